"""Compare replay runs: read kvemu results files, line runs of the same trace up, render them.

The report is data first (:class:`Report`, built by :func:`build_report`) and text second: each
renderer in :data:`RENDERERS` turns a report into a string, so another output (HTML, plots) is one
more function over the same :class:`Report` and :func:`run_record`.

Runs are grouped by the SHA-256 of the trace they replayed, so the same requests on different
backends sit together; within a group every run is compared with one *baseline* run of that group
(see :func:`build_report`). Rows are ordered the same way in every group (by backend, in order of
first appearance), so the groups of two traces replayed on the same backends line up.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import metrics
from .errors import ConfigError, ResultsError
from .metrics import SLO
from .schema import METADATA_KEY, RESULTS_FORMAT, SUPPORTED_RESULTS_VERSIONS

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

#: Backend modes: ``measured`` accesses the tier itself, ``emulated`` adds delay to model one.
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
        return self.mode == "emulated"

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
class Group:
    """The runs of one trace, and the run they are compared with."""

    trace_sha256: str
    rows: tuple[RunRow, ...]
    baseline: RunRow
    baseline_rule: str

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
) -> Report:
    """A report over the results in ``paths``, files or folders (see :func:`discover_results`).

    ``baseline`` chooses the run each group is compared with:

    * ``None``: the measured run with the lowest median TTFT; an emulated run is never chosen
      this way. A group with no measured run falls back to its first run.
    * a label: the run carrying it. A group without such a run falls back to the default rule;
      a label no run carries, or that two runs of one group carry, is a :class:`ConfigError`.
      A string of digits that is no run's label is read as an index.
    * an index: the run at that position in each group, counting from 0 in the order the report
      lists them.

    ``slo`` (a preset name, ``ttft=MS,tpot=MS`` or an :class:`SLO`) adds goodput to every run.
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
        groups.append(Group(trace_sha256=sha, rows=rows, baseline=rows[chosen], baseline_rule=rule))
    return Report(groups=tuple(groups), slo=slo, skipped=tuple(skipped))


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
    eligible = np.array([not r.is_emulated for r in runs]) & ~np.isnan(ttft)
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

    Nested mappings (``breakdown``, ``ratio_vs_baseline``, ``delta_vs_baseline_ms``) stay nested;
    flat outputs join the keys with ``_``. NaN stays NaN here; each renderer spells it.
    """
    run = row.run
    record: dict[str, Any] = {
        "label": run.label,
        "backend": run.backend_spec,
        "backend_name": run.backend_name,
        "mode": run.mode,
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
    return record


def report_records(report: Report) -> list[dict[str, Any]]:
    """:func:`run_record` of every run, group by group."""
    return [run_record(row, group, report.slo) for group in report.groups for row in group.rows]


# --------------------------------------------------------------------------------------------
# Renderers


def render_json(report: Report) -> str:
    """The runs as a JSON list of :func:`run_record` objects; NaN is written as ``null``."""
    return json.dumps(_json_ready(report_records(report)), indent=2, allow_nan=False) + "\n"


def render_csv(report: Report) -> str:
    """The runs as CSV, one row per run, columns as :func:`run_record` flattened with ``_``;
    NaN and absent values are empty cells."""
    records = [_flatten(r) for r in report_records(report)]
    out = io.StringIO()
    if records:
        writer = csv.DictWriter(out, fieldnames=list(records[0]), lineterminator="\n")
        writer.writeheader()
        for record in records:
            writer.writerow({k: _csv_cell(v) for k, v in record.items()})
    return out.getvalue()


#: Narrowest terminal the table renderer lays out for.
MIN_TABLE_WIDTH = 80


def render_table(report: Report, width: int = 100) -> str:
    """The report as plain-text tables no wider than ``width`` columns.

    Per trace: a header naming the trace and its baseline, then latency, comparison with the
    baseline, and KV bandwidth and time shares. Emulated runs say ``EMULATED`` in the mode column
    and the footer explains what that means; ``*`` marks the baseline.
    """
    if width < MIN_TABLE_WIDTH:
        raise ConfigError(f"table width must be at least {MIN_TABLE_WIDTH}, got {width}")
    lines: list[str] = []
    n_runs, n_traces = len(report.rows), len(report.groups)
    title = (
        f"kvemu report: {n_runs} run{'s' * (n_runs != 1)} of {n_traces} "
        f"trace{'s' * (n_traces != 1)}; times in ms"
    )
    lines += _wrap(title, width)
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
    notes = ["* baseline of its trace."]
    if any(row.run.is_emulated for row in report.rows):
        notes.append(
            "EMULATED: KV access times come from delays added on this host to model the tier, "
            "not from the tier itself; they cannot be faster than this host's own memory."
        )
    if report.slo is not None:
        notes.append(
            "goodput: requests/s meeting every SLO objective request by request (vLLM); "
            "p99 ok: the run's p99 TTFT and TPOT are within the SLO (MLPerf)."
        )
    notes.append(
        "time share: each component's part of the per-request time attributed to queue, KV load, "
        "store, read and compute; stall: share of step time that KV work added beyond compute."
    )
    for path, why in report.skipped:
        notes.append(f"skipped {path}: {why}")
    for note in notes:
        lines += _wrap(note, width)
    return "\n".join(lines) + "\n"


def _label_cell(row: RunRow) -> str:
    return f"{'*' if row.is_baseline else ' '} {row.run.label}"


def _latency_section(group: Group, width: int) -> list[str]:
    columns = [
        _Column("run", flex=True),
        _Column("backend", flex=True),
        _Column("mode"),
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
            "EMULATED" if row.run.is_emulated else row.run.mode,
            str(s["completed"]),
            _ms(s["median_ttft_ms"]),
            _ms(s["p99_ttft_ms"]),
            _ms(s["mean_tpot_ms"]),
            _ms(s["p99_tpot_ms"]),
            _ms(s["median_e2el_ms"]),
        ])
    return _layout(columns, body, width)


def _comparison_section(group: Group, slo: SLO | None, width: int) -> list[str]:
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
    return _layout(columns, body, width)


_SHARE_HEADERS = {"queue": "queue", "kv_load": "load", "kv_store": "store", "kv_read": "read",
                  "compute": "compute"}


def _kv_section(group: Group, width: int) -> list[str]:
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
    return _layout(columns, body, width)


@dataclass(frozen=True)
class _Column:
    header: str
    right: bool = False
    flex: bool = False  # may be cut short (with an ellipsis) to fit the width
    group: str = ""  # a heading spanning adjacent columns with the same group


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
        flexible = [i for i, c in enumerate(columns) if c.flex and widths[i] > _MIN_FLEX]
        if not flexible:
            break  # the fixed columns alone are wider; MIN_TABLE_WIDTH keeps us from here
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


#: Renderers by output format name; each takes a :class:`Report` and returns text.
RENDERERS: dict[str, Callable[..., str]] = {
    "table": render_table,
    "json": render_json,
    "csv": render_csv,
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
    "COMPARED",
    "KV_OPS",
    "RENDERERS",
    "REQUIRED_COLUMNS",
    "RESULTS_FORMAT",
    "SUPPORTED_RESULTS_VERSIONS",
    "Group",
    "Report",
    "Run",
    "RunRow",
    "build_report",
    "discover_results",
    "read_results",
    "render",
    "render_csv",
    "render_json",
    "render_table",
    "report_records",
    "run_record",
]
