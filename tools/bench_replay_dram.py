#!/usr/bin/env python3
"""DRAM replay bandwidth against a plain copy of the same blocks, measured in the same run.

Records a load-heavy synthetic trace (offload policy, tiny HBM: every prefix hit is loaded from
the tier), replays it on `dram` (cache-cold and warm), and copies the same number of blocks of the
same size between a same-sized arena and a staging buffer with numpy (memcpy underneath) as the
baseline. Prints GB/s per op and the ratio to the baseline, median and spread of N repetitions.

    python tools/bench_replay_dram.py [--repeat 3] [--layers 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvemu.recording import record_workload
from kvemu.replay import replay_trace

WORKLOAD = "synthetic:docqa:documents=6,questions=16"


def baseline_gbps(arena_bytes: int, block: int, n: int) -> float:
    arena = np.ones(arena_bytes, np.uint8)
    staging = np.ones(min(64 << 20, arena_bytes), np.uint8)
    slots = arena_bytes // block
    st = len(staging) // block
    order = np.random.default_rng(0).integers(0, slots, n)
    t0 = time.perf_counter()
    for i, s in enumerate(order.tolist()):
        j = i % st
        np.copyto(staging[j * block:(j + 1) * block], arena[s * block:(s + 1) * block])
    return n * block / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "t.parquet"
        record_workload(WORKLOAD, "llama3-8b", trace, tier_policy="offload", hbm_kv_gib=1.6, show_progress=False)
        rows = {"cold": [], "warm": [], "base": []}
        meta = None
        for i in range(a.repeat):
            for mode in ("cold", "warm"):
                meta = replay_trace(trace, f"dram:cold={int(mode == 'cold')}", Path(d) / f"r{i}{mode}.parquet",
                                    replay_layers=a.layers)
                rows[mode].append(meta["ops"]["load"]["gbps"])
            ld = meta["ops"]["load"]
            rows["base"].append(baseline_gbps(meta["params"]["arena_bytes"], ld["bytes"] // ld["accesses"],
                                              ld["accesses"]))
    ld = meta["ops"]["load"]
    print(f"trace: {WORKLOAD} on llama3-8b, {ld['accesses']} loads of {ld['bytes'] // ld['accesses']} B, "
          f"arena {meta['params']['arena_bytes'] / 2**20:.0f} MiB, {a.repeat} repetitions")
    base = statistics.median(rows["base"])
    for k in ("base", "warm", "cold"):
        v = rows[k]
        name = {"base": "numpy copy (baseline)", "warm": "dram:cold=0 load", "cold": "dram load (cold)"}[k]
        print(f"{name:24s} median {statistics.median(v):6.2f} GB/s [{min(v):.2f}-{max(v):.2f}]  "
              f"ratio {statistics.median(v) / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
