"""Arrow array operations the replay path needs, done on the arrays' buffers with numpy.

``pyarrow.compute`` (which ``Array.is_null``, ``fill_null``, ``value_lengths`` and, in pyarrow 26,
``ListArray.flatten`` call) takes tens of milliseconds to import, a fixed cost of every command that
reads a trace or writes results (issue 43 item 5: ``replay`` against Mooncake's benchmark at a
small page, where the whole peer run is 0.4 s). Each function gives what its pyarrow counterpart
gives, checked against it in tests/test_arrowops.py.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def null_mask(arr: pa.Array) -> np.ndarray:
    """True where ``arr`` is null (``arr.is_null()``), from its validity bitmap."""
    n = len(arr)
    if not arr.null_count:
        return np.zeros(n, bool)
    bits = np.unpackbits(np.frombuffer(arr.buffers()[0], np.uint8), bitorder="little")
    return bits[arr.offset:arr.offset + n] == 0


def filled(arr: pa.Array) -> np.ndarray:
    """A fixed-width numeric (not boolean) array's values with its nulls as 0
    (``arr.fill_null(0).to_numpy()``), read from its value buffer."""
    data = np.frombuffer(arr.buffers()[1], np.dtype(arr.type.to_pandas_dtype()))
    data = data[arr.offset:arr.offset + len(arr)].copy()
    data[null_mask(arr)] = 0
    return data


def list_lengths(arr: pa.Array) -> np.ndarray:
    """Each list's length as int64, 0 for a null list (``arr.value_lengths().fill_null(0)``)."""
    lengths = np.diff(arr.offsets.to_numpy()).astype(np.int64)
    lengths[null_mask(arr)] = 0
    return lengths


def list_values(arr: pa.Array) -> pa.Array:
    """The values of a list array's non-null lists, in order (``arr.flatten()``): one slice of the
    child array where every null list is empty (as pyarrow builds them), else ``arr.flatten()``."""
    off = arr.offsets.to_numpy()
    if arr.null_count and np.diff(off)[null_mask(arr)].any():
        return arr.flatten()  # a null list backed by values: rare, pyarrow.compute's way
    return arr.values.slice(int(off[0]), int(off[-1] - off[0]))
