"""Tier profiles: what an emulated tier (``emu:PROFILE``, ``vemu:PROFILE``) stands for.

A profile gives a tier's first-access latency, sustained bandwidth, concurrency (accesses in
flight together) and per-access software overhead, with the sources of those figures. Built-in
profiles come from published measurements (docs/tier-profiles.md has the table and the timing
model); user profiles are TOML files, and ``kvemu calibrate --out`` writes one from a measured
backend, so a measured machine can be emulated elsewhere.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ConfigError
from .inputs import loads_bounded, not_regular

KINDS = ("memory", "storage")


#: Largest concurrency (cbackends/emu.c, EMU_MAX_CONCURRENCY): beyond any batch, so beyond any effect.
MAX_CONCURRENCY = 1 << 20

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NUMBERS = ("latency_ns", "bandwidth_gbps", "concurrency", "overhead_ns")
_FIELDS = ("name", "description", "kind", *_NUMBERS, "sources")
_REQUIRED = ("kind", "latency_ns", "bandwidth_gbps", "concurrency")
#: Top-level tables of a profile file besides the profile itself; kept as provenance, not checked.
_EXTRA_TABLES = ("calibration",)


@dataclass(frozen=True)
class Profile:
    """One tier. Times in ns, bandwidth in GB/s (10^9 bytes/s, i.e. bytes/ns)."""

    name: str
    kind: str
    latency_ns: float
    bandwidth_gbps: float
    concurrency: int
    overhead_ns: float = 0.0
    description: str = ""
    sources: tuple[str, ...] = field(default_factory=tuple)

    def access_ns(self, nbytes: int) -> float:
        """Time of one access of ``nbytes`` on an idle tier: overhead + latency + bytes / bandwidth."""
        return self.overhead_ns + self.latency_ns + nbytes / self.bandwidth_gbps

    def batch_times(self, sizes) -> tuple[list[float], float]:
        """Per-access latencies and the busy time of a batch (ns, unrounded): the timing model.

        The C backends compute exactly this (cbackends/emu.c, emu_model), in the same order; see
        docs/tier-profiles.md. One CPU issues accesses in order, ``overhead_ns`` each, never more
        than ``concurrency`` in flight; ``latency_ns`` after an access is issued its data moves
        over one link of ``bandwidth_gbps``, shared in issue order.
        """
        o, lat, bw, c = self.overhead_ns, self.latency_ns, self.bandwidth_gbps, self.concurrency
        issue: list[float] = []
        done: list[float] = []
        cpu_free = link_free = 0.0
        for k, b in enumerate(sizes):
            slot = done[k - c] if k >= c else 0.0
            start = cpu_free if cpu_free > slot else slot
            issue.append(start)
            cpu_free = start + o
            ready = cpu_free + lat
            d = (link_free if link_free > ready else ready) + float(b) / bw
            done.append(d)
            link_free = d
        return [d - i for d, i in zip(done, issue)], (done[-1] if done else 0.0)

    def c_args(self) -> str:
        """The option string the C backends emu and vemu take."""
        return (f"name={self.name},kind={self.kind},latency_ns={self.latency_ns!r},"
                f"gbps={self.bandwidth_gbps!r},concurrency={self.concurrency},overhead_ns={self.overhead_ns!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sources"] = list(self.sources)
        return d

    def to_toml(self, extra: dict | None = None) -> str:
        """A TOML file that :func:`load_profile` reads back as this profile (``extra``: a
        ``[calibration]`` table of provenance)."""
        lines = ["[profile]"]
        for key in _FIELDS:
            lines.append(f"{key} = {_toml_value(getattr(self, key))}")
        if extra:
            lines += ["", "[calibration]"]
            for key, value in extra.items():
                if value is not None:
                    lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    import json

    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"cannot write {v} to a TOML profile")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # a TOML basic string accepts JSON's escapes
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {type(v).__name__} to a TOML profile")


# ------------------------------------------------------------------------------- validation


def _type_name(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "table"}.get(type(v), type(v).__name__)


#: What a profile's figures may be: per access at most 10 ms of latency or overhead (a tier slower
#: than that is not a KV tier), bandwidth from 1 MB/s to 100 TB/s.
PROFILE_BOUNDS = {"latency_ns": (0.0, 1e7), "overhead_ns": (0.0, 1e7), "bandwidth_gbps": (1e-3, 1e5)}


def profile_from_mapping(data: dict, where: str, default_name: str = "custom") -> Profile:
    """A validated profile from a mapping of its fields; errors are one line naming ``where``."""
    unknown = [k for k in data if k not in _FIELDS]
    if unknown:
        raise ConfigError(f"{where}: unknown profile key '{unknown[0]}' (known: {', '.join(_FIELDS)})")
    for key in _REQUIRED:
        if key not in data:
            raise ConfigError(f"{where}: profile is missing '{key}'")
    values: dict = {}
    for key in ("latency_ns", "bandwidth_gbps", "overhead_ns"):
        if key not in data:
            continue
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{where}: profile key '{key}' must be a number, got {_type_name(v)}")
        if not math.isfinite(v):
            raise ConfigError(f"{where}: profile key '{key}' must be finite, got {v}")
        if v < 0 or (key == "bandwidth_gbps" and v == 0):
            bound = "> 0" if key == "bandwidth_gbps" else ">= 0"
            raise ConfigError(f"{where}: profile key '{key}' must be {bound}, got {v}")
        lo, hi = PROFILE_BOUNDS[key]
        if not lo <= v <= hi:
            raise ConfigError(f"{where}: profile key '{key}' must be between {lo:g} and {hi:g}, got {v:g} "
                              f"(bounds in docs/tier-profiles.md: an emulated access must not wait for minutes)")
        values[key] = float(v)
    c = data["concurrency"]
    if isinstance(c, bool) or not isinstance(c, int):
        raise ConfigError(f"{where}: profile key 'concurrency' must be an integer, got {_type_name(c)}")
    if not 1 <= c <= MAX_CONCURRENCY:
        raise ConfigError(f"{where}: profile key 'concurrency' must be in 1..{MAX_CONCURRENCY}, got {c}")
    kind = data["kind"]
    if kind not in KINDS:
        raise ConfigError(f"{where}: profile key 'kind' must be one of {', '.join(KINDS)}, got {kind!r}")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"{where}: profile key 'name' must be 1-64 of [A-Za-z0-9._-] starting with a letter "
                          f"or digit, got {name!r}")
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise ConfigError(f"{where}: profile key 'description' must be a string, got {_type_name(desc)}")
    sources = data.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise ConfigError(f"{where}: profile key 'sources' must be an array of strings")
    return Profile(name=name, kind=kind, latency_ns=values["latency_ns"], bandwidth_gbps=values["bandwidth_gbps"],
                   concurrency=c, overhead_ns=values.get("overhead_ns", 0.0), description=desc,
                   sources=tuple(sources))


def load_profile(path) -> Profile:
    """A profile from a TOML file: a ``[profile]`` table, or the same keys at the top level."""
    p = Path(path)
    why = not_regular(p)
    if why:
        raise ConfigError(f"{p}: {why}")
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: profile file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read profile ({getattr(e, 'strerror', None) or e})") from None
    try:
        doc = loads_bounded(tomllib.loads, text, f"{p}: the profile", ConfigError)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None
    if "profile" in doc:
        other = [k for k in doc if k != "profile" and k not in _EXTRA_TABLES]
        if other:
            raise ConfigError(f"{p}: unknown top-level key '{other[0]}' next to [profile] "
                              f"(allowed: profile, {', '.join(_EXTRA_TABLES)})")
        if not isinstance(doc["profile"], dict):
            raise ConfigError(f"{p}: 'profile' must be a table")
        data = doc["profile"]
    else:
        data = {k: v for k, v in doc.items() if k not in _EXTRA_TABLES}
    return profile_from_mapping(data, str(p), default_name=_default_name(p))


def _default_name(p: Path) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", p.stem)[:64].lstrip("._-")
    return stem or "custom"


# ------------------------------------------------------------------------------- built-ins

_MLC = "Intel MLC outputs, 2-socket Cascade Lake / Ice Lake Xeon (shared/REFERENCE.md)"
_CXL = ("CXL Type-3 expanders: Intel CacheLib OCP demo 250 ns / 17.8 GB/s; public MLC outputs up to "
        "370 ns / 31 GB/s (shared/REFERENCE.md)")
#: One 200 Gb/s NIC as Mooncake's Transfer Engine drives it: 87 GB/s over 4 x 200 Gbps RoCE (Mooncake README).
RDMA_NIC_GBPS = 87.0 / 4

#: Block size at which memory tiers' concurrency is set: one layer of a 16-token Llama-3-8B block.
REFERENCE_BLOCK_BYTES = 64 << 10


def memory_concurrency(latency_ns: float, bandwidth_gbps: float) -> int:
    """Block accesses a memory tier keeps in flight: 1 + ceil(latency x bandwidth / 64 KiB).

    Little's law at the block: enough 64 KiB accesses waiting on their latency to keep the link
    busy, plus the one transferring. The line fills a memory tier overlaps are inside one access,
    which streams at the bandwidth (docs/tier-profiles.md).
    """
    return 1 + math.ceil(latency_ns * bandwidth_gbps / REFERENCE_BLOCK_BYTES)


_BLOCK_LITTLE = ("concurrency: 1 + ceil(latency x bandwidth / 64 KiB), Little's law at a 64 KiB block "
                 "(docs/tier-profiles.md)")

BUILTIN_PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile(
        name="hbm", kind="memory", latency_ns=500.0, bandwidth_gbps=3350.0,
        concurrency=memory_concurrency(500.0, 3350.0),
        description="GPU HBM3 of an H100 SXM: the tier KV normally lives in, for comparison",
        sources=("bandwidth: NVIDIA H100 SXM datasheet, 3.35 TB/s (shared/REFERENCE.md)",
                 "latency: ~400-600 ns load-to-use in public GPU microbenchmarks; an estimate, not in "
                 "shared/REFERENCE.md",
                 _BLOCK_LITTLE),
    ),
    Profile(
        name="local-dram", kind="memory", latency_ns=85.0, bandwidth_gbps=176.0,
        concurrency=memory_concurrency(85.0, 176.0),
        description="host DRAM of one socket, 2-socket Xeon server (idle latency, per-socket bandwidth)",
        sources=(f"latency 81-89 ns idle, midpoint; bandwidth ~176 GB/s per socket: {_MLC}", _BLOCK_LITTLE),
    ),
    Profile(
        name="remote-numa", kind="memory", latency_ns=142.0, bandwidth_gbps=56.0,
        concurrency=memory_concurrency(142.0, 56.0),
        description="the other socket's DRAM over one UPI hop",
        sources=(f"latency 140-143 ns, bandwidth ~56 GB/s cross-node: {_MLC}",
                 "Quartz emulator README: local 91.9 ns, remote 163.9 ns (HewlettPackard/quartz)", _BLOCK_LITTLE),
    ),
    Profile(
        name="cxl-pool", kind="memory", latency_ns=310.0, bandwidth_gbps=24.0,
        concurrency=memory_concurrency(310.0, 24.0),
        description="one CXL Type-3 memory expander (a pool of one device), loads and stores",
        sources=(f"latency 310 ns and bandwidth 24 GB/s: midpoints of 250-370 ns and 17-31 GB/s per device; {_CXL}",
                 _BLOCK_LITTLE),
    ),
    Profile(
        name="cxl-pool-multi", kind="memory", latency_ns=410.0, bandwidth_gbps=96.0,
        concurrency=memory_concurrency(410.0, 96.0),
        description="pooled CXL memory interleaved over 4 devices behind a switch: 4x the bandwidth of one, "
                    "a switch hop more latency",
        sources=("latency 410 ns: top of 140-410 ns measured across CXL devices, Melody (ASPLOS'25); Pond "
                 "(ASPLOS'23) puts pool latency about one NUMA hop above local",
                 f"bandwidth 96 GB/s: 4 devices x 24 GB/s ({_CXL}); PCIe5 x8 ~32 GB/s per direction per device",
                 _BLOCK_LITTLE),
    ),
    Profile(
        name="rdma-storage", kind="storage", latency_ns=2300.0 - 4096 / RDMA_NIC_GBPS, bandwidth_gbps=RDMA_NIC_GBPS,
        concurrency=16,
        description="a remote memory pool reached by one-sided RDMA (Mooncake Store style) over one 200 Gb/s NIC",
        sources=("latency: perftest ib_*_lat ~2.3 us one-way at 4 KiB, less 4 KiB / 21.75 GB/s so that a 4 KiB "
                 "access costs 2.3 us (shared/REFERENCE.md); ~0.8 us at 32 B",
                 "bandwidth 21.75 GB/s per 200 Gb/s NIC: what Mooncake's Transfer Engine delivers, 87 GB/s over "
                 "4 x 200 Gbps RoCE for 40 GB of KV (Mooncake README, 'Superior performance at scale'); the line "
                 "rate is 25 GB/s (shared/REFERENCE.md), which no transfer engine reaches",
                 "concurrency 16: RDMA reads outstanding per queue pair (max_qp_rd_atom that ibv_devinfo "
                 "reports on ConnectX NICs); 13 x 4 KiB in flight already fill the link at 2.3 us"),
    ),
    Profile(
        name="nvme", kind="storage", latency_ns=65000.0, bandwidth_gbps=7.0, concurrency=64,
        description="one NVMe TLC PCIe Gen4 drive, 4 KiB random reads through the OS",
        sources=("latency 65 us: midpoint of ~50-80 us 4 KiB QD1 in drive reviews (shared/REFERENCE.md); "
                 "measured through the OS, so per-I/O software cost is inside it (overhead_ns 0)",
                 "bandwidth ~7 GB/s sequential (drive reviews, shared/REFERENCE.md)",
                 "concurrency 64: ~1M IOPS at depth x 65 us (Little's law) = 65 in flight"),
    ),
)}


# ------------------------------------------------------------------------------- resolution


def is_profile_path(ref: str) -> bool:
    return "/" in ref or ref.endswith(".toml")


def resolve_profile(ref: str) -> Profile:
    """A built-in profile by name, or a TOML file by path (anything with a '/' or ending in .toml)."""
    if not isinstance(ref, str) or not ref:
        raise ConfigError("a tier profile is a built-in name or a .toml path, got nothing")
    if is_profile_path(ref):
        return load_profile(ref)
    try:
        return BUILTIN_PROFILES[ref]
    except KeyError:
        raise ConfigError(f"unknown tier profile '{ref}' (built-in: {', '.join(BUILTIN_PROFILES)}; "
                          f"or give a .toml path)") from None


_OVERRIDES = {"latency_ns": float, "bandwidth_gbps": float, "overhead_ns": float, "concurrency": int}


def emulated_backend_args(spec) -> tuple[Profile, str]:
    """An ``emu``/``vemu`` spec (a BackendSpec or its text) -> (profile, option string for C).

    Its target is the profile, a built-in name or a .toml path; its options override the
    profile's numbers (``latency_ns``, ``bandwidth_gbps``, ``concurrency``, ``overhead_ns``) or are
    the backend's own (``hugepages=0|1`` for emu: backend_spec.KINDS says which it takes).
    """
    from .backend_spec import BackendSpec

    spec = BackendSpec.parse(spec)
    backend, ref = spec.name, spec.target
    if not ref:
        raise ConfigError(f"{backend} needs a tier profile first: {backend}:NAME or {backend}:PATH.toml "
                          f"(built-in: {', '.join(BUILTIN_PROFILES)})")
    profile = resolve_profile(ref)
    own = [k for k in spec.kind.options if k not in _OVERRIDES]
    extra = []
    changes: dict = {}
    for key, value in spec.options:
        if not key and value is None:
            continue  # an empty item between commas
        if value is None:
            raise ConfigError(f"{backend}: option '{key}' is not key=value")
        if key in _OVERRIDES:
            try:
                changes[key] = _OVERRIDES[key](value)
            except ValueError:
                raise ConfigError(f"{backend}: option {key} must be a number, got {value!r}") from None
        elif key in own:
            if value not in ("0", "1"):
                raise ConfigError(f"{backend}: option {key} must be 0 or 1, got {value!r}")
            extra.append(f"{key}={value}")
        else:
            known = ", ".join([*_OVERRIDES, *own])
            raise ConfigError(f"{backend}: unknown option '{key}' (known: {known})")
    if changes:
        data = {**profile.to_dict(), **changes}
        profile = profile_from_mapping(data, spec.text())
    return profile, ",".join([profile.c_args(), *extra])


def counterpart_spec(spec) -> str | None:
    """The emulated backend standing in for a real one that cannot run here, or None: its kind's
    counterpart profile (backend_spec.KINDS: numa -> emu:remote-numa, mmap of a DAX device ->
    emu:cxl-pool and of a file emu:nvme, uring -> emu:nvme), with a queue depth as the
    concurrency where the backend has one."""
    from .backend_spec import BackendSpec

    spec = BackendSpec.parse(spec)
    kind = spec.kind
    profile = kind.dax_counterpart if kind.dax_counterpart and spec.on_dax_device() else kind.counterpart
    if profile is None:
        return None
    target = f"emu:{profile}"
    if kind.queue_depth:
        qd = spec.option("qd")
        if qd and qd.isdigit() and int(qd) >= 1:
            target += f",concurrency={min(int(qd), BUILTIN_PROFILES[profile].concurrency)}"
    return target


__all__ = ["BUILTIN_PROFILES", "KINDS", "MAX_CONCURRENCY", "Profile", "counterpart_spec", "emulated_backend_args",
           "load_profile", "profile_from_mapping", "resolve_profile"]
