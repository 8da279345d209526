"""`kvemu demo`: the main job end to end on a small built-in workload, in about a minute.

It records one long-context multi-turn chat workload (eight interleaved sessions of five turns,
prompts growing to ~10k tokens, below saturation on one H100) under three tier policies — HBM
only; write-through offload with an HBM that holds about two sessions, so that a returning
session's history comes back from the tier; and KV resident in the tier — and replays them in closed loop on every tier this machine offers: host
DRAM, NUMA node 0, a file on the demo folder's disk through io_uring with O_DIRECT, and emulated
CXL-pool and NVMe tiers. The resident trace, whose decode reads every context block every step, is
replayed on DRAM with one layer in 32 and on the CXL pool in virtual time, so the demo stays short.
A trace recorded from a real (small, numpy) transformer run is replayed too. Tiers that are
unavailable here are skipped with a note. The offload replays run three times each (the report
shows their spread). The report, verdict first, compares them side by side.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from .errors import BackendUnavailable, OutputError
from .realrun import record_tiny
from .record_options import EngineOptions, RecordOptions, RecordOutputOptions
from .recording import record
from .replay import DataPathOptions, OutputOptions, ReplayOptions, WindowOptions, replay
from .report import build_report, render_html

# Multi-turn conversations with long contexts (a 2k-token system prompt, 1.5k-token messages, five
# turns: prompts grow to ~10k tokens): eight sessions interleave, an HBM of 2 GiB holds about two of
# them, so a returning session's history comes back from the tier (a quarter of all prompt tokens,
# 8.9 GiB of loads), at GPU busy ~30 % (below saturation).
WORKLOAD = "synthetic:chat:sessions=8,turns=5,system_tokens=2048,user_tokens=1500,output_tokens=100,rate=0.5,think_s=12"
MODEL = "llama3-8b"
HBM_KV_GIB = 2.0
REPLAY_LAYERS = 2  # of 32; each replayed layer stands for 16 (results say so)
RESIDENT_LAYERS = 1  # the resident trace reads every context block every step
REPEAT = 3  # the offload replays, the tier comparison, run three times: the report shows their spread


def demo_runs(folder: Path) -> list[tuple[str, str, bool]]:
    """(tier policy of the trace, backend spec, overlap) for every replay of the demo."""
    tiers = ["dram", "numa:0", f"uring:{folder / 'tier.bin'},qd=32", "emu:cxl-pool", "emu:nvme"]
    runs = [("none", "dram", False)]
    runs += [("offload", spec, False) for spec in tiers]
    runs += [("offload", "dram", True)]
    runs += [("resident", "dram", False), ("resident", "vemu:cxl-pool", False)]
    runs += [("realrun", "dram", False), ("realrun", "emu:cxl-pool", False)]
    return runs


def _name(spec: str) -> str:
    """The backend as the report names it: ``dram``, ``uring`` (no path), ``emu:cxl-pool``."""
    from .backend_spec import BackendSpec

    return BackendSpec.parse(spec).short()


def run_demo(out_dir=None, log=print):
    folder = Path(out_dir) if out_dir else Path(f"kvemu-demo-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{folder}: cannot create the demo folder ({e.strerror})") from None
    if any(folder.glob("*.parquet")) or (folder / "report.html").exists():
        raise OutputError(f"{folder}: already holds a demo's files (parquet or report.html); give an "
                          f"empty or new --out folder")
    log(f"kvemu demo: files go to {folder}/")
    results, traces = [], {}
    for policy, spec, overlap in demo_runs(folder):
        if policy not in traces:
            traces[policy] = folder / f"trace-{policy}.parquet"
            if policy == "realrun":
                log(f"record a real run of a small numpy transformer (paged KV, shared prefix) -> "
                    f"{traces[policy].name}")
                record_tiny(traces[policy])
            else:
                log(f"record {WORKLOAD} on {MODEL}, tier policy {policy} -> {traces[policy].name}")
                record(WORKLOAD, MODEL, traces[policy],
                       RecordOptions(engine=EngineOptions(tier_policy=policy, hbm_kv_gib=HBM_KV_GIB),
                                     output=RecordOutputOptions(show_progress=False)))
        label = f"{_name(spec)}/{policy}{'+overlap' if overlap else ''}"
        res = folder / f"results-{label.replace('/', '-').replace('+', '-').replace(':', '-')}.parquet"
        log(f"replay {traces[policy].name} on {spec}{' with overlap' if overlap else ''} -> {res.name}")
        try:
            opts = ReplayOptions(
                window=WindowOptions(layers=RESIDENT_LAYERS if policy == "resident" else REPLAY_LAYERS),
                datapath=DataPathOptions(overlap=overlap),
                output=OutputOptions(label=label, repeat=REPEAT if policy == "offload" else 1))
            replay(traces[policy], spec, opts, out=res, warn=log)
        except BackendUnavailable as e:
            log(f"  skipped: {e}")
            continue
        results.append(res)
    rep = build_report([str(p) for p in results])
    html = render_html(rep, folder / "report.html")
    return rep, folder, html
