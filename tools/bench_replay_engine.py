#!/usr/bin/env python3
"""Replay engine throughput: block-layer accesses per second on the virtual-time backend.

`vemu` moves no data and never waits, so what is measured is kvemu itself: the replay core's
per-access loop (slot lookup, batching, the tier model, histograms, step composition) and, on
the full path, Python around it. One core, one thread.

  full path  `kvemu.replay(trace, "vemu:cxl-pool", ...)`: reading the trace, planning the arena,
             building the batches, every C call, the timeline and the results file; accesses /
             wall time of the whole call. The time spent inside the C calls is measured too
             (Backend.replay wrapped with a timer), so the Python share is visible.
  raw call   the very arrays that run handed to Backend.replay, replayed again on a fresh
             backend: accesses / time of those calls alone (the baseline of the full path).

Target: >= 5 million block-layer accesses per second, on both. Two traces: synthetic docqa
under the resident policy (decode reads the whole context from the tier every step: long runs of
blocks per entry), llama3-8b, all 32 layers; and the repository's sample of the first 500
Mooncake requests under offload (llama3-70b, all 80 layers: many entries of a few blocks, the
harder case for the per-entry work). --quick replays a quarter of the layers.

    python tools/bench_replay_engine.py [--quick] [--repeat N]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench_common import ReplaySpy, Stat, header, info, parser, ratios, repeats, result

from kvemu.backends import Backend
from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.replay import ReplayOptions, WindowOptions, replay

WORKLOAD = "synthetic:docqa:documents=6,questions=16"
MODEL = "llama3-8b"
SPEC = "vemu:cxl-pool"
TARGET = 5e6
#: a recorded sample of the repository: the first 500 Mooncake requests, llama3-70b, offload
SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "mooncake-first500-llama3-70b-offload.parquet"


def raw_replay(calls) -> float:
    """Seconds spent in Backend.replay replaying the captured calls on a fresh vemu backend."""
    total = 0.0
    b = None
    try:
        for geom, table_off, table_slots, steps, entries, layer_span in calls:
            if b is None:
                b = Backend(SPEC)
                b.prepare(geom["block_bytes"], geom["n_slots"], geom["n_layers_model"], geom["n_layers_replay"],
                          bool(geom["overlap"]))
            t0 = time.perf_counter()
            b.replay(table_off, table_slots, steps, entries, layer_span)
            total += time.perf_counter() - t0
    finally:
        if b is not None:
            b.close()
    return total


def main() -> int:
    ap = parser(__doc__, "3 repetitions instead of 5, a quarter of the layers")
    a = ap.parse_args()
    reps = repeats(a, 3, 5)
    header("replay engine throughput on vemu (virtual time)", a)
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        d = Path(d)
        docqa = d / "docqa.parquet"
        record(WORKLOAD, MODEL, docqa, RecordOptions.from_flat(tier_policy="resident", show_progress=False))
        cases = (("resident", f"{WORKLOAD} (resident), {MODEL}", docqa, 8 if a.quick else 32),
                 ("offload", f"{SAMPLE.name} (offload)", SAMPLE, 20 if a.quick else 80))
        for case, label, trace, layers in cases:
            full, in_c, raw = Stat(), Stat(), Stat()
            for i in range(reps):
                with ReplaySpy(keep_arrays=True) as spy:
                    t0 = time.perf_counter()
                    meta = replay(trace, SPEC, ReplayOptions(window=WindowOptions(layers=layers)), out=d / f"{case}{i}.parquet")
                    wall = time.perf_counter() - t0
                n = sum(meta["ops"][op]["accesses"] for op in meta["ops"])
                full.add(n / wall)
                in_c.add(n / spy.c_seconds)
                raw.add(n / raw_replay(spy.calls))
                calls, steps = spy.n_calls, meta["steps"]["count"]
                del spy
            per_op = ", ".join(f"{op} {meta['ops'][op]['accesses']:,}" for op in meta["ops"])
            entries = meta["trace"]["summary"].get("entries")
            info(f"{case}: {label}, --layers {layers}: {n:,} block-layer accesses ({per_op}), {steps:,} steps, "
                 f"{entries:,} entries, {calls} C calls; {reps} repetitions")
            for key, what, st in (("full", "full kvemu.replay path", full), ("raw", "raw Backend.replay", raw)):
                status = "PASS" if st.median >= TARGET else "FAIL"
                mps = Stat([v / 1e6 for v in st.values])
                result(status, f"engine.{case}.{key}", f"{what} {mps.fmt(2, 'M accesses/s')} = "
                                                       f"{1e9 / st.median:.1f} ns per access | target >= "
                                                       f"{TARGET / 1e6:.0f} M/s")
            r = ratios(full, raw)
            c_share = Stat([f / c for f, c in zip(full.values, in_c.values)]).median
            result("INFO", f"engine.{case}.python-share",
                   f"full / raw {r.fmt(3)}; inside kvemu.replay the C calls run at "
                   f"{Stat([v / 1e6 for v in in_c.values]).fmt(2)} M/s and take {c_share:.0%} of its wall time; "
                   f"Python and I/O add {1e9 / full.median - 1e9 / in_c.median:.1f} ns per access")
    return 0


if __name__ == "__main__":
    sys.exit(main())
