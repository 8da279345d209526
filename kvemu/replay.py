"""Replay a trace through a C backend and compose the serving timeline from what was measured.

Python streams the trace's entries and prepares whole batches (the batch's own block tables
mapped to arena slots, entry and step arrays) and hands them to C, which performs and times every
block access. Python never loops per access.

Time model (docs/replay.md): C adds the measured KV time of a step to its modelled GPU compute
layer by layer, serially or pipelined (``overlap``). Closed loop (kvemu.closedloop) re-plans each
step with the engine model from the clock those times produced; the recorded schedule keeps each
step's batch and rebuilds the timeline from the step durations (a step starts when the previous
one ended, and not before its requests arrived). Request metrics follow from the step end times.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import platform
import re
import resource
import socket
import tempfile
import threading
import time
import uuid

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__
from .analysis import (TOTAL_COLUMNS, add_entry_totals, gpus_text, load_line, offered_load, timing_from_meta,
                       trace_summary)
from .closedloop import (KV_LOADS, ROUTING, SCHEDULES, ClosedLoop, Router, TierQueue, chunk_keys, engine_inputs, schedule_source,
                         shared_tier)
from .errors import ConfigError, KvemuError, OutputError, ResourceLimitError, TraceError
from .engine.weights import weights_from_meta
from .figures import run_figures
from .links import (DEFAULT_LINK, DEFAULT_STORE_INFLIGHT_BYTES, DEFAULT_STORE_MODE, STORE_MODES, effective_link,
                    get_link, is_staged)
from .output import atomic_output, check_destination, make_folders, remove_empty_folders
from .integrity import READ_OPTIONS, ResultsWriter, write_results
from .schema import (METADATA_KEY, OPS, PHASE_PREFILL, RESULTS_FORMAT, RESULTS_VERSION, file_sha256, iter_entries,
                     read_trace)
DEFAULT_MAX_MEMORY = 4 << 30
# LMCache moves KV in chunks of 256 tokens (LMCACHE_CHUNK_SIZE); the transfer unit of traces that do not
# record one.
DEFAULT_CHUNK_TOKENS = 256
MEMORY_TIERS = ("dram", "numa", "mmap")
# Pointer-chase hops that measure a memory tier's idle latency for the in-place read bound (~30-60 ms).
LATENCY_HOPS = 100_000
SHARING = ("shared", "replicated")
#: Serving instances one replay runs (a thread, a backend context and a spill file each).
MAX_INSTANCES = 256
STEP_BATCH_ENTRIES = 1 << 14
TOUCH_BATCH_ENTRIES = 1 << 14
# Block-layer accesses per C call: bounds how long a signal waits (about a second on DRAM).
ACCESSES_PER_CALL = 1 << 17
# Inter-token gaps go to a temporary file as they are measured (request id, gap in ms) and come
# back a row group of results at a time: at most this many values, or RESULT_GROUP_ROWS requests.
ITL_RECORD = np.dtype([("request", "<i4"), ("ms", "<f8")])
ITL_VALUES_PER_GROUP = 1 << 18
RESULT_GROUP_ROWS = 1 << 16


def host_facts() -> dict:
    facts = {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "page_size": os.sysconf("SC_PAGE_SIZE"),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    facts["memory_bytes"] = _meminfo("MemTotal")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            facts["thp"] = f.read().strip()
    except OSError:
        pass
    return facts


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def layer_plan(n_layers: int, replay_layers: int | None) -> tuple[list[int], np.ndarray]:
    """Replay ``k`` evenly spaced layers; each stands for a contiguous group of model layers."""
    k = n_layers if replay_layers is None else replay_layers
    if not 1 <= k <= n_layers:
        raise ConfigError(f"--layers must be between 1 and the model's {n_layers} layers")
    bounds = (np.arange(k + 1) * n_layers) // k
    span = np.diff(bounds).astype(np.uint32)
    return bounds[:-1].tolist(), span


def _select_requests(trace, request_range, arrival_range) -> np.ndarray:
    sel = np.ones(trace.n_requests, bool)
    if request_range is not None:
        lo, hi = request_range
        sel &= (trace.request_id >= lo) & (trace.request_id < hi)
    if arrival_range is not None:
        lo, hi = arrival_range
        sel &= (trace.arrival_ms >= lo) & (trace.arrival_ms < hi)
    if not sel.any():
        raise ConfigError("the request window selects no request of this trace")
    return sel


def _replay_once(trace_path, backend_spec: str, out, *, overlap: bool = False, request_range=None,
                 arrival_range=None, replay_layers: int | None = None, max_memory: int = DEFAULT_MAX_MEMORY,
                 label: str | None = None, force: bool = False, progress=None, emulate_missing: bool = False,
                 warn=None, instances: int = 1, sharing: str = "shared", run_id: str | None = None,
                 link: str = DEFAULT_LINK, store_mode: str = DEFAULT_STORE_MODE, store_inflight_bytes: int = DEFAULT_STORE_INFLIGHT_BYTES,
                 chunk_tokens: int | None = None, tier_capacity_bytes: int | None = None,
                 layout: str | None = None, schedule: str | None = None, time_scale: float | None = None,
                 request_rate: float | None = None, routing: str = "round-robin", kv_load: str = "in-step") -> dict:
    """Replays a trace, writes the results file, returns its metadata.

    ``emulate_missing``: a backend that cannot run here (BackendUnavailable when opening or
    preparing it) is replaced by its emulated counterpart (profiles.counterpart_spec) and the
    results say so. ``warn(message)`` is called for each warning as it arises (a substitution,
    accesses of an emulated tier that this host could not make as fast as its profile); the
    warnings are also recorded in the results' metadata.

    ``dataset``: instead of ``out``, a folder holding a Hive-partitioned dataset of results: the
    file goes to ``DATASET/backend=NAME/host=HOST/run_id=ID/results.parquet`` (see dataset_path).

    ``instances``: N serving instances (emulated GPUs) replay the trace together, one thread
    each, requests spread round-robin (request i on instance i mod N). ``sharing="shared"``: one
    tier arena holds every block once and all instances touch it concurrently;
    ``"replicated"``: each instance has its own arena with a copy of every block it uses.

    The data path (docs/replay.md): ``link`` (kvemu.links) bounds every transfer; ``store_mode``
    ``async`` issues stores into a stream that overlaps later compute, stalling past
    ``store_inflight_bytes`` in flight, ``serial`` keeps them on the step's critical path;
    ``chunk_tokens`` is the transfer unit (default: the trace's, else 256 tokens as LMCache).

    ``schedule`` (kvemu.closedloop): ``closed`` runs the engine model again, each step planned from
    the state the tier's KV times produced (the default for traces the engine model recorded, with
    one instance); ``recorded`` keeps the trace's steps and stretches the timeline (real-run traces,
    several instances). ``time_scale`` multiplies arrival times, ``request_rate`` sets the mean
    arrival rate in requests per second (one of the two; closed loop only). ``routing``: how closed
    loop sends requests to instances (closedloop.ROUTING). ``kv_load``: ``in-step`` loads a prefix
    from the tier inside the request's first prefill step (as recorded); ``async`` on a load stream
    of its own while running requests go on (vLLM's asynchronous KV loading; closed loop only).
    """
    from .backends import parse_spec

    link_profile = get_link(link)
    if store_mode not in STORE_MODES:
        raise ConfigError(f"--store-timing must be one of {', '.join(STORE_MODES)}")
    if not isinstance(store_inflight_bytes, int) or not 1 <= store_inflight_bytes <= 1 << 50:
        raise ConfigError("--store-inflight must be between 1 byte and 1 PiB")
    if not isinstance(instances, int) or not 1 <= instances <= MAX_INSTANCES:
        raise ConfigError(f"--instances must be from 1 to {MAX_INSTANCES} (one thread and one spill file each), "
                          f"got {instances}")
    if sharing not in SHARING:
        raise ConfigError(f"--sharing must be one of {', '.join(SHARING)}")

    backend_name, backend_args = parse_spec(backend_spec)
    if instances > 1 and backend_name in MEMORY_TIERS and "workers=" not in backend_args:
        # one thread per instance, as a GPU per instance: pools of several would pin every instance's
        # replaying thread to the same first CPU
        backend_spec = f"{backend_spec}{',' if backend_args else ':'}workers=1"
    run_id = run_id or uuid.uuid4().hex[:12]
    check_destination(out, force, inputs=[trace_path])
    raise_fd_limit(instances)
    wall0 = time.perf_counter()
    trace = read_trace(trace_path)
    h = trace.header
    n_layers = h.layers
    block_bytes = h.block_bytes_per_layer
    selected = _select_requests(trace, request_range, arrival_range)
    sched_src = schedule_source(h.meta)
    if schedule is None:
        schedule = "closed" if sched_src["closed_loop"] else "recorded"
        schedule_from = "default"
    else:
        schedule_from = "--schedule"
    if schedule not in SCHEDULES:
        raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    closed = schedule == "closed"
    if routing not in ROUTING:
        raise ConfigError(f"--routing must be one of {', '.join(ROUTING)}, got {routing!r}")
    if kv_load not in KV_LOADS:
        raise ConfigError(f"--kv-load must be one of {', '.join(KV_LOADS)}, got {kv_load!r}")
    if kv_load == "async" and not closed:
        raise ConfigError("--kv-load async needs --schedule closed: the recorded schedule loads where it was recorded")
    if routing != "round-robin" and not closed:
        raise ConfigError("--routing needs --schedule closed: the recorded schedule spreads requests round-robin")
    time_scale, load_from = _time_scale(trace, time_scale, request_rate, closed)
    arrival_ms = trace.arrival_ms * time_scale if time_scale != 1.0 else trace.arrival_ms
    arrival_ns = np.round(arrival_ms * 1e6).astype(np.int64)

    # Pass 1 over the entries: the step range the selected requests span.
    first_step = np.full(trace.n_requests, np.iinfo(np.int64).max)
    last_step = np.full(trace.n_requests, -1, np.int64)
    totals: dict = {}  # the trace summary's entry totals, while the entries stream by
    # (every entry passes the checks `trace validate` runs, and this full pass verifies their content
    # digest: nothing below runs on entries the validator would refuse)
    for e in iter_entries(trace, columns=("step", "request_id", *TOTAL_COLUMNS)):
        np.minimum.at(first_step, e["request_id"], e["step"])
        np.maximum.at(last_step, e["request_id"], e["step"])
        add_entry_totals(totals, e)
    if np.any(last_step[selected] < 0):
        raise ConfigError("some selected requests never run in this trace (incomplete trace?)")
    s0 = int(first_step[selected].min())
    s1 = int(last_step[selected].max())
    n_steps = s1 - s0 + 1
    # Every request running in that span is replayed (its KV traffic loads the tier); metrics are
    # reported for the selected requests, whose steps all lie inside the span.
    involved = (first_step <= s1) & (last_step >= s0)
    inputs = None
    if closed:
        # The engine replans from the first request; the tier may hold the blocks of every request that
        # arrives before the selected ones finished in the recorded run (a slower tier lets more in: the
        # arena's LRU takes them).
        inputs = engine_inputs(trace, time_scale)
        recorded_end = int(trace.start_ns[s1] + trace.compute_ns[s1])
        involved = inputs.arrival_ns <= max(recorded_end * time_scale, int(inputs.arrival_ns[selected].max()))
        s0 = 0
    layout, layout_from = _layout(h, layout)
    if layout == "cross-layer" and replay_layers not in (None, n_layers):
        raise ConfigError("the cross-layer layout moves every layer of a chunk in one transfer: replay all layers "
                          "(no --layers), or use --kv-layout per-layer")
    first_layers, span = layer_plan(n_layers, replay_layers)
    block_tokens = _block_tokens(h)
    chunk_tokens, chunk_from = _chunk_tokens(h, chunk_tokens, block_tokens)
    chunk_blocks = chunk_tokens // block_tokens
    # Pass 2: the blocks each instance touches, which sizes the arenas and maps ids to slots.
    if closed:
        key_of, off_of, may_hold = chunk_keys(inputs, chunk_blocks, involved)
        # any instance may be routed any request
        touched = np.broadcast_to(may_hold, (instances, len(may_hold)))
    else:
        touched, key_of, off_of = _touched_blocks(trace, s0, s1, instances, chunk_blocks)
    virtual = backend_name == "vemu"  # virtual time: no arena, slots unused
    views = _instance_views(touched, instances, sharing, virtual, key_of, off_of, chunk_blocks)
    # The arena is the tier: as many chunks as the tier holds (given, recorded, or what --max-memory
    # allows when the touched chunks do not fit), its slots reused least recently used first.
    slot_bytes = chunk_blocks * len(span) * block_bytes
    capacity, capacity_from = _tier_capacity(h, tier_capacity_bytes, chunk_blocks, n_layers * block_bytes)
    tier_slots = pending_warning = None
    needed = max(v["n_slots"] for v in views) // chunk_blocks
    # An arena in memory is bounded by --max-memory: a tier the user did not size (unbounded, or as
    # recorded) that needs more is replayed as one of what fits. A file tier (uring) is bounded by its
    # disk instead, and vemu has no arena.
    in_memory = backend_name not in ("uring", "vemu")
    fits = max(int(max_memory // slot_bytes), 1) if in_memory else None
    want = needed if capacity is None else min(capacity, needed)
    if fits is not None and want > fits and capacity_from != "--tier-capacity":
        pending_warning = (f"the tier ({capacity_from}) needs a {want * slot_bytes / 2**30:.2f} GiB arena for the "
                           f"{needed} chunks this replay {'may touch' if closed else 'touches'}; "
                           f"--max-memory allows {fits} "
                           f"({fits * slot_bytes / 2**30:.2f} GiB), so the arena stands for a tier of that size and "
                           f"reuses the slots of what it evicts (LRU); give --tier-capacity or a larger --max-memory "
                           f"to change it")
        capacity, capacity_from = fits, "--max-memory"
    if capacity is not None and capacity < needed:
        from .backends import TierSlots

        key_space = int(h.meta["blocks"]["id_space"]) or 1
        shared_lru = TierSlots(capacity, key_space) if instances == 1 or sharing == "shared" else None
        tier_slots = [shared_lru or TierSlots(capacity, key_space) for _ in range(instances)]
        for v in views:
            v["n_slots"], v["slot_of"] = capacity * chunk_blocks, None
    # Weights in the tier (engine/weights.py): a weight region after the KV slots of every arena
    placement = weights_from_meta(h.meta)
    w_blocks = 0
    if placement is not None:
        w_blocks = _WeightStream.region_blocks(placement, n_layers, block_bytes, chunk_blocks)
        for v in views:
            v["weight_base"] = v["n_slots"]
            v["n_slots"] += w_blocks
        if placement.stream == "overlap" and not overlap:
            overlap = True  # the engine prefetched weights a layer ahead: loads run in a fetch stream
    arena_slots = [v["n_slots"] for v in views if v["owns_arena"]]
    arena_bytes = sum(arena_slots) * len(span) * block_bytes
    n_slots = sum(arena_slots)
    _check_arena_fits(backend_spec, arena_bytes, n_slots, len(span), block_bytes, max_memory)

    warnings: list[str] = []
    lock = threading.Lock()

    def _warn(message: str) -> None:
        with lock:
            warnings.append(message)
            if warn is not None:
                warn(message)

    if pending_warning:
        _warn(pending_warning)
    owner = np.arange(trace.n_requests) % instances
    lru_lock = threading.Lock()
    accs = [_Accumulator(trace, s0, n_steps, selected if closed else selected & (owner == i), views[i]["slot_of"], span,
                         None if tier_slots is None else (tier_slots[i], key_of, off_of, chunk_blocks, lru_lock))
            for i in range(instances)]
    if placement is not None:
        for acc, v in zip(accs, views):
            acc.weights = _WeightStream(placement, v["weight_base"], w_blocks, block_bytes, n_layers)
    timing = {"link": link_profile, "store_mode": store_mode, "store_inflight_bytes": store_inflight_bytes}
    geometry = (n_layers, len(span), overlap, chunk_blocks, layout)
    if instances > 1 and not closed:
        # a recorded step is one GPU's batch: each instance computes only its own requests' entries
        try:
            model = (timing_from_meta(h.meta), h.meta.get("engine", {}).get("tier_policy") == "resident")
        except TraceError:
            model = None
            _warn("the trace has no GPU compute model: each instance is charged the whole recorded step's compute")
        for acc in accs:
            acc.compute_model = model
    closed_stats = None
    if closed:
        id_space = trace.header.meta["blocks"]["id_space"]
        for acc in accs:
            acc.touched = np.zeros(id_space, bool)
        body, closed_stats, router = _closed_body(inputs, accs, selected, instances, sharing, routing, backend_name,
                                                  backend_args, block_bytes * n_layers, kv_load == "async")
        outcome = _run_instances(views, accs, trace, s0, s1, backend_spec, geometry, block_bytes, emulate_missing,
                                 _warn, progress, n_steps, timing, body=body,
                                 on_error=None if router is None else router.fail)
        closed_stats = _closed_totals(closed_stats, router, inputs)
        if router is not None:
            for i, acc in enumerate(accs):
                acc.selected = selected & (router.owner == i)
        s1 = closed_stats["steps"] - 1
        n_steps = closed_stats["steps"]
        involved = np.logical_or.reduce([acc.first_start < np.iinfo(np.int64).max for acc in accs])
        touched = np.stack([acc.touched for acc in accs]) if instances > 1 else accs[0].touched[None, :]
    else:
        outcome = _run_instances(views, accs, trace, s0, s1, backend_spec, geometry, block_bytes, emulate_missing,
                                 _warn, progress, n_steps, timing)
    backend_spec, requested, because = outcome["spec"], outcome["requested"], outcome["because"]
    facts, ops_meta, mode = outcome["facts"][0], outcome["ops"], outcome["mode"]
    for f in outcome["facts"]:
        floor = _floor_warning(backend_spec, f)
        if floor:
            _warn(floor)
    misses = sum(acc.load_misses for acc in accs)
    if misses:
        _warn(f"{misses} block loads found their chunk evicted from the tier of {capacity} chunks "
              f"({capacity_from}): the recorded engine found them in a larger tier; they are timed as loads "
              f"(tier.load_misses_blocks)")

    block_all_layers = block_bytes * n_layers
    parts, ends, arrivals = [], [], []
    for i, acc in enumerate(accs):
        sel_idx = np.flatnonzero(acc.selected)
        if len(sel_idx) == 0:
            continue
        part, end_i = _request_rows(trace, acc, sel_idx, arrival_ns, arrival_ms, block_all_layers)
        if instances > 1:
            part = part.append_column("instance", pa.array(np.full(len(sel_idx), i, np.int16)))
        parts.append(part)
        ends.append(end_i)
        arrivals.append(arrival_ns[sel_idx].min())
    rows = parts[0] if len(parts) == 1 else pa.concat_tables(parts).sort_by("request_id")
    compute_ns = sum(acc.compute_total_ns for acc in accs)
    summary = trace_summary(trace, prefix_hits=False, totals=totals)
    load = _replayed_load(accs, selected, arrival_ns, h)
    if load is not None and load["overloaded"]:
        _warn(load_line(load))
    total_ns = sum(acc.total_ns for acc in accs)
    policy = h.meta.get("engine", {}).get("tier_policy")
    meta = {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "creator": f"kvemu {__version__}",
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "run_id": run_id,
        "label": label or (f"{backend_spec}/{policy}{'+overlap' if overlap else ''}"
                           f"{'' if link == DEFAULT_LINK else '@' + link}"
                           f"{'+serial-stores' if store_mode == 'serial' else ''}"
                           f"{_weights_label(placement)}"),
        # Reports know two modes; virtual time is an emulation too, and says so in `virtual`.
        "backend": {"spec": backend_spec, "name": facts.get("backend", backend_spec.split(":")[0]),
                    "mode": "emulated" if mode.startswith("emulated") else mode,
                    "virtual": mode == "emulated-virtual", "facts": facts,
                    "requested": requested, "substituted_because": because},
        "warnings": warnings,
        "trace": {
            "path": os.fspath(trace_path),
            "sha256": file_sha256(trace_path),
            "size_bytes": os.path.getsize(trace_path),
            "version": h.meta["version"],
            "model": h.model,
            "workload": {k: v for k, v in h.meta.get("workload", {}).items() if k != "params"},
            "engine": h.meta.get("engine", {}),
            "gpu": h.meta.get("gpu", {}),
            "summary": summary,
        },
        "host": host_facts(),
        "load": load,
        "schedule": {**_schedule_meta(schedule, schedule_from, sched_src, time_scale, load_from, closed_stats, h),
                     "kv_load": kv_load},
        "params": {
            "overlap": overlap,
            "max_memory_bytes": max_memory,
            "reductions": {
                "requests": list(request_range) if request_range else None,
                "arrival_ms": list(arrival_range) if arrival_range else None,
                "selected_requests": int(selected.sum()),
                "replayed_requests": int(involved.sum()),
                "steps": [s0, s1],
                "layers": {"replayed": first_layers, "span": span.tolist(), "of": n_layers},
            },
            "arena_bytes": arena_bytes,
            "arena_blocks": n_slots,
            "instances": instances,
            "sharing": sharing if instances > 1 else None,
        },
        "tier": {**_tier_footprint(touched, instances, len(span) * block_bytes, arena_slots),
                 "capacity_chunks": capacity, "capacity_from": capacity_from,
                 "capacity_bytes": None if capacity is None else capacity * chunk_blocks * n_layers * block_bytes,
                 "slots_reused": tier_slots is not None,
                 "evictions": sum({id(t): t.evictions for t in tier_slots}.values()) if tier_slots else 0,
                 "load_misses_blocks": sum(acc.load_misses for acc in accs)},
        "steps": {
            "count": n_steps,
            "total_ns": total_ns,
            "compute_ns": compute_ns,
            "kv_stall_ns": total_ns - compute_ns,
            **{f"kv_{op}_ns": sum(acc.kv_total_ns[op] for acc in accs) for op in OPS},
        },
        "ops": ops_meta,
        "datapath": {
            "link": (outcome["link"] or link_profile).to_dict(),
            "link_requested": link_profile.name,
            "staged": outcome["staged"],
            "store_timing": store_mode,
            "store_inflight_bytes": store_inflight_bytes if store_mode == "async" else None,
            "overlap_loads": overlap,
            "transfer": {"chunk_tokens": chunk_tokens, "chunk_blocks": chunk_blocks, "block_tokens": block_tokens,
                         "layout": layout, "layout_from": layout_from, "chunk_tokens_from": chunk_from},
            "workers": facts.get("workers"),
            "tier_latency_ns": outcome["tier_latency_ns"],
            "tier_latency_from": outcome["tier_latency_from"],
            "ops": outcome["datapath_ops"],
            "stores_drain_ns": outcome["stores_drain_ns"],
        },
        "instance_ops": _instance_ops(outcome["instance_ops"], closed_stats) if instances > 1 else None,
        "duration_s": float((max(ends) - min(arrivals)) / 1e9),
        "wall_s": round(time.perf_counter() - wall0, 3),
        # the arena's allocation and pre-fault, apart from the replay (the tier exists before serving)
        "prefault_s": round(outcome["prepare_s"], 3),
    }
    meta["figures"] = run_figures(meta)
    if placement is not None:
        meta["weights"] = _weights_results(placement, accs, meta["figures"].get("kind"), w_blocks, overlap, n_steps)
    with atomic_output(out, force=force, inputs=[trace_path]) as tmp:
        _write_rows(tmp, rows, accs, {METADATA_KEY: json.dumps(meta, sort_keys=True).encode()})
    for acc in accs:
        acc.close()
    return {**meta, "results_path": str(out)}  # where it went (with --dataset, chosen here)


MAX_REPEAT = 100


def replay_trace(trace_path, backend_spec: str, out, *, repeat: int = 1, **options) -> dict:
    """Replays a trace (see _replay_once for every option), ``repeat`` times: the results are the
    repetition with the median median-TTFT, and their metadata's ``repetitions`` holds every
    repetition's figures (metrics.repetition_figures), so that the
    report can show the spread. Repetitions are replays from scratch: a fresh backend each time."""
    if not isinstance(repeat, int) or not 1 <= repeat <= MAX_REPEAT:
        raise ConfigError(f"--repeat must be an integer from 1 to {MAX_REPEAT}, got {repeat!r}")
    dataset = options.pop("dataset", None)
    if dataset is None:
        if out is None:
            raise ConfigError("an output is needed: --out FILE or --dataset DIR")
        return _replay_repetitions(trace_path, backend_spec, out, repeat, options)
    if out is not None:
        raise ConfigError("give either --out or --dataset, not both")
    run_id = uuid.uuid4().hex[:12]
    out = dataset_path(dataset, backend_spec, run_id)
    # the partition folders are made for this run and removed again if it writes nothing
    created = make_folders(out.parent)
    try:
        return _replay_repetitions(trace_path, backend_spec, out, repeat, {**options, "run_id": run_id})
    except BaseException:
        remove_empty_folders(created)
        raise


def _replay_repetitions(trace_path, backend_spec: str, out, repeat: int, options: dict) -> dict:
    if repeat == 1:
        return _replay_once(trace_path, backend_spec, out, **options)
    from . import metrics

    force = options.get("force", False)
    check_destination(out, force, inputs=[trace_path])
    folder = os.path.dirname(os.path.abspath(out))
    temps, figures = [], []
    try:
        for i in range(repeat):
            fd, tmp = tempfile.mkstemp(prefix=f".kvemu-rep{i}-", suffix=".parquet", dir=folder)
            os.close(fd)
            os.unlink(tmp)
            temps.append(tmp)
            meta = _replay_once(trace_path, backend_spec, tmp, **{**options, "force": False})
            figures.append(metrics.repetition_figures(pq.read_table(tmp, **READ_OPTIONS), meta))
        ttft = [f["median_ttft_ms"] for f in figures]
        chosen = int(np.argsort(ttft, kind="stable")[(len(ttft) - 1) // 2])
        table = pq.read_table(temps[chosen], **READ_OPTIONS)
        meta = json.loads(table.schema.metadata[METADATA_KEY])
        meta["repetitions"] = {"n": repeat, "chosen": chosen, "rule": "the repetition with the median median TTFT",
                               "runs": figures}
        with atomic_output(out, force=force, inputs=[trace_path]) as dst:
            write_results(dst, table, {METADATA_KEY: json.dumps(meta, sort_keys=True).encode()})
    finally:
        for t in temps:
            try:
                os.unlink(t)
            except FileNotFoundError:
                pass
    return {**meta, "results_path": str(out)}


def _write_rows(path, rows: pa.Table, accs, metadata: dict) -> None:
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
            acc.spill.seek(0)
            while True:
                rec = np.fromfile(acc.spill, ITL_RECORD, count=ITL_VALUES_PER_GROUP)
                if len(rec) == 0:
                    break
                keep = (rec["request"] >= lo) & (rec["request"] <= hi)
                if keep.any():
                    found.append(rec[keep])
        except OSError as e:
            raise spill_error(e) from None
    rec = np.concatenate(found) if found else np.zeros(0, ITL_RECORD)
    rec = rec[np.argsort(rec["request"], kind="stable")]  # one request's gaps stay in token order
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    if offsets[-1] != len(rec):
        raise OutputError(f"ITL spill holds {len(rec)} gaps for requests {lo}..{hi}, expected {int(offsets[-1])}")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(rec["ms"], pa.float64()))


def _partition_value(text: str) -> str:
    """A Hive partition value that is a safe single path component."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "unknown"


def backend_label(backend_spec: str) -> str:
    """The backend partition value: the spec without paths (``emu:cxl-pool`` -> ``emu-cxl-pool``)."""
    name, _, args = backend_spec.partition(":")
    first = args.split(",")[0]
    return _partition_value(name if name in ("dram", "mmap", "uring") or not first else f"{name}-{first}")


def partition_folder(dataset, backend_spec: str, host: str, run_id: str) -> Path:
    """``DATASET/backend=…/host=…/run_id=…``: the layout DuckDB, Polars, pandas and pyarrow read as
    one table with those three partition columns."""
    return (Path(dataset) / f"backend={backend_label(backend_spec)}" / f"host={_partition_value(host)}"
            / f"run_id={run_id}")


def dataset_path(dataset, backend_spec: str, run_id: str) -> Path:
    """Where a run of this host goes in a results dataset: its partition folder's results.parquet
    (not created here: see output.make_folders)."""
    return partition_folder(dataset, backend_spec, socket.gethostname(), run_id) / "results.parquet"


def _request_rows(trace, acc, sel_idx, arrival_ns, arrival_ms, block_all_layers):
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
        "cached_tokens": pa.array(trace.cached_tokens[sel_idx].astype(np.int32)),
        "ttft_ms": pa.array(ttft),
        "tpot_ms": pa.array(tpot),
        "e2el_ms": pa.array(e2el),
        "queue_ms": pa.array((acc.first_start[sel_idx] - arr) / 1e6),
        "compute_ms": pa.array(acc.req_compute[sel_idx] / 1e6),
        "kv_load_ms": pa.array(acc.req_kv["load"][sel_idx] / 1e6),
        "kv_store_ms": pa.array(acc.req_kv["store"][sel_idx] / 1e6),
        "kv_read_ms": pa.array(acc.req_kv["read"][sel_idx] / 1e6),
        "kv_stall_ms": pa.array(acc.req_stall[sel_idx] / 1e6),
        "kv_bytes_loaded": pa.array(acc.req_blocks["load"][sel_idx] * block_all_layers),
        "kv_bytes_stored": pa.array(acc.req_blocks["store"][sel_idx] * block_all_layers),
        "kv_bytes_read": pa.array(acc.req_blocks["read"][sel_idx] * block_all_layers),
    })
    return table, int(acc.last_end_ns[sel_idx].max())


def _instance_views(touched: np.ndarray, instances: int, sharing: str, virtual: bool, key_of=None, off_of=None,
                    chunk_blocks: int = 1) -> list[dict]:
    """What each instance replays on: its arena's size in blocks, whether it owns that arena (the
    first instance of a shared tier; every replicated one), and the map from block id to arena
    slot (None in virtual time, where slots are never used). With chunks of several blocks, each
    touched chunk gets chunk_blocks consecutive slots, its blocks at their offsets, so that the C
    replay moves a chunk's blocks as one transfer."""
    if instances == 1 or sharing == "shared":
        rows, owns = [np.logical_or.reduce(touched, axis=0)] * instances, [i == 0 for i in range(instances)]
    else:
        rows, owns = list(touched), [True] * instances
    views = []
    for row, own in zip(rows, owns):
        if key_of is None:
            n_slots = max(int(np.count_nonzero(row)), 1)
        else:
            chunks = np.zeros(len(row), bool)
            chunks[key_of[row]] = True
            n_slots = max(int(np.count_nonzero(chunks)), 1) * chunk_blocks
        slot_of = None
        # virtual time moves no byte, but its transfers are cut where a real arena's would be
        if not virtual or key_of is not None:
            if key_of is None:
                # dense slots in id order; an id no entry touches shares a slot and is never accessed
                slot_of = np.maximum(np.cumsum(row, dtype=np.int64) - 1, 0).astype(np.uint32)
            else:
                chunk_index = np.maximum(np.cumsum(chunks, dtype=np.int64) - 1, 0)
                slot_of = np.where(row, chunk_index[key_of] * chunk_blocks + off_of, 0).astype(np.uint32)
        views.append({"n_slots": n_slots, "owns_arena": own, "slot_of": slot_of})
    return views


def _tier_footprint(touched: np.ndarray, instances: int, bytes_per_block: int, arena_slots: list[int]) -> dict:
    """Tier bytes the replayed span needs with one shared pool and with per-instance copies, and
    what this run allocated (every arena is pre-faulted, so allocated is resident)."""
    shared = int(np.count_nonzero(np.logical_or.reduce(touched, axis=0)))
    replicated = int(np.count_nonzero(touched))
    return {"instances": instances, "shared_bytes": shared * bytes_per_block,
            "replicated_bytes": replicated * bytes_per_block,
            "resident_bytes": sum(arena_slots) * bytes_per_block, "note": "bytes of the replayed layers only"}


def _instance_spec(spec: str, i: int, sharing: str, attached: bool) -> str:
    """The backend spec instance i opens: its own file for replicated file-backed tiers; an
    attached mmap instance maps the owner's existing file."""
    name, _, args = spec.partition(":")
    if name not in ("mmap", "uring"):
        return spec
    path, comma, rest = args.partition(",")
    if attached:  # the owner created the file
        return f"{name}:{path},{rest + ',' if rest else ''}size=existing"
    if sharing == "replicated" and i > 0:
        return f"{name}:{path}.{i}{comma}{rest}"
    return spec


def _tier_latency(backend) -> tuple[float, str]:
    """The tier medium's idle latency for the in-place read bound: an emulated tier's profile, a
    pointer chase over a memory tier's arena (measured now), none for storage reached by I/O."""
    if backend.profile is not None:
        return float(backend.profile.overhead_ns + backend.profile.latency_ns), "profile"
    if backend.name in MEMORY_TIERS:
        try:
            return float(backend.chase(LATENCY_HOPS)), f"pointer chase over the arena ({LATENCY_HOPS} hops)"
        except KvemuError:
            return 0.0, "unavailable (the arena is too small to chase)"
    return 0.0, "none: storage is not reached with in-place loads"


def _run_instances(views, accs, trace, s0, s1, spec, geometry, block_bytes, emulate_missing, warn, progress,
                   n_steps, timing, body=None, on_error=None) -> dict:
    """Replays every instance (one thread each when there are several; cffi releases the GIL in C).
    ``body(i, backend, acc, stop, progress)``: what an instance runs once its backend is ready
    (closed loop; it returns the end of its timeline), instead of the recorded steps;
    ``on_error()``: called when an instance fails, so that the others stop waiting for it."""
    from .backends import Backend, cancel_all

    n = len(views)
    h = trace.header
    shared = n > 1 and not views[1]["owns_arena"]
    owner_ready = threading.Event()
    released = threading.Barrier(n)
    state: dict = {"owner": None, "spec": spec, "requested": spec, "because": None}
    stats: list = [None] * n
    errors: list[BaseException] = []
    done = [0] * n
    stop = threading.Event()  # set on Ctrl-C / SIGTERM in the main thread: workers end at a batch boundary
    prepare_s = [0.0] * n     # opening, mapping and pre-faulting each instance's arena
    ends: list = [None] * n   # closed loop: the end of each instance's timeline

    def report_progress(i, d, total):
        done[i] = d
        if progress is not None:
            progress(sum(done), n_steps * n)

    def work(i: int) -> None:
        v, acc, backend = views[i], accs[i], None
        attached = shared and i > 0
        try:
            if attached:
                owner_ready.wait()
                if state["owner"] is None:
                    return  # the owner failed; its error is reported
                backend = Backend(_instance_spec(state["spec"], i, "shared", True))
                backend.attach(state["owner"])
                backend.set_timing(**state["timing"])
            else:
                t_prep = time.perf_counter()
                backend, opened = _open_configured(_instance_spec(spec, i, "replicated" if n > 1 else "shared", False),
                                                   (block_bytes, v["n_slots"], *geometry), emulate_missing, warn,
                                                   timing)
                prepare_s[i] = time.perf_counter() - t_prep
                if i == 0:
                    state.update(opened)
                    if shared:
                        state["owner"] = backend
            if i == 0:
                owner_ready.set()
            if body is not None:
                ends[i], extra = body(i, backend, acc, stop,
                                      None if progress is None else (lambda d, t, i=i: report_progress(i, d, t)))
                stats[i] = _merge_stats(_backend_stats(backend), extra)
                return
            pending = None
            for e in _entries_in_span(trace, s0, s1):
                if stop.is_set():
                    return
                if n > 1:
                    keep = e["request_id"] % n == i
                    if not keep.any():
                        continue
                    e = {k: x[keep] for k, x in e.items()}
                if pending is not None:
                    e = {k: np.concatenate([pending[k], e[k]]) for k in e}
                # hold back the batch's last step: its entries may continue in the next batch
                cut = int(np.searchsorted(e["step"], e["step"][-1], side="left"))
                pending = {k: x[cut:] for k, x in e.items()}
                if cut:
                    acc.replay_steps(backend, {k: x[:cut] for k, x in e.items()},
                                     lambda d, t, i=i: report_progress(i, d, t))
            if pending is not None and len(pending["step"]):
                acc.replay_steps(backend, pending, lambda d, t, i=i: report_progress(i, d, t))
            # after the replay: emulated tiers count their floor hits
            stats[i] = _backend_stats(backend)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises the first
            errors.append(e)
            if on_error is not None:
                on_error()
            owner_ready.set()
            released.abort()
        finally:
            if backend is not None and attached:
                backend.close()  # before the owner unmaps the arena
            if n > 1:
                try:
                    released.wait()
                except threading.BrokenBarrierError:
                    pass
            if backend is not None and not attached:
                backend.close()

    if n == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), name=f"kvemu-instance-{i}", daemon=True)
                   for i in range(n)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        except BaseException:
            stop.set()  # let every worker close its backend (and remove its tier file) first
            cancel_all()  # and end the C calls they are in (a slow tier's batch can take minutes)
            for t in threads:
                t.join()
            raise
    if errors:
        raise errors[0]
    return _outcome(state, stats, max(prepare_s), end_ns=ends if body is not None else None)


def _backend_stats(backend) -> tuple:
    return ({op: backend.op_stats(op) for op in OPS}, backend.describe(),
            {op: backend.datapath_stats(op) for op in OPS}, backend.timeline())


def _merge_stats(main: tuple, extra: tuple | None) -> tuple:
    """An instance's backend statistics with those of its load stream (same tier, second context)
    added: op and data-path totals summed; facts and timeline the main context's."""
    if extra is None:
        return main
    ops = {op: {k: (main[0][op][k] + extra[0][op][k]) for k in main[0][op]} for op in OPS}
    datapath = {op: {k: main[2][op][k] + extra[2][op][k] for k in main[2][op]} for op in OPS}
    return ops, main[1], datapath, main[3]


def _open_configured(spec: str, geometry: tuple, emulate_missing: bool, warn, timing: dict):
    """A backend opened, prepared and given its data path timing; and what the results say of it."""
    backend, requested, because = _open_backend(spec, geometry, emulate_missing, warn)
    try:
        lat, lat_from = _tier_latency(backend)
        link = effective_link(timing["link"], backend.profile)
        staged = is_staged(backend.name, backend.profile)
        t = link.timing(tier_latency_ns=lat, store_mode=timing["store_mode"],
                        store_inflight_bytes=timing["store_inflight_bytes"], staged=staged)
        backend.set_timing(**t)
    except BaseException:
        backend.close()
        raise
    return backend, {"spec": backend.spec, "requested": requested, "because": because, "timing": t,
                     "latency": lat, "latency_from": lat_from, "link": link, "staged": bool(t["staged"])}


def _outcome(state: dict, stats: list, prepare_s: float, end_ns: list | None = None) -> dict:
    """What the results say of the backends' runs (stats: _backend_stats of every instance)."""
    n = len(stats)
    merged = {}
    for op in OPS:
        parts = [s[0][op] for s in stats]
        merged[op] = {"counts": sum(p["counts"] for p in parts),
                      **{k: sum(p[k] for p in parts) for k in ("accesses", "bytes", "time_ns", "busy_ns")}}
    facts = [s[1] for s in stats]
    datapath = {op: {k: sum(s[2][op][k] for s in stats) for k in stats[0][2][op]} for op in OPS}
    return {"spec": state["spec"], "requested": state["requested"], "because": state["because"],
            "facts": facts, "mode": facts[0].get("mode", "measured"),
            "tier_latency_ns": state.get("latency"), "tier_latency_from": state.get("latency_from"),
            "link": state.get("link"), "staged": state.get("staged"),
            "datapath_ops": datapath, "prepare_s": prepare_s,
            # how long the async stores ran past the last step (closed loop: past the engine's clock)
            "stores_drain_ns": max(max(s[3]["stores_done_ns"] - (s[3]["clock_ns"] if end_ns is None else end_ns[i]), 0)
                                   for i, s in enumerate(stats)),
            "ops": {op: _op_meta(merged[op]) for op in OPS},
            "instance_ops": [{"instance": i, **{op: _op_meta(stats[i][0][op]) for op in OPS}} for i in range(n)]}


def _instance_ops(ops: list, closed_stats: dict | None) -> list:
    """Per-instance op statistics; in closed loop with a shared emulated tier also the time the
    instance's steps queued for it and the KV bandwidth it got with that wait (``effective_gbps``:
    its bytes over its busy time plus its queueing)."""
    per = {p["instance"]: p for p in (closed_stats or {}).get("per_instance", [])}
    out = []
    for o in ops:
        p = per.get(o["instance"])
        if p is not None:
            nbytes = sum(o[op]["bytes"] for op in OPS)
            busy = sum(o[op]["busy_ns"] for op in OPS) + p["queued_ns"]
            o = {**o, "queued_ns": p["queued_ns"], "effective_gbps": nbytes / busy if busy else None}
        out.append(o)
    return out


def _replayed_load(accs, selected, arrival_ns, h) -> dict | None:
    """offered_load of the selected requests on the replayed timeline (every instance's steps busy)."""
    first = np.minimum.reduce([acc.first_start for acc in accs])
    last = np.maximum.reduce([acc.last_end_ns for acc in accs])
    ran = selected & (last >= 0)
    if not ran.any():
        return None
    gpus = gpus_text(h.meta.get("gpu"))
    if len(accs) > 1 and gpus:
        gpus = f"{len(accs)} instances of {gpus}"
    return offered_load(arrival_ns[ran], first[ran], last[ran], sum(acc.total_ns for acc in accs), gpus)


def _schedule_meta(schedule, schedule_from, source, time_scale, scale_from, stats, h) -> dict:
    """Which schedule ran, and what the closed loop's engine did against what was recorded."""
    eng = h.meta.get("engine", {})
    d = {"ran": schedule, "from": schedule_from, "trace": source, "time_scale": time_scale,
         "time_scale_from": scale_from,
         "recorded": {k: eng.get(k) for k in ("steps", "entries", "makespan_ns", "hbm_evictions", "tier_evictions")}}
    if stats is not None:
        d["engine"] = {k: int(stats[k]) for k in ("steps", "c_steps", "entries", "finished", "hbm_evictions",
                                                 "tier_evictions", "end_ns", "queued_ns", "async_loads")}
        for k in ("routing", "lockstep", "per_instance"):
            if k in stats:
                d["engine"][k] = stats[k]
    return d


def _time_scale(trace, time_scale, request_rate, closed: bool) -> tuple[float, str]:
    """The factor arrival times are multiplied by, and where it came from."""
    from .recording import arrival_scale

    if time_scale is None and request_rate is None:
        return 1.0, "trace"
    if time_scale is not None and request_rate is not None:
        raise ConfigError("give --time-scale or --request-rate, not both")
    if not closed:
        raise ConfigError("--time-scale and --request-rate reschedule the arrivals: they need --schedule closed "
                          "(a recorded schedule cannot react to them)")
    return arrival_scale(trace.arrival_ms, time_scale, request_rate), \
        "--request-rate" if request_rate is not None else "--time-scale"


def _load_stream(backend):
    """A second context on ``backend``'s tier, with a timeline of its own (async loads): attached to
    its arena, or for a uring file, a ring of its own on the same file."""
    from .backends import Backend

    lb = Backend(_instance_spec(backend.spec, 0, "shared", True))
    try:
        if backend.name == "uring":
            g = backend.geometry
            lb.prepare(g["block_bytes"], g["n_slots"], g["n_layers_model"], g["n_layers_replay"], bool(g["overlap"]),
                       g["chunk_blocks"], "cross-layer" if g["layout"] else "per-layer")
        else:
            lb.attach(backend)
        lb.set_timing(**backend.timing)
    except BaseException:
        lb.close()
        raise
    return lb


def _closed_body(inputs, accs, selected, instances, sharing, routing, backend_name, backend_args,
                 block_all_layers, async_loads=False):
    """What each instance's thread runs in closed loop (for _run_instances), the list its engine
    statistics go to, and the router (None with one instance)."""
    n = instances
    lockstep = backend_name in ("emu", "vemu")
    router = Router(n, inputs, routing, selected, lockstep) if n > 1 else None
    tiers = shared_tier(inputs.cfg, sharing, n)
    queue = None
    if n > 1 and sharing == "shared" and lockstep:
        from .profiles import emulated_backend_args

        queue = TierQueue(emulated_backend_args(backend_name, backend_args)[0].bandwidth_gbps)
    stats: list = [None] * n

    def body(i, backend, acc, stop, progress):
        total = int(np.count_nonzero(selected))
        lb = _load_stream(backend) if async_loads else None
        try:
            loop = ClosedLoop(inputs, acc, selected, router, i, tiers[i] if n > 1 else None, queue, block_all_layers,
                              load_stream=lb)
            stats[i] = loop.run(backend, None if progress is None else (lambda done: progress(min(done, total), total)),
                                stop=stop)
            extra = _backend_stats(lb) if lb is not None else None
        finally:
            if lb is not None:
                lb.close()
        stats[i]["tier"] = tiers[i]
        return stats[i]["end_ns"], extra

    return body, stats, router


def _closed_totals(stats: list, router, inputs) -> dict:
    """The engines' statistics over all instances."""
    tot = {k: sum(s[k] for s in stats) for k in ("steps", "c_steps", "entries", "finished", "hbm_evictions",
                                                 "queued_ns", "async_loads")}
    tot["end_ns"] = max(s["end_ns"] for s in stats)
    tiers = {id(s["tier"]): s["tier"] for s in stats if s["tier"] is not None}
    tot["tier_evictions"] = (sum(t.evictions for t in tiers.values()) if tiers else
                             sum(s["tier_evictions"] for s in stats))
    if router is not None:
        tot["routing"] = router.policy
        tot["lockstep"] = router.lockstep
        tot["per_instance"] = [{"instance": i, "requests": int(np.count_nonzero(router.owner == i)),
                                **{k: int(s[k]) for k in ("steps", "c_steps", "finished", "end_ns", "queued_ns")}}
                               for i, s in enumerate(stats)]
    return tot


def _open_backend(spec: str, geometry: tuple, emulate_missing: bool, warn):
    """(prepared backend, spec requested, why it was substituted or None)."""
    from .errors import BackendUnavailable
    from .profiles import counterpart_spec

    try:
        return _prepared(spec, geometry), spec, None
    except BackendUnavailable as e:
        substitute = counterpart_spec(spec) if emulate_missing else None
        if substitute is None:
            raise
        because = str(e)
    warn(f"backend {spec} is unavailable here ({because}); replaying its emulated counterpart {substitute} "
         f"instead: results are emulated, not measured")
    return _prepared(substitute, geometry), spec, because


def _prepared(spec: str, geometry: tuple):
    """A backend opened and prepared, or closed again if preparing it fails."""
    from .backends import Backend

    backend = Backend(spec)
    try:
        backend.prepare(*geometry)
    except BaseException:
        backend.close()
        raise
    return backend


def _floor_warning(spec: str, facts: dict) -> str | None:
    """A line saying how many accesses an emulated tier made at this host's speed, not its profile's."""
    hits, n = facts.get("floor_hits") or 0, facts.get("accesses") or 0
    if not hits:
        return None
    prof = facts.get("profile", {})
    floor = facts.get("floor_ns")
    floor_text = f"; this host takes {floor / 1000:.2f} us per access on its own" if floor else ""
    return (f"{spec}: {hits} of {n} accesses ({100 * hits / n:.1f}%) took longer on this host than profile "
            f"'{prof.get('name')}' allows ({prof.get('latency_ns')} ns, {prof.get('bandwidth_gbps')} GB/s){floor_text}; "
            f"their times are this host's, so those results are slower than the tier (backend.facts.floor_hits)")


def _block_tokens(h) -> int:
    return int(h.meta.get("engine", {}).get("tokens_per_block") or h.meta.get("model", {}).get(
        "tokens_per_block") or 16)


def transfer_shape(h) -> dict:
    """How replay moves a trace's KV unless told otherwise: chunk tokens and blocks, layout, and
    where each came from (``trace`` or ``default``)."""
    block_tokens = _block_tokens(h)
    chunk_tokens, chunk_from = _chunk_tokens(h, None, block_tokens)
    layout, layout_from = _layout(h, None)
    return {"chunk_tokens": chunk_tokens, "chunk_blocks": chunk_tokens // block_tokens,
            "chunk_tokens_from": chunk_from, "layout": layout, "layout_from": layout_from}


def _chunk_tokens(h, given: int | None, block_tokens: int) -> tuple[int, str]:
    """The transfer unit in tokens and where it came from (``--chunk-tokens``, the trace, default)."""
    recorded = h.meta.get("engine", {}).get("transfer_chunk_tokens")
    value, origin = ((given, "--chunk-tokens") if given is not None else
                     (recorded, "trace") if isinstance(recorded, int) and recorded > 0 else
                     (max(DEFAULT_CHUNK_TOKENS // block_tokens, 1) * block_tokens, "default"))
    if not isinstance(value, int) or value < block_tokens or value % block_tokens or value > block_tokens * 65536:
        raise ConfigError(f"--chunk-tokens must be a positive multiple of the trace's {block_tokens} tokens "
                          f"per block, at most {block_tokens * 65536}; got {value}")
    return value, origin


def _layout(h, given: str | None) -> tuple[str, str]:
    """The KV layout of transfers and where it came from (--kv-layout, the trace, default per-layer)."""
    from .backends import LAYOUTS

    recorded = h.meta.get("engine", {}).get("kv_layout")
    value, origin = ((given, "--kv-layout") if given is not None else
                     (recorded, "trace") if recorded in LAYOUTS else ("per-layer", "default"))
    if value not in LAYOUTS:
        raise ConfigError(f"--kv-layout must be one of {', '.join(LAYOUTS)}, got {value!r}")
    return value, origin


def _touched_blocks(trace, s0: int, s1: int, instances: int, chunk_blocks: int = 1):
    """Which block ids the entries of steps [s0, s1] touch, per instance (requests round-robin):
    a boolean matrix (instances x blocks.id_space), one byte per block id and instance whatever
    the trace's length; and, for chunked transfers, each touched block's chunk (the id of the
    block at the chunk's first position: a prefix hash names the whole prefix, so requests sharing
    a block share its chunk) and its offset in it (None, None for one block per chunk)."""
    id_space = int(trace.header.meta["blocks"]["id_space"])
    touched = np.zeros((instances, id_space), bool)
    key_of = off_of = None
    if chunk_blocks > 1:
        key_of = np.zeros(id_space, np.int64 if id_space >= 2**31 else np.int32)
        off_of = np.zeros(id_space, np.uint16)
    # smaller batches than the replay's: their tables span whole requests, not a C call's share
    for e in _entries_in_span(trace, s0, s1, batch_rows=TOUCH_BATCH_ENTRIES):
        t = _LocalTables(trace, e)
        n = int(t.table_off[-1])
        mark = np.zeros(n + 1, np.int64)  # +1 where an accessed range starts, -1 after it ends
        for op in OPS:
            live = t.count[op] > 0
            first = t.table_off[t.local[live]].astype(np.int64) + t.first[op][live]
            np.add.at(mark, first, 1)
            np.add.at(mark, first + t.count[op][live], -1)
        hit = np.cumsum(mark[:-1]) > 0
        touched[(t.requests[t.owner] % instances)[hit], t.ids[hit]] = True
        if key_of is not None:
            pos = t.position[hit]
            off = pos % chunk_blocks
            key_of[t.ids[hit]] = trace.block_ids(t.requests[t.owner][hit], pos - off)
            off_of[t.ids[hit]] = off
    return touched, key_of, off_of


def _check_arena_fits(backend_spec: str, arena_bytes: int, n_slots: int, layers: int, block_bytes: int,
                      max_memory: int) -> None:
    """Refuse, before anything is allocated, an arena the machine cannot hold. Memory tiers are
    bounded by --max-memory and available memory; a uring tier by the free space of its file
    system; virtual time needs no arena."""
    from .backends import parse_spec

    name, args = parse_spec(backend_spec)
    what = (f"the tier arena would need {arena_bytes / 2**30:.2f} GiB ({n_slots} blocks x {layers} layers x "
            f"{block_bytes} B)")
    hint = ("replay fewer layers (--layers), give a smaller --tier-capacity, or raise --max-memory")
    if name == "vemu":
        return
    if name == "uring":
        folder = os.path.dirname(os.path.abspath(args.split(",")[0] or ".")) or "."
        try:
            st = os.statvfs(folder)
        except OSError:
            return  # the backend reports a missing folder itself
        free = st.f_bavail * st.f_frsize
        if "size=existing" not in args and arena_bytes > 0.9 * free:
            raise ResourceLimitError(f"{what} but {folder} has {free / 2**30:.2f} GiB free; {hint}")
        return
    if arena_bytes > max_memory:
        raise ResourceLimitError(f"{what} but --max-memory is {max_memory / 2**30:.2f} GiB; {hint}")
    available = _meminfo("MemAvailable")
    if available is not None and arena_bytes > 0.8 * available:
        raise ResourceLimitError(f"{what} but only {available / 2**30:.2f} GiB of memory is available; {hint}")


class _LocalTables:
    """The block tables one batch of entries needs, in the CSR form the C replay takes: for each
    request of the batch, its table positions from the lowest its entries access to the highest,
    and the entries' ranges rebased onto them. Bounded by the batch, not the trace."""

    def __init__(self, trace, e):
        rid = e["request_id"].astype(np.int64)
        self.requests, self.local = np.unique(rid, return_inverse=True)
        m = len(self.requests)
        lo, hi = np.full(m, np.iinfo(np.int64).max), np.zeros(m, np.int64)
        self.count, first = {}, {}
        for op in OPS:
            self.count[op] = e[f"{op}_count"].astype(np.int64)
            first[op] = e[f"{op}_first"].astype(np.int64)
            live = self.count[op] > 0
            np.minimum.at(lo, self.local[live], first[op][live])
            np.maximum.at(hi, self.local[live], (first[op] + self.count[op])[live])
        lo = np.minimum(lo, hi)  # a request with no access in the batch gets an empty table
        self.first = {op: np.where(self.count[op] > 0, first[op] - lo[self.local], 0) for op in OPS}
        self.table_off = np.zeros(m + 1, np.uint64)
        np.cumsum(hi - lo, out=self.table_off[1:])
        n = int(self.table_off[-1])
        self.owner = np.repeat(np.arange(m), hi - lo)  # local request of each table position
        self.position = lo[self.owner] + np.arange(n) - self.table_off[:-1][self.owner].astype(np.int64)
        self.ids = trace.block_ids(self.requests[self.owner], self.position)


def _greedy_groups(sizes: np.ndarray, budget: int) -> np.ndarray:
    """Group index of each item when consecutive items are packed greedily into groups of at most
    ``budget`` (an item larger than the budget gets a group of its own). Non-decreasing."""
    group = np.empty(len(sizes), np.int64)
    g, used = 0, 0
    for i, x in enumerate(sizes.tolist()):  # one value per step, not per access
        if used and used + x > budget:
            g, used = g + 1, 0
        group[i] = g
        used += x
    return group


def _range_positions(t, op: str) -> np.ndarray:
    """Positions in a call's local tables that the entries' ``op`` ranges cover (with repeats)."""
    count = t.count[op]
    live = count > 0
    if not live.any():
        return np.zeros(0, np.int64)
    start = t.table_off[t.local[live]].astype(np.int64) + t.first[op][live]
    n = count[live]
    return np.repeat(start - np.r_[0, np.cumsum(n)[:-1]], n) + np.arange(int(n.sum()))


def _tier_capacity(h, given: int | None, chunk_blocks: int, block_all_layers: int) -> tuple[int | None, str]:
    """The tier's capacity in chunks and where it came from: --tier-capacity (bytes of all layers), the
    trace's recorded tier capacity, or None (unbounded: every touched chunk gets a slot)."""
    chunk_all_layers = chunk_blocks * block_all_layers
    if given is not None:
        if not isinstance(given, int) or given < chunk_all_layers:
            raise ConfigError(f"--tier-capacity must hold at least one chunk ({chunk_all_layers} bytes)")
        return given // chunk_all_layers, "--tier-capacity"
    recorded = h.meta.get("engine", {}).get("tier_capacity_blocks")
    if isinstance(recorded, int) and recorded > 0:
        return max(recorded // chunk_blocks, 1), "trace"
    return None, "unbounded"


def _entries_in_span(trace, s0: int, s1: int, batch_rows: int = STEP_BATCH_ENTRIES):
    for e in iter_entries(trace, batch_rows=batch_rows):
        st = e["step"]
        if st[-1] < s0:
            continue
        if st[0] > s1:
            break
        keep = (st >= s0) & (st <= s1)
        if keep.all():
            yield e
        elif keep.any():
            yield {k: v[keep] for k, v in e.items()}


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


def raise_fd_limit(instances: int) -> None:
    """Raise the soft open-file limit towards the hard one when several instances run: each keeps
    a spill file and its backend's files (a tier file, io_uring rings) open. Where the hard limit
    is lower still, running out is reported by spill_error or the backend, in one line."""
    want = 64 + 8 * instances
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class _Accumulator:
    """What one instance's replay adds up, batch by batch: the step timeline, per-request sums and
    times, and the inter-token gaps of the selected requests (spilled to a temporary file, 12
    bytes a generated token). Its memory is a few numbers per request; nothing grows with the
    entries, the block accesses or the tokens."""

    def __init__(self, trace, s0, n_steps, selected, slot_of, span, tier=None):
        n_req = trace.n_requests
        # (TierSlots, key_of, off_of, chunk_blocks, lock) when the arena is smaller than the touched
        # chunks: slots come from the tier's LRU, call by call
        self.tier = tier
        self.load_misses = 0
        self.touched = None  # closed loop: a bool per block id, marked as calls touch them
        self.compute_model = None  # (GpuTiming, resident): recorded instances compute their own entries
        self.weights = None  # _WeightStream: weights in the tier, loaded in every step's C call
        self.weight_ns = self.weight_bytes = self.weight_steps = 0
        self.trace, self.s0, self.n_steps, self.selected, self.slot_of, self.span = (
            trace, s0, n_steps, selected, slot_of, span)
        self.arrival_ns = np.round(trace.arrival_ms * 1e6).astype(np.int64)
        self.done_steps = 0
        self.total_ns = self.compute_total_ns = 0
        self.kv_total_ns = {op: 0 for op in OPS}
        self.req_kv = {op: np.zeros(n_req, np.int64) for op in OPS}
        self.req_blocks = {op: np.zeros(n_req, np.int64) for op in OPS}
        self.req_compute = np.zeros(n_req, np.int64)
        self.req_stall = np.zeros(n_req, np.int64)
        self.first_start = np.full(n_req, np.iinfo(np.int64).max)  # start of the request's first step
        self.last_end_ns = np.full(n_req, -1, np.int64)  # end of its last step
        self.prefill_end_ns = np.full(n_req, -1, np.int64)  # end of its last prefill chunk: first token
        # ITL: the selected requests' gaps (one per decode step, at most output_tokens - 1) go to
        # an unlinked temporary file as (request, ms) records; _write_rows reads them back
        self.itl_cap = np.where(selected, trace.output_tokens - 1, 0).astype(np.int64)
        self.itl_n = np.zeros(n_req, np.int64)
        self.last_token_ns = np.zeros(n_req, np.int64)
        try:
            self.spill = tempfile.TemporaryFile(prefix="kvemu-itl-")
        except OSError as e:
            raise spill_error(e) from None

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
            # and, with the tier's LRU, before the call's chunks would pass half the tier: a call's chunks
            # stay resident while it runs (an upper bound: every range may start mid-chunk)
            cb = self.tier[3]
            chunks = sum(np.where(e[f"{op}_count"] > 0, e[f"{op}_count"].astype(np.int64) // cb + 2, 0) for op in OPS)
            step_chunks = np.add.reduceat(chunks, step_begin)
            budget = max(self.tier[0].capacity // 2, 1)
            call_of_step = np.maximum(call_of_step, _greedy_groups(step_chunks, budget))
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
        self.fold(rid, e["phase"], of_entry, compute, step_out, entry_out, counts)

    def _own_compute(self, e, of_entry, n_steps) -> np.ndarray:
        """The compute of each step's entries alone (one instance's share of a recorded batch), from
        the trace's GPU model: the same roofline as the engine's, over these entries."""
        timing, resident = self.compute_model
        tok = e["tokens"].astype(np.float64)
        ctx = e["context_tokens"].astype(np.float64)
        dec = np.where(e["phase"] == PHASE_PREFILL, 0.0, tok)
        sums = [np.bincount(of_entry, weights=w, minlength=n_steps)
                for w in (tok, tok * (ctx + (tok + 1) / 2), tok if resident else ctx + tok, dec)]
        return np.array([timing.step_ns(int(a), b, int(c), int(d)) for a, b, c, d in zip(*sums)], np.int64)

    def c_call(self, backend, e, begin, compute, ready, weight_blocks=None):
        """One C replay call: the steps whose entries start at ``begin`` (indices into ``e``), with
        their compute and earliest start times. Returns (step_out, entry_out, block counts per op).
        ``weight_blocks`` (one per step, with weights in the tier): blocks of every replayed layer the
        step loads from the arena's weight region, in the same call (_WeightStream.join); their time
        is taken out of the steps' load_ns and added to ``weight_ns``."""
        from .backends import ENTRY_DTYPE, STEP_DTYPE

        n = len(e["step"])
        t = _LocalTables(self.trace, e)
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
        step_out, entry_out = backend.replay(table_off, slots, steps, entries, self.span)
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

    def fold(self, rid, phase, of_entry, compute, step_out, entry_out, counts) -> None:
        """Fold placed steps into the sums: entries (request ``rid``, ``phase``, index of their step
        ``of_entry``) of steps with ``compute`` and C's ``step_out``; the entries' own KV times and
        block counts per op."""
        d = step_out["step_ns"].astype(np.int64)
        self.total_ns += int(d.sum())
        self.compute_total_ns += int(compute[d > 0].sum())
        for op in OPS:
            self.kv_total_ns[op] += int(step_out[f"{op}_ns"].sum())
            np.add.at(self.req_kv[op], rid, entry_out[f"{op}_ns"])
            np.add.at(self.req_blocks[op], rid, counts[op])
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
        self.last_token_ns[rid[pre]] = self.prefill_end_ns[rid[pre]]
        self._add_gaps(rid[sel & ~pre], e_end[sel & ~pre])
        self.done_steps += len(compute)

    def _tier_slots(self, t) -> np.ndarray:
        """Slots of this call's table positions from the tier's LRU (chunk by chunk), counting the
        loads of chunks the tier had evicted: not resident before the call, not stored in it."""
        lru, key_of, off_of, cb, lock = self.tier
        keys = key_of[t.ids] if key_of is not None else t.ids
        with lock:
            chunk_slot, fresh = lru.map(keys)
        slots = chunk_slot.astype(np.uint64) * cb + (off_of[t.ids] if off_of is not None else 0)
        loaded = _range_positions(t, "load")
        if len(loaded) and fresh[loaded].any():
            stored = np.zeros(len(keys), bool)
            stored_pos = _range_positions(t, "store")
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
        self.itl_n[rid[head]] += size
        self.last_token_ns[rid[head]] = t[group_begin + size - 1]


class _WeightStream:
    """Weights in the tier (engine/weights.py), replayed: the arena holds, after the KV slots, a weight
    region of ``n_blocks`` slots per replayed layer, and every step loads the blocks its weight bytes
    take (rounded up to whole blocks of each layer) from it, in the step's own C call, as one more
    request of the call whose entry comes first in its step. The loads are timed and charged as KV
    loads are (medium, link, the step's composition); their charged time is reported apart."""

    def __init__(self, placement, base_slot: int, n_blocks: int, block_bytes: int, n_layers: int):
        self.placement, self.base, self.n_blocks = placement, int(base_slot), int(n_blocks)
        self.block_bytes, self.n_layers = int(block_bytes), int(n_layers)
        self.block_bytes_all_layers = self.block_bytes * self.n_layers
        self.slots = (self.base + np.arange(self.n_blocks)).astype(np.uint32)

    @staticmethod
    def region_blocks(placement, n_layers: int, block_bytes: int, chunk_blocks: int) -> int:
        """Slots of the weight region per replayed layer: the placed bytes, whole chunks of them."""
        from .engine.weights import blocks_per_layer

        b = blocks_per_layer(placement.placed_bytes, n_layers, block_bytes)
        return -(-b // chunk_blocks) * chunk_blocks

    def blocks(self, new_tokens) -> np.ndarray:
        """Weight blocks per replayed layer of steps with these new tokens."""
        from .engine.weights import blocks_per_layer

        p = self.placement
        out = [min(blocks_per_layer(p.step_bytes(int(t)), self.n_layers, self.block_bytes), self.n_blocks)
               for t in np.atleast_1d(new_tokens).tolist()]  # one value per step, not per access
        return np.array(out, np.int64)

    def join(self, table_off, slots, steps, entries, weight_blocks):
        """The call's arrays with the weight request added: its table (the weight region) last, one entry
        per step first in the step. Returns them, the positions of the original entries and of the weight
        entries."""
        from .backends import ENTRY_DTYPE

        n_steps, n = len(steps), len(entries)
        begin = steps["entry_begin"].astype(np.int64)
        of_entry = np.searchsorted(begin, np.arange(n), side="right") - 1
        real = np.arange(n) + of_entry + 1
        mine = begin + np.arange(n_steps)
        new = np.zeros(n + n_steps, ENTRY_DTYPE)
        new[real] = entries
        new["req"][mine] = len(table_off) - 1
        new["load_count"][mine] = weight_blocks
        table_off = np.append(table_off, np.uint64(int(table_off[-1]) + self.n_blocks))
        slots = np.concatenate([slots.astype(np.uint32), self.slots])
        steps = steps.copy()
        steps["entry_begin"] = mine
        steps["entry_end"] = steps["entry_end"].astype(np.int64) + np.arange(1, n_steps + 1)
        return table_off, slots, steps, new, real, mine


def _weights_label(placement) -> str:
    """The default label's mark of weights in the tier."""
    if placement is None:
        return ""
    return f"+{'weights' if placement.placement == 'dense' else 'cold-experts'}{placement.fraction:g}"


def _weights_results(placement, accs, kind: str, n_blocks: int, overlap: bool, steps: int) -> dict | None:
    """Results' ``weights``: the placement and what its stream did in this replay."""
    if placement is None:
        return None
    ns = sum(a.weight_ns for a in accs)
    nbytes = sum(a.weight_bytes for a in accs)
    streamed = sum(a.weight_steps for a in accs)
    return {**placement.to_dict(),
            "replay": {"region_blocks_per_layer": n_blocks, "steps": steps, "steps_streamed": streamed,
                       "bytes": nbytes, "time_ns": ns, "gbps": nbytes / ns if ns else None,
                       "mean_ns_per_step": ns / streamed if streamed else None,
                       "composition": "overlap" if overlap else "serial", "figures": kind,
                       "note": "weight loads are loads of the tier: ops.load and datapath.ops.load include them; "
                               "steps.kv_load_ns and the requests' kv_load_ms do not; their time on the critical "
                               "path is in kv_stall_ms"}}


def _op_meta(st: dict) -> dict:
    """Results metadata of one op from Backend.op_stats (or their sum over instances)."""
    from .backends import hist_bucket_lower_ns, percentile_from_hist

    counts = st["counts"]
    lower = hist_bucket_lower_ns()
    nz = np.flatnonzero(counts)
    d = {"accesses": int(st["accesses"]), "bytes": int(st["bytes"]), "time_ns": int(st["time_ns"]),
         "busy_ns": int(st["busy_ns"]), "gbps": (st["bytes"] / st["busy_ns"]) if st["busy_ns"] else None,
         "hist": {"lower_ns": lower[nz].tolist(), "counts": counts[nz].tolist()}}
    for name, q in (("p50_ns", 50), ("p99_ns", 99), ("p999_ns", 99.9)):
        d[name] = float(percentile_from_hist(counts, lower, q)) if st["accesses"] else None
    d["mean_ns"] = st["time_ns"] / st["accesses"] if st["accesses"] else None
    return d
