"""The numpy real run: a paged, prefix-sharing KV cache that gives the logits of a full recompute,
a recorder whose trace says what attention really wrote and read, and a trace that replays."""

import numpy as np
import pytest

from kvemu.analysis import trace_summary
from kvemu.errors import ConfigError, OutputError, TraceError
from kvemu.realrun.tiny import TinyConfig, TinyModel, record_tiny, run_tiny, tiny_prompts
from kvemu.realrun.tracebuild import LayerAccess, TraceBuilder, entry_ops
from kvemu.replay import replay
from kvemu.schema import PHASE_DECODE, PHASE_PREFILL, check_entries, read_trace

TPB = 8
CFG = TinyConfig(layers=3, hidden=48, heads=6, kv_heads=2, head_dim=8, vocab=97, seed=3)


@pytest.fixture(scope="module")
def model():
    return TinyModel(CFG)


@pytest.fixture(scope="module")
def shared_run(model):
    """Three requests: 0 and 1 share 20 prompt tokens (2 full blocks), 2 shares nothing."""
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, CFG.vocab, 20)
    prompts = [np.concatenate([prefix, rng.integers(0, CFG.vocab, 9)]),
               np.concatenate([prefix, rng.integers(0, CFG.vocab, 14)]),
               rng.integers(0, CFG.vocab, 21)]
    run = run_tiny(model, prompts, [7, 5, 6], tokens_per_block=TPB, max_num_seqs=2, keep_logits=True)
    return prompts, run


def entries(run):
    e = run.builder._entries
    return [dict(zip(e, row)) for row in zip(*e.values())]


def test_cached_decode_matches_full_recompute(model, shared_run):
    prompts, run = shared_run
    for rid, prompt in enumerate(prompts):
        gen = run.generated[rid]
        full = model.forward_full(np.concatenate([prompt, gen[:-1]]))  # no cache: the whole sequence again
        want = full[len(prompt) - 1:]
        got = np.array(run.logits[rid])
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
        assert [int(np.argmax(x)) for x in want] == gen


def test_float32_model_matches_too():
    m = TinyModel(TinyConfig(dtype="float32", seed=1))
    prompts = tiny_prompts(2, 30, 17, m.cfg.vocab, seed=2)
    run = run_tiny(m, prompts, 4, tokens_per_block=TPB, keep_logits=True)
    assert run.cached_tokens == [0, 16]
    for rid, p in enumerate(prompts):
        want = m.forward_full(np.concatenate([p, run.generated[rid][:-1]]))[len(p) - 1:]
        np.testing.assert_allclose(np.array(run.logits[rid]), want, rtol=0, atol=1e-5)


def test_shared_prefix_reads_the_cached_blocks_instead_of_recomputing(shared_run):
    prompts, run = shared_run
    assert run.cached_tokens == [0, 16, 0]  # two full blocks of request 0 reused by request 1
    assert run.tables[1][:2] == run.tables[0][:2]  # the same physical blocks
    assert not set(run.tables[2]) & set(run.tables[0][:2])
    first = [a for a in run.accesses if a["request"] == 1 and a["write_first"] < len(prompts[1])]
    assert len(first) == CFG.layers
    for a in first:  # its prefill wrote only the uncached tokens and read the shared blocks
        assert (a["write_first"], a["write_tokens"]) == (16, len(prompts[1]) - 16)
        assert a["read_blocks"][:2] == tuple(run.tables[0][:2])
        assert not set(a["write_blocks"]) & set(run.tables[0][:2])
    e = [x for x in entries(run) if x["request_id"] == 1 and x["phase"] == PHASE_PREFILL]
    assert len(e) == 1 and (e[0]["context_tokens"], e[0]["tokens"]) == (16, len(prompts[1]) - 16)
    assert (e[0]["read_first"], e[0]["read_count"]) == (0, 2)


def test_reads_per_decode_step_are_the_full_context_blocks_of_every_layer(shared_run):
    prompts, run = shared_run
    by_key = {}
    for a in run.accesses:
        by_key.setdefault((a["step"], a["request"]), []).append(a)
    decodes = [x for x in entries(run) if x["phase"] == PHASE_DECODE]
    assert len(decodes) == sum(o - 1 for o in (7, 5, 6))
    for x in decodes:
        ctx = x["context_tokens"]
        logged = by_key[(x["step"], x["request_id"])]
        assert sorted(a["layer"] for a in logged) == list(range(CFG.layers))
        for a in logged:  # what the layer's attention gathered from the pool
            assert (a["write_first"], a["write_tokens"], a["read_tokens"]) == (ctx, 1, ctx + 1)
            assert list(a["read_blocks"]) == run.tables[x["request_id"]][: -(-(ctx + 1) // TPB)]
        assert (x["read_first"], x["read_count"]) == (0, ctx // TPB)
        assert x["store_count"] == (1 if (ctx + 1) % TPB == 0 else 0)


def test_trace_validates_shows_dedup_and_replays(tmp_path):
    out = tmp_path / "tiny.parquet"
    meta = record_tiny(out, requests=4, prompt_tokens=40, output_tokens=6, shared_prefix_tokens=24,
                       tokens_per_block=TPB, layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, vocab=64)
    tr = read_trace(out)
    assert check_entries(tr) == meta["engine"]["entries"]
    assert tr.header.meta["model"]["source"] == "realrun:tiny"
    assert tr.header.meta["workload"]["kind"] == "realrun:tiny"
    assert tr.header.meta["engine"]["tier_policy"] == "resident"
    assert tr.cached_tokens.tolist() == [0, 24, 24, 24]
    assert tr.tier_hit_tokens.tolist() == tr.cached_tokens.tolist()
    assert np.all(tr.compute_ns > 0)  # measured
    s = trace_summary(tr)
    assert s["dedup_ratio"] > 1 and s["unique_blocks"] < s["referenced_blocks"]
    assert s["kv_blocks_loaded"] == 0 and s["kv_blocks_read"] > 0
    # each request stores its full blocks once, except those it found cached
    full = (40 + 6 - 1) // TPB
    assert s["kv_blocks_stored"] == 4 * full - 3 * (24 // TPB)
    for backend in ("dram", "vemu:cxl-pool"):
        res = replay(out, backend, None, out=tmp_path / f"r-{backend.replace(':', '_')}.parquet")
        assert res["ops"]["read"]["accesses"] == s["kv_blocks_read"] * 2
        assert res["steps"]["compute_ns"] == int(tr.compute_ns.sum())


def test_small_pool_evicts_and_stays_correct(model):
    prompts = tiny_prompts(4, 26, 16, CFG.vocab, seed=5)
    run = run_tiny(model, prompts, 3, tokens_per_block=TPB, max_num_seqs=1, pool_blocks=5, keep_logits=True)
    assert run.stats["evictions"] > 0
    for rid, p in enumerate(prompts):
        want = model.forward_full(np.concatenate([p, run.generated[rid][:-1]]))[len(p) - 1:]
        np.testing.assert_allclose(np.array(run.logits[rid]), want, rtol=0, atol=1e-9)
    with pytest.raises(ConfigError, match="pool"):
        run_tiny(model, prompts, 3, tokens_per_block=TPB, max_num_seqs=4, pool_blocks=5)


def test_entry_ops_need_every_layer_to_agree():
    a = [LayerAccess(0, 16, 1, 0, 17), LayerAccess(1, 16, 1, 0, 17)]
    assert entry_ops(a, 2, 8) == {"context_tokens": 16, "tokens": 1, "store": (0, 0), "read": (0, 2)}
    assert entry_ops([LayerAccess(0, 15, 1, 0, 16)], 1, 8)["store"] == (1, 1)
    # a sliding window: only the full blocks inside the window count
    assert entry_ops([LayerAccess(0, 40, 1, 20, 21)], 1, 8)["read"] == (3, 2)
    with pytest.raises(TraceError, match="layers"):
        entry_ops(a[:1], 2, 8)
    with pytest.raises(TraceError, match="same ranges"):
        entry_ops([a[0], LayerAccess(1, 16, 1, 8, 9)], 2, 8)


def test_builder_refuses_bad_input(tmp_path):
    b = TraceBuilder(8)
    r = b.add_request(arrival_ms=1.0, input_tokens=20, output_tokens=3, block_keys=["a", "b"])
    with pytest.raises(TraceError, match="arrival order"):
        b.add_request(arrival_ms=0.5, input_tokens=20, output_tokens=3)
    s = b.add_step(100)
    with pytest.raises(TraceError, match="exceeds its block table"):
        b.add_entry(s, r, phase=0, tokens=20, context_tokens=0, store=(2, 2))
    b.add_request(arrival_ms=2.0, input_tokens=30, output_tokens=1, block_keys=["b"])
    b.add_entry(s, r, phase=0, tokens=20, context_tokens=0, store=(0, 2))
    with pytest.raises(TraceError, match="position"):
        b.block_tables()
    with pytest.raises(TraceError, match="never ran"):
        b.write(tmp_path / "x.parquet", model=TinyModel(TinyConfig()).geometry(), workload={}, engine={}, capture={})


def test_record_tiny_refuses_bad_options_before_work(tmp_path):
    out = tmp_path / "t.parquet"
    out.write_bytes(b"x")
    with pytest.raises(OutputError):
        record_tiny(out)
    with pytest.raises(ConfigError, match="shared-prefix"):
        record_tiny(tmp_path / "u.parquet", prompt_tokens=10, shared_prefix_tokens=11)
    with pytest.raises(ConfigError, match="kv_heads"):
        record_tiny(tmp_path / "u.parquet", heads=4, kv_heads=3)
    with pytest.raises(ConfigError, match="KV dtype"):
        record_tiny(tmp_path / "u.parquet", kv_dtype="fp32")
