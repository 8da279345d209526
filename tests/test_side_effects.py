"""What a Backend leaves of the process it runs in, seen by a library caller: the thread's CPU
affinity as it was, no signal wakeup fd installed once the last Backend is closed (and a caller's
own never replaced), and after a signal that cancelled a C call, Backends that work."""
import errno
import os
import signal
import threading
import time

import pytest

from backend_helpers import load_steps, replay_one
from kvemu.backends import Backend
from kvemu.errors import BackendError

BLOCK = 1 << 20
POOLED = "dram:hugepages=0,workers=2"
# 10 ms per access, one at a time: one kv_replay batch of 256 loads waits 2.56 s in C
SLOW = "emu:nvme,latency_ns=10000000,concurrency=1,overhead_ns=0"

needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                    reason="a transfer pool needs two CPUs this process may use")


def _prepared(spec=POOLED, n_slots=4):
    b = Backend(spec)
    b.prepare(BLOCK, n_slots, 2, 2, False)
    return b


def _slow_loads(n_steps, per_step=64):
    return load_steps(n_steps, per_step)


def _slow_backend():
    b = Backend(SLOW)
    b.prepare(4096, 64, 1, 1, False)
    return b


def _loads_moved(b) -> int:
    return b.op_stats("load")["accesses"]


@pytest.fixture
def sigint_raises():
    """SIGINT as a Python program starts with it (KeyboardInterrupt), also where the test run
    inherited it ignored (a background job)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _kill_later(delay_s: float, sig=signal.SIGINT) -> threading.Timer:
    t = threading.Timer(delay_s, os.kill, (os.getpid(), sig))
    t.start()
    return t


# ------------------------------------------------------------------------------ CPU affinity

@needs_two_cpus
def test_affinity_is_the_callers_again_after_close():
    mask = os.sched_getaffinity(0)
    b = Backend(POOLED)
    assert os.sched_getaffinity(0) == mask  # opening pins nothing
    b.prepare(BLOCK, 4, 2, 2, False)
    # documented: while the pool runs, its caller is worker 0, pinned to one CPU of its set
    assert len(os.sched_getaffinity(0)) == 1 and os.sched_getaffinity(0) <= mask
    assert b.describe()["workers"] == 2
    replay_one(b, 1, "load")
    replay_one(b, 2, "store")
    b.close()
    assert os.sched_getaffinity(0) == mask


@needs_two_cpus
@pytest.mark.parametrize("first_closed", ["first", "second"])
def test_overlapping_pools_on_one_thread_restore_the_mask_once_both_close(first_closed):
    mask = os.sched_getaffinity(0)
    a = _prepared()
    b = _prepared()
    # the second sees the caller's own CPUs, not the first one's pinning
    assert b.describe()["workers"] == 2
    replay_one(a, 1, "load")
    replay_one(b, 1, "load")
    one, other = (a, b) if first_closed == "first" else (b, a)
    one.close()
    assert len(os.sched_getaffinity(0)) == 1  # the other pool still runs on this thread
    replay_one(other, 2, "load")
    other.close()
    assert os.sched_getaffinity(0) == mask


@needs_two_cpus
def test_a_pool_closed_from_another_thread_restores_its_callers_mask():
    out = {}
    made = threading.Event()
    closed = threading.Event()

    def caller():
        out["before"] = os.sched_getaffinity(0)
        out["b"] = _prepared()
        out["tid"] = threading.get_native_id()
        made.set()
        closed.wait(30)
        out["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=caller)
    t.start()
    try:
        assert made.wait(30)
        assert len(os.sched_getaffinity(out["tid"])) == 1
        out["b"].close()  # here, on the main thread
    finally:
        closed.set()
        t.join(30)
    assert out["after"] == out["before"]


@needs_two_cpus
def test_a_failed_prepare_leaves_the_mask_as_it_was():
    mask = os.sched_getaffinity(0)
    with Backend(POOLED) as b:
        with pytest.raises(Exception):
            b.prepare(BLOCK, 1 << 40, 2, 2, False)  # far more than memory: refused
        assert os.sched_getaffinity(0) == mask
    assert os.sched_getaffinity(0) == mask


# ------------------------------------------------------------------------------ wakeup fd

def _watcher_running() -> bool:
    return any(t.name == "kvemu-signals" and t.is_alive() for t in threading.enumerate())


def test_no_wakeup_fd_is_left_installed():
    with Backend("dram:hugepages=0") as b:
        b.prepare(BLOCK, 4, 2, 2, False)
        replay_one(b, 1, "load")
        # between C calls nothing is installed either: set_wakeup_fd(-1) replaces -1 by -1
        assert signal.set_wakeup_fd(-1) == -1
        assert _watcher_running()
    assert signal.set_wakeup_fd(-1) == -1
    assert not _watcher_running()
    # and a later Backend watches again
    with Backend("dram:hugepages=0") as b:
        b.prepare(BLOCK, 4, 2, 2, False)
        replay_one(b, 1, "load")
        assert _loads_moved(b) == 2
    assert signal.set_wakeup_fd(-1) == -1


def test_the_callers_own_wakeup_fd_is_never_replaced(sigint_raises):
    r, w = os.pipe()
    os.set_blocking(w, False)
    os.set_blocking(r, False)
    signal.set_wakeup_fd(w)
    try:
        with Backend("dram:hugepages=0") as b:
            b.prepare(BLOCK, 4, 2, 2, False)
            replay_one(b, 1, "load")
            assert signal.set_wakeup_fd(w) == w
        # a Backend opened before the caller installs its fd: its calls leave that fd alone too
        signal.set_wakeup_fd(-1)
        with Backend("dram:hugepages=0") as b:
            signal.set_wakeup_fd(w)
            b.prepare(BLOCK, 4, 2, 2, False)
            replay_one(b, 1, "load")
            assert signal.set_wakeup_fd(w) == w
        # a signal in a C call still ends it (the Backend waits on a call thread of its own) and
        # reaches the caller's fd
        with _slow_backend() as b:
            t0 = time.perf_counter()
            timer = _kill_later(0.3)
            with pytest.raises(KeyboardInterrupt):
                b.replay(*_slow_loads(16))
            took = time.perf_counter() - t0
            timer.join()
        assert took < 2.0, took  # the first batch alone would wait 2.56 s
        assert signal.SIGINT in os.read(r, 64)
    finally:
        assert signal.set_wakeup_fd(-1) == w
        os.close(r)
        os.close(w)


# ------------------------------------------------------------------------------ after a signal

def test_a_sigint_in_a_c_call_cancels_it_and_later_backends_work(sigint_raises):
    with _prepared("dram:hugepages=0") as idle:
        slow = _slow_backend()
        try:
            t0 = time.perf_counter()
            timer = _kill_later(0.3)
            with pytest.raises(KeyboardInterrupt):
                slow.replay(*_slow_loads(16))  # 41 s of loads
            took = time.perf_counter() - t0
            timer.join()
            assert took < 2.0, took  # cancelled inside the first batch (2.56 s)
            # the Backend whose call was cancelled stays so (documented): close it, open another
            with pytest.raises(BackendError, match="cancelled") as info:
                slow.replay(*_slow_loads(1))
            assert info.value.errno == errno.EINTR
        finally:
            slow.close()
        # a Backend that was open but not in a call when the signal came is not affected
        replay_one(idle, 1, "load")
        assert _loads_moved(idle) == 2
    # nor is one opened after it: a library caller who caught the KeyboardInterrupt goes on
    with _slow_backend() as b:
        b.replay(*_slow_loads(1, per_step=4))
        assert _loads_moved(b) == 4
    with _prepared("dram:hugepages=0") as b:
        replay_one(b, 1, "store")
        replay_one(b, 1, "load")
        assert _loads_moved(b) == 2
    assert signal.set_wakeup_fd(-1) == -1


def test_a_sigint_between_calls_cancels_nothing(sigint_raises):
    with _prepared("dram:hugepages=0") as b:
        replay_one(b, 1, "load")
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        replay_one(b, 2, "load")
        assert _loads_moved(b) == 4


def test_a_callers_own_signal_handler_does_not_cancel_the_call():
    """A signal a library caller handles itself (here SIGUSR1, counted) is not an interruption:
    the replay it arrives in runs to its end."""
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with _slow_backend() as b:
            timer = _kill_later(0.1, signal.SIGUSR1)
            b.replay(*_slow_loads(1, per_step=40))  # 0.4 s of loads
            timer.join()
            assert _loads_moved(b) == 40
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old)


# ------------------------------------------------------------------ glibc's mmap threshold

_MMAP_PROBE = r"""
import ctypes, sys
from click.testing import CliRunner

libc = ctypes.CDLL(None)


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
SIZE = 30 << 20  # under glibc's largest dynamic threshold (32 MiB on 64-bit)


def mapped_after_a_free():
    # Whether a 30 MiB block gets a mapping of its own after one was freed: glibc's dynamic
    # threshold rises to 30 MiB on that free (the block then comes from the heap); a fixed one
    # does not. The heap's free top is given back first, so that it cannot serve the block.
    libc.free(libc.malloc(SIZE))
    libc.malloc_trim(0)
    before = libc.mallinfo2().hblks
    p = libc.malloc(SIZE)
    mapped = libc.mallinfo2().hblks - before
    libc.free(p)
    return mapped


from kvemu.cli import cli

trace, out = sys.argv[1], sys.argv[2]
runs = {"others": [["analyze", "capacity", trace], ["trace", "info", trace]],
        "replay": [["replay", trace, "--backend", "vemu:nvme", "--requests", "0:2", "--layers", "1", "--out", out]]}
for args in runs[sys.argv[3]]:
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
print(mapped_after_a_free())
"""


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"), reason="glibc >= 2.33 only")
@pytest.mark.parametrize("commands, mapped", [("others", "0"), ("replay", "1")])
def test_only_a_replay_fixes_glibcs_mmap_threshold(tmp_path, commands, mapped):
    """The allocator setting that keeps a replay's memory flat is the replay's alone: importing
    the CLI and running commands that do not replay (analyze capacity, trace info) leave glibc's
    dynamic mmap threshold as it was (a freed large block raises it); `kvemu replay` fixes it at
    128 KiB. In a child process each, so this one's allocator stays as it is."""
    import subprocess
    import sys
    from pathlib import Path

    trace = Path(__file__).resolve().parent.parent / "traces" / "chat-llama3-8b-offload.parquet"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    res = subprocess.run([sys.executable, "-c", _MMAP_PROBE, str(trace), str(tmp_path / "r.parquet"), commands],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == [mapped]
