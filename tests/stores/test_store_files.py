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
from kvemu.stores import StoredRanges

ROOT = Path(__file__).resolve().parents[2]
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


def _range_step(b, table, op, first, count):
    """One batch moving ``count`` blocks of a request whose block table is ``table`` (slots), from
    table position ``first``: the engine's hit may begin and end inside a chunk."""
    off, tab = csr([table])
    moves = {"load": ((first, count), (0, 0)), "store": ((0, 0), (first, count))}[op]
    b.replay(off, tab, make_steps([(0, 1)]), make_entries([(0, *moves, (0, 0))]), span(1))


def _loaded(b, table, first, count, size):
    """The bytes a load put into cleared staging, in staging order (one transfer: contiguous)."""
    b.debug_poke("staging", 0, bytes(size))
    _range_step(b, table, "load", first, count)
    return b"".join(blk for blk in _blocks(b.debug_peek("staging", 0, size)) if any(blk))


# Stores then loads on chunks of 4 blocks, (table, first, count) each: chunk 0 stored whole, chunk 1
# in two halves, chunk 0's second half stored again; loads that begin inside chunk 0 (the engine
# held its first block in HBM), span chunk 1's halves, lie across them, cover chunk 0's old and
# new objects; last, slots never stored.
_STORES = (([0, 1, 2, 3], 0, 4), ([4, 5, 6, 7], 0, 2), ([4, 5, 6, 7], 2, 2), ([0, 1, 2, 3], 2, 2))
_LOADS = (([0, 1, 2, 3], 1, 3), ([4, 5, 6, 7], 0, 4), ([4, 5, 6, 7], 1, 2), ([0, 1, 2, 3], 0, 4), ([8, 9], 0, 2))


def _chunk_sequence(spec, kvdir=None):
    """Runs _STORES then _LOADS on ``spec``; returns the bytes each load brought, the facts, and
    (files) the arena as the files on disk say it is: each file's bytes at its key's offset, in
    the order written."""
    rng = np.random.default_rng(11)
    arena = bytearray(12 * BLOCK)
    with Backend(spec) as b:
        b.prepare(BLOCK, 12, 1, 1, False, chunk_blocks=4)
        size = b.describe()["staging_bytes"]
        for table, first, count in _STORES:
            b.debug_poke("staging", 0, rng.integers(1, 256, size, dtype=np.uint8).tobytes())
            _range_step(b, table, "store", first, count)
            if kvdir is not None:
                (folder,) = list(kvdir.iterdir())
                off = table[first] * BLOCK
                (obj,) = [f for f in folder.iterdir() if f.name.endswith(f"-{off}")]
                data = obj.read_bytes()
                assert len(data) == count * BLOCK  # one object per store transfer, keyed by its offset
                arena[off:off + len(data)] = data
        got = [_loaded(b, table, first, count, size) for table, first, count in _LOADS]
        facts = b.describe()
    return got, facts, arena


def test_loads_that_begin_or_end_inside_a_stored_chunk_read_its_bytes(kvdir):
    # The closed loop's engine loads a tier hit from where its HBM prefix cache ends, often inside
    # a chunk the tier stored whole (LMCache then reads the whole chunk): before, the object named
    # by the load's first slot had never been stored and the load counted store_get_missing,
    # reading nothing. Oracles: the files on disk, laid at their offsets by hand; and dram, whose
    # arena keeps bytes by slot, moved by the same steps from the same staging bytes.
    got, facts, arena = _chunk_sequence(f"files:{kvdir}", kvdir)
    for (table, first, count), data in zip(_LOADS[:4], got):
        p0 = table[first] * BLOCK
        assert data == bytes(arena[p0:p0 + count * BLOCK])
    assert got[4] == b""  # never stored: nothing read
    assert facts["store_get_missing"] == 1 and facts["store_get_partial"] == 0  # only that load
    # by the time of the loads chunk 0 is its old object's first half and the new object of its
    # second: the loads read, whole and in part, 1 + 1, 2 + 0, 0 + 2, 1 + 1 objects, then 1 missing
    assert facts["store_get_within_object"] == 1 + 0 + 2 + 1 and facts["store_get_within_object_unread"] == 0
    assert facts["store_gets"] == 2 + 2 + 2 + 2 + 1
    dram_got, _, _ = _chunk_sequence("dram")
    assert dram_got[:4] == got[:4]
    assert list(kvdir.iterdir()) == []


def test_stored_ranges_against_a_byte_by_byte_simulation():
    # Oracle: every byte's owner (the object holding it) kept in a list; a put of key a drops
    # object a wherever it was, then, when stored, owns [a, b).
    rng = np.random.default_rng(5)
    for _ in range(40):
        r, owner = StoredRanges(), [None] * 64
        for _ in range(30):
            a = int(rng.integers(0, 60))
            b = int(rng.integers(a + 1, 65))
            ok = bool(rng.random() > 0.2)
            owner = [None if o == a else o for o in owner]
            if ok:
                owner[a:b] = [a] * (b - a)
            r.put(a, b, ok)
            x = int(rng.integers(0, 63))
            y = int(rng.integers(x + 1, 65))
            runs, p = [], x
            while p < y:
                q = p
                while q < y and owner[q] == owner[p]:
                    q += 1
                runs.append((p, q, owner[p]))
                p = q
            assert r.pieces(x, y) == runs


def test_replay_of_a_small_trace_through_the_api_and_the_cli(kvdir, tmp_path):
    keep = kvdir / "mine.txt"  # a file of the user's in DIR: left alone
    keep.write_text("x")
    # the first tier hits of this trace come by request 48; by request 96 the closed loop's engine
    # loads hits that begin inside stored chunks (its HBM prefix cache ends there: how often
    # depends on the measured times), which before counted a missing object each, 3 to 5 a run
    window = kvemu.ReplayOptions(window=kvemu.WindowOptions(layers=1, requests=(0, 96)))
    meta = kvemu.replay(str(TRACE), f"files:{kvdir}", window, out=str(tmp_path / "a.parquet"))
    facts = meta["backend"]["facts"]
    assert meta["backend"]["mode"] == "measured" and meta["backend"]["name"] == "files"
    assert facts["store_puts"] > 0 and facts["store_gets"] > 0
    # the engine loads only blocks it stored before: every load finds its bytes
    assert facts["store_get_missing"] == facts["store_get_partial"] == facts["store_put_refused"] == 0
    assert facts["store_get_within_object_unread"] == 0
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


def test_session_counts_outcomes_and_refuses_unknown_codes(kvdir):
    # StoreSession._count, the rule every store's batch goes through (a clean batch returns early):
    # the store's own codes counted by name on their op only, success codes of any size left alone,
    # any other negative code a BackendError naming it and how many objects had it. Hand-made results
    # against the files store's codes (-ENOSPC put_refused, -ENOENT get_missing, -EMSGSIZE get_partial).
    import errno

    from kvemu.backend_spec import parse_spec
    from kvemu.errors import BackendError
    from kvemu.stores import StoreSession

    s = StoreSession(parse_spec(f"files:{kvdir}"))
    try:
        s._count([0, 0, 0], "puts", 3)
        s._count([BLOCK, 5], "gets", 2)  # a get returns the bytes it read
        s._count([0, -errno.ENOSPC, -errno.ENOSPC], "puts", 3)
        s._count([-errno.ENOENT, 7, -errno.EMSGSIZE, -errno.ENOENT], "gets", 4)
        c = s.counts
        assert (c["puts"], c["gets"], c["put_refused"], c["get_missing"], c["get_partial"]) == (6, 6, 2, 2, 1)
        with pytest.raises(BackendError, match=r"batch put of 2 objects failed with store error -5 \(1 objects\)"):
            s._count([0, -errno.EIO], "puts", 2)
        with pytest.raises(BackendError, match="failed with store error -2"):  # -ENOENT is no put's outcome
            s._count([-errno.ENOENT], "puts", 1)
        with pytest.raises(BackendError, match="answered a batch get of 2 objects with 1 results"):
            s._count([0], "gets", 2)
    finally:
        s.close()
