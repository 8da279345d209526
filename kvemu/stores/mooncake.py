"""Mooncake Store as a tier: a real store in the replay loop (``--backend mooncake``).

A :class:`MooncakeStore` (a :class:`kvemu.stores.Store`) owns a ``mooncake_master`` process (the
store's metadata service) and one store client (``MooncakeDistributedStore``) in this process. The
master serves its RPC and metrics on 127.0.0.1 at ports chosen free, and runs no HTTP metadata
server: the client finds its own segment by Mooncake's peer-to-peer handshake (``P2PHANDSHAKE``),
since the master's HTTP metadata server listens on every interface whatever host it is given
(Mooncake 0.3.13). The client mounts a segment the size of the tier's arena (the memory the master
places objects in) and registers kvemu's staging buffer (the HBM stand-in), so that puts and gets
move bytes between the two through the store's transfer path: its TCP transport unless
``memcpy=1`` (the client's same-host shortcut, ``MC_STORE_MEMCPY``).

Loopback. Before any data moves, :meth:`MooncakeStore.start` reads what the master and this
process listen on (``/proc/net/tcp``, ``tcp6``, matched to each process's socket inodes) and
refuses, in one line naming the process and the address, anything beyond loopback. The client's
transfer engine (its TCP data listener and its handshake daemon) binds every interface in the
Mooncake releases kvemu supports, with no option to change it. In a network namespace whose only
interface is ``lo`` (kvemu.isolation: ``kvemu calibrate`` runs the store in a child there, ``kvemu
replay`` and ``kvemu sweep`` enter one at their start) every address is loopback: the check reads the
sockets the same way and accepts them there (``isolation = "netns"``, every address in ``listening``).
Elsewhere a run needs ``allow_exposed=1``, the user's explicit acceptance of that exposure; the
addresses are then listed in the facts (``exposed``). docs/backends.md says so.

Each batch is one ``batch_upsert_from`` (a slot the tier reuses is overwritten) or one
``batch_get_into``. The store applies its own rules: it evicts when its segment passes the master's
high watermark, refuses a put it has no room for, and keeps an object it leased for a while; the
session counts what it did (:data:`MooncakeStore.outcomes`).

Processes are this object's: :meth:`stop` stops the client and the master (SIGTERM, then SIGKILL);
the master also gets SIGKILL from the kernel if this process dies without cleaning up
(PR_SET_PDEATHSIG), and the folder such a run leaves (``kvemu-mooncake-*``, the master's log) is
removed by the next start (only kvemu's own: owned by this user, the PID recorded in it dead).
The library leaves ``os.environ`` as it found it: the client's settings are set around its
creation only, the master gets its environment of its own.
"""
from __future__ import annotations

import contextlib
import ctypes
import ipaddress
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

from .. import isolation
from ..errors import BackendError, BackendUnavailable, ConfigError

#: What to install when the store is missing (one line, docs/errors.md).
INSTALL_HINT = ("install it with pip install 'kvemu[mooncake]' (or pip install '.[mooncake]' from a clone; "
                "the package mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1")
#: The user's options after ``mooncake:`` (backend_spec.KINDS lists them).
OPTIONS = ("lease_ms", "memcpy", "start_timeout_s", "allow_exposed")
#: Mooncake Store error codes the store's own rules produce (Mooncake's types.h ErrorCode).
NO_SPACE, INVALID_PARAMS, NOT_FOUND, HAS_LEASE = -200, -600, -704, -706
#: Seconds the master has to come up (its first start on a loaded host takes about a second).
START_TIMEOUT_S = 30.0
#: The client's own transfer buffer (unused by the registered-buffer calls kvemu makes).
LOCAL_BUFFER_BYTES = 16 << 20
#: The master's default lease of an object after a get (its flag's default is 10 s).
LEASE_MS = 10000
#: The prefix of the folder each store's master runs in (its log), under the temporary directory.
FOLDER_PREFIX = "kvemu-mooncake-"
#: The file in that folder naming the process that owns it: "PID START_TICKS".
OWNER_FILE = "owner"
#: The client's settings, set around its creation only (the store logs every INFO line otherwise).
CLIENT_LOG_LEVEL = "ERROR"
#: The prefix of the folder a failed run's logs are kept in (the master's and the client's), named in
#: its error line; it has no owner file, so remove_stale_folders leaves it to the user.
KEPT_PREFIX = FOLDER_PREFIX + "logs-"


def import_store():
    """The store client class; BackendUnavailable saying what to install where it cannot import."""
    try:
        with _scoped_env({"MC_LOG_LEVEL": CLIENT_LOG_LEVEL}):
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
    opts = {"lease_ms": LEASE_MS, "memcpy": 0, "start_timeout_s": START_TIMEOUT_S, "allow_exposed": 0}
    if spec.target is not None:
        raise ConfigError(f"mooncake: takes no positional option, got {spec.target!r} (options: "
                          f"{', '.join(OPTIONS)})")
    seen = set()
    for key, value in spec.options:
        if key not in OPTIONS:
            raise ConfigError(f"mooncake: unknown option {key!r} (known: lease_ms=MS, memcpy=0|1, start_timeout_s=S, "
                              f"allow_exposed=0|1)")
        if key in seen:
            raise ConfigError(f"mooncake: option {key} given twice")
        seen.add(key)
        flag = key in ("memcpy", "allow_exposed")
        number = _number(value, float if key == "start_timeout_s" else int)
        hi = _OPTION_MAX.get(key)
        if number is None or (flag and number not in (0, 1)) or (not flag and not (0 < number <= hi)):
            # NaN fails too: a start deadline that never passes
            raise ConfigError(f"mooncake: option {key} is {value!r}, must be " + (
                "0|1" if flag else f"a number above 0 and at most {hi:g}" if isinstance(hi, float)
                else f"a whole number from 1 to {hi}"))
        opts[key] = number
    return opts


#: Largest values of the numeric options: an hour to start, a lease of a day.
_OPTION_MAX = {"start_timeout_s": 3600.0, "lease_ms": 86_400_000}


def _number(value, kind):
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        return None


# ------------------------------------------------------------------------------ what listens where
def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def _address(hex_addr: str) -> tuple[ipaddress._BaseAddress, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # /proc prints each 32-bit word of the address in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw), int(port, 16)


def listening(pid: int, inodes: set[int] | None = None) -> list[tuple[str, int, int]]:
    """TCP sockets process ``pid`` listens on: (address, port, inode), IPv4 and IPv6; only those of
    ``inodes`` where given (else every socket the process has open)."""
    mine = _socket_inodes(pid) if inodes is None else inodes
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[9]) in mine:  # 0A: TCP_LISTEN
                addr, port = _address(cols[1])
                found.append((str(addr), port, int(cols[9])))
    return found


def is_loopback(address: str) -> bool:
    a = ipaddress.ip_address(address)
    mapped = getattr(a, "ipv4_mapped", None)
    return a.is_loopback or (mapped is not None and mapped.is_loopback)


def _shown(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


# ------------------------------------------------------------------------------ leftovers of killed runs
def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]  # field 22: the process's start time


def remove_stale_folders(parent: str | None = None) -> list[str]:
    """Removes the ``kvemu-mooncake-*`` folders of runs that died without cleaning up: only real
    folders owned by this user whose owner file names a process that is gone (its PID free, or
    taken by a process that started later). Returns the folders removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(FOLDER_PREFIX):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(path, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                pid_text, ticks = f.read(64).split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # not ours to judge: no owner file (yet), unreadable
        if _start_ticks(pid) == ticks:
            continue  # alive
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def _scoped_env(values: dict):
    """``os.environ`` with ``values`` inside the block, exactly as before after it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class MooncakeStore:
    """A master and a store client on loopback (module docstring); a :class:`kvemu.stores.Store`."""

    outcomes = {NO_SPACE: "put_refused", HAS_LEASE: "lease_held", NOT_FOUND: "get_missing",
                INVALID_PARAMS: "get_partial"}

    def __init__(self, spec):
        self.options = _options(spec)
        broken = isolation.broken_reason()
        if broken is not None and not self.options["allow_exposed"]:
            raise BackendError(f"mooncake: kvemu's private network namespace was only half made ({broken}); "
                               f"pass mooncake:allow_exposed=1 to run without one (docs/backends.md)", 0)
        self._store_cls = import_store()
        self._binary = master_binary()
        self.store = None
        self.master = None
        self.staging_addr = 0
        self.segment_bytes = 0
        self.exposed: list[str] = []
        self.bound: list[str] = []
        self.isolation = "none"
        self._lock = threading.Lock()
        self._stopping = threading.RLock()  # held through a stop: a second caller waits for the first's cleanup
        self._kept = False  # the folder is kept for its logs (a fault named them)
        self._log_fd = None  # the client's log, open while it runs
        remove_stale_folders()
        self._dir = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        self._finalizer = weakref.finalize(self, _stop, None, None, self._dir)
        try:
            with open(os.path.join(self._dir, OWNER_FILE), "w") as f:
                f.write(f"{os.getpid()} {_start_ticks(os.getpid())}\n")
            self._start_master()
        except BaseException:
            self.stop()
            raise

    # -- processes
    def _start_master(self) -> None:
        self.rpc_port, self.metrics_port = _free_ports(2)
        self.log_path = os.path.join(self._dir, "master.log")
        self.client_log_path = os.path.join(self._dir, "client.log")
        args = [self._binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=false", "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}", f"--default_kv_lease_ttl={self.options['lease_ms']}",
                "--logtostderr"]
        with open(self.log_path, "wb") as log:
            # A session of its own: a terminal's Ctrl-C reaches kvemu, which stops the master itself.
            self.master = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           cwd=self._dir, start_new_session=True, preexec_fn=_die_with_parent,
                                           env={**os.environ, "MC_LOG_LEVEL": CLIENT_LOG_LEVEL})
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, None, self.master, self._dir)
        deadline = time.monotonic() + self.options["start_timeout_s"]
        while True:
            if self.master.poll() is not None:
                raise BackendError(f"mooncake: mooncake_master exited with status {self.master.returncode} at start "
                                   f"({self._log_tail()})", 0)
            if all(_accepts(p) for p in (self.rpc_port, self.metrics_port)):
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
        """Processes this store started and has not stopped yet."""
        return [self.master.pid] if self.master is not None and self.master.poll() is None else []

    # -- the Store protocol
    def start(self, buffer_addr: int, buffer_bytes: int, capacity_bytes: int) -> None:
        """Starts the client, mounts a segment of ``capacity_bytes``, checks that nothing listens
        beyond loopback, and registers the staging buffer."""
        before = _socket_inodes(os.getpid())
        store = self._store_cls()
        env = {"MC_LOG_LEVEL": CLIENT_LOG_LEVEL,
               # 0: the transfer path, not the same-host memcpy
               "MC_STORE_MEMCPY": "1" if self.options["memcpy"] else "0"}
        with _scoped_env(env), _stderr_to(self.client_log_path):  # the client's chatter, in its log file
            rc, got = self._setup(store, capacity_bytes)
        self.store = store  # closed by stop() whatever happens next
        if rc != 0:
            raise BackendError(f"mooncake: the store client's setup returned {rc} (master on 127.0.0.1:"
                               f"{self.rpc_port}: {self._log_tail()})", 0)
        if not isinstance(got, dict) or got.get("ret", -1) != 0:
            raise BackendError(f"mooncake: mounting a segment of {capacity_bytes} bytes failed: {got}", 0)
        self.segment_bytes = int(got.get("allocated_size", capacity_bytes))
        self._check_loopback(before)
        rc = store.register_buffer(int(buffer_addr), int(buffer_bytes))
        if rc != 0:
            raise BackendError(f"mooncake: registering the {buffer_bytes}-byte staging buffer returned {rc}", 0)
        self.staging_addr = int(buffer_addr)

    def _setup(self, store, capacity_bytes: int):
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, LOCAL_BUFFER_BYTES, "tcp", "", f"127.0.0.1:{self.rpc_port}")
        got = store.allocate_and_mount_segment(int(capacity_bytes), "tcp") if rc == 0 else None
        return rc, got

    def _check_loopback(self, before: set[int]) -> None:
        """What the master and the client (sockets this process opened since ``before``) listen on:
        refused beyond loopback unless allow_exposed=1, then listed in the facts."""
        found = [("mooncake_master", self.master.pid, a, p) for a, p, _ in listening(self.master.pid)]
        mine = _socket_inodes(os.getpid()) - before
        found += [("the store client in kvemu", os.getpid(), a, p) for a, p, _ in listening(os.getpid(), mine)]
        self.bound = [f"{who} (pid {pid}) {_shown(a, p)}" for who, pid, a, p in found]
        # In a network namespace whose only interface is lo (kvemu.isolation), any address is loopback:
        # the master must be in it too (its child, started there).
        private = isolation.private_interfaces()
        if private is not None and _netns(self.master.pid) == _netns(os.getpid()):
            self.isolation = "netns"
            outside = []
        else:
            self.isolation = "none"
            outside = [f for f in found if not is_loopback(f[2])]
        self.exposed = [f"{who} (pid {pid}) {_shown(a, p)}" for who, pid, a, p in outside]
        if outside and not self.options["allow_exposed"]:
            who, pid, a, p = outside[0]
            more = f" and {len(outside) - 1} more" if len(outside) > 1 else ""
            raise BackendError(f"mooncake: {who} (pid {pid}) listens on {_shown(a, p)}{more} beyond loopback "
                               f"(Mooncake {package_version() or '?'} binds every interface){_why_not()}; pass "
                               f"mooncake:allow_exposed=1 to accept that (docs/backends.md)", 0)

    def put_from(self, keys, addrs, sizes):
        return self._logged(self.store.batch_upsert_from, keys, addrs, sizes)

    def get_into(self, keys, addrs, sizes):
        return self._logged(self.store.batch_get_into, keys, addrs, sizes)

    def _logged(self, call, *args):
        """``call(*args)`` with file descriptor 2 on the client's log (it logs each failed key
        there), then the master checked if an object failed. Lean: it is inside the timed call
        (about 6 us on the 2-core development VM, against a batch's milliseconds over TCP)."""
        if self._log_fd is None:
            self._log_fd = os.open(self.client_log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(self._log_fd, 2)
            res = call(*args)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        if res and min(res) < 0:
            self._check_master(res)
        return res

    def _check_master(self, res) -> None:
        """After a batch with a failed object (a code that is not one of the store's rules): a
        MasterExited naming the master if it has exited, its log and the client's kept."""
        if all(r >= 0 or r in self.outcomes for r in res):
            return
        master = self.master
        if master is None:
            return
        try:
            code = master.wait(1)  # the RPC failed as its socket closed: the process is gone or going
        except subprocess.TimeoutExpired:
            return  # alive: the session reports the store's error
        raise MasterExited(master.pid, code, *self._keep_logs())

    def _keep_logs(self) -> tuple[str, str]:
        """Moves the run folder to one of its own that no later start removes (no owner file):
        the master's and the client's logs, named in the error line."""
        with self._lock:
            if not self._kept:
                kept = tempfile.mkdtemp(prefix=KEPT_PREFIX)
                try:
                    for name in ("master.log", "client.log"):
                        src = os.path.join(self._dir, name)
                        if os.path.exists(src):
                            shutil.move(src, os.path.join(kept, name))
                except OSError:
                    shutil.rmtree(kept, ignore_errors=True)
                    return self.log_path, self.client_log_path  # left where they are, removed at stop
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir, self._kept = kept, True
                self.log_path = os.path.join(kept, "master.log")
                self.client_log_path = os.path.join(kept, "client.log")
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _stop, None, self.master, None)
        return self.log_path, self.client_log_path

    def describe(self) -> dict:
        """What results say about the store: transport, wire, where it listens, its settings."""
        return {"store": "mooncake", "product": "Mooncake Store", "store_package": package_version(),
                "transport": "memcpy (same host)" if self.options["memcpy"] else "tcp",
                "wire": "loopback (master, client and segment on this host, 127.0.0.1)",
                "isolation": self.isolation, "listening": list(self.bound),
                "exposed": list(self.exposed), "isolation_how": self._isolation_how(),
                "lease_ms": self.options["lease_ms"], "segment_bytes": self.segment_bytes}

    def _isolation_how(self) -> str | None:
        """kvemu.isolation.how_text of this store (after its start; None before)."""
        if not self.bound:
            return None
        iso = isolation.state(bool(self.options["allow_exposed"]))
        if self.isolation != iso["isolation"]:  # the master outside this namespace: the check's word counts
            iso = {"isolation": "none", "reason": "the master is not in this process's network namespace"}
        return isolation.how_text(iso, self.bound, self.exposed)

    def stop(self) -> None:
        """Closes the client and stops the master; idempotent, from any thread."""
        with self._stopping:
            self._stop_once()

    def _stop_once(self) -> None:
        with self._lock:
            store, self.store = self.store, None
            master, self.master = self.master, None
        if store is not None:
            try:
                # its complaints (a master gone: the segment cannot be unmounted) in its log
                with _stderr_to(self.client_log_path):
                    if self.staging_addr:
                        store.unregister_buffer(self.staging_addr)
                    store.close()
            except Exception:  # noqa: BLE001 - the master is stopped whatever the client says
                pass
        with self._lock:
            fd, self._log_fd = self._log_fd, None
        if fd is not None:
            os.close(fd)
        try:
            _stop(None, master, None if self._kept else self._dir)
        finally:  # detached once done: interrupted, the finalizer stops it again at exit
            if master is None or master.poll() is not None:
                self._finalizer.detach()


class MasterExited(BackendError):
    """The store's master exited while kvemu used it (killed, crashed): one line naming it, its
    exit, and the two logs kept; where it happened is added by the replay (:meth:`located`)."""

    def __init__(self, pid: int, code: int, master_log: str, client_log: str):
        self.pid, self.code, self.logs = pid, code, (master_log, client_log)
        self.where = ""
        super().__init__(self._text(), 0)

    def _text(self) -> str:
        if self.code < 0:
            try:
                name = f" ({signal.Signals(-self.code).name})"
            except ValueError:
                name = ""
            how = f"with signal {-self.code}{name}"
        else:
            how = f"with status {self.code}"
        return (f"mooncake: the Mooncake master (mooncake_master, pid {self.pid}) exited {how} mid-run"
                f"{self.where}; nothing was written; rerun the command; its log: {self.logs[0]}; "
                f"the store client's log: {self.logs[1]}")

    def located(self, where: str) -> None:
        """Says where the run was (`` while replaying steps 40-57 (requests 3-9)``)."""
        if not self.where:
            self.where = where
            self.args = (self._text(),)


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


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _why_not() -> str:
    """Why no private network namespace could be made here, where a run tried (kvemu.isolation)."""
    reason = isolation.unavailable_reason()
    return f"; no private network namespace here: {reason}" if reason else ""


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def _stop(store, master, folder) -> None:
    try:
        if master is not None and master.poll() is None:
            master.terminate()
            try:
                master.wait(5)
            except subprocess.TimeoutExpired:
                master.kill()
                master.wait(5)
    finally:  # a signal that ends the wait (Ctrl-C as the run closes) still leaves no folder
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
