"""Figures for the HTML report, as PNG bytes: latency CDFs, time-breakdown bars, the break-even
bandwidth against each run's tier bandwidth, the capacity curve, and a tier stack swept on one
level's capacity.

Plotting is the optional extra ``kvemu[plot]`` (matplotlib). Nothing here imports matplotlib until
a figure is drawn, so ``import kvemu.plots`` always works; :func:`unavailable_reason` says whether
figures can be drawn on this installation and :data:`INSTALL_HINT` how to make them drawable.

Figures are drawn on matplotlib's ``Agg`` canvas through the object API (``Figure`` and
``FigureCanvasAgg``), never through ``pyplot``: no global state, no display, no change to the
backend a caller's own ``pyplot`` uses. The functions take plain data (labels and numpy arrays),
not a report, so they can be tested and reused on their own.
"""
from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: How to install what the figures need.
#: Works from a checkout of kvemu (it is not on PyPI): the plot extra of the project in this folder.
INSTALL_HINT = "pip install '.[plot]'"

#: Size of one figure in inches and its resolution: about 800 × 460 pixels.
FIGURE_SIZE_IN = (7.4, 4.2)
DPI = 110

#: Width in inches of the breakdown bars, which carry run labels beside two panels.
WIDE_FIGURE_WIDTH_IN = 10.2

#: A label longer than this is cut short (with an ellipsis) in legends and on axes.
MAX_LABEL_CHARS = 40

#: Components of the breakdown bars, in stacking order, with how they are named and coloured.
#: The names are those of :data:`kvemu.metrics.BREAKDOWN_COMPONENTS`.
COMPONENT_STYLE = {
    "queue": ("queue", "#9e9e9e"),
    "kv_load": ("KV load", "#1f77b4"),
    "kv_store": ("KV store", "#ff7f0e"),
    "kv_read": ("KV read", "#2ca02c"),
    "compute": ("compute", "#9467bd"),
}

#: Font sizes in points: the report shows two CDFs side by side, at about 3/4 of their size.
FONT_PT = {"ticks": 10, "axis": 11, "legend": 10, "title": 12, "note": 9}

#: Line colours of the runs, one each: matplotlib's ten (C0-C9), then ten more as far from them and
#: from each other as can be told apart (black, dark and light variants); they repeat only past 20 runs.
RUN_COLOURS = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9",
               "#000000", "#7f0000", "#00468b", "#6b8e23", "#ff1493", "#00ced1", "#b8860b", "#4b0082",
               "#808000", "#ff6347")


def run_colour(i: int) -> str:
    """The line colour of the ``i``-th run of a figure (:data:`RUN_COLOURS`)."""
    return RUN_COLOURS[i % len(RUN_COLOURS)]


#: A CDF switches to a log x axis (when not asked for one) once its values span this factor.
AUTO_LOG_SPREAD = 20.0


@dataclass(frozen=True)
class Series:
    """One run's values in a CDF. ``dashed`` draws it dashed (the report does so for emulated
    and virtual runs, so they stand apart from measured ones even in greyscale); ``tag`` follows the label in
    the legend and is never cut short, as a long label may be."""

    label: str
    values: np.ndarray
    dashed: bool = False
    tag: str = ""


@dataclass(frozen=True)
class Level:
    """One run's value drawn as a horizontal line across a figure (its tier GB/s in the
    break-even figure); ``dashed`` and ``tag`` as in :class:`Series`. A NaN value is listed in
    the legend only."""

    label: str
    value: float
    dashed: bool = False
    tag: str = ""


def unavailable_reason() -> str | None:
    """Why figures cannot be drawn here (matplotlib is missing or broken), or None if they can."""
    try:
        _matplotlib()
    except ImportError as exc:
        return f"matplotlib is not available ({exc})"
    return None


def _matplotlib():
    """matplotlib's ``Figure``, the Agg canvas class and ``matplotlib.ticker``, on first use."""
    import matplotlib  # noqa: F401  (fails first and clearly when the extra is not installed)
    from matplotlib import ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return Figure, FigureCanvasAgg, ticker


def cdf_png(
    series: Sequence[Series],
    *,
    title: str,
    xlabel: str,
    log_x: bool | None = None,
) -> bytes:
    """A PNG of the empirical CDF of each series, one line per series.

    NaNs are left out of each series (for TPOT: requests with one output token, which have none);
    a series with no values left is listed in the legend as ``(no data)``. ``log_x`` None picks a
    log axis when the positive values span :data:`AUTO_LOG_SPREAD` or more. Values that cannot be
    drawn (infinite ones; on a log axis also those ≤ 0) still count in the fractions: a curve
    then starts above 0 or ends below 1. Dotted lines mark the median and p99.
    """
    Figure, Canvas, ticker = _matplotlib()
    cleaned = [np.sort(_without_nan(s.values)) for s in series]
    positive = np.concatenate([v[_drawable(v, log_x=True)] for v in cleaned] or [np.empty(0)])
    if log_x is None:
        log_x = positive.size > 0 and positive.max() >= AUTO_LOG_SPREAD * positive.min()
    labels = []
    for s, values, label in zip(series, cleaned, _shorts([s.label for s in series], [s.tag for s in series])):
        if values.size == 0:
            label += " (no data)"
        elif not np.any(_drawable(values, log_x)):
            label += " (nothing to draw)"
        labels.append(label)

    columns = _legend_columns(labels, FIGURE_SIZE_IN[0], 3)
    legend_rows = -(-len(labels) // columns)
    size = (FIGURE_SIZE_IN[0], FIGURE_SIZE_IN[1] + 0.2 * max(0, legend_rows - 1))
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    Canvas(fig)
    ax = fig.add_subplot()

    for i, (s, values, label) in enumerate(zip(series, cleaned, labels)):
        style = dict(color=run_colour(i), linewidth=1.8, linestyle="--" if s.dashed else "-")
        count = values.size
        fraction = np.arange(1, count + 1) / max(count, 1)
        keep = _drawable(values, log_x)
        values, fraction = values[keep], fraction[keep]
        if values.size == 0:
            ax.plot([], [], label=label, **style)
            continue
        start = fraction[0] - 1 / count  # the share below the first value drawn
        xs = np.concatenate([[values[0]], values])
        ys = np.concatenate([[start], fraction])
        ax.step(xs, ys, where="post", label=label, **style)

    if log_x:
        ax.set_xscale("log")
        _plain_log_ticks(ax, ticker, positive)
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        ax.axhline(q, color="0.45", linewidth=0.8, linestyle=":", zorder=0)
        ax.annotate(name, xy=(1.0, q), xycoords=("axes fraction", "data"), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=FONT_PT["note"],
                    color="0.35")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(xlabel + (" — log scale" if log_x else ""), fontsize=FONT_PT["axis"])
    ax.set_ylabel("fraction of requests ≤ x", fontsize=FONT_PT["axis"])
    ax.set_title(title, fontsize=FONT_PT["title"])
    ax.tick_params(labelsize=FONT_PT["ticks"])
    ax.grid(True, which="major", color="0.88", linewidth=0.8)
    if log_x:
        ax.grid(True, which="minor", axis="x", color="0.94", linewidth=0.5)
    _legend_below(fig, ax, columns)
    return _png(fig)


def breakdown_png(
    labels: Sequence[str],
    mean_ms: Sequence[Sequence[float]],
    *,
    title: str,
    components: Sequence[str] = tuple(COMPONENT_STYLE),
    dashed: Sequence[bool] | None = None,
    tags: Sequence[str] | None = None,
) -> bytes:
    """A PNG of stacked horizontal bars, one per run: left the mean time per request of each
    component in ms, then each component's share of their sum in %, then (when there are KV
    components) the KV components alone in ms on their own scale.

    ``mean_ms[i][j]`` is run ``i``'s mean time per request in ``components[j]`` (NaN counts as 0).
    Runs whose ``dashed`` entry is true get hatched bars, as the CDFs draw them dashed; ``tags``
    follow the labels, as :attr:`Series.tag` does.
    """
    Figure, Canvas, ticker = _matplotlib()
    n = len(labels)
    values = np.nan_to_num(np.asarray(mean_ms, dtype=np.float64).reshape(n, len(components)))
    totals = values.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        shares = np.where(totals > 0, 100.0 * values / totals, 0.0)
    dashed = list(dashed) if dashed is not None else [False] * n

    height = max(2.6, 1.6 + 0.42 * n)
    fig = Figure(figsize=(WIDE_FIGURE_WIDTH_IN, height), dpi=DPI, layout="constrained")
    Canvas(fig)
    kv = [j for j, c in enumerate(components) if c.startswith("kv")]
    panels = 3 if kv else 2
    axes = fig.subplots(1, panels, sharey=True,
                        gridspec_kw={"width_ratios": [1.25, 1, 1][:panels]})
    ax_ms, ax_pct = axes[0], axes[1]
    y = np.arange(n)[::-1]  # first run at the top, as in the tables
    to_hatch = []
    # the third panel: the KV components alone, on their own scale, so that a few percent of KV
    # beside the compute is not a sliver
    for ax, data, cols in ((ax_ms, values, range(len(components))), (ax_pct, shares, range(len(components))),
                           *(((axes[2], values, kv),) if kv else ())):
        left = np.zeros(n)
        for j in cols:
            component = components[j]
            name, color = COMPONENT_STYLE.get(component, (component, f"C{j}"))
            bars = ax.barh(y, data[:, j], left=left, height=0.62, color=color,
                           label=name if ax is ax_ms else None, edgecolor="white", linewidth=0.5)
            to_hatch += [bar for bar, hatched in zip(bars, dashed) if hatched]
            left += data[:, j]
        ax.grid(True, axis="x", color="0.88", linewidth=0.8)
        ax.set_axisbelow(True)
    if kv:
        axes[2].set_xlabel("KV ms per request", fontsize=FONT_PT["axis"])
        axes[2].set_title("KV alone, on its own scale", fontsize=FONT_PT["note"], color="0.35")
        axes[2].tick_params(labelsize=FONT_PT["ticks"])
    tags = list(tags) if tags is not None else [""] * n
    ax_ms.set_yticks(y, _shorts(labels, tags))
    ax_ms.set_xlabel("mean ms per request", fontsize=FONT_PT["axis"])
    ax_pct.set_xlabel("share of time (%)", fontsize=FONT_PT["axis"])
    for ax in (ax_ms, ax_pct):
        ax.tick_params(labelsize=FONT_PT["ticks"])
    ax_pct.set_xlim(0, 100)
    ax_pct.set_xticks([0, 50, 100])
    # few ticks per panel, so that one panel's last label does not run into the next one's first
    for ax in (ax_ms, *((axes[2],) if kv else ())):
        ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=4, min_n_ticks=2))
    ax_ms.set_ylim(-0.6, n - 0.4)
    fig.suptitle(title, fontsize=FONT_PT["title"])
    _legend_below(fig, ax_ms, len(components))
    for bar in to_hatch:  # after the legend, whose patches copy the first bar of each component
        bar.set_hatch("//")
    return _png(fig)


def breakeven_png(
    prefix_tokens: Sequence[int],
    breakeven_gbps: Sequence[float],
    levels: Sequence[Level],
    *,
    title: str,
) -> bytes:
    """A PNG of the break-even bandwidth against the prefix length (log-log), with each run's
    measured tier bandwidth as a horizontal line: where a run's line lies above the curve,
    loading the prefix from its tier beats recomputing it."""
    Figure, Canvas, ticker = _matplotlib()
    x = np.asarray(prefix_tokens, dtype=np.float64)
    y = np.asarray(breakeven_gbps, dtype=np.float64)
    values = np.array([lv.value for lv in levels], dtype=np.float64)
    drawn = values[np.isfinite(values) & (values > 0)]
    every = np.concatenate([y[np.isfinite(y) & (y > 0)], drawn])
    labels = [text + ("" if np.isfinite(lv.value) and lv.value > 0 else " (no tier traffic)")
              for lv, text in zip(levels, _shorts([lv.label for lv in levels], [lv.tag for lv in levels]))]
    curve_label = "break-even bandwidth"
    columns = _legend_columns(labels + [curve_label], FIGURE_SIZE_IN[0], 2)
    legend_rows = -(-(len(labels) + 1) // columns)
    size = (FIGURE_SIZE_IN[0], FIGURE_SIZE_IN[1] + 0.2 * max(0, legend_rows - 1))
    fig = Figure(figsize=size, dpi=DPI, layout="constrained")
    Canvas(fig)
    ax = fig.add_subplot()
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.plot(x, y, color="0.15", linewidth=2.2, marker="o", markersize=4, label=curve_label,
            zorder=3)
    if every.size:
        low, high = every.min() / 1.8, every.max() * 1.8
        ax.set_ylim(low, high)
        ax.fill_between(x, y, high, color="#2ca02c", alpha=0.07, linewidth=0, zorder=0)
        ax.fill_between(x, low, y, color="#d62728", alpha=0.06, linewidth=0, zorder=0)
        for text, yy, va in (("reuse wins", 0.97, "top"), ("recompute wins", 0.03, "bottom")):
            ax.text(0.99, yy, text, transform=ax.transAxes, ha="right", va=va,
                    fontsize=FONT_PT["note"], color="0.35")
        _plain_log_ticks(ax, ticker, every, axis="y")
    for i, (lv, label) in enumerate(zip(levels, labels)):
        style = dict(color=run_colour(i), linewidth=1.6, linestyle="--" if lv.dashed else "-")
        if np.isfinite(lv.value) and lv.value > 0:
            ax.axhline(lv.value, label=label, zorder=2, **style)
        else:
            ax.plot([], [], label=label, **style)
    ax.set_xticks(x, [f"{int(t) // 1024}k" if int(t) % 1024 == 0 else f"{int(t)}" for t in x])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    if x.size:
        ax.set_xlim(x.min() / 1.15, x.max() * 1.15)
    ax.set_xlabel("reused prefix (tokens) — log scale", fontsize=FONT_PT["axis"])
    ax.set_ylabel("tier bandwidth (GB/s) — log scale", fontsize=FONT_PT["axis"])
    ax.set_title(title, fontsize=FONT_PT["title"])
    ax.tick_params(labelsize=FONT_PT["ticks"])
    ax.grid(True, which="major", color="0.88", linewidth=0.8)
    _legend_below(fig, ax, columns)
    return _png(fig)


def capacity_png(
    capacity_bytes: Sequence[float],
    hit_ratio: Sequence[float],
    *,
    unbounded: float,
    saturation_bytes: float | None,
    title: str,
    mean_ttft_ms: Sequence[float] | None = None,
) -> bytes:
    """A PNG of the capacity curve on a log capacity axis: left the prefix-hit ratio with the
    unbounded ratio dotted and the saturation capacity marked, right (when given) the modelled
    mean TTFT at each capacity."""
    Figure, Canvas, ticker = _matplotlib()
    x = np.asarray(capacity_bytes, dtype=np.float64)
    panels = 1 if mean_ttft_ms is None else 2
    fig = Figure(figsize=(WIDE_FIGURE_WIDTH_IN, FIGURE_SIZE_IN[1]), dpi=DPI, layout="constrained")
    Canvas(fig)
    axes = fig.subplots(1, panels, sharex=True, squeeze=False)[0]
    series = [(axes[0], np.asarray(hit_ratio, dtype=np.float64), "prefix-hit ratio", "C0")]
    if mean_ttft_ms is not None:
        series.append((axes[1], np.asarray(mean_ttft_ms, dtype=np.float64),
                       "modelled mean TTFT (ms)", "C3"))
    for ax, y, ylabel, color in series:
        ax.plot(x, y, color=color, linewidth=2, marker="o", markersize=3.5)
        ax.set_xscale("log")
        ax.set_ylabel(ylabel, fontsize=FONT_PT["axis"])
        ax.set_xlabel("tier capacity — log scale", fontsize=FONT_PT["axis"])
        ax.tick_params(labelsize=FONT_PT["ticks"])
        ax.grid(True, which="major", color="0.88", linewidth=0.8)
        if saturation_bytes is not None:
            ax.axvline(saturation_bytes, color="0.4", linewidth=1, linestyle="--")
    hit_ax = axes[0]
    hit_ax.axhline(unbounded, color="0.45", linewidth=0.9, linestyle=":")
    hit_ax.annotate(f"unbounded {unbounded:.3f}", xy=(0.01, unbounded),
                    xycoords=("axes fraction", "data"), xytext=(0, 3), textcoords="offset points",
                    fontsize=FONT_PT["note"], color="0.35")
    if saturation_bytes is not None:
        hit_ax.annotate(f"95% of max at {_bytes_label(saturation_bytes)}",
                        xy=(saturation_bytes, 0.02), xycoords=("data", "axes fraction"),
                        xytext=(-4, 0), textcoords="offset points", ha="right",
                        fontsize=FONT_PT["note"], color="0.35")
    top = np.nan_to_num(series[0][1], nan=0.0).max(initial=0.0)
    hit_ax.set_ylim(0, max(1e-3, unbounded, float(top)) * 1.12)
    if x.size:
        # few enough labels, slanted, that two panels side by side never overlap them
        hit_ax.xaxis.set_major_locator(ticker.LogLocator(base=2, numticks=5 if panels == 2 else 7))
        hit_ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: _bytes_label(v)))
        hit_ax.xaxis.set_minor_locator(ticker.NullLocator())
        for ax in axes:
            ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(title, fontsize=FONT_PT["title"])
    return _png(fig)


def stack_sweep_png(
    capacity_bytes: Sequence[float],
    level_names: Sequence[str],
    level_shares: Sequence[Sequence[float]],
    *,
    hbm_share: Sequence[float],
    recomputed_share: Sequence[float],
    usd_per_million: Sequence[float | None],
    swept: str,
    title: str,
) -> bytes:
    """A PNG of a stack swept on one level's capacity (log x; with a capacity of 0, linear up to the
    smallest other one): left the share of prompt tokens each level served, hit in HBM (dotted) and
    recomputed (dashed), one line each; right the modelled $ per million output tokens (a point
    without a price is left out)."""
    Figure, Canvas, ticker = _matplotlib()
    x = np.asarray(capacity_bytes, dtype=np.float64)
    fig = Figure(figsize=(WIDE_FIGURE_WIDTH_IN, FIGURE_SIZE_IN[1] + 0.4), dpi=DPI, layout="constrained")
    Canvas(fig)
    share_ax, cost_ax = fig.subplots(1, 2, sharex=True)
    shares = np.asarray(level_shares, dtype=np.float64).reshape(len(x), len(level_names))
    for j, name in enumerate(_shorts(level_names)):
        share_ax.plot(x, shares[:, j], color=run_colour(j), linewidth=2, marker="o", markersize=3.5,
                      label=name)
    share_ax.plot(x, np.asarray(hbm_share, dtype=np.float64), color="0.45", linewidth=1.2, linestyle=":",
                  marker="o", markersize=2.5, label="HBM")
    share_ax.plot(x, np.asarray(recomputed_share, dtype=np.float64), color="0.2", linewidth=1.2, linestyle="--",
                  marker="o", markersize=2.5, label="recomputed")
    usd = np.array([np.nan if v is None else float(v) for v in usd_per_million], dtype=np.float64)
    cost_ax.plot(x, usd, color="C3", linewidth=2, marker="o", markersize=3.5)
    if np.isfinite(usd).any() and np.nanmin(usd) >= 0:
        # from zero: a cost axis cut above it makes a 0.4 % change look like a halving
        cost_ax.set_ylim(0, float(np.nanmax(usd)) * 1.08 or 1.0)
    share_ax.set_ylabel("share of prompt tokens", fontsize=FONT_PT["axis"])
    share_ax.set_ylim(0, 1.02)
    cost_ax.set_ylabel("$ per million output tokens (modelled)", fontsize=FONT_PT["axis"])
    positive = x[x > 0]
    # a sweep from 0 (no such level): linear up to the smallest size, log above it
    zero = bool(positive.size) and bool((x <= 0).any())
    for ax in (share_ax, cost_ax):
        if zero:
            ax.set_xscale("symlog", linthresh=float(positive.min()), linscale=0.5)
        elif positive.size:
            ax.set_xscale("log")
        ax.set_xlabel(f"{_short(swept)} capacity — log scale" + (" above 0" if zero else ""),
                      fontsize=FONT_PT["axis"])
        ax.tick_params(labelsize=FONT_PT["ticks"])
        ax.grid(True, which="major", color="0.88", linewidth=0.8)
    share_ax.xaxis.set_major_locator(ticker.FixedLocator(x))
    share_ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: _bytes_label(v)))
    share_ax.xaxis.set_minor_locator(ticker.NullLocator())
    for ax in (share_ax, cost_ax):
        ax.tick_params(axis="x", labelrotation=30)
    labels = [*level_names, "HBM", "recomputed"]
    _legend_below(fig, share_ax, _legend_columns(labels, WIDE_FIGURE_WIDTH_IN, 6))
    fig.suptitle(title, fontsize=FONT_PT["title"])
    return _png(fig)


def _bytes_label(n: float) -> str:
    """A byte count as a short axis label: ``512 MiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:g} B"


def _plain_log_ticks(ax, ticker, values: np.ndarray, axis: str = "x") -> None:
    """Log-axis ticks written as plain numbers (``20``, ``0.5``, not ``2×10¹``), dense enough
    to read a value off a curve whether the data span one decade or five."""
    decades = np.log10(values.max() / values.min()) if values.size else 0.0
    subs = (1.0,) if decades > 4 else (1.0, 2.0, 5.0) if decades >= 1 else tuple(range(1, 10))
    which = ax.xaxis if axis == "x" else ax.yaxis
    which.set_major_locator(ticker.LogLocator(base=10, subs=subs, numticks=15))
    which.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    which.set_minor_locator(ticker.LogLocator(base=10, subs=tuple(range(2, 10)), numticks=15))
    which.set_minor_formatter(ticker.NullFormatter())


def _legend_columns(labels: Sequence[str], width_in: float, limit: int) -> int:
    """How many legend columns of these labels fit across ``width_in`` inches (at most
    ``limit``): about 12 characters of 10-point text per inch, 5 more per entry for its line."""
    widest = max((len(label) for label in labels), default=1) + 5
    return max(1, min(limit, int(width_in * 12) // widest))


def _legend_below(fig, ax, columns: int) -> None:
    """The legend of ``ax`` under the figure, in up to ``columns`` columns, never over data."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", frameon=False,
                   fontsize=FONT_PT["legend"],
                   ncol=max(1, min(columns, len(handles))))


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    # No "Software" entry: the bytes depend on the data, not on the matplotlib version string.
    fig.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def _without_nan(values) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).ravel()
    return v[~np.isnan(v)]


def _drawable(values: np.ndarray, log_x: bool) -> np.ndarray:
    """Mask of the values a curve can show: finite, and > 0 on a log axis."""
    return np.isfinite(values) & (values > 0) if log_x else np.isfinite(values)


def _short(label: str, tag: str = "") -> str:
    """``label`` cut to :data:`MAX_LABEL_CHARS` (with an ellipsis), then `` tag`` if any."""
    if len(label) > MAX_LABEL_CHARS:
        label = label[: MAX_LABEL_CHARS - 1] + "…"
    return f"{label} {tag}" if tag else label


#: Where a label cut to tell it apart from others may start (after " + ", a stack's levels apart,
#: where there is one): after one of these characters.
_CUT_AFTER = " +[(/,;"


def _shorts(labels: Sequence[str], tags: Sequence[str] | None = None) -> list[str]:
    """Every label of one figure cut to :data:`MAX_LABEL_CHARS` so that no two read the same
    where the labels differ (the runs of a stack sweep differ deep inside a long label): a label
    whose plain cut (:func:`_short`) would equal another's shows, after an ellipsis, the part from
    where it first differs from the others (from the stack level or the word it differs in), cut
    again at the end; were two
    still the same, each gets its position (``#3``). Then `` tag``, as :func:`_short` adds it."""
    labels = list(labels)
    tags = list(tags) if tags is not None else [""] * len(labels)
    plain = [_short(label) for label in labels]
    out = list(plain)
    for i, label in enumerate(labels):
        clash = [other for j, other in enumerate(labels) if j != i and plain[j] == plain[i] and other != label]
        if not clash or len(label) <= MAX_LABEL_CHARS:
            continue
        common = max(len(os.path.commonprefix([label, other])) for other in clash)
        # from the part (a stack's level, between " + ") it first differs in, else the word
        part_start = label.rfind(" + ", 0, common + 1)
        start = part_start + 3 if part_start >= 0 else max(
            (k + 1 for k in range(common) if label[k] in _CUT_AFTER), default=0)
        part = label[start:]
        part = part if len(part) <= MAX_LABEL_CHARS - 1 else part[: MAX_LABEL_CHARS - 2] + "…"
        out[i] = ("…" if start else "") + part
    sources: dict[str, set] = {}
    for text, label in zip(out, labels):
        sources.setdefault(text, set()).add(label)
    out = [f"{text} #{i + 1}" if len(sources[text]) > 1 else text for i, text in enumerate(out)]
    return [f"{text} {tag}" if tag else text for text, tag in zip(out, tags)]


__all__ = [
    "COMPONENT_STYLE",
    "INSTALL_HINT",
    "RUN_COLOURS",
    "run_colour",
    "Level",
    "Series",
    "breakdown_png",
    "breakeven_png",
    "capacity_png",
    "cdf_png",
    "stack_sweep_png",
    "unavailable_reason",
]
