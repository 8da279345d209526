#!/usr/bin/env python3
"""The latency sweep of docs/tier-profiles.md ("Links"): one tier bandwidth, tier latency from 100 ns
to 100 us, in virtual time (vemu, so every figure is the model's and the run takes seconds).

Two traces of the same workload (synthetic docqa on llama3-8b): `offload` (a small HBM, so shared
documents are loaded back from the tier in 256-token chunks) and `resident` (KV lives in the tier,
attention reads it in place). Resident TPOT follows the tier's latency once Little's law binds (the
GPU keeps 768 x 128 B requests in flight over PCIe Gen5, and cxl-pool keeps 2 accesses in flight); offload load time follows bandwidth and
hides latency up to about a chunk's transfer time. Writes docs/img/latency-sweep.png and prints the
numbers (tests/test_tier_order.py holds them).

    python tools/plot_latency_sweep.py [--out docs/img/latency-sweep.png]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.replay import OutputOptions, ReplayOptions, WindowOptions, replay

WORKLOAD = "synthetic:docqa:documents=4,questions=4"
LATENCIES_NS = (100, 300, 1_000, 3_000, 10_000, 30_000, 100_000)
BANDWIDTHS = (6, 12, 24, 48)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "img" / "latency-sweep.png"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        record(WORKLOAD, "llama3-8b", d / "o.parquet", RecordOptions.from_flat(hbm_kv_gib=1.5, show_progress=False))
        record(WORKLOAD, "llama3-8b", d / "r.parquet",
               RecordOptions.from_flat(tier_policy="resident", show_progress=False))

        def run(trace, spec):
            replay(d / trace, spec, ReplayOptions(window=WindowOptions(layers=2), output=OutputOptions(force=True)), out=d / "x.parquet")
            t = pq.read_table(d / "x.parquet").to_pydict()
            return {"tpot": float(np.nanmean(t["tpot_ms"])), "ttft": float(np.median(t["ttft_ms"])),
                    "load": float(np.mean(t["kv_load_ms"]))}

        lat = {x: (run("o.parquet", f"vemu:cxl-pool,latency_ns={x}"), run("r.parquet", f"vemu:cxl-pool,latency_ns={x}"))
               for x in LATENCIES_NS}
        bw = {g: (run("o.parquet", f"vemu:cxl-pool,bandwidth_gbps={g}"),
                  run("r.parquet", f"vemu:cxl-pool,bandwidth_gbps={g}")) for g in BANDWIDTHS}
    print("latency_ns  offload_load_ms  offload_ttft_p50_ms  resident_tpot_ms   (cxl-pool, 24 GB/s, pcie5-x16)")
    for x, (o, r) in lat.items():
        print(f"{x:>10}  {o['load']:15.3f}  {o['ttft']:19.1f}  {r['tpot']:16.2f}")
    print("gbps  offload_load_ms  resident_tpot_ms   (cxl-pool, 310 ns)")
    for g, (o, r) in bw.items():
        print(f"{g:>4}  {o['load']:15.3f}  {r['tpot']:16.2f}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = ((axes[0], lat, "tier latency, ns (bandwidth 24 GB/s)", "latency moves in-place reads"),
              (axes[1], bw, "tier bandwidth, GB/s (latency 310 ns)", "bandwidth moves both"))
    for ax, series, xlabel, title in panels:
        xs = list(series)
        ax.plot(xs, [series[x][1]["tpot"] for x in xs], "o-", label="resident: TPOT (in-place reads)")
        ax.plot(xs, [series[x][0]["load"] * 10 for x in xs], "s--", label="offload: KV load per request x10")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("ms")
    fig.suptitle("vemu:cxl-pool over pcie5-x16, synthetic docqa on llama3-8b (virtual time)", fontsize=9)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
