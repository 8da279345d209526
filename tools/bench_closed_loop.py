#!/usr/bin/env python3
"""Closed-loop replay speed on the full Mooncake conversation trace, against recording it.

Records `../shared/traces/mooncake_conversation_trace.jsonl` (12,031 requests) for llama3-70b
under the offload policy (the baseline, timed in the same repetition), then replays that trace in
virtual time on `vemu:cxl-pool` twice: closed loop (the engine model schedules again, every step
with KV traffic through the C core) and, for comparison, the recorded schedule. Target: the
closed loop takes at most twice what recording takes (ratio record / closed >= 0.5). Skips with
a message when the trace file is absent.

    python tools/bench_closed_loop.py [--quick] [--repeat N] [--backend vemu:cxl-pool]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from bench_common import Stat, header, info, mooncake_path, parser, ratios, repeats, result

from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.replay import ReplayOptions, ScheduleOptions, replay


def main() -> int:
    ap = parser(__doc__, "1 repetition instead of 3")
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--backend", default="vemu:cxl-pool")
    a = ap.parse_args()
    reps = repeats(a, 1, 3)
    header("closed-loop replay of the full Mooncake conversation trace", a)
    path = mooncake_path()
    if not path.exists():
        for key in ("closed-loop.vs-record", "recorded.vs-record"):
            result("SKIP", key, f"{path} not found")
        return 0
    rec, closed, recorded = Stat(), Stat(), Stat()
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        for i in range(reps):
            trace = Path(d) / f"t{i}.parquet"
            t0 = time.perf_counter()
            record(f"mooncake:{path}", a.model, trace, RecordOptions.from_flat(show_progress=False))
            rec.add(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cm = replay(trace, a.backend, ReplayOptions(schedule=ScheduleOptions(schedule="closed")), out=Path(d) / f"c{i}.parquet")
            closed.add(time.perf_counter() - t0)
            t0 = time.perf_counter()
            rm = replay(trace, a.backend, ReplayOptions(schedule=ScheduleOptions(schedule="recorded")), out=Path(d) / f"r{i}.parquet")
            recorded.add(time.perf_counter() - t0)
            trace.unlink()
    eng = cm["schedule"]["engine"]
    info(f"model {a.model}, backend {a.backend}, all {cm['params']['reductions']['layers']['of']} layers; "
         f"{reps} repetitions; closed loop: {eng['steps']:,} steps, {eng['c_steps']:,} of them with KV traffic "
         f"(one C call each), makespan {eng['end_ns'] / 1e9:,.0f} s; recorded schedule: "
         f"{rm['steps']['count']:,} steps")
    for key, label, stat, target in (("closed-loop.vs-record", "closed loop", closed, 2.0),
                                     ("recorded.vs-record", "recorded schedule", recorded, None)):
        r = ratios(stat, rec)
        status = "INFO" if target is None else ("PASS" if r.median <= target else "FAIL")
        result(status, key, f"{label} {stat.fmt(1, 's')} | record (baseline) {rec.fmt(1, 's')} | ratio "
                            f"{r.fmt(2)}" + (f" | target <= {target:.2f}" if target else " (for comparison)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
