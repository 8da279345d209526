"""What one serving instance's replay adds up (Accumulator: the C calls it makes, the step
timeline, per-request sums and times, the inter-token gaps spilled to a temporary file), and the
results written from it: the per-request rows and the file, a row group at a time with the gaps
read back from the spill files."""

from __future__ import annotations

import errno
import os
import resource
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from ..backends import ENTRY_DTYPE, STEP_DTYPE
from ..errors import KvemuError, OutputError, ResourceLimitError, TraceError
from ..integrity import ResultsWriter
from ..schema import OPS, PHASE_PREFILL
from .arena import LocalTables, greedy_groups, range_positions

if TYPE_CHECKING:
    from ..backends import TierSlots

# Block-layer accesses per C call: bounds how long a signal waits (about a second on DRAM).
ACCESSES_PER_CALL = 1 << 17
# Inter-token gaps go to a temporary file as they are measured (request id, gap in ms) and come
# back a row group of results at a time: at most this many values, or RESULT_GROUP_ROWS requests.
ITL_RECORD = np.dtype([("request", "<i4"), ("ms", "<f8")])
ITL_VALUES_PER_GROUP = 1 << 18
RESULT_GROUP_ROWS = 1 << 16


def spill_error(e: OSError) -> KvemuError:
    """The one-line error for a failure of an inter-token-gap spill file (in $TMPDIR)."""
    where = tempfile.gettempdir()
    if e.errno in (errno.EMFILE, errno.ENFILE):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return ResourceLimitError(f"out of file descriptors ({os.strerror(e.errno)}; ulimit -n is {soft}): every "
                                  f"replay instance keeps a spill file and its backend's files open; give fewer "
                                  f"--instances or raise ulimit -n")
    # numpy's tofile reports a short write without an errno: a full disk or a file-size limit
    why = os.strerror(e.errno) if e.errno else f"short write: {e}; the disk is full or a file-size limit was reached"
    hint = ("; point TMPDIR at a folder with room" if e.errno in (None, errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            else "")
    return OutputError(f"{where}: cannot write the inter-token-gap spill file ({why}); nothing was written{hint}")


def _locate(exc: BaseException, e) -> None:
    """Tells an error that takes it (``located``: a store's master that exited) which steps and
    requests the failed call replayed."""
    located = getattr(exc, "located", None)
    if located is not None and len(e["step"]):
        step, rid = e["step"], e["request_id"]
        located(f" while replaying steps {int(step.min())}-{int(step.max())} "
                f"(requests {int(rid.min())}-{int(rid.max())})")


@dataclass(frozen=True)
class TierMap:
    """How a call's blocks find their arena slots when the arena is smaller than the chunks the
    replay touches: from the tier's LRU (``lru``, backends.TierSlots, under ``lock``) by chunk,
    ``key_of[id]`` a block's chunk and ``off_of[id]`` its position in it (None: chunks of one
    block), ``chunk_blocks`` blocks a chunk."""
    lru: TierSlots
    key_of: np.ndarray | None
    off_of: np.ndarray | None
    chunk_blocks: int
    lock: threading.Lock


class Accumulator:
    """What one instance's replay adds up, batch by batch: the step timeline, per-request sums and
    times, and the inter-token gaps of the selected requests (spilled to a temporary file, 12
    bytes a generated token). Its memory is a few numbers per request; nothing grows with the
    entries, the block accesses or the tokens."""

    def __init__(self, trace, s0, n_steps, selected, slot_of, span, tier=None):
        n_req = trace.n_requests
        # a TierMap when the arena is smaller than the touched chunks: slots come from the tier's LRU,
        # call by call
        self.tier = tier
        self.load_misses = 0
        self.touched = None  # closed loop: a bool per block id, marked as calls touch them
        # closed loop: per request, the prompt tokens the replayed engine found cached at admission and
        # the part of them found in the tier (its EngineLog's); None: the recording's stand
        self.found_tokens = self.found_in_tier_tokens = None
        # closed loop on a tier stack: per level, top first, the prompt tokens it served each request
        self.level_tokens = None
        self.late_tokens = None   # a stack with async prefetch: per level, tokens whose prefetch came too late
        self.compute_model = None  # (GpuTiming, resident): recorded instances compute their own entries
        self.weights = None  # WeightStream: weights in the tier, loaded in every step's C call
        # layerkv.GroupMoves for a model with KV groups: what each replayed layer moves, and each entry's
        # bytes; None: full attention in every layer (a block of every layer per block operation)
        self.kv = None
        self.weight_ns = self.weight_bytes = self.weight_steps = 0
        self.trace, self.s0, self.n_steps, self.selected, self.slot_of, self.span = (
            trace, s0, n_steps, selected, slot_of, span)
        self.arrival_ns = np.round(trace.arrival_ms * 1e6).astype(np.int64)
        self.done_steps = 0
        self.total_ns = self.compute_total_ns = 0
        self.kv_total_ns = {op: 0 for op in OPS}
        self.req_kv = {op: np.zeros(n_req, np.int64) for op in OPS}
        self.req_blocks = {op: np.zeros(n_req, np.int64) for op in OPS}
        self.req_bytes = {op: np.zeros(n_req, np.int64) for op in OPS}  # all model layers
        self.req_compute = np.zeros(n_req, np.int64)
        self.req_stall = np.zeros(n_req, np.int64)
        self.first_start = np.full(n_req, np.iinfo(np.int64).max)  # start of the request's first step
        self.last_end_ns = np.full(n_req, -1, np.int64)  # end of its last step
        self.prefill_end_ns = np.full(n_req, -1, np.int64)  # end of its last prefill chunk: first token
        self.prefill_step_ns = np.zeros(n_req, np.int64)   # how long the step of that chunk took
        self.prefill_step_compute_ns = np.zeros(n_req, np.int64)  # that step's modelled compute
        # ITL: the selected requests' gaps (one per decode step, at most output_tokens - 1) go to
        # an unlinked temporary file as (request, ms) records; write_rows reads them back
        self.itl_cap = np.where(selected, trace.output_tokens - 1, 0).astype(np.int64)
        self.itl_n = np.zeros(n_req, np.int64)
        self.last_token_ns = np.zeros(n_req, np.int64)
        try:
            self.spill = tempfile.TemporaryFile(prefix="kvemu-itl-")
        except OSError as e:
            raise spill_error(e) from None
        # each write to the spill, in file order: (records, lowest request, highest request), so the
        # results' writer reads back only the writes holding a row group's requests
        self.spill_writes: list[tuple[int, int, int]] = []

    def close(self) -> None:
        self.spill.close()

    def replay_steps(self, backend, e, progress=None) -> None:
        """Replay whole steps in C calls of at most about ACCESSES_PER_CALL accesses each."""
        ops = sum(e[f"{op}_count"].astype(np.int64) for op in OPS) * len(self.span)
        step = e["step"]
        step_begin = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
        step_ops = np.add.reduceat(ops, step_begin)
        # cut before the step whose accesses would overflow the current call's share
        call_of_step = np.cumsum(step_ops) // ACCESSES_PER_CALL
        if self.tier is not None:
            # and, with the tier's slots, before the call's chunks would pass half the tier: under LRU a
            # call's chunks stay resident while it runs (an upper bound: every range may start mid-chunk);
            # under another policy one may still go (tier.call_overflow_chunks)
            cb = self.tier.chunk_blocks
            chunks = sum(np.where(e[f"{op}_count"] > 0, e[f"{op}_count"].astype(np.int64) // cb + 2, 0) for op in OPS)
            step_chunks = np.add.reduceat(chunks, step_begin)
            budget = max(self.tier.lru.capacity // 2, 1)
            call_of_step = np.maximum(call_of_step, greedy_groups(step_chunks, budget))
        cuts = step_begin[np.flatnonzero(np.diff(call_of_step)) + 1]
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(step)]):
            self.replay(backend, {k: v[lo:hi] for k, v in e.items()})
            if progress is not None:
                progress(self.done_steps, self.n_steps)

    def replay(self, backend, e) -> None:
        """Replay complete steps of one batch of entries (one C call) and fold in the measurements."""
        step = e["step"].astype(np.int64)
        rid = e["request_id"].astype(np.int64)
        uniq_steps, begin, of_entry = np.unique(step, return_index=True, return_inverse=True)
        if self.compute_model is None:
            compute = self.trace.compute_ns[uniq_steps]
        else:
            compute = self._own_compute(e, of_entry, len(uniq_steps))
        # a step starts when the previous one ended, and not before every request in it arrived
        arrived = np.zeros(len(uniq_steps), np.int64)
        np.maximum.at(arrived, of_entry, self.arrival_ns[rid])
        wblocks = None
        if self.weights is not None:
            tokens = np.bincount(of_entry, weights=e["tokens"].astype(np.float64), minlength=len(uniq_steps))
            wblocks = self.weights.blocks(tokens.astype(np.int64))
        step_out, entry_out, counts = self.c_call(backend, e, begin, compute, np.maximum(arrived, 0), wblocks)
        self.fold(rid, e["phase"], of_entry, compute, step_out, entry_out, counts, self.entry_bytes(e))

    def _own_compute(self, e, of_entry, n_steps) -> np.ndarray:
        """The compute of each step's entries alone (one instance's share of a recorded batch), from
        the trace's GPU model: the same roofline as the engine's, over these entries."""
        timing, resident = self.compute_model
        tok = e["tokens"].astype(np.float64)
        ctx = e["context_tokens"].astype(np.float64)
        chunk = (e["phase"] == PHASE_PREFILL).astype(np.float64)
        dec = np.where(chunk > 0, 0.0, tok)
        sums = [np.bincount(of_entry, weights=w, minlength=n_steps)
                for w in (tok, tok * (ctx + (tok + 1) / 2), tok if resident else ctx + tok, dec,
                          np.where(chunk > 0, 0.0, ctx), chunk, np.where(chunk > 0, ctx, 0.0))]
        # the step's composition as the scheduler passes it (data-parallel attention counts its requests
        # and places its mean prefill chunk on one rank)
        return np.array([timing.step_ns(int(a), b, int(c), int(d), int(dc), int(k), int(kc))
                         for a, b, c, d, dc, k, kc in zip(*sums)], np.int64)

    def c_call(self, backend, e, begin, compute, ready, weight_blocks=None, load_end=None):
        """One C replay call: the steps whose entries start at ``begin`` (indices into ``e``), with
        their compute and earliest start times. Returns (step_out, entry_out, block counts per op).
        ``weight_blocks`` (one per step, with weights in the tier): blocks of every replayed layer the
        step loads from the arena's weight region, in the same call (WeightStream.join); their time
        is taken out of the steps' load_ns and added to ``weight_ns``. ``load_end`` (request id ->
        block position): where the windows of a request's load end when its load is split over
        several entries (a tier stack: the whole prefix hit's end; layerkv.GroupMoves.moves)."""
        n = len(e["step"])
        t = LocalTables(self.trace, e)
        entries = np.zeros(n, ENTRY_DTYPE)
        entries["req"] = t.local
        for op in OPS:
            entries[f"{op}_first"] = t.first[op]
            entries[f"{op}_count"] = t.count[op]
        if self.tier is not None:
            slots = self._tier_slots(t)
        else:
            slots = self.slot_of[t.ids] if self.slot_of is not None else np.zeros(len(t.ids), np.uint32)
        if self.touched is not None:
            self.touched[t.ids] = True
        steps = np.zeros(len(begin), STEP_DTYPE)
        steps["entry_begin"] = begin
        steps["entry_end"] = np.append(begin[1:], n)
        steps["compute_ns"] = compute
        steps["ready_ns"] = ready
        table_off = t.table_off
        if weight_blocks is not None:
            table_off, slots, steps, entries, real, mine = self.weights.join(table_off, slots, steps, entries,
                                                                             weight_blocks)
        ends = None if load_end is None else [load_end.get(int(r), 0) for r in t.requests]
        kv = None if self.kv is None else self.kv.moves(t.requests, t.base, 0 if weight_blocks is None else 1, ends)
        try:
            step_out, entry_out = backend.replay(table_off, slots, steps, entries, self.span, kv)
        except KvemuError as exc:  # a component that failed (a store's master) says where the replay was
            _locate(exc, e)
            raise
        if weight_blocks is not None:
            w_ns = entry_out["load_ns"][mine]
            entry_out = entry_out[real]
            # the steps' KV loads; the weights' are counted apart (their shares of a batch are rounded)
            cs = np.r_[0, np.cumsum(entries["load_count"].astype(np.int64))]
            kv_loads = cs[steps["entry_end"].astype(np.int64)] - cs[steps["entry_begin"].astype(np.int64)] - weight_blocks
            step_out["load_ns"] = np.where(kv_loads > 0, np.maximum(step_out["load_ns"] - w_ns, 0), 0)
            self.weight_ns += int(w_ns.sum())
            self.weight_bytes += int(weight_blocks.sum()) * self.weights.block_bytes_all_layers
            self.weight_steps += int(np.count_nonzero(weight_blocks))
        return step_out, entry_out, t.count

    def entry_bytes(self, e) -> dict | None:
        """Bytes of all model layers each entry row moves, per op, for a model with KV groups
        (layerkv.GroupMoves); None: a block of every layer per block (``block_bytes_all_layers``)."""
        return None if self.kv is None else self.kv.entry_bytes(e)

    def count_kv(self, rid, counts, nbytes) -> None:
        """Adds entries' blocks and, with KV groups, bytes per op to their requests (``nbytes`` None:
        the bytes are the blocks times a block of every layer, kv_bytes)."""
        for op in OPS:
            np.add.at(self.req_blocks[op], rid, counts[op])
            if nbytes is not None:
                np.add.at(self.req_bytes[op], rid, nbytes[op])

    def kv_bytes(self, op: str, block_all_layers: int) -> np.ndarray:
        """Each request's KV bytes of ``op``, all model layers: the groups' (count_kv), else its blocks
        times a block of every layer."""
        return self.req_bytes[op] if self.kv is not None else self.req_blocks[op] * block_all_layers

    def fold(self, rid, phase, of_entry, compute, step_out, entry_out, counts, nbytes=None) -> None:
        """Fold placed steps into the sums: entries (request ``rid``, ``phase``, index of their step
        ``of_entry``) of steps with ``compute`` and C's ``step_out``; the entries' own KV times,
        block counts and (with KV groups) bytes per op."""
        d = step_out["step_ns"].astype(np.int64)
        self.total_ns += int(d.sum())
        self.compute_total_ns += int(compute[d > 0].sum())
        for op in OPS:
            self.kv_total_ns[op] += int(step_out[f"{op}_ns"].sum())
            np.add.at(self.req_kv[op], rid, entry_out[f"{op}_ns"])
        self.count_kv(rid, counts, nbytes)
        # C placed the steps on the instance's timeline: end[k] = max(end[k-1], arrivals of step k) + d[k]
        end = step_out["end_ns"].astype(np.int64)
        e_end, e_d = end[of_entry], d[of_entry]
        np.add.at(self.req_compute, rid, compute[of_entry])
        np.add.at(self.req_stall, rid, e_d - compute[of_entry])
        np.minimum.at(self.first_start, rid, e_end - e_d)
        np.maximum.at(self.last_end_ns, rid, e_end)
        sel = self.selected[rid]
        pre = sel & (phase == PHASE_PREFILL)
        np.maximum.at(self.prefill_end_ns, rid[pre], e_end[pre])
        last = pre & (e_end == self.prefill_end_ns[rid])
        self.prefill_step_ns[rid[last]] = e_d[last]
        self.prefill_step_compute_ns[rid[last]] = compute[of_entry][last]
        self.last_token_ns[rid[pre]] = self.prefill_end_ns[rid[pre]]
        self._add_gaps(rid[sel & ~pre], e_end[sel & ~pre])
        self.done_steps += len(compute)

    def _tier_slots(self, t) -> np.ndarray:
        """Slots of this call's table positions from the tier's LRU (chunk by chunk), counting the
        loads of chunks the tier had evicted: not resident before the call, not stored in it."""
        tm = self.tier
        lru, key_of, off_of, cb, lock = tm.lru, tm.key_of, tm.off_of, tm.chunk_blocks, tm.lock
        keys = key_of[t.ids] if key_of is not None else t.ids
        loaded = range_positions(t, "load")
        written = None
        if getattr(lru, "takes_writes", False):  # a policy for which only a load is a reuse (PolicySlots)
            written = np.ones(len(keys), bool)
            written[loaded] = False
        with lock:
            chunk_slot, fresh = lru.map(keys) if written is None else lru.map(keys, written)
        slots = chunk_slot.astype(np.uint64) * cb + (off_of[t.ids] if off_of is not None else 0)
        if len(loaded) and fresh[loaded].any():
            stored = np.zeros(len(keys), bool)
            stored_pos = range_positions(t, "store")
            if len(stored_pos):
                stored_keys = np.unique(keys[stored_pos])
                stored = np.isin(keys, stored_keys)
            self.load_misses += int(np.count_nonzero(fresh[loaded] & ~stored[loaded]))
        return slots.astype(np.uint32)

    def _add_gaps(self, rid: np.ndarray, t: np.ndarray) -> None:
        """Token times of decode entries (in step order) -> each request's next inter-token gaps."""
        if len(rid) == 0:
            return
        order = np.argsort(rid, kind="stable")  # by request, in step order within one
        rid, t = rid[order], t[order]
        head = np.r_[True, rid[1:] != rid[:-1]]
        prev = np.r_[0, t[:-1]]
        prev[head] = self.last_token_ns[rid[head]]
        group_begin = np.flatnonzero(head)
        size = np.diff(np.r_[group_begin, len(rid)])
        rank = np.arange(len(rid)) - np.repeat(group_begin, size)
        over = self.itl_n[rid] + rank >= self.itl_cap[rid]
        if over.any():
            r = int(rid[np.argmax(over)])
            raise TraceError(f"{self.trace.header.path}: request {r} has more decode steps than output_tokens - 1 "
                             f"= {int(self.trace.output_tokens[r]) - 1}")
        rec = np.empty(len(rid), ITL_RECORD)
        rec["request"] = rid
        rec["ms"] = (t - prev) / 1e6
        try:
            rec.tofile(self.spill)
        except OSError as e:
            raise spill_error(e) from None
        self.spill_writes.append((len(rec), int(rid[0]), int(rid[-1])))  # rid sorted
        self.itl_n[rid[head]] += size
        self.last_token_ns[rid[head]] = t[group_begin + size - 1]


def reuse_columns(trace, acc, sel_idx) -> dict:
    """Where each request's prompt tokens came from: ``cached_tokens`` (found in a cache at
    admission), split into ``hbm_hit_tokens`` and ``tier_hit_tokens``, and ``recomputed_tokens``
    (the rest: computed by the request's prefill). As the replayed engine found them in closed
    loop (its own HBM prefix cache and tier, bounded as the replay bounds them); as recorded under
    the recorded schedule, whose steps are the recording's."""
    if acc.found_tokens is not None:
        cached, tier = acc.found_tokens[sel_idx], acc.found_in_tier_tokens[sel_idx]
    else:
        cached, tier = trace.cached_tokens[sel_idx], trace.tier_hit_tokens[sel_idx]
    cached, tier = cached.astype(np.int64), tier.astype(np.int64)
    inp = trace.input_tokens[sel_idx].astype(np.int64)
    cols = {"cached_tokens": pa.array(cached.astype(np.int32)),
            "hbm_hit_tokens": pa.array((cached - tier).astype(np.int32)),
            "tier_hit_tokens": pa.array(tier.astype(np.int32)),
            "recomputed_tokens": pa.array((inp - cached).astype(np.int32))}
    if acc.level_tokens is not None:  # a tier stack: the tokens each level served, top first
        per = np.stack([t[sel_idx] for t in acc.level_tokens], axis=1).astype(np.int32)
        cols["stack_level_tokens"] = pa.array(per.tolist(), pa.list_(pa.int32()))
    if getattr(acc, "late_tokens", None) is not None:  # prefetched, recomputed: the prefetch came too late
        per = np.stack([t[sel_idx] for t in acc.late_tokens], axis=1).astype(np.int32)
        cols["stack_late_tokens"] = pa.array(per.tolist(), pa.list_(pa.int32()))
    return cols


def request_rows(trace, acc, sel_idx, arrival_ns, arrival_ms, block_all_layers):
    """Per-request results of one instance from its replayed timeline, and its last end time."""
    arr = arrival_ns[sel_idx]
    ttft = (acc.prefill_end_ns[sel_idx] - arr) / 1e6
    e2el = (acc.last_end_ns[sel_idx] - arr) / 1e6
    out_tok = trace.output_tokens[sel_idx]
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(out_tok > 1, (e2el - ttft) / (out_tok - 1), np.nan)
    table = pa.table({
        "request_id": pa.array(sel_idx.astype(np.int32)),
        "arrival_ms": pa.array(arrival_ms[sel_idx]),
        "input_tokens": pa.array(trace.input_tokens[sel_idx].astype(np.int32)),
        "output_tokens": pa.array(out_tok.astype(np.int32)),
        **reuse_columns(trace, acc, sel_idx),
        "ttft_ms": pa.array(ttft),
        "tpot_ms": pa.array(tpot),
        "e2el_ms": pa.array(e2el),
        "queue_ms": pa.array((acc.first_start[sel_idx] - arr) / 1e6),
        "compute_ms": pa.array(acc.req_compute[sel_idx] / 1e6),
        "kv_load_ms": pa.array(acc.req_kv["load"][sel_idx] / 1e6),
        "kv_store_ms": pa.array(acc.req_kv["store"][sel_idx] / 1e6),
        "kv_read_ms": pa.array(acc.req_kv["read"][sel_idx] / 1e6),
        "kv_stall_ms": pa.array(acc.req_stall[sel_idx] / 1e6),
        "kv_bytes_loaded": pa.array(acc.kv_bytes("load", block_all_layers)[sel_idx]),
        "kv_bytes_stored": pa.array(acc.kv_bytes("store", block_all_layers)[sel_idx]),
        "kv_bytes_read": pa.array(acc.kv_bytes("read", block_all_layers)[sel_idx]),
    })
    return table, int(acc.last_end_ns[sel_idx].max())


def write_rows(path, rows: pa.Table, accs, metadata: dict) -> None:
    """Writes the results: ``rows`` (every column but itl_ms, in request order) a row group at a
    time, each with its requests' ITL lists gathered from the accumulators' spill files, so the
    gaps are never all in memory at once."""
    ids = rows["request_id"].to_numpy().astype(np.int64)
    n_itl = sum(acc.itl_n for acc in accs)[ids]
    # a group ends where it would pass ITL_VALUES_PER_GROUP values or RESULT_GROUP_ROWS rows
    group = np.maximum(np.cumsum(n_itl) // ITL_VALUES_PER_GROUP, np.arange(len(ids)) // RESULT_GROUP_ROWS)
    cuts = np.flatnonzero(np.diff(group)) + 1
    at = rows.num_columns - (1 if "instance" in rows.column_names else 0)  # itl_ms before instance
    writer = None
    try:
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(ids)]):
            part = rows.slice(lo, hi - lo).add_column(at, "itl_ms", _itl_lists(accs, ids[lo:hi], n_itl[lo:hi]))
            if writer is None:
                writer = ResultsWriter(path, part.schema, metadata)
            writer.write_table(part)
    except BaseException:
        if writer is not None:
            writer.close(ok=False)
        raise
    writer.close()


def _itl_lists(accs, ids: np.ndarray, counts: np.ndarray) -> pa.Array:
    """The ITL lists of requests ``ids`` (sorted, consecutive among the selected ones), read back
    from every accumulator's spill file in blocks: values in token order per request."""
    lo, hi = int(ids[0]), int(ids[-1])
    found = []
    for acc in accs:
        try:
            acc.spill.flush()
            at = 0  # records before this write
            for n, r_lo, r_hi in acc.spill_writes:
                if r_hi >= lo and r_lo <= hi:  # this write holds some of the requests: read it in blocks
                    acc.spill.seek(at * ITL_RECORD.itemsize)
                    left = n
                    while left:
                        rec = np.fromfile(acc.spill, ITL_RECORD, count=min(left, ITL_VALUES_PER_GROUP))
                        if len(rec) == 0:  # shorter than its writes: the count check below says so
                            break
                        left -= len(rec)
                        keep = (rec["request"] >= lo) & (rec["request"] <= hi)
                        if keep.any():
                            found.append(rec[keep])
                at += n
        except OSError as e:
            raise spill_error(e) from None
    rec = np.concatenate(found) if found else np.zeros(0, ITL_RECORD)
    rec = rec[np.argsort(rec["request"], kind="stable")]  # one request's gaps stay in token order
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    if offsets[-1] != len(rec):
        raise OutputError(f"ITL spill holds {len(rec)} gaps for requests {lo}..{hi}, expected {int(offsets[-1])}")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(rec["ms"], pa.float64()))
