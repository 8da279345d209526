#!/usr/bin/env python3
"""Recording throughput and trace size on the full Mooncake conversation trace.

Baseline measured in the same run: parsing the workload file alone (load_workload). Prints the
time to record, the ratio to the baseline, trace bytes per block operation and peak RSS.

    python tools/bench_record.py [--model llama3-70b] [--policy offload] [--repeat 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvemu.analysis import trace_summary
from kvemu.recording import record_workload
from kvemu.schema import read_trace
from kvemu.workloads import load_workload

DEFAULT_SRC = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default=f"mooncake:{DEFAULT_SRC}")
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--policy", default="offload")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if a.workload.startswith("mooncake:") and not Path(a.workload[9:]).exists():
        print(f"skip: {a.workload[9:]} not found", file=sys.stderr)
        return 0
    base, rec = [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.repeat):
            t0 = time.perf_counter()
            w = load_workload(a.workload)
            base.append(time.perf_counter() - t0)
            out = Path(d) / f"t{i}.parquet"
            t0 = time.perf_counter()
            record_workload(a.workload, a.model, out, tier_policy=a.policy, show_progress=False)
            rec.append(time.perf_counter() - t0)
        s = trace_summary(read_trace(out))
    ops = s["kv_blocks_stored"] + s["kv_blocks_loaded"] + s["kv_blocks_read"]
    med_b, med_r = statistics.median(base), statistics.median(rec)
    print(f"workload: {a.workload} ({w.n_requests} requests), model {a.model}, policy {a.policy}")
    print(f"parse only (baseline): median {med_b:.2f} s  [{min(base):.2f}-{max(base):.2f}]")
    print(f"record:                median {med_r:.2f} s  [{min(rec):.2f}-{max(rec):.2f}]  "
          f"= {med_r / med_b:.0f}x baseline  (target < 60 s: {'PASS' if med_r < 60 else 'FAIL'})")
    print(f"trace: {s['file_bytes'] / 2**20:.1f} MiB, {s['steps']} steps, {s['entries']} entries, {ops} block ops "
          f"-> {s['file_bytes'] / max(ops, 1):.3f} B per block op (target < 2: "
          f"{'PASS' if s['file_bytes'] / max(ops, 1) < 2 else 'FAIL'})")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
