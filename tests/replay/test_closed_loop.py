"""Closed-loop replay: the engine model schedules again, each step from the state the tier's KV
times produced. Checked against a small discrete-event simulation written here (not the engine's
code) with fixed per-access costs, and for the properties the loop exists for: a slower tier
changes the batches, a window keeps its history, arrivals can be rescaled."""

import math
import heapq
from pathlib import Path
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import make_workload, record
from kvemu.replay.closed import engine_inputs
from kvemu.engine.scheduler import simulate
from kvemu.errors import ConfigError
from kvemu.models import resolve_model
from kvemu.replay import (DataPathOptions, InstanceOptions, OutputOptions, ReplayOptions, ScheduleOptions, StoreOptions,
                          TierOptions, WindowOptions, replay)
from kvemu.schema import iter_entries, read_trace

TPB = 16
LAYERS = 32                     # llama3-8b
BLOCK_LAYER_BYTES = 65536       # 16 tokens x 2 x 8 KV heads x 128 x 2 bytes, one layer
BW = 64.0                       # GB/s = bytes per ns: a block-layer access moves in exactly 1024 ns


def rows(path):
    t = pq.read_table(path)
    return t.to_pydict(), json.loads(t.schema.metadata[b"kvemu"])


# ----------------------------------------------------------------------------- the oracle

def roofline_ns(tokens, pairs, touched):
    """docs: GPU time of a step on one H100 SXM at mfu 0.5 / mbu 0.7 plus 300 us (llama3-8b)."""
    m = resolve_model("llama3-8b")
    flops = 2.0 * m.active_params * tokens + 2.0 * m.layers * m.attention_heads * (m.qk_head_dim + m.v_head_dim) * pairs
    nbytes = min(m.params, m.active_params * max(1, tokens)) * 2 + m.kv_bytes_per_token * touched
    # the soft roofline: the 2-norm of the compute and HBM terms (docs/engine.md)
    return int(math.hypot(flops / (989e12 * 0.5), nbytes / (3350e9 * 0.7)) * 1e9 + 300e3)


def des(arrival_ms, inp, out, budget, max_seqs, access_ns):
    """A discrete-event simulation of one GPU serving requests with KV resident in the tier: events
    are arrivals and step completions; a step is planned when the GPU falls idle (decodes first, then
    prefill chunks oldest first, then admissions in arrival order) and costs its roofline compute plus
    ``access_ns`` for every block of every layer it reads or stores, one after another."""
    events = [(int(round(a * 1e6)), 0, i) for i, a in enumerate(arrival_ms)]  # (time, kind 0=arrive 1=done, id)
    heapq.heapify(events)
    waiting, running = [], []          # running: dicts in admission order
    first_token, last_token = {}, {}
    busy = False
    while events:
        now, kind, what = heapq.heappop(events)
        if kind == 0:
            waiting.append(what)
        else:
            busy = False
            for r in what:               # the step's outcomes, at its end
                if r["first"]:
                    first_token[r["id"]] = now
                if r["last"]:
                    last_token[r["id"]] = now
        if busy or (events and events[0][0] == now and events[0][1] == 0):
            continue                     # take every arrival at this instant before planning
        left, tokens, pairs, touched, blocks, outcome = budget, 0, 0.0, 0, 0, []
        for r in [r for r in running if r["done"] == r["inp"]]:     # decodes
            ctx = r["inp"] + r["gen"] - 1
            left -= 1; tokens += 1; pairs += ctx + 1; touched += 1
            blocks += ctx // TPB + (1 if (ctx + 1) % TPB == 0 else 0)
            r["gen"] += 1
            outcome.append({"id": r["id"], "first": False, "last": r["gen"] == r["out"]})
        def prefill(r):
            nonlocal left, tokens, pairs, touched, blocks
            ctx, k = r["done"], min(r["inp"] - r["done"], left)
            left -= k; tokens += k; pairs += k * (ctx + (k + 1) / 2); touched += k
            blocks += ctx // TPB + (ctx + k) // TPB - ctx // TPB
            r["done"] += k
            if r["done"] == r["inp"]:
                r["gen"] = 1
                outcome.append({"id": r["id"], "first": True, "last": r["out"] == 1})
        for r in [r for r in running if r["done"] < r["inp"]]:
            if left <= 0:
                break
            prefill(r)
        while waiting and left > 0 and len(running) < max_seqs:
            i = waiting.pop(0)
            r = {"id": i, "inp": inp[i], "out": out[i], "done": 0, "gen": 0}
            running.append(r)
            prefill(r)
        running = [r for r in running if not (r["done"] == r["inp"] and r["gen"] >= r["out"])]
        if tokens == 0:
            continue
        cost = roofline_ns(tokens, pairs, touched) + LAYERS * blocks * access_ns
        heapq.heappush(events, (now + cost, 1, outcome))
        busy = True
    ttft = [(first_token[i] - round(a * 1e6)) / 1e6 for i, a in enumerate(arrival_ms)]
    e2el = [(last_token[i] - round(a * 1e6)) / 1e6 for i, a in enumerate(arrival_ms)]
    tpot = [(e - t) / (o - 1) if o > 1 else float("nan") for t, e, o in zip(ttft, e2el, out)]
    return ttft, tpot, e2el


# ----------------------------------------------------------------------------- workloads

ARRIVALS = [0.0, 3.0, 4.0, 30.0, 31.0, 200.0]
INPUTS = [100, 40, 70, 150, 20, 90]
OUTPUTS = [6, 20, 3, 9, 1, 5]
BUDGET, SEQS = 64, 3


@pytest.fixture(scope="module")
def resident_trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("closed")
    w = make_workload(ARRIVALS, INPUTS, OUTPUTS)
    return record(w, d / "t.parquet", tier_policy="resident", max_num_batched_tokens=BUDGET, max_num_seqs=SEQS)


def closed(trace, latency_ns, out, **groups):
    """Closed-loop replay on a tier of this latency; ``groups``: other options as ReplayOptions.but takes them."""
    spec = f"vemu:cxl-pool,latency_ns={latency_ns},bandwidth_gbps={BW},concurrency=1"
    opts = ReplayOptions(datapath=DataPathOptions(link="cpu", chunk_tokens=TPB), stores=StoreOptions(timing="serial"),
                         output=OutputOptions(force=True)).but(**groups)
    replay(trace, spec, opts, out=out)
    return rows(out)


@pytest.mark.parametrize("latency_ns", [0, 4000, 400_000])
def test_closed_loop_matches_a_discrete_event_simulation(resident_trace, tmp_path, latency_ns):
    r, meta = closed(resident_trace, latency_ns, tmp_path / "r.parquet")
    assert meta["schedule"]["ran"] == "closed"
    ttft, tpot, e2el = des(ARRIVALS, INPUTS, OUTPUTS, BUDGET, SEQS, latency_ns + BLOCK_LAYER_BYTES / BW)
    assert r["ttft_ms"] == pytest.approx(ttft, abs=1e-6)
    assert r["e2el_ms"] == pytest.approx(e2el, abs=1e-6)
    assert np.allclose(r["tpot_ms"], tpot, atol=1e-6, equal_nan=True)


def test_a_slower_tier_changes_the_batches_not_only_the_timeline(resident_trace, tmp_path):
    fast_r, fast = closed(resident_trace, 0, tmp_path / "f.parquet")
    slow_r, slow = closed(resident_trace, 400_000, tmp_path / "s.parquet")
    # while a slow step runs, more requests arrive and join the next batch: fewer, fuller steps
    assert slow["schedule"]["engine"]["steps"] < fast["schedule"]["engine"]["steps"]
    # open loop keeps every recorded step whatever the tier
    spec = f"vemu:cxl-pool,latency_ns=400000,bandwidth_gbps={BW},concurrency=1"
    rec = replay(resident_trace, spec, ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), datapath=DataPathOptions(link="cpu"), stores=StoreOptions(timing="serial")), out=tmp_path / "rec.parquet")
    assert rec["steps"]["count"] == read_trace(resident_trace).header.meta["engine"]["steps"]
    assert rec["schedule"]["ran"] == "recorded" and "engine" not in rec["schedule"]
    assert max(slow_r["ttft_ms"]) > max(fast_r["ttft_ms"])


def test_the_engine_rebuilt_from_a_trace_plans_the_recorded_steps(tmp_path):
    """What closed loop schedules with (engine_inputs) is what recorded the trace: with compute
    alone it plans the recorded steps again, entry for entry."""
    from kvemu.record_options import RecordOptions
    from kvemu.recording import record

    path = tmp_path / "t.parquet"
    record("synthetic:docqa:documents=3,questions=3", "llama3-8b", path,
           RecordOptions.from_flat(hbm_kv_gib=1.5, show_progress=False))
    tr = read_trace(path)
    i = engine_inputs(tr)
    run = simulate(i.tables, i.arrival_ns / 1e6, i.input_tokens, i.output_tokens, i.timing, i.cfg)
    assert run.step_compute_ns.tolist() == tr.compute_ns.tolist()
    assert run.step_start_ns.tolist() == tr.start_ns.tolist()
    recorded = {k: np.concatenate([e[k] for e in iter_entries(tr.header)]) for k in run.entries}
    for k, v in run.entries.items():
        assert v.tolist() == recorded[k].tolist(), k


def test_a_window_keeps_its_history(tmp_path, chat_trace):
    """Requests 4..6 replayed alone meet the queue and caches the earlier requests left: the same
    per-request figures as in a full replay (virtual time: exactly)."""
    full, _ = rows(replay(chat_trace, "vemu:nvme", None, out=tmp_path / "full.parquet")["results_path"])
    win, meta = rows(replay(chat_trace, "vemu:nvme", ReplayOptions(window=WindowOptions(requests=(4, 7))), out=tmp_path / "w.parquet")
                     ["results_path"])
    assert win["request_id"] == list(range(4, 7))
    for col in ("ttft_ms", "e2el_ms", "queue_ms", "kv_load_ms", "kv_store_ms"):
        assert win[col] == pytest.approx([full[col][i] for i in range(4, 7)], rel=1e-9), col
    # it stopped once the window's requests finished
    assert meta["schedule"]["engine"]["finished"] < len(full["request_id"])


def test_time_scale_rescales_arrivals(tmp_path, chat_trace):
    base, bm = rows(replay(chat_trace, "vemu:cxl-pool", None, out=tmp_path / "a.parquet")["results_path"])
    slow, sm = rows(replay(chat_trace, "vemu:cxl-pool", ReplayOptions(schedule=ScheduleOptions(time_scale=3.0)), out=tmp_path / "b.parquet")
                    ["results_path"])
    assert slow["arrival_ms"] == pytest.approx([3 * a for a in base["arrival_ms"]])
    assert sm["schedule"]["time_scale"] == 3.0 and sm["schedule"]["time_scale_from"] == "--time-scale"
    assert np.median(slow["queue_ms"]) <= np.median(base["queue_ms"])
    n = len(base["arrival_ms"])
    span_s = (max(base["arrival_ms"]) - min(base["arrival_ms"])) / 1e3
    rate = replay(chat_trace, "vemu:cxl-pool", ReplayOptions(schedule=ScheduleOptions(request_rate=2.0)), out=tmp_path / "c.parquet")
    assert rate["schedule"]["time_scale"] == pytest.approx((n - 1) / span_s / 2.0)


def test_bad_schedule_options_are_refused(tmp_path, chat_trace):
    with pytest.raises(ConfigError, match="need --schedule closed"):
        replay(chat_trace, "vemu:nvme", ReplayOptions(schedule=ScheduleOptions(schedule="recorded", time_scale=2.0)), out=tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="not both"):
        replay(chat_trace, "vemu:nvme", ReplayOptions(schedule=ScheduleOptions(time_scale=2.0, request_rate=1.0)), out=tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="positive"):
        replay(chat_trace, "vemu:nvme", ReplayOptions(schedule=ScheduleOptions(time_scale=0.0)), out=tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="schedule.routing must be one of"):
        replay(chat_trace, "vemu:nvme", ReplayOptions(schedule=ScheduleOptions(routing="random"), instances=InstanceOptions(count=2)), out=tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="schedule.routing needs schedule.schedule closed"):
        replay(chat_trace, "vemu:nvme", ReplayOptions(schedule=ScheduleOptions(routing="least-loaded", schedule="recorded"), instances=InstanceOptions(count=2)), out=tmp_path / "x.parquet")
    assert not (tmp_path / "x.parquet").exists()


# ----------------------------------------------------------------------------- instances

def test_instances_each_schedule_their_own_requests(resident_trace, tmp_path):
    """Round-robin over replicated tiers (no shared queue): each instance is one GPU serving its
    own requests, so each matches the discrete-event simulation of its share of the workload."""
    n, lat = 2, 4000
    spec = f"vemu:cxl-pool,latency_ns={lat},bandwidth_gbps={BW},concurrency=1"
    replay(resident_trace, spec, ReplayOptions(schedule=ScheduleOptions(routing="round-robin"), datapath=DataPathOptions(link="cpu", chunk_tokens=TPB), stores=StoreOptions(timing="serial"), instances=InstanceOptions(count=n, sharing="replicated")), out=tmp_path / "r.parquet")
    r, meta = rows(tmp_path / "r.parquet")
    assert r["instance"] == [i % n for i in range(len(ARRIVALS))]
    for i in range(n):
        mine = list(range(i, len(ARRIVALS), n))
        ttft, tpot, e2el = des([ARRIVALS[k] for k in mine], [INPUTS[k] for k in mine], [OUTPUTS[k] for k in mine],
                               BUDGET, SEQS, lat + BLOCK_LAYER_BYTES / BW)
        assert [r["ttft_ms"][k] for k in mine] == pytest.approx(ttft, abs=1e-6)
        assert [r["e2el_ms"][k] for k in mine] == pytest.approx(e2el, abs=1e-6)
    per = meta["schedule"]["engine"]["per_instance"]
    assert [p["requests"] for p in per] == [3, 3] and meta["schedule"]["engine"]["queued_ns"] == 0


def test_a_shared_tier_is_contended_and_a_replicated_one_is_not(tmp_path, chat_trace):
    """Four instances on one emulated pool queue for it; with a copy each they do not. Sharing saves
    capacity (the common prefix is held once), and the results measure both."""
    # one pool device for all four (--tier-devices 1); by default a shared tier has one per instance
    shared = replay(chat_trace, "vemu:cxl-pool,bandwidth_gbps=4", ReplayOptions(instances=InstanceOptions(count=4, sharing="shared"), tier=TierOptions(devices=1)), out=tmp_path / "s.parquet")
    assert shared["tier"]["devices"]["devices"] == 1 and shared["tier"]["devices"]["gbps"] == 4.0
    four = replay(chat_trace, "vemu:cxl-pool,bandwidth_gbps=4", ReplayOptions(instances=InstanceOptions(count=4, sharing="shared")), out=tmp_path / "s4.parquet")
    assert four["tier"]["devices"]["gbps"] == 16.0
    assert four["schedule"]["engine"]["queued_ns"] < shared["schedule"]["engine"]["queued_ns"]
    repl = replay(chat_trace, "vemu:cxl-pool,bandwidth_gbps=4", ReplayOptions(instances=InstanceOptions(count=4, sharing="replicated")), out=tmp_path / "r.parquet")
    assert shared["schedule"]["engine"]["queued_ns"] > 0 == repl["schedule"]["engine"]["queued_ns"]
    assert shared["schedule"]["engine"]["lockstep"] is True
    assert shared["tier"]["shared_bytes"] < shared["tier"]["replicated_bytes"]
    s_rows, _ = rows(tmp_path / "s.parquet")
    r_rows, _ = rows(tmp_path / "r.parquet")
    assert sum(s_rows["kv_stall_ms"]) > sum(r_rows["kv_stall_ms"])
    # each instance's KV bandwidth, with its waits for the others, is below the pool's 4 GB/s
    for o in shared["instance_ops"]:
        if o["load"]["bytes"]:
            assert o["effective_gbps"] < 4.0 and o["queued_ns"] >= 0
    assert sum(o["queued_ns"] for o in shared["instance_ops"]) == shared["schedule"]["engine"]["queued_ns"]


def _router(policy, arrivals, tables_of, n=2, selected=None):
    """A router over a hand-made workload, driven by hand: every instance idle between arrivals."""
    from kvemu.replay.closed import EngineInputs, Router
    from kvemu.engine.blocks import BlockTables

    offsets = np.cumsum([0] + [len(t) for t in tables_of])
    ids = np.array([b for t in tables_of for b in t], np.int64)
    tables = BlockTables(16, offsets, ids, np.array([len(t) for t in tables_of]), 100, 100)
    k = len(arrivals)
    inputs = EngineInputs(tables, np.array(arrivals, np.int64), np.full(k, 64), np.full(k, 2), None, None)
    return Router(n, inputs, policy, np.ones(k, bool) if selected is None else selected, lockstep=True)


def test_routing_policies():
    def drive(router, busy, finish):
        """Route every request with all instances idle; busy[j] requests stay unfinished on j, and
        with ``finish`` each routed request finishes at once (so that only ``busy`` loads them)."""
        for j, b in enumerate(busy):
            router.routed[j] = b
        for r in range(len(router.arrival)):
            router.parked = [True] * router.n
            with router.cond:
                router._route()
            if finish:
                router.completed[int(router.owner[r])].append(-1)   # finished before any arrival
        return router.owner.tolist()

    tables = [[1, 2, 3], [1, 2, 4], [7, 8, 9], [1, 2, 3]]
    assert drive(_router("round-robin", [0, 1, 2, 3], tables), [0, 0], False) == [0, 1, 0, 1]
    # least-loaded: instance 0 already holds 2 unfinished requests, and routed ones stay
    assert drive(_router("least-loaded", [0, 1, 2, 3], tables), [2, 0], False) == [1, 1, 0, 1]
    # prefix-aware, nothing queued: a request follows the instance that holds its prefix
    assert drive(_router("prefix-aware", [0, 1, 2, 3], [[7, 8, 9], [1, 2, 3], [1, 2, 4], [1, 2, 3]]), [0, 0],
                 True) == [0, 0, 0, 0]
    assert drive(_router("prefix-aware", [0, 1, 2, 3], [[7, 8, 9], [1, 2, 3], [5, 6, 4], [1, 2, 3]], n=2),
                 [0, 1], True) == [0, 0, 0, 0]
    # a queue outweighs a prefix: with 9 requests waiting on instance 0, everything goes to 1
    assert drive(_router("prefix-aware", [0, 1, 2, 3], tables), [9, 0], True) == [1, 1, 1, 1]
    # one request queued on 0 against a two-block prefix there (avg 3 blocks a request): 1 + 3 > 3, to 1
    r = _router("prefix-aware", [0, 1], [[1, 2, 3], [1, 2, 4]])
    assert drive(r, [0, 0], False) == [0, 1]


# ----------------------------------------------------------------------------- asynchronous loads

@pytest.mark.parametrize("backend", ["vemu:nvme,latency_ns=2000000", "dram"])
def test_async_loads_do_not_stall_running_requests(tmp_path, backend):
    """In-step, a prefix loaded from a slow tier stalls every request in that step; asynchronously
    (vLLM's WAITING_FOR_REMOTE_KVS) it runs on a load stream of its own: requests that load
    nothing never stall, and a request that loads starts computing only once its load is done."""
    trace = Path(__file__).resolve().parents[2] / "traces" / "chat-llama3-8b-offload.parquet"
    opts = ReplayOptions(window=WindowOptions(layers=1 if backend == "dram" else None))
    ins = replay(trace, backend, opts, out=tmp_path / "i.parquet")
    asy = replay(trace, backend, opts.but(schedule__kv_load="async"), out=tmp_path / "a.parquet")
    i_rows, _ = rows(tmp_path / "i.parquet")
    a_rows, _ = rows(tmp_path / "a.parquet")
    assert ins["schedule"]["kv_load"] == "in-step" and asy["schedule"]["kv_load"] == "async"
    n_async = asy["schedule"]["engine"]["async_loads"]
    loaders = [k for k, v in enumerate(a_rows["kv_load_ms"]) if v > 0]
    assert n_async == len(loaders) > 0
    # the loads are timed on the load stream, and its statistics are the run's
    layers = asy["params"]["reductions"]["layers"]
    assert asy["ops"]["load"]["bytes"] * layers["of"] == sum(a_rows["kv_bytes_loaded"]) * len(layers["replayed"])
    others = [k for k in range(len(a_rows["request_id"])) if k not in loaders]
    if backend.startswith("vemu"):
        # in-step, some requests that load nothing stall behind another's load; async, none does
        assert any(i_rows["kv_stall_ms"][k] > 1.0 for k in others)
        assert all(a_rows["kv_stall_ms"][k] == 0 for k in others)
        # a loading request waits for its load: admission + load time before its first token
        for k in loaders:
            assert a_rows["ttft_ms"][k] >= a_rows["queue_ms"][k] + a_rows["kv_load_ms"][k] - 1e-6
        assert np.nanpercentile(a_rows["tpot_ms"], 99) < np.nanpercentile(i_rows["tpot_ms"], 99)


def test_async_loads_need_the_closed_loop(tmp_path, chat_trace):
    with pytest.raises(ConfigError, match="schedule.kv_load async needs schedule.schedule closed"):
        replay(chat_trace, "vemu:nvme", ReplayOptions(schedule=ScheduleOptions(kv_load="async", schedule="recorded")), out=tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match="schedule.kv_load must be one of"):
        replay(chat_trace, "vemu:nvme", ReplayOptions(schedule=ScheduleOptions(kv_load="later")), out=tmp_path / "x.parquet")
