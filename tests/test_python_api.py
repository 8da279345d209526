"""The Python API: docs/python.md's worked example runs as written, and kvemu's top level exports
what the docs name."""

import re
from pathlib import Path

import pytest

import kvemu

DOC = Path(__file__).resolve().parents[1] / "docs" / "python.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_worked_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (code,) = _blocks()
    exec(compile(code, str(DOC), "exec"), {})
    out = capsys.readouterr().out
    assert "requests recorded" in out
    assert "vemu:cxl-pool/offload" in out and "vemu:nvme/offload" in out
    assert (tmp_path / "chat-cxl-pool.parquet").exists() and (tmp_path / "chat-nvme.parquet").exists()


def test_every_name_the_docs_give_is_exported():
    text = DOC.read_text()
    for name in sorted(set(re.findall(r"kvemu\.([A-Za-z_]+)\b", text)) - {"replay", "record_options"}):
        assert hasattr(kvemu, name), name
    for name in kvemu.__all__:
        getattr(kvemu, name)


def test_option_errors_name_the_field_and_are_value_errors(tmp_path):
    with pytest.raises(ValueError) as e:
        kvemu.replay("x.parquet", "dram", kvemu.ReplayOptions(stores=kvemu.StoreOptions(timing="later")),
                     out=tmp_path / "r.parquet")
    assert isinstance(e.value, kvemu.OptionError) and e.value.field == "stores.timing"
    assert str(e.value).startswith("stores.timing must be one of")


def test_replay_and_report_are_callable_whichever_is_imported():
    import kvemu.replay.options  # noqa: F401  (the subpackages, imported, stand where the functions were)
    import kvemu.report

    assert callable(kvemu.replay) and callable(kvemu.report)


def test_every_replay_option_field_is_documented():
    from dataclasses import fields

    for group in fields(kvemu.ReplayOptions):
        cls = group.default_factory
        doc = cls.__doc__
        for f in fields(cls):
            assert f"``{f.name}``" in doc, f"{cls.__name__}.{f.name} is not documented"


def test_replay_options_defaults_are_the_command_lines():
    """ReplayOptions() is `kvemu replay` without flags: each field's default against its flag's."""
    from dataclasses import fields

    from kvemu.cli import REPLAY_FLAGS, cli
    from kvemu.units import parse_size

    params = {opt: p for p in cli.commands["replay"].params for opt in p.opts}
    opts = kvemu.ReplayOptions()
    checked = 0
    for field, flag in REPLAY_FLAGS.items():
        group, name = field.split(".")
        value = getattr(getattr(opts, group), name)
        p = params[flag]
        default = p.default
        if isinstance(default, str) and name.endswith("_bytes"):
            default = parse_size(default)
        if p.is_flag:
            default = bool(default)
        assert value == default, f"{field} = {value!r}, {flag} defaults to {default!r}"
        checked += 1
    assert checked == sum(len(fields(g.default_factory)) for g in fields(kvemu.ReplayOptions)) - 1  # all but run_id
