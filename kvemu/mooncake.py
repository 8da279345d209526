"""Mooncake Store as a tier: a real storage stack in the replay loop (``--backend mooncake``).

A :class:`MooncakeStack` owns a ``mooncake_master`` process (the store's metadata service, with
its HTTP metadata server) and one store client (``MooncakeDistributedStore``) in this process,
both on loopback with ports chosen free. The client mounts a segment the size of the tier's arena
(the memory the master places objects in) and registers kvemu's staging buffer (the HBM
stand-in), so that puts and gets move bytes between the two through the store's transfer path:
its TCP transport unless ``memcpy=1`` (the client's same-host shortcut, ``MC_STORE_MEMCPY``).

Replay hands it one batch of the core at a time (cbackends/mooncake.c): one op, one replayed
layer, at most 256 transfers. A store is one ``batch_upsert_from`` (a slot the tier reuses is
overwritten), a load one ``batch_get_into``; keys are built from the transfers' arena offsets
with numpy. The time of the client call alone is measured: the client's own software, the RPCs
to the master (allocation, lookup, leases), the transfer over loopback TCP. The store applies its
own rules: it evicts when its segment passes the master's high watermark, refuses a put it has no
room for, and keeps an object it leased for a while; what that did is counted (:meth:`facts`):
loads that found no object (evicted) and stores refused.

Processes are this object's: :meth:`close` stops the client and the master (SIGTERM, then
SIGKILL), and is called by Backend.close, so every ``with``/``finally`` on the way out of an error
or an interruption (kvemu/interrupt.py) stops them; the master also gets SIGKILL from the kernel
if this process dies without cleaning up (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import numpy as np

from .errors import BackendError, BackendUnavailable, ConfigError

#: What to install when the store is missing (one line, docs/errors.md).
INSTALL_HINT = ("install it with pip install 'kvemu[mooncake]' (or pip install '.[mooncake]' from a clone; "
                "the package mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1")
#: The user's options after ``mooncake:`` (backend_spec.KINDS lists them).
OPTIONS = ("lease_ms", "memcpy", "start_timeout_s")
#: Mooncake Store error codes the store's own rules produce (Mooncake's types.h ErrorCode).
NO_SPACE, INVALID_PARAMS, NOT_FOUND, HAS_LEASE = -200, -600, -704, -706
#: Seconds the master has to come up (its first start on a loaded host takes about a second).
START_TIMEOUT_S = 30.0
#: The client's own transfer buffer (unused by the registered-buffer calls kvemu makes).
LOCAL_BUFFER_BYTES = 16 << 20
#: The master's default lease of an object after a get (its flag's default is 10 s).
LEASE_MS = 10000
# The store client logs every INFO line to stderr unless told otherwise.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def import_store():
    """The store client class; BackendUnavailable saying what to install where it cannot import."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:  # the package, or libibverbs.so.1 it links against
        raise BackendUnavailable(f"mooncake: the Mooncake Store client cannot be imported ({exc}); "
                                 f"{INSTALL_HINT}", 0) from None
    return MooncakeDistributedStore


def master_binary() -> str:
    import mooncake

    path = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    if not os.access(path, os.X_OK):
        raise BackendUnavailable(f"mooncake: the package has no runnable mooncake_master ({path}); {INSTALL_HINT}", 0)
    return path


def package_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("mooncake-transfer-engine-non-cuda")
    except Exception:  # noqa: BLE001 - another distribution of the same module
        return None


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort: close() is the rule
        pass


def _options(spec) -> dict:
    opts = {"lease_ms": LEASE_MS, "memcpy": 0, "start_timeout_s": START_TIMEOUT_S}
    if spec.target is not None:
        raise ConfigError(f"mooncake: takes no positional option, got {spec.target!r} (options: "
                          f"{', '.join(OPTIONS)})")
    seen = set()
    for key, value in spec.options:
        if key not in OPTIONS:
            raise ConfigError(f"mooncake: unknown option {key!r} (known: lease_ms=MS, memcpy=0|1, start_timeout_s=S)")
        if key in seen:
            raise ConfigError(f"mooncake: option {key} given twice")
        seen.add(key)
        number = _number(value, float if key == "start_timeout_s" else int)
        if number is None or (key == "memcpy" and number not in (0, 1)) or (key != "memcpy" and number <= 0):
            raise ConfigError(f"mooncake: option {key} is {value!r}, must be "
                              f"{'0|1' if key == 'memcpy' else 'a positive number'}")
        v = number
        opts[key] = v
    return opts


def _number(value, kind):
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


class MooncakeStack:
    """A master and a store client on loopback, owned by one Backend (module docstring)."""

    def __init__(self, spec):
        self.options = _options(spec)
        self._store_cls = import_store()
        self._binary = master_binary()
        self.store = None
        self.master = None
        self.staging_addr = 0
        self.segment_bytes = 0
        self.counts = {"puts": 0, "gets": 0, "put_refused": 0, "get_missing": 0, "get_partial": 0,
                       "lease_held": 0, "put_duplicate": 0}
        self.pending: BaseException | None = None  # raised by Backend after the C call
        self._lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="kvemu-mooncake-")
        self._finalizer = weakref.finalize(self, _stop, None, None, self._dir)
        try:
            self._start_master()
        except BaseException:
            self.close()
            raise

    # -- processes
    def _start_master(self) -> None:
        self.rpc_port, self.http_port, self.metrics_port = _free_ports(3)
        self.log_path = os.path.join(self._dir, "master.log")
        args = [self._binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.options['lease_ms']}",
                "--logtostderr"]
        with open(self.log_path, "wb") as log:
            # A session of its own: a terminal's Ctrl-C reaches kvemu, which stops the master itself.
            self.master = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           cwd=self._dir, start_new_session=True, preexec_fn=_die_with_parent)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, None, self.master, self._dir)
        deadline = time.monotonic() + self.options["start_timeout_s"]
        while True:
            if self.master.poll() is not None:
                raise BackendError(f"mooncake: mooncake_master exited with status {self.master.returncode} at start "
                                   f"({self._log_tail()})", 0)
            if all(_accepts(p) for p in (self.rpc_port, self.http_port)):
                return
            if time.monotonic() > deadline:
                raise BackendError(f"mooncake: mooncake_master did not listen on 127.0.0.1:{self.rpc_port} within "
                                   f"{self.options['start_timeout_s']:g} s ({self._log_tail()})", 0)
            time.sleep(0.05)

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                lines = f.read()[-2000:].decode("utf-8", "replace").strip().splitlines()
            return lines[-1][:200] if lines else "no log"
        except OSError:
            return "no log"

    @property
    def pids(self) -> list[int]:
        """Processes this stack started and has not stopped yet."""
        return [self.master.pid] if self.master is not None and self.master.poll() is None else []

    # -- what C calls (kvemu/backends.py's callbacks)
    def prepare(self, staging_addr: int, staging_bytes: int, arena_bytes: int) -> None:
        """Starts the client, mounts a segment of ``arena_bytes`` and registers the staging buffer."""
        # 0: the transfer path, not the same-host memcpy
        os.environ["MC_STORE_MEMCPY"] = "0" if self.options["memcpy"] == 0 else "1"
        store = self._store_cls()
        with _stderr_to(self.log_path):  # the client's start-up chatter, in the stack's log
            rc, got = self._setup(store, arena_bytes)
        self.store = store  # closed by close() whatever happens next
        if rc != 0:
            raise BackendError(f"mooncake: the store client's setup returned {rc} (master on 127.0.0.1:"
                               f"{self.rpc_port}: {self._log_tail()})", 0)
        if not isinstance(got, dict) or got.get("ret", -1) != 0:
            raise BackendError(f"mooncake: mounting a segment of {arena_bytes} bytes failed: {got}", 0)
        self.segment_bytes = int(got.get("allocated_size", arena_bytes))
        rc = store.register_buffer(int(staging_addr), int(staging_bytes))
        if rc != 0:
            raise BackendError(f"mooncake: registering the {staging_bytes}-byte staging buffer returned {rc}", 0)
        self.staging_addr, self.staging_bytes, self.arena_bytes = int(staging_addr), int(staging_bytes), int(arena_bytes)
        self.key_prefix = f"kv{os.getpid()}-{id(self):x}/"

    def _setup(self, store, arena_bytes: int):
        rc = store.setup("127.0.0.1", f"http://127.0.0.1:{self.http_port}/metadata", 0, LOCAL_BUFFER_BYTES,
                         "tcp", "", f"127.0.0.1:{self.rpc_port}")
        got = store.allocate_and_mount_segment(int(arena_bytes), "tcp") if rc == 0 else None
        return rc, got

    def access(self, op: int, acc: np.ndarray) -> int:
        """One batch: ``acc`` the core's struct kv_access array; returns the ns of the client call.
        op 0 loads (get), 1 stores (put). The key of a transfer is its arena offset."""
        if op == 1:
            # A slot stored twice in one batch (two requests writing one chunk): its last transfer
            # wins, as it would in the tier; the store takes each key once per batch call.
            last = len(acc) - 1 - np.unique(acc["arena_off"][::-1], return_index=True)[1]
            if len(last) < len(acc):
                self.counts["put_duplicate"] += len(acc) - len(last)
                acc = acc[np.sort(last)]
        keys = np.char.add(self.key_prefix, acc["arena_off"].astype(np.str_)).tolist()
        ptrs = (acc["staging_off"] + np.uint64(self.staging_addr)).tolist()
        sizes = acc["bytes"].tolist()
        call = self.store.batch_upsert_from if op == 1 else self.store.batch_get_into
        t0 = time.perf_counter_ns()
        res = call(keys, ptrs, sizes)
        ns = time.perf_counter_ns() - t0
        if op == 1:
            self._count(res, "puts", ok=lambda r: r == 0, refused={NO_SPACE: "put_refused", HAS_LEASE: "lease_held"})
        else:
            self._count(res, "gets", ok=lambda r: r >= 0, refused={NOT_FOUND: "get_missing", INVALID_PARAMS: "get_partial"})
        return ns

    def _count(self, res, what: str, ok, refused: dict) -> None:
        r = np.asarray(res, dtype=np.int64)
        self.counts[what] += len(r)
        bad = r[~ok(r)]
        for code, name in refused.items():
            self.counts[name] += int((bad == code).sum())
        other = bad[~np.isin(bad, list(refused))]
        if other.size:
            raise BackendError(f"mooncake: a batch {what[:-1]} of {len(r)} objects failed with store error "
                               f"{int(other[0])} ({int(other.size)} objects)", 0)

    def facts(self) -> dict:
        """What results say about the stack: transport, wire, the store's decisions."""
        return {"store": "mooncake", "store_package": package_version(),
                "transport": "memcpy (same host)" if self.options["memcpy"] else "tcp",
                "wire": "loopback (master, client and segment on this host, 127.0.0.1)",
                "lease_ms": self.options["lease_ms"], "segment_bytes": self.segment_bytes,
                **{f"store_{k}": v for k, v in self.counts.items()}}

    # -- lifetime
    def close(self) -> None:
        """Closes the client and stops the master; idempotent, from any thread."""
        with self._lock:
            store, self.store = self.store, None
            master, self.master = self.master, None
        if store is not None:
            try:
                if self.staging_addr:
                    store.unregister_buffer(self.staging_addr)
                store.close()
            except Exception:  # noqa: BLE001 - the master is stopped whatever the client says
                pass
        self._finalizer.detach()
        _stop(None, master, self._dir)


@contextlib.contextmanager
def _stderr_to(path: str):
    """File descriptor 2 appended to ``path`` inside the block (a C++ library's logging)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.dup2(fd, 2)
        finally:
            os.close(fd)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def _stop(store, master, folder) -> None:
    if master is not None and master.poll() is None:
        master.terminate()
        try:
            master.wait(5)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait(5)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
