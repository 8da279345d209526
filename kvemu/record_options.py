"""The options of :func:`kvemu.recording.record`, grouped as `kvemu record` groups its flags.

Each group is a frozen dataclass whose defaults are `kvemu record`'s; ``None`` means "derived"
(from the model, the GPU or the workload, as each field says). :meth:`RecordOptions.check`
validates what can be validated without the model and the workload, and raises
:class:`kvemu.errors.OptionError` naming the field by its dotted name (``"engine.chunk_tokens"``);
what needs them (the HBM left for KV, tensor parallelism dividing the heads, ...) is checked when
the recording reads them. Each class's docstring documents its fields: meaning, unit, default.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .bounds import DEFAULT_TIER_EVICTION, FACTOR_BOUNDS, MAX_BATCHED_TOKENS, MAX_CHUNK_BLOCKS, MAX_NUM_SEQS, STREAMS, tier_eviction_problem, \
    time_scale_problem
from .deployment import DEFAULT_ROUTING, DEFAULT_TRANSFER, ROUTING, check_deployment
from .engine import TIER_POLICIES
from .engine.compute import parse_compute
from .engine.gpus import gpu_names
from .engine.timing import ENGINE_ERAS
from .errors import ConfigError, OptionError
from .option_table import Opt, OptionGroups, declare, flag_map
from .policies import policy_names
from .units import number_problem


def _fail(group: str, name: str, reason: str):
    raise OptionError(f"{group}.{name}", reason)


def _check_number(group: str, name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value is not None and number_problem(value, lo, hi, lo_open=lo_open):
        _fail(group, name, number_problem(value, lo, hi, lo_open=lo_open))


def chunk_tokens_problem(chunk_tokens, block_tokens: int) -> str | None:
    """What is wrong with a transfer chunk of ``chunk_tokens`` (the rest of a sentence naming it), or
    None: a whole multiple of the tokens per block, at most MAX_CHUNK_BLOCKS blocks."""
    c = chunk_tokens
    if isinstance(c, bool) or not isinstance(c, int) or c < block_tokens or c % block_tokens \
            or c > block_tokens * MAX_CHUNK_BLOCKS:
        return (f"must be a positive multiple of the {block_tokens} tokens per block, at most "
                f"{block_tokens * MAX_CHUNK_BLOCKS} ({MAX_CHUNK_BLOCKS} blocks); got {c!r}")
    return None


def request_rate_problem(request_rate) -> str | None:
    """What is wrong with a ``request_rate`` (the rest of a sentence naming it), or None."""
    if not (request_rate > 0 and math.isfinite(request_rate)):
        return f"must be a positive number of requests per second, got {request_rate}"
    return None


@dataclass(frozen=True)
class WorkloadOptions:
    """Which requests of the workload are recorded, and when they arrive.

    Attributes:
        max_requests: keep the first N requests (after ``window_ms``). Default None: all.
        window_ms: ``(start, end)``, ms after the workload's first request: keep the requests
            arriving in ``start <= t < end`` (end may be infinity). Default None: all.
        hash_block_tokens: tokens per workload hash block. Default None: the source's (Mooncake
            512, synthetic 256).
        seed: seed of the synthetic workload generators (files ignore it). Default 0.
        time_scale: multiply the arrival times by this (2 = half the load); recorded in the trace.
            Default None: 1.
        request_rate: rescale the arrivals to this mean rate, requests per second (as vllm bench
            serve --request-rate; instead of ``time_scale``). Default None.
    """

    #: first N requests kept (after window_ms); None: all
    max_requests: int | None = None
    #: (start, end) ms after the first request; None: all
    window_ms: tuple[float, float] | None = None
    #: tokens per workload hash block; None: the source's
    hash_block_tokens: int | None = None
    #: seed of synthetic workloads
    seed: int = 0
    #: factor on the arrival times; None: 1
    time_scale: float | None = None
    #: mean arrival rate, requests per second; None: the workload's
    request_rate: float | None = None

    def check(self) -> None:
        if self.time_scale is not None and time_scale_problem(self.time_scale):
            _fail("workload", "time_scale", time_scale_problem(self.time_scale))
        if self.request_rate is not None and request_rate_problem(self.request_rate):
            _fail("workload", "request_rate", request_rate_problem(self.request_rate))


@dataclass(frozen=True)
class GpuOptions:
    """The GPUs of one serving instance and the compute-time model (docs/engine.md).

    Attributes:
        gpu: GPU preset of the compute-time model (``kvemu.engine.gpus``). Default "H100-SXM".
        gpus: GPUs of one instance, = tp x pp. Default None: the smallest power of two holding the
            weights in half its HBM, split as vLLM advises (tensor parallel inside a node of 8).
        tp: tensor-parallel ranks. Default None: from ``gpus``.
        pp: pipeline stages. Default None: ``gpus / tp``.
        ep: expert-parallel ranks of a MoE model, 1 or ``tp``. Default None: 1.
        dp_attention: the attention layers data-parallel over the ``tp`` ranks (each with the whole
            attention weights and its own requests' KV), the MLP and MoE layers split over them, as
            SGLang's ``--enable-dp-attention`` and TensorRT-LLM's ``enable_attention_dp`` run DeepSeek
            (docs/engine.md, "Data-parallel attention"). Default False.
        weight_dtype: dtype of the weights, in which the GEMMs compute: "bf16", "fp16" or "fp8".
            Default "bf16".
        mfu: achieved fraction of peak FLOP/s (0.001 to 1), prefill and decode alike. Default
            None: the factors fitted to published measurements, per phase.
        mbu: achieved fraction of HBM bandwidth (0.001 to 1), prefill and decode alike. Default
            None: fitted, per phase.
        step_overhead_us: fixed time per engine step, microseconds, prefill and decode alike.
            Default None: fitted, per phase.
        compute: compute-time model of a step: "roofline" (the fitted roofline above) or
            "aiconfigurator[:BACKEND[@VERSION]]" (aiconfigurator-core's measured kernels, the extra
            ``.[aic]``; the roofline where its database has no entry; docs/engine.md).
            Default "roofline".
        engine_era: the engine era whose fitted factors the roofline uses
            (``kvemu.engine.timing.ENGINE_ERAS``; docs/engine.md, "Engine eras"). Default "2025".
    """

    #: GPU preset
    gpu: str = "H100-SXM"
    #: GPUs of one instance (tp x pp); None: derived from the model's weights
    gpus: int | None = None
    #: tensor-parallel ranks; None: from gpus
    tp: int | None = None
    #: pipeline stages; None: gpus / tp
    pp: int | None = None
    #: expert-parallel ranks, 1 or tp; None: 1
    ep: int | None = None
    #: attention data-parallel over the tp ranks
    dp_attention: bool = False
    #: dtype of the weights and the GEMMs
    weight_dtype: str = "bf16"
    #: fraction of peak FLOP/s; None: fitted, per phase
    mfu: float | None = None
    #: fraction of HBM bandwidth; None: fitted, per phase
    mbu: float | None = None
    #: fixed time per step, microseconds; None: fitted, per phase
    step_overhead_us: float | None = None
    #: roofline or aiconfigurator[:BACKEND[@VERSION]]
    compute: str = "roofline"
    #: engine era of the roofline's fitted factors (engine.timing.ENGINE_ERAS)
    engine_era: str = "2025"

    def check(self) -> None:
        try:
            parse_compute(self.compute)
        except ConfigError as e:
            _fail("gpu", "compute", str(e).removeprefix("--compute").lstrip(": "))

        if self.engine_era not in ENGINE_ERAS:
            _fail("gpu", "engine_era", f"names no fitted engine era, got {self.engine_era!r} (known: {', '.join(ENGINE_ERAS)})")
        if not isinstance(self.dp_attention, bool):
            _fail("gpu", "dp_attention", f"must be true or false, got {self.dp_attention!r}")
        for name in ("gpus", "tp", "pp", "ep"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                _fail("gpu", name, f"must be a whole number >= 1, got {v!r}")
        for name, bounds in (("mfu", "mfu"), ("mbu", "mbu"), ("step_overhead_us", "overhead_us")):
            _check_number("gpu", name, getattr(self, name), *FACTOR_BOUNDS[bounds])


@dataclass(frozen=True)
class EngineOptions:
    """The serving engine's configuration: KV blocks, batching, capacities, transfers.

    Attributes:
        tier_policy: "none" (HBM prefix cache only), "offload" (write-through to the tier, prefix
            hits loaded back) or "resident" (KV lives in the tier, decode reads it there).
            Default "offload".
        block_tokens: tokens per KV block. Default 16.
        max_batched_tokens: token budget of one engine step (chunked prefill). Default 8192.
        max_num_seqs: requests in one batch at most. Default 256.
        hbm_kv_gib: HBM KV capacity, GiB. Default None: the GPUs' memory x 0.9 minus the weights
            held in HBM.
        tier_capacity_gib: tier capacity, GiB, evicted by ``tier_eviction``. Default None: unbounded.
        tier_eviction: what a bounded offload tier evicts: an online ``kvemu.policies`` name ("lru",
            "fifo", "s3fifo"); recorded in the trace (``engine.tier_eviction``), which replay's arena
            and closed-loop engine evict by unless told otherwise. Default "lru".
        kv_dtype: dtype of the KV cache: "bf16", "fp16" or "fp8". Default "bf16".
        chunk_tokens: offload transfer unit, tokens, recorded in the trace; a multiple of
            ``block_tokens``. Default 256 (LMCache's chunk).
        kv_layout: transfer layout recorded in the trace: "per-layer" (one layer of a chunk per
            transfer) or "cross-layer" (a chunk's blocks of every layer in one). Default
            "per-layer".
    """

    #: none, offload or resident
    tier_policy: str = "offload"
    #: tokens per KV block
    block_tokens: int = 16
    #: token budget of one step
    max_batched_tokens: int = 8192
    #: requests in one batch at most
    max_num_seqs: int = 256
    #: HBM KV capacity, GiB; None: GPU memory x 0.9 minus weights
    hbm_kv_gib: float | None = None
    #: tier capacity, GiB; None: unbounded
    tier_capacity_gib: float | None = None
    #: what a bounded offload tier evicts (a kvemu.policies name)
    tier_eviction: str = DEFAULT_TIER_EVICTION
    #: dtype of the KV cache
    kv_dtype: str = "bf16"
    #: offload transfer unit, tokens (a multiple of block_tokens)
    chunk_tokens: int = 256
    #: per-layer or cross-layer transfers
    kv_layout: str = "per-layer"

    def check(self) -> None:
        b = self.block_tokens
        if isinstance(b, bool) or not isinstance(b, int):
            _fail("engine", "block_tokens", f"must be a whole number, got {b!r}")
        if b <= 0:
            _fail("engine", "block_tokens", "must be positive")
        for name, hi in (("max_num_seqs", MAX_NUM_SEQS), ("max_batched_tokens", MAX_BATCHED_TOKENS)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                _fail("engine", name, f"must be a whole number from 1 to {hi}, got {v!r}")
        _check_number("engine", "hbm_kv_gib", self.hbm_kv_gib, 0.0, 1e6, lo_open=True)
        _check_number("engine", "tier_capacity_gib", self.tier_capacity_gib, 0.0, 1e9, lo_open=True)
        why = tier_eviction_problem(self.tier_eviction, self.tier_policy, self.tier_capacity_gib is not None)
        if why:
            _fail("engine", "tier_eviction", why)
        if chunk_tokens_problem(self.chunk_tokens, b):
            _fail("engine", "chunk_tokens", chunk_tokens_problem(self.chunk_tokens, b))
        if self.kv_layout not in ("per-layer", "cross-layer"):
            _fail("engine", "kv_layout", f"must be per-layer or cross-layer, got {self.kv_layout!r}")


@dataclass(frozen=True)
class WeightsOptions:
    """Weights placed in the tier and streamed to the GPU (docs/weights-in-tier.md).

    Attributes:
        weights_in_tier: fraction (0 to 1) of the weights in the tier, streamed over the GPU's
            host link every step, as vLLM's --cpu-offload-gb; their HBM goes to KV. Default None:
            none.
        cold_experts: MoE models: fraction (0 to 1) of every MoE layer's routed experts in the
            tier, fetched when a token routes to one (not with ``weights_in_tier``). Default None:
            none.
        stream: how streamed weights compose with compute: "serial" (each layer loads, then
            computes) or "overlap" (the next layer's weights prefetched). Default "serial".
    """

    #: fraction of the weights in the tier; None: none
    weights_in_tier: float | None = None
    #: fraction of each MoE layer's experts in the tier; None: none
    cold_experts: float | None = None
    #: serial or overlap
    stream: str = "serial"

    def check(self) -> None:

        _check_number("weights", "weights_in_tier", self.weights_in_tier, 0.0, 1.0)
        _check_number("weights", "cold_experts", self.cold_experts, 0.0, 1.0)
        if self.stream not in STREAMS:
            _fail("weights", "stream", f"must be one of {', '.join(STREAMS)}, got {self.stream!r}")


@dataclass(frozen=True)
class DeploymentOptions:
    """The prefill/decode deployment the trace is meant for, recorded in its metadata's
    ``deployment``; closed-loop replay runs it unless told otherwise (docs/replay.md,
    "Prefill/decode disaggregation"). The recording itself is one colocated instance (the engine
    model's steps); the roles are the replay's. Bounded as replay's options are
    (kvemu.deployment).

    Attributes:
        prefill_instances: prefill instances, each with the recorded GPUs and parallelism (1 to
            128), with ``decode_instances``. Default None: no deployment (colocated).
        decode_instances: decode instances (1 to 128). Default None.
        transfer: the hand-off path: "rdma", "rdma-pull", "host", "pool" or "pool:SPEC". Default
            None: rdma.
        prefill_routing: the prefill side's router. Default None: round-robin.
        decode_routing: the decode side's router. Default None: round-robin.
        threshold_tokens: conditional disaggregation: prompts of fewer tokens are prefilled where
            they are decoded. Default None: every prompt disaggregated.
    """

    #: prefill instances; None: no deployment
    prefill_instances: int | None = None
    #: decode instances; None: no deployment
    decode_instances: int | None = None
    #: rdma, rdma-pull, host, pool, pool:SPEC, pool-serial or pool-serial:SPEC; None: rdma
    transfer: str | None = None
    #: the prefill side's router; None: round-robin
    prefill_routing: str | None = None
    #: the decode side's router; None: round-robin
    decode_routing: str | None = None
    #: conditional disaggregation below this many prompt tokens; None: none
    threshold_tokens: int | None = None

    def check(self) -> None:
        check_deployment("deployment", **dataclasses.asdict(self))
        if self.prefill_instances is None:
            given = [k for k, v in dataclasses.asdict(self).items() if v is not None]
            if given:
                _fail("deployment", given[0], "has no effect without {deployment.prefill_instances} and "
                                              "{deployment.decode_instances}")

    def to_meta(self) -> dict | None:
        """The trace's ``deployment`` (every field, defaults filled in), or None without one."""
        if self.prefill_instances is None:
            return None
        return {"prefill_instances": self.prefill_instances, "decode_instances": self.decode_instances,
                "transfer": self.transfer or DEFAULT_TRANSFER,
                "prefill_routing": self.prefill_routing or DEFAULT_ROUTING,
                "decode_routing": self.decode_routing or DEFAULT_ROUTING,
                "threshold_tokens": self.threshold_tokens,
                "recorded_steps": "colocated: one instance of the recorded GPUs; the deployment is "
                                  "replayed in closed loop"}


@dataclass(frozen=True)
class RecordOutputOptions:
    """How the trace file is written.

    Attributes:
        force: replace an existing trace file. Default False.
        show_progress: show a progress line on stderr. Default True.
    """

    #: replace an existing file
    force: bool = False
    #: progress line on stderr
    show_progress: bool = True

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class RecordOptions(OptionGroups):
    """Everything :func:`kvemu.recording.record` takes besides the workload, the model and the output
    path, in groups; each group's fields are documented on its class.

    Attributes:
        workload: which requests are recorded, and when they arrive. Default WorkloadOptions().
        gpu: the GPUs and the compute-time model. Default GpuOptions().
        engine: the serving engine's configuration. Default EngineOptions().
        weights: weights in the tier. Default WeightsOptions().
        deployment: the prefill/decode deployment the trace is meant for. Default
            DeploymentOptions() (none: colocated).
        output: how the trace file is written. Default RecordOutputOptions().
    """

    #: which requests, and when they arrive
    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    #: GPUs and compute-time model
    gpu: GpuOptions = field(default_factory=GpuOptions)
    #: the serving engine
    engine: EngineOptions = field(default_factory=EngineOptions)
    #: weights in the tier
    weights: WeightsOptions = field(default_factory=WeightsOptions)
    #: the prefill/decode deployment the trace is meant for
    deployment: DeploymentOptions = field(default_factory=DeploymentOptions)
    #: how the trace is written
    output: RecordOutputOptions = field(default_factory=RecordOutputOptions)

    @classmethod
    def from_flat(cls, **flat) -> "RecordOptions":
        """The options from flat keywords, named as `kvemu record`'s flags (``weight_stream``,
        ``hbm_kv_gib``, ...: :data:`FLAT_FIELDS`), as a sweep spec's ``[[trace]]`` table gives them.
        Raises OptionError for an unknown name; the values are checked by :meth:`check`."""
        for name in flat:
            if name not in FLAT_FIELDS:
                raise OptionError(name, f"is not a record option (known: {', '.join(FLAT_FIELDS)})")
        return cls.from_fields({FLAT_FIELDS[name]: value for name, value in flat.items()})


# --------------------------------------------------------------------------------- the option table
def _tier_policies() -> tuple:
    return TIER_POLICIES


def _tier_eviction_help() -> str:
    return (f"What a bounded offload tier (--tier-capacity-gib) evicts: "
            f"{', '.join(policy_names(online=True))} (kvemu.policies; docs/extending.md). Recorded in the "
            f"trace; replay's arena and closed-loop engine evict by it unless told otherwise.")


def _gpu_names() -> tuple:
    return gpu_names()


def _routers() -> tuple:
    return ROUTING


_DTYPES = ("bf16", "fp16", "fp8")


def _rec(name: str, flag: str | None, help="", **kw) -> Opt:
    """A record option; a sweep's ``[[trace]]`` key is the flag's name (``--hbm-kv-gib``: ``hbm_kv_gib``)."""
    return Opt(name, flag, help, sweep=flag[2:].replace("-", "_") if flag else None, **kw)


#: Every `kvemu record` option of :class:`RecordOptions`, in the order ``kvemu record --help``
#: lists them (the sources' options, --workload, --run, --from-vllm-events and --run tiny's
#: geometry, are the command's own). Each is a key of a sweep's ``[[trace]]`` table to record.
OPTIONS: tuple[Opt, ...] = declare(RecordOptions, (
    _rec("workload.max_requests", "--max-requests", "Keep the first N requests (after --window-ms).", kind="int"),
    _rec("workload.window_ms", "--window-ms", "Keep requests arriving in START:END ms of the workload.", kind="range"),
    _rec("workload.hash_block_tokens", "--hash-block-tokens",
         "Tokens per workload hash block (Mooncake default 512, synthetic 256); the other formats' "
         "defaults and block-rule options: docs/workloads.md.", kind="int"),
    _rec("workload.seed", "--seed", "Seed of synthetic workloads and of --run tiny.", kind="int"),
    _rec("workload.time_scale", "--time-scale",
         "Multiply the workload's arrival times by this (2 = half the load); recorded in the trace.", kind="float"),
    _rec("workload.request_rate", "--request-rate",
         "Rescale the workload's arrivals to this mean rate, requests per second (as vllm bench serve "
         "--request-rate).", kind="float"),
    _rec("engine.tier_policy", "--tier-policy",
         "none: HBM prefix cache only; offload: write-through to the tier, load prefix hits back; "
         "resident: KV lives in the tier, decode reads it there.", kind="choice", choices=_tier_policies),
    _rec("gpu.gpu", "--gpu", "GPU preset of the compute-time model (datasheet figures; docs/engine.md). A100, A800, "
         "H100, H800 and H200-SXM name the SXM parts.", kind="choice", choices=_gpu_names),
    _rec("gpu.gpus", "--gpus", "GPUs of one serving instance, = --tp x --pp (default: smallest power of two holding "
         "the weights in half its HBM). Alone it is split as vLLM advises: tensor parallel inside a "
         "node of 8, pipeline stages across nodes. Data parallel: replay --instances.", kind="int"),
    _rec("gpu.tp", "--tp", "Tensor-parallel ranks: compute, weights and KV heads split over them, two all-reduces "
         "per layer over the GPU's interconnect (default: from --gpus).", kind="int"),
    _rec("gpu.pp", "--pp", "Pipeline stages (layers split over them, run one after the other per step; default: "
         "--gpus / --tp).", kind="int"),
    _rec("gpu.ep", "--ep", "Expert-parallel ranks of a MoE model, 1 or --tp: experts split over the tensor-parallel "
         "ranks, all-to-all dispatch and combine per MoE layer (default: 1).", kind="int"),
    _rec("gpu.dp_attention", "--dp-attention",
         "Attention data-parallel over the --tp ranks (SGLang --enable-dp-attention, TensorRT-LLM "
         "enable_attention_dp): each rank holds the whole attention weights and its own requests' "
         "KV (MLA's latent not replicated), MLP and MoE layers stay split; docs/engine.md.", kind="bool"),
    _rec("engine.block_tokens", "--block-tokens", "Tokens per KV block.", kind="int"),
    _rec("engine.max_batched_tokens", "--max-batched-tokens", "Token budget of one engine step (chunked prefill).",
         kind="int"),
    _rec("engine.max_num_seqs", "--max-num-seqs", "Requests in one batch.", kind="int"),
    _rec("engine.hbm_kv_gib", "--hbm-kv-gib", "HBM KV capacity in GiB (default: GPU memory x 0.9 minus weights).",
         kind="float"),
    _rec("engine.tier_capacity_gib", "--tier-capacity-gib", "Tier capacity in GiB, evicting by --tier-eviction (default: unbounded).",
         kind="float"),
    _rec("engine.tier_eviction", "--tier-eviction", _tier_eviction_help, choices=policy_names(online=True),
         metavar="POLICY"),
    _rec("engine.kv_dtype", "--kv-dtype", "Dtype of the KV cache (bytes per cached value), independent of the "
         "weights.", kind="choice", choices=_DTYPES),
    _rec("gpu.weight_dtype", "--weight-dtype",
         "Dtype of the weights; the GEMMs compute in it (fp8 at the GPU's FP8 tensor peak, W8A8; "
         "on a GPU without FP8, A100/A800, fp8 weights compute at the bf16 peak).", kind="choice", choices=_DTYPES),
    _rec("gpu.mfu", "--mfu", "Achieved fraction of peak FLOP/s, prefill and decode steps alike (default: the "
         "--engine-era's factors fitted to published measurements, one for prefill and one for decode; "
         "docs/engine.md).", kind="float"),
    _rec("gpu.mbu", "--mbu", "Achieved fraction of HBM bandwidth, prefill and decode steps alike (default: fitted, "
         "per phase).", kind="float"),
    _rec("gpu.step_overhead_us", "--step-overhead-us",
         "Fixed time per engine step, prefill and decode alike: scheduling, launches (default: "
         "fitted, per phase; collectives are modelled apart).", kind="float"),
    _rec("gpu.engine_era", "--engine-era",
         "Engine era whose fitted roofline factors are used (docs/engine.md, 'Engine eras'): "
         "2025, engines of 2025-26 (vLLM, SGLang, TensorRT-LLM with CUDA-graph decode); 2024, "
         "those of 2023-24.", metavar="ERA"),
    _rec("gpu.compute", "--compute",
         "Compute-time model of a step: roofline (fitted to published measurements) or "
         "aiconfigurator[:BACKEND[@VERSION]] (NVIDIA aiconfigurator-core's kernels measured on "
         "real GPUs, BACKEND vllm, sglang or trtllm; pip install '.[aic]'; the roofline where "
         "its database has no entry; docs/engine.md, 'Compute backends').", metavar="MODEL"),
    _rec("engine.chunk_tokens", "--chunk-tokens",
         "Offload transfer unit in tokens, recorded in the trace (LMCache moves 256-token "
         "chunks); a multiple of --block-tokens.", kind="int"),
    _rec("engine.kv_layout", "--kv-layout",
         "Transfer layout recorded in the trace: one layer of a chunk per transfer, or a chunk's "
         "blocks of every layer in one (vLLM's cross-layer offloading layout).", kind="choice",
         choices=("per-layer", "cross-layer")),
    _rec("weights.weights_in_tier", "--weights-in-tier",
         "Put a fraction F (0 to 1) of the weights in the tier: their HBM goes to KV, and every "
         "step streams them over the GPU's host link, as vLLM's --cpu-offload-gb "
         "(docs/weights-in-tier.md).", kind="float", metavar="F"),
    _rec("weights.cold_experts", "--cold-experts",
         "MoE presets (mixtral-8x7b, deepseek-v3): put round(C x experts) routed experts of every "
         "MoE layer in the tier, fetched when a token routes to one (uniform top-k routing).", kind="float",
         metavar="C"),
    _rec("weights.stream", "--weight-stream",
         "How streamed weights compose with compute: serial (each layer loads, then computes, as "
         "vLLM's CPU offload) or overlap (the next layer's weights prefetched while one computes, "
         "as FlexGen).", kind="choice", choices=("serial", "overlap")),
    _rec("deployment.prefill_instances", "--prefill-instances",
         "The deployment the trace is meant for: this many prefill instances, each with the "
         "recorded GPUs (with --decode-instances). Recorded in the trace's metadata; closed-loop "
         "replay runs it by default. The recorded steps stay one colocated instance's.", kind="int"),
    _rec("deployment.decode_instances", "--decode-instances", "With --prefill-instances: this many decode instances.",
         kind="int"),
    _rec("deployment.transfer", "--transfer",
         "With --prefill-instances: the hand-off path replay uses (rdma, rdma-pull, host, pool or "
         "pool:SPEC, as replay --transfer; default rdma)."),
    _rec("deployment.prefill_routing", "--prefill-routing",
         "With --prefill-instances: the prefill side's router (default round-robin).", kind="choice",
         choices=_routers),
    _rec("deployment.decode_routing", "--decode-routing",
         "With --prefill-instances: the decode side's router (default round-robin).", kind="choice",
         choices=_routers),
    _rec("deployment.threshold_tokens", "--disagg-threshold",
         "With --prefill-instances: conditional disaggregation below this many prompt tokens.", kind="int"),
    Opt("output.force", "--force", "Replace an existing output file.", kind="bool"),
    Opt("output.show_progress", None),
))
#: The flag of each field (errors.OptionError.field), so that a message names what the user typed.
FLAGS: dict[str, str] = flag_map(OPTIONS)
#: Each flat keyword (a `kvemu record` flag without its dashes, underscores for dashes; a sweep's
#: ``[[trace]]`` key) -> the dotted field of RecordOptions it sets.
FLAT_FIELDS: dict[str, str] = {(o.sweep or o.field): o.name for o in OPTIONS}
