#!/usr/bin/env python3
"""`kvemu analyze capacity` side by side with kvcache-simulator on the same LRU capacity curve.

The peer is not part of kvemu: `pip install kvcache-simulator` (KVCache.AI's hit-rate simulator,
tested with 0.1.3; its C++ core is compiled on first use), or pass how to start it with --peer
(e.g. --peer "python -m kvcache_sim" with its wheel unpacked on PYTHONPATH).

Input: a kvemu trace of the Mooncake conversation workload (default: recorded here first for
llama3-70b with `--time-scale 5` at the default 16-token engine blocks). The peer runs twice:

- `jsonl`: on the Mooncake JSONL itself, at its own 512-token hash blocks (what a user of the peer
  runs on this workload; 32x fewer block references than kvemu's 16-token blocks);
- `stream`: on kvemu's reference stream: every request's full prompt blocks in arrival order, as
  kvemu's capacity curve reads them (kvemu.analysis.input_block_stream), one JSONL line a request
  at the trace's block size.

Both get the same capacities: kvemu's default 24-point grid, in GiB at the model's KV bytes per
token (llama3-70b = the peer's llama-3.1-70b: 320 KiB a token in bf16). Only LRU (kvemu's default
curve; the peer's --policies lru). Each repetition runs the three commands back to back as
subprocesses, rotating which goes first; one untimed warm-up of each comes first (the peer
compiles its core then). Wall time and CPU time (user + system of the child) are both reported.
kvemu runs from its modules' cached bytecode, as the peer does from the bytecode pip compiled at
its install: PYTHONDONTWRITEBYTECODE is dropped from kvemu's environment, so that its first
(untimed) run writes the cache (with no cache written, every run compiles kvemu's modules afresh:
about 0.13 CPU s); --no-bytecode-cache keeps the environment as it is (a cache already written is
still read).
See docs/performance.md, "Side by side: kvcache-simulator".

    python tools/bench_vs_kvcache_simulator.py [--quick] [--repeat N] [--trace T.parquet]
        [--jsonl mooncake_conversation_trace.jsonl] [--peer CMD]
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import REPO, Stat, header, info, mooncake_path, parser, repeats, result

from kvemu.analysis import input_block_stream
from kvemu.schema import read_trace

TARGET_RATIO = 1.5
PEER_MODEL = "llama-3.1-70b"  # kvemu llama3-70b: 80 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def _timed(cmd: list[str], out: Path, env: dict | None = None) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one child."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(out, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.DEVNULL, cwd=REPO, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = parser(__doc__, "3 repetitions instead of 5")
    ap.add_argument("--trace", default=None, help="a recorded trace (default: record the Mooncake trace first)")
    ap.add_argument("--jsonl", default=None, help="the Mooncake conversation JSONL (default: ../shared/traces/)")
    ap.add_argument("--peer", default="kvcache-simulator", help="command that starts kvcache-simulator")
    ap.add_argument("--jsonl-only", action="store_true",
                    help="time the peer on its JSONL only, not on kvemu's 16-token stream (minutes a run)")
    ap.add_argument("--no-bytecode-cache", action="store_true",
                    help="run kvemu in this environment as it is (with PYTHONDONTWRITEBYTECODE set and no cache "
                         "written yet, every run compiles kvemu's modules afresh)")
    a = ap.parse_args()
    reps = repeats(a, 3, 5)
    header("analyze capacity vs kvcache-simulator, LRU curve, same capacities", a)
    src = Path(a.jsonl) if a.jsonl else mooncake_path()
    if not src.exists():
        result("SKIP", "capacity_vs_kvcache_simulator.ratio", f"{src} not found")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvemu-bench-") as d:
        work = Path(d)
        path = a.trace
        if path is None:
            from kvemu.record_options import RecordOptions
            from kvemu.recording import record

            path = work / "mc.parquet"
            record(f"mooncake:{src}", "llama3-70b", path, RecordOptions.from_flat(time_scale=5.0, show_progress=False))
        kvemu_cmd = [sys.executable, "-m", "kvemu", "analyze", "capacity", str(path), "--json"]
        kvemu_env = None if a.no_bytecode_cache else \
            {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        # kvemu's grid, from a first (untimed) run of the command itself (which caches its bytecode)
        curve = json.loads(subprocess.run(kvemu_cmd, check=True, capture_output=True, text=True, cwd=REPO,
                                          env=kvemu_env).stdout)
        caps = curve["capacity_bytes"]
        tr = read_trace(path)
        tpb = tr.header.tokens_per_block
        ids, req = input_block_stream(tr)
        stream = work / "stream.jsonl"
        ends = np.searchsorted(req, np.arange(tr.n_requests + 1), side="left")
        with open(stream, "w") as f:
            for r in range(tr.n_requests):
                f.write(json.dumps({"block_size": tpb, "input_length": int(tr.input_tokens[r]),
                                    "hash_ids": ids[ends[r]:ends[r + 1]].tolist()}) + "\n")
        budgets = ",".join(f"{c / 2**30:.6g}" for c in caps if c > 0)
        peer = [*shlex.split(a.peer), "run", "--model", PEER_MODEL, "--kv-precision", "bf16_fp16",
                "--policies", "lru", "--budgets-gib", budgets, "--no-progress", "--format", "json"]
        cmds = {"kvemu": kvemu_cmd, "jsonl": [*peer, "--trace", str(src), "--block-size", "512"],
                "stream": [*peer, "--trace", str(stream)]}
        peers = ("jsonl",) if a.jsonl_only else ("jsonl", "stream")
        if a.jsonl_only:
            del cmds["stream"]
        for name in peers:
            _timed(cmds[name], work / f"{name}.out")  # warm-up: compiles the peer's core
        wall = {k: Stat() for k in cmds}
        cpu = {k: Stat() for k in cmds}
        ratio = {k: (Stat(), Stat()) for k in peers}
        names = list(cmds)
        for i in range(reps):
            order = names[i % len(names):] + names[:i % len(names)]
            got = {name: _timed(cmds[name], work / f"{name}.out", kvemu_env if name == "kvemu" else None)
                   for name in order}
            for name, (w, c) in got.items():
                wall[name].add(w)
                cpu[name].add(c)
            for name in peers:
                ratio[name][0].add(got["kvemu"][0] / got[name][0])
                ratio[name][1].add(got["kvemu"][1] / got[name][1])
    load = os.getloadavg()
    info(f"trace {path}: {tr.n_requests} requests, {len(ids)} prompt-block references of {tpb} tokens, "
         f"{len(caps)} capacities; {reps} repetitions, rotated; load average {load[0]:.1f} at the end")
    info("kvemu:  " + " ".join(kvemu_cmd[1:]) + (" (bytecode as this environment has it)" if a.no_bytecode_cache
                                                 else " (from its cached bytecode)"))
    info("jsonl:  " + " ".join(cmds["jsonl"][:4]) + f" --trace {src.name} --block-size 512 --model {PEER_MODEL} "
         "--policies lru --budgets-gib <kvemu's grid>")
    if not a.jsonl_only:
        info("stream: the same on kvemu's 16-token block stream as JSONL")
    info(f"kvemu wall {wall['kvemu'].fmt(2, 's')}, CPU {cpu['kvemu'].fmt(2, 's')} | "
         f"peer on the JSONL wall {wall['jsonl'].fmt(2, 's')}, CPU {cpu['jsonl'].fmt(2, 's')}"
         + ("" if a.jsonl_only else
            f" | peer on the stream wall {wall['stream'].fmt(2, 's')}, CPU {cpu['stream'].fmt(2, 's')}"))
    for name, what in (("jsonl", "its 512-token blocks"), ("stream", "the same 16-token stream")):
        if name not in peers:
            continue
        w, c = ratio[name]
        result("PASS" if w.median <= TARGET_RATIO else "FAIL", f"capacity_vs_kvcache_simulator.{name}",
               f"kvemu / kvcache-simulator on {what}: wall {w.fmt(2)}, CPU {c.fmt(2)} | target <= {TARGET_RATIO}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
