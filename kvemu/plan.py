"""``kvemu plan``: the cheapest stack of KV levels below HBM that meets a latency target
(docs/analysis.md, "Planner").

0. The trace is a file, or recorded first from record options (:class:`RecordInput`).
1. Every candidate of the grid (one capacity per level, one policy, with ``prefetch`` one prefetch
   policy of the replay; a level of capacity 0 is left out) is analysed with the stack analysis
   (kvemu.capacity.StackAnalysis.evaluate, the machinery of ``analyze capacity --stack``), one
   call per stack (:func:`analyse_candidate`; a stack's prefetch variants share it: the analysis
   models no prefetch policy), under ``analysis_placement`` (default ``inclusive``: each level a
   cache of the whole prompt-block stream, computed once per policy and capacity, the fast path;
   the replay's rule itself, e.g. write-back, is exact but runs one Python call per block).
2. :func:`feasible` says whether a candidate can be built (each level against its medium's
   physical limits in the price table); infeasible candidates are kept out unless told.
3. Each candidate gets its cost ($ per million output tokens, kvemu.prices.run_cost) and its SLO
   ratio: the largest of (modelled figure / target) over the SLO's targets (a :class:`Goodput`
   target: its share over the attainment, :func:`goodput`), so a ratio <= 1 meets every target and
   ``1 - ratio`` is the margin. :func:`pareto_frontier` keeps the candidates no other is at least
   as good as on both.
4. The frontier's cheapest points (at most ``replay_max``, cheapest first, and always the cheapest
   that the analysis says meets the SLO) are replayed in the closed loop in virtual time (``vemu:``
   levels, ``replay --tiers`` under ``placement``; with a prefetch policy ``--kv-load async``) on
   the first ``replay_requests`` requests, on local processes or a Dask cluster (kvemu.executors).
5. The answer: the cheapest replayed stack that meets the SLO in the replay (else the analysis's,
   said so), with its margin; and per level the capacity at which it serves 95 % and 99 % of what
   it can serve at all below the levels above it (:func:`level_saturation`).
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import tempfile
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConfigError
from .plan_options import (DEFAULT_ANALYSIS_PLACEMENT, DEFAULT_PLACEMENT, DEFAULT_REPLAY_LAYERS,  # noqa: F401
                           DEFAULT_REPLAY_MAX, DEFAULT_REPLAY_REQUESTS, PlanOptions)

#: SLO metrics and percentiles a plan's target may name.
SLO_METRICS = ("ttft", "tpot")
SLO_PERCENTILES = (50, 90, 99)
#: The share of a replay window shorter than the trace that warms the levels uncounted (a window
#: from the trace's start is cold: every block is new).
WINDOW_WARMUP = 0.5
#: The shares of what a level can serve at all whose capacity the plan reports per level.
SATURATION_SHARES = (0.95, 0.99)
#: Log-spaced capacities :func:`level_saturation` tries before it bisects, to one block or 1/2^N of the
#: capacity found, whichever is more (N below: 1/1024; a level of under 1024 blocks to one block).
SATURATION_POINTS = 32
SATURATION_RESOLUTION_BITS = 10
#: Candidates at most in one grid.
MAX_CANDIDATES = 20_000


@dataclass(frozen=True)
class Target:
    """One SLO target: ``metric`` (ttft or tpot) at percentile ``pct`` at most ``limit_ms``."""

    metric: str
    pct: int
    limit_ms: float

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.pct}"


@dataclass(frozen=True)
class LevelChoice:
    """One level of the grid: a tier profile (its medium priced by the price table) and the
    capacities to try (bytes; 0 leaves the level out)."""

    profile: str
    capacities: tuple[int, ...]


@dataclass(frozen=True)
class Candidate:
    """One stack of the grid: a capacity per level (0: left out), the levels' eviction policy, and
    the replay's prefetch policy (None: loads in-step; kvemu.stackspec.PREFETCH_POLICIES)."""

    capacities: tuple[int, ...]
    policy: str
    prefetch: str | None = None

    def label(self, levels) -> str:
        from .units import human_bytes

        parts = [f"{lv.profile}={human_bytes(c)}" for lv, c in zip(levels, self.capacities) if c > 0]
        pf = f", prefetch {self.prefetch}" if self.prefetch else ""
        return (",".join(parts) or "HBM only") + f" ({self.policy}{pf})"


def _duration_ms(text: str, where: str) -> float:
    t = text.strip().lower()
    for unit, scale in (("ms", 1.0), ("us", 1e-3), ("s", 1e3)):
        if t.endswith(unit):
            num = t[: -len(unit)]
            break
    else:
        raise ConfigError(f"{where}: '{text.strip()}' needs a unit (ms, s or us), e.g. 2s or 50ms")
    try:
        v = float(num) * scale
    except ValueError:
        raise ConfigError(f"{where}: '{text.strip()}' is not a duration (e.g. 2s or 50ms)") from None
    if not (math.isfinite(v) and v > 0):
        raise ConfigError(f"{where}: '{text.strip()}' must be a positive duration")
    return v


@dataclass(frozen=True)
class Goodput:
    """A goodput target: at least ``share`` (0 < share <= 1) of the counted requests meet their
    per-request bounds, TTFT at most ``ttft_ms`` and TPOT at most ``tpot_ms`` (either None: not
    bounded). DistServe's SLO attainment (Zhong et al., "DistServe", OSDI 2024, whose goodput is the
    highest request rate at which the attainment reaches its goal): a stack meeting it serves the
    trace's offered rate within its goodput at that goal. :func:`goodput` counts it."""

    share: float
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    metric = "goodput"
    pct = None

    @property
    def name(self) -> str:
        return "goodput"

    @property
    def limit_ms(self):
        return None


def _share(text: str, where: str) -> float:
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and 0 < v <= 1):
        raise ConfigError(f"{where}: '{t}' is not a share above 0 and at most 1 (e.g. 0.9 or 90%)")
    return v


def parse_slo(text: str) -> tuple:
    """``ttft_p90=2s,tpot_p50=50ms``: each item METRIC_pPCT=DURATION (METRIC ttft or tpot, PCT 50, 90
    or 99; DURATION with ms, s or us); and/or a goodput target, ``goodput>=SHARE`` (0.9 or 90%) with
    the per-request bounds it counts, ``ttft<=DURATION`` and/or ``tpot<=DURATION`` (:class:`Goodput`).
    ConfigError, one line, otherwise."""
    out, bounds, share = [], {}, None
    for item in str(text).split(","):
        item = item.strip()
        if "<=" in item or ">=" in item:
            key, op, value = item.partition("<=") if "<=" in item else item.partition(">=")
            key = key.strip()
            if op == ">=" and key == "goodput":
                if share is not None:
                    raise ConfigError("--slo names goodput twice")
                share = _share(value, "--slo goodput")
                continue
            if op == "<=" and key in SLO_METRICS:
                if key in bounds:
                    raise ConfigError(f"--slo bounds {key} per request twice")
                bounds[key] = _duration_ms(value, f"--slo {key}")
                continue
            raise ConfigError(f"--slo: '{item}' is neither goodput>=SHARE nor ttft<=DURATION or tpot<=DURATION "
                              f"(e.g. ttft<=2s,tpot<=50ms,goodput>=90%)")
        key, eq, value = (x.strip() for x in item.partition("="))
        metric, _, pct = key.partition("_p")
        if not eq or metric not in SLO_METRICS or pct not in {str(p) for p in SLO_PERCENTILES}:
            raise ConfigError(f"--slo: '{item}' is not METRIC_pPCT=DURATION (METRIC ttft or tpot, PCT "
                              f"50, 90 or 99; e.g. ttft_p90=2s,tpot_p50=50ms) nor a goodput target "
                              f"(ttft<=2s,tpot<=50ms,goodput>=90%)")
        out.append(Target(metric, int(pct), _duration_ms(value, f"--slo {key}")))
    if len({t.name for t in out}) != len(out):
        raise ConfigError("--slo names a target twice")
    if share is not None and not bounds:
        raise ConfigError("--slo goodput>=SHARE needs the bounds each request must meet: ttft<=DURATION and/or "
                          "tpot<=DURATION")
    if bounds and share is None:
        raise ConfigError(f"--slo {next(iter(bounds))}<=DURATION bounds each request: give the share that must "
                          f"meet it, goodput>=SHARE (e.g. goodput>=90%)")
    if share is not None:
        out.append(Goodput(share, bounds.get("ttft"), bounds.get("tpot")))
    return tuple(out)


def goodput(ttft_ms, tpot_ms, arrival_ms, target: Goodput) -> dict:
    """The requests meeting ``target``'s bounds, one rule for the analysis and the replay: a request
    meets them when its TTFT is at most ``ttft_ms`` and its TPOT at most ``tpot_ms`` (a bound not
    given is met; a request without a TPOT, one output token, meets the TPOT bound). ``met`` of
    ``requests``; ``share`` (the attainment, 0 without requests); ``rps``: ``met`` over the span of
    their arrivals (the counted requests' first to last arrival; None when that is 0)."""
    ttft = np.asarray(ttft_ms, np.float64)
    tpot = np.asarray(tpot_ms, np.float64)
    arr = np.asarray(arrival_ms, np.float64)
    ok = np.ones(len(ttft), bool)
    if target.ttft_ms is not None:
        ok &= ttft <= target.ttft_ms  # nan: not met
    if target.tpot_ms is not None:
        ok &= ~(tpot > target.tpot_ms)  # nan (one output token): met
    met, n = int(ok.sum()), int(len(ok))
    span_s = float(arr.max() - arr.min()) / 1e3 if n else 0.0
    return {"met": met, "requests": n, "share": met / n if n else 0.0,
            "rps": met / span_s if span_s > 0 else None}


def slo_text(targets) -> str:
    """The SLO as a line says it."""
    parts = []
    for t in targets:
        if isinstance(t, Goodput):
            b = [f"{m.upper()} <= {v:g} ms" for m, v in (("ttft", t.ttft_ms), ("tpot", t.tpot_ms)) if v is not None]
            parts.append(f"goodput >= {t.share:.0%} of requests with {' and '.join(b)}")
        else:
            parts.append(f"{t.metric.upper()} p{t.pct} <= {t.limit_ms:g} ms")
    return ", ".join(parts)


def target_doc(t) -> dict:
    """A target as the plan's JSON gives it."""
    if isinstance(t, Goodput):
        return {"metric": "goodput", "percentile": None, "limit_ms": None, "name": "goodput", "share": t.share,
                "ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms}
    return {"metric": t.metric, "percentile": t.pct, "limit_ms": t.limit_ms, "name": t.name}


def parse_level(text: str) -> LevelChoice:
    """``PROFILE=SIZE,SIZE,...`` (PROFILE a built-in tier profile, e.g. cxl-pool=0,1TiB,2TiB)."""
    from .profiles import resolve_profile
    from .units import parse_size

    name, eq, sizes = str(text).partition("=")
    name = name.strip()
    if not eq or not name or not sizes.strip():
        raise ConfigError(f"--level: '{str(text).strip()}' is not PROFILE=SIZE,SIZE,... (e.g. cxl-pool=0,1TiB,2TiB)")
    if "/" in name or name.endswith(".toml"):
        raise ConfigError(f"--level {name}: give a built-in tier profile's name")
    resolve_profile(name)
    caps = tuple(parse_size(s.strip(), f"--level {name} size") for s in sizes.split(","))
    if len(set(caps)) != len(caps):
        raise ConfigError(f"--level {name} lists a size twice")
    return LevelChoice(name, caps)


# ------------------------------------------------------------------------------- the selection rules
def pareto_frontier(costs, ratios) -> list[int]:
    """Indices of the points no other point is at least as good as on both ``costs`` and ``ratios``
    (lower is better on both) and better on one; of points equal on both, the first. Sorted by cost
    (then ratio). A point with a cost or ratio that is None or NaN is never on the frontier."""
    pts = [(float(c), float(r), i) for i, (c, r) in enumerate(zip(costs, ratios))
           if c is not None and r is not None and math.isfinite(float(c)) and math.isfinite(float(r))]
    pts.sort()
    out, best = [], math.inf
    for c, r, i in pts:
        if r < best:  # cheaper points all have a larger ratio: this one is not dominated
            out.append(i)
            best = r
    return out


def cheapest_meeting(costs, ratios, among=None) -> int | None:
    """The index of the cheapest point whose SLO ratio is at most 1 (of ``among``, default all; a
    tie in cost goes to the smaller ratio, then the first); None if none meets."""
    idx = range(len(costs)) if among is None else among
    ok = [(float(costs[i]), float(ratios[i]), i) for i in idx
          if costs[i] is not None and ratios[i] is not None and float(ratios[i]) <= 1.0]
    return min(ok)[2] if ok else None


def slo_ratio(figures: dict, targets) -> float | None:
    """The largest of figure / limit over ``targets`` (``figures[metric]`` a dict of percentiles
    ``p50``/``p90``/``p99`` in ms); for a :class:`Goodput` target, its share over the attainment
    (``figures["goodput"]["share"]``, :func:`goodput`; inf when no request meets it). None when a
    figure is missing."""
    worst = 0.0
    for t in targets:
        if isinstance(t, Goodput):
            v = (figures.get("goodput") or {}).get("share")
            if v is None:
                return None
            worst = max(worst, t.share / float(v) if v > 0 else math.inf)
            continue
        v = (figures.get(t.metric) or {}).get(f"p{t.pct}")
        if v is None or not math.isfinite(float(v)):
            return None
        worst = max(worst, float(v) / t.limit_ms)
    return worst


def capacity_for_share(capacities, hit_ratios, unbounded: float, share: float):
    """The smallest capacity of a curve (``capacities`` ascending with their ``hit_ratios``) whose
    hit ratio reaches ``share`` x ``unbounded``; None if none does (or the ratio is 0)."""
    if not unbounded or unbounded <= 0:
        return None
    need = share * unbounded - 1e-12
    for c, r in zip(capacities, hit_ratios):
        if r >= need:
            return c
    return None


def level_saturation(an, levels, capacities, policy: str, placement: str, shares=SATURATION_SHARES,
                     points: int = SATURATION_POINTS) -> list[dict]:
    """Per level k of ``levels`` (LevelChoice, top first), the capacity at which it serves ``share``
    of what it can serve at all, given the levels above it: the stack of levels ``0 .. k-1`` at
    ``capacities`` (bytes; 0 leaves a level out) and level k at C, the levels below it left out,
    under ``placement`` and ``policy`` (kvemu.stackrules), analysed by ``an``
    (kvemu.capacity.StackAnalysis.evaluate). ``served_k(C)`` is the prompt tokens of the counted
    requests level k serves; its ``reachable`` figure is ``served_k`` with every block of the trace
    fitting in level k (it then evicts nothing, so no capacity serves more); ``reaches[share]`` is
    the smallest C, in whole blocks, with ``served_k(C) >= share x reachable``: the first of
    ``points`` log-spaced capacities from one block to every block that reaches it, then bisection
    between it and the point below, to one block or 1/1024 of the capacity found, whichever is more
    (exact, to that resolution, where ``served_k`` does not fall as C grows, as under LRU with
    ``inclusive``). None where the level serves nothing even unbounded."""
    from .capacity import Level
    from .profiles import resolve_profile

    bb = int(an.block_bytes)
    grid = an.grid(points)
    rows = []
    for k, lv in enumerate(levels):
        above = [Level(name=c.profile, profile=resolve_profile(c.profile), capacity_bytes=int(cap))
                 for c, cap in zip(levels[:k], capacities[:k]) if cap > 0]
        profile = resolve_profile(lv.profile)
        memo: dict = {}

        def served(blocks: int) -> int:
            if blocks not in memo:
                stack = above + [Level(name=lv.profile, profile=profile, capacity_bytes=int(blocks) * bb)]
                memo[blocks] = int(an.evaluate(stack, policy, placement=placement)["levels"][-1]["served_tokens"])
            return memo[blocks]

        top = max(int(an.unique), 1)
        reachable = served(top)
        reaches = {}
        for share in shares:
            need = share * reachable
            if reachable <= 0:
                reaches[share] = None
                continue
            hi = next((g for g in grid if served(g) >= need - 1e-9), top)
            lo = max([g for g in grid if g < hi], default=0)  # served(lo) < need (or lo is 0 blocks)
            while hi - lo > max(1, hi >> SATURATION_RESOLUTION_BITS):
                mid = (lo + hi) // 2
                if served(mid) >= need - 1e-9:
                    hi = mid
                else:
                    lo = mid
            reaches[share] = hi * bb
        counted = an.trace.input_tokens[an.first_counted:].sum()
        rows.append({"level": lv.profile, "reachable_tokens": reachable,
                     "reachable_share": float(reachable / counted) if counted else 0.0,
                     "reaches_bytes": {_share_key(s): v for s, v in reaches.items()},
                     "evaluated_capacities": len(memo)})
    return rows


def _share_key(share: float) -> str:
    return f"{share * 100:g}%"


def feasible(candidate: Candidate, levels, prices, *, instances: int = 1, gpus_per_instance: int = 1,
             shared: bool = True, compression: bool = False) -> tuple[bool, str | None]:
    """Whether ``candidate`` can be built, and if not why (one line): each level against its
    medium's physical limits in the price table (kvemu.feasibility.stack_feasibility)."""
    from .feasibility import stack_feasibility

    @dataclass(frozen=True)
    class _Lv:
        name: str
        profile: str
        capacity_bytes: int

    rows = stack_feasibility(prices, [_Lv(lv.profile, lv.profile, cap) for lv, cap in zip(levels, candidate.capacities)],
                             instances=instances, gpus_per_instance=gpus_per_instance, shared=shared,
                             compression=compression)
    bad = [r for r in rows if not r["ok"]]
    return (not bad), ("; ".join(f"{r['level']}: {r['reason']}" for r in bad) or None)


# ----------------------------------------------------------------------------------- the analysis
def analyse_candidate(an, candidate: Candidate, levels, *, prices, amortise_years: float, placement: str,
                      per_request: bool = False) -> dict:
    """One candidate through the stack analysis (kvemu.capacity.StackAnalysis.evaluate): its point
    (per-level shares, TTFT, TPOT, cost; with ``per_request``, each counted request's figures)."""
    from .capacity import Level
    from .profiles import resolve_profile

    lv = [Level(name=c.profile, profile=resolve_profile(c.profile), capacity_bytes=cap)
          for c, cap in zip(levels, candidate.capacities)]
    return an.evaluate(lv, candidate.policy, prices=prices, amortise_years=amortise_years, placement=placement,
                       per_request=per_request)


def _percentiles(values) -> dict:
    v = np.asarray(values, np.float64)
    v = v[np.isfinite(v)]
    if not v.size:
        return {}
    return {"mean": float(v.mean()), **{f"p{p}": float(np.percentile(v, p)) for p in SLO_PERCENTILES}}


def _analysed_percentiles(an, point: dict) -> dict:
    """TTFT and TPOT percentiles of an analysed point (p90 as well as the analysis's p50/p99)."""
    return {"ttft": point.get("ttft_ms") or {}, "tpot": point.get("tpot_ms") or {}}


# ------------------------------------------------------------------------------------- the replay
def tiers_text(candidate: Candidate, levels, placement: str, shared: bool) -> str | None:
    """The ``replay --tiers`` stack of a candidate (vemu levels; None when it has no level)."""
    parts = [f"vemu:{lv.profile}|cap={cap},policy={candidate.policy}" + (",sharing=shared" if shared else "")
             for lv, cap in zip(levels, candidate.capacities) if cap > 0]
    if not parts:
        return None
    return ";".join(parts) + f";placement={placement}" + (f",prefetch={candidate.prefetch}" if candidate.prefetch
                                                          else "")


def replay_candidate(trace_path, tiers: str, *, requests: int, layers: int, warmup: float, instances: int,
                     sharing: str, amortise_years: float, prices_path=None, goodput_target: dict | None = None,
                     kv_load: str | None = None) -> dict:
    """Replay one stack in the closed loop in virtual time; its TTFT/TPOT percentiles, per-level
    shares and cost, and with ``goodput_target`` (:class:`Goodput`'s fields) its :func:`goodput`
    (a small dict: what goes back from a worker). ``kv_load``: replay's ``--kv-load``."""
    import json

    import pyarrow.parquet as pq

    from .backend_spec import BackendSpec
    from .replay import replay
    from .replay.stack import parse_tiers
    from .replay_options import options_from
    from .schema import METADATA_KEY

    stack = parse_tiers(tiers)
    values = {"tier__stack": stack, "window__requests": (0, requests), "window__layers": layers,
              "window__warmup": warmup, "instances__count": instances, "cost__amortise_years": amortise_years}
    if instances > 1:
        values["instances__sharing"] = sharing
    if prices_path is not None:
        values["cost__prices"] = str(prices_path)
    if kv_load is not None:
        values["schedule__kv_load"] = kv_load
    options = options_from(values)
    with tempfile.TemporaryDirectory(prefix="kvemu-plan-") as d:
        out = Path(d) / "run.parquet"
        meta = replay(trace_path, BackendSpec.parse(stack.levels[0].backend), options, out=out)
        t = pq.read_table(out, columns=["ttft_ms", "tpot_ms", "arrival_ms", "input_tokens", "stack_level_tokens"])
        m = json.loads(t.schema.metadata[METADATA_KEY.encode() if isinstance(METADATA_KEY, str) else METADATA_KEY])
    inp = np.asarray(t["input_tokens"].to_numpy(), np.float64)
    shares = None
    try:
        per = t["stack_level_tokens"].to_pylist()
        if per and per[0] is not None and inp.sum() > 0:
            shares = (np.asarray(per, np.float64).sum(axis=0) / inp.sum()).tolist()
    except (ValueError, TypeError):
        shares = None
    cost = m.get("cost") or meta.get("cost") or {}
    return {"ttft": _percentiles(t["ttft_ms"].to_numpy(zero_copy_only=False)),
            "tpot": _percentiles(t["tpot_ms"].to_numpy(zero_copy_only=False)),
            "usd_per_million_output_tokens": cost.get("usd_per_million_output_tokens"),
            "level_shares": shares, "requests": int(len(inp)), "wall_s": meta.get("wall_s"),
            **({"goodput": goodput(t["ttft_ms"].to_numpy(zero_copy_only=False),
                                   t["tpot_ms"].to_numpy(zero_copy_only=False),
                                   t["arrival_ms"].to_numpy(zero_copy_only=False), Goodput(**goodput_target))}
               if goodput_target is not None else {})}


def _remote_replay(trace_bytes: bytes, kwargs: dict) -> dict:
    """A Dask task: the trace comes as bytes (no shared file system), a small dict goes back."""
    with tempfile.TemporaryDirectory(prefix="kvemu-plan-") as d:
        p = Path(d) / "trace.parquet"
        p.write_bytes(trace_bytes)
        return replay_candidate(p, **kwargs)


def run_replays(trace_path, jobs: list[dict], executor: str = "local", workers: int | None = None, tls=None,
                insecure: bool = False, progress=None) -> list:
    """Each job's :func:`replay_candidate` (keyword arguments), on local processes (``local``: up to
    ``workers``, default the CPUs, at most one per job) or a Dask cluster (kvemu.executors). A job
    that fails gives ``{"error": ...}`` in its place."""
    from .errors import KvemuError
    from .executors import connect, parse_executor

    target = parse_executor(executor, tls, insecure)
    results: list = [None] * len(jobs)
    done = 0
    if not jobs:
        return results
    if target == "local":
        from concurrent.futures import ProcessPoolExecutor, as_completed

        n = max(1, min(len(jobs), workers or os.cpu_count() or 1))
        if n == 1:
            for i, j in enumerate(jobs):
                try:
                    results[i] = replay_candidate(trace_path, **j)
                except KvemuError as e:
                    results[i] = {"error": str(e)}
                if progress:
                    progress(i + 1, len(jobs))
            return results
        with ProcessPoolExecutor(max_workers=n) as pool:
            futs = {pool.submit(replay_candidate, trace_path, **j): i for i, j in enumerate(jobs)}
            for f in as_completed(futs):
                try:
                    results[futs[f]] = f.result()
                except KvemuError as e:
                    results[futs[f]] = {"error": str(e)}
                done += 1
                if progress:
                    progress(done, len(jobs))
        return results
    client = connect(target, 10.0)
    try:
        data = client.scatter(Path(trace_path).read_bytes(), hash=True)
        futs = [client.submit(_remote_replay, data, j, pure=False) for j in jobs]
        for i, f in enumerate(futs):
            try:
                results[i] = f.result()
            except Exception as e:  # noqa: BLE001 - a worker's error: this point's replay failed
                results[i] = {"error": f"{type(e).__name__}: {e}"}
            if progress:
                progress(i + 1, len(jobs))
    finally:
        client.close()
    return results


# ------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class RecordInput:
    """A plan's trace made first: ``workload`` (``synthetic:chat``, ``mooncake:PATH``, ...) served by
    the engine model on ``model``, recorded with ``options`` (kvemu.record_options.RecordOptions;
    None: `kvemu record`'s defaults) through :func:`kvemu.recording.record`, into a temporary file
    the plan removes when it is done."""

    workload: str
    model: str
    options: object = None


def check_options(levels, targets, o: PlanOptions) -> None:
    from .capacity import POLICIES
    from .policies import get_policy
    from .prices import check_amortise_years
    from .stackrules import check_placement, check_warmup

    if not targets:
        raise ConfigError("--slo names no target (e.g. ttft_p90=2s)")
    if not levels:
        raise ConfigError("give at least one --level PROFILE=SIZE,... (e.g. --level cxl-pool=0,1TiB,2TiB)")
    if len({lv.profile for lv in levels}) != len(levels):
        raise ConfigError("--level names a profile twice")
    if not o.policies:
        raise ConfigError(f"--policies names no policy (known: {', '.join(POLICIES)})")
    if len(set(o.policies)) != len(o.policies):
        raise ConfigError("--policies names a policy twice")
    for p in o.policies:
        if not get_policy(p, "--policies").online:
            raise ConfigError(f"--policies: {p} needs every future access, so it cannot be replayed; plan online "
                              f"policies only")
    from .stackspec import PREFETCH_POLICIES

    for p in o.prefetch:
        if p not in PREFETCH_POLICIES:
            raise ConfigError(f"--prefetch: unknown prefetch policy {p!r} (known: {', '.join(PREFETCH_POLICIES)})")
    if len(set(o.prefetch)) != len(o.prefetch):
        raise ConfigError("--prefetch names a policy twice")
    check_placement(o.placement, "--placement")
    check_placement(o.analysis_placement, "--analysis-placement")
    if o.placement == "inclusive":
        raise ConfigError("--placement inclusive is no engine's rule and cannot be replayed; give write-back, "
                          "write-through or write-through-selective")
    check_warmup(o.warmup)
    check_amortise_years(o.amortise_years)
    for name, v, lo, hi in (("--instances", o.instances, 1, 1024), ("--replay", o.replay_max, 0, 1000),
                            ("--replay-requests", o.replay_requests, 1, 10_000_000),
                            ("--replay-layers", o.replay_layers, 1, 1 << 20)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"{name} must be a whole number from {lo} to {hi}, got {v!r}")
    from .executors import parse_executor

    parse_executor(o.executor, o.tls, o.insecure)  # a bad address is refused before any work
    n = math.prod(len(lv.capacities) for lv in levels) * len(o.policies)
    if n > MAX_CANDIDATES:
        raise ConfigError(f"the grid has {n} candidates (capacities per level x policies); at most {MAX_CANDIDATES}")


def plan(trace_path, slo, levels, options: PlanOptions | None = None, progress=None, log=None) -> dict:
    """Search the grid (``levels``: LevelChoice or ``PROFILE=SIZES`` text, top level first) for the
    cheapest stack meeting ``slo`` (Targets or ``--slo`` text); see the module docstring. Returns
    a JSON-able dict. ``trace_path``: a trace file, or a :class:`RecordInput` to record one first
    (every other input is checked before it is recorded). ``progress(done, total)`` and
    ``log(line)`` are told of long work."""
    o = options or PlanOptions()
    targets = parse_slo(slo) if isinstance(slo, str) else tuple(slo)
    levels = [parse_level(lv) if isinstance(lv, str) else lv for lv in levels]
    check_options(levels, targets, o)
    log = log or (lambda m: None)
    if not isinstance(trace_path, RecordInput):
        return _plan(trace_path, targets, levels, o, progress, log)
    from .record_options import RecordOptions
    from .recording import record

    rec = trace_path
    from .arguments import instance_arg, text_arg

    text_arg("trace.workload", rec.workload)
    ro = RecordOptions() if rec.options is None else instance_arg("trace.options", rec.options, RecordOptions)
    ro.check()  # before the log says it records
    # a refusal names what was given, not the temporary file it is recorded into (gone by then)
    name = f"the trace recorded from --workload {rec.workload} --model {rec.model}"
    if ro.engine.tier_policy == "resident":  # refused as _plan refuses the trace, before recording it
        raise _resident_refusal(name)
    with tempfile.TemporaryDirectory(prefix="kvemu-plan-") as d:
        path = Path(d) / "trace.parquet"
        log(f"recording {rec.workload} on {rec.model}")
        record(rec.workload, rec.model, path, ro)
        doc = _plan(path, targets, levels, o, progress, log, name=name)
    doc["trace"] = f"recorded: {rec.workload} on {rec.model}"
    doc["recorded"] = {"workload": rec.workload, "model": str(rec.model),
                       "options": _given_record_options(ro)}
    return doc


def _given_record_options(ro) -> dict:
    """The record options that differ from `kvemu record`'s defaults, by their flags."""
    from .record_options import OPTIONS

    out = {}
    for opt in OPTIONS:
        v = getattr(getattr(ro, opt.group), opt.field)
        if opt.flag and v != opt.default:
            out[opt.flag] = list(v) if isinstance(v, tuple) else v
    return out


def _resident_refusal(name) -> ConfigError:
    """plan's refusal of a resident trace (``name``: the trace as the user gave it)."""
    return ConfigError(f"{name}: its KV is resident in one tier (tier policy resident); plan searches stacks of "
                       f"levels under an offload trace (record it with --tier-policy offload)")


def _plan(trace_path, targets, levels, o: PlanOptions, progress, log, name=None) -> dict:
    """The plan of the trace at ``trace_path``; ``name``: the trace in a refusal (default the path)."""
    name = trace_path if name is None else name
    from .capacity import StackAnalysis
    from .prices import load_prices
    from .schema import read_trace

    prices = load_prices(o.prices_path)
    if o.compression:
        prices = prices.with_compression()
        if not prices.compressed:
            raise ConfigError(f"--compression: no medium of {prices.path} declares inline compression "
                              f"([medium.NAME.compression])")
    tr = read_trace(trace_path)
    if "gpu" not in tr.header.meta:
        raise ConfigError(f"{name}: a real run's trace has no GPU model to analyse stacks with; plan needs a "
                          f"trace kvemu record made")
    if tr.header.meta.get("engine", {}).get("tier_policy") == "resident":
        raise _resident_refusal(name)
    an = StackAnalysis(tr, o.warmup)
    gp = next((t for t in targets if isinstance(t, Goodput)), None)
    # with --prefetch, each stack once per prefetch policy (the replay's; HBM only has none)
    cands = [Candidate(tuple(caps), pol, pf if any(caps) else None)
             for caps in itertools.product(*(lv.capacities for lv in levels))
             for pol in o.policies for pf in (o.prefetch or (None,))]
    # a candidate whose levels are all empty is the same stack under every policy: once
    seen, grid = set(), []
    for c in cands:
        key = (c.capacities, c.policy if any(c.capacities) else None, c.prefetch)
        if key not in seen:
            seen.add(key)
            grid.append(c)
    analysed: dict = {}  # the analysis models no prefetch policy: each stack analysed once
    points = []
    gpus = int(tr.header.meta["gpu"].get("gpus", 1))
    for i, c in enumerate(grid):
        ok, why = feasible(c, levels, prices, instances=o.instances, gpus_per_instance=gpus, shared=o.shared,
                           compression=o.compression)
        entry = {"stack": c.label(levels), "policy": c.policy, "capacities_bytes": list(c.capacities),
                 "feasible": ok, "infeasible_because": why}
        if o.prefetch:
            entry["prefetch"] = c.prefetch
        if (ok or o.keep_infeasible) and (c.capacities, c.policy) in analysed:
            entry["analysed"] = dict(analysed[(c.capacities, c.policy)])
        elif ok or o.keep_infeasible:
            p = analyse_candidate(an, c, levels, prices=prices, amortise_years=o.amortise_years,
                                  placement=o.analysis_placement, per_request=gp is not None)
            figs = _analysed_percentiles(an, p)
            each = p.pop("per_request_ms", None)
            if gp is not None and each is not None:
                figs["goodput"] = goodput(each["ttft"], each["tpot"], each["arrival"], gp)
            entry["analysed"] = {"ttft_ms": figs["ttft"], "tpot_ms": figs["tpot"],
                                 "usd_per_million_output_tokens": (p.get("cost") or {}).get(
                                     "usd_per_million_output_tokens"),
                                 "level_shares": [lv["hit_share"] for lv in p["levels"]],
                                 "hbm_share": p["hbm_share"], "recompute_share": p["recompute_share"],
                                 **({"goodput": figs["goodput"]} if "goodput" in figs else {}),
                                 "slo_ratio": slo_ratio(figs, targets)}
            analysed[(c.capacities, c.policy)] = entry["analysed"]
        points.append(entry)
        if progress:
            progress(i + 1, len(grid))
    costs = [(e.get("analysed") or {}).get("usd_per_million_output_tokens") for e in points]
    ratios = [(e.get("analysed") or {}).get("slo_ratio") for e in points]
    front = pareto_frontier(costs, ratios)
    if o.prefetch:  # a stack's prefetch variants share its analysed point: all of them or none on the frontier
        front = [j for i in front for j in range(len(grid)) if grid[j].capacities == grid[i].capacities
                 and grid[j].policy == grid[i].policy and "analysed" in points[j]]
    pick = cheapest_meeting(costs, ratios)
    # the frontier's cheapest points (and the analysis's pick) are replayed, the cheapest first
    replayable = [i for i in front if any(points[i]["capacities_bytes"])]
    chosen = replayable[: o.replay_max]
    if pick is not None and pick not in chosen and o.replay_max > 0 and any(points[pick]["capacities_bytes"]):
        chosen = chosen[: max(0, o.replay_max - 1)] + [pick]
    n = tr.n_requests
    requests = min(o.replay_requests, n)
    # a window shorter than the trace starts cold: its first half (or the --warmup share of the
    # trace, if more) warms the levels uncounted; replay's --warmup is a share of the whole trace
    counted_from = int(math.floor(o.warmup * n))
    if requests < n:
        counted_from = max(counted_from, int(requests * WINDOW_WARMUP))
        if counted_from >= requests:
            requests = min(n, counted_from + max(1, int(o.replay_requests * (1 - WINDOW_WARMUP))))
    replay_warmup = (counted_from + 0.5) / n if counted_from else 0.0  # floor(share x n) == counted_from
    jobs = [dict(tiers=tiers_text(grid[i], levels, o.placement, o.shared), requests=requests,
                 layers=min(o.replay_layers, tr.header.layers), warmup=replay_warmup, instances=o.instances,
                 sharing="shared" if o.shared else "replicated", amortise_years=o.amortise_years,
                 prices_path=o.prices_path,
                 goodput_target=None if gp is None else {"share": gp.share, "ttft_ms": gp.ttft_ms, "tpot_ms": gp.tpot_ms},
                 kv_load="async" if grid[i].prefetch else None)
            for i in chosen]
    if jobs:
        log(f"replaying {len(jobs)} frontier point(s) in virtual time on requests 0:{requests} "
            f"({o.executor})")
    replayed = run_replays(trace_path, jobs, o.executor, o.workers, o.tls, o.insecure, progress=None)
    for i, r in zip(chosen, replayed):
        if r is not None and "error" not in r:
            present = [k for k, cap in enumerate(grid[i].capacities) if cap > 0]  # the levels the replay ran
            if r.get("level_shares") is not None and len(r["level_shares"]) == len(present):
                full = [0.0] * len(levels)
                for k, v in zip(present, r["level_shares"]):
                    full[k] = v
                r["level_shares"] = full
            r["slo_ratio"] = slo_ratio({"ttft": r["ttft"], "tpot": r["tpot"], "goodput": r.get("goodput")}, targets)
        points[i]["replayed"] = r
    r_costs = [(points[i].get("replayed") or {}).get("usd_per_million_output_tokens") for i in range(len(points))]
    r_ratios = [(points[i].get("replayed") or {}).get("slo_ratio") for i in range(len(points))]
    r_pick = cheapest_meeting(r_costs, r_ratios, among=chosen)
    if r_pick is not None:
        answer = {"index": r_pick, "by": "replay", "slo_ratio": r_ratios[r_pick], "usd_per_million_output_tokens":
                  r_costs[r_pick]}
    elif pick is not None:
        answer = {"index": pick, "by": "analysis (no replayed point met the SLO)" if chosen else "analysis",
                  "slo_ratio": ratios[pick], "usd_per_million_output_tokens": costs[pick]}
    else:
        answer = None
    if answer is not None:
        answer["stack"] = points[answer["index"]]["stack"]
        answer["margin"] = 1.0 - answer["slo_ratio"]
    # per level: the capacity at which it serves 95 % and 99 % of what it can serve at all, below
    # the levels above it in the answer's stack (else the largest capacities tried, the first policy)
    if answer is not None:
        ref = grid[answer["index"]]
    else:
        ref = Candidate(tuple(max(lv.capacities) for lv in levels), o.policies[0])
    per_level = []
    for lv, row in zip(levels, level_saturation(an, levels, ref.capacities, ref.policy, o.analysis_placement)):
        k = len(per_level)
        above = Candidate(tuple(ref.capacities[:k]), ref.policy).label(levels[:k]).rsplit(" (", 1)[0]
        row = {**row, "capacities_bytes": list(lv.capacities), "above": above,
               **{f"reaches_{s}": v for s, v in row["reaches_bytes"].items()}}
        row["largest_tried_reaches"] = {s: (v is not None and max(lv.capacities) >= v)
                                        for s, v in row["reaches_bytes"].items()}
        per_level.append(row)
    return {
        "trace": str(trace_path), "requests": tr.n_requests,
        "slo": [target_doc(t) for t in targets],
        "levels": [{"profile": lv.profile, "capacities_bytes": list(lv.capacities)} for lv in levels],
        "policies": list(o.policies), "placement": o.placement, "analysis_placement": o.analysis_placement,
        **({"prefetch": list(o.prefetch)} if o.prefetch else {}),
        "instances": o.instances, "shared": o.shared, "warmup": o.warmup,
        "prices": prices.describe(), "amortise_years": o.amortise_years,
        "candidates": len(points), "not_buildable": sum(not p["feasible"] for p in points),
        "keep_infeasible": o.keep_infeasible, "compression": o.compression, "points": points, "frontier": front, "replayed": chosen,
        "replay": {"requests": requests, "counted_from": counted_from, "layers": min(o.replay_layers, tr.header.layers), "max": o.replay_max,
                   "executor": o.executor, "placement": o.placement},
        "answer": answer, "analysis_pick": pick,
        "saturation": per_level,
        "saturation_reference": {"stack": ref.label(levels), "capacities_bytes": list(ref.capacities),
                                 "policy": ref.policy, "placement": o.analysis_placement,
                                 "from": "the answer" if answer is not None else "the largest capacities tried"},
    }


def _target_of(d: dict):
    """A target back from its JSON (:func:`target_doc`)."""
    if d["metric"] == "goodput":
        return Goodput(d["share"], d.get("ttft_ms"), d.get("tpot_ms"))
    return Target(d["metric"], d["percentile"], d["limit_ms"])


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _closest_text(doc: dict) -> str:
    """The hint when no candidate meets the SLO: the frontier's point of the smallest SLO ratio;
    under a goodput target, the analysed point of the highest attained share (then the smallest
    ratio, then the cheapest), off the frontier too, since one where no request meets the bounds
    has an infinite ratio and no frontier point. "" when there is none."""
    pts = doc["points"]
    gt = next((t for t in doc["slo"] if t["metric"] == "goodput"), None)
    if gt is None:
        close = min(doc["frontier"], key=lambda i: pts[i]["analysed"]["slo_ratio"], default=None)
        if close is None:
            return ""
        an = pts[close]["analysed"]
        return (f" (closest: {pts[close]['stack']}, SLO ratio {an['slo_ratio']:.2f}, "
                f"{an['usd_per_million_output_tokens']:.3f} $/M output tokens)")

    def figs(i):
        an = pts[i].get("analysed") or {}
        share, cost = (an.get("goodput") or {}).get("share"), an.get("usd_per_million_output_tokens")
        ratio = an.get("slo_ratio")
        return share, math.inf if ratio is None else float(ratio), cost

    ok = [i for i in range(len(pts)) if figs(i)[0] is not None and figs(i)[2] is not None
          and math.isfinite(float(figs(i)[2]))]
    if not ok:
        return ""
    close = min(ok, key=lambda i: (-figs(i)[0], figs(i)[1], figs(i)[2], i))
    share, ratio, cost = figs(close)
    rat = f", SLO ratio {ratio:.2f}" if math.isfinite(ratio) else ""
    return (f" (closest: {pts[close]['stack']}, goodput {share:.1%} of requests against {gt['share']:.1%}{rat}, "
            f"{cost:.3f} $/M output tokens)")


def render_text(doc: dict) -> str:
    """The plan as text: the answer first, the frontier with analysed and replayed figures side by
    side, then per level the capacity reaching 95 % and 99 % of the unbounded hit ratio."""
    from .units import human_bytes

    targets = doc["slo"]
    slo = slo_text(_target_of(t) for t in targets)
    lines = []
    a = doc["answer"]
    if a is None:
        near = _closest_text(doc)
        lines.append(f"no candidate meets the SLO ({slo}) in the analysis{near}; widen the levels' capacities, "
                     f"add instances or relax it")
    else:
        p = doc["points"][a["index"]]
        lines.append(f"cheapest stack meeting {slo}: {p['stack']}, {a['usd_per_million_output_tokens']:.3f} $/M output "
                     f"tokens, margin {a['margin']:.0%} (by the {a['by']})")
    if doc.get("recorded"):
        r = doc["recorded"]
        given = ", ".join(f"{k} {v}" for k, v in r["options"].items())
        lines.append(f"trace recorded first: {r['workload']} on {r['model']}" + (f" ({given})" if given else "")
                     + ", removed after the plan")
    rp = doc["replay"]
    nb = doc.get("not_buildable", 0)
    if nb:
        lines.append(f"{nb} of {doc['candidates']} candidates cannot be built (the media's limits in the price table; "
                     + ("kept, marked" if doc["keep_infeasible"] else "left out; --keep-infeasible keeps them") + ")")
    lines.append(f"searched {doc['candidates']} candidates with the analysis (placement {doc['analysis_placement']}, "
                 f"TTFT and TPOT queued at the trace's load as the analysis models it); frontier {len(doc['frontier'])} point"
                 f"{'s' * (len(doc['frontier']) != 1)}; replayed "
                 f"{len(doc['replayed'])} (at most {rp['max']}, the cheapest) in the closed loop in virtual time "
                 f"(placement {rp['placement']}, requests 0:{rp['requests']}, "
                 + (f"0:{rp['counted_from']} warming the levels uncounted, " if rp["counted_from"] else "")
                 + f"{rp['layers']} layers, {rp['executor']})")
    if doc.get("prefetch"):
        lines.append(f"prefetch policies {', '.join(doc['prefetch'])}: the analysis models in-step loads and no "
                     f"prefetch policy, so a stack's variants are analysed as one (the same figures); the replays, "
                     f"with --kv-load async, tell them apart")
    names = [t["name"] for t in targets]
    head = (f"{'#':>3} {'stack':<44} {'$/M an':>8} {'$/M rep':>8} " + " ".join(f"{n + ' an':>12} {n + ' rep':>12}" for n in names)
            + f" {'ratio an':>8} {'ratio rep':>9}")
    gp = ("; goodput: % of the counted requests meeting their bounds, its ratio the target over it"
          if "goodput" in names else "")
    lines += ["", "frontier ($ per million output tokens against the SLO ratio = worst figure / target; an: analysed, "
              f"rep: replayed{gp}):", head]
    for n, i in enumerate(doc["frontier"], 1):
        p = doc["points"][i]
        an, rep = p.get("analysed") or {}, p.get("replayed") or {}
        def fig(d, t, key):
            if t["metric"] == "goodput":  # the attainment, in %
                v = (d.get("goodput") or {}).get("share")
                return None if v is None else 100.0 * v
            return (d.get(key) or {}).get(f"p{t['percentile']}")

        stack = p["stack"] if p["feasible"] else "[not buildable] " + p["stack"]
        row = (f"{n:>3} {stack[:44]:<44} {_num(an.get('usd_per_million_output_tokens')):>8} "
               f"{('failed' if 'error' in rep else _num(rep.get('usd_per_million_output_tokens'))):>8} ")
        row += " ".join(f"{_ms(fig(an, t, t['metric'] + '_ms')):>12} {_ms(fig(rep, t, t['metric'])):>12}" for t in targets)
        row += f" {_num(an.get('slo_ratio')):>8} {_num(rep.get('slo_ratio')):>9}"
        lines.append(row)
        if "error" in rep:
            lines.append(f"  replay failed: {rep['error']}")
    ref = doc["saturation_reference"]
    lines += ["", f"per level, the capacity at which it serves 95 % / 99 % of the prompt tokens it can serve at all, "
              f"below the levels above it in {ref['stack']} ({ref['from']}; placement {ref['placement']}, levels "
              f"below left out):"]
    for s in doc["saturation"]:
        fmt = lambda v: "never" if v is None else human_bytes(v)  # noqa: E731
        tried = human_bytes(max(s["capacities_bytes"]))
        lines.append(f"  {s['level']:<12} 95 %: {fmt(s['reaches_95%']):>10}  99 %: {fmt(s['reaches_99%']):>10}  "
                     f"(at most {s['reachable_share']:.1%} of the prompt tokens, below {s['above'] or 'HBM'}; "
                     f"largest tried {tried})")
    return "\n".join(lines)


def frontier_png(doc: dict) -> bytes:
    """Every analysed candidate (grey), the frontier (line) and its replayed figures (squares): $ per
    million output tokens against the SLO ratio; the ratio 1 (the target) dashed. Cost from zero."""
    from .plots import DPI, FIGURE_SIZE_IN, _matplotlib, _png

    Figure, Canvas, _ = _matplotlib()
    fig = Figure(figsize=FIGURE_SIZE_IN, dpi=DPI, layout="constrained")
    Canvas(fig)
    ax = fig.subplots()
    an = [(p["analysed"].get("slo_ratio"), p["analysed"].get("usd_per_million_output_tokens"))
          for p in doc["points"] if p.get("analysed")]
    an = np.array([(r, c) for r, c in an if r is not None and c is not None and math.isfinite(r)],
                  np.float64).reshape(-1, 2)  # an infinite ratio (no request meets a goodput's bounds): off the plot
    ax.scatter(an[:, 0], an[:, 1], s=10, color="0.7", label="analysed candidate")
    fr = np.array([(doc["points"][i]["analysed"]["slo_ratio"], doc["points"][i]["analysed"]
                    ["usd_per_million_output_tokens"]) for i in doc["frontier"]], np.float64).reshape(-1, 2)
    ax.plot(fr[:, 0], fr[:, 1], color="C0", marker="o", linewidth=2, label="frontier (analysed)")
    rep = [(doc["points"][i].get("replayed") or {}) for i in doc["replayed"]]
    rp = np.array([(r["slo_ratio"], r["usd_per_million_output_tokens"]) for r in rep
                   if r.get("slo_ratio") is not None and r.get("usd_per_million_output_tokens") is not None
                   and math.isfinite(r["slo_ratio"])],
                  np.float64).reshape(-1, 2)
    if rp.size:
        ax.scatter(rp[:, 0], rp[:, 1], marker="s", s=40, color="C3", label="replayed (closed loop, virtual time)")
    ax.axvline(1.0, color="0.3", linestyle="--", linewidth=1)
    top = max([1.0, *an[:, 1].tolist(), *rp[:, 1].tolist()]) if an.size else 1.0
    ax.set_ylim(0, top * 1.08)
    ax.set_xlabel("SLO ratio (worst figure / target; <= 1 meets it)")
    ax.set_ylabel("$ per million output tokens (modelled)")
    ax.grid(True, color="0.88")
    ax.legend(fontsize=8)
    ax.set_title("plan: cost against the SLO")
    return _png(fig)


def shares_png(doc: dict) -> bytes:
    """Per frontier point, the share of prompt tokens each level serves (analysed), stacked bars."""
    from .plots import DPI, WIDE_FIGURE_WIDTH_IN, FIGURE_SIZE_IN, _matplotlib, _png, run_colour

    Figure, Canvas, _ = _matplotlib()
    fig = Figure(figsize=(WIDE_FIGURE_WIDTH_IN, FIGURE_SIZE_IN[1] + 0.6), dpi=DPI, layout="constrained")
    Canvas(fig)
    ax = fig.subplots()
    pts = [doc["points"][i] for i in doc["frontier"]]
    x = np.arange(len(pts))
    bottom = np.zeros(len(pts))
    names = [lv["profile"] for lv in doc["levels"]]
    series = [("HBM", [p["analysed"]["hbm_share"] for p in pts], "0.6")]
    series += [(n, [p["analysed"]["level_shares"][k] for p in pts], run_colour(k)) for k, n in enumerate(names)]
    series += [("recomputed", [p["analysed"]["recompute_share"] for p in pts], "0.2")]
    for name, vals, colour in series:
        v = np.asarray(vals, np.float64)
        ax.bar(x, v, bottom=bottom, color=colour, label=name)
        bottom += v
    ax.set_xticks(x, [f"{i + 1}" for i in range(len(pts))])
    ax.set_xlabel("frontier point, cheapest first (see the table)")
    ax.set_ylabel("share of prompt tokens (analysed)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, ncols=min(6, len(series)), loc="upper center", bbox_to_anchor=(0.5, -0.15))
    ax.set_title("per-level shares of the frontier's stacks")
    return _png(fig)


def render_html(doc: dict, path, force: bool = False, inputs=()) -> Path:
    """One self-contained page: the answer, the frontier plot, the shares plot and the text table
    (no plots, said so, without matplotlib)."""
    import base64
    import html

    from .output import atomic_output
    from .plots import INSTALL_HINT, unavailable_reason

    body = [f"<h1>kvemu plan: {html.escape(doc['trace'])}</h1>"]
    missing = unavailable_reason()
    if missing:
        body.append(f"<p>No plots: {html.escape(missing)} ({html.escape(INSTALL_HINT)} adds them).</p>")
    else:
        for png in (frontier_png(doc), shares_png(doc)):
            body.append(f'<p><img alt="plan figure" src="data:image/png;base64,{base64.b64encode(png).decode()}"></p>')
    body.append(f"<pre>{html.escape(render_text(doc))}</pre>")
    page = ("<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>kvemu plan</title></head><body>"
            + "\n".join(body) + "</body></html>\n")
    with atomic_output(path, force=force, inputs=inputs) as tmp:
        Path(tmp).write_text(page, encoding="utf-8")
    return Path(path)


def _num(v) -> str:
    return "-" if v is None else f"{v:.3f}"


__all__ = ["Candidate", "Goodput", "LevelChoice", "PlanOptions", "RecordInput", "Target", "analyse_candidate",
           "capacity_for_share", "cheapest_meeting", "feasible", "goodput", "level_saturation", "pareto_frontier",
           "parse_level", "parse_slo", "plan", "slo_ratio"]


class _PlanModule(types.ModuleType):
    """This module is also the function kvemu.plan (:func:`plan`): ``kvemu.plan(trace, slo, levels,
    options)``, whichever of the two ``kvemu.plan`` names."""

    def __call__(self, *args, **kwargs):
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _PlanModule
