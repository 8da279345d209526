"""The serving-engine model: prefix hits, eviction and tier loads, batching, tier-resident reads."""

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from conftest import SHARED_TRACES, make_workload, record
from kvemu.analysis import trace_summary
from kvemu.engine.blocks import build_block_tables
from kvemu.errors import ConfigError
from kvemu.schema import ROW_ENTRY, check_entries, read_trace


def entries(path):
    t = pq.read_table(path)
    t = t.filter(pc.equal(t["row_type"], ROW_ENTRY))
    return {c: t[c].to_numpy() for c in ("step", "request_id", "phase", "tokens", "context_tokens", "load_first",
                                         "load_count", "store_first", "store_count", "read_first", "read_count")}


def test_block_tables_share_prefix_ids():
    w = make_workload([0, 1], [200, 150], [4, 3], [[1, 2, 3, 4], [1, 7, 8]], hash_block_tokens=64)
    t = build_block_tables(w.input_tokens, w.output_tokens, w.hash_offsets, w.hash_ids, 64, 16)
    a, b = t.table(0), t.table(1)
    assert len(a) == -(-(200 + 4 - 1) // 16) and len(b) == -(-(150 + 3 - 1) // 16)
    assert list(a[:4]) == list(b[:4])  # first hash block = four shared engine blocks
    assert not set(a[4:]) & set(b[4:])
    assert t.n_full_input.tolist() == [12, 9]
    run_off, starts, counts = t.runs()
    assert counts.sum() == len(t.ids) and len(starts) <= 5  # a handful of runs, not one per block


def test_hash_block_must_be_multiple_of_block():
    w = make_workload([0], [100], [2], [[1, 2]], hash_block_tokens=64)
    with pytest.raises(ConfigError, match="not a multiple of --block-tokens 48"):
        build_block_tables(w.input_tokens, w.output_tokens, w.hash_offsets, w.hash_ids, 64, 48)


def test_prefix_hits_in_hbm(tmp_path, shared_prefix_workload):
    path = record(shared_prefix_workload, tmp_path / "t.parquet", tier_policy="offload")
    tr = read_trace(path)
    assert tr.cached_tokens.tolist() == [0, 64, 128]
    assert tr.tier_hit_tokens.tolist() == [0, 0, 0]
    check_entries(tr)
    e = entries(path)
    # prefill computes exactly the uncached tokens; decode makes output - 1 steps
    for r, (inp, out) in enumerate(zip(tr.input_tokens, tr.output_tokens)):
        mine = e["request_id"] == r
        assert e["tokens"][mine & (e["phase"] == 0)].sum() == inp - tr.cached_tokens[r]
        assert np.count_nonzero(mine & (e["phase"] == 1)) == out - 1
    # write-through: every computed full input block is stored once
    assert e["store_count"].sum() == sum(i // 16 for i in tr.input_tokens) - tr.cached_tokens.sum() // 16


def _evicting_workload():
    return make_workload([0, 1000, 2000], [192, 192, 192], [1, 1, 1], [[1, 2, 3], [5, 6, 7], [1, 2, 3]])


def test_hbm_eviction_then_tier_load(tmp_path):
    path = record(_evicting_workload(), tmp_path / "t.parquet", tier_policy="offload", hbm_kv_blocks=13)
    tr = read_trace(path)
    # request 1 evicts request 0's cached blocks tail first, keeping block 0; request 2 then hits
    # block 0 in HBM and blocks 1..10 in the tier (at least one token is always recomputed)
    assert tr.cached_tokens.tolist() == [0, 0, 176]
    assert tr.tier_hit_tokens.tolist() == [0, 0, 160]
    e = entries(path)
    first = np.flatnonzero(e["request_id"] == 2)[0]
    assert (e["load_first"][first], e["load_count"][first]) == (1, 10)
    assert e["load_count"].sum() == 10
    assert read_trace(path).header.meta["engine"]["hbm_evictions"] >= 11


def test_without_tier_evicted_prefix_is_recomputed(tmp_path):
    path = record(_evicting_workload(), tmp_path / "t.parquet", tier_policy="none", hbm_kv_blocks=13)
    tr = read_trace(path)
    assert tr.cached_tokens.tolist() == [0, 0, 16]
    e = entries(path)
    assert e["load_count"].sum() == 0 and e["store_count"].sum() == 0


def test_request_larger_than_hbm_is_refused(tmp_path, shared_prefix_workload):
    with pytest.raises(ConfigError, match="request 0 needs 13 KV blocks"):
        record(shared_prefix_workload, tmp_path / "t.parquet", hbm_kv_blocks=5)


def test_batching_respects_budget_and_sequence_limit(tmp_path):
    rng = np.random.default_rng(1)
    n = 12
    w = make_workload([0.0] + sorted(rng.uniform(0, 50, n - 1)),
                      rng.integers(100, 1000, n).tolist(), rng.integers(2, 30, n).tolist())
    path = record(w, tmp_path / "t.parquet", max_num_batched_tokens=256, max_num_seqs=4)
    e = entries(path)
    per_step_tokens = np.bincount(e["step"], weights=e["tokens"])
    per_step_seqs = np.bincount(e["step"])
    assert per_step_tokens.max() <= 256
    assert per_step_seqs.max() <= 4
    assert per_step_tokens.max() == 256  # chunked prefill fills the budget
    # a request's prefill chunks are contiguous in context and add up to its input
    for r in range(n):
        mine = (e["request_id"] == r) & (e["phase"] == 0)
        ctx, tok = e["context_tokens"][mine], e["tokens"][mine]
        assert np.array_equal(ctx[1:], (ctx + tok)[:-1])
        assert ctx[0] + tok.sum() == w.input_tokens[r]


def test_resident_policy_reads_context_from_tier(tmp_path, shared_prefix_workload):
    path = record(shared_prefix_workload, tmp_path / "t.parquet", tier_policy="resident")
    tr = read_trace(path)
    e = entries(path)
    dec = e["phase"] == 1
    # every decode step reads all full blocks of the context, from position 0
    assert np.array_equal(e["read_count"][dec], e["context_tokens"][dec] // 16)
    assert np.all(e["read_first"] == 0)
    # every block that fills up (prefill or decode) is stored exactly once, except prefix hits
    for r in range(tr.n_requests):
        mine = e["request_id"] == r
        full_blocks = (tr.input_tokens[r] + tr.output_tokens[r] - 1) // 16
        assert e["store_count"][mine].sum() == full_blocks - tr.cached_tokens[r] // 16
    assert tr.tier_hit_tokens.tolist() == tr.cached_tokens.tolist() == [0, 64, 128]


def test_full_mooncake_conversation_trace(tmp_path):
    src = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    if not src.exists():
        pytest.skip(f"{src} not present")
    from kvemu.record_options import RecordOptions
    from kvemu.recording import record

    out = tmp_path / "mc.parquet"
    record(f"mooncake:{src}", "llama3-70b", out, RecordOptions.from_flat(show_progress=False))
    s = trace_summary(read_trace(out))
    assert s["requests"] == 12031
    assert abs(s["prefix_hit_ratio_unbounded"] - 0.374) < 0.002  # shared/REFERENCE.md: 37.4%
    assert s["input_tokens"] == 144_793_823 or abs(s["input_tokens"] / 12031 - 12035) < 1
    assert s["file_bytes"] < 40 * 2**20
    # the engine model never caches more than the unbounded ratio allows
    assert s["cached_tokens"] / s["input_tokens"] <= s["prefix_hit_ratio_unbounded"] + 1e-9


@pytest.mark.parametrize("path", ["tests/data/golden-trace-v2.parquet", "traces/chat-llama3-8b-offload.parquet",
                                  "traces/docqa-qwen2.5-72b-offload.parquet"])
def test_the_timing_rebuilt_from_a_trace_gives_its_recorded_step_times(path):
    """analysis.timing_from_meta rebuilds a trace's compute model: the golden v2 trace from before
    parallelism and per-phase factors were modelled (its one set of factors, gpus multiplying peak
    and bandwidth), and traces recorded since. Every step's recorded compute_ns must come out again
    to the nanosecond from the step's own entries (n_r new tokens on c_r context each): closed-loop
    replay of a trace schedules its steps with this."""
    from pathlib import Path

    from kvemu.analysis import timing_from_meta
    from kvemu.schema import PHASE_PREFILL, iter_entries, read_trace

    trace = read_trace(Path(__file__).resolve().parents[2] / path)
    timing = timing_from_meta(trace.header.meta)
    n = len(trace.step)
    tokens, pairs, touched, decode = (np.zeros(n) for _ in range(4))
    for e in iter_entries(trace):
        s, t, c = e["step"], e["tokens"].astype(np.float64), e["context_tokens"].astype(np.float64)
        np.add.at(tokens, s, t)
        np.add.at(pairs, s, t * (c + (t + 1) / 2))
        np.add.at(touched, s, c + t)
        np.add.at(decode, s, (e["phase"] != PHASE_PREFILL).astype(np.float64))
    want = np.asarray(trace.compute_ns)
    got = np.array([timing.step_ns(int(tokens[i]), pairs[i], int(touched[i]), int(decode[i])) for i in range(n)])
    assert np.array_equal(got, want), (np.flatnonzero(got != want)[:5], got[:3], want[:3])
