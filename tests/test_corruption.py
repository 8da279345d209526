"""Corruption is detected (issue 15, classes 1 and 4): single-bit flips in the data pages of a trace
and of a results file, and traces whose entries or metadata are wrong in ways that used to crash
or allocate hundreds of GiB. Every file is either read as exactly what was written, or refused by
`trace validate`, `replay` and `report` alike with one line and exit 2, with no output written."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.schema import METADATA_KEY, ROW_ENTRY

FLIPS = 100
BACKEND = "vemu:cxl-pool"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_refused(res, path):
    """Exit 2, one `Error:` line naming the file, no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert isinstance(res.exception, SystemExit), res.exception
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    assert str(path) in lines[0] and "Traceback" not in res.output


def assert_no_crash(res):
    assert res.exit_code in (0, 2), (res.exit_code, res.output, res.exception)
    assert isinstance(res.exception, (SystemExit, type(None))), res.exception
    if res.exit_code == 2:
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("corruption")
    trace, results = d / "t.parquet", d / "r.parquet"
    res = run("record", "--workload", "synthetic:chat:sessions=3,turns=2", "--model", "llama3-8b", "--hbm-kv-gib",
              "0.5", "--out", trace)
    assert res.exit_code == 0, res.output
    res = run("replay", trace, "--backend", BACKEND, "--out", results)
    assert res.exit_code == 0, res.output
    return trace, results


# ------------------------------------------------------------------------- the oracle, in the test
def page_bytes(path) -> np.ndarray:
    """Offsets of every byte of every column chunk's pages (dictionary page, data pages and their
    headers), from the footer's column chunk offsets and sizes."""
    md = pq.ParquetFile(path).metadata
    spans = []
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            col = md.row_group(g).column(c)
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                start = min(start, col.dictionary_page_offset)
            spans.append(np.arange(start, start + col.total_compressed_size))
    return np.unique(np.concatenate(spans))


def decoded(path):
    """Every column's values as Python objects (NaN as a string, so that equal files compare equal),
    or None when pyarrow, without checksum verification, cannot decode the file."""
    try:
        t = pq.read_table(path)
    except (pa.ArrowException, OSError):
        return None
    return {name: json.dumps(t[name].to_pylist()) for name in t.column_names}, t.schema.metadata


def flipped_copies(src, dst, n, seed):
    data = src.read_bytes()
    where = page_bytes(src)
    rng = random.Random(seed)
    for k in range(n):
        pos = int(where[rng.randrange(len(where))])
        bit = rng.randrange(8)
        b = bytearray(data)
        b[pos] ^= 1 << bit
        dst.write_bytes(bytes(b))
        yield k, pos, bit


def test_the_written_files_have_checksums(files):
    trace, results = files
    for p in files:
        assert b"kvemu.digest" in pq.ParquetFile(p).metadata.metadata
    res = run("trace", "validate", trace)
    assert res.exit_code == 0 and "content digest" in res.output and "none" not in res.output.split("checksums:")[1]
    res = run("trace", "validate", "tests/data/golden-trace-v1.parquet")
    assert res.exit_code == 0 and "checksums: none" in res.output
    info = run("trace", "info", "tests/data/golden-trace-v2.parquet")
    assert info.exit_code == 0 and "checksums" in info.output and "none (" in info.output


def test_single_bit_flips_in_a_trace_are_detected(files, tmp_path):
    trace, _ = files
    original = decoded(trace)
    bad = tmp_path / "bad.parquet"
    out = tmp_path / "out.parquet"
    changed = 0
    for k, pos, bit in flipped_copies(trace, bad, FLIPS, seed=15):
        validate = run("trace", "validate", bad)
        replay = run("replay", bad, "--backend", BACKEND, "--out", out)
        if decoded(bad) == original:
            assert_no_crash(validate)
            assert_no_crash(replay)
        else:
            changed += 1
            assert_refused(validate, bad)
            assert_refused(replay, bad)
            assert not out.exists(), f"flip {k} (byte {pos} bit {bit}): replay wrote results"
        out.unlink(missing_ok=True)
    assert changed > FLIPS // 2  # most flips do change what the file decodes to


def test_single_bit_flips_in_results_are_detected(files, tmp_path):
    _, results = files
    original = decoded(results)
    bad = tmp_path / "bad-results.parquet"
    changed = 0
    for k, pos, bit in flipped_copies(results, bad, FLIPS, seed=16):
        report = run("report", bad)
        if decoded(bad) == original:
            assert_no_crash(report)
        else:
            changed += 1
            assert_refused(report, bad)
    assert changed > FLIPS // 2


def test_a_sweep_cell_received_from_a_worker_is_verified(files, tmp_path):
    # store_cell's reader: the results a worker sends back are checked like a file on disk
    from kvemu.errors import ResultsError
    from kvemu.integrity import read_verified_results

    _, results = files
    data = results.read_bytes()
    assert read_verified_results(data, "cell").equals(pq.read_table(results))
    bad = tmp_path / "bad.parquet"
    changed = 0
    for k, pos, bit in flipped_copies(results, bad, 40, seed=23):
        if decoded(bad) != decoded(results):
            changed += 1
            with pytest.raises(ResultsError, match="^cell: "):
                read_verified_results(bad.read_bytes(), "cell")
    assert changed > 20
    plain = tmp_path / "plain.parquet"
    pq.write_table(pq.read_table(results), plain)  # another writer: no digest
    with pytest.raises(ResultsError, match="without their content digest"):
        read_verified_results(plain.read_bytes(), "cell")


# ---------------------------------------------------- class 4: entries and metadata out of bounds
def rewrite(src, dst, entries=None, steps_kept=None, meta=None):
    """A copy of trace ``src`` with entry columns changed (``entries``: {column: f(array) -> array}),
    only the first ``steps_kept`` step rows, or other metadata; written by pyarrow (no digest)."""
    t = pq.read_table(src)
    rt = t["row_type"].to_numpy()
    if entries:
        is_entry = rt == ROW_ENTRY
        for name, f in entries.items():
            col = t[name].combine_chunks()
            new = np.zeros(len(col), np.int64)
            new[is_entry] = f(col.filter(pa.array(is_entry)).to_numpy().astype(np.int64))
            arr = pc.if_else(pa.array(is_entry), pa.array(new).cast(col.type), col)
            t = t.set_column(t.schema.get_field_index(name), name, arr)
    if steps_kept is not None:
        step = t["step"].to_numpy(zero_copy_only=False)
        t = t.filter(pa.array(~((rt == 1) & (step >= steps_kept))))
    m = json.loads(t.schema.metadata[METADATA_KEY])
    if meta:
        m = meta(m)
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(m).encode()}), dst)
    return dst


def _set_first(col, value):
    col = col.copy()
    col[0] = value
    return col


CLASS4 = {
    "steps-removed": (dict(steps_kept=100), "entry refers to step"),
    "request-1e6": (dict(entries={"request_id": lambda c: _set_first(c, 10**6)}), "entry refers to request 1000000"),
    "negative-store-first": (dict(entries={"store_first": lambda c: _set_first(c, -3)}), "store range -3+"),
    "read-count-2^31-1": (dict(entries={"read_count": lambda c: _set_first(c, 2**31 - 1)}),
                          "read range 0+2147483647 exceeds its block table"),
    "id-space-1e12": (dict(meta=lambda m: {**m, "blocks": {**m["blocks"], "id_space": 10**12}}),
                      "blocks.id_space 1000000000000 exceeds the"),
    "id-space-1e30": (dict(meta=lambda m: {**m, "blocks": {**m["blocks"], "id_space": 10**30}}),
                      "'blocks.id_space' must be an integer from 0 to 2^53"),
}


@pytest.mark.parametrize("case", sorted(CLASS4))
def test_out_of_bounds_traces_are_refused_everywhere(files, tmp_path, case):
    trace, _ = files
    how, message = CLASS4[case]
    bad = rewrite(trace, tmp_path / "bad.parquet", **how)
    out = tmp_path / "out.parquet"
    for args in (("trace", "validate", bad), ("replay", bad, "--backend", BACKEND, "--out", out),
                 ("replay", bad, "--backend", "dram", "--layers", "1", "--out", out),
                 ("replay", bad, "--backend", BACKEND, "--schedule", "recorded", "--out", out)):
        res = run(*args)
        assert_refused(res, bad)
        assert message in res.stderr, (args, res.stderr)
        assert not out.exists()


def test_the_id_space_bound_admits_every_sample_trace(tmp_path):
    """The bound on blocks.id_space (table positions x (1 + hash split)) never refuses a trace kvemu
    recorded: the samples and the golden files read."""
    from pathlib import Path

    for p in [*sorted(Path("traces").glob("*.parquet")), *sorted(Path("tests/data").glob("*.parquet"))]:
        res = run("trace", "validate", p)
        assert res.exit_code == 0, res.output


def test_a_rewritten_trace_keeps_no_stale_digest(files, tmp_path):
    """A trace whose rows changed after kvemu wrote it, with its digest copied along, is refused.
    The change keeps the rows consistent (the start of an empty load range), so only the digest
    can tell."""
    trace, _ = files
    t = pq.read_table(trace)
    first = t["load_first"].to_numpy(zero_copy_only=False).copy()
    empty = (t["row_type"].to_numpy() == ROW_ENTRY) & (t["load_count"].to_numpy(zero_copy_only=False) == 0)
    i = int(np.flatnonzero(empty)[-1])
    first[i] = 1
    t = t.set_column(t.schema.get_field_index("load_first"), "load_first",
                     pa.array(first, mask=np.isnan(first)).cast(pa.int32()))
    bad = tmp_path / "stale.parquet"
    with pq.ParquetWriter(bad, t.schema) as w:
        w.write_table(t)
        w.add_key_value_metadata({"kvemu.digest": pq.ParquetFile(trace).metadata.metadata[b"kvemu.digest"]})
    res = run("trace", "validate", bad)
    assert_refused(res, bad)
    assert "entry rows do not match the trace's content digest" in res.stderr


def test_results_with_a_stale_digest_are_refused(files, tmp_path):
    """A results file whose rows changed after kvemu wrote it, digest copied along: report refuses."""
    _, results = files
    t = pq.read_table(results)
    ttft = t["ttft_ms"].to_numpy().copy()
    ttft[0] += 1.0
    t = t.set_column(t.schema.get_field_index("ttft_ms"), "ttft_ms", pa.array(ttft))
    bad = tmp_path / "stale-results.parquet"
    with pq.ParquetWriter(bad, t.schema) as w:
        w.write_table(t)
        w.add_key_value_metadata({"kvemu.digest": pq.ParquetFile(results).metadata.metadata[b"kvemu.digest"]})
    res = run("report", bad)
    assert_refused(res, bad)
    assert "column 'ttft_ms' does not match the file's content digest" in res.stderr


def test_upgrade_writes_checksums_and_refuses_what_validate_refuses(tmp_path):
    """`trace upgrade` validates its source completely and writes the v2 file with checksums."""
    out = tmp_path / "v2.parquet"
    res = run("trace", "upgrade", "tests/data/golden-trace-v1.parquet", "--out", out)
    assert res.exit_code == 0, res.output
    res = run("trace", "validate", out)
    assert res.exit_code == 0 and "content digest" in res.output
    bad = rewrite("tests/data/golden-trace-v1.parquet", tmp_path / "bad-v1.parquet",
                  entries={"request_id": lambda c: _set_first(c, 10**6)})
    res = run("trace", "upgrade", bad, "--out", tmp_path / "never.parquet")
    assert_refused(res, bad)
    assert "entry refers to request 1000000" in res.stderr and not (tmp_path / "never.parquet").exists()
