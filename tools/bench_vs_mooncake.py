#!/usr/bin/env python3
"""kvemu side by side with Mooncake's storage_benchmark_v1 on one workload, block size and file system.

The peer is not part of kvemu: extract it yourself and pass its folder, e.g.
    git clone https://github.com/kvcache-ai/Mooncake && \\
    python tools/bench_vs_mooncake.py --peer Mooncake/benchmarks/storage_benchmark_v1

Workload: the first --requests requests of the Mooncake conversation trace. Block: one 512-token page
of every layer, 35,979,264 bytes (peer preset kimi-k2.6 = kvemu deepseek-v3: 61 layers x 576 values x
2 bytes per token; kvemu --kv-layout cross-layer moves a block's layers as one transfer). Both tiers
hold --pages pages in one file under --dir. See docs/performance.md, "Side by side: Mooncake
storage_benchmark_v1", for what each tool counts as an operation.
"""
import argparse, json, os, re, shutil, subprocess, sys, tempfile, time
from pathlib import Path

PAGE_BYTES = 512 * 61 * 576 * 2  # 35,979,264
HERE = Path(__file__).resolve().parent.parent


def run(cmd, **kw):
    print("$", " ".join(map(str, cmd)), flush=True)
    t = time.perf_counter()
    subprocess.run(list(map(str, cmd)), check=True, **kw)
    return time.perf_counter() - t


def peer(args, work):
    traces = work / "traces"
    traces.mkdir()
    (traces / "conversation_trace.jsonl").symlink_to(Path(args.trace).resolve())  # the name it wants
    store = Path(args.dir) / "sbs-peer"
    shutil.rmtree(store, ignore_errors=True)
    log = work / "peer.out"
    with open(log, "w") as f:
        wall = run([sys.executable, "benchmark.py", "--scenario", "conversation", "--trace-dir", traces,
                    "--storage-dir", store, "--model", "kimi-k2.6", "--page-size-tokens", 512,
                    "--max-requests", args.requests, "--max-pages", args.pages, "--fsync-mode", "none",
                    "--threads", 1, "--progress-interval", 0], cwd=args.peer, stdout=f)
    shutil.rmtree(store, ignore_errors=True)
    text = log.read_text()
    out = {"tool": "peer (pread/pwrite)", "wall_s": wall}
    for op, title in (("load", "Read"), ("store", "Write")):
        sec = text.split(f"[{title} Operations]")[-1]
        num = lambda key: float(re.search(rf"{key}:\s+([\d,.]+)", sec).group(1).replace(",", ""))
        out[op] = {"ops": int(num("Count")), "bytes": num("Data Volume") * 2**20, "busy_s": num("Total Time"),
                   "p50_ms": num("P50"), "p99_ms": num("P99")}
    out["loop_s"] = float(re.search(r"Total I/O Time:\s+([\d.]+)", text).group(1))
    return out


def kvemu(args, work, backend, capacity):
    trace = work / "mc.parquet"
    if not trace.exists():
        run(["kvemu", "record", "--workload", f"mooncake:{args.trace}", "--model", "deepseek-v3",
             "--max-requests", args.requests, "--block-tokens", 512, "--chunk-tokens", 512,
             "--kv-layout", "cross-layer", "--hbm-kv-gib", args.hbm_kv_gib, "--out", trace])
    res = work / f"{backend.split(':')[0]}.parquet"
    wall = run(["kvemu", "replay", trace, "--backend", backend, "--kv-layout", "cross-layer", "--link", "cpu",
                "--tier-capacity", capacity, "--max-memory", "64GiB", "--out", res])
    import pyarrow.parquet as pq
    m = json.loads(pq.read_schema(res).metadata[b"kvemu"])
    out = {"tool": f"kvemu {backend.split(':')[0]}", "wall_s": wall, "meta_wall_s": m["wall_s"],
           "prefault_s": m["prefault_s"]}
    for op in ("load", "store"):
        o = m["ops"][op]
        out[op] = {"ops": o["accesses"], "bytes": o["bytes"], "busy_s": o["busy_ns"] / 1e9,
                   "p50_ms": (o["p50_ns"] or 0) / 1e6, "p99_ms": (o["p99_ns"] or 0) / 1e6}
    busy = sum(m["ops"][op]["busy_ns"] for op in m["ops"]) / 1e9
    out["check"] = (f"wall {m['wall_s']:.1f} s <= 2 x {busy:.1f} s timed + {m['prefault_s']:.1f} s pre-fault"
                    f" = {2 * busy + m['prefault_s']:.1f} s: {'PASS' if m['wall_s'] <= 2 * busy + m['prefault_s'] else 'FAIL'}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", help="folder of Mooncake's benchmarks/storage_benchmark_v1 (omit: kvemu only)")
    p.add_argument("--trace", default=str(HERE.parent / "shared/traces/mooncake_conversation_trace.jsonl"))
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--pages", type=int, default=500, help="tier capacity in pages, both tools [500 = 18.0 GB]")
    p.add_argument("--dir", default="/var/tmp", help="folder for both tier files (same file system)")
    p.add_argument("--hbm-kv-gib", type=float, default=9,
                   help="kvemu HBM KV pool: small, so prefix hits come from the tier as the peer's do")
    p.add_argument("--dram-pages", type=int, default=480,
                   help="capacity of the kvemu dram run, 0: skip it [480 = 17.3 GB; at least 2x the largest request]")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sbs-", dir="/tmp"))
    print(subprocess.run(["df", "-hT", args.dir], capture_output=True, text=True).stdout, flush=True)
    rows = [peer(args, work)] if args.peer else []
    tier = Path(args.dir) / "sbs-tier.bin"
    rows.append(kvemu(args, work, f"uring:{tier}", args.pages * PAGE_BYTES))
    if args.dram_pages:
        rows.append(kvemu(args, work, "dram", args.dram_pages * PAGE_BYTES))
    print(f"\n{'tool':<20} {'wall s':>7} | {'op':<5} {'count':>6} {'GiB':>7} {'busy s':>7} {'GB/s':>6}"
          f" {'p50 ms':>7} {'p99 ms':>7}")
    for r in rows:
        wall = f"{r['wall_s']:.1f}"
        for i, op in enumerate(("load", "store")):
            o = r[op]
            gbps = o["bytes"] / o["busy_s"] / 1e9 if o["busy_s"] else float("nan")
            print(f"{r['tool'] if i == 0 else '':<20} {wall if i == 0 else '':>7} | {op:<5} {o['ops']:>6}"
                  f" {o['bytes'] / 2**30:>7.1f} {o['busy_s']:>7.1f} {gbps:>6.2f} {o['p50_ms']:>7.2f} {o['p99_ms']:>7.2f}")
    for r in rows:
        print(r["tool"], "|", r.get("check", f"loop {r.get('loop_s', 0):.1f} s"))
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
