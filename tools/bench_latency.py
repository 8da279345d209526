#!/usr/bin/env python3
"""`kvemu calibrate --backend dram` idle latency against an independent pointer chase, same run.

Each repetition runs `kvemu calibrate --backend dram --buffer SIZE --json` (its latency: the
median of 5 rounds of kv_chase, a random cycle over lines of the buffer, huge pages advised) and,
right after it, tools/c/chase.c compiled here: its own random cycle through every line of a
buffer of the same size (Sattolo's algorithm, another generator), huge pages advised, a plain
`p = *p` loop timed with clock_gettime, median of 5 rounds. The ratio is kvemu / chase per
repetition (each figure the median of its 5 rounds, as calibrate reports it); the target is
within 5 %. An INFO line gives the same from each side's fastest round, less exposed to other
tenants of a shared machine. lmbench's lat_mem_rd runs too when it is installed.

    python tools/bench_latency.py [--quick] [--repeat N] [--buffer-mib 1024]
"""

from __future__ import annotations

import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench_common import Stat, compile_c, header, info, parser, ratios, repeats, result, run_json

TOLERANCE = 0.05
HOPS = 1_000_000
ROUNDS = 5


def kvemu_cmd() -> list[str]:
    exe = shutil.which("kvemu")
    return [exe] if exe else [sys.executable, "-c", "from kvemu.cli import main; main()"]


def lat_mem_rd(buffer_mib: int) -> float | None:
    """lmbench's figure at the buffer size (ns), when lat_mem_rd is installed."""
    exe = shutil.which("lat_mem_rd")
    if exe is None:
        return None
    p = subprocess.run([exe, "-P", "1", str(buffer_mib), "64"], capture_output=True, text=True, timeout=600)
    rows = [tuple(map(float, m.groups())) for m in
            re.finditer(r"^\s*([0-9.]+)\s+([0-9.]+)\s*$", p.stderr + p.stdout, re.M)]
    return rows[-1][1] if rows else None


def main() -> int:
    ap = parser(__doc__, "5 repetitions instead of 9")
    ap.add_argument("--buffer-mib", type=int, default=1024, help="buffer size in MiB (default 1024, kvemu's default)")
    a = ap.parse_args()
    reps = repeats(a, 5, 9)
    header("idle latency: kvemu calibrate vs an independent pointer chase", a)
    buf = a.buffer_mib << 20
    kv, base, kv_min, base_min = Stat(), Stat(), Stat(), Stat()
    huge_kv = huge_c = None
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        chase = compile_c("chase", d)
        for _ in range(reps):
            cal = run_json([*kvemu_cmd(), "calibrate", "--backend", "dram", "--buffer", f"{a.buffer_mib}MiB",
                            "--hops", str(HOPS), "--json"])
            kv.add(cal["latency"]["ns"])
            kv_min.add(min(cal["latency"]["rounds_ns"]))
            facts = cal.get("facts", {})
            huge_kv = (facts.get("arena_hugepage_bytes") or 0) / max(facts.get("arena_bytes") or 1, 1)
            out = run_json([chase, buf, HOPS // ROUNDS, ROUNDS, 1])
            base.add(statistics.median(out["ns_per_hop"]))
            base_min.add(min(out["ns_per_hop"]))
            huge_c = out["hugepage_bytes"] / buf
    info(f"buffer {a.buffer_mib} MiB, huge pages: kvemu arena {huge_kv:.0%}, chase buffer {huge_c:.0%}; "
         f"{HOPS:,} hops per repetition each ({ROUNDS} rounds, median); {reps} repetitions, paired")
    r = ratios(kv, base)
    status = "PASS" if abs(r.median - 1) <= TOLERANCE else "FAIL"
    result(status, "latency.dram.idle",
           f"kvemu calibrate {kv.fmt(1, 'ns')} | C pointer chase {base.fmt(1, 'ns')} | ratio {r.fmt(3)} | "
           f"target within +-{TOLERANCE:.0%}")
    rm = ratios(kv_min, base_min)
    result("INFO", "latency.dram.idle.min", f"fastest round of each repetition: kvemu {kv_min.fmt(1, 'ns')} | "
                                            f"C chase {base_min.fmt(1, 'ns')} | ratio {rm.fmt(3)}")
    lm = lat_mem_rd(a.buffer_mib)
    if lm is None:
        result("INFO", "latency.dram.lmbench", "lat_mem_rd not installed: lmbench comparison skipped")
    else:
        result("INFO", "latency.dram.lmbench", f"lat_mem_rd {lm:.1f} ns at {a.buffer_mib} MiB, stride 64 "
                                               f"(kvemu / lmbench {kv.median / lm:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
