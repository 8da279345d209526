"""GPU execution-time model: what one engine step costs on the GPU, without any KV tier traffic.

A step runs the batch's new tokens through the model on one serving instance of ``tp x pp`` GPUs
(tensor-parallel ranks times pipeline stages; data parallelism is replay's ``--instances``). Its
time is a roofline with efficiency factors fitted to published measurements
(``tools/fit_engine.py``, docs/engine.md) plus the collectives of the parallelism:

    flops  = 2 * active_params * new_tokens
           + 2 * layers * heads * (qk_head_dim + v_head_dim) * sum_r n_r * (c_r + (n_r + 1) / 2)
    bytes  = weight_bytes_read / tp + kv_bytes_per_token * sum_r (c_r + n_r) / kv_shards
    time   = ||(flops / (tp * peak * mfu'), bytes / (hbm_bandwidth * mbu))||_p + comm + overhead

where request r computes n_r new tokens on top of c_r tokens already cached, ``mfu'`` is ``mfu`` times
``fp8_mfu_scale`` where the GEMMs compute in FP8 (``mfu`` elsewhere) and ``||a, b||_p`` is
``(a^p + b^p)^(1/p)`` with ``p = roofline_p`` (a soft maximum; ``roofline_p = 0`` is the plain
``max(a, b)`` of traces recorded before it). Why these two (tools/engine_fit/README.md, "Why a soft maximum
and an FP8 scale"): a step is a chain of kernels, some bound by compute and some by HBM, and a
GEMM whose arithmetic intensity is near the ridge point overlaps its loads and its math only in
part, so a step's time is above the larger of its two whole-step terms, most of all where they are
close (a prefill of a few hundred tokens); and FP8 GEMMs reach a smaller fraction of their doubled
tensor peak than 16-bit ones do. Pipeline stages run
one after the other for a step (no micro-batch interleaving), so the compute and HBM terms are
those of all layers on ``tp`` GPUs. ``kv_shards`` is how many ranks the KV heads are split over:
``min(tp, kv_heads)`` for GQA, 1 for MLA (its latent is replicated on every rank, as vLLM does
without data-parallel attention). ``comm``:

* tensor parallelism: two all-reduces per layer (attention output and MLP output, Megatron-LM) of
  ``new_tokens x hidden x 2`` bytes, each ``2 (tp-1)/tp x bytes / busbw + latency`` (ring);
* mixture of experts: a step reads the dense weights and, per MoE layer, the experts its tokens
  are routed to: ``E (1 - (1 - k/E)^T)`` of E experts for T tokens of top-k (uniform routing);
* expert parallelism (MoE, ``ep = tp``): the MLP all-reduce of an MoE layer becomes a dispatch
  and a combine all-to-all, each ``new_tokens x top_k x hidden x 2 x (ep-1)/ep / ep`` bytes per rank;
* pipeline parallelism: ``pp - 1`` activation sends of ``new_tokens x hidden x 2`` bytes.

Data-parallel attention (``dp_attention``; SGLang's ``--enable-dp-attention``, TensorRT-LLM's
``enable_attention_dp``, vLLM's data-parallel ranks with ``--enable-expert-parallel``): the attention
layers run data-parallel over the ``tp`` ranks, each with the whole attention weights and its own
requests, while the MLP and MoE layers stay split over them (tensor- or expert-parallel). A rank's KV
is its requests' alone, neither head-split nor replicated (``kv_shards = tp``, MLA included), and the
weights it holds grow by the attention blocks' ``(tp - 1)`` copies (``hbm_kv_bytes``). In a step the
busiest rank has ``ceil(R / tp)`` of the step's R requests (decodes and prefill chunks, spread round
robin, of like lengths): its share ``s = ceil(R / tp) / R`` of the attention work sets the step, and
never less than one whole prefill chunk's (a chunk runs on one rank: the step's mean chunk, a lower
bound on its largest), so

    flops  = (2 * (active_params - attention_params) * new_tokens) / tp
           + max(s * (2 * attention_params * new_tokens + attention FLOPs), the chunk's)
    bytes  = (weight_bytes_read - attention_bytes) / tp + attention_bytes + max(s * KV bytes, the chunk's)

and the attention all-reduce of every layer goes: the MLP of each layer gathers the ranks' tokens and
scatters them back (an all-gather and a reduce-scatter, an all-reduce's bytes) or, with ``ep = tp``,
sends them to their experts (the all-to-alls above).

The factors come one set per engine era (``ENGINE_ERAS``; docs/engine.md, "Engine eras"): era 2025
(``FACTORS_2025``, engines of 2025-26), the default (``DEFAULT_ERA``, ``DEFAULT_FACTORS``), and era
2024 (``FACTORS_2024``, engines of 2023-24; ``record --engine-era 2024``, and the era the traces under
``traces/`` were recorded at). Era 2025's factors add four terms, 0, 0, 1 and 0 in era 2024: a fixed
``moe_layer_us`` per MoE layer per step (router, token sort and padding, grouped-GEMM launches) and
``moe_expert_us`` per MoE layer per routed expert a token goes to (top-k: the top-k selection, the
permute and weighted combine of k outputs per token, and at small batch k separate small expert
GEMMs whose weight reads stay below streaming bandwidth),
``moe_mfu_scale``, the routed experts' grouped GEMMs' compute efficiency relative to the dense
GEMMs': their FLOPs (``expert_flops``) count ``1 / moe_mfu_scale`` times in the compute term, and a
fixed ``mla_layer_us`` per MLA layer per step (multi-head latent attention runs more, smaller
kernels per layer than grouped-query attention: the low-rank query and KV projections with their
norms, the absorbed key and value matmuls, the FP8 block quantisations before each GEMM).

Bus bandwidths and latencies are the GPU preset's (``gpus.py``): inside the scale-up domain
(NVLink, NVSwitch, Infinity Fabric or PCIe), over the scale-out NIC beyond ``node_gpus`` ranks.

Prefill steps and decode steps have their own factors (``mfu``, ``mbu``, ``overhead_us`` and
``decode_mfu``, ``decode_mbu``, ``decode_overhead_us``); a mixed step (chunked prefill with
decodes) blends them by its share of decode tokens: ``1/mfu = (1-f)/mfu_prefill + f/mfu_decode``,
the same for ``mbu``, and the overhead ``(1-f) o_prefill + f o_decode``.

A timing with ``tp = 0`` is the model of traces recorded before parallelism was modelled:
``gpus`` multiplies peak and bandwidth, no collectives, one set of factors (analysis.timing_from_meta
rebuilds old traces so).

Peak figures are vendor datasheets (dense, without sparsity; ``gpus.py``), at the compute dtype:
the weight dtype's, where the GPU has tensor cores for it (FP8 weights on an A100 compute in bf16).
The KV dtype is separate (``ModelGeometry.kv_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar

import numpy as np

from ..bounds import FACTOR_BOUNDS, WEIGHT_DTYPE_BYTES
from ..errors import ConfigError
from ..units import check_number, number_problem
from ..models import ModelGeometry
from .gpus import GPU_ALIASES, GPU_PRESETS, GpuSpec, get_gpu

__all__ = ["ROOFLINE_PARAMS", "validate_roofline_params", "GPU_ALIASES", "GPU_PRESETS", "DEFAULT_ERA", "check_dp_attention", "DEFAULT_FACTORS", "ENGINE_ERAS", "era_of", "FACTORS_2024", "FACTORS_2025", "era_factors", "ROOFLINE_P", "GpuTiming", "auto_gpu_count", "get_gpu", "make_timing",
           "split_gpus"]

#: Bytes per activation value in the collectives (16-bit: FP8 W8A8 GEMMs also write 16-bit outputs).
ACT_BYTES = 2

#: Era 2024's fitted efficiency factors (tools/fit_engine.py over the points of tools/engine_fit/points.csv
#: version 2; docs/engine.md, "Validation against published measurements"): prefill steps, decode steps.
FACTORS_2024 = {
    "mfu": 0.763, "mbu": 0.327, "overhead_us": 0.0,
    "decode_mfu": 0.391, "decode_mbu": 0.850, "decode_overhead_us": 4072.0,
    "fp8_mfu_scale": 0.479,
}
#: Era 2025's factors (tools/fit_engine.py --era 2025 over the points of 2025-26 engines; docs/engine.md,
#: "Engine eras"), with the four terms era 2024 has not: ``moe_layer_us``, a fixed time per MoE layer
#: per step, ``moe_expert_us``, a fixed time per routed expert (top-k) per MoE layer per step,
#: ``moe_mfu_scale``, the routed experts' compute efficiency relative to the dense GEMMs', and
#: ``mla_layer_us``, a fixed time per MLA layer per step (the three fixed times fitted together after
#: the first stage, with the other seven held).
#: Its FP8 scale is at least 0.5 (an FP8 step is never slower than the same step in BF16) and its
#: overheads at most era 2024's decode overhead.
FACTORS_2025 = {
    "mfu": 0.857, "mbu": 0.599, "overhead_us": 884.0,
    "decode_mfu": 0.488, "decode_mbu": 0.697, "decode_overhead_us": 0.0,
    "fp8_mfu_scale": 0.610, "moe_layer_us": 23.5, "moe_expert_us": 4.3, "moe_mfu_scale": 0.2248,
    "mla_layer_us": 28.4,
}
#: Era 2025's terms beyond the roofline's factors, at their neutral values (era 2024 and traces recorded
#: before them: none of their cost). ``to_dict`` leaves a term out at its neutral value.
ERA_TERMS = {"moe_layer_us": 0.0, "moe_expert_us": 0.0, "moe_mfu_scale": 1.0, "mla_layer_us": 0.0}
#: Named factor sets, one per engine era (docs/engine.md, "Engine eras"): "2024", engines of 2023-24
#: (TensorRT-LLM 0.5-0.7, lmdeploy 0.1, vLLM before CUDA-graph decode), fitted to the points of
#: tools/engine_fit/points.csv version 2 (P01-P51); "2025", engines of 2025-26 (vLLM, SGLang, NIM /
#: TensorRT-LLM), fitted to the points whose ``era`` column is 2025.
ENGINE_ERAS = {"2024": FACTORS_2024, "2025": FACTORS_2025}
#: The era ``record`` models unless ``--engine-era`` says otherwise: today's engines.
DEFAULT_ERA = "2025"
#: The factors of the default era.
DEFAULT_FACTORS = ENGINE_ERAS[DEFAULT_ERA]


def era_factors(era: str | None) -> dict:
    """The factor set of engine era ``era`` (None: :data:`DEFAULT_ERA`); ConfigError for an unknown one."""
    era = DEFAULT_ERA if era is None else era
    if era not in ENGINE_ERAS:
        raise ConfigError(f"--engine-era: unknown engine era {era!r} (known: {', '.join(ENGINE_ERAS)})")
    return dict(ENGINE_ERAS[era])


def era_of(gpu_meta: dict) -> str | None:
    """The engine era whose factors a trace's ``gpu`` metadata (``GpuTiming.to_dict``) carries: the
    era all of whose factors it has, on the soft roofline (``roofline_p`` :data:`ROOFLINE_P`); None
    for other factors (``--mfu``, ``--mbu``, ``--step-overhead-us``, or a trace recorded before the
    eras). An absent MoE or MLA term is its neutral value, as ``to_dict`` leaves it out."""
    if gpu_meta.get("roofline_p") != ROOFLINE_P:
        return None
    neutral = ERA_TERMS
    for era, factors in ENGINE_ERAS.items():
        have = {k: gpu_meta.get(k, neutral.get(k)) for k in {*factors, *neutral}}
        want = {**neutral, **factors}
        if all(isinstance(have[k], (int, float)) and abs(have[k] - want[k]) <= 1e-9 * max(1.0, abs(want[k]))
               for k in want):
            return era
    return None


#: The soft roofline's exponent (module docstring): 2, the step's compute and HBM terms add as the
#: sides of a right triangle; fixed, not fitted (0: the plain maximum of older traces).
ROOFLINE_P = 2.0
#: The longest modelled step: a day of GPU time. No real step comes near it (seconds at most); a
#: longer one comes from figures no GPU has (a trace's metadata, validated but extreme), and a
#: timeline of such steps would leave kvemu's int64 nanosecond clock.
MAX_STEP_NS = 86_400 * 10**9


def step_time(ns: float) -> int:
    """A modelled step time as whole nanoseconds; ConfigError when it is not a number from 0 to
    MAX_STEP_NS."""
    if not 0 <= ns <= MAX_STEP_NS:
        raise ConfigError(f"the modelled GPU time of one step is {ns / 1e9:.3g} s, more than a day: the GPU "
                          f"figures (peak TFLOP/s, HBM and link GB/s, efficiency factors) are too small for the model")
    return int(ns)


@dataclass(frozen=True)
class GpuTiming:
    """The roofline compute model (module docstring; engine/compute.py ``ComputeModel``): its fitted
    terms are its parameters (:data:`ROOFLINE_PARAMS`), the rest its GPUs, model and parallelism."""

    name: ClassVar[str] = "roofline"
    model_version: ClassVar[int] = 1

    gpu: GpuSpec
    gpus: int
    model: ModelGeometry
    weight_dtype: str = "bf16"
    mfu: float = 0.5  # prefill steps' (all steps' when the decode factors are None)
    mbu: float = 0.7
    overhead_us: float = 300.0
    memory_utilization: float = 0.9
    compute_dtype: str | None = None  # None: what the GPU computes weights of weight_dtype in
    # weight bytes that live in the KV tier and are streamed per step (engine/weights.py); not in HBM
    tier_weight_bytes: int = 0
    # parallelism: tp = 0 is the model before it (gpus divide both roofline terms, no collectives)
    tp: int = 0
    pp: int = 1
    ep: int = 1
    # decode steps' factors; None: the prefill ones
    decode_mfu: float | None = None
    decode_mbu: float | None = None
    decode_overhead_us: float | None = None
    # compute efficiency of FP8 GEMMs relative to 16-bit ones (both phases); 1: the same
    fp8_mfu_scale: float = 1.0
    # the roofline's exponent: 0 is max(compute, HBM), p > 0 their p-norm (module docstring)
    roofline_p: float = 0.0
    # fixed time per MoE layer per step (routing, token permutation and the grouped expert GEMMs'
    # launches; engine era 2025, docs/engine.md "Engine eras"); 0: none (era 2024, older traces)
    moe_layer_us: float = 0.0
    # fixed time per routed expert a token is sent to (top-k), per MoE layer per step (top-k selection,
    # permute and weighted combine of k outputs, k small expert GEMMs at small batch; era 2025); 0: none
    moe_expert_us: float = 0.0
    # compute efficiency of the routed experts' grouped GEMMs relative to the dense GEMMs (era 2025); 1: the same
    moe_mfu_scale: float = 1.0
    # fixed time per MLA layer per step (multi-head latent attention's extra small kernels; era 2025);
    # 0: none (era 2024, older traces)
    mla_layer_us: float = 0.0
    # data-parallel attention over the tp ranks (module docstring); False: attention tensor-parallel
    dp_attention: bool = False

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

    @property
    def attention_bytes(self) -> int:
        """Bytes of the attention blocks' weights (what data-parallel attention holds whole on every
        rank); 0 without data-parallel attention, where nothing needs them apart."""
        if not self.dp_attention:
            return 0
        return (self.model.attention_weight_params or 0) * WEIGHT_DTYPE_BYTES[self.weight_dtype]

    @property
    def kv_shards(self) -> int:
        """Ranks the KV cache is split over: the KV heads over the tensor-parallel ranks (GQA; a head
        is replicated when tp exceeds the KV heads), none for MLA (its latent is on every rank); with
        data-parallel attention every rank, each holding its own requests' KV."""
        if self.tp <= 0:
            return self.gpus
        if self.dp_attention:
            return self.tp
        return max(1, min(self.tp, self.model.kv_heads)) if self.model.kv_heads else 1

    def attention_share(self, requests: int) -> float:
        """With data-parallel attention, the busiest rank's share of a step's attention work (its
        FLOPs and KV reads): ``ceil(R / tp) / R`` of the step's R requests, ``1 / tp`` when R is not
        given (0)."""
        if requests <= 0:
            return 1.0 / self.tp
        return -(-requests // self.tp) / requests

    @property
    def kv_links(self) -> int:
        """Host links a block's KV moves over in parallel: each rank moves its own share of the heads
        (and each pipeline stage its layers) over its own link. MLA's replicated latent gains nothing
        from tensor parallelism: every rank moves the whole of it; nor does data-parallel attention,
        where a request's blocks are one rank's (other requests' move over the other ranks' links,
        which this one figure leaves out: a lower bound on the instance's aggregate)."""
        if self.dp_attention:
            return self.pp
        return self.kv_shards * (self.pp if self.tp > 0 else 1)

    def hbm_kv_bytes(self) -> int:
        """KV capacity: the memory share vLLM would get (gpu_memory_utilization) minus the weights
        resident in HBM (those placed in the tier free their bytes for KV)."""
        total = self.gpus * self.gpu.memory_gb * 1e9 * self.memory_utilization
        # data-parallel attention: every rank of a pipeline stage holds its layers' attention weights whole
        kv = int(total - self.hbm_weight_bytes - self.attention_bytes * (self.tp - 1))
        # KV replicated over the tensor-parallel ranks (MLA; GQA with fewer KV heads than ranks) holds
        # fewer distinct tokens
        return kv * self.kv_shards // self.tp if self.tp > self.kv_shards and kv > 0 else kv

    @staticmethod
    def weight_stream_ns(nbytes: int, link_gbps: float) -> float:
        """Time to stream ``nbytes`` of weights over a host link of ``link_gbps`` GB/s (bytes per ns)."""
        return nbytes / link_gbps if link_gbps > 0 else 0.0

    def factors(self, decode_share: float = 0.0) -> tuple[float, float, float]:
        """(mfu, mbu, overhead_us) of a step whose new tokens are ``decode_share`` decode tokens."""
        dm = self.mfu if self.decode_mfu is None else self.decode_mfu
        db = self.mbu if self.decode_mbu is None else self.decode_mbu
        do = self.overhead_us if self.decode_overhead_us is None else self.decode_overhead_us
        f = min(1.0, max(0.0, decode_share))
        if f == 0.0:
            return self.mfu, self.mbu, self.overhead_us
        if f == 1.0:
            return dm, db, do
        return (1.0 / ((1 - f) / self.mfu + f / dm), 1.0 / ((1 - f) / self.mbu + f / db),
                (1 - f) * self.overhead_us + f * do)

    def _link(self, ranks: int) -> tuple[float, float]:
        """(bus bandwidth bytes/ns, latency ns) of a collective over ``ranks`` GPUs of the instance."""
        g = self.gpu
        if ranks <= g.node_gpus:
            return g.allreduce_busbw_gbps, g.collective_us * 1e3
        return g.scaleout_busbw_gbps, g.scaleout_us * 1e3

    def comm_ns(self, new_tokens: int) -> float:
        """The collectives of one step: tensor-parallel all-reduces, expert-parallel all-to-alls,
        pipeline sends (module docstring)."""
        if self.tp <= 0 or new_tokens <= 0:
            return 0.0
        m = self.model
        act = float(new_tokens) * m.hidden_size * ACT_BYTES
        t = 0.0
        moe_layers = m.moe_layers if self.ep > 1 else 0
        if self.tp > 1:
            bw, lat = self._link(self.tp)
            one = 2.0 * (self.tp - 1) / self.tp * act / bw + lat
            # attention's all-reduce of every layer, unless data-parallel; the MLP's (or its gather and
            # scatter) of every layer whose experts are not expert-parallel
            t += one * ((0 if self.dp_attention else m.layers) + m.layers - moe_layers)
        if moe_layers:
            bw, lat = self._link(self.ep)
            per_rank = act * m.experts_per_token * (self.ep - 1) / self.ep / self.ep
            t += 2.0 * (per_rank / bw + lat) * moe_layers
        if self.pp > 1:
            bw, lat = self._link(self.tp * self.pp)
            t += (self.pp - 1) * (act / bw + lat)
        return t

    def weights_read(self, new_tokens: int) -> float:
        """Parameters a step reads: all of a dense model; of a MoE model the dense part and, per MoE
        layer, the experts its tokens are routed to, ``E (1 - (1 - k/E)^T)`` of the E experts in
        expectation when T tokens each pick k uniformly (all of them for large batches)."""
        m = self.model
        if not m.moe_layers or m.experts <= m.experts_per_token:
            return float(min(m.params, m.active_params * max(1, new_tokens))) if m.params != m.active_params \
                else float(m.params)
        e, k = m.experts, m.experts_per_token
        expert = (m.params - m.active_params) / (m.moe_layers * (e - k))
        touched = e * (1.0 - (1.0 - k / e) ** max(1, new_tokens))
        return m.active_params + m.moe_layers * (touched - k) * expert

    def expert_flops(self, new_tokens: int) -> float:
        """FLOPs of a step's routed experts: per MoE layer, each token's top-k experts (0 for a dense
        model): the part of ``2 x active_params x new_tokens`` that runs as grouped expert GEMMs."""
        m = self.model
        if not m.moe_layers or m.experts <= m.experts_per_token:
            return 0.0
        e, k = m.experts, m.experts_per_token
        expert = (m.params - m.active_params) / (m.moe_layers * (e - k))
        return 2.0 * new_tokens * m.moe_layers * k * expert

    def attention_flops(self, attn_token_pairs: float) -> float:
        """FLOPs of the attention scores and weighted values over ``attn_token_pairs`` (query, key)
        pairs per layer: ``2 x layers x heads x (qk_head_dim + v_head_dim)`` a pair."""
        m = self.model
        return 2.0 * m.layers * m.attention_heads * (m.qk_head_dim + m.v_head_dim) * attn_token_pairs

    def roofline_ns(self, new_tokens: int, attn_token_pairs: float, kv_tokens_touched: int,
                    requests: int = 0, chunk: tuple[float, float, float] | None = None) -> tuple[float, float]:
        """The compute and HBM terms of a step at efficiency 1 (ns); the routed experts' FLOPs count
        ``1 / moe_mfu_scale`` times (their grouped GEMMs' lower efficiency). For data-parallel
        attention's busiest rank: ``requests``, the step's requests (decodes and prefill chunks; 0: an
        even split), and ``chunk``, the (new tokens, attention pairs, KV tokens touched) of its mean
        prefill chunk, which runs on one rank whole (None: no chunk)."""
        m = self.model
        attn = self.attention_flops(attn_token_pairs)
        if self.dp_attention and self.tp > 0:
            return self._dp_roofline_ns(new_tokens, attn, kv_tokens_touched, requests, chunk)
        flops = 2.0 * m.active_params * new_tokens + attn
        if self.moe_mfu_scale != 1.0 and self.tp > 0:
            flops += self.expert_flops(new_tokens) * (1.0 / self.moe_mfu_scale - 1.0)
        kvbytes = m.kv_bytes_per_token * kv_tokens_touched
        if self.tp > 0:
            wbytes = self.weights_read(new_tokens) * WEIGHT_DTYPE_BYTES[self.weight_dtype]
        else:
            wbytes = min(m.params, m.active_params * max(1, new_tokens)) * WEIGHT_DTYPE_BYTES[self.weight_dtype]
        if self.tp <= 0:
            return (flops / (self.gpus * self.peak_tflops * 1e3),
                    (wbytes + kvbytes) / (self.gpus * self.gpu.hbm_gbps))
        return (flops / (self.tp * self.peak_tflops * 1e3),
                (wbytes / self.tp + kvbytes / self.kv_shards) / self.gpu.hbm_gbps)

    def _dp_roofline_ns(self, new_tokens: int, attn_flops: float, kv_tokens_touched: int, requests: int,
                        chunk: tuple[float, float, float] | None) -> tuple[float, float]:
        """``roofline_ns`` with data-parallel attention (module docstring): the busiest rank's, which has
        ``attention_share`` of the step's attention work, and at least a whole prefill chunk's."""
        m = self.model
        s = self.attention_share(requests)
        attn_params = float(m.attention_weight_params or 0)
        rank_attn = s * (2.0 * attn_params * new_tokens + attn_flops)
        rank_kv = s * kv_tokens_touched
        if chunk is not None:
            n, pairs, touched = chunk
            rank_attn = max(rank_attn, 2.0 * attn_params * n + self.attention_flops(pairs))
            rank_kv = max(rank_kv, touched)
        flops = 2.0 * (m.active_params - attn_params) * new_tokens / self.tp + rank_attn
        if self.moe_mfu_scale != 1.0:
            flops += self.expert_flops(new_tokens) * (1.0 / self.moe_mfu_scale - 1.0) / self.tp
        wbytes = self.weights_read(new_tokens) * WEIGHT_DTYPE_BYTES[self.weight_dtype]
        abytes = float(self.attention_bytes)
        nbytes = (wbytes - abytes) / self.tp + abytes + m.kv_bytes_per_token * rank_kv
        return flops / (self.peak_tflops * 1e3), nbytes / self.gpu.hbm_gbps

    def step_ns(self, new_tokens: int, attn_token_pairs: float, kv_tokens_touched: int,
                decode_tokens: int = 0, decode_context_tokens: int = 0, prefill_chunks: int = 0,
                prefill_prefix_tokens: int = 0) -> int:
        """Modelled GPU time of one step.

        new_tokens: sum_r n_r; attn_token_pairs: sum_r n_r * (c_r + (n_r + 1) / 2);
        kv_tokens_touched: sum_r (c_r + n_r); decode_tokens: how many of the new tokens are decode
        tokens (one per decoding request), which chooses the factors; prefill_chunks and
        prefill_prefix_tokens: the prefill requests in the step and the tokens they have cached, for
        data-parallel attention's busiest rank (the step's request count, its mean chunk). The
        decodes' attended tokens are for other compute models (engine/compute.py).
        """
        mfu, mbu, overhead = self.factors(decode_tokens / new_tokens if new_tokens > 0 else 0.0)
        chunk = None
        if self.dp_attention and prefill_chunks > 0 and new_tokens > decode_tokens:
            # the mean prefill chunk (its new tokens on its cached ones), on one rank whole
            n = (new_tokens - decode_tokens) / prefill_chunks
            c = prefill_prefix_tokens / prefill_chunks
            pairs, touched = self.model.step_equivalents(int(c), max(1, int(n)))
            chunk = (n, pairs, touched)
        tc, tm = self.roofline_ns(new_tokens, attn_token_pairs, kv_tokens_touched, decode_tokens + prefill_chunks,
                                  chunk)
        if self.tp <= 0:
            return self._legacy_step_ns(new_tokens, attn_token_pairs, kv_tokens_touched)
        if self.compute == "fp8":
            mfu = mfu * self.fp8_mfu_scale
        return step_time(self.combine(tc / mfu, tm / mbu) + self.comm_ns(new_tokens) + overhead * 1e3
                         + self.moe_ns() + self.mla_ns())

    def decode_steps_ns(self, decodes: int, attended: np.ndarray) -> np.ndarray | None:
        """``step_ns`` of steps that are ``decodes`` decodes and nothing else, step ``j``'s decodes
        attending to ``attended[j]`` tokens together (each its context and its new token), for many
        steps at once (int64 ns): the same arithmetic in the same order, element by element, so each
        is what ``step_ns(decodes, float(a), a, decodes, a)`` returns. None where it does not apply
        (data-parallel attention, the legacy model; a KV byte count past float64's exact integers)."""
        if self.dp_attention or self.tp <= 0 or not decodes:
            return None
        a = np.asarray(attended, np.int64)
        if len(a) and int(a.max()) * self.model.kv_bytes_per_token >= 1 << 53:
            return None
        mfu, mbu, overhead = self.factors(decodes / decodes)
        tc, tm = self.roofline_ns(decodes, a.astype(np.float64), a, decodes, None)
        if self.compute == "fp8":
            mfu = mfu * self.fp8_mfu_scale
        combine = self.combine
        ns = np.array([combine(c, m) for c, m in zip((tc / mfu).tolist(), (tm / mbu).tolist())], np.float64)
        ns = ns + self.comm_ns(decodes) + overhead * 1e3 + self.moe_ns() + self.mla_ns()
        if len(ns) and not (0 <= ns.min() and ns.max() <= MAX_STEP_NS):
            return None  # step_ns says what is wrong
        return ns.astype(np.int64)

    def moe_ns(self) -> float:
        """The MoE layers' fixed time per step: ``moe_layer_us`` plus ``moe_expert_us`` per routed expert a
        token is sent to (``experts_per_token``), per MoE layer (0 for dense models and for factor sets
        without the terms)."""
        per_layer = self.moe_layer_us + self.moe_expert_us * self.model.experts_per_token
        return per_layer * 1e3 * self.model.moe_layers if per_layer else 0.0

    def mla_ns(self) -> float:
        """The MLA layers' fixed time per step: ``mla_layer_us`` per layer of multi-head latent attention
        (0 for grouped-query attention and for factor sets without the term)."""
        return self.mla_layer_us * 1e3 * self.model.mla_layers if self.mla_layer_us else 0.0

    def combine(self, compute_ns: float, hbm_ns: float) -> float:
        """The step's GPU time from its compute and HBM terms: their maximum (``roofline_p`` 0) or
        their ``roofline_p``-norm."""
        p = self.roofline_p
        if p <= 0:
            return max(compute_ns, hbm_ns)
        try:
            return (compute_ns ** p + hbm_ns ** p) ** (1.0 / p)
        except OverflowError:  # a step beyond any clock: step_time refuses it
            return float("inf")

    def _legacy_step_ns(self, new_tokens: int, attn_token_pairs: float, kv_tokens_touched: int) -> int:
        """The model of traces from before parallelism, to its arithmetic (closed-loop replay of an old
        trace must schedule its recorded steps again to the nanosecond)."""
        m = self.model
        flops = 2.0 * m.active_params * new_tokens + self.attention_flops(attn_token_pairs)
        wbytes = min(m.params, m.active_params * max(1, new_tokens)) * WEIGHT_DTYPE_BYTES[self.weight_dtype]
        nbytes = wbytes + m.kv_bytes_per_token * kv_tokens_touched
        t_compute = flops / (self.gpus * self.peak_tflops * 1e12 * self.mfu)
        t_memory = nbytes / (self.gpus * self.gpu.hbm_gbps * 1e9 * self.mbu)
        return step_time(max(t_compute, t_memory) * 1e9 + self.overhead_us * 1e3)

    # ------------------------------------------------------------------ the ComputeModel interface
    def params(self) -> dict:
        """The roofline's parameters, as ``to_dict`` writes them: the phases' and era 2025's terms
        only where the timing models parallelism and, for the era terms, not at their neutral value."""
        d = self.to_dict()
        return {k: d[k] for k in ROOFLINE_PARAMS if k in d}

    def describe(self) -> str:
        era = era_of(self.to_dict())
        if era is not None:
            return f"the fitted roofline at engine era {era}'s factors"
        if self.tp > 0 and self.roofline_p == ROOFLINE_P:
            return "the fitted roofline at factors of no named era"
        return "the roofline of traces recorded before the engine eras"

    @classmethod
    def validate(cls, params) -> None:
        """ConfigError, one line naming the parameter, unless ``params`` are roofline parameters
        (:data:`ROOFLINE_PARAMS`): known names, numbers in their bounds, the required ones present."""
        validate_roofline_params(params)

    @classmethod
    def from_params(cls, params: dict, base: "GpuTiming", **context) -> "GpuTiming":
        """``base`` (the GPUs, model and parallelism) at the roofline parameters ``params``; one
        absent takes its field's default (the model of traces recorded before the term)."""
        validate_roofline_params(params)
        defaults = {f.name: f.default for f in fields(cls) if f.name in ROOFLINE_PARAMS}
        return replace(base, **{**defaults, **params})

    @classmethod
    def from_option(cls, spec, timing: "GpuTiming", model_spec: str, kv_dtype: str) -> "GpuTiming":
        """``--compute roofline``: the timing itself (engine/compute.py)."""
        if spec.backend is not None:
            raise ConfigError(f"--compute {spec}: the roofline takes no backend (give --compute roofline)")
        return timing

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
            **({"tp": self.tp, "pp": self.pp, "ep": self.ep, "decode_mfu": self.decode_mfu,
                "decode_mbu": self.decode_mbu, "decode_overhead_us": self.decode_overhead_us,
                "fp8_mfu_scale": self.fp8_mfu_scale, "roofline_p": self.roofline_p,
                "kv_shards": self.kv_shards, "kv_links": self.kv_links} if self.tp > 0 else {}),
            **({"moe_layer_us": self.moe_layer_us} if self.tp > 0 and self.moe_layer_us else {}),
            **({"moe_expert_us": self.moe_expert_us} if self.tp > 0 and self.moe_expert_us else {}),
            **({"moe_mfu_scale": self.moe_mfu_scale} if self.tp > 0 and self.moe_mfu_scale != 1.0 else {}),
            **({"mla_layer_us": self.mla_layer_us} if self.tp > 0 and self.mla_layer_us else {}),
            **({"dp_attention": True, "attention_bytes": self.attention_bytes} if self.dp_attention else {}),
        }


def auto_gpu_count(gpu: GpuSpec, model: ModelGeometry, weight_dtype: str) -> int:
    """Smallest power of two whose HBM holds the weights in at most half of it (rest for KV)."""
    weights = model.params * WEIGHT_DTYPE_BYTES[weight_dtype]
    n = 1
    while weights > 0.5 * n * gpu.memory_gb * 1e9:
        n *= 2
    return n


def split_gpus(gpus: int, spec: GpuSpec, model: ModelGeometry) -> tuple[int, int]:
    """(tp, pp) for ``gpus`` GPUs given alone, as vLLM's docs advise: tensor parallelism inside a node
    (at most ``node_gpus``, a divisor of the attention heads), pipeline stages across nodes."""
    for tp in range(min(gpus, spec.node_gpus), 0, -1):
        if gpus % tp == 0 and model.attention_heads % tp == 0:
            return tp, gpus // tp
    return 1, gpus


def _parallelism(spec: GpuSpec, model: ModelGeometry, weight_dtype: str, gpus, tp, pp, ep) -> tuple[int, int, int]:
    for v, name in ((gpus, "--gpus"), (tp, "--tp"), (pp, "--pp"), (ep, "--ep")):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(f"{name} must be a whole number >= 1, got {v!r}")
    pp_given = pp is not None
    if tp is None and pp is None:
        n = gpus if gpus is not None else auto_gpu_count(spec, model, weight_dtype)
        tp, pp = split_gpus(n, spec, model)
    elif tp is None:
        if gpus is not None and gpus % pp:
            raise ConfigError(f"--gpus {gpus} is not a multiple of --pp {pp}")
        tp = gpus // pp if gpus is not None else split_gpus(auto_gpu_count(spec, model, weight_dtype), spec, model)[0]
    elif pp is None:
        if gpus is not None and gpus % tp:
            raise ConfigError(f"--gpus {gpus} is not a multiple of --tp {tp}")
        pp = gpus // tp if gpus is not None else 1
    if gpus is not None and gpus != tp * pp:
        raise ConfigError(f"--gpus {gpus} contradicts --tp {tp} x --pp {pp} = {tp * pp} GPUs per instance")
    if model.attention_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide {model.name}'s {model.attention_heads} attention heads")
    if pp > model.layers:
        if pp_given:
            raise ConfigError(f"--pp {pp} exceeds {model.name}'s {model.layers} layers")
        # name only what the user gave: without --gpus the count is the one the weights need
        who = f"--gpus {gpus}" if gpus is not None else \
            f"the {tp * pp} {spec.name} GPUs {model.name}'s weights need (no --gpus given)"
        raise ConfigError(f"{who} would need {pp} pipeline stages of tp {tp}, more than {model.name}'s "
                          f"{model.layers} layers")
    ep = 1 if ep is None else ep
    if ep > 1:
        if not model.moe_layers:
            raise ConfigError(f"--ep {ep}: {model.name} has no experts (expert parallelism needs a MoE model)")
        if ep != tp:
            raise ConfigError(f"--ep {ep} must equal --tp {tp} (experts split over the tensor-parallel ranks, "
                              "as vLLM's --enable-expert-parallel does without data-parallel attention)")
        if model.experts % ep:
            raise ConfigError(f"--ep {ep} does not divide {model.name}'s {model.experts} experts")
    return tp, pp, ep


#: The roofline's parameters (``GpuTiming``'s fitted terms), each -> (low, high, required). The
#: bounds are those of the options that set them (``FACTOR_BOUNDS``): the decode factors may be
#: null (traces from before the phases: the prefill ones), ``roofline_p`` is 0 or 1 to 8.
ROOFLINE_P_MAX = 8.0
_MFU, _OVH = FACTOR_BOUNDS["mfu"], FACTOR_BOUNDS["overhead_us"]
ROOFLINE_PARAMS = {
    "mfu": (*_MFU, True), "mbu": (*FACTOR_BOUNDS["mbu"], True), "overhead_us": (*_OVH, True),
    "decode_mfu": (*_MFU, False), "decode_mbu": (*FACTOR_BOUNDS["mbu"], False), "decode_overhead_us": (*_OVH, False),
    "fp8_mfu_scale": (_MFU[0], 1.0, False), "roofline_p": (0.0, ROOFLINE_P_MAX, False),
    "moe_layer_us": (*_OVH, False), "moe_expert_us": (*_OVH, False), "moe_mfu_scale": (_MFU[0], 1.0, False),
    "mla_layer_us": (*_OVH, False),
}
assert set(ERA_TERMS) <= set(ROOFLINE_PARAMS)


def validate_roofline_params(params) -> None:
    """ConfigError, one line naming the parameter, unless ``params`` are roofline parameters
    (:data:`ROOFLINE_PARAMS`): known names, numbers in their bounds, the three required ones present."""
    if not isinstance(params, dict):
        raise ConfigError(f"compute.params must be a mapping of the roofline's parameters, got {type(params).__name__}")
    for k in params:
        if k not in ROOFLINE_PARAMS:
            raise ConfigError(f"compute.params.{k}: not a roofline parameter (known: {', '.join(ROOFLINE_PARAMS)})")
    for k, (lo, hi, required) in ROOFLINE_PARAMS.items():
        if k not in params:
            if required:
                raise ConfigError(f"compute.params.{k}: missing (the roofline needs {k})")
            continue
        v = params[k]
        if v is None and not required and k.startswith("decode_"):
            continue
        why = number_problem(v, lo, hi)
        if why:
            raise ConfigError(f"compute.params.{k} {why}")
        if k == "roofline_p" and 0 < v < 1:
            raise ConfigError(f"compute.params.roofline_p must be 0 (the plain maximum) or from 1 to "
                              f"{ROOFLINE_P_MAX:g}, got {v:g}")



def make_timing(
    gpu: str,
    model: ModelGeometry,
    gpus: int | None = None,
    weight_dtype: str = "bf16",
    mfu: float | None = None,
    mbu: float | None = None,
    overhead_us: float | None = None,
    *,
    tp: int | None = None,
    pp: int | None = None,
    ep: int | None = None,
    factors: dict | None = None,
    era: str | None = None,
    dp_attention: bool = False,
) -> GpuTiming:
    """The timing of ``model`` on ``gpu``. ``gpus`` is the instance's total (tp x pp); given alone it
    is split as :func:`split_gpus` does; none of the three: :func:`auto_gpu_count`. ``mfu``, ``mbu``
    and ``overhead_us`` override both phases' factors; ``factors`` replaces the factors of engine era
    ``era`` (:func:`era_factors`; None: :data:`DEFAULT_ERA`), and both together are refused.
    ``dp_attention``: the attention layers data-parallel over the tensor-parallel ranks (module
    docstring; ``--dp-attention``)."""
    if factors is not None and era is not None:
        raise ConfigError("give factors or an engine era, not both")
    spec = get_gpu(gpu)
    if weight_dtype not in WEIGHT_DTYPE_BYTES:
        raise ConfigError(f"unknown weight dtype '{weight_dtype}' (known: {', '.join(WEIGHT_DTYPE_BYTES)})")
    f = era_factors(era) if factors is None else dict(factors)
    for given, keys in ((mfu, ("mfu", "decode_mfu")), (mbu, ("mbu", "decode_mbu")),
                        (overhead_us, ("overhead_us", "decode_overhead_us"))):
        if given is not None:
            f.update(dict.fromkeys(keys, given))
    for k in ("mfu", "decode_mfu"):
        check_number(f[k], "--mfu", *FACTOR_BOUNDS["mfu"])
    for k in ("mbu", "decode_mbu"):
        check_number(f[k], "--mbu", *FACTOR_BOUNDS["mbu"])
    for k in ("overhead_us", "decode_overhead_us"):
        check_number(f[k], "--step-overhead-us", *FACTOR_BOUNDS["overhead_us"])
    fp8_scale = float(f.get("fp8_mfu_scale", FACTORS_2024["fp8_mfu_scale"]))  # older traces: era 2024's
    # era 2025's terms (absent: neutral); the fixed times have the overheads' bounds, the scale mfu's
    terms = {k: float(f.get(k, neutral)) for k, neutral in ERA_TERMS.items()}
    for k, v in terms.items():
        check_number(v, k, *FACTOR_BOUNDS["mfu" if k == "moe_mfu_scale" else "overhead_us"])
    tp, pp, ep = _parallelism(spec, model, weight_dtype, gpus, tp, pp, ep)
    if dp_attention:
        check_dp_attention(model, tp)
    return GpuTiming(spec, tp * pp, model, weight_dtype, f["mfu"], f["mbu"], f["overhead_us"],
                     compute_dtype=spec.compute_dtype(weight_dtype), tp=tp, pp=pp, ep=ep,
                     decode_mfu=f["decode_mfu"], decode_mbu=f["decode_mbu"],
                     decode_overhead_us=f["decode_overhead_us"], fp8_mfu_scale=fp8_scale,
                     roofline_p=ROOFLINE_P, dp_attention=bool(dp_attention), **terms)


def check_dp_attention(model: ModelGeometry, tp: int) -> None:
    """ConfigError unless data-parallel attention can be modelled for ``model`` at ``tp``: two ranks
    or more, and the attention blocks' weights known (every rank holds them whole)."""
    if tp < 2:
        raise ConfigError(f"--dp-attention needs --tp 2 or more (the attention layers are data-parallel over "
                          f"the tensor-parallel ranks), got tp {tp}")
    if model.attention_weight_params is None:
        raise ConfigError(f"--dp-attention: {model.name}'s attention weights are not known (an MLA model "
                          "recorded without model.attention_params): give --model a preset or config.json")
