"""From captured KV activity to a v1 trace: the one builder the real-run sources share.

A source (the numpy run, the HuggingFace cache hook, the vLLM event importer) adds requests,
steps and batch entries as it observes them; :class:`TraceBuilder` assigns block ids, checks
every range against the request's block table and writes the trace with ``schema.write_trace``.

Block ids follow docs/trace-format.md. A source names each shareable block by a *key* that stands
for its content and everything before it (a chained hash of token ids, as vLLM's prefix cache);
equal keys get the same id, so prefix sharing shows as dedup. Keys get dense ids in order of first
appearance; the rest of a table (the partial last prompt block, the blocks decode fills) gets
private ids after all shared ones, consecutive per request, so tables stay a handful of runs.

Sources that see per-layer token traffic (the numpy run, the HuggingFace hook) describe it with
:class:`LayerAccess`; :func:`entry_ops` turns the accesses of all layers into one entry's
operations under the *resident* mapping (the KV lives where it was captured, in the tier):
blocks that become full are stored, full blocks written before the step and read by attention
are read. Tokens written and read within the same step stay in the working block and are not
tier traffic, as in the engine model's resident policy.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from ..engine.blocks import BlockTables
from ..errors import TraceError
from ..models import ModelGeometry
from ..schema import PHASE_DECODE, PHASE_PREFILL, list_column, write_trace

OPS = ("load", "store", "read")


@dataclass(frozen=True)
class LayerAccess:
    """One layer's KV traffic for one request in one step, in token positions of the request.

    ``write_first``/``write_tokens``: tokens whose K and V the layer appended to the cache.
    ``read_first``/``read_tokens``: tokens whose K and V attention read (this step's own included).
    """

    layer: int
    write_first: int
    write_tokens: int
    read_first: int
    read_tokens: int


def chained_block_hashes(tokens, tokens_per_block: int) -> list[bytes]:
    """Keys of the full blocks of a token sequence: each hashes its block's token ids together with
    the key before it (as vLLM's prefix cache), so equal keys mean equal prefixes."""
    tokens = np.asarray(tokens, "<i8")
    out, parent = [], b""
    for b in range(len(tokens) // tokens_per_block):
        parent = hashlib.sha256(parent + tokens[b * tokens_per_block:(b + 1) * tokens_per_block].tobytes()).digest()
        out.append(parent)
    return out


def table_blocks(input_tokens: int, output_tokens: int, tokens_per_block: int) -> int:
    """Blocks in a request's table: the KV of the last generated token is never written."""
    return -(-(input_tokens + output_tokens - 1) // tokens_per_block)


def entry_ops(accesses: Sequence[LayerAccess], layers: int, tokens_per_block: int) -> dict:
    """One entry's fields from the per-layer accesses of one request in one step (resident mapping).

    Every layer must appear once and all must agree: the trace format gives one range per operation
    that applies to every layer. Returns ``context_tokens``, ``tokens``, ``store`` and ``read``
    (ranges of table positions as ``(first, count)``)."""
    seen = sorted(a.layer for a in accesses)
    if seen != list(range(layers)):
        raise TraceError(f"captured KV accesses cover layers {seen}, expected each of 0..{layers - 1} once")
    a0 = accesses[0]
    for a in accesses[1:]:
        if (a.write_first, a.write_tokens, a.read_first, a.read_tokens) != (
                a0.write_first, a0.write_tokens, a0.read_first, a0.read_tokens):
            raise TraceError(
                f"layer {a.layer} wrote/read tokens {a.write_first}+{a.write_tokens}/{a.read_first}+{a.read_tokens}"
                f" but layer {a0.layer} {a0.write_first}+{a0.write_tokens}/{a0.read_first}+{a0.read_tokens}:"
                f" a v1 trace needs the same ranges in every layer"
            )
    tpb = tokens_per_block
    ctx, n = a0.write_first, a0.write_tokens
    if n <= 0 or ctx < 0:
        raise TraceError(f"captured write of {n} tokens at {ctx}: an entry writes at least one token")
    filled_lo, filled_hi = ctx // tpb, (ctx + n) // tpb
    # Full blocks that existed before the step and lie inside what attention read.
    read_end = min(a0.read_first + a0.read_tokens, ctx)
    read_lo = -(-a0.read_first // tpb)
    read_hi = max(read_lo, read_end // tpb)
    return {
        "context_tokens": ctx,
        "tokens": n,
        "store": (filled_lo, filled_hi - filled_lo) if filled_hi > filled_lo else (0, 0),
        "read": (read_lo, read_hi - read_lo) if read_hi > read_lo else (0, 0),
    }


class TraceBuilder:
    """Collects requests, steps and entries; writes them as a v1 trace.

    Requests are added in arrival order; entries name a step already added. Time: each step has a
    measured (or zero) ``compute_ns``; ``start_ns`` is rebuilt at write time as the engine model
    does, a step starting when the previous one ended and not before its requests arrived."""

    def __init__(self, tokens_per_block: int):
        if tokens_per_block <= 0:
            raise TraceError("tokens_per_block must be positive")
        self.tokens_per_block = tokens_per_block
        self._req: list[tuple[float, int, int, int, int]] = []
        self._keys: list[list[Hashable]] = []
        self._compute: list[int] = []
        self._entries: dict[str, list[int]] = {k: [] for k in (
            "step", "request_id", "phase", "tokens", "context_tokens", "load_first", "load_count",
            "store_first", "store_count", "read_first", "read_count")}

    @property
    def n_requests(self) -> int:
        return len(self._req)

    @property
    def n_steps(self) -> int:
        return len(self._compute)

    def table_length(self, request: int) -> int:
        _, inp, out, _, _ = self._req[request]
        return table_blocks(inp, out, self.tokens_per_block)

    def add_request(self, *, arrival_ms: float, input_tokens: int, output_tokens: int, cached_tokens: int = 0,
                    tier_hit_tokens: int = 0, block_keys: Sequence[Hashable] = ()) -> int:
        """A request; ``block_keys`` name its leading shareable blocks (the rest are private)."""
        if self._req and arrival_ms < self._req[-1][0]:
            raise TraceError(f"requests must be added in arrival order ({arrival_ms} ms after {self._req[-1][0]} ms)")
        if not (np.isfinite(arrival_ms) and arrival_ms >= 0):
            raise TraceError(f"request arrival {arrival_ms} ms must be finite and >= 0")
        if input_tokens <= 0 or output_tokens <= 0:
            raise TraceError(f"request token counts must be positive (input {input_tokens}, output {output_tokens})")
        if not 0 <= tier_hit_tokens <= cached_tokens < input_tokens:
            raise TraceError(f"need 0 <= tier_hit_tokens {tier_hit_tokens} <= cached_tokens {cached_tokens}"
                             f" < input_tokens {input_tokens}")
        keys = list(block_keys)
        if len(keys) > table_blocks(input_tokens, output_tokens, self.tokens_per_block):
            raise TraceError(f"{len(keys)} block keys for a table of "
                             f"{table_blocks(input_tokens, output_tokens, self.tokens_per_block)} blocks")
        self._req.append((float(arrival_ms), int(input_tokens), int(output_tokens), int(cached_tokens),
                          int(tier_hit_tokens)))
        self._keys.append(keys)
        return len(self._req) - 1

    def add_step(self, compute_ns: int) -> int:
        if compute_ns < 0:
            raise TraceError(f"step compute_ns {compute_ns} is negative")
        self._compute.append(int(compute_ns))
        return len(self._compute) - 1

    def add_entry(self, step: int, request: int, *, phase: int, tokens: int, context_tokens: int,
                  load: tuple[int, int] = (0, 0), store: tuple[int, int] = (0, 0),
                  read: tuple[int, int] = (0, 0)) -> None:
        if not 0 <= step < self.n_steps:
            raise TraceError(f"entry names step {step}, {self.n_steps} steps added")
        if self._entries["step"] and step < self._entries["step"][-1]:
            raise TraceError(f"entries must be added in step order (step {step} after {self._entries['step'][-1]})")
        if not 0 <= request < self.n_requests:
            raise TraceError(f"entry names request {request}, {self.n_requests} requests added")
        if phase not in (PHASE_PREFILL, PHASE_DECODE) or tokens <= 0 or context_tokens < 0:
            raise TraceError(f"step {step} request {request}: phase {phase}, tokens {tokens}, context {context_tokens}")
        n_blocks = self.table_length(request)
        e = self._entries
        e["step"].append(step)
        e["request_id"].append(request)
        e["phase"].append(phase)
        e["tokens"].append(tokens)
        e["context_tokens"].append(context_tokens)
        for op, (first, count) in zip(OPS, (load, store, read)):
            if first < 0 or count < 0 or first + count > n_blocks:
                raise TraceError(f"step {step} request {request}: {op} range {first}+{count} exceeds its block "
                                 f"table ({n_blocks} blocks)")
            e[f"{op}_first"].append(first if count else 0)
            e[f"{op}_count"].append(count)

    # ------------------------------------------------------------------------------------ writing
    def block_tables(self) -> BlockTables:
        """Every request's table: shared ids by key in order of first appearance, then private ids."""
        tpb = self.tokens_per_block
        shared: dict[Hashable, int] = {}
        position: dict[Hashable, int] = {}
        lengths = [self.table_length(r) for r in range(self.n_requests)]
        rows = []
        for r, keys in enumerate(self._keys):
            row = []
            for p, k in enumerate(keys):
                if position.setdefault(k, p) != p:
                    raise TraceError(f"request {r}: block key at table position {p} was seen at position "
                                     f"{position[k]}; a key must stand for the whole prefix up to its block")
                row.append(shared.setdefault(k, len(shared)))
            rows.append(row)
        n_shared = len(shared)
        next_private = n_shared
        ids = np.zeros(sum(lengths), np.int64)
        offsets = np.zeros(self.n_requests + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        n_full = np.zeros(self.n_requests, np.int64)
        for r, row in enumerate(rows):
            k = len(row)
            priv = lengths[r] - k
            ids[offsets[r]: offsets[r] + k] = row
            ids[offsets[r] + k: offsets[r + 1]] = np.arange(next_private, next_private + priv)
            next_private += priv
            n_full[r] = k
        return BlockTables(tpb, offsets, ids, n_full, n_shared, next_private)

    def step_start_ns(self) -> np.ndarray:
        compute = np.asarray(self._compute, np.int64)
        arrival_ns = np.round(np.array([r[0] for r in self._req], np.float64) * 1e6).astype(np.int64)
        bound = np.zeros(self.n_steps, np.int64)
        if self._entries["step"]:
            np.maximum.at(bound, np.asarray(self._entries["step"]),
                          arrival_ns[np.asarray(self._entries["request_id"])])
        start = np.zeros(self.n_steps, np.int64)
        now = 0
        for s in range(self.n_steps):
            now = max(now, int(bound[s]))
            start[s] = now
            now += int(compute[s])
        return start

    def write(self, out, *, model: ModelGeometry, workload: dict, engine: dict, capture: dict,
              force: bool = False) -> dict:
        """Write the trace; returns its metadata. ``capture`` says what was observed and how."""
        if self.n_requests == 0:
            raise TraceError("nothing was captured: no request")
        ran = np.zeros(self.n_requests, bool)
        ran[np.asarray(self._entries["request_id"], np.int64)] = True
        if not ran.all():
            raise TraceError(f"request {int(np.argmin(ran))} was captured but never ran in a step")
        tables = self.block_tables()
        run_off, run_start, run_count = tables.runs()
        req = np.array([r[1:] for r in self._req], np.int64).reshape(-1, 4)
        n = self.n_requests
        requests = {
            "request_id": np.arange(n, dtype=np.int32),
            "arrival_ms": np.array([r[0] for r in self._req], np.float64),
            "input_tokens": req[:, 0].astype(np.int32),
            "output_tokens": req[:, 1].astype(np.int32),
            "cached_tokens": req[:, 2].astype(np.int32),
            "tier_hit_tokens": req[:, 3].astype(np.int32),
            "block_start": list_column(run_off, run_start),
            "block_count": list_column(run_off, run_count.astype(np.int32)),
        }
        start = self.step_start_ns()
        compute = np.asarray(self._compute, np.int64)
        steps = {"step": np.arange(self.n_steps, dtype=np.int32), "start_ns": start, "compute_ns": compute}
        entries = {k: np.asarray(v, np.int32) for k, v in self._entries.items()}
        makespan = int(start[-1] + compute[-1]) if self.n_steps else 0
        meta = {
            "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "model": model.to_dict(self.tokens_per_block),
            "workload": {"requests": n, **workload},
            "engine": {"tokens_per_block": self.tokens_per_block, **engine, "steps": self.n_steps,
                       "entries": len(entries["step"]), "makespan_ns": makespan},
            "capture": capture,
            "schedule": {"closed_loop": False, "source": "captured",
                         "why": "a real run's schedule is what happened: replay it as recorded"},
            "blocks": {"id_space": tables.id_space, "shared_id_space": tables.shared_id_space},
        }
        write_trace(out, meta, requests, steps, entries, force=force)
        return meta
