"""Sweeps: spec parsing and its errors, dry-run expansion, a local sweep into a dataset, resume, and
placement by resources on a real Dask cluster (docs/scale-out.md)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvemu.errors import ConfigError, KvemuError, OutputError
from kvemu.report import build_report
from kvemu.schema import METADATA_KEY
from kvemu.sweep import cell_resources, finished_path, load_sweep, plan_lines, run_sweep

ROOT = Path(__file__).resolve().parents[1]
TRACES = [ROOT / "traces" / "chat-llama3-8b-offload.parquet", ROOT / "traces" / "chat-llama3-8b-resident.parquet"]

SMALL = f"""
[sweep]
name = "small"
[[trace]]
path = "{TRACES[0]}"
[[trace]]
path = "{TRACES[1]}"
[backends]
use = ["vemu:cxl-pool", "dram"]
[grid]
replay_layers = [1]
requests = ["0:1"]  # one request: the closed loop still replays every request it batches with (0:4: ~13 s a dram cell)
"""


def write_spec(tmp_path, text: str, name="spec.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def meta_of(path) -> dict:
    return json.loads(pq.read_schema(path).metadata[METADATA_KEY])


# ---------------------------------------------------------------------------------------- spec
def test_example_spec_parses_and_expands():
    sweep = load_sweep(ROOT / "examples" / "sweep.toml")
    # 2 traces x 5 backends (3 + 2 optional) x overlap 2 x repetitions 2
    assert len(sweep.cells) == 2 * 5 * 2 * 2
    assert {c.backend for c in sweep.cells if c.optional} == {"numa:0", "uring:/var/tmp/kvemu-sweep-tier.bin"}


def test_dry_run_expansion_count_and_estimate(tmp_path):
    text = (SMALL.replace("replay_layers = [1]", "replay_layers = [1, 2]\noverlap = [false, true]")
            .replace('name = "small"', 'name = "small"\nrepetitions = 3'))
    spec = write_spec(tmp_path, text)
    sweep = load_sweep(spec)
    assert len(sweep.cells) == 2 * 2 * 2 * 2 * 3
    lines = plan_lines(sweep, tmp_path / "out")
    assert len(lines) == len(sweep.cells) + 1
    assert all(" todo " in line for line in lines[:-1])
    assert lines[-1].startswith("48 cells, 48 to run, estimated") and "estimator:" in lines[-1]
    # the repetitions of one cell share its hash; different parameters do not
    keys = {c.key for c in sweep.cells}
    assert len(keys) == 16 and len({c.run_id for c in sweep.cells}) == 48


def test_measured_cells_repeat_three_times_unless_the_spec_says(tmp_path):
    # no [sweep] repetitions: dram (measured) three times, to show its spread; virtual time once
    sweep = load_sweep(write_spec(tmp_path, SMALL))
    per = {b: sorted(c.repetition for c in sweep.cells if c.backend == b and c.trace == sweep.traces[0])
           for b in ("dram", "vemu:cxl-pool")}
    assert per == {"dram": [0, 1, 2], "vemu:cxl-pool": [0]}
    # given, it holds for every backend
    sweep = load_sweep(write_spec(tmp_path, SMALL.replace('name = "small"', 'name = "small"\nrepetitions = 1'),
                                  "one.toml"))
    assert len(sweep.cells) == 2 * 2


def test_cell_hash_is_stable_across_spec_order(tmp_path):
    a = load_sweep(write_spec(tmp_path, SMALL, "a.toml"))
    b = load_sweep(write_spec(tmp_path, SMALL.replace('["vemu:cxl-pool", "dram"]', '["dram", "vemu:cxl-pool"]'),
                              "b.toml"))
    assert {c.run_id for c in a.cells} == {c.run_id for c in b.cells}


def test_recorded_trace_options_are_a_grid(tmp_path):
    spec = write_spec(tmp_path, """
[[trace]]
workload = "synthetic:chat"
model = "llama3-8b"
max_requests = 8
tier_capacity_gib = [1, 4]
hbm_kv_gib = 2
[backends]
use = ["vemu:nvme"]
""")
    sweep = load_sweep(spec)
    assert [t.name for t in sweep.traces] == ["chat-llama3-8b-tier_capacity_gib=1", "chat-llama3-8b-tier_capacity_gib=4"]
    assert len(sweep.cells) == 2
    assert "?" in plan_lines(sweep)[0]  # cost unknown until recorded


@pytest.mark.parametrize("text, message", [
    ("[[trace]\n", "not valid TOML"),
    ("[backends]\nuse = ['dram']\n", "no [[trace]] given"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n", "no [backends] given"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = []\n", "lists no backend"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['floppy']\n", "unknown backend 'floppy'"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram', 'dram']\n", "listed twice"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = 'dram'\n", "must be a list of backend specs"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\nwanted = []\n", "unknown key in [backends] 'wanted'"),
    ("[[trace]]\npath = 'nowhere.parquet'\n[backends]\nuse = ['dram']\n", "not found"),
    (f"[[trace]]\npath = '{TRACES[0]}'\nworkload = 'synthetic:chat'\n[backends]\nuse = ['dram']\n", "not both"),
    ("[[trace]]\nname = 'x'\n[backends]\nuse = ['dram']\n", "not neither"),
    ("[[trace]]\nworkload = 'synthetic:chat'\n[backends]\nuse = ['dram']\n", "needs model"),
    (f"[[trace]]\npath = '{TRACES[0]}'\nhbm_kv_gib = 2\n[backends]\nuse = ['dram']\n", "applies to recorded"),
    (f"[[trace]]\npath = '{TRACES[0]}'\ncolour = 2\n[backends]\nuse = ['dram']\n", "unknown key in [[trace]] #1 'colour'"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n", "used twice"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n[grid]\nlayers = [1]\n", "unknown key in [grid] 'layers'"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n[grid]\nreplay_layers = [0]\n", "replay_layers"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n[grid]\noverlap = ['yes']\n", "true or false"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n[grid]\ninstances = [0]\n", "instances"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n[grid]\nsharing = ['pooled']\n", "sharing"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n[grid]\nrequests = ['9:3']\n", "START < END"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n[grid]\nrequests = []\n", "empty list"),
    (f"[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n[grid]\noverlap = [true, true]\n", "twice"),
    (f"[sweep]\nrepetitions = 0\n[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n", "repetitions"),
    (f"[sweep]\nmax_memory = 'lots'\n[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n", "max_memory"),
    (f"[sweep]\nspeed = 1\n[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n", "unknown key in [sweep]"),
    (f"[matrix]\n[[trace]]\npath = '{TRACES[0]}'\n[backends]\nuse = ['dram']\n", "unknown top-level table 'matrix'"),
])
def test_spec_errors_are_one_line_config_errors(tmp_path, text, message):
    spec = write_spec(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_sweep(spec)
    assert message in str(e.value)
    assert str(e.value).startswith(str(spec)) and "\n" not in str(e.value)


def test_missing_spec_file(tmp_path):
    with pytest.raises(ConfigError, match="sweep spec not found"):
        load_sweep(tmp_path / "absent.toml")


def test_resources_follow_the_backend():
    assert cell_resources("dram") == {"mem": 1}
    assert cell_resources("emu:cxl-pool") == {"mem": 1}
    assert cell_resources("vemu:cxl-pool") == {}
    assert cell_resources("numa:1") == {"numa1": 1}
    assert cell_resources("uring:/mnt/nvme/kv.bin,qd=32") == {"uring": 1}
    assert cell_resources("mmap:/dev/dax0.0") == {"dax": 1}
    assert cell_resources("mmap:/tmp/pool.bin") == {"mem": 1}


# ---------------------------------------------------------------------------------------- local
@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    # one repetition: the default's three on dram would double this slow test (the default: above)
    spec = write_spec(root, SMALL.replace('name = "small"', 'name = "small"\nrepetitions = 1'))
    out = root / "out"
    summary = run_sweep(spec, out)
    return spec, out, summary


def test_local_sweep_writes_the_dataset_and_a_report(local_sweep):
    spec, out, summary = local_sweep
    assert summary["ran"] == 4 and not summary["failed"] and summary["already_done"] == 0
    files = sorted(out.rglob("results.parquet"))
    assert len(files) == 4
    sweep = load_sweep(spec)
    for cell in sweep.cells:
        path = finished_path(out, cell)
        rel = path.relative_to(out).parts
        assert rel[0].startswith("backend=") and rel[1].startswith("host=") and rel[2] == f"run_id={cell.run_id}"
        meta = meta_of(path)
        assert meta["run_id"] == cell.run_id
        assert meta["sweep"]["cell"] == cell.key and meta["sweep"]["executor"] == "local"
        assert meta["params"]["reductions"]["layers"]["replayed"] == [0]
    assert {p.parts[-4] for p in files} == {"backend=dram", "backend=vemu-cxl-pool"}
    assert not list(out.rglob("*.part")) and not (out / ".sweep-work").exists()
    rep = build_report([str(out)])
    # the two traces record one workload (two policies): one comparison
    assert len(rep.rows) == 4 and len(rep.groups) == 1 and len(rep.groups[0].trace_shas) == 2 and not rep.skipped


def test_resume_skips_done_cells_and_reruns_a_deleted_one(local_sweep):
    spec, out, _ = local_sweep
    again = run_sweep(spec, out)
    assert again["ran"] == 0 and again["already_done"] == 4
    assert all(" done " in line for line in plan_lines(load_sweep(spec), out)[:-1])
    victim = sorted(out.rglob("results.parquet"))[0]
    others = {p: p.stat().st_mtime_ns for p in out.rglob("results.parquet") if p != victim}
    victim.unlink()
    third = run_sweep(spec, out)
    assert third["ran"] == 1 and third["already_done"] == 3
    assert victim.exists()
    assert {p: p.stat().st_mtime_ns for p in others} == others


def test_a_half_written_file_is_not_a_finished_cell(tmp_path):
    spec = write_spec(tmp_path, SMALL.replace('["vemu:cxl-pool", "dram"]', '["vemu:cxl-pool"]')
                      .replace(f'[[trace]]\npath = "{TRACES[1]}"\n', ""))
    cell = load_sweep(spec).cells[0]
    out = tmp_path / "out"
    folder = out / "backend=vemu-cxl-pool" / "host=h" / f"run_id={cell.run_id}"
    folder.mkdir(parents=True)
    (folder / ".results.parquet.x.part").write_bytes(b"PAR1 half")
    assert finished_path(out, cell) is None
    assert run_sweep(spec, out)["ran"] == 1


def test_unavailable_optional_backend_is_skipped_not_failed(tmp_path):
    spec = write_spec(tmp_path, SMALL.replace('use = ["vemu:cxl-pool", "dram"]', 'optional = ["numa:63"]')
                      .replace(f'[[trace]]\npath = "{TRACES[1]}"\n', ""))
    summary = run_sweep(spec, tmp_path / "out")
    # a measured backend's three default repetitions, each skipped
    assert summary["ran"] == 0 and not summary["failed"] and len(summary["skipped"]) == 3
    assert not list((tmp_path / "out").rglob("*.parquet"))


def test_unknown_executor(tmp_path):
    with pytest.raises(ConfigError, match="unknown executor"):
        run_sweep(write_spec(tmp_path, SMALL), tmp_path / "out", executor="ray://x")


def test_dask_missing_is_a_clear_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'kvemu\[dask\]'"):
        run_sweep(write_spec(tmp_path, SMALL), tmp_path / "out", executor="dask://127.0.0.1:8786")


# ----------------------------------------------------------------------------------------- dask
@pytest.fixture(scope="module")
def cluster():
    distributed = pytest.importorskip("distributed", reason="Dask distributed not installed (pip install 'kvemu[dask]')")
    # Two workers in this process: only "mem" has the memory resource.
    spec = {
        "mem": {"cls": distributed.Worker, "options": {"nthreads": 1, "resources": {"mem": 1}, "host": "127.0.0.1"}},
        "plain": {"cls": distributed.Worker, "options": {"nthreads": 1, "host": "127.0.0.1"}},
    }
    # All on loopback: plain TCP elsewhere is refused without --insecure (test_sweep_security.py), and
    # workers on this host's other addresses may not reach each other quickly.
    c = distributed.SpecCluster(scheduler={"cls": distributed.Scheduler,
                                           "options": {"dashboard_address": None, "host": "127.0.0.1"}},
                                workers=spec, asynchronous=False)
    yield c
    c.close()


def test_dask_places_cells_on_the_worker_with_the_resource(cluster, tmp_path):
    spec = write_spec(tmp_path, SMALL.replace('["vemu:cxl-pool", "dram"]', '["dram"]')
                      .replace('name = "small"', 'name = "small"\nrepetitions = 1'))
    out = tmp_path / "out"
    summary = run_sweep(spec, out, executor=f"dask://{cluster.scheduler_address}", placement_timeout_s=5)
    assert summary["ran"] == 2 and not summary["failed"]
    mem_worker = cluster.workers["mem"].address
    for cell in load_sweep(spec).cells:
        meta = meta_of(finished_path(out, cell))
        assert meta["sweep"]["worker"] == mem_worker
        assert meta["sweep"]["executor"].startswith("dask://")
    assert run_sweep(spec, out, executor=f"dask://{cluster.scheduler_address}")["ran"] == 0


def test_dask_cell_needing_a_resource_no_worker_has_fails_clearly(cluster, tmp_path):
    spec = write_spec(tmp_path, SMALL.replace('["vemu:cxl-pool", "dram"]', '["numa:7"]'))
    with pytest.raises(ConfigError, match="no worker of .* has resource 'numa7' needed by backend numa:7"):
        run_sweep(spec, tmp_path / "out", executor=f"dask://{cluster.scheduler_address}", placement_timeout_s=1)
    assert not (tmp_path / "out").exists()  # refused before any folder was made


def test_link_and_store_timing_are_grid_axes_and_old_keys_stay(tmp_path):
    from kvemu.sweep import Cell, TraceSource

    base = dict(trace=TraceSource("t", path="x"), trace_id="abc", backend="vemu:nvme", optional=False,
                replay_layers=None, overlap=False, instances=1, sharing="shared", requests=None, arrival_ms=None,
                max_memory=1 << 30, repetition=0)
    plain, cpu = Cell(**base), Cell(**base, link="cpu", store_timing="serial")
    # a cell at the defaults keeps the key it had before these axes existed: old datasets resume
    assert "link" not in plain.params() and "store_timing" not in plain.params()
    assert cpu.params()["link"] == "cpu" and cpu.params()["store_timing"] == "serial"
    assert plain.key != cpu.key


# ------------------------------------------------------------------ the output folder, refusals
def _nothing_created(root: Path, before: set) -> bool:
    return {p for p in root.rglob("*")} == before


def test_out_under_a_regular_file_is_one_line_output_error(tmp_path):
    spec = write_spec(tmp_path, SMALL)
    (tmp_path / "afile").write_text("x")
    before = set(tmp_path.rglob("*"))
    with pytest.raises(OutputError, match=r"afile/out: cannot be created: .*afile is not a folder"):
        run_sweep(spec, tmp_path / "afile" / "out")
    with pytest.raises(OutputError, match=r"afile: exists and is not a folder"):
        run_sweep(spec, tmp_path / "afile")
    assert _nothing_created(tmp_path, before) and (tmp_path / "afile").read_text() == "x"


def test_out_in_a_read_only_folder_is_one_line_output_error(tmp_path):
    """A read-only folder (chmod 0555) for a user; as root, which writes there anyway, a read-only
    tmpfs mounted in a private mount namespace (``unshare -m``) around the CLI."""
    spec = write_spec(tmp_path, SMALL)
    ro = tmp_path / "ro"
    ro.mkdir()
    cmd = [sys.executable, "-m", "kvemu.cli", "sweep", str(spec), "--out"]
    if os.geteuid() != 0:
        ro.chmod(0o555)
        try:
            runs = [subprocess.run(cmd + [str(ro / "out")], capture_output=True, text=True, timeout=120),
                    subprocess.run(cmd + [str(ro)], capture_output=True, text=True, timeout=120)]
        finally:
            ro.chmod(0o755)
    else:
        if shutil.which("unshare") is None or subprocess.run(
                ["unshare", "-m", "true"], capture_output=True).returncode != 0:
            pytest.skip("running as root (chmod does not stop root) and no private mount namespace (unshare -m) "
                        "for a read-only mount")
        mount = f"mount -t tmpfs -o ro,size=64k none {shlex.quote(str(ro))}"
        runs = [subprocess.run(["unshare", "-m", "sh", "-c", f"{mount} && exec {shlex.join(cmd + [str(out)])}"],
                               capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
                for out in (ro / "out", ro)]
    first, second = runs
    assert first.returncode == 2 and second.returncode == 2, (first.stderr, second.stderr)
    why = "Read-only file system" if os.geteuid() == 0 else "Permission denied"
    assert first.stderr.strip().splitlines() == [f"Error: {ro / 'out'}: cannot be created in {ro} ({why})"]
    assert second.stderr.strip().splitlines()[0].startswith(f"Error: {ro}: results folder is not writable (")
    assert len(second.stderr.strip().splitlines()) == 1
    assert list(ro.iterdir()) == []


def test_refusals_before_work_create_no_folder(tmp_path):
    spec = write_spec(tmp_path, SMALL)
    bad = write_spec(tmp_path, SMALL.replace("[grid]", "[grid]\nbogus = 1"), "bad.toml")
    out = tmp_path / "a" / "b" / "out"
    for s, executor in ((bad, "local"), (spec, "ray://x"), (spec, "dask://sched.lab"), (spec, "dask://10.0.0.1:8786")):
        with pytest.raises(KvemuError):
            run_sweep(s, out, executor=executor)
        assert not (tmp_path / "a").exists(), executor


def test_a_recording_refused_after_the_folders_were_made_removes_them(tmp_path):
    bad = tmp_path / "conv.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{not json\n')
    spec = write_spec(tmp_path, f'[[trace]]\nworkload = "mooncake:{bad}"\nmodel = "llama3-8b"\n'
                                '[backends]\nuse = ["vemu:cxl-pool"]\n')
    out = tmp_path / "a" / "out"
    with pytest.raises(KvemuError, match="conv.jsonl:2"):
        run_sweep(spec, out)
    assert not (tmp_path / "a").exists()
    # an existing OUT stays, and so does what was in it
    out.mkdir(parents=True)
    (out / "keep.txt").write_text("mine")
    with pytest.raises(KvemuError):
        run_sweep(spec, out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_a_missing_workload_file_is_a_spec_error(tmp_path):
    spec = write_spec(tmp_path, f'[[trace]]\nworkload = "mooncake:{tmp_path}/none.jsonl"\nmodel = "llama3-8b"\n'
                                '[backends]\nuse = ["vemu:cxl-pool"]\n')
    with pytest.raises(ConfigError, match=r"\[\[trace\]\] #1: workload file .*none.jsonl: not found"):
        load_sweep(spec)


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_sweep_keeps_finished_cells_and_leaves_no_work_folder(tmp_path, sig, code):
    single = SMALL.replace('["vemu:cxl-pool", "dram"]', '["dram"]').replace(f'[[trace]]\npath = "{TRACES[1]}"\n', "")
    spec = write_spec(tmp_path, single.replace('name = "small"', 'name = "long"\nrepetitions = 1000'))
    out = tmp_path / "out"
    def default_signals():
        # a suite run as a background job inherits SIGINT ignored, and kvemu keeps an ignored signal so
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])

    p = subprocess.Popen([sys.executable, "-m", "kvemu.cli", "sweep", str(spec), "--out", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    try:
        deadline = time.time() + 60
        while p.poll() is None and time.time() < deadline and len(list(out.rglob("results.parquet"))) < 3:
            time.sleep(0.05)
        assert p.poll() is None, p.communicate()
        assert (out / ".sweep-work").is_dir()  # mid-sweep: a cell is running
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:  # never left behind, whatever failed
            p.kill()
            p.communicate()
    assert p.returncode == code, err
    assert "interrupted by" in err and "Traceback" not in err
    assert not (out / ".sweep-work").exists()
    assert not [f for f in out.rglob("*") if f.is_file() and f.name != "results.parquet"]
    done = sorted(out.rglob("results.parquet"))
    assert 3 <= len(done) < 1000
    for f in done:  # each finished cell's file is whole
        assert pq.read_table(f).num_rows > 0 and meta_of(f)["sweep"]["repetition"] < 1000
