"""The options of :func:`kvemu.recording.record`, grouped as `kvemu record` groups its flags.

Each group is a frozen dataclass whose defaults are `kvemu record`'s; ``None`` means "derived"
(from the model, the GPU or the workload, as each field says). :meth:`RecordOptions.check`
validates what can be validated without the model and the workload, and raises
:class:`kvemu.errors.OptionError` naming the field by its dotted name (``"engine.chunk_tokens"``);
what needs them (the HBM left for KV, tensor parallelism dividing the heads, ...) is checked when
the recording reads them. The class docstrings list every field with its default; they are made
from each field's ``doc``, so that a default is written once.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from dataclasses import dataclass, field

from .errors import OptionError
from .units import number_problem


def _opt(default, doc: str):
    return field(default=default, metadata={"doc": doc})


def _documented(cls):
    """Append a "Fields" section to the class docstring: each field, its default and its ``doc``."""
    def default(f):
        return f"{f.default_factory.__name__}()" if f.default is dataclasses.MISSING else repr(f.default)

    lines = [f"    {f.name} = {default(f)}\n" + textwrap.fill(f.metadata["doc"], 100, initial_indent=" " * 8,
                                                              subsequent_indent=" " * 8)
             for f in dataclasses.fields(cls)]
    cls.__doc__ = f"{cls.__doc__.rstrip()}\n\n    Fields (default):\n\n" + "\n".join(lines) + "\n"
    return cls


def _fail(group: str, name: str, reason: str):
    raise OptionError(f"{group}.{name}", reason)


def _check_number(group: str, name: str, value, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if value is not None and number_problem(value, lo, hi, lo_open=lo_open):
        _fail(group, name, number_problem(value, lo, hi, lo_open=lo_open))


def time_scale_problem(time_scale) -> str | None:
    """What is wrong with a ``time_scale`` (the rest of a sentence naming it), or None."""
    if not (isinstance(time_scale, (int, float)) and 0 < time_scale < 1e9 and math.isfinite(time_scale)):
        return f"must be a positive number, got {time_scale}"
    return None


def request_rate_problem(request_rate) -> str | None:
    """What is wrong with a ``request_rate`` (the rest of a sentence naming it), or None."""
    if not (request_rate > 0 and math.isfinite(request_rate)):
        return f"must be a positive number of requests per second, got {request_rate}"
    return None


@_documented
@dataclass(frozen=True)
class WorkloadOptions:
    """Which requests of the workload are recorded, and when they arrive."""

    max_requests: int | None = _opt(None, "Keep the first N requests (after window_ms); None: all.")
    window_ms: tuple[float, float] | None = _opt(
        None, "(start, end) in ms after the workload's first request: keep the requests arriving in it "
              "(end may be infinity); None: all.")
    hash_block_tokens: int | None = _opt(
        None, "Tokens per workload hash block; None: the source's (Mooncake 512, synthetic 256).")
    seed: int = _opt(0, "Seed of the synthetic workload generators (files ignore it).")
    time_scale: float | None = _opt(
        None, "Multiply the arrival times by this (2 = half the load); recorded in the trace. None: 1.")
    request_rate: float | None = _opt(
        None, "Rescale the arrivals to this mean rate, requests per second (instead of time_scale).")

    def check(self) -> None:
        if self.time_scale is not None and time_scale_problem(self.time_scale):
            _fail("workload", "time_scale", time_scale_problem(self.time_scale))
        if self.request_rate is not None and request_rate_problem(self.request_rate):
            _fail("workload", "request_rate", request_rate_problem(self.request_rate))


@_documented
@dataclass(frozen=True)
class GpuOptions:
    """The GPUs of one serving instance and the compute-time model (docs/engine.md)."""

    gpu: str = _opt("H100-SXM", "GPU preset of the compute-time model (kvemu.engine.gpus).")
    gpus: int | None = _opt(
        None, "GPUs of one instance, = tp x pp; None: the smallest power of two holding the weights in "
              "half its HBM.")
    tp: int | None = _opt(None, "Tensor-parallel ranks; None: from gpus.")
    pp: int | None = _opt(None, "Pipeline stages; None: gpus / tp.")
    ep: int | None = _opt(None, "Expert-parallel ranks of a MoE model, 1 or tp; None: 1.")
    weight_dtype: str = _opt("bf16", "Dtype of the weights, in which the GEMMs compute: bf16, fp16 or fp8.")
    mfu: float | None = _opt(
        None, "Achieved fraction of peak FLOP/s, prefill and decode alike; None: the fitted factors, per phase.")
    mbu: float | None = _opt(
        None, "Achieved fraction of HBM bandwidth, prefill and decode alike; None: fitted, per phase.")
    step_overhead_us: float | None = _opt(
        None, "Fixed time per engine step, microseconds, prefill and decode alike; None: fitted, per phase.")

    def check(self) -> None:
        from .engine.timing import FACTOR_BOUNDS

        for name in ("gpus", "tp", "pp", "ep"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                _fail("gpu", name, f"must be a whole number >= 1, got {v!r}")
        for name, bounds in (("mfu", "mfu"), ("mbu", "mbu"), ("step_overhead_us", "overhead_us")):
            _check_number("gpu", name, getattr(self, name), *FACTOR_BOUNDS[bounds])


@_documented
@dataclass(frozen=True)
class EngineOptions:
    """The serving engine's configuration: KV blocks, batching, capacities, transfers."""

    tier_policy: str = _opt(
        "offload", "none: HBM prefix cache only; offload: write-through to the tier, prefix hits loaded back; "
                   "resident: KV lives in the tier, decode reads it there.")
    block_tokens: int = _opt(16, "Tokens per KV block.")
    max_batched_tokens: int = _opt(8192, "Token budget of one engine step (chunked prefill).")
    max_num_seqs: int = _opt(256, "Requests in one batch at most.")
    hbm_kv_gib: float | None = _opt(
        None, "HBM KV capacity, GiB; None: the GPUs' memory x 0.9 minus the weights in HBM.")
    tier_capacity_gib: float | None = _opt(None, "Tier capacity, GiB, evicted LRU; None: unbounded.")
    kv_dtype: str = _opt("bf16", "Dtype of the KV cache: bf16, fp16 or fp8.")
    chunk_tokens: int = _opt(
        256, "Offload transfer unit, tokens, recorded in the trace; a multiple of block_tokens.")
    kv_layout: str = _opt(
        "per-layer", "Transfer layout recorded in the trace: per-layer (one layer of a chunk per transfer) "
                     "or cross-layer (a chunk's blocks of every layer in one).")

    def check(self) -> None:
        b = self.block_tokens
        if isinstance(b, bool) or not isinstance(b, int):
            _fail("engine", "block_tokens", f"must be a whole number, got {b!r}")
        if b <= 0:
            _fail("engine", "block_tokens", "must be positive")
        _check_number("engine", "hbm_kv_gib", self.hbm_kv_gib, 0.0, 1e6, lo_open=True)
        _check_number("engine", "tier_capacity_gib", self.tier_capacity_gib, 0.0, 1e9, lo_open=True)
        c = self.chunk_tokens
        if isinstance(c, bool) or not isinstance(c, int) or c < b or c % b:
            _fail("engine", "chunk_tokens", f"must be a positive multiple of the tokens per block ({b}), got {c}")
        if self.kv_layout not in ("per-layer", "cross-layer"):
            _fail("engine", "kv_layout", f"must be per-layer or cross-layer, got {self.kv_layout!r}")


@_documented
@dataclass(frozen=True)
class WeightsOptions:
    """Weights placed in the tier and streamed to the GPU (docs/engine.md, "Weights in the tier")."""

    weights_in_tier: float | None = _opt(
        None, "Fraction (0 to 1) of the weights in the tier, streamed over the GPU's host link every step; "
              "their HBM goes to KV. None: none.")
    cold_experts: float | None = _opt(
        None, "MoE models: fraction (0 to 1) of every MoE layer's routed experts in the tier, fetched when a "
              "token routes to one. None: none.")
    stream: str = _opt(
        "serial", "How streamed weights compose with compute: serial (load, then compute) or overlap "
                  "(the next layer's prefetched).")

    def check(self) -> None:
        from .engine.weights import STREAMS

        _check_number("weights", "weights_in_tier", self.weights_in_tier, 0.0, 1.0)
        _check_number("weights", "cold_experts", self.cold_experts, 0.0, 1.0)
        if self.stream not in STREAMS:
            _fail("weights", "stream", f"must be one of {', '.join(STREAMS)}, got {self.stream!r}")


@_documented
@dataclass(frozen=True)
class OutputOptions:
    """How the trace file is written."""

    force: bool = _opt(False, "Replace an existing trace file.")
    show_progress: bool = _opt(True, "Show a progress line on stderr.")

    def check(self) -> None:
        pass


@_documented
@dataclass(frozen=True)
class RecordOptions:
    """Everything :func:`kvemu.recording.record` takes besides the workload, the model and the output
    path, in groups; each group's fields are documented on its class."""

    workload: WorkloadOptions = field(default_factory=WorkloadOptions,
                                      metadata={"doc": "Which requests are recorded, and when they arrive."})
    gpu: GpuOptions = field(default_factory=GpuOptions, metadata={"doc": "GPUs and the compute-time model."})
    engine: EngineOptions = field(default_factory=EngineOptions, metadata={"doc": "The serving engine."})
    weights: WeightsOptions = field(default_factory=WeightsOptions, metadata={"doc": "Weights in the tier."})
    output: OutputOptions = field(default_factory=OutputOptions, metadata={"doc": "How the trace is written."})

    def check(self) -> None:
        """Raise OptionError for the first field whose value is invalid whatever the model and workload."""
        for group in (self.workload, self.gpu, self.engine, self.weights, self.output):
            group.check()

    @classmethod
    def from_flat(cls, **flat) -> "RecordOptions":
        """The options from flat keywords, named as `kvemu record`'s flags (``weight_stream``,
        ``hbm_kv_gib``, ...: :data:`FLAT_FIELDS`), as a sweep spec's ``[[trace]]`` table gives them.
        Raises OptionError for an unknown name; the values are checked by :meth:`check`."""
        groups: dict[str, dict] = {}
        for name, value in flat.items():
            if name not in FLAT_FIELDS:
                raise OptionError(name, f"is not a record option (known: {', '.join(FLAT_FIELDS)})")
            group, _, attr = FLAT_FIELDS[name].partition(".")
            groups.setdefault(group, {})[attr] = value
        types = {f.name: f.default_factory for f in dataclasses.fields(cls)}
        return cls(**{g: types[g](**kw) for g, kw in groups.items()})


def _flat_fields() -> dict[str, str]:
    out = {}
    for group in dataclasses.fields(RecordOptions):
        for f in dataclasses.fields(group.default_factory):
            out["weight_stream" if (group.name, f.name) == ("weights", "stream") else f.name] = f"{group.name}.{f.name}"
    return out


#: Each flat keyword (a `kvemu record` flag without its dashes, underscores for dashes) -> the dotted
#: field of RecordOptions it sets.
FLAT_FIELDS: dict[str, str] = _flat_fields()
