"""The kvemu command (``kvemu``, ``python -m kvemu``): signal handlers first, then the CLI.

The handlers go in before anything heavy is imported (numpy, pyarrow and the engine take most of
the command's first second), so that a signal at any moment ends the command with one line and
exit 128 plus its number (kvemu/interrupt.py). Then, while the process still has one thread, a
command that starts a Mooncake store here without ``allow_exposed=1`` enters a private network
namespace (kvemu/isolation.py): numpy's and pyarrow's imports start threads, after which it cannot.
"""

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


def _isolate() -> None:
    """A private network namespace for a command that starts a Mooncake store (kvemu.isolation's rule),
    entered before anything starts a thread; where none can be made, the store's check says why."""
    import sys

    from kvemu.isolation import enter_for_command  # stdlib only: no thread is started by its imports

    enter_for_command(sys.argv[1:])


def main() -> None:
    _install_early()
    _isolate()
    from kvemu import interrupt  # here, after the early hold: importing it imports ``signal``

    interrupt.run_command(_command, _early)


def _command():
    from kvemu.cli import cli  # here, after the handlers: the CLI's imports take most of the first second

    return cli


if __name__ == "__main__":
    main()
