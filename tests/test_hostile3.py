"""Hostile inputs, third round (issue 26 items 2, 5, 7, tracebacks, leftovers): each case is one
line on stderr, exit 2, nothing written and no input destroyed, within a bounded time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.schema import METADATA_KEY
from test_hostile import _refused  # one line on stderr, exit 2: the refusal every case here expects

SMALL = "synthetic:chat:sessions=1,turns=1"
NVME = """[profile]
name = "mine"
kind = "storage"
latency_ns = 65000.0
bandwidth_gbps = 7.0
concurrency = 64
"""
CONFIG = json.dumps({"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 1000, "intermediate_size": 512})


def _run(args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)




def _listing(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes: what a refusal must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- nesting: a parser's RecursionError is one line ------------------------------------------------

DEEP_JSON = "[" * 100_000 + "]" * 100_000
DEEP_TOML = "x = " + "[" * 100_000 + "]" * 100_000 + "\n"
# nested inline tables, shallower than the recursion limit but deeper than MAX_NESTING
DEEP_INLINE = "x = " + "{a=" * 200 + "1" + "}" * 200 + "\n"


def _with_metadata(src, dst, extra_raw: bytes):
    t = pq.read_table(src)
    raw = t.schema.metadata[METADATA_KEY]
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: raw.rstrip()[:-1] + b', "x": ' + extra_raw + b"}"}), dst)


@pytest.mark.parametrize("deep", [DEEP_JSON, "[" * 100 + "]" * 100], ids=["parser", "walkers"])
def test_deeply_nested_trace_metadata_is_one_line(chat_trace, tmp_path, deep):
    path = tmp_path / "deep.parquet"
    _with_metadata(chat_trace, path, deep.encode())
    for args in (["trace", "info", path], ["trace", "validate", path],
                 ["replay", path, "--backend", "vemu:nvme", "--out", tmp_path / "r.parquet"]):
        _refused(_run(args), "deep.parquet", "more than 64 levels deep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.parquet"]


@pytest.mark.parametrize("body", [DEEP_TOML, DEEP_INLINE], ids=["parser", "walkers"])
def test_deeply_nested_toml_is_one_line(chat_trace, tmp_path, body):
    deep = tmp_path / "deep.toml"
    deep.write_text(body)
    out = tmp_path / "r.parquet"
    for args in (["replay", chat_trace, "--backend", f"vemu:{deep}", "--out", out],
                 ["replay", chat_trace, "--backend", f"emu:{deep}", "--out", out],
                 ["sweep", deep, "--dry-run"],
                 ["analyze", "capacity", chat_trace, "--stack", deep],
                 ["analyze", "capacity", chat_trace, "--stack", "local-dram=1GiB", "--prices", deep]):
        _refused(_run(args), "deep.toml", "more than 64 levels deep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep.toml"]


def test_a_deeply_nested_model_config_is_one_line(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"num_hidden_layers": 2, "x": ' + DEEP_JSON + "}")
    _refused(_run(["record", "--workload", SMALL, "--model", cfg, "--out", tmp_path / "t.parquet"]),
             "config.json", "more than 64 levels deep")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_deeply_nested_results_metadata_is_one_line(chat_trace, tmp_path):
    res = tmp_path / "r.parquet"
    assert _run(["replay", chat_trace, "--backend", "vemu:nvme", "--layers", "1", "--out", res]).exit_code == 0
    _with_metadata(res, tmp_path / "deep.parquet", DEEP_JSON.encode())  # rewritten: no digest to match
    _refused(_run(["report", tmp_path / "deep.parquet"]), "deep.parquet", "more than 64 levels deep")


def test_nesting_depth_is_counted_without_recursion():
    from kvemu.inputs import MAX_NESTING, nesting_depth

    # hand-built: depth d is d lists one inside the other
    def nested(d):
        x = 0
        for _ in range(d):
            x = [x]
        return x
    assert [nesting_depth(v) for v in (0, [], {}, [1, {"a": [2]}], nested(5))] == [0, 1, 1, 3, 5]
    assert nesting_depth(nested(50_000)) == MAX_NESTING + 1  # stops counting past the bound


# --- every file a command reads is an input (item 2) ------------------------------------------------

def test_record_does_not_replace_its_model_config(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(CONFIG)
    _refused(_run(["record", "--workload", SMALL, "--model", cfg, "--out", cfg, "--force"]),
             "is one of this command's inputs")
    link = tmp_path / "link.json"
    link.symlink_to(cfg)  # the same file under another name
    _refused(_run(["record", "--workload", SMALL, "--model", cfg, "--out", link, "--force"]),
             "is one of this command's inputs")
    assert cfg.read_text() == CONFIG and sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "link.json"]
    # the check is on the file, not on the name: another output is written
    assert _run(["record", "--workload", SMALL, "--model", cfg, "--out", tmp_path / "t.parquet"]).exit_code == 0


@pytest.mark.parametrize("kind", ["vemu", "emu"])
@pytest.mark.parametrize("name", ["p.toml", "sub/profile"], ids=["toml", "path-without-suffix"])
def test_replay_does_not_replace_its_profile(chat_trace, tmp_path, kind, name):
    prof = tmp_path / name
    prof.parent.mkdir(exist_ok=True)
    prof.write_text(NVME)
    before = _listing(tmp_path)
    ref = str(prof) if "/" in name else os.path.relpath(prof)
    _refused(_run(["replay", chat_trace, "--backend", f"{kind}:{ref}", "--layers", "1", "--out", prof, "--force"]),
             "is one of this command's inputs")
    _refused(_run(["calibrate", "--backend", f"{kind}:{ref}", "--out", prof, "--force"]),
             "is one of this command's inputs")
    assert _listing(tmp_path) == before


def test_every_spec_names_the_files_it_reads():
    from kvemu.backend_spec import BackendSpec

    # a profile is a path when it holds "/" or ends in .toml (docs/tier-profiles.md), else a built-in
    cases = {"vemu:nvme": [], "emu:cxl-pool": [], "vemu:./p": ["./p"], "emu:/x/p.toml": ["/x/p.toml"],
             "vemu:p.toml": ["p.toml"], "mmap:/dev/shm/t.bin": ["/dev/shm/t.bin"], "dram": []}
    assert {s: BackendSpec.parse(s).files_read() for s in cases} == cases


@pytest.mark.parametrize("form", ["file", "compact"])
@pytest.mark.parametrize("repeat", ["1", "2"])
def test_replay_does_not_replace_its_tier_stack_or_a_profile_it_names(chat_trace, tmp_path, form, repeat):
    prof = tmp_path / "p.toml"
    prof.write_text(NVME)
    stack = tmp_path / "stack.toml"
    stack.write_text(f'[[tier]]\nbackend = "dram"\ncapacity = "1GiB"\n[[tier]]\nbackend = "vemu:{prof}"\n'
                     f'capacity = "8TiB"\n')
    tiers = str(stack) if form == "file" else f"dram|cap=1GiB;vemu:{prof}|cap=8TiB"
    before = _listing(tmp_path)
    for victim in ([stack, prof] if form == "file" else [prof]):
        _refused(_run(["replay", chat_trace, "--tiers", tiers, "--requests", "0:2", "--layers", "1",
                       "--repeat", repeat, "--out", victim, "--force"]), "is one of this command's inputs")
    assert _listing(tmp_path) == before
    from kvemu.replay.stack import parse_tiers

    assert parse_tiers(tiers).files_read() == ([str(stack)] if form == "file" else []) + [str(prof)]


# --- names no file can have: one line at every entry point ------------------------------------------

LONG = "x" * 300


def _entry_points(trace, results, tmp_path, bad):
    """Each command with ``bad`` in one of the places it takes a file name."""
    sweep = Path(__file__).parent.parent / "examples" / "sweep.toml"
    return [
        ["replay", f"{bad}.parquet", "--backend", "dram", "--out", tmp_path / "r.parquet"],
        ["replay", trace, "--backend", "vemu:nvme", "--layers", "1", "--out", f"{bad}.parquet"],
        ["replay", trace, "--backend", "vemu:nvme", "--layers", "1", "--dataset", bad],
        ["replay", trace, "--backend", f"vemu:{bad}.toml", "--out", tmp_path / "r.parquet"],
        ["record", "--workload", SMALL, "--model", "llama3-8b", "--out", f"{bad}.parquet"],
        ["record", "--workload", f"mooncake:{bad}.jsonl", "--model", "llama3-8b", "--out", tmp_path / "t.parquet"],
        ["record", "--workload", SMALL, "--model", f"{bad}.json", "--out", tmp_path / "t.parquet"],
        ["trace", "info", f"{bad}.parquet"],
        ["trace", "validate", f"{bad}.parquet"],
        ["trace", "upgrade", f"{bad}.parquet", "--out", tmp_path / "u.parquet"],
        ["report", f"{bad}.parquet"],
        ["report", results, "--trace", f"{bad}.parquet"],
        ["report", results, "--html", f"{bad}.html"],
        ["sweep", f"{bad}.toml", "--dry-run"],
        ["sweep", sweep, "--out", bad],
        ["analyze", "capacity", f"{bad}.parquet"],
        ["analyze", "capacity", trace, "--stack", f"{bad}.toml"],
        ["analyze", "breakeven", f"{bad}.parquet"],
        ["calibrate", "--backend", "vemu:nvme", "--out", f"{bad}.toml"],
        ["demo", "--out", bad],
    ]


@pytest.fixture(scope="module")
def results_file(chat_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("res") / "r.parquet"
    assert _run(["replay", chat_trace, "--backend", "vemu:nvme", "--layers", "1", "--out", out]).exit_code == 0
    return out


@pytest.mark.parametrize("which", range(20))
def test_a_300_byte_name_is_one_line_everywhere(chat_trace, results_file, tmp_path, monkeypatch, which):
    monkeypatch.chdir(tmp_path)
    args = _entry_points(chat_trace, results_file, tmp_path, LONG)[which]
    _refused(_run(args), "x" * 40)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("which", range(20))
def test_a_symlink_loop_is_one_line_everywhere(chat_trace, results_file, tmp_path, monkeypatch, which):
    monkeypatch.chdir(tmp_path)
    os.symlink("b", "a")
    os.symlink("a", "b")
    args = _entry_points(chat_trace, results_file, tmp_path, "a/x")[which]
    _refused(_run(args), "a/x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize("bad", ["long", "loop"])
def test_unusable_names_are_kvemu_errors_in_the_library(chat_trace, results_file, tmp_path, monkeypatch, bad):
    """The library refuses such names itself (InputError/OutputError/TraceError...), so the CLI's
    backstop for a raw OSError/RuntimeError (cli.unusable_name_message) is never reached."""
    import kvemu.cli

    monkeypatch.setattr(kvemu.cli, "unusable_name_message", lambda e: None)  # the backstop off
    for which, args in enumerate(_entry_points(chat_trace, results_file, tmp_path, LONG if bad == "long" else "a/x")):
        where = tmp_path / f"{bad}{which}"
        where.mkdir()
        monkeypatch.chdir(where)
        if bad == "loop":
            os.symlink("b", "a")
            os.symlink("a", "b")
        _refused(_run(args), "x" * 40 if bad == "long" else "a/x")
        assert sorted(p.name for p in where.iterdir()) == ([] if bad == "long" else ["a", "b"]), args


def test_an_output_that_is_a_looping_symlink_is_refused(chat_trace, tmp_path):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    for force in ([], ["--force"]):
        _refused(_run(["replay", chat_trace, "--backend", "vemu:nvme", "--layers", "1", "--out", tmp_path / "a",
                       *force]), str(tmp_path / "a"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


# --- bounds before expansion (item 5) and sizes up to the documented maximum (item 7) ---------------

def _spec(tmp_path, trace, body, name="s.toml"):
    p = tmp_path / name
    p.write_text(f'[[trace]]\npath = "{trace}"\n[backends]\nuse = ["dram", "vemu:nvme"]\n' + body)
    return p


def test_a_sweep_of_25_million_cells_is_refused_before_expansion(chat_trace, tmp_path):
    from timing_noise import host_units

    grid = "[sweep]\nrepetitions = 1000\n[grid]\ninstances = [%s]\nreplay_layers = [%s]\n" % (
        ",".join(map(str, range(1, 161))), ",".join(map(str, range(1, 81))))
    spec = _spec(tmp_path, chat_trace, grid)
    res, units = host_units(lambda: _run(["sweep", spec, "--dry-run"]))
    # 2 backends x 160 x 80 x 1000 repetitions, counted by hand
    _refused(res, "25,600,000 cells", "at most 100,000")
    # expanding them took 45 minutes; refusing parses a small file
    assert units < 40, f"the refusal cost {units:.0f} reference units (timing_noise.host_units)"
    # the bound itself: exactly 100,000 cells (2 x 50 x 1000) are expanded
    ok = _spec(tmp_path, chat_trace, "[sweep]\nrepetitions = 1000\n[grid]\ninstances = [%s]\n"
               % ",".join(map(str, range(1, 51))), "ok.toml")
    from kvemu.sweep import MAX_CELLS, load_sweep
    assert len(load_sweep(ok).cells) == MAX_CELLS == 100_000


def test_a_grid_of_recorded_traces_is_bounded_before_expansion(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text('[[trace]]\nworkload = "synthetic:chat"\nmodel = "llama3-8b"\nseed = [%s]\nmax_requests = [%s]\n'
                    '[backends]\nuse = ["dram"]\n' % (",".join(map(str, range(1000))), ",".join(map(str, range(1, 1001)))))
    _refused(_run(["sweep", spec, "--dry-run"]), "1,000,000 traces", "at most 100,000")


@pytest.mark.parametrize("retries,ok", [(0, True), (100, True), (101, False), (10**12, False), (-1, False)])
def test_sweep_retries_are_bounded(chat_trace, tmp_path, retries, ok):
    spec = _spec(tmp_path, chat_trace, f"[sweep]\nretries = {retries}\n")
    res = _run(["sweep", spec, "--dry-run"])
    if ok:
        assert res.exit_code == 0, res.output
    else:
        _refused(res, "[sweep] retries must be an integer from 0 to 100")


@pytest.mark.parametrize("text,value", [("4EiB", 4 << 60), ("1EiB", 1 << 60), ("2PiB", 2 << 50), ("1PB", 10**15),
                                         ("3EB", 3 * 10**18)])
def test_sizes_up_to_the_documented_maximum_parse(text, value):
    from kvemu.units import MAX_SIZE, parse_size

    assert parse_size(text) == value and MAX_SIZE == 4 << 60


def test_max_memory_4eib_is_accepted_and_5eib_names_the_bound(chat_trace, tmp_path):
    out = tmp_path / "r.parquet"
    assert _run(["replay", chat_trace, "--backend", "vemu:nvme", "--layers", "1", "--max-memory", "4EiB",
                 "--out", out]).exit_code == 0
    _refused(_run(["replay", chat_trace, "--backend", "vemu:nvme", "--max-memory", "5EiB", "--out", tmp_path / "x"]),
             "--max-memory '5EiB' is too large (at most 4 EiB)")


# --- Dask: bounded in time (item 5) ------------------------------------------------------------------

@pytest.fixture
def silent_port():
    """A loopback port that accepts TCP connections and never says a word."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass
    t = threading.Thread(target=accept, daemon=True, name="silent-port")
    t.start()
    yield srv.getsockname()[1], held
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


def test_a_port_that_never_speaks_dask_is_refused_within_the_connect_timeout(chat_trace, tmp_path, silent_port):
    pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    from kvemu.errors import ConfigError
    from kvemu.sweep import run_sweep

    port, held = silent_port
    spec = _spec(tmp_path, chat_trace, "")
    before = set(threading.enumerate())
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"accepted the connection but did not answer as a Dask scheduler within 2 s"):
        run_sweep(spec, tmp_path / "out", executor=f"dask://127.0.0.1:{port}", connect_timeout_s=2)
    # it waited the timeout (a wall-clock wait, not CPU work), and not for ever: the sweep hung before
    assert 2 <= time.monotonic() - t0 < 60
    assert not (tmp_path / "out").exists()
    # nothing is left of the attempt: no thread (neither the one that connected nor the client's IO loop)
    # and no connection: the port's end of it reads the end of the stream (after the client's handshake)
    assert [th.name for th in set(threading.enumerate()) - before] == []
    assert held
    for c in held:
        c.settimeout(10)  # a bound on a socket read, not a timing assertion: EOF comes at once
        while c.recv(1 << 16):
            pass


def test_a_sweep_whose_only_resource_worker_dies_fails_its_cells(chat_trace, tmp_path):
    distributed = pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    from kvemu.sweep import run_sweep

    spec = _spec(tmp_path, chat_trace, "[sweep]\nrepetitions = 12\n[grid]\nreplay_layers = [1]\nrequests = [\"0:2\"]\n")
    spec.write_text(spec.read_text().replace('["dram", "vemu:nvme"]', '["dram"]'))
    cluster = distributed.LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1",
                                         dashboard_address=None)
    worker = None
    try:
        worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", cluster.scheduler_address,
                                   "--nthreads", "1", "--resources", "mem=1", "--no-dashboard", "--host", "127.0.0.1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

        class KillOnFirst:  # a Progress stand-in: the worker dies once the first cell is back
            total = None

            def __call__(self, done):
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()

            def close(self, n):
                pass
        t0 = time.monotonic()
        summary = run_sweep(spec, tmp_path / "out", executor=f"dask://{cluster.scheduler_address}",
                            placement_timeout_s=60, progress=KillOnFirst())
        # the first wait is for the worker to start (60 s); then the poll sees the loss, and gives up
        # on the cells after placement_timeout_s. Before, the sweep waited for ever.
        elapsed = time.monotonic() - t0
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait()
        cluster.close()
    assert summary["ran"] >= 1 and summary["ran"] + len(summary["failed"]) == 12, summary
    assert summary["failed"], "the worker died after the first cell: some cells had nowhere to run"
    # which of the two depends on where Dask put the trace's bytes: on the dead worker, its cells are
    # cancelled; elsewhere, they wait for a worker with 'mem' (test below)
    assert all("no worker has offered resource 'mem' for 60 s" in f["error"] or "cancelled by the Dask scheduler"
               in f["error"] for f in summary["failed"]), summary["failed"]
    assert elapsed < 600


def test_cells_waiting_for_a_resource_no_worker_offers_fail_after_the_wait(chat_trace, tmp_path):
    distributed = pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    from kvemu.sweep import _run_dask, load_sweep

    spec = _spec(tmp_path, chat_trace, "[sweep]\nrepetitions = 2\n")
    spec.write_text(spec.read_text().replace('["dram", "vemu:nvme"]', '["numa:9"]'))
    sweep = load_sweep(spec)
    summary = {"failed": [], "skipped": [], "ran": 0}
    lines = []
    with distributed.LocalCluster(n_workers=1, processes=False, protocol="tcp", host="127.0.0.1",
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        # what the sweep is left with once the workers with numa9 are gone: the cells are queued
        # on the scheduler with nowhere to run
        t0 = time.monotonic()
        _run_dask(client, sweep, sweep.cells, {sweep.traces[0].name: chat_trace}, tmp_path / "out", "dask://x",
                  lines.append, None, summary, placement_timeout_s=1.0)
        elapsed = time.monotonic() - t0
    assert summary["ran"] == 0 and len(summary["failed"]) == 2 and len(lines) == 2
    assert all("no worker has offered resource 'numa9' for 1 s" in f["error"] for f in summary["failed"])
    assert 1.0 <= elapsed < 120  # the wait, then the poll: wall-clock waits, bounded loosely


# --- record and replay accept the same ranges, and say who gave the value (item 7) -------------------

def _record(tmp_path, *extra, name="t.parquet"):
    return _run(["record", "--workload", SMALL, "--model", "llama3-8b", *extra, "--out", tmp_path / name])


@pytest.mark.parametrize("tokens,ok", [(16 * 65536, True), (16 * 65536 + 16, False), (2**31, False)])
def test_record_and_replay_bound_the_chunk_alike(chat_trace, tmp_path, tokens, ok):
    # 65536 blocks of 16 tokens at most, said by hand
    rec = _record(tmp_path, "--chunk-tokens", tokens)
    rep = _run(["replay", chat_trace, "--backend", "vemu:nvme", "--layers", "1", "--chunk-tokens", tokens,
                "--out", tmp_path / "r.parquet"])
    if ok:
        assert rec.exit_code == 0, rec.output
        assert rep.exit_code == 0, rep.output
    else:
        for res in (rec, rep):
            _refused(res, "--chunk-tokens must be a positive multiple of the 16 tokens per block, at most 1048576",
                     f"got {tokens}")
        assert not list(tmp_path.iterdir())


def test_a_bad_chunk_in_a_trace_is_named_as_the_trace_field(chat_trace, tmp_path):
    t = pq.read_table(chat_trace)
    meta = json.loads(t.schema.metadata[METADATA_KEY])
    meta["engine"]["transfer_chunk_tokens"] = 2**31
    bad = tmp_path / "bad.parquet"
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), bad)
    line = _refused(_run(["replay", bad, "--backend", "vemu:nvme", "--out", tmp_path / "r.parquet"]),
                    "bad.parquet: trace metadata engine.transfer_chunk_tokens must be")
    assert "--chunk-tokens" not in line  # the user gave no option: the file did


def test_record_refuses_a_tier_smaller_than_the_chunk_replay_refuses(tmp_path, chat_trace):
    # llama3-8b: 32 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes = 128 KiB per token, 16 tokens
    # a block, 256-token chunks: 32 MiB a chunk of all layers = 0.03125 GiB
    chunk = 32 * 8 * 128 * 2 * 2 * 256
    line = _refused(_record(tmp_path, "--tier-capacity-gib", "1e-12"), "--tier-capacity-gib must hold at least one "
                    f"transfer chunk of llama3-8b ({chunk} bytes")
    assert "as replay's --tier-capacity must" in line
    _refused(_run(["replay", chat_trace, "--backend", "vemu:nvme", "--tier-capacity", chunk - 1,
                   "--out", tmp_path / "r.parquet"]), f"--tier-capacity must hold at least one chunk ({chunk} bytes)")
    assert not list(tmp_path.iterdir())
    assert _record(tmp_path, "--tier-capacity-gib", chunk / 2**30).exit_code == 0  # the bound itself is accepted


def _results_meta(path) -> dict:
    return json.loads(pq.read_schema(path).metadata[METADATA_KEY])


@pytest.mark.parametrize("schedule", ["recorded", "closed"])
def test_a_trace_recorded_with_a_one_chunk_tier_replays(tmp_path, schedule):
    # the brief's command, shortened: 0.03125 GiB is one 256-token chunk of llama3-8b (32 MiB)
    rec = _run(["record", "--workload", "synthetic:chat", "--model", "llama3-8b", "--tier-capacity-gib", "0.03125",
                "--max-requests", "8", "--out", tmp_path / "t.parquet"])
    assert rec.exit_code == 0, rec.output
    # the oracle, from the entries: a store range of more than 16 blocks (one chunk) in one step means a
    # replay call touches at least two chunks of a one-chunk tier
    entries = pq.read_table(tmp_path / "t.parquet", columns=["row_type", "store_count"]).to_pydict()
    assert max(c for c in entries["store_count"] if c is not None) > 16
    for backend, given in (("dram", []), ("vemu:nvme", []), ("dram", ["--tier-capacity", "32MiB"])):
        out = tmp_path / "r.parquet"
        res = _run(["replay", tmp_path / "t.parquet", "--backend", backend, "--schedule", schedule, *given,
                    "--layers", "2", "--out", out, "--force"])
        assert res.exit_code == 0, res.output
        tier = _results_meta(out)["tier"]
        assert tier["capacity_chunks"] == 1
        assert tier["capacity_from"] == ("--tier-capacity" if given else "trace")
        assert tier["call_overflow_chunks"] >= 1 and tier["evictions"] >= tier["call_overflow_chunks"]
        origin = "--tier-capacity" if given else "the trace's engine.tier_capacity_blocks"
        assert (f"chunks were evicted by the replay call that stored or loaded them: one engine step touches more "
                f"chunks than the tier's 1 ({origin})") in res.output
    # a tier that holds every touched chunk: no call overflows it, no warning
    res = _run(["replay", tmp_path / "t.parquet", "--backend", "dram", "--schedule", schedule, "--tier-capacity",
                "64GiB", "--max-memory", "64GiB", "--layers", "1", "--out", tmp_path / "big.parquet"])
    assert res.exit_code == 0, res.output
    assert _results_meta(tmp_path / "big.parquet")["tier"]["call_overflow_chunks"] == 0
    assert "evicted by the replay call" not in res.output


@pytest.mark.parametrize("command", ["record", "replay"])
@pytest.mark.parametrize("value", ["1e9", "nan", "0"])
def test_time_scale_refusals_say_the_bound(chat_trace, tmp_path, command, value):
    args = (["record", "--workload", SMALL, "--model", "llama3-8b"] if command == "record" else
            ["replay", chat_trace, "--backend", "vemu:nvme"])
    shown = {"1e9": "1e+09", "nan": "nan", "0": "0"}[value]
    _refused(_run([*args, "--time-scale", value, "--out", tmp_path / "o.parquet"]),
             f"--time-scale must be a positive number below 1e+09, got {shown}")


def test_csv_cells_that_look_like_formulas_are_escaped(chat_trace, tmp_path):
    import csv
    import io

    labels = ["=1+2", "+cmd", "-2", "@SUM(A1)", "plain"]
    outs = []
    for i, label in enumerate(labels):
        out = tmp_path / f"r{i}.parquet"
        assert _run(["replay", chat_trace, "--backend", "vemu:nvme", "--layers", "1", "--label", label,
                     "--out", out]).exit_code == 0
        outs.append(out)
    res = _run(["report", *outs, "--csv"])
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO(res.output)))
    # as OWASP's CSV-injection advice has it: a leading quote makes the cell text
    assert sorted(r["label"] for r in rows) == sorted(["'=1+2", "'+cmd", "'-2", "'@SUM(A1)", "plain"])
