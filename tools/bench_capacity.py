#!/usr/bin/env python3
"""The capacity analysis of three policies on the full Mooncake conversation trace.

Runs what `kvemu analyze capacity TRACE --policies fifo,lru,optimal` computes (kvemu/capacity.py:
the default 24-point grid, each point's shares, modelled TTFT and cost) on a trace of the Mooncake
conversation workload recorded for llama3-70b (recorded here first, or given with --trace). Baseline,
measured in the same run before each analysis: one pass of LRU stack distances over the same prompt
block stream (`kvemu.backends.stack_distances`), which gives the LRU curve at every capacity.
Target: under 60 s for the analysis. Skips with a message when the workload file is absent.

    python tools/bench_capacity.py [--quick] [--repeat N] [--trace T.parquet] [--points 24]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench_common import Stat, header, info, mooncake_path, parser, repeats, result

from kvemu.analysis import input_block_stream
from kvemu.backends import stack_distances
from kvemu.capacity import StackAnalysis, default_level
from kvemu.prices import load_prices
from kvemu.schema import read_trace

TARGET_S = 60.0
POLICIES = ("fifo", "lru", "optimal")


def analyse(tr, points: int, prices) -> int:
    an = StackAnalysis(tr)
    n = 0
    for cap in an.grid(points):
        for pol in POLICIES:
            an.evaluate([default_level(20.0, cap * an.block_bytes)], pol, prices=prices, amortise_years=3.0)
            n += 1
    return n


def main() -> int:
    ap = parser(__doc__, "1 repetition instead of 3")
    ap.add_argument("--trace", default=None, help="a recorded trace (default: record the Mooncake trace first)")
    ap.add_argument("--points", type=int, default=24)
    a = ap.parse_args()
    reps = repeats(a, 1, 3)
    header("capacity analysis, three policies, full Mooncake conversation trace", a)
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        path = a.trace
        if path is None:
            src = mooncake_path()
            if not Path(src).exists():
                result("SKIP", "capacity.seconds", f"{src} not found")
                return 0
            from kvemu.record_options import RecordOptions
            from kvemu.recording import record

            path = Path(d) / "mc.parquet"
            record(f"mooncake:{src}", "llama3-70b", path, RecordOptions.from_flat(time_scale=5.0, show_progress=False))
        tr = read_trace(path)
        prices = load_prices()
        base, run = Stat(), Stat()
        for _ in range(reps):
            t0 = time.perf_counter()
            ids, _ = input_block_stream(tr)
            stack_distances(ids, int(tr.header.meta["blocks"]["id_space"]))
            base.add(time.perf_counter() - t0)
            t0 = time.perf_counter()
            n = analyse(tr, a.points, prices)
            run.add(time.perf_counter() - t0)
    info(f"trace {path}: {tr.n_requests} requests, {len(ids)} prompt-block references; {n} points "
         f"({a.points}-point grid x {len(POLICIES)} policies); {reps} repetitions")
    result("PASS" if run.median < TARGET_S else "FAIL", "capacity.seconds",
           f"analysis {run.fmt(2, 's')} | LRU stack distances (baseline) {base.fmt(2, 's')} | ratio "
           f"{run.median / base.median:.1f}x | target < {TARGET_S:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
