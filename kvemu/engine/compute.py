"""The compute-time model of a recording: which model prices one engine step on the GPU.

A compute model is anything with ``step_ns(new_tokens, attn_token_pairs, kv_tokens_touched,
decode_tokens, decode_context_tokens, prefill_chunks, prefill_prefix_tokens) -> int`` (the step's
composition as the scheduler sums it; :class:`~kvemu.engine.timing.GpuTiming` documents the first
four) and the attributes of :class:`~kvemu.engine.timing.GpuTiming` the engine reads (its HBM, its
parallelism). Two are registered (docs/engine.md, "Compute backends"):

* ``roofline`` (the default, no dependency): the fitted roofline of ``timing.py``; the timing
  itself is the model.
* ``aiconfigurator[:BACKEND[@VERSION]]``: NVIDIA's aiconfigurator-core, step times from kernels
  measured on real GPUs for vLLM, SGLang or TensorRT-LLM at a stated version (``engine/aic.py``;
  the optional extra ``pip install '.[aic]'``). Where it has no entry, the roofline.

A model other than the roofline says what it did in ``compute_summary()``, which the trace keeps
as its metadata's ``compute`` (docs/trace-format.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .aic import make_aic_timing
from .timing import GpuTiming

__all__ = ["COMPUTE_MODELS", "DEFAULT_COMPUTE", "ComputeSpec", "make_compute", "parse_compute"]

#: The compute model `kvemu record` uses unless told (--compute).
DEFAULT_COMPUTE = "roofline"


@dataclass(frozen=True)
class ComputeSpec:
    """A parsed ``--compute``: the model's name and, for aiconfigurator, its serving backend and
    database version (None: the backend's default, the newest the database holds)."""

    name: str
    backend: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        out = self.name
        if self.backend:
            out += f":{self.backend}"
            if self.version:
                out += f"@{self.version}"
        return out


def _roofline(spec: ComputeSpec, timing: GpuTiming, model_spec: str, kv_dtype: str):
    if spec.backend is not None:
        raise ConfigError(f"--compute {spec}: the roofline takes no backend (give --compute roofline)")
    return timing


def _aiconfigurator(spec: ComputeSpec, timing: GpuTiming, model_spec: str, kv_dtype: str):
    return make_aic_timing(timing, model_spec, kv_dtype, backend=spec.backend, version=spec.version)


#: Each compute model's name -> its factory (spec, roofline timing, --model as given, KV dtype) ->
#: the compute model.
COMPUTE_MODELS = {"roofline": _roofline, "aiconfigurator": _aiconfigurator}


def parse_compute(text: str) -> ComputeSpec:
    """``NAME[:BACKEND[@VERSION]]`` -> ComputeSpec; ConfigError for an unknown name or an empty part."""
    if not isinstance(text, str) or not text:
        raise ConfigError(f"--compute must be one of {', '.join(COMPUTE_MODELS)}, got {text!r}")
    name, colon, rest = text.partition(":")
    if name not in COMPUTE_MODELS:
        raise ConfigError(f"--compute: unknown model '{name}' (known: {', '.join(COMPUTE_MODELS)})")
    if not colon:
        return ComputeSpec(name)
    backend, at, version = rest.partition("@")
    if not backend or (at and not version):
        raise ConfigError(f"--compute {text}: expected {name}:BACKEND or {name}:BACKEND@VERSION")
    return ComputeSpec(name, backend, version or None)


def make_compute(text: str, timing: GpuTiming, model_spec: str, kv_dtype: str = "bf16"):
    """The compute model ``text`` names (:func:`parse_compute`) for the roofline ``timing`` of
    ``model_spec`` (a preset name or a config.json path, as given to --model)."""
    spec = parse_compute(text)
    return COMPUTE_MODELS[spec.name](spec, timing, model_spec, kv_dtype)
