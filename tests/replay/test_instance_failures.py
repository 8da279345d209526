"""A multi-instance replay whose instance fails (its inter-token-gap spill file past a file-size
limit, memory running out under an address-space limit) ends as one line and exit 2, with nothing
half-written: the failing instance stops the others before the shared arena is unmapped (issue 26).
The routes that once crashed (a tier of one chunk, which a replay call overflows) now replay. Each
route runs the CLI in a subprocess, so that a crash in C shows up as a signal, not as a dead test run."""

import os
import re
import resource
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "traces" / "chat-llama3-8b-offload.parquet"
DOCQA = ROOT / "traces" / "docqa-qwen2.5-72b-offload.parquet"
# Progress lines (kvemu/progress.py, stderr not a terminal): not part of the failure's message.
PROGRESS = re.compile(r"^replay: \d+/\d+ ")


def replay(tmp_path, trace, *args, limit_as=None, limit_fsize=None, timeout=120):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def limit():
        if limit_as is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))
        if limit_fsize is not None:  # a file written past it fails with EFBIG (SIGXFSZ is ignored)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_fsize, limit_fsize))

    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "kvemu.cli", "replay", str(trace), "--layers", "1",
                        "--out", str(out / "r.parquet"), *args], capture_output=True, text=True, env=env,
                       timeout=timeout, preexec_fn=limit if limit_as or limit_fsize else None)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not PROGRESS.match(ln)]
    return p, lines, sorted(x.name for x in out.iterdir())


def assert_one_line_failure(p, lines, left, match):
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])  # not -SIGSEGV, not a traceback's 1
    assert len(lines) == 1, p.stderr[-2000:]
    assert re.search(match, lines[0]), lines[0]
    assert left == [], left  # no results, no .part file


# The spill of 8 instances' inter-token gaps (12 B a token) passes 16 KiB part-way through the replay.
SPILL_FAILS = r"cannot write the inter-token-gap spill file \(short write"
OVERFLOW = re.compile(r"warning: (\d+) chunks were evicted by the replay call that stored or loaded them: one engine "
                      r"step touches more chunks than the tier's 1 \(--tier-capacity\)")


def assert_replayed_with_overflow(p, left):
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])  # not -SIGSEGV
    assert left == ["r.parquet"], left
    assert OVERFLOW.search(p.stderr), p.stderr[-2000:]


@pytest.mark.parametrize("backend", ["dram", "emu:cxl-pool"])
def test_tier_of_one_chunk_replays_on_every_instance(tmp_path, backend):
    p, lines, left = replay(tmp_path, CHAT, "--backend", backend, "--instances", "8", "--schedule", "recorded",
                            "--tier-capacity", "32MiB")
    assert_replayed_with_overflow(p, left)


@pytest.mark.parametrize("backend", ["dram", "emu:cxl-pool"])
def test_an_instance_failing_mid_replay_stops_every_instance_cleanly(tmp_path, backend):
    p, lines, left = replay(tmp_path, CHAT, "--backend", backend, "--instances", "8", "--schedule", "recorded",
                            "--tier-capacity", "32MiB", limit_fsize=16 * 1024)
    assert_one_line_failure(p, lines, left, SPILL_FAILS)


def test_tier_smaller_than_a_chunk_is_refused_before_replay(tmp_path):
    p, lines, left = replay(tmp_path, CHAT, "--backend", "dram", "--instances", "8", "--schedule", "recorded",
                            "--tier-capacity", "2MiB")
    assert_one_line_failure(p, lines, left, r"--tier-capacity must hold at least one chunk")


def test_shared_mmap_file_is_removed_when_an_instance_fails(tmp_path):
    folder = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
    tier = folder / f"kvemu-fail-{uuid.uuid4().hex}.bin"
    try:
        # one 16-token chunk of one layer: a 64 KiB tier file, under the 128 KiB limit that 2 instances'
        # spills pass
        p, lines, left = replay(tmp_path, CHAT, "--backend", f"mmap:{tier}", "--instances", "2",
                                "--schedule", "recorded", "--chunk-tokens", "16", "--tier-capacity", "2MiB",
                                limit_fsize=128 * 1024)
        assert_one_line_failure(p, lines, left, SPILL_FAILS)
        assert not tier.exists()
        p, lines, left = replay(tmp_path, CHAT, "--backend", f"mmap:{tier}", "--instances", "8",
                                "--schedule", "recorded", "--tier-capacity", "32MiB")
        assert_replayed_with_overflow(p, left)
        assert not tier.exists()
    finally:
        tier.unlink(missing_ok=True)


@pytest.mark.parametrize("trace", [CHAT, DOCQA], ids=["chat", "docqa"])
def test_closed_loop_with_async_loads_and_a_one_chunk_tier(tmp_path, trace):
    # docqa's chunks are 80 MiB: 96 MiB holds one
    args = ("--backend", "dram", "--instances", "8", "--schedule", "closed", "--kv-load", "async",
            "--tier-capacity", "32MiB" if trace == CHAT else "96MiB")
    p, lines, left = replay(tmp_path, trace, *args)
    assert_replayed_with_overflow(p, left)
    (tmp_path / "out" / "r.parquet").unlink()
    p, lines, left = replay(tmp_path, trace, *args, limit_fsize=16 * 1024)
    assert_one_line_failure(p, lines, left, SPILL_FAILS)


def test_closed_loop_with_async_loads_and_room_succeeds(tmp_path):
    p, lines, left = replay(tmp_path, CHAT, "--backend", "dram", "--instances", "4", "--schedule", "closed",
                            "--kv-load", "async", "--requests", "0:16")
    assert p.returncode == 0, p.stderr[-2000:]
    assert left == ["r.parquet"]


def test_instances_out_of_address_space_fail_in_one_line(tmp_path):
    # ulimit -v 2500000: 32 staging buffers of 64 MiB cannot all be mapped
    p, lines, left = replay(tmp_path, CHAT, "--backend", "dram", "--instances", "32", "--schedule", "recorded",
                            limit_as=2_500_000 * 1024)
    assert_one_line_failure(p, lines, left, r"(cannot map|cannot allocate|out of memory|memory)")


OWNER_FIRST = r"""
import numpy as np
from kvemu.backends import Backend
owner = Backend("dram:workers=1")
owner.prepare(4096, 8, 1, 1, False)
owner.debug_poke("arena", 4096, b"kept")
b = Backend("dram:workers=1")
b.attach(owner)
owner.close()  # the C context stays until b, attached to its arena, is freed
assert b.debug_peek("arena", 4096, 4) == b"kept"
b.debug_poke("arena", 0, b"x" * 4096 * 8)
b.close()
print("ok")
"""


def test_arena_outlives_its_owner_while_attached():
    """kv_ctx_free of an owner defers the unmap until the last attached context is freed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", OWNER_FIRST], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stderr[-2000:])
