"""Workloads: the requests an engine model replays, read from a trace or generated from a recipe.

A workload says when each request arrives, how many prompt tokens it brings, how many tokens it
generates and, where the source knows it, which prompt blocks it shares with other requests
(chained prefix-block hashes, as Mooncake publishes them). Sources are named by a spec string:

``mooncake:PATH``
    Mooncake's JSONL traces (FAST'25 release): one object per line with ``timestamp`` (ms),
    ``input_length``, ``output_length`` (tokens) and ``hash_ids``, one id per 512-token prompt block.
``azure:PATH``
    Azure LLM inference CSV: ``TIMESTAMP`` (wall clock, up to 9 fractional digits),
    ``ContextTokens``, ``GeneratedTokens``. It carries no prefix information.
``semianalysis:PATH``, ``bailian:PATH``, ``dynamo:PATH``, ``tair:PATH``
    Agentic and session traces: SemiAnalysis x WEKA coding-agent traces, Qwen Bailian sessions,
    Dynamo's ``mooncake-delta`` and ``agentic_mooncake`` rows, tair-kvcache events
    (docs/workloads.md gives each format's fields, conventions and sources).
``synthetic:NAME`` or ``synthetic:NAME:key=value,key=value``
    A seeded generator registered in `SYNTHETIC_WORKLOADS` (``chat``, ``docqa``, ``agent``).

Every file format is a reader registered with `register_reader` (the registry `FILE_READERS`),
with its format's block rule (kvemu/blockrule.py) as defaults: a spec may override it after the
path, ``KIND:PATH:block_tokens=N,scope=global|local,partial=0|1,time_unit=...,context_cap=N,
truncate=drop|head``, and the workload records the rule it was read with (``block_rule``).

Every source then goes through the same selection in `load_workload` (arrival order, time window,
first N, time rebased to the first kept request), and every parameter it used is recorded in
`Workload.params`, so a trace recorded from a workload says exactly which requests it replayed.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import hashlib
import inspect
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from . import blockrule
from .blockrule import BlockRule
from .errors import ConfigError, WorkloadError
from .inputs import not_regular
from .sessions import SessionGraph, build_graph, graph_problem
from .units import MAX_ARRIVAL_SPAN_MS, span_text

__all__ = [
    "FILE_READERS",
    "MOONCAKE_BLOCK_TOKENS",
    "SYNTHETIC_BLOCK_TOKENS",
    "SYNTHETIC_WORKLOADS",
    "RequestColumns",
    "Workload",
    "load_workload",
    "register_reader",
    "register_synthetic",
    "source_file",
]

MOONCAKE_BLOCK_TOKENS = 512  # the block size Mooncake's published traces were hashed with
SYNTHETIC_BLOCK_TOKENS = 256  # LMCache's default chunk size

_INT64_MAX = int(np.iinfo(np.int64).max)
# Synthetic recipes beyond these are refused up front rather than failing in the allocator or
# wrapping around: 10^8 hash ids is 800 MB, and the engine keeps token counts as int32.
_MAX_SYNTHETIC_REQUESTS = 10_000_000
_MAX_SYNTHETIC_HASH_IDS = 100_000_000
_MAX_SYNTHETIC_PROMPT_TOKENS = 2**31 - 1


@dataclass(frozen=True, eq=False)
class Workload:
    """Requests in arrival order, with the hash ids of their prompt blocks in CSR form.

    Request ``i`` arrives ``arrival_ms[i]`` ms after the first one (which is at 0.0), brings
    ``input_tokens[i]`` prompt tokens and generates ``output_tokens[i]``. Its prompt, cut into
    blocks of ``hash_block_tokens`` tokens (the last one possibly partial), has the block ids
    ``hashes(i)``. Ids are chained: two requests have the same id at a block exactly when their
    prompts agree on every token up to the end of that block. Sources without prefix information
    (Azure) have ``hash_block_tokens=None`` and no ids.

    Construction checks these invariants and makes the arrays read-only. Equality is identity:
    compare ``checksum`` and ``params`` to tell whether two workloads hold the same requests.
    """

    source: str
    kind: str
    checksum: str
    arrival_ms: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_block_tokens: int | None
    hash_offsets: np.ndarray
    hash_ids: np.ndarray
    params: dict
    #: the block rule the requests were made with (`kvemu.blockrule.BlockRule.to_dict`); None for a
    #: workload built by hand
    block_rule: dict | None = None
    #: which request continues which, and the gap after its parent completes (kvemu.sessions); None:
    #: the source has no sessions
    sessions: SessionGraph | None = None

    def __post_init__(self) -> None:
        problem = _workload_problem(self)
        if problem:
            # Loaders only build valid workloads, so this is a bug in the caller, not bad data.
            raise ValueError(f"invalid Workload from {self.source!r}: {problem}")
        for array in (self.arrival_ms, self.input_tokens, self.output_tokens,
                      self.hash_offsets, self.hash_ids):
            array.setflags(write=False)

    @property
    def n_requests(self) -> int:
        return len(self.arrival_ms)

    def hashes(self, i: int) -> np.ndarray:
        """Block ids of request ``i``'s prompt, first block first (a read-only view)."""
        n = self.n_requests
        if not -n <= i < n:
            raise IndexError(f"request {i} out of range for a workload of {n} requests")
        i %= n
        return self.hash_ids[self.hash_offsets[i] : self.hash_offsets[i + 1]]


def _workload_problem(w: Workload) -> str | None:
    """The first broken invariant of ``w``, or None."""
    columns = {"arrival_ms": (w.arrival_ms, np.float64), "input_tokens": (w.input_tokens, np.int64),
               "output_tokens": (w.output_tokens, np.int64), "hash_offsets": (w.hash_offsets, np.int64),
               "hash_ids": (w.hash_ids, np.int64)}
    for name, (array, dtype) in columns.items():
        if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
            return f"{name} must be a 1-D {np.dtype(dtype).name} array"
    n = len(w.arrival_ms)
    if n == 0:
        return "no requests"
    if len(w.input_tokens) != n or len(w.output_tokens) != n or len(w.hash_offsets) != n + 1:
        return "column lengths disagree"
    if w.arrival_ms[0] != 0.0 or not np.all(np.diff(w.arrival_ms) >= 0):
        return "arrival_ms must start at 0.0 and never decrease"
    if w.input_tokens.min() < 1 or w.output_tokens.min() < 1:
        return "token counts must be >= 1"
    counts = np.diff(w.hash_offsets)
    if w.hash_offsets[0] != 0 or w.hash_offsets[-1] != len(w.hash_ids) or counts.min() < 0:
        return "hash_offsets are not CSR offsets into hash_ids"
    if w.hash_block_tokens is None:
        if len(w.hash_ids):
            return "hash ids without hash_block_tokens"
    elif w.hash_block_tokens < 1:
        return "hash_block_tokens must be >= 1"
    elif np.any(counts != -(-w.input_tokens // w.hash_block_tokens)):
        return "a request's hash count is not ceil(input_tokens / hash_block_tokens)"
    if w.sessions is not None:
        g = w.sessions
        return graph_problem(g.parent, g.gap_ms, g.session, g.turn, n)
    return None


class RequestColumns(NamedTuple):
    """Requests as parsed or generated, before selection: what readers and generators return.

    ``arrival_ms`` is measured from the earliest request (so its minimum is 0.0) but need not be
    sorted; the hash columns are CSR as in `Workload`. A source with sessions gives ``parent`` (int64:
    the row a request continues, or -1) and ``gap_ms`` (float64: ms after the parent completes; NaN:
    the recorded inter-arrival gap stands for it).
    """

    arrival_ms: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_offsets: np.ndarray
    hash_ids: np.ndarray
    parent: np.ndarray | None = None
    gap_ms: np.ndarray | None = None


# ---------------------------------------------------------------------------------------------
# Entry point and selection


def load_workload(spec: str, *, max_requests: int | None = None,
                  window_ms: tuple[float, float] | None = None,
                  hash_block_tokens: int | None = None, seed: int = 0) -> Workload:
    """Read or generate the workload named by ``spec`` and select the requests to replay.

    Requests are put in arrival order first. Where a file's timestamps go backwards, the requests
    are sorted stably by timestamp (ties keep file order), and ``params`` records
    ``"sorted": True`` and ``"out_of_order"``: how many requests arrive earlier than some request
    listed before them. ``window_ms=(a, b)`` then keeps the requests with ``a <= t < b``, ``t`` in
    ms after the source's first (earliest) request (``b`` may be infinity, recorded as null), and
    ``max_requests`` keeps the first N of those. Times are rebased so the first kept request
    arrives at 0.0; ``params["time_offset_ms"]`` says where it was, and ``params["time_origin"]``
    (file sources) is the source's own timestamp of its first request.

    ``hash_block_tokens`` overrides the tokens per hash block: Mooncake's 512 (the file is checked
    against it) or the synthetic generators' 256. Azure has no prefix information and refuses it.
    ``seed`` seeds synthetic generators and is ignored for files.

    A file request that generated 0 tokens is replayed as generating 1, since prefill always
    yields the first token; ``params["output_zero_clamped"]`` counts them. Negative counts are
    refused, as is an input of 0 tokens.

    Raises ConfigError for a bad spec or option, WorkloadError for bad data or an empty selection.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"a workload spec is a string such as 'mooncake:PATH', got {spec!r}")
    _check_selection_options(max_requests, window_ms, hash_block_tokens)
    if hash_block_tokens is not None:
        hash_block_tokens = int(hash_block_tokens)  # a numpy integer would not serialise into params
    kind, _, rest = spec.partition(":")
    if kind in FILE_READERS:
        path_text, options = _split_rule_options(spec, kind, rest)
        if not path_text:
            raise ConfigError(f"workload spec {spec!r} names no file; expected {kind}:PATH")
        reader = FILE_READERS[kind]
        rule, given = _rule_for(reader, options, hash_block_tokens)
        raw = reader.read(Path(path_text), rule, given)
        columns, rule_params = _apply_rule(Path(path_text), raw)
        checksum, block_tokens, rule = raw.checksum, raw.rule.block_tokens, raw.rule
        params = {**raw.params, **rule_params}
    elif kind == "synthetic":
        name, _, knob_text = rest.partition(":")
        kind = f"synthetic:{name}"
        columns, checksum, block_tokens, params = _generate(name, knob_text, hash_block_tokens, seed)
        # generators give a trailing partial block an id of its own, in milliseconds
        rule = BlockRule(block_tokens, "global", False, "ms")
    else:
        raise ConfigError(f"unknown workload source {kind!r} in {spec!r}; known: "
                          f"{', '.join(f'{k}:PATH' for k in FILE_READERS)}, synthetic:NAME[:key=value,...]")
    columns, selection = _select(spec, columns, max_requests, window_ms)
    params = {"hash_block_tokens": block_tokens, **params, **selection}
    sessions = _session_graph(columns, params)
    return Workload(source=spec, kind=kind, checksum=checksum, arrival_ms=columns.arrival_ms,
                    input_tokens=columns.input_tokens, output_tokens=columns.output_tokens,
                    hash_block_tokens=block_tokens, hash_offsets=columns.hash_offsets,
                    hash_ids=columns.hash_ids, params=params, block_rule=rule.to_dict(), sessions=sessions)


def _session_graph(columns: RequestColumns, params: dict) -> SessionGraph | None:
    """The selected requests' session graph: a parent that arrives after its child (equal times in
    the other order) or outside the selection leaves the child a root (``params["session_links_cut"]``
    counts the former); a gap the source did not give is the recorded inter-arrival gap."""
    if columns.parent is None:
        return None
    parent = columns.parent.copy()
    late = parent >= np.arange(len(parent))
    if late.any():
        params["session_links_cut"] = int(late.sum())
        parent[late] = -1
    if not np.any(parent >= 0):
        return None
    gap = columns.gap_ms.copy()
    derived = np.isnan(gap) & (parent >= 0)
    gap[derived] = columns.arrival_ms[derived] - columns.arrival_ms[parent[derived]]
    gap[parent < 0] = 0.0
    gap = np.maximum(gap, 0.0)
    given = (parent >= 0) & ~derived
    gap_from = "inter-arrival" if not given.any() else "trace" if not derived.any() else "mixed"
    return build_graph(parent, gap, gap_from)


def source_file(spec: str) -> str | None:
    """The file a workload spec reads (its PATH, without rule options), or None for a generator."""
    if not isinstance(spec, str):
        return None
    kind, _, rest = spec.partition(":")
    if kind not in FILE_READERS:
        return None
    return _split_rule_options(spec, kind, rest)[0] or None


def _split_rule_options(spec: str, kind: str, rest: str) -> tuple[str, dict]:
    """PATH and the block-rule options of ``KIND:PATH[:key=value,...]`` (blockrule.OPTIONS).

    The part after the last colon is options when it holds an ``=`` and no ``/``; a file whose
    name ends so is named with a trailing colon, an empty option list (``KIND:PATH:``)."""
    head, sep, tail = rest.rpartition(":")
    if not sep or "/" in tail or ("=" not in tail and tail):
        return rest, {}
    options: dict = {}
    for item in tail.split(",") if tail else []:
        key, has_value, value = (part.strip() for part in item.partition("="))
        if not has_value or not key:
            raise ConfigError(f"{kind}: expected key=value in the block-rule options of {spec!r}, got {item!r}")
        if key not in blockrule.OPTIONS:
            raise ConfigError(f"{kind}: unknown block-rule option {key!r}; known: {', '.join(blockrule.OPTIONS)}")
        if key in options:
            raise ConfigError(f"{kind}: block-rule option {key!r} given twice")
        try:
            options[key] = blockrule.parse_value(key, value)
        except ValueError as e:
            raise ConfigError(f"{kind}: {e}") from None
    return head, options


def _rule_for(reader: "FileReader", options: dict, hash_block_tokens: int | None) -> tuple[BlockRule, frozenset]:
    """The reader's default rule with the spec's options (and --hash-block-tokens) applied."""
    if hash_block_tokens is not None:
        if "block_tokens" in reader.fixed:
            raise ConfigError(f"{reader.name}: {reader.name} traces carry no prefix information, "
                              f"so hash_block_tokens does not apply")
        if options.get("block_tokens", hash_block_tokens) != hash_block_tokens:
            raise ConfigError(f"{reader.name}: block_tokens={options['block_tokens']} and hash_block_tokens="
                              f"{hash_block_tokens} disagree; give one")
        options = {**options, "block_tokens": hash_block_tokens}
    fixed = [k for k in options if k in reader.fixed]
    if fixed:
        raise ConfigError(f"{reader.name}: block-rule option {', '.join(fixed)} does not apply to "
                          f"{reader.name} traces (docs/workloads.md)")
    if options.get("scope") == "local" and reader.local_unit is None:
        raise ConfigError(f"{reader.name}: scope=local needs sessions, which {reader.name} traces do not have")
    rule = dataclasses.replace(reader.rule, **options)
    problem = rule.problem()
    if problem:
        raise ConfigError(f"{reader.name}: {problem}")
    return rule, frozenset(options)


def _check_selection_options(max_requests, window_ms, hash_block_tokens) -> None:
    if max_requests is not None and (not _is_int(max_requests) or max_requests < 1):
        raise ConfigError(f"max_requests must be a positive integer, got {max_requests!r}")
    if hash_block_tokens is not None and (not _is_int(hash_block_tokens) or hash_block_tokens < 1):
        raise ConfigError(f"hash_block_tokens must be a positive integer, got {hash_block_tokens!r}")
    if window_ms is not None:
        ok = (isinstance(window_ms, (tuple, list)) and len(window_ms) == 2
              and all(map(_is_real, window_ms)) and math.isfinite(window_ms[0])
              and window_ms[0] < window_ms[1] and not math.isnan(window_ms[1]))
        if not ok:
            raise ConfigError(f"window_ms must be (start, end) with a finite start < end "
                              f"(end may be infinity), got {window_ms!r}")


def _select(source: str, columns: RequestColumns, max_requests: int | None,
            window_ms: tuple[float, float] | None) -> tuple[RequestColumns, dict]:
    """Sort into arrival order, apply the window then the count limit, rebase time to 0.0."""
    arrival = columns.arrival_ms
    total = len(arrival)
    # A request is out of order when some request listed before it arrives later.
    out_of_order = int(np.count_nonzero(arrival[1:] < np.maximum.accumulate(arrival)[:-1]))
    if out_of_order:
        columns = _take_rows(columns, np.argsort(arrival, kind="stable"))
    since_first = columns.arrival_ms - columns.arrival_ms[0]
    if not since_first[-1] <= MAX_ARRIVAL_SPAN_MS:  # not: an infinite difference of huge stamps too
        late = int(np.argmax(~(since_first <= MAX_ARRIVAL_SPAN_MS)))
        raise WorkloadError(f"{source}: timestamps span more than {span_text(MAX_ARRIVAL_SPAN_MS)} (request "
                            f"{late} in arrival order arrives {span_text(since_first[late])} after the first), "
                            f"beyond kvemu's nanosecond clock; use --window-ms or --max-requests")
    lo, hi = 0, total
    if window_ms is not None:
        # Sorted times make the window one contiguous slice.
        lo, hi = (int(k) for k in np.searchsorted(since_first, window_ms, side="left"))
    if max_requests is not None:
        hi = min(hi, lo + max_requests)
    if hi <= lo:
        raise WorkloadError(f"{source}: no requests left after window_ms={window_ms} and "
                            f"max_requests={max_requests} (the source has {total} requests "
                            f"over {since_first[-1]:.3f} ms)")
    offsets = columns.hash_offsets[lo : hi + 1]
    offset_ms = float(since_first[lo])
    kept = RequestColumns(
        arrival_ms=since_first[lo:hi] - offset_ms,
        input_tokens=columns.input_tokens[lo:hi].copy(),
        output_tokens=columns.output_tokens[lo:hi].copy(),
        hash_offsets=offsets - offsets[0],
        hash_ids=columns.hash_ids[offsets[0] : offsets[-1]].copy(),
        parent=None if columns.parent is None else np.where(columns.parent[lo:hi] >= lo, columns.parent[lo:hi] - lo, -1),
        gap_ms=None if columns.gap_ms is None else columns.gap_ms[lo:hi].copy(),
    )
    window = None
    if window_ms is not None:
        # An open end is written as null: params stay strict JSON, which has no infinity.
        start_ms, end_ms = float(window_ms[0]), float(window_ms[1])
        window = [start_ms, end_ms if math.isfinite(end_ms) else None]
    selection = {
        "source_requests": total,
        "sorted": bool(out_of_order),
        "out_of_order": out_of_order,
        "window_ms": window,
        "max_requests": None if max_requests is None else int(max_requests),
        "time_offset_ms": offset_ms,
    }
    return kept, selection


def _take_rows(columns: RequestColumns, rows: np.ndarray) -> RequestColumns:
    """The requests ``rows`` (an index array) in that order, hash rows gathered along."""
    lengths = np.diff(columns.hash_offsets)[rows]
    offsets = _offsets_from_counts(lengths)
    # Each output hash position maps back to its row's old start plus its place in the row.
    shift = np.repeat(columns.hash_offsets[:-1][rows] - offsets[:-1], lengths)
    parent = gap = None
    if columns.parent is not None:  # parents renumbered to the new rows; one not taken: none
        new_row = np.full(len(columns.arrival_ms), -1, np.int64)
        new_row[rows] = np.arange(len(rows))
        old = columns.parent[rows]
        parent, gap = np.where(old >= 0, new_row[np.maximum(old, 0)], -1), columns.gap_ms[rows]
    return RequestColumns(columns.arrival_ms[rows], columns.input_tokens[rows], columns.output_tokens[rows],
                          offsets, columns.hash_ids[shift + np.arange(offsets[-1])], parent, gap)


def _offsets_from_counts(counts: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


# ---------------------------------------------------------------------------------------------
# File readers and generators both come back with (columns, checksum, hash_block_tokens, params);
# readers report bad data as one line "PATH:LINE: what is wrong".

_Loaded = tuple[RequestColumns, str, int | None, dict]


class _Raw(NamedTuple):
    """What a file reader returns: requests as the file gives them, before the block rule's cap,
    scope and partial blocks are applied (`_apply_rule`)."""

    columns: RequestColumns  # a request lists at most ceil(input / block) hashes, its leading blocks'
    scope: np.ndarray | None  # int64 per request: its local scope (trace, session, instance); None: none
    lines: np.ndarray  # the line each request was read from (messages)
    checksum: str
    params: dict
    rule: BlockRule  # the rule as applied


@dataclass(frozen=True)
class FileReader:
    """A registered file format: ``read(path, rule, given) -> _Raw`` and its conventions."""

    name: str
    read: Callable[[Path, BlockRule, frozenset], _Raw]
    rule: BlockRule  # the format's own conventions, the defaults of its options
    local_unit: str | None  # what scope=local scopes hashes to; None: the format has no sessions
    fixed: tuple[str, ...]  # rule options the format does not take


#: Every file format ``--workload KIND:PATH`` reads, by KIND (`register_reader`).
FILE_READERS: dict[str, FileReader] = {}


def register_reader(name: str, *, rule: BlockRule, local_unit: str | None = None,
                    fixed: tuple[str, ...] = ()) -> Callable:
    """Decorator adding a file reader under ``name`` (``--workload NAME:PATH``); duplicates are refused.

    The reader is called as ``fn(path, rule, given)``: the block rule to read with (``rule``, its
    defaults overridden by the options the spec gave, whose names are in ``given``) and returns
    `_Raw`. ``local_unit`` names what ``scope=local`` scopes hashes to (the reader fills
    ``_Raw.scope``); ``fixed`` lists rule options the format refuses.
    """
    problem = rule.problem()
    if problem:
        raise ValueError(f"reader {name!r}: {problem}")

    def add(fn: Callable) -> Callable:
        if name in FILE_READERS or name == "synthetic":
            raise ValueError(f"workload reader {name!r} is already registered")
        FILE_READERS[name] = FileReader(name, fn, rule, local_unit, tuple(fixed))
        return fn
    return add


def _apply_rule(path: Path, raw: _Raw) -> tuple[RequestColumns, dict]:
    """The block rule applied to what a reader read: the context cap, the count of hashes (at most
    ceil(input / block), the rest of a prompt being its own), the scope, and partial blocks. Every
    request comes out with exactly ceil(input / block) ids; a block that may not match any other
    request's gets a fresh id."""
    rule, cols, lines = raw.rule, raw.columns, raw.lines
    inp = cols.input_tokens.copy()
    params: dict = {}
    B = rule.block_tokens
    counts = np.diff(cols.hash_offsets)
    if B is not None:
        most = -(-inp // B)
        _refuse_first(counts > most, lines, path, lambda i: (
            f"{counts[i]} block hashes for {inp[i]} input tokens, more than ceil({inp[i]} / {B}) = {most[i]}"))
    cut = np.zeros(len(inp), bool)
    scope = raw.scope
    if rule.context_cap is not None:
        over = inp > rule.context_cap
        if rule.truncate == "drop":
            params["dropped_over_cap"] = int(over.sum())
            if over.all():
                raise WorkloadError(f"{path}: every request's prompt is over context_cap={rule.context_cap}")
            keep = np.flatnonzero(~over)
            cols = _take_rows(cols, keep)
            inp, lines, counts = cols.input_tokens.copy(), lines[keep], np.diff(cols.hash_offsets)
            scope = None if scope is None else scope[keep]
        else:
            params["truncated_over_cap"] = int(over.sum())
            inp = np.minimum(inp, rule.context_cap)
            cut = over
    if B is None:
        return cols._replace(input_tokens=inp), params
    ids = cols.hash_ids
    if rule.scope == "local" and scope is not None and len(ids):
        owner = np.repeat(scope, counts)
        pairs = np.stack([owner, ids], axis=1)
        _, ids = np.unique(pairs, axis=0, return_inverse=True)
        ids = ids.reshape(-1).astype(np.int64)
    need = -(-inp // B)
    listed_counts = np.minimum(counts, need)
    offsets = _offsets_from_counts(need)
    req = np.repeat(np.arange(len(inp)), need)
    pos = np.arange(int(offsets[-1])) - offsets[req]
    listed = pos < listed_counts[req]
    out = np.zeros(int(offsets[-1]), np.int64)
    out[listed] = ids[cols.hash_offsets[req[listed]] + pos[listed]]
    last_partial = (pos == need[req] - 1) & (inp[req] % B != 0)
    private = ~listed | (last_partial & (cut[req] | (not rule.partial)))
    padded = int(np.count_nonzero(~listed))
    if padded:
        params["unhashed_blocks"] = padded
    if private.any():
        _, dense = np.unique(out[~private], return_inverse=True)
        out[~private] = dense.reshape(-1)
        out[private] = int(dense.max(initial=-1)) + 1 + np.arange(int(private.sum()))
    return cols._replace(input_tokens=inp, hash_offsets=offsets, hash_ids=out), params


def _read_source(path: Path) -> tuple[bytes, str]:
    why = not_regular(path)
    if why:
        raise WorkloadError(f"{path}: {why}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read ({e.strerror or e})") from None
    return data, "sha256:" + hashlib.sha256(data).hexdigest()


def _refuse_first(bad: np.ndarray, lines: np.ndarray, path: Path, describe: Callable[[int], str]) -> None:
    """Raise WorkloadError naming the first row where ``bad`` holds; checks run column-wise."""
    if bad.any():
        i = int(np.argmax(bad))
        raise WorkloadError(f"{path}:{lines[i]}: {describe(i)}")


def _show(value: Any) -> str:
    """A value for an error message: its repr, cut short so the message stays one line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True is not a token count.
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return _is_int(value) or isinstance(value, (float, np.floating))


_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@register_reader("mooncake", rule=BlockRule(MOONCAKE_BLOCK_TOKENS, "global", True, "ms"))
def _read_mooncake(path: Path, rule: BlockRule, given: frozenset) -> _Raw:
    """Mooncake JSONL. Blank lines are skipped; line numbers count every line of the file."""
    block_tokens = rule.block_tokens
    data, checksum = _read_source(path)
    timestamps: list[int | float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    id_counts: list[int] = []
    flat_ids: list[int] = []
    line_numbers: list[int] = []
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{line_no}"
        record = _json_object(raw, where)
        missing = [f for f in _MOONCAKE_FIELDS if f not in record]
        if missing:
            raise WorkloadError(f"{where}: missing field {', '.join(map(repr, missing))}")
        ts, n_in, n_out, ids = (record[f] for f in _MOONCAKE_FIELDS)
        # Exact type tests: JSON gives int, float, str, bool, None, list or dict, and bool is an int.
        if type(ts) not in (int, float) or (type(ts) is int and abs(ts) > _INT64_MAX):
            raise WorkloadError(f"{where}: 'timestamp' must be a number of ms, got {_show(ts)}")
        for name, value in (("input_length", n_in), ("output_length", n_out)):
            if type(value) is not int or abs(value) > _INT64_MAX:
                raise WorkloadError(f"{where}: {name!r} must be an integer token count, got {_show(value)}")
        if type(ids) is not list or not all(type(h) is int for h in ids):
            raise WorkloadError(f"{where}: 'hash_ids' must be a list of integers, got {_show(ids)}")
        timestamps.append(ts)
        inputs.append(n_in)
        outputs.append(n_out)
        id_counts.append(len(ids))
        flat_ids.extend(ids)
        line_numbers.append(line_no)
    if not line_numbers:
        raise WorkloadError(f"{path}: empty file, no requests")

    # Value checks run column-wise on the arrays and name the first offending line.
    lines = np.array(line_numbers)
    ts = np.array(timestamps, dtype=np.float64)
    n_in = np.array(inputs, dtype=np.int64)
    n_out = np.array(outputs, dtype=np.int64)
    counts = np.array(id_counts, dtype=np.int64)
    _refuse_first(~np.isfinite(ts), lines, path, lambda i: f"'timestamp' must be finite, got {ts[i]}")
    _refuse_first(n_in < 1, lines, path, lambda i: f"'input_length' must be >= 1, got {n_in[i]}")
    _refuse_first(n_out < 0, lines, path, lambda i: f"'output_length' must be >= 0, got {n_out[i]}")
    needed = -(-n_in // block_tokens)
    _refuse_first(counts != needed, lines, path, lambda i: (
        f"'hash_ids' has {counts[i]} entries but input_length {n_in[i]} needs "
        f"ceil({n_in[i]} / {block_tokens}) = {needed[i]}"))
    offsets = _offsets_from_counts(counts)
    try:
        ids = np.array(flat_ids, dtype=np.int64)
    except OverflowError:
        first_bad = next(k for k, h in enumerate(flat_ids) if not -_INT64_MAX - 1 <= h <= _INT64_MAX)
        row = int(np.searchsorted(offsets, first_bad, side="right")) - 1
        raise WorkloadError(f"{path}:{lines[row]}: hash id {_show(flat_ids[first_bad])} "
                            f"does not fit in 64 bits") from None
    zero_output = n_out == 0
    n_out[zero_output] = 1
    first = int(np.argmin(ts))
    columns = RequestColumns((ts - ts[first]) * blockrule.TIME_UNITS[rule.time_unit], n_in, n_out, offsets, ids)
    params = {"time_origin": timestamps[first], "output_zero_clamped": int(zero_output.sum())}
    return _Raw(columns, None, lines, checksum, params, rule)


def _json_object(raw: bytes, where: str) -> dict:
    try:
        # Decode explicitly: json.loads(bytes) would guess UTF-16/32 from the first bytes.
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        # Integers beyond Python's digit limit, or nesting deeper than the parser recurses.
        raise WorkloadError(f"{where}: malformed JSON ({type(e).__name__}: {_show(str(e))})") from None
    if not isinstance(record, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(record).__name__}")
    return record


_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# Azure writes "2023-11-16 18:17:03.9799600". numpy's own parser also takes "now", "NaT" and bare
# years, and wraps years outside 1678..2262 silently at ns resolution, so the shape is checked
# here and whole seconds and the fraction are converted apart.
_AZURE_TIMESTAMP = re.compile(
    r"([0-9]{4}-[0-9]{2}-[0-9]{2})[ T]([0-9]{2}:[0-9]{2}:[0-9]{2})(?:\.([0-9]{1,9}))?")
_DECIMAL = re.compile(r"[+-]?[0-9]{1,18}")  # 18 digits always fit in int64


@register_reader("azure", rule=BlockRule(None, "global", False, "s"),
                 fixed=("block_tokens", "scope", "partial", "time_unit"))
def _read_azure(path: Path, rule: BlockRule, given: frozenset) -> _Raw:
    """Azure LLM inference CSV. The first non-blank row is the header; extra columns are ignored."""
    data, checksum = _read_source(path)
    # Spreadsheet exports often start with a byte-order mark; it is not part of the header.
    body = data.removeprefix(codecs.BOM_UTF8)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        line = body.count(b"\n", 0, e.start) + 1
        raise WorkloadError(f"{path}:{line}: not UTF-8 ({e.reason})") from None

    header: list[str] | None = None
    wanted: list[int] = []
    seconds: list[str] = []
    fraction_ns: list[int] = []
    stamps: list[str] = []
    contexts: list[int] = []
    generated: list[int] = []
    line_numbers: list[int] = []
    reader = csv.reader(io.StringIO(text, newline=""))
    row_start = 1
    try:
        for row in reader:
            # A quoted field may span lines; messages name the line where the row starts.
            start, row_start = row_start, reader.line_num + 1
            where = f"{path}:{start}"
            if not row or (len(row) == 1 and not row[0].strip()):
                continue  # a blank line; a row of empty fields is still checked
            if header is None:
                header = [field.strip() for field in row]
                missing = [c for c in _AZURE_COLUMNS if c not in header]
                if missing:
                    raise WorkloadError(f"{where}: header is missing column {', '.join(map(repr, missing))} "
                                        f"(found {_show(header)})")
                wanted = [header.index(c) for c in _AZURE_COLUMNS]
                continue
            if len(row) != len(header):
                raise WorkloadError(f"{where}: expected {len(header)} fields as in the header, "
                                    f"got {len(row)}")
            stamp, context, gen = (row[k].strip() for k in wanted)
            match = _AZURE_TIMESTAMP.fullmatch(stamp)
            if not match:
                raise WorkloadError(f"{where}: unparsable TIMESTAMP {_show(stamp)}, "
                                    f"expected YYYY-MM-DD HH:MM:SS[.fraction]")
            for name, value in (("ContextTokens", context), ("GeneratedTokens", gen)):
                if not _DECIMAL.fullmatch(value):
                    raise WorkloadError(f"{where}: {name} must be an integer token count, got {_show(value)}")
            date, clock, fraction = match.groups()
            seconds.append(f"{date}T{clock}")
            fraction_ns.append(int((fraction or "").ljust(9, "0")))
            stamps.append(stamp)
            contexts.append(int(context))
            generated.append(int(gen))
            line_numbers.append(start)
    except csv.Error as e:
        raise WorkloadError(f"{path}:{reader.line_num}: malformed CSV ({e})") from None
    if header is None:
        raise WorkloadError(f"{path}: empty file, no header")
    if not line_numbers:
        raise WorkloadError(f"{path}: no requests after the header")

    lines = np.array(line_numbers)
    try:
        whole_s = np.array(seconds, dtype="datetime64[s]").astype(np.int64)
    except ValueError:
        # Well-shaped but impossible (month 13, hour 24): find the row to name it.
        for text_s, line in zip(seconds, lines):
            try:
                np.datetime64(text_s, "s")
            except ValueError as e:
                raise WorkloadError(f"{path}:{line}: unparsable TIMESTAMP ({e})") from None
        raise WorkloadError(f"{path}: unparsable TIMESTAMP column") from None
    context_tokens = np.array(contexts, dtype=np.int64)
    generated_tokens = np.array(generated, dtype=np.int64)
    _refuse_first(context_tokens < 1, lines, path,
                  lambda i: f"ContextTokens must be >= 1, got {context_tokens[i]}")
    _refuse_first(generated_tokens < 0, lines, path,
                  lambda i: f"GeneratedTokens must be >= 0, got {generated_tokens[i]}")
    zero_output = generated_tokens == 0
    generated_tokens[zero_output] = 1
    # ms since the first row, from exact integer seconds and nanoseconds; then from the earliest.
    frac = np.array(fraction_ns, dtype=np.int64)
    since_row0 = (whole_s - whole_s[0]) * 1000.0 + (frac - frac[0]) / 1e6
    first = int(np.argmin(since_row0))
    n = len(lines)
    columns = RequestColumns(since_row0 - since_row0[first], context_tokens, generated_tokens,
                             np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64))
    params = {"time_origin": stamps[first], "output_zero_clamped": int(zero_output.sum())}
    return _Raw(columns, None, lines, checksum, params, rule)


# ---------------------------------------------------------------------------------------------
# Synthetic workloads

SYNTHETIC_WORKLOADS: dict[str, Callable[..., RequestColumns]] = {}


def register_synthetic(name: str) -> Callable:
    """Decorator adding a generator to `SYNTHETIC_WORKLOADS` under ``name``; duplicates are refused.

    A generator is called as ``fn(rng, hash_block_tokens, **knobs)`` with a numpy Generator and
    returns `RequestColumns`. Its knobs are its keyword-only parameters; their int or float
    defaults are the defaults, and give the type that ``key=value`` text in a spec is parsed as.
    """
    def add(generator: Callable[..., RequestColumns]) -> Callable[..., RequestColumns]:
        if name in SYNTHETIC_WORKLOADS:
            raise ValueError(f"synthetic workload {name!r} is already registered")
        _knob_defaults(generator)  # a malformed signature fails here, at import, not at first use
        SYNTHETIC_WORKLOADS[name] = generator
        return generator
    return add


def _knob_defaults(generator: Callable) -> dict[str, int | float]:
    knobs = {p.name: p.default for p in inspect.signature(generator).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY}
    bad = [k for k, default in knobs.items() if type(default) not in (int, float)]
    if bad:
        raise TypeError(f"synthetic generator {generator.__name__}: knobs {bad} need int or float defaults")
    return knobs


def _generate(name: str, knob_text: str, hash_block_tokens: int | None, seed: int) -> _Loaded:
    if name not in SYNTHETIC_WORKLOADS:
        known = ", ".join(sorted(SYNTHETIC_WORKLOADS))
        raise ConfigError(f"unknown synthetic workload {name!r}; known: {known}")
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    generator = SYNTHETIC_WORKLOADS[name]
    knobs = _parse_knobs(name, knob_text, _knob_defaults(generator))
    block_tokens = SYNTHETIC_BLOCK_TOKENS if hash_block_tokens is None else hash_block_tokens
    try:
        columns = generator(np.random.default_rng(seed), block_tokens, **knobs)
    except ConfigError as e:
        raise ConfigError(f"synthetic:{name}: {e}") from None
    digest = hashlib.sha256()
    # Fixed byte order and a length before each array, so the checksum names the arrays alone.
    for array, dtype in zip(columns, ("<f8", "<i8", "<i8", "<i8", "<i8")):
        digest.update(len(array).to_bytes(8, "little"))
        digest.update(np.ascontiguousarray(array, dtype=dtype).tobytes())
    return columns, "sha256:" + digest.hexdigest(), block_tokens, {"seed": int(seed), "knobs": knobs}


def _parse_knobs(name: str, text: str, defaults: dict[str, int | float]) -> dict[str, int | float]:
    knobs = dict(defaults)
    given: set[str] = set()
    for item in text.split(",") if text else []:
        key, has_value, value = (part.strip() for part in item.partition("="))
        if not has_value or not key:
            raise ConfigError(f"synthetic:{name}: expected key=value, got {item!r}")
        if key not in defaults:
            raise ConfigError(f"synthetic:{name}: unknown knob {key!r}; known: {', '.join(defaults)}")
        if key in given:
            raise ConfigError(f"synthetic:{name}: knob {key!r} given twice")
        given.add(key)
        if isinstance(defaults[key], int):
            if not _DECIMAL.fullmatch(value):
                raise ConfigError(f"synthetic:{name}: {key} must be an integer, got {value!r}")
            knobs[key] = int(value)
        else:
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not math.isfinite(number):
                raise ConfigError(f"synthetic:{name}: {key} must be a finite number, got {value!r}")
            knobs[key] = number
    return knobs


def _require(ok: bool, knob: str, value: int | float, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{knob}={value} must be {expected}")


def _poisson_arrivals_s(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    """Arrival times (s) of a Poisson process, the first one at 0."""
    gaps = rng.exponential(1.0 / rate_per_s, size=n)
    return np.cumsum(gaps) - gaps[0]


def _lognormal_tokens(rng: np.random.Generator, median: int, sigma: float, shape) -> np.ndarray:
    draws = np.rint(rng.lognormal(math.log(median), sigma, size=shape))
    # Clip before the cast: a far tail draw would otherwise wrap around in int64.
    return np.clip(draws, 1, _MAX_SYNTHETIC_PROMPT_TOKENS).astype(np.int64)


def _requests_in_arrival_order(arrival_s: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray,
                               stream: np.ndarray, shared_tokens: np.ndarray, common_tokens: int,
                               block_tokens: int) -> RequestColumns:
    """Sort generated requests by arrival and give their prompt blocks chained ids.

    Request i's first ``shared_tokens[i]`` prompt tokens are a prefix of the append-only token
    stream ``stream[i]`` (a conversation, a document), whose first ``common_tokens`` tokens are the
    same in every stream (a system prompt); the rest of the prompt is the request's own. A full
    block inside the shared part is named by (stream, block index), or by block index alone inside
    the common part, so every request that reaches the block reuses its id. Any other block, the
    request's own tokens or a trailing partial block whose content changes as the stream grows,
    gets a fresh id. Ids are numbered 0, 1, ... in order of first appearance, like Mooncake's.
    """
    order = np.argsort(arrival_s, kind="stable")
    input_tokens, stream, shared_tokens = input_tokens[order], stream[order], shared_tokens[order]
    longest = int(input_tokens.max())
    _require(longest <= _MAX_SYNTHETIC_PROMPT_TOKENS, "longest prompt", longest,
             f"<= {_MAX_SYNTHETIC_PROMPT_TOKENS} tokens")
    n_blocks = -(-input_tokens // block_tokens)
    offsets = _offsets_from_counts(n_blocks)
    total = int(offsets[-1])
    _require(total <= _MAX_SYNTHETIC_HASH_IDS, "hash ids", total, f"<= {_MAX_SYNTHETIC_HASH_IDS}")
    row = np.repeat(np.arange(len(order)), n_blocks)
    block = np.arange(total) - offsets[row]
    block_end = (block + 1) * block_tokens
    owner = np.where(block_end <= common_tokens, -1, stream[row])
    named = block_end <= shared_tokens[row]
    # Named blocks get non-negative keys, equal for every request reaching the same block; every
    # other block gets a distinct negative key and so an id of its own.
    key = np.where(named, (owner + 1) * (int(n_blocks.max()) + 1) + block, -1 - np.arange(total))
    _, first_seen, inverse = np.unique(key, return_index=True, return_inverse=True)
    rank = np.empty(len(first_seen), dtype=np.int64)
    rank[np.argsort(first_seen)] = np.arange(len(first_seen))
    arrival_ms = (arrival_s[order] - arrival_s[order[0]]) * 1000.0
    return RequestColumns(arrival_ms, input_tokens, output_tokens[order], offsets, rank[inverse.reshape(-1)])


@register_synthetic("chat")
def chat_workload(rng: np.random.Generator, hash_block_tokens: int, *, sessions: int = 16, turns: int = 6,
                  system_tokens: int = 1024, user_tokens: int = 200, output_tokens: int = 250,
                  max_output_tokens: int = 1024, sigma: float = 0.5, rate: float = 1.0,
                  think_s: float = 8.0) -> RequestColumns:
    """Multi-turn chat: every turn's prompt is the whole conversation so far.

    ``sessions`` conversations of ``turns`` turns each start as a Poisson process of ``rate``
    sessions/s. Every prompt opens with the same ``system_tokens``-token system prompt; turn k's
    prompt is the system prompt, all earlier user messages and replies, and the new message, so
    earlier turns' full blocks (replies included) are a shared prefix of later ones. Message and
    reply lengths are lognormal with medians ``user_tokens`` and ``output_tokens`` and log-sd
    ``sigma``; replies are capped at ``max_output_tokens``. A turn arrives an exponential think time
    (mean ``think_s`` s) after the previous turn arrived: when that turn finishes depends on the
    engine, which a workload cannot know.
    """
    _require(sessions >= 1, "sessions", sessions, ">= 1")
    _require(turns >= 1, "turns", turns, ">= 1")
    _require(sessions * turns <= _MAX_SYNTHETIC_REQUESTS, "sessions*turns", sessions * turns,
             f"<= {_MAX_SYNTHETIC_REQUESTS}")
    _require(system_tokens >= 0, "system_tokens", system_tokens, ">= 0")
    _require(user_tokens >= 1, "user_tokens", user_tokens, ">= 1")
    _require(output_tokens >= 1, "output_tokens", output_tokens, ">= 1")
    _require(max_output_tokens >= 1, "max_output_tokens", max_output_tokens, ">= 1")
    _require(0 <= sigma <= 3, "sigma", sigma, "between 0 and 3")  # beyond 3 lengths explode
    _require(rate > 0, "rate", rate, "> 0")
    _require(think_s >= 0, "think_s", think_s, ">= 0")
    start_s = _poisson_arrivals_s(rng, sessions, rate)
    user = _lognormal_tokens(rng, user_tokens, sigma, (sessions, turns))
    reply = np.minimum(_lognormal_tokens(rng, output_tokens, sigma, (sessions, turns)), max_output_tokens)
    think = rng.exponential(think_s, size=(sessions, turns - 1))
    arrival_s = start_s[:, None] + np.concatenate((np.zeros((sessions, 1)), np.cumsum(think, axis=1)), axis=1)
    # Turn k: system + (message + reply) of every turn up to k, less turn k's own reply.
    prompt = system_tokens + np.cumsum(user + reply, axis=1) - reply
    session = np.repeat(np.arange(sessions), turns)
    # The whole prompt is a prefix of the session's conversation, so all of it may be shared.
    return _requests_in_arrival_order(arrival_s.ravel(), prompt.ravel(), reply.ravel(), session,
                                      prompt.ravel(), system_tokens, hash_block_tokens)


@register_synthetic("docqa")
def docqa_workload(rng: np.random.Generator, hash_block_tokens: int, *, documents: int = 8,
                   doc_tokens: int = 8192, doc_jitter: float = 0.25, questions: int = 12,
                   question_min_tokens: int = 20, question_max_tokens: int = 120,
                   output_min_tokens: int = 50, output_max_tokens: int = 300,
                   rate: float = 2.0) -> RequestColumns:
    """Long-document QA: many short questions about a few long documents.

    ``documents`` documents of ``doc_tokens`` tokens (times a uniform factor in
    1 +/- ``doc_jitter``) get ``questions`` questions each; a prompt is its document followed by
    the question, so all questions of a document share the document's full blocks. Question and
    reply lengths are uniform in their inclusive ranges. Questions arrive as one Poisson process of
    ``rate`` requests/s in a random order, so questions about different documents interleave.
    """
    _require(documents >= 1, "documents", documents, ">= 1")
    _require(questions >= 1, "questions", questions, ">= 1")
    _require(documents * questions <= _MAX_SYNTHETIC_REQUESTS, "documents*questions", documents * questions,
             f"<= {_MAX_SYNTHETIC_REQUESTS}")
    _require(doc_tokens >= 1, "doc_tokens", doc_tokens, ">= 1")
    _require(0 <= doc_jitter < 1, "doc_jitter", doc_jitter, "in [0, 1)")
    _require(question_min_tokens >= 1, "question_min_tokens", question_min_tokens, ">= 1")
    _require(question_max_tokens >= question_min_tokens, "question_max_tokens", question_max_tokens,
             f">= question_min_tokens ({question_min_tokens})")
    _require(output_min_tokens >= 1, "output_min_tokens", output_min_tokens, ">= 1")
    _require(output_max_tokens >= output_min_tokens, "output_max_tokens", output_max_tokens,
             f">= output_min_tokens ({output_min_tokens})")
    _require(rate > 0, "rate", rate, "> 0")
    n = documents * questions
    doc_len = np.maximum(1, np.rint(doc_tokens * rng.uniform(1 - doc_jitter, 1 + doc_jitter, size=documents)))
    doc_len = doc_len.astype(np.int64)
    doc = rng.permutation(np.repeat(np.arange(documents), questions))
    question = rng.integers(question_min_tokens, question_max_tokens, endpoint=True, size=n)
    reply = rng.integers(output_min_tokens, output_max_tokens, endpoint=True, size=n)
    arrival_s = _poisson_arrivals_s(rng, n, rate)
    return _requests_in_arrival_order(arrival_s, doc_len[doc] + question, reply, doc, doc_len[doc], 0,
                                      hash_block_tokens)


# ---------------------------------------------------------------------------------------------
# Agentic and session traces (docs/workloads.md gives each format's fields and sources)


def _jsonl(path: Path) -> tuple[list[tuple[int, dict]], str]:
    """(line, object) of every non-blank line of a JSONL file, and the file's checksum."""
    data, checksum = _read_source(path)
    records = [(n, _json_object(raw, f"{path}:{n}"))
               for n, raw in enumerate(data.split(b"\n"), start=1) if raw.strip()]
    if not records:
        raise WorkloadError(f"{path}: empty file, no requests")
    return records, checksum


def _field(record: dict, name: str, where: str, kind: str, *, default: Any = ..., lo: float | None = None):
    """``record[name]`` checked: kind "int" (a JSON integer), "num" (finite number), "ids" (list of
    integers), "str" (string or integer id, as text), "list" (list of ids as text)."""
    if name not in record or record[name] is None:
        if default is ...:
            raise WorkloadError(f"{where}: missing field {name!r}")
        return default
    v = record[name]
    if kind == "int":
        if type(v) is not int or abs(v) > _INT64_MAX:
            raise WorkloadError(f"{where}: {name!r} must be an integer, got {_show(v)}")
    elif kind == "num":
        if type(v) not in (int, float) or not math.isfinite(v) or abs(v) > _INT64_MAX:
            raise WorkloadError(f"{where}: {name!r} must be a finite number, got {_show(v)}")
    elif kind == "ids":
        if type(v) is not list or not all(type(h) is int and abs(h) <= _INT64_MAX for h in v):
            raise WorkloadError(f"{where}: {name!r} must be a list of 64-bit integers, got {_show(v)}")
        return v
    elif kind == "str":
        if type(v) not in (str, int):
            raise WorkloadError(f"{where}: {name!r} must be a string or an integer id, got {_show(v)}")
        return str(v)
    elif kind == "list":
        if type(v) is not list or not all(type(x) in (str, int) for x in v):
            raise WorkloadError(f"{where}: {name!r} must be a list of ids, got {_show(v)}")
        return [str(x) for x in v]
    if lo is not None and v < lo:
        raise WorkloadError(f"{where}: {name!r} must be >= {lo:g}, got {v}")
    return v


class _Rows:
    """Requests collected row by row, then made into `_Raw` (times in the source's unit)."""

    def __init__(self) -> None:
        self.t: list[float] = []
        self.inp: list[int] = []
        self.out: list[int] = []
        self.ids: list[list[int]] = []
        self.scope: list[int] = []
        self.lines: list[int] = []
        self.parent: list[int] = []   # the row a request continues, -1 at a root (kvemu.sessions)
        self.gap: list[float] = []    # after the parent completes, in the source's time unit; NaN: none given

    def add(self, t: float, inp: int, out: int, ids: list[int], scope: int, line: int, where: str,
            parent: int = -1, gap: float = math.nan) -> int:
        """Adds a request; returns its row."""
        if inp < 1:
            raise WorkloadError(f"{where}: input length must be >= 1, got {inp}")
        if out < 0:
            raise WorkloadError(f"{where}: output length must be >= 0, got {out}")
        self.t.append(t), self.inp.append(inp), self.out.append(out), self.ids.append(ids)
        self.scope.append(scope), self.lines.append(line)
        self.parent.append(parent), self.gap.append(gap)
        return len(self.t) - 1

    def raw(self, path: Path, checksum: str, rule: BlockRule, params: dict) -> _Raw:
        if not self.t:
            raise WorkloadError(f"{path}: no requests")
        first = min(range(len(self.t)), key=self.t.__getitem__)
        t0 = self.t[first]
        # exact differences first: integer ns timestamps since the epoch lose digits as floats
        t = np.array([x - t0 for x in self.t], np.float64)
        out = np.array(self.out, np.int64)
        zero = out == 0
        out[zero] = 1
        counts = np.array([len(x) for x in self.ids], np.int64)
        flat = np.fromiter((h for x in self.ids for h in x), np.int64, int(counts.sum()))
        unit_ms = blockrule.TIME_UNITS[rule.time_unit]
        parent = np.array(self.parent, np.int64)
        columns = RequestColumns(t * unit_ms, np.array(self.inp, np.int64), out,
                                 _offsets_from_counts(counts), flat,
                                 parent if np.any(parent >= 0) else None, np.array(self.gap, np.float64) * unit_ms)
        params = {"time_origin": self.t[first], "output_zero_clamped": int(zero.sum()), **params}
        return _Raw(columns, np.array(self.scope, np.int64), np.array(self.lines), checksum, params, rule)


def _declared(rule: BlockRule, given: frozenset, key: str, value, where: str) -> None:
    """A file that declares a rule value (SemiAnalysis ``block_size``) must agree with the rule,
    unless the spec set that option on purpose."""
    if value is not None and key not in given and value != getattr(rule, key):
        raise WorkloadError(f"{where}: the file declares {key}={value} but the reader's default is "
                            f"{getattr(rule, key)}; give {key}={value} in the spec (docs/workloads.md)")


@register_reader("semianalysis", rule=BlockRule(64, "local", True, "s"), local_unit="trace")
def _read_semianalysis(path: Path, rule: BlockRule, given: frozenset) -> _Raw:
    """SemiAnalysis x WEKA agentic coding traces: one trace object per line with ``requests`` of types
    ``n``, ``s`` (API calls) and ``subagent`` (with nested ``requests``); hashes scoped to the trace."""
    records, checksum = _jsonl(path)
    rows = _Rows()
    subagents = 0
    for k, (line, trace) in enumerate(records):
        where = f"{path}:{line}"
        main: tuple | None = None  # the trace's last API call: (row, t, api_time)
        requests = trace.get("requests")
        if type(requests) is not list:
            raise WorkloadError(f"{where}: a trace needs a list 'requests'")
        _declared(rule, given, "block_tokens", _field(trace, "block_size", where, "int", default=None), where)
        scope = trace.get("hash_id_scope")
        _declared(rule, given, "scope", scope if scope in (None, "local", "global") else "?", where)
        for j, r in enumerate(requests):
            w = f"{where}: requests[{j}]"
            if type(r) is not dict or r.get("type") not in ("n", "s", "subagent"):
                raise WorkloadError(f"{w}: expected a request of type 'n', 's' or 'subagent'")
            if r["type"] == "subagent":
                subagents += 1
                spawn = _field(r, "t", w, "num")
                inner = r.get("requests")
                if type(inner) is not list:
                    raise WorkloadError(f"{w}: a subagent needs a list 'requests'")
                prev = main  # a sub-agent's first call continues the call that spawned it
                for i, q in enumerate(inner):
                    wq = f"{w}.requests[{i}]"
                    if type(q) is not dict or q.get("type") not in ("n", "s"):
                        raise WorkloadError(f"{wq}: expected a request of type 'n' or 's'")
                    t = _field(q, "t", wq, "num")
                    # AIPerf's reading: a nested t before the spawn is relative to the spawn
                    t = spawn + t if t < spawn else t
                    prev = _semianalysis_call(rows, q, t, prev, k, line, wq)
                continue
            main = _semianalysis_call(rows, r, _field(r, "t", w, "num"), main, k, line, w)
    return rows.raw(path, checksum, rule, {"traces": len(records), "subagents": subagents})


def _semianalysis_call(rows: _Rows, r: dict, t: float, prev: tuple | None, k: int, line: int, where: str) -> tuple:
    """Adds one API call continuing ``prev`` (row, t, api_time) and returns its own. The gap after
    its parent completes: its ``think_time`` (s), else its start less the parent's start and
    ``api_time``, else none (the inter-arrival gap)."""
    api = _field(r, "api_time", where, "num", default=None, lo=0)
    think = _field(r, "think_time", where, "num", default=None, lo=0)
    gap = math.nan
    if prev is not None:
        gap = think if think is not None else (max(0.0, t - prev[1] - prev[2]) if prev[2] is not None else math.nan)
    row = rows.add(t, _field(r, "in", where, "int"), _field(r, "out", where, "int"),
                   _field(r, "hash_ids", where, "ids", default=[]), k, line, where,
                   -1 if prev is None else prev[0], gap)
    return row, t, api


@register_reader("bailian", rule=BlockRule(16, "global", True, "s"), local_unit="session")
def _read_bailian(path: Path, rule: BlockRule, given: frozenset) -> _Raw:
    """Qwen Bailian session JSONL: ``chat_id``, ``parent_chat_id`` (-1 at a session's root),
    ``timestamp`` (s), ``input_length``, ``output_length``, ``type``, ``turn``, ``hash_ids``."""
    records, checksum = _jsonl(path)
    parent: dict[str, str] = {}
    parsed = []
    for line, r in records:
        where = f"{path}:{line}"
        chat = _field(r, "chat_id", where, "str")
        if chat in parent:
            raise WorkloadError(f"{where}: chat_id {chat} appears twice")
        parent[chat] = _field(r, "parent_chat_id", where, "str", default="-1")
        _field(r, "turn", where, "int", default=None)
        parsed.append((line, where, chat, r))
    roots: dict[str, int] = {}

    def root(chat: str) -> str:
        seen = set()
        while parent.get(chat, "-1") != "-1" and parent[chat] in parent and chat not in seen:
            seen.add(chat)
            chat = parent[chat]
        return chat

    rows = _Rows()
    row_of: dict[str, int] = {chat: j for j, (_, _, chat, _) in enumerate(parsed)}
    for line, where, chat, r in parsed:
        session = roots.setdefault(root(chat), len(roots))
        # a follow-up continues its parent turn; Bailian records no think time: the inter-arrival gap
        rows.add(_field(r, "timestamp", where, "num"), _field(r, "input_length", where, "int"),
                 _field(r, "output_length", where, "int"), _field(r, "hash_ids", where, "ids", default=[]),
                 session, line, where, row_of.get(parent[chat], -1))
    followups = sum(1 for p in parent.values() if p != "-1")
    return rows.raw(path, checksum, rule, {"sessions": len(roots), "follow_up_turns": followups})


_AGENTIC_FIELDS = ("wait_for", "branches", "prefix_reset", "tool_wait_ms")


@register_reader("dynamo", rule=BlockRule(MOONCAKE_BLOCK_TOKENS, "global", True, "ms"), local_unit="session")
def _read_dynamo(path: Path, rule: BlockRule, given: frozenset) -> _Raw:
    """Dynamo's Mooncake-shaped session rows: ``agentic_mooncake`` (whole prompts, dependencies in
    ``wait_for``, ``delay`` and ``tool_wait_ms``) when any row has one of _AGENTIC_FIELDS, otherwise
    ``mooncake-delta`` (a follow-up turn's ``input_length`` and ``hash_ids`` are what it adds)."""
    records, checksum = _jsonl(path)
    agentic = any(any(f in r for f in _AGENTIC_FIELDS) for _, r in records)
    sessions: dict[str, int] = {}
    rows = _Rows()
    if agentic:
        dependent, tool_ms = 0, 0.0
        row_of = {_field(r, "request_id", f"{path}:{line}", "str", default=f"row{line}"): j
                  for j, (line, r) in enumerate(records)}
        unit_ms = blockrule.TIME_UNITS[rule.time_unit]
        for line, r in records:
            where = f"{path}:{line}"
            sid = _field(r, "session_id", where, "str", default=f"row{line}")
            waits = _field(r, "wait_for", where, "list", default=[])
            dependent += bool(waits)
            tool = _field(r, "tool_wait_ms", where, "num", default=0.0, lo=0)
            tool_ms += tool
            delay = _field(r, "delay", where, "num", default=0.0, lo=0)
            # dispatched delay + tool_wait_ms after its dependencies complete: kvemu keeps one parent,
            # the dependency listed last in the file (the latest to arrive)
            deps = [row_of[x] for x in waits if x in row_of]
            rows.add(_field(r, "timestamp", where, "num"), _field(r, "input_length", where, "int"),
                     _field(r, "output_length", where, "int"), _field(r, "hash_ids", where, "ids", default=[]),
                     sessions.setdefault(sid, len(sessions)), line, where,
                     max(deps) if deps else -1, (delay + tool) / unit_ms)
        return rows.raw(path, checksum, rule, {"dynamo_format": "agentic_mooncake", "sessions": len(sessions),
                                               "requests_with_dependencies": dependent, "tool_wait_ms": tool_ms})
    return _dynamo_delta(path, records, checksum, rule)


def _dynamo_delta(path: Path, records: list, checksum: str, rule: BlockRule) -> _Raw:
    """mooncake-delta: per session, turn k's prompt is turn k-1's prompt, its output and turn k's
    input delta, as Dynamo's replay accumulates them. Full blocks inside the first turn's input keep
    its hash ids; any other full block of the session's stream is named by (session, block); a
    partial last block is the request's own. A follow-up turn arrives ``delay`` ms after the previous
    turn's arrival unless it has a ``timestamp`` (the previous turn's end is unknown to a workload)."""
    B = rule.block_tokens
    state: dict[str, dict] = {}
    keys: dict[tuple, int] = {}
    rows = _Rows()
    for line, r in records:
        where = f"{path}:{line}"
        sid = _field(r, "session_id", where, "str", default=f"row{line}")
        delta = _field(r, "input_length", where, "int", lo=1)
        out = _field(r, "output_length", where, "int", lo=0)
        ids = _field(r, "hash_ids", where, "ids", default=[])
        s = state.get(sid)
        gap = math.nan
        if s is None:
            t = _field(r, "timestamp", where, "num")
            s = state[sid] = {"n": len(state), "first": ids, "first_len": delta, "prompt": 0, "t": t, "row": -1}
            prompt = delta
        else:
            t = _field(r, "timestamp", where, "num", default=None)
            if t is None:  # ``delay`` ms after the previous turn completes: the gap of the session loop
                gap = _field(r, "delay", where, "num", default=0.0, lo=0) / blockrule.TIME_UNITS[rule.time_unit]
                t = s["t"] + gap
            prompt = s["prompt"] + delta
        if len(s["first"]) > -(-s["first_len"] // B):
            raise WorkloadError(f"{where}: {len(s['first'])} block hashes for {s['first_len']} input tokens")
        blocks = []
        for j in range(-(-prompt // B)):
            end = (j + 1) * B
            if j < len(s["first"]) and (end <= s["first_len"] or prompt == s["first_len"]):
                key = ("hash", s["first"][j])  # the first turn's listed hashes, partial or not
            elif end > prompt:
                key = ("own", line)
            else:
                key = ("stream", s["n"], j)
            blocks.append(keys.setdefault(key, len(keys)))
        s["row"] = rows.add(t, prompt, out, blocks, s["n"], line, where, s["row"], gap)
        s["prompt"], s["t"] = prompt + out, t
    # scope=local renumbers the first turns' hashes per session (_apply_rule)
    return rows.raw(path, checksum, rule, {"dynamo_format": "mooncake-delta", "sessions": len(state)})


@register_reader("tair", rule=BlockRule(16, "global", False, "ns"), local_unit="instance")
def _read_tair(path: Path, rule: BlockRule, given: frozenset) -> _Raw:
    """tair-kvcache trace events: one per line, ``timestamp_ns`` (or ``timestamp_us`` in the
    optimizer's schema), ``instance_id``, ``keys`` (full blocks only), ``input_len``, ``output_len``."""
    records, checksum = _jsonl(path)
    unit_field = "timestamp_ns" if "timestamp_ns" in records[0][1] or "timestamp_us" not in records[0][1] \
        else "timestamp_us"
    if "time_unit" not in given and unit_field == "timestamp_us":
        rule = dataclasses.replace(rule, time_unit="us")
    instances: dict[str, int] = {}
    rows = _Rows()
    for line, r in records:
        where = f"{path}:{line}"
        keys = _field(r, "keys", where, "ids")
        n_in = _field(r, "input_len", where, "int", default=len(keys) * rule.block_tokens)
        rows.add(_field(r, unit_field, where, "num"), n_in, _field(r, "output_len", where, "int", default=0),
                 keys, instances.setdefault(_field(r, "instance_id", where, "str", default=""), len(instances)),
                 line, where)
    return rows.raw(path, checksum, rule, {"instances": len(instances), "time_field": unit_field})


@register_synthetic("agent")
def agent_workload(rng: np.random.Generator, hash_block_tokens: int, *, sessions: int = 8, turns: int = 10,
                   system_tokens: int = 4096, task_tokens: int = 400, tool_tokens: int = 800,
                   output_tokens: int = 200, max_output_tokens: int = 2048, sigma: float = 0.6,
                   rate: float = 0.2, tool_s: float = 3.0, subagent_prob: float = 0.2, subagents: int = 2,
                   subagent_turns: int = 4) -> RequestColumns:
    """Coding agents: a growing shared context, tool gaps, and sub-agents on branches of their own.

    ``sessions`` agents start as a Poisson process of ``rate`` sessions/s. Every prompt opens with
    the same ``system_tokens``-token system prompt and tool definitions; an agent's first prompt adds
    its task (lognormal, median ``task_tokens``), and each later turn appends the previous reply
    (median ``output_tokens``, capped at ``max_output_tokens``) and a tool result (median
    ``tool_tokens``), so turn k's prompt is the whole context so far. A turn arrives an exponential
    tool time (mean ``tool_s`` s) after the previous one arrived: when that one finishes depends on
    the engine. After a turn, with probability ``subagent_prob``, the agent spawns ``subagents``
    sub-agents at once: each branches off the context so far (its prompts share the agent's blocks
    up to the branch point) with a task of its own, and runs ``subagent_turns`` turns the same way;
    the agent's next turn arrives after the last of them plus a tool time. Log-sd ``sigma``. Each
    turn's parent (kvemu.sessions) is the turn it follows (a sub-agent's first turn: the turn that
    spawned it; the agent's turn after its sub-agents: the last turn of the last to finish), its gap
    the tool time drawn.
    """
    _require(sessions >= 1, "sessions", sessions, ">= 1")
    _require(turns >= 1, "turns", turns, ">= 1")
    _require(subagents >= 0 and subagent_turns >= 1, "subagents", subagents, ">= 0 (subagent_turns >= 1)")
    _require(sessions * turns * (1 + subagents * subagent_turns) <= _MAX_SYNTHETIC_REQUESTS // 10,
             "sessions*turns*(1+subagents*subagent_turns)", sessions * turns * (1 + subagents * subagent_turns),
             f"<= {_MAX_SYNTHETIC_REQUESTS // 10}")
    for knob, value in (("task_tokens", task_tokens), ("tool_tokens", tool_tokens),
                        ("output_tokens", output_tokens), ("max_output_tokens", max_output_tokens)):
        _require(value >= 1, knob, value, ">= 1")
    _require(system_tokens >= 0, "system_tokens", system_tokens, ">= 0")
    _require(0 <= sigma <= 3, "sigma", sigma, "between 0 and 3")
    _require(rate > 0, "rate", rate, "> 0")
    _require(tool_s >= 0, "tool_s", tool_s, ">= 0")
    _require(0 <= subagent_prob <= 1, "subagent_prob", subagent_prob, "between 0 and 1")

    def draw(median: int) -> int:
        return int(_lognormal_tokens(rng, median, sigma, 1)[0])

    # One request: (arrival s, prompt, output, [(stream, tokens of the stream it covers)]): a full
    # block lies on the first stream of the chain whose span holds it (the system prompt is stream -1).
    requests: list[tuple[float, int, int, list[tuple[int, int]]]] = []
    parent: list[int] = []  # the request each continues (kvemu.sessions), -1 at an agent's first turn
    streams = iter(range(1 << 62))

    def run(start_s: float, base: list[tuple[int, int]], context: int, n_turns: int, spawn: bool,
            prev: int) -> tuple[float, int]:
        stream = next(streams)
        context += draw(task_tokens)
        t = start_s
        for k in range(n_turns):
            reply = min(draw(output_tokens), max_output_tokens)
            requests.append((t, context, reply, base + [(stream, context)]))
            parent.append(prev)
            prev = len(requests) - 1
            context += reply + draw(tool_tokens)
            t += rng.exponential(tool_s) if tool_s > 0 else 0.0
            if spawn and subagents and k + 1 < n_turns and rng.random() < subagent_prob:
                branch = base + [(stream, context)]
                # sub-agents continue the turn that spawned them; the agent goes on after the last one
                ends = [run(t, branch, context, subagent_turns, False, prev) for _ in range(subagents)]
                last_t, prev = max(ends)
                t = last_t + (rng.exponential(tool_s) if tool_s > 0 else 0.0)
        return t, prev

    for start in _poisson_arrivals_s(rng, sessions, rate):
        run(float(start), [(-1, system_tokens)], system_tokens, turns, True, -1)
    order = sorted(range(len(requests)), key=lambda i: requests[i][0])
    keys: dict[tuple[int, int], int] = {}
    counts, ids = [], []
    for i in order:
        _, prompt, _, chain = requests[i]
        n_blocks = -(-prompt // hash_block_tokens)
        counts.append(n_blocks)
        for j in range(n_blocks):
            end = (j + 1) * hash_block_tokens
            owner = next((s for s, upto in chain if end <= upto), None) if end <= prompt else None
            key = (owner, j) if owner is not None else (-2 - len(keys), j)  # a partial block: its own
            ids.append(keys.setdefault(key, len(keys)))
    t = np.array([requests[i][0] for i in order])
    new_row = np.empty(len(order), np.int64)
    new_row[np.array(order, np.int64)] = np.arange(len(order))
    old_parent = np.array([parent[i] for i in order], np.int64)
    # every gap is the tool time drawn after the parent's turn (its arrival to this one's): a
    # workload cannot know when the parent completes, so the inter-arrival gap stands for it
    return RequestColumns((t - t[0]) * 1000.0, np.array([requests[i][1] for i in order], np.int64),
                          np.array([requests[i][2] for i in order], np.int64),
                          _offsets_from_counts(np.array(counts, np.int64)), np.array(ids, np.int64),
                          np.where(old_parent >= 0, new_row[np.maximum(old_parent, 0)], -1),
                          np.full(len(order), math.nan))
