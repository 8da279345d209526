"""The compute model behind its fence (engine/compute.py): the protocol, the registry, the blob a
trace records and the one mapper of the legacy fields, checked against hand-built oracles."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvemu.analysis import compute_from_meta, timing_from_meta
from kvemu.engine.aic import AicTiming
from kvemu.engine.compute import (COMPUTE_MODELS, ComputeModel, compute_blob, compute_from_blob, roofline_params,
                                  validate_blob)
from kvemu.engine.timing import FACTORS_2024, FACTORS_2025, GpuTiming, era_of, make_timing
from kvemu.errors import ConfigError
from kvemu.models import resolve_model
from kvemu.schema import read_header

ROOT = Path(__file__).resolve().parents[2]
TRACES = sorted((ROOT / "traces").glob("*.parquet")) + [ROOT / "tests/data/golden-trace-v1.parquet",
                                                        ROOT / "tests/data/golden-trace-v2.parquet"]


def test_registry_names_the_classes_that_implement_the_protocol():
    assert list(COMPUTE_MODELS) == ["roofline", "aiconfigurator"]
    assert COMPUTE_MODELS["roofline"] is GpuTiming and COMPUTE_MODELS["aiconfigurator"] is AicTiming
    timing = make_timing("H100-SXM", resolve_model("llama3-8b"), 1)
    assert isinstance(timing, ComputeModel)
    for cls in COMPUTE_MODELS.values():
        for attr in ("step_ns", "describe", "params", "validate", "from_params", "name", "model_version"):
            assert hasattr(cls, attr), (cls, attr)


@pytest.mark.parametrize("era,factors", [("2024", FACTORS_2024), ("2025", FACTORS_2025)])
def test_roofline_params_round_trip_to_the_same_step_times(era, factors):
    model = resolve_model("deepseek-v3")  # MoE + MLA: every era term counts
    timing = make_timing("H200", model, 8, "fp8", era=era)
    p = timing.params()
    # the era's fitted terms, the neutral ones left out as to_dict leaves them out
    for k, v in factors.items():
        if k in ("moe_layer_us", "moe_expert_us", "mla_layer_us") and v == 0.0:
            assert k not in p
        elif k == "moe_mfu_scale" and v == 1.0:
            assert k not in p
        else:
            assert p[k] == v, k
    base = replace(timing, mfu=0.11, mbu=0.22, overhead_us=7.0, moe_layer_us=0.0, mla_layer_us=0.0)
    again = GpuTiming.from_params(p, base)
    assert again == timing
    for comp in [(512, 512 * 256.5, 512, 0, 0, 1, 0), (64, 64 * 2000.0, 64 * 2000, 64, 64 * 2000, 0, 0)]:
        assert again.step_ns(*comp) == timing.step_ns(*comp)
    assert era in again.describe()


@pytest.mark.parametrize("params,names", [
    ({"mbu": 0.5, "overhead_us": 1.0}, "compute.params.mfu"),
    ({"mfu": 0.0, "mbu": 0.5, "overhead_us": 1.0}, "compute.params.mfu"),
    ({"mfu": 0.5, "mbu": 0.5, "overhead_us": -1.0}, "compute.params.overhead_us"),
    ({"mfu": 0.5, "mbu": 0.5, "overhead_us": 1.0, "roofline_p": 0.5}, "compute.params.roofline_p"),
    ({"mfu": 0.5, "mbu": 0.5, "overhead_us": 1.0, "mla_layer_us": "x"}, "compute.params.mla_layer_us"),
    ({"mfu": 0.5, "mbu": 0.5, "overhead_us": 1.0, "moe_mfu_scale": 2.0}, "compute.params.moe_mfu_scale"),
    ({"mfu": 0.5, "mbu": 0.5, "overhead_us": 1.0, "warp_us": 1.0}, "compute.params.warp_us"),
    ("not a mapping", "compute.params"),
])
def test_roofline_validate_names_the_bad_param_in_one_line(params, names):
    with pytest.raises(ConfigError) as e:
        GpuTiming.validate(params)
    assert str(e.value).startswith(names) and "\n" not in str(e.value)


def test_validate_blob_refuses_unknown_model_and_version():
    good = {"mfu": 0.5, "mbu": 0.5, "overhead_us": 1.0}
    assert validate_blob({"model": "roofline", "version": 1, "params": good}) is GpuTiming
    with pytest.raises(ConfigError, match="^compute.model: unknown compute model 'vidur'"):
        validate_blob({"model": "vidur", "version": 1, "params": good})
    with pytest.raises(ConfigError, match="^compute.version: roofline reads version 1, got 2"):
        validate_blob({"model": "roofline", "version": 2, "params": good})
    with pytest.raises(ConfigError, match="^compute.params.backend"):
        validate_blob({"model": "aiconfigurator", "version": 1,
                       "params": {"backend": "ollama", "database": None, "roofline": good}})


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_legacy_traces_map_into_one_blob_with_the_same_timing(path):
    """The shipped and golden traces carry the roofline's terms in ``gpu``: the blob holds exactly
    those, the model validates them, and the timing built from it is the one the fields say."""
    meta = read_header(path).meta
    g = meta["gpu"]
    blob = compute_blob(meta)
    assert blob["model"] == "roofline" and blob["version"] == 1
    want = {k: g[k] for k in ("mfu", "mbu", "overhead_us", "decode_mfu", "decode_mbu", "decode_overhead_us",
                              "fp8_mfu_scale", "roofline_p", "moe_layer_us", "moe_expert_us", "moe_mfu_scale",
                              "mla_layer_us") if k in g}
    assert blob["params"] == want
    validate_blob(blob)
    t = timing_from_meta(meta)
    assert (t.mfu, t.mbu, t.overhead_us) == (g["mfu"], g["mbu"], g["overhead_us"])
    assert t.roofline_p == g.get("roofline_p", 0.0) and t.fp8_mfu_scale == g.get("fp8_mfu_scale", 1.0)
    assert compute_from_meta(meta) is t or compute_from_meta(meta) == t
    if "tp" in g:  # a timing from after parallelism writes back the same parameters
        assert t.params() == want
        assert era_of(g) is None or era_of(g) in t.describe()


def test_a_new_blob_is_read_before_the_legacy_fields():
    meta = read_header(TRACES[0]).meta
    g = dict(meta["gpu"])
    new = {"mfu": 0.25, "mbu": 0.5, "overhead_us": 100.0, "decode_mfu": 0.25, "decode_mbu": 0.5,
           "decode_overhead_us": 100.0, "fp8_mfu_scale": 1.0, "roofline_p": 2.0}
    meta2 = {**meta, "gpu": g, "compute": {"model": "roofline", "version": 1, "params": new}}
    assert compute_blob(meta2)["params"] == new
    t = timing_from_meta(meta2)
    assert t.params() == new and t.mfu == 0.25
    # a roofline blob inside aiconfigurator's parameters is the roofline it falls back to
    assert roofline_params({"model": "aiconfigurator", "params": {"roofline": new}}) == new
    old = timing_from_meta(meta)
    assert compute_from_blob({"model": "roofline", "version": 1, "params": new}, old) == t


def test_legacy_aiconfigurator_summary_maps_to_its_params():
    meta = read_header(TRACES[0]).meta
    meta2 = {**meta, "compute": {"model": "aiconfigurator", "backend": "sglang", "version": "0.5.6", "steps": {}}}
    blob = compute_blob(meta2)
    assert blob["model"] == "aiconfigurator" and blob["params"]["backend"] == "sglang"
    assert blob["params"]["database"] == "0.5.6"
    assert blob["params"]["roofline"] == compute_blob(meta)["params"]
    validate_blob(blob)


def test_the_format_checks_the_blob_shape_and_the_model_its_params():
    """validation.py (below the engine) checks the blob's shape; the model named checks its
    parameters (analysis.check_compute_meta, on every rebuild of the timing), both in one line."""
    from kvemu.analysis import check_compute_meta
    from kvemu.errors import TraceError
    from kvemu.validation import check_timing_meta

    meta = read_header(TRACES[0]).meta
    ok = {"mfu": 0.5, "mbu": 0.5, "overhead_us": 1.0}
    bad = {**meta, "compute": {"model": "roofline", "version": 1, "params": {**ok, "mbu": 1.5}}}
    check_timing_meta(bad)  # the shape is right
    with pytest.raises(TraceError, match=r"^f.parquet: trace metadata compute.params.mbu must be"):
        check_compute_meta(bad, "f.parquet")
    with pytest.raises(TraceError, match=r"compute.params.mbu must be"):
        timing_from_meta(bad)
    for field, blob in (("compute.model", {"model": 3, "version": 1, "params": ok}),
                        ("compute.version", {"model": "roofline", "version": "1", "params": ok}),
                        ("compute.params", {"model": "roofline", "version": 1, "params": [1]})):
        with pytest.raises(TraceError, match=rf"^trace metadata {field} "):
            check_timing_meta({**meta, "compute": blob})
    check_compute_meta({**meta, "compute": {"model": "roofline", "version": 1, "params": ok}})
