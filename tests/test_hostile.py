"""Hostile inputs and environments (issue 15, classes 3-5): each gets one line on stderr, exit 2,
and leaves nothing behind; real subprocesses with real resource limits where a limit is the
point."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.schema import METADATA_KEY
from timing_noise import host_units

ESC = "\x1b"


def _run(args, cwd=None):
    res = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return res


def _refused(res, *needles):
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _cli_proc(args, cwd, limits=(), **kw):
    """``kvemu ARGS`` in a child process, under the given resource limits (set in the child)."""
    def pre():
        for which, value in limits:
            resource.setrlimit(which, value)
    code = "import sys; from kvemu.cli import main; sys.argv = ['kvemu'] + sys.argv[1:]; main()"
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=cwd, preexec_fn=pre,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _finish(p, timeout=120):
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException:  # a hung child (or a Ctrl-C of the suite) is killed, never left behind
        p.kill()
        p.communicate()
        raise
    return p.returncode, out, err


# --- names -------------------------------------------------------------------------------------

def test_a_250_byte_output_name_is_written(chat_trace, tmp_path):
    name = "r" * (250 - len(".parquet")) + ".parquet"
    res = _run(["replay", chat_trace, "--backend", "vemu:nvme", "--layers", "1", "--out", tmp_path / name])
    assert res.exit_code == 0, res.output
    assert (tmp_path / name).is_file() and [p.name for p in tmp_path.iterdir()] == [name]


def test_a_newline_in_a_file_name_stays_one_line(tmp_path):
    line = _refused(_run(["replay", tmp_path / "no\nsuch.parquet", "--backend", "dram", "--out", tmp_path / "r.parquet"]),
                    "no\\nsuch.parquet", "no such file")
    assert "\n" not in line


# --- terminal escapes in what files say --------------------------------------------------------

@pytest.fixture
def evil_trace(chat_trace, tmp_path):
    t = pq.read_table(chat_trace)
    meta = json.loads(t.schema.metadata[METADATA_KEY])
    meta["workload"]["source"] = f"src{ESC}]0;title\x07{ESC}[2Jmore\nline\u009b31m"
    path = tmp_path / "evil.parquet"
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), path)
    return path


def test_trace_info_escapes_control_characters(evil_trace):
    res = _run(["trace", "info", evil_trace])
    assert res.exit_code == 0, res.output
    assert ESC not in res.output and "\x07" not in res.output and "\u009b" not in res.output
    workload = [ln for ln in res.output.splitlines() if ln.startswith("workload")]
    assert workload and "\\x1b]0;title\\x07\\x1b[2Jmore\\nline\\x9b31m" in workload[0]


def test_report_escapes_labels_and_metadata(evil_trace, tmp_path):
    out = tmp_path / "r.parquet"
    res = _run(["replay", evil_trace, "--backend", "vemu:nvme", "--layers", "1", "--label", f"red{ESC}[31m\nx",
                "--out", out])
    assert res.exit_code == 0, res.output
    res = _run(["report", out])
    assert res.exit_code == 0, res.output
    assert ESC not in res.output and "\u009b" not in res.output
    assert "red\\x1b[31m" in res.output


# --- outputs refused early, folders left as they were --------------------------------------------

def test_demo_refuses_an_existing_report_before_any_work(tmp_path):
    (tmp_path / "report.html").write_text("mine")
    res, units = host_units(lambda: _run(["demo", "--out", tmp_path]))
    _refused(res, "already holds")
    # the demo's work (recording, replays) is thousands of reference units; refusing is a few
    assert units < 40, f"the refusal cost {units:.0f} reference units of CPU time (timing_noise.host_units)"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    assert (tmp_path / "report.html").read_text() == "mine"


@pytest.mark.parametrize("extra", [[], ["--max-memory", "1KiB"]])
def test_a_refused_dataset_replay_leaves_no_folder(chat_trace, tmp_path, extra):
    root = tmp_path / "runs" / "ds"
    trace = tmp_path / "missing.parquet" if not extra else chat_trace
    res = _run(["replay", trace, "--backend", "dram", "--layers", "1", "--dataset", root, *extra])
    _refused(res)
    assert not (tmp_path / "runs").exists()


def test_a_dataset_keeps_folders_someone_else_made(chat_trace, tmp_path):
    root = tmp_path / "ds"
    (root / "backend=dram").mkdir(parents=True)
    _refused(_run(["replay", chat_trace, "--backend", "dram", "--layers", "1", "--dataset", root,
                   "--max-memory", "1KiB"]))
    assert (root / "backend=dram").is_dir() and not list((root / "backend=dram").iterdir())


# --- a tier file a killed replay left behind -----------------------------------------------------

def test_a_leftover_tier_file_says_which_file_to_remove(chat_trace, tmp_path):
    tier = tmp_path / "tier.bin"
    p = _cli_proc(["replay", chat_trace, "--backend", f"mmap:{tier}", "--out", tmp_path / "r.parquet"], tmp_path)
    deadline = time.monotonic() + 60
    while not tier.exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    if not tier.exists():
        pytest.skip("the replay ended before its tier file could be seen")
    line = _refused(_run(["replay", chat_trace, "--backend", f"mmap:{tier}", "--out", tmp_path / "r2.parquet"]),
                    str(tier), "remove that file")
    assert "size=existing" in line
    assert not (tmp_path / "r.parquet").exists() and not (tmp_path / "r2.parquet").exists()


# --- results naming a trace: bounded work ------------------------------------------------------

def _rename_trace(results: Path, path: str, size: int | None):
    t = pq.read_table(results)
    meta = json.loads(t.schema.metadata[METADATA_KEY])
    meta["trace"]["path"] = path
    if size is None:
        meta["trace"].pop("size_bytes", None)
    else:
        meta["trace"]["size_bytes"] = size
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), results)


@pytest.mark.parametrize("recorded", ["matching", "absent"])
def test_report_does_not_hash_a_huge_file_a_results_file_names(chat_trace, tmp_path, recorded):
    out = tmp_path / "r.parquet"
    assert _run(["replay", chat_trace, "--backend", "vemu:nvme", "--layers", "1", "--out", out]).exit_code == 0
    huge = tmp_path / "huge.bin"
    with open(huge, "wb") as f:
        f.truncate(40 << 30)  # sparse: 40 GiB that would take minutes to hash
    _rename_trace(out, str(huge), (40 << 30) if recorded == "matching" else None)
    res, units = host_units(lambda: _run(["report", out]))
    assert res.exit_code == 0, res.output
    # hashing the 40 GiB would be 640 reference units (SHA-256 of 64 MiB each) and reading them more
    assert units < 100, f"the report cost {units:.0f} reference units of CPU time (timing_noise.host_units)"
    assert "a report reads unasked" in " ".join(res.output.split()) and "--trace" in res.output


def test_report_sees_a_changed_trace_by_its_size(chat_trace, tmp_path):
    out = tmp_path / "r.parquet"
    assert _run(["replay", chat_trace, "--backend", "vemu:nvme", "--layers", "1", "--out", out]).exit_code == 0
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * 1000)
    _rename_trace(out, str(other), os.path.getsize(chat_trace))
    res = _run(["report", out])
    assert res.exit_code == 0 and f"{other} has changed since the replay" in " ".join(res.output.split())


# --- the nanosecond clock ------------------------------------------------------------------------

def test_timestamps_beyond_the_clock_are_refused(tmp_path):
    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text('{"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1]}\n'
                     '{"timestamp": 1e300, "input_length": 100, "output_length": 10, "hash_ids": [2]}\n')
    _refused(_run(["record", "--workload", f"mooncake:{jsonl}", "--model", "llama3-8b", "--out", tmp_path / "t.parquet"]),
             "timestamps span more than 10 years", "request 1")
    csv = tmp_path / "w.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0001-01-01 00:00:00.0,100,10\n"
                   "9999-12-31 23:59:59.0,100,10\n")
    _refused(_run(["record", "--workload", f"azure:{csv}", "--model", "llama3-8b", "--out", tmp_path / "t.parquet"]),
             "timestamps span more than 10 years")
    # nine years is fine: ten years of ns (3.2e17) is far inside int64 (9.2e18)
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2000-01-01 00:00:00.0,100,10\n"
                   "2009-01-01 00:00:00.0,100,10\n")
    res = _run(["record", "--workload", f"azure:{csv}", "--model", "llama3-8b", "--out", tmp_path / "t.parquet"])
    assert res.exit_code == 0, res.output
    info = _run(["trace", "info", tmp_path / "t.parquet", "--json"])
    summary = json.loads(info.output)
    assert not list(tmp_path.glob(".t.parquet*"))
    assert summary["metadata"]["workload"]["requests"] == 2


def test_a_time_scale_beyond_the_clock_is_refused(chat_trace, tmp_path):
    _refused(_run(["replay", chat_trace, "--backend", "vemu:nvme", "--time-scale", "9e8", "--out", tmp_path / "r.parquet"]),
             "--time-scale", "nanosecond clock")
    _refused(_run(["record", "--workload", "synthetic:chat:sessions=2,turns=2", "--model", "llama3-8b",
                   "--request-rate", "1e-12", "--out", tmp_path / "t.parquet"]), "--request-rate", "nanosecond clock")
    assert not list(tmp_path.iterdir())


# --- the inter-token-gap spill files ----------------------------------------------------------

def test_a_file_size_limit_on_the_spill_is_one_line(chat_trace, tmp_path):
    p = _cli_proc(["replay", chat_trace, "--backend", "vemu:nvme", "--out", tmp_path / "r.parquet"], tmp_path,
                  limits=[(resource.RLIMIT_FSIZE, (4096, 4096))], env={**os.environ, "TMPDIR": str(tmp_path)})
    rc, out, err = _finish(p)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "inter-token-gap spill file" in err and "TMPDIR" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # the spill is unlinked; no results, no temporary


def test_running_out_of_file_descriptors_is_one_line(chat_trace, tmp_path):
    p = _cli_proc(["replay", chat_trace, "--backend", "vemu:nvme", "--instances", "64", "--out", tmp_path / "r.parquet"],
                  tmp_path, limits=[(resource.RLIMIT_NOFILE, (40, 40))])
    rc, out, err = _finish(p)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "out of file descriptors" in err and "ulimit -n is 40" in err and "--instances" in err
    assert not (tmp_path / "r.parquet").exists()


def test_a_low_soft_descriptor_limit_is_raised_for_many_instances(chat_trace, tmp_path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 64 + 8 * 64:
        pytest.skip(f"the hard open-file limit here ({hard}) is below what 64 instances want")
    p = _cli_proc(["replay", chat_trace, "--backend", "vemu:nvme", "--instances", "64", "--out", tmp_path / "r.parquet"],
                  tmp_path, limits=[(resource.RLIMIT_NOFILE, (40, hard))])
    rc, out, err = _finish(p)
    assert rc == 0, err
    assert pq.read_metadata(tmp_path / "r.parquet").num_rows > 0


# --- memory --------------------------------------------------------------------------------------

def test_out_of_memory_is_one_line_with_the_limit(tmp_path):
    # the limit is set in the child once kvemu is imported, so the failure is the recording's
    code = ("import resource, sys\nfrom kvemu.cli import main\n"
            "peak = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmPeak:')][0] * 1024\n"
            "lim = peak + (64 << 20)\nresource.setrlimit(resource.RLIMIT_AS, (lim, lim))\n"
            "sys.argv = ['kvemu'] + sys.argv[1:]\nmain()\n")
    args = ["record", "--workload", "synthetic:docqa:questions=20000", "--model", "llama3-8b", "--out", "t.parquet"]
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if p.returncode == 0:
        pytest.skip("the recording fitted in 64 MiB more than the imports")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]
    assert "out of memory" in p.stderr and "ulimit -v" in p.stderr and "--max-requests" in p.stderr
    assert not list(tmp_path.iterdir())


def test_validate_refuses_a_trace_beyond_the_clock(tmp_path):
    # written by the library's own writer, bypassing the workload readers' bound: 12.7 years
    from conftest import make_workload, record

    path = record(make_workload([0.0, 4e11], [100, 100], [3, 3]), tmp_path / "late.parquet")
    line = _refused(_run(["trace", "validate", path]), "arrival_ms reaches 12.7 years", "10 years")
    _refused(_run(["replay", path, "--backend", "vemu:nvme", "--out", tmp_path / "r.parquet"]), "arrival_ms reaches")
    assert not (tmp_path / "r.parquet").exists() and "\n" not in line


@pytest.mark.parametrize("args,message", [
    (["--gpus", "8", "--tp", "4", "--pp", "1"], "--gpus 8 contradicts --tp 4 x --pp 1 = 4 GPUs per instance"),
    (["--tp", "3"], "--tp 3 does not divide llama3-8b's 32 attention heads"),
    (["--pp", "40"], "--pp 40 exceeds llama3-8b's 32 layers"),
    (["--gpus", "99999999999999999999"], "pipeline stages of tp 1, more than llama3-8b's 32 layers"),
    (["--ep", "2"], "--ep 2: llama3-8b has no experts"),
    (["--gpus", "0"], "--gpus must be a whole number >= 1"),
])
def test_a_parallelism_that_does_not_fit_is_one_line(tmp_path, args, message):
    _refused(_run(["record", "--workload", "synthetic:chat:sessions=1,turns=1", "--model", "llama3-8b", *args,
                   "--out", tmp_path / "t.parquet"]), message)
    assert not list(tmp_path.iterdir())
