"""The verdict's rules (docs/report.md, "Verdict"), checked on hand-built results files: one real
replay's file rewritten with the figures each case needs (every request the same TTFT, TPOT and
E2EL, so each run's medians are the numbers written here), its kind and flags, its repetitions.
The expected verdict is worked out by hand in each test: a tie, a clear win, a floor-limited run
ranked on its virtual twin, mixed kinds, different workloads, no KV moved."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvemu.errors import ConfigError
from kvemu.figures import FIGURE_KEYS
from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.report import build_report, render_json, render_table
from kvemu.replay import OutputOptions, ReplayOptions, WindowOptions, replay

WORKLOAD = "synthetic:docqa:documents=4,questions=3,rate=0.5,output_max_tokens=60"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("rules")
    trace = d / "t.parquet"
    record(WORKLOAD, "llama3-8b", trace, RecordOptions.from_flat(hbm_kv_gib=2.5, show_progress=False))
    out = d / "base.parquet"
    replay(trace, "vemu:nvme", ReplayOptions(window=WindowOptions(layers=1), output=OutputOptions(label="b")), out=out)
    return out


KIND_MODE = {"measured": "measured", "emulated": "emulated", "virtual": "emulated"}


def make(base, path, label, spec, kind, ttft, *, tpot=10.0, e2el=500.0, flags=(), reps=None, loaded=True,
         checksum=None, policy=None, still=False, gbps=None):
    """A results file like ``base`` with: every request's TTFT/TPOT/E2EL the given ones, backend
    ``spec`` of ``kind`` with ``flags``; ``reps``, the median TTFT of each repetition (TPOT and E2EL
    the run's own in each); without ``loaded``, no KV loaded or read from the tier."""
    t = pq.read_table(base)
    meta = json.loads(t.schema.metadata[b"kvemu"])
    n = t.num_rows
    cols = {name: t[name] for name in t.column_names}
    cols["ttft_ms"] = pa.array([float(ttft)] * n)
    cols["tpot_ms"] = pa.array([float(tpot)] * n)
    cols["e2el_ms"] = pa.array([float(e2el)] * n)
    if still:
        loaded = False
        cols["kv_bytes_stored"] = pa.array([0] * n, type=t["kv_bytes_stored"].type)
        cols["kv_store_ms"] = pa.array([0.0] * n)
        meta["ops"]["store"].update(bytes=0, accesses=0, gbps=None)
    if not loaded:
        for name in ("kv_bytes_loaded", "kv_bytes_read"):
            cols[name] = pa.array([0] * n, type=t[name].type)
        for name in ("kv_load_ms", "kv_read_ms"):
            cols[name] = pa.array([0.0] * n)
        for op in ("load", "read"):
            meta["ops"][op].update(bytes=0, accesses=0, gbps=None)
    if gbps is not None:
        meta["ops"]["load"]["gbps"] = gbps
    meta["label"] = label
    meta["run_id"] = label
    meta["backend"] = {**meta["backend"], "spec": spec, "requested": spec, "name": spec.partition(":")[0],
                       "mode": KIND_MODE[kind], "virtual": kind == "virtual"}
    upper = any(f in ("host-bound", "floor-limited") for f in flags)
    meta["figures"] = dict.fromkeys(FIGURE_KEYS)
    meta["figures"].update(kind=kind, compute="modelled", flags=list(flags), upper_bound=upper,
                           floor_share=1.0 if "floor-limited" in flags else None,
                           host_bound_share=1.0 if "host-bound" in flags else None,
                           label=kind + (" (upper bound)" if upper else ""))
    meta.pop("repetitions", None)
    if reps:
        meta["repetitions"] = {"n": len(reps), "chosen": 0, "runs": [
            {"median_ttft_ms": r, "mean_tpot_ms": tpot, "median_e2el_ms": e2el} for r in reps]}
    if checksum:
        meta["trace"]["workload"]["checksum"] = checksum
    if policy:
        meta["trace"]["engine"]["tier_policy"] = policy
    table = pa.table(cols).replace_schema_metadata({b"kvemu": json.dumps(meta).encode()})
    pq.write_table(table, path)
    return path


def test_a_clear_win_names_the_metric_the_margin_and_its_spread(base, tmp_path):
    a = make(base, tmp_path / "a.parquet", "dram", "dram", "measured", 100, reps=[95, 100, 105])
    b = make(base, tmp_path / "b.parquet", "numa:1", "numa:1", "measured", 150, reps=[140, 150, 160])
    v = build_report([b, a]).groups[0].verdict
    assert v.winner == "dram" and v.runner_up == "numa:1" and not v.tie
    assert v.basis == "measured" and v.objective == "median TTFT"
    assert v.margin == pytest.approx(1.5)
    assert v.margin_spread == pytest.approx((140 / 105, 160 / 95))
    assert v.sentence.startswith("dram beats numa:1 on median TTFT by 1.50x measured on this host (1.33-1.68x")
    assert ";" not in v.sentence and "because" not in v.sentence  # their KV terms are the same: no reason made up
    first = render_table(build_report([b, a])).splitlines()[0]
    assert "): dram beats numa:1 on" in first  # the verdict is the first line


def test_overlapping_spreads_are_a_tie_not_a_win(base, tmp_path):
    a = make(base, tmp_path / "a.parquet", "dram", "dram", "measured", 100, reps=[90, 100, 120])
    b = make(base, tmp_path / "b.parquet", "numa:0", "numa:0", "measured", 110, reps=[100, 110, 130])
    v = build_report([a, b]).groups[0].verdict
    assert v.tie and v.winner is None and set(v.tied) == {"dram", "numa:0"}
    assert "dram and numa:0 are the same within their spread measured on this host" in v.sentence
    assert "beats" not in render_table(build_report([a, b])).split("\n\n")[0] and "beats" not in v.sentence


def test_a_tie_on_ttft_is_decided_by_tpot(base, tmp_path):
    a = make(base, tmp_path / "a.parquet", "dram", "dram", "measured", 100, tpot=12.0, reps=[90, 100, 120])
    b = make(base, tmp_path / "b.parquet", "numa:0", "numa:0", "measured", 110, tpot=10.0, reps=[100, 110, 130])
    v = build_report([a, b]).groups[0].verdict
    assert v.winner == "numa:0" and v.objective == "mean TPOT" and v.margin == pytest.approx(1.2)
    assert v.sentence.startswith("numa:0 beats dram on mean TPOT by 1.20x")


def test_the_reason_points_the_way_of_the_result_or_is_left_out(base, tmp_path):
    fast = make(base, tmp_path / "a.parquet", "vemu:cxl-pool", "vemu:cxl-pool", "virtual", 50, gbps=24.0)
    slow = make(base, tmp_path / "b.parquet", "vemu:nvme", "vemu:nvme", "virtual", 130, gbps=6.8)
    v = build_report([fast, slow]).groups[0].verdict
    assert "because its KV comes from the tier at 24.0 GB/s against 6.8 GB/s" in v.sentence
    odd = make(base, tmp_path / "c.parquet", "vemu:nvme", "vemu:nvme", "virtual", 130, gbps=90.0)
    v = build_report([fast, odd]).groups[0].verdict  # faster, though its tier loads slower
    assert v.winner == "vemu:cxl-pool" and "because" not in v.sentence


def test_one_repetition_each_says_it_has_no_spread(base, tmp_path):
    a = make(base, tmp_path / "a.parquet", "dram", "dram", "measured", 100)
    b = make(base, tmp_path / "b.parquet", "numa:0", "numa:0", "measured", 109)
    v = build_report([a, b]).groups[0].verdict
    assert v.winner == "dram" and v.margin == pytest.approx(1.09)
    assert "one repetition each: no spread" in v.sentence


def test_an_emulated_run_that_met_its_profile_is_ranked_on_this_host_and_named_so(base, tmp_path):
    a = make(base, tmp_path / "a.parquet", "dram", "dram", "measured", 100)
    b = make(base, tmp_path / "b.parquet", "emu:cxl-pool", "emu:cxl-pool", "emulated", 150)
    v = build_report([a, b]).groups[0].verdict
    assert v.basis == "measured" and v.winner == "dram"
    assert "by 1.50x on this host (measured, and emulated with profiles met)" in v.sentence


def test_floor_limited_runs_are_ranked_on_their_virtual_twins(base, tmp_path):
    """This host made the emulated pool and NVMe the same (300 vs 290 ms, both floor-limited);
    their virtual twins (50 and 130 ms) decide, exactly, and say so."""
    pool = make(base, tmp_path / "p.parquet", "emu:cxl-pool", "emu:cxl-pool", "emulated", 300, flags=["floor-limited"])
    nvme = make(base, tmp_path / "n.parquet", "emu:nvme", "emu:nvme", "emulated", 290, flags=["floor-limited"])
    vpool = make(base, tmp_path / "vp.parquet", "vemu:cxl-pool", "vemu:cxl-pool", "virtual", 50)
    vnvme = make(base, tmp_path / "vn.parquet", "vemu:nvme", "vemu:nvme", "virtual", 130)
    rep = build_report([pool, nvme, vnvme, vpool])
    g = rep.groups[0]
    v = g.verdict
    assert v.basis == "virtual" and v.winner == "emu:cxl-pool" and v.runner_up == "emu:nvme"
    assert v.margin == pytest.approx(130 / 50) and v.margin_spread is None
    assert dict(v.twins) == {"emu:cxl-pool": "vemu:cxl-pool", "emu:nvme": "vemu:nvme"}
    assert [lab for lab, _ in v.ranking] == ["emu:cxl-pool", "emu:nvme"]  # the twins are not ranked again
    assert v.ranking[0][1] == pytest.approx(50)
    assert "in virtual time (exact: no spread)" in v.sentence and "as its virtual twin vemu:cxl-pool" in v.sentence
    # beside: each twin's row follows its run's
    labels = [row.run.label for row in g.rows]
    assert labels.index("vemu:cxl-pool") == labels.index("emu:cxl-pool") + 1
    assert labels.index("vemu:nvme") == labels.index("emu:nvme") + 1
    # instead: --fallback virtual leaves the upper bounds out, the twins in their place
    rep = build_report([pool, nvme, vnvme, vpool], fallback="virtual")
    g = rep.groups[0]
    assert sorted(row.run.label for row in g.rows) == ["vemu:cxl-pool", "vemu:nvme"]
    assert g.replaced == (("emu:cxl-pool", "vemu:cxl-pool"), ("emu:nvme", "vemu:nvme"))
    assert g.verdict.winner == "vemu:cxl-pool" and g.verdict.basis == "virtual"
    assert "emu:nvme is left out for its virtual twin vemu:nvme" in render_table(rep)
    doc = json.loads(render_json(rep))
    assert doc["traces"][g.trace_sha256]["verdict"]["basis"] == "virtual"
    assert doc["traces"][g.trace_sha256]["replaced"][1] == {"label": "emu:nvme", "virtual_twin": "vemu:nvme"}
    with pytest.raises(ConfigError, match="fallback must be one of beside, virtual"):
        build_report([pool], fallback="twin")


def test_mixed_kinds_never_rank_an_upper_bound_or_virtual_against_a_measured_figure(base, tmp_path):
    dram = make(base, tmp_path / "d.parquet", "dram", "dram", "measured", 40)
    pool = make(base, tmp_path / "p.parquet", "emu:cxl-pool", "emu:cxl-pool", "emulated", 300, flags=["floor-limited"])
    vpool = make(base, tmp_path / "vp.parquet", "vemu:cxl-pool", "vemu:cxl-pool", "virtual", 50)
    vnvme = make(base, tmp_path / "vn.parquet", "vemu:nvme", "vemu:nvme", "virtual", 130)
    v = build_report([dram, pool, vpool, vnvme]).groups[0].verdict
    # dram has a real figure, the pool only a virtual one: virtual runs ranked, dram set apart
    assert v.basis == "virtual" and [lab for lab, _ in v.ranking] == ["emu:cxl-pool", "vemu:nvme"]
    assert [r.basis for r in v.rankings] == ["virtual"]
    assert dict(v.unranked)["dram"].startswith("the only run with a measured figure")
    # an upper bound without a twin is not ranked at all; the measured runs are ranked together
    numa = make(base, tmp_path / "n.parquet", "numa:1", "numa:1", "measured", 60)
    v = build_report([dram, numa, pool]).groups[0].verdict
    assert v.basis == "measured" and [lab for lab, _ in v.ranking] == ["dram", "numa:1"]
    assert "replay its trace on vemu:cxl-pool" in dict(v.unranked)["emu:cxl-pool"]
    # a host-bound measured run with its twin given: all three have virtual figures, ranked on them
    hb = make(base, tmp_path / "hb.parquet", "dram", "dram", "measured", 40, flags=["host-bound"])
    vl = make(base, tmp_path / "vl.parquet", "vemu:local-dram", "vemu:local-dram", "virtual", 45)
    v = build_report([hb, vl, pool, vpool, vnvme]).groups[0].verdict
    assert v.basis == "virtual" and [lab for lab, _ in v.ranking] == ["dram", "emu:cxl-pool", "vemu:nvme"]
    assert v.margin == pytest.approx(50 / 45)
    assert ("the order in virtual time: dram, then emu:cxl-pool (1.11x on median TTFT), then vemu:nvme "
            "(2.60x on median TTFT)") in v.parts


def test_a_run_that_moved_no_kv_is_ranked_with_the_virtual_runs(base, tmp_path):
    """HBM alone (policy none: nothing stored, nothing loaded) has the same figures in every kind:
    it is ranked with the tiers' virtual twins rather than set apart as the one measured run."""
    hbm = make(base, tmp_path / "h.parquet", "dram/none", "dram", "measured", 80, still=True, policy="none")
    pool = make(base, tmp_path / "p.parquet", "emu:cxl-pool", "emu:cxl-pool", "emulated", 300, flags=["floor-limited"])
    vpool = make(base, tmp_path / "vp.parquet", "vemu:cxl-pool", "vemu:cxl-pool", "virtual", 50)
    vnvme = make(base, tmp_path / "vn.parquet", "vemu:nvme", "vemu:nvme", "virtual", 130)
    v = build_report([hbm, pool, vpool, vnvme]).groups[0].verdict
    assert v.basis == "virtual" and v.unranked == ()
    assert [lab for lab, _ in v.ranking] == ["emu:cxl-pool", "dram/none", "vemu:nvme"]


def test_different_workloads_are_never_ranked_against_each_other(base, tmp_path):
    a = make(base, tmp_path / "a.parquet", "dram", "dram", "measured", 100)
    b = make(base, tmp_path / "b.parquet", "fast", "dram", "measured", 10, checksum="sha256:other")
    rep = build_report([a, b])
    assert len(rep.groups) == 2
    for g in rep.groups:
        assert len(g.verdict.ranking) == 1 and "beats" not in g.verdict.sentence
    assert "2 workloads: each is ranked on its own" in render_table(rep)


def test_no_kv_moved_names_no_winner(base, tmp_path):
    a = make(base, tmp_path / "a.parquet", "dram", "dram", "measured", 27.6, loaded=False)
    b = make(base, tmp_path / "b.parquet", "emu:cxl-pool", "emu:cxl-pool", "emulated", 27.0, loaded=False)
    v = build_report([a, b]).groups[0].verdict
    assert v.winner is None and not v.moved_kv
    assert v.sentence.startswith("no run loaded KV from its tier: the tiers cannot differ")
    assert "beats" not in render_table(build_report([a, b])).split("\n\n")[0]


def test_rank_limits_the_verdict_to_the_runs_asked_for(base, tmp_path):
    a = make(base, tmp_path / "a.parquet", "dram", "dram", "measured", 100)
    b = make(base, tmp_path / "b.parquet", "numa:0", "numa:0", "measured", 150)
    c = make(base, tmp_path / "c.parquet", "overlap", "dram", "measured", 50)
    v = build_report([a, b, c], rank=["dram", "numa:0"]).groups[0].verdict
    assert [lab for lab, _ in v.ranking] == ["dram", "numa:0"] and v.winner == "dram"
    other = make(base, tmp_path / "o.parquet", "elsewhere", "dram", "measured", 10, checksum="sha256:other")
    rep = build_report([a, b, other], rank=["dram", "numa:0"])  # a workload none of whose runs is asked for
    v = next(g.verdict for g in rep.groups if g.rows[0].run.label == "elsewhere")
    assert v.winner is None and v.ranking == () and v.sentence.startswith("not ranked: none of this workload's")
    with pytest.raises(ConfigError, match="rank: no run is labelled 'nope'"):
        build_report([a, b], rank=["nope"])


def test_goodput_decides_under_an_slo(base, tmp_path):
    # TTFT 100 ms meets ttft=150; 200 ms does not: goodput > 0 against 0
    a = make(base, tmp_path / "a.parquet", "dram", "dram", "measured", 200)
    b = make(base, tmp_path / "b.parquet", "numa:0", "numa:0", "measured", 100)
    v = build_report([a, b], slo="ttft=150,tpot=1000").groups[0].verdict
    assert v.objective == "goodput" and v.winner == "numa:0"
    assert v.sentence.startswith("numa:0 beats dram on goodput")


def test_the_documented_defaults_and_thresholds_are_the_code_s():
    from pathlib import Path

    from kvemu import figures
    from kvemu.cli import cli
    from kvemu.report import FALLBACKS
    from kvemu.report.verdict import SAME_WITHIN

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "report.md").read_text().split())
    option = next(p for p in cli.commands["report"].params if p.name == "fallback")
    assert f"`--fallback {option.default}` (the default)" in text and option.default == FALLBACKS[0]
    assert f"`host-bound` ({100 * figures.HOST_BOUND_SHARE:g} % or more" in text
    assert f"`floor-limited` ({100 * figures.FLOOR_LIMITED_SHARE:g} % or more" in text
    assert f"within {100 * SAME_WITHIN:g} % of each other" in text


def test_the_cli_takes_fallback_and_rank_and_refuses_an_unknown_label(base, tmp_path):
    from click.testing import CliRunner

    from kvemu.cli import cli

    pool = make(base, tmp_path / "p.parquet", "emu:cxl-pool", "emu:cxl-pool", "emulated", 300, flags=["floor-limited"])
    vpool = make(base, tmp_path / "vp.parquet", "vemu:cxl-pool", "vemu:cxl-pool", "virtual", 50)
    vnvme = make(base, tmp_path / "vn.parquet", "vemu:nvme", "vemu:nvme", "virtual", 130)
    res = CliRunner().invoke(cli, ["report", str(pool), str(vpool), str(vnvme), "--fallback", "virtual"])
    assert res.exit_code == 0, res.output
    assert "vemu:cxl-pool beats vemu:nvme on median TTFT by 2.60x in virtual time" in " ".join(res.output.split())
    assert "emu:cxl-pool is left out for its virtual twin vemu:cxl-pool" in " ".join(res.output.split())
    res = CliRunner().invoke(cli, ["report", str(vpool), str(vnvme), "--rank", "vemu:nvme,nope"])
    assert res.exit_code == 2 and "rank: no run is labelled 'nope'" in res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_report_help_gives_the_install_hint_that_works_from_a_checkout():
    from click.testing import CliRunner

    from kvemu import plots
    from kvemu.cli import cli

    text = " ".join(CliRunner().invoke(cli, ["report", "-h"]).output.split())
    assert plots.INSTALL_HINT == "pip install '.[plot]'" and plots.INSTALL_HINT in text
    assert "kvemu[plot]" not in text
    assert "--fallback [beside|virtual]" in text and "--rank LABEL,..." in text
