"""The replay option table (kvemu/replay_options.py OPTIONS): every option declared once, and the
command line's flags, the flag map and the sweep's [grid] keys all made from it."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvemu.cli import REPLAY_FLAGS, cli
from kvemu.errors import ConfigError
from kvemu.replay_options import BY_NAME, OPTIONS, SWEEPABLE, ReplayOptions
from kvemu.sweep import GRID_DEFAULTS, expand_sweep

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"


def test_each_field_declared_once_and_no_flag_or_key_twice():
    names = [o.name for o in OPTIONS]
    flags = [o.flag for o in OPTIONS if o.flag]
    keys = [o.sweep for o in OPTIONS if o.sweep]
    assert len(set(names)) == len(names) and len(set(flags)) == len(flags) and len(set(keys)) == len(keys)
    every_field = {f"{g.name}.{f.name}" for g in fields(ReplayOptions) for f in fields(g.default_factory)}
    assert set(names) == every_field  # each field of each group has its one declaration
    assert REPLAY_FLAGS == {o.name: o.flag for o in OPTIONS if o.flag}
    assert set(GRID_DEFAULTS) == set(SWEEPABLE) == set(keys)


def _help_entries() -> dict[str, str]:
    """``replay --help``'s entry of each flag, its lines joined: an entry starts on a line of its own
    with two spaces and the flag."""
    res = CliRunner().invoke(cli, ["replay", "--help"], terminal_width=100)
    assert res.exit_code == 0
    entries: dict[str, list[str]] = {}
    for line in res.output[res.output.index("Options:"):].splitlines()[1:]:
        m = re.match(r"  (--[a-z-]+)", line)
        if m:
            flag = m.group(1)
        entries.setdefault(flag, []).append(line.strip())
    return {flag: " ".join(lines) for flag, lines in entries.items()}


def _shown(value) -> str:
    """A default as --help shows it, written out by hand: sizes in the largest whole binary unit."""
    if isinstance(value, int) and value >= 1 << 20 and not isinstance(value, bool):
        for unit, shift in (("GiB", 30), ("MiB", 20)):
            if value % (1 << shift) == 0:
                return f"{value >> shift}{unit}"
    return str(value)


def test_every_declared_option_is_in_replay_help_with_its_default():
    by_flag = _help_entries()
    for o in OPTIONS:
        if o.flag is None:
            assert o.name == "output.run_id"  # the one field the command line does not set
            continue
        entry = by_flag[o.flag]
        first_words = re.sub(r"\s+", " ", o.help_text()).split(" ")[:4]
        assert " ".join(first_words) in entry, o.flag
        default = o.default
        if default is None or isinstance(default, bool):
            assert "[default:" not in entry, o.flag
        else:
            assert f"[default: {_shown(default)}]" in entry, (o.flag, entry[-60:])
    assert set(by_flag) == {o.flag for o in OPTIONS if o.flag} | {"--backend", "--out"}
    assert by_flag["--store-inflight"].endswith("[default: 2GiB]") and "[default: 4GiB]" in by_flag["--max-memory"]


#: A value other than the default for each kind of option, and the field value a sweep makes of it.
SAMPLES = {"bool": (True, True), "size": ("1GiB", 1 << 30), "range": ("0:4", (0.0, 4.0)), "float": (2.0, 2.0),
           "int": (2, 2)}
#: What an option needs beside it to be a valid replay (both sides of a deployment).
COMPANIONS = {"prefill_instances": {"decode_instances": 1}, "decode_instances": {"prefill_instances": 1}}


def _sample(o):
    if o.choices is not None:
        v = next(c for c in o.choices if c != o.default)
        return v, v
    if o.sweep == "transfer":
        return "pool", "pool"
    if o.sweep == "warmup":  # a share below 1
        return 0.25, 0.25
    return SAMPLES[o.kind]


def _spec(grid: dict) -> dict:
    return {"trace": [{"path": str(TRACE)}], "backends": {"use": ["vemu:nvme"]}, "grid": grid}


@pytest.mark.parametrize("key", sorted(SWEEPABLE))
def test_every_sweepable_option_is_a_grid_axis(tmp_path, key):
    o = SWEEPABLE[key]
    value, field_value = _sample(o)
    sweep = expand_sweep(_spec({key: [value], **COMPANIONS.get(key, {})}), tmp_path / "s.toml")
    (cell,) = sweep.cells
    opts = cell.replay_options()
    assert getattr(getattr(opts, o.group), o.field) == field_value
    assert opts == opts.check()
    # a cell at the default has the key of a spec that does not name the axis (datasets resume)
    default = o.none_word if o.default is None else _shown(o.default) if o.kind == "size" else o.default
    if default is not None and key not in COMPANIONS:
        (plain,) = expand_sweep(_spec({}), tmp_path / "s.toml").cells
        (at_default,) = expand_sweep(_spec({key: [default]}), tmp_path / "s.toml").cells
        assert at_default.key == plain.key != cell.key


def test_unsweepable_options_are_refused_as_grid_keys(tmp_path):
    for o in OPTIONS:
        key = o.sweep or o.field
        if o.sweep is None and key not in SWEEPABLE:
            with pytest.raises(ConfigError, match=f"unknown key in \\[grid\\] '{key}'"):
                expand_sweep(_spec({key: [1]}), tmp_path / "s.toml")


@pytest.mark.parametrize("grid, message", [
    ({"tier_devices": [2, 0]}, "[grid] tier_devices must be a whole number from 1 to 4096, got 0"),
    ({"kv_layout": ["diagonal"]}, "[grid] kv_layout must be one of per-layer, cross-layer, got 'diagonal'"),
    ({"prefill_instances": [2]}, "give both [grid] prefill_instances and [grid] decode_instances, or neither"),
    ({"schedule": ["recorded"], "kv_load": ["async"]}, "[grid] kv_load async needs [grid] schedule closed"),
    ({"tier_capacity": ["lots"]}, "[grid] tier_capacity"),
])
def test_a_grid_value_is_checked_by_the_options_own_rules(tmp_path, grid, message):
    with pytest.raises(ConfigError) as e:
        expand_sweep(_spec(grid), tmp_path / "s.toml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_command_line_sets_each_field_through_its_flag(tmp_path):
    """The flag a message names is the declared one: a bad value by flag names that flag."""
    res = CliRunner().invoke(cli, ["replay", str(TRACE), "--backend", "vemu:nvme", "--tier-devices", "0",
                                   "--out", str(tmp_path / "r.parquet")])
    assert res.exit_code == 2 and "--tier-devices must be a whole number from 1 to 4096" in res.output
    assert BY_NAME["tier.devices"].bounds == (1, 4096)
    assert not (tmp_path / "r.parquet").exists()


def test_scale_out_doc_lists_every_grid_key_with_its_flag_and_default():
    from kvemu.units import parse_size

    text = (ROOT / "docs" / "scale-out.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \| `(--[a-z-]+)` \| `([^`]+)` \|", text, flags=re.M)
    assert {key: flag for key, flag, _ in rows} == {key: o.flag for key, o in SWEEPABLE.items()}
    for key, _, stated in rows:
        o = SWEEPABLE[key]
        if stated in ('"default"', '"all"'):
            assert o.default is None and o.none_word == stated.strip('"'), key
        elif stated in ("true", "false"):
            assert o.default is (stated == "true"), key
        elif stated.startswith('"'):
            word = stated.strip('"')
            assert o.default == (parse_size(word) if o.kind == "size" else word), key
        else:
            assert o.default == float(stated), key


# ------------------------------------------------------------------------------------------ record
def test_record_table_declares_each_field_once_and_its_flags_are_the_commands():
    from kvemu.cli import RECORD_FLAGS
    from kvemu.record_options import FLAT_FIELDS, OPTIONS as RECORD, RecordOptions
    from kvemu.sweep import RECORD_OPTIONS

    names = [o.name for o in RECORD]
    flags = [o.flag for o in RECORD if o.flag]
    assert len(set(names)) == len(names) and len(set(flags)) == len(flags)
    assert set(names) == {f"{g.name}.{f.name}" for g in fields(RecordOptions) for f in fields(g.default_factory)}
    assert RECORD_FLAGS == {o.name: o.flag for o in RECORD if o.flag}
    # a flat name (a [[trace]] key) is its flag's, without dashes
    assert {k: v for k, v in FLAT_FIELDS.items() if v in RECORD_FLAGS} == \
        {RECORD_FLAGS[v][2:].replace("-", "_"): v for v in RECORD_FLAGS}
    assert set(RECORD_OPTIONS) == set(FLAT_FIELDS) - {"force", "show_progress"}
    params = {p.opts[0]: p for p in cli.commands["record"].params}
    for o in RECORD:
        if o.flag:
            p = params[o.flag]
            assert p.help == o.help_text() and (bool(p.default) if p.is_flag else p.default) == o.default, o.flag
            assert bool(p.show_default) == (o.default is not None and not isinstance(o.default, bool)), o.flag


@pytest.mark.parametrize("key, value", [("engine_era", "2024"), ("kv_layout", "cross-layer"), ("chunk_tokens", 512),
                                        ("prefill_instances", 1)])
def test_record_options_new_to_sweeps_are_trace_keys(tmp_path, key, value):
    spec = {"trace": [{"workload": "synthetic:chat", "model": "llama3-8b", key: [value]}],
            "backends": {"use": ["vemu:nvme"]}}
    if key == "prefill_instances":
        spec["trace"][0]["decode_instances"] = 1
    (src,) = expand_sweep(spec, tmp_path / "s.toml").traces
    assert src.record[key] == value


def test_a_trace_keys_value_is_checked_at_parse_by_record_options(tmp_path):
    spec = {"trace": [{"workload": "synthetic:chat", "model": "llama3-8b", "tp": [1, 0]}],
            "backends": {"use": ["vemu:nvme"]}}
    with pytest.raises(ConfigError, match=r"\[\[trace\]\] #1: tp must be a whole number >= 1, got 0"):
        expand_sweep(spec, tmp_path / "s.toml")
