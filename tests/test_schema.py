"""Trace format v2 (and v1, read and upgraded): round trip, the golden files, and one exact message
per problem."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import record
from kvemu.errors import TraceError
from kvemu.schema import METADATA_KEY, check_entries, read_header, read_trace

from pathlib import Path

GOLDEN = Path(__file__).parent / "data" / "golden-trace-v1.parquet"
GOLDEN_V2 = Path(__file__).parent / "data" / "golden-trace-v2.parquet"


def test_golden_v1_file_still_reads():
    """tests/data/golden-trace-v1.parquet was written by kvemu 0.1.0 and is never regenerated."""
    t = read_trace(GOLDEN)
    assert t.header.meta["version"] == 1
    assert t.cached_tokens.tolist() == [0, 64, 128]
    assert t.table_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 28, 0, 1, 2, 3, 16, 17, 18, 19, 20, 29,
                                    0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 30]
    assert t.compute_ns.tolist()[:2] == [7159792, 7168232]
    assert check_entries(t) == 12
    assert t.header.meta["engine"]["tier_policy"] == "resident"


def test_golden_v1_file_reads_with_a_derived_schedule():
    t = read_trace(GOLDEN)
    assert t.header.meta["upgraded_from"] == 1
    assert t.header.meta["schedule"] == {"closed_loop": True, "source": "engine-model",
                                         "engine_model": "kvemu.engine/1"}


def test_golden_v2_file_still_reads():
    """tests/data/golden-trace-v2.parquet was written by kvemu 0.1.0 (trace v2) and is never
    regenerated: three requests, the third finding 10 blocks of the first in the tier."""
    t = read_trace(GOLDEN_V2)
    m = t.header.meta
    assert m["version"] == 2 and "upgraded_from" not in m
    assert m["schedule"] == {"closed_loop": True, "source": "engine-model", "engine_model": "kvemu.engine/1"}
    assert m["load"]["overloaded"] is False and m["load"]["arrival_span_s"] == 2.0
    assert m["workload"]["time_scale"] == 1.0
    assert t.cached_tokens.tolist() == [0, 0, 176] and t.tier_hit_tokens.tolist() == [0, 0, 160]
    assert t.table_ids.tolist() == [*range(12), 24, *range(12, 24), 25, *range(12), 26]
    assert t.compute_ns.tolist()[:3] == [7159345, 7159401, 7159457]
    assert len(t.step) == 9 and check_entries(t) == 9
    assert m["engine"]["hbm_evictions"] == 22


def test_a_v1_trace_upgrades_to_v2_with_the_same_rows(tmp_path):
    from kvemu.schema import upgrade_trace

    out = tmp_path / "v2.parquet"
    meta = upgrade_trace(GOLDEN, out)
    assert meta["version"] == 2 and meta["upgraded"]["from_version"] == 1
    new, old = read_trace(out), read_trace(GOLDEN)
    assert new.header.meta["schedule"] == old.header.meta["schedule"]
    assert "upgraded_from" not in new.header.meta
    assert pq.read_table(out).to_pydict() == pq.read_table(GOLDEN).to_pydict()
    with pytest.raises(TraceError, match="already a v2 trace"):
        upgrade_trace(out, tmp_path / "again.parquet")
    assert not (tmp_path / "again.parquet").exists()


def test_block_lookup_and_unique_count_from_runs_match_the_expanded_tables():
    """The replay looks block ids up from the stored runs instead of expanding every table."""
    t = read_trace(GOLDEN)
    lengths = np.diff(t.table_offsets)
    req = np.repeat(np.arange(t.n_requests), lengths)
    pos = np.arange(len(req)) - np.repeat(t.table_offsets[:-1], lengths)
    assert t.block_ids(req, pos).tolist() == t.table_ids.tolist()
    assert t.unique_blocks() == len(set(t.table_ids.tolist())) == 22
    first_two = np.array([True, True, False])
    assert t.unique_blocks(first_two) == len(set(t.table_ids[: t.table_offsets[2]].tolist()))
    assert t.unique_blocks(np.zeros(3, bool)) == 0


def test_round_trip(tmp_path, shared_prefix_workload):
    w = shared_prefix_workload
    path = record(w, tmp_path / "t.parquet")
    t = read_trace(path)
    assert np.array_equal(t.arrival_ms, w.arrival_ms)
    assert np.array_equal(t.input_tokens, w.input_tokens)
    assert np.array_equal(t.output_tokens, w.output_tokens)
    m = t.header.meta
    assert m["format"] == "kvemu.trace" and m["creator"].startswith("kvemu ")
    assert m["model"]["block_bytes_per_layer"] == 16 * 2 * 8 * 128 * 2
    assert m["engine"]["max_num_batched_tokens"] == 8192
    # conftest.record gives its factors: the compute blob's (engine/compute.py), no longer gpu's
    assert m["gpu"]["name"] == "H100-SXM" and m["compute"]["params"]["mfu"] == 0.5 and "mfu" not in m["gpu"]
    assert m["workload"]["checksum"] == "sha256:0"


def test_output_is_never_overwritten(tmp_path, shared_prefix_workload):
    from kvemu.errors import OutputError

    path = record(shared_prefix_workload, tmp_path / "t.parquet")
    before = path.read_bytes()
    with pytest.raises(OutputError, match="already exists"):
        record(shared_prefix_workload, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.parquet"]  # no temporary file left behind


def _rewrite(src, dst, table_fn=None, meta_fn=None):
    t = pq.read_table(src)
    meta = json.loads(t.schema.metadata[METADATA_KEY])
    if table_fn:
        t = table_fn(t)
    if meta_fn:
        meta_fn(meta)
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), dst)
    return dst


def _set(path, value):
    def fn(meta):
        d = meta
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return fn


@pytest.mark.parametrize("make,message", [
    (lambda p, d: d.write_bytes(b""), "empty file"),
    (lambda p, d: d.write_bytes(b"hello, not parquet" * 10), "not a Parquet file or truncated"),
    (lambda p, d: d.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "not a Parquet file or truncated"),
    (lambda p, d: pq.write_table(pa.table({"a": [1]}), d), "not a kvemu trace (no 'kvemu' schema metadata)"),
    (lambda p, d: _rewrite(p, d, meta_fn=_set(["version"], 3)), "unsupported trace version 3"),
    (lambda p, d: _rewrite(p, d, meta_fn=_set(["version"], 2)), "v2 trace without a valid 'schedule' object"),
    (lambda p, d: _rewrite(GOLDEN_V2, d, meta_fn=_set(["schedule", "closed_loop"], "yes")),
     "v2 trace without a valid 'schedule' object"),
    (lambda p, d: _rewrite(p, d, meta_fn=_set(["format"], "kvemu.results")), "not a kvemu trace (format"),
    (lambda p, d: _rewrite(p, d, table_fn=lambda t: t.drop_columns(["read_count"])),
     "trace is missing required column 'read_count'"),
    (lambda p, d: _rewrite(p, d, table_fn=lambda t: t.set_column(t.schema.get_field_index("compute_ns"), "compute_ns",
                                                                 t["compute_ns"].cast(pa.float64()))),
     "column 'compute_ns' has type double, expected int64"),
    (lambda p, d: _rewrite(p, d, meta_fn=_set(["model", "block_bytes_per_layer"], 12345)),
     "geometry does not add up: block_bytes_per_layer 12345"),
    (lambda p, d: _rewrite(p, d, meta_fn=_set(["model", "layers"], -1)),
     "model geometry field 'layers' must be a positive integer"),
    (lambda p, d: _rewrite(p, d, meta_fn=_set(["blocks", "id_space"], 3)), "block ids must be in [0, blocks.id_space=3)"),
])
def test_invalid_traces(tmp_path, make, message):
    bad = tmp_path / "bad.parquet"
    make(GOLDEN, bad)
    with pytest.raises(TraceError) as e:
        read_trace(bad)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def _entries_reordered(t):
    idx = np.arange(len(t))
    rt = t["row_type"].to_numpy()
    ent = np.flatnonzero(rt == 2)
    idx[ent] = ent[::-1]
    return t.take(pa.array(idx))


def _range_broken(t):
    rc = t["read_count"].to_pylist()
    rt = t["row_type"].to_numpy()
    rc[int(np.flatnonzero(rt == 2)[-1])] = 999
    return t.set_column(t.schema.get_field_index("read_count"), "read_count", pa.array(rc, pa.int32()))


@pytest.mark.parametrize("fn,message", [
    (_entries_reordered, "out of step order"),
    (_range_broken, r"read range 0\+999 exceeds its block table"),
])
def test_entry_problems_found_by_full_check(tmp_path, fn, message):
    bad = _rewrite(GOLDEN, tmp_path / "bad.parquet", table_fn=fn)
    read_header(bad)  # the footer is fine
    with pytest.raises(TraceError, match=message):
        check_entries(read_trace(bad))


def test_absurd_block_ids_are_refused(tmp_path):
    def huge(t):
        starts = t["block_start"].to_pylist()
        starts[0] = [2**50 + i for i in range(len(starts[0]))]
        return t.set_column(t.schema.get_field_index("block_start"), "block_start",
                            pa.array(starts, pa.list_(pa.int64())))
    bad = _rewrite(GOLDEN, tmp_path / "bad.parquet", table_fn=huge)
    with pytest.raises(TraceError, match="block ids must be in"):
        read_trace(bad)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "traces").glob("*.parquet")), ids=lambda p: p.name)
def test_sample_traces_validate(path):
    t = read_trace(path)
    assert check_entries(t) > 0
