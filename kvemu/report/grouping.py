"""The report's grouping rules: which runs are compared request for request (workload_key), like
with like (comparison_class), and which run can stand in as another's virtual twin
(deployment_key). Read by the comparison (compare.py) and the verdict (verdict.py) alike."""
from __future__ import annotations

import json

from .common import lookup as _get
from .results import Run


def workload_key(run: Run) -> str:
    """What makes runs comparable request for request: the workload (its checksum, source and
    request count, arrival scale), the model and GPU, and the requests replayed. Traces of one
    workload recorded under different tier policies share it; without a workload checksum (a
    real run), the trace's SHA-256 stands in."""
    w = _get(run.meta, "trace.workload") or {}
    checksum = w.get("checksum")
    if not checksum:
        return "trace:" + run.trace_sha256
    red = _get(run.meta, "params.reductions") or {}
    gpu = _get(run.meta, "trace.gpu") or {}
    return json.dumps([checksum, w.get("source"), w.get("requests"), w.get("time_scale", 1.0),
                       _get(run.meta, "schedule.time_scale") or 1.0, run.model_name, gpu.get("name"),
                       gpu.get("gpus"), red.get("requests"), red.get("arrival_ms")], default=str)


def comparison_class(run: Run) -> tuple:
    """Runs compared like with like: the same overlap, schedule, store timing, KV loading and
    instances (the tier and the policy are what the comparison is about). A disaggregated run's
    instances are its prefill and decode instances together, so that it is compared with a
    colocated run of as many instances."""
    m = run.meta
    d = run.disagg
    instances = _get(m, "params.instances") or 1
    if d is not None:
        instances = sum(v for v in (d.get("prefill_instances"), d.get("decode_instances"))
                        if isinstance(v, int) and not isinstance(v, bool) and v > 0) or instances
    # a disaggregated run's sharing follows from its transfer path (the pool is shared): not a class of its own
    sharing = _get(m, "params.sharing") if d is None else None
    return (bool(_get(m, "params.overlap")), _get(m, "schedule.ran") or "recorded",
            _get(m, "datapath.store_timing") or "serial", _get(m, "schedule.kv_load") or "in-step",
            instances, sharing)


def deployment_key(run: Run) -> tuple | None:
    """What a run's virtual twin must share besides its comparison class: the prefill and decode
    instances and the transfer path (None for a colocated run)."""
    d = run.disagg
    return None if d is None else (d.get("prefill_instances"), d.get("decode_instances"), _get(d, "transfer.path"))


def class_text(key: tuple) -> str:
    overlap, schedule, stores, kv_load, instances, sharing = key
    parts = ["overlap" if overlap else "no overlap", f"{schedule} schedule", f"{stores} stores"]
    if kv_load != "in-step":
        parts.append(f"{kv_load} loads")
    if instances and instances > 1:
        parts.append(f"{instances} instances {sharing or ''}".rstrip())
    return ", ".join(parts)
