"""Workload-level facts of a trace: KV traffic, dedup, and the unbounded prefix-hit ratio."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .backends import prefix_threshold_runs as _c_threshold_runs
from .bounds import MAX_BREAKEVEN_GPUS, WEIGHT_DTYPE_BYTES
from .engine.aic import INSTALL_HINT
from .engine.compute import compute_blob, compute_from_blob, gpu_figures, roofline_params, validate_blob
from .engine.kvgeometry import group_traffic, pool_block_bytes
# the offered load is recorded by the engine (kvemu/engine/load.py); its names stay importable from here
from .engine.load import OVERLOAD_QUEUE_SHARE, gpus_text, load_from_entries, load_line, offered_load  # noqa: F401
from .engine.timing import ERA_TERMS, GPU_PRESETS, GpuSpec, GpuTiming, check_dp_attention, era_of, get_gpu, make_timing
from .errors import ConfigError, TraceError
from .models import geometry_from_meta, resolve_model
from .schema import OPS, TraceData, expand_runs, iter_entries
from .units import check_number
from .validation import check_timing_meta


def prefix_hit_ratio_unbounded(trace: TraceData, stream: tuple[np.ndarray, np.ndarray] | None = None,
                               thresholds=None) -> float:
    """Fraction of input tokens whose block and every block before it appeared in an earlier
    request (in arrival order): the Mooncake paper's "cache ratio" with an unbounded cache.

    Counted over full input blocks (a partial last block holds content of its request alone).
    ``stream``: input_block_stream(trace), ``thresholds``: prefix_hit_thresholds(trace, stream),
    when the caller already has them."""
    return float(prefix_hit_tokens_unbounded(trace, stream, thresholds).sum() / trace.input_tokens.sum())


def prefix_hit_tokens_unbounded(trace: TraceData, stream: tuple[np.ndarray, np.ndarray] | None = None,
                                thresholds=None) -> np.ndarray:
    """Per request (int64): the prompt tokens an unbounded prefix cache holding every earlier
    request of the trace would serve it, :func:`prefix_hit_ratio_unbounded` request by request
    (full input blocks whose block and every block before it appeared in an earlier request).

    ``thresholds`` (prefix_hit_thresholds(trace, stream) or prefix_threshold_runs(trace)), when the
    caller has them: a request's
    first block never referenced before is its first reference of the whole stream (a block of the
    request seen in no earlier request is new at its first place in the request), the first whose
    threshold is a first reference's (THRESHOLD_BIG - 1), so the hits are the blocks before that."""
    tpb = trace.header.tokens_per_block
    if thresholds is not None:
        runs = _as_runs(trace, thresholds)
        return runs.hits_per_request(THRESHOLD_BIG - 1) * tpb
    ids, req = stream if stream is not None else input_block_stream(trace)
    if len(ids) == 0:
        return np.zeros(trace.n_requests, np.int64)
    n_full = trace.input_tokens // tpb
    seg_begin = np.cumsum(n_full) - n_full
    # the request each id first appeared in (requests arrive in order): one slot per id
    first_req = np.full(int(ids.max()) + 1, trace.n_requests, np.int64)
    np.minimum.at(first_req, ids, req)
    # a request's hits are its blocks before its first one unseen in earlier requests
    miss_pos = np.r_[np.flatnonzero(first_req[ids] >= req), len(ids)]
    seg_begin = seg_begin.astype(np.int64)
    first_miss = miss_pos[np.searchsorted(miss_pos, seg_begin, side="left")]
    return (np.minimum(first_miss, seg_begin + n_full) - seg_begin).astype(np.int64) * tpb


def _prefix_hits(trace: TraceData) -> dict:
    """The summary's hit ratios: ``prefix_hit_ratio_unbounded`` under the trace's block rule where it
    records one (kvemu.blockrule: the source's hash blocks, computed when it was recorded), else over
    its full engine blocks; ``prefix_hit_ratio_engine_blocks`` always over the engine blocks."""
    engine = prefix_hit_ratio_unbounded(trace)
    w = trace.header.meta.get("workload") or {}
    rule = w.get("block_rule")
    ruled = w.get("prefix_hit_ratio_unbounded")
    return {"prefix_hit_ratio_unbounded": engine if ruled is None else float(ruled),
            "prefix_hit_ratio_engine_blocks": engine, "block_rule": rule}


#: Entry columns the summary's totals need.
TOTAL_COLUMNS = ("phase", "load_count", "store_count", "read_count")


def add_entry_totals(totals: dict, e: dict) -> dict:
    """Adds one batch of entry rows (TOTAL_COLUMNS at least) to ``totals``, a dict that starts
    empty: entries, prefill entries and blocks per op, what trace_summary reports."""
    totals["entries"] = totals.get("entries", 0) + len(e["phase"])
    totals["prefill"] = totals.get("prefill", 0) + int(np.count_nonzero(e["phase"] == 0))
    for op in OPS:
        totals[op] = totals.get(op, 0) + int(e[f"{op}_count"].sum(dtype=np.int64))
    return totals


#: Context lengths `trace info` gives a model's KV bytes per token at.
BYTES_PER_TOKEN_CONTEXTS = (1024, 8192, 131072)


def trace_geometry(trace: TraceData):
    """A trace's model geometry (models.geometry_from_meta): its KV groups where it records them,
    full attention in every layer otherwise."""
    return geometry_from_meta(trace.header.model)


def kv_group_bytes(trace: TraceData) -> dict:
    """Bytes each op moves over a trace's KV groups (engine/kvgeometry.group_traffic), one pass over
    the entries; for a trace with KV groups only."""
    h = trace.header
    groups = trace_geometry(trace).kv_groups
    eng = h.meta.get("engine", {})
    n_full = trace.input_tokens.astype(np.int64) // h.tokens_per_block
    out = dict.fromkeys(OPS, 0)
    cols = ("request_id", *(f"{op}_{k}" for op in OPS for k in ("first", "count")))
    for e in iter_entries(trace, columns=cols):
        got = group_traffic(groups, h.tokens_per_block, eng.get("tier_policy", "offload"),
                            int(eng.get("checkpoint_blocks") or 0), e, n_full)
        for op in OPS:
            out[op] += got[op]
    return out


def trace_summary(trace: TraceData, prefix_hits: bool = True, totals: dict | None = None) -> dict:
    """Workload-level facts. ``prefix_hits=False`` leaves out prefix_hit_ratio_unbounded, the one
    figure that needs every prompt block reference in memory (a replay does without it).
    ``totals``: add_entry_totals over every entry row, when the caller has streamed them anyway.

    KV bytes follow the trace's KV groups (kv_group_bytes: a windowed layer moves only its window's
    blocks, a linear layer its state; one more pass over the entries); a block (``block_bytes_all_layers``)
    is a block of the growing groups then, and the referenced and unique KV bytes count those."""
    h = trace.header
    geometry = trace_geometry(trace)
    block_bytes_all_layers = (h.block_bytes_per_layer * h.layers if geometry.uniform
                              else pool_block_bytes(geometry, h.tokens_per_block))
    if totals is None:
        totals = {}
        for e in iter_entries(trace, columns=TOTAL_COLUMNS):
            add_entry_totals(totals, e)
    entries, prefill = totals.get("entries", 0), totals.get("prefill", 0)
    blocks = {op: totals.get(op, 0) for op in OPS}
    op_bytes = ({op: blocks[op] * block_bytes_all_layers for op in OPS} if geometry.uniform
                else kv_group_bytes(trace))
    referenced = int(trace.table_offsets[-1])
    unique = trace.unique_blocks()
    eng = h.meta.get("engine", {})
    return {
        "requests": trace.n_requests,
        "steps": len(trace.step),
        "entries": entries,
        "prefill_entries": prefill,
        "decode_entries": entries - prefill,
        "input_tokens": int(trace.input_tokens.sum()),
        "output_tokens": int(trace.output_tokens.sum()),
        "cached_tokens": int(trace.cached_tokens.sum()),
        "tier_hit_tokens": int(trace.tier_hit_tokens.sum()),
        "model": h.model.get("name"),
        "tier_policy": eng.get("tier_policy"),
        "tokens_per_block": h.tokens_per_block,
        "block_bytes_all_layers": block_bytes_all_layers,
        "kv_blocks_stored": blocks["store"],
        "kv_blocks_loaded": blocks["load"],
        "kv_blocks_read": blocks["read"],
        "kv_bytes_stored": op_bytes["store"],
        "kv_bytes_loaded": op_bytes["load"],
        "kv_bytes_read": op_bytes["read"],
        "kv_groups": [g.to_dict() for g in geometry.kv_groups],
        "kv_bytes_per_token_at": {str(L): geometry.kv_bytes_per_token_at(L) for L in BYTES_PER_TOKEN_CONTEXTS},
        "referenced_blocks": referenced,
        "unique_blocks": unique,
        "dedup_ratio": referenced / unique if unique else 1.0,
        "unique_kv_bytes": unique * block_bytes_all_layers,
        "referenced_kv_bytes": referenced * block_bytes_all_layers,
        **(_prefix_hits(trace) if prefix_hits else {}),
        "modelled_makespan_s": (int(trace.start_ns[-1] + trace.compute_ns[-1]) / 1e9) if len(trace.step) else 0.0,
        "file_bytes": h.file_bytes,
    }


# ------------------------------------------------------------------------------ capacity curve
def _stream_runs(trace: TraceData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`input_block_stream` as runs of consecutive ids: the tables' runs, each cut to its
    request's full input blocks (some to nothing), and where each request's references begin
    (n_requests + 1 offsets)."""
    tpb = trace.header.tokens_per_block
    n_full = (trace.input_tokens // tpb).astype(np.int64)
    run_req = np.repeat(np.arange(trace.n_requests), np.diff(trace.run_offsets))
    # each run's first position in its request's table
    in_table = np.cumsum(trace.run_count) - trace.run_count - trace.table_offsets[:-1][run_req]
    count = np.clip(n_full[run_req] - in_table, 0, trace.run_count)
    offsets = np.zeros(trace.n_requests + 1, np.int64)
    np.cumsum(n_full, out=offsets[1:])
    return trace.run_start, count, offsets


def input_block_stream(trace: TraceData) -> tuple[np.ndarray, np.ndarray]:
    """Every request's full input blocks in arrival order: (block ids, request of each reference).

    This is the reference stream a prefix cache in the tier sees: each request looks up (and, on a
    miss, stores) its prompt blocks when it is admitted."""
    # from the tables' runs, each cut to the request's full input blocks: the tables are not
    # expanded (table_ids) and no reference is gathered
    start, count, offsets = _stream_runs(trace)
    return expand_runs(start, count), np.repeat(np.arange(trace.n_requests), np.diff(offsets))


#: Above every threshold and capacity (in blocks): a first reference's threshold is one below it.
THRESHOLD_BIG = 1 << 40


@dataclass(frozen=True)
class ThresholdRuns:
    """:func:`prefix_hit_thresholds` in runs of one threshold within one request (a request's
    thresholds only grow, and a prompt stream repeats whole runs of blocks: tens of thousands of
    runs for millions of references). ``key``: each run's request x THRESHOLD_BIG + its threshold
    (ascending); ``values``: its threshold; ``before``: the references before each run, and all of
    them last (one more than the runs); ``unique``: the distinct block ids of the stream (None: not
    counted)."""

    key: np.ndarray
    values: np.ndarray
    before: np.ndarray
    n_requests: int
    unique: int | None

    @property
    def references(self) -> int:
        return int(self.before[-1])

    def expand(self) -> np.ndarray:
        """The threshold of every reference (int64), prefix_hit_thresholds' first array."""
        return np.repeat(self.values, np.diff(self.before))

    def _before_capacity(self, capacity: int) -> np.ndarray:
        """Per request, the references (over the stream) before its first one with a threshold of at
        least ``capacity`` (below THRESHOLD_BIG): its thresholds offset by its request are sorted."""
        offsets = np.arange(self.n_requests, dtype=np.int64) * THRESHOLD_BIG
        return self.before[np.searchsorted(self.key, offsets + int(capacity), side="left")]

    def hits_per_request(self, capacity: int, first: np.ndarray | None = None) -> np.ndarray:
        """Each request's blocks that hit in an LRU tier of ``capacity`` blocks (int64); ``first``:
        ``_before_capacity(0)``, when the caller has it."""
        return self._before_capacity(capacity) - (self._before_capacity(0) if first is None else first)


def prefix_threshold_runs(trace: TraceData) -> ThresholdRuns:
    """:func:`prefix_hit_thresholds` as :class:`ThresholdRuns`, from the tables' runs in one C pass
    (cbackends/stackdist.c): no per-reference array is built."""
    start, count, offsets = _stream_runs(trace)
    values, end, request, unique = _c_threshold_runs(start, count, int(trace.header.meta["blocks"]["id_space"]),
                                                     offsets, THRESHOLD_BIG - 1)
    return ThresholdRuns(request * THRESHOLD_BIG + values, values, np.r_[0, end].astype(np.int64),
                         trace.n_requests, unique)


def prefix_hit_thresholds(trace: TraceData, stream: tuple[np.ndarray, np.ndarray] | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
    """For every prompt-block reference (input_block_stream order): the capacity in blocks it needs
    to hit, exclusive (it hits in an LRU tier of C blocks when C > threshold), and its request.

    A block hits when its LRU stack distance is below C; with prefix caching it also needs every
    earlier block of its prompt to hit, so its threshold is the running maximum of the distances
    within its request (first references: THRESHOLD_BIG - 1). ``stream``: input_block_stream(trace),
    when the caller already has it (its requests are returned)."""
    req = stream[1] if stream is not None else input_block_stream(trace)[1]
    return prefix_threshold_runs(trace).expand(), req


def _as_runs(trace: TraceData, thresholds, stream=None, count_unique: bool = False) -> ThresholdRuns:
    """``thresholds`` as ThresholdRuns: as they are, computed (None), or from prefix_hit_thresholds'
    arrays (the distinct ids then counted over ``stream``, input_block_stream(trace), with
    ``count_unique``; else None)."""
    if isinstance(thresholds, ThresholdRuns):
        return thresholds
    if thresholds is None:
        return prefix_threshold_runs(trace)
    m, req = thresholds
    unique = None
    if count_unique:
        ids = (stream if stream is not None else input_block_stream(trace))[0]
        unique = distinct_ids(ids, int(trace.header.meta["blocks"]["id_space"]))
    if len(m) == 0:
        return ThresholdRuns(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64),
                             trace.n_requests, unique)
    change = np.not_equal(m[1:], m[:-1])
    change |= req[1:] != req[:-1]
    starts = np.r_[0, np.flatnonzero(change) + 1]
    values = m[starts].astype(np.int64)
    return ThresholdRuns(req[starts].astype(np.int64) * THRESHOLD_BIG + values, values, np.r_[starts, len(m)],
                         trace.n_requests, unique)


def distinct_ids(ids: np.ndarray, id_space: int) -> int:
    """How many distinct block ids ``ids`` holds, each below ``id_space``: one mark per id of the
    space (np.unique hashes or sorts every reference: tens of seconds on millions of them)."""
    seen = np.zeros(id_space, bool)
    seen[ids] = True
    return int(np.count_nonzero(seen))


def capacity_curve(trace: TraceData, capacities_blocks: np.ndarray | None = None, points: int = 24,
                   thresholds=None, stream: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """Prefix-hit ratio (in input tokens) of an LRU tier of each capacity, from exact stack distances.

    A block is a hit in a cache of C blocks when its LRU stack distance is below C; a prompt token
    counts as cached when its block and every earlier block of the prompt hit (prefix caching).
    One pass gives the whole curve. Capacities default to a log-spaced grid up to the unique blocks.
    ``thresholds``: prefix_threshold_runs(trace) or prefix_hit_thresholds(trace), ``stream``:
    input_block_stream(trace), when the caller already has them."""
    tpb = trace.header.tokens_per_block
    total_tokens = int(trace.input_tokens.sum())
    runs = _as_runs(trace, thresholds, stream, count_unique=True)
    unique = runs.unique
    unbounded = prefix_hit_ratio_unbounded(trace, thresholds=runs)
    # the thresholds' values, ascending, and how many references hold a smaller one
    order = np.argsort(runs.values, kind="stable")
    sorted_values = runs.values[order]
    below = np.r_[0, np.cumsum(np.diff(runs.before)[order])]
    # blocks that must hit for 95 % of the unbounded ratio (in tokens)
    need = int(np.ceil(0.95 * unbounded * total_tokens / tpb - 1e-9)) if unbounded > 0 else None
    if capacities_blocks is None:
        grid = np.geomspace(1, max(unique, 1), points).astype(np.int64)
        if need is not None and 0 < need <= runs.references:
            # the exact saturation capacity joins the grid: the smallest C with `need` thresholds < C
            # (one above the need-th smallest threshold)
            grid = np.r_[grid, int(sorted_values[np.searchsorted(below, need, side="left") - 1]) + 1]
        capacities_blocks = np.unique(grid)
    capacities_blocks = np.asarray(capacities_blocks, np.int64)
    # blocks with threshold < C
    hits = below[np.searchsorted(sorted_values, capacities_blocks, side="left")].astype(np.int64)
    ratio = hits * tpb / total_tokens if total_tokens else np.zeros(len(capacities_blocks))
    bytes_per_block = _pool_block_bytes(trace)
    reached = np.flatnonzero(hits >= need) if need is not None else []
    saturation = int(capacities_blocks[reached[0]]) if len(reached) else None
    return {
        "capacity_blocks": capacities_blocks.tolist(),
        "capacity_tokens": (capacities_blocks * tpb).tolist(),
        "capacity_bytes": (capacities_blocks * bytes_per_block).tolist(),
        "hit_ratio": np.asarray(ratio, float).tolist(),
        "unbounded_hit_ratio": unbounded,
        "saturation_blocks": saturation,  # smallest grid capacity reaching 95 % of the unbounded ratio
        # (on the default grid, which includes it, the smallest capacity at all)
        "references": runs.references,
        "unique_blocks": unique,
    }


def _pool_block_bytes(trace: TraceData) -> int:
    """Bytes of one of a trace's table blocks: every layer's, or the growing KV groups' (kvgeometry)."""
    return pool_block_bytes(trace_geometry(trace), trace.header.tokens_per_block)


def prefix_load_bytes(model, tokens) -> np.ndarray:
    """KV bytes a prefix hit of ``tokens`` tokens loads under ``model``'s KV groups: what the layers
    hold at that context (models.ModelGeometry.kv_bytes: a windowed layer its window, a linear layer
    its state), vectorised."""
    t = np.asarray(tokens, np.int64)
    if model.uniform:
        return t * model.kv_bytes_per_token
    return np.vectorize(model.kv_bytes, otypes=[np.int64])(t) if t.ndim else np.int64(model.kv_bytes(int(t)))


def check_compute_meta(meta: dict, where=None) -> None:
    """A trace's compute model (its ``compute`` blob, or the fields of a trace recorded before it,
    mapped in: engine.compute.compute_blob), validated by the model it names; TraceError, one line
    naming the field (``trace metadata compute.params.mfu must be ...``). ``where``: the file."""
    try:
        validate_blob(compute_blob(meta))
    except ConfigError as e:
        field, _, why = str(e).partition(" ")
        raise TraceError(f"{'' if where is None else f'{where}: '}trace metadata {field.rstrip(':')} {why}") from None


def timing_from_meta(meta: dict):
    """The GPU compute-time model a trace was recorded with, rebuilt from its metadata (a trace's
    header metadata, or the ``trace`` section of a results file). TraceError when it has none."""
    try:
        check_timing_meta(meta)
        check_compute_meta(meta)
    except TraceError as e:
        raise TraceError(f"no usable GPU compute model in the metadata ({e})") from None
    try:
        g = meta["gpu"]
        # the figures the trace was recorded with; a preset fills what older traces did not record
        preset = GPU_PRESETS.get(g["name"])
        spec_fields = [f for f in GpuSpec.__dataclass_fields__ if f != "sources"]
        spec = GpuSpec(**{f: g[f] if f in g else getattr(preset, f) for f in spec_fields if f in g or preset},
                       sources=preset.sources if preset else ())
        model = geometry_from_meta(meta["model"])
        # traces from before compute dtypes were all timed at the bf16 peak; traces from before
        # parallelism (no "tp") by the model of that time (GpuTiming with tp 0); the roofline's own
        # parameters from the trace's compute blob (engine/compute.py: traces from before the FP8
        # efficiency and the soft roofline have neither, scale 1 and the plain max)
        par = {k: g[k] for k in ("tp", "pp", "ep", "dp_attention") if k in g}
        if par.get("dp_attention"):
            check_dp_attention(model, par.get("tp", 0))
        base = GpuTiming(spec, g["gpus"], model, g["weight_dtype"], compute_dtype=g.get("compute_dtype", "bf16"),
                         **par)
        return GpuTiming.from_params(roofline_params(compute_blob(meta)), base)
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        raise TraceError(f"no usable GPU compute model in the metadata ({type(e).__name__}: {e})") from None


def compute_model(meta: dict) -> dict:
    """Which GPU step-time model a trace was recorded with, from its metadata, for ``trace info``:
    the GPUs and their parallelism, ``model`` ("roofline" or "aiconfigurator"), the roofline's
    ``engine_era`` (``engine.timing.era_of``: None for factors of no named era) and its factors,
    ``how``, the model in words, and ``text``, one line that says all of it. ``meta``: a trace's header
    metadata or a results file's ``trace`` section. Every figure of it is modelled (docs/engine.md)."""
    g = gpu_figures(meta)
    rec = meta.get("compute") if isinstance(meta.get("compute"), dict) else None
    database = (compute_blob(meta).get("params") or {}).get("database") if rec else None
    era = era_of(g)
    keys = ("mfu", "mbu", "overhead_us", "decode_mfu", "decode_mbu", "decode_overhead_us", "fp8_mfu_scale",
            *ERA_TERMS, "roofline_p")
    out = {"gpu": g.get("name"), "gpus": g.get("gpus"), "tp": g.get("tp"), "pp": g.get("pp"), "ep": g.get("ep"),
           "dp_attention": g.get("dp_attention") is True,
           "weight_dtype": g.get("weight_dtype"), "compute_dtype": g.get("compute_dtype"),
           "model": "aiconfigurator" if rec and rec.get("model") == "aiconfigurator" else "roofline",
           "engine_era": era, "factors": {k: g[k] for k in keys if k in g}}
    num = lambda k, d=1: g[k] if isinstance(g.get(k), (int, float)) else d  # noqa: E731  (validated traces: numbers)
    par = (f"TP {g['tp']}" + (f" x PP {g['pp']}" if num("pp") > 1 else "")
           + (f", EP {g['ep']}" if num("ep") > 1 else "")
           + (", DP attention" if g.get("dp_attention") is True else "")) if num("tp", 0) else "no parallelism recorded"
    where = f"{g.get('gpus')} x {g.get('name')} ({par}), {g.get('weight_dtype')} weights"
    if era is not None:
        roof = f"the fitted roofline at engine era {era}'s factors"
    elif num("tp", 0) and g.get("roofline_p") == 2.0:
        f = out["factors"]
        roof = (f"the fitted roofline at factors of no named era (prefill mfu {f.get('mfu')}, mbu {f.get('mbu')}, "
                f"overhead {f.get('overhead_us')} us; decode mfu {f.get('decode_mfu')}, mbu {f.get('decode_mbu')}, "
                f"overhead {f.get('decode_overhead_us')} us)")
    else:
        roof = "the roofline of traces recorded before the engine eras (its factors in the metadata's gpu)"
    if out["model"] == "aiconfigurator":
        steps = rec.get("steps") or {}
        how = (f"aiconfigurator {rec.get('backend')} {database} on {rec.get('system')} priced "
               f"{steps.get('aiconfigurator', 0):,} steps; {roof} priced the other {steps.get('roofline', 0):,}")
        if rec.get("fallback"):
            how = f"{roof} for every step (aiconfigurator: {rec['fallback']})"
    else:
        how = roof
    out["how"] = how
    out["text"] = f"{where}; modelled: {how}" + (' (docs/engine.md, "Engine eras")' if era is not None else "")
    return out


def compute_from_meta(meta: dict, timing=None, model_spec: str | None = None):
    """The compute model a trace was recorded with (its metadata's ``compute``; engine/compute.py):
    aiconfigurator's measured kernels over the roofline ``timing`` (default: ``timing_from_meta``),
    or that roofline itself for a trace recorded with it (no ``compute``). ``model_spec``: the model
    aiconfigurator is asked about (default: the trace's model name). ConfigError, one line, when the
    trace was recorded with aiconfigurator and aiconfigurator-core is not installed here."""
    timing = timing_from_meta(meta) if timing is None else timing
    blob = compute_blob(meta)
    if blob.get("model") == "roofline":
        return timing

    if blob.get("model") == "aiconfigurator":
        try:
            import aiconfigurator_core  # noqa: F401
        except ImportError:
            raise ConfigError(f"this trace was recorded with --compute aiconfigurator; pricing its recomputation "
                              f"the same way {INSTALL_HINT.removeprefix('--compute aiconfigurator ')}") from None
    # the model over the roofline given (a what-if's GPU or factors), not the one recorded
    params = blob.get("params") if isinstance(blob.get("params"), dict) else {}
    blob = {**blob, "params": {**params, "roofline": timing.params()}}
    return compute_from_blob(blob, timing, model_spec=model_spec or str(meta.get("model", {}).get("name")))


def prefill_step_ns(timing, new_tokens: int, cached_tokens: int) -> int:
    """Modelled time of one prefill of ``new_tokens`` after ``cached_tokens`` cached, alone in its
    step, by any compute model (the step's composition: one prefill chunk and its prefix)."""
    eq = timing.model.step_equivalents  # a window caps a sliding layer's attention (models.py)
    return timing.step_ns(new_tokens, *eq(cached_tokens, new_tokens), 0, 0, 1, cached_tokens)


def prefill_ns(timing, new_tokens, cached_tokens) -> np.ndarray:
    """Modelled time of one request's prefill alone (no batching, no queueing), vectorised."""
    n, c = np.broadcast_arrays(np.asarray(new_tokens, np.float64), np.asarray(cached_tokens, np.float64))
    # a plain loop over Python ints (np.vectorize adds its own dispatch to every call)
    out = np.fromiter((prefill_step_ns(timing, int(a), int(b)) for a, b in zip(n.ravel().tolist(), c.ravel().tolist())),
                      np.int64, count=n.size)
    return out.reshape(n.shape)


def _distinct_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (a, b) pairs of two non-negative int64 arrays (2 x k, sorted by a then b) and
    where each element's pair is among them: np.unique(axis=1) over one int64 key per pair (the
    axis form sorts rows as records, ten times slower on the capacity grid's half million)."""
    a = np.asarray(a, np.int64)
    b = np.asarray(b, np.int64)
    width = int(b.max()) + 1 if len(b) else 1
    if len(a) and (int(a.min()) < 0 or int(b.min()) < 0 or (int(a.max()) + 1) * width >= 1 << 62):
        pairs, inverse = np.unique(np.stack([a, b]), axis=1, return_inverse=True)
        return pairs, inverse.reshape(-1)
    keys, inverse = np.unique(a * width + b, return_inverse=True)
    return np.stack([keys // width, keys % width]), inverse.reshape(-1)


def prefill_key(new_tokens, cached_tokens):
    """One int64 key per (new, cached) token pair (each below 2^31, as traces store them), the key of
    a ``prefill_memo``: {key: prefill_ns of the pair} under one trace's compute model."""
    return np.asarray(new_tokens, np.int64) << 32 | np.asarray(cached_tokens, np.int64)


def capacity_ttft_parts(trace: TraceData, curve: dict, thresholds=None, progress=None,
                        prefill_memo: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What :func:`capacity_ttft` needs that does not depend on the tier's bandwidth, per capacity
    of ``curve`` (rows) and request (columns): the modelled prefill compute in ns and the bytes of
    the cached prefix loaded from the tier (int64 both). ``progress(done, total)``: called after
    each capacity. ``prefill_memo``: a dict that gets every pair's prefill time (:func:`prefill_key`),
    for the recorded pairs of the same trace (capacity.curve_queued_ttft)."""
    tpb = trace.header.tokens_per_block
    timing = compute_from_meta(trace.header.meta)
    runs = _as_runs(trace, thresholds)
    inp = trace.input_tokens
    caps = curve["capacity_blocks"]
    # a request's thresholds only grow (a running maximum), so offset by request they are sorted,
    # and the blocks a request hits at capacity C are those below its offset plus C (every
    # threshold and capacity is below THRESHOLD_BIG): searched over the thresholds' runs
    first = runs._before_capacity(0)
    loaded = np.zeros((len(caps), trace.n_requests), np.int64)
    hits = np.zeros((len(caps), trace.n_requests), np.int64)
    for i, cap in enumerate(caps):
        hit_blocks = runs.hits_per_request(cap, first)
        hits[i] = np.minimum(hit_blocks * tpb, inp - 1)  # at least one token is computed
        loaded[i] = prefix_load_bytes(timing.model, hits[i])
    # the prefill model once per distinct (new, cached) pair: capacities repeat most of them
    pairs, inverse = _distinct_pairs((inp - hits).ravel(), hits.ravel())
    done, step = 0, max(1, pairs.shape[1] // 20)
    times = np.zeros(pairs.shape[1], np.int64)
    while done < pairs.shape[1]:
        times[done:done + step] = prefill_ns(timing, pairs[0, done:done + step], pairs[1, done:done + step])
        done = min(done + step, pairs.shape[1])
        if progress is not None:
            progress(done, pairs.shape[1])
    compute = times[inverse.reshape(-1)].reshape(hits.shape)
    if prefill_memo is not None:
        prefill_memo.update(zip(prefill_key(pairs[0], pairs[1]).tolist(), times.tolist()))
    return compute, loaded


def ttft_from_parts(curve: dict, compute_ns: np.ndarray, load_bytes: np.ndarray, load_gbps: float) -> list[dict]:
    """:func:`capacity_ttft` from :func:`capacity_ttft_parts`: each capacity's prefill compute plus
    its cached prefix loaded at ``load_gbps``, mean and median over the requests."""
    rows = []
    for cap, c, b in zip(curve["capacity_blocks"], compute_ns, load_bytes):
        t = c + b / (load_gbps * 1e9) * 1e9
        rows.append({"capacity_blocks": int(cap), "mean_ttft_ms": float(t.mean() / 1e6),
                     "median_ttft_ms": float(np.median(t) / 1e6)})
    return rows


def capacity_ttft(trace: TraceData, curve: dict, load_gbps: float, thresholds=None) -> list[dict]:
    """Modelled TTFT (prefill alone, no queueing) at each capacity of a capacity curve: cached
    prefix tokens are loaded from the tier at ``load_gbps``, the rest is computed."""
    return ttft_from_parts(curve, *capacity_ttft_parts(trace, curve, thresholds), load_gbps)


# ------------------------------------------------------------------------------------ break-even
BREAKEVEN_PREFIXES = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def breakeven_timing(meta: dict | None = None, *, model: str | None = None, gpu: str | None = None,
                     gpus: int | None = None, mfu: float | None = None, weight_dtype: str | None = None,
                     kv_dtype: str | None = None, tp: int | None = None, pp: int | None = None,
                     ep: int | None = None, dp_attention: bool | None = None):
    """The compute-time model ``analyze breakeven`` prices recomputation with.

    With a trace (``meta``, its header metadata): the trace's model (``timing_from_meta``), each
    option given in place of what the trace recorded; what is not given stays the trace's: its
    parallelism (unless ``gpus``, ``tp``, ``pp`` or ``ep`` is given), its factors (mbu, step
    overheads; mfu unless given). Without one: ``model`` (needed) with `kvemu record`'s defaults for
    the rest (H100-SXM, the GPUs that hold the weights in half their HBM split as record splits them,
    bf16 weights and KV, the fitted factors; ``make_timing``). ``dp_attention``: data-parallel
    attention on or off (None: the trace's; without a trace, off). Options are checked as `record`
    checks them; ConfigError, one line, otherwise."""
    if mfu is not None:
        check_number(mfu, "--mfu", 1e-3, 1.0)
    for name, value in (("--gpus", gpus), ("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if value is not None and not 1 <= value <= MAX_BREAKEVEN_GPUS:
            raise ConfigError(f"{name} must be from 1 to {MAX_BREAKEVEN_GPUS}, got {value}")
    if meta is None:
        if model is None:
            raise ConfigError("break-even needs a TRACE or --model (with --gpu, --gpus, --mfu, ... "
                              "for a model and GPU without a trace)")
        return make_timing(gpu or "H100-SXM", resolve_model(model, kv_dtype or "bf16"), gpus,
                           weight_dtype or "bf16", mfu, tp=tp, pp=pp, ep=ep, dp_attention=bool(dp_attention))
    base = timing_from_meta(meta)
    spec = get_gpu(gpu) if gpu is not None else base.gpu
    if weight_dtype is not None and weight_dtype not in WEIGHT_DTYPE_BYTES:
        raise ConfigError(f"unknown weight dtype '{weight_dtype}' (known: {', '.join(WEIGHT_DTYPE_BYTES)})")
    if model is not None:
        geometry = resolve_model(model, kv_dtype or base.model.kv_dtype)
    else:
        geometry = base.model if kv_dtype is None else base.model.with_kv_dtype(kv_dtype)
    wd = weight_dtype or base.weight_dtype
    # the trace's compute dtype (older traces: bf16) unless the GPU or the weights change
    compute = base.compute if gpu is None and weight_dtype is None else spec.compute_dtype(wd)
    parallel_given = any(v is not None for v in (gpus, tp, pp, ep))
    dp = base.dp_attention if dp_attention is None else bool(dp_attention)
    if base.tp <= 0 and not parallel_given and not dp:  # a trace from before parallelism was modelled, as it was
        return compute_from_meta(meta, replace(base, gpu=spec, model=geometry, weight_dtype=wd,
                                               mfu=base.mfu if mfu is None else float(mfu),
                                               compute_dtype=compute), model)
    factors = {"mfu": base.mfu, "mbu": base.mbu, "overhead_us": base.overhead_us}
    for k in ("mfu", "mbu", "overhead_us"):
        v = getattr(base, f"decode_{k}")
        factors[f"decode_{k}"] = factors[k] if v is None else v
    if not parallel_given:
        tp, pp, ep = base.tp, base.pp, base.ep
    factors["fp8_mfu_scale"] = base.fp8_mfu_scale
    factors.update({k: getattr(base, k) for k in ERA_TERMS})
    timing = make_timing(spec.name, geometry, gpus, wd, mfu, tp=tp, pp=pp, ep=ep, factors=factors,
                         dp_attention=dp)
    # the trace's roofline (its plain maximum, for traces recorded before the soft one), under the
    # trace's compute model (aiconfigurator's measured kernels where it recorded with them)
    return compute_from_meta(meta, replace(timing, compute_dtype=compute, roofline_p=base.roofline_p), model)


def breakeven_gbps(timing, prefix_tokens=BREAKEVEN_PREFIXES) -> list[dict]:
    """Tier bandwidth at which loading a reused prefix of P tokens takes as long as recomputing it:
    kv_bytes(P) / prefill_compute_time(P). Faster tiers make reuse pay; slower ones lose to
    recomputation. The fixed per-step overhead is left out of the recompute time (a load needs a
    step too). kv_bytes(P) follows the model's KV groups (ModelGeometry.kv_bytes: a sliding layer
    loads its window, a linear layer its state), so a windowed model breaks even at lower bandwidth."""
    rows = []
    for p in prefix_tokens:
        t_ns = prefill_step_ns(timing, p, 0) - timing.overhead_us * 1e3
        kv = int(prefix_load_bytes(timing.model, p))
        rows.append({"prefix_tokens": p, "kv_bytes": kv, "recompute_ms": t_ns / 1e6,
                     # a recomputation modelled in no time (extreme GPU figures): no tier beats it
                     "breakeven_gbps": kv / t_ns if t_ns > 0 else float("inf")})
    return rows


#: Instances `trace info --instances` sizes a deployment for (one pass over the tables each).
MAX_DEPLOYMENT_INSTANCES = 4096


def deployment_capacity(trace: TraceData, instances: int) -> dict:
    """Tier capacity for N serving instances with requests spread round-robin: one shared pool
    holds each block once; replicated per-instance tiers each hold every block their requests use."""
    if not isinstance(instances, int) or not 1 <= instances <= MAX_DEPLOYMENT_INSTANCES:
        raise ConfigError(f"--instances must be from 1 to {MAX_DEPLOYMENT_INSTANCES}, got {instances}")
    owner = np.arange(trace.n_requests) % instances
    shared = trace.unique_blocks()
    replicated = sum(trace.unique_blocks(owner == i) for i in range(instances))
    per_block = _pool_block_bytes(trace)
    return {"instances": instances, "shared_blocks": shared, "replicated_blocks": replicated,
            "shared_bytes": shared * per_block, "replicated_bytes": replicated * per_block,
            "sharing_saves": 1 - shared / replicated if replicated else 0.0}


def trace_load(trace: TraceData) -> dict | None:
    """A trace's offered load against what its GPUs served: recorded in v2 traces of the engine
    model, computed from the recorded timeline otherwise."""
    load = trace.header.meta.get("load")
    if load is None:
        load = load_from_entries(iter_entries(trace, columns=("step", "request_id")),
                                 np.round(trace.arrival_ms * 1e6).astype(np.int64), trace.start_ns,
                                 trace.compute_ns, gpus_text(trace.header.meta.get("gpu")))
    return load
