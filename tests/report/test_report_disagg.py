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
from kvemu.report import build_report, read_results, render_csv, render_json, render_table, verdict_lines
from test_report import results_meta, results_table

MS = 1_000_000  # ns


def _write(path, table, meta):
    path.parent.mkdir(parents=True, exist_ok=True)
    write_results(path, table.replace_schema_metadata(None), {b"kvemu": json.dumps(meta).encode()})
    return str(path)


def disagg_meta(label, path="rdma", p=1, d=1, spec=None, busy=None, **extra):
    return results_meta(label, schedule={"ran": "closed", "disagg": {
        "prefill_instances": p, "decode_instances": d,
        "transfer": {"path": path, "spec": spec or path, "link": "rdma-200g", "mode": "modelled",
                     "bound": "link profiles: bytes / GB/s + one setup per transfer",
                     "pipelining": "layer-by-layer, under the last prefill step"},
        "routing": {"decode": "least-loaded", "prefill": "round-robin"}, "conditional_threshold": None,
        "local_requests": 0, "gpu_busy": busy or {"prefill": 0.8, "decode": 0.4}}}, **extra)


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


def _records(report):
    return {r["label"]: r for r in json.loads(render_json(report))["runs"]}


def test_first_lines_give_the_handoff_share_and_the_deployment_verdict(runs):
    report = build_report(list(runs.values()))
    first = verdict_lines(report)   # the report's first lines, before any wrapping
    text = render_table(report)
    # the verdict, then the hand-off share of TTFT (20 of 140 ms: 14%), then the deployments
    assert first[1].startswith("hand-off share of TTFT: pd-rdma 14% (rdma; ")
    assert "pd-pool 14% (pool:vemu:cxl-pool; " in first[1] and "9% hidden under prefill" in first[1]
    # on 2 GPUs: pd-pool (median TTFT 17.5) beats pd-rdma (35) by 2.00x; colo (55) last; pd-big (4 GPUs) apart
    assert first[2].startswith("deployments on 2 GPUs in total (colocated: colo; disaggregated over RDMA: "
                               "pd-rdma; disaggregated through the pool: pd-pool): pd-pool beats pd-rdma on "
                               "median TTFT by 2.00x")
    assert "colo last" in first[2] and "pd-big" not in first[2]
    assert first[3].startswith("not the same GPUs in total: colo 2; pd-rdma 2; pd-pool 2; pd-big 4")
    assert "pd-big is not compared: its deployment has 4 GPUs in total against 2" in text
    dv = json.loads(render_json(build_report(list(runs.values()))))["traces"]["a" * 64]["deployment_verdict"]
    assert (dv["winner"], dv["runner_up"], dv["total_gpus"]) == ("pd-pool", "pd-rdma", 2)
    assert dv["margin"] == pytest.approx(35 / 17.5)
    assert [r["label"] for r in dv["ranking"]] == ["pd-pool", "pd-rdma", "colo"]
    assert [r["label"] for r in dv["refused"]] == ["pd-big"]


def test_run_records_carry_the_split_handoff_and_pools(runs):
    rec = _records(build_report(list(runs.values())))
    rdma, pool, big, colo = (rec[k]["deployment"] for k in ("pd-rdma", "pd-pool", "pd-big", "colo"))
    assert rdma["kind"] == "disaggregated over RDMA" and pool["kind"] == "disaggregated through the pool"
    assert (rdma["total_gpus"], big["total_gpus"], colo["total_gpus"]) == (2, 4, 2)
    assert rdma["handoff_share_of_ttft"] == pytest.approx(20 / 140)
    assert rdma["ttft_split"]["handoff_p50_ms"] == pytest.approx(5.0)
    assert rdma["ttft_split"]["prefill_share"] == pytest.approx(100 / 140)
    # the pool run's parts are half as long: the same shares, half the times
    assert pool["ttft_split"]["handoff_p50_ms"] == pytest.approx(2.5)
    assert pool["handoff_share_of_ttft"] == pytest.approx(20 / 140)
    assert rdma["handoff"]["bytes"] == 6000 and rdma["handoff"]["overlap_share"] == pytest.approx(2 / 22)
    assert (rdma["handoff"]["pool_blocks"], pool["handoff"]["pool_blocks"]) == (0, 8)
    assert (rdma["gpu_busy_prefill"], rdma["gpu_busy_decode"]) == (0.8, 0.4)
    assert (pool["gpu_busy_prefill"], pool["gpu_busy_decode"]) == (0.9, pytest.approx(0.6))  # mean of 0.5, 0.7
    assert big["tpot_by_decode_instance"]["0"]["mean_tpot_ms"] == pytest.approx(20.0)   # 10 and 30
    assert big["tpot_by_decode_instance"]["1"]["mean_tpot_ms"] == pytest.approx(30.0)   # 20 and 40
    assert (rdma["transfer_spec"], pool["transfer_spec"]) == ("rdma", "pool:vemu:cxl-pool")
    assert rdma["routing"] == "prefill round-robin, decode least-loaded" and rdma["local_requests"] == 0
    assert colo["kind"] == "colocated" and colo["handoff"] is None and colo["ttft_split"] is None
    # CSV: one header, the same figures flat
    rows = list(__import__("csv").DictReader(render_csv(build_report(list(runs.values()))).splitlines()))
    by = {r["label"]: r for r in rows}
    assert float(by["pd-rdma"]["deployment_handoff_share_of_ttft"]) == pytest.approx(20 / 140)
    assert by["pd-pool"]["deployment_handoff_pool_blocks"] == "8"
    assert by["colo"]["deployment_handoff_share_of_ttft"] == "" and by["colo"]["deployment_total_gpus"] == "2"


def test_goodput_by_objective_in_every_output(runs):
    report = build_report(list(runs.values()), slo="ttft=35,tpot=25")
    rec = _records(report)
    # (TTFT, TPOT) by hand: pd-rdma (20,30) (30,10) (40,20) (50,40); pd-pool TTFT 10..25; colo TTFT 40..70
    want = {"pd-rdma": (2, 2, 1), "pd-pool": (4, 2, 2), "colo": (0, 2, 0)}
    for label, (ttft, tpot, both) in want.items():
        r = rec[label]
        assert (r["good_ttft_requests"], r["good_tpot_requests"], r["good_both_requests"]) == (ttft, tpot, both)
        assert r["request_goodput_ttft"] == pytest.approx(ttft / 10.0)    # duration 10 s
        assert r["request_goodput_both"] == pytest.approx(r["request_goodput"])
    from kvemu.report.tables import group_sections

    comparison = next(s for s in group_sections(report.groups[0], report.slo) if s.key == "comparison")
    table = next(t for t in comparison.tables if t.key == "goodput")
    row = next(r for r in table.rows if r.run.run.label == "pd-rdma")
    assert [c.text for c in row.cells[1:]] == ["50.0", "0.20", "50.0", "0.20", "25.0", "0.10"]
    text = render_table(report)
    assert "goodput by objective" in text and "DistServe" in text


def test_html_has_the_disaggregation_tables(runs):
    from kvemu.report import html_page

    page = html_page(build_report(list(runs.values()), slo="ttft=35,tpot=25"))
    for cls in ("deployment", "ttft-split", "handoff", "tpot-instances", "goodput"):
        assert f'<table class="{cls}">' in page
    assert "hand-off share of TTFT: pd-rdma 14%" in page


def test_gpus_in_total_come_from_instances_times_gpus_each(tmp_path):
    gpu = {"name": "H100", "gpus": 4}
    colo = _write(tmp_path / "c.parquet", results_table(TTFT), results_meta("colo", params={"instances": 1}))
    pd = _write(tmp_path / "p.parquet", disagg_table(), disagg_meta("pd", p=1, d=1))
    one = results_meta("colo8", params={"instances": 2})
    one["trace"]["gpu"] = gpu
    colo8 = _write(tmp_path / "c8.parquet", results_table([60.0, 60.0, 60.0, 60.0]), one)
    two = disagg_meta("pd8", p=1, d=1)
    two["trace"]["gpu"] = gpu
    pd8 = _write(tmp_path / "p8.parquet", disagg_table(), two)
    assert read_results(colo8).total_gpus == 8 and read_results(pd8).total_gpus == 8
    assert read_results(colo).total_gpus == 1 and read_results(pd).total_gpus == 2
    # one run on 1 GPU, one on 2: a tie of totals goes to the disaggregated run's, the other is refused
    dv = build_report([colo, pd]).groups[0].deployment
    assert dv.total_gpus == 2 and dv.winner is None
    assert dv.refused == (("colo", "its deployment has 1 GPUs in total against 2: not the same GPUs, so it is "
                                   "not compared with them"),)
    assert "no comparison, pd is the only run on 2 GPUs" in dv.sentence


def test_results_without_disaggregation_report_as_before(tmp_path):
    paths = [_write(tmp_path / f"{k}.parquet", results_table([10.0 + i, 20.0]), results_meta(k, backend=b))
             for i, (k, b) in enumerate((("a", "dram"), ("b", "numa:1")))]
    report = build_report(paths)
    assert all(g.deployment is None for g in report.groups)
    doc = json.loads(render_json(report))
    assert all("deployment" not in r for r in doc["runs"])
    assert all("deployment_verdict" not in t for t in doc["traces"].values())
    assert "deployment" not in render_csv(report).splitlines()[0]
    text = render_table(report)
    assert "hand-off" not in text and "deployments on" not in text and "Prefill and decode apart" not in text
    assert [s.key for s in __import__("kvemu.report.tables", fromlist=["x"]).group_sections(report.groups[0], None)
            if s.key == "disagg"] == []


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(handoff_ns=pa.array([-1, 0, 0, 0], pa.int64())), "column 'handoff_ns' must hold finite values >= 0"),
    (lambda c: c.update(prefill_instance=pa.array([-2, 0, 0, 0], pa.int32())),
     "column 'prefill_instance' must hold values >= -1 (served where it arrived)"),
    (lambda c: c.pop("ttft_first_decode_ns"),
     "results have TTFT parts but not 'ttft_first_decode_ns' (a disaggregated replay writes all of"),
    (lambda c: c.update(handoff_bytes=pa.array([1.5, 0, 0, 0])), "column 'handoff_bytes' has type double, "
                                                                  "expected an integer column"),
])
def test_bad_disaggregation_columns_are_refused(tmp_path, change, message):
    t = disagg_table()
    cols = {n: t[n] for n in t.column_names}
    change(cols)
    path = _write(tmp_path / "bad.parquet", pa.table(cols), disagg_meta("bad"))
    with pytest.raises(ResultsError, match=__import__("re").escape(message)):
        read_results(path)


def test_a_request_served_where_it_arrived_has_prefill_instance_minus_one(tmp_path):
    # conditional disaggregation: request 3 (no hand-off bytes) was prefilled on its decode instance
    t = disagg_table()
    cols = {n: t[n] for n in t.column_names}
    cols["prefill_instance"] = pa.array([0, 0, 0, -1], pa.int32())
    meta = disagg_meta("cond")
    meta["schedule"]["disagg"].update(conditional_threshold=512, local_requests=1)
    run = read_results(_write(tmp_path / "c.parquet", pa.table(cols), meta))
    h = metrics.handoff_summary(run.table)
    # three requests handed off: 6, 8 and 6 ms (p50 6 ms) of which 2 ms hidden; request 3's 2 ms count nowhere
    assert (h["handed_off"], h["p50_ms"], h["mean_ms"]) == (3, 6.0, pytest.approx(20 / 3))
    report = build_report([run.path])
    notes = next(s for s in __import__("kvemu.report.tables", fromlist=["x"]).group_sections(report.groups[0], None)
                 if s.key == "disagg").notes
    assert notes == ("cond: disaggregated over RDMA (1 prefill + 1 decode instances of 1 GPU); link rdma-200g; "
                     "pipelining: layer-by-layer, under the last prefill step; timed: modelled; bound: link "
                     "profiles: bytes / GB/s + one setup per transfer; routing prefill round-robin, decode "
                     "least-loaded; prompts under 512 tokens served where they arrive (1 requests).",)


def _figured(meta, spec, kind, flags=()):
    """``meta`` on backend ``spec`` with figures of ``kind`` and ``flags`` (an upper bound when
    floor-limited), as replay writes the block."""
    from kvemu.figures import FIGURE_KEYS

    meta["backend"] = {"spec": spec, "name": spec.partition(":")[0], "mode": "measured" if kind == "measured"
                       else "emulated", "virtual": kind == "virtual", "facts": {}}
    upper = "floor-limited" in flags
    meta["figures"] = dict.fromkeys(FIGURE_KEYS)
    meta["figures"].update(kind=kind, compute="modelled", flags=list(flags), upper_bound=upper,
                           floor_share=1.0 if upper else None, label=kind + (" (upper bound)" if upper else ""))
    return meta


def test_deployments_rank_on_virtual_twins_of_the_same_deployment(tmp_path):
    # (the P/D run first, so that the colocated virtual run is the first it could take)
    # emulated runs on this host, floor-limited (an upper bound), each with a virtual run beside it:
    # the colocated run's twin is the colocated virtual run, the P/D run's the P/D virtual run
    colo = {"params": {"overlap": False, "instances": 2}, "schedule": {"ran": "closed"}}
    paths = [
        _write(tmp_path / "pe.parquet", disagg_table(scale=10),
               _figured(disagg_meta("pd-emu", path="pool"), "emu:cxl-pool", "emulated", ("floor-limited",))),
        _write(tmp_path / "ce.parquet", results_table([400.0] * 4, tpot_ms=TPOT),
               _figured(results_meta("colo-emu", **colo), "emu:cxl-pool", "emulated", ("floor-limited",))),
        _write(tmp_path / "cv.parquet", results_table([40.0, 50.0, 60.0, 70.0], tpot_ms=TPOT),
               _figured(results_meta("colo-v", **colo), "vemu:cxl-pool", "virtual")),
        _write(tmp_path / "pv.parquet", disagg_table(), _figured(disagg_meta("pd-v", path="pool"), "vemu:cxl-pool",
                                                                 "virtual")),
    ]
    group = build_report(paths).groups[0]
    dv = group.deployment
    assert dict(dv.verdict.twins) == {"colo-emu": "colo-v", "pd-emu": "pd-v"}
    assert dv.verdict.basis == "virtual"
    # median TTFT in virtual time: pd-v 35 ms (20, 30, 40, 50), colo-v 55 ms (40, 50, 60, 70)
    assert (dv.winner, dv.verdict.runner_up) == ("pd-emu", "colo-emu")
    assert dv.verdict.margin == pytest.approx(55 / 35)
    assert "pd-emu (as its virtual twin pd-v) beats colo-emu (as its virtual twin colo-v)" in dv.sentence


def test_html_draws_the_ttft_split(runs):
    pytest.importorskip("matplotlib", reason="no plots without matplotlib ('.[plot]')")
    import base64
    import re

    from kvemu.report import html_page

    page = html_page(build_report(list(runs.values())))
    found = re.findall(r'<img src="data:image/png;base64,([^"]+)"[^>]*alt="TTFT split per disaggregated run', page)
    assert len(found) == 1 and base64.b64decode(found[0]).startswith(b"\x89PNG")


@pytest.mark.slow
def test_a_real_disaggregated_replay_reports(tmp_path):
    """End to end, once the replay has roles (kvemu.replay.options.DisaggOptions): a colocated run
    on 2 instances and 1+1 prefill/decode over RDMA and through the pool, replayed in virtual time;
    the report's figures against sums taken here of the results' own columns."""
    options = pytest.importorskip("kvemu.replay.options")
    if not hasattr(options, "DisaggOptions"):
        pytest.skip("this kvemu's replay has no prefill/decode roles (replay --prefill-instances)")
    import pyarrow.parquet as pq

    from kvemu.record_options import RecordOptions
    from kvemu.recording import record
    from kvemu.replay import OutputOptions, ReplayOptions, WindowOptions, replay

    trace = tmp_path / "t.parquet"
    record("synthetic:docqa:documents=4,questions=3,rate=2,output_max_tokens=60", "llama3-8b", trace,
           RecordOptions.from_flat(hbm_kv_gib=2.5, show_progress=False))
    runs = {"colo": {"instances": options.InstanceOptions(count=2)},
            "pd-rdma": {"disagg": options.DisaggOptions(prefill_instances=1, decode_instances=1, transfer="rdma")},
            "pd-pool": {"disagg": options.DisaggOptions(prefill_instances=1, decode_instances=1, transfer="pool")}}
    paths = {}
    for label, kw in runs.items():
        paths[label] = tmp_path / f"{label}.parquet"
        replay(trace, "vemu:cxl-pool", ReplayOptions(window=WindowOptions(layers=1),
                                                     output=OutputOptions(label=label), **kw), out=paths[label])
    report = build_report([str(p) for p in paths.values()])
    group = report.groups[0]
    assert group.deployment.total_gpus == 2 and not group.deployment.refused
    assert {lab for lab, _, _ in group.deployment.deployments} == set(runs)
    lines = verdict_lines(report)
    assert lines[1].startswith("hand-off share of TTFT: ") and lines[2].startswith("deployments on 2 GPUs in total")
    rec = _records(report)
    for label in ("pd-rdma", "pd-pool"):
        t = pq.read_table(paths[label])
        parts = sum(t[f"ttft_{p}_ns"].to_numpy().astype(np.float64).sum() for p in metrics.TTFT_PARTS)
        assert parts == pytest.approx(t["ttft_ms"].to_numpy().sum() * 1e6, rel=1e-6)  # the parts are TTFT
        d = rec[label]["deployment"]
        assert d["handoff_share_of_ttft"] == pytest.approx(t["ttft_handoff_ns"].to_numpy().sum() / parts)
        assert d["handoff"]["handed_off"] == int((t["prefill_instance"].to_numpy() >= 0).sum())
        assert d["handoff"]["bytes"] == int(t["handoff_bytes"].to_numpy().sum()) > 0
        meta = json.loads(t.schema.metadata[b"kvemu"])["schedule"]["disagg"]
        assert d["gpu_busy_prefill"] == pytest.approx(meta["gpu_busy"]["prefill"])
    assert rec["pd-pool"]["deployment"]["transfer_path"] == "pool"


def test_an_ill_formed_disagg_block_reports_what_it_can(tmp_path):
    # schedule.disagg from a file: wrong types are shown as unknown, never a crash, in every output
    from kvemu.report import html_page

    meta = disagg_meta("odd")
    meta["schedule"]["disagg"].update(prefill_instances="two", decode_instances=True, conditional_threshold="x",
                                      local_requests=-3, transfer="rdma", routing=["a"], gpu_busy={"prefill": "hot"})
    path = _write(tmp_path / "odd.parquet", disagg_table(), meta)
    report = build_report([path], slo="ttft=35,tpot=25")
    d = _records(report)["odd"]["deployment"]
    assert (d["prefill_instances"], d["decode_instances"], d["conditional_threshold"], d["local_requests"]) == (
        None, None, None, None)
    assert d["total_gpus"] == 1 and d["gpu_busy_prefill"] is None and d["kind"] == "disaggregated over ?"
    assert d["handoff_share_of_ttft"] == pytest.approx(20 / 140)   # the columns still tell
    for text in (render_table(report), render_csv(report), html_page(report)):
        assert "odd" in text


def test_rank_names_the_deployments_compared(runs):
    # --rank pd-rdma,colo: pd-pool is left out; pd-rdma (35 ms) beats colo (55 ms) on 2 GPUs
    dv = build_report(list(runs.values()), rank=["pd-rdma", "colo"]).groups[0].deployment
    assert [lab for lab, _, _ in dv.deployments] == ["colo", "pd-rdma"]
    assert (dv.winner, dv.verdict.runner_up) == ("pd-rdma", "colo")
    assert dv.verdict.margin == pytest.approx(55 / 35) and not dv.refused
