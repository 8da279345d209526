"""Ctrl-C, SIGTERM and SIGHUP during record and replay: exit 130/143/129, one line, nothing
half-written, also from inside a C call that would wait for minutes."""

import errno
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvemu.errors import BackendError

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


@pytest.mark.parametrize("sig,code,name", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGHUP, 129, "SIGHUP")])
def test_interrupted_uring_replay_removes_its_tier_file(tmp_path, sig, code, name):
    """SIGTERM or SIGHUP (a closed terminal) mid-replay: no results, and the tier file kvemu created
    is unlinked on the way out."""
    trace = ROOT / "traces" / "chat-llama3-8b-resident.parquet"
    disk = Path("/var/tmp") if Path("/var/tmp").is_dir() else tmp_path
    tier = disk / f"kvemu-interrupt-{tmp_path.name}.bin"
    p = subprocess.Popen([sys.executable, "-m", "kvemu.cli", "replay", str(trace), "--backend", f"uring:{tier},qd=8",
                          "--layers", "2", "--out", "r.parquet"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    deadline = time.time() + 30
    while not tier.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if p.poll() is not None:
        err = p.communicate()[1]
        if "unavailable" in err:
            pytest.skip(err.strip())
        pytest.fail(f"replay ended before it could be interrupted: {err}")
    time.sleep(1.0)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    assert f"interrupted by {name}" in err and "r.parquet" in err and "Traceback" not in err
    assert not tier.exists()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------- long C calls: cancelled within 100 ms of waiting

# The slowest profile the bounds allow (10 ms per access, one at a time): one kv_replay batch of
# 256 accesses waits 2.56 s in C, and the trace's replay would take hours.
SLOW = "emu:nvme,latency_ns=10000000,concurrency=1,overhead_ns=0"


def _slow_load_args(n_steps=64, per_step=64):
    from kvemu.backends import ENTRY_DTYPE, STEP_DTYPE

    n_slots = per_step
    entries = np.zeros(n_steps, ENTRY_DTYPE)
    entries["load_count"] = per_step
    steps = np.zeros(n_steps, STEP_DTYPE)
    steps["entry_begin"] = np.arange(n_steps)
    steps["entry_end"] = np.arange(1, n_steps + 1)
    return (np.array([0, n_slots], np.uint64), np.arange(n_slots, dtype=np.uint32), steps, entries,
            np.ones(1, np.uint32))


def _cancelled_replay(from_main_thread: bool) -> tuple[float, BaseException]:
    """A replay of 4096 accesses at 10 ms (41 s), cancelled from another thread after 0.3 s."""
    from kvemu.backends import Backend

    out: dict = {}

    def replay(b):
        t0 = time.perf_counter()
        try:
            b.replay(*_slow_load_args())
        except BaseException as e:  # noqa: BLE001
            out["exc"] = e
        out["s"] = time.perf_counter() - t0

    with Backend(SLOW) as b:
        b.prepare(4096, 64, 1, 1, False)
        timer = threading.Timer(0.3, b.cancel)
        timer.start()
        if from_main_thread:
            replay(b)
        else:
            t = threading.Thread(target=replay, args=(b,))
            t.start()
            t.join(30)
        timer.join()
        # a cancelled context stays cancelled: the next long call ends at its first check
        with pytest.raises(BackendError, match="cancelled"):
            b.replay(*_slow_load_args(n_steps=1))
    return out["s"], out.get("exc")


@pytest.mark.parametrize("from_main_thread", [True, False], ids=["main-thread", "worker-thread"])
def test_kv_cancel_ends_an_emulated_wait_within_100ms(from_main_thread):
    took, exc = _cancelled_replay(from_main_thread)
    assert isinstance(exc, BackendError) and exc.errno == errno.EINTR, exc
    assert "emu: cancelled" in str(exc)
    # 0.3 s until the cancel, then at most one poll of the wait (the bound is 100 ms; C polls
    # every round of its busy-wait) and the hand-back; 0.5 s leaves 200 ms for a loaded host
    assert 0.25 <= took < 0.5, took  # (the timer starts just before the clock)


def test_kv_cancel_ends_a_chase():
    from kvemu.backends import Backend

    with Backend(SLOW) as b:
        b.prepare(4096, 64, 1, 1, False)
        threading.Timer(0.3, b.cancel).start()
        t0 = time.perf_counter()
        with pytest.raises(BackendError, match="emu: cancelled") as info:
            b.chase(10_000)  # 100 s of hops
        assert info.value.errno == errno.EINTR
        assert time.perf_counter() - t0 < 0.5


def _start_slow_replay(tmp_path, preexec_fn=None, prelude=""):
    trace = ROOT / "traces" / "chat-llama3-8b-resident.parquet"
    code = f"import sys\n{prelude}\nfrom kvemu.cli import main\nsys.argv = ['kvemu'] + sys.argv[1:]\nmain()\n"
    p = subprocess.Popen([sys.executable, "-c", code, "replay", str(trace), "--backend", SLOW,
                          "--layers", "1", "--out", "r.parquet"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    # start-up (imports, reading the trace, the arena) is well under 4 s; then every C call waits
    # seconds, and the replay would take hours
    time.sleep(4.0)
    assert p.poll() is None, p.communicate()[1]
    return p


# The wakeup fd taken before kvemu starts (as an asyncio loop in the main thread takes it): the
# Backend then makes its C calls on a call thread of its own and cancels them itself.
TAKEN_WAKEUP_FD = "import os, signal\nr, w = os.pipe()\nos.set_blocking(w, False)\nsignal.set_wakeup_fd(w)"


@pytest.mark.parametrize("sig,code,name,prelude", [
    (signal.SIGINT, 130, "SIGINT", ""), (signal.SIGTERM, 143, "SIGTERM", ""), (signal.SIGHUP, 129, "SIGHUP", ""),
    (signal.SIGINT, 130, "SIGINT", TAKEN_WAKEUP_FD), (signal.SIGTERM, 143, "SIGTERM", TAKEN_WAKEUP_FD)])
def test_a_signal_ends_a_slow_emulated_replay_within_a_second(tmp_path, sig, code, name, prelude):
    """Inside one kv_replay call of minutes, a signal still ends the command within a second: the
    wakeup-fd watcher cancels the call, or the call thread's waiter where the wakeup fd is taken."""
    p = _start_slow_replay(tmp_path, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
                           prelude=prelude)
    t0 = time.perf_counter()
    p.send_signal(sig)
    try:
        _, err = p.communicate(timeout=10)
    finally:
        p.kill()
    took = time.perf_counter() - t0
    assert p.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: interrupted by {name}; discarded: ") \
        and "r.parquet" in lines[0], err
    assert list(tmp_path.iterdir()) == []
    # the signal is seen within 100 ms, C returns within 50 ms of the cancel; the rest is the
    # way out (closing the backend, removing the output) and the interpreter's exit
    assert took < 1.0, took


def test_sighup_is_left_ignored_under_nohup(tmp_path):
    """A replay started with SIGHUP ignored (nohup) keeps running when its terminal goes."""
    p = _start_slow_replay(tmp_path, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        p.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert p.poll() is None
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=10)
    finally:
        p.kill()
    assert p.returncode == 143 and "interrupted by SIGTERM" in err
