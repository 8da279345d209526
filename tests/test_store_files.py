"""The files store (``--backend files:DIR``, kvemu/stores/files.py): one real file per object.

Oracles of the test's own: the bytes it poked into staging, read back from the files on disk with
open() and from staging after the loads; the directory's listing before and after.
"""
import json
import os
import stat
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import kvemu
from backend_helpers import csr, make_entries, make_steps, span
from kvemu.backends import Backend
from kvemu.cli import cli
from kvemu.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"
BLOCK = 16 << 10


@pytest.fixture
def kvdir(tmp_path):
    d = tmp_path / "kv"
    d.mkdir(mode=0o700)
    return d


def _step(b, slots, op):
    """One batch moving ``slots`` (op: store or load). Which staging blocks it uses is the core's
    cursor: the test finds its bytes by content, each staging block being unique."""
    off, tab = csr([slots])
    n = len(slots)
    moves = {"load": ((0, n), (0, 0)), "store": ((0, 0), (0, n))}[op]
    _, out = b.replay(off, tab, make_steps([(0, 1)]), make_entries([(0, *moves, (0, 0))]), span(1))
    return out


def _blocks(data: bytes) -> list[bytes]:
    return [data[i:i + BLOCK] for i in range(0, len(data), BLOCK)]


def test_objects_are_real_files_and_come_back_byte_for_byte(kvdir):
    rng = np.random.default_rng(3)
    with Backend(f"files:{kvdir}") as b:
        b.prepare(BLOCK, 8, 1, 1, False)
        staging = b.describe()["staging_bytes"] // BLOCK
        first = rng.integers(0, 256, staging * BLOCK, dtype=np.uint8).tobytes()
        b.debug_poke("staging", 0, first)
        _step(b, [0, 1, 2, 3], "store")
        (folder,) = list(kvdir.iterdir())
        assert folder.name.startswith("kvemu-files-") and stat.S_IMODE(folder.stat().st_mode) == 0o700
        files = sorted(folder.iterdir(), key=lambda p: int(p.name.rsplit("-", 1)[1]))
        # one file per object, named by the slot's arena offset, holding one staging block's bytes
        assert [int(p.name.rsplit("-", 1)[1]) for p in files] == [i * BLOCK for i in range(4)]
        held = [p.read_bytes() for p in files]
        assert len(set(held)) == 4 and set(held) <= set(_blocks(first))
        # slots 1 and 2 written again from other bytes: their files are replaced, the others kept
        second = rng.integers(0, 256, staging * BLOCK, dtype=np.uint8).tobytes()
        b.debug_poke("staging", 0, second)
        _step(b, [1, 2], "store")
        now = [p.read_bytes() for p in files]
        assert now[0] == held[0] and now[3] == held[3]
        assert {now[1], now[2]} <= set(_blocks(second)) and now[1] != now[2]
        # loaded back into cleared staging: exactly the files' bytes, each object whole
        b.debug_poke("staging", 0, bytes(staging * BLOCK))
        out = _step(b, [0, 1, 2, 3], "load")
        got = [blk for blk in _blocks(b.debug_peek("staging", 0, staging * BLOCK)) if any(blk)]
        assert sorted(got) == sorted(now)
        facts = b.describe()
        assert (facts["store_puts"], facts["store_gets"], facts["store_get_missing"]) == (6, 4, 0)
        assert facts["backend"] == "files" and facts["wire"].startswith("local-fs")
        assert facts["fsync"] == 0 and "no fsync" in facts["wire"]  # the default docs/backends.md states
        assert out["load_ns"][0] > 0  # timed around the store's calls, as every backend's
    assert list(kvdir.iterdir()) == []  # the store removed what it created, and only that


def test_a_load_of_what_was_never_stored_and_a_file_of_another_size(kvdir):
    with Backend(f"files:{kvdir},fsync=1") as b:
        b.prepare(BLOCK, 4, 1, 1, False)
        _step(b, [0], "store")
        (folder,) = list(kvdir.iterdir())
        (obj,) = list(folder.iterdir())
        _step(b, [3], "load")
        assert b.describe()["store_get_missing"] == 1
        obj.write_bytes(b"short")  # the object changed under the store: counted, not copied
        _step(b, [0], "load")
        facts = b.describe()
        assert facts["store_get_partial"] == 1 and facts["fsync"] == 1
    assert list(kvdir.iterdir()) == []


def test_replay_of_a_small_trace_through_the_api_and_the_cli(kvdir, tmp_path):
    keep = kvdir / "mine.txt"  # a file of the user's in DIR: left alone
    keep.write_text("x")
    # the first tier hits of this trace come by request 48
    window = kvemu.ReplayOptions(window=kvemu.WindowOptions(layers=1, requests=(0, 48)))
    meta = kvemu.replay(str(TRACE), f"files:{kvdir}", window, out=str(tmp_path / "a.parquet"))
    facts = meta["backend"]["facts"]
    assert meta["backend"]["mode"] == "measured" and meta["backend"]["name"] == "files"
    assert facts["store_puts"] > 0 and facts["store_gets"] > 0
    assert facts["store_get_missing"] == facts["store_get_partial"] == facts["store_put_refused"] == 0
    assert sorted(p.name for p in kvdir.iterdir()) == ["mine.txt"]
    out = tmp_path / "c.parquet"
    res = CliRunner().invoke(cli, ["replay", str(TRACE), "--backend", f"files:{kvdir}", "--layers", "1",
                                   "--requests", "0:48", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "file per object over local-fs" in res.stdout
    cli_facts = json.loads(pq.read_schema(out).metadata[b"kvemu"])["backend"]["facts"]
    # measured times steer the closed loop, so the counts may differ a little from the API's run
    assert cli_facts["store_puts"] > 0 and cli_facts["store_get_missing"] == cli_facts["store_get_partial"] == 0
    assert sorted(p.name for p in kvdir.iterdir()) == ["mine.txt"] and keep.read_text() == "x"


def _cli_refusal(args, tmp_path):
    out = tmp_path / "x.parquet"
    res = CliRunner().invoke(cli, ["replay", str(TRACE), *args, "--layers", "1", "--requests", "0:2",
                                   "--out", str(out)])
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert not out.exists()
    return lines[0]


def test_a_directory_that_is_missing_not_one_or_unsafe_is_refused_in_one_line(kvdir, tmp_path):
    plain = tmp_path / "f.bin"
    plain.write_bytes(b"data")
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    cases = [(f"files:{tmp_path / 'nope'}", "cannot be used: No such file or directory"),
             (f"files:{plain}", "is not a directory"),
             (f"files:{open_dir}", "is writable by every user without the sticky bit"),
             ("files", "needs a directory: files:DIR"),
             (f"files:{kvdir},fsync=2", "option fsync is '2', must be 0|1"),
             (f"files:{kvdir},fsync=1,fsync=0", "option fsync given twice"),
             (f"files:{kvdir},sync=1", "unknown option 'sync'")]
    for spec, match in cases:
        line = _cli_refusal(["--backend", spec], tmp_path)
        assert match in line and line.startswith("Error: files: "), (spec, line)
    assert plain.read_bytes() == b"data" and list(open_dir.iterdir()) == [] and list(kvdir.iterdir()) == []
    # a sticky world-writable directory (as /tmp) is fine: the store writes in a 0700 folder of its own
    with Backend(f"files:{sticky}") as b:
        b.prepare(BLOCK, 2, 1, 1, False)
        assert len(list(sticky.iterdir())) == 1
    assert list(sticky.iterdir()) == []
    with pytest.raises(ConfigError, match="is not a directory"):
        Backend(f"files:{plain}")


def test_in_place_reads_are_refused_and_nothing_is_left(kvdir, tmp_path):
    resident = ROOT / "traces" / "chat-llama3-8b-resident.parquet"
    window = kvemu.ReplayOptions(window=kvemu.WindowOptions(layers=1, requests=(0, 2)))
    with pytest.raises(ConfigError, match="reached by I/O"):
        kvemu.replay(str(resident), f"files:{kvdir}", window, out=str(tmp_path / "r.parquet"))
    assert list(kvdir.iterdir()) == [] and not (tmp_path / "r.parquet").exists()
