"""Sweeps: a TOML spec expanded into a matrix of replay cells, run locally or on a Dask cluster.

A *cell* is one replay: one trace, one backend, one set of replay parameters, one repetition. Its
identity is a stable hash of its parameters (``Cell.key``); its results go to the Hive-partitioned
dataset ``OUT/backend=…/host=…/run_id=KEY-rN/results.parquet``, written atomically, so "is this
cell done?" is a path check and a sweep restarted after a crash skips what finished.

Executors (docs/scale-out.md):

- local (default): one cell at a time. Concurrent replays on the same host contend for the same
  memory bandwidth, caches and cores, and each would measure the others; serial runs measure the
  tier alone.
- ``dask://HOST:PORT``: cells are submitted to an existing ``distributed`` cluster with resource
  requirements derived from their backend (``cell_resources``), so each runs on a worker that has
  the hardware, one at a time per resource. Workers return the results file's bytes; the client
  writes them into the dataset. That needs no shared file system, and only the client writes, so
  a worker dying mid-cell leaves nothing behind (the cell is retried, then reported failed).
  Dask unpickles what it receives, so whoever reaches the scheduler runs code on the workers and
  on this machine: ``executors.parse_executor`` demands TLS with certificates (``tls://``) for any address
  that is not loopback, unless told ``insecure``.

Nothing is created before the spec, the executor and the output folder have been checked; a
sweep refused or interrupted after that removes the folders it made that are still empty, and
always its ``OUT/.sweep-work``.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import itertools
import json
import logging
import math
import os
import socket
import tempfile
import time
import tomllib
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from pathlib import Path

from . import jsontext
from .analysis import trace_summary
from .backend_spec import BackendSpec
from .errors import BackendUnavailable, ComponentError, ConfigError, KvemuError, OptionError, OutputError
from .executors import DaskTarget, connect, parse_executor
from .inputs import loads_bounded, not_regular
from .integrity import read_verified_results, write_results
from .output import atomic_output, check_written_files, make_folders, remove_empty_folders
from .replay import DEFAULT_MAX_MEMORY, backend_label, partition_folder, partition_value, replay
from .record_options import FLAT_FIELDS, OPTIONS as RECORD_TABLE, RecordOptions
from .recording import record
from .replay_options import SWEEPABLE, options_from
from .schema import METADATA_KEY, file_sha256, read_trace
from .units import parse_range, parse_size
from .workloads import source_file

#: Version of the sweep's entry in a results file's metadata (``kvemu.sweep``).
SWEEP_META_VERSION = 1
#: The axes a Cell has a field of, the first sweeps' (a cell's key always names them).
_FIRST_AXES = ("replay_layers", "overlap", "instances", "sharing", "requests", "arrival_ms")
#: Axes added after sweeps existed: a cell's key names them only when they differ from the default,
#: so that datasets written before them resume. The rest are in ``Cell.more``, named alike.
_LATE_AXES = ("link", "store_timing")
#: Replay parameters a spec may grid over (``[grid]``), with their defaults: every replay option
#: the option table (kvemu/replay_options.py OPTIONS) declares sweepable, by its ``sweep`` key; the
#: axes above first, in their order (cells expand in it), then the others by name.
GRID_DEFAULTS = {key: SWEEPABLE[key].default
                 for key in sorted(SWEEPABLE, key=lambda k: ((_FIRST_AXES + _LATE_AXES + (k,)).index(k), k))}
#: `kvemu record` options a recorded trace may set, each a value or a list of values (a grid axis): every
#: option of record's option table (kvemu/record_options.py OPTIONS) but --force, by its flat name.
RECORD_OPTIONS = tuple(o.sweep for o in RECORD_TABLE if o.sweep)
_TOP_KEYS = {"sweep", "trace", "backends", "grid"}
_SWEEP_KEYS = {"name", "repetitions", "max_memory", "retries"}
_BACKEND_KEYS = {"use", "optional"}
#: Repetitions of a sweep cell at most (each is a full replay).
MAX_REPETITIONS = 1000
#: Repetitions of a cell on a measured or emulated backend when the spec gives none (virtual: one).
MEASURED_REPETITIONS = 3
#: Cells of one sweep at most, counted before the grid is expanded (each cell is a replay of seconds
#: to minutes; a spec beyond this is a typo or an attack, and expanding it would take hours and GBs).
MAX_CELLS = 100_000
#: Resubmissions of a failed cell at most ([sweep] retries).
MAX_RETRIES = 100
#: Estimator of a cell's cost (dry run): bytes it moves / an assumed throughput per backend, plus a
#: fixed cost per cell for reading the trace and building the arena. Rough by design: it ranks
#: and sizes sweeps, it does not predict wall time to better than a factor of two or so.
CELL_OVERHEAD_S = 0.5


# ------------------------------------------------------------------------------------------ spec
@dataclass(frozen=True)
class TraceSource:
    """A trace file, or a workload to record into ``OUT/traces/`` before the replays."""

    name: str
    path: str | None = None
    record: dict | None = None  # workload, model and record options

    def identity(self) -> str:
        """What a cell's hash holds for its trace: the file's content, or the recording's inputs."""
        if self.path is not None:
            return file_sha256(self.path)
        return "record:" + _digest(self.record)

    def recorded_path(self, out) -> Path:
        return Path(out) / "traces" / f"{partition_value(self.name)}-{_digest(self.record)[:10]}.parquet"


@dataclass(frozen=True)
class Cell:
    trace: TraceSource
    trace_id: str
    backend: str
    optional: bool
    replay_layers: int | None
    overlap: bool
    instances: int
    sharing: str
    requests: tuple | None
    arrival_ms: tuple | None
    max_memory: int
    repetition: int
    link: str = "pcie5-x16"
    store_timing: str = "async"
    #: The other [grid] axes, ``(key, value)`` sorted by key, each different from its default.
    more: tuple = ()

    def axes(self) -> dict:
        """Every [grid] key the cell sets, and its value."""
        return {**{k: getattr(self, k) for k in (*_FIRST_AXES, *_LATE_AXES)}, **dict(self.more)}

    def params(self) -> dict:
        """The parameters that identify the cell (the repetition apart)."""
        p = {"trace": self.trace_id, "backend": self.backend, "replay_layers": self.replay_layers,
             "overlap": self.overlap, "instances": self.instances, "sharing": self.sharing,
             "requests": list(self.requests) if self.requests else None,
             "arrival_ms": list(self.arrival_ms) if self.arrival_ms else None, "max_memory": self.max_memory}
        p.update({k: getattr(self, k) for k in _LATE_AXES if getattr(self, k) != GRID_DEFAULTS[k]})
        p.update({k: list(v) if isinstance(v, tuple) else v for k, v in self.more})
        return p

    def replay_options(self):
        """The cell's replay as kvemu.replay takes it."""
        return options_from({**{SWEEPABLE[k].key(): v for k, v in self.axes().items()},
                             "tier__max_memory_bytes": self.max_memory})

    @property
    def key(self) -> str:
        return _digest(self.params())[:12]

    @property
    def run_id(self) -> str:
        return f"{self.key}-r{self.repetition}"

    def describe(self) -> str:
        """The cell in a few words: trace, backend, and only what differs from a plain replay."""
        w = lambda r: f"{r[0]:g}:{r[1]:g}"  # noqa: E731
        parts = [self.trace.name, self.backend]
        if self.replay_layers:
            parts.append(f"layers={self.replay_layers}")
        if self.overlap:
            parts.append("overlap")
        if self.instances > 1:
            parts.append(f"instances={self.instances} {self.sharing}")
        if self.requests is not None:
            parts.append(f"requests={w(self.requests)}")
        if self.arrival_ms is not None:
            parts.append(f"arrival_ms={w(self.arrival_ms)}")
        parts += [f"{k}={getattr(self, k)}" for k in _LATE_AXES if getattr(self, k) != GRID_DEFAULTS[k]]
        parts += [f"{k}={w(v) if isinstance(v, tuple) else v}" for k, v in self.more]
        parts.append(f"rep={self.repetition}")
        return " ".join(parts)


@dataclass
class Sweep:
    path: Path
    name: str
    cells: list[Cell]
    traces: list[TraceSource]
    retries: int = 1
    notes: list[str] = field(default_factory=list)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def load_sweep(spec_path) -> Sweep:
    """Parse and expand a sweep spec. Every problem is a one-line ConfigError naming the spec."""
    path = Path(spec_path)
    where = str(path)
    why = not_regular(path)
    if why:
        raise ConfigError(f"{where}: {why}")
    try:
        doc = loads_bounded(tomllib.loads, path.read_text(encoding="utf-8"), f"{where}: the sweep spec", ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{where}: sweep spec not found") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the sweep spec ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not valid TOML ({e})") from None
    return expand_sweep(doc, path)


def expand_sweep(doc: dict, path) -> Sweep:
    path = Path(path)
    where = str(path)

    def fail(msg: str):
        raise ConfigError(f"{where}: {msg}")

    _unknown(doc, _TOP_KEYS, "top-level table", fail)
    head = _table(doc.get("sweep", {}), "[sweep]", fail)
    _unknown(head, _SWEEP_KEYS, "key in [sweep]", fail)
    reps = head.get("repetitions")
    if reps is not None and (not isinstance(reps, int) or isinstance(reps, bool) or not 1 <= reps <= MAX_REPETITIONS):
        fail(f"[sweep] repetitions must be an integer from 1 to {MAX_REPETITIONS}")
    retries = head.get("retries", 1)
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= MAX_RETRIES:
        fail(f"[sweep] retries must be an integer from 0 to {MAX_RETRIES}")
    max_memory = head.get("max_memory", DEFAULT_MAX_MEMORY)
    if isinstance(max_memory, str):
        try:
            max_memory = parse_size(max_memory, "[sweep] max_memory")
        except ConfigError as e:
            fail(str(e))
    elif not isinstance(max_memory, int) or isinstance(max_memory, bool) or max_memory <= 0:
        fail("[sweep] max_memory must be a size like \"4GiB\" or a number of bytes")

    traces = _traces(doc.get("trace"), path.parent, fail)
    backends = _backends(doc.get("backends"), fail)
    axes = _grid(doc.get("grid", {}), fail)
    grid_points = math.prod(len(v) for v in axes.values())
    _check_count(len(traces) * grid_points * sum(reps or default_repetitions(spec) for spec, _ in backends),
                 "cells (traces x backends x [grid] values x repetitions)", fail)

    names = list(axes)
    points = []
    for values in itertools.product(*(axes[n] for n in names)):
        p = dict(zip(names, values))
        more = sorted((k, p.pop(k)) for k in list(p) if k not in _FIRST_AXES + _LATE_AXES)
        point = dict(p, more=tuple((k, v) for k, v in more if v != GRID_DEFAULTS[k]))
        _check_point(point, max_memory, fail)
        points.append(point)
    cells = []
    for src in traces:
        tid = src.identity()
        for spec, optional in backends:
            for p in points:
                for rep in range(reps or default_repetitions(spec)):
                    cells.append(Cell(trace=src, trace_id=tid, backend=spec, optional=optional,
                                      max_memory=max_memory, repetition=rep, **p))
    return Sweep(path=path, name=str(head.get("name", path.stem)), cells=cells, traces=traces, retries=retries)


def default_repetitions(spec: str) -> int:
    """A cell's repetitions when ``[sweep] repetitions`` is not given: MEASURED_REPETITIONS on a
    backend whose figures this host measures or emulates (the report shows their spread), one in
    virtual time, which gives the same figures every time."""
    return 1 if BackendSpec.parse(spec).kind.virtual else MEASURED_REPETITIONS


def _check_count(n: int, what: str, fail) -> None:
    """Refuse a sweep of more than MAX_CELLS ``what``, counted before anything is expanded."""
    if n > MAX_CELLS:
        fail(f"{n:,} {what}; a sweep has at most {MAX_CELLS:,} cells: split it, or grid over fewer values")


def _unknown(d: dict, allowed, what: str, fail) -> None:
    extra = sorted(set(d) - set(allowed))
    if extra:
        fail(f"unknown {what} '{extra[0]}' (expected one of: {', '.join(sorted(allowed))})")


def _table(v, what: str, fail) -> dict:
    if not isinstance(v, dict):
        fail(f"{what} must be a table")
    return v


def _traces(raw, base: Path, fail) -> list[TraceSource]:
    if raw is None:
        fail("no [[trace]] given: list trace files (path = ...) or workloads to record (workload, model)")
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        fail("trace must be an array of tables ([[trace]])")
    out: list[TraceSource] = []
    seen = set()
    for i, t in enumerate(raw):
        what = f"[[trace]] #{i + 1}"
        _unknown(t, {"name", "path", "workload", "model", *RECORD_OPTIONS}, f"key in {what}", fail)
        if ("path" in t) == ("workload" in t):
            both = "both" if "path" in t else "neither"
            fail(f"{what} needs either path = FILE or workload = SPEC (with model), not {both}")
        if "path" in t:
            extra = sorted(set(t) - {"name", "path"})
            if extra:
                fail(f"{what}: '{extra[0]}' applies to recorded workloads, not to a trace file")
            p = Path(t["path"])
            p = p if p.is_absolute() else base / p
            if not p.is_file():
                fail(f"{what}: trace file {p} not found")
            expanded = [TraceSource(name=str(t.get("name", p.stem)), path=str(p))]
        else:
            if "model" not in t:
                fail(f"{what}: a workload to record needs model = NAME")
            if not isinstance(t["workload"], str) or not isinstance(t["model"], str):
                fail(f"{what}: workload and model must be strings")
            source = source_file(t["workload"])
            if source is not None:  # a file to read: there before anything is created
                why = not_regular(source) or (None if Path(source).is_file() else "not found")
                if why:
                    fail(f"{what}: workload file {source}: {why}")
            opts = {k: v for k, v in t.items() if k in RECORD_OPTIONS}
            grid = {k: (v if isinstance(v, list) else [v]) for k, v in opts.items()}
            for k, v in grid.items():
                if not v:
                    fail(f"{what}: {k} is an empty list")
            keys = sorted(grid)
            _check_count(len(out) + math.prod(len(v) for v in grid.values()), f"traces up to {what}", fail)
            expanded = []
            for values in itertools.product(*(grid[k] for k in keys)):
                o = dict(zip(keys, values))
                _check_recording(o, what, fail)
                varied = "".join(f"-{k}={o[k]}" for k in keys if len(grid[k]) > 1)
                name = str(t.get("name", f"{t['workload'].split(':')[-1]}-{t['model']}")) + varied
                expanded.append(TraceSource(name=name, record={"workload": t["workload"], "model": t["model"], **o}))
        for src in expanded:
            if src.name in seen:
                fail(f"{what}: trace name '{src.name}' is used twice; give name = ...")
            seen.add(src.name)
        out.extend(expanded)
    return out


def _check_recording(flat: dict, what: str, fail) -> None:
    """Check a trace's record options as kvemu.record will (RecordOptions.check: what needs no model
    and no workload), naming the spec's keys."""
    try:
        RecordOptions.from_flat(**flat).check()
    except OptionError as e:
        keys = {v: k for k, v in FLAT_FIELDS.items()}
        fail(f"{what}: {e.render(lambda name: keys.get(name, name))}")


def _backends(raw, fail) -> list[tuple[str, bool]]:
    if raw is None:
        fail("no [backends] given: use = [\"dram\", \"vemu:cxl-pool\", ...]")
    raw = _table(raw, "[backends]", fail)
    _unknown(raw, _BACKEND_KEYS, "key in [backends]", fail)
    out = []
    for key, optional in (("use", False), ("optional", True)):
        v = raw.get(key, [])
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            fail(f"[backends] {key} must be a list of backend specs")
        for s in v:
            try:
                BackendSpec.parse(s)
            except ConfigError as e:
                fail(str(e))
            if any(s == o for o, _ in out):
                fail(f"backend '{s}' is listed twice")
            out.append((s, optional))
    if not out:
        fail("[backends] lists no backend")
    return out


def _grid(raw, fail) -> dict:
    raw = _table(raw, "[grid]", fail)
    _unknown(raw, GRID_DEFAULTS, "key in [grid]", fail)
    axes = {}
    for k, default in GRID_DEFAULTS.items():
        if k not in raw:
            axes[k] = [default]
            continue
        v = raw[k] if isinstance(raw[k], list) else [raw[k]]
        if not v:
            fail(f"[grid] {k} is an empty list")
        axes[k] = [_grid_value(k, x, fail) for x in v]
        if len(set(map(str, axes[k]))) != len(axes[k]):
            fail(f"[grid] {k} lists a value twice")
    return axes


def _grid_value(k: str, x, fail):
    """A [grid] value as its replay option's field takes it: a size from ``"64GiB"``, a range from
    ``"0:50"``, None from the option's word for it (``"all"`` layers, ``"default"``). Whether the value is allowed is the
    options' own check (``_check_point``), not this."""
    o = SWEEPABLE[k]
    if o.default is None and x == o.none_word:
        return None
    try:
        if o.kind == "size" and isinstance(x, str):
            return parse_size(x, f"[grid] {k}")
        if o.kind == "range":
            return parse_range(x, f"[grid] {k}")
    except ConfigError as e:
        fail(str(e))
    return x


def _check_point(point: dict, max_memory: int, fail) -> None:
    """Check one grid point's replay options as kvemu.replay will (ReplayOptions.check), naming the
    [grid] keys in the message."""
    cell = Cell(trace=None, trace_id="", backend="", optional=False, max_memory=max_memory, repetition=0, **point)
    keys = {o.name: f"[grid] {k}" for k, o in SWEEPABLE.items()}
    keys["tier.max_memory_bytes"] = "[sweep] max_memory"
    try:
        cell.replay_options().check()
    except OptionError as e:
        fail(e.render(lambda name: keys.get(name, name)))


# ------------------------------------------------------------------------------------- resources
def cell_resources(backend_spec: str) -> dict:
    """Dask resources a cell needs, from its backend: the hardware it measures, one replay at a time.

    ``vemu`` runs in virtual time (no memory traffic, no waiting): it needs nothing and may run
    anywhere, next to anything. ``emu`` moves bytes in host memory and busy-waits on the clock,
    so it disturbs and is disturbed like ``dram``: it takes ``mem``.
    """
    return BackendSpec.parse(backend_spec).resources()


# -------------------------------------------------------------------------------------- dataset
def cell_folder(out, backend_spec: str, host: str, run_id: str) -> Path:
    """``OUT/backend=…/host=…/run_id=…`` of a cell that ran on ``host``."""
    return partition_folder(out, backend_spec, host, run_id)


def finished_path(out, cell: Cell) -> Path | None:
    """The results file of a finished cell, on whichever host it ran; None if not done. Files are
    written atomically, so one under its final name is complete."""
    pattern = (Path(glob.escape(str(out))) / f"backend={backend_label(cell.backend)}" / "host=*"
               / f"run_id={cell.run_id}" / "results.parquet")
    found = sorted(glob.glob(str(pattern)))
    return Path(found[0]) if found else None


# ---------------------------------------------------------------------------------- cost estimate
def estimate_seconds(cells: list[Cell]) -> list[float | None]:
    """Seconds per cell: bytes the replay moves / its backend kind's assumed_gbps + CELL_OVERHEAD_S.
    Bytes: the trace's blocks loaded, stored and read x replayed layers' share x requests' share.
    None for a trace still to record."""
    facts = {}
    out = []
    for c in cells:
        if c.trace.path is None:
            out.append(None)
            continue
        if c.trace.path not in facts:
            tr = read_trace(c.trace.path)
            s = trace_summary(tr)
            facts[c.trace.path] = (s["kv_bytes_loaded"] + s["kv_bytes_stored"] + s["kv_bytes_read"],
                                   tr.header.layers, tr.n_requests, tr.request_id, tr.arrival_ms)
        total, layers, n_req, rid, arr = facts[c.trace.path]
        share = (c.replay_layers or layers) / layers
        sel = n_req
        if c.requests:
            sel = int(((rid >= c.requests[0]) & (rid < c.requests[1])).sum())
        if c.arrival_ms:
            sel = min(sel, int(((arr >= c.arrival_ms[0]) & (arr < c.arrival_ms[1])).sum()))
        gbps = BackendSpec.parse(c.backend).kind.assumed_gbps
        out.append(CELL_OVERHEAD_S + total * share * (sel / max(n_req, 1)) / (gbps * 1e9))
    return out


def plan_lines(sweep: Sweep, out=None) -> list[str]:
    """The dry run: one line per cell, then the totals and the estimator used."""
    est = estimate_seconds(sweep.cells)
    lines = []
    todo_s, todo, unknown = 0.0, 0, 0
    for c, s in zip(sweep.cells, est):
        done = out is not None and finished_path(out, c) is not None
        res = ",".join(sorted(cell_resources(c.backend))) or "-"
        cost = "?" if s is None else f"{s:.1f}s"
        lines.append(f"{c.run_id} {'done' if done else 'todo'} ~{cost:>6} res={res}"
                     f"{' (optional)' if c.optional else ''} {c.describe()}")
        if not done:
            todo += 1
            if s is None:
                unknown += 1
            else:
                todo_s += s
    lines.append(f"{len(sweep.cells)} cells, {todo} to run, estimated {todo_s:.0f} s serial"
                 + (f" plus {unknown} cells on traces still to record" if unknown else "")
                 + " (estimator: bytes moved / assumed GB/s, docs/scale-out.md)")
    return lines


# ------------------------------------------------------------------------------------- one cell
def replay_cell(cell: Cell, trace_path, work_dir) -> dict:
    """Run one cell into ``work_dir``; return the results file's bytes and where it ran."""
    tmp = Path(work_dir) / f"{cell.run_id}.parquet"
    try:
        meta = replay(trace_path, cell.backend, cell.replay_options(), out=tmp)
        data = tmp.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)
    return {"results": data, "host": socket.gethostname(), "wall_s": meta["wall_s"]}


def _remote_cell(cell: Cell, trace_bytes: bytes) -> dict:
    """A Dask task: the trace comes as bytes (no shared file system needed), results go back as bytes."""
    from distributed import get_worker

    # in the worker's own folder of Dask's scratch space, which Dask purges once the worker is gone
    # (a worker killed mid-cell cannot remove it itself); not the host's /tmp
    with tempfile.TemporaryDirectory(prefix="kvemu-cell-", dir=getattr(get_worker(), "local_directory", None)) as d:
        trace_path = Path(d) / "trace.parquet"
        trace_path.write_bytes(trace_bytes)
        try:
            result = replay_cell(cell, trace_path, d)
        except BackendUnavailable as e:
            return {"unavailable": str(e), "host": socket.gethostname(), "worker": get_worker().address}
    result["worker"] = get_worker().address
    return result


def store_cell(out, cell: Cell, result: dict, executor: str) -> Path:
    """Write a cell's results into the dataset, atomically, with the sweep's facts in its metadata.
    ``run_id`` in the metadata becomes the cell's, as in its partition path; replay's own is kept."""
    table = read_verified_results(result["results"], f"cell {cell.key} from {result.get('worker') or result['host']}")
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    meta["sweep"] = {"version": SWEEP_META_VERSION, "cell": cell.key, "repetition": cell.repetition,
                     "params": cell.params(), "trace_name": cell.trace.name, "executor": executor,
                     "worker": result.get("worker"), "host": result["host"], "replay_run_id": meta.get("run_id")}
    meta["run_id"] = cell.run_id
    folder = cell_folder(out, cell.backend, result["host"], cell.run_id)
    made = make_folders(folder)
    path = folder / "results.parquet"
    schema = table.schema.with_metadata({METADATA_KEY: jsontext.dumps(meta, f"{path}: results metadata",
                                                                      sort_keys=True).encode()})
    try:
        with atomic_output(path) as tmp:
            write_results(tmp, table.cast(schema), schema.metadata)
    except BaseException:  # a full disk: the partition folders made for it go again
        remove_empty_folders(made)
        raise
    return path


# ------------------------------------------------------------------------------------------- run
def _check_out_folder(out: Path) -> None:
    """Refuse, before anything is created, an OUT that cannot become a writable folder: probed by
    creating a file in OUT or in its nearest existing ancestor (root passes ``os.access`` on a
    read-only file system)."""
    for place in (out, *out.absolute().parents):
        if os.path.lexists(place):
            break
    if not place.is_dir():
        what = "exists and is not a folder" if place == out else f"cannot be created: {place} is not a folder"
        raise OutputError(f"{out}: {what}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvemu-sweep-", suffix=".probe", dir=place)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        what = "results folder is not writable" if place == out else f"cannot be created in {place}"
        raise OutputError(f"{out}: {what} ({e.strerror or e})") from None


def _record_traces(sweep: Sweep, out, cells: list[Cell], log, created: list) -> dict:
    """Trace path per trace name; workloads to record are recorded once, into OUT/traces/."""
    paths = {}
    for src in sweep.traces:
        if src.path is not None:
            paths[src.name] = src.path
            continue
        p = src.recorded_path(out)
        if not p.exists() and any(c.trace is src for c in cells):
            created.extend(make_folders(p.parent))
            log(f"recording {src.name} -> {p}")
            r = dict(src.record)
            try:
                record(r.pop("workload"), r.pop("model"), p, RecordOptions.from_flat(show_progress=False, **r))
            except OptionError as e:  # named as the spec names it
                keys = {v: k for k, v in FLAT_FIELDS.items()}
                raise ConfigError(f"trace {src.name}: {e.render(lambda name: keys.get(name, name))}") from None
        paths[src.name] = str(p)
    return paths


def run_sweep(spec_path, out, executor: str = "local", log=None, progress=None, connect_timeout_s: float = 10.0,
              placement_timeout_s: float = 30.0, tls: dict | None = None, insecure: bool = False) -> dict:
    """Run a sweep's unfinished cells. Returns counts and the cells that failed or were skipped.

    ``log(message)`` gets one line per event (stderr in the CLI); ``progress`` is a
    kvemu.progress.Progress (cells done/total, ETA) or None. ``executor``, ``tls`` (the client's
    ``ca_file``, ``cert``, ``key``) and ``insecure``: :func:`parse_executor`.

    The spec, the executor and OUT are checked, and a Dask scheduler reached and asked for the
    resources the cells need, before any folder is created. A sweep refused or interrupted later
    removes the folders it created that are still empty.
    """
    sweep = load_sweep(spec_path)
    target = parse_executor(executor, tls, insecure)
    out = Path(out)
    _check_tier_files(sweep, spec_path, out)
    log = log or (lambda m: None)
    todo = [c for c in sweep.cells if finished_path(out, c) is None]
    summary = {"cells": len(sweep.cells), "already_done": len(sweep.cells) - len(todo), "ran": 0,
               "failed": [], "skipped": [], "out": str(out)}
    if not todo:
        return summary
    _check_out_folder(out)
    if progress is not None:
        progress.total = len(todo)
    created: list[Path] = []
    client = lock = dask_log = None
    try:
        if target != "local":
            dask_log = _dask_log(out).__enter__()  # Dask's own lines go to a file, not the terminal
            client = connect(target, connect_timeout_s)
            todo = _placeable(client, target, todo, placement_timeout_s, log, summary)
        created.extend(make_folders(out))
        lock = _lock_out(out)  # before anything under OUT is made or removed: one sweep per folder
        trace_paths = _record_traces(sweep, out, todo, log, created)
        if target == "local":
            _run_local(todo, trace_paths, out, log, progress, summary, created)
        elif _run_dask(client, sweep, todo, trace_paths, out, executor, log, progress, summary, placement_timeout_s):
            dask_log.keep()
            raise ComponentError(_scheduler_lost(target, spec_path, out, executor, tls, insecure, summary,
                                                 dask_log.path))
    except BaseException:  # a refusal, Ctrl-C, SIGTERM (kvemu.interrupt.Terminated), a scheduler lost
        _unlock_out(lock)
        _end_dask(client, dask_log)  # before the empty folders go: an unkept log leaves one empty
        remove_empty_folders(created)
        raise
    _end_dask(client, dask_log)
    _unlock_out(lock)
    # a sweep whose every cell failed (a full disk) or was skipped leaves no empty folder either
    remove_empty_folders(created)
    if progress is not None:
        progress.close(summary["ran"] + len(summary["failed"]) + len(summary["skipped"]))
    return summary


def _check_tier_files(sweep: Sweep, spec_path, out: Path) -> None:
    """No backend's tier file (``mmap:PATH,size=existing`` writes into PATH) is the spec, a trace
    the sweep replays or a results file under OUT (output.check_written_files); before anything."""
    inputs = [spec_path, *(src.path for src in sweep.traces if src.path is not None)]
    for b in sorted({c.backend for c in sweep.cells}):
        spec = BackendSpec.parse(b)
        check_written_files([(spec.name, f) for f in spec.files_written()], inputs=inputs, outputs=[out])


#: The lock file a running sweep holds in its output folder (fcntl.flock, exclusive): a second sweep
#: on the same folder is refused rather than sharing (and removing) its work folder.
LOCK_NAME = ".sweep.lock"


def _lock_out(out: Path) -> tuple[int, Path]:
    """Take the sweep lock of ``out`` (its :data:`LOCK_NAME`, created if missing); the open file's
    descriptor and path. OutputError in one line if another sweep holds it. A lock file removed by the sweep
    that held it (as it ends) while this one opened it is opened again: the lock is on the file
    that the name holds, not on a removed one."""
    path = out / LOCK_NAME
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise OutputError(f"{path}: cannot open the sweep's lock file ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputError(f"{out}: another sweep is running on this folder (it holds {LOCK_NAME}); wait for it "
                              f"to finish or give another --out (finished cells are kept)") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd, path
        os.close(fd)  # the holder removed the file as it ended: lock the new one
    raise OutputError(f"{path}: the sweep's lock file keeps changing; is another sweep starting and ending on it?")


def _unlock_out(lock: tuple[int, Path] | None) -> None:
    """Remove the lock file (while still holding it: a sweep that opened it meanwhile sees it gone
    and opens the name again) and release the lock."""
    if lock is None:
        return
    fd, path = lock
    with contextlib.suppress(OSError):
        if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.close(fd)


def _run_local(todo, trace_paths, out, log, progress, summary, created) -> None:
    work = out / ".sweep-work"
    created.extend(make_folders(work))
    try:
        for i, cell in enumerate(todo):
            try:
                result = replay_cell(cell, trace_paths[cell.trace.name], work)
            except BackendUnavailable as e:
                _unavailable(cell, str(e), log, summary)
            except KvemuError as e:
                summary["failed"].append({"run_id": cell.run_id, "cell": cell.describe(), "error": str(e)})
                log(f"failed {cell.run_id} ({cell.describe()}): {e}")
            else:
                store_cell(out, cell, result, "local")
                summary["ran"] += 1
            if progress is not None:
                progress(i + 1)
    finally:
        # the cell's files in it are gone (replay_cell and atomic_output remove theirs on the way out)
        with contextlib.suppress(OSError):
            work.rmdir()


def _unavailable(cell, why, log, summary) -> None:
    entry = {"run_id": cell.run_id, "cell": cell.describe(), "error": why}
    if cell.optional:
        summary["skipped"].append(entry)
        log(f"skipped optional {cell.run_id} ({cell.backend}): {why}")
    else:
        summary["failed"].append(entry)
        log(f"failed {cell.run_id} ({cell.describe()}): {why}")


def _placeable(client, target: DaskTarget, todo, placement_timeout_s, log, summary) -> list:
    """The cells some worker has the resources for. Dask would queue the others forever: a required
    one is refused (one line), an optional one skipped."""
    have = _cluster_resources(client, placement_timeout_s, {r for c in todo for r in cell_resources(c.backend)})
    runnable = []
    for c in todo:
        missing = [r for r in cell_resources(c.backend) if r not in have]
        if not missing:
            runnable.append(c)
        elif c.optional:
            _unavailable(c, f"no worker has resource '{missing[0]}'", log, summary)
        else:
            tls = " --tls-ca-file ... --tls-cert ... --tls-key ..." if target.tls else ""
            raise ConfigError(
                f"no worker of {target.address} has resource '{missing[0]}' needed by backend {c.backend}: start one "
                f"with dask worker {target.address}{tls} --resources \"{missing[0]}=1\", or list the backend under "
                f"[backends] optional")
    return runnable


#: The file in OUT that Dask's client logs to while a sweep runs on a cluster (its reconnection
#: attempts, tracebacks of a scheduler gone), kept and named only when the scheduler was lost.
DASK_LOG_NAME = "dask-client.log"


class _QuietFileHandler(logging.FileHandler):
    """Before OUT exists (while connecting) or on a full disk, a line is lost rather than raised
    into Dask's code (FileHandler opens its file outside its own error handling)."""

    def emit(self, record):
        try:
            super().emit(record)
        except Exception:  # noqa: BLE001 - see above
            pass

    def handleError(self, record):
        pass


class _dask_log:
    """Dask's own logging (``distributed``) into ``OUT/dask-client.log`` while the block runs, not
    to the terminal; the file is removed after it unless :meth:`keep` was called."""

    def __init__(self, out: Path):
        self.path = out / DASK_LOG_NAME
        self.kept = False

    def keep(self) -> None:
        self.kept = True

    def __enter__(self):
        import distributed  # noqa: F401 - its logging is configured on import (a handler per logger)

        self.handler = _QuietFileHandler(self.path, encoding="utf-8", delay=True)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        names = ["distributed"] + [n for n, lg in logging.root.manager.loggerDict.items()
                                   if n.startswith("distributed.") and isinstance(lg, logging.Logger) and lg.handlers]
        self.saved = {}
        for n in names:
            lg = logging.getLogger(n)
            self.saved[n] = lg.handlers[:]
            lg.handlers[:] = [self.handler]
        return self

    def __exit__(self, *exc) -> None:
        for n, handlers in self.saved.items():
            logging.getLogger(n).handlers[:] = handlers
        self.handler.close()
        if not self.kept:
            with contextlib.suppress(OSError):
                self.path.unlink()


def _end_dask(client, dask_log) -> None:
    """Closes the client, then gives Dask's logging back (its log file removed unless kept)."""
    try:
        if client is not None:
            _close_client(client)
    finally:
        if dask_log is not None:
            dask_log.__exit__(None, None, None)


def _close_client(client) -> None:
    """Closes the Dask client; one whose scheduler is gone closes without waiting for it."""
    if not _scheduler_gone(client):
        client.close()
        return
    try:
        client.close(timeout=2)
    except Exception:  # noqa: BLE001 - the scheduler is gone: nothing to close on its side
        pass


def _scheduler_gone(client) -> bool:
    """The client lost its scheduler (it is reconnecting, or gave up)."""
    return getattr(client, "status", "running") not in ("running", "newly-created")


def _scheduler_lost(target: DaskTarget, spec_path, out, executor, tls, insecure, summary, log_path) -> str:
    """The one line of a sweep whose Dask scheduler was lost: what finished, what to rerun."""
    import shlex

    finished = summary["already_done"] + summary["ran"]
    rest = summary["cells"] - finished - len(summary["skipped"])
    words = ["kvemu", "sweep", str(spec_path), "--out", str(out), "--executor", executor]
    for k, flag in (("ca_file", "--tls-ca-file"), ("cert", "--tls-cert"), ("key", "--tls-key")):
        if (tls or {}).get(k):
            words += [flag, str(tls[k])]
    if insecure:
        words.append("--insecure")
    return (f"the Dask scheduler at {target.address} stopped answering mid-sweep (its connection was lost); "
            f"{finished} of {summary['cells']} cells finished (their results are kept in {out}); rerun "
            f"{shlex.join(words)} to run the other {rest} (finished cells are skipped) once a scheduler is up "
            f"there; Dask's log: {log_path}")


def _run_dask(client, sweep, todo, trace_paths, out, executor, log, progress, summary,
              placement_timeout_s: float = 30.0) -> bool:
    """Runs the cells on the cluster; True if the scheduler was lost on the way (the cells still
    pending are then neither run nor failed: the caller says what to rerun)."""
    from distributed import wait

    traces = {}
    futures = {}
    for c in todo:
        if c.trace.name not in traces:
            data = Path(trace_paths[c.trace.name]).read_bytes()
            traces[c.trace.name] = client.scatter(data, hash=True)
        # pure=False with a stable key: a resubmitted sweep does not reuse another run's result
        fut = client.submit(_remote_cell, c, traces[c.trace.name], resources=cell_resources(c.backend) or None,
                            retries=sweep.retries, key=f"kvemu-cell-{c.run_id}-{os.urandom(4).hex()}",
                            pure=False)
        futures[fut] = c
    done = len(summary["skipped"])
    pending = set(futures)
    stranded_since: dict = {}  # a waiting cell's first moment with no worker offering its resources
    while pending:
        try:
            finished, pending = wait(pending, timeout=DEAD_WORKER_POLL_S, return_when="FIRST_COMPLETED")
        except TimeoutError:
            finished = set()
        except CancelledError:  # the scheduler cancelled some (their trace's only copy was on a worker that died)
            finished = {f for f in pending if f.done()}
            pending -= finished
        except (OSError, RuntimeError):  # the scheduler's connection closed under the wait
            if _scheduler_gone(client):
                return True
            raise
        if _scheduler_gone(client):
            # its futures are cancelled as "scheduler-connection-lost": not the cells' fault. The
            # results taken so far are stored; one not taken yet is on a worker the client can no
            # longer reach without the scheduler: that cell runs again at the rerun
            return True
        for fut in finished:
            _take_result(fut, futures[fut], out, executor, log, summary)
            done += 1
            if progress is not None:
                progress(done)
        try:
            stranded = _stranded(client, pending, futures, stranded_since, placement_timeout_s)
        except (OSError, RuntimeError):
            if _scheduler_gone(client):
                return True
            raise
        for fut in stranded:
            c = futures[fut]
            fut.cancel()
            pending.discard(fut)
            missing = ", ".join(sorted(r for r in cell_resources(c.backend)))
            why = (f"no worker has offered resource '{missing}' for {placement_timeout_s:g} s (its workers left or "
                   f"died); start one with dask worker ... --resources \"{missing}=1\" and rerun the sweep (finished "
                   "cells are kept)")
            summary["failed"].append({"run_id": c.run_id, "cell": c.describe(), "error": why})
            log(f"failed {c.run_id} ({c.describe()}): {why}")
            done += 1
            if progress is not None:
                progress(done)
    return False


#: How often a Dask sweep waiting for its cells checks that workers still offer their resources.
DEAD_WORKER_POLL_S = 0.5


def _stranded(client, pending, futures, since: dict, wait_s: float) -> list:
    """The waiting cells that no worker has offered the resources of for ``wait_s`` seconds: Dask
    would hold them for ever, waiting for a worker that may never come back."""
    wanted = {r for f in pending for r in cell_resources(futures[f].backend)}
    if not wanted:
        return []
    have = set()
    for w in client.scheduler_info(n_workers=-1)["workers"].values():
        have |= {r for r, n in (w.get("resources") or {}).items() if n >= 1}
    now = time.monotonic()
    out = []
    for f in pending:
        if set(cell_resources(futures[f].backend)) <= have:
            since.pop(f, None)
        elif now - since.setdefault(f, now) >= wait_s:
            out.append(f)
    return out


def _take_result(fut, c, out, executor, log, summary) -> None:
    try:
        result = fut.result()
    except Exception as e:  # noqa: BLE001 - a worker's error, KilledWorker, a cancelled task: the cell failed
        why = f"{type(e).__name__}: {e}"
        if isinstance(e, CancelledError):
            why = ("cancelled by the Dask scheduler (the worker that held its trace left or died); rerun the sweep "
                   f"(finished cells are kept) [{why}]")
        elif type(e).__name__ == "KilledWorker":  # the scheduler moved it to another worker, which died too
            why = (f"lost with its workers: each worker that ran it died ({' '.join(str(e).split())[:200]}); see "
                   "the workers' logs (memory?), then rerun the sweep (finished cells are kept)")
        summary["failed"].append({"run_id": c.run_id, "cell": c.describe(), "error": why})
        log(f"failed {c.run_id} ({c.describe()}): {why}")
        return
    if "unavailable" in result:
        _unavailable(c, f"{result['unavailable']} (worker {result['worker']})", log, summary)
    else:
        store_cell(out, c, result, executor)
        summary["ran"] += 1


def _cluster_resources(client, wait_s: float, wanted: set) -> set:
    """Resource names some worker offers. Workers may still be joining: wait up to ``wait_s``
    for the wanted ones, then answer with what is there."""
    deadline = time.monotonic() + wait_s
    while True:
        have = set()
        for w in client.scheduler_info(n_workers=-1)["workers"].values():
            have |= {r for r, n in (w.get("resources") or {}).items() if n >= 1}
        if wanted <= have or time.monotonic() >= deadline:
            return have
        time.sleep(0.5)
