"""Closed-loop replay: the engine model schedules while the tier sets its clock (docs/replay.md).

Open-loop replay (``--schedule recorded``) keeps every recorded step and only stretches the
timeline. Here the engine model that recorded the trace (kvemu.engine: continuous batching, token
budget, chunked prefill, prefix cache, HBM capacity and eviction, tier policy) runs again, step by
step: each step is planned from the engine's state at its start, its KV operations are replayed
through the backend (measured or emulated), and the step's end as the backend timed it becomes the
engine's clock. Requests that arrived by then join the next step, so a slower tier changes the
batches, and a window of requests is replayed with everything before it (its history).

Steps that move no KV (decodes under ``offload``) and stream no weights take their modelled compute
and do not call C;
C keeps the async store stream across calls, and every call starts at the engine's clock.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections import deque
from dataclasses import dataclass, fields

import numpy as np

from .engine.blocks import BlockTables
from .engine.pool import BlockPool, TierCache
from .engine.scheduler import ENGINE_MODEL, IDLE_NS, EngineConfig, EngineLog, engine_steps
from .analysis import timing_from_meta
from .engine.timing import GpuTiming
from .errors import ConfigError, TraceError
from .schema import OPS

SCHEDULES = ("closed", "recorded")
#: Where a prefix from the tier is loaded: inside the request's first prefill step, or asynchronously.
KV_LOADS = ("in-step", "async")
#: How closed-loop replay routes requests to instances (Router).
ROUTING = ("round-robin", "least-loaded", "prefix-aware")
# Entries the closed loop holds before folding them into the results' sums.
FOLD_ROWS = 1 << 16
_STEP_FIELDS = ("start", "compute", "end", "step_ns", "load", "store", "read", "stall")
_OP_COLUMNS = tuple(f"{op}_{k}" for op in OPS for k in ("first", "count"))


@dataclass
class EngineInputs:
    tables: BlockTables
    arrival_ns: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    timing: GpuTiming
    cfg: EngineConfig


def schedule_source(meta: dict) -> dict:
    """Whether a trace's schedule can be re-planned, and why (not): the trace's ``schedule`` object
    (v2; read_header derives it for v1). Traces of real runs hold what happened; traces the engine
    model recorded hold what it needs to schedule again."""
    return meta["schedule"]


def engine_inputs(trace, time_scale: float = 1.0) -> EngineInputs:
    """The engine model's inputs, rebuilt from a trace the engine model recorded."""
    meta = trace.header.meta
    src = schedule_source(meta)
    if not src["closed_loop"]:
        raise ConfigError(f"{trace.header.path}: closed-loop replay needs a trace the engine model recorded "
                          f"({src['why']}); use --schedule recorded")
    if src.get("engine_model", ENGINE_MODEL) != ENGINE_MODEL:
        raise ConfigError(f"{trace.header.path}: recorded by engine model {src.get('engine_model')}, this kvemu "
                          f"runs {ENGINE_MODEL}; use --schedule recorded")
    try:
        eng = meta["engine"]
        cfg = EngineConfig(**{f.name: eng[f.name] for f in fields(EngineConfig) if f.name in eng})
        timing = timing_from_meta(meta)
    except (KeyError, TypeError, TraceError) as e:
        raise ConfigError(f"{trace.header.path}: the engine metadata is incomplete for closed-loop replay ({e}); "
                          f"use --schedule recorded") from None
    cfg.check()
    tpb = cfg.tokens_per_block
    shared_space = int(meta["blocks"].get("shared_id_space", 0))
    inp = trace.input_tokens.astype(np.int64)
    # only full input blocks are shareable, and only where the workload named its prefixes
    n_full = inp // tpb if shared_space > 0 else np.zeros(len(inp), np.int64)
    tables = BlockTables(tpb, trace.table_offsets, trace.table_ids, n_full, shared_space,
                         int(meta["blocks"]["id_space"]))
    arrival_ns = np.round(trace.arrival_ms * time_scale * 1e6).astype(np.int64)
    return EngineInputs(tables, arrival_ns, inp, trace.output_tokens.astype(np.int64), timing, cfg)


def chunk_keys(inputs: EngineInputs, chunk_blocks: int, requests: np.ndarray | None = None):
    """Every block the tier may hold, by the chunk it moves in: (``key_of``, ``off_of``, held),
    ``key_of[id]`` the id of the block at its chunk's first position (a prefix id names the
    whole prefix, so requests sharing a block share its chunk), and which blocks the tier may hold
    (a bool per block id). Under ``offload`` the tier holds full input blocks, under
    ``resident`` every block, of the ``requests`` a boolean mask selects (default all); ``None``
    arrays with chunks of one block."""
    t, cfg = inputs.tables, inputs.cfg
    lens = np.diff(t.offsets)
    # offload stores every input block that fills up (shareable or not); resident keeps every block
    keep_len = np.minimum(inputs.input_tokens // cfg.tokens_per_block, lens) if cfg.tier_policy == "offload" else lens
    if cfg.tier_policy == "none":
        keep_len = np.zeros_like(lens)
    if requests is not None:
        keep_len = np.where(requests, keep_len, 0)
    req = np.repeat(np.arange(len(lens)), keep_len)
    pos = np.arange(int(keep_len.sum()), dtype=np.int64) - np.repeat(np.cumsum(keep_len) - keep_len, keep_len)
    at = t.offsets[:-1][req] + pos
    ids = t.ids[at]
    present = np.zeros(t.id_space, bool)
    present[ids] = True
    if chunk_blocks <= 1:
        return None, None, present
    key_of = np.zeros(t.id_space, np.int64 if t.id_space >= 2**31 else np.int32)
    off_of = np.zeros(t.id_space, np.uint16)
    off = pos % chunk_blocks
    key_of[ids] = t.ids[at - off]
    off_of[ids] = off
    return key_of, off_of, present


class ClosedLoop:
    """Runs the engine model with one instance's backend; what happened goes into ``acc``
    (replay.accumulate.Accumulator), folded every FOLD_ROWS entries. With a ``router`` the
    instance is one of several: its requests come from the router's inbox, and it tells the router
    when each step ends and which requests finished. With a ``queue`` (TierQueue) its KV traffic
    shares one emulated tier with the other instances'."""

    def __init__(self, inputs: EngineInputs, acc, selected: np.ndarray, router=None, instance: int = 0,
                 tier=None, queue=None, block_bytes_all_layers: int = 0, load_stream=None):
        self.inputs, self.acc, self.selected = inputs, acc, selected
        # async loads (vLLM's asynchronous KV loading) go through this second backend context on the
        # same tier, with a timeline of its own: the load stream
        self.load_stream = load_stream
        self.bg_loads = 0
        self.router, self.instance, self.tier, self.queue = router, instance, tier, queue
        self.block_bytes = block_bytes_all_layers
        self.log = EngineLog(len(inputs.input_tokens))
        self.buf = {k: array("q") for k in _STEP_FIELDS}
        self.kv_rows: list = []       # (absolute entry rows, their C entry_out) of steps that called C
        self.step_base = 0            # engine step of buf's first step
        self.c_steps = 0
        self.end_ns = 0
        self.queued_ns = 0            # time steps waited for the shared tier (TierQueue)
        self.finished = 0

    def run(self, backend, progress=None, stop=None) -> dict:
        i, router, me = self.inputs, self.router, self.instance
        inbox = None if router is None else router.inbox[me]
        gen = engine_steps(i.tables, i.arrival_ns, i.input_tokens, i.output_tokens, i.timing, i.cfg, self.log,
                           progress=progress if router is None else None,
                           stop_after=self.selected if router is None else None, inbox=inbox, tier=self.tier,
                           async_loads=self.load_stream is not None)
        log, buf, acc = self.log, self.buf, self.acc
        one = np.zeros(1, np.int64)
        b_start, b_comp, b_end, b_d = buf["start"], buf["compute"], buf["end"], buf["step_ns"]
        b_load, b_store, b_read, b_stall = buf["load"], buf["store"], buf["read"], buf["stall"]
        try:
            plan = next(gen)
            while plan is not None:
                if stop is not None and stop.is_set():
                    break
                start, comp, r0, r1, kv = plan
                if comp == IDLE_NS:
                    wake = router.park(me, kv)
                    plan = gen.send(wake) if wake is not None else None
                    continue
                if log.bg_loads:
                    self._issue_loads(start)
                wblocks = None if acc.weights is None else acc.weights.blocks(log.new_tokens)
                if kv or (wblocks is not None and wblocks[0]):
                    lo, hi = r0 - log.taken, r1 - log.taken
                    cols = log.cols
                    e = {k: np.frombuffer(cols[k][lo:hi], np.int32) for k in ("request_id", *_OP_COLUMNS)}
                    live = np.flatnonzero((e["load_count"] > 0) | (e["store_count"] > 0) | (e["read_count"] > 0))
                    e = {k: v[live] for k, v in e.items()}
                    e["step"] = np.zeros(len(live), np.int32)
                    so, eo, _ = acc.c_call(backend, e, one, np.array([comp], np.int64), np.array([start], np.int64),
                                           wblocks)
                    s = so[0]
                    end, d, stall = int(s["end_ns"]), int(s["step_ns"]), int(s["stall_ns"])
                    if self.queue is not None:
                        wait = self.queue.serve(start, e, self.block_bytes)
                        end, d, stall = end + wait, d + wait, stall + wait
                        self.queued_ns += wait
                    b_d.append(d); b_load.append(int(s["load_ns"])); b_store.append(int(s["store_ns"]))
                    b_read.append(int(s["read_ns"])); b_stall.append(stall)
                    b_start.append(int(s["start_ns"]))
                    self.kv_rows.append((live + r0, eo))
                    self.c_steps += 1
                else:
                    end = start + comp
                    b_d.append(comp); b_load.append(0); b_store.append(0); b_read.append(0); b_stall.append(0)
                    b_start.append(start)
                b_comp.append(comp)
                b_end.append(end)
                self.end_ns = end
                if r1 - log.taken >= FOLD_ROWS:
                    self._fold()
                self.finished += len(log.done)
                if router is not None:
                    router.complete(me, [r.rid for r in log.done], end)
                    if not router.advance(me, end):
                        break
                plan = gen.send(end)
        except StopIteration:
            pass
        finally:
            if router is not None:
                router.leave(me)
        self._fold()
        resident = self.inputs.cfg.tier_policy == "resident"
        pool, tier = log.pool, log.tier
        return {"steps": self.step_base, "c_steps": self.c_steps, "end_ns": self.end_ns, "finished": self.finished,
                "async_loads": self.bg_loads,
                "hbm_evictions": 0 if resident or pool is None else pool.evictions,
                "tier_evictions": (pool.evictions if resident and pool is not None else
                                   tier.evictions if tier is not None else 0),
                "entries": log.rows(), "queued_ns": self.queued_ns}

    def _issue_loads(self, start: int) -> None:
        """The loads the engine issued at ``start``, on the load stream (one C call, a step each, in
        issue order): when each is done goes back to the engine; their times go to the requests."""
        log, acc = self.log, self.acc
        loads = log.bg_loads
        log.bg_loads = []
        k = len(loads)
        rid = np.array([x[0] for x in loads], np.int64)
        zeros = np.zeros(k, np.int32)
        e = {"request_id": rid.astype(np.int32), "load_first": np.array([x[1] for x in loads], np.int32),
             "load_count": np.array([x[2] for x in loads], np.int32), "store_first": zeros, "store_count": zeros,
             "read_first": zeros, "read_count": zeros, "step": np.arange(k, dtype=np.int32)}
        so, eo, _ = acc.c_call(self.load_stream, e, np.arange(k, dtype=np.int64), np.zeros(k, np.int64),
                               np.full(k, start, np.int64))
        for r, done in zip(rid.tolist(), so["end_ns"].tolist()):
            log.load_done[r] = int(done)
        np.add.at(acc.req_kv["load"], rid, eo["load_ns"])
        np.add.at(acc.req_blocks["load"], rid, e["load_count"].astype(np.int64))
        acc.kv_total_ns["load"] += int(so["load_ns"].sum())
        np.minimum.at(acc.first_start, rid, start)   # admitted now: the queue ends here
        self.bg_loads += k

    def _fold(self) -> None:
        from .backends import ENTRY_OUT_DTYPE, STEP_OUT_DTYPE

        buf = self.buf
        n_steps = len(buf["end"])
        if n_steps == 0:
            return
        taken0 = self.log.taken
        e = self.log.take_entries()
        step_out = np.zeros(n_steps, STEP_OUT_DTYPE)
        for name, f in (("start_ns", "start"), ("end_ns", "end"), ("step_ns", "step_ns"), ("load_ns", "load"),
                        ("store_ns", "store"), ("read_ns", "read"), ("stall_ns", "stall")):
            step_out[name] = np.frombuffer(buf[f], np.int64)
        compute = np.frombuffer(buf["compute"], np.int64).copy()
        entry_out = np.zeros(len(e["step"]), ENTRY_OUT_DTYPE)
        for rows, eo in self.kv_rows:
            entry_out[rows - taken0] = eo
        counts = {op: e[f"{op}_count"].astype(np.int64) for op in OPS}
        of_entry = e["step"].astype(np.int64) - self.step_base
        self.acc.fold(e["request_id"].astype(np.int64), e["phase"], of_entry, compute, step_out, entry_out, counts)
        self.step_base += n_steps
        self.kv_rows = []
        for a in buf.values():
            del a[:]


class Router:
    """Routes arriving requests to N instances, each running its own engine, in arrival order and
    at the time they arrive; keeps the instances' clocks in step so that every decision sees the
    state at that time.

    An arrival at time T is routed once every instance's clock (the end of its last step, when it
    plans the next) is at least T, or the instance is idle. An instance plans a step at t once every
    arrival up to t is routed. With ``lockstep`` only the instance with the earliest clock plans
    (emulated and virtual tiers: the order of steps is then that of the timeline, and the shared
    tier's queue is served in time order); otherwise instances run concurrently, as real tiers are
    accessed, and wait only for the routing.

    Policies: ``round-robin`` (the k-th arrival to instance k mod N); ``least-loaded`` (the fewest
    requests routed and not finished at T; ties to the lowest index); ``prefix-aware`` (as
    Mooncake's conductor: the instance where the request's uncached blocks plus the work queued
    there are least, a block counting as cached on an instance that was routed a request holding
    it, whether or not that instance has evicted it since, and each queued request as an average
    request's blocks).
    """

    def __init__(self, n: int, inputs: EngineInputs, policy: str, selected: np.ndarray, lockstep: bool):
        if policy not in ROUTING:
            raise ConfigError(f"--routing must be one of {', '.join(ROUTING)}, got {policy!r}")
        self.n, self.policy, self.lockstep = n, policy, lockstep
        self.arrival = inputs.arrival_ns.tolist()
        self.tables = inputs.tables
        self.n_full = inputs.tables.n_full_input.tolist()
        self.cond = threading.Condition()
        self.clock = [0] * n
        self.parked = [False] * n
        self.sleeping = [False] * n   # idle until a deadline (an async load), or until a request comes
        self.gone = [False] * n
        self.wake: list = [None] * n
        self.inbox = [deque() for _ in range(n)]
        self.k = 0
        self.owner = np.full(len(self.arrival), -1, np.int32)
        self.routed = [0] * n
        self.completed: list[list[int]] = [[] for _ in range(n)]   # completion times, sorted
        self.selected = selected.tolist()
        self.selected_left = int(np.count_nonzero(selected))
        self.home: dict = {}         # prefix-aware: block id -> bit mask of the instances routed it
        self.blocks_seen = self.requests_seen = 0
        self.failed = False

    # -- called by the instances' threads
    def advance(self, i: int, t: int) -> bool:
        """Instance i plans its next step at t: wait until that is allowed. False: stop."""
        with self.cond:
            self.clock[i] = t
            self._route()
            self.cond.notify_all()
            while not self._done() and not self._may_plan(i, t):
                self.cond.wait(0.2)
            return not self._done()

    def park(self, i: int, deadline=None):
        """Instance i has nothing to do: wait for a request routed to it (wake at its arrival) or,
        given a deadline (an async load done then), until then at the latest. None: the end."""
        with self.cond:
            if deadline is None:
                self.parked[i] = True
            else:
                self.sleeping[i] = True
                self.clock[i] = self.wake[i] = int(deadline)
            self._route()
            self.cond.notify_all()
            while not self._done() and self.parked[i]:
                if self.k >= len(self.arrival) and all(self.parked[j] or self.gone[j] for j in range(self.n)):
                    self.cond.notify_all()
                    return None
                self.cond.wait(0.2)
            if self._done():
                return None
            while not self._done() and not self._may_plan(i, self.wake[i]):
                self.cond.wait(0.2)
            self.sleeping[i] = False
            return None if self._done() else self.wake[i]

    def complete(self, i: int, rids, t: int) -> None:
        with self.cond:
            for r in rids:
                bisect.insort(self.completed[i], t)
                if self.selected[r]:
                    self.selected_left -= 1
            if self.selected_left <= 0:
                self.cond.notify_all()

    def leave(self, i: int) -> None:
        with self.cond:
            self.gone[i] = True
            self.parked[i] = True
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    # -- inside the lock
    def _done(self) -> bool:
        return self.failed or self.selected_left <= 0

    def _horizon(self) -> float:
        live = [self.clock[j] for j in range(self.n) if not self.parked[j]]
        return min(live) if live else float("inf")

    def _may_plan(self, i: int, t: int) -> bool:
        if self.k < len(self.arrival) and self.arrival[self.k] <= t:
            return False  # an arrival up to t is not routed yet
        if not self.lockstep:
            return True
        return all(self.parked[j] or (self.clock[j], j) >= (t, i) for j in range(self.n))

    def _route(self) -> None:
        while self.k < len(self.arrival) and self.arrival[self.k] <= self._horizon():
            r, t = self.k, self.arrival[self.k]
            j = self._choose(r, t)
            self.owner[r] = j
            self.routed[j] += 1
            self.inbox[j].append(r)
            if (self.parked[j] or (self.sleeping[j] and t < self.clock[j])) and not self.gone[j]:
                self.parked[j] = False
                self.clock[j] = t
                self.wake[j] = t
            self.k += 1

    def _load(self, j: int, t: int) -> int:
        return self.routed[j] - bisect.bisect_right(self.completed[j], t)

    def _choose(self, r: int, t: int) -> int:
        live = [j for j in range(self.n) if not self.gone[j]] or list(range(self.n))
        if self.policy == "round-robin":
            return live[r % len(live)]
        if self.policy == "least-loaded":
            return min(live, key=lambda j: (self._load(j, t), j))
        t_ids = self.tables.ids[self.tables.offsets[r]:self.tables.offsets[r] + self.n_full[r]].tolist()
        hit = {}
        home = self.home
        for j in live:
            bit, n_hit = 1 << j, 0
            for b in t_ids:
                if not home.get(b, 0) & bit:
                    break
                n_hit += 1
            hit[j] = n_hit
        # Mooncake's conductor weighs the prefix an instance holds against the work queued there: the
        # blocks this request must compute on j, plus the requests j already has, each an average
        # request's blocks of work
        self.blocks_seen += len(t_ids)
        self.requests_seen += 1
        avg = self.blocks_seen / self.requests_seen
        j = min(live, key=lambda j: (len(t_ids) - hit[j] + self._load(j, t) * avg, j))
        bit = 1 << j
        for b in t_ids:
            home[b] = home.get(b, 0) | bit
        return j


class TierQueue:
    """One emulated tier shared by several instances, as a FIFO queue at step granularity: a step's
    KV bytes (all layers) occupy the tier for bytes / bandwidth from when it is free; a step that
    loads or reads waits until the traffic queued before it has passed. The C model already charges
    each step its own medium time, so the queue adds only the wait for earlier traffic. Steps are
    served in timeline order (the router's lockstep)."""

    def __init__(self, bandwidth_gbps: float):
        self.gbps = float(bandwidth_gbps)
        self.free_ns = 0.0
        self.lock = threading.Lock()
        self.bytes = 0
        self.waited_ns = 0

    def serve(self, start: int, e: dict, block_bytes_all_layers: int) -> int:
        blocks = {op: int(e[f"{op}_count"].sum()) for op in OPS}
        nbytes = sum(blocks.values()) * block_bytes_all_layers
        critical = blocks["load"] + blocks["read"] > 0
        with self.lock:
            wait = max(0.0, self.free_ns - start) if critical else 0.0
            self.free_ns = max(self.free_ns, float(start)) + nbytes / self.gbps
            self.bytes += nbytes
            self.waited_ns += int(round(wait))
        return int(round(wait))


def shared_tier(cfg: EngineConfig, sharing: str, n: int) -> list:
    """The engine-side tier of each of n instances: one shared TierCache (offload) or block pool
    (resident) for a shared tier, one each when replicated; None each when the policy has no tier."""
    def make():
        if cfg.tier_policy == "offload":
            return TierCache(cfg.tier_capacity_blocks)
        if cfg.tier_policy == "resident":
            return BlockPool(cfg.tier_capacity_blocks)
        return None
    if sharing == "shared":
        one = make()
        return [one] * n
    return [make() for _ in range(n)]
