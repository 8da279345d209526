"""Tier profiles: what an emulated tier (``emu:PROFILE``, ``vemu:PROFILE``) stands for.

A profile gives a tier's first-access latency, sustained bandwidth, concurrency (accesses in
flight together) and per-access software overhead, with the sources of those figures. Built-in
profiles come from published measurements (docs/tier-profiles.md has the table and the timing
model); user profiles are TOML files, and ``kvemu calibrate --out`` writes one from a measured
backend, so a measured machine can be emulated elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .errors import ConfigError
from .inputs import loads_bounded, not_regular

KINDS = ("memory", "storage")


#: Largest concurrency (cbackends/emu.c, EMU_MAX_CONCURRENCY): beyond any batch, so beyond any effect.
MAX_CONCURRENCY = 1 << 20

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NUMBERS = ("latency_ns", "bandwidth_gbps", "concurrency", "overhead_ns")
_FIELDS = ("name", "description", "kind", *_NUMBERS, "sources", "generation", "gpu_direct", "software",
           "software_from")
_REQUIRED = ("kind", "latency_ns", "bandwidth_gbps", "concurrency")
#: Top-level tables of a profile file besides the profile itself; kept as provenance, not checked.
_EXTRA_TABLES = ("calibration",)


#: What a software part may say: a fixed cost per request (one engine request's lookup in the store,
#: paid whether it hits or misses), per I/O (one access: one object, one chunk transfer), a cost per
#: byte it moves, which path it belongs to, and where the figure comes from.
_PART_KEYS = ("ns_per_request", "ns_per_io", "ns_per_byte", "path", "source")
_PART_NUMBERS = ("ns_per_request", "ns_per_io", "ns_per_byte")
#: Bounds of a part's figures: at most 10 ms per request or I/O (as latency_ns), at most 100 ns per
#: byte (10 MB/s).
PART_BOUNDS = {"ns_per_request": (0.0, 1e7), "ns_per_io": (0.0, 1e7), "ns_per_byte": (0.0, 100.0)}
#: Where a part sits: ``store`` (the store's own metadata service: lookups, the master's RPC per
#: object; a P/D hand-off over the same transfer engine does not pay it) or ``transfer`` (moving the
#: bytes: host copies, I/O submission; every transfer over that engine pays it, store or hand-off).
PART_PATHS = ("store", "transfer")


@dataclass(frozen=True)
class SoftwarePart:
    """One named part of a storage tier's software path (docs/tier-profiles.md, "The software path"):
    a fixed cost per I/O (metadata lookup, client and server CPU, serialisation, submission) and a
    cost per byte (a copy through a host bounce buffer), paid by the issuing CPU."""

    name: str
    ns_per_io: float = 0.0
    ns_per_byte: float = 0.0
    source: str = ""
    ns_per_request: float = 0.0
    path: str = "transfer"

    def io_ns(self, nbytes: int) -> float:
        """What this part adds to one I/O of ``nbytes``."""
        return self.ns_per_io + nbytes * self.ns_per_byte

    def ns(self, requests: int, accesses: int, nbytes: int) -> float:
        """What this part adds to ``requests`` lookups and ``accesses`` I/Os moving ``nbytes``."""
        return requests * self.ns_per_request + accesses * self.ns_per_io + nbytes * self.ns_per_byte

    def to_dict(self) -> dict:
        return {"ns_per_request": self.ns_per_request, "ns_per_io": self.ns_per_io, "ns_per_byte": self.ns_per_byte,
                "path": self.path, "source": self.source}


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
    software: tuple[SoftwarePart, ...] = field(default_factory=tuple)
    #: What software generation a storage profile models, in words ("Mooncake Store via LMCache,
    #: zero-copy batch_get_into, mid-2025"): what the report and the demo print beside its rows.
    generation: str = ""
    #: Storage whose bytes move between the medium and GPU memory by DMA (GPUDirect RDMA, GPUDirect
    #: Storage, GPU-initiated I/O): no host bounce buffer between the medium and the link.
    gpu_direct: bool = False
    #: Where the software parts came from when they are another profile's (``software_from``: a built-in
    #: name or a .toml path; docs/tier-profiles.md, "Calibrating the software path"); "" when they are
    #: this profile's own. The wire and medium (latency, bandwidth, concurrency) are always its own.
    software_from: str = ""

    # The software path composes into the timing model's per-access numbers (docs/tier-profiles.md):
    # its fixed costs are paid by the issuing CPU per access, with overhead_ns; its per-byte costs are a
    # copy in series with the medium's link, so 1/bandwidth grows by them. Memory tiers have none.
    @property
    def software_ns_per_io(self) -> float:
        return sum(p.ns_per_io for p in self.software)

    @property
    def software_ns_per_byte(self) -> float:
        return sum(p.ns_per_byte for p in self.software)

    @property
    def software_ns_per_request(self) -> float:
        """The lookup each engine request pays, hit or miss (not in the C model: the closed loop charges
        it to the step that first carries the request)."""
        return sum(p.ns_per_request for p in self.software)

    @property
    def transfer_parts(self) -> tuple[SoftwarePart, ...]:
        """The parts that move bytes (path ``transfer``): what a P/D hand-off over the same transfer
        engine pays too (replay.closed.disagg)."""
        return tuple(p for p in self.software if p.path == "transfer")

    @property
    def staged(self) -> bool:
        """Storage whose bytes pass a host bounce buffer between the medium and the GPU link."""
        return self.kind == "storage" and not self.gpu_direct

    @property
    def label(self) -> str:
        """The profile's name with the software generation it models, for reports."""
        return f"{self.name} ({self.generation})" if self.generation else self.name

    @property
    def issue_ns(self) -> float:
        """What the issuing CPU pays per access: overhead_ns and the software path's fixed costs."""
        return self.overhead_ns + self.software_ns_per_io

    @property
    def path_gbps(self) -> float:
        """Bandwidth of medium and software path in series: 1 / (1 / bandwidth + software ns per byte)."""
        per_byte = self.software_ns_per_byte
        return self.bandwidth_gbps if per_byte == 0 else 1.0 / (1.0 / self.bandwidth_gbps + per_byte)

    def software_ns(self, accesses: int, nbytes: int, requests: int = 0) -> float:
        """Software-path time of ``accesses`` I/Os moving ``nbytes`` in all, for ``requests`` engine
        requests' lookups (hits and misses alike) (modelled)."""
        return sum(p.ns(requests, accesses, nbytes) for p in self.software)

    def access_ns(self, nbytes: int) -> float:
        """Time of one access of ``nbytes`` on an idle tier: overhead + software path + latency + bytes /
        bandwidth."""
        return self.issue_ns + self.latency_ns + nbytes / self.path_gbps

    def batch_times(self, sizes) -> tuple[list[float], float]:
        """Per-access latencies and the busy time of a batch (ns, unrounded): the timing model.

        The C backends compute exactly this (cbackends/emu.c, emu_model), in the same order; see
        docs/tier-profiles.md. One CPU issues accesses in order, ``overhead_ns`` each, never more
        than ``concurrency`` in flight; ``latency_ns`` after an access is issued its data moves
        over one link of ``bandwidth_gbps``, shared in issue order. With a software path, ``issue_ns``
        and ``path_gbps`` stand for overhead_ns and bandwidth_gbps.
        """
        o, lat, bw, c = self.issue_ns, self.latency_ns, self.path_gbps, self.concurrency
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
        """The option string the C backends emu and vemu take: the software path composed in."""
        return (f"name={self.name},kind={self.kind},latency_ns={self.latency_ns!r},"
                f"gbps={self.path_gbps!r},concurrency={self.concurrency},overhead_ns={self.issue_ns!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sources"] = list(self.sources)
        d["software"] = {p.name: p.to_dict() for p in self.software}
        return d

    def to_toml(self, extra: dict | None = None) -> str:
        """A TOML file that :func:`load_profile` reads back as this profile (``extra``: a
        ``[calibration]`` table of provenance)."""
        lines = ["[profile]"]
        for key in _FIELDS:
            if key != "software" and (key != "software_from" or self.software_from):
                lines.append(f"{key} = {_toml_value(getattr(self, key))}")
        for p in self.software:
            lines += ["", f"[profile.software.{p.name}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in p.to_dict().items()]
        if extra:
            lines += ["", "[calibration]"]
            for key, value in extra.items():
                if value is not None:
                    lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
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
    generation = data.get("generation", "")
    if not isinstance(generation, str):
        raise ConfigError(f"{where}: profile key 'generation' must be a string, got {_type_name(generation)}")
    gpu_direct = data.get("gpu_direct", False)
    if not isinstance(gpu_direct, bool):
        raise ConfigError(f"{where}: profile key 'gpu_direct' must be true or false, got {_type_name(gpu_direct)}")
    if gpu_direct and kind != "storage":
        raise ConfigError(f"{where}: profile key 'gpu_direct' is for storage tiers (DMA between the medium and GPU "
                          f"memory, no host bounce buffer)")
    software_from = data.get("software_from", "")
    if not isinstance(software_from, str):
        raise ConfigError(f"{where}: profile key 'software_from' must be a profile name or .toml path, got "
                          f"{_type_name(software_from)}")
    if software_from and "software" not in data:
        other = _software_of(software_from, where, kind)
        # the software generation is the parts': a measured stack on this profile's wire and medium
        software, generation = other.software, other.generation or f"software path of {other.name}"
    else:
        # a profile kvemu wrote carries both: the parts it took, and where from (provenance)
        software = _software_parts(data.get("software", {}), where)
    if software and kind != "storage":
        raise ConfigError(f"{where}: profile key 'software' is for storage tiers; a memory tier is reached by loads "
                          f"and stores, with no software path")
    return Profile(name=name, kind=kind, latency_ns=values["latency_ns"], bandwidth_gbps=values["bandwidth_gbps"],
                   concurrency=c, overhead_ns=values.get("overhead_ns", 0.0), description=desc,
                   sources=tuple(sources), software=software, generation=generation, gpu_direct=gpu_direct,
                   software_from=software_from)


#: Profile files being loaded by this thread: a ``software_from`` that leads back to one is a cycle.
_LOADING = threading.local()


def _software_of(ref: str, where: str, kind: str) -> Profile:
    """Profile ``ref`` (a built-in name or a .toml path), whose software parts ``software_from`` takes."""
    if kind != "storage":
        raise ConfigError(f"{where}: profile key 'software_from' is for storage tiers; a memory tier has no "
                          f"software path")
    try:
        other = resolve_profile(ref)
    except ConfigError as e:
        raise ConfigError(f"{where}: software_from: {e}") from None
    if other.kind != "storage" or not other.software:
        raise ConfigError(f"{where}: software_from '{ref}': profile {other.name} has no software parts to take")
    return other


def _software_parts(data, where: str) -> tuple[SoftwarePart, ...]:
    """A profile's software parts from a mapping name -> {ns_per_io, ns_per_byte, source}."""
    if isinstance(data, (list, tuple)) and all(isinstance(p, SoftwarePart) for p in data):
        data = {p.name: p.to_dict() for p in data}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: profile key 'software' must be a table of parts, got {_type_name(data)}")
    parts = []
    for name, part in data.items():
        w = f"{where}: software part '{name}'"
        if not _NAME_RE.fullmatch(str(name)):
            raise ConfigError(f"{where}: software part name must be 1-64 of [A-Za-z0-9._-], got {name!r}")
        if not isinstance(part, dict):
            raise ConfigError(f"{w} must be a table, got {_type_name(part)}")
        unknown = [k for k in part if k not in _PART_KEYS]
        if unknown:
            raise ConfigError(f"{w}: unknown key '{unknown[0]}' (known: {', '.join(_PART_KEYS)})")
        if not any(k in part for k in _PART_NUMBERS):
            raise ConfigError(f"{w} needs ns_per_request, ns_per_io or ns_per_byte")
        nums = {}
        for key in _PART_NUMBERS:
            v = part.get(key, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"{w}: '{key}' must be a finite number, got {v!r}")
            lo, hi = PART_BOUNDS[key]
            if not lo <= v <= hi:
                raise ConfigError(f"{w}: '{key}' must be between {lo:g} and {hi:g}, got {v:g}")
            nums[key] = float(v)
        source = part.get("source", "")
        if not isinstance(source, str) or not source:
            raise ConfigError(f"{w}: 'source' must say where its figures come from (a non-empty string)")
        path = part.get("path", "transfer")
        if path not in PART_PATHS:
            raise ConfigError(f"{w}: 'path' must be one of {', '.join(PART_PATHS)}, got {path!r}")
        parts.append(SoftwarePart(str(name), nums["ns_per_io"], nums["ns_per_byte"], source, nums["ns_per_request"],
                                  path))
    return tuple(parts)


def load_profile(path) -> Profile:
    """A profile from a TOML file: a ``[profile]`` table, or the same keys at the top level. A relative
    ``software_from`` path is relative to the file's folder."""
    p = Path(path)
    loading = getattr(_LOADING, "paths", None)
    if loading is None:
        loading = _LOADING.paths = set()
    key = os.path.abspath(p)
    if key in loading:
        raise ConfigError(f"{p}: software_from leads back to this file (a cycle)")
    if len(loading) >= 16:
        raise ConfigError(f"{p}: software_from goes through more than 16 profile files")
    loading.add(key)
    try:
        return _load_profile(p)
    finally:
        loading.discard(key)


def _load_profile(p: Path) -> Profile:
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
    ref = data.get("software_from")
    if isinstance(ref, str) and is_profile_path(ref) and not Path(ref).is_absolute():
        data = {**data, "software_from": str(p.parent / ref)}
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


# The software path of storage tiers (docs/tier-profiles.md, "The software path"): per I/O = per access.
# Every part names the publication, software and date its figure describes; none is this development VM's.
#: The kernel block layer's cost per O_DIRECT I/O on the issuing CPU (io_uring / libaio, interrupts).
_KERNEL_IO_NS = 1250.0
_KERNEL_IO = SoftwarePart(
    "kernel_io", ns_per_io=_KERNEL_IO_NS,
    source="submission, interrupt and completion of one O_DIRECT I/O through the Linux block layer (io_uring or "
           "libaio) by the issuing CPU: one core is used up at ~800,000 IOPS (Jens Axboe, the block layer's "
           "maintainer, quoted in 'After 30+ years, is Linux disk I/O finally fast enough?', Floe blog, "
           "2026-03-26): 1.25 us per I/O; inside the drive's 4 KiB time through the OS (nixlbench POSIX/Linux AIO "
           "on a Samsung PM1735: 24.8 us at 4 KiB, ai-dynamo/nixl PR #885)")
_FILESYSTEM = SoftwarePart(
    "filesystem", ns_per_byte=(0.84 / 0.16) / 7.0,
    source="the kernel file system on the read path (page cache, VFS, extent lookup): 84 % of SSD-based KV "
           "retrieval time is in it rather than in device access (Unified KV Pooling, arXiv 2606.14779, "
           "2026-06-10, LMCache-style file backend on ext4-class file systems); applied to bulk transfers as "
           "0.84 / 0.16 = 5.25 x the drive's own time per byte (5.25 / 7 GB/s); its per-I/O share is not "
           "published separately")
_SPDK_IO = SoftwarePart(
    "spdk_io", ns_per_io=100.0,
    source="a user-space polled NVMe driver's CPU per I/O (SPDK-style passthrough, no kernel, no interrupts): "
           "10 M 4 KiB random reads per second from one thread (SPDK, SNIA SDC 2019, '10 Million I/Ops From a "
           "Single Thread'; 13.85 M 512 B IOPS on one Xeon 8380 core, spdk.io 2021-05-06): 100 ns per I/O")
_OBJECT_RPC = SoftwarePart(
    "object_rpc", ns_per_io=1000.0, path="store",
    source="AN ESTIMATE, not a measurement: the store master's per-key replica lookup (Mooncake Store "
           "GetReplicaList, once per key even in a batch: kvcache-ai/Mooncake PR #2508; 'basically unordered_map "
           "inserts and lookups', issue #990, 2025), ~1 us per object, bounded by those descriptions; no published "
           "per-key time of the lookup alone. Beside it: the inverse solve of #467's zero-copy retrieve gives 23.5 us "
           "per object (docs/analysis.md, tools/reproduce_papers.py --solve), and the one public per-object figure "
           "of batch_get_into, whole path, is 1 / 46,551 objects/s = 21.5 us of one host (4 KiB objects, batches "
           "of 32, TCP on a single host, 64 client lanes, jemalloc: kvcache-ai/Mooncake PR #2871, 2026-07-13); "
           "both include per-object work beyond the lookup (the transfer engine's, the client's)")
_REQUEST_LOOKUP = SoftwarePart(
    "request_lookup", ns_per_request=1.5e6, path="store",
    source="LMCache's lookup of a request's chunks in Mooncake Store (batch_exist through the external lookup "
           "client, called by vLLM's scheduler in get_num_new_matched_tokens, once per request whether it hits or "
           "misses): 1-2 ms per request, midpoint (LMCache PR #934, 2025-07-01, with PR #936's lookup client; "
           "LMCache issue #891, 2025-06-23, measured 2.6-655 ms before them)")
#: A server core's single-thread copy rate, GB/s (the host copy of the mid-2025 LMCache paths).
SERVER_MEMCPY_GBPS = 6.25
_HOST_COPY = SoftwarePart(
    "host_copy", ns_per_byte=1 / SERVER_MEMCPY_GBPS,
    source="one CPU copy of the bytes through a host buffer (LMCache's remote connector copying Mooncake Store "
           "get() results, mid-2025: kvcache-ai/Mooncake issue #467, 2025-06-10, Mooncake main with LMCache dev): "
           "single-thread memcpy of a server core, 6.25 GB/s (dual-socket Xeon E5-2650 v2, CacheBench copy of "
           "64 MiB buffers; 5.9-9.3 GB/s over three dual-socket Xeons: Intel Developer Zone forum, "
           "'Single-threaded memory performance for dual socket Xeon E5-* systems', 2014, J. McCalpin: a core's "
           "copy is bound by its ~10 outstanding L1 misses per memory latency)")

_BLOCK_LITTLE = ("concurrency: 1 + ceil(latency x bandwidth / 64 KiB), Little's law at a 64 KiB block "
                 "(docs/tier-profiles.md)")

_RDMA_SOURCES = (
    "latency: perftest ib_*_lat ~2.3 us one-way at 4 KiB, less 4 KiB / 21.75 GB/s so that a 4 KiB access costs "
    "2.3 us (shared/REFERENCE.md); ~0.8 us at 32 B",
    "bandwidth 21.75 GB/s per 200 Gb/s NIC: what Mooncake's Transfer Engine delivers, 87 GB/s over 4 x 200 Gbps "
    "RoCE for 40 GB of KV (Mooncake README, 'Superior performance at scale'); the line rate is 25 GB/s "
    "(shared/REFERENCE.md), which no transfer engine reaches",
    "concurrency 16: RDMA reads outstanding per queue pair (max_qp_rd_atom that ibv_devinfo reports on ConnectX "
    "NICs); 13 x 4 KiB in flight already fill the link at 2.3 us")
_NVME_SOURCES = (
    "latency 65 us: midpoint of ~50-80 us 4 KiB QD1 in drive reviews (shared/REFERENCE.md), measured through the "
    "OS with O_DIRECT; less the kernel I/O path (kernel_io, 1.25 us), so that the drive's own time is 63.75 us",
    "bandwidth ~7 GB/s sequential (drive reviews, shared/REFERENCE.md)",
    "concurrency 64: ~1M IOPS at depth x 65 us (Little's law) = 65 in flight")


def _rdma_store(name: str, generation: str, description: str, software, gpu_direct: bool) -> Profile:
    return Profile(name=name, kind="storage", latency_ns=2300.0 - 4096 / RDMA_NIC_GBPS, bandwidth_gbps=RDMA_NIC_GBPS,
                   concurrency=16, description=description, sources=_RDMA_SOURCES, software=tuple(software),
                   generation=generation, gpu_direct=gpu_direct)


def _nvme(name: str, generation: str, description: str, software, gpu_direct: bool) -> Profile:
    return Profile(name=name, kind="storage", latency_ns=65000.0 - _KERNEL_IO_NS, bandwidth_gbps=7.0, concurrency=64,
                   description=description, sources=_NVME_SOURCES, software=tuple(software), generation=generation,
                   gpu_direct=gpu_direct)


_STORAGE = (
    _rdma_store("mooncake-lmcache-copy", "Mooncake Store via LMCache, host copy of get() results, mid-2025",
                "a remote DRAM pool (Mooncake Store) over one 200 Gb/s RDMA NIC, reached through LMCache's remote "
                "connector as of June 2025: a per-request lookup, a master RPC per object, a CPU copy of every byte",
                (_REQUEST_LOOKUP, _OBJECT_RPC, _HOST_COPY), gpu_direct=False),
    _rdma_store("mooncake-lmcache-zerocopy", "Mooncake Store via LMCache, zero-copy batch_get_into, mid-2025",
                "the same store after LMCache's zero-copy batch_get_into / batch_put_from into a registered host "
                "buffer (LMCache PR #934, 2025-07-01; PR #988 and #1269, 2025-07/08: mooncake-store 5.37 s against an "
                "ideal 4.79 s on qwen-7b); the bytes still cross host memory on their way to the GPU",
                (_REQUEST_LOOKUP, _OBJECT_RPC), gpu_direct=False),
    _rdma_store("mooncake-gdr", "Mooncake Store, zero-copy, GPUDirect RDMA",
                "the same store with the NIC reading and writing GPU memory (GPUDirect RDMA: vLLM's Mooncake "
                "connector docs; LMCache P/D example with Mooncake Store, PR #1691, 2025-09-25: 'we use GDR to "
                "directly read from and write to GPU memory'): lookups and master RPCs only",
                (_REQUEST_LOOKUP, _OBJECT_RPC), gpu_direct=True),
    _nvme("nvme-fs", "NVMe through a kernel file system",
          "one NVMe TLC PCIe Gen4 drive read through a kernel file system (an LMCache-style file backend): the "
          "block layer per I/O and the file system per byte, staged in host memory",
          (_KERNEL_IO, _FILESYSTEM), gpu_direct=False),
    _nvme("nvme-direct", "NVMe, O_DIRECT through the kernel block layer",
          "one NVMe TLC PCIe Gen4 drive, reads with O_DIRECT (io_uring / libaio) through the kernel block layer, "
          "staged in host memory", (_KERNEL_IO,), gpu_direct=False),
    _nvme("nvme-spdk", "NVMe, user-space passthrough (SPDK-style)",
          "one NVMe TLC PCIe Gen4 drive driven from user space by a polled driver (SPDK-style passthrough, as "
          "Unified KV Pooling's KV-passthrough), staged in host memory", (_SPDK_IO,), gpu_direct=False),
    _nvme("nvme-gds", "NVMe, GPUDirect Storage (cuFile)",
          "one NVMe TLC PCIe Gen4 drive read by DMA into GPU memory (GPUDirect Storage): no host copy, but the CPU "
          "still submits every I/O through the kernel (Tutti, arXiv 2605.03375, 2026-05-05: GDS 'still relies on "
          "CPU intervention to initiate each I/O')", (_KERNEL_IO,), gpu_direct=True),
    _nvme("nvme-gpu-initiated", "NVMe, GPU-initiated I/O (Tutti-style)",
          "one NVMe TLC PCIe Gen4 drive read by I/O the GPU itself submits (Tutti, arXiv 2605.03375, 2026-05-05: "
          "the CPU loads I/O kernels once per layer, asynchronously; TTFT -78.3 % against LMCache with GPUDirect "
          "Storage): no CPU software part per I/O", (), gpu_direct=True),
    Profile(
        name="storage-rdma", kind="storage", latency_ns=65000.0 + 2300.0 - _KERNEL_IO_NS, bandwidth_gbps=RDMA_NIC_GBPS,
        concurrency=256,
        description="a disaggregated flash store reached over RDMA (3FS / NVMe-oF style): a remote NVMe read "
                    "behind one 200 Gb/s NIC, tens of us per I/O",
        sources=("latency: the nvme profile's 65 us 4 KiB read on the storage server plus one RDMA hop, "
                 "2.3 us at 4 KiB (perftest ib_*_lat, shared/REFERENCE.md); an estimate composed of the two",
                 "bandwidth 21.75 GB/s: one 200 Gb/s NIC as Mooncake's Transfer Engine drives it (Mooncake README); "
                 "the drives behind it (several at ~7 GB/s) deliver more",
                 "concurrency 256: 4 drives x 64 in flight (the nvme profile's Little's law); an estimate"),
        software=(_OBJECT_RPC, _KERNEL_IO),
        generation="3FS-style remote flash, USRBIO zero-copy client, 2025",
    ),
    Profile(
        name="object-store", kind="storage", latency_ns=5e6, bandwidth_gbps=12.5, concurrency=1000,
        description="an object store in the same zone (S3 Express One Zone class): single-digit ms to the first "
                    "byte, reached by HTTP",
        sources=("latency 5 ms: 'consistent single-digit millisecond first-byte read' latency, midpoint; AWS S3 "
                 "User Guide, 'Optimizing S3 Express One Zone performance'; an estimate within that range; the "
                 "client's request handling is inside that first-byte time as the client sees it",
                 "bandwidth 12.5 GB/s: one 100 Gb/s instance NIC; an estimate, the store itself scales further",
                 "concurrency 1000: 200,000 reads/s per directory bucket (same AWS page) x 5 ms (Little's law)"),
        software=(_HOST_COPY,),
        generation="object store over HTTP, host copy of each response",
    ),
)

#: Names kept for what they meant before the storage profiles came in generations: each is its
#: generation's profile under the old name (shipped traces, results and scripts name them).
ALIASES = {"rdma-storage": "mooncake-lmcache-copy", "nvme": "nvme-direct"}
_STORAGE = (*_STORAGE, *(
    replace(next(p for p in _STORAGE if p.name == target), name=alias,
            description=f"{next(p for p in _STORAGE if p.name == target).description} (the name of "
                        f"{target} before storage profiles came in generations)")
    for alias, target in ALIASES.items()))

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
    *_STORAGE,
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


__all__ = ["ALIASES", "BUILTIN_PROFILES", "KINDS", "MAX_CONCURRENCY", "Profile", "load_profile", "profile_from_mapping",
           "resolve_profile"]
