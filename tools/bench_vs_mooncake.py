#!/usr/bin/env python3
"""kvemu side by side with Mooncake's storage_benchmark_v1: the same requests and bytes, two page sizes.

The peer is not part of kvemu: extract it yourself and pass its folder, e.g.
    git clone https://github.com/kvcache-ai/Mooncake && \\
    python tools/bench_vs_mooncake.py --peer Mooncake/benchmarks/storage_benchmark_v1

Workload: the first --requests requests of the Mooncake conversation trace (one hash_id = 512
tokens). The peer moves one page per hash_id: a write the first time, a read after; its page is
--page-size-tokens x 61 layers x 576 values x 2 bytes (preset kimi-k2.6). Two page sizes
(--page-tokens): the peer's default, 512 tokens (35,979,264 bytes), and 16 tokens (1,124,352 bytes,
a 1 MiB-class page). kvemu replays the same pages: a DeepSeek-V3 config.json written here with 61
layers and kv_lora_rank + qk_rope_head_dim = 576 x T / 512 values per token (512 + 64 at the default
page; 16 + 2 at 16 tokens), recorded with 512-token blocks and chunks, cross-layer (one transfer =
one page of every layer = the peer's page, byte for byte), an HBM pool of --hbm-kv-gib x T / 512
(the same number of pages at both sizes: small, so that prefix hits come from the tier as the
peer's do). Both tiers hold --pages pages: the peer's file under --dir, kvemu's `uring` file there
and its `dram` arena (huge pages advised, its default: `page_size` and the bytes the kernel backed
with huge pages are printed from the results' facts).

Each repetition runs the peer, kvemu `dram` and kvemu `uring` back to back, rotating which goes
first; the recording is made once per page size, untimed, and both tools' Python bytecode is
compiled once beforehand into the work folder (as an installed package has it). Figures: each command's wall time as a
process (kvemu's replay includes loading the trace, pre-faulting its arena, writing the results;
the peer's includes loading the trace and creating its sparse file) and its CPU time (user +
system); result lines kvemu / peer per backend and page size, target at most 1.00 (issue 43 item
5). Tier files are removed after each run. See docs/performance.md, "Side by side: Mooncake
storage_benchmark_v1".

    python tools/bench_vs_mooncake.py --peer DIR [--requests 20] [--pages 100] [--repeat 3]
        [--page-tokens 512,16] [--dir /var/tmp]
"""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import REPO, Stat, info, mooncake_path, parser, repeats, result  # noqa: E402

LAYERS, VALUES, DTYPE_BYTES = 61, 576, 2  # the peer's kimi-k2.6 = DeepSeek-V3's MLA: 512 + 64 values a token
HASH_TOKENS = 512  # tokens per hash_id of the Mooncake trace: kvemu's block and chunk
TARGET = 1.00
TOOLS = ("peer", "dram", "uring")
#: DeepSeek-V3's config.json fields kvemu reads (tests/test_configs.py holds the same), the KV ranks set per page.
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": LAYERS, "hidden_size": 7168,
               "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
               "vocab_size": 129280, "tie_word_embeddings": False}


def page_bytes(tokens: int) -> int:
    return tokens * LAYERS * VALUES * DTYPE_BYTES


#: The children's environment (set in main): Python's bytecode cached in the work folder, as an
#: installed package has it, whatever PYTHONDONTWRITEBYTECODE says here.
ENV: dict = dict(os.environ)


def _timed(cmd, cwd, out) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one child process, its output to ``out``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(out, "w") as f:
        subprocess.run([str(c) for c in cmd], check=True, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=ENV)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def peer_cmd(args, tokens: int, traces: Path, store: Path) -> list:
    return [sys.executable, "benchmark.py", "--scenario", "conversation", "--trace-dir", traces,
            "--storage-dir", store, "--model", "kimi-k2.6", "--page-size-tokens", tokens,
            "--max-requests", args.requests, "--max-pages", args.pages, "--fsync-mode", "none",
            "--threads", 1, "--progress-interval", 0]


def run_peer(args, tokens: int, work: Path) -> dict:
    traces = work / "traces"
    if not traces.exists():
        traces.mkdir()
        (traces / "conversation_trace.jsonl").symlink_to(Path(args.trace).resolve())  # the name it wants
    store = Path(args.dir) / f"kvemu-sbs-peer-{os.getpid()}"
    shutil.rmtree(store, ignore_errors=True)
    log = work / "peer.out"
    try:
        wall, cpu = _timed(peer_cmd(args, tokens, traces, store), args.peer, log)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    text = log.read_text()
    out = {"wall_s": wall, "cpu_s": cpu, "loop_s": float(re.search(r"Total I/O Time:\s+([\d.]+)", text).group(1))}
    for op, title in (("load", "Read"), ("store", "Write")):
        sec = text.split(f"[{title} Operations]")[-1]
        num = lambda key: float(re.search(rf"{key}:\s+([\d,.]+)", sec).group(1).replace(",", ""))  # noqa: E731
        out[op] = {"ops": int(num("Count")), "bytes": num("Data Volume") * 2**20, "busy_s": num("Total Time")}
    return out


def model_config(tokens: int, work: Path) -> Path:
    values = VALUES * tokens // HASH_TOKENS
    rope = values // 9  # 64 of 576, as DeepSeek-V3
    path = work / f"deepseek-v3-{tokens}t-page.json"
    path.write_text(json.dumps({**DEEPSEEK_V3, "kv_lora_rank": values - rope, "qk_rope_head_dim": rope}))
    return path


def record(args, tokens: int, work: Path) -> Path:
    trace = work / f"mc-{tokens}.parquet"
    hbm = args.hbm_kv_gib * tokens / HASH_TOKENS
    cmd = [sys.executable, "-m", "kvemu", "record", "--workload", f"mooncake:{args.trace}", "--model",
           model_config(tokens, work), "--max-requests", args.requests, "--block-tokens", HASH_TOKENS,
           "--chunk-tokens", HASH_TOKENS, "--kv-layout", "cross-layer", "--hbm-kv-gib", f"{hbm:g}", "--out", trace]
    info("$ " + " ".join(map(str, cmd[1:])).replace(str(work), "WORK"))
    _timed(cmd, REPO, work / "record.out")
    return trace


def kvemu_cmd(trace: Path, backend: str, capacity: int, res: Path) -> list:
    return [sys.executable, "-m", "kvemu", "replay", trace, "--backend", backend, "--kv-layout", "cross-layer",
            "--link", "cpu", "--tier-capacity", capacity, "--max-memory", "64GiB", "--out", res]


def run_kvemu(args, tokens: int, trace: Path, work: Path, backend: str) -> dict:
    import pyarrow.parquet as pq

    res = work / f"{backend}.parquet"
    tier = Path(args.dir) / f"kvemu-sbs-tier-{os.getpid()}.bin"
    spec = f"uring:{tier}" if backend == "uring" else backend
    try:
        wall, cpu = _timed(kvemu_cmd(trace, spec, args.pages * page_bytes(tokens), res), REPO, work / "kvemu.out")
    finally:
        tier.unlink(missing_ok=True)  # uring removes the file it created; a failed run too
    m = json.loads(pq.read_schema(res).metadata[b"kvemu"])
    res.unlink()
    out = {"wall_s": wall, "cpu_s": cpu, "meta_wall_s": m["wall_s"], "prefault_s": m["prefault_s"],
           "facts": m["backend"]["facts"]}
    for op in ("load", "store"):
        o = m["ops"][op]
        out[op] = {"ops": o["accesses"], "bytes": o["bytes"], "busy_s": o["busy_ns"] / 1e9}
    return out


def main() -> int:
    ap = parser(__doc__, "5 requests and 2 repetitions (a check that it runs)")
    ap.add_argument("--peer", help="folder of Mooncake's benchmarks/storage_benchmark_v1 (without it: SKIP)")
    ap.add_argument("--trace", default=str(mooncake_path()))
    ap.add_argument("--requests", type=int, default=None, help="the first N requests of the trace [20; 5 with --quick]")
    ap.add_argument("--pages", type=int, default=100, help="tier capacity in pages, both tools [100]")
    ap.add_argument("--page-tokens", default="512,16",
                    help="peer page sizes in tokens, multiples of 8 [512 (the peer's default), 16 (1 MiB-class)]")
    ap.add_argument("--dir", default="/var/tmp", help="folder for both tier files (same file system) [/var/tmp]")
    ap.add_argument("--hbm-kv-gib", type=float, default=6,
                    help="kvemu's HBM KV pool at the 512-token page, scaled with the page [6 GiB = 179 pages: "
                         "the largest of the first 20 requests, 171 pages, fits]")
    args = ap.parse_args()
    args.requests = args.requests or (5 if args.quick else 20)
    reps = repeats(args, quick=2, full=3)
    pages = [int(t) for t in args.page_tokens.split(",")]
    if any(t <= 0 or (VALUES * t) % HASH_TOKENS for t in pages):
        ap.error("--page-tokens: each must be a positive multiple of 8 (576 x T / 512 values a token)")
    if not args.peer or not (Path(args.peer) / "benchmark.py").is_file():
        result("SKIP", "vs_mooncake", f"no storage_benchmark_v1 at --peer {args.peer} (see the docstring)")
        return 0
    if not Path(args.trace).is_file():
        result("SKIP", "vs_mooncake", f"{args.trace} not found")
        return 0
    free = shutil.disk_usage(args.dir).free
    need = 2 * args.pages * page_bytes(max(pages))  # the peer's file and kvemu's, never both at once; twice to be safe
    if need > free // 2:
        ap.error(f"--pages {args.pages}: the tier files need {need / 1e9:.1f} GB, more than half of the "
                 f"{free / 1e9:.1f} GB free in {args.dir}")
    load0 = os.getloadavg()[0]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="kvemu-sbs-") as d:
        work = Path(d)
        ENV.pop("PYTHONDONTWRITEBYTECODE", None)
        ENV["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        for folder in (args.peer, REPO / "kvemu"):  # both tools' bytecode compiled once, untimed
            _timed([sys.executable, "-m", "compileall", "-q", folder], REPO, work / "compile.out")
        for tokens in pages:
            trace = record(args, tokens, work)
            runs = {t: [] for t in TOOLS}
            for i in range(reps):
                order = TOOLS[i % 3:] + TOOLS[:i % 3]
                for t in order:
                    runs[t].append(run_peer(args, tokens, work) if t == "peer" else
                                   run_kvemu(args, tokens, trace, work, t))
            report(args, tokens, runs, reps)
    info(f"{stamp}; load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
         f"peer: {' '.join(map(str, peer_cmd(args, 'T', 'DIR', args.dir + '/…')))} (in --peer); "
         f"kvemu: {' '.join(map(str, kvemu_cmd('mc.parquet', 'dram|uring:FILE', 'PAGES x PAGE', 'r.parquet')))}")
    return 0


def report(args, tokens: int, runs: dict, reps: int) -> None:
    pb = page_bytes(tokens)
    info(f"page {tokens} tokens = {pb:,} bytes; first {args.requests} requests; {args.pages} pages "
         f"({args.pages * pb / 1e9:.2f} GB) per tier; {reps} repetitions, order rotated")
    info(f"{'tool':<10} {'wall s':>16} {'CPU s':>16} | {'loads':>6} {'GiB':>7} | {'stores':>6} {'GiB':>7} | notes")
    for t in TOOLS:
        r = runs[t][-1]
        wall, cpu = Stat(x["wall_s"] for x in runs[t]), Stat(x["cpu_s"] for x in runs[t])
        if t == "peer":
            note = f"request loop {Stat(x['loop_s'] for x in runs[t]).fmt(2, 's')}"
        else:
            f = r["facts"]
            note = (f"replay wall_s {Stat(x['meta_wall_s'] for x in runs[t]).fmt(2, 's')}, pre-fault "
                    f"{Stat(x['prefault_s'] for x in runs[t]).fmt(2, 's')}")
            if t == "dram":
                note += (f"; arena {f.get('arena_bytes', 0) / 2**30:.2f} GiB, base page {f.get('page_size')} B, "
                         f"huge pages advised {f.get('hugepages_advised')}: {(f.get('arena_hugepage_bytes') or 0) / 2**30:.2f}"
                         f" GiB backed by them; cold {f.get('cache_cold')}, {f.get('workers')} workers")
            else:
                note += f"; O_DIRECT, qd {f.get('qd', f.get('queue_depth', '?'))}"
        name = "peer" if t == "peer" else f"kvemu {t}"
        print(f"      {name:<10} {wall.fmt(2):>16} {cpu.fmt(2):>16} | {r['load']['ops']:>6} "
              f"{r['load']['bytes'] / 2**30:>7.2f} | {r['store']['ops']:>6} {r['store']['bytes'] / 2**30:>7.2f} | {note}",
              flush=True)
    for t in ("dram", "uring"):
        w = Stat(k["wall_s"] / p["wall_s"] for k, p in zip(runs[t], runs["peer"]))
        c = Stat(k["cpu_s"] / p["cpu_s"] for k, p in zip(runs[t], runs["peer"]))
        kw = Stat(x["wall_s"] for x in runs[t])
        pw = Stat(x["wall_s"] for x in runs["peer"])
        result("PASS" if w.median <= TARGET else "FAIL", f"vs_mooncake.{tokens}t.{t}",
               f"kvemu {t} wall {kw.fmt(2, 's')} | storage_benchmark_v1 wall {pw.fmt(2, 's')} | ratio {w.fmt(2)} "
               f"(CPU {c.fmt(2)}) | target <= {TARGET:.2f}  (page {pb / 2**20:.2f} MiB, pre-fault counted)")


if __name__ == "__main__":
    sys.exit(main())
