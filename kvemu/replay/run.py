"""The replay's flow: options checked, the span of steps and the arena planned from the trace,
the instances run on the recorded or closed schedule, the results and their metadata written;
repetitions (``--repeat``) and runs into a results dataset (``--dataset``)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
import threading
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import __version__
from ..analysis import TOTAL_COLUMNS, add_entry_totals, load_line, timing_from_meta, trace_summary
from ..errors import ConfigError, TraceError
from ..engine.weights import weights_from_meta
from ..figures import run_figures
from ..links import DEFAULT_LINK, DEFAULT_STORE_INFLIGHT_BYTES, DEFAULT_STORE_MODE, STORE_MODES, get_link
from ..output import atomic_output, check_destination, make_folders, remove_empty_folders
from ..integrity import READ_OPTIONS, write_results
from ..schema import METADATA_KEY, OPS, RESULTS_FORMAT, RESULTS_VERSION, file_sha256, iter_entries, read_trace
from .accumulate import Accumulator, TierMap, request_rows, write_rows
from .arena import (block_tokens_of, check_arena_fits, chunk_tokens_of, layer_plan, layout_of, tier_capacity_of,
                    touched_blocks)
from .closed import (KV_LOADS, ROUTING, SCHEDULES, chunk_keys, closed_body, closed_totals, engine_inputs,
                     replayed_load, schedule_meta, schedule_source, time_scale_of)
from .dataset import dataset_path
from .host import host_facts
from .instances import (MEMORY_TIERS, floor_warning, instance_ops, instance_views, raise_fd_limit, run_instances,
                        tier_footprint)
from .weights import WeightStream, weights_label, weights_results

DEFAULT_MAX_MEMORY = 4 << 30
SHARING = ("shared", "replicated")
#: Serving instances one replay runs (a thread, a backend context and a spill file each).
MAX_INSTANCES = 256


def _kv_links(meta: dict, path) -> int:
    """Host links a block's KV moves over in parallel (the trace's ``gpu.kv_links``: tensor-parallel
    ranks holding distinct KV heads, times pipeline stages); 1 for traces without it (recorded
    before parallelism was modelled, real runs)."""
    lanes = (meta.get("gpu") or {}).get("kv_links", 1)
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= 1 << 20:
        raise TraceError(f"{path}: gpu.kv_links must be a whole number from 1 to 2^20, "
                         f"got {lanes!r}")
    return lanes


def _closed_loop_backend(backend_name: str, backend_args: str, instances: int, sharing: str) -> dict:
    """What the closed loop asks of this backend (closed_body's keywords): ``lockstep``, emulated and
    virtual tiers, whose steps are then taken in timeline order; ``tier_gbps``, the bandwidth of an
    emulated tier several instances share (their queue's; None: no queue); ``attach_load_stream``,
    whether an opened backend's load stream attaches to its arena (a uring file takes a ring of its
    own; asked of the backend each instance opened, which may be an emulated substitute)."""
    lockstep = backend_name in ("emu", "vemu")
    tier_gbps = None
    if instances > 1 and sharing == "shared" and lockstep:
        from ..profiles import emulated_backend_args

        tier_gbps = emulated_backend_args(backend_name, backend_args)[0].bandwidth_gbps
    return {"lockstep": lockstep, "tier_gbps": tier_gbps, "attach_load_stream": lambda name: name != "uring"}


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

    ``schedule`` (replay.closed): ``closed`` runs the engine model again, each step planned from
    the state the tier's KV times produced (the default for traces the engine model recorded, with
    one instance); ``recorded`` keeps the trace's steps and stretches the timeline (real-run traces,
    several instances). ``time_scale`` multiplies arrival times, ``request_rate`` sets the mean
    arrival rate in requests per second (one of the two; closed loop only). ``routing``: how closed
    loop sends requests to instances (closed.ROUTING). ``kv_load``: ``in-step`` loads a prefix
    from the tier inside the request's first prefill step (as recorded); ``async`` on a load stream
    of its own while running requests go on (vLLM's asynchronous KV loading; closed loop only).
    """
    from ..backends import parse_spec

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
    # a tensor-parallel instance's GPUs each move their share of the KV over their own host link
    link_lanes = _kv_links(h.meta, h.path)
    link_profile = link_profile.with_lanes(link_lanes)
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
    time_scale, load_from = time_scale_of(trace, time_scale, request_rate, closed)
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
    layout, layout_from = layout_of(h, layout)
    if layout == "cross-layer" and replay_layers not in (None, n_layers):
        raise ConfigError("the cross-layer layout moves every layer of a chunk in one transfer: replay all layers "
                          "(no --layers), or use --kv-layout per-layer")
    first_layers, span = layer_plan(n_layers, replay_layers)
    block_tokens = block_tokens_of(h)
    chunk_tokens, chunk_from = chunk_tokens_of(h, chunk_tokens, block_tokens)
    chunk_blocks = chunk_tokens // block_tokens
    # Pass 2: the blocks each instance touches, which sizes the arenas and maps ids to slots.
    if closed:
        key_of, off_of, may_hold = chunk_keys(inputs, chunk_blocks, involved)
        # any instance may be routed any request
        touched = np.broadcast_to(may_hold, (instances, len(may_hold)))
    else:
        touched, key_of, off_of = touched_blocks(trace, s0, s1, instances, chunk_blocks)
    virtual = backend_name == "vemu"  # virtual time: no arena, slots unused
    views = instance_views(touched, instances, sharing, virtual, key_of, off_of, chunk_blocks)
    # The arena is the tier: as many chunks as the tier holds (given, recorded, or what --max-memory
    # allows when the touched chunks do not fit), its slots reused least recently used first.
    slot_bytes = chunk_blocks * len(span) * block_bytes
    capacity, capacity_from = tier_capacity_of(h, tier_capacity_bytes, chunk_blocks, n_layers * block_bytes)
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
        from ..backends import TierSlots

        key_space = int(h.meta["blocks"]["id_space"]) or 1
        shared_lru = TierSlots(capacity, key_space) if instances == 1 or sharing == "shared" else None
        tier_slots = [shared_lru or TierSlots(capacity, key_space) for _ in range(instances)]
        for v in views:
            v["n_slots"], v["slot_of"] = capacity * chunk_blocks, None
    # Weights in the tier (engine/weights.py): a weight region after the KV slots of every arena
    placement = weights_from_meta(h.meta)
    w_blocks = 0
    if placement is not None:
        w_blocks = WeightStream.region_blocks(placement, n_layers, block_bytes, chunk_blocks)
        for v in views:
            v["weight_base"] = v["n_slots"]
            v["n_slots"] += w_blocks
        if placement.stream == "overlap" and not overlap:
            overlap = True  # the engine prefetched weights a layer ahead: loads run in a fetch stream
    arena_slots = [v["n_slots"] for v in views if v["owns_arena"]]
    arena_bytes = sum(arena_slots) * len(span) * block_bytes
    n_slots = sum(arena_slots)
    check_arena_fits(backend_spec, arena_bytes, n_slots, len(span), block_bytes, max_memory)

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
    accs = [Accumulator(trace, s0, n_steps, selected if closed else selected & (owner == i), views[i]["slot_of"], span,
                         None if tier_slots is None else TierMap(tier_slots[i], key_of, off_of, chunk_blocks, lru_lock))
            for i in range(instances)]
    if placement is not None:
        for acc, v in zip(accs, views):
            acc.weights = WeightStream(placement, v["weight_base"], w_blocks, block_bytes, n_layers)
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
        body, closed_stats, router = closed_body(inputs, accs, selected, instances, sharing, routing,
                                                  block_bytes * n_layers, async_loads=kv_load == "async",
                                                  **_closed_loop_backend(backend_name, backend_args, instances,
                                                                         sharing))
        outcome = run_instances(views, accs, trace, s0, s1, backend_spec, geometry, block_bytes, emulate_missing,
                                 _warn, progress, n_steps, timing, body=body,
                                 on_error=None if router is None else router.fail)
        closed_stats = closed_totals(closed_stats, router, inputs)
        if router is not None:
            for i, acc in enumerate(accs):
                acc.selected = selected & (router.owner == i)
        s1 = closed_stats["steps"] - 1
        n_steps = closed_stats["steps"]
        involved = np.logical_or.reduce([acc.first_start < np.iinfo(np.int64).max for acc in accs])
        touched = np.stack([acc.touched for acc in accs]) if instances > 1 else accs[0].touched[None, :]
    else:
        outcome = run_instances(views, accs, trace, s0, s1, backend_spec, geometry, block_bytes, emulate_missing,
                                 _warn, progress, n_steps, timing)
    backend_spec, requested, because = outcome["spec"], outcome["requested"], outcome["because"]
    facts, ops_meta, mode = outcome["facts"][0], outcome["ops"], outcome["mode"]
    for f in outcome["facts"]:
        floor = floor_warning(backend_spec, f)
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
        part, end_i = request_rows(trace, acc, sel_idx, arrival_ns, arrival_ms, block_all_layers)
        if instances > 1:
            part = part.append_column("instance", pa.array(np.full(len(sel_idx), i, np.int16)))
        parts.append(part)
        ends.append(end_i)
        arrivals.append(arrival_ns[sel_idx].min())
    rows = parts[0] if len(parts) == 1 else pa.concat_tables(parts).sort_by("request_id")
    compute_ns = sum(acc.compute_total_ns for acc in accs)
    summary = trace_summary(trace, prefix_hits=False, totals=totals)
    load = replayed_load(accs, selected, arrival_ns, h)
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
                           f"{weights_label(placement)}"),
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
        "schedule": {**schedule_meta(schedule, schedule_from, sched_src, time_scale, load_from, closed_stats, h),
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
        "tier": {**tier_footprint(touched, instances, len(span) * block_bytes, arena_slots),
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
            "link_requested": link,
            "link_lanes": link_lanes,
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
        "instance_ops": instance_ops(outcome["instance_ops"], closed_stats) if instances > 1 else None,
        "duration_s": float((max(ends) - min(arrivals)) / 1e9),
        "wall_s": round(time.perf_counter() - wall0, 3),
        # the arena's allocation and pre-fault, apart from the replay (the tier exists before serving)
        "prefault_s": round(outcome["prepare_s"], 3),
    }
    meta["figures"] = run_figures(meta)
    if placement is not None:
        meta["weights"] = weights_results(placement, accs, meta["figures"].get("kind"), w_blocks, overlap, n_steps)
    with atomic_output(out, force=force, inputs=[trace_path]) as tmp:
        write_rows(tmp, rows, accs, {METADATA_KEY: json.dumps(meta, sort_keys=True).encode()})
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
    from .. import metrics

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
