"""Checksums of kvemu's Parquet files (traces and results): docs/trace-format.md, "Checksums".

Two layers, written by every kvemu writer and verified by every kvemu reader:

- **Parquet page checksums** (CRC-32 of each page's compressed bytes, in its page header): written
  with ``write_page_checksum``, verified as each page is decoded (``page_checksum_verification``).
  They catch a changed byte in a page's data wherever a reader decodes it, also when it reads only
  some columns.
- **A content digest** in the file's key-value metadata (key ``kvemu.digest``, added when the file
  is closed): BLAKE2b-128 of the ``kvemu`` metadata and of every column's *decoded* values, per
  section (traces) or per column (results). It catches what the CRCs cannot: a change in a page
  header, the dictionary or the footer that decodes to different values, and any change to the
  metadata. It is verified wherever a reader has decoded a whole column.

Files without the key (written before kvemu wrote checksums, or by other tools) are read as they
are: their contents are checked for consistency, not verified, and ``trace info`` / ``validate``
say so.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .arrowops import filled, list_lengths, list_values, null_mask
from .errors import ResultsError
from .inputs import MAX_NESTING
from .validation import check_results_table

#: The schema-metadata key of traces and results alike (re-exported by kvemu.schema, which reads it).
METADATA_KEY = b"kvemu"
DIGEST_KEY = b"kvemu.digest"
DIGEST_ALGORITHM = "blake2b-128"
#: Writer options of every kvemu Parquet file.
WRITE_OPTIONS = {"compression": "zstd", "write_page_checksum": True}
#: Reader options of every kvemu Parquet file: a page whose CRC does not match is an error.
READ_OPTIONS = {"page_checksum_verification": True}


def decode_error(e: BaseException) -> str:
    """One line for a failure to decode a page (pyarrow's message, first line; a checksum mismatch
    said plainly)."""
    lines = str(e).splitlines()
    text = lines[0] if lines else type(e).__name__
    if "CRC checksum verification failed" in text:
        return "a page does not match its checksum: the file is corrupt"
    return text


def _hasher():
    return hashlib.blake2b(digest_size=16)


def metadata_digest(raw: bytes) -> str:
    h = _hasher()
    h.update(raw)
    return h.hexdigest()


class ColumnDigest:
    """Digest of one column's decoded values, fed batch by batch; the result does not depend on how
    the rows were batched. Numbers are hashed as their little-endian bytes (nulls as 0, with the
    positions of the nulls apart), lists as their lengths and their flattened values."""

    def __init__(self):
        self._streams: dict[str, object] = {}
        self._rows: dict[str, int] = {}

    def _feed(self, key: str, data: np.ndarray) -> None:
        h = self._streams.get(key)
        if h is None:
            h = self._streams[key] = _hasher()
        h.update(np.ascontiguousarray(data).view(np.uint8))

    def update(self, arr, key: str = "v") -> None:
        if isinstance(arr, pa.ChunkedArray):
            for chunk in arr.chunks:
                self.update(chunk, key)
            return
        n = len(arr)
        if n == 0:  # nothing to hash: an empty batch leaves the digest as it is
            return
        at = self._rows.get(key, 0)
        self._rows[key] = at + n
        if arr.null_count:
            nulls = np.flatnonzero(null_mask(arr)).astype(np.int64) + at
            self._feed(key + "?", nulls)
        t = arr.type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            self._feed(key + "#", list_lengths(arr))
            self.update(list_values(arr), key + "[]")
        elif pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
            if arr.null_count and not pa.types.is_boolean(t):
                data = filled(arr)
            else:
                values = arr.fill_null(False) if arr.null_count else arr
                data = values.to_numpy(zero_copy_only=False)
            self._feed(key, data.astype(data.dtype.newbyteorder("<"), copy=False))
        else:  # no kvemu file has other types; hashed value by value, still independent of batching
            text = "".join(json.dumps(v, default=str) + "\n" for v in arr.to_pylist())
            self._feed(key, np.frombuffer(text.encode(), np.uint8))

    def hexdigest(self) -> str:
        h = _hasher()
        for key in sorted(self._streams):
            h.update(key.encode() + b"\0" + self._streams[key].digest())
        for key in sorted(self._rows):
            h.update(f"{key}={self._rows[key]};".encode())
        return h.hexdigest()


class SectionDigest:
    """Digests of a set of columns over some rows (a trace section, or a results file's rows)."""

    def __init__(self, columns):
        self.columns = tuple(columns)
        self.rows = 0
        self._col = {name: ColumnDigest() for name in self.columns}

    def update(self, table) -> None:
        """``table``: a pa.Table or pa.RecordBatch holding (at least) the columns."""
        self.rows += table.num_rows
        for name in self.columns:
            self._col[name].update(table.column(name))

    def to_dict(self) -> dict:
        return {"rows": self.rows, "columns": {name: d.hexdigest() for name, d in self._col.items()}}


def digest_value(metadata_raw: bytes, sections: dict | None = None, columns: dict | None = None) -> bytes:
    """The ``kvemu.digest`` value: the metadata's digest and the sections' (traces) or the columns'
    (results) digests."""
    d = {"algorithm": DIGEST_ALGORITHM, "page_checksums": True, "metadata": metadata_digest(metadata_raw)}
    if sections is not None:
        d["sections"] = sections
    if columns is not None:
        d["rows"], d["columns"] = columns["rows"], columns["columns"]
    return json.dumps(d, sort_keys=True, allow_nan=False).encode()


def read_digest(pf: pq.ParquetFile) -> dict | None | str:
    """The file's ``kvemu.digest`` object; None when it has none; a string saying what is wrong
    when it has one that is not a digest kvemu wrote."""
    raw = (pf.metadata.metadata or {}).get(DIGEST_KEY)
    if raw is None:
        return None
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "'kvemu.digest' metadata is not valid JSON"
    except RecursionError:
        return f"'kvemu.digest' metadata nests more than {MAX_NESTING} levels deep"
    if not isinstance(d, dict) or d.get("algorithm") != DIGEST_ALGORITHM or not isinstance(d.get("metadata"), str):
        return f"'kvemu.digest' metadata is not a {DIGEST_ALGORITHM} digest kvemu wrote"
    return d


def checksums_text(digest: dict | None) -> str:
    """What a reader verifies in a file with this digest (None: without checksums)."""
    if digest is None:
        return ("none (the file was written without page checksums or a content digest: its contents are "
                "checked for consistency, not verified)")
    return "page CRC-32 and content digest (blake2b-128), verified"


class ResultsWriter:
    """A results file written a row group at a time, with page checksums and the content digest of
    its metadata and every column (added when closed). Use as a context manager."""

    def __init__(self, path, schema: pa.Schema, metadata: dict):
        self.metadata = metadata
        self.schema = schema.with_metadata(metadata)
        self._writer = pq.ParquetWriter(path, self.schema, **WRITE_OPTIONS)
        self._digest = SectionDigest(schema.names)

    def write_table(self, table: pa.Table) -> None:
        table = table.replace_schema_metadata(self.metadata)
        self._digest.update(table)
        self._writer.write_table(table)

    def close(self, ok: bool = True) -> None:
        if ok:
            self._writer.add_key_value_metadata(
                {DIGEST_KEY: digest_value(self.metadata[METADATA_KEY], columns=self._digest.to_dict())})
        self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close(ok=exc_type is None)
        return False


def write_results(path, table: pa.Table, metadata: dict) -> None:
    """One results table written at once (replay --repeat, a sweep's cells), with checksums."""
    with ResultsWriter(path, table.schema, metadata) as w:
        w.write_table(table)


def verify_columns(digest: dict, metadata_raw: bytes, table: pa.Table) -> str | None:
    """Against a results file's digest: the metadata and the columns of ``table`` (all of their
    rows). None when they match, else what does not."""
    if digest.get("metadata") != metadata_digest(metadata_raw):
        return "'kvemu' metadata does not match the file's content digest"
    cols = digest.get("columns")
    if not isinstance(cols, dict) or digest.get("rows") != table.num_rows:
        return f"{table.num_rows} rows, the file's content digest says {digest.get('rows')!r}"
    for name in table.column_names:
        d = ColumnDigest()
        d.update(table.column(name))
        if cols.get(name) != d.hexdigest():
            return f"column '{name}' does not match the file's content digest"
    return None


def read_verified_results(data: bytes, where: str) -> pa.Table:
    """A results file received as bytes (a sweep cell from a worker), verified like a file on disk:
    page CRCs as it decodes, then the content digest over every column. ResultsError otherwise."""
    try:
        pf = pq.ParquetFile(pa.BufferReader(data), **READ_OPTIONS)
        table = pf.read()
    except (OSError, pa.ArrowException) as e:
        raise ResultsError(f"{where}: results cannot be decoded ({decode_error(e)})") from None
    digest = read_digest(pf)
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ResultsError(f"{where}: not kvemu results (no 'kvemu' schema metadata)")
    if isinstance(digest, str):
        raise ResultsError(f"{where}: {digest}")
    if digest is None:
        raise ResultsError(f"{where}: results arrived without their content digest")
    bad = verify_columns(digest, raw, table)
    if bad:
        raise ResultsError(f"{where}: {bad}: the results were corrupted on their way")
    check_results_table(where, table)
    return table
