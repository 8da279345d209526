"""LRU: a hit makes the key the most recently used; a miss stores it, evicting the least recently
used. The analysis reads every capacity at once from the exact stack distances (cbackends/stackdist.c)."""

from __future__ import annotations

from . import register_policy
from .fifo import FIFO


@register_policy
class LRU(FIFO):
    """FIFO's queue, where a hit or a write also moves the key to the back."""

    name = "lru"
    summary = "least recently used goes first"
    order = 0
    fast_path = "stack-distance"
    run_writes = True  # a write moves the key to the end: twice is as once

    def on_hit(self, key) -> None:
        self.held.move_to_end(key)

    on_write = on_hit  # a write is a use: the engine's tier and the stack levels always counted it so
    _write_moves = True  # FIFO.fill_chunks: a write moves the key to the end, as on_write does

    def hit_many(self, keys) -> None:
        move = self.held.move_to_end
        for k in keys:
            move(k)

    def insert_many(self, keys) -> list:
        """Every key stored and made the most recent, then room made once for the whole batch."""
        held = self.held
        move = held.move_to_end
        for k in keys:
            held[k] = None
            move(k)
        out = []
        while len(held) > self.capacity:
            out.append(held.popitem(last=False)[0])
        return out
