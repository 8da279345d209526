"""Prices and power: the table (kvemu/data/prices.toml, or a file given with ``--prices``) and the cost
and energy of a run from it.

Every figure of the table is an input, with its source and date, and is recorded in the results that
use it (``cost`` sections: the file, its digest, the figures used); nothing here folds a price into a
constant. Money in USD, capacity in GB of 10^9 bytes (as media are priced), power in W.

:func:`run_cost` is the one pricing rule of every command (``analyze capacity``'s points, a replay's
results, and so the report and the demo, which read those): the GPU time, each level's provisioned
capacity amortised over the run, and a flash level's wear (the bytes the run wrote into it against the
drive's rated endurance). A medium is priced from its own figures or as the sum of its parts (remote
DRAM: the DRAM, its servers' and its NICs' share per GB), each part with its source.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

#: The table kvemu ships.
DEFAULT_PRICES = Path(__file__).with_name("data") / "prices.toml"

#: Amortisation period of capacity when none is given, in years (a server's usual depreciation).
DEFAULT_AMORTISE_YEARS = 3.0

SECONDS_PER_YEAR = 365.25 * 86400

#: Bounds of the amortisation period, in years: from about four days (0.01 year; a shorter period prices
#: capacity as if bought for one run, and 1e-300 would give a cost of 290 digits or an infinite one)
#: to a century.
AMORTISE_YEARS_BOUNDS = (0.01, 100.0)

_GPU_FIELDS = {"usd_per_hour": (0.0, 1e4), "watts": (0.0, 1e5)}
_MEDIUM_FIELDS = {"usd_per_gb": (0.0, 1e5), "watts_per_gb": (0.0, 1e3)}
#: a flash medium's rated endurance: drive writes per day over its warranty (both or neither)
_ENDURANCE_FIELDS = {"dwpd": (0.0, 1e3), "warranty_years": (0.0, 100.0)}
DAYS_PER_YEAR = 365.25
#: a medium's physical unit ([medium.NAME.device]): one of capacity_gib (DRAM, sold in binary sizes) or
#: capacity_gb (flash), its bandwidth, and per_host (absent: network-attached, no per-host limit)
_DEVICE_FIELDS = {"bandwidth_gbps": (0.0, 1e6)}
_DEVICE_OPTIONAL = {"capacity_gib": (1e-3, 1e9), "capacity_gb": (1e-3, 1e9), "per_host": (1.0, 1e5)}
#: a published switch that pools a medium across hosts ([[medium.NAME.switch]])
_SWITCH_FIELDS = {"hosts": (1.0, 1e5), "capacity_gb": (1e-3, 1e9), "bandwidth_gbps": (0.0, 1e6)}
#: inline compression ([medium.NAME.compression]): a capacity multiplier, used only when asked
_COMPRESSION_FIELDS = {"ratio": (1.0, 100.0)}


@dataclass(frozen=True)
class DeviceLimit:
    """A medium's physical unit: ``capacity_bytes`` and ``bandwidth_gbps`` per device, and how many
    one host attaches (``per_host``; None: network-attached, no per-host limit), with its source."""

    name: str
    capacity_bytes: int
    bandwidth_gbps: float
    per_host: int | None
    source: str
    date: str


@dataclass(frozen=True)
class SwitchLimit:
    """A published switch that pools a medium across hosts: the hosts it joins, the capacity behind
    it and its aggregate bandwidth, with its source."""

    name: str
    hosts: int
    capacity_bytes: int
    bandwidth_gbps: float
    source: str
    date: str


@dataclass(frozen=True)
class Compression:
    """Inline compression a medium may declare: a capacity multiplier (logical bytes per physical
    byte), with its source; off unless asked for (``--compression``)."""

    ratio: float
    source: str
    date: str


@dataclass(frozen=True)
class GpuPrice:
    name: str
    usd_per_hour: float
    watts: float
    source: str
    date: str


@dataclass(frozen=True)
class MediumPart:
    """One part of a composed medium's price per GB (its DRAM, its servers' share, its NICs' share)."""

    name: str
    usd_per_gb: float
    watts_per_gb: float
    source: str
    date: str
    #: a part ``of`` a rated (flash) medium: that medium's wear per GB written; None: it does not wear
    usd_per_gb_written: float | None = None


@dataclass(frozen=True)
class MediumPrice:
    """A medium: $/GB and W/GB of capacity (the sum of ``parts`` when it has parts), and for flash the
    drive's rated endurance (``dwpd`` drive writes per day over ``warranty_years``; None: not rated,
    its wear not priced)."""

    name: str
    usd_per_gb: float
    watts_per_gb: float
    profiles: tuple[str, ...]
    source: str
    date: str
    parts: tuple[MediumPart, ...] = ()
    dwpd: float | None = None
    warranty_years: float | None = None
    #: physical limits (kvemu/feasibility.py): None / () where the table gives none
    device: DeviceLimit | None = None
    switches: tuple[SwitchLimit, ...] = ()
    compression: Compression | None = None

    @property
    def usd_per_gb_written(self) -> float | None:
        """Wear per GB written: the drive's price per GB over the GB its rating lets each GB of it be
        written (dwpd x 365.25 days x warranty years); a composed medium, its flash parts' (the
        drives wear, not the servers); None for a medium without a rating."""
        if self.parts:
            worn = [p.usd_per_gb_written for p in self.parts if p.usd_per_gb_written is not None]
            return sum(worn) if worn else None
        if not self.dwpd or not self.warranty_years:
            return None
        return self.usd_per_gb / (self.dwpd * DAYS_PER_YEAR * self.warranty_years)

    def describe(self) -> dict:
        return {"usd_per_gb": self.usd_per_gb, "watts_per_gb": self.watts_per_gb,
                "parts": [{"name": p.name, "usd_per_gb": p.usd_per_gb, "watts_per_gb": p.watts_per_gb,
                           "usd_per_gb_written": p.usd_per_gb_written, "source": p.source, "date": p.date}
                          for p in self.parts] or None,
                "dwpd": self.dwpd, "warranty_years": self.warranty_years,
                "usd_per_gb_written": self.usd_per_gb_written}

    def describe_limits(self) -> dict:
        """The medium's physical limits as results record them (kvemu/feasibility.py)."""
        from dataclasses import asdict

        return {"device": asdict(self.device) if self.device else None,
                "switches": [asdict(w) for w in self.switches],
                "compression": asdict(self.compression) if self.compression else None}


@dataclass(frozen=True)
class Prices:
    path: str
    digest: str  # sha256 of the file's bytes
    title: str
    date: str
    gpus: dict
    media: dict
    #: media priced per logical GB under their declared inline compression (:meth:`with_compression`)
    compressed: tuple[str, ...] = ()

    def with_compression(self) -> "Prices":
        """This table with every medium that declares inline compression priced per logical GB: its
        $/GB and W/GB (its parts' too, and so its wear per GB written) divided by the ratio, the
        capacity a level is given being the KV bytes it holds. The media that declare none are
        unchanged."""
        from dataclasses import replace

        media, done = {}, []
        for name, m in self.media.items():
            if m.compression is None:
                media[name] = m
                continue
            r = m.compression.ratio
            parts = tuple(replace(p, usd_per_gb=p.usd_per_gb / r, watts_per_gb=p.watts_per_gb / r,
                                  usd_per_gb_written=None if p.usd_per_gb_written is None
                                  else p.usd_per_gb_written / r) for p in m.parts)
            media[name] = replace(m, usd_per_gb=m.usd_per_gb / r, watts_per_gb=m.watts_per_gb / r, parts=parts)
            done.append(name)
        return replace(self, media=media, compressed=tuple(done))

    def medium_of(self, profile: str) -> MediumPrice | None:
        """The medium a tier profile is priced as (its ``profiles`` list names it), or None."""
        for m in self.media.values():
            if profile in m.profiles or profile == m.name:
                return m
        return None

    def describe(self) -> dict:
        out = {"path": self.path, "sha256": self.digest, "title": self.title, "date": self.date}
        if self.compressed:  # priced per logical GB (with_compression): the ratios taken
            out["compressed_media"] = {n: self.media[n].compression.ratio for n in self.compressed}
        return out

    @property
    def label(self) -> str:
        """How figures priced with this table were obtained, as results and reports label them."""
        return f"modelled (price table {self.date or 'undated'})"


def _entry(where: str, name: str, table, fields: dict, optional: dict | None = None, extra=()) -> dict:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [{name}] must be a table")
    out = {}
    for f, (lo, hi) in {**fields, **(optional or {})}.items():
        v = table.get(f)
        if v is None and f not in fields:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise ConfigError(f"{where}: [{name}] {f} must be a number from {lo:g} to {hi:g}, got {v!r}")
        out[f] = float(v)
    for f in ("source", "date"):
        if not isinstance(table.get(f), str) or not table[f].strip():
            raise ConfigError(f"{where}: [{name}] needs a {f} (every figure names its source and date)")
        out[f] = table[f]
    unknown = set(table) - set(fields) - set(optional or {}) - {"source", "date", *extra}
    if unknown:
        raise ConfigError(f"{where}: [{name}] has unknown keys {', '.join(sorted(unknown))}")
    return out


#: a medium's limit tables (kvemu/feasibility.py)
_LIMITS = ("device", "switch", "compression")


def _media(where: str, tables) -> dict:
    """The ``[medium.NAME]`` tables, checked: a medium gives its ``usd_per_gb`` and ``watts_per_gb``,
    or ``part`` tables whose figures add up to them (each a ``[[medium.NAME.part]]`` with its name,
    its own figures, source and date, or ``of = "MEDIUM"``: that simple medium's figures, its wear
    included); a simple flash medium may give its rated endurance, ``dwpd`` and ``warranty_years``
    together. Any medium may give its physical limits, each with its source and date (kvemu/feasibility.py):
    ``[medium.NAME.device]`` (name; capacity_gib or capacity_gb; bandwidth_gbps; per_host, absent for a
    network-attached unit), ``[[medium.NAME.switch]]`` (name, hosts, capacity_gb, bandwidth_gbps) and
    ``[medium.NAME.compression]`` (ratio)."""
    if not isinstance(tables, dict):
        raise ConfigError(f"{where}: [medium] must be a table of media")
    simple, composed = {}, {}
    def limits(name, t):
        """[medium.NAME.device], [[medium.NAME.switch]], [medium.NAME.compression], checked."""
        out = {}
        if "device" in t:
            label = f"medium.{name}.device"
            d = t["device"]
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not d["name"].strip():
                raise ConfigError(f"{where}: [{label}] must be a table with a name")
            e = _entry(where, label, {k: v for k, v in d.items() if k != "name"}, _DEVICE_FIELDS, _DEVICE_OPTIONAL)
            if ("capacity_gib" in e) == ("capacity_gb" in e):
                raise ConfigError(f"{where}: [{label}] gives one of capacity_gib (DRAM, binary sizes) or "
                                  f"capacity_gb (flash)")
            if "per_host" in e and e["per_host"] != int(e["per_host"]):
                raise ConfigError(f"{where}: [{label}] per_host must be a whole number, got {e['per_host']:g}")
            cap = e.pop("capacity_gib") * 2**30 if "capacity_gib" in e else e.pop("capacity_gb") * 1e9
            per_host = e.pop("per_host", None)
            out["device"] = DeviceLimit(name=d["name"], capacity_bytes=int(cap),
                                        per_host=None if per_host is None else int(per_host), **e)
        if "switch" in t:
            rows = t["switch"]
            if not isinstance(rows, list) or not rows:
                raise ConfigError(f"{where}: [medium.{name}] switch must be a list of [[medium.{name}.switch]] "
                                  f"tables")
            sw = []
            for i, row in enumerate(rows):
                label = f"medium.{name}.switch {i + 1}"
                if not isinstance(row, dict) or not isinstance(row.get("name"), str) or not row["name"].strip():
                    raise ConfigError(f"{where}: [{label}] needs a name")
                e = _entry(where, label, {k: v for k, v in row.items() if k != "name"}, _SWITCH_FIELDS)
                if e["hosts"] != int(e["hosts"]):
                    raise ConfigError(f"{where}: [{label}] hosts must be a whole number, got {e['hosts']:g}")
                sw.append(SwitchLimit(name=row["name"], hosts=int(e.pop("hosts")),
                                      capacity_bytes=int(e.pop("capacity_gb") * 1e9), **e))
            if "device" not in out:
                raise ConfigError(f"{where}: [medium.{name}] a switch pools devices: give [medium.{name}.device]")
            out["switches"] = tuple(sorted(sw, key=lambda w: (w.capacity_bytes, w.hosts)))
        if "compression" in t:
            e = _entry(where, f"medium.{name}.compression", t["compression"], _COMPRESSION_FIELDS)
            out["compression"] = Compression(**e)
        return out

    for name, t in tables.items():
        if isinstance(t, dict) and "part" in t:
            composed[name] = t
        else:
            simple[name] = t
    media = {}

    def profiles_of(name, t):
        profiles = t.get("profiles", [])
        if not isinstance(profiles, list) or not all(isinstance(x, str) for x in profiles):
            raise ConfigError(f"{where}: [medium.{name}] profiles must be a list of tier profile names")
        return tuple(profiles)

    def endurance(name, e):
        if ("dwpd" in e) != ("warranty_years" in e):
            raise ConfigError(f"{where}: [medium.{name}] gives dwpd and warranty_years together (a drive's rated "
                              f"endurance), or neither")
        return {"dwpd": e.pop("dwpd", None), "warranty_years": e.pop("warranty_years", None)}

    for name, t in simple.items():
        e = _entry(where, f"medium.{name}", t, _MEDIUM_FIELDS, _ENDURANCE_FIELDS, extra=("profiles", *_LIMITS))
        media[name] = MediumPrice(name=name, profiles=profiles_of(name, t), **endurance(name, e), **e,
                                  **limits(name, t))
    for name, t in composed.items():
        e = _entry(where, f"medium.{name}", t, {}, extra=("profiles", "part", *_LIMITS))  # rating: its parts'
        rows = t["part"]
        if not isinstance(rows, list) or not rows:
            raise ConfigError(f"{where}: [medium.{name}] part must be a list of [[medium.{name}.part]] tables")
        parts = []
        for i, row in enumerate(rows):
            label = f"medium.{name}.part {i + 1}"
            if not isinstance(row, dict) or not isinstance(row.get("name"), str) or not row["name"].strip():
                raise ConfigError(f"{where}: [{label}] needs a name")
            if "of" in row:
                ref = media.get(row["of"]) if isinstance(row["of"], str) else None
                if ref is None or set(row) - {"name", "of"}:
                    raise ConfigError(f"{where}: [{label}] of must name a medium of the table with figures of "
                                      f"its own ({', '.join(media) or 'none'}), and nothing else beside name")
                parts.append(MediumPart(row["name"], ref.usd_per_gb, ref.watts_per_gb,
                                        f"medium.{ref.name}: {ref.source}", ref.date, ref.usd_per_gb_written))
                continue
            pe = _entry(where, label, {k: v for k, v in row.items() if k != "name"}, _MEDIUM_FIELDS)
            parts.append(MediumPart(name=row["name"], **pe))
        media[name] = MediumPrice(name=name, usd_per_gb=sum(p.usd_per_gb for p in parts),
                                  watts_per_gb=sum(p.watts_per_gb for p in parts), profiles=profiles_of(name, t),
                                  parts=tuple(parts), **e, **limits(name, t))
    return media


def load_prices(path=None) -> Prices:
    """The price table at ``path`` (default: the one kvemu ships), checked; ConfigError, one line."""
    from .inputs import read_toml

    p = Path(path) if path is not None else DEFAULT_PRICES
    raw, data = read_toml(p, "prices file")
    where = str(p)
    unknown = set(data) - {"title", "date", "currency", "gpu", "medium"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))} (known: title, date, currency, "
                          f"gpu, medium)")
    if data.get("currency", "USD") != "USD":
        raise ConfigError(f"{where}: currency must be USD, got {data.get('currency')!r}")
    for key in ("gpu", "medium"):  # tables of tables: [gpu.NAME], [medium.NAME]
        if key in data and not isinstance(data[key], dict):
            raise ConfigError(f"{where}: {key} must be a table of [{key}.NAME] tables, got "
                              f"{type(data[key]).__name__} {str(data[key])[:40]!r}")
    for key in ("title", "date", "currency"):
        if key in data and not isinstance(data[key], str):
            raise ConfigError(f"{where}: {key} must be a string, got {type(data[key]).__name__}")
    gpus = {}
    for name, t in (data.get("gpu") or {}).items():
        gpus[name] = GpuPrice(name=name, **_entry(where, f"gpu.{name}", t, _GPU_FIELDS))
    media = _media(where, data.get("medium") or {})
    return Prices(path=str(p), digest=hashlib.sha256(raw).hexdigest(), title=str(data.get("title", "")),
                  date=str(data.get("date", "")), gpus=gpus, media=media)


def check_amortise_years(years) -> float:
    from .units import check_number

    return check_number(years, "--amortise-years", *AMORTISE_YEARS_BOUNDS)


@dataclass(frozen=True)
class Held:
    """One level's capacity as a run is priced: its name, the tier profile whose medium prices it,
    the bytes provisioned (all layers, every copy: what the user sized, not what the run happened
    to fill), where that figure came from, and the bytes the run wrote into it (all layers; None:
    not known, which leaves a rated medium's wear, and the total, unpriced)."""

    level: str
    profile: str
    capacity_bytes: int
    capacity_from: str = "given"
    written_bytes: int | None = None


#: How far the stack analysis's priced duration (and so its $ per million output tokens) was from a
#: closed-loop replay's (``replay`` / ``kvemu plan``, vemu levels, virtual time, --layers 2) on the demo's
#: workload and traces/chat-llama3-8b-offload, docqa-qwen2.5-72b-offload and
#: mooncake-first500-llama3-70b-offload, 2026-12-07: at most 0.4 % (docs/analysis.md, "One pricing
#: rule"); stated as 1 %. Where the modelled GPU busy time exceeds the span (the full Mooncake
#: conversation trace at time scale 5, +6 to +9 % over the replay's timeline, "Queueing") the busy time
#: floors the figure and the analysis is that much higher.
PRICED_DURATION_TOLERANCE = 0.01


def priced_duration_s(arrival_ns, completion_ns, busy_s: float = 0.0) -> float:
    """The duration a run is priced over (s), the one rule of every command: the span its instances
    are held, from the first request's arrival to the last one's completion (``arrival_ns`` and
    ``completion_ns``, per request, on one clock), idle GPU time inside it included, since GPUs and
    levels are provisioned for as long as the workload runs, not only while they compute; never
    below ``busy_s`` (an instance's GPU busy time: it cannot compute longer than it is held). A
    replay passes its timeline's arrivals and ends; the stack analysis its trace's arrivals and its
    modelled completions (queued TTFT plus the modelled decode) and its modelled busy time. No
    request: ``busy_s``."""
    import numpy as np

    a, c = np.asarray(arrival_ns), np.asarray(completion_ns)
    span = float(c.max() - a.min()) / 1e9 if a.size and c.size else 0.0  # integer ns stay exact
    return max(span, float(busy_s), 0.0)


def run_cost(prices: Prices, *, gpu: str, gpus: int, instances: int, duration_s: float, output_tokens: int,
             requests: int, capacities=(), amortise_years: float = DEFAULT_AMORTISE_YEARS) -> dict:
    """Cost and energy of a run: ``instances`` x ``gpus`` GPUs of ``gpu`` for ``duration_s``, and
    each level of ``capacities`` (:class:`Held`, or (level name, tier profile, bytes)) held for the
    same time. The one pricing rule of every command (module docstring).

    GPU-hours = instances x gpus x duration; GPU cost = GPU-hours x $/GPU-hour; a level's capacity
    cost = provisioned GB x $/GB x duration / amortisation period; its wear = GB written x $/GB /
    (DWPD x 365.25 x warranty years) for a medium with an endurance rating (flash), 0 otherwise;
    total = GPU + capacity + wear; energy = (GPUs x W + sum GB x W/GB) x duration. A GPU or profile
    the table does not price leaves the figures that need it None, with a note."""
    check_amortise_years(amortise_years)
    notes = []
    gpu_hours = instances * gpus * duration_s / 3600.0
    gp = prices.gpus.get(gpu)
    if gp is None:
        notes.append(f"no price for GPU {gpu} in {prices.path} (priced: {', '.join(prices.gpus) or 'none'})")
    gpu_usd = gpu_hours * gp.usd_per_hour if gp else None
    gpu_joules = instances * gpus * gp.watts * duration_s if gp else None
    per_m = lambda x: x * 1e6 / output_tokens if x is not None and output_tokens else None  # noqa: E731
    levels, cap_usd, wear_usd, cap_joules, cap_bytes = [], 0.0, 0.0, 0.0, 0
    for held in capacities:
        h = held if isinstance(held, Held) else Held(*held)
        m = prices.medium_of(h.profile)
        gb = h.capacity_bytes / 1e9
        cap_bytes += int(h.capacity_bytes)
        written_gb = None if h.written_bytes is None else h.written_bytes / 1e9
        row = {"level": h.level, "profile": h.profile, "capacity_bytes": int(h.capacity_bytes), "gb": gb,
               "capacity_from": h.capacity_from, "written_gb": written_gb}
        if m is None:
            notes.append(f"no medium in {prices.path} prices profile {h.profile} (level {h.level})")
            levels.append({**row, "medium": None, "usd": None, "joules": None, "wear_usd": None})
            cap_usd = cap_joules = None
            continue
        usd = gb * m.usd_per_gb * duration_s / (amortise_years * SECONDS_PER_YEAR)
        joules = gb * m.watts_per_gb * duration_s
        per_written = m.usd_per_gb_written
        if per_written is None:
            wear, wear_from = 0.0, "no endurance rating for this medium in the price table: no wear priced"
        elif written_gb is None:
            wear, wear_from = None, "the bytes the run wrote into it are not known"
            notes.append(f"level {h.level}: the bytes written into it are not known, so its wear is not priced")
        else:
            wear = written_gb * per_written
            wear_from = (f"{written_gb:.6g} GB written x ${per_written:.6g} per GB written (the drive's $/GB / "
                         f"(DWPD x 365.25 days x warranty years))")
        levels.append({**row, "medium": m.name, **m.describe(), "usd": usd, "joules": joules,
                       "usd_per_million_output_tokens": per_m(usd), "wear_usd": wear, "wear_from": wear_from,
                       "wear_usd_per_million_output_tokens": per_m(wear)})
        if cap_usd is not None:
            cap_usd += usd
            cap_joules += joules
        wear_usd = None if wear is None or wear_usd is None else wear_usd + wear
    parts = (gpu_usd, cap_usd, wear_usd)
    total = sum(parts) if all(x is not None for x in parts) else None
    joules = gpu_joules + cap_joules if gpu_joules is not None and cap_joules is not None else None
    per = lambda x, n: x / n if x is not None and n else None  # noqa: E731
    return {
        "inputs": {"gpu": gpu, "gpus": gpus, "instances": instances, "duration_s": duration_s,
                   "output_tokens": output_tokens, "requests": requests, "amortise_years": amortise_years,
                   "gpu_usd_per_hour": gp.usd_per_hour if gp else None, "gpu_watts": gp.watts if gp else None},
        "gpu_hours": gpu_hours,
        "gpu_usd": gpu_usd,
        "levels": levels,
        "capacity_bytes": cap_bytes,
        "capacity_usd": cap_usd,
        "wear_usd": wear_usd,
        "total_usd": total,
        "usd_per_million_output_tokens": per_m(total),
        "gpu_usd_per_million_output_tokens": per_m(gpu_usd),
        "capacity_usd_per_million_output_tokens": per_m(cap_usd),
        "wear_usd_per_million_output_tokens": per_m(wear_usd),
        "usd_per_request": per(total, requests),
        "energy_joules": joules,
        "wh_per_request": per(joules / 3600.0 if joules is not None else None, requests),
        "joules_per_request": per(joules, requests),
        "notes": notes,
    }


def cost_line(cost: dict) -> str:
    """A run's cost in one line, as every command prints it: $ per million output tokens, its GPU,
    capacity and wear parts, and the capacity priced (provisioned, where the figure came from)."""
    from .units import human_bytes

    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    held = "; ".join(f"{lv['level']} {human_bytes(lv['capacity_bytes'])} as {lv['medium'] or lv['profile']} "
                     f"({lv['capacity_from']})" for lv in cost.get("levels") or [])
    return (f"${fmt(cost.get('usd_per_million_output_tokens'))} per million output tokens = GPU "
            f"${fmt(cost.get('gpu_usd_per_million_output_tokens'))} + capacity "
            f"${fmt(cost.get('capacity_usd_per_million_output_tokens'))} + flash wear "
            f"${fmt(cost.get('wear_usd_per_million_output_tokens'))}; capacity priced: {held or 'none'}")
