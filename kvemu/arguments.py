"""The Python API's arguments checked at the edge (docs/python.md): a wrong type or value is an
OptionError naming the argument, never an AttributeError or a TypeError from deep inside, and a
single path where a list of paths is taken is refused (a string is iterable: its characters would
be read as paths, and ``"/"`` walks the whole file system). A leaf module: kvemu.errors only."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import OptionError


def _shown(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def path_arg(name: str, value, *, optional: bool = False) -> str | os.PathLike | None:
    """``value`` as a file or folder path: a non-empty str or an os.PathLike."""
    if value is None and optional:
        return None
    if isinstance(value, os.PathLike):
        value_text = os.fspath(value)
        if isinstance(value_text, str) and value_text:
            return value
    elif isinstance(value, str) and value:
        return value
    raise OptionError(name, f"must be a path (a non-empty str or os.PathLike), got {_shown(value)}")


def paths_arg(name: str, value, *, empty_ok: bool = True) -> list:
    """``value`` as a list of paths: a list or tuple (any iterable but a str, bytes, path or mapping)
    of :func:`path_arg` values."""
    if isinstance(value, (str, bytes, os.PathLike)):
        raise OptionError(name, f"takes a list of paths, got the single {type(value).__name__} {_shown(value)}: "
                                f"write [{_shown(value)}]")
    if isinstance(value, Mapping) or not hasattr(value, "__iter__"):
        raise OptionError(name, f"must be a list of paths, got {type(value).__name__} {_shown(value)}")
    items = list(value)
    if not items and not empty_ok:
        raise OptionError(name, "must name at least one path")
    for i, p in enumerate(items):
        path_arg(f"{name}[{i}]", p)
    return items


def text_arg(name: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise OptionError(name, f"must be a non-empty str, got {_shown(value)}")
    return value


def instance_arg(name: str, value, cls, *, optional: bool = False):
    """``value`` an instance of ``cls`` (an options object, a Report)."""
    if value is None and optional:
        return None
    if not isinstance(value, cls):
        raise OptionError(name, f"must be a kvemu.{cls.__name__}, got {type(value).__name__} {_shown(value)}")
    return value


def callable_arg(name: str, value):
    if value is not None and not callable(value):
        raise OptionError(name, f"must be a function or None, got {type(value).__name__} {_shown(value)}")
    return value
