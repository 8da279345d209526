#!/usr/bin/env python3
"""Peak memory of a replay against its tier arena, for traces of growing length.

Each replay runs in its own process (`kvemu.replay`, then ru_maxrss; VmHWM as a check), and so
does each recording: on Linux a child's ru_maxrss starts from its parent's peak, so the parent
stays small.
What should hold: peak RSS = arena + a constant, whatever the trace's length (entries are
streamed in batches). Printed per trace: peak RSS, the arena, RSS - arena, and the baseline
measured in the same run: a process that imports kvemu and opens the trace with `read_trace`
and nothing else.

  dram   synthetic docqa, 2 documents and a growing number of questions (offload, a small HBM:
         prefix hits are loaded back), llama3-8b, one replayed layer, on `dram`: the arena grows
         with the trace, RSS - arena should not.
  vemu   the first N requests of the Mooncake conversation trace (llama3-70b, offload), one
         replayed layer, on `vemu:cxl-pool` (virtual time, no arena): RSS itself should not
         grow. Skipped when the trace file is absent.

Target: RSS - arena flat, i.e. its spread over the lengths at most 32 MiB (allocator noise).

Then, on the Mooncake conversation trace recorded as the README records it (llama3-70b, 4 x H100,
offload, `--time-scale 5`), all layers, each replay the `kvemu replay` command in a process of its
own (its peak RSS and CPU time from wait4), the two in each pair back to back:

  closed   the closed loop (`--schedule closed`, the default) against the recorded schedule
           (`--schedule recorded`) of the same trace: peak RSS, target at most 1.3x and at most
           400 MiB (issue 43).
  stack    a three-level virtual stack (`--tiers` of vemu:local-dram, vemu:cxl-pool, vemu:nvme)
           against a single tier (`vemu:local-dram`), closed loop: CPU time, target at most 1.3x;
           peak RSS beside it.

    python tools/bench_memory.py [--quick] [--only dram,vemu,closed,stack] [--mooncake PATH]
"""

from __future__ import annotations

import json
import os
import resource
import time
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import Stat, header, info, mooncake_path, parser, ratios, result

MIB = 1 << 20
FLAT_MIB = 32
CLOSED_RATIO, CLOSED_MIB = 1.3, 400     # closed loop's peak RSS against the recorded schedule's
STACK_RATIO = 1.3                       # a three-level stack's CPU against a single tier's
STACK = "vemu:local-dram|cap=256GiB;vemu:cxl-pool|cap=512GiB;vemu:nvme|cap=4TiB"


def vm_hwm() -> int:
    """Peak RSS of this process's own address space (VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(argv) -> int:
    """--child MODE TRACE [...]: one measurement (or one recording), one JSON line."""
    mode, trace = argv[0], argv[1]
    import kvemu.cli  # first: it picks Arrow's allocator, as for the command
    kvemu.cli.replay_allocator()  # and glibc's mmap threshold, as `kvemu replay` does
    if mode == "record":
        from kvemu.record_options import RecordOptions
        from kvemu.recording import record

        workload, model, extra = argv[2], argv[3], json.loads(argv[4])
        record(workload, model, trace, RecordOptions.from_flat(tier_policy="offload", show_progress=False, **extra))
        print(json.dumps({"recorded": trace}))
        return 0
    if mode == "open":
        from kvemu.replay import ReplayOptions, TierOptions, WindowOptions, replay  # noqa: F401  (the same imports as a replay)
        from kvemu.schema import read_trace

        t = read_trace(trace)
        out = {"n_requests": int(t.n_requests)}
    else:
        from kvemu.replay import ReplayOptions, TierOptions, WindowOptions, replay

        spec, res, layers = argv[2], argv[3], int(argv[4])
        m = replay(trace, spec, ReplayOptions(window=WindowOptions(layers=layers), tier=TierOptions(max_memory_bytes=16 << 30)), out=res)
        virtual = bool(m["backend"].get("virtual"))  # vemu allocates neither arena nor staging
        out = {"arena": 0 if virtual else m["params"]["arena_bytes"],
               "staging": 0 if virtual else m["backend"]["facts"].get("staging_bytes") or 0,
               "accesses": sum(m["ops"][op]["accesses"] for op in m["ops"]), "steps": m["steps"]["count"],
               "entries": m["trace"]["summary"]["entries"], "requests": m["trace"]["summary"]["requests"],
               "wall_s": m["wall_s"]}
    out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["vm_hwm"] = vm_hwm()
    print(json.dumps(out))
    return 0


def measure(*args) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", *map(str, args)], capture_output=True, text=True,
                       timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"child {args} failed: {p.stderr.strip()[-600:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def series(key: str, label: str, rows: list[tuple[str, dict, dict]]) -> None:
    """rows: (name, replay measurement, open-only baseline)."""
    for name, r, base in rows:
        info(f"{key} {name}: {r['steps']:,} steps, {r['entries']:,} entries, "
             f"{r['accesses']:,} accesses, replay {r['wall_s']:.1f} s: peak RSS {r['maxrss'] / MIB:.0f} MiB, "
             f"arena {r['arena'] / MIB:.0f} MiB (+ staging {r['staging'] / MIB:.0f} MiB), RSS - arena "
             f"{(r['maxrss'] - r['arena']) / MIB:.0f} MiB (VmHWM {r['vm_hwm'] / MIB:.0f} MiB); open-only baseline "
             f"{base['maxrss'] / MIB:.0f} MiB")
    over = [(r["maxrss"] - r["arena"]) / MIB for _, r, _ in rows]
    base = [b["maxrss"] / MIB for _, _, b in rows]
    spread = max(over) - min(over)
    entries = rows[-1][1]["entries"] / max(rows[0][1]["entries"], 1)
    own = [(r["maxrss"] - r["arena"] - b["maxrss"]) / MIB for _, r, b in rows]
    result("PASS" if spread <= FLAT_MIB else "FAIL", f"memory.{key}",
           f"RSS - arena {' / '.join(f'{o:.0f}' for o in over)} MiB over {label} ({entries:.0f}x the entries) | "
           f"open-only baseline {' / '.join(f'{b:.0f}' for b in base)} MiB | spread {spread:.0f} MiB, longest / "
           f"shortest {over[-1] / over[0]:.2f} | target spread <= {FLAT_MIB} MiB")
    result("INFO", f"memory.{key}.beyond-open",
           f"RSS - arena - open-only baseline (what the replay adds to opening the trace): "
           f"{' / '.join(f'{o:.0f}' for o in own)} MiB")


def command(*args) -> dict:
    """``python -m kvemu ARGS`` in a process of its own: its peak RSS (bytes), CPU and wall seconds,
    from wait4 (this process's own high-water mark stays out)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "kvemu", *map(str, args)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parent.parent)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"kvemu {' '.join(map(str, args))} failed: {err.decode()[-600:]}")
    return {"maxrss": ru.ru_maxrss * 1024, "cpu_s": ru.ru_utime + ru.ru_stime, "wall_s": time.perf_counter() - t0}


def closed_and_stack(d: Path, src: Path, quick: bool, reps: int, only) -> None:
    """The closed loop's peak RSS against the recorded schedule's (full trace), and a three-level
    stack's CPU against a single tier's (first 3,000 requests; --quick: 1,000 and 500)."""
    n_closed, n_stack = (1000, 500) if quick else (None, 3000)
    for key, n in (("closed", n_closed), ("stack", n_stack)):
        if key not in only:
            continue
        t = d / f"{key}.parquet"
        extra = [] if n is None else ["--max-requests", n]
        command("record", "--workload", f"mooncake:{src}", "--model", "llama3-70b", "--time-scale", 5,
                "--out", t, *extra)
        what = f"Mooncake conversation trace{'' if n is None else f', first {n} requests'}, llama3-70b, --time-scale 5"
        a_, b_ = Stat(), Stat()
        a_cpu, b_cpu = Stat(), Stat()
        for i in range(reps):
            if key == "closed":
                a = command("replay", t, "--backend", "vemu:cxl-pool", "--out", d / f"c{i}.parquet")
                b = command("replay", t, "--backend", "vemu:cxl-pool", "--schedule", "recorded",
                            "--out", d / f"r{i}.parquet")
            else:
                a = command("replay", t, "--backend", "vemu:local-dram", "--tiers", STACK, "--out", d / f"s{i}.parquet")
                b = command("replay", t, "--backend", "vemu:local-dram", "--out", d / f"o{i}.parquet")
            for x, y in ((a, a_), (b, b_)):
                y.add(x["maxrss"] / MIB)
            a_cpu.add(a["cpu_s"]); b_cpu.add(b["cpu_s"])
            names = ("closed loop", "recorded schedule") if key == "closed" else ("3-level stack", "single tier")
            info(f"{key} pair {i + 1}: " + " | ".join(
                f"{name} peak RSS {x['maxrss'] / MIB:.0f} MiB, CPU {x['cpu_s']:.1f} s, wall {x['wall_s']:.1f} s"
                for name, x in zip(names, (a, b))))
        if key == "closed":
            r = ratios(a_, b_)
            ok = r.median <= CLOSED_RATIO and a_.median <= CLOSED_MIB
            result("PASS" if ok else "FAIL", "memory.closed-vs-recorded",
                   f"closed loop peak RSS {a_.fmt(0, 'MiB')} | recorded schedule (baseline) {b_.fmt(0, 'MiB')} | "
                   f"ratio {r.fmt(2)} | target <= {CLOSED_RATIO:.2f} and <= {CLOSED_MIB} MiB ({what}, vemu:cxl-pool, "
                   f"all layers)")
            result("INFO", "memory.closed-vs-recorded.cpu",
                   f"closed loop CPU {a_cpu.fmt(1, 's')} | recorded schedule {b_cpu.fmt(1, 's')} | ratio "
                   f"{ratios(a_cpu, b_cpu).fmt(2)}")
        else:
            r = ratios(a_cpu, b_cpu)
            result("PASS" if r.median <= STACK_RATIO else "FAIL", "stack.cpu-vs-single",
                   f"3-level stack CPU {a_cpu.fmt(1, 's')} | single tier (baseline) {b_cpu.fmt(1, 's')} | ratio "
                   f"{r.fmt(2)} | target <= {STACK_RATIO:.2f} ({what}, closed loop, all layers; stack {STACK})")
            result("INFO", "stack.rss-vs-single",
                   f"3-level stack peak RSS {a_.fmt(0, 'MiB')} | single tier {b_.fmt(0, 'MiB')} | ratio "
                   f"{ratios(a_, b_).fmt(2)}")
        t.unlink()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    ap = parser(__doc__, "fewer and shorter traces")
    ap.add_argument("--only", default="dram,vemu,closed,stack", help="the series to run (comma-separated)")
    ap.add_argument("--mooncake", type=Path, default=None, help="the Mooncake conversation trace (default: "
                    "../shared/traces/ beside the repository)")
    a = ap.parse_args()
    only = set(a.only.split(","))
    header("peak memory of a replay vs its arena", a)
    src = a.mooncake or mooncake_path()
    if only & {"closed", "stack"}:
        if not src.exists():
            result("SKIP", "memory.closed-vs-recorded", f"{src} not found")
        else:
            with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
                closed_and_stack(Path(d), src, a.quick, a.repeat or (1 if a.quick else 2), only)
    if not only & {"dram", "vemu"}:
        return 0
    # This process stays small and records in children too: a child's ru_maxrss starts from its
    # parent's peak (Linux carries the high-water mark across fork and exec).
    questions = (8, 64, 512) if a.quick else (8, 32, 128, 512, 1024)
    requests = (500, 2000) if a.quick else (1000, 4000, 12031)
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        d = Path(d)
        rows = []
        for q in (questions if "dram" in only else ()):
            t = d / f"docqa{q}.parquet"
            measure("record", t, f"synthetic:docqa:documents=2,questions={q}", "llama3-8b",
                    json.dumps({"hbm_kv_gib": 1.6}))
            rows.append((f"{2 * q} requests", measure("replay", t, "dram", d / f"r{q}.parquet", 1),
                         measure("open", t)))
            os.remove(t)
        if rows:
            series("dram", "docqa " + "/".join(str(2 * q) for q in questions) + " requests", rows)
        if "vemu" not in only:
            return 0
        if not src.exists():
            result("SKIP", "memory.vemu", f"{src} not found")
            return 0
        rows = []
        for n in requests:
            t = d / f"mc{n}.parquet"
            measure("record", t, f"mooncake:{src}", "llama3-70b", json.dumps({"max_requests": n}))
            rows.append((f"first {n}", measure("replay", t, "vemu:cxl-pool", d / f"m{n}.parquet", 1),
                         measure("open", t)))
            os.remove(t)
        series("vemu", "Mooncake first " + "/".join(map(str, requests)) + " requests", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
