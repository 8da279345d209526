"""An option declared once (:class:`Opt`): the field of an options dataclass it sets, its
command-line flag and help, the values it takes and whether a sweep can vary it. Replay's table is
``kvemu.replay_options.OPTIONS``, record's ``kvemu.record_options.OPTIONS``; the command line's
options (kvemu/cli.py), the flag a message names for a field and the sweep's keys (kvemu/sweep.py)
are made from them; :class:`OptionGroups` is what both tables' root dataclass (ReplayOptions,
RecordOptions) does with its groups. A leaf module: kvemu.errors and the standard library only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import OptionError

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
    - ``choices``: the values taken, in the order --help lists them (or a function giving them);
      kind ``choice``: click refuses others, kind ``str``: the group's ``check()`` does, in one line.
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


def flag_map(opts) -> dict[str, str]:
    """The flag of each field of ``opts`` that has one (``"stores.timing": "--store-timing"``): what
    errors.OptionError.render names a field by on the command line."""
    return {o.name: o.flag for o in opts if o.flag}


class OptionGroups:
    """What the root of an option table does with its groups: the base of a frozen dataclass whose
    fields are groups, each a frozen dataclass with a default factory and a ``check()``
    (kvemu.replay_options.ReplayOptions, kvemu.record_options.RecordOptions). A root declares its
    groups and the checks across them; reading, checking and copying its groups is here."""

    def check(self):
        """Check each group on its own (OptionError naming the first bad field); returns self. A root
        with checks across groups runs them after this."""
        for f in dataclasses.fields(self):
            group = getattr(self, f.name)
            if not isinstance(group, f.default_factory):  # a dict or a string has no check()
                raise OptionError(f.name, f"must be of type {f.default_factory.__name__}, got {type(group).__name__}")
            group.check()
        return self

    @classmethod
    def from_fields(cls, values: dict):
        """The options from ``{"group.field": value}`` (``"group__field"`` too, Opt.key()); a group not
        named keeps its defaults, and so does a field. A name that is no group raises OptionError;
        the values are checked by :meth:`check`."""
        kinds = {f.name: f.default_factory for f in dataclasses.fields(cls)}
        groups: dict[str, dict] = {}
        for key, value in values.items():
            group, _, name = key.replace("__", ".").partition(".")
            if group not in kinds:
                raise OptionError(key, f"names no group of {cls.__name__} (known: {', '.join(kinds)})")
            groups.setdefault(group, {})[name] = value
        return cls(**{g: kinds[g](**kw) for g, kw in groups.items()})

    def but(self, **groups):
        """A copy with some fields changed, by ``group__field=value`` or ``group=GroupOptions``:
        ``opts.but(output__force=False)``."""
        changes: dict = {}
        for key, value in groups.items():
            group, _, name = key.partition("__")
            if not name:
                changes[group] = value
            else:
                changes[group] = dataclasses.replace(changes.get(group, getattr(self, group)), **{name: value})
        return dataclasses.replace(self, **changes)
