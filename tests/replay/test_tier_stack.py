"""A tier stack (kvemu.replay.stack), hand-traced: which level serves each block, what each level
holds and moves, what is recomputed. The expected figures are counted here by hand, step by step."""

import pytest

from kvemu.errors import ConfigError
from kvemu.replay.stack import StackSpec, TierStack, parse_tiers


def _stack(placement="write-back", promote=False, policy="lru", caps=(2, 2), selective_hits=1):
    # selective_hits only where the placement uses it (a stack refuses an option it ignores)
    hits = f",selective_hits={selective_hits}" if placement == "write-through-selective" else ""
    spec = parse_tiers(f"placement={placement},promote={int(promote)}{hits};"
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


# ----------------------------------------------------------------------------- async loads, prefetch policies

# Both levels on one virtual profile with fixed costs: one block of one layer moves in L + 65536 B / 64
# GB/s = L + 1024 ns, one access at a time, so a chunk (one block, 32 layers) arrives 32 x (L + 1024) ns
# after the one before it (test_closed_loop's oracle, with the CPU link and serial stores).
LAT = 400_000
CHUNK_NS = 32 * (LAT + 1024)
_V = f"latency_ns={LAT},bandwidth_gbps=64,concurrency=1,overhead_ns=0"


def _async(path, out, prefetch):
    import json

    import pyarrow.parquet as pq

    from kvemu.replay import DataPathOptions, ReplayOptions, ScheduleOptions, StoreOptions, TierOptions, replay

    spec = parse_tiers(f"{prefetch};vemu:cxl-pool,{_V}|cap=16MiB;vemu:cxl-pool,{_V}|cap=32MiB")
    opts = ReplayOptions(datapath=DataPathOptions(chunk_tokens=16, link="cpu"), stores=StoreOptions(timing="serial"),
                         tier=TierOptions(stack=spec), schedule=ScheduleOptions(kv_load="async"))
    meta = replay(path, spec.levels[0].backend, opts, out=out)
    return json.loads(json.dumps(meta["schedule"]["stack"])), pq.read_table(meta["results_path"]).to_pydict()


@pytest.mark.parametrize("prefetch", ["wait_complete", "timeout_30", "timeout_200", "best_effort"])
def test_async_prefetch_from_a_lower_level_hand_timed(tmp_path, docs_trace, prefetch):
    # Request 2 (document A again, alone at 2 s) finds its 8 blocks in L2 (the write-back trace of
    # test_two_level_write_back_stack_end_to_end_hand_traced). Its load goes on L2's load stream, a
    # chunk per block: chunk i arrives CHUNK_NS x (i + 1) after the admission step starts, at its arrival.
    # The admission step itself runs nothing (the request waits for its load): E = roofline(0, 0, 0).
    #   wait_complete: starts when all 8 have arrived: 8 chunks; its prefill is its last token alone.
    #   timeout 30 ms: starts at 30 ms with the 2 chunks that arrived (25.7 ms); 6 recomputed.
    #   timeout 200 ms: the 8 arrive first (102.7 ms): as wait_complete.
    #   best_effort: starts after the admission step (E = 7.1 ms), before the first chunk: all recomputed.
    # The prefill then computes the rest and stores its full blocks into L1, serially (one store each).
    # L2 stops moving the request's chunks once it started without them (HiCache terminates the
    # prefetch): a chunk not started by then is cancelled, the one in flight completes, late.
    #   timeout 30 ms: chunks 0, 1, 2 start before 30 ms (2 in flight, late), 3..7 cancelled.
    #   best_effort: the request cannot start before the admission step ends (E): chunk 0 starts
    #   before, completes late; 1..7 cancelled.
    from test_closed_loop import roofline_ns

    opt = {"wait_complete": "prefetch=wait_complete", "best_effort": "prefetch=best_effort",
           "timeout_30": "prefetch=timeout,prefetch_timeout_ms=30,prefetch_timeout_per_ki_token_ms=0",
           "timeout_200": "prefetch=timeout,prefetch_timeout_ms=200"}[prefetch]
    st, rows = _async(docs_trace, tmp_path / "a.parquet", opt)
    e = roofline_ns(0, 0, 0)
    starts_ns, kept = {"wait_complete": (8 * CHUNK_NS, 8), "timeout_200": (8 * CHUNK_NS, 8),
                       "timeout_30": (30_000_000, 2), "best_effort": (e, 0)}[prefetch]
    assert rows["tier_hit_tokens"][2] == kept * 16
    assert rows["stack_level_tokens"][2] == [0, kept * 16]
    assert rows["stack_late_tokens"][2] == [0, (8 - kept) * 16]
    assert rows["recomputed_tokens"][2] == 129 - kept * 16
    moved = {"wait_complete": 8, "timeout_200": 8, "timeout_30": 3, "best_effort": 1}[prefetch]
    # the chunks moved, in time or late: the request's load time is theirs
    assert rows["kv_load_ms"][2] == pytest.approx(moved * CHUNK_NS / 1e6, abs=1e-6)
    k = 129 - kept * 16                                   # tokens its prefill computes, after kept x 16 cached
    ctx = kept * 16
    stores = (ctx + k) // 16 - ctx // 16                  # blocks that fill up: stored into L1
    ttft_ns = starts_ns + roofline_ns(k, k * (ctx + (k + 1) / 2), ctx + k) + stores * CHUNK_NS
    assert rows["ttft_ms"][2] == pytest.approx(ttft_ns / 1e6, abs=1e-6)
    l2 = st["levels"][1]
    # (later requests prefetch from L2 too: the level's totals hold request 2's at least)
    assert l2["late_tokens"] >= (8 - kept) * 16 and l2["cancelled_tokens"] >= (8 - moved) * 16
    assert l2["bytes_late"] == (l2["late_tokens"] - l2["cancelled_tokens"]) // 16 * 2 * MIB
    assert l2["bytes_cancelled"] == l2["cancelled_tokens"] // 16 * 2 * MIB
    assert (l2["cancelled_tokens"] == 0) == (moved == 8)
    assert st["prefetch"]["policy"] == opt.split(",")[0].split("=")[1]
    assert sum(sum(x) for x in rows["stack_late_tokens"]) == sum(lv["late_tokens"] for lv in st["levels"])


def test_prefetch_grammar_and_defaults():
    s = parse_tiers("dram|cap=1GiB;vemu:nvme|cap=2GiB")
    # the defaults docs/replay.md states: wait_complete, 2000 ms + 100 ms per 1024 tokens
    assert (s.prefetch, s.prefetch_timeout_ms, s.prefetch_timeout_per_ki_token_ms) == ("wait_complete", 2000.0, 100.0)
    assert s.prefetch_timeout_ns(2048) == 2_200_000_000
    for bad, why in (("prefetch=eager;dram|cap=1GiB", "unknown prefetch policy"),
                     ("prefetch_timeout_ms=-1;dram|cap=1GiB", "milliseconds"),
                     ("dram|cap=1GiB,sharing=shared;vemu:nvme|cap=1GiB", "private below shared"),
                     ("dram|cap=1GiB;vemu:nvme|cap=1GiB,devices=2", "devices is for a shared level"),
                     ("dram|cap=1GiB;vemu:nvme|cap=1GiB,sharing=shared,devices=0", "whole number")):
        with pytest.raises(ConfigError, match=why):
            parse_tiers(bad)


# ----------------------------------------------------------------------------- instances: mixed and shared levels

def _instances(path, out, tiers, n=2, **opts):
    import json

    import pyarrow.parquet as pq

    from kvemu.replay import (DataPathOptions, InstanceOptions, ReplayOptions, StoreOptions, TierOptions,
                              WindowOptions, replay)

    spec = parse_tiers(tiers)
    o = ReplayOptions(window=WindowOptions(layers=2), datapath=DataPathOptions(chunk_tokens=16, link="cpu"),
                      stores=StoreOptions(timing="serial"), tier=TierOptions(stack=spec),
                      instances=InstanceOptions(count=n)).but(**opts)
    meta = replay(path, spec.levels[0].backend, o, out=out)
    return json.loads(json.dumps(meta["schedule"]["stack"])), pq.read_table(meta["results_path"]).to_pydict(), meta


def test_a_private_level_above_a_shared_one_hand_traced(tmp_path, docs_trace):
    # Two instances, round-robin: instance 0 gets A A A B (requests 0 2 4 6), instance 1 B C D C
    # (1 3 5 7); each HBM holds one request. L1 private (one document each), L2 shared (two).
    #   0 A (i0): stored in L1/0 {A}           1 B (i1): L1/1 {B}
    #   2 A (i0): its HBM                      3 C (i1): L1/1 {C}, B demoted: L2 {B}
    #   4 A (i0): its HBM                      5 D (i1): L1/1 {D}, C demoted: L2 {B, C}
    #   6 B (i0): not in its HBM nor L1/0: L2 serves it, a block instance 1 put there (cross-instance)
    #   7 C (i1): L2 serves it (its own)
    st, rows, meta = _instances(docs_trace, tmp_path / "m.parquet",
                                f"vemu:cxl-pool,{_V}|cap=16MiB;vemu:cxl-pool,{_V}|cap=32MiB,sharing=shared")
    assert rows["hbm_hit_tokens"] == [0, 0, 128, 0, 128, 0, 0, 0]
    assert rows["tier_hit_tokens"] == [0, 0, 0, 0, 0, 0, 128, 128]
    assert rows["stack_level_tokens"][6:] == [[0, 128], [0, 128]]
    l1, l2 = st["levels"]
    assert (l1["sharing"], l1["caches"], l2["sharing"], l2["caches"]) == ("private", 2, "shared", 1)
    assert meta["params"]["sharing"] == "replicated"               # the top level is private: an arena each
    assert l2["served_tokens"] == 256 and l2["cross_instance_tokens"] == 128 and l2["hit_share"] == 1.0
    assert l2["bytes_written"] == 16 * 2 * MIB and l2["bytes_loaded"] == 16 * 2 * MIB
    # footprints: L1 one document per instance (two caches); L2 held B and C once
    assert l1["footprint_bytes"] == 2 * 8 * 2 * MIB and l2["footprint_bytes"] == 16 * 2 * MIB
    # dedup: L1 holds A (i0) and B, C, D (i1), no block twice; L2 B and C once, B read by both
    assert l1["distinct_bytes"] == l1["per_instance_bytes"] == 32 * 2 * MIB and l1["dedup"] == 1.0
    assert l2["distinct_bytes"] == 16 * 2 * MIB and l2["per_instance_bytes"] == 24 * 2 * MIB and l2["dedup"] == 1.5
    # the shared level's queue: two devices (one per instance) of 64 GB/s, every byte moved on it
    q = l2["queue"]
    assert (q["devices"], q["device_gbps"], q["gbps"], q["from"]) == (2, 64.0, 128.0, "one per instance")
    assert q["bytes"] == 32 * 2 * MIB and q["waited_ns"] == 0          # 1 s apart: nobody waited
    assert l2["contention"].startswith("modelled") and l1["contention"].startswith("none")

    # the same stack with L2 private too: instance 0's L2 never held B (recomputed), instance 1's holds C
    st, rows, _ = _instances(docs_trace, tmp_path / "p.parquet",
                             f"vemu:cxl-pool,{_V}|cap=16MiB;vemu:cxl-pool,{_V}|cap=32MiB")
    assert rows["tier_hit_tokens"] == [0, 0, 0, 0, 0, 0, 0, 128]
    assert st["levels"][1]["cross_instance_tokens"] == 0 and st["levels"][1]["queue"] is None


@pytest.mark.parametrize("devices", [1, 2])
def test_two_instances_loading_from_a_shared_level_at_once_queue_on_it(tmp_path, devices):
    # Instances 0 and 1 each store a document (A, B at 0 s), then another (C, D at 1 s), which
    # demotes A and B into the shared L2; at 2 s instance 0 asks for B and instance 1 for A at once:
    # each loads 8 blocks (16 MiB, all layers) from L2 in its prefill step, both starting at 2 s.
    # One medium of `devices` x 64 GB/s: the second waits for the first's 16 MiB to pass.
    from conftest import make_workload, record

    docs = [[1, 2], [3, 4], [5, 6], [7, 8], [3, 4], [1, 2]]
    w = make_workload([0.0, 0.0, 1000.0, 1000.0, 2000.0, 2000.0], [129] * 6, [1] * 6,
                      [d + [100 + i] for i, d in enumerate(docs)], hash_block_tokens=64)
    path = record(w, tmp_path / "t.parquet", hbm_kv_blocks=9)
    st, rows, _ = _instances(path, tmp_path / "q.parquet",
                             f"vemu:cxl-pool,{_V}|cap=16MiB;vemu:cxl-pool,{_V}|cap=32MiB,sharing=shared,devices={devices}")
    assert rows["instance"] == [0, 1, 0, 1, 0, 1]
    assert rows["tier_hit_tokens"] == [0, 0, 0, 0, 128, 128]
    assert st["levels"][1]["cross_instance_tokens"] == 256       # each reads what the other stored
    wait = 16 * MIB / (devices * 64.0)                            # ns: bytes over bytes per ns
    q = st["levels"][1]["queue"]
    assert q["gbps"] == devices * 64.0 and q["from"] == "devices="
    assert q["waited_ns"] == pytest.approx(wait, abs=1)
    assert abs(rows["ttft_ms"][5] - rows["ttft_ms"][4]) == pytest.approx(wait / 1e6, abs=1e-5)


def test_toml_stack_with_prefetch_and_shared_levels(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text('prefetch = "timeout"\nprefetch_timeout_ms = 50\n'
                 '[[tier]]\nbackend = "dram"\ncapacity = "1GiB"\n'
                 '[[tier]]\nbackend = "vemu:cxl-pool"\ncapacity = "2GiB"\nsharing = "shared"\ndevices = 3\n'
                 '[[tier]]\nbackend = "vemu:nvme"\ncapacity = "8GiB"\nsharing = "shared"\n')
    s = parse_tiers(str(f))
    assert (s.prefetch, s.prefetch_timeout_ms, s.prefetch_timeout_per_ki_token_ms) == ("timeout", 50.0, 100.0)
    assert [lv.sharing for lv in s.levels] == ["private", "shared", "shared"] and s.mixed
    assert [lv.devices for lv in s.levels] == [None, 3, None]
    # the engine-side stack: a private top level per instance, the shared levels once
    st = TierStack(s, [1, 2, 2], chunk_blocks=1, instances=2)
    assert st.by_instance[0][0] is not st.by_instance[1][0]
    assert st.by_instance[0][1] is st.by_instance[1][1] and st.by_instance[0][2] is st.by_instance[1][2]
    a, b = st.view(0), st.view(1)
    a.add_range([1, 2], 0, 2)                # instance 0's L1 holds one chunk: 1 demoted into the shared L2
    assert a.prefix_hit([1, 2], 0, 2) == 2 and b.prefix_hit([1, 2], 0, 2) == 1   # 2 is in instance 0's L1 only
    b.touch_range([1], 0, 1)
    assert st.cross_blocks == [0, 1, 0]      # instance 1 read the block instance 0 put in L2


def test_a_cancelled_prefetch_leaves_its_level_to_the_next_request():
    """LowerLevels.prefetch with cancel times, hand-timed: one block of one layer moves in L + 1024 ns,
    one access at a time, so a chunk of one block and 2 layers takes C = 2 (L + 1024) ns. Request X's 4
    chunks then Y's 2, all issued at 0; X starts without what has not arrived at 1.5 C: its chunks 0
    and 1 start before (1 is in flight, completes), 2 and 3 are cancelled; Y's follow at 2 C, 3 C."""
    import numpy as np

    from kvemu.links import get_link
    from kvemu.replay.stack import LowerLevels

    spec = parse_tiers(f"vemu:cxl-pool,{_V}|cap=16MiB;vemu:cxl-pool,{_V}|cap=32MiB")
    timing = {"link": get_link("cpu"), "store_mode": "serial", "store_inflight_bytes": 1 << 20}
    c = 2 * (LAT + 1024)
    groups = [(np.array([b]), 0, b, 4) for b in range(4)] + [(np.array([10 + b]), 1, b, 2) for b in range(2)]
    got = {}
    for cancelled in (False, True):
        lower = LowerLevels(spec, 65536, (2, 2, False, 1, "per-layer"), [8, 16], 1, 1 << 30, False, print, timing,
                            np.array([1, 1], np.uint32))
        try:
            lower.open_streams()
            got[cancelled] = lower.prefetch(1, 0, groups, None, [1.5 * c] * 4 + [None] * 2 if cancelled else None)
            if cancelled:
                assert lower.cancelled_blocks == [0, 2]
        finally:
            lower.close()
    ends, load_ns = got[True]
    assert ends[:2] == [pytest.approx(c, abs=2), pytest.approx(2 * c, abs=2)] and ends[2:4] == [None, None]
    assert ends[4:] == [pytest.approx(3 * c, abs=2), pytest.approx(4 * c, abs=2)]
    assert load_ns[2:4] == [0, 0] and sum(load_ns) == pytest.approx(4 * c, abs=8)
    assert got[False][0][-1] == pytest.approx(6 * c, abs=2)   # without the cancel Y waits for all of X's


def test_promotion_writes_are_timed_on_the_top_level(tmp_path, docs_trace):
    # Write-back, LRU, promote=1, L1 one document, L2 two, by hand (ORDER ABACADBC):
    #   A: L1 {A};  B: L1 {B}, A demoted, L2 {A};  A: served by L2, promoted: L1 {A}, B demoted, L2 {A, B}
    #   C: L1 {C}, A demoted (already in L2);  A: served by L2, promoted: L1 {A}, C demoted, L2 evicts B
    #   D: L1 {D}, A demoted (already in L2);  B: recomputed, L1 {B}, D demoted, L2 evicts C
    #   C: recomputed, L1 {C}, B demoted, L2 evicts A
    # L1 writes the 6 computed documents and the 2 promoted ones, L2 loads 2 and receives 5 (B, B, C, D,
    # B) by demotion; each block (one chunk, 32 layers) moves in CHUNK_NS, one at a time (serial).
    import json

    import pyarrow.parquet as pq

    from kvemu.replay import DataPathOptions, ReplayOptions, StoreOptions, TierOptions, replay

    spec = parse_tiers(f"promote=1;vemu:cxl-pool,{_V}|cap=16MiB;vemu:cxl-pool,{_V}|cap=32MiB")
    opts = ReplayOptions(datapath=DataPathOptions(chunk_tokens=16, link="cpu"), stores=StoreOptions(timing="serial"),
                         tier=TierOptions(stack=spec))
    meta = replay(docs_trace, spec.levels[0].backend, opts, out=tmp_path / "p.parquet")
    st = json.loads(json.dumps(meta["schedule"]["stack"]))
    rows = pq.read_table(meta["results_path"]).to_pydict()
    assert rows["tier_hit_tokens"] == [0, 0, 128, 0, 128, 0, 0, 0]
    l1, l2 = st["levels"]
    assert l1["promoted_blocks"] == 2 * 8 and l1["bytes_written"] == (6 + 2) * 8 * 2 * MIB
    assert l1["time_ns"] == pytest.approx((6 + 2) * 8 * CHUNK_NS, rel=1e-6)
    assert l2["bytes_written"] == 5 * 8 * 2 * MIB and l2["bytes_loaded"] == 2 * 8 * 2 * MIB
    assert l2["time_ns"] == pytest.approx((5 + 2) * 8 * CHUNK_NS, rel=1e-6)
