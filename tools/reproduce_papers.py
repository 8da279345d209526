#!/usr/bin/env python3
"""Rebuild the published pool-versus-RDMA comparisons with kvemu, in virtual time, and print kvemu's
ratios beside the papers' (docs/analysis.md, "Reproducing the published comparisons").

    PYTHONPATH=. python tools/reproduce_papers.py                # every setup, a few minutes here
    PYTHONPATH=. python tools/reproduce_papers.py --only beluga-docqa --work /tmp/papers
    PYTHONPATH=. python tools/reproduce_papers.py --commands     # print the kvemu commands only

Each setup is one `kvemu record` and one `kvemu replay` per tier, run as printed (`python -m kvemu
...`), and where it says so the replays again with arrivals at a fraction of the pool's capacity.
The tiers: the CXL pool, the RDMA store with its software path (kvemu's `rdma-storage` profile),
and the same store's medium alone (its profile written without the software parts), which splits
the RDMA store's handicap into medium and software. Every replay is `vemu:` (virtual time: the
model's times, exact and host-independent). Setups whose input is absent (the Mooncake trace in
shared/traces) are skipped with a line. Not imported by kvemu; tests/test_reproduce_papers.py checks
the table builder on a tiny trace.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

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


@dataclasses.dataclass(frozen=True)
class Setup:
    """One rebuilt comparison: a recording, the replays' options, and the published ratios."""

    name: str
    paper: str
    record: tuple[str, ...]          # `kvemu record` arguments after --out
    replay: tuple[str, ...] = ()     # `kvemu replay` arguments every tier shares
    ttft_ratio: float | None = None  # published baseline / pool mean TTFT
    throughput_ratio: float | None = None  # published pool / baseline throughput
    needs: Path | None = None        # an input file that may be absent
    at_load: float | None = None     # also TTFT with arrivals at this fraction of the pool's capacity
    arrivals: str = "saturated"      # what the main runs' arrivals are, for the table
    note: str = ""


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
        ("--workload", f"mooncake:{MOONCAKE_TRACE}", "--max-requests", "300", "--model", "llama3-70b",
         "--gpu", "H100-SXM", "--tp", "4", "--tier-policy", "offload"),
        ("--time-scale", "4.0"),
        ttft_ratio=1 / (1 - 0.896), throughput_ratio=7.35, needs=MOONCAKE_TRACE,
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
             "no prefill-to-decode transfer (kvemu has no P/D disaggregation)"),
)


# ------------------------------------------------------------------------------------- commands


def kvemu_command(*args) -> list[str]:
    return [sys.executable, "-m", "kvemu", *map(str, args)]


def record_command(setup: Setup, work: Path) -> list[str]:
    return kvemu_command("record", *setup.record, "--out", work / f"{setup.name}.parquet", "--force")


def replay_command(setup: Setup, work: Path, tier: str, spec: str, extra: tuple = ()) -> list[str]:
    return kvemu_command("replay", work / f"{setup.name}.parquet", "--backend", spec, "--layers", LAYERS,
                         *setup.replay, *extra, "--out", work / f"{setup.name}-{tier}.parquet", "--force")


def medium_profile(work: Path) -> Path:
    """A TOML profile of rdma-storage's medium: its figures, no software path."""
    from kvemu.profiles import BUILTIN_PROFILES

    path = work / f"{RDMA_MEDIUM_NAME}.toml"
    path.write_text(dataclasses.replace(BUILTIN_PROFILES["rdma-storage"], name=RDMA_MEDIUM_NAME,
                                        software=()).to_toml())
    return path


def tiers(work: Path) -> dict[str, str]:
    return {"pool": POOL, "rdma": RDMA, **GENERATIONS,
            "rdma-medium": f"vemu:{work / (RDMA_MEDIUM_NAME + '.toml')},bandwidth_gbps=87"}


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


def reproduce(setup: Setup, work: Path, quiet: bool = True) -> dict:
    run(record_command(setup, work), quiet)
    medium_profile(work)
    figures = {}
    for tier, spec in tiers(work).items():
        run(replay_command(setup, work, tier, spec), quiet)
        figures[tier] = run_figures(work / f"{setup.name}-{tier}.parquet")
    def at(fraction, suffix):
        rate = round(fraction * figures["pool"]["request_throughput"], 3)
        got = {"request_rate": rate}
        for tier, spec in tiers(work).items():
            run(replay_command(setup, work, f"{tier}-{suffix}", spec, ("--request-rate", rate)), quiet)
            got[tier] = run_figures(work / f"{setup.name}-{tier}-{suffix}.parquet")
        return got

    at_load = at(setup.at_load, "load") if setup.at_load is not None else None
    light = at(LIGHT_LOAD, "light")
    gens = {g: {"main": figures[g], "at_load": None if at_load is None else at_load[g], "light": light[g]}
            for g in GENERATIONS}
    return comparison(setup, figures["pool"], figures["rdma"], figures["rdma-medium"], at_load, light, gens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvemu-papers"), help="folder for traces and results")
    ap.add_argument("--only", action="append", choices=[s.name for s in SETUPS], help="run only this setup")
    ap.add_argument("--commands", action="store_true", help="print the kvemu commands and stop")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for setup in SETUPS:
        if args.only and setup.name not in args.only:
            continue
        if args.commands:
            print(f"# {setup.name}: {setup.paper}; {setup.note}")
            print(f"# ({medium_profile(args.work)}: rdma-storage's figures without its software parts)")
            cmds = [record_command(setup, args.work)] + [replay_command(setup, args.work, t, s)
                                                         for t, s in tiers(args.work).items()]
            print("\n".join(" ".join(["kvemu", *map(str, c[3:])]) for c in cmds))
            if setup.at_load is not None:
                print(f"# then, with RATE = {setup.at_load} x the pool run's request_throughput:")
                cmds = [replay_command(setup, args.work, f"{t}-load", s, ("--request-rate", "RATE"))
                        for t, s in tiers(args.work).items()]
                print("\n".join(" ".join(["kvemu", *map(str, c[3:])]) for c in cmds))
            continue
        if setup.needs is not None and not setup.needs.exists():
            print(f"skipped {setup.name}: {setup.needs} not present", file=sys.stderr)
            continue
        rows.append(reproduce(setup, args.work))
    if rows:
        print(json.dumps(rows, indent=1) if args.json else markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
