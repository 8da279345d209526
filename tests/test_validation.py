"""One semantic validation of traces and results (issue 26, items 3 and 4).

Every file here carries valid checksums: it is written by kvemu's own writer (schema.write_trace,
integrity.write_results) from a recorded trace's rows and metadata with one thing changed, as a
file from elsewhere would be. Each case of the issue's "Trace metadata trusted without bounds" is
refused by `trace validate`, `trace info`, `replay` and `trace upgrade` with one line naming the
metadata field; a results file with a negative TTFT is refused by `report`; a property-based test
crafts metadata and entries and checks that a file either fails validation with one KvemuError or
goes through every command without any other exception. Provenance: a trace replaced at its path
during a replay leaves the results with the hash of what was replayed."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.cli import cli
from kvemu.errors import KvemuError
from kvemu.integrity import write_results
from kvemu.schema import ENTRY_COLUMNS, METADATA_KEY, iter_entries, list_column, read_trace, write_trace

BACKEND = "vemu:cxl-pool"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_refused(res, *words):
    """Exit 2, one `Error:` line holding every word, no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert isinstance(res.exception, SystemExit), res.exception
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small closed-loop trace (4 requests of a chat workload on llama3-8b, a tenth of its weights
    in the tier: every metadata section there is) and its parts."""
    from kvemu.record_options import RecordOptions
    from kvemu.recording import record

    path = tmp_path_factory.mktemp("small") / "t.parquet"
    record("synthetic:chat:sessions=2,turns=2,output_tokens=6,system_tokens=64,user_tokens=40", "llama3-8b", path,
           RecordOptions.from_flat(hbm_kv_gib=0.5, weights_in_tier=0.1, show_progress=False))
    return path, parts(path)


def parts(path):
    """(meta, requests, steps, entries) of a trace, as write_trace takes them."""
    tr = read_trace(path)
    meta = {k: v for k, v in tr.header.meta.items() if k not in ("format", "version", "creator")}
    requests = {"request_id": tr.request_id.astype(np.int32), "arrival_ms": tr.arrival_ms,
                "input_tokens": tr.input_tokens.astype(np.int32), "output_tokens": tr.output_tokens.astype(np.int32),
                "cached_tokens": tr.cached_tokens.astype(np.int32),
                "tier_hit_tokens": tr.tier_hit_tokens.astype(np.int32),
                "block_start": list_column(tr.run_offsets, tr.run_start),
                "block_count": list_column(tr.run_offsets, tr.run_count.astype(np.int32))}
    steps = {"step": tr.step.astype(np.int32), "start_ns": tr.start_ns, "compute_ns": tr.compute_ns}
    batches = list(iter_entries(tr))
    entries = {k: np.concatenate([b[k] for b in batches]) for k in ENTRY_COLUMNS}
    tr.header.close()
    return meta, requests, steps, entries


def crafted(tmp_path, small, name="x.parquet", meta=None, entries=None, steps=None):
    """The small trace with its metadata, entries or steps replaced, written with valid checksums."""
    _, (m, r, s, e) = small
    out = tmp_path / name
    write_trace(out, m if meta is None else meta, r, s if steps is None else steps, e if entries is None else entries,
                force=True, strict_json=False)  # NaN metadata is written on purpose: the reader is tested
    return out


def with_field(meta: dict, dotted: str, value) -> dict:
    meta = json.loads(json.dumps(meta))
    *path, key = dotted.split(".")
    at = meta
    for part in path:
        at = at[part]
    at[key] = value
    return meta


# ------------------------------------------------------------------------ the issue's cases
#: Each case of the issue: the field, the value, and what the refusal says about it.
ISSUE_CASES = [
    ("gpu.mfu", 1e-300, "must be >= 0.001"),          # was OverflowError
    ("gpu.peak_tflops", float("nan"), "must be a finite number"),  # was ValueError
    ("gpu.hbm_gbps", 0, "must be > 0"),               # was ZeroDivisionError
    ("gpu.fp8_mfu_scale", 0, "must be >= 0.001"),     # was ZeroDivisionError
    ("gpu.weight_dtype", "fp4", "must be one of bf16, fp16, fp8"),  # was KeyError
    ("gpu.mfu", -1, "must be >= 0.001"),              # silently wrong
    ("gpu.tp", 10**9, "must be >= 0 and <= 1048576"),
    ("gpu.peak_tflops", float("inf"), "must be a finite number"),
    ("gpu.roofline_p", -5, "must be >= 0"),
    ("model.params", -1, "must be >= 1"),
]


@pytest.mark.parametrize("field,value,says", ISSUE_CASES, ids=[f"{f}={v}" for f, v, _ in ISSUE_CASES])
def test_each_metadata_case_of_the_issue_is_refused_naming_the_field(small, tmp_path, field, value, says):
    bad = crafted(tmp_path, small, meta=with_field(small[1][0], field, value))
    for args in (("trace", "validate", bad), ("trace", "info", bad),
                 ("replay", bad, "--backend", BACKEND, "--out", tmp_path / "r.parquet"),
                 ("analyze", "breakeven", bad)):
        res = run(*args)
        assert_refused(res, str(bad), f"trace metadata {field}", says)
    assert not (tmp_path / "r.parquet").exists()


#: Other fields kvemu computes with, each with a value validation refuses and what it says.
MORE_CASES = [
    ("engine.tier_policy", "write-back", "must be one of none, offload, resident"),
    ("engine.max_num_seqs", 0, "must be >= 1"),
    ("engine.max_num_batched_tokens", 8, "must be >= 256"),   # below max_num_seqs: a decode each
    ("engine.kv_layout", "diagonal", "must be one of per-layer, cross-layer"),
    ("engine.tier_eviction", "mru", "names no eviction policy, got 'mru' (known: lru, fifo, s3fifo)"),
    ("engine.tier_eviction", "fifo", "fifo has no effect without tier_capacity_blocks"),  # the trace's is unbounded
    ("engine.transfer_chunk_tokens", 20, "must be a multiple of the 16 tokens per block"),
    ("gpu.compute_dtype", "int4", "must be one of bf16, fp16, fp8"),
    ("gpu.memory_utilization", 1.5, "must be > 0 and <= 1"),
    ("gpu.decode_mbu", 0, "must be >= 0.001"),
    ("gpu.overhead_us", 1e7, "must be >= 0 and <= 1e+06"),
    ("gpu.roofline_p", 0.5, "must be 0 (the plain maximum) or from 1 to 8"),
    ("gpu.gpus", 2, "differs from gpu.tp x gpu.pp = 1"),
    ("gpu.kv_links", True, "must be a whole number"),
    ("model.kv_dtype", "fp4", "must be one of bf16, fp16, fp8"),
    ("model.active_params", 10**13, "must be >= 1 and <= 8.03e+09"),  # more than the params
    ("model.kv_heads", 64, "must be >= 0 and <= 32"),
    ("workload.time_scale", 0, "must be a positive number"),
    ("workload.source", 7, "must be a string"),
    ("load.queue_share", 2, "must be >= 0 and <= 1"),
    ("load.overloaded", "yes", "must be true or false"),
    ("weights.stream", "sideways", "must be one of serial, overlap"),
    ("weights.link_gbps", 0, "must be > 0"),
    ("weights.layers", 0, "must be >= 1 and <= 32"),
]


@pytest.mark.parametrize("field,value,says", MORE_CASES, ids=[f"{f}={v}" for f, v, _ in MORE_CASES])
def test_every_metadata_field_kvemu_computes_with_is_checked(small, tmp_path, field, value, says):
    bad = crafted(tmp_path, small, meta=with_field(small[1][0], field, value))
    assert_refused(run("trace", "validate", bad), str(bad), f"trace metadata {field}", says)


#: gpu.* fields that name a choice, and fields that are free text: their crafted wrong values.
GPU_CHOICES = {"weight_dtype": "fp4", "compute_dtype": "int4"}
GPU_TEXT = {"name", "scaleup", "host_link", "link"}


def test_every_gpu_field_a_trace_carries_is_checked(small, tmp_path):
    """Each gpu.* key record writes, crafted (NaN for a number, a number for text, an unknown name for
    a choice) with valid checksums: trace validate refuses it naming that field, in one line."""
    gpu = small[1][0]["gpu"]
    params = small[1][0]["compute"]["params"]
    # the roofline's own terms are its compute blob's, validated by the model (engine/compute.py)
    assert {"peak_tflops", "hbm_gbps", "tp"} <= set(gpu) and not {"mfu", "roofline_p", "fp8_mfu_scale"} & set(gpu)
    assert {"mfu", "roofline_p", "fp8_mfu_scale"} <= set(params)
    for key in sorted(params):
        bad = crafted(tmp_path, small, name=f"compute-{key}.parquet",
                      meta=with_field(small[1][0], f"compute.params.{key}", float("nan")))
        assert_refused(run("trace", "validate", bad), str(bad), f"trace metadata compute.params.{key}")
    for key in ("mfu", "fp8_mfu_scale"):
        bad = crafted(tmp_path, small, name=f"big-{key}.parquet",
                      meta=with_field(small[1][0], f"compute.params.{key}", params[key] * 1e9 * 2**40))
        assert_refused(run("trace", "validate", bad), str(bad), f"trace metadata compute.params.{key}")
    for key, good in sorted(gpu.items()):
        bad_value = GPU_CHOICES.get(key, 7 if key in GPU_TEXT else float("nan"))
        assert isinstance(good, str) == (key in GPU_TEXT or key in GPU_CHOICES), key
        bad = crafted(tmp_path, small, name=f"gpu-{key}.parquet", meta=with_field(small[1][0], f"gpu.{key}", bad_value))
        assert_refused(run("trace", "validate", bad), str(bad), f"trace metadata gpu.{key}")
    # and beyond range where the field is a figure: a billion-fold the recorded value
    for key in ("peak_tflops", "memory_utilization", "tp", "kv_links"):
        bad = crafted(tmp_path, small, name=f"big-{key}.parquet",
                      meta=with_field(small[1][0], f"gpu.{key}", (gpu[key] or 1) * 1e9 * 2**40))
        assert_refused(run("trace", "validate", bad), str(bad), f"trace metadata gpu.{key}")


@pytest.mark.parametrize("field,value", [("gpu.peak_tflops", 1e-300), ("gpu.hbm_gbps", 1e-300),
                                         ("weights.link_gbps", 1e-300)])
def test_figures_in_range_that_make_a_step_last_for_ever_are_one_line(small, tmp_path, field, value):
    """Found by the property test: a figure that is positive and finite but makes a modelled step
    take longer than a day (here 10^300 times longer than on the recorded GPU) is refused where
    the step is modelled, in one line, not an OverflowError."""
    bad = crafted(tmp_path, small, meta=with_field(small[1][0], field, value))
    assert run("trace", "validate", bad).exit_code == 0
    out = tmp_path / "r.parquet"
    refused = []
    for args in (("replay", bad, "--backend", BACKEND, "--out", out), ("analyze", "capacity", bad),
                 ("analyze", "breakeven", bad)):  # breakeven rebuilds the GPU from its preset: it runs
        res = run(*args)
        if res.exit_code != 0:
            assert_refused(res, "the modelled GPU time of one step is", "more than a day")
            refused.append(args[:2])
    if field.startswith("gpu."):  # the recorded GPU's figures model every step of the closed loop
        assert ("replay", bad) in refused and ("analyze", "capacity") in refused and not out.exists()


def test_a_metadata_value_that_is_in_range_but_contradicts_the_model_is_refused(small, tmp_path):
    # tp 3 does not divide llama3-8b's 32 heads (record refuses it the same way)
    meta = with_field(small[1][0], "gpu.tp", 3)
    assert_refused(run("trace", "validate", crafted(tmp_path, small, meta=meta)), "gpu.tp", "does not divide")
    meta = with_field(small[1][0], "engine.tokens_per_block", 32)
    assert_refused(run("trace", "validate", crafted(tmp_path, small, meta=meta)), "engine.tokens_per_block")
    meta = with_field(small[1][0], "model.kv_dtype_bytes", 4)
    meta["model"]["kv_bytes_per_token_layer"] *= 2  # the geometry still adds up: only the dtype is wrong
    meta["model"]["block_bytes_per_layer"] *= 2
    assert_refused(run("trace", "validate", crafted(tmp_path, small, meta=meta)), "model.kv_dtype_bytes")


def test_trace_upgrade_refuses_a_v1_trace_with_bad_metadata(small, tmp_path):
    """A v1 trace is validated as v2 metadata before it is rewritten with fresh checksums."""
    meta = with_field(small[1][0], "gpu.hbm_gbps", 0)
    meta.pop("schedule")
    v1 = tmp_path / "v1.parquet"
    m, r, s, e = small[1]
    write_trace(v1, {**meta, "version": 1}, r, s, e)
    res = run("trace", "upgrade", v1, "--out", tmp_path / "v2.parquet")
    assert_refused(res, "trace metadata gpu.hbm_gbps")
    assert not (tmp_path / "v2.parquet").exists()
    # the same file with a good value upgrades
    meta["gpu"]["hbm_gbps"] = 3350.0
    write_trace(v1, {**meta, "version": 1}, r, s, e, force=True)
    assert run("trace", "upgrade", v1, "--out", tmp_path / "v2.parquet").exit_code == 0


# ----------------------------------------------------------------------------- entries
def test_every_other_entry_removed_is_refused(small, tmp_path):
    e = small[1][3]
    keep = np.arange(len(e["step"])) % 2 == 0
    bad = crafted(tmp_path, small, entries={k: v[keep] for k, v in e.items()})
    assert_refused(run("trace", "validate", bad), str(bad), "request")


def test_a_missing_last_decode_is_refused_at_the_end(small, tmp_path):
    """Removing a request's last entry leaves every entry consistent: only the end can tell."""
    e = small[1][3]
    last = int(np.flatnonzero(e["request_id"] == 0)[-1])
    keep = np.arange(len(e["step"])) != last
    bad = crafted(tmp_path, small, entries={k: v[keep] for k, v in e.items()})
    res = run("trace", "validate", bad)
    # request 0 has 6 output tokens: input + 5 tokens to compute from its cached tokens, one short
    assert_refused(res, "request 0's entries cover", "input")


@pytest.mark.parametrize("change,says", [
    ("context", "context_tokens"),        # a chunk that does not start where the last one ended
    ("decode_tokens", "decode entry of 2 tokens"),
    ("phase", "a prefill entry after its decode entries"),
])
def test_inconsistent_context_and_phases_are_refused(small, tmp_path, change, says):
    e = {k: v.copy() for k, v in small[1][3].items()}
    rows = np.flatnonzero(e["request_id"] == 1)
    decodes = rows[e["phase"][rows] == 1]
    if change == "context":
        e["context_tokens"][decodes[1]] += 1
    elif change == "decode_tokens":
        e["tokens"][decodes[-1]] = 2
    else:
        e["phase"][decodes[-1]] = 0
    assert_refused(run("trace", "validate", crafted(tmp_path, small, entries=e)), "request 1", says)


def test_step_times_that_saturate_the_clock_are_refused(small, tmp_path):
    s = dict(small[1][2])
    s["compute_ns"] = np.full(len(s["compute_ns"]), 1 << 62, np.int64)
    s["start_ns"] = np.zeros(len(s["start_ns"]), np.int64)
    bad = crafted(tmp_path, small, steps=s)
    assert_refused(run("trace", "validate", bad), "timeline", "2^60 ns")
    assert_refused(run("replay", bad, "--backend", BACKEND, "--schedule", "recorded", "--out", tmp_path / "r.parquet"),
                   "timeline")


def test_the_engines_clock_guard_stops_a_closed_loop_whose_steps_pass_2_to_the_60(small):
    """A trace that passes check_timeline (its recorded steps fit) can still be replayed closed-loop
    on a tier that makes each step last for ever: the engine's clock guard refuses it at the first
    step whose end passes 2^60 ns. Each step is told it ended 0.3 x 2^60 ns after it started, so by
    hand the ends are 0.3, 0.6, 0.9, 1.2 x 2^60 (+ the first start): the guard fires after step 3,
    at the 4th end, before a 5th step is planned."""
    from kvemu.engine.scheduler import EngineLog, StepOutcome, engine_steps
    from kvemu.errors import ConfigError
    from kvemu.replay.closed import engine_inputs
    from kvemu.validation import MAX_TIMELINE_NS

    tr = read_trace(small[0])
    i = engine_inputs(tr)
    tr.header.close()
    gen = engine_steps(i.tables, i.arrival_ns, i.input_tokens, i.output_tokens, i.timing, i.cfg,
                       EngineLog(len(i.input_tokens)))
    slow = int(0.3 * MAX_TIMELINE_NS)
    plan, planned = next(gen), 1
    start0 = plan.start_ns
    with pytest.raises(ConfigError, match=r"clock passed 2\^60 ns .* at step 3"):
        while True:
            plan = gen.send(StepOutcome(plan.start_ns + slow))
            planned += 1
            assert plan.start_ns <= MAX_TIMELINE_NS
    assert planned == 4 and start0 + 3 * slow <= MAX_TIMELINE_NS < start0 + 4 * slow


# ----------------------------------------------------------------------------- results
def test_a_results_file_with_a_negated_ttft_is_refused(small, tmp_path):
    trace = small[0]
    good = tmp_path / "r.parquet"
    assert run("replay", trace, "--backend", BACKEND, "--out", good).exit_code == 0
    t = pq.read_table(good)
    raw = t.schema.metadata[METADATA_KEY]
    for column, value in (("ttft_ms", lambda a: -a), ("kv_bytes_read", lambda a: a - 2**40),
                          ("e2el_ms", lambda a: a * np.inf)):
        col = t[column].to_numpy()
        bad_table = t.set_column(t.schema.get_field_index(column), column, pa.array(value(col)).cast(t.schema.field(column).type))
        bad = tmp_path / f"bad-{column}.parquet"
        write_results(bad, bad_table.replace_schema_metadata({METADATA_KEY: raw}), {METADATA_KEY: raw})
        assert_refused(run("report", bad), str(bad), f"column '{column}' must hold finite values >= 0")
    assert run("report", good).exit_code == 0


def test_a_results_file_whose_trace_section_has_a_bad_gpu_model_reports_without_break_even(small, tmp_path):
    """The report rebuilds the GPU compute model from the results' own trace section (no trace file
    is read): a value validation refuses in a trace leaves the break-even out, with why."""
    good = tmp_path / "r.parquet"
    assert run("replay", small[0], "--backend", BACKEND, "--out", good).exit_code == 0
    t = pq.read_table(good)
    meta = json.loads(t.schema.metadata[METADATA_KEY])
    meta["trace"]["compute"]["params"]["mfu"] = 1e-300  # was OverflowError in the break-even section
    raw = json.dumps(meta).encode()
    bad = tmp_path / "bad.parquet"
    write_results(bad, t.replace_schema_metadata({METADATA_KEY: raw}), {METADATA_KEY: raw})
    res = run("report", bad)
    assert res.exit_code == 0, (res.output, res.exception)
    assert "trace metadata compute.params.mfu must be >= 0.001" in res.output


# --------------------------------------------------------------------------- provenance
def test_a_trace_replaced_during_a_replay_gives_the_hash_of_what_was_replayed(small, tmp_path):
    import kvemu

    trace = tmp_path / "t.parquet"
    shutil.copy(small[0], trace)
    replayed = hashlib.sha256(trace.read_bytes()).hexdigest()
    other = crafted(tmp_path, small, name="other.parquet",
                    meta={**small[1][0], "workload": {**small[1][0]["workload"], "source": "elsewhere"}})
    other_sha = hashlib.sha256(other.read_bytes()).hexdigest()
    assert other_sha != replayed
    calls = []

    def progress(done, total):
        if not calls:  # the first progress report: the replay has read the trace and is running
            os.replace(other, trace)
        calls.append(done)

    # the recorded schedule reports progress after every C call (the closed loop every 512 steps)
    opts = kvemu.ReplayOptions().but(schedule__schedule="recorded")
    res = kvemu.replay(str(trace), BACKEND, opts, out=tmp_path / "r.parquet", progress=progress)
    assert calls, "the replay reported no progress: the file was never replaced"
    assert hashlib.sha256(trace.read_bytes()).hexdigest() == other_sha  # the path now holds the other file
    assert res.meta["trace"]["sha256"] == replayed
    assert res.meta["trace"]["size_bytes"] == small[0].stat().st_size
    # the report finds the trace at the recorded path changed: no capacity section from the replacement
    rep = run("report", tmp_path / "r.parquet", "--json")
    assert rep.exit_code == 0, rep.output
    (record,) = json.loads(rep.stdout)["traces"].values()
    assert record["capacity"] is None and "has changed since the replay" in record["capacity_note"]


def test_every_repetition_replays_the_file_opened_first(small, tmp_path):
    """--repeat: the trace is opened once for every repetition; one replaced after the first has
    begun (by a trace whose steps take twice as long) changes no repetition's figures."""
    import kvemu

    trace = tmp_path / "t.parquet"
    shutil.copy(small[0], trace)
    replayed = hashlib.sha256(trace.read_bytes()).hexdigest()
    s = dict(small[1][2])
    s["compute_ns"] = s["compute_ns"] * 2
    other = crafted(tmp_path, small, name="other.parquet", steps=s)
    calls = []

    def progress(done, total):
        if not calls:
            os.replace(other, trace)
        calls.append(done)

    opts = kvemu.ReplayOptions().but(schedule__schedule="recorded", output__repeat=2)
    res = kvemu.replay(str(trace), BACKEND, opts, out=tmp_path / "r.parquet", progress=progress)
    assert calls and res.meta["trace"]["sha256"] == replayed
    first, second = res.meta["repetitions"]["runs"]
    # virtual time is deterministic: the same trace gives the same figures
    assert first["median_ttft_ms"] == second["median_ttft_ms"], (first, second)


# ------------------------------------------------------------------------ property-based
#: Metadata fields the property test changes: every number, enum and text kvemu computes with or
#: prints, in the sections validation checks.
FIELDS = [f"gpu.{k}" for k in (
    "peak_tflops", "hbm_gbps", "memory_gb", "fp8_tflops", "allreduce_busbw_gbps", "scaleout_busbw_gbps",
    "collective_us", "scaleout_us", "node_gpus", "gpus", "weight_dtype", "compute_dtype", "mfu", "mbu",
    "overhead_us", "decode_mfu", "decode_mbu", "decode_overhead_us", "memory_utilization", "fp8_mfu_scale",
    "roofline_p", "tier_weight_bytes", "tp", "pp", "ep", "kv_links", "name")] + [f"engine.{k}" for k in (
        "tokens_per_block", "max_num_batched_tokens", "max_num_seqs", "tier_policy", "hbm_kv_blocks",
        "tier_capacity_blocks", "tier_eviction", "transfer_chunk_tokens", "kv_layout", "steps", "makespan_ns")] + [
    f"model.{k}" for k in ("hidden_size", "attention_heads", "kv_heads", "head_dim", "qk_head_dim", "v_head_dim",
                           "params", "active_params", "moe_layers", "experts", "experts_per_token", "kv_dtype",
                           "name")] + [
    f"load.{k}" for k in ("arrival_span_s", "makespan_s", "busy_s", "utilisation", "makespan_over_span",
                          "queue_p50_s", "queue_share", "overloaded", "suggest_time_scale", "gpus")] + [
    f"weights.{k}" for k in ("placement", "fraction", "placed_bytes", "layers", "stream", "link_gbps")] + [
    "workload.hash_block_tokens", "workload.time_scale", "workload.source", "schedule.engine_model"]

#: A change relative to the recorded value (kept in range more often than a value drawn blind).
RELATIVE = st.tuples(st.just("relative"), st.sampled_from([0.5, 0.9, 1.1, 2.0, 4.0, 0.0, -1.0]))

VALUES = st.one_of(*[RELATIVE] * 8,
    st.integers(min_value=-3, max_value=300), st.sampled_from([0, 1, 2, 8, 10**9, 2**31, 2**62, -(2**40)]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 1e-300, 1e300, 2.0]),
    st.sampled_from(["fp4", "bf16", "fp8", "none", "resident", "per-layer", "", "x"]), st.none(), st.booleans(),
    st.just([1]), st.just({"a": 1}))

ENTRY_CHANGES = st.just([]) | st.just([]) | st.lists(st.tuples(st.sampled_from(["tokens", "context_tokens", "phase", "drop", "store_count"]),
                                   st.integers(0, 10**6), st.integers(-2, 2)), max_size=2)


PASSED: list[bool] = []


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(changes=st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), min_size=1, max_size=2), rows=ENTRY_CHANGES)
def test_a_file_passes_validation_and_runs_everywhere_or_fails_with_one_kvemu_error(small, tmp_path, changes, rows):
    meta = json.loads(json.dumps(small[1][0]))
    for dotted, value in changes:
        section, key = dotted.split(".")
        old = meta.setdefault(section, {}).get(key)
        if isinstance(value, tuple):  # relative to the recorded value: scaled numbers, the same text
            if isinstance(old, bool) or not isinstance(old, (int, float)):
                continue
            value = type(old)(old * value[1]) if math.isfinite(old * value[1]) else old
        meta[section][key] = value
    e = {k: v.copy() for k, v in small[1][3].items()}
    for column, at, delta in rows:
        i = at % len(e["step"])
        if column == "drop":
            e = {k: np.delete(v, i) for k, v in e.items()}
        else:
            e[column][i] = max(e[column][i] + delta, 0)
    folder = Path(tempfile.mkdtemp(dir=tmp_path))  # hypothesis runs an example again while it shrinks
    path = folder / "t.parquet"
    _, (_, r, s, _) = small
    write_trace(path, meta, r, s, e)
    try:
        from kvemu.schema import check_entries

        tr = read_trace(path)
        check_entries(tr)
        tr.header.close()
    except KvemuError:
        PASSED.append(False)
        return  # refused: one KvemuError, the CLI's one line
    PASSED.append(True)
    for args in (("trace", "info", path), ("trace", "info", path, "--json"), ("analyze", "capacity", path),
                 ("analyze", "capacity", path, "--stack", "local-dram=1GiB,cxl-pool=0:fifo"),
                 ("analyze", "breakeven", path),
                 ("replay", path, "--backend", BACKEND, "--out", folder / "closed.parquet"),
                 ("replay", path, "--backend", BACKEND, "--schedule", "recorded", "--out", folder / "rec.parquet")):
        res = run(*args)
        assert res.exit_code in (0, 2), (args, res.exit_code, res.output)
        assert isinstance(res.exception, (SystemExit, type(None))), (args, repr(res.exception))
    for out in ("closed.parquet", "rec.parquet"):
        if (folder / out).exists():
            for extra in (("--trace", path), ("--html", folder / f"{out}.html")):
                res = run("report", folder / out, *extra)
                assert res.exit_code in (0, 2) and isinstance(res.exception, (SystemExit, type(None))), \
                    (out, extra, res.output, repr(res.exception))


def test_the_property_test_reaches_files_that_pass():
    """Some crafted files must pass validation, or the property test proves nothing (it runs first)."""
    if not PASSED:
        pytest.skip("the property test did not run")
    assert sum(PASSED) >= 3, PASSED


@pytest.mark.parametrize("option,field", [("max_num_seqs", "engine.max_num_seqs"),
                                          ("max_batched_tokens", "engine.max_num_batched_tokens")])
def test_record_and_validation_bound_the_engine_counts_alike(small, tmp_path, option, field):
    """record refuses one past the bound (record_options), and a trace carrying it is refused by
    validation naming the field: the same figure, 2^31 - 1, in both."""
    from kvemu.errors import OptionError
    from kvemu.record_options import RecordOptions

    hi = 2**31 - 1  # int32, by hand
    with pytest.raises(OptionError, match="from 1 to 2147483647"):
        RecordOptions.from_flat(**{option: hi + 1}).check()
    bad = crafted(tmp_path, small, meta=with_field(small[1][0], field, hi + 1))
    assert_refused(run("trace", "validate", bad), f"trace metadata {field}", "<= 2147483647")


def test_a_trace_chunk_past_record_s_bound_is_refused(small, tmp_path):
    """transfer_chunk_tokens is bounded as record's --chunk-tokens: 65536 blocks of 16 tokens."""
    ok = crafted(tmp_path, small, "ok.parquet", meta=with_field(small[1][0], "engine.transfer_chunk_tokens", 16 * 65536))
    assert run("trace", "validate", ok).exit_code == 0
    bad = crafted(tmp_path, small, meta=with_field(small[1][0], "engine.transfer_chunk_tokens", 16 * 65537))
    assert_refused(run("trace", "validate", bad), "engine.transfer_chunk_tokens")


def test_a_windowed_model_s_replay_warns_only_where_it_moves_full_blocks(small, tmp_path):
    """gemma-3-27b has sliding-window layers (models.py kv_groups): replay moves each group's own
    blocks per layer (docs/replay.md, "KV groups"), so it gives no KV-bytes warning, except with the
    cross-layer layout, whose copies move a full-attention block of every layer: then it says so,
    once; a full-attention trace (llama3-8b, no kv_groups) gets no such warning either way."""
    from kvemu.record_options import RecordOptions
    from kvemu.recording import record
    from kvemu.replay import DataPathOptions, ReplayOptions, WindowOptions
    from kvemu.replay.run import replay

    gemma = tmp_path / "g.parquet"
    record("synthetic:chat:sessions=1,turns=2,output_tokens=4,system_tokens=64,user_tokens=40", "gemma-3-27b", gemma,
           RecordOptions.from_flat(show_progress=False))
    seen = []
    replay(gemma, BACKEND, ReplayOptions(window=WindowOptions(layers=2)), out=tmp_path / "g-r.parquet",
           warn=seen.append)
    assert not [w for w in seen if "KV bytes" in w or "upper bound" in w], seen
    cross = ReplayOptions(datapath=DataPathOptions(layout="cross-layer"))
    seen = []
    got = replay(gemma, BACKEND, cross, out=tmp_path / "g-x.parquet", warn=seen.append)
    full = [w for w in seen if w.startswith("KV bytes are full attention's")]
    assert len(full) == 1 and "sliding" in full[0], seen
    assert full[0] in got["warnings"]  # in the results file too
    seen = []
    replay(small[0], BACKEND, cross, out=tmp_path / "l-r.parquet", warn=seen.append)
    assert not [w for w in seen if "KV bytes" in w], seen


def test_entry_checks_in_c_give_the_python_checks_verdict():
    """Every entry check runs first in one C pass (cbackends/entries.c) that only says whether a batch
    passes, the requests' state left as it was where it does not; the Python checks then word the
    error. Against those checks alone (the C pass off), batches with a value changed here and there:
    the same verdict and message every time, and most of them are refused."""
    from kvemu.errors import TraceError
    from kvemu.schema import _EntryCheck

    tr = read_trace(Path(__file__).resolve().parents[1] / "traces" / "chat-llama3-8b-offload.parquet")
    batches = list(iter_entries(tr, batch_rows=300))
    assert len(batches) > 3

    def verdict(bs, c_pass: bool) -> str:
        check = _EntryCheck(tr)
        if not c_pass:
            check._batch_ok = lambda e: None
        try:
            for e in bs:
                check(e)
            check.accounting.finish()
            return "ok"
        except TraceError as exc:
            return str(exc)

    assert verdict(batches, True) == verdict(batches, False) == "ok"
    rng = np.random.default_rng(4)
    refused = 0
    for _ in range(120):
        bs = [{k: v.copy() for k, v in e.items()} for e in batches]
        for _ in range(int(rng.integers(1, 3))):
            b = bs[int(rng.integers(len(bs)))]
            col = ENTRY_COLUMNS[int(rng.integers(len(ENTRY_COLUMNS)))]
            i = int(rng.integers(len(b[col])))
            v = int(b[col][i])
            b[col][i] = [v + 1, v - 1, 0, -1, int(np.iinfo(b[col].dtype).max)][int(rng.integers(5))]
        got, want = verdict(bs, True), verdict(bs, False)
        assert got == want
        refused += want != "ok"
    assert refused > 60
