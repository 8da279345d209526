"""`kvemu demo`: the main job end to end on a small built-in workload, in about a minute.

It records one multi-turn chat workload under three tier policies (HBM only, write-through
offload with a small HBM so that prefix hits must come back from the tier, and KV resident in the
tier), replays each trace on every backend available on this machine, and reports them side by
side. HBM is deliberately small (0.6 GiB of KV) so that the tier matters.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from .errors import OutputError
from .recording import record_workload
from .replay import replay_trace
from .report import build_report

WORKLOAD = "synthetic:chat:sessions=8,turns=4"
MODEL = "llama3-8b"
HBM_KV_GIB = 0.6
REPLAY_LAYERS = 2  # of 32; each replayed layer stands for 16 (results say so)


def available_backends() -> list[str]:
    from .backends import KNOWN_BACKENDS

    return [b for b in KNOWN_BACKENDS if b == "dram"]


def run_demo(out_dir=None, log=print):
    folder = Path(out_dir) if out_dir else Path(f"kvemu-demo-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{folder}: cannot create the demo folder ({e.strerror})") from None
    if any(folder.glob("*.parquet")):
        raise OutputError(f"{folder}: already holds parquet files; give an empty or new --out folder")
    log(f"kvemu demo: files go to {folder}/")
    results = []
    for policy in ("none", "offload", "resident"):
        trace = folder / f"trace-{policy}.parquet"
        log(f"record {WORKLOAD} on {MODEL}, tier policy {policy} -> {trace.name}")
        record_workload(WORKLOAD, MODEL, trace, tier_policy=policy, hbm_kv_gib=HBM_KV_GIB, show_progress=False)
        for backend in available_backends():
            for overlap in ((False, True) if policy != "none" else (False,)):
                name = f"{backend}-{policy}{'-overlap' if overlap else ''}"
                res = folder / f"results-{name}.parquet"
                log(f"replay {trace.name} on {backend}{' with overlap' if overlap else ''} -> {res.name}")
                replay_trace(trace, backend, res, overlap=overlap, replay_layers=REPLAY_LAYERS)
                results.append(res)
    return build_report([str(p) for p in results]), folder
