"""kvemu plan: the frontier and selection rules against hand-computed answers, the capacity read off
a hand-built curve, an end-to-end plan on a shipped trace whose frontier was replayed, bad input."""

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.plan import (Target, capacity_for_share, cheapest_meeting, pareto_frontier, parse_level, parse_slo,
                        slo_ratio)

CHAT = Path(__file__).resolve().parents[1] / "traces" / "chat-llama3-8b-offload.parquet"


def test_three_point_frontier_by_hand():
    # five configurations: (cost $/M, SLO ratio). By hand: sorted by cost, a point is on the frontier
    # when its ratio is below every cheaper point's: #1 (1.0, 2.0) yes; #2 (2.0, 1.0) yes; #3 (2.5,
    # 1.2) no (#2 is cheaper and better); #0 (3.0, 0.5) yes; #4 (4.0, 0.5) no (#0 equal and cheaper).
    costs = [3.0, 1.0, 2.0, 2.5, 4.0]
    ratios = [0.5, 2.0, 1.0, 1.2, 0.5]
    assert pareto_frontier(costs, ratios) == [1, 2, 0]
    # the cheapest meeting the SLO (ratio <= 1): #2 at 2.0 (its ratio exactly 1 meets it)
    assert cheapest_meeting(costs, ratios) == 2
    # only among #0, #3, #4: #0
    assert cheapest_meeting(costs, ratios, among=[0, 3, 4]) == 0
    assert cheapest_meeting(costs, [1.5] * 5) is None
    # a point without a figure is never on the frontier; equal points: the first
    assert pareto_frontier([1.0, None, 1.0], [1.0, 0.1, 1.0]) == [0]


def test_slo_ratio_by_hand():
    targets = parse_slo("ttft_p90=2s,tpot_p50=50ms")
    assert targets == (Target("ttft", 90, 2000.0), Target("tpot", 50, 50.0))
    figs = {"ttft": {"p90": 1500.0}, "tpot": {"p50": 60.0}}
    assert slo_ratio(figs, targets) == pytest.approx(1.2)  # max(1500/2000, 60/50)
    assert slo_ratio({"ttft": {"p90": 1500.0}, "tpot": {}}, targets) is None


def test_capacity_for_share_off_a_hand_built_curve():
    caps = [1, 2, 4, 8, 16, 32]
    ratio = [0.10, 0.30, 0.50, 0.57, 0.595, 0.60]
    # unbounded 0.6: 95 % = 0.57, first reached at 8; 99 % = 0.594, first reached at 16
    assert capacity_for_share(caps, ratio, 0.6, 0.95) == 8
    assert capacity_for_share(caps, ratio, 0.6, 0.99) == 16
    assert capacity_for_share(caps, [0.1] * 6, 0.6, 0.95) is None
    assert capacity_for_share(caps, ratio, 0.0, 0.95) is None


def test_parse_level():
    lv = parse_level("cxl-pool=0,1GiB,2GiB")
    assert lv.profile == "cxl-pool" and lv.capacities == (0, 1 << 30, 2 << 30)


def test_plan_end_to_end_on_a_shipped_trace(tmp_path):
    r = CliRunner()
    args = ["plan", str(CHAT), "--slo", "ttft_p90=100ms,tpot_p50=50ms", "--level", "local-dram=0,512MiB",
            "--level", "cxl-pool=0,2GiB,4GiB", "--policies", "lru,s3fifo", "--replay-requests", "48"]
    res = r.invoke(cli, args + ["--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["candidates"] == 2 * 3 * 2 - 1  # the empty stack once
    pts = doc["points"]
    # the frontier, recomputed here by brute force from the analysed figures: a point is on it iff
    # no other is at least as cheap and as good and better on one
    an = [(p["analysed"]["usd_per_million_output_tokens"], p["analysed"]["slo_ratio"]) for p in pts]
    brute = {i for i, (c, q) in enumerate(an)
             if not any((c2 <= c and q2 <= q and (c2 < c or q2 < q)) for c2, q2 in an)}
    assert set(doc["frontier"]) <= brute and {an[i] for i in brute} == {an[i] for i in doc["frontier"]}
    assert doc["replayed"] and set(doc["replayed"]) <= set(doc["frontier"]) | {doc["analysis_pick"]}
    for i in doc["replayed"]:
        rep = pts[i]["replayed"]
        # a window shorter than the trace: its first half warms the levels and has no rows
        assert doc["replay"]["counted_from"] == 24 and rep["requests"] == 24 and rep["ttft"]["p90"] > 0 and rep["usd_per_million_output_tokens"] > 0
        want = max(rep["ttft"]["p90"] / 100.0, rep["tpot"]["p50"] / 50.0)
        assert rep["slo_ratio"] == pytest.approx(want)
    a = doc["answer"]
    assert a is not None and a["by"] == "replay" and a["slo_ratio"] <= 1 and a["margin"] == pytest.approx(1 - a["slo_ratio"])
    ok = [pts[i]["replayed"]["usd_per_million_output_tokens"] for i in doc["replayed"]
          if pts[i]["replayed"]["slo_ratio"] <= 1]
    assert a["usd_per_million_output_tokens"] == min(ok)
    # the text form: the answer first, then the frontier with both figures
    res = r.invoke(cli, args + ["--replay", "1", "--html", str(tmp_path / "plan.html")])
    assert res.exit_code == 0, res.output
    first = res.stdout.splitlines()[0]
    assert first.startswith("cheapest stack meeting TTFT p90 <= 100 ms")
    assert "ttft_p90 an ttft_p90 rep" in res.stdout
    assert (tmp_path / "plan.html").read_text().startswith("<!DOCTYPE html>")


def test_analysed_point_is_analyze_capacity_stacks():
    """One rule: a plan's analysed figure for a stack is what analyze capacity --stack prints for it."""
    r = CliRunner()
    res = r.invoke(cli, ["plan", str(CHAT), "--slo", "ttft_p50=1s", "--level", "cxl-pool=2GiB", "--level",
                         "nvme=16GiB", "--replay", "0", "--json"])
    assert res.exit_code == 0, res.output
    p = json.loads(res.stdout)["points"][0]
    res = r.invoke(cli, ["analyze", "capacity", str(CHAT), "--stack", "cxl-pool=2GiB,nvme=16GiB", "--placement",
                         "inclusive", "--json"])
    assert res.exit_code == 0, res.output
    q = json.loads(res.stdout)["points"][0]
    assert p["analysed"]["usd_per_million_output_tokens"] == pytest.approx(q["cost"]["usd_per_million_output_tokens"])
    assert p["analysed"]["level_shares"] == pytest.approx([lv["hit_share"] for lv in q["levels"]])
    assert p["analysed"]["ttft_ms"]["p50"] == pytest.approx(q["ttft_ms"]["p50"])
    assert not math.isnan(p["analysed"]["slo_ratio"])


@pytest.mark.parametrize("extra,message", [
    (["--slo", "ttft_p95=2s"], "METRIC_pPCT"),
    (["--slo", "ttft_p90=2"], "needs a unit"),
    (["--level", "nope=1GiB"], "unknown tier profile"),
    (["--level", "cxl-pool=1GiB,1GiB"], "twice"),
    (["--policies", "optimal"], "cannot be replayed"),
    (["--placement", "inclusive"], "cannot be replayed"),
    (["--replay-requests", "0"], "--replay-requests"),
    (["--executor", "dask://10.0.0.1"], "no port"),
])
def test_bad_input_one_line_exit_2(extra, message, tmp_path):
    args = ["plan", str(CHAT), "--slo", "ttft_p90=2s", "--level", "cxl-pool=0,1GiB"]
    # later options of the same name win in click: put the bad one last
    res = CliRunner().invoke(cli, args + extra)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_missing_trace_one_line_exit_2():
    res = CliRunner().invoke(cli, ["plan", "nope.parquet", "--slo", "ttft_p90=2s", "--level", "cxl-pool=1GiB"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1


def test_a_resident_trace_is_refused_by_plan_and_by_a_stack_replay(tmp_path):
    """A resident trace keeps its KV in one tier: no stack of levels to search or replay (the
    replay raised a TypeError from deep in the scheduler before)."""
    resident = CHAT.with_name("chat-llama3-8b-resident.parquet")
    res = CliRunner().invoke(cli, ["plan", str(resident), "--slo", "ttft_p90=2s", "--level", "cxl-pool=0,1GiB"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "plan searches stacks of levels under an offload trace" in res.output
    out = tmp_path / "r.parquet"
    res = CliRunner().invoke(cli, ["replay", str(resident), "--tiers", "vemu:cxl-pool|cap=2GiB", "--layers", "1",
                                   "--out", str(out)])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "--tiers replays a stack of levels under an offload trace" in res.output and not out.exists()


def test_the_docs_defaults_are_the_codes():
    import re

    from kvemu.cli import cli as group

    text = (Path(__file__).resolve().parents[1] / "docs" / "analysis.md").read_text()
    table = dict(re.findall(r"^\| `(--[\w-]+)` \| ([\w-]+) \|$", text.split("## Planner", 1)[1].split("\n## ", 1)[0],
                            re.M))
    params = {p.opts[0]: p.default for p in group.commands["plan"].params if p.opts}
    assert table and all(str(params[k]) == v for k, v in table.items()), (table, params)
    # and the command's defaults are the library's
    from kvemu.plan import PlanOptions

    o = PlanOptions()
    assert (",".join(o.policies), o.placement, o.analysis_placement, o.replay_max, o.replay_requests,
            o.replay_layers, o.instances, o.executor) == (
        params["--policies"], params["--placement"], params["--analysis-placement"], params["--replay"],
        params["--replay-requests"], params["--replay-layers"], params["--instances"], params["--executor"])
    assert o.shared == (params["--sharing"] == "shared")


def test_a_candidate_that_cannot_be_built_is_left_out_unless_kept():
    from kvemu.prices import load_prices

    dev = load_prices(None).medium_of("local-dram").device
    # one host attaches per_host devices of capacity_bytes: 64 TiB of DRAM is beyond that, 1 GiB is not
    assert dev.per_host * dev.capacity_bytes < 64 << 40
    args = ["plan", str(CHAT), "--slo", "ttft_p90=1s", "--level", "local-dram=1GiB,64TiB", "--replay", "0", "--json"]
    doc = json.loads(CliRunner().invoke(cli, args).stdout)
    big = next(p for p in doc["points"] if p["capacities_bytes"] == [64 << 40])
    small = next(p for p in doc["points"] if p["capacities_bytes"] == [1 << 30])
    assert doc["not_buildable"] == 1 and not big["feasible"] and "analysed" not in big
    assert "not buildable" in big["infeasible_because"] and small["feasible"] and "analysed" in small
    assert doc["points"].index(big) not in doc["frontier"]
    doc = json.loads(CliRunner().invoke(cli, args + ["--keep-infeasible"]).stdout)
    big = next(p for p in doc["points"] if p["capacities_bytes"] == [64 << 40])
    assert not big["feasible"] and big["analysed"]["usd_per_million_output_tokens"] > 0
