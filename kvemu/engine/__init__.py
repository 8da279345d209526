"""The serving-engine model that records traces: block tables, scheduler, GPU timing."""

from __future__ import annotations

import datetime as _dt

import numpy as np

from ..blockrule import prefix_hit_ratio
from ..errors import ConfigError
from ..models import ModelGeometry
from ..schema import list_column, write_trace
from .blocks import build_block_tables
from .compute import write_blob
from .load import load_from_entries
from .scheduler import ENGINE_MODEL, TIER_POLICIES, EngineConfig, simulate
from .timing import GPU_PRESETS, ROOFLINE_PARAMS, GpuTiming, make_timing

__all__ = ["EngineConfig", "TIER_POLICIES", "GPU_PRESETS", "make_timing", "record_trace"]


def record_trace(workload, model: ModelGeometry, timing: GpuTiming, cfg: EngineConfig, out, *,
                 force: bool = False, progress=None, time_scale: float = 1.0, weights=None,
                 deployment: dict | None = None) -> dict:
    """Run the engine model over a workload and write a trace to ``out``. Returns its metadata.
    ``time_scale``: the factor the workload's arrivals were multiplied by (recorded). ``weights``
    (engine.weights.WeightPlacement): weights in the tier, streamed every step (metadata ``weights``).
    ``deployment``: the prefill/decode deployment the trace is meant for (metadata ``deployment``,
    record_options.DeploymentOptions.to_meta); the steps recorded are this one instance's."""
    cfg.check()
    if int((workload.input_tokens + workload.output_tokens).max()) >= 2**31:
        raise ConfigError("a request has 2^31 tokens or more; traces store token counts as int32")
    tables = build_block_tables(workload.input_tokens, workload.output_tokens, workload.hash_offsets,
                                workload.hash_ids, workload.hash_block_tokens, cfg.tokens_per_block)
    run = simulate(tables, workload.arrival_ms, workload.input_tokens, workload.output_tokens, timing, cfg,
                   progress=progress, weights=weights)
    run_off, run_start, run_count = tables.runs()
    n = workload.n_requests
    requests = {
        "request_id": np.arange(n, dtype=np.int32),
        "arrival_ms": workload.arrival_ms,
        "input_tokens": workload.input_tokens.astype(np.int32),
        "output_tokens": workload.output_tokens.astype(np.int32),
        "cached_tokens": run.cached_tokens.astype(np.int32),
        "tier_hit_tokens": run.tier_hit_tokens.astype(np.int32),
        "block_start": list_column(run_off, run_start),
        "block_count": list_column(run_off, run_count.astype(np.int32)),
    }
    steps = {
        "step": np.arange(len(run.step_compute_ns), dtype=np.int32),
        "start_ns": run.step_start_ns,
        "compute_ns": run.step_compute_ns,
    }
    meta = {
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        # what closed-loop replay needs to schedule again: this engine model, its configuration
        # ("engine"), the GPU timing ("gpu") and the model ("model")
        "schedule": {"closed_loop": True, "source": "engine-model", "engine_model": ENGINE_MODEL},
        "load": _recorded_load(run, workload, timing),
        "model": model.to_dict(cfg.tokens_per_block),
        "workload": {
            "source": workload.source,
            "kind": workload.kind,
            "checksum": workload.checksum,
            "hash_block_tokens": workload.hash_block_tokens,
            "requests": n,
            "params": workload.params,
            "time_scale": time_scale,
            **_block_rule_meta(workload),
        },
        "engine": {**cfg.to_dict(), **run.stats},
        # the GPUs and their parallelism; the compute model's own parameters are its blob's
        "gpu": {k: v for k, v in timing.to_dict().items() if k not in ROOFLINE_PARAMS},
        "compute": write_blob(timing),
        "blocks": {"id_space": tables.id_space, "shared_id_space": tables.shared_id_space},
    }
    if getattr(workload, "sessions", None) is not None:
        # the session graph replay's --arrivals session releases requests by (kvemu.sessions)
        meta["sessions"] = workload.sessions.to_meta()
    if weights is not None:
        meta["weights"] = _weights_meta(weights, run)
    if deployment is not None:
        meta["deployment"] = deployment
    write_trace(out, meta, requests, steps, run.entries, force=force)
    return meta


def _block_rule_meta(workload) -> dict:
    """The block rule the workload was read with and the theoretical hit ratio under it
    (kvemu.blockrule), for the workloads that carry one."""
    if getattr(workload, "block_rule", None) is None:
        return {}

    return {"block_rule": workload.block_rule,
            "prefix_hit_ratio_unbounded": prefix_hit_ratio(workload.input_tokens, workload.hash_offsets,
                                                           workload.hash_ids, workload.hash_block_tokens)}


def _recorded_load(run, workload, timing: GpuTiming) -> dict | None:
    """The offered load against what the modelled GPUs served, on the recorded timeline."""
    arrival = np.round(np.asarray(workload.arrival_ms, np.float64) * 1e6).astype(np.int64)
    busy = run.step_compute_ns if run.step_busy_ns is None else run.step_busy_ns
    return load_from_entries([run.entries], arrival, run.step_start_ns, busy, f"{timing.gpus} x {timing.gpu.name}")


def _weights_meta(weights, run) -> dict:
    """The placement, and what its stream did to the recorded steps (modelled, on the host link)."""
    added = run.step_busy_ns - run.step_compute_ns
    return {**weights.to_dict(),
            "recorded": {"steps": int(len(added)), "stream_added_ns": int(added.sum()),
                         "mean_added_ns_per_step": float(added.mean()) if len(added) else 0.0,
                         "how": "modelled: bytes / link GB/s, composed with compute by `stream`"}}
