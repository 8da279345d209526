"""A pool of KV blocks with a prefix cache: HBM in vLLM, or the tier when KV lives there.

Blocks in use by running requests are referenced; blocks no request uses stay cached (so later
requests can hit them) until space is needed, then the least recently used goes first.
Requests reserve all the blocks they will ever need when admitted, so the engine never has to
preempt; a reserved block becomes a registered (hittable) block once its content is computed.
"""

from __future__ import annotations

import threading
from array import array

import numpy as np

from ..backends import BlockRefs
from ..policies import make_policy


class BlockPool:
    """The pool's blocks: those registered under an id (hittable), each with the running requests
    that use it, in C (backends.BlockRefs: a batch of blocks a call); those reserved (held by
    running requests, not yet registered) counted. ``capacity`` in blocks (None: unbounded)."""

    def __init__(self, capacity: int | None):
        self.capacity = capacity  # blocks; None = unbounded
        self.refs = BlockRefs()  # registered block id -> requests using it; the unused ones in LRU order
        self.reserved = 0  # blocks held by running requests but not registered under an id
        self.evictions = 0
        self.peak = 0  # most blocks resident at once (registered or reserved)
        # instances that share the pool (a shared tier under ``resident``) call it from their threads
        self.lock = threading.Lock()

    @property
    def ref(self) -> dict:
        """Registered block id -> the running requests using it (a copy)."""
        with self.lock:
            return self.refs.counts()

    def __contains__(self, block_id: int) -> bool:
        with self.lock:
            return self.refs.users(block_id) >= 0

    def resident(self) -> int:
        return self.refs.registered() + self.reserved

    def prefix_hit(self, ids, start: int, limit: int) -> tuple[int, int]:
        """Blocks ids[start:limit] present in order from ``start``; and how many of them are unreferenced."""
        if limit <= start:
            return 0, 0
        with self.lock:
            return self.refs.prefix_hit(ids[start:limit])

    def can_hold(self, new_blocks: int, idle_hits: int) -> bool:
        if self.capacity is None:
            return True
        with self.lock:
            evictable = self.refs.idle() - idle_hits
            return self.capacity - self.resident() + evictable >= new_blocks

    def pin(self, ids) -> None:
        with self.lock:
            self.refs.pin(ids)

    def reserve(self, n: int) -> None:
        with self.lock:
            self.reserved += n
            self._make_room()
            self.peak = max(self.peak, self.resident())

    def _make_room(self) -> None:
        """Evicts unused blocks, least recently used first, until the resident ones fit (or none is left)."""
        if self.capacity is None:
            return
        over = self.resident() - self.capacity
        if over > 0:
            self.evictions += self.refs.evict(over)

    def register(self, ids) -> None:
        """Reserved blocks whose content is now computed become hittable under their ids (a block
        computed concurrently by another request is kept once, with both as users)."""
        with self.lock:
            self.refs.register(ids)
            self.reserved -= len(ids)

    def unregister(self, ids) -> None:
        """Blocks registered ahead of their content (an asynchronous load) that will not arrive: they
        go back to being reserved, to be computed and registered again."""
        with self.lock:
            self.refs.unregister(ids)
            self.reserved += len(ids)

    def release(self, registered_ids, reserved_left: int) -> None:
        """A request finished: its shared blocks stay cached, tail first in line for eviction."""
        with self.lock:
            self.refs.release(registered_ids)
            self.reserved -= reserved_left


class BlockSet:
    """The blocks an unbounded tier holds: a byte per block id (grown to the largest id seen) and the
    ids in the order first stored, 4 bytes each (8 past 2^32): a few bytes a block where a dict of
    Python ints took about 100, so the tier's copy of a long trace stays small. Iterates in the order
    first stored, as the dict it replaces did."""

    __slots__ = ("bits", "order")

    def __init__(self):
        self.bits = bytearray()
        self.order = array("I")

    def __contains__(self, b) -> bool:
        return b < len(self.bits) and self.bits[b] == 1

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self):
        return iter(self.order)

    def add_many(self, ids) -> None:
        """Adds ``ids`` (a sequence of ints or an int array), in order, those not held yet."""
        if not len(ids):
            return
        ids = np.asarray(ids, np.int64)
        bits, order = self.bits, self.order
        top = int(ids.max())
        if top >= len(bits):
            bits.extend(bytes(max(top + 1, 2 * len(bits)) - len(bits)))
            if top >= 1 << 32 and order.typecode == "I":
                self.order = order = array("q", order)
        held = np.frombuffer(bits, np.uint8)  # a view: dropped before bits can grow again
        new = ids[held[ids] == 0]
        if len(new) > 1:
            s = np.sort(new)
            if (s[1:] == s[:-1]).any():  # a block given twice joins once, where it came first
                new = new[np.sort(np.unique(new, return_index=True)[1])]
        held[new] = 1
        del held
        order.frombytes(new.astype(np.uint32 if order.typecode == "I" else np.int64).tobytes())

    def prefix(self, ids) -> int:
        """How many of ``ids`` (an int array) are held, in order from the first."""
        bits = self.bits
        inside = ids < len(bits)
        held = np.zeros(len(ids), bool)
        held[inside] = np.frombuffer(bits, np.uint8)[ids[inside]] == 1
        miss = np.flatnonzero(~held)
        return int(miss[0]) if len(miss) else len(ids)


class TierCache:
    """The tier in write-through offload mode: a copy of blocks, evicted by ``policy`` (a
    kvemu.policies name; LRU, as the engine always ran it) when bounded. ``capacity`` in blocks;
    ``peak`` the most blocks it held at once; ``blocks`` the blocks held (unbounded: in the order
    first stored; bounded: the policy's keys). A request's table may be given as a list or an int64
    array (``takes_arrays``); instances sharing the tier call it from their threads (``lock``)."""

    #: the engine may give a request's table as an int64 array (else as a list)
    takes_arrays = True

    def __init__(self, capacity: int | None, policy: str = "lru"):
        self.capacity = capacity
        self.policy = policy
        self.order = None if capacity is None else make_policy(policy, capacity)
        self.blocks = BlockSet() if capacity is None else self.order.held
        self.evictions = 0
        self.peak = 0
        self.lock = threading.Lock()

    def prefix_hit(self, ids, start: int, limit: int) -> int:
        if limit <= start:
            return 0
        blocks = self.blocks
        if type(blocks) is BlockSet:
            with self.lock:
                return blocks.prefix(np.asarray(ids[start:limit], np.int64))
        ids = _as_list(ids[start:limit])
        n = 0
        while n < len(ids) and ids[n] in blocks:
            n += 1
        return n

    def touch(self, ids) -> None:
        if self.order is not None:
            self.order.hit_many(ids)

    def add(self, ids) -> None:
        if self.order is None:
            with self.lock:
                self.blocks.add_many(ids)
        else:
            self.evictions += len(self.order.insert_many(ids))
        self.peak = max(self.peak, len(self.blocks))

    def touch_range(self, table, p0: int, p1: int) -> None:
        """Blocks at positions ``p0..p1-1`` of a request's ``table`` were used (a prefix hit)."""
        if self.order is not None:
            self.touch(_as_list(table[p0:p1]))

    def add_range(self, table, p0: int, p1: int) -> None:
        """The blocks at positions ``p0..p1-1`` of a request's ``table`` are stored."""
        self.add(table[p0:p1] if self.order is None else _as_list(table[p0:p1]))


def _as_list(ids):
    """Block ids as a list (the policies' keys are ints)."""
    return ids.tolist() if isinstance(ids, np.ndarray) else ids


class ChunkTierCache(TierCache):
    """An offload tier that holds and evicts whole transfer chunks, LRU (``policy``), as the
    replay's arena (backends.TierSlots) does: ``capacity`` in chunks of ``chunk_blocks`` blocks. The
    block at position ``p`` of a request's table belongs to the chunk named by the block at ``p - p %
    chunk_blocks`` (the arena's key: requests sharing a prefix share its chunks). A block is
    present once stored; evicting a chunk drops every block of it stored so far (``evictions``
    counts blocks). Closed-loop replay with ``--tier-capacity``; instances sharing it may call it
    from their threads at once (real tiers), so its changes hold a lock, and a block evicted between
    another instance's lookup and its touch is skipped (its load then counts as a load miss)."""

    takes_arrays = False  # a request's table as a list

    def __init__(self, capacity_chunks: int, chunk_blocks: int, policy: str = "lru"):
        super().__init__(capacity_chunks, policy)
        self.blocks = {}                             # stored blocks
        self.chunk_blocks = chunk_blocks
        self.chunk_of: dict[int, int] = {}           # stored block -> its chunk's key
        self.chunks: dict[int, list] = {}            # chunk key -> its stored blocks (the policy orders the keys)
        self.lock = threading.Lock()

    def touch(self, ids) -> None:
        chunk_of = self.chunk_of
        with self.lock:
            self.order.hit_many([k for k in map(chunk_of.get, ids) if k is not None])

    def touch_range(self, table, p0: int, p1: int) -> None:
        self.touch(table[p0:p1])

    def add(self, ids) -> None:
        raise TypeError("a ChunkTierCache is given table positions (add_range): a block's chunk depends on them")

    def add_range(self, table, p0: int, p1: int) -> None:
        with self.lock:
            self._add_range(table, p0, p1)

    def _add_range(self, table, p0: int, p1: int) -> None:
        cb, blocks, chunks, chunk_of = self.chunk_blocks, self.blocks, self.chunks, self.chunk_of
        keys = []
        for p in range(p0, p1):
            b = table[p]
            key = table[p - p % cb]
            if b not in chunk_of:
                chunk_of[b] = key
                blocks[b] = None
                chunks.setdefault(key, []).append(b)
            keys.append(chunk_of[b])
        for k in dict.fromkeys(self.order.insert_many(keys)):
            if k in self.order:  # evicted and stored again within the batch (a policy that makes room per key)
                continue
            gone = chunks.pop(k)
            for b in gone:
                del chunk_of[b]
                del blocks[b]
            self.evictions += len(gone)
        self.peak = max(self.peak, len(blocks))
