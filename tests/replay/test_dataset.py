"""Results as a Hive-partitioned dataset, and the worked queries of docs/analysis.md."""

import json
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from kvemu.metrics import percentile
from kvemu.replay import OutputOptions, ReplayOptions, WindowOptions, replay
from kvemu.report import build_report

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"
BACKENDS = ("dram", "vemu:cxl-pool", "vemu:nvme")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    paths = {b: Path(replay(TRACE, b, ReplayOptions(window=WindowOptions(layers=1), output=OutputOptions(dataset=root)), out=None)["results_path"]) for b in BACKENDS}
    return root, paths


def test_layout_is_hive_partitioned(runs):
    root, paths = runs
    for path in paths.values():
        rel = path.relative_to(root).parts
        assert [p.split("=")[0] for p in rel[:3]] == ["backend", "host", "run_id"] and rel[3] == "results.parquet"
    assert {p.relative_to(root).parts[0] for p in paths.values()} == {
        "backend=dram", "backend=vemu-cxl-pool", "backend=vemu-nvme"}
    assert len(build_report([str(root)]).groups[0].rows) == 3  # kvemu report reads the dataset whole


def _p99_by_backend_pyarrow(root):
    t = pads.dataset(root, format="parquet", partitioning="hive").to_table(columns=["backend", "ttft_ms"])
    return {b: pc.quantile(t.filter(pc.equal(t["backend"], b))["ttft_ms"], 0.99)[0].as_py()
            for b in pc.unique(t["backend"]).to_pylist()}


def test_p99_ttft_per_backend_pyarrow_and_duckdb_agree_with_kvemu(runs):
    root, paths = runs
    got = _p99_by_backend_pyarrow(root)
    for b, path in paths.items():
        expected = percentile(pq.read_table(path)["ttft_ms"].to_numpy(), 99)
        key = path.relative_to(root).parts[0].split("=")[1]
        assert got[key] == pytest.approx(expected)
    duckdb = pytest.importorskip("duckdb", reason="duckdb not installed")
    rows = duckdb.sql(f"""SELECT backend, count(*) AS requests, quantile_cont(ttft_ms, 0.99) AS p99_ttft_ms
        FROM read_parquet('{root}/**/*.parquet', hive_partitioning = true)
        GROUP BY backend ORDER BY backend""").fetchall()
    assert {b: p for b, _, p in rows} == pytest.approx(got)
    assert all(n == 96 for _, n, _ in rows)


def test_stall_share_and_op_bandwidth_queries(runs):
    duckdb = pytest.importorskip("duckdb", reason="duckdb not installed")
    root, paths = runs
    stall = dict(duckdb.sql(f"""SELECT backend, sum(kv_stall_ms) / sum(e2el_ms - queue_ms) AS stall_share
        FROM read_parquet('{root}/**/*.parquet', hive_partitioning = true)
        GROUP BY backend ORDER BY backend""").fetchall())
    assert all(0 <= v < 1 for v in stall.values())
    assert stall["vemu-nvme"] > stall["vemu-cxl-pool"]  # a slower tier stalls the steps more
    bw = duckdb.sql(f"""SELECT regexp_extract(file_name, 'backend=([^/]+)', 1) AS backend,
           CAST(json_extract(decode(value), '$.ops.store.gbps') AS DOUBLE) AS store_gbps
        FROM parquet_kv_metadata('{root}/**/*.parquet') WHERE decode(key) = 'kvemu'
        ORDER BY backend""").fetchall()
    for backend, gbps in bw:
        path = next(p for p in paths.values() if f"backend={backend}" in str(p))
        meta = json.loads(pq.read_schema(path).metadata[b"kvemu"])
        assert gbps == pytest.approx(meta["ops"]["store"]["gbps"])
    assert np.isfinite([g for _, g in bw]).all()
