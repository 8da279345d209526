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
results' metadata alone), and the LRU capacity curve (from the trace itself, when it is found; kept
per trace digest by :mod:`~kvemu.report.curve_cache` for the next report).

The package is split by concern: :mod:`~kvemu.report.results` reads results files,
:mod:`~kvemu.report.compare` builds the report, :mod:`~kvemu.report.tables` turns it into tables
(typed columns, cells with their figure and its text, numbers formatted once),
:mod:`~kvemu.report.text` renders those as JSON, CSV and terminal tables,
:mod:`~kvemu.report.html` as an HTML page (and holds :data:`RENDERERS`). No module reaches into
another's private names.
"""
from __future__ import annotations

import sys
import types

from ..arguments import paths_arg
from .compare import (CAPACITY_POINTS, COMPARED, FALLBACKS, TIER_BANDWIDTH_OPS, Breakeven, Capacity, Group,
                      Report, RunRow, StackSweep, TierVerdict, build_report, report_records, run_record,
                      stack_record, stack_sweeps, tier_bandwidth, trace_record)
from .html import HTML_CONTENT_POLICY, RENDERERS, html_page, render, render_html
from .results import (KV_OP_PERCENTILES, KV_OPS, MODES, REQUIRED_COLUMNS, REQUIRED_METADATA,
                      RESULTS_FORMAT, SHORT_SHA_LEN, SUPPORTED_RESULTS_VERSIONS, Run,
                      discover_results, read_results)
from .tables import FIGURE_BADGES, Cell, Column, Row, Section, Table, group_sections, runs_table
from .text import MIN_TABLE_WIDTH, render_csv, render_json, render_table
from .tables import verdict_lines
from .verdict import Ranking, Step, Verdict, verdict_of, virtual_twins

__all__ = [
    "report",
    "CAPACITY_POINTS",
    "COMPARED",
    "FALLBACKS",
    "KV_OPS",
    "RENDERERS",
    "REQUIRED_COLUMNS",
    "RESULTS_FORMAT",
    "SUPPORTED_RESULTS_VERSIONS",
    "TIER_BANDWIDTH_OPS",
    "Breakeven",
    "Capacity",
    "Cell",
    "Column",
    "Group",
    "Report",
    "Row",
    "Run",
    "RunRow",
    "Section",
    "StackSweep",
    "Table",
    "TierVerdict",
    "Ranking",
    "Step",
    "Verdict",
    "build_report",
    "discover_results",
    "group_sections",
    "html_page",
    "read_results",
    "render",
    "render_csv",
    "render_html",
    "render_json",
    "render_table",
    "report_records",
    "run_record",
    "runs_table",
    "stack_record",
    "stack_sweeps",
    "tier_bandwidth",
    "trace_record",
    "verdict_lines",
    "verdict_of",
    "virtual_twins",
]


def report(paths, *, baseline=None, slo=None, traces=(), fallback="beside", rank=None, cache=True) -> Report:
    """kvemu.report: the comparison of the results in ``paths`` (files or folders of results), as
    build_report makes it (``fallback="virtual"``: a run whose figures are an upper bound gives
    way to its virtual twin; ``cache=False``: the traces' capacity curves computed afresh, the capacity
    cache neither read nor written); render it with render_table, render_json, render_csv or render_html."""
    return build_report(paths_arg("paths", paths), baseline=baseline, slo=slo, traces=paths_arg("traces", traces),
                        fallback=fallback, rank=rank, cache=cache)


class _ReportModule(types.ModuleType):
    """This package is also the function kvemu.report (report above), whichever of the two
    ``kvemu.report`` names."""

    def __call__(self, *args, **kwargs):
        return report(*args, **kwargs)


sys.modules[__name__].__class__ = _ReportModule
