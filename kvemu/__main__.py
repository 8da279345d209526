"""The kvemu command (``kvemu``, ``python -m kvemu``): signal handlers first, then the CLI.

The handlers go in before anything heavy is imported (numpy, pyarrow and the engine take most of
the command's first second), so that a signal at any moment ends the command with one line and
exit 128 plus its number (kvemu/interrupt.py).
"""

import sys


def main() -> None:
    from kvemu import interrupt

    interrupt.install_handlers()
    try:
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
