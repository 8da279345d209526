#!/usr/bin/env python3
"""DRAM replay bandwidth against a C copy of the very same transfers, same run.

Records two traces: a load-heavy one (synthetic docqa, offload policy, a tiny HBM so that every
prefix hit is loaded back from the tier; it writes every new block through to the tier, so it is
the store trace too) and a read-heavy one (resident policy: decode reads the whole context in the
tier). Replays each with `kvemu.replay` on `dram` (cold=1, the default: lines flushed after each
timed access) and `dram:cold=0`, both with the default transfer workers (every CPU this process
may use), and runs tools/c/membw_mt.c, compiled here, over an arena of the same size performing
**the same transfers** the replay performed (arena offset, bytes, staging offset and batch of
each: rebuilt from the arrays handed to Backend.replay, tools/bench_common.py replay_transfers)
with as many pinned threads as the backend had workers, each batch split into the same
contiguous byte shares, each piece timed as kvemu times it:

  load   memcpy arena -> staging;
  store  memcpy staging -> arena, then clwb (else clflushopt, else clflush) of every stored line
         and a fence, all inside the timed region (the store reaches memory);
  read   one 8-byte load per 64-byte line, summed.

cold=1 is compared with the C copy that evicts every touched arena line after its timed
region (untimed; clflushopt, else clflush, then mfence, as memtier does), cold=0 with the copy that does not. Both figures are bytes / busy time (each
batch's largest per-worker sum of piece times); kvemu's is the results' ops[op].gbps. The
headline is cold=1, what a replay gets by default. The full run adds the same C copy over
random block slots (INFO): the access order alone moves the figure. A last line checks that
stores come out no faster than loads (they do strictly more: the same copy plus the write-back).

    python tools/bench_replay_dram.py [--quick] [--repeat N]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench_common import (MembwMT, ReplaySpy, Stat, compile_c, header, info, parser, ratio_result, ratios,
                          repeats, result)

from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.replay import ReplayOptions, WindowOptions, replay

#: op -> the trace that exercises it
OPS = {"load": "load", "store": "load", "read": "read"}
WORKLOADS = {"load": "synthetic:docqa:documents=6,questions=16",
             "read": "synthetic:docqa:documents=4,questions=2,output_min_tokens=10,output_max_tokens=40"}
POLICY = {"load": "offload, --hbm-kv-gib 1.6", "read": "resident"}
LAYERS = {"load": 2, "read": 2}
MODEL = "llama3-8b"
TARGET = 0.90


def main() -> int:
    a = parser(__doc__, "5 repetitions instead of 9, no random-order runs").parse_args()
    reps = repeats(a, 5, 9)
    header("DRAM replay bandwidth vs a C copy of the same transfers", a)
    kinds = ("kv-cold", "kv-warm", "c-cold", "c-warm", "rnd-cold", "rnd-warm")
    figs = {(op, k): Stat() for op in OPS for k in kinds}
    geometry = {}   # trace -> (arena bytes, block bytes, workers, huge-page bytes, facts)
    counts = {}     # op -> (transfers, bytes)
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        d = Path(d)
        membw = compile_c("membw_mt", d, ["-pthread"])
        traces = {t: d / f"{t}.parquet" for t in WORKLOADS}
        record(WORKLOADS["load"], MODEL, traces["load"],
               RecordOptions.from_flat(tier_policy="offload", hbm_kv_gib=1.6, show_progress=False))
        record(WORKLOADS["read"], MODEL, traces["read"], RecordOptions.from_flat(tier_policy="resident", show_progress=False))
        for i in range(reps):
            for t, trace in traces.items():
                for cold in (1, 0):
                    mode = "cold" if cold else "warm"
                    with ReplaySpy(keep_arrays=t not in geometry) as spy:
                        meta = replay(trace, f"dram:cold={cold}", ReplayOptions(window=WindowOptions(layers=LAYERS[t])), out=d / f"{t}{i}{cold}.parquet")
                    if spy.calls:
                        facts = meta["backend"]["facts"]
                        block = spy.calls[0][0]["block_bytes"]
                        geometry[t] = (meta["params"]["arena_bytes"], block, int(facts["workers"]),
                                       facts.get("arena_hugepage_bytes"), facts)
                        for op, tr in spy.transfers().items():
                            if OPS.get(op) != t:
                                continue
                            st = meta["ops"][op]
                            assert len(tr) == st["accesses"] and int(tr["bytes"].sum()) == st["bytes"], \
                                (op, len(tr), int(tr["bytes"].sum()), st["accesses"], st["bytes"])
                            counts[op] = (len(tr), int(tr["bytes"].sum()), len(set(tr["batch"].tolist())))
                            tr.tofile(d / f"{op}.transfers")
                    arena, block, workers, _, _ = geometry[t]
                    for op in (o for o, tt in OPS.items() if tt == t):
                        figs[op, "kv-" + mode].add(meta["ops"][op]["gbps"])
                        # the baseline right after the replay it is paired with
                        with MembwMT(membw, arena, block, f"@{d / f'{op}.transfers'}", workers, cold) as c:
                            figs[op, "c-" + mode].add(c.run(op)["gbps"])
                        if not a.quick:
                            n = min(counts[op][1] // block, 200_000)
                            with MembwMT(membw, arena, block, n, workers, cold) as c:
                                figs[op, "rnd-" + mode].add(c.run(op)["gbps"])
    for op, t in OPS.items():
        arena, block, workers, huge, facts = geometry[t]
        n, nbytes, batches = counts[op]
        info(f"{op}: {WORKLOADS[t]} ({POLICY[t]}), {MODEL}, --layers {LAYERS[t]}: {n} {op} transfers "
             f"({nbytes / 2**20:.0f} MiB in {batches} batches, blocks of {block} B, {nbytes / n / block:.1f} "
             f"blocks per transfer) per replay, arena {arena / 2**20:.0f} MiB ({(huge or 0) / max(arena, 1):.0%} "
             f"huge pages), {workers} workers on CPUs {facts.get('worker_cpus')}"
             f"{', stores written back with ' + str(facts.get('store_writeback')) if op == 'store' else ''}; "
             f"{reps} repetitions, interleaved")
    base = {"load": "C memcpy", "store": "C memcpy + write-back", "read": "C sum"}
    for op in OPS:
        w = geometry[OPS[op]][2]
        ratio_result(f"dram.{op}.cold", "kvemu dram (cold=1, headline)", figs[op, "kv-cold"],
                     f"{base[op]} + cold flush, {w} threads, same transfers", figs[op, "c-cold"], "GB/s", TARGET)
        ratio_result(f"dram.{op}.warm", "kvemu dram:cold=0", figs[op, "kv-warm"],
                     f"{base[op]}, {w} threads, same transfers", figs[op, "c-warm"], "GB/s", TARGET)
        if not a.quick:
            for mode in ("cold", "warm"):
                result("INFO", f"dram.{op}.{mode}.random-order",
                       f"{base[op]}{' + cold flush' if mode == 'cold' else ''}, {w} threads, over random slots "
                       f"{figs[op, 'rnd-' + mode].fmt(2, 'GB/s')} (same-transfers copy: "
                       f"{figs[op, 'c-' + mode].fmt(2, 'GB/s')})")
    for mode in ("cold", "warm"):
        # loads and stores of one replay are measured together: their ratio is paired per replay
        s, ld = figs["store", "kv-" + mode], figs["load", "kv-" + mode]
        r, rc = ratios(s, ld), ratios(figs["store", "c-" + mode], figs["load", "c-" + mode])
        result("PASS" if r.median <= 1 else "FAIL", f"dram.store-le-load.{mode}",
               f"kvemu dram{'' if mode == 'cold' else ':cold=0'} store {s.fmt(2, 'GB/s')} vs load "
               f"{ld.fmt(2, 'GB/s')}: store / load {r.fmt(3)} (C copy: {rc.fmt(3)}) | target store <= load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
