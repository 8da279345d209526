"""Link profiles: how the GPU reaches the tier (docs/tier-profiles.md, "Links").

A link carries KV between the tier and the GPU in one of two ways: **DMA copies** of whole
transfers by copy engines (loads tier -> HBM, stores HBM -> tier), and **in-place loads** by
attention kernels from tier memory mapped into the GPU's address space (the ``resident`` policy).
Replay charges every backend batch the larger of the medium's time (measured or emulated) and the
link's (struct kv_timing in cbackends/kvemu.h):

* copies: ``bytes / gbps + ceil(transfers / engines) * setup_ns`` per direction;
* in-place reads: ``max(bytes / gbps, bytes * (read_latency_ns + tier latency) / (outstanding *
  line_bytes))``: the GPU keeps at most ``outstanding`` line requests in flight (Little's law).

``cpu`` is no link at all: a CPU consumer, whose time is the medium's alone (kvemu before links).
Every figure has its source in ``sources``; estimates say so.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from .errors import ConfigError

DEFAULT_LINK = "pcie5-x16"


@dataclass(frozen=True)
class Link:
    name: str
    description: str
    load_gbps: float        # tier -> GPU per direction, GB/s (= bytes per ns); 0: no limit
    store_gbps: float       # GPU -> tier
    read_gbps: float        # in-place loads over the link
    setup_ns: float         # per transfer and copy engine (launch, descriptor)
    engines: int            # copy engines (or copy kernels) working on a batch at once
    outstanding: int        # line requests the GPU keeps in flight for in-place loads; 0: no bound
    line_bytes: int         # bytes per in-place request
    read_latency_ns: float  # the link's own round trip, added to the tier's latency
    sources: tuple[str, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sources"] = list(self.sources)
        return d

    def with_lanes(self, lanes: int) -> "Link":
        """This link taken ``lanes`` times in parallel: the GPUs of one tensor-parallel (and
        pipeline-parallel) instance each move their share of a block's KV over their own host link
        (each rank holds its KV heads, each stage its layers), so their bandwidths, copy engines and
        outstanding requests add up; the setup cost and latency of one transfer stay a link's."""
        if lanes <= 1 or not self.limits:
            return self
        return replace(self, name=f"{self.name}x{lanes}",
                       description=f"{lanes} x {self.description}, one per GPU of the instance",
                       load_gbps=self.load_gbps * lanes, store_gbps=self.store_gbps * lanes,
                       read_gbps=self.read_gbps * lanes, engines=self.engines * lanes,
                       outstanding=self.outstanding * lanes,
                       sources=(*self.sources, f"x{lanes}: the instance's GPUs each reach the tier over their own "
                                               f"link, moving their share of the KV (the trace's gpu.kv_links)"))

    @property
    def limits(self) -> bool:
        return self.load_gbps > 0 or self.store_gbps > 0 or self.read_gbps > 0

    def timing(self, *, tier_latency_ns: float, store_mode: str, store_inflight_bytes: int,
               staged: bool = False) -> dict:
        """The fields of struct kv_timing for this link (Backend.set_timing). ``staged``: storage
        reached by I/O, whose transfers pass a host bounce buffer (medium, then link)."""
        return {"staged": 1 if staged and self.limits else 0, "load_gbps": self.load_gbps, "store_gbps": self.store_gbps, "read_gbps": self.read_gbps,
                "setup_ns": self.setup_ns, "read_latency_ns": self.read_latency_ns,
                "tier_latency_ns": float(tier_latency_ns), "engines": self.engines,
                "outstanding": self.outstanding, "line_bytes": self.line_bytes,
                "store_mode": STORE_MODES.index(store_mode), "store_inflight_bytes": int(store_inflight_bytes)}


_PCIE_TAGS = ("PCIe 4.0+ 10-bit tags: up to 768 outstanding non-posted requests per function "
              "(PCI-SIG, PCIe Base Specification 4.0, 10-Bit Tag Requester)")
_LAUNCH = ("setup_ns: an estimate of one cudaMemcpyAsync's submission cost (a few us, "
           "NVIDIA CUDA C++ Best Practices Guide, 'Asynchronous transfers'); not measured by kvemu")

LINKS: dict[str, Link] = {
    "cpu": Link("cpu", "no link: the CPU itself consumes KV (kvemu before link models)", 0.0, 0.0, 0.0, 0.0, 1, 0,
                64, 0.0, ("no limit: times are the medium's, as measured or emulated",)),
    "pcie4-x16": Link(
        "pcie4-x16", "a GPU on PCIe Gen4 x16 (A100 class)", 28.3, 28.3, 28.3, 2000.0, 2, 768, 128, 1000.0,
        ("~26.4 GiB/s (28.3 GB/s) per direction measured for a PCIe Gen4 x16 GPU in third-party nixlbench runs "
         "(shared/REFERENCE.md); 32 GB/s theoretical (PCI-SIG)", _PCIE_TAGS, _LAUNCH,
         "read_latency_ns: ~1 us GPU -> host memory round trip over PCIe, an estimate")),
    "pcie5-x16": Link(
        "pcie5-x16", "a GPU on PCIe Gen5 x16 (H100 PCIe / SXM host link)", 50.0, 50.0, 50.0, 2000.0, 2, 768, 128,
        1000.0,
        ("~50 GB/s per direction with DMA (cudaMemcpyAsync) or a copy kernel, 83.4 GB/s both ways, H100: vLLM blog "
         "'KV offloading' (2025-12-29); 64 GB/s per direction theoretical (PCI-SIG)", _PCIE_TAGS, _LAUNCH,
         "read_latency_ns: ~1 us GPU -> host memory round trip over PCIe, an estimate")),
    "nvlink-c2c": Link(
        "nvlink-c2c", "GH200's NVLink-C2C between Hopper and Grace memory", 450.0, 450.0, 450.0, 1000.0, 2, 8192,
        128, 500.0,
        ("450 GB/s per direction, 900 GB/s total: NVIDIA GH200 Grace Hopper Superchip whitepaper", _LAUNCH,
         "outstanding 8192 x 128 B and read_latency_ns 500 ns: estimates for a coherent chip-to-chip link, so "
         "that Little's law allows ~2 TB/s at 500 ns and the 450 GB/s link binds")),
    "cxl-x16": Link(
        "cxl-x16", "a consumer attached over a CXL 2.0/3.x x16 port (PCIe Gen5 PHY), loads and stores", 64.0, 64.0,
        64.0, 0.0, 1, 768, 64, 250.0,
        ("64 GB/s per direction: PCIe Gen5 x16 signalling, which CXL.mem uses (PCI-SIG; CXL 2.0 spec); a Gen5 x8 "
         "CXL device delivers 36 GB/s (Samsung CMM-D 2.0, shared/REFERENCE.md)", _PCIE_TAGS,
         "no copy setup: CXL memory is reached with loads and stores, not DMA descriptors",
         "read_latency_ns 250 ns: the port's share of the 250-370 ns CXL expander latency (Intel CacheLib OCP demo, "
         "public MLC outputs), an estimate")),
    "rdma-200g": Link(
        "rdma-200g", "the wire to a remote KV store: one 200 Gb/s RDMA NIC (RoCE / InfiniBand, GPUDirect RDMA)",
        21.75, 21.75, 21.75, 2300.0, 16, 0, 64, 2300.0,
        ("21.75 GB/s per direction per 200 Gb/s NIC: what Mooncake's Transfer Engine delivers (87 GB/s over "
         "4 x 200 Gbps RoCE for 40 GB of KV, Mooncake README, shared/REFERENCE.md); line rate 25 GB/s",
         "setup_ns and read_latency_ns 2300 ns: one RC transfer of 4 KiB in perftest ib_*_lat (~2.3 us, "
         "shared/REFERENCE.md), the fixed cost of a transfer on the wire",
         "engines 16: RDMA reads outstanding per queue pair (max_qp_rd_atom on ConnectX NICs), as the "
         "rdma-storage profile; the wire a measured mooncake: run on loopback lacks")),
}

# Not selectable: what an emulated `hbm` tier is reached by. HBM is the GPU's own memory, so no link stands
# between it and the kernels; its profile's bandwidth is the whole story.
HBM_LOCAL = Link("hbm-local", "the tier is the GPU's own HBM: no link in between", 0.0, 0.0, 0.0, 0.0, 1, 0, 64, 0.0,
                 ("an hbm profile is the GPU's memory itself (replaces --link for emu:hbm / vemu:hbm)",))


def effective_link(link: Link, profile) -> Link:
    """The link a tier is reached by: ``link``, except for an emulated HBM tier (no link)."""
    return HBM_LOCAL if profile is not None and getattr(profile, "name", None) == "hbm" else link


def spread_over_gpus(profile, lanes: int) -> float | None:
    """The bandwidth of an emulated HBM tier read by an instance of ``lanes`` GPUs (the trace's
    gpu.kv_links): each GPU reads its share of the KV from its own HBM, so the bandwidths add up;
    None when nothing changes (not HBM, or one GPU)."""
    if profile is None or getattr(profile, "name", None) != "hbm" or lanes <= 1:
        return None
    return profile.bandwidth_gbps * lanes


def is_staged(kind, profile) -> bool:
    """Storage reached by I/O (a uring file, an emulated storage profile): its bytes pass a host bounce
    buffer between the medium and the GPU link (Mooncake Store and LMCache's remote and disk backends
    without GPUDirect). A storage profile with ``gpu_direct`` (GPUDirect RDMA or Storage, GPU-initiated
    I/O) moves them by DMA between the medium and GPU memory: not staged."""
    if profile is not None and getattr(profile, "kind", None) == "storage":
        return not getattr(profile, "gpu_direct", False)
    return kind.medium == "storage"


def is_storage(kind, profile) -> bool:
    """A tier reached by I/O rather than by loads and stores (staged or GPU-direct alike)."""
    return kind.medium == "storage" or (profile is not None and getattr(profile, "kind", None) == "storage")


STORE_MODES = ("serial", "async")
DEFAULT_STORE_MODE = "async"
# vLLM's OffloadingConnector and LMCache save KV asynchronously; what bounds the bytes in flight is their
# host staging buffers. 2 GiB: an estimate of that buffer, not a figure either project publishes as such.
DEFAULT_STORE_INFLIGHT_BYTES = 2 << 30


def get_link(name: str) -> Link:
    try:
        return LINKS[name]
    except KeyError:
        raise ConfigError(f"unknown link '{name}' (known: {', '.join(LINKS)})") from None
