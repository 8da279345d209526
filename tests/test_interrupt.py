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
