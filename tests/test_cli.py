"""The command line, driven through click's CliRunner."""

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvemu.cli import cli


def all_commands(group, prefix=()):
    for name, cmd in group.commands.items():
        yield prefix + (name,)
        if isinstance(cmd, click.Group):
            yield from all_commands(cmd, prefix + (name,))


@pytest.mark.parametrize("path", sorted(all_commands(cli)))
def test_every_command_has_help_with_text(path):
    res = CliRunner().invoke(cli, [*path, "-h"])
    assert res.exit_code == 0, res.output
    assert "Usage:" in res.output and len(res.output.splitlines()) > 3


def test_record_info_validate_replay_report(tmp_path):
    r = CliRunner()
    trace = tmp_path / "t.parquet"
    res = r.invoke(cli, ["record", "--workload", "synthetic:docqa:documents=2,questions=3", "--model", "llama3-8b",
                         "--out", str(trace), "--hbm-kv-gib", "4"])
    assert res.exit_code == 0, res.output
    assert "6 requests" in res.output
    res = r.invoke(cli, ["trace", "info", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["summary"]["requests"] == 6
    assert info["summary"]["dedup_ratio"] > 1  # questions share their document's blocks
    res = r.invoke(cli, ["trace", "info", str(trace)])
    assert "prefix_hit_ratio_unbounded" in res.output
    res = r.invoke(cli, ["trace", "validate", str(trace)])
    assert res.exit_code == 0 and "valid kvemu trace v2" in res.output
    out = tmp_path / "r.parquet"
    res = r.invoke(cli, ["replay", str(trace), "--backend", "dram", "--layers", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "(measured" in res.output
    res = r.invoke(cli, ["report", str(out), "--json"])
    assert res.exit_code == 0, res.output
    runs = json.loads(res.output)["runs"]
    assert runs[0]["completed"] == 6 and runs[0]["median_ttft_ms"] > 0
    res = r.invoke(cli, ["report", str(tmp_path)])
    assert res.exit_code == 0 and "dram" in res.output


@pytest.mark.parametrize("args,message", [
    (["trace", "info", "nope.parquet"], "no such file"),
    (["trace", "validate", "{bad}"], "not a Parquet file"),
    (["record", "--workload", "synthetic:nope", "--model", "llama3-8b", "--out", "{tmp}/x.parquet"], "nope"),
    (["record", "--workload", "synthetic:chat", "--model", "gpt-9", "--out", "{tmp}/x.parquet"], "unknown model"),
    (["replay", "{bad}", "--backend", "dram", "--out", "{tmp}/r.parquet"], "not a Parquet file"),
    (["replay", "{trace}", "--backend", "warp-drive", "--out", "{tmp}/r.parquet"], "unknown backend"),
    (["replay", "{trace}", "--backend", "dram", "--max-memory", "lots", "--out", "{tmp}/r.parquet"], "not a size"),
    (["replay", "{trace}", "--backend", "dram", "--requests", "5:2", "--out", "{tmp}/r.parquet"], "START < END"),
    (["replay", "{trace}", "--backend", "dram", "--out", "{trace}"], "one of this command's inputs"),
    (["replay", "{trace}", "--backend", "dram", "--out", "{bad}"], "already exists"),
    (["report", "{bad}"], "not a Parquet file"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, chat_trace, args, message):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"garbage")
    args = [a.format(tmp=tmp_path, bad=bad, trace=chat_trace) for a in args]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "r.parquet").exists() and not (tmp_path / "x.parquet").exists()


def test_load_schedule_and_upgrade_on_the_command_line(tmp_path):
    """record and replay say when the offered load is too high and how to change it; --time-scale
    changes it; replay says which schedule ran; trace upgrade rewrites a v1 trace."""
    r = CliRunner()
    hot, calm = tmp_path / "hot.parquet", tmp_path / "calm.parquet"
    args = ["record", "--workload", "synthetic:docqa:documents=4,questions=4", "--model", "llama3-8b",
            "--hbm-kv-gib", "1.5"]
    res = r.invoke(cli, [*args, "--out", str(hot)])
    assert res.exit_code == 0 and "offered load exceeds what 1 x H100-SXM can serve" in res.output
    assert "--time-scale 2.5" in res.output
    res = r.invoke(cli, [*args, "--out", str(calm), "--time-scale", "5"])
    assert res.exit_code == 0 and "offered load" not in res.output
    res = r.invoke(cli, ["trace", "info", str(calm)])
    assert "below saturation" in res.output and "closed loop" in res.output
    res = r.invoke(cli, ["replay", str(hot), "--backend", "vemu:cxl-pool", "--out", str(tmp_path / "a.parquet"),
                         "--time-scale", "4"])
    assert res.exit_code == 0 and "(closed schedule)" in res.output and "exceeds" not in res.output
    # the recorded schedule keeps the trace's overload (2.4x on one H100 at engine era 2025)
    res = r.invoke(cli, ["replay", str(hot), "--backend", "vemu:cxl-pool", "--out", str(tmp_path / "b.parquet"),
                         "--schedule", "recorded"])
    assert res.exit_code == 0 and "(recorded schedule)" in res.output and "exceeds" in res.output
    # on three instances each serves 2.4 / 3 = 0.8 of its capacity: no overload (two instances, at 1.2x, sit
    # at the edge of what the warning calls overload, so they make no claim either way)
    res = r.invoke(cli, ["replay", str(hot), "--backend", "vemu:cxl-pool", "--out", str(tmp_path / "b2.parquet"),
                         "--schedule", "recorded", "--instances", "3"])
    assert res.exit_code == 0 and "(recorded schedule)" in res.output and "exceeds" not in res.output
    res = r.invoke(cli, ["replay", str(hot), "--backend", "vemu:cxl-pool", "--out", str(tmp_path / "c.parquet"),
                         "--schedule", "recorded", "--time-scale", "2"])
    assert res.exit_code == 2 and "need --schedule closed" in res.output and "Traceback" not in res.output
    res = r.invoke(cli, ["replay", str(hot), "--backend", "vemu:cxl-pool", "--out", str(tmp_path / "d.parquet"),
                         "--instances", "3", "--routing", "prefix-aware"])
    assert res.exit_code == 0, res.output
    v1 = Path(__file__).parent / "data" / "golden-trace-v1.parquet"
    res = r.invoke(cli, ["trace", "upgrade", str(v1), "--out", str(tmp_path / "v2.parquet")])
    assert res.exit_code == 0 and "v2 trace (from v1" in res.output
    res = r.invoke(cli, ["trace", "validate", str(tmp_path / "v2.parquet")])
    assert res.exit_code == 0 and "valid kvemu trace v2" in res.output
    res = r.invoke(cli, ["trace", "upgrade", str(tmp_path / "v2.parquet"), "--out", str(tmp_path / "v3.parquet")])
    assert res.exit_code == 2 and "already a v2 trace" in res.output
