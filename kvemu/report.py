"""Compare replay runs: read kvemu results files, line runs of the same trace up, render them.

The report is data first (:class:`Report`, built by :func:`build_report`) and text second: each
renderer in :data:`RENDERERS` turns a report into a string, so another output (HTML, plots) is one
more function over the same :class:`Report` and :func:`run_record`.

Runs are grouped by the SHA-256 of the trace they replayed, so the same requests on different
backends sit together; within a group every run is compared with one *baseline* run of that group
(see :func:`build_report`). Rows are ordered the same way in every group (by backend, in order of
first appearance), so the groups of two traces replayed on the same backends line up.

Each group also carries two sections about its trace, computed with :mod:`kvemu.analysis`: the
break-even bandwidth of reuse vs recompute with every run's tier bandwidth against it (from the
results' metadata alone), and the LRU capacity curve (from the trace itself, when it is found).
"""
from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import os
import struct
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__, analysis, metrics, plots
from .errors import ConfigError, KvemuError, ResultsError
from .figures import figures_of
from .metrics import SLO
from .output import atomic_output, check_destination
from .schema import (METADATA_KEY, RESULTS_FORMAT, SUPPORTED_RESULTS_VERSIONS, file_sha256,
                     read_header, read_trace)
from .units import human_bytes

#: The ``format`` value in a results file's ``kvemu`` metadata, and the versions this module reads.

#: Columns a results file must have, with a predicate on their Arrow type and its description.
_FLOAT = (pa.types.is_floating, "a floating-point column")
_INT = (pa.types.is_integer, "an integer column")
_FLOAT_LIST = (
    lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t))
    and pa.types.is_floating(t.value_type),
    "a list of floating-point values",
)
REQUIRED_COLUMNS: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "request_id": _INT,
    "arrival_ms": _FLOAT,
    "input_tokens": _INT,
    "output_tokens": _INT,
    "cached_tokens": _INT,
    "ttft_ms": _FLOAT,
    "tpot_ms": _FLOAT,
    "e2el_ms": _FLOAT,
    "queue_ms": _FLOAT,
    "compute_ms": _FLOAT,
    "kv_load_ms": _FLOAT,
    "kv_store_ms": _FLOAT,
    "kv_read_ms": _FLOAT,
    "kv_stall_ms": _FLOAT,
    "kv_bytes_loaded": _INT,
    "kv_bytes_stored": _INT,
    "kv_bytes_read": _INT,
    "itl_ms": _FLOAT_LIST,
}

#: Metadata entries a results file must carry, as dotted paths into the ``kvemu`` object.
REQUIRED_METADATA = ("label", "backend.spec", "backend.mode", "trace.sha256", "duration_s")

#: Backend modes: ``measured`` accesses the tier itself, ``emulated`` models one (with delays on
#: this host, or in virtual time: ``backend.virtual``); :mod:`kvemu.figures` tells the three kinds
#: of KV figures apart.
MODES = ("measured", "emulated")

#: KV operations whose totals and latency percentiles the results metadata records under ``ops``.
KV_OPS = ("load", "store", "read")

#: Latency percentiles per KV operation, as recorded in ``ops.<op>.<stat>_ns``.
KV_OP_PERCENTILES = ("p50", "p99", "p999")

#: The metrics each run is compared on with its baseline: (name, summary key, table header).
COMPARED = (
    ("ttft", "median_ttft_ms", "TTFT p50"),
    ("tpot", "mean_tpot_ms", "TPOT mean"),
    ("e2el", "median_e2el_ms", "E2EL p50"),
)

#: Hex digits of the trace SHA-256 shown to people.
SHORT_SHA_LEN = 12

#: Capacities on the log-spaced grid of the report's capacity curve.
CAPACITY_POINTS = 16

#: KV operations whose measured GB/s stands for a run's tier bandwidth, in order of preference:
#: prefix hits loaded back from the tier, else (KV resident in the tier) decode reads of it.
TIER_BANDWIDTH_OPS = ("load", "read")


class _NotResults(ResultsError):
    """The file is not a kvemu results file at all (a folder scan skips it rather than failing)."""


# --------------------------------------------------------------------------------------------
# Reading results files


@dataclass(frozen=True, eq=False)
class Run:
    """One results file: its ``kvemu`` metadata (upgraded to the current version) and its rows."""

    path: str
    meta: Mapping[str, Any]
    table: pa.Table

    @property
    def label(self) -> str:
        return str(self.meta["label"])

    @property
    def run_id(self) -> str | None:
        return self.meta.get("run_id")

    @property
    def backend_spec(self) -> str:
        return str(self.meta["backend"]["spec"])

    @property
    def backend_name(self) -> str:
        return str(self.meta["backend"].get("name") or self.backend_spec)

    @property
    def mode(self) -> str:
        return str(self.meta["backend"]["mode"])

    @property
    def is_emulated(self) -> bool:
        """Whether the KV times model a tier (emulated or virtual) rather than measure one."""
        return self.mode == "emulated"

    @cached_property
    def figures(self) -> dict[str, Any]:
        """How the run's KV figures were obtained and what bounded them
        (:func:`kvemu.figures.figures_of`): the block the results carry, or derived from them."""
        return figures_of(self.meta)

    @property
    def kind(self) -> str:
        """``measured``, ``emulated`` or ``virtual`` (see :mod:`kvemu.figures`)."""
        return str(self.figures["kind"])

    @property
    def is_measured(self) -> bool:
        """Whether the KV accesses were performed and timed on this host (not emulated, not
        virtual): the runs a default baseline is chosen from."""
        return self.mode == "measured" and self.kind == "measured"

    @property
    def trace_sha256(self) -> str:
        return str(self.meta["trace"]["sha256"])

    @property
    def workload_kind(self) -> str:
        return str(_get(self.meta, "trace.workload.kind") or "?")

    @property
    def tier_policy(self) -> str:
        return str(_get(self.meta, "trace.engine.tier_policy") or "?")

    @property
    def model_name(self) -> str:
        return str(_get(self.meta, "trace.model.name") or "?")

    @property
    def trace_description(self) -> str:
        """Short SHA, workload kind and tier policy: what tells traces apart at a glance."""
        return f"{self.trace_sha256[:SHORT_SHA_LEN]} {self.workload_kind} {self.tier_policy}"

    @property
    def duration_s(self) -> float:
        return float(self.meta["duration_s"])

    @property
    def dedup_ratio(self) -> float:
        return _number(_get(self.meta, "trace.summary.dedup_ratio"))

    @property
    def kv_stall_share(self) -> float:
        """Share of all step time by which KV work extended steps beyond compute."""
        total = _number(_get(self.meta, "steps.total_ns"))
        stall = _number(_get(self.meta, "steps.kv_stall_ns"))
        return stall / total if total > 0 else math.nan

    def kv_op(self, op: str) -> dict[str, float]:
        """``gbps`` and ``p50_ns``/``p99_ns``/``p999_ns`` of KV operation ``op``; NaN if absent."""
        entry = _get(self.meta, f"ops.{op}") or {}
        stats = {"gbps": _number(entry.get("gbps"))}
        for p in KV_OP_PERCENTILES:
            stats[f"{p}_ns"] = _number(entry.get(f"{p}_ns"))
        return stats


def read_results(path: str | os.PathLike) -> Run:
    """Read one kvemu results file, validating its footer before loading any data.

    Raises :class:`ResultsError` with a one-line message naming the file when it cannot be read,
    is not Parquet, has no ``kvemu`` metadata or another format, has an unsupported version, or
    lacks a required column or metadata entry.
    """
    path = os.fspath(path)
    meta = _read_footer(path)
    try:
        table = pq.read_table(path, columns=list(REQUIRED_COLUMNS))
    except (OSError, pa.ArrowException) as exc:
        raise ResultsError(f"{path}: cannot read results data: {_one_line(exc)}") from None
    return Run(path=path, meta=meta, table=table)


def _read_footer(path: str) -> dict:
    """The ``kvemu`` metadata of a results file, validated against the footer and upgraded."""
    if os.path.isdir(path):
        raise ResultsError(f"{path}: is a folder, not a results file")
    try:
        schema = pq.read_schema(path)
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file") from None
    except PermissionError:
        raise ResultsError(f"{path}: permission denied") from None
    except (OSError, pa.ArrowException):
        raise _NotResults(f"{path}: not a Parquet file") from None

    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise _NotResults(f"{path}: not a kvemu results file (no 'kvemu' schema metadata)")
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ResultsError(f"{path}: 'kvemu' schema metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise ResultsError(f"{path}: 'kvemu' schema metadata is not a JSON object")
    fmt = meta.get("format")
    if fmt != RESULTS_FORMAT:
        raise _NotResults(
            f"{path}: not a kvemu results file (format is {fmt!r}, expected '{RESULTS_FORMAT}')"
        )
    version = meta.get("version")
    if type(version) is not int or version not in SUPPORTED_RESULTS_VERSIONS:
        supported = ", ".join(str(v) for v in SUPPORTED_RESULTS_VERSIONS)
        raise ResultsError(
            f"{path}: results format version {version!r} is not supported "
            f"(this kvemu reads version {supported})"
        )
    meta = _upgrade(meta)

    for name, (is_expected, expected) in REQUIRED_COLUMNS.items():
        index = schema.get_field_index(name)
        if index < 0:
            raise ResultsError(f"{path}: results file is missing required column '{name}'")
        actual = schema.field(index).type
        if not is_expected(actual):
            raise ResultsError(f"{path}: column '{name}' has type {actual}, expected {expected}")
    for entry in REQUIRED_METADATA:
        if _get(meta, entry) in (None, ""):
            raise ResultsError(f"{path}: 'kvemu' metadata is missing '{entry}'")
    mode = meta["backend"]["mode"]
    if mode not in MODES:
        raise ResultsError(
            f"{path}: backend mode {mode!r} is not one of {', '.join(repr(m) for m in MODES)}"
        )
    duration = meta["duration_s"]
    if not (isinstance(duration, (int, float)) and math.isfinite(duration) and duration > 0):
        raise ResultsError(f"{path}: duration_s must be a positive number, got {duration!r}")
    return meta


def _upgrade(meta: dict) -> dict:
    """Metadata of any supported version, rewritten to the current version's layout.

    The one place where versions differ; version 1 is current, so there is nothing to do yet.
    """
    return meta


def discover_results(paths: Iterable[str | os.PathLike]) -> tuple[list[Run], list[tuple[str, str]]]:
    """Runs from result files and folders, and the files skipped with why.

    A folder is searched recursively for ``*.parquet``; a Parquet file there that is not a kvemu
    results file (a trace, anything else) is skipped, while a results file that cannot be read is
    an error. A file named explicitly must be a results file. A file reached twice is read once.
    """
    runs: list[Run] = []
    skipped: list[tuple[str, str]] = []
    seen: set[str] = set()
    run_files: set[str] = set()

    def add(path: str, explicit: bool) -> None:
        key = os.path.realpath(path)
        if key in run_files or (key in seen and not explicit):
            return
        seen.add(key)
        try:
            runs.append(read_results(path))
        except _NotResults as exc:
            if explicit:
                raise
            skipped.append((path, str(exc).removeprefix(f"{path}: ")))
        else:
            run_files.add(key)

    for given in paths:
        path = os.fspath(given)
        if os.path.isdir(path):
            found = sorted(str(p) for p in Path(path).rglob("*.parquet") if p.is_file())
            for file in found:
                add(file, explicit=False)
            if not any(os.path.realpath(file) in run_files for file in found):
                raise ResultsError(f"{path}: no kvemu results files in this folder")
        else:
            add(path, explicit=True)
    return runs, skipped


# --------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True, eq=False)
class RunRow:
    """One run in a report: its metrics and its comparison with the baseline of its group."""

    run: Run
    summary: Mapping[str, float]
    kv: Mapping[str, Mapping[str, float]]
    shares: Mapping[str, float]
    goodput: float | None
    slo_p99_met: bool | None
    is_baseline: bool
    ratio: Mapping[str, float]
    delta_ms: Mapping[str, float]


@dataclass(frozen=True, eq=False)
class TierVerdict:
    """One run set against the break-even bandwidth of its trace: the tier bandwidth it measured
    (:func:`tier_bandwidth`) and, per standard prefix length, whether loading a reused prefix at
    that rate beats recomputing it."""

    gbps: float  # NaN: the run moved no KV from the tier
    op: str | None  # the KV operation gbps was measured on
    wins: Mapping[int, bool]  # prefix tokens -> reuse beats recompute

    @property
    def wins_from_tokens(self) -> int | None:
        """The shortest standard prefix from which on reuse wins at every longer one; None when
        it loses at the longest."""
        start = None
        for prefix, wins in self.wins.items():
            start = (prefix if start is None else start) if wins else None
        return start


@dataclass(frozen=True, eq=False)
class Breakeven:
    """Break-even bandwidth per prefix length for a trace's model and GPU compute model
    (:func:`kvemu.analysis.breakeven_gbps`), and every run of the trace set against it."""

    model: str
    gpu: Mapping[str, Any]  # the trace's ``gpu`` metadata
    prefixes: tuple[Mapping[str, float], ...]  # rows of analysis.breakeven_gbps
    verdicts: tuple[TierVerdict, ...]  # one per run of the group, in row order


@dataclass(frozen=True, eq=False)
class Capacity:
    """The LRU capacity curve of a trace (:func:`kvemu.analysis.capacity_curve`) and the TTFT it
    models at each capacity (:func:`kvemu.analysis.capacity_ttft`)."""

    trace_path: str
    found_by: str  # "--trace" or "recorded": given, or the path recorded in the results
    curve: Mapping[str, Any]
    ttft: tuple[Mapping[str, float], ...] | None  # None: TTFT cannot be modelled (see ttft_note)
    load_gbps: float  # the bandwidth cached prefixes are loaded at in the TTFT; NaN without one
    ttft_note: str  # where load_gbps comes from, or why there is no TTFT

    @property
    def saturation_index(self) -> int | None:
        """Position on the grid of the smallest capacity within 5 % of the unbounded hit ratio."""
        sat = self.curve["saturation_blocks"]
        return None if sat is None else self.curve["capacity_blocks"].index(sat)


@dataclass(frozen=True, eq=False)
class Group:
    """The runs of one trace, the run they are compared with, and the trace's break-even and
    capacity sections (each None with a note saying why, or how to get it)."""

    trace_sha256: str
    rows: tuple[RunRow, ...]
    baseline: RunRow
    baseline_rule: str
    breakeven: Breakeven | None = None
    breakeven_note: str = ""
    capacity: Capacity | None = None
    capacity_note: str = ""  # empty when the capacity section was not looked for

    @property
    def trace(self) -> Run:
        """A run of this trace, to read trace facts from (all runs share the trace)."""
        return self.baseline.run


@dataclass(frozen=True, eq=False)
class Report:
    """Runs grouped by trace, each compared with its group's baseline."""

    groups: tuple[Group, ...]
    slo: SLO | None
    skipped: tuple[tuple[str, str], ...]

    @property
    def rows(self) -> list[RunRow]:
        return [row for group in self.groups for row in group.rows]


def build_report(
    paths: Sequence[str | os.PathLike],
    baseline: str | int | None = None,
    slo: str | SLO | None = None,
    traces: Sequence[str | os.PathLike] = (),
    recorded_traces: bool = True,
) -> Report:
    """A report over the results in ``paths``, files or folders (see :func:`discover_results`).

    ``baseline`` chooses the run each group is compared with:

    * ``None``: the measured run with the lowest median TTFT; an emulated or virtual run is never
      chosen this way. A group with no measured run falls back to its first run.
    * a label: the run carrying it. A group without such a run falls back to the default rule;
      a label no run carries, or that two runs of one group carry, is a :class:`ConfigError`.
      A string of digits that is no run's label is read as an index.
    * an index: the run at that position in each group, counting from 0 in the order the report
      lists them.

    ``slo`` (a preset name, ``ttft=MS,tpot=MS`` or an :class:`SLO`) adds goodput to every run.

    Every group gets its break-even section from the results' metadata alone. Its capacity
    section needs the trace itself: one of ``traces`` (each must be the trace of some group, by
    SHA-256, or this raises :class:`ConfigError`), else, with ``recorded_traces``, the path
    recorded in the group's results if the file there still has the trace's SHA-256. Each trace
    is read and its curve computed once.
    """
    if not paths:
        raise ConfigError("no results files given")
    if isinstance(slo, str):
        slo = metrics.parse_slo(slo)
    runs, skipped = discover_results(paths)
    baseline = _normalise_baseline(baseline, runs)

    summaries = {id(run): metrics.summarize(run.table, run.duration_s) for run in runs}
    backend_rank: dict[str, int] = {}
    for run in runs:
        backend_rank.setdefault(run.backend_spec, len(backend_rank))

    by_trace: dict[str, list[Run]] = {}
    for run in runs:
        by_trace.setdefault(run.trace_sha256, []).append(run)

    given = _given_traces(traces, list(by_trace))
    hashes: dict[str, str] = {}  # SHA-256 of each recorded trace path looked at, by real path
    groups = []
    for sha, members in by_trace.items():
        # sorted() is stable: runs of one backend keep their input order.
        members = sorted(members, key=lambda r: backend_rank[r.backend_spec])
        chosen, rule = _choose_baseline(members, [summaries[id(r)] for r in members], baseline)
        base_summary = summaries[id(members[chosen])]
        rows = tuple(
            _run_row(run, summaries[id(run)], base_summary, i == chosen, slo)
            for i, run in enumerate(members)
        )
        breakeven, breakeven_note = _breakeven(rows)
        capacity, capacity_note = None, ""
        if sha in given:
            capacity = _capacity(given[sha], "--trace", rows[chosen])
        elif recorded_traces:
            path, capacity_note = _recorded_trace(sha, members, hashes)
            if path is not None:
                capacity = _capacity(path, "recorded", rows[chosen])
        groups.append(Group(trace_sha256=sha, rows=rows, baseline=rows[chosen], baseline_rule=rule,
                            breakeven=breakeven, breakeven_note=breakeven_note,
                            capacity=capacity, capacity_note=capacity_note))
    return Report(groups=tuple(groups), slo=slo, skipped=tuple(skipped))


def tier_bandwidth(run: Run) -> tuple[float, str | None]:
    """The tier bandwidth a run measured, to set against the break-even bandwidth, and the KV
    operation it comes from: its load GB/s, or its read GB/s when it loaded nothing (see
    :data:`TIER_BANDWIDTH_OPS`); NaN and None when it moved no KV from the tier."""
    for op in TIER_BANDWIDTH_OPS:
        gbps = run.kv_op(op)["gbps"]
        if gbps > 0:  # False for NaN: the run did not do this operation
            return gbps, op
    return math.nan, None


def _breakeven(rows: Sequence[RunRow]) -> tuple[Breakeven | None, str]:
    """The break-even section of one group, from its results' trace metadata; or None and why."""
    trace = rows[0].run.meta["trace"]
    if not _get(trace, "gpu"):
        return None, ("break-even: not available; the trace has no GPU compute model to price "
                      "recomputation with (a real-run trace measures its compute instead)")
    try:
        timing = analysis.timing_from_meta(trace)
    except KvemuError as exc:
        return None, (f"break-even: not available; the results' trace metadata has no usable "
                      f"model and GPU ({_one_line(exc)})")
    prefixes = tuple(analysis.breakeven_gbps(timing))
    verdicts = []
    for row in rows:
        gbps, op = tier_bandwidth(row.run)
        wins = {int(p["prefix_tokens"]): bool(gbps >= p["breakeven_gbps"]) for p in prefixes}
        verdicts.append(TierVerdict(gbps, op, wins))
    model = str(trace["model"].get("name", "?"))
    return Breakeven(model, trace["gpu"], prefixes, tuple(verdicts)), ""


def _given_traces(traces: Sequence[str | os.PathLike], shas: Sequence[str]) -> dict[str, str]:
    """Each trace in ``traces`` by its SHA-256, which must be that of one of the groups."""
    found: dict[str, str] = {}
    for given in traces:
        path = os.fspath(given)
        read_header(path)  # a missing, unreadable or foreign file is a TraceError saying so
        sha = file_sha256(path)
        if sha not in shas:
            known = ", ".join(s[:SHORT_SHA_LEN] for s in shas)
            raise ConfigError(f"--trace {path}: SHA-256 {sha[:SHORT_SHA_LEN]} is not the trace of "
                              f"any run in the report (their traces: {known})")
        found.setdefault(sha, path)
    return found


def _recorded_trace(sha: str, runs: Sequence[Run],
                    hashes: dict[str, str]) -> tuple[str | None, str]:
    """The trace path recorded in these runs' results, if the file there is still the trace they
    replayed; else None and a one-line note on how to get the capacity section."""
    reasons = []
    for path in dict.fromkeys(str(_get(run.meta, "trace.path") or "") for run in runs):
        if not path:
            continue
        if not os.path.isfile(path):
            reasons.append(f"{path} not found")
            continue
        key = os.path.realpath(path)
        try:
            if key not in hashes:
                hashes[key] = file_sha256(path)
        except OSError as exc:
            reasons.append(f"{path} unreadable ({exc.strerror or exc})")
            continue
        if hashes[key] == sha:
            return path, ""
        reasons.append(f"{path} has changed since the replay")
    why = reasons[0] if reasons else "the results do not say where the trace is"
    return None, f"capacity curve: needs the trace ({why}); add --trace TRACE"


def _capacity(path: str, found_by: str, baseline: RunRow) -> Capacity:
    """The capacity section from the trace at ``path``; the TTFT loads cached prefixes at the
    tier bandwidth of the group's baseline run."""
    trace = read_trace(path)
    thresholds = analysis.prefix_hit_thresholds(trace)  # one stack-distance pass for both
    curve = analysis.capacity_curve(trace, points=CAPACITY_POINTS, thresholds=thresholds)
    gbps, op = tier_bandwidth(baseline.run)
    label = baseline.run.label
    if not trace.header.meta.get("gpu"):
        return Capacity(path, found_by, curve, None, math.nan,
                        "no modelled TTFT: the trace has no GPU compute model")
    if op is None:
        return Capacity(path, found_by, curve, None, math.nan,
                        f"no modelled TTFT: the baseline run {label} moved no KV from the tier")
    ttft = tuple(analysis.capacity_ttft(trace, curve, gbps, thresholds))
    note = (f"TTFT modelled for prefill alone (no queueing), cached prefixes loaded at "
            f"{gbps:.2f} GB/s (the {op} GB/s of the baseline run {label})")
    return Capacity(path, found_by, curve, ttft, gbps, note)


def _normalise_baseline(baseline: str | int | None, runs: list[Run]) -> str | int | None:
    if baseline is None:
        return None
    if isinstance(baseline, bool) or not isinstance(baseline, (str, int)):
        raise ConfigError(f"baseline must be a run label or an index, got {baseline!r}")
    if isinstance(baseline, int):
        if baseline < 0:
            raise ConfigError(f"baseline index must be 0 or more, got {baseline}")
        return baseline
    labels = {run.label for run in runs}
    if baseline in labels:
        return baseline
    if baseline.isdigit():
        return int(baseline)
    shown = ", ".join(sorted(labels))
    raise ConfigError(f"no run is labelled '{baseline}' (labels: {shown})")


def _choose_baseline(
    runs: list[Run], summaries: list[Mapping[str, float]], baseline: str | int | None
) -> tuple[int, str]:
    """Index of the baseline among one group's ``runs``, and the rule that picked it."""
    short = runs[0].trace_sha256[:SHORT_SHA_LEN]
    if isinstance(baseline, int):
        if baseline >= len(runs):
            raise ConfigError(
                f"baseline index {baseline} is out of range: trace {short} has {len(runs)} runs"
            )
        return baseline, f"run {baseline} of this trace"
    fallback_note = ""
    if isinstance(baseline, str):
        matches = [i for i, run in enumerate(runs) if run.label == baseline]
        if len(matches) > 1:
            raise ConfigError(
                f"baseline '{baseline}' is ambiguous: {len(matches)} runs of trace {short} carry it"
            )
        if matches:
            return matches[0], f"labelled '{baseline}'"
        fallback_note = f"; no run labelled '{baseline}'"
    ttft = np.array([s["median_ttft_ms"] for s in summaries], dtype=np.float64)
    eligible = np.array([r.is_measured for r in runs]) & ~np.isnan(ttft)
    if not eligible.any():
        return 0, f"first run: no measured run{fallback_note}"
    # argmin returns the first of equal minima, so ties go to the earlier run.
    chosen = int(np.argmin(np.where(eligible, ttft, np.inf)))
    return chosen, f"fastest measured run by median TTFT{fallback_note}"


def _run_row(
    run: Run,
    summary: Mapping[str, float],
    base: Mapping[str, float],
    is_baseline: bool,
    slo: SLO | None,
) -> RunRow:
    shares = metrics.breakdown_shares(summary)
    shares["kv_stall"] = run.kv_stall_share
    ratio, delta = {}, {}
    for name, key, _ in COMPARED:
        value, reference = summary[key], base[key]
        delta[name] = value - reference
        ratio[name] = value / reference if reference > 0 else math.nan
    if slo is None:
        good, p99_met = None, None
    else:
        good = metrics.goodput(run.table, slo.ttft_ms, slo.tpot_ms, run.duration_s)
        p99_met = metrics.slo_p99_met(summary, slo)
    return RunRow(
        run=run,
        summary=summary,
        kv={op: run.kv_op(op) for op in KV_OPS},
        shares=shares,
        goodput=good,
        slo_p99_met=p99_met,
        is_baseline=is_baseline,
        ratio=ratio,
        delta_ms=delta,
    )


def run_record(row: RunRow, group: Group, slo: SLO | None = None) -> dict[str, Any]:
    """One run as a JSON-ready mapping: identity, vLLM's keys, KV and breakdown, comparison.

    Nested mappings (``figures``, ``breakdown``, ``ratio_vs_baseline``,
    ``delta_vs_baseline_ms``) stay nested; flat outputs join the keys with ``_``. NaN stays NaN
    here; each renderer spells it.
    """
    run = row.run
    record: dict[str, Any] = {
        "label": run.label,
        "backend": run.backend_spec,
        "backend_name": run.backend_name,
        "mode": run.mode,
        "figures": dict(run.figures),
        "path": run.path,
        "run_id": run.run_id,
        "trace_sha256": run.trace_sha256,
        "workload": run.workload_kind,
        "tier_policy": run.tier_policy,
        "model": run.model_name,
        "is_baseline": row.is_baseline,
        "baseline_label": group.baseline.run.label,
        **row.summary,
    }
    if slo is not None:
        record["slo"] = slo.name
        record["slo_ttft_ms"] = slo.ttft_ms
        record["slo_tpot_ms"] = slo.tpot_ms
        record["request_goodput"] = row.goodput
        record["slo_p99_met"] = row.slo_p99_met
    for op in KV_OPS:
        record[f"kv_gbps_{op}"] = row.kv[op]["gbps"]
    for op in KV_OPS:
        for p in KV_OP_PERCENTILES:
            record[f"kv_{p}_ns_{op}"] = row.kv[op][f"{p}_ns"]
    record["breakdown"] = dict(row.shares)
    record["dedup_ratio"] = run.dedup_ratio
    record["ratio_vs_baseline"] = dict(row.ratio)
    record["delta_vs_baseline_ms"] = dict(row.delta_ms)
    verdict = (group.breakeven.verdicts[group.rows.index(row)] if group.breakeven is not None
               else None)
    record["breakeven"] = {
        "tier_gbps": verdict.gbps if verdict else math.nan,
        "tier_op": verdict.op if verdict else None,
        "reuse_wins_from_tokens": verdict.wins_from_tokens if verdict else None,
    }
    return record


def report_records(report: Report) -> list[dict[str, Any]]:
    """:func:`run_record` of every run, group by group."""
    return [run_record(row, group, report.slo) for group in report.groups for row in group.rows]


def trace_record(group: Group) -> dict[str, Any]:
    """One group's trace-level sections as a JSON-ready mapping: ``breakeven`` (per prefix
    length, and per run its tier GB/s and verdicts) and ``capacity`` (the curve, its saturation
    point and the modelled TTFT), each None with a ``*_note`` saying why."""
    be, cap = group.breakeven, group.capacity
    breakeven = None
    if be is not None:
        breakeven = {
            "model": be.model,
            "gpu": dict(be.gpu),
            "prefixes": [dict(p) for p in be.prefixes],
            "runs": [
                {"label": row.run.label, "tier_gbps": v.gbps, "tier_op": v.op,
                 "reuse_wins": {str(p): w for p, w in v.wins.items()},
                 "reuse_wins_from_tokens": v.wins_from_tokens}
                for row, v in zip(group.rows, be.verdicts)
            ],
        }
    capacity = None
    if cap is not None:
        capacity = {
            "trace_path": cap.trace_path,
            "found_by": cap.found_by,
            **cap.curve,
            "saturation_bytes": (None if cap.saturation_index is None
                                 else cap.curve["capacity_bytes"][cap.saturation_index]),
            "load_gbps": cap.load_gbps,
            "ttft": [dict(t) for t in cap.ttft] if cap.ttft is not None else None,
            "ttft_note": cap.ttft_note,
        }
    return {
        "workload": group.trace.workload_kind,
        "tier_policy": group.trace.tier_policy,
        "model": group.trace.model_name,
        "baseline_label": group.baseline.run.label,
        "breakeven": breakeven,
        "breakeven_note": group.breakeven_note or None,
        "capacity": capacity,
        "capacity_note": group.capacity_note or None,
    }


# --------------------------------------------------------------------------------------------
# Renderers


def render_json(report: Report) -> str:
    """The report as a JSON object: ``runs``, a list of :func:`run_record` objects, and
    ``traces``, :func:`trace_record` of each group keyed by its trace's SHA-256. NaN is written
    as ``null``."""
    document = {
        "runs": report_records(report),
        "traces": {group.trace_sha256: trace_record(group) for group in report.groups},
    }
    return json.dumps(_json_ready(document), indent=2, allow_nan=False) + "\n"


def render_csv(report: Report) -> str:
    """The runs as CSV, one row per run, columns as :func:`run_record` flattened with ``_``,
    except ``figures``, which becomes :func:`_figures_columns`; NaN and absent values are empty
    cells."""
    records = [_flatten(_figures_columns(r)) for r in report_records(report)]
    out = io.StringIO()
    if records:
        writer = csv.DictWriter(out, fieldnames=list(records[0]), lineterminator="\n")
        writer.writeheader()
        for record in records:
            writer.writerow({k: _csv_cell(v) for k, v in record.items()})
    return out.getvalue()


def _figures_columns(record: Mapping[str, Any]) -> dict[str, Any]:
    """A run record with its ``figures`` as flat CSV columns, in its place: ``figures_kind``,
    ``figures_flags`` (joined with ``;``), ``host_bound_share``, ``floor_share``,
    ``upper_bound``, ``figures_locality``, ``figures_compute`` and ``figures_label``."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key != "figures":
            out[key] = value
            continue
        out.update({
            "figures_kind": value["kind"],
            "figures_flags": ";".join(value["flags"]),
            "host_bound_share": value["host_bound_share"],
            "floor_share": value["floor_share"],
            "upper_bound": value["upper_bound"],
            "figures_locality": value["locality"],
            "figures_compute": value["compute"],
            "figures_label": value["label"],
        })
    return out


#: Narrowest terminal the table renderer lays out for.
MIN_TABLE_WIDTH = 80


def render_table(report: Report, width: int = 100) -> str:
    """The report as plain-text tables no wider than ``width`` columns.

    Per trace: a header naming the trace and its baseline, then latency, comparison with the
    baseline, KV bandwidth and time shares, how each run's KV figures were obtained, the
    break-even section and the capacity section (or the line saying why each is missing). The
    mode column says ``measured``, ``emulated`` or ``virtual`` and the run's flags
    (:mod:`kvemu.figures`), the footer what each means; ``*`` marks the baseline.
    """
    if width < MIN_TABLE_WIDTH:
        raise ConfigError(f"table width must be at least {MIN_TABLE_WIDTH}, got {width}")
    lines: list[str] = []
    lines += _wrap(f"{_title(report)}; times in ms", width)
    if report.slo is not None:
        lines += _wrap(f"SLO {report.slo.describe()}", width)

    for group in report.groups:
        trace = group.trace
        lines.append("")
        lines += _wrap(
            f"trace {trace.trace_description}  model {trace.model_name}  "
            f"dedup {_fmt(trace.dedup_ratio, '.2f')}x",
            width,
        )
        lines += _wrap(f"baseline: {group.baseline.run.label} ({group.baseline_rule})", width)
        lines.append("")
        lines += _latency_section(group, width)
        lines.append("")
        lines += _comparison_section(group, report.slo, width)
        lines.append("")
        lines += _kv_section(group, width)
        lines.append("")
        lines += _layout(*_figures_table(group), width)
        for section in (_breakeven_section(group, width), _capacity_section(group, width)):
            if section:
                lines += [""] + section

    lines.append("")
    notes = ["* baseline of its trace."] + _explanations(report)
    notes += [f"skipped {path}: {why}" for path, why in report.skipped]
    for note in notes:
        lines += _wrap(note, width)
    return "\n".join(lines) + "\n"


def _explanations(report: Report) -> list[str]:
    """What the report's less obvious entries mean: each kind of KV figures and flag present,
    compute time, goodput, time shares, the trace sections. Each note is ``term: text``."""
    notes = []
    figures = [row.run.figures for row in report.rows]
    kinds = {f["kind"] for f in figures}
    flags = {flag for f in figures for flag in f["flags"]}
    if "measured" in kinds:
        notes.append(
            "measured: KV accesses performed and timed on this host (its memory, NUMA node, "
            "mapping or file), standing for the tier."
        )
    if "host-bound" in flags:
        notes.append(
            "host-bound: a measured run in which this host's CPU workers could not supply what "
            "the modelled GPU link would carry for that share of its KV time; its KV times are "
            "this host's and an upper bound of the tier's."
        )
    if "emulated" in kinds:
        notes.append(
            "emulated: KV times are delays injected on this host to a tier profile, after moving "
            "the bytes in this host's memory, so they are never faster than this host."
        )
    if "floor-limited" in flags:
        notes.append(
            "floor-limited: the share of an emulated run's accesses in which this host was "
            "slower than the profile; their times are this host's, so the run's KV times are an "
            "upper bound of the tier's."
        )
    if "virtual" in kinds:
        notes.append(
            "virtual: KV times are the profile's model computed in virtual time; no data moved "
            "and nothing waited, so they are not bounded by this host and say nothing about it."
        )
    if "local" in flags:
        notes.append(
            "local: a numa run whose arena is on the replaying CPU's own node (no allowed CPU "
            "lies outside it): the dram baseline through the numa path, not a remote tier."
        )
    compute = ("compute: GPU compute time is modelled (docs/engine.md), not measured, in every "
               "kind of run")
    if any(f["compute"] == "recorded" for f in figures):
        compute += ("; runs of a trace recorded from a real run replay the compute times "
                    "recorded with it (docs/sources.md)")
    notes.append(compute + ".")
    if report.slo is not None:
        notes.append(
            "goodput: requests/s meeting every SLO objective request by request (vLLM); "
            "p99 ok: the run's p99 TTFT and TPOT are within the SLO (MLPerf)."
        )
    notes.append(
        "time share: each component's part of the per-request time attributed to queue, KV load, "
        "store, read and compute; stall: share of step time that KV work added beyond compute."
    )
    if any(group.breakeven is not None for group in report.groups):
        notes.append(
            "break-even: the tier bandwidth at which loading a reused prefix takes as long as "
            "recomputing it on the trace's GPU model, KV bytes / prefill compute time "
            "(docs/analysis.md); a run's tier GB/s is its KV load GB/s, or its read GB/s when it "
            "loaded nothing."
        )
    if any(group.capacity is not None for group in report.groups):
        notes.append(
            "capacity: share of prompt tokens whose prefix blocks hit in an LRU tier of that "
            "capacity, the prompts taken in arrival order (exact stack distances; "
            "docs/analysis.md); of max: share of the hit ratio of an unbounded tier."
        )
    return notes


def _title(report: Report) -> str:
    n_runs, n_traces = len(report.rows), len(report.groups)
    return (
        f"kvemu report: {n_runs} run{'s' * (n_runs != 1)} of {n_traces} "
        f"trace{'s' * (n_traces != 1)}"
    )


def _label_cell(row: RunRow) -> str:
    return f"{'*' if row.is_baseline else ' '} {row.run.label}"


def _latency_section(group: Group, width: int) -> list[str]:
    return _layout(*_latency_table(group), width)


def _latency_table(group: Group) -> tuple[list[_Column], list[list[str]]]:
    """Columns and cells of a group's latency table; the first cell of each row is its label."""
    columns = [
        _Column("run", flex=True),
        _Column("backend", flex=True),
        # the kind and flags of the figures, cut after the label and backend (which other
        # tables repeat) and never below the kind
        _Column("mode", flex=True, min_width=len("emulated…"), cut_last=True),
        _Column("reqs", right=True),
        _Column("p50", right=True, group="TTFT ms"),
        _Column("p99", right=True, group="TTFT ms"),
        _Column("mean", right=True, group="TPOT ms"),
        _Column("p99", right=True, group="TPOT ms"),
        _Column("p50", right=True, group="E2EL ms"),
    ]
    body = []
    for row in group.rows:
        s = row.summary
        body.append([
            _label_cell(row),
            row.run.backend_spec,
            _mode_text(row.run),
            str(s["completed"]),
            _ms(s["median_ttft_ms"]),
            _ms(s["p99_ttft_ms"]),
            _ms(s["mean_tpot_ms"]),
            _ms(s["p99_tpot_ms"]),
            _ms(s["median_e2el_ms"]),
        ])
    return columns, body


def _mode_text(run: Run) -> str:
    """The kind of a run's KV figures and its flags: ``measured``, ``emulated floor-limited``."""
    return " ".join([run.kind, *run.figures["flags"]])


def _figures_table(group: Group) -> tuple[list[_Column], list[list[str]]]:
    """Columns and cells of how each run's KV figures were obtained and what bounded them."""
    columns = [_Column("KV figures", flex=True), _Column("how obtained, what bounded them")]
    return columns, [[_label_cell(row), row.run.figures["label"]] for row in group.rows]


def _comparison_section(group: Group, slo: SLO | None, width: int) -> list[str]:
    return _layout(*_comparison_table(group, slo), width)


def _comparison_table(group: Group, slo: SLO | None) -> tuple[list[_Column], list[list[str]]]:
    """Columns and cells of a group's comparison with its baseline (and goodput with an SLO)."""
    columns = [_Column("vs baseline", flex=True)]
    for _, _, header in COMPARED:
        columns += [
            _Column("Δ ms", right=True, group=header),
            _Column("ratio", right=True, group=header),
        ]
    if slo is not None:
        columns += [
            _Column("req/s", right=True, group="goodput"),
            _Column("good %", right=True, group="goodput"),
            _Column("p99 ok", right=True),
        ]
    body = []
    for row in group.rows:
        cells = [_label_cell(row)]
        for name, _, _ in COMPARED:
            cells += [_signed_ms(row.delta_ms[name]), _fmt(row.ratio[name], ".2f") + "x"]
        if slo is not None:
            throughput = row.summary["request_throughput"]
            good_pct = 100 * row.goodput / throughput if throughput > 0 else math.nan
            cells += [_fmt(row.goodput, ".2f"), _fmt(good_pct, ".1f"),
                      "yes" if row.slo_p99_met else "NO"]
        body.append(cells)
    return columns, body


_SHARE_HEADERS = {"queue": "queue", "kv_load": "load", "kv_store": "store", "kv_read": "read",
                  "compute": "compute"}


def _kv_section(group: Group, width: int) -> list[str]:
    return _layout(*_kv_table(group), width)


def _kv_table(group: Group) -> tuple[list[_Column], list[list[str]]]:
    """Columns and cells of a group's KV bandwidth per op and time shares."""
    columns = [_Column("KV and time", flex=True)]
    columns += [_Column(op, right=True, group="KV GB/s") for op in KV_OPS]
    columns += [_Column(_SHARE_HEADERS[c], right=True, group="time share %")
                for c in metrics.BREAKDOWN_COMPONENTS]
    columns.append(_Column("stall %", right=True))
    body = []
    for row in group.rows:
        cells = [_label_cell(row)]
        cells += [_fmt(row.kv[op]["gbps"], ".2f") for op in KV_OPS]
        cells += [_fmt(100 * row.shares[c], ".1f") for c in metrics.BREAKDOWN_COMPONENTS]
        cells.append(_fmt(100 * row.shares["kv_stall"], ".1f"))
        body.append(cells)
    return columns, body


def _breakeven_section(group: Group, width: int) -> list[str]:
    if group.breakeven is None:
        return _wrap(group.breakeven_note, width) if group.breakeven_note else []
    lines = _wrap(_breakeven_heading(group.breakeven), width)
    lines += _layout(*_breakeven_table(group.breakeven), width)
    lines.append("")
    lines += _layout(*_verdict_table(group), width)
    return lines


def _breakeven_heading(be: Breakeven) -> str:
    gpu = be.gpu
    return (f"reuse or recompute: {be.model} on {gpu.get('gpus', '?')} x {gpu.get('name', '?')} "
            f"(MFU {gpu.get('mfu', '?')}); loading a reused prefix beats recomputing it when the "
            f"tier delivers at least the break-even GB/s")


def _breakeven_table(be: Breakeven) -> tuple[list[_Column], list[list[str]]]:
    """Columns and cells of the break-even bandwidth per standard prefix length."""
    columns = [_Column("prefix tokens", right=True), _Column("KV", right=True),
               _Column("recompute ms", right=True), _Column("break-even GB/s", right=True)]
    body = [[f"{int(p['prefix_tokens']):,}", human_bytes(p["kv_bytes"]), _ms(p["recompute_ms"]),
             _fmt(p["breakeven_gbps"], ".2f")] for p in be.prefixes]
    return columns, body


def _tokens_short(tokens: int) -> str:
    """``1k`` for 1024 tokens, ``128k`` for 131072; other counts as they are."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _verdict_table(group: Group) -> tuple[list[_Column], list[list[str]]]:
    """Columns and cells of each run's tier GB/s and, per prefix length, whether reuse wins."""
    be = group.breakeven
    heading = "reuse beats recompute at prefix tokens"
    columns = [_Column("tier vs break-even", flex=True), _Column("GB/s", right=True),
               _Column("op")]
    # headers at least as wide as "yes", so the heading fits even when every cell is "-"
    columns += [_Column(_tokens_short(int(p["prefix_tokens"])).rjust(3), right=True, group=heading)
                for p in be.prefixes]
    columns.append(_Column("reuse wins", right=True))
    body = []
    for row, verdict in zip(group.rows, be.verdicts):
        cells = [_label_cell(row), _fmt(verdict.gbps, ".2f"), verdict.op or "-"]
        if verdict.op is None:
            cells += ["-"] * (len(be.prefixes) + 1)
        else:
            cells += ["yes" if win else "no" for win in verdict.wins.values()]
            start = verdict.wins_from_tokens
            cells.append("never" if start is None else f"from {_tokens_short(start)}")
        body.append(cells)
    return columns, body


def _capacity_section(group: Group, width: int) -> list[str]:
    cap = group.capacity
    if cap is None:
        return _wrap(group.capacity_note, width) if group.capacity_note else []
    lines = _wrap(_capacity_heading(cap), width)
    lines += _layout(*_capacity_table(cap), width)
    lines += _wrap(_capacity_summary(cap), width)
    return lines


def _capacity_heading(cap: Capacity) -> str:
    how = "given with --trace" if cap.found_by == "--trace" else "as recorded in the results"
    return (f"tier capacity: prefix-hit ratio of an LRU tier of each capacity, from the trace "
            f"{cap.trace_path} ({how})")


def _capacity_table(cap: Capacity) -> tuple[list[_Column], list[list[str]]]:
    """Columns and cells of the capacity curve: one row per capacity on the grid."""
    curve = cap.curve
    columns = [_Column("capacity", right=True), _Column("blocks", right=True),
               _Column("tokens", right=True), _Column("hit ratio", right=True),
               _Column("of max", right=True), _Column("mean", right=True, group="TTFT ms"),
               _Column("p50", right=True, group="TTFT ms"), _Column("")]
    unbounded = curve["unbounded_hit_ratio"]
    body = []
    for i, blocks in enumerate(curve["capacity_blocks"]):
        ratio = curve["hit_ratio"][i]
        ttft = cap.ttft[i] if cap.ttft is not None else {}
        body.append([
            human_bytes(curve["capacity_bytes"][i]),
            f"{blocks:,}",
            f"{curve['capacity_tokens'][i]:,}",
            f"{ratio:.4f}",
            _fmt(ratio / unbounded if unbounded > 0 else math.nan, ".0%"),
            _ms(ttft.get("mean_ttft_ms", math.nan)),
            _ms(ttft.get("median_ttft_ms", math.nan)),
            "<- 95% of max" if i == cap.saturation_index else "",
        ])
    return columns, body


def _capacity_summary(cap: Capacity) -> str:
    curve = cap.curve
    unbounded = curve["unbounded_hit_ratio"]
    i = cap.saturation_index
    if i is None:
        reach = "no prompt block is reused, so the hit ratio is 0 at every capacity"
    else:
        reach = (f"95% of it is reached at {human_bytes(curve['capacity_bytes'][i])} "
                 f"({curve['capacity_blocks'][i]:,} blocks, {curve['capacity_tokens'][i]:,} "
                 f"tokens)")
    return f"unbounded hit ratio {unbounded:.4f}; {reach}; {cap.ttft_note}."


@dataclass(frozen=True)
class _Column:
    header: str
    right: bool = False
    flex: bool = False  # may be cut short (with an ellipsis) to fit the width
    group: str = ""  # a heading spanning adjacent columns with the same group
    min_width: int = 0  # a flexible column is never cut below this (nor below _MIN_FLEX)
    cut_last: bool = False  # cut only once the other flexible columns are as short as they go


_GAP = "  "
_MIN_FLEX = 8


def _layout(columns: list[_Column], body: list[list[str]], width: int) -> list[str]:
    """Aligned text lines of one table, flexible columns cut short so no line exceeds ``width``.

    Adjacent columns sharing a ``group`` get one heading line above their headers.
    """
    widths = [max([len(c.header)] + [len(r[i]) for r in body]) for i, c in enumerate(columns)]
    spans, start = [], 0
    for i in range(1, len(columns) + 1):
        if i == len(columns) or columns[i].group != columns[start].group:
            spans.append((start, i))
            start = i

    def span_width(a: int, b: int) -> int:
        return sum(widths[a:b]) + len(_GAP) * (b - a - 1)

    for a, b in spans:
        widths[b - 1] += max(0, len(columns[a].group) - span_width(a, b))

    excess = span_width(0, len(columns)) - width
    while excess > 0:
        flexible = [i for i, c in enumerate(columns)
                    if c.flex and widths[i] > max(_MIN_FLEX, c.min_width)]
        if not flexible:
            break  # the fixed columns alone are wider; MIN_TABLE_WIDTH keeps us from here
        flexible = [i for i in flexible if not columns[i].cut_last] or flexible
        widths[max(flexible, key=lambda i: widths[i])] -= 1
        excess -= 1

    def line(cells: list[str]) -> str:
        parts = []
        for cell, column, w in zip(cells, columns, widths):
            cell = _truncate(cell, w)
            parts.append(cell.rjust(w) if column.right else cell.ljust(w))
        return _GAP.join(parts).rstrip()

    lines = []
    if any(c.group for c in columns):
        lines.append(_GAP.join(
            _truncate(columns[a].group, span_width(a, b)).center(span_width(a, b))
            for a, b in spans
        ).rstrip())
    lines.append(line([c.header for c in columns]))
    lines += [line(r) for r in body]
    return lines


def _truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False) or [""]


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _ms(value: float) -> str:
    """A duration in ms with about four significant digits and no exponent."""
    if math.isnan(value):
        return "-"
    magnitude = abs(value)
    decimals = 0 if magnitude >= 1000 else 1 if magnitude >= 100 else 2 if magnitude >= 10 else 3
    return f"{value:.{decimals}f}"


def _signed_ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "0" if value == 0 else ("+" if value > 0 else "") + _ms(value)


def _json_ready(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    return value


def _flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}_"))
        else:
            flat[name] = value
    return flat


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ""
    return value


# --------------------------------------------------------------------------------------------
# HTML

#: What the page may load: nothing but its own inline style and ``data:`` images. A browser then
#: refuses anything external, so a page that renders completely is self-contained.
HTML_CONTENT_POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

_HTML_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1d1d1f;
       margin: 0 auto; padding: 1.5em 2em 3em; max-width: 1240px; }
h1 { font-size: 1.6em; margin: 0 0 .2em; }
h2 { font-size: 1.25em; margin: 2.2em 0 .3em; padding-top: .6em; border-top: 2px solid #ddd; }
h3 { font-size: 1.02em; margin: 1.4em 0 .4em; }
.meta, .trace-facts { color: #555; margin: .2em 0; }
code { font-size: .95em; background: #f2f2f2; padding: 0 .25em; border-radius: 3px; }
.note { background: #fff8e1; border-left: 4px solid #f0b400; padding: .6em .9em; margin: 1em 0; }
table { border-collapse: collapse; margin: .3em 0 .8em; font-variant-numeric: tabular-nums; }
th, td { padding: .28em .7em; border-bottom: 1px solid #e3e3e3; text-align: left;
         white-space: nowrap; }
thead th { background: #f4f5f7; font-weight: 600; border-bottom: 2px solid #cfd3da; }
thead th[colspan] { text-align: center; border-bottom: 1px solid #cfd3da; }
td.num, th.num { text-align: right; }
tr.baseline td { font-weight: 600; }
tr.emulated td { background: #fff4e5; }
tr.virtual td { background: #f3effa; }
tr.marked th, tr.marked td { font-weight: 600; background: #eaf3ea; }
.badge { display: inline-block; font-size: .78em; font-weight: 700; letter-spacing: .03em;
         padding: .05em .45em; border-radius: 3px; }
.badge.measured { background: #2e7d32; color: #fff; }
.badge.emulated { background: #e8710a; color: #fff; }
.badge.virtual { background: #7b4fb6; color: #fff; }
.badge.host-bound, .badge.floor-limited { background: #c62828; color: #fff; }
.badge.local { background: #00796b; color: #fff; }
.badge.baseline { background: #3b6fb6; color: #fff; }
td.path { white-space: normal; word-break: break-all; font-family: ui-monospace, monospace;
          font-size: .9em; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(440px, 1fr)); gap: 1em; }
figure { margin: 0; }
figure.wide { grid-column: 1 / -1; }
figure img { max-width: 100%; height: auto; border: 1px solid #e3e3e3; }
figcaption { color: #555; font-size: .9em; margin-top: .2em; }
footer { margin-top: 2.5em; color: #444; }
footer li { margin: .25em 0; }
"""


def html_page(report: Report, now: datetime | None = None) -> str:
    """The report as one self-contained HTML page (``<style>`` inline, figures as ``data:`` PNGs).

    Per trace, the tables of :func:`render_table` as ``<table>`` elements, then a TTFT CDF (log x
    axis), a TPOT CDF, stacked time-breakdown bars per run, the break-even bandwidth with each
    run's tier GB/s and the capacity curve, drawn by :mod:`kvemu.plots` when matplotlib is
    installed; without it the page says how to get them. Every string that comes
    from a results file (labels, backend specs, paths, host names) is escaped. ``now`` is the
    generation time shown (default: the current time, UTC).
    """
    now = now or datetime.now(timezone.utc)
    missing = plots.unavailable_reason()
    title = _title(report)
    hosts = []
    for row in report.rows:
        host = _host_description(row.run)
        if host not in hosts:
            hosts.append(host)

    out = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta http-equiv="Content-Security-Policy" content="{_esc(HTML_CONTENT_POLICY)}">',
        f'<meta name="generator" content="kvemu {_esc(__version__)}">',
        f"<title>{_esc(title)}</title>",
        f"<style>{_HTML_STYLE}</style>",
        "</head>",
        "<body>",
        "<header>",
        f"<h1>{_esc(title)}</h1>",
        f'<p class="meta">Generated by kvemu {_esc(__version__)} on '
        f'{_esc(now.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"))}; '
        f"times in ms.</p>",
        f'<p class="meta">Host{"s" * (len(hosts) != 1)} of the runs: '
        f"{_esc('; '.join(hosts))}.</p>",
    ]
    if report.slo is not None:
        out.append(f'<p class="meta">SLO: {_esc(report.slo.describe())}.</p>')
    if missing is not None:
        out.append(
            f'<p class="note" id="plots-missing">Plots are not included: {_esc(missing)}. '
            f"Install the plotting extra with <code>{_esc(plots.INSTALL_HINT)}</code> and render "
            "the report again to get the TTFT and TPOT CDFs and the time-breakdown bars.</p>"
        )
    if len(report.groups) > 1:
        out.append("<nav><ul>")
        for i, group in enumerate(report.groups):
            out.append(f'<li><a href="#trace-{i}">trace '
                       f"{_esc(group.trace.trace_description)}</a></li>")
        out.append("</ul></nav>")
    out.append("</header>")

    for i, group in enumerate(report.groups):
        out += _html_group(group, i, report.slo, missing)

    out += ["<footer>", "<h2>Notes</h2>", "<ul>"]
    out.append('<li><span class="badge baseline">baseline</span> the run each run of its trace '
               "is compared with.</li>")
    for note in _explanations(report):
        term, _, text = note.partition(": ")
        if term in FIGURE_BADGES:
            term_html = _badge(term)
        else:
            term_html = f"<strong>{_esc(term)}</strong>:"
        out.append(f"<li>{term_html} {_esc(text)}</li>")
    out.append(
        "<li><strong>percentiles</strong>: numpy's linear interpolation between order statistics; "
        "TPOT leaves out requests with one output token, which have none.</li>"
    )
    out.append("</ul>")
    out += _html_sources(report)
    out += ["</footer>", "</body>", "</html>", ""]
    return "\n".join(out)


def render_html(report: Report, path: str | os.PathLike, force: bool = False) -> Path:
    """Write :func:`html_page` of ``report`` to ``path`` and return the path written.

    The file is written atomically (:func:`kvemu.output.atomic_output`): the destination is
    checked before any figure is drawn, and an existing file is replaced only with ``force``
    (otherwise :class:`~kvemu.errors.OutputError`).
    """
    final = check_destination(path, force)
    page = html_page(report)
    with atomic_output(final, force) as tmp:
        Path(tmp).write_text(page, encoding="utf-8")
    return final


def _html_group(group: Group, index: int, slo: SLO | None, missing: str | None) -> list[str]:
    trace = group.trace
    out = [
        f'<section class="trace" id="trace-{index}">',
        f"<h2>Trace {_esc(trace.trace_description)}</h2>",
        f'<p class="trace-facts">SHA-256 <code>{_esc(trace.trace_sha256)}</code> · model '
        f"{_esc(trace.model_name)} · dedup ratio {_esc(_fmt(trace.dedup_ratio, '.2f'))}x · "
        f"baseline: <strong>{_esc(group.baseline.run.label)}</strong> "
        f"({_esc(group.baseline_rule)})</p>",
        "<h3>Latency (ms)</h3>",
        *_html_table(group, *_latency_table(group), "latency"),
        "<h3>Compared with the baseline</h3>",
        *_html_table(group, *_comparison_table(group, slo), "comparison"),
        "<h3>KV bandwidth and time shares</h3>",
        *_html_table(group, *_kv_table(group), "kv"),
        "<h3>Reuse or recompute: break-even bandwidth</h3>",
    ]
    be = group.breakeven
    if be is None:
        out.append(f'<p class="note">{_esc(group.breakeven_note)}</p>')
    else:
        out.append(f'<p class="trace-facts">{_esc(_breakeven_heading(be))}.</p>')
        out += _html_grid(*_breakeven_table(be), "breakeven")
        out += _html_table(group, *_verdict_table(group), "verdicts")
    cap = group.capacity
    if cap is not None or group.capacity_note:
        out.append("<h3>Tier capacity</h3>")
    if cap is not None:
        out.append(f'<p class="trace-facts">{_esc(_capacity_heading(cap))}.</p>')
        marked = [i == cap.saturation_index for i in range(len(cap.curve["capacity_blocks"]))]
        out += _html_grid(*_capacity_table(cap), "capacity", marked)
        out.append(f"<p>{_esc(_capacity_summary(cap))}</p>")
    elif group.capacity_note:
        out.append(f'<p class="note">{_esc(group.capacity_note)}</p>')
    out.append("<h3>Plots</h3>")
    if missing is not None:
        out.append(f'<p class="note">No plots: {_esc(missing)}; '
                   f"<code>{_esc(plots.INSTALL_HINT)}</code> adds them.</p>")
    else:
        out.append('<div class="plots">')
        for figure in _group_figures(group):
            out.append(figure)
        out.append("</div>")
    out.append("</section>")
    return out


def _html_table(group: Group, columns: list[_Column], body: list[list[str]],
                kind: str) -> list[str]:
    """A ``<table>`` of one of the text tables with a row per run: grouped headings span their
    columns, the label cell carries the baseline badge and the run's figures badges (but for
    ``measured``), the mode column all of its figures badges, rows of emulated and virtual runs
    are tinted."""
    return _html_grid(columns, body, kind, runs=group.rows)


def _html_grid(columns: list[_Column], body: list[list[str]], kind: str,
               marked: Sequence[bool] = (), runs: Sequence[RunRow] = ()) -> list[str]:
    """A ``<table>`` of a text table. With ``runs``, one per row, the first cell is the run's
    label with its badges (see :func:`_html_table`); otherwise it is the row's heading as it is.
    Rows whose ``marked`` entry is true are highlighted."""
    spans, start = [], 0
    for i in range(1, len(columns) + 1):
        if i == len(columns) or columns[i].group != columns[start].group:
            spans.append((start, i))
            start = i
    grouped = any(c.group for c in columns)
    out = [f'<table class="{kind}">', "<thead>"]
    if grouped:
        cells = []
        for a, b in spans:
            if columns[a].group:
                cells.append(f'<th scope="colgroup" colspan="{b - a}">'
                             f"{_esc(columns[a].group)}</th>")
            else:
                cells += [_html_header(c, rowspan=2) for c in columns[a:b]]
        out.append("<tr>" + "".join(cells) + "</tr>")
        out.append("<tr>" + "".join(_html_header(c) for c in columns if c.group) + "</tr>")
    else:
        out.append("<tr>" + "".join(_html_header(c) for c in columns) + "</tr>")
    out += ["</thead>", "<tbody>"]
    for i, cells in enumerate(body):
        if runs:
            row = runs[i]
            classes = " ".join(c for c in ("baseline" if row.is_baseline else "",
                                           _row_class(row.run)) if c)
            parts = [f'<th scope="row">{_html_label(row)}</th>']
        else:
            classes = "marked" if i < len(marked) and marked[i] else ""
            numeric = ' class="num"' if columns[0].right else ""
            parts = [f'<th scope="row"{numeric}>{_esc(cells[0])}</th>']
        for column, cell in zip(columns[1:], cells[1:]):
            if runs and column.header == "mode":
                parts.append(f"<td>{_html_mode(runs[i].run)}</td>")
            else:
                numeric = ' class="num"' if column.right else ""
                parts.append(f"<td{numeric}>{_esc(cell)}</td>")
        out.append(f'<tr class="{classes}">' if classes else "<tr>")
        out[-1] += "".join(parts) + "</tr>"
    out += ["</tbody>", "</table>"]
    return out


def _html_header(column: _Column, rowspan: int = 1) -> str:
    attrs = ' scope="col"' + (f' rowspan="{rowspan}"' if rowspan > 1 else "")
    attrs += ' class="num"' if column.right else ""
    return f"<th{attrs}>{_esc(column.header)}</th>"


#: Terms of the figures block (:mod:`kvemu.figures`) the page shows as badges: kinds and flags.
FIGURE_BADGES = ("measured", "emulated", "virtual", "host-bound", "floor-limited", "local")


def _badge(term: str, title: str = "") -> str:
    """The badge of a kind or flag of :data:`FIGURE_BADGES`: ``EMULATED``, ``HOST-BOUND``."""
    attr = f' title="{_esc(title)}"' if title else ""
    return f'<span class="badge {term}"{attr}>{_esc(term.upper())}</span>'


def _figure_terms(run: Run, measured: bool = True) -> list[str]:
    """A run's kind and flags; without ``measured``, a measured run's flags alone."""
    kind = run.kind if run.kind in FIGURE_BADGES else "unknown"
    return [t for t in [kind, *run.figures["flags"]] if measured or t != "measured"]


def _html_mode(run: Run) -> str:
    """Badges of a run's kind and flags, each titled with the run's figures label."""
    return " ".join(_badge(t, run.figures["label"]) if t in FIGURE_BADGES else _esc(t)
                    for t in _figure_terms(run))


def _row_class(run: Run) -> str:
    """The tint of a run's rows: ``emulated``, ``virtual``, or none for a measured run."""
    return run.kind if run.kind in ("emulated", "virtual") else ""


def _html_label(row: RunRow) -> str:
    badges = ""
    if row.is_baseline:
        badges += ' <span class="badge baseline">baseline</span>'
    for term in _figure_terms(row.run, measured=False):
        badges += " " + (_badge(term, row.run.figures["label"]) if term in FIGURE_BADGES
                         else _esc(term))
    return f'<span title="{_esc(row.run.path)}">{_esc(row.run.label)}</span>{badges}'


def _plot_tag(row: RunRow) -> str:
    """What follows a run's label in a figure: ``(baseline)``, the kind unless it is measured
    and the flags, upper case (``(baseline, LOCAL)``, ``(EMULATED, FLOOR-LIMITED)``), or
    nothing."""
    tags = ["baseline"] if row.is_baseline else []
    tags += [t.upper() for t in _figure_terms(row.run, measured=False)]
    return f"({', '.join(tags)})" if tags else ""


def _group_figures(group: Group) -> list[str]:
    """``<figure>`` elements of one group: TTFT CDF, TPOT CDF and the breakdown bars."""
    trace = group.trace.trace_description
    rows = group.rows
    labels = [row.run.label for row in rows]
    tags = [_plot_tag(row) for row in rows]
    dashed = [row.run.is_emulated for row in rows]

    def series(name: str) -> list[plots.Series]:
        return [plots.Series(row.run.label, metrics.column(row.run.table, f"{name}_ms"),
                             row.run.is_emulated, tag) for row, tag in zip(rows, tags)]

    mean_ms = [
        [row.summary[f"total_{c}_ms"] / row.summary["completed"] if row.summary["completed"]
         else math.nan for c in metrics.BREAKDOWN_COMPONENTS]
        for row in rows
    ]
    figures = [
        (plots.cdf_png(series("ttft"), title=f"TTFT CDF · trace {trace}",
                       xlabel="time to first token (ms)", log_x=True),
         f"TTFT CDF per run, trace {trace}",
         "TTFT per request, one curve per run; log x axis. Dashed: emulated and virtual runs.", ""),
        (plots.cdf_png(series("tpot"), title=f"TPOT CDF · trace {trace}",
                       xlabel="time per output token (ms)"),
         f"TPOT CDF per run, trace {trace}",
         "TPOT per request (requests with one output token have none); log x axis when the "
         f"values span {plots.AUTO_LOG_SPREAD:g}x or more. Dashed: emulated and virtual runs.", ""),
        (plots.breakdown_png(labels, mean_ms, title=f"Time breakdown · trace {trace}",
                             components=metrics.BREAKDOWN_COMPONENTS, dashed=dashed, tags=tags),
         f"Time breakdown per run, trace {trace}",
         "Mean time per request attributed to queue, KV load, KV store, KV read and compute, "
         "and each one's share of their sum. With overlap, KV time may be hidden behind "
         "compute. Hatched: emulated and virtual runs.", "wide"),
    ]
    be = group.breakeven
    if be is not None:
        levels = [plots.Level(row.run.label, v.gbps, row.run.is_emulated, tag)
                  for row, v, tag in zip(rows, be.verdicts, tags)]
        figures.append((
            plots.breakeven_png([p["prefix_tokens"] for p in be.prefixes],
                                [p["breakeven_gbps"] for p in be.prefixes], levels,
                                title=f"Reuse or recompute · {be.model}"),
            f"Break-even bandwidth per prefix length and each run's tier GB/s, trace {trace}",
            "Tier bandwidth at which loading a reused prefix beats recomputing it, per prefix "
            "length (log axes); each run's measured tier GB/s as a horizontal line: above the "
            "curve, reuse wins. Dashed: emulated and virtual runs.", ""))
    cap = group.capacity
    if cap is not None:
        curve, i = cap.curve, cap.saturation_index
        figures.append((
            plots.capacity_png(
                curve["capacity_bytes"], curve["hit_ratio"],
                unbounded=curve["unbounded_hit_ratio"],
                saturation_bytes=None if i is None else curve["capacity_bytes"][i],
                mean_ttft_ms=None if cap.ttft is None else [t["mean_ttft_ms"] for t in cap.ttft],
                title=f"Tier capacity · trace {trace}"),
            f"Prefix-hit ratio and modelled TTFT against tier capacity, trace {trace}",
            "Prefix-hit ratio of an LRU tier of each capacity (dotted: unbounded; dashed: 95% "
            "of it reached) and the mean TTFT modelled at that capacity; log x axis. "
            + cap.ttft_note + ".", "wide"))
    return [_html_figure(png, alt, caption, css) for png, alt, caption, css in figures]


def _html_figure(png: bytes, alt: str, caption: str, css: str) -> str:
    width, height = struct.unpack(">II", png[16:24])  # the PNG's IHDR chunk
    data = base64.b64encode(png).decode("ascii")
    opening = f'<figure class="{css}">' if css else "<figure>"
    return (
        f"{opening}"
        f'<img src="data:image/png;base64,{data}" width="{width}" height="{height}" '
        f'alt="{_esc(alt)}"><figcaption>{_esc(caption)}</figcaption></figure>'
    )


def _html_sources(report: Report) -> list[str]:
    """Where each run comes from: its file, host, backend, creation time and run id."""
    out = ["<h2>Runs</h2>", '<table class="sources">', "<thead><tr>"]
    headers = ("run", "backend", "mode", "KV figures", "host", "created", "run id", "file")
    out.append("".join(f'<th scope="col">{h}</th>' for h in headers) + "</tr></thead>")
    out.append("<tbody>")
    for row in report.rows:
        run = row.run
        cells = (run.figures["label"], _host_description(run), str(run.meta.get("created") or "-"),
                 str(run.run_id or "-"))
        tint = _row_class(run)
        out.append(
            (f'<tr class="{tint}">' if tint else "<tr>")
            + f'<th scope="row">{_esc(run.label)}</th><td>{_esc(run.backend_spec)}</td>'
            + f"<td>{_html_mode(run)}</td>"
            + "".join(f"<td>{_esc(c)}</td>" for c in cells)
            + f'<td class="path">{_esc(run.path)}</td></tr>'
        )
    out += ["</tbody>", "</table>"]
    if report.skipped:
        out.append("<p>Skipped:</p><ul>")
        out += [f"<li><code>{_esc(p)}</code>: {_esc(why)}</li>" for p, why in report.skipped]
        out.append("</ul>")
    return out


def _host_description(run: Run) -> str:
    """Host name, CPU model and cores of the host a run was replayed on, as far as recorded."""
    host = _get(run.meta, "host") or {}
    if not isinstance(host, Mapping):
        return "?"
    name = str(host.get("hostname") or "?")
    details = [str(host[k]) for k in ("cpu_model",) if host.get(k)]
    if isinstance(host.get("cores"), int):
        details.append(f"{host['cores']} cores")
    return f"{name} ({', '.join(details)})" if details else name


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


#: Renderers by output format name; each takes a :class:`Report` and returns text.
RENDERERS: dict[str, Callable[..., str]] = {
    "table": render_table,
    "json": render_json,
    "csv": render_csv,
    "html": html_page,
}


def render(report: Report, fmt: str = "table", **options: Any) -> str:
    """The report in output format ``fmt`` (a key of :data:`RENDERERS`)."""
    try:
        renderer = RENDERERS[fmt]
    except KeyError:
        known = ", ".join(RENDERERS)
        raise ConfigError(f"unknown report format '{fmt}' (formats: {known})") from None
    return renderer(report, **options)


# --------------------------------------------------------------------------------------------
# Small helpers


def _get(meta: Mapping[str, Any], dotted: str) -> Any:
    """``meta["a"]["b"]`` for ``"a.b"``; None where any step is missing or not a mapping."""
    node: Any = meta
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def _number(value: Any) -> float:
    """A metadata number as float; NaN when absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


__all__ = [
    "CAPACITY_POINTS",
    "COMPARED",
    "KV_OPS",
    "RENDERERS",
    "REQUIRED_COLUMNS",
    "RESULTS_FORMAT",
    "SUPPORTED_RESULTS_VERSIONS",
    "TIER_BANDWIDTH_OPS",
    "Breakeven",
    "Capacity",
    "Group",
    "Report",
    "Run",
    "RunRow",
    "TierVerdict",
    "build_report",
    "discover_results",
    "html_page",
    "read_results",
    "render",
    "render_csv",
    "render_html",
    "render_json",
    "render_table",
    "report_records",
    "run_record",
    "tier_bandwidth",
    "trace_record",
]
