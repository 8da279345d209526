"""The kvemu command in a private network namespace of its own (kvemu/__main__.py, kvemu/isolation.py):
which command lines enter one, and a real Mooncake replay without ``allow_exposed`` in it.

The oracles are this file's: the command lines' answers are written out by hand, and the namespace's
interfaces and the processes' listening sockets are read from /proc here while the replay runs, not by
kvemu's code. Where no namespace can be made is a real one (user namespaces disabled inside an outer
one of this test's, with CAP_SYS_ADMIN dropped), not a mock."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_isolation import _NO_SHELL, _listening  # the test's own /proc reading, one copy

from kvemu.isolation import wants_private_network

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"
SHORT = ["--layers", "1", "--requests", "0:2"]


# ------------------------------------------------------------------------------ the command-line rule
@pytest.mark.parametrize("argv, wanted", [
    (["replay", "t.parquet", "--backend", "mooncake", "--out", "r.parquet"], True),
    (["replay", "t.parquet", "--backend=mooncake:lease_ms=500", "--out", "r.parquet"], True),
    (["replay", "t.parquet", "--backend", "mooncake:allow_exposed=0"], True),
    (["replay", "t.parquet", "--backend", "mooncake:memcpy=1,allow_exposed=1"], False),
    (["replay", "t.parquet", "--backend", "mooncake:allow_exposed=1"], False),
    (["replay", "t.parquet", "--backend", "dram"], False),
    (["replay", "t.parquet", "--backend", "files:/tmp/mooncake"], False),
    (["replay", "mooncake", "--backend", "dram"], False),               # a trace named mooncake
    (["replay", "t.parquet", "--tiers", "dram|cap=1GiB;mooncake|cap=8GiB"], True),
    (["replay", "t.parquet", "--tiers=placement=write-through;mooncake:allow_exposed=1|cap=8GiB"], False),
    (["replay", "t.parquet", "--backend", "mooncake", "--help"], False),
    (["calibrate", "--backend", "mooncake"], False),                    # isolates its own child
    (["record", "--workload", "mooncake:conv.jsonl", "--model", "llama3-8b", "--out", "t.parquet"], False),
    (["demo"], False),
    ([], False),
    (["--version"], False),
    (["replay", "t.parquet", "--backend"], False),                      # click's to refuse
])
def test_which_command_lines_enter_a_namespace(argv, wanted):
    assert wants_private_network(argv) is wanted


def test_a_tiers_file_and_a_local_sweep_are_read_for_a_store(tmp_path):
    tiers = tmp_path / "stack.toml"
    tiers.write_text('[[tier]]\nbackend = "dram"\ncapacity = "1GiB"\n[[tier]]\nbackend = "mooncake"\n'
                     'capacity = "8GiB"\n')
    assert wants_private_network(["replay", "t.parquet", "--tiers", str(tiers)])
    tiers.write_text('[[tier]]\nbackend = "dram"\ncapacity = "1GiB"\n')
    assert not wants_private_network(["replay", "t.parquet", "--tiers", str(tiers)])
    assert not wants_private_network(["replay", "t.parquet", "--tiers", str(tmp_path / "missing.toml")])
    spec = tmp_path / "s.toml"
    spec.write_text('[backends]\nuse = ["dram"]\noptional = ["mooncake"]\n')
    assert wants_private_network(["sweep", str(spec), "--out", "runs"])
    assert wants_private_network(["sweep", "--out", "runs", "--executor=local", str(spec)])
    assert not wants_private_network(["sweep", str(spec), "--dry-run"])
    # a Dask cluster's workers run the cells, and this process must reach its scheduler
    assert not wants_private_network(["sweep", str(spec), "--out", "runs", "--executor", "dask://127.0.0.1:8786"])
    spec.write_text('[backends]\nuse = ["dram", "mooncake:allow_exposed=1"]\n')
    assert not wants_private_network(["sweep", str(spec), "--out", "runs"])
    spec.write_text('[backends\n')  # not TOML: the sweep says so itself
    assert not wants_private_network(["sweep", str(spec), "--out", "runs"])


def test_the_command_imports_nothing_that_starts_a_thread_before_the_namespace():
    # what __main__ has imported when it enters: the process's threads, from /proc, and no numpy/pyarrow
    code = ("import os, sys, kvemu.__main__ as m, kvemu.isolation as iso\n"
            "seen = []\n"
            "iso.enter_for_command = lambda argv: seen.append((len(os.listdir('/proc/self/task')), "
            "sorted(n for n in ('numpy', 'pyarrow', 'click', 'kvemu.cli') if n in sys.modules)))\n"
            "sys.argv = ['kvemu', '--version']\n"
            "try:\n    m.main()\nexcept SystemExit:\n    pass\nprint(seen, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.stderr.strip().splitlines()[-1] == "[(1, [])]", r.stderr


# ------------------------------------------------------------------------------ a real replay
def _mooncake_missing():
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any reason it cannot load is a reason to skip
        return f"{type(e).__name__}: {e}"
    return None


def _namespaces_here() -> str | None:
    r = subprocess.run([sys.executable, "-c", "from kvemu.isolation import enter_private_network as e; e()"],
                       capture_output=True, text=True, timeout=30, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["failed"])[-1]


_MISSING = _mooncake_missing()
_NO_NETNS = _namespaces_here()
needs_store = pytest.mark.skipif(_MISSING is not None, reason=f"Mooncake Store client not importable: {_MISSING}")
needs_netns = pytest.mark.skipif(_NO_NETNS is not None, reason=f"no network namespace here: {_NO_NETNS}")


def _interfaces(pid: int) -> list[str]:
    rows = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    return [r.split(":", 1)[0].strip() for r in rows if ":" in r]


def _masters(parent: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == parent and stat[stat.index("(") + 1:].startswith("mooncake_master") \
                    and fields[0] != "Z":
                found.append(int(d.name))
    return found


def _start(args, out):
    def default_signals():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])

    return subprocess.Popen([sys.executable, "-m", "kvemu", "replay", str(TRACE), "--backend", "mooncake", *args,
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=default_signals, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _watch(p) -> dict | None:
    """While ``p`` runs: its master, and what it and ``p`` listen on once the client has bound (read here)."""
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline:
        try:
            for m in _masters(p.pid):
                client = _listening(p.pid)
                if client:
                    return {"master": m, "client": client, "served": _listening(m), "netns": {
                        who: os.readlink(f"/proc/{pid}/ns/net") for who, pid in (("kvemu", p.pid), ("master", m))},
                        "interfaces": {"kvemu": _interfaces(p.pid), "master": _interfaces(m)}}
        except OSError:  # a process ended while read
            pass
        time.sleep(0.02)
    return None


@needs_netns
@needs_store
def test_a_default_mooncake_replay_runs_in_a_namespace_with_only_lo_and_says_so(tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "r.parquet"
    p = _start(SHORT, out)
    try:
        seen = _watch(p)
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert seen is not None, "the replay ended before its store was seen"
    mine = os.readlink("/proc/self/ns/net")
    assert seen["netns"]["kvemu"] == seen["netns"]["master"] != mine  # both in one namespace, not this one
    assert seen["interfaces"] == {"kvemu": ["lo"], "master": ["lo"]}
    # the client still binds every interface (there, that is loopback alone)
    assert any(a.startswith(("0.0.0.0:", "::")) for a in seen["client"]), seen
    facts = json.loads(pq.read_schema(out).metadata[b"kvemu"])["backend"]["facts"]
    assert facts["isolation"] == "netns" and facts["exposed"] == []
    listed = {e.rsplit(" ", 1)[1].replace("[", "").replace("]", "") for e in facts["listening"]}
    assert listed == seen["served"] | seen["client"]
    how = "network namespace" if os.geteuid() == 0 else "user and network namespace (unprivileged)"
    assert facts["isolation_how"] == (f"a private network namespace ({how}; interfaces: lo): "
                                      f"{len(listed)} listeners, reachable from it alone")
    assert out.stat().st_uid == os.getuid()  # the user's file
    assert not Path(f"/proc/{seen['master']}").exists()


@needs_netns
@needs_store
def test_ctrl_c_in_the_namespace_stops_the_master_and_leaves_nothing(tmp_path):
    out = tmp_path / "r.parquet"
    p = _start(["--layers", "32"], out)
    try:
        seen = _watch(p)
        assert seen is not None, p.communicate()[1] if p.poll() is not None else "no store within 120 s"
        folder = os.readlink(f"/proc/{seen['master']}/cwd")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert "interrupted by SIGINT" in err and "Traceback" not in err
    deadline = time.monotonic() + 5
    while os.path.exists(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(folder) and not Path(f"/proc/{seen['master']}").exists() and not out.exists()


@needs_store
@pytest.mark.skipif(_NO_SHELL is not None, reason=f"cannot disable namespaces for a child: {_NO_SHELL}")
def test_where_no_namespace_can_be_made_a_default_replay_is_refused_in_one_line_saying_why(tmp_path):
    out = tmp_path / "r.parquet"
    inner = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "kvemu", "replay", str(TRACE), "--backend",
                                               "mooncake", *SHORT, "--out", str(out)))
    script = ("echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --bounding-set=-sys_admin "
              f"--inh-caps=-sys_admin {inner}")
    r = subprocess.run(["unshare", "-Ur", "sh", "-c", script], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, lines
    assert lines[0].startswith("Error: mooncake: the store client in kvemu (pid ") and "beyond loopback" in lines[0]
    assert " listens on 0.0.0.0:" in lines[0] or " listens on [::]:" in lines[0]
    assert "; no private network namespace here: unshare of a user and network namespace: " in lines[0]
    assert lines[0].endswith("; pass mooncake:allow_exposed=1 to accept that (docs/backends.md)")
    assert not out.exists()
