"""The measured-kernel compute model: NVIDIA aiconfigurator-core's step estimates (Apache-2.0,
``pip install '.[aic]'``; docs/engine.md, "Compute backends").

aiconfigurator prices one engine iteration from a database of kernels (GEMM, attention, MoE,
collectives) measured on real GPUs for a serving framework at a stated version. Its mixed step
takes a homogeneous composition: ``ctx_tokens`` prompt tokens of requests ``isl`` long whose first
``prefix`` tokens are cached (so ``ctx_tokens / isl`` requests, each computing ``isl - prefix``),
and ``gen`` decode requests whose attention reads ``isl + osl // 2 + 1`` tokens. A kvemu step is
mapped onto it so (``composition``):

* prefill: ``n`` chunks computing ``P`` tokens on ``C`` cached tokens in all become ``n`` requests
  of ``isl = q(P/n) + q(C/n)`` with ``prefix = q(C/n)``, ``ctx_tokens = n * isl``;
* decode: ``d`` requests attending ``D`` tokens in all (context plus the new one) attend
  ``q(D/d)`` each, priced as aiconfigurator's decode step at ``isl = q(D/d) - 2``, ``osl = 2``;
* a mixed step is the mixed estimate of the prefill part with its decodes (the GEMMs of all the
  step's tokens, the prefill attention), with the decode attention of the decode-only estimate at
  the decodes' own context in place of the mixed one's (which would use the prefill's length).

Weights in FP8 are priced with aiconfigurator's block-scaled FP8 kernels (``fp8_block``) for a model
whose published FP8 checkpoint is block-scaled (DeepSeek-V3/R1: ``quantization_config`` with
``weight_block_size`` [128, 128]; a ``config.json`` that says so), with its per-tensor FP8 kernels
otherwise.

With data-parallel attention (``--dp-attention``) aiconfigurator is asked for one attention rank of
``attention_dp_size = tp`` (``tp_size`` 1, the experts over ``moe_tp x moe_ep = tp`` ranks), which it
takes to run like every other rank: a decode-only step of ``d`` requests is its decode step at
``ceil(d / tp)`` requests a rank (the MoE layers see the ranks' tokens together). A step with a
prefill chunk is not like that (the chunk runs on one rank), so it goes to the roofline, and the
summary counts it there.

For a model with multi-head latent attention (DeepSeek) aiconfigurator's mixed step prices the MLA
block, attention included, over all of ``ctx_tokens`` as one sequence: ``n`` chunks would cost as
one chunk ``n`` times longer (an 8 x 7,373-token prefill on 8 x H200 comes out at 7.7 s, against 0.33 s
for one prompt). So a step of more than one prefill chunk of an MLA model goes to the roofline, and
the summary counts it there (``mla_multi_chunk_steps_roofline``).

``q`` keeps 6 significant bits (counts below 64 exact, above that within 1/64): the compositions a
long recording meets fall on a few thousand points, and each is asked once (a dict keyed on the
rounded composition), so the measured-kernel model costs little more than the roofline.

Where aiconfigurator has no entry (a GPU, model, framework version or parallelism its database
lacks), the recording says why in ``compute_summary()["fallback"]`` and every step uses the
roofline; a single composition it cannot price (outside its tables) uses the roofline too. The
summary counts the steps of each model. Energy: aiconfigurator's per-step energy (watt-milliseconds,
from the measured power of the kernels where the database has it) is summed over the steps it
priced; where the database carries no power it reports 0, and the summary says energy is absent.
"""

from __future__ import annotations

import json
import logging
import os

from ..errors import ConfigError
from .timing import GpuTiming

#: What to install when aiconfigurator-core is absent (one line).
INSTALL_HINT = "--compute aiconfigurator needs aiconfigurator-core: pip install '.[aic]' in the kvemu checkout, or pip install aiconfigurator-core"

#: The serving frameworks aiconfigurator's database covers; the first is the default.
AIC_BACKENDS = ("vllm", "sglang", "trtllm")

#: kvemu GPU preset -> aiconfigurator system (systems/*.yaml); presets absent have no database.
AIC_SYSTEMS = {"A100-80GB": "a100_sxm", "H100-SXM": "h100_sxm", "H200": "h200_sxm", "B200": "b200_sxm",
               "L40S": "l40s"}

#: kvemu model preset -> the HuggingFace id whose config aiconfigurator ships and reads offline
#: (its DefaultHFModels; any other id it would download); Llama 3 8B/70B share Llama 3.1's geometry
#: (the 3.1 configs differ in RoPE scaling only). Mixtral-8x7B is not among them in 0.12.0: give its
#: config.json as --model.
AIC_MODELS = {"llama3-8b": "meta-llama/Meta-Llama-3.1-8B", "llama3-70b": "meta-llama/Meta-Llama-3.1-70B",
              "llama3.1-405b": "meta-llama/Meta-Llama-3.1-405B", "deepseek-v3": "deepseek-ai/DeepSeek-V3"}

#: Bits the composition keeps after the leading one (module docstring: 6 significant bits).
ROUND_BITS = 5

#: kvemu presets whose published FP8 checkpoint is block-scaled (DeepSeek-V3's and R1's config.json:
#: quantization_config {"quant_method": "fp8", "weight_block_size": [128, 128]}): priced with
#: aiconfigurator's fp8_block GEMM and MoE kernels.
BLOCK_FP8_PRESETS = ("deepseek-v3", "deepseek-v3.2")


def block_fp8(model_spec: str) -> bool:
    """Whether ``model_spec``'s FP8 weights are block-scaled: a preset of :data:`BLOCK_FP8_PRESETS`, or a
    config.json whose ``quantization_config`` gives a ``weight_block_size``."""
    if model_spec in BLOCK_FP8_PRESETS:
        return True
    if not os.path.isfile(model_spec):
        return False
    try:
        with open(model_spec, encoding="utf-8") as f:
            cfg = json.loads(f.read(1 << 22))
    except (OSError, ValueError):
        return False
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return isinstance(qc, dict) and bool(qc.get("weight_block_size"))


def q(x: float) -> int:
    """``x`` rounded to :data:`ROUND_BITS` + 1 significant bits, half up (exact below
    ``2**(ROUND_BITS + 1)``)."""
    x = int(round(x))
    shift = x.bit_length() - 1 - ROUND_BITS
    if shift <= 0:
        return x
    return ((x + (1 << (shift - 1))) >> shift) << shift


def composition(new_tokens: int, decode_tokens: int, decode_context_tokens: int, prefill_chunks: int,
                prefill_prefix_tokens: int) -> tuple[tuple[int, int, int] | None, tuple[int, int] | None]:
    """The step's rounded composition: ``(chunks, tokens per chunk, cached tokens per chunk)`` of its
    prefill part (None without one) and ``(decode requests, tokens each attends)`` of its decodes
    (None without)."""
    pre = new_tokens - decode_tokens
    prefill = None
    if pre > 0 and prefill_chunks > 0:
        prefill = (q(prefill_chunks), max(1, q(pre / prefill_chunks)), q(prefill_prefix_tokens / prefill_chunks))
    decode = (q(decode_tokens), max(3, q(decode_context_tokens / decode_tokens))) if decode_tokens > 0 else None
    return prefill, decode


def _quant(dtype: str, enum, block: bool = False):
    if dtype != "fp8":
        return enum.bfloat16
    return getattr(enum, "fp8_block", enum.fp8) if block else enum.fp8


class AicTiming:
    """The roofline ``GpuTiming`` with its ``step_ns`` priced by aiconfigurator where it can; every
    other attribute is the roofline's (HBM, parallelism, what the trace's ``gpu`` metadata says).
    A ``ComputeModel`` (engine/compute.py): its parameters are the serving backend, the database
    version and the parameters of the roofline it falls back to."""

    name = "aiconfigurator"
    model_version = 1

    def __init__(self, roofline: GpuTiming, *, system: str | None, backend: str, version: str | None,
                 hf_model: str | None, fallback: str | None = None, engine=None, weight_quant: str | None = None):
        self.roofline = roofline
        self.weight_quant = weight_quant  # the GEMM and MoE quantisation it was asked with (None: unasked)
        # data-parallel attention: aiconfigurator prices one of tp alike ranks (module docstring)
        self.dp_ranks = roofline.tp if roofline.dp_attention else 1
        self.dp_prefill_steps = 0
        # MLA: a step of several prefill chunks is not what its mixed step prices (module docstring)
        self.mla = roofline.model.mla_layers > 0
        self.mla_multi_chunk_steps = 0
        self.system, self.backend, self.version, self.hf_model = system, backend, version, hf_model
        self.fallback = fallback
        self._engine = engine  # (aiconfigurator model, database, backend) or None: the roofline
        self._cache: dict = {}  # aiconfigurator's answers, by what it was asked
        self._steps: dict = {}  # step estimates, by rounded composition
        self.steps = {"aiconfigurator": 0, "roofline": 0}
        self.hits = 0
        self.step_hits = 0
        self.energy_wms = 0.0
        self.misses: dict[str, int] = {}

    def __getattr__(self, name):
        if name == "roofline":  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.roofline, name)

    # ------------------------------------------------------------------ aiconfigurator's answers
    def _mixed(self, prefill, n_dec: int):
        from aiconfigurator_core.sdk import config
        from aiconfigurator_core.sdk.step_estimate import MixedStepInput

        model, db, be = self._engine
        n, k, c = prefill
        isl = k + c
        rc = config.RuntimeConfig(isl=isl, osl=2, prefix=c)
        e = be.run_mixed(model, db, rc, MixedStepInput(context_tokens=n * isl, num_decode_requests=n_dec))
        lat, en = e.component_latency_ms, e.component_energy_wms
        return (lat["shared_non_attention"] + lat["context_attention"],
                en.get("shared_non_attention", 0.0) + en.get("context_attention", 0.0))

    def _decode(self, n_dec: int, ctx: int):
        from aiconfigurator_core.sdk.rust_engine_step import estimate_decode_step_breakdown_with_rust

        model, db, _ = self._engine
        lat, en, _, _, _ = estimate_decode_step_breakdown_with_rust(model, db, gen_tokens=n_dec, isl=ctx - 2, osl=2)
        return lat, en

    def _ask(self, key, fn, *args):
        hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        try:
            got = fn(*args)
        except Exception as exc:  # noqa: BLE001 - any refusal of the database: the roofline for this one
            got = False
            why = type(exc).__name__
            self.misses[why] = self.misses.get(why, 0) + 1
        self._cache[key] = got
        return got

    def estimate_ms(self, prefill, decode) -> tuple[float, float] | None:
        """(latency ms, energy Wms) of a rounded composition (:func:`composition`), None where
        aiconfigurator cannot price it."""
        if prefill is None and decode is None:
            return 0.0, 0.0
        if prefill is None:
            got = self._ask(("d",) + decode, self._decode, decode[0], decode[1])
            return got or None
        n_dec = decode[0] if decode else 0
        mixed = self._ask(("m",) + prefill + (n_dec,), self._mixed, prefill, n_dec)
        if not mixed:
            return None
        if decode is None:
            return mixed
        attn = self._ask(("a",) + decode, self._decode_attention, decode[0], decode[1])
        if not attn:
            return None
        return mixed[0] + attn[0], mixed[1] + attn[1]

    def _decode_attention(self, n_dec: int, ctx: int):
        from aiconfigurator_core.sdk.rust_engine_step import estimate_decode_step_breakdown_with_rust

        model, db, _ = self._engine
        _, total_en, per_lat, _, _ = estimate_decode_step_breakdown_with_rust(model, db, gen_tokens=n_dec,
                                                                               isl=ctx - 2, osl=2)
        attn = per_lat["generation_attention"]
        total = sum(per_lat.values())
        # energy of the attention: its share of the decode step's, by time (per-op energy is folded away)
        return attn, (total_en * attn / total if total > 0 else 0.0)

    def _composition(self, new_tokens: int, decode_tokens: int, decode_context_tokens: int, prefill_chunks: int,
                     prefill_prefix_tokens: int):
        """The rounded composition aiconfigurator is asked for (:func:`composition`), or None for a step
        it would misprice, counted by why (module docstring): a prefill under data-parallel attention
        (the chunk runs on one rank: not alike ranks), several prefill chunks of an MLA model (its MLA
        block would take them for one sequence)."""
        prefill = new_tokens > decode_tokens
        if self.dp_ranks > 1:
            if prefill:
                self.dp_prefill_steps += 1
                return None
            per_rank = -(-decode_tokens // self.dp_ranks)  # one rank's share, at the decodes' mean context
            return composition(per_rank, per_rank, round(decode_context_tokens * per_rank / decode_tokens), 0, 0)
        if self.mla and prefill and prefill_chunks > 1:
            self.mla_multi_chunk_steps += 1
            return None
        return composition(new_tokens, decode_tokens, decode_context_tokens, prefill_chunks, prefill_prefix_tokens)

    # --------------------------------------------------------------------------- the interface
    def step_ns(self, new_tokens: int, attn_token_pairs: float, kv_tokens_touched: int, decode_tokens: int = 0,
                decode_context_tokens: int = 0, prefill_chunks: int = 0, prefill_prefix_tokens: int = 0) -> int:
        comp = None
        if self._engine is not None and new_tokens > 0:
            comp = self._composition(new_tokens, decode_tokens, decode_context_tokens, prefill_chunks,
                                     prefill_prefix_tokens)
        if comp is not None:
            got = self._steps.get(comp)
            if got is None:
                got = self._steps[comp] = self.estimate_ms(*comp) or False
            else:
                self.step_hits += 1
            if got:
                self.steps["aiconfigurator"] += 1
                self.energy_wms += got[1]
                return int(round(got[0] * 1e6))
        self.steps["roofline"] += 1
        return self.roofline.step_ns(new_tokens, attn_token_pairs, kv_tokens_touched, decode_tokens,
                                     decode_context_tokens, prefill_chunks, prefill_prefix_tokens)

    # ------------------------------------------------------------------ the ComputeModel interface
    def params(self) -> dict:
        return {"backend": self.backend, "database": self.version, "roofline": self.roofline.params()}

    def describe(self) -> str:
        if self.fallback:
            return f"{self.roofline.describe()} for every step (aiconfigurator: {self.fallback})"
        return f"aiconfigurator {self.backend} {self.version} on {self.system}, {self.roofline.describe()} elsewhere"

    @classmethod
    def validate(cls, params) -> None:
        """ConfigError, one line naming the parameter, unless ``params`` are ``{backend, database,
        roofline}``: a backend aiconfigurator knows (or null), a database version (or null: the
        backend's default), the roofline's parameters."""
        if not isinstance(params, dict):
            raise ConfigError(f"compute.params must be a mapping, got {type(params).__name__}")
        for k in params:
            if k not in ("backend", "database", "roofline"):
                raise ConfigError(f"compute.params.{k}: not an aiconfigurator parameter (known: backend, database, "
                                  "roofline)")
        b = params.get("backend")
        if b is not None and b not in AIC_BACKENDS:
            raise ConfigError(f"compute.params.backend: unknown backend {b!r} (known: {', '.join(AIC_BACKENDS)})")
        d = params.get("database")
        if d is not None and (not isinstance(d, str) or not d):
            raise ConfigError(f"compute.params.database must be a version string or null, got {d!r}")
        GpuTiming.validate(params.get("roofline", {}))

    @classmethod
    def from_params(cls, params: dict, base: GpuTiming, *, model_spec: str | None = None, **context) -> "AicTiming":
        """aiconfigurator over the roofline of ``params["roofline"]`` on ``base``; ``model_spec``: the
        model it is asked about (default: the base's model name). ConfigError when it is not installed."""
        cls.validate(params)
        roof = GpuTiming.from_params(params.get("roofline", {}), base)
        return make_aic_timing(roof, model_spec or roof.model.name, roof.model.kv_dtype,
                               backend=params.get("backend"), version=params.get("database"))

    @classmethod
    def from_option(cls, spec, timing: GpuTiming, model_spec: str, kv_dtype: str) -> "AicTiming":
        """``--compute aiconfigurator[:BACKEND[@VERSION]]`` over the roofline ``timing``."""
        return make_aic_timing(timing, model_spec, kv_dtype, backend=spec.backend, version=spec.version)

    def compute_summary(self) -> dict:
        """What the trace's metadata ``compute`` says (docs/trace-format.md)."""
        priced = self.steps["aiconfigurator"]
        energy_j = self.energy_wms / 1e3 if priced and self.energy_wms > 0 else None
        return {
            "model": "aiconfigurator",
            "how": "modelled: aiconfigurator-core step estimates from kernels measured on real GPUs "
                   "(its database), the roofline where it has none",
            "package_version": _package_version(),
            "system": self.system, "backend": self.backend, "version": self.version, "hf_model": self.hf_model,
            "fallback": self.fallback,
            "steps": dict(self.steps),
            "unpriced": dict(self.misses),
            "compositions": len(self._steps), "queries": len(self._cache), "cache_hits": self.step_hits,
            "round_bits": ROUND_BITS,
            "energy_j": energy_j,
            "energy": "aiconfigurator's per-step energy summed over the steps it priced" if energy_j is not None
            else "absent: the database carries no kernel power for these points",
            **({"weight_quant": self.weight_quant} if self.weight_quant else {}),
            **({"attention_dp_size": self.dp_ranks, "dp_prefill_steps_roofline": self.dp_prefill_steps}
               if self.dp_ranks > 1 else {}),
            **({"mla_multi_chunk_steps_roofline": self.mla_multi_chunk_steps} if self.mla and self.dp_ranks == 1 else {}),
        }


def _package_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("aiconfigurator-core")
    except Exception:  # noqa: BLE001 - metadata absent
        return None


def aic_model_id(model_spec: str) -> str | None:
    """The model aiconfigurator is asked about: a preset's HuggingFace id, a config.json's directory
    (aiconfigurator reads config.json from a local directory), None for a preset it lacks."""
    if model_spec in AIC_MODELS:
        return AIC_MODELS[model_spec]
    if os.path.isfile(model_spec):
        return os.path.dirname(os.path.abspath(model_spec))
    return None


def make_aic_timing(roofline: GpuTiming, model_spec: str, kv_dtype: str = "bf16", *, backend: str | None = None,
                    version: str | None = None) -> AicTiming:
    """The aiconfigurator compute model over ``roofline``; ConfigError when aiconfigurator-core is
    not installed or the backend is not one it knows. A GPU, model or parallelism its database
    lacks gives a timing whose every step is the roofline's, saying why (``fallback``)."""
    try:
        import aiconfigurator_core  # noqa: F401
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    backend = backend or AIC_BACKENDS[0]
    if backend not in AIC_BACKENDS:
        raise ConfigError(f"--compute aiconfigurator:{backend}: unknown backend (known: {', '.join(AIC_BACKENDS)})")
    # its loaders warn through logging about low-fidelity rows they load; the summary says what was used
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    from aiconfigurator_core.sdk import common, config
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.models import get_model
    from aiconfigurator_core.sdk.perf_database import get_database, get_latest_database_version, get_version_slots

    system = AIC_SYSTEMS.get(roofline.gpu.name)
    hf = aic_model_id(model_spec)

    def fall(why: str) -> AicTiming:
        return AicTiming(roofline, system=system, backend=backend, version=version, hf_model=hf, fallback=why)

    if system is None:
        return fall(f"aiconfigurator has no database for {roofline.gpu.name} (it has: {', '.join(AIC_SYSTEMS)})")
    from aiconfigurator_core.sdk.utils import DefaultHFModels

    if hf is not None and not os.path.isdir(hf) and hf not in DefaultHFModels:
        hf = None  # never a download: only the configs it ships, or a local folder
    if hf is None:
        return fall(f"aiconfigurator has no config for model {model_spec} (give its config.json, or a preset of "
                    f"{', '.join(AIC_MODELS)})")
    if version is None:
        # the maintained default ("current" slot); listing every database to find it costs seconds
        slots = get_version_slots(system, backend)
        version = (slots or {}).get("current") or get_latest_database_version(system, backend)
        if version is None:
            return fall(f"aiconfigurator has no {backend} database for {system}")
    try:
        db = get_database(system, backend, version)
    except Exception as exc:  # noqa: BLE001 - its loader refuses a version it lacks in several ways
        db = None
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        return fall(f"aiconfigurator has no {backend} {version} database for {system} ({detail})")
    if db is None:
        return fall(f"aiconfigurator has no {backend} {version} database for {system}")
    tp, pp, ep = roofline.tp, roofline.pp, roofline.ep
    block = block_fp8(model_spec)
    gemm = _quant(roofline.weight_dtype, common.GEMMQuantMode, block)
    # data-parallel attention: one attention rank of tp (module docstring)
    attn_tp, attn_dp = (1, tp) if roofline.dp_attention else (tp, 1)
    mc = config.ModelConfig(tp_size=attn_tp, pp_size=pp, attention_dp_size=attn_dp, gemm_quant_mode=gemm,
                            moe_quant_mode=_quant(roofline.weight_dtype, common.MoEQuantMode, block),
                            kvcache_quant_mode=_quant(kv_dtype, common.KVCacheQuantMode),
                            fmha_quant_mode=_quant(kv_dtype, common.FMHAQuantMode),
                            moe_tp_size=tp // ep, moe_ep_size=ep, num_gpus_per_node=roofline.gpu.node_gpus,
                            system=system)
    try:
        model = get_model(hf, mc, backend)
        be = get_backend(backend)
        timing = AicTiming(roofline, system=system, backend=backend, version=version, hf_model=hf,
                           engine=(model, db, be), weight_quant=gemm.name)
        # one probe: a database that cannot price a small decode step for this model and parallelism has no entry
        if timing.estimate_ms(None, (1, 64)) is None:
            raise ValueError("; ".join(timing.misses) or "no estimate")
        timing._cache.clear()
        timing.hits = 0
        return timing
    except Exception as exc:  # noqa: BLE001 - a model family or parallelism it does not cover
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        dp = " with data-parallel attention" if roofline.dp_attention else ""
        return fall(f"aiconfigurator cannot price {model_spec} at tp {tp} pp {pp} ep {ep}{dp} ({gemm.name} weights) "
                    f"with {backend} {version} on {system} ({detail})")
