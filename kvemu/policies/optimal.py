"""Belady's MIN with bypass: on a miss with the cache full, of the held keys and the missed one, the
one whose next reference is furthest in the future (or never comes) is left out. It needs every
future reference, so only the capacity analysis runs it (C, cbackends/policies.c); a replay refuses it."""

from __future__ import annotations

from . import CachePolicy, register_policy


@register_policy
class Optimal(CachePolicy):
    name = "optimal"
    summary = "Belady's MIN: the bound on block hits (analysis only: it needs the future)"
    order = 2
    online = False
    fast_path = "optimal"

    def __init__(self, capacity: int):
        raise TypeError("the optimal policy needs every future access: the capacity analysis runs it in C")
