"""Interruptions: SIGINT, SIGTERM and SIGHUP end a command cleanly.

SIGTERM and SIGHUP (a closed terminal, a dropped ssh session) are turned into exceptions like
SIGINT's KeyboardInterrupt, so that every ``with`` and ``finally`` on the way out runs: temporary
output files are removed, backends unmap their arenas and unlink the tier files they created. A C
call in progress is cancelled first (kvemu/backends.py). The command then exits 130 (SIGINT), 143
(SIGTERM) or 129 (SIGHUP), 128 plus the signal's number, with one line naming what was discarded.
"""

from __future__ import annotations

import signal

from .output import unfinished_outputs


class Terminated(BaseException):
    """SIGTERM, raised in the main thread (a BaseException, like KeyboardInterrupt)."""

    signal_name, exit_code = "SIGTERM", 128 + signal.SIGTERM


class Hangup(Terminated):
    """SIGHUP: its terminal went away. Handled as SIGTERM, reported as itself."""

    signal_name, exit_code = "SIGHUP", 128 + signal.SIGHUP


def _raise_terminated(signum, frame):
    raise Terminated()


def _raise_hangup(signum, frame):
    raise Hangup()


def install_handlers() -> None:
    signal.signal(signal.SIGTERM, _raise_terminated)
    # Started under nohup (SIGHUP ignored): it is asked to outlive its terminal, so leave it be.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _raise_hangup)


def interrupted_message(exc: BaseException) -> tuple[int, str]:
    """Exit code and the one line to print for an interruption."""
    name, code = (exc.signal_name, exc.exit_code) if isinstance(exc, Terminated) else ("SIGINT", 130)
    lost = unfinished_outputs()
    what = ", ".join(str(p) for p in lost) if lost else "nothing"
    return code, f"interrupted by {name}; discarded: {what} (no partial file left; tier released)"
