"""cffi build script for kvemu._kvemu_c (out-of-line API mode).

setup.py names ``ffibuilder`` here in ``cffi_modules``. The cdef is the marked region of
kvemu.h itself, so the Python view of every struct and constant comes from the one header the C
code compiles against; cffi checks the declared layouts against the compiler's at build time.

Run directly (``python cbackends/build_ffi.py``) to build the extension in place, next to
``kvemu/__init__.py``, without setuptools.
"""
import glob
import os
import shutil
import sys
import tempfile

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HEADER = os.path.join(HERE, "kvemu.h")
SOURCES = ("core.c", "memtier.c", "dram.c", "numa.c", "mmap.c", "uring.c", "emu.c", "store.c", "stackdist.c", "entries.c", "policies.c", "xfer.c", "lru.c", "opts.c", "pool.c")
DEPENDS = ("kvemu.h", "backend.h", "memtier.h", "xfer.h")
CDEF_BEGIN = "/* cffi-cdef-begin */"
CDEF_END = "/* cffi-cdef-end */"
# The bridge of every store kind (cbackends/store.c, kvemu/stores/): C calls these once per batch,
# kvemu/backends.py defines them (@ffi.def_extern).
STORE_CALLBACKS = """
extern "Python+C" int kv_py_store_prepare(uint64_t, uint64_t, uint64_t, uint64_t);
extern "Python+C" int kv_py_store_access(uint64_t, int, const struct kv_access *, uint32_t, uint64_t *, uint64_t *);
"""
# -std=gnu11 for inline asm and __builtin_*_overflow; visibility keeps internals out of the .so.
COMPILE_ARGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden"]


def public_declarations(header: str = HEADER) -> str:
    """The part of kvemu.h between the cffi markers."""
    with open(header, encoding="utf-8") as f:
        text = f.read()
    begin, end = text.find(CDEF_BEGIN), text.find(CDEF_END)
    if begin < 0 or end < begin:
        raise RuntimeError(f"{header}: missing {CDEF_BEGIN!r} ... {CDEF_END!r} markers")
    return text[begin + len(CDEF_BEGIN):end]


def make_builder(base: str) -> FFI:
    """An FFI whose source paths are relative to ``base`` (the directory the build runs in)."""
    ffi = FFI()
    ffi.cdef(public_declarations())
    ffi.cdef(STORE_CALLBACKS)
    rel = lambda name: os.path.relpath(os.path.join(HERE, name), base)  # noqa: E731
    ffi.set_source(
        "kvemu._kvemu_c",
        '#include "kvemu.h"\n',
        sources=[rel(s) for s in SOURCES],
        depends=[rel(h) for h in DEPENDS],
        include_dirs=[rel(".")],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-pthread"],
    )
    return ffi


# setuptools builds from the project root, and wants relative source paths.
ffibuilder = make_builder(ROOT)


def build_in_place() -> str:
    """Compiles in a scratch directory and copies the module into kvemu/; returns its path."""
    with tempfile.TemporaryDirectory(prefix="kvemu-build-") as tmp:
        # cffi compiles from inside tmpdir, so sources must be reachable from there.
        built = make_builder(tmp).compile(tmpdir=tmp, verbose=False)
        target = os.path.join(ROOT, "kvemu", os.path.basename(built))
        # setuptools names its build _kvemu_c.abi3.so; Python would prefer whichever suffix it
        # lists first, so a stale sibling from the other route could shadow this build.
        for old in glob.glob(os.path.join(ROOT, "kvemu", "_kvemu_c.*")):
            if old != target:
                os.remove(old)
        # Copied beside the target and renamed over it: a process that has the old module
        # mapped keeps its (now unlinked) file instead of seeing it change under it.
        partial = target + ".partial"
        shutil.copy2(built, partial)
        os.replace(partial, target)
    return target


if __name__ == "__main__":
    print(build_in_place(), file=sys.stderr)
