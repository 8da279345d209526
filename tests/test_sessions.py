"""Sessions: a follow-up is released in closed loop when its parent completes plus the recorded gap
(--arrivals session), so a slower tier delays every later turn. Checked by hand, turn by turn: each
turn runs alone on the GPU (its parent has completed before it is sent), so its end-to-end time is
the sum of its own steps, priced here as tests/replay/test_closed_loop.py's simulation prices them
(the documented roofline plus a fixed cost per block-layer access; not the engine's code), and the
next turn's arrival is that end plus its gap."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import make_workload, record
from kvemu import metrics
from kvemu.errors import OptionError, TraceError
from kvemu.models import resolve_model
from kvemu.replay import DataPathOptions, InstanceOptions, OutputOptions, ReplayOptions, ScheduleOptions, \
    StoreOptions, replay
from kvemu.schema import read_trace
from kvemu.sessions import build_graph, graph_problem
from kvemu.validation import check_sessions
from kvemu.workloads import load_workload

ROOT = Path(__file__).resolve().parents[1]
TPB, LAYERS = 16, 32            # llama3-8b's layers; 16-token blocks
BLOCK_LAYER_BYTES = 65536       # 16 tokens x 2 x 8 KV heads x 128 x 2 bytes, one layer
BW = 64.0                       # GB/s = bytes per ns: a block-layer access moves in 1024 ns
BUDGET, SEQS = 64, 3
RECORDED = [0.0, 50.0, 120.0]   # the turns' recorded arrivals (ms)
INPUTS = [100, 150, 200]
OUTPUTS = [6, 5, 4]
GAPS = [0.0, 5.0, 8.0]          # tool time after the previous turn completes (ms)
FAST, SLOW = 0, 400_000         # the tier's latency per access (ns)


def session_workload(with_sessions=True):
    w = make_workload(RECORDED, INPUTS, OUTPUTS)
    if with_sessions:
        w = dataclasses.replace(w, sessions=build_graph(np.array([-1, 0, 1]), np.array(GAPS)))
    return w


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("sessions")
    kw = dict(tier_policy="resident", max_num_batched_tokens=BUDGET, max_num_seqs=SEQS)
    return (record(session_workload(), d / "s.parquet", **kw),
            record(session_workload(False), d / "plain.parquet", **kw))


def run(trace, latency_ns, out, arrivals=None, **groups):
    spec = f"vemu:cxl-pool,latency_ns={latency_ns},bandwidth_gbps={BW},concurrency=1"
    opts = ReplayOptions(datapath=DataPathOptions(link="cpu", chunk_tokens=TPB), stores=StoreOptions(timing="serial"),
                         output=OutputOptions(force=True), schedule=ScheduleOptions(arrivals=arrivals)).but(**groups)
    replay(trace, spec, opts, out=out)
    t = pq.read_table(out)
    return t.to_pydict(), json.loads(t.schema.metadata[b"kvemu"])


def roofline_ns(tokens, pairs, touched):
    """docs/engine.md: a step on one H100 SXM at mfu 0.5 / mbu 0.7 plus 300 us (llama3-8b), the
    2-norm of the compute and HBM terms."""
    m = resolve_model("llama3-8b")
    flops = 2.0 * m.active_params * tokens + 2.0 * m.layers * m.attention_heads * (m.qk_head_dim + m.v_head_dim) * pairs
    nbytes = min(m.params, m.active_params * max(1, tokens)) * 2 + m.kv_bytes_per_token * touched
    return int(math.hypot(flops / (989e12 * 0.5), nbytes / (3350e9 * 0.7)) * 1e9 + 300e3)


def alone_e2e_ms(i, latency_ns):
    """Turn i's end-to-end time alone, KV resident in the tier: prefill chunks of at most BUDGET
    tokens (each reads the blocks before it and stores the blocks it fills), then one decode step
    per further token (reading the context's full blocks, storing a block it fills); every access
    of a block in one layer costs the tier's latency plus 1024 ns."""
    access = latency_ns + BLOCK_LAYER_BYTES / BW
    inp, out = INPUTS[i], OUTPUTS[i]
    ns, done = 0, 0
    while done < inp:
        k = min(inp - done, BUDGET)
        blocks = done // TPB + ((done + k) // TPB - done // TPB)
        ns += roofline_ns(k, k * (done + (k + 1) / 2), k) + LAYERS * blocks * access
        done += k
    for gen in range(1, out):  # the first token came with the last prefill chunk
        ctx = inp + gen - 1
        blocks = ctx // TPB + (1 if (ctx + 1) % TPB == 0 else 0)
        ns += roofline_ns(1, ctx + 1, 1) + LAYERS * blocks * access
    return ns / 1e6


def session_arrivals(latency_ns):
    """By hand: turn 1 at 0; turn k+1 when turn k ends (its arrival + its time alone) plus its gap."""
    a = [0.0]
    for k in (1, 2):
        a.append(a[k - 1] + alone_e2e_ms(k - 1, latency_ns) + GAPS[k])
    return a


def test_turn_three_moves_by_the_earlier_turns_extra_time(traces, tmp_path):
    s_trace, _ = traces
    fast, fast_meta = run(s_trace, FAST, tmp_path / "f.parquet")
    slow, _ = run(s_trace, SLOW, tmp_path / "s.parquet")
    assert fast_meta["schedule"]["arrivals"]["ran"] == "session"  # the default for a trace with sessions
    assert fast["arrival_ms"] == pytest.approx(session_arrivals(FAST), abs=1e-6)
    assert slow["arrival_ms"] == pytest.approx(session_arrivals(SLOW), abs=1e-6)
    extra = [alone_e2e_ms(i, SLOW) - alone_e2e_ms(i, FAST) for i in range(2)]
    assert extra[0] > 1 and extra[1] > 1  # the slow tier costs each turn time
    assert slow["arrival_ms"][2] - fast["arrival_ms"][2] == pytest.approx(extra[0] + extra[1], abs=1e-6)
    # each turn ran alone: its end-to-end time is the simulation's for it alone
    assert slow["e2el_ms"] == pytest.approx([alone_e2e_ms(i, SLOW) for i in range(3)], abs=1e-6)
    assert fast["session_id"] == [0, 0, 0] and fast["turn"] == [0, 1, 2]


def test_recorded_arrivals_keep_the_recorded_times(traces, tmp_path):
    s_trace, _ = traces
    r, meta = run(s_trace, SLOW, tmp_path / "r.parquet", arrivals="recorded")
    assert r["arrival_ms"] == RECORDED and RECORDED[2] < session_arrivals(SLOW)[2]
    assert meta["schedule"]["arrivals"] == {"ran": "recorded", "from": "--arrivals", "sessions": True}
    assert meta["label"].endswith("+recorded-arrivals")
    # the first turn is alone until the second arrives at 50 ms, then they share steps: it ends later
    assert r["e2el_ms"][0] > alone_e2e_ms(0, SLOW) > RECORDED[1]


def test_a_trace_without_sessions_is_unchanged(traces, tmp_path):
    _, plain = traces
    assert "sessions" not in read_trace(plain).header.meta
    default, meta = run(plain, SLOW, tmp_path / "d.parquet")
    session, _ = run(plain, SLOW, tmp_path / "s.parquet", arrivals="session")
    assert "arrivals" not in meta["schedule"] and "session_id" not in default
    assert default["arrival_ms"] == RECORDED
    for k in ("arrival_ms", "ttft_ms", "e2el_ms"):
        assert default[k] == session[k]


def test_session_arrivals_need_one_closed_loop_instance(traces, tmp_path):
    s_trace, _ = traces
    with pytest.raises(OptionError, match="one instance"):
        run(s_trace, FAST, tmp_path / "x.parquet", arrivals="session", instances=InstanceOptions(count=2))
    with pytest.raises(OptionError, match="closed"):
        run(s_trace, FAST, tmp_path / "y.parquet", arrivals="session", schedule__schedule="recorded")
    # by default, several instances replay a session trace at its recorded times, and say so
    r, meta = run(s_trace, FAST, tmp_path / "z.parquet", instances=InstanceOptions(count=2))
    assert r["arrival_ms"] == RECORDED and meta["schedule"]["arrivals"]["ran"] == "recorded"


def test_the_trace_keeps_the_graph_and_refuses_a_broken_one(traces):
    s_trace, _ = traces
    s = read_trace(s_trace).header.meta["sessions"]
    assert (s["parent"], s["gap_ms"], s["session"], s["turn"]) == ([-1, 0, 1], GAPS, [0, 0, 0], [0, 1, 2])
    good = {k: s[k] for k in ("version", "gap_from", "sessions", "max_turn", "parent", "gap_ms", "session", "turn")}
    for bad, why in (({"parent": [-1, 2, 1]}, "parent\\[1\\]"), ({"turn": [0, 1, 1]}, "turn"),
                     ({"gap_ms": [0.0, -1.0, 8.0]}, "gap_ms"), ({"parent": [-1, 0]}, "one value per request"),
                     ({"version": 2}, "version"), ({"session": [0, 1, 1]}, "session"),
                     ({"max_turn": "2"}, "max_turn"), ({"sessions": 2}, "sessions.sessions")):
        with pytest.raises(TraceError, match=why):
            check_sessions("t", {"sessions": {**good, **bad}}, 3)
    check_sessions("t", {"sessions": good}, 3)
    check_sessions("t", {}, 3)  # absent: no sessions
    assert graph_problem(np.array([-1, 0]), np.zeros(2), np.array([0, 0]), np.array([0, 1]), 2) is None


def test_readers_keep_parents_and_gaps():
    """Hand-read from the samples in traces/formats: the second request continues the first."""
    formats = ROOT / "traces" / "formats"
    # Bailian: chat 101's parent is 100, 2.543 s later; no think time recorded: the inter-arrival gap
    b = load_workload(f"bailian:{formats / 'bailian.jsonl'}").sessions
    assert b.parent[1] == 0 and b.gap_ms[1] == pytest.approx(2543.0) and b.gap_from == "inter-arrival"
    # agentic_mooncake: r1 waits for r0, dispatched delay 155.3 + tool_wait_ms 465.8 after it completes
    d = load_workload(f"dynamo:{formats / 'dynamo-agentic.jsonl'}").sessions
    assert d.parent[1] == 0 and d.gap_ms[1] == pytest.approx(621.1)
    # SemiAnalysis: call 2 at t=2.543 s after call 1 (t=0, api_time 1.922 s): 0.621 s after it ended
    s = load_workload(f"semianalysis:{formats / 'semianalysis.jsonl'}").sessions
    assert s.parent[1] == 0 and s.gap_ms[1] == pytest.approx(621.0)
    assert load_workload(f"mooncake:{formats / 'mooncake.jsonl'}").sessions is None


def test_a_window_cuts_the_links_to_requests_it_leaves_out():
    formats = ROOT / "traces" / "formats"
    full = load_workload(f"bailian:{formats / 'bailian.jsonl'}").sessions
    later = load_workload(f"bailian:{formats / 'bailian.jsonl'}", window_ms=(1.0, float("inf"))).sessions
    # the first request is left out: its child becomes a root of its own session, turn 0
    assert full.parent[1] == 0 and later.parent[0] == -1 and later.turn[0] == 0
    assert later.parent.tolist() == [-1 if p <= 0 else p - 1 for p in full.parent[1:].tolist()]


def test_report_per_turn_and_per_session_by_hand():
    rows = pa.table({"session_id": [0, 0, 1, 0], "turn": [0, 1, 0, 2], "arrival_ms": [0.0, 20.0, 5.0, 50.0],
                     "ttft_ms": [2.0, 4.0, 3.0, 6.0], "e2el_ms": [10.0, 12.0, 7.0, 9.0]})
    s = metrics.session_summary(rows)
    assert [(t["turn"], t["requests"], t["mean_ttft_ms"], t["mean_e2el_ms"]) for t in s["turns"]] == \
        [(0, 2, 2.5, 8.5), (1, 1, 4.0, 12.0), (2, 1, 6.0, 9.0)]
    # session 0: 0 ms to 50 + 9 = 59 ms, TTFT 2 + 4 + 6 = 12; session 1: 5 to 12 ms (7), TTFT 3
    assert s["sessions"]["sessions"] == 2
    assert s["sessions"]["mean_session_ms"] == pytest.approx((59 + 7) / 2)
    assert s["sessions"]["mean_ttft_sum_ms"] == pytest.approx((12 + 3) / 2)
    assert metrics.session_summary(rows.drop(["turn"])) is None
