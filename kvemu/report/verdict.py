"""The verdict of a report: which tier wins for a workload, by how much, on which figure, and why.

Per group (the runs of one workload), docs/report.md "Verdict":

* **What is ranked.** The runs the user asked to compare (all of the group's, or those of
  ``rank``), each once: a virtual run that is the *virtual twin* of another run of the group (the
  same tier in virtual time, :meth:`kvemu.backend_spec.BackendSpec.virtual_twin`, same tier
  policy and comparison class) stands beside that run, not as a run of its own.
* **Which figure ranks them.** Measured against measured where this host supports every run (no
  run an upper bound: not host-bound, not floor-limited, :mod:`kvemu.figures`); else virtual
  against virtual where every run has a virtual figure (its own or its twin's); else each kind is
  ranked apart and a run with neither is left unranked. An upper bound is never ranked against a
  real figure. The verdict says which kind of figure decided.
* **Which metric decides.** Goodput under the SLO when one is given; else median TTFT, then mean
  TPOT, then median completion time (E2EL): the first on which the two runs differ beyond their
  spreads over repetitions decides; none: a tie ("A and B are the same within their spread").
* **No KV moved.** When no ranked run loaded KV from its tier, no winner is named.

For every run a "why didn't reuse help" breakdown: prompt tokens hit in HBM, hit in the tier,
missed; KV stall against compute; bytes moved; and what bounded its KV figures (the link, the
tier's medium, or this host), from the run's own results.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..analysis import breakeven_gbps, timing_from_meta
from ..backend_spec import BackendSpec
from ..errors import ConfigError, KvemuError, TraceError
from .common import lookup as _get
from .grouping import comparison_class, deployment_key
from .results import Run


@dataclass(frozen=True, eq=False)
class Reuse:
    """Why reuse did or did not help one run, in its own measured terms."""

    label: str
    kind: str                  # measured / emulated / virtual
    flags: tuple[str, ...]     # host-bound, floor-limited, local
    input_tokens: int
    hit_hbm_tokens: int        # served from the HBM prefix cache
    hit_tier_tokens: int       # loaded from the tier
    missed_tokens: int         # recomputed
    compute_ms: float          # summed over requests
    kv_stall_ms: float         # what KV work added to the requests' steps
    queue_ms: float
    kv_load_share_of_ttft: float   # the requests' KV load time over their TTFT
    kv_stall_share_of_e2el: float  # what KV work added to their steps over their whole time
    queue_share: float             # their wait for admission over their whole time
    bytes_loaded: int
    bytes_stored: int
    bytes_read: int
    load_gbps: float           # the tier's load (or in-place read) bandwidth measured; NaN without
    bound: str                 # "link", "medium", "host" (an upper bound), or "-" (no KV traffic)

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


#: The figures a verdict is decided on without an SLO, in order: (summary key, name in the verdict).
METRICS = (("median_ttft_ms", "median TTFT"), ("mean_tpot_ms", "mean TPOT"),
           ("median_e2el_ms", "median completion time (E2EL)"))

#: Two figures without spreads closer than this share of the larger are the same.
SAME_WITHIN = 0.005

#: The kinds of figure a ranking is made of (:attr:`Ranking.basis`).
BASES = ("measured", "virtual")


@dataclass(frozen=True, eq=False)
class Step:
    """How one ranked run compares with the next: the metric that decided (None: a tie on every
    metric), the margin on it (>= 1) and its range over the repetitions (None without)."""

    better: str
    worse: str
    metric: str | None
    margin: float | None
    margin_spread: tuple[float, float] | None
    exact: bool            # virtual time on both sides: no noise to spread over
    repeated: bool         # both sides have repetitions

    def as_dict(self) -> dict[str, Any]:
        return {"better": self.better, "worse": self.worse, "metric": self.metric, "margin": self.margin,
                "margin_spread": list(self.margin_spread) if self.margin_spread else None,
                "exact": self.exact, "repeated": self.repeated}


@dataclass(frozen=True, eq=False)
class Ranking:
    """Runs ranked on one kind of figure (``basis``: measured, which counts emulated runs whose
    accesses met their profile, or virtual), best first, with how each compares with the next."""

    basis: str
    labels: tuple[str, ...]          # the runs, best first
    figures_of: tuple[str, ...]      # per run, the run whose figures rank it (itself or its twin)
    steps: tuple[Step, ...]
    metrics: tuple[str, ...] = ()    # the metrics compared, in the order they decide
    basis_text: str = ""             # how the verdict names the kind: "measured on this host", ...

    def as_dict(self) -> dict[str, Any]:
        return {"basis": self.basis, "basis_text": self.basis_text, "labels": list(self.labels),
                "figures_of": list(self.figures_of), "steps": [s.as_dict() for s in self.steps],
                "metrics": list(self.metrics)}


@dataclass(frozen=True, eq=False)
class Cheapest:
    """Under an SLO, the cheapest of the deciding ranking's runs whose p99 TTFT and p99 TPOT meet it
    (MLPerf's pass criterion, metrics.slo_p99_met), by the modelled $ per million output tokens of
    its results' ``cost``: like with like, the figures of one kind (``basis``). ``headroom`` is the
    margin to the SLO, the smallest of SLO / p99 over TTFT and TPOT (> 1: inside it), with its range
    over the repetitions (``headroom_spread``; None in virtual time or with one repetition);
    ``next`` the next cheapest run that meets it and ``cost_margin`` its $/M over the cheapest's.
    ``label`` None: no priced run meets the SLO (``closest``: the one with the most headroom)."""

    label: str | None
    figures_of: str | None
    usd_per_million_output_tokens: float | None
    headroom: float | None
    headroom_spread: tuple[float, float] | None
    exact: bool
    next: str | None
    cost_margin: float | None
    meeting: tuple[str, ...]
    missing: tuple[str, ...]     # priced runs that do not meet the SLO
    unpriced: tuple[str, ...]    # runs without a cost figure (older results, an unpriced GPU)
    closest: str | None
    closest_headroom: float | None
    stacks: bool                 # some candidate is a tier stack (--tiers): the verdict calls them stacks
    slo: str
    basis_text: str

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k in ("headroom_spread", "meeting", "missing", "unpriced"):
            d[k] = list(d[k]) if d[k] is not None else None
        return d


@dataclass(frozen=True, eq=False)
class Verdict:
    objective: str                       # the metric that decided ("goodput", "median TTFT", ...)
    ranking: tuple[tuple[str, float], ...]   # (label, objective value), best first (the deciding ranking)
    winner: str | None                   # None: a tie at the top, or no run moved KV from its tier
    runner_up: str | None
    margin: float | None                 # runner-up's objective over the winner's (>= 1), NaN when 0
    reason: str                          # the parts below joined with "; "
    breakeven_prefix_tokens: int | None  # the median reused prefix of the workload
    breakeven_gbps: float | None         # what the tier must deliver for reuse to beat recompute there
    reuse: tuple[Reuse, ...]
    margin_spread: tuple[float, float] | None = None  # the margin's range over repetitions
    sentence: str = ""                   # the verdict in one sentence: who, on what, by how much, why
    basis: str | None = None             # the kind of figure that decided: measured, virtual; None: nothing ranked
    tie: bool = False                    # the top runs are the same within their spread
    tied: tuple[str, ...] = ()           # the runs tied at the top
    moved_kv: bool = True                # some ranked run loaded KV from its tier
    rankings: tuple[Ranking, ...] = ()   # the deciding one first
    unranked: tuple[tuple[str, str], ...] = ()   # (label, why it is not ranked)
    twins: tuple[tuple[str, str], ...] = ()      # (label, label of its virtual twin)
    parts: tuple[str, ...] = ()          # the reason, one sentence per part
    cheapest: Cheapest | None = None     # with an SLO: the cheapest run (stack) that meets it

    def as_dict(self) -> dict[str, Any]:
        return {"objective": self.objective, "ranking": [{"label": lab, "value": v} for lab, v in self.ranking],
                "winner": self.winner, "runner_up": self.runner_up, "margin": self.margin,
                "margin_spread": list(self.margin_spread) if self.margin_spread else None,
                "sentence": self.sentence, "basis": self.basis, "tie": self.tie, "tied": list(self.tied),
                "moved_kv": self.moved_kv, "rankings": [r.as_dict() for r in self.rankings],
                "unranked": [{"label": lab, "why": why} for lab, why in self.unranked],
                "twins": {lab: twin for lab, twin in self.twins},
                "reason": self.reason, "breakeven_prefix_tokens": self.breakeven_prefix_tokens,
                "breakeven_gbps": self.breakeven_gbps, "reuse": [r.as_dict() for r in self.reuse],
                "cheapest_meeting_slo": self.cheapest.as_dict() if self.cheapest is not None else None}


def _col(run: Run, name: str) -> np.ndarray:
    return run.table[name].to_numpy(zero_copy_only=False).astype(np.float64)


def reuse_of(run: Run) -> Reuse:
    """The reuse breakdown of one run (see the module docstring)."""
    meta = run.meta
    bytes_per_token = _get(meta, "trace.model.kv_bytes_per_token")
    inp = _col(run, "input_tokens")
    cached = _col(run, "cached_tokens")
    loaded = _col(run, "kv_bytes_loaded")
    if "tier_hit_tokens" in run.table.column_names:
        # the replay's own split (closed loop: as the replayed engine found them; recorded: as recorded)
        tier_tokens = int(_col(run, "tier_hit_tokens").sum())
    elif run.tier_policy == "resident":
        tier_tokens = int(cached.sum())  # KV lives in the tier: every reused token is read there in place
    else:  # results written before the split was a column
        tier_tokens = int(round(loaded.sum() / bytes_per_token)) if bytes_per_token else 0
        tier_tokens = min(tier_tokens, int(cached.sum()))
    ttft = _col(run, "ttft_ms")
    kv_load = _col(run, "kv_load_ms")
    load_share = float(np.nansum(np.minimum(kv_load, ttft)) / np.nansum(ttft)) if np.nansum(ttft) > 0 else math.nan
    e2el = _col(run, "e2el_ms")
    # KV stall: what KV work added to the steps the request was in (its own reads and the others')
    read_share = (float(np.nansum(_col(run, "kv_stall_ms")) / np.nansum(e2el)) if np.nansum(e2el) > 0 else math.nan)
    fig = run.figures
    flags = tuple(fig.get("flags", ()))
    ops = _get(meta, "datapath.ops") or {}
    moved = any((ops.get(op) or {}).get("bytes", 0) for op in ("load", "store", "read"))
    link_ns = sum((ops.get(op) or {}).get("link_ns", 0) for op in ("load", "store", "read"))
    medium_ns = sum((ops.get(op) or {}).get("medium_ns", 0) for op in ("load", "store", "read"))
    if not moved:
        bound = "-"
    elif "host-bound" in flags or "floor-limited" in flags:
        bound = "host"
    elif link_ns > medium_ns:
        bound = "link"
    else:
        bound = "medium"
    gbps, _ = tier_gbps(run)
    return Reuse(
        label=run.label, kind=run.kind, flags=flags, input_tokens=int(inp.sum()),
        hit_hbm_tokens=int(cached.sum()) - tier_tokens, hit_tier_tokens=tier_tokens,
        missed_tokens=int(inp.sum() - cached.sum()), compute_ms=float(np.nansum(_col(run, "compute_ms"))),
        kv_stall_ms=float(np.nansum(_col(run, "kv_stall_ms"))), queue_ms=float(np.nansum(_col(run, "queue_ms"))),
        kv_load_share_of_ttft=load_share, kv_stall_share_of_e2el=read_share,
        queue_share=(float(np.nansum(_col(run, "queue_ms")) / np.nansum(e2el)) if np.nansum(e2el) > 0 else math.nan),
        bytes_loaded=int(loaded.sum()),
        bytes_stored=int(_col(run, "kv_bytes_stored").sum()), bytes_read=int(_col(run, "kv_bytes_read").sum()),
        load_gbps=gbps, bound=bound)


#: KV operations whose measured GB/s stands for a run's tier bandwidth, in order of preference:
#: prefix hits loaded back from the tier, else (KV resident in the tier) decode reads of it.
TIER_BANDWIDTH_OPS = ("load", "read")


def tier_gbps(run: Run) -> tuple[float, str | None]:
    """The tier bandwidth a run measured, to set against the break-even bandwidth, and the KV
    operation it comes from: its load GB/s, or its read GB/s when it loaded nothing (see
    :data:`TIER_BANDWIDTH_OPS`); NaN and None when it moved no KV from the tier. The break-even
    table and the verdict's sentences both read a run's bandwidth here."""
    for op in TIER_BANDWIDTH_OPS:
        gbps = run.kv_op(op)["gbps"]
        if gbps > 0:  # False for NaN: the run did not do this operation
            return gbps, op
    return math.nan, None


def reuse_wins(gbps: float, prefixes) -> dict[int, bool]:
    """Per standard prefix length (rows of :func:`kvemu.analysis.breakeven_gbps`), whether loading
    a reused prefix at ``gbps`` beats recomputing it: the break-even table's cells and the
    verdict's "above/below break-even" are both this."""
    return {int(p["prefix_tokens"]): bool(gbps >= p["breakeven_gbps"]) for p in prefixes}


def wins_from(wins) -> int | None:
    """The shortest prefix from which on reuse wins at every longer one (``wins``: reuse_wins);
    None when it loses at the longest."""
    start = None
    for prefix, won in wins.items():
        start = (prefix if start is None else start) if won else None
    return start


def _tokens_short(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _median_reused_prefix(run: Run) -> int | None:
    """The median prompt tokens served from a cache, over the requests that reused any, in ``run``
    (the winner: how much a run reuses depends on its policy)."""
    cached = _col(run, "cached_tokens")
    cached = cached[cached > 0]
    return int(np.median(cached)) if len(cached) else None


def _breakeven_at(run: Run, prefix: int | None) -> float | None:
    if prefix is None:
        return None

    try:
        timing = timing_from_meta(run.meta["trace"])
    except (TraceError, KeyError):
        return None
    return float(breakeven_gbps(timing, [prefix])[0]["breakeven_gbps"])


def _breakeven_table(run: Run) -> tuple | None:
    """The break-even table's rows (analysis.breakeven_gbps at the standard prefixes) for ``run``'s
    trace; None when its metadata has no compute model."""
    if not _get(run.meta, "trace.gpu"):
        return None
    try:
        return tuple(breakeven_gbps(timing_from_meta(run.meta["trace"])))
    except (KvemuError, KeyError):
        return None


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def virtual_twins(rows) -> dict[int, Any]:
    """Each row's virtual twin among ``rows`` (anything with a ``run``; by the row's index):
    a virtual run of the backend :meth:`~kvemu.backend_spec.BackendSpec.virtual_twin` names (the
    same options preferred, else the same profile), of the same tier policy and comparison class.
    A virtual row is no twin of another virtual row, and a twin serves one row; a tier stack's run
    (``--tiers``) neither has a twin nor is one (its backend spec names its top level alone)."""
    def spec(row):
        try:
            return BackendSpec.parse(row.run.backend_spec)
        except ConfigError:
            return None

    def stacked(row) -> bool:
        return bool(_get(row.run.meta, "schedule.stack"))

    # a tier stack's backend spec is its top level's: a stack is no twin of one tier, nor has one
    virtual = [i for i, r in enumerate(rows) if r.run.kind == "virtual" and spec(r) is not None and not stacked(r)]
    taken: set[int] = set()
    out: dict[int, Any] = {}
    for i, row in enumerate(rows):
        s = spec(row)
        if row.run.kind == "virtual" or s is None or stacked(row):
            continue
        twin = s.virtual_twin()
        if twin is None:
            continue
        same = [j for j in virtual if j not in taken and rows[j].run.tier_policy == row.run.tier_policy
                and comparison_class(rows[j].run) == comparison_class(row.run)
                and deployment_key(rows[j].run) == deployment_key(row.run)]
        exact = [j for j in same if spec(rows[j]) == twin]
        close = [j for j in same if (spec(rows[j]).name, spec(rows[j]).target) == (twin.name, twin.target)]
        pick = (exact or close or [None])[0]
        if pick is not None:
            out[i] = rows[pick]
            taken.add(pick)
    return out


def _host_ok(run: Run) -> bool:
    """Whether a run's own figures stand for its tier on this host: measured or emulated, and not an
    upper bound (host-bound, floor-limited)."""
    return run.kind in ("measured", "emulated") and not run.figures.get("upper_bound")


def _moved(reuse: Reuse) -> bool:
    """Whether a run moved any KV between HBM and its tier (loads, stores, reads)."""
    return reuse.bytes_loaded > 0 or reuse.bytes_stored > 0 or reuse.bytes_read > 0


def _loaded_from_tier(reuse: Reuse) -> bool:
    return reuse.bytes_loaded > 0 or reuse.bytes_read > 0


def _value(row, key: str) -> float:
    if key == "goodput":
        return math.nan if row.goodput is None else float(row.goodput)
    return float(row.summary.get(key, math.nan))


def _interval(row, key: str, exact: bool) -> tuple[float, float] | None:
    """The figure's range over the repetitions; the point itself in virtual time (exact); None
    without repetitions."""
    v = _value(row, key)
    if exact:
        return (v, v)
    if key == "goodput":
        return None
    return row.run.spread(key)


def _compare(a, b, key: str, higher: bool, basis: str) -> int:
    """-1 when ``a`` is better than ``b`` on ``key`` beyond their spreads, 1 when worse, 0 the same."""
    va, vb = _value(a, key), _value(b, key)
    if math.isnan(va) or math.isnan(vb):
        return 0 if math.isnan(va) and math.isnan(vb) else (1 if math.isnan(va) else -1)
    exact = basis == "virtual"
    ia, ib = _interval(a, key, exact), _interval(b, key, exact)
    if ia is not None or ib is not None:
        ia, ib = ia or (va, va), ib or (vb, vb)
        if ia[0] <= ib[1] and ib[0] <= ia[1]:
            if not exact or va == vb:
                return 0
    if abs(va - vb) <= SAME_WITHIN * max(abs(va), abs(vb)):
        return 0
    better = va > vb if higher else va < vb
    return -1 if better else 1


def _metrics(slo) -> tuple[tuple[str, str, bool], ...]:
    """(key, name, higher is better) in the order they decide."""
    if slo is not None:
        return (("goodput", "goodput", True),)
    return tuple((k, n, False) for k, n in METRICS)


def _step(a, b, la: str, lb: str, basis: str, slo) -> Step:
    exact = basis == "virtual"
    repeated = bool(a.run.repetitions) and bool(b.run.repetitions)
    for key, name, higher in _metrics(slo):
        if _compare(a, b, key, higher, basis) == 0:
            continue
        va, vb = _value(a, key), _value(b, key)
        margin = (va / vb if vb > 0 else math.inf) if higher else (vb / va if va > 0 else math.nan)
        spread = None
        sa, sb = _interval(a, key, exact), _interval(b, key, exact)
        if not exact and (sa is not None or sb is not None):
            sa, sb = sa or (va, va), sb or (vb, vb)
            if higher and sb[1] > 0 and sb[0] > 0:
                spread = (sa[0] / sb[1], sa[1] / sb[0])
            elif not higher and sa[1] > 0 and sa[0] > 0:
                spread = (sb[0] / sa[1], sb[1] / sa[0])
        return Step(la, lb, name, margin, spread, exact, repeated)
    return Step(la, lb, None, None, None, exact, repeated)


def _rank(entries, basis: str, slo) -> Ranking:
    """``entries``: (label, figure row) ranked best first by the metrics in turn."""
    metrics = _metrics(slo)

    def cmp(x, y):
        for key, _, higher in metrics:
            c = _compare(x[1], y[1], key, higher, basis)
            if c:
                return c
        vx, vy = _value(x[1], metrics[0][0]), _value(y[1], metrics[0][0])
        if math.isnan(vx) or math.isnan(vy) or vx == vy:
            return 0
        return (-1 if vx > vy else 1) if metrics[0][2] else (-1 if vx < vy else 1)

    ordered = sorted(entries, key=functools.cmp_to_key(cmp))
    steps = tuple(_step(ordered[i][1], ordered[i + 1][1], ordered[i][0], ordered[i + 1][0], basis, slo)
                  for i in range(len(ordered) - 1))
    kinds = {e[1].run.kind for e in entries}
    if basis == "virtual":
        text = "in virtual time"
    elif kinds == {"measured"}:
        text = "measured on this host"
    elif kinds == {"emulated"}:
        text = "emulated on this host (profiles met)"
    else:
        text = "on this host (measured, and emulated with profiles met)"
    return Ranking(basis, tuple(e[0] for e in ordered), tuple(e[1].run.label for e in ordered), steps,
                   tuple(n for _, n, _ in metrics), text)


def verdict_of(rows, slo=None, *, rank=None, require_moved_kv=True) -> Verdict:
    """The verdict over one group's rows (RunRow: run, summary, goodput); ``rank``, the labels
    of the runs to rank (None: every run of the group); see the module docstring. Without
    ``require_moved_kv`` runs are ranked even when none loaded KV from a tier (deployments differ
    in more than their tiers: :func:`deployment_verdict`)."""
    rows = list(rows)
    twins = virtual_twins(rows)
    twin_ids = {id(t) for t in twins.values()}
    asked = [i for i, r in enumerate(rows) if rank is None or r.run.label in rank]
    # a twin stands beside its run when that run is ranked; else it is a run of its own
    entries = [i for i in asked if not (id(rows[i]) in twin_ids and any(
        twins.get(j) is rows[i] for j in asked))]
    reuse = tuple(reuse_of(r.run) for r in rows)
    by_label = {r.label: r for r in reuse}
    host = [i for i in entries if _host_ok(rows[i].run)]
    # a run that moved no KV has the same figures in every kind (its times are the modelled
    # compute's): it stands for itself on either basis
    still = {i for i in entries if not _moved(by_label[rows[i].run.label])}
    has_virtual = {i: (rows[i] if rows[i].run.kind == "virtual" or i in still else twins.get(i)) for i in entries}
    if not entries:  # --rank names no run of this workload
        groups, unranked = [], []
    elif len(host) == len(entries):
        groups = [("measured", [(rows[i].run.label, rows[i]) for i in entries])]
        unranked: list[tuple[str, str]] = []
    elif all(has_virtual[i] is not None for i in entries):
        groups = [("virtual", [(rows[i].run.label, has_virtual[i]) for i in entries])]
        unranked = []
    else:
        # runs that moved no KV join the virtual ranking when there is one, else the measured
        virtual = [i for i in entries if i not in host and has_virtual[i] is not None]
        measured = [i for i in host if not (virtual and i in still)]
        virtual += [i for i in entries if i in still and i not in measured and i not in virtual]
        measured = [(rows[i].run.label, rows[i]) for i in measured]
        virtual = [(rows[i].run.label, has_virtual[i]) for i in virtual]
        groups = sorted([("measured", measured), ("virtual", virtual)], key=lambda g: -len(g[1]))
        groups = [g for g in groups if g[1]]
        unranked = [(rows[i].run.label, _why_unranked(rows[i])) for i in entries
                    if i not in host and has_virtual[i] is None]
        if len(groups) == 2:  # a run alone on its kind is not ranked: say against what it is not
            for basis, members in list(groups):
                if len(members) == 1:
                    other = "virtual" if basis == "measured" else "measured"
                    unranked.append((members[0][0], f"the only run with a {basis} figure: a {basis} figure is "
                                                    f"not ranked against {other} ones"))
                    groups.remove((basis, members))
    rankings = tuple(_rank(members, basis, slo) for basis, members in groups)
    moved = (not require_moved_kv) or any(_loaded_from_tier(by_label[fig]) for r in rankings for fig in r.figures_of)
    head = rankings[0] if rankings else None
    winner = runner = None
    margin = spread = None
    tied: tuple[str, ...] = ()
    objective = _metrics(slo)[0][1]
    value_key = _metrics(slo)[0][0]
    fig_row = {r.run.label: r for r in rows}
    if head is not None and len(head.labels) > 1:
        first = head.steps[0]
        if first.metric is None:
            n = 1
            for st in head.steps:
                if st.metric is not None:
                    break
                n += 1
            tied = tuple(head.labels[:n])
        else:
            winner, runner = head.labels[0], head.labels[1]
            margin, spread, objective = first.margin, first.margin_spread, first.metric
            value_key = next(k for k, nm, _ in _metrics(slo) if nm == first.metric)
    elif head is not None:
        winner = head.labels[0]
    if not moved:
        winner, runner, margin, spread, tied = None, None, None, None, ()
    ranking = tuple((lab, _value(fig_row[fig], value_key)) for lab, fig in zip(head.labels, head.figures_of)) \
        if head else ()
    ref = fig_row[head.figures_of[0]] if head else rows[0]
    prefix = _median_reused_prefix(ref.run)
    be = _breakeven_at(ref.run, prefix)
    sentence = _sentence(head, moved, by_label, unranked, bool(entries))
    parts = [sentence]
    cheapest = _cheapest(head, fig_row, slo) if slo is not None and head is not None else None
    if cheapest is not None:
        parts.append(_cheapest_sentence(cheapest))
    if head is not None and len(head.labels) > 2 and moved:
        parts.append(_order(head))
    for r in rankings[1:]:
        parts.append(_ranking_sentence(r, by_label))
    for label, why in unranked:
        parts.append(f"{label} is not ranked: {why}")
    for i, twin in twins.items():
        if i in entries and not _host_ok(rows[i].run) and head is not None and head.basis == "virtual":
            own = str(rows[i].run.figures.get("label") or "").replace(" (upper bound)", "")
            parts.append(f"{rows[i].run.label} is ranked on its virtual twin {twin.run.label}: its own figures "
                         f"({own}) are an upper bound, this host's and not its tier's")
    if prefix is not None and be is not None:
        parts.append(f"reusing this workload's median cached prefix ({prefix:,} tokens) beats recomputing it from "
                     f"{be:.1f} GB/s")
    shown = list(head.figures_of) if head else []
    table = _breakeven_table(ref.run)
    for fig in dict.fromkeys([*shown[:2], *shown[-1:]]):  # the winner, the runner-up, the last
        parts.append(_run_terms(fig, by_label[fig], table))
    return Verdict(objective=objective if moved else "-", ranking=ranking, winner=winner, runner_up=runner,
                   margin=margin, reason="; ".join(parts), breakeven_prefix_tokens=prefix, breakeven_gbps=be,
                   reuse=reuse, margin_spread=spread, sentence=sentence,
                   basis=head.basis if head else None, tie=bool(tied), tied=tied, moved_kv=moved,
                   rankings=rankings, unranked=tuple(unranked),
                   twins=tuple((rows[i].run.label, t.run.label) for i, t in twins.items()), parts=tuple(parts),
                   cheapest=cheapest)


def _why_unranked(row) -> str:
    """Why an upper bound with no virtual twin is not ranked, and the replay that would rank it."""
    fig = str(row.run.figures.get("label") or row.run.kind).replace(" (upper bound)", "")
    try:
        twin = BackendSpec.parse(row.run.backend_spec).virtual_twin()
    except ConfigError:
        twin = None
    hint = (f"replay its trace on {twin} with the same options for its virtual twin" if twin is not None
            else "its tier has no profile to compare it in virtual time")
    return f"its figures are an upper bound ({fig}) and no virtual twin is given; {hint}"


def _margin_text(step: Step, basis_text: str) -> str:
    """`` by 1.51x in virtual time (exact: no spread)``, `` by 1.09x measured on this host (1.02-1.15x over
    the repetitions)`` or with one repetition each, that it has no spread."""
    m = "" if step.margin is None or math.isnan(step.margin) else f" by {step.margin:.2f}x"
    m += f" {basis_text}"
    if step.exact:
        return m + " (exact: no spread)"
    if step.margin_spread is not None:
        lo, hi = step.margin_spread
        return m + f" ({lo:.2f}-{hi:.2f}x over the repetitions)"
    return m + " (one repetition each: no spread to tell it from this host's noise; --repeat 3 gives one)"


def _because(better: Reuse, worse: Reuse) -> str:
    """Why the better run is better, in its KV terms: ``, because ...`` with the first of these that
    reads differently for the two runs and points the way of the result: a faster tier load, less
    KV stall in the steps, more of the prompt reused. Empty when none does (no reason made up)."""
    # a reason carries weight only where it shows: loads that take no visible share of either
    # run's TTFT (both 0%) cannot explain a lead, however different the tiers' GB/s
    loads_show = any(_pct(x) not in ("-", "0%") for x in (better.kv_load_share_of_ttft, worse.kv_load_share_of_ttft))
    if not (math.isnan(better.load_gbps) or math.isnan(worse.load_gbps)) and better.load_gbps > worse.load_gbps \
            and f"{better.load_gbps:.1f}" != f"{worse.load_gbps:.1f}" and loads_show:
        return (f", because its KV comes from the tier at {better.load_gbps:.1f} GB/s against "
                f"{worse.load_gbps:.1f} GB/s ({_pct(better.kv_load_share_of_ttft)} against "
                f"{_pct(worse.kv_load_share_of_ttft)} of TTFT)")
    bs, ws = better.kv_stall_share_of_e2el, worse.kv_stall_share_of_e2el
    if not (math.isnan(bs) or math.isnan(ws)) and bs < ws and _pct(bs) != _pct(ws):
        return f", because KV work stalls its steps for {_pct(bs)} of request time against {_pct(ws)}"
    if better.input_tokens and worse.input_tokens:
        br = (better.hit_tier_tokens + better.hit_hbm_tokens) / better.input_tokens
        wr = (worse.hit_tier_tokens + worse.hit_hbm_tokens) / worse.input_tokens
        if br > wr and _pct(br) != _pct(wr):
            return f", because it reuses {_pct(br)} of prompt tokens against {_pct(wr)}"
    return ""


def _ranking_sentence(r: Ranking, by_label) -> str:
    """One ranking as a sentence: who beats whom, or who are the same."""
    if len(r.labels) < 2:
        return f"{r.labels[0]} is the only run {r.basis_text}"
    s = r.steps[0]
    if s.metric is None:
        same = [r.labels[0]]
        for st in r.steps:
            if st.metric is not None:
                break
            same.append(st.worse)
        within = (f"within {100 * SAME_WITHIN:g} %" if r.basis == "virtual" else "within their spread")
        text = f"{_and(same)} are the same {within} {r.basis_text} (on {_and(r.metrics)})"
        if len(same) < len(r.labels):
            nxt = r.steps[len(same) - 1]
            text += f", ahead of {nxt.worse} on {nxt.metric}{_margin_text(nxt, r.basis_text)}"
        return text
    better, worse = by_label[r.figures_of[0]], by_label[r.figures_of[1]]
    last = f" ({len(r.labels)} runs ranked, {r.labels[-1]} last)" if len(r.labels) > 2 else ""
    return f"{_named(r, 0)} beats {_named(r, 1)} on {s.metric}{_margin_text(s, r.basis_text)}{_because(better, worse)}{last}"


def _order(r: Ranking) -> str:
    """A ranking in one line: ``the order in virtual time: A = B, then C (1.16x on median TTFT),
    then D (2.31x)``, each margin over the run before it on the metric that decided that step."""
    out = [r.labels[0]]
    for step in r.steps:
        if step.metric is None:
            out[-1] += f" = {step.worse}"
        else:
            m = "" if step.margin is None or math.isnan(step.margin) else f"{step.margin:.2f}x on {step.metric}"
            out.append(f"{step.worse} ({m})" if m else step.worse)
    return f"the order {r.basis_text}: " + ", then ".join(out)


def _named(r: Ranking, i: int) -> str:
    """A ranked run's label, with the twin whose figures rank it where that is another run."""
    label, fig = r.labels[i], r.figures_of[i]
    return label if label == fig else f"{label} (as its virtual twin {fig})"


def _and(labels) -> str:
    labels = list(labels)
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def _sentence(head: Ranking | None, moved: bool, by_label, unranked=(), asked: bool = True) -> str:
    """The verdict's first sentence (see the module docstring)."""
    if not asked:
        return "not ranked: none of this workload's runs is among those asked for (rank)"
    if head is None:
        return "no run can be ranked: every run's figures are an upper bound and none has a virtual twin"
    if not moved:
        return ("no run loaded KV from its tier: the tiers cannot differ (every reused prompt token was hit "
                "in HBM, the rest recomputed), so no run wins")
    if len(head.labels) == 1:
        others = (f": the {len(unranked)} other{'s' * (len(unranked) > 1)} cannot be ranked against it "
                  f"(below)" if unranked else "")
        return f"no comparison: {_named(head, 0)} is the only run ranked ({head.basis_text}){others}"
    return _ranking_sentence(head, by_label)


def _run_terms(label: str, reuse: Reuse, table=None) -> str:
    """One run's KV in measured terms: its share of TTFT, the bandwidth, against the break-even
    table (``table``: its rows; the run's place in it is the table's own cells, :func:`reuse_wins`)."""
    reads = reuse.bytes_read > reuse.bytes_loaded
    first = (f"in-place KV reads stall the steps for {_pct(reuse.kv_stall_share_of_e2el)} of request time" if reads else
             f"KV loads {_pct(reuse.kv_load_share_of_ttft)} of TTFT")
    if not math.isnan(reuse.load_gbps):
        first += f" at {reuse.load_gbps:.1f} GB/s"
        if table:
            start = wins_from(reuse_wins(reuse.load_gbps, table))
            longest = _tokens_short(int(table[-1]["prefix_tokens"]))
            if start is None:
                first += f" (below break-even: recomputing beats reusing at every prefix up to {longest} tokens)"
            elif start == int(table[0]["prefix_tokens"]):
                first += f" (above break-even at every prefix from {_tokens_short(start)} to {longest} tokens)"
            else:
                first += f" (above break-even from {_tokens_short(start)}-token prefixes on)"
    parts = [first]
    hit = reuse.hit_hbm_tokens + reuse.hit_tier_tokens
    parts.append(f"reuse {_pct(hit / reuse.input_tokens) if reuse.input_tokens else '-'} of prompt tokens "
                 f"({_pct(reuse.hit_tier_tokens / reuse.input_tokens) if reuse.input_tokens else '-'} from the tier)")
    if not math.isnan(reuse.queue_share) and reuse.queue_share >= 0.2:
        parts.append(f"requests queue {_pct(reuse.queue_share)} of their time (the GPU falls behind the arrivals)")
    if reuse.bound == "host":
        parts.append("bounded by this host: an upper bound")
    elif reuse.bound in ("link", "medium"):
        parts.append(f"bounded by the {reuse.bound}")
    return f"{label}: " + ", ".join(parts)


def _usd_per_m(run: Run) -> float | None:
    c = run.meta.get("cost")
    v = c.get("usd_per_million_output_tokens") if isinstance(c, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _headroom(row, slo, exact: bool) -> tuple[float | None, tuple[float, float] | None]:
    """SLO / p99 on TTFT and TPOT, the smaller (None when the SLO bounds neither or the run has no
    figure), and its range over the repetitions (None in virtual time or without repetitions)."""
    point, lo, hi, spread_ok = math.inf, math.inf, math.inf, not exact and bool(row.run.repetitions)
    for key, limit in (("p99_ttft_ms", slo.ttft_ms), ("p99_tpot_ms", slo.tpot_ms)):
        v = float(row.summary.get(key, math.nan))
        if not math.isfinite(limit) or math.isnan(v):
            continue
        point = min(point, limit / v if v > 0 else math.inf)
        sp = row.run.spread(key) if spread_ok else None
        if sp is None:
            spread_ok = False
        else:
            lo = min(lo, limit / sp[1] if sp[1] > 0 else math.inf)
            hi = min(hi, limit / sp[0] if sp[0] > 0 else math.inf)
    if not math.isfinite(point):
        return None, None
    return point, ((lo, hi) if spread_ok and math.isfinite(lo) and math.isfinite(hi) else None)


def _cheapest(head: Ranking, fig_row, slo) -> Cheapest | None:
    """The cheapest run of ``head`` meeting ``slo`` (:class:`Cheapest`); None when no run of it is priced."""
    exact = head.basis == "virtual"
    entries = [(lab, fig, fig_row[fig]) for lab, fig in zip(head.labels, head.figures_of)]
    priced = [(lab, fig, row, _usd_per_m(row.run)) for lab, fig, row in entries if _usd_per_m(row.run) is not None]
    if not priced:
        return None
    unpriced = tuple(lab for lab, fig, row in entries if _usd_per_m(row.run) is None)
    meets = sorted((e for e in priced if e[2].slo_p99_met), key=lambda e: e[3])
    missing = tuple(e[0] for e in priced if not e[2].slo_p99_met)
    stacks = any((e[2].run.meta.get("schedule") or {}).get("stack") for e in priced)
    closest = closest_h = None
    if not meets:
        scored = [(e[0], _headroom(e[2], slo, exact)[0]) for e in priced]
        scored = [x for x in scored if x[1] is not None]
        if scored:
            closest, closest_h = max(scored, key=lambda x: x[1])
    label = fig = usd = head_room = spread = nxt = cost_margin = None
    if meets:
        label, fig, row, usd = meets[0]
        head_room, spread = _headroom(row, slo, exact)
        if len(meets) > 1:
            nxt = meets[1][0]
            cost_margin = meets[1][3] / usd if usd > 0 else None
    return Cheapest(label, fig, usd, head_room, spread, exact, nxt, cost_margin, tuple(e[0] for e in meets),
                    missing, unpriced, closest, closest_h, stacks, slo.name, head.basis_text)


def _cheapest_sentence(c: Cheapest) -> str:
    """``the cheapest stack that meets the SLO ... is X at $A per million output tokens ...``."""
    what = "stack" if c.stacks else "run"
    if c.label is None:
        closest = (f" (closest: {c.closest}, at {c.closest_headroom:.2f}x of it)" if c.closest is not None else "")
        return f"no {what} {c.basis_text} meets the SLO {c.slo} at p99{closest}"
    text = (f"the cheapest {what} that meets the SLO {c.slo} at p99 {c.basis_text} is {c.label} at "
            f"${c.usd_per_million_output_tokens:.3f} per million output tokens (modelled)")
    if c.headroom is not None:
        text += f", with {c.headroom:.2f}x headroom on its p99"
        if c.exact:
            text += " (exact: no spread)"
        elif c.headroom_spread is not None:
            lo, hi = c.headroom_spread
            text += f" ({lo:.2f}-{hi:.2f}x over the repetitions" + (", below 1 in some: not in every one)"
                                                                     if lo < 1 else ")")
        else:
            text += " (one repetition: no spread)"
    if c.next is not None and c.cost_margin is not None:
        text += f"; the next, {c.next}, costs {c.cost_margin:.3f}x as much"
    if c.missing:
        text += f"; {_and(c.missing)} {'miss' if len(c.missing) > 1 else 'misses'} it"
    return text


# --------------------------------------------------------------------------------------------
# Colocated against disaggregated prefill and decode


@dataclass(frozen=True, eq=False)
class DeploymentVerdict:
    """Colocated runs against runs with prefill and decode instances apart (over RDMA, through the
    pool, through host DRAM), on the same GPUs in total: ranked by :func:`verdict_of`'s rules
    (``verdict``) among the runs whose deployments have ``total_gpus``; a run with another total
    is not compared (``refused``, with why)."""

    total_gpus: int | None
    deployments: tuple[tuple[str, str, int], ...]  # (label, deployment, GPUs in total) of every run asked
    refused: tuple[tuple[str, str], ...]           # (label, why it is not compared)
    verdict: Verdict | None                        # the ranking of the runs on total_gpus
    sentence: str
    parts: tuple[str, ...]
    mixed_totals: bool                             # the runs asked have different GPU totals

    @property
    def winner(self) -> str | None:
        return self.verdict.winner if self.verdict is not None else None

    def as_dict(self) -> dict[str, Any]:
        v = self.verdict
        return {"total_gpus": self.total_gpus, "sentence": self.sentence, "parts": list(self.parts),
                "deployments": [{"label": lab, "deployment": dep, "total_gpus": n} for lab, dep, n in self.deployments],
                "refused": [{"label": lab, "why": why} for lab, why in self.refused],
                "mixed_totals": self.mixed_totals,
                "winner": v.winner if v else None, "runner_up": v.runner_up if v else None,
                "objective": v.objective if v else None, "margin": v.margin if v else None,
                "margin_spread": list(v.margin_spread) if v and v.margin_spread else None,
                "basis": v.basis if v else None, "tie": v.tie if v else False, "tied": list(v.tied) if v else [],
                "ranking": [{"label": lab, "value": x} for lab, x in v.ranking] if v else []}


#: The order deployments are named in.
_DEPLOYMENT_ORDER = ("colocated", "disaggregated over RDMA", "disaggregated over RDMA (pull)",
                     "disaggregated through the pool", "disaggregated through the pool (serial stores)",
                     "disaggregated through host DRAM")


def deployment_verdict(rows, slo=None, *, rank=None) -> DeploymentVerdict | None:
    """Colocated against disaggregated over each transfer path, for the same GPUs in total
    (instances x GPUs each; a disaggregated run's instances are its prefill and decode ones
    together). The total compared is the one most of the runs asked have (on a tie, the first
    disaggregated run's); the others are named and not compared. None when no run of ``rows``
    is disaggregated. The ranking is :func:`verdict_of`'s (the same basis, metrics, tie rule and
    margin), without its no-KV-moved rule: a hand-off moves KV whatever the tier does."""
    rows = list(rows)
    if not any(r.run.disagg is not None for r in rows):
        return None
    asked = [r for r in rows if rank is None or r.run.label in rank]
    deployments = tuple((r.run.label, r.run.deployment, r.run.total_gpus) for r in asked)
    if not asked:
        return DeploymentVerdict(None, (), (), None, "deployments: not ranked: none of this workload's runs is "
                                 "among those asked for (rank)", (), False)
    counts: dict[int, int] = {}
    for r in asked:
        counts[r.run.total_gpus] = counts.get(r.run.total_gpus, 0) + 1
    most = max(counts.values())
    candidates = [t for t, n in counts.items() if n == most]
    first_pd = next((r.run.total_gpus for r in asked if r.run.disagg is not None), None)
    total = first_pd if first_pd in candidates else candidates[0]
    same = [r for r in asked if r.run.total_gpus == total]
    refused = tuple((r.run.label, f"its deployment has {r.run.total_gpus} GPUs in total against {total}: not the "
                                  f"same GPUs, so it is not compared with them")
                    for r in asked if r.run.total_gpus != total)
    by_kind: dict[str, list[str]] = {}
    for r in same:
        by_kind.setdefault(r.run.deployment, []).append(r.run.label)
    kinds = sorted(by_kind, key=lambda k: (_DEPLOYMENT_ORDER.index(k) if k in _DEPLOYMENT_ORDER else 9, k))
    listing = "; ".join(f"{k}: {', '.join(by_kind[k])}" for k in kinds)
    head = f"deployments on {total} GPUs in total ({listing})"
    # every run on that total, so that a virtual twin not asked for still stands beside its run
    on_total = [r for r in rows if r.run.total_gpus == total]
    v = (verdict_of(on_total, slo, rank=None if rank is None else [r.run.label for r in same], require_moved_kv=False)
         if len(same) > 1 else None)
    if v is None:
        sentence = f"{head}: no comparison, {same[0].run.label} is the only run on {total} GPUs"
    else:
        sentence = f"{head}: {v.sentence}"
    if len(kinds) == 1:
        sentence += f" (every run compared is {kinds[0]}: nothing to set it against)"
    parts = [sentence]
    if v is not None:
        parts += [p for p in v.parts[1:] if p.startswith("the order ") or " is not ranked: " in p
                  or " is ranked on its virtual twin " in p]
    parts += [f"{label} is not compared: {why}" for label, why in refused]
    return DeploymentVerdict(total, deployments, refused, v, sentence, tuple(parts), len(counts) > 1)
