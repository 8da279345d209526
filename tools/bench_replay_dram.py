#!/usr/bin/env python3
"""DRAM replay bandwidth against a plain C loop over the same block size and arena, same run.

Records two traces: a load-heavy one (synthetic docqa, offload policy, a tiny HBM so that every
prefix hit is loaded back from the tier) and a read-heavy one (resident policy: decode reads the
whole context in the tier). Replays each with `replay_trace` on `dram` (cold=1, the default:
lines flushed after each timed access) and `dram:cold=0`, and runs tools/c/membw.c, compiled here,
over an arena of the same size with blocks of the same size at random slots:

  load  vs  memcpy into a 64 MiB staging buffer (kvemu's load), the same number of accesses;
  read  vs  a summing loop, one 8-byte load per 64-byte line (kvemu's read semantics).

Like with like: cold=1 is compared with the C loop that flushes each block after copying it
(each copy bracketed by lfence;rdtsc;lfence, as kvemu does, so the flushes stay out of the timed
region); cold=0 with the plain loop timed end to end. The headline is cold=1, what a replay gets
by default. kvemu's figure is the results' ops[op].gbps (bytes / summed access time).

    python tools/bench_replay_dram.py [--quick] [--repeat N] [--layers K]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench_common import Stat, compile_c, header, info, parser, ratio_result, repeats, run_json

from kvemu.recording import record_workload
from kvemu.replay import replay_trace

LOAD_WORKLOAD = "synthetic:docqa:documents=6,questions=16"
READ_WORKLOAD = "synthetic:docqa:documents=2,questions=4"
MODEL = "llama3-8b"
TARGET = 0.90
#: C baseline accesses at most (a reads trace has ~660 k; 200 k of 64 KiB is ~13 GB, plenty).
MAX_BASELINE_ACCESSES = 200_000


def main() -> int:
    ap = parser(__doc__, "3 repetitions instead of 5")
    ap.add_argument("--layers", type=int, default=2, help="replayed layers (default 2)")
    a = ap.parse_args()
    reps = repeats(a)
    header("DRAM replay bandwidth vs a plain C loop", a)
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        d = Path(d)
        membw = compile_c("membw", d)
        traces = {"load": d / "load.parquet", "read": d / "read.parquet"}
        record_workload(LOAD_WORKLOAD, MODEL, traces["load"], tier_policy="offload", hbm_kv_gib=1.6,
                        show_progress=False)
        record_workload(READ_WORKLOAD, MODEL, traces["read"], tier_policy="resident", show_progress=False)
        c_op = {"load": "copy", "read": "sum"}
        figs = {(op, mode): Stat() for op in ("load", "read") for mode in ("kv-cold", "kv-warm", "c-cold", "c-warm")}
        geometry = {}
        for i in range(reps):
            for op, trace in traces.items():
                for cold in (1, 0):
                    meta = replay_trace(trace, f"dram:cold={cold}", d / f"{op}{i}{cold}.parquet",
                                        replay_layers=a.layers)
                    st = meta["ops"][op]
                    figs[op, "kv-cold" if cold else "kv-warm"].add(st["gbps"])
                    block = st["bytes"] // st["accesses"]
                    geometry[op] = (meta["params"]["arena_bytes"], block, st["accesses"],
                                    meta["backend"]["facts"].get("arena_hugepage_bytes"))
                arena, block, n, _ = geometry[op]
                for flush in (1, 0):
                    out = run_json([membw, c_op[op], arena, block, min(n, MAX_BASELINE_ACCESSES), flush, 1])
                    figs[op, "c-cold" if flush else "c-warm"].add(out["gbps"][0])
    for op in ("load", "read"):
        arena, block, n, huge = geometry[op]
        info(f"{op}: trace {LOAD_WORKLOAD if op == 'load' else READ_WORKLOAD} ({'offload, hbm 1.6 GiB' if op == 'load' else 'resident'}), "
             f"{MODEL}, --layers {a.layers}: {n} {op}s of {block} B per replay, arena {arena / 2**20:.0f} MiB "
             f"({(huge or 0) / max(arena, 1):.0%} huge pages); C loop: {min(n, MAX_BASELINE_ACCESSES)} accesses "
             f"at random slots; {reps} repetitions, interleaved")
    base = {"load": "C memcpy loop", "read": "C sum loop"}
    for op in ("load", "read"):
        ratio_result(f"dram.{op}.cold", "kvemu dram (cold=1, headline)", figs[op, "kv-cold"],
                     f"{base[op]} + clflush", figs[op, "c-cold"], "GB/s", TARGET)
        ratio_result(f"dram.{op}.warm", "kvemu dram:cold=0", figs[op, "kv-warm"],
                     base[op], figs[op, "c-warm"], "GB/s", TARGET)
    return 0


if __name__ == "__main__":
    sys.exit(main())
