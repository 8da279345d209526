"""The serving-engine model: continuous batching with chunked prefill and a prefix cache, as vLLM
schedules, plus a KV tier policy. It produces the step-by-step batch composition and the KV
operations each request performs; it does no I/O itself.

Per step: every decoding request gets one token; the remaining token budget goes to requests
still in prefill (oldest first, chunked), then to new requests in arrival order while the budget,
the sequence limit and KV capacity allow (first come, first served: the head of the queue blocks
the rest, as in vLLM's FCFS policy).

Tier policies:
- ``none``: HBM prefix cache only; no tier traffic.
- ``offload``: write-through. Every newly computed full input block is stored to the tier; on
  admission, a prefix that misses in HBM but hits in the tier is loaded back (LMCache / Mooncake
  style). Decode reads KV in HBM.
- ``resident``: KV lives in the tier (the memory-pool argument). Prefill stores every block that
  fills up and reads the earlier context from the tier; decode reads the whole context from the tier
  every step and stores a block each time one fills. A prefix hit in the tier is reused in place.
  The GPU time model then charges HBM traffic for the new tokens' KV only: the context is read
  from the tier, and that time is what replay measures.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from ..bounds import DEFAULT_TIER_EVICTION, MAX_TIMELINE_NS, TIER_POLICIES, tier_eviction_problem
from ..errors import ConfigError, OptionError
from .blocks import BlockTables
from .pool import BlockPool, TierCache
from .timing import GpuTiming

#: The most steps one DecodeRun plans (an arrival may cut it short: the rest is planned again).
MAX_RUN_STEPS = 256

#: This scheduler's name and version: traces record it, closed-loop replay checks it. Bump it when a
#: change makes the same inputs schedule differently.
ENGINE_MODEL = "kvemu.engine/1"


@dataclass(frozen=True)
class EngineConfig:
    tokens_per_block: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    tier_policy: str = "offload"
    hbm_kv_blocks: int | None = None  # None: unbounded
    tier_capacity_blocks: int | None = None  # None: unbounded
    # What a bounded offload tier evicts: a kvemu.policies name (an online one), LRU by default.
    tier_eviction: str = DEFAULT_TIER_EVICTION
    # The offload transfer unit (LMCache's 256-token chunks); replay moves a chunk's blocks of one
    # layer as one transfer. Recorded so that replay uses what the engine would.
    transfer_chunk_tokens: int = 256
    # How a transfer lays KV out: one layer of a chunk per transfer (per-layer), or a chunk's blocks
    # of every layer contiguous, moved as one (cross-layer, vLLM's offloading layout since 2025).
    kv_layout: str = "per-layer"
    # KV geometry beyond full attention (engine/kvgeometry.py, pool_accounting): a pool block is one
    # block of the groups that grow with the context (``pool_block_bytes``; 0: every layer is full
    # attention, nothing below applies); a request's windowed layers hold at most ``max_blocks`` blocks
    # of ``bytes`` each (``bounded_kv_blocks``, pairs) and its linear-attention layers a fixed state
    # (``state_bytes_per_request``), reserved as extra pool blocks at admission; a prefix hit is
    # reused only up to a multiple of ``checkpoint_blocks`` blocks (0: any block), where the linear
    # layers' state was checkpointed.
    pool_block_bytes: int = 0
    bounded_kv_blocks: tuple = ()
    state_bytes_per_request: int = 0
    checkpoint_blocks: int = 0

    def extra_blocks(self, table_blocks: int) -> int:
        """Pool blocks a request with a table of ``table_blocks`` blocks needs besides them: its
        windowed layers' blocks and its linear layers' state, in pool blocks (rounded up)."""
        if not self.pool_block_bytes:
            return 0
        b = self.state_bytes_per_request + sum(min(table_blocks, m) * bb for m, bb in self.bounded_kv_blocks)
        return -(-b // self.pool_block_bytes)

    def check(self) -> None:
        if self.tier_policy not in TIER_POLICIES:
            raise ConfigError(f"unknown tier policy '{self.tier_policy}' (known: {', '.join(TIER_POLICIES)})")
        if self.tokens_per_block <= 0 or self.max_num_seqs <= 0:
            raise ConfigError("--block-tokens and --max-num-seqs must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("--max-batched-tokens must be at least --max-num-seqs (every decode needs a token)")
        if self.tier_policy == "none" and self.tier_capacity_blocks is not None:
            raise ConfigError("--tier-capacity-gib has no effect with --tier-policy none")
        why = tier_eviction_problem(self.tier_eviction, self.tier_policy, self.tier_capacity_blocks is not None)
        if why:
            raise OptionError("engine.tier_eviction", why)
        for name in ("hbm_kv_blocks", "tier_capacity_blocks"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be positive")

    def to_dict(self) -> dict:
        return asdict(self)


class Running:
    """A request the engine holds, from admission until it finishes: its block table, how many of
    its input tokens are computed, the tokens generated, its blocks registered in the pool and those
    still reserved, and the prefix it loads from the tier (``load_first``, ``load_count`` blocks; the
    count goes to 0 once a step carries the load). ``tier_hit``: tokens of its prefix found in the
    tier at admission (under ``resident`` every hit, the pool being the tier). ``blocks``: the table as
    an int64 array, as the pool takes it (``table`` is a list, as the tier takes it)."""

    __slots__ = ("rid", "table", "blocks", "inp", "out", "n_full", "computed", "generated", "n_reg", "reserved",
                 "load_first", "load_count", "tier_hit")

    def __init__(self, rid, table, inp, out, n_full, blocks=None):
        self.rid, self.table, self.inp, self.out, self.n_full = rid, table, inp, out, n_full
        self.blocks = np.asarray(table, np.int64) if blocks is None else blocks
        self.generated = 0
        self.load_first = self.load_count = 0


@dataclass
class EngineRun:
    cached_tokens: np.ndarray
    tier_hit_tokens: np.ndarray
    step_start_ns: np.ndarray
    step_compute_ns: np.ndarray
    entries: dict  # column name -> numpy array
    stats: dict
    step_busy_ns: np.ndarray | None = None  # with weights in the tier: compute and weight stream composed


ENTRY_FIELDS = ("step", "request_id", "phase", "tokens", "context_tokens", "load_first", "load_count",
                "store_first", "store_count", "read_first", "read_count")


class EngineLog:
    """What the engine decided, as it decides it: one row per batch entry (a request in a step), and
    per request the tokens of its prefix found cached (``cached``) and found in the tier
    (``tier_hit``). Only the scheduler writes into it; ``take_entries`` hands the rows over and
    starts afresh (closed-loop replay folds them in as it goes, so memory stays bounded).

    Rows are kept two ways. ``cols`` (array('i') per trace column) holds the rows the scheduler
    writes one by one: prefill chunks, and decodes that move KV (``resident``). A request's decodes
    that move no KV are one span instead (``decode_span``): a request decodes in every step from
    the one after its prefill completes until it finishes (the engine never preempts), one token
    each, so its rows follow from its first step, its first context and its count; they are written
    out, vectorised, when taken."""

    def __init__(self, n: int):
        self.cols = {k: array("i") for k in ENTRY_FIELDS}
        self.cached = np.zeros(n, np.int64)
        self.tier_hit = np.zeros(n, np.int64)
        self.taken = 0  # rows handed over before the current ones
        self.base = 0   # rows of ``cols`` handed over before its current ones (what ``index`` counts from)
        # decode spans: request, first step, steps, context of its first step (in the order they begin)
        self.spans = {k: array("q") for k in ("rid", "s0", "n", "ctx0")}
        self.through = 0      # steps logged so far (decode spans cover steps below it)
        self.emitted = 0      # steps whose decode-span rows were handed over
        self.span_rows = 0    # decode-span rows logged and not yet handed over

    def rows(self) -> int:
        """Rows logged so far, handed over or not."""
        return self.taken + len(self.cols["step"]) + self.span_rows

    def index(self) -> int:
        """The position of the next row of ``cols`` (counted over every row it ever held): what a
        StepPlan's ``r0`` and ``r1`` count, and what ``entries`` takes."""
        return self.base + len(self.cols["step"])

    def entries(self, r0: int, r1: int, columns) -> dict:
        """Rows ``r0`` to ``r1`` of ``cols`` (counted as ``index`` does; not yet taken) of
        ``columns``, as int32 arrays."""
        lo, hi = r0 - self.base, r1 - self.base
        return {k: np.frombuffer(self.cols[k][lo:hi], np.int32) for k in columns}

    def decode_span(self, rid: int, first_step: int, steps: int, ctx0: int) -> None:
        """Request ``rid`` decodes in ``steps`` steps from ``first_step``, attending to ``ctx0``
        tokens in the first and one more in each after; it moves no KV."""
        sp = self.spans
        sp["rid"].append(rid); sp["s0"].append(first_step); sp["n"].append(steps); sp["ctx0"].append(ctx0)

    def logged_step(self, span_rows: int) -> None:
        """A step is logged; ``span_rows`` of its rows are decode spans'."""
        self.through += 1
        self.span_rows += span_rows

    def logged_steps(self, steps: int, span_rows: int) -> None:
        """``steps`` steps are logged, ``span_rows`` decode-span rows each and no other."""
        self.through += steps
        self.span_rows += steps * span_rows

    def _span_rows(self) -> dict:
        """The decode-span rows of steps ``emitted`` to ``through``, span by span in the order they
        began, each in step order (a stable sort by step gives the engine's order: within a step,
        its decoding requests in the order they joined); the spans that end by then are dropped."""
        sp = {k: np.frombuffer(v, np.int64) for k, v in self.spans.items()}
        lo, hi = self.emitted, self.through
        end = sp["s0"] + sp["n"]
        a = np.maximum(sp["s0"], lo)
        cnt = np.maximum(np.minimum(end, hi) - a, 0)
        of = np.repeat(np.arange(len(cnt)), cnt)
        step = a[of] + (np.arange(len(of)) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        n = len(of)
        z = np.zeros(n, np.int32)
        out = {"step": step.astype(np.int32), "request_id": sp["rid"][of].astype(np.int32),
               "phase": np.ones(n, np.int32), "tokens": np.ones(n, np.int32),
               "context_tokens": (sp["ctx0"][of] + step - sp["s0"][of]).astype(np.int32)}
        for k in ENTRY_FIELDS[5:]:
            out[k] = z
        keep = end > hi
        self.spans = {k: array("q", v[keep].tobytes()) for k, v in sp.items()}
        self.emitted = hi
        return out

    def take_entries(self) -> dict:
        """The rows logged since the last call: those of ``cols`` first, in the order written, then
        the decode spans' (``in_step_order`` puts them all in the engine's order). Each request's
        rows are in step order."""
        out = {k: np.frombuffer(v, dtype=np.int32).copy() if len(v) else np.zeros(0, np.int32)
               for k, v in self.cols.items()}
        n_cols = len(self.cols["step"])
        if self.span_rows:
            spans = self._span_rows()
            out = {k: np.concatenate([v, spans[k]]) for k, v in out.items()}
        self.taken += n_cols + self.span_rows
        self.base += n_cols
        self.span_rows = 0
        self.cols = {k: array("i") for k in ENTRY_FIELDS}
        return out


def in_step_order(entries: dict) -> dict:
    """Rows from ``EngineLog.take_entries`` in the engine's order: by step, and within a step its
    decodes (in the order of its decoding requests) before its prefill chunks (in the order
    planned)."""
    key = entries["step"].astype(np.int64) * 2 + (entries["phase"] == 0)
    order = np.argsort(key, kind="stable")
    if np.array_equal(order, np.arange(len(order))):
        return entries
    return {k: v[order] for k, v in entries.items()}


@dataclass
class EngineCaches:
    """Where the engine keeps KV blocks: ``pool`` the block pool it allocates from (HBM, or under
    ``resident`` the tier), ``tier`` the offload tier's copy of blocks (None unless ``offload``)."""
    pool: BlockPool
    tier: TierCache | None
    resident: bool

    def tier_peak(self) -> int:
        """The most blocks the tier held at once (the pool's, under ``resident``)."""
        if self.resident:
            return self.pool.peak
        return self.tier.peak if self.tier is not None else 0

    def evictions(self) -> tuple[int, int]:
        """(HBM evictions, tier evictions) so far."""
        if self.resident:
            return 0, self.pool.evictions
        return self.pool.evictions, self.tier.evictions if self.tier is not None else 0


def engine_caches(cfg: EngineConfig, shared=None) -> EngineCaches:
    """The engine's block pool and tier cache for ``cfg``. ``shared``: the tier other instances
    use too (a TierCache under ``offload``, the block pool under ``resident``), else its own."""
    if cfg.tier_policy == "resident":
        return EngineCaches(shared if shared is not None else BlockPool(cfg.tier_capacity_blocks), None, True)
    tier = None
    if cfg.tier_policy == "offload":
        tier = shared if shared is not None else TierCache(cfg.tier_capacity_blocks, cfg.tier_eviction)
    return EngineCaches(BlockPool(cfg.hbm_kv_blocks), tier, False)


class AsyncLoad(NamedTuple):
    """A prefix load the engine issues asynchronously: ``count`` blocks of ``request``'s table from
    position ``first``."""
    request: int
    first: int
    count: int


@dataclass(slots=True)
class StepPlan:
    """A step the engine planned, for its caller to run; the caller sends back a StepOutcome.

    ``start_ns`` on the engine's clock, ``compute_ns`` its modelled GPU compute, its entries rows
    ``r0`` to ``r1`` of the log's ``cols`` (EngineLog.index; its decode spans' rows, which move no KV,
    are not among them), ``moves_kv`` whether any of them moves KV, ``new_tokens`` the tokens it computes (what its weights in the tier
    stream: engine/weights.py), ``finished`` the requests it finishes, ``loads`` the asynchronous
    loads issued when it starts."""
    start_ns: int
    compute_ns: int
    r0: int
    r1: int
    moves_kv: bool
    new_tokens: int
    finished: list
    loads: list


@dataclass(frozen=True, slots=True)
class Idle:
    """What the engine yields, in place of a step, when it takes its arrivals from an inbox and has
    nothing to do: it must wake by ``deadline_ns`` (when its first asynchronous load is done; None
    without one). The caller sends back when to wake, or None: no request will come, the engine ends."""
    deadline_ns: int | None


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """Steps the engine plans at once (engine_steps ``decode_runs``): ``compute_ns[j]`` the modelled
    compute of the j-th, each ``decodes`` decodes and nothing else (no KV moved, no request admitted
    or finished). The first starts at ``start_ns``, each next one when the one before ends; only
    those that start before ``deadline_ns`` (the next arrival, which a step starting then would
    admit; None: none comes) run. The caller runs them and sends back a RunOutcome."""
    start_ns: int
    compute_ns: np.ndarray
    decodes: int
    deadline_ns: int | None


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """What the caller made of a DecodeRun: how many of its steps ran (at least one) and when the
    last ended (the engine's clock from then on)."""
    steps: int
    end_ns: int


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What the caller made of a StepPlan: when the step ended (the engine's clock from then on)
    and, for the loads it issued, when each is done (request id -> ns): when the request may
    start. ``loads_arrival_ns`` (request id -> a list, one per block of its load, in table order):
    when each block arrives, for loads whose request may start before all have (a prefetch
    policy's timeout, replay.stack): the request keeps the blocks that arrived, in order, by the
    step it joins, and recomputes the rest."""
    end_ns: int
    loads_done_ns: dict | None = None
    loads_arrival_ns: dict | None = None


class AsyncLoads:
    """The asynchronous loads in flight (vLLM's WAITING_FOR_REMOTE_KVS): a request admitted with a
    prefix in the tier waits, holding its blocks but no sequence slot or token budget, until its
    load is done; it then joins the prefills of the first step planned at or after that time."""

    def __init__(self):
        self.in_flight: list[Running] = []   # in issue order
        self.done_ns: dict[int, int] = {}    # request id -> when its load is done, once the caller said
        self.arrival_ns: dict[int, list] = {}  # request id -> when each block of its load arrives
        self.count: dict[int, int] = {}      # request id -> blocks its load carries

    def issue(self, r: Running) -> AsyncLoad:
        """``r``'s prefix load, now in flight: it leaves the request (no step carries it)."""
        self.in_flight.append(r)
        load = AsyncLoad(r.rid, r.load_first, r.load_count)
        self.count[r.rid] = r.load_count
        r.load_count = 0
        return load

    def completed(self, done_ns: dict, arrival_ns: dict | None = None) -> None:
        self.done_ns.update(done_ns)
        if arrival_ns:
            self.arrival_ns.update(arrival_ns)

    def cut(self, r: Running, now: int, tpb: int, caches: EngineCaches, checkpoint: int = 0) -> bool:
        """``r`` starts at ``now``: with per-block arrivals, it keeps the blocks of its load that
        arrived by then, in table order up to the first that did not; the rest go back to being
        computed (their pool registration undone). Returns whether anything was cut."""
        count = self.count.pop(r.rid, 0)
        arrival = self.arrival_ns.pop(r.rid, None)
        if arrival is None:
            return False
        keep = 0
        while keep < count and arrival[keep] <= now:
            keep += 1
        h = r.load_first
        if checkpoint > 1 and (h + keep) % checkpoint:
            keep = max(0, h + keep - (h + keep) % checkpoint - h)
        if keep >= count:
            return False
        caches.pool.unregister(r.blocks[h + keep : h + count])
        r.reserved += count - keep
        r.n_reg = h + keep
        r.computed = (h + keep) * tpb
        r.tier_hit = keep * tpb
        return True

    def ready(self, now: int) -> list[Running]:
        """The requests whose load is done by ``now``, in issue order; they are no longer in flight."""
        ready, still = [], []
        for r in self.in_flight:
            if self.done_ns[r.rid] <= now:
                del self.done_ns[r.rid]
                ready.append(r)
            else:
                still.append(r)
        self.in_flight = still
        return ready

    def deadline(self) -> int | None:
        """When the first load in flight is done (None: none in flight)."""
        return min(self.done_ns[r.rid] for r in self.in_flight) if self.in_flight else None


def _hold(pool, r: Running, table, h: int, need: int, idle) -> bool:
    """Admission's hold on the pool: False when it cannot hold ``need`` more blocks (``idle``: the
    hit's blocks no request uses); else the hit ``table[:h]`` pinned and ``need`` blocks reserved
    for ``r``."""
    if not pool.can_hold(need, idle):
        return False
    pool.pin(table[:h])
    pool.reserve(need)
    r.reserved = need
    return True


def admit(rid: int, table: list, inp: int, out: int, n_full: int, tpb: int, caches: EngineCaches,
          extra: int = 0, checkpoint: int = 0, present: int = 0, blocks=None) -> Running | None:
    """Request ``rid`` admitted (its ``table`` of block ids, ``inp`` input and ``out`` output tokens,
    ``n_full`` shareable full input blocks), or None when the pool cannot hold its blocks. Its
    prefix is looked up in the pool (a hit is pinned and reused) and then in the tier (a hit is
    registered in the pool, to be loaded by the request's first prefill step); every block it will
    ever need besides the pool's hit is reserved, and ``extra`` blocks more (its windowed and
    linear layers: EngineConfig.extra_blocks). With ``checkpoint`` > 0 the hit (pool and tier
    together) is cut to a multiple of ``checkpoint`` blocks, where linear layers' state is kept. At
    least one input token is always computed.

    ``present`` > 0 (a decode instance of a disaggregated deployment, replay.closed.disagg): that
    many of its prompt tokens arrive with the request, their KV handed over into HBM by the prefill
    instance; they are neither looked up in the tier nor loaded, and the first step computes the
    rest (at least one token). ``blocks``: ``table`` as an int64 array, if the caller has it."""
    pool, tier = caches.pool, caches.tier
    r = Running(rid, table, inp, out, n_full, blocks)
    blocks = r.blocks
    limit = min((r.inp - 1) // tpb, r.n_full)  # always compute at least one token
    h, idle = pool.prefix_hit(blocks, 0, limit)
    if present:
        given = max(h * tpb, min(present, r.inp - 1))
        g = max(h, min(given // tpb, r.n_full))  # full blocks handed over: hittable in the pool from now
        if not _hold(pool, r, blocks, h, len(table) - h + extra, idle):
            return None
        if g > h:
            pool.register(blocks[h:g])
            r.reserved -= g - h
        r.n_reg = g
        r.computed = given
        r.tier_hit = h * tpb if caches.resident else 0
        return r
    t = tier.prefix_hit(table, h, limit) if tier is not None else 0
    if checkpoint > 1 and (h + t) % checkpoint:
        total = h + t - (h + t) % checkpoint
        if total < h:
            idle = pool.prefix_hit(blocks, 0, total)[1]
            h = total
        t = total - h
    if not _hold(pool, r, blocks, h, len(table) - h + extra, idle):
        return None
    if t:
        tier.touch_range(table, h, h + t)
        pool.register(blocks[h : h + t])  # loaded into HBM during this step
        r.reserved -= t
        r.load_first, r.load_count = h, t
    r.n_reg = h + t
    r.computed = (h + t) * tpb
    r.tier_hit = (h if caches.resident else t) * tpb
    return r


class Chunk(NamedTuple):
    """A prefill chunk's entry: its columns in the trace (ENTRY_FIELDS) and whether it moves KV."""
    tokens: int
    context_tokens: int
    load_first: int
    load_count: int
    store_first: int
    store_count: int
    read_first: int
    read_count: int
    moves_kv: bool


def prefill_chunk(r: Running, budget: int, tpb: int, policy: str, caches: EngineCaches) -> Chunk:
    """The next prefill chunk of ``r`` under a token ``budget``: as many of its uncomputed input
    tokens as the budget allows. It carries the request's pending prefix load; the blocks that fill
    up become hittable in the pool and, unless the policy is ``none``, are stored to the tier;
    under ``resident`` it reads its earlier context from the tier. ``r`` and the caches advance."""
    resident = policy == "resident"
    ctx = r.computed
    k = min(r.inp - ctx, budget)
    p0, p1 = ctx // tpb, (ctx + k) // tpb  # blocks that fill up in this chunk
    load_first, load_count = r.load_first, r.load_count
    moves_kv = load_count > 0 or (resident and ctx >= tpb)
    r.load_count = 0
    store_first = store_count = 0
    if p1 > p0:
        caches.pool.register(r.blocks[p0:p1])
        r.reserved -= p1 - p0
        r.n_reg = p1
        if policy != "none":
            store_first, store_count = p0, p1 - p0
            moves_kv = True
            if caches.tier is not None:
                caches.tier.add_range(r.table, p0, p1)
    r.computed = ctx + k
    return Chunk(k, ctx, load_first, load_count, store_first, store_count, 0, ctx // tpb if resident else 0,
                 moves_kv)


class SpanDecodes:
    """The decoding requests when their decodes move no KV and cost by their context alone (no
    ``resident`` policy, every layer full attention): each joins as one span of the log
    (EngineLog.decode_span) and the step's sums follow from running totals, so a step costs the
    same whatever its batch. ``n``: requests decoding in the current step; ``ctx_sum``: their
    attended tokens (context + 1) summed; ``finish_at``: step -> the requests whose last token it
    is, in the order they joined (the order of the engine's decoding requests)."""

    __slots__ = ("log", "n", "ctx_sum", "finish_at", "finish_steps", "join_n", "join_sum")

    def __init__(self, log: EngineLog):
        self.log = log
        self.n = self.ctx_sum = 0
        self.finish_at: dict[int, list] = {}
        self.finish_steps: list[int] = []  # a heap of finish_at's steps (and of some already past)
        self.join_n = self.join_sum = 0

    def join(self, r: Running, step: int) -> None:
        """``r``'s prefill completed in ``step``: it decodes one token a step from the next, its
        ``out - 1`` tokens left, attending to ``inp + g`` tokens when ``g`` are generated."""
        steps = r.out - 1
        self.log.decode_span(r.rid, step + 1, steps, r.inp)
        last = step + steps
        if last not in self.finish_at:
            self.finish_at[last] = []
            heapq.heappush(self.finish_steps, last)
        self.finish_at[last].append(r)
        self.join_n += 1
        self.join_sum += r.inp + 1

    def advance(self, finishing: list) -> None:
        """The step ended: ``finishing`` (its last tokens) leave, the rest attend to one token more,
        the requests joined in it start."""
        self.ctx_sum += self.n - len(finishing) - sum(r.inp + r.out - 1 for r in finishing) + self.join_sum
        self.n += self.join_n - len(finishing)
        self.join_n = self.join_sum = 0

    def next_finish(self) -> int:
        """The next step in which a request finishes (some request decodes)."""
        heap = self.finish_steps
        while heap[0] not in self.finish_at:
            heapq.heappop(heap)
        return heap[0]

    def ran(self, steps: int) -> None:
        """``steps`` steps in which nobody joined or finished: each attended to one token more."""
        self.ctx_sum += steps * self.n
        self.log.logged_steps(steps, self.n)


def engine_steps(tables: BlockTables, arrival_ns, input_tokens, output_tokens, timing: GpuTiming,
                 cfg: EngineConfig, log: EngineLog, progress=None, stop_after=None, inbox=None,
                 caches: EngineCaches | None = None, async_loads: bool = False, present=None,
                 chunked_prefill: bool = True, release=None, decode_runs: bool = False):
    """The scheduler as a coroutine: it plans one step at a time and waits to be told when that
    step ended.

    Yields a StepPlan per step and receives a StepOutcome: the step's end, which becomes the
    engine's clock (``start + compute`` when only compute counts, recording; whatever the tier made
    of the step, closed-loop replay). Arrivals up to the clock are admitted before the next step is
    planned, so a slower tier changes the batches. The entries go into ``log``. ``stop_after``: a
    boolean array; the engine stops once every request it marks has finished. Returns (as
    StopIteration's value) the run's statistics.

    ``inbox`` (a deque): the engine is one of several instances, and a router puts the requests
    routed to it there, each once it has arrived; the engine takes them before planning each step.
    With nothing to do it yields Idle and receives the time to wake (or None: the engine ends).
    ``caches``: the engine's pool and tier (engine_caches; another instance may share the tier);
    default its own.

    ``async_loads`` (vLLM's asynchronous KV loading, WAITING_FOR_REMOTE_KVS): a request admitted
    with a prefix in the tier does not join a batch; the plan of the step that admitted it lists
    its load (``loads``), which the caller issues when the step starts, on a stream of its own, and
    says in the StepOutcome when each is done (AsyncLoads). Running requests go on meanwhile.
    Without it, the load is part of the request's first prefill step (the trace's way).

    ``present`` (an array per request, or None): prompt tokens whose KV arrives with the request
    (a decode instance of a disaggregated deployment: admit).

    ``chunked_prefill`` False (vLLM's ``enable_chunked_prefill=False``): a prompt is prefilled in one
    step, never cut to the step's budget: a request whose prompt does not fit the budget left is
    admitted but waits for a step where it fits (and the requests behind it wait too, FCFS); the
    budget must hold the longest prompt (the caller sets ``max_num_batched_tokens``).

    ``release`` (kvemu.sessions.Release, without an inbox): session arrivals. A session's root
    arrives at its ``arrival_ns``, any other request when its parent completes (the end of the step
    that finished it) plus its gap; requests are admitted in the order they arrive (ties by id).

    ``decode_runs`` (a caller that takes them, without an inbox or sessions): where the steps ahead
    are decodes and nothing else (no prefill running, nobody waiting, no load in flight) until the
    next step in which a request finishes, the engine yields them as one DecodeRun (their compute
    from ``timing.decode_steps_ns``, the same figures ``step_ns`` gives one at a time) and
    receives a RunOutcome: the steps that ran before the next arrival. The schedule is the same
    as step by step.
    """
    cfg.check()
    n = len(input_tokens)
    tpb = cfg.tokens_per_block
    policy = cfg.tier_policy
    arrival_ns = np.asarray(arrival_ns, np.int64).tolist()
    inp_l = np.asarray(input_tokens, np.int64).tolist()
    out_l = np.asarray(output_tokens, np.int64).tolist()
    offsets = tables.offsets.tolist()
    n_full_l = tables.n_full_input.tolist()
    ids = tables.ids
    present_l = None if present is None else np.asarray(present, np.int64).tolist()
    remaining = n if stop_after is None else int(np.count_nonzero(stop_after))
    watch = None if stop_after is None else np.asarray(stop_after, bool).tolist()

    resident = policy == "resident"
    if caches is None:
        caches = engine_caches(cfg)
    pool = caches.pool
    # the tier takes a request's table as an int64 array (the pool always does), else as a list
    tier_arrays = getattr(caches.tier, "takes_arrays", False)

    cached, tier_hit = log.cached, log.tier_hit
    cols = log.cols

    waiting: deque[int] = deque()
    prefilling: list[Running] = []
    decoding: list[Running] = []
    # decodes without KV moves and priced by their context alone are spans of the log; else a row each
    spans = SpanDecodes(log) if not resident and timing.model.uniform else None
    runs = (decode_runs and spans is not None and inbox is None and release is None
            and getattr(timing, "decode_steps_ns", None) is not None)
    loads = AsyncLoads()
    next_arrival = 0
    heap = None
    if release is not None:
        if inbox is not None:
            raise ValueError("session release takes its arrivals itself: not with an inbox")
        heap = release.roots()
        heapq.heapify(heap)
    finished = 0
    now = 0
    step = 0
    max_tokens, max_seqs = cfg.max_num_batched_tokens, cfg.max_num_seqs
    step_ns = timing.step_ns
    extra_blocks, checkpoint = cfg.extra_blocks, cfg.checkpoint_blocks
    # attention pairs and KV bytes of windowed and linear layers (models.ModelGeometry.step_equivalents)
    equiv = None if timing.model.uniform else timing.model.step_equivalents
    decode_equiv = timing.model.decode_equivalents()

    while remaining > 0 and (finished < n or inbox is not None):
        cols = log.cols  # take_entries may have swapped them between steps
        c_step, c_rid, c_phase, c_tok, c_ctx = (cols[k] for k in ("step", "request_id", "phase", "tokens",
                                                                  "context_tokens"))
        c_lf, c_lc, c_sf, c_sc, c_rf, c_rc = (cols[k] for k in ("load_first", "load_count", "store_first",
                                                                "store_count", "read_first", "read_count"))
        if loads.in_flight:
            for r in loads.ready(now):
                if loads.cut(r, now, tpb, caches, checkpoint):
                    cached[r.rid], tier_hit[r.rid] = r.computed, r.tier_hit
                prefilling.append(r)
        if heap is not None:
            while heap and heap[0][0] <= now:
                waiting.append(heapq.heappop(heap)[1])
            if not prefilling and not decoding and not waiting and not (spans and spans.n):
                soonest = loads.deadline()
                if not heap and soonest is None:
                    break  # nothing left that can arrive (the parents of the rest never ran)
                now = heap[0][0] if soonest is None or (heap and heap[0][0] <= soonest) else soonest
                continue
        elif inbox is None:
            while next_arrival < n and arrival_ns[next_arrival] <= now:
                waiting.append(next_arrival)
                next_arrival += 1
            if not prefilling and not decoding and not waiting and not (spans and spans.n):
                # idle until the next arrival or the first async load done, whichever comes first
                soonest = loads.deadline()
                now = (arrival_ns[next_arrival] if soonest is None or (next_arrival < n and arrival_ns[next_arrival] <= soonest)
                       else soonest)
                continue
        else:
            while inbox:
                waiting.append(inbox.popleft())
            if not prefilling and not decoding and not waiting and not (spans and spans.n):
                # nothing to run: sleep until a request is routed here, or the first load is done
                wake = yield Idle(loads.deadline())
                if wake is None:
                    break
                now = max(now, int(wake))
                continue
        if runs and spans.n and not prefilling and not waiting and not loads.in_flight:
            k = min(spans.next_finish() - step, MAX_RUN_STEPS)  # the steps before the next that finishes one
            comp = None if k < 2 else timing.decode_steps_ns(spans.n, spans.ctx_sum + spans.n * np.arange(k))
            if comp is not None:
                outcome = yield DecodeRun(now, comp, spans.n, arrival_ns[next_arrival] if next_arrival < n else None)
                spans.ran(outcome.steps)
                now = outcome.end_ns
                if now > MAX_TIMELINE_NS:
                    raise ConfigError(f"the engine's clock passed 2^60 ns (36.5 years) at step {step}: the steps "
                                      f"are modelled too slow for kvemu's int64 nanosecond clock")
                if progress is not None and (step + outcome.steps) // 512 > step // 512:
                    progress(finished)
                step += outcome.steps
                continue
        row0 = log.index()
        budget = max_tokens
        tok_sum = 0
        pair_sum = 0.0
        touched = 0
        dec_ctx = 0  # decodes' attended tokens, prefill chunks, their cached tokens (compute models
        n_chunks = 0  # other than the roofline price the composition, engine/compute.py)
        chunk_ctx = 0
        kv_ops = False
        done_now: list[Running] = []
        issued: list[AsyncLoad] = []

        # 1. decodes: one token each, attending to the whole context
        if spans is not None:
            n_dec = spans.n
            dec_ctx = touched = spans.ctx_sum
            pair_sum = float(dec_ctx)
            finishing = spans.finish_at.pop(step, [])
            done_now.extend(finishing)
        for r in decoding:
            ctx = r.inp + r.generated - 1
            c_step.append(step); c_rid.append(r.rid); c_phase.append(1); c_tok.append(1); c_ctx.append(ctx)
            c_lf.append(0); c_lc.append(0)
            if resident:
                full_after = (ctx + 1) // tpb
                if full_after * tpb == ctx + 1:
                    c_sf.append(full_after - 1); c_sc.append(1)
                else:
                    c_sf.append(0); c_sc.append(0)
                c_rf.append(0); c_rc.append(ctx // tpb)
                kv_ops = kv_ops or ctx >= tpb or full_after * tpb == ctx + 1
            else:
                c_sf.append(0); c_sc.append(0); c_rf.append(0); c_rc.append(0)
            dec_ctx += ctx + 1
            if equiv is None:
                pair_sum += ctx + 1.0
                touched += 1 if resident else ctx + 1
            else:
                p_eq, t_eq = decode_equiv(ctx)
                pair_sum += p_eq
                touched += 1 if resident else t_eq
            r.generated += 1
            if r.generated == r.out:
                done_now.append(r)
        if spans is None:
            n_dec = len(decoding)
        budget -= n_dec
        tok_sum += n_dec

        # 2. prefill chunks of running requests, then 3. new admissions
        def chunk(r: Running) -> None:
            nonlocal budget, tok_sum, pair_sum, touched, kv_ops, n_chunks, chunk_ctx
            c = prefill_chunk(r, budget, tpb, policy, caches)
            k, ctx = c.tokens, c.context_tokens
            c_step.append(step); c_rid.append(r.rid); c_phase.append(0); c_tok.append(k); c_ctx.append(ctx)
            c_lf.append(c.load_first); c_lc.append(c.load_count)
            c_sf.append(c.store_first); c_sc.append(c.store_count)
            c_rf.append(c.read_first); c_rc.append(c.read_count)
            kv_ops = kv_ops or c.moves_kv
            budget -= k
            tok_sum += k
            n_chunks += 1
            chunk_ctx += ctx
            if equiv is None:
                pair_sum += k * (ctx + (k + 1) / 2)
                touched += k if resident else ctx + k
            else:
                p_eq, t_eq = equiv(ctx, k)
                pair_sum += p_eq
                touched += k if resident else t_eq

        for r in prefilling:
            if budget <= 0 or (not chunked_prefill and r.inp - r.computed > budget):
                break
            chunk(r)
        seqs = n_dec + len(prefilling)
        while waiting and budget > 0 and seqs < max_seqs:
            rid = waiting[0]
            blocks = ids[offsets[rid]:offsets[rid + 1]]
            r = admit(rid, blocks if tier_arrays else blocks.tolist(), inp_l[rid], out_l[rid], n_full_l[rid], tpb,
                      caches, extra_blocks(offsets[rid + 1] - offsets[rid]), checkpoint,
                      0 if present_l is None else present_l[rid], blocks)
            if r is None:
                if not prefilling and not n_dec:
                    need = offsets[rid + 1] - offsets[rid] + extra_blocks(offsets[rid + 1] - offsets[rid])
                    raise ConfigError(
                        f"request {rid} needs {need} KV blocks but the {'tier' if resident else 'HBM'} pool "
                        f"holds {pool.capacity}; raise the capacity or use a smaller model/workload"
                    )
                break
            cached[rid] = r.computed
            tier_hit[rid] = r.tier_hit
            waiting.popleft()
            if async_loads and r.load_count:
                issued.append(loads.issue(r))
                continue
            prefilling.append(r)
            seqs += 1
            if not chunked_prefill and r.inp - r.computed > budget:
                break  # the whole prompt in a later step
            chunk(r)

        # move completed prefills to decode; retire finished requests
        still = []
        for r in prefilling:
            if r.computed == r.inp:
                r.generated = 1
                if r.out == 1:
                    done_now.append(r)
                elif spans is not None:
                    spans.join(r, step)
                else:
                    decoding.append(r)
            else:
                still.append(r)
        prefilling = still
        if done_now:
            gone = set()
            for r in done_now:
                pool.release(r.blocks[: r.n_reg], r.reserved)
                gone.add(r.rid)
                if watch is not None and watch[r.rid]:
                    remaining -= 1
            if spans is None:
                decoding = [r for r in decoding if r.rid not in gone]
            finished += len(done_now)
            if watch is None:
                remaining -= len(done_now)
        if spans is not None:
            spans.advance(finishing)
        log.logged_step(n_dec if spans is not None else 0)
        t = step_ns(tok_sum, pair_sum, touched, n_dec, dec_ctx, n_chunks, chunk_ctx)
        outcome = yield StepPlan(now, t, row0, log.index(), kv_ops, tok_sum, [r.rid for r in done_now], issued)
        now = outcome.end_ns
        if heap is not None:
            for r in done_now:  # their children are sent now plus their gaps
                for item in release.completed(r.rid, now):
                    heapq.heappush(heap, item)
        if now > MAX_TIMELINE_NS:
            raise ConfigError(f"the engine's clock passed 2^60 ns (36.5 years) at step {step}: the steps are "
                              f"modelled too slow for kvemu's int64 nanosecond clock")
        if outcome.loads_done_ns:
            loads.completed(outcome.loads_done_ns, outcome.loads_arrival_ns)
        step += 1
        if progress is not None and step % 512 == 0:
            progress(finished)

    hbm_evictions, tier_evictions = caches.evictions()
    return {
        "steps": step,
        "entries": log.rows(),
        "hbm_evictions": hbm_evictions,
        "tier_evictions": tier_evictions,
        "makespan_ns": now,
        "finished": finished,
    }


def simulate(tables: BlockTables, arrival_ms, input_tokens, output_tokens, timing: GpuTiming,
             cfg: EngineConfig, progress=None, weights=None) -> EngineRun:
    """The engine on its own clock: every step takes its modelled compute time (recording), and with
    ``weights`` (engine.weights.WeightPlacement) its weight stream composed with it; ``step_compute_ns``
    stays the GPU compute, the step starts show the stream."""
    n = len(input_tokens)
    arrival_ns = np.round(np.asarray(arrival_ms, np.float64) * 1e6).astype(np.int64)
    log = EngineLog(n)
    step_start = array("q")
    step_compute = array("q")
    step_busy = array("q")
    gen = engine_steps(tables, arrival_ns, input_tokens, output_tokens, timing, cfg, log, progress)
    try:
        plan = next(gen)
        while True:
            step_start.append(plan.start_ns)
            step_compute.append(plan.compute_ns)
            d = plan.compute_ns if weights is None else weights.step_ns(plan.compute_ns, plan.new_tokens)
            step_busy.append(d)
            plan = gen.send(StepOutcome(plan.start_ns + d))
    except StopIteration as end:
        run_stats = end.value
    stats = {k: run_stats[k] for k in ("steps", "entries", "hbm_evictions", "tier_evictions", "makespan_ns")}
    return EngineRun(log.cached, log.tier_hit, np.frombuffer(step_start, np.int64).copy(),
                     np.frombuffer(step_compute, np.int64).copy(), in_step_order(log.take_entries()), stats,
                     None if weights is None else np.frombuffer(step_busy, np.int64).copy())
