"""Ctrl-C and SIGTERM during record and replay: exit 130/143, one line, nothing half-written."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SHARED_TRACES

ROOT = Path(__file__).resolve().parents[1]


def _run_and_signal(args, sig, tmp_path, after_s=2.0):
    p = subprocess.Popen([sys.executable, "-m", "kvemu.cli", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    assert p.poll() is None, "the command finished before it could be interrupted"
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    return p.returncode, err


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_record_leaves_nothing(tmp_path, sig, code):
    src = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    if not src.exists():
        pytest.skip(f"{src} not present")
    rc, err = _run_and_signal(["record", "--workload", f"mooncake:{src}", "--model", "llama3-70b",
                               "--out", "t.parquet"], sig, tmp_path)
    assert rc == code, err
    assert "interrupted by" in err and "t.parquet" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_replay_leaves_nothing(tmp_path, sig, code):
    trace = ROOT / "traces" / "chat-llama3-8b-resident.parquet"
    rc, err = _run_and_signal(["replay", str(trace), "--backend", "dram", "--layers", "8", "--out", "r.parquet"],
                              sig, tmp_path, after_s=3.0)
    assert rc == code, err
    assert "interrupted by" in err and "r.parquet" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_interrupted_uring_replay_removes_its_tier_file(tmp_path):
    """SIGTERM mid-replay: no results, and the tier file kvemu created is unlinked on the way out."""
    trace = ROOT / "traces" / "chat-llama3-8b-resident.parquet"
    disk = Path("/var/tmp") if Path("/var/tmp").is_dir() else tmp_path
    tier = disk / f"kvemu-interrupt-{tmp_path.name}.bin"
    p = subprocess.Popen([sys.executable, "-m", "kvemu.cli", "replay", str(trace), "--backend", f"uring:{tier},qd=8",
                          "--layers", "2", "--out", "r.parquet"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not tier.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if p.poll() is not None:
        err = p.communicate()[1]
        if "unavailable" in err:
            pytest.skip(err.strip())
        pytest.fail(f"replay ended before it could be interrupted: {err}")
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    assert not tier.exists()
    assert list(tmp_path.iterdir()) == []
