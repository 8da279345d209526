"""Closed-loop replay: the engine model schedules while the tier sets its clock (docs/replay.md).

Open-loop replay (``--schedule recorded``) keeps every recorded step and only stretches the
timeline. Here the engine model that recorded the trace (kvemu.engine: continuous batching, token
budget, chunked prefill, prefix cache, HBM capacity and eviction, tier policy) runs again, step by
step: each step is planned from the engine's state at its start, its KV operations are replayed
through the backend (measured or emulated), and the step's end as the backend timed it becomes the
engine's clock. Requests that arrived by then join the next step, so a slower tier changes the
batches, and a window of requests is replayed with everything before it (its history).

Steps that move no KV (decodes under ``offload``) take their modelled compute and do not call C;
C keeps the async store stream across calls, and every call starts at the engine's clock.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, fields

import numpy as np

from .engine.blocks import BlockTables
from .engine.scheduler import ENGINE_MODEL, EngineConfig, EngineLog, engine_steps
from .analysis import timing_from_meta
from .engine.timing import GpuTiming
from .errors import ConfigError, TraceError
from .schema import OPS, upgrade_v1_meta

SCHEDULES = ("closed", "recorded")
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
    return meta.get("schedule") or upgrade_v1_meta(meta)["schedule"]


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
    if chunk_blocks <= 1:
        present = np.zeros(t.id_space, bool)
        present[ids] = True
        return None, None, present
    key_of = np.zeros(t.id_space, np.int64 if t.id_space >= 2**31 else np.int32)
    off_of = np.zeros(t.id_space, np.uint16)
    off = pos % chunk_blocks
    key_of[ids] = t.ids[at - off]
    off_of[ids] = off
    present = np.zeros(t.id_space, bool)
    present[ids] = True
    return key_of, off_of, present


class ClosedLoop:
    """Runs the engine model with one instance's backend; what happened goes into ``acc``
    (replay._Accumulator), folded every FOLD_ROWS entries."""

    def __init__(self, inputs: EngineInputs, acc, selected: np.ndarray):
        self.inputs, self.acc, self.selected = inputs, acc, selected
        self.log = EngineLog(len(inputs.input_tokens))
        self.buf = {k: array("q") for k in _STEP_FIELDS}
        self.kv_rows: list = []       # (absolute entry rows, their C entry_out) of steps that called C
        self.step_base = 0            # engine step of buf's first step
        self.c_steps = 0
        self.end_ns = 0

    def run(self, backend, progress=None) -> dict:
        i = self.inputs
        gen = engine_steps(i.tables, i.arrival_ns, i.input_tokens, i.output_tokens, i.timing, i.cfg, self.log,
                           progress=progress, stop_after=self.selected)
        log, buf, acc = self.log, self.buf, self.acc
        one = np.zeros(1, np.int64)
        b_start, b_comp, b_end, b_d = buf["start"], buf["compute"], buf["end"], buf["step_ns"]
        b_load, b_store, b_read, b_stall = buf["load"], buf["store"], buf["read"], buf["stall"]
        try:
            plan = next(gen)
        except StopIteration:
            plan = None
        while plan is not None:
            start, comp, r0, r1, kv = plan
            if kv:
                lo, hi = r0 - log.taken, r1 - log.taken
                cols = log.cols
                e = {k: np.frombuffer(cols[k][lo:hi], np.int32) for k in ("request_id", *_OP_COLUMNS)}
                live = np.flatnonzero((e["load_count"] > 0) | (e["store_count"] > 0) | (e["read_count"] > 0))
                e = {k: v[live] for k, v in e.items()}
                e["step"] = np.zeros(len(live), np.int32)
                so, eo, _ = acc.c_call(backend, e, one, np.array([comp], np.int64), np.array([start], np.int64))
                s = so[0]
                end = int(s["end_ns"])
                b_d.append(int(s["step_ns"])); b_load.append(int(s["load_ns"])); b_store.append(int(s["store_ns"]))
                b_read.append(int(s["read_ns"])); b_stall.append(int(s["stall_ns"]))
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
            try:
                plan = gen.send(end)
            except StopIteration:
                plan = None
        self._fold()
        return {"steps": log.stats["steps"], "c_steps": self.c_steps, "end_ns": self.end_ns,
                "finished": log.stats["finished"], "hbm_evictions": log.stats["hbm_evictions"],
                "tier_evictions": log.stats["tier_evictions"], "entries": log.stats["entries"],
                "cached_tokens": log.cached, "tier_hit_tokens": log.tier_hit}

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
