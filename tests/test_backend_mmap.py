"""The mmap backend: a shared mapping of a file or device as the tier; bytes really reach the file."""
import errno
import glob
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from backend_helpers import replay_one
from kvemu.backends import Backend
from kvemu.errors import BackendError, ConfigError

BLOCK = 4096
PAGE = os.sysconf("SC_PAGESIZE")
ROOT = Path(__file__).resolve().parents[1]


def _chunk_offset(layer: int, slot: int, n_slots: int, block: int = BLOCK, offset: int = 0) -> int:
    """Where the arena's chunk of (replayed layer, slot) lies in the file."""
    return (layer * n_slots + slot) * block + offset


@pytest.fixture(params=["file", "tmpfs"])
def fresh(request, tmp_path):
    """A path that does not exist yet, on a disk file system (tmp_path) or on /dev/shm (tmpfs)."""
    if request.param == "file":
        path = tmp_path / "tier"
    else:
        if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
            pytest.skip("/dev/shm is not a writable tmpfs here")
        path = Path("/dev/shm") / f"kvemu-test-{uuid.uuid4().hex}"
    yield request.param, path
    path.unlink(missing_ok=True)


def _mounts(fstype: str) -> list[str]:
    with open("/proc/mounts", encoding="utf-8") as f:
        return [line.split()[1] for line in f if line.split()[2] == fstype]


# ---------------------------------------------------------------- data path


@pytest.mark.parametrize("offset", [0, PAGE])
def test_stores_reach_the_file_layer_major_and_load_back(fresh, offset):
    kind, path = fresh
    with Backend(f"mmap:{path},offset={offset}") as b:
        b.prepare(BLOCK, 4, 2, 2, False)
        d = b.describe()
        assert d["kind"] == kind and d["shared"] is True and d["path"] == str(path)
        assert d["created"] is True and d["kept"] is False and d["size"] == "create"
        assert d["offset"] == offset and d["mapping_bytes"] == 8 * BLOCK == d["arena_bytes"]
        assert d["page_size"] == PAGE and d["prefaulted"] is True and d["prefault_access"] == "write"
        assert os.path.getsize(path) == offset + 8 * BLOCK
        # Pre-faulting wrote nothing: the new file is still all zeros.
        assert b.debug_peek("arena", 0, 8 * BLOCK) == bytes(8 * BLOCK)

        for k in range(8):
            b.debug_poke("staging", k * BLOCK, bytes([k + 1]) * BLOCK)
        replay_one(b, 2, "store")      # layer 0 from staging block 0, layer 1 from block 1
        with open(path, "rb") as f:
            data = f.read()
        assert data[_chunk_offset(0, 2, 4, offset=offset):][:BLOCK] == b"\x01" * BLOCK
        assert data[_chunk_offset(1, 2, 4, offset=offset):][:BLOCK] == b"\x02" * BLOCK
        assert data.count(0) == len(data) - 2 * BLOCK    # nothing else was written

        b.debug_poke("staging", 0, bytes(8 * BLOCK))
        replay_one(b, 2, "load")       # the staging cursor continues at blocks 2 and 3
        assert b.debug_peek("staging", 2 * BLOCK, 2 * BLOCK) == b"\x01" * BLOCK + b"\x02" * BLOCK
        replay_one(b, 2, "read")
        assert [b.op_stats(op)["accesses"] for op in ("load", "store", "read")] == [2, 2, 2]
    assert not path.exists()            # created, so removed at close


def test_keep_leaves_the_created_file(fresh):
    _, path = fresh
    with Backend(f"mmap:{path},keep=1") as b:
        b.prepare(BLOCK, 2, 1, 1, False)
        b.debug_poke("staging", 0, b"\x77" * BLOCK)
        replay_one(b, 1, "store", n_layers=1)
        assert b.describe()["kept"] is True
    assert path.read_bytes() == bytes(BLOCK) + b"\x77" * BLOCK


def test_populate_0_skips_prefaulting_but_moves_the_same_bytes(fresh):
    _, path = fresh
    with Backend(f"mmap:{path},populate=0,cold=0") as b:
        b.prepare(BLOCK, 2, 1, 1, False)
        d = b.describe()
        assert d["prefaulted"] is False and d["prefault_access"] is None and d["cache_cold"] is False
        b.debug_poke("staging", 0, b"\x33" * BLOCK)
        replay_one(b, 0, "store", n_layers=1)
        assert path.read_bytes()[:BLOCK] == b"\x33" * BLOCK


# ---------------------------------------------------------------- existing tiers


def test_existing_path_is_refused_without_size_existing(tmp_path):
    path = tmp_path / "precious"
    path.write_bytes(b"keep me" * 1000)
    stat = path.stat()
    with pytest.raises(ConfigError, match="exists; .*pass size=existing"):  # the user's choice to make
        Backend(f"mmap:{path}")
    assert path.read_bytes() == b"keep me" * 1000 and path.stat().st_mtime_ns == stat.st_mtime_ns


def test_existing_file_is_mapped_read_only_faulted_and_never_truncated(tmp_path):
    path = tmp_path / "tier"
    content = bytes(range(256)) * (40 * BLOCK // 256)      # 40 blocks; the arena takes 8 at 1 page
    path.write_bytes(content)
    with Backend(f"mmap:{path},size=existing,offset={PAGE}") as b:
        b.prepare(BLOCK, 4, 2, 2, False)
        d = b.describe()
        assert d["created"] is False and d["kept"] is True and d["prefault_access"] == "read"
        assert b.debug_peek("arena", 0, 8 * BLOCK) == content[PAGE:PAGE + 8 * BLOCK]
    assert path.read_bytes() == content     # same size, nothing written, not removed


def test_two_backends_on_one_file_see_each_others_stores(fresh):
    _, path = fresh
    with Backend(f"mmap:{path}") as writer:
        writer.prepare(BLOCK, 4, 2, 2, False)       # creates the file the reader then maps
        reader = Backend(f"mmap:{path},size=existing")
        reader.prepare(BLOCK, 4, 2, 2, False)
        pattern = os.urandom(2 * BLOCK)
        writer.debug_poke("staging", 0, pattern)
        replay_one(writer, 3, "store")
        replay_one(reader, 3, "load")     # into the reader's own staging blocks 0 and 1
        assert reader.debug_peek("staging", 0, 2 * BLOCK) == pattern
        assert reader.debug_peek("arena", _chunk_offset(1, 3, 4), BLOCK) == pattern[BLOCK:]
        reader.close()                              # size=existing: leaves the file alone
        assert path.exists()
    assert not path.exists()


CHILD = r"""
import sys
from kvemu.backends import Backend
with Backend(f"mmap:{sys.argv[1]},size=existing") as b:
    b.prepare(4096, 4, 2, 2, False)
    sys.stdout.write(b.debug_peek("arena", int(sys.argv[2]), 4096).hex())
    b.debug_poke("arena", 0, b"child")
"""


def test_two_processes_share_the_tier(tmp_path):
    path = tmp_path / "tier"
    with Backend(f"mmap:{path}") as parent:
        parent.prepare(BLOCK, 4, 2, 2, False)
        pattern = os.urandom(BLOCK)
        parent.debug_poke("staging", 0, pattern * 2)
        replay_one(parent, 1, "store")
        off = _chunk_offset(1, 1, 4)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(off)], capture_output=True,
                           text=True, env=env, timeout=60)
        assert r.returncode == 0, r.stderr
        assert bytes.fromhex(r.stdout) == pattern
        assert parent.debug_peek("arena", 0, 5) == b"child"


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("size", ["", ",size=existing"])
def test_misaligned_offset_is_refused(tmp_path, size):
    path = tmp_path / "tier"
    if size:
        path.write_bytes(bytes(16 * BLOCK))
    with pytest.raises(ConfigError, match=rf"offset 100 is not a multiple of {PAGE} bytes"):
        Backend(f"mmap:{path},offset=100{size}")


def test_too_small_existing_file_is_refused_untouched(tmp_path):
    path = tmp_path / "small"
    path.write_bytes(b"\x01" * (6 * BLOCK))
    with Backend(f"mmap:{path},size=existing,offset={PAGE}") as b:
        with pytest.raises(BackendError, match=rf"holds {6 * BLOCK} bytes; the arena needs {8 * BLOCK} "
                                               rf"from offset {PAGE}") as info:
            b.prepare(BLOCK, 4, 2, 2, False)
        assert info.value.errno == errno.ENOSPC     # as uring's size=existing
    assert path.read_bytes() == b"\x01" * (6 * BLOCK)


@pytest.mark.parametrize("spec,match", [
    ("mmap", "give a path"),
    ("mmap:", "give a path"),
    ("mmap:{d}/x,size=big", r"mmap: option size is 'big', must be create or existing"),
    ("mmap:{d}/x,sizes=big", r"unknown option 'sizes=big' \(known: offset=BYTES, size=create\|existing"),
    ("mmap:{d}/x,keep=2", "mmap: option keep is '2', must be 0 or 1"),
    ("mmap:{d}/x,offset=-1", "mmap: option offset is '-1', must be a decimal integer"),
    ("mmap:{d}/x,offset=4k", "mmap: option offset is '4k', must be a decimal integer"),
    ("mmap:{d}/missing/x", "cannot create .*missing/x: directory"),
    ("mmap:{d}/missing,size=existing", "cannot map .*: No such file"),
    ("mmap:/dev/null,size=existing", "character device but not device DAX"),
    ("mmap:{d},size=existing", "neither a regular file nor a device-DAX device"),
])
def test_bad_specs_are_config_errors(tmp_path, spec, match):
    with pytest.raises(ConfigError, match=match):
        Backend(spec.format(d=tmp_path))


def test_a_failed_prepare_removes_what_it_created(tmp_path):
    path = tmp_path / "tier"
    with Backend(f"mmap:{path}") as b:
        with pytest.raises(BackendError, match=r"cannot size .*tier to 1125899906842624 bytes|exceed the"):
            b.prepare(1 << 20, 1 << 30, 1, 1, False)   # 1 PiB: no file system holds it
        assert not path.exists()
        b.prepare(BLOCK, 2, 1, 1, False)                # and the context can still be prepared
        assert path.exists()
    assert not path.exists()


# ---------------------------------------------------------------- special file systems


DAX_DEVICES = sorted(glob.glob("/dev/dax*"))


@pytest.mark.skipif(not DAX_DEVICES, reason="no device-DAX device (/dev/daxX.Y) on this machine")
def test_devdax_maps_whole_aligned_pages_read_only():
    dev = DAX_DEVICES[0]
    if not os.access(dev, os.R_OK | os.W_OK):
        pytest.skip(f"{dev} is not readable and writable here")
    # Never store: the device may hold someone's data. Prepare pre-faults by reading only.
    with Backend(f"mmap:{dev},size=existing") as b:
        b.prepare(BLOCK, 4, 1, 1, False)
        d = b.describe()
        assert d["kind"] == "devdax" and d["page_size"] >= 2 << 20
        assert d["mapping_bytes"] == d["page_size"] and d["prefault_access"] == "read"
    with pytest.raises(ConfigError, match="not a multiple"):
        Backend(f"mmap:{dev},size=existing,offset={PAGE}")


def _hugetlbfs_dir() -> str | None:
    for mnt in _mounts("hugetlbfs"):
        if os.access(mnt, os.W_OK):
            return mnt
    return None


@pytest.mark.skipif(_hugetlbfs_dir() is None, reason="no writable hugetlbfs mount")
def test_hugetlbfs_maps_huge_pages():
    mnt = _hugetlbfs_dir()
    huge = os.statvfs(mnt).f_bsize
    path = Path(mnt) / f"kvemu-test-{uuid.uuid4().hex}"
    try:
        with Backend(f"mmap:{path}") as b:
            try:
                b.prepare(BLOCK, 4, 2, 2, False)
            except BackendError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    pytest.skip(f"no free huge page: {e}")
                raise
            d = b.describe()
            assert d["kind"] == "hugetlbfs" and d["page_size"] == huge
            assert d["mapping_bytes"] == huge and d["arena_hugepage_bytes"] == huge
            b.debug_poke("staging", 0, b"\x42" * 2 * BLOCK)
            replay_one(b, 3, "store")
            with open(path, "rb") as f:
                f.seek(_chunk_offset(1, 3, 4))
                assert f.read(BLOCK) == b"\x42" * BLOCK
        assert not path.exists()
        with pytest.raises(ConfigError, match=rf"not a multiple of {huge} bytes"):
            Backend(f"mmap:{path},offset={PAGE}")
    finally:
        path.unlink(missing_ok=True)
