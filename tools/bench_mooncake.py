"""Mooncake Store as kvemu replays it: time of one batch put and get against object size and batch.

Through kvemu's own path (Backend("mooncake:allow_exposed=1"), accepting the client's listeners beyond
loopback: a master and a store client on loopback, the staging buffer registered, TCP transport), one
replayed layer, object = one block: stores of ``batch`` objects in one batch_upsert_from, then loads of them in one batch_get_into. Prints per
batch the median time (the client call alone, as replay charges it) with the spread of the
repetitions, per object, and the bytes per second. The baseline is the same client's single-object
put_from/get_into of the same sizes, timed here around the call, so the per-object saving of a
batch shows. INFO lines only: what this host's stack costs, for docs/performance.md and the
software-path figures of storage profiles (docs/tier-profiles.md).

    python tools/bench_mooncake.py [--quick] [--repeat N]
"""
from __future__ import annotations

import sys
import time

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

from bench_common import Stat, parser, repeats, result  # noqa: E402

from kvemu.backends import ENTRY_DTYPE, STEP_DTYPE, Backend  # noqa: E402
from kvemu.errors import BackendUnavailable  # noqa: E402

SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
BATCHES = (1, 16, 64)


def _one_step(n: int, op: str):
    entries = np.zeros(1, ENTRY_DTYPE)
    entries[0][f"{op}_count"] = n
    steps = np.array([(0, 1, 0, 0)], STEP_DTYPE)
    return (np.array([0, n], np.uint64), np.arange(n, dtype=np.uint32), steps, entries, np.ones(1, np.uint32))


def main() -> int:
    args = parser(__doc__, "fewer sizes and repetitions").parse_args()
    reps = repeats(args, quick=3, full=7)
    sizes = SIZES[1:4] if args.quick else SIZES
    try:
        Backend("mooncake:allow_exposed=1").close()
    except BackendUnavailable as e:
        result("SKIP", "mooncake", str(e))
        return 0
    for size in sizes:
        for batch in BATCHES:
            if size * batch > 256 << 20:
                continue
            with Backend("mooncake:allow_exposed=1") as b:
                b.prepare(size, 2 * batch, 1, 1, False)
                put, get = Stat(), Stat()
                store, load = _one_step(batch, "store"), _one_step(batch, "load")
                for _ in range(reps + 1):  # the first, connection set-up, is not counted
                    b.reset_stats()
                    b.replay(*store)
                    b.replay(*load)
                    put.add(b.op_stats("store")["busy_ns"] / 1e3)
                    get.add(b.op_stats("load")["busy_ns"] / 1e3)
                put.values, get.values = put.values[1:], get.values[1:]
                single = _single_calls(b, size, reps) if batch == 1 else None
                facts = b.describe()
            for op, st in (("put", put), ("get", get)):
                gbps = size * batch / (st.median * 1e3)
                result("INFO", f"mooncake.{op}.{size >> 10}k.x{batch}",
                       f"{op} of {batch} x {size >> 10} KiB in one batch: {st.fmt(1, 'us')} per batch, "
                       f"{st.median / batch:.1f} us per object, {gbps:.2f} GB/s "
                       f"({facts['transport']}, {facts['wire'].split(' ')[0]})")
            if single:
                result("INFO", f"mooncake.single.{size >> 10}k",
                       f"put_from / get_into of one {size >> 10} KiB object: {single[0].fmt(1, 'us')} / "
                       f"{single[1].fmt(1, 'us')} (the client called directly)")
    return 0


def _single_calls(b: Backend, size: int, reps: int):
    """The client's one-object calls on the same stack, timed around the call."""
    store = b.store.impl.store
    ptr = b.store.impl.staging_addr
    put, get = Stat(), Stat()
    for i in range(reps + 1):
        t0 = time.perf_counter_ns()
        rc_put = store.upsert_from("single", ptr, size)  # one key, overwritten: the segment never fills
        t1 = time.perf_counter_ns()
        rc_get = store.get_into("single", ptr + size, size)
        t2 = time.perf_counter_ns()
        if rc_put != 0 or rc_get != size:
            raise SystemExit(f"mooncake single calls of {size} bytes failed: put {rc_put}, get {rc_get}")
        if i:
            put.add((t1 - t0) / 1e3)
            get.add((t2 - t1) / 1e3)
    return put, get


if __name__ == "__main__":
    sys.exit(main())
