"""Every number a user gives is checked before work starts: NaN, infinities, absurd sizes and counts
get one line on stderr and exit 2, and nothing is written (issue: reliability, classes 3 and 4)."""
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvemu.cli import cli

ROOT = Path(__file__).resolve().parents[1]
TRACE = str(ROOT / "traces" / "chat-llama3-8b-offload.parquet")
RECORD = ["record", "--workload", "synthetic:chat", "--model", "llama3-8b"]
HUGE = "1" + "0" * 400


@pytest.mark.parametrize("args,message", [
    (RECORD + ["--hbm-kv-gib", "nan"], "--hbm-kv-gib must be a finite number"),
    (RECORD + ["--hbm-kv-gib", "inf"], "--hbm-kv-gib must be a finite number"),
    (RECORD + ["--hbm-kv-gib", "1e300"], "--hbm-kv-gib must be > 0 and <= 1e+06"),
    (RECORD + ["--tier-capacity-gib", "-inf"], "--tier-capacity-gib must be a finite number"),
    (RECORD + ["--mfu", "1e-300"], "--mfu must be >= 0.001 and <= 1"),
    (RECORD + ["--mbu", "nan"], "--mbu must be a finite number"),
    (RECORD + ["--step-overhead-us", "inf"], "--step-overhead-us must be a finite number"),
    (RECORD + ["--time-scale", "nan"], "--time-scale must be a positive number"),
    (RECORD + ["--request-rate", "inf"], "--request-rate must be a positive number"),
    (["replay", TRACE, "--backend", "vemu:nvme", "--max-memory", HUGE], "--max-memory '100000000"),
    (["replay", TRACE, "--backend", "vemu:nvme", "--tier-capacity", HUGE + "GiB"], "is too large (at most 4 EiB)"),
    (["replay", TRACE, "--backend", "vemu:nvme", "--instances", "10000"], "--instances must be from 1 to 256"),
    (["replay", TRACE, "--backend", "vemu:nvme", "--repeat", "1000000000"], "--repeat must be an integer from 1 to 100"),
    (["replay", TRACE, "--backend", "vemu:nvme,latency_ns=1e12"], "profile key 'latency_ns' must be between 0 and 1e+07"),
    (["replay", TRACE, "--backend", "vemu:nvme,bandwidth_gbps=1e-9"], "profile key 'bandwidth_gbps' must be between"),
    (["replay", TRACE, "--backend", "vemu:nvme", "--time-scale", "inf"], "--time-scale must be a positive number"),
    (["trace", "info", TRACE, "--instances", "1000000000"], "--instances must be from 1 to 4096"),
    (["analyze", "capacity", TRACE, "--load-gbps", "nan"], "--load-gbps must be a finite number"),
    (["analyze", "capacity", TRACE, "--points", "100000000"], "--points must be from 2 to 10000"),
])
def test_absurd_numbers_are_refused_in_one_line(tmp_path, args, message):
    out = tmp_path / "out.parquet"
    if args[0] in ("record", "replay"):
        args = [*args, "--out", str(out)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1
    assert not out.exists()


def test_a_sweep_with_a_billion_repetitions_is_refused(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text(f'[sweep]\nname = "x"\nrepetitions = 1000000000\n[[trace]]\npath = "{TRACE}"\n'
                    '[backends]\nuse = ["vemu:nvme"]\n')
    res = CliRunner().invoke(cli, ["sweep", str(spec), "--dry-run"])
    assert res.exit_code == 2 and "repetitions must be an integer from 1 to 1000" in res.output


@pytest.mark.parametrize("args", [
    ["trace", "info", "{f}"], ["trace", "validate", "{f}"],
    ["replay", "{f}", "--backend", "vemu:nvme", "--out", "{o}"], ["report", "{f}"],
    ["record", "--workload", "mooncake:{f}", "--model", "llama3-8b", "--out", "{o}"],
    ["record", "--workload", "azure:{f}", "--model", "llama3-8b", "--out", "{o}"],
    ["replay", TRACE, "--backend", "emu:{f}", "--out", "{o}"], ["sweep", "{f}", "--dry-run"],
])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_endless_inputs_are_refused_not_read(tmp_path, args, kind):
    """A FIFO would block forever and /dev/zero never ends: refused before any read."""
    import os

    if kind == "fifo":
        path = tmp_path / ("in.toml" if "emu:{f}" in args else "in")
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    out = tmp_path / "out.parquet"
    args = [a.replace("{f}", str(path)).replace("{o}", str(out)) for a in args]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert "not a regular file" in res.output and "Traceback" not in res.output
    assert not out.exists()
