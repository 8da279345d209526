"""A file per object on a local directory (``--backend files:DIR``): a file-system KV store.

The tier LMCache's local-disk backend is: each KV chunk the tier stores is one file, written with
``write`` from kvemu's staging buffer and read back with ``readv`` into it, through the page cache
(``fsync=1`` adds an ``fdatasync`` per object, the durable variant). The time of each batch's calls
is measured around them (kvemu.stores.StoreSession), as every store's: the file system's software
and this host's page cache or disk, nothing modelled.

Safety. ``DIR`` must be an existing directory this user can write, and not one that other users
can write unless it has the sticky bit (``/tmp``): another user could swap a file in under the
store. The store writes only inside a folder of its own that it creates there
(``kvemu-files-XXXXXX``, mode 0700, opened once and reached by its descriptor, files opened with
``O_NOFOLLOW``), and removes that folder and everything in it when it stops. Its capacity (the
tier's arena) must fit in the free space of ``DIR``'s file system.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import tempfile

from ..errors import BackendError, ConfigError

#: The user's options after ``files:DIR`` (backend_spec.KINDS lists them).
OPTIONS = ("fsync",)
#: This store's codes for its rules (kvemu.stores.Store.outcomes).
NO_SPACE, MISSING, PARTIAL = -errno.ENOSPC, -errno.ENOENT, -errno.EMSGSIZE
#: The prefix of the folder the store creates in DIR.
FOLDER_PREFIX = "kvemu-files-"


def _options(spec) -> dict:
    opts = {"fsync": 0}
    if not spec.target:
        raise ConfigError("files: needs a directory: files:DIR[,fsync=0|1]")
    seen = set()
    for key, value in spec.options:
        if key not in OPTIONS:
            raise ConfigError(f"files: unknown option {key!r} (known: fsync=0|1)")
        if key in seen:
            raise ConfigError(f"files: option {key} given twice")
        seen.add(key)
        if value not in ("0", "1"):
            raise ConfigError(f"files: option {key} is {value!r}, must be 0|1")
        opts[key] = int(value)
    return opts


def _checked_directory(path: str) -> str:
    """``path`` as an absolute directory the store may write in; ConfigError saying why not."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"files: {path} cannot be used: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"files: {path} is not a directory")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"files: {path} is writable by every user without the sticky bit; give a directory "
                          f"only you can change")
    if st.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"files: {path} belongs to another user (uid {st.st_uid}); give a directory of your own")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"files: {path} is not writable by this user")
    return os.path.abspath(path)


class FileStore:
    """One file per object in a folder of its own under DIR (module docstring); a kvemu.stores.Store."""

    outcomes = {NO_SPACE: "put_refused", MISSING: "get_missing", PARTIAL: "get_partial"}

    def __init__(self, spec):
        self.options = _options(spec)
        self.directory = _checked_directory(spec.target)
        self.folder: str | None = None
        self._dfd = -1
        self._view = None
        self._base = 0

    def start(self, buffer_addr: int, buffer_bytes: int, capacity_bytes: int) -> None:
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if capacity_bytes > free:
            raise BackendError(f"files: the tier needs {capacity_bytes / 2**30:.2f} GiB but {self.directory} has "
                               f"{free / 2**30:.2f} GiB free; give a smaller --tier-capacity or another directory", 0)
        self.folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=self.directory)
        self._dfd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._view = memoryview((ctypes.c_char * buffer_bytes).from_address(buffer_addr)).cast("B")
        self._base = buffer_addr

    def _span(self, key: str, addr: int, size: int) -> memoryview:
        if not key or "/" in key or key.startswith("."):
            raise BackendError(f"files: refusing object key {key[:40]!r} (not a plain file name)", 0)
        off = addr - self._base
        if off < 0 or off + size > len(self._view):
            raise BackendError(f"files: object {key[:40]} lies outside the registered buffer", 0)
        return self._view[off:off + size]

    def put_from(self, keys, addrs, sizes):
        out = []
        for key, addr, size in zip(keys, addrs, sizes):
            view = self._span(key, addr, size)
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self._dfd)
            try:
                done = 0
                while done < size:
                    done += os.write(fd, view[done:])
                if self.options["fsync"]:
                    os.fdatasync(fd)
                out.append(0)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise BackendError(f"files: writing object {key} failed: {e.strerror}", e.errno) from None
                os.unlink(key, dir_fd=self._dfd)  # no half object left behind
                out.append(NO_SPACE)
            finally:
                os.close(fd)
        return out

    def get_into(self, keys, addrs, sizes):
        out = []
        for key, addr, size in zip(keys, addrs, sizes):
            view = self._span(key, addr, size)
            try:
                fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dfd)
            except FileNotFoundError:
                out.append(MISSING)
                continue
            try:
                if os.fstat(fd).st_size != size:
                    out.append(PARTIAL)
                    continue
                done = 0
                while done < size:
                    n = os.readv(fd, [view[done:]])
                    if n == 0:
                        break
                    done += n
                out.append(done if done == size else PARTIAL)
            finally:
                os.close(fd)
        return out

    def get_range_into(self, keys, offsets, addrs, sizes):
        """Part of each object (a load that begins or ends inside it: kvemu.stores.StoreSession):
        the whole file is read, as LMCache reads a whole chunk when the engine's own prefix cache
        ends inside it, and the part asked for copied into the caller's memory."""
        out = []
        for key, off, addr, size in zip(keys, offsets, addrs, sizes):
            view = self._span(key, addr, size)
            try:
                fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dfd)
            except FileNotFoundError:
                out.append(MISSING)
                continue
            try:
                whole = os.fstat(fd).st_size
                if off + size > whole:
                    out.append(PARTIAL)
                    continue
                data = bytearray(whole)
                done = 0
                while done < whole:
                    n = os.readv(fd, [memoryview(data)[done:]])
                    if n == 0:
                        break
                    done += n
                if done != whole:
                    out.append(PARTIAL)
                    continue
                view[:] = memoryview(data)[off:off + size]
                out.append(size)
            finally:
                os.close(fd)
        return out

    def describe(self) -> dict:
        sync = "fdatasync per object" if self.options["fsync"] else "page cache, no fsync"
        return {"store": "files", "transport": "file per object",
                "wire": f"local-fs ({self.directory}, {sync})", "directory": self.directory,
                "fsync": self.options["fsync"]}

    def stop(self) -> None:
        view, self._view = self._view, None
        if view is not None:
            try:
                view.release()
            except BufferError:  # a slice still referenced: freed with it
                pass
        fd, self._dfd = self._dfd, -1
        if fd >= 0:
            os.close(fd)
        folder, self.folder = self.folder, None
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
