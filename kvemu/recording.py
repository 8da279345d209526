"""`kvemu record`: workload + model + GPU model + engine configuration -> trace file."""

from __future__ import annotations

import dataclasses

import numpy as np

from .engine import EngineConfig, make_timing, record_trace
from .engine.weights import make_placement
from .errors import ConfigError
from .models import resolve_model
from .output import check_destination
from .progress import Progress
from .units import MAX_ARRIVAL_SPAN_MS, check_number, span_text
from .workloads import load_workload

GIB = 1 << 30


def record_workload(workload_spec: str, model: str, out, *, max_requests=None, window_ms=None,
                    hash_block_tokens=None, seed=0, force=False, tier_policy="offload", gpu="H100-SXM",
                    gpus=None, block_tokens=16, max_batched_tokens=8192, max_num_seqs=256, hbm_kv_gib=None,
                    tier_capacity_gib=None, kv_dtype="bf16", weight_dtype="bf16", mfu=None, mbu=None,
                    step_overhead_us=None, tp=None, pp=None, ep=None, chunk_tokens=256, kv_layout="per-layer",
                    show_progress=True, time_scale=None, request_rate=None, weights_in_tier=None, cold_experts=None,
                    weight_stream="serial") -> dict:
    source_path = workload_spec.partition(":")[2].split(":")[0] if workload_spec.partition(":")[0] in (
        "mooncake", "azure") else None
    check_destination(out, force, inputs=[source_path] if source_path else [])
    geometry = resolve_model(model, kv_dtype)
    timing = make_timing(gpu, geometry, gpus, weight_dtype, mfu, mbu, step_overhead_us, tp=tp, pp=pp, ep=ep)
    weights = make_placement(geometry, weight_dtype, weights_in_tier=weights_in_tier, cold_experts=cold_experts,
                             stream=weight_stream, link=timing.gpu.link or None,
                             lanes=timing.gpus if timing.tp > 0 else 1)
    if weights is not None:
        timing = dataclasses.replace(timing, tier_weight_bytes=weights.placed_bytes)
    block_all_layers = geometry.block_bytes_per_layer(block_tokens) * geometry.layers if block_tokens > 0 else 0
    if block_tokens <= 0:
        raise ConfigError("--block-tokens must be positive")
    if hbm_kv_gib is not None:
        check_number(hbm_kv_gib, "--hbm-kv-gib", 0.0, 1e6, lo_open=True)
        hbm_bytes = hbm_kv_gib * GIB
    else:
        hbm_bytes = timing.hbm_kv_bytes()
        if hbm_bytes <= 0:
            raise ConfigError(
                f"{geometry.name} weights ({timing.weight_bytes / 1e9:.0f} GB) leave no KV space on "
                f"{timing.gpus} x {gpu}; use more --gpus or set --hbm-kv-gib"
            )
    if tier_capacity_gib is not None:
        check_number(tier_capacity_gib, "--tier-capacity-gib", 0.0, 1e9, lo_open=True)
    if not isinstance(chunk_tokens, int) or chunk_tokens < block_tokens or chunk_tokens % block_tokens:
        raise ConfigError(f"--chunk-tokens must be a positive multiple of --block-tokens ({block_tokens}), "
                          f"got {chunk_tokens}")
    if kv_layout not in ("per-layer", "cross-layer"):
        raise ConfigError(f"--kv-layout must be per-layer or cross-layer, got {kv_layout!r}")
    cfg = EngineConfig(
        transfer_chunk_tokens=chunk_tokens,
        kv_layout=kv_layout,
        tokens_per_block=block_tokens,
        max_num_batched_tokens=max_batched_tokens,
        max_num_seqs=max_num_seqs,
        tier_policy=tier_policy,
        hbm_kv_blocks=max(1, int(hbm_bytes // block_all_layers)),
        tier_capacity_blocks=None if tier_capacity_gib is None else max(1, int(tier_capacity_gib * GIB // block_all_layers)),
    )
    cfg.check()
    workload = load_workload(workload_spec, max_requests=max_requests, window_ms=window_ms,
                             hash_block_tokens=hash_block_tokens, seed=seed)
    scale = arrival_scale(workload.arrival_ms, time_scale, request_rate)
    if scale != 1.0:
        workload = dataclasses.replace(workload, arrival_ms=workload.arrival_ms * scale)
    prog = Progress("record", total=workload.n_requests, unit="requests") if show_progress else None
    meta = record_trace(workload, geometry, timing, cfg, out, force=force, progress=prog, time_scale=scale,
                        weights=weights)
    if prog is not None:
        prog.close(workload.n_requests)
    return meta


def arrival_scale(arrival_ms, time_scale=None, request_rate=None) -> float:
    """The factor arrival times are multiplied by: ``time_scale`` as given, or what brings the mean
    arrival rate to ``request_rate`` requests per second (one of the two; 1.0 for neither). The
    scaled arrivals must stay within the clock's span (workloads.MAX_ARRIVAL_SPAN_MS)."""
    scale = _arrival_scale(arrival_ms, time_scale, request_rate)
    arrival_ms = np.asarray(arrival_ms, np.float64)
    span = float(arrival_ms.max() - arrival_ms.min()) * scale if len(arrival_ms) else 0.0
    if not span <= MAX_ARRIVAL_SPAN_MS:
        how = f"--time-scale {time_scale}" if time_scale is not None else f"--request-rate {request_rate}"
        raise ConfigError(f"{how} stretches the arrivals over {span_text(span)}, more than the "
                          f"{span_text(MAX_ARRIVAL_SPAN_MS)} kvemu's nanosecond clock allows")
    return scale


def _arrival_scale(arrival_ms, time_scale, request_rate) -> float:
    if time_scale is not None and request_rate is not None:
        raise ConfigError("give --time-scale or --request-rate, not both")
    if request_rate is not None:
        arrival_ms = np.asarray(arrival_ms, np.float64)
        span_s = float(arrival_ms.max() - arrival_ms.min()) / 1e3 if len(arrival_ms) else 0.0
        if not (request_rate > 0 and np.isfinite(request_rate)):
            raise ConfigError(f"--request-rate must be a positive number of requests per second, got {request_rate}")
        if len(arrival_ms) < 2 or span_s <= 0:
            raise ConfigError("--request-rate needs requests that arrive over time; use --time-scale")
        return (len(arrival_ms) - 1) / span_s / request_rate
    if time_scale is None:
        return 1.0
    if not (isinstance(time_scale, (int, float)) and 0 < time_scale < 1e9 and np.isfinite(time_scale)):
        raise ConfigError(f"--time-scale must be a positive number, got {time_scale}")
    return float(time_scale)
