"""Reuse as the replay saw it: ``--tier-capacity`` bounds the replayed engine's tier (what it evicted
is recomputed, not loaded), each request's prompt tokens split into HBM hits, tier hits and
recomputed tokens from the replayed engine, and the tier's resident footprint from what it held.

Every expected figure is counted by hand below from the workload: 16-token blocks, 64-token hash
blocks (4 blocks each), every request 128 prompt tokens (8 full blocks) and one output token, one
second apart so each finishes before the next arrives, an HBM of 8 blocks (exactly one request:
the next request's unrelated blocks evict all of it), offload (write-through: every full input
block is stored to the tier). A request reuses at most 7 blocks (112 tokens): at least one token
is always computed, so its last full block is recomputed.
"""
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import make_workload, record
from kvemu.replay import (DataPathOptions, InstanceOptions, ReplayOptions, ScheduleOptions, TierOptions, replay)
from kvemu.report import build_report
from kvemu.report.results import read_results
from kvemu.schema import read_trace

TPB = 16


def _results(path):
    t = pq.read_table(path)
    return t.to_pydict(), json.loads(t.schema.metadata[b"kvemu"])


def _trace(tmp_path, hashes):
    wl = make_workload([1000.0 * i for i in range(len(hashes))], [128] * len(hashes), [1] * len(hashes), hashes)
    return record(wl, tmp_path / "t.parquet", tokens_per_block=TPB, hbm_kv_blocks=8, tier_policy="offload")


def _block_bytes(trace) -> int:
    h = read_trace(trace).header
    return h.block_bytes_per_layer * h.layers  # one block of every layer


@pytest.fixture(scope="module")
def evicting(tmp_path_factory):
    """r0 prefix [1,2], r1 [3,4] (evicts r0 from HBM), r2 [1,2] again: HBM holds r1's blocks only,
    so r2's prefix can come only from the tier."""
    return _trace(tmp_path_factory.mktemp("evicting"), [[1, 2], [3, 4], [1, 2]])


def test_unbounded_tier_serves_the_prefix_from_the_tier(evicting, tmp_path):
    rows, meta = _results(replay(evicting, "vemu:cxl-pool", ReplayOptions(datapath=DataPathOptions(chunk_tokens=16)),
                                 out=tmp_path / "r.parquet").path)
    # r2: HBM has r1's blocks (0 hits), the tier r0's 8 blocks: 7 of them reused, 1 recomputed
    assert rows["hbm_hit_tokens"] == [0, 0, 0]
    assert rows["tier_hit_tokens"] == [0, 0, 7 * TPB]
    assert rows["recomputed_tokens"] == [128, 128, TPB]
    assert rows["cached_tokens"] == [0, 0, 7 * TPB]
    assert rows["kv_bytes_loaded"] == [0, 0, 7 * _block_bytes(evicting)]
    assert meta["schedule"]["reuse_from"] == "replayed engine"


@pytest.mark.parametrize("capacity_blocks, r2_tier_blocks, evicted, peak", [
    # r1's 8 stored blocks evict all of r0's; r2 stores 8 again (r0's ids) and evicts r1's
    (8, 0, 16, 8),
    # r1 evicts r0's first 4 blocks (LRU: stored first), so r2's prefix misses at block 0; r2 stores
    # those 4 again (the other 4 are there) and evicts 4 of r1's
    (12, 0, 8, 12),
    # both requests fit: as unbounded; r2's one computed block is in the tier already
    (16, 7, 0, 16),
])
def test_tier_capacity_makes_evicted_chunks_misses(evicting, tmp_path, capacity_blocks, r2_tier_blocks, evicted, peak):
    bb = _block_bytes(evicting)
    opts = ReplayOptions(datapath=DataPathOptions(chunk_tokens=16),
                         tier=TierOptions(capacity_bytes=capacity_blocks * bb))
    rows, meta = _results(replay(evicting, "vemu:cxl-pool", opts, out=tmp_path / "r.parquet").path)
    assert rows["tier_hit_tokens"][2] == r2_tier_blocks * TPB
    assert rows["recomputed_tokens"][2] == 128 - r2_tier_blocks * TPB  # the prefill grows by what was evicted
    assert rows["kv_bytes_loaded"][2] == r2_tier_blocks * bb            # evicted chunks are not timed as loads
    # r2 stores the full blocks it computed
    assert rows["kv_bytes_stored"] == [8 * bb, 8 * bb, (8 - r2_tier_blocks) * bb]
    assert meta["tier"]["capacity_from"] == "--tier-capacity" and meta["tier"]["capacity_chunks"] == capacity_blocks
    assert meta["tier"]["load_misses_blocks"] == 0
    assert meta["schedule"]["engine"]["tier_evictions"] == evicted
    assert meta["tier"]["resident_bytes"] == peak * bb
    assert not any("timed as loads" in w for w in meta["warnings"])


def test_whole_chunks_are_evicted(evicting, tmp_path):
    """64-token chunks (4 blocks): a tier of 3 chunks. r0 stores 2 chunks, r1 2 more: r0's first
    chunk (blocks 0-3) goes, so r2's prefix misses at its first block and is recomputed."""
    bb = _block_bytes(evicting)
    opts = ReplayOptions(datapath=DataPathOptions(chunk_tokens=64), tier=TierOptions(capacity_bytes=3 * 4 * bb))
    rows, meta = _results(replay(evicting, "vemu:cxl-pool", opts, out=tmp_path / "r.parquet").path)
    assert rows["tier_hit_tokens"] == [0, 0, 0] and rows["recomputed_tokens"] == [128, 128, 128]
    assert meta["tier"]["capacity_chunks"] == 3 and meta["tier"]["load_misses_blocks"] == 0
    # r2 stores r0's first chunk again and touches its second (still held): r1's first chunk goes
    assert meta["schedule"]["engine"]["tier_evictions"] == 2 * 4


def test_recorded_schedule_counts_the_misses_and_keeps_the_recorded_steps(evicting, tmp_path):
    bb = _block_bytes(evicting)
    warnings = []
    opts = ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), datapath=DataPathOptions(chunk_tokens=16),
                         tier=TierOptions(capacity_bytes=8 * bb))
    res = replay(evicting, "vemu:cxl-pool", opts, out=tmp_path / "r.parquet", warn=warnings.append)
    rows, meta = _results(res.path)
    # the recorded steps load r2's 7 blocks; the tier of 8 evicted them when r1 stored its 8
    assert meta["tier"]["load_misses_blocks"] == 7
    assert rows["kv_bytes_loaded"] == [0, 0, 7 * bb]
    assert rows["tier_hit_tokens"] == [0, 0, 7 * TPB]  # the recording's split: its steps are replayed
    assert meta["schedule"]["reuse_from"] == "recording"
    assert any("recorded schedule keeps its steps" in w and "timed as loads" in w for w in warnings)


@pytest.fixture(scope="module")
def two_instances(tmp_path_factory):
    """Six requests, round-robin over instances A (even) and B (odd):
    r0 A [1,2], r1 B [1,2], r2 A [1,2], r3 B [3,4], r4 A [3,4], r5 B [1,2]."""
    return _trace(tmp_path_factory.mktemp("two"), [[1, 2], [1, 2], [1, 2], [3, 4], [3, 4], [1, 2]])


# Per request (hbm, tier) blocks, counted by hand:
#   replicated: r0 A computes all; r1 B has an empty HBM and tier: computes all; r2 A: r0's blocks in
#   A's HBM (7); r3 B: [3,4] nowhere; r4 A: A's tier holds [1,2] only; r5 B: B's HBM holds [3,4],
#   B's tier [1,2] (7).
#   shared: as replicated but r1 finds r0's blocks in the one tier (7), r4 finds r3's (7).
SPLIT = {"replicated": [(0, 0), (0, 0), (7, 0), (0, 0), (0, 0), (0, 7)],
         "shared": [(0, 0), (0, 7), (7, 0), (0, 0), (0, 7), (0, 7)]}
# distinct blocks each tier held at the end (nothing is evicted): A [1,2]+[3,4], B likewise; one tier: 16
RESIDENT = {"replicated": 32, "shared": 16}


@pytest.mark.parametrize("sharing", ["replicated", "shared"])
def test_two_instances_reuse_split_is_the_replayed_engines(two_instances, tmp_path, sharing):
    bb = _block_bytes(two_instances)
    opts = ReplayOptions(instances=InstanceOptions(count=2, sharing=sharing))
    out = replay(two_instances, "vemu:cxl-pool", opts, out=tmp_path / "r.parquet").path
    rows, meta = _results(out)
    assert rows["instance"] == [0, 1, 0, 1, 0, 1]
    hbm = [h * TPB for h, _ in SPLIT[sharing]]
    tier = [t * TPB for _, t in SPLIT[sharing]]
    assert rows["hbm_hit_tokens"] == hbm and rows["tier_hit_tokens"] == tier
    assert rows["recomputed_tokens"] == [128 - h - t for h, t in zip(hbm, tier)]
    assert rows["kv_bytes_loaded"] == [t * bb // TPB for t in tier]
    assert meta["tier"]["resident_bytes"] == RESIDENT[sharing] * bb
    assert meta["tier"]["replicated_bytes"] == 32 * bb and meta["tier"]["shared_bytes"] == 16 * bb
    # the report's reuse split is the same count, from these columns
    assert {"hbm_hit_tokens", "tier_hit_tokens", "recomputed_tokens"} <= set(read_results(out).table.column_names)
    (r,) = build_report([out]).groups[0].verdict.reuse
    assert (r.hit_hbm_tokens, r.hit_tier_tokens, r.missed_tokens) == (sum(hbm), sum(tier), 768 - sum(hbm) - sum(tier))
    # the recording (one engine, one HBM) found more in HBM than either replay
    rec = read_trace(two_instances)
    assert int((rec.cached_tokens - rec.tier_hit_tokens).sum()) > sum(hbm)


@pytest.mark.parametrize("capacity_blocks, r2_tier_blocks", [(8, 0), (16, 7)])
def test_resident_tier_capacity_bounds_the_engines_pool(tmp_path, capacity_blocks, r2_tier_blocks):
    """Under resident the pool is the tier: of 8 blocks, r1's 8 evict r0's and r2 recomputes its
    prefix; of 16, r2 reuses 7 of r0's blocks in place (no HBM hit: HBM holds no KV)."""
    wl = make_workload([0.0, 1000.0, 2000.0], [128] * 3, [1] * 3, [[1, 2], [3, 4], [1, 2]])
    trace = record(wl, tmp_path / "t.parquet", tokens_per_block=TPB, tier_policy="resident")
    bb = _block_bytes(trace)
    opts = ReplayOptions(datapath=DataPathOptions(chunk_tokens=16),
                         tier=TierOptions(capacity_bytes=capacity_blocks * bb))
    rows, meta = _results(replay(trace, "vemu:cxl-pool", opts, out=tmp_path / "r.parquet").path)
    assert rows["hbm_hit_tokens"] == [0, 0, 0]
    assert rows["tier_hit_tokens"] == [0, 0, r2_tier_blocks * TPB]
    assert rows["recomputed_tokens"] == [128, 128, 128 - r2_tier_blocks * TPB]
    # the pool held at most its capacity: 8 blocks a request, two at once when both fit
    assert meta["tier"]["resident_bytes"] == capacity_blocks * bb


def test_chunk_tier_cache_evicts_whole_chunks_lru():
    from kvemu.engine.pool import ChunkTierCache

    c = ChunkTierCache(2, 2)  # two chunks of two blocks
    a, b, d = [10, 11, 12, 13], [20, 21], [10, 11, 30, 31]  # d shares a's first chunk
    c.add_range(a, 0, 3)      # a's chunk (10, 11) and the first block of (12, 13)
    assert set(c.blocks) == {10, 11, 12} and c.prefix_hit(a, 0, 4) == 3
    c.add_range(b, 0, 2)      # a third chunk: the least recently used, a's first (10, 11), goes
    assert set(c.blocks) == {12, 20, 21} and c.evictions == 2 and c.prefix_hit(a, 0, 4) == 0
    c.add_range(d, 0, 2)      # (10, 11) again: evicts (12), stored before (20, 21)
    c.touch_range(b, 0, 1)    # (20, 21) used: now (10, 11) is the oldest
    c.add_range(d, 2, 4)      # (30, 31) evicts (10, 11)
    assert set(c.blocks) == {20, 21, 30, 31} and c.evictions == 2 + 1 + 2 and c.peak == 4
