"""A stack of tiers below HBM for closed-loop replay (``--tiers``; docs/replay.md, "A stack of tiers").

A stack is levels, top to bottom, each with a backend spec (the medium its bytes are timed on), a
capacity, a link, an eviction policy (``lru`` or ``fifo``) and whether it is ``private`` to an
instance or ``shared`` by all; and one placement rule for the whole stack:

- ``write-back`` (default; HiCache ``write_back``, Dynamo KVBM's offload on eviction): a stored block
  lands in the top level only; a chunk the top level evicts is demoted into the next level, and so
  on down; what the bottom level evicts is gone.
- ``write-through`` (SGLang HiCache ``write_through``): a stored block lands in every level.
- ``write-through-selective`` (HiCache ``write_through_selective``): a stored block lands in the top
  level; it is copied to the levels below once it has been reused (hit) ``selective_hits`` times.
- ``inclusive``: a stored block lands in every level, and so does a served one (a use where the
  level holds it): the analysis's rule with the levels as independent caches.

kvemu.stackrules names these rules (with their sources) for this module and ``analyze capacity``.

Levels are ``private`` (one per instance) or ``shared`` (one for all instances); the private levels
come first (a shared level above a private one is refused): an instance's lookup walks its own
private levels, then the shared ones (LMCache's local CPU/disk backends above a remote one,
Mooncake's per-node memory above its shared store).

A lookup walks down: the first level holding a block serves it. With ``promote`` a block served
below the top is copied into the top level (write-back placement then demotes what that evicts). A
block no level holds is recomputed: the engine's prefix ends there, so its prefill grows.

Levels hold and evict whole transfer chunks, as the replay's arena does (engine.pool.ChunkTierCache):
the block at table position ``p`` belongs to the chunk named by the block at ``p - p % chunk_blocks``.

The stack's description (:class:`StackSpec`, :func:`parse_tiers`) is kvemu/stackspec.py's; this
module holds the engine-side stack (:class:`TierStack`): which level serves each block, what each
level holds, the bytes each moves. The closed loop (replay.closed.loop) times each level's share of a step on that
level's own backend context.
"""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass, field
from itertools import chain, compress

import numpy as np

from ..backend_spec import parse_spec
from ..backends import ENTRY_DTYPE, STEP_DTYPE
from ..links import get_link
from ..policies import make_policy
from ..stackspec import STACK_POLICIES, StackSpec, parse_tiers  # noqa: F401  (importable from here too)
from .instances import open_configured, open_load_stream



@dataclass
class LevelCache:
    """One level's chunks, evicted whole by its policy (a kvemu.policies object over chunk keys), and
    what it did: ``served_blocks`` hits it served, ``stored_blocks`` blocks written into it (stores,
    demotions, promotions, write-through copies), ``evicted_blocks``; ``peak_blocks`` the most it
    held. A block served is a hit on its chunk; a block added to a chunk held, or stored again, is a
    write to it (LRU counts both as uses, FIFO and S3-FIFO neither). Which chunk holds each block is
    an array over block ids (``key_of``, -1: none; ``id_space`` ids to start with, grown as larger
    ids come), so a batch of blocks is looked up, stored and dropped in a few numpy calls."""

    capacity_chunks: int
    policy: str
    chunks: dict = field(default_factory=dict)   # chunk key -> its stored block ids
    held: int = 0
    peak_blocks: int = 0
    served_blocks: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0
    demoted_blocks: int = 0   # blocks it received by demotion from the level above
    order: object = None      # the policy object (make_policy(policy, capacity_chunks))
    id_space: int = 0

    def __post_init__(self):
        if self.order is None:
            self.order = make_policy(self.policy, self.capacity_chunks)
        self.run_writes = bool(getattr(self.order, "run_writes", False))
        # a policy that stores a stretch of runs itself, its calls as _stretch's loop makes them
        self.fill = getattr(self.order, "fill_chunks", None)
        self.key_of = np.full(max(1, int(self.id_space)), -1, np.int64 if self.id_space >= 2**31 else np.int32)

    @property
    def where(self) -> dict:
        """Block id -> the key of the chunk holding it (built from ``chunks``: for tests and reports)."""
        return {b: k for k, blocks in self.chunks.items() for b in blocks}

    def keys_of(self, ids: np.ndarray) -> np.ndarray:
        """The key of the chunk holding each of ``ids`` (int64 ids >= 0), -1 where none does."""
        key_of = self.key_of
        out = key_of.take(ids, mode="clip")
        out[ids >= len(key_of)] = -1
        return out

    def _room(self, top: int) -> None:
        """``key_of`` covers block ids up to ``top``."""
        n = len(self.key_of)
        if top >= n:
            dtype = np.int64 if top >= 2**31 - 1 else self.key_of.dtype
            grown = np.full(max(top + 1, 2 * n), -1, dtype)
            grown[:n] = self.key_of
            self.key_of = grown

    def __contains__(self, b) -> bool:
        return 0 <= b < len(self.key_of) and self.key_of[b] >= 0

    def use(self, b) -> None:
        self.order.on_hit(int(self.key_of[b]))

    def put(self, key, b) -> list:
        """Stores block ``b`` in chunk ``key``; returns the chunks evicted to make room, as
        (key, blocks) victim first."""
        if b in self:
            self.order.on_write(int(self.key_of[b]))
            return []
        self._room(b)
        chunks = self.chunks
        fresh = key not in chunks
        chunks.setdefault(key, []).append(b)
        self.key_of[b] = key
        self.held += 1
        self.stored_blocks += 1
        if not fresh:
            self.order.on_write(key)
            victims = ()
        else:
            victims = self.order.on_insert(key)
        gone = []
        for k in victims:
            blocks = chunks.pop(k)
            self.key_of[blocks] = -1
            self.held -= len(blocks)
            self.evicted_blocks += len(blocks)
            gone.append((k, blocks))
        self.peak_blocks = max(self.peak_blocks, self.held)
        return gone

    def put_run(self, key, blocks: list):
        """``put`` of each of ``blocks`` (distinct ids of chunk ``key``) in order, in one call:
        returns (the blocks newly stored, in order; the chunks evicted, as ``put`` gives them), or
        None, having changed nothing, where the run must go block by block (``put_runs``)."""
        done, fresh, gone = self.put_runs([(key, blocks)], 0)
        return (fresh.tolist(), gone) if done else None

    def put_runs(self, runs: list, i: int = 0, end: int | None = None) -> tuple[int, list, list]:
        """``put`` of each block of ``runs[i:end]`` ((chunk key, distinct ids of it), in order), a run
        at a time, up to the first run that must go block by block: one not of one chunk (a block
        held under another chunk), or every run where the policy does not say its writes are
        idempotent (``CachePolicy.run_writes``). Returns (the index of that run, ``end`` when there
        is none; the blocks newly stored, in order (int64); the chunks evicted, (key, blocks), in
        order).
        The policy sees what ``put`` would show it: an insert of a run's key at its first new block
        when the chunk is new, and writes to the key (a repeated write to the same key, with
        nothing between, being one: LRU's move to the end, no-op for FIFO and S3-FIFO). Each run's
        list becomes the level's (the caller hands over lists of its own).

        Runs go in stretches: the stretch's blocks are looked up at once; while none is held and
        none comes twice (the usual case) every block is new and only the policy and the chunk
        lists are walked run by run, ``key_of`` being written once at the stretch's end (its
        stores, then its evictions: a block stored and evicted within it ends up not held); the
        run with the first held block goes alone, its blocks looked up as it comes."""
        end = len(runs) if end is None else end
        if not self.run_writes:
            return i, _NONE, []
        new: list = []   # the stretches' new blocks, arrays
        gone: list = []
        while i < end:
            part = runs[i:end]
            ids = np.fromiter(chain.from_iterable(blocks for _, blocks in part), np.int64)
            if not len(ids):  # (runs are never empty)
                break
            self._room(int(ids.max()))
            key_of = self.key_of
            have = key_of[ids]
            first_held = int(np.argmax(have >= 0)) if have.max() >= 0 else len(ids)
            lens = [len(b) for _, b in part]
            ends = np.cumsum(lens)
            stretch = int(np.searchsorted(ends, first_held, side="right"))
            if stretch:
                n_new = int(ends[stretch - 1])
                mine = ids[:n_new]
                # none held: are they distinct? (a mark per position, read back)
                marks = -2 - np.arange(n_new, dtype=key_of.dtype)
                key_of[mine] = marks
                distinct = bool((key_of[mine] == marks).all())
                key_of[mine] = -1
                if not distinct:  # one run (its ids distinct, as given): the next stretch looks again
                    stretch, n_new = 1, lens[0]
                self._stretch(part[:stretch], lens[:stretch], ids[:n_new], new, gone)
                i += stretch
                continue
            # the run holding the first held block, alone
            key, blocks = runs[i]
            have = key_of[np.array(blocks, np.int64)].tolist()
            if any(h >= 0 and h != key for h in have):
                break
            fresh = [b for b, h in zip(blocks, have) if h < 0]
            if fresh:
                self._stretch([(key, fresh)], [len(fresh)], np.array(fresh, np.int64), new, gone)
            else:
                self.order.on_write(key)
            i += 1
        return i, (new[0] if len(new) == 1 else np.concatenate(new) if new else _NONE), gone

    def _stretch(self, runs: list, lens: list, ids: np.ndarray, new: list, gone: list) -> None:
        """Stores ``runs`` (of ``lens`` blocks each), whose blocks (``ids``, in order) are all new
        and distinct."""
        chunks, order = self.chunks, self.order
        held_n, peak = self.held, self.peak_blocks
        dropped: list = []
        fill = self.fill
        if fill is not None:  # the policy walks its own queue inline (FIFO, LRU: FIFO.fill_chunks)
            held_n, peak = fill(chunks, runs, lens, held_n, peak, dropped, gone)
        get, on_write, on_insert = chunks.get, order.on_write, order.on_insert
        for (key, blocks), n in zip(() if fill is not None else runs, lens):
            held = get(key)
            if held is not None:
                on_write(key)
                held.extend(blocks)
            else:
                chunks[key] = blocks
                for k in on_insert(key):  # never ``key``
                    vb = chunks.pop(k)
                    dropped += vb
                    held_n -= len(vb)
                    gone.append((k, vb))
            held_n += n
            if held_n > peak:
                peak = held_n
        new.append(ids)
        key_of = self.key_of
        key_of[ids] = np.repeat(np.array([key for key, _ in runs], np.int64), lens)
        if dropped:
            key_of[np.array(dropped, np.int64)] = -1
        self.evicted_blocks += len(dropped)
        self.stored_blocks += len(ids)
        self.held, self.peak_blocks = held_n, peak


def _distinct(a: np.ndarray) -> np.ndarray:
    """The values of ``a`` (ids >= 0), each once, sorted: a byte per id up to the largest where that
    is not much more than ``a`` (block ids are dense), else a sort (numpy.unique's hash table is far
    slower on these)."""
    if not len(a):
        return a
    top = int(a.max())
    if a.min() >= 0 and top < 16 * len(a) + (1 << 20):
        seen = np.zeros(top + 1, bool)
        seen[a] = True
        return np.flatnonzero(seen).astype(np.int64)
    u = np.sort(a)
    if len(u) > 1:
        keep = np.empty(len(u), bool)
        keep[0] = True
        np.not_equal(u[1:], u[:-1], out=keep[1:])
        u = u[keep]
    return u


_NONE = np.zeros(0, np.int64)


class BlockLog:
    """The blocks an instance stored into or was served from one level (TierStack's ``touched``),
    for the dedup figures: arrays of ids kept as they come, 8 bytes an id, made distinct (sorted)
    once they outgrow twice what was distinct at the last time, and at the end; a set took about
    50 bytes a block and a hash insert each."""

    __slots__ = ("parts", "size", "limit")

    def __init__(self):
        self.parts: list = []
        self.size = 0
        self.limit = 1 << 21

    def add(self, b) -> None:
        self.update(np.array([b], np.int64))

    def update(self, blocks) -> None:
        blocks = np.asarray(blocks, np.int64)
        self.parts.append(blocks)
        self.size += len(blocks)
        if self.size > self.limit:
            self.distinct()

    def distinct(self) -> np.ndarray:
        """The blocks, each once (sorted)."""
        u = _distinct(np.concatenate(self.parts)) if self.parts else np.zeros(0, np.int64)
        self.parts, self.size = [u], len(u)
        self.limit = max(1 << 21, 2 * len(u))
        return u

    def __len__(self) -> int:
        return len(self.distinct())


class TierStack:
    """The engine's tier as a stack of levels (the interface of engine.pool.TierCache:
    ``prefix_hit``, ``touch_range``, ``add_range``; ``evictions``, ``peak``), for ``instances``
    instances: each has its own private levels and all share the shared ones (one LevelCache each).
    ``capacities`` in chunks of ``chunk_blocks`` blocks, one per level. The moves the loop must time
    are queued per instance and level and taken by :meth:`take_moves`: for each level, the (table,
    position) runs it loads and the blocks written into it. Each method takes the instance
    (``inst``, default 0); :meth:`view` is one instance's TierCache. Calls from several instances'
    threads hold a lock.

    For the dedup figures each level keeps, per instance, the blocks that instance stored into it or
    was served from it (``touched``), and a shared level which instance put each block there
    (``owner``): a hit on a block another instance put there is ``cross_blocks``."""

    def __init__(self, spec: StackSpec, capacities: list[int], chunk_blocks: int, instances: int = 1,
                 id_space: int = 0):
        self.spec, self.cb, self.n = spec, chunk_blocks, int(instances)
        # each block's first store: the request and table position that wrote it (note_origin), so a
        # copy of it into another level (demotion, promotion, write-through) is written as that store
        # was, each KV group its own bytes; -1: not known
        self.origin_rid = np.full(int(id_space), -1, np.int32)
        self.origin_pos = np.zeros(int(id_space), np.int32)
        shared = {k: LevelCache(max(1, int(c)), lv.policy, id_space=int(id_space))
                  for k, (c, lv) in enumerate(zip(capacities, spec.levels)) if lv.sharing == "shared"}
        self.by_instance = [[shared[k] if k in shared else
                             LevelCache(max(1, int(c)), lv.policy, id_space=int(id_space))
                             for k, (c, lv) in enumerate(zip(capacities, spec.levels))] for _ in range(self.n)]
        self.levels = self.by_instance[0]   # instance 0's levels (the only ones with one instance)
        n_levels = len(spec.levels)
        self.hits: dict = {}          # block id -> times it was served (selective write-through)
        self.lock = threading.Lock()
        self.loads: list = [[[] for _ in range(n_levels)] for _ in range(self.n)]    # (table, p0, p1) served
        self.writes: list = [[0] * n_levels for _ in range(self.n)]                 # blocks written since take_moves
        self.written: list = [[array("q") for _ in range(n_levels)] for _ in range(self.n)]  # their ids
        # the runs of each served prefix, by (its first block, its first position): the loop splits the
        # request's load entry by level with them (runs_of)
        self.pending: list = [{} for _ in range(self.n)]
        self.gone_blocks = 0          # blocks evicted from the bottom level (lost)
        self.touched = [[BlockLog() for _ in range(n_levels)] for _ in range(self.n)]
        self.owner = [{} if lv.sharing == "shared" else None for lv in spec.levels]
        self.cross_blocks = [0] * n_levels
        self.late_blocks = [0] * n_levels   # served blocks whose prefetch came too late (the loop says)
        self.cancelled_blocks = [0] * n_levels  # of those, the ones the level never moved (cancelled)

    def view(self, inst: int) -> StackView:
        return StackView(self, inst)

    def distinct(self, k: int) -> list:
        """Level ``k``'s caches: one when shared, one per instance when private."""
        return [self.by_instance[0][k]] if self.spec.levels[k].sharing == "shared" else \
            [lv[k] for lv in self.by_instance]

    # -- the TierCache interface -------------------------------------------------------------------
    @property
    def evictions(self) -> int:
        return self.gone_blocks

    @property
    def peak(self) -> int:
        return sum(c.peak_blocks for k in range(len(self.spec.levels)) for c in self.distinct(k))

    def prefix_hit(self, ids, start: int, limit: int, inst: int = 0) -> int:
        levels = self.by_instance[inst]
        n, step = start, 256
        with self.lock:
            while n < limit:  # windows of growing length: a lookup looks little past the prefix's end
                m = min(limit, n + step)
                w = np.array(ids[n:m], np.int64)
                held = levels[0].keys_of(w) >= 0
                for lv in levels[1:]:
                    held |= lv.keys_of(w) >= 0
                if not held.all():
                    return n + int(np.argmin(held)) - start
                n, step = m, step * 4
        return n - start

    def touch(self, ids) -> None:  # pragma: no cover - the scheduler calls the range forms
        raise TypeError("a TierStack is given table positions (touch_range)")

    def touch_range(self, table, p0: int, p1: int, inst: int = 0) -> None:
        """Positions p0..p1-1 of ``table`` are served: each by the first of ``inst``'s levels holding it."""
        if self.spec.promote or self.spec.placement not in ("write-back", "write-through"):
            return self._touch_each(table, p0, p1, inst)
        # no serve changes what a level holds here (no promotion, no copy on a hit): each block's
        # level is known up front, and each level's hits go to its policy in order at once
        levels = self.by_instance[inst]
        ids = table[p0:p1]
        w = np.array(ids, np.int64)
        with self.lock:
            level = np.full(len(ids), -1, np.int8)
            keys = [lv.keys_of(w) for lv in levels]
            for k in range(len(levels) - 1, -1, -1):  # the first level holding a block serves it
                level[keys[k] >= 0] = k
            # a block evicted since the lookup (another instance) is loaded from the top as a miss
            runs_level = np.where(level < 0, 0, level)
            cuts = np.flatnonzero(runs_level[1:] != runs_level[:-1]) + 1
            starts = [0, *cuts.tolist()]
            ends = [*cuts.tolist(), len(ids)]
            runs = [(int(runs_level[a]), p0 + a, p0 + z) for a, z in zip(starts, ends)]
            for k, lv in enumerate(levels):
                sel = level == k
                count = int(np.count_nonzero(sel))
                if not count:
                    continue
                lv.order.hit_many(keys[k][sel].tolist())
                lv.served_blocks += count
                owner = self.owner[k]
                if owner is not None:  # (a private level's blocks are all ones the instance stored: logged)
                    got = ids if count == len(ids) else list(compress(ids, sel.tolist()))
                    self.touched[inst][k].update(got)
                    self.cross_blocks[k] += sum(owner.get(b, inst) != inst for b in got)
            for k, a, z in runs:
                self.loads[inst][k].append((table, a, z))
            if runs:
                self.pending[inst].setdefault((table[p0], p0), []).append(runs)

    def _touch_each(self, table, p0: int, p1: int, inst: int) -> None:
        """touch_range block by block: each hit may change what the levels hold (promotion, copies)."""
        levels = self.by_instance[inst]
        selective = self.spec.placement == "write-through-selective"
        with self.lock:
            runs: list = []
            run_level, run_start = None, p0
            for p in range(p0, p1):
                b = table[p]
                k = None
                for i, lv in enumerate(levels):
                    if b in lv:
                        k = i
                        break
                if k is None:  # evicted since the lookup (another instance): loaded from the top as a miss
                    k = 0
                else:
                    lv = levels[k]
                    lv.use(b)
                    lv.served_blocks += 1
                    if selective:  # only write-through-selective reads the counts: kept only there
                        self.hits[b] = self.hits.get(b, 0) + 1
                    self.touched[inst][k].add(b)
                    if self.owner[k] is not None and self.owner[k].get(b, inst) != inst:
                        self.cross_blocks[k] += 1
                if k != run_level:
                    if run_level is not None:
                        runs.append((run_level, run_start, p))
                    run_level, run_start = k, p
                self._after_hit(table, p, b, k, inst)
            if run_level is not None:
                runs.append((run_level, run_start, p1))
            for k, a, z in runs:
                self.loads[inst][k].append((table, a, z))
            if runs:
                self.pending[inst].setdefault((table[p0], p0), []).append(runs)

    def runs_of(self, first_block, p0: int, inst: int = 0) -> list | None:
        """The (level, p0, p1) runs of a served prefix starting at ``p0`` with block ``first_block``
        (the oldest such prefix of ``inst`` not yet taken), or None."""
        with self.lock:
            pend = self.pending[inst]
            q = pend.get((first_block, p0))
            if not q:
                return None
            runs = q.pop(0)
            if not q:
                del pend[(first_block, p0)]
            return runs

    def add_range(self, table, p0: int, p1: int, inst: int = 0) -> None:
        """Positions p0..p1-1 of ``table`` were computed by ``inst`` and are stored, by the placement rule."""
        with self.lock:
            through = self.spec.placement in ("write-through", "inclusive")
            inclusive = self.spec.placement == "inclusive"
            if not inclusive:  # a chunk's run of positions at a time (_put_runs), the levels in turn
                cb = self.cb
                cuts = [p0, *range(p0 - p0 % cb + cb, p1, cb), p1]
                runs = [(table[a - a % cb], table[a:z]) for a, z in zip(cuts, cuts[1:])]
                self._put_runs(0, runs, inst)
                for k in (range(1, len(self.spec.levels)) if through else ()):
                    # (the levels are independent here: each its own runs, in order; a run's list
                    # becomes the level's, so each level gets a copy)
                    self._put_runs(k, [(key, list(run)) for key, run in runs], inst)
                return
            for p in range(p0, p1):
                key, b = table[p - p % self.cb], table[p]
                for k in (range(len(self.spec.levels)) if through else (0,)):
                    if inclusive and b in self.by_instance[inst][k]:
                        self.by_instance[inst][k].use(b)  # a reference to a level holding it: a use
                    else:
                        self._put(k, key, b, inst)

    def unserve(self, k: int, blocks: int, cancelled: int = 0, inst: int = 0) -> None:
        """``blocks`` blocks counted as served by level ``k`` were recomputed instead: their
        prefetch had not arrived when the request started (``--kv-load async`` with a prefetch
        policy other than wait_complete); ``cancelled`` of them the level never moved."""
        with self.lock:
            self.by_instance[inst][k].served_blocks -= blocks
            self.late_blocks[k] += blocks
            self.cancelled_blocks[k] += cancelled

    # -- placement ---------------------------------------------------------------------------------
    def _put(self, k: int, key, b, inst: int, copy: bool = False) -> None:
        """Block ``b`` (of chunk ``key``) goes into level ``k``: below the top always a copy, into
        the top a promotion (``copy``) or the engine's own store."""
        levels = self.by_instance[inst]
        lv = levels[k]
        fresh = b not in lv
        gone = lv.put(key, b)
        self.touched[inst][k].add(b)
        if fresh:
            self.writes[inst][k] += 1
            if self.owner[k] is not None:
                self.owner[k][b] = inst
            if k or copy:
                self.written[inst][k].append(b)
        for gkey, blocks in gone:
            if self.owner[k] is not None:
                for x in blocks:
                    self.owner[k].pop(x, None)
            if self.spec.placement == "write-back" and k + 1 < len(levels):
                for x in blocks:
                    if x not in levels[k + 1]:
                        levels[k + 1].demoted_blocks += 1
                    self._put(k + 1, gkey, x, inst)
            elif k + 1 == len(levels):
                self.gone_blocks += len(blocks)

    def _put_runs(self, k: int, runs: list, inst: int) -> None:
        """``_put`` of each block of ``runs`` ((chunk key, distinct ids of it), in order; each list
        becomes the level's), with the same outcome: level ``k`` takes them a run at a time
        (LevelCache.put_runs), block by block where it cannot, and the chunks it evicts go down
        (write-back) or are lost, in the order ``_put`` would send them. The level below gets them
        together after the level's runs: a level's puts touch only the levels below it, so only
        the order within each level matters (before a block-by-block put, whose demotions go down
        at once, the ones gathered so far go first)."""
        lv = self.by_instance[inst][k]
        touched = self.touched[inst][k]
        owner = self.owner[k]
        last = k + 1 == len(self.spec.levels)
        down = self.spec.placement == "write-back" and not last
        victims: list = []
        i = 0
        while i < len(runs):
            # a shared level a run at a time: its owners change in the order of its puts and evictions
            stop = len(runs) if owner is None else i + 1
            j, fresh, gone = lv.put_runs(runs, i, stop)
            if owner is None:
                # a private level: its held blocks are ones the instance stored, already logged
                touched.update(fresh)
            else:
                for _, blocks in runs[i:j]:
                    touched.update(blocks)
                for b in fresh.tolist():
                    owner[b] = inst
                for _, vb in gone:
                    for x in vb:
                        owner.pop(x, None)
            if len(fresh):
                self.writes[inst][k] += len(fresh)
                if k:
                    self.written[inst][k].frombytes(fresh.tobytes())
            if down:
                victims += gone
            elif last:
                self.gone_blocks += sum(len(vb) for _, vb in gone)
            if j < stop:  # block by block, its demotions at once: the ones gathered so far first
                self._send_down(k, victims, inst)
                victims = []
                key, blocks = runs[j]
                for b in blocks:
                    self._put(k, key, b, inst)
                j += 1
            i = j
        self._send_down(k, victims, inst)

    def _send_down(self, k: int, victims: list, inst: int) -> None:
        """Chunks level ``k`` evicted, (key, blocks) in order, demoted into the level below."""
        if not victims:
            return
        below = self.by_instance[inst][k + 1]
        before = below.stored_blocks
        self._put_runs(k + 1, victims, inst)
        # blocks it did not hold (and so stored): what _put counts as demoted
        below.demoted_blocks += below.stored_blocks - before

    def _after_hit(self, table, p: int, b, k: int, inst: int) -> None:
        key = table[p - p % self.cb]
        if self.spec.placement == "inclusive":  # every level gets the block (promotion adds nothing)
            levels = self.by_instance[inst]
            for j in range(len(levels)):
                if j != k:
                    if b in levels[j]:
                        levels[j].use(b)
                    else:
                        self._put(j, key, b, inst, copy=j == 0)
            return
        if self.spec.promote and k > 0:
            self._put(0, key, b, inst, copy=True)
        if self.spec.placement == "write-through-selective" and self.hits.get(b, 0) >= self.spec.selective_hits:
            for j in range(1, len(self.spec.levels)):
                if b not in self.by_instance[inst][j]:
                    self._put(j, key, b, inst)

    def take_moves(self, inst: int = 0) -> tuple[list, list]:
        """(loads, writes) of ``inst`` since the last call: per level, the (table, p0, p1) runs it
        served and the number of blocks written into it."""
        with self.lock:
            loads, writes = self.loads[inst], self.writes[inst]
            self.loads[inst] = [[] for _ in self.spec.levels]
            self.writes[inst] = [0 for _ in self.spec.levels]
        return loads, writes

    def take_written(self, inst: int = 0) -> list:
        """Per level, the ids of the blocks ``inst`` copied into it since the last call: demotions,
        write-through and selective copies below the top, promotions into the top (the engine's own
        stores into the top level are its step's store entries, not listed). The closed loop calls
        this each step and times the loads from the step's entries (runs_of), so what was queued for
        :meth:`take_moves` is dropped with it: kept, it would hold a request's table per served
        prefix for the whole run."""
        with self.lock:
            w, self.written[inst] = self.written[inst], [array("q") for _ in self.spec.levels]
            self.loads[inst] = [[] for _ in self.spec.levels]
            self.writes[inst] = [0 for _ in self.spec.levels]
        return w

    def note_origin(self, ids, rid: int, p0: int) -> None:
        """Request ``rid`` stores the blocks ``ids`` at table positions ``p0``...: each block's origin
        unless it has one (the first store of a block is what every copy of it moves)."""
        if not len(self.origin_rid):
            return
        ids = np.asarray(ids, np.int64)
        with self.lock:
            new = self.origin_rid[ids] < 0
            self.origin_rid[ids[new]] = rid
            self.origin_pos[ids[new]] = p0 + np.flatnonzero(new)

    def origin_runs(self, ids) -> list:
        """The blocks ``ids`` (in order) as runs of one origin's consecutive positions: (block ids,
        request, first position); request -1 for blocks of no known origin."""
        ids = np.frombuffer(ids, np.int64) if isinstance(ids, array) else np.asarray(ids, np.int64)
        if not len(ids):
            return []
        if not len(self.origin_rid):
            return [(ids, -1, 0)]
        with self.lock:
            rid, pos = self.origin_rid[ids], self.origin_pos[ids]
        brk = rid[1:] != rid[:-1]
        brk |= (rid[1:] >= 0) & (pos[1:] != pos[:-1] + 1)
        cut = (np.flatnonzero(brk) + 1).tolist()
        starts, ends = [0, *cut], [*cut, len(ids)]
        return [(ids[a:z], r, p if r >= 0 else 0)
                for a, z, r, p in zip(starts, ends, rid[starts].tolist(), pos[starts].tolist())]

    def summary(self, tokens_per_block: int, block_bytes_all_layers: int) -> list[dict]:
        """Per level, over its caches (one when shared, one per instance when private): what it
        served, stored, demoted, evicted; ``footprint_bytes`` the most its caches held (summed over
        the per-instance caches of a private level); ``distinct_bytes`` the blocks any instance
        stored into it or was served from it, counted once, and ``per_instance_bytes`` counted once
        per instance (what replicated levels would hold: their ratio is the dedup); ``cross_tokens``
        (shared levels) served to an instance from blocks another instance put there."""
        out = []
        bb = block_bytes_all_layers
        for k, spec in enumerate(self.spec.levels):
            caches = self.distinct(k)
            mine = [t[k].distinct() for t in self.touched]
            union = mine[0] if self.n == 1 else _distinct(np.concatenate(mine))
            out.append({**spec.describe(), "capacity_chunks": caches[0].capacity_chunks,
                        "caches": len(caches),
                        "served_tokens": sum(c.served_blocks for c in caches) * tokens_per_block,
                        "stored_blocks": sum(c.stored_blocks for c in caches),
                        "demoted_blocks": sum(c.demoted_blocks for c in caches),
                        "evicted_blocks": sum(c.evicted_blocks for c in caches),
                        "bytes_in": sum(c.stored_blocks for c in caches) * bb,
                        "bytes_out": sum(c.served_blocks for c in caches) * bb,
                        "footprint_bytes": sum(c.peak_blocks for c in caches) * bb,
                        "peak_blocks": sum(c.peak_blocks for c in caches),
                        "distinct_bytes": len(union) * bb,
                        "per_instance_bytes": sum(len(m) for m in mine) * bb,
                        "cross_tokens": self.cross_blocks[k] * tokens_per_block,
                        "late_tokens": self.late_blocks[k] * tokens_per_block,
                        "cancelled_tokens": self.cancelled_blocks[k] * tokens_per_block})
        return out


class StackView:
    """One instance's TierCache on a TierStack: its private levels, then the shared ones."""

    def __init__(self, stack: TierStack, inst: int):
        self.stack, self.inst = stack, inst

    @property
    def spec(self) -> StackSpec:
        return self.stack.spec

    @property
    def evictions(self) -> int:
        return self.stack.evictions

    @property
    def peak(self) -> int:
        return self.stack.peak

    def prefix_hit(self, ids, start: int, limit: int) -> int:
        return self.stack.prefix_hit(ids, start, limit, self.inst)

    def touch_range(self, table, p0: int, p1: int) -> None:
        self.stack.touch_range(table, p0, p1, self.inst)

    def add_range(self, table, p0: int, p1: int) -> None:
        self.stack.add_range(table, p0, p1, self.inst)

    def runs_of(self, first_block, p0: int) -> list | None:
        return self.stack.runs_of(first_block, p0, self.inst)

    def take_written(self) -> list:
        return self.stack.take_written(self.inst)

    def unserve(self, k: int, blocks: int, cancelled: int = 0) -> None:
        self.stack.unserve(k, blocks, cancelled, self.inst)


class LowerLevels:
    """One instance's backend contexts for the levels below the top (the top level is the replay's
    own backend and arena): each level its own context, arena, link and timing, so its bytes are
    timed on its own medium. A level's arena holds at most ``max_memory_bytes`` / levels (and at
    least ``min_slots``, where a linear layer's state must fit); blocks map to its slots by id
    modulo its size (only bytes and timing matter below the top). ``call`` times one step's share
    of a level: the loads it serves and the blocks written into it (demotions, write-through
    copies), starting at the step's start with the step's compute. With a model's KV groups
    (``kv``, layerkv.GroupMoves) every call moves each replayed layer's own bytes, as the top
    level's do: a load's windows end where the whole prefix hit ends, a copied block is written
    as its first store wrote it."""

    def __init__(self, spec: StackSpec, block_bytes: int, geometry: tuple, capacities: list[int], chunk_blocks: int,
                 max_memory_bytes: int, emulate_missing: bool, warn, timing: dict, span, min_slots: int = 0):
        self.span, self.chunk_blocks = span, chunk_blocks
        self.streams: list = [None] * len(spec.levels)   # each level's load stream (open_streams)
        self.stream_free = [0] * len(spec.levels)      # when each load stream's last transfer ended
        slot_bytes = block_bytes * len(span)
        per_level = max(1, max_memory_bytes // max(1, len(spec.levels)) // slot_bytes)
        self.backends: list = [None]
        self.n_slots = [0]
        self.opened: list = [None]
        self.load_ns = [0] * len(spec.levels)
        self.store_ns = [0] * len(spec.levels)
        self.stored_blocks = [0] * len(spec.levels)
        self.calls = [0] * len(spec.levels)
        # prefetch chunks each level did not move: their request had started without them
        self.cancelled_blocks = [0] * len(spec.levels)
        try:
            for k, lv in enumerate(spec.levels[1:], 1):
                n = int(max(chunk_blocks, min_slots, min(capacities[k] * chunk_blocks, per_level)))
                t = dict(timing)
                if lv.link is not None:
                    t["link"] = get_link(lv.link)
                b, opened = open_configured(lv.backend, (block_bytes, n, *geometry), emulate_missing, warn, t)
                self.backends.append(b)
                self.n_slots.append(n)
                prof = opened["profile"]
                link_gbps = opened["link"].load_gbps or None
                medium_gbps = getattr(prof, "bandwidth_gbps", None) if prof is not None else None
                tighter = None
                if link_gbps and medium_gbps:
                    tighter = "link" if link_gbps < medium_gbps else "medium"
                self.opened.append({"spec": opened["spec"], "requested": opened["requested"],
                                    "link": opened["link"].name, "staged": opened["staged"],
                                    "link_load_gbps": link_gbps, "medium_gbps": medium_gbps, "tighter": tighter})
        except BaseException:
            self.close()
            raise

    def open_streams(self) -> None:
        """A load stream on each level below the top (``--kv-load async``): a second context on the
        level's medium with a timeline of its own, attached to its arena where the backend can be
        shared, so prefetches do not wait for the level's in-step writes nor they for them."""
        for k, b in enumerate(self.backends):
            if b is not None:
                self.streams[k] = open_load_stream(b, b.kind.shareable)

    def moved_bytes(self) -> list:
        """Per level (None for the top), the bytes its contexts moved, per op, as the C core counted
        them (the replayed layers, each once)."""
        out: list = [None]
        for k in range(1, len(self.backends)):
            ctxs = [b for b in (self.backends[k], self.streams[k]) if b is not None]
            out.append({op: sum(int(b.op_stats(op)["bytes"]) for b in ctxs) for op in ("load", "store")})
        return out

    def close(self) -> None:
        for b in [*self.streams, *self.backends[1:]]:
            if b is not None:
                b.close()

    def _batch(self, k: int, groups: list, kv):
        """CSR tables of ``groups`` (one local request each: (block ids, request, first position,
        load end)) on level ``k``'s arena, and their LayerMoves (None without KV groups)."""
        sizes = np.array([len(g[0]) for g in groups], np.int64)
        table_off = np.zeros(len(groups) + 1, np.uint64)
        np.cumsum(sizes, out=table_off[1:])
        slots = (np.concatenate([np.asarray(g[0], np.int64) for g in groups]) % self.n_slots[k]).astype(np.uint32)
        moves = None if kv is None else kv.moves(np.array([g[1] for g in groups], np.int64),
                                                 np.array([g[2] for g in groups], np.int64), 0,
                                                 np.array([g[3] for g in groups], np.int64))
        return sizes, table_off, slots, moves

    def call(self, k: int, start: int, compute: int, loads: list, written: list, kv=None):
        """Level ``k``'s share of a step starting at ``start``: ``loads`` the runs it serves, each
        (block ids, request, first table position, where the request's whole load ends);
        ``written`` the runs copied into it, each (block ids, request, first position) of the store
        that first wrote them (TierStack.origin_runs). Returns (step_out row, load ns of each load)."""
        groups = list(loads) + [(ids, rid, p0, 0) for ids, rid, p0 in written]
        sizes, table_off, slots, moves = self._batch(k, groups, kv)
        entries = np.zeros(len(groups), ENTRY_DTYPE)
        entries["req"] = np.arange(len(groups))
        nl = len(loads)
        entries["load_count"][:nl] = sizes[:nl]
        entries["store_count"][nl:] = sizes[nl:]
        steps = np.zeros(1, STEP_DTYPE)
        steps["entry_end"] = len(groups)
        steps["compute_ns"] = compute
        steps["ready_ns"] = start
        so, eo = self.backends[k].replay(table_off, slots, steps, entries, self.span, moves)
        self.load_ns[k] += int(so[0]["load_ns"])
        self.store_ns[k] += int(so[0]["store_ns"])
        self.stored_blocks[k] += int(sizes[nl:].sum())
        self.calls[k] += 1
        return so[0], eo["load_ns"][:nl]

    def prefetch(self, k: int, start: int, groups: list, kv=None, cancel=None) -> tuple[list, list]:
        """Level ``k``'s part of asynchronous prefix loads issued at ``start``: ``groups`` the chunks
        (as ``call``'s loads, in issue order), one step each with no compute, on the level's own
        timeline, so each chunk's end is when it has arrived. ``cancel`` (one per chunk, None:
        never): when the chunk's request starts without what has not arrived; a chunk not started
        by then is not moved (HiCache's prefetch termination: docs/replay.md, "Prefetch"), and so
        does not delay the chunks after it. Returns (each chunk's end ns, None for a cancelled
        one; each chunk's load time, 0 for a cancelled one)."""
        def issue(part: list):
            g = len(part)
            sizes, table_off, slots, moves = self._batch(k, part, kv)
            entries = np.zeros(g, ENTRY_DTYPE)
            entries["req"] = np.arange(g)
            entries["load_count"] = sizes
            steps = np.zeros(g, STEP_DTYPE)
            steps["entry_begin"] = np.arange(g)
            steps["entry_end"] = np.arange(1, g + 1)
            steps["ready_ns"] = start
            so, _ = self.streams[k].replay(table_off, slots, steps, entries, self.span, moves)
            self.load_ns[k] += int(so["load_ns"].sum())
            self.calls[k] += 1
            self.stream_free[k] = max(self.stream_free[k], int(so["end_ns"].max()))
            return so["end_ns"].tolist(), so["load_ns"].tolist()

        if cancel is None or all(c is None for c in cancel):
            return issue(groups)
        # chunk by chunk: whether the next one starts before its request does depends on when the
        # ones before it ended
        ends, load_ns = [], []
        for g, c in zip(groups, cancel):
            if c is not None and max(start, self.stream_free[k]) >= c:
                ends.append(None)
                load_ns.append(0)
                self.cancelled_blocks[k] += len(g[0])
                continue
            e, t = issue([g])
            ends += e
            load_ns += t
        return ends, load_ns


def stack_section(t: dict, block_bytes_all_layers: int, tokens_per_block: int) -> dict:
    """The results' ``schedule.stack``: the stack, its prefetch policy, and per level its capacity,
    policy, sharing, tokens served and their share of what the stack served, tokens it held but
    whose prefetch came too late, bytes written and loaded, time, footprint and the dedup figures,
    a shared level's queue; which levels share a medium on this host. (``level_tokens`` and
    ``late_tokens`` per request stay out: they go to the rows.)"""
    bb = block_bytes_all_layers
    served = sum(lv["served_tokens"] for lv in t["levels"])
    levels = []
    for k, lv in enumerate(t["levels"]):
        blocks_served = lv["served_tokens"] // max(1, tokens_per_block)
        mode = parse_spec(lv["backend"]).kind.mode
        if lv["sharing"] == "private":
            contention = "none: one cache and context per instance"
        elif k == 0:
            contention = "the top level's: the replay's shared tier (tier_devices)"
        elif lv["queue"] is not None:
            contention = "modelled: every instance's traffic on the level waits in one queue (queue)"
        elif mode == "measured":
            contention = "measured: each instance's context runs on this host's medium at once"
        else:
            contention = "none: one instance"
        levels.append({"level": k + 1, "backend": lv["backend"], "mode": mode,
                       "capacity_bytes": lv["capacity_bytes"],
                       "policy": lv["policy"], "sharing": lv["sharing"], "link": lv["link"],
                       "caches": int(lv["caches"]),
                       "served_tokens": int(lv["served_tokens"]),
                       "hit_share": lv["served_tokens"] / served if served else None,
                       "late_tokens": int(lv["late_tokens"]),
                       "cross_instance_tokens": int(lv["cross_tokens"]),
                       "bytes_written": int(lv["stored_blocks"]) * bb,
                       "bytes_loaded": int(blocks_served) * bb,
                       "cancelled_tokens": int(lv["cancelled_tokens"]),
                       # late blocks the level moved all the same (in flight when the request started),
                       # and those it cancelled (never moved)
                       "bytes_late": (int(lv["late_tokens"]) - int(lv["cancelled_tokens"])) // max(1, tokens_per_block) * bb,
                       "bytes_cancelled": int(lv["cancelled_tokens"]) // max(1, tokens_per_block) * bb,
                       "demoted_blocks": int(lv["demoted_blocks"]), "evicted_blocks": int(lv["evicted_blocks"]),
                       # the top level: blocks promoted into it (promote=1), their writes timed on it
                       "promoted_blocks": int(lv.get("promoted_blocks", 0)),
                       # below the top: what the level's own contexts moved, per op (C core's count, the
                       # replayed layers once each; each KV group its own bytes)
                       "replayed_bytes": lv.get("replayed_bytes"),
                       "time_ns": int(lv["time_ns"]),
                       "time_from": "the replay's backend (its load and store time)" if k == 0 else
                                    "the level's own backend contexts (one per instance)",
                       "footprint_bytes": int(lv["peak_blocks"]) * bb,
                       "distinct_bytes": int(lv["distinct_bytes"]) * bb,
                       "per_instance_bytes": int(lv["per_instance_bytes"]) * bb,
                       "dedup": lv["per_instance_bytes"] / lv["distinct_bytes"] if lv["distinct_bytes"] else None,
                       "contention": contention, "queue": lv["queue"],
                       # bytes the level moved over its time (GB/s = bytes per ns), and, below the top,
                       # which of its link and its medium (profile) has the lower bandwidth: the bound
                       "gbps": (blocks_served + int(lv["stored_blocks"])) * bb / lv["time_ns"]
                       if lv["time_ns"] else None,
                       "bound": None if lv["backend_opened"] is None else lv["backend_opened"]["tighter"],
                       "opened": lv["backend_opened"]})
    spec = t["spec"]
    return {"label": spec.label(), "placement": spec.placement, "promote": spec.promote,
            "selective_hits": spec.selective_hits,
            "prefetch": {"policy": spec.prefetch, "timeout_ms": spec.prefetch_timeout_ms,
                         "timeout_per_ki_token_ms": spec.prefetch_timeout_per_ki_token_ms},
            "levels": levels, "instances": t["instances"],
            "shared_media": [{"levels": [a + 1, b + 1], "medium": "this host's DRAM"} for a, b in t["shared_media"]],
            "one_stack_for_all_instances": t["instances_share"], "level_tokens": t["level_tokens"],
            "late_tokens": t["late_tokens"]}


__all__ = ["STACK_POLICIES", "StackSpec", "StackView", "TierStack", "parse_tiers"]
