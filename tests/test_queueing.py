"""The analysis's queueing (kvemu/capacity.py: fifo_waits, queued_ttft, StackAnalysis.evaluate): a
hand-computed queue, a discrete-event simulation written here, the GPU time a slower level's loads
add by hand, and the checked tolerance against a closed-loop replay of a shipped trace."""

import heapq
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from conftest import make_workload, record
from kvemu.capacity import QUEUE_CHECK, Level, StackAnalysis, curve_queued_ttft, fifo_waits, queued_ttft
from kvemu.cli import cli
from kvemu.prices import load_prices
from kvemu.profiles import resolve_profile
from kvemu.schema import read_trace

ROOT = Path(__file__).resolve().parents[1]


def simulate_fifo(arrivals, services):
    """A single server, first come first served, as events: each job's start - arrival."""
    events = [(a, 0, i) for i, a in enumerate(arrivals)]  # (time, kind 0 arrival / 1 departure, job)
    heapq.heapify(events)
    queue, busy, start = [], False, {}
    while events:
        t, kind, i = heapq.heappop(events)
        if kind == 1:
            busy = False
        else:
            queue.append(i)
        if not busy and queue:
            j = queue.pop(0)
            start[j] = t
            busy = True
            heapq.heappush(events, (t + services[j], 1, j))
    return [start[i] - arrivals[i] for i in range(len(arrivals))]


def test_a_queue_by_hand():
    # arrivals 0, 1, 2, 10 ms, services 3 ms each then 1: the second waits 3 - 1 = 2, the third
    # 6 - 2 = 4, the fourth finds the server idle (free at 9)
    a = np.array([0, 1, 2, 10]) * 1e6
    s = np.array([3, 3, 3, 1]) * 1e6
    assert fifo_waits(a, s).tolist() == pytest.approx([0, 2e6, 4e6, 0])
    assert queued_ttft(a, s).tolist() == pytest.approx([3e6, 5e6, 7e6, 1e6])


@pytest.mark.parametrize("seed", range(5))
def test_fifo_waits_against_an_event_simulation(seed):
    rng = np.random.default_rng(seed)
    n = 300
    a = np.cumsum(rng.exponential(10.0, n)).round(3)  # ms; a utilisation near 1 gives long queues
    s = rng.gamma(2.0, 4.8, n).round(3)
    want = simulate_fifo(a.tolist(), s.tolist())
    assert fifo_waits(a, s) == pytest.approx(want, abs=1e-6)
    assert max(want) > 20  # the case queues


def test_the_recorded_timeline_shifted_by_hand():
    # recorded: TTFT 5 and 9 ms with prefills of 3 ms arriving at 0 and 1: the FIFO queue explains
    # 0 + 3 and 2 + 3 of them, the engine the rest, 2 and 4 ms. Prefills of 1 ms now: no wait, so
    # 2 + 1 and 4 + 1; with the steps 1.5x longer, 2 x 1.5 + 1 and 4 x 1.5 + 1
    a = np.array([0.0, 1.0])
    got = queued_ttft(a, [1.0, 1.0], [5.0, 9.0], [3.0, 3.0])
    assert got.tolist() == pytest.approx([3.0, 5.0])
    assert queued_ttft(a, [1.0, 1.0], [5.0, 9.0], [3.0, 3.0], 1.5).tolist() == pytest.approx([4.0, 7.0])
    # never below the request's own service; a request with no recorded figure (-1) takes the queue's
    # (recorded 2 against 0 + 3 explained: -1 + 1 = 0, so 1; the second: no wait behind a 1 ms service, 8)
    assert queued_ttft(a, [1.0, 8.0], [2.0, -1.0], [3.0, 3.0]).tolist() == pytest.approx([1.0, 8.0])
    assert queued_ttft(a, [8.0, 8.0], [5.0, -1.0], [3.0, 3.0]).tolist() == pytest.approx([10.0, 15.0])


def _busy_workload():
    rng = np.random.default_rng(3)
    n, hashes = 40, []
    for i in range(n):
        k = int(rng.integers(0, 10))  # one of ten shared prompts, more than HBM holds
        base = list(range(100 * (k + 1), 100 * (k + 1) + 8))
        hashes.append(base + list(range(1000 + 20 * i, 1000 + 20 * i + int(rng.integers(1, 4)))))
    return make_workload([0.0] + sorted(rng.uniform(0, 1500, n - 1).tolist()), [64 * len(h) - 5 for h in hashes],
                         [4] * n, hashes)


@pytest.fixture(scope="module")
def busy_trace(tmp_path_factory):
    """Requests sharing ten long prefixes (more than HBM holds), arriving faster than one GPU
    prefills them when nothing is cached."""
    return read_trace(record(_busy_workload(), tmp_path_factory.mktemp("q") / "t.parquet", hbm_kv_blocks=128))


def test_a_slower_level_stalls_steps_and_costs_gpu_hours(busy_trace):
    """The same level (same hits) on a slower medium: its loads stall their steps, so the GPU busy
    time rises by exactly the extra load time, by hand: served tokens x KV bytes per
    token x (1/slow - 1/fast) (latency 0 on both, so only the bandwidth counts)."""
    tr = busy_trace
    an = StackAnalysis(tr)
    fast = replace(resolve_profile("local-dram"), latency_ns=0.0)
    slow = replace(resolve_profile("nvme"), latency_ns=0.0)
    cap = 1024 * an.block_bytes
    prices = load_prices(None)
    pf = an.evaluate([Level("l", fast, cap)], "lru", prices=prices)
    ps = an.evaluate([Level("l", slow, cap)], "lru", prices=prices)
    served = ps["levels"][0]["served_tokens"]
    assert served == pf["levels"][0]["served_tokens"] > 0
    kv = an.block_bytes // tr.header.tokens_per_block  # uniform model: bytes per token
    extra_s = served * kv * (1 / slow.bandwidth_gbps - 1 / fast.bandwidth_gbps) / 1e9
    assert ps["gpu_busy_s"] - pf["gpu_busy_s"] == pytest.approx(extra_s, rel=1e-9)
    assert ps["load_stall_s"] - pf["load_stall_s"] == pytest.approx(extra_s, rel=1e-9)
    gpus = int(tr.header.meta["gpu"].get("gpus", 1))
    # GPU-hours are the priced duration's (the span the GPU is held, prices.priced_duration_s): never
    # below the busy time, and a slower level's later completions never shorten it
    for p in (pf, ps):
        assert p["cost"]["gpu_hours"] == pytest.approx(gpus * p["priced_duration_s"] / 3600, rel=1e-12)
        assert p["priced_duration_s"] >= p["gpu_busy_s"]
    assert ps["priced_duration_s"] >= pf["priced_duration_s"]
    # queueing never makes a request faster than its prefill and loads alone
    assert ps["ttft_ms"]["p50"] >= ps["ttft_unloaded_ms"]["p50"] - 1e-9
    assert ps["ttft_ms"]["p99"] >= pf["ttft_ms"]["p99"]


def test_no_level_queues_as_recorded(tmp_path):
    """A stack that serves nothing (capacity 0) on a trace recorded without a tier computes what
    the trace computed: it keeps the engine's own TTFT, which the trace's steps give by hand, the
    end of each request's last prefill step less its arrival."""
    tr = read_trace(record(_busy_workload(), tmp_path / "t.parquet", hbm_kv_blocks=128, tier_policy="none"))
    assert int(tr.tier_hit_tokens.sum()) == 0
    an = StackAnalysis(tr)
    p = an.evaluate([Level("l", resolve_profile("local-dram"), 0)], "lru")
    end = np.asarray(tr.start_ns, np.float64) + np.asarray(tr.compute_ns, np.float64)
    from kvemu.schema import iter_entries

    last = {}
    for e in iter_entries(tr, columns=("step", "request_id", "phase")):
        for s, r, ph in zip(e["step"].tolist(), e["request_id"].tolist(), e["phase"].tolist()):
            if ph == 0:
                last[r] = max(last.get(r, -1), s)
    want = [(end[last[r]] - round(tr.arrival_ms[r] * 1e6)) / 1e6 for r in range(tr.n_requests)]
    assert p["ttft_ms"]["p50"] == pytest.approx(float(np.percentile(want, 50)), rel=1e-9)
    assert p["ttft_ms"]["p99"] == pytest.approx(float(np.percentile(want, 99)), rel=1e-9)
    assert max(want) > p["ttft_unloaded_ms"]["p99"]  # the engine queued
    # the one-level curve's queue (curve_queued_ttft) the same way: its services the recorded prefills,
    # nothing loaded; with a slower load of 1 MB per request, the p50 rises
    inp, c = tr.input_tokens.astype(np.int64), tr.cached_tokens.astype(np.int64)
    rec = an.prefill_ns(inp - c, c)
    rows = curve_queued_ttft(tr, {"capacity_blocks": [0, 1]}, [rec, rec], [np.zeros(len(rec)), np.full(len(rec), 1e6)],
                             1.0)
    assert rows[0]["p50_ms"] == pytest.approx(float(np.percentile(want, 50)), rel=1e-9)
    assert rows[0]["gpu_busy_s"] == pytest.approx(float(np.sum(tr.compute_ns)) / 1e9, rel=1e-9)
    assert rows[1]["gpu_busy_s"] == pytest.approx(rows[0]["gpu_busy_s"] + tr.n_requests * 1e6 / 1e9, rel=1e-9)
    assert rows[1]["p50_ms"] >= rows[0]["p50_ms"] + 1.0 - 1e-9  # 1 ms of load each
    assert rows[1]["mean_ms"] > rows[0]["mean_ms"] + 1.0  # and the queue behind them on top


def test_within_the_checked_tolerance_of_a_closed_loop_replay(tmp_path):
    """The shipped chat trace on a three-level stack, replayed in virtual time: the analysis's p50
    TTFT and TPOT within the tolerance the output states (QUEUE_CHECK), and the unloaded figure
    well outside it (what the queue adds)."""
    trace = ROOT / "traces" / "chat-llama3-8b-offload.parquet"
    out = tmp_path / "r.parquet"
    r = CliRunner().invoke(cli, ["replay", str(trace), "--layers", "2", "--tiers",
                                 "vemu:local-dram|cap=1GiB;vemu:cxl-pool|cap=4GiB;vemu:nvme|cap=16GiB",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    t = pq.read_table(out)
    ttft = t["ttft_ms"].to_numpy()
    tpot = t["tpot_ms"].to_numpy()
    tpot = tpot[np.isfinite(tpot)]
    a = CliRunner().invoke(cli, ["analyze", "capacity", str(trace), "--stack",
                                 "local-dram=1GiB,cxl-pool=4GiB,nvme=16GiB", "--json"])
    assert a.exit_code == 0, a.output
    doc = json.loads(a.output)
    p = doc["points"][0]
    assert doc["checked_against_replay"] == QUEUE_CHECK and p["checked_against_replay"] == QUEUE_CHECK
    for q in (50, 90, 99):
        got, want = p["ttft_ms"][f"p{q}"], float(np.percentile(ttft, q))
        assert abs(got / want - 1) <= QUEUE_CHECK[f"ttft_p{q}"] + 1e-9
    assert abs(p["ttft_unloaded_ms"]["p50"] / np.percentile(ttft, 50) - 1) > 2 * QUEUE_CHECK["ttft_p50"]
    assert abs(p["tpot_ms"]["p50"] / np.percentile(tpot, 50) - 1) <= QUEUE_CHECK["tpot_p50"] + 1e-9
    text = CliRunner().invoke(cli, ["analyze", "capacity", str(trace), "--stack",
                                    "local-dram=1GiB,cxl-pool=4GiB,nvme=16GiB"])
    assert text.exit_code == 0 and "checked against the closed loop: " + QUEUE_CHECK["text"] in text.output
