"""kvemu plan's per-level capacities, goodput SLO, option table and record-first input, each against
an oracle written here: counts made by hand on a twelve-request trace, a hand count of requests
meeting their targets, the command line against the table."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvemu.cli import cli

CHAT = Path(__file__).resolve().parents[1] / "traces" / "chat-llama3-8b-offload.parquet"

MIB = 1 << 20
DOC = 8  # blocks of a document (128 tokens, 16-token blocks, 2 MiB a block for llama3-8b)
DOCS = {c: [2 * i + 1, 2 * i + 2] for i, c in enumerate("ABCDE")}
ORDER = "ABACBDAEBCED"


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """Twelve requests one second apart, each a 128-token document of five and one token of its own,
    HBM holding one request: every reuse comes from the levels (tests/test_stack_rules.py's trace)."""
    from conftest import make_workload, record

    w = make_workload([1000.0 * i for i in range(len(ORDER))], [129] * len(ORDER), [1] * len(ORDER),
                      [DOCS[c] + [100 + i] for i, c in enumerate(ORDER)], hash_block_tokens=64)
    return record(w, tmp_path_factory.mktemp("plan") / "t.parquet", hbm_kv_blocks=9)


# ----------------------------------------------------------------------- per-level 95 % / 99 % capacity
# By hand, ORDER = A B A C B D A E B C E D. A reuse's LRU distance in documents (other documents
# since the last use): 3 A 1, 5 B 2, 7 A 3, 9 B 3, 10 C 4, 11 E 2, 12 D 4. Every block of a
# document has the same block distance (8 x docs + 7), so an LRU level of C blocks holds a reuse of
# distance d iff C >= 8 (d + 1): the level's served documents are a step function of C.
#   one level alone (inclusive): C < 16: 0; 16..23: 1 (req 3); 24..31: 3 (+5, 11); 32..39: 5 (+7, 9);
#     >= 40: 7 (+10, 12), all it can serve.
#   below a level of 2 documents (32 MiB), inclusive: that level serves req 3 first, so the lower level
#     serves the same steps less one: 24..31: 2, 32..39: 4, >= 40: 6.
#   below the same level, write-back (the lower level gets what the upper evicts; tests/test_stack_rules
#     counts the run): 1 document (8 blocks): 5 B, 7 A, 11 E = 3; 2 documents or more: 5, 7, 10, 12 = 4.
def _levels(*names):
    from kvemu.plan import LevelChoice

    return [LevelChoice(n, (0,)) for n in names]


def _analysis(trace):
    from kvemu.capacity import StackAnalysis
    from kvemu.schema import read_trace

    return StackAnalysis(read_trace(trace))


def test_one_level_alone_by_hand(trace):
    from kvemu.plan import level_saturation

    (row,) = level_saturation(_analysis(trace), _levels("cxl-pool"), (0,), "lru", "inclusive",
                              shares=(0.95, 0.99, 0.5, 0.4, 0.1))
    assert row["reachable_tokens"] == 7 * 128 and row["reachable_share"] == pytest.approx(7 * 128 / (12 * 129))
    # 95 % and 99 % of 7 documents: all 7 (40 blocks); 50 %: 3.5 -> 5 (32 blocks); 40 %: 2.8 -> 3
    # (24 blocks); 10 %: 0.7 -> 1 (16 blocks)
    assert row["reaches_bytes"] == {"95%": 80 * MIB, "99%": 80 * MIB, "50%": 64 * MIB, "40%": 48 * MIB,
                                    "10%": 32 * MIB}


def test_a_lower_level_given_the_level_above_by_hand(trace):
    from kvemu.plan import level_saturation

    levels = _levels("cxl-pool", "nvme")
    top, low = level_saturation(_analysis(trace), levels, (32 * MIB, 0), "lru", "inclusive",
                                shares=(0.95, 0.5, 0.3))
    assert top["reachable_tokens"] == 7 * 128  # the top level has nothing above it: its capacity given is not used
    # below 2 documents: 6 reachable; 95 %: 5.7 -> 6 (40 blocks); 50 %: 3 -> 4 (32); 30 %: 1.8 -> 2 (24)
    assert low["reachable_tokens"] == 6 * 128
    assert low["reaches_bytes"] == {"95%": 80 * MIB, "50%": 64 * MIB, "30%": 48 * MIB}


def test_write_back_changes_what_a_lower_level_needs(trace):
    from kvemu.capacity import Level
    from kvemu.plan import level_saturation
    from kvemu.profiles import resolve_profile

    an = _analysis(trace)
    levels = _levels("cxl-pool", "nvme")
    _, low = level_saturation(an, levels, (32 * MIB, 0), "lru", "write-back", shares=(0.95, 0.75))
    assert low["reachable_tokens"] == 4 * 128
    # 95 % of 4 documents (3.8) needs more than the 3 one document of capacity serves, and 2 documents
    # serve all 4; 75 % (3) is reached at one document or less
    assert 8 * 2 * MIB < low["reaches_bytes"]["95%"] <= 16 * 2 * MIB
    assert low["reaches_bytes"]["75%"] <= 8 * 2 * MIB
    # and it is the smallest: every capacity of one block to every block tried (brute force)
    top = Level("cxl-pool", resolve_profile("cxl-pool"), 32 * MIB)

    def served(blocks):
        return an.evaluate([top, Level("nvme", resolve_profile("nvme"), blocks * 2 * MIB)], "lru",
                           placement="write-back")["levels"][1]["served_tokens"]

    for share in (0.95, 0.75):
        want = next(b for b in range(1, 41) if served(b) >= share * 4 * 128)
        assert low["reaches_bytes"][f"{share * 100:g}%"] == want * 2 * MIB


# ------------------------------------------------------------------------------------------- goodput
def test_goodput_counted_by_hand():
    from kvemu.plan import Goodput, goodput, parse_slo

    g = parse_slo("ttft<=2s,tpot<=50ms,goodput>=90%")
    assert g == (Goodput(0.9, 2000.0, 50.0),)
    ttft = [100.0, 2000.0, 2500.0, 10.0, float("nan"), 30.0]
    tpot = [40.0, 50.0, 10.0, 60.0, 10.0, float("nan")]
    arrival = [0.0, 1000.0, 2000.0, 3000.0, 4000.0, 5000.0]
    # by hand: #0 meets both; #1 meets both (equal is met); #2 TTFT over; #3 TPOT over; #4 no TTFT:
    # not met; #5 one output token (no TPOT): met. 3 of 6, over 5 s of arrivals: 0.6 requests/s
    assert goodput(ttft, tpot, arrival, g[0]) == {"met": 3, "requests": 6, "share": 0.5, "rps": 0.6}
    # TTFT alone bounded: #3 now meets it too
    assert goodput(ttft, tpot, arrival, Goodput(0.5, ttft_ms=2000.0))["met"] == 4
    assert goodput([], [], [], g[0]) == {"met": 0, "requests": 0, "share": 0.0, "rps": None}


def test_goodput_ratio_by_hand():
    from kvemu.plan import parse_slo, slo_ratio

    t = parse_slo("ttft_p90=2s,ttft<=1s,goodput>=0.8")
    # max(1500 / 2000, 0.8 / 0.5) = 1.6; no request meeting its bounds: inf (never on the frontier)
    assert slo_ratio({"ttft": {"p90": 1500.0}, "goodput": {"share": 0.5}}, t) == pytest.approx(1.6)
    assert slo_ratio({"ttft": {"p90": 1500.0}, "goodput": {"share": 0.0}}, t) == float("inf")
    assert slo_ratio({"ttft": {"p90": 1500.0}}, t) is None


def test_goodput_is_one_rule_in_the_analysis_and_the_replay(tmp_path):
    """The plan's analysed and replayed goodput are the requests meeting the bound, counted here
    from the analysis's per-request TTFT and from the rows of the same replay run here."""
    import pyarrow.parquet as pq

    from kvemu.capacity import Level, StackAnalysis
    from kvemu.plan import PlanOptions, plan
    from kvemu.profiles import resolve_profile
    from kvemu.replay import ReplayOptions, WindowOptions, replay
    from kvemu.replay.stack import parse_tiers
    from kvemu.replay_options import TierOptions
    from kvemu.schema import read_trace

    doc = plan(CHAT, "ttft<=30ms,goodput>=50%", ["cxl-pool=2GiB"],
               PlanOptions(replay_max=1, replay_requests=48, replay_layers=2, workers=1))
    (p,) = doc["points"]
    tr = read_trace(CHAT)
    an = StackAnalysis(tr).evaluate([Level("cxl-pool", resolve_profile("cxl-pool"), 2 << 30)], "lru",
                                    placement="inclusive", per_request=True)
    met = sum(1 for x in an["per_request_ms"]["ttft"] if x <= 30.0)
    assert 0 < met < tr.n_requests  # a bound that parts the requests
    span_s = (max(tr.arrival_ms) - min(tr.arrival_ms)) / 1e3
    assert p["analysed"]["goodput"] == pytest.approx({"met": met, "requests": tr.n_requests,
                                                      "share": met / tr.n_requests, "rps": met / span_s})
    # the replay the plan ran: requests 0:48, the first 24 warming the levels uncounted
    assert (doc["replay"]["requests"], doc["replay"]["counted_from"]) == (48, 24)
    spec = parse_tiers("vemu:cxl-pool|cap=2GiB,policy=lru;placement=write-back")
    opts = ReplayOptions(window=WindowOptions(layers=2, requests=(0, 48), warmup=24.5 / tr.n_requests),
                         tier=TierOptions(stack=spec))
    meta = replay(CHAT, spec.levels[0].backend, opts, out=tmp_path / "r.parquet")
    rows = pq.read_table(meta["results_path"]).to_pydict()
    met = sum(1 for x in rows["ttft_ms"] if x <= 30.0)
    assert len(rows["ttft_ms"]) == 24 and 0 < met < 24
    rep = p["replayed"]["goodput"]
    assert (rep["met"], rep["requests"]) == (met, 24)
    assert p["replayed"]["slo_ratio"] == pytest.approx(0.5 / (met / 24))


# ---------------------------------------------------------------------------------- the option table
def test_plan_help_is_the_option_table():
    from kvemu.plan_options import OPTIONS, PlanOptions, options_from_flags

    params = {p.opts[0]: p for p in cli.commands["plan"].params if p.opts and p.opts[0].startswith("--")}
    table = [o for o in OPTIONS if o.flag]
    # every flag of the table, and only the command's own besides (the SLO, levels, record inputs, outputs)
    assert {o.flag for o in table} <= set(params)
    own = set(params) - {o.flag for o in table}
    assert own <= {"--slo", "--level", "--json", "--html", "--force", "--workload", "--model", "--help"} | {
        o.flag for o in __import__("kvemu.record_options", fromlist=["OPTIONS"]).OPTIONS if o.flag}
    # the command line's defaults, read back through the table, are the library's
    assert options_from_flags({p.name: params[o.flag].default for o in table for p in [params[o.flag]]}) == PlanOptions()
    # and a flag given reaches its field: --sharing replicated -> shared False, --policies a,b -> a tuple
    o = options_from_flags({"shared": "replicated", "policies": "lru,fifo", "prefetch": "timeout", "replay_max": 0})
    assert (o.shared, o.policies, o.prefetch, o.replay_max) == (False, ("lru", "fifo"), ("timeout",), 0)


@pytest.mark.parametrize("extra,message", [
    (["--slo", "goodput>=90%"], "needs the bounds"),
    (["--slo", "ttft<=2s"], "give the share"),
    (["--slo", "ttft<=2s,goodput>=1.5"], "at most 1"),
    (["--slo", "ttft<=2s,ttft<=1s,goodput>=0.9"], "twice"),
    (["--slo", "goodput<=0.9,ttft<=1s"], "neither goodput"),
    (["--prefetch", "eager"], "unknown prefetch policy"),
    (["--policies", "lru,lru"], "twice"),
])
def test_bad_plan_input_one_line_exit_2(extra, message):
    args = ["plan", str(CHAT), "--slo", "ttft_p90=2s", "--level", "cxl-pool=0,1GiB"]
    res = CliRunner().invoke(cli, args + extra)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


# ------------------------------------------------------------------------------- record options as input
def test_plan_records_first_as_kvemu_record_does(tmp_path):
    """plan --workload --model records through the record API: its analysed points are those of a
    plan on the trace `kvemu record` writes with the same options, and nothing is left behind."""
    import tempfile

    before = {p.name for p in Path(tempfile.gettempdir()).glob("kvemu-plan-*")}
    rec = ["--workload", "synthetic:chat", "--model", "llama3-8b", "--hbm-kv-gib", "2", "--max-requests", "40"]
    plan_args = ["--slo", "ttft_p90=200ms", "--level", "cxl-pool=0,1GiB,4GiB", "--replay", "0", "--json"]
    r = CliRunner()
    res = r.invoke(cli, ["plan", *rec, *plan_args])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["recorded"] == {"workload": "synthetic:chat", "model": "llama3-8b",
                               "options": {"--max-requests": 40, "--hbm-kv-gib": 2.0}}
    trace = tmp_path / "t.parquet"
    assert r.invoke(cli, ["record", *rec, "--out", str(trace)]).exit_code == 0
    res = r.invoke(cli, ["plan", str(trace), *plan_args])
    assert res.exit_code == 0, res.output
    other = json.loads(res.stdout)
    assert doc["requests"] == other["requests"] == 40
    assert [p["analysed"] for p in doc["points"]] == [p["analysed"] for p in other["points"]]
    assert {p.name for p in Path(tempfile.gettempdir()).glob("kvemu-plan-*")} == before


@pytest.mark.parametrize("args,message", [
    ([str(CHAT), "--workload", "synthetic:chat", "--model", "llama3-8b"], "not both"),
    ([str(CHAT), "--hbm-kv-gib", "2"], "--hbm-kv-gib: record options"),
    ([], "give a TRACE, or --workload and --model"),
    (["--workload", "synthetic:chat"], "give a TRACE, or --workload and --model"),
    (["--workload", "synthetic:chat", "--model", "llama3-8b", "--mfu", "7"], "mfu"),
])
def test_trace_or_record_options_one_line_exit_2(args, message):
    res = CliRunner().invoke(cli, ["plan", *args, "--slo", "ttft_p90=2s", "--level", "cxl-pool=0,1GiB"])
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


# --------------------------------------------------------------------------------- the prefetch axis
def test_prefetch_variants_share_the_analysis_and_the_replay_parts_them(tmp_path):
    """With --prefetch, each stack is a candidate per prefetch policy: one analysed point (the
    analysis models no prefetch), replayed with --kv-load async under each; best_effort stops waiting
    for the slow lower level, so its replay serves less from it than wait_complete's, and each
    replay is the one `kvemu replay` gives for the same stack."""
    import pyarrow.parquet as pq

    args = ["plan", str(CHAT), "--slo", "ttft_p90=100ms", "--level", "cxl-pool=256MiB", "--level", "nvme=4GiB",
            "--replay-requests", "96", "--replay", "2", "--replay-layers", "1", "--prefetch", "wait_complete,best_effort", "--json"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    wait, best = doc["points"]
    assert (wait["prefetch"], best["prefetch"]) == ("wait_complete", "best_effort")
    assert wait["analysed"] == best["analysed"] and doc["frontier"] == [0, 1] and doc["replayed"] == [0, 1]
    assert best["replayed"]["level_shares"][1] < wait["replayed"]["level_shares"][1]
    for p in (wait, best):
        out = tmp_path / f"{p['prefetch']}.parquet"
        tiers = (f"vemu:cxl-pool|cap={256 * MIB},policy=lru,sharing=shared;vemu:nvme|cap={4 << 30},policy=lru,"
                 f"sharing=shared;placement=write-back,prefetch={p['prefetch']}")
        r = CliRunner().invoke(cli, ["replay", str(CHAT), "--backend", "vemu:cxl-pool", "--tiers", tiers,
                                     "--kv-load", "async", "--layers", "1", "--requests", "0:96", "--out", str(out)])
        assert r.exit_code == 0, r.output
        rows = pq.read_table(out).to_pydict()
        lower = sum(t[1] for t in rows["stack_level_tokens"]) / sum(rows["input_tokens"])
        assert p["replayed"]["level_shares"][1] == pytest.approx(lower)


# ------------------------------------------------------------------ the closest when no goodput is met
def test_no_candidate_meeting_a_goodput_names_the_closest(trace):
    """No candidate meets the goodput: the answer names the one of the highest attained share, its
    share against the target and its $/M, even where no request of any candidate meets the bounds
    (an infinite ratio: no frontier point to name). By hand (the hand count above): a 48 MiB level
    (24 blocks) serves the reuses of distance <= 2 documents, requests 3, 5 and 11, the 16 MiB one
    (8 blocks) none; the others recompute their document. Under TTFT <= 8 ms only those three meet
    it (a recomputed request's TTFT is above 8 ms, asserted below): 3 of 12 = 25 %, ratio 0.9 / 0.25
    = 3.6, so 48 MiB is the closest. Under TTFT <= 1 us no request meets it anywhere: every share
    is 0, and the closest is the cheapest."""
    base = ["plan", str(trace), "--level", "cxl-pool=0,16MiB,48MiB", "--replay", "0"]
    for slo, stack, share, ratio in (("ttft<=8ms,goodput>=90%", "cxl-pool=48.0 MiB (lru)", "25.0%", ", SLO ratio 3.60"),
                                     ("ttft<=1us,goodput>=90%", None, "0.0%", "")):
        res = CliRunner().invoke(cli, base + ["--slo", slo, "--json"])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        cost = {p["stack"]: p["analysed"]["usd_per_million_output_tokens"] for p in doc["points"]}
        assert doc["answer"] is None and len(cost) == 3
        assert doc["points"][0]["analysed"]["ttft_ms"]["p50"] > 8.0  # HBM only recomputes every document
        if stack is None:
            assert doc["frontier"] == []  # every ratio infinite: the frontier names nothing
            stack = min(cost, key=cost.get)
        res = CliRunner().invoke(cli, base + ["--slo", slo])
        assert res.exit_code == 0, res.output
        first = res.stdout.splitlines()[0]
        assert first.startswith("no candidate meets the SLO (goodput >= 90% of requests with TTFT <= ")
        assert (f" in the analysis (closest: {stack}, goodput {share} of requests against 90.0%{ratio}, "
                f"{cost[stack]:.3f} $/M output tokens); widen") in first


def test_the_closest_goodput_by_hand_built_points():
    """The closest under a goodput target among hand-built analysed points: the highest share, then
    the smallest SLO ratio, then the cheapest; a point without figures is never it."""
    from kvemu.plan import _closest_text

    slo = [{"metric": "ttft", "percentile": 90, "limit_ms": 100.0, "name": "ttft_p90"},
           {"metric": "goodput", "percentile": None, "limit_ms": None, "name": "goodput", "share": 0.9,
            "ttft_ms": 50.0, "tpot_ms": None}]

    def pt(stack, share, ratio, cost):
        return {"stack": stack, "analysed": {"goodput": {"share": share}, "slo_ratio": ratio,
                                             "usd_per_million_output_tokens": cost}}

    # #0 and #1 attain 50 %, #1 with the smaller ratio (its TTFT p90 closer); #2 60 % but its TTFT p90
    # 4 x the limit; #3 analysed nothing (not buildable, left out)
    pts = [pt("a", 0.5, 2.0, 1.0), pt("b", 0.5, 1.8, 3.0), pt("c", 0.6, 4.0, 2.0), {"stack": "d"}]
    doc = {"slo": slo, "points": pts, "frontier": [0, 1]}
    assert _closest_text(doc) == " (closest: c, goodput 60.0% of requests against 90.0%, SLO ratio 4.00, 2.000 $/M output tokens)"
    doc["points"] = pts[:2] + pts[3:]
    assert _closest_text(doc) == " (closest: b, goodput 50.0% of requests against 90.0%, SLO ratio 1.80, 3.000 $/M output tokens)"
    # none meets its bounds: every ratio infinite, the cheapest (a tie in share and ratio), no ratio said
    doc = {"slo": slo, "frontier": [], "points": [pt("a", 0.0, float("inf"), 2.0), pt("b", 0.0, float("inf"), 1.5)]}
    assert _closest_text(doc) == " (closest: b, goodput 0.0% of requests against 90.0%, 1.500 $/M output tokens)"
    assert _closest_text({"slo": slo, "frontier": [], "points": [{"stack": "d"}]}) == ""


def test_a_recorded_trace_refused_names_the_workload_not_a_temporary_file():
    """plan refuses a resident trace; recorded first from --workload --model, the refusal names them
    (the temporary file it would be recorded into is gone by then), before recording, nothing left."""
    import tempfile

    before = {p.name for p in Path(tempfile.gettempdir()).glob("kvemu-plan-*")}
    res = CliRunner().invoke(cli, ["plan", "--workload", "synthetic:chat", "--model", "llama3-8b", "--tier-policy",
                                   "resident", "--max-requests", "10", "--slo", "ttft_p90=2s", "--level", "cxl-pool=0,1GiB"])
    assert res.exit_code == 2, res.output
    assert res.stderr == ("Error: the trace recorded from --workload synthetic:chat --model llama3-8b: its KV is "
                          "resident in one tier (tier policy resident); plan searches stacks of levels under an offload "
                          "trace (record it with --tier-policy offload)\n")
    assert res.stdout == ""
    assert {p.name for p in Path(tempfile.gettempdir()).glob("kvemu-plan-*")} == before
