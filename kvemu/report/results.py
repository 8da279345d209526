"""Reading kvemu results files: validate a file's footer and columns, upgrade its metadata, and
find the results files among files and folders."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ResultsError
from ..figures import figures_of
from ..inputs import loads_bounded, not_regular
from ..metrics import DISAGG_COLUMNS, SESSION_COLUMNS
from ..integrity import READ_OPTIONS, decode_error, metadata_digest, read_digest, verify_columns
from ..schema import METADATA_KEY, RESULTS_FORMAT, SUPPORTED_RESULTS_VERSIONS
from ..validation import check_results_meta, check_results_table, check_results_tokens
from .common import lookup as _get

#: The ``format`` value in a results file's ``kvemu`` metadata, and the versions this module reads.

#: Columns a results file must have, with a predicate on their Arrow type and its description.
_FLOAT = (pa.types.is_floating, "a floating-point column")
_INT = (pa.types.is_integer, "an integer column")
_FLOAT_LIST = (
    lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t))
    and pa.types.is_floating(t.value_type),
    "a list of floating-point values",
)
REQUIRED_COLUMNS: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "request_id": _INT,
    "arrival_ms": _FLOAT,
    "input_tokens": _INT,
    "output_tokens": _INT,
    "cached_tokens": _INT,
    "ttft_ms": _FLOAT,
    "tpot_ms": _FLOAT,
    "e2el_ms": _FLOAT,
    "queue_ms": _FLOAT,
    "compute_ms": _FLOAT,
    "kv_load_ms": _FLOAT,
    "kv_store_ms": _FLOAT,
    "kv_read_ms": _FLOAT,
    "kv_stall_ms": _FLOAT,
    "kv_bytes_loaded": _INT,
    "kv_bytes_stored": _INT,
    "kv_bytes_read": _INT,
    "itl_ms": _FLOAT_LIST,
}

#: Columns read when a results file has them (the reuse split as the replay saw it: results of older
#: kvemu lack them), with their types; docs/replay.md "Results file".
OPTIONAL_COLUMNS: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "hbm_hit_tokens": _INT,
    "tier_hit_tokens": _INT,
    "recomputed_tokens": _INT,
    # a disaggregated replay (--prefill-instances/--decode-instances): docs/replay.md
    **{name: _INT for name in DISAGG_COLUMNS},
    # a trace with sessions (kvemu.sessions): each request's session and turn index
    **{name: _INT for name in SESSION_COLUMNS},
}

#: Metadata entries a results file must carry, as dotted paths into the ``kvemu`` object.
REQUIRED_METADATA = ("label", "backend.spec", "backend.mode", "trace.sha256", "duration_s")

#: Backend modes: ``measured`` accesses the tier itself, ``emulated`` models one (with delays on
#: this host, or in virtual time: ``backend.virtual``); :mod:`kvemu.figures` tells the three kinds
#: of KV figures apart.
MODES = ("measured", "emulated")

#: KV operations whose totals and latency percentiles the results metadata records under ``ops``.
KV_OPS = ("load", "store", "read")

#: Latency percentiles per KV operation, as recorded in ``ops.<op>.<stat>_ns``.
KV_OP_PERCENTILES = ("p50", "p99", "p999")

#: Hex digits of the trace SHA-256 shown to people.
SHORT_SHA_LEN = 12


#: A disaggregated run's deployment by its transfer path (results ``schedule.disagg.transfer.path``).
DEPLOYMENTS = {"rdma": "disaggregated over RDMA", "rdma-pull": "disaggregated over RDMA (pull)",
               "pool": "disaggregated through the pool",
               "pool-serial": "disaggregated through the pool (serial stores)",
               "host": "disaggregated through host DRAM"}


class _NotResults(ResultsError):
    """The file is not a kvemu results file at all (a folder scan skips it rather than failing).
    ``is_trace``: it is a kvemu trace (a folder of runs often holds their traces: not worth a note)."""

    is_trace = False


# --------------------------------------------------------------------------------------------
# Reading results files


@dataclass(frozen=True, eq=False)
class Run:
    """One results file: its ``kvemu`` metadata (upgraded to the current version) and its rows."""

    path: str
    meta: Mapping[str, Any]
    table: pa.Table

    @property
    def label(self) -> str:
        return str(self.meta["label"])

    @property
    def run_id(self) -> str | None:
        return self.meta.get("run_id")

    @property
    def backend_spec(self) -> str:
        return str(self.meta["backend"]["spec"])

    @property
    def backend_name(self) -> str:
        return str(self.meta["backend"].get("name") or self.backend_spec)

    @property
    def mode(self) -> str:
        return str(self.meta["backend"]["mode"])

    @property
    def is_emulated(self) -> bool:
        """Whether the KV times model a tier (emulated or virtual) rather than measure one."""
        return self.mode == "emulated"

    @cached_property
    def figures(self) -> dict[str, Any]:
        """How the run's KV figures were obtained and what bounded them
        (:func:`kvemu.figures.figures_of`): the block the results carry, or derived from them."""
        return figures_of(self.meta)

    @property
    def kind(self) -> str:
        """``measured``, ``emulated`` or ``virtual`` (see :mod:`kvemu.figures`)."""
        return str(self.figures["kind"])

    @property
    def is_measured(self) -> bool:
        """Whether the KV accesses were performed and timed on this host (not emulated, not
        virtual): the runs a default baseline is chosen from."""
        return self.mode == "measured" and self.kind == "measured"

    @property
    def trace_sha256(self) -> str:
        return str(self.meta["trace"]["sha256"])

    @property
    def workload_kind(self) -> str:
        return str(_get(self.meta, "trace.workload.kind") or "?")

    @property
    def tier_policy(self) -> str:
        return str(_get(self.meta, "trace.engine.tier_policy") or "?")

    @property
    def model_name(self) -> str:
        return str(_get(self.meta, "trace.model.name") or "?")

    @property
    def trace_description(self) -> str:
        """Short SHA, workload kind and tier policy: what tells traces apart at a glance."""
        return f"{self.trace_sha256[:SHORT_SHA_LEN]} {self.workload_kind} {self.tier_policy}"

    @property
    def duration_s(self) -> float:
        return float(self.meta["duration_s"])

    @property
    def dedup_ratio(self) -> float:
        return _number(_get(self.meta, "trace.summary.dedup_ratio"))

    @property
    def kv_stall_share(self) -> float:
        """Share of all step time by which KV work extended steps beyond compute."""
        total = _number(_get(self.meta, "steps.total_ns"))
        stall = _number(_get(self.meta, "steps.kv_stall_ns"))
        return stall / total if total > 0 else math.nan

    @property
    def repetitions(self) -> list[dict]:
        """The figures of every repetition of this run's configuration (``replay --repeat``, or the
        repetitions of a sweep cell the report folded into this run); [] for a single run."""
        reps = self.meta.get("repetitions") or {}
        runs = reps.get("runs") if isinstance(reps, dict) else None
        return list(runs) if isinstance(runs, list) and len(runs) > 1 else []

    def spread(self, figure: str) -> tuple[float, float] | None:
        """(min, max) of ``figure`` over the repetitions, or None without repetitions."""
        values = [_number(r.get(figure)) for r in self.repetitions]
        values = [v for v in values if not math.isnan(v)]
        return (min(values), max(values)) if values else None

    @property
    def disagg(self) -> Mapping[str, Any] | None:
        """The deployment of a disaggregated replay (results ``schedule.disagg``: prefill and
        decode instances, the transfer path, GPU busy per pool); None for a colocated run."""
        d = _get(self.meta, "schedule.disagg")
        return d if isinstance(d, Mapping) else None

    @property
    def gpus_per_instance(self) -> int:
        """GPUs of one instance: the trace's ``gpu.gpus`` (1 when it does not say)."""
        g = _get(self.meta, "trace.gpu.gpus")
        return g if isinstance(g, int) and not isinstance(g, bool) and g > 0 else 1

    @property
    def total_gpus(self) -> int:
        """GPUs of the whole deployment: instances x GPUs each; a disaggregated run's instances
        are its prefill and decode instances together."""
        d = self.disagg
        n = 0
        if d is not None:  # an ill-formed count adds nothing; none at all: the instances below
            n = sum(v for v in (d.get("prefill_instances"), d.get("decode_instances"))
                    if isinstance(v, int) and not isinstance(v, bool) and v > 0)
        if not n:
            n = _get(self.meta, "params.instances")
            n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        return n * self.gpus_per_instance

    @property
    def deployment(self) -> str:
        """``colocated``, or ``disaggregated over RDMA`` (``(pull)``), ``through the pool`` or
        ``through host DRAM`` by the transfer path of ``schedule.disagg``."""
        d = self.disagg
        if d is None:
            return "colocated"
        path = str(_get(d, "transfer.path") or "?")
        return DEPLOYMENTS.get(path, f"disaggregated over {path}")

    def kv_op(self, op: str) -> dict[str, float]:
        """``gbps`` and ``p50_ns``/``p99_ns``/``p999_ns`` of KV operation ``op``; NaN if absent."""
        entry = _get(self.meta, f"ops.{op}") or {}
        stats = {"gbps": _number(entry.get("gbps"))}
        for p in KV_OP_PERCENTILES:
            stats[f"{p}_ns"] = _number(entry.get(f"{p}_ns"))
        return stats


def read_results(path: str | os.PathLike) -> Run:
    """Read one kvemu results file, validating its footer before loading any data.

    Raises :class:`ResultsError` with a one-line message naming the file when it cannot be read,
    is not Parquet, has no ``kvemu`` metadata or another format, has an unsupported version, or
    lacks a required column or metadata entry.
    """
    path = os.fspath(path)
    meta, raw, digest, optional = _read_footer(path)
    try:
        # every page against its checksum (files written before kvemu wrote them have none)
        table = pq.read_table(path, columns=[*REQUIRED_COLUMNS, *optional], **READ_OPTIONS)
    except (OSError, pa.ArrowException) as exc:
        raise ResultsError(f"{path}: cannot read results data: {decode_error(exc)}") from None
    if digest is not None:
        wrong = verify_columns(digest, raw, table)
        if wrong:
            raise ResultsError(f"{path}: {wrong} (the file is corrupt)")
    check_results_table(path, table)
    check_results_tokens(path, table)
    check_results_meta(path, meta)
    _check_disagg(path, table)
    return Run(path=path, meta=meta, table=table)


def _check_disagg(path: str, table: pa.Table) -> None:
    """A disaggregated run's per-request columns: no nulls, none negative (they are instances,
    bytes, times and block counts; a prefill_instance of -1 is a request prefilled where it was
    decoded); a TTFT part without the other three is no split."""
    for name in DISAGG_COLUMNS:
        if name not in table.column_names:
            continue
        col = table.column(name)
        if col.null_count:
            raise ResultsError(f"{path}: column '{name}' has nulls")
        # prefill_instance is -1 for a request served where it arrived (conditional disaggregation)
        if np.any(col.to_numpy(zero_copy_only=False) < (-1 if name == "prefill_instance" else 0)):
            least = "-1 (served where it arrived)" if name == "prefill_instance" else "0"
            raise ResultsError(f"{path}: column '{name}' must hold values >= {least}")
    parts = [n for n in DISAGG_COLUMNS if n.startswith("ttft_")]
    have = [n for n in parts if n in table.column_names]
    if have and len(have) != len(parts):
        missing = next(n for n in parts if n not in have)
        raise ResultsError(f"{path}: results have TTFT parts but not '{missing}' (a disaggregated replay "
                           f"writes all of {', '.join(parts)})")


def _read_footer(path: str) -> tuple[dict, bytes, dict | None, list]:
    """The ``kvemu`` metadata of a results file, validated against the footer and upgraded; its raw
    bytes; the file's content digest (None without one; kvemu/integrity.py); the OPTIONAL_COLUMNS
    it has."""
    if os.path.isdir(path):
        raise ResultsError(f"{path}: is a folder, not a results file")
    why = not_regular(path)
    if why:
        raise ResultsError(f"{path}: {why}")
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
        digest = read_digest(pf)
    except FileNotFoundError:
        raise ResultsError(f"{path}: no such file") from None
    except PermissionError:
        raise ResultsError(f"{path}: permission denied") from None
    except (OSError, pa.ArrowException):
        raise _NotResults(f"{path}: not a Parquet file") from None

    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise _NotResults(f"{path}: not a kvemu results file (no 'kvemu' schema metadata)")
    if isinstance(digest, str):
        raise ResultsError(f"{path}: {digest}")
    if digest is not None and digest["metadata"] != metadata_digest(raw):
        raise ResultsError(f"{path}: 'kvemu' metadata does not match the file's content digest (the file is corrupt)")
    try:
        meta = loads_bounded(json.loads, raw, f"{path}: 'kvemu' schema metadata", ResultsError)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ResultsError(f"{path}: 'kvemu' schema metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise ResultsError(f"{path}: 'kvemu' schema metadata is not a JSON object")
    fmt = meta.get("format")
    if fmt != RESULTS_FORMAT:
        exc = _NotResults(f"{path}: not a kvemu results file (format is {fmt!r}, expected '{RESULTS_FORMAT}')")
        exc.is_trace = fmt == "kvemu.trace"
        raise exc
    version = meta.get("version")
    if type(version) is not int or version not in SUPPORTED_RESULTS_VERSIONS:
        supported = ", ".join(str(v) for v in SUPPORTED_RESULTS_VERSIONS)
        raise ResultsError(
            f"{path}: results format version {version!r} is not supported "
            f"(this kvemu reads version {supported})"
        )
    meta = _upgrade(meta)

    for name, (is_expected, expected) in REQUIRED_COLUMNS.items():
        index = schema.get_field_index(name)
        if index < 0:
            raise ResultsError(f"{path}: results file is missing required column '{name}'")
        actual = schema.field(index).type
        if not is_expected(actual):
            raise ResultsError(f"{path}: column '{name}' has type {actual}, expected {expected}")
    optional = []
    for name, (is_expected, expected) in OPTIONAL_COLUMNS.items():
        index = schema.get_field_index(name)
        if index >= 0:
            if not is_expected(schema.field(index).type):
                raise ResultsError(f"{path}: column '{name}' has type {schema.field(index).type}, expected {expected}")
            optional.append(name)
    for entry in REQUIRED_METADATA:
        if _get(meta, entry) in (None, ""):
            raise ResultsError(f"{path}: 'kvemu' metadata is missing '{entry}'")
    mode = meta["backend"]["mode"]
    if mode not in MODES:
        raise ResultsError(
            f"{path}: backend mode {mode!r} is not one of {', '.join(repr(m) for m in MODES)}"
        )
    duration = meta["duration_s"]
    if not (isinstance(duration, (int, float)) and math.isfinite(duration) and duration > 0):
        raise ResultsError(f"{path}: duration_s must be a positive number, got {duration!r}")
    return meta, raw, digest, optional


def _upgrade(meta: dict) -> dict:
    """Metadata of any supported version, rewritten to the current version's layout.

    The one place where versions differ; version 1 is current, so there is nothing to do yet.
    """
    return meta


def discover_results(paths: Iterable[str | os.PathLike]) -> tuple[list[Run], list[tuple[str, str]]]:
    """Runs from result files and folders, and the files skipped with why.

    A folder is searched recursively for ``*.parquet``; a Parquet file there that is not a kvemu
    results file is skipped (and listed, unless it is a kvemu trace), while a results file that cannot be read is
    an error. A file named explicitly must be a results file. A file reached twice is read once.
    """
    runs: list[Run] = []
    skipped: list[tuple[str, str]] = []
    seen: set[str] = set()
    run_files: set[str] = set()

    def add(path: str, explicit: bool) -> None:
        key = os.path.realpath(path)
        if key in run_files or (key in seen and not explicit):
            return
        seen.add(key)
        try:
            runs.append(read_results(path))
        except _NotResults as exc:
            if explicit:
                raise
            if not exc.is_trace:
                skipped.append((path, str(exc).removeprefix(f"{path}: ")))
        else:
            run_files.add(key)

    for given in paths:
        path = os.fspath(given)
        if os.path.isdir(path):
            found = sorted(str(p) for p in Path(path).rglob("*.parquet") if p.is_file())
            for file in found:
                add(file, explicit=False)
            if not any(os.path.realpath(file) in run_files for file in found):
                raise ResultsError(f"{path}: no kvemu results files in this folder")
        else:
            add(path, explicit=True)
    return runs, skipped


# --------------------------------------------------------------------------------------------
# Small helpers


def _number(value: Any) -> float:
    """A metadata number as float; NaN when absent or not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    return float(value)
