#!/usr/bin/env python3
"""Regenerate the small sample traces in traces/ (kvemu's own output; see traces/README.md).

    python tools/make_sample_traces.py [--force]
    python tools/make_sample_traces.py --rewrite   # add checksums to the samples as they are

``--rewrite`` keeps each sample's rows and metadata byte for byte and writes them again with page
checksums and the content digest (docs/trace-format.md, "Checksums"), after validating them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvemu.analysis import load_line
from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.schema import rewrite_with_checksums

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"

SAMPLES = [
    # (file, workload, model, options). Arrivals are stretched (time_scale) so that every sample runs
    # below what its GPUs serve; the load line below says how far.
    ("chat-llama3-8b-offload.parquet", "synthetic:chat", "llama3-8b",
     {"tier_policy": "offload", "hbm_kv_gib": 2}),
    ("chat-llama3-8b-resident.parquet", "synthetic:chat", "llama3-8b", {"tier_policy": "resident"}),
    ("docqa-qwen2.5-72b-offload.parquet", "synthetic:docqa", "qwen2.5-72b",
     {"tier_policy": "offload", "hbm_kv_gib": 8, "time_scale": 4.0}),
    ("mooncake-first500-llama3-70b-offload.parquet", f"mooncake:{MOONCAKE}", "llama3-70b",
     {"tier_policy": "offload", "max_requests": 500, "time_scale": 8.0}),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--rewrite", action="store_true",
                    help="rewrite the existing samples with checksums, rows and metadata unchanged")
    a = ap.parse_args()
    if a.rewrite:
        for name, *_ in SAMPLES:
            path = ROOT / "traces" / name
            tmp = path.with_name(f".{name}.rewrite")
            rewrite_with_checksums(path, tmp)
            tmp.replace(path)
            print(f"{name}: rewritten with checksums, {path.stat().st_size / 1024:.0f} KiB")
        return 0
    for name, workload, model, opts in SAMPLES:
        if workload.startswith("mooncake:") and not MOONCAKE.exists():
            print(f"skip {name}: {MOONCAKE} not found", file=sys.stderr)
            continue
        out = ROOT / "traces" / name
        meta = record(workload, model, out, RecordOptions.from_flat(force=a.force, show_progress=False, **opts))
        print(f"{name}: {meta['workload']['requests']} requests, {meta['engine']['steps']} steps, "
              f"{out.stat().st_size / 1024:.0f} KiB; {load_line(meta['load'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
