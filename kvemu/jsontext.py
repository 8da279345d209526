"""JSON as kvemu writes it: strict JSON, never ``Infinity`` or ``NaN`` (which jq, browsers and
``JSON.parse`` refuse). A non-finite number reaching a writer is refused in one line naming where
it is, rather than written (issue 44). A leaf module: it imports only kvemu.errors."""

from __future__ import annotations

import json
import math

from .errors import OutputError


def _first_non_finite(obj, path: str = "") -> tuple[str, float] | None:
    stack = [(obj, path)]
    while stack:  # iterative: nesting is bounded elsewhere, but a walk never recurses
        v, p = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return p or "the value", v
        if isinstance(v, dict):
            stack.extend((x, f"{p}.{k}" if p else str(k)) for k, x in reversed(list(v.items())))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{p}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def finite_or_null(value):
    """``value`` with every non-finite float (NaN: no figure) as None, JSON's ``null``: the rule of
    the documents kvemu prints (``report --json``, ``trace info --json``, ``analyze ... --json``)."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def document(obj, **kw) -> str:
    """A JSON document kvemu prints: :func:`finite_or_null`, then strict JSON."""
    return json.dumps(finite_or_null(obj), allow_nan=False, **kw)


def dumps(obj, what: str, **kw) -> str:
    """``json.dumps(obj, allow_nan=False, **kw)`` for what kvemu stores (a trace's or results'
    metadata): a non-finite float is an OutputError naming ``what`` (the output) and the key that
    holds it, never ``NaN`` or ``Infinity`` in the file."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        found = _first_non_finite(obj)
        if found is None:
            raise
        where, v = found
        raise OutputError(f"{what}: not written: {where} is {v!r}, not a finite number (JSON holds finite numbers "
                          f"only)") from None
