"""Reading inputs safely: a file kvemu reads whole or seeks in must be a regular file.

A FIFO, a character device (``/dev/zero``) or a socket never ends, or blocks until someone writes:
reading one would hang or exhaust memory. Every reader of a user's file (traces, results, workload
files, tier profiles, sweep specs) asks :func:`not_regular` first and refuses with its own error.
"""

from __future__ import annotations

import os
import stat


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
    import tomllib
    from pathlib import Path

    from .errors import ConfigError

    p = Path(path)
    why = not_regular(p)
    if why:
        raise ConfigError(f"{what} {p} {why}")
    try:
        raw = p.read_bytes()
        return raw, tomllib.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} {p} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{what} {p} cannot be read: {e}") from None
