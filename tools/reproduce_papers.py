#!/usr/bin/env python3
"""Rebuild the published pool-versus-RDMA comparisons with kvemu, in virtual time, and print kvemu's
ratios beside the papers' (docs/analysis.md, "Reproducing the published comparisons").

    PYTHONPATH=. python tools/reproduce_papers.py                # every setup, ~10 minutes here
    PYTHONPATH=. python tools/reproduce_papers.py --only beluga-docqa --work /tmp/papers
    PYTHONPATH=. python tools/reproduce_papers.py --commands     # print the kvemu commands only
    PYTHONPATH=. python tools/reproduce_papers.py --mooncake-trace /work/shared/traces/mooncake_conversation_trace.jsonl \
        --curve docs/img/papers-load-curves.png --solve --save rows.json   # and the load curves and inverse
                                                                            # solves: ~40 minutes here
    PYTHONPATH=. python tools/reproduce_papers.py --rows rows.json --curve docs/img/papers-load-curves.png

Each setup is one `kvemu record` and one `kvemu replay` per tier, run as printed (`python -m kvemu
...`), and where it says so the replays again with arrivals at a fraction of the pool's capacity.
The tiers: the CXL pool, the RDMA store with its software path (kvemu's `rdma-storage` profile),
and the same store's medium alone (its profile written without the software parts), which splits
the RDMA store's handicap into medium and software. Every replay is `vemu:` (virtual time: the
model's times, exact and host-independent). Setups whose input is absent (the Mooncake trace in
shared/traces, given with --mooncake-trace) are skipped with a line. Not imported by kvemu;
tests/test_reproduce_papers.py checks the table builder on a tiny trace, the inverse solve on a linear
model and the TraCT P/D setup's commands.

Three more things per setup (docs/analysis.md, "Reproducing the published comparisons"): the ratio at
a light load (LIGHT_LOAD of the pool's capacity, where no tier queues and the ratio is the two paths'
service times), the ratio against offered load (``--curve PNG``: LOAD_CURVE fractions, drawn by
plot_curves), and an inverse solve (``--solve``: the value of one software part, the host copy's rate
or a per-object cost, that makes kvemu's light-load ratio the published one, by solve_part).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
#: The public Mooncake trace, where the tests look for it (tests/conftest.py SHARED_TRACES); never committed.
MOONCAKE_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
#: Replayed layers: each stands for its share of the model's (docs/replay.md); 4 keeps a run to seconds.
LAYERS = 4
#: How far from the published ratio kvemu may be and still count as reproduced (issue 22, item 3).
TOLERANCE = 1.5

# The tiers. Beluga's pool: one host's share of a CXL switch pool, 1 TB/s aggregate over 16 hosts
# (64 GB/s) at the top of its 200-500 ns (shared/REFERENCE.md, "CXL switched pool"), reached by the
# GPU over PCIe Gen5 x16 (the default link). The RDMA store: Mooncake Store behind the 4 NICs Beluga's
# adapters replace, 87 GB/s as Mooncake's Transfer Engine drives 4 x 200 Gbps (Mooncake README),
# with rdma-storage's software path (metadata lookup, bounce copy: docs/tier-profiles.md).
POOL = "vemu:cxl-pool,latency_ns=500,bandwidth_gbps=64"
RDMA = "vemu:rdma-storage,bandwidth_gbps=87"
#: The same store in the software generations after mid-2025 (docs/tier-profiles.md): LMCache's zero-copy
#: batch_get_into (still staged through host memory), and GPUDirect RDMA. ``rdma`` is rdma-storage, the
#: name of mooncake-lmcache-copy: the host copy of get() results Beluga's baseline era had.
GENERATIONS = {"rdma-zerocopy": "vemu:mooncake-lmcache-zerocopy,bandwidth_gbps=87",
               "rdma-gdr": "vemu:mooncake-gdr,bandwidth_gbps=87"}
#: Light load: arrivals at this fraction of the pool's capacity, where no tier queues and the TTFT ratio is
#: the ratio of the two paths' service times, whatever load is chosen below it (beluga-docqa, host-copy
#: store: 5.96x at 0.5 %, 6.29x at 2 %, 7.46x at 5 %, where the store, at a fifth of the pool's capacity,
#: starts to queue).
LIGHT_LOAD = 0.005
#: The RDMA store's medium alone: rdma-storage's figures without its software parts (written by medium_profile).
RDMA_MEDIUM_NAME = "rdma-storage-medium"
#: Offered loads of the load curve, as fractions of the pool's capacity (its saturated request throughput).
LOAD_CURVE = (0.005, 0.05, 0.2, 0.5, 0.8)
#: The tiers a load curve draws (the pool is the denominator).
CURVE_TIERS = ("rdma", "rdma-zerocopy", "rdma-gdr")
#: P/D setups: every tier's replay runs on the pool backend (the prefill's own offload tier, the same in
#: every run) and differs only in how the prefill's KV reaches the decode instance (kvemu replay
#: --transfer): through the pool, read layer by layer (TraCT), or over the RDMA transfer engine of
#: each software generation (deployment.HANDOFF_PROFILE's parts: the same as a store on it pays).
PD_TRANSFERS = {"pool": "pool", "rdma": "rdma:mooncake-lmcache-copy", "rdma-zerocopy": "rdma:mooncake-lmcache-zerocopy",
                "rdma-gdr": "rdma:mooncake-gdr", "rdma-medium": "rdma:{medium}"}


@dataclasses.dataclass(frozen=True)
class Setup:
    """One rebuilt comparison: a recording, the replays' options, and the published ratios."""

    name: str
    paper: str
    record: tuple[str, ...]          # `kvemu record` arguments after --out
    replay: tuple[str, ...] = ()     # `kvemu replay` arguments every tier shares
    ttft_ratio: float | None = None  # published baseline / pool mean TTFT
    throughput_ratio: float | None = None  # published pool / baseline throughput
    at_load: float | None = None     # also TTFT with arrivals at this fraction of the pool's capacity
    arrivals: str = "saturated"      # what the main runs' arrivals are, for the table
    note: str = ""
    pool: str = POOL                 # the tier the store is set against
    pd: bool = False                 # a P/D deployment: the tiers are hand-off paths (PD_TRANSFERS)
    #: published light-load ratios of the later generations, tier -> (ratio, where it comes from)
    published_generations: tuple = ()
    #: the inverse solves: (tier, software part, field, what the part's published microbenchmarks say)
    solves: tuple = ()


SETUPS = (
    Setup(
        "beluga-docqa", "Beluga (arXiv 2511.20172)",
        ("--workload", "synthetic:docqa:documents=8,questions=128,doc_tokens=32768,rate=1000,"
                       "output_min_tokens=1,output_max_tokens=16",
         "--model", "llama3-8b", "--gpu", "H100-SXM", "--hbm-kv-gib", "16", "--tier-policy", "offload"),
        ttft_ratio=1 / (1 - 0.896), throughput_ratio=7.35, at_load=0.8,
        note="prefix-cache hits dominate (98.6 % of input tokens cached, half of them from the tier); "
             "1,024 requests at once: both runs saturated"),
    Setup(
        "beluga-mooncake", "Beluga (arXiv 2511.20172)",
        ("--workload", "mooncake:{mooncake_trace}", "--max-requests", "300", "--model", "llama3-70b",
         "--gpu", "H100-SXM", "--tp", "4", "--tier-policy", "offload"),
        ("--time-scale", "4.0"),
        ttft_ratio=1 / (1 - 0.896), throughput_ratio=7.35,
        arrivals="the trace's arrivals x 4.0",
        note="the first 300 Mooncake conversation requests, stretched 4.0x to the rate 4 x H100 serve; "
             "8 % of input tokens cached"),
    Setup(
        "tract-prefix", "TraCT (arXiv 2512.18194)",
        ("--workload", "synthetic:docqa:documents=16,questions=32,doc_tokens=16384,rate=1000,"
                       "output_min_tokens=16,output_max_tokens=128",
         "--model", "llama3-8b", "--gpu", "H100-SXM", "--hbm-kv-gib", "16", "--tier-policy", "offload"),
        ("--instances", "4", "--sharing", "shared", "--routing", "prefix-aware"),
        ttft_ratio=9.8, throughput_ratio=1.6, at_load=0.8,
        note="the rack-wide prefix cache only: 4 instances sharing one tier, prefix-aware routing; "
             "no prefill-to-decode transfer (that is tract-pd)"),
    Setup(
        "tract-pd", "TraCT (arXiv 2512.18194)",
        ("--workload", "synthetic:docqa:documents=64,questions=1,doc_tokens=16384,rate=1000,"
                       "output_min_tokens=16,output_max_tokens=128",
         "--model", "llama3-8b", "--gpu", "H100-SXM", "--hbm-kv-gib", "16", "--tier-policy", "offload"),
        ("--prefill-instances", "1", "--decode-instances", "1"),
        ttft_ratio=9.8, throughput_ratio=1.6, at_load=0.8, pd=True,
        note="the P/D transfer half: 1 prefill + 1 decode instance, unique 16k-token prompts; the pool "
             "hand-off (prefill writes layer by layer, decode reads layer by layer) against the RDMA "
             "transfer engine, one 200 Gb/s NIC per GPU, in each software generation"),
    Setup(
        "mooncake-467", "Mooncake issue #467 (2025-06-10) / LMCache PR #988 (2025-07-07)",
        ("--workload", "mooncake:{work}/mooncake-467.jsonl",
         "--model", "llama3-8b", "--gpu", "H100-SXM", "--hbm-kv-gib", "2", "--tier-policy", "offload"),
        ("--warmup", "0.5"), ttft_ratio=29.00 / 1.77, pool="vemu:local-dram",
        arrivals="the 32 retrieves at 10 a second (#467: at once)",
        published_generations=(("rdma-zerocopy", 5.37 / 4.79,
                                "LMCache PR #988: mooncake-store 5.37 s against an ideal 4.79 s, qwen-7b"),),
        note="32 prompts of 10k tokens issued at once, then the same 32 again a minute later (the retrieve run, "
             "the only one counted: --warmup 0.5), 1 output token; the store against LMCache's local "
             "CPU DRAM backend (#467's 'local dram': 1.77 s against 29.00 s for the retrieve run); llama3-8b "
             "stands for DeepSeek-R1-Distill-Qwen-7B, which kvemu does not list"),
)

#: The parts each setup's inverse solve varies, and what their published microbenchmarks say.
_COPY_EVIDENCE = ("a server core's single-thread memcpy 5.9-9.3 GB/s (J. McCalpin, Intel forum, 2014); #467's "
                  "own retrieve, 18.4 GB in 29.00 s, is 0.63 GB/s end to end for the whole LMCache + Mooncake path")
_RPC_EVIDENCE = ("Mooncake master: 'unordered_map inserts and lookups' (issue #990), ~1 us per object, an "
                 "estimate; batch_get_into end to end, 4 KiB objects in batches of 32 over TCP on one host, "
                 "46,551 objects/s = 21.5 us of the host per object (Mooncake PR #2871, 2026-07-13); LMCache "
                 "PR #988: the remaining gap is 'for-loop contains checks' and batched_to_gpu")
SOLVES = {"beluga-docqa": (("rdma", "host_copy", "ns_per_byte", _COPY_EVIDENCE),),
          "beluga-mooncake": (("rdma", "host_copy", "ns_per_byte", _COPY_EVIDENCE),),
          "tract-prefix": (("rdma", "host_copy", "ns_per_byte", _COPY_EVIDENCE),),
          "tract-pd": (("rdma", "host_copy", "ns_per_byte", _COPY_EVIDENCE),),
          "mooncake-467": (("rdma", "host_copy", "ns_per_byte", _COPY_EVIDENCE),
                           ("rdma-zerocopy", "object_rpc", "ns_per_io", _RPC_EVIDENCE))}



# ------------------------------------------------------------------------------------- commands


def kvemu_command(*args) -> list[str]:
    return [sys.executable, "-m", "kvemu", *map(str, args)]


def write_467_workload(work: Path) -> Path:
    """Mooncake issue #467's benchmark as a Mooncake-format trace: 32 prompts of 10k tokens, no prefix
    shared among them, 10 a second (#467 issued them at once; a rescaled burst stays a burst, so spaced
    arrivals give the light-load row its meaning, and at 10 a second they still queue as a burst does),
    then the same 32 a minute later (the retrieve run); one output token each. Hash ids stand for
    512-token blocks (the trace format's)."""
    path = work / "mooncake-467.jsonl"
    lines = []
    for t in (0, 60_000):
        for k in range(32):
            ids = list(range(k * 20, k * 20 + 20))  # ceil(10000 / 512) blocks, none shared
            lines.append(json.dumps({"timestamp": t + 100 * k, "input_length": 10000, "output_length": 1, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def record_command(setup: Setup, work: Path, mooncake_trace: Path = MOONCAKE_TRACE) -> list[str]:
    if any("{work}/mooncake-467.jsonl" in a for a in setup.record):
        write_467_workload(work)
    args = [a.replace("{mooncake_trace}", str(mooncake_trace)).replace("{work}", str(work)) for a in setup.record]
    return kvemu_command("record", *args, "--out", work / f"{setup.name}.parquet", "--force")


def replay_command(setup: Setup, work: Path, tier: str, spec, extra: tuple = ()) -> list[str]:
    """One tier's replay; ``spec``: the backend, or (backend, its own arguments) as tiers() gives it."""
    spec, own = (spec, ()) if isinstance(spec, str) else spec
    shared = list(setup.replay)
    if "--request-rate" in extra and "--time-scale" in shared:  # a rate replaces the setup's stretch
        k = shared.index("--time-scale")
        del shared[k:k + 2]
    return kvemu_command("replay", work / f"{setup.name}.parquet", "--backend", spec, "--layers", LAYERS,
                         *shared, *own, *extra, "--out", work / f"{setup.name}-{tier}.parquet", "--force")


def medium_profile(work: Path) -> Path:
    """A TOML profile of rdma-storage's medium: its figures, no software path."""
    from kvemu.profiles import BUILTIN_PROFILES

    path = work / f"{RDMA_MEDIUM_NAME}.toml"
    path.write_text(dataclasses.replace(BUILTIN_PROFILES["rdma-storage"], name=RDMA_MEDIUM_NAME,
                                        software=()).to_toml())
    return path


def tiers(work: Path, setup: Setup | None = None) -> dict[str, tuple[str, tuple]]:
    """Each tier's backend and its own replay arguments: the pool, the RDMA store in its generations and
    its medium alone; for a P/D setup the pool backend in every run and the hand-off path per tier."""
    medium = work / (RDMA_MEDIUM_NAME + ".toml")
    pool = POOL if setup is None else setup.pool
    if setup is not None and setup.pd:
        return {t: (pool, ("--transfer", x.replace("{medium}", str(medium)))) for t, x in PD_TRANSFERS.items()}
    return {"pool": (pool, ()), "rdma": (RDMA, ()), **{g: (v, ()) for g, v in GENERATIONS.items()},
            "rdma-medium": (f"vemu:{medium},bandwidth_gbps=87", ())}


def varied_profile(work: Path, base: str, part: str, field: str, value: float) -> Path:
    """A TOML profile: the built-in ``base`` with its software part ``part``'s ``field`` set to ``value``
    (the inverse solve's trial)."""
    from kvemu.profiles import resolve_profile

    prof = resolve_profile(base)
    if not any(p.name == part for p in prof.software):
        raise SystemExit(f"{base} has no software part {part}")
    parts = tuple(dataclasses.replace(p, **{field: value}) if p.name == part else p for p in prof.software)
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in f"{prof.name}-{part}-{value:.6g}")
    path = work / f"{name}.toml"
    path.write_text(dataclasses.replace(prof, name=name, software=parts).to_toml())
    return path


def with_profile(tier_spec: tuple[str, tuple], profile: Path, pd: bool) -> tuple[str, tuple]:
    """A tier's backend and arguments with its RDMA profile swapped for ``profile``: the hand-off's
    engine in a P/D setup, the backend's profile otherwise."""
    spec, own = tier_spec
    if pd:
        return spec, ("--transfer", f"rdma:{profile}")
    return f"vemu:{profile},bandwidth_gbps=87" if "bandwidth_gbps=87" in spec else f"vemu:{profile}", own


def solve_part(ratio_at: Callable[[float], float], target: float, x0: float, x1: float, *, lo: float = 0.0,
               hi: float = 100.0, rel: float = 0.01, max_iter: int = 24) -> dict:
    """The value x of one software part at which ``ratio_at(x)`` (kvemu's light-load ratio with the part
    set to x, growing with x) equals ``target`` (the published ratio), within ``rel``, kept inside [lo, hi]
    (the part's bounds, profiles.PART_BOUNDS). Secant steps from x0 and x1: at light load no tier queues,
    so a store's mean TTFT is affine in a per-byte cost and one step lands on the answer. A part that is
    hidden under the medium until it outgrows it (a per-object cost under concurrent I/O) bends the
    curve: once the target is bracketed, a secant step that does not halve the bracket is followed by
    a bisection (geometric for positive ends). Returns {"value", "ratio", "trials": [(x, ratio)...],
    "solved"}; solved is False (value None) when the target lies outside what [lo, hi] can give."""
    trials = []

    def trial(x):
        y = ratio_at(x)
        trials.append((x, y))
        return y

    def done(x, y):
        return {"value": x, "ratio": y, "trials": trials, "solved": True}

    def beyond():
        return {"value": None, "ratio": None, "trials": trials, "solved": False}

    ya, yb = trial(x0), trial(x1)
    xa, xb = x0, x1
    for x, y in ((xa, ya), (xb, yb)):
        if abs(y - target) <= rel * target:
            return done(x, y)
    below = above = None  # the bracket: (x, ratio) under and over the target
    for x, y in ((xa, ya), (xb, yb)):
        if y < target and (below is None or x > below[0]):
            below = (x, y)
        if y > target and (above is None or x < above[0]):
            above = (x, y)
    bisect = False
    while len(trials) < max_iter:
        if below is not None and above is not None:
            (x_lo, y_lo), (x_hi, y_hi) = below, above
            if bisect or y_hi == y_lo:
                x = math.sqrt(x_lo * x_hi) if x_lo > 0 else (x_lo + x_hi) / 2
            else:
                x = x_lo + (target - y_lo) * (x_hi - x_lo) / (y_hi - y_lo)
            width = x_hi - x_lo
        else:
            if yb == ya:
                x = xb * 2 if xb > 0 else 1.0
            else:
                x = xb + (target - yb) * (xb - xa) / (yb - ya)
            if not lo <= x <= hi:
                x = lo if x < lo else hi
                if x in (t[0] for t in trials):
                    return beyond()
            width = None
        y = trial(x)
        if abs(y - target) <= rel * target:
            return done(x, y)
        if y < target:
            if below is None or x > below[0]:
                below = (x, y)
        elif above is None or x < above[0]:
            above = (x, y)
        if below is None and x == hi or above is None and x == lo:
            return beyond()
        if width is not None:
            bisect = not bisect and (above[0] - below[0]) > width / 2
        xa, ya, xb, yb = xb, yb, x, y
    return beyond()



# ------------------------------------------------------------------------------------- figures


def run_figures(results: Path) -> dict:
    """What the table needs from one results file: mean TTFT, throughput, the KV time and its software
    share (the results' backend.software_path, modelled)."""
    import pyarrow.parquet as pq

    from kvemu import metrics

    table = pq.read_table(results)
    meta = json.loads(table.schema.metadata[b"kvemu"])
    rows = table.to_pydict()
    s = metrics.summarize(rows, meta["duration_s"])
    kv_ms = sum(sum(rows[c]) for c in ("kv_load_ms", "kv_store_ms", "kv_read_ms") if c in rows)
    sw = (meta.get("backend") or {}).get("software_path")
    busy = sw_ns = 0.0
    if sw:
        for op in sw["ops"].values():
            sw_ns += op["software_ns"]
            busy += op["software_ns"] + op["medium_ns"]
    return {"mean_ttft_ms": s["mean_ttft_ms"], "output_throughput": s["output_throughput"],
            "request_throughput": s["request_throughput"], "duration_s": float(meta["duration_s"]),
            "kv_ms": kv_ms, "software_share": sw_ns / busy if busy else (None if sw is None else 0.0),
            "virtual": bool(meta["backend"].get("virtual"))}


def comparison(setup: Setup, pool: dict, rdma: dict, medium: dict, at_load: dict | None = None,
               light: dict | None = None, generations: dict | None = None) -> dict:
    """kvemu's ratios for one setup beside the published ones.

    ttft: baseline / pool mean TTFT; throughput: pool / baseline output tokens per second; each
    once with the RDMA store's software path (the comparison) and once with its medium alone, so
    that the share of the pool's advantage that is software shows; within: kvemu's ratio within
    TOLERANCE x of the published one (None where the paper gives none). ``at_load``: the three runs'
    figures with arrivals at ``setup.at_load`` of the pool's capacity (the ``ttft_at_load`` row);
    ``light``: the same at LIGHT_LOAD (the ``ttft_light`` row); ``generations``: the other software
    generations' figures (tier name -> {"main", "at_load", "light"}), whose ratios go beside the store's
    under ``generations``."""
    def ratio(num, den):
        return num / den if den else math.inf

    out = {"setup": setup.name, "paper": setup.paper, "note": setup.note, "arrivals": setup.arrivals,
           "software_share": rdma["software_share"], "virtual": pool["virtual"] and rdma["virtual"]}
    metrics = [("ttft", setup.ttft_ratio, ratio(rdma["mean_ttft_ms"], pool["mean_ttft_ms"]),
                ratio(medium["mean_ttft_ms"], pool["mean_ttft_ms"])),
               ("throughput", setup.throughput_ratio, ratio(pool["output_throughput"], rdma["output_throughput"]),
                ratio(pool["output_throughput"], medium["output_throughput"]))]
    if at_load is not None:
        p, r, m = at_load["pool"], at_load["rdma"], at_load["rdma-medium"]
        metrics.insert(1, ("ttft_at_load", setup.ttft_ratio, ratio(r["mean_ttft_ms"], p["mean_ttft_ms"]),
                           ratio(m["mean_ttft_ms"], p["mean_ttft_ms"])))
        out["at_load"] = {"fraction": setup.at_load, "request_rate": at_load["request_rate"]}
    if light is not None:
        p, r, m = light["pool"], light["rdma"], light["rdma-medium"]
        metrics.insert(0, ("ttft_light", setup.ttft_ratio, ratio(r["mean_ttft_ms"], p["mean_ttft_ms"]),
                           ratio(m["mean_ttft_ms"], p["mean_ttft_ms"])))
        out["light"] = {"fraction": LIGHT_LOAD, "request_rate": light["request_rate"]}
    for key, published, kv, kv_medium in metrics:
        out[key] = {"published": published, "kvemu": kv, "kvemu_medium_only": kv_medium,
                    "within": None if published is None else 1 / TOLERANCE <= kv / published <= TOLERANCE}
    out["generations"] = {}
    for gen, figs in (generations or {}).items():
        sub = comparison(setup, pool, figs["main"], medium,
                         None if at_load is None else {**at_load, "rdma": figs["at_load"]},
                         None if light is None else {**light, "rdma": figs["light"]})
        out["generations"][gen] = {"software_share": figs["main"]["software_share"],
                                   **{key: sub[key]["kvemu"] for key, *_ in metrics}}
    return out


def _x(v) -> str:
    return "—" if v is None else f"{v:.2f}x"


def _share(v) -> str:
    return "—" if v is None else f"{100 * v:.0f} %"


def _load(r, which: str = "at_load") -> str:
    a = r.get(which) or {}
    return f"{100 * a.get('fraction', 0):g} % ({a.get('request_rate', 0):.3g} req/s)"


def markdown_table(rows: list[dict]) -> str:
    """The side-by-side table of docs/analysis.md: the store as Beluga's baseline era had it (host copy,
    mid-2025), then zero-copy and GPUDirect RDMA, then its medium alone."""
    lines = ["| setup | paper | metric | published | kvemu, host copy (mid-2025) | within 1.5x | kvemu, zero-copy | "
             "kvemu, GPUDirect RDMA | kvemu, RDMA medium alone | software share of RDMA KV time (copy / zero-copy "
             "/ GDR) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gens = r.get("generations") or {}
        share = " / ".join(_share(v) for v in [r["software_share"],
                                               *(gens.get(g, {}).get("software_share") for g in GENERATIONS)])
        for key, label in (("ttft_light", f"mean TTFT, RDMA / pool, light load ({_load(r, 'light')} of the "
                                          f"pool's capacity)"),
                           ("ttft", f"mean TTFT, RDMA / pool, {r['arrivals']}"),
                           ("ttft_at_load", f"mean TTFT, RDMA / pool, at {_load(r)} of the pool's capacity"),
                           ("throughput", "throughput, pool / RDMA")):
            if key not in r:
                continue
            m = r[key]
            within = "—" if m["within"] is None else ("yes" if m["within"] else "no")
            g = [_x(gens.get(name, {}).get(key)) for name in GENERATIONS]
            lines.append(f"| {r['setup']} | {r['paper']} | {label} | {_x(m['published'])} | {_x(m['kvemu'])} | "
                         f"{within} | {' | '.join(g)} | {_x(m['kvemu_medium_only'])} | {share} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- main


def run(cmd: list[str], quiet: bool) -> None:
    printable = " ".join(["kvemu", *map(str, cmd[3:])])
    print(f"$ {printable}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {printable}\n{r.stderr.strip()}")
    if not quiet and r.stderr.strip():
        print(r.stderr.strip().splitlines()[-1], file=sys.stderr)


def reproduce(setup: Setup, work: Path, quiet: bool = True, mooncake_trace: Path = MOONCAKE_TRACE,
              curve: bool = False, solve: bool = False) -> dict:
    run(record_command(setup, work, mooncake_trace), quiet)
    medium_profile(work)
    specs = tiers(work, setup)
    figures = {}
    for tier, spec in specs.items():
        run(replay_command(setup, work, tier, spec), quiet)
        figures[tier] = run_figures(work / f"{setup.name}-{tier}.parquet")
    capacity = figures["pool"]["request_throughput"]

    def at(fraction, suffix, which=specs):
        rate = round(fraction * capacity, 4)
        got = {"request_rate": rate}
        for tier, spec in which.items():
            run(replay_command(setup, work, f"{tier}-{suffix}", spec, ("--request-rate", rate)), quiet)
            got[tier] = run_figures(work / f"{setup.name}-{tier}-{suffix}.parquet")
        return got

    at_load = at(setup.at_load, "load") if setup.at_load is not None else None
    light = at(LIGHT_LOAD, "light")
    gens = {g: {"main": figures[g], "at_load": None if at_load is None else at_load[g], "light": light[g]}
            for g in GENERATIONS}
    row = comparison(setup, figures["pool"], figures["rdma"], figures["rdma-medium"], at_load, light, gens)
    row["published_generations"] = {g: {"published": r, "source": src,
                                        "kvemu": row["generations"].get(g, {}).get("ttft_light")}
                                    for g, r, src in setup.published_generations}
    if curve:
        which = {t: specs[t] for t in ("pool", *CURVE_TIERS)}
        points = []
        for f in LOAD_CURVE:
            got = light if f == LIGHT_LOAD else at_load if f == setup.at_load else at(f, f"curve{f:g}", which)
            points.append({"fraction": f, "request_rate": got["request_rate"],
                           **{t: got[t]["mean_ttft_ms"] / got["pool"]["mean_ttft_ms"] for t in CURVE_TIERS}})
        row["curve"] = points
    if solve:
        row["solves"] = []
        pool_ms = light["pool"]["mean_ttft_ms"]
        targets = {"rdma": setup.ttft_ratio, **{g: r for g, r, _ in setup.published_generations}}
        for tier, part, field, evidence in SOLVES.get(setup.name, ()):
            base = {"rdma": "mooncake-lmcache-copy", "rdma-zerocopy": "mooncake-lmcache-zerocopy"}[tier]
            from kvemu.profiles import resolve_profile
            sourced = next(getattr(p, field) for p in resolve_profile(base).software if p.name == part)

            def ratio_at(x, tier=tier, base=base, part=part, field=field):
                if x == sourced:
                    return light[tier]["mean_ttft_ms"] / pool_ms
                prof = varied_profile(work, base, part, field, x)
                one = {tier: with_profile(specs[tier], prof, setup.pd)}
                got = at(LIGHT_LOAD, f"solve-{prof.stem}", one)
                return got[tier]["mean_ttft_ms"] / pool_ms

            from kvemu.profiles import PART_BOUNDS
            res = solve_part(ratio_at, targets[tier], sourced, 2 * sourced if sourced else 1.0,
                             lo=PART_BOUNDS[field][0], hi=PART_BOUNDS[field][1])
            row["solves"].append({"tier": tier, "part": part, "field": field, "sourced": sourced,
                                  "target": targets[tier], "evidence": evidence, **res})
    return row


def plot_curves(rows: list[dict], path: Path) -> None:
    """The ratio against offered load, one panel per setup: each store generation's mean TTFT over the
    pool's, the published light-load ratio as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("curve")]
    cols = min(3, len(rows))
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.4 * cols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(rows):]:
        ax.set_visible(False)
    labels = {"rdma": "host copy (mid-2025)", "rdma-zerocopy": "zero-copy", "rdma-gdr": "GPUDirect RDMA"}
    for ax, r in zip(axes.flat, rows):
        xs = [100 * p["fraction"] for p in r["curve"]]
        for t in CURVE_TIERS:
            ax.plot(xs, [p[t] for p in r["curve"]], marker="o", label=labels[t])
        if r["ttft"]["published"]:
            ax.axhline(r["ttft"]["published"], color="k", ls="--", lw=1, label="published")
        ax.set_xscale("log"); ax.set_yscale("log")
        ax.set_xlabel("offered load, % of the pool's capacity")
        ax.set_ylabel("mean TTFT, store / pool (virtual time)")
        ax.set_title(r["setup"], fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("kvemu: the pool's TTFT advantage against offered load (vemu, modelled)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def solves_table(rows: list[dict]) -> str:
    """The inverse solves: each part's sourced value, the value that reproduces the published ratio, and
    what its published microbenchmarks say."""
    def show(field, v):
        if v is None:
            return "none in bounds"
        if field == "ns_per_byte":
            return "no copy" if v == 0 else f"{1 / v:.3g} GB/s ({v:.3g} ns/B)"
        return f"{v / 1000:.3g} us"

    lines = ["| setup | store | part | sourced value | light-load ratio, sourced | published | value reproducing "
             "it | trials | published microbenchmarks |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for sv in r.get("solves") or ():
            first = sv["trials"][0][1]
            lines.append(f"| {r['setup']} | {sv['tier']} | {sv['part']} | {show(sv['field'], sv['sourced'])} | "
                         f"{first:.2f}x | {sv['target']:.2f}x | {show(sv['field'], sv['value'])} | "
                         f"{len(sv['trials'])} | {sv['evidence']} |")
    return "\n".join(lines)


def curves_table(rows: list[dict]) -> str:
    """The load curves as text (host copy / zero-copy / GPUDirect RDMA ratios at each load), and the
    published ratios of later generations beside kvemu's light-load ones."""
    lines = []
    for r in rows:
        for g, v in (r.get("published_generations") or {}).items():
            lines.append(f"{r['setup']}, {g}: published {v['published']:.2f}x ({v['source']}), kvemu at light load "
                         f"{_x(v['kvemu'])}")
    for r in rows:
        if not r.get("curve"):
            continue
        lines.append(f"{r['setup']}: " + ", ".join(
            f"{100 * p['fraction']:g} % {p['rdma']:.2f}x/{p['rdma-zerocopy']:.2f}x/{p['rdma-gdr']:.2f}x"
            for p in r["curve"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvemu-papers"), help="folder for traces and results")
    ap.add_argument("--only", action="append", choices=[s.name for s in SETUPS], help="run only this setup")
    ap.add_argument("--commands", action="store_true", help="print the kvemu commands and stop")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--mooncake-trace", type=Path, default=MOONCAKE_TRACE,
                    help="the public Mooncake conversation trace (JSONL) beluga-mooncake records")
    ap.add_argument("--curve", type=Path, metavar="PNG", help="also replay the load curve and draw it here")
    ap.add_argument("--solve", action="store_true", help="also solve each setup's software part for the published ratio")
    ap.add_argument("--save", type=Path, metavar="JSON", help="also write the rows here")
    ap.add_argument("--rows", type=Path, nargs="+", metavar="JSON",
                    help="run nothing: print the tables (and draw --curve) from rows saved by --save")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.rows:
        rows = [r for f in args.rows for r in json.loads(f.read_text())]
        order = [s.name for s in SETUPS]
        rows.sort(key=lambda r: order.index(r["setup"]))
        args.only = ["-"]  # nothing to run
    for setup in SETUPS:
        if args.only and setup.name not in args.only:
            continue
        if args.commands:
            print(f"# {setup.name}: {setup.paper}; {setup.note}")
            print(f"# ({medium_profile(args.work)}: rdma-storage's figures without its software parts)")
            specs = tiers(args.work, setup)
            cmds = [record_command(setup, args.work, args.mooncake_trace)] + [
                replay_command(setup, args.work, t, s) for t, s in specs.items()]
            print("\n".join(" ".join(["kvemu", *map(str, c[3:])]) for c in cmds))
            if setup.at_load is not None:
                print(f"# then, with RATE = {setup.at_load} x the pool run's request_throughput:")
                cmds = [replay_command(setup, args.work, f"{t}-load", s, ("--request-rate", "RATE"))
                        for t, s in specs.items()]
                print("\n".join(" ".join(["kvemu", *map(str, c[3:])]) for c in cmds))
            continue
        if "{mooncake_trace}" in " ".join(setup.record) and not args.mooncake_trace.exists():
            print(f"skipped {setup.name}: {args.mooncake_trace} not present (give --mooncake-trace)", file=sys.stderr)
            continue
        rows.append(reproduce(setup, args.work, mooncake_trace=args.mooncake_trace, curve=args.curve is not None,
                              solve=args.solve))
        if args.save:
            args.save.write_text(json.dumps(rows, indent=1))
    if rows:
        if args.curve is not None:
            plot_curves(rows, args.curve)
        print(json.dumps(rows, indent=1) if args.json else "\n\n".join(
            t for t in (markdown_table(rows), solves_table(rows), curves_table(rows)) if t.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
