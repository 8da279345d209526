"""Workload-level facts of a trace: KV traffic, dedup, and the unbounded prefix-hit ratio."""

from __future__ import annotations

import numpy as np

from .schema import OPS, TraceData, iter_entries


def prefix_hit_ratio_unbounded(trace: TraceData) -> float:
    """Fraction of input tokens whose block and every block before it appeared in an earlier
    request (in arrival order): the Mooncake paper's "cache ratio" with an unbounded cache.

    Counted over full input blocks (a partial last block holds content of its request alone)."""
    tpb = trace.header.tokens_per_block
    n_full = trace.input_tokens // tpb
    req = np.repeat(np.arange(trace.n_requests), n_full)
    seg_begin = np.cumsum(n_full) - n_full
    pos = np.arange(int(n_full.sum())) - seg_begin[req]
    ids = trace.table_ids[trace.table_offsets[:-1][req] + pos]
    if len(ids) == 0:
        return 0.0
    _, first_index, inverse = np.unique(ids, return_index=True, return_inverse=True)
    seen_before = req[first_index][inverse.reshape(-1)] < req
    misses = np.cumsum(~seen_before)
    misses_before_segment = np.where(seg_begin > 0, misses[np.maximum(seg_begin - 1, 0)], 0)
    in_prefix = (misses - misses_before_segment[req]) == 0
    return float(in_prefix.sum() * tpb / trace.input_tokens.sum())


def trace_summary(trace: TraceData) -> dict:
    h = trace.header
    block_bytes_all_layers = h.block_bytes_per_layer * h.layers
    blocks = {op: 0 for op in OPS}
    entries = prefill = 0
    for e in iter_entries(h, columns=("phase", "load_count", "store_count", "read_count")):
        entries += len(e["phase"])
        prefill += int(np.count_nonzero(e["phase"] == 0))
        for op in OPS:
            blocks[op] += int(e[f"{op}_count"].sum(dtype=np.int64))
    referenced = len(trace.table_ids)
    unique = len(np.unique(trace.table_ids))
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
        "kv_bytes_stored": blocks["store"] * block_bytes_all_layers,
        "kv_bytes_loaded": blocks["load"] * block_bytes_all_layers,
        "kv_bytes_read": blocks["read"] * block_bytes_all_layers,
        "referenced_blocks": referenced,
        "unique_blocks": unique,
        "dedup_ratio": referenced / unique if unique else 1.0,
        "unique_kv_bytes": unique * block_bytes_all_layers,
        "referenced_kv_bytes": referenced * block_bytes_all_layers,
        "prefix_hit_ratio_unbounded": prefix_hit_ratio_unbounded(trace),
        "modelled_makespan_s": (int(trace.start_ns[-1] + trace.compute_ns[-1]) / 1e9) if len(trace.step) else 0.0,
        "file_bytes": h.path.stat().st_size,
    }
