"""The compute-model registry and the measured-kernel backend (kvemu/engine/compute.py, aic.py).

Oracles: the rounded composition and the inputs it maps to are worked out by hand here; the
roofline default against GpuTiming's formula on the step sums the trace's own entries give; the
fallback against a roofline recording of the same run. Tests that need aiconfigurator-core skip
with the reason where it is absent (pip install '.[aic]').
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.engine.aic import composition, q
from kvemu.engine.compute import ComputeSpec, make_compute, parse_compute
from kvemu.engine.timing import make_timing
from kvemu.errors import ConfigError, OptionError
from kvemu.models import resolve_model
from kvemu.record_options import GpuOptions, RecordOptions
from kvemu.recording import record
from kvemu.schema import iter_entries, read_trace

HAVE_AIC = importlib.util.find_spec("aiconfigurator_core") is not None
needs_aic = pytest.mark.skipif(not HAVE_AIC, reason="aiconfigurator-core not installed (pip install '.[aic]')")
WORKLOAD = "synthetic:chat"


def _opts(**flat):
    return RecordOptions.from_flat(max_requests=6, show_progress=False, **flat)


# ------------------------------------------------------------------------------------ parsing
def test_parse_compute():
    assert parse_compute("roofline") == ComputeSpec("roofline")
    assert parse_compute("aiconfigurator") == ComputeSpec("aiconfigurator")
    assert parse_compute("aiconfigurator:sglang") == ComputeSpec("aiconfigurator", "sglang")
    assert parse_compute("aiconfigurator:vllm@0.24.0") == ComputeSpec("aiconfigurator", "vllm", "0.24.0")
    assert str(ComputeSpec("aiconfigurator", "vllm", "0.24.0")) == "aiconfigurator:vllm@0.24.0"
    for bad in ("", "vidur", "aiconfigurator:", "aiconfigurator:vllm@"):
        with pytest.raises(ConfigError):
            parse_compute(bad)
    with pytest.raises(ConfigError, match="takes no backend"):
        make_compute("roofline:vllm", make_timing("H100-SXM", resolve_model("llama3-8b")), "llama3-8b")


def test_option_names_the_field_and_cli_the_flag(tmp_path):
    with pytest.raises(OptionError) as e:
        RecordOptions(gpu=GpuOptions(compute="vidur")).check()
    assert e.value.field == "gpu.compute"
    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(cli, ["record", "--workload", WORKLOAD, "--model", "llama3-8b", "--max-requests", "2",
                                 "--compute", "vidur", "--out", str(out)])
    assert r.exit_code == 2 and "--compute" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()


def test_without_the_extra_one_line_says_what_to_install(tmp_path, monkeypatch):
    # a None entry in sys.modules makes `import aiconfigurator_core` raise ImportError, as when absent
    monkeypatch.setitem(sys.modules, "aiconfigurator_core", None)
    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(cli, ["record", "--workload", WORKLOAD, "--model", "llama3-8b", "--max-requests", "2",
                                 "--compute", "aiconfigurator", "--out", str(out)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "pip install '.[aic]'" in lines[0], r.output
    assert not out.exists()


# ------------------------------------------------------------------------- the roofline default
def test_roofline_default_unchanged(tmp_path):
    """The default records the roofline's step times: each step's compute_ns is GpuTiming's formula
    on the sums of that step's entries (new tokens, attention pairs, KV touched, decodes), and the
    trace's compute metadata is the roofline's blob, its parameters and nothing else (issue 41)."""
    meta = record(WORKLOAD, "llama3-8b", tmp_path / "d.parquet", _opts())
    assert set(meta["compute"]) == {"model", "version", "params"} and meta["compute"]["model"] == "roofline"
    explicit = record(WORKLOAD, "llama3-8b", tmp_path / "e.parquet", _opts(compute="roofline"))
    t, e = read_trace(tmp_path / "d.parquet"), read_trace(tmp_path / "e.parquet")
    steps = t.compute_ns
    assert np.array_equal(steps, e.compute_ns) and explicit["engine"] == meta["engine"]
    timing = make_timing("H100-SXM", resolve_model("llama3-8b"))
    cols = ("step", "tokens", "context_tokens", "phase")
    ent = {k: np.concatenate([b[k] for b in iter_entries(t, cols)]) for k in cols}
    step = ent["step"]
    tok = ent["tokens"].astype(np.int64)
    ctx = ent["context_tokens"].astype(np.int64)
    dec = ent["phase"] == 1
    for s in np.unique(step)[:200]:
        m = step == s
        n, c = tok[m], ctx[m]
        want = timing.step_ns(int(n.sum()), float((n * (c + (n + 1) / 2)).sum()), int((c + n).sum()),
                              int(dec[m].sum()))
        assert steps[s] == want, s


# ------------------------------------------------------------------------------- the mapping
def test_rounding_by_hand():
    # below 64 exact; above, 6 significant bits, half up
    assert [q(x) for x in (0, 1, 33, 63, 64, 65, 127, 250, 500, 2051)] == [0, 1, 33, 63, 64, 66, 128, 252, 504, 2048]


def test_composition_by_hand():
    # two decodes at contexts 100 and 4000 (each attends its context + 1), two prefill chunks: 300 new
    # tokens on nothing cached, 200 new tokens on 1000 cached
    prefill, decode = composition(new_tokens=2 + 300 + 200, decode_tokens=2, decode_context_tokens=101 + 4001,
                                  prefill_chunks=2, prefill_prefix_tokens=0 + 1000)
    assert prefill == (2, 252, 504)  # 500 / 2 = 250 -> 252; 1000 / 2 = 500 -> 504
    assert decode == (2, 2048)  # 4102 / 2 = 2051 -> 2048
    assert composition(8, 8, 8 * 40, 0, 0) == (None, (8, 40))
    assert composition(512, 0, 0, 1, 0) == ((1, 512, 0), None)


@needs_aic
def test_a_composition_maps_to_these_inputs():
    """The step above is priced as aiconfigurator's mixed step of ctx_tokens 2 x (252 + 504) with isl
    756, prefix 504 and 2 decodes (its GEMMs and prefill attention), plus the decode attention of
    its decode step at isl 2046, osl 2 (2046 + 2 // 2 + 1 = 2048 tokens attended); the decode-only
    step is its decode step at the same inputs. Inputs written here by hand."""
    from aiconfigurator_core.sdk import config
    from aiconfigurator_core.sdk.rust_engine_step import estimate_decode_step_breakdown_with_rust
    from aiconfigurator_core.sdk.step_estimate import MixedStepInput

    timing = make_compute("aiconfigurator:vllm", make_timing("H100-SXM", resolve_model("llama3-8b")), "llama3-8b")
    assert timing.fallback is None, timing.fallback
    model, db, be = timing._engine
    mixed = be.run_mixed(model, db, config.RuntimeConfig(isl=756, osl=2, prefix=504),
                         MixedStepInput(context_tokens=1512, num_decode_requests=2))
    dec = estimate_decode_step_breakdown_with_rust(model, db, gen_tokens=2, isl=2046, osl=2)
    want_ms = (mixed.component_latency_ms["shared_non_attention"] + mixed.component_latency_ms["context_attention"]
               + dec[2]["generation_attention"])
    got = timing.step_ns(502, 0.0, 0, decode_tokens=2, decode_context_tokens=4102, prefill_chunks=2,
                         prefill_prefix_tokens=1000)
    assert got == int(round(want_ms * 1e6))
    assert timing.step_ns(2, 0.0, 0, 2, 4102) == int(round(dec[0] * 1e6))
    assert timing.steps == {"aiconfigurator": 2, "roofline": 0}


@needs_aic
def test_the_cache_does_not_change_results():
    """Step times asked in one order with one cache equal those asked each of a fresh model."""
    roof = make_timing("H100-SXM", resolve_model("llama3-8b"))
    comps = [(1, 0.0, 0, 1, 900), (8, 0.0, 0, 8, 8 * 1200), (1, 0.0, 0, 1, 903), (600, 0.0, 0, 88, 88 * 700, 1, 64),
             (8, 0.0, 0, 8, 8 * 1210)]
    shared = make_compute("aiconfigurator", roof, "llama3-8b")
    together = [shared.step_ns(*c) for c in comps]
    assert shared.step_hits >= 2  # 900/903 (-> 896) and 1200/1210 (-> 1216) attended tokens round alike
    alone = []
    for c in comps:
        fresh = make_compute("aiconfigurator", roof, "llama3-8b")
        alone.append(fresh.step_ns(*c))
    assert together == alone


def test_block_fp8_checkpoints(tmp_path):
    """DeepSeek-V3/R1's FP8 checkpoint is block-scaled (its config.json: quantization_config weight_block_size
    [128, 128]); Llama's FP8 presets are not; a config.json says which it is."""
    import json

    from kvemu.engine.aic import block_fp8

    assert block_fp8("deepseek-v3") and not block_fp8("llama3-70b")
    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    (tmp_path / "a.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8",
                                                                                 "weight_block_size": [128, 128]}}))
    (tmp_path / "b.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    (tmp_path / "c.json").write_text("not json")
    assert [block_fp8(str(tmp_path / n)) for n in ("a.json", "b.json", "c.json", "none.json")] == [
        True, False, False, False]


def _aic_deepseek(gpu, backend, kv, dp=False):
    t = make_timing(gpu, resolve_model("deepseek-v3", kv), weight_dtype="fp8", tp=8, ep=8 if dp else None,
                    dp_attention=dp)
    return make_compute(f"aiconfigurator:{backend}", t, "deepseek-v3", kv)


def _by_hand_model(system, backend, version, tp, adp, ep, kv):
    from aiconfigurator_core.sdk import common, config
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.perf_database import get_database

    mc = config.ModelConfig(tp_size=tp, pp_size=1, attention_dp_size=adp, gemm_quant_mode=common.GEMMQuantMode.fp8_block,
                            moe_quant_mode=common.MoEQuantMode.fp8_block, kvcache_quant_mode=getattr(common.KVCacheQuantMode, kv),
                            fmha_quant_mode=getattr(common.FMHAQuantMode, kv), moe_tp_size=(tp * adp) // ep, moe_ep_size=ep,
                            num_gpus_per_node=8, system=system)
    return get_model("deepseek-ai/DeepSeek-V3", mc, backend), get_database(system, backend, version)


@needs_aic
def test_deepseek_is_priced_with_block_fp8_kernels():
    """DeepSeek-V3 in FP8 on 8 x H200 is priced with aiconfigurator's block-scaled FP8 kernels: a decode step of 4
    requests attending 4,608 tokens each (a count the composition keeps exact) is its decode step at isl 4,606, osl
    2, with the inputs set here by hand."""
    from aiconfigurator_core.sdk.rust_engine_step import estimate_decode_step_breakdown_with_rust

    t = _aic_deepseek("H200", "sglang", "bf16")  # KV bf16, SGLang's default
    assert t.fallback is None and t.weight_quant == "fp8_block", t.fallback
    model, db = _by_hand_model("h200_sxm", "sglang", t.version, 8, 1, 1, "bfloat16")
    want = estimate_decode_step_breakdown_with_rust(model, db, gen_tokens=4, isl=4606, osl=2)[0]
    assert t.step_ns(4, 0.0, 0, 4, 4 * 4608) == int(round(want * 1e6))
    # several prompts of an MLA model in one step: its mixed step would take them for one sequence
    t.step_ns(4 * 7373, 0.0, 0, 0, 0, 4, 0)
    t.step_ns(7373, 0.0, 0, 0, 0, 1, 0)
    assert t.mla_multi_chunk_steps == 1 and t.steps == {"aiconfigurator": 2, "roofline": 1}
    assert t.compute_summary()["mla_multi_chunk_steps_roofline"] == 1


@needs_aic
def test_dp_attention_prices_one_rank_of_alike_ranks():
    """With --dp-attention, a decode step of 256 requests on 8 x B200 is aiconfigurator's decode step of one
    attention rank of attention_dp_size 8 (tp_size 1, experts over 8 ranks) at 32 requests; a step with a prefill
    chunk is the roofline's (the chunk runs on one rank)."""
    from aiconfigurator_core.sdk.rust_engine_step import estimate_decode_step_breakdown_with_rust

    t = _aic_deepseek("B200", "trtllm", "fp8", dp=True)
    assert t.fallback is None and t.dp_ranks == 8, t.fallback
    model, db = _by_hand_model("b200_sxm", "trtllm", t.version, 1, 8, 8, "fp8")
    want = estimate_decode_step_breakdown_with_rust(model, db, gen_tokens=32, isl=4606, osl=2)[0]
    assert t.step_ns(256, 0.0, 0, 256, 256 * 4608) == int(round(want * 1e6))
    roof = t.roofline.step_ns(1256, 1e6, 2e5, 256, 256 * 4608, 1, 0)
    assert t.step_ns(1256, 1e6, 2e5, 256, 256 * 4608, 1, 0) == roof
    assert t.steps == {"aiconfigurator": 1, "roofline": 1} and t.compute_summary()["dp_prefill_steps_roofline"] == 1


# ------------------------------------------------------------------------------- fallback, meta
@needs_aic
@pytest.mark.parametrize("gpu,model,why", [("MI300X", "llama3-8b", "no database for MI300X"),
                                           ("H100-SXM", "qwen2.5-72b", "no config for model qwen2.5-72b")])
def test_fallback_says_why_and_is_the_roofline(tmp_path, gpu, model, why):
    flat = dict(gpu=gpu, hbm_kv_gib=8.0)
    r = CliRunner().invoke(cli, ["record", "--workload", WORKLOAD, "--model", model, "--max-requests", "6",
                                 "--gpu", gpu, "--hbm-kv-gib", "8", "--compute", "aiconfigurator",
                                 "--out", str(tmp_path / "a.parquet")])
    assert r.exit_code == 0, r.output
    warned = [ln for ln in r.output.splitlines() if ln.startswith("warning:")]
    assert len(warned) == 1 and why in warned[0] and "roofline" in warned[0], r.output
    roof = record(WORKLOAD, model, tmp_path / "r.parquet", _opts(**flat))
    a, rt = read_trace(tmp_path / "a.parquet"), read_trace(tmp_path / "r.parquet")
    assert np.array_equal(a.compute_ns, rt.compute_ns)
    meta = record(WORKLOAD, model, tmp_path / "b.parquet", _opts(compute="aiconfigurator", **flat))
    c = meta["compute"]
    assert why in c["fallback"]
    assert c["steps"] == {"aiconfigurator": 0, "roofline": roof["engine"]["steps"]}


@needs_aic
def test_recording_counts_steps_and_records_its_source(tmp_path):
    meta = record(WORKLOAD, "llama3-8b", tmp_path / "a.parquet", _opts(compute="aiconfigurator:vllm"))
    c = meta["compute"]
    assert c["fallback"] is None and c["backend"] == "vllm" and c["system"] == "h100_sxm"
    # the compute blob (engine/compute.py): its database version among its parameters, over the roofline's
    assert c["model"] == "aiconfigurator" and c["version"] == 1 and c["params"]["database"]
    assert c["params"]["backend"] == "vllm" and c["params"]["roofline"]["mfu"] > 0 and "mfu" not in meta["gpu"]
    assert c["steps"]["aiconfigurator"] + c["steps"]["roofline"] == meta["engine"]["steps"]
    assert c["steps"]["aiconfigurator"] > 0 and c["cache_hits"] > 0
    assert c["compositions"] < meta["engine"]["steps"]
    # the shipped database carries no kernel power for H100 vLLM: energy absent, not zero
    assert (c["energy_j"] is None) == c["energy"].startswith("absent") or c["energy_j"] > 0
    steps = read_trace(tmp_path / "a.parquet").compute_ns
    assert (steps > 0).all()
    line = next(x for x in CliRunner().invoke(cli, ["trace", "info", str(tmp_path / "a.parquet")]).output.splitlines()
                if x.startswith("GPU step times"))
    assert (f"modelled: aiconfigurator vllm {c['version']} on h100_sxm priced {c['steps']['aiconfigurator']:,} steps; "
            f"the fitted roofline at engine era 2025's factors priced the other {c['steps']['roofline']:,}") in line
    # a replay's results keep the trace's compute record, so its report says what priced the compute
    res = CliRunner().invoke(cli, ["replay", str(tmp_path / "a.parquet"), "--backend", "vemu:cxl-pool",
                                   "--out", str(tmp_path / "r.parquet")])
    assert res.exit_code == 0, res.output
    from kvemu.report import build_report

    run = build_report([str(tmp_path / "r.parquet")]).rows[0].run
    assert run.meta["trace"]["compute"] == c
    rep = " ".join(CliRunner().invoke(cli, ["report", str(tmp_path / "r.parquet")]).output.split())
    assert f"in every kind of run, by aiconfigurator vllm {c['version']} on h100_sxm priced" in rep
    assert dataclasses.asdict(GpuOptions())["compute"] == "roofline"


@needs_aic
def test_closed_loop_schedules_again_with_aiconfigurator(tmp_path):
    """The engine inputs of closed-loop replay rebuild the recorded compute model, and the engine
    run again on them (nothing in the tier: policy none) gives the recorded step times exactly."""
    from kvemu.engine.scheduler import simulate
    from kvemu.replay.closed.inputs import engine_inputs

    out = tmp_path / "a.parquet"
    record(WORKLOAD, "llama3-8b", out, _opts(compute="aiconfigurator", tier_policy="none"))
    t = read_trace(out)
    inp = engine_inputs(t)
    assert inp.timing.compute_summary()["model"] == "aiconfigurator"
    again = simulate(inp.tables, t.arrival_ms, inp.input_tokens, inp.output_tokens, inp.timing, inp.cfg)
    assert np.array_equal(again.step_compute_ns, t.compute_ns)
    assert inp.timing.steps["roofline"] == 0
