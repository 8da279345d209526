#!/usr/bin/env python3
"""Runs every kvemu benchmark, one after the other, and prints one line per figure.

Each benchmark is a script in tools/ that measures its own baseline in the same run and prints
result lines (`PASS|FAIL|FLOOR|SKIP|INFO  key  figures | baseline | ratio | target`, see
tools/bench_common.py). This runs them in turn (never two at once: they measure the machine),
streams their output, and ends with the summary: every result line, the time each benchmark
took, and the total.

    python tools/bench_all.py --quick           # every benchmark, shorter (under 5 minutes)
    python tools/bench_all.py                   # the full run docs/performance.md records
    python tools/bench_all.py --only uring,emu  # some of them

Exit status 0 when every benchmark ran (whatever its figures), 1 when one crashed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
#: name -> script, in the order they run
BENCHMARKS = {
    "record": "bench_record.py",
    "closed": "bench_closed_loop.py",
    "compute": "bench_compute.py",
    "dram": "bench_replay_dram.py",
    "workers": "bench_workers.py",
    "latency": "bench_latency.py",
    "uring": "bench_uring.py",
    "emu": "bench_emu.py",
    "engine": "bench_replay_engine.py",
    "memory": "bench_memory.py",
    "mooncake": "bench_mooncake.py",
}
RESULT_RE = re.compile(r"^(PASS|FAIL|FLOOR|SKIP|INFO)\s+\S")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--quick", action="store_true", help="the short variant of every benchmark")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    a = ap.parse_args()
    names = list(BENCHMARKS) if a.only is None else [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark {unknown[0]!r} (known: {', '.join(BENCHMARKS)})")
    started = _dt.datetime.now().astimezone()
    print(f"kvemu benchmarks{' --quick' if a.quick else ''}: {', '.join(names)}; "
          f"{started:%Y-%m-%d %H:%M %Z}, {platform.node()}, python {platform.python_version()}", flush=True)
    t_all = time.perf_counter()
    lines: list[str] = []
    took: dict[str, float] = {}
    crashed: list[str] = []
    for name in names:
        cmd = [sys.executable, str(TOOLS / BENCHMARKS[name])] + (["--quick"] if a.quick else [])
        print(f"\n$ {' '.join(['python', 'tools/' + BENCHMARKS[name]] + cmd[2:])}", flush=True)
        t0 = time.perf_counter()
        with subprocess.Popen(cmd, cwd=TOOLS.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, bufsize=1) as p:
            for line in p.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                if RESULT_RE.match(line):
                    lines.append(line.rstrip("\n"))
        took[name] = time.perf_counter() - t0
        if p.returncode != 0:
            crashed.append(name)
            lines.append(f"FAIL  {name}  the benchmark exited with status {p.returncode}")
    total = time.perf_counter() - t_all
    counts = {s: sum(1 for ln in lines if ln.startswith(s)) for s in ("PASS", "FAIL", "FLOOR", "SKIP", "INFO")}
    print("\n== summary: one line per figure (median [min-max] of repetitions; ratio = kvemu / baseline)")
    for ln in lines:
        print(ln)
    print("\n" + ", ".join(f"{n} {took[n]:.0f} s" for n in names))
    print(f"total {total:.0f} s ({total / 60:.1f} min); " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
