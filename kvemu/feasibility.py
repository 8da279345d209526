"""Can a configuration be built? A level's capacity against its medium's physical limits in the price
table (kvemu/data/prices.toml: ``[medium.NAME.device]``, ``[[medium.NAME.switch]]``,
``[medium.NAME.compression]``; docs/analysis.md, "Feasibility limits").

A leaf: it reads a :class:`kvemu.prices.MediumPrice` and nothing else of kvemu. The rule, for a level of
``capacity_bytes`` per instance (``shared``: one pool of that size for all instances):

- physical bytes = capacity / the medium's compression ratio when ``compression`` is asked for and the
  medium declares one, else the capacity;
- devices = ceil(physical bytes / device capacity), per instance, or once for a shared pool;
- hosts = ceil(instances x GPUs per instance / GPUs per host); the instances on one host share its
  slots or lanes;
- a network-attached unit (no ``per_host``: memory or storage servers) is always buildable: the
  figure is how many servers;
- otherwise, the devices one host needs (a shared pool reached by one host: all of them) within
  ``per_host``: attached directly;
- else a published switch of the medium: the smallest (by capacity) that joins the hosts that
  share the pool and holds the bytes a host reaches (a shared pool: all of them), and as many of
  them as the hosts and the bytes take (ceil(hosts / switch hosts), ceil(total / switch capacity));
- else not buildable, and the reason says by how much.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .errors import ConfigError
from .units import human_bytes

#: GPUs in one host when none is given: an 8-GPU HGX/DGX H100 board (NVIDIA DGX H100: 8 x H100 SXM5,
#: https://www.nvidia.com/en-us/data-center/dgx-h100/).
DEFAULT_GPUS_PER_HOST = 8


@dataclass(frozen=True)
class Feasibility:
    """Whether a level can be built, and what it takes: ``devices`` in all (None where the medium
    gives no limits), the ``switch`` it needs (its name; None: attached directly or network-
    attached) and how many (``switches``), and the reason in one line."""

    ok: bool
    devices: int | None
    switch: str | None
    reason: str
    switches: int = 0
    checked: bool = True
    medium: str | None = None
    physical_bytes: int = 0
    hosts: int = 1
    devices_per_host: int | None = None
    bandwidth_gbps: float | None = None
    compression: float | None = None

    def describe(self) -> dict:
        return asdict(self)

    @property
    def short(self) -> str:
        """A few words for a table cell: '16x dev + Structera S 30260', 'NOT BUILDABLE'."""
        if not self.checked:
            return "unchecked"
        if not self.ok:
            return "NOT BUILDABLE"
        if not self.devices:
            return "-"
        sw = f" + {self.switches}x {self.switch}" if self.switch else ""
        return f"{self.devices} dev{sw}"


def _int(v, name, lo):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"feasibility: {name} must be a whole number of at least {lo}, got {v!r}")
    return v


def _gb(b) -> str:
    return human_bytes(int(b))


def check_feasible(medium, capacity_bytes: int, instances: int = 1, gpus_per_instance: int = 1,
                   shared: bool = False, *, compression: bool = False,
                   gpus_per_host: int = DEFAULT_GPUS_PER_HOST) -> Feasibility:
    """Whether ``capacity_bytes`` of ``medium`` (a :class:`kvemu.prices.MediumPrice`) per instance
    (``shared``: one pool for all ``instances``) can be built, and with how many devices and which
    switch (module docstring). ConfigError, one line, on a bad argument."""
    _int(capacity_bytes, "capacity_bytes", 0)
    _int(instances, "instances", 1)
    _int(gpus_per_instance, "gpus_per_instance", 1)
    _int(gpus_per_host, "gpus_per_host", 1)
    name = getattr(medium, "name", None)
    dev = getattr(medium, "device", None)
    comp = getattr(medium, "compression", None)
    ratio = comp.ratio if compression and comp is not None else 1.0
    phys = math.ceil(capacity_bytes / ratio)
    hosts = math.ceil(instances * gpus_per_instance / gpus_per_host)
    base = dict(medium=name, physical_bytes=phys, hosts=hosts, compression=ratio if ratio != 1.0 else None)
    if capacity_bytes == 0:
        return Feasibility(True, 0, None, "no capacity: nothing to build", **base)
    if dev is None:
        return Feasibility(True, None, None, f"medium {name} gives no device limits in the price table: not checked",
                           checked=False, **base)
    each = math.ceil(phys / dev.capacity_bytes)  # devices per instance, or for the one shared pool
    total = each if shared else each * instances
    what = f"{_gb(phys)}" + (f" ({_gb(capacity_bytes)} at {ratio:g}x compression)" if ratio != 1.0 else "")
    scope = f"one pool for {instances} instance(s) on {hosts} host(s)" if shared else "per instance"
    need = f"{what} of {name} {scope}: {each} x {dev.name}"
    if dev.per_host is None:  # network-attached servers
        return Feasibility(True, total, None, f"{need}, {total} in all (network-attached: no per-host limit)",
                           devices_per_host=None, bandwidth_gbps=total * dev.bandwidth_gbps, **base)
    per_instance_hosts = max(1, gpus_per_host // gpus_per_instance)
    on_host = each if shared else each * min(instances, per_instance_hosts)
    if (not shared or hosts == 1) and on_host <= dev.per_host:
        return Feasibility(True, total, None, f"{need}, {on_host} per host of the {dev.per_host} a host attaches",
                           devices_per_host=on_host, bandwidth_gbps=total * dev.bandwidth_gbps, **base)
    why = (f"more than the {dev.per_host} a host attaches" if on_host > dev.per_host
           else f"shared by {hosts} hosts")
    where = f"{on_host} in the pool" if shared else f"{on_host} per host"
    reach = phys if shared else phys * min(instances, per_instance_hosts)  # the bytes one host reaches
    sharing = hosts if shared else 1
    for sw in medium.switches:
        if sw.hosts >= sharing and sw.capacity_bytes >= reach:
            n = max(math.ceil(hosts / sw.hosts), math.ceil(total * dev.capacity_bytes / sw.capacity_bytes), 1)
            if shared:
                n = 1
            return Feasibility(True, total, sw.name,
                               f"{need}, {where}, {why}: needs a switch ({n} x {sw.name}: "
                               f"{sw.hosts} hosts, {sw.capacity_bytes / 1e12:g} TB, {sw.bandwidth_gbps:g} GB/s)",
                               switches=n, devices_per_host=on_host,
                               bandwidth_gbps=min(total * dev.bandwidth_gbps, n * sw.bandwidth_gbps), **base)
    if medium.switches:
        best = medium.switches[-1]
        reason = (f"{need}, {where}, {why}; no published switch holds it (largest: {best.name}, "
                  f"{best.hosts} hosts, {best.capacity_bytes / 1e12:g} TB)")
    elif shared and hosts > 1:
        reason = f"{need}: {name} is not shared between hosts (no switch for it in the price table)"
    else:
        reason = f"{need}, {where}, more than the {dev.per_host} a host attaches (no switch for it)"
    return Feasibility(False, total, None, "not buildable: " + reason, devices_per_host=on_host, **base)


def stack_feasibility(prices, levels, *, instances: int = 1, gpus_per_instance: int = 1, shared: bool = False,
                      compression: bool = False, gpus_per_host: int = DEFAULT_GPUS_PER_HOST) -> list[dict]:
    """Per level of a stack (objects with ``name``, ``profile`` (its ``.name`` or a str) and
    ``capacity_bytes``): its :func:`check_feasible` under the medium that prices its profile."""
    out = []
    for lv in levels:
        profile = getattr(lv.profile, "name", lv.profile)
        m = prices.medium_of(profile)
        if m is None:
            f = Feasibility(True, None, None, f"no medium in the price table prices profile {profile}: not checked",
                            checked=False)
        else:
            f = check_feasible(m, int(lv.capacity_bytes), instances, gpus_per_instance, shared,
                               compression=compression, gpus_per_host=gpus_per_host)
        out.append({"level": lv.name, "capacity_bytes": int(lv.capacity_bytes), **f.describe(), "short": f.short})
    return out
