"""Reading inputs safely: a file kvemu reads whole or seeks in must be a regular file.

A FIFO, a character device (``/dev/zero``) or a socket never ends, or blocks until someone writes:
reading one would hang or exhaust memory. Every reader of a user's file (traces, results, workload
files, tier profiles, sweep specs) asks :func:`not_regular` first and refuses with its own error.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path

from .errors import ConfigError


def not_regular(path) -> str | None:
    """Why ``path`` is not a file kvemu can read (one phrase), or None when it is a regular file
    or does not exist (the caller's own "no such file" message then applies)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file")
    return f"is {kind}, not a regular file (kvemu reads inputs whole; copy it to a file first)"


def read_toml(path, what: str) -> tuple[bytes, dict]:
    """A TOML file's bytes and contents; ConfigError, one line naming ``what`` (e.g. "prices file"),
    when it is not a regular file, does not exist or does not parse."""
    p = Path(path)
    why = not_regular(p)
    if why:
        raise ConfigError(f"{what} {p} {why}")
    try:
        raw = p.read_bytes()
        return raw, loads_bounded(tomllib.loads, raw.decode("utf-8"), f"{what} {p}", ConfigError)
    except FileNotFoundError:
        raise ConfigError(f"{what} {p} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{what} {p} cannot be read: {e}") from None


#: The deepest nesting of arrays and tables kvemu reads from a JSON or TOML file (trace and results
#: metadata, model configs, tier profiles, sweep specs, stacks, prices). Its own files nest 4 deep;
#: a deeper document would exhaust Python's stack in the parser or in what walks it afterwards.
MAX_NESTING = 64


def nesting_depth(doc) -> int:
    """How deep lists and dicts nest in ``doc`` (a scalar: 0), without recursion."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        node, depth = todo.pop()
        items = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if items is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_NESTING:
            break
        todo.extend((v, depth + 1) for v in items)
    return deepest


def loads_bounded(loads, text, what: str, error):
    """``loads(text)`` (json.loads, tomllib.loads), refused as ``error(one line)`` when the document
    nests more than MAX_NESTING deep: what the parser's own RecursionError would be. Its other
    errors (JSONDecodeError, TOMLDecodeError) pass through to the caller's message."""
    too_deep = error(f"{what} nests arrays or tables more than {MAX_NESTING} levels deep")
    try:
        doc = loads(text)
    except RecursionError:
        raise too_deep from None
    if nesting_depth(doc) > MAX_NESTING:
        raise too_deep
    return doc
