"""Weights in the tier, replayed (the engine's side is kvemu/engine/weights.py): the arena's weight
region and the loads every step streams from it, the default label's mark, and the results'
``weights``."""

from __future__ import annotations

import numpy as np

from ..backends import ENTRY_DTYPE
from ..engine.weights import blocks_per_layer


class WeightStream:
    """Weights in the tier (engine/weights.py), replayed: the arena holds, after the KV slots, a weight
    region of ``n_blocks`` slots per replayed layer, and every step loads the blocks its weight bytes
    take (rounded up to whole blocks of each layer) from it, in the step's own C call, as one more
    request of the call whose entry comes first in its step. The loads are timed and charged as KV
    loads are (medium, link, the step's composition); their charged time is reported apart."""

    def __init__(self, placement, base_slot: int, n_blocks: int, block_bytes: int, n_layers: int):
        self.placement, self.base, self.n_blocks = placement, int(base_slot), int(n_blocks)
        self.block_bytes, self.n_layers = int(block_bytes), int(n_layers)
        self.block_bytes_all_layers = self.block_bytes * self.n_layers
        self.slots = (self.base + np.arange(self.n_blocks)).astype(np.uint32)

    @staticmethod
    def region_blocks(placement, n_layers: int, block_bytes: int, chunk_blocks: int) -> int:
        """Slots of the weight region per replayed layer: the placed bytes, whole chunks of them."""
        b = blocks_per_layer(placement.placed_bytes, n_layers, block_bytes)
        return -(-b // chunk_blocks) * chunk_blocks

    def blocks(self, new_tokens) -> np.ndarray:
        """Weight blocks per replayed layer of steps with these new tokens."""
        p = self.placement
        out = [min(blocks_per_layer(p.step_bytes(int(t)), self.n_layers, self.block_bytes), self.n_blocks)
               for t in np.atleast_1d(new_tokens).tolist()]  # one value per step, not per access
        return np.array(out, np.int64)

    def join(self, table_off, slots, steps, entries, weight_blocks):
        """The call's arrays with the weight request added: its table (the weight region) last, one entry
        per step first in the step. Returns them, the positions of the original entries and of the weight
        entries."""
        n_steps, n = len(steps), len(entries)
        begin = steps["entry_begin"].astype(np.int64)
        of_entry = np.searchsorted(begin, np.arange(n), side="right") - 1
        real = np.arange(n) + of_entry + 1
        mine = begin + np.arange(n_steps)
        new = np.zeros(n + n_steps, ENTRY_DTYPE)
        new[real] = entries
        new["req"][mine] = len(table_off) - 1
        new["load_count"][mine] = weight_blocks
        table_off = np.append(table_off, np.uint64(int(table_off[-1]) + self.n_blocks))
        slots = np.concatenate([slots.astype(np.uint32), self.slots])
        steps = steps.copy()
        steps["entry_begin"] = mine
        steps["entry_end"] = steps["entry_end"].astype(np.int64) + np.arange(1, n_steps + 1)
        return table_off, slots, steps, new, real, mine


def weights_label(placement) -> str:
    """The default label's mark of weights in the tier."""
    if placement is None:
        return ""
    return f"+{'weights' if placement.placement == 'dense' else 'cold-experts'}{placement.fraction:g}"


