"""Trace format: schema, versions, writing and validation. The spec is docs/trace-format.md.

A trace is one Parquet file with three sections of rows, told apart by ``row_type``:
requests (with their KV block tables as runs of block ids), engine steps (with their modelled GPU
compute time), and batch entries (one request in one step, with its KV operations as ranges of
positions in that request's block table). Columns a section does not use are null.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import __version__
from .errors import TraceError
from .inputs import not_regular
from .output import atomic_output

TRACE_FORMAT = "kvemu.trace"
TRACE_VERSION = 2
SUPPORTED_TRACE_VERSIONS = (1, 2)
RESULTS_FORMAT = "kvemu.results"
RESULTS_VERSION = 1
SUPPORTED_RESULTS_VERSIONS = (1,)
METADATA_KEY = b"kvemu"  # the schema-metadata key of traces and results alike

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


def write_trace(path, meta: dict, requests: dict, steps: dict, entries: dict, force: bool = False) -> None:
    """Write a trace atomically. ``requests``/``steps``/``entries`` map column names to arrays."""
    meta = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "creator": f"kvemu {__version__}", **meta}
    schema = TRACE_SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True).encode()})
    with atomic_output(path, force=force) as tmp:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as w:
            w.write_table(_section(requests, ROW_REQUEST).cast(schema), row_group_size=1 << 16)
            w.write_table(_section(steps, ROW_STEP).cast(schema), row_group_size=1 << 20)
            n = len(entries["step"])
            chunk = ENTRY_ROW_GROUP
            for lo in range(0, max(n, 1), chunk):
                part = {k: v[lo : lo + chunk] for k, v in entries.items()}
                w.write_table(_section(part, ROW_ENTRY).cast(schema), row_group_size=chunk)


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
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if p.is_dir():
        raise TraceError(f"{p}: is a folder, not a trace file")
    why = not_regular(p)
    if why:
        raise TraceError(f"{p}: {why}")
    try:
        pf = pq.ParquetFile(p)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as e:
        reason = "empty file" if p.stat().st_size == 0 else "not a Parquet file or truncated"
        raise TraceError(f"{p}: {reason} ({str(e).splitlines()[0]})") from None
    schema = pf.schema_arrow
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise TraceError(f"{p}: a Parquet file but not a kvemu trace (no 'kvemu' schema metadata)")
    try:
        meta = json.loads(raw)
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
    _check_geometry(p, meta)
    return TraceHeader(p, meta, pf.metadata.num_rows)


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
    """Rewrite a v1 trace as v2: the same rows, v2 metadata. Returns the new metadata."""
    h = read_header(src)
    if h.meta["version"] != 1:
        raise TraceError(f"{src}: already a v{h.meta['version']} trace; nothing to upgrade")
    meta = {k: v for k, v in h.meta.items() if k != "upgraded_from"}
    meta.update(version=TRACE_VERSION, upgraded={"from_version": 1, "by": f"kvemu {__version__}",
                                                  "source_sha256": file_sha256(src)})
    schema = TRACE_SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True).encode()})
    pf = pq.ParquetFile(h.path)
    with atomic_output(dst, force=force, inputs=[src]) as tmp:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as w:
            for g in range(pf.num_row_groups):
                w.write_table(pf.read_row_group(g, columns=TRACE_SCHEMA.names).cast(schema))
    return meta


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
    blocks = meta.get("blocks")
    if not isinstance(blocks, dict) or not isinstance(blocks.get("id_space"), int) or blocks["id_space"] < 0:
        raise TraceError(f"{p}: metadata 'blocks.id_space' must be a non-negative integer")


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
    run_of = np.repeat(np.arange(len(counts)), counts)
    begin = np.cumsum(counts) - counts
    return starts.astype(np.int64)[run_of] + (np.arange(total, dtype=np.int64) - begin[run_of])


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
    """Read and check the request and step sections. Raises TraceError naming the first problem."""
    header = read_header(path)
    p = header.path
    try:
        pf = pq.ParquetFile(p)
        req = _read_section(pf, ROW_REQUEST, REQUEST_COLUMNS)
        stp = _read_section(pf, ROW_STEP, STEP_COLUMNS)
    except (pa.ArrowInvalid, OSError) as e:
        raise TraceError(f"{p}: cannot read trace data ({str(e).splitlines()[0]})") from None
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

    steps = _np(stp["step"], np.int64)
    if len(steps) and not np.array_equal(steps, np.arange(len(steps))):
        raise TraceError(f"{p}: steps must be numbered 0..{len(steps) - 1} in order")
    compute = _np(stp["compute_ns"], np.int64)
    start = _np(stp["start_ns"], np.int64)
    if np.any(compute < 0) or np.any(np.diff(start) < 0):
        raise TraceError(f"{p}: step compute_ns must be >= 0 and start_ns non-decreasing")
    return TraceData(header, rid, arrival, inp, out, cached, tier_hit, table_offsets, run_off.astype(np.int64),
                     starts, counts, steps, start, compute)


def _first_line(e: BaseException) -> str:
    lines = str(e).splitlines()
    return lines[0] if lines else type(e).__name__


def iter_entries(header: TraceHeader, columns=ENTRY_COLUMNS, batch_rows: int = 1 << 16):
    """Stream entry rows as dicts of numpy arrays, in step order."""
    try:
        pf = pq.ParquetFile(header.path)
    except (pa.ArrowException, OSError) as e:
        raise TraceError(f"{header.path}: cannot read entry rows ({_first_line(e)})") from None
    cols = ["row_type", *columns]
    # one thread: decoding on Arrow's pool leaves freed buffers in per-thread malloc arenas
    batches = pf.iter_batches(batch_size=batch_rows, columns=cols, use_threads=False)
    while True:
        # a corrupt page (a bad header, a failed decompression) is the file's fault: one line
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as e:
            raise TraceError(f"{header.path}: cannot read entry rows ({_first_line(e)})") from None
        rt = batch.column(0).to_numpy(zero_copy_only=False)
        mask = rt == ROW_ENTRY
        if not mask.any():
            continue
        sub = batch.filter(pa.array(mask))
        out = {}
        for name in columns:
            col = sub.column(name)
            if col.null_count:
                raise TraceError(f"{header.path}: entry rows have nulls in column '{name}'")
            out[name] = col.to_numpy(zero_copy_only=False)
        yield out


def check_entries(trace: TraceData) -> int:
    """Full scan of the entry rows: ordering and every range. Returns the number of entries."""
    p = trace.header.path
    n_req = trace.n_requests
    n_steps = len(trace.step)
    lengths = np.diff(trace.table_offsets)
    last_step = -1
    total = 0
    for e in iter_entries(trace.header):
        st = e["step"].astype(np.int64)
        rid = e["request_id"].astype(np.int64)
        if len(st) and (st[0] < last_step or np.any(np.diff(st) < 0)):
            raise TraceError(f"{p}: entry rows are out of step order near step {int(st[0])}")
        if np.any(st < 0) or np.any(st >= n_steps):
            raise TraceError(f"{p}: entry refers to a step outside 0..{n_steps - 1}")
        if np.any(rid < 0) or np.any(rid >= n_req):
            bad = int(rid[(rid < 0) | (rid >= n_req)][0])
            raise TraceError(f"{p}: entry refers to request {bad}, trace has {n_req}")
        if np.any(e["phase"] > PHASE_DECODE) or np.any(e["phase"] < 0) or np.any(e["tokens"] <= 0):
            raise TraceError(f"{p}: entry phase must be 0 (prefill) or 1 (decode) and tokens positive")
        for op in OPS:
            first = e[f"{op}_first"].astype(np.int64)
            count = e[f"{op}_count"].astype(np.int64)
            bad = (first < 0) | (count < 0) | (first + count > lengths[rid])
            if np.any(bad):
                i = int(np.argmax(bad))
                raise TraceError(
                    f"{p}: step {int(st[i])} request {int(rid[i])}: {op} range {int(first[i])}+{int(count[i])}"
                    f" exceeds its block table ({int(lengths[rid[i]])} blocks)"
                )
        last_step = int(st[-1]) if len(st) else last_step
        total += len(st)
    return total
