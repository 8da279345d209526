"""Semantic validation of traces and results: what a file says must be something kvemu can compute
with, beyond its checksums (docs/trace-format.md, "Validation").

The checksums (kvemu/integrity.py) prove that a file is what its writer wrote; they do not prove
that its writer was kvemu, since the content digest is easy to recompute. So every value that
feeds a computation is checked here, once, wherever a trace or a results file is read:

- :func:`check_trace_meta`: every number of the ``gpu``, ``engine``, ``model``, ``weights``,
  ``workload``, ``load`` and ``deployment`` sections that kvemu computes with, bounded as the matching option is
  bounded where there is one (the bounds come from kvemu/bounds.py, where the options take them too), finite,
  of the right type, enums among their known values, and the facts that must agree with each
  other (tensor-parallel ranks dividing the heads, the engine's block size the model's, ...);
  read_header calls it, so every command refuses such a trace with the field's name;
- :class:`RequestAccounting`: each request's entries add up to its tokens, in order (fed batch
  by batch by schema.iter_entries' full pass);
- :func:`check_sessions`: the ``sessions`` graph (kvemu.sessions), where a trace has one, lists
  one parent, gap, session and turn per request, consistent with each other;
- :func:`check_timeline`: the recorded timeline fits kvemu's int64 nanosecond clock with room;
- :func:`check_results_table`: a results file's per-request values are finite and not negative.

Every refusal is a TraceError or ResultsError naming the file and the field.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from .arrowops import list_values
from .blockrule import BLOCK_RULE_VERSION, SCOPES, TIME_UNITS, TRUNCATIONS
from .bounds import (COMPUTE_DTYPES, FACTOR_BOUNDS, KV_DTYPE_BYTES, LAYOUTS, MAX_BATCHED_TOKENS, MAX_CHUNK_BLOCKS,
                     MAX_ID_SPACE, MAX_NUM_SEQS, MAX_TIMELINE_NS, STREAMS, TIER_POLICIES, WEIGHT_DTYPE_BYTES,
                     tier_eviction_problem, time_scale_problem)
from .bounds import MAX_BREAKEVEN_GPUS as MAX_GPUS
from .deployment import FIELDS, check_deployment
from .errors import OptionError, ResultsError, TraceError
from .prices import AMORTISE_YEARS_BOUNDS
from .sessions import GAP_SOURCES, SESSIONS_VERSION, graph_problem
from .units import MAX_SIZE, number_problem

#: Bounds of the GPU preset figures a trace records (kvemu.engine.gpus.GpuSpec): no option sets
#: them (they come from the presets' datasheets), so they are bounded here, far above any GPU
#: (B200: 2,250 dense bf16 TFLOP/s, 8,000 GB/s) and below what would make a step take no time.
_FIGURE_MAX = 1e6
#: Largest model dimension (hidden size, heads, head dims, experts) and parameter count a trace
#: may declare: 2^20 and 10^15, thousands of times today's largest models (DeepSeek-V3: hidden
#: 7,168, 671 B parameters); every product of them stays exact in float64 and int64.
_DIM_MAX = 1 << 20
_PARAMS_MAX = 10**15
#: Largest layer count (Llama 3.1 405B has 126) and token counts of one engine step or block.
_LAYERS_MAX = 1 << 16
_INT32_MAX = 2**31 - 1
#: ``roofline_p``'s range: 0 is the plain maximum of older traces, else a p-norm (p >= 1 is a
#: norm; above 8 it is the maximum to within 9 %, and larger powers of step times overflow).
_ROOFLINE_P_MAX = 8.0


#: what _Meta._given returns for a field with nothing to check
_ABSENT = object()

class _Meta:
    """Checks one trace's metadata, each refusal naming the file and the field."""

    def __init__(self, where, meta: dict):
        self.where, self.meta = where, meta

    def fail(self, field: str, reason: str):
        where = "" if self.where is None else f"{self.where}: "
        raise TraceError(f"{where}trace metadata {field} {reason}")

    def section(self, name: str, required: bool = False) -> dict | None:
        s = self.meta.get(name)
        if s is None and not required:
            return None
        if name not in self.meta:
            self.fail(name, "is missing")
        if not isinstance(s, dict):
            self.fail(name, f"must be an object, got {_short(s)}")
        return s

    def _given(self, sec: dict, section: str, key: str, required: bool, optional: bool):
        """``sec[key]`` to check, or _ABSENT: absent (refused when ``required``) or None where
        ``optional`` allows it."""
        if key not in sec:
            if required:
                self.fail(f"{section}.{key}", "is missing")
            return _ABSENT
        v = sec[key]
        return _ABSENT if v is None and optional else v

    def number(self, sec: dict, section: str, key: str, lo: float, hi: float, *, lo_open: bool = False,
               integer: bool = False, optional: bool = False, required: bool = False):
        """``sec[key]`` checked as a finite number in [lo, hi] (``lo_open``: (lo, hi]); an
        integer with ``integer``; None allowed with ``optional``; absent allowed unless
        ``required``. Returns the value (None when absent)."""
        v = self._given(sec, section, key, required, optional)
        if v is _ABSENT:
            return None
        if integer and (isinstance(v, bool) or not isinstance(v, int)):
            self.fail(f"{section}.{key}", f"must be a whole number, got {_short(v)}")
        why = number_problem(v, lo, hi, lo_open=lo_open)
        if why:
            self.fail(f"{section}.{key}", why)
        return v

    def choice(self, sec: dict, section: str, key: str, known, *, required: bool = False, optional: bool = False):
        v = self._given(sec, section, key, required, optional)
        if v is _ABSENT:
            return None
        if not isinstance(v, str) or v not in known:
            self.fail(f"{section}.{key}", f"must be one of {', '.join(known)}, got {_short(v)}")
        return v

    def text(self, sec: dict, section: str, key: str, *, required: bool = False, optional: bool = False):
        v = self._given(sec, section, key, required, optional)
        if v is _ABSENT:
            return None
        if not isinstance(v, str):
            self.fail(f"{section}.{key}", f"must be a string, got {_short(v)}")
        return v


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def check_trace_meta(where, meta: dict) -> None:
    """Every metadata value of a trace that kvemu computes with, checked (module docstring).
    ``meta``: the header's metadata (v1 already upgraded), its geometry already checked by
    read_header. TraceError naming the first field that is wrong."""
    m = _Meta(where, meta)
    model = _check_model(m)
    _check_engine(m, model)
    _check_gpu(m, model)
    _check_compute(m)
    _check_weights(m, model)
    _check_workload(m)
    _check_load(m)
    _check_schedule(m)
    _check_deployment(m)


def check_timing_meta(meta: dict) -> None:
    """The ``model`` and ``gpu`` sections the GPU compute model is rebuilt from
    (analysis.timing_from_meta), checked as check_trace_meta checks them: a results file's
    ``trace`` section is not a trace read_header has checked. TraceError without a file name."""
    m = _Meta(None, meta)
    _check_gpu(m, _check_model(m))
    _check_compute(m)


def _check_model(m: _Meta) -> dict:
    s = m.section("model", required=True)
    n = lambda key, lo, hi, **kw: m.number(s, "model", key, lo, hi, integer=True, **kw)  # noqa: E731
    m.text(s, "model", "name", required=True)
    m.text(s, "model", "source")
    layers = n("layers", 1, _LAYERS_MAX, required=True)
    for key in ("kv_values_per_token_layer", "kv_dtype_bytes"):
        n(key, 1, _DIM_MAX, required=True)
    n("tokens_per_block", 1, 1 << 20, required=True)
    for key in ("kv_bytes_per_token_layer", "block_bytes_per_layer"):  # read_header checks they add up
        n(key, 1, MAX_SIZE, required=True)
    for key in ("hidden_size", "attention_heads", "head_dim", "qk_head_dim", "v_head_dim"):
        n(key, 1, _DIM_MAX)
    heads = s.get("attention_heads")
    n("kv_heads", 0, heads if heads is not None else _DIM_MAX)
    params = n("params", 1, _PARAMS_MAX)
    n("active_params", 1, params if params is not None else _PARAMS_MAX)
    n("attention_params", 1, params if params is not None else _PARAMS_MAX)  # absent where not recorded
    moe = n("moe_layers", 0, layers)
    experts = n("experts", 0, _DIM_MAX)
    top_k = n("experts_per_token", 0, experts if experts is not None else _DIM_MAX)
    if moe and not (experts and top_k):
        m.fail("model.experts", f"and model.experts_per_token must be positive in a model with {moe} MoE layers")
    dtype = m.choice(s, "model", "kv_dtype", tuple(KV_DTYPE_BYTES), required=True)
    if s["kv_dtype_bytes"] != KV_DTYPE_BYTES[dtype]:
        m.fail("model.kv_dtype_bytes", f"must be {KV_DTYPE_BYTES[dtype]} for kv_dtype {dtype}, got {s['kv_dtype_bytes']}")
    per_token, how = layers * s["kv_bytes_per_token_layer"], "layers x kv_bytes_per_token_layer"
    groups = (s.get("kv_groups") or {}).get("groups") if isinstance(s.get("kv_groups"), dict) else None
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        # KV groups (read_header checks them): a token costs each group's bytes in its layers
        try:
            per_token = sum(int(g.get("bytes_per_token_layer", 0)) * int(g.get("layers", 0)) for g in groups)
        except (TypeError, ValueError):
            per_token = None
        how = "the KV groups' bytes_per_token_layer x layers, summed"
    if per_token is not None and "kv_bytes_per_token" in s and s["kv_bytes_per_token"] != per_token:
        m.fail("model.kv_bytes_per_token", f"must be {how} = {per_token}, "
                                           f"got {_short(s['kv_bytes_per_token'])}")
    if s["block_bytes_per_layer"] * layers > MAX_SIZE:
        m.fail("model.block_bytes_per_layer", f"x layers exceeds {MAX_SIZE >> 60} EiB")
    return s


def _check_engine(m: _Meta, model: dict) -> None:
    s = m.section("engine")
    if s is None:
        return
    n = lambda key, lo, hi, **kw: m.number(s, "engine", key, lo, hi, integer=True, **kw)  # noqa: E731
    tpb = n("tokens_per_block", 1, 1 << 20)
    if tpb is not None and tpb != model["tokens_per_block"]:
        m.fail("engine.tokens_per_block", f"{tpb} differs from model.tokens_per_block {model['tokens_per_block']}")
    seqs = n("max_num_seqs", 1, MAX_NUM_SEQS)
    n("max_num_batched_tokens", seqs or 1, MAX_BATCHED_TOKENS)
    policy = m.choice(s, "engine", "tier_policy", TIER_POLICIES)
    n("hbm_kv_blocks", 1, MAX_ID_SPACE, optional=True)
    cap = n("tier_capacity_blocks", 1, MAX_ID_SPACE, optional=True)
    if policy == "none" and cap is not None:
        m.fail("engine.tier_capacity_blocks", "must be null with tier_policy none (no tier)")
    eviction = m.text(s, "engine", "tier_eviction", optional=True)  # absent: LRU, as traces before it
    if eviction is not None and policy is not None:
        why = tier_eviction_problem(eviction, policy, cap is not None, policy_field="tier_policy",
                                    capacity_field="tier_capacity_blocks")
        if why:
            m.fail("engine.tier_eviction", why)
    block = tpb or model["tokens_per_block"]
    chunk = n("transfer_chunk_tokens", 1, block * MAX_CHUNK_BLOCKS)  # record's and replay's --chunk-tokens bound
    if chunk is not None and chunk % block:
        m.fail("engine.transfer_chunk_tokens", f"must be a multiple of the {block} tokens per block, got {chunk}")
    m.choice(s, "engine", "kv_layout", LAYOUTS)
    for key in ("steps", "entries", "hbm_evictions", "tier_evictions", "makespan_ns"):
        n(key, 0, 2**63 - 1)



def _check_gpu(m: _Meta, model: dict) -> None:
    # most GPUs of one instance, and of any other count of GPUs a trace names (MAX_GPUS): the bound of
    # ``analyze breakeven --gpus`` (beyond it a value is mistyped, not a deployment)
    s = m.section("gpu")
    if s is None:
        return
    f = lambda key, lo, hi, **kw: m.number(s, "gpu", key, lo, hi, **kw)  # noqa: E731
    i = lambda key, lo, hi, **kw: m.number(s, "gpu", key, lo, hi, integer=True, **kw)  # noqa: E731
    for key in ("name", "scaleup", "host_link", "link"):
        m.text(s, "gpu", key)
    for key in ("peak_tflops", "hbm_gbps", "memory_gb"):
        f(key, 0.0, _FIGURE_MAX, lo_open=True)
    for key in ("fp8_tflops", "scaleup_gbps", "host_link_gbps", "allreduce_busbw_gbps", "scaleout_busbw_gbps",
                "collective_us", "scaleout_us", "compute_tflops"):
        f(key, 0.0, _FIGURE_MAX)
    node = i("node_gpus", 1, MAX_GPUS)
    gpus = i("gpus", 1, MAX_GPUS)
    m.choice(s, "gpu", "weight_dtype", tuple(WEIGHT_DTYPE_BYTES))
    m.choice(s, "gpu", "compute_dtype", COMPUTE_DTYPES)
    for key, bounds in (("mfu", "mfu"), ("mbu", "mbu"), ("overhead_us", "overhead_us")):
        f(key, *FACTOR_BOUNDS[bounds])
        f(f"decode_{key}", *FACTOR_BOUNDS[bounds], optional=True)
    f("memory_utilization", 0.0, 1.0, lo_open=True)
    # the FP8 GEMMs' efficiency scales mfu: an effective fraction of peak no smaller than mfu's own bound
    f("fp8_mfu_scale", FACTOR_BOUNDS["mfu"][0], 1.0)
    # the MoE layers' fixed time per step (engine era 2025); absent in older traces
    f("moe_layer_us", *FACTOR_BOUNDS["overhead_us"])
    f("moe_expert_us", *FACTOR_BOUNDS["overhead_us"])
    f("moe_mfu_scale", FACTOR_BOUNDS["mfu"][0], 1.0)
    # the MLA layers' fixed time per step (engine era 2025); absent in older traces
    f("mla_layer_us", *FACTOR_BOUNDS["overhead_us"])
    p = f("roofline_p", 0.0, _ROOFLINE_P_MAX)
    if p is not None and 0 < p < 1:
        m.fail("gpu.roofline_p", f"must be 0 (the plain maximum) or from 1 to {_ROOFLINE_P_MAX:g}, got {p:g}")
    for key in ("tier_weight_bytes", "weight_bytes"):
        i(key, 0, MAX_SIZE)
    f("hbm_kv_bytes", -MAX_SIZE, MAX_SIZE)
    tp = i("tp", 0, MAX_GPUS)
    pp = i("pp", 1, model["layers"])
    ep = i("ep", 1, MAX_GPUS)
    i("kv_shards", 1, MAX_GPUS)
    i("kv_links", 1, MAX_GPUS)
    dp = s.get("dp_attention", False)
    if not isinstance(dp, bool):
        m.fail("gpu.dp_attention", f"must be true or false, got {_short(dp)}")
    i("attention_bytes", 0, MAX_SIZE)
    if dp is True and not (isinstance(tp, int) and tp >= 2):
        m.fail("gpu.dp_attention", f"needs gpu.tp of 2 or more, got {_short(tp)}")
    if tp:  # the parallelism kvemu record accepts (engine.timing._parallelism)
        heads = model.get("attention_heads")
        if heads is not None and heads % tp:
            m.fail("gpu.tp", f"{tp} does not divide model.attention_heads {heads}")
        pp = 1 if pp is None else pp
        if gpus is not None and gpus != tp * pp:
            m.fail("gpu.gpus", f"{gpus} differs from gpu.tp x gpu.pp = {tp * pp}")
        if ep is not None and ep > 1:
            if ep != tp:
                m.fail("gpu.ep", f"must be 1 or gpu.tp ({tp}), got {ep}")
            if not model.get("moe_layers") or model.get("experts", 0) % ep:
                m.fail("gpu.ep", f"{ep} needs a MoE model whose experts it divides")
        ranks = tp * pp
        # a collective over more than one GPU divides by the bus bandwidth of its fabric
        for key, used in (("allreduce_busbw_gbps", ranks > 1), ("scaleout_busbw_gbps", ranks > (node or 8))):
            if used and key in s and not s[key] > 0:
                m.fail(f"gpu.{key}", f"must be > 0 for {ranks} GPUs (tp {tp} x pp {pp}), got {s[key]}")


def _check_compute(m: _Meta) -> None:
    """A ``compute`` blob's shape, ``{model, version, params}`` (engine/compute.py): a model's name, a
    version, a mapping of parameters. The parameters are the model's business, not the format's: the
    model validates them where it is built (analysis.check_compute_meta, timing_from_meta, ``trace
    validate``). Traces from before the blob (the roofline's terms in ``gpu``, aiconfigurator's
    summary without ``params``) are checked where they are."""
    rec = m.meta.get("compute")
    if not (isinstance(rec, dict) and "params" in rec):
        return
    if not isinstance(rec.get("model"), str) or not rec["model"]:
        m.fail("compute.model", f"must name a compute model, got {_short(rec.get('model'))}")
    v = rec.get("version")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        m.fail("compute.version", f"must be a whole number >= 1, got {_short(v)}")
    if not isinstance(rec["params"], dict):
        m.fail("compute.params", f"must be a mapping of the model's parameters, got {_short(rec['params'])}")


def _check_deployment(m: _Meta) -> None:
    """The deployment the trace is meant for (`kvemu record --prefill-instances`), bounded as
    replay's options are (kvemu.deployment)."""
    s = m.section("deployment")
    if s is None:
        return
    for key in ("prefill_instances", "decode_instances"):
        if key not in s:
            m.fail(f"deployment.{key}", "is missing")
    try:
        check_deployment("deployment", **{k: s.get(k) for k in FIELDS})
    except OptionError as e:
        m.fail(e.field, e.render(lambda name: name)[len(e.field) + 1:])


def _check_weights(m: _Meta, model: dict) -> None:
    s = m.section("weights")
    if s is None or not s.get("placed_bytes"):
        return
    i = lambda key, lo, hi, **kw: m.number(s, "weights", key, lo, hi, integer=True, **kw)  # noqa: E731
    placement = m.choice(s, "weights", "placement", ("dense", "cold-experts"), required=True)
    m.number(s, "weights", "fraction", 0.0, 1.0, required=True)
    i("placed_bytes", 0, MAX_SIZE)
    i("layers", 1, model["layers"], required=True)
    m.choice(s, "weights", "stream", STREAMS)
    m.text(s, "weights", "link")
    m.number(s, "weights", "link_gbps", 0.0, _FIGURE_MAX, lo_open=True)
    experts = i("experts", 0, _DIM_MAX)
    i("top_k", 0, experts if experts is not None else _DIM_MAX)
    i("moe_layers", 0, model["layers"])
    i("cold_experts", 0, experts if experts is not None else _DIM_MAX)
    i("expert_bytes", 0, MAX_SIZE)
    if placement == "cold-experts" and not s.get("experts"):
        m.fail("weights.experts", "must be positive for cold experts")


def _check_workload(m: _Meta) -> None:
    s = m.section("workload", required=True)
    m.text(s, "workload", "source", required=True)
    m.text(s, "workload", "kind")
    m.number(s, "workload", "hash_block_tokens", 1, _INT32_MAX, integer=True, optional=True)
    m.number(s, "workload", "requests", 0, _INT32_MAX, integer=True)
    if "time_scale" in s and time_scale_problem(s["time_scale"]):
        m.fail("workload.time_scale", time_scale_problem(s["time_scale"]))
    m.number(s, "workload", "prefix_hit_ratio_unbounded", 0.0, 1.0, optional=True)
    _check_block_rule(m, s)


def _check_block_rule(m: _Meta, workload: dict) -> None:
    """``workload.block_rule`` (kvemu.blockrule, docs/workloads.md): optional, versioned."""
    r = workload.get("block_rule")
    if r is None:
        return
    if not isinstance(r, dict):
        m.fail("workload.block_rule", f"must be an object, got {_short(r)}")
    if r.get("version") != BLOCK_RULE_VERSION:
        m.fail("workload.block_rule.version", f"must be {BLOCK_RULE_VERSION}, got {_short(r.get('version'))}")
    sec = "workload.block_rule"
    m.number(r, sec, "block_tokens", 1, _INT32_MAX, integer=True, optional=True, required=True)
    m.choice(r, sec, "scope", SCOPES, required=True)
    if not isinstance(r.get("partial"), bool):
        m.fail(f"{sec}.partial", f"must be true or false, got {_short(r.get('partial'))}")
    m.choice(r, sec, "time_unit", tuple(TIME_UNITS), required=True)
    m.number(r, sec, "context_cap", 1, _INT32_MAX, integer=True, optional=True, required=True)
    m.choice(r, sec, "truncate", TRUNCATIONS, required=True)
    hbt = workload.get("hash_block_tokens")
    if r.get("block_tokens") != hbt:
        m.fail(f"{sec}.block_tokens", f"({r.get('block_tokens')}) must equal workload.hash_block_tokens ({hbt})")


def _check_load(m: _Meta) -> None:
    s = m.section("load")
    if s is None:
        return
    big = 1e30
    for key in ("arrival_span_s", "makespan_s", "busy_s", "queue_p50_s"):
        m.number(s, "load", key, 0.0, big, required=True)
    m.number(s, "load", "queue_share", 0.0, 1.0, required=True)
    for key in ("utilisation", "makespan_over_span"):
        m.number(s, "load", key, 0.0, big, optional=True)
    m.number(s, "load", "suggest_time_scale", 0.0, big, lo_open=True, optional=True)
    if not isinstance(s.get("overloaded", False), bool):
        m.fail("load.overloaded", f"must be true or false, got {_short(s['overloaded'])}")
    m.text(s, "load", "gpus", optional=True)


def _check_schedule(m: _Meta) -> None:
    s = m.meta["schedule"]
    for key in ("source", "engine_model", "why"):
        m.text(s, "schedule", key)


# ------------------------------------------------------------------------------ rows
def check_timeline(where, arrival_ms: np.ndarray, start_ns: np.ndarray, compute_ns: np.ndarray) -> None:
    """The recorded timeline fits kvemu's int64 nanosecond clock with room: the last arrival plus
    every step's compute (a closed-loop replay can run them one after the other), and every
    recorded step's end, at most MAX_TIMELINE_NS."""
    last_arrival_ns = float(arrival_ms[-1]) * 1e6 if len(arrival_ms) else 0.0
    if len(compute_ns) and (np.any(start_ns < 0) or float(np.max(start_ns)) > MAX_TIMELINE_NS):
        raise TraceError(f"{where}: step start_ns must be from 0 to 2^60 ns (36.5 years)")
    total = last_arrival_ns + float(compute_ns.sum(dtype=np.float64))
    end = float(np.max(start_ns.astype(np.float64) + compute_ns)) if len(compute_ns) else 0.0
    if not max(total, end) <= MAX_TIMELINE_NS:
        raise TraceError(f"{where}: the timeline (last arrival + every step's compute_ns = "
                         f"{max(total, end) / 1e9 / 86400 / 365.25:.3g} years) exceeds the 2^60 ns (36.5 years) "
                         f"kvemu's int64 nanosecond clock leaves room for")


def _group_order(keys: np.ndarray) -> np.ndarray:
    """np.argsort(keys, kind="stable"), as a radix sort of 16-bit keys where the keys span less
    than 2^16 (a batch of entries names a window of requests): the same order, a few times faster."""
    if not len(keys):
        return np.zeros(0, np.intp)
    lo = int(keys.min())
    if int(keys.max()) - lo < 1 << 16:
        return np.argsort((keys - lo).astype(np.uint16), kind="stable")
    return np.argsort(keys, kind="stable")


class RequestAccounting:
    """Each request's entries, in step order, must add up to its tokens as an engine computes
    them (docs/trace-format.md, "Validation"): its prefill chunks first, the first starting at
    ``cached_tokens``, each starting where the one before ended, the last ending at
    ``input_tokens``; then ``output_tokens - 1`` decode entries of one token each, at contexts
    ``input_tokens``, ``input_tokens + 1``, ... (the KV of the last generated token is never
    computed); a request at most once per step. Fed every batch of a full pass (``add``), then
    ``finish``."""

    def __init__(self, where, input_tokens, output_tokens, cached_tokens):
        self.where = where
        self.inp = np.asarray(input_tokens, np.int64)
        self.out = np.asarray(output_tokens, np.int64)
        self.next = np.asarray(cached_tokens, np.int64).copy()  # where each request's next entry starts
        self.phase = np.zeros(len(self.inp), np.int8)
        self.last_step = np.full(len(self.inp), -1, np.int64)

    def _fail(self, rid, step, reason):
        raise TraceError(f"{self.where}: request {int(rid)} step {int(step)}: {reason}")

    def add(self, e: dict, rid=None, step=None, context=None) -> None:
        """``rid``, ``step``, ``context``: the batch's request_id, step and context_tokens as int64,
        when the caller has converted them."""
        rid = e["request_id"].astype(np.int64) if rid is None else rid
        order = _group_order(rid)  # each request's entries together, in step order
        r = rid[order]
        st = (e["step"].astype(np.int64) if step is None else step)[order]
        ph = e["phase"].astype(np.int8, copy=False)[order]
        tok = e["tokens"].astype(np.int64)[order]
        ctx = (e["context_tokens"].astype(np.int64) if context is None else context)[order]
        first = np.empty(len(r), bool)
        first[0] = True
        np.not_equal(r[1:], r[:-1], out=first[1:])
        at = np.flatnonzero(first)  # each request's first entry in the batch: its state from earlier batches
        rf = r[at]
        end = ctx + tok
        prev_end = np.empty_like(end)
        prev_end[1:] = end[:-1]
        prev_end[at] = self.next[rf]
        prev_phase = np.empty_like(ph)
        prev_phase[1:] = ph[:-1]
        prev_phase[at] = self.phase[rf]
        prev_step = np.empty_like(st)
        prev_step[1:] = st[:-1]
        prev_step[at] = self.last_step[rf]
        inp, out = self.inp[r], self.out[r]
        decode = ph == 1
        prefill = ph == 0
        checks = (
            (st == prev_step, lambda j: "appears twice in one step"),
            (ph < prev_phase, lambda j: "a prefill entry after its decode entries"),
            (ctx != prev_end, lambda j: f"context_tokens {int(ctx[j])}, but its entries so far reach "
                                        f"{int(prev_end[j])} tokens"),
            (lambda: prefill & (end > inp), lambda j: f"prefill of {int(tok[j])} tokens at context {int(ctx[j])} "
                                                      f"goes past its {int(inp[j])} input tokens"),
            (lambda: decode & (ctx < inp), lambda j: f"decode at context {int(ctx[j])} before its {int(inp[j])} "
                                                     f"input tokens are computed"),
            (lambda: decode & (tok != 1), lambda j: f"a decode entry of {int(tok[j])} tokens (one per step)"),
            (lambda: decode & (end > inp + out - 1), lambda j: f"decode at context {int(ctx[j])}: more than its "
                                                               f"{int(out[j])} output tokens need"),
        )
        for bad, why in checks:
            bad = bad() if callable(bad) else bad
            if np.any(bad):
                j = int(np.argmax(bad))
                self._fail(r[j], st[j], why(j))
        last = np.empty(len(r), bool)
        last[-1] = True
        last[:-1] = first[1:]
        self.next[r[last]] = end[last]
        self.phase[r[last]] = ph[last]
        self.last_step[r[last]] = st[last]

    def finish(self) -> None:
        want = self.inp + self.out - 1
        bad = self.next != want
        if np.any(bad):
            j = int(np.argmax(bad))
            raise TraceError(f"{self.where}: request {j}'s entries cover {int(self.next[j])} of its "
                             f"{int(want[j])} tokens to compute (input {int(self.inp[j])} + output "
                             f"{int(self.out[j])} - 1, from cached_tokens)")


# ------------------------------------------------------------------------------ results
#: Results columns that are times or sizes: finite and not negative in every row (tpot_ms and the
#: inter-token latencies may be NaN where a request has one output token: nothing to average).
RESULTS_NONNEGATIVE = ("arrival_ms", "input_tokens", "output_tokens", "cached_tokens", "ttft_ms", "e2el_ms",
                       "queue_ms", "compute_ms", "kv_load_ms", "kv_store_ms", "kv_read_ms", "kv_stall_ms",
                       "kv_bytes_loaded", "kv_bytes_stored", "kv_bytes_read",
                       # a disaggregated deployment's (docs/replay.md): prefill_instance may be -1
                       "handoff_bytes", "handoff_ns", "handoff_overlap_ns", "handoff_pool_blocks", "ttft_queue_ns",
                       "ttft_prefill_ns", "ttft_handoff_ns", "ttft_first_decode_ns", "decode_instance",
                       # a trace with sessions' (kvemu.sessions)
                       "session_id", "turn")
RESULTS_NAN_ALLOWED = ("tpot_ms",)


def check_results_table(where, table) -> None:
    """A results table's per-request values: finite and >= 0 where they must be (ResultsError)."""
    def bad_values(arr: np.ndarray, nan_ok: bool) -> bool:
        a = arr.astype(np.float64, copy=False)
        if nan_ok:
            a = a[~np.isnan(a)]
        return bool(np.any(~np.isfinite(a)) or np.any(a < 0))

    for name in (*RESULTS_NONNEGATIVE, *RESULTS_NAN_ALLOWED):
        if name not in table.column_names:
            continue
        col = table.column(name)
        if col.null_count:
            raise ResultsError(f"{where}: column '{name}' has nulls")
        if bad_values(col.to_numpy(zero_copy_only=False), name in RESULTS_NAN_ALLOWED):
            raise ResultsError(f"{where}: column '{name}' must hold finite values >= 0")
    if "itl_ms" in table.column_names:
        flat = pa.chunked_array([list_values(c) for c in table.column("itl_ms").chunks],
                                type=table.schema.field("itl_ms").type.value_type)
        if flat.null_count or bad_values(flat.to_numpy(zero_copy_only=False), False):
            raise ResultsError(f"{where}: column 'itl_ms' must hold finite values >= 0")


#: Results columns of where each prompt token came from (docs/replay.md, "Results file"): each row's
#: hbm_hit_tokens + tier_hit_tokens = cached_tokens <= input_tokens, recomputed_tokens the rest.
RESULTS_TOKEN_COLUMNS = ("hbm_hit_tokens", "tier_hit_tokens", "recomputed_tokens")
#: Per-level token lists of a stack run (one value per level, top first), none negative.
RESULTS_LEVEL_LISTS = ("stack_level_tokens", "stack_late_tokens")
#: Largest figure a results cost section may hold (USD, J, GPU-hours, bytes): far above any run.
_COST_MAX = 1e18


def check_results_tokens(where, table) -> None:
    """Each request's tokens add up (ResultsError naming the first request that does not): cached at
    most the input, its HBM and tier hits adding up to it and the recomputed tokens the rest, the
    per-level lists not negative (their sum is no check: a level's tokens are counted in whole
    blocks, each time a load is replayed)."""
    names = table.column_names
    if "cached_tokens" not in names or "input_tokens" not in names:
        return
    col = lambda n: table.column(n).to_numpy(zero_copy_only=False).astype(np.int64)  # noqa: E731
    rid = table.column("request_id").to_numpy(zero_copy_only=False) if "request_id" in names else None
    inp, cached = col("input_tokens"), col("cached_tokens")

    def fail(mask, reason):
        i = int(np.flatnonzero(mask)[0])
        who = f"request {int(rid[i])}" if rid is not None else f"row {i}"
        raise ResultsError(f"{where}: {who}: {reason(i)}")

    bad = cached > inp
    if bad.any():
        fail(bad, lambda i: f"cached_tokens {cached[i]} exceed its input_tokens {inp[i]}")
    present = [n for n in RESULTS_TOKEN_COLUMNS if n in names]
    for n in present:
        v = col(n)
        if (v < 0).any():
            fail(v < 0, lambda i, n=n, v=v: f"{n} must be >= 0, got {v[i]}")
    if "hbm_hit_tokens" in names and "tier_hit_tokens" in names:
        hbm, tier = col("hbm_hit_tokens"), col("tier_hit_tokens")
        bad = hbm + tier != cached
        if bad.any():
            fail(bad, lambda i: f"hbm_hit_tokens {hbm[i]} + tier_hit_tokens {tier[i]} != cached_tokens {cached[i]}")
    if "recomputed_tokens" in names:
        rec = col("recomputed_tokens")
        bad = rec != inp - cached
        if bad.any():
            fail(bad, lambda i: f"recomputed_tokens {rec[i]} != input_tokens {inp[i]} - cached_tokens {cached[i]}")
    for n in RESULTS_LEVEL_LISTS:
        if n not in names:
            continue
        lists = table.column(n).to_pylist()
        for i, lv in enumerate(lists):
            if lv is None:
                continue
            if any(x is None or x < 0 for x in lv):
                fail(np.arange(len(lists)) == i, lambda i, n=n, lv=lv: f"{n} must hold values >= 0, got {lv[:8]}")


def _cost_number(where, field: str, v, lo: float = 0.0, hi: float = _COST_MAX) -> None:
    if v is None:
        return
    why = number_problem(v, lo, hi)
    if why:
        raise ResultsError(f"{where}: results metadata {field} {why}")


def check_results_meta(where, meta: dict) -> None:
    """The sections of a results file's metadata that a report prints as figures: ``cost`` (every
    figure None or a finite number from 0, its amortisation period in the option's bounds, its texts
    strings) and ``schedule.stack``'s levels (every number finite and >= 0). ResultsError naming the
    field, never a traceback or a negative cost in a table."""
    cost = meta.get("cost")
    if cost is not None:
        if not isinstance(cost, dict):
            raise ResultsError(f"{where}: results metadata cost must be an object, got {_short(cost)}")
        for k, v in cost.items():
            if k in ("inputs", "levels", "prices", "notes"):
                continue
            if isinstance(v, str) and k not in ("priced_as", "figures", "note", "capacity_from", "duration_from"):
                raise ResultsError(f"{where}: results metadata cost.{k} must be a number, got {_short(v)}")
            if not isinstance(v, str):
                _cost_number(where, f"cost.{k}", v)
        inputs = cost.get("inputs")
        if inputs is not None:
            if not isinstance(inputs, dict):
                raise ResultsError(f"{where}: results metadata cost.inputs must be an object, got {_short(inputs)}")
            for k, v in inputs.items():
                if k == "gpu":
                    if v is not None and not isinstance(v, str):
                        raise ResultsError(f"{where}: results metadata cost.inputs.gpu must be a string, got {_short(v)}")
                elif k == "amortise_years":
                    _cost_number(where, "cost.inputs.amortise_years", v, *AMORTISE_YEARS_BOUNDS)
                else:
                    _cost_number(where, f"cost.inputs.{k}", v)
        levels = cost.get("levels")
        if levels is not None:
            if not isinstance(levels, list) or not all(isinstance(lv, dict) for lv in levels):
                raise ResultsError(f"{where}: results metadata cost.levels must be a list of objects")
            for j, lv in enumerate(levels):
                for k in ("gb", "usd", "joules", "usd_per_gb", "watts_per_gb"):
                    _cost_number(where, f"cost.levels[{j}].{k}", lv.get(k))
        for k in ("prices", "notes"):
            if cost.get(k) is not None and not isinstance(cost[k], dict if k == "prices" else list):
                raise ResultsError(f"{where}: results metadata cost.{k} must be "
                                   f"{'an object' if k == 'prices' else 'a list'}, got {_short(cost[k])}")
    sched = meta.get("schedule")
    stack = sched.get("stack") if isinstance(sched, dict) else None
    if isinstance(stack, dict) and stack.get("levels") is not None:
        levels = stack["levels"]
        if not isinstance(levels, list) or not all(isinstance(lv, dict) for lv in levels):
            raise ResultsError(f"{where}: results metadata schedule.stack.levels must be a list of objects")
        for j, lv in enumerate(levels):
            for k, v in lv.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    _cost_number(where, f"schedule.stack.levels[{j}].{k}", v, 0.0, float(MAX_SIZE))


def check_sessions(where, meta: dict, n_requests: int) -> None:
    """A trace's ``sessions`` metadata (kvemu.sessions; absent: no sessions): version 1, one
    ``parent`` (-1 or an earlier request), ``gap_ms`` (finite, >= 0), ``session`` and ``turn``
    (derived from the parents) per request. TraceError naming the field."""
    s = meta.get("sessions")
    if s is None:
        return
    def fail(field: str, why: str):
        raise TraceError(f"{where}: sessions.{field} {why}")

    if not isinstance(s, dict):
        raise TraceError(f"{where}: sessions must be an object, got {_short(s)}")
    if s.get("version") != SESSIONS_VERSION:
        fail("version", f"must be {SESSIONS_VERSION}, got {_short(s.get('version'))}")
    if s.get("gap_from") not in GAP_SOURCES:
        fail("gap_from", f"must be one of {', '.join(GAP_SOURCES)}, got {_short(s.get('gap_from'))}")
    arrays = {}
    for key, kind in (("parent", int), ("gap_ms", float), ("session", int), ("turn", int)):
        v = s.get(key)
        ok = isinstance(v, list) and all((type(x) is int and abs(x) < 1 << 62)
                                         or (kind is float and type(x) is float) for x in v)
        if not ok:
            fail(key, f"must be a list of {'numbers' if kind is float else 'integers'}")
        arrays[key] = np.array(v, np.float64 if kind is float else np.int64) if v else np.zeros(0, np.int64)
    problem = graph_problem(arrays["parent"], arrays["gap_ms"].astype(np.float64), arrays["session"],
                            arrays["turn"], n_requests)
    if problem:
        raise TraceError(f"{where}: {problem}")
    for key, value in (("sessions", int(arrays["session"].max()) + 1 if n_requests else 0),
                       ("max_turn", int(arrays["turn"].max()) if n_requests else 0)):
        if type(s.get(key)) is not int or s[key] != value:
            fail(key, f"must be {value} (from the lists), got {_short(s.get(key))}")
