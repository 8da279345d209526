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

import datetime as _dt
import statistics

import numpy as np

from . import __version__
from .errors import BackendUnavailable, ConfigError, OutputError
from .backend_spec import BackendSpec
from .profiles import MAX_CONCURRENCY, emulated_backend_args, Profile, memory_concurrency, profile_from_mapping

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
    to measure (see the module's docstring).
    """
    parsed = BackendSpec.parse(spec)
    if parsed.kind.virtual:
        profile = parsed.args() if parsed.target else "PROFILE"
        raise ConfigError(
            f"cannot calibrate {parsed}: {parsed.name} is the profile's model in virtual time, there is "
            f"nothing to measure; calibrate emu:{profile} to see what this host can emulate")
    from .replay.host import host_load, load_sample, load_warning

    before = load_sample()
    result = _measure(parsed.text(), parsed.name, buffer_bytes=buffer_bytes, hops=hops, rounds=rounds,
                      name=name, log=log)
    # what else ran meanwhile: write_profile refuses a profile measured under a load that moved it
    result["host_load"] = host_load(before, load_sample())
    line = load_warning(result["host_load"], f"calibrate --backend {parsed.text()}")
    if line:
        result["warnings"].append(line)
    return result


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
    from .replay import host_facts

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
    from .backends import ENTRY_DTYPE, STEP_DTYPE

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
    from .backends import Backend

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
    from .backends import Backend

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
    return profile_from_mapping(data, f"calibration of {spec}")


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
    from .output import atomic_output

    load = result.get("host_load") or {}
    if load.get("moved") and not force_load:
        raise OutputError(
            f"{path}: not written: other processes took {load['others_share']:.0%} of this host's "
            f"{load.get('cpus')} CPUs while calibrating (load average {load.get('loadavg_1m_after')}), so "
            f"the figures are partly this host's contention; calibrate on a quiet host, or give --force-load "
            f"to write them anyway")

    text = profile_of(result).to_toml(extra=calibration_table(result))
    with atomic_output(path, force=force) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
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
