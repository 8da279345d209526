"""The results dataset's layout (``kvemu replay --dataset``, sweeps): Hive partitions
``backend=…/host=…/run_id=…``, each value a safe single path component."""

from __future__ import annotations

import re
import socket

from pathlib import Path

from ..backend_spec import BackendSpec


def partition_value(text: str) -> str:
    """A Hive partition value that is a safe single path component."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "unknown"


def backend_label(backend_spec: str) -> str:
    """The backend partition value: the spec without paths (``emu:cxl-pool`` -> ``emu-cxl-pool``)."""
    return partition_value(BackendSpec.parse(backend_spec).partition_label())


def partition_folder(dataset, backend_spec: str, host: str, run_id: str) -> Path:
    """``DATASET/backend=…/host=…/run_id=…``: the layout DuckDB, Polars, pandas and pyarrow read as
    one table with those three partition columns."""
    return (Path(dataset) / f"backend={backend_label(backend_spec)}" / f"host={partition_value(host)}"
            / f"run_id={run_id}")


def dataset_path(dataset, backend_spec: str, run_id: str) -> Path:
    """Where a run of this host goes in a results dataset: its partition folder's results.parquet
    (not created here: see output.make_folders)."""
    return partition_folder(dataset, backend_spec, socket.gethostname(), run_id) / "results.parquet"
