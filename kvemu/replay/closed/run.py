"""How replay.run runs the closed loop: what each instance's thread runs (closed_body, with its
load stream for async KV loads), the engines' totals (closed_totals), and what the results say of
the schedule (time_scale_of) and of the offered load on the replayed timeline
(replayed_load)."""

from __future__ import annotations

import numpy as np

from ...analysis import gpus_text, offered_load
from ...backend_spec import BackendSpec, emulated_backend_args
from ...errors import ConfigError
from ...recording import arrival_scale
from ..instances import backend_stats, open_load_stream
from ..stack import TierStack
from .loop import ClosedLoop
from .router import Router
from .tierqueue import TierQueue, shared_tier


def time_scale_of(trace, time_scale, request_rate, closed: bool) -> tuple[float, str]:
    """The factor arrival times are multiplied by, and where it came from."""
    if time_scale is None and request_rate is None:
        return 1.0, "trace"
    if time_scale is not None and request_rate is not None:
        raise ConfigError("give --time-scale or --request-rate, not both")
    if not closed:
        raise ConfigError("--time-scale and --request-rate reschedule the arrivals: they need --schedule closed "
                          "(a recorded schedule cannot react to them)")
    return arrival_scale(trace.arrival_ms, time_scale, request_rate), \
        "--request-rate" if request_rate is not None else "--time-scale"


def replayed_load(accs, selected, arrival_ns, h) -> dict | None:
    """offered_load of the selected requests on the replayed timeline (every instance's steps busy)."""
    first = np.minimum.reduce([acc.first_start for acc in accs])
    last = np.maximum.reduce([acc.last_end_ns for acc in accs])
    ran = selected & (last >= 0)
    if not ran.any():
        return None
    gpus = gpus_text(h.meta.get("gpu"))
    if len(accs) > 1 and gpus:
        gpus = f"{len(accs)} instances of {gpus}"
    return offered_load(arrival_ns[ran], first[ran], last[ran], sum(acc.total_ns for acc in accs), gpus)


def closed_body(inputs, accs, selected, instances, sharing, routing, block_all_layers, *, lockstep: bool,
                tier_gbps: float | None, async_loads=False, tier_chunks: int | None = None, chunk_blocks: int = 1,
                stack=None, open_lower=None, router=None, tiers=None, present=None, stores_done=None, queue=None,
                chunked_prefill=True, release=None):
    """What each instance's thread runs in closed loop (for run_instances), the list its engine
    statistics go to, and the router (None with one instance).

    What the backend asks of the loop: ``lockstep`` (the router plans steps in timeline order:
    emulated and virtual tiers); ``tier_gbps`` the shared tier's bandwidth, for the queue its
    instances' traffic waits in (TierQueue; None: no queue); an instance's load stream (``async_loads``) attaches to
    its arena where the backend it opened can be shared (backend_spec.KINDS), else it is a second
    context on the same file. ``tier_chunks`` (``--tier-capacity``): the engine's offload tier holds
    that many chunks of ``chunk_blocks`` blocks (shared_tier). ``stack`` (a StackSpec, ``--tiers``):
    the engine's tier is a TierStack (one for all instances when its levels are shared, else one
    each), and ``open_lower()`` opens an instance's contexts for the levels below the top.
    ``router``, ``tiers`` (one side of a disaggregated deployment, replay.closed.disagg): the router
    and the engine-side tier of each instance, made by the caller; ``present``: prompt tokens handed
    over with each request, ``stores_done``: filled per request with when its stores are done
    (ClosedLoop); ``queue``: the shared medium's queue, made by the caller (instead of ``tier_gbps``);
    ``chunked_prefill`` False: each prompt prefilled in one step (engine_steps); ``release``
    (kvemu.sessions.Release, one instance): session arrivals (engine_steps)."""
    n = instances
    level_queues = shared_level_queues(stack, n) if stack is not None else {}
    # a queue on a shared level needs the instances' steps in timeline order, as the top tier's does
    if router is None:
        router = Router(n, inputs, routing, selected, lockstep or bool(level_queues)) if n > 1 else None
    if tiers is not None:
        pass
    elif stack is not None:
        chunk_all = chunk_blocks * block_all_layers
        caps = [max(1, lv.capacity_bytes // chunk_all) for lv in stack.levels]
        # private levels one per instance, shared ones once
        one = TierStack(stack, caps, chunk_blocks, n, id_space=inputs.tables.id_space)
        tiers = [one.view(i) for i in range(n)]
    else:
        tiers = shared_tier(inputs.cfg, sharing, n, tier_chunks, chunk_blocks)
    if queue is None:
        queue = TierQueue(tier_gbps) if tier_gbps is not None else None
    stats: list = [None] * n

    def body(i, backend, acc, stop, progress):
        total = int(np.count_nonzero(selected))
        lb = open_load_stream(backend, backend.kind.shareable) if async_loads else None
        lower = None
        try:
            lower = open_lower() if stack is not None else None
            if lower is not None and async_loads:
                lower.open_streams()
            loop = ClosedLoop(inputs, acc, selected, router, i, tiers[i], queue, block_all_layers,
                              load_stream=lb, lower=lower, level_queues=level_queues, present=present,
                              stores_done=stores_done, chunked_prefill=chunked_prefill, release=release)
            stats[i] = loop.run(backend, None if progress is None else (lambda done: progress(min(done, total), total)),
                                stop=stop)
            if lower is not None:
                stats[i]["stack"] = {"load_ns": lower.load_ns, "store_ns": lower.store_ns, "top_ns": loop.top_ns,
                                     "opened": lower.opened, "level_tokens": loop.level_tokens,
                                     "late_tokens": loop.late_tokens, "queues": level_queues,
                                     "promoted_blocks": loop.promoted_blocks,
                                     "replayed_bytes": lower.moved_bytes()}
            extra = backend_stats(lb) if lb is not None else None
        finally:
            if lb is not None:
                lb.close()
            if lower is not None:
                lower.close()
        stats[i]["tier"] = getattr(tiers[i], "stack", tiers[i])
        return stats[i]["end_ns"], extra

    return body, stats, router


def shared_level_queues(stack, n: int) -> dict:
    """The queue of each shared emulated or virtual level below the top, with several instances: one
    medium of ``devices`` (default one per instance, as ``--tier-devices``) x its profile's
    bandwidth that every instance's traffic on the level waits in (TierQueue), as the top level's
    when it is shared. Level index -> TierQueue, with ``devices``, ``device_gbps`` and ``devices_from``
    set on it."""
    out = {}
    if n < 2:
        return out
    for k, lv in enumerate(stack.levels[1:], 1):
        spec = BackendSpec.parse(lv.backend)
        if lv.sharing != "shared" or spec.kind.mode == "measured":
            continue
        device_gbps = emulated_backend_args(spec)[0].bandwidth_gbps
        devices = lv.devices if lv.devices is not None else n
        q = TierQueue(devices * device_gbps)
        q.devices, q.device_gbps = devices, device_gbps
        q.devices_from = "devices=" if lv.devices is not None else "one per instance"
        out[k] = q
    return out


def stack_totals(stats: list, inputs) -> dict:
    """Per level of a tier stack, over all instances: what it held, served and moved (TierStack.summary),
    its time (the top level's on the replay's backend, the others' on their own contexts, summed
    over instances), a shared level's queue; and per request the tokens each level served
    (``level_tokens``) and those it held whose prefetch came too late (``late_tokens``)."""
    tpb = inputs.cfg.tokens_per_block
    one = stats[0]["tier"]
    spec = one.spec
    levels = [dict(x) for x in one.summary(tpb, 1)]
    n_levels = len(levels)
    time_ns = [sum(s["stack"]["top_ns"] for s in stats)] + [
        sum(s["stack"]["load_ns"][k] + s["stack"]["store_ns"][k] for s in stats) for k in range(1, n_levels)]
    level_tokens = [sum(s["stack"]["level_tokens"][k] for s in stats) for k in range(n_levels)]
    late = [s["stack"]["late_tokens"] for s in stats]
    late_tokens = [sum(x[k] for x in late) for k in range(n_levels)]
    opened = stats[0]["stack"]["opened"]
    queues = stats[0]["stack"]["queues"]
    promoted = sum(s["stack"]["promoted_blocks"] for s in stats)
    for k, lv in enumerate(levels):
        lv["time_ns"] = int(time_ns[k])
        lv["promoted_blocks"] = int(promoted) if k == 0 else 0
        lv["replayed_bytes"] = None if k == 0 else {
            op: sum(s["stack"]["replayed_bytes"][k][op] for s in stats) for op in ("load", "store")}
        lv["backend_opened"] = None if k == 0 else opened[k]
        q = queues.get(k)
        lv["queue"] = None if q is None else {"devices": q.devices, "device_gbps": q.device_gbps,
                                              "gbps": q.gbps, "from": q.devices_from,
                                              "bytes": int(q.bytes), "waited_ns": int(q.waited_ns)}
        lv.pop("bytes_in"), lv.pop("bytes_out")
    return {"spec": spec, "levels": levels, "level_tokens": level_tokens, "late_tokens": late_tokens,
            "shared_media": spec.shared_media(), "instances": len(stats),
            "instances_share": all(lv.sharing == "shared" for lv in spec.levels) and len(stats) > 1}


def closed_totals(stats: list, router, inputs) -> dict:
    """The engines' statistics over all instances."""
    tot = {k: sum(s[k] for s in stats) for k in ("steps", "c_steps", "entries", "finished", "hbm_evictions",
                                                 "queued_ns", "async_loads")}
    tot["lookups"] = sum(s.get("lookups", 0) for s in stats)
    tot["lookup_ns"] = sum(s.get("lookup_ns", 0) for s in stats)
    tot["end_ns"] = max(s["end_ns"] for s in stats)
    tiers = {id(s["tier"]): s["tier"] for s in stats if s["tier"] is not None}
    tot["tier_evictions"] = (sum(t.evictions for t in tiers.values()) if tiers else
                             sum(s["tier_evictions"] for s in stats))
    # the most blocks each tier held at once, over the distinct tiers (one when shared, one per instance
    # when replicated): what was resident
    tot["tier_peak_blocks"] = sum(t.peak for t in tiers.values()) if tiers else 0
    if any("stack" in s for s in stats):
        tot["stack"] = stack_totals(stats, inputs)
    if router is not None:
        tot["routing"] = router.policy
        tot["lockstep"] = router.lockstep
        tot["per_instance"] = [{"instance": i, "requests": int(np.count_nonzero(router.owner == i)),
                                **{k: int(s[k]) for k in ("steps", "c_steps", "finished", "end_ns", "queued_ns")}}
                               for i, s in enumerate(stats)]
    return tot
