"""One instance's closed loop (ClosedLoop): the engine's step plans run through the backend, the
backend's step ends sent back as the engine's clock, what happened folded into the instance's
Accumulator."""

from __future__ import annotations

from array import array

import numpy as np

from ...backends import ENTRY_OUT_DTYPE, STEP_OUT_DTYPE
from ...engine.scheduler import (DecodeRun, EngineLog, Idle, RunOutcome, StepOutcome, StepPlan, engine_caches,
                                 engine_steps)
from ...schema import OPS
from .inputs import EngineInputs

# Entries the closed loop holds before folding them into the results' sums.
FOLD_ROWS = 1 << 16
_STEP_FIELDS = ("start", "compute", "end", "step_ns", "load", "store", "read", "stall")
_OP_COLUMNS = tuple(f"{op}_{k}" for op in OPS for k in ("first", "count"))


class ClosedLoop:
    """Runs the engine model with one instance's backend; what happened goes into ``acc``
    (replay.accumulate.Accumulator), folded every FOLD_ROWS entries. With a ``router`` the
    instance is one of several: its requests come from the router's inbox, and it tells the router
    when each step ends and which requests finished. With a ``queue`` (TierQueue) its KV traffic
    shares one emulated tier with the other instances'."""

    def __init__(self, inputs: EngineInputs, acc, selected: np.ndarray, router=None, instance: int = 0,
                 tier=None, queue=None, block_bytes_all_layers: int = 0, load_stream=None, lower=None,
                 level_queues=None, present=None, stores_done=None, chunked_prefill=True, release=None):
        self.inputs, self.acc, self.selected = inputs, acc, selected
        # a tier stack (replay.stack): ``tier`` is the TierStack, ``lower`` the contexts of its levels
        # below the top (LowerLevels); the top level is ``backend``, as a single tier is
        self.lower = lower
        self.present = present        # prompt tokens handed over with each request (disaggregated decode)
        # per request, when the stores issued up to its last step are done (the backend's store stream:
        # a disaggregated prefill's layer-wise save into the pool), filled when given
        self.stores_done = stores_done
        self.chunked_prefill = chunked_prefill  # False: each prompt prefilled in one step (engine_steps)
        self.release = release  # session arrivals (kvemu.sessions.Release): follow-ups sent as parents complete
        self.top_ns = 0               # load and store time of the stack's top level
        self.promoted_blocks = 0      # blocks promoted into the top level, their writes timed on it
        self.level_tokens = None if lower is None else [np.zeros(len(inputs.input_tokens), np.int64)
                                                        for _ in lower.n_slots]
        # tokens each level held for a request but whose prefetch had not arrived when it started
        # (--kv-load async with a prefetch policy other than wait_complete): recomputed
        self.late_tokens = None if lower is None else [np.zeros(len(inputs.input_tokens), np.int64)
                                                       for _ in lower.n_slots]
        # shared lower levels' queues (level -> TierQueue: the instances' traffic on one medium)
        self.level_queues = level_queues or {}
        self.prefetched: dict = {}    # request id -> (its load's first position, the level of each block)
        # async loads (vLLM's asynchronous KV loading) go through this second backend context on the
        # same tier, with a timeline of its own: the load stream
        self.load_stream = load_stream
        self.async_loads = 0          # loads issued on the load stream
        self.router, self.instance, self.queue = router, instance, queue
        # the engine's pool and tier cache; ``tier`` is the one other instances share, if any
        self.caches = engine_caches(inputs.cfg, tier)
        self.block_bytes = block_bytes_all_layers
        self.log = EngineLog(len(inputs.input_tokens))
        self.buf = {k: array("q") for k in _STEP_FIELDS}
        self.kv_rows: list = []       # (absolute entry rows, their C entry_out) of steps that called C
        self.step_base = 0            # engine step of buf's first step
        self.c_steps = 0
        self.end_ns = 0
        self.queued_ns = 0            # time steps waited for the shared tier (TierQueue)
        self.finished = 0
        # the store's per-request lookup (a profile's ns_per_request parts, docs/tier-profiles.md): paid by
        # every request the engine consults the tier for, hit or miss, in the first step that carries it
        self.lookup_each_ns = 0.0
        self.looked_up = np.zeros(len(inputs.input_tokens), bool)
        self.lookups = 0
        self.lookup_ns = 0

    def run(self, backend, progress=None, stop=None) -> dict:
        i, router, me = self.inputs, self.router, self.instance
        profile = getattr(backend, "profile", None)
        if profile is not None and i.cfg.tier_policy != "none":
            self.lookup_each_ns = float(profile.software_ns_per_request)
        inbox = None if router is None else router.inbox[me]
        gen = engine_steps(i.tables, i.arrival_ns, i.input_tokens, i.output_tokens, i.timing, i.cfg, self.log,
                           progress=progress if router is None else None,
                           stop_after=self.selected if router is None else None, inbox=inbox, caches=self.caches,
                           async_loads=self.load_stream is not None, present=self.present,
                           chunked_prefill=self.chunked_prefill, release=self.release,
                           decode_runs=self.acc.weights is None)
        try:
            plan = next(gen)
            while plan is not None:
                if stop is not None and stop.is_set():
                    break
                if type(plan) is DecodeRun:
                    plan = gen.send(self._run_decodes(plan))
                    continue
                if isinstance(plan, Idle):
                    wake = router.park(me, plan.deadline_ns)
                    plan = gen.send(wake) if wake is not None else None
                    continue
                loads_done = arrivals = None
                if plan.loads and self.lower is not None:
                    loads_done, arrivals = self._issue_stack_loads(plan.start_ns, plan.loads, plan.compute_ns)
                elif plan.loads:
                    loads_done = self._issue_loads(plan.start_ns, plan.loads)
                end = self._run_step(backend, plan)
                self.end_ns = end
                if self.log.rows() - self.log.taken >= FOLD_ROWS:
                    self._fold()
                self.finished += len(plan.finished)
                if self.stores_done is not None and plan.finished:
                    # the store stream is FIFO: what it issued so far is done then
                    done = max(end, backend.timeline()["stores_done_ns"])
                    self.stores_done[np.asarray(plan.finished, np.int64)] = done
                if router is not None:
                    router.complete(me, plan.finished, end)
                    if not router.advance(me, end):
                        break
                plan = gen.send(StepOutcome(end, loads_done, arrivals))
        except StopIteration:
            pass
        finally:
            if router is not None:
                router.leave(me)
        self._fold()
        if self.prefetched:
            self._late()
        # what the replayed engine found at admission, per request (0 for those it never admitted)
        self.acc.found_tokens, self.acc.found_in_tier_tokens = self.log.cached, self.log.tier_hit
        self.acc.level_tokens = self.level_tokens
        self.acc.late_tokens = self.late_tokens if self.load_stream is not None else None
        hbm_evictions, tier_evictions = self.caches.evictions()
        return {"steps": self.step_base, "c_steps": self.c_steps, "tier_peak_blocks": self.caches.tier_peak(),
                "end_ns": self.end_ns, "finished": self.finished,
                "async_loads": self.async_loads, "hbm_evictions": hbm_evictions, "tier_evictions": tier_evictions,
                "entries": self.log.rows(), "queued_ns": self.queued_ns, "lookups": self.lookups,
                "lookup_ns": self.lookup_ns}

    def _run_step(self, backend, plan: StepPlan) -> int:
        """Runs a planned step: through the backend (one C call) when it moves KV or streams weights,
        else its modelled compute alone; its times go to the step buffer. Returns when it ended."""
        acc, buf = self.acc, self.buf
        start, comp = plan.start_ns, plan.compute_ns
        look = self._lookups(plan) if self.lookup_each_ns else 0
        wblocks = None if acc.weights is None else acc.weights.blocks(plan.new_tokens)
        if plan.moves_kv or (wblocks is not None and wblocks[0]):
            e = self.log.entries(plan.r0, plan.r1, ("request_id", *_OP_COLUMNS))
            live = np.flatnonzero((e["load_count"] > 0) | (e["store_count"] > 0) | (e["read_count"] > 0))
            e = {k: v[live] for k, v in e.items()}
            e["step"] = np.zeros(len(live), np.int32)
            if self.lower is not None:  # the top level's share of the step's KV goes to its queue below
                s, eo, end, d, stall, e = self._stack_step(backend, e, start, comp, wblocks)
            else:
                so, eo, _ = acc.c_call(backend, e, np.zeros(1, np.int64), np.array([comp], np.int64),
                                       np.array([start], np.int64), wblocks)
                s = so[0]
                end, d, stall = int(s["end_ns"]), int(s["step_ns"]), int(s["stall_ns"])
            if self.queue is not None:
                wait = self.queue.serve(start, e, self.block_bytes)
                end, d, stall = end + wait, d + wait, stall + wait
                self.queued_ns += wait
            end, d, stall = end + look, d + look, stall + look
            buf["step_ns"].append(d); buf["load"].append(int(s["load_ns"])); buf["store"].append(int(s["store_ns"]))
            buf["read"].append(int(s["read_ns"])); buf["stall"].append(stall)
            buf["start"].append(int(s["start_ns"]))
            self.kv_rows.append((live + plan.r0, eo))
            self.c_steps += 1
        else:
            end = start + comp + look
            buf["step_ns"].append(comp + look); buf["load"].append(0); buf["store"].append(0); buf["read"].append(0)
            buf["stall"].append(look)
            buf["start"].append(start)
        buf["compute"].append(comp)
        buf["end"].append(end)
        return end

    def _run_decodes(self, run: DecodeRun) -> RunOutcome:
        """The steps of a DecodeRun that start before its deadline: decodes alone, which move no KV
        (the engine plans none that do), so each takes its modelled compute, as ``_run_step`` times a
        step that moves nothing, and starts when the one before ends; their times go to the step
        buffer."""
        comp = run.compute_ns
        end = run.start_ns + np.cumsum(comp)
        start = end - comp
        m = len(comp) if run.deadline_ns is None else max(1, int(np.searchsorted(start, run.deadline_ns)))
        zeros = bytes(8 * m)
        buf = self.buf
        for k, v in (("start", start), ("compute", comp), ("end", end), ("step_ns", comp)):
            buf[k].frombytes(v[:m].tobytes())
        for k in ("load", "store", "read", "stall"):
            buf[k].frombytes(zeros)
        self.end_ns = int(end[m - 1])
        return RunOutcome(m, self.end_ns)

    def _lookups(self, plan: StepPlan) -> int:
        """The store's per-request lookups this step pays (ns): one for each request it carries for the
        first time, whether its prefix was found in the tier or not (LMCache's lookup runs in vLLM's
        scheduler for every request it schedules, SGLang #31398: a miss still waits for it), one after
        the other on the scheduler's thread."""
        e = self.log.entries(plan.r0, plan.r1, ("request_id", "phase"))
        rids = np.unique(e["request_id"][e["phase"] == 0])
        new = rids[~self.looked_up[rids]]
        if not len(new):
            return 0
        self.looked_up[new] = True
        ns = int(round(len(new) * self.lookup_each_ns))
        self.lookups += len(new)
        self.lookup_ns += ns
        return ns

    def _stack_step(self, backend, e: dict, start: int, comp: int, wblocks):
        """A step on a tier stack: each load entry is split by the level that serves each block
        (TierStack.runs_of); the top level's runs, the step's stores and the blocks promoted into
        the top level go through ``backend``, each lower level's runs and the blocks written into it
        (demotions, copies) through its own context (LowerLevels.call), all from the step's start.
        With KV groups each part of a split load moves its layers' share of the whole load's
        windows (load_end), and a copied block what its first store wrote (TierStack.origin_runs).
        The step ends when the last of them does: the levels are separate media, loading side by
        side. Each level's load time is added to the entry it was split from. Returns (step_out,
        entry_out, end, step_ns, stall_ns, the entries the top level ran)."""
        acc, stack, lower, tpb = self.acc, self.caches.tier, self.lower, self.inputs.cfg.tokens_per_block
        n = len(e["request_id"])
        extra = {k: [] for k in e}
        extra_of: list = []
        below: list = [[] for _ in lower.n_slots]      # per level: (entry index, block ids, rid, p0, load end)
        load_end: dict = {}
        e = {k: v.copy() for k, v in e.items()}
        for i in np.flatnonzero(e["store_count"] > 0):  # the blocks' first stores: what their copies move
            rid, sf, sc = int(e["request_id"][i]), int(e["store_first"][i]), int(e["store_count"][i])
            stack.stack.note_origin(acc.trace.block_ids(np.full(sc, rid), np.arange(sf, sf + sc)), rid, sf)
        for i in np.flatnonzero(e["load_count"] > 0):
            rid, lf = int(e["request_id"][i]), int(e["load_first"][i])
            runs = stack.runs_of(int(acc.trace.block_ids(np.array([rid]), np.array([lf]))[0]), lf)
            if runs is None:
                self.level_tokens[0][rid] += int(e["load_count"][i]) * tpb
                continue
            for k, a, z in runs:
                self.level_tokens[k][rid] += (z - a) * tpb
            if all(k == 0 for k, _, _ in runs):
                continue
            end_of_hit = lf + int(e["load_count"][i])
            load_end[rid] = end_of_hit
            e["load_count"][i] = 0
            for k, a, z in runs:
                if k == 0:
                    for c in e:
                        extra[c].append(0)
                    extra["request_id"][-1], extra["load_first"][-1], extra["load_count"][-1] = rid, a, z - a
                    extra_of.append(i)
                else:
                    below[k].append((i, acc.trace.block_ids(np.full(z - a, rid), np.arange(a, z)), rid, a, end_of_hit))
        written = stack.take_written()
        promoted = stack.stack.origin_runs(written[0]) if len(written[0]) else []
        for ids, rid, p0 in promoted:  # promotions: stores into the top level, as their first store wrote them
            if rid < 0:
                continue  # (no origin: not a block the engine stored; cannot happen on the top level)
            for c in e:
                extra[c].append(0)
            extra["request_id"][-1], extra["store_first"][-1], extra["store_count"][-1] = rid, p0, len(ids)
        if len(extra["request_id"]):
            e = {c: np.concatenate([v, np.array(extra[c], v.dtype)]) for c, v in e.items()}
        top_moves = any(int(e[f"{op}_count"].sum()) for op in OPS)
        if top_moves or (wblocks is not None and wblocks[0]):
            so, eo_all, _ = acc.c_call(backend, e, np.zeros(1, np.int64), np.array([comp], np.int64),
                                       np.array([start], np.int64), wblocks, load_end or None)
            s = so[0].copy()
            self.top_ns += int(s["load_ns"]) + int(s["store_ns"])
            eo = eo_all[:n].copy()
            for j, i in enumerate(extra_of):
                eo["load_ns"][i] += eo_all["load_ns"][n + j]
            self.promoted_blocks += sum(len(ids) for ids, rid, _ in promoted if rid >= 0)
        else:
            s = np.zeros(1, STEP_OUT_DTYPE)[0]
            s["start_ns"], s["end_ns"], s["step_ns"] = start, start + comp, comp
            eo = np.zeros(n, ENTRY_OUT_DTYPE)
        end, stall = int(s["end_ns"]), int(s["stall_ns"])
        for k in range(1, len(below)):
            if not below[k] and not written[k]:
                continue
            copies = stack.stack.origin_runs(written[k])
            sk, ns = lower.call(k, start, comp, [x[1:] for x in below[k]], copies, acc.kv)
            for (i, *_), t in zip(below[k], ns):
                eo["load_ns"][i] += int(t)
            s["load_ns"] += int(sk["load_ns"])
            s["store_ns"] += int(sk["store_ns"])
            wait = 0
            q = self.level_queues.get(k)
            if q is not None:  # a shared level: wait for the traffic other instances queued before
                nbytes = (sum(len(x[1]) for x in below[k]) + len(written[k])) * self.block_bytes
                wait = q.serve_bytes(start, nbytes, bool(below[k]))
            end = max(end, int(sk["end_ns"]) + wait)
            stall = max(stall, int(sk["stall_ns"]) + wait)
        s["end_ns"] = end
        d = end - int(s["start_ns"])
        s["step_ns"] = d
        return s, eo, end, d, max(stall, d - comp), e

    def _issue_stack_loads(self, start: int, loads: list, compute: int = 0) -> tuple[dict, dict | None]:
        """Asynchronous loads from a tier stack issued at ``start``: each load is split by the level
        serving each block (TierStack.runs_of); the top level's runs go on the top level's load
        stream (a step each), each lower level's chunks on that level's own load stream (a step per
        chunk, so each chunk's arrival is known), a shared level's after the traffic queued before
        on it (TierQueue). The stack's prefetch policy (docs/replay.md, "Prefetch") says when each
        request may start: ``wait_complete`` when every block has arrived; ``best_effort`` when its
        top-level blocks have (its lower-level blocks that arrived by the step it joins are used);
        ``timeout`` when every block has arrived or the timeout has passed, whichever is first.
        Under the last two a level stops moving a request's chunks once the request starts
        without them: when the policy lets it start, and not before the step planned with the load
        (its ``compute``) can have ended, the first the scheduler can take it (LowerLevels.prefetch:
        a chunk not started by then is cancelled, never arrives, and leaves the level to the
        chunks after it). With KV groups each part of a split
        load moves its layers' share of the whole load's windows (load_end). Returns (request id
        -> when it may start, request id -> when each block arrives, or None under wait_complete)."""
        acc, stack, lower = self.acc, self.caches.tier, self.lower
        spec, tpb, cb = stack.spec, self.inputs.cfg.tokens_per_block, lower.chunk_blocks
        top: list = []                                   # (request, first, count)
        chunks: dict = {}                                # level -> [(request, p0, p1)], chunk by chunk
        for x in loads:
            rid = x.request
            runs = stack.runs_of(int(acc.trace.block_ids(np.array([rid]), np.array([x.first]))[0]), x.first)
            if runs is None:
                runs = [(0, x.first, x.first + x.count)]
            level_of = np.zeros(x.count, np.int8)
            for k, a, z in runs:
                self.level_tokens[k][rid] += (z - a) * tpb
                level_of[a - x.first : z - x.first] = k
                if k == 0:
                    top.append((rid, a, z - a))
                    continue
                p = a
                while p < z:
                    q = min(z, p - p % cb + cb)
                    chunks.setdefault(k, []).append((rid, p, q))
                    p = q
            self.prefetched[rid] = (x.first, level_of, np.zeros(x.count, bool))  # the last: cancelled
        load_end = {x.request: x.first + x.count for x in loads}
        arrival = {x.request: np.full(x.count, start, np.int64) for x in loads}
        top_done = {x.request: start for x in loads}
        if top:
            e = {"request_id": np.array([t[0] for t in top], np.int32),
                 "load_first": np.array([t[1] for t in top], np.int32),
                 "load_count": np.array([t[2] for t in top], np.int32)}
            z = np.zeros(len(top), np.int32)
            e.update(store_first=z, store_count=z, read_first=z, read_count=z, step=np.arange(len(top), dtype=np.int32))
            so, eo, _ = acc.c_call(self.load_stream, e, np.arange(len(top), dtype=np.int64),
                                   np.zeros(len(top), np.int64), np.full(len(top), start, np.int64),
                                   load_end=load_end)
            np.add.at(acc.req_kv["load"], e["request_id"].astype(np.int64), eo["load_ns"])
            acc.kv_total_ns["load"] += int(so["load_ns"].sum())
            self.top_ns += int(so["load_ns"].sum())
            for (rid, a, n), t in zip(top, so["end_ns"].tolist()):
                first = self.prefetched[rid][0]
                arrival[rid][a - first : a - first + n] = t
                top_done[rid] = max(top_done[rid], int(t))
        cancel_at = None
        if spec.prefetch != "wait_complete":
            # when each request starts without what has not arrived: its top-level blocks' arrival,
            # and under timeout not before the timeout of what it prefetches from below
            below_tokens = {rid: int(np.count_nonzero(lv > 0)) * tpb for rid, (_, lv, _) in self.prefetched.items()
                            if rid in top_done}
            cancel_at = {rid: max(start + compute, top_done[rid] if spec.prefetch == "best_effort" else
                                  max(top_done[rid], start + spec.prefetch_timeout_ns(below_tokens[rid])))
                         for rid in top_done}
        never = np.iinfo(np.int64).max
        for k, cs in chunks.items():
            groups = [(acc.trace.block_ids(np.full(q - p, rid), np.arange(p, q)), rid, p, load_end[rid])
                      for rid, p, q in cs]
            ends, load_ns = lower.prefetch(k, start, groups, acc.kv,
                                           None if cancel_at is None else [cancel_at[rid] for rid, _, _ in cs])
            wait = 0
            qk = self.level_queues.get(k)
            if qk is not None:  # a shared level: its chunks wait for the traffic queued before on it
                moved = sum(q - p for (_, p, q), t in zip(cs, ends) if t is not None)
                wait = qk.serve_bytes(start, moved * self.block_bytes, True)
            acc.kv_total_ns["load"] += int(sum(load_ns))
            for (rid, p, q), t, ns in zip(cs, ends, load_ns):
                first = self.prefetched[rid][0]
                if t is None:  # cancelled: never arrives
                    arrival[rid][p - first : q - first] = never
                    self.prefetched[rid][2][p - first : q - first] = True
                    continue
                arrival[rid][p - first : q - first] = int(t) + wait
                acc.req_kv["load"][rid] += int(ns)
        for x in loads:
            acc.req_blocks["load"][x.request] += x.count
            acc.first_start[x.request] = min(int(acc.first_start[x.request]), start)
        self.async_loads += len(loads)
        done, per_block = {}, None if spec.prefetch == "wait_complete" else {}
        for x in loads:
            rid, arr = x.request, arrival[x.request]
            lower_arr = arr[self.prefetched[rid][1] > 0]
            last = int(arr.max()) if len(arr) else start
            if spec.prefetch == "wait_complete" or not len(lower_arr):
                done[rid] = last
            elif spec.prefetch == "best_effort":
                done[rid] = top_done[rid]
            else:
                deadline = start + spec.prefetch_timeout_ns(len(lower_arr) * tpb)
                done[rid] = max(top_done[rid], min(int(lower_arr.max()), deadline))
            if per_block is not None:
                per_block[rid] = arr.tolist()
        return done, per_block

    def _late(self) -> None:
        """After the run: the blocks each prefetched request kept (the engine's ``cached``) and those
        it recomputed because their prefetch had not arrived; the latter leave the levels' served
        counts for their late counts (and, of those, the ones whose chunks the level cancelled:
        never moved)."""
        tpb, stack = self.inputs.cfg.tokens_per_block, self.caches.tier
        n_levels = len(self.level_tokens)
        for rid, (first, level_of, cancelled) in self.prefetched.items():
            keep = max(0, int(self.log.cached[rid]) // tpb - first)
            late = level_of[keep:]
            if not len(late):
                continue
            gone = np.bincount(late[cancelled[keep:]], minlength=n_levels).tolist()
            for k, n in enumerate(np.bincount(late, minlength=n_levels).tolist()):
                if n:
                    self.level_tokens[k][rid] -= n * tpb
                    self.late_tokens[k][rid] += n * tpb
                    stack.unserve(k, n, gone[k])

    def _issue_loads(self, start: int, loads: list) -> dict:
        """The engine's asynchronous loads (AsyncLoad) issued at ``start``, on the load stream (one C
        call, a step each, in issue order); their times go to the requests. Returns when each is
        done (request id -> ns), for the engine."""
        acc = self.acc
        k = len(loads)
        rid = np.array([x.request for x in loads], np.int64)
        zeros = np.zeros(k, np.int32)
        e = {"request_id": rid.astype(np.int32), "load_first": np.array([x.first for x in loads], np.int32),
             "load_count": np.array([x.count for x in loads], np.int32), "store_first": zeros, "store_count": zeros,
             "read_first": zeros, "read_count": zeros, "step": np.arange(k, dtype=np.int32)}
        so, eo, _ = acc.c_call(self.load_stream, e, np.arange(k, dtype=np.int64), np.zeros(k, np.int64),
                               np.full(k, start, np.int64))
        done = {r: int(t) for r, t in zip(rid.tolist(), so["end_ns"].tolist())}
        np.add.at(acc.req_kv["load"], rid, eo["load_ns"])
        acc.count_kv(rid, {op: e[f"{op}_count"].astype(np.int64) for op in OPS}, acc.entry_bytes(e))
        acc.kv_total_ns["load"] += int(so["load_ns"].sum())
        np.minimum.at(acc.first_start, rid, start)   # admitted now: the queue ends here
        self.async_loads += k
        return done

    def _fold(self) -> None:
        buf = self.buf
        n_steps = len(buf["end"])
        if n_steps == 0:
            return
        taken0 = self.log.base  # kv_rows count the log's cols, handed over first
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
        self.acc.fold(e["request_id"].astype(np.int64), e["phase"], of_entry, compute, step_out, entry_out, counts,
                      self.acc.entry_bytes(e))
        self.step_base += n_steps
        self.kv_rows = []
        for a in buf.values():
            del a[:]
