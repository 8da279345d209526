"""The verdict of a report: which run wins for a workload, by how much, and why.

Per group (the runs of one trace): the runs ranked by the objective — goodput under the SLO when
one is given (higher is better), else median TTFT (lower is better), ties broken by median TTFT
then median E2EL — the winner's margin over the runner-up, and the reason in measured terms. For
every run a "why didn't reuse help" breakdown: prompt tokens hit in HBM, hit in the tier, missed;
KV stall against compute; bytes moved; and what bounded its KV figures (the link, the tier's
medium, or this host), from the run's own results (docs/report.md, "Verdict").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .common import lookup as _get
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


@dataclass(frozen=True, eq=False)
class Verdict:
    objective: str                       # "goodput" or "median TTFT"
    ranking: tuple[tuple[str, float], ...]   # (label, objective value), best first
    winner: str
    runner_up: str | None
    margin: float | None                 # runner-up's objective over the winner's (>= 1), NaN when 0
    reason: str
    breakeven_prefix_tokens: int | None  # the median reused prefix of the workload
    breakeven_gbps: float | None         # what the tier must deliver for reuse to beat recompute there
    reuse: tuple[Reuse, ...]
    margin_spread: tuple[float, float] | None = None  # the margin's range over repetitions (median TTFT)

    def as_dict(self) -> dict[str, Any]:
        return {"objective": self.objective, "ranking": [{"label": lab, "value": v} for lab, v in self.ranking],
                "winner": self.winner, "runner_up": self.runner_up, "margin": self.margin,
                "margin_spread": list(self.margin_spread) if self.margin_spread else None,
                "reason": self.reason, "breakeven_prefix_tokens": self.breakeven_prefix_tokens,
                "breakeven_gbps": self.breakeven_gbps, "reuse": [r.as_dict() for r in self.reuse]}


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
    gbps = math.nan
    for op in ("load", "read"):
        g = run.kv_op(op)["gbps"]
        if not math.isnan(g):
            gbps = g
            break
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


def _median_reused_prefix(run: Run) -> int | None:
    """The median prompt tokens served from a cache, over the requests that reused any, in ``run``
    (the winner: how much a run reuses depends on its policy)."""
    cached = _col(run, "cached_tokens")
    cached = cached[cached > 0]
    return int(np.median(cached)) if len(cached) else None


def _breakeven_at(run: Run, prefix: int | None) -> float | None:
    if prefix is None:
        return None
    from ..analysis import breakeven_gbps, timing_from_meta
    from ..errors import TraceError

    try:
        timing = timing_from_meta(run.meta["trace"])
    except (TraceError, KeyError):
        return None
    return float(breakeven_gbps(timing, [prefix])[0]["breakeven_gbps"])


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def verdict_of(rows, slo=None) -> Verdict:
    """The verdict over one group's rows (RunRow: run, summary, goodput)."""
    def key(row):
        ttft = row.summary.get("median_ttft_ms", math.nan)
        e2el = row.summary.get("median_e2el_ms", math.nan)
        nan_last = (math.inf if math.isnan(ttft) else ttft, math.inf if math.isnan(e2el) else e2el)
        if slo is not None:
            g = row.goodput if row.goodput is not None and not math.isnan(row.goodput) else -math.inf
            return (-g, *nan_last)
        return nan_last

    ranked = sorted(rows, key=key)
    objective = "goodput" if slo is not None else "median TTFT"

    def value(row):
        return float(row.goodput) if slo is not None else float(row.summary.get("median_ttft_ms", math.nan))

    winner = ranked[0]
    runner = ranked[1] if len(ranked) > 1 else None
    margin = None
    if runner is not None:
        a, b = value(winner), value(runner)
        if slo is not None:
            margin = a / b if b > 0 else math.inf if a > 0 else math.nan
        else:
            margin = b / a if a > 0 else math.nan
    spread = None
    if runner is not None and slo is None:
        a, b = winner.run.spread("median_ttft_ms"), runner.run.spread("median_ttft_ms")
        if a is not None or b is not None:
            wa = a or (value(winner),) * 2
            rb = b or (value(runner),) * 2
            if wa[1] > 0 and wa[0] > 0:
                spread = (rb[0] / wa[1], rb[1] / wa[0])
    reuse = tuple(reuse_of(r.run) for r in rows)
    by_label = {r.label: r for r in reuse}
    prefix = _median_reused_prefix(winner.run)
    be = _breakeven_at(winner.run, prefix)
    reason = _reason(winner, runner, ranked[-1] if len(ranked) > 2 else None, by_label, prefix, be, slo, margin,
                     spread)
    return Verdict(objective=objective, ranking=tuple((r.run.label, value(r)) for r in ranked),
                   winner=winner.run.label, runner_up=runner.run.label if runner else None, margin=margin,
                   reason=reason, breakeven_prefix_tokens=prefix, breakeven_gbps=be, reuse=reuse,
                   margin_spread=spread)


def _run_terms(label: str, reuse: Reuse, be: float | None) -> str:
    """One run's KV in measured terms: its share of TTFT, the bandwidth, against the break-even."""
    reads = reuse.bytes_read > reuse.bytes_loaded
    first = (f"in-place KV reads stall the steps for {_pct(reuse.kv_stall_share_of_e2el)} of request time" if reads else
             f"KV loads {_pct(reuse.kv_load_share_of_ttft)} of TTFT")
    if not math.isnan(reuse.load_gbps):
        first += f" at {reuse.load_gbps:.1f} GB/s"
        if be is not None:
            first += f" ({'above' if reuse.load_gbps >= be else 'below'} the {be:.1f} GB/s break-even)"
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


def _reason(winner, runner, last, by_label, prefix, be, slo, margin, spread=None) -> str:
    w = winner.run.label
    if runner is None:
        head = f"{w} is the only run"
    else:
        obj = "goodput" if slo is not None else "median TTFT"
        m = "" if margin is None or math.isnan(margin) else f" by {margin:.2f}x"
        if spread is not None:
            m += (f" ({spread[0]:.2f}-{spread[1]:.2f}x over the repetitions"
                  f"{', the spreads overlap: not a clear win' if spread[0] < 1 else ''})")
        else:
            m += " (one repetition each: no spread; --repeat N gives one)"
        head = f"{w} wins on {obj}{m} over {runner.run.label}"
    lines = [head]
    if prefix is not None and be is not None:
        lines.append(f"reusing this workload's median cached prefix ({prefix:,} tokens) beats recomputing it from "
                     f"{be:.1f} GB/s")
    lines.append(_run_terms(w, by_label[w], be))
    if runner is not None:
        lines.append(_run_terms(runner.run.label, by_label[runner.run.label], be))
    if last is not None and last is not runner:
        lines.append(_run_terms(last.run.label, by_label[last.run.label], be))
    return "; ".join(lines)


