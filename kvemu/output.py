"""Writing outputs safely: a temporary file in the destination folder, flushed, then moved into
place in one step. A half-written file never appears under the final name, and an existing file
is never replaced without ``force``."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from .errors import OutputError

# Outputs this process has checked and not yet completed: what an interruption discards.
_unfinished: list[Path] = []


def unfinished_outputs() -> list[Path]:
    return list(_unfinished)


def _same_file(a: Path, b: Path) -> bool:
    """a and b name one file: the same inode (hard links, symlinks), or the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one is missing (or cannot be examined): compare where the names lead
        return os.path.realpath(a) == os.path.realpath(b)  # realpath, unlike resolve(), stops at a loop


def check_written_files(written, inputs=(), outputs=()) -> None:
    """Refuse a file a backend or a tier level would write into (``written``: (who, path) pairs)
    that is one of the command's ``inputs`` or ``outputs``, or another written file: the same
    inode (symlinks and hard links included). Before anything is opened for writing."""
    seen: list[tuple[str, str]] = []
    for who, w in written:
        if not os.path.lexists(w):  # not there yet: the backend creates it (O_EXCL), replacing nothing
            continue
        for kind, paths in (("inputs", inputs), ("outputs", outputs)):
            for src in paths:
                if src is None:
                    continue
                src = Path(src)
                candidates = sorted(src.rglob("*.parquet")) if os.path.isdir(src) else [src]
                for c in candidates:
                    if os.path.lexists(c) and _same_file(w, c):
                        raise OutputError(f"{who}: {w} is one of this command's {kind} ({c}); a tier writes "
                                          f"into its file: give the tier another file")
        for other_who, other in seen:
            if _same_file(w, other) and other_who != who:
                raise OutputError(f"{who}: {w} is also the file of {other_who}; each tier writes into a file "
                                  f"of its own: give it another file")
        seen.append((who, w))


def path_problem(path) -> str | None:
    """Why no file can be made at ``path`` whatever the folder holds (a name longer than the file
    system takes, a loop of symbolic links on the way), as the rest of a sentence; None otherwise.
    ``Path.exists`` raises on the first and ``Path.resolve`` on the second."""
    try:
        os.lstat(path)
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP):
            return f"cannot be a file name ({e.strerror})"
    return None


def check_destination(path, force: bool = False, inputs=()) -> Path:
    """Refuse early (before any work) when the output cannot be written: a folder, an existing
    file without ``force``, something other than a regular file even with it (a device node, a
    FIFO), or one of the command's own ``inputs`` (paths; a folder stands for the results files
    under it)."""
    p = Path(path)
    why = path_problem(p)
    if why:
        raise OutputError(f"{p}: {why}")
    if os.path.isdir(p):  # os.path's tests answer False where Path's raise (a name too long)
        raise OutputError(f"{p}: is a folder; give a file name")
    for src in inputs:
        src = Path(src)
        candidates = sorted(src.rglob("*.parquet")) if os.path.isdir(src) else [src]
        for c in candidates:
            if _same_file(p, c):
                raise OutputError(f"{p}: is one of this command's inputs ({c}); give another output")
    if os.path.lexists(p):
        if not force:
            raise OutputError(f"{p}: already exists (use --force to replace it)")
        if not os.path.isfile(p):
            raise OutputError(f"{p}: is not a regular file; --force replaces regular files only")
    parent = p.parent if str(p.parent) else Path(".")
    if not os.path.isdir(parent):
        raise OutputError(f"{parent}: output folder does not exist")
    try:  # a real probe: root passes os.access() on read-only or special filesystems
        fd, probe = tempfile.mkstemp(prefix=".kvemu-", suffix=".probe", dir=parent)  # short: any valid name fits
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"{parent}: output folder is not writable ({e.strerror})") from None
    if p not in _unfinished:
        _unfinished.append(p)
    return p


def _temp_prefix(name: str) -> str:
    """``.NAME.`` for the temporary file, shortened so that the temporary name (the prefix, 8 random
    characters and ``.part``) stays within the 255 bytes a file name may have."""
    room = 255 - len(".") - len(".") - 8 - len(".part")
    raw = name.encode()
    if len(raw) > room:
        name = raw[:room].decode(errors="ignore")
    return f".{name}."


def make_folders(folder) -> list[Path]:
    """Create ``folder`` and its missing parents; the folders this call created, outermost first
    (for :func:`remove_empty_folders` when the run that needed them writes nothing)."""
    folder = Path(folder)
    missing = [f for f in (folder, *folder.parents) if not os.path.lexists(f)][::-1]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        remove_empty_folders(f for f in missing if os.path.isdir(f))  # isdir: False for a name too long
        raise OutputError(f"{folder}: cannot create the folder ({e.strerror or e})") from None
    return missing


def remove_empty_folders(folders) -> None:
    """Remove these folders, innermost first, where they are empty: what a refused or interrupted
    run created and never filled."""
    for f in reversed(list(folders)):
        try:
            Path(f).rmdir()
        except OSError:  # not empty (someone else's files), or already gone: leave it
            pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path, force: bool = False, inputs=()):
    """Yield a temporary path next to ``path``; on success it becomes ``path``."""
    final = check_destination(path, force, inputs)
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(final.name), suffix=".part", dir=final.parent)
    except OSError as e:  # root passes os.access checks that a read-only filesystem still refuses
        raise OutputError(f"{final.parent}: output folder is not writable ({e.strerror})") from None
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 is for the temporary name only
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)  # fails if final appeared meanwhile: never overwrite
            except FileExistsError:
                raise OutputError(f"{final}: already exists (use --force to replace it)") from None
            os.unlink(tmp)
        if final in _unfinished:
            _unfinished.remove(final)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise OutputError(f"{final}: cannot write ({os.strerror(e.errno)}); nothing was written") from None
        raise OutputError(f"{final}: cannot write ({e.strerror or e})") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
