"""A tier stack (kvemu.replay.stack), hand-traced: which level serves each block, what each level
holds and moves, what is recomputed. The expected figures are counted here by hand, step by step."""

import pytest

from kvemu.errors import ConfigError
from kvemu.replay.stack import StackSpec, TierStack, parse_tiers


def _stack(placement="write-back", promote=False, policy="lru", caps=(2, 2), selective_hits=1):
    spec = parse_tiers(f"placement={placement},promote={int(promote)},selective_hits={selective_hits};"
                       f"dram|cap=1GiB,policy={policy};vemu:nvme|cap=8GiB,policy={policy}")
    return TierStack(spec, list(caps), chunk_blocks=1)


def _serve(st, table, limit):
    """The scheduler's admission: the prefix found in the stack, then its blocks touched (served)."""
    t = st.prefix_hit(table, 0, limit)
    if t:
        st.touch_range(table, 0, t)
    return t


def test_write_back_lru_two_levels_hand_traced():
    st = _stack()
    A, B, C, D = [1, 2], [3, 4], [1, 2], [5, 6]
    st.add_range(A, 0, 2)                    # L1 {1,2}
    st.add_range(B, 0, 2)                    # 3 evicts 1 -> L2 {1}; 4 evicts 2 -> L2 {1,2}; L1 {3,4}
    assert [sorted(lv.where) for lv in st.levels] == [[3, 4], [1, 2]]
    loads, writes = st.take_moves()
    assert writes == [4, 2] and loads == [[], []]
    assert _serve(st, C, 2) == 2             # both blocks from L2
    loads, writes = st.take_moves()
    assert loads == [[], [(C, 0, 2)]] and writes == [0, 0]
    st.add_range(D, 0, 2)                    # 5,6 evict 3,4 into L2, which evicts 1,2 (LRU): gone
    assert [sorted(lv.where) for lv in st.levels] == [[5, 6], [3, 4]]
    assert st.evictions == 2
    assert _serve(st, C, 2) == 0             # recomputed: in no level
    s = st.summary(tokens_per_block=16, block_bytes_all_layers=1000)
    assert [x["served_tokens"] for x in s] == [0, 32]
    assert [x["bytes_in"] for x in s] == [6000, 4000]      # L1: 1..6 stored; L2: 1,2,3,4 demoted
    assert [x["bytes_out"] for x in s] == [0, 2000]
    assert [x["demoted_blocks"] for x in s] == [0, 4]
    assert [x["footprint_bytes"] for x in s] == [2000, 2000]


def test_lru_and_fifo_differ_on_a_hit_below():
    # L1 holds one chunk, L2 two. 1 and 2 are demoted into L2 (1 first); a hit on 1 (served by L2)
    # makes it the most recent under LRU only; demoting 9 then evicts L2's victim: 2 under LRU, 1 under FIFO
    for policy, kept, again in (("lru", [1, 9], 1), ("fifo", [2, 9], 0)):
        st = _stack(policy=policy, caps=(1, 2))
        st.add_range([1], 0, 1)
        st.add_range([2], 0, 1)              # 1 demoted: L2 [1]
        st.add_range([9], 0, 1)              # 2 demoted: L2 [1, 2]; L1 {9}
        assert _serve(st, [1], 1) == 1 and st.levels[1].served_blocks == 1
        st.add_range([3], 0, 1)              # 9 demoted into L2, which evicts its victim
        assert sorted(st.levels[0].where) == [3] and sorted(st.levels[1].where) == kept
        assert st.evictions == 1
        assert _serve(st, [1], 1) == again   # FIFO lost 1: recomputed


def test_write_through_promote_and_selective():
    st = _stack("write-through", caps=(1, 3))
    st.add_range([1, 2], 0, 2)               # both levels; L1 keeps 2 only
    assert sorted(st.levels[0].where) == [2] and sorted(st.levels[1].where) == [1, 2]
    assert _serve(st, [1, 2], 2) == 2        # 1 from L2, 2 from L1
    loads, _ = st.take_moves()
    assert loads[1] == [([1, 2], 0, 1)] and loads[0] == [([1, 2], 1, 2)]

    st = _stack(promote=True, caps=(1, 2))
    st.add_range([1], 0, 1)
    st.add_range([2], 0, 1)                  # 1 demoted
    assert _serve(st, [1], 1) == 1           # from L2, promoted: L1 {1}, 2 demoted
    assert sorted(st.levels[0].where) == [1] and sorted(st.levels[1].where) == [1, 2]

    st = _stack("write-through-selective", caps=(2, 2), selective_hits=2)
    st.add_range([1], 0, 1)
    assert sorted(st.levels[1].where) == []  # not reused yet
    _serve(st, [1], 1)
    assert sorted(st.levels[1].where) == []  # reused once
    _serve(st, [1], 1)
    assert sorted(st.levels[1].where) == [1]  # reused twice: copied down


def test_tiers_grammar_and_refusals(tmp_path):
    s = parse_tiers("dram|cap=64GiB,policy=lru; uring:/x.bin,qd=8|cap=8TiB,link=pcie4-x16,sharing=shared")
    assert [lv.backend for lv in s.levels] == ["dram", "uring:/x.bin,qd=8"]
    assert s.levels[0].capacity_bytes == 64 << 30 and s.levels[1].link == "pcie4-x16"
    assert s.levels[1].sharing == "shared" and s.placement == "write-back"
    # the defaults docs/replay.md states: lru, private, link of --link, no promotion, selective after 1 hit
    assert (s.levels[0].policy, s.levels[0].sharing, s.levels[0].link) == ("lru", "private", None)
    assert s.promote is False and s.selective_hits == 1
    assert s.shared_media() == []
    assert parse_tiers("dram|cap=1GiB;numa:0|cap=1GiB").shared_media() == [(0, 1)]
    f = tmp_path / "s.toml"
    f.write_text('placement = "write-through"\n[[tier]]\nbackend = "dram"\ncapacity = "1GiB"\n'
                 '[[tier]]\nbackend = "vemu:nvme"\ncapacity = "2GiB"\npolicy = "fifo"\n')
    t = parse_tiers(str(f))
    assert isinstance(t, StackSpec) and t.placement == "write-through" and t.levels[1].policy == "fifo"
    for bad, why in (("dram|cap=1GiB,policy=optimal", "analyze capacity"), ("dram", "no capacity"),
                     ("dram|cap=1GiB,policy=mru", "unknown policy"), ("nope|cap=1GiB", "nope"),
                     ("placement=sideways;dram|cap=1GiB", "placement"), ("", "no level")):
        with pytest.raises(ConfigError, match=why):
            parse_tiers(bad)


# ----------------------------------------------------------------------------- end to end, closed loop

DOCS = {"A": [1, 2], "B": [3, 4], "C": [5, 6], "D": [7, 8]}
ORDER = "ABACADBC"
MIB = 1 << 20


@pytest.fixture(scope="module")
def docs_trace(tmp_path_factory):
    """Eight requests, one at a time (1 s apart), each a 128-token document (8 blocks of 16 tokens)
    and one more token (its own hash), one output token; HBM holds one request (9 blocks), so every request finds
    only what the tier stack holds."""
    from conftest import make_workload, record

    w = make_workload([1000.0 * i for i in range(len(ORDER))], [129] * len(ORDER), [1] * len(ORDER),
                      [DOCS[c] + [100 + i] for i, c in enumerate(ORDER)], hash_block_tokens=64)
    return record(w, tmp_path_factory.mktemp("stack") / "t.parquet", hbm_kv_blocks=9)


def _run(path, out, tiers):
    import json

    import pyarrow.parquet as pq

    from kvemu.replay import DataPathOptions, ReplayOptions, TierOptions, WindowOptions, replay

    spec = parse_tiers(tiers)
    opts = ReplayOptions(window=WindowOptions(layers=2), datapath=DataPathOptions(chunk_tokens=16),
                         tier=TierOptions(stack=spec))
    meta = replay(path, spec.levels[0].backend, opts, out=out)
    rows = pq.read_table(meta["results_path"]).to_pydict()
    return json.loads(json.dumps(meta["schedule"]["stack"])), rows, meta


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_two_level_write_back_stack_end_to_end_hand_traced(tmp_path, docs_trace, policy):
    # A block is 16 tokens x 128 KiB (llama3-8b, all layers) = 2 MiB: L1 16 MiB holds one document
    # (8 chunks of one block), L2 32 MiB two. Write-back, by hand:
    #   A: miss, stored in L1              L1 {A}  L2 {}
    #   B: miss, stored; A demoted         L1 {B}  L2 {A}
    #   A: served by L2                    L1 {B}  L2 {A}
    #   C: miss, stored; B demoted         L1 {C}  L2 {A, B}
    #   A: served by L2 (LRU: A now newest; FIFO: A still first in)
    #   D: miss, stored; C demoted: L2 evicts B (LRU) / A (FIFO)
    #   B: LRU: in no level, recomputed, stored (D demoted, L2 evicts A) / FIFO: served by L2
    #   C: served by L2
    st, rows, meta = _run(docs_trace, tmp_path / "r.parquet",
                          f"vemu:cxl-pool|cap=16MiB,policy={policy};vemu:nvme|cap=32MiB,policy={policy}")
    served = {"lru": [0, 0, 128, 0, 128, 0, 0, 128], "fifo": [0, 0, 128, 0, 128, 0, 128, 128]}[policy]
    assert rows["tier_hit_tokens"] == served
    assert rows["hbm_hit_tokens"] == [0] * 8
    assert rows["stack_level_tokens"] == [[0, s] for s in served]   # every hit from L2
    assert rows["recomputed_tokens"] == [129 - s for s in served]
    l1, l2 = st["levels"]
    assert l1["served_tokens"] == 0 and l2["served_tokens"] == sum(served) and l2["hit_share"] == 1.0
    stored = {"lru": 5, "fifo": 4}[policy]               # documents computed and stored into L1
    assert l1["bytes_written"] == stored * 8 * 2 * MIB
    assert l2["demoted_blocks"] == (stored - 1) * 8      # every one but the last, pushed down by the next
    assert l2["bytes_written"] == (stored - 1) * 8 * 2 * MIB
    assert l2["bytes_loaded"] == sum(served) // 16 * 2 * MIB
    assert l2["evicted_blocks"] == {"lru": 16, "fifo": 8}[policy]
    assert l1["footprint_bytes"] == 16 * MIB and l2["footprint_bytes"] == 32 * MIB
    assert l2["time_ns"] > 0 and l2["mode"] == "virtual"
    # vemu:nvme's medium is slower than a PCIe 5 x16 link: the medium bounds it
    assert l2["opened"]["medium_gbps"] < l2["opened"]["link_load_gbps"] and l2["bound"] == "medium"
    assert 0 < l2["gbps"] <= l2["opened"]["medium_gbps"] * 1.0001
    assert "vemu:cxl-pool 16.0 MiB + vemu:nvme 32.0 MiB" in meta["label"]


def test_a_stack_whose_top_holds_everything_is_the_one_tier_replay(tmp_path, docs_trace):
    """The same hits as one tier of the top level's size (the single-tier path, ChunkTierCache)."""
    from kvemu.replay import DataPathOptions, ReplayOptions, TierOptions, WindowOptions, replay
    import pyarrow.parquet as pq

    st, rows, _ = _run(docs_trace, tmp_path / "s.parquet", "vemu:cxl-pool|cap=64MiB;vemu:nvme|cap=64MiB")
    one = replay(docs_trace, "vemu:cxl-pool", ReplayOptions(window=WindowOptions(layers=2),
                 datapath=DataPathOptions(chunk_tokens=16), tier=TierOptions(capacity_bytes=64 * MIB)),
                 out=tmp_path / "o.parquet")
    r1 = pq.read_table(one["results_path"]).to_pydict()
    assert rows["tier_hit_tokens"] == r1["tier_hit_tokens"] == [0, 0, 128, 0, 128, 0, 128, 128]
    assert st["levels"][1]["served_tokens"] == 0 and st["levels"][1]["bytes_written"] == 0


def test_cli_refusals(tmp_path, docs_trace):
    from click.testing import CliRunner

    from kvemu.cli import cli

    for args, why in ((["--schedule", "recorded"], "--schedule closed"), ([], "--kv-load async"),
                      ([], "optimal")):
        tiers = ("dram|cap=16MiB,policy=optimal" if why == "optimal" else
                 "prefetch=timeout;dram|cap=16MiB;vemu:nvme|cap=32MiB" if why == "--kv-load async" else
                 "dram|cap=16MiB;vemu:nvme|cap=32MiB")
        r = CliRunner().invoke(cli, ["replay", str(docs_trace), "--tiers", tiers, "--out", str(tmp_path / "x.parquet"),
                                     *args])
        assert r.exit_code == 2 and why in r.output and "Traceback" not in r.output, r.output
        assert not (tmp_path / "x.parquet").exists()


def test_shared_levels_serve_every_instance_private_ones_their_own(tmp_path, docs_trace):
    # Two instances, round-robin: instance 0 gets A A A B, instance 1 B C D C (requests 0, 2, 4, 6 and
    # 1, 3, 5, 7). Each has its own HBM of one request: instance 0's second and third A hit its HBM.
    # Shared stack, in arrival order: A in L1; B: A demoted; C: B demoted (L2 A, B); D: C demoted, L2
    # evicts A (LRU: untouched since) -> L2 {B, C}; request 6 (B, instance 0) and 7 (C, instance 1)
    # are served by L2. Private: instance 0's stack never held B (recomputed); instance 1's holds C.
    from kvemu.replay import DataPathOptions, InstanceOptions, ReplayOptions, TierOptions, WindowOptions, replay
    import pyarrow.parquet as pq

    got = {}
    for sharing in ("shared", "private"):
        spec = parse_tiers(f"vemu:cxl-pool|cap=16MiB,sharing={sharing};vemu:nvme|cap=32MiB,sharing={sharing}")
        meta = replay(docs_trace, spec.levels[0].backend,
                      ReplayOptions(window=WindowOptions(layers=2), datapath=DataPathOptions(chunk_tokens=16),
                                    tier=TierOptions(stack=spec), instances=InstanceOptions(count=2)),
                      out=tmp_path / f"{sharing}.parquet")
        got[sharing] = pq.read_table(meta["results_path"]).to_pydict(), meta["schedule"]["stack"]
    rows, st = got["shared"]
    assert rows["hbm_hit_tokens"] == [0, 0, 128, 0, 128, 0, 0, 0]
    assert rows["tier_hit_tokens"] == [0, 0, 0, 0, 0, 0, 128, 128]
    assert st["one_stack_for_all_instances"] and st["levels"][1]["served_tokens"] == 256
    rows, st = got["private"]
    assert rows["tier_hit_tokens"] == [0, 0, 0, 0, 0, 0, 0, 128]
    assert not st["one_stack_for_all_instances"] and st["levels"][1]["served_tokens"] == 128


def test_write_through_stack_end_to_end_hand_traced(tmp_path, docs_trace):
    # Write-through, LRU, L1 one document, L2 two; every computed document lands in both levels:
    #   A: L1 {A} L2 {A};  B: L1 {B} L2 {A, B};  A: served by L2 (A newest);  C: L2 evicts B -> {A, C}
    #   A: served by L2;  D: L2 evicts C -> {A, D};  B: recomputed, L2 evicts A -> {D, B};
    #   C: recomputed, L2 evicts D -> {B, C}
    st, rows, _ = _run(docs_trace, tmp_path / "w.parquet",
                       "placement=write-through;vemu:cxl-pool|cap=16MiB;vemu:nvme|cap=32MiB")
    assert rows["tier_hit_tokens"] == [0, 0, 128, 0, 128, 0, 0, 0]
    assert rows["stack_level_tokens"] == [[0, s] for s in [0, 0, 128, 0, 128, 0, 0, 0]]
    l1, l2 = st["levels"]
    assert st["placement"] == "write-through"
    assert l1["bytes_written"] == l2["bytes_written"] == 6 * 8 * 2 * MIB    # A B C D B C, in both levels
    assert l2["demoted_blocks"] == 0 and l2["evicted_blocks"] == 4 * 8    # B, C, A, D
