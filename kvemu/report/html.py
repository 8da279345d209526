"""Rendering a report as one self-contained HTML page, with its figures; and :data:`RENDERERS`,
every output format by name."""
from __future__ import annotations

import base64
import html
import math
import os
import struct
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import __version__, metrics, plots
from ..arguments import instance_arg, path_arg
from ..errors import ConfigError
from ..metrics import SLO
from ..output import atomic_output, check_destination
from ..units import human_bytes
from .common import lookup
from .compare import Group, Report, RunRow, stack_sweeps
from .results import SHORT_SHA_LEN, Run
from .tables import (FIGURE_BADGES, TTFT_PART_TITLES, Column, Row, Section, Table, explanations, figure_terms,
                     group_sections, number, report_title, verdict_lines, verdict_parts)
from .text import render_csv, render_json, render_table


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
th[scope=row], td.figures { white-space: normal; max-width: 15em; }
th[scope=row] > span:first-child { margin-right: .3em; }
thead th { background: #f4f5f7; font-weight: 600; border-bottom: 2px solid #cfd3da; }
thead th[colspan] { text-align: center; border-bottom: 1px solid #cfd3da; }
td.num, th.num { text-align: right; }
tr.baseline td { font-weight: 600; }
tr.emulated td { background: #fff4e5; }
tr.virtual td { background: #f3effa; }
tr.marked th, tr.marked td { font-weight: 600; background: #eaf3ea; }
.badge { display: inline-block; white-space: nowrap; margin: .05em .3em .05em 0; font-size: .78em; font-weight: 700; letter-spacing: .03em;
         padding: .05em .45em; border-radius: 3px; }
.badge.measured { background: #2e7d32; color: #fff; }
.badge.emulated { background: #e8710a; color: #fff; }
.badge.virtual { background: #7b4fb6; color: #fff; }
.badge.host-bound, .badge.floor-limited { background: #c62828; color: #fff; }
.badge.local { background: #00796b; color: #fff; }
.badge.baseline { background: #3b6fb6; color: #fff; }
td.path { white-space: normal; word-break: break-all; font-family: ui-monospace, monospace;
          font-size: .9em; }
td.path span { display: inline-block; min-width: 36ch; }
div.scroll { overflow-x: auto; max-width: 100%; }
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
    title = report_title(report)
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
    verdicts = verdict_lines(report)
    if verdicts:
        out.append('<section class="verdict"><h2>Verdict</h2><ul>')
        out += [f"<li>{_esc(line)}</li>" for line in verdicts]
        out.append("</ul></section>")
    if missing is not None:
        out.append(
            f'<p class="note" id="plots-missing">Plots are not included: {_esc(missing)}. '
            f"Install the plotting extra with <code>{_esc(plots.INSTALL_HINT)}</code> in the kvemu checkout and render "
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
    for note in explanations(report):
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
    instance_arg("report", report, Report)
    final = check_destination(path_arg("path", path), force)
    page = html_page(report)
    with atomic_output(final, force) as tmp:
        Path(tmp).write_text(page, encoding="utf-8")
    return final


def capacity_sweep_page(doc: Mapping[str, Any], now: datetime | None = None) -> str:
    """``kvemu analyze capacity --sweep ... --html``: the sweep (``doc``, the analysis as its
    ``--json`` prints it) as one self-contained page: per policy, the share of prompt tokens each
    level serves, hit in HBM and recomputed, and the modelled $ per million output tokens against the
    swept level's capacity (:func:`kvemu.plots.stack_sweep_png`), then every point as a table."""
    now = now or datetime.now(timezone.utc)
    missing = plots.unavailable_reason()
    sweep = doc.get("sweep") or {}
    level = str(sweep.get("level", "?"))
    title = f"kvemu analyze capacity: {level} swept"
    names = [str(lv["name"]) for lv in doc["stack"]]
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f'<meta http-equiv="Content-Security-Policy" content="{_esc(HTML_CONTENT_POLICY)}">',
           f'<meta name="generator" content="kvemu {_esc(__version__)}">', f"<title>{_esc(title)}</title>",
           f"<style>{_HTML_STYLE}</style>", "</head>", "<body>", "<header>", f"<h1>{_esc(title)}</h1>",
           f'<p class="meta">Generated by kvemu {_esc(__version__)} on '
           f'{_esc(now.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"))} from the trace '
           f"{_esc(doc['trace'])}. Modelled (docs/analysis.md): no replay ran.</p>",
           f'<p class="meta">Stack, top first: ' + _esc(", ".join(
               f"{lv['name']} ({lv['profile']}, {human_bytes(lv['capacity_bytes'])})" for lv in doc["stack"]))
           + f"; the capacity of {_esc(level)} varies.</p>",
           f'<p class="meta">Measurement: {_esc(doc["measurement_rule"])}.</p>',
           f'<p class="meta">Prices: {_esc(doc["prices"]["path"])} ({_esc(doc["prices"]["title"])}, '
           f'{_esc(doc["prices"]["date"])}), capacity amortised over {doc["amortise_years"]:g} years.</p>',
           "</header>"]
    if missing is not None:
        out.append(f'<p class="note" id="plots-missing">Plots are not included: {_esc(missing)}. Install the '
                   f"plotting extra with <code>{_esc(plots.INSTALL_HINT)}</code> in the kvemu checkout.</p>")
    else:
        figures = []
        for pol in doc["policies"]:
            pts = [p for p in doc["points"] if p["policy"] == pol]
            caps = [p["swept_capacity_bytes"] for p in pts]
            png = plots.stack_sweep_png(
                caps, names, [[lv["hit_share"] for lv in p["levels"]] for p in pts],
                hbm_share=[p["hbm_share"] for p in pts], recomputed_share=[p["recompute_share"] for p in pts],
                usd_per_million=[(p.get("cost") or {}).get("usd_per_million_output_tokens") for p in pts],
                swept=level, title=f"{level} swept, policy {pol} (modelled)")
            figures.append(_html_figure(
                png, f"Share of prompt tokens per level and cost against the capacity of {level}, policy {pol}",
                f"Policy {pol}: left, the share of the counted requests' prompt tokens each level serves, hit in "
                "HBM (dotted) and recomputed (dashed); right, the modelled $ per million output tokens (GPU "
                "busy time, each level's provisioned capacity amortised and a flash level's wear).", "wide"))
        out += ['<div class="plots">', *figures, "</div>"]
    num_class = ' class="num"'
    head = ["capacity", "policy", "HBM", *names, "recompute", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
            "$/M out", "J/req"]
    out += ["<h2>Points</h2>", '<div class="scroll"><table>', "<thead><tr>",
            *[f'<th scope="col"{"" if i < 2 else num_class}>{_esc(h)}</th>' for i, h in enumerate(head)],
            "</tr></thead>", "<tbody>"]

    def num(v, spec):
        return "-" if v is None else format(v, spec)

    for p in doc["points"]:
        c, t, d = p.get("cost") or {}, p.get("ttft_ms") or {}, p.get("tpot_ms") or {}
        cells = [human_bytes(p["swept_capacity_bytes"]), p["policy"], num(p["hbm_share"], ".3f"),
                 *[num(lv["hit_share"], ".3f") for lv in p["levels"]], num(p["recompute_share"], ".3f"),
                 num(t.get("p50"), ".1f"), num(t.get("p99"), ".1f"), num(d.get("p50"), ".2f"),
                 num(c.get("usd_per_million_output_tokens"), ".3f"), num(c.get("joules_per_request"), ".1f")]
        out.append("<tr>" + "".join(f'<td{"" if i < 2 else num_class}>{_esc(x)}</td>'
                                    for i, x in enumerate(cells)) + "</tr>")
    out += ["</tbody></table></div>", "</body>", "</html>", ""]
    return "\n".join(out)


def render_capacity_sweep_html(doc: Mapping[str, Any], path: str | os.PathLike, force: bool = False,
                               inputs=()) -> Path:
    """Write :func:`capacity_sweep_page` to ``path`` atomically, replacing a file only with ``force``
    and never one of ``inputs`` (the trace analysed)."""
    final = check_destination(path, force, inputs)
    page = capacity_sweep_page(doc)
    with atomic_output(final, force) as tmp:
        Path(tmp).write_text(page, encoding="utf-8")
    return final


def _html_group(group: Group, index: int, slo: SLO | None, missing: str | None) -> list[str]:
    trace = group.trace
    out = [
        f'<section class="trace" id="trace-{index}">',
        f"<h2>Workload {_esc(group.description)}</h2>",
        f'<p class="trace-facts">SHA-256 <code>{_esc(trace.trace_sha256)}</code> · model '
        f"{_esc(trace.model_name)} · dedup ratio {_esc(number(trace.dedup_ratio, '.2f'))}x · "
        f"baseline: <strong>{_esc(group.baseline.run.label)}</strong> "
        f"({_esc(group.baseline_rule)})</p>",
    ]
    parts = verdict_parts(group)
    if parts:
        out.append("<h3>Verdict</h3><ul class=\"reason\">")
        out += [f"<li>{_esc(part)}</li>" for part in parts]
        out.append("</ul>")
    for section in group_sections(group, slo):
        if section.key not in _PAGE_LEAVES_OUT:
            out += _html_section(section)
    out.append("<h3>Plots</h3>")
    if missing is not None:
        out.append(f'<p class="note">No plots: {_esc(missing)}; '
                   f"<code>{_esc(plots.INSTALL_HINT)}</code> in the kvemu checkout adds them.</p>")
    else:
        out.append('<div class="plots">')
        for figure in _group_figures(group):
            out.append(figure)
        out.append("</div>")
    out.append("</section>")
    return out


#: Sections the page shows elsewhere: how each run's figures were obtained is in its Runs table.
_PAGE_LEAVES_OUT = ("figures",)


def _html_section(section: Section) -> list[str]:
    """A section under its heading: the caption, each table, the notes, or why it is missing."""
    out = [f"<h3>{_esc(section.title)}</h3>"]
    if section.caption:
        out.append(f'<p class="trace-facts">{_esc(section.caption)}.</p>')
    for table in section.tables:
        out += _html_table(table)
    out += [f"<p>{_esc(note)}</p>" for note in section.notes]
    if section.missing:
        out.append(f'<p class="note">{_esc(section.missing)}</p>')
    return out


def _html_table(table: Table) -> list[str]:
    """A ``<table>`` of one of the report's tables: grouped headings span their columns. In a
    row about a run the first cell is its label with the baseline badge and the run's figures
    badges (but for ``measured``), the ``figures`` column all of them, and rows of emulated and
    virtual runs are tinted; a row of a trace's table starts with its heading as it is. Marked
    rows are highlighted."""
    columns = table.columns
    spans, start = [], 0
    for i in range(1, len(columns) + 1):
        if i == len(columns) or columns[i].group != columns[start].group:
            spans.append((start, i))
            start = i
    grouped = any(c.group for c in columns)
    out = ['<div class="scroll">', f'<table class="{_table_class(table)}">', "<thead>"]
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
    # a table with a figures column shows the kind and flags there alone, not again by the label
    own_column = any(c.kind == "figures" for c in columns)
    for row in table.rows:
        out.append(_row_open(row) + "".join(_html_cell(row, i, c, own_column) for i, c in enumerate(columns))
                   + "</tr>")
    out += ["</tbody>", "</table>", "</div>"]
    return out


def _table_class(table: Table) -> str:
    """The class of a table's element: its key, both spread tables ``spread``."""
    return "spread" if table.key.startswith("spread-") else table.key


def _row_open(row: Row) -> str:
    if row.run is not None:
        classes = " ".join(c for c in ("baseline" if row.baseline else "", _row_class(row.run.run)) if c)
    else:
        classes = "marked" if row.marked else ""
    return f'<tr class="{classes}">' if classes else "<tr>"


def _html_cell(row: Row, index: int, column: Column, no_badges: bool = False) -> str:
    """One cell; ``no_badges``: a run's label without its figures badges (its table has a column
    of them)."""
    cell = row.cells[index]
    numeric = ' class="num"' if column.right else ""
    if column.kind == "run":
        badges = '<span class="badge baseline">baseline</span>' if row.baseline else ""
        if not no_badges:
            badges += "".join(_term(t, row.run.run.figures["label"]) for t in cell.badges)
        return (f'<th scope="row"><span title="{_esc(cell.hint)}">{_esc(cell.text)}</span>'
                f"{badges}</th>")
    if index == 0:
        return f'<th scope="row"{numeric}>{_esc(cell.text)}</th>'
    if column.kind == "figures":
        return '<td class="figures">' + "".join(_term(t, cell.hint) for t in cell.badges) + "</td>"
    return f"<td{numeric}>{_esc(cell.text)}</td>"


def _html_header(column: Column, rowspan: int = 1) -> str:
    attrs = ' scope="col"' + (f' rowspan="{rowspan}"' if rowspan > 1 else "")
    attrs += ' class="num"' if column.right else ""
    return f"<th{attrs}>{_esc(column.title)}</th>"


def _badge(term: str, title: str = "") -> str:
    """The badge of a kind or flag of :data:`FIGURE_BADGES`: ``EMULATED``, ``HOST-BOUND``."""
    attr = f' title="{_esc(title)}"' if title else ""
    return f'<span class="badge {term}"{attr}>{_esc(term.upper())}</span>'


def _term(term: str, title: str) -> str:
    """A figures term as a badge titled ``title``, or as text when it has no badge."""
    return _badge(term, title) if term in FIGURE_BADGES else _esc(term)


def _html_mode(run: Run) -> str:
    """Badges of a run's kind and flags, each titled with the run's figures label."""
    return " ".join(_term(t, run.figures["label"]) for t in figure_terms(run))


def _row_class(run: Run) -> str:
    """The tint of a run's rows: ``emulated``, ``virtual``, or none for a measured run."""
    return run.kind if run.kind in ("emulated", "virtual") else ""


def _traces_title(group: Group) -> str:
    """A group's workload and every one of its traces, for a plot title:
    ``synthetic:docqa: 1b9567fc32e8 none, 9b51fee4565a offload``; on a second line when it is long."""
    shas = group.trace_shas or (group.trace_sha256,)
    by_sha = {row.run.trace_sha256: row.run.tier_policy for row in group.rows}
    traces = ", ".join(f"{sha[:SHORT_SHA_LEN]} {by_sha.get(sha, '?')}" for sha in shas)
    text = f"{group.trace.workload_kind}, trace{'s' * (len(shas) > 1)} {traces}"
    return text if len(text) <= 48 else f"{group.trace.workload_kind}\ntrace{'s' * (len(shas) > 1)} {traces}"


def _plot_tag(row: RunRow, is_baseline: bool) -> str:
    """What follows a run's label in a figure: ``(baseline)``, the kind unless it is measured
    and the flags, upper case (``(baseline, LOCAL)``, ``(EMULATED, FLOOR-LIMITED)``), or
    nothing."""
    tags = ["baseline"] if is_baseline else []
    tags += [t.upper() for t in figure_terms(row.run, measured=False)]
    return f"({', '.join(tags)})" if tags else ""


def _group_figures(group: Group) -> list[str]:
    """``<figure>`` elements of one group: TTFT CDF, TPOT CDF and the breakdown bars, with a
    disaggregated run the TTFT split bars; each title names the group's workload and every trace of
    it (:func:`_traces_title`)."""
    trace = _traces_title(group)
    alt = trace.replace("\n", ", ")
    rows = group.rows
    labels = [row.run.label for row in rows]
    tags = [_plot_tag(row, row is group.baseline) for row in rows]
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
        (plots.cdf_png(series("ttft"), title=f"TTFT CDF · {trace}",
                       xlabel="time to first token (ms)", log_x=True),
         f"TTFT CDF per run, {alt}",
         "TTFT per request, one curve per run; log x axis. Dashed: emulated and virtual runs.", ""),
        (plots.cdf_png(series("tpot"), title=f"TPOT CDF · {trace}",
                       xlabel="time per output token (ms)"),
         f"TPOT CDF per run, {alt}",
         "TPOT per request (requests with one output token have none); log x axis when the "
         f"values span {plots.AUTO_LOG_SPREAD:g}x or more. Dashed: emulated and virtual runs.", ""),
        (plots.breakdown_png(labels, mean_ms, title=f"Time breakdown · {trace}",
                             components=metrics.BREAKDOWN_COMPONENTS, dashed=dashed, tags=tags),
         f"Time breakdown per run, {alt}",
         "Mean time per request attributed to queue, KV load, KV store, KV read and compute, "
         "and each one's share of their sum. With overlap, KV time may be hidden behind "
         "compute. Hatched: emulated and virtual runs.", "wide"),
    ]
    pd_rows = [(row, tag) for row, tag in zip(rows, tags) if row.run.disagg is not None]
    splits = [metrics.ttft_split(row.run.table) for row, _ in pd_rows]
    if pd_rows and all(s is not None for s in splits):
        figures.append((
            plots.breakdown_png([row.run.label for row, _ in pd_rows],
                                [[s[p]["mean_ms"] for p in metrics.TTFT_PARTS] for s in splits],
                                title=f"TTFT split · {trace}",
                                components=[TTFT_PART_TITLES[p] for p in metrics.TTFT_PARTS],
                                dashed=[row.run.is_emulated for row, _ in pd_rows], tags=[t for _, t in pd_rows]),
            f"TTFT split per disaggregated run, {alt}",
            "Mean TTFT per request of each disaggregated run split into queueing, prefill, the KV hand-off "
            "to the decode instance and the first decode step, and each part's share of their sum. "
            "Hatched: emulated and virtual runs.", "wide"))
    be = group.breakeven
    if be is not None:
        levels = [plots.Level(row.run.label, v.gbps, row.run.is_emulated, tag)
                  for row, v, tag in zip(rows, be.verdicts, tags)]
        figures.append((
            plots.breakeven_png([p["prefix_tokens"] for p in be.prefixes],
                                [p["breakeven_gbps"] for p in be.prefixes], levels,
                                title=f"Reuse or recompute · {be.model} · {trace}"),
            f"Break-even bandwidth per prefix length and each run's tier GB/s, {alt}",
            "Tier bandwidth at which loading a reused prefix beats recomputing it, per prefix "
            "length (log axes); each run's measured tier GB/s as a horizontal line: above the "
            "curve, reuse wins. Dashed: emulated and virtual runs.", ""))
    cap = group.capacity
    if cap is not None:  # the curve of one trace: the baseline's
        one = f"{group.trace.workload_kind}, trace {group.trace_sha256[:SHORT_SHA_LEN]} {group.trace.tier_policy}"
        curve, i = cap.curve, cap.saturation_index
        figures.append((
            plots.capacity_png(
                curve["capacity_bytes"], curve["hit_ratio"],
                unbounded=curve["unbounded_hit_ratio"],
                saturation_bytes=None if i is None else curve["capacity_bytes"][i],
                mean_ttft_ms=None if cap.ttft is None else [t["mean_ttft_ms"] for t in cap.ttft],
                title=f"Tier capacity · {one}"),
            f"Prefix-hit ratio and modelled TTFT against tier capacity, {one}",
            "Prefix-hit ratio of an LRU tier of each capacity (dotted: unbounded; dashed: 95% "
            "of it reached) and the mean TTFT modelled at that capacity; log x axis. "
            + cap.ttft_note + ".", "wide"))
    for sw in stack_sweeps(group):
        what = f"L{sw.level} {sw.backend}"
        figures.append((
            plots.stack_sweep_png(sw.capacity_bytes, sw.level_names, sw.level_shares, hbm_share=sw.hbm_share,
                                  recomputed_share=sw.recomputed_share,
                                  usd_per_million=sw.usd_per_million_output_tokens, swept=what,
                                  title=f"Tier stack, {what} swept ({sw.kind}) · {trace}"),
            f"Share of prompt tokens per stack level and cost against the capacity of {what}, {sw.fixed}, {alt}",
            f"Stack runs differing only in the capacity of {what} (fixed: {sw.fixed}; figures {sw.kind}): "
            "left, the share of the requests' prompt tokens each level served, hit in HBM (dotted) and "
            "recomputed (dashed); right, the modelled $ per million output tokens (GPU time, each "
            "level's provisioned capacity amortised and a flash level's wear). Log x axis.", "wide"))
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
    out = ["<h2>Runs</h2>", '<div class="scroll">', '<table class="sources">', "<thead><tr>"]
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
            + f'<td class="path"><span>{_esc(run.path)}</span></td></tr>'
        )
    out += ["</tbody>", "</table>", "</div>"]
    if report.skipped:
        out.append("<p>Skipped:</p><ul>")
        out += [f"<li><code>{_esc(p)}</code>: {_esc(why)}</li>" for p, why in report.skipped]
        out.append("</ul>")
    return out


def _host_description(run: Run) -> str:
    """Host name, CPU model and cores of the host a run was replayed on, as far as recorded."""
    host = lookup(run.meta, "host") or {}
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

