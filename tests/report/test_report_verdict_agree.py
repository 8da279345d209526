"""The verdict's sentences agree with each other and with the tables below them (issue 42, item 5),
on hand-built results files (tests/test_report_verdict_rules.py's ``make``): a run's place against
break-even is the break-even table's own cell, a lead is never explained by loads that take no
share of TTFT, and the demo's verdict on a few runs sees the virtual twins the whole report sees."""
import pyarrow as pa
import pyarrow.parquet as pq

from kvemu.analysis import breakeven_gbps, timing_from_meta
from kvemu.demo import _verdict as demo_verdict
from kvemu.report import build_report
from kvemu.report.results import read_results

from test_report_verdict_rules import base, make  # noqa: F401  (base: the module's fixture)


def _no_load_time(path):
    """``path`` rewritten so that its KV loads take no time (0 % of every request's TTFT)."""
    t = pq.read_table(path)
    t = t.set_column(t.column_names.index("kv_load_ms"), "kv_load_ms", pa.array([0.0] * t.num_rows))
    pq.write_table(t, path)
    return path


def _k(tokens):
    return f"{tokens // 1024}k"


def test_above_or_below_break_even_is_what_the_table_says(base, tmp_path):  # noqa: F811
    runs = {g: make(base, tmp_path / f"{g}.parquet", f"t{g}", f"vemu:{name}", "virtual", ttft, gbps=g)
            for g, name, ttft in ((24.0, "cxl-pool", 50), (5.7, "rdma-storage", 60), (2.0, "nvme", 70))}
    rep = build_report([str(p) for p in runs.values()])
    v = rep.groups[0].verdict
    rows = breakeven_gbps(timing_from_meta(read_results(runs[24.0]).meta["trace"]))
    for g in runs:
        # the oracle: the prefixes at which loading at g beats recomputing, by hand from the rows
        wins = [int(r["prefix_tokens"]) for r in rows if g >= r["breakeven_gbps"]]
        longest = int(rows[-1]["prefix_tokens"])
        from_ = next((p for p in (int(r["prefix_tokens"]) for r in rows) if all(w in wins for w in
                      (int(r["prefix_tokens"]) for r in rows if int(r["prefix_tokens"]) >= p))), None)
        (terms,) = [p for p in v.parts if p.startswith(f"t{g}: ")]
        if from_ is None:
            assert f"below break-even: recomputing beats reusing at every prefix up to {_k(longest)}" in terms
        elif from_ == int(rows[0]["prefix_tokens"]):
            assert "above break-even at every prefix" in terms
        else:
            assert f"above break-even from {_k(from_)}-token prefixes on" in terms
        # the table's "reuse wins" cell for the run says the same
        group = rep.groups[0]
        (i,) = [i for i, row in enumerate(group.rows) if row.run.label == f"t{g}"]
        assert group.breakeven.verdicts[i].wins_from_tokens == from_
    # the case a user saw: a tier between the break-even at its median prefix and at short prefixes
    # was called "above the break-even" beside a table saying "no" up to 8k
    (rdma,) = [p for p in v.parts if p.startswith("t5.7: ")]
    assert "above the" not in rdma and "break-even from" in rdma


def test_a_faster_tier_is_no_reason_when_loads_take_no_share_of_ttft(base, tmp_path):  # noqa: F811
    fast = _no_load_time(make(base, tmp_path / "a.parquet", "vemu:cxl-pool", "vemu:cxl-pool", "virtual", 50,
                              gbps=24.0))
    slow = _no_load_time(make(base, tmp_path / "b.parquet", "vemu:nvme", "vemu:nvme", "virtual", 52, gbps=6.8))
    v = build_report([str(fast), str(slow)]).groups[0].verdict
    assert v.winner == "vemu:cxl-pool"
    assert "because its KV comes from the tier" not in v.sentence
    assert "0% against 0%" not in v.reason
    # where the loads do take a share of TTFT, the faster tier's GB/s is the reason
    fast2 = make(base, tmp_path / "c.parquet", "vemu:cxl-pool", "vemu:cxl-pool", "virtual", 50, gbps=24.0)
    slow2 = make(base, tmp_path / "d.parquet", "vemu:nvme", "vemu:nvme", "virtual", 52, gbps=6.8)
    t = pq.read_table(slow2)  # the slow tier's loads: a tenth of its TTFT
    t = t.set_column(t.column_names.index("kv_load_ms"), "kv_load_ms", pa.array([5.2] * t.num_rows))
    pq.write_table(t, slow2)
    v = build_report([str(fast2), str(slow2)]).groups[0].verdict
    assert "because its KV comes from the tier at 24.0 GB/s against 6.8 GB/s" in v.sentence


def test_the_demo_verdict_on_measured_runs_sees_the_twins_the_report_sees(base, tmp_path):  # noqa: F811
    dram = make(base, tmp_path / "dram.parquet", "dram/offload", "dram", "measured", 64, flags=("host-bound",),
                reps=[60, 64, 67])
    uring = make(base, tmp_path / "uring.parquet", "uring/offload", "uring", "measured", 200,
                 flags=("host-bound",), reps=[170, 200, 240])
    nvme = make(base, tmp_path / "nvme.parquet", "vemu:nvme/offload", "vemu:nvme", "virtual", 60)
    cxl = make(base, tmp_path / "cxl.parquet", "vemu:cxl-pool/offload", "vemu:cxl-pool", "virtual", 50)
    full = build_report([str(p) for p in (dram, uring, nvme, cxl)])
    whole = full.groups[0].verdict
    assert ("uring/offload", "vemu:nvme/offload") in whole.twins
    assert any("uring/offload is ranked on its virtual twin vemu:nvme/offload" in p for p in whole.parts)
    v = demo_verdict(full, [dram, uring])
    # before: "no run can be ranked: every run's figures are an upper bound and none has a virtual twin"
    assert "none has a virtual twin" not in v.reason
    assert ("uring/offload", "vemu:nvme/offload") in v.twins
    assert [r.figures_of for r in v.rankings] == [("vemu:nvme/offload",)]
    assert v.sentence.startswith("no comparison: uring/offload (as its virtual twin vemu:nvme/offload) is the only "
                                 "run ranked (in virtual time)")
    assert any(lab == "dram/offload" and "no virtual twin is given" in why for lab, why in v.unranked)


def test_figure_labels_of_a_stack_sweep_are_told_apart():
    from kvemu.plots import MAX_LABEL_CHARS, _shorts

    caps = ("1.0", "2.0", "4.0", "8.0", "16.0")
    labels = (["[vemu:local-dram 1.0 GiB + vemu:nvme 16.0 GiB write-back]/offload"]
              + [f"[vemu:local-dram 1.0 GiB + vemu:cxl-pool {c} GiB + vemu:nvme 16.0 GiB write-back]/offload"
                 for c in caps] + ["dram/offload"])
    out = _shorts(labels, ["(VIRTUAL)"] * 6 + [""])
    assert len(set(out)) == len(out)  # before: five read "[vemu:local-dram 1.0 GiB + vemu:cxl-poo… (VIRTUAL)"
    for c, text in zip(caps, out[1:6]):
        assert f"cxl-pool {c} GiB" in text and text.endswith(" (VIRTUAL)")
        assert len(text) - len(" (VIRTUAL)") <= MAX_LABEL_CHARS
    assert out[-1] == "dram/offload"
    # labels that differ only past the cut, with no stack levels, are still told apart
    assert len(set(_shorts(["x" * 45 + "a", "x" * 45 + "b"]))) == 2
