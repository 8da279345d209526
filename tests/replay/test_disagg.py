"""Prefill/decode disaggregation in closed loop (replay.closed.disagg), against timelines built by
hand here: three requests far apart in time (none waits for another) through one prefill and one
decode instance, over each transfer path; each step's compute from the roofline the docs give
(test_closed_loop's oracle), each tier access a fixed cost (virtual time), each modelled transfer
walked layer by layer. And: a deployment where every prompt is served where it arrives is the
colocated replay, exactly."""

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import make_workload, record
from kvemu.errors import ConfigError, OptionError
from kvemu.links import LINKS
from kvemu.models import resolve_model
from kvemu.replay import (DataPathOptions, DisaggOptions, OutputOptions, ReplayOptions, StoreOptions, replay)

TPB = 16
LAYERS = 32                          # llama3-8b
BLOCK_ALL = 65536 * LAYERS           # a block of every layer, bytes
BW = 64.0                            # GB/s: a block-layer access moves in 1024 ns
LAT = 1000                           # ns per access, on top
ACCESS = LAT + 65536 / BW            # one block of one layer, serially (concurrency=1)
ARRIVALS = [0.0, 500.0, 1000.0]      # ms: each request is long done when the next arrives
INPUTS = [150, 90, 200]              # none a multiple of the block: the last block is partial
OUTPUTS = [4, 3, 5]
SPEC = f"vemu:cxl-pool,latency_ns={LAT},bandwidth_gbps={BW},concurrency=1"


def roofline_ns(tokens, pairs, touched):
    """docs: GPU time of a step on one H100 SXM at mfu 0.5 / mbu 0.7 plus 300 us (llama3-8b)."""
    m = resolve_model("llama3-8b")
    flops = 2.0 * m.active_params * tokens + 2.0 * m.layers * m.attention_heads * (m.qk_head_dim + m.v_head_dim) * pairs
    nbytes = min(m.params, m.active_params * max(1, tokens)) * 2 + m.kv_bytes_per_token * touched
    return int(math.hypot(flops / (989e12 * 0.5), nbytes / (3350e9 * 0.7)) * 1e9 + 300e3)


def decode_steps_ns(inp, out):
    """The decode steps after the first token: step g attends to inp + g tokens."""
    return [roofline_ns(1, inp + g, inp + g) for g in range(1, out)]


def rdma_layerwise_end(t0, d, nbytes, nic, nic_free=0.0):
    """Layer by layer: layer l is computed at t0 + (l+1) d / L; it goes on the wire when computed
    and when the layer before it has gone, the first after the NIC is free and its setup."""
    per = nbytes / LAYERS / nic.load_gbps
    end = None
    for layer in range(LAYERS):
        ready = t0 + (layer + 1) * d / LAYERS
        end = max(ready, nic_free) + nic.setup_ns + per if end is None else max(ready, end) + per
    return max(t0 + d / LAYERS, nic_free), end


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("disagg")
    w = make_workload(ARRIVALS, INPUTS, OUTPUTS, hashes=[[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    return {"none": record(w, d / "none.parquet", tier_policy="none"),
            "offload": record(w, d / "offload.parquet", tier_policy="offload")}


def run(trace, out, transfer, link="cpu", **disagg):
    opts = ReplayOptions(datapath=DataPathOptions(link=link, chunk_tokens=TPB), stores=StoreOptions(timing="serial"),
                         disagg=DisaggOptions(1, 1, transfer, **disagg), output=OutputOptions(force=True))
    replay(trace, SPEC, opts, out=out)
    t = pq.read_table(out)
    return t.to_pydict(), json.loads(t.schema.metadata[b"kvemu"])


def check_parts(r):
    total = [a + b + c + d for a, b, c, d in zip(r["ttft_queue_ns"], r["ttft_prefill_ns"], r["ttft_handoff_ns"],
                                                 r["ttft_first_decode_ns"])]
    assert [t / 1e6 for t in total] == pytest.approx(r["ttft_ms"], abs=1e-6)


@pytest.mark.parametrize("transfer", ["rdma", "rdma-pull", "host"])
def test_link_handoffs_follow_a_hand_built_timeline(traces, tmp_path, transfer):
    link = "pcie5-x16" if transfer == "host" else "cpu"
    r, meta = run(traces["none"], tmp_path / "r.parquet", transfer, link=link)
    nic, pcie = LINKS["rdma-200g"], LINKS["pcie5-x16"]
    for i, (a, inp, out) in enumerate(zip(ARRIVALS, INPUTS, OUTPUTS)):
        arr = round(a * 1e6)
        prefill = roofline_ns(inp, inp * (inp + 1) / 2, inp)       # one chunk, no KV through the tier
        p_end = arr + prefill
        nbytes = -(-inp // TPB) * BLOCK_ALL                        # every block, the partial one too
        if transfer == "rdma":
            start, end = rdma_layerwise_end(arr, prefill, nbytes, nic)
        elif transfer == "rdma-pull":
            start, end = p_end, p_end + nic.setup_ns + nbytes / nic.load_gbps
        else:
            hop = pcie.setup_ns + nbytes / pcie.store_gbps
            start, end = p_end, p_end + hop + nic.setup_ns + nbytes / nic.load_gbps + hop
        ready = max(math.ceil(end), p_end)
        first = roofline_ns(1, inp, inp)                           # the prompt's last token, its KV handed over
        ttft = ready + first - arr
        assert r["handoff_bytes"][i] == nbytes
        assert r["handoff_ns"][i] == pytest.approx(end - start, abs=2)
        assert r["handoff_overlap_ns"][i] == pytest.approx(max(0, min(end, p_end) - start), abs=2)
        assert r["handoff_pool_blocks"][i] == 0
        assert r["ttft_queue_ns"][i] == 0
        assert r["ttft_prefill_ns"][i] == prefill
        assert r["ttft_handoff_ns"][i] == ready - p_end
        assert r["ttft_first_decode_ns"][i] == first
        assert r["ttft_ms"][i] == pytest.approx(ttft / 1e6, abs=1e-6)
        e2el = ttft + sum(decode_steps_ns(inp, out))
        assert r["e2el_ms"][i] == pytest.approx(e2el / 1e6, abs=1e-6)
        assert (r["prefill_instance"][i], r["decode_instance"][i]) == (0, 0)
    check_parts(r)
    if transfer == "rdma":  # layer by layer, most of the transfer runs under the prefill
        assert all(o > 0.5 * n for o, n in zip(r["handoff_overlap_ns"], r["handoff_ns"]))
    d = meta["schedule"]["disagg"]
    assert d["prefill_instances"] == 1 and d["decode_instances"] == 1
    assert d["transfer"]["path"] == transfer and d["transfer"]["mode"] == "modelled"
    assert set(d["gpu_busy"]) == {"prefill", "decode"} and 0 < d["gpu_busy"]["prefill"] < 1


def test_handoffs_of_one_step_queue_on_the_prefill_instances_nic(tmp_path):
    """Two prompts prefilled in one step: their layers are computed together, and the second's
    hand-off waits on the NIC for the first's (FIFO); the decode instance starts each when it is in."""
    w = make_workload([0.0, 0.0], [3000, 3000], [2, 2])
    tr = record(w, tmp_path / "t.parquet", tier_policy="none")
    r, _ = run(tr, tmp_path / "r.parquet", "rdma")
    nic = LINKS["rdma-200g"]
    # one step of both prompts: 6000 tokens, each attending to its own
    prefill = roofline_ns(6000, 2 * 3000 * 3001 / 2, 6000)
    nbytes = -(-3000 // TPB) * BLOCK_ALL
    s0, e0 = rdma_layerwise_end(0, prefill, nbytes, nic)
    s1, e1 = rdma_layerwise_end(0, prefill, nbytes, nic, nic_free=math.ceil(e0))
    assert r["ttft_prefill_ns"] == [prefill, prefill]
    assert r["handoff_ns"][0] == pytest.approx(e0 - s0, abs=2)
    assert r["handoff_ns"][1] == pytest.approx(e1 - s1, abs=2)
    assert r["ttft_handoff_ns"] == [max(math.ceil(e0), prefill) - prefill, math.ceil(e1) - prefill]
    assert r["ttft_handoff_ns"][1] > r["ttft_handoff_ns"][0] + nbytes / nic.load_gbps * 0.99
    check_parts(r)


@pytest.mark.parametrize("transfer, decode", [("rdma-pull", 1), ("rdma", 1), ("rdma-pull", 2)])
def test_handoffs_from_two_prefill_instances_queue_on_the_receiving_nic(tmp_path, transfer, decode):
    """Two prompts prefilled at once on two prefill instances: with one decode instance the second
    hand-off waits for the first on its receiving NIC (FIFO, a hand-off holding both NICs); with two
    (round-robin) each has a NIC of its own and they run side by side."""
    w = make_workload([0.0, 0.0], [3000, 3000], [2, 2])
    tr = record(w, tmp_path / "t.parquet", tier_policy="none")
    opts = ReplayOptions(datapath=DataPathOptions(link="cpu", chunk_tokens=TPB), stores=StoreOptions(timing="serial"),
                         disagg=DisaggOptions(2, decode, transfer), output=OutputOptions(force=True))
    res = replay(tr, SPEC, opts, out=tmp_path / "r.parquet")
    r = res.table().to_pydict()
    nic = LINKS["rdma-200g"]
    prefill = roofline_ns(3000, 3000 * 3001 / 2, 3000)             # each alone on its prefill instance
    nbytes = -(-3000 // TPB) * BLOCK_ALL
    if transfer == "rdma-pull":
        s0, e0 = prefill, prefill + nic.setup_ns + nbytes / nic.load_gbps
        s1 = math.ceil(e0) if decode == 1 else prefill
        e1 = s1 + nic.setup_ns + nbytes / nic.load_gbps
    else:
        s0, e0 = rdma_layerwise_end(0, prefill, nbytes, nic)
        s1, e1 = rdma_layerwise_end(0, prefill, nbytes, nic, nic_free=math.ceil(e0))
    assert r["prefill_instance"] == [0, 1]
    assert r["decode_instance"] == ([0, 0] if decode == 1 else [0, 1])
    assert r["handoff_ns"][0] == pytest.approx(e0 - s0, abs=2)
    assert r["handoff_ns"][1] == pytest.approx(e1 - s1, abs=2)
    assert r["ttft_handoff_ns"] == [math.ceil(e0) - prefill, math.ceil(e1) - prefill]
    check_parts(r)
    assert res.meta["schedule"]["disagg"]["transfer"]["receiving_nic"] == "modelled"


def layerwise_stores_done(t0, compute, store_layer):
    """docs (async composition): layer l's compute takes compute / L (the remainder one ns each over
    the first layers); when it ends, the layer's stores go on the store stream after the ones before."""
    ce = sd = t0
    for layer in range(LAYERS):
        ce += compute // LAYERS + (1 if layer < compute % LAYERS else 0)
        sd = max(sd, ce) + store_layer
    return ce, sd


def layerwise_first_step(compute, load_layer):
    """docs (pipelined composition): layer l's load goes on the fetch stream after layer l - 1's; layer
    l computes once its load is there and layer l - 1 has computed. Returns (the step's time, the time
    past its compute: the loads not hidden)."""
    fd = ce = 0
    for layer in range(LAYERS):
        fd += load_layer
        ce = max(ce, fd) + compute // LAYERS + (1 if layer < compute % LAYERS else 0)
    return ce, ce - compute


@pytest.mark.parametrize("transfer", ["pool", "pool-serial"])
def test_pool_handoff_stores_in_prefill_and_loads_in_decode(traces, tmp_path, transfer):
    """pool: each layer's stores start when the prefill has computed the layer and the layer's
    before them are stored (layer-wise save); the decode instance starts when they are done and
    reads each layer as its first step needs it, the load of layer l under the compute of l - 1.
    pool-serial: the stores inside the prefill's step, after its compute, and the decode instance
    loading every layer before it computes. (Changed on purpose with TraCT's pool hand-off, issue 40:
    pool's decode no longer loads all of the KV first.)"""
    r, meta = run(traces["offload"], tmp_path / "p.parquet", transfer)
    for i, (a, inp, out) in enumerate(zip(ARRIVALS, INPUTS, OUTPUTS)):
        arr = round(a * 1e6)
        stored = inp // TPB                                        # every full block, into the pool
        store_ns = LAYERS * stored * ACCESS
        compute = roofline_ns(inp, inp * (inp + 1) / 2, inp)
        if transfer == "pool":
            p_end, ready = layerwise_stores_done(arr, compute, stored * ACCESS)
            assert p_end == arr + compute
            assert ready - p_end < store_ns                        # most of the stores under the prefill
        else:
            p_end = ready = arr + compute + store_ns               # serial stores inside the step
        hit = (inp - 1) // TPB                                     # the decode engine finds them in the pool
        load_ns = LAYERS * hit * ACCESS
        k = inp - hit * TPB                                        # the tail it recomputes
        comp_d = roofline_ns(k, k * (hit * TPB + (k + 1) / 2), hit * TPB + k)
        first, on_path = (layerwise_first_step(comp_d, hit * ACCESS) if transfer == "pool"
                          else (comp_d + load_ns, load_ns))
        if transfer == "pool":  # the closed form: the first layer's load, then what each outlasts its compute
            a_l, c_l = hit * ACCESS, comp_d / LAYERS
            assert on_path == pytest.approx(a_l + (LAYERS - 1) * max(0.0, a_l - c_l), abs=LAYERS)
            assert on_path < load_ns
        ttft = ready + first - arr
        assert r["handoff_bytes"][i] == (stored + hit) * BLOCK_ALL
        assert r["handoff_ns"][i] == pytest.approx(store_ns + load_ns, abs=2)
        overlap = store_ns - (ready - p_end) if transfer == "pool" else 0
        assert r["handoff_overlap_ns"][i] == pytest.approx(overlap, abs=2)
        assert r["handoff_pool_blocks"][i] == 0                    # no prefix shared between them
        assert r["ttft_queue_ns"][i] == 0
        assert r["ttft_prefill_ns"][i] == pytest.approx(compute, abs=2)
        exposed = ready - p_end if transfer == "pool" else store_ns
        assert r["ttft_handoff_ns"][i] == pytest.approx(exposed + on_path, abs=2)
        assert r["ttft_first_decode_ns"][i] == pytest.approx(first - on_path, abs=2)
        assert r["ttft_ms"][i] == pytest.approx(ttft / 1e6, abs=1e-6)
        assert r["kv_bytes_stored"][i] == stored * BLOCK_ALL and r["kv_bytes_loaded"][i] == hit * BLOCK_ALL
    check_parts(r)
    t = meta["schedule"]["disagg"]["transfer"]
    assert t["path"] == transfer and t["mode"] == meta["figures"]["kind"] == "virtual" and t["link"] is None
    assert t["spec"] == f"{transfer}:{SPEC}" and t["medium"]["devices"] == 2


@pytest.mark.parametrize("devices", [None, 1])
def test_decode_loads_queue_behind_the_prefill_sides_stores_on_the_pool(tmp_path, devices):
    """Request A (40 tokens) is prefilled alone; B (200 tokens) arrives during it and is prefilled
    in the next step, whose stores occupy the pool's medium from that step's start for their bytes /
    bandwidth (the prefill side's traffic goes first). A's decode starts when its own stores are done,
    inside that interval: its load waits for the rest of B's stores, then takes its own bytes; it reads
    them layer by layer, and the wait is on the hand-off's part of TTFT with the loads not hidden."""
    from kvemu.replay import TierOptions

    w = make_workload([0.0, 0.1], [40, 200], [2, 2], hashes=[[1], [2, 3, 4, 5]])
    tr = record(w, tmp_path / "t.parquet", tier_policy="offload")
    opts = ReplayOptions(datapath=DataPathOptions(link="cpu", chunk_tokens=TPB), stores=StoreOptions(timing="serial"),
                         disagg=DisaggOptions(1, 1, "pool"), tier=TierOptions(devices=devices),
                         output=OutputOptions(force=True))
    res = replay(tr, SPEC, opts, out=tmp_path / "r.parquet")
    r = res.table().to_pydict()
    gbps = BW * (devices or 2)                                     # default: one device per instance
    compute = roofline_ns(40, 40 * 41 / 2, 40)
    p_end, ready = layerwise_stores_done(0, compute, (40 // TPB) * ACCESS)
    b_busy_end = p_end + (200 // TPB) * BLOCK_ALL / gbps           # B's prefill step starts at A's end
    hit = 39 // TPB
    own = hit * BLOCK_ALL / gbps
    assert p_end < ready < b_busy_end
    wait = b_busy_end - ready                                      # then its own bytes, in the idle time
    load_ns = LAYERS * hit * ACCESS
    k = 40 - hit * TPB
    comp_d = roofline_ns(k, k * (hit * TPB + (k + 1) / 2), hit * TPB + k)
    first, exposed = layerwise_first_step(comp_d, hit * ACCESS)
    assert r["ttft_ms"][0] == pytest.approx((ready + first + wait) / 1e6, abs=1e-5)
    on_path = min(load_ns, exposed + wait)
    assert r["ttft_first_decode_ns"][0] == pytest.approx(first + wait - on_path, abs=2)
    check_parts(r)
    m = res.meta["schedule"]["disagg"]["transfer"]["medium"]
    assert m["gbps"] == gbps and m["decode_behind_prefill_ns"] >= round(wait) - 1
    assert own > 0


def test_a_resident_trace_is_handed_off_in_the_pool_and_read_in_place(tmp_path):
    """resident: the prefill writes the prompt's blocks into the pool layer by layer; the decode
    instance finds them in the pool (its block pool is the tier), loads nothing, and its first step
    computes the tail reading the context in place (attention over tier memory: the layer's reads
    in its compute, HBM touched by the new tokens alone)."""
    w = make_workload(ARRIVALS, INPUTS, OUTPUTS, hashes=[[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    tr = record(w, tmp_path / "res.parquet", tier_policy="resident")
    r, meta = run(tr, tmp_path / "r.parquet", "pool")
    for i, (a, inp) in enumerate(zip(ARRIVALS, INPUTS)):
        arr = round(a * 1e6)
        stored = inp // TPB
        compute = roofline_ns(inp, inp * (inp + 1) / 2, inp)
        p_end, ready = layerwise_stores_done(arr, compute, stored * ACCESS)
        h = (inp - 1) // TPB                                       # in the pool, read where they are
        k = inp - h * TPB
        first = roofline_ns(k, k * (h * TPB + (k + 1) / 2), k) + LAYERS * h * ACCESS
        assert r["handoff_bytes"][i] == stored * BLOCK_ALL        # the stores alone: nothing is loaded
        assert r["kv_bytes_loaded"][i] == 0 and r["kv_bytes_read"][i] > 0
        assert r["ttft_prefill_ns"][i] == compute
        assert r["ttft_handoff_ns"][i] == pytest.approx(ready - p_end, abs=2)
        assert r["ttft_first_decode_ns"][i] == pytest.approx(first, abs=2)
        assert r["ttft_ms"][i] == pytest.approx((ready + first - arr) / 1e6, abs=1e-6)
    check_parts(r)
    with pytest.raises(ConfigError, match="lives in the pool"):
        run(tr, tmp_path / "x.parquet", "rdma")
    assert not (tmp_path / "x.parquet").exists()


def test_pool_holds_a_shared_prefix_for_the_whole_deployment(tmp_path):
    """Two prefill instances (round-robin): the second request's prefix, stored by the first
    request's prefill on the other instance, is a prefix hit in the pool and is not stored again;
    over RDMA each prefill instance has only its own cache and computes it."""
    w = make_workload([0.0, 500.0], [200, 200], [2, 2], hashes=[[1, 2, 3, 4], [1, 2, 3, 5]])
    tr = record(w, tmp_path / "t.parquet", tier_policy="offload")
    opts = ReplayOptions(datapath=DataPathOptions(link="cpu", chunk_tokens=TPB), stores=StoreOptions(timing="serial"),
                         output=OutputOptions(force=True))
    pool = replay(tr, SPEC, opts.but(disagg=DisaggOptions(2, 1, "pool")), out=tmp_path / "p.parquet").table().to_pydict()
    rdma = replay(tr, SPEC, opts.but(disagg=DisaggOptions(2, 1, "rdma")), out=tmp_path / "r.parquet").table().to_pydict()
    assert pool["prefill_instance"] == [0, 1] and rdma["prefill_instance"] == [0, 1]
    shared = 3 * 64 // TPB                                         # three 64-token hash blocks in common
    assert pool["handoff_pool_blocks"] == [0, shared]
    assert pool["cached_tokens"][1] == shared * TPB and rdma["cached_tokens"][1] == 0
    assert pool["kv_bytes_stored"][1] == (200 // TPB - shared) * BLOCK_ALL
    assert pool["ttft_prefill_ns"][1] < pool["ttft_prefill_ns"][0]


def test_every_prompt_served_where_it_arrives_is_the_colocated_replay(traces, tmp_path):
    """--disagg-threshold above every prompt: each request goes to the decode instance and is served
    there alone, which is the colocated replay of one instance, figure for figure."""
    base = ReplayOptions(datapath=DataPathOptions(link="cpu", chunk_tokens=TPB), stores=StoreOptions(timing="serial"),
                         output=OutputOptions(force=True))
    colo_res = replay(traces["offload"], SPEC, base, out=tmp_path / "c.parquet")
    colo = colo_res.table().to_pydict()
    assert "disagg" not in colo_res.meta["schedule"] and "handoff_ns" not in colo  # colocated: as before
    r, meta = run(traces["offload"], tmp_path / "d.parquet", "rdma", threshold_tokens=10_000)
    for col in ("ttft_ms", "tpot_ms", "e2el_ms", "queue_ms", "kv_load_ms", "kv_store_ms", "cached_tokens", "itl_ms"):
        assert r[col] == colo[col], col
    assert r["prefill_instance"] == [-1, -1, -1] and r["handoff_bytes"] == [0, 0, 0]
    assert r["ttft_handoff_ns"] == [0, 0, 0]
    check_parts(r)
    assert meta["schedule"]["disagg"]["local_requests"] == 3


def test_conditional_disaggregation_serves_short_prompts_where_they_arrive(traces, tmp_path):
    """--disagg-threshold 160: the prompts of 150 and 90 tokens are prefilled on the decode instance
    (as colocated, requests being far apart), the one of 200 is prefilled remotely and handed over."""
    base = ReplayOptions(datapath=DataPathOptions(link="cpu", chunk_tokens=TPB), stores=StoreOptions(timing="serial"),
                         output=OutputOptions(force=True))
    colo = replay(traces["none"], SPEC, base, out=tmp_path / "c.parquet").table().to_pydict()
    r, meta = run(traces["none"], tmp_path / "d.parquet", "rdma-pull", threshold_tokens=160)
    assert r["prefill_instance"] == [-1, -1, 0]
    for i in (0, 1):
        assert r["ttft_ms"][i] == colo["ttft_ms"][i] and r["e2el_ms"][i] == colo["e2el_ms"][i]
        assert r["ttft_prefill_ns"][i] == round(colo["ttft_ms"][i] * 1e6) and r["handoff_bytes"][i] == 0
    inp, arr = INPUTS[2], round(ARRIVALS[2] * 1e6)
    nic = LINKS["rdma-200g"]
    p_end = arr + roofline_ns(inp, inp * (inp + 1) / 2, inp)
    ready = math.ceil(p_end + nic.setup_ns + -(-inp // TPB) * BLOCK_ALL / nic.load_gbps)
    assert r["ttft_ms"][2] == pytest.approx((ready + roofline_ns(1, inp, inp) - arr) / 1e6, abs=1e-6)
    check_parts(r)
    assert meta["schedule"]["disagg"]["local_requests"] == 2
    assert meta["schedule"]["disagg"]["conditional_threshold"] == 160


@pytest.mark.parametrize("chunked", ["on", "off"])
def test_decode_instances_prefill_whole_prompts_with_chunked_prefill_off(tmp_path, chunked):
    """A 10,000-token prompt under the threshold is prefilled on the decode instance: in chunks of
    the trace's 8192-token budget (on), or in one step (off: vLLM without chunked prefill, its budget
    raised to the prompt)."""
    w = make_workload([0.0], [10_000], [2])
    tr = record(w, tmp_path / "t.parquet", tier_policy="none")
    res = replay(tr, SPEC, ReplayOptions(datapath=DataPathOptions(link="cpu", chunk_tokens=TPB),
                                         disagg=DisaggOptions(1, 1, "rdma", threshold_tokens=20_000,
                                                              decode_chunked_prefill=chunked),
                                         output=OutputOptions(force=True)), out=tmp_path / "r.parquet")
    r = res.table().to_pydict()
    n = 10_000
    if chunked == "on":
        a, b = 8192, n - 8192
        ttft = roofline_ns(a, a * (a + 1) / 2, a) + roofline_ns(b, b * (a + (b + 1) / 2), n)
    else:
        ttft = roofline_ns(n, n * (n + 1) / 2, n)
    assert r["ttft_ms"][0] == pytest.approx(ttft / 1e6, abs=1e-6)
    d = res.meta["schedule"]["disagg"]
    assert d["decode_chunked_prefill"] == chunked
    assert d["decode_max_batched_tokens"] == (8192 if chunked == "on" else n)


@pytest.mark.parametrize("backend, kv_load", [("dram:hugepages=0", "in-step"), (SPEC, "async")])
def test_two_by_two_on_a_measured_pool_and_with_async_loads(traces, tmp_path, backend, kv_load):
    """Two prefill and two decode instances, each side's threads on one arena (measured DRAM), or
    the decode's pool loads on their own stream (--kv-load async): every request is prefilled on one
    side and decoded on the other, and its TTFT parts add up."""
    from kvemu.replay import ScheduleOptions

    opts = ReplayOptions(datapath=DataPathOptions(link="cpu", chunk_tokens=TPB), output=OutputOptions(force=True),
                         schedule=ScheduleOptions(kv_load=kv_load), disagg=DisaggOptions(2, 2, "pool"))
    res = replay(traces["offload"], backend, opts, out=tmp_path / "r.parquet")
    r = res.table().to_pydict()
    assert r["prefill_instance"] == [0, 1, 0] and r["decode_instance"] == [0, 1, 0]
    assert all(b > 0 for b in r["handoff_bytes"])
    check_parts(r)
    assert res.meta["schedule"]["disagg"]["transfer"]["mode"] == ("measured" if backend.startswith("dram") else "virtual")
    assert len(res.meta["instance_ops"]) == 4


def test_the_report_leads_with_the_handoff_share_of_ttft(traces, tmp_path):
    from kvemu.report import render_html, render_json, render_table, report

    out = tmp_path / "p.parquet"
    r, _ = run(traces["offload"], out, "pool")
    share = sum(r["ttft_handoff_ns"]) / sum(t * 1e6 for t in r["ttft_ms"])
    rep = report([out], slo="ttft=20,tpot=8")
    text = render_table(rep)
    head = " ".join(text.split("kvemu report:")[0].split())   # before the title: the first lines
    assert "hand-off share of TTFT" in head
    rec = json.loads(render_json(rep))["runs"][0]
    assert rec["deployment"]["handoff_share_of_ttft"] == pytest.approx(share, rel=1e-9)
    # DistServe's goodput per objective: requests meeting each objective alone, over the run's duration
    dur = rep.groups[0].rows[0].run.duration_s
    assert rec["request_goodput_ttft"] == pytest.approx(sum(t <= 20 for t in r["ttft_ms"]) / dur)
    assert rec["request_goodput_tpot"] == pytest.approx(sum(t <= 8 for t in r["tpot_ms"]) / dur)
    html = render_html(rep, tmp_path / "r.html")
    assert "hand-off" in html.read_text().lower()


def test_disaggregation_refusals(traces, tmp_path):
    with pytest.raises(OptionError, match="give both"):
        ReplayOptions(disagg=DisaggOptions(prefill_instances=2)).check()
    with pytest.raises(OptionError, match="must be one of rdma"):
        ReplayOptions(disagg=DisaggOptions(1, 1, "nvlink")).check()
    with pytest.raises(OptionError, match="cannot be given with"):
        ReplayOptions(disagg=DisaggOptions(1, 1), instances=__import__("kvemu").InstanceOptions(count=2)).check()
    with pytest.raises(ConfigError, match="needs an offload or resident trace"):
        run(traces["none"], tmp_path / "x.parquet", "pool")
    with pytest.raises(ConfigError, match="give the pool as the backend"):
        run(traces["offload"], tmp_path / "y.parquet", "pool:dram")
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "y.parquet").exists()


def test_cli_replays_a_disaggregated_deployment(traces, tmp_path):
    from click.testing import CliRunner

    from kvemu.cli import cli

    out = tmp_path / "c.parquet"
    res = CliRunner().invoke(cli, ["replay", str(traces["offload"]), "--backend", "vemu:cxl-pool", "--prefill-instances",
                                   "1", "--decode-instances", "2", "--transfer", "pool-serial", "--decode-chunked-prefill",
                                   "off", "--out", str(out)])
    assert res.exit_code == 0, res.output
    t = pq.read_table(out)
    assert set(t["decode_instance"].to_pylist()) == {0, 1}
    d = json.loads(t.schema.metadata[b"kvemu"])["schedule"]["disagg"]
    assert d["transfer"]["path"] == "pool-serial" and d["decode_chunked_prefill"] == "off"
    bad = CliRunner().invoke(cli, ["replay", str(traces["offload"]), "--backend", "vemu:cxl-pool", "--transfer", "pool",
                                   "--out", str(tmp_path / "b.parquet")])
    assert bad.exit_code == 2 and "--transfer has no effect without --prefill-instances" in bad.output


COPY = 1 / 6.25  # ns per byte: the host copy of the mid-2025 Mooncake Store path (a server core's memcpy)


@pytest.mark.parametrize("transfer", ["rdma-pull", "rdma"])
def test_an_rdma_handoff_pays_the_stores_transfer_parts(traces, tmp_path, transfer):
    """One transfer model: a hand-off over the transfer engine of mooncake-lmcache-copy pays that store's
    host copy on every byte, in series with the wire, as a store on it does; its lookups and master RPCs
    are the store's own (path 'store') and not paid. mooncake-gdr (the default) pays nothing."""
    from kvemu.profiles import BUILTIN_PROFILES

    r, meta = run(traces["none"], tmp_path / "r.parquet", f"{transfer}:mooncake-lmcache-copy")
    bare, _ = run(traces["none"], tmp_path / "b.parquet", transfer)
    gdr, _ = run(traces["none"], tmp_path / "g.parquet", f"{transfer}:mooncake-gdr")
    assert gdr["ttft_handoff_ns"] == bare["ttft_handoff_ns"]
    nic = LINKS["rdma-200g"]
    wire = 1 / nic.load_gbps + COPY
    for i, (a, inp) in enumerate(zip(ARRIVALS, INPUTS)):
        arr = round(a * 1e6)
        prefill = roofline_ns(inp, inp * (inp + 1) / 2, inp)
        p_end = arr + prefill
        nbytes = -(-inp // TPB) * BLOCK_ALL
        if transfer == "rdma-pull":
            end = p_end + nic.setup_ns + nbytes * wire
        else:  # layer by layer, each layer's bytes through the wire and the copy
            end = None
            for layer in range(LAYERS):
                ready = arr + (layer + 1) * prefill / LAYERS
                per = nbytes / LAYERS * wire
                end = ready + nic.setup_ns + per if end is None else max(ready, end) + per
        exposed = max(math.ceil(end), p_end) - p_end
        assert r["ttft_handoff_ns"][i] == exposed
        # the hand-off's software is the store's transfer parts on the same bytes
        store = BUILTIN_PROFILES["mooncake-lmcache-copy"]
        assert sum(p.ns(0, 0, nbytes) for p in store.transfer_parts) == pytest.approx(nbytes * COPY)
    sw = meta["schedule"]["disagg"]["software"]
    assert sw["profile"] == "mooncake-lmcache-copy" and set(sw["parts"]) == {"host_copy"}
    assert sw["parts"]["host_copy"]["ns_per_byte"] == pytest.approx(COPY)


def test_a_handoff_engine_must_be_a_storage_profile(traces, tmp_path):
    from click.testing import CliRunner

    from kvemu.cli import cli

    with pytest.raises(ConfigError, match="memory tier"):
        run(traces["none"], tmp_path / "r.parquet", "rdma:cxl-pool")
    out = tmp_path / "c.parquet"
    for transfer, why in (("rdma:no-such-profile", "unknown tier profile 'no-such-profile'"),
                          ("rdma-pull:cxl-pool", "cxl-pool is a memory tier")):
        res = CliRunner().invoke(cli, ["replay", str(traces["none"]), "--backend", SPEC, "--prefill-instances", "1",
                                       "--decode-instances", "1", "--transfer", transfer, "--out", str(out)])
        assert res.exit_code == 2 and why in res.output and len(res.output.strip().splitlines()) == 1
        assert not out.exists()
