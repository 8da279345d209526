"""S3-FIFO (Yang, Zhang, Qiu, Yue and Rashmi, "FIFO queues are all you need for cache eviction",
SOSP 2023, Algorithm 1): a small FIFO ``S`` of 10 % of the capacity, a main FIFO ``M`` of the rest,
and a ghost FIFO ``G`` of keys only (as many as ``M`` holds), with a per-key frequency capped at 3.

As kvemu runs it, for a capacity of ``C`` keys (``s = ceil(C / 10)``, ``m = C - s``):

- a hit (key in ``S`` or ``M``) raises its frequency by one, up to 3; a ghost key is not a hit;
- a miss first evicts while ``|S| + |M| >= C``, then stores the key at the head of ``M`` if it is in
  ``G`` (and drops it from ``G``), else at the head of ``S``, with frequency 0;
- evicting evicts from ``S`` if ``|S| >= s`` (the paper's ``S.size >= 10 %``) or ``M`` is empty,
  else from ``M``;
- evicting from ``S``: take its tail; if its frequency is at least 1 (used since it was stored)
  it moves to the head of ``M`` with frequency 0 (the authors' description clears its bits on the
  move), and if ``M`` then holds more than ``m`` keys one is evicted from ``M``; the loop goes on
  with the next tail; otherwise the key goes to the head of ``G`` (the oldest ghost leaves once
  ``G`` holds more than ``m``) and the loop ends;
- evicting from ``M``: take its tail; a key with frequency at least 1 goes back to the head with
  its frequency less one; the first with frequency 0 is evicted.

Writes to a held key (a block added to a chunk it holds) are not reuses: they change nothing. The
capacity analysis runs the same rules in C (cbackends/policies.c, ``fast_path``); the tests check
both against a brute-force oracle."""

from __future__ import annotations

from collections import OrderedDict

from . import CachePolicy, register_policy

MAX_FREQ = 3


@register_policy
class S3FIFO(CachePolicy):
    name = "s3fifo"
    summary = "S3-FIFO (SOSP'23): small FIFO 10 %, main FIFO, ghost FIFO, frequencies capped at 3"
    order = 10
    fast_path = "s3fifo"
    run_writes = True  # a write changes nothing

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.small_cap = -(-self.capacity // 10)
        self.main_cap = self.capacity - self.small_cap
        self.held: dict = {}                      # held key -> frequency (0..3)
        self.small: OrderedDict = OrderedDict()   # tail (oldest) first
        self.main: OrderedDict = OrderedDict()
        self.ghost: OrderedDict = OrderedDict()

    def on_hit(self, key) -> None:
        f = self.held[key]
        if f < MAX_FREQ:
            self.held[key] = f + 1

    def on_insert(self, key) -> list:
        out = []
        while len(self.held) >= self.capacity:
            out += self._evict()
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        self.held[key] = 0
        return out

    def evict(self) -> list:
        return self._evict() if self.held else []

    def remove(self, key) -> None:
        del self.held[key]
        if key in self.small:
            del self.small[key]
        else:
            del self.main[key]

    def _evict(self) -> list:
        if len(self.small) >= self.small_cap or not self.main:
            return self._evict_small()
        return self._evict_main()

    def _evict_small(self) -> list:
        held, small, main = self.held, self.small, self.main
        out = []
        while small:
            t = small.popitem(last=False)[0]
            if held[t] >= 1:
                held[t] = 0
                main[t] = None
                if len(main) > self.main_cap:
                    out += self._evict_main()
            else:
                del held[t]
                self.ghost[t] = None
                while len(self.ghost) > self.main_cap:
                    self.ghost.popitem(last=False)
                out.append(t)
                break
        return out

    def _evict_main(self) -> list:
        held, main = self.held, self.main
        while main:
            t = main.popitem(last=False)[0]
            f = held[t]
            if f >= 1:
                held[t] = f - 1
                main[t] = None
            else:
                del held[t]
                return [t]
        return []
