"""Prices and power: the table (kvemu/data/prices.toml, or a file given with ``--prices``) and the cost
and energy of a run from it.

Every figure of the table is an input, with its source and date, and is recorded in the results that
use it (``cost`` sections: the file, its digest, the figures used); nothing here folds a price into a
constant. Money in USD, capacity in GB of 10^9 bytes (as media are priced), power in W.
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

_GPU_FIELDS = {"usd_per_hour": (0.0, 1e4), "watts": (0.0, 1e5)}
_MEDIUM_FIELDS = {"usd_per_gb": (0.0, 1e5), "watts_per_gb": (0.0, 1e3)}


@dataclass(frozen=True)
class GpuPrice:
    name: str
    usd_per_hour: float
    watts: float
    source: str
    date: str


@dataclass(frozen=True)
class MediumPrice:
    name: str
    usd_per_gb: float
    watts_per_gb: float
    profiles: tuple[str, ...]
    source: str
    date: str


@dataclass(frozen=True)
class Prices:
    path: str
    digest: str  # sha256 of the file's bytes
    title: str
    date: str
    gpus: dict
    media: dict

    def medium_of(self, profile: str) -> MediumPrice | None:
        """The medium a tier profile is priced as (its ``profiles`` list names it), or None."""
        for m in self.media.values():
            if profile in m.profiles or profile == m.name:
                return m
        return None

    def describe(self) -> dict:
        return {"path": self.path, "sha256": self.digest, "title": self.title, "date": self.date}

    @property
    def label(self) -> str:
        """How figures priced with this table were obtained, as results and reports label them."""
        return f"modelled (price table {self.date or 'undated'})"


def _entry(where: str, name: str, table, fields: dict) -> dict:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [{name}] must be a table")
    out = {}
    for f, (lo, hi) in fields.items():
        v = table.get(f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise ConfigError(f"{where}: [{name}] {f} must be a number from {lo:g} to {hi:g}, got {v!r}")
        out[f] = float(v)
    for f in ("source", "date"):
        if not isinstance(table.get(f), str) or not table[f].strip():
            raise ConfigError(f"{where}: [{name}] needs a {f} (every figure names its source and date)")
        out[f] = table[f]
    unknown = set(table) - set(fields) - {"source", "date", "profiles"}
    if unknown:
        raise ConfigError(f"{where}: [{name}] has unknown keys {', '.join(sorted(unknown))}")
    return out


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
    gpus, media = {}, {}
    for name, t in (data.get("gpu") or {}).items():
        gpus[name] = GpuPrice(name=name, **_entry(where, f"gpu.{name}", t, _GPU_FIELDS))
    for name, t in (data.get("medium") or {}).items():
        e = _entry(where, f"medium.{name}", t, _MEDIUM_FIELDS)
        profiles = t.get("profiles", [])
        if not isinstance(profiles, list) or not all(isinstance(x, str) for x in profiles):
            raise ConfigError(f"{where}: [medium.{name}] profiles must be a list of tier profile names")
        media[name] = MediumPrice(name=name, profiles=tuple(profiles), **e)
    return Prices(path=str(p), digest=hashlib.sha256(raw).hexdigest(), title=str(data.get("title", "")),
                  date=str(data.get("date", "")), gpus=gpus, media=media)


def check_amortise_years(years) -> float:
    from .units import check_number

    return check_number(years, "--amortise-years", 0.0, 100.0, lo_open=True)


def run_cost(prices: Prices, *, gpu: str, gpus: int, instances: int, duration_s: float, output_tokens: int,
             requests: int, capacities: list[tuple[str, str, int]] = (),
             amortise_years: float = DEFAULT_AMORTISE_YEARS) -> dict:
    """Cost and energy of a run: ``instances`` x ``gpus`` GPUs of ``gpu`` for ``duration_s``, and
    each level of ``capacities`` ((level name, tier profile, bytes)) held for the same time.

    GPU-hours = instances x gpus x duration; GPU cost = GPU-hours x $/GPU-hour; a level's cost =
    GB x $/GB x duration / amortisation period; energy = (GPUs x W + sum GB x W/GB) x duration.
    A GPU or profile the table does not price leaves the figures that need it None, with a note."""
    check_amortise_years(amortise_years)
    notes = []
    gpu_hours = instances * gpus * duration_s / 3600.0
    gp = prices.gpus.get(gpu)
    if gp is None:
        notes.append(f"no price for GPU {gpu} in {prices.path} (priced: {', '.join(prices.gpus) or 'none'})")
    gpu_usd = gpu_hours * gp.usd_per_hour if gp else None
    gpu_joules = instances * gpus * gp.watts * duration_s if gp else None
    levels, cap_usd, cap_joules = [], 0.0, 0.0
    for name, profile, nbytes in capacities:
        m = prices.medium_of(profile)
        gb = nbytes / 1e9
        if m is None:
            notes.append(f"no medium in {prices.path} prices profile {profile} (level {name})")
            levels.append({"level": name, "profile": profile, "gb": gb, "medium": None, "usd": None, "joules": None})
            cap_usd = cap_joules = None
            continue
        usd = gb * m.usd_per_gb * duration_s / (amortise_years * SECONDS_PER_YEAR)
        joules = gb * m.watts_per_gb * duration_s
        levels.append({"level": name, "profile": profile, "gb": gb, "medium": m.name, "usd_per_gb": m.usd_per_gb,
                       "watts_per_gb": m.watts_per_gb, "usd": usd, "joules": joules})
        if cap_usd is not None:
            cap_usd += usd
            cap_joules += joules
    total = gpu_usd + cap_usd if gpu_usd is not None and cap_usd is not None else None
    joules = gpu_joules + cap_joules if gpu_joules is not None and cap_joules is not None else None
    per = lambda x, n: x / n if x is not None and n else None  # noqa: E731
    return {
        "inputs": {"gpu": gpu, "gpus": gpus, "instances": instances, "duration_s": duration_s,
                   "output_tokens": output_tokens, "requests": requests, "amortise_years": amortise_years,
                   "gpu_usd_per_hour": gp.usd_per_hour if gp else None, "gpu_watts": gp.watts if gp else None},
        "gpu_hours": gpu_hours,
        "gpu_usd": gpu_usd,
        "levels": levels,
        "capacity_usd": cap_usd,
        "total_usd": total,
        "usd_per_million_output_tokens": per(total * 1e6 if total is not None else None, output_tokens),
        "usd_per_request": per(total, requests),
        "energy_joules": joules,
        "wh_per_request": per(joules / 3600.0 if joules is not None else None, requests),
        "joules_per_request": per(joules, requests),
        "notes": notes,
    }
