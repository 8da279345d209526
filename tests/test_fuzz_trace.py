"""Property-based: whatever bytes or table a trace file holds, reading it either gives a valid trace
or raises TraceError (never another exception)."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.errors import TraceError
from kvemu.schema import METADATA_KEY, TRACE_SCHEMA, check_entries, read_trace

GOLDEN = Path(__file__).parent / "data" / "golden-trace-v1.parquet"
GOLDEN_BYTES = GOLDEN.read_bytes()
GOLDEN_META = json.loads(pq.read_schema(GOLDEN).metadata[METADATA_KEY])
SETTINGS = settings(max_examples=int(os.environ.get("KVEMU_FUZZ_EXAMPLES", "60")), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def read_all(path):
    try:
        check_entries(read_trace(path))
    except TraceError as e:
        assert str(e) and "\n" not in str(e)


@SETTINGS
@given(data=st.binary(max_size=4096))
def test_arbitrary_bytes(tmp_path, data):
    p = tmp_path / "t.parquet"
    p.write_bytes(data)
    read_all(p)


@SETTINGS
@given(edits=st.lists(st.tuples(st.integers(0, len(GOLDEN_BYTES) - 1), st.integers(0, 255)), min_size=1,
                      max_size=8), cut=st.integers(1, len(GOLDEN_BYTES)))
def test_corrupted_golden_file(tmp_path, edits, cut):
    b = bytearray(GOLDEN_BYTES[:cut])
    for pos, val in edits:
        if pos < len(b):
            b[pos] = val
    p = tmp_path / "t.parquet"
    p.write_bytes(bytes(b))
    read_all(p)


def _column(field, n, draw):
    if field.name == "row_type":
        return pa.array(draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n)), pa.int8())
    if pa.types.is_list(field.type):
        vals = draw(st.lists(st.one_of(st.none(), st.lists(st.integers(-3, 40), max_size=4)), min_size=n,
                             max_size=n))
        return pa.array(vals, field.type)
    if pa.types.is_floating(field.type):
        return pa.array(draw(st.lists(st.one_of(st.none(), st.floats(-10, 1e6)), min_size=n, max_size=n)),
                        field.type)
    lo, hi = -5, 60
    return pa.array(draw(st.lists(st.one_of(st.none(), st.integers(lo, hi)), min_size=n, max_size=n)), field.type)


@SETTINGS
@given(data=st.data(), n=st.integers(0, 12), id_space=st.integers(0, 50))
def test_random_tables_with_valid_metadata(tmp_path, data, n, id_space):
    cols = [_column(f, n, data.draw) for f in TRACE_SCHEMA]
    meta = {**GOLDEN_META, "blocks": {"id_space": id_space, "shared_id_space": 0}}
    t = pa.Table.from_arrays(cols, schema=TRACE_SCHEMA).replace_schema_metadata(
        {METADATA_KEY: json.dumps(meta).encode()})
    p = tmp_path / "t.parquet"
    pq.write_table(t, p)
    read_all(p)


@SETTINGS
@given(meta=st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=8),
                         lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                         max_leaves=12))
def test_random_metadata(tmp_path, meta):
    t = pq.read_table(GOLDEN)
    for m in (meta, {**GOLDEN_META, "model": meta}, {**GOLDEN_META, "blocks": meta}):
        p = tmp_path / "t.parquet"
        pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(m).encode()}), p)
        read_all(p)


def test_a_corrupt_entry_page_header_is_a_trace_error(tmp_path):
    """Found by the fuzzer above from a fresh clone: a zeroed byte in the first data page's header
    made pyarrow's batch iterator raise OSError through iter_entries."""
    b = bytearray(GOLDEN_BYTES[:15595])
    b[96] = 0
    p = tmp_path / "t.parquet"
    p.write_bytes(bytes(b))
    read_all(p)
