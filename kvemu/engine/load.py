"""Offered load: how a timeline's arrivals compare with what the GPUs served (recorded with every
engine-model trace, re-measured on replay's timeline, printed by ``trace info``)."""

from __future__ import annotations

import math

import numpy as np

#: A run is overloaded when its requests spend at least this share of their time waiting for admission.
OVERLOAD_QUEUE_SHARE = 0.5


def offered_load(arrival_ns: np.ndarray, admit_ns: np.ndarray, end_ns: np.ndarray, busy_ns: int,
                 gpus: str | None = None) -> dict:
    """How the offered load compares with what the GPUs served, from one timeline: per request its
    arrival, its first step's start (admission) and its last step's end; ``busy_ns`` the steps' time.

    ``makespan_over_span``: first arrival to last completion against the span of arrivals;
    ``utilisation``: busy time over that makespan; ``queue_share``: the requests' time spent waiting
    for admission over their whole time in the system. Overloaded when that share is at least
    OVERLOAD_QUEUE_SHARE: the GPUs cannot keep up, queueing decides TTFT, and it compounds.
    ``suggest_time_scale``: arrivals stretched by it come at about the rate the GPUs served
    (makespan over span rounded up to a tenth, never 1.0; batching is less efficient at lower load,
    so it is a lower bound).
    """
    arrival_ns = np.asarray(arrival_ns, np.int64)
    first, last_end = int(arrival_ns.min()), int(np.max(end_ns))
    span_s = (int(arrival_ns.max()) - first) / 1e9
    makespan_s = (last_end - first) / 1e9
    queue = np.maximum(np.asarray(admit_ns, np.int64) - arrival_ns, 0)
    in_system = np.maximum(np.asarray(end_ns, np.int64) - arrival_ns, 1)
    share = float(queue.sum() / in_system.sum())
    ratio = makespan_s / span_s if span_s > 0 else None
    overloaded = share >= OVERLOAD_QUEUE_SHARE
    return {"arrival_span_s": span_s, "makespan_s": makespan_s, "busy_s": busy_ns / 1e9,
            "utilisation": (busy_ns / 1e9) / makespan_s if makespan_s > 0 else None,
            "makespan_over_span": ratio, "queue_p50_s": float(np.median(queue)) / 1e9, "queue_share": share,
            "overloaded": overloaded, "gpus": gpus,
            "suggest_time_scale": _stretch(ratio) if overloaded else None}


def _stretch(ratio: float | None) -> float | None:
    """The time scale to advise: the makespan over the span rounded up to a tenth, so that it is
    never 1.0 (a scale that changes nothing); None when the arrivals need no stretching."""
    if ratio is None or ratio <= 1:
        return None
    return math.ceil(ratio * 10 - 1e-9) / 10


def load_line(load: dict) -> str:
    """One line saying how loaded a run was, and how to change it when it is overloaded."""
    util = "" if load.get("utilisation") is None else f", GPU busy {load['utilisation']:.0%}"
    ratio = load.get("makespan_over_span")
    served = (f"served in {load['makespan_s']:,.1f} s requests arriving over {load['arrival_span_s']:,.1f} s "
              f"({ratio:.2f}x){util}" if ratio is not None else
              f"all requests arrive at once; served in {load['makespan_s']:,.1f} s{util}")
    text = f"{served}; requests waited {load['queue_share']:.0%} of their time for admission " \
           f"(median {load['queue_p50_s']:,.1f} s)"
    if not load.get("overloaded"):
        return text
    who = f" {load['gpus']}" if load.get("gpus") else " the modelled GPUs"
    fix = (f"--time-scale {load['suggest_time_scale']} (or --request-rate) stretches the arrivals to about the "
           f"rate served; " if load.get("suggest_time_scale") else "")
    return (f"the offered load exceeds what{who} can serve: {text}; queueing decides TTFT. {fix}more --gpus "
            f"or fewer requests also help, unless overload is what you study")


def gpus_text(gpu: dict | None) -> str | None:
    """``4 x H100-SXM`` from a trace's ``gpu`` metadata, None without one."""
    g = gpu or {}
    return f"{g['gpus']} x {g['name']}" if "gpus" in g and "name" in g else None


def load_from_entries(entries, arrival_ns: np.ndarray, start_ns: np.ndarray, compute_ns: np.ndarray,
                      gpus: str | None = None) -> dict | None:
    """offered_load of a recorded timeline: ``entries`` are batches of entry rows (``step`` and
    ``request_id``), a request's first and last steps its admission and completion."""
    n = len(arrival_ns)
    if n == 0 or len(start_ns) == 0:
        return None
    first = np.full(n, np.iinfo(np.int64).max)
    last = np.full(n, -1, np.int64)
    for e in entries:
        np.minimum.at(first, e["request_id"], e["step"])
        np.maximum.at(last, e["request_id"], e["step"])
    ran = last >= 0
    if not ran.any():
        return None
    end = start_ns + compute_ns
    return offered_load(arrival_ns[ran], start_ns[first[ran]], end[last[ran]], int(compute_ns.sum()), gpus)
