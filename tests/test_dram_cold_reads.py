"""In-place reads on `dram` (cold=1): what a resident replay issues, and which instruction the
untimed cold flush uses (a resident replay on dram spent ~94 % of its wall time in `clflush`, which
is ordered against every other clflush; the flush now uses `clflushopt` where the CPU has it; its
cost is measured by tools/bench_replay_dram.py, not asserted here).

Every expected count below is worked out by hand from the workload: llama3-8b (32 layers, 2 MiB of
KV per 16-token block, so 64 KiB per block and layer), 16-token blocks, two requests arriving
together with no shared prefix: r0 64 prompt tokens (4 blocks) and 4 output tokens, r1 96 prompt
tokens (6 blocks) and 3 output tokens. Their prefill is one step; the first output token comes with
it, so r0 decodes 3 times (contexts 64, 65, 66 tokens) and r1 twice (96, 97). A resident decode
reads every full block of its context in place, once per replayed layer: r0 3 x 4 = 12 blocks, r1
2 x 6 = 12, 24 in all, each one access. The prefill stores r0's 4 and r1's 6 full blocks; with
256-token chunks (16 blocks) each request's blocks are consecutive slots of one chunk: one store
transfer per request and layer.
"""
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import make_workload, record
from kvemu.backends import Backend
from kvemu.replay import OutputOptions, ReplayOptions, ScheduleOptions, WindowOptions, replay

BLOCK_LAYER = 64 * 1024           # llama3-8b: 128 KiB per token over 32 layers, 16 tokens a block
LAYERS_MODEL = 32
READ_BLOCKS = {0: 3 * 4, 1: 2 * 6}  # per replayed layer
STORE_BLOCKS = {0: 4, 1: 6}


def _has_clflushopt() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " clflushopt" in flags


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    w = make_workload([0.0, 0.0], [64, 96], [4, 3])
    return record(w, tmp_path_factory.mktemp("cold") / "t.parquet", tokens_per_block=16, tier_policy="resident")


@pytest.mark.parametrize("schedule", ["closed", "recorded"])
def test_a_resident_replay_reads_each_context_block_once_per_decode_and_layer(tiny, tmp_path, schedule):
    layers = 2
    res = replay(tiny, "dram", ReplayOptions(window=WindowOptions(layers=layers),
                                             schedule=ScheduleOptions(schedule=schedule),
                                             output=OutputOptions(force=True)), out=tmp_path / "r.parquet")
    ops, dp = res.meta["ops"], res.meta["datapath"]["ops"]
    reads = sum(READ_BLOCKS.values()) * layers
    assert ops["read"]["accesses"] == dp["read"]["transfers"] == reads == 48
    assert ops["read"]["bytes"] == dp["read"]["bytes"] == reads * BLOCK_LAYER
    assert ops["load"]["accesses"] == 0 and ops["load"]["bytes"] == 0
    assert ops["store"]["accesses"] == 2 * layers
    assert ops["store"]["bytes"] == sum(STORE_BLOCKS.values()) * layers * BLOCK_LAYER
    # per request, scaled to every model layer: its own blocks, once each per decode
    rows = pq.read_table(res.path, columns=["request_id", "kv_bytes_read", "kv_bytes_stored"]).to_pydict()
    for r, read, stored in zip(rows["request_id"], rows["kv_bytes_read"], rows["kv_bytes_stored"]):
        assert read == READ_BLOCKS[r] * LAYERS_MODEL * BLOCK_LAYER
        assert stored == STORE_BLOCKS[r] * LAYERS_MODEL * BLOCK_LAYER
    facts = res.meta["backend"]["facts"]
    assert facts["cache_cold"] is True
    assert facts["cold_flush"] == ("clflushopt+mfence" if _has_clflushopt() else "clflush+mfence")


def test_cold_flush_is_named_and_absent_with_cold_0():
    with Backend("dram:hugepages=0,cold=0") as b:
        b.prepare(4096, 4, 1, 1, False)
        assert b.describe()["cache_cold"] is False and b.describe()["cold_flush"] == "none"
    with Backend("dram:hugepages=0") as b:
        b.prepare(4096, 4, 1, 1, False)
        assert b.describe()["cold_flush"] in ("clflushopt+mfence", "clflush+mfence")
