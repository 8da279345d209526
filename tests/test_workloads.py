"""Tests for kvemu.workloads: the Mooncake and Azure readers, selection, synthetic generators."""

from __future__ import annotations

import hashlib
import json
import os
import math
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu import workloads
from kvemu.errors import ConfigError, WorkloadError
from kvemu.workloads import SYNTHETIC_WORKLOADS, Workload, load_workload, register_synthetic

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
MOONCAKE_TRACE = TRACES / "mooncake_conversation_trace.jsonl"
AZURE_TRACE = TRACES / "azure_llm_2023_code.csv"


# ---------------------------------------------------------------------------------------------
# helpers


def write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def mooncake_line(ts, n_in, n_out, ids=None, block=512) -> str:
    if ids is None:
        ids = list(range(-(-n_in // block)))
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def azure_text(*rows: str, header: str = "TIMESTAMP,ContextTokens,GeneratedTokens") -> str:
    return "\n".join((header, *rows)) + "\n"


def chain_violations(w: Workload) -> int:
    """Ids that appear at two block positions or after two different parent ids.

    Chained ids stand for a block together with everything before it, so an id fixes both its
    position and the id before it; a reader or generator that breaks this mixes up prefixes.
    """
    counts = np.diff(w.hash_offsets)
    row = np.repeat(np.arange(w.n_requests), counts)
    position = np.arange(len(w.hash_ids)) - w.hash_offsets[row]
    parent = np.where(position > 0, np.r_[-1, w.hash_ids[:-1]], -1)
    _, inverse = np.unique(w.hash_ids, return_inverse=True)
    bad = 0
    for values in (position, parent):
        low = np.full(inverse.max() + 1, np.iinfo(np.int64).max)
        high = np.full(inverse.max() + 1, np.iinfo(np.int64).min)
        np.minimum.at(low, inverse, values)
        np.maximum.at(high, inverse, values)
        bad += int(np.count_nonzero(low != high))
    return bad


def prefix_hit_ratio(w: Workload) -> float:
    """Share of input tokens in leading blocks that all appeared in earlier requests (infinite cache)."""
    seen_before = np.ones(len(w.hash_ids), dtype=bool)
    seen_before[np.unique(w.hash_ids, return_index=True)[1]] = False
    counts = np.diff(w.hash_offsets)
    row = np.repeat(np.arange(w.n_requests), counts)
    position = np.arange(len(w.hash_ids)) - w.hash_offsets[row]
    # The hit run of a request ends at its first block never seen before.
    run = counts.copy()
    np.minimum.at(run, row[~seen_before], position[~seen_before])
    hit_tokens = np.minimum(run * w.hash_block_tokens, w.input_tokens)
    return hit_tokens.sum() / w.input_tokens.sum()


def assert_valid(w: Workload) -> None:
    """What every loaded workload promises beyond the invariants Workload checks itself."""
    assert isinstance(w, Workload)
    json.dumps(w.params, allow_nan=False)
    assert w.checksum.startswith("sha256:") and len(w.checksum) == len("sha256:") + 64
    for array in (w.arrival_ms, w.input_tokens, w.output_tokens, w.hash_offsets, w.hash_ids):
        assert not array.flags.writeable


# ---------------------------------------------------------------------------------------------
# Mooncake


def test_mooncake_small_file(tmp_path):
    text = "\n".join([mooncake_line(1000, 600, 5, [7, 8]), mooncake_line(1250, 512, 0, [7]),
                      mooncake_line(1250.5, 1, 3, [9])]) + "\n"
    path = write(tmp_path, "t.jsonl", text)
    w = load_workload(f"mooncake:{path}")
    assert_valid(w)
    assert (w.source, w.kind, w.hash_block_tokens) == (f"mooncake:{path}", "mooncake", 512)
    assert w.checksum == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    assert w.arrival_ms.tolist() == [0.0, 250.0, 250.5]
    assert w.input_tokens.tolist() == [600, 512, 1]
    assert w.output_tokens.tolist() == [5, 1, 3]  # output_length 0 clamped to 1 ...
    assert w.params["output_zero_clamped"] == 1  # ... and counted
    assert w.hash_offsets.tolist() == [0, 2, 3, 4]
    assert w.hashes(0).tolist() == [7, 8] and w.hashes(-1).tolist() == [9]
    assert np.shares_memory(w.hashes(1), w.hash_ids)
    assert w.params["time_origin"] == 1000 and w.params["sorted"] is False
    with pytest.raises(IndexError):
        w.hashes(3)


def test_mooncake_block_size_override(tmp_path):
    path = write(tmp_path, "t.jsonl", mooncake_line(0, 9, 1, [1, 2, 3]))
    w = load_workload(f"mooncake:{path}", hash_block_tokens=4)
    assert w.hash_block_tokens == 4 and w.params["hash_block_tokens"] == 4
    with pytest.raises(WorkloadError, match=r":1: 'hash_ids' has 3 entries .* ceil\(9 / 512\) = 1"):
        load_workload(f"mooncake:{path}")


GOOD = mooncake_line(0, 10, 1, [1])


@pytest.mark.parametrize("bad_line, message", [
    ('{"timestamp": 0, "input_length": 1', "malformed JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1}', "missing field 'hash_ids'"),
    ('{"hash_ids": []}', "missing field 'timestamp', 'input_length', 'output_length'"),
    (mooncake_line("0", 10, 1, [1]), "'timestamp' must be a number of ms, got '0'"),
    (mooncake_line(0, "10", 1, [1]), "'input_length' must be an integer token count, got '10'"),
    (mooncake_line(0, 10.0, 1, [1]), "'input_length' must be an integer token count, got 10.0"),
    (mooncake_line(0, True, 1, [1]), "'input_length' must be an integer token count, got True"),
    (mooncake_line(0, 10, None, [1]), "'output_length' must be an integer token count, got None"),
    (mooncake_line(0, 10, 1, [1.0]), "'hash_ids' must be a list of integers"),
    (mooncake_line(0, 10, 1, "1"), "'hash_ids' must be a list of integers"),
    (mooncake_line(0, 2**70, 1, [1]), "'input_length' must be an integer token count"),
    (mooncake_line(0, 10, 1, [2**64]), "hash id 18446744073709551616 does not fit in 64 bits"),
    (mooncake_line(0, 0, 1, []), "'input_length' must be >= 1, got 0"),
    (mooncake_line(0, -5, 1, []), "'input_length' must be >= 1, got -5"),
    (mooncake_line(0, 10, -1, [1]), "'output_length' must be >= 0, got -1"),
    (mooncake_line(0, 10, 1, [1]).replace("0", "NaN", 1), "'timestamp' must be finite"),
    (mooncake_line(0, 513, 1, [1]), "'hash_ids' has 1 entries but input_length 513 needs "
     "ceil(513 / 512) = 2"),
    (mooncake_line(0, 512, 1, [1, 2]), "'hash_ids' has 2 entries but input_length 512 needs"),
    ("\xff", "malformed JSON"),
])
def test_mooncake_errors_name_file_and_line(tmp_path, bad_line, message):
    # The bad record sits on line 3, after a good one and a blank line that still counts.
    path = write(tmp_path, "bad.jsonl", f"{GOOD}\n\n{bad_line}\n{GOOD}\n")
    with pytest.raises(WorkloadError) as err:
        load_workload(f"mooncake:{path}")
    text = str(err.value)
    assert text.startswith(f"{path}:3: ") and message in text and "\n" not in text


def test_mooncake_not_utf8(tmp_path):
    path = write(tmp_path, "bad.jsonl", GOOD.encode() + b"\n" + b'{"timestamp": "\xff"}\n')
    with pytest.raises(WorkloadError, match=r"bad\.jsonl:2: not UTF-8"):
        load_workload(f"mooncake:{path}")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_mooncake_empty_file(tmp_path, content):
    path = write(tmp_path, "empty.jsonl", content)
    with pytest.raises(WorkloadError, match=r"empty\.jsonl: empty file"):
        load_workload(f"mooncake:{path}")


def test_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="nothere.jsonl: cannot read"):
        load_workload(f"mooncake:{tmp_path / 'nothere.jsonl'}")
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(f"azure:{tmp_path}")  # a directory


def test_mooncake_out_of_order_rows_are_sorted_stably(tmp_path):
    rows = [(10, 100, [1]), (5, 200, [2]), (20, 300, [3]), (5, 600, [4, 5])]
    path = write(tmp_path, "t.jsonl", "\n".join(mooncake_line(ts, n, 1, ids) for ts, n, ids in rows))
    w = load_workload(f"mooncake:{path}")
    assert_valid(w)
    assert w.params["sorted"] is True
    assert w.params["out_of_order"] == 2  # both ts=5 rows come after a later request
    assert w.params["time_origin"] == 5
    assert w.arrival_ms.tolist() == [0.0, 0.0, 5.0, 15.0]
    assert w.input_tokens.tolist() == [200, 600, 100, 300]  # ties keep file order
    assert [w.hashes(i).tolist() for i in range(4)] == [[2], [4, 5], [1], [3]]


def test_window_then_limit(tmp_path):
    times = [1000, 1100, 1200, 1300, 1400, 1500]
    path = write(tmp_path, "t.jsonl", "\n".join(mooncake_line(t, t // 100, 1) for t in times))
    spec = f"mooncake:{path}"
    # The window is in ms from the first request of the file: a <= t < b.
    w = load_workload(spec, window_ms=(100, 400))
    assert w.input_tokens.tolist() == [11, 12, 13]
    assert w.arrival_ms.tolist() == [0.0, 100.0, 200.0]
    assert w.params["time_offset_ms"] == 100.0 and w.params["window_ms"] == [100.0, 400.0]
    # The window applies first, then the first N of what it kept.
    w = load_workload(spec, window_ms=(150, 10_000), max_requests=2)
    assert w.input_tokens.tolist() == [12, 13]
    assert w.params["time_offset_ms"] == 200.0 and w.params["max_requests"] == 2
    assert w.params["source_requests"] == 6
    w = load_workload(spec, max_requests=100)
    assert w.n_requests == 6
    # An open end (the CLI's "--window-ms 250:") is recorded as null.
    w = load_workload(spec, window_ms=(250, math.inf))
    assert w.input_tokens.tolist() == [13, 14, 15] and w.params["window_ms"] == [250.0, None]
    json.dumps(w.params, allow_nan=False)
    with pytest.raises(WorkloadError, match="no requests left"):
        load_workload(spec, window_ms=(600, 700))


def test_window_applies_after_sorting(tmp_path):
    rows = [(300, 1), (0, 2), (100, 3), (200, 4)]
    path = write(tmp_path, "t.jsonl", "\n".join(mooncake_line(t, n, 1) for t, n in rows))
    w = load_workload(f"mooncake:{path}", window_ms=(100, 300))
    assert w.input_tokens.tolist() == [3, 4] and w.params["sorted"] is True


# ---------------------------------------------------------------------------------------------
# Azure


def test_azure_small_file(tmp_path):
    text = azure_text("2023-11-16 18:17:03.9799600,4808,10", "2023-11-16 18:17:04.0319600,3180,0",
                      "2023-11-16 18:17:05.0000000,110,27")
    path = write(tmp_path, "t.csv", text)
    w = load_workload(f"azure:{path}")
    assert_valid(w)
    assert (w.kind, w.hash_block_tokens) == ("azure", None)
    assert w.checksum == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    assert w.arrival_ms == pytest.approx([0.0, 52.0, 1020.04])
    assert w.input_tokens.tolist() == [4808, 3180, 110]
    assert w.output_tokens.tolist() == [10, 1, 27] and w.params["output_zero_clamped"] == 1
    assert w.hash_offsets.tolist() == [0, 0, 0, 0] and len(w.hash_ids) == 0
    assert w.params["time_origin"] == "2023-11-16 18:17:03.9799600"


def test_azure_extra_columns_bom_and_sorting(tmp_path):
    text = "\ufeff" + azure_text("2023-01-01 00:00:01,5,1,x", "2023-01-01 00:00:00.5,6,2,y",
                                 header="TIMESTAMP,ContextTokens,GeneratedTokens,Note")
    w = load_workload(f"azure:{write(tmp_path, 't.csv', text)}")
    assert w.input_tokens.tolist() == [6, 5] and w.arrival_ms.tolist() == [0.0, 500.0]
    assert w.params["sorted"] is True and w.params["out_of_order"] == 1
    assert w.params["time_origin"] == "2023-01-01 00:00:00.5"


def test_azure_refuses_hash_block_tokens(tmp_path):
    path = write(tmp_path, "t.csv", azure_text("2023-01-01 00:00:00,5,1"))
    with pytest.raises(ConfigError, match="no prefix information"):
        load_workload(f"azure:{path}", hash_block_tokens=16)


OK_ROW = "2023-11-16 18:17:03.9799600,4808,10"


@pytest.mark.parametrize("bad_row, message", [
    ("16/11/2023 18:17,4808,10", "unparsable TIMESTAMP '16/11/2023 18:17'"),
    ("now,4808,10", "unparsable TIMESTAMP 'now'"),
    ("2023-13-16 18:17:03.9799600,4808,10", "unparsable TIMESTAMP (Month out of range"),
    ("2023-11-16 24:17:03,4808,10", "unparsable TIMESTAMP (Hours out of range"),
    ("2023-11-16 18:17:03,48x8,10", "ContextTokens must be an integer token count, got '48x8'"),
    ("2023-11-16 18:17:03,4808,", "GeneratedTokens must be an integer token count, got ''"),
    ("2023-11-16 18:17:03,4808.0,10", "ContextTokens must be an integer token count"),
    ("2023-11-16 18:17:03,0,10", "ContextTokens must be >= 1, got 0"),
    ("2023-11-16 18:17:03,-4,10", "ContextTokens must be >= 1, got -4"),
    ("2023-11-16 18:17:03,4808,-10", "GeneratedTokens must be >= 0, got -10"),
    (",,", "unparsable TIMESTAMP ''"),
    ("2023-11-16 18:17:03,4808", "expected 3 fields as in the header, got 2"),
    ("2023-11-16 18:17:03,4808,1,2", "expected 3 fields as in the header, got 4"),
    pytest.param("2023-11-16 18:17:03,4808," + "9" * 200_000, "malformed CSV (field larger than field limit",
                 id="huge-field"),
])
def test_azure_errors_name_file_and_line(tmp_path, bad_row, message):
    path = write(tmp_path, "bad.csv", azure_text(OK_ROW, "", bad_row, OK_ROW))
    with pytest.raises(WorkloadError) as err:
        load_workload(f"azure:{path}")
    text = str(err.value)
    assert text.startswith(f"{path}:4: ") and message in text and "\n" not in text


def test_azure_header_and_encoding_errors(tmp_path):
    path = write(tmp_path, "h.csv", azure_text(OK_ROW, header="TIMESTAMP,ContextTokens,Generated"))
    with pytest.raises(WorkloadError, match=r"h\.csv:1: header is missing column 'GeneratedTokens'"):
        load_workload(f"azure:{path}")
    path = write(tmp_path, "u.csv", azure_text(OK_ROW).encode() + b"2023-11-16 18:17:04,\xff,1\n")
    with pytest.raises(WorkloadError, match=r"u\.csv:3: not UTF-8"):
        load_workload(f"azure:{path}")
    path = write(tmp_path, "b.csv", b"\xef\xbb\xbf" + azure_text(OK_ROW).encode() + b"\n\xff\n")
    with pytest.raises(WorkloadError, match=r"b\.csv:4: not UTF-8"):
        load_workload(f"azure:{path}")
    path = write(tmp_path, "e.csv", "\n")
    with pytest.raises(WorkloadError, match=r"e\.csv: empty file"):
        load_workload(f"azure:{path}")
    path = write(tmp_path, "o.csv", azure_text())
    with pytest.raises(WorkloadError, match=r"o\.csv: no requests after the header"):
        load_workload(f"azure:{path}")


def test_azure_quoted_multiline_row_reports_its_first_line(tmp_path):
    path = write(tmp_path, "q.csv", azure_text(OK_ROW, '2023-11-16 18:17:04,"1\n2",3'))
    with pytest.raises(WorkloadError, match=r"q\.csv:3: ContextTokens"):
        load_workload(f"azure:{path}")


# ---------------------------------------------------------------------------------------------
# Specs and options


@pytest.mark.parametrize("spec, kwargs, message", [
    ("parquet:/x", {}, "unknown workload source 'parquet'.*mooncake:PATH, azure:PATH, .*synthetic:NAME"),
    ("mooncake:", {}, "names no file"),
    ("synthetic:nope", {}, "unknown synthetic workload 'nope'; known: agent, chat, docqa"),
    ("synthetic:chat:bogus=1", {}, "unknown knob 'bogus'; known: sessions, turns, system_tokens"),
    ("synthetic:chat:sessions", {}, "expected key=value"),
    ("synthetic:chat:sessions=2,,turns=2", {}, "expected key=value"),
    ("synthetic:chat:sessions=2.5", {}, "sessions must be an integer"),
    ("synthetic:chat:rate=fast", {}, "rate must be a finite number"),
    ("synthetic:chat:rate=inf", {}, "rate must be a finite number"),
    ("synthetic:chat:turns=2,turns=3", {}, "knob 'turns' given twice"),
    ("synthetic:chat:turns=0", {}, r"synthetic:chat: turns=0 must be >= 1"),
    ("synthetic:docqa:question_min_tokens=50,question_max_tokens=40", {}, "question_max_tokens=40 must be"),
    ("synthetic:docqa:doc_jitter=1", {}, "doc_jitter=1.0 must be in"),
    ("synthetic:docqa:doc_tokens=100000000000", {}, "longest prompt=.* must be <="),
    ("synthetic:docqa:doc_tokens=1000000000,doc_jitter=0", {"hash_block_tokens": 1}, "hash ids=.* must be"),
    ("synthetic:chat:sessions=100000,turns=1000", {}, "sessions\\*turns=100000000 must be <="),
    (123, {}, "a workload spec is a string"),
    ("synthetic:chat", {"seed": -1}, "seed must be a non-negative integer"),
    ("synthetic:chat", {"max_requests": 0}, "max_requests must be a positive integer"),
    ("synthetic:chat", {"max_requests": True}, "max_requests must be a positive integer"),
    ("synthetic:chat", {"window_ms": (5, 5)}, r"window_ms must be \(start, end\) with a finite start < end"),
    ("synthetic:chat", {"window_ms": (-math.inf, 5)}, "window_ms must be"),
    ("synthetic:chat", {"window_ms": (0, math.nan)}, "window_ms must be"),
    ("synthetic:chat", {"window_ms": (0, 1, 2)}, "window_ms must be"),
    ("synthetic:chat", {"hash_block_tokens": 0}, "hash_block_tokens must be a positive integer"),
])
def test_bad_specs_and_options_raise_config_error(spec, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        load_workload(spec, **kwargs)


def test_registry_refuses_duplicates_and_accepts_new_generators(monkeypatch):
    monkeypatch.setattr(workloads, "SYNTHETIC_WORKLOADS", dict(SYNTHETIC_WORKLOADS))
    with pytest.raises(ValueError, match="'chat' is already registered"):
        register_synthetic("chat")(lambda rng, block: None)

    @register_synthetic("single")
    def single(rng, hash_block_tokens, *, tokens: int = 5):
        return workloads.RequestColumns(np.zeros(1), np.array([tokens]), np.array([1]),
                                        np.array([0, -(-tokens // hash_block_tokens)]),
                                        np.arange(-(-tokens // hash_block_tokens)))

    w = load_workload("synthetic:single:tokens=600")
    assert w.kind == "synthetic:single" and w.input_tokens.tolist() == [600]
    assert w.params["knobs"] == {"tokens": 600} and w.hash_offsets.tolist() == [0, 3]
    with pytest.raises(TypeError, match="need int or float defaults"):
        register_synthetic("bad")(lambda rng, block, *, name="x": None)


# ---------------------------------------------------------------------------------------------
# Synthetic


@pytest.mark.parametrize("name", ["chat", "docqa"])
def test_synthetic_defaults(name):
    w = load_workload(f"synthetic:{name}")
    assert_valid(w)
    assert w.kind == f"synthetic:{name}" and w.hash_block_tokens == 256
    assert w.n_requests == 96  # 16 sessions x 6 turns, 8 documents x 12 questions
    assert np.array_equal(np.diff(w.hash_offsets), -(-w.input_tokens // 256))
    assert chain_violations(w) == 0
    assert w.params["seed"] == 0
    expected = {"chat": {"sessions": 16, "turns": 6, "rate": 1.0},
                "docqa": {"documents": 8, "questions": 12, "rate": 2.0}}[name]
    assert expected.items() <= w.params["knobs"].items()
    assert 0.0 < prefix_hit_ratio(w) < 1.0


@pytest.mark.parametrize("name", ["chat", "docqa"])
def test_synthetic_is_deterministic(name):
    a, b = load_workload(f"synthetic:{name}", seed=3), load_workload(f"synthetic:{name}", seed=3)
    assert a.checksum == b.checksum
    for field in ("arrival_ms", "input_tokens", "output_tokens", "hash_offsets", "hash_ids"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert load_workload(f"synthetic:{name}", seed=4).checksum != a.checksum
    assert load_workload(f"synthetic:{name}", seed=3, hash_block_tokens=128).checksum != a.checksum
    # Selection does not change the checksum, which names the generated (source) arrays.
    assert load_workload(f"synthetic:{name}", seed=3, max_requests=5).checksum == a.checksum


def test_synthetic_block_size_override():
    w = load_workload("synthetic:docqa", hash_block_tokens=np.int64(1000), max_requests=np.int64(50))
    json.dumps(w.params, allow_nan=False)
    assert w.hash_block_tokens == 1000 and w.params["hash_block_tokens"] == 1000
    assert np.array_equal(np.diff(w.hash_offsets), -(-w.input_tokens // 1000))


def test_chat_turns_extend_the_previous_turn():
    w = load_workload("synthetic:chat:sessions=1,turns=8", seed=1)
    block = w.hash_block_tokens
    for k in range(w.n_requests - 1):
        full = w.input_tokens[k] // block
        assert w.input_tokens[k + 1] > w.input_tokens[k]
        assert np.array_equal(w.hashes(k + 1)[:full], w.hashes(k)[:full])
        if w.input_tokens[k] % block:
            # The trailing partial block changes once the next reply extends it: a fresh id.
            assert w.hashes(k)[-1] not in w.hashes(k + 1)


def test_chat_sessions_share_only_the_system_prompt():
    # Fixed lengths (sigma=0) make the first user message fill block 4, which names the session.
    spec = "synthetic:chat:sessions=5,turns=4,system_tokens=1024,user_tokens=400,sigma=0"
    w = load_workload(spec, seed=2)
    system = np.array([w.hashes(i)[:4] for i in range(w.n_requests)])
    assert (system == system[0]).all()
    session_of = np.array([w.hashes(i)[4] for i in range(w.n_requests)])
    sessions, sizes = np.unique(session_of, return_counts=True)
    assert len(sessions) == 5 and (sizes == 4).all()
    # Ids after the system prompt are never shared between sessions.
    owners = {}
    for i in range(w.n_requests):
        for h in w.hashes(i)[4:]:
            assert owners.setdefault(int(h), session_of[i]) == session_of[i]
    assert chain_violations(w) == 0


def test_docqa_questions_share_their_document():
    spec = "synthetic:docqa:documents=4,questions=6,doc_tokens=1000,doc_jitter=0"
    w = load_workload(spec, hash_block_tokens=256)
    doc_blocks = np.array([w.hashes(i)[:3] for i in range(w.n_requests)])  # 1000 // 256 = 3 full blocks
    docs, doc_of, sizes = np.unique(doc_blocks[:, 0], return_inverse=True, return_counts=True)
    assert len(docs) == 4 and (sizes == 6).all()
    for d in range(4):
        assert (doc_blocks[doc_of == d] == doc_blocks[doc_of == d][0]).all()
    # Block 3 mixes the document's tail with the question: every later id is the request's own.
    own = np.concatenate([w.hashes(i)[3:] for i in range(w.n_requests)])
    assert len(np.unique(own)) == len(own) and not np.isin(own, doc_blocks).any()
    # Questions of different documents interleave in arrival order.
    assert np.count_nonzero(np.diff(doc_of)) > 4


@settings(max_examples=40, deadline=None, database=None)
@given(name=st.sampled_from(["chat", "docqa"]), seed=st.integers(0, 2**32),
       block=st.sampled_from([None, 16, 100, 256, 4096]),
       size=st.integers(1, 5), other=st.integers(1, 5))
def test_synthetic_invariants_for_many_recipes(name, seed, block, size, other):
    knobs = f"sessions={size},turns={other}" if name == "chat" else f"documents={size},questions={other}"
    w = load_workload(f"synthetic:{name}:{knobs}", seed=seed, hash_block_tokens=block)
    assert_valid(w)
    assert w.n_requests == size * other
    assert chain_violations(w) == 0


# ---------------------------------------------------------------------------------------------
# The published traces


@pytest.fixture(scope="module")
def mooncake_trace():
    if not MOONCAKE_TRACE.exists():
        pytest.skip(f"public trace not present: {MOONCAKE_TRACE}")
    start = time.perf_counter()
    w = load_workload(f"mooncake:{MOONCAKE_TRACE}")
    return w, time.perf_counter() - start


def test_mooncake_published_trace(mooncake_trace):
    w, seconds = mooncake_trace
    assert seconds < 2.0
    assert_valid(w)
    assert w.n_requests == 12_031
    assert len(w.hash_ids) == 288_500
    assert len(np.unique(w.hash_ids)) == 182_790
    assert w.input_tokens.mean() == pytest.approx(12_035, abs=1)
    assert w.output_tokens.mean() == pytest.approx(343, abs=1)
    assert w.params["sorted"] is False and w.params["output_zero_clamped"] == 0
    assert chain_violations(w) == 0
    assert prefix_hit_ratio(w) == pytest.approx(0.374, abs=0.001)  # docs/analysis.md's figure


def test_mooncake_published_trace_window(mooncake_trace):
    full, _ = mooncake_trace
    w = load_workload(f"mooncake:{MOONCAKE_TRACE}", window_ms=(60_000, 120_000), max_requests=50)
    keep = np.flatnonzero(full.arrival_ms >= 60_000)[:50]
    assert w.n_requests == 50 and np.array_equal(w.input_tokens, full.input_tokens[keep])
    assert np.array_equal(w.arrival_ms, full.arrival_ms[keep] - full.arrival_ms[keep[0]])
    assert np.array_equal(w.hashes(7), full.hashes(int(keep[7])))


def test_azure_published_trace():
    if not AZURE_TRACE.exists():
        pytest.skip(f"public trace not present: {AZURE_TRACE}")
    w = load_workload(f"azure:{AZURE_TRACE}")
    assert_valid(w)
    assert w.n_requests == 8_819
    assert w.input_tokens.mean() == pytest.approx(2_048, abs=1)
    assert np.median(w.input_tokens) == 1_469
    assert w.output_tokens.mean() == pytest.approx(28, abs=0.5)
    assert w.params["time_origin"] == "2023-11-16 18:17:03.9799600"
    assert w.arrival_ms[1] == pytest.approx(52.0)
    assert w.arrival_ms[-1] == pytest.approx(3_435_948.056)  # 18:17:03.97996 to 19:14:19.928016


# ---------------------------------------------------------------------------------------------
# Whatever is in the file, the readers answer with a Workload or a WorkloadError


def load_or_refuse(path: Path, kind: str) -> None:
    try:
        w = load_workload(f"{kind}:{path}")
    except WorkloadError as e:
        assert "\n" not in str(e)
    else:
        assert_valid(w)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4), max_leaves=8)
mooncake_records = st.fixed_dictionaries(
    {},
    optional={
        "timestamp": st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=True), json_values),
        "input_length": st.one_of(st.integers(-3, 3000), json_values),
        "output_length": st.one_of(st.integers(-3, 500), json_values),
        "hash_ids": st.one_of(st.lists(st.integers(-2**64, 2**64), max_size=7), json_values),
    })
# Well-formed records as well, so that files that do load are part of the search.
consistent_records = st.integers(1, 3000).flatmap(lambda n: st.fixed_dictionaries({
    "timestamp": st.integers(0, 10**6) | st.floats(0, 1e6),
    "input_length": st.just(n),
    "output_length": st.integers(0, 500),
    "hash_ids": st.lists(st.integers(0, 20), min_size=-(-n // 512), max_size=-(-n // 512)),
}))
mooncake_files = st.one_of(
    st.binary(max_size=300),
    st.lists(mooncake_records | consistent_records, max_size=6).map(
        lambda rs: "\n".join(json.dumps(r) for r in rs).encode()),
)

azure_stamps = st.datetimes().map(lambda t: t.strftime("%Y-%m-%d %H:%M:%S.%f") + "0")
azure_fields = st.one_of(
    st.integers(-5, 10**20).map(str),
    azure_stamps,
    st.text(alphabet="0123456789-: .T,\"\r\nx\0", max_size=30),
)
consistent_rows = st.tuples(azure_stamps, st.integers(1, 10**6), st.integers(0, 1000)).map(
    lambda row: ",".join(map(str, row)))
azure_files = st.one_of(
    st.binary(max_size=300),
    st.lists(st.lists(azure_fields, min_size=2, max_size=4).map(",".join) | consistent_rows, max_size=6).map(
        lambda rows: azure_text(*rows).encode()),
)


# tools/fuzz_campaign.py raises this for the long campaign
FUZZ_EXAMPLES = int(os.environ.get("KVEMU_FUZZ_EXAMPLES", "250"))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=mooncake_files)
def test_any_mooncake_bytes_load_or_raise_workload_error(fuzz_dir, content):
    load_or_refuse(write(fuzz_dir, "f.jsonl", content), "mooncake")


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=azure_files)
def test_any_azure_bytes_load_or_raise_workload_error(fuzz_dir, content):
    load_or_refuse(write(fuzz_dir, "f.csv", content), "azure")
