"""The serving-engine model: continuous batching with chunked prefill and a prefix cache, as vLLM
schedules, plus a KV tier policy. It produces the step-by-step batch composition and the KV
operations each request performs; it does no I/O itself.

Per step: every decoding request gets one token; the remaining token budget goes to requests
still in prefill (oldest first, chunked), then to new requests in arrival order while the budget,
the sequence limit and KV capacity allow (first come, first served: the head of the queue blocks
the rest, as in vLLM's FCFS policy).

Tier policies:
- ``none``: HBM prefix cache only; no tier traffic.
- ``offload``: write-through. Every newly computed full input block is stored to the tier; on
  admission, a prefix that misses in HBM but hits in the tier is loaded back (LMCache / Mooncake
  style). Decode reads KV in HBM.
- ``resident``: KV lives in the tier (the memory-pool argument). Prefill stores every block that
  fills up and reads the earlier context from the tier; decode reads the whole context from the tier
  every step and stores a block each time one fills. A prefix hit in the tier is reused in place.
  The GPU time model then charges HBM traffic for the new tokens' KV only: the context is read
  from the tier, and that time is what replay measures.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import ConfigError
from .blocks import BlockTables
from .pool import BlockPool, TierCache
from .timing import GpuTiming

TIER_POLICIES = ("none", "offload", "resident")
#: This scheduler's name and version: traces record it, closed-loop replay checks it. Bump it when a
#: change makes the same inputs schedule differently.
ENGINE_MODEL = "kvemu.engine/1"


@dataclass(frozen=True)
class EngineConfig:
    tokens_per_block: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    tier_policy: str = "offload"
    hbm_kv_blocks: int | None = None  # None: unbounded
    tier_capacity_blocks: int | None = None  # None: unbounded
    # The offload transfer unit (LMCache's 256-token chunks); replay moves a chunk's blocks of one
    # layer as one transfer. Recorded so that replay uses what the engine would.
    transfer_chunk_tokens: int = 256
    # How a transfer lays KV out: one layer of a chunk per transfer (per-layer), or a chunk's blocks
    # of every layer contiguous, moved as one (cross-layer, vLLM's offloading layout since 2025).
    kv_layout: str = "per-layer"

    def check(self) -> None:
        if self.tier_policy not in TIER_POLICIES:
            raise ConfigError(f"unknown tier policy '{self.tier_policy}' (known: {', '.join(TIER_POLICIES)})")
        if self.tokens_per_block <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("--block-tokens and --max-num-seqs must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("--max-batched-tokens must be at least --max-num-seqs (every decode needs a token)")
        if self.tier_policy == "none" and self.tier_capacity_blocks is not None:
            raise ConfigError("--tier-capacity-gib has no effect with --tier-policy none")
        for name in ("hbm_kv_blocks", "tier_capacity_blocks"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be positive")

    def to_dict(self) -> dict:
        return asdict(self)


class _Running:
    __slots__ = ("rid", "table", "inp", "out", "n_full", "computed", "generated", "n_reg", "reserved",
                 "load_first", "load_count", "load_done")

    def __init__(self, rid, table, inp, out, n_full):
        self.rid, self.table, self.inp, self.out, self.n_full = rid, table, inp, out, n_full
        self.generated = 0
        self.load_first = self.load_count = 0


@dataclass
class EngineRun:
    cached_tokens: np.ndarray
    tier_hit_tokens: np.ndarray
    step_start_ns: np.ndarray
    step_compute_ns: np.ndarray
    entries: dict  # column name -> numpy array
    stats: dict
    step_busy_ns: np.ndarray | None = None  # with weights in the tier: compute and weight stream composed


ENTRY_FIELDS = ("step", "request_id", "phase", "tokens", "context_tokens", "load_first", "load_count",
                "store_first", "store_count", "read_first", "read_count")


class EngineLog:
    """What the engine decided, as it decides it: one row per batch entry (a request in a step) in
    ``cols`` (array('i') per trace column), per-request prefix hits, and the statistics.
    ``take_entries`` hands the rows over and starts afresh (closed-loop replay folds them in as it
    goes, so memory stays bounded)."""

    def __init__(self, n: int):
        self.cols = {k: array("i") for k in ENTRY_FIELDS}
        self.cached = np.zeros(n, np.int64)
        self.tier_hit = np.zeros(n, np.int64)
        self.stats: dict = {}
        self.taken = 0  # rows handed over before the current ones
        self.done: list = []    # the last planned step's finished requests (_Running)
        self.pool = self.tier = None
        self.new_tokens = 0     # the last planned step's new tokens

    def rows(self) -> int:
        return self.taken + len(self.cols["step"])

    def take_entries(self) -> dict:
        out = {k: np.frombuffer(v, dtype=np.int32).copy() if len(v) else np.zeros(0, np.int32)
               for k, v in self.cols.items()}
        self.taken += len(self.cols["step"])
        self.cols = {k: array("i") for k in ENTRY_FIELDS}
        return out


#: What engine_steps yields, in place of a step, when it has nothing to do and takes its arrivals
#: from an inbox: the caller sends back when to wake (or None to end).
IDLE_NS = -1


def engine_steps(tables: BlockTables, arrival_ns, input_tokens, output_tokens, timing: GpuTiming,
                 cfg: EngineConfig, log: EngineLog, progress=None, stop_after=None, inbox=None, tier=None,
                 async_loads: bool = False):
    """The scheduler as a coroutine: it plans one step at a time and waits to be told when that
    step ended.

    Yields ``(start_ns, compute_ns, entry_begin, entry_end, kv_ops)`` per step: the step's start
    on the engine's clock, its modelled GPU compute, its rows in ``log`` (counted over every row
    the log ever held) and whether any of them moves KV. The caller ``send``s back the step's end
    time, which becomes the engine's clock: ``start + compute`` when only compute counts
    (recording), or whatever the tier made of the step (closed-loop replay). Arrivals up to the
    clock are admitted before the next step is planned, so a slower tier changes the batches.
    ``stop_after``: a boolean array; the engine stops once every request it marks has finished.

    ``inbox`` (a deque): the engine is one of several instances, and a router puts the requests
    routed to it there, each once it has arrived; the engine takes them before planning each step.
    With nothing to do it yields ``(now, IDLE_NS, row, row, deadline)`` and waits for the time to
    wake (or None: no request will come, the engine ends); ``deadline`` is when its first
    asynchronous load is done (None without one): it must wake by then. ``tier``: the offload tier's cache (TierCache)
    or, under ``resident``, the block pool, shared with other instances (default: its own).
    Each step's finished requests are in ``log.done`` until the next step is planned.

    ``async_loads`` (vLLM's asynchronous KV loading, WAITING_FOR_REMOTE_KVS): a request admitted
    with a prefix in the tier does not join a batch; its load is issued when the step that admitted
    it starts, on a stream of its own, and ``log.bg_loads`` lists ``(request, first, count)`` for
    the caller, which puts when each load is done in ``log.load_done`` before it sends the step's
    end. The request then waits, holding its blocks but no sequence slot or token budget, and joins
    the prefills of the first step planned at or after that time; running requests go on meanwhile.
    Without it, the load is part of the request's first prefill step (the trace's way).
    """
    cfg.check()
    n = len(input_tokens)
    tpb = cfg.tokens_per_block
    policy = cfg.tier_policy
    arrival_ns = np.asarray(arrival_ns, np.int64).tolist()
    inp_l = np.asarray(input_tokens, np.int64).tolist()
    out_l = np.asarray(output_tokens, np.int64).tolist()
    offsets = tables.offsets.tolist()
    n_full_l = tables.n_full_input.tolist()
    ids = tables.ids
    remaining = n if stop_after is None else int(np.count_nonzero(stop_after))
    watch = None if stop_after is None else np.asarray(stop_after, bool).tolist()

    resident = policy == "resident"
    if resident:
        pool = tier if tier is not None else BlockPool(cfg.tier_capacity_blocks)
        tier = None
    else:
        pool = BlockPool(cfg.hbm_kv_blocks)
        tier = (tier if tier is not None else TierCache(cfg.tier_capacity_blocks)) if policy == "offload" else None
    log.pool, log.tier = pool, tier

    cached, tier_hit = log.cached, log.tier_hit
    cols = log.cols

    waiting: deque[int] = deque()
    prefilling: list[_Running] = []
    decoding: list[_Running] = []
    loading: list[_Running] = []    # async loads in flight
    log.bg_loads, log.load_done = [], {}
    load_done = log.load_done
    next_arrival = 0
    finished = 0
    now = 0
    step = 0
    max_tokens, max_seqs = cfg.max_num_batched_tokens, cfg.max_num_seqs
    step_ns = timing.step_ns

    def admit(rid: int) -> _Running | None:
        lo, hi = offsets[rid], offsets[rid + 1]
        table = ids[lo:hi].tolist()
        r = _Running(rid, table, inp_l[rid], out_l[rid], n_full_l[rid])
        limit = min((r.inp - 1) // tpb, r.n_full)  # always compute at least one token
        h, idle = pool.prefix_hit(table, 0, limit)
        t = tier.prefix_hit(table, h, limit) if tier is not None else 0
        need = len(table) - h
        if not pool.can_hold(need, idle):
            return None
        pool.pin(table[:h])
        pool.reserve(need)
        r.reserved = need
        if t:
            tier.touch(table[h : h + t])
            pool.register(table[h : h + t])  # loaded into HBM during this step
            r.reserved -= t
            r.load_first, r.load_count = h, t
        r.n_reg = h + t
        r.computed = (h + t) * tpb
        cached[rid] = r.computed
        tier_hit[rid] = (h if resident else t) * tpb
        return r

    def finish(r: _Running) -> None:
        pool.release(r.table[: r.n_reg], r.reserved)

    while remaining > 0 and (finished < n or inbox is not None):
        cols = log.cols  # take_entries may have swapped them between steps
        c_step, c_rid, c_phase, c_tok, c_ctx = (cols[k] for k in ("step", "request_id", "phase", "tokens",
                                                                  "context_tokens"))
        c_lf, c_lc, c_sf, c_sc, c_rf, c_rc = (cols[k] for k in ("load_first", "load_count", "store_first",
                                                                "store_count", "read_first", "read_count"))
        if loading:
            still = []
            for r in loading:
                if load_done[r.rid] <= now:
                    del load_done[r.rid]
                    prefilling.append(r)
                else:
                    still.append(r)
            loading = still
        if inbox is None:
            while next_arrival < n and arrival_ns[next_arrival] <= now:
                waiting.append(next_arrival)
                next_arrival += 1
            if not prefilling and not decoding and not waiting:
                # idle until the next arrival or the first async load done, whichever comes first
                soonest = min(load_done[r.rid] for r in loading) if loading else None
                now = (arrival_ns[next_arrival] if soonest is None or (next_arrival < n and arrival_ns[next_arrival] <= soonest)
                       else soonest)
                continue
        else:
            while inbox:
                waiting.append(inbox.popleft())
            if not prefilling and not decoding and not waiting:
                # nothing to run: sleep until a request is routed here, or the first load is done
                log.done = []
                row = log.rows()
                wake = yield now, IDLE_NS, row, row, (min(load_done[r.rid] for r in loading) if loading else None)
                if wake is None:
                    break
                now = max(now, int(wake))
                continue
        row0 = log.rows()
        budget = max_tokens
        tok_sum = 0
        pair_sum = 0.0
        touched = 0
        kv_ops = False
        done_now: list[_Running] = []

        # 1. decodes: one token each, attending to the whole context
        for r in decoding:
            ctx = r.inp + r.generated - 1
            c_step.append(step); c_rid.append(r.rid); c_phase.append(1); c_tok.append(1); c_ctx.append(ctx)
            c_lf.append(0); c_lc.append(0)
            if resident:
                full_after = (ctx + 1) // tpb
                if full_after * tpb == ctx + 1:
                    c_sf.append(full_after - 1); c_sc.append(1)
                else:
                    c_sf.append(0); c_sc.append(0)
                c_rf.append(0); c_rc.append(ctx // tpb)
                kv_ops = kv_ops or ctx >= tpb or full_after * tpb == ctx + 1
            else:
                c_sf.append(0); c_sc.append(0); c_rf.append(0); c_rc.append(0)
            pair_sum += ctx + 1.0
            touched += 1 if resident else ctx + 1
            r.generated += 1
            if r.generated == r.out:
                done_now.append(r)
        n_dec = len(decoding)
        budget -= n_dec
        tok_sum += n_dec

        # 2. prefill chunks of running requests, then 3. new admissions
        def chunk(r: _Running) -> None:
            nonlocal budget, tok_sum, pair_sum, touched, kv_ops
            ctx = r.computed
            k = min(r.inp - ctx, budget)
            p0, p1 = ctx // tpb, (ctx + k) // tpb  # blocks that fill up in this chunk
            c_step.append(step); c_rid.append(r.rid); c_phase.append(0); c_tok.append(k); c_ctx.append(ctx)
            c_lf.append(r.load_first); c_lc.append(r.load_count)
            kv_ops = kv_ops or r.load_count > 0 or (resident and ctx >= tpb)
            r.load_count = 0
            if p1 > p0:
                new = r.table[p0:p1]
                pool.register(new)
                r.reserved -= p1 - p0
                r.n_reg = p1
                if policy != "none":
                    c_sf.append(p0); c_sc.append(p1 - p0)
                    kv_ops = True
                    if tier is not None:
                        tier.add(new)
                else:
                    c_sf.append(0); c_sc.append(0)
            else:
                c_sf.append(0); c_sc.append(0)
            c_rf.append(0); c_rc.append(ctx // tpb if resident else 0)
            budget -= k
            tok_sum += k
            pair_sum += k * (ctx + (k + 1) / 2)
            touched += k if resident else ctx + k
            r.computed = ctx + k

        for r in prefilling:
            if budget <= 0:
                break
            chunk(r)
        seqs = len(decoding) + len(prefilling)
        while waiting and budget > 0 and seqs < max_seqs:
            r = admit(waiting[0])
            if r is None:
                if not prefilling and not decoding:
                    rid = waiting[0]
                    need = offsets[rid + 1] - offsets[rid]
                    raise ConfigError(
                        f"request {rid} needs {need} KV blocks but the {'tier' if resident else 'HBM'} pool "
                        f"holds {pool.capacity}; raise the capacity or use a smaller model/workload"
                    )
                break
            waiting.popleft()
            if async_loads and r.load_count:
                loading.append(r)
                log.bg_loads.append((r.rid, r.load_first, r.load_count))
                r.load_count = 0
                continue
            prefilling.append(r)
            seqs += 1
            chunk(r)

        # move completed prefills to decode; retire finished requests
        still = []
        for r in prefilling:
            if r.computed == r.inp:
                r.generated = 1
                if r.out == 1:
                    done_now.append(r)
                else:
                    decoding.append(r)
            else:
                still.append(r)
        prefilling = still
        log.done = done_now
        if done_now:
            gone = set()
            for r in done_now:
                finish(r)
                gone.add(r.rid)
                if watch is not None and watch[r.rid]:
                    remaining -= 1
            decoding = [r for r in decoding if r.rid not in gone]
            finished += len(done_now)
            if watch is None:
                remaining -= len(done_now)
        t = step_ns(tok_sum, pair_sum, touched, n_dec)
        log.new_tokens = tok_sum  # the step's new tokens: what its weights in the tier stream (weights.py)
        now = yield now, t, row0, log.rows(), kv_ops
        step += 1
        if progress is not None and step % 512 == 0:
            progress(finished)

    log.stats.update({
        "steps": step,
        "entries": log.rows(),
        "hbm_evictions": 0 if resident else pool.evictions,
        "tier_evictions": (pool.evictions if resident else (tier.evictions if tier else 0)),
        "makespan_ns": now,
        "finished": finished,
    })


def simulate(tables: BlockTables, arrival_ms, input_tokens, output_tokens, timing: GpuTiming,
             cfg: EngineConfig, progress=None, weights=None) -> EngineRun:
    """The engine on its own clock: every step takes its modelled compute time (recording), and with
    ``weights`` (engine.weights.WeightPlacement) its weight stream composed with it; ``step_compute_ns``
    stays the GPU compute, the step starts show the stream."""
    n = len(input_tokens)
    arrival_ns = np.round(np.asarray(arrival_ms, np.float64) * 1e6).astype(np.int64)
    log = EngineLog(n)
    step_start = array("q")
    step_compute = array("q")
    step_busy = array("q")
    gen = engine_steps(tables, arrival_ns, input_tokens, output_tokens, timing, cfg, log, progress)
    try:
        start, t, _, _, _ = next(gen)
        while True:
            step_start.append(start)
            step_compute.append(t)
            d = t if weights is None else weights.step_ns(t, log.new_tokens)
            step_busy.append(d)
            start, t, _, _, _ = gen.send(start + d)
    except StopIteration:
        pass
    stats = {k: log.stats[k] for k in ("steps", "entries", "hbm_evictions", "tier_evictions", "makespan_ns")}
    return EngineRun(log.cached, log.tier_hit, np.frombuffer(step_start, np.int64).copy(),
                     np.frombuffer(step_compute, np.int64).copy(), log.take_entries(), stats,
                     None if weights is None else np.frombuffer(step_busy, np.int64).copy())
