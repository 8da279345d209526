#!/usr/bin/env python3
"""DRAM replay bandwidth against a plain C loop over the same block size and arena, same run.

Records two traces: a load-heavy one (synthetic docqa, offload policy, a tiny HBM so that every
prefix hit is loaded back from the tier) and a read-heavy one (resident policy: decode reads the
whole context in the tier). Replays each with `replay_trace` on `dram` (cold=1, the default:
lines flushed after each timed access) and `dram:cold=0`, and runs tools/c/membw.c, compiled here,
over an arena of the same size, with the same block size, accessing **the same sequence of arena
offsets** the replay performed (captured from the arrays handed to Backend.replay):

  load  vs  memcpy into a 64 MiB staging buffer filled front to back (kvemu's load);
  read  vs  a summing loop, one 8-byte load per 64-byte line (kvemu's read semantics).

Like with like: cold=1 is compared with the C loop that flushes each block after touching it
(each access bracketed by lfence;rdtsc;lfence, as kvemu does, so the flushes stay out of the
timed region); cold=0 with the plain loop timed end to end. The headline is cold=1, what a replay
gets by default. kvemu's figure is the results' ops[op].gbps (bytes / summed access time). The
full run adds the C loop over random slots (INFO): the access order alone moves the figure.
INFO lines also give kvemu's raw C call (Backend.replay) on the same offsets, back to back.

    python tools/bench_replay_dram.py [--quick] [--repeat N]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench_common import ReplaySpy, Stat, ratios, compile_c, header, info, parser, ratio_result, repeats, result, run_json

import numpy as np

from kvemu.backends import ENTRY_DTYPE, STEP_DTYPE, Backend
from kvemu.recording import record_workload
from kvemu.replay import replay_trace

OPS = ("load", "read")
WORKLOADS = {"load": "synthetic:docqa:documents=6,questions=16", "read": "synthetic:docqa:documents=4,questions=2,output_min_tokens=10,output_max_tokens=40"}
LAYERS = {"load": 2, "read": 2}
MODEL = "llama3-8b"
TARGET = 0.90


def raw_gbps(spec: str, op: str, arena: int, block: int, offsets) -> float:
    """kvemu's C path alone: one request whose block table is the offsets' slots, one step, one layer."""
    slots = (offsets // np.uint64(block)).astype(np.uint32)
    entries = np.zeros(1, ENTRY_DTYPE)
    entries[f"{op}_count"] = len(slots)
    steps = np.array([(0, 1, 0, 0)], STEP_DTYPE)
    with Backend(spec) as b:
        b.prepare(block, arena // block, 1, 1, False)
        b.replay(np.array([0, len(slots)], np.uint64), slots, steps, entries, np.ones(1, np.uint32))
        st = b.op_stats(op)
    return st["bytes"] / st["busy_ns"]


def main() -> int:
    a = parser(__doc__, "5 repetitions instead of 9, no random-order runs").parse_args()
    reps = repeats(a, 5, 9)
    header("DRAM replay bandwidth vs a plain C loop", a)
    c_op = {"load": "copy", "read": "sum"}
    kinds = ("kv-cold", "kv-warm", "c-cold", "c-warm", "rnd-cold", "rnd-warm", "raw-cold", "raw-warm")
    figs = {(op, k): Stat() for op in OPS for k in kinds}
    geometry = {}
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        d = Path(d)
        membw = compile_c("membw", d)
        traces = {op: d / f"{op}.parquet" for op in OPS}
        record_workload(WORKLOADS["load"], MODEL, traces["load"], tier_policy="offload", hbm_kv_gib=1.6,
                        show_progress=False)
        record_workload(WORKLOADS["read"], MODEL, traces["read"], tier_policy="resident", show_progress=False)
        for i in range(reps):
            for op, trace in traces.items():
                for cold in (1, 0):
                    mode = "cold" if cold else "warm"
                    with ReplaySpy(keep_arrays=op not in geometry) as spy:
                        meta = replay_trace(trace, f"dram:cold={cold}", d / f"{op}{i}{cold}.parquet",
                                            replay_layers=LAYERS[op])
                    st = meta["ops"][op]
                    figs[op, "kv-" + mode].add(st["gbps"])
                    if spy.calls:
                        offsets = spy.arena_offsets(op)
                        assert len(offsets) == st["accesses"], (len(offsets), st["accesses"])
                        offsets.tofile(d / f"{op}.offsets")
                        geometry[op] = (meta["params"]["arena_bytes"], st["bytes"] // st["accesses"],
                                        st["accesses"], meta["backend"]["facts"].get("arena_hugepage_bytes"),
                                        offsets)
                    arena, block, n, _, offsets = geometry[op]
                    # the baseline right after the replay it is paired with
                    out = run_json([membw, c_op[op], arena, block, f"@{d / f'{op}.offsets'}", cold, 1])
                    figs[op, "c-" + mode].add(out["gbps"][0])
                    figs[op, "raw-" + mode].add(raw_gbps(f"dram:cold={cold}", op, arena, block, offsets))
                    if not a.quick:
                        out = run_json([membw, c_op[op], arena, block, min(n, 200_000), cold, 1])
                        figs[op, "rnd-" + mode].add(out["gbps"][0])
    for op in OPS:
        arena, block, n, huge, _ = geometry[op]
        info(f"{op}: {WORKLOADS[op]} ({'offload, --hbm-kv-gib 1.6' if op == 'load' else 'resident'}), {MODEL}, "
             f"--layers {LAYERS[op]}: {n} {op}s of {block} B per replay, arena {arena / 2**20:.0f} MiB "
             f"({(huge or 0) / max(arena, 1):.0%} huge pages); {reps} repetitions, interleaved")
    base = {"load": "C memcpy loop", "read": "C sum loop"}
    for op in OPS:
        ratio_result(f"dram.{op}.cold", "kvemu dram (cold=1, headline)", figs[op, "kv-cold"],
                     f"{base[op]} + clflush, same offsets", figs[op, "c-cold"], "GB/s", TARGET)
        ratio_result(f"dram.{op}.warm", "kvemu dram:cold=0", figs[op, "kv-warm"],
                     f"{base[op]}, same offsets", figs[op, "c-warm"], "GB/s", TARGET)
        for mode in ("cold", "warm"):
            r = ratios(figs[op, "raw-" + mode], figs[op, "c-" + mode])
            result("INFO", f"dram.{op}.{mode}.raw-call",
                   f"kvemu Backend.replay, the same offsets back to back in one step "
                   f"{figs[op, 'raw-' + mode].fmt(2, 'GB/s')} | ratio {r.fmt(3)} to the C loop")
        if not a.quick:
            for mode in ("cold", "warm"):
                result("INFO", f"dram.{op}.{mode}.random-order",
                       f"{base[op]}{' + clflush' if mode == 'cold' else ''} over random slots "
                       f"{figs[op, 'rnd-' + mode].fmt(2, 'GB/s')} (same-offsets loop: "
                       f"{figs[op, 'c-' + mode].fmt(2, 'GB/s')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
