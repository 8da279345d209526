"""The batched forms behind issue 43's memory and stack work agree with the one-at-a-time forms
they replace: a level's chunk run against its block-by-block puts, the unbounded tier's block set
against a dict, run expansion against a Python loop."""

import random

import numpy as np
import pytest

from kvemu.engine.pool import BlockSet, TierCache
from kvemu.replay.stack import LevelCache, TierStack, parse_tiers
from kvemu.schema import expand_runs


def _state(lv: LevelCache):
    return (dict(lv.chunks), dict(lv.where), list(lv.order.held), lv.held, lv.peak_blocks, lv.stored_blocks,
            lv.evicted_blocks)


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo"])
def test_put_run_equals_puts_block_by_block(policy):
    rng = random.Random(7)
    a, b = LevelCache(5, policy), LevelCache(5, policy)
    for _ in range(400):
        key = rng.randrange(12)
        # a chunk's blocks: ids key*8 .. key*8+7, a run of consecutive positions
        lo = rng.randrange(8)
        blocks = list(range(key * 8 + lo, key * 8 + min(8, lo + rng.randrange(1, 5))))
        out = a.put_run(key, blocks)
        gone_b = [g for x in blocks for g in b.put(key, x)]
        if out is None:  # refused: changed nothing; do it block by block
            assert policy not in ("lru", "fifo")
            out = ([], [g for x in blocks for g in a.put(key, x)])
        assert out[1] == gone_b
        assert _state(a) == _state(b)


def test_stack_write_back_counts_agree_with_a_block_by_block_stack():
    spec = parse_tiers("vemu:local-dram|cap=1GiB;vemu:cxl-pool|cap=1GiB;vemu:nvme|cap=1GiB")
    fast, slow = TierStack(spec, [3, 4, 5], 2), TierStack(spec, [3, 4, 5], 2)
    rng = random.Random(3)
    for r in range(60):
        table = [rng.randrange(40) * 2 + j for j in range(2)] + [100 + r * 4 + j for j in range(4)]
        fast.add_range(table, 0, len(table))
        for p in range(len(table)):  # the old path: _put block by block
            slow._put(0, table[p - p % 2], table[p], 0)
    for k in range(3):
        assert _state(fast.levels[k]) == _state(slow.levels[k])
        assert fast.levels[k].demoted_blocks == slow.levels[k].demoted_blocks
        assert fast.written[0][k] == slow.written[0][k]
    assert fast.gone_blocks == slow.gone_blocks > 0


def test_block_set_is_a_dict_of_blocks_in_first_stored_order():
    s, d = BlockSet(), {}
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(5000) for _ in range(rng.randrange(0, 6))]
        s.add_many(ids)
        for x in ids:
            d[x] = None
    assert list(s) == list(d) and len(s) == len(d)
    assert all((x in s) == (x in d) for x in range(6000))
    t = TierCache(None)
    t.add([3, 1, 2])
    assert t.prefix_hit([3, 1, 7, 2], 0, 4) == 2 and t.prefix_hit([9999999], 0, 1) == 0 and t.peak == 3


def test_expand_runs_against_a_loop():
    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        starts, counts = rng.integers(0, 500, n), rng.integers(0, 6, n)
        want = [s + i for s, c in zip(starts.tolist(), counts.tolist()) for i in range(c)]
        assert expand_runs(starts, counts).tolist() == want
