"""kvemu.recording.record's options (kvemu/record_options.py): grouped, documented, `kvemu record`'s
defaults, validated with OptionError naming the field, which the command line names by its flag."""
import dataclasses
import inspect
import re

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.cli import RECORD_FLAGS, cli
from kvemu.errors import ConfigError, OptionError
from kvemu.record_options import (FLAT_FIELDS, EngineOptions, GpuOptions, RecordOutputOptions, RecordOptions,
                                  WeightsOptions, WorkloadOptions)
from kvemu.recording import record

WORKLOAD = "synthetic:chat:sessions=2,turns=2"
GROUPS = (WorkloadOptions, GpuOptions, EngineOptions, WeightsOptions, RecordOutputOptions)


def _field(options, dotted):
    group, name = dotted.split(".")
    return getattr(getattr(options, group), name)


def test_defaults_are_the_commands():
    params = {p.name: p for p in cli.commands["record"].params}
    defaults = RecordOptions()
    for flat, dotted in FLAT_FIELDS.items():
        if flat == "show_progress":  # the command always shows progress
            assert defaults.output.show_progress is True
            continue
        assert flat in params, flat
        assert _field(defaults, dotted) == params[flat].default, dotted


def test_every_field_has_a_flag_of_the_command():
    flags = {opt for p in cli.commands["record"].params for opt in p.opts}
    assert set(RECORD_FLAGS) == set(FLAT_FIELDS.values()) - {"output.show_progress"}
    assert set(RECORD_FLAGS.values()) <= flags
    for flat, dotted in FLAT_FIELDS.items():
        if dotted in RECORD_FLAGS:
            assert RECORD_FLAGS[dotted] == "--" + flat.replace("_", "-")


def test_every_field_is_documented_with_its_default():
    """The class docstring gives each field's meaning and its actual default; a #: comment is above it."""
    def shown(f):
        if f.default is dataclasses.MISSING:
            return f"{f.default_factory.__name__}()"
        return f'"{f.default}"' if isinstance(f.default, str) else str(f.default)

    for cls in (*GROUPS, RecordOptions):
        assert cls.__dataclass_params__.frozen
        doc = inspect.cleandoc(cls.__doc__)
        entries = dict(re.findall(r"^    (\w+): (.*?)(?=^    \w+: |\Z)", doc, re.M | re.S))
        source = inspect.getsource(cls).splitlines()
        for f in dataclasses.fields(cls):
            assert f.name in entries, f"{cls.__name__}.{f.name} is not documented"
            assert f"Default {shown(f)}" in " ".join(entries[f.name].split()), f"{cls.__name__}.{f.name}"
            line = next(i for i, s in enumerate(source) if s.startswith(f"    {f.name}: "))
            assert source[line - 1].startswith("    #: "), f"{cls.__name__}.{f.name} has no #: comment"
        assert set(entries) == {f.name for f in dataclasses.fields(cls)}


def test_a_group_of_the_wrong_type_is_refused():
    with pytest.raises(OptionError) as e:
        RecordOptions(engine={"block_tokens": 16}).check()
    assert e.value.field == "engine" and e.value.reason == "must be of type EngineOptions, got dict"


BAD = [
    (RecordOptions(workload=WorkloadOptions(time_scale=float("nan"))), "workload.time_scale",
     "must be a positive number below 1e+09, got nan"),
    (RecordOptions(workload=WorkloadOptions(request_rate=0.0)), "workload.request_rate",
     "must be a positive number of requests per second, got 0.0"),
    (RecordOptions(gpu=GpuOptions(tp=0)), "gpu.tp", "must be a whole number >= 1, got 0"),
    (RecordOptions(gpu=GpuOptions(gpus=2.0)), "gpu.gpus", "must be a whole number >= 1, got 2.0"),
    (RecordOptions(gpu=GpuOptions(mfu=2.0)), "gpu.mfu", "must be >= 0.001 and <= 1, got 2"),
    (RecordOptions(gpu=GpuOptions(step_overhead_us=float("inf"))), "gpu.step_overhead_us",
     "must be a finite number, got inf"),
    (RecordOptions(engine=EngineOptions(block_tokens=0)), "engine.block_tokens", "must be positive"),
    (RecordOptions(engine=EngineOptions(chunk_tokens=100)), "engine.chunk_tokens",
     "must be a positive multiple of the 16 tokens per block, at most 1048576 (65536 blocks); got 100"),
    (RecordOptions(engine=EngineOptions(hbm_kv_gib=0)), "engine.hbm_kv_gib", "must be > 0 and <= 1e+06, got 0"),
    (RecordOptions(engine=EngineOptions(tier_capacity_gib=-1.0)), "engine.tier_capacity_gib",
     "must be > 0 and <= 1e+09, got -1"),
    (RecordOptions(engine=EngineOptions(kv_layout="rows")), "engine.kv_layout",
     "must be per-layer or cross-layer, got 'rows'"),
    (RecordOptions(weights=WeightsOptions(weights_in_tier=1.5)), "weights.weights_in_tier",
     "must be >= 0 and <= 1, got 1.5"),
    (RecordOptions(weights=WeightsOptions(cold_experts=float("nan"))), "weights.cold_experts",
     "must be a finite number, got nan"),
    (RecordOptions(weights=WeightsOptions(stream="parallel")), "weights.stream",
     "must be one of serial, overlap, got 'parallel'"),
]


@pytest.mark.parametrize("options,field,reason", BAD, ids=[b[1] for b in BAD])
def test_a_bad_field_is_named_and_nothing_is_written(tmp_path, options, field, reason):
    with pytest.raises(OptionError) as e:
        options.check()
    assert (e.value.field, e.value.reason, str(e.value)) == (field, reason, f"{field} {reason}")
    assert isinstance(e.value, (ConfigError, ValueError))
    out = tmp_path / "t.parquet"
    with pytest.raises(OptionError, match="^" + field.replace(".", r"\.")):
        record(WORKLOAD, "llama3-8b", out, options)
    assert not out.exists()


@pytest.mark.parametrize("options,field,reason", BAD, ids=[b[1] for b in BAD])
def test_the_command_names_the_flag(tmp_path, options, field, reason):
    flat = {v: k for k, v in FLAT_FIELDS.items()}[field]
    value = _field(options, field)
    out = tmp_path / "t.parquet"
    res = CliRunner().invoke(cli, ["record", "--workload", WORKLOAD, "--model", "llama3-8b", "--out", str(out),
                                   RECORD_FLAGS[field], str(value)])
    assert res.exit_code == 2, res.output
    if field in ("gpu.gpus", "engine.kv_layout", "weights.stream"):  # click refuses these values itself
        assert RECORD_FLAGS[field] in res.output
    else:
        assert res.output.strip() == f"Error: {RECORD_FLAGS[field]} {reason}"
    assert not out.exists()


def test_from_flat_takes_the_commands_names_and_refuses_others():
    o = RecordOptions.from_flat(weight_stream="overlap", hbm_kv_gib=2, tp=2, max_requests=5, force=True)
    assert o == RecordOptions(workload=WorkloadOptions(max_requests=5), gpu=GpuOptions(tp=2),
                              engine=EngineOptions(hbm_kv_gib=2), weights=WeightsOptions(stream="overlap"),
                              output=RecordOutputOptions(force=True))
    assert RecordOptions.from_flat() == RecordOptions()
    with pytest.raises(OptionError) as e:
        RecordOptions.from_flat(chunk=256)
    assert e.value.field == "chunk" and e.value.reason.startswith("is not a record option")


def test_the_api_records_what_the_command_records(tmp_path):
    """Typed options through record() and the same flags through `kvemu record`: the same rows."""
    api, cmd = tmp_path / "api.parquet", tmp_path / "cmd.parquet"
    meta = record(WORKLOAD, "llama3-8b", api,
                  RecordOptions(engine=EngineOptions(hbm_kv_gib=0.5, chunk_tokens=64), gpu=GpuOptions(mfu=0.4),
                                workload=WorkloadOptions(time_scale=2.0), output=RecordOutputOptions(show_progress=False)))
    res = CliRunner().invoke(cli, ["record", "--workload", WORKLOAD, "--model", "llama3-8b", "--out", str(cmd),
                                   "--hbm-kv-gib", "0.5", "--chunk-tokens", "64", "--mfu", "0.4",
                                   "--time-scale", "2"])
    assert res.exit_code == 0, res.output
    assert pq.read_table(api).equals(pq.read_table(cmd))
    assert meta["engine"]["transfer_chunk_tokens"] == 64
