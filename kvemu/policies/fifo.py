"""FIFO: a miss stores the key, evicting the one stored longest ago; a hit changes nothing. The
analysis runs it in C (cbackends/policies.c, a ring per capacity)."""

from __future__ import annotations

from collections import OrderedDict

from . import CachePolicy, register_policy


@register_policy
class FIFO(CachePolicy):
    name = "fifo"
    summary = "stored longest ago goes first; a hit changes nothing"
    order = 1
    fast_path = "fifo"
    run_writes = True  # a write changes nothing

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.held: OrderedDict = OrderedDict()  # stored longest ago first

    def on_hit(self, key) -> None:
        return None

    def hit_many(self, keys) -> None:
        return None

    def on_insert(self, key) -> list:
        held = self.held
        held[key] = None
        out = []
        while len(held) > self.capacity:
            out.append(held.popitem(last=False)[0])
        return out

    def evict(self) -> list:
        return [self.held.popitem(last=False)[0]] if self.held else []

    def remove(self, key) -> None:
        del self.held[key]
