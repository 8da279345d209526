"""Capacity curve (exact LRU stack distances), deployment capacity, break-even bandwidth."""

import json
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import SHARED_TRACES, make_workload, record
from kvemu.analysis import (_distinct_pairs, capacity_curve, capacity_ttft, deployment_capacity, input_block_stream,
                            prefix_hit_ratio_unbounded, prefix_hit_thresholds, prefix_hit_tokens_unbounded,
                            prefix_threshold_runs)
from kvemu.backends import stack_distances
from kvemu.cli import cli
from kvemu.schema import read_header, read_trace


def brute_force_distances(ids):
    stack, out = [], []
    for b in ids:
        if b in stack:
            i = stack.index(b)
            out.append(len(stack) - 1 - i)
            stack.pop(i)
        else:
            out.append(None)
        stack.append(b)
    return out


def test_stack_distances_match_brute_force():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 40, 2000)
    got = stack_distances(ids, 40)
    want = brute_force_distances(ids.tolist())
    never = np.iinfo(np.uint64).max
    assert [None if g == never else int(g) for g in got] == want


def _prompt_stream(rng, requests, docs=6):
    """A stream as prompts make one: each request a prefix of one of a few documents (runs of
    consecutive ids), then blocks of its own, now and then a stray repeat; its requests' offsets."""
    starts = rng.integers(0, 400, docs)
    lengths = rng.integers(5, 120, docs)
    parts, offsets, fresh = [], [0], 1000  # ids below 2000
    for _ in range(requests):
        d = rng.integers(docs)
        own = int(rng.integers(0, 8))
        blocks = [np.arange(starts[d], starts[d] + rng.integers(0, lengths[d] + 1)), np.arange(fresh, fresh + own)]
        if rng.random() < 0.1:
            blocks.append(rng.integers(0, 1200, 2))
        fresh += own
        parts.extend(blocks)
        offsets.append(offsets[-1] + sum(len(b) for b in blocks))
    return np.concatenate(parts).astype(np.int64), np.array(offsets, np.int64)


@pytest.mark.parametrize("form", ["runs", "scattered"])
def test_stack_distances_match_brute_force_on_prompt_streams(form):
    # cbackends/stackdist.c counts one distance per segment of repeated runs where segments are few
    # (the prompt stream: a few hundred segments for some thousands of references), a distance per
    # reference otherwise (the scattered stream: nearly a segment per reference)
    rng = np.random.default_rng(11)
    if form == "runs":
        ids, _ = _prompt_stream(rng, 80)
    else:
        ids = rng.integers(0, 300, 3000)
    got = stack_distances(ids, 2000)
    never = np.iinfo(np.uint64).max
    assert [None if g == never else int(g) for g in got] == brute_force_distances(ids.tolist())


def test_threshold_runs_match_running_maximum_of_brute_force_distances():
    from kvemu.analysis import THRESHOLD_BIG
    from kvemu.backends import prefix_threshold_runs
    from kvemu.errors import BackendError

    rng = np.random.default_rng(5)
    ids, offsets = _prompt_stream(rng, 60)
    # the stream as runs of consecutive ids, some empty, cut wherever ids are not consecutive
    cut = np.r_[0, np.flatnonzero(np.diff(ids) != 1) + 1, len(ids)]
    start = np.repeat(ids[cut[:-1]], 2)
    count = np.ravel(np.column_stack([np.diff(cut), np.zeros(len(cut) - 1, np.int64)]))
    values, end, request, unique = prefix_threshold_runs(start, count, 2000, offsets, THRESHOLD_BIG - 1)
    dist = brute_force_distances(ids.tolist())
    want = []
    for r in range(len(offsets) - 1):
        run = 0
        for i in range(offsets[r], offsets[r + 1]):
            run = max(run, THRESHOLD_BIG - 1 if dist[i] is None else dist[i])
            want.append((r, run))
    begin = np.r_[0, end[:-1]]
    got = [(int(q), int(v)) for q, v, b, e in zip(request, values, begin, end) for _ in range(b, e)]
    assert got == want
    assert unique == len(set(ids.tolist()))
    # each run is maximal: a new one at each request's first reference or a larger threshold
    assert all(q1 != q0 or v1 > v0 for q0, v0, q1, v1 in zip(request, values, request[1:], values[1:]))
    with pytest.raises(BackendError, match="offsets"):
        prefix_threshold_runs(start, count, 2000, offsets[:-1], THRESHOLD_BIG - 1)
    with pytest.raises(BackendError, match="outside"):
        prefix_threshold_runs(start, count, 500, offsets, THRESHOLD_BIG - 1)


def lru_prefix_hits(stream_by_request, capacity):
    """Reference LRU simulation with the prefix rule, request by request."""
    cache, hits = OrderedDict(), 0
    for blocks in stream_by_request:
        prefix = True
        for b in blocks:
            hit = b in cache
            prefix = prefix and hit
            hits += prefix
            cache[b] = None
            cache.move_to_end(b)
            while len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def test_capacity_curve_matches_lru_simulation_and_is_monotone(tmp_path):
    rng = np.random.default_rng(7)
    n = 40
    hashes, fresh = [], 1000
    for i in range(n):  # each request shares a prefix of an earlier one's chain, then continues
        base = hashes[rng.integers(0, i)][: rng.integers(0, 5)] if i else []
        hashes.append(base + list(range(fresh, fresh + int(rng.integers(1, 5)))))
        fresh += 10
    w = make_workload([0.0] + sorted(rng.uniform(0, 1000, n - 1).tolist()), [64 * len(h) for h in hashes],
                      [2] * n, hashes)
    tr = read_trace(record(w, tmp_path / "t.parquet"))
    caps = np.array([1, 2, 4, 8, 16, 32, 64, 128, 100000])
    curve = capacity_curve(tr, caps)
    tpb = tr.header.tokens_per_block
    per_req = [tr.table_ids[tr.table_offsets[i]:tr.table_offsets[i] + tr.input_tokens[i] // tpb].tolist()
               for i in range(n)]
    for cap, ratio in zip(caps, curve["hit_ratio"]):
        assert ratio == pytest.approx(lru_prefix_hits(per_req, cap) * tpb / tr.input_tokens.sum())
    assert np.all(np.diff(curve["hit_ratio"]) >= 0)
    assert curve["hit_ratio"][-1] == pytest.approx(prefix_hit_ratio_unbounded(tr))
    ttft = capacity_ttft(tr, curve, load_gbps=20)
    assert np.all(np.diff([r["mean_ttft_ms"] for r in ttft]) <= 1e-9)  # more capacity never slower


def test_mooncake_small_cache_reaches_well_under_half_of_unbounded(tmp_path):
    src = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    if not src.exists():
        pytest.skip(f"{src} not present")
    from kvemu.record_options import RecordOptions
    from kvemu.recording import record

    out = tmp_path / "mc.parquet"
    record(f"mooncake:{src}", "llama3-70b", out, RecordOptions.from_flat(tier_policy="none", show_progress=False))
    tr = read_trace(out)
    tokens = np.array([3_000_000, 50_000_000])  # 1 TB of DRAM for LLaMA3-70B; ~50M tokens (Mooncake)
    curve = capacity_curve(tr, tokens // 16)
    small, large = curve["hit_ratio"]
    unbounded = curve["unbounded_hit_ratio"]
    assert small < 0.5 * unbounded
    assert large > 0.95 * unbounded


# ----------------------------------------------------------------------------- break-even oracle
# Geometry from the models' config.json (meta-llama/Meta-Llama-3-70B, Meta-Llama-3-8B): hidden, layers,
# query heads, KV heads, head_dim, SwiGLU intermediate size, vocabulary (untied lm_head).
LLAMA3_70B = dict(d=8192, layers=80, heads=64, kv_heads=8, head_dim=128, inter=28672, vocab=128256)
LLAMA3_8B = dict(d=4096, layers=32, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256)
# Vendor datasheets, dense (half the printed 2:4-sparsity figure): TFLOP/s by compute dtype, HBM GB/s.
DATASHEET = {"A800-80GB": ({"bf16": 312.0}, 2039.0), "H800-SXM": ({"bf16": 989.0, "fp8": 1979.0}, 3350.0),
             "H100-SXM": ({"bf16": 989.0, "fp8": 1979.0}, 3350.0)}
TRACE_8B = str(Path(__file__).resolve().parents[1] / "traces" / "chat-llama3-8b-offload.parquet")


def hand_params(g):
    """Every weight of a Llama-3 model counted by hand: q and o (hidden x hidden), k and v (hidden x
    KV heads x head_dim), gate/up/down (3 x hidden x intermediate), two norms per layer, untied
    embedding and lm_head tables, the final norm."""
    d = g["d"]
    layer = 2 * d * g["heads"] * g["head_dim"] + 2 * d * g["kv_heads"] * g["head_dim"] + 3 * d * g["inter"] + 2 * d
    return g["layers"] * layer + 2 * g["vocab"] * d + d


# All-reduce bus bandwidth (nccl-tests' busbw, GB/s) inside one 8-GPU node and the latency of one
# collective: NVLink 4 ~370 GB/s (nccl-tests issue #212), A800 and H800 scaled to their 200 GB/s
# per direction (kvemu's gpus.py estimates), 10 us a call (SGLang PR #2904).
ALLREDUCE = {"A800-80GB": (139.0, 10e-6), "H800-SXM": (164.0, 10e-6), "H100-SXM": (370.0, 10e-6)}
# kvemu's fitted prefill factors, copied by hand (docs/engine.md, "Engine eras"; kvemu/engine/timing.py): era
# 2025, the default of record and of a trace-less breakeven, and era 2024, at which the traces under traces/ were
# recorded. mfu: achieved fraction of the peak; mbu: of HBM bandwidth; fp8: efficiency of FP8 steps relative to 16-bit.
ERA_2025_PREFILL = {"mfu": 0.857, "mbu": 0.599, "fp8_mfu_scale": 0.610}
ERA_2024_PREFILL = {"mfu": 0.763, "mbu": 0.327, "fp8_mfu_scale": 0.479}
DEFAULT_PREFILL_MBU = ERA_2025_PREFILL["mbu"]  # mfu is given per call
DEFAULT_FP8_MFU_SCALE = ERA_2025_PREFILL["fp8_mfu_scale"]


def hand_allreduce_s(g, prefix, gpu, tp):
    """Megatron-style tensor parallelism: two ring all-reduces per layer (attention and MLP output)
    of prefix x hidden 16-bit activations, 2 (tp - 1) / tp of them over the bus, plus the latency."""
    if tp == 1:
        return 0.0
    busbw, lat = ALLREDUCE[gpu]
    one = 2 * (tp - 1) / tp * prefix * g["d"] * 2 / (busbw * 1e9) + lat
    return 2 * g["layers"] * one


def hand_breakeven(g, prefix, gpu, gpus, mfu, weights="bf16", kv_value_bytes=2, mbu=DEFAULT_PREFILL_MBU,
                   fp8_scale=DEFAULT_FP8_MFU_SCALE):
    """(KV bytes, linear FLOPs, attention FLOPs, break-even GB/s) of recomputing ``prefix`` tokens on
    ``gpus`` tensor-parallel GPUs: 2 FLOPs per parameter per token, causal attention over prefix
    (prefix + 1) / 2 token pairs with QK^T and PV 2 x heads x head_dim FLOPs each per pair and layer,
    soft roofline sqrt(compute^2 + memory^2) against the HBM bytes (weights and the prefix's KV, split
    over the ranks) at mbu, FP8 compute at mfu x the FP8 scale, then the all-reduces."""
    kv = prefix * g["layers"] * 2 * g["kv_heads"] * g["head_dim"] * kv_value_bytes
    linear = 2 * hand_params(g) * prefix
    attention = g["layers"] * 2 * (2 * g["heads"] * g["head_dim"]) * prefix * (prefix + 1) / 2
    peaks, hbm = DATASHEET[gpu]
    fp8 = weights in peaks and weights == "fp8"
    compute_s = (linear + attention) / (gpus * peaks.get(weights, peaks["bf16"]) * 1e12 * mfu
                                        * (fp8_scale if fp8 else 1.0))
    memory_s = (hand_params(g) * (1 if weights == "fp8" else 2) + kv) / (gpus * hbm * 1e9 * mbu)
    both = (compute_s ** 2 + memory_s ** 2) ** 0.5
    return kv, linear, attention, kv / (both + hand_allreduce_s(g, prefix, gpu, gpus)) / 1e9


def breakeven_json(*args):
    res = CliRunner().invoke(cli, ["analyze", "breakeven", *args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def mooncake_eq2_gbps(peak_tflops, gpus=8, prefix=8192):
    """The Mooncake paper's Equation 2 with its Table 1 (LLaMA3-70B): B = G x 2ds / (gqa (a p d + b d^2)),
    l = 80, d = 8192, a = 4, b = 22, gqa = 8, s = 2 bytes, G the GPUs' peak."""
    d, a, b, gqa, s = 8192, 4, 22, 8, 2
    return gpus * peak_tflops * 1e12 * 2 * d * s / (gqa * (a * prefix * d + b * d * d)) / 1e9


@pytest.mark.parametrize("gpu,paper", [("A800-80GB", 6), ("H800-SXM", 19)])
def test_breakeven_on_8_a800_and_h800_matches_the_hand_oracle_and_mooncake_term_by_term(gpu, paper):
    """Mooncake (FAST'25, section 2.2): ~6 GB/s on 8 x A800, ~19 GB/s on 8 x H800 for an 8k prefix of
    LLaMA3-70B, at the GPUs' peak. kvemu at the same assumptions (mfu 1) agrees with the hand count
    and differs from the paper by its FLOP count alone: the KV bytes are the same."""
    out = breakeven_json("--model", "llama3-70b", "--gpu", gpu, "--gpus", "8", "--mfu", "1")
    assert out["model"] == "llama3-70b" and out["trace"] is None
    assert out["gpu"]["name"] == gpu and out["gpu"]["gpus"] == 8 and out["gpu"]["mfu"] == 1.0
    g, d = LLAMA3_70B, LLAMA3_70B["d"]
    for row in out["breakeven"]:
        kv, _, _, gbps = hand_breakeven(g, row["prefix_tokens"], gpu, 8, 1.0)
        assert row["kv_bytes"] == kv
        assert row["breakeven_gbps"] == pytest.approx(gbps, rel=1e-3)
    row = next(r for r in out["breakeven"] if r["prefix_tokens"] == 8192)
    # the paper's own figures follow from its Equation 2 at the datasheet peak (mfu 1)
    ours_paper = mooncake_eq2_gbps(DATASHEET[gpu][0]["bf16"])
    assert round(ours_paper) == paper
    # the KV bytes are the paper's: p x l x (2d / gqa) x s
    assert row["kv_bytes"] == 8192 * 80 * (2 * d // 8) * 2
    # so the whole difference is the FLOPs per token per layer: paper 22 d^2 + 4 p d = 26 d^2 at p = d
    kv, linear, attention, _ = hand_breakeven(g, 8192, gpu, 8, 1.0)
    per_layer = [linear / 8192 / 80 / d ** 2, attention / 8192 / 80 / d ** 2]
    assert per_layer == [pytest.approx(26.28, abs=0.01), pytest.approx(2.0, abs=0.001)]
    # compute alone: the paper's figure scaled by the FLOP counts; kvemu also counts the HBM term
    # (soft roofline) and the TP8 all-reduces, which the paper leaves out: recomputing takes longer,
    # reuse pays off sooner
    compute_s = (linear + attention) / (8 * DATASHEET[gpu][0]["bf16"] * 1e12)
    assert kv / compute_s / 1e9 == pytest.approx(ours_paper * 26 / sum(per_layer), rel=1e-3)
    memory_s = (hand_params(g) * 2 + kv) / (8 * DATASHEET[gpu][1] * 1e9 * DEFAULT_PREFILL_MBU)
    both = (compute_s ** 2 + memory_s ** 2) ** 0.5
    assert row["breakeven_gbps"] == pytest.approx(kv / (both + hand_allreduce_s(g, 8192, gpu, 8)) / 1e9, rel=1e-3)
    # docs/analysis.md states the figures this command prints
    doc = (Path(__file__).resolve().parents[1] / "docs" / "analysis.md").read_text()
    assert f"{row['breakeven_gbps']:.2f} GB/s" in doc and f"{ours_paper:.2f} GB/s" in doc
    assert f"{kv / compute_s / 1e9:.2f} GB/s" in doc


DEFAULT_PREFILL_MFU = ERA_2025_PREFILL["mfu"]


def test_breakeven_at_kvemu_defaults_without_a_trace():
    """The fitted prefill mfu of the default era (2025) by default; without --gpus the GPUs that hold the weights in half their
    HBM (4 A800s for 141 GB of bf16 weights), tensor parallel inside the node."""
    eight = breakeven_json("--model", "llama3-70b", "--gpu", "A800", "--gpus", "8")
    auto = breakeven_json("--model", "llama3-70b", "--gpu", "A800")
    assert eight["gpu"]["mfu"] == DEFAULT_PREFILL_MFU and auto["gpu"]["gpus"] == 4
    assert eight["gpu"]["tp"] == 8 and auto["gpu"]["tp"] == 4
    for r8, r4 in zip(eight["breakeven"], auto["breakeven"]):
        p = r8["prefix_tokens"]
        assert r8["breakeven_gbps"] == pytest.approx(
            hand_breakeven(LLAMA3_70B, p, "A800-80GB", 8, DEFAULT_PREFILL_MFU)[3], rel=1e-3)
        assert r4["breakeven_gbps"] == pytest.approx(
            hand_breakeven(LLAMA3_70B, p, "A800-80GB", 4, DEFAULT_PREFILL_MFU)[3], rel=1e-3)
    plain = breakeven_json("--model", "llama3-8b")  # record's defaults: one H100 holds 16 GB of weights
    assert plain["gpu"]["name"] == "H100-SXM" and plain["gpu"]["gpus"] == 1
    assert plain["breakeven"][0]["breakeven_gbps"] == pytest.approx(
        hand_breakeven(LLAMA3_8B, 1024, "H100-SXM", 1, DEFAULT_PREFILL_MFU)[3], rel=1e-3)
    text = CliRunner().invoke(cli, ["analyze", "breakeven", "--model", "llama3-70b", "--gpu", "H800", "--gpus", "8",
                                    "--mfu", "1"])
    assert text.exit_code == 0 and "on 8 x H800-SXM (tp 8; bf16 989 TFLOP/s each, mfu 1)" in text.output
    assert re.search(r"^\s*8,192\s.*\s6\.91$", text.output, re.M)
    # pipeline stages instead: no all-reduce, the stages one after the other
    pp = breakeven_json("--model", "llama3-70b", "--gpu", "H800", "--tp", "1", "--pp", "8", "--mfu", "1")
    assert (pp["gpu"]["tp"], pp["gpu"]["pp"]) == (1, 8)


def test_breakeven_options_take_the_place_of_what_the_trace_recorded():
    """The sample trace was recorded for llama3-8b on 1 x H100-SXM at engine era 2024's fitted factors
    (prefill mfu 0.763, mbu 0.327, FP8 scale 0.479); each option replaces its part and keeps the rest (the
    trace's mbu and FP8 scale too)."""
    as_recorded = breakeven_json(TRACE_8B)
    recorded = read_header(TRACE_8B).meta["gpu"]
    assert as_recorded["gpu"] == recorded and as_recorded["options"] == {}
    assert as_recorded["trace"] == TRACE_8B
    mfu0, mbu = recorded["mfu"], recorded["mbu"]
    assert (mfu0, mbu, recorded["fp8_mfu_scale"]) == tuple(ERA_2024_PREFILL.values())
    for args, g, gpu, gpus, mfu, weights, kv_bytes in [
        ([], LLAMA3_8B, "H100-SXM", 1, mfu0, "bf16", 2),
        (["--gpu", "A800", "--gpus", "8", "--mfu", "1"], LLAMA3_8B, "A800-80GB", 8, 1.0, "bf16", 2),
        (["--model", "llama3-70b"], LLAMA3_70B, "H100-SXM", 1, mfu0, "bf16", 2),
        (["--weight-dtype", "fp8"], LLAMA3_8B, "H100-SXM", 1, mfu0, "fp8", 2),  # FP8 tensor cores
        (["--gpu", "A800-80GB", "--weight-dtype", "fp8"], LLAMA3_8B, "A800-80GB", 1, mfu0, "fp8", 2),  # none
        (["--kv-dtype", "fp8"], LLAMA3_8B, "H100-SXM", 1, mfu0, "bf16", 1),
    ]:
        out = breakeven_json(TRACE_8B, *args)
        assert out["gpu"]["name"] == gpu and out["gpu"]["gpus"] == gpus, args
        for row in out["breakeven"]:
            kv, _, _, gbps = hand_breakeven(g, row["prefix_tokens"], gpu, gpus, mfu, weights, kv_bytes, mbu,
                                            ERA_2024_PREFILL["fp8_mfu_scale"])
            assert row["kv_bytes"] == kv, args
            assert row["breakeven_gbps"] == pytest.approx(gbps, rel=1e-3), args
    a800_fp8 = breakeven_json(TRACE_8B, "--gpu", "A800", "--weight-dtype", "fp8")
    assert a800_fp8["gpu"]["compute_dtype"] == "bf16" and a800_fp8["options"] == {"gpu": "A800",
                                                                                   "weight_dtype": "fp8"}


@pytest.mark.parametrize("args,message", [
    ([], "break-even needs a TRACE or --model"),
    (["--gpu", "A800"], "break-even needs a TRACE or --model"),
    (["--model", "llama3-70b", "--gpu", "X100"], "unknown GPU 'X100' (presets: A100-80GB, A800-80GB"),
    ([TRACE_8B, "--gpu", "A900"], "unknown GPU 'A900'"),
    (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--model", "llama3-70b", "--mfu", "0"], "--mfu must be >= 0.001 and <= 1, got 0"),
    (["--model", "llama3-70b", "--mfu", "nan"], "--mfu must be a finite number"),
    ([TRACE_8B, "--mfu", "1.5"], "--mfu must be >= 0.001 and <= 1, got 1.5"),
    (["--model", "llama3-70b", "--gpus", "0"], "--gpus must be from 1 to"),
    ([TRACE_8B, "--weight-dtype", "int4"], "unknown weight dtype 'int4'"),
    (["--model", "llama3-70b", "--kv-dtype", "int4"], "unknown KV dtype 'int4'"),
])
def test_breakeven_refusals_are_one_line(args, message):
    res = CliRunner().invoke(cli, ["analyze", "breakeven", *args])
    assert res.exit_code == 2 and message in res.output, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


def test_deployment_capacity_shared_vs_replicated(tmp_path, shared_prefix_workload):
    tr = read_trace(record(shared_prefix_workload, tmp_path / "t.parquet"))
    one = deployment_capacity(tr, 1)
    assert one["shared_blocks"] == one["replicated_blocks"] == len(np.unique(tr.table_ids))
    three = deployment_capacity(tr, 3)  # every request on its own instance: shared prefixes are copied
    assert three["replicated_blocks"] == len(tr.table_ids)
    assert three["shared_blocks"] < three["replicated_blocks"] and three["sharing_saves"] > 0


def test_breakeven_keeps_the_roofline_of_the_trace_it_prices():
    """A trace recorded with tensor parallelism but before the soft roofline and the FP8 scale (its
    gpu metadata without roofline_p and fp8_mfu_scale) is priced with the plain maximum and no FP8
    scale, also when --gpus re-splits it."""
    import copy

    from kvemu.analysis import breakeven_timing

    meta = copy.deepcopy(read_header(TRACE_8B).meta)
    for k in ("roofline_p", "fp8_mfu_scale"):
        meta["gpu"].pop(k, None)
    for options in ({}, {"gpus": 2}, {"gpu": "H200", "weight_dtype": "fp8"}):
        t = breakeven_timing(meta, **options)
        assert (t.roofline_p, t.fp8_mfu_scale) == (0.0, 1.0), options
    fresh = breakeven_timing(read_header(TRACE_8B).meta, gpus=2)
    assert fresh.roofline_p == read_header(TRACE_8B).meta["gpu"]["roofline_p"] and fresh.tp == 2


def test_prompt_block_stream_and_unbounded_hits_against_brute_force(tmp_path):
    # prompts that share prefixes, repeat a block within a request and end in partial blocks
    rng = np.random.default_rng(11)
    n, hashes, fresh = 30, [], 5000
    for i in range(n):
        base = hashes[rng.integers(0, i)][: rng.integers(0, 6)] if i else []
        own = list(range(fresh, fresh + int(rng.integers(1, 4))))
        hashes.append(base + own + own[:1])
        fresh += 10
    arrivals = [0.0] + sorted(rng.uniform(0, 1000, n - 1).tolist())
    w = make_workload(arrivals, [64 * len(h) - int(rng.integers(0, 40)) for h in hashes], [3] * n, hashes)
    tr = read_trace(record(w, tmp_path / "t.parquet"))
    tpb = tr.header.tokens_per_block
    per_req = [tr.table_ids[tr.table_offsets[i]:tr.table_offsets[i] + tr.input_tokens[i] // tpb].tolist()
               for i in range(n)]
    ids, req = input_block_stream(tr)
    assert ids.tolist() == [b for blocks in per_req for b in blocks]
    assert req.tolist() == [i for i, blocks in enumerate(per_req) for _ in blocks]
    seen, expect = set(), []
    for blocks in per_req:  # the leading blocks that some earlier request held
        k = 0
        while k < len(blocks) and blocks[k] in seen:
            k += 1
        expect.append(k * tpb)
        seen.update(blocks)
    assert 0 < sum(expect) < tr.input_tokens.sum()
    assert prefix_hit_tokens_unbounded(tr).tolist() == expect
    assert prefix_hit_tokens_unbounded(tr, (ids, req)).tolist() == expect
    m, _ = prefix_hit_thresholds(tr, (ids, req))
    assert np.array_equal(m, prefix_hit_thresholds(tr)[0])
    # from the thresholds (a request's first block never seen before is a first reference), the same
    runs = prefix_threshold_runs(tr)
    assert prefix_hit_tokens_unbounded(tr, thresholds=runs).tolist() == expect
    assert prefix_hit_tokens_unbounded(tr, thresholds=(m, req)).tolist() == expect
    assert np.array_equal(runs.expand(), m)
    for cap in (1, 3, 10, 1000):  # each request's hits at a capacity: its blocks with a threshold below it
        assert runs.hits_per_request(cap).tolist() == [int(np.count_nonzero(m[req == r] < cap)) for r in range(n)]


def test_distinct_pairs_against_a_dict():
    rng = np.random.default_rng(3)
    for a, b in ((rng.integers(0, 50, 500), rng.integers(0, 7, 500)), (np.array([2, -1, 2]), np.array([0, 5, 0]))):
        pairs, inverse = _distinct_pairs(a, b)
        expect = sorted(set(zip(a.tolist(), b.tolist())))
        assert list(zip(pairs[0].tolist(), pairs[1].tolist())) == expect
        assert [expect[k] for k in inverse.tolist()] == list(zip(a.tolist(), b.tolist()))
