#!/usr/bin/env python3
"""Recording throughput and trace size on the full Mooncake conversation trace.

Records `../shared/traces/mooncake_conversation_trace.jsonl` (relative to the repository root;
12,031 requests) for llama3-70b under the offload policy, as `kvemu record` does. Baseline,
measured in the same run before each recording: parsing the workload file alone
(`load_workload`). Targets: under 60 s to record, under 2 trace bytes per KV block operation
(a block of all layers stored, loaded or read; per block-layer access it is 1/80 of that).
Skips with a message when the trace file is absent.

    python tools/bench_record.py [--quick] [--repeat N] [--model llama3-70b] [--policy offload]
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path

from bench_common import Stat, header, info, mooncake_path, parser, repeats, result

from kvemu.analysis import trace_summary
from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.schema import read_trace
from kvemu.workloads import load_workload

TARGET_S = 60.0
TARGET_BYTES = 2.0


def main() -> int:
    ap = parser(__doc__, "1 repetition instead of 3")
    ap.add_argument("--workload", default=None, help="workload spec (default: the Mooncake conversation trace)")
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--policy", default="offload")
    a = ap.parse_args()
    reps = repeats(a, 1, 3)
    header("recording the full Mooncake conversation trace", a)
    workload = a.workload or f"mooncake:{mooncake_path()}"
    if workload.startswith("mooncake:") and not Path(workload[9:]).exists():
        result("SKIP", "record.seconds", f"{workload[9:]} not found")
        result("SKIP", "record.bytes-per-block-op", f"{workload[9:]} not found")
        return 0
    base, rec = Stat(), Stat()
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        for i in range(reps):
            t0 = time.perf_counter()
            w = load_workload(workload)
            base.add(time.perf_counter() - t0)
            out = Path(d) / f"t{i}.parquet"
            t0 = time.perf_counter()
            record(workload, a.model, out, RecordOptions.from_flat(tier_policy=a.policy, show_progress=False))
            rec.add(time.perf_counter() - t0)
        t = read_trace(out)
        s, layers = trace_summary(t), t.header.layers
    ops = s["kv_blocks_stored"] + s["kv_blocks_loaded"] + s["kv_blocks_read"]
    per_op = s["file_bytes"] / max(ops, 1)
    info(f"workload {workload} ({w.n_requests} requests), model {a.model}, policy {a.policy}; {reps} repetitions")
    info(f"trace: {s['file_bytes'] / 2**20:.1f} MiB, {s['steps']} steps, {s['entries']} entries, {ops} block ops "
         f"(stored {s['kv_blocks_stored']}, loaded {s['kv_blocks_loaded']}, read {s['kv_blocks_read']}); "
         f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    result("PASS" if rec.median < TARGET_S else "FAIL", "record.seconds",
           f"record {rec.fmt(2, 's')} | parse only (baseline) {base.fmt(2, 's')} | ratio {rec.median / base.median:.0f}x "
           f"| target < {TARGET_S:.0f} s")
    result("PASS" if per_op < TARGET_BYTES else "FAIL", "record.bytes-per-block-op",
           f"{per_op:.3f} B per block op ({s['file_bytes']} B / {ops} ops; "
           f"{per_op / layers:.4f} B per block-layer access) | target < {TARGET_BYTES:g} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
