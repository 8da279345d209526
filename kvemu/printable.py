"""Text from files is untrusted: terminal control sequences in a trace's metadata, a results label
or a file name must not reach the terminal raw (an ``ESC [`` sequence can rewrite the screen, hide
lines or set the window title), and a newline in a file name must not split a one-line error.

:func:`one_line` escapes every control character, newlines included (error messages, table cells);
:func:`safe_text` keeps newlines and tabs (multi-line output such as a report's tables). Escapes
are Python's: ``\\x1b``, ``\\n``, ``\\u009b``. JSON output needs neither: ``json.dumps`` escapes
control characters itself.
"""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls (U+0080-U+009F: 8-bit CSI and friends); plus the line and
# paragraph separators, which some terminals treat as newlines
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(m: re.Match) -> str:
    c = m.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100
                                                              else f"\\u{ord(c):04x}")


def one_line(text: str) -> str:
    """``text`` with every control character escaped: one printable line."""
    return _CONTROL.sub(_escape, str(text))


def safe_text(text: str) -> str:
    """``text`` with control characters escaped except newline and tab."""
    return _CONTROL_BUT_LINES.sub(_escape, str(text))


#: The longest word (a run without spaces: a path, a profile name, a value) an error line shows whole;
#: a longer one is shortened to its start and its end, so that a 1 MB name is not a 1 MB line.
LONGEST_WORD = 400
_LONG_WORD = re.compile(r"\S{%d,}" % (LONGEST_WORD + 1))


#: The longest error line, after its words are shortened (a name of many short words).
LONGEST_LINE = 4000


def shorten_words(text: str) -> str:
    """``text`` with every word longer than :data:`LONGEST_WORD` characters shortened to its first
    200 and last 60 characters around ``…(N characters)…``, and the whole to :data:`LONGEST_LINE`
    (its start and its end: the reason is at the end)."""
    def cut(m: re.Match) -> str:
        w = m.group()
        return f"{w[:200]}…({len(w)} characters)…{w[-60:]}"
    out = _LONG_WORD.sub(cut, str(text))
    if len(out) > LONGEST_LINE:
        out = f"{out[:LONGEST_LINE - 1000]}…({len(out)} characters)…{out[-900:]}"
    return out
