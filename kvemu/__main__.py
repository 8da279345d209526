"""The kvemu command (``kvemu``, ``python -m kvemu``): signal handlers first, then the CLI.

The handlers go in before anything heavy is imported (numpy, pyarrow and the engine take most of
the command's first second), so that a signal at any moment ends the command with one line and
exit 128 plus its number (kvemu/interrupt.py).
"""

import sys

#: A signal that came before kvemu.interrupt's handlers were in (its number), delivered once they are.
_early: list[int] = []


def _hold_early(signum, frame) -> None:
    if not _early:
        _early.append(signum)


def _install_early() -> None:
    """Hold every ending signal from the first moment of main(): importing kvemu.interrupt imports
    ``signal``, whose enums take tens of milliseconds to build, during which Python's own SIGINT
    handler would print a traceback. ``_signal`` is the C module, already loaded."""
    import _signal

    for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGXCPU", "SIGUSR1", "SIGUSR2"):
        num = getattr(_signal, s)
        if _signal.getsignal(num) != _signal.SIG_IGN:  # one started ignored (nohup) stays ignored
            _signal.signal(num, _hold_early)


def main() -> None:
    _install_early()
    from kvemu import interrupt

    interrupt.install_handlers()
    try:
        if _early:  # it came during the import above: it ends the command as any other would
            interrupt.deliver(_early[0])
        interrupt.mark_ready("handlers")
        from kvemu.cli import cli

        interrupt.hold()  # until the command starts: click's parsing would swallow a KeyboardInterrupt
        cli(prog_name="kvemu")
        code = 0
    except SystemExit as e:
        code = e.code
    except (KeyboardInterrupt, interrupt.Terminated) as e:  # during the imports
        interrupt.hold()
        code = _report(e)
    interrupt.hold()  # the command is done: what comes now is reported, never a traceback
    # Python's finalization puts SIG_DFL back in place of every Python handler, so a signal during
    # it (threads joined, modules torn down) would kill the process: ignored from here, the way out
    # of a finished command ends with its own code; one that came before is reported just below
    interrupt.ignore_from_now()
    late = interrupt.pending()
    if late is not None and not code:
        code = _report(late)
    sys.exit(code)


def _report(exc: BaseException) -> int:
    from kvemu.interrupt import interrupted_message
    from kvemu.printable import one_line

    code, message = interrupted_message(exc)
    if message:
        try:
            sys.stderr.write(f"Error: {one_line(message)}\n")
            sys.stderr.flush()
        except OSError:
            pass
    return code


if __name__ == "__main__":
    main()
