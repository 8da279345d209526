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
``synthetic:NAME`` or ``synthetic:NAME:key=value,key=value``
    A seeded generator registered in `SYNTHETIC_WORKLOADS` (``chat``, ``docqa``).

Every source then goes through the same selection in `load_workload` (arrival order, time window,
first N, time rebased to the first kept request), and every parameter it used is recorded in
`Workload.params`, so a trace recorded from a workload says exactly which requests it replayed.
"""

from __future__ import annotations

import codecs
import csv
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

from .errors import ConfigError, WorkloadError
from .inputs import not_regular
from .units import MAX_ARRIVAL_SPAN_MS, span_text

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "SYNTHETIC_BLOCK_TOKENS",
    "SYNTHETIC_WORKLOADS",
    "RequestColumns",
    "Workload",
    "load_workload",
    "register_synthetic",
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
    return None


class RequestColumns(NamedTuple):
    """Requests as parsed or generated, before selection: what readers and generators return.

    ``arrival_ms`` is measured from the earliest request (so its minimum is 0.0) but need not be
    sorted; the hash columns are CSR as in `Workload`.
    """

    arrival_ms: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    hash_offsets: np.ndarray
    hash_ids: np.ndarray


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
    if kind in _FILE_READERS:
        if not rest:
            raise ConfigError(f"workload spec {spec!r} names no file; expected {kind}:PATH")
        columns, checksum, block_tokens, params = _FILE_READERS[kind](Path(rest), hash_block_tokens)
    elif kind == "synthetic":
        name, _, knob_text = rest.partition(":")
        kind = f"synthetic:{name}"
        columns, checksum, block_tokens, params = _generate(name, knob_text, hash_block_tokens, seed)
    else:
        raise ConfigError(f"unknown workload source {kind!r} in {spec!r}; known: "
                          f"{', '.join(f'{k}:PATH' for k in _FILE_READERS)}, synthetic:NAME[:key=value,...]")
    columns, selection = _select(spec, columns, max_requests, window_ms)
    params = {"hash_block_tokens": block_tokens, **params, **selection}
    return Workload(source=spec, kind=kind, checksum=checksum, arrival_ms=columns.arrival_ms,
                    input_tokens=columns.input_tokens, output_tokens=columns.output_tokens,
                    hash_block_tokens=block_tokens, hash_offsets=columns.hash_offsets,
                    hash_ids=columns.hash_ids, params=params)


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
    return RequestColumns(columns.arrival_ms[rows], columns.input_tokens[rows], columns.output_tokens[rows],
                          offsets, columns.hash_ids[shift + np.arange(offsets[-1])])


def _offsets_from_counts(counts: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


# ---------------------------------------------------------------------------------------------
# File readers and generators both come back with (columns, checksum, hash_block_tokens, params);
# readers report bad data as one line "PATH:LINE: what is wrong".

_Loaded = tuple[RequestColumns, str, int | None, dict]


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


def _read_mooncake(path: Path, hash_block_tokens: int | None) -> _Loaded:
    """Mooncake JSONL. Blank lines are skipped; line numbers count every line of the file."""
    block_tokens = MOONCAKE_BLOCK_TOKENS if hash_block_tokens is None else hash_block_tokens
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
    columns = RequestColumns(ts - ts[first], n_in, n_out, offsets, ids)
    params = {"time_origin": timestamps[first], "output_zero_clamped": int(zero_output.sum())}
    return columns, checksum, block_tokens, params


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


def _read_azure(path: Path, hash_block_tokens: int | None) -> _Loaded:
    """Azure LLM inference CSV. The first non-blank row is the header; extra columns are ignored."""
    if hash_block_tokens is not None:
        raise ConfigError(f"azure:{path}: Azure traces carry no prefix information, "
                          f"so hash_block_tokens does not apply")
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
    return columns, checksum, None, params


_FILE_READERS = {"mooncake": _read_mooncake, "azure": _read_azure}


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
