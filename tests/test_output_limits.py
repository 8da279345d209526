"""Outputs under resource limits: a full disk or an unwritable folder loses nothing and leaves nothing."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"


def test_disk_full_while_writing_results(tmp_path):
    # RLIMIT_FSIZE makes writes past 64 KiB fail with EFBIG, as a full disk fails with ENOSPC.
    code = textwrap.dedent(f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        from kvemu.cli import main
        import sys
        sys.argv = ["kvemu", "record", "--workload", "synthetic:chat", "--model", "llama3-8b",
                    "--out", {str(tmp_path / "t.parquet")!r}]
        main()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "cannot write" in r.stderr and "File too large" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_unwritable_folder_is_refused_before_work(tmp_path):
    from click.testing import CliRunner

    from kvemu.cli import cli

    res = CliRunner().invoke(cli, ["replay", str(TRACE), "--backend", "dram", "--out", "/proc/kvemu-r.parquet"])
    assert res.exit_code == 2
    assert "not writable" in res.output and len(res.output.strip().splitlines()) == 1
    res = CliRunner().invoke(cli, ["replay", str(TRACE), "--backend", "dram", "--out",
                                   str(tmp_path / "missing" / "r.parquet")])
    assert res.exit_code == 2 and "does not exist" in res.output
