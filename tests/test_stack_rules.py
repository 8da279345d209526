"""One set of rules for `analyze capacity --stack` and `replay --tiers` (kvemu.stackrules): the same
placement rules under the same names, checked two ways.

- A hand-counted oracle: twelve requests over five documents, a two-level stack, the blocks each
  level serves counted here by hand for every placement rule; both the analysis and the closed-loop
  replay must give them.
- The analysis against the replay: the same trace replayed in virtual time, one request at a time
  (1 s apart, levels fast enough that timing cannot change admission, one block per chunk), must give
  the analysis's per-level shares exactly, for every rule, with promotion and with other policies.
"""

import json

import pytest

from kvemu.stackrules import PLACEMENTS, SELECTIVE

MIB = 1 << 20
DOCS = {c: [2 * i + 1, 2 * i + 2] for i, c in enumerate("ABCDE")}  # two 64-token hash blocks each
ORDER = "ABACBDAEBCED"  # no document twice in a row: HBM (one request) never serves


def _record(tmp_path_factory, order):
    from conftest import make_workload, record

    w = make_workload([1000.0 * i for i in range(len(order))], [129] * len(order), [1] * len(order),
                      [DOCS[c] + [100 + i] for i, c in enumerate(order)], hash_block_tokens=64)
    return record(w, tmp_path_factory.mktemp("rules") / "t.parquet", hbm_kv_blocks=9)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """Twelve requests, one at a time (1 s apart), each a 128-token document (8 blocks of 16 tokens)
    and one token of its own, one output token; HBM holds one request (9 blocks), so every request
    finds only what the stack holds. A block is 2 MiB (llama3-8b, all layers): a document is 16 MiB."""
    return _record(tmp_path_factory, ORDER)


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory):
    """The same, seven requests: A B A C D A B (``SHORT``)."""
    return _record(tmp_path_factory, SHORT)


# Level 1 holds two documents (32 MiB), level 2 three (48 MiB), both LRU; oldest first.
#
# write-back: computed -> L1; L1's victims -> L2; L2's are lost.
#   1 A: L1 [A]  2 B: L1 [A,B]  3 A: L1 serves, L1 [B,A]  4 C: L1 [A,C], L2 [B]  5 B: L2 serves
#   6 D: L1 [C,D], L2 [B,A]  7 A: L2 serves  8 E: L1 [D,E], L2 [B,A,C]  9 B: L2 serves, L2 [A,C,B]
#   10 C: L2 serves  11 E: L1 serves, L1 [D,E]  12 D: L1 serves
# write-through: computed -> L1 and L2; nothing moves down.
#   1 A: L1 [A] L2 [A]  2 B: L1 [A,B] L2 [A,B]  3 A: L1 serves, L1 [B,A]  4 C: L1 [A,C] L2 [A,B,C]
#   5 B: L2 serves, L2 [A,C,B]  6 D: L1 [C,D] L2 [C,B,D]  7 A: recomputed, L1 [D,A] L2 [B,D,A]
#   8 E: L1 [A,E] L2 [D,A,E]  9 B: recomputed, L1 [E,B] L2 [A,E,B]  10 C: recomputed, L1 [B,C] L2 [E,B,C]
#   11 E: L2 serves, L2 [B,C,E]  12 D: recomputed
# write-through-selective (1 hit): computed -> L1; a served block is copied into L2; L1's victims lost.
#   1 A: L1 [A]  2 B: L1 [A,B]  3 A: L1 serves, copied: L2 [A]  4 C: L1 [A,C]  5 B: recomputed, L1 [C,B]
#   6 D: L1 [B,D]  7 A: L2 serves  8..12: L1 holds the last two computed; none of them comes back in time
# inclusive: each level an LRU cache of its own on the whole stream (L1 two documents, L2 three):
#   L1 hits request 3 only; L2 hits 3 (L1 serves it first), 5 and 11.
HAND = {  # documents (of 8 blocks, 128 tokens) each level serves
    "write-back": (3, 4),
    "write-through": (1, 2),
    "write-through-selective": (1, 1),
    "inclusive": (1, 2),
}


# Where write-through and inclusive part (the analysis's old "write-through" was inclusive): A B A C D
# A B, the same stack.
#   write-through: 3 A: L1 serves (L2 untouched: [A,B])  4 C: L1 [A,C] L2 [A,B,C]  5 D: L1 [C,D],
#     L2 evicts A: [B,C,D]  6 A: recomputed, L1 [D,A], L2 evicts B  7 B: recomputed       -> (1, 0)
#   inclusive: 3 A: L1 serves, and L2 uses A: [B,A]  4 C: L2 [B,A,C]  5 D: L2 evicts B: [A,C,D]
#     6 A: L2 serves (and A goes into L1)  7 B: recomputed                               -> (1, 1)
#   write-back: 4 C: L2 [B]  5 D: L2 [B,A]  6 A: L2 serves  7 B: L2 serves                -> (1, 2)
#   write-through-selective: 3 A: L1 serves, copied into L2  4, 5: L1's victims lost  6 A: L2 serves
#     7 B: recomputed                                                                   -> (1, 1)
SHORT = "ABACDAB"
HAND_SHORT = {"write-back": (1, 2), "write-through": (1, 0), "write-through-selective": (1, 1), "inclusive": (1, 1)}


def _replay(path, out, placement, policy="lru", promote=False, hits=1, warmup=0.0):
    import pyarrow.parquet as pq

    from kvemu.replay import DataPathOptions, ReplayOptions, TierOptions, WindowOptions, replay
    from kvemu.replay.stack import parse_tiers

    sel = f",selective_hits={hits}" if placement in SELECTIVE else ""
    spec = parse_tiers(f"placement={placement},promote={int(promote)}{sel};"
                       f"vemu:cxl-pool|cap=32MiB,policy={policy};vemu:nvme|cap=48MiB,policy={policy}")
    opts = ReplayOptions(window=WindowOptions(layers=2, warmup=warmup), datapath=DataPathOptions(chunk_tokens=16),
                         tier=TierOptions(stack=spec))
    meta = replay(path, spec.levels[0].backend, opts, out=out)
    return pq.read_table(meta["results_path"]).to_pydict(), meta


def _analysis(path, placement, policy="lru", promote=False, hits=1, warmup=0.0):
    from kvemu.capacity import StackAnalysis, parse_stack
    from kvemu.schema import read_trace

    an = StackAnalysis(read_trace(path), warmup)
    return an.evaluate(parse_stack("cxl-pool=32MiB,nvme=48MiB"), policy, placement=placement, promote=promote,
                       selective_hits=hits)


def _replayed_shares(rows):
    """Per level, the share of the counted requests' prompt tokens it served (the analysis's hit_share)."""
    total = sum(rows["input_tokens"])
    n = len(rows["stack_level_tokens"][0])
    return [sum(t[k] for t in rows["stack_level_tokens"]) / total for k in range(n)]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_hand_counted_shares_for_every_rule(tmp_path, trace, placement):
    docs = HAND[placement]
    a = _analysis(trace, placement)
    assert [lv["served_tokens"] for lv in a["levels"]] == [d * 128 for d in docs]
    assert a["hbm_share"] == 0.0
    assert [lv["hit_share"] for lv in a["levels"]] == [d * 128 / (12 * 129) for d in docs]
    rows, meta = _replay(trace, tmp_path / "r.parquet", placement)
    assert rows["hbm_hit_tokens"] == [0] * 12
    assert [sum(t[k] for t in rows["stack_level_tokens"]) for k in (0, 1)] == [d * 128 for d in docs]
    assert meta["schedule"]["stack"]["placement"] == placement


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_hand_counted_shares_where_write_through_and_inclusive_part(tmp_path, short_trace, placement):
    docs = HAND_SHORT[placement]
    a = _analysis(short_trace, placement)
    assert [lv["served_tokens"] for lv in a["levels"]] == [d * 128 for d in docs]
    rows, _ = _replay(short_trace, tmp_path / "r.parquet", placement)
    assert rows["hbm_hit_tokens"] == [0] * len(SHORT)
    assert [sum(t[k] for t in rows["stack_level_tokens"]) for k in (0, 1)] == [d * 128 for d in docs]
    assert [lv["hit_share"] for lv in a["levels"]] == _replayed_shares(rows)


@pytest.mark.parametrize("placement,policy,promote,hits", [
    ("write-back", "lru", True, 1), ("write-back", "fifo", False, 1), ("write-back", "s3fifo", True, 1),
    ("write-through", "fifo", True, 1), ("write-through-selective", "lru", False, 2),
    ("write-through-selective", "fifo", True, 1), ("inclusive", "fifo", False, 1),
])
def test_the_analysis_gives_the_replays_shares_exactly(tmp_path, trace, placement, policy, promote, hits):
    rows, _ = _replay(trace, tmp_path / "r.parquet", placement, policy, promote, hits)
    a = _analysis(trace, placement, policy, promote, hits)
    assert [lv["hit_share"] for lv in a["levels"]] == _replayed_shares(rows)
    assert [lv["served_tokens"] for lv in a["levels"]] == [sum(t[k] for t in rows["stack_level_tokens"])
                                                           for k in (0, 1)]


def test_warmup_is_one_rule_on_both(tmp_path, trace):
    # --warmup 0.5: requests 0..5 warm the stack uncounted; write-back's hand count above leaves
    # L1 serving requests 11 and 12 (2 documents), L2 requests 7, 9 and 10 (3 documents)
    rows, meta = _replay(trace, tmp_path / "w.parquet", "write-back", warmup=0.5)
    assert rows["request_id"] == list(range(6, 12))
    assert meta["params"]["reductions"]["warmup"] == 0.5
    assert [sum(t[k] for t in rows["stack_level_tokens"]) for k in (0, 1)] == [2 * 128, 3 * 128]
    a = _analysis(trace, "write-back", warmup=0.5)
    assert [lv["served_tokens"] for lv in a["levels"]] == [2 * 128, 3 * 128]
    assert [lv["hit_share"] for lv in a["levels"]] == _replayed_shares(rows)


def test_rule_names_and_refusals(tmp_path, trace):
    from click.testing import CliRunner

    from kvemu.cli import cli
    from kvemu.replay.stack import StackSpec

    assert StackSpec(levels=()).placement == "write-back"
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(trace), "--stack", "cxl-pool=32MiB,nvme=48MiB",
                                 "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["placement"] == "write-back" and doc["points"][0]["placement"] == "write-back"
    assert [lv["served_tokens"] for lv in doc["points"][0]["levels"]] == [3 * 128, 4 * 128]
    for args, why in ((["--placement", "sideways"], "unknown placement 'sideways'"),
                      (["--policies", "optimal"], "--placement inclusive only"),
                      (["--placement", "write-through-selective", "--selective-hits", "0"],
                       "selective_hits is a whole number from 1"),
                      (["--selective-hits", "2"], "--selective-hits is for --placement write-through-selective"),
                      (["--placement", "write-back", "--policies", "lru", "--promote"], None)):
        r = CliRunner().invoke(cli, ["analyze", "capacity", str(trace), "--stack", "cxl-pool=32MiB", *args])
        if why is None:
            assert r.exit_code == 0 and "placement: write-back" in r.output and ", promote" in r.output, r.output
            continue
        assert r.exit_code == 2 and why in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(cli, ["replay", str(trace), "--tiers", "vemu:cxl-pool|cap=32MiB", "--warmup", "1",
                                 "--out", str(tmp_path / "x.parquet")])
    assert r.exit_code == 2 and "--warmup must be below 1" in r.output, r.output
    assert not (tmp_path / "x.parquet").exists()
