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

    #: fill_chunks: the queue on a write to a held key (None: FIFO changes nothing; LRU: to the end)
    _write_moves = False

    def fill_chunks(self, chunks: dict, runs, lens, held_n: int, peak: int, dropped: list, gone: list):
        """The replay stack's level storing runs of new blocks (replay.stack.LevelCache._stretch),
        this policy's queue walked inline: for each run (key, blocks) of ``lens`` blocks, a chunk
        ``chunks`` holds takes the blocks (``on_write`` of its key), a new one is inserted
        (``on_insert``) and the chunks evicted for it leave ``chunks``, their blocks added to
        ``dropped`` and (key, blocks) to ``gone``. ``held_n`` blocks held before; returns the blocks
        held after and the most held at any point (at least ``peak``). The same calls, in the same
        order, as on_write/on_insert one run at a time; only the Python call per chunk is saved. (A
        subclass that changes on_insert or on_write sets ``fill_chunks = None``.)"""
        held, cap = self.held, self.capacity
        get, pop, popitem = chunks.get, chunks.pop, held.popitem
        move = held.move_to_end if self._write_moves else None
        for (key, blocks), n in zip(runs, lens):
            have = get(key)
            if have is not None:
                if move is not None:
                    move(key)
                have.extend(blocks)
            else:
                chunks[key] = blocks
                held[key] = None
                while len(held) > cap:
                    k = popitem(last=False)[0]
                    vb = pop(k)
                    dropped += vb
                    held_n -= len(vb)
                    gone.append((k, vb))
            held_n += n
            if held_n > peak:
                peak = held_n
        return held_n, peak

    def remove(self, key) -> None:
        del self.held[key]
