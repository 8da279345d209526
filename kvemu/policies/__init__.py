"""Eviction policies by name: the interface every evicting cache of kvemu runs its policy through,
and the registry that names them (docs/extending.md, "Adding an eviction policy").

Users of the interface: the replay stack's levels (replay.stack.LevelCache, ``--tiers ...
policy=NAME``), the engine's offload tier (engine.pool.TierCache and ChunkTierCache, which the
closed loop's shared tier builds; ``record --tier-eviction NAME``, ``replay --tier-eviction NAME``),
the replay arena's slots (replay.arena.tier_slots: the C allocator's LRU, backends.TierSlots, for
lru, replay.arena.PolicySlots for the others) and the capacity analysis (capacity.StackAnalysis,
``analyze capacity --policies`` / ``--stack NAME=SIZE:POLICY``). HBM's prefix cache
(engine.pool.BlockPool) stays LRU over reference-counted blocks, as vLLM's is.

A policy is a :class:`CachePolicy` subclass in one module of this package, registered with
:func:`register_policy`; the package imports every module in it, so adding a policy is adding a
file (and its test). Keys are hashable (block ids, chunk keys). A policy holds at most
``capacity`` keys and evicts only when it must (a policy that never fills evicts nothing: the
capacity analysis relies on it). For the analysis a policy names a fast path (``fast_path``): the
exact LRU stack distances (``"stack-distance"``, every capacity at once) or a loop in C
(cbackends/policies.c; a name of backends.POLICY_CODES); without one the analysis runs the Python
object over the stream (:func:`simulate_hits`), one Python call per reference: the slow path.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import ClassVar

import numpy as np

from ..errors import ConfigError


class CachePolicy:
    """What a cache tells its policy, and what the policy answers. ``held`` maps the keys held (its
    keys are exactly them; callers read it, e.g. for a fast ``in``, and never change it).

    - :meth:`on_hit`: a held key was used (served);
    - :meth:`on_write`: a held key was written again (a block added to a chunk it holds, a store of
      a block it already has); not a reuse: by default nothing changes;
    - :meth:`on_insert`: a key not held is stored; the policy makes room as its algorithm says and
      returns the keys it evicted, victim first (never the key inserted);
    - :meth:`evict`: make room now: evict (at least) one key if any is held; returns them;
    - :meth:`remove`: a held key is gone for a reason of the cache's own (no eviction counted);
    - ``len``, ``in``, iteration: the keys held.

    Batch forms (:meth:`hit_many`, :meth:`insert_many`) exist so a cache's hot loop makes one call
    per batch; a policy may override them for speed, and :meth:`insert_many` may make room once
    after the whole batch (LRU does: that is what the engine's tier always did)."""

    #: The name ``--policies``, ``--stack NAME=SIZE:POLICY`` and ``--tiers ... policy=`` take.
    name: ClassVar[str] = ""
    #: One line for listings (help, docs).
    summary: ClassVar[str] = ""
    #: Place in listings of names (lower first); ties by name.
    order: ClassVar[int] = 100
    #: False: the policy needs every future access (analysis only; a replay refuses it).
    online: ClassVar[bool] = True
    #: The analysis' fast path: "stack-distance", a C loop of backends.POLICY_CODES, or None.
    fast_path: ClassVar[str | None] = None
    #: True: :meth:`on_write` of a key twice, nothing between, is as once (a no-op, or LRU's move to
    #: the end), so a cache may show a run of writes to one key as one (the replay stack's levels
    #: then store a chunk's blocks in one call, replay.stack.LevelCache.put_run). False (the
    #: default, always safe): the cache shows each write.
    run_writes: ClassVar[bool] = False

    def __init__(self, capacity: int):
        capacity = int(capacity)
        if capacity < 1:
            raise ConfigError(f"policy {self.name}: capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.held: dict = {}

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, key) -> bool:
        return key in self.held

    def __iter__(self):
        return iter(self.held)

    def on_hit(self, key) -> None:
        raise NotImplementedError

    def on_write(self, key) -> None:
        return None

    def on_insert(self, key) -> list:
        raise NotImplementedError

    def evict(self) -> list:
        raise NotImplementedError

    def remove(self, key) -> None:
        raise NotImplementedError

    def hit_many(self, keys) -> None:
        on_hit = self.on_hit
        for k in keys:
            on_hit(k)

    def insert_many(self, keys) -> list:
        """Each key stored in order (written when held, inserted when not); the keys evicted. A key
        of the batch may be among them (when the batch holds more keys than ``capacity``)."""
        held, out = self.held, []
        for k in keys:
            if k in held:
                self.on_write(k)
            else:
                out += self.on_insert(k)
        return out

    def access(self, key) -> bool:
        """One reference as the analysis sees it: a hit (True) or a miss that stores the key."""
        if key in self.held:
            self.on_hit(key)
            return True
        self.on_insert(key)
        return False


_REGISTRY: dict[str, type] = {}


def register_policy(cls: type) -> type:
    """Class decorator: makes ``cls`` (a CachePolicy) known by ``cls.name``."""
    name = getattr(cls, "name", "")
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise TypeError(f"{cls!r} is not a CachePolicy")
    if not name or not name.isascii() or not all(c.isalnum() or c in "-_" for c in name) or name != name.lower():
        raise ValueError(f"policy name {name!r}: lower-case letters, digits, '-' and '_' only")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"policy {name!r} is registered twice")
    _REGISTRY[name] = cls
    return cls


def policy_names(online: bool | None = None, fast: bool | None = None) -> tuple[str, ...]:
    """The known policies' names, in listing order; ``online=True``: those a replay can run;
    ``fast=False``: those the analysis runs in Python (no fast path)."""
    cls = sorted(_REGISTRY.values(), key=lambda c: (c.order, c.name))
    return tuple(c.name for c in cls if (online is None or c.online == online)
                 and (fast is None or (c.fast_path is not None) == fast))


def get_policy(name: str, where: str = "policy", online: bool = False) -> type:
    """The class registered as ``name``; ConfigError (one line, naming ``where``) otherwise, or when
    ``online`` and the policy needs the future."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        known = policy_names(online=True if online else None)
        raise ConfigError(f"{where}: unknown policy {name!r} (known: {', '.join(known)})")
    if online and not cls.online:
        raise ConfigError(f"{where}: policy {name} needs every future access, which a replay does not have; "
                          f"it is for analyze capacity (replay levels run {_either(policy_names(online=True))})")
    return cls


def _either(names) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def make_policy(name: str, capacity: int, where: str = "policy") -> CachePolicy:
    """A fresh, empty policy object ``name`` for ``capacity`` keys (an online policy)."""
    return get_policy(name, where, online=True)(capacity)


def simulate_hits(name: str, ids, capacity: int) -> np.ndarray:
    """Whether each reference of ``ids`` hits (bool) in a ``name`` cache of ``capacity`` keys that
    starts empty, by running the Python policy object: the analysis' slow path (one Python call per
    reference; docs/analysis.md gives its speed)."""
    pol = make_policy(name, capacity)
    held, on_hit, on_insert = pol.held, pol.on_hit, pol.on_insert
    hits = []
    append = hits.append
    for i, k in enumerate(np.asarray(ids).tolist()):
        if k in held:
            on_hit(k)
            append(i)
        else:
            on_insert(k)
    out = np.zeros(len(ids), bool)
    out[hits] = True
    return out


def _load_all() -> None:
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not m.name.startswith("_"):
            importlib.import_module(f"{__name__}.{m.name}")


_load_all()

__all__ = ["CachePolicy", "get_policy", "make_policy", "policy_names", "register_policy", "simulate_hits"]
