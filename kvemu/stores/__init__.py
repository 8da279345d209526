"""Stores: tiers that Python drives beside the C replay core (``--backend mooncake``, ``files:DIR``).

A store keeps objects by key, as a KV-cache store does (Mooncake Store, LMCache's backends): the
replay core hands it one batch at a time (one op, one replayed layer, at most 256 transfers), and
it puts objects from, or gets them into, memory the caller owns (kvemu's staging buffer, the HBM
stand-in). The seam is three pieces:

- :class:`Store`, the protocol a store implements, written down here and nowhere else;
- a row of ``kvemu.backend_spec.KINDS`` naming the class (``store="kvemu.stores.files:FileStore"``);
- one C bridge for every store kind (cbackends/store.c, the ``store`` ops table), which calls back
  into Python once per batch; :class:`StoreSession` is its Python half (kvemu/backends.py owns the
  callbacks): it builds the keys, times the store's call, counts what the store decided.

docs/extending.md ("Adding a store") says how to add one. Nothing here imports the compiled module.
"""
from __future__ import annotations

import bisect
import importlib
import os
import time
from collections.abc import Mapping, Sequence
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from ..errors import BackendError, ConfigError

#: What a store may decide about one object, beside success (a key of :attr:`Store.outcomes`' values):
#: a put it had no room for, a put refused because it holds the object (a lease), a get that found no
#: object (never stored, or evicted), a get of an object whose size differs from the one asked for.
OUTCOMES = ("put_refused", "lease_held", "get_missing", "get_partial")
_OF_OP = {"puts": OUTCOMES[:2], "gets": OUTCOMES[2:]}


@runtime_checkable
class Store(Protocol):
    """A key-value store of byte objects, reached by batch calls into and from caller memory.

    Construction: ``cls(spec)`` with the :class:`kvemu.backend_spec.BackendSpec` the user gave
    (``files:/mnt/kv``, ``mooncake:lease_ms=500``). It checks every option (ConfigError, one line,
    naming the option), says what to install where the store cannot run here (BackendUnavailable),
    and may start the store's processes; it moves no data yet.

    Results a batch call returns hold one integer per object, in the order of the keys: ``>= 0``
    for success (a get may return the bytes it read), or a negative code of the store's own. A
    code that :attr:`outcomes` names is one of the store's rules (the object was evicted, it had no
    room); any other negative code is a failure, raised by the session as BackendError. A store
    raises BackendError itself for a failure of the store as a whole (its server died).

    Every method is called from the thread replaying the tier, one call at a time; :meth:`stop`
    may also come from another thread (an interruption) and must be idempotent. kvemu asks no
    ``exists``/lookup of its own: a get that finds no object says so in its result.
    """

    #: The store's codes for its own rules, each mapped to a name of :data:`OUTCOMES`.
    outcomes: ClassVar[Mapping[int, str]]

    def start(self, buffer_addr: int, buffer_bytes: int, capacity_bytes: int) -> None:
        """Makes the store ready to hold ``capacity_bytes`` of objects (the tier's arena) and to
        move bytes to and from the caller's buffer, ``buffer_bytes`` at address ``buffer_addr``
        (registered with the store where it needs that). Called once, before any put or get;
        refuses with BackendError (one line) what it cannot do (no room on its medium)."""

    def put_from(self, keys: list[str], addrs: list[int], sizes: list[int]) -> Sequence[int]:
        """Stores ``sizes[i]`` bytes at address ``addrs[i]`` as object ``keys[i]``, replacing an
        object of that key (a tier's slot written again). Keys are distinct within a call."""

    def get_into(self, keys: list[str], addrs: list[int], sizes: list[int]) -> Sequence[int]:
        """Reads object ``keys[i]`` into ``sizes[i]`` bytes at address ``addrs[i]``."""

    # Optional: ``get_range_into(keys, offsets, addrs, sizes)`` reads ``sizes[i]`` bytes at
    # ``offsets[i]`` of object ``keys[i]`` into ``addrs[i]`` (a load that begins or ends inside a
    # stored object: StoreSession). A store without it has such loads counted, not read.

    def describe(self) -> dict:
        """Facts for the results' ``backend.facts``: at least ``store`` (its name) and ``wire``
        (what carries the bytes: ``loopback ...``, ``local file system ...``); JSON values only."""

    def stop(self) -> None:
        """Releases everything the store created: objects, files, processes, registrations.
        Idempotent; safe after a failed :meth:`start` and from another thread."""


def store_class(path: str) -> type:
    """The class a kind's ``store`` names (``"kvemu.stores.files:FileStore"``)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class StoreSession:
    """The Python half of the C store bridge for one Backend: its store, the keys, the counts.

    ``pending`` holds an exception raised inside a callback, for the Backend to raise once the C
    call has returned (an exception cannot cross C)."""

    def __init__(self, spec):
        cls = store_class(spec.kind.store)
        #: The store (an instance of the kind's class, a :class:`Store`).
        self.impl = cls(spec)
        self.name = spec.name
        self.pending: BaseException | None = None
        self.counts = {"puts": 0, "gets": 0, **{k: 0 for k in OUTCOMES}, "put_duplicate": 0,
                       "get_within_object": 0, "get_within_object_unread": 0}
        self.staging_addr = 0
        self.key_prefix = f"kv{os.getpid()}-{id(self):x}-"
        self.objects = StoredRanges()

    def prepare(self, staging_addr: int, staging_bytes: int, arena_bytes: int) -> None:
        self.impl.start(int(staging_addr), int(staging_bytes), int(arena_bytes))
        self.staging_addr = int(staging_addr)

    def access(self, op: int, acc: np.ndarray) -> int:
        """One batch: ``acc`` the core's struct kv_access array (op 0 loads: get, 1 stores: put).
        The key of a stored object is its transfer's arena offset; a load is read from the objects
        that hold its bytes (:meth:`_get`). Returns the ns of the store's calls alone."""
        if op != 1:
            return self._get(acc)
        # A slot stored twice in one batch (two requests writing one chunk): its last transfer
        # wins, as it would in the tier; a store takes each key once per batch call.
        last = len(acc) - 1 - np.unique(acc["arena_off"][::-1], return_index=True)[1]
        if len(last) < len(acc):
            self.counts["put_duplicate"] += len(acc) - len(last)
            acc = acc[np.sort(last)]
        offs = acc["arena_off"].tolist()
        addrs = (acc["staging_off"] + np.uint64(self.staging_addr)).tolist()
        sizes = acc["bytes"].tolist()
        t0 = time.perf_counter_ns()
        res = self.impl.put_from(self._keys(offs), addrs, sizes)
        ns = time.perf_counter_ns() - t0
        self._count(res, "puts", len(offs))
        for off, size, r in zip(offs, sizes, np.asarray(res, np.int64).tolist()):
            self.objects.put(off, off + size, r >= 0)
        return ns

    def _keys(self, offs) -> list[str]:
        return [f"{self.key_prefix}{o}" for o in offs]

    def _get(self, acc: np.ndarray) -> int:
        """A batch of loads. The core cuts a load's transfers where the engine's hit begins and
        ends, which need not be where the tier's objects do: a prefix the engine holds in HBM up
        to the middle of a chunk is loaded from there on, while the chunk was stored whole. Each
        transfer is read from the objects that hold its bytes (StoredRanges): a whole object by
        ``get_into``; part of one by the store's ``get_range_into`` (or, for a store without it,
        counted in ``get_within_object_unread`` and not read); bytes no object holds by ``get_into`` of
        their own offset, which the store answers as a get that found no object (never stored)."""
        offs = acc["arena_off"].tolist()
        addrs = (acc["staging_off"] + np.uint64(self.staging_addr)).tolist()
        sizes = acc["bytes"].tolist()
        whole: tuple = ([], [], [])           # key offsets, addresses, sizes
        part: tuple = ([], [], [], [])        # object offsets, offsets in them, addresses, sizes
        for off, addr, size in zip(offs, addrs, sizes):
            for a, b, obj in self.objects.pieces(off, off + size):
                if obj is None or (obj == a and self.objects.size[obj] == b - a):
                    for lst, v in zip(whole, (a, addr + a - off, b - a)):
                        lst.append(v)
                else:
                    for lst, v in zip(part, (obj, a - obj, addr + a - off, b - a)):
                        lst.append(v)
        ns = 0
        if whole[0]:
            t0 = time.perf_counter_ns()
            res = self.impl.get_into(self._keys(whole[0]), whole[1], whole[2])
            ns += time.perf_counter_ns() - t0
            self._count(res, "gets", len(whole[0]))
        if part[0]:
            ranged = getattr(self.impl, "get_range_into", None)
            if ranged is None:
                self.counts["get_within_object_unread"] += len(part[0])
            else:
                t0 = time.perf_counter_ns()
                res = ranged(self._keys(part[0]), part[1], part[2], part[3])
                ns += time.perf_counter_ns() - t0
                self._count(res, "gets", len(part[0]))
                self.counts["get_within_object"] += len(part[0])
        return ns

    def _count(self, res, what: str, n: int) -> None:
        r = np.asarray(res, dtype=np.int64)
        if r.shape != (n,):
            raise BackendError(f"{self.name}: the store answered a batch {what[:-1]} of {n} objects with "
                               f"{r.size} results", 0)
        self.counts[what] += n
        bad = r[r < 0]
        if not bad.size:  # every object done: nothing more to count (the usual batch, kept lean)
            return
        outcomes = {c: k for c, k in self.impl.outcomes.items() if k in _OF_OP[what]}
        for code, name in outcomes.items():
            self.counts[name] += int((bad == code).sum())
        other = bad[~np.isin(bad, list(outcomes))]
        if other.size:
            raise BackendError(f"{self.name}: a batch {what[:-1]} of {n} objects failed with store error "
                               f"{int(other[0])} ({int(other.size)} objects)", 0)

    def facts(self) -> dict:
        """The store's facts and what it decided (``store_puts``, ``store_get_missing``, ...)."""
        return {**self.impl.describe(), **{f"store_{k}": v for k, v in self.counts.items()}}

    def close(self) -> None:
        self.impl.stop()


class StoredRanges:
    """What a store holds where, in arena bytes: disjoint ranges ``[start, end)``, each with the
    offset of the object (the put) holding it, the latest put of a byte winning, as the tier's
    arena. A put replaces the object of its key whole (a refused one leaves none: the store
    refused it or dropped the old object), so the ranges the object of that key held elsewhere go."""

    def __init__(self):
        self.starts: list[int] = []            # sorted
        self.ranges: dict[int, tuple] = {}     # start -> (end, object offset)
        self.of_object: dict[int, set] = {}    # object offset -> starts of the ranges it holds
        self.size: dict[int, int] = {}         # object offset -> its size

    def _remove(self, start: int) -> int:
        """Drops the range at ``start``; returns the object that held it."""
        _, obj = self.ranges.pop(start)
        del self.starts[bisect.bisect_left(self.starts, start)]
        self.of_object[obj].discard(start)
        return obj

    def _add(self, a: int, b: int, obj: int) -> None:
        bisect.insort(self.starts, a)
        self.ranges[a] = (b, obj)
        self.of_object.setdefault(obj, set()).add(a)

    def put(self, a: int, b: int, stored: bool) -> None:
        """A put of ``[a, b)`` as object ``a``; ``stored``: the store took it."""
        if stored and self.ranges.get(a) == (b, a) and len(self.of_object[a]) == 1:
            return  # the slot's object written again whole (the usual put)
        for s in list(self.of_object.get(a, ())):
            self._remove(s)
        self.of_object.pop(a, None)
        self.size.pop(a, None)
        if not stored:
            return
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        for s in self.starts[i:bisect.bisect_left(self.starts, b)]:
            e, obj = self.ranges[s]
            if e <= a:
                continue
            self._remove(s)
            if s < a:
                self._add(s, a, obj)
            if e > b:
                self._add(b, e, obj)
            if not self.of_object[obj]:  # wholly written over
                del self.of_object[obj], self.size[obj]
        self._add(a, b, a)
        self.size[a] = b - a

    def pieces(self, a: int, b: int) -> list[tuple]:
        """``[a, b)`` cut where the objects holding it begin and end: ``(start, end, object offset
        or None where no object holds the bytes)``, in order."""
        out, p = [], a
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        for s in self.starts[i:bisect.bisect_left(self.starts, b)]:
            e, obj = self.ranges[s]
            if e <= p:
                continue
            if s > p:
                out.append((p, s, None))
            out.append((max(s, p), min(e, b), obj))
            p = min(e, b)
        if p < b:
            out.append((p, b, None))
        return out


def no_target(spec) -> None:
    """ConfigError where a store that takes no positional option was given one."""
    if spec.target is not None:
        raise ConfigError(f"{spec.name}: takes no positional option, got {spec.target!r} (options: "
                          f"{', '.join(spec.kind.options) or 'none'})")


__all__ = ["OUTCOMES", "Store", "StoreSession", "StoredRanges", "no_target", "store_class"]
