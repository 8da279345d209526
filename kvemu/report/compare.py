"""Building the comparison: runs grouped by trace, each compared with its group's baseline, with
the trace's break-even and capacity sections, and the JSON-ready records of runs and traces."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import __version__, analysis, metrics
from ..errors import ConfigError, KvemuError, OptionError, TraceError
from ..metrics import SLO
from ..schema import read_header, read_trace
from ..units import human_bytes
from .common import error_text as _one_line, lookup as _get
from .grouping import class_text, comparison_class, workload_key
from .results import KV_OP_PERCENTILES, KV_OPS, SHORT_SHA_LEN, Run, discover_results
from . import curve_cache
from .verdict import (TIER_BANDWIDTH_OPS, deployment_verdict, reuse_wins, tier_gbps, verdict_of, virtual_twins,
                      wins_from)

#: The metrics each run is compared on with its baseline: (name, summary key, table header).
COMPARED = (
    ("ttft", "median_ttft_ms", "TTFT p50"),
    ("tpot", "mean_tpot_ms", "TPOT mean"),
    ("e2el", "median_e2el_ms", "E2EL p50"),
)

#: Capacities on the log-spaced grid of the report's capacity curve.
CAPACITY_POINTS = 16
#: The largest trace a report hashes on its own, to find the trace a results file names (that
#: path is metadata, not the user's word); a larger one is read only when given with --trace.
AUTO_HASH_LIMIT = 1 << 30

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
    baseline_label: str = ""  # the run this one is compared with (like with like)
    # with an SLO, DistServe's split: requests (counts) and req/s meeting the TTFT objective, the TPOT one, both
    slo_attainment: Mapping[str, int] | None = None
    goodput_split: Mapping[str, float] | None = None


@dataclass(frozen=True, eq=False)
class TierVerdict:
    """One run set against the break-even bandwidth of its trace: the tier bandwidth it measured
    (:func:`tier_bandwidth`) and, per standard prefix length, whether loading a reused prefix at
    that rate beats recomputing it."""

    gbps: float  # NaN: the run moved no KV from the tier
    op: str | None  # the KV operation gbps was measured on
    wins: Mapping[int, bool]  # prefix tokens -> reuse beats recompute

    @property
    def wins_from_tokens(self) -> int | None:
        """The shortest standard prefix from which on reuse wins at every longer one; None when
        it loses at the longest."""
        return wins_from(self.wins)


@dataclass(frozen=True, eq=False)
class Breakeven:
    """Break-even bandwidth per prefix length for a trace's model and GPU compute model
    (:func:`kvemu.analysis.breakeven_gbps`), and every run of the trace set against it."""

    model: str
    gpu: Mapping[str, Any]  # the trace's ``gpu`` metadata
    prefixes: tuple[Mapping[str, float], ...]  # rows of analysis.breakeven_gbps
    verdicts: tuple[TierVerdict, ...]  # one per run of the group, in row order


@dataclass(frozen=True, eq=False)
class Capacity:
    """The LRU capacity curve of a trace (:func:`kvemu.analysis.capacity_curve`) and the TTFT it
    models at each capacity (:func:`kvemu.analysis.capacity_ttft`)."""

    trace_path: str
    found_by: str  # "--trace" or "recorded": given, or the path recorded in the results
    curve: Mapping[str, Any]
    ttft: tuple[Mapping[str, float], ...] | None  # None: TTFT cannot be modelled (see ttft_note)
    load_gbps: float  # the bandwidth cached prefixes are loaded at in the TTFT; NaN without one
    ttft_note: str  # where load_gbps comes from, or why there is no TTFT
    #: per request of the trace, the prompt tokens every earlier request would let it reuse
    #: (analysis.prefix_hit_tokens_unbounded); None when not computed
    earlier_hit_tokens: np.ndarray | None = None

    @property
    def saturation_index(self) -> int | None:
        """Position on the grid of the smallest capacity within 5 % of the unbounded hit ratio."""
        sat = self.curve["saturation_blocks"]
        return None if sat is None else self.curve["capacity_blocks"].index(sat)


@dataclass(frozen=True, eq=False)
class Group:
    """The runs of one trace, the run they are compared with, and the trace's break-even and
    capacity sections (each None with a note saying why, or how to get it)."""

    trace_sha256: str
    rows: tuple[RunRow, ...]
    baseline: RunRow
    baseline_rule: str
    breakeven: Breakeven | None = None
    breakeven_note: str = ""
    capacity: Capacity | None = None
    capacity_note: str = ""  # empty when the capacity section was not looked for
    verdict: Any = None  # verdict.Verdict: the ranking, the margin and the reason
    deployment: Any = None  # verdict.DeploymentVerdict: colocated against disaggregated; None without a P/D run
    trace_shas: tuple[str, ...] = ()  # every trace of the group (one per tier policy recorded)
    replaced: tuple[tuple[str, str], ...] = ()  # fallback virtual: (run left out, its virtual twin)
    cold: tuple[Any, ...] = ()  # ColdWindow: runs of a window of the trace that start cold

    @property
    def policies(self) -> list[str]:
        return list(dict.fromkeys(row.run.tier_policy for row in self.rows))

    @property
    def description(self) -> str:
        """The workload and its traces: ``synthetic:docqa on llama3-8b: <sha> offload, <sha> none``."""
        shas = self.trace_shas or (self.trace_sha256,)
        by_sha = {row.run.trace_sha256: row.run.tier_policy for row in self.rows}
        traces = ", ".join(f"{s[:SHORT_SHA_LEN]} {by_sha.get(s, '?')}" for s in shas)
        return f"{self.trace.workload_kind} on {self.trace.model_name}: trace{'s' * (len(shas) > 1)} {traces}"

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
    traces: Sequence[str | os.PathLike] = (),
    recorded_traces: bool = True,
    fallback: str = "beside",
    rank: Sequence[str] | None = None,
    cache: bool = True,
    progress=None,
) -> Report:
    """A report over the results in ``paths``, files or folders (see :func:`discover_results`).

    ``baseline`` chooses the run each group is compared with:

    * ``None``: the measured run with the lowest median TTFT; an emulated or virtual run is never
      chosen this way. A group with no measured run falls back to its first run.
    * a label: the run carrying it. A group without such a run falls back to the default rule;
      a label no run carries, or that two runs of one group carry, is a :class:`ConfigError`.
      A string of digits that is no run's label is read as an index.
    * an index: the run at that position in each group, counting from 0 in the order the report
      lists them.

    ``slo`` (a preset name, ``ttft=MS,tpot=MS`` or an :class:`SLO`) adds goodput to every run.

    Every group gets its break-even section from the results' metadata alone. Its capacity
    section needs the trace itself: one of ``traces`` (each must be the trace of some group, by
    SHA-256, or this raises :class:`ConfigError`), else, with ``recorded_traces``, the path
    recorded in the group's results if the file there still has the trace's SHA-256. Each trace
    is read and its curve computed once.

    ``fallback`` (:data:`FALLBACKS`): a run whose figures are an upper bound (host-bound,
    floor-limited) stays in the tables with its virtual twin beside it (``beside``), or is left
    out, its virtual twin in its place (``virtual``; the group's ``replaced`` says which).
    ``rank``: the labels of the runs the verdict ranks (default: every run); each must be a run's.
    ``cache``: read and keep each trace's capacity curve in the capacity cache (:mod:`.curve_cache`;
    ``KVEMU_NO_CACHE=1`` turns it off too). ``progress(done, total)``: called as a curve is
    computed (in percent), when it is not in the cache.
    """
    if isinstance(paths, (str, bytes, os.PathLike)):  # a str is iterable: its characters are no paths
        raise OptionError("paths", f"takes a list of paths, got the single {type(paths).__name__} {str(paths)[:60]!r}")
    if not paths:
        raise ConfigError("no results files given")
    if slo is not None and not isinstance(slo, (str, SLO)):
        raise OptionError("slo", f"must be a preset name, 'ttft=MS,tpot=MS' or a metrics.SLO, got {type(slo).__name__}")
    if baseline is not None and (isinstance(baseline, bool) or not isinstance(baseline, (str, int))):
        raise OptionError("baseline", f"must be a run's label or index, got {type(baseline).__name__}")
    if rank is not None and (isinstance(rank, (str, bytes)) or not hasattr(rank, "__iter__")
                             or not all(isinstance(x, str) for x in rank)):
        raise OptionError("rank", f"must be a list of run labels, got {str(rank)[:60]!r}")
    if fallback not in FALLBACKS:
        raise ConfigError(f"fallback must be one of {', '.join(FALLBACKS)}, got {fallback!r}")
    if isinstance(slo, str):
        slo = metrics.parse_slo(slo)
    runs, skipped = discover_results(paths)
    runs = _fold_sweep_repetitions(runs)
    # Runs of one workload group together, whatever tier policy their traces were recorded with.
    by_workload: dict[str, list[Run]] = {}
    for run in runs:
        by_workload.setdefault(workload_key(run), []).append(run)
    for members in by_workload.values():
        _unique_labels(members)
    baseline = _normalise_baseline(baseline, runs)
    if rank is not None:
        rank = tuple(rank)
        known = {run.label for run in runs}
        unknown = [label for label in rank if label not in known]
        if unknown or not rank:
            raise ConfigError(f"rank: no run is labelled {', '.join(repr(u) for u in unknown) or 'nothing given'} "
                              f"(labels: {', '.join(sorted(known))})")

    summaries = {id(run): metrics.summarize(run.table, run.duration_s) for run in runs}
    backend_rank: dict[str, int] = {}
    for run in runs:
        backend_rank.setdefault(run.backend_spec, len(backend_rank))

    all_shas = list(dict.fromkeys(run.trace_sha256 for run in runs))
    given = _given_traces(traces, all_shas)
    hashes: dict = {}  # (SHA-256, TraceHeader) of each recorded trace path looked at, by real path
    groups = []
    for members in by_workload.values():
        replaced: list[tuple[str, str]] = []
        if fallback == "virtual":
            twins = virtual_twins([_Of(run) for run in members])
            gone = {i for i, t in twins.items() if members[i].figures.get("upper_bound")}
            replaced = [(members[i].label, twins[i].run.label) for i in sorted(gone)]
            members = [run for i, run in enumerate(members) if i not in gone]
        policy_rank: dict[str, int] = {}
        for run in members:
            policy_rank.setdefault(run.tier_policy, len(policy_rank))
        # by policy, then backend; sorted() is stable: runs of one backend keep their input order.
        members = sorted(members, key=lambda r: (_POLICY_ORDER.get(r.tier_policy, 9), policy_rank[r.tier_policy],
                                                 backend_rank[r.backend_spec]))
        members = _twins_beside(members)
        picks = _choose_baselines(members, [summaries[id(r)] for r in members], baseline)
        chosen, rule = picks["group"]
        rows = tuple(
            _run_row(run, summaries[id(run)], summaries[id(members[picks["of"][i]])], i == picks["of"][i], slo,
                     members[picks["of"][i]].label)
            for i, run in enumerate(members)
        )
        breakeven, breakeven_note = _breakeven(rows)
        capacity, capacity_note = None, ""
        shas = list(dict.fromkeys(r.trace_sha256 for r in members))
        sha = members[chosen].trace_sha256
        given_sha = next((x for x in [sha, *shas] if x in given), None)
        if given_sha is not None:
            capacity = _capacity(str(given[given_sha].path), "--trace", rows[chosen], given[given_sha],
                                 cache=cache, progress=progress)
        elif recorded_traces:
            header, capacity_note = _recorded_trace(sha, [m for m in members if m.trace_sha256 == sha], hashes)
            path = None if header is None else str(header.path)
            if path is not None:
                capacity = _capacity(path, "recorded", rows[chosen], header, cache=cache, progress=progress)
        groups.append(Group(trace_sha256=sha, rows=rows, baseline=rows[chosen], baseline_rule=rule,
                            breakeven=breakeven, breakeven_note=breakeven_note,
                            capacity=capacity, capacity_note=capacity_note, verdict=verdict_of(rows, slo, rank=rank),
                            deployment=deployment_verdict(rows, slo, rank=rank),
                            trace_shas=tuple(shas), replaced=tuple(replaced),
                            cold=cold_windows(rows, sha, capacity)))
    return Report(groups=tuple(groups), slo=slo, skipped=tuple(skipped))


_POLICY_ORDER = {"none": 0, "offload": 1, "resident": 2}

#: What the report does with a run whose figures are an upper bound and that has a virtual twin:
#: show the twin beside it, or in its place (build_report ``fallback``).
FALLBACKS = ("beside", "virtual")


@dataclass(frozen=True, eq=False)
class _Of:
    """A run where verdict.virtual_twins expects a row."""

    run: Run
#: The figures whose spread over repetitions the report shows (Run.spread).
SPREAD_FIGURES = ("median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "median_e2el_ms",
                  "request_throughput", "kv_gbps_load", "kv_gbps_store", "kv_gbps_read", "kv_stall_share")


def _twins_beside(members: list[Run]) -> list[Run]:
    """``members`` with each run's virtual twin moved to just after it (the twin beside its run)."""
    twins = virtual_twins([_Of(run) for run in members])
    moved = {id(t.run) for t in twins.values()}
    out = []
    for i, run in enumerate(members):
        if id(run) in moved:
            continue
        out.append(run)
        if i in twins:
            out.append(twins[i].run)
    return out


def _choose_baselines(runs: list[Run], summaries: list, baseline) -> dict:
    """Each run's baseline (``of``: an index per run) and the group's (``group``: index, rule).
    A baseline given (label or index) is every run's. By default each run is compared with the
    fastest measured run of its own comparison class; the group's baseline is that of the class
    holding the fastest measured run (else the first run's)."""
    if baseline is not None:
        chosen, rule = _choose_baseline(runs, summaries, baseline)
        return {"group": (chosen, rule), "of": [chosen] * len(runs)}
    classes: dict[tuple, list[int]] = {}
    for i, run in enumerate(runs):
        classes.setdefault(comparison_class(run), []).append(i)
    of = [0] * len(runs)
    picked: dict[tuple, tuple[int, str]] = {}
    for key, idx in classes.items():
        k, rule = _choose_baseline([runs[i] for i in idx], [summaries[i] for i in idx], None)
        picked[key] = (idx[k], rule)
        for i in idx:
            of[i] = idx[k]
    ttft = np.array([s["median_ttft_ms"] for s in summaries], dtype=np.float64)
    measured = np.array([r.is_measured for r in runs]) & ~np.isnan(ttft)
    first_key = (comparison_class(runs[int(np.argmin(np.where(measured, ttft, np.inf)))]) if measured.any()
                 else comparison_class(runs[0]))
    chosen, rule = picked[first_key]
    if len(classes) > 1:
        rule += f", of the runs with {class_text(first_key)}; other runs against the same rule within their class"
    return {"group": (chosen, rule), "of": of}


def _fold_sweep_repetitions(runs: list[Run]) -> list[Run]:
    """The repetitions of one sweep cell (same cell key, same trace) as one run: the repetition with
    the median median-TTFT, carrying every repetition's figures (Run.repetitions)."""
    cells: dict[tuple, list[Run]] = {}
    out: list = []
    for run in runs:
        cell = _get(run.meta, "sweep.cell")
        if cell is None or run.repetitions:
            out.append(run)
            continue
        key = (cell, run.trace_sha256)
        if key not in cells:
            cells[key] = []
            out.append(key)
        cells[key].append(run)
    folded = []
    for item in out:
        if isinstance(item, Run):
            folded.append(item)
            continue
        reps = cells[item]
        if len(reps) == 1:
            folded.append(reps[0])
            continue
        figures = [metrics.repetition_figures(r.table, r.meta) for r in reps]
        order = np.argsort([f["median_ttft_ms"] for f in figures], kind="stable")
        chosen = int(order[(len(reps) - 1) // 2])
        run = reps[chosen]
        run.meta["repetitions"] = {"n": len(reps), "chosen": chosen, "runs": figures,
                                   "rule": "the sweep repetition with the median median TTFT",
                                   "paths": [r.path for r in reps]}
        folded.append(run)
    return folded


def _unique_labels(runs: list[Run]) -> None:
    """Labels unique among ``runs`` (those of one workload, which share its tables): the second
    and later runs carrying one get ``#2``, ``#3`` ... in the order read (the label the file
    holds stays in ``label_recorded``). Runs of different workloads keep their labels."""
    seen: dict[str, int] = {}
    taken = {run.label for run in runs}
    for run in runs:
        label = run.label
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            k = seen[label]
            while f"{label}#{k}" in taken:
                k += 1
            run.meta["label_recorded"] = label
            run.meta["label"] = f"{label}#{k}"
            taken.add(run.meta["label"])


def tier_bandwidth(run: Run) -> tuple[float, str | None]:
    """The tier bandwidth a run measured and the KV operation it comes from (:func:`.verdict.tier_gbps`,
    the one rule the break-even table and the verdict read)."""
    return tier_gbps(run)


def _breakeven(rows: Sequence[RunRow]) -> tuple[Breakeven | None, str]:
    """The break-even section of one group, from its results' trace metadata; or None and why."""
    trace = rows[0].run.meta["trace"]
    if not _get(trace, "gpu"):
        return None, ("break-even: not available; the trace has no GPU compute model to price "
                      "recomputation with (a real-run trace measures its compute instead)")
    try:
        timing = analysis.timing_from_meta(trace)
    except KvemuError as exc:
        return None, (f"break-even: not available; the results' trace metadata has no usable "
                      f"model and GPU ({_one_line(exc)})")
    prefixes = tuple(analysis.breakeven_gbps(timing))
    verdicts = []
    for row in rows:
        gbps, op = tier_bandwidth(row.run)
        verdicts.append(TierVerdict(gbps, op, reuse_wins(gbps, prefixes)))
    model = str(trace["model"].get("name", "?"))
    return Breakeven(model, analysis.gpu_figures(trace), prefixes, tuple(verdicts)), ""


def _given_traces(traces: Sequence[str | os.PathLike], shas: Sequence[str]) -> dict:
    """Each trace in ``traces`` (its TraceHeader: the file as opened, hashed and later read through
    one descriptor) by its SHA-256, which must be that of one of the groups."""
    found: dict = {}
    for given in traces:
        path = os.fspath(given)
        h = read_header(path)  # a missing, unreadable or foreign file is a TraceError saying so
        sha = h.sha256()
        if sha not in shas:
            known = ", ".join(s[:SHORT_SHA_LEN] for s in shas)
            raise ConfigError(f"--trace {path}: SHA-256 {sha[:SHORT_SHA_LEN]} is not the trace of "
                              f"any run in the report (their traces: {known})")
        found.setdefault(sha, h)
    return found


def _recorded_trace(sha: str, runs: Sequence[Run],
                    hashes: dict) -> tuple[object, str]:
    """The trace recorded in these runs' results (its TraceHeader, opened once: what is hashed is
    what the capacity section reads), if the file there is still the trace they replayed; else None
    and a one-line note on how to get the capacity section."""
    reasons = []
    for path in dict.fromkeys(str(_get(run.meta, "trace.path") or "") for run in runs):
        if not path:
            continue
        if not os.path.isfile(path):
            reasons.append(f"{path} not found")
            continue
        key = os.path.realpath(path)
        try:
            size = os.path.getsize(path)
            recorded = _get(runs[0].meta, "trace.size_bytes")
            if isinstance(recorded, int) and size != recorded:
                reasons.append(f"{path} has changed since the replay")
                continue
            if size > AUTO_HASH_LIMIT:  # the path comes from a file: what it names is not trusted
                reasons.append(f"{path} is {human_bytes(size)}, more than the {human_bytes(AUTO_HASH_LIMIT)} "
                               f"a report reads unasked")
                continue
            if key not in hashes:
                try:
                    h = read_header(path)
                except TraceError:  # no longer a trace kvemu reads
                    reasons.append(f"{path} has changed since the replay")
                    continue
                hashes[key] = (h.sha256(), h)
        except OSError as exc:
            reasons.append(f"{path} unreadable ({exc.strerror or exc})")
            continue
        if hashes[key][0] == sha:
            return hashes[key][1], ""
        reasons.append(f"{path} has changed since the replay")
    why = reasons[0] if reasons else "the results do not say where the trace is"
    return None, f"capacity curve: needs the trace ({why}); add --trace TRACE"


def _capacity(path: str, found_by: str, baseline: RunRow, header=None, cache: bool = True,
              progress=None) -> Capacity:
    """The capacity section from the trace at ``path`` (read through ``header``, the TraceHeader its
    hash was taken through, when given); the TTFT loads cached prefixes at the tier bandwidth of
    the group's baseline run. The curve and the bandwidth-free parts of the TTFT come from the
    capacity cache (:mod:`.curve_cache`, kept per trace digest) when ``cache`` and it holds them."""
    header = header if header is not None else read_header(path)
    entry = curve_entry(header, cache=cache, progress=progress)
    curve = entry.curve
    gbps, op = tier_bandwidth(baseline.run)
    label = baseline.run.label
    earlier = entry.earlier_hit_tokens
    if not entry.has_gpu:
        return Capacity(path, found_by, curve, None, math.nan,
                        "no modelled TTFT: the trace has no GPU compute model", earlier)
    if op is None:
        return Capacity(path, found_by, curve, None, math.nan,
                        f"no modelled TTFT: the baseline run {label} moved no KV from the tier", earlier)
    ttft = tuple(analysis.ttft_from_parts(curve, entry.compute_ns, entry.load_bytes, gbps))
    note = (f"TTFT modelled for prefill alone (no queueing), cached prefixes loaded at "
            f"{gbps:.2f} GB/s (the {op} GB/s of the baseline run {label})")
    return Capacity(path, found_by, curve, ttft, gbps, note, earlier)


@dataclass(frozen=True)
class ColdWindow:
    """A run that replayed a window of its trace (not every request) with nothing cached before
    it: the share of its prompt tokens it reused, and the share every earlier request of the trace
    would have let it reuse (an unbounded prefix cache, full blocks), against the whole trace's."""

    label: str
    requests: int          # requests the run replayed
    first: int             # its first and last request of the trace
    last: int
    trace_requests: int
    reused_share: float    # what the run reused (HBM and tier)
    earlier_share: float   # what every earlier request of the trace would let it reuse
    trace_share: float     # the whole trace's unbounded prefix-hit ratio

    @property
    def sentence(self) -> str:
        span = (f"requests {self.first:,}-{self.last:,}" if self.last - self.first + 1 == self.requests
                else f"{self.requests:,} requests between {self.first:,} and {self.last:,}")
        head = f"{self.label} replays {span} of the trace's {self.trace_requests:,} and starts cold: "
        tail = f"the whole trace: {100 * self.trace_share:.0f} %; an unbounded prefix cache, full blocks"
        if self.first == 0:  # nothing comes before it: its own earlier requests are all it can reuse
            return (head + f"at most {100 * self.earlier_share:.0f} % of its prompt tokens can be reused, from its "
                           f"own earlier requests (it reused {100 * self.reused_share:.0f} %; {tail})")
        return (head + f"it reused {100 * self.reused_share:.0f} % of its prompt tokens, where the trace's earlier "
                       f"requests, cached, would let it reuse {100 * self.earlier_share:.0f} % ({tail})")

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "sentence": self.sentence}


def cold_windows(rows: Sequence[RunRow], sha: str, capacity: Capacity | None) -> tuple[ColdWindow, ...]:
    """The runs of trace ``sha`` among ``rows`` that replayed a window of it starting cold, with
    what the earlier requests would have let them reuse (:class:`ColdWindow`); none without the
    trace's capacity section. A window starts cold when it starts at the trace's first request, or
    later without its history replayed first (a closed-loop replay of ``--requests`` runs every
    earlier request first) and no warm-up recorded in its results."""
    earlier = None if capacity is None else capacity.earlier_hit_tokens
    if earlier is None or len(earlier) == 0:
        return ()
    out = []
    for row in rows:
        run = row.run
        if run.trace_sha256 != sha or "request_id" not in run.table.column_names:
            continue
        if _get(run.meta, "params.warmup") or _get(run.meta, "params.reductions.warmup"):
            continue
        ids = np.unique(run.table["request_id"].to_numpy(zero_copy_only=False).astype(np.int64))
        if len(ids) == 0 or len(ids) >= len(earlier) or ids[0] < 0 or ids[-1] >= len(earlier):
            continue
        if ids[0] > 0 and _get(run.meta, "schedule.ran") == "closed" and _get(run.meta, "params.reductions.requests"):
            continue  # the closed loop ran every earlier request first: the window starts warm
        inp = float(np.asarray(run.table["input_tokens"].to_numpy(zero_copy_only=False), np.float64).sum())
        cached = float(np.asarray(run.table["cached_tokens"].to_numpy(zero_copy_only=False), np.float64).sum())
        if inp <= 0:
            continue
        out.append(ColdWindow(run.label, len(ids), int(ids[0]), int(ids[-1]), len(earlier), cached / inp,
                              float(earlier[ids].sum()) / inp, float(capacity.curve["unbounded_hit_ratio"])))
    return tuple(out)


def curve_params() -> dict:
    """What besides the trace the report's capacity curve depends on (the cache key's other half)."""
    return {"points": CAPACITY_POINTS, "kvemu": __version__}


def curve_entry(header, cache: bool = True, progress=None) -> curve_cache.Entry:
    """The capacity curve of the trace read through ``header`` and the bandwidth-free parts of its
    modelled TTFT: from the cache when it holds a sound entry for the trace's digest, else computed
    (``progress(done, total)`` in percent as it goes) and, with ``cache``, kept for the next report."""
    use = curve_cache.enabled(cache)
    sha, params = header.sha256(), curve_params()
    if use:
        entry = curve_cache.load(sha, params)
        if entry is not None:
            return entry
    tick = progress or (lambda done, total: None)
    tick(0, 100)
    trace = read_trace(header)
    tick(20, 100)
    # one stack-distance pass, over the tables' runs, for the curve, the TTFT parts and the ratio
    thresholds = analysis.prefix_threshold_runs(trace)
    curve = analysis.capacity_curve(trace, points=CAPACITY_POINTS, thresholds=thresholds)
    tick(40, 100)
    has_gpu = bool(trace.header.meta.get("gpu"))
    if has_gpu:
        compute, loaded = analysis.capacity_ttft_parts(
            trace, curve, thresholds, progress=lambda d, t: tick(40 + 60 * d // max(t, 1), 100))
    else:
        compute = loaded = np.zeros((0, 0), np.int64)
    earlier = analysis.prefix_hit_tokens_unbounded(trace, thresholds=thresholds)
    tick(100, 100)
    entry = curve_cache.Entry(sha, params, curve, has_gpu, compute, loaded, earlier)
    if use:
        curve_cache.store(entry)
    return entry


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
    eligible = np.array([r.is_measured for r in runs]) & ~np.isnan(ttft)
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
    baseline_label: str = "",
) -> RunRow:
    shares = metrics.breakdown_shares(summary)
    shares["kv_stall"] = run.kv_stall_share
    ratio, delta = {}, {}
    for name, key, _ in COMPARED:
        value, reference = summary[key], base[key]
        delta[name] = value - reference
        ratio[name] = value / reference if reference > 0 else math.nan
    if slo is None:
        good, p99_met, attained, split = None, None, None, None
    else:
        good = metrics.goodput(run.table, slo.ttft_ms, slo.tpot_ms, run.duration_s)
        p99_met = metrics.slo_p99_met(summary, slo)
        attained = metrics.slo_attainment(run.table, slo.ttft_ms, slo.tpot_ms)
        split = metrics.goodput_split(run.table, slo.ttft_ms, slo.tpot_ms, run.duration_s)
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
        baseline_label=baseline_label,
        slo_attainment=attained,
        goodput_split=split,
    )


def reductions_of(run: Run) -> dict[str, Any]:
    """What a run replayed of its trace, and how: layers, request window, schedule, time scale."""
    red = _get(run.meta, "params.reductions") or {}
    layers = red.get("layers") or {}
    sched = run.meta.get("schedule") or {}
    return {"layers": len(layers.get("replayed") or []) or None, "of_layers": layers.get("of"),
            "requests": red.get("requests"), "arrival_ms": red.get("arrival_ms"), "warmup": red.get("warmup") or 0.0,
            "selected_requests": red.get("selected_requests"), "schedule": sched.get("ran", "recorded"),
            "time_scale": sched.get("time_scale", 1.0), "instances": _get(run.meta, "params.instances") or 1}


def reductions_text(run: Run) -> str:
    """The reductions as a short cell: ``2/80 layers, requests 0:50, closed, x5``."""
    r = reductions_of(run)
    parts = []
    if r["layers"] and r["of_layers"] and r["layers"] != r["of_layers"]:
        parts.append(f"{r['layers']}/{r['of_layers']} layers")
    if r["requests"]:
        parts.append(f"requests {r['requests'][0]}:{r['requests'][1]}")
    if r["arrival_ms"]:
        parts.append(f"arrivals {r['arrival_ms'][0]:g}:{r['arrival_ms'][1]:g} ms")
    if r["warmup"]:
        parts.append(f"warm-up {r['warmup']:g} uncounted")
    parts.append(str(r["schedule"]))
    if r["time_scale"] not in (None, 1.0):
        parts.append(f"time x{r['time_scale']:g}")
    if r["instances"] and r["instances"] > 1:
        parts.append(f"{r['instances']} instances")
    return ", ".join(parts)


def run_record(row: RunRow, group: Group, slo: SLO | None = None) -> dict[str, Any]:
    """One run as a JSON-ready mapping: identity, vLLM's keys, KV and breakdown, comparison.

    Nested mappings (``figures``, ``breakdown``, ``ratio_vs_baseline``,
    ``delta_vs_baseline_ms``) stay nested; flat outputs join the keys with ``_``. NaN stays NaN
    here; each renderer spells it.
    """
    run = row.run
    record: dict[str, Any] = {
        "label": run.label,
        "backend": run.backend_spec,
        "backend_name": run.backend_name,
        "mode": run.mode,
        "figures": dict(run.figures),
        "reductions": reductions_of(run),
        "path": run.path,
        "run_id": run.run_id,
        "trace_sha256": run.trace_sha256,
        "workload": run.workload_kind,
        "tier_policy": run.tier_policy,
        "model": run.model_name,
        "is_baseline": row.is_baseline,
        "baseline_label": row.baseline_label or group.baseline.run.label,
        "comparison_class": class_text(comparison_class(run)),
        "repetitions": len(run.repetitions) or 1,
        # min and max of every figure a repetition records (flat, so that CSV keeps them)
        "spread": ({f"{fig}_{end}": v for fig in SPREAD_FIGURES if run.spread(fig)
                    for end, v in zip(("min", "max"), run.spread(fig))} if run.repetitions else None),
        **row.summary,
    }
    if slo is not None:
        record["slo"] = slo.name
        record["slo_ttft_ms"] = slo.ttft_ms
        record["slo_tpot_ms"] = slo.tpot_ms
        record["request_goodput"] = row.goodput
        record["slo_p99_met"] = row.slo_p99_met
        # DistServe's split: the objectives one by one, then both (= request_goodput)
        for part in ("ttft", "tpot", "both"):
            record[f"request_goodput_{part}"] = row.goodput_split[part]
            record[f"good_{part}_requests"] = row.slo_attainment[part]
    for op in KV_OPS:
        record[f"kv_gbps_{op}"] = row.kv[op]["gbps"]
    for op in KV_OPS:
        for p in KV_OP_PERCENTILES:
            record[f"kv_{p}_ns_{op}"] = row.kv[op][f"{p}_ns"]
    record["weights"] = weights_record(row, group)
    record["cost"] = cost_record(run)
    if is_disaggregated(group):  # only where P/D is part of the comparison: other reports stay as they were
        record["deployment"] = deployment_record(row)
    record["stack"] = stack_record(run)
    record["breakdown"] = dict(row.shares)
    record["dedup_ratio"] = run.dedup_ratio
    record["ratio_vs_baseline"] = dict(row.ratio)
    record["delta_vs_baseline_ms"] = dict(row.delta_ms)
    verdict = (group.breakeven.verdicts[group.rows.index(row)] if group.breakeven is not None
               else None)
    record["breakeven"] = {
        "tier_gbps": verdict.gbps if verdict else math.nan,
        "tier_op": verdict.op if verdict else None,
        "reuse_wins_from_tokens": verdict.wins_from_tokens if verdict else None,
    }
    return record


def is_disaggregated(group: Group) -> bool:
    """Whether a run of the group ran with prefill and decode instances apart."""
    return any(row.run.disagg is not None for row in group.rows)


def gpu_busy(run: Run, pool: str) -> float:
    """The share of time the GPUs of a pool (``prefill`` or ``decode``) were busy, from
    ``schedule.disagg.gpu_busy.<pool>``: a share (0..1), per-instance shares (their mean), or a
    mapping with ``share``; NaN when absent."""
    v = _get(run.disagg or {}, f"gpu_busy.{pool}")
    if isinstance(v, Mapping):
        v = v.get("share")
    if isinstance(v, (list, tuple)):
        vals = [x for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)]
        v = sum(vals) / len(vals) if vals else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


#: The keys of a run's ``deployment`` record, flat (the TTFT split, hand-off and TPOT per decode instance
#: are mappings beside them).
DEPLOYMENT_KEYS = ("kind", "total_gpus", "gpus_per_instance", "prefill_instances", "decode_instances",
                   "transfer_path", "transfer_spec", "transfer_link", "transfer_mode", "transfer_bound", "pipelining",
                   "routing", "conditional_threshold", "local_requests", "gpu_busy_prefill", "gpu_busy_decode",
                   "handoff_share_of_ttft")


def _count(value: Any) -> int | None:
    """A count read from a results file: an int 0 or more, else None (shown as ``-``)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _str(value: Any) -> str | None:
    """Text read from a results file (None stays None)."""
    return None if value is None else str(value)


def _routing_text(routing: Any) -> str | None:
    """Each side's router as text: ``prefill round-robin, decode least-loaded``."""
    if isinstance(routing, Mapping):  # the prefill side first, whatever order the file keeps
        sides = sorted(routing, key=lambda side: (side != "prefill", side != "decode", str(side)))
        return ", ".join(f"{side} {routing[side]}" for side in sides)
    return None if routing is None else str(routing)


def deployment_record(row: RunRow) -> dict[str, Any]:
    """A run's deployment in a report holding a disaggregated run: how many GPUs in all, prefill
    and decode instances, the transfer path, GPU busy per pool, the TTFT split (each part's p50,
    p99, mean and share), the hand-off (bytes, time, overlap share, blocks the pool held) and TPOT
    per decode instance. A colocated run has its kind and GPUs, the rest None."""
    run = row.run
    d = run.disagg
    rec: dict[str, Any] = dict.fromkeys(DEPLOYMENT_KEYS)
    rec.update(kind=run.deployment, total_gpus=run.total_gpus, gpus_per_instance=run.gpus_per_instance)
    split = metrics.ttft_split(run.table) if d is not None else None
    handoff = metrics.handoff_summary(run.table) if d is not None else None
    if d is not None:
        t = d.get("transfer") if isinstance(d.get("transfer"), Mapping) else {}
        rec.update(prefill_instances=_count(d.get("prefill_instances")),
                   decode_instances=_count(d.get("decode_instances")),
                   transfer_path=_str(t.get("path")), transfer_spec=_str(t.get("spec")), transfer_mode=_str(t.get("mode")),
                   transfer_bound=_str(t.get("bound")), pipelining=_str(t.get("pipelining")),
                   routing=_routing_text(d.get("routing")), local_requests=_count(d.get("local_requests")),
                   transfer_link=_str(t.get("link")),
                   conditional_threshold=_count(d.get("conditional_threshold")),
                   gpu_busy_prefill=gpu_busy(run, "prefill"), gpu_busy_decode=gpu_busy(run, "decode"),
                   handoff_share_of_ttft=split["handoff"]["share"] if split else None)
    rec["ttft_split"] = ({f"{p}_{k}": v for p, stats in split.items() for k, v in stats.items()} if split
                         else None)
    rec["handoff"] = handoff
    by = metrics.tpot_by_instance(run.table) if d is not None else []
    rec["tpot_by_decode_instance"] = ({str(e["instance"]): {k: v for k, v in e.items() if k != "instance"}
                                       for e in by} or None)
    return rec


COST_KEYS = ("usd_per_million_output_tokens", "joules_per_request", "usd_per_request", "gpu_hours", "total_usd",
             "energy_joules", "amortise_years", "priced_as", "figures", "prices_path", "prices_sha256",
             "capacity_bytes", "capacity_usd_per_million_output_tokens", "wear_usd_per_million_output_tokens")


def cost_record(run) -> dict[str, Any]:
    """A run's cost figures from its results' ``cost`` section (docs/replay.md, "Cost and energy"),
    the price table they came from included; every key None for results without one (older
    replays): blank, never zero."""
    c = run.meta.get("cost")
    if not isinstance(c, Mapping):
        return dict.fromkeys(COST_KEYS)  # the same keys in every run: CSV has one header
    prices = c.get("prices") or {}
    inputs = c.get("inputs") or {}
    return {**{k: c.get(k) for k in COST_KEYS[:6]}, "amortise_years": inputs.get("amortise_years"),
            "priced_as": c.get("priced_as"), "figures": c.get("figures"), "prices_path": prices.get("path"),
            "prices_sha256": prices.get("sha256"), **{k: c.get(k) for k in COST_KEYS[11:]}}


def stack_record(run) -> dict[str, Any] | None:
    """A tier stack's run (``--tiers``): its label and placement and, per level top first, what the
    results' ``schedule.stack`` says of it (capacity, policy, tokens served and their share, bytes
    loaded and written, time, bound) with its cost from the results' ``cost`` (the level's amortised
    capacity in $, and per million output tokens; its energy in J). None for a run on one tier.
    The top level's bound, which the stack leaves to the replay's backend, is the run's own: the
    link or the medium, whichever took longer over its transfers (``datapath.ops``), ``host`` when
    the run's figures are an upper bound."""
    st = _get(run.meta, "schedule.stack")
    if not isinstance(st, Mapping) or not st.get("levels"):
        return None
    cost = run.meta.get("cost") if isinstance(run.meta.get("cost"), Mapping) else {}
    priced = list(cost.get("levels") or [])
    out_tokens = (cost.get("inputs") or {}).get("output_tokens")
    levels = []
    for k, lv in enumerate(st["levels"]):
        c = priced[k] if k < len(priced) and len(priced) == len(st["levels"]) else {}
        usd = c.get("usd")
        bound = lv.get("bound")
        if k == 0 and bound is None:
            bound = _top_bound(run)
        levels.append({
            "level": lv["level"], "backend": lv["backend"], "mode": lv.get("mode"),
            "capacity_bytes": lv["capacity_bytes"], "policy": lv["policy"], "sharing": lv.get("sharing"),
            "served_tokens": lv["served_tokens"], "hit_share": lv.get("hit_share"),
            "bytes_loaded": lv["bytes_loaded"], "bytes_written": lv["bytes_written"],
            "time_ms": lv["time_ns"] / 1e6, "gbps": lv.get("gbps"), "bound": bound,
            "footprint_bytes": lv.get("footprint_bytes"), "priced_as": c.get("medium"),
            "usd": usd, "usd_per_million_output_tokens": c.get("usd_per_million_output_tokens",
                                                               usd * 1e6 / out_tokens if usd is not None and out_tokens
                                                               else None),
            "wear_usd_per_million_output_tokens": c.get("wear_usd_per_million_output_tokens"),
            "joules": c.get("joules")})
    return {"label": st.get("label"), "placement": st.get("placement"), "levels": levels}


@dataclass(frozen=True, eq=False)
class StackSweep:
    """Stack runs of one workload that differ only in one level's capacity (:func:`stack_sweeps`),
    in order of that capacity: per point the run, the share of the selected requests' prompt tokens
    each level served (``level_shares``, top first), hit in HBM and recomputed, the modelled $ per
    million output tokens (None unpriced) and the median TTFT."""

    level: int                     # the swept level, 1 = top
    backend: str                   # its backend
    fixed: str                     # the other levels: ``L1 dram 256.0 GiB + L3 vemu:nvme 8.0 TiB``
    kind: str                      # the runs' figures kind (one kind per sweep)
    labels: tuple[str, ...]
    capacity_bytes: tuple[int, ...]
    level_names: tuple[str, ...]   # ``L1 dram``, ``L2 vemu:cxl-pool`` ...
    level_shares: tuple[tuple[float, ...], ...]
    hbm_share: tuple[float, ...]
    recomputed_share: tuple[float, ...]
    usd_per_million_output_tokens: tuple[float | None, ...]
    median_ttft_ms: tuple[float, ...]

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()} | {
            "level_shares": [list(x) for x in self.level_shares]}


def stack_share_of_prompts(run) -> tuple[list[float], float, float]:
    """Per level, its share of the selected requests' prompt tokens (the stack's tier hits split as
    the levels' ``hit_share`` over the whole replay), and the HBM-hit and recomputed shares."""
    cols = run.table.column_names
    total = float(np.asarray(run.table["input_tokens"]).sum())
    col = (lambda name: float(np.asarray(run.table[name]).sum()) if name in cols else math.nan)  # noqa: E731
    tier, hbm, recomputed = col("tier_hit_tokens"), col("hbm_hit_tokens"), col("recomputed_tokens")
    levels = _get(run.meta, "schedule.stack.levels") or []
    shares = [(lv.get("hit_share") or 0.0) * tier / total if total else math.nan for lv in levels]
    return shares, (hbm / total if total else math.nan), (recomputed / total if total else math.nan)


def stack_sweeps(group: Group) -> tuple[StackSweep, ...]:
    """The sweeps among a group's stack runs: runs alike in everything (comparison class, tier
    policy, kind of figures, placement, and every level's backend, policy, sharing and link) but
    one level's capacity, at two capacities or more; the first run at each capacity stands for it."""
    stacks = [(row, _get(row.run.meta, "schedule.stack")) for row in group.rows]
    stacks = [(row, st) for row, st in stacks if isinstance(st, Mapping) and st.get("levels")]
    out = []
    for k in range(max((len(st["levels"]) for _, st in stacks), default=0)):
        buckets: dict[str, list] = {}
        for row, st in stacks:
            lvs = st["levels"]
            if k >= len(lvs):
                continue
            key = json.dumps([comparison_class(row.run), row.run.tier_policy, row.run.kind, st.get("placement"),
                              st.get("promote"), st.get("selective_hits"),
                              [[lv["backend"], lv["policy"], lv.get("sharing"), lv.get("link"),
                                None if j == k else lv["capacity_bytes"]] for j, lv in enumerate(lvs)]],
                             default=str)
            buckets.setdefault(key, []).append((int(lvs[k]["capacity_bytes"]), row, st))
        for points in buckets.values():
            by_cap: dict[int, tuple] = {}
            for cap, row, st in points:
                by_cap.setdefault(cap, (row, st))
            if len(by_cap) < 2:
                continue
            caps = sorted(by_cap)
            st0 = by_cap[caps[0]][1]
            names = tuple(f"L{j + 1} {lv['backend']}" for j, lv in enumerate(st0["levels"]))
            fixed = " + ".join(f"{names[j]} {human_bytes(lv['capacity_bytes'])}"
                               for j, lv in enumerate(st0["levels"]) if j != k)
            shares, hbm, recomputed, usd, ttft = [], [], [], [], []
            for cap in caps:
                row = by_cap[cap][0]
                sh, h, r = stack_share_of_prompts(row.run)
                shares.append(tuple(sh))
                hbm.append(h)
                recomputed.append(r)
                usd.append(cost_record(row.run)["usd_per_million_output_tokens"])
                ttft.append(float(row.summary.get("median_ttft_ms", math.nan)))
            out.append(StackSweep(k + 1, st0["levels"][k]["backend"], fixed, by_cap[caps[0]][0].run.kind,
                                  tuple(by_cap[c][0].run.label for c in caps), tuple(caps), names, tuple(shares),
                                  tuple(hbm), tuple(recomputed), tuple(usd), tuple(ttft)))
    return tuple(out)


def _top_bound(run) -> str | None:
    ops = _get(run.meta, "datapath.ops") or {}
    if not any((ops.get(op) or {}).get("bytes", 0) for op in ("load", "store", "read")):
        return None
    if run.figures.get("upper_bound"):
        return "host"
    link = sum((ops.get(op) or {}).get("link_ns", 0) for op in ("load", "store", "read"))
    medium = sum((ops.get(op) or {}).get("medium_ns", 0) for op in ("load", "store", "read"))
    return "link" if link > medium else "medium"


WEIGHTS_KEYS = ("placement", "fraction", "placed_bytes", "stream", "bytes", "time_ns", "gbps", "mean_ms_per_step",
                "figures", "without_label", "tpot_cost_ms", "tpot_ratio")


def weights_record(row: RunRow, group: Group) -> dict[str, Any] | None:
    """A run with weights in the tier (results ``weights``, docs/weights-in-tier.md): what its weight stream
    moved and took, and its TPOT cost against the run of its group on the same backend and tier
    policy without weights in the tier (None when the report holds no such run). A run without weights
    in the tier has every key None."""
    w = row.run.meta.get("weights")
    if not w:
        return dict.fromkeys(WEIGHTS_KEYS)  # the same keys in every run: CSV has one header
    rep = w.get("replay", {})
    base = next((r for r in group.rows if not r.run.meta.get("weights") and r.run.backend_spec == row.run.backend_spec
                 and r.run.tier_policy == row.run.tier_policy), None)
    tpot, base_tpot = row.summary.get("mean_tpot_ms", math.nan), math.nan
    if base is not None:
        base_tpot = base.summary.get("mean_tpot_ms", math.nan)
    return {"placement": w.get("placement"), "fraction": w.get("fraction"), "placed_bytes": w.get("placed_bytes"),
            "stream": rep.get("composition"), "bytes": rep.get("bytes"), "time_ns": rep.get("time_ns"),
            "gbps": rep.get("gbps"), "mean_ms_per_step": (rep["mean_ns_per_step"] / 1e6
                                                          if rep.get("mean_ns_per_step") is not None else None),
            "figures": rep.get("figures"),
            "without_label": base.run.label if base is not None else None,
            "tpot_cost_ms": tpot - base_tpot if base is not None else None,
            "tpot_ratio": tpot / base_tpot if base is not None and base_tpot else None}


def report_records(report: Report) -> list[dict[str, Any]]:
    """:func:`run_record` of every run, group by group."""
    return [run_record(row, group, report.slo) for group in report.groups for row in group.rows]


def trace_record(group: Group) -> dict[str, Any]:
    """One group's trace-level sections as a JSON-ready mapping: ``breakeven`` (per prefix
    length, and per run its tier GB/s and verdicts) and ``capacity`` (the curve, its saturation
    point and the modelled TTFT), each None with a ``*_note`` saying why."""
    be, cap = group.breakeven, group.capacity
    breakeven = None
    if be is not None:
        breakeven = {
            "model": be.model,
            "gpu": dict(be.gpu),
            "prefixes": [dict(p) for p in be.prefixes],
            "runs": [
                {"label": row.run.label, "tier_gbps": v.gbps, "tier_op": v.op,
                 "reuse_wins": {str(p): w for p, w in v.wins.items()},
                 "reuse_wins_from_tokens": v.wins_from_tokens}
                for row, v in zip(group.rows, be.verdicts)
            ],
        }
    capacity = None
    if cap is not None:
        capacity = {
            "trace_path": cap.trace_path,
            "found_by": cap.found_by,
            **cap.curve,
            "saturation_bytes": (None if cap.saturation_index is None
                                 else cap.curve["capacity_bytes"][cap.saturation_index]),
            "load_gbps": cap.load_gbps,
            "ttft": [dict(t) for t in cap.ttft] if cap.ttft is not None else None,
            "ttft_note": cap.ttft_note,
        }
    extra = ({"deployment_verdict": group.deployment.as_dict() if group.deployment is not None else None}
             if is_disaggregated(group) else {})
    return {
        "verdict": group.verdict.as_dict() if group.verdict is not None else None,
        **extra,
        "stack_sweeps": [sw.as_dict() for sw in stack_sweeps(group)],
        "replaced": [{"label": gone, "virtual_twin": twin} for gone, twin in group.replaced],
        "trace_shas": list(group.trace_shas or (group.trace_sha256,)),
        "policies": group.policies,
        "workload": group.trace.workload_kind,
        "tier_policy": group.trace.tier_policy,
        "model": group.trace.model_name,
        "baseline_label": group.baseline.run.label,
        "breakeven": breakeven,
        "breakeven_note": group.breakeven_note or None,
        "capacity": capacity,
        "capacity_note": group.capacity_note or None,
        "cold_windows": [c.as_dict() for c in group.cold],
    }

