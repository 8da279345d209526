"""Weights in the tier (kvemu record --weights-in-tier / --cold-experts, docs/weights-in-tier.md): HBM freed
for KV, the weight stream through the replay's data path, its composition with compute, the report's
TPOT cost. The oracles are hand-computed here: a flat virtual tier whose every 64 KiB block takes
exactly 4000 ns, a two-request workload whose batches do not depend on timing, and the roofline of
docs/engine.md written out for llama3-8b on one H100."""

import json
import math
from math import comb

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.engine.timing import make_timing
from kvemu.engine.weights import make_placement
from kvemu.errors import ConfigError
from kvemu.models import resolve_model
from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.replay import DataPathOptions, ReplayOptions, ScheduleOptions, replay
from kvemu.schema import iter_entries, read_trace

LAYERS = 32
BLOCK = 65536                    # llama3-8b: 16 tokens x 2 x 8 KV heads x 128 x 2 bytes, one layer
WEIGHTS = 8_030_000_000 * 2      # llama3-8b bf16 weight bytes
BW = 16.384                      # GB/s of the flat tier: a 64 KiB block in exactly 4000 ns
PCIE5 = 50.0                     # GB/s, the H100's host link (links.py pcie5-x16)

FLAT = """name = "flat"
kind = "memory"
latency_ns = 0
bandwidth_gbps = 16.384
concurrency = 1048576
overhead_ns = 0
sources = ["test: 16.384 GB/s, no latency"]
"""


def roofline_ns(tokens, pairs, touched):
    """docs/engine.md's step time for llama3-8b on one H100 SXM (mfu 0.5, mbu 0.7, 300 us)."""
    flops = 2.0 * 8.03e9 * tokens + 2.0 * 32 * 32 * 256 * pairs
    nbytes = 8.03e9 * 2 + 131072 * touched
    # the soft roofline: the 2-norm of the compute and HBM terms (docs/engine.md)
    return int(math.hypot(flops / (989e12 * 0.5), nbytes / (3350e9 * 0.7)) * 1e9 + 300e3)


# Two 100-token prompts at t = 0, five tokens each: step 0 prefills both, steps 1-4 decode both.
def decode_ns(k):
    """Decode step k (1..4): both requests attend to 100 + k tokens."""
    return roofline_ns(2, 2 * (100 + k), 2 * (100 + k))


PREFILL_NS = roofline_ns(200, 2 * 100 * 101 / 2, 200)


@pytest.fixture
def files(tmp_path):
    wl = tmp_path / "two.jsonl"
    wl.write_text("".join(json.dumps({"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [i]}) + "\n"
                          for i in (1, 2)))
    prof = tmp_path / "flat.toml"
    prof.write_text(FLAT)
    return tmp_path, f"mooncake:{wl}", f"vemu:{prof}"


def rec(tmp, workload, name, **kw):
    out = tmp / f"{name}.parquet"
    # the roofline above, with its factors given (the fitted defaults differ by phase)
    kw = {"mfu": 0.5, "mbu": 0.7, "step_overhead_us": 300.0, **kw}
    record(workload, "llama3-8b", out, RecordOptions.from_flat(tier_policy="none", show_progress=False, **kw))
    return out


def results(path):
    t = pq.read_table(path)
    return t.to_pydict(), json.loads(t.schema.metadata[b"kvemu"])


def weight_step_ns(fraction):
    """One step's weight loads on the flat tier: whole blocks of every layer at 4000 ns each."""
    blocks = math.ceil(fraction * WEIGHTS / LAYERS / BLOCK)
    return blocks * 4000 * LAYERS


def test_hbm_kv_grows_by_exactly_the_placed_bytes(files):
    tmp, wl, _ = files
    base = read_trace(rec(tmp, wl, "base")).header.meta
    half = read_trace(rec(tmp, wl, "half", weights_in_tier=0.5)).header.meta
    placed = WEIGHTS // 2
    assert half["weights"]["placed_bytes"] == placed
    assert half["gpu"]["hbm_kv_bytes"] - base["gpu"]["hbm_kv_bytes"] == placed
    block_all = BLOCK * LAYERS
    assert half["engine"]["hbm_kv_blocks"] == int(int(80e9 * 0.9 - WEIGHTS + placed) // block_all)
    timing = make_timing("H100-SXM", resolve_model("llama3-8b"))
    assert timing.hbm_kv_bytes() == base["gpu"]["hbm_kv_bytes"]


def test_recorded_steps_add_the_stream_over_the_host_link(files):
    tmp, wl, _ = files
    t = read_trace(rec(tmp, wl, "half", weights_in_tier=0.5))
    assert t.compute_ns.tolist() == [PREFILL_NS] + [decode_ns(k) for k in range(1, 5)]   # GPU compute only
    gaps = np.diff(t.start_ns)
    stream = WEIGHTS / 2 / PCIE5
    assert np.allclose(gaps, t.compute_ns[:-1] + stream, atol=1)
    o = read_trace(rec(tmp, wl, "ovl", weights_in_tier=0.5, weight_stream="overlap"))
    w = stream / LAYERS
    want = [max(w + c, LAYERS * w + c / LAYERS) for c in o.compute_ns[:-1]]
    assert np.allclose(np.diff(o.start_ns), want, atol=1)


@pytest.mark.parametrize("schedule", ["recorded", "closed"])
def test_serial_tpot_is_compute_plus_the_weight_stream(files, schedule):
    tmp, wl, flat = files
    out = tmp / f"r-{schedule}.parquet"
    replay(rec(tmp, wl, "half", weights_in_tier=0.5), flat, ReplayOptions(schedule=ScheduleOptions(schedule=schedule), datapath=DataPathOptions(link="cpu")), out=out)
    r, meta = results(out)
    w = weight_step_ns(0.5)
    tpot = (sum(decode_ns(k) for k in range(1, 5)) + 4 * w) / 4 / 1e6
    assert r["tpot_ms"] == pytest.approx([tpot, tpot], abs=1e-3)       # 1 us: batch shares are rounded
    assert r["ttft_ms"] == pytest.approx([(PREFILL_NS + w) / 1e6] * 2, abs=1e-3)
    rep = meta["weights"]["replay"]
    assert rep["bytes"] == 5 * math.ceil(0.5 * WEIGHTS / LAYERS / BLOCK) * BLOCK * LAYERS
    assert rep["time_ns"] == pytest.approx(5 * w, abs=5000)
    assert rep["gbps"] == pytest.approx(BW, rel=1e-5)
    assert rep["composition"] == "serial" and rep["figures"] == "virtual"
    assert meta["steps"]["kv_load_ns"] == 0                            # weight loads are counted apart
    assert meta["label"].endswith("+weights0.5")


def test_overlapped_stream_hides_compute_behind_the_loads(files):
    tmp, wl, flat = files
    out = tmp / "r.parquet"
    replay(rec(tmp, wl, "ovl", weights_in_tier=0.5, weight_stream="overlap"), flat, ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), datapath=DataPathOptions(link="cpu")), out=out)
    r, meta = results(out)
    w_layer = weight_step_ns(0.5) // LAYERS
    # layer l starts once its weights arrived (l x w); loads outlast compute, so the step ends one
    # layer's compute after the last layer's weights
    tpot = sum(LAYERS * w_layer + decode_ns(k) // LAYERS for k in range(1, 5)) / 4 / 1e6
    assert r["tpot_ms"] == pytest.approx([tpot, tpot], abs=1e-3)
    assert meta["weights"]["replay"]["composition"] == "overlap" and meta["params"]["overlap"]


def test_zero_fraction_records_what_no_option_does(files):
    tmp, wl, _ = files
    a, b = read_trace(rec(tmp, wl, "none")), read_trace(rec(tmp, wl, "zero", weights_in_tier=0.0))
    for k in ("arrival_ms", "cached_tokens", "start_ns", "compute_ns", "table_offsets", "table_ids"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    ea, eb = list(iter_entries(a)), list(iter_entries(b))
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(ea, eb) for k in x)
    ma, mb = dict(a.header.meta), dict(b.header.meta)
    for m in (ma, mb):
        m.pop("created")
        m.pop("integrity", None)
    assert ma == mb and "weights" not in mb


def test_cold_experts_stream_the_experts_a_step_routes_to():
    mixtral = resolve_model("mixtral-8x7b")
    p = make_placement(mixtral, "bf16", cold_experts=0.5)
    expert = 3 * 4096 * 14336 * 2
    assert p.placed_bytes == 4 * expert * 32
    # a token picks 2 of 8 experts: a given expert is missed with probability C(7,2)/C(8,2)
    miss = comb(7, 2) / comb(8, 2)
    for t in (1, 3, 64):
        assert p.step_bytes(t) == round(4 * (1 - miss ** t) * expert * 32)
    assert p.step_bytes(1) == expert * 32                   # one cold expert per layer, on average
    timing = make_timing("H100-SXM", mixtral)
    import dataclasses
    assert (dataclasses.replace(timing, tier_weight_bytes=p.placed_bytes).hbm_kv_bytes() - timing.hbm_kv_bytes()
            == p.placed_bytes)


@pytest.mark.parametrize("kw,msg", [
    ({"weights_in_tier": float("nan")}, "--weights-in-tier must be a finite number"),
    ({"weights_in_tier": 1.5}, "--weights-in-tier must be >= 0 and <= 1"),
    ({"weights_in_tier": -0.1}, "--weights-in-tier must be >= 0 and <= 1"),
    ({"cold_experts": 2.0}, "--cold-experts must be >= 0 and <= 1"),
    ({"weights_in_tier": 0.5, "cold_experts": 0.5}, "not both"),
])
def test_bad_placements_are_refused(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        make_placement(resolve_model("mixtral-8x7b"), "bf16", **kw)


def test_cold_experts_need_an_moe_preset(tmp_path):
    res = CliRunner().invoke(cli, ["record", "--workload", "synthetic:chat:sessions=1,turns=1", "--model",
                                   "llama3-8b", "--cold-experts", "0.5", "--out", str(tmp_path / "t.parquet")])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --cold-experts needs a mixture-of-experts preset")
    assert not (tmp_path / "t.parquet").exists()
    res = CliRunner().invoke(cli, ["record", "--workload", "synthetic:chat:sessions=1,turns=1", "--model",
                                   "llama3-8b", "--weights-in-tier", "nan", "--out", str(tmp_path / "t.parquet")])
    assert res.exit_code == 2 and res.output.strip() == "Error: --weights-in-tier must be a finite number, got nan"


def test_report_gives_the_tpot_cost_against_the_run_without_weights(files):
    from kvemu.report import build_report
    from kvemu.report.compare import report_records

    tmp, wl, flat = files
    base, half = tmp / "rb.parquet", tmp / "rh.parquet"
    replay(rec(tmp, wl, "base"), flat, ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), datapath=DataPathOptions(link="cpu")), out=base)
    replay(rec(tmp, wl, "half", weights_in_tier=0.5), flat, ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), datapath=DataPathOptions(link="cpu")), out=half)
    recs = {r["label"]: r for r in report_records(build_report([base, half]))}
    assert len(recs) == 2, list(recs)
    (wl_label,) = [k for k in recs if k.endswith("+weights0.5")]
    (base_label,) = [k for k in recs if k != wl_label]
    w = recs[wl_label]["weights"]
    tb, th = results(base)[0]["tpot_ms"], results(half)[0]["tpot_ms"]
    assert w["tpot_cost_ms"] == pytest.approx(np.mean(th) - np.mean(tb))
    assert w["tpot_cost_ms"] == pytest.approx(weight_step_ns(0.5) / 1e6, abs=1e-3)
    assert w["without_label"] == base_label and recs[base_label]["weights"]["placement"] is None
    from kvemu.report.text import render_csv
    rows = render_csv(build_report([base, half])).splitlines()
    assert len(rows) == 3 and "weights_tpot_cost_ms" in rows[0]
