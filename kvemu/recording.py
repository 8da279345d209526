"""`kvemu record`: workload + model + GPU model + engine configuration -> trace file (:func:`record`)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from .arguments import instance_arg, path_arg, text_arg
from .engine import EngineConfig, make_timing, record_trace
from .engine.kvgeometry import pool_accounting, pool_block_bytes
from .engine.compute import make_compute
from .engine.weights import make_placement
from .errors import ConfigError, OptionError
from .models import model_file, resolve_model
from .output import check_destination
from .progress import Progress
from .bounds import time_scale_problem
from .record_options import RecordOptions, request_rate_problem
from .units import MAX_ARRIVAL_SPAN_MS, span_text
from .workloads import load_workload, source_file

GIB = 1 << 30


def record(workload: str, model: str, out, options: RecordOptions | None = None) -> dict:
    """Record the KV access trace of ``workload`` (``mooncake:PATH``, ``azure:PATH``,
    ``synthetic:NAME[:key=value,...]``) served by the engine model on ``model`` (a preset or a
    HuggingFace config.json path) into ``out`` (a .parquet file), and return the trace's metadata.

    ``options`` (default: ``RecordOptions()``, `kvemu record`'s defaults) are checked first
    (:meth:`RecordOptions.check`, OptionError naming the field); what needs the model or the
    workload is checked as they are read (ConfigError, WorkloadError). Nothing is written on error.
    """
    o = RecordOptions() if options is None else instance_arg("options", options, RecordOptions)
    text_arg("workload", workload)
    if not isinstance(model, os.PathLike):
        text_arg("model", model)
    path_arg("out", out)
    w, g, e, wt = o.workload, o.gpu, o.engine, o.weights
    source_path = source_file(workload)
    config_path = model_file(model) if isinstance(model, str) else None
    check_destination(out, o.output.force, inputs=[p for p in (source_path, config_path) if p])
    o.check()
    _check_deployment(o)
    if g.dp_attention and wt.weights_in_tier:
        # every rank would stream its own copy of the attention weights placed in the tier
        raise OptionError("weights.weights_in_tier", "is not modelled with {gpu.dp_attention} (each rank would "
                                                     "stream its own copy of the attention weights in the tier)")
    geometry = resolve_model(model, e.kv_dtype)
    timing = make_timing(g.gpu, geometry, g.gpus, g.weight_dtype, g.mfu, g.mbu, g.step_overhead_us,
                         tp=g.tp, pp=g.pp, ep=g.ep, era=g.engine_era, dp_attention=g.dp_attention)
    weights = make_placement(geometry, g.weight_dtype, weights_in_tier=wt.weights_in_tier,
                             cold_experts=wt.cold_experts, stream=wt.stream, link=timing.gpu.link or None,
                             lanes=timing.gpus if timing.tp > 0 else 1)
    if weights is not None:
        timing = dataclasses.replace(timing, tier_weight_bytes=weights.placed_bytes)
    timing = make_compute(g.compute, timing, model, e.kv_dtype)
    # one pool block: a block of every layer, or of the growing KV groups of a model with windowed or
    # linear-attention layers (their bounded share is reserved per request: engine/kvgeometry.py)
    accounting = pool_accounting(geometry, e.block_tokens, e.chunk_tokens)
    block_all_layers = pool_block_bytes(geometry, e.block_tokens)
    # replay moves a full block of every layer per chunk (replay.arena.tier_capacity_of)
    chunk_all_layers = e.chunk_tokens // e.block_tokens * geometry.block_bytes_per_layer(e.block_tokens) * geometry.layers
    if e.tier_capacity_gib is not None and e.tier_capacity_gib * GIB < chunk_all_layers:
        # the bound of replay's --tier-capacity (replay.arena.tier_capacity_of): one transfer chunk
        raise OptionError("engine.tier_capacity_gib", f"must hold at least one transfer chunk of {geometry.name} "
                          f"({chunk_all_layers} bytes = {chunk_all_layers / GIB:.4g} GiB: {{engine.chunk_tokens}} "
                          f"{e.chunk_tokens} x {geometry.layers} layers), as replay's --tier-capacity must; got "
                          f"{e.tier_capacity_gib:g}")
    if e.hbm_kv_gib is not None:
        hbm_bytes = e.hbm_kv_gib * GIB
    else:
        hbm_bytes = timing.hbm_kv_bytes()
        if hbm_bytes <= 0:
            raise ConfigError(
                f"{geometry.name} weights ({timing.weight_bytes / 1e9:.0f} GB) leave no KV space on "
                f"{timing.gpus} x {g.gpu}; use more --gpus or set --hbm-kv-gib"
            )
    cfg = EngineConfig(
        transfer_chunk_tokens=e.chunk_tokens,
        kv_layout=e.kv_layout,
        tokens_per_block=e.block_tokens,
        max_num_batched_tokens=e.max_batched_tokens,
        max_num_seqs=e.max_num_seqs,
        tier_policy=e.tier_policy,
        tier_eviction=e.tier_eviction,
        hbm_kv_blocks=max(1, int(hbm_bytes // block_all_layers)),
        tier_capacity_blocks=None if e.tier_capacity_gib is None
        else max(1, int(e.tier_capacity_gib * GIB // block_all_layers)),
        **accounting,
    )
    cfg.check()
    requests = load_workload(workload, max_requests=w.max_requests, window_ms=w.window_ms,
                             hash_block_tokens=w.hash_block_tokens, seed=w.seed)
    scale = arrival_scale(requests.arrival_ms, w.time_scale, w.request_rate)
    if scale != 1.0:
        graph = requests.sessions
        if graph is not None:  # the gaps after a parent completes are on the same clock
            graph = dataclasses.replace(graph, gap_ms=graph.gap_ms * scale)
        requests = dataclasses.replace(requests, arrival_ms=requests.arrival_ms * scale, sessions=graph)
    prog = Progress("record", total=requests.n_requests, unit="requests") if o.output.show_progress else None
    meta = record_trace(requests, geometry, timing, cfg, out, force=o.output.force, progress=prog,
                        time_scale=scale, weights=weights, deployment=o.deployment.to_meta())
    if prog is not None:
        prog.close(requests.n_requests)
    return meta


def _check_deployment(o: RecordOptions) -> None:
    """What replay would refuse of the trace's deployment with this engine, refused at record time
    (replay.closed.disagg.check_disagg)."""
    d, policy = o.deployment, o.engine.tier_policy
    if d.prefill_instances is None:
        return
    if policy == "resident":
        raise OptionError("deployment.prefill_instances", "is not replayed on a resident trace yet (its KV lives "
                                                          "in the tier): give {engine.tier_policy} offload or none")
    if (d.transfer or "").partition(":")[0] == "pool" and policy != "offload":
        raise OptionError("deployment.transfer", f"pool needs {{engine.tier_policy}} offload: the prefill stores "
                                                 f"the KV into the pool (got {policy})")


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
        if request_rate_problem(request_rate):
            raise ConfigError(f"--request-rate {request_rate_problem(request_rate)}")
        if len(arrival_ms) < 2 or span_s <= 0:
            raise ConfigError("--request-rate needs requests that arrive over time; use --time-scale")
        return (len(arrival_ms) - 1) / span_s / request_rate
    if time_scale is None:
        return 1.0
    if time_scale_problem(time_scale):
        raise ConfigError(f"--time-scale {time_scale_problem(time_scale)}")
    return float(time_scale)
