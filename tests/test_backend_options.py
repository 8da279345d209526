"""The one option parser every backend's open goes through (cbackends/opts.c): the same mistake gets
the same message from each backend, through the C API itself."""

import errno

import pytest

from kvemu._kvemu_c import ffi, lib

PROFILE = "latency_ns=1,gbps=1"  # and concurrency, the integer option of emu and vemu


def specs(tmp_path):
    """(backend, positional part with its comma, options a valid open needs, an integer option
    with its range, a 0|1 option) for each backend."""
    return [
        ("dram", "", "", ("workers", 1, None), "cold"),
        ("numa", "0,", "", ("workers", 1, None), "hugepages"),
        ("mmap", f"{tmp_path / 'tier.bin'},", "", ("workers", 1, None), "keep"),
        ("uring", f"{tmp_path / 'tier.bin'},", "", ("qd", 1, 4096), "register"),
        ("emu", "", PROFILE + ",", ("concurrency", 1, 1 << 20), "hugepages"),
        ("vemu", "", PROFILE + ",", ("concurrency", 1, 1 << 20), None),
    ]


def open_rc(name, args):
    ctx = ffi.gc(lib.kv_ctx_new(), lib.kv_ctx_free)
    rc = lib.kv_backend_open(ctx, name.encode(), args.encode())
    return rc, ffi.string(lib.kv_errmsg(ctx)).decode()


def cases(tmp_path):
    for name, pos, base, (ikey, lo, hi), bkey in specs(tmp_path):
        yield name, pos + base + "nosuch=1", rf"^{name}: unknown option 'nosuch=1' \(known: .*\b{ikey}="
        yield name, pos + base + "nosuch", rf"^{name}: unknown option 'nosuch' \("
        yield name, pos + base + "=1", rf"^{name}: unknown option '=1' \("
        yield name, pos + base + f"{ikey}", rf"^{name}: option {ikey} needs a value: {ikey}=\S+$"
        yield name, pos + base + f"{ikey}=", rf"^{name}: option {ikey} is '', must be an integer in {lo}\.\.\d+$"
        yield name, pos + base + f"{ikey}=0", rf"^{name}: option {ikey} is '0', must be an integer in {lo}\.\.\d+$"
        if hi is not None:
            yield name, pos + base + f"{ikey}={hi + 1}", rf"^{name}: option {ikey} is '{hi + 1}', must be an integer in {lo}\.\.{hi}$"
        yield name, pos + base + f"{ikey}=99999999999999999999999", rf"^{name}: option {ikey} is '9+', must be an integer"
        yield name, pos + base + f"{ikey}=+1", rf"^{name}: option {ikey} is '\+1', must be an integer"
        # a duplicate is refused even where both agree
        yield name, pos + base + f"{ikey}=1,{ikey}=1", rf"^{name}: option {ikey} given twice$"
        if bkey:
            yield name, pos + base + f"{bkey}=2", rf"^{name}: option {bkey} is '2', must be 0 or 1$"
            yield name, pos + base + f"{bkey}=yes", rf"^{name}: option {bkey} is 'yes', must be 0 or 1$"


def test_every_backend_reports_the_same_mistakes_the_same_way(tmp_path):
    import re

    seen = set()
    for name, args, pattern in cases(tmp_path):
        rc, msg = open_rc(name, args)
        assert rc == -errno.EINVAL, (name, args, rc, msg)
        assert re.search(pattern, msg), (name, args, msg)
        seen.add(name)
    assert seen == {"dram", "numa", "mmap", "uring", "emu", "vemu"}
    assert not (tmp_path / "tier.bin").exists()


def test_empty_items_are_skipped_and_options_taken_in_any_order(tmp_path):
    """Only the options: whatever the backend says next (a missing node, no io_uring) is not about them."""
    for name, pos, base, (ikey, lo, _), bkey in specs(tmp_path):
        extra = f"{bkey}=0" if bkey else "overhead_ns=0"
        args = f"{pos},,{extra},,{base}{ikey}={lo},"
        rc, msg = open_rc(name, args)
        assert rc == 0 or "option" not in msg, (name, args, msg)


def test_known_list_names_the_backends_own_keys_before_the_shared_ones(tmp_path):
    _, msg = open_rc("mmap", f"{tmp_path / 'tier.bin'},x=1")
    assert msg.endswith("(known: offset=BYTES, size=create|existing, keep=0|1, populate=0|1, "
                        "hugepages=0|1, cold=0|1, workers=N)")
    _, msg = open_rc("emu", "x=1")
    assert msg.endswith("(known: latency_ns=X, gbps=X, concurrency=N, overhead_ns=X, name=S, kind=memory|storage, "
                        "hugepages=0|1, cold=0|1, workers=N)")
    _, msg = open_rc("vemu", "x=1")
    assert msg.endswith("(known: latency_ns=X, gbps=X, concurrency=N, overhead_ns=X, name=S, kind=memory|storage)")
