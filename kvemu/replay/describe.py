"""What the results say, built in one place: each stage of a replay hands over a small typed
piece (the run, the backends' outcome, the trace, the schedule, the parameters and reductions,
the tier, the steps, the data path), and :func:`results_meta` composes the results' metadata from
them (docs/replay.md, "Results"). Nothing else writes the metadata."""

from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass

import numpy as np

from .. import __version__
from ..analysis import trace_summary
from ..backend_spec import BackendSpec
from ..backends import hist_bucket_lower_ns, percentile_from_hist
from ..bounds import DEFAULT_TIER_EVICTION
from ..figures import run_figures
from ..links import DEFAULT_LINK
from ..prices import Held, run_cost
from ..schema import OPS, RESULTS_FORMAT, RESULTS_VERSION
from .host import host_facts

__all__ = ["BackendOutcome", "CostPiece", "DEFAULT_LINK", "DatapathPiece", "ParamsPiece", "RunPiece", "SchedulePiece",
           "StepsPiece", "TierPiece", "TracePiece", "backend_outcome", "results_meta"]


# ------------------------------------------------------------------------------------- pieces
@dataclass(frozen=True)
class RunPiece:
    run_id: str
    label: str
    duration_s: float
    wall_s: float
    prefault_s: float


@dataclass(frozen=True)
class BackendOutcome:
    """What the instances' backends did (instances.run_instances): the spec that ran (substituted
    or not), their facts and mode, the data path they were given, and their statistics."""

    spec: str
    requested: str
    because: str | None
    facts: list
    mode: str
    tier_latency_ns: float | None
    tier_latency_from: str | None
    link: object
    staged: bool | None
    datapath_ops: dict
    prepare_s: float
    stores_drain_ns: int
    ops: dict
    instance_ops: list
    software: dict | None = None


@dataclass(frozen=True)
class TracePiece:
    path: object
    trace: object
    totals: dict
    sha256: str


@dataclass(frozen=True)
class SchedulePiece:
    ran: str
    ran_from: str
    source: dict
    time_scale: float
    scale_from: str
    stats: dict | None
    header: object
    kv_load: str
    #: --arrivals as resolved (docs/replay.md), for a trace with sessions; None: none
    arrivals: dict | None = None


@dataclass(frozen=True)
class ParamsPiece:
    overlap: bool
    max_memory_bytes: int
    requests: tuple | None
    arrival_ms: tuple | None
    warmup: float
    selected_requests: int
    replayed_requests: int
    steps: tuple
    first_layers: list
    span: list
    n_layers: int
    arena_bytes: int
    arena_blocks: int
    instances: int
    sharing: str
    #: what each replayed layer caches (full, sliding, chunked, linear), None: full attention in every layer
    kinds: list | None = None


@dataclass(frozen=True)
class TierPiece:
    touched: np.ndarray
    instances: int
    bytes_per_block: int
    arena_slots: list
    capacity: int | None
    capacity_from: str
    chunk_bytes: int
    tier_slots: list | None
    load_misses_blocks: int
    #: closed loop: the most blocks the replayed engines' tiers held at once (None: the arena's slots)
    resident_blocks: int | None = None
    #: the capacity the tier was provisioned with, all layers (arena.provisioned_bytes; None: unbounded)
    provisioned_bytes: int | None = None
    #: what the tier evicts (a kvemu.policies name: --tier-eviction, else the trace's, else lru)
    eviction: str = DEFAULT_TIER_EVICTION


@dataclass(frozen=True)
class StepsPiece:
    count: int
    total_ns: int
    compute_ns: int
    kv_ns: dict

    @classmethod
    def of(cls, accs, count: int) -> StepsPiece:
        return cls(count, sum(a.total_ns for a in accs), sum(a.compute_total_ns for a in accs),
                   {op: sum(a.kv_total_ns[op] for a in accs) for op in OPS})


@dataclass(frozen=True)
class DatapathPiece:
    link_requested: str
    link: object
    lanes: int
    store_timing: str
    store_inflight_bytes: int
    overlap: bool
    transfer: object  # run.Transfer
    outcome: BackendOutcome


@dataclass(frozen=True)
class CostPiece:
    """What the run is priced with (docs/replay.md, "Cost and energy"): the price table
    (prices.Prices), the amortisation period, the trace's GPU preset and GPUs per instance, the
    selected requests and their output tokens, and the tier profile the backend's medium is priced
    as (BackendSpec.priced_profile; None: no profile)."""

    prices: object
    amortise_years: float
    gpu: str | None
    gpus: int
    requests: int
    output_tokens: int
    priced_profile: str | None


# ------------------------------------------------------------------------------------- sections
def backend_outcome(state: dict, stats: list, prepare_s: float, end_ns: list | None = None) -> BackendOutcome:
    """The backends' runs (stats: instances.backend_stats of every instance) as the results say them."""
    n = len(stats)
    merged = {}
    for op in OPS:
        parts = [s.ops[op] for s in stats]
        merged[op] = {"counts": sum(p["counts"] for p in parts),
                      **{k: sum(p[k] for p in parts) for k in ("accesses", "bytes", "time_ns", "busy_ns")}}
    facts = [s.facts for s in stats]
    datapath = {op: {k: sum(s.datapath[op][k] for s in stats) for k in stats[0].datapath[op]} for op in OPS}
    # how long the async stores ran past the last step (closed loop: past the engine's clock)
    drain = max(max(s.timeline["stores_done_ns"] - (s.timeline["clock_ns"] if end_ns is None else end_ns[i]), 0)
                for i, s in enumerate(stats))
    return BackendOutcome(
        spec=state["spec"], requested=state["requested"], because=state["because"], facts=facts,
        mode=facts[0].get("mode", "measured"), tier_latency_ns=state.get("latency"),
        tier_latency_from=state.get("latency_from"), link=state.get("link"), staged=state.get("staged"),
        datapath_ops=datapath, prepare_s=prepare_s, stores_drain_ns=drain,
        ops={op: op_meta(merged[op]) for op in OPS}, software=software_share(state.get("profile"), merged),
        instance_ops=[{"instance": i, **{op: op_meta(stats[i].ops[op]) for op in OPS}} for i in range(n)])


def software_share(profile, ops: dict) -> dict | None:
    """The share of an emulated storage tier's KV time spent on its software path rather than on the
    medium, per op (modelled: accesses x fixed parts + bytes x per-byte parts, against the busy time
    the model charged), with the software generation the profile models; None for a tier that is not
    storage. The per-request lookups are step time, not KV time: schedule.engine.store_lookups."""
    if profile is None or profile.kind != "storage":
        return None
    per_op = {}
    for op in OPS:
        st = ops[op]
        sw = profile.software_ns(int(st["accesses"]), int(st["bytes"]))
        busy = int(st["busy_ns"])
        sw = min(sw, float(busy)) if busy else sw
        per_op[op] = {"software_ns": sw, "medium_ns": max(busy - sw, 0.0),
                      "software_share": sw / busy if busy else None}
    return {"figures": "modelled", "generation": profile.generation or None, "gpu_direct": profile.gpu_direct,
            "parts": {p.name: p.to_dict() for p in profile.software},
            "ns_per_request": profile.software_ns_per_request,
            # which part came from where: the parts are another profile's when it says software_from
            "parts_from": profile.software_from or profile.name, "wire_and_medium_from": profile.name,
            "ns_per_io": profile.software_ns_per_io, "ns_per_byte": profile.software_ns_per_byte,
            "ops": per_op,
            "note": "software_ns: the profile's software parts for these accesses and bytes, at most the op's "
                    "busy time; medium_ns: the rest of it; ns_per_request: each request's lookup, hit or miss, "
                    "charged to its first step (schedule.engine.store_lookups) (docs/tier-profiles.md, "
                    "'The software path')"}


def op_meta(st: dict) -> dict:
    """Results metadata of one op from Backend.op_stats (or their sum over instances)."""
    counts = st["counts"]
    lower = hist_bucket_lower_ns()
    nz = np.flatnonzero(counts)
    d = {"accesses": int(st["accesses"]), "bytes": int(st["bytes"]), "time_ns": int(st["time_ns"]),
         "busy_ns": int(st["busy_ns"]), "gbps": (st["bytes"] / st["busy_ns"]) if st["busy_ns"] else None,
         "hist": {"lower_ns": lower[nz].tolist(), "counts": counts[nz].tolist()}}
    for name, q in (("p50_ns", 50), ("p99_ns", 99), ("p999_ns", 99.9)):
        d[name] = float(percentile_from_hist(counts, lower, q)) if st["accesses"] else None
    d["mean_ns"] = st["time_ns"] / st["accesses"] if st["accesses"] else None
    return d


def instance_ops(ops: list, closed_stats: dict | None) -> list:
    """Per-instance op statistics; in closed loop with a shared emulated tier also the time the
    instance's steps queued for it and the KV bandwidth it got with that wait (``effective_gbps``:
    its bytes over its busy time plus its queueing)."""
    per = {p["instance"]: p for p in (closed_stats or {}).get("per_instance", [])}
    out = []
    for o in ops:
        p = per.get(o["instance"])
        if p is not None:
            nbytes = sum(o[op]["bytes"] for op in OPS)
            busy = sum(o[op]["busy_ns"] for op in OPS) + p["queued_ns"]
            o = {**o, "queued_ns": p["queued_ns"], "effective_gbps": nbytes / busy if busy else None}
        out.append(o)
    return out


def tier_footprint(touched: np.ndarray, instances: int, bytes_per_block: int, arena_slots: list[int],
                   resident_blocks: int | None = None) -> dict:
    """Tier bytes the replayed span needs with one shared pool and with per-instance copies (the
    blocks each instance's replay touched), and what was resident: in closed loop the most blocks
    the replayed engines' tiers held at once, over the distinct tiers (one shared, one per
    replicated instance); recorded, the arenas' slots (every block the steps touch has one, every
    arena is pre-faulted)."""
    shared = int(np.count_nonzero(np.logical_or.reduce(touched, axis=0)))
    replicated = int(np.count_nonzero(touched))
    resident, how = ((sum(arena_slots), "arena slots") if resident_blocks is None else
                     (resident_blocks, "peak blocks held by the replayed engines' tiers"))
    return {"instances": instances, "shared_bytes": shared * bytes_per_block,
            "replicated_bytes": replicated * bytes_per_block,
            "resident_bytes": resident * bytes_per_block, "resident_from": how,
            "note": "bytes of the replayed layers only"}


def tier_section(t: TierPiece) -> dict:
    slots = t.tier_slots
    return {**tier_footprint(t.touched, t.instances, t.bytes_per_block, t.arena_slots, t.resident_blocks),
            "capacity_chunks": t.capacity, "capacity_from": t.capacity_from,
            "capacity_bytes": None if t.capacity is None else t.capacity * t.chunk_bytes,
            "provisioned_bytes": t.provisioned_bytes,
            "slots_reused": slots is not None,
            "eviction": t.eviction,
            "evictions": sum({id(s): s.evictions for s in slots}.values()) if slots else 0,
            "call_overflow_chunks": tier_overflow(slots),
            "load_misses_blocks": t.load_misses_blocks}


def tier_overflow(slots) -> int:
    """Chunks a replay call evicted itself, over the distinct tiers (one shared, one per replicated
    instance): a call, at least one engine step, touched more chunks than the tier holds."""
    return sum({id(s): s.overflow for s in slots}.values()) if slots else 0


def schedule_section(p: SchedulePiece) -> dict:
    """Which schedule ran, and what the closed loop's engine did against what was recorded."""
    eng = p.header.meta.get("engine", {})
    d = {"ran": p.ran, "from": p.ran_from, "trace": p.source, "time_scale": p.time_scale,
         "time_scale_from": p.scale_from,
         "recorded": {k: eng.get(k) for k in ("steps", "entries", "makespan_ns", "hbm_evictions", "tier_evictions")},
         # whose the per-request hbm_hit_tokens / tier_hit_tokens / recomputed_tokens are
         "reuse_from": "replayed engine" if p.stats is not None else "recording"}
    if p.stats is not None:
        d["engine"] = {k: int(p.stats[k]) for k in ("steps", "c_steps", "entries", "finished", "hbm_evictions",
                                                   "tier_evictions", "end_ns", "queued_ns", "async_loads")}
        if p.stats.get("lookups"):  # a store's per-request lookups (docs/tier-profiles.md, "The software path")
            d["engine"]["store_lookups"] = {"requests": int(p.stats["lookups"]), "ns": int(p.stats["lookup_ns"]),
                                            "figures": "modelled",
                                            "note": "the tier profile's ns_per_request parts, once per request the "
                                                    "engine consulted the tier for (hits and misses), added to the "
                                                    "first step carrying it"}
        for k in ("routing", "lockstep", "per_instance"):
            if k in p.stats:
                d["engine"][k] = p.stats[k]
        if "disagg" in p.stats:  # prefill/decode disaggregation (replay.closed.disagg)
            d["disagg"] = p.stats["disagg"]
        if "stack" in p.stats:  # a tier stack (replay.stack.stack_section), less the per-request arrays
            d["stack"] = {k: v for k, v in p.stats["stack"].items() if k not in ("level_tokens", "late_tokens")}
    if p.arrivals is not None:
        d["arrivals"] = p.arrivals
    return {**d, "kv_load": p.kv_load}


def trace_section(t: TracePiece) -> dict:
    h = t.trace.header
    return {
        "path": os.fspath(t.path),
        "sha256": t.sha256,
        "size_bytes": h.file_bytes,
        "version": h.meta["version"],
        "model": h.model,
        "workload": {k: v for k, v in h.meta.get("workload", {}).items() if k != "params"},
        "engine": h.meta.get("engine", {}),
        "gpu": h.meta.get("gpu", {}),
        # the compute model other than the roofline that priced the trace's steps, and prices the
        # steps a closed-loop replay schedules again (analysis.compute_from_meta)
        **({"compute": h.meta["compute"]} if isinstance(h.meta.get("compute"), dict) else {}),
        "summary": trace_summary(t.trace, prefix_hits=False, totals=t.totals),
    }


def params_section(p: ParamsPiece) -> dict:
    return {
        "overlap": p.overlap,
        "max_memory_bytes": p.max_memory_bytes,
        "reductions": {
            "requests": list(p.requests) if p.requests else None,
            "arrival_ms": list(p.arrival_ms) if p.arrival_ms else None,
            # --warmup: the share of the requests, in arrival order, that warmed the caches uncounted
            "warmup": p.warmup,
            "selected_requests": p.selected_requests,
            "replayed_requests": p.replayed_requests,
            "steps": list(p.steps),
            # kinds: what each replayed layer caches, for a model with KV groups only
            "layers": {"replayed": p.first_layers, "span": p.span, "of": p.n_layers,
                       **({} if p.kinds is None else {"kinds": p.kinds})},
        },
        # what each block operation moves: a block of every layer (full attention), or each replayed layer's
        # own group (a sliding layer's window, a linear layer's state: docs/replay.md "KV groups")
        "kv_bytes": "full attention" if p.kinds is None else "kv groups",
        "arena_bytes": p.arena_bytes,
        "arena_blocks": p.arena_blocks,
        "instances": p.instances,
        "sharing": p.sharing if p.instances > 1 else None,
    }


def steps_section(s: StepsPiece) -> dict:
    return {"count": s.count, "total_ns": s.total_ns, "compute_ns": s.compute_ns,
            "kv_stall_ns": s.total_ns - s.compute_ns, **{f"kv_{op}_ns": s.kv_ns[op] for op in OPS}}


def datapath_section(d: DatapathPiece) -> dict:
    x, o = d.transfer, d.outcome
    return {
        "link": (o.link or d.link).to_dict(),
        "link_requested": d.link_requested,
        "link_lanes": d.lanes,
        "staged": o.staged,
        "store_timing": d.store_timing,
        "store_inflight_bytes": d.store_inflight_bytes if d.store_timing == "async" else None,
        "overlap_loads": d.overlap,
        "transfer": {"chunk_tokens": x.chunk_tokens, "chunk_blocks": x.chunk_blocks, "block_tokens": x.block_tokens,
                     "layout": x.layout, "layout_from": x.layout_from, "chunk_tokens_from": x.chunk_from},
        "workers": o.facts[0].get("workers"),
        "tier_latency_ns": o.tier_latency_ns,
        "tier_latency_from": o.tier_latency_from,
        "ops": o.datapath_ops,
        "stores_drain_ns": o.stores_drain_ns,
    }


def backend_section(o: BackendOutcome) -> dict:
    facts = o.facts[0]
    # Reports know two modes; virtual time is an emulation too, and says so in `virtual`.
    return {"spec": o.spec, "name": facts.get("backend", o.spec.split(":")[0]),
            "mode": "emulated" if o.mode.startswith("emulated") else o.mode,
            "virtual": o.mode == "emulated-virtual", "facts": facts,
            "requested": o.requested, "substituted_because": o.because,
            # only a tier with a software path (an emulated storage profile) has the key
            **({"software_path": o.software} if o.software is not None else {})}


def weights_section(placement, accs, kind: str, n_blocks: int, overlap: bool, steps: int) -> dict | None:
    """Results' ``weights``: the placement and what its stream did in this replay."""
    if placement is None:
        return None
    ns = sum(a.weight_ns for a in accs)
    nbytes = sum(a.weight_bytes for a in accs)
    streamed = sum(a.weight_steps for a in accs)
    return {**placement.to_dict(),
            "replay": {"region_blocks_per_layer": n_blocks, "steps": steps, "steps_streamed": streamed,
                       "bytes": nbytes, "time_ns": ns, "gbps": nbytes / ns if ns else None,
                       "mean_ns_per_step": ns / streamed if streamed else None,
                       "composition": "overlap" if overlap else "serial", "figures": kind,
                       "note": "weight loads are loads of the tier: ops.load and datapath.ops.load include them; "
                               "steps.kv_load_ns and the requests' kv_load_ms do not; their time on the critical "
                               "path is in kv_stall_ms"}}


def tier_capacity_priced(tier: dict, params: dict) -> tuple[int, str]:
    """The tier bytes a run is priced at, all layers, and where the figure came from: the capacity it
    was provisioned with (``provisioned_bytes``: --tier-capacity as given, the recording's tier, or
    what --max-memory allowed; results before it: the sized tier's chunks), once when shared and
    once per instance when replicated; an unbounded tier, which nothing sized, at what it held at
    its peak (over its distinct tiers), scaled from the replayed layers to all of them."""
    n = params["instances"]
    tiers = n if n > 1 and params.get("sharing") == "replicated" else 1
    given = tier.get("provisioned_bytes")
    if given is None:
        given = tier.get("capacity_bytes")
    if given is not None:
        return int(given) * tiers, f"provisioned ({tier['capacity_from']}) x {tiers} tier(s)"
    return (int(round(tier["resident_bytes"] * _layer_scale(params))),
            f"unbounded, nothing provisioned: resident bytes ({tier['resident_from']}), scaled to all "
            f"{params['reductions']['layers']['of']} layers")


def _layer_scale(params: dict) -> float:
    """All layers over the replayed ones: what a figure of the replayed layers is multiplied by."""
    layers = params["reductions"]["layers"]
    return layers["of"] / (len(layers["replayed"]) or 1)


def tier_written_bytes(meta: dict) -> int:
    """The bytes a single-tier run wrote into its tier, all layers: its stores (``ops.store``, the
    replayed layers of every instance) scaled to all layers."""
    return int(round(((meta.get("ops") or {}).get("store") or {}).get("bytes", 0) * _layer_scale(meta["params"])))


def stack_capacities_priced(stack: dict, params: dict) -> list:
    """A tier stack's levels as the cost prices them (prices.Held): ``L1 BACKEND``, the profile its
    medium is priced as, its capacity (``cap``, all layers), once for a shared level and once per
    instance for a private one (each instance holds its own), and the bytes written into it."""
    n = params["instances"]
    out = []
    for lv in stack["levels"]:
        copies = n if n > 1 and lv.get("sharing") != "shared" else 1
        out.append(Held(f"L{lv['level']} {lv['backend']}", BackendSpec.parse(lv["backend"]).priced_profile() or "(none)",
                        int(lv["capacity_bytes"]) * copies,
                        f"the level's cap (--tiers){f' x {copies} instances' if copies > 1 else ''}",
                        lv.get("bytes_written")))
    return out


def cost_section(c: CostPiece, meta: dict) -> dict:
    """Results' ``cost``: GPU-hours, the run's cost and energy, per request and per million output
    tokens (prices.run_cost, the one rule ``analyze capacity`` prices with too), over the replayed
    timeline's duration, with the price table and every figure it took recorded. Each level is
    priced at its provisioned capacity as its own medium, and a flash level for its writes too."""
    stack = (meta.get("schedule") or {}).get("stack")
    if stack:
        capacities = stack_capacities_priced(stack, meta["params"])
        cap_from = "each level's cap (--tiers), x instances for a private level"
        profile = " + ".join(h.profile for h in capacities)
    else:
        nbytes, cap_from = tier_capacity_priced(meta["tier"], meta["params"])
        profile = c.priced_profile
        capacities = [Held("tier", profile or "(none)", nbytes, cap_from, tier_written_bytes(meta))]
    cost = run_cost(c.prices, gpu=c.gpu, gpus=c.gpus, instances=meta["params"]["instances"],
                    duration_s=float(meta["duration_s"]), output_tokens=c.output_tokens, requests=c.requests,
                    capacities=capacities, amortise_years=c.amortise_years)
    if c.gpu is None:
        cost["notes"] = ["the trace names no GPU preset: no GPU price or power" if n.startswith("no price for GPU")
                         else n for n in cost["notes"]]
    return {"figures": c.prices.label, "prices": c.prices.describe(), "capacity_from": cap_from,
            "priced_as": profile, "duration_from": "duration_s (the replayed timeline)",
            **cost,
            "note": "GPU-hours = instances x GPUs per instance x duration; cost = GPU-hours x $/GPU-hour + each "
                    "level's provisioned GB x $/GB x duration / amortisation period, as its medium + a flash "
                    "level's GB written x $/GB / (DWPD x 365.25 x warranty years); energy = GPU W x GPU time + "
                    "the levels' GB x W/GB x duration; weights held in the tier are not priced"}


# ------------------------------------------------------------------------------------- the builder
def results_meta(*, run: RunPiece, backend: BackendOutcome, warnings: list, trace: TracePiece, load: dict | None,
                 schedule: SchedulePiece, params: ParamsPiece, tier: TierPiece, steps: StepsPiece,
                 datapath: DatapathPiece, instances: int, closed_stats: dict | None, weights=None,
                 host_load: dict | None = None, cost: CostPiece | None = None) -> dict:
    """The results' metadata (docs/replay.md "Results") from the stages' pieces; ``figures`` (how
    each figure was obtained, figures.run_figures) is derived from the rest."""
    meta = {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "creator": f"kvemu {__version__}",
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "run_id": run.run_id,
        "label": run.label,
        "backend": backend_section(backend),
        "warnings": warnings,
        "trace": trace_section(trace),
        "host": host_facts(),
        # this host's load while the replay ran (host.host_load): other processes move measured figures
        "host_load": host_load,
        "load": load,
        "schedule": schedule_section(schedule),
        "params": params_section(params),
        "tier": tier_section(tier),
        "steps": steps_section(steps),
        "ops": backend.ops,
        "datapath": datapath_section(datapath),
        "instance_ops": instance_ops(backend.instance_ops, closed_stats) if instances > 1 else None,
        "duration_s": run.duration_s,
        "wall_s": run.wall_s,
        # the arena's allocation and pre-fault, apart from the replay (the tier exists before serving)
        "prefault_s": run.prefault_s,
    }
    if closed_stats and closed_stats.get("tier_devices"):
        meta["tier"] = {**meta["tier"], "devices": closed_stats["tier_devices"]}
    meta["figures"] = run_figures(meta)
    if weights is not None:
        placement, accs, n_blocks, overlap, n_steps = weights
        meta["weights"] = weights_section(placement, accs, meta["figures"].get("kind"), n_blocks, overlap, n_steps)
    if cost is not None:
        meta["cost"] = cost_section(cost, meta)
    return meta
