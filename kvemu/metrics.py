"""Per-run serving metrics computed from a results table: latency statistics, throughput, goodput.

Names follow vLLM's ``benchmarks/benchmark_serving.py`` so that a kvemu run and a vLLM benchmark
can be compared key for key (``completed``, ``request_throughput``, ``mean_ttft_ms``,
``p99_itl_ms``, ...). Keys that vLLM has no counterpart for (queueing, the KV time breakdown) use
the same ``mean_/total_`` prefixes and unit suffixes.

Statistics
----------
Every statistic ignores NaN values: ``tpot_ms`` is NaN for requests with at most one output token,
and such requests contribute nothing to TPOT, exactly as vLLM only collects TPOT for
``output_len > 1``. A statistic over no values is NaN.

* mean, median: arithmetic mean and 50th percentile.
* std: population standard deviation (``ddof=0``), as ``numpy.std`` and vLLM compute it.
* pX: the X-th percentile by linear interpolation between order statistics (Hyndman & Fan type 7,
  numpy's default ``method="linear"``). For the n values sorted as ``x[0] <= ... <= x[n-1]``::

      h = (n - 1) * X / 100,   pX = x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])

  so p99 of ``[1, 2, 3, 4]`` is ``3 + 0.97 * (4 - 3) = 3.97``.

ITL is pooled: the inter-token latencies of all requests form one sample (vLLM's definition), so a
long request weighs more than a short one.

SLOs and goodput
----------------
Goodput is vLLM's ``request_goodput``: the requests per second that met *every* objective, judged
request by request. The presets in :data:`SLO_PRESETS` are the latency constraints of the MLPerf
Inference datacenter LLM benchmarks, p99 TTFT and p99 TPOT in the Server scenario (MLPerf
Inference rules, mlcommons/inference_policies; collected in the project's REFERENCE.md):
llama2-70b, llama2-70b-interactive, llama3.1-405b, llama3.1-8b and llama3.1-8b-interactive.
MLPerf checks the run's p99 against these (:func:`slo_p99_met`); goodput applies them to each
request, so a run can pass MLPerf's check while up to 1% of its requests are not good.

DistServe (Zhong et al., "DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large
Language Model Serving", OSDI'24, arXiv:2401.09670) judges the TTFT and the TPOT objective apart as
well as together, since prefill and decode instances each answer for one of them:
:func:`slo_attainment` counts the requests meeting the TTFT objective, the TPOT objective and both,
and :func:`goodput_split` turns each count into requests per second.

Disaggregated prefill and decode
--------------------------------
A replay with prefill and decode instances writes per request the parts of its TTFT
(``ttft_queue_ns``, ``ttft_prefill_ns``, ``ttft_handoff_ns``, ``ttft_first_decode_ns``, summing to
TTFT) and its hand-off (``handoff_bytes``, ``handoff_ns``, ``handoff_overlap_ns``,
``handoff_pool_blocks``, ``decode_instance``; docs/replay.md). :func:`ttft_split`,
:func:`handoff_summary` and :func:`tpot_by_instance` summarise them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Union

import numpy as np
import pyarrow as pa

from .arrowops import list_values
from .errors import ConfigError

#: Percentiles reported for every latency metric besides the median.
PERCENTILES = (90, 99)

#: Latency metrics summarised with mean/median/std/percentiles, each a ``<name>_ms`` column.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")

#: Per-request time components that make up the breakdown, each a ``<name>_ms`` column.
BREAKDOWN_COMPONENTS = ("queue", "kv_load", "kv_store", "kv_read", "compute")

#: Per-request KV traffic columns, summed into ``total_<column>``.
KV_BYTE_COLUMNS = ("kv_bytes_loaded", "kv_bytes_stored", "kv_bytes_read")

#: Columns :func:`summarize` reads.
SUMMARY_COLUMNS = (
    ("input_tokens", "output_tokens", "ttft_ms", "tpot_ms", "e2el_ms", "itl_ms", "kv_stall_ms")
    + tuple(f"{c}_ms" for c in BREAKDOWN_COMPONENTS)
    + KV_BYTE_COLUMNS
)

#: A results table, or a mapping from column name to values. ``itl_ms`` may be an Arrow list
#: column or a sequence of per-request sequences.
Rows = Union[pa.Table, Mapping[str, object]]


# --------------------------------------------------------------------------------------------
# Statistics


def percentile(values, q):
    """The ``q``-th percentile(s) of ``values``, NaNs ignored (linear interpolation, see above).

    ``q`` is a number or a sequence of numbers in [0, 100]; the result is a float or an array.
    With no non-NaN values the result is NaN.
    """
    v = _without_nan(values)
    qs = np.asarray(q, dtype=np.float64)
    if np.any((qs < 0) | (qs > 100)):
        raise ValueError(f"percentile must be within [0, 100], got {q!r}")
    if v.size == 0:
        out = np.full(qs.shape, np.nan)
    else:
        out = np.percentile(v, qs, method="linear")
    return float(out) if out.ndim == 0 else out


def percentile_key(q: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> ``p99``, 99.9 -> ``p99.9``."""
    return f"p{int(q)}" if float(q).is_integer() else f"p{q}"


def latency_stats(values, name: str) -> dict[str, float]:
    """``mean_/median_/std_/p90_/p99_<name>_ms`` of ``values`` in ms, NaNs ignored."""
    v = _without_nan(values)
    stats = {
        f"mean_{name}_ms": float(np.mean(v)) if v.size else math.nan,
        f"median_{name}_ms": percentile(v, 50),
        f"std_{name}_ms": float(np.std(v)) if v.size else math.nan,
    }
    for q, value in zip(PERCENTILES, np.atleast_1d(percentile(v, PERCENTILES))):
        stats[f"{percentile_key(q)}_{name}_ms"] = float(value)
    return stats


def _without_nan(values) -> np.ndarray:
    """``values`` as a flat float64 array with NaNs dropped (infinities are kept: they are data)."""
    v = np.asarray(values, dtype=np.float64).ravel()
    return v[~np.isnan(v)]


# --------------------------------------------------------------------------------------------
# Column access


def column(rows: Rows, name: str, dtype=np.float64) -> np.ndarray:
    """Column ``name`` of ``rows`` as a numpy array; Arrow nulls become NaN for float columns."""
    if isinstance(rows, pa.Table):
        if name not in rows.column_names:
            raise KeyError(f"results table has no column '{name}'")
        data = rows.column(name).to_numpy()
    else:
        if name not in rows:
            raise KeyError(f"results rows have no column '{name}'")
        data = rows[name]
        if isinstance(data, (pa.Array, pa.ChunkedArray)):
            data = data.to_numpy(zero_copy_only=False)
    return np.asarray(data, dtype=dtype)


def pooled_itl(rows: Rows) -> np.ndarray:
    """All requests' inter-token latencies (``itl_ms``) as one float64 array, in row order."""
    if isinstance(rows, pa.Table):
        if "itl_ms" not in rows.column_names:
            raise KeyError("results table has no column 'itl_ms'")
        data = rows.column("itl_ms")
    else:
        if "itl_ms" not in rows:
            raise KeyError("results rows have no column 'itl_ms'")
        data = rows["itl_ms"]
    if isinstance(data, (pa.Array, pa.ChunkedArray)):
        # Flattening in Arrow keeps this one pass over contiguous buffers; null lists add nothing.
        chunks = data.chunks if isinstance(data, pa.ChunkedArray) else [data]
        parts = [np.asarray(list_values(c).to_numpy(zero_copy_only=False), dtype=np.float64) for c in chunks]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)
    parts = [np.asarray(x, dtype=np.float64).ravel() for x in data if x is not None]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# Summary


def summarize(rows: Rows, duration_s: float) -> dict[str, float | int]:
    """Serving metrics of one run, keyed as vLLM's ``benchmark_serving`` keys them.

    ``rows`` holds one completed request per row with the columns in :data:`SUMMARY_COLUMNS`;
    ``duration_s`` is the run's wall time on the replayed timeline (first arrival to last
    completion), the denominator of every throughput.

    Keys: ``duration``, ``completed``, ``total_input_tokens``, ``total_output_tokens``,
    ``request_throughput`` (req/s), ``output_throughput`` and ``total_token_throughput`` (tok/s);
    ``mean_/median_/std_/p90_/p99_`` of ``ttft_ms``, ``tpot_ms``, ``itl_ms`` (pooled) and
    ``e2el_ms``; ``mean_queue_ms``; and the breakdown sums ``total_<c>_ms`` for each component in
    :data:`BREAKDOWN_COMPONENTS` plus ``total_kv_stall_ms``, and ``total_kv_bytes_{loaded,stored,
    read}``.
    """
    if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive number of seconds, got {duration_s!r}")
    input_tokens = column(rows, "input_tokens", np.int64)
    output_tokens = column(rows, "output_tokens", np.int64)
    completed = int(input_tokens.size)
    total_input = int(input_tokens.sum())
    total_output = int(output_tokens.sum())

    summary: dict[str, float | int] = {
        "duration": float(duration_s),
        "completed": completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name in LATENCY_METRICS:
        values = pooled_itl(rows) if name == "itl" else column(rows, f"{name}_ms")
        summary.update(latency_stats(values, name))

    queue = column(rows, "queue_ms")
    summary["mean_queue_ms"] = float(np.nanmean(queue)) if np.any(~np.isnan(queue)) else math.nan
    for name in BREAKDOWN_COMPONENTS + ("kv_stall",):
        summary[f"total_{name}_ms"] = float(np.nansum(column(rows, f"{name}_ms")))
    for name in KV_BYTE_COLUMNS:
        summary[f"total_{name}"] = int(column(rows, name, np.int64).sum())
    return summary


#: Serving figures each repetition of a replay records (``repetitions`` in results metadata).
REPETITION_FIGURES = ("median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "median_e2el_ms",
                      "request_throughput")


def repetition_figures(rows: Rows, meta: Mapping) -> dict:
    """One repetition's figures: REPETITION_FIGURES of its rows, and from its results metadata the
    KV GB/s per op, the KV stall share of step time, the wall time and the run id."""
    summary = summarize(rows, meta["duration_s"])
    steps = meta.get("steps") or {}
    total = steps.get("total_ns")
    return {**{k: summary[k] for k in REPETITION_FIGURES},
            **{f"kv_gbps_{op}": ((meta.get("ops") or {}).get(op) or {}).get("gbps") for op in ("load", "store", "read")},
            "kv_stall_share": steps.get("kv_stall_ns", 0) / total if total else None,
            "wall_s": meta.get("wall_s"), "run_id": meta.get("run_id")}


def breakdown_shares(summary: Mapping[str, float]) -> dict[str, float]:
    """Each component's share of the request time attributed to all of them, from a summary.

    The denominator is the sum of ``total_<c>_ms`` over :data:`BREAKDOWN_COMPONENTS`, so the
    shares add up to 1. With overlap enabled, KV time may be hidden behind compute and these shares
    then describe work done, not wall time; ``kv_stall_share`` (from the run's step totals) says
    how much KV work actually lengthened steps. NaN for every share when nothing was attributed.
    """
    totals = np.array([summary[f"total_{c}_ms"] for c in BREAKDOWN_COMPONENTS], dtype=np.float64)
    whole = totals.sum()
    shares = totals / whole if whole > 0 else np.full(totals.shape, np.nan)
    return {c: float(s) for c, s in zip(BREAKDOWN_COMPONENTS, shares)}


# --------------------------------------------------------------------------------------------
# SLOs and goodput


@dataclass(frozen=True)
class SLO:
    """Per-request latency objectives: a request is *good* when it meets every one of them."""

    name: str
    ttft_ms: float = math.inf
    tpot_ms: float = math.inf
    source: str = "user"

    def describe(self) -> str:
        """One line: name, thresholds and where they come from."""
        parts = []
        if math.isfinite(self.ttft_ms):
            parts.append(f"TTFT {self.ttft_ms:g} ms")
        if math.isfinite(self.tpot_ms):
            parts.append(f"TPOT {self.tpot_ms:g} ms")
        return f"{self.name} ({', '.join(parts)}; {self.source})"


_MLPERF = "MLPerf Inference LLM p99 target, Server scenario"

#: SLO presets, by MLPerf benchmark name; see the module docstring for the source.
SLO_PRESETS: dict[str, SLO] = {
    s.name: s
    for s in (
        SLO("llama2-70b", ttft_ms=2000, tpot_ms=200, source=_MLPERF),
        SLO("llama2-70b-interactive", ttft_ms=450, tpot_ms=40, source=_MLPERF),
        SLO("llama3.1-405b", ttft_ms=6000, tpot_ms=175, source=_MLPERF),
        SLO("llama3.1-8b", ttft_ms=2000, tpot_ms=100, source=_MLPERF),
        SLO("llama3.1-8b-interactive", ttft_ms=500, tpot_ms=30, source=_MLPERF),
    )
}


def parse_slo(text: str) -> SLO:
    """An SLO from a preset name (see :data:`SLO_PRESETS`) or ``ttft=MS,tpot=MS`` (either may be
    left out). Raises :class:`ConfigError` for anything else."""
    spec = text.strip()
    if spec in SLO_PRESETS:
        return SLO_PRESETS[spec]
    if "=" not in spec:
        raise ConfigError(
            f"unknown SLO preset '{spec}' (presets: {', '.join(SLO_PRESETS)}; "
            "or give ttft=MS,tpot=MS)"
        )
    limits: dict[str, float] = {}
    for item in spec.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in ("ttft", "tpot"):
            raise ConfigError(
                f"bad SLO item '{item.strip()}' in '{spec}' (expected ttft=MS or tpot=MS)"
            )
        if f"{key}_ms" in limits:
            raise ConfigError(f"SLO '{spec}' gives {key} twice")
        try:
            ms = float(value)
        except ValueError:
            raise ConfigError(
                f"SLO {key} must be a number of milliseconds, got '{value}'"
            ) from None
        if not (math.isfinite(ms) and ms > 0):
            raise ConfigError(f"SLO {key} must be a positive number of milliseconds, got '{value}'")
        limits[f"{key}_ms"] = ms
    return SLO(spec, **limits)


def good_requests(rows: Rows, ttft_ms: float = math.inf, tpot_ms: float = math.inf) -> np.ndarray:
    """Boolean mask of the requests meeting both objectives.

    A request with at most one output token has no TPOT (NaN) and meets the TPOT objective, as in
    vLLM, which counts its TPOT as 0. A NaN TTFT never meets the TTFT objective.
    """
    ttft = column(rows, "ttft_ms")
    tpot = column(rows, "tpot_ms")
    return (ttft <= ttft_ms) & (np.isnan(tpot) | (tpot <= tpot_ms))


def goodput(rows: Rows, ttft_ms: float, tpot_ms: float, duration_s: float) -> float:
    """Requests per second that met both the TTFT and the TPOT objective (vLLM's
    ``request_goodput``): the count from :func:`good_requests` over ``duration_s``."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive number of seconds, got {duration_s!r}")
    return int(np.count_nonzero(good_requests(rows, ttft_ms, tpot_ms))) / duration_s


def slo_attainment(rows: Rows, ttft_ms: float = math.inf, tpot_ms: float = math.inf) -> dict[str, int]:
    """DistServe's attainment counts: ``requests``, and the requests meeting the TTFT objective
    (``ttft``), the TPOT objective (``tpot``) and both (``both``, :func:`good_requests`). A request
    without a TPOT (one output token) meets the TPOT objective; a NaN TTFT never meets the TTFT one."""
    ttft = column(rows, "ttft_ms")
    tpot = column(rows, "tpot_ms")
    ttft_ok = ttft <= ttft_ms
    tpot_ok = np.isnan(tpot) | (tpot <= tpot_ms)
    return {"requests": int(ttft.size), "ttft": int(np.count_nonzero(ttft_ok)),
            "tpot": int(np.count_nonzero(tpot_ok)), "both": int(np.count_nonzero(ttft_ok & tpot_ok))}


def goodput_split(rows: Rows, ttft_ms: float, tpot_ms: float, duration_s: float) -> dict[str, float]:
    """Requests per second meeting the TTFT objective, the TPOT objective and both (``ttft``,
    ``tpot``, ``both``): :func:`slo_attainment` over ``duration_s``. ``both`` is :func:`goodput`."""
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s must be a positive number of seconds, got {duration_s!r}")
    counts = slo_attainment(rows, ttft_ms, tpot_ms)
    return {k: counts[k] / duration_s for k in ("ttft", "tpot", "both")}


def slo_p99_met(summary: Mapping[str, float], slo: SLO) -> bool:
    """Whether the run's p99 TTFT and p99 TPOT are within ``slo`` (MLPerf's pass criterion)."""
    return bool(summary["p99_ttft_ms"] <= slo.ttft_ms) and not (
        summary["p99_tpot_ms"] > slo.tpot_ms  # NaN (no multi-token request) passes
    )


# --------------------------------------------------------------------------------------------
# Disaggregated prefill and decode

#: The parts of TTFT a disaggregated replay writes, each a ``ttft_<part>_ns`` column; they sum to TTFT.
TTFT_PARTS = ("queue", "prefill", "handoff", "first_decode")

#: Per-request columns of a disaggregated replay (docs/replay.md), all integers.
DISAGG_COLUMNS = ("prefill_instance", "decode_instance", "handoff_bytes", "handoff_ns", "handoff_overlap_ns",
                  "handoff_pool_blocks") + tuple(f"ttft_{p}_ns" for p in TTFT_PARTS)


def _has(rows: Rows, name: str) -> bool:
    return name in (rows.column_names if isinstance(rows, pa.Table) else rows)


def ttft_split(rows: Rows) -> dict[str, dict[str, float]] | None:
    """Per part of TTFT (:data:`TTFT_PARTS`): ``p50_ms``, ``p99_ms`` and ``mean_ms`` over the
    requests, and ``share``, the part's mean over the mean of the parts' sum (so the shares add up
    to 1: the part's share of all the requests' TTFT). None when ``rows`` lacks a part's column."""
    if not all(_has(rows, f"ttft_{p}_ns") for p in TTFT_PARTS):
        return None
    parts = {p: column(rows, f"ttft_{p}_ns") / 1e6 for p in TTFT_PARTS}
    whole = float(np.sum([np.sum(v) for v in parts.values()]))
    out = {}
    for p, v in parts.items():
        out[p] = {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99),
                  "mean_ms": float(np.mean(v)) if v.size else math.nan,
                  "share": float(np.sum(v)) / whole if whole > 0 else math.nan}
    return out


def handoff_summary(rows: Rows) -> dict[str, float | int] | None:
    """The hand-off of KV from prefill to decode instances, over the requests: ``requests``, those
    handed off (``handed_off``: prefilled on a prefill instance, ``prefill_instance`` >= 0, a
    request served where it arrived having -1; without that column, any hand-off time or bytes),
    ``bytes`` (KV bytes moved),
    ``p50_ms``/``p99_ms``/``mean_ms`` of the hand-off time over the requests handed off,
    ``overlap_share`` (their hand-off time hidden under prefill over all their hand-off time) and
    ``pool_blocks`` (blocks the pool already held, which needed no transfer). None when ``rows``
    lacks ``handoff_bytes`` or ``handoff_ns``."""
    if not (_has(rows, "handoff_bytes") and _has(rows, "handoff_ns")):
        return None
    moved = column(rows, "handoff_bytes", np.int64)
    ns = column(rows, "handoff_ns", np.int64)
    if _has(rows, "prefill_instance"):
        handed = column(rows, "prefill_instance", np.int64) >= 0
    else:
        handed = (moved > 0) | (ns > 0)
    ms_ = ns[handed] / 1e6
    overlap = column(rows, "handoff_overlap_ns", np.int64) if _has(rows, "handoff_overlap_ns") else None
    pool = column(rows, "handoff_pool_blocks", np.int64) if _has(rows, "handoff_pool_blocks") else None
    total_ns = int(ns[handed].sum())
    return {"requests": int(moved.size), "handed_off": int(np.count_nonzero(handed)), "bytes": int(moved.sum()),
            "p50_ms": percentile(ms_, 50), "p99_ms": percentile(ms_, 99),
            "mean_ms": float(np.mean(ms_)) if ms_.size else math.nan,
            "overlap_share": (int(overlap[handed].sum()) / total_ns if overlap is not None and total_ns > 0
                              else math.nan),
            "pool_blocks": int(pool.sum()) if pool is not None else None}


def tpot_by_instance(rows: Rows, instance_column: str = "decode_instance") -> list[dict[str, float | int]]:
    """TPOT per instance (``decode_instance`` by default), in instance order: ``instance``,
    ``requests``, ``mean_tpot_ms``, ``median_tpot_ms`` and ``p99_tpot_ms`` (NaN TPOTs ignored);
    [] when ``rows`` lacks the column."""
    if not _has(rows, instance_column):
        return []
    inst = column(rows, instance_column, np.int64)
    tpot = column(rows, "tpot_ms")
    out = []
    for i in np.unique(inst):
        v = tpot[inst == i]
        s = latency_stats(v, "tpot")
        out.append({"instance": int(i), "requests": int(v.size), "mean_tpot_ms": s["mean_tpot_ms"],
                    "median_tpot_ms": s["median_tpot_ms"], "p99_tpot_ms": s["p99_tpot_ms"]})
    return out



#: The results columns a trace with sessions adds (kvemu.sessions): each request's session and turn.
SESSION_COLUMNS = ("session_id", "turn")


def session_summary(rows: Rows) -> dict | None:
    """TTFT and end-to-end time per turn index and per session (None without SESSION_COLUMNS).

    ``turns``: per turn index, in order, ``turn``, ``requests``, ``median_ttft_ms``,
    ``mean_ttft_ms``, ``median_e2el_ms``, ``mean_e2el_ms``. ``sessions``: over the sessions,
    ``sessions``, and of each session's time from its first request's arrival to its last
    request's end (``session_ms``: what the user of an agent waits for the whole task) and of the
    TTFT summed over its turns (``ttft_sum_ms``): the median, p99 and mean."""
    if not (_has(rows, "session_id") and _has(rows, "turn")):
        return None
    sid, turn = column(rows, "session_id", np.int64), column(rows, "turn", np.int64)
    ttft, e2el, arrival = column(rows, "ttft_ms"), column(rows, "e2el_ms"), column(rows, "arrival_ms")
    turns = []
    for k in np.unique(turn):
        m = turn == k
        t, e = latency_stats(ttft[m], "ttft"), latency_stats(e2el[m], "e2el")
        turns.append({"turn": int(k), "requests": int(m.sum()), "median_ttft_ms": t["median_ttft_ms"],
                      "mean_ttft_ms": t["mean_ttft_ms"], "median_e2el_ms": e["median_e2el_ms"],
                      "mean_e2el_ms": e["mean_e2el_ms"]})
    ids, inv = np.unique(sid, return_inverse=True)
    start = np.full(len(ids), np.inf)
    end = np.full(len(ids), -np.inf)
    np.minimum.at(start, inv, arrival)
    np.maximum.at(end, inv, arrival + e2el)
    ttft_sum = np.bincount(inv, weights=ttft, minlength=len(ids))
    span = end - start
    sessions = {"sessions": int(len(ids))}
    for name, v in (("session_ms", span), ("ttft_sum_ms", ttft_sum)):
        sessions[f"median_{name}"] = percentile(v, 50)
        sessions[f"p99_{name}"] = percentile(v, 99)
        sessions[f"mean_{name}"] = float(np.mean(v)) if len(v) else math.nan
    return {"turns": turns, "sessions": sessions}

__all__ = [
    "SESSION_COLUMNS",
    "session_summary",
    "BREAKDOWN_COMPONENTS",
    "DISAGG_COLUMNS",
    "LATENCY_METRICS",
    "PERCENTILES",
    "SLO",
    "SLO_PRESETS",
    "SUMMARY_COLUMNS",
    "TTFT_PARTS",
    "breakdown_shares",
    "column",
    "good_requests",
    "goodput",
    "goodput_split",
    "handoff_summary",
    "latency_stats",
    "parse_slo",
    "percentile",
    "percentile_key",
    "pooled_itl",
    "slo_attainment",
    "slo_p99_met",
    "summarize",
    "tpot_by_instance",
    "ttft_split",
]
