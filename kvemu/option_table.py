"""An option declared once (:class:`Opt`): the field of an options dataclass it sets, its
command-line flag and help, the values it takes and whether a sweep can vary it. Replay's table is
``kvemu.replay_options.OPTIONS``, record's ``kvemu.record_options.OPTIONS``; the command line's
options (kvemu/cli.py), the flag a message names for a field and the sweep's keys (kvemu/sweep.py)
are made from them. A leaf module: the standard library only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_UNSET = object()


@dataclass(frozen=True)
class Opt:
    """One option.

    - ``name``: ``group.field`` of the options dataclass (``stores.timing``).
    - ``flag``: ``--store-timing``; None: the Python API alone.
    - ``help``: the flag's help, or a function giving it (called when the command line is built).
    - ``kind``: what the command line and a sweep read: ``bool`` (a flag), ``int``, ``float``,
      ``str``, ``choice``, ``size`` (``64GiB`` or bytes), ``range`` (``START:END``), ``file``,
      ``folder``, ``tiers`` (kvemu.replay.stack.parse_tiers).
    - ``choices``: the values taken, in the order --help lists them (or a function giving them).
    - ``bounds``: ``(lo, hi)``, both taken, where the group's ``check()`` reads them from here.
    - ``sweep``: the key a sweep spec varies it by (replay: ``[grid]``; record: ``[[trace]]``);
      None: not sweepable (where the output goes, or what a sweep sets elsewhere).
    - ``none_word``: the word a sweep writes for a field's None where that is its default (``"all"``
      layers, ``"default"`` for the others: the trace's chunk, the trace's deployment).
    - ``metavar``: the value's name in --help, where not its type's.
    - ``default``: the field's default, filled in from the dataclass by :func:`declare`.
    """

    name: str
    flag: str | None
    help: object = ""
    kind: str = "str"
    choices: object = None
    bounds: tuple | None = None
    sweep: str | None = None
    none_word: str = "default"
    metavar: str | None = None
    default: object = _UNSET

    @property
    def group(self) -> str:
        return self.name.partition(".")[0]

    @property
    def field(self) -> str:
        return self.name.partition(".")[2]

    def help_text(self) -> str:
        return self.help() if callable(self.help) else self.help

    def choice_list(self) -> tuple | None:
        return tuple(self.choices()) if callable(self.choices) else self.choices

    def key(self) -> str:
        """The option's name as a Python identifier (``stores__timing``)."""
        return self.name.replace(".", "__")


def declare(root, opts) -> tuple[Opt, ...]:
    """``opts`` with each default filled in from ``root``'s groups (a dataclass whose fields are
    dataclasses with default factories); a name that is no field of them raises ValueError."""
    groups = {f.name: f.default_factory for f in dataclasses.fields(root)}
    out = []
    for o in opts:
        cls = groups.get(o.group)
        found = [f for f in dataclasses.fields(cls)] if cls is not None else []
        f = next((f for f in found if f.name == o.field), None)
        if f is None:
            raise ValueError(f"{o.name} is no field of {root.__name__}")
        out.append(dataclasses.replace(o, default=f.default))
    return tuple(out)
