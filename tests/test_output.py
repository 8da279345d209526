"""Never destroy inputs or things kvemu does not own (issue: reliability, second round, class 2):
an output that is one of the command's inputs is refused, and --force replaces regular files only.
Each case runs the real command line and then checks the input byte for byte."""
import os
import shutil

import pytest
from click.testing import CliRunner

from kvemu.cli import cli


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_refusal(res, *words):
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert "\n" not in err and "Traceback" not in res.output
    for w in words:
        assert w in err, err


@pytest.fixture
def trace(tmp_path, chat_trace):
    p = tmp_path / "t.parquet"
    shutil.copy(chat_trace, p)
    return p


def test_replay_refuses_its_own_trace_as_output(trace):
    before = trace.read_bytes()
    res = run("replay", trace, "--backend", "vemu:nvme", "--out", trace, "--force")
    one_line_refusal(res, "inputs")
    assert trace.read_bytes() == before


def test_replay_refuses_the_trace_through_a_symlink_and_a_hard_link(trace, tmp_path):
    before = trace.read_bytes()
    (tmp_path / "sym.parquet").symlink_to(trace)
    os.link(trace, tmp_path / "hard.parquet")
    for out in ("sym.parquet", "hard.parquet"):
        res = run("replay", trace, "--backend", "vemu:nvme", "--out", tmp_path / out, "--force")
        one_line_refusal(res, "inputs")
    assert trace.read_bytes() == before


def test_record_refuses_its_workload_as_output(tmp_path):
    src = tmp_path / "w.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1]}\n')
    before = src.read_bytes()
    res = run("record", "--workload", f"mooncake:{src}", "--model", "llama3-8b", "--out", src, "--force")
    one_line_refusal(res, "inputs")
    assert src.read_bytes() == before


def test_report_html_refuses_a_results_file_it_reads(trace, tmp_path):
    results = tmp_path / "runs" / "r.parquet"
    results.parent.mkdir()
    assert run("replay", trace, "--backend", "vemu:nvme", "--out", results).exit_code == 0
    before = results.read_bytes()
    for given in (results, results.parent):   # the file itself, or the folder it is read from
        res = run("report", given, "--html", results, "--force")
        one_line_refusal(res, "inputs")
        assert results.read_bytes() == before


def test_force_replaces_regular_files_only(trace, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    res = run("replay", trace, "--backend", "vemu:nvme", "--out", fifo, "--force")
    one_line_refusal(res, "regular files only")
    assert fifo.exists() and not fifo.is_file()
    # /dev/null: a character device kvemu does not own stays as it is
    res = run("replay", trace, "--backend", "vemu:nvme", "--out", "/dev/null", "--force")
    one_line_refusal(res, "regular files only")
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    # a regular file is still replaced with --force
    out = tmp_path / "r.parquet"
    out.write_bytes(b"old")
    assert run("replay", trace, "--backend", "vemu:nvme", "--out", out, "--force").exit_code == 0
    assert out.read_bytes()[:4] == b"PAR1"
