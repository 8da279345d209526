"""Measure a backend the way Intel MLC and fio measure a tier, and turn the figures into a profile.

Memory tiers (host-addressable arena): idle latency by pointer chasing a random cycle over a
buffer much larger than the LLC (``Backend.chase``, huge pages where the backend advises them),
bandwidth by block loads, stores and reads of large blocks through ``kv_replay``
(GB/s = bytes / busy time). Storage tiers (``uring``, ``mooncake``): latency of 4 KiB reads one at a time
(queue depth 1), IOPS at queue depth 32 (a batch of the store's for ``mooncake``), bandwidth with
1 MiB reads; a store (``mooncake``) first gets the objects the reads touch put, untimed. Every figure is the median
of several rounds, so one preempted round on a shared machine does not move it.

The result converts to a tier profile (``profile`` in the result, ``--out`` writes it as TOML)
that ``emu:PATH.toml`` loads: a measured machine can be emulated elsewhere.

``vemu`` is refused: in virtual time its figures are its profile's model, so there is nothing to
measure, and a profile made of them would pass the model off as a measurement. ``emu:PROFILE``
shows what this host can emulate of a profile.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import os
import statistics

import numpy as np

from . import __version__
from .errors import BackendError, BackendUnavailable, ConfigError, OutputError
from .backend_spec import BackendSpec, emulated_backend_args
from .backends import ENTRY_DTYPE, STEP_DTYPE, Backend
from .output import atomic_output
from .profiles import MAX_CONCURRENCY, Profile, _FIELDS, _PART_KEYS, memory_concurrency, profile_from_mapping
from .replay import host_facts
from .replay.host import host_load, load_sample, load_warning

DEFAULT_BUFFER_BYTES = 1 << 30
DEFAULT_HOPS = 1_000_000
DEFAULT_ROUNDS = 5
MIN_BUFFER_BYTES = 8 << 20

MEMORY_BLOCK_BYTES = 4 << 20
STORAGE_BLOCK_BYTES = 4096
STORAGE_BW_BLOCK_BYTES = 1 << 20
STORAGE_QD_LATENCY = 1
STORAGE_QD_IOPS = 32
#: 4 KiB reads per round at each queue depth (bounded by the blocks the buffer holds).
STORAGE_OPS_QD1 = 400
STORAGE_OPS_QD32 = 4096


def calibrate(spec: str, *, buffer_bytes: int = DEFAULT_BUFFER_BYTES, hops: int = DEFAULT_HOPS,
              rounds: int = DEFAULT_ROUNDS, name: str | None = None, log=None) -> dict:
    """Measures backend ``spec``; returns the figures, the profile they make, and warnings.

    ``hops`` pointer-chase hops in all (memory tiers), split over ``rounds``. ``log(message)``
    gets a line per phase. A ``vemu`` spec is a :class:`ConfigError`: virtual time has nothing
    to measure (see the module's docstring). ``mooncake`` is measured in a network namespace of its
    own where one can be made (:func:`_run`; the result's ``isolation`` says how).
    """
    parsed = BackendSpec.parse(spec)
    if parsed.kind.virtual:
        profile = parsed.args() if parsed.target else "PROFILE"
        raise ConfigError(
            f"cannot calibrate {parsed}: {parsed.name} is the profile's model in virtual time, there is "
            f"nothing to measure; calibrate emu:{profile} to see what this host can emulate")

    before = load_sample(children=True)  # the measurement may run in a child (kvemu.isolation)
    result = _run(parsed, "_measure", dict(spec=parsed.text(), backend_name=parsed.name, buffer_bytes=buffer_bytes,
                                           hops=hops, rounds=rounds, name=name), log)
    # what else ran meanwhile: write_profile refuses a profile measured under a load that moved it
    result["host_load"] = host_load(before, load_sample(children=True))
    line = load_warning(result["host_load"], f"calibrate --backend {parsed.text()}")
    if line:
        result["warnings"].append(line)
    return result


def _isolated_kind(parsed) -> bool:
    """A backend whose software listens on every interface (Mooncake 0.3.13's client): measured in a
    network namespace of its own where one can be made (kvemu.isolation)."""
    return parsed.name == "mooncake"


def _run(parsed, measure: str, kwargs: dict, log) -> dict:
    """``measure(**kwargs)`` of this module, in a private network namespace for a backend that needs one
    (:func:`_isolated_kind`), else here; ``isolation`` in the result says which and, in the namespace,
    what the store's processes listened on (the store checks them there as here)."""
    if _isolated_kind(parsed):
        from .isolation import IsolationUnavailable, run_isolated

        try:
            return run_isolated(f"{__name__}:{measure}", kwargs, log)
        except IsolationUnavailable as e:
            reason = str(e)
        result = globals()[measure](**kwargs, log=log)
        result["isolation"] = {"isolation": "none", "reason": f"no private network namespace here: {reason}"}
        return result
    return globals()[measure](**kwargs, log=log)


def _isolation_text(result: dict) -> str | None:
    """How the measured software was kept from the network, in words (kvemu.isolation.how_text, as a
    replay's ``backend.facts.isolation_how``); None for a backend with nothing to keep."""
    from .isolation import how_text

    facts = result.get("facts") or {}
    return how_text(result.get("isolation"), facts.get("listening") or [], facts.get("exposed") or [])


def _isolation_keys(result: dict, out: dict) -> None:
    """The [calibration] table's isolation keys: how, in words, and what the store listened on."""
    iso = result.get("isolation")
    if iso:
        out["isolation"] = iso.get("isolation")
        out["isolation_how"] = _isolation_text(result)
        listening = (result.get("facts") or {}).get("listening")
        if listening:
            out["listening"] = list(listening)


def _measure(spec: str, backend_name: str, *, buffer_bytes: int, hops: int, rounds: int,
             name: str | None, log) -> dict:
    """The measurements of :func:`calibrate`, for any backend: tests run them on ``vemu``, whose
    exact model checks the methods themselves, free of this host's noise."""
    if buffer_bytes < MIN_BUFFER_BYTES:
        raise ConfigError(f"--buffer must be at least {MIN_BUFFER_BYTES >> 20} MiB, got {buffer_bytes} bytes")
    if hops < rounds or rounds < 1:
        raise ConfigError(f"--hops must be at least the number of rounds ({rounds}), got {hops}")
    log = log or (lambda message: None)
    kind = _kind(spec, backend_name)

    result = {"backend": spec, "kind": kind, "buffer_bytes": int(buffer_bytes), "rounds": rounds, "warnings": [],
              "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "creator": f"kvemu {__version__}", "host": host_facts()}
    if kind == "memory":
        try:
            _measure_memory(spec, buffer_bytes, hops, rounds, result, log)
        except _NotHostAddressable:
            kind = result["kind"] = "storage"
    if kind == "storage":
        _measure_storage(spec, backend_name, buffer_bytes, rounds, result, log)
    result["profile"] = _profile(result, name or f"measured-{backend_name}", spec).to_dict()
    return result


class _NotHostAddressable(Exception):
    pass


def _kind(spec: str, backend_name: str) -> str:
    """``memory`` or ``storage``: the backend's medium, or its profile's for an emulated tier."""
    parsed = BackendSpec.parse(spec)
    if parsed.kind.emulated:
        return emulated_backend_args(parsed)[0].kind
    return parsed.kind.medium


def with_queue_depth(spec: str, qd: int) -> str:
    """``spec`` with its ``qd=`` option set to ``qd`` (backends whose queue depth is an option)."""
    parsed = BackendSpec.parse(spec)
    if not parsed.kind.queue_depth:
        return spec
    return parsed.with_option("qd", qd).text()


def _replay_op(backend, op: str, slots: np.ndarray, count_per_step: int) -> dict:
    """One replay of ``op`` over ``slots`` (one request), ``count_per_step`` blocks per step; its op stats."""
    n = len(slots)
    n_steps = n // count_per_step
    table_off = np.array([0, n], np.uint64)
    entries = np.zeros(n_steps, ENTRY_DTYPE)
    entries[f"{op}_first"] = np.arange(n_steps, dtype=np.uint32) * count_per_step
    entries[f"{op}_count"] = count_per_step
    steps = np.zeros(n_steps, STEP_DTYPE)
    steps["entry_begin"] = np.arange(n_steps)
    steps["entry_end"] = np.arange(1, n_steps + 1)
    backend.reset_stats()
    backend.replay(table_off, slots, steps, entries, np.ones(1, np.uint32))
    return backend.op_stats(op)


def _slots(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n).astype(np.uint32)


def _gbps(st: dict) -> float:
    return st["bytes"] / st["busy_ns"] if st["busy_ns"] else float("nan")


def _median(values) -> float:
    return float(statistics.median(values))


def _measure_memory(spec, buffer_bytes, hops, rounds, result, log) -> None:
    n_slots = buffer_bytes // MEMORY_BLOCK_BYTES
    with Backend(spec) as b:
        b.prepare(MEMORY_BLOCK_BYTES, n_slots, 1, 1, False)
        log(f"pointer chase over {n_slots * MEMORY_BLOCK_BYTES >> 20} MiB, {hops:,} hops in {rounds} rounds")
        try:
            per_round = [b.chase(hops // rounds) for _ in range(rounds)]
        except BackendUnavailable:
            raise _NotHostAddressable() from None
        result["latency"] = {"method": "pointer chase, random cycle over the buffer (Intel MLC idle latency)",
                             "ns": _median(per_round), "rounds_ns": per_round, "hops": hops // rounds * rounds}
        bw = {"method": "block accesses through kv_replay, bytes / busy time", "block_bytes": MEMORY_BLOCK_BYTES}
        for op in ("load", "store", "read"):
            log(f"{op} bandwidth, {MEMORY_BLOCK_BYTES >> 20} MiB blocks, {rounds} rounds")
            per_round = [_gbps(_replay_op(b, op, _slots(n_slots, r), n_slots)) for r in range(rounds)]
            bw[f"{op}_gbps"] = _median(per_round)
            bw[f"{op}_rounds_gbps"] = per_round
        result["bandwidth"] = bw
        facts = b.describe()
    result["facts"] = facts
    result["concurrency"] = {
        "value": memory_concurrency(result["latency"]["ns"], bw["load_gbps"]),
        "method": "memory tiers: 1 + ceil(latency x load bandwidth / 64 KiB), as the built-in profiles"}
    _emulation_warnings(spec, facts, result)


def _measure_storage(spec, backend_name, buffer_bytes, rounds, result, log) -> None:
    n4k = buffer_bytes // STORAGE_BLOCK_BYTES
    lat_spec = with_queue_depth(spec, STORAGE_QD_LATENCY)
    iops_spec = with_queue_depth(spec, STORAGE_QD_IOPS)
    takes_qd = BackendSpec.parse(spec).kind.queue_depth
    # A store evicts before its segment is full (Mooncake's master above a high watermark, with its
    # allocator's own overhead): reads touch only the first half of its slots there, so that every read finds
    # its object.
    stack = BackendSpec.parse(spec).kind.store is not None
    room4k = max(1, n4k // 2) if stack else n4k
    ops1, ops32 = min(STORAGE_OPS_QD1, room4k), min(STORAGE_OPS_QD32, room4k)
    with Backend(lat_spec) as b:
        b.prepare(STORAGE_BLOCK_BYTES, n4k, 1, 1, False)
        _fill(b, [np.arange(room4k, dtype=np.uint32)], log)
        log(f"4 KiB reads at queue depth 1: {ops1} x {rounds} rounds")
        # One access per step: each reaches the backend alone, whatever its queue depth.
        lat = [(st["time_ns"] / st["accesses"]) for st in
               (_replay_op(b, "load", _slots(room4k, r)[:ops1], 1) for r in range(rounds))]
        if not takes_qd:  # a tier with its own concurrency: the same backend
            iops = _iops_rounds(b, room4k, ops32, rounds, log)
        facts = b.describe()
    if takes_qd:
        with Backend(iops_spec) as b:
            b.prepare(STORAGE_BLOCK_BYTES, n4k, 1, 1, False)
            _fill(b, [np.arange(room4k, dtype=np.uint32)], log)
            iops = _iops_rounds(b, room4k, ops32, rounds, log)
    n1m = buffer_bytes // STORAGE_BW_BLOCK_BYTES
    with Backend(iops_spec) as b:
        b.prepare(STORAGE_BW_BLOCK_BYTES, n1m, 1, 1, False)
        n_bw = max(1, n1m // 2) if stack else n1m
        _fill(b, [np.arange(n_bw, dtype=np.uint32)], log)
        log(f"1 MiB reads: {n_bw} x {rounds} rounds")
        bw_rounds = [_gbps(_replay_op(b, "load", _slots(n_bw, r), n_bw)) for r in range(rounds)]
        facts_bw = b.describe()
    lat_ns = _median(lat)
    gbps = _median(bw_rounds)
    result["latency"] = {"method": "4 KiB reads one at a time (fio randread, iodepth 1), mean per access",
                         "ns": lat_ns, "rounds_ns": lat, "block_bytes": STORAGE_BLOCK_BYTES,
                         "queue_depth": STORAGE_QD_LATENCY if takes_qd else None}
    result["iops"] = {"method": "4 KiB reads, accesses / busy time", "value": _median(iops), "rounds": iops,
                      "queue_depth": STORAGE_QD_IOPS if takes_qd else None}
    result["bandwidth"] = {"method": "1 MiB reads through kv_replay, bytes / busy time",
                           "block_bytes": STORAGE_BW_BLOCK_BYTES, "load_gbps": gbps, "load_rounds_gbps": bw_rounds}
    cap = STORAGE_QD_IOPS if takes_qd else MAX_CONCURRENCY
    conc = fit_concurrency(max(0.0, lat_ns - STORAGE_BLOCK_BYTES / gbps), gbps, result["iops"]["value"], cap)
    result["concurrency"] = {"value": conc, "method": "the smallest that makes the model give the IOPS measured "
                                                      "(Little's law, solved in the model)"}
    result["facts"] = facts_bw
    merged = dict(facts_bw)
    for key in ("accesses", "floor_hits"):
        if key in facts:
            merged[key] = facts[key] + facts_bw.get(key, 0)
    _emulation_warnings(spec, merged, result)
    for what, f in (("4 KiB", facts), ("1 MiB", facts_bw)):
        if f.get("store_get_missing"):
            result["warnings"].append(
                f"{spec}: {f['store_get_missing']} of {f['store_gets']} {what} reads found no object (the store "
                f"evicted it): their times are lookups, not transfers")


def _fill(b, slot_sets: list, log) -> None:
    """A store holds an object only once it was put (a store: kind ``store``): the slots the
    reads will touch are stored first, untimed. Files (uring) are written whole by prepare instead."""
    if not b.kind.store:
        return
    slots = np.unique(np.concatenate(slot_sets)).astype(np.uint32)
    log(f"storing the {len(slots)} objects the reads touch")
    _replay_op(b, "store", slots, len(slots))


def fit_concurrency(latency_ns: float, gbps: float, iops: float, cap: int) -> int:
    """Smallest concurrency (1..cap) for which the model's 4 KiB IOPS reach ``iops``, batches of 256.

    Little's law (in flight = IOPS x latency) solved in the model itself, so the queueing for the
    link that a burst of accesses meets is accounted for as the measurement met it.
    """
    def model_iops(c: int) -> float:
        p = Profile(name="fit", kind="storage", latency_ns=latency_ns, bandwidth_gbps=gbps, concurrency=c)
        return 256 / p.batch_times([STORAGE_BLOCK_BYTES] * 256)[1] * 1e9

    lo, hi = 1, max(1, cap)
    target = 0.99 * iops  # within the rounding of the figures the fit starts from
    if not iops > 0 or model_iops(hi) < target:
        return hi if iops > 0 else 1
    while lo < hi:  # model IOPS never fall as concurrency grows
        mid = (lo + hi) // 2
        if model_iops(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _iops_rounds(b, n4k, ops, rounds, log) -> list[float]:
    log(f"4 KiB reads in batches{f' at queue depth {STORAGE_QD_IOPS}' if b.kind.queue_depth else ''}: "
        f"{ops} x {rounds} rounds")
    out = []
    for r in range(rounds):
        st = _replay_op(b, "load", _slots(n4k, 100 + r)[:ops], ops)
        out.append(st["accesses"] / st["busy_ns"] * 1e9 if st["busy_ns"] else float("nan"))
    return out


def _emulation_warnings(spec: str, facts: dict, result: dict) -> None:
    """Floor hits of an emulated backend: figures that are this host's, not the profile's."""
    floor = {k: facts[k] for k in ("hops", "hop_floor_hits", "accesses", "floor_hits", "floor_ns", "hop_floor_ns")
             if k in facts}
    if "floor_hits" not in floor:
        return
    result["floor"] = floor
    hop_hits, hops = facts.get("hop_floor_hits") or 0, facts.get("hops") or 0
    if hop_hits and hops and hop_hits > 0.01 * hops:
        result["warnings"].append(
            f"{spec}: {hop_hits} of {hops} chase hops ({100 * hop_hits / hops:.0f}%) took longer on this host than "
            f"the profile allows (host {facts.get('hop_floor_ns')} ns per hop): the latency is this host's floor")
    hits, n = facts.get("floor_hits") or 0, facts.get("accesses") or 0
    if hits and n and hits > 0.01 * n:
        result["warnings"].append(
            f"{spec}: {hits} of {n} block accesses ({100 * hits / n:.0f}%) took longer on this host than the "
            f"profile allows (host {facts.get('floor_ns')} ns per access): the bandwidth is this host's floor")


def _profile(result: dict, name: str, spec: str) -> Profile:
    gbps = result["bandwidth"]["load_gbps"]
    lat = result["latency"]["ns"]
    if result["kind"] == "storage":
        # The 4 KiB access moved its bytes too; the profile's latency is what precedes the transfer.
        lat = max(0.0, lat - STORAGE_BLOCK_BYTES / gbps)
    host = result.get("host") or {}
    data = {
        "name": name,
        "kind": result["kind"],
        "latency_ns": round(lat, 1),
        "bandwidth_gbps": round(gbps, 3),
        "concurrency": int(result["concurrency"]["value"]),
        "overhead_ns": 0.0,
        "description": f"measured by kvemu calibrate --backend {spec}",
        "sources": [f"kvemu calibrate --backend {spec}, buffer {result['buffer_bytes']} bytes, "
                    f"{result['rounds']} rounds{', on ' + host['hostname'] if host.get('hostname') else ''}"],
    }
    if _stack_measured(result):
        data["generation"] = software_generation(result)
    return profile_from_mapping(data, f"calibration of {spec}")


def _stack_measured(result: dict) -> bool:
    """A storage stack of this host measured (uring, a store), not an emulated tier's profile: its
    profile names the software generation it measured."""
    kind = BackendSpec.parse(result["backend"]).kind
    return result["kind"] == "storage" and not (kind.emulated or kind.virtual)


def profile_of(result: dict) -> Profile:
    """The profile a calibration result makes (``result["profile"]``)."""
    return profile_from_mapping(result["profile"], "calibration result")


def calibration_table(result: dict) -> dict:
    """Provenance written as the ``[calibration]`` table of a profile file."""
    out = {
        "backend": result["backend"],
        "created": result.get("created"),
        "creator": result.get("creator"),
        "hostname": result.get("host", {}).get("hostname"),
        "cpu_model": result.get("host", {}).get("cpu_model"),
        "buffer_bytes": result["buffer_bytes"],
        "rounds": result["rounds"],
        "latency_ns_measured": result["latency"]["ns"],
        "latency_method": result["latency"]["method"],
        "bandwidth_method": result["bandwidth"]["method"],
    }
    for op in ("load", "store", "read"):
        if f"{op}_gbps" in result["bandwidth"]:
            out[f"{op}_gbps"] = result["bandwidth"][f"{op}_gbps"]
    if "iops" in result:
        out["iops"] = result["iops"]["value"]
    _isolation_keys(result, out)
    load = result.get("host_load") or {}
    for k in ("loadavg_1m_before", "loadavg_1m_after", "process_cpus", "others_share"):
        if load.get(k) is not None:
            out[f"host_{k}"] = load[k]
    if result.get("warnings"):
        out["warnings"] = list(result["warnings"])
    return out


def write_profile(result: dict, path, force: bool = False, force_load: bool = False) -> None:
    """Writes the calibrated profile as TOML (atomically; never over an existing file without force).

    A result whose ``host_load`` says other processes took a share of this host that moves its
    figures (:data:`kvemu.replay.host.OTHERS_SHARE_LIMIT`) is refused with an :class:`OutputError`
    before anything is written, unless ``force_load``: a profile is a claim about the tier, and
    one measured under contention would pass this host's contention off as the tier."""
    load = result.get("host_load") or {}
    if load.get("moved") and not force_load:
        raise OutputError(
            f"{path}: not written: other processes took {load['others_share']:.0%} of this host's "
            f"{load.get('cpus')} CPUs while calibrating (load average {load.get('loadavg_1m_after')}), so "
            f"the figures are partly this host's contention; calibrate on a quiet host, or give --force-load "
            f"to write them anyway")

    table = software_table(result) if result.get("kind") == "software" else calibration_table(result)
    text = profile_of(result).to_toml(extra=table)
    with atomic_output(path, force=force) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            if result.get("kind") == "software":
                f.write("# kvemu software path measured by `kvemu calibrate --software`; take its parts onto a "
                        "profile with software_from = PATH (or emu:/vemu:PROFILE,software_from=PATH)\n")
            else:
                f.write("# kvemu tier profile measured by `kvemu calibrate`; load it with emu:PATH or vemu:PATH\n")
            f.write(text)


def render_table(result: dict) -> str:
    """The calibration as aligned text lines."""
    p = result["profile"]
    lat, bw = result["latency"], result["bandwidth"]
    rows = [("backend", result["backend"]), ("kind", result["kind"]),
            ("buffer", f"{result['buffer_bytes'] / 2**20:,.0f} MiB, median of {result['rounds']} rounds")]
    if result["kind"] == "memory":
        facts = result.get("facts", {})
        huge = facts.get("arena_hugepage_bytes")
        huge_text = f", huge pages {100 * huge / facts['arena_bytes']:.0f}% of the arena" if huge is not None and \
            facts.get("arena_bytes") else ""
        rows.append(("latency", f"{lat['ns']:.1f} ns per hop (pointer chase, {lat['hops']:,} hops{huge_text})"))
        rows.append(("bandwidth", ", ".join(f"{op} {bw[f'{op}_gbps']:.2f} GB/s" for op in ("load", "store", "read"))
                     + f" ({bw['block_bytes'] >> 20} MiB blocks)"))
    else:
        rows.append(("latency", f"{lat['ns'] / 1000:.2f} us per 4 KiB read at queue depth 1"))
        qd = result["iops"]["queue_depth"]
        rows.append(("IOPS", f"{result['iops']['value']:,.0f} (4 KiB{f', queue depth {qd}' if qd else ''})"))
        rows.append(("bandwidth", f"{bw['load_gbps']:.2f} GB/s (1 MiB reads)"))
    if p.get("generation"):
        rows.append(("generation", f"{p['generation']}: its software is inside the latency and bandwidth "
                                   f"measured, not apart (--software fits it apart)"))
    iso = _isolation_text(result)
    if iso:
        rows.append(("isolation", iso))
    rows.append(("profile", f"{p['name']}: latency {p['latency_ns']} ns, {p['bandwidth_gbps']} GB/s, "
                            f"concurrency {p['concurrency']}, overhead {p['overhead_ns']} ns"))
    floor = result.get("floor")
    if floor:
        parts = []
        if floor.get("hops"):
            parts.append(f"{floor.get('hop_floor_hits', 0)} of {floor['hops']} hops")
        if floor.get("accesses"):
            parts.append(f"{floor.get('floor_hits', 0)} of {floor['accesses']} accesses")
        rows.append(("floor hits", ", ".join(parts) or "none"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ------------------------------------------------------------------------------- the software path
# ``calibrate_software``: the times of batches of reads through a storage stack, over a grid of
# (objects per batch, object size), fitted by least squares to a fixed cost per request (one batch
# call), per object and per byte; written as a profile's software parts (docs/tier-profiles.md,
# "Calibrating the software path").

#: The grid: objects per batch (one request: one batch call of the store, one submission of io_uring)
#: and object sizes; every point measured SOFTWARE_REPS times, in shuffled order.
SOFTWARE_BATCHES = (1, 4, 16, 64)
SOFTWARE_SIZES = (4096, 65536, 262144, 1048576)
SOFTWARE_REPS = 5
#: The three costs of the fit, in the order of its columns (1, objects, objects x bytes each).
COST_TERMS = ("ns_per_request", "ns_per_io", "ns_per_byte")
#: Largest batch: the replay core hands a store at most 256 transfers at once.
MAX_SOFTWARE_BATCH = 256


def fit_costs(batch, size, time_ns) -> dict:
    """Least squares of batch times on (1, objects, objects x object bytes): the fixed cost per request,
    per object and per byte, none below zero.

    The timings of each grid point (batch, size) are taken at their median first: a shared host makes a
    timing slow, never fast, and one preempted batch must not pull a cost (every figure of calibrate is a
    median of rounds). The medians are fitted weighted by their inverse square, so that every point counts
    by its relative error. A cost whose unconstrained fit is negative is held at 0 (``held_at_zero``): the
    best fit over the subsets of the three columns whose costs are all >= 0 (non-negative least squares,
    solved exactly for three unknowns). Returns the costs, their standard errors (sigma^2 (X'WX)^-1 from
    the weighted residuals), R^2 of the weighted fit, each point's relative residual, the counts.
    """
    n = np.asarray(batch, dtype=float)
    s = np.asarray(size, dtype=float)
    y = np.asarray(time_ns, dtype=float)
    if not (n.shape == s.shape == y.shape) or n.ndim != 1:
        raise ConfigError("fit_costs: batch, size and time_ns must be three sequences of one length")
    if not (np.all(np.isfinite(y)) and np.all(n >= 1) and np.all(s >= 1)):
        raise ConfigError("fit_costs: every batch and size must be >= 1 and every time finite")
    points = sorted(set(zip(n.tolist(), s.tolist())))
    if len({p[0] for p in points}) < 2 or len({p[1] for p in points}) < 2:
        raise ConfigError("fit_costs needs at least two batch sizes and two object sizes to tell the three "
                          "costs apart")
    if len(points) < 4:
        raise ConfigError(f"fit_costs needs at least 4 grid points, got {len(points)}")
    pn = np.array([p[0] for p in points])
    ps = np.array([p[1] for p in points])
    py = np.array([float(np.median(y[(n == a) & (s == b)])) for a, b in points])
    X = np.column_stack([np.ones_like(pn), pn, pn * ps])
    scale = np.abs(py)
    scale[scale <= 0] = 1.0
    sw = 1.0 / scale                                     # sqrt of the weights: relative residuals
    Xw, yw = X * sw[:, None], py * sw
    # column scaling keeps X'X well conditioned (bytes are ~1e6 times objects)
    col = np.sqrt((Xw ** 2).sum(axis=0))
    col[col == 0] = 1.0
    best = None
    for mask in range(7, 0, -1):                          # every non-empty subset of the three columns
        cols = [j for j in range(3) if mask >> j & 1]
        coef_s, *_ = np.linalg.lstsq(Xw[:, cols] / col[cols], yw, rcond=None)
        coef = np.zeros(3)
        coef[cols] = coef_s / col[cols]
        if np.any(coef[cols] < 0):
            continue
        rss = float(((yw - Xw @ coef) ** 2).sum())
        if best is None or rss < best[0] * (1 - 1e-12):
            best = (rss, cols, coef)
    rss, cols, coef = best
    dof = max(1, len(points) - len(cols))
    A = Xw[:, cols] / col[cols]
    cov = rss / dof * np.linalg.pinv(A.T @ A)
    stderr = np.zeros(3)
    stderr[cols] = np.sqrt(np.clip(np.diag(cov), 0, None)) / col[cols]
    ybar = float(np.sum(sw ** 2 * py) / np.sum(sw ** 2))
    tss = float((((py - ybar) * sw) ** 2).sum())
    model = X @ coef
    residuals = [{"batch": int(a), "object_bytes": int(b), "median_ns": float(m), "fit_ns": float(f),
                  "rel_residual": float((m - f) / c)} for a, b, m, f, c in zip(pn, ps, py, model, scale)]
    return {"method": "weighted least squares of each grid point's median batch time on (1, objects, objects x "
                      "bytes), weights 1 / median^2, costs >= 0",
            **{t: float(coef[j]) for j, t in enumerate(COST_TERMS)},
            "stderr": {t: float(stderr[j]) for j, t in enumerate(COST_TERMS)},
            "held_at_zero": [t for j, t in enumerate(COST_TERMS) if j not in cols],
            "r2": 1.0 - rss / tss if tss > 0 else 1.0,
            "max_abs_rel_residual": float(max(abs(r["rel_residual"]) for r in residuals)),
            "timings": int(len(y)), "points": len(points), "residuals": residuals}


def _check_grid(batches, sizes, reps) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    batches, sizes = tuple(sorted({int(b) for b in batches})), tuple(sorted({int(s) for s in sizes}))
    if len(batches) < 2 or batches[0] < 1 or batches[-1] > MAX_SOFTWARE_BATCH:
        raise ConfigError(f"--batches needs at least two batch sizes in 1..{MAX_SOFTWARE_BATCH}, got "
                          f"{','.join(map(str, batches)) or 'none'}")
    if len(sizes) < 2 or sizes[0] < 512 or sizes[-1] > 64 << 20 or any(s % 512 for s in sizes):
        raise ConfigError("--sizes needs at least two object sizes, multiples of 512 bytes up to 64 MiB, got "
                          f"{','.join(map(str, sizes)) or 'none'}")
    if not 2 <= int(reps) <= 1000:
        raise ConfigError(f"--reps must be in 2..1000, got {reps}")
    return batches, sizes, int(reps)


def _steps(batches, reps, n_slots, seed) -> tuple[list[int], np.ndarray]:
    """Shuffled steps: every batch size ``reps`` times (and a warm-up step of the largest first), each
    step's objects distinct slots chosen at random."""
    rng = np.random.default_rng(seed)
    order = [b for b in batches for _ in range(reps)]
    rng.shuffle(order)
    order = [max(batches), *order]
    slots = np.concatenate([rng.choice(n_slots, b, replace=False) for b in order]).astype(np.uint32)
    return order, slots


def _batch_times(spec: str, batches, sizes, reps: int, log) -> tuple[list[tuple[int, int, float]], dict]:
    """Times of one batch of loads (one step of the replay core: one batch call of a store, one
    submission of io_uring) at every grid point, ``reps`` each; the backend's facts."""
    out = []
    facts: dict = {}
    top = max(batches)
    for k, size in enumerate(sizes):
        n_slots = 2 * top
        with Backend(spec) as b:
            b.prepare(size, n_slots, 1, 1, False)
            _fill(b, [np.arange(top, dtype=np.uint32)], lambda m: None)
            order, slots = _steps(batches, reps, top, seed=1000 + k)
            log(f"{size} B objects: {len(order) - 1} batches of {', '.join(map(str, batches))}")
            n_steps = len(order)
            entries = np.zeros(n_steps, ENTRY_DTYPE)
            entries["load_first"] = np.concatenate([[0], np.cumsum(order[:-1])])
            entries["load_count"] = order
            steps = np.zeros(n_steps, STEP_DTYPE)
            steps["entry_begin"] = np.arange(n_steps)
            steps["entry_end"] = np.arange(1, n_steps + 1)
            b.reset_stats()
            step_out, _ = b.replay(np.array([0, len(slots)], np.uint64), slots, steps, entries,
                                   np.ones(1, np.uint32))
            out += [(n, size, float(t)) for n, t in zip(order[1:], step_out["load_ns"][1:])]
            facts = b.describe()
            missing = facts.get("store_get_missing") or facts.get("get_missing")
            if missing:
                raise BackendError(f"{spec}: {missing} reads found no object (the store evicted them): their "
                                   f"times would be lookups, not transfers; calibrate with smaller --sizes",
                                   0)
    return out, facts


def _pread_times(directory: str, direct: bool, batches, sizes, reps: int, log) -> list[tuple[int, int, float]]:
    """Times of batches of reads of a preallocated file in ``directory``, one ``preadv`` per object, through
    the file system (the page cache emptied of the file before each batch: POSIX_FADV_DONTNEED on its clean
    pages) or with O_DIRECT: the same reads, the same calls, one path with the file system and one without.
    The file is removed on the way out."""
    import mmap
    import tempfile
    import time

    top, big = max(batches), max(sizes)
    fd_w, path = tempfile.mkstemp(prefix=".kvemu-calibrate-", suffix=".bin", dir=directory)
    buf = mmap.mmap(-1, big)                              # page aligned, as O_DIRECT wants
    out = []
    try:
        try:
            block = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
            total = top * big
            written = 0
            while written < total:
                written += os.write(fd_w, block[:min(len(block), total - written)])
            os.fsync(fd_w)
        finally:
            os.close(fd_w)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0) | os.O_CLOEXEC)
        try:
            for k, size in enumerate(sizes):
                view = memoryview(buf)[:size]
                order, slots = _steps(batches, reps, top * big // size, seed=2000 + k)
                log(f"{size} B reads {'with O_DIRECT' if direct else 'through the file system'}: {len(order) - 1} "
                    f"batches")
                pos = 0
                for i, n in enumerate(order):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    offs = [int(x) * size for x in slots[pos:pos + n]]
                    pos += n
                    t0 = time.perf_counter_ns()
                    for off in offs:
                        if os.preadv(fd, [view], off) != size:
                            raise BackendError(f"{path}: short read at {off}", 0)
                    t = time.perf_counter_ns() - t0
                    if i:
                        out.append((n, size, float(t)))
                view.release()
        finally:
            os.close(fd)
    except OSError as e:
        raise BackendUnavailable(f"calibrate: cannot read a file in {directory} "
                                 f"{'with O_DIRECT' if direct else 'through the file system'} "
                                 f"({e.strerror or e})") from None
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
    return out



def calibrate_software(spec: str, *, batches=SOFTWARE_BATCHES, sizes=SOFTWARE_SIZES, reps: int = SOFTWARE_REPS,
                       name: str | None = None, log=None) -> dict:
    """Fits the software path of storage stack ``spec`` (``uring:PATH``, ``mooncake``, ``files:DIR``) into a
    fixed cost per request, per object and per byte; returns the fit, the profile its parts make, and
    warnings (docs/tier-profiles.md, "Calibrating the software path").

    ``batches`` objects per batch and ``sizes`` object bytes make the grid, each point timed ``reps``
    times. For ``uring:PATH`` on a file, the file system's share is measured as well: the same reads of a
    preallocated file in PATH's directory through the file system and with O_DIRECT. The result names the
    software generation measured (``generation``, the profile's) and its software share of the KV time
    (``software_share``, :func:`software_share_of`); ``mooncake`` is measured in a network namespace of its
    own where one can be made (``isolation``).
    """
    parsed = BackendSpec.parse(spec)
    kind = parsed.kind
    if kind.virtual or kind.emulated or kind.medium != "storage":
        raise ConfigError(
            f"cannot calibrate the software path of {parsed}: it is measured on a storage stack of this host "
            f"(uring:PATH, mooncake, files:DIR); {parsed.name} "
            + ("is a profile's model, its software parts are the profile's" if kind.emulated or kind.virtual
               else "is a memory tier, reached by loads and stores with no software path"))

    before = load_sample(children=True)  # the measurement may run in a child (kvemu.isolation)
    result = _run(parsed, "_measure_software", dict(spec=parsed.text(), batches=list(batches), sizes=list(sizes),
                                                    reps=reps, name=name), log)
    result["host_load"] = host_load(before, load_sample(children=True))
    line = load_warning(result["host_load"], f"calibrate --software --backend {parsed.text()}")
    if line:
        result["warnings"].append(line)
    return result


def _block_device(path: str) -> bool:
    import stat

    try:
        return stat.S_ISBLK(os.stat(path).st_mode)
    except OSError:
        return False


def _direct_file(kind) -> bool:
    """A storage backend that reads a file or device itself, with O_DIRECT (``uring``), rather than a store."""
    return kind.medium == "storage" and kind.store is None and kind.target == "path" and kind.mode == "measured"


def _transport(spec: str, facts: dict) -> str:
    """What carried the bytes measured, as the profile's ``transport`` says it."""
    parsed = BackendSpec.parse(spec)
    if parsed.kind.store is not None:
        t = str(facts.get("transport", parsed.name))
        wire = str(facts.get("wire", ""))
        if t == "tcp" and wire.startswith("loopback"):
            return "tcp-loopback"
        if t.startswith("memcpy"):
            return "memcpy-same-host"
        return f"{t} ({wire})" if wire else t
    if _direct_file(parsed.kind):
        return "io_uring O_DIRECT"
    return f"{parsed.name} ({parsed.kind.mode})"


def _measure_software(spec: str, *, batches, sizes, reps, name, log) -> dict:
    """The measurements of :func:`calibrate_software` for any storage backend (tests run them on ``vemu``,
    whose exact model checks the method)."""

    batches, sizes, reps = _check_grid(batches, sizes, reps)
    log = log or (lambda message: None)
    parsed = BackendSpec.parse(spec)
    run_spec = with_queue_depth(spec, max(batches))

    host = host_facts()
    created = _dt.datetime.now(_dt.timezone.utc)
    times, facts = _batch_times(run_spec, batches, sizes, reps, log)
    fit = fit_costs(*zip(*times))
    result = {"backend": spec, "kind": "software", "measured": run_spec, "created": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
              "date": created.strftime("%Y-%m-%d"), "creator": f"kvemu {__version__}", "kvemu_version": __version__,
              "host": host, "measured_on": host.get("hostname") or "this host",
              "transport": _transport(spec, facts), "grid": {"batches": list(batches), "object_bytes": list(sizes),
                                                             "reps": reps},
              "fit": fit, "facts": facts, "warnings": []}
    if _direct_file(parsed.kind) and parsed.target and not _block_device(parsed.target):
        directory = os.path.dirname(os.path.abspath(parsed.target))
        fs_times = _pread_times(directory, False, batches, sizes, reps, log)
        direct_times = _pread_times(directory, True, batches, sizes, reps, log)
        result["filesystem"] = _fs_share(fs_times, direct_times, directory)
    elif _direct_file(parsed.kind):
        result["warnings"].append(f"{spec}: a raw device has no file system: its share is not measured (give a "
                                  f"file on a file system to measure it)")
    for what, f in (("software path", fit), *((("file system", result["filesystem"]["fit_fs"]),)
                                             if "filesystem" in result else ())):
        if f["held_at_zero"]:
            result["warnings"].append(f"{spec}: the {what} fit puts {', '.join(f['held_at_zero'])} below zero; "
                                      f"held at 0 (the grid does not resolve it on this host)")
        if f["r2"] < 0.9:
            result["warnings"].append(f"{spec}: the {what} fit explains only R^2 = {f['r2']:.2f} of the times: "
                                      f"they are not linear in requests, objects and bytes here (a loaded host, "
                                      f"or a cache); more --reps or a quieter host")
    result["profile"] = _software_profile(result, name or f"measured-{parsed.name}-software").to_dict()
    result["generation"] = result["profile"].get("generation") or software_generation(result)
    result["software_share"] = software_share_of(result)
    return result


def _fs_share(fs_times, direct_times, directory: str) -> dict:
    """The file system's share: the same reads through it and with O_DIRECT, fitted each, and their
    difference per cost; the share of the time at every grid point."""
    import subprocess

    fit_fs, fit_direct = fit_costs(*zip(*fs_times)), fit_costs(*zip(*direct_times))
    shares = []
    for a, b in zip(fit_fs["residuals"], fit_direct["residuals"]):
        shares.append({"batch": a["batch"], "object_bytes": a["object_bytes"], "fs_ns": a["median_ns"],
                       "direct_ns": b["median_ns"],
                       "share": 1.0 - b["median_ns"] / a["median_ns"] if a["median_ns"] else 0.0})
    fstype = None
    try:
        fstype = subprocess.run(["stat", "-f", "-c", "%T", directory], capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"method": "the same preadv calls on a preallocated file, through the file system (its clean pages "
                      "dropped before each batch, POSIX_FADV_DONTNEED) and with O_DIRECT; share = 1 - direct / "
                      "file system",
            "directory": os.path.abspath(directory), "fs_type": fstype,
            "fit_fs": fit_fs, "fit_direct": fit_direct,
            "difference": {t: max(0.0, fit_fs[t] - fit_direct[t]) for t in COST_TERMS},
            "difference_stderr": {t: math.hypot(fit_fs["stderr"][t], fit_direct["stderr"][t]) for t in COST_TERMS},
            "points": shares, "share_median": float(statistics.median(p["share"] for p in shares))}


#: The profile the software parts of a stack measured alone sit on: no wire or medium of its own
#: (every measured time is in the parts), one access at a time, so that replaying it gives the fit's
#: batch times; ``software_from`` takes the parts onto another profile's wire and medium.
_NO_MEDIUM = {"latency_ns": 0.0, "bandwidth_gbps": 1e5, "concurrency": 1, "overhead_ns": 0.0}


def _part(name: str, path: str, source: str, **costs) -> dict:
    """A software part's mapping, with the keys this kvemu's profiles know (profiles._PART_KEYS)."""
    part = {k: float(v) for k, v in costs.items()}
    if "path" in _PART_KEYS:
        part["path"] = path
    part["source"] = source
    return part


def _software_profile(result: dict, name: str) -> Profile:
    """The profile of a software-path calibration: its parts named as the built-in storage profiles name
    theirs (request_lookup, object_rpc, host_copy for a store; kernel_io, filesystem for io_uring)."""
    spec, fit = result["backend"], result["fit"]
    where = (f"measured by kvemu calibrate --software --backend {spec} on {result['measured_on']}, "
             f"{result['date']}, kvemu {result['kvemu_version']}, {result['transport']}")

    def cost(f, t):
        return f"{f[t]:.4g} +- {f['stderr'][t]:.2g} ns {t.removeprefix('ns_')}"

    per_request = "ns_per_request" in _PART_KEYS
    parts: dict = {}
    parsed = BackendSpec.parse(spec)
    if _direct_file(parsed.kind):
        data = {**_NO_MEDIUM, "latency_ns": fit["ns_per_io"],
                "bandwidth_gbps": min(1e5, 1.0 / fit["ns_per_byte"]) if fit["ns_per_byte"] > 0 else 1e5}
        description = (f"{spec} measured on {result['measured_on']}: io_uring O_DIRECT reads as the medium "
                       f"(per object {fit['ns_per_io']:.0f} ns as latency, per byte as bandwidth, one at a time), "
                       f"the submission per request and the file system's share as software parts")
        if per_request:
            parts["kernel_io"] = _part("kernel_io", "transfer", f"{where}: one io_uring submission and its "
                                       f"completions per request (batch), {cost(fit, 'ns_per_request')}",
                                       ns_per_request=fit["ns_per_request"])
        fs = result.get("filesystem")
        if fs:
            d, e = fs["difference"], fs["difference_stderr"]
            costs = {t: d[t] for t in COST_TERMS if t != "ns_per_request" or per_request}
            if any(costs.values()):
                parts["filesystem"] = _part(
                    "filesystem", "transfer",
                    f"{where}: the file system ({fs['fs_type'] or 'type unknown'}) on the read path, the same preadv "
                    f"reads through it less with O_DIRECT: " + ", ".join(
                        f"{d[t]:.4g} +- {e[t]:.2g} ns {t.removeprefix('ns_')}" for t in costs)
                    + f"; {fs['share_median']:.0%} of the read time (median over the grid)", **costs)
    else:
        data = dict(_NO_MEDIUM)
        description = (f"{spec}'s software path measured on {result['measured_on']} over {result['transport']}: "
                       f"every measured time in its software parts, no wire or medium of its own; take them onto "
                       f"a deployment's with software_from")
        if per_request:
            parts["request_lookup"] = _part("request_lookup", "store", f"{where}: fixed cost of one batch call "
                                            f"(request), {cost(fit, 'ns_per_request')}",
                                            ns_per_request=fit["ns_per_request"])
        parts["object_rpc"] = _part("object_rpc", "store", f"{where}: cost per object in a batch, "
                                    f"{cost(fit, 'ns_per_io')}", ns_per_io=fit["ns_per_io"])
        parts["host_copy"] = _part("host_copy", "transfer", f"{where}: cost per byte moved (the transport's and "
                                   f"the client's copies), {cost(fit, 'ns_per_byte')}",
                                   ns_per_byte=fit["ns_per_byte"])
    parts = {k: v for k, v in parts.items() if any(v.get(t) for t in COST_TERMS)} or parts
    if not per_request and fit["ns_per_request"] > 0:
        result["warnings"].append(
            f"{spec}: this kvemu's profiles have no per-request part; the fitted {fit['ns_per_request']:.0f} ns per "
            f"request is in the [calibration] table only")
    data.update({"name": name, "kind": "storage", "description": description,
                 "sources": [f"kvemu calibrate --software --backend {spec}: {result['fit']['timings']} batch "
                             f"times over {len(result['grid']['batches'])} batch sizes x "
                             f"{len(result['grid']['object_bytes'])} object sizes, R^2 {fit['r2']:.3f}; on "
                             f"{result['measured_on']}, {result['date']}, over {result['transport']}"],
                 "software": {k: v for k, v in parts.items()}})
    if "generation" in _FIELDS:
        data["generation"] = software_generation(result)
    return profile_from_mapping(data, f"software calibration of {spec}")


#: The transports of :func:`_transport`, in the words a generation's name uses.
_TRANSPORT_WORDS = {"tcp-loopback": "TCP loopback", "memcpy-same-host": "same-host memcpy",
                    "io_uring O_DIRECT": "O_DIRECT reads"}


def software_generation(result: dict) -> str:
    """The software generation a software-path calibration measured, in words: the software and its
    version, what carried the bytes, where and when (``Mooncake Store 0.3.13 over TCP loopback, measured on
    HOST, 2026-12-07``). It is the profile's ``generation``: a replay that takes its parts (software_from)
    carries it into its results, and the report and the demo print it beside the row, as they print a
    built-in profile's."""
    facts = result.get("facts") or {}
    parsed = BackendSpec.parse(result["backend"])
    transport = result.get("transport") or _transport(result["backend"], facts)
    measured_on = result.get("measured_on") or (result.get("host") or {}).get("hostname") or "this host"
    date = result.get("date") or str(result.get("created") or "")[:10]
    if _direct_file(parsed.kind):
        kernel = (result.get("host") or {}).get("kernel")
        software = f"Linux io_uring{' (kernel ' + kernel + ')' if kernel else ''}"
    else:
        software = " ".join(str(x) for x in (facts.get("product") or f"kvemu's {parsed.name} store",
                                             facts.get("store_package")) if x)
    over = _TRANSPORT_WORDS.get(transport, transport)
    return f"{software} over {over}, measured on {measured_on}, {date}"


def software_share_of(result: dict) -> dict:
    """The software path's share of the KV time, over the calibration's grid, by the rule a replay's
    results use (kvemu.replay.describe.software_share: the profile's software parts for the accesses and
    bytes against the busy time its model charges them, per-request lookups aside, modelled): one batch
    of every grid point, on the profile the calibration made."""
    from .replay.describe import software_share
    from .schema import OPS

    profile = profile_of(result)
    load = {"accesses": 0, "bytes": 0, "busy_ns": 0}
    for point in result["fit"]["residuals"]:
        n, size = point["batch"], point["object_bytes"]
        load["accesses"] += n
        load["bytes"] += n * size
        load["busy_ns"] += round(profile.batch_times([size] * n)[1])
    none = {"accesses": 0, "bytes": 0, "busy_ns": 0}
    share = software_share(profile, {op: load if op == "load" else none for op in OPS})
    return {"figures": "modelled", "software_share": share["ops"]["load"]["software_share"],
            "software_ns": share["ops"]["load"]["software_ns"], "medium_ns": share["ops"]["load"]["medium_ns"],
            "generation": share["generation"], "method": "one batch of every grid point on the profile made: its "
            "software parts against the busy time the model charges (kvemu.replay.describe.software_share, the "
            "rule of replay results), per-request lookups aside"}


def software_table(result: dict) -> dict:
    """Provenance of a software-path calibration, the ``[calibration]`` table of its profile file."""
    fit = result["fit"]
    out = {"backend": result["backend"], "what": "software path", "measured_on": result["measured_on"],
           "transport": result["transport"], "date": result["date"], "created": result["created"],
           "kvemu_version": result["kvemu_version"], "hostname": result["host"].get("hostname"),
           "cpu_model": result["host"].get("cpu_model"), "kernel": result["host"].get("kernel"),
           "batches": result["grid"]["batches"], "object_bytes": result["grid"]["object_bytes"],
           "reps": result["grid"]["reps"], "fit_method": fit["method"], "fit_timings": fit["timings"],
           "fit_r2": fit["r2"], "fit_max_abs_rel_residual": fit["max_abs_rel_residual"]}
    for t in COST_TERMS:
        out[f"fit_{t}"] = fit[t]
        out[f"fit_{t}_stderr"] = fit["stderr"][t]
    out["generation"] = result.get("generation") or software_generation(result)
    share = (result.get("software_share") or {}).get("software_share")
    if share is not None:
        out["software_share_modelled"] = share
    _isolation_keys(result, out)
    fs = result.get("filesystem")
    if fs:
        out["fs_type"] = fs["fs_type"]
        out["fs_share_median"] = fs["share_median"]
        for t in COST_TERMS:
            out[f"fs_{t}"] = fs["fit_fs"][t]
            out[f"direct_{t}"] = fs["fit_direct"][t]
    load = result.get("host_load") or {}
    for k in ("loadavg_1m_before", "loadavg_1m_after", "process_cpus", "others_share"):
        if load.get(k) is not None:
            out[f"host_{k}"] = load[k]
    if result.get("warnings"):
        out["warnings"] = list(result["warnings"])
    return out


def render_software_table(result: dict) -> str:
    """A software-path calibration as aligned text lines."""
    fit = result["fit"]
    g = result["grid"]
    share = (result.get("software_share") or {}).get("software_share")
    rows = [("backend", result["backend"]), ("measured on", f"{result['measured_on']}, {result['date']}, "
                                                            f"over {result['transport']}"),
            ("generation", f"{result.get('generation') or software_generation(result)}: software "
                           + (f"{100 * share:.0f} % of its KV time (modelled from the fit over the grid)"
                              if share is not None else "share unknown (no KV time)")
                           + (f", and {fit['ns_per_request'] / 1000:.4g} us per request (one batch call), step "
                              f"time in a replay" if fit["ns_per_request"] > 0 else ""))]
    iso = _isolation_text(result)
    if iso:
        rows.append(("isolation", iso))
    rows += [("grid", f"batches {','.join(map(str, g['batches']))} x objects "
                      f"{','.join(_bytes_text(s) for s in g['object_bytes'])}, {g['reps']} reps each")]
    for t, unit in zip(COST_TERMS, ("per request", "per object", "per byte")):
        rows.append((unit, f"{fit[t]:.4g} ns +- {fit['stderr'][t]:.2g}"
                           + (" (held at 0)" if t in fit["held_at_zero"] else "")))
    rows.append(("fit", f"R^2 {fit['r2']:.4f}, largest mean residual {100 * fit['max_abs_rel_residual']:.1f}% "
                        f"of a point's time, medians of {fit['timings']} timings at {fit['points']} points"))
    fs = result.get("filesystem")
    if fs:
        rows.append(("file system", f"{fs['share_median']:.0%} of the read time (median over the grid; "
                                    f"{fs['fs_type'] or 'type unknown'}, preadv through it against O_DIRECT)"))
    p = result["profile"]
    rows.append(("profile", f"{p['name']}: software parts " + ", ".join(p["software"]) if p["software"]
                 else f"{p['name']}: no software parts"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _bytes_text(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"
