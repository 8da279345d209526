"""The report's capacity curve of a trace, kept between reports (docs/report.md, "The capacity cache").

What a trace's capacity section needs that does not depend on the runs (the LRU capacity curve,
and per capacity and request the modelled prefill compute and the bytes a cached prefix loads) is
computed once per trace and kept in ``$XDG_CACHE_HOME/kvemu/capacity/`` (``~/.cache/kvemu/capacity/``
without it), one file per trace content digest (SHA-256 of the trace file) and set of curve
parameters. A later report of that trace reads it back instead of reading the trace and computing
again; only the TTFT at the baseline run's bandwidth is computed, in numpy.

An entry is written atomically (a temporary file in the folder, renamed over the entry). It is
used only when it names the trace digest and parameters asked for and its own checksum matches
its contents; anything else (a truncated, foreign or corrupt file) is ignored, computed again
and replaced. ``KVEMU_NO_CACHE=1`` (or ``kvemu report --no-cache``) neither reads nor writes
it; deleting the folder clears it.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import jsontext
from ..errors import OutputError

#: The format of an entry and of the rules that made it: bumped when either changes, so an
#: entry made by other rules is never read as this one's.
FORMAT = 2
#: Environment variable that turns the cache off (any value but "", "0").
DISABLE_ENV = "KVEMU_NO_CACHE"
#: The cache's folder under the user's cache home.
SUBDIR = ("kvemu", "capacity")
#: The curve's keys an entry must hold.
CURVE_KEYS = ("capacity_blocks", "capacity_tokens", "capacity_bytes", "hit_ratio", "unbounded_hit_ratio",
              "saturation_blocks", "references", "unique_blocks")


def enabled(option: bool = True) -> bool:
    """Whether the cache is used: ``option`` (False: --no-cache) and the environment don't turn it off."""
    return option and os.environ.get(DISABLE_ENV, "") in ("", "0")


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvemu/capacity`` (an absolute XDG_CACHE_HOME only, as the XDG spec says),
    else ``~/.cache/kvemu/capacity``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root.joinpath(*SUBDIR)


@dataclass(frozen=True)
class Entry:
    """A trace's capacity curve and the bandwidth-free parts of its modelled TTFT."""

    trace_sha256: str
    params: dict
    curve: dict
    has_gpu: bool                  # the trace has a GPU compute model (else no TTFT parts)
    compute_ns: np.ndarray         # int64 [capacities, requests]; empty without a GPU model
    load_bytes: np.ndarray         # int64 [capacities, requests]
    earlier_hit_tokens: np.ndarray  # int64 [requests]: analysis.prefix_hit_tokens_unbounded


def _key(sha: str, params: dict) -> str:
    digest = hashlib.sha256(jsontext.dumps(params, "the curve cache key", sort_keys=True).encode()).hexdigest()[:16]
    return f"{sha}-{digest}.npz"


def path_of(sha: str, params: dict) -> Path:
    return cache_dir() / _key(sha, params)


def _checksum(meta_text: str, *arrays: np.ndarray) -> str:
    h = hashlib.sha256(meta_text.encode())
    for a in arrays:
        h.update(repr(a.shape).encode())
        h.update(np.ascontiguousarray(a, "<i8").tobytes())
    return h.hexdigest()


def load(sha: str, params: dict) -> Entry | None:
    """The entry for this trace digest and parameters, or None when there is none or it is not
    sound (not an entry, another trace's or parameters', a checksum that does not match)."""
    path = path_of(sha, params)
    try:
        with open(path, "rb") as f:
            data = f.read()
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta_text = str(z["meta"][()])
            compute, loaded, earlier = z["compute_ns"], z["load_bytes"], z["earlier_hit_tokens"]
            checksum = str(z["checksum"][()])
        meta = json.loads(meta_text)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("trace_sha256") != sha \
                or meta.get("params") != params:
            return None
        curve = meta.get("curve")
        if not isinstance(curve, dict) or any(k not in curve for k in CURVE_KEYS):
            return None
        if compute.dtype != np.int64 or loaded.dtype != np.int64 or compute.shape != loaded.shape \
                or earlier.dtype != np.int64 or earlier.ndim != 1 or np.any(earlier < 0):
            return None
        has_gpu = meta.get("has_gpu")
        if not isinstance(has_gpu, bool) or (has_gpu and compute.shape[0] != len(curve["capacity_blocks"])):
            return None
        if _checksum(meta_text, compute, loaded, earlier) != checksum:
            return None
        return Entry(sha, params, curve, has_gpu, compute, loaded, earlier)
    except Exception:  # noqa: BLE001 - an unreadable entry of any kind is computed again
        return None


def store(entry: Entry) -> Path | None:
    """Write ``entry`` atomically; None when the cache folder cannot be written (the report goes
    on without it)."""
    folder = cache_dir()
    try:  # strict JSON: a curve with a non-finite figure is not kept (it is computed again next time)
        meta_text = jsontext.dumps({"format": FORMAT, "trace_sha256": entry.trace_sha256, "params": entry.params,
                                    "curve": entry.curve, "has_gpu": entry.has_gpu}, "the curve cache entry",
                                   sort_keys=True)
    except OutputError:
        return None
    compute = np.ascontiguousarray(entry.compute_ns, np.int64)
    loaded = np.ascontiguousarray(entry.load_bytes, np.int64)
    earlier = np.ascontiguousarray(entry.earlier_hit_tokens, np.int64)
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=folder)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.array(meta_text), compute_ns=compute, load_bytes=loaded, earlier_hit_tokens=earlier,
                     checksum=np.array(_checksum(meta_text, compute, loaded, earlier)))
            f.flush()
            os.fsync(f.fileno())
        final = path_of(entry.trace_sha256, entry.params)
        os.replace(tmp, final)
        tmp = None
        return final
    except OSError:
        return None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def describe() -> dict[str, Any]:
    """Where the cache is and whether it is on (for --help and the docs)."""
    return {"folder": str(cache_dir()), "enabled": enabled()}
