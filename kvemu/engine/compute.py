"""The compute model of a recording, behind one interface: which model prices one engine step on the GPU.

A compute model (:class:`ComputeModel`) is:

* ``step_ns(new_tokens, attn_token_pairs, kv_tokens_touched, decode_tokens, decode_context_tokens,
  prefill_chunks, prefill_prefix_tokens) -> int``: the modelled GPU time of one step, from the
  step's composition as the scheduler sums it (:class:`~kvemu.engine.timing.GpuTiming.step_ns`
  documents the arguments), plus the attributes of the roofline's ``GpuTiming`` the engine reads
  (its HBM, its parallelism: the GPUs the step runs on, not the model's fitted terms);
* ``describe() -> str``: the model in one line (``trace info``);
* ``params() -> dict``: its own parameters, JSON values, what a trace keeps as ``compute.params``;
* ``from_params(params, base, ...)``: the model again from those parameters over ``base``, the
  roofline ``GpuTiming`` of the trace's GPUs, model and parallelism (its ``gpu`` and ``model``
  sections); ``validate(params)``: ConfigError, one line naming the bad parameter, for parameters
  the model cannot be built from.

A trace records its compute model as one blob, ``compute = {"model", "version", "params"}``
(:func:`compute_blob`), validated by the model it names; traces recorded before the blob carry
the roofline's fitted terms in their ``gpu`` section (and aiconfigurator's backend in a summary
``compute``), and :func:`compute_blob` maps them into the blob on read, so every reader sees one
shape. Two models are registered (:data:`COMPUTE_MODELS`; docs/engine.md, "Compute backends"):

* ``roofline`` (the default, no dependency): the fitted roofline of ``timing.py``
  (:class:`~kvemu.engine.timing.GpuTiming`), at an engine era's factors or given ones.
* ``aiconfigurator[:BACKEND[@VERSION]]``: NVIDIA's aiconfigurator-core, step times from kernels
  measured on real GPUs for vLLM, SGLang or TensorRT-LLM at a stated version (``engine/aic.py``;
  the optional extra ``pip install '.[aic]'``). Where it has no entry, the roofline.

A model other than the roofline says what it did in ``compute_summary()``, which the trace keeps
as its metadata's ``compute`` (docs/trace-format.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from ..errors import ConfigError
from .aic import AIC_MODELS, AicTiming, make_aic_timing
from .timing import ROOFLINE_PARAMS, GpuTiming

__all__ = ["COMPUTE_MODELS", "DEFAULT_COMPUTE", "ComputeModel", "ComputeSpec", "ROOFLINE_PARAMS", "compute_blob",
           "compute_from_blob", "gpu_figures", "make_compute", "parse_compute", "roofline_params", "timing_from_compute_meta", "validate_blob", "write_blob"]

#: The compute model `kvemu record` uses unless told (--compute).
DEFAULT_COMPUTE = "roofline"


@runtime_checkable
class ComputeModel(Protocol):
    """What the engine, the replay and the analyses ask of a GPU compute model (module docstring)."""

    name: ClassVar[str]
    #: the version of its ``params`` a trace's blob records (``compute.version``)
    model_version: ClassVar[int]

    def step_ns(self, new_tokens: int, attn_token_pairs: float, kv_tokens_touched: int, decode_tokens: int = 0,
                decode_context_tokens: int = 0, prefill_chunks: int = 0, prefill_prefix_tokens: int = 0) -> int: ...

    def describe(self) -> str: ...

    def params(self) -> dict: ...

    @classmethod
    def validate(cls, params: dict) -> None: ...

    @classmethod
    def from_params(cls, params: dict, base: GpuTiming, **context) -> "ComputeModel": ...


# ----------------------------------------------------------------------------- the registry
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


#: Each compute model's name -> its class (:class:`ComputeModel`).
COMPUTE_MODELS: dict = {"roofline": GpuTiming, "aiconfigurator": AicTiming}


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
    return COMPUTE_MODELS[spec.name].from_option(spec, timing, model_spec, kv_dtype)


# ----------------------------------------------------------------------------- the blob
def compute_blob(meta: dict) -> dict:
    """The trace's compute model as one blob ``{"model", "version", "params"}``: its metadata's
    ``compute`` where that is a blob already, else mapped from the fields traces recorded before it
    carry (the roofline's terms in ``gpu``; aiconfigurator's backend and database version in a
    summary ``compute``). The one place legacy fields are read. Not validated (:func:`validate_blob`)."""
    rec = meta.get("compute")
    if isinstance(rec, dict) and "params" in rec:
        return {"model": rec.get("model"), "version": rec.get("version"), "params": rec.get("params")}
    g = meta.get("gpu") if isinstance(meta.get("gpu"), dict) else {}
    roof = {k: g[k] for k in ROOFLINE_PARAMS if k in g}
    if isinstance(rec, dict) and rec.get("model") == "aiconfigurator":
        backend, version = rec.get("backend"), rec.get("version")
        return {"model": "aiconfigurator", "version": 1,
                "params": {"backend": backend if isinstance(backend, str) else None,
                           "database": version if isinstance(version, str) else None, "roofline": roof}}
    return {"model": "roofline", "version": 1, "params": roof}


def gpu_figures(meta: dict) -> dict:
    """A trace's ``gpu`` section with its roofline's parameters, as traces recorded before the blob
    wrote it (what ``trace info``, the break-even heading and ``analyze breakeven --json`` show)."""
    g = meta.get("gpu") if isinstance(meta.get("gpu"), dict) else {}
    return {**g, **roofline_params(compute_blob(meta))}


def write_blob(timing) -> dict:
    """What a new trace records as its ``compute``: the blob of the model ``timing`` is, and, for a
    model other than the roofline, what it did (``compute_summary``; its ``version``, the database's,
    is in the blob's ``params``)."""
    summary = getattr(timing, "compute_summary", None)
    return {**(summary() if summary is not None else {}),
            "model": timing.name, "version": timing.model_version, "params": timing.params()}


def validate_blob(blob) -> type:
    """The class of the model ``blob`` names, after the model has validated its parameters;
    ConfigError, one line, for an unknown model, a version it does not read or a bad parameter."""
    if not isinstance(blob, dict):
        raise ConfigError(f"compute must be a mapping {{model, version, params}}, got {type(blob).__name__}")
    name = blob.get("model")
    if not isinstance(name, str) or name not in COMPUTE_MODELS:
        raise ConfigError(f"compute.model: unknown compute model {name!r} (known: {', '.join(COMPUTE_MODELS)})")
    cls = COMPUTE_MODELS[name]
    if blob.get("version") != cls.model_version:
        raise ConfigError(f"compute.version: {name} reads version {cls.model_version}, got {blob.get('version')!r}")
    cls.validate(blob.get("params"))
    return cls


def roofline_params(blob: dict) -> dict:
    """The roofline's parameters in a blob: its own, or those of the roofline a model falls back to."""
    p = blob.get("params") if isinstance(blob.get("params"), dict) else {}
    p = p if blob.get("model") == "roofline" else p.get("roofline")
    return p if isinstance(p, dict) else {}


def compute_from_blob(blob: dict, base: GpuTiming, **context):
    """The compute model ``blob`` describes over ``base`` (the trace's GPUs, model and parallelism),
    validated by its model first. ``context``: what a model needs beyond its parameters
    (aiconfigurator: ``model_spec``)."""
    return validate_blob(blob).from_params(blob["params"], base, **context)


def timing_from_compute_meta(roofline: GpuTiming, compute: dict | None):
    """The compute model a trace was recorded with, from its ``compute`` metadata (closed-loop
    replay schedules its steps again with it): ``roofline`` where it has none or where every step
    fell back; aiconfigurator with the same database otherwise (ConfigError with the install hint
    where aiconfigurator-core is absent)."""
    if not compute or compute.get("model") != "aiconfigurator" or compute.get("fallback"):
        return roofline
    database = (compute_blob({"compute": compute}).get("params") or {}).get("database")
    spec = compute.get("hf_model")
    model = next((k for k, v in AIC_MODELS.items() if v == spec), None)
    model = model or (os.path.join(spec, "config.json") if spec else "")
    timing = make_aic_timing(roofline, model, roofline.model.kv_dtype, backend=compute.get("backend"),
                             version=database)
    if timing.fallback:
        raise ConfigError(f"the trace was recorded with {compute.get('backend')} {database} of "
                          f"aiconfigurator, which this installation cannot load ({timing.fallback})")
    return timing
