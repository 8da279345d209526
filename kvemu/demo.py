"""`kvemu demo`: memory pool or storage for the KV cache, answered on a small built-in workload in
under a minute, the answer first.

It records one long-context multi-turn chat workload (eight interleaved sessions of five turns,
prompts growing to ~10k tokens, below saturation on one H100) twice: HBM only, and with
write-through offload to a tier behind an HBM that holds about two sessions, so that a
returning session's history comes back from the tier. It replays the offload trace on every
tier, each three times (:data:`REPEAT`): host DRAM and a file on the demo folder's disk through
io_uring with O_DIRECT, **measured** on this host; a CXL memory pool, RDMA storage and an NVMe SSD
in **virtual time** from their published profiles (docs/tier-profiles.md), because this host
has none of them and an emulation that waits to a profile is bounded by this host's own memory
on a small machine (docs/backends.md). A tier this machine cannot run (io_uring refused, a file
system without O_DIRECT) is skipped with a note.

The verdicts are the report's (:func:`kvemu.report.build_report`, its groups' ``verdict``), one
over the virtual tiers — the pool against the storage tiers, figures of one kind — and one over
the measured tiers; measured figures are never ranked against virtual ones. :class:`Demo`
carries them, the first screen (:meth:`Demo.screen`) and the full report.

Then the same trace on tier stacks below HBM (``replay --tiers``, all levels in virtual time, once
each: virtual time has no spread): host DRAM then NVMe, and host DRAM, a CXL pool and NVMe with
the pool swept over :data:`POOL_SIZES` — where the pool stops paying against storage: the smallest
pool beyond which a larger one takes no more reuse off NVMe and no more off the median TTFT, while
its capacity keeps adding to the cost per million output tokens (modelled from the price table).

Last, prefill/decode disaggregation (docs/replay.md): the same chat workload on a 70B-class model
(:data:`PD_MODEL`, 4 H100s per instance), recorded with its deployment (2 prefill + 2 decode
instances, ``record --prefill-instances``), replayed in virtual time as recorded (the hand-off over
RDMA), through the CXL pool (``--transfer pool``) and colocated on the same 16 GPUs
(``--colocated --instances 4``); the first screen gives the hand-off's share of TTFT.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .backend_spec import BackendSpec
from .errors import BackendUnavailable, OutputError
from .progress import Phases
from .record_options import DeploymentOptions, EngineOptions, RecordOptions, RecordOutputOptions
from .recording import record
from .replay import OutputOptions, ReplayOptions, TierOptions, WindowOptions, replay
from .report import Report, build_report, render_html
from .report.compare import deployment_record, stack_share_of_prompts
from .report.tables import _share_text, handoff_line, ms, spread
from .report.verdict import SAME_WITHIN
from .stackspec import parse_tiers

# Multi-turn conversations with long contexts (a 2k-token system prompt, 1.5k-token messages, five
# turns: prompts grow to ~10k tokens): eight sessions interleave, an HBM of 2 GiB holds about two of
# them, so a returning session's history comes back from the tier (a quarter of all prompt tokens,
# 8.9 GiB of loads), at GPU busy ~38 % (below saturation).
WORKLOAD = "synthetic:chat:sessions=8,turns=5,system_tokens=2048,user_tokens=1500,output_tokens=100,rate=0.5,think_s=12"
MODEL = "llama3-8b"
HBM_KV_GIB = 2.0
REPLAY_LAYERS = 2  # of 32; each replayed layer stands for 16 (results say so)
REPEAT = 3  # every tier replayed three times: the measured ones show their spread, virtual time none

# The tier stacks (virtual levels, replayed once each): DRAM below HBM, then NVMe, with a CXL pool
# between them swept from none to more than the workload's distinct KV (10 GiB), so that the point
# where it stops paying lies inside the sweep.
STACK_DRAM = "1GiB"
STACK_NVME = "16GiB"
POOL_SIZES = ("1GiB", "2GiB", "4GiB", "8GiB", "16GiB")

# Prefill/decode disaggregation: the chat workload on a 70B-class model, whose instances are 4 H100s
# each (the recording's default parallelism), 2 prefill + 2 decode against 4 colocated instances.
PD_MODEL = "llama3-70b"
PD_PREFILL, PD_DECODE = 2, 2

# The plan for the demo's workload (kvemu plan, docs/analysis.md "Planner"): a small grid, so the demo
# stays quick; the SLO a latency target a chat service might state.
PLAN_SLO = "ttft_p90=200ms"
PLAN_LEVELS = ("local-dram=0,1GiB", "cxl-pool=0,2GiB,4GiB,8GiB", "nvme=0,16GiB")
PLAN_REPLAY = 2


@dataclass(frozen=True)
class Deployment:
    """One disaggregation run of the demo: its label, what it is, and replay's flags for it."""

    label: str
    name: str
    flags: tuple[str, ...]

    @property
    def results_name(self) -> str:
        return f"results-{self.label}.parquet"


def demo_deployments() -> list[Deployment]:
    """The deployments, the recorded one (RDMA) first, on the same GPUs in total."""
    n = PD_PREFILL + PD_DECODE
    return [Deployment(f"pd{PD_PREFILL}x{PD_DECODE}-rdma", "disaggregated, KV over RDMA (as recorded)", ()),
            Deployment(f"pd{PD_PREFILL}x{PD_DECODE}-pool", "disaggregated, KV through the CXL pool",
                       ("--transfer", "pool")),
            Deployment(f"colocated-{n}x", f"colocated, {n} instances", ("--colocated", "--instances", str(n)))]


@dataclass
class DeploymentRow:
    """A deployment's figures on the first screen (from its results, virtual time)."""

    deployment: Deployment
    ttft_p50: float
    tpot_mean: float
    handoff_share: float | None   # the hand-off's share of TTFT; None colocated
    results: Path
    command: str


@dataclass(frozen=True)
class Tier:
    """One row of the demo: what the first screen calls the tier, the trace policy and backend it is
    replayed with, and its role in the question (``hbm``, ``dram``, ``pool``, ``storage``)."""

    name: str
    policy: str
    spec: str
    role: str

    @property
    def label(self) -> str:
        """The results' label: ``SPEC/POLICY`` as replay gives it, less a tier file's path."""
        return f"{_short(self.spec)}/{self.policy}"

    @property
    def results_name(self) -> str:
        return "results-" + self.label.replace("/", "-").replace(":", "-") + ".parquet"


def demo_tiers(folder: Path) -> list[Tier]:
    """Every row of the demo, in the order the first screen lists them."""
    return [
        Tier("HBM only (prefixes recomputed)", "none", "vemu:hbm", "hbm"),
        Tier("host DRAM", "offload", "dram", "dram"),
        Tier("this host's disk (io_uring file)", "offload", f"uring:{folder / 'tier.bin'},qd=32", "storage"),
        Tier("CXL memory pool (one expander)", "offload", "vemu:cxl-pool", "pool"),
        Tier("RDMA storage (Mooncake-style)", "offload", "vemu:rdma-storage", "storage"),
        Tier("NVMe SSD", "offload", "vemu:nvme", "storage"),
    ]


@dataclass(frozen=True)
class Stack:
    """One tier stack of the demo: its ``--tiers`` text and the pool's capacity (None: no pool)."""

    tiers: str
    pool: str | None

    @property
    def name(self) -> str:
        pool = f" + CXL pool {_gib(self.pool)}" if self.pool else ""
        return f"DRAM {_gib(STACK_DRAM)}{pool} + NVMe {_gib(STACK_NVME)}"

    @property
    def results_name(self) -> str:
        return f"results-stack-pool-{self.pool or '0'}.parquet"


def _gib(size: str) -> str:
    return size.replace("GiB", " GiB")


def demo_stacks() -> list[Stack]:
    """The stacks, the one without a pool first, then the pool sizes in order."""
    top, bottom = f"vemu:local-dram|cap={STACK_DRAM}", f"vemu:nvme|cap={STACK_NVME}"
    return [Stack(f"{top};{bottom}", None)] + [Stack(f"{top};vemu:cxl-pool|cap={p};{bottom}", p) for p in POOL_SIZES]


@dataclass
class StackRow:
    """A stack's figures on the first screen: the share of prompt tokens the pool and NVMe served
    and recomputed (the report's stack figures), median TTFT, modelled $ per million output tokens."""

    stack: Stack
    pool_share: float | None   # None: no pool
    nvme_share: float
    recomputed_share: float
    ttft_p50: float
    usd_per_million: float | None
    results: Path
    command: str


@dataclass
class Row:
    """A tier's figures on the first screen, from its results."""

    tier: Tier
    kind: str                 # measured / virtual (the results' figures.kind)
    figures: str              # the results' figures label, and the host's load when it moved them
    ttft_p50: float
    ttft_p50_spread: tuple[float, float] | None
    ttft_p99: float
    e2el_p50: float           # a request's completion time, arrival to last token
    gpu_busy: float | None    # the steps' time over first arrival to last completion
    kv_stall: float | None    # KV work's share of the steps' time
    moved_bytes: int
    results: Path
    command: str              # the one command that reproduces its figures
    # a storage profile's software generation and its software share of the KV time (modelled), or None
    software: tuple[str, float | None] | None = None


@dataclass
class Demo:
    folder: Path
    rows: list[Row]
    skipped: list[tuple[Tier, str]]
    virtual_verdict: object | None   # report.verdict.Verdict over the pool and storage tiers in virtual time
    measured_verdict: object | None  # the same over the tiers measured here
    report: Report                   # every run, as `kvemu report DIR` gives it
    html: Path
    record_commands: list[str] = field(default_factory=list)
    stacks: list[StackRow] = field(default_factory=list)
    deployments: list[DeploymentRow] = field(default_factory=list)
    handoff_line: str | None = None  # the report's hand-off share of TTFT over the deployments
    plan: dict | None = None  # kvemu.plan.plan's answer for the demo's workload
    plan_command: str | None = None

    def plan_lines(self) -> list[str]:
        """The plan in one line, and the command behind it."""
        if self.plan is None:
            return []
        a = self.plan["answer"]
        slo = ", ".join(f"{t['metric'].upper()} p{t['percentile']} <= {t['limit_ms']:g} ms" for t in self.plan["slo"])
        if a is None:
            line = f"plan: no stack of the grid meets {slo}"
        else:
            line = (f"plan: the cheapest stack meeting {slo} is {a['stack']}, {a['usd_per_million_output_tokens']:.3f} "
                    f"$/M output tokens, margin {a['margin']:.0%} (by the {a['by']}; {self.plan['candidates']} "
                    f"candidates analysed, {len(self.plan['replayed'])} replayed in virtual time)")
        return [line, f"  {self.plan_command}"]

    def deployment_lines(self) -> list[str]:
        """Two lines on disaggregation: each deployment's hand-off share of TTFT, median TTFT and
        mean TPOT (virtual time)."""
        if not self.deployments:
            return []
        gpus = (PD_PREFILL + PD_DECODE) * 4
        parts = []
        for r in self.deployments:
            share = "" if r.handoff_share is None else f", hand-off {_share_text(r.handoff_share)} of TTFT"
            parts.append(f"{r.deployment.label}: TTFT p50 {_ms(r.ttft_p50)} ms, TPOT mean {_ms(r.tpot_mean)} ms{share}")
        return [f"prefill/decode disaggregation, {PD_MODEL} on {gpus} x H100-SXM ({PD_PREFILL} prefill + "
                f"{PD_DECODE} decode instances of 4, against {PD_PREFILL + PD_DECODE} colocated; virtual time, "
                f"the RDMA link modelled): " + "; ".join(parts)]

    def pool_stops(self) -> StackRow | None:
        """The smallest pool beyond which every larger one is the same on median TTFT (within the
        verdict's 0.5 %) and takes no more of the prompt tokens off NVMe; None when the largest pool
        still pays (or there is no sweep)."""
        pools = [r for r in self.stacks if r.pool_share is not None]
        for i, r in enumerate(pools[:-1]):
            if all(abs(o.ttft_p50 - r.ttft_p50) <= SAME_WITHIN * r.ttft_p50 and o.nvme_share >= r.nvme_share - 1e-9
                   for o in pools[i + 1:]):
                return r
        return None

    def stack_meaning(self) -> str:
        """One sentence on where the pool stops paying against storage, from the stack rows."""
        base = next((r for r in self.stacks if r.pool_share is None), None)
        stop = self.pool_stops()
        pools = [r for r in self.stacks if r.pool_share is not None]
        if base is None or not pools:
            return "the stacks were not all replayed"
        if stop is None:
            last = pools[-1]
            return (f"a pool still pays at {_gib(last.stack.pool)}: median TTFT {_ms(last.ttft_p50)} ms against "
                    f"{_ms(base.ttft_p50)} ms without one; the sweep ends before it stops")
        nxt = pools[pools.index(stop) + 1]
        priced = all(r.usd_per_million is not None for r in (base, stop, nxt))
        dearer = f" for {stop.usd_per_million - base.usd_per_million:+.3f} $/M output tokens" if priced else ""
        extra = (f", while {_gib(nxt.stack.pool)} adds {nxt.usd_per_million - stop.usd_per_million:.3f} $/M more"
                 if priced else "")
        return (f"the pool stops paying against NVMe at {_gib(stop.stack.pool)}: median TTFT "
                f"{_ms(base.ttft_p50)} ms (DRAM + NVMe) -> {_ms(stop.ttft_p50)} ms "
                f"({base.ttft_p50 / stop.ttft_p50:.2f}x){dearer}, NVMe serving {_pct(stop.nvme_share)} of prompt "
                f"tokens instead of {_pct(base.nvme_share)}; a larger pool is the same on TTFT{extra} "
                f"(virtual time; cost modelled)")

    def meaning(self) -> str:
        """One sentence on what the figures say for "memory pool or storage", from the rows."""
        by_role: dict[str, list[Row]] = {}
        for r in self.rows:
            by_role.setdefault(r.tier.role if r.kind == "virtual" or r.tier.role == "hbm" else "measured", []).append(r)
        pools, stores = by_role.get("pool", []), by_role.get("storage", [])
        if not pools or not stores:
            return "a pool tier and a storage tier are both needed to answer the question; one was skipped"
        pool = min(pools, key=lambda r: r.ttft_p50)
        best = min(stores, key=lambda r: r.ttft_p50)
        worst = max(stores, key=lambda r: r.ttft_p50)
        hbm = by_role.get("hbm")
        recompute = f"; recomputing it in HBM only takes {_ms(hbm[0].ttft_p50)} ms" if hbm else ""
        if pool.ttft_p50 < best.ttft_p50:
            head = (f"for this workload a {pool.tier.name.split(' (')[0]} returns a session's history fastest: "
                    f"median TTFT {_ms(pool.ttft_p50)} ms against {_ms(best.ttft_p50)} ms from "
                    f"{best.tier.name.split(' (')[0]} ({best.ttft_p50 / pool.ttft_p50:.2f}x)")
            if worst is not best:
                head += f" and {_ms(worst.ttft_p50)} ms from {worst.tier.name.split(' (')[0]} " \
                        f"({worst.ttft_p50 / pool.ttft_p50:.2f}x)"
        else:
            head = (f"for this workload {best.tier.name.split(' (')[0]} matches or beats the "
                    f"{pool.tier.name.split(' (')[0]}: median TTFT {_ms(best.ttft_p50)} ms against "
                    f"{_ms(pool.ttft_p50)} ms, so a pool buys no TTFT here")
        tiered = pools + stores
        decode_bound = max(r.ttft_p50 for r in tiered) < 0.2 * min(r.e2el_p50 for r in tiered)
        tail = ("; the tiers differ in TTFT, not in completion: the decode steps, which no tier touches, "
                "dominate a request's time" if decode_bound and _close([r.e2el_p50 for r in tiered], 0.1) else "")
        return f"{head}{recompute}{tail} (virtual time, the tiers' published profiles)"

    def screen(self) -> str:
        """The first screen: the question, the verdicts, one line per tier, how to reproduce each."""
        lines = [f"kvemu demo: memory pool or storage for the KV cache? {WORKLOAD.split(':', 2)[1]} "
                 f"(8 sessions x 5 turns, prompts to ~10k tokens) on {MODEL}, 1 x H100-SXM, HBM for ~2 sessions"]
        if self.virtual_verdict is not None:
            lines.append(f"verdict, virtual time (no spread: the model gives the same figures every repetition): "
                         f"{self.virtual_verdict.sentence}")
        if self.measured_verdict is not None:
            lines.append(f"verdict on the tiers measured on this host ({REPEAT} repetitions each): "
                         f"{self.measured_verdict.sentence}")
        lines.append(f"meaning: {self.meaning()}")
        lines.extend(self.deployment_lines())
        lines.append("")
        head = (f"{'tier':<34} {'backend':<18} {'figures':<10} {'TTFT p50':>22} {'TTFT p99':>9} "
                f"{'completion p50':>14} {'GPU busy':>8} {'KV stall':>8}")
        lines.append(head)
        for r in self.rows:
            p50 = _ms(r.ttft_p50)
            if r.ttft_p50_spread is not None and r.kind != "virtual":
                p50 += f" ({_spread(*r.ttft_p50_spread)})"
            lines.append(f"{r.tier.name:<34} {_short(r.tier.spec):<18} {r.kind:<10} {p50:>22} {_ms(r.ttft_p99):>9} "
                         f"{_ms(r.e2el_p50):>14} {_pct(r.gpu_busy):>8} {_pct(r.kv_stall):>8}")
        for tier, why in self.skipped:
            lines.append(f"{tier.name:<34} {_short(tier.spec):<18} skipped: {why}")
        soft = [f"{r.tier.name}: {r.software[0]}, software {_pct(r.software[1])} of its KV time"
                for r in self.rows if r.software is not None]
        if soft:
            lines.append("storage software paths (modelled, docs/tier-profiles.md): " + "; ".join(soft))
        notes = sorted({r.figures for r in self.rows if r.kind != "virtual" and r.figures != r.kind})
        if notes:
            lines.append(f"measured rows: {'; '.join(notes)} (docs/report.md, \"How the figures were obtained\")")
        lines.append("times in ms, p50 with its range over the repetitions where it varies; completion: a request's "
                     "arrival to its last token; GPU compute modelled in every row (docs/engine.md)")
        if self.stacks:
            lines.append("")
            lines.append(f"tier stacks below HBM, virtual time: {self.stack_meaning()}")
            lines.append(f"{'stack (top first)':<44} {'pool':>6} {'NVMe':>6} {'recomputed':>10} {'TTFT p50':>9} "
                         f"{'$/M out':>8}")
            for r in self.stacks:
                pool = "-" if r.pool_share is None else _pct(r.pool_share)
                usd = "-" if r.usd_per_million is None else f"{r.usd_per_million:.3f}"
                lines.append(f"{r.stack.name:<44} {pool:>6} {_pct(r.nvme_share):>6} {_pct(r.recomputed_share):>10} "
                             f"{_ms(r.ttft_p50):>9} {usd:>8}")
            lines.append("pool, NVMe, recomputed: shares of the prompt tokens (the rest hit in HBM or DRAM); "
                         "$/M out: modelled, GPU time, each level's provisioned capacity amortised and "
                         "the NVMe level's wear (its writes against the drive's rated endurance)")
        if self.handoff_line:
            lines.append("")
            lines.append(self.handoff_line)
        lines.append("")
        lines.append(f"reproduce (files in {self.folder}/; `kvemu report {self.folder}` for the whole comparison):")
        lines.extend(f"  {c}" for c in self.record_commands)
        lines.extend(f"  {r.command}" for r in self.rows)
        lines.extend(f"  {r.command}" for r in self.stacks)
        lines.extend(f"  {r.command}" for r in self.deployments)
        if self.plan is not None:
            lines.append("")
            lines.extend(self.plan_lines())
        return "\n".join(lines)


def _ms(value: float) -> str:
    return ms(value)


def _spread(lo: float, hi: float) -> str:
    return spread(lo, hi)


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def _short(spec: str) -> str:
    return BackendSpec.parse(spec).short()


def _close(values: list[float], share: float) -> bool:
    return bool(values) and max(values) <= (1 + share) * min(values)


def _record_command(trace: Path, policy: str) -> str:
    return (f"kvemu record --workload {shlex.quote(WORKLOAD)} --model {MODEL} --tier-policy {policy} "
            f"--hbm-kv-gib {HBM_KV_GIB:g} --out {shlex.quote(str(trace))}")


def _pd_record_command(trace: Path) -> str:
    return (f"kvemu record --workload {shlex.quote(WORKLOAD)} --model {PD_MODEL} --prefill-instances {PD_PREFILL} "
            f"--decode-instances {PD_DECODE} --transfer rdma --out {shlex.quote(str(trace))}")


def _pd_replay_command(trace: Path, dep: Deployment, out: Path) -> str:
    flags = "".join(f" {f}" for f in dep.flags)
    return (f"kvemu replay {shlex.quote(str(trace))} --backend vemu:cxl-pool --layers {REPLAY_LAYERS}{flags} "
            f"--label {dep.label} --out {shlex.quote(str(out))}")


def _pd_options(dep: Deployment) -> ReplayOptions:
    """replay's options for ``dep`` (its flags, in the Python API)."""
    opts = ReplayOptions(window=WindowOptions(layers=REPLAY_LAYERS), output=OutputOptions(label=dep.label))
    if "--transfer" in dep.flags:
        opts = opts.but(disagg__transfer=dep.flags[dep.flags.index("--transfer") + 1])
    if "--colocated" in dep.flags:
        opts = opts.but(disagg__colocated=True,
                        instances__count=int(dep.flags[dep.flags.index("--instances") + 1]))
    return opts


def _replay_command(trace: Path, tier: Tier, out: Path) -> str:
    label = f" --label {shlex.quote(tier.label)}" if _short(tier.spec) != tier.spec else ""
    return (f"kvemu replay {shlex.quote(str(trace))} --backend {shlex.quote(tier.spec)} --layers {REPLAY_LAYERS} "
            f"--repeat {REPEAT}{label} --out {shlex.quote(str(out))}")


def _stack_command(trace: Path, stack: Stack, out: Path) -> str:
    return (f"kvemu replay {shlex.quote(str(trace))} --tiers {shlex.quote(stack.tiers)} --layers {REPLAY_LAYERS} "
            f"--out {shlex.quote(str(out))}")


def _stack_row(stack: Stack, results: Path, run_row, command: str) -> StackRow:
    shares, _, recomputed = stack_share_of_prompts(run_row.run)
    return StackRow(stack=stack, pool_share=shares[1] if stack.pool else None, nvme_share=shares[-1],
                    recomputed_share=recomputed, ttft_p50=float(run_row.summary["median_ttft_ms"]),
                    usd_per_million=(run_row.run.meta.get("cost") or {}).get("usd_per_million_output_tokens"),
                    results=results, command=command)


def _deployment_row(dep: Deployment, results: Path, run_row, command: str) -> DeploymentRow:
    share = deployment_record(run_row)["handoff_share_of_ttft"] if run_row.run.disagg is not None else None
    return DeploymentRow(deployment=dep, ttft_p50=float(run_row.summary["median_ttft_ms"]),
                         tpot_mean=float(run_row.summary["mean_tpot_ms"]), handoff_share=share, results=results,
                         command=command)


def _row(tier: Tier, results: Path, run_row, command: str) -> Row:
    run = run_row.run
    meta = run.meta
    steps = meta.get("steps") or {}
    total = steps.get("total_ns") or 0
    load = meta.get("load") or {}
    figures = str(run.figures.get("label") or run.kind)
    host = meta.get("host_load") or {}
    if run.kind != "virtual" and host.get("moved"):
        figures += f", others took {host['others_share']:.0%} of the host's CPU"
    moved = sum(int(run_row.summary.get(f"total_kv_bytes_{op}", 0)) for op in ("loaded", "stored", "read"))
    return Row(tier=tier, kind=run.kind, figures=figures, ttft_p50=float(run_row.summary["median_ttft_ms"]),
               ttft_p50_spread=run.spread("median_ttft_ms"), ttft_p99=float(run_row.summary["p99_ttft_ms"]),
               e2el_p50=float(run_row.summary["median_e2el_ms"]), gpu_busy=load.get("utilisation"),
               kv_stall=(steps.get("kv_stall_ns", 0) / total) if total else None, moved_bytes=moved,
               results=results, command=command, software=_software(meta))


def _software(meta: dict) -> tuple[str, float | None] | None:
    """A storage profile's generation and its software share of the KV time (results'
    backend.software_path, modelled), or None for a tier without one."""
    sw = (meta.get("backend") or {}).get("software_path")
    if not isinstance(sw, dict):
        return None
    ops = (sw.get("ops") or {}).values()
    soft = sum(float(o.get("software_ns") or 0) for o in ops)
    busy = soft + sum(float(o.get("medium_ns") or 0) for o in ops)
    return str(sw.get("generation") or "no stated generation"), (soft / busy if busy else None)


def _verdict(report, paths: list[Path]):
    """The report's verdict on the runs of ``paths`` (one workload), ranked among every run of
    ``report`` (``rank``: so a run's virtual twin stands beside it as in the whole report, and the
    two verdicts cannot disagree on it); None with fewer than two runs."""
    if len(paths) < 2:
        return None
    wanted = {os.path.abspath(p) for p in paths}
    rows = [row for group in report.groups for row in group.rows if os.path.abspath(row.run.path) in wanted]
    rep = build_report([row.run.path for group in report.groups for row in group.rows], recorded_traces=False,
                       rank=[row.run.label for row in rows])
    groups = [g for g in rep.groups if any(os.path.abspath(r.run.path) in wanted for r in g.rows)]
    return groups[0].verdict if len(groups) == 1 else None


def run_demo(out_dir=None, stream=None) -> Demo:
    """Runs the demo into ``out_dir`` (default: a new ``kvemu-demo-TIMESTAMP`` folder), with progress
    as one line per phase on ``stream`` (stderr by default)."""
    folder = Path(out_dir) if out_dir else Path(f"kvemu-demo-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{folder}: cannot create the demo folder ({e.strerror})") from None
    if any(folder.glob("*.parquet")) or (folder / "report.html").exists():
        raise OutputError(f"{folder}: already holds a demo's files (parquet or report.html); give an "
                          f"empty or new --out folder")
    tiers = demo_tiers(folder)
    policies = list(dict.fromkeys(t.policy for t in tiers))
    stacks = demo_stacks()
    deployments = demo_deployments()
    phases = Phases(len(policies) + len(tiers) + 5, stream=stream)
    traces: dict[str, Path] = {}
    commands = []
    for policy in policies:
        traces[policy] = folder / f"trace-{policy}.parquet"
        line = phases.start(f"record {WORKLOAD.split(':', 2)[1]} on {MODEL}, tier policy {policy}")
        record(WORKLOAD, MODEL, traces[policy],
               RecordOptions(engine=EngineOptions(tier_policy=policy, hbm_kv_gib=HBM_KV_GIB),
                             output=RecordOutputOptions(show_progress=False)))
        line.end(traces[policy].name)
        commands.append(_record_command(traces[policy], policy))
    done: list[tuple[Tier, Path, str]] = []
    skipped: list[tuple[Tier, str]] = []
    for tier in tiers:
        res = folder / tier.results_name
        warnings: list[str] = []
        line = phases.start(f"replay {traces[tier.policy].name} on {_short(tier.spec)}", REPEAT)
        try:
            options = ReplayOptions(window=WindowOptions(layers=REPLAY_LAYERS),
                                    output=OutputOptions(label=tier.label, repeat=REPEAT))
            replay(traces[tier.policy], tier.spec, options, out=res, progress=line, warn=warnings.append)
        except BackendUnavailable as e:
            line.end(f"skipped: {e}")
            skipped.append((tier, str(e)))
            continue
        n = len(warnings)
        line.end(f"x{REPEAT}" + (f", {n} warning{'s' * (n > 1)} (in the results' metadata)" if n else ""))
        done.append((tier, res, _replay_command(traces[tier.policy], tier, res)))
    trace = traces["offload"]
    line = phases.start(f"replay {trace.name} on {len(stacks)} tier stacks (virtual time)", len(stacks))
    stacked: list[tuple[Stack, Path, str]] = []
    for st in stacks:
        res = folder / st.results_name
        spec = parse_tiers(st.tiers)
        replay(trace, spec.levels[0].backend,
               ReplayOptions(window=WindowOptions(layers=REPLAY_LAYERS), tier=TierOptions(stack=spec)),
               out=res, progress=line)
        stacked.append((st, res, _stack_command(trace, st, res)))
    line.end(f"a CXL pool of {', '.join(_gib(p) for p in POOL_SIZES)} and none")
    pd_trace = folder / "trace-pd.parquet"
    line = phases.start(f"record {WORKLOAD.split(':', 2)[1]} on {PD_MODEL} for {PD_PREFILL} prefill + {PD_DECODE} "
                        f"decode instances")
    record(WORKLOAD, PD_MODEL, pd_trace,
           RecordOptions(deployment=DeploymentOptions(PD_PREFILL, PD_DECODE, "rdma"),
                         output=RecordOutputOptions(show_progress=False)))
    line.end(pd_trace.name)
    commands.append(_pd_record_command(pd_trace))
    line = phases.start(f"replay {pd_trace.name} disaggregated and colocated (virtual time)", len(deployments))
    deployed: list[tuple[Deployment, Path, str]] = []
    for dep in deployments:
        res = folder / dep.results_name
        replay(pd_trace, "vemu:cxl-pool", _pd_options(dep), out=res, progress=line)
        deployed.append((dep, res, _pd_replay_command(pd_trace, dep, res)))
    line.end(", ".join(d.label for d in deployments))
    from .plan import PlanOptions, plan

    line = phases.start(f"plan {trace.name}: the cheapest stack meeting {PLAN_SLO}")
    planned = plan(trace, PLAN_SLO, list(PLAN_LEVELS), PlanOptions(replay_max=PLAN_REPLAY, replay_layers=REPLAY_LAYERS,
                                                                   workers=1))
    line.end("done")
    plan_command = (f"kvemu plan {shlex.quote(str(trace))} --slo {PLAN_SLO} "
                    + " ".join(f"--level {lv}" for lv in PLAN_LEVELS) + f" --replay {PLAN_REPLAY}")
    line = phases.start("report")
    report = build_report([str(p) for _, p, _ in done] + [str(p) for _, p, _ in stacked]
                          + [str(p) for _, p, _ in deployed])
    html = render_html(report, folder / "report.html")
    by_path = {os.path.abspath(row.run.path): row for group in report.groups for row in group.rows}
    rows = [_row(t, p, by_path[os.path.abspath(p)], c) for t, p, c in done]
    stack_rows = [_stack_row(st, p, by_path[os.path.abspath(p)], c) for st, p, c in stacked]
    virtual = [r.results for r in rows if r.kind == "virtual" and r.tier.role in ("pool", "storage")]
    measured = [r.results for r in rows if r.kind == "measured" and r.tier.policy == "offload"]
    dep_rows = [_deployment_row(d, p, by_path[os.path.abspath(p)], c) for d, p, c in deployed]
    pd_group = next((g for g in report.groups if any(os.path.abspath(r.run.path) == os.path.abspath(deployed[0][1])
                                                     for r in g.rows)), None)
    demo = Demo(folder=folder, rows=rows, skipped=skipped, virtual_verdict=_verdict(report, virtual),
                measured_verdict=_verdict(report, measured), report=report, html=html, record_commands=commands,
                stacks=stack_rows, deployments=dep_rows,
                handoff_line=None if pd_group is None else handoff_line(pd_group), plan=planned,
                plan_command=plan_command)
    line.end(html.name)
    return demo
