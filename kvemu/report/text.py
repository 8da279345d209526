"""Rendering a report as text: JSON, CSV and plain-text tables (their layout helpers are also
used by :mod:`kvemu.report.html`)."""
from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import metrics
from ..errors import ConfigError
from ..metrics import SLO
from ..printable import one_line
from ..units import human_bytes
from .compare import (COMPARED, Breakeven, Capacity, Group, Report, RunRow, reductions_text, report_records,
                      trace_record)
from .results import KV_OPS, SHORT_SHA_LEN, Run


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
    lines += _verdict_summary(report, width)
    lines.append("")
    lines += _wrap(f"{_title(report)}; times in ms", width)
    if report.slo is not None:
        lines += _wrap(f"SLO {report.slo.describe()}", width)

    for group in report.groups:
        trace = group.trace
        lines.append("")
        lines += _wrap(f"workload {group.description}  dedup {_fmt(trace.dedup_ratio, '.2f')}x", width)
        if group.verdict is not None:
            for part in group.verdict.reason.split("; "):
                lines += _wrap(f"  {part}", width)
        lines += _wrap(f"baseline: {group.baseline.run.label} ({group.baseline_rule})", width)
        lines.append("")
        lines += _layout(*_reuse_table(group), width)
        lines.append("")
        if any(row.run.repetitions for row in group.rows):
            for which in ("latency", "kv"):
                lines += _layout(*_spread_table(group, which), width)
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
    notes += _weights_notes(report)
    notes += [f"skipped {path}: {why}" for path, why in report.skipped]
    for note in notes:
        lines += _wrap(note, width)
    return "\n".join(lines) + "\n"


def _weights_notes(report: Report) -> list[str]:
    """One note per run with weights in the tier: what it streamed, and its TPOT cost."""
    from .compare import weights_record

    notes = []
    for group in report.groups:
        for row in group.rows:
            w = weights_record(row, group)
            if w["placement"] is None:
                continue
            what = (f"{w['fraction']:g} of the weights" if w["placement"] == "dense"
                    else f"cold experts {w['fraction']:g}")
            cost = (f"TPOT {_signed_ms(w['tpot_cost_ms'])} ms ({_fmt(w['tpot_ratio'], '.2f')}x) against "
                    f"{w['without_label']}" if w["without_label"] else
                    "no run of the same backend and policy without weights in the tier to compare TPOT with")
            notes.append(f"weights in the tier, {row.run.label}: {what} ({human_bytes(w['placed_bytes'])} out of "
                         f"HBM), {w['stream']} stream, {human_bytes(w['bytes'] or 0)} streamed at "
                         f"{_fmt(w['gbps'], '.1f')} GB/s, {_fmt(w['mean_ms_per_step'], '.2f')} ms per step "
                         f"({w['figures']}); {cost}; its KV load figures (bytes, GB/s, latency percentiles) "
                         f"include these weight loads, which go through the same load operation.")
    return notes


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
    n_runs, n_groups = len(report.rows), len(report.groups)
    n_traces = sum(len(g.trace_shas or (g.trace_sha256,)) for g in report.groups)
    return (
        f"kvemu report: {n_runs} run{'s' * (n_runs != 1)} of {n_groups} "
        f"workload{'s' * (n_groups != 1)} ({n_traces} trace{'s' * (n_traces != 1)})"
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
    """Columns and cells of how each run's KV figures were obtained and what bounded them, and
    what each replayed of its trace (reductions, schedule)."""
    columns = [_Column("KV figures", flex=True), _Column("how obtained, what bounded them"),
               _Column("replayed")]
    return columns, [[_label_cell(row), row.run.figures["label"], reductions_text(row.run)] for row in group.rows]


def _verdict_summary(report: Report, width: int) -> list[str]:
    """The report's first lines: per trace, which run wins, by how much, on what objective."""
    lines = []
    for group in report.groups:
        v = group.verdict
        if v is None:
            continue
        t = group.trace
        head = (f"verdict for {t.workload_kind} on {t.model_name} ({', '.join(group.policies)}; "
                f"{t.trace_sha256[:SHORT_SHA_LEN]}): ")
        if v.runner_up is None:
            text = f"{v.winner}, the only run"
        else:
            margin = "" if v.margin is None or math.isnan(v.margin) else f" by {v.margin:.2f}x"
            text = f"{v.winner} wins on {v.objective}{margin} over {v.runner_up}"
            if len(v.ranking) > 2:
                text += f"; last {v.ranking[-1][0]}"
        lines += _wrap(head + text, width)
    return lines


SPREAD_HEADS = {
    "latency": (("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"), ("mean_tpot_ms", "TPOT mean"),
                ("p99_tpot_ms", "TPOT p99"), ("median_e2el_ms", "E2EL p50")),
    "kv": (("kv_gbps_load", "load GB/s"), ("kv_gbps_store", "store GB/s"), ("kv_gbps_read", "read GB/s"),
           ("kv_stall_share", "stall %"), ("request_throughput", "req/s")),
}


def _spread_table(group: Group, which: str = "latency") -> tuple[list[_Column], list[list[str]]]:
    """The spread over repetitions, min-max: the latency figures (ms) or the KV and throughput ones."""
    heads = SPREAD_HEADS[which]
    columns = [_Column("spread, ms" if which == "latency" else "spread, KV", flex=True),
               _Column("reps", right=True)]
    columns += [_Column(h, right=True) for _, h in heads]
    body = []
    for row in group.rows:
        cells = [_label_cell(row), str(len(row.run.repetitions) or 1)]
        for fig, _ in heads:
            sp = row.run.spread(fig)
            if sp is not None and fig == "kv_stall_share":
                sp = (100 * sp[0], 100 * sp[1])
            cells.append("-" if sp is None else f"{_fmt(sp[0], '.4g')}–{_fmt(sp[1], '.4g')}")
        body.append(cells)
    return columns, body


def _reuse_table(group: Group) -> tuple[list[_Column], list[list[str]]]:
    """Why reuse did or did not help: per run, where the prompt tokens came from, KV stall against
    compute, bytes moved, and what bounded the KV figures."""
    columns = [_Column("reuse", flex=True), _Column("HBM", right=True, group="prompt tokens %"),
               _Column("tier", right=True, group="prompt tokens %"), _Column("miss", right=True, group="prompt tokens %"),
               _Column("stall", right=True, group="KV vs compute s"), _Column("comp", right=True, group="KV vs compute s"),
               _Column("GiB", right=True, group="moved"), _Column("GB/s", right=True, group="moved"),
               _Column("bound")]
    body = []
    reuse = {r.label: r for r in group.verdict.reuse} if group.verdict is not None else {}
    for row in group.rows:
        r = reuse.get(row.run.label)
        if r is None:
            continue
        n = max(r.input_tokens, 1)
        moved = (r.bytes_loaded + r.bytes_stored + r.bytes_read) / 2**30
        body.append([_label_cell(row), f"{100 * r.hit_hbm_tokens / n:.0f}", f"{100 * r.hit_tier_tokens / n:.0f}",
                     f"{100 * r.missed_tokens / n:.0f}", f"{r.kv_stall_ms / 1e3:.2f}", f"{r.compute_ms / 1e3:.2f}",
                     f"{moved:.2f}", _fmt(r.load_gbps, ".1f"), r.bound])
    return columns, body


def _comparison_section(group: Group, slo: SLO | None, width: int) -> list[str]:
    return _layout(*_comparison_table(group, slo), width)


def _comparison_table(group: Group, slo: SLO | None) -> tuple[list[_Column], list[list[str]]]:
    """Columns and cells of a group's comparison with its baseline (and goodput with an SLO)."""
    columns = [_Column("vs baseline", flex=True)]
    several = len({row.baseline_label for row in group.rows}) > 1
    if several:
        columns.append(_Column("baseline", flex=True))
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
        cells = [_label_cell(row)] + ([row.baseline_label] if several else [])
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
    body = [[one_line(cell) for cell in row] for row in body]  # labels and paths come from files
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

