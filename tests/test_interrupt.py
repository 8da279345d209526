"""Signals during record and replay: exit 128 + the signal's number (130 SIGINT, 143 SIGTERM, 129
SIGHUP, 152 SIGXCPU, 138 SIGUSR1), one line, nothing half-written, tier files removed, also from
inside a C call that would wait for minutes and from the command's first instant.

Each child starts with every signal at its default (a test run in the background inherits SIGINT
ignored), says when it got so far (kvemu.interrupt.READY_FILE_ENV) before it is signalled, and is
killed in a finally whatever the test's outcome. Time limits scale with how long this host took
to import the command in the same test."""

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvemu.errors import BackendError
from kvemu.interrupt import ENDING_SIGNALS, READY_FILE_ENV

from backend_helpers import load_steps
from conftest import SHARED_TRACES

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "chat-llama3-8b-resident.parquet"
#: Storage tiers (uring, emulated nvme) take offload traces: a resident trace reads its KV in place,
#: which only memory tiers allow. 8 layers of it keep uring busy for seconds after the file appears.
OFFLOAD_ARGS = (ROOT / "traces" / "chat-llama3-8b-offload.parquet", "--layers", "8")
#: The longest a child may take to get to a stage; only a hung child gets near it.
STAGE_LIMIT_S = 180.0


def _default_signals() -> None:
    """The child's preexec_fn: every signal kvemu handles at its default and none blocked."""
    for s in ENDING_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


class _Child:
    """A kvemu command in a subprocess, run in ``tmp_path/work``."""

    def __init__(self, args, tmp_path, code=None, preexec_fn=_default_signals):
        self.work = tmp_path / "work"
        self.work.mkdir()
        self.ready = tmp_path / "ready"
        self.stages: dict[str, float] = {}
        argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "kvemu"]
        self.t0 = time.perf_counter()
        self.p = subprocess.Popen([*argv, *map(str, args)], cwd=self.work, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn,
                                  env={**os.environ, READY_FILE_ENV: str(self.ready),
                                       # the kvemu this test imported, whatever the child's folder
                                       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})

    def wait_for(self, stage: str) -> float:
        """Seconds from the start until the child reported ``stage`` ("handlers", "command")."""
        while stage not in self.stages:
            lines = self.ready.read_text().split() if self.ready.exists() else []
            for s in lines:
                self.stages.setdefault(s, time.perf_counter() - self.t0)
            if stage in self.stages:
                break
            if self.p.poll() is not None:
                err = self.p.communicate()[1]
                if "unavailable" in err:
                    pytest.skip(err.strip())
                pytest.fail(f"the command ended before it got to {stage!r}: {err}")
            if time.perf_counter() - self.t0 > STAGE_LIMIT_S:
                pytest.fail(f"the command did not get to {stage!r} in {STAGE_LIMIT_S:.0f} s")
            time.sleep(0.005)
        return self.stages[stage]

    @property
    def import_s(self) -> float:
        """How long this host took to import the command (handlers to command start): the scale of
        this test's waits."""
        return max(self.wait_for("command") - self.wait_for("handlers"), 0.05)

    def interrupt(self, sig) -> tuple[int, str, float]:
        """Sends sig; (exit code, stderr, seconds from the signal to the exit)."""
        assert self.p.poll() is None, f"the command ended before it could be interrupted: {self.p.communicate()[1]}"
        t = time.perf_counter()
        self.p.send_signal(sig)
        _, err = self.p.communicate(timeout=60 + 20 * self.stage_scale())
        return self.p.returncode, err, time.perf_counter() - t

    def stage_scale(self) -> float:
        return self.import_s if "command" in self.stages else 1.0

    def left(self) -> list:
        return sorted(self.work.iterdir())


@contextlib.contextmanager
def _child(args, tmp_path, **kw):
    c = _Child(args, tmp_path, **kw)
    try:
        yield c
    finally:
        if c.p.poll() is None:
            c.p.kill()
        c.p.communicate()


def _wait_for_tier_file(c, tier, before: str) -> None:
    """Until the replay child ``c`` created its tier file ``tier`` (skips where the backend is
    unavailable; fails when the child ended first or took longer than STAGE_LIMIT_S)."""
    while not tier.exists() and c.p.poll() is None and time.perf_counter() - c.t0 < STAGE_LIMIT_S:
        time.sleep(0.01)
    if c.p.poll() is not None:
        err = c.p.communicate()[1]
        if "unavailable" in err:
            pytest.skip(err.strip())
        pytest.fail(f"replay ended before {before}: {err}")


#: A progress line (kvemu/progress.py: stderr not a terminal, one every ten seconds): a child slowed
#: by a loaded host prints some before the signal; they are not part of the interruption's line.
PROGRESS = re.compile(r"^[\w .-]+: [\d,]+(/[\d,]+)? .*[\d,.]+ \S+/s$")


def _one_interrupted_line(err: str, name: str, discarded: str | None = None) -> str:
    lines = [ln for ln in err.strip().splitlines() if not PROGRESS.match(ln.strip())]
    assert len(lines) == 1 and lines[0].startswith(f"Error: interrupted by {name}; discarded: "), err
    assert "Traceback" not in err
    if discarded:
        assert discarded in lines[0], err
    return lines[0]


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_record_leaves_nothing(tmp_path, sig, code):
    src = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    if not src.exists():
        pytest.skip(f"{src} not present")
    with _child(["record", "--workload", f"mooncake:{src}", "--model", "llama3-70b", "--out", "t.parquet"],
                tmp_path) as c:
        time.sleep(2 * c.import_s)  # into the recording
        rc, err, _ = c.interrupt(sig)
    assert rc == code, err
    _one_interrupted_line(err, signal.Signals(sig).name, "t.parquet")
    assert c.left() == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_replay_leaves_nothing(tmp_path, sig, code):
    with _child(["replay", TRACE, "--backend", "dram", "--layers", "8", "--out", "r.parquet"], tmp_path) as c:
        time.sleep(4 * c.import_s)  # into the replay
        rc, err, _ = c.interrupt(sig)
    assert rc == code, err
    _one_interrupted_line(err, signal.Signals(sig).name, "r.parquet")
    assert c.left() == []


def _tier_backend(kind: str, tmp_path) -> tuple[str, Path, tuple]:
    """(backend spec, the tier file it creates, the trace and layers to replay on it)."""
    if kind == "uring":
        disk = Path("/var/tmp") if Path("/var/tmp").is_dir() else tmp_path
        tier = disk / f"kvemu-interrupt-{tmp_path.name}.bin"
        return f"uring:{tier},qd=8", tier, OFFLOAD_ARGS
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm here")
    tier = Path("/dev/shm") / f"kvemu-interrupt-{tmp_path.name}.bin"
    return f"mmap:{tier}", tier, (TRACE, "--layers", "2")


@pytest.mark.parametrize("kind,sig", [
    ("uring", signal.SIGTERM), ("uring", signal.SIGHUP), ("uring", signal.SIGXCPU), ("uring", signal.SIGUSR1),
    ("uring", signal.SIGUSR2), ("mmap", signal.SIGXCPU), ("mmap", signal.SIGUSR1), ("mmap", signal.SIGUSR2)])
def test_a_signal_mid_replay_removes_the_tier_file(tmp_path, kind, sig):
    """SIGTERM, SIGHUP (a closed terminal), SIGXCPU (a batch system's soft CPU limit), SIGUSR1/2 in
    a replay on a tier file kvemu created: no results, the file unlinked on the way out."""
    spec, tier, trace = _tier_backend(kind, tmp_path)
    try:
        with _child(["replay", trace[0], "--backend", spec, *trace[1:], "--out", "r.parquet"], tmp_path) as c:
            scale = c.import_s
            _wait_for_tier_file(c, tier, "it could be interrupted")
            time.sleep(scale)  # past creating the file: pre-faulting it, or replaying
            rc, err, _ = c.interrupt(sig)
        assert rc == 128 + sig, err
        _one_interrupted_line(err, signal.Signals(sig).name, "r.parquet")
        assert not tier.exists()
        assert c.left() == []
    finally:
        tier.unlink(missing_ok=True)  # a failed test leaves no 1 GB file either


@pytest.mark.parametrize("kind", ["uring", "mmap"])
def test_a_sigpipe_mid_replay_is_ignored_and_the_tier_file_still_removed(tmp_path, kind):
    """SIGPIPE stays ignored (kvemu.interrupt): sent while a tier file exists, the replay goes on to
    its results and removes the file it created, as without the signal."""
    spec, tier, _ = _tier_backend(kind, tmp_path)
    trace = OFFLOAD_ARGS  # offload: no reads in place, so a few seconds on either tier
    try:
        with _child(["replay", trace[0], "--backend", spec, *trace[1:], "--requests", "0:4", "--out", "r.parquet"],
                    tmp_path) as c:
            scale = c.import_s
            _wait_for_tier_file(c, tier, "the signal")
            c.p.send_signal(signal.SIGPIPE)
            out, err = c.p.communicate(timeout=STAGE_LIMIT_S + 20 * scale)
        assert c.p.returncode == 0, err
        assert out.startswith("wrote r.parquet") and "Traceback" not in err
        assert not tier.exists()
        assert [p.name for p in c.left()] == ["r.parquet"]
    finally:
        tier.unlink(missing_ok=True)


def test_a_closed_stdout_during_a_tier_file_replay_removes_the_file(tmp_path):
    """`kvemu replay ... | head -0`: the results are written, the line about them is not (exit 141, as
    SIGPIPE's death), and the tier file kvemu created is removed on the way out."""
    spec, tier, _ = _tier_backend("mmap", tmp_path)
    trace = OFFLOAD_ARGS
    try:
        with _child(["replay", trace[0], "--backend", spec, *trace[1:], "--requests", "0:4", "--out", "r.parquet"],
                    tmp_path) as c:
            c.p.stdout.close()
            _, err = c.p.communicate(timeout=STAGE_LIMIT_S + 20 * c.import_s)
        assert c.p.returncode == 141, err
        assert "Traceback" not in err
        assert not tier.exists()
        assert [p.name for p in c.left()] == ["r.parquet"]
    finally:
        tier.unlink(missing_ok=True)


def test_signals_during_the_way_out_are_ignored(tmp_path):
    """A batch system's SIGXCPU, then its SIGTERM, then an impatient Ctrl-C: one of them ends the
    replay, the others cannot cut its cleanup short."""
    spec, tier, trace = _tier_backend("mmap", tmp_path)
    try:
        with _child(["replay", trace[0], "--backend", spec, *trace[1:], "--out", "r.parquet"], tmp_path) as c:
            scale = c.import_s
            while not tier.exists() and c.p.poll() is None and time.perf_counter() - c.t0 < STAGE_LIMIT_S:
                time.sleep(0.01)
            time.sleep(scale)
            assert c.p.poll() is None, c.p.communicate()[1]
            c.p.send_signal(signal.SIGXCPU)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGINT):
                time.sleep(0.01)  # one at a time: pending together, the kernel delivers SIGINT first
                c.p.send_signal(sig)
            _, err = c.p.communicate(timeout=60 + 20 * scale)
            rc = c.p.returncode
        # the one reported: the first Python handled (signals pending together are handled in
        # the order of their numbers)
        name = {128 + s: s.name for s in (signal.SIGXCPU, signal.SIGTERM, signal.SIGINT)}.get(rc)
        assert name, (rc, err)
        _one_interrupted_line(err, name, "r.parquet")
        assert not tier.exists()
        assert c.left() == []
    finally:
        tier.unlink(missing_ok=True)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGXCPU])
def test_a_signal_at_the_first_instant_is_one_line(tmp_path, sig):
    """Sent the moment the handlers are in, before the imports that take most of the first second:
    the same one line and exit code, no traceback."""
    with _child(["replay", TRACE, "--backend", "dram", "--layers", "2", "--out", "r.parquet"], tmp_path) as c:
        c.wait_for("handlers")
        rc, err, _ = c.interrupt(sig)
    assert rc == 128 + sig, err
    _one_interrupted_line(err, signal.Signals(sig).name)
    assert c.left() == []


def test_a_closed_stdout_is_a_quiet_exit(tmp_path):
    """`kvemu trace info T | head -0`: the reader is gone before the first line; no traceback, no
    line, exit 141 (128 + SIGPIPE) as a program killed by SIGPIPE would have."""
    with _child(["trace", "info", TRACE], tmp_path) as c:
        c.p.stdout.close()
        _, err = c.p.communicate(timeout=60 + 20 * c.import_s)
    assert c.p.returncode == 141, err
    assert err == ""


# ------------------------------------------------- long C calls: cancelled within 100 ms of waiting

# The slowest memory tier the bounds allow (10 ms per access, one at a time): one kv_replay batch of
# 256 accesses waits 2.56 s in C, and the trace's replay would take hours. A memory profile, since the
# resident trace reads in place, which storage tiers refuse.
SLOW = "emu:cxl-pool,latency_ns=10000000,concurrency=1,overhead_ns=0"


def _slow_load_args(n_steps=64, per_step=64):
    return load_steps(n_steps, per_step)


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


def _slow_replay(tmp_path, prelude="", preexec_fn=_default_signals):
    """The kvemu command (after ``prelude``) replaying on SLOW, in its first C call once it returns."""
    code = f"import sys\n{prelude}\nfrom kvemu.__main__ import main\nmain()\n"
    c = _Child(["replay", TRACE, "--backend", SLOW, "--layers", "1", "--out", "r.parquet"], tmp_path, code=code,
               preexec_fn=preexec_fn)
    try:
        # reading the trace and preparing the arena take a few times the imports; then every C
        # call waits seconds, and the replay would take hours
        time.sleep(4 * c.import_s)
    except BaseException:
        c.p.kill()
        c.p.communicate()
        raise
    return c


# The wakeup fd taken before kvemu starts (as an asyncio loop in the main thread takes it): the
# Backend then makes its C calls on a call thread of its own and cancels them itself.
TAKEN_WAKEUP_FD = "import os, signal\nr, w = os.pipe()\nos.set_blocking(w, False)\nsignal.set_wakeup_fd(w)"


@pytest.mark.parametrize("sig,prelude", [
    (signal.SIGINT, ""), (signal.SIGTERM, ""), (signal.SIGHUP, ""), (signal.SIGXCPU, ""), (signal.SIGUSR2, ""),
    (signal.SIGINT, TAKEN_WAKEUP_FD), (signal.SIGTERM, TAKEN_WAKEUP_FD)])
def test_a_signal_ends_a_slow_emulated_replay_within_a_second(tmp_path, sig, prelude):
    """Inside one kv_replay call of minutes, a signal still ends the command within a second: the
    wakeup-fd watcher cancels the call, or the call thread's waiter where the wakeup fd is taken."""
    c = _slow_replay(tmp_path, prelude=prelude)
    try:
        rc, err, took = c.interrupt(sig)
    finally:
        c.p.kill()
        c.p.communicate()
    assert rc == 128 + sig, err
    _one_interrupted_line(err, signal.Signals(sig).name, "r.parquet")
    assert c.left() == []
    # the signal is seen within 100 ms, C returns within 50 ms of the cancel; the rest is the way
    # out (closing the backend, removing the output) and the interpreter's exit, which a busy host
    # slows as it slowed the imports (about 0.6 s on an idle one)
    assert took < max(1.0, 1.5 * c.import_s), (took, c.import_s)


def test_sighup_is_left_ignored_under_nohup(tmp_path):
    """A replay started with SIGHUP ignored (nohup) keeps running when its terminal goes."""

    def nohup():
        _default_signals()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    c = _slow_replay(tmp_path, preexec_fn=nohup)
    try:
        c.p.send_signal(signal.SIGHUP)
        time.sleep(max(1.0, c.import_s))
        assert c.p.poll() is None
        rc, err, _ = c.interrupt(signal.SIGTERM)
    finally:
        c.p.kill()
        c.p.communicate()
    assert rc == 143 and "interrupted by SIGTERM" in err
