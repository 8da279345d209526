"""The data path (docs/replay.md): transfer workers, stores timed to memory, chunked transfers, the
link model, asynchronous stores and the step timeline. Each claim is checked against an oracle
written here: hand-computed times on a virtual-time tier whose model is exact, a small
discrete-event simulation of the store stream, bytes read back from the arena."""
import math
import os

import numpy as np
import pytest

from backend_helpers import csr, make_entries, make_steps, span
from kvemu.backends import STEP_DTYPE, Backend
from kvemu.errors import ConfigError

# A virtual-time tier with one access in flight and no overhead: a batch of n accesses of b bytes
# takes exactly n * (LAT + b / GBPS) ns (docs/tier-profiles.md, the batch model with c = 1).
LAT, GBPS = 1000.0, 10.0
VSPEC = f"vemu:cxl-pool,latency_ns={LAT},bandwidth_gbps={GBPS},concurrency=1,overhead_ns=0"


def vtier(block, n_slots=64, layers=1, overlap=False, chunk_blocks=1, **timing):
    b = Backend(VSPEC)
    b.prepare(block, n_slots, layers, layers, overlap, chunk_blocks)
    if timing:
        b.set_timing(**timing)
    return b


def medium_ns(n, nbytes):
    return n * (LAT + nbytes / GBPS)


# ------------------------------------------------------------------------------- the link model


@pytest.mark.parametrize("op", ["load", "store"])
def test_a_copy_batch_takes_the_slower_of_medium_and_link(op):
    block, n = 64 << 10, 10
    off, slots = csr([list(range(n))])
    ld, st = {"load": ((0, n), (0, 0)), "store": ((0, 0), (0, n))}[op]
    entries = make_entries([(0, ld, st, (0, 0))])
    medium = medium_ns(n, block)                     # 10 x (1000 + 6553.6) = 75,536 ns
    for gbps, setup, engines in [(0.0, 0.0, 1), (50.0, 2000.0, 2), (2.0, 0.0, 1), (100.0, 9000.0, 1)]:
        link = (n * block / gbps + math.ceil(n / engines) * setup) if gbps else 0.0
        with vtier(block, **{f"{op}_gbps": gbps, "setup_ns": setup, "engines": engines}) as b:
            out, _ = b.replay(off, slots, make_steps([(0, 1)]), entries, span(1))
            d = b.datapath_stats(op)
        want = max(medium, link)
        assert out[0][f"{op}_ns"] == pytest.approx(want, abs=2), (gbps, setup, engines)
        assert d["medium_ns"] == pytest.approx(medium, abs=2) and d["link_ns"] == pytest.approx(link, abs=2)
        assert d["time_ns"] == out[0][f"{op}_ns"]
        # "medium-bound" only where a limiting link was slower than nothing: the medium took longer
        assert d["medium_bound_ns"] == (d["time_ns"] if gbps and medium > link else 0)


def test_in_place_reads_are_bounded_by_littles_law():
    block, n = 4096, 16
    off, slots = csr([list(range(n))])
    entries = make_entries([(0, (0, 0), (0, 0), (0, n))])
    medium = medium_ns(n, block)
    nbytes = n * block
    for outstanding, line, lat_link, lat_tier, gbps in [(768, 128, 1000.0, 310.0, 50.0), (4, 64, 0.0, 5000.0, 50.0),
                                                        (0, 64, 0.0, 1e6, 1.0)]:
        little = nbytes * (lat_link + lat_tier) / (outstanding * line) if outstanding else 0.0
        want = max(medium, nbytes / gbps, little)
        with vtier(block, read_gbps=gbps, outstanding=outstanding, line_bytes=line, read_latency_ns=lat_link,
                   tier_latency_ns=lat_tier) as b:
            out, _ = b.replay(off, slots, make_steps([(0, 1)]), entries, span(1))
        assert out[0]["read_ns"] == pytest.approx(want, rel=1e-6, abs=2), (outstanding, lat_tier)


def test_bad_timing_is_refused():
    with vtier(4096) as b:
        for bad in [{"load_gbps": -1.0}, {"setup_ns": float("nan")}, {"engines": 0}, {"store_mode": 2},
                    {"store_mode": 1, "store_inflight_bytes": 0}, {"tier_latency_ns": float("inf")}]:
            with pytest.raises(Exception, match="timing"):
                b.set_timing(**bad)
        with pytest.raises(ConfigError, match="unknown timing"):
            b.set_timing(bogus=1)


# ----------------------------------------------------------------------------- chunked transfers


def test_consecutive_slots_of_one_chunk_move_as_one_transfer():
    block, cb = 4096, 4
    # positions 0..9 on slots 0..9: chunks [0-3] [4-7] [8-9]; then slots 12, 13 (chunk 3) and 2 (chunk 0)
    table = list(range(10)) + [12, 13, 2]
    off, slots = csr([table])
    with Backend("dram:hugepages=0") as b:
        b.prepare(block, 16, 1, 1, False, cb)
        for s in range(16):
            b.debug_poke("arena", s * block, bytes([s + 1]) * block)
        entries = make_entries([(0, (0, len(table)), (0, 0), (0, 0))])
        b.replay(off, slots, make_steps([(0, 1)]), entries, span(1))
        st = b.op_stats("load")
        # oracle: cut where the next slot is not the previous + 1 or crosses a multiple of cb
        cuts = 1 + sum(1 for a, c in zip(table, table[1:]) if c != a + 1 or c // cb != a // cb)
        assert st["accesses"] == cuts == 5
        assert st["bytes"] == len(table) * block
        # every block landed in staging in table order: one transfer moved its blocks contiguously
        got = b.debug_peek("staging", 0, len(table) * block)
        assert [got[i * block] for i in range(len(table))] == [s + 1 for s in table]


def test_chunk_of_one_block_keeps_one_transfer_per_block():
    off, slots = csr([list(range(8))])
    with Backend("dram:hugepages=0") as b:
        b.prepare(4096, 8, 1, 1, False)
        b.replay(off, slots, make_steps([(0, 1)]), make_entries([(0, (0, 8), (0, 0), (0, 0))]), span(1))
        assert b.op_stats("load")["accesses"] == 8


# ------------------------------------------------------------------------------- transfer workers


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_workers_move_every_byte_to_the_right_place(workers):
    """Batches of 1..40 blocks of 48 KiB split over the workers (a block may be cut between two):
    every byte lands where a serial copy would put it, for loads and stores."""
    block, n_slots = 48 << 10, 64
    rng = np.random.default_rng(workers)
    cpus = len(os.sched_getaffinity(0))   # before the pool pins this thread to one of them
    with Backend(f"dram:hugepages=0,workers={workers}") as b:
        b.prepare(block, n_slots, 1, 1, False)
        # never more workers than CPUs: an untimed wait for a CPU would inflate the figure
        assert b.describe()["workers"] == min(workers, cpus)
        assert b.describe()["staging_bytes"] == n_slots * block
        arena = rng.integers(0, 256, n_slots * block, np.uint8)
        b.debug_poke("arena", 0, arena.tobytes())
        cursor = 0   # the staging cursor: blocks are staged one after another, wrapping at the end
        for n in (1, 2, 7, 40):
            table = rng.choice(n_slots, n, replace=False).tolist()
            off, slots = csr([table])
            b.replay(off, slots, make_steps([(0, 1)]), make_entries([(0, (0, n), (0, 0), (0, 0))]), span(1))
            staging = np.frombuffer(b.debug_peek("staging", 0, n_slots * block), np.uint8)
            for k, s in enumerate(table):
                at = (cursor + k) % n_slots
                assert np.array_equal(staging[at * block:(at + 1) * block], arena[s * block:(s + 1) * block])
            cursor = (cursor + n) % n_slots
        # stores: staging -> arena
        pattern = rng.integers(0, 256, n_slots * block, np.uint8)
        b.debug_poke("staging", 0, pattern.tobytes())
        off, slots = csr([list(range(40))])
        b.replay(off, slots, make_steps([(0, 1)]), make_entries([(0, (0, 0), (0, 40), (0, 0))]), span(1))
        stored = np.frombuffer(b.debug_peek("arena", 0, 40 * block), np.uint8)
        for s in range(40):
            at = (cursor + s) % n_slots
            assert np.array_equal(stored[s * block:(s + 1) * block], pattern[at * block:(at + 1) * block])
        assert b.op_stats("store")["accesses"] == 40


def test_stores_are_timed_to_memory_and_say_how():
    with Backend("dram:hugepages=0") as b:
        b.prepare(4096, 4, 1, 1, False)
        assert b.describe()["store_writeback"] in ("clwb+sfence", "clflushopt+sfence", "clflush+mfence", "none")


def test_workers_option_is_checked():
    for bad in ("dram:workers=0", "dram:workers=x", "dram:workers=100000"):
        with pytest.raises(ConfigError, match="workers"):
            Backend(bad)


# ------------------------------------------------------------------- async stores and the timeline


def store_stream_oracle(steps, layers, bound):
    """A discrete-event simulation of the async composition (independent of kv_compose_step):
    each step is (ready, comp_per_layer, load_per_layer, store_per_layer, store_bytes_per_layer);
    a layer computes after its load (serial), issues its store when it ends into a FIFO stream, and
    waits first, while more than `bound` bytes would be in flight, for the oldest store."""
    clock, free, inflight = 0.0, 0.0, []   # inflight: [(done, bytes)]
    out = []
    for ready, comp, load, store, sbytes in steps:
        t = start = max(clock, ready)
        stall = 0.0
        for _ in range(layers):
            t += load + comp
            inflight = [(d, x) for d, x in inflight if d > t]
            while inflight and sum(x for _, x in inflight) + sbytes > bound:
                d = inflight[0][0]
                if d > t:
                    stall += d - t
                    t = d
                inflight = [(dd, x) for dd, x in inflight if dd > t]
            free = max(free, t) + store
            inflight.append((free, sbytes))
        clock = t
        out.append((start, t, stall))
    return out


@pytest.mark.parametrize("bound_blocks", [1, 2, 3, 100])
def test_async_stores_overlap_compute_and_stall_past_the_bound(bound_blocks):
    block, layers = 8192, 3
    store_one = medium_ns(1, block)     # one block stored per layer and step
    comp_layer = 500
    ready = [0, 0, 50_000, 50_000, 0, 0]
    off, slots = csr([[0, 1]])
    entries = make_entries([(0, (0, 0), (k % 2, 1), (0, 0)) for k in range(len(ready))])
    steps = np.zeros(len(ready), STEP_DTYPE)
    steps["entry_begin"] = np.arange(len(ready))
    steps["entry_end"] = np.arange(len(ready)) + 1
    steps["compute_ns"] = comp_layer * layers
    steps["ready_ns"] = ready
    bound = bound_blocks * block
    with vtier(block, n_slots=2, layers=layers, store_mode=1, store_inflight_bytes=bound) as b:
        out, _ = b.replay(off, slots, steps, entries, span(1, 1, 1))
        tl = b.timeline()
    want = store_stream_oracle([(r, comp_layer, 0, store_one, block) for r in ready], layers, bound)
    for k, (start, end, stall) in enumerate(want):
        assert out[k]["start_ns"] == pytest.approx(start, abs=layers * 2 + 2)
        assert out[k]["end_ns"] == pytest.approx(end, abs=layers * 2 * (k + 1) + 2)
        assert out[k]["stall_ns"] == pytest.approx(stall, abs=layers * 2 * (k + 1) + 2)
        assert out[k]["store_ns"] == pytest.approx(layers * store_one, abs=layers)
    if bound_blocks >= 100:
        assert all(o["stall_ns"] == 0 for o in out)       # stores never on the critical path
        assert out[0]["step_ns"] == comp_layer * layers
    # the stores drain after the last step
    assert tl["stores_done_ns"] >= tl["clock_ns"]


def test_serial_stores_keep_the_old_composition():
    block = 8192
    off, slots = csr([[0]])
    entries = make_entries([(0, (0, 1), (0, 1), (0, 0))])
    with vtier(block, n_slots=1, layers=2) as b:      # default: CPU link, serial stores
        out, _ = b.replay(off, slots, make_steps([(0, 1)], compute_ns=1000), entries, span(1, 1))
    assert out[0]["step_ns"] == pytest.approx(1000 + 2 * 2 * medium_ns(1, block), abs=4)


def test_steps_start_no_earlier_than_ready_and_the_previous_end():
    off, slots = csr([[0]])
    entries = make_entries([(0, (0, 0), (0, 0), (0, 0))] * 3)
    steps = np.zeros(3, STEP_DTYPE)
    steps["entry_begin"], steps["entry_end"] = [0, 1, 2], [1, 2, 3]
    steps["compute_ns"] = [100, 100, 100]
    steps["ready_ns"] = [0, 50, 1000]
    with vtier(4096, n_slots=1) as b:
        out, _ = b.replay(off, slots, steps, entries, span(1))
        # hand-computed: [0,100], [100,200], [1000,1100]; then a second call continues the clock
        assert [(o["start_ns"], o["end_ns"]) for o in out] == [(0, 100), (100, 200), (1000, 1100)]
        out, _ = b.replay(off, slots, steps[:1], entries[:1], span(1))
        assert (out[0]["start_ns"], out[0]["end_ns"]) == (1100, 1200)


def test_negative_ready_is_refused():
    off, slots = csr([[0]])
    steps = make_steps([(0, 1)])
    steps["ready_ns"] = -1
    with vtier(4096, n_slots=1) as b:
        with pytest.raises(Exception, match="ready_ns"):
            b.replay(off, slots, steps, make_entries([(0, (0, 0), (0, 0), (0, 0))]), span(1))


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs for two workers")
def test_two_workers_are_pinned_to_two_cpus_and_the_caller_is_released():
    # the thread that makes the C calls is worker 0, pinned while the backend lives (the main
    # thread, or the Backend's call thread where the wakeup fd is taken)
    before = os.sched_getaffinity(0)
    with Backend("dram:hugepages=0,workers=2") as b:
        b.prepare(1 << 20, 4, 1, 1, False)
        cpus = b.describe()["worker_cpus"]
        caller = b._calls._thread.native_id if b._calls is not None else 0
        assert len(set(cpus)) == 2 and os.sched_getaffinity(caller) == {cpus[0]}
    assert os.sched_getaffinity(0) == before


# ------------------------------------------------------------------------- an arena the size of the tier


def brute_lru(calls, capacity):
    """An LRU of `capacity` slots written plainly: lists, no links. Per call: (slots, fresh, evictions,
    evictions of a key the same call mapped)."""
    order, slot_of, out, free = [], {}, [], list(range(capacity))
    for keys in calls:
        inserted, slots, fresh, ev, mapped, own = set(), [], [], 0, set(), 0
        for k in keys:
            if k in slot_of:
                order.remove(k)
            elif free:
                slot_of[k] = free.pop(0)
                inserted.add(k)
            else:
                victim = order.pop(0)
                own += victim in mapped
                slot_of[k] = slot_of.pop(victim)
                inserted.discard(victim)
                inserted.add(k)
                ev += 1
            order.append(k)
            mapped.add(k)
            slots.append(slot_of[k])
            fresh.append(k in inserted)   # its data entered the tier during this call
        out.append((slots, fresh, ev, own))
    return out


def test_tier_slots_are_an_lru_of_the_tier_capacity():
    from kvemu.backends import TierSlots

    rng = np.random.default_rng(7)
    capacity = 5
    calls = [rng.integers(0, 12, rng.integers(1, 4)).tolist() for _ in range(200)]
    lru = TierSlots(capacity, 12)
    for keys, (slots, fresh, ev, own) in zip(calls, brute_lru(calls, capacity)):
        before = lru.evictions
        got_slots, got_fresh = lru.map(np.array(keys))
        assert got_slots.tolist() == slots and got_fresh.tolist() == fresh
        assert lru.evictions - before == ev and own == 0
    assert lru.resident == capacity and lru.overflow == 0


def test_a_call_larger_than_the_tier_evicts_its_own_chunks_in_order():
    from kvemu.backends import TierSlots

    # calls of up to 8 distinct keys through a tier of 3: the call's earliest keys leave first
    rng = np.random.default_rng(11)
    calls = [rng.integers(0, 10, rng.integers(1, 9)).tolist() for _ in range(200)]
    lru, own_total = TierSlots(3, 10), 0
    for keys, (slots, fresh, ev, own) in zip(calls, brute_lru(calls, 3)):
        before = lru.evictions
        got_slots, got_fresh = lru.map(np.array(keys))
        assert got_slots.tolist() == slots and got_fresh.tolist() == fresh
        assert lru.evictions - before == ev
        own_total += own
    assert own_total > 0 and lru.overflow == own_total
    # by hand: [1, 2, 3] through 2 slots: 3 takes 1's slot, 1 is gone, 2 and 3 stay
    two = TierSlots(2, 10)
    slots, fresh = two.map(np.array([1, 2, 3]))
    assert slots.tolist() == [0, 1, 0] and fresh.tolist() == [True, True, True] and two.overflow == 1
    slots, fresh = two.map(np.array([2, 3]))
    assert slots.tolist() == [1, 0] and fresh.tolist() == [False, False]
    with pytest.raises(Exception, match="key"):
        TierSlots(2, 10).map(np.array([10]))


def test_replay_with_a_small_tier_reuses_its_slots(tmp_path, chat_trace):
    from kvemu.replay import DataPathOptions, ReplayOptions, ScheduleOptions, StoreOptions, TierOptions, WindowOptions, replay

    # the recorded schedule: its steps are kept, so a smaller tier changes only where blocks land (in
    # closed loop it would change what the engine finds: tests/test_reuse.py)
    rec = ScheduleOptions(schedule="recorded")
    full = replay(chat_trace, "dram", ReplayOptions(schedule=rec, window=WindowOptions(layers=1), stores=StoreOptions(timing="serial")), out=tmp_path / "a.parquet")
    block = full["params"]["arena_bytes"] // full["params"]["arena_blocks"]   # one replayed layer
    cb = full["datapath"]["transfer"]["chunk_blocks"]
    layers = full["params"]["reductions"]["layers"]["of"]
    assert not full["tier"]["slots_reused"]
    small = replay(chat_trace, "dram", ReplayOptions(schedule=rec, window=WindowOptions(layers=1), stores=StoreOptions(timing="serial"), tier=TierOptions(capacity_bytes=8 * cb * layers * block)), out=tmp_path / "b.parquet")
    assert small["tier"]["slots_reused"] and small["tier"]["capacity_chunks"] == 8
    assert small["tier"]["capacity_from"] == "--tier-capacity"
    assert small["params"]["arena_bytes"] == 8 * cb * block < full["params"]["arena_bytes"]
    assert small["tier"]["evictions"] > 0
    # the same accesses and bytes: only where they land changed
    for op in ("load", "store", "read"):
        assert small["ops"][op]["bytes"] == full["ops"][op]["bytes"]
        assert small["ops"][op]["accesses"] == full["ops"][op]["accesses"]


FAST_TIER = """name = "fast"
kind = "memory"
latency_ns = 0
bandwidth_gbps = 100000
concurrency = 1048576
overhead_ns = 0
sources = ["test: a tier far faster than any link"]
"""


def test_tensor_parallel_ranks_each_move_their_kv_over_their_own_link(tmp_path):
    """llama3-8b at --tp 2: each rank holds 4 of the 8 KV heads and loads them over its own link, so
    the instance's KV moves at twice one link's bandwidth (the trace's gpu.kv_links). On a tier far
    faster than the link, over cxl-x16 (64 GB/s a direction, no copy setup), a load of B bytes is
    charged exactly B / (lanes x 64) ns of link time."""
    import json

    import pyarrow.parquet as pq

    from kvemu.record_options import RecordOptions
    from kvemu.recording import record
    from kvemu.replay import DataPathOptions, ReplayOptions, ScheduleOptions, StoreOptions, TierOptions, WindowOptions, replay

    prof = tmp_path / "fast.toml"
    prof.write_text(FAST_TIER)
    for tp in (1, 2):
        t = tmp_path / f"tp{tp}.parquet"
        record("synthetic:chat:sessions=4,turns=3", "llama3-8b", t,
               RecordOptions.from_flat(tp=tp, hbm_kv_gib=0.5, show_progress=False))
        r = tmp_path / f"r{tp}.parquet"
        replay(t, f"vemu:{prof}", ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), window=WindowOptions(layers=1), datapath=DataPathOptions(link="cxl-x16")), out=r)
        meta = json.loads(pq.read_schema(r).metadata[b"kvemu"])
        link = meta["datapath"]["link"]
        assert meta["datapath"]["link_lanes"] == tp and link["load_gbps"] == 64.0 * tp
        assert link["name"] == ("cxl-x16" if tp == 1 else "cxl-x16x2") and meta["datapath"]["link_requested"] == "cxl-x16"
        d = meta["datapath"]["ops"]["load"]
        assert d["bytes"] > 0 and d["link_ns"] > d["medium_ns"]  # the link binds, not the tier
        assert d["link_ns"] == pytest.approx(d["bytes"] / (64.0 * tp), abs=d["transfers"])
