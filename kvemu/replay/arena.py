"""The tier arena and what moves through it: the layers replayed, the transfer unit and layout,
the tier's capacity, the block ids a replay touches (which size the arena and map ids to slots),
the check that the arena fits the machine, and the block tables of one batch in the form the C
replay takes, streamed from the entries of a step span."""

from __future__ import annotations

import errno
import os

import numpy as np

from ..backend_spec import BackendSpec
from ..backends import TierSlots
from ..bounds import DEFAULT_TIER_EVICTION, LAYOUTS
from ..errors import BackendError, OptionError, ResourceLimitError, TraceError
from ..policies import make_policy
from ..record_options import chunk_tokens_problem
from ..schema import OPS, iter_entries
from .host import meminfo

# LMCache moves KV in chunks of 256 tokens (LMCACHE_CHUNK_SIZE); the transfer unit of traces that do not
# record one.
DEFAULT_CHUNK_TOKENS = 256
STEP_BATCH_ENTRIES = 1 << 14
TOUCH_BATCH_ENTRIES = 1 << 14


def layer_plan(n_layers: int, replay_layers: int | None) -> tuple[list[int], np.ndarray]:
    """Replay ``k`` evenly spaced layers; each stands for a contiguous group of model layers."""
    k = n_layers if replay_layers is None else replay_layers
    if not 1 <= k <= n_layers:
        raise OptionError("window.layers", f"must be between 1 and the model's {n_layers} layers")
    bounds = (np.arange(k + 1) * n_layers) // k
    span = np.diff(bounds).astype(np.uint32)
    return bounds[:-1].tolist(), span


def block_tokens_of(h) -> int:
    return int(h.meta.get("engine", {}).get("tokens_per_block") or h.meta.get("model", {}).get(
        "tokens_per_block") or 16)


def transfer_shape(h) -> dict:
    """How replay moves a trace's KV unless told otherwise: chunk tokens and blocks, layout, and
    where each came from (``trace`` or ``default``)."""
    block_tokens = block_tokens_of(h)
    chunk_tokens, chunk_from = chunk_tokens_of(h, None, block_tokens)
    layout, layout_from = layout_of(h, None)
    return {"chunk_tokens": chunk_tokens, "chunk_blocks": chunk_tokens // block_tokens,
            "chunk_tokens_from": chunk_from, "layout": layout, "layout_from": layout_from}


def chunk_tokens_of(h, given: int | None, block_tokens: int) -> tuple[int, str]:
    """The transfer unit in tokens and where it came from (``--chunk-tokens``, the trace, default)."""
    recorded = h.meta.get("engine", {}).get("transfer_chunk_tokens")
    value, origin = ((given, "--chunk-tokens") if given is not None else
                     (recorded, "trace") if isinstance(recorded, int) and recorded > 0 else
                     (max(DEFAULT_CHUNK_TOKENS // block_tokens, 1) * block_tokens, "default"))
    why = chunk_tokens_problem(value, block_tokens)
    if why:
        if origin == "trace":
            raise TraceError(f"{h.path}: engine.transfer_chunk_tokens {why}")
        raise OptionError("datapath.chunk_tokens", why)
    return value, origin


def layout_of(h, given: str | None) -> tuple[str, str]:
    """The KV layout of transfers and where it came from (--kv-layout, the trace, default per-layer)."""
    recorded = h.meta.get("engine", {}).get("kv_layout")
    value, origin = ((given, "--kv-layout") if given is not None else
                     (recorded, "trace") if recorded in LAYOUTS else ("per-layer", "default"))
    if value not in LAYOUTS:
        raise OptionError("datapath.layout", f"must be one of {', '.join(LAYOUTS)}, got {value!r}")
    return value, origin


def tier_capacity_of(h, given: int | None, chunk_blocks: int, block_all_layers: int) -> tuple[int | None, str]:
    """The tier's capacity in chunks and where it came from: --tier-capacity (bytes of all layers), the
    trace's recorded tier capacity, or None (unbounded: every touched chunk gets a slot)."""
    chunk_all_layers = chunk_blocks * block_all_layers
    if given is not None:
        if not isinstance(given, int) or given < chunk_all_layers:
            raise OptionError("tier.capacity_bytes", f"must hold at least one chunk ({chunk_all_layers} bytes)")
        return given // chunk_all_layers, "--tier-capacity"
    recorded = h.meta.get("engine", {}).get("tier_capacity_blocks")
    if isinstance(recorded, int) and recorded > 0:
        return max(recorded // chunk_blocks, 1), "trace"
    return None, "unbounded"


def provisioned_bytes(h, given: int | None, capacity: int | None, capacity_from: str, chunk_all_layers: int,
                      block_all_layers: int) -> int | None:
    """The tier capacity the run was provisioned with, all layers, as the cost prices it: the
    user's --tier-capacity as given, the recording's tier (its blocks), the arena --max-memory
    allowed (its chunks); None for an unbounded tier (nothing was provisioned)."""
    if capacity_from == "--tier-capacity":
        return int(given)
    if capacity_from == "trace":
        return int(h.meta["engine"]["tier_capacity_blocks"]) * block_all_layers
    return None if capacity is None else int(capacity) * chunk_all_layers


def touched_blocks(trace, s0: int, s1: int, instances: int, chunk_blocks: int = 1):
    """Which block ids the entries of steps [s0, s1] touch, per instance (requests round-robin):
    a boolean matrix (instances x blocks.id_space), one byte per block id and instance whatever
    the trace's length; and, for chunked transfers, each touched block's chunk (the id of the
    block at the chunk's first position: a prefix hash names the whole prefix, so requests sharing
    a block share its chunk) and its offset in it (None, None for one block per chunk)."""
    id_space = int(trace.header.meta["blocks"]["id_space"])
    touched = np.zeros((instances, id_space), bool)
    key_of = off_of = None
    if chunk_blocks > 1:
        key_of = np.zeros(id_space, np.int64 if id_space >= 2**31 else np.int32)
        off_of = np.zeros(id_space, np.uint16)
    # smaller batches than the replay's: their tables span whole requests, not a C call's share
    for e in entries_in_span(trace, s0, s1, batch_rows=TOUCH_BATCH_ENTRIES):
        t = LocalTables(trace, e)
        n = int(t.table_off[-1])
        mark = np.zeros(n + 1, np.int64)  # +1 where an accessed range starts, -1 after it ends
        for op in OPS:
            live = t.count[op] > 0
            first = t.table_off[t.local[live]].astype(np.int64) + t.first[op][live]
            np.add.at(mark, first, 1)
            np.add.at(mark, first + t.count[op][live], -1)
        hit = np.cumsum(mark[:-1]) > 0
        touched[(t.requests[t.owner] % instances)[hit], t.ids[hit]] = True
        if key_of is not None:
            pos = t.position[hit]
            off = pos % chunk_blocks
            key_of[t.ids[hit]] = trace.block_ids(t.requests[t.owner][hit], pos - off)
            off_of[t.ids[hit]] = off
    return touched, key_of, off_of


def check_arena_fits(backend_spec: str, arena_bytes: int, n_slots: int, layers: int, block_bytes: int,
                      max_memory: int) -> None:
    """Refuse, before anything is allocated, an arena the machine cannot hold. Memory tiers are
    bounded by --max-memory and available memory; a uring tier by the free space of its file
    system; virtual time needs no arena."""
    spec = BackendSpec.parse(backend_spec)
    what = (f"the tier arena would need {arena_bytes / 2**30:.2f} GiB ({n_slots} blocks x {layers} layers x "
            f"{block_bytes} B)")
    hint = ("replay fewer layers (--layers), give a smaller --tier-capacity, or raise --max-memory")
    if spec.kind.arena is None:
        return
    if spec.kind.arena == "file":
        folder = spec.folder()
        try:
            st = os.statvfs(folder)
        except OSError:
            return  # the backend reports a missing folder itself
        free = st.f_bavail * st.f_frsize
        if spec.option("size") != "existing" and arena_bytes > 0.9 * free:
            raise ResourceLimitError(f"{what} but {folder} has {free / 2**30:.2f} GiB free; {hint}")
        return
    if arena_bytes > max_memory:
        raise ResourceLimitError(f"{what} but --max-memory is {max_memory / 2**30:.2f} GiB; {hint}")
    available = meminfo("MemAvailable")
    if available is not None and arena_bytes > 0.8 * available:
        raise ResourceLimitError(f"{what} but only {available / 2**30:.2f} GiB of memory is available; {hint}")


class LocalTables:
    """The block tables one batch of entries needs, in the CSR form the C replay takes: for each
    request of the batch, its table positions from the lowest its entries access to the highest,
    and the entries' ranges rebased onto them. Bounded by the batch, not the trace."""

    def __init__(self, trace, e):
        rid = e["request_id"].astype(np.int64)
        big = np.iinfo(np.int64).max
        if len(rid) < 2 or bool((rid[1:] > rid[:-1]).all()):
            # each request once, in order (every call of the closed loop): its entries are its requests,
            # and each table's range is its entry's own, over the ops at once (what np.unique and
            # ufunc.at give, elementwise)
            self.requests, self.local = rid, np.arange(len(rid))
            count = np.array([e[f"{op}_count"] for op in OPS], np.int64).reshape(len(OPS), len(rid))
            first = np.array([e[f"{op}_first"] for op in OPS], np.int64).reshape(len(OPS), len(rid))
            live = count > 0
            hi = np.where(live, first + count, 0).max(axis=0, initial=0)
            lo = np.minimum(np.where(live, first, big).min(axis=0, initial=big), hi)
            self.count = dict(zip(OPS, count))
            self.first = dict(zip(OPS, np.where(live, first - lo, 0)))
        else:
            self.requests, self.local = np.unique(rid, return_inverse=True)
            lo, hi = np.full(len(self.requests), big), np.zeros(len(self.requests), np.int64)
            self.count, first = {}, {}
            for op in OPS:
                self.count[op] = e[f"{op}_count"].astype(np.int64)
                first[op] = e[f"{op}_first"].astype(np.int64)
                live = self.count[op] > 0
                np.minimum.at(lo, self.local[live], first[op][live])
                np.maximum.at(hi, self.local[live], (first[op] + self.count[op])[live])
            lo = np.minimum(lo, hi)  # a request with no access in the batch gets an empty table
            self.first = {op: np.where(self.count[op] > 0, first[op] - lo[self.local], 0) for op in OPS}
        m = len(self.requests)
        self.base = lo  # each request's block-table position of its local position 0
        self.table_off = np.zeros(m + 1, np.uint64)
        np.cumsum(hi - lo, out=self.table_off[1:])
        n = int(self.table_off[-1])
        self.owner = np.repeat(np.arange(m), hi - lo)  # local request of each table position
        self.position = lo[self.owner] + np.arange(n) - self.table_off[:-1][self.owner].astype(np.int64)
        self.ids = trace.block_ids(self.requests[self.owner], self.position)


def greedy_groups(sizes: np.ndarray, budget: int) -> np.ndarray:
    """Group index of each item when consecutive items are packed greedily into groups of at most
    ``budget`` (an item larger than the budget gets a group of its own). Non-decreasing."""
    group = np.empty(len(sizes), np.int64)
    g, used = 0, 0
    for i, x in enumerate(sizes.tolist()):  # one value per step, not per access
        if used and used + x > budget:
            g, used = g + 1, 0
        group[i] = g
        used += x
    return group


def range_positions(t, op: str) -> np.ndarray:
    """Positions in a call's local tables that the entries' ``op`` ranges cover (with repeats)."""
    count = t.count[op]
    live = count > 0
    if not live.any():
        return np.zeros(0, np.int64)
    start = t.table_off[t.local[live]].astype(np.int64) + t.first[op][live]
    n = count[live]
    return np.repeat(start - np.r_[0, np.cumsum(n)[:-1]], n) + np.arange(int(n.sum()))


def entries_in_span(trace, s0: int, s1: int, batch_rows: int = STEP_BATCH_ENTRIES):
    for e in iter_entries(trace, batch_rows=batch_rows):
        st = e["step"]
        if st[-1] < s0:
            continue
        if st[0] > s1:
            break
        keep = (st >= s0) & (st <= s1)
        if keep.all():
            yield e
        elif keep.any():
            yield {k: v[keep] for k, v in e.items()}


def geometry_warning(meta: dict, layout: str = "per-layer") -> str | None:
    """The warning for what a replay still does not move as the engine would, for a trace whose model
    has KV groups (models.KVGroup): replay moves each group's own blocks and states per layer
    (layerkv, kvemu.h struct kv_layer), on every level of a tier stack too, except with the
    cross-layer layout, whose copies move a block of every layer at once (full attention's). None
    when nothing is left out."""
    groups = ((meta.get("model") or {}).get("kv_groups") or {}).get("groups") or []
    kinds = sorted({g.get("kind") for g in groups if isinstance(g, dict) and g.get("kind") != "full"})
    if not kinds:
        return None
    if layout == "cross-layer":
        return (f"KV bytes are full attention's: this model has {', '.join(kinds)} layers, but the cross-layer "
                f"layout moves a block of every layer at once, so replay moves the trace's full-attention block "
                f"in every layer per block operation (more than an engine moves for windowed and linear layers, "
                f"without DeepSeek-V3.2's indexer keys), and kv_bytes_* count those blocks; use --kv-layout "
                f"per-layer to move each group's own bytes")
    return None


class PolicySlots:
    """The tier's slot allocator for an eviction policy other than LRU (a kvemu.policies name;
    LRU is backends.TierSlots, in C): ``capacity`` slots, each chunk key held by the policy keeping
    its slot until the policy evicts it, a new key taking the slot of what its insertion evicted
    (or a slot never used). The interface and counts of TierSlots: :meth:`map` gives each key's
    slot and whether it was stored by this call; ``evictions``; ``overflow`` the keys evicted by a
    later key of the call that mapped them. A held key mapped is a use (``on_hit``), as the C LRU
    takes it, unless ``written`` says the call does not load it (``on_write``: no reuse, as the
    engine's tier counts a store or a block found in HBM). One Python step per key: the replay's arena is mapped chunk by
    chunk, a small share of a replay's work."""

    #: map() takes ``written`` (replay.accumulate passes it)
    takes_writes = True

    def __init__(self, policy: str, capacity: int, key_space: int, origin: str = "--tier-capacity"):
        self.origin = origin
        self.policy = make_policy(policy, int(capacity), "--tier-eviction")
        self.capacity = int(capacity)
        self.key_space = int(key_space)
        self.evictions = 0
        self.overflow = 0
        self.resident = 0                  # slots ever used, as the C allocator's count
        self._slot_of: dict[int, int] = {}
        self._free: list[int] = []
        self._mapped: dict[int, int] = {}  # key -> the call that last mapped it
        self._stored: dict[int, int] = {}  # key -> the call that stored it
        self._epoch = 0

    def map(self, keys, written=None) -> tuple[np.ndarray, np.ndarray]:
        """(slot of each key, whether it was not resident before this call); ``written``: a bool per
        key, True where the call does not load it (default: every key a use)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if len(keys) and (int(keys.min()) < 0 or int(keys.max()) >= self.key_space):
            raise BackendError("tier slots: a key is outside the key space", errno.EINVAL)
        self._epoch += 1
        ep = self._epoch
        pol, slot_of, free, mapped, stored = self.policy, self._slot_of, self._free, self._mapped, self._stored
        slots = np.empty(len(keys), np.uint32)
        fresh = np.empty(len(keys), bool)
        writes = [False] * len(keys) if written is None else np.asarray(written, bool).tolist()
        for i, (k, w) in enumerate(zip(keys.tolist(), writes)):
            s = slot_of.get(k)
            if s is not None:
                pol.on_write(k) if w else pol.on_hit(k)
            else:
                for v in pol.on_insert(k):
                    free.append(slot_of.pop(v))
                    stored.pop(v)
                    if mapped.pop(v) == ep:
                        self.overflow += 1
                    self.evictions += 1
                if free:
                    s = free.pop()
                else:
                    s = self.resident
                    self.resident += 1
                slot_of[k] = s
                stored[k] = ep
            mapped[k] = ep
            slots[i] = s
            fresh[i] = stored[k] == ep
        return slots, fresh


def tier_slots(eviction: str, capacity: int, key_space: int, origin: str):
    """The slot allocator of a tier of ``capacity`` chunks evicting by ``eviction`` (a kvemu.policies
    name): the C LRU (backends.TierSlots) for lru, else a PolicySlots."""
    if eviction == DEFAULT_TIER_EVICTION:  # LRU
        return TierSlots(capacity, key_space, origin)
    return PolicySlots(eviction, capacity, key_space, origin)
