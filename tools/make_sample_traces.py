#!/usr/bin/env python3
"""Regenerate the small sample traces in traces/ (kvemu's own output; see traces/README.md).

    python tools/make_sample_traces.py [--force]
    python tools/make_sample_traces.py --rewrite   # add checksums to the samples as they are
    python tools/make_sample_traces.py --formats   # only the source-format samples in traces/formats/

The source-format samples (docs/workloads.md) are a few seeded coding-agent sessions, written in each
format kvemu reads: SemiAnalysis x WEKA, Qwen Bailian, Dynamo mooncake-delta and agentic_mooncake,
tair-kvcache and Mooncake. They are kvemu's own, made here; no line comes from a real trace.

``--rewrite`` keeps each sample's rows and metadata byte for byte and writes them again with page
checksums and the content digest (docs/trace-format.md, "Checksums"), after validating them.
"""

from __future__ import annotations

import argparse
import json
import random
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


# ------------------------------------------------------------------------- source-format samples
FORMATS = ROOT / "traces" / "formats"


def agent_sessions(seed: int = 7, sessions: int = 3, turns: int = 4) -> list[dict]:
    """A few coding-agent sessions: turns whose prompt is the context so far (system prompt shared by
    all), tool gaps, and one sub-agent branching off the first session's context.

    Each turn: ``t`` (s from the first session's start), ``prompt``, ``out``, ``api_s`` (its
    recorded service time), ``chain`` [(stream, tokens)] (a full block lies on the first stream of
    the chain reaching its end; stream -1 is the shared system prompt)."""
    rng = random.Random(seed)
    system = 1000
    out: list[dict] = []
    stream = 0
    for s in range(sessions):
        stream += 1
        own, t, context, reqs = stream, 5.0 * s, system + rng.randint(150, 450), []
        for k in range(turns):
            api = round(rng.uniform(0.5, 2.0), 3)
            reqs.append({"t": round(t, 3), "prompt": context, "out": rng.randint(40, 200), "api_s": api,
                         "chain": [(-1, system), (own, context)]})
            if s == 0 and k == 1:  # a sub-agent on a branch of this context
                stream += 1
                branch = [(-1, system), (own, context + reqs[-1]["out"])]
                ctx, st, sub = context + reqs[-1]["out"] + rng.randint(100, 300), t + api + 0.2, []
                for _ in range(2):
                    a = round(rng.uniform(0.4, 1.2), 3)
                    sub.append({"t": round(st, 3), "prompt": ctx, "out": rng.randint(30, 120), "api_s": a,
                                "chain": branch + [(stream, ctx)]})
                    ctx += sub[-1]["out"] + rng.randint(50, 250)
                    st += a + rng.uniform(0.3, 1.5)
                reqs[-1]["subagent"] = {"t": sub[0]["t"], "requests": sub}
                t = st
            context += reqs[-1]["out"] + rng.randint(60, 400)
            t += api + rng.uniform(0.5, 3.0)
        out.append({"id": f"session-{s}", "requests": reqs})
    return out


def block_ids(req: dict, block: int, keys: dict, full_only: bool = False, scope=None) -> list[int]:
    """The chained ids of a request's prompt blocks at ``block`` tokens, numbered in ``keys`` (one
    dict per hash scope); a last partial block gets an id of its own (or none with ``full_only``)."""
    ids = []
    n = req["prompt"] // block if full_only else -(-req["prompt"] // block)
    for j in range(n):
        end = (j + 1) * block
        owner = next((s for s, upto in req["chain"] if end <= upto), None) if end <= req["prompt"] else None
        key = (scope, owner, j) if owner is not None else ("own", id(req), j)
        ids.append(keys.setdefault(key, len(keys) + 1))
    return ids


def all_requests(sessions: list[dict]):
    """(session index, request, is_subagent) in time order."""
    flat = [(i, r, False) for i, s in enumerate(sessions) for r in s["requests"]]
    flat += [(i, q, True) for i, s in enumerate(sessions) for r in s["requests"] if "subagent" in r
             for q in r["subagent"]["requests"]]
    return sorted(flat, key=lambda x: x[1]["t"])


def write_jsonl(name: str, rows: list) -> None:
    FORMATS.mkdir(parents=True, exist_ok=True)
    (FORMATS / name).write_text("".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in rows))
    print(f"formats/{name}: {len(rows)} lines")


def write_format_samples() -> None:
    sessions = agent_sessions()
    # SemiAnalysis x WEKA (AIPerf's Weka trace model): one trace per line, hashes local to the trace
    traces = []
    for s in sessions:
        keys: dict = {}

        def req(r, model="claude-sonnet"):
            return {"t": r["t"], "type": "s", "model": model, "in": r["prompt"], "out": r["out"],
                    "hash_ids": block_ids(r, 64, keys), "input_types": ["text"], "output_types": ["text"],
                    "stop": "tool_use", "api_time": r["api_s"]}
        items = []
        for r in s["requests"]:
            items.append(req(r))
            if "subagent" in r:
                sub = r["subagent"]
                items.append({"t": sub["t"], "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
                              "status": "completed", "models": ["claude-haiku"],
                              "requests": [req(q, "claude-haiku") for q in sub["requests"]]})
        traces.append({"id": s["id"], "models": ["claude-sonnet"], "block_size": 64, "hash_id_scope": "local",
                       "tool_tokens": 600, "system_tokens": 400, "requests": items})
    write_jsonl("semianalysis.jsonl", traces)

    # Qwen Bailian: one request per line, follow-ups linked by parent_chat_id, 16-token global hashes
    keys, rows, last, turn = {}, [], {}, {}
    for chat, (i, r, sub) in enumerate(all_requests(sessions), start=100):
        unit = (i, sub)
        turn[unit] = turn.get(unit, 0) + 1
        rows.append({"chat_id": chat, "parent_chat_id": last.get(unit, -1), "timestamp": round(60 + r["t"], 3),
                     "input_length": r["prompt"], "output_length": r["out"], "type": "text", "turn": turn[unit],
                     "hash_ids": block_ids(r, 16, keys)})
        last[unit] = chat
    write_jsonl("bailian.jsonl", rows)

    # Dynamo agentic_mooncake: whole prompts, dependencies on the previous turn, tool waits
    keys, rows, prev = {}, [], {}
    for n, (i, r, sub) in enumerate(all_requests(sessions)):
        unit = f"s{i}" + ("-sub" if sub else "")
        row = {"request_id": f"r{n}", "session_id": unit, "input_length": r["prompt"], "output_length": r["out"],
               "hash_ids": block_ids(r, 512, keys), "timestamp": round(r["t"] * 1000.0, 1),
               "prefix_reset": unit not in prev}
        if unit in prev:
            p = prev[unit]
            gap = max(0.0, r["t"] - (p["t"] + p["api_s"])) * 1000.0
            row.update(wait_for=[p["id"]], delay=round(gap * 0.25, 1), tool_wait_ms=round(gap * 0.75, 1))
        prev[unit] = {"id": row["request_id"], "t": r["t"], "api_s": r["api_s"]}
        rows.append(row)
    write_jsonl("dynamo-agentic.jsonl", rows)

    # Dynamo mooncake-delta: per session, each turn lists only the tokens it adds and their hashes
    # (512-token blocks, Dynamo's default); the first block, inside the shared system prompt, is shared
    rows = []
    for i, s in enumerate(sessions):
        prompt_before, t_prev = 0, None
        for k, r in enumerate(s["requests"]):
            delta = r["prompt"] - prompt_before
            n = -(-delta // 512)
            row = {"session_id": s["id"], "input_length": delta, "output_length": r["out"],
                   "hash_ids": [1 if k == 0 and j == 0 else 1000 * (i + 1) + 100 * k + j for j in range(n)]}
            if k == 0:
                row["timestamp"] = round(r["t"] * 1000.0, 1)
            else:
                row["delay"] = round(max(0.0, r["t"] - t_prev) * 1000.0, 1)
            t_prev = r["t"] + r["api_s"]
            prompt_before = r["prompt"] + r["out"]
            rows.append(row)
    write_jsonl("dynamo-delta.jsonl", rows)

    # tair-kvcache: one event per line, ns timestamps, keys of full 16-token blocks only
    keys, rows = {}, []
    for n, (i, r, sub) in enumerate(all_requests(sessions)):
        rows.append({"instance_id": f"instance-{i % 2}", "trace_id": f"t{n}",
                     "timestamp_ns": 1_700_000_000_000_000_000 + int(r["t"] * 1e9), "query_type": "prefix_match",
                     "keys": block_ids(r, 16, keys, full_only=True), "input_len": r["prompt"], "output_len": r["out"]})
    write_jsonl("tair.jsonl", rows)

    # Mooncake (FAST'25): ms timestamps, chained 512-token hashes, a partial last block counted
    keys = {}
    write_jsonl("mooncake.jsonl", [{"timestamp": int(r["t"] * 1000), "input_length": r["prompt"],
                                    "output_length": r["out"], "hash_ids": block_ids(r, 512, keys)}
                                   for _, r, _ in all_requests(sessions)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--rewrite", action="store_true",
                    help="rewrite the existing samples with checksums, rows and metadata unchanged")
    ap.add_argument("--formats", action="store_true", help="only the source-format samples in traces/formats/")
    a = ap.parse_args()
    write_format_samples()
    if a.formats:
        return 0
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
