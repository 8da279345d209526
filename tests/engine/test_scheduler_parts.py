"""The scheduler's parts one at a time, against expectations worked out by hand: admission with its
prefix-cache and tier lookups, a prefill chunk under the token budget, the bookkeeping of
asynchronous loads, and the coroutine's protocol (StepPlan / Idle out, StepOutcome in)."""

from collections import deque

import numpy as np
import pytest

from kvemu.engine import EngineConfig, make_timing
from kvemu.engine.blocks import BlockTables
from kvemu.engine.pool import BlockPool, TierCache
from kvemu.engine.scheduler import (AsyncLoad, AsyncLoads, Chunk, EngineLog, Idle, Running, StepOutcome, StepPlan,
                                    admit, engine_caches, engine_steps, prefill_chunk)
from kvemu.models import resolve_model

TPB = 16


def _cached_in_pool(pool: BlockPool, ids) -> None:
    """``ids`` computed by a request that has finished: cached in the pool, referenced by none."""
    pool.reserve(len(ids))
    pool.register(ids)
    pool.release(ids, 0)


def _caches(policy="offload", pool_blocks=(), tier_blocks=(), hbm=None):
    cfg = EngineConfig(tokens_per_block=TPB, tier_policy=policy, hbm_kv_blocks=hbm)
    caches = engine_caches(cfg)
    _cached_in_pool(caches.pool, list(pool_blocks))
    if tier_blocks:
        caches.tier.add(list(tier_blocks))
    return caches


# ----------------------------------------------------------------------------- admission

def test_admission_reuses_the_pool_hit_and_loads_the_tier_hit_after_it():
    caches = _caches(pool_blocks=[10, 11], tier_blocks=[12, 13])
    # 80 input tokens: 5 full blocks, all shareable; at most 4 may hit (one token is always computed)
    r = admit(7, [10, 11, 12, 13, 14], 80, 3, 5, TPB, caches)
    assert (r.rid, r.inp, r.out) == (7, 80, 3)
    assert (r.load_first, r.load_count) == (2, 2)        # blocks 12, 13 come from the tier
    assert r.computed == 4 * TPB and r.n_reg == 4
    assert r.tier_hit == 2 * TPB                          # offload: the tier's share of the hit
    # 3 blocks reserved (all but the pool's 2), 2 of them registered at once as the tier's load
    assert r.reserved == 1 and caches.pool.reserved == 1
    assert {b: caches.pool.ref[b] for b in (10, 11, 12, 13)} == {10: 1, 11: 1, 12: 1, 13: 1}
    assert 14 not in caches.pool


def test_admission_always_leaves_a_token_to_compute():
    caches = _caches(pool_blocks=[1, 2])
    r = admit(0, [1, 2], 32, 1, 2, TPB, caches)   # both blocks cached, but the last token is computed
    assert r.computed == TPB and r.n_reg == 1 and r.load_count == 0 and r.tier_hit == 0


def test_admission_stops_at_the_first_miss_and_at_the_shareable_blocks():
    caches = _caches(pool_blocks=[1, 3], tier_blocks=[2, 4])
    r = admit(0, [1, 2, 9, 4, 5], 80, 1, 5, TPB, caches)
    assert (r.computed, r.load_first, r.load_count) == (2 * TPB, 1, 1)   # 1 in the pool, 2 in the tier, 9 missing
    caches = _caches(pool_blocks=[1, 2, 3])
    r = admit(0, [1, 2, 3, 4], 64, 1, 1, TPB, caches)   # only the first block is shareable
    assert r.computed == TPB


def test_admission_refused_when_the_pool_cannot_hold_it_touches_nothing():
    caches = _caches(pool_blocks=[1], hbm=3)
    assert admit(0, [1, 2, 3, 4], 64, 1, 4, TPB, caches) is None    # needs 3 new blocks beside the hit; 2 free
    assert caches.pool.reserved == 0 and caches.pool.ref == {1: 0} and caches.pool.evictions == 0
    # an unreferenced cached block is evicted to make room for a request that misses it
    r = admit(1, [5, 6, 7], 48, 1, 3, TPB, caches)
    assert r is not None and r.computed == 0 and caches.pool.evictions == 1 and 1 not in caches.pool


def test_resident_admission_counts_the_pool_hit_as_the_tiers():
    caches = _caches("resident", pool_blocks=[1, 2])
    assert caches.tier is None
    r = admit(0, [1, 2, 3], 48, 1, 3, TPB, caches)
    assert r.computed == 2 * TPB and r.tier_hit == 2 * TPB and r.load_count == 0


# ----------------------------------------------------------------------------- prefill chunks

def _fresh(table, inp, caches, rid=0):
    return admit(rid, table, inp, 1, len(table), TPB, caches)


def test_a_chunk_takes_what_the_budget_allows_and_stores_the_blocks_that_fill():
    caches = _caches()
    r = _fresh([1, 2, 3, 4, 5, 6, 7], 100, caches)
    c = prefill_chunk(r, 40, TPB, "offload", caches)
    # tokens 0..39: blocks 0 and 1 fill up (32 tokens), block 2 is partial
    assert c == Chunk(40, 0, 0, 0, 0, 2, 0, 0, True)
    assert r.computed == 40 and r.n_reg == 2 and r.reserved == 5
    assert list(caches.tier.blocks) == [1, 2] and 1 in caches.pool and 3 not in caches.pool
    c = prefill_chunk(r, 500, TPB, "offload", caches)
    # tokens 40..99: blocks 2..5 fill up (up to token 96); the last 4 tokens' block stays partial
    assert c == Chunk(60, 40, 0, 0, 2, 4, 0, 0, True)
    assert r.computed == 100 and r.n_reg == 6 and list(caches.tier.blocks) == [1, 2, 3, 4, 5, 6]


def test_a_chunk_carries_the_prefix_load_once():
    caches = _caches(tier_blocks=[1, 2])
    r = _fresh([1, 2, 3, 4], 60, caches)
    c = prefill_chunk(r, 8, TPB, "offload", caches)
    assert c == Chunk(8, 32, 0, 2, 0, 0, 0, 0, True)    # no block fills, but the load moves KV
    c = prefill_chunk(r, 8, TPB, "offload", caches)
    assert c == Chunk(8, 40, 0, 0, 2, 1, 0, 0, True)    # block 2 fills at token 48
    c = prefill_chunk(r, 8, TPB, "offload", caches)
    assert c == Chunk(8, 48, 0, 0, 0, 0, 0, 0, False)   # nothing moves


def test_chunks_without_a_tier_and_with_kv_resident_in_it():
    caches = _caches("none")
    r = _fresh([1, 2], 20, caches)
    c = prefill_chunk(r, 64, TPB, "none", caches)
    assert c == Chunk(20, 0, 0, 0, 0, 0, 0, 0, False) and 1 in caches.pool   # registered in HBM, not stored
    caches = _caches("resident")
    r = _fresh([1, 2, 3], 40, caches)
    assert prefill_chunk(r, 20, TPB, "resident", caches) == Chunk(20, 0, 0, 0, 0, 1, 0, 0, True)
    # from token 20: block 0 is read back from the tier, and block 1 (tokens 16..31) does not fill yet
    assert prefill_chunk(r, 10, TPB, "resident", caches) == Chunk(10, 20, 0, 0, 0, 0, 0, 1, True)


# ----------------------------------------------------------------------------- asynchronous loads

def test_async_loads_wait_for_their_completion_in_issue_order():
    loads = AsyncLoads()
    a, b = Running(3, [0], 32, 1, 2), Running(5, [0], 48, 1, 3)
    a.load_first, a.load_count = 1, 2
    b.load_first, b.load_count = 0, 3
    assert loads.issue(a) == AsyncLoad(3, 1, 2) and loads.issue(b) == AsyncLoad(5, 0, 3)
    assert a.load_count == 0 and b.load_count == 0   # no step carries them
    loads.completed({3: 500, 5: 200})
    assert loads.deadline() == 200
    assert loads.ready(199) == []
    assert loads.ready(200) == [b] and loads.in_flight == [a] and loads.deadline() == 500
    assert loads.ready(10_000) == [a]
    assert loads.in_flight == [] and loads.done_ns == {} and loads.deadline() is None


# ----------------------------------------------------------------------------- the coroutine

def test_the_engine_plans_steps_idles_and_takes_the_outcomes_it_is_sent():
    """Two requests routed at 0 to an engine with async loads: request 0's first two blocks are in
    the (shared) tier, so it waits for its load; request 1 runs meanwhile. Every plan worked out
    by hand, its compute from the GPU model's step_ns with the sums written out."""
    cfg = EngineConfig(tokens_per_block=TPB, max_num_batched_tokens=64, max_num_seqs=4, tier_policy="offload")
    timing = make_timing("H100-SXM", resolve_model("llama3-8b"))
    tables = BlockTables(TPB, np.array([0, 3, 5]), np.array([0, 1, 2, 3, 4]), np.array([3, 1]), 3, 5)
    shared = TierCache(None)
    shared.add([0, 1])
    caches = engine_caches(cfg, shared)
    assert caches.tier is shared
    log = EngineLog(2)
    inbox = deque([0, 1])
    gen = engine_steps(tables, np.zeros(2, np.int64), np.array([48, 20]), np.array([2, 1]), timing, cfg, log,
                       inbox=inbox, caches=caches, async_loads=True)
    # step 0: request 0's load is issued, request 1 prefills all 20 tokens (one block fills) and finishes
    p = next(gen)
    assert p == StepPlan(0, timing.step_ns(20, 20 * (0 + 21 / 2), 20, 0), 0, 1, True, 20, [1],
                         [AsyncLoad(0, 0, 2)])
    # nothing to run until the load is done
    assert gen.send(StepOutcome(1000, {0: 5000})) == Idle(5000)
    # step 1 at 5000: request 0 computes its last 16 input tokens, without the load (done apart)
    p = gen.send(5000)
    assert p == StepPlan(5000, timing.step_ns(16, 16 * (32 + 17 / 2), 48, 0), 1, 2, True, 16, [], [])
    # step 2: its one decode, and it finishes; a decode that moves no KV is a span of the log, not
    # one of the rows r0..r1 name (those the caller may have to move KV for)
    p = gen.send(StepOutcome(6000))
    assert p == StepPlan(6000, timing.step_ns(1, 49.0, 49, 1), 2, 2, False, 1, [0], [])
    with pytest.raises(StopIteration) as end:
        gen.send(StepOutcome(7000))
    assert end.value.value == {"steps": 3, "entries": 3, "hbm_evictions": 0, "tier_evictions": 0, "makespan_ns": 7000,
                         "finished": 2}
    e = log.take_entries()
    assert e["request_id"].tolist() == [1, 0, 0] and e["tokens"].tolist() == [20, 16, 1]
    assert e["context_tokens"].tolist() == [0, 32, 48] and e["load_count"].tolist() == [0, 0, 0]
    assert e["store_first"].tolist() == [0, 2, 0] and e["store_count"].tolist() == [1, 1, 0]
    assert log.cached.tolist() == [32, 0] and log.tier_hit.tolist() == [32, 0]
    assert list(shared.blocks) == [0, 1, 3, 2]


def test_an_idle_engine_ends_when_told_no_request_will_come():
    cfg = EngineConfig(tokens_per_block=TPB)
    timing = make_timing("H100-SXM", resolve_model("llama3-8b"))
    tables = BlockTables(TPB, np.array([0, 1]), np.array([0]), np.array([0]), 0, 1)
    gen = engine_steps(tables, np.zeros(1, np.int64), np.array([8]), np.array([1]), timing, cfg, EngineLog(1),
                       inbox=deque())
    assert next(gen) == Idle(None)
    with pytest.raises(StopIteration) as end:
        gen.send(None)
    stats = end.value.value
    assert stats["steps"] == 0 and stats["finished"] == 0
