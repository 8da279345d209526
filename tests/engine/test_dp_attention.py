"""Data-parallel attention (``record --dp-attention``): step times, KV capacity and plumbing, against
hand computations from the published configs and the GPU presets' datasheet figures."""

import json
import math

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.engine.timing import FACTORS_2025, make_timing
from kvemu.errors import ConfigError
from kvemu.models import resolve_model

# Llama-3-70B (config.json): 80 layers, hidden 8192, 64 query heads, 8 KV heads of 128 dims; 70.55 B weights
L70 = dict(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, params=70_550_000_000)
# its attention blocks by hand: q and o 8192 x 8192, k and v 8192 x 1024, per layer
L70_ATTN = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024)
# DeepSeek-V3 (config.json): per layer q_a 7168 x 1536, its norm, q_b 1536 x 128 x (128 + 64), kv_a 7168 x
# (512 + 64), its norm, kv_b 512 x 128 x (128 + 128), o 128 x 128 x 7168; 61 layers
DSV3_ATTN = 61 * (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168)


def test_attention_weights_from_the_configs():
    assert resolve_model("llama3-70b").attention_weight_params == L70_ATTN
    assert resolve_model("deepseek-v3").attention_weight_params == DSV3_ATTN


def hand_decode_ms(batch: int, context: int, *, dp: bool) -> float:
    """One decode step of ``batch`` requests at ``context`` cached tokens of Llama-3-70B on 8 x H100 in
    bf16, era 2025's decode factors, written out from the module's formulas."""
    peak, hbm, busbw, coll_us = 989.0, 3350.0, 370.0, 10.0  # H100-SXM preset: TFLOP/s, GB/s, GB/s, us
    f = FACTORS_2025
    tp, P, A = 8, L70["params"], L70_ATTN
    pairs = batch * (context + 1)  # each decode attends its context and itself
    attn_flops = 2 * 80 * 64 * (128 + 128) * pairs
    kv_bytes = 80 * 2 * 8 * 128 * 2 * batch * (context + 1)  # K and V, 8 heads of 128, bf16
    if dp:
        share = math.ceil(batch / tp) / batch  # the busiest rank's requests
        flops = 2 * (P - A) * batch / tp + share * (2 * A * batch + attn_flops)
        nbytes = (P - A) * 2 / tp + A * 2 + share * kv_bytes
        allreduces = 80  # the MLP's of every layer (attention's are gone)
    else:
        flops = (2 * P * batch + attn_flops) / tp
        nbytes = P * 2 / tp + kv_bytes / 8  # KV heads split over the 8 ranks
        allreduces = 160
    tc = flops / (peak * 1e12 * f["decode_mfu"])
    tm = nbytes / (hbm * 1e9 * f["decode_mbu"])
    act = batch * 8192 * 2
    comm = allreduces * (2 * (tp - 1) / tp * act / (busbw * 1e9) + coll_us * 1e-6)
    return (math.hypot(tc, tm) + comm + f["decode_overhead_us"] * 1e-6) * 1e3


@pytest.mark.parametrize("batch,context", [(16, 1000), (9, 4000), (256, 2000)])
@pytest.mark.parametrize("dp", [False, True])
def test_decode_step_against_hand_computation(batch, context, dp):
    t = make_timing("H100-SXM", resolve_model("llama3-70b"), tp=8, dp_attention=dp)
    got = t.step_ns(batch, batch * (context + 1.0), batch * (context + 1), batch) / 1e6
    assert got == pytest.approx(hand_decode_ms(batch, context, dp=dp), rel=1e-6)


def test_busiest_rank_sets_the_step():
    t = make_timing("H100-SXM", resolve_model("llama3-70b"), tp=8, dp_attention=True)
    step = lambda b: t.step_ns(b, b * 8001.0, b * 8001, b)  # noqa: E731
    # 9 requests put 2 on one rank: its KV and attention are those of 2 requests, as at 16
    assert step(9) > step(8)
    # one long prefill runs on one rank: slower than tensor-parallel attention, which splits it
    tp = make_timing("H100-SXM", resolve_model("llama3-70b"), tp=8)
    pre = lambda timing: timing.step_ns(8192, 8192 * 8193 / 2, 8192, 0, 0, 1)  # noqa: E731
    assert pre(t) > pre(tp)


def test_mla_decode_reads_a_rank_share_of_the_latent():
    """DeepSeek-V3 FP8 on 8 x B200, EP 8: at batch 256 and 8k contexts, tensor-parallel MLA reads the
    whole latent KV on every rank; data-parallel attention an eighth of it, at the price of the whole
    attention weights."""
    m = resolve_model("deepseek-v3", "fp8")
    tp = make_timing("B200", m, weight_dtype="fp8", tp=8, ep=8)
    dp = make_timing("B200", m, weight_dtype="fp8", tp=8, ep=8, dp_attention=True)
    b, c = 256, 8000
    kv = 61 * 576 * b * (c + 1)  # fp8 latent of every layer
    t_tp = tp.roofline_ns(b, b * (c + 1.0), b * (c + 1), b)[1]
    t_dp = dp.roofline_ns(b, b * (c + 1.0), b * (c + 1), b)[1]
    # the HBM terms differ by 7/8 of the KV less the 7/8 of the attention weights now read whole
    assert (t_tp - t_dp) * 8000.0 == pytest.approx(kv * 7 / 8 - DSV3_ATTN * 7 / 8, rel=1e-9)


def test_kv_capacity_and_links():
    m = resolve_model("deepseek-v3", "fp8")
    mem = 8 * 180e9 * 0.9  # 8 x B200, vLLM's gpu_memory_utilization
    tp = make_timing("B200", m, weight_dtype="fp8", tp=8, ep=8)
    dp = make_timing("B200", m, weight_dtype="fp8", tp=8, ep=8, dp_attention=True)
    # the latent replicated on the 8 ranks holds an eighth of the free bytes in distinct tokens
    assert tp.hbm_kv_bytes() == int(mem - 671e9) // 8
    # every rank holds the attention weights whole (7 more copies) and its own requests' KV
    assert dp.hbm_kv_bytes() == pytest.approx(mem - 671e9 - 7 * DSV3_ATTN, abs=2)
    # a request's blocks move over its rank's link alone
    assert (tp.kv_shards, tp.kv_links, dp.kv_shards, dp.kv_links) == (1, 1, 8, 1)


def test_refused_configurations():
    with pytest.raises(ConfigError, match="needs --tp 2 or more"):
        make_timing("H100-SXM", resolve_model("llama3-8b"), tp=1, dp_attention=True)
    from dataclasses import replace

    unknown = replace(resolve_model("deepseek-v3"), attention_params=0)
    with pytest.raises(ConfigError, match="attention weights are not known"):
        make_timing("B200", unknown, tp=8, dp_attention=True)


def _record(tmp_path, *extra):
    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(cli, ["record", "--workload", "synthetic:chat", "--model", "deepseek-v3", "--gpu", "B200",
                                 "--tp", "8", "--ep", "8", "--weight-dtype", "fp8", "--kv-dtype", "fp8",
                                 "--max-requests", "24", "--out", str(out), *extra])
    return r, out


def test_record_carries_it_and_trace_info_says_so(tmp_path):
    r, out = _record(tmp_path, "--dp-attention")
    assert r.exit_code == 0, r.output
    meta = json.loads(pq.read_schema(out).metadata[b"kvemu"])
    assert meta["gpu"]["dp_attention"] is True
    assert meta["gpu"]["kv_shards"] == 8 and meta["gpu"]["attention_bytes"] == DSV3_ATTN
    assert meta["model"]["attention_params"] == DSV3_ATTN
    info = CliRunner().invoke(cli, ["trace", "info", str(out)])
    assert info.exit_code == 0 and "DP attention" in info.output
    # its HBM prefix hits pool the ranks' caches: the line says it is an upper bound
    cached = next(ln for ln in info.output.splitlines() if ln.startswith("cached tokens"))
    assert "an upper bound" in cached
    # the recorded step times are the timing's own, rebuilt from the metadata
    from kvemu.analysis import timing_from_meta

    t = timing_from_meta(meta)
    assert t.dp_attention and t.hbm_kv_bytes() == meta["gpu"]["hbm_kv_bytes"]
    # and the same workload without it records other step times
    (tmp_path / "tp").mkdir()
    r2, out2 = _record(tmp_path / "tp")
    assert r2.exit_code == 0, r2.output

    def steps(path):
        t = pq.read_table(path, columns=["row_type", "compute_ns"]).to_pydict()
        return [ns for kind, ns in zip(t["row_type"], t["compute_ns"]) if kind == 1]

    assert steps(out) != steps(out2)
    info2 = CliRunner().invoke(cli, ["trace", "info", str(out2)])
    assert "DP attention" not in info2.output and "an upper bound" not in info2.output


def test_record_refuses_it_in_one_line(tmp_path):
    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(cli, ["record", "--workload", "synthetic:chat", "--model", "llama3-8b", "--tp", "1",
                                 "--dp-attention", "--out", str(out)])
    assert r.exit_code == 2 and "--dp-attention needs --tp 2 or more" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()


def test_breakeven_follows_it():
    """A prefix is recomputed as one prompt: on one rank with data-parallel attention, so slower,
    and loading it breaks even at a lower bandwidth."""
    def gbps(*extra):
        r = CliRunner().invoke(cli, ["analyze", "breakeven", "--model", "deepseek-v3", "--gpu", "B200", "--tp", "8",
                                     "--weight-dtype", "fp8", "--json", *extra])
        assert r.exit_code == 0, r.output
        rows = json.loads(r.output)["breakeven"]
        return {row["prefix_tokens"]: row["breakeven_gbps"] for row in rows}

    base, dp = gbps(), gbps("--dp-attention")
    long = max(base)
    assert dp[long] < base[long]


def test_sweep_grid_over_dp_attention(tmp_path):
    """A sweep spec's [[trace]] takes dp_attention like any record option; a list is a grid axis, and each
    value records as `record --dp-attention` would."""
    from kvemu.record_options import RecordOptions
    from kvemu.recording import record
    from kvemu.sweep import load_sweep

    spec = tmp_path / "s.toml"
    spec.write_text('[[trace]]\nworkload = "synthetic:chat"\nmodel = "deepseek-v3"\ngpu = "B200"\ntp = 8\nep = 8\n'
                    'weight_dtype = "fp8"\nmax_requests = 8\ndp_attention = [false, true]\n[backends]\nuse = ["vemu:nvme"]\n')
    sweep = load_sweep(spec)
    assert [t.name for t in sweep.traces] == ["chat-deepseek-v3-dp_attention=False", "chat-deepseek-v3-dp_attention=True"]
    metas = []
    for t in sweep.traces:
        r = dict(t.record)
        metas.append(record(r.pop("workload"), r.pop("model"), tmp_path / f"{t.name}.parquet",
                            RecordOptions.from_flat(show_progress=False, **r)))
    assert [m["gpu"].get("dp_attention", False) for m in metas] == [False, True]
    # the replicated latent against each rank's own: eight times the distinct KV, less the attention copies
    assert metas[1]["gpu"]["hbm_kv_bytes"] > 6 * metas[0]["gpu"]["hbm_kv_bytes"]


def test_a_trace_without_the_attention_weights_is_refused(tmp_path):
    """A trace's gpu.dp_attention needs the model's attention weights (every rank holds them): an MLA model's
    metadata without model.attention_params gives no usable compute model, in one line."""
    from kvemu.analysis import timing_from_meta
    from kvemu.errors import TraceError

    r, out = _record(tmp_path, "--dp-attention")
    assert r.exit_code == 0, r.output
    meta = json.loads(pq.read_schema(out).metadata[b"kvemu"])
    del meta["model"]["attention_params"]
    with pytest.raises(TraceError, match="attention weights are not known"):
        timing_from_meta(meta)
    meta["gpu"]["dp_attention"] = "yes"
    with pytest.raises(TraceError, match="dp_attention"):
        timing_from_meta(meta)


def test_a_prefill_chunk_runs_on_one_rank_whole():
    """A mixed step of one 8,192-token prompt and 200 decodes at 1,000 tokens (Llama-3-70B bf16, 8 x H100,
    data-parallel attention): the prompt's attention and its projections run on one rank, so that rank's
    work is the chunk's, not 26/201 of the step's (the even split by requests). By hand, era 2025's mixed factors."""
    from kvemu.engine.timing import FACTORS_2025 as F

    t = make_timing("H100-SXM", resolve_model("llama3-70b"), tp=8, dp_attention=True)
    n, d, c = 8192, 200, 1000
    pairs = n * (n + 1) / 2 + d * (c + 1)
    touched = n + d * (c + 1)
    got = t.step_ns(n + d, pairs, touched, d, d * c, 1, 0) / 1e6
    P, A = L70["params"], L70_ATTN
    per_pair = 2 * 80 * 64 * (128 + 128)
    share = 26 / 201
    rank_attn = max(share * (2 * A * (n + d) + per_pair * pairs), 2 * A * n + per_pair * n * (n + 1) / 2)
    rank_kv = max(share * touched, n) * 80 * 2 * 8 * 128 * 2
    assert rank_attn == 2 * A * n + per_pair * n * (n + 1) / 2  # the chunk's rank is the busiest
    f = d / (n + d)  # the step's share of decode tokens blends the two phases' factors
    mfu = 1 / ((1 - f) / F["mfu"] + f / F["decode_mfu"])
    mbu = 1 / ((1 - f) / F["mbu"] + f / F["decode_mbu"])
    overhead = (1 - f) * F["overhead_us"] + f * F["decode_overhead_us"]
    tc = (2 * (P - A) * (n + d) / 8 + rank_attn) / (989e12 * mfu)
    tm = ((P - A) * 2 / 8 + A * 2 + rank_kv) / (3350e9 * mbu)
    comm = 80 * (2 * 7 / 8 * (n + d) * 8192 * 2 / 370e9 + 10e-6)
    assert got == pytest.approx((math.hypot(tc, tm) + comm + overhead * 1e-6) * 1e3, rel=1e-6)
    # the even split alone would have charged a fraction of it
    even = t.step_ns(n + d, pairs, touched, d, d * c, 0, 0) / 1e6
    assert got > 1.5 * even


def test_weights_in_the_tier_are_refused_with_it(tmp_path):
    """Each rank would stream its own copy of the attention weights placed in the tier: not modelled, refused in
    one line before anything is written."""
    r, out = _record(tmp_path, "--dp-attention", "--weights-in-tier", "0.2")
    assert r.exit_code == 2 and "--weights-in-tier is not modelled with --dp-attention" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()


def test_the_report_says_a_dp_attention_traces_reuse_is_an_upper_bound(tmp_path):
    r, out = _record(tmp_path, "--dp-attention")
    assert r.exit_code == 0, r.output
    res = tmp_path / "r.parquet"
    rr = CliRunner().invoke(cli, ["replay", str(out), "--backend", "vemu:cxl-pool", "--out", str(res)])
    assert rr.exit_code == 0, rr.output
    rep = CliRunner().invoke(cli, ["report", str(res)])
    assert rep.exit_code == 0 and "models data-parallel attention with one prefix cache" in rep.output
