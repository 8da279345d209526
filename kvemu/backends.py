"""Python face of the C replay core (cbackends/): the only importer of ``kvemu._kvemu_c``.

A :class:`Backend` owns one C context: a tier backend, its arena and staging buffer, a timer and
per-op latency histograms. Batches of steps cross into C as numpy structured arrays whose layouts
are checked against the C structs at import, one ``kv_replay`` call per batch.

Interruptions. Python runs signal handlers in the main thread only, between bytecodes, never
inside a C call, and one ``kv_replay`` on a slow tier can take minutes. But Python's own C-level
handler writes each signal's number to the wakeup fd (``signal.set_wakeup_fd``) the moment the
signal arrives, also while the main thread is inside C. So while the main thread is in a long C
call, a pipe of kvemu's is that fd, and a watcher thread reads it: on SIGINT, SIGTERM or SIGHUP
(and the other signals kvemu.interrupt's handlers turn into exceptions, while they are installed)
it cancels the C call of every Backend in one (``kv_cancel``: the C waits poll for it at least
every 50 ms and return -EINTR). The call returns, the Python-level handler raises its exception
(KeyboardInterrupt, interrupt.Terminated) at the next bytecode, and ``with`` and ``finally``
release the tier as usual. Before each such call the handlers of signals that came earlier run
(their exception is raised there, not after the call), and what they wrote to the pipe is
discarded, so a signal cancels only the calls in flight when it comes. A cancelled Backend stays
so (close it); the others, and every Backend opened later, are unaffected: a library caller that
catches the KeyboardInterrupt goes on with them. Where the wakeup fd is someone else's when a
Backend opens (an asyncio loop in the main thread), that Backend makes its long C calls on a
thread of its own instead, while the main thread waits on a lock, woken by a signal and at least
every 100 ms, and cancels the call itself; a caller's fd installed later is left alone too (those
calls are then not cancelled by a signal).

Side effects. Nothing outlives the Backends: between C calls no wakeup fd of kvemu's is installed,
and when the last Backend closes the watcher thread ends and its pipe is closed; a later Backend
starts them again. The cost is a few microseconds per long C call. A transfer pool (``dram``,
``numa``, ``mmap`` with two workers or more) pins the thread that prepares it to one CPU while the
Backend is prepared; the thread's affinity is put back exactly as it was when the last pool that
pinned it closes (cbackends/xfer.h), in any order and from any thread.
"""
from __future__ import annotations

import ctypes
import errno as _errno
import itertools
import json
import math
import os
import queue
import select
import signal
import threading
import weakref
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kvemu.backend_spec import KINDS, BackendSpec, emulated_backend_args
from kvemu.bounds import LAYOUTS
from kvemu.errors import BackendError, BackendUnavailable, ConfigError
from kvemu.interrupt import ENDING_SIGNALS, interrupts
from kvemu.stores import StoreSession

try:
    from kvemu._kvemu_c import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "kvemu's C extension kvemu._kvemu_c is not built or cannot load "
        f"({exc}); build it with `pip install -e .` or `python cbackends/build_ffi.py`"
    ) from exc

#: Struct layout this module was written against; kvemu.h's KV_ABI_VERSION must match.
ABI_VERSION = 6

OPS = ("load", "store", "read")
KNOWN_BACKENDS = tuple(KINDS)

ENTRY_DTYPE = np.dtype([
    ("req", np.uint32),
    ("load_first", np.uint32), ("load_count", np.uint32),
    ("store_first", np.uint32), ("store_count", np.uint32),
    ("read_first", np.uint32), ("read_count", np.uint32),
])
STEP_DTYPE = np.dtype([("entry_begin", np.uint64), ("entry_end", np.uint64), ("compute_ns", np.int64),
                       ("ready_ns", np.int64)])
STEP_OUT_DTYPE = np.dtype([
    ("step_ns", np.int64), ("load_ns", np.int64), ("store_ns", np.int64), ("read_ns", np.int64),
    ("start_ns", np.int64), ("end_ns", np.int64), ("stall_ns", np.int64),
])
#: Fields of struct kv_timing (kvemu.h): the link model and the composition of KV work.
TIMING_FIELDS = ("load_gbps", "store_gbps", "read_gbps", "setup_ns", "read_latency_ns", "tier_latency_ns",
                 "engines", "outstanding", "line_bytes", "store_mode", "store_inflight_bytes", "staged")
DATAPATH_FIELDS = ("transfers", "bytes", "medium_ns", "link_ns", "time_ns", "medium_bound_ns")
ENTRY_OUT_DTYPE = np.dtype([("load_ns", np.int64), ("store_ns", np.int64), ("read_ns", np.int64)])
#: struct kv_layer (kvemu.h): what one replayed layer caches, and the kinds' codes (KV_LAYER_*).
LAYER_DTYPE = np.dtype([("kind", np.uint32), ("window_tokens", np.uint32), ("block_bytes", np.uint64),
                        ("state_bytes", np.uint64)])
#: struct kv_req: a request's block-table base, full prompt blocks, whether it moves every layer alike,
#: and where its windows of a load end (0: each load range's end; a split load: the whole load's).
REQ_DTYPE = np.dtype([("base_block", np.uint32), ("prompt_blocks", np.uint32), ("all_layers", np.uint32),
                      ("load_end", np.uint32)])
LAYER_KINDS = ("full", "sliding", "chunked", "linear")


@dataclass(frozen=True)
class LayerMoves:
    """What a replay call's layers move (struct kv_layers): ``layers`` (LAYER_DTYPE, one per replayed
    layer), ``reqs`` (REQ_DTYPE, one per request of the call), the block's tokens, the linear layers'
    checkpoint interval in blocks, and whether stores write every block of windowed layers
    (``store_all``: the resident policy)."""

    layers: np.ndarray
    reqs: np.ndarray
    block_tokens: int
    checkpoint_blocks: int
    store_all: bool


#: struct kv_access: one transfer of a batch, as a store's callback sees it.
ACCESS_DTYPE = np.dtype([("arena_off", np.uint64), ("staging_off", np.uint64), ("bytes", np.uint64)])

_STRUCTS = {
    "struct kv_entry": ENTRY_DTYPE,
    "struct kv_step": STEP_DTYPE,
    "struct kv_step_out": STEP_OUT_DTYPE,
    "struct kv_entry_out": ENTRY_OUT_DTYPE,
    "struct kv_access": ACCESS_DTYPE,
    "struct kv_layer": LAYER_DTYPE,
    "struct kv_req": REQ_DTYPE,
}

# errnos meaning "this machine cannot run the backend", which callers skip rather than fail.
_UNAVAILABLE = frozenset({_errno.ENOSYS, _errno.EOPNOTSUPP, _errno.EPERM, _errno.ENODEV})


def _layout_mismatch(ctype: str, dtype: np.dtype) -> str | None:
    """Why ``dtype`` does not mirror ``ctype`` byte for byte, or None when it does."""
    t = ffi.typeof(ctype)
    if ffi.sizeof(t) != dtype.itemsize:
        return f"{ctype} is {ffi.sizeof(t)} bytes, dtype is {dtype.itemsize}"
    c_fields = [(name, f.offset, ffi.sizeof(f.type)) for name, f in t.fields]
    np_fields = [(name, dtype.fields[name][1], dtype.fields[name][0].itemsize) for name in dtype.names]
    if c_fields != np_fields:
        return f"{ctype} fields {c_fields} != dtype fields {np_fields}"
    return None


def _check_abi() -> None:
    if lib.KV_ABI_VERSION != ABI_VERSION:
        raise ImportError(
            f"kvemu._kvemu_c has ABI version {lib.KV_ABI_VERSION}, kvemu/backends.py expects "
            f"{ABI_VERSION}: the extension is stale; rebuild it"
        )
    for ctype, dtype in _STRUCTS.items():
        why = _layout_mismatch(ctype, dtype)
        if why:
            raise ImportError(f"kvemu._kvemu_c layout mismatch: {why}; rebuild the extension")
    kinds = tuple(getattr(lib, f"KV_LAYER_{k.upper()}") for k in LAYER_KINDS)
    if kinds != tuple(range(len(LAYER_KINDS))):
        raise ImportError(f"kvemu._kvemu_c layer kinds {kinds} do not follow {LAYER_KINDS}")
    codes = tuple(getattr(lib, f"KV_OP_{op.upper()}") for op in OPS)
    if codes != tuple(range(len(OPS))) or lib.KV_N_OPS != len(OPS):
        raise ImportError(f"kvemu._kvemu_c op codes {codes} do not follow OPS {OPS}")


_check_abi()

# Store sessions (a kind with ``store``: kvemu/stores/) by number: C names its session in each
# callback, made once per batch of the core (cbackends/store.c, the bridge of every store kind).
_sessions: dict[int, object] = {}
_session_numbers = itertools.count(1)


def _store_failed(session, exc: BaseException) -> int:
    """Keeps the callback's exception for the Backend to raise once C has returned; the errno C reports."""
    if session is not None and session.pending is None:
        session.pending = exc
    return -_errno.EINTR if not isinstance(exc, Exception) else -_errno.EIO


def _store_onerror(exc_type, exc, tb):  # an exception before the callback's own handler took over
    return -_errno.EINTR


@ffi.def_extern(onerror=_store_onerror)
def kv_py_store_prepare(session, staging_addr, staging_bytes, arena_bytes):
    s = _sessions.get(session)
    try:
        s.prepare(staging_addr, staging_bytes, arena_bytes)
        return 0
    except BaseException as e:  # noqa: BLE001 - raised again by Backend once C has returned
        return _store_failed(s, e)


@ffi.def_extern(onerror=_store_onerror)
def kv_py_store_access(session, op, acc, n, lat_ns, busy_ns):
    s = _sessions.get(session)
    try:
        accesses = np.frombuffer(ffi.buffer(acc, n * ACCESS_DTYPE.itemsize), ACCESS_DTYPE)
        ns = s.access(op, accesses)
        np.frombuffer(ffi.buffer(lat_ns, n * 8), np.uint64)[:] = ns  # all issued at once, done by the end
        busy_ns[0] = ns
        return n
    except BaseException as e:  # noqa: BLE001 - raised again by Backend once C has returned
        return _store_failed(s, e)

_OP_CODE = {op: i for i, op in enumerate(OPS)}
_REGION_CODE = {"arena": lib.KV_REGION_ARENA, "staging": lib.KV_REGION_STAGING}


def _check(ctx, rc: int, *, opening: bool = False) -> int:
    """``rc`` when it is >= 0; otherwise the exception that C's errno and message call for.

    While opening, ENOENT (unknown backend) and EINVAL (bad backend options) are the user's
    configuration, not a backend failure.
    """
    if rc >= 0:
        return rc
    err = -rc
    msg = ffi.string(lib.kv_errmsg(ctx)).decode("utf-8", "replace") if ctx else ""
    msg = msg or os.strerror(err)
    if opening and err in (_errno.ENOENT, _errno.EINVAL, _errno.EEXIST):
        raise ConfigError(msg)
    if err in _UNAVAILABLE:
        raise BackendUnavailable(msg, err)
    raise BackendError(msg, err)


def _c_array(arr, dtype: np.dtype, name: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise ConfigError(f"{name} must be a numpy array of {dtype}, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise ConfigError(f"{name} has dtype {arr.dtype}, expected {dtype}")
    if arr.ndim != 1:
        raise ConfigError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ConfigError(f"{name} must be C-contiguous (copy it with np.ascontiguousarray)")
    return arr


def _ptr(ctype: str, arr: np.ndarray, *, writable: bool = False):
    # An empty array has no buffer worth pointing at; C accepts NULL with a zero count.
    if arr.size == 0:
        return ffi.NULL
    return ffi.from_buffer(ctype, arr, require_writable=writable)


def _uint(value, name: str, bits: int, minimum: int = 0) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if v != value or not minimum <= v < 2**bits:
        raise ConfigError(f"{name} must be an integer in [{minimum}, 2**{bits}), got {value!r}")
    return v


#: The main thread's longest wait for a C call between checks for a signal (s).
CALL_POLL_S = 0.1
# Signals the interrupt handlers turn into exceptions: a C call thread blocks them, so the kernel
# delivers them to the main thread, whose wait they interrupt at once.
_HANDLED_SIGNALS = set(ENDING_SIGNALS)
# Runs the Python handlers of signals that came, now (a handler's exception is raised here).
_run_signal_handlers = ctypes.pythonapi.PyErr_CheckSignals

_watch_lock = threading.Lock()  # the watcher, _open and _in_call
_watcher = None  # the wakeup pipe and its reader, while a Backend is open (_Watcher)
_open = 0  # Backends open
_in_call: set = set()  # Backends in a long C call, on any thread: what a signal cancels


class _Watcher:
    """The wakeup pipe and the thread that reads it (module docstring): each signal that ends the
    main thread's work cancels the C call of every Backend in one."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)
        self._ready = select.poll()  # drain's; the thread waits on a poll object of its own
        self._ready.register(self.r, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name="kvemu-signals", daemon=True)
        self._thread.start()

    def drain(self) -> bytes | None:
        """The signal numbers written and not read yet; None once the write end is closed. Under
        _watch_lock (the one reader at a time)."""
        data = b""
        while self._ready.poll(0):  # a system call, but no exception when there is nothing
            chunk = os.read(self.r, 256)
            if not chunk:
                return None
            data += chunk
        return data

    def _run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED_SIGNALS)  # delivered to the other threads
        poll = select.poll()
        poll.register(self.r, select.POLLIN)
        while True:
            poll.poll()  # a signal's number, or the end: stop() closed the write end
            with _watch_lock:  # against a call's drain: a byte is either its or this thread's
                data = self.drain()
                if data is None:
                    break
                if any(interrupts(n) for n in set(data)):
                    for b in list(_in_call):
                        b.cancel()
        os.close(self.r)

    def stop(self) -> None:
        """Ends the thread and closes the pipe. Not under _watch_lock (the thread takes it)."""
        os.close(self.w)
        self._thread.join()


def _wakeup_fd_taken() -> bool:
    """Whether the main thread's wakeup fd is someone else's (an asyncio loop's). set_wakeup_fd is
    also its only getter: what it returns is put back at once."""
    try:
        previous = signal.set_wakeup_fd(-1)
    except ValueError:  # pragma: no cover - not the main thread of the main interpreter
        return True
    if previous != -1:
        signal.set_wakeup_fd(previous)
    return previous != -1


def _serve_calls(jobs: queue.SimpleQueue) -> None:
    """A C call thread: runs the jobs it is handed, one at a time, until it gets None."""
    signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED_SIGNALS)  # threads C starts inherit it
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, out, done = job
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            out.append((False, e))
        done.release()


class _CallThread:
    """The thread a main-thread Backend makes its long C calls on, always the same one (the numa
    and transfer-pool backends pin the thread that prepares and replays)."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve_calls, args=(self._jobs,), name=name, daemon=True)
        self._thread.start()

    def call(self, fn, cancel):
        """fn() on the call thread. A signal's exception while it runs calls cancel() and, once
        fn has returned, is raised in place of fn's outcome."""
        out: list = []
        done = threading.Lock()
        done.acquire()
        interrupted = None
        self._jobs.put((fn, out, done))
        while True:
            try:
                if done.acquire(timeout=CALL_POLL_S):
                    break
            except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt, Terminated: stop C first
                if interrupted is None:
                    interrupted = e
                cancel()
        if interrupted is not None:
            raise interrupted
        ok, value = out[0]
        if ok:
            return value
        raise value

    def stop(self) -> None:
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()


# Every open Backend, for cancel_all (the main thread cancelling instances' threads' calls).
_live: weakref.WeakSet = weakref.WeakSet()
_live_lock = threading.Lock()


def cancel_all() -> None:
    """Cancels every open Backend for good (see kv_cancel): the C call each one is in returns
    -EINTR within about 50 ms, and every later long call at once. For a caller on its way out, as
    the main thread on an interruption, before it waits for the threads that replay serving
    instances; a signal itself cancels only the calls in flight (module docstring)."""
    with _live_lock:
        backends = list(_live)
    for b in backends:
        b.cancel()


class Backend:
    """One tier backend with its own arena, timer and statistics.

    Use as a context manager, or call :meth:`close`; garbage collection frees it only as a backstop.
    """

    def __init__(self, spec: BackendSpec | str):
        global _open
        #: The backend and its options (backend_spec.BackendSpec); ``spec`` is its text.
        self.backend_spec = BackendSpec.parse(spec)
        self.spec = self.backend_spec.text()
        self.name, self.args = self.backend_spec.name, self.backend_spec.args()
        #: What the backend is and can do (backend_spec.KINDS).
        self.kind = self.backend_spec.kind
        self.geometry: dict | None = None
        #: The tier profile of an emulated backend (emu, vemu); None for a real one.
        self.profile = None
        c_args = self.args
        if self.kind.emulated:
            # Profiles are resolved here (built-in name or TOML path); C takes their numbers.
            self.profile, c_args = emulated_backend_args(self.backend_spec)
        #: The store session (kvemu.stores.StoreSession: the store, its keys and counts) of a store
        #: kind, else None; C opens every store kind through one bridge, ``store``.
        self.store = None
        self._session = 0
        c_name = self.name
        if self.kind.store:
            self.store = StoreSession(self.backend_spec)
            self._session = next(_session_numbers)
            _sessions[self._session] = self.store
            c_name, c_args = "store", f"session={self._session},kind={self.name}"
        self._lock = threading.Lock()  # cancel (any thread) against close
        self._calls = None
        self._counted = False  # in _open, until close
        ctx = lib.kv_ctx_new()
        if ctx == ffi.NULL:
            self._close_store()
            raise MemoryError("kv_ctx_new: out of memory")
        self._ctx = ffi.gc(ctx, lib.kv_ctx_free)
        try:
            with _watch_lock:
                _open += 1
                self._counted = True
            if threading.current_thread() is threading.main_thread() and _wakeup_fd_taken():
                self._calls = _CallThread(f"kvemu-c-{self.name}")
                self._stop_calls = weakref.finalize(self, self._calls.stop)  # once, at close or GC
            with _live_lock:
                _live.add(self)
            _check(self._ctx, self._long_call(lib.kv_backend_open, self._ctx, c_name.encode(),
                                              c_args.encode()), opening=True)
        except BaseException:
            self.close()
            raise

    def _long_call(self, fn, *args):
        """fn(*args), a C call on this context that may take long: directly, while the wakeup pipe
        is the main thread's wakeup fd and a signal's watcher cancels it; or on the call thread
        where that fd is taken (module docstring)."""
        if self._calls is not None:
            return self._store_checked(self._calls.call(lambda: fn(*args), self.cancel))
        watched = threading.current_thread() is threading.main_thread() and self._watch_call()
        if not watched:
            with _watch_lock:
                _in_call.add(self)
        try:
            if watched:
                _run_signal_handlers()  # a signal that came before: its exception now, not after the call
            return self._store_checked(fn(*args))
        finally:
            with _watch_lock:
                _in_call.discard(self)
                if watched:
                    signal.set_wakeup_fd(-1)

    def _store_checked(self, rc):
        """rc, unless the store's callback failed during the call: its exception then."""
        store = getattr(self, "store", None)
        if store is not None and store.pending is not None:
            exc, store.pending = store.pending, None
            raise exc
        return rc

    def _close_store(self) -> None:
        store, self.store = getattr(self, "store", None), None
        if store is not None:
            try:
                store.close()
            finally:
                _sessions.pop(self._session, None)

    def _watch_call(self) -> bool:
        """From the main thread, before a long call: the wakeup pipe becomes the wakeup fd until the
        call ends. False where the fd is someone else's (taken since this Backend opened)."""
        global _watcher
        with _watch_lock:
            if _watcher is None:
                _watcher = _Watcher()
            try:
                previous = signal.set_wakeup_fd(_watcher.w, warn_on_full_buffer=False)
            except ValueError:  # pragma: no cover - not the main thread of the main interpreter
                return False
            if previous != -1:
                signal.set_wakeup_fd(previous)
                return False
            _watcher.drain()  # signals of before: their handlers run before the call, they cancel nothing
            _in_call.add(self)
            return True

    # -- lifetime
    def cancel(self) -> None:
        """Makes the C call running on this backend, in another thread, return -EINTR soon (within
        about 50 ms), and every later long call at once: a cancelled Backend stays so (close it,
        open another). Safe from any thread; no-op once closed."""
        with self._lock:
            if self._ctx is not None:
                lib.kv_cancel(self._ctx)

    def close(self) -> None:
        """Unmaps the arena and frees the context now; the last Backend to close also stops the
        signal watcher. Idempotent."""
        global _open, _watcher
        lock = getattr(self, "_lock", None)
        if lock is None:
            self._close_store()
            return
        # The store releases the staging buffer before C unmaps it.
        self._close_store()
        with lock:
            ctx, self._ctx = getattr(self, "_ctx", None), None
            if ctx is not None:
                ffi.release(ctx)
        if self._calls is not None:
            self._calls = None
            self._stop_calls()
        watcher = None
        with _watch_lock:
            if self._counted:
                self._counted = False
                _open -= 1
                if _open == 0:
                    watcher, _watcher = _watcher, None
        if watcher is not None:
            watcher.stop()

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._ctx is None else "prepared" if self.geometry else "open"
        return f"<Backend {self.spec!r} {state}>"

    @property
    def _live(self):
        if self._ctx is None:
            raise BackendError(f"backend {self.spec!r} is closed", _errno.EBADF)
        return self._ctx

    # -- setup
    def prepare(self, block_bytes: int, n_slots: int, n_layers_model: int, n_layers_replay: int,
                overlap: bool, chunk_blocks: int = 1, layout: str = "per-layer") -> None:
        """Allocates and pre-faults the arena: ``n_slots`` blocks of ``block_bytes`` per replayed layer.
        ``chunk_blocks``: loads and stores of consecutive slots of one chunk move as one transfer."""
        ctx = self._live
        geom = {
            "block_bytes": _uint(block_bytes, "block_bytes", 64),
            "n_slots": _uint(n_slots, "n_slots", 64),
            "n_layers_model": _uint(n_layers_model, "n_layers_model", 32),
            "n_layers_replay": _uint(n_layers_replay, "n_layers_replay", 32),
            "overlap": 1 if overlap else 0,
            "chunk_blocks": _uint(chunk_blocks, "chunk_blocks", 32, minimum=1),
            "layout": _layout_code(layout),
        }
        _check(ctx, self._long_call(lib.kv_prepare, ctx, ffi.new("struct kv_geom *", geom)))
        self.geometry = geom

    def attach(self, owner: "Backend") -> None:
        """Prepares this backend to replay another serving instance on ``owner``'s arena (one copy of
        every block, shared), with a staging buffer of its own. ``owner`` must be prepared, use the
        same backend, and stay open while this one is. BackendUnavailable where the tier cannot be
        shared (uring)."""
        ctx = self._live
        if owner.geometry is None:
            raise ConfigError("attach: the owner backend is not prepared")
        _check(ctx, self._long_call(lib.kv_prepare_attached, ctx, ffi.new("struct kv_geom *", owner.geometry),
                                    owner._live))
        self.geometry = dict(owner.geometry)
        self._owner = owner  # keeps the arena's owner alive as long as this backend

    def set_timing(self, **timing) -> None:
        """Sets the link model and composition (struct kv_timing; unnamed fields keep the CPU link's
        defaults: no link limit, serial stores)."""
        ctx = self._live
        unknown = set(timing) - set(TIMING_FIELDS)
        if unknown:
            raise ConfigError(f"unknown timing fields: {', '.join(sorted(unknown))}")
        t = {"engines": 1, "line_bytes": 64, **timing}
        _check(ctx, lib.kv_set_timing(ctx, ffi.new("struct kv_timing *", t)))
        self.timing = dict(timing)  # what was set, for a second stream on the same tier

    def datapath_stats(self, op: str) -> dict:
        """Data-path totals of ``op``: transfers, bytes, medium/link/charged ns (see kv_datapath_stats)."""
        if op not in _OP_CODE:
            raise ConfigError(f"unknown op {op!r} (known: {', '.join(OPS)})")
        out = ffi.new("uint64_t[6]")
        _check(self._live, lib.kv_datapath_stats(self._live, _OP_CODE[op], out))
        return dict(zip(DATAPATH_FIELDS, (int(x) for x in out)))

    def timeline(self) -> dict:
        """The end of the last step, when the async stores issued so far complete, bytes in flight."""
        c, d, b = ffi.new("int64_t *"), ffi.new("int64_t *"), ffi.new("uint64_t *")
        _check(self._live, lib.kv_timeline(self._live, c, d, b))
        return {"clock_ns": int(c[0]), "stores_done_ns": int(d[0]), "inflight_bytes": int(b[0])}

    def describe(self) -> dict:
        """Facts about the backend, its memory and the timer (see kv_describe in kvemu.h)."""
        ctx = self._live
        size = 1024
        while True:
            buf = ffi.new("char[]", size)
            rc = lib.kv_describe(ctx, buf, size)
            if rc != -_errno.ENOSPC or size >= 1 << 20:
                break
            size *= 4
        _check(ctx, rc)
        facts = json.loads(ffi.string(buf, rc).decode())
        if self.store is not None:
            facts["backend"] = self.name  # the kind, not its C bridge
            facts.update(self.store.facts())
        return facts

    def chase(self, hops: int) -> float:
        """Mean ns of one dependent load, chasing a random cycle over the whole arena (see kv_chase).

        Overwrites the arena. Raises BackendUnavailable when the tier is not host-addressable.
        """
        ctx = self._live
        hops = _uint(hops, "hops", 64, minimum=1)
        out = ffi.new("double *")
        _check(ctx, self._long_call(lib.kv_chase, ctx, hops, out))
        return float(out[0])

    @property
    def timer_ghz(self) -> float:
        """Timer ticks per ns: the TSC rate, or 1.0 when timing with clock_gettime."""
        return float(lib.kv_timer_ghz(self._live))

    # -- replay
    def replay(self, table_off: np.ndarray, table_slots: np.ndarray, steps: np.ndarray,
               entries: np.ndarray, layer_span: np.ndarray, kv: "LayerMoves | None" = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """Replays ``steps`` in one C call; returns ``(step_out, entry_out)``.

        ``table_off`` (uint64, n_req + 1) and ``table_slots`` (uint32) are the requests' block
        tables in CSR form, as arena slots. ``layer_span`` (uint32, one per replayed layer) gives
        the model layers each replayed layer stands for. ``kv``: what each replayed layer caches
        and each request's place (struct kv_layers); None: full attention in every layer.
        Contents (slot bounds, ranges, spans, kinds) are checked by C, which raises
        BackendError(EINVAL) before moving any byte.
        """
        ctx = self._live
        if self.geometry is None:
            _check(ctx, lib.kv_replay(ctx, ffi.NULL, 0, ffi.NULL, 0, ffi.NULL, 0, ffi.NULL, 0,
                                      ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL))
        table_off = _c_array(table_off, np.dtype(np.uint64), "table_off")
        table_slots = _c_array(table_slots, np.dtype(np.uint32), "table_slots")
        steps = _c_array(steps, STEP_DTYPE, "steps")
        entries = _c_array(entries, ENTRY_DTYPE, "entries")
        layer_span = _c_array(layer_span, np.dtype(np.uint32), "layer_span")
        if not 1 <= table_off.size <= 2**32:
            raise ConfigError(f"table_off needs n_req + 1 values with n_req < 2**32, got {table_off.size}")
        if layer_span.size != self.geometry["n_layers_replay"]:
            raise ConfigError(
                f"layer_span has {layer_span.size} values, the arena has "
                f"{self.geometry['n_layers_replay']} replayed layers"
            )
        step_out = np.zeros(len(steps), STEP_OUT_DTYPE)
        entry_out = np.zeros(len(entries), ENTRY_OUT_DTYPE)
        kv_c = keep = ffi.NULL
        if kv is not None:
            layers = _c_array(kv.layers, LAYER_DTYPE, "kv.layers")
            reqs = _c_array(kv.reqs, REQ_DTYPE, "kv.reqs")
            if layers.size != self.geometry["n_layers_replay"] or reqs.size != table_off.size - 1:
                raise ConfigError(f"kv has {layers.size} layers and {reqs.size} requests, the call "
                                  f"{self.geometry['n_layers_replay']} and {table_off.size - 1}")
            keep = (ffi.from_buffer("struct kv_layer[]", layers), _ptr("struct kv_req[]", reqs))
            kv_c = ffi.new("struct kv_layers *", {
                "layer": keep[0], "req": keep[1], "block_tokens": _uint(kv.block_tokens, "block_tokens", 32),
                "checkpoint_blocks": _uint(kv.checkpoint_blocks, "checkpoint_blocks", 32),
                "store_all": 1 if kv.store_all else 0})
        rc = self._long_call(
            lib.kv_replay, ctx,
            ffi.from_buffer("uint64_t[]", table_off), table_off.size - 1,
            _ptr("uint32_t[]", table_slots), table_slots.size,
            _ptr("struct kv_step[]", steps), len(steps),
            _ptr("struct kv_entry[]", entries), len(entries),
            ffi.from_buffer("uint32_t[]", layer_span), kv_c,
            _ptr("struct kv_step_out[]", step_out, writable=True),
            _ptr("struct kv_entry_out[]", entry_out, writable=True),
        )
        del keep  # the arrays C read, alive until here
        _check(ctx, rc)
        return step_out, entry_out

    # -- statistics
    def op_stats(self, op: str) -> dict:
        """Latency histogram and totals of ``op`` since the last :meth:`reset_stats`."""
        if op not in _OP_CODE:
            raise ConfigError(f"unknown op {op!r} (known: {', '.join(OPS)})")
        ctx = self._live
        counts = np.zeros(_n_buckets(), np.uint64)
        totals = ffi.new("uint64_t[4]")
        _check(ctx, lib.kv_op_stats(ctx, _OP_CODE[op], ffi.from_buffer("uint64_t[]", counts, require_writable=True),
                                    counts.size, totals))
        return {"counts": counts, "accesses": int(totals[0]), "bytes": int(totals[1]),
                "time_ns": int(totals[2]), "busy_ns": int(totals[3])}

    def reset_stats(self) -> None:
        lib.kv_stats_reset(self._live)

    # -- tests only
    def debug_peek(self, region: str, off: int, n: int) -> bytes:
        """Copies bytes out of the arena or staging buffer. For tests: it bypasses the timing path."""
        ctx = self._live
        buf = ffi.new("char[]", max(n, 1))
        _check(ctx, lib.kv_debug_peek(ctx, _region(region), off, buf, n))
        return ffi.buffer(buf, n)[:]

    def debug_poke(self, region: str, off: int, data: bytes) -> None:
        """Copies bytes into the arena or staging buffer. For tests: it bypasses the timing path."""
        ctx = self._live
        _check(ctx, lib.kv_debug_poke(ctx, _region(region), off, ffi.from_buffer(data), len(data)))


def _layout_code(layout: str) -> int:
    try:
        return LAYOUTS.index(layout)
    except ValueError:
        raise ConfigError(f"unknown KV layout {layout!r} (known: {', '.join(LAYOUTS)})") from None


def _region(region: str) -> int:
    try:
        return _REGION_CODE[region]
    except KeyError:
        raise ConfigError(f"unknown region {region!r} (known: {', '.join(_REGION_CODE)})") from None


def _n_buckets() -> int:
    return int(lib.kv_hist_n_buckets())


@lru_cache(maxsize=1)
def hist_bucket_lower_ns() -> np.ndarray:
    """Lower bound in ns of each latency-histogram bucket (read-only; shared between callers)."""
    lower = np.array([lib.kv_hist_bucket_lower_ns(i) for i in range(_n_buckets())], np.uint64)
    lower.setflags(write=False)
    return lower


def percentile_from_hist(counts: np.ndarray, lower_ns: np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0..100) in ns of the latencies a histogram counts; nan when empty.

    Below 64 ns buckets hold one exact value, which is returned as is. Above, a value is assumed
    uniformly spread inside its bucket, and the percentile is interpolated linearly between the
    bucket's bounds (error < 1/64 of the value). The last bucket collects everything beyond
    2**40 ns, so its lower bound is returned.
    """
    if not 0 <= q <= 100:
        raise ConfigError(f"percentile must be within [0, 100], got {q}")
    counts = np.asarray(counts, dtype=np.float64)
    lower = np.asarray(lower_ns, dtype=np.float64)
    if counts.shape != lower.shape:
        raise ConfigError(f"counts has {counts.size} buckets, lower_ns has {lower.size}")
    cum = np.cumsum(counts)
    total = cum[-1] if cum.size else 0.0
    if total <= 0:
        return math.nan
    target = q / 100.0 * total
    # side="right" at q = 0 skips leading empty buckets; elsewhere the first bucket reaching target.
    i = int(np.searchsorted(cum, target, side="left" if target > 0 else "right"))
    i = min(i, cum.size - 1)
    lo = lower[i]
    if i + 1 >= lower.size or lower[i + 1] - lo <= 1:
        return float(lo)
    before = cum[i] - counts[i]
    frac = (target - before) / counts[i]
    return float(lo + frac * (lower[i + 1] - lo))


class TierSlots:
    """The tier's slot allocator (kv_lru_map): ``capacity`` slots reused least recently used first,
    so that an arena the size of the tier serves a trace that touches more blocks than it holds,
    even a call that touches more chunks than the tier holds (they evict one another in order)."""

    def __init__(self, capacity: int, key_space: int, origin: str = "--tier-capacity"):
        self.origin = origin  # where the capacity came from, for the warning that a call overflowed it
        lru = lib.kv_lru_new(int(capacity), int(key_space))
        if lru == ffi.NULL:
            raise ConfigError(f"tier slots: capacity {capacity} or key space {key_space} out of range, "
                              f"or out of memory")
        self._lru = ffi.gc(lru, lib.kv_lru_free)
        self.capacity = int(capacity)
        self.evictions = 0

    def map(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot of each key, whether it was not resident before this call)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        slots = np.empty(len(keys), np.uint32)
        fresh = np.empty(len(keys), np.uint8)
        rc = lib.kv_lru_map(self._lru, ffi.from_buffer("int64_t[]", keys), len(keys),
                            ffi.from_buffer("uint32_t[]", slots, require_writable=True),
                            ffi.from_buffer("uint8_t[]", fresh, require_writable=True))
        if rc < 0:
            raise BackendError("tier slots: a key is outside the key space", -rc)
        self.evictions += int(rc)
        return slots, fresh.astype(bool)

    @property
    def resident(self) -> int:
        return int(lib.kv_lru_resident(self._lru))

    @property
    def overflow(self) -> int:
        """Chunks evicted by a later chunk of the call that mapped them: calls whose chunks do not all
        fit the tier (one engine step touching more than it holds) keep only their last ``capacity``."""
        return int(lib.kv_lru_overflow(self._lru))


class BlockRefs:
    """The engine's block pool's reference counts (kv_pool, cbackends/pool.c): per registered block
    id the running requests using it, and the unused blocks in the order they became unused, the
    first to be evicted. Block ids are given as int64 arrays (or sequences of ints), each call a
    batch, each id in order as one at a time. Not thread-safe: a pool shared by instances' threads
    holds its own lock around the calls (engine.pool.BlockPool)."""

    def __init__(self):
        p = lib.kv_pool_new()
        if p == ffi.NULL:
            raise MemoryError("block pool: out of memory")
        self._p = ffi.gc(p, lib.kv_pool_free)
        self._idle = ffi.new("uint64_t *")

    @staticmethod
    def _ids(ids):
        if type(ids) is not np.ndarray or ids.dtype != np.int64 or not ids.flags.c_contiguous:
            ids = np.ascontiguousarray(ids, dtype=np.int64)
        return ffi.from_buffer("int64_t[]", ids), len(ids)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc == -_errno.ENOENT:
            raise KeyError(f"block pool: {what} of a block that is not registered (or has no user)")
        if rc < 0:
            raise MemoryError("block pool: out of memory")

    def prefix_hit(self, ids) -> tuple[int, int]:
        """(how many of ``ids`` are registered, in order from the first; how many of those are unused)."""
        buf, n = self._ids(ids)
        k = lib.kv_pool_prefix_hit(self._p, buf, n, self._idle)
        return int(k), int(self._idle[0])

    def pin(self, ids) -> None:
        self._check(lib.kv_pool_pin(self._p, *self._ids(ids)), "pin")

    def register(self, ids) -> None:
        self._check(lib.kv_pool_register(self._p, *self._ids(ids)), "register")

    def unregister(self, ids) -> None:
        self._check(lib.kv_pool_unregister(self._p, *self._ids(ids)), "unregister")

    def release(self, ids) -> None:
        self._check(lib.kv_pool_release(self._p, *self._ids(ids)), "release")

    def evict(self, n: int) -> int:
        """Drops up to ``n`` unused blocks, the longest unused first; returns how many."""
        return int(lib.kv_pool_evict(self._p, n))

    def registered(self) -> int:
        return int(lib.kv_pool_registered(self._p))

    def idle(self) -> int:
        return int(lib.kv_pool_idle(self._p))

    def users(self, block_id: int) -> int:
        """The requests using ``block_id``; -1 when it is not registered."""
        return int(lib.kv_pool_ref(self._p, int(block_id)))

    def counts(self) -> dict:
        """Every registered block id -> its users."""
        n = self.registered()
        ids, refs = np.empty(n, np.int64), np.empty(n, np.int64)
        k = lib.kv_pool_dump(self._p, ffi.from_buffer("int64_t[]", ids, require_writable=True),
                             ffi.from_buffer("int64_t[]", refs, require_writable=True), n)
        return dict(zip(ids[:k].tolist(), refs[:k].tolist()))


def stack_distances(ids: np.ndarray, id_space: int) -> np.ndarray:
    """LRU stack distance of every reference (uint64; the maximum value for a first reference)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty(len(ids), np.uint64)
    rc = lib.kv_stack_distances(ffi.from_buffer("int64_t[]", ids), len(ids), int(id_space),
                                ffi.from_buffer("uint64_t[]", out, require_writable=True))
    if rc < 0:
        reason = {_errno.EINVAL: "a block id is outside [0, id_space)", _errno.E2BIG: "too many references",
                  _errno.ENOMEM: "out of memory"}.get(-rc, os.strerror(-rc))
        raise BackendError(f"stack distances: {reason}", -rc)
    return out


def prefix_threshold_runs(run_start: np.ndarray, run_count: np.ndarray, id_space: int, offsets: np.ndarray,
                          clamp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The capacity curve's thresholds as runs (cbackends/kvemu.h, kv_prefix_threshold_runs): the
    reference stream as runs of consecutive ids (``run_start``, ``run_count``), request r's
    references at offsets[r]:offsets[r + 1]. Returns each threshold run's value, end (references up
    to it) and request (int64 arrays), and the distinct ids referenced."""
    start = np.ascontiguousarray(run_start, dtype=np.int64)
    count = np.ascontiguousarray(run_count, dtype=np.int64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if len(start) != len(count) or len(offsets) < 1:
        raise BackendError("prefix thresholds: runs' starts and counts differ in length, or no offsets",
                           _errno.EINVAL)
    n = int(count.sum())
    # room for a run per reference; np.empty touches no page it does not write
    value, end, request = (np.empty(max(n, 1), np.int64) for _ in range(3))
    unique = ffi.new("uint64_t *")
    rc = lib.kv_prefix_threshold_runs(
        ffi.from_buffer("int64_t[]", start), ffi.from_buffer("int64_t[]", count), len(start), int(id_space),
        ffi.from_buffer("int64_t[]", offsets), len(offsets) - 1, int(clamp),
        *(ffi.from_buffer("int64_t[]", a, require_writable=True) for a in (value, end, request)), max(n, 1), unique)
    if rc < 0:
        reason = {_errno.EINVAL: "a block id is outside [0, id_space), or bad counts or offsets",
                  _errno.E2BIG: "too many references", _errno.ENOMEM: "out of memory"}.get(-rc, os.strerror(-rc))
        raise BackendError(f"prefix thresholds: {reason}", -rc)
    k = int(rc)
    return value[:k].copy(), end[:k].copy(), request[:k].copy(), int(unique[0])


#: The entry columns kv_entry_batch_ok reads, with the types kvemu writes them in (kvemu.schema).
ENTRY_BATCH_COLUMNS = (("step", np.int32), ("request_id", np.int32), ("phase", np.int8), ("tokens", np.int32),
                       ("context_tokens", np.int32), ("load_first", np.int32), ("load_count", np.int32),
                       ("store_first", np.int32), ("store_count", np.int32), ("read_first", np.int32),
                       ("read_count", np.int32))


def entry_batch_ok(e: dict, prev_step: int, n_steps: int, n_requests: int, table_len: np.ndarray,
                   tokens_max: np.ndarray, input_tokens: np.ndarray, output_tokens: np.ndarray,
                   next_token: np.ndarray, phase: np.ndarray, last_step: np.ndarray) -> bool | None:
    """Whether a batch of entry rows (``e``: ENTRY_BATCH_COLUMNS as numpy arrays) passes the checks of
    a trace's first read (cbackends/kvemu.h, kv_entry_batch_ok), updating the requests' state
    (``next_token``, ``phase``, ``last_step``: int64, int8, int64, written in place) where it does.
    False: a check fails, the state as it was. None: a column is not of the type kvemu writes, or
    the state's arrays not of theirs (nothing checked)."""
    cols = []
    for name, dtype in ENTRY_BATCH_COLUMNS:
        a = e[name]
        if a.dtype != dtype or a.ndim != 1:
            return None
        cols.append(np.ascontiguousarray(a))
    n = len(cols[0])
    if any(len(a) != n for a in cols):
        return None
    fixed = (table_len, tokens_max, input_tokens, output_tokens)
    if any(a.dtype != np.int64 or not a.flags.c_contiguous or len(a) != n_requests for a in fixed) or \
            any(a.dtype != d or not a.flags.c_contiguous or not a.flags.writeable or len(a) != n_requests
                for a, d in ((next_token, np.int64), (phase, np.int8), (last_step, np.int64))):
        return None
    types = {np.dtype(np.int32): "int32_t[]", np.dtype(np.int8): "int8_t[]"}
    rc = lib.kv_entry_batch_ok(
        n, *(ffi.from_buffer(types[a.dtype], a) for a in cols), int(prev_step), int(n_steps), int(n_requests),
        *(ffi.from_buffer("int64_t[]", a) for a in fixed),
        ffi.from_buffer("int64_t[]", next_token, require_writable=True),
        ffi.from_buffer("int8_t[]", phase, require_writable=True),
        ffi.from_buffer("int64_t[]", last_step, require_writable=True))
    if rc < 0:
        raise BackendError("entry checks: " + os.strerror(-rc), -rc)
    return rc == 0


#: Cache policies kv_policy_hits simulates (LRU comes from stack_distances, every capacity at once).
POLICY_CODES = {"fifo": lib.KV_POLICY_FIFO, "optimal": lib.KV_POLICY_OPTIMAL, "s3fifo": lib.KV_POLICY_S3FIFO}


def policy_hits(ids: np.ndarray, id_space: int, capacity: int, policy: str) -> np.ndarray:
    """Whether each reference hits (bool) in a ``policy`` cache (a key of POLICY_CODES) of ``capacity``
    blocks that starts empty (cbackends/policies.c)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty(len(ids), np.uint8)
    rc = lib.kv_policy_hits(ffi.from_buffer("int64_t[]", ids), len(ids), int(id_space), int(capacity),
                            POLICY_CODES[policy], ffi.from_buffer("uint8_t[]", out, require_writable=True))
    if rc < 0:
        reason = {_errno.EINVAL: "a block id is outside [0, id_space)", _errno.ENOMEM: "out of memory"}.get(
            -rc, os.strerror(-rc))
        raise BackendError(f"{policy} cache: {reason}", -rc)
    return out.view(bool)
