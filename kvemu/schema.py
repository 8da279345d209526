"""Trace format: schema, versions, writing and validation. The spec is docs/trace-format.md.

A trace is one Parquet file with three sections of rows, told apart by ``row_type``:
requests (with their KV block tables as runs of block ids), engine steps (with their modelled GPU
compute time), and batch entries (one request in one step, with its KV operations as ranges of
positions in that request's block table). Columns a section does not use are null.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__
from . import jsontext
from .arrowops import null_mask
from .bounds import MAX_ID_SPACE
from .errors import ConfigError, TraceError
from .inputs import loads_bounded, not_regular
from .integrity import (DIGEST_KEY, METADATA_KEY, READ_OPTIONS, WRITE_OPTIONS, SectionDigest, checksums_text,
                        decode_error, digest_value, metadata_digest, read_digest)
from .models import geometry_from_meta
from .output import atomic_output
from .units import MAX_ARRIVAL_SPAN_MS, span_text
from .validation import RequestAccounting, check_sessions, check_timeline, check_trace_meta

TRACE_FORMAT = "kvemu.trace"
TRACE_VERSION = 2
SUPPORTED_TRACE_VERSIONS = (1, 2)
RESULTS_FORMAT = "kvemu.results"
RESULTS_VERSION = 1
SUPPORTED_RESULTS_VERSIONS = (1,)
# METADATA_KEY, the schema-metadata key of traces and results alike, lives in .integrity (below this module)

ROW_REQUEST, ROW_STEP, ROW_ENTRY = 0, 1, 2
PHASE_PREFILL, PHASE_DECODE = 0, 1

TRACE_SCHEMA = pa.schema(
    [
        ("row_type", pa.int8()),
        ("step", pa.int32()),
        ("request_id", pa.int32()),
        # request rows
        ("arrival_ms", pa.float64()),
        ("input_tokens", pa.int32()),
        ("output_tokens", pa.int32()),
        ("cached_tokens", pa.int32()),
        ("tier_hit_tokens", pa.int32()),
        ("block_start", pa.list_(pa.int64())),
        ("block_count", pa.list_(pa.int32())),
        # step rows
        ("start_ns", pa.int64()),
        ("compute_ns", pa.int64()),
        # entry rows
        ("phase", pa.int8()),
        ("tokens", pa.int32()),
        ("context_tokens", pa.int32()),
        ("load_first", pa.int32()),
        ("load_count", pa.int32()),
        ("store_first", pa.int32()),
        ("store_count", pa.int32()),
        ("read_first", pa.int32()),
        ("read_count", pa.int32()),
    ]
)
REQUEST_COLUMNS = ("request_id", "arrival_ms", "input_tokens", "output_tokens", "cached_tokens",
                   "tier_hit_tokens", "block_start", "block_count")
STEP_COLUMNS = ("step", "start_ns", "compute_ns")
ENTRY_COLUMNS = ("step", "request_id", "phase", "tokens", "context_tokens", "load_first", "load_count",
                 "store_first", "store_count", "read_first", "read_count")
OPS = ("load", "store", "read")

_GEOMETRY_KEYS = ("layers", "kv_values_per_token_layer", "kv_dtype_bytes", "tokens_per_block",
                  "block_bytes_per_layer", "kv_bytes_per_token_layer")


def _section(columns: dict[str, np.ndarray | pa.Array], row_type: int) -> pa.Table:
    """A table with every trace column; those not given are null."""
    n = len(next(iter(columns.values())))
    arrays = []
    for field in TRACE_SCHEMA:
        if field.name == "row_type":
            arrays.append(pa.array(np.full(n, row_type, np.int8)))
        elif isinstance(columns.get(field.name), pa.Array):
            arrays.append(columns[field.name].cast(field.type))
        elif field.name in columns:
            arrays.append(pa.array(columns[field.name], type=field.type))
        else:
            arrays.append(pa.nulls(n, field.type))
    return pa.Table.from_arrays(arrays, schema=TRACE_SCHEMA)


def list_column(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))


#: Entry rows per row group. A reader decodes a row group's columns at once, so this bounds the
#: memory a streamed pass over the entries takes (about 34 bytes a row: 9 MiB).
ENTRY_ROW_GROUP = 1 << 18


def write_trace(path, meta: dict, requests: dict, steps: dict, entries: dict, force: bool = False,
                strict_json: bool = True) -> None:
    """Write a trace atomically, with page checksums and the content digest (kvemu/integrity.py).
    ``requests``/``steps``/``entries`` map column names to arrays. Metadata holding a NaN or an
    infinity is refused (OutputError), unless ``strict_json`` is False: only for tests that craft a
    hostile file with valid checksums to check that the reader refuses it."""
    meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "creator": f"kvemu {__version__}", **meta}
    raw = (jsontext.dumps(meta, f"{path}: trace metadata", sort_keys=True) if strict_json
           else json.dumps(meta, sort_keys=True)).encode()
    schema = TRACE_SCHEMA.with_metadata({METADATA_KEY: raw})
    digests = _section_digests()
    with atomic_output(path, force=force) as tmp:
        with pq.ParquetWriter(tmp, schema, **WRITE_OPTIONS) as w:
            for cols, row_type, group in ((requests, ROW_REQUEST, 1 << 16), (steps, ROW_STEP, 1 << 20)):
                t = _section(cols, row_type).cast(schema)
                digests[SECTIONS[row_type]].update(t)
                w.write_table(t, row_group_size=group)
            n = len(entries["step"])
            chunk = ENTRY_ROW_GROUP
            for lo in range(0, max(n, 1), chunk):
                part = {k: v[lo : lo + chunk] for k, v in entries.items()}
                t = _section(part, ROW_ENTRY).cast(schema)
                digests["entry"].update(t)
                w.write_table(t, row_group_size=chunk)
            w.add_key_value_metadata({DIGEST_KEY: digest_value(raw, {k: d.to_dict() for k, d in digests.items()})})


#: Section names (in the content digest) by row_type, and each section's own columns.
SECTIONS = {ROW_REQUEST: "request", ROW_STEP: "step", ROW_ENTRY: "entry"}
SECTION_COLUMNS = {"request": REQUEST_COLUMNS, "step": STEP_COLUMNS, "entry": ENTRY_COLUMNS}


def _section_digests() -> dict[str, SectionDigest]:
    return {name: SectionDigest(cols) for name, cols in SECTION_COLUMNS.items()}


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class TraceHeader:
    path: Path
    meta: dict
    num_rows: int
    #: the file's content digest (kvemu/integrity.py); None for a file written without checksums
    digest: dict | None = None
    #: the file as read_header opened it (a Python file): every later read of this trace, and its
    #: sha256, go through this one descriptor, so a file replaced at ``path`` meanwhile changes
    #: nothing (provenance is of what was read); None for a header made by hand (read by path)
    file: object = field(default=None, repr=False, compare=False)
    _sha256: str | None = field(default=None, repr=False, compare=False)
    _lock: object = field(default_factory=threading.Lock, repr=False, compare=False)

    def parquet(self) -> pq.ParquetFile:
        """The trace as a ParquetFile read through the header's descriptor (page checksums verified)."""
        if self.file is None:
            return pq.ParquetFile(self.path, **READ_OPTIONS)
        # each reader its own Arrow file on the same open file (the inode read_header opened, even if
        # the path was replaced since): Arrow's positioned reads (pread) on a descriptor of its own are
        # safe from every thread, and one reader closing, or the header closing, stops no other
        with self._lock:
            if self.file.closed:
                raise TraceError(f"{self.path}: the trace was closed before it was read")
            return pq.ParquetFile(pa.OSFile(f"/proc/self/fd/{self.file.fileno()}", mode="r"), **READ_OPTIONS)

    def sha256(self) -> str:
        """SHA-256 of the file's bytes, read through the header's descriptor (positioned reads, so
        no other reader's position moves); computed once, when first asked."""
        with self._lock:
            if self._sha256 is None:
                if self.file is None:
                    self._sha256 = file_sha256(self.path)
                else:
                    h, fd, at = hashlib.sha256(), self.file.fileno(), 0
                    while block := os.pread(fd, 1 << 20, at):
                        h.update(block)
                        at += len(block)
                    self._sha256 = h.hexdigest()
            return self._sha256

    @property
    def file_bytes(self) -> int:
        """The size of the file read (through the descriptor)."""
        return os.fstat(self.file.fileno()).st_size if self.file is not None else self.path.stat().st_size

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    @property
    def checksums(self) -> str:
        return checksums_text(self.digest)

    @property
    def model(self) -> dict:
        return self.meta["model"]

    @property
    def tokens_per_block(self) -> int:
        return int(self.meta["model"]["tokens_per_block"])

    @property
    def block_bytes_per_layer(self) -> int:
        return int(self.meta["model"]["block_bytes_per_layer"])

    @property
    def layers(self) -> int:
        return int(self.meta["model"]["layers"])


def read_header(path) -> TraceHeader:
    """Validate a trace from its footer alone; one exact message per problem."""
    p = Path(path)
    why = not_regular(p)  # first: a name no file can have (too long, a symlink loop) is refused here
    if why:
        raise TraceError(f"{p}: {why}")
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if p.is_dir():
        raise TraceError(f"{p}: is a folder, not a trace file")
    try:
        # non-blocking: a FIFO put at the path since not_regular looked must not block the open
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise TraceError(f"{p}: cannot be opened ({e.strerror or e})") from None
    f = os.fdopen(fd, "rb")
    try:
        return _read_header(p, f)
    except BaseException:
        f.close()
        raise


def _read_header(p: Path, f) -> TraceHeader:
    st = os.fstat(f.fileno())
    if not stat.S_ISREG(st.st_mode):
        raise TraceError(f"{p}: is not a regular file (it was replaced while kvemu opened it)")
    size = st.st_size
    header = TraceHeader(p, {}, 0, None, f)
    weakref.finalize(header, f.close)  # closed with the last reference to the header, not by the GC's warning
    try:
        pf = header.parquet()
        schema = pf.schema_arrow
        num_rows = pf.metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        reason = "empty file" if size == 0 else "not a Parquet file or truncated"
        raise TraceError(f"{p}: {reason} ({_first_line(e)})") from None
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise TraceError(f"{p}: a Parquet file but not a kvemu trace (no 'kvemu' schema metadata)")
    try:
        meta = loads_bounded(json.loads, raw, f"{p}: 'kvemu' metadata", TraceError)
    except json.JSONDecodeError:
        raise TraceError(f"{p}: 'kvemu' metadata is not valid JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != TRACE_FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise TraceError(f"{p}: not a kvemu trace (format {fmt!r}, expected '{TRACE_FORMAT}')")
    version = meta.get("version")
    if version not in SUPPORTED_TRACE_VERSIONS:
        raise TraceError(
            f"{p}: unsupported trace version {version!r} (this kvemu {__version__} reads "
            f"{', '.join(map(str, SUPPORTED_TRACE_VERSIONS))})"
        )
    if version == 1:
        meta = upgrade_v1_meta(meta)
    sched = meta.get("schedule")
    if not (isinstance(sched, dict) and isinstance(sched.get("closed_loop"), bool)):
        raise TraceError(f"{p}: v2 trace without a valid 'schedule' object (closed_loop true or false)")
    for field in TRACE_SCHEMA:
        if field.name not in schema.names:
            raise TraceError(f"{p}: trace is missing required column '{field.name}'")
        got = schema.field(field.name).type
        if got != field.type:
            raise TraceError(f"{p}: column '{field.name}' has type {got}, expected {field.type}")
    digest = read_digest(pf)
    if isinstance(digest, str):
        raise TraceError(f"{p}: {digest}")
    if digest is not None:
        if digest["metadata"] != metadata_digest(raw):
            raise TraceError(f"{p}: 'kvemu' metadata does not match the trace's content digest (the file is corrupt)")
        sections = digest.get("sections")
        if not (isinstance(sections, dict) and all(isinstance(sections.get(k), dict) for k in SECTION_COLUMNS)):
            raise TraceError(f"{p}: 'kvemu.digest' metadata has no digest of each section")
    _check_geometry(p, meta)
    check_trace_meta(p, meta)
    header.meta, header.num_rows, header.digest = meta, num_rows, digest
    return header


#: The engine model every v1 trace of a workload was recorded by (closed-loop replay checks it).
V1_ENGINE_MODEL = "kvemu.engine/1"


def upgrade_v1_meta(meta: dict) -> dict:
    """A v1 trace's metadata as v2 has it (``version`` stays 1: the file's own): the ``schedule``
    object, derived. v1 traces of real runs have a ``capture`` section and hold what happened; v1
    traces of workloads have the engine configuration, GPU timing and model the engine model needs
    to schedule again."""
    meta = dict(meta)
    if "capture" in meta:
        meta["schedule"] = {"closed_loop": False, "source": "captured",
                            "why": "a real run's schedule is what happened: replay it as recorded"}
    elif all(isinstance(meta.get(k), dict) for k in ("engine", "gpu", "model")):
        meta["schedule"] = {"closed_loop": True, "source": "engine-model", "engine_model": V1_ENGINE_MODEL}
    else:
        missing = [k for k in ("engine", "gpu", "model") if not isinstance(meta.get(k), dict)]
        meta["schedule"] = {"closed_loop": False, "source": "unknown",
                            "why": f"the trace has no {', '.join(missing)} metadata"}
    meta["upgraded_from"] = 1
    return meta


def upgrade_trace(src, dst, force: bool = False) -> dict:
    """Rewrite a v1 trace as v2: the same rows, v2 metadata, with checksums. The source is
    validated completely first (a file `trace validate` refuses is not rewritten). Returns the new
    metadata."""
    h = read_header(src)
    if h.meta["version"] != 1:
        raise TraceError(f"{src}: already a v{h.meta['version']} trace; nothing to upgrade")
    check_entries(read_trace(h))
    meta = {k: v for k, v in h.meta.items() if k != "upgraded_from"}
    meta.update(version=TRACE_VERSION, upgraded={"from_version": 1, "by": f"kvemu {__version__}",
                                                  "source_sha256": h.sha256()})
    _copy_rows(h, dst, jsontext.dumps(meta, f"{dst}: trace metadata", sort_keys=True).encode(), force)
    return meta


def rewrite_with_checksums(src, dst, force: bool = False) -> None:
    """Rewrite a trace written without checksums with them: the same rows and the same metadata
    bytes, validated completely first (tools/make_sample_traces.py --rewrite)."""
    h = read_header(src)
    check_entries(read_trace(h))
    _copy_rows(h, dst, h.parquet().schema_arrow.metadata[METADATA_KEY], force)


def _copy_rows(h: TraceHeader, dst, raw: bytes, force: bool) -> None:
    """Every row of trace ``h``, row group by row group, into ``dst`` with metadata ``raw``, page
    checksums and the content digest."""
    schema = TRACE_SCHEMA.with_metadata({METADATA_KEY: raw})
    digests = _section_digests()
    try:
        pf = h.parquet()
        with atomic_output(dst, force=force, inputs=[h.path]) as tmp:
            with pq.ParquetWriter(tmp, schema, **WRITE_OPTIONS) as w:
                for g in range(pf.num_row_groups):
                    t = pf.read_row_group(g, columns=TRACE_SCHEMA.names).cast(schema)
                    rt = t["row_type"].to_numpy()
                    for row_type, name in SECTIONS.items():
                        keep = rt == row_type
                        if keep.any():
                            digests[name].update(t if keep.all() else t.filter(pa.array(keep)))
                    w.write_table(t, row_group_size=max(t.num_rows, 1))
                w.add_key_value_metadata({DIGEST_KEY: digest_value(raw, {k: d.to_dict() for k, d in digests.items()})})
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"{h.path}: cannot read trace data ({_first_line(e)})") from None


def _check_geometry(p: Path, meta: dict) -> None:
    model = meta.get("model")
    if not isinstance(model, dict):
        raise TraceError(f"{p}: metadata has no 'model' geometry")
    for key in _GEOMETRY_KEYS:
        v = model.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise TraceError(f"{p}: model geometry field '{key}' must be a positive integer, got {v!r}")
    per_layer = model["kv_values_per_token_layer"] * model["kv_dtype_bytes"]
    if model["kv_bytes_per_token_layer"] != per_layer:
        raise TraceError(
            f"{p}: geometry does not add up: kv_bytes_per_token_layer {model['kv_bytes_per_token_layer']}"
            f" != kv_values_per_token_layer x kv_dtype_bytes = {per_layer}"
        )
    if model["block_bytes_per_layer"] != per_layer * model["tokens_per_block"]:
        raise TraceError(
            f"{p}: geometry does not add up: block_bytes_per_layer {model['block_bytes_per_layer']}"
            f" != tokens_per_block x kv_bytes_per_token_layer = {per_layer * model['tokens_per_block']}"
        )
    if "kv_groups" in model:  # per-layer-group KV geometry (models.KVGroup; absent: full attention)

        try:
            geometry_from_meta(model)
        except (ConfigError, TypeError) as e:
            raise TraceError(f"{p}: {e}") from None
    blocks = meta.get("blocks")
    space = blocks.get("id_space") if isinstance(blocks, dict) else None
    if not isinstance(space, int) or isinstance(space, bool) or not 0 <= space <= MAX_ID_SPACE:
        raise TraceError(f"{p}: metadata 'blocks.id_space' must be an integer from 0 to 2^53, got {space!r}")
    shared = blocks.get("shared_id_space", 0)
    if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared <= MAX_ID_SPACE:
        raise TraceError(f"{p}: metadata 'blocks.shared_id_space' must be an integer from 0 to 2^53, got {shared!r}")


def id_space_bound(meta: dict, table_positions: int, tokens_per_block: int) -> tuple[int, int]:
    """(bound, split): the most block ids a trace's tables can need. Each table position names one
    id; the engine numbers a shared hash block's engine blocks ``dense_hash * S + j`` with ``S =
    hash_block_tokens / tokens_per_block`` (the split), and a hash block reaches at least one table
    position, so at most ``S`` ids per position can be reserved for shared prefixes, besides the one
    it names: ``positions x (1 + S)``. Traces without hash blocks (real runs) need ``positions``."""
    hbt = meta.get("workload", {}).get("hash_block_tokens") if isinstance(meta.get("workload"), dict) else None
    split = hbt // tokens_per_block if isinstance(hbt, int) and not isinstance(hbt, bool) and hbt > 0 else 0
    return table_positions * (1 + split), split


@dataclass
class TraceData:
    """The request and step sections in memory, as numpy arrays (entries stream separately)."""

    header: TraceHeader
    request_id: np.ndarray
    arrival_ms: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray
    tier_hit_tokens: np.ndarray
    table_offsets: np.ndarray  # int64, n_requests + 1: request i's blocks are positions off[i]:off[i+1]
    run_offsets: np.ndarray  # int64, n_requests + 1: request i's runs are run_start/count[ro[i]:ro[i+1]]
    run_start: np.ndarray  # int64 first block id of each run
    run_count: np.ndarray  # int64 blocks in each run (> 0)
    step: np.ndarray
    start_ns: np.ndarray
    compute_ns: np.ndarray
    #: a pass over the entries has verified their content digest (iter_entries)
    entries_verified: bool = False
    #: a pass has read every entry through the checks (and every page of the file): later passes
    #: decode only the columns they ask for
    entries_checked: bool = False

    @property
    def n_requests(self) -> int:
        return len(self.request_id)

    @cached_property
    def table_ids(self) -> np.ndarray:
        """Every request's block ids, runs expanded (int64, table_offsets[-1] of them). Costs 8 bytes
        per block reference: the replay does without it (block_ids); analyses use it."""
        return expand_runs(self.run_start, self.run_count)

    @cached_property
    def _run_position(self) -> np.ndarray:
        """Table position (over all requests) of each run's first block."""
        return np.cumsum(self.run_count) - self.run_count

    def block_ids(self, request: np.ndarray, position: np.ndarray) -> np.ndarray:
        """Block ids at the given positions of the given requests' tables (vectorised, from the
        runs: nothing is expanded)."""
        at = self.table_offsets[request] + position
        run = np.searchsorted(self._run_position, at, side="right") - 1
        return self.run_start[run] + (at - self._run_position[run])

    def unique_blocks(self, requests: np.ndarray | None = None) -> int:
        """Distinct block ids over all tables (or the tables of the requests a boolean mask
        selects): the size of the union of the runs' id intervals."""
        start, count = self.run_start, self.run_count
        if requests is not None:
            keep = np.repeat(np.asarray(requests, bool), np.diff(self.run_offsets))
            start, count = start[keep], count[keep]
        if len(start) == 0:
            return 0
        order = np.argsort(start, kind="stable")
        end = start[order] + count[order]
        start = start[order]
        covered_before = np.maximum.accumulate(np.r_[start[0], end[:-1]])
        return int(np.maximum(end - np.maximum(start, covered_before), 0).sum())


def expand_runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[s0, s0+1, ..., s0+c0-1, s1, ...] without a Python loop."""
    counts = counts.astype(np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    # one array of the output's size and nothing else as large (the full Mooncake trace's 9.3 M
    # references): steps of 1, each run's first element a step from the end of the run before it,
    # summed in place
    nz = counts > 0
    s, c = starts[nz].astype(np.int64), counts[nz]
    begin = np.cumsum(c) - c
    out = np.ones(total, np.int64)
    out[0] = s[0]
    out[begin[1:]] = s[1:] - (s[:-1] + c[:-1] - 1)
    return np.cumsum(out, out=out)


def _np(col: pa.ChunkedArray, dtype) -> np.ndarray:
    return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _read_section(pf: pq.ParquetFile, row_type: int, columns) -> pa.Table:
    """The rows of one section with its own columns only, reading just the row groups whose
    row_type statistics admit it (kvemu writes each section in row groups of its own)."""
    md = pf.metadata
    at = pf.schema_arrow.get_field_index("row_type")
    groups = []
    for i in range(md.num_row_groups):
        st = md.row_group(i).column(at).statistics
        if st is None or not st.has_min_max or st.min <= row_type <= st.max:
            groups.append(i)
    t = pf.read_row_groups(groups, columns=["row_type", *columns])
    rt = _np(t["row_type"], np.int8)
    return t if np.all(rt == row_type) else t.filter(pa.array(rt == row_type))


def read_trace(path) -> TraceData:
    """Read and check the request and step sections. Raises TraceError naming the first problem.
    ``path``: a trace file's path, or its TraceHeader (read through the header's descriptor)."""
    header = path if isinstance(path, TraceHeader) else read_header(path)
    p = header.path
    try:
        pf = header.parquet()
        req = _read_section(pf, ROW_REQUEST, REQUEST_COLUMNS)
        stp = _read_section(pf, ROW_STEP, STEP_COLUMNS)
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"{p}: cannot read trace data ({_first_line(e)})") from None
    for name in REQUEST_COLUMNS:
        if req[name].null_count:
            raise TraceError(f"{p}: request rows have nulls in column '{name}'")
    for name in STEP_COLUMNS:
        if stp[name].null_count:
            raise TraceError(f"{p}: step rows have nulls in column '{name}'")
    rid = _np(req["request_id"], np.int64)
    if len(rid) == 0:
        raise TraceError(f"{p}: trace has no requests")
    if not np.array_equal(rid, np.arange(len(rid))):
        raise TraceError(f"{p}: request ids must be 0..{len(rid) - 1} in order")
    arrival = _np(req["arrival_ms"], np.float64)
    if not np.all(np.isfinite(arrival)) or np.any(np.diff(arrival) < 0) or arrival[0] < 0:
        raise TraceError(f"{p}: request arrival_ms must be finite, >= 0 and non-decreasing")
    if not arrival[-1] <= MAX_ARRIVAL_SPAN_MS:
        raise TraceError(f"{p}: request arrival_ms reaches {span_text(arrival[-1])}, beyond the "
                         f"{span_text(MAX_ARRIVAL_SPAN_MS)} kvemu's nanosecond clock allows")
    inp = _np(req["input_tokens"], np.int64)
    out = _np(req["output_tokens"], np.int64)
    cached = _np(req["cached_tokens"], np.int64)
    tier_hit = _np(req["tier_hit_tokens"], np.int64)
    if np.any(inp <= 0) or np.any(out <= 0):
        raise TraceError(f"{p}: request token counts must be positive")
    if np.any(cached < 0) or np.any(cached >= inp) or np.any(tier_hit < 0) or np.any(tier_hit > cached):
        raise TraceError(f"{p}: cached_tokens must satisfy 0 <= tier_hit_tokens <= cached_tokens < input_tokens")

    starts_col, counts_col = req["block_start"].combine_chunks(), req["block_count"].combine_chunks()
    run_off = starts_col.offsets.to_numpy()
    if not np.array_equal(run_off, counts_col.offsets.to_numpy()):
        raise TraceError(f"{p}: block_start and block_count lists differ in length")
    starts = starts_col.values.to_numpy(zero_copy_only=False).astype(np.int64)
    counts = counts_col.values.to_numpy(zero_copy_only=False).astype(np.int64)
    id_space = int(header.meta["blocks"]["id_space"])
    if len(starts) and (np.any(counts <= 0) or np.any(starts < 0) or np.any(starts + counts > id_space)):
        raise TraceError(f"{p}: block ids must be in [0, blocks.id_space={id_space}) and run counts positive")
    per_request = np.add.reduceat(counts, run_off[:-1]) if len(counts) else np.zeros(len(rid), np.int64)
    per_request[run_off[:-1] == run_off[1:]] = 0  # reduceat quirk for empty lists
    tpb = header.tokens_per_block
    need = -(-(inp + out - 1) // tpb)
    if np.any(per_request != need):
        bad = int(np.argmax(per_request != need))
        raise TraceError(
            f"{p}: request {bad} has {int(per_request[bad])} blocks, expected ceil((input+output-1)/"
            f"tokens_per_block) = {int(need[bad])}"
        )
    table_offsets = np.zeros(len(rid) + 1, np.int64)
    np.cumsum(per_request, out=table_offsets[1:])
    bound, split = id_space_bound(header.meta, int(table_offsets[-1]), tpb)
    if id_space > bound:
        raise TraceError(
            f"{p}: blocks.id_space {id_space} exceeds the {bound} ids its block tables can need "
            f"({int(table_offsets[-1])} table positions x (1 + {split} engine blocks per hash block))"
        )

    steps = _np(stp["step"], np.int64)
    if len(steps) and not np.array_equal(steps, np.arange(len(steps))):
        raise TraceError(f"{p}: steps must be numbered 0..{len(steps) - 1} in order")
    compute = _np(stp["compute_ns"], np.int64)
    start = _np(stp["start_ns"], np.int64)
    if np.any(compute < 0) or np.any(np.diff(start) < 0):
        raise TraceError(f"{p}: step compute_ns must be >= 0 and start_ns non-decreasing")
    check_timeline(p, arrival, start, compute)
    check_sessions(p, header.meta, len(rid))
    if header.digest is not None:
        for name, table in (("request", req), ("step", stp)):
            _verify_section(header, name, table)
    return TraceData(header, rid, arrival, inp, out, cached, tier_hit, table_offsets, run_off.astype(np.int64),
                     starts, counts, steps, start, compute)


def _first_line(e: BaseException) -> str:
    return decode_error(e)


def _verify_section(header: TraceHeader, name: str, digest) -> None:
    """Compare a section's digest (a SectionDigest, or the section's table) with the file's."""
    if isinstance(digest, pa.Table):
        table, digest = digest, SectionDigest(SECTION_COLUMNS[name])
        digest.update(table)
    if digest.to_dict() != header.digest["sections"][name]:
        raise TraceError(f"{header.path}: {name} rows do not match the trace's content digest (the file is corrupt)")


class _EntryCheck:
    """The checks every entry row passes, batch by batch, wherever entries are read: step order,
    steps and requests in range, phase, tokens and context, every range inside its block table."""

    def __init__(self, trace: TraceData):
        self.trace = trace
        self.p = trace.header.path
        self.lengths = np.diff(trace.table_offsets)
        self.tokens_max = trace.input_tokens + trace.output_tokens
        self.last_step = -1
        self.accounting = RequestAccounting(self.p, trace.input_tokens, trace.output_tokens, trace.cached_tokens)
        from .backends import entry_batch_ok  # every check below in one C pass (cbackends/entries.c)

        acc = self.accounting
        self._batch_ok = lambda e: entry_batch_ok(e, self.last_step, len(trace.step), trace.n_requests, self.lengths,
                                                  self.tokens_max, acc.inp, acc.out, acc.next, acc.phase,
                                                  acc.last_step)

    def __call__(self, e: dict) -> None:
        if self._batch_ok(e):  # passes every check (the requests' state updated): nothing to word
            self.last_step = int(e["step"][-1])
            return
        # a check fails (or a column is not of kvemu's types): the checks below find it and word it
        p, tr = self.p, self.trace
        n_req, n_steps = tr.n_requests, len(tr.step)
        st = e["step"].astype(np.int64)
        rid = e["request_id"].astype(np.int64)
        if st[0] < self.last_step or np.any(st[1:] < st[:-1]):
            raise TraceError(f"{p}: entry rows are out of step order near step {int(st[0])}")
        if st[0] < 0 or st[-1] >= n_steps:  # in order: the first and last bound them
            bad = int(st[(st < 0) | (st >= n_steps)][0])
            raise TraceError(f"{p}: entry refers to step {bad}, outside the trace's steps 0..{n_steps - 1}")
        if rid.min() < 0 or rid.max() >= n_req:
            bad = int(rid[(rid < 0) | (rid >= n_req)][0])
            raise TraceError(f"{p}: entry refers to request {bad}, trace has {n_req}")
        phase, tokens = e["phase"], e["tokens"]
        if phase.max() > PHASE_DECODE or phase.min() < 0 or tokens.min() <= 0:
            raise TraceError(f"{p}: entry phase must be 0 (prefill) or 1 (decode) and tokens positive")
        ctx = e["context_tokens"].astype(np.int64)
        bad = ctx < 0
        bad |= ctx + tokens > self.tokens_max[rid]
        if np.any(bad):
            i = int(np.argmax(bad))
            raise TraceError(f"{p}: step {int(st[i])} request {int(rid[i])}: context_tokens {int(ctx[i])} + tokens "
                             f"{int(e['tokens'][i])} must be >= 0 and at most input + output tokens "
                             f"({int(self.tokens_max[rid[i]])})")
        lengths = self.lengths[rid]
        for op in OPS:
            first = e[f"{op}_first"].astype(np.int64)
            count = e[f"{op}_count"]
            bad = first < 0
            bad |= count < 0
            bad |= first + count > lengths
            if np.any(bad):
                i = int(np.argmax(bad))
                raise TraceError(
                    f"{p}: step {int(st[i])} request {int(rid[i])}: {op} range {int(first[i])}+{int(count[i])}"
                    f" exceeds its block table ({int(self.lengths[rid[i]])} blocks)"
                )
        self.accounting.add(e, rid=rid, step=st, context=ctx)
        self.last_step = int(st[-1])


#: The sections (row types) whose rows use each column; in the others it is null.
_USED_BY = {name: tuple(rt for rt, sec in SECTIONS.items() if name in SECTION_COLUMNS[sec])
            for name in TRACE_SCHEMA.names if name != "row_type"}


def _rows(batch, mask: np.ndarray):
    """The rows of ``batch`` where ``mask`` holds (``batch.filter``): a slice where they are one run,
    as a section's rows are, without importing pyarrow.compute (kvemu.arrowops)."""
    at = np.flatnonzero(mask)
    if at[-1] - at[0] + 1 == len(at):
        return batch.slice(int(at[0]), len(at))
    return batch.filter(pa.array(mask))


def _check_unused_null(p, batch, rt: np.ndarray) -> None:
    """Columns a section does not use are null in its rows."""
    lo = int(rt.min()) if len(rt) else 0
    one_type = len(rt) and lo == int(rt.max())  # a batch of one section's rows (kvemu writes them so)
    for name, used in _USED_BY.items():
        col = batch.column(name)
        if col.null_count == len(col) or (one_type and lo in used):
            continue
        stray = ~null_mask(col) & ~np.isin(rt, used)
        if stray.any():
            bad = int(rt[np.argmax(stray)])
            raise TraceError(f"{p}: column '{name}' holds values in {SECTIONS[bad]} rows, which do not use it")


def iter_entries(trace, columns=ENTRY_COLUMNS, batch_rows: int = 1 << 16):
    """Stream entry rows as dicts of numpy arrays (the given columns), in step order.

    The one way kvemu reads entries: until a pass has reached the end, every batch passes
    _EntryCheck before it is yielded, every page of the file is decoded and verified against its
    checksum, and the end verifies the entries' content digest. That is done once per TraceData:
    later passes decode only the columns they ask for (still verifying those pages). ``trace``: a
    TraceData (a TraceHeader is read with read_trace first). Any problem is a TraceError naming the
    file."""
    if isinstance(trace, TraceHeader):
        trace = read_trace(trace)
    header = trace.header
    full = not trace.entries_checked
    check = _EntryCheck(trace) if full else None
    digest = SectionDigest(ENTRY_COLUMNS) if full and header.digest is not None and not trace.entries_verified \
        else None
    names = ENTRY_COLUMNS if full else tuple(dict.fromkeys(columns))
    try:
        pf = header.parquet()
        # one thread: decoding on Arrow's pool leaves freed buffers in per-thread malloc arenas;
        # every column on a full pass, so that it decodes (and verifies) every page of the file
        read = TRACE_SCHEMA.names if full else ["row_type", *names]
        batches = pf.iter_batches(batch_size=batch_rows, columns=read, use_threads=False)
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"{header.path}: cannot read entry rows ({_first_line(e)})") from None
    while True:
        # a corrupt page (a bad header, a failed decompression, a checksum mismatch) is the file's fault
        try:
            batch = next(batches)
        except StopIteration:
            break
        except (pa.ArrowException, OSError) as e:
            raise TraceError(f"{header.path}: cannot read entry rows ({_first_line(e)})") from None
        rt = batch.column(0).to_numpy(zero_copy_only=False)
        if np.any((rt < ROW_REQUEST) | (rt > ROW_ENTRY)):
            bad = int(rt[(rt < ROW_REQUEST) | (rt > ROW_ENTRY)][0])
            raise TraceError(f"{header.path}: row_type {bad} is not 0 (request), 1 (step) or 2 (entry)")
        if full:
            _check_unused_null(header.path, batch, rt)
        mask = rt == ROW_ENTRY
        if not mask.any():
            continue
        sub = batch if mask.all() else _rows(batch, mask)
        e = {}
        for name in names:
            col = sub.column(name)
            if col.null_count:
                raise TraceError(f"{header.path}: entry rows have nulls in column '{name}'")
            e[name] = col.to_numpy(zero_copy_only=False)
        if full:
            check(e)
        if digest is not None:
            digest.update(sub)
        yield {name: e[name] for name in columns}
    if full:
        check.accounting.finish()
    if digest is not None:
        _verify_section(header, "entry", digest)
        trace.entries_verified = True
    if full:
        trace.entries_checked = True


def check_entries(trace: TraceData) -> int:
    """Full scan of the entry rows (iter_entries' checks and digest). Returns the number of entries."""
    return sum(len(e["step"]) for e in iter_entries(trace, columns=("step",)))
