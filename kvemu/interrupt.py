"""Interruptions: every catchable signal that would end the process ends a command cleanly.

SIGINT raises KeyboardInterrupt, as Python's own handler does; SIGTERM, SIGHUP (a closed terminal,
a dropped ssh session), SIGXCPU (a soft CPU-time limit, as batch systems send before SIGKILL),
SIGUSR1 and SIGUSR2 raise :class:`Terminated`. Either way every ``with`` and ``finally`` on the way
out runs: temporary output files are removed, backends unmap their arenas and unlink the tier
files they created. A C call in progress is cancelled first (kvemu/backends.py). The command then
exits 128 plus the signal's number (130 for SIGINT, 143 SIGTERM, 129 SIGHUP, 152 SIGXCPU, 138
SIGUSR1, 140 SIGUSR2) with one line naming what was discarded.

SIGPIPE stays ignored, as Python has it: a write to a closed pipe fails with EPIPE, which
:class:`BrokenPipe` turns into a quiet exit 141 (`kvemu trace info T | head -1`), with the line
only when an output was discarded.

The kvemu command installs the handlers first thing (kvemu/__main__.py), before the imports that
take most of its first second, so that a signal at any moment is one line and that exit code; a
signal while click parses the command line or after the command is done is held and reported when
it is safe (:func:`hold`, :func:`release`). Only the first signal counts (the first that Python
handles: signals that come together are handled in the order of their numbers); another one while
the first one's way out runs is ignored, so that it cannot cut short the cleanup (SIGKILL still
ends a way out that hangs). A signal the process was started with ignored stays ignored (``nohup``,
a background job of a non-interactive shell). Nothing here runs for a library caller that does not
call :func:`install_handlers`.
"""

from __future__ import annotations

import os
import signal
import sys

from .printable import one_line

#: Signals whose default action ends the process and that kvemu turns into an exception instead.
ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGXCPU, signal.SIGUSR1, signal.SIGUSR2)

# Where a test waits for the command to get so far: the environment variable names a file to which
# the command appends "handlers" once its handlers are installed, "command" when the command starts.
READY_FILE_ENV = "KVEMU_TEST_READY_FILE"


class Terminated(BaseException):
    """A signal that ends the command, raised in the main thread (a BaseException, like
    KeyboardInterrupt). ``Terminated()`` is SIGTERM's."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = int(signum)
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + self.signum


class Hangup(Terminated):
    """SIGHUP: its terminal went away. Handled as SIGTERM, reported as itself."""

    def __init__(self, signum: int = signal.SIGHUP):
        super().__init__(signum)


class BrokenPipe(Terminated):
    """EPIPE: the reader of stdout (or stderr) went away. Exit 141, as SIGPIPE's death would be."""

    def __init__(self, signum: int = signal.SIGPIPE):
        super().__init__(signum)


_installed = False
_held = False
_received: list[int] = []  # the first signal, once it came: the one that ends the command
_raised = False            # whether its exception was raised (else it is held, to be reported)


def _interruption(signum: int) -> BaseException:
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return Hangup() if signum == signal.SIGHUP else Terminated(signum)


def _raise_first() -> None:
    global _raised
    _raised = True
    raise _interruption(_received[0])


def _handle(signum, frame):
    if _received:  # already on the way out: let the cleanup finish
        return
    _received.append(signum)
    if not _held:
        _raise_first()


def install_handlers() -> None:
    """Makes each of ENDING_SIGNALS (those not ignored) raise its exception in the main thread."""
    global _installed, _held, _raised
    _received.clear()
    _held = _raised = False
    for s in ENDING_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _handle)
    _installed = True


def deliver(signum: int) -> None:
    """Handle signal ``signum`` as if it came now (one that came before the handlers were in:
    kvemu/__main__.py holds it until then)."""
    _handle(signum, None)


def ignore_from_now() -> None:
    """The command is done: each signal kvemu's handler has is ignored from now on (the process is
    exiting; Python's finalization would otherwise put the default action, death, back in place)."""
    for s in ENDING_SIGNALS:
        if signal.getsignal(s) is _handle:
            signal.signal(s, signal.SIG_IGN)


def interrupts(signum: int) -> bool:
    """Whether signal ``signum`` now ends what the main thread does, so that a C call it waits for
    should be cancelled: SIGINT, SIGTERM and SIGHUP by convention, whatever handles them in Python;
    the other ENDING_SIGNALS while kvemu's handler has them (a library caller's own SIGUSR1 handler
    may mean anything)."""
    if signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        return True
    return signum in ENDING_SIGNALS and signal.getsignal(signum) is _handle


def hold() -> None:
    """From now on a signal is recorded, not raised (see :func:`release`, :func:`pending`)."""
    global _held
    _held = _installed


def release() -> None:
    """Signals raise again; one that came while they were held is raised now."""
    global _held
    if not _installed:
        return
    _held = False
    mark_ready("command")
    if _received and not _raised:
        _raise_first()


def pending() -> BaseException | None:
    """The interruption of a signal that came while signals were held and was not raised since
    (None: none came)."""
    return _interruption(_received[0]) if _received and not _raised else None


def mark_ready(stage: str) -> None:
    path = os.environ.get(READY_FILE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{stage}\n")


def interrupted_message(exc: BaseException) -> tuple[int, str | None]:
    """Exit code and the one line to print for an interruption (None: nothing to say)."""
    from .output import unfinished_outputs  # here: the handlers go in before any import they need not wait for

    name, code = (exc.signal_name, exc.exit_code) if isinstance(exc, Terminated) else ("SIGINT", 130)
    lost = unfinished_outputs()
    if isinstance(exc, BrokenPipe):
        silence_stdout()
        if not lost:
            return code, None
    what = ", ".join(str(p) for p in lost) if lost else "nothing"
    return code, f"interrupted by {name}; discarded: {what} (no partial file left; tier released)"


def silence_stdout() -> None:
    """Points stdout at /dev/null: its reader is gone, and the interpreter's last flush would
    report the broken pipe."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    except OSError:
        pass


def run_command(load_command, early=()) -> None:
    """Runs the kvemu command and exits with its code: the handlers installed first, then
    ``load_command()`` imports the click command and returns it (kvemu/__main__.py: so that a
    signal during the imports is one line too), which runs on ``sys.argv``. ``early``: the numbers
    of signals that came before the handlers were in (kvemu/__main__.py holds them); the first
    ends the command as any other would."""
    install_handlers()
    try:
        if early:
            deliver(early[0])
        mark_ready("handlers")
        command = load_command()
        hold()  # until the command starts: click's parsing would swallow a KeyboardInterrupt
        command(prog_name="kvemu")
        code = 0
    except SystemExit as e:
        code = e.code
    except (KeyboardInterrupt, Terminated) as e:  # during the imports
        hold()
        code = _report(e)
    hold()  # the command is done: what comes now is reported, never a traceback
    # Python's finalization puts SIG_DFL back in place of every Python handler, so a signal during
    # it (threads joined, modules torn down) would kill the process: ignored from here, the way out
    # of a finished command ends with its own code; one that came before is reported just below
    ignore_from_now()
    late = pending()
    if late is not None and not code:
        code = _report(late)
    sys.exit(code)


def _report(exc: BaseException) -> int:
    code, message = interrupted_message(exc)
    if message:
        try:
            sys.stderr.write(f"Error: {one_line(message)}\n")
            sys.stderr.flush()
        except OSError:
            pass
    return code
