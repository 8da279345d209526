"""GPU presets of the compute-time model: tensor peaks per dtype, HBM, and the GPU's links.

Every figure is a vendor datasheet's (the source is named on each preset and in docs/engine.md's
preset table). Tensor peaks are **dense** (datasheets print the 2:4-sparsity figure first and the
dense one, half of it, in a footnote or as the second number). ``fp8_tflops`` 0 means the GPU has
no FP8 tensor cores (Ampere): FP8 weights there are stored in 8 bits and computed in 16 (vLLM's
weight-only FP8 on Ampere, Marlin kernels), so compute runs at the bf16/fp16 peak.

Link figures are per GPU and count both directions together, as datasheets give them
(NVLink 4 on H100: 900 GB/s = 450 GB/s each way). ``link`` names the kvemu link profile
(``kvemu.links``, ``replay --link``) that matches the GPU's host link.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..errors import ConfigError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_tflops: float  # dense bf16 = fp16 tensor-core peak, TFLOP/s
    hbm_gbps: float  # GB/s
    memory_gb: float  # GB (10^9 bytes)
    fp8_tflops: float = 0.0  # dense FP8 tensor-core peak; 0: no FP8 tensor cores
    scaleup: str = ""  # GPU-to-GPU fabric
    scaleup_gbps: float = 0.0  # per GPU, both directions together
    host_link: str = ""  # the GPU's link to the host
    host_link_gbps: float = 0.0  # both directions together
    link: str = ""  # the kvemu link profile of that host link (kvemu.links.LINKS)
    sources: tuple[str, ...] = ()
    # collectives of the parallelism model (kvemu.engine.timing): NCCL-style bus bandwidth per GPU and
    # direction (nccl-tests' busbw) and the latency of one small collective, inside the scale-up domain
    # of ``node_gpus`` GPUs and, beyond it, over each GPU's scale-out NIC
    allreduce_busbw_gbps: float = 0.0
    collective_us: float = 0.0
    node_gpus: int = 8
    scaleout_busbw_gbps: float = 0.0
    scaleout_us: float = 0.0
    comm_sources: tuple[str, ...] = ()

    def peak_for(self, dtype: str) -> float:
        """Dense tensor peak, TFLOP/s, of computing in ``dtype``: fp8 only where the GPU has it."""
        if dtype == "fp8" and self.fp8_tflops > 0:
            return self.fp8_tflops
        return self.peak_tflops

    def compute_dtype(self, weight_dtype: str) -> str:
        """What the GEMMs run in for weights of ``weight_dtype``: FP8 weights use FP8 tensor cores
        where the GPU has them (vLLM's FP8 W8A8 on Hopper, Blackwell, MI300X), else bf16."""
        if weight_dtype == "fp8":
            return "fp8" if self.fp8_tflops > 0 else "bf16"
        return weight_dtype

    def to_dict(self) -> dict:
        """The figures a trace records (the sources stay in the code and the docs)."""
        d = asdict(self)
        d.pop("sources")
        d.pop("comm_sources")
        return d


_A100 = ("NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column): "
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_A800 = ("NVIDIA A800 Tensor Core GPU datasheet (A800 80GB SXM column): "
         "https://www.nvidia.cn/content/dam/en-zz/Solutions/Data-Center/a800/nvidia-a800-datasheet-2029415.pdf")
_H100 = ("NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): "
         "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_H800 = ("NVIDIA H800 Tensor Core GPU datasheet (H800 SXM column): "
         "https://www.nvidia.cn/content/dam/en-zz/Solutions/Data-Center/h800/nvidia-h800-datasheet-2029415.pdf")
_H200 = ("NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): "
         "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446")
_B200 = ("NVIDIA DGX B200 datasheet (8 GPUs: 1,440 GB HBM3e, 64 TB/s, FP8 72 PFLOPS sparse, NVLink 5 1.8 TB/s "
         "per GPU): https://resources.nvidia.com/en-us-dgx-systems/dgx-b200-datasheet; NVIDIA HGX platform page "
         "(HGX B200 FP16/BF16 36 PFLOPS sparse): https://www.nvidia.com/en-us/data-center/hgx/")
_GH200 = ("NVIDIA GH200 Grace Hopper Superchip datasheet (96 GB HBM3 configuration): "
          "https://resources.nvidia.com/en-us-data-center-overview-mc/en-us-data-center-overview/"
          "grace-hopper-superchip-datasheet-partner")
_L40S = ("NVIDIA L40S GPU datasheet: https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413")
_MI300X = ("AMD Instinct MI300X accelerator data sheet: "
           "https://www.amd.com/content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
           "amd-instinct-mi300x-data-sheet.pdf")

GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        # Ampere: no FP8 tensor cores; NVLink 3 (12 links x 50 GB/s), PCIe Gen4 x16 (64 GB/s both ways)
        GpuSpec("A100-80GB", 312.0, 2039.0, 80.0, 0.0, "NVLink 3", 600.0, "PCIe Gen4 x16", 64.0, "pcie4-x16",
                (_A100, "BF16/FP16 tensor 312 TFLOPS dense (624 sparse); 80 GB HBM2e, 2,039 GB/s; NVLink 600 GB/s; "
                        "PCIe Gen4 64 GB/s")),
        # A100 with its NVLink cut to 400 GB/s (export rules); compute and memory as A100
        GpuSpec("A800-80GB", 312.0, 2039.0, 80.0, 0.0, "NVLink 3 (reduced)", 400.0, "PCIe Gen4 x16", 64.0,
                "pcie4-x16",
                (_A800, "BF16/FP16 tensor 312 TFLOPS dense (624 sparse); 80 GB HBM2e, 2,039 GB/s; NVLink 400 GB/s; "
                        "PCIe Gen4 64 GB/s")),
        GpuSpec("H100-SXM", 989.0, 3350.0, 80.0, 1979.0, "NVLink 4", 900.0, "PCIe Gen5 x16", 128.0, "pcie5-x16",
                (_H100, "BF16/FP16 1,979 and FP8 3,958 TFLOPS with sparsity (989 / 1,979 dense); 80 GB HBM3, "
                        "3.35 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s")),
        # H100 with its NVLink cut to 400 GB/s and FP64 to 1 TFLOPS (export rules); tensor peaks as H100
        GpuSpec("H800-SXM", 989.0, 3350.0, 80.0, 1979.0, "NVLink 4 (reduced)", 400.0, "PCIe Gen5 x16", 128.0,
                "pcie5-x16",
                (_H800, "BF16/FP16 1,979 and FP8 3,958 TFLOPS with sparsity (989 / 1,979 dense); 80 GB HBM3, "
                        "3.35 TB/s; NVLink 400 GB/s; PCIe Gen5 128 GB/s")),
        GpuSpec("H200", 989.0, 4800.0, 141.0, 1979.0, "NVLink 4", 900.0, "PCIe Gen5 x16", 128.0, "pcie5-x16",
                (_H200, "BF16/FP16 1,979 and FP8 3,958 TFLOPS with sparsity (989 / 1,979 dense); 141 GB HBM3e, "
                        "4.8 TB/s; NVLink 900 GB/s; PCIe Gen5 128 GB/s")),
        GpuSpec("B200", 2250.0, 8000.0, 180.0, 4500.0, "NVLink 5", 1800.0, "PCIe Gen5 x16", 128.0, "pcie5-x16",
                (_B200, "per GPU: FP8 72 / 8 / 2 = 4.5 PFLOPS and BF16 36 / 8 / 2 = 2.25 PFLOPS dense; "
                        "1,440 / 8 = 180 GB HBM3e at 64 / 8 = 8 TB/s; NVLink 5 1.8 TB/s; the DGX B200 host link is "
                        "PCIe Gen5")),
        # GH200's Hopper GPU reaches Grace's LPDDR5X over NVLink-C2C: 900 GB/s both ways (450 each way)
        GpuSpec("GH200", 989.0, 4000.0, 96.0, 1979.0, "NVLink 4", 900.0, "NVLink-C2C", 900.0, "nvlink-c2c",
                (_GH200, "BF16/FP16 1,979 and FP8 3,958 TFLOPS with sparsity (989 / 1,979 dense); 96 GB HBM3, "
                         "4 TB/s (the 144 GB HBM3e part: 4.9 TB/s); NVLink-C2C 900 GB/s CPU-GPU; NVLink 900 GB/s")),
        # a PCIe card without NVLink: GPU-to-GPU traffic crosses PCIe Gen4 x16 (32 GB/s each way)
        GpuSpec("L40S", 362.05, 864.0, 48.0, 733.0, "PCIe Gen4 x16 (no NVLink)", 64.0, "PCIe Gen4 x16", 64.0,
                "pcie4-x16",
                (_L40S, "BF16/FP16 tensor 362.05 and FP8 733 TFLOPS dense (733 / 1,466 with sparsity); 48 GB GDDR6, "
                        "864 GB/s; PCIe Gen4 x16 64 GB/s; no NVLink")),
        GpuSpec("MI300X", 1307.4, 5300.0, 192.0, 2614.9, "Infinity Fabric", 896.0, "PCIe Gen5 x16", 128.0,
                "pcie5-x16",
                (_MI300X, "BF16/FP16 matrix 1,307.4 and FP8 2,614.9 TFLOPS dense (2,614.9 / 5,229.8 with sparsity); "
                          "192 GB HBM3, 5.3 TB/s; 7 Infinity Fabric links x 128 GB/s = 896 GB/s; PCIe Gen5 x16 "
                          "128 GB/s")),
    )
}

# ------------------------------------------------------------------------------ collectives
_BUSBW = ("nccl-tests doc/PERFORMANCE.md: an all-reduce's bus bandwidth is algbw x 2(n-1)/n, comparable with "
          "the per-direction link rate: https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md")
_NVL4 = ("nccl-tests issue #212 (NCCL maintainer): NVLink 4's 450 GB/s line rate per direction gives ~370 GB/s "
         "effective bus bandwidth after NCCL's protocol overhead (ring): https://github.com/NVIDIA/nccl-tests/issues/212")
_NVL3 = ("nccl-tests issues #178 and #149: 8 x A100 SXM all-reduce busbw 200-208 GB/s over NVLink 3 (300 GB/s per "
         "direction): https://github.com/NVIDIA/nccl-tests/issues/178, https://github.com/NVIDIA/nccl-tests/issues/149")
_SCALED = "busbw scaled from the H100's 370 / 450 = 0.82 of the per-direction link rate: an estimate"
_AR_US = ("collective_us 10: SGLang PR #2904 measured vLLM's custom all-reduce on H100 at 8.5-11.8 us per call for "
          "512 B-32 KiB at TP 2, 4 and 8 (no CUDA graph): https://github.com/sgl-project/sglang/pull/2904; other "
          "GPUs: the same figure, an estimate")
_NIC = ("scale-out: one NIC per GPU, NVIDIA DGX H100/H200/B200 8 x ConnectX-7 400 Gb/s (50 GB/s), DGX A100 8 x "
        "ConnectX-6 200 Gb/s (25 GB/s) (NVIDIA DGX datasheets); busbw 0.9 of that and 25 us per collective are "
        "estimates")
_PCIE_AR = ("busbw 22 GB/s: an estimate, 0.7 of PCIe Gen4 x16's 32 GB/s per direction (GPU-to-GPU traffic through the "
            "host's root complex); 15 us per collective: an estimate")

#: name: (all-reduce busbw GB/s, us per collective, GPUs per scale-up domain, scale-out busbw GB/s, us, sources)
_COMM = {
    "A100-80GB": (208.0, 10.0, 8, 22.5, 25.0, (_BUSBW, _NVL3, _AR_US, _NIC)),
    "A800-80GB": (139.0, 10.0, 8, 22.5, 25.0, (_BUSBW, _NVL3, "A800: the A100's 208 GB/s x 200 / 300 (its NVLink "
                                                "rate per direction), an estimate", _AR_US, _NIC)),
    "H100-SXM": (370.0, 10.0, 8, 45.0, 25.0, (_BUSBW, _NVL4, _AR_US, _NIC)),
    "H800-SXM": (164.0, 10.0, 8, 45.0, 25.0, (_BUSBW, _SCALED + " (200 GB/s per direction)", _AR_US, _NIC)),
    "H200": (370.0, 10.0, 8, 45.0, 25.0, (_BUSBW, _NVL4, _AR_US, _NIC)),
    "B200": (740.0, 10.0, 8, 45.0, 25.0, (_BUSBW, _SCALED + " (NVLink 5, 900 GB/s per direction)", _AR_US, _NIC)),
    "GH200": (370.0, 10.0, 8, 45.0, 25.0, (_BUSBW, _NVL4, _AR_US, _NIC)),
    "L40S": (22.0, 15.0, 8, 22.5, 25.0, (_BUSBW, _PCIE_AR, _NIC)),
    "MI300X": (367.0, 10.0, 8, 45.0, 25.0, (_BUSBW, _SCALED + " (7 x 64 GB/s per direction)", _AR_US, _NIC)),
}
GPU_PRESETS = {
    name: replace(g, allreduce_busbw_gbps=c[0], collective_us=c[1], node_gpus=c[2], scaleout_busbw_gbps=c[3],
                  scaleout_us=c[4], comm_sources=c[5])
    for name, g in GPU_PRESETS.items() for c in (_COMM[name],)
}

#: Other spellings accepted for ``--gpu`` (the SXM parts are the presets).
GPU_ALIASES = {"A100": "A100-80GB", "A100-SXM": "A100-80GB", "A800": "A800-80GB", "A800-SXM": "A800-80GB",
               "H100": "H100-SXM", "H800": "H800-SXM", "H200-SXM": "H200"}


def gpu_names() -> list[str]:
    """Every name ``--gpu`` accepts: the presets, then their aliases."""
    return list(GPU_PRESETS) + list(GPU_ALIASES)


def get_gpu(name: str) -> GpuSpec:
    spec = GPU_PRESETS.get(GPU_ALIASES.get(name, name))
    if spec is None:
        raise ConfigError(f"unknown GPU '{name}' (presets: {', '.join(GPU_PRESETS)})")
    return spec
