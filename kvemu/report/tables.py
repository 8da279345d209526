"""The report as tables, before any output format: what each table holds, cell by cell.

Every renderer draws the same tables: :mod:`kvemu.report.text` lays them out for a terminal,
:mod:`kvemu.report.html` writes them as ``<table>`` elements, and the CSV output is the rows of
:func:`runs_table`. A :class:`Table` has typed :class:`Column` s and :class:`Row` s of
:class:`Cell` s, each carrying the figure (``value``) and how it reads (``text``); the numbers are
spelled here, once (:func:`number`, :func:`ms`, :func:`signed_ms`, :func:`spread`), so every output
shows the same digits. A group's tables come in :class:`Section` s, each with its heading, the
sentence before its tables and the lines after them (:func:`group_sections`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import metrics
from ..analysis import compute_model
from ..metrics import SLO
from ..units import human_bytes
from .compare import (COMPARED, Breakeven, Capacity, Group, Report, RunRow, cost_record, deployment_record,
                      is_disaggregated, reductions_text, report_records, stack_record, weights_record)
from .results import KV_OPS, SHORT_SHA_LEN, Run


# --------------------------------------------------------------------------------------------
# Numbers as they read


def number(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``; ``-`` for None and NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def ms(value: float) -> str:
    """A duration in ms with about four significant digits and no exponent."""
    if math.isnan(value):
        return "-"
    magnitude = abs(value)
    decimals = 0 if magnitude >= 1000 else 1 if magnitude >= 100 else 2 if magnitude >= 10 else 3
    return f"{value:.{decimals}f}"


def signed_ms(value: float) -> str:
    """A difference in ms: ``+`` before a positive one, ``0`` for none."""
    if math.isnan(value):
        return "-"
    return "0" if value == 0 else ("+" if value > 0 else "") + ms(value)


#: Below this magnitude a spread is written with an exponent (it has no ordinary decimals).
SPREAD_EXPONENT_BELOW = 1e-3


def spread(low: float, high: float) -> str:
    """A range ``low–high`` in one format for both ends: the decimals that give the larger end
    about four significant digits, thousands separated (``1,974–13,214``, ``10.34–10.90``,
    ``0–0``); an exponent only for magnitudes below :data:`SPREAD_EXPONENT_BELOW`."""
    magnitude = max(abs(low), abs(high))
    if magnitude == 0:
        return "0–0"
    if magnitude < SPREAD_EXPONENT_BELOW:
        return f"{low:.3e}–{high:.3e}"
    decimals = max(0, 3 - math.floor(math.log10(magnitude)))
    return f"{low:,.{decimals}f}–{high:,.{decimals}f}"


def tokens_short(tokens: int) -> str:
    """``1k`` for 1024 tokens, ``128k`` for 131072; other counts as they are."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def plain(value: Any) -> str:
    """A value as a flat file writes it: empty for None and NaN (and infinities), a float in full
    (``repr``), anything else as ``str``."""
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(float(value)) if math.isfinite(value) else ""
    return str(value)


def is_number(value: Any) -> bool:
    """Whether a cell's value is a number (not a bool, not text)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------
# The model


#: What a column holds, which decides how each output draws it:
#: ``run``, the label of the row's run (the row's heading: with the baseline marker and badges);
#: ``figures``, the kind and flags of the run's KV figures (badges in HTML);
#: ``number``, a figure, right-aligned; ``verdict``, a yes/no answer, right-aligned;
#: ``text``, anything else, left-aligned.
COLUMN_KINDS = ("run", "figures", "number", "verdict", "text")


@dataclass(frozen=True)
class Column:
    """One column: a stable ``key``, the ``title`` shown, the ``unit`` of its figures (empty when
    none or when the title names it) and its ``kind`` (:data:`COLUMN_KINDS`); ``group``, a
    heading spanning adjacent columns with the same group. The last three say how a narrow
    layout may shorten the column: ``flex`` columns may be cut (with an ellipsis), never below
    ``min_width``, and ``cut_last`` ones only once the other flexible columns are as short as
    they go."""

    key: str
    title: str
    kind: str = "text"
    unit: str = ""
    group: str = ""
    flex: bool = False
    min_width: int = 0
    cut_last: bool = False

    def __post_init__(self) -> None:
        if self.kind not in COLUMN_KINDS:
            raise ValueError(f"column {self.key!r}: kind {self.kind!r} is not one of {COLUMN_KINDS}")

    @property
    def right(self) -> bool:
        """Whether the column is right-aligned: figures and verdicts are."""
        return self.kind in ("number", "verdict")


@dataclass(frozen=True)
class Cell:
    """One cell: the figure or text it stands for (``value``; None when there is none), how it
    reads (``text``), the kinds and flags of :data:`FIGURE_BADGES` it shows as badges, and a
    ``hint`` saying more (the results file of a run label, the figures label of its badges)."""

    value: Any
    text: str
    badges: tuple[str, ...] = ()
    hint: str = ""


@dataclass(frozen=True)
class Row:
    """One row: its cells, one per column; the run it is about (None for a row of a trace's
    table); whether it is the table's baseline run (one per table) or otherwise ``marked``
    (the saturation point of the capacity curve)."""

    cells: tuple[Cell, ...]
    run: RunRow | None = None
    baseline: bool = False
    marked: bool = False


@dataclass(frozen=True)
class Table:
    """Columns and rows; ``key`` names the table (``latency``, ``capacity``...)."""

    key: str
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]

    def column(self, key: str) -> list[Cell]:
        """The cells of the column ``key``, row by row."""
        index = [c.key for c in self.columns].index(key)
        return [row.cells[index] for row in self.rows]


@dataclass(frozen=True)
class Section:
    """Tables under one heading: ``caption``, a sentence before them; ``notes``, sentences after;
    ``missing``, why the section has no tables and how to get them."""

    key: str
    title: str
    tables: tuple[Table, ...] = ()
    caption: str = ""
    notes: tuple[str, ...] = ()
    missing: str = ""


#: Terms of the figures block (:mod:`kvemu.figures`) shown as badges: kinds and flags.
FIGURE_BADGES = ("measured", "emulated", "virtual", "host-bound", "floor-limited", "local")


def figure_terms(run: Run, measured: bool = True) -> list[str]:
    """A run's kind (``unknown`` for one not in :data:`FIGURE_BADGES`) and flags; without
    ``measured``, a measured run's flags alone."""
    kind = run.kind if run.kind in FIGURE_BADGES else "unknown"
    return [t for t in [kind, *run.figures["flags"]] if measured or t != "measured"]


def _run_table(key: str, group: Group, columns: Sequence[Column],
               cells: Sequence[tuple[RunRow, Sequence[Cell]]]) -> Table:
    """A table with a row per run: each row's first cell is the run's label."""
    rows = []
    for row, rest in cells:
        run = row.run
        label = Cell(run.label, run.label, tuple(figure_terms(run, measured=False)), run.path)
        rows.append(Row((label, *rest), run=row, baseline=row is group.baseline))
    return Table(key, tuple(columns), tuple(rows))


def _text(text: str) -> Cell:
    return Cell(text, text)


def _num(value: float | None, spec: str, unit: str = "") -> Cell:
    return Cell(value, number(value, spec) + unit)


def _ms(value: float) -> Cell:
    return Cell(value, ms(value))


# --------------------------------------------------------------------------------------------
# The tables of a group


def reuse_table(group: Group) -> Table:
    """Why reuse did or did not help: per run, where the prompt tokens came from, KV stall against
    compute, bytes moved, and what bounded the KV figures."""
    tokens, kv, moved_group = "prompt tokens %", "KV vs compute s", "moved"
    columns = [Column("run", "reuse", "run", flex=True),
               Column("hit_hbm_pct", "HBM", "number", "%", tokens),
               Column("hit_tier_pct", "tier", "number", "%", tokens),
               Column("missed_pct", "miss", "number", "%", tokens),
               Column("kv_stall_s", "stall", "number", "s", kv),
               Column("compute_s", "comp", "number", "s", kv),
               Column("moved_gib", "GiB", "number", "GiB", moved_group),
               Column("load_gbps", "GB/s", "number", "GB/s", moved_group),
               Column("bound", "bound")]
    reuse = {r.label: r for r in group.verdict.reuse} if group.verdict is not None else {}
    body = []
    for row in group.rows:
        r = reuse.get(row.run.label)
        if r is None:
            continue
        n = max(r.input_tokens, 1)
        moved = (r.bytes_loaded + r.bytes_stored + r.bytes_read) / 2**30
        body.append((row, [_num(100 * r.hit_hbm_tokens / n, ".0f"), _num(100 * r.hit_tier_tokens / n, ".0f"),
                           _num(100 * r.missed_tokens / n, ".0f"), _num(r.kv_stall_ms / 1e3, ".2f"),
                           _num(r.compute_ms / 1e3, ".2f"), _num(moved, ".2f"), _num(r.load_gbps, ".1f"),
                           _text(r.bound)]))
    return _run_table("reuse", group, columns, body)


#: The figures of each spread table: (figure of Run.spread, title, unit).
SPREAD_HEADS = {
    "latency": (("median_ttft_ms", "TTFT p50", "ms"), ("p99_ttft_ms", "TTFT p99", "ms"),
                ("mean_tpot_ms", "TPOT mean", "ms"), ("p99_tpot_ms", "TPOT p99", "ms"),
                ("median_e2el_ms", "E2EL p50", "ms")),
    "kv": (("kv_gbps_load", "load GB/s", "GB/s"), ("kv_gbps_store", "store GB/s", "GB/s"),
           ("kv_gbps_read", "read GB/s", "GB/s"), ("kv_stall_share", "stall %", "%"),
           ("request_throughput", "req/s", "req/s")),
}


def spread_table(group: Group, which: str = "latency") -> Table:
    """The spread over repetitions, min–max: the latency figures (ms) or the KV and throughput
    ones (:data:`SPREAD_HEADS`); each cell's value is the (min, max) pair, None without."""
    heads = SPREAD_HEADS[which]
    columns = [Column("run", "spread, ms" if which == "latency" else "spread, KV", "run", flex=True),
               Column("repetitions", "reps", "number")]
    columns += [Column(fig, title, "number", unit) for fig, title, unit in heads]
    body = []
    for row in group.rows:
        reps = len(row.run.repetitions) or 1
        cells = [Cell(reps, str(reps))]
        for fig, _, _ in heads:
            sp = row.run.spread(fig)
            if sp is not None and fig == "kv_stall_share":
                sp = (100 * sp[0], 100 * sp[1])
            cells.append(Cell(None, "-") if sp is None else Cell(sp, spread(*sp)))
        body.append((row, cells))
    return _run_table(f"spread-{which}", group, columns, body)


def mode_text(run: Run) -> str:
    """The kind of a run's KV figures and its flags: ``measured``, ``emulated floor-limited``."""
    return " ".join([run.kind, *run.figures["flags"]])


def latency_table(group: Group) -> Table:
    """Per run: its backend, the kind and flags of its figures, requests, TTFT, TPOT and E2EL."""
    columns = [
        Column("run", "run", "run", flex=True),
        Column("backend", "backend", flex=True),
        # the kind and flags of the figures, cut after the label and backend (which other
        # tables repeat) and never below the kind
        Column("mode", "mode", "figures", flex=True, min_width=len("emulated…"), cut_last=True),
        Column("completed", "reqs", "number"),
        Column("median_ttft_ms", "p50", "number", "ms", "TTFT ms"),
        Column("p99_ttft_ms", "p99", "number", "ms", "TTFT ms"),
        Column("mean_tpot_ms", "mean", "number", "ms", "TPOT ms"),
        Column("p99_tpot_ms", "p99", "number", "ms", "TPOT ms"),
        Column("median_e2el_ms", "p50", "number", "ms", "E2EL ms"),
    ]
    body = []
    for row in group.rows:
        s, run = row.summary, row.run
        mode = Cell(run.kind, mode_text(run), tuple(figure_terms(run)), run.figures["label"])
        body.append((row, [_text(run.backend_spec), mode, Cell(s["completed"], str(s["completed"])),
                           *(_ms(s[c.key]) for c in columns[4:])]))
    return _run_table("latency", group, columns, body)


def comparison_table(group: Group, slo: SLO | None) -> Table:
    """Per run, the difference from and ratio to its baseline (and goodput with an SLO); a
    ``baseline`` column when the runs of the group have different baselines."""
    columns = [Column("run", "vs baseline", "run", flex=True)]
    several = len({row.baseline_label for row in group.rows}) > 1
    if several:
        columns.append(Column("baseline_label", "baseline", flex=True))
    for name, _, header in COMPARED:
        columns += [Column(f"delta_{name}_ms", "Δ ms", "number", "ms", header),
                    Column(f"ratio_{name}", "ratio", "number", "x", header)]
    if slo is not None:
        columns += [Column("request_goodput", "req/s", "number", "req/s", "goodput"),
                    Column("good_pct", "good %", "number", "%", "goodput"),
                    Column("slo_p99_met", "p99 ok", "verdict")]
    body = []
    for row in group.rows:
        cells = [_text(row.baseline_label)] if several else []
        for name, _, _ in COMPARED:
            cells += [Cell(row.delta_ms[name], signed_ms(row.delta_ms[name])),
                      _num(row.ratio[name], ".2f", "x")]
        if slo is not None:
            throughput = row.summary["request_throughput"]
            good_pct = 100 * row.goodput / throughput if throughput > 0 else math.nan
            cells += [_num(row.goodput, ".2f"), _num(good_pct, ".1f"),
                      Cell(row.slo_p99_met, "yes" if row.slo_p99_met else "NO")]
        body.append((row, cells))
    return _run_table("comparison", group, columns, body)


def goodput_table(group: Group, slo: SLO) -> Table:
    """Per run, DistServe's goodput split under ``slo``: the requests meeting the TTFT objective,
    the TPOT objective and both, as shares of the requests and as req/s."""
    columns = [Column("run", "goodput by objective", "run", flex=True)]
    for part, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("both", "both")):
        columns += [Column(f"good_{part}_pct", "%", "number", "%", title),
                    Column(f"request_goodput_{part}", "req/s", "number", "req/s", title)]
    body = []
    for row in group.rows:
        n = row.slo_attainment["requests"]
        cells = []
        for part in ("ttft", "tpot", "both"):
            cells += [_num(100 * row.slo_attainment[part] / n if n else math.nan, ".1f"),
                      _num(row.goodput_split[part], ".2f")]
        body.append((row, cells))
    return _run_table("goodput", group, columns, body)


def cost_table(group: Group) -> Table:
    """Per run, its modelled cost and energy from the results' ``cost`` section (docs/report.md,
    "Cost"): $ per million output tokens, its capacity and flash-wear parts, the capacity priced
    (provisioned), $ per request, J per request, GPU-hours; ``-`` for results without one (an older
    replay, or one written before the parts were recorded), never zero."""
    columns = [Column("run", "cost, modelled", "run", flex=True),
               Column("usd_per_million_output_tokens", "$/M out", "number"),
               Column("capacity_usd_per_million_output_tokens", "capacity", "number", "$/M"),
               Column("wear_usd_per_million_output_tokens", "wear", "number", "$/M"),
               Column("capacity_bytes", "provisioned", "number"),
               Column("usd_per_request", "$/req", "number"),
               Column("joules_per_request", "J/req", "number"),
               Column("gpu_hours", "GPU-h", "number"),
               Column("priced_as", "tier priced as", flex=True)]
    body = []
    for row in group.rows:
        c = cost_record(row.run)
        cap = c["capacity_bytes"]
        body.append((row, [_num(c["usd_per_million_output_tokens"], ".3f"),
                           _num(c["capacity_usd_per_million_output_tokens"], ".3f"),
                           _num(c["wear_usd_per_million_output_tokens"], ".3f"),
                           Cell(cap, "-" if cap is None else human_bytes(cap)),
                           _num(c["usd_per_request"], ".2e"),
                           _num(c["joules_per_request"], ".0f"), _num(c["gpu_hours"], ".4f"),
                           _text(c["priced_as"] or "-")]))
    return _run_table("cost", group, columns, body)


_SHARE_TITLES = {"queue": "queue", "kv_load": "load", "kv_store": "store", "kv_read": "read",
                 "compute": "compute"}


def kv_table(group: Group) -> Table:
    """Per run, the KV bandwidth of each operation and the time shares."""
    columns = [Column("run", "KV and time", "run", flex=True)]
    columns += [Column(f"kv_gbps_{op}", op, "number", "GB/s", "KV GB/s") for op in KV_OPS]
    columns += [Column(f"share_{c}", _SHARE_TITLES[c], "number", "%", "time share %")
                for c in metrics.BREAKDOWN_COMPONENTS]
    columns.append(Column("kv_stall_pct", "stall %", "number", "%"))
    body = []
    for row in group.rows:
        cells = [_num(row.kv[op]["gbps"], ".2f") for op in KV_OPS]
        cells += [_num(100 * row.shares[c], ".1f") for c in metrics.BREAKDOWN_COMPONENTS]
        cells.append(_num(100 * row.shares["kv_stall"], ".1f"))
        body.append((row, cells))
    return _run_table("kv", group, columns, body)


def figures_table(group: Group) -> Table:
    """Per run, how its KV figures were obtained and what bounded them, and what it replayed of
    its trace (reductions, schedule)."""
    columns = [Column("run", "KV figures", "run", flex=True),
               Column("figures_label", "how obtained, what bounded them"),
               Column("replayed", "replayed")]
    return _run_table("figures", group, columns,
                      [(row, [_text(row.run.figures["label"]), _text(reductions_text(row.run))])
                       for row in group.rows])


def dp_attention_notes(group: Group) -> tuple[str, ...]:
    """A sentence per run whose trace models data-parallel attention: its HBM prefix reuse pools the
    ranks' caches, an upper bound (docs/engine.md, "Parallelism")."""
    return tuple(f"{row.run.label}: its trace models data-parallel attention with one prefix cache for the "
                 f"ranks, which each cache their own, so its HBM reuse is an upper bound (docs/engine.md, "
                 f"'Parallelism')." for row in group.rows
                 if compute_model(row.run.meta.get("trace") or {})["dp_attention"])


def software_notes(group: Group) -> tuple[str, ...]:
    """A sentence per run on a storage tier profile: the software generation it models and its software
    path's share of its KV time (results' backend.software_path, modelled; docs/tier-profiles.md)."""
    notes = []
    for row in group.rows:
        sw = (row.run.meta.get("backend") or {}).get("software_path")
        if not isinstance(sw, Mapping):
            continue
        ops = sw.get("ops") or {}
        soft = sum(float(o.get("software_ns") or 0) for o in ops.values())
        busy = soft + sum(float(o.get("medium_ns") or 0) for o in ops.values())
        share = f"{100 * soft / busy:.0f} % of its KV time" if busy else "no KV time"
        parts = ", ".join(sw.get("parts") or {}) or "none"
        gen = sw.get("generation") or "a storage profile of no stated generation"
        lookups = ((row.run.meta.get("schedule") or {}).get("engine") or {}).get("store_lookups")
        look = (f"; {lookups['requests']} per-request lookups, {lookups['ns'] / 1e6:.1f} ms of step time"
                if isinstance(lookups, Mapping) else "")
        notes.append(f"{row.run.label}: storage software path {gen} (parts: {parts}): software {share}, "
                     f"modelled{look} (docs/tier-profiles.md, 'The software path').")
    return tuple(notes)


def breakeven_table(be: Breakeven) -> Table:
    """The break-even bandwidth per standard prefix length."""
    columns = (Column("prefix_tokens", "prefix tokens", "number"), Column("kv_bytes", "KV", "number"),
               Column("recompute_ms", "recompute ms", "number", "ms"),
               Column("breakeven_gbps", "break-even GB/s", "number", "GB/s"))
    rows = tuple(Row((Cell(p["prefix_tokens"], f"{int(p['prefix_tokens']):,}"),
                      Cell(p["kv_bytes"], human_bytes(p["kv_bytes"])), _ms(p["recompute_ms"]),
                      _num(p["breakeven_gbps"], ".2f"))) for p in be.prefixes)
    return Table("breakeven", columns, rows)


def tier_table(group: Group) -> Table:
    """Per run, its tier GB/s and, per standard prefix length, whether reuse beats recompute."""
    be = group.breakeven
    heading = "reuse beats recompute at prefix tokens"
    columns = [Column("run", "tier vs break-even", "run", flex=True),
               Column("tier_gbps", "GB/s", "number", "GB/s"), Column("tier_op", "op")]
    # titles at least as wide as "yes", so the heading fits even when every cell is "-"
    columns += [Column(f"wins_{int(p['prefix_tokens'])}", tokens_short(int(p["prefix_tokens"])).rjust(3),
                       "verdict", group=heading) for p in be.prefixes]
    columns.append(Column("reuse_wins_from_tokens", "reuse wins", "verdict"))
    body = []
    for row, verdict in zip(group.rows, be.verdicts):
        cells = [_num(verdict.gbps, ".2f"), Cell(verdict.op, verdict.op or "-")]
        if verdict.op is None:
            cells += [Cell(None, "-")] * (len(be.prefixes) + 1)
        else:
            cells += [Cell(win, "yes" if win else "no") for win in verdict.wins.values()]
            start = verdict.wins_from_tokens
            cells.append(Cell(start, "never" if start is None else f"from {tokens_short(start)}"))
        body.append((row, cells))
    return _run_table("verdicts", group, columns, body)


def capacity_table(cap: Capacity) -> Table:
    """The capacity curve: one row per capacity on the grid, the saturation point marked."""
    curve = cap.curve
    columns = (Column("capacity_bytes", "capacity", "number"), Column("capacity_blocks", "blocks", "number"),
               Column("capacity_tokens", "tokens", "number"), Column("hit_ratio", "hit ratio", "number"),
               Column("of_max", "of max", "number", "%"),
               Column("mean_ttft_ms", "mean", "number", "ms", "TTFT ms"),
               Column("median_ttft_ms", "p50", "number", "ms", "TTFT ms"), Column("saturation", ""))
    unbounded = curve["unbounded_hit_ratio"]
    rows = []
    for i, blocks in enumerate(curve["capacity_blocks"]):
        ratio = curve["hit_ratio"][i]
        ttft = cap.ttft[i] if cap.ttft is not None else {}
        saturation = i == cap.saturation_index
        of_max = ratio / unbounded if unbounded > 0 else math.nan
        rows.append(Row((
            Cell(curve["capacity_bytes"][i], human_bytes(curve["capacity_bytes"][i])),
            Cell(blocks, f"{blocks:,}"),
            Cell(curve["capacity_tokens"][i], f"{curve['capacity_tokens'][i]:,}"),
            Cell(ratio, f"{ratio:.4f}"),
            _num(of_max, ".0%"),
            _ms(ttft.get("mean_ttft_ms", math.nan)),
            _ms(ttft.get("median_ttft_ms", math.nan)),
            Cell(saturation, "<- 95% of max" if saturation else ""),
        ), marked=saturation))
    return Table("capacity", columns, tuple(rows))


# --------------------------------------------------------------------------------------------
# Sentences around the tables


def breakeven_heading(be: Breakeven) -> str:
    gpu = be.gpu
    return (f"reuse or recompute: {be.model} on {gpu.get('gpus', '?')} x {gpu.get('name', '?')} "
            f"(MFU {gpu.get('mfu', '?')}); loading a reused prefix beats recomputing it when the "
            f"tier delivers at least the break-even GB/s")


def capacity_heading(cap: Capacity) -> str:
    how = "given with --trace" if cap.found_by == "--trace" else "as recorded in the results"
    return (f"tier capacity: prefix-hit ratio of an LRU tier of each capacity, from the trace "
            f"{cap.trace_path} ({how})")


def capacity_summary(cap: Capacity) -> str:
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


def stack_table(group: Group) -> Table:
    """Per run on a tier stack (``--tiers``), a row per level (:func:`~kvemu.report.compare.stack_record`):
    its backend and how its time was obtained, capacity, policy, prompt tokens it served and their
    share of what the stack served, bytes it loaded and had written into it, its KV time, what bound
    it, its footprint, and its amortised capacity's cost per million output tokens (docs/replay.md,
    "A stack of tiers"; docs/report.md, "Tier stacks")."""
    columns = [Column("run", "run", "run", flex=True, min_width=18), Column("level", "L", "number"),
               Column("backend", "backend", flex=True, min_width=10, cut_last=True), Column("mode", "figures"),
               Column("capacity", "capacity", "number"), Column("policy", "policy"),
               Column("served_tokens", "tokens", "number"), Column("hit_share", "share", "number"),
               Column("bytes_loaded", "loaded", "number"), Column("bytes_written", "written", "number"),
               Column("time_ms", "time", "number", "ms"), Column("bound", "bound"),
               Column("footprint", "footprint", "number"),
               Column("usd_per_million_output_tokens", "$/M out", "number")]
    rows = []
    for row in group.rows:
        st = stack_record(row.run)
        if st is None:
            continue
        for lv in st["levels"]:
            share = lv["hit_share"]
            rows.append(Row((Cell(row.run.label, row.run.label if lv["level"] == 1 else ""),
                             _num(lv["level"], "d"), _text(lv["backend"]), _text(lv["mode"] or "-"),
                             Cell(lv["capacity_bytes"], human_bytes(lv["capacity_bytes"])), _text(lv["policy"]),
                             _num(lv["served_tokens"], "d"),
                             Cell(share, "-" if share is None else f"{share:.1%}"),
                             Cell(lv["bytes_loaded"], human_bytes(lv["bytes_loaded"])),
                             Cell(lv["bytes_written"], human_bytes(lv["bytes_written"])),
                             _num(lv["time_ms"], ".1f"), _text(lv["bound"] or "-"),
                             Cell(lv["footprint_bytes"], human_bytes(lv["footprint_bytes"] or 0)),
                             _num(lv["usd_per_million_output_tokens"], ".4f"))))
    return Table("stack", tuple(columns), tuple(rows))


#: The parts of TTFT as the tables name them.
TTFT_PART_TITLES = {"queue": "queueing", "prefill": "prefill", "handoff": "hand-off", "first_decode": "first decode"}


def _pct_cell(share: float | None) -> Cell:
    return Cell(share, "-" if share is None or math.isnan(share) else f"{100 * share:.1f}")


def deployment_table(group: Group) -> Table:
    """Per run, its deployment: colocated or prefill and decode instances apart, the GPUs in all,
    the transfer path and how its time was obtained, and the share of time each pool's GPUs were
    busy (``schedule.disagg.gpu_busy``)."""
    columns = [Column("run", "deployment", "run", flex=True), Column("kind", "kind", flex=True),
               Column("total_gpus", "GPUs", "number"), Column("instances", "P+D", "number"),
               Column("transfer", "transfer", flex=True), Column("transfer_mode", "timed", flex=True),
               Column("local_requests", "local", "number"),
               Column("gpu_busy_prefill", "prefill", "number", "%", "GPU busy %"),
               Column("gpu_busy_decode", "decode", "number", "%", "GPU busy %")]
    body = []
    for row in group.rows:
        d = deployment_record(row)
        pd = row.run.disagg is not None
        transfer = str(d["transfer_spec"] or d["transfer_path"] or "?") if pd else "-"
        inst = f"{_or_q(d['prefill_instances'])}+{_or_q(d['decode_instances'])}" if pd else "-"
        local = d["local_requests"]
        body.append((row, [_text(d["kind"].replace("disaggregated ", "")), Cell(d["total_gpus"], str(d["total_gpus"])),
                           Cell(inst, inst), _text(transfer), _text(str(d["transfer_mode"] or "-")),
                           Cell(local, "-" if local is None else f"{local:,}"),
                           _pct_cell(d["gpu_busy_prefill"]), _pct_cell(d["gpu_busy_decode"])]))
    return _run_table("deployment", group, columns, body)


def _or_q(value: Any) -> str:
    return "?" if value is None else str(value)


def transfer_notes(group: Group) -> list[str]:
    """One sentence per disaggregated run: its transfer path, link, how it is pipelined and timed,
    and what bounds its figures (``schedule.disagg.transfer``), and its routers."""
    notes = []
    for row in group.rows:
        if row.run.disagg is None:
            continue
        d = deployment_record(row)
        parts = [f"{row.run.label}: {d['kind']} ({_or_q(d['prefill_instances'])} prefill + {_or_q(d['decode_instances'])} "
                 f"decode instances of {d['gpus_per_instance']} GPU{'s' * (d['gpus_per_instance'] != 1)})"]
        if d["transfer_link"]:
            parts.append(f"link {d['transfer_link']}")
        if d["pipelining"]:
            parts.append(f"pipelining: {d['pipelining']}")
        if d["transfer_mode"]:
            parts.append(f"timed: {d['transfer_mode']}")
        if d["transfer_bound"]:
            parts.append(f"bound: {d['transfer_bound']}")
        if d["routing"]:
            parts.append(f"routing {d['routing']}")
        if d["conditional_threshold"] is not None:
            parts.append(f"prompts under {d['conditional_threshold']:,} tokens served where they arrive "
                         f"({d['local_requests'] if d['local_requests'] is not None else '?'} requests)")
        notes.append("; ".join(parts) + ".")
    return notes


def ttft_split_table(group: Group) -> Table:
    """Per disaggregated run, a row per part of TTFT (queueing, prefill, hand-off, first decode
    step): its p50, p99 and mean over the requests and its share of all their TTFT."""
    columns = [Column("run", "TTFT split", "run", flex=True), Column("part", "part"),
               Column("p50_ms", "p50", "number", "ms", "ms"), Column("p99_ms", "p99", "number", "ms", "ms"),
               Column("mean_ms", "mean", "number", "ms", "ms"), Column("share", "share %", "number", "%")]
    rows = []
    for row in group.rows:
        split = metrics.ttft_split(row.run.table) if row.run.disagg is not None else None
        if split is None:
            continue
        for i, (part, st) in enumerate(split.items()):
            label = row.run.label if i == 0 else ""
            rows.append(Row((Cell(row.run.label, label), _text(TTFT_PART_TITLES[part]), _ms(st["p50_ms"]),
                             _ms(st["p99_ms"]), _ms(st["mean_ms"]), _pct_cell(st["share"])),
                            run=row, baseline=i == 0 and row is group.baseline))
    return Table("ttft-split", tuple(columns), tuple(rows))


def handoff_table(group: Group) -> Table:
    """Per disaggregated run, its hand-off of KV from prefill to decode: requests handed off (those
    prefilled on a prefill instance, not served where they arrived), KV
    bytes moved, the hand-off time (p50, p99 over those requests), the share of it hidden under
    prefill, and the blocks the pool already held (no transfer needed)."""
    columns = [Column("run", "hand-off", "run", flex=True), Column("handed_off", "reqs", "number"),
               Column("bytes", "KV moved", "number"), Column("p50_ms", "p50", "number", "ms", "hand-off ms"),
               Column("p99_ms", "p99", "number", "ms", "hand-off ms"),
               Column("overlap_share", "hidden %", "number", "%"),
               Column("pool_blocks", "pool-held blocks", "number")]
    body = []
    for row in group.rows:
        h = metrics.handoff_summary(row.run.table) if row.run.disagg is not None else None
        if h is None:
            continue
        body.append((row, [Cell(h["handed_off"], f"{h['handed_off']:,}"), Cell(h["bytes"], human_bytes(h["bytes"])),
                           _ms(h["p50_ms"]), _ms(h["p99_ms"]), _pct_cell(h["overlap_share"]),
                           Cell(h["pool_blocks"], "-" if h["pool_blocks"] is None else f"{h['pool_blocks']:,}")]))
    return _run_table("handoff", group, columns, body)


def tpot_instance_table(group: Group) -> Table:
    """Per disaggregated run, a row per decode instance: its requests and their TPOT."""
    columns = [Column("run", "TPOT per decode instance", "run", flex=True),
               Column("instance", "instance", "number"), Column("requests", "reqs", "number"),
               Column("mean_tpot_ms", "mean", "number", "ms", "TPOT ms"),
               Column("median_tpot_ms", "p50", "number", "ms", "TPOT ms"),
               Column("p99_tpot_ms", "p99", "number", "ms", "TPOT ms")]
    rows = []
    for row in group.rows:
        if row.run.disagg is None:
            continue
        for i, e in enumerate(metrics.tpot_by_instance(row.run.table)):
            rows.append(Row((Cell(row.run.label, row.run.label if i == 0 else ""), _num(e["instance"], "d"),
                             _num(e["requests"], ","), _ms(e["mean_tpot_ms"]), _ms(e["median_tpot_ms"]),
                             _ms(e["p99_tpot_ms"])), run=row, baseline=i == 0 and row is group.baseline))
    return Table("tpot-instances", tuple(columns), tuple(rows))


def handoff_line(group: Group) -> str | None:
    """The hand-off share of TTFT of each disaggregated run of the group, in one line (None without
    one): ``hand-off share of TTFT: pd-rdma 31% (over rdma; p50 12.3 ms), ...``."""
    parts = []
    for row in group.rows:
        run = row.run
        if run.disagg is None:
            continue
        d = deployment_record(row)
        share = d["handoff_share_of_ttft"]
        h = d["handoff"] or {}
        text = f"{run.label} " + ("-" if share is None or math.isnan(share) else _share_text(share))
        how = [str(d["transfer_spec"] or d["transfer_path"] or "?")]
        if h.get("handed_off"):
            how.append(f"{human_bytes(h['bytes'])} handed off, p50 {ms(h['p50_ms'])} ms")
        if h.get("overlap_share") is not None and not math.isnan(h["overlap_share"]):
            how.append(f"{_share_text(h['overlap_share'])} hidden under prefill")
        parts.append(f"{text} ({'; '.join(how)})")
    return ("hand-off share of TTFT: " + ", ".join(parts)) if parts else None


def _share_text(share: float) -> str:
    """A share as a whole percentage that never rounds a part to all or none."""
    if 0 < share < 0.005:
        return "<1%"
    if 0.995 <= share < 1:
        return ">99%"
    return f"{100 * share:.0f}%"



def sessions_table(group: Group) -> Table:
    """Per run of a trace with sessions, TTFT and end-to-end time per turn index, then over its
    sessions: each session's time from its first arrival to its last end and its turns' TTFT summed
    (metrics.session_summary)."""
    columns = [Column("run", "sessions", "run", flex=True), Column("turn", "turn"),
               Column("requests", "reqs", "number"),
               Column("ttft_p50_ms", "TTFT p50", "number", "ms", "ms"),
               Column("ttft_mean_ms", "TTFT mean", "number", "ms", "ms"),
               Column("e2e_p50_ms", "e2e p50", "number", "ms", "ms"),
               Column("e2e_mean_ms", "e2e mean", "number", "ms", "ms")]
    rows = []
    for row in group.rows:
        s = metrics.session_summary(row.run.table)
        if s is None:
            continue
        lines = [(_text(str(t["turn"])), _num(t["requests"], ","), _ms(t["median_ttft_ms"]), _ms(t["mean_ttft_ms"]),
                  _ms(t["median_e2el_ms"]), _ms(t["mean_e2el_ms"])) for t in s["turns"]]
        ss = s["sessions"]
        # the whole session: TTFT summed over its turns, e2e from its first arrival to its last end
        lines.append((_text("session"), _num(ss["sessions"], ","), _ms(ss["median_ttft_sum_ms"]),
                      _ms(ss["mean_ttft_sum_ms"]), _ms(ss["median_session_ms"]), _ms(ss["mean_session_ms"])))
        for i, cells in enumerate(lines):
            rows.append(Row((Cell(row.run.label, row.run.label if i == 0 else ""), *cells),
                            run=row, baseline=i == 0 and row is group.baseline))
    return Table("sessions", tuple(columns), tuple(rows))


def group_sections(group: Group, slo: SLO | None) -> list[Section]:
    """A group's tables, section by section, in the order every output shows them: why reuse
    helped (with a verdict), the spread over repetitions (with repetitions), latency, the
    comparison with the baseline, KV and time shares, how the figures were obtained, reuse or
    recompute, tier capacity (when the capacity section was looked for)."""
    sections = []
    if group.verdict is not None:
        sections.append(Section("reuse", "Why reuse did or did not help", (reuse_table(group),)))
    if any(row.run.repetitions for row in group.rows):
        sections.append(Section("spread", "Spread over the repetitions (min–max)",
                                (spread_table(group, "latency"), spread_table(group, "kv"))))
    sections += [
        Section("latency", "Latency (ms)", (latency_table(group),)),
        # the cost table where a run of the group has a cost section (older results have none)
        Section("comparison", "Compared with the baseline",
                (comparison_table(group, slo),
                 *((goodput_table(group, slo),) if slo is not None else ()),
                 *((cost_table(group),) if any(row.run.meta.get("cost") for row in group.rows) else ()))),
        Section("kv", "KV bandwidth and time shares", (kv_table(group),)),
        Section("figures", "How the KV figures were obtained", (figures_table(group),),
                notes=dp_attention_notes(group) + software_notes(group)),
    ]
    if any(metrics.SESSION_COLUMNS[0] in row.run.table.column_names for row in group.rows):
        sections.append(Section("sessions", "Sessions: per turn and per session", (sessions_table(group),),
                                caption="Per turn index (0: a session's first request), TTFT and end-to-end time; "
                                        "the 'session' row: TTFT summed over a session's turns and the time from "
                                        "its first arrival to its last end (docs/report.md, 'Sessions')."))
    if is_disaggregated(group):
        sections.append(Section(
            "disagg", "Prefill and decode apart", (deployment_table(group), ttft_split_table(group),
                                                   handoff_table(group), tpot_instance_table(group)),
            caption="Each deployment's GPUs, the TTFT of its requests split into queueing, prefill, the KV "
                    "hand-off from the prefill to the decode instance and the first decode step, the hand-off "
                    "itself, and TPOT per decode instance (docs/report.md, 'Prefill and decode apart')",
            notes=tuple(transfer_notes(group))))
    if any((row.run.meta.get("schedule") or {}).get("stack") for row in group.rows):
        sections.append(Section("stack", "Tier stack: each level", (stack_table(group),),
                                caption="Per level, top first: what it served of the prompts' reuse, what it moved, "
                                        "and its KV time (the top level's on the replay's backend, each lower "
                                        "level's on its own backend context)."))
    title = "Reuse or recompute: break-even bandwidth"
    be = group.breakeven
    if be is not None:
        sections.append(Section("breakeven", title, (breakeven_table(be), tier_table(group)),
                                caption=breakeven_heading(be)))
    elif group.breakeven_note:
        sections.append(Section("breakeven", title, missing=group.breakeven_note))
    cap = group.capacity
    if cap is not None:
        sections.append(Section("capacity", "Tier capacity", (capacity_table(cap),),
                                caption=capacity_heading(cap), notes=(capacity_summary(cap),)))
    elif group.capacity_note:
        sections.append(Section("capacity", "Tier capacity", missing=group.capacity_note))
    return sections


def report_title(report: Report) -> str:
    n_runs, n_groups = len(report.rows), len(report.groups)
    n_traces = sum(len(g.trace_shas or (g.trace_sha256,)) for g in report.groups)
    return (
        f"kvemu report: {n_runs} run{'s' * (n_runs != 1)} of {n_groups} "
        f"workload{'s' * (n_groups != 1)} ({n_traces} trace{'s' * (n_traces != 1)})"
    )


def verdict_lines(report: Report) -> list[str]:
    """The report's first lines: per workload, its verdict in one sentence (who wins, on which
    metric, by how much, on which kind of figure, and why; or a tie; or why no run can win), and a
    line saying that different workloads are not ranked against each other when there are several."""
    lines = []
    for group in report.groups:
        v = group.verdict
        if v is None:
            continue
        t = group.trace
        head = (f"verdict for {t.workload_kind} on {t.model_name} ({', '.join(group.policies)}; "
                f"{t.trace_sha256[:SHORT_SHA_LEN]}): ")
        lines.append(head + (v.sentence or v.reason.split("; ")[0]) + ".")
        if is_disaggregated(group):
            handoff = handoff_line(group)
            if handoff:
                lines.append(handoff + ".")
            dv = group.deployment
            if dv is not None:
                lines.append(dv.sentence + ".")
                if dv.mixed_totals:
                    lines.append("not the same GPUs in total: " + "; ".join(
                        f"{lab} {n}" for lab, _, n in dv.deployments) + " (the verdict above ranks their tiers; "
                        "the deployments are compared only on the same total).")
    if len(report.groups) > 1:
        lines.append(f"{len(report.groups)} workloads: each is ranked on its own, never one workload's runs "
                     f"against another's.")
    return lines


def verdict_parts(group: Group) -> list[str]:
    """A group's verdict with its reasons, one sentence each (the first is the verdict), and the
    runs ``fallback virtual`` replaced by their virtual twins."""
    v = group.verdict
    parts = list(v.parts or v.reason.split("; ")) if v is not None else []
    parts += [f"{gone} is left out for its virtual twin {twin} (its figures are an upper bound; --fallback "
              f"virtual)" for gone, twin in group.replaced]
    parts += [c.sentence for c in group.cold]
    if group.deployment is not None:
        parts += list(group.deployment.parts)
    return parts


def weights_notes(report: Report) -> list[str]:
    """One note per run with weights in the tier: what it streamed, and its TPOT cost."""
    notes = []
    for group in report.groups:
        for row in group.rows:
            w = weights_record(row, group)
            if w["placement"] is None:
                continue
            what = (f"{w['fraction']:g} of the weights" if w["placement"] == "dense"
                    else f"cold experts {w['fraction']:g}")
            cost = (f"TPOT {signed_ms(w['tpot_cost_ms'])} ms ({number(w['tpot_ratio'], '.2f')}x) against "
                    f"{w['without_label']}" if w["without_label"] else
                    "no run of the same backend and policy without weights in the tier to compare TPOT with")
            notes.append(f"weights in the tier, {row.run.label}: {what} ({human_bytes(w['placed_bytes'])} out of "
                         f"HBM), {w['stream']} stream, {human_bytes(w['bytes'] or 0)} streamed at "
                         f"{number(w['gbps'], '.1f')} GB/s, {number(w['mean_ms_per_step'], '.2f')} ms per step "
                         f"({w['figures']}); {cost}; its KV load figures (bytes, GB/s, latency percentiles) "
                         f"include these weight loads, which go through the same load operation.")
    return notes


def explanations(report: Report) -> list[str]:
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
    models: dict[str, list[str]] = {}
    for row in report.rows:
        trace_meta = row.run.meta.get("trace")
        if isinstance(trace_meta, Mapping) and isinstance(trace_meta.get("gpu"), Mapping) and trace_meta["gpu"]:
            models.setdefault(compute_model(dict(trace_meta))["how"], []).append(row.run.label)
    if len(models) == 1:
        compute += f", by {next(iter(models))}"
    elif models:
        compute += ", by " + "; ".join(f"{how} ({', '.join(labels)})" for how, labels in models.items())
    if any(f["compute"] == "recorded" for f in figures):
        compute += ("; runs of a trace recorded from a real run replay the compute times "
                    "recorded with it (docs/sources.md)")
    notes.append(compute + ".")
    if report.slo is not None:
        notes.append(
            "goodput: requests/s meeting every SLO objective request by request (vLLM); "
            "p99 ok: the run's p99 TTFT and TPOT are within the SLO (MLPerf); goodput by objective: the "
            "requests meeting the TTFT objective, the TPOT objective and both, as DistServe judges them "
            "(OSDI'24, arXiv:2401.09670)."
        )
    if any(is_disaggregated(group) for group in report.groups):
        notes.append(
            "prefill and decode apart: TTFT parts, hand-off and per-instance TPOT from the replay's own "
            "per-request columns (docs/replay.md); a part's share is its sum over the sum of all four over "
            "the requests; hidden: the hand-off time that overlapped prefill; pool-held blocks: blocks "
            "the pool already held, which needed no transfer; GPU busy: the share of the run each pool's "
            "GPUs computed; GPUs: instances x GPUs each, the prefill and decode instances together."
        )
    notes.append(
        "time share: each component's part of the per-request time attributed to queue, KV load, "
        "store, read and compute; stall: share of step time that KV work added beyond compute."
    )
    dates = sorted({c["figures"] for c in (cost_record(row.run) for row in report.rows) if c["figures"]})
    if dates:
        notes.append(
            "cost: " + ", ".join(dates) + ": $ per million output tokens and J per request, from the GPU "
            "time of the replayed timeline, the tier's provisioned capacity amortised over it (capacity) and "
            "a flash tier's writes against its rated endurance (wear) (docs/replay.md, 'Cost and energy'); "
            "'-' for results without a cost section."
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


# --------------------------------------------------------------------------------------------
# The runs as one flat table (CSV)


def runs_table(report: Report) -> Table:
    """Every run as one row of :func:`~kvemu.report.compare.run_record` flattened: nested keys
    joined with ``_``, the ``figures`` block as :func:`_figures_columns`. The columns are every
    run's, in order of first appearance; a nested mapping absent (None) in some runs, such as
    ``spread`` without repetitions, is its flattened columns alone, empty in those runs. A column
    is ``number`` when every value it has is a number; each cell's text is :func:`plain`."""
    records = [_flatten(_stack_columns(_figures_columns(r))) for r in report_records(report)]
    keys: list[str] = []
    for record in records:
        at = 0
        for key in record:
            if key in keys:
                at = keys.index(key) + 1
            else:
                keys.insert(at, key)
                at += 1
    keys = [k for k in keys if not (all(r.get(k) is None for r in records)
                                    and any(other.startswith(f"{k}_") for other in keys))]
    columns = []
    for key in keys:
        values = [r[key] for r in records if r.get(key) is not None]
        numeric = bool(values) and all(is_number(v) for v in values)
        columns.append(Column(key, key, "number" if numeric else "text"))
    rows = [Row(tuple(Cell(r.get(k), plain(r.get(k))) for k in keys), run=row)
            for r, row in zip(records, report.rows)]
    return Table("runs", tuple(columns), tuple(rows))


def _figures_columns(record: Mapping[str, Any]) -> dict[str, Any]:
    """A run record with its ``figures`` as flat columns, in its place: ``figures_kind``,
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


def _stack_columns(record: Mapping[str, Any]) -> dict[str, Any]:
    """A run record with a tier stack's levels as ``stack_L1_...``, ``stack_L2_...`` columns (a run
    on one tier has none; a level a run lacks is an empty cell)."""
    st = record.get("stack")
    if not isinstance(st, Mapping):
        return dict(record)
    flat = {k: v for k, v in st.items() if k != "levels"}
    flat.update({f"L{lv['level']}": {k: v for k, v in lv.items() if k != "level"} for lv in st.get("levels", [])})
    return {**record, "stack": flat}


def _flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}_"))
        else:
            flat[name] = value
    return flat
