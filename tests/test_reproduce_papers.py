"""tools/reproduce_papers.py's table builder on a tiny trace (issue 22, item 3): the ratios it prints are
the results' own mean TTFT and throughput, divided; its software share is the RDMA store's software
parts, composed by hand from the accesses and bytes the replay moved."""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvemu.replay import OutputOptions, ReplayOptions, WindowOptions, replay

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"


def _tool():
    spec = importlib.util.spec_from_file_location("reproduce_papers", ROOT / "tools" / "reproduce_papers.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_table_builder_divides_the_results_figures(tmp_path):
    tool = _tool()
    medium = tool.medium_profile(tmp_path)
    specs = {"pool": tool.POOL, "rdma": tool.RDMA, "rdma-medium": f"vemu:{medium},bandwidth_gbps=87"}
    figures, hand = {}, {}
    for tier, spec in specs.items():
        out = tmp_path / f"{tier}.parquet"
        replay(TRACE, spec, ReplayOptions(window=WindowOptions(layers=1, requests=(0, 48)),
                                          output=OutputOptions(force=True)), out=out)
        figures[tier] = tool.run_figures(out)
        t = pq.read_table(out)
        meta = json.loads(t.schema.metadata[b"kvemu"])
        rows = t.to_pydict()
        first = min(rows["arrival_ms"])
        last = max(a + e for a, e in zip(rows["arrival_ms"], rows["e2el_ms"]))
        # throughput over the run: first arrival to last completion, as vLLM's benchmark counts it
        assert meta["duration_s"] == pytest.approx((last - first) / 1e3, rel=1e-6)
        hand[tier] = {"ttft": float(np.mean(rows["ttft_ms"])), "meta": meta,
                      "tokens_per_s": sum(rows["output_tokens"]) / ((last - first) / 1e3)}
    assert all(f["virtual"] for f in figures.values())
    # the software share: 1 us of master RPC per access, a server core's 6.25 GB/s copy per byte
    # (rdma-storage's parts, docs/tier-profiles.md), over the busy time the model charged
    ops = hand["rdma"]["meta"]["ops"]
    sw = sum(min(ops[op]["accesses"] * 1000.0 + ops[op]["bytes"] / 6.25, ops[op]["busy_ns"]) for op in ops)
    busy = sum(ops[op]["busy_ns"] for op in ops)
    assert busy > 0 and figures["rdma"]["software_share"] == pytest.approx(sw / busy, rel=1e-6)
    assert figures["pool"]["software_share"] is None  # a memory pool has no software path
    assert figures["rdma-medium"]["software_share"] == 0.0  # storage, with its software parts taken out

    setup = tool.Setup("tiny", "a paper", (), ttft_ratio=1.0, throughput_ratio=1.0)
    row = tool.comparison(setup, figures["pool"], figures["rdma"], figures["rdma-medium"])
    ttft = hand["rdma"]["ttft"] / hand["pool"]["ttft"]
    thr = hand["pool"]["tokens_per_s"] / hand["rdma"]["tokens_per_s"]
    assert row["ttft"]["kvemu"] == pytest.approx(ttft, rel=1e-9)
    assert row["throughput"]["kvemu"] == pytest.approx(thr, rel=1e-9)
    assert row["ttft"]["kvemu_medium_only"] == pytest.approx(hand["rdma-medium"]["ttft"] / hand["pool"]["ttft"])
    # the RDMA store with its software path is slower than the pool; its medium alone (87 GB/s) is not
    assert ttft > 1.0 and row["ttft"]["kvemu_medium_only"] <= ttft
    # within 1.5x of a published ratio, either way, and not beyond
    for factor, within in ((1.4, True), (1 / 1.4, True), (1.6, False), (1 / 1.6, False)):
        s = tool.Setup("tiny", "a paper", (), ttft_ratio=ttft * factor, throughput_ratio=None)
        r = tool.comparison(s, figures["pool"], figures["rdma"], figures["rdma-medium"])
        assert r["ttft"]["within"] is within and r["throughput"]["within"] is None
    table = tool.markdown_table([row]).splitlines()
    assert len(table) == 4 and table[2].startswith("| tiny | a paper | mean TTFT")
    assert f"{ttft:.2f}x" in table[2] and f"{thr:.2f}x" in table[3]


def test_the_inverse_solve_finds_a_linear_models_answer_in_one_secant_step():
    """At light load a store's mean TTFT is affine in a per-byte cost, so the ratio is too: with
    ratio(x) = 2 + 3 x, the published 8.0 is reproduced at x = 2 (by hand), after the two starting
    trials and one secant step; beyond the part's bounds there is no answer."""
    tool = _tool()
    calls = []

    def linear(x):
        calls.append(x)
        return 2.0 + 3.0 * x

    res = tool.solve_part(linear, 8.0, 0.16, 0.32)
    assert res["solved"] and res["value"] == pytest.approx(2.0, rel=1e-12) and res["ratio"] == pytest.approx(8.0)
    assert len(res["trials"]) == 3 and calls == [0.16, 0.32, pytest.approx(2.0)]
    # a ratio that grows as the square: several steps, still within 1 % of the target
    res = tool.solve_part(lambda x: (1 + x) ** 2, 9.0, 0.1, 0.2)
    assert res["solved"] and res["ratio"] == pytest.approx(9.0, rel=0.01) and 1.9 < res["value"] < 2.1
    # the target needs x = 40 but the part may not exceed 10: no answer, the bound tried
    res = tool.solve_part(linear, 122.0, 0.16, 0.32, hi=10.0)
    assert not res["solved"] and res["value"] is None and res["trials"][-1][0] == 10.0
    # below the ratio with the part at zero: the lower bound tried, no answer either
    res = tool.solve_part(linear, 1.0, 0.16, 0.32)
    assert not res["solved"] and res["trials"][-1][0] == 0.0


def test_a_varied_profile_changes_one_part_and_the_handoff_engine_of_a_pd_setup(tmp_path):
    """The inverse solve's trial profile is the built-in one with one field of one part changed; in a
    P/D setup it replaces the hand-off's transfer engine, elsewhere the store's backend."""
    from kvemu.profiles import resolve_profile

    tool = _tool()
    path = tool.varied_profile(tmp_path, "mooncake-lmcache-copy", "host_copy", "ns_per_byte", 0.5)
    got, base = resolve_profile(str(path)), resolve_profile("mooncake-lmcache-copy")
    parts = {p.name: p for p in got.software}
    assert parts["host_copy"].ns_per_byte == 0.5
    assert {n: (p.ns_per_request, p.ns_per_io) for n, p in parts.items()} == {
        p.name: (p.ns_per_request, p.ns_per_io) for p in base.software}
    assert (got.bandwidth_gbps, got.latency_ns, got.kind) == (base.bandwidth_gbps, base.latency_ns, base.kind)
    pd = next(s for s in tool.SETUPS if s.name == "tract-pd")
    specs = tool.tiers(tmp_path, pd)
    assert {spec for spec, _ in specs.values()} == {tool.POOL}  # one backend: only the hand-off differs
    assert specs["pool"][1] == ("--transfer", "pool") and specs["rdma"][1] == ("--transfer", "rdma:mooncake-lmcache-copy")
    assert tool.with_profile(specs["rdma"], path, True) == (tool.POOL, ("--transfer", f"rdma:{path}"))
    assert tool.with_profile((tool.RDMA, ()), path, False) == (f"vemu:{path},bandwidth_gbps=87", ())


def test_the_tract_pd_half_divides_the_runs_and_the_copy_is_on_the_handoff(tmp_path):
    """TraCT's P/D half on the tiny trace, one prefill and one decode instance: the row divides the two
    runs' mean TTFT; the RDMA hand-off through LMCache's host copy takes at least each request's bytes at
    the copy's 6.25 GB/s (in series with the wire, docs/replay.md), the pool's reads its KV layer by
    layer and its hand-off shows on TTFT for less than its loads and stores took."""
    from kvemu.replay import DisaggOptions

    tool = _tool()
    pd = next(s for s in tool.SETUPS if s.name == "tract-pd")
    figures, rows = {}, {}
    for tier, (spec, own) in tool.tiers(tmp_path, pd).items():
        if tier not in ("pool", "rdma"):
            continue
        out = tmp_path / f"{tier}.parquet"
        replay(TRACE, spec, ReplayOptions(window=WindowOptions(layers=1, requests=(0, 12)),
                                          disagg=DisaggOptions(1, 1, own[1]),
                                          output=OutputOptions(force=True)), out=out)
        figures[tier] = tool.run_figures(out)
        rows[tier] = pq.read_table(out).to_pydict()
        rows[tier]["meta"] = json.loads(pq.read_schema(out).metadata[b"kvemu"])
    sw = rows["rdma"]["meta"]["schedule"]["disagg"]["software"]
    assert sw["profile"] == "mooncake-lmcache-copy" and sw["parts"]["host_copy"]["ns_per_byte"] == 0.16
    r = rows["rdma"]
    for b, ns in zip(r["handoff_bytes"], r["handoff_ns"]):
        assert b > 0 and ns >= b / 6.25
    p = rows["pool"]
    assert "layer by layer" in p["meta"]["schedule"]["disagg"]["transfer"]["pipelining"]
    assert all(0 <= h < n for h, n in zip(p["ttft_handoff_ns"], p["handoff_ns"]) if n > 0)
    row = tool.comparison(pd, figures["pool"], figures["rdma"], figures["rdma"])
    assert row["ttft"]["kvemu"] == pytest.approx(float(np.mean(r["ttft_ms"])) / float(np.mean(p["ttft_ms"])), rel=1e-9)


def test_the_inverse_solve_finds_a_part_hidden_under_the_medium_until_it_outgrows_it():
    """A per-object cost under concurrent I/O: the ratio stays 1.05 while the part hides under the
    medium (x < 3000 ns) and grows by 1 per us past it; the published 1.12 is reached at x = 3070 ns
    (by hand). The secant from two flat points overshoots; the bracket and bisection find it."""
    tool = _tool()

    def hinge(x):
        return 1.05 + max(0.0, x - 3000.0) / 1000.0

    res = tool.solve_part(hinge, 1.12, 1000.0, 2000.0, hi=1e7, rel=0.001)
    assert res["solved"] and res["value"] == pytest.approx(3070.0, abs=2.0)
    assert len(res["trials"]) <= 24
