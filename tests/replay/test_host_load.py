"""This host's load while a measurement ran: recorded in replay results and calibrations, a warning
when other processes took a share that moves measured figures, and calibrate --out refusing to
write a profile measured under it. The load is made here: busy-loop processes, one per CPU."""
import os
import subprocess
import sys
import time
import tomllib

import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.replay import OutputOptions, ReplayOptions, WindowOptions, replay
from kvemu.replay.host import LOAD_MIN_WALL_S, OTHERS_SHARE_LIMIT, host_load


def sample(t, cpu, busy, total, load=1.0):
    return {"t": t, "loadavg_1m": load, "process_cpu_s": cpu, "host_busy_s": busy, "host_total_s": total, "cpus": 2}


def test_others_share_is_the_host_busy_time_this_process_did_not_use():
    # 10 s on 2 CPUs: 20 CPU-seconds; the host was busy 15 of them, this process 6: others took 9/20
    d = host_load(sample(100.0, 1.0, 50.0, 200.0), sample(110.0, 7.0, 65.0, 220.0, load=2.5))
    assert d["others_share"] == pytest.approx(0.45)
    assert d["process_cpus"] == pytest.approx(0.6)
    assert d["loadavg_1m_before"] == 1.0 and d["loadavg_1m_after"] == 2.5
    assert d["moved"] is True
    # this process alone kept the host busy: nobody else moved anything
    d = host_load(sample(0.0, 0.0, 0.0, 0.0), sample(10.0, 15.0, 15.5, 20.0))
    assert d["others_share"] == pytest.approx(0.025) and d["moved"] is False
    assert OTHERS_SHARE_LIMIT == 0.25
    # too short to judge, or no /proc/stat: recorded, not judged
    short = host_load(sample(0.0, 0.0, 0.0, 0.0), sample(LOAD_MIN_WALL_S / 2, 0.0, 0.5, 0.5))
    assert short["others_share"] is None and short["moved"] is None
    blind = host_load(sample(0.0, 0.0, None, None), sample(10.0, 1.0, None, None))
    assert blind["others_share"] is None and blind["moved"] is None and blind["process_cpus"] == pytest.approx(0.1)


@pytest.fixture
def cpu_hogs():
    """Busy loops on every CPU for the test's duration; never left behind."""
    n = len(os.sched_getaffinity(0))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3)  # they are running before the measurement starts
        yield hogs
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()


def test_a_replay_under_a_cpu_hog_records_the_load_and_warns(cpu_hogs, tmp_path):
    warnings = []
    # 8 layers: about a second on a quiet host, well over the LOAD_MIN_WALL_S a share needs
    res = replay("traces/chat-llama3-8b-offload.parquet", "dram",
                 ReplayOptions(window=WindowOptions(layers=8, requests=(0, 40)), output=OutputOptions()),
                 out=tmp_path / "r.parquet", warn=warnings.append)
    load = res.meta["host_load"]
    assert load["wall_s"] >= LOAD_MIN_WALL_S
    # one busy loop per CPU: at least half of the host's CPU time went to them
    assert load["others_share"] >= 0.4 and load["moved"] is True
    assert load["loadavg_1m_before"] is not None and load["process_cpus"] > 0
    assert any(w.startswith("other processes took") and "dram replay" in w for w in warnings)
    assert any(w.startswith("other processes took") for w in res.meta["warnings"])


def test_a_virtual_replay_records_the_load_without_a_warning(cpu_hogs, tmp_path):
    warnings = []
    res = replay("traces/chat-llama3-8b-offload.parquet", "vemu:cxl-pool",
                 ReplayOptions(window=WindowOptions(layers=1), output=OutputOptions()),
                 out=tmp_path / "v.parquet", warn=warnings.append)
    assert "host_load" in res.meta
    assert not any(w.startswith("other processes took") for w in warnings)


def test_calibrate_refuses_to_write_a_profile_measured_under_a_cpu_hog(cpu_hogs, tmp_path):
    out = tmp_path / "here.toml"
    args = ["calibrate", "--backend", "dram", "--buffer", "128MiB", "--hops", "4000000", "--out", str(out)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    error = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "not written: other processes took" in error[0] and "--force-load" in error[0]
    assert "Traceback" not in res.output and not out.exists()
    res = CliRunner().invoke(cli, [*args, "--force-load"])
    assert res.exit_code == 0, res.output
    cal = tomllib.loads(out.read_text())["calibration"]
    assert cal["host_others_share"] >= 0.4
    assert any(w.startswith("other processes took") for w in cal["warnings"])
