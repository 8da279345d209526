"""Rendering a report as text: JSON, CSV and plain-text tables, all from :mod:`kvemu.report.tables`
(the records of the runs and traces, and the tables built from them)."""
from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from typing import Any

import numpy as np

from ..arguments import instance_arg
from ..errors import ConfigError
from ..printable import one_line
from .compare import Group, Report, report_records, trace_record
from .tables import (Cell, Row, Section, Table, explanations, group_sections, is_number, number, report_title,
                     runs_table, verdict_lines, verdict_parts, weights_notes)


# --------------------------------------------------------------------------------------------
# Renderers


def _check_report(report) -> None:
    instance_arg("report", report, Report)


def render_json(report: Report) -> str:
    """The report as a JSON object: ``runs``, a list of :func:`run_record` objects, and
    ``traces``, :func:`trace_record` of each group keyed by its trace's SHA-256. NaN is written
    as ``null``."""
    _check_report(report)
    document = {
        "runs": report_records(report),
        "traces": {group.trace_sha256: trace_record(group) for group in report.groups},
    }
    return json.dumps(_json_ready(document), indent=2, allow_nan=False) + "\n"


#: First characters that make a spreadsheet read a cell as a formula (OWASP, "CSV injection").
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(cell: Cell) -> str:
    """A cell as CSV writes it: its text, with a ``'`` before text that a spreadsheet would take
    for a formula (:data:`FORMULA_STARTS`); numbers, negative ones too, stay as they are."""
    if not is_number(cell.value) and cell.text.startswith(FORMULA_STARTS):
        return "'" + cell.text
    return cell.text


def render_csv(report: Report) -> str:
    """The runs as CSV: the rows of :func:`~kvemu.report.tables.runs_table`, one per run, its
    column keys as the header; NaN and absent values are empty cells, text a spreadsheet would
    run as a formula is escaped (:func:`csv_text`)."""
    _check_report(report)
    table = runs_table(report)
    if not table.rows:
        return ""
    lines = [_csv_line([c.key for c in table.columns])]
    lines += [_csv_line([csv_text(cell) for cell in row.cells]) for row in table.rows]
    return "".join(lines)


def _csv_line(fields: list[str]) -> str:
    """One CSV record ending in ``\n``. The writer is told the records end in ``\r\n`` so that it
    quotes a field holding a carriage return as well as one holding a line feed (it quotes the
    characters of its line terminator), then the record's own ending is made ``\n``."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerow(fields)
    return out.getvalue()[:-2] + "\n"


#: Narrowest terminal the table renderer lays out for.
MIN_TABLE_WIDTH = 80


def render_table(report: Report, width: int = 100) -> str:
    """The report as plain-text tables no wider than ``width`` columns.

    Per trace: a header naming the trace and its baseline, then the sections of
    :func:`~kvemu.report.tables.group_sections` (or the line saying why one is missing). The
    mode column says ``measured``, ``emulated`` or ``virtual`` and the run's flags
    (:mod:`kvemu.figures`), the footer what each means; ``*`` marks the baseline.
    """
    _check_report(report)
    if width < MIN_TABLE_WIDTH:
        raise ConfigError(f"table width must be at least {MIN_TABLE_WIDTH}, got {width}")
    lines: list[str] = []
    for line in verdict_lines(report):
        lines += _wrap(line, width)
    lines.append("")
    lines += _wrap(f"{report_title(report)}; times in ms", width)
    if report.slo is not None:
        lines += _wrap(f"SLO {report.slo.describe()}", width)

    for group in report.groups:
        lines.append("")
        lines += _group_header(group, width)
        for section in group_sections(group, report.slo):
            lines.append("")
            lines += _section_lines(section, width)

    lines.append("")
    notes = ["* baseline of its trace."] + explanations(report)
    notes += weights_notes(report)
    notes += [f"skipped {path}: {why}" for path, why in report.skipped]
    for note in notes:
        lines += _wrap(note, width)
    return "\n".join(lines) + "\n"


def _group_header(group: Group, width: int) -> list[str]:
    lines = _wrap(f"workload {group.description}  dedup {number(group.trace.dedup_ratio, '.2f')}x", width)
    for part in verdict_parts(group):
        lines += _wrap(f"  {part}", width)
    return lines + _wrap(f"baseline: {group.baseline.run.label} ({group.baseline_rule})", width)


def _section_lines(section: Section, width: int) -> list[str]:
    """A section: its caption, its tables a blank line apart, its notes, or why it is missing."""
    lines = _wrap(section.caption, width) if section.caption else []
    for i, table in enumerate(section.tables):
        lines += [""] if i else []
        lines += _layout(table, width)
    for note in (*section.notes, *([section.missing] if section.missing else [])):
        lines += _wrap(note, width)
    return lines


def _cell_text(row: Row, index: int, table: Table) -> str:
    """A cell as the terminal shows it: a run's label after ``*`` for the baseline."""
    text = row.cells[index].text
    if table.columns[index].kind == "run":
        return f"{'*' if row.baseline else ' '} {text}"
    return text


_GAP = "  "
_MIN_FLEX = 8


def _layout(table: Table, width: int) -> list[str]:
    """Aligned text lines of one table, flexible columns cut short so no line exceeds ``width``.

    Adjacent columns sharing a ``group`` get one heading line above their titles.
    """
    columns = table.columns
    # labels and paths come from files
    body = [[one_line(_cell_text(row, i, table)) for i in range(len(columns))] for row in table.rows]
    widths = [max([len(c.title)] + [len(r[i]) for r in body]) for i, c in enumerate(columns)]
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
    lines.append(line([c.title for c in columns]))
    lines += [line(r) for r in body]
    return lines


def _truncate(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False) or [""]


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
