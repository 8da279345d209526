"""The order of the tiers (issue: tier figures that mean what they say). Virtual-time replays of one
trace with the built-in profiles must rank the tiers as their media and software paths do, a measured
dram run must either keep up with an emulated CXL pool or say it is host-bound, and a latency sweep
must move in-place reads (resident TPOT) while copies (offload loads) follow bandwidth."""
import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.replay import DataPathOptions, OutputOptions, ReplayOptions, WindowOptions, replay as run_replay

WORKLOAD = "synthetic:docqa:documents=4,questions=4"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("order")
    offload, resident = d / "offload.parquet", d / "resident.parquet"
    # a small HBM, so that shared documents are evicted there and loaded back from the tier
    record(WORKLOAD, "llama3-8b", offload, RecordOptions.from_flat(hbm_kv_gib=1.5, show_progress=False))
    record(WORKLOAD, "llama3-8b", resident, RecordOptions.from_flat(tier_policy="resident", show_progress=False))
    return {"offload": offload, "resident": resident, "dir": d}


def replay(traces, policy, spec, link=DataPathOptions.link):
    out = traces["dir"] / "r.parquet"
    meta = run_replay(traces[policy], spec, ReplayOptions(window=WindowOptions(layers=2), datapath=DataPathOptions(link=link),
                                                          output=OutputOptions(force=True)), out=out)
    t = pq.read_table(out).to_pydict()
    kv = np.array(t["kv_load_ms"]) + np.array(t["kv_store_ms"]) + np.array(t["kv_read_ms"])
    return {"kv_ms": float(kv.mean()), "load_ms": float(np.mean(t["kv_load_ms"])),
            "ttft_ms": float(np.median(t["ttft_ms"])), "tpot_ms": float(np.nanmean(t["tpot_ms"])), "meta": meta}


def _medium_only(traces, name):
    """A TOML profile of a built-in storage tier's medium alone: its figures without its software path."""
    from kvemu.profiles import BUILTIN_PROFILES

    path = traces["dir"] / f"{name}-medium.toml"
    path.write_text(dataclasses.replace(BUILTIN_PROFILES[name], software=()).to_toml())
    return path


def test_virtual_time_ranks_the_built_in_tiers(traces):
    # NVLink-C2C carries 450 GB/s, so the media below HBM show through the link; hbm is the GPU's own
    # memory and is reached by no link at all.
    runs = {p: replay(traces, "offload", f"vemu:{p}", link="nvlink-c2c")
            for p in ("hbm", "local-dram", "remote-numa", "cxl-pool", "rdma-storage", "nvme", "storage-rdma",
                      "object-store", "mooncake-lmcache-zerocopy", "mooncake-gdr", "nvme-fs")}
    kv = {p: r["kv_ms"] for p, r in runs.items()}
    assert kv["hbm"] < kv["local-dram"] < kv["remote-numa"] <= kv["cxl-pool"] < kv["rdma-storage"]
    # one CXL expander (24 GB/s) against one 200 Gb/s NIC as a transfer engine drives it (21.75 GB/s) and
    # the software in front of it: the pool must win by at least the media's ratio
    assert kv["rdma-storage"] / kv["cxl-pool"] > 1.05
    # the storage tiers rank by medium and software path together. In bulk, rdma-storage's NIC in series
    # with a server core's single-thread copy (1 / (1/21.75 + 1/6.25) = 4.85 GB/s) moves KV slower than
    # one NVMe drive read with O_DIRECT (7 GB/s), and one drive through a kernel file system slower still
    # (1 / (1/7 + 5.25/7) = 1.12 GB/s); the same store without the copy (zero-copy or GPUDirect) is its
    # NIC again; flash behind the NIC adds its 65 us; an object store its ms, hidden by its 1000 in flight.
    assert kv["nvme"] < kv["rdma-storage"] < kv["object-store"] < kv["nvme-fs"]
    assert kv["mooncake-gdr"] <= kv["mooncake-lmcache-zerocopy"] < kv["storage-rdma"] < kv["nvme"]
    assert kv["rdma-storage"] > 4 * kv["mooncake-lmcache-zerocopy"]
    # ... and the medium alone ranks as before: without its software path one NIC is 3x one drive
    bare = replay(traces, "offload", f"vemu:{_medium_only(traces, 'rdma-storage')}", link="nvlink-c2c")
    assert bare["kv_ms"] < kv["nvme"] and bare["kv_ms"] * 2.5 < kv["rdma-storage"]
    assert kv["cxl-pool"] < bare["kv_ms"]
    # the hand-computed floor: at least the bytes over each medium's bandwidth, and through a storage tier's
    # per-byte software parts in series with it
    for p, gbps in (("local-dram", 176.0), ("cxl-pool", 24.0), ("nvme", 7.0),
                    ("rdma-storage", 1 / (1 / 21.75 + 1 / 6.25)), ("nvme-fs", 1 / (1 / 7.0 + 5.25 / 7.0))):
        m = runs[p]["meta"]
        moved = sum(m["datapath"]["ops"][op]["bytes"] for op in ("load", "store"))
        charged = sum(m["datapath"]["ops"][op]["time_ns"] for op in ("load", "store"))
        assert charged >= moved / gbps * 0.999


def test_over_pcie_every_memory_faster_than_the_link_looks_the_same(traces):
    """A GPU on PCIe Gen5 gets ~50 GB/s from any memory faster than that: local DRAM (176 GB/s) and
    a remote socket (56 GB/s) take the link's time, and the run says the link bound them."""
    local = replay(traces, "offload", "vemu:local-dram")
    remote = replay(traces, "offload", "vemu:remote-numa")
    assert local["load_ms"] == pytest.approx(remote["load_ms"], rel=1e-3)
    ops = local["meta"]["datapath"]["ops"]["load"]
    assert ops["link_ns"] > ops["medium_ns"] and ops["time_ns"] == ops["link_ns"]
    assert local["meta"]["datapath"]["link"]["name"] == "pcie5-x16"
    cxl = replay(traces, "offload", "vemu:cxl-pool")
    assert cxl["load_ms"] > local["load_ms"]


def test_measured_dram_keeps_up_with_a_cxl_pool_or_says_it_is_host_bound(traces):
    dram = replay(traces, "offload", "dram")
    cxl = replay(traces, "offload", "vemu:cxl-pool")
    fig = dram["meta"]["figures"]
    assert fig["kind"] == "measured"
    assert dram["kv_ms"] <= cxl["kv_ms"] or ("host-bound" in fig["flags"] and fig["upper_bound"])


def test_latency_moves_in_place_reads_and_bandwidth_moves_copies(traces):
    lats = (100, 1_000, 10_000, 100_000)
    resident = [replay(traces, "resident", f"vemu:cxl-pool,latency_ns={lat}")["tpot_ms"] for lat in lats]
    loads = [replay(traces, "offload", f"vemu:cxl-pool,latency_ns={lat}")["load_ms"] for lat in lats]
    # resident TPOT rises with the tier's latency once Little's law binds (768 x 128 B in flight)
    assert all(a <= b for a, b in zip(resident, resident[1:]))
    assert resident[-1] > 5 * resident[1] and resident[2] > 1.5 * resident[1]
    # copies of 256-token chunks hide latency up to ~10 us: load time stays within 5 %
    assert loads[2] == pytest.approx(loads[0], rel=0.05)
    # ... and follow bandwidth instead
    bw = {g: replay(traces, "offload", f"vemu:cxl-pool,bandwidth_gbps={g}", link="nvlink-c2c")["load_ms"]
          for g in (6, 12, 24)}
    assert bw[6] == pytest.approx(2 * bw[12], rel=0.1) and bw[12] == pytest.approx(2 * bw[24], rel=0.1)
