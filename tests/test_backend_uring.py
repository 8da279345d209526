"""The uring backend on a real file: bytes on disk, counts, queue depth, refusals, cleanup.

Files live on a disk-backed filesystem (O_DIRECT on tmpfs is memory, which the backend refuses);
tests skip only where the kernel does not offer io_uring.
"""
import ctypes
import errno
import mmap
import os

import numpy as np
import pytest

from backend_helpers import csr
from kvemu.backends import ENTRY_DTYPE, OPS, STEP_DTYPE, Backend, hist_bucket_lower_ns, percentile_from_hist
from kvemu.errors import BackendError, BackendUnavailable, ConfigError

BLOCK = 65536
_MEMORY_FS = {"tmpfs", "ramfs"}


def _fs_type(path):
    """Filesystem type of the mount holding ``path``, from /proc/mounts (longest prefix wins)."""
    path = os.path.realpath(path)
    best, fstype = "", None
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            mnt = fields[1].replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, fields[2]
    return fstype


def _disk_dir(tmp_path):
    """pytest's tmp_path when it is on disk, else /var/tmp or the repository's folder."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in (str(tmp_path), "/var/tmp", repo):
        if os.path.isdir(d) and os.access(d, os.W_OK) and _fs_type(d) not in _MEMORY_FS:
            return d
    pytest.skip("no writable disk-backed directory for an O_DIRECT file")


@pytest.fixture
def tier_path(tmp_path):
    """A path that does not exist yet, on disk; removed afterwards if a test left it."""
    d = _disk_dir(tmp_path)
    path = os.path.join(d, f"kvemu-uring-{os.getpid()}-{tmp_path.name}.bin")
    assert not os.path.exists(path)
    yield path
    if os.path.exists(path):
        os.unlink(path)


def _open(spec):
    try:
        return Backend(spec)
    except BackendUnavailable as exc:
        if "io_uring unavailable" in str(exc):
            pytest.skip(str(exc))
        raise


def _prepared(path, n_slots=16, n_layers=2, block=BLOCK, opts="qd=4"):
    b = _open(f"uring:{path}" + (f",{opts}" if opts else ""))
    try:
        b.prepare(block, n_slots, n_layers, n_layers, False)
    except BaseException:
        b.close()
        raise
    return b


def entries(load=(0, 0), store=(0, 0), read=(0, 0)):
    e = np.zeros(1, ENTRY_DTYPE)
    e[0] = (0, *load, *store, *read)
    return e


def one_step():
    s = np.zeros(1, STEP_DTYPE)
    s[0] = (0, 1, 0, 0)
    return s


def span(n):
    return np.ones(n, np.uint32)


# ---------------------------------------------------------------- data path


def test_stores_land_in_the_file_and_load_back(tier_path):
    n_slots, n_layers = 8, 2
    with _prepared(tier_path, n_slots, n_layers) as b:
        d = b.describe()
        assert d["backend"] == "uring" and d["o_direct"] is True and d["file"] == "created"
        assert d["file_bytes"] == d["arena_bytes"] == n_slots * n_layers * BLOCK
        assert d["prewritten_bytes"] == d["arena_bytes"]
        assert d["queue_depth"] == 4 and d["sqpoll"] is False
        assert d["page_cache_check"] == "mincore"
        for k in range(n_slots * n_layers):
            b.debug_poke("staging", k * BLOCK, bytes([k + 1]) * BLOCK)
        off, slots = csr([[5, 2]])
        b.replay(off, slots, one_step(), entries(store=(0, 2)), span(n_layers))
        # The staging cursor handed out blocks 0, 1 (layer 0: slots 5, 2) and 2, 3 (layer 1).
        want = {(0, 5): 1, (0, 2): 2, (1, 5): 3, (1, 2): 4}
        with open(tier_path, "rb") as f:
            for (layer, slot), fill in want.items():
                assert os.pread(f.fileno(), BLOCK, (layer * n_slots + slot) * BLOCK) == bytes([fill]) * BLOCK
            untouched = os.pread(f.fileno(), BLOCK, (0 * n_slots + 0) * BLOCK)
            assert untouched != bytes([1]) * BLOCK and len(set(untouched)) > 1  # still the pre-write pattern

        # Loads take the next staging blocks (4, 5, 6, 7) and bring the stored bytes back.
        for k in range(4, 8):
            b.debug_poke("staging", k * BLOCK, bytes(BLOCK))
        b.replay(off, slots, one_step(), entries(load=(0, 2)), span(n_layers))
        assert [b.debug_peek("staging", k * BLOCK, BLOCK) for k in range(4, 8)] == [
            bytes([v]) * BLOCK for v in (1, 2, 3, 4)
        ]
        # Reads go to scratch, never to staging.
        before = b.debug_peek("staging", 0, 8 * BLOCK)
        b.replay(off, slots, one_step(), entries(read=(0, 2)), span(n_layers))
        assert b.debug_peek("staging", 0, 8 * BLOCK) == before


def test_counts_bytes_and_busy_time(tier_path):
    n_slots, n_layers = 16, 2
    with _prepared(tier_path, n_slots, n_layers, opts="qd=8") as b:
        off, slots = csr([list(range(n_slots))])
        e = entries(load=(0, 16), store=(0, 6), read=(0, 10))
        step_out, entry_out = b.replay(off, slots, one_step(), e, span(n_layers))
        for op, count in (("load", 16), ("store", 6), ("read", 10)):
            st = b.op_stats(op)
            assert st["accesses"] == n_layers * count
            assert st["bytes"] == n_layers * count * BLOCK
            assert int(st["counts"].sum()) == st["accesses"]
            assert 0 < st["busy_ns"] <= st["time_ns"]
            assert int(step_out[0][f"{op}_ns"]) == st["busy_ns"]
        # Sixteen 64 KiB reads at depth 8 overlap: the tier is busy for less than their sum.
        assert b.op_stats("load")["busy_ns"] < b.op_stats("load")["time_ns"]


@pytest.mark.parametrize("opts,batch", [("qd=8", 1), ("qd=8,batch=3", 3), ("qd=8,batch=64", 8)])
def test_every_submit_batch_moves_the_right_blocks(tier_path, opts, batch):
    """SQEs go to the kernel `batch` per io_uring_enter (clamped to qd); every block still lands
    where it belongs, and each access gets a latency of its own."""
    n_slots = 32
    with _prepared(tier_path, n_slots, 1, opts=opts) as b:
        assert b.describe()["submit_batch"] == batch
        for k in range(n_slots):
            b.debug_poke("staging", k * BLOCK, bytes([k + 1]) * BLOCK)
        order = list(np.random.default_rng(batch).permutation(n_slots))
        off, slots = csr([order])
        b.replay(off, slots, one_step(), entries(store=(0, n_slots)), span(1))
        with open(tier_path, "rb") as f:
            for k, slot in enumerate(order):
                assert os.pread(f.fileno(), BLOCK, int(slot) * BLOCK) == bytes([k + 1]) * BLOCK
        b.debug_poke("staging", 0, bytes(n_slots * BLOCK))
        b.replay(off, slots, one_step(), entries(load=(0, n_slots)), span(1))
        # the staging cursor wrapped: the loads brought each block back to where it was stored from
        assert [b.debug_peek("staging", k * BLOCK, BLOCK) for k in range(n_slots)] == [
            bytes([k + 1]) * BLOCK for k in range(n_slots)]
        st = b.op_stats("load")
        assert st["accesses"] == n_slots and int(st["counts"].sum()) == n_slots
        assert 0 < st["busy_ns"] <= st["time_ns"]


def test_qd1_busy_time_is_the_sum_of_latencies(tier_path):
    with _prepared(tier_path, 8, 1, opts="qd=1") as b:
        off, slots = csr([list(range(8))])
        b.replay(off, slots, one_step(), entries(load=(0, 8), store=(0, 8), read=(0, 8)), span(1))
        for op in OPS:
            st = b.op_stats(op)
            assert st["accesses"] == 8
            # One access at a time: busy spans exactly the accesses' own intervals (+ rounding).
            assert abs(st["busy_ns"] - st["time_ns"]) <= 8


def _resident_pages(path, length):
    """Pages of the file's first ``length`` bytes in the page cache, by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(ctypes.c_void_p(addr), length, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(ctypes.c_void_p(addr), length)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def test_reads_bypass_the_page_cache(tier_path):
    block, n_slots = 4096, 64
    with _prepared(tier_path, n_slots, 1, block=block, opts="qd=1") as b:
        fd = os.open(tier_path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        off, slots = csr([list(range(n_slots))])
        for _ in range(3):  # each block read three times: a cache would serve the repeats
            b.replay(off, slots, one_step(), entries(load=(0, n_slots), read=(0, n_slots)), span(1))
        assert _resident_pages(tier_path, n_slots * block) == 0
        lower = hist_bucket_lower_ns()
        for op in ("load", "read"):
            p50 = percentile_from_hist(b.op_stats(op)["counts"], lower, 50)
            # A page-cache hit of 4 KiB is ~1 us; any storage reached by I/O takes several.
            assert p50 > 5_000, (op, p50)


# ---------------------------------------------------------------- files: create, existing, cleanup


def test_created_file_is_removed_at_close(tier_path):
    b = _prepared(tier_path, 4, 1)
    assert os.path.getsize(tier_path) == 4 * BLOCK
    b.close()
    assert not os.path.exists(tier_path)


def test_keep_leaves_the_file(tier_path):
    with _prepared(tier_path, 4, 1, opts="keep=1"):
        pass
    assert os.path.getsize(tier_path) == 4 * BLOCK


def test_existing_path_is_refused_and_untouched(tier_path):
    content = b"precious data\n" * 1000
    with open(tier_path, "wb") as f:
        f.write(content)
    with pytest.raises(ConfigError, match="exists; refusing to overwrite it"):  # the user's choice to make
        Backend(f"uring:{tier_path}")
    with open(tier_path, "rb") as f:
        assert f.read() == content


def test_size_existing_uses_the_file_without_truncating_or_unlinking(tier_path):
    with open(tier_path, "wb") as f:
        f.truncate(8 * BLOCK)
    with _prepared(tier_path, 2, 2, opts="size=existing") as b:
        d = b.describe()
        assert d["file"] == "existing" and d["file_bytes"] == 8 * BLOCK
        assert d["prewritten_bytes"] == 4 * BLOCK
        b.debug_poke("staging", 0, b"\xee" * BLOCK)
        off, slots = csr([[1]])
        b.replay(off, slots, one_step(), entries(store=(0, 1)), span(2))
    assert os.path.getsize(tier_path) == 8 * BLOCK
    with open(tier_path, "rb") as f:
        assert os.pread(f.fileno(), BLOCK, 1 * BLOCK) == b"\xee" * BLOCK
        assert os.pread(f.fileno(), 4 * BLOCK, 4 * BLOCK) == bytes(4 * BLOCK)  # beyond the arena


def test_failed_io_names_op_and_offset(tier_path):
    with open(tier_path, "wb") as f:
        f.truncate(4 * BLOCK)
    with _prepared(tier_path, 4, 1, opts="size=existing") as b:
        os.truncate(tier_path, 0)  # someone shrinks the tier under us: reads hit end of file
        off, slots = csr([[2]])
        with pytest.raises(BackendError, match=r"uring: load: read of 65536 bytes at offset 131072 of .* "
                                               r"moved nothing \(end of file\?\)") as info:
            b.replay(off, slots, one_step(), entries(load=(0, 1)), span(1))
        assert info.value.errno == errno.EIO
    assert os.path.exists(tier_path)


def test_size_existing_refuses_a_small_file(tier_path):
    with open(tier_path, "wb") as f:
        f.truncate(3 * BLOCK)
    b = _open(f"uring:{tier_path},size=existing")
    with b, pytest.raises(BackendError, match=r"holds 196608 bytes, the arena needs 262144") as info:
        b.prepare(BLOCK, 4, 1, 1, False)
    assert info.value.errno == errno.ENOSPC
    assert os.path.getsize(tier_path) == 3 * BLOCK


def test_size_existing_needs_the_file(tier_path):
    with pytest.raises(ConfigError, match="size=existing needs an existing file"):
        Backend(f"uring:{tier_path},size=existing")


def test_tmpfs_is_unavailable():
    if not os.path.isdir("/dev/shm") or _fs_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    path = f"/dev/shm/kvemu-uring-{os.getpid()}.bin"
    b = _open(f"uring:{path}")
    try:
        with pytest.raises(BackendUnavailable, match="does not support O_DIRECT") as info:
            b.prepare(BLOCK, 4, 1, 1, False)
        assert info.value.errno == errno.EOPNOTSUPP
        assert not os.path.exists(path)  # the refused file does not stay behind
    finally:
        b.close()
        if os.path.exists(path):
            os.unlink(path)


# ---------------------------------------------------------------- options and alignment


@pytest.mark.parametrize("args,match", [
    ("", "needs a file or block device path"),
    ("{p},qd=0", r"uring: option qd is '0', must be an integer in 1\.\.4096"),
    ("{p},qd=4097", "option qd is '4097'"),
    ("{p},qd=x", "option qd is 'x'"),
    ("{p},batch=0", r"uring: option batch is '0', must be an integer in 1\.\.4096"),
    ("{p},batch=two", "option batch is 'two'"),
    ("{p},size=grow", "uring: option size is 'grow', must be create or existing"),
    ("{p},register=2", "uring: option register is '2', must be 0 or 1"),
    ("{p},sqpoll=1", r"uring: unknown option 'sqpoll=1' \(known: qd=1\.\.4096, batch=1\.\.4096, "
                     r"size=create\|existing, register=0\|1, keep=0\|1\)"),
])
def test_bad_options(tier_path, args, match):
    with pytest.raises(ConfigError, match=match):
        Backend("uring:" + args.format(p=tier_path))


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Backend(f"uring:{tmp_path}/no/such/dir/tier.bin")


def test_misaligned_block_is_refused_at_prepare(tier_path):
    # 4160 x 4 slots: the arena itself is not a multiple of the 512-byte (or larger) alignment.
    with _open(f"uring:{tier_path}") as b:
        with pytest.raises(BackendError, match=r"block_bytes must be a multiple of \d+") as info:
            b.prepare(4160, 4, 1, 1, False)
        assert info.value.errno == errno.EINVAL
        assert not os.path.exists(tier_path)  # the file the refused prepare created is gone
        b.prepare(BLOCK, 4, 1, 1, False)      # and the context can still be prepared
        assert os.path.getsize(tier_path) == 4 * BLOCK


def test_misaligned_block_is_refused_at_prepare_even_when_totals_align(tier_path):
    # 4160 x 8 slots = 65 x 512: the totals align, but prepare sees the block size itself.
    with pytest.raises(BackendError, match=r"block_bytes must be a multiple of 512") as info:
        _prepared(tier_path, 8, 1, block=4160, opts="")
    assert info.value.errno == errno.EINVAL


def test_register_0_uses_plain_buffers(tier_path):
    with _prepared(tier_path, 4, 1, opts="register=0,qd=2") as b:
        d = b.describe()
        assert d["register_requested"] is False
        assert d["registered_buffers"] is False and d["registered_files"] is False
        b.debug_poke("staging", 0, b"\x42" * BLOCK)
        off, slots = csr([[3]])
        b.replay(off, slots, one_step(), entries(store=(0, 1)), span(1))
        with open(tier_path, "rb") as f:
            assert os.pread(f.fileno(), BLOCK, 3 * BLOCK) == b"\x42" * BLOCK


def test_describe_before_prepare(tier_path):
    path = tier_path[:-4] + ' "quoted"\\.bin'  # describe is JSON: the path must come back intact
    with _open(f"uring:{path},qd=16") as b:
        d = b.describe()
        assert d["queue_depth"] == 16 and d["sq_entries"] >= 16
        assert d["file_bytes"] is None and d["path"] == path
        assert isinstance(d["io_uring_features"], list)
    assert not os.path.exists(path)
