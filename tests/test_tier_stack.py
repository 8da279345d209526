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
