"""What the closed loop schedules from: the engine model's inputs rebuilt from a trace the engine
model recorded (EngineInputs), whether a trace can be re-planned at all (schedule_source), and the
blocks the tier may hold by the chunk they move in (chunk_keys)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from ...analysis import timing_from_meta
from ...engine.compute import timing_from_compute_meta
from ...engine.blocks import BlockTables
from ...engine.scheduler import ENGINE_MODEL, EngineConfig
from ...engine.timing import GpuTiming
from ...errors import ConfigError, TraceError

SCHEDULES = ("closed", "recorded")
#: Where a prefix from the tier is loaded: inside the request's first prefill step, or asynchronously.
KV_LOADS = ("in-step", "async")


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
    if meta.get("compute"):  # recorded with a compute model other than the roofline: schedule with it again

        timing = timing_from_compute_meta(timing, meta["compute"])
    tpb = cfg.tokens_per_block
    shared_space = int(meta["blocks"].get("shared_id_space", 0))
    inp = trace.input_tokens.astype(np.int64)
    # only full input blocks are shareable, and only where the workload named its prefixes
    n_full = inp // tpb if shared_space > 0 else np.zeros(len(inp), np.int64)
    tables = BlockTables(tpb, trace.table_offsets, trace.table_ids, n_full, shared_space,
                         int(meta["blocks"]["id_space"]))
    arrival_ns = np.round(trace.arrival_ms * time_scale * 1e6).astype(np.int64)
    return EngineInputs(tables, arrival_ns, inp, trace.output_tokens.astype(np.int64), timing, cfg)


# Blocks chunk_keys expands at a time: its seven 8-byte temporaries per block then peak at about
# 7 MiB, whatever the trace's length (at 1 M blocks they were the replay's peak: 56 MiB, growing
# with the trace up to that size).
CHUNK_KEYS_BATCH = 1 << 17


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
    present = np.zeros(t.id_space, bool)
    key_of = off_of = None
    if chunk_blocks > 1:
        key_of = np.zeros(t.id_space, np.int64 if t.id_space >= 2**31 else np.int32)
        off_of = np.zeros(t.id_space, np.uint16)
    # requests a batch at a time (about CHUNK_KEYS_BATCH blocks): the per-block temporaries stay that
    # size, not the trace's (9 M blocks, 8 bytes each, several of them, on the full Mooncake trace)
    ends = np.cumsum(keep_len)
    r0 = 0
    while r0 < len(lens):
        r1 = max(r0 + 1, int(np.searchsorted(ends, (ends[r0 - 1] if r0 else 0) + CHUNK_KEYS_BATCH, side="right")))
        kl = keep_len[r0:r1]
        req = np.repeat(np.arange(r0, r1), kl)
        pos = np.arange(int(kl.sum()), dtype=np.int64) - np.repeat(np.cumsum(kl) - kl, kl)
        at = t.offsets[:-1][req] + pos
        ids = t.ids[at]
        present[ids] = True
        if key_of is not None:
            off = pos % chunk_blocks
            key_of[ids] = t.ids[at - off]
            off_of[ids] = off
        r0 = r1
    return key_of, off_of, present
