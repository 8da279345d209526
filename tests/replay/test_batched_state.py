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


@pytest.mark.parametrize("policy", ["lru", "fifo", "s3fifo"])
def test_put_runs_in_stretches_equal_puts_block_by_block(policy):
    # batches of runs where blocks repeat across runs, some are held already (under their own chunk
    # or another), and a batch holds more chunks than the level: the stretch path, the run-alone
    # path and the refusals all against one put per block
    rng = random.Random(11)
    a, b = LevelCache(4, policy), LevelCache(4, policy)
    for _ in range(300):
        runs = []
        for _ in range(rng.randrange(1, 7)):
            key = rng.randrange(10) * 8
            lo = rng.randrange(8)
            runs.append((key, [key + x for x in range(lo, min(8, lo + rng.randrange(1, 5)))]))
        if rng.random() < 0.1:  # a block held under another chunk's key: refused from there on
            held = sorted(a.where)
            if held:
                runs.append((999 * 8, [rng.choice(held)]))
        i, gone_a = 0, []
        while i < len(runs):
            j, fresh, gone = a.put_runs([(k, list(r)) for k, r in runs], i)
            gone_a += gone
            if j < len(runs):  # the run it stopped at, block by block
                gone_a += [g for x in runs[j][1] for g in a.put(runs[j][0], x)]
                j += 1
            i = j
        gone_b = [g for k, r in runs for x in r for g in b.put(k, x)]
        assert gone_a == gone_b
        assert _state(a) == _state(b)
        assert a.demoted_blocks == b.demoted_blocks


def test_block_log_counts_each_block_once_across_compactions():
    from kvemu.replay.stack import BlockLog

    log, seen = BlockLog(), set()
    log.limit = 50  # compact often
    rng = random.Random(4)
    for _ in range(500):
        ids = [rng.randrange(300) for _ in range(rng.randrange(0, 9))]
        if len(ids) == 1:
            log.add(ids[0])
        else:
            log.update(ids)
        seen.update(ids)
    assert log.distinct().tolist() == sorted(seen) and len(log) == len(seen)


def test_shared_write_through_stack_with_two_instances_agrees_with_block_by_block():
    # two instances, a private top and shared lower levels: the runs path (owners, dedup logs,
    # cross-instance hits) against puts and serves block by block
    spec = parse_tiers("placement=write-through;vemu:local-dram|cap=1GiB;vemu:cxl-pool|cap=1GiB,sharing=shared;"
                       "vemu:nvme|cap=1GiB,sharing=shared")
    fast, slow = TierStack(spec, [2, 6, 9], 2, instances=2), TierStack(spec, [2, 6, 9], 2, instances=2)
    rng = random.Random(9)
    for r in range(80):
        inst = r % 2
        table = [rng.randrange(5) * 2 + j for j in range(2)] + [200 + r * 4 + j for j in range(4)]
        for st in (fast, slow):
            t = st.prefix_hit(table, 0, len(table), inst)
            if t:
                if st is fast:
                    st.touch_range(table, 0, t, inst)
                else:
                    st._touch_each(table, 0, t, inst)
        fast.add_range(table, 0, len(table), inst)
        for k in range(3):
            for p in range(len(table)):
                slow._put(k, table[p - p % 2], table[p], inst)
    assert fast.summary(16, 1000) == slow.summary(16, 1000)
    assert fast.cross_blocks == slow.cross_blocks and sum(fast.cross_blocks) > 0
    for i in range(2):
        for k in range(3):
            assert _state(fast.by_instance[i][k]) == _state(slow.by_instance[i][k])


@pytest.mark.parametrize("distinct", [True, False])
def test_local_tables_against_a_request_by_request_oracle(distinct):
    """A C call's block tables: each request once (the closed loop's calls, elementwise) or with
    several entries (a recorded batch, through np.unique and ufunc.at): the same tables as a loop
    over the entries' ranges, request by request."""
    from kvemu.replay.arena import LocalTables
    from kvemu.schema import OPS, TraceData

    rng = np.random.default_rng(5 if distinct else 6)
    n_req = 9
    counts = rng.integers(1, 4, n_req * 3)  # three runs per request, ids far apart
    run_start = np.arange(len(counts)) * 1000 + rng.integers(0, 50, len(counts))
    run_offsets = np.arange(0, len(counts) + 1, 3)
    table_offsets = np.r_[0, np.cumsum(np.add.reduceat(counts, run_offsets[:-1]))]
    trace = TraceData(None, *([None] * 6), table_offsets.astype(np.int64), run_offsets.astype(np.int64),
                      run_start.astype(np.int64), counts.astype(np.int64), None, None, None)
    ids_of = [trace.table_ids[table_offsets[r]:table_offsets[r + 1]].tolist() for r in range(n_req)]
    for _ in range(30):
        rid = (np.sort(rng.choice(n_req, rng.integers(1, 5), replace=False)) if distinct
               else rng.integers(0, n_req, rng.integers(2, 7)))
        e = {"request_id": rid.astype(np.int32)}
        for op in OPS:
            size = np.diff(table_offsets)[rid]
            first = rng.integers(0, size)
            e[f"{op}_first"] = first.astype(np.uint32)
            e[f"{op}_count"] = np.where(rng.random(len(rid)) < 0.3, 0, rng.integers(0, size - first + 1)).astype(np.uint32)
        t = LocalTables(trace, e)
        reqs = sorted(set(rid.tolist()))
        assert t.requests.tolist() == reqs
        assert [reqs[i] for i in t.local] == rid.tolist()
        ids = t.ids.tolist()
        for k, r in enumerate(reqs):
            spans = [(int(e[f"{op}_first"][i]), int(e[f"{op}_first"][i] + e[f"{op}_count"][i]))
                     for i in range(len(rid)) if rid[i] == r for op in OPS if e[f"{op}_count"][i] > 0]
            lo = min((a for a, _ in spans), default=None)
            hi = max((b for _, b in spans), default=None)
            table = ids[int(t.table_off[k]):int(t.table_off[k + 1])]
            assert table == ([] if lo is None else ids_of[r][lo:hi])
            if lo is not None:
                assert t.base[k] == lo
        for i in range(len(rid)):
            for op in OPS:
                c = int(e[f"{op}_count"][i])
                assert t.count[op][i] == c
                if c:  # the entry's range, rebased onto its request's local table
                    k = t.local[i]
                    got = ids[int(t.table_off[k]) + int(t.first[op][i]):][:c]
                    f = int(e[f"{op}_first"][i])
                    assert got == ids_of[rid[i]][f:f + c]
