#!/usr/bin/env python3
"""Emulation accuracy: does `emu:PROFILE` really take the time its profile says, on the wall clock?

For every built-in profile, through the raw Backend.replay call, timed with the wall clock:

  latency    isolated accesses: one 64-byte load per step (each backend call carries one), so
             each costs the model's o + L + 64 / B; measured = wall time / accesses.
             Target: within 5 % of the model.
  bandwidth  batches of 256 loads of 64 KiB (the core's batch), measured = bytes / wall time;
             the model's figure for such a batch is the profile's bandwidth less its latency
             share (within 3 % of bandwidth_gbps for every built-in). Target: within 10 %.

The times emu reports in results follow the model by construction (an access that is not late
is given its modelled time; each line shows them too); the wall clock is the test. Each figure is also measured on the
floor: the same geometry with a zero-time profile (`latency_ns=0`, unbounded bandwidth), so
every access takes what this host and the replay core need on their own. A profile whose model
time is not above that floor by more than the tolerance cannot be emulated here: FLOOR, not a
failure of accuracy (shown with what emu then gives).

Each figure is timed over several replay calls on one prepared backend and the median call is
taken: a shared VM steals the CPU for milliseconds at a time, which emu cannot pay back (a late
access moves the rest of the schedule, as a stalled tier would); the total over all calls is
shown beside it. Two geometries: `dram`, a 256 MiB arena (far above the LLC: the floor is a DRAM access, what a
replay of a real trace meets), and `cache`, a 1 MiB arena (cache-resident: the floor is the
replay core's own cost, which isolates emu's pacing). Medians of repetitions; each repetition
runs the floor and every profile back to back.

    python tools/bench_emu.py [--quick] [--repeat N]
"""

from __future__ import annotations

import sys
import time

import numpy as np
from bench_common import Stat, header, info, parser, repeats, result, sequential_loads

from kvemu.backends import Backend
from kvemu.profiles import BUILTIN_PROFILES

LAT_BLOCK = 64
BW_BLOCK = 64 << 10
BATCH = 256
TOL = {"latency": 0.05, "bandwidth": 0.10}
GEOMETRIES = {"dram": 256 << 20, "cache": 1 << 20}
# The floor: no latency, no overhead, the profile bounds' largest bandwidth (100 TB/s: 0.00064 ns for a
# 64-byte access, nothing against the ~10 ns being measured).
FLOOR_ARGS = "latency_ns=0,bandwidth_gbps=100000,overhead_ns=0"


def run(spec: str, block: int, arena: int, n: int, per_step: int, chunks: int, rng) -> tuple[list, dict, dict]:
    """Wall seconds of each of `chunks` replay calls of n loads (per_step per step) on one prepared
    backend, its facts and load stats (all chunks)."""
    n_slots = arena // block
    n_steps = max(1, n // per_step)
    n = n_steps * per_step
    table_off, steps, entries = sequential_loads(n_steps, per_step)
    walls = []
    with Backend(spec) as b:
        b.prepare(block, n_slots, 1, 1, False)
        for _ in range(chunks):
            slots = np.resize(rng.permutation(n_slots).astype(np.uint32), n)
            t0 = time.perf_counter()
            b.replay(table_off, slots, steps, entries, np.ones(1, np.uint32))
            walls.append(time.perf_counter() - t0)
        return walls, b.describe(), b.op_stats("load")


def model(profile, figure: str) -> float:
    """The model's per-access ns (latency) or GB/s for a batch of 256 x 64 KiB (bandwidth)."""
    if figure == "latency":
        return profile.batch_times([LAT_BLOCK])[1]
    busy = profile.batch_times([BW_BLOCK] * BATCH)[1]
    return BATCH * BW_BLOCK / busy


def measure(spec: str, figure: str, arena: int, seconds: float, chunks: int, expect: float,
            rng) -> tuple[float, float, float, dict]:
    """Wall-clock ns per access (latency) or GB/s (bandwidth): the median chunk, and over all
    chunks together; the same as the results would report it (mean access time; bytes / busy
    time); and the backend's facts."""
    per = seconds / chunks
    if figure == "latency":
        n = int(min(100_000, max(200, per * 1e9 / max(expect, 1.0))))
        walls, facts, st = run(spec, LAT_BLOCK, arena, n, 1, chunks, rng)
        return (float(np.median(walls)) * 1e9 / n, sum(walls) * 1e9 / (n * chunks), st["time_ns"] / st["accesses"],
                facts)
    n = int(min(16 * BATCH, max(BATCH, per * expect * 1e9 / BW_BLOCK)))
    n -= n % BATCH
    walls, facts, st = run(spec, BW_BLOCK, arena, n, n, chunks, rng)
    return (n * BW_BLOCK / float(np.median(walls)) / 1e9, n * chunks * BW_BLOCK / sum(walls) / 1e9,
            st["bytes"] / st["busy_ns"], facts)


def main() -> int:
    a = parser(__doc__, "3 repetitions instead of 5, shorter runs").parse_args()
    reps = repeats(a, 3, 5)
    seconds = 0.1 if a.quick else 0.3
    chunks = 5 if a.quick else 11
    header("emulation accuracy: emu on the wall clock vs its profile", a)
    rng = np.random.default_rng(0)
    profiles = BUILTIN_PROFILES
    figs = ("latency", "bandwidth")
    meas = {(g, p, f): Stat() for g in GEOMETRIES for p in profiles for f in figs}
    floor = {(g, f): Stat() for g in GEOMETRIES for f in figs}
    overall = {(g, p, f): Stat() for g in GEOMETRIES for p in profiles for f in figs}
    reported = {(g, p, f): Stat() for g in GEOMETRIES for p in profiles for f in figs}
    hits = {(g, p, f): 0 for g in GEOMETRIES for p in profiles for f in figs}
    for _ in range(reps):
        for g, arena in GEOMETRIES.items():
            for f in figs:
                # the floor: the host and the replay core alone (every access late for a zero-time profile)
                v, _, _, _ = measure(f"emu:cxl-pool,{FLOOR_ARGS}", f, arena, seconds / 2, chunks,
                                     50.0 if f == "bandwidth" else 100.0, rng)
                floor[g, f].add(v)
                for name, prof in profiles.items():
                    expect = model(prof, f)
                    fl = floor[g, f].values[-1]
                    limited = fl > expect * (1 - TOL[f]) if f == "latency" else fl < expect * (1 + TOL[f])
                    # a tier this host cannot reach only needs a short run to show what emu gives
                    v, whole, rep, facts = measure(f"emu:{name}", f, arena, seconds / 10 if limited else seconds,
                                                   chunks, fl if (limited and f == "bandwidth") else expect, rng)
                    meas[g, name, f].add(v)
                    overall[g, name, f].add(whole)
                    reported[g, name, f].add(rep)
                    hits[g, name, f] += facts.get("floor_hits") or 0
    info(f"latency: {LAT_BLOCK}-byte loads one per step; bandwidth: batches of {BATCH} x {BW_BLOCK >> 10} KiB loads; "
         f"arenas: dram {GEOMETRIES['dram'] >> 20} MiB, cache {GEOMETRIES['cache'] >> 20} MiB; per figure and "
         f"repetition about {seconds:.2f} s in {chunks} replay calls on one backend, the median call's wall time "
         f"(`all chunks`: their total); {reps} repetitions")
    for g in GEOMETRIES:
        info(f"floor ({g}): {floor[g, 'latency'].fmt(1, 'ns')} per isolated access, "
             f"{floor[g, 'bandwidth'].fmt(2, 'GB/s')} for 64 KiB loads")
    for g in GEOMETRIES:
        for name, prof in profiles.items():
            for f in figs:
                expect = model(prof, f)
                m = meas[g, name, f]
                fl = floor[g, f].median
                unit, digits = ("ns", 1) if f == "latency" else ("GB/s", 3)
                err = m.median / expect - 1
                nominal = ("profile o+L+64/B" if f == "latency" else
                           f"model for 256 x 64 KiB (profile {prof.bandwidth_gbps:g} GB/s)")
                limited = fl > expect * (1 - TOL[f]) if f == "latency" else fl < expect * (1 + TOL[f])
                if limited:
                    status = "FLOOR"
                    tail = (f"floor-limited: this host needs {fl:.{digits}f} {unit} on its own"
                            f" ({hits[g, name, f]} floor hits)")
                else:
                    status = "PASS" if abs(err) <= TOL[f] else "FAIL"
                    tail = f"target within +-{TOL[f]:.0%} (floor {fl:.{digits}f} {unit}; {hits[g, name, f]} floor hits)"
                result(status, f"emu.{g}.{name}.{f}",
                       f"wall {m.fmt(digits, unit)} (all chunks {overall[g, name, f].median:.{digits}f}, results "
                       f"report {reported[g, name, f].median:.{digits}f}) | {nominal} {expect:.{digits}f} {unit} | error {err:+.1%} | {tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
