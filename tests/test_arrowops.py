"""kvemu.arrowops against pyarrow.compute's own results (the independent oracle), on sliced arrays
with and without nulls, and the replay path's import of neither."""

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from kvemu.arrowops import filled, list_lengths, list_values, null_mask

NUMERIC = [pa.int8(), pa.int32(), pa.int64(), pa.uint32(), pa.float32(), pa.float64()]
VALUES = [1, None, 3, 4, None, 6, 7, 8, None, 10, 11, 12, None, 14, 15, 16, 17]


@pytest.mark.parametrize("t", NUMERIC)
@pytest.mark.parametrize("lo,n", [(0, 17), (1, 9), (8, 9), (3, 0), (9, 1)])
def test_numeric_matches_compute(t, lo, n):
    a = pa.array(VALUES, t).slice(lo, n)
    assert null_mask(a).tolist() == a.is_null().to_pylist()
    f, g = filled(a), a.fill_null(0).to_numpy(zero_copy_only=False)
    assert f.dtype == g.dtype and f.tolist() == g.tolist()


def test_no_nulls():
    a = pa.array([5, 6, 7], pa.int64()).slice(1)
    assert null_mask(a).tolist() == [False, False]
    assert filled(a).tolist() == [6, 7]


@pytest.mark.parametrize("t", [pa.list_(pa.int64()), pa.large_list(pa.float64())])
@pytest.mark.parametrize("lo,n", [(0, 7), (1, 4), (2, 5), (6, 1), (3, 0)])
def test_lists_match_compute(t, lo, n):
    a = pa.array([[1, 2], None, [], [3], None, [4, 5, 6], [7]], t).slice(lo, n)
    assert list_lengths(a).tolist() == a.value_lengths().fill_null(0).to_pylist()
    assert list_values(a).to_pylist() == a.flatten().to_pylist()


def test_null_list_backed_by_values():
    """A null list whose offsets span values (possible in Arrow, not as pyarrow builds them):
    its values are left out, as flatten leaves them out."""
    offsets = pa.array([0, 2, 4, 5], pa.int32())
    a = pa.ListArray.from_arrays(offsets, pa.array([1, 2, 3, 4, 5]), mask=pa.array([False, True, False]))
    assert a.null_count == 1 and np.diff(a.offsets.to_numpy()).tolist() == [2, 2, 1]
    assert list_values(a).to_pylist() == a.flatten().to_pylist() == [1, 2, 5]
    assert list_lengths(a).tolist() == [2, 0, 1]


def test_trace_read_and_results_without_compute(tmp_path):
    """Reading a recorded trace's entries (with their checks and digest) and pooling a results
    table's inter-token latencies do not import pyarrow.compute."""
    code = (
        "import sys, pyarrow as pa\n"
        "from kvemu.integrity import SectionDigest\n"
        "from kvemu.metrics import pooled_itl\n"
        "t = pa.table({'itl_ms': pa.array([[1.0, 2.0], None, [3.0]]), 'x': pa.array([1, None, 3])})\n"
        "assert pooled_itl(t).tolist() == [1.0, 2.0, 3.0]\n"
        "d = SectionDigest(['itl_ms', 'x']); d.update(t); d.to_dict()\n"
        "print('pyarrow.compute' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
