"""Faults of the real components (issue 44, item 4): a Mooncake master killed mid-replay and a Dask
scheduler killed mid-sweep each end in one line naming the component and what survives, exit 2, no
traceback, nothing half-written; the component's own logs go to a file that line names.

Real processes, no mocks: the test starts the run, watches for the first work done, and SIGKILLs the
component. Each skips where its component is not installed (Mooncake is not in the test extras)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_backend_mooncake import _children_named  # the test's own view of /proc

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"


def _env(tmp: Path) -> dict:
    # TMPDIR: whatever kvemu keeps (the logs of a failed run) lands under the test's folder
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}


def assert_one_line_failure(line: str, *fragments: str) -> None:
    """``line`` is an error line holding every fragment (tests/test_errors_doc.py finds them in
    docs/errors.md)."""
    assert line.startswith("Error: ") and "\n" not in line, line
    for f in fragments:
        assert f in line, (f, line)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()


# ------------------------------------------------------------------------------------- Mooncake
def _store_importable() -> bool:
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _store_importable(), reason="Mooncake Store client not importable")
def test_a_mooncake_master_killed_mid_replay_is_one_line_with_its_logs_kept(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "r.parquet"
    p = subprocess.Popen([sys.executable, "-m", "kvemu", "replay", str(TRACE), "--backend", "mooncake:allow_exposed=1",
                          "--layers", "32", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=_env(tmp))
    master = None
    try:
        # the master is up and the client set up (its log file made); a moment later stores and loads
        # are going through the store (32 layers: a replay of one ended within that moment once the
        # closed loop got faster, and the kill then came after it)
        deadline = time.monotonic() + 120
        while master is None and p.poll() is None and time.monotonic() < deadline:
            for pid in _children_named("mooncake_master", p.pid):
                if (Path(os.readlink(f"/proc/{pid}/cwd")) / "client.log").exists():
                    master = pid
            time.sleep(0.02)
        if master is not None:
            time.sleep(0.5)
            os.kill(master, signal.SIGKILL)
        _, rest = p.communicate(timeout=120)
    finally:
        _stop(p)
    assert master is not None, rest
    lines = [ln for ln in rest.replace("\r", "\n").splitlines()
             if ln.strip() and not ln.startswith("replay: ")]
    assert p.returncode == 2, lines
    assert "Traceback" not in rest
    # the client's own log lines (glog: E1207 12:00:00.123 ...) reach no terminal
    assert not [ln for ln in lines if re.match(r"[EWIF]\d{4} ", ln)], lines
    errors = [ln for ln in lines if ln.startswith("Error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    line = errors[0]
    assert_one_line_failure(line, "exited with signal 9 (SIGKILL) mid-run while replaying steps ",
                            "; nothing was written; rerun the command; its log: ", "; the store client's log: ")
    assert f"the Mooncake master (mooncake_master, pid {master}) exited" in line
    logs = re.search(r"its log: (\S+); the store client's log: (\S+)$", line)
    assert logs, line
    master_log, client_log = Path(logs[1]), Path(logs[2])
    assert master_log.parent == client_log.parent and master_log.parent.parent == tmp
    assert master_log.stat().st_size > 0  # the master's own start-up lines
    assert "RPC_FAIL" in client_log.read_text() or "master" in client_log.read_text().lower()
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))
    # the kept logs are all that is left: no run folder; the next run does not remove them
    assert sorted(x.name for x in tmp.iterdir()) == [master_log.parent.name]
    assert master_log.parent.name.startswith("kvemu-mooncake-logs-")
    from kvemu.stores.mooncake import remove_stale_folders

    assert remove_stale_folders(str(tmp)) == [] and master_log.exists()


# ----------------------------------------------------------------------------------------- Dask
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


SPEC = """
[sweep]
name = "faults"
repetitions = 1
[[trace]]
path = "{trace}"
[backends]
use = ["vemu:cxl-pool"]
[grid]
replay_layers = [1]
requests = ["0:16", "16:32", "32:48", "48:64", "64:80", "80:96"]
"""


def test_a_dask_scheduler_killed_mid_sweep_is_one_line_and_finished_cells_are_kept(tmp_path):
    pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    dask = shutil.which("dask")
    if dask is None:
        pytest.skip("no dask command")
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(trace=TRACE))
    out = tmp_path / "out"
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = _env(tmp_path)
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    sched = subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"], **quiet)
    worker = subprocess.Popen([dask, "worker", address, "--nthreads", "1", "--no-dashboard", "--host", "127.0.0.1",
                               "--preload", "kvemu.sweep"],
                              **quiet)
    p = None
    try:
        p = subprocess.Popen([sys.executable, "-m", "kvemu", "sweep", str(spec), "--out", str(out), "--executor",
                              f"dask://127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT, env=env)
        # kill the scheduler once the first cell's results are in (cells run one at a time, on one thread)
        deadline = time.monotonic() + 180
        while p.poll() is None and time.monotonic() < deadline:
            if any(out.rglob("results.parquet")):
                sched.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        err: list[str] = []
        rest = p.communicate(timeout=120)[1]
        p.wait(120)
    finally:
        for q in (p, worker, sched):
            if q is not None:
                _stop(q)
    text = "".join(err) + rest
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip() and not re.match(r"sweep: \d+/6", ln)]
    assert p.returncode == 2, text
    assert "Traceback" not in text and "distributed." not in text, text
    finished = sorted(out.rglob("results.parquet"))
    assert 1 <= len(finished) < 6
    errors = [ln for ln in lines if ln.startswith("Error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    line = errors[0]
    assert_one_line_failure(line, "stopped answering mid-sweep (its connection was lost); ",
                            "(finished cells are skipped) once a scheduler is up there; Dask's log: ")
    assert f"the Dask scheduler at {address} stopped answering mid-sweep" in line, line
    assert line.endswith(f"Dask's log: {out / 'dask-client.log'}") and (out / "dask-client.log").stat().st_size > 0
    assert f"{len(finished)} of 6 cells finished (their results are kept in {out})" in line, line
    assert f"rerun kvemu sweep {spec} --out {out} --executor dask://127.0.0.1:{port}" in line, line
    assert "to run the other" in line
    # no cell is blamed on a worker or the code; no work folder is left
    assert not [ln for ln in lines if "failed" in ln and "worker" in ln], lines
    assert not [x for x in out.rglob("*") if x.name.startswith((".work", ".lock")) or x.suffix == ".tmp"]
