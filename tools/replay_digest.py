"""Digest of replay results on virtual-time and recorded schedules, to check that a refactor keeps
behaviour: the sample traces replayed through the CLI on ``vemu`` in a fixed set of cases, every
results column and the metadata that does not depend on the wall clock or the host hashed.

    python tools/replay_digest.py --out before.json           # on the old code
    python tools/replay_digest.py --out after.json            # on the new code
    python tools/replay_digest.py --compare before.json after.json

Run from the repository root, with the code under test first on PYTHONPATH (the CLI runs as
``python -m kvemu.cli``). Not imported by kvemu.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "traces"

#: (name, trace, args): each a replay the refactor must leave unchanged.
CASES = [
    ("chat-offload-cxl", "chat-llama3-8b-offload.parquet", ["--backend", "vemu:cxl-pool"]),
    ("chat-offload-nvme", "chat-llama3-8b-offload.parquet", ["--backend", "vemu:nvme"]),
    ("chat-resident-cxl", "chat-llama3-8b-resident.parquet", ["--backend", "vemu:cxl-pool"]),
    # a resident trace reads in place, which storage tiers refuse: the async case on a switched pool
    ("chat-resident-pool-async", "chat-llama3-8b-resident.parquet", ["--backend", "vemu:cxl-pool-multi",
                                                                     "--kv-load", "async"]),
    ("chat-offload-async", "chat-llama3-8b-offload.parquet", ["--backend", "vemu:cxl-pool", "--kv-load", "async"]),
    ("chat-offload-recorded", "chat-llama3-8b-offload.parquet", ["--backend", "vemu:nvme", "--schedule", "recorded"]),
    ("chat-offload-cap", "chat-llama3-8b-offload.parquet", ["--backend", "vemu:cxl-pool", "--tier-capacity", "1GiB"]),
    ("chat-offload-serial-c2c", "chat-llama3-8b-offload.parquet", ["--backend", "vemu:cxl-pool", "--store-timing",
                                                                    "serial", "--link", "nvlink-c2c", "--overlap"]),
    ("docqa-2-shared-pa", "docqa-qwen2.5-72b-offload.parquet", ["--backend", "vemu:cxl-pool", "--instances", "2",
                                                               "--sharing", "shared", "--routing", "prefix-aware"]),
    ("docqa-3-replicated-ll", "docqa-qwen2.5-72b-offload.parquet", ["--backend", "vemu:nvme", "--instances", "3",
                                                                   "--sharing", "replicated", "--routing",
                                                                   "least-loaded"]),
    ("docqa-2-recorded", "docqa-qwen2.5-72b-offload.parquet", ["--backend", "vemu:cxl-pool", "--instances", "2",
                                                              "--schedule", "recorded"]),
    ("mooncake-window", "mooncake-first500-llama3-70b-offload.parquet", ["--backend", "vemu:rdma-storage",
                                                                        "--requests", "100:160", "--layers", "4"]),
    ("mooncake-scaled", "mooncake-first500-llama3-70b-offload.parquet", ["--backend", "vemu:cxl-pool",
                                                                        "--time-scale", "0.5", "--requests",
                                                                        "0:120"]),
]

#: Metadata that depends on the wall clock, the host, the file's path or the run's id.
VOLATILE = {"created", "run_id", "wall_s", "prefault_s", "host", "results_path", "creator"}
VOLATILE_TRACE = {"path"}


def _stable(meta: dict) -> dict:
    out = {k: v for k, v in meta.items() if k not in VOLATILE}
    if isinstance(out.get("trace"), dict):
        out["trace"] = {k: v for k, v in out["trace"].items() if k not in VOLATILE_TRACE}
    facts = (out.get("backend") or {}).get("facts")
    if isinstance(facts, dict):
        out["backend"] = {**out["backend"], "facts": {k: v for k, v in facts.items()
                                                      if k not in ("timer", "timer_ghz", "tsc_ghz", "host")}}
    return out


def _digest(path: Path) -> dict:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[b"kvemu"])
    cols = {}
    for name in table.column_names:
        cols[name] = hashlib.sha256(json.dumps(table.column(name).to_pylist(), default=str).encode()).hexdigest()[:16]
    stable = _stable(meta)
    return {"columns": cols, "meta": hashlib.sha256(json.dumps(stable, sort_keys=True, default=str).encode())
            .hexdigest()[:16], "meta_full": stable}


def run(out: Path, only: list[str] | None) -> None:
    result = {}
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        for name, trace, args in CASES:
            if only and name not in only:
                continue
            dst = Path(tmp) / f"{name}.parquet"
            cmd = [sys.executable, "-m", "kvemu.cli", "replay", str(TRACES / trace), *args, "--out", str(dst)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
            if p.returncode != 0:
                result[name] = {"error": p.stderr.strip().splitlines()[-1:]}
            else:
                result[name] = _digest(dst)
            print(f"{name}: {'error' if 'error' in result[name] else result[name]['meta']}", file=sys.stderr)
    out.write_text(json.dumps(result, indent=1, sort_keys=True, default=str))


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        lines = []
        for k in sorted(set(a) | set(b)):
            if k not in a:
                lines.append(f"{path}.{k}: only after")
            elif k not in b:
                lines.append(f"{path}.{k}: only before")
            else:
                lines.extend(_diff(a[k], b[k], f"{path}.{k}"))
        return lines
    return [] if a == b else [f"{path}: {json.dumps(a, default=str)[:200]} -> {json.dumps(b, default=str)[:200]}"]


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    lines = _diff(a, b)
    for line in lines:
        print(line)
    print("identical" if not lines else f"{len(lines)} differences")
    return 1 if lines else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--compare", nargs=2, type=Path)
    a = ap.parse_args()
    if a.compare:
        return compare(*a.compare)
    if not a.out:
        ap.error("--out or --compare")
    run(a.out, a.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
