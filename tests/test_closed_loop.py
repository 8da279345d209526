"""Closed-loop replay: the engine model schedules again, each step from the state the tier's KV
times produced. Checked against a small discrete-event simulation written here (not the engine's
code) with fixed per-access costs, and for the properties the loop exists for: a slower tier
changes the batches, a window keeps its history, arrivals can be rescaled."""

import heapq
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import make_workload, record
from kvemu.closedloop import engine_inputs
from kvemu.engine.scheduler import simulate
from kvemu.errors import ConfigError
from kvemu.models import resolve_model
from kvemu.replay import replay_trace
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
    return int(max(flops / (989e12 * 0.5), nbytes / (3350e9 * 0.7)) * 1e9 + 300e3)


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


def closed(trace, latency_ns, out, **kw):
    spec = f"vemu:cxl-pool,latency_ns={latency_ns},bandwidth_gbps={BW},concurrency=1"
    replay_trace(trace, spec, out, force=True, link="cpu", store_mode="serial", chunk_tokens=TPB, **kw)
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
    rec = replay_trace(resident_trace, spec, tmp_path / "rec.parquet", link="cpu", store_mode="serial",
                       schedule="recorded")
    assert rec["steps"]["count"] == read_trace(resident_trace).header.meta["engine"]["steps"]
    assert rec["schedule"]["ran"] == "recorded" and "engine" not in rec["schedule"]
    assert max(slow_r["ttft_ms"]) > max(fast_r["ttft_ms"])


def test_the_engine_rebuilt_from_a_trace_plans_the_recorded_steps(tmp_path):
    """What closed loop schedules with (engine_inputs) is what recorded the trace: with compute
    alone it plans the recorded steps again, entry for entry."""
    from kvemu.recording import record_workload

    path = tmp_path / "t.parquet"
    record_workload("synthetic:docqa:documents=3,questions=3", "llama3-8b", path, hbm_kv_gib=1.5,
                    show_progress=False)
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
    full, _ = rows(replay_trace(chat_trace, "vemu:nvme", tmp_path / "full.parquet")["results_path"])
    win, meta = rows(replay_trace(chat_trace, "vemu:nvme", tmp_path / "w.parquet", request_range=(4, 7))
                     ["results_path"])
    assert win["request_id"] == list(range(4, 7))
    for col in ("ttft_ms", "e2el_ms", "queue_ms", "kv_load_ms", "kv_store_ms"):
        assert win[col] == pytest.approx([full[col][i] for i in range(4, 7)], rel=1e-9), col
    # it stopped once the window's requests finished
    assert meta["schedule"]["engine"]["finished"] < len(full["request_id"])


def test_time_scale_rescales_arrivals(tmp_path, chat_trace):
    base, bm = rows(replay_trace(chat_trace, "vemu:cxl-pool", tmp_path / "a.parquet")["results_path"])
    slow, sm = rows(replay_trace(chat_trace, "vemu:cxl-pool", tmp_path / "b.parquet", time_scale=3.0)
                    ["results_path"])
    assert slow["arrival_ms"] == pytest.approx([3 * a for a in base["arrival_ms"]])
    assert sm["schedule"]["time_scale"] == 3.0 and sm["schedule"]["time_scale_from"] == "--time-scale"
    assert np.median(slow["queue_ms"]) <= np.median(base["queue_ms"])
    n = len(base["arrival_ms"])
    span_s = (max(base["arrival_ms"]) - min(base["arrival_ms"])) / 1e3
    rate = replay_trace(chat_trace, "vemu:cxl-pool", tmp_path / "c.parquet", request_rate=2.0)
    assert rate["schedule"]["time_scale"] == pytest.approx((n - 1) / span_s / 2.0)


def test_bad_schedule_options_are_refused(tmp_path, chat_trace):
    with pytest.raises(ConfigError, match="need --schedule closed"):
        replay_trace(chat_trace, "vemu:nvme", tmp_path / "x.parquet", schedule="recorded", time_scale=2.0)
    with pytest.raises(ConfigError, match="not both"):
        replay_trace(chat_trace, "vemu:nvme", tmp_path / "x.parquet", time_scale=2.0, request_rate=1.0)
    with pytest.raises(ConfigError, match="positive"):
        replay_trace(chat_trace, "vemu:nvme", tmp_path / "x.parquet", time_scale=0.0)
    with pytest.raises(ConfigError, match="one instance"):
        replay_trace(chat_trace, "vemu:nvme", tmp_path / "x.parquet", schedule="closed", instances=2)
    assert not (tmp_path / "x.parquet").exists()


def test_a_real_run_replays_as_recorded(tmp_path):
    """A real run's schedule is what happened: replay keeps it by default and refuses to replan."""
    from kvemu.realrun import record_tiny

    trace = tmp_path / "tiny.parquet"
    record_tiny(trace, requests=3, prompt_tokens=64, output_tokens=4, shared_prefix_tokens=32)
    sched = read_trace(trace).header.meta["schedule"]
    assert sched["closed_loop"] is False and sched["source"] == "captured"
    meta = replay_trace(trace, "vemu:cxl-pool", tmp_path / "r.parquet")
    assert meta["schedule"]["ran"] == "recorded" and meta["schedule"]["from"] == "default"
    with pytest.raises(ConfigError, match="real run's schedule is what happened"):
        replay_trace(trace, "vemu:cxl-pool", tmp_path / "c.parquet", schedule="closed")


def test_the_replayed_load_is_measured_and_said(tmp_path, chat_trace):
    """An overloaded replay says so, with the figures and what would change it."""
    w = make_workload([0.0] * 12, [2000] * 12, [50] * 12)
    trace = record(w, tmp_path / "burst.parquet", tier_policy="offload", max_num_seqs=2)
    warnings = []
    meta = replay_trace(trace, "vemu:cxl-pool", tmp_path / "r.parquet", warn=warnings.append)
    load = meta["load"]
    assert load["overloaded"] and load["queue_share"] >= 0.5 and load["arrival_span_s"] == 0.0
    assert any("exceeds what 1 x H100-SXM can serve" in w for w in warnings)
    assert load["utilisation"] == pytest.approx(1.0, abs=0.01)   # a burst keeps the GPU busy throughout
    calm = replay_trace(chat_trace, "vemu:cxl-pool", tmp_path / "c.parquet", time_scale=20.0)
    assert not calm["load"]["overloaded"] and calm["load"]["queue_share"] < 0.05
