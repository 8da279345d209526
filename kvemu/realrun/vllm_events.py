"""Import a recorded stream of vLLM KV cache events as a v1 trace (``kvemu record --from-vllm-events``).

vLLM publishes its prefix cache's changes over ZMQ when started with ``--kv-events-config``
(``vllm/distributed/kv_events.py``): each message is one msgpack-encoded ``EventBatch`` (a
timestamp, a list of events, and since multi-rank support a ``data_parallel_rank``). Events are
``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``,
``lora_id``, later ``medium``, ``lora_name``, ``extra_keys``, ``group_idx``, ...),
``BlockRemoved`` (``block_hashes``, later ``medium``, ``group_idx``) and ``AllBlocksCleared``.
Older vLLM encodes events positionally (msgspec ``array_like``: ``["BlockStored", hashes, parent,
...]``); newer vLLM encodes them as maps tagged by ``type``. Both are read; fields added after
those named here are ignored.

File format (what ``tools/capture_vllm_events.py`` writes): a msgpack stream, the payload frame of
each ZMQ message (one EventBatch) appended as received, nothing in between. msgpack values are
self-delimiting, so the file is read with one ``msgpack.Unpacker``.

Mapping (docs/sources.md): events show which blocks entered and left the cache, not which blocks
each step read. Every ``BlockStored`` event of a batch becomes one synthetic request, whose block
table is the chain of its blocks (ancestors found through ``parent_block_hash``, then the new
blocks) and whose one prefill entry stores the new blocks, in a step of its own per batch at the
batch's timestamp. Parent chains give shared block ids, so prefix sharing shows as dedup.
``BlockRemoved`` and ``AllBlocksCleared`` end block lifetimes, reported per medium in the
trace's ``capture`` metadata.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Iterator

import numpy as np

from ..errors import ConfigError, WorkloadError
from ..models import ModelGeometry, resolve_model
from ..output import check_destination
from ..schema import PHASE_PREFILL, file_sha256
from .tracebuild import TraceBuilder

SOURCE = "vllm-events"
# Positional field order of vLLM's array_like structs, tag first; later versions appended fields.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple
    parent_block_hash: Hashable | None
    tokens: int  # len(token_ids)
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple
    data_parallel_rank: int | None
    encoding: str  # "positional" or "map": how the events were encoded
    unknown: int = 0  # events of a type this importer does not know (skipped)


def _msgpack():
    try:
        import msgpack
    except ImportError:
        raise ConfigError("reading vLLM KV events needs msgpack: pip install 'kvemu[vllm]'") from None
    return msgpack


def read_event_batches(path) -> Iterator[EventBatch]:
    """The EventBatches of a capture file, in file order. Raises WorkloadError naming the batch."""
    msgpack = _msgpack()
    p = Path(path)
    try:
        f = open(p, "rb")
    except OSError as e:
        raise WorkloadError(f"{p}: cannot read vLLM events ({e.strerror or e})") from None
    with f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=1 << 30)
        i = end = 0
        while True:
            try:
                obj = unpacker.unpack()
            except msgpack.OutOfData:
                if end != p.stat().st_size:
                    raise WorkloadError(f"{p}: truncated after {i} event batches (byte {end})") from None
                return
            except (ValueError, msgpack.StackError, msgpack.FormatError) as e:
                raise WorkloadError(f"{p}: batch {i} is not valid msgpack ({str(e) or type(e).__name__})") from None
            end = unpacker.tell()  # where the next batch starts
            yield _batch(obj, i, p)
            i += 1


def _batch(obj: Any, i: int, p: Path) -> EventBatch:
    where = f"{p}: batch {i}"
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, (list, tuple)) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    else:
        raise WorkloadError(f"{where}: not an EventBatch (expected [ts, events, ...] or a map with 'ts' and 'events')")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not np.isfinite(ts):
        raise WorkloadError(f"{where}: timestamp {ts!r} is not a number")
    if not isinstance(events, (list, tuple)):
        raise WorkloadError(f"{where}: events is not a list")
    if rank is not None and not isinstance(rank, int):
        raise WorkloadError(f"{where}: data_parallel_rank {rank!r} is not an integer")
    out, unknown, kinds = [], 0, set()
    for j, ev in enumerate(events):
        if isinstance(ev, dict):
            tag, fields = ev.get("type"), ev
            kinds.add("map")
        elif isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
            tag = ev[0]
            names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
            fields = dict(zip(names, ev[1:]))
            kinds.add("positional")
        else:
            raise WorkloadError(f"{where} event {j}: neither a tagged array nor a map with 'type'")
        try:
            if tag == "BlockStored":
                out.append(_stored(fields))
            elif tag == "BlockRemoved":
                out.append(BlockRemoved(_hashes(fields["block_hashes"]), _opt(fields, "medium", str),
                                        _opt(fields, "group_idx", int)))
            elif tag == "AllBlocksCleared":
                out.append(AllBlocksCleared())
            else:
                unknown += 1
        except (KeyError, TypeError, ValueError) as e:
            raise WorkloadError(f"{where} event {j} ({tag}): malformed ({e})") from None
    return EventBatch(float(ts), tuple(out), rank, "map" if kinds == {"map"} else "positional", unknown)


def _stored(f: dict) -> BlockStored:
    hashes = _hashes(f["block_hashes"])
    size = f["block_size"]
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"block_size {size!r} is not a positive integer")
    tokens = f.get("token_ids") or []
    if not isinstance(tokens, (list, tuple)):
        raise TypeError("token_ids is not a list")
    parent = f.get("parent_block_hash")
    return BlockStored(hashes, _hash(parent) if parent is not None else None, len(tokens), size,
                       _opt(f, "lora_id", int), _opt(f, "medium", str), _opt(f, "group_idx", int))


def _hash(h) -> Hashable:
    if isinstance(h, bool) or not isinstance(h, (int, bytes, str)):
        raise TypeError(f"block hash {h!r} is not an integer, bytes or string")
    return h


def _hashes(hs) -> tuple:
    if not isinstance(hs, (list, tuple)):
        raise TypeError("block_hashes is not a list")
    return tuple(_hash(h) for h in hs)


def _opt(f: dict, name: str, kind: type):
    v = f.get(name)
    if v is not None and (not isinstance(v, kind) or isinstance(v, bool)):
        raise TypeError(f"{name} {v!r} is not {kind.__name__}")
    return v


# -------------------------------------------------------------------------------------- import
class _Lifetimes:
    """Block lifetimes per medium: stored at, removed at; what is left live at the end."""

    def __init__(self):
        self.live: dict[tuple, float] = {}  # (rank, group, hash, medium) -> stored at (s)
        self.count = defaultdict(lambda: defaultdict(int))
        self.lifetimes = defaultdict(list)  # medium -> seconds
        self.live_now = defaultdict(int)
        self.peak = defaultdict(int)

    def store(self, key: tuple, medium: str, ts: float) -> None:
        self.count[medium]["stored_blocks"] += 1
        if key in self.live:
            self.count[medium]["restored_live_blocks"] += 1
            return
        self.live[key] = ts
        self.live_now[medium] += 1
        self.peak[medium] = max(self.peak[medium], self.live_now[medium])

    def remove(self, key: tuple, medium: str, ts: float, why: str) -> None:
        t0 = self.live.pop(key, None)
        if t0 is None:
            self.count[medium]["removed_unknown_blocks"] += 1
            return
        self.count[medium][why] += 1
        self.live_now[medium] -= 1
        self.lifetimes[medium].append(ts - t0)

    def clear(self, rank, ts: float) -> None:
        for key in [k for k in self.live if k[0] == rank]:
            self.remove(key, key[3], ts, "cleared_blocks")

    def summary(self) -> dict:
        out = {}
        for medium in sorted(set(self.count) | set(self.lifetimes), key=str):
            life = np.asarray(self.lifetimes[medium], np.float64) * 1e3
            out[str(medium)] = {
                **{k: 0 for k in ("stored_blocks", "removed_blocks", "cleared_blocks", "removed_unknown_blocks",
                                  "restored_live_blocks")},
                **dict(self.count[medium]),
                "live_blocks_at_end": self.live_now[medium],
                "peak_live_blocks": self.peak[medium],
                "lifetime_ms": {
                    "count": int(len(life)),
                    **({"mean": float(life.mean()), "median": float(np.median(life)),
                        "p99": float(np.percentile(life, 99)), "max": float(life.max())} if len(life) else {}),
                },
            }
        return out


def import_vllm_events(path, model: str | ModelGeometry, out, *, medium: str | None = None,
                       tokens_per_block: int | None = None, kv_dtype: str = "bf16", force: bool = False) -> dict:
    """Turn a capture of vLLM KV events into a trace of ``model``'s geometry. Returns its metadata.

    ``medium``: import only the stores of this medium (``GPU``, ``CPU``, ...; None: all).
    ``tokens_per_block``: checked against the events' ``block_size`` (None: taken from them)."""
    check_destination(out, force, inputs=[path])
    geometry = resolve_model(model, kv_dtype) if isinstance(model, str) else model
    p = Path(path)
    batches = list(read_event_batches(p))
    if not batches:
        raise WorkloadError(f"{p}: no event batches")
    order = sorted(range(len(batches)), key=lambda i: batches[i].ts)  # stable: equal stamps keep file order
    reordered = sum(1 for a, b in zip(order, order[1:]) if b < a)
    ts0 = batches[order[0]].ts

    builder: TraceBuilder | None = None
    block_size = tokens_per_block
    depth: dict[tuple, int] = {}  # (rank, group, hash) -> position in its chain
    parent_of: dict[tuple, tuple | None] = {}
    life = _Lifetimes()
    counts = defaultdict(int)
    ranks, encodings = set(), defaultdict(int)
    for i in order:
        batch = batches[i]
        rank = batch.data_parallel_rank
        ranks.add(rank)
        encodings[batch.encoding] += 1
        counts["unknown_events"] += batch.unknown
        step = None
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                counts["BlockStored"] += 1
                if block_size is None:
                    block_size = ev.block_size
                if ev.block_size != block_size:
                    raise WorkloadError(
                        f"{p}: events have block_size {ev.block_size}, but --block-tokens is {block_size}"
                        if tokens_per_block is not None else
                        f"{p}: events mix block_size {block_size} and {ev.block_size}; a trace has one block size")
                if ev.tokens and ev.tokens != len(ev.block_hashes) * ev.block_size:
                    counts["token_count_mismatches"] += 1
                if not ev.block_hashes:
                    continue
                med = ev.medium or "GPU"  # vLLM before `medium` existed published the GPU cache only
                chain = _ancestors(rank, ev, depth, parent_of, counts)
                prefix = len(chain)
                for j, h in enumerate(ev.block_hashes):
                    key = (rank, ev.group_idx, h)
                    parent_of[key] = chain[-1][:3] if chain else None
                    depth[key] = prefix + j
                    chain.append((*key, prefix + j))
                    life.store((rank, ev.group_idx, h, med), med, batch.ts)
                if medium is not None and med != medium:
                    continue
                if builder is None:
                    builder = TraceBuilder(block_size)
                if step is None:
                    step = builder.add_step(0)
                new = len(ev.block_hashes)
                rid = builder.add_request(arrival_ms=(batch.ts - ts0) * 1e3, input_tokens=len(chain) * block_size,
                                          output_tokens=1, cached_tokens=prefix * block_size, block_keys=chain)
                builder.add_entry(step, rid, phase=PHASE_PREFILL, tokens=new * block_size,
                                  context_tokens=prefix * block_size, store=(prefix, new))
            elif isinstance(ev, BlockRemoved):
                counts["BlockRemoved"] += 1
                med = ev.medium or "GPU"
                for h in ev.block_hashes:
                    life.remove((rank, ev.group_idx, h, med), med, batch.ts, "removed_blocks")
            else:
                counts["AllBlocksCleared"] += 1
                life.clear(rank, batch.ts)
    if builder is None:
        which = f" of medium {medium!r}" if medium is not None else ""
        raise WorkloadError(f"{p}: no BlockStored events{which} among {len(batches)} batches")

    digest = file_sha256(p)
    params = {"medium": medium, "batches": len(batches), "reordered_batches": reordered}
    workload = {"source": f"{SOURCE}:{p}", "kind": SOURCE, "checksum": f"sha256:{digest}",
                "hash_block_tokens": block_size, "params": params}
    engine = {"tier_policy": "offload", "block_size": block_size,
              "engine": "vLLM (prefix cache as seen through its KV cache events)"}
    capture = {
        "source": SOURCE,
        "file": str(p),
        "file_format": "msgpack stream of EventBatch payloads, as published by vLLM's ZMQ KV event publisher",
        "encodings": dict(encodings),
        "events": {k: counts[k] for k in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "unknown_events")},
        "data_parallel_ranks": sorted(ranks, key=lambda r: -1 if r is None else r),
        "orphan_stores": counts["orphan_stores"],
        "token_count_mismatches": counts["token_count_mismatches"],
        "span_s": batches[order[-1]].ts - ts0,
        "mediums": life.summary(),
        "compute_ns": "zero: events carry no compute time; each step starts at its batch's timestamp",
        "ops": {
            "store": "the blocks of one BlockStored event, one synthetic request per event",
            "read": "none: events do not show attention reads",
            "load": "none: events do not show prefix hits",
        },
    }
    return builder.write(out, model=geometry, workload=workload, engine=engine, capture=capture, force=force)


def _ancestors(rank, ev: BlockStored, depth: dict, parent_of: dict, counts) -> list[tuple]:
    """Keys of the blocks before ``ev``'s first block, root first; empty for a root or an unknown parent."""
    if ev.parent_block_hash is None:
        return []
    key = (rank, ev.group_idx, ev.parent_block_hash)
    if key not in depth:
        counts["orphan_stores"] += 1  # capture started after the parent was stored
        return []
    chain = []
    while key is not None:
        chain.append(key)
        if len(chain) > len(depth):
            raise WorkloadError(f"block {ev.parent_block_hash!r}: parent_block_hash links form a cycle")
        key = parent_of[key]
    chain.reverse()
    # an ancestor stored as an orphan starts its own chain: positions are renumbered from 0 here
    return [(*k, pos) for pos, k in enumerate(chain)]
