"""A private network namespace for Mooncake (kvemu/isolation.py): what the namespace holds, what the real
store binds inside it, and the one-line refusal where no namespace can be made.

The oracles are this file's own: the namespace's interfaces and listening sockets are read from /proc here,
not by kvemu's code, and where no namespace can be made is a real one (user namespaces disabled inside an
outer one of this test's, with CAP_SYS_ADMIN dropped), not a mock."""
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvemu.isolation import run_isolated

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent


def _mooncake_missing():
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any reason it cannot load is a reason to skip
        return f"{type(e).__name__}: {e}"
    return None


_MISSING = _mooncake_missing()
needs_store = pytest.mark.skipif(_MISSING is not None, reason=f"Mooncake Store client not importable: {_MISSING}")


def _namespaces_here() -> str | None:
    """Why this host cannot make a network namespace for a child (None where it can)."""
    try:
        r = subprocess.run([sys.executable, "-c", "from kvemu.isolation import enter_private_network as e; e()"],
                           capture_output=True, text=True, timeout=30, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]


_NO_NETNS = _namespaces_here()
needs_netns = pytest.mark.skipif(_NO_NETNS is not None, reason=f"no network namespace here: {_NO_NETNS}")


@pytest.fixture
def tests_importable(monkeypatch):
    """The child imports its target from this folder."""
    rest = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(HERE) + (os.pathsep + rest if rest else ""))


# ------------------------------------------------------------------------------ targets run in the child
def _interfaces() -> list[str]:
    with open("/proc/self/net/dev") as f:
        return [line.split(":", 1)[0].strip() for line in f.read().splitlines()[2:] if ":" in line]


def _listening(pid: int) -> set[str]:
    """``addr:port`` of every TCP socket process ``pid`` listens on (its own /proc parse)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                c = row.split()
                if c[3] == "0A" and c[9] in inodes:
                    host, port = c[1].split(":")
                    raw = bytes.fromhex(host)
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    addr = socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, raw)
                    out.add(f"{addr}:{int(port, 16)}")
    return out


def probe_namespace(outside: list, log) -> dict:
    """In the child: the interfaces, and whether a listener on every interface is reachable from loopback
    and from the host's own addresses (``outside``)."""
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen()
    port = srv.getsockname()[1]
    socket.create_connection(("127.0.0.1", port), 2).close()
    reached = []
    for addr in outside:
        try:
            socket.create_connection((addr, port), 2).close()
            reached.append(addr)
        except OSError:
            pass
    srv.close()
    return {"interfaces": _interfaces(), "reached": reached, "pid": os.getpid(), "ids": [os.getuid(), os.getgid()]}


def probe_mooncake(log) -> dict:
    """In the child: a real Mooncake Store, default options, and what its processes listen on."""
    from kvemu.backends import Backend

    with Backend("mooncake") as b:
        b.prepare(64 << 10, 4, 1, 1, False)
        master = b.store.impl.pids[0]
        seen = {"master": sorted(_listening(master)), "client": sorted(_listening(os.getpid()))}
        facts = b.describe()
    return {"seen": seen, "facts": {k: facts[k] for k in ("isolation", "listening", "exposed")},
            "interfaces": _interfaces(), "pids": [master, os.getpid()]}


def _host_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback (from its routing table's local entries)."""
    found = set()
    try:
        with open("/proc/net/fib_trie") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for prev, line in zip(lines, lines[1:]):
        if "/32 host LOCAL" in line:
            addr = prev.strip().split()[-1]
            if not addr.startswith("127."):
                found.add(addr)
    return sorted(found)


# ------------------------------------------------------------------------------ tests
@needs_netns
def test_the_namespace_holds_lo_alone_and_a_wildcard_listener_is_loopback_only(tests_importable):
    outside = _host_addresses()
    r = run_isolated("test_isolation:probe_namespace", {"outside": outside})
    assert r["interfaces"] == ["lo"]
    assert r["reached"] == []  # none of the host's addresses exists in there
    assert r["isolation"]["isolation"] == "netns" and r["isolation"]["interfaces"] == ["lo"]
    assert r["isolation"]["netns"] != os.readlink("/proc/self/ns/net")
    assert not Path(f"/proc/{r['pid']}").exists()  # the child is gone


@needs_netns
@needs_store
def test_the_real_store_binds_every_interface_in_the_namespace_and_nothing_is_exposed(tests_importable):
    r = run_isolated("test_isolation:probe_mooncake", {})
    seen, facts = r["seen"], r["facts"]
    assert r["interfaces"] == ["lo"]
    # the real client binds every interface (why kvemu isolates it); the master, loopback
    assert any(a.startswith(("0.0.0.0:", ":::")) for a in seen["client"]), seen
    assert seen["master"] and all(a.startswith("127.") for a in seen["master"]), seen
    assert facts["isolation"] == "netns" and facts["exposed"] == []
    listed = {e.rsplit(" ", 1)[1].replace("[", "").replace("]", "") for e in facts["listening"]}
    assert listed == set(seen["master"]) | set(seen["client"])
    assert all(not Path(f"/proc/{p}").exists() for p in r["pids"])  # master and child stopped


def _no_namespace_shell() -> str | None:
    """Why a shell with user namespaces disabled and no CAP_SYS_ADMIN cannot be made here (None where it can)."""
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        return "unshare or setpriv missing"
    r = subprocess.run(["unshare", "-Ur", "true"], capture_output=True, text=True, timeout=30)
    return None if r.returncode == 0 else f"unshare -Ur: {r.stderr.strip()}"


_NO_SHELL = _no_namespace_shell()


def _without_namespaces(*argv: str) -> subprocess.CompletedProcess:
    """``argv`` in an outer user namespace of this test's whose own limit of user namespaces is 0, with
    CAP_SYS_ADMIN dropped: neither unshare(CLONE_NEWNET) nor a new user namespace is allowed there."""
    inner = " ".join(shlex.quote(a) for a in argv)
    script = ("echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --bounding-set=-sys_admin "
              f"--inh-caps=-sys_admin {inner}")
    return subprocess.run(["unshare", "-Ur", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(_NO_SHELL is not None, reason=f"cannot disable namespaces for a child: {_NO_SHELL}")
def test_where_no_namespace_can_be_made_run_isolated_says_why():
    r = _without_namespaces(sys.executable, "-c", "from kvemu.isolation import run_isolated\n"
                                                  "try:\n run_isolated('os:getcwd', {})\n"
                                                  "except Exception as e:\n print(type(e).__name__, e)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("IsolationUnavailable unshare of a user and network namespace: "), r.stdout


@needs_store
@pytest.mark.skipif(_NO_SHELL is not None, reason=f"cannot disable namespaces for a child: {_NO_SHELL}")
def test_where_no_namespace_can_be_made_a_default_mooncake_calibration_is_refused_in_one_line(tmp_path):
    out = tmp_path / "mc.toml"
    r = _without_namespaces(sys.executable, "-m", "kvemu", "calibrate", "--backend", "mooncake", "--batches", "1,2",
                            "--sizes", "4KiB,8KiB", "--reps", "2", "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and lines[-1].startswith("Error: mooncake: the store client in kvemu"), lines
    assert "beyond loopback" in lines[-1] and "no private network namespace here: unshare of a user and network " \
                                              "namespace" in lines[-1]
    assert "pass mooncake:allow_exposed=1" in lines[-1]
    assert not out.exists()


@pytest.mark.skipif(_NO_SHELL is not None, reason=f"cannot make a user namespace here: {_NO_SHELL}")
def test_without_cap_sys_admin_the_namespace_is_an_unprivileged_user_namespace_with_the_users_own_ids():
    code = ("import json, os\nfrom kvemu.isolation import run_isolated\n"
            "r = run_isolated('test_isolation:probe_namespace', {'outside': []})\n"
            "print(json.dumps([r['isolation']['namespace'], r['interfaces'], r['ids'], [os.getuid(), os.getgid()]]))")
    # root drops CAP_SYS_ADMIN; any other user has none
    drop = ["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin"] if os.geteuid() == 0 else []
    r = subprocess.run([*drop, sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(HERE)))})
    assert r.returncode == 0, r.stderr
    how, interfaces, inside, outside = json.loads(r.stdout)
    assert how == "user and network namespace (unprivileged)" and interfaces == ["lo"]
    assert inside == outside  # files the child writes stay the user's
