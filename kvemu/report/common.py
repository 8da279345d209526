"""Small helpers shared by the modules of :mod:`kvemu.report`."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


# --------------------------------------------------------------------------------------------
# Small helpers


def lookup(meta: Mapping[str, Any], dotted: str) -> Any:
    """``meta["a"]["b"]`` for ``"a.b"``; None where any step is missing or not a mapping."""
    node: Any = meta
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def error_text(exc: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__
