#!/usr/bin/env python3
"""The longer fuzz campaign: kv_replay with random batches under ASan/UBSan for many seeds, then the
property-based trace-reader tests with many more examples. Prints one line per part and a total.

    python tools/fuzz_campaign.py [--iterations 200000] [--seeds 8] [--examples 2000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=200_000)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--examples", type=int, default=2000)
    a = ap.parse_args()
    from test_c_fuzz import build_fuzzer

    failed = 0
    with tempfile.TemporaryDirectory() as d:
        exe = build_fuzzer(d)
        for seed in range(1, a.seeds + 1):
            t0 = time.perf_counter()
            r = subprocess.run([exe, str(a.iterations), str(seed)], capture_output=True, text=True,
                               env=dict(os.environ, ASAN_OPTIONS="detect_leaks=1"))
            status = "PASS" if r.returncode == 0 else "FAIL"
            failed += r.returncode != 0
            print(f"C kv_replay seed {seed}: {r.stdout.strip() or r.stderr.strip()[:200]} "
                  f"[{time.perf_counter() - t0:.1f} s] {status}")
    t0 = time.perf_counter()
    env = dict(os.environ, KVEMU_FUZZ_EXAMPLES=str(a.examples))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz_trace.py",
                        "tests/test_workloads.py", "-k", "any_ or arbitrary or random_ or corrupted"],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr.strip()[:200]
    failed += r.returncode != 0
    print(f"property-based readers ({a.examples} examples each): {last} [{time.perf_counter() - t0:.1f} s] "
          f"{'PASS' if r.returncode == 0 else 'FAIL'}")
    print("campaign:", "PASS" if not failed else f"FAIL ({failed} parts)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
