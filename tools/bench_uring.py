#!/usr/bin/env python3
"""The `uring` backend against fio (ioengine=io_uring, direct=1) on the same file, same run.

Three figures, each repetition running kvemu and fio back to back on one file under --dir
(a real disk file system, not tmpfs):

  4 KiB random reads at queue depth 1   IOPS      target >= 90 % of fio's
  4 KiB random reads at queue depth 32  IOPS      target >= 90 % of fio's
  256 KiB random reads at queue depth 32  GB/s    target >= 90 % of fio's

kvemu: one Backend per configuration (`uring:PATH,qd=N,size=existing`; the first creates the
file, `keep=1`), one request whose block table is a random permutation of the file's blocks, one
step that loads them all through the raw `Backend.replay` call (batches of 256 accesses, the
queue drains between batches, as in any replay). The headline is wall-clock (accesses / time of
the call), as fio's figure is; the figure replay results report (accesses / busy time) is shown
beside it. fio: `--rw=randread --ioengine=io_uring --direct=1 --fixedbufs --registerfiles`
(kvemu registers its buffers and file too), time-based. The benchmark installs nothing: without
fio on PATH its side is skipped with a message.

    python tools/bench_uring.py [--quick] [--repeat N] [--dir /var/tmp] [--size-mib N]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from bench_common import Stat, header, info, parser, ratio_result, repeats, result, sequential_loads

from kvemu.backends import Backend
from kvemu.errors import BackendUnavailable

TARGET = 0.90
#: (key, block bytes, queue depth, figure)
CONFIGS = (("uring.4k.qd1", 4096, 1, "iops"), ("uring.4k.qd32", 4096, 32, "iops"),
           ("uring.256k.qd32", 256 << 10, 32, "gbps"))
#: accesses per backend call for the QD32 drain fit (256 is the core's KV_BATCH)
DRAIN_SIZES = (32, 64, 128, 256)


def fs_type(path: Path) -> str:
    """File system type of the mount holding path (longest mount point prefix in /proc/mounts)."""
    best, kind = "", "unknown"
    p = str(path.resolve())
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def kvemu_run(b: Backend, n_slots: int, n: int, rng, per_call: int = 0) -> tuple[float, float, float]:
    """(accesses/s wall, accesses/s busy, GB/s wall) of n random loads through Backend.replay.

    per_call=0: one step holding all n (the core hands them to the backend 256 at a time);
    per_call=k: steps of k loads each, so every backend call carries k accesses.
    """
    slots = np.resize(rng.permutation(n_slots).astype(np.uint32), n)
    k = per_call or n
    n_steps = n // k
    n = n_steps * k
    table_off, steps, entries = sequential_loads(n_steps, k)
    b.reset_stats()
    t0 = time.perf_counter()
    b.replay(table_off, slots[:n], steps, entries, np.ones(1, np.uint32))
    wall = time.perf_counter() - t0
    st = b.op_stats("load")
    return n / wall, st["accesses"] / st["busy_ns"] * 1e9, st["bytes"] / wall / 1e9


def fio_run(fio: str, path: Path, size: int, block: int, qd: int, seconds: float) -> dict:
    cmd = [fio, "--name=kvemu-bench", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
           "--rw=randread", f"--bs={block}", f"--iodepth={qd}", f"--size={size}", "--time_based",
           f"--runtime={seconds}s", "--fixedbufs=1", "--registerfiles=1", "--invalidate=1",
           "--output-format=json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 5 + 60)
    if p.returncode != 0:
        raise RuntimeError(f"fio failed ({p.returncode}): {p.stderr.strip()[-400:]}")
    job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
    return {"iops": job["iops"], "gbps": job["bw_bytes"] / 1e9, "clat_p50_us": job["clat_ns"]["percentile"].get(
        "50.000000", float("nan")) / 1e3}


def main() -> int:
    ap = parser(__doc__, "3 repetitions instead of 5, 2 s per run instead of 4, a 1 GiB file instead of 2")
    ap.add_argument("--dir", default="/var/tmp", help="folder on a real disk file system (default /var/tmp)")
    ap.add_argument("--size-mib", type=int, default=None, help="file size in MiB")
    a = ap.parse_args()
    reps = repeats(a, 3, 5)
    seconds = 2.0 if a.quick else 4.0
    size = (a.size_mib or (1024 if a.quick else 2048)) << 20
    header("io_uring: kvemu uring vs fio on the same file", a)
    folder = Path(a.dir)
    kind = fs_type(folder)
    if kind in ("tmpfs", "ramfs"):
        for key, *_ in CONFIGS:
            result("SKIP", key, f"{folder} is {kind}; give --dir on a disk file system")
        return 0
    fio = shutil.which("fio")
    path = folder / f"kvemu-bench-{uuid.uuid4().hex[:8]}.bin"
    rng = np.random.default_rng(0)
    kv_wall = {k: Stat() for k, *_ in CONFIGS}
    kv_busy = {k: Stat() for k, *_ in CONFIGS}
    fio_fig = {k: Stat() for k, *_ in CONFIGS}
    p50 = {k: Stat() for k, *_ in CONFIGS}
    # QD32 4 KiB with every backend call carrying k accesses: time per call = k / rate + drain
    per_call = {k: Stat() for k in DRAIN_SIZES}
    # QD32 4 KiB with all freed slots handed to the kernel in one io_uring_enter (batch=32)
    burst = Stat()
    backends = {}
    try:
        try:
            for i, (key, block, qd, _) in enumerate(CONFIGS):
                size_opt = "size=create,keep=1" if i == 0 else "size=existing"
                b = Backend(f"uring:{path},qd={qd},{size_opt}")
                b.prepare(block, size // block, 1, 1, False)
                backends[key] = b
            b = Backend(f"uring:{path},qd=32,batch=32,size=existing")
            b.prepare(4096, size // 4096, 1, 1, False)
            backends["burst"] = b
        except BackendUnavailable as e:
            for key, *_ in CONFIGS:
                result("SKIP", key, f"uring unavailable here: {e}")
            return 0
        facts = backends[CONFIGS[0][0]].describe()
        n_ops = {key: (2000 if block == 4096 and qd == 1 else 20000 if block == 4096 else 2000)
                 for key, block, qd, _ in CONFIGS}
        for _ in range(reps):
            for key, block, qd, fig in CONFIGS:
                iops_wall, iops_busy, gbps = kvemu_run(backends[key], size // block, n_ops[key], rng)
                # the next run lasts about as long as fio's
                n_ops[key] = max(1000, int(iops_wall * seconds))
                kv_wall[key].add(iops_wall if fig == "iops" else gbps)
                kv_busy[key].add(iops_busy if fig == "iops" else iops_busy * block / 1e9)
                if key == "uring.4k.qd32":
                    for k in DRAIN_SIZES:
                        per_call[k].add(kvemu_run(backends[key], size // block, max(k, int(iops_wall * seconds / 4)),
                                                  rng, per_call=k)[0])
                    burst.add(kvemu_run(backends["burst"], size // block, n_ops[key], rng)[0])
                if fio:
                    out = fio_run(fio, path, size, block, qd, seconds)
                    fio_fig[key].add(out[fig])
                    p50[key].add(out["clat_p50_us"])
    finally:
        for b in backends.values():
            b.close()
        if path.exists():
            path.unlink()
    info(f"file {size >> 20} MiB on {kind} ({folder}), O_DIRECT, registered buffers "
         f"{facts.get('registered_buffers')}, files {facts.get('registered_files')}; about {seconds:.0f} s per run; "
         f"{reps} repetitions, kvemu and fio back to back")
    for key, block, qd, fig in CONFIGS:
        unit = "IOPS" if fig == "iops" else "GB/s"
        digits = 0 if fig == "iops" else 3
        what = f"{block >> 10} KiB randread QD{qd}"
        if not fio:
            result("SKIP", key, f"fio not installed (Debian: apt-get install fio); kvemu alone: {what} "
                                f"{kv_wall[key].fmt(digits, unit)} wall, {kv_busy[key].fmt(digits, unit)} busy")
            continue
        ratio_result(key, f"{what}: kvemu uring (wall)", kv_wall[key], "fio io_uring", fio_fig[key], unit, TARGET,
                     digits=digits, note=f"(kvemu by busy time {kv_busy[key].fmt(digits, unit)}; "
                                         f"fio clat p50 {p50[key].fmt(1, 'us')})")
    # time per backend call t(k) = k / R + c: R the rate with the queue kept full, c what one
    # drain of the queue costs (the core drains it after every call of at most 256 accesses)
    ks = np.array(DRAIN_SIZES, float)
    t_call = np.array([k / per_call[k].median for k in DRAIN_SIZES])
    slope, icpt = np.polyfit(ks, t_call, 1)
    result("INFO", "uring.4k.qd32.drain",
           "kvemu IOPS with k accesses per backend call: " +
           ", ".join(f"k={k} {per_call[k].fmt(0)}" for k in DRAIN_SIZES) +
           f"; fit t = k/R + c: R = {1 / slope:,.0f} IOPS with the queue kept full, c = {icpt * 1e6:.0f} us per drain"
           + (f"; R / fio = {1 / slope / fio_fig['uring.4k.qd32'].median:.3f}" if fio else ""))
    result("INFO", "uring.4k.qd32.batch32",
           f"kvemu IOPS with batch=32 (every free slot in one io_uring_enter) {burst.fmt(0)} vs the default "
           f"batch=1 {kv_wall['uring.4k.qd32'].fmt(0)}: ratio {burst.median / kv_wall['uring.4k.qd32'].median:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
