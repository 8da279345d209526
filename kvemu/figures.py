"""How a run's KV figures were obtained and what bounded them: the ``figures`` block of a results
file, derived from the rest of its ``kvemu`` metadata (docs/report.md, "How the figures were
obtained").

Three kinds of KV figures:

* ``measured``: the accesses were performed on this host's memory or storage and timed. When this
  host's CPU workers could not supply what the modelled GPU link would carry (``datapath``: the
  share of KV time bound by the medium side), the times are an upper bound of the tier's.
* ``emulated`` (``emu``): the bytes moved on this host, then the backend waited until a tier
  profile's time; never faster than this host. Accesses where this host was slower than the
  profile (``floor_hits``) took this host's time, so the run's times are then an upper bound.
* ``virtual`` (``vemu``): the profile's model computed in virtual time; no data moved, nothing
  waited, and nothing here bounds it.

GPU compute time is modelled (docs/engine.md) in every kind, unless the trace was recorded from a
real run, whose recorded step times are replayed (docs/sources.md). Metadata is untrusted input:
a value of the wrong type counts as missing, and nothing here raises on it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .backend_spec import known_kind

#: How the KV figures of a run were obtained, by ``backend.mode`` and ``backend.virtual``.
KINDS = ("measured", "emulated", "virtual")

#: Flags, in the order they are listed: what bounded the figures, and a NUMA run that is local.
FLAGS = ("host-bound", "floor-limited", "local")

#: Flags that make a run's KV times an upper bound of the tier's.
UPPER_BOUND_FLAGS = ("host-bound", "floor-limited")

#: A measured run is host-bound from this share of its KV time bound by the host's side.
HOST_BOUND_SHARE = 0.05

#: An emulated run is floor-limited from this share of its accesses slower than the profile.
FLOOR_LIMITED_SHARE = 0.01

#: The keys of a figures block, in order.
FIGURE_KEYS = ("kind", "compute", "floor_share", "host_bound_share", "locality", "flags",
               "upper_bound", "label")

#: ``workload.kind`` of traces recorded from a real run, whose compute times were recorded.
REAL_RUN_KINDS = ("realrun:tiny", "realrun:hf", "vllm-events")

#: ``backend.facts.mode`` of virtual-time backends (results before ``backend.virtual`` existed).
VIRTUAL_FACTS_MODE = "emulated-virtual"


def run_figures(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The figures block of a results file's ``kvemu`` metadata (see :data:`FIGURE_KEYS`):
    ``kind`` (one of :data:`KINDS`, None when ``backend.mode`` is neither ``measured`` nor
    ``emulated``), ``compute`` (``modelled`` or ``recorded``), ``floor_share`` (emulated runs),
    ``host_bound_share`` (measured runs with ``datapath``), ``locality`` (``numa`` runs),
    ``flags`` (a subset of :data:`FLAGS`), ``upper_bound`` and a short human ``label``."""
    meta = meta if isinstance(meta, Mapping) else {}
    backend = _mapping(meta.get("backend"))
    facts = _mapping(backend.get("facts"))
    kind = _kind(backend, facts)
    floor = _floor_share(facts) if kind == "emulated" else None
    host = _host_bound_share(meta.get("datapath")) if kind == "measured" else None
    locality = _locality(backend, facts)

    flags = []
    if host is not None and host >= HOST_BOUND_SHARE:
        flags.append("host-bound")
    if floor is not None and floor >= FLOOR_LIMITED_SHARE:
        flags.append("floor-limited")
    if locality == "local":
        flags.append("local")
    upper = any(f in UPPER_BOUND_FLAGS for f in flags)

    parts = [kind or "unknown"]
    transport, wire = facts.get("transport"), facts.get("wire")
    if kind == "measured" and isinstance(transport, str) and isinstance(wire, str) and wire:
        parts.append(f"{transport} over {wire.split()[0]}")  # a storage stack's (mooncake): what carried the bytes
    if locality == "local":
        parts.append("numa local")
    if "host-bound" in flags:
        parts.append(f"host-bound {_percent(host)}")
    if "floor-limited" in flags:
        parts.append(f"floor-limited {_percent(floor)}")
    label = ", ".join(parts) + (" (upper bound)" if upper else "")
    return {"kind": kind, "compute": _compute(meta), "floor_share": floor,
            "host_bound_share": host, "locality": locality, "flags": flags,
            "upper_bound": upper, "label": label}


def figures_of(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The figures block a results file carries (``figures``) when it is well formed and agrees
    with its ``backend.mode``; else :func:`run_figures` of its metadata (older results)."""
    meta = meta if isinstance(meta, Mapping) else {}
    stored = meta.get("figures")
    if _well_formed(stored, _mapping(meta.get("backend")).get("mode")):
        return {key: list(stored[key]) if key == "flags" else stored[key] for key in FIGURE_KEYS}
    return run_figures(meta)


def _kind(backend: Mapping[str, Any], facts: Mapping[str, Any]) -> str | None:
    mode = backend.get("mode")
    if mode == "measured":
        return "measured"
    if mode != "emulated":
        return None
    virtual = backend.get("virtual")
    if not isinstance(virtual, bool):  # results written before backend.virtual
        virtual = facts.get("mode") == VIRTUAL_FACTS_MODE
    return "virtual" if virtual else "emulated"


def _floor_share(facts: Mapping[str, Any]) -> float | None:
    """Share of an emulated run's accesses that took this host's time, not the profile's."""
    hits, accesses = _count(facts.get("floor_hits")), _count(facts.get("accesses"))
    if hits is None or accesses is None or accesses == 0 or hits > accesses:
        return None
    return hits / accesses


def _host_bound_share(datapath: Any) -> float | None:
    """Share of a measured run's KV time bound by the host's side of the data path: the sum of
    ``medium_bound_ns`` over the ops of ``datapath`` over the sum of their ``time_ns``. An op
    whose two figures are not numbers with 0 <= bound <= time is left out."""
    ops = _mapping(_mapping(datapath).get("ops"))
    bound = total = 0.0
    for entry in ops.values():
        entry = _mapping(entry)
        time_ns, bound_ns = _number(entry.get("time_ns")), _number(entry.get("medium_bound_ns"))
        if time_ns is None or bound_ns is None or not 0 <= bound_ns <= time_ns:
            continue
        bound += bound_ns
        total += time_ns
    return bound / total if total > 0 else None


def _locality(backend: Mapping[str, Any], facts: Mapping[str, Any]) -> str | None:
    """``local`` when a numa run's arena is on the replaying CPU's own node, ``remote`` when
    the CPU ran on another node; None for other backends or when the facts do not say."""
    names = (backend.get("name"), facts.get("backend"),
             str(backend.get("spec") or "").partition(":")[0])

    if not any(known_kind(n) is not None and known_kind(n).locality for n in names):
        return None
    remote = facts.get("remote_cpu")
    if not isinstance(remote, bool):
        return None
    return "remote" if remote else "local"


def _compute(meta: Mapping[str, Any]) -> str:
    """``recorded`` for a trace of a real run without a GPU model, else ``modelled``."""
    trace = _mapping(meta.get("trace"))
    kind = _mapping(trace.get("workload")).get("kind")
    if kind in REAL_RUN_KINDS and not _mapping(trace.get("gpu")):
        return "recorded"
    return "modelled"


def _well_formed(figures: Any, mode: Any) -> bool:
    """Whether a stored figures block has every key with a value of its type, and a kind that
    ``backend.mode`` allows."""
    if not isinstance(figures, Mapping) or set(figures) != set(FIGURE_KEYS):
        return False
    kind, flags = figures["kind"], figures["flags"]
    allowed = {"measured": ("measured",), "emulated": ("emulated", "virtual")}.get(mode, ())
    shares_ok = all(
        figures[key] is None or (_number(figures[key]) is not None and 0 <= figures[key] <= 1)
        for key in ("floor_share", "host_bound_share"))
    flags_ok = (isinstance(flags, list) and all(isinstance(f, str) and f in FLAGS for f in flags)
                and len(set(flags)) == len(flags))
    return (kind in allowed and shares_ok and flags_ok
            and figures["compute"] in ("modelled", "recorded")
            and figures["locality"] in ("local", "remote", None)
            and figures["upper_bound"] is any(f in UPPER_BOUND_FLAGS for f in flags)
            and isinstance(figures["label"], str) and figures["label"] != "")


def _percent(share: float) -> str:
    """A share as a whole percentage that never rounds to 100 % or 0 % unless it is."""
    pct = 100 * share
    if 99.5 <= pct < 100:
        return ">99%"
    if 0 < pct < 1:
        return "<1%"
    return f"{pct:.0f}%"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _number(value: Any) -> float | None:
    """A finite int or float as float; None for anything else (bools included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    """A count: an int >= 0 (or a float holding one); None for anything else."""
    number = _number(value)
    if number is None or number < 0 or number != int(number):
        return None
    return int(number)


__all__ = [
    "FIGURE_KEYS",
    "FLAGS",
    "FLOOR_LIMITED_SHARE",
    "HOST_BOUND_SHARE",
    "KINDS",
    "UPPER_BOUND_FLAGS",
    "figures_of",
    "run_figures",
]
