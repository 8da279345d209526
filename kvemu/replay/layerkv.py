"""What each replayed layer caches and moves, for a model whose layers do not all cache every token
(models.KVGroup: sliding windows, chunked local attention, linear attention's state, DeepSeek-V3.2's
indexer keys): the layers a replay samples, each in its KV group with a span inside that group, the
arena's block stride, the per-layer table the C core clips each op's block run by (kvemu.h, struct
kv_layer), and the bytes the results count per entry (engine/kvgeometry.entry_traffic, the same rule).

A config or a trace gives a group's layer count, not which layers: the groups' layers are spread
evenly over the model's depth, in the order the groups are listed (gemma-3-27b: a full layer about
every sixth, as its pattern 5 local : 1 global has it). The indexer keys lie inside the full layers'
blocks (DeepSeek-V3.2: every layer is MLA with an indexer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends import LAYER_DTYPE, LAYER_KINDS, REQ_DTYPE, LayerMoves
from ..engine.kvgeometry import entry_traffic
from ..errors import OptionError
from ..models import ModelGeometry, geometry_from_meta
from .arena import layer_plan


@dataclass(frozen=True)
class LayerKV:
    """One model layer's cache: kind (full, sliding, chunked, linear), window tokens, bytes of one
    block (full attention's and, where the layer has them, the indexer keys'), state bytes (linear)."""

    kind: str
    window: int
    block_bytes: int
    state_bytes: int


@dataclass(frozen=True)
class LayerPlan:
    """The replayed layers: the model layer each starts at, the model layers of its group it stands
    for (``span``), what each caches (None: full attention in every layer, as before KV groups), and
    the arena's bytes per block and layer (the largest layer block)."""

    first_layers: list
    span: np.ndarray
    layers: tuple | None
    block_bytes: int


def _spread(n: int, total: int) -> np.ndarray:
    """Positions of n items spread evenly over 0..total-1 (sort keys, the i-th at (i + 1/2) total / n)."""
    return (np.arange(n) + 0.5) * total / n


def _lines(n: int) -> int:
    """``n`` bytes rounded up to whole 64-byte lines: what the tier moves (kvemu.h, struct kv_layer)."""
    return -(-n // 64) * 64


def model_layers(model: ModelGeometry, tokens_per_block: int) -> list[LayerKV]:
    """What each model layer caches: the attention groups' layers spread evenly over the model's depth
    (stable by group order), the indexer keys added to the blocks of the non-linear layers they cover;
    blocks and states in whole 64-byte lines."""
    B = tokens_per_block
    keys, owner = [], []
    attn = [g for g in model.kv_groups if g.kind != "indexer"]
    for gi, g in enumerate(attn):
        keys.append(_spread(g.layers, model.layers))
        owner.append(np.full(g.layers, gi))
    order = np.lexsort((np.concatenate(owner), np.concatenate(keys)))
    kinds = np.concatenate(owner)[order]
    out = [LayerKV(attn[gi].kind, attn[gi].window if attn[gi].kind in ("sliding", "chunked") else 0,
                   0 if attn[gi].kind == "linear" else B * attn[gi].bytes_per_token_layer,
                   attn[gi].state_bytes_per_layer if attn[gi].kind == "linear" else 0) for gi in kinds.tolist()]
    blocks = [i for i, lk in enumerate(out) if lk.kind != "linear"]
    for g in model.kv_groups:
        if g.kind != "indexer" or not blocks:
            continue
        n = min(g.layers, len(blocks))
        at = np.floor(_spread(n, len(blocks))).astype(int)
        for i in (blocks[k] for k in at.tolist()):
            lk = out[i]
            out[i] = LayerKV(lk.kind, lk.window, lk.block_bytes + B * g.bytes_per_token_layer, lk.state_bytes)
    return [LayerKV(lk.kind, lk.window, _lines(lk.block_bytes), _lines(lk.state_bytes)) for lk in out]


def plan_layers(model: ModelGeometry, tokens_per_block: int, replay_layers: int | None,
                block_bytes_per_layer: int) -> LayerPlan:
    """The layers a replay runs. Full attention in every layer: ``layer_plan`` (k evenly spaced layers)
    and the trace's block. Otherwise every group keeps its share: of k replayed layers, each class of
    layers that cache alike gets k x its layers / all layers (largest remainders, at least one), its
    layers split into that many runs of consecutive members, each run replayed by its first layer with
    the run's length as span; so each group's spans add up to its layers."""
    if model.uniform:
        first, span = layer_plan(model.layers, replay_layers)
        return LayerPlan(first, span, None, block_bytes_per_layer)
    per_layer = model_layers(model, tokens_per_block)
    L = len(per_layer)
    k = L if replay_layers is None else replay_layers
    classes: dict[LayerKV, list[int]] = {}
    for i, lk in enumerate(per_layer):
        classes.setdefault(lk, []).append(i)
    if not 1 <= k <= L:
        raise OptionError("window.layers", f"must be between 1 and the model's {L} layers")
    if k < len(classes):
        raise OptionError("window.layers", f"must be at least {len(classes)}: the model's layers cache in "
                                           f"{len(classes)} ways (KV groups), and each needs a replayed layer")
    members = list(classes.values())
    quota = np.array([k * len(m) / L for m in members])
    share = np.maximum(np.floor(quota).astype(int), 1)
    while share.sum() < k:  # largest remainders first
        rem = np.where(share < [len(m) for m in members], quota - share, -np.inf)
        share[int(np.argmax(rem))] += 1
    while share.sum() > k:  # the minimum of one took layers from the largest
        share[int(np.argmax(np.where(share > 1, share - quota, -np.inf)))] -= 1
    runs = []
    for m, s in zip(members, share.tolist()):
        bounds = (np.arange(s + 1) * len(m)) // s
        runs += [(m[a], b - a) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    runs.sort()
    first = [r[0] for r in runs]
    span = np.array([r[1] for r in runs], np.uint32)
    layers = tuple(per_layer[i] for i in first)
    stride = max(64, max(lk.block_bytes for lk in per_layer))  # whole lines already
    return LayerPlan(first, span, layers, stride)


def layer_table(layers) -> np.ndarray:
    """struct kv_layer per replayed layer (backends.LAYER_DTYPE)."""
    t = np.zeros(len(layers), LAYER_DTYPE)
    t["kind"] = [LAYER_KINDS.index(lk.kind) for lk in layers]
    t["window_tokens"] = [lk.window for lk in layers]
    t["block_bytes"] = [lk.block_bytes for lk in layers]
    t["state_bytes"] = [lk.state_bytes for lk in layers]
    return t


def min_slots(layers, block_bytes: int) -> int:
    """Slots each layer's arena region needs so that a linear layer's state fits in it."""
    state = max((lk.state_bytes for lk in layers), default=0)
    return -(-state // block_bytes)


@dataclass
class GroupMoves:
    """What an instance's replay calls pass the C core for a grouped model, and how the results count
    an entry's bytes: ``table`` (struct kv_layer per replayed layer), the trace's KV groups, block
    tokens, linear checkpoints (blocks), the tier policy, and each request's full prompt blocks."""

    table: np.ndarray
    groups: tuple
    block_tokens: int
    checkpoint_blocks: int
    policy: str
    prompt_blocks: np.ndarray

    def moves(self, requests: np.ndarray, base: np.ndarray, extra_all_layers: int = 0, load_end=None):
        """backends.LayerMoves for a call whose local requests are trace requests ``requests`` (-1: a
        block of unknown origin, moved in every layer) with local position 0 at block ``base``;
        ``extra_all_layers`` more requests (weights) move every layer alike. ``load_end`` (one per
        request, 0: its load ranges' own ends): where the windows of each request's load end, for a
        prefix load split over several entries (a tier stack's levels: the whole load's end)."""
        requests = np.asarray(requests, np.int64)
        reqs = np.zeros(len(requests) + extra_all_layers, REQ_DTYPE)
        n = len(requests)
        known = requests >= 0
        reqs["base_block"][:n] = base
        reqs["prompt_blocks"][:n] = np.where(known, self.prompt_blocks[np.maximum(requests, 0)], 0)
        reqs["all_layers"][:n] = ~known
        reqs["all_layers"][n:] = 1
        if load_end is not None:
            reqs["load_end"][:n] = load_end
        return LayerMoves(self.table, reqs, self.block_tokens, self.checkpoint_blocks, self.policy == "resident")

    def entry_bytes(self, e: dict) -> dict:
        """Bytes of all model layers each entry row moves, per op (engine.kvgeometry.entry_traffic)."""
        return entry_traffic(self.groups, self.block_tokens, self.policy, self.checkpoint_blocks, e,
                             self.prompt_blocks)


def group_moves(trace, plan: LayerPlan) -> GroupMoves | None:
    """The GroupMoves of a trace replayed with ``plan``; None for full attention in every layer."""
    if plan.layers is None:
        return None

    h = trace.header
    eng = h.meta.get("engine", {})
    tpb = h.tokens_per_block
    return GroupMoves(layer_table(plan.layers), geometry_from_meta(h.model).kv_groups, tpb,
                      int(eng.get("checkpoint_blocks") or 0), eng.get("tier_policy", "offload"),
                      (trace.input_tokens.astype(np.int64) // tpb).astype(np.uint32))
