"""Tier stacks in the report (kvemu/report: stack_record, the stack table, the verdict's cheapest
stack under an SLO) and the HTML page's plots of a swept level. Each level's row is checked against
a stack hand-traced in the test (tests/replay/test_tier_stack.py's two-level write-back case) and a cost
computed by hand from a made-up price table; the verdict against hand-built results files whose
figures and costs are written here."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvemu.report import build_report, render_json, render_table

import test_cost  # its made-up price table

MIB = 1 << 20
YEAR_S = 365.25 * 86400
DOCS = {"A": [1, 2], "B": [3, 4], "C": [5, 6], "D": [7, 8]}
ORDER = "ABACADBC"

#: the GPU and the CXL pool of test_cost's table, and NVMe
PRICES = test_cost.PRICES + test_cost.NVME_PRICES


@pytest.fixture(scope="module")
def docs_trace(tmp_path_factory):
    """Eight requests one at a time, each a 128-token document of 8 blocks and one token of its own;
    HBM holds one request, so every request finds only what the stack holds (test_tier_stack)."""
    from conftest import make_workload, record

    w = make_workload([1000.0 * i for i in range(len(ORDER))], [129] * len(ORDER), [1] * len(ORDER),
                      [DOCS[c] + [100 + i] for i, c in enumerate(ORDER)], hash_block_tokens=64)
    return record(w, tmp_path_factory.mktemp("stackrep") / "t.parquet", hbm_kv_blocks=9)


def _stack_run(trace, out, tiers, prices=None, label=None):
    from kvemu.replay import (CostOptions, DataPathOptions, OutputOptions, ReplayOptions, TierOptions,
                              WindowOptions, replay)
    from kvemu.replay.stack import parse_tiers

    spec = parse_tiers(tiers)
    opts = ReplayOptions(window=WindowOptions(layers=2), datapath=DataPathOptions(chunk_tokens=16),
                         tier=TierOptions(stack=spec), output=OutputOptions(label=label),
                         cost=CostOptions(prices=str(prices) if prices else None))
    replay(trace, spec.levels[0].backend, opts, out=out)
    return out


@pytest.fixture(scope="module")
def stack_run(docs_trace, tmp_path_factory):
    d = tmp_path_factory.mktemp("stackrep-runs")
    (d / "p.toml").write_text(PRICES)
    return _stack_run(docs_trace, d / "s.parquet", "vemu:cxl-pool|cap=16MiB;vemu:nvme|cap=32MiB", d / "p.toml")


def test_each_level_row_shows_what_it_served_moved_took_and_cost(stack_run):
    # test_tier_stack's hand trace (LRU): L2 serves requests 2, 4 and 7 (128 tokens each, 8 blocks of 2 MiB);
    # L1 has every computed document written into it (5 of 8 blocks), L2 the 4 demoted ones
    meta = json.loads(pq.read_schema(stack_run).metadata[b"kvemu"])
    run = build_report([stack_run], recorded_traces=False)
    record = json.loads(render_json(run))["runs"][0]["stack"]
    l1, l2 = record["levels"]
    assert (l1["served_tokens"], l2["served_tokens"]) == (0, 384) and l2["hit_share"] == 1.0
    assert l2["bytes_loaded"] == 24 * 2 * MIB and l1["bytes_written"] == 5 * 8 * 2 * MIB
    assert l2["bytes_written"] == 4 * 8 * 2 * MIB
    assert (l1["capacity_bytes"], l2["capacity_bytes"]) == (16 * MIB, 32 * MIB)
    assert l1["policy"] == l2["policy"] == "lru" and l2["bound"] == "medium"   # nvme's medium under PCIe 5
    assert l1["bound"] in ("link", "medium") and l2["time_ms"] > 0
    # each level's capacity cost, by hand: GB x $/GB x duration / 3 years, per million output tokens
    d = meta["duration_s"]
    out_tokens = 8   # one output token per request
    for lv, mib, usd_per_gb, w_per_gb, medium in ((l1, 16, 10.0, 0.5, "cxl"), (l2, 32, 0.1, 0.01, "nvme")):
        usd = mib * MIB / 1e9 * usd_per_gb * d / (3 * YEAR_S)
        assert lv["usd"] == pytest.approx(usd, rel=1e-9) and lv["priced_as"] == medium
        assert lv["usd_per_million_output_tokens"] == pytest.approx(usd * 1e6 / out_tokens, rel=1e-9)
        assert lv["joules"] == pytest.approx(mib * MIB / 1e9 * w_per_gb * d, rel=1e-9)
    import csv
    import io

    from kvemu.report import render_csv

    (row,) = csv.DictReader(io.StringIO(render_csv(run)))
    assert row["stack_L2_served_tokens"] == "384" and row["stack_L2_backend"] == "vemu:nvme"
    assert float(row["stack_L1_usd"]) == pytest.approx(l1["usd"]) and "stack_levels" not in row
    text = render_table(run)
    head = next(line for line in text.splitlines() if line.startswith("run") and "bound" in line)
    assert "$/M out" in head and " tokens " in head
    rows = text.splitlines()[text.splitlines().index(head) + 1:][:2]
    assert rows[1].split()[-1] == f"{l2['usd_per_million_output_tokens']:.4f}" and " medium " in rows[1]


def _variant(base, path, label, ttft, usd, *, kind="virtual", p99_reps=None, capacity=None):
    """``base`` (a stack run's results) with every request's TTFT ``ttft`` ms (TPOT 10, E2EL 500),
    label ``label``, $ per million output tokens ``usd``, figures of ``kind``; ``p99_reps``, the p99
    TTFT of each repetition (p99 TPOT 10 in each); ``capacity``, level 2's capacity."""
    from kvemu.figures import FIGURE_KEYS

    t = pq.read_table(base)
    meta = json.loads(t.schema.metadata[b"kvemu"])
    n = t.num_rows
    cols = {name: t[name] for name in t.column_names}
    cols.update(ttft_ms=pa.array([float(ttft)] * n), tpot_ms=pa.array([10.0] * n), e2el_ms=pa.array([500.0] * n))
    meta.update(label=label, run_id=label)
    meta["cost"]["usd_per_million_output_tokens"] = usd
    meta["figures"] = {**dict.fromkeys(FIGURE_KEYS), "kind": kind, "compute": "modelled", "flags": [],
                       "upper_bound": False, "label": kind}
    if kind == "measured":
        meta["backend"] = {**meta["backend"], "mode": "measured", "virtual": False}
    if p99_reps:
        meta["repetitions"] = {"n": len(p99_reps), "chosen": 0, "runs": [
            {"median_ttft_ms": ttft, "p99_ttft_ms": p, "mean_tpot_ms": 10.0, "p99_tpot_ms": 10.0,
             "median_e2el_ms": 500.0} for p in p99_reps]}
    if capacity is not None:
        meta["schedule"]["stack"]["levels"][1]["capacity_bytes"] = capacity
    pq.write_table(pa.table(cols).replace_schema_metadata({b"kvemu": json.dumps(meta).encode()}), path)
    return path


def test_the_verdict_names_the_cheapest_stack_that_meets_the_slo(stack_run, tmp_path):
    # DRAM + NVMe misses a 150 ms p99 TTFT (300 ms); both pooled stacks meet it; the 2 TiB pool is cheaper
    a = _variant(stack_run, tmp_path / "a.parquet", "dram 256 GiB + nvme 8 TiB", 300, 2.0)
    b = _variant(stack_run, tmp_path / "b.parquet", "dram 256 GiB + pool 2 TiB + nvme 8 TiB", 100, 2.5)
    c = _variant(stack_run, tmp_path / "c.parquet", "dram 256 GiB + pool 8 TiB + nvme 8 TiB", 90, 4.0)
    rep = build_report([a, b, c], slo="ttft=150,tpot=1000", recorded_traces=False)
    ch = rep.groups[0].verdict.cheapest
    assert ch.label == "dram 256 GiB + pool 2 TiB + nvme 8 TiB" and ch.usd_per_million_output_tokens == 2.5
    assert ch.headroom == pytest.approx(1.5) and ch.exact and ch.headroom_spread is None   # 150 / 100 ms
    assert ch.next == "dram 256 GiB + pool 8 TiB + nvme 8 TiB" and ch.cost_margin == pytest.approx(1.6)
    assert ch.missing == ("dram 256 GiB + nvme 8 TiB",) and ch.stacks
    text = " ".join(render_table(rep).split())
    assert ("the cheapest stack that meets the SLO ttft=150,tpot=1000 at p99 in virtual time is dram 256 GiB + "
            "pool 2 TiB + nvme 8 TiB at $2.500 per million output tokens (modelled), with 1.50x headroom") in text
    j = next(iter(json.loads(render_json(rep))["traces"].values()))["verdict"]["cheapest_meeting_slo"]
    assert j["label"] == ch.label and j["headroom"] == pytest.approx(1.5) and j["missing"] == list(ch.missing)
    # a tighter SLO that none meets: the closest is named, no cheapest
    none = build_report([a, b, c], slo="ttft=50,tpot=1000", recorded_traces=False).groups[0].verdict.cheapest
    assert none.label is None and none.closest == "dram 256 GiB + pool 8 TiB + nvme 8 TiB"
    assert none.closest_headroom == pytest.approx(50 / 90)
    # no SLO: nothing to meet
    assert build_report([a, b], recorded_traces=False).groups[0].verdict.cheapest is None


def test_measured_stacks_give_the_headroom_its_spread_over_the_repetitions(stack_run, tmp_path):
    a = _variant(stack_run, tmp_path / "a.parquet", "pool", 100, 3.0, kind="measured", p99_reps=[90, 100, 120])
    b = _variant(stack_run, tmp_path / "b.parquet", "nvme", 140, 2.0, kind="measured", p99_reps=[130, 140, 160])
    ch = build_report([a, b], slo="ttft=150,tpot=1000", recorded_traces=False).groups[0].verdict.cheapest
    # both meet 150 ms at their chosen figures; the cheaper is nvme, headroom 150/140, 150/160-150/130 over reps
    assert ch.label == "nvme" and ch.headroom == pytest.approx(150 / 140) and not ch.exact
    assert ch.headroom_spread == pytest.approx((150 / 160, 150 / 130))
    sentence = next(p for p in build_report([a, b], slo="ttft=150,tpot=1000",
                                            recorded_traces=False).groups[0].verdict.parts if "cheapest" in p)
    assert "(0.94-1.15x over the repetitions, below 1 in some: not in every one)" in sentence
    assert "the next, pool, costs 1.500x as much" in sentence


def test_stack_runs_differing_in_one_level_s_capacity_are_a_sweep_plotted_in_html(docs_trace, stack_run, tmp_path):
    # stack_run is L1 16 MiB + L2 32 MiB; add L2 16 MiB (a sweep of L2) and L1 32 MiB + L2 16 MiB (with the
    # L2 16 MiB run, a sweep of L1). By hand, L1 and L2 16 MiB (one document each), write-back LRU:
    #   A miss; B miss (A down); A from L2; C miss (B down, L2 drops A); A miss; D miss; B miss; C miss
    # so L2 serves request 2 alone (128 of 8 x 129 prompt tokens); at 32 MiB it serves 2, 4 and 7 (384)
    from kvemu import plots
    from kvemu.report import html_page, stack_sweeps

    small = _stack_run(docs_trace, tmp_path / "l2-16.parquet", "vemu:cxl-pool|cap=16MiB;vemu:nvme|cap=16MiB")
    top = _stack_run(docs_trace, tmp_path / "l1-32.parquet", "vemu:cxl-pool|cap=32MiB;vemu:nvme|cap=16MiB")
    rep = build_report([stack_run, small, top], recorded_traces=False)
    sweeps = {sw.level: sw for sw in stack_sweeps(rep.groups[0])}
    assert sorted(sweeps) == [1, 2]
    l2 = sweeps[2]
    assert l2.capacity_bytes == (16 * MIB, 32 * MIB) and l2.backend == "vemu:nvme" and l2.kind == "virtual"
    assert l2.fixed == "L1 vemu:cxl-pool 16.0 MiB"
    assert [s[1] for s in l2.level_shares] == pytest.approx([128 / 1032, 384 / 1032])
    assert [s[0] for s in l2.level_shares] == [0, 0] and l2.hbm_share == (0, 0)
    assert l2.recomputed_share == pytest.approx((904 / 1032, 648 / 1032))
    assert l2.labels[1] == json.loads(pq.read_schema(stack_run).metadata[b"kvemu"])["label"]
    assert all(v is not None and v > 0 for v in l2.usd_per_million_output_tokens)
    assert sweeps[1].capacity_bytes == (16 * MIB, 32 * MIB) and sweeps[1].fixed == "L2 vemu:nvme 16.0 MiB"
    j = next(iter(json.loads(render_json(rep))["traces"].values()))["stack_sweeps"]
    assert [s["level"] for s in j] == [sw.level for sw in stack_sweeps(rep.groups[0])]
    if plots.unavailable_reason() is None:
        page = html_page(rep)
        assert page.count('alt="Share of prompt tokens per stack level') == 2
    # a run of one tier, or stacks differing in two capacities, make no sweep
    assert stack_sweeps(build_report([stack_run, top], recorded_traces=False).groups[0]) == ()


def test_analyze_capacity_sweep_writes_a_page_per_policy_and_refuses_what_it_must(tmp_path):
    import re
    from pathlib import Path

    from click.testing import CliRunner

    from kvemu import plots
    from kvemu.cli import cli

    trace = Path(__file__).resolve().parents[2] / "traces" / "chat-llama3-8b-offload.parquet"
    args = ["analyze", "capacity", str(trace), "--stack", "local-dram=1GiB,cxl-pool=0,nvme=16GiB",
            "--sweep", "cxl-pool=0,1GiB,4GiB", "--policies", "lru,optimal", "--placement", "inclusive"]
    page = tmp_path / "sweep.html"
    r = CliRunner().invoke(cli, [*args, "--json", "--html", str(page)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    html = page.read_text()
    rows = re.findall(r"<tr><td>([^<]*)</td><td>([^<]*)</td><td class=\"num\">([^<]*)</td>"
                      r"<td class=\"num\">([^<]*)</td><td class=\"num\">([^<]*)</td><td class=\"num\">([^<]*)</td>",
                      html)
    # one row per (capacity, policy), in the order analysed, with its shares as --json gives them
    assert [(c, p) for c, p, *_ in rows] == [(c, p) for c in ("0 B", "1.0 GiB", "4.0 GiB") for p in ("lru", "optimal")]
    for row, point in zip(rows, doc["points"]):
        assert row[3:] == tuple(f"{lv['hit_share']:.3f}" for lv in point["levels"])
    if plots.unavailable_reason() is None:
        assert html.count("<img src=\"data:image/png;base64,") == 2   # a figure per policy
    assert 'http-equiv="Content-Security-Policy" content="default-src &#x27;none&#x27;' in html
    for extra, why in ((["--html", str(page)], "already exists"), (["--html", str(trace), "--force"], "inputs")):
        r = CliRunner().invoke(cli, [*args, *extra])
        assert r.exit_code == 2 and why in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(trace), "--html", str(tmp_path / "x.html")])
    assert r.exit_code == 2 and "--html draws a sweep" in r.output and not (tmp_path / "x.html").exists()


def test_a_stack_run_is_no_virtual_twin_of_a_single_tier(stack_run, docs_trace, tmp_path):
    # the stack's backend spec is its top level's, vemu:cxl-pool: the twin a measured mmap of a DAX
    # device would take; a stack stands for more than that level, so it is never taken for it
    from kvemu.report import virtual_twins

    single = _variant(stack_run, tmp_path / "m.parquet", "dax", 100, 1.0, kind="measured")
    t = pq.read_table(single)
    meta = json.loads(t.schema.metadata[b"kvemu"])
    del meta["schedule"]["stack"]
    meta["backend"] = {**meta["backend"], "spec": "mmap:/dev/dax0.0", "name": "mmap"}
    pq.write_table(t.replace_schema_metadata({b"kvemu": json.dumps(meta).encode()}), single)
    rep = build_report([single, stack_run], recorded_traces=False)
    assert virtual_twins(rep.groups[0].rows) == {}
