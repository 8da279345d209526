"""Attention families (issue 25 items 3-4): KV bytes per token against hand computations from the
published config.json files, config.json parsing of the same figures, the trace's KV-group metadata,
and a sliding-window trace storing fewer bytes than its full-attention twin by the hand-computed ratio.

Published figures used below (docs/engine.md, "Attention families"):
- gpt-oss-120b: 36 layers alternating sliding (window 128) / full, 8 KV heads x 64 dims.
- Gemma 3 27B: 62 layers, pattern 6 (layers 5, 11, ..., 59 global: 10), window 1024, 16 KV heads x 128.
- Qwen3-Next-80B-A3B: 48 layers, every 4th full (12), 2 KV heads x 256; DeltaNet 16 key / 32 value
  heads of 128 dims, conv kernel 4.
- Llama 4 Scout: 48 layers, every 4th global (12), chunk 8192 on the other 36, 8 KV heads x 128.
- DeepSeek-V3.2: 61 MLA layers of 512 + 64 values, indexer keys 128 FP8 + one FP32 scale.
"""

import dataclasses
import json

import numpy as np
import pytest

from kvemu.engine.blocks import build_block_tables
from kvemu.engine.kvgeometry import pool_accounting
from kvemu.errors import ConfigError, TraceError
from kvemu.models import PRESETS, resolve_model

K1, K8, K128 = 1024, 8192, 131072
BF16 = 2


def gpt_oss(L):
    per = 2 * 8 * 64 * BF16  # 2048 bytes per token per layer
    return 18 * per * L + 18 * per * min(L, 128)


def gemma3(L):
    per = 2 * 16 * 128 * BF16  # 8192
    return 10 * per * L + 52 * per * min(L, 1024)


QWEN_STATE = (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * BF16  # recurrent + conv, per layer


def qwen3_next(L):
    return 12 * (2 * 2 * 256 * BF16) * L + 36 * QWEN_STATE


def scout(L):
    per = 2 * 8 * 128 * BF16  # 4096
    in_chunk = L - 8192 * ((L - 1) // 8192)  # tokens of the last token's chunk
    return 12 * per * L + 36 * per * in_chunk


def dsv32(L):
    return 61 * (576 * BF16) * L + 61 * (128 + 4) * L


FAMILIES = {"gpt-oss-120b": gpt_oss, "gemma-3-27b": gemma3, "qwen3-next-80b-a3b": qwen3_next,
            "llama-4-scout": scout, "deepseek-v3.2": dsv32}


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("L", [K1, K8, K128])
def test_kv_bytes_per_token_against_the_published_configs(name, L):
    m = PRESETS[name]
    assert m.kv_bytes(L) == FAMILIES[name](L)
    assert m.kv_bytes_per_token_at(L) == pytest.approx(FAMILIES[name](L) / L)


def test_hand_numbers_at_a_glance():
    # the same figures, written out: a reader can check them against the model cards
    assert gpt_oss(K128) == 18 * 2048 * 131072 + 18 * 2048 * 128 == 4_836_556_800
    assert gemma3(K8) == 10 * 8192 * 8192 + 52 * 8192 * 1024 == 1_107_296_256
    assert QWEN_STATE == 1_097_728 and qwen3_next(K1) == 12 * 2048 * 1024 + 36 * 1_097_728
    assert scout(K128) == 12 * 4096 * 131072 + 36 * 4096 * 8192 and scout(8193) == 12 * 4096 * 8193 + 36 * 4096
    assert dsv32(K1) == 61 * 1284 * 1024


def test_windows_stop_growing_and_full_attention_does_not():
    g = PRESETS["gemma-3-27b"]
    # past the window only the 10 global layers grow: 10 x 8192 bytes per further token
    assert g.kv_bytes(K8 + 1) - g.kv_bytes(K8) == 10 * 8192
    assert g.kv_bytes(512) - g.kv_bytes(511) == 62 * 8192
    full = PRESETS["llama3-70b"]
    assert full.uniform and full.kv_bytes(K128) == K128 * 80 * 2 * 8 * 128 * BF16


def test_fp8_kv_halves_attention_but_not_indexer_or_state():
    d = PRESETS["deepseek-v3.2"].with_kv_dtype("fp8")
    assert d.kv_bytes(K1) == 61 * 576 * K1 + 61 * 132 * K1
    q = PRESETS["qwen3-next-80b-a3b"].with_kv_dtype("fp8")
    assert q.kv_bytes(K1) == 12 * 1024 * K1 + 36 * QWEN_STATE


# ------------------------------------------------------------------------------ config.json
def write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return str(p)


GPT_OSS_CFG = {"model_type": "gpt_oss", "num_hidden_layers": 36, "hidden_size": 2880, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128, "vocab_size": 201088,
               "intermediate_size": 2880, "num_local_experts": 128, "num_experts_per_tok": 4,
               "layer_types": ["sliding_attention", "full_attention"] * 18}
GEMMA3_CFG = {"model_type": "gemma3", "text_config": {
    "model_type": "gemma3_text", "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
    "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024, "sliding_window_pattern": 6,
    "intermediate_size": 21504, "vocab_size": 262208}}
QWEN3_NEXT_CFG = {"model_type": "qwen3_next", "num_hidden_layers": 48, "hidden_size": 2048,
                  "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
                  "num_experts_per_tok": 10, "moe_intermediate_size": 512, "vocab_size": 151936}
SCOUT_CFG = {"model_type": "llama4", "text_config": {
    "model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192, "no_rope_layers": [1, 1, 1, 0] * 12,
    "num_local_experts": 16, "num_experts_per_tok": 1, "intermediate_size": 8192, "vocab_size": 202048}}
DSV32_CFG = {"model_type": "deepseek_v32", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
             "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
             "q_lora_rank": 1536, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
             "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
             "first_k_dense_replace": 3, "intermediate_size": 18432, "vocab_size": 129280}
CONFIGS = {"gpt-oss-120b": GPT_OSS_CFG, "gemma-3-27b": GEMMA3_CFG, "qwen3-next-80b-a3b": QWEN3_NEXT_CFG,
           "llama-4-scout": SCOUT_CFG, "deepseek-v3.2": DSV32_CFG}


@pytest.mark.parametrize("name", CONFIGS)
def test_config_json_gives_the_same_kv_bytes(tmp_path, name):
    m = resolve_model(write(tmp_path, CONFIGS[name]))
    for L in (K1, K8, K128):
        assert m.kv_bytes(L) == FAMILIES[name](L), (name, L)


def test_gpt_oss_experts_per_token_name(tmp_path):
    cfg = {k: v for k, v in GPT_OSS_CFG.items() if k != "num_experts_per_tok"}
    m = resolve_model(write(tmp_path, {**cfg, "experts_per_token": 4}))
    assert (m.experts, m.experts_per_token) == (128, 4)


def test_gemma3_pattern_and_layer_types_agree(tmp_path):
    by_pattern = resolve_model(write(tmp_path, GEMMA3_CFG))
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]
    cfg = {**GEMMA3_CFG["text_config"], "layer_types": types}
    by_types = resolve_model(write(tmp_path, cfg, "t.json"))
    assert by_pattern.kv_groups == by_types.kv_groups


def test_qwen35_float32_state(tmp_path):
    cfg = {**QWEN3_NEXT_CFG, "mamba_ssm_dtype": "float32"}
    m = resolve_model(write(tmp_path, cfg))
    state = 32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2
    assert m.kv_bytes(K1) == 12 * 2048 * K1 + 36 * state


def test_qwen2_disabled_window_stays_full(tmp_path):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
           "num_key_value_heads": 2, "sliding_window": 4096, "use_sliding_window": False}
    assert resolve_model(write(tmp_path, cfg)).uniform


@pytest.mark.parametrize("bad, message", [
    ({"layer_types": ["full_attention"] * 35}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 36, "sliding_window": None}, "no sliding_window"),
    ({"layer_types": ["wavy"] * 36}, "layer_types"),
])
def test_bad_layer_configs_are_refused(tmp_path, bad, message):
    with pytest.raises(ConfigError, match=message):
        resolve_model(write(tmp_path, {**GPT_OSS_CFG, **bad}))


# ------------------------------------------------------------------------------ traces
def _record(tmp_path, model, name, policy="offload", **workload):
    from kvemu import RecordOptions, record
    from kvemu.record_options import EngineOptions, WorkloadOptions

    knobs = ",".join(f"{k}={v}" for k, v in workload.items())
    opts = RecordOptions(workload=WorkloadOptions(max_requests=4),
                         engine=EngineOptions(tier_policy=policy, hbm_kv_gib=64))
    out = tmp_path / f"{name}.parquet"
    record(f"synthetic:docqa:{knobs}" if knobs else "synthetic:docqa", model, out, opts)
    return out


def test_sliding_window_trace_stores_fewer_bytes_by_the_hand_ratio(tmp_path, monkeypatch):
    from kvemu import models
    from kvemu.analysis import trace_summary
    from kvemu.schema import read_trace

    # the same model with full attention in every layer, as a preset of its own
    full = dataclasses.replace(PRESETS["gemma-3-27b"], name="gemma-3-27b-full", groups=())
    monkeypatch.setitem(models.PRESETS, full.name, full)
    s_win = trace_summary(read_trace(_record(tmp_path, "gemma-3-27b", "win")))
    s_full = trace_summary(read_trace(_record(tmp_path, full.name, "full")))
    tr = read_trace(tmp_path / "win.parquet")
    assert s_win["kv_blocks_stored"] == s_full["kv_blocks_stored"] > 0  # the same schedule of stores
    # Hand ratio. Offload stores each request's new full prompt blocks; a global layer stores all of
    # them, a sliding layer only those in the last 1024 tokens (64 blocks of 16) of the prompt's full blocks.
    tpb, per_block = 16, 16 * 8192
    n_full = tr.input_tokens.astype(int) // tpb
    cached_blocks = tr.cached_tokens.astype(int) // tpb
    stored = n_full - cached_blocks
    window_stored = np.minimum(stored, 64)  # stores run up to n_full; the window is its last 64 blocks
    win_bytes = int((10 * stored + 52 * window_stored).sum()) * per_block
    full_bytes = int((62 * stored).sum()) * per_block
    assert s_full["kv_bytes_stored"] == full_bytes
    assert s_win["kv_bytes_stored"] == win_bytes
    assert s_win["kv_bytes_stored"] / s_full["kv_bytes_stored"] == pytest.approx(win_bytes / full_bytes)
    assert win_bytes < full_bytes


def test_trace_records_kv_groups_and_old_traces_read_as_full(tmp_path):
    from kvemu.analysis import trace_geometry
    from kvemu.schema import read_header, read_trace

    p = _record(tmp_path, "gpt-oss-120b", "oss")
    meta = read_header(p).meta["model"]
    assert meta["kv_groups"]["version"] == 1
    assert [(g["kind"], g["layers"], g["window"]) for g in meta["kv_groups"]["groups"]] == [
        ("sliding", 18, 128), ("full", 18, 0)]
    assert trace_geometry(read_trace(p)).kv_bytes(K8) == gpt_oss(K8)
    # the golden v2 trace (no kv_groups) is full attention in every layer
    golden = read_trace("tests/data/golden-trace-v2.parquet")
    g = trace_geometry(golden)
    assert g.uniform and g.kv_bytes(100) == 100 * g.layers * golden.header.model["kv_bytes_per_token_layer"]


def test_a_trace_with_bad_kv_groups_is_refused(tmp_path):
    import pyarrow.parquet as pq

    from kvemu.integrity import METADATA_KEY
    from kvemu.schema import read_header

    p = _record(tmp_path, "gpt-oss-120b", "oss")
    t = pq.read_table(p)
    meta = json.loads(t.schema.metadata[METADATA_KEY])
    meta["model"]["kv_groups"]["groups"][0]["layers"] = 17
    bad = tmp_path / "bad.parquet"
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(meta)}), bad)
    with pytest.raises(TraceError, match="KV groups cover 35 layers, the model has 36"):
        read_header(bad)


def test_engine_reserves_the_window_not_the_context():
    from kvemu.engine.scheduler import EngineConfig

    g = PRESETS["gemma-3-27b"]
    acc = pool_accounting(g, 16, 256)
    # a pool block is a block of the 10 global layers; the sliding layers' window, 65 blocks
    # (ceil(1023 / 16) + 1) of 52 layers, is reserved per request
    assert acc["pool_block_bytes"] == 16 * 8192 * 10
    assert acc["bounded_kv_blocks"] == ((65, 16 * 8192 * 52),)
    cfg = EngineConfig(**acc)
    assert cfg.extra_blocks(1000) == -(-65 * 16 * 8192 * 52 // (16 * 8192 * 10)) == 338
    assert cfg.extra_blocks(10) == 52  # a short request holds its 10 blocks in the sliding layers too
    q = pool_accounting(PRESETS["qwen3-next-80b-a3b"], 16, 256)
    assert q["checkpoint_blocks"] == 16 and q["state_bytes_per_request"] == 36 * QWEN_STATE
    assert pool_accounting(PRESETS["llama3-8b"], 16, 256) == {}


def test_linear_attention_prefix_hits_stop_at_checkpoints():
    from kvemu.engine.pool import BlockPool
    from kvemu.engine.scheduler import EngineCaches, admit

    pool = BlockPool(None)
    pool.reserve(20)
    pool.register(list(range(20)))
    pool.release(list(range(20)), 0)
    caches = EngineCaches(pool, None, False)
    table = list(range(20)) + [100, 101]
    # 20 blocks cached; checkpoints every 8 blocks: the state is there after block 16, not 20
    r = admit(1, table, 22 * 16, 1, 22, 16, caches, checkpoint=8)
    assert r.computed == 16 * 16
    r2 = admit(2, table, 22 * 16, 1, 22, 16, EngineCaches(pool, None, False))
    assert r2.computed == 20 * 16


def test_breakeven_follows_the_window():
    from kvemu.analysis import breakeven_gbps, breakeven_timing

    rows = {r["prefix_tokens"]: r for r in breakeven_gbps(breakeven_timing(model="gemma-3-27b", gpus=1))}
    assert rows[K8]["kv_bytes"] == gemma3(K8)
    assert rows[131072]["kv_bytes"] == gemma3(131072)


def test_step_equivalents_by_hand():
    g = PRESETS["gemma-3-27b"]
    # a decode at context 8191 (token 8192): global layers attend to 8192 tokens, sliding ones to 1024
    pairs, touched = g.step_equivalents(8191, 1)
    assert pairs == pytest.approx((10 * 8192 + 52 * 1024) / 62)
    assert touched == pytest.approx(gemma3(8192) / (62 * 8192))
    # a 2048-token prefill from 0: sliding layers' pairs 1..1024 then 1024 each
    pairs, _ = g.step_equivalents(0, 2048)
    assert pairs == pytest.approx((10 * 2048 * 2049 / 2 + 52 * (1024 * 1025 / 2 + 1024 * 1024)) / 62)
    s = PRESETS["llama-4-scout"]
    # tokens 8192..8193 after 8191 cached: the chunked layers' chunk restarts at 8193
    pairs, _ = s.step_equivalents(8191, 2)
    assert pairs == pytest.approx((12 * (8192 + 8193) + 36 * (8192 + 1)) / 48)
    q = PRESETS["qwen3-next-80b-a3b"]
    pairs, touched = q.step_equivalents(100, 1)
    assert pairs == pytest.approx(12 * 101 / 48) and touched == pytest.approx(qwen3_next(101) / (12 * 2048))
    full = PRESETS["llama3-8b"]
    assert full.step_equivalents(100, 28) == (28 * (100 + 29 / 2), 128.0)


def test_a_windowed_decode_step_reads_less_than_its_full_twin():
    from kvemu.engine import make_timing

    win = PRESETS["gemma-3-27b"]
    full = dataclasses.replace(win, groups=())
    t_win, t_full = (make_timing("H100-SXM", m, 1) for m in (win, full))
    ctx = 100_000
    a = t_win.step_ns(1, *win.step_equivalents(ctx, 1), 1)
    b = t_full.step_ns(1, *full.step_equivalents(ctx, 1), 1)
    # decode at batch 1 is memory-bound: weights + KV; the windowed model's KV is kv_bytes(ctx + 1)
    assert a < b
    kv_w, kv_f = win.kv_bytes(ctx + 1), full.kv_bytes(ctx + 1)
    assert kv_f / kv_w == pytest.approx(62 * (ctx + 1) / (10 * (ctx + 1) + 52 * 1024))


@pytest.mark.parametrize("name", [*FAMILIES, "llama3-8b"])
def test_decode_equivalents_match_the_general_sum(name):
    m = PRESETS[name]
    d = m.decode_equivalents()
    if m.uniform:
        assert d is None
        return
    for ctx in (0, 1, 127, 128, 1023, 1024, 8191, 8192, 100_000):
        assert d(ctx) == pytest.approx(m.step_equivalents(ctx, 1), rel=1e-12)


def test_hbm_holds_more_requests_of_a_windowed_model_by_the_hand_count():
    """24 requests of 4,000 prompt tokens arrive at once, no shared prefixes, the same HBM bytes for
    both: 2,000 blocks of all 62 layers. Full attention in every layer: each request needs its
    table, ceil((4000 + 100 - 1) / 16) = 257 blocks, so 7 run together. gemma-3-27b: a pool block
    is a block of the 10 global layers, so the same bytes hold 2,000 x 62 / 10 = 12,400 of them; a
    request needs its 257 plus the sliding layers' 65-block window over 52 layers in pool blocks,
    ceil(65 x 52 / 10) = 338: 595, so 20 run together."""
    from kvemu.engine import make_timing
    from kvemu.engine.scheduler import EngineConfig, EngineLog, StepOutcome, engine_steps

    n, inp, out = 24, 4000, 100
    tables = build_block_tables(np.full(n, inp), np.full(n, out), np.zeros(n + 1, np.int64), np.zeros(0, np.int64),
                                None, 16)
    win = PRESETS["gemma-3-27b"]
    cases = ((dataclasses.replace(win, groups=()), 2000, 2000 // 257), (win, 2000 * 62 // 10, 12400 // (257 + 338)))
    assert [c[2] for c in cases] == [7, 20]
    for model, blocks, expect in cases:
        cfg = EngineConfig(tier_policy="none", hbm_kv_blocks=blocks, max_num_batched_tokens=8192,
                           **pool_accounting(model, 16, 256))
        log = EngineLog(n)
        gen = engine_steps(tables, np.zeros(n, np.int64), np.full(n, inp), np.full(n, out),
                           make_timing("H100-SXM", model, 1), cfg, log)
        try:
            plan = next(gen)
            while True:
                plan = gen.send(StepOutcome(plan.start_ns + plan.compute_ns))
        except StopIteration:
            pass
        e = log.take_entries()  # a row per request in a step: the most rows of one step run together
        assert len(set(zip(e["step"].tolist(), e["request_id"].tolist()))) == len(e["step"])
        most = int(np.bincount(e["step"]).max())
        assert most == expect, (model.name, model.uniform, most)


def test_trace_info_prints_bytes_per_token_by_context(tmp_path):
    from click.testing import CliRunner

    from kvemu.cli import cli

    p = _record(tmp_path, "gpt-oss-120b", "oss")
    res = CliRunner().invoke(cli, ["trace", "info", str(p)])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("KV bytes per token"))
    # 18 x 2048 + 18 x 2048 x min(L, 128) / L bytes per token: 41,472 B at 1k (40.5 KiB)
    assert gpt_oss(K1) / K1 == 41_472 and "40.5 KiB at 1k" in line
    assert "(18 sliding 128, 18 full)" in line
