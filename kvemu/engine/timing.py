"""GPU execution-time model: what one engine step costs on the GPU, without any KV tier traffic.

A step runs the batch's new tokens through the model. Its time is a roofline with stated
efficiency factors:

    flops  = 2 * active_params * new_tokens
           + 2 * layers * heads * (qk_head_dim + v_head_dim) * sum_r n_r * (c_r + (n_r + 1) / 2)
    bytes  = weight_bytes_read + kv_bytes_per_token * sum_r (c_r + n_r)
    time   = max(flops / (gpus * peak_flops * mfu), bytes / (gpus * hbm_bandwidth * mbu)) + overhead

where request r computes n_r new tokens on top of c_r tokens already cached. The first term is
the linear layers (two FLOPs per multiply-accumulate per parameter), the second causal attention
(QK^T and PV). Weight bytes are all weights for dense models; for mixture-of-experts models the
experts a batch touches, bounded by ``active_params * tokens`` and by all weights.

Peak figures are vendor datasheets (dense, without sparsity; ``gpus.py``), at the compute dtype:
the weight dtype's, where the GPU has tensor cores for it (FP8 weights on an A100 compute in bf16).
The KV dtype is separate (``ModelGeometry.kv_dtype``). The efficiency factors are
assumptions stated here and recorded in every trace: ``mfu`` 0.5 (large prefill GEMMs typically
reach 40-60% of peak), ``mbu`` 0.7 (decode kernels typically reach 60-80% of HBM bandwidth), and a
fixed per-step ``overhead_us`` of 300 us for scheduling, kernel launches and tensor-parallel
collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..units import check_number
from ..models import WEIGHT_DTYPE_BYTES, ModelGeometry
from .gpus import GPU_ALIASES, GPU_PRESETS, GpuSpec, get_gpu

__all__ = ["GPU_ALIASES", "GPU_PRESETS", "GpuSpec", "GpuTiming", "auto_gpu_count", "get_gpu", "make_timing"]


@dataclass(frozen=True)
class GpuTiming:
    gpu: GpuSpec
    gpus: int
    model: ModelGeometry
    weight_dtype: str = "bf16"
    mfu: float = 0.5
    mbu: float = 0.7
    overhead_us: float = 300.0
    memory_utilization: float = 0.9
    compute_dtype: str | None = None  # None: what the GPU computes weights of weight_dtype in
    # weight bytes that live in the KV tier and are streamed per step (engine/weights.py); not in HBM
    tier_weight_bytes: int = 0

    @property
    def compute(self) -> str:
        """The dtype the GEMMs run in (``GpuSpec.compute_dtype`` unless given)."""
        return self.compute_dtype or self.gpu.compute_dtype(self.weight_dtype)

    @property
    def peak_tflops(self) -> float:
        """Dense tensor peak per GPU at the compute dtype."""
        return self.gpu.peak_for(self.compute)

    @property
    def weight_bytes(self) -> int:
        return self.model.params * WEIGHT_DTYPE_BYTES[self.weight_dtype]

    @property
    def hbm_weight_bytes(self) -> int:
        """Weight bytes resident in HBM: all of them but those placed in the tier."""
        return self.weight_bytes - self.tier_weight_bytes

    def hbm_kv_bytes(self) -> int:
        """KV capacity: the memory share vLLM would get (gpu_memory_utilization) minus the weights
        resident in HBM (those placed in the tier free their bytes for KV)."""
        total = self.gpus * self.gpu.memory_gb * 1e9 * self.memory_utilization
        return int(total - self.hbm_weight_bytes)

    @staticmethod
    def weight_stream_ns(nbytes: int, link_gbps: float) -> float:
        """Time to stream ``nbytes`` of weights over a host link of ``link_gbps`` GB/s (bytes per ns)."""
        return nbytes / link_gbps if link_gbps > 0 else 0.0

    def step_ns(self, new_tokens: int, attn_token_pairs: float, kv_tokens_touched: int) -> int:
        """Modelled GPU time of one step.

        new_tokens: sum_r n_r; attn_token_pairs: sum_r n_r * (c_r + (n_r + 1) / 2);
        kv_tokens_touched: sum_r (c_r + n_r).
        """
        m = self.model
        flops = 2.0 * m.active_params * new_tokens + (
            2.0 * m.layers * m.attention_heads * (m.qk_head_dim + m.v_head_dim) * attn_token_pairs
        )
        wbytes = min(m.params, m.active_params * max(1, new_tokens)) * WEIGHT_DTYPE_BYTES[self.weight_dtype]
        nbytes = wbytes + m.kv_bytes_per_token * kv_tokens_touched
        t_compute = flops / (self.gpus * self.peak_tflops * 1e12 * self.mfu)
        t_memory = nbytes / (self.gpus * self.gpu.hbm_gbps * 1e9 * self.mbu)
        return int(max(t_compute, t_memory) * 1e9 + self.overhead_us * 1e3)

    def to_dict(self) -> dict:
        return {
            **self.gpu.to_dict(),
            "gpus": self.gpus,
            "weight_dtype": self.weight_dtype,
            "compute_dtype": self.compute,
            "compute_tflops": self.peak_tflops,
            "weight_bytes": self.weight_bytes,
            "mfu": self.mfu,
            "mbu": self.mbu,
            "overhead_us": self.overhead_us,
            "memory_utilization": self.memory_utilization,
            "hbm_kv_bytes": self.hbm_kv_bytes(),
            **({"tier_weight_bytes": self.tier_weight_bytes} if self.tier_weight_bytes else {}),
        }


def auto_gpu_count(gpu: GpuSpec, model: ModelGeometry, weight_dtype: str) -> int:
    """Smallest power of two whose HBM holds the weights in at most half of it (rest for KV)."""
    weights = model.params * WEIGHT_DTYPE_BYTES[weight_dtype]
    n = 1
    while weights > 0.5 * n * gpu.memory_gb * 1e9:
        n *= 2
    return n


def make_timing(
    gpu: str,
    model: ModelGeometry,
    gpus: int | None = None,
    weight_dtype: str = "bf16",
    mfu: float = 0.5,
    mbu: float = 0.7,
    overhead_us: float = 300.0,
) -> GpuTiming:
    spec = get_gpu(gpu)
    if weight_dtype not in WEIGHT_DTYPE_BYTES:
        raise ConfigError(f"unknown weight dtype '{weight_dtype}' (known: {', '.join(WEIGHT_DTYPE_BYTES)})")
    # below 0.001 a step would take longer than a day: a mistyped factor, not a GPU
    check_number(mfu, "--mfu", 1e-3, 1.0)
    check_number(mbu, "--mbu", 1e-3, 1.0)
    check_number(overhead_us, "--step-overhead-us", 0.0, 1e6)
    n = gpus if gpus is not None else auto_gpu_count(spec, model, weight_dtype)
    if n < 1:
        raise ConfigError("--gpus must be >= 1")
    return GpuTiming(spec, n, model, weight_dtype, mfu, mbu, overhead_us,
                     compute_dtype=spec.compute_dtype(weight_dtype))
