#!/usr/bin/env python3
"""Transfer workers: `dram:workers=W` load and store GB/s against a W-thread C copy, same run.

For W = 1 .. N (N = os.cpu_count()), and N + 1 to show oversubscription (INFO), and for blocks
of 64 KiB and 1 MiB, kvemu replays one request whose block table is a random permutation of every
block of a 1 GiB arena (256 MiB with --quick) through the raw `Backend.replay` call: one step, all
blocks loaded (or stored) in one phase, so batches of 256 block accesses, each split over the W
workers. kvemu's figure is `op_stats(op)`: bytes / busy_ns, busy being each batch's largest
per-worker sum of piece times, summed over the batches.

The baseline, tools/c/membw_mt.c (compiled here), performs the SAME transfers (arena offset,
bytes, staging offset, batch: rebuilt from the arrays handed to kvemu, tools/bench_common.py
replay_transfers) with W threads pinned to distinct CPUs (round-robin beyond N), each batch split
into W contiguous byte shares cut on 64-byte lines exactly as cbackends/memtier.c does, each piece
timed with lfence;rdtsc;lfence: load = memcpy arena -> staging; store = memcpy staging -> arena,
then clwb (else clflushopt, else clflush) of every stored line and a fence, inside the timed
region; cold (cold=1, kvemu's default): every touched arena line evicted after timing,
untimed (clflushopt, else clflush, then mfence, as cbackends/memtier.c does). Same figure:
bytes / sum over batches of the largest per-worker piece-time sum.

Both keep their arenas mapped for a round: per round and configuration, one Backend and one C
process, then pairs of passes, kvemu and C back to back (which goes first alternates); rounds
repeat the whole sweep, so each figure's repetitions are spread over the run. Ratios are the
medians of the per-pair ratios (tools/bench_common.py). INFO lines give the scaling with W and how
late the C copy's helper threads joined each batch (first to last worker's first piece start, as
a share of the busy time): busy time does not see it, so a large skew would mean the workers' pieces
did not overlap and the figure overstates the bandwidth.

    python tools/bench_workers.py [--quick] [--repeat N] [--arena-mib N]
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from bench_common import (MembwMT, Stat, compile_c, header, info, parser, ratio_result, ratios, repeats,
                          replay_transfers, result)

from kvemu.backends import ENTRY_DTYPE, STEP_DTYPE, Backend

TARGET = 0.90
BLOCKS = (64 << 10, 1 << 20)
OPS = ("load", "store")


def fmt_block(b: int) -> str:
    return f"{b >> 20}M" if b >= 1 << 20 and b % (1 << 20) == 0 else f"{b >> 10}K"


def arrays(n: int, op: str, perm: np.ndarray):
    """One request, one entry moving every slot of perm with op, one step, one layer."""
    entries = np.zeros(1, ENTRY_DTYPE)
    entries[f"{op}_count"] = n
    steps = np.array([(0, 1, 0, 0)], STEP_DTYPE)
    return np.array([0, n], np.uint64), perm, steps, entries, np.ones(1, np.uint32)


def kvemu_pass(b: Backend, op: str, call) -> tuple[float, dict]:
    b.reset_stats()
    b.replay(*call)
    st = b.op_stats(op)
    return st["bytes"] / st["busy_ns"], st


def main() -> int:
    ap = parser(__doc__, "256 MiB arena, 3 pairs in one round instead of 15 in five")
    ap.add_argument("--arena-mib", type=int, default=None, help="arena size (default 1024, --quick 256)")
    a = ap.parse_args()
    reps = repeats(a, 3, 15)
    rounds = 1 if a.quick else 5
    pairs = math.ceil(reps / rounds)
    arena = (a.arena_mib or (256 if a.quick else 1024)) << 20
    n_cpu = os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0))
    workers = list(range(1, n_cpu + 1)) + [n_cpu + 1]
    header("transfer workers: dram:workers=W vs a W-thread C copy of the same transfers", a)
    kv = {(op, blk, w): Stat() for op in OPS for blk in BLOCKS for w in workers}
    cc = {(op, blk, w): Stat() for op in OPS for blk in BLOCKS for w in workers}
    skew = {(op, blk, w): Stat() for op in OPS for blk in BLOCKS for w in workers}
    facts = {}
    rng = np.random.default_rng(20261201)
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        d = Path(d)
        membw = compile_c("membw_mt", d, ["-pthread"])
        calls, files = {}, {}
        for blk in BLOCKS:
            n = arena // blk
            perm = rng.permutation(n).astype(np.uint32)
            geom = {"block_bytes": blk, "n_slots": n, "n_layers_replay": 1, "chunk_blocks": 1}
            calls[blk] = {op: arrays(n, op, perm) for op in OPS}
            tr = replay_transfers([(geom, *calls[blk]["load"])])["load"]
            # one pass leaves staging's cursor where it found it, so every pass is the same transfers
            assert (n * blk) % min(arena, 64 << 20) == 0, "arena must be a multiple of the 64 MiB staging"
            assert len(tr) == n and int(tr["bytes"].sum()) == n * blk
            files[blk] = d / f"transfers-{blk}.bin"
            tr.tofile(files[blk])
        for r in range(rounds):
            for blk in BLOCKS:
                n = arena // blk
                for w in workers:
                    with Backend(f"dram:workers={w}") as b, \
                            MembwMT(membw, arena, blk, f"@{files[blk]}", w, 1) as c:
                        b.prepare(blk, n, 1, 1, False)
                        facts.setdefault(w, b.describe())
                        for p in range(pairs):
                            for op in OPS:
                                first_kv = (p + r) % 2 == 0
                                if first_kv:
                                    g, st = kvemu_pass(b, op, calls[blk][op])
                                out = c.run(op)
                                if not first_kv:
                                    g, st = kvemu_pass(b, op, calls[blk][op])
                                assert st["accesses"] == n and st["bytes"] == n * blk, st
                                assert out["bytes"] == n * blk and out["accesses"] == n, out
                                kv[op, blk, w].add(g)
                                cc[op, blk, w].add(out["gbps"])
                                skew[op, blk, w].add(out["skew_ns"] / out["busy_ns"])
    f1 = facts[1]
    info(f"arena {arena >> 20} MiB, blocks of {', '.join(fmt_block(x) for x in BLOCKS)} in a random order "
         f"(one permutation per block size, the same for kvemu and C), cold=1; {rounds} round(s) x {pairs} "
         f"pairs = {rounds * pairs} repetitions per figure; os.cpu_count() {n_cpu}, CPUs this process may "
         f"use {allowed}; stores written back with {f1.get('store_writeback')}; arena huge pages "
         f"{f1.get('arena_hugepage_bytes', 0) / arena:.0%}")
    for w in workers:
        info(f"dram:workers={w}: kvemu reports workers {facts[w].get('workers')} on CPUs "
             f"{facts[w].get('worker_cpus')}")
    for blk in BLOCKS:
        for op in OPS:
            for w in workers:
                over = w > allowed
                key = f"workers.{op}.{fmt_block(blk)}.w{w}"
                label = f"{op} {fmt_block(blk)} blocks, kvemu dram:workers={w}"
                base = f"C {w}-thread copy{', oversubscribed' if over else ''}"
                if over:
                    rr = ratios(kv[op, blk, w], cc[op, blk, w])
                    result("INFO", key, f"{label} {kv[op, blk, w].fmt(2, 'GB/s')} | {base} "
                                        f"{cc[op, blk, w].fmt(2, 'GB/s')} | ratio {rr.fmt(3)} "
                                        f"({w} workers on {allowed} CPUs: busy time leaves out the time a "
                                        f"worker waits for its CPU)")
                else:
                    ratio_result(key, label, kv[op, blk, w], base, cc[op, blk, w], "GB/s", TARGET)
    for blk in BLOCKS:
        for op in OPS:
            k1 = kv[op, blk, 1].median
            c1 = cc[op, blk, 1].median
            result("INFO", f"workers.{op}.{fmt_block(blk)}.curve",
                   "kvemu GB/s by W: " + ", ".join(f"W={w} {kv[op, blk, w].median:.2f} "
                                                   f"({kv[op, blk, w].median / k1:.2f}x)" for w in workers)
                   + " | C: " + ", ".join(f"W={w} {cc[op, blk, w].median:.2f} ({cc[op, blk, w].median / c1:.2f}x)"
                                          for w in workers)
                   + " | C helpers' start skew / busy: "
                   + ", ".join(f"W={w} {skew[op, blk, w].median:.2%}" for w in workers if w > 1))
    for blk in BLOCKS:
        # a load pass and a store pass of one pair run back to back on one backend: paired ratios
        ws = [w for w in workers if w <= allowed]
        r = {w: ratios(kv["store", blk, w], kv["load", blk, w]) for w in ws}
        rc = {w: ratios(cc["store", blk, w], cc["load", blk, w]) for w in ws}
        result("PASS" if all(r[w].median <= 1 for w in ws) else "FAIL", f"workers.store-le-load.{fmt_block(blk)}",
               f"{fmt_block(blk)} blocks, kvemu store / load: "
               + ", ".join(f"W={w} {kv['store', blk, w].median:.2f} / {kv['load', blk, w].median:.2f} GB/s = "
                           f"{r[w].fmt(3)}" for w in ws)
               + " (C copy: " + ", ".join(f"W={w} {rc[w].fmt(3)}" for w in ws)
               + ") | target store <= load for every W")
    return 0


if __name__ == "__main__":
    sys.exit(main())
