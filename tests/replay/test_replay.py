"""Replay on real DRAM: results that add up, reductions recorded, guards before allocation."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import make_workload, record
from kvemu.analysis import trace_summary
from kvemu.errors import ConfigError, OutputError, ResourceLimitError
from kvemu.replay import DataPathOptions, InstanceOptions, ReplayOptions, StoreOptions, TierOptions, WindowOptions, layer_plan, replay
from kvemu.schema import METADATA_KEY, read_trace


def results(path):
    t = pq.read_table(path)
    return t, json.loads(t.schema.metadata[METADATA_KEY])


def test_layer_plan_covers_every_layer_once():
    first, span = layer_plan(80, 3)
    assert first == [0, 26, 53] and span.tolist() == [26, 27, 27]
    assert layer_plan(32, None)[1].tolist() == [1] * 32
    with pytest.raises(ConfigError):
        layer_plan(32, 33)


def test_replay_results_add_up(tmp_path, chat_trace):
    out = tmp_path / "r.parquet"
    # one block per transfer (--chunk-tokens = the block): accesses count blocks
    meta = replay(chat_trace, "dram", ReplayOptions(window=WindowOptions(layers=2), datapath=DataPathOptions(chunk_tokens=16)), out=out)
    t, m = results(out)
    tr = read_trace(chat_trace)
    s = trace_summary(tr)
    assert t.num_rows == tr.n_requests
    ttft, e2el, queue = (t[c].to_numpy() for c in ("ttft_ms", "e2el_ms", "queue_ms"))
    assert np.all(queue >= 0) and np.all(ttft > queue) and np.all(e2el >= ttft)
    # one inter-token latency per generated token after the first
    itl = t["itl_ms"].to_pylist()
    assert [len(x) for x in itl] == (tr.output_tokens - 1).tolist()
    assert all(min(x) > 0 for x in itl if x)
    # KV bytes per request add up to the trace's totals (all layers)
    assert t["kv_bytes_stored"].to_numpy().sum() == s["kv_bytes_stored"]
    assert t["kv_bytes_loaded"].to_numpy().sum() == s["kv_bytes_loaded"]
    # the backend really performed one access per block per replayed layer, and timed each
    assert m["ops"]["store"]["accesses"] == s["kv_blocks_stored"] * 2
    assert m["ops"]["store"]["bytes"] == s["kv_blocks_stored"] * 2 * tr.header.block_bytes_per_layer
    assert sum(m["ops"]["store"]["hist"]["counts"]) == m["ops"]["store"]["accesses"]
    assert 0 < m["ops"]["store"]["p50_ns"] <= m["ops"]["store"]["p99_ns"] <= m["ops"]["store"]["p999_ns"]
    assert m["backend"]["mode"] == "measured"
    assert m["params"]["reductions"]["layers"] == {"replayed": [0, 16], "span": [16, 16], "of": 32}
    assert m["trace"]["sha256"] and m["host"]["cores"] >= 1
    # step time is compute plus the KV time the steps stalled on
    assert m["steps"]["total_ns"] >= m["steps"]["compute_ns"]
    assert meta["run_id"] == m["run_id"]


def test_tpot_is_nan_for_single_token_outputs(tmp_path):
    w = make_workload([0.0, 1.0], [100, 120], [1, 5])
    trace = record(w, tmp_path / "t.parquet")
    replay(trace, "dram", None, out=tmp_path / "r.parquet")
    t, _ = results(tmp_path / "r.parquet")
    tpot = t["tpot_ms"].to_numpy()
    assert np.isnan(tpot[0]) and tpot[1] > 0
    # e2el = ttft + (n - 1) * tpot by definition
    e2el, ttft = t["e2el_ms"].to_numpy(), t["ttft_ms"].to_numpy()
    assert e2el[1] == pytest.approx(ttft[1] + 4 * tpot[1])


def test_request_window_replays_co_batched_requests(tmp_path, chat_trace):
    out = tmp_path / "r.parquet"
    replay(chat_trace, "dram", ReplayOptions(window=WindowOptions(requests=(0, 2), layers=1)), out=out)
    t, m = results(out)
    assert t["request_id"].to_pylist() == [0, 1]
    red = m["params"]["reductions"]
    assert red["selected_requests"] == 2 and red["replayed_requests"] >= 2
    assert red["requests"] == [0, 2]


def test_arrival_window_selecting_nothing(tmp_path, chat_trace):
    with pytest.raises(ConfigError, match="selects no request"):
        replay(chat_trace, "dram", ReplayOptions(window=WindowOptions(arrival_ms=(1e12, 2e12))), out=tmp_path / "r.parquet")


def test_arena_over_max_memory_is_refused_before_allocating(tmp_path, chat_trace):
    with pytest.raises(ResourceLimitError, match="--max-memory"):
        replay(chat_trace, "dram", ReplayOptions(tier=TierOptions(max_memory_bytes=1 << 20)), out=tmp_path / "r.parquet")
    assert not any(tmp_path.iterdir())


def test_existing_results_are_never_overwritten(tmp_path, chat_trace):
    out = tmp_path / "r.parquet"
    out.write_bytes(b"precious")
    with pytest.raises(OutputError, match="already exists"):
        replay(chat_trace, "dram", ReplayOptions(window=WindowOptions(layers=1)), out=out)
    assert out.read_bytes() == b"precious"


def test_overlap_hides_kv_time_behind_compute(tmp_path):
    """Loads of a long prefix hit: pipelined, the step takes less than compute + KV time."""
    w = make_workload([0, 1000, 2000], [4096, 4096, 4096], [2, 2, 2],
                      [list(range(1, 65)), list(range(100, 164)), list(range(1, 65))])
    trace = record(w, tmp_path / "t.parquet", tier_policy="offload", hbm_kv_blocks=300)
    serial = replay(trace, "dram", ReplayOptions(window=WindowOptions(layers=4), stores=StoreOptions(timing="serial")), out=tmp_path / "s.parquet")
    overlap = replay(trace, "dram", ReplayOptions(window=WindowOptions(layers=4), datapath=DataPathOptions(overlap=True), stores=StoreOptions(timing="serial")), out=tmp_path / "o.parquet")
    assert serial["ops"]["load"]["accesses"] > 0
    for m in (serial, overlap):
        assert m["steps"]["total_ns"] >= m["steps"]["compute_ns"]
    kv = overlap["steps"]["kv_load_ns"] + overlap["steps"]["kv_store_ns"]
    assert overlap["steps"]["total_ns"] < overlap["steps"]["compute_ns"] + kv
    assert serial["steps"]["total_ns"] == serial["steps"]["compute_ns"] + serial["steps"]["kv_load_ns"] + \
        serial["steps"]["kv_store_ns"] + serial["steps"]["kv_read_ns"]


def test_results_in_many_row_groups_match_one(tmp_path, chat_trace, monkeypatch):
    """ITL gaps come back from the spill file a row group at a time: tiny groups (a few requests,
    a handful of gaps) give the same results as one group, in request order."""
    import kvemu.replay.accumulate as replay_mod

    one = tmp_path / "one.parquet"
    replay(chat_trace, "vemu:cxl-pool", ReplayOptions(instances=InstanceOptions(count=2, sharing="replicated")), out=one)
    monkeypatch.setattr(replay_mod, "ITL_VALUES_PER_GROUP", 7)
    monkeypatch.setattr(replay_mod, "RESULT_GROUP_ROWS", 3)
    many = tmp_path / "many.parquet"
    replay(chat_trace, "vemu:cxl-pool", ReplayOptions(instances=InstanceOptions(count=2, sharing="replicated")), out=many)
    assert pq.ParquetFile(one).metadata.num_row_groups == 1
    assert pq.ParquetFile(many).metadata.num_row_groups > 2
    a, b = pq.read_table(one), pq.read_table(many)
    assert a.column_names == b.column_names and a.column_names[-2:] == ["itl_ms", "instance"]
    assert a.num_rows == b.num_rows and b["request_id"].to_pylist() == sorted(b["request_id"].to_pylist())
    for name in ("request_id", "ttft_ms", "e2el_ms", "itl_ms", "instance"):
        assert a[name].to_pylist() == b[name].to_pylist(), name
