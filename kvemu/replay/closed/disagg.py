"""Prefill/decode disaggregation in closed loop (docs/replay.md, "Prefill/decode disaggregation").

A deployment of P prefill and D decode instances, each with the trace's GPUs and parallelism,
each running the engine model on its own (replay.closed.ClosedLoop). A request is routed to a
prefill instance when it arrives (its side's router), prefilled there to its first token, and its
KV handed to a decode instance, which decodes it (vLLM's and Dynamo's disaggregated serving; the
first token the decode instance streams is the one its first step computes from the handed-over
KV, as a vLLM decode instance recomputes the prompt's last token).

The two sides are replayed one after the other: first every prefill instance (the router on the
trace's arrivals), then the hand-offs, then every decode instance (its router on the times the
hand-offs are done). Nothing a decode instance does delays a prefill instance (no back-pressure),
which is how a deployment with enough decode capacity runs; contention is within a side, for the
modelled links among the hand-offs on each sending and each receiving NIC (receiving_nics), and on
an emulated or virtual pool between the sides on the pool's medium (below).

Transfer paths (``--transfer``):

- ``rdma``: GPU to GPU over the RDMA NIC link (links.LINKS ``rdma-200g``, one NIC per GPU of the
  instance), layer by layer as the last prefill step computes each layer (vLLM's layer-wise
  connector hooks ``save_kv_layer``, used by LMCache's and the P2P NCCL connectors, and SGLang's
  Mooncake transfer backend); one setup cost per request; modelled (virtual time), FIFO on the
  prefill instance's NIC. The decode instance receives the KV in HBM.
- ``rdma-pull``: the same link, the whole KV once the prefill is done (vLLM's NixlConnector: the
  decode instance reads the prefill's blocks after it finished).
- ``host``: staged through host DRAM: prefill GPU to its host over the trace's host link, host to
  host over the NIC, host to the decode GPU over the host link, one hop after the other.
- ``pool``: the replay's tier is the pool (its backend, measured, emulated or virtual): the prefill
  stores every full block into it (the trace's offload policy) layer by layer, each layer's stores
  issued when its compute ends and run on the backend's store stream past the step (the backend's
  ``async`` store composition; vLLM's layer-wise ``save_kv_layer`` as LMCache's connector uses it,
  TraCT's layer-wise writes into CXL shared memory), and the decode instance's engine, from when
  the request's stores are done, finds the prompt's full blocks there and reads them layer by layer
  as its first step needs them (the tail of at most a block is recomputed): by DMA, each layer's
  loads on a fetch stream ahead of the compute (the pipelined composition, ``--overlap``, on the
  decode instances), so the step ends at max(fetch of layer l, compute of layer l - 1) + compute
  of layer l walked over the layers and a layer's load hides under the compute of the layer before
  it; a resident trace's decode reads them in place, inside each layer's attention. That is
  TraCT's decode side (arXiv 2512.18194: the decode worker reads the prefill's KV from CXL
  shared memory, no NIC on the path). Blocks already in the pool need no store, and a
  prefill finds them as a prefix hit (reuse across the deployment). With rdma and host, prefix
  reuse is each prefill instance's own (its HBM and its own tier).
- ``pool-serial``: the stores serial inside the prefill's steps (the backend's ``serial`` store
  composition) and the decode instance loading every layer before it computes (the replay's own
  composition): an upper bound on a hand-off through the pool.

On an emulated or virtual pool the two sides' traffic shares the pool's medium (MediumLog,
BehindQueue): the prefill side's, booked first, and the decode side's served in the medium's idle
time among it. On a measured pool the sides run one after the other on the real memory, so they do
not contend with each other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ...backend_spec import BackendSpec, emulated_backend_args
from ...deployment import HANDOFF_PROFILE
from ...errors import ConfigError
from ...figures import VIRTUAL_FACTS_MODE
from ...links import LINKS
from ...profiles import resolve_profile
from ..describe import backend_outcome
from ..instances import instance_views, run_instances
from .router import Router
from .run import closed_body, closed_totals
from .tierqueue import BehindQueue, MediumLog, shared_tier

#: Where each transfer path's figures come from and what bounds them (results' schedule.disagg.transfer).
PIPELINING = {"rdma": "layer-by-layer, under the last prefill step", "rdma-pull": "none: after the prefill",
              "host": "none: store and forward, hop after hop",
              "pool": "layer by layer: each layer's stores issued when its compute ends, on the backend's store "
                      "stream; once they are done, decode reads each layer as its first step needs it "
                      "(DMA pipelined with compute, or in place for a resident trace)",
              "pool-serial": "none: stores serial inside the prefill's steps, decode loads every layer first"}


@dataclass
class Handoff:
    """The hand-off of every request (arrays by request id): when the decode side may start it
    (``ready_ns``), what crossed the medium and how long it took, the part hidden under the prefill."""
    ready_ns: np.ndarray
    bytes: np.ndarray
    ns: np.ndarray
    overlap_ns: np.ndarray


def handoff_software(profile, objects: np.ndarray) -> tuple[np.ndarray, float]:
    """What a link hand-off pays for its transfer engine's software (profiles.Profile.transfer_parts, the
    parts a store over the same engine pays per request, per object and per byte): per request, the
    fixed ns (once per request and once per object moved: ``objects``, its layers x chunks), and the
    ns per byte (a host copy in series with the wire, as a store's per-byte parts are)."""
    parts = () if profile is None else profile.transfer_parts
    fixed = sum(p.ns_per_request for p in parts) + np.asarray(objects, np.float64) * sum(p.ns_per_io for p in parts)
    return fixed, float(sum(p.ns_per_byte for p in parts))


def handoff_engine(d):
    """The storage profile whose transfer engine a link hand-off runs on (``rdma:PROFILE``, default
    deployment.HANDOFF_PROFILE), or None for a hand-off through the pool; refused (ConfigError) if it is
    not a storage profile."""
    if d.pool:
        return None

    engine = resolve_profile(d.handoff_profile or HANDOFF_PROFILE)
    if engine.kind != "storage":
        raise ConfigError(f"--transfer {d.transfer}: {engine.name} is a memory tier; the hand-off's transfer "
                          f"engine is a storage profile's (its software parts)")
    return engine


def link_handoffs(path: str, owner: np.ndarray, prefilled: np.ndarray, p_end: np.ndarray, p_last: np.ndarray,
                  nbytes: np.ndarray, n_layers: int, nic, host_link, dest: np.ndarray | None = None,
                  sw_fixed_ns=None, sw_ns_per_byte: float = 0.0) -> Handoff:
    """The modelled hand-offs (rdma, rdma-pull, host): per prefill instance, its NIC serves them one
    after the other (FIFO by when each can start), and with ``dest`` (each request's decode
    instance) so does each decode instance's receiving NIC: a hand-off holds both NICs from its start
    to its last byte, and starts once both are free. A link's ``load_gbps`` is bytes per ns.

    rdma: layer l of a request's KV is ready when its last prefill step (of ``p_last`` ns, ending at
    ``p_end``) has computed it, at t0 + (l+1)/L of the step; each layer's 1/L of the bytes goes on the
    wire once ready and once the previous layer is sent; the first layer after the NIC's setup.

    Software (handoff_software): ``sw_fixed_ns`` per request is paid with the NIC's setup, before the
    first byte; ``sw_ns_per_byte`` is in series with the wire, each byte taking 1 / gbps + it."""
    n = len(p_end)
    ready = np.zeros(n, np.int64)
    ns = np.zeros(n, np.int64)
    overlap = np.zeros(n, np.int64)
    L = max(int(n_layers), 1)
    mine = np.flatnonzero(prefilled)
    t0 = p_end[mine] - p_last[mine]
    first = t0 + p_last[mine] / L if path == "rdma" else p_end[mine].astype(np.float64)
    free_s: dict = {}                 # each prefill instance's NIC, each decode instance's, free from
    free_r: dict = {}
    for k in np.argsort(first, kind="stable"):  # FIFO by when each can start, over all NICs
        r = int(mine[k])
        i, j = int(owner[r]), (None if dest is None else int(dest[r]))
        free = max(free_s.get(i, 0.0), free_r.get(j, 0.0) if j is not None else 0.0)
        b = float(nbytes[r])
        start = max(free, float(first[k]))
        fixed = 0.0 if sw_fixed_ns is None else float(sw_fixed_ns[r])
        wire = 1.0 / nic.load_gbps + sw_ns_per_byte  # ns per byte: the wire and the software in series
        if path == "rdma":
            d, per = float(p_last[mine[k]]), b / L * wire
            end = max(start + nic.setup_ns + fixed + L * per,
                      float(t0[k]) + 2 * d / L + (L - 1) * per if L > 1 else 0.0, float(p_end[r]) + per)
        elif path == "rdma-pull":
            end = start + nic.setup_ns + fixed + b * wire
        else:  # host: GPU -> host, host -> host, host -> GPU (a host link without a limit: no time)
            hop = host_link.setup_ns + (b / host_link.store_gbps if host_link.store_gbps > 0 else 0.0)
            end = start + 2 * hop + nic.setup_ns + fixed + b * wire
        end_ns = int(np.ceil(end))
        free_s[i] = float(end_ns)
        if j is not None:
            free_r[j] = float(end_ns)
        ready[r] = max(end_ns, int(p_end[r]))
        ns[r] = end_ns - int(np.floor(start))
        overlap[r] = max(0, min(end_ns, int(p_end[r])) - int(np.floor(start)))
    return Handoff(ready, np.where(prefilled, nbytes, 0).astype(np.int64), ns, overlap)


def receiving_nics(ho: Handoff, d, D: int, local, prefilled, arrival_ns, handoffs):
    """The link hand-offs with each decode instance's receiving NIC a FIFO queue too, which needs
    each request's decode instance before its hand-off: exact with one decode instance; with
    round-robin decode routing, the k-th request to reach the decode side (KV arrived, or a local
    prompt arrived) goes to instance k mod D, found by iterating until the arrival order is stable
    (the router then keeps that assignment); least-loaded and prefix-aware decode routing decide on
    the decode side's state, after the hand-off: the receiving NICs are then not modelled.
    ``handoffs(dest)``: link_handoffs with those instances. Returns (the hand-offs, dest, how the
    receiving NIC was treated: ``modelled`` or why not)."""
    if D > 1 and d.decode_routing != "round-robin":
        return ho, None, f"not modelled with --decode-routing {d.decode_routing}"
    arr = np.asarray(arrival_ns, np.int64)
    goes = local | prefilled
    dest = np.zeros(len(arr), np.int64)
    for it in range(16 if D > 1 else 1):
        arr_d = np.where(local, arr, np.where(prefilled, ho.ready_ns, 0))
        order = np.flatnonzero(goes)
        order = order[np.argsort(arr_d[order], kind="stable")]
        new = np.zeros(len(arr), np.int64)
        new[order] = np.arange(len(order)) % D
        if it and np.array_equal(new, dest):
            break
        dest = new
        ho = handoffs(dest)
    return ho, dest, "modelled"


def check_disagg(opts, spec, policy: str) -> None:
    """What a disaggregated replay refuses before anything runs."""
    d = opts.disagg
    if policy == "resident" and not d.pool:
        raise ConfigError(f"--transfer {d.path}: a resident trace's KV lives in the pool, not in the GPUs' HBM; "
                          f"hand it off with --transfer pool or pool-serial")
    if d.pool and policy not in ("offload", "resident"):
        raise ConfigError(f"--transfer {d.path} needs an offload or resident trace: its prefill stores the KV into "
                          f"the pool (this trace's tier policy is {policy}); use --transfer rdma, or record with "
                          f"--tier-policy offload")
    if d.pool_spec is not None:
        if BackendSpec.parse(d.pool_spec) != spec:
            raise ConfigError(f"--transfer {d.transfer}: the pool is the replay's tier ({spec.text()}); give the "
                              f"pool as the backend")


def run_disagg(sched, ctx, accs):
    """Replays the deployment (sched: the ClosedSchedule; accs: P prefill then D decode accumulators).
    Returns the backends' outcome (both sides'); leaves the engines' totals with ``disagg`` in
    ``sched.stats`` and the per-request hand-off in ``sched.disagg``."""
    o, spec = sched.opts, ctx.spec
    d = o.disagg
    P, D = d.prefill_instances, d.decode_instances
    inputs = sched.inputs
    cfg = inputs.cfg
    check_disagg(o, spec, cfg.tier_policy)
    tpb = cfg.tokens_per_block
    n_req = len(inputs.arrival_ns)
    sel = ctx.sel.selected
    lockstep = spec.kind.lockstep
    pool = d.pool
    layerwise = d.path == "pool"
    x = ctx.xfer
    block_all = x.block_bytes * x.n_layers
    tier_chunks = sched._bound_tier(ctx.arena, block_all)
    inputs = sched.inputs  # _bound_tier may bound the engine's tier
    inp = np.asarray(inputs.input_tokens, np.int64)
    local = inp < d.threshold_tokens if d.threshold_tokens is not None else np.zeros(n_req, bool)
    remote = ~local
    sharing = "shared" if pool else "replicated"
    touched = ctx.arena.touched
    virtual = spec.kind.virtual
    key_of, off_of, cb = ctx.arena.key_of, ctx.arena.off_of, x.chunk_blocks
    async_loads = o.schedule.kv_load == "async"
    accs_p, accs_d = accs[:P], accs[P:]
    # one engine-side tier for both sides with the pool (the decode engines find the prefills' blocks
    # there), else one per instance
    tiers_p = shared_tier(cfg, sharing, P, tier_chunks, cb)
    tiers_d = [tiers_p[0]] * D if pool else shared_tier(cfg, "replicated", D, tier_chunks, cb)

    raw: list = []

    def views_of(n):
        """One arena for the side's instances (the engine-side tiers are shared or each instance's own):
        a block's store or load is timed alike in either; as _arena sizes it, LRU slots included."""
        views = instance_views(touched[:n], n, "shared", virtual, key_of, off_of, cb)
        if ctx.arena.tier_slots is not None:  # the arena holds fewer chunks than the replay touches
            for v in views:
                v["n_slots"], v["slot_of"] = ctx.arena.capacity * cb, None
        return views

    def side(accs_side, side_inputs, selected, policy, order, tiers, timing, present=None, stores_done=None,
             queue=None, chunked=True, fixed=None, geometry=None):
        n = len(accs_side)
        views = views_of(n)
        for acc, v in zip(accs_side, views):
            acc.slot_of = v["slot_of"]
        router = Router(n, side_inputs, policy, selected, lockstep, order=order, fixed=fixed)
        body, stats, _ = closed_body(side_inputs, accs_side, selected, n, "shared", policy, block_all,
                                     lockstep=lockstep, tier_gbps=None, async_loads=async_loads,
                                     tier_chunks=tier_chunks, chunk_blocks=cb, router=router, tiers=tiers,
                                     present=present, stores_done=stores_done, queue=queue,
                                     chunked_prefill=chunked)
        outcome = run_instances(views, accs_side, ctx.trace, ctx.sel.s0, ctx.sel.s1, ctx.spec_text,
                                ctx.geometry if geometry is None else geometry,
                                x.block_bytes, o.tier.emulate_missing, ctx.warn, ctx.progress, ctx.sel.n_steps, timing,
                                body=body, on_error=router.fail, raw=raw)
        return views, stats, router, outcome

    # 1. prefill: every remote request to its first token (an engine with one output token each)
    sel_p = sel & remote
    p_start = np.full(n_req, np.iinfo(np.int64).max)
    p_end = np.full(n_req, -1, np.int64)
    p_last = np.zeros(n_req, np.int64)
    owner_p = np.full(n_req, -1, np.int32)
    views_p, stats_p, outcome_p = [], [], None
    # the pool's stores: layer by layer on the backend's store stream (async composition: each layer's
    # stores issued when its compute ends), or serial inside the prefill's steps (pool-serial)
    timing_p = dict(ctx.timing, store_mode="async" if layerwise else "serial") if pool else ctx.timing
    stores_done = np.full(n_req, -1, np.int64) if layerwise else None
    # the pool's medium shared by the two sides, on an emulated or virtual pool
    medium = None
    if pool and lockstep:
        devices = o.tier.devices if o.tier.devices is not None else P + D
        device_gbps = emulated_backend_args(spec)[0].bandwidth_gbps
        medium = {"devices": devices, "device_gbps": device_gbps, "gbps": devices * device_gbps,
                  "from": "--tier-devices" if o.tier.devices is not None else "one per instance"}
    queue_p = MediumLog(medium["gbps"], wait=P > 1) if medium else None
    if sel_p.any():
        for acc in accs_p:
            acc.selected = np.ones(n_req, bool)  # every prefill's end, selected or not, starts a hand-off
        inputs_p = replace(inputs, output_tokens=np.ones(n_req, np.asarray(inputs.output_tokens).dtype))
        views_p, stats_p, router_p, outcome_p = side(accs_p, inputs_p, sel_p, d.prefill_routing,
                                                     np.flatnonzero(remote), tiers_p, timing_p,
                                                     stores_done=stores_done, queue=queue_p)
        owner_p = router_p.owner
        for acc in accs_p:
            p_start = np.minimum(p_start, acc.first_start)
            p_end = np.maximum(p_end, acc.prefill_end_ns)
            p_last = np.maximum(p_last, np.where(acc.prefill_end_ns >= 0, acc.prefill_step_ns, 0))
    else:
        for acc in accs_p:
            acc.selected = np.zeros(n_req, bool)
    prefilled = remote & (p_end >= 0)

    # 2. the hand-offs
    kv_links = ctx.link_lanes
    nic = LINKS["rdma-200g"].with_lanes(kv_links)
    prompt_bytes = (-(-inp // tpb)) * block_all  # every block of the prompt, the last one partial
    dest, receiving, engine = None, None, None
    if pool:  # decode may start once the request's stores into the pool are done
        ready = np.maximum(p_end, stores_done) if layerwise else p_end
        ho = Handoff(np.where(prefilled, ready, 0), np.zeros(n_req, np.int64), np.zeros(n_req, np.int64),
                     np.zeros(n_req, np.int64))
    else:
        engine = handoff_engine(d)
        blocks = -(-inp // tpb)
        objects = x.n_layers * -(-blocks // cb)  # one object per chunk of blocks, per layer
        sw_fixed, sw_byte = handoff_software(engine, objects)
        ho = link_handoffs(d.path, owner_p, prefilled, p_end, p_last, prompt_bytes, x.n_layers, nic, ctx.link,
                           sw_fixed_ns=sw_fixed, sw_ns_per_byte=sw_byte)
        ho, dest, receiving = receiving_nics(ho, d, D, local, prefilled, inputs.arrival_ns,
                                             lambda dest: link_handoffs(d.path, owner_p, prefilled, p_end, p_last,
                                                                        prompt_bytes, x.n_layers, nic, ctx.link, dest,
                                                                        sw_fixed_ns=sw_fixed, sw_ns_per_byte=sw_byte))

    # 3. decode: remote requests from when their KV is there, local ones when they arrive
    arr = np.asarray(inputs.arrival_ns, np.int64)
    arr_d = np.where(local, arr, np.where(prefilled, ho.ready_ns, 0))
    goes = local | prefilled
    if not goes[sel].all():
        raise ConfigError("some selected requests were not prefilled (the prefill side stopped early)")
    order_d = np.flatnonzero(goes)
    order_d = order_d[np.argsort(arr_d[order_d], kind="stable")]
    inputs_d = replace(inputs, arrival_ns=arr_d)
    chunked_d = d.decode_chunked_prefill == "on"
    if not chunked_d:  # vLLM needs max_num_batched_tokens >= max_model_len without chunked prefill
        whole = np.where(local, inp, np.where(prefilled, inp - (np.maximum(inp - 1, 0) // tpb) * tpb, 0))
        whole = int(whole[goes].max()) if goes.any() else 0
        inputs_d = replace(inputs_d, cfg=replace(cfg, max_num_batched_tokens=max(cfg.max_num_batched_tokens, whole)))
    present = None if pool else np.where(prefilled, inp - 1, 0)
    fixed = dest if not pool and D > 1 and receiving == "modelled" else None
    queue_d = BehindQueue(medium["gbps"], queue_p.busy) if medium else None
    # the pool read layer by layer as the decode's steps need it: the pipelined composition (geometry's
    # overlap flag, replay.run: (layers, replayed layers, overlap, chunk blocks, layout)); a resident trace's
    # decode reads the pool in place, inside each layer's attention, as it is
    geom_d = (*ctx.geometry[:2], True, *ctx.geometry[3:]) if layerwise and cfg.tier_policy != "resident" else None
    views_d, stats_d, router_d, outcome_d = side(accs_d, inputs_d, sel, d.decode_routing, order_d, tiers_d,
                                                 ctx.timing, present, queue=queue_d, chunked=chunked_d,
                                                 fixed=fixed, geometry=geom_d)
    owner_d = router_d.owner

    # what each request's decode row says: its prefill's compute, KV and queueing folded in
    d_start = np.full(n_req, np.iinfo(np.int64).max)
    d_load = np.zeros(n_req, np.int64)
    d_load_blocks = np.zeros(n_req, np.int64)
    d_exposed = np.zeros(n_req, np.int64)  # the first decode step's time past its compute
    for acc in accs_d:
        d_exposed = np.maximum(d_exposed, acc.prefill_step_ns - acc.prefill_step_compute_ns)
        d_start = np.minimum(d_start, acc.first_start)
        d_load += acc.req_kv["load"]
        d_load_blocks += acc.req_blocks["load"]
    p_store = sum((acc.req_kv["store"] for acc in accs_p), np.zeros(n_req, np.int64))
    p_store_blocks = sum((acc.req_blocks["store"] for acc in accs_p), np.zeros(n_req, np.int64))
    ran_p = [acc for acc in accs_p if acc.found_tokens is not None]  # none when every prompt stayed local
    p_found = sum((acc.found_tokens for acc in ran_p), np.zeros(n_req, np.int64))
    p_found_tier = sum((acc.found_in_tier_tokens for acc in ran_p), np.zeros(n_req, np.int64))
    first_token = np.full(n_req, -1, np.int64)
    for acc in accs_d:
        first_token = np.maximum(first_token, acc.prefill_end_ns)
    if pool:
        ho.bytes = np.where(prefilled, (p_store_blocks + d_load_blocks) * block_all, 0)
        ho.ns = np.where(prefilled, p_store + d_load, 0)
        if layerwise:  # the stores' time not after the prefill's end
            ho.overlap_ns = np.where(prefilled, np.maximum(0, p_store - (ho.ready_ns - p_end)), 0)
    for j, acc in enumerate(accs_d):
        mine = owner_d == j
        rp = mine & prefilled
        for op in acc.req_kv:
            acc.req_kv[op][rp] += sum(a.req_kv[op][rp] for a in accs_p)
            acc.req_blocks[op][rp] += sum(a.req_blocks[op][rp] for a in accs_p)
        acc.req_compute[rp] += sum(a.req_compute[rp] for a in accs_p)
        acc.req_stall[rp] += sum(a.req_stall[rp] for a in accs_p)
        if acc.found_tokens is not None:
            acc.found_tokens = np.where(prefilled, p_found, acc.found_tokens)
            acc.found_in_tier_tokens = np.where(prefilled, p_found_tier, acc.found_in_tier_tokens)
        acc.first_start = np.where(rp, p_start, acc.first_start)
        acc.selected = sel & mine
    for acc in accs_p:
        acc.selected = np.zeros(n_req, bool)

    # TTFT in four parts that add up to it (docs/replay.md)
    # the decode's loads on the first token's path: all of them, loaded before the compute (pool-serial); read
    # layer by layer (pool), the part not hidden under the step's compute
    on_path = np.where(prefilled & pool, np.clip(np.minimum(d_load, d_exposed) if layerwise else d_load, 0,
                                                 np.maximum(first_token - d_start, 0)), 0)
    st = np.where(prefilled & pool & (not layerwise), np.minimum(p_store, np.maximum(p_end - p_start, 0)), 0)
    parts = {
        "ttft_queue_ns": np.where(prefilled, (p_start - arr) + (d_start - ho.ready_ns), d_start - arr),
        "ttft_prefill_ns": np.where(prefilled, p_end - p_start - st, first_token - d_start),
        "ttft_handoff_ns": np.where(prefilled, ho.ready_ns - p_end + st + on_path, 0),
        "ttft_first_decode_ns": np.where(prefilled, first_token - d_start - on_path, 0),
    }
    pool_blocks = np.where(prefilled & pool, p_found // tpb, 0)
    sched.disagg = {"prefill_instance": np.where(prefilled, owner_p, -1).astype(np.int32),
                    "decode_instance": owner_d.astype(np.int32), "handoff_bytes": ho.bytes.astype(np.int64),
                    "handoff_ns": ho.ns.astype(np.int64), "handoff_overlap_ns": ho.overlap_ns.astype(np.int64),
                    "handoff_pool_blocks": pool_blocks.astype(np.int64),
                    **{k: v.astype(np.int64) for k, v in parts.items()}}

    stats = closed_totals(list(stats_p) + list(stats_d), None, inputs)
    first = int(arr[sel].min())
    last = max([int(a.last_end_ns.max()) for a in accs_d] + [0])
    span = max(last - first, 1)
    if pool:
        # measured, emulated or virtual: as the run's figures (figures.kind) say of the same backend
        mode = "virtual" if outcome_d.mode == VIRTUAL_FACTS_MODE else outcome_d.mode
        bound = (f"the pool's backend ({outcome_d.spec}); " +
                 ("prefill stores layer by layer on the store stream" if layerwise else
                  "prefill stores serial in their steps (an upper bound on a layer-wise save)") +
                 ("; the two sides share the medium, the prefill side's traffic first" if medium else
                  "; the two sides run one after the other on the measured memory, not contending"))
        link = None
    else:
        mode = "modelled"
        link = nic.name if d.path != "host" else f"{ctx.link.name}+{nic.name}+{ctx.link.name}"
        bound = ("link profiles: bytes / GB/s + one setup per transfer; one FIFO queue per prefill instance's NIC"
                 + ("; and per decode instance's, a hand-off holding both NICs from its start to its last byte"
                    if receiving == "modelled" else "; the receiving NICs not a bottleneck (" + receiving + ")")
                 + "; the switch is not a bottleneck; the whole prompt's blocks are sent")
    stats["disagg"] = {
        "prefill_instances": P, "decode_instances": D,
        "transfer": {"path": d.path, "spec": d.transfer if not pool else f"{d.path}:{outcome_d.spec}",
                     "link": link, "receiving_nic": None if pool else receiving, "mode": mode, "bound": bound, "pipelining": PIPELINING[d.path],
                     "medium": None if medium is None else {
                         **medium, "bytes": int(queue_p.bytes + queue_d.bytes),
                         "waited_ns": int(queue_p.waited_ns + queue_d.waited_ns),
                         "decode_behind_prefill_ns": int(queue_d.behind_ns)}},
        "software": None if engine is None else {
            "profile": engine.name, "generation": engine.generation or None, "figures": "modelled",
            "parts": {p.name: p.to_dict() for p in engine.transfer_parts},
            "note": "the transfer engine's parts (path 'transfer') of that storage profile, as a store on it pays "
                    "them: per request and per object with the NIC's setup, per byte in series with the wire"},
        "routing": {"prefill": d.prefill_routing, "decode": d.decode_routing},
        "conditional_threshold": d.threshold_tokens,
        "decode_chunked_prefill": d.decode_chunked_prefill,
        "decode_max_batched_tokens": int(inputs_d.cfg.max_num_batched_tokens),
        "local_requests": int(np.count_nonzero(local & sel)),
        "gpu_busy": {"prefill": round(sum(a.total_ns for a in accs_p) / (P * span), 6),
                     "decode": round(sum(a.total_ns for a in accs_d) / (D * span), 6)},
    }
    sched.stats = stats
    ctx.arena.views = (views_p or views_of(P)) + views_d
    if len(raw) == 1:
        return outcome_d
    # both sides' backends as one outcome: the prefill instances' statistics, then the decode instances'
    (state_p, st_p, prep_p, ends_p), (state_d, st_d, prep_d, ends_d) = raw
    return backend_outcome(state_d, list(st_p) + list(st_d), max(prep_p, prep_d), end_ns=list(ends_p) + list(ends_d))
