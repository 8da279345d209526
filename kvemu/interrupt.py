"""Interruptions: SIGINT and SIGTERM end a command cleanly.

SIGTERM is turned into an exception like SIGINT's KeyboardInterrupt, so that every ``with`` and
``finally`` on the way out runs: temporary output files are removed, backends unmap their arenas
and unlink the tier files they created. The command then exits 130 (SIGINT) or 143 (SIGTERM) with
one line naming what was discarded.
"""

from __future__ import annotations

import signal

from .output import unfinished_outputs


class Terminated(BaseException):
    """SIGTERM, raised in the main thread (a BaseException, like KeyboardInterrupt)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def install_handlers() -> None:
    signal.signal(signal.SIGTERM, _raise_terminated)


def interrupted_message(exc: BaseException) -> tuple[int, str]:
    """Exit code and the one line to print for an interruption."""
    name, code = ("SIGTERM", 143) if isinstance(exc, Terminated) else ("SIGINT", 130)
    lost = unfinished_outputs()
    what = ", ".join(str(p) for p in lost) if lost else "nothing"
    return code, f"interrupted by {name}; discarded: {what} (no partial file left; tier released)"
