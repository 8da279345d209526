"""Backend specs and the table of backend kinds: the one place that knows what each backend is.

A spec names a backend and its options, as the command line takes it::

    dram                       dram:workers=2,hugepages=0
    numa:1                     mmap:/dev/dax0.0            uring:/mnt/nvme/kv.bin,qd=32
    emu:cxl-pool               vemu:nvme.toml,latency_ns=20000

:class:`BackendSpec` parses that text once, at the edge (the CLI, a sweep's spec, an API call),
and prints it back (:meth:`BackendSpec.text`); everything below takes the object. The text that
C receives (:meth:`BackendSpec.c_text`) is the target and the ``key=value`` options in the same
syntax, parsed there by one function (cbackends/).

:data:`KINDS` says, for each backend, what it stands for and what it can do: whether it moves
bytes in memory or does I/O, whether its times are measured, emulated or virtual, whether other
serving instances can share its arena, whether it has transfer workers, which emulated profile
stands in for it where this machine lacks it. No module outside this one tests a backend's name:
they ask its kind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from .errors import ConfigError
from .profiles import BUILTIN_PROFILES, Profile, is_profile_path, profile_from_mapping, resolve_profile

#: Where a backend's times come from (results ``backend.mode``; virtual time reports ``emulated``
#: with ``backend.virtual``).
MODES = ("measured", "emulated", "virtual")
#: What a backend's medium is: reached with loads and stores, or by I/O.
MEDIA = ("memory", "storage", "profile")


@dataclass(frozen=True)
class BackendKind:
    """What one backend is and can do (one row of :data:`KINDS`).

    ``target``: what the first, positional part of the options names (``"path"``, ``"node"``,
    ``"profile"``) or None. ``medium``: ``memory``, ``storage``, or ``profile`` (an emulated tier:
    its profile's kind decides). ``mode``: measured, emulated or virtual. ``shareable``: other
    instances can attach to its arena (one copy of every block, ``--sharing shared``).
    ``arena``: ``memory`` (bounded by ``--max-memory`` and free memory), ``file`` (bounded by its
    file system) or None (virtual time allocates nothing). ``workers``: moves bytes with transfer
    workers (``workers=N``), one per instance when several instances run. ``file_per_instance``:
    replicated instances each get their own file (``PATH.1``, ...), attached ones map the
    owner's. ``counterpart``: the built-in profile ``--emulate-missing`` puts in its place.
    ``dax_counterpart``: the profile standing in for it when its target is a device-DAX node
    (``/dev/dax*``) rather than a file. ``resource``: the Dask resource a sweep's cell on it takes
    (``{target}`` is its target), None for none; ``dax_resource`` in place of it on a DAX device.
    ``queue_depth``: its queue depth is the ``qd=`` option (calibration sets it). ``locality``:
    its facts say whether the replaying CPU was on the memory's node. ``assumed_gbps``: a rough
    throughput for a sweep's time estimate. ``options``: the keys it takes after the target, for
    the docs and early checks. ``twin_profile``: the built-in profile of its tier in virtual time
    where it has no ``counterpart`` (the report's virtual twin, :meth:`BackendSpec.virtual_twin`).
    ``priced_as``: the built-in tier profile whose medium the price table prices its capacity as
    (kvemu/data/prices.toml ``profiles``); None for an emulated tier, priced as its own profile
    (:meth:`BackendSpec.priced_profile`)."""

    name: str
    summary: str
    target: str | None
    medium: str
    mode: str
    shareable: bool
    arena: str | None
    workers: bool = False
    file_per_instance: bool = False
    counterpart: str | None = None
    dax_counterpart: str | None = None
    resource: str | None = "mem"
    dax_resource: str | None = None
    queue_depth: bool = False
    locality: bool = False
    assumed_gbps: float = 5.0
    options: tuple[str, ...] = ()
    twin_profile: str | None = None
    #: A store kind: the class implementing kvemu.stores.Store for it (``"module:Class"``), which
    #: Python drives beside C once per batch of the core through the one store bridge
    #: (cbackends/store.c); None for a backend C runs alone.
    store: str | None = None
    #: The built-in profile whose medium prices this backend's capacity (emu/vemu: their own profile).
    priced_as: str | None = None

    @property
    def emulated(self) -> bool:
        """Its tier is a profile (emu, vemu): Python resolves the profile, C gets its numbers."""
        return self.medium == "profile"

    @property
    def virtual(self) -> bool:
        return self.mode == "virtual"

    @property
    def lockstep(self) -> bool:
        """Several instances advance in timeline order (closed loop): an emulated or virtual tier's
        clock is the model's, so its shared queue is served in time order."""
        return self.mode in ("emulated", "virtual")

    @property
    def arena_in_memory(self) -> bool:
        return self.arena == "memory"


_MEM_OPTS = ("workers", "hugepages")
KINDS: dict[str, BackendKind] = {k.name: k for k in (
    BackendKind("dram", "host DRAM of this machine", None, "memory", "measured", True, "memory",
                workers=True, assumed_gbps=8.0, options=_MEM_OPTS, twin_profile="local-dram", priced_as="local-dram"),
    BackendKind("numa", "memory of a NUMA node (how CXL expanders appear in Linux)", "node", "memory", "measured",
                True, "memory", workers=True, counterpart="remote-numa", resource="numa{target}", locality=True,
                options=_MEM_OPTS, priced_as="remote-numa"),
    BackendKind("mmap", "a mapped file or device (device DAX, pmem, shared memory)", "path", "memory", "measured",
                True, "memory", workers=True, file_per_instance=True, counterpart="nvme", dax_counterpart="cxl-pool",
                dax_resource="dax", options=(*_MEM_OPTS, "size"), priced_as="nvme"),
    BackendKind("uring", "a file or block device read and written with io_uring and O_DIRECT", "path", "storage",
                "measured", False, "file", file_per_instance=True, counterpart="nvme", resource="uring", queue_depth=True,
                assumed_gbps=1.5, options=("qd", "batch", "size"), priced_as="nvme"),
    BackendKind("emu", "a tier this machine lacks, emulated by calibrated busy-waiting", "profile", "profile",
                "emulated", True, "memory", assumed_gbps=4.0,
                options=("latency_ns", "bandwidth_gbps", "concurrency", "overhead_ns", "software_from", "hugepages")),
    BackendKind("vemu", "the same tier in virtual time (nothing moved, nothing waited)", "profile", "profile",
                "virtual", True, None, resource=None, assumed_gbps=40.0,
                options=("latency_ns", "bandwidth_gbps", "concurrency", "overhead_ns", "software_from")),
    BackendKind("mooncake", "Mooncake Store (a master and a store client on loopback): KV chunks put and got "
                "through the store's TCP transport", None, "storage", "measured", False, "memory",
                counterpart="rdma-storage", assumed_gbps=0.5,
                options=("lease_ms", "memcpy", "start_timeout_s", "allow_exposed"),
                store="kvemu.stores.mooncake:MooncakeStore", twin_profile="rdma-storage", priced_as="rdma-storage"),
    BackendKind("files", "a file per KV chunk in a directory of this host (a file-system KV store, as LMCache's "
                "local-disk backend)", "path", "storage", "measured", False, "file", assumed_gbps=1.0,
                options=("fsync",), store="kvemu.stores.files:FileStore", twin_profile="nvme", priced_as="nvme"),
)}


def spec_forms(measured_only: bool = False) -> str:
    """The backends as --help lists them, from the table: ``dram, numa:NODE, ..., files:PATH``."""
    forms = [k.name + (f":{k.target.upper()}" if k.target else "") for k in KINDS.values()
             if not (measured_only and k.virtual)]
    return ", ".join(forms)


def kind_of(name: str) -> BackendKind:
    """The kind of backend ``name``; ConfigError naming the known ones otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ConfigError(f"unknown backend '{name}' (known: {', '.join(KINDS)})") from None


def known_kind(name) -> BackendKind | None:
    """The kind of ``name`` when it is one, else None (for reading what a results file says)."""
    return KINDS.get(name) if isinstance(name, str) else None


@dataclass(frozen=True)
class BackendSpec:
    """A backend and its options: ``kind`` (a key of :data:`KINDS`), ``target`` (the positional
    first option: a path, a NUMA node, a profile; None when absent) and ``options`` (the
    ``key=value`` pairs after it, in the order given). Build it with :meth:`parse`; the text
    form is :meth:`text`, and ``parse(s.text()) == s``."""

    name: str
    target: str | None = None
    options: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, spec: BackendSpec | str) -> BackendSpec:
        """``"uring:/x.bin,qd=8"`` -> BackendSpec("uring", "/x.bin", (("qd", "8"),)). Only the
        name is checked here (against KINDS); the options are checked by the backend."""
        if isinstance(spec, BackendSpec):
            return spec
        if not isinstance(spec, str) or not spec:
            raise ConfigError(f"backend spec must be a non-empty string like 'dram' or 'dram:hugepages=0', "
                              f"got {spec!r}")
        name, _, args = spec.partition(":")
        kind_of(name)
        parts = args.split(",") if args else []
        target = None
        if parts and "=" not in parts[0]:
            target = parts.pop(0)
        options = []
        for p in parts:
            key, eq, value = p.partition("=")
            # kept as given (C says what is wrong with it): an empty key or a bare word
            options.append((key, value) if eq else (p, None))
        return cls(name, target, tuple(options))

    @property
    def kind(self) -> BackendKind:
        return kind_of(self.name)

    # -- the text forms
    def args(self) -> str:
        """The part after ``name:``: target, then options."""
        parts = [] if self.target is None else [self.target]
        parts += [k if v is None else f"{k}={v}" for k, v in self.options]
        return ",".join(parts)

    def text(self) -> str:
        a = self.args()
        return f"{self.name}:{a}" if a else self.name

    __str__ = text

    def short(self) -> str:
        """The backend as a report names it: ``dram``, ``uring`` (no path), ``emu:cxl-pool``,
        ``numa:1``: the target only where it is not a path."""
        return self.name if self.target is None or self.kind.target == "path" else f"{self.name}:{self.target}"

    def partition_label(self) -> str:
        """The backend part of a results dataset's partition (dataset.backend_label)."""
        return self.short().replace(":", "-")

    # -- options
    def option(self, key: str, default: str | None = None) -> str | None:
        """The last value given for ``key`` (as C takes the last), or ``default``."""
        for k, v in reversed(self.options):
            if k == key:
                return v
        return default

    def has_option(self, key: str) -> bool:
        return any(k == key for k, _ in self.options)

    def with_option(self, key: str, value) -> BackendSpec:
        """This spec with ``key=value`` in place of any earlier ``key``."""
        kept = tuple((k, v) for k, v in self.options if k != key)
        return replace(self, options=(*kept, (key, str(value))))

    def with_target(self, target: str | None) -> BackendSpec:
        return replace(self, target=target)

    # -- what the kind implies
    def instance(self, i: int, replicated: bool, attached: bool) -> BackendSpec:
        """The spec serving instance ``i`` opens: a file-backed tier's replicated instances each
        get a file of their own (``PATH.i``), an attached one maps the owner's existing file."""
        if not self.kind.file_per_instance:
            return self
        if attached:
            return self.with_option("size", "existing")
        if replicated and i > 0:
            return self.with_target(f"{self.target or ''}.{i}")
        return self

    def files_read(self) -> list[str]:
        """Files this spec names that a command reads (a profile file, the tier's own file), so
        that no output replaces them."""
        t = self.target
        out = []
        if t and (self.kind.target == "path" or (self.kind.target == "profile" and is_profile_path(t))):
            out.append(t)
        sw = self.option("software_from") if "software_from" in self.kind.options else None
        if sw and is_profile_path(sw):
            out.append(sw)  # the profile whose software parts it takes
        return out

    def files_written(self, instances: int = 256) -> list[str]:
        """Files a backend of this spec may write into: a file-backed tier's own file and, for
        replicated instances, each instance's ``PATH.i`` (:meth:`instance`); up to ``instances``."""
        if not self.target or self.kind.target != "path":
            return []
        return [self.target, *(f"{self.target}.{i}" for i in range(1, instances if self.kind.file_per_instance else 1))]

    def on_dax_device(self) -> bool:
        """Its target is a device-DAX node (how Linux exposes CXL or persistent memory as a device)."""
        return bool(self.target) and self.target.startswith("/dev/dax")

    def resources(self) -> dict:
        """Dask resources a sweep's cell on this backend takes (sweep.cell_resources)."""
        k = self.kind
        if k.dax_resource and self.on_dax_device():
            return {k.dax_resource: 1}
        if k.resource is None:
            return {}
        return {k.resource.format(target=self.target or "0"): 1}

    def folder(self) -> str:
        """The folder a file-backed tier's file lives in (its free space bounds the arena)."""
        return os.path.dirname(os.path.abspath(self.target or ".")) or "."

    def counterpart(self) -> BackendSpec | None:
        """The emulated backend standing in for this one where it cannot run here (counterpart_spec)."""
        return counterpart_spec(self)

    def priced_profile(self) -> str | None:
        """The tier profile whose medium prices this tier's capacity: an emulated tier's own profile
        (a profile file's ``name``), a device-DAX mapping as its DAX counterpart (a CXL or pmem
        device), else the kind's ``priced_as`` (a mapped file as the storage it lives on)."""
        kind = self.kind
        if kind.emulated:
            if not self.target:
                return None
            return resolve_profile(self.target).name
        if kind.dax_counterpart and self.on_dax_device():
            return kind.dax_counterpart
        return kind.priced_as

    def virtual_twin(self) -> BackendSpec | None:
        """The same tier in virtual time (docs/report.md, "Virtual twins"): an emulated spec's
        profile, with the options virtual time takes, under the virtual kind; a measured one's
        counterpart profile (:meth:`counterpart`, else its kind's ``twin_profile``); itself for a
        virtual spec; None where there is no profile for the tier."""
        kind = self.kind
        if kind.virtual:
            return self
        virtual = next(k for k in KINDS.values() if k.virtual)
        if kind.emulated:
            source = self
        else:
            other = self.counterpart()
            if other is not None:
                source = BackendSpec.parse(other)
            elif kind.twin_profile is not None:
                source = BackendSpec(virtual.name, kind.twin_profile)
            else:
                return None
        options = tuple((k, v) for k, v in source.options if k in virtual.options)
        return BackendSpec(virtual.name, source.target, options)


def parse_spec(spec: BackendSpec | str) -> BackendSpec:
    """BackendSpec.parse, as a function."""
    return BackendSpec.parse(spec)


# ------------------------------------------------------------------------------- emulated tiers
_OVERRIDES = {"latency_ns": float, "bandwidth_gbps": float, "overhead_ns": float, "concurrency": int}


def emulated_backend_args(spec) -> tuple[Profile, str]:
    """An ``emu``/``vemu`` spec (a BackendSpec or its text) -> (profile, option string for C).

    Its target is the profile, a built-in name or a .toml path; its options override the
    profile's numbers (``latency_ns``, ``bandwidth_gbps``, ``concurrency``, ``overhead_ns``) or are
    the backend's own (``hugepages=0|1`` for emu: KINDS says which it takes).
    """
    spec = BackendSpec.parse(spec)
    backend, ref = spec.name, spec.target
    if not ref:
        raise ConfigError(f"{backend} needs a tier profile first: {backend}:NAME or {backend}:PATH.toml "
                          f"(built-in: {', '.join(BUILTIN_PROFILES)})")
    profile = resolve_profile(ref)
    own = [k for k in spec.kind.options if k not in _OVERRIDES and k != "software_from"]
    extra = []
    changes: dict = {}
    for key, value in spec.options:
        if not key and value is None:
            continue  # an empty item between commas
        if value is None:
            raise ConfigError(f"{backend}: option '{key}' is not key=value")
        if key == "software_from":
            if not value:
                raise ConfigError(f"{backend}: option software_from needs a profile name or .toml path")
            changes["software_from"] = value
        elif key in _OVERRIDES:
            try:
                changes[key] = _OVERRIDES[key](value)
            except ValueError:
                raise ConfigError(f"{backend}: option {key} must be a number, got {value!r}") from None
        elif key in own:
            if value not in ("0", "1"):
                raise ConfigError(f"{backend}: option {key} must be 0 or 1, got {value!r}")
            extra.append(f"{key}={value}")
        else:
            known = ", ".join([*_OVERRIDES, "software_from", *own])
            raise ConfigError(f"{backend}: unknown option '{key}' (known: {known})")
    if changes:
        data = {**profile.to_dict(), **changes}
        if "software_from" in changes:
            del data["software"]  # the parts of the profile named, on this profile's wire and medium
        profile = profile_from_mapping(data, spec.text())
    return profile, ",".join([profile.c_args(), *extra])


def counterpart_spec(spec) -> str | None:
    """The emulated backend standing in for a real one that cannot run here, or None: its kind's
    counterpart profile (KINDS: numa -> emu:remote-numa, mmap of a DAX device ->
    emu:cxl-pool and of a file emu:nvme, uring -> emu:nvme), with a queue depth as the
    concurrency where the backend has one."""
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


__all__ = ["BackendKind", "BackendSpec", "KINDS", "MEDIA", "MODES", "counterpart_spec", "emulated_backend_args", "kind_of",
           "known_kind", "parse_spec", "spec_forms"]
