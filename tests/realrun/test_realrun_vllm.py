"""vLLM KV cache events imported as a trace: chains, sharing, media, lifetimes, both encodings.

The committed sample tests/data/vllm_events_sample.msgpack is made by ``sample_events()`` below;
re-create it with ``python tests/realrun/test_realrun_vllm.py``.
"""

import importlib.util
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

msgpack = pytest.importorskip("msgpack", reason="vLLM event import needs msgpack (pip install 'kvemu[vllm]')")

from kvemu.analysis import trace_summary  # noqa: E402
from kvemu.errors import ConfigError, WorkloadError  # noqa: E402
from kvemu.realrun.vllm_events import import_vllm_events, read_event_batches  # noqa: E402
from kvemu.replay import DataPathOptions, ReplayOptions, WindowOptions, replay  # noqa: E402
from kvemu.schema import check_entries, iter_entries, read_trace  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "vllm_events_sample.msgpack"
ROOT = Path(__file__).resolve().parents[2]
BS = 16
T0 = 1_700_000_000.0

# (seconds after T0, events) in a neutral form: ("S", hashes, parent, medium) / ("R", hashes, medium) / ("C",)
# Request A stores a 3-block prompt; A's decode fills block 104; B shares A's first two blocks and
# stores two of its own; A's blocks are offloaded to CPU; 104 and 103 are evicted from the GPU;
# C continues B; a store whose parent the capture never saw; the cache is reset; A's prefix comes back.
SCENARIO = [
    (0.000, [("S", [101, 102, 103], None, "GPU")]),
    (0.020, [("S", [104], 103, "GPU"), ("S", [201, 202], 102, "GPU")]),
    (0.050, [("S", [101, 102, 103], None, "CPU"), ("R", [104], "GPU")]),
    (0.080, [("S", [301], 202, "GPU"), ("R", [103], "GPU"), ("X",)]),
    (0.100, [("S", [401, 402], 999, "GPU")]),
    (0.150, [("C",)]),
    (0.200, [("S", [101, 102], None, "GPU")]),
]


def _event(ev, encoding, hash_of):
    kind = ev[0]
    if kind == "S":
        _, hashes, parent, medium = ev
        fields = {"block_hashes": [hash_of(h) for h in hashes],
                  "parent_block_hash": None if parent is None else hash_of(parent),
                  "token_ids": list(range(len(hashes) * BS)), "block_size": BS, "lora_id": None, "medium": medium}
        tag = "BlockStored"
    elif kind == "R":
        fields, tag = {"block_hashes": [hash_of(h) for h in ev[1]], "medium": ev[2]}, "BlockRemoved"
    elif kind == "C":
        fields, tag = {}, "AllBlocksCleared"
    else:  # an event type from a future vLLM: skipped and counted
        fields, tag = {"whatever": 1}, "KVFutureEvent"
    if encoding == "positional":  # msgspec array_like: the tag, then the fields in declaration order
        return [tag, *fields.values()]
    return {"type": tag, **fields}


def sample_events(encoding="positional", hash_of=int) -> bytes:
    """The scenario as a capture file: one msgpack EventBatch per ZMQ message, concatenated."""
    out = b""
    for dt, events in SCENARIO:
        evs = [_event(e, encoding, hash_of) for e in events]
        batch = [T0 + dt, evs, 0] if encoding == "positional" else {"ts": T0 + dt, "events": evs,
                                                                       "data_parallel_rank": 0}
        out += msgpack.packb(batch, use_bin_type=True)
    return out


def test_committed_sample_is_what_the_generator_makes():
    assert SAMPLE.read_bytes() == sample_events(), "re-create it: python tests/realrun/test_realrun_vllm.py"


def test_reader_parses_both_encodings(tmp_path):
    pos = list(read_event_batches(SAMPLE))
    p = tmp_path / "map.msgpack"
    p.write_bytes(sample_events("map"))
    mp = list(read_event_batches(p))
    assert [b.encoding for b in pos] == ["positional"] * 7 and [b.encoding for b in mp] == ["map"] * 7
    assert [b.events for b in pos] == [b.events for b in mp]
    assert pos[1].events[1].parent_block_hash == 102 and pos[1].events[1].block_hashes == (201, 202)
    assert pos[2].events[0].medium == "CPU" and pos[3].unknown == 1


def test_import_builds_chains_with_shared_ids(tmp_path):
    out = tmp_path / "v.parquet"
    meta = import_vllm_events(SAMPLE, "llama3-8b", out)
    tr = read_trace(out)
    assert check_entries(tr) == 7
    # one synthetic request per BlockStored event; the table is the chain from the root
    tables = [tr.table_ids[tr.table_offsets[i]:tr.table_offsets[i + 1]].tolist() for i in range(tr.n_requests)]
    a = tables[0]
    assert len(a) == 3
    assert tables[1] == a + [tables[1][3]]  # A's decode block extends A
    assert tables[2][:2] == a[:2] and len(tables[2]) == 4  # B shares A's first two blocks
    assert tables[3] == a  # the CPU copy of A's blocks: same content, same ids
    assert tables[4][:4] == tables[2]  # C continues B
    assert len(tables[5]) == 2 and not set(tables[5]) & set(sum(tables[:5], []))  # orphan chain
    assert tables[6] == a[:2]
    assert (tr.input_tokens // BS).tolist() == [3, 4, 4, 3, 5, 2, 2]
    assert (tr.cached_tokens // BS).tolist() == [0, 3, 2, 0, 4, 0, 0]
    assert tr.output_tokens.tolist() == [1] * 7
    e = next(iter_entries(tr.header))
    assert list(zip(e["store_first"], e["store_count"])) == [(0, 3), (3, 1), (2, 2), (0, 3), (4, 1), (0, 2), (0, 2)]
    assert e["read_count"].sum() == 0 and e["load_count"].sum() == 0
    assert e["step"].tolist() == [0, 1, 1, 2, 3, 4, 5]  # the clear-only batch makes no step
    np.testing.assert_allclose(tr.arrival_ms, [0, 20, 20, 50, 80, 100, 200], atol=1e-3)
    s = trace_summary(tr)
    assert s["unique_blocks"] == 9 and s["referenced_blocks"] == 23 and s["dedup_ratio"] > 2.5
    assert s["kv_blocks_stored"] == 3 + 1 + 2 + 3 + 1 + 2 + 2
    cap = meta["capture"]
    assert cap["orphan_stores"] == 1 and cap["events"]["unknown_events"] == 1
    assert cap["events"]["AllBlocksCleared"] == 1 and cap["data_parallel_ranks"] == [0]
    gpu, cpu = cap["mediums"]["GPU"], cap["mediums"]["CPU"]
    assert gpu["stored_blocks"] == 11 and gpu["removed_blocks"] == 2 and gpu["cleared_blocks"] == 7
    assert gpu["live_blocks_at_end"] == 2 and gpu["peak_live_blocks"] == 7
    assert cpu["stored_blocks"] == 3 and cpu["cleared_blocks"] == 3 and cpu["live_blocks_at_end"] == 0
    # 104 lived 30 ms and 103 80 ms before eviction; the clear ended the others
    assert gpu["lifetime_ms"]["count"] == 9
    assert gpu["lifetime_ms"]["max"] == pytest.approx(150, abs=1e-3)
    assert meta["model"]["tokens_per_block"] == BS and meta["engine"]["tier_policy"] == "offload"


def test_map_encoding_and_byte_hashes_give_the_same_trace(tmp_path):
    ref = read_trace(_imported(tmp_path, SAMPLE, "ref"))
    p = tmp_path / "map.msgpack"
    p.write_bytes(sample_events("map", hash_of=lambda h: h.to_bytes(32, "big")))
    got = read_trace(_imported(tmp_path, p, "map"))
    assert np.array_equal(ref.table_ids, got.table_ids) and np.array_equal(ref.cached_tokens, got.cached_tokens)


def _imported(tmp_path, src, name, **kw):
    out = tmp_path / f"{name}.parquet"
    import_vllm_events(src, "llama3-8b", out, **kw)
    return out


def test_medium_filter_keeps_one_tier(tmp_path):
    tr = read_trace(_imported(tmp_path, SAMPLE, "gpu", medium="GPU"))
    assert tr.n_requests == 6 and len(tr.step) == 5
    tr = read_trace(_imported(tmp_path, SAMPLE, "cpu", medium="CPU"))
    assert tr.n_requests == 1 and tr.input_tokens.tolist() == [3 * BS]
    with pytest.raises(WorkloadError, match="no BlockStored events of medium 'DISK'"):
        _imported(tmp_path, SAMPLE, "disk", medium="DISK")


def test_imported_trace_replays(tmp_path):
    out = _imported(tmp_path, SAMPLE, "t")
    s = trace_summary(read_trace(out))
    for backend in ("dram", "vemu:cxl-pool"):
        res = replay(out, backend, ReplayOptions(window=WindowOptions(layers=2), datapath=DataPathOptions(chunk_tokens=BS)), out=tmp_path / f"r-{backend.replace(':', '_')}.parquet")
        assert res["ops"]["store"]["accesses"] == s["kv_blocks_stored"] * 2
        assert res["steps"]["compute_ns"] == 0


def test_bad_files_are_one_line_errors(tmp_path):
    trunc = tmp_path / "trunc.msgpack"
    trunc.write_bytes(sample_events()[:-5])
    with pytest.raises(WorkloadError, match="truncated after 6 event batches"):
        list(read_event_batches(trunc))
    junk = tmp_path / "junk.msgpack"
    junk.write_bytes(b"\xc1")  # a byte msgpack never uses
    with pytest.raises(WorkloadError, match="batch 0 is not valid msgpack"):
        list(read_event_batches(junk))
    junk.write_bytes(msgpack.packb("hello"))
    with pytest.raises(WorkloadError, match="batch 0: not an EventBatch"):
        list(read_event_batches(junk))
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(msgpack.packb([1.0, [["BlockStored", [1], None, [], "sixteen", None]]]))
    with pytest.raises(WorkloadError, match="block_size"):
        list(read_event_batches(bad))
    with pytest.raises(WorkloadError, match="no such file|cannot read"):
        list(read_event_batches(tmp_path / "missing.msgpack"))
    empty = tmp_path / "empty.msgpack"
    empty.write_bytes(b"")
    with pytest.raises(WorkloadError, match="no event batches"):
        _imported(tmp_path, empty, "e")
    mixed = tmp_path / "mixed.msgpack"
    mixed.write_bytes(msgpack.packb([1.0, [["BlockStored", [1], None, [], 16, None],
                                           ["BlockStored", [2], None, [], 32, None]]]))
    with pytest.raises(WorkloadError, match="mix block_size 16 and 32"):
        _imported(tmp_path, mixed, "m")
    with pytest.raises(WorkloadError, match="block_size 16, but --block-tokens is 32"):
        _imported(tmp_path, SAMPLE, "bt", tokens_per_block=32)
    with pytest.raises(ConfigError, match="unknown model"):
        import_vllm_events(SAMPLE, "no-such-model", tmp_path / "nm.parquet")


def test_capture_tool_writes_what_the_importer_reads(tmp_path):
    zmq = pytest.importorskip("zmq", reason="the capture tool needs pyzmq (not a test dependency)")
    spec = importlib.util.spec_from_file_location("capture_vllm_events", ROOT / "tools" / "capture_vllm_events.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    frames = [msgpack.packb([T0 + i, [["BlockStored", [i + 1], i or None, [], BS, None, "GPU"]], 0])
              for i in range(200)]
    stop = threading.Event()

    def publish():  # as vLLM's publisher: (topic, 8-byte big-endian sequence number, payload)
        seq = 0
        while not stop.is_set() and seq < 10_000:
            pub.send_multipart((b"kv", seq.to_bytes(8, "big"), frames[seq % len(frames)]))
            seq += 1
            time.sleep(0.002)

    t = threading.Thread(target=publish)
    t.start()
    out = tmp_path / "cap.msgpack"
    try:
        stats = tool.capture(f"tcp://127.0.0.1:{port}", out, topic="kv", max_batches=5, duration_s=20)
    finally:
        stop.set()
        t.join()
        pub.close(linger=0)
        ctx.term()
    assert stats["batches"] == 5 and stats["missed"] == 0
    batches = list(read_event_batches(out))
    assert len(batches) == 5 and all(len(b.events) == 1 for b in batches)


if __name__ == "__main__":
    SAMPLE.write_bytes(sample_events())
    print(f"wrote {SAMPLE} ({SAMPLE.stat().st_size} bytes)")
    sys.exit(0)
