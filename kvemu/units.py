"""Parsing and printing sizes and ranges given on the command line."""

from __future__ import annotations

import math
import re

from .errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40,
          "p": 10**15, "pb": 10**15, "pib": 2**50, "e": 10**18, "eb": 10**18, "eib": 2**60}


def parse_size(text: str, what: str = "size") -> int:
    """'4GiB', '512MiB', '1.5GB', '1000000' -> bytes; units up to EiB (the largest size, MAX_SIZE, is 4 EiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what} '{text}' is not a size (examples: 4GiB, 512MiB, 2.5GB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 0:
        raise ConfigError(f"{what} must not be negative")
    if not value <= MAX_SIZE:
        raise ConfigError(f"{what} '{text[:40]}' is too large (at most {MAX_SIZE >> 60} EiB)")
    return int(value)


#: The largest size any option takes: 4 EiB (int64 byte offsets stay far from overflow).
MAX_SIZE = 4 << 60


def check_number(value, what: str, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``value`` as a float, or ConfigError when it is not a finite number in [lo, hi] (``lo_open``:
    (lo, hi]). Every numeric option goes through a check like this (docs/errors.md)."""
    reason = number_problem(value, lo, hi, lo_open=lo_open)
    if reason:
        raise ConfigError(f"{what} {reason}")
    return float(value)


def number_problem(value, lo: float, hi: float, *, lo_open: bool = False) -> str | None:
    """What is wrong with ``value`` as a finite number in [lo, hi] (``lo_open``: (lo, hi]), as the rest
    of a sentence that starts with the option's name; None when nothing is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if value < lo or value > hi or (lo_open and value == lo):
        return f"must be {'>' if lo_open else '>='} {exact(lo)} and <= {exact(hi)}, got {exact(value)}"
    return None


def exact(x) -> str:
    """A number as a message shows it, with the digits that tell it from a bound: ``1e+09``, ``0.001``,
    ``1048576`` (not ``1.04858e+06``), ``1.0000001`` (never ``1``), ``1e-320``: the shorter of ``:g``
    and Python's shortest round-trip text among those that read back as the same number; a whole
    number that ``:g`` would round, in full."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return repr(x)
    g = f"{x:g}"
    if isinstance(x, int):
        return g if abs(x) < 10**6 or (float(g) == x and int(float(g)) == x) else str(x)
    if not math.isfinite(x):
        return g
    texts = [t for t in (g, repr(x)) if float(t) == x]
    if x.is_integer() and abs(x) < 1e16:
        texts.append(str(int(x)))
    return min(texts, key=len)


def parse_range(text: str, what: str) -> tuple[float, float]:
    """'A:B' -> (A, B) with A < B; either side may be empty (0 / infinity)."""
    parts = str(text).split(":")
    if len(parts) != 2:
        raise ConfigError(f"{what} '{text}' must look like START:END")
    try:
        lo = float(parts[0]) if parts[0].strip() else 0.0
        hi = float(parts[1]) if parts[1].strip() else float("inf")
    except ValueError:
        raise ConfigError(f"{what} '{text}' must look like START:END with numbers") from None
    if not lo < hi or lo < 0:
        raise ConfigError(f"{what} '{text}' must have 0 <= START < END")
    return lo, hi


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


#: The longest span of arrival times kvemu accepts (after any --time-scale): ten years. Times are
#: int64 nanoseconds inside the engine and the backends, which overflow after about 292 years; the
#: margin leaves room for the processing that follows the last arrival.
MAX_ARRIVAL_SPAN_MS = 10 * 365.25 * 86400e3


def span_text(ms: float) -> str:
    days = ms / 86400e3
    return f"{days / 365.25:.3g} years" if days >= 365.25 else f"{days:.3g} days"
