"""Metrics definitions, results-file validation, run grouping and the renderers."""
import csv
import io
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvemu import metrics
from kvemu.errors import ConfigError, ResultsError
from kvemu.report import (
    REQUIRED_COLUMNS,
    build_report,
    read_results,
    render_csv,
    render_json,
    render_table,
)

SHA_A = "a" * 64
SHA_B = "b" * 64


def results_table(ttft_ms, tpot_ms=None, itl_ms=None, output_tokens=None, **columns):
    """A results table with one request per TTFT value; other columns get simple defaults."""
    n = len(ttft_ms)
    ttft = np.asarray(ttft_ms, dtype=np.float64)
    if output_tokens is None:
        output_tokens = [3] * n
    out = np.asarray(output_tokens, dtype=np.int32)
    if itl_ms is None:
        itl_ms = [[10.0] * (int(k) - 1) for k in out]
    if tpot_ms is None:
        tpot_ms = [np.mean(x) if len(x) else np.nan for x in itl_ms]
    tpot = np.asarray(tpot_ms, dtype=np.float64)
    e2el = ttft + np.nan_to_num(tpot) * np.maximum(out - 1, 0)
    data = {
        "request_id": np.arange(n, dtype=np.int32),
        "arrival_ms": np.arange(n, dtype=np.float64) * 100.0,
        "input_tokens": np.full(n, 100, dtype=np.int32),
        "output_tokens": out,
        "cached_tokens": np.zeros(n, dtype=np.int32),
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "e2el_ms": e2el,
        "queue_ms": np.full(n, 1.0),
        "compute_ms": np.full(n, 5.0),
        "kv_load_ms": np.full(n, 2.0),
        "kv_store_ms": np.full(n, 1.0),
        "kv_read_ms": np.full(n, 1.0),
        "kv_stall_ms": np.full(n, 0.5),
        "kv_bytes_loaded": np.full(n, 1 << 20, dtype=np.int64),
        "kv_bytes_stored": np.full(n, 1 << 19, dtype=np.int64),
        "kv_bytes_read": np.full(n, 1 << 21, dtype=np.int64),
    }
    data.update(columns)
    arrays = {k: pa.array(v) for k, v in data.items()}
    arrays["itl_ms"] = pa.array(itl_ms, type=pa.list_(pa.float64()))
    return pa.table(arrays)


def results_meta(label, backend="dram", mode="measured", sha=SHA_A, duration_s=10.0, **extra):
    meta = {
        "format": "kvemu.results",
        "version": 1,
        "creator": "kvemu 0.1.0",
        "created": "2026-11-29T16:00:00Z",
        "run_id": f"run-{label}",
        "label": label,
        "backend": {"spec": backend, "name": backend, "mode": mode, "facts": {}},
        "trace": {
            "path": "t.parquet",
            "sha256": sha,
            "version": 1,
            "model": {"name": "llama3-8b", "layers": 32},
            "workload": {"kind": "synthetic:chat"},
            "engine": {"tier_policy": "offload"},
            "summary": {"requests": 4, "dedup_ratio": 1.8, "prefix_hit_ratio_unbounded": 0.41},
        },
        "host": {"hostname": "h", "cores": 2},
        "params": {"overlap": False},
        "steps": {"count": 10, "total_ns": 4_000_000, "compute_ns": 3_000_000,
                  "kv_stall_ns": 1_000_000},
        "ops": {
            op: {"accesses": 8, "bytes": 8 << 20, "time_ns": 1_000_000, "gbps": gbps,
                 "p50_ns": 1000, "p99_ns": 5000, "p999_ns": 9000,
                 "hist": {"lower_ns": [0, 1000], "counts": [4, 4]}}
            for op, gbps in (("load", 8.4), ("store", 4.2), ("read", 16.8))
        },
        "duration_s": duration_s,
    }
    meta.update(extra)
    return meta


def write_results(path, table, meta):
    path.parent.mkdir(parents=True, exist_ok=True)
    table = table.replace_schema_metadata({b"kvemu": json.dumps(meta).encode()})
    pq.write_table(table, path)
    return str(path)


# --------------------------------------------------------------------------------------------
# metrics


def test_percentile_is_linear_interpolation_ignoring_nan():
    assert metrics.percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert metrics.percentile([4, np.nan, 1, 3, 2], 99) == pytest.approx(3.97)
    assert metrics.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert metrics.percentile(np.arange(1, 11), 90) == pytest.approx(9.1)
    assert list(metrics.percentile([1, 2, 3, 4], [0, 100])) == [1.0, 4.0]
    assert math.isnan(metrics.percentile([np.nan], 50))
    assert math.isnan(metrics.percentile([], 99))


def test_summarize_uses_vllm_keys_pools_itl_and_skips_single_token_tpot():
    itl = [[10.0, 20.0], [30.0], []]
    table = results_table([100.0, 200.0, 300.0], output_tokens=[3, 2, 1], itl_ms=itl)
    s = metrics.summarize(table, duration_s=2.0)

    # Pooled over the 3 ITL values (mean 20), not a mean of per-request means (22.5).
    assert s["mean_itl_ms"] == pytest.approx(20.0)
    assert s["median_itl_ms"] == pytest.approx(20.0)
    assert s["p99_itl_ms"] == pytest.approx(29.8)
    assert s["std_itl_ms"] == pytest.approx(np.std([10.0, 20.0, 30.0]))
    # The 1-token request has no TPOT: mean of 15 and 30 only.
    assert s["mean_tpot_ms"] == pytest.approx(22.5)
    assert s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["completed"] == 3
    assert s["total_input_tokens"] == 300 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["total_token_throughput"] == pytest.approx(153.0)
    assert s["mean_queue_ms"] == pytest.approx(1.0)
    assert s["total_kv_load_ms"] == pytest.approx(6.0)
    assert s["total_kv_bytes_read"] == 3 << 21
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in s

    as_arrays = {name: table.column(name).to_pylist() for name in table.column_names}
    assert metrics.summarize(as_arrays, 2.0) == pytest.approx(s, nan_ok=True)


def test_goodput_counts_requests_meeting_both_objectives_of_a_preset():
    slo = metrics.parse_slo("llama3.1-8b-interactive")
    assert (slo.ttft_ms, slo.tpot_ms) == (500, 30)
    table = results_table(
        [400.0, 600.0, 500.0, 100.0, 100.0],
        tpot_ms=[20.0, 10.0, 30.0, np.nan, 31.0],
        output_tokens=[3, 3, 3, 1, 3],
    )
    good = metrics.good_requests(table, slo.ttft_ms, slo.tpot_ms)
    # TTFT too slow; TPOT on the limit is good; no TPOT (one token) is good; TPOT too slow.
    assert good.tolist() == [True, False, True, True, False]
    assert metrics.goodput(table, slo.ttft_ms, slo.tpot_ms, duration_s=2.0) == pytest.approx(1.5)

    assert metrics.parse_slo("ttft=500, tpot=30") == metrics.SLO("ttft=500, tpot=30", 500.0, 30.0)
    assert metrics.parse_slo("tpot=30").ttft_ms == math.inf
    for bad in ("llama9", "ttft=fast", "ttft=-1", "e2el=5", "ttft=1,ttft=2"):
        with pytest.raises(ConfigError):
            metrics.parse_slo(bad)


def test_summary_reads_only_columns_a_results_file_must_have():
    assert set(metrics.SUMMARY_COLUMNS) <= set(REQUIRED_COLUMNS)


def test_slo_presets_are_the_mlperf_targets():
    presets = {name: (s.ttft_ms, s.tpot_ms) for name, s in metrics.SLO_PRESETS.items()}
    assert presets == {
        "llama2-70b": (2000, 200),
        "llama2-70b-interactive": (450, 40),
        "llama3.1-405b": (6000, 175),
        "llama3.1-8b": (2000, 100),
        "llama3.1-8b-interactive": (500, 30),
    }


# --------------------------------------------------------------------------------------------
# grouping and baselines


@pytest.fixture
def two_traces(tmp_path):
    """Two traces on three backends, written in an order unlike the report's: for each trace,
    nvme is slow (TTFT 300), dram fast (100) and an emulated cxl fastest (50)."""
    specs = [
        ("B", "nvme", "measured", 300.0),
        ("A", "dram", "measured", 100.0),
        ("B", "cxl", "emulated", 50.0),
        ("A", "cxl", "emulated", 50.0),
        ("A", "nvme", "measured", 300.0),
        ("B", "dram", "measured", 100.0),
    ]
    paths = []
    for trace, backend, mode, ttft in specs:
        table = results_table([ttft, ttft, ttft, ttft], tpot_ms=[ttft / 10] * 4)
        meta = results_meta(f"{backend}-{trace}", backend, mode, SHA_A if trace == "A" else SHA_B)
        paths.append(write_results(tmp_path / f"{trace}-{backend}.parquet", table, meta))
    return paths


def test_runs_group_by_trace_and_line_up_by_backend(two_traces):
    report = build_report(two_traces)
    assert [g.trace_sha256 for g in report.groups] == [SHA_B, SHA_A]
    for group in report.groups:
        # Backends in order of first appearance, so both groups list them alike.
        assert [r.run.backend_spec for r in group.rows] == ["nvme", "dram", "cxl"]
        # The emulated cxl run is fastest but never the default baseline.
        assert group.baseline.run.backend_spec == "dram"
        assert [r.is_baseline for r in group.rows] == [False, True, False]
        assert "fastest measured" in group.baseline_rule


def test_deltas_and_ratios_against_the_baseline(two_traces):
    group = build_report(two_traces).groups[0]
    nvme, dram, cxl = group.rows
    assert nvme.ratio == pytest.approx({"ttft": 3.0, "tpot": 3.0, "e2el": 3.0})
    assert nvme.delta_ms["ttft"] == pytest.approx(200.0)
    assert nvme.delta_ms["tpot"] == pytest.approx(20.0)
    assert nvme.delta_ms["e2el"] == pytest.approx(240.0)
    assert cxl.ratio["ttft"] == pytest.approx(0.5)
    assert cxl.delta_ms["ttft"] == pytest.approx(-50.0)
    assert dram.ratio == pytest.approx({"ttft": 1.0, "tpot": 1.0, "e2el": 1.0})


def test_baseline_by_label_by_index_and_fallbacks(two_traces, tmp_path):
    by_label = build_report(two_traces, baseline="nvme-A")
    assert [g.baseline.run.label for g in by_label.groups] == ["dram-B", "nvme-A"]
    assert "no run labelled 'nvme-A'" in by_label.groups[0].baseline_rule

    for index in (2, "2"):
        report = build_report(two_traces, baseline=index)
        assert [g.baseline.run.backend_spec for g in report.groups] == ["cxl", "cxl"]
    with pytest.raises(ConfigError, match="out of range"):
        build_report(two_traces, baseline=3)
    with pytest.raises(ConfigError, match="no run is labelled 'sram'"):
        build_report(two_traces, baseline="sram")

    emulated = [
        write_results(tmp_path / "only" / f"{label}.parquet", results_table([ttft, ttft]),
                      results_meta(label, backend, "emulated", "c" * 64))
        for label, backend, ttft in (("c", "cxl", 5.0), ("d", "pmem", 1.0))
    ]
    group = build_report(emulated).groups[0]
    assert group.baseline.run.label == "c" and group.baseline_rule.startswith("first run")


# --------------------------------------------------------------------------------------------
# inputs and errors


def test_folders_are_searched_recursively_and_non_results_skipped(tmp_path):
    root = tmp_path / "runs"
    write_results(root / "a.parquet", results_table([1.0]), results_meta("a"))
    write_results(root / "deep" / "er" / "b.parquet", results_table([2.0]),
                  results_meta("b", "cxl"))
    pq.write_table(pa.table({"x": [1, 2]}), root / "plain.parquet")
    trace = pa.table({"op": [1]}).replace_schema_metadata(
        {b"kvemu": json.dumps({"format": "kvemu.trace", "version": 1}).encode()}
    )
    pq.write_table(trace, root / "deep" / "trace.parquet")
    (root / "deep" / "notes.parquet").write_text("not parquet")
    (root / "readme.txt").write_text("ignored")

    report = build_report([str(root), str(root / "a.parquet")])
    assert sorted(r.run.label for r in report.rows) == ["a", "b"]
    # a kvemu trace beside its results is expected there: skipped without a note
    assert sorted(p.rsplit("/", 1)[1] for p, _ in report.skipped) == ["notes.parquet", "plain.parquet"]
    # Named explicitly, a non-results file is an error, even after a folder scan skipped it.
    for paths in ([root / "plain.parquet"], [root, root / "plain.parquet"]):
        with pytest.raises(ResultsError, match="plain.parquet: not a kvemu results file"):
            build_report([str(p) for p in paths])

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ResultsError, match="no kvemu results files in this folder"):
        build_report([str(empty)])

    # A results file a folder scan cannot read is an error, not something to skip.
    write_results(root / "new.parquet", results_table([1.0]), {**results_meta("n"), "version": 2})
    with pytest.raises(ResultsError, match="version 2"):
        build_report([str(root)])


def test_results_error_messages(tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 but not really")
    with pytest.raises(ResultsError) as err:
        read_results(garbage)
    assert str(err.value) == f"{garbage}: not a Parquet file"

    bare = tmp_path / "bare.parquet"
    pq.write_table(results_table([1.0]), bare)
    with pytest.raises(ResultsError) as err:
        read_results(bare)
    assert str(err.value) == f"{bare}: not a kvemu results file (no 'kvemu' schema metadata)"

    trace = write_results(tmp_path / "trace.parquet", results_table([1.0]),
                          {**results_meta("t"), "format": "kvemu.trace"})
    with pytest.raises(ResultsError) as err:
        read_results(trace)
    assert str(err.value) == (
        f"{trace}: not a kvemu results file (format is 'kvemu.trace', expected 'kvemu.results')"
    )

    future = write_results(tmp_path / "future.parquet", results_table([1.0]),
                           {**results_meta("f"), "version": 2})
    with pytest.raises(ResultsError) as err:
        read_results(future)
    assert str(err.value) == (
        f"{future}: results format version 2 is not supported (this kvemu reads version 1)"
    )

    missing = write_results(tmp_path / "missing.parquet",
                            results_table([1.0]).drop_columns(["kv_stall_ms"]), results_meta("m"))
    with pytest.raises(ResultsError) as err:
        read_results(missing)
    assert str(err.value) == f"{missing}: results file is missing required column 'kv_stall_ms'"

    table = results_table([1.0])
    table = table.set_column(table.schema.get_field_index("ttft_ms"), "ttft_ms", pa.array(["1"]))
    mistyped = write_results(tmp_path / "mistyped.parquet", table, results_meta("x"))
    with pytest.raises(ResultsError, match="column 'ttft_ms' has type string, expected a floating"):
        read_results(mistyped)

    meta = results_meta("nolabel")
    del meta["trace"]["sha256"]
    no_sha = write_results(tmp_path / "nosha.parquet", results_table([1.0]), meta)
    with pytest.raises(ResultsError) as err:
        read_results(no_sha)
    assert str(err.value) == f"{no_sha}: 'kvemu' metadata is missing 'trace.sha256'"

    with pytest.raises(ResultsError) as err:
        read_results(tmp_path / "absent.parquet")
    assert str(err.value) == f"{tmp_path / 'absent.parquet'}: no such file"


# --------------------------------------------------------------------------------------------
# renderers


def test_table_fits_width_names_baseline_and_marks_emulated(two_traces):
    report = build_report(two_traces, slo="llama3.1-8b")
    for width in (100, 80):
        text = render_table(report, width=width)
        assert max(len(line) for line in text.splitlines()) <= width
    text = render_table(report)
    assert "baseline: dram-A (fastest measured run by median TTFT)" in text
    assert "baseline: dram-B (fastest measured run by median TTFT)" in text
    # the latency table's rows (the figures table's rows end with what they replayed: "recorded")
    latency_rows = [line for line in text.splitlines()
                    if ("  measured  " in line or "  emulated  " in line) and not line.endswith("recorded")]
    assert len(latency_rows) == 6
    for line in latency_rows:
        assert ("emulated" in line) == (line.split()[-8] == "cxl")
    # the footnotes saying what each kind means
    assert "\nmeasured: KV accesses performed and timed on this host" in text
    assert "\nemulated: KV times are delays injected on this host" in text
    assert "virtual:" not in text and "compute: GPU compute time is modelled" in text
    with pytest.raises(ConfigError):
        render_table(report, width=40)


def test_table_cuts_long_labels_to_fit(tmp_path):
    path = write_results(tmp_path / "long.parquet", results_table([1.0, 2.0]),
                         results_meta("x" * 150, "dram-" + "y" * 60))
    text = render_table(build_report([path]), width=100)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "…" in text


def test_json_and_csv_carry_every_key(two_traces):
    report = build_report(two_traces, slo="ttft=200,tpot=25")
    document = json.loads(render_json(report))
    runs = document["runs"]
    assert len(runs) == 6
    assert set(document["traces"]) == {SHA_A, SHA_B}
    expected = {
        "label", "backend", "mode", "completed", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
        "kv_gbps_load", "kv_gbps_store", "kv_gbps_read", "kv_p50_ns_load", "kv_p99_ns_store",
        "kv_p999_ns_read", "breakdown", "dedup_ratio", "ratio_vs_baseline", "delta_vs_baseline_ms",
    } | {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
         for m in ("ttft", "tpot", "itl", "e2el")}
    for run in runs:
        assert expected <= set(run)
        assert set(run["ratio_vs_baseline"]) == {"ttft", "tpot", "e2el"}
        assert set(run["breakdown"]) == {
            "queue", "kv_load", "kv_store", "kv_read", "compute", "kv_stall"
        }
    nvme = runs[0]
    assert (nvme["backend"], nvme["mode"], nvme["baseline_label"]) == ("nvme", "measured", "dram-B")
    assert nvme["ratio_vs_baseline"]["ttft"] == pytest.approx(3.0)
    assert nvme["kv_gbps_load"] == pytest.approx(8.4)
    assert nvme["breakdown"]["kv_stall"] == pytest.approx(0.25)
    assert nvme["breakdown"]["kv_load"] == pytest.approx(0.2)
    assert nvme["dedup_ratio"] == pytest.approx(1.8)
    # nvme misses TTFT 200 ms; dram (TTFT 100, TPOT 10) meets both.
    assert nvme["request_goodput"] == 0.0 and runs[1]["request_goodput"] == pytest.approx(0.4)

    rows = list(csv.DictReader(io.StringIO(render_csv(report))))
    assert len(rows) == 6
    assert float(rows[0]["ratio_vs_baseline_ttft"]) == pytest.approx(3.0)
    assert rows[2]["mode"] == "emulated" and rows[2]["breakdown_kv_stall"] == "0.25"


def test_json_writes_nan_as_null(tmp_path):
    path = write_results(tmp_path / "one.parquet", results_table([5.0], output_tokens=[1]),
                         results_meta("one", ops={}))
    (run,) = json.loads(render_json(build_report([path])))["runs"]
    assert run["mean_tpot_ms"] is None and run["kv_gbps_read"] is None
    assert run["mean_ttft_ms"] == 5.0
