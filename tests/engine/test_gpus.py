"""GPU presets and compute dtypes of the timing model (issue 13, parts 2 and 3)."""
import numpy as np
import pytest

from kvemu.analysis import timing_from_meta
from kvemu.engine.gpus import GPU_ALIASES, GPU_PRESETS, get_gpu, gpu_names
from kvemu.engine.timing import make_timing
from kvemu.errors import ConfigError
from kvemu.links import LINKS
from kvemu.models import resolve_model

# dense tensor peaks, HBM and links per GPU, from the datasheets named in docs/engine.md
DATASHEET = {  # name: (bf16 TFLOP/s, fp8 TFLOP/s or 0, HBM GB, HBM GB/s, scale-up GB/s, host link GB/s)
    "A100-80GB": (312, 0, 80, 2039, 600, 64),
    "A800-80GB": (312, 0, 80, 2039, 400, 64),
    "H100-SXM": (989, 1979, 80, 3350, 900, 128),
    "H800-SXM": (989, 1979, 80, 3350, 400, 128),
    "H200": (989, 1979, 141, 4800, 900, 128),
    "B200": (2250, 4500, 180, 8000, 1800, 128),
    "GH200": (989, 1979, 96, 4000, 900, 900),
    "L40S": (362.05, 733, 48, 864, 64, 64),
    "MI300X": (1307.4, 2614.9, 192, 5300, 896, 128),
}


def test_presets_carry_the_datasheet_figures_and_a_source():
    assert set(GPU_PRESETS) == set(DATASHEET)
    for name, (bf16, fp8, mem, bw, scaleup, host) in DATASHEET.items():
        g = GPU_PRESETS[name]
        assert (g.peak_tflops, g.fp8_tflops, g.memory_gb, g.hbm_gbps, g.scaleup_gbps, g.host_link_gbps) == (
            bf16, fp8, mem, bw, scaleup, host), name
        assert g.sources and g.sources[0].split("http")[1].startswith("s://"), name
        assert g.link in LINKS, name


def test_gh200_reaches_the_host_over_c2c():
    g = get_gpu("GH200")
    assert g.host_link == "NVLink-C2C" and g.link == "nvlink-c2c"
    assert LINKS["nvlink-c2c"].load_gbps * 2 == g.host_link_gbps  # 450 GB/s each way


def test_aliases_name_the_sxm_parts():
    assert get_gpu("H800") is GPU_PRESETS["H800-SXM"] and get_gpu("A800") is GPU_PRESETS["A800-80GB"]
    assert get_gpu("H200-SXM") is GPU_PRESETS["H200"]
    assert set(GPU_ALIASES.values()) <= set(GPU_PRESETS) and gpu_names()[:len(GPU_PRESETS)] == list(GPU_PRESETS)
    with pytest.raises(ConfigError, match="unknown GPU 'V100'.*H800-SXM"):
        get_gpu("V100")
    t = make_timing("H800", resolve_model("llama3-8b"), 1)
    assert t.gpu.name == "H800-SXM" and t.to_dict()["name"] == "H800-SXM"


def prefill_compute_ns(t, n=8192):
    """The compute term of an n-token prefill from nothing, by the roofline written out here."""
    m = t.model
    attention = 2 * m.layers * m.attention_heads * (m.qk_head_dim + m.v_head_dim) * n * (n + 1) / 2
    flops = 2 * m.active_params * n + attention
    scale = t.fp8_mfu_scale if t.compute == "fp8" else 1.0  # FP8 steps' efficiency (docs/engine.md)
    return flops / (t.tp * t.peak_tflops * 1e12 * t.mfu * scale) * 1e9


def prefill_hbm_ns(t, n=8192):
    """The HBM term of the same prefill: the weights over the ranks and the n tokens' KV over its shards."""
    m = t.model
    return (t.weight_bytes / t.tp + m.kv_bytes_per_token * n / t.kv_shards) / (t.gpu.hbm_gbps * t.mbu)


@pytest.mark.parametrize("gpu,fp8_peak", [("H100-SXM", 1979), ("H800-SXM", 1979), ("B200", 4500),
                                          ("MI300X", 2614.9)])
def test_fp8_weights_compute_at_the_fp8_peak(gpu, fp8_peak):
    m = resolve_model("llama3-70b")
    bf, f8 = make_timing(gpu, m, 8), make_timing(gpu, m, 8, weight_dtype="fp8")
    assert (bf.compute, bf.peak_tflops) == ("bf16", GPU_PRESETS[gpu].peak_tflops)
    assert (f8.compute, f8.peak_tflops) == ("fp8", fp8_peak)
    n = 8192  # the soft roofline of the compute and HBM terms, plus the collectives and the overhead
    for t in (bf, f8):
        assert t.roofline_p == 2.0
        assert t.step_ns(n, n * (n + 1) / 2, n) == pytest.approx(
            float(np.hypot(prefill_compute_ns(t, n), prefill_hbm_ns(t, n))) + t.comm_ns(n) + t.overhead_us * 1e3,
            abs=2)
    assert f8.weight_bytes * 2 == bf.weight_bytes
    d = f8.to_dict()
    assert (d["compute_dtype"], d["compute_tflops"], d["weight_dtype"]) == ("fp8", fp8_peak, "fp8")


@pytest.mark.parametrize("gpu", ["A100-80GB", "A800-80GB"])
def test_ampere_has_no_fp8_and_computes_fp8_weights_in_bf16(gpu):
    m = resolve_model("llama3-70b")
    bf, f8 = make_timing(gpu, m, 8), make_timing(gpu, m, 8, weight_dtype="fp8")
    assert (f8.compute, f8.peak_tflops) == ("bf16", 312)
    n = 8192
    # compute-bound, and no FP8 scale (bf16 compute): within the soft roofline's small HBM share
    assert f8.fp8_mfu_scale < 1 and f8.compute == "bf16"
    a, b = f8.step_ns(n, n * (n + 1) / 2, n), bf.step_ns(n, n * (n + 1) / 2, n)
    assert b * 0.99 < a <= b
    # decode of one token is bound by the weights read: fp8 reads half
    assert f8.step_ns(1, 1, 1) < bf.step_ns(1, 1, 1)


def test_kv_dtype_is_separate_from_the_weight_dtype():
    m16, m8 = resolve_model("llama3-70b"), resolve_model("llama3-70b", "fp8")
    a, b = make_timing("H100-SXM", m16, 4), make_timing("H100-SXM", m8, 4)
    assert (a.compute, b.compute, a.weight_bytes) == ("bf16", "bf16", b.weight_bytes)
    assert m8.kv_bytes_per_token * 2 == m16.kv_bytes_per_token
    c = make_timing("H100-SXM", m16, 4, weight_dtype="fp8")
    assert c.model.kv_bytes_per_token == m16.kv_bytes_per_token and c.compute == "fp8"


def test_timing_round_trips_through_the_metadata():
    m = resolve_model("deepseek-v3")
    for gpu, wd in (("H800-SXM", "fp8"), ("A800-80GB", "fp8"), ("GH200", "bf16"), ("MI300X", "fp16")):
        t = make_timing(gpu, m, 16, weight_dtype=wd)
        back = timing_from_meta({"gpu": t.to_dict(), "model": m.to_dict(16)})
        assert back.gpu == t.gpu and (back.compute, back.peak_tflops) == (t.compute, t.peak_tflops)
        assert back.step_ns(4096, 4096 * 2048.5, 4096) == t.step_ns(4096, 4096 * 2048.5, 4096)


def test_traces_from_before_compute_dtypes_keep_their_timing():
    """A trace recorded before compute dtypes were modelled was timed at the bf16 peak, fp8 weights or
    not; rebuilt from its metadata it stays so (closed-loop replay reschedules by it)."""
    m = resolve_model("llama3-70b")
    t = make_timing("H100-SXM", m, 4, weight_dtype="fp8")
    old = {k: v for k, v in t.to_dict().items() if k in (
        "name", "peak_tflops", "hbm_gbps", "memory_gb", "gpus", "weight_dtype", "weight_bytes", "mfu", "mbu",
        "overhead_us", "memory_utilization", "hbm_kv_bytes")}
    back = timing_from_meta({"gpu": old, "model": m.to_dict(16)})
    assert (back.compute, back.peak_tflops) == ("bf16", 989.0)
    # an unknown GPU of an old trace: its recorded figures, no FP8
    back = timing_from_meta({"gpu": {**old, "name": "X1", "peak_tflops": 100.0}, "model": m.to_dict(16)})
    assert (back.gpu.peak_tflops, back.gpu.fp8_tflops, back.compute) == (100.0, 0.0, "bf16")


def test_record_names_the_compute_dtype(tmp_path):
    from click.testing import CliRunner

    from kvemu.cli import cli
    from kvemu.schema import read_header

    out = tmp_path / "t.parquet"
    res = CliRunner().invoke(cli, ["record", "--workload", "synthetic:chat:sessions=2,turns=2", "--model",
                                   "llama3-8b", "--gpu", "H800", "--weight-dtype", "fp8", "--kv-dtype", "fp16",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    h = read_header(out)
    g = h.meta["gpu"]
    assert (g["name"], g["compute_dtype"], g["compute_tflops"], g["scaleup_gbps"]) == ("H800-SXM", "fp8", 1979.0, 400.0)
    assert h.meta["model"]["kv_dtype"] == "fp16"
    res = CliRunner().invoke(cli, ["record", "--workload", "synthetic:chat", "--model", "llama3-8b", "--gpu",
                                   "V100", "--out", str(tmp_path / "u.parquet")])
    assert res.exit_code == 2 and "'V100' is not one of" in res.output
