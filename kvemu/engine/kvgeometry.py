"""What the engine's KV blocks cost and move when a model's layers do not all cache every token
(models.KVGroup): sliding windows, chunked local attention, linear attention's state, indexer keys.

The engine's block tables (engine/blocks.py) name the blocks of the groups that grow with the
context (full attention, MLA, DeepSeek-V3.2's indexer keys); one pool block is one such block over
all those layers. A request's windowed layers never hold more than their window's blocks, and its
linear-attention layers hold one fixed state: the pool reserves both for it at admission, as extra
blocks, and frees them when it finishes (blocks that leave the window are reused by the window's
new ones). A prefix hit reuses a linear layer's state only where it was checkpointed, every
``checkpoint_blocks`` blocks (``pool_accounting``).

Tier traffic follows the same geometry (``group_traffic``): an offload store writes a windowed
layer's blocks only where a later request resuming at the end of this prompt needs them (the last
window, or the last chunk, of the prompt's full blocks), and a linear layer's state at each
checkpoint the stored blocks pass; a load brings a windowed layer's window before the end of the
hit, and a linear layer's state once; a resident read reads a windowed layer's window and a linear
layer's state. Full-attention groups move every block, as before.
"""

from __future__ import annotations

import numpy as np

from ..models import KVGroup, ModelGeometry


def pool_accounting(model: ModelGeometry, tokens_per_block: int, checkpoint_tokens: int) -> dict:
    """The EngineConfig fields (pool_block_bytes, bounded_kv_blocks, state_bytes_per_request,
    checkpoint_blocks) for ``model`` at ``tokens_per_block``; {} for full attention in every layer.
    Linear layers' state is checkpointed every ``checkpoint_tokens`` tokens (rounded to blocks).
    A model with no growing group (every layer windowed) counts its windowed blocks as pool blocks:
    the pool then holds every block of a request's table, an upper bound."""
    if model.uniform:
        return {}
    tpb = tokens_per_block
    groups = model.kv_groups
    unit = sum(g.block_bytes(tpb) for g in groups if g.grows)
    bounded = [(g.max_blocks(tpb), g.block_bytes(tpb)) for g in groups if g.kind in ("sliding", "chunked")]
    if unit == 0:
        unit, bounded = sum(bb for _, bb in bounded), []
    state = sum(g.state_bytes_per_layer * g.layers for g in groups if g.kind == "linear")
    linear = any(g.kind == "linear" for g in groups)
    return {"pool_block_bytes": unit, "bounded_kv_blocks": tuple(bounded), "state_bytes_per_request": state,
            "checkpoint_blocks": max(1, checkpoint_tokens // tpb) if linear else 0}


def pool_block_bytes(model: ModelGeometry, tokens_per_block: int) -> int:
    """Bytes of one pool block: a block of every layer (full attention everywhere), else of the
    growing groups (pool_accounting)."""
    acc = pool_accounting(model, tokens_per_block, tokens_per_block)
    return acc.get("pool_block_bytes") or model.block_bytes_per_layer(tokens_per_block) * model.layers


def _overlap(first, count, lo, hi):
    """Length of [first, first + count) within [lo, hi), element-wise."""
    return np.maximum(0, np.minimum(first + count, hi) - np.maximum(first, lo))


def _reach_start(g: KVGroup, end_blocks, tpb: int):
    """First block a windowed layer needs to go on from block ``end_blocks`` (exclusive): the
    window's ``ceil(W / B)`` blocks before it (sliding), the blocks of its chunk (chunked)."""
    if g.kind == "sliding":
        return np.maximum(0, end_blocks - (-(-g.window // tpb)))
    return (end_blocks * tpb // g.window) * g.window // tpb


def entry_traffic(groups, tokens_per_block: int, policy: str, checkpoint_blocks: int, e: dict,
                  n_full) -> dict:
    """Bytes each entry row moves per op (load, store, read) under KV ``groups``. ``e``: entry
    columns request_id and {op}_first, {op}_count; ``n_full``: full prompt blocks per request.
    Returns {op: int64 array, one value per row}. The replay's C core moves the same (kvemu.h,
    struct kv_layer)."""
    tpb = tokens_per_block
    nf = np.asarray(n_full, np.int64)[np.asarray(e["request_id"], np.int64)]
    ops = {op: (np.asarray(e[f"{op}_first"], np.int64), np.asarray(e[f"{op}_count"], np.int64))
           for op in ("load", "store", "read")}
    out = {op: np.zeros(len(nf), np.int64) for op in ops}
    for g in groups:
        for op, (first, count) in ops.items():
            end = first + count
            if g.grows:
                out[op] += count * g.block_bytes(tpb)
            elif g.kind == "linear":
                if op == "store":
                    n = (end // checkpoint_blocks - first // checkpoint_blocks) if checkpoint_blocks else (
                        count > 0)
                else:
                    n = count > 0
                out[op] += np.where(count > 0, n, 0) * (g.state_bytes_per_layer * g.layers)
            else:
                if op == "store" and policy != "resident":
                    blocks = _overlap(first, count, _reach_start(g, nf, tpb), nf)
                elif op == "store":
                    blocks = count
                else:
                    blocks = _overlap(first, count, _reach_start(g, end, tpb), end)
                out[op] += blocks * g.block_bytes(tpb)
    return out


def group_traffic(groups, tokens_per_block: int, policy: str, checkpoint_blocks: int, e: dict,
                  n_full) -> dict:
    """Bytes each op (load, store, read) of a batch of entry rows moves under KV ``groups``
    (entry_traffic, summed). Returns {op: bytes} (int)."""
    per = entry_traffic(groups, tokens_per_block, policy, checkpoint_blocks, e, n_full)
    return {op: int(v.sum()) for op, v in per.items()}
