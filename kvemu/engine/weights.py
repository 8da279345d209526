"""Weights in the tier: a share of the model's weights lives in the KV tier instead of HBM and is
streamed to the GPU when a step needs it (docs/weights-in-tier.md).

Two placements:

* ``dense`` (``--weights-in-tier F``): a fraction F of all weight bytes, spread evenly over the
  layers, as vLLM's ``--cpu-offload-gb`` keeps part of the weights in CPU memory and loads them to
  the GPU in every forward pass. Every step streams all F x weight bytes.
* ``cold-experts`` (``--cold-experts C``, MoE models): ``round(C x E)`` of the E routed experts of
  every MoE layer live in the tier and are fetched when a token routes to them (MoE-Infinity,
  Eliseev & Mazur's Mixtral offloading). Routing is modelled as uniform: each token picks its
  top-k experts uniformly, so a step of T new tokens touches a given expert with probability
  ``1 - (1 - k/E)^T``, and streams the expected ``n_cold x (1 - (1 - k/E)^T)`` experts per MoE
  layer. Under uniform routing no expert is colder than another; "cold" names the placed share.

Placed bytes leave HBM, so the KV cache gets them (``GpuTiming.hbm_kv_bytes``). The GPU still reads
the streamed weights from HBM once they arrive (the roofline of ``GpuTiming.step_ns`` is unchanged).

How a step's stream composes with its compute (``stream``), with L layers, ``w`` the stream time of
one layer (bytes / link GB/s / L) and ``c`` one layer's compute:

* ``serial`` (default; vLLM's CPU offload loads a layer's weights before it runs, on the compute
  stream): ``step = compute + stream``;
* ``overlap`` (FlexGen and DeepSpeed ZeRO-Inference prefetch the next layer's weights while the
  current one computes): layer l starts once its weights arrived, ``step = max(w + L c, L w + c)``.

These are the compositions replay applies to the weight loads (without and with ``--overlap``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..bounds import STREAMS, WEIGHT_DTYPE_BYTES
from ..errors import ConfigError
from ..links import DEFAULT_LINK, get_link
from ..models import ModelGeometry
from ..units import check_number
from .timing import GpuTiming, step_time

PLACEMENTS = ("dense", "cold-experts")

#: Routed experts of the MoE presets, from their config.json: (experts, top-k, MoE layers, params per
#: expert = 3 x hidden x moe_intermediate_size). Mixtral-8x7B: 8 experts, top-2, all 32 layers,
#: 3 x 4096 x 14336. DeepSeek-V3: 256 routed experts, top-8, layers 3..60 (first_k_dense_replace 3),
#: 3 x 7168 x 2048; its shared expert stays in HBM.
MOE_PRESETS = {
    "mixtral-8x7b": (8, 2, 32, 3 * 4096 * 14336),
    "deepseek-v3": (256, 8, 58, 3 * 7168 * 2048),
}


@dataclass(frozen=True)
class WeightPlacement:
    placement: str          # dense | cold-experts
    fraction: float         # F, or C
    placed_bytes: int       # weight bytes in the tier (freed in HBM)
    layers: int
    stream: str = "serial"
    link: str = "pcie5-x16"
    link_gbps: float = 50.0
    experts: int = 0        # cold-experts only
    top_k: int = 0
    moe_layers: int = 0
    cold_experts: int = 0   # per MoE layer
    expert_bytes: int = 0   # bytes of one expert (one layer)

    def step_bytes(self, new_tokens: int) -> int:
        """Weight bytes a step with ``new_tokens`` new tokens streams (expected, cold-experts)."""
        if self.placed_bytes == 0 or new_tokens <= 0:
            return 0
        if self.placement == "dense":
            return self.placed_bytes
        touched = self.cold_experts * (1.0 - (1.0 - self.top_k / self.experts) ** new_tokens)
        return int(round(touched * self.expert_bytes * self.moe_layers))

    def stream_ns(self, nbytes: int) -> float:
        """Link time of ``nbytes`` (the host link's load direction, bytes / GB/s)."""
        return GpuTiming.weight_stream_ns(nbytes, self.link_gbps)

    def step_ns(self, compute_ns: int, new_tokens: int) -> int:
        """The step's duration with its weight stream composed with ``compute_ns`` (module docstring)."""
        w_total = self.stream_ns(self.step_bytes(new_tokens))
        if w_total <= 0:
            return int(compute_ns)
        if not w_total <= 2 ** 62:  # step_time refuses it (round() of inf would raise)
            return step_time(w_total)
        if self.stream == "serial":
            return step_time(compute_ns + round(w_total))
        n = self.layers
        w, c = w_total / n, compute_ns / n
        return step_time(round(max(w + n * c, n * w + c)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WeightPlacement":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def weights_from_meta(meta: dict) -> WeightPlacement | None:
    """The placement a trace (or a results file's ``trace`` section) was recorded with; None without one."""
    d = meta.get("weights")
    if not d or not d.get("placed_bytes"):
        return None
    return WeightPlacement.from_dict(d)


def make_placement(model: ModelGeometry, weight_dtype: str, *, weights_in_tier: float | None = None,
                   cold_experts: float | None = None, stream: str = "serial", link: str | None = None,
                   lanes: int = 1) -> WeightPlacement | None:
    """The placement the record options ask for (None for neither, or a fraction of 0). ``lanes``:
    the instance's GPUs, each streaming its shard of the placed weights over its own link."""
    if weights_in_tier is not None and cold_experts is not None:
        raise ConfigError("give --weights-in-tier or --cold-experts, not both")
    if stream not in STREAMS:
        raise ConfigError(f"--weight-stream must be one of {', '.join(STREAMS)}, got {stream!r}")
    lk = get_link(link or DEFAULT_LINK).with_lanes(lanes)
    if lk.load_gbps <= 0:
        raise ConfigError(f"the GPU's host link {lk.name} has no bandwidth limit; weights in the tier need a GPU link "
                          f"(e.g. pcie5-x16)")
    wb = WEIGHT_DTYPE_BYTES[weight_dtype]
    common = {"layers": model.layers, "stream": stream, "link": lk.name, "link_gbps": lk.load_gbps}
    if weights_in_tier is not None:
        f = check_number(weights_in_tier, "--weights-in-tier", 0.0, 1.0)
        if f == 0:
            return None
        return WeightPlacement("dense", f, int(round(f * model.params * wb)), **common)
    if cold_experts is None:
        return None
    c = check_number(cold_experts, "--cold-experts", 0.0, 1.0)
    moe = MOE_PRESETS.get(model.name)
    if moe is None:
        raise ConfigError(f"--cold-experts needs a mixture-of-experts preset ({', '.join(MOE_PRESETS)}); "
                          f"{model.name} has no expert table here (use --weights-in-tier)")
    experts, top_k, moe_layers, expert_params = moe
    n_cold = int(round(c * experts))
    if n_cold == 0:
        return None
    expert_bytes = expert_params * wb
    return WeightPlacement("cold-experts", c, n_cold * expert_bytes * moe_layers, experts=experts, top_k=top_k,
                           moe_layers=moe_layers, cold_experts=n_cold, expert_bytes=expert_bytes, **common)


def blocks_per_layer(nbytes: int, layers: int, block_bytes_per_layer: int) -> int:
    """Arena blocks of one layer that carry ``nbytes`` of weights spread over ``layers`` (rounded up)."""
    if nbytes <= 0:
        return 0
    return math.ceil(nbytes / layers / block_bytes_per_layer)
