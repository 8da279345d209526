"""A private network namespace for software that binds every interface (Mooncake Store's client).

Mooncake 0.3.13's transfer engine listens on every interface with no option to change it. Inside a
network namespace of its own, where the only interface is ``lo``, such a listener is reachable
from loopback only: binding ``0.0.0.0`` there exposes nothing. :func:`run_isolated` runs a
measurement in a fresh child process (``python -m kvemu.isolation``) that first enters a new network
namespace, then brings ``lo`` up, then calls the function it was given and sends its result back
over a pipe (JSON); the master the store starts there is the child's child, in the same namespace.

How the namespace is made, in order: ``unshare(CLONE_NEWNET)`` where the process may (CAP_SYS_ADMIN);
otherwise ``unshare(CLONE_NEWUSER | CLONE_NEWNET)``, an unprivileged user namespace with this user's
own uid and gid mapped, so files the child writes stay the user's. Both need a process with one
thread, hence the fresh child: a kvemu process has numpy's threads. Where neither is allowed (user
namespaces disabled, a seccomp filter), :func:`run_isolated` says so and the caller runs as before:
the store's own check of what it listens on then refuses an exposed listener in one line naming
``allow_exposed=1`` (kvemu/stores/mooncake.py). The check runs in the namespace too: it is what
says that nothing listens beyond loopback (:func:`private_interfaces`).

The kvemu command itself (``kvemu replay`` or a local ``kvemu sweep`` with a Mooncake store and no
``allow_exposed=1``: :func:`wants_private_network`) enters one in its own process at its start, while
it has one thread (:func:`enter_for_command`, from kvemu/__main__.py); the store then runs in it.

Nothing here imports numpy, the compiled module or a store before the namespace is entered.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_IFF_UP = 0x1

#: What :func:`enter_private_network` made, once this process is in a namespace of its own (else None).
_ENTERED: dict | None = None
#: Why the last :func:`run_isolated` or :func:`enter_for_command` could not make a namespace (else None).
_UNAVAILABLE: str | None = None
#: Why :func:`enter_for_command` left this process half in a namespace (else None): a store refuses to start.
_BROKEN: str | None = None


class IsolationUnavailable(Exception):
    """No private network namespace can be made here (the reason, in words). ``partly``: the process
    was left changed (in a new namespace with no user mapping, or ``lo`` down): not safe to go on in."""

    def __init__(self, reason: str, partly: bool = False):
        super().__init__(reason)
        self.partly = partly


def private_interfaces() -> list[str] | None:
    """The interfaces of this process's network namespace where it is one that holds only ``lo``
    (a listener on any address there is reachable from loopback alone); None otherwise."""
    try:
        with open("/proc/self/net/dev") as f:
            names = [line.split(":", 1)[0].strip() for line in f.read().splitlines()[2:] if ":" in line]
    except OSError:
        return None
    return names if names == ["lo"] else None


def unavailable_reason() -> str | None:
    """Why the last :func:`run_isolated` of this process, or the kvemu command at its start
    (:func:`enter_for_command`), found no namespace to make, or None."""
    return _UNAVAILABLE


def broken_reason() -> str | None:
    """Why the kvemu command's namespace was only half made (this process changed, not isolated), or None."""
    return _BROKEN


def entered() -> dict | None:
    """How this process was isolated (:func:`enter_private_network`'s answer), or None."""
    return _ENTERED


def enter_private_network() -> dict:
    """Moves this single-threaded process into a new network namespace and brings its ``lo`` up.
    Returns ``{"isolation": "netns", "namespace": ..., "interfaces": ["lo"]}``; raises
    IsolationUnavailable saying why not."""
    global _ENTERED
    if _ENTERED is not None:
        return _ENTERED
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise IsolationUnavailable(f"a namespace needs a process with one thread, this one has {threads}")
    try:
        unshare = ctypes.CDLL(None, use_errno=True).unshare
    except (OSError, AttributeError):
        raise IsolationUnavailable("this system's C library has no unshare (Linux namespaces)") from None
    uid, gid = os.getuid(), os.getgid()
    if unshare(CLONE_NEWNET) == 0:
        how = "network namespace"
    else:
        if unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise IsolationUnavailable(f"unshare of a user and network namespace: {os.strerror(err)} "
                                       f"({_errno.errorcode.get(err, err)})")
        try:  # this user's own ids inside, so that what the process writes stays the user's
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                with open(path, "w") as f:
                    f.write(text)
        except OSError as e:
            raise IsolationUnavailable(f"mapping this user into the new user namespace: {e.strerror}",
                                       partly=True) from None
        how = "user and network namespace (unprivileged)"
    try:
        _loopback_up()
    except OSError as e:
        raise IsolationUnavailable(f"bringing lo up in the new network namespace: {e.strerror}", partly=True) from None
    interfaces = private_interfaces()
    if interfaces is None:
        raise IsolationUnavailable("the new network namespace holds more than lo")
    _ENTERED = {"isolation": "netns", "namespace": how, "interfaces": interfaces,
                "netns": os.readlink("/proc/self/ns/net")}
    return _ENTERED


def _loopback_up() -> None:
    """``ip link set lo up``, by the SIOCSIFFLAGS ioctl on a socket of this namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | _IFF_UP))


# ------------------------------------------------------------------------------ the kvemu command itself
#: Options of ``kvemu sweep`` that take a value (the rest of its options are flags).
_SWEEP_VALUED = ("--executor", "--out", "--tls-ca-file", "--tls-cert", "--tls-key")


def wants_private_network(argv: list[str]) -> bool:
    """Whether the kvemu command line ``argv`` (without the program name) starts a Mooncake store in
    kvemu's own process with no ``allow_exposed=1``: ``replay`` whose ``--backend`` or a ``--tiers``
    level (compact form or ``.toml`` file) is ``mooncake[:...]``, or ``sweep SPEC.toml`` run here
    (``--executor local``, not ``--dry-run``) whose ``[backends]`` list one. Such a command enters a
    private network namespace at its start (:func:`enter_for_command`). Read cheaply, before click
    and the heavy imports: never raises; what it cannot read is answered False, and the command
    itself then reports what is wrong. ``calibrate`` isolates its measurement in a child instead
    (:func:`run_isolated`); ``--help`` starts nothing."""
    try:
        return _wants(list(argv))
    except Exception:  # noqa: BLE001 - a command line this cannot read is the command's to refuse
        return False


def _wants(argv: list[str]) -> bool:
    if any(a in ("--help", "-h") for a in argv):
        return False
    command = next((a for a in argv if not a.startswith("-")), None)
    rest = argv[argv.index(command) + 1:] if command else []
    if command == "replay":
        specs = []
        for name, value in _options(rest, ("--backend", "--tiers")):
            specs.extend([value] if name == "--backend" else _tier_backends(value))
        return any(_mooncake_without_allow(s) for s in specs)
    if command == "sweep":
        opts = dict(_options(rest, _SWEEP_VALUED))
        if "--dry-run" in rest or opts.get("--executor", "local") != "local":
            return False  # nothing runs, or the cells run on a Dask cluster's workers (beyond this namespace)
        spec = next((a for a in _positionals(rest, _SWEEP_VALUED)), None)
        backends = _toml(spec).get("backends", {}) if spec else {}
        return any(_mooncake_without_allow(s) for key in ("use", "optional") for s in backends.get(key, []))
    return False


def _options(args: list[str], names) -> list[tuple[str, str]]:
    """``(name, value)`` of each ``--name VALUE`` or ``--name=VALUE`` among ``args``."""
    found = []
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in names:
            if eq:
                found.append((name, value))
            elif i + 1 < len(args):
                found.append((name, args[i + 1]))
    return found


def _positionals(args: list[str], valued) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = a in valued
        else:
            out.append(a)
    return out


def _toml(path: str) -> dict:
    import tomllib

    with open(path, "rb") as f:
        return tomllib.load(f)


def _tier_backends(text: str) -> list[str]:
    """The backend spec of each level of a ``--tiers`` value (kvemu.stackspec's two forms)."""
    text = text.strip()
    if text.endswith(".toml"):
        return [t.get("backend", "") for t in _toml(text).get("tier", []) if isinstance(t, dict)]
    return [seg.partition("|")[0].strip() for seg in text.split(";")]


def _mooncake_without_allow(spec) -> bool:
    if not isinstance(spec, str):
        return False
    name, _, options = spec.strip().partition(":")
    if name != "mooncake":
        return False
    for item in options.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "allow_exposed":
            try:
                if int(value) == 1:
                    return False
            except ValueError:
                pass
    return True


def enter_for_command(argv: list[str]) -> dict | None:
    """At the start of the kvemu command, while its process has one thread (kvemu/__main__.py):
    where :func:`wants_private_network`, enters a private network namespace
    (:func:`enter_private_network`'s answer). Where none can be made, returns None and the store's
    loopback check then refuses in one line, with the reason (:func:`unavailable_reason`); where
    one was half made, the store refuses to start (:func:`broken_reason`)."""
    global _UNAVAILABLE, _BROKEN
    if not wants_private_network(argv):
        return None
    try:
        return enter_private_network()
    except IsolationUnavailable as e:
        _UNAVAILABLE = str(e)
        if e.partly:
            _BROKEN = str(e)
    except OSError as e:  # no /proc to count the threads by
        _UNAVAILABLE = f"reading /proc/self/task: {e.strerror}"
    return None


def how_text(iso: dict | None, listening, exposed) -> str | None:
    """How a store's software was kept from the network, in words (``kvemu calibrate``'s ``isolation``
    line and ``isolation_how``, a replay's ``backend.facts.isolation_how``); None for no store."""
    if not iso:
        return None
    if iso.get("isolation") == "netns":
        return (f"a private network namespace ({iso.get('namespace')}; interfaces: "
                f"{', '.join(iso.get('interfaces') or [])}): {len(listening or [])} listeners, reachable from it alone")
    return (f"none ({iso.get('reason')})" + (f"; accepted exposed (allow_exposed=1): {', '.join(exposed)}"
                                             if exposed else ""))


def state(allow_exposed: bool = False) -> dict:
    """This process's isolation, as ``kvemu calibrate``'s result ``isolation`` says it: the namespace
    it entered (:func:`entered`), one it was started in (only ``lo``), or ``none`` and why."""
    if _ENTERED is not None:
        return dict(_ENTERED)
    interfaces = private_interfaces()
    if interfaces is not None:
        return {"isolation": "netns", "namespace": "a network namespace kvemu was started in", "interfaces": interfaces,
                "netns": os.readlink("/proc/self/ns/net")}
    if _UNAVAILABLE is not None:
        reason = f"no private network namespace here: {_UNAVAILABLE}"
    elif allow_exposed:
        reason = "allow_exposed=1 given: no private network namespace was made"
    else:
        reason = "no private network namespace was made (the kvemu command makes one for a Mooncake store)"
    return {"isolation": "none", "reason": reason}


# ------------------------------------------------------------------------------ the child process
def _error_class(name: str):
    from . import errors

    cls = getattr(errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, errors.KvemuError) else None


def run_isolated(target: str, kwargs: dict, log=None) -> dict:
    """``target(**kwargs, log=...)`` (``"module:function"``, JSON arguments and result) run in a
    child process in a network namespace of its own. Returns its result with ``isolation`` added
    (:func:`enter_private_network`'s answer). Raises IsolationUnavailable (nothing was run) where
    no namespace can be made; a KvemuError the function raised is raised here as the same class,
    with its message."""
    log = log or (lambda message: None)
    read_fd, write_fd = os.pipe()
    request = json.dumps({"target": target, "kwargs": kwargs, "fd": write_fd})
    try:
        child = subprocess.Popen([sys.executable, "-m", "kvemu.isolation", request], stdin=subprocess.DEVNULL,
                                 stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None,
                                 pass_fds=(write_fd,), preexec_fn=_die_with_parent,
                                 env={**os.environ, "PYTHONPATH": _pythonpath()})
    finally:
        os.close(write_fd)
    answer: dict | None = None
    try:
        with os.fdopen(read_fd, "r", encoding="utf-8") as pipe:
            for line in pipe:
                msg = json.loads(line)
                if "log" in msg:
                    log(msg["log"])
                else:
                    answer = msg
        code = child.wait()
    finally:
        if child.poll() is None:  # interrupted: the child stops its store on SIGTERM
            child.terminate()
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    if answer is None:
        from .errors import BackendError

        raise BackendError(f"the isolated measurement ({target}) ended with status {code} and no answer", 0)
    if "unavailable" in answer:
        global _UNAVAILABLE
        _UNAVAILABLE = answer["unavailable"]
        raise IsolationUnavailable(answer["unavailable"])
    if "error" in answer:
        err = answer["error"]
        cls = _error_class(err["class"])
        if cls is None:
            from .errors import BackendError

            raise BackendError(f"{err['class']}: {err['message']} (in the isolated measurement)", 0)
        exc = cls.__new__(cls)
        if issubclass(cls, OSError):
            OSError.__init__(exc, err["message"])
            exc.errno = err.get("errno") or 0
        else:
            Exception.__init__(exc, err["message"])
        raise exc
    return answer["result"]


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def _pythonpath() -> str:
    """This kvemu's folder first, so that the child imports the same package."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = os.environ.get("PYTHONPATH")
    return here + (os.pathsep + rest if rest else "")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _child(request: str) -> int:  # pragma: no cover - runs in the child (tests run it through run_isolated)
    req = json.loads(request)
    out = os.fdopen(req["fd"], "w", encoding="utf-8", buffering=1)

    def send(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's: it stops this one
    try:
        facts = enter_private_network()
    except IsolationUnavailable as e:
        send({"unavailable": str(e)})
        return 0
    try:
        import importlib

        module, _, name = req["target"].partition(":")
        fn = getattr(importlib.import_module(module), name)
        result = fn(**req["kwargs"], log=lambda m: send({"log": m}))
        send({"result": {**result, "isolation": facts}})
    except KeyboardInterrupt:  # SIGTERM from the parent: the measurement's own cleanup has run
        return 128 + signal.SIGTERM
    except Exception as e:  # noqa: BLE001 - every failure goes back to the parent, which raises it
        send({"error": {"class": type(e).__name__, "message": str(e), "errno": getattr(e, "errno", None)}})
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    from kvemu import isolation as _module  # the module the measurement imports, not this __main__ copy

    sys.exit(_module._child(sys.argv[1]))
