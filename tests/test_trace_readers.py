"""The trace readers and the block rule (docs/workloads.md).

Each format gets a small hand-written trace whose theoretical hit ratio is counted by hand, in the
test, under each rule; the samples in traces/formats/ are read and recorded; `trace info` states the
rule and the ratio.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvemu.blockrule import prefix_hit_ratio
from kvemu.cli import cli
from kvemu.errors import ConfigError, TraceError, WorkloadError
from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.schema import read_trace
from kvemu.validation import check_trace_meta
from kvemu.workloads import FILE_READERS, load_workload

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ROOT / "traces" / "formats"
SHARED = ROOT.parent / "shared" / "traces"


def jsonl(tmp_path: Path, name: str, rows: list) -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ratio(spec: str) -> float:
    w = load_workload(spec)
    return prefix_hit_ratio(w.input_tokens, w.hash_offsets, w.hash_ids, w.hash_block_tokens)


def brute_force_ratio(w) -> float:
    """The rule's definition, one request at a time: its longest run of leading hashes all seen in
    earlier requests, in tokens up to its input."""
    seen: set[int] = set()
    hit = 0
    for i in range(w.n_requests):
        ids = [int(h) for h in w.hashes(i)]
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        hit += min(run * w.hash_block_tokens, int(w.input_tokens[i]))
        seen.update(ids)
    return hit / int(w.input_tokens.sum())


# ------------------------------------------------------------------------------ hand-counted ratios
def test_mooncake_partial_block_and_context_cap(tmp_path):
    # 4-token blocks. r0 10 tokens [1,2,3] (3 is a 2-token partial block); r1 the same prompt;
    # r2 12 tokens [1,2,4]. Inputs 32.
    p = jsonl(tmp_path, "m.jsonl", [
        {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 2, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 4]}])
    # partial counted: r1 hits all 10 tokens, r2 its first two blocks (8)
    assert ratio(f"mooncake:{p}:block_tokens=4") == pytest.approx((0 + 10 + 8) / 32)
    # partial not counted: r1's partial block 3 is its own, so r1 hits 8
    assert ratio(f"mooncake:{p}:block_tokens=4,partial=0") == pytest.approx((0 + 8 + 8) / 32)
    # cap 10, drop: r2 (12 tokens) goes, r1 hits its 10 of 20
    w = load_workload(f"mooncake:{p}:block_tokens=4,context_cap=10")
    assert w.n_requests == 2 and w.params["dropped_over_cap"] == 1
    assert ratio(f"mooncake:{p}:block_tokens=4,context_cap=10") == pytest.approx(10 / 20)
    # cap 8, head: every prompt is its first two blocks [1,2]: r1 and r2 hit 8 each of 24
    assert ratio(f"mooncake:{p}:block_tokens=4,context_cap=8,truncate=head") == pytest.approx(16 / 24)
    # cap 6, head: the cut block is each request's own, only block 1 (4 tokens) is shared
    assert ratio(f"mooncake:{p}:block_tokens=4,context_cap=6,truncate=head") == pytest.approx(8 / 18)
    # the same file through --hash-block-tokens
    assert load_workload(str(f"mooncake:{p}"), hash_block_tokens=4).block_rule["block_tokens"] == 4


def semianalysis_file(tmp_path: Path) -> Path:
    # trace A: t=0 8 tokens [1,2]; t=1 12 tokens [1,2,3]; a sub-agent spawned at t=2 whose request
    # says t=0.5 (before the spawn: relative, so at 2.5) with 8 tokens [1,5]. Trace B at t=0.5:
    # 8 tokens [1,2]. Arrival order A0, B0, A1, Asub; inputs 36.
    return jsonl(tmp_path, "sa.jsonl", [
        {"id": "A", "block_size": 4, "hash_id_scope": "local", "requests": [
            {"t": 0.0, "type": "n", "model": "m", "in": 8, "out": 3, "hash_ids": [1, 2]},
            {"t": 1.0, "type": "s", "model": "m", "in": 12, "out": 3, "hash_ids": [1, 2, 3], "api_time": 0.4},
            {"t": 2.0, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
             "status": "completed", "models": ["m"],
             "requests": [{"t": 0.5, "type": "n", "model": "m", "in": 8, "out": 2, "hash_ids": [1, 5]}]}]},
        {"id": "B", "block_size": 4, "hash_id_scope": "local", "requests": [
            {"t": 0.5, "type": "n", "model": "m", "in": 8, "out": 3, "hash_ids": [1, 2]}]}])


def test_semianalysis_local_and_global_scope(tmp_path):
    p = semianalysis_file(tmp_path)
    w = load_workload(f"semianalysis:{p}:block_tokens=4")
    assert w.arrival_ms.tolist() == [0.0, 500.0, 1000.0, 2500.0]
    assert w.params["traces"] == 2 and w.params["subagents"] == 1
    # local (the format's): B's [1,2] are not A's; A1 hits 8, the sub-agent A's block 1 (4)
    assert ratio(f"semianalysis:{p}:block_tokens=4") == pytest.approx((0 + 0 + 8 + 4) / 36)
    # global: B0 hits A0's two blocks too
    assert ratio(f"semianalysis:{p}:block_tokens=4,scope=global") == pytest.approx((0 + 8 + 8 + 4) / 36)


def test_semianalysis_refuses_a_block_size_it_was_not_told(tmp_path):
    p = semianalysis_file(tmp_path)
    with pytest.raises(WorkloadError, match=r"sa.jsonl:1: the file declares block_tokens=4 .* give block_tokens=4"):
        load_workload(f"semianalysis:{p}")


def bailian_file(tmp_path: Path) -> Path:
    # 16-token blocks. c1 (root, 10.0 s) 40 tokens [7,8,9] (9 partial, 8 tokens); c3 (root, 11.0 s)
    # 32 tokens [7,8]; c2 (follows c1, 12.5 s) 60 tokens [7,8,10,11]; c4 (follows c2, 13.0 s)
    # 40 tokens [7,8,9]. Inputs 172; sessions {c1,c2,c4} and {c3}.
    return jsonl(tmp_path, "b.jsonl", [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 10.0, "input_length": 40, "output_length": 5,
         "type": "text", "turn": 1, "hash_ids": [7, 8, 9]},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 12.5, "input_length": 60, "output_length": 5,
         "type": "text", "turn": 2, "hash_ids": [7, 8, 10, 11]},
        {"chat_id": 3, "parent_chat_id": -1, "timestamp": 11.0, "input_length": 32, "output_length": 0,
         "type": "text", "turn": 1, "hash_ids": [7, 8]},
        {"chat_id": 4, "parent_chat_id": 2, "timestamp": 13.0, "input_length": 40, "output_length": 5,
         "type": "text", "turn": 3, "hash_ids": [7, 8, 9]}])


def test_bailian_sessions_scope_and_partial(tmp_path):
    p = bailian_file(tmp_path)
    w = load_workload(f"bailian:{p}")
    assert w.arrival_ms.tolist() == [0.0, 1000.0, 2500.0, 3000.0]
    assert w.params["sessions"] == 2 and w.params["output_zero_clamped"] == 1
    # global, partial counted: c3 32, c2 32, c4 all 40 (its partial block 9 was c1's)
    assert ratio(f"bailian:{p}") == pytest.approx((0 + 32 + 32 + 40) / 172)
    # partial not counted: c4 hits its two full blocks only
    assert ratio(f"bailian:{p}:partial=0") == pytest.approx((0 + 32 + 32 + 32) / 172)
    # local: c3 is a session of its own and hits nothing
    assert ratio(f"bailian:{p}:scope=local") == pytest.approx((0 + 0 + 32 + 40) / 172)


def test_dynamo_agentic_rows(tmp_path):
    # 4-token blocks. r0 (A, 0 ms) 8 [1,2]; r2 (B, 50 ms) 8 [1,9]; r1 (A, 100 ms, after r0 and a
    # tool) 12 [1,2,3]. Inputs 28.
    p = jsonl(tmp_path, "ag.jsonl", [
        {"request_id": "r0", "session_id": "A", "input_length": 8, "output_length": 2, "hash_ids": [1, 2],
         "timestamp": 0, "prefix_reset": True},
        {"request_id": "r1", "session_id": "A", "input_length": 12, "output_length": 2, "hash_ids": [1, 2, 3],
         "timestamp": 100, "wait_for": ["r0"], "delay": 10, "tool_wait_ms": 40},
        {"request_id": "r2", "session_id": "B", "input_length": 8, "output_length": 2, "hash_ids": [1, 9],
         "timestamp": 50, "prefix_reset": True}])
    w = load_workload(f"dynamo:{p}:block_tokens=4")
    assert w.params["dynamo_format"] == "agentic_mooncake"
    assert w.params["requests_with_dependencies"] == 1 and w.params["tool_wait_ms"] == 40
    assert w.arrival_ms.tolist() == [0.0, 50.0, 100.0]
    assert ratio(f"dynamo:{p}:block_tokens=4") == pytest.approx((0 + 4 + 8) / 28)
    assert ratio(f"dynamo:{p}:block_tokens=4,scope=local") == pytest.approx((0 + 0 + 8) / 28)


def test_dynamo_delta_rows_accumulate(tmp_path):
    # 4-token blocks. Session A: turn 0 at 0 ms adds 6 tokens [1,2] (2 is a 2-token partial block),
    # generates 2; turn 1 (10 ms after) adds 4; turn 2 (0 ms after) adds 4. Session B at 5 ms: 6
    # tokens [1,3]. Prompts: A0 6, B0 6, A1 6+2+4 = 12, A2 12+1+4 = 17; inputs 41.
    p = jsonl(tmp_path, "d.jsonl", [
        {"session_id": "A", "input_length": 6, "output_length": 2, "hash_ids": [1, 2], "timestamp": 0},
        {"session_id": "A", "input_length": 4, "output_length": 1, "hash_ids": [5], "delay": 10},
        {"session_id": "A", "input_length": 4, "output_length": 1, "hash_ids": [6], "delay": 0},
        {"session_id": "B", "input_length": 6, "output_length": 3, "hash_ids": [1, 3], "timestamp": 5}])
    w = load_workload(f"dynamo:{p}:block_tokens=4")
    assert w.params["dynamo_format"] == "mooncake-delta"
    assert w.input_tokens.tolist() == [6, 6, 12, 17]
    assert w.arrival_ms.tolist() == [0.0, 5.0, 10.0, 10.0]
    # B0 shares A0's first block (4 tokens); A1's second block holds A0's partial tail and output:
    # new, so A1 hits 4; A2 repeats A1's three full blocks (12)
    assert ratio(f"dynamo:{p}:block_tokens=4") == pytest.approx((0 + 4 + 4 + 12) / 41)
    assert ratio(f"dynamo:{p}:block_tokens=4,scope=local") == pytest.approx((0 + 0 + 4 + 12) / 41)


def test_tair_full_blocks_instances_and_units(tmp_path):
    # 16-token blocks, keys of full blocks only. e1 (X) 40 tokens [1,2]; e2 (Y, +2 ms) 40 [1,2];
    # e3 (X, +3 ms) 20 [1]. Inputs 100.
    base = 1_700_000_000_000_000_123  # ns since the epoch: beyond a float's exact integers
    p = jsonl(tmp_path, "t.jsonl", [
        {"instance_id": "X", "timestamp_ns": base, "keys": [1, 2], "input_len": 40, "output_len": 0},
        {"instance_id": "Y", "timestamp_ns": base + 2_000_000, "keys": [1, 2], "input_len": 40, "output_len": 0},
        {"instance_id": "X", "timestamp_ns": base + 3_000_000, "keys": [1], "input_len": 20, "output_len": 4}])
    w = load_workload(f"tair:{p}")
    assert w.arrival_ms.tolist() == [0.0, 2.0, 3.0]
    assert w.params["unhashed_blocks"] == 3  # the partial tails: 8, 8 and 4 tokens
    assert ratio(f"tair:{p}") == pytest.approx((0 + 32 + 16) / 100)
    assert ratio(f"tair:{p}:partial=1") == pytest.approx((0 + 32 + 16) / 100)  # a tail has no hash
    assert ratio(f"tair:{p}:scope=local") == pytest.approx((0 + 0 + 16) / 100)
    us = jsonl(tmp_path, "us.jsonl", [
        {"instance_id": "X", "timestamp_us": 10, "keys": [1], "input_len": 16, "output_len": 1},
        {"instance_id": "X", "timestamp_us": 2010, "keys": [1], "input_len": 16, "output_len": 1}])
    w = load_workload(f"tair:{us}")
    assert w.arrival_ms.tolist() == [0.0, 2.0] and w.block_rule["time_unit"] == "us"


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("suffix, error, message", [
    (":blocks=4", ConfigError, "unknown block-rule option 'blocks'"),
    (":scope=nearby", ConfigError, "scope must be one of global, local"),
    (":partial=maybe", ConfigError, "partial must be 0 or 1"),
    (":block_tokens=4,block_tokens=8", ConfigError, "given twice"),
    (":scope=local", ConfigError, "scope=local needs sessions"),
    (":block_tokens=2", WorkloadError, r"m.jsonl:1: 'hash_ids' has 2 entries"),
])
def test_bad_rules_are_one_line_errors(tmp_path, suffix, error, message):
    p = jsonl(tmp_path, "m.jsonl", [{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}])
    with pytest.raises(error, match=message):
        load_workload(f"mooncake:{p}{suffix}")


def test_more_hashes_than_blocks_names_the_line(tmp_path):
    p = jsonl(tmp_path, "b.jsonl", [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, "output_length": 1,
         "hash_ids": [1]},
        {"chat_id": 2, "parent_chat_id": 1, "timestamp": 1, "input_length": 16, "output_length": 1,
         "hash_ids": [1, 2]}])
    with pytest.raises(WorkloadError, match=r"b.jsonl:2: 2 block hashes for 16 input tokens"):
        load_workload(f"bailian:{p}")
    with pytest.raises(ConfigError, match="azure: block-rule option scope does not apply"):
        load_workload(f"azure:{p}:scope=global")


# ------------------------------------------------------------------------------ samples, records, info
SAMPLES = {"semianalysis.jsonl": "semianalysis", "bailian.jsonl": "bailian", "dynamo-agentic.jsonl": "dynamo",
           "dynamo-delta.jsonl": "dynamo", "tair.jsonl": "tair", "mooncake.jsonl": "mooncake"}


def test_every_format_has_a_sample():
    assert set(SAMPLES.values()) == set(FILE_READERS) - {"azure"}
    assert sorted(p.name for p in FORMATS.glob("*.jsonl")) == sorted(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_sample_reads_and_records_its_rule(tmp_path, name):
    kind = SAMPLES[name]
    spec = f"{kind}:{FORMATS / name}"
    w = load_workload(spec)
    expected = brute_force_ratio(w)
    assert 0.3 < expected < 1.0  # the samples are agent sessions: most of a prompt was seen
    meta = record(spec, "llama3-8b", tmp_path / "t.parquet", RecordOptions.from_flat(show_progress=False))
    rule = FILE_READERS[kind].rule
    assert meta["workload"]["block_rule"] == {"version": 1, **{k: getattr(rule, k) for k in (
        "block_tokens", "scope", "partial", "time_unit", "context_cap", "truncate")}}
    assert meta["workload"]["prefix_hit_ratio_unbounded"] == pytest.approx(expected)
    tr = read_trace(tmp_path / "t.parquet")  # validated on read
    assert tr.n_requests == w.n_requests


def test_synthetic_agent_shares_its_context_and_branches():
    w = load_workload("synthetic:agent")
    assert w.block_rule["block_tokens"] == 256 and w.block_rule["partial"] is False
    assert prefix_hit_ratio(w.input_tokens, w.hash_offsets, w.hash_ids, 256) == pytest.approx(brute_force_ratio(w))
    # without sub-agents there are sessions*turns requests; with them more, each sharing a prefix
    plain = load_workload("synthetic:agent:subagent_prob=0")
    assert plain.n_requests == 8 * 10 and w.n_requests > plain.n_requests
    assert brute_force_ratio(w) > 0.8  # a growing shared context: most of each prompt was seen
    # every sub-agent prompt's first hash block is the shared system prompt's
    first = {int(w.hashes(i)[0]) for i in range(w.n_requests)}
    assert len(first) == 1


def test_engine_blocks_recut_hash_blocks(tmp_path):
    # two 64-token-block requests sharing their first hash block: with 16-token engine blocks, the
    # first four engine blocks of each table are the same four ids
    p = jsonl(tmp_path, "sa.jsonl", [{"id": "A", "block_size": 64, "hash_id_scope": "local", "requests": [
        {"t": 0.0, "type": "n", "model": "m", "in": 128, "out": 2, "hash_ids": [1, 2]},
        {"t": 0.1, "type": "n", "model": "m", "in": 128, "out": 2, "hash_ids": [1, 3]}]}])
    record(f"semianalysis:{p}", "llama3-8b", tmp_path / "t.parquet", RecordOptions.from_flat(show_progress=False))
    tr = read_trace(tmp_path / "t.parquet")
    t0 = tr.table_ids[tr.table_offsets[0]:tr.table_offsets[1]]
    t1 = tr.table_ids[tr.table_offsets[1]:tr.table_offsets[2]]
    assert t0[:4].tolist() == t1[:4].tolist() and len(set(t0[:4].tolist())) == 4
    assert set(t0[4:8].tolist()).isdisjoint(t1[4:8].tolist())


def test_trace_info_states_the_rule_and_ratio(tmp_path):
    p = semianalysis_file(tmp_path)
    out = tmp_path / "t.parquet"
    record(f"semianalysis:{p}:block_tokens=4", "llama3-8b", out, RecordOptions.from_flat(show_progress=False,
                                                                                         block_tokens=4))
    res = CliRunner().invoke(cli, ["trace", "info", str(out)])
    assert res.exit_code == 0, res.output
    assert re.search(r"block rule\s+4-token blocks, local hash scope, partial last block counted, "
                     r"timestamps in s, no context cap", res.output)
    assert re.search(r"prefix_hit_ratio_unbounded\s+0\.3333 \(under the block rule", res.output)
    res = CliRunner().invoke(cli, ["trace", "info", str(out), "--json"])
    summary = json.loads(res.output)["summary"]
    assert summary["prefix_hit_ratio_unbounded"] == pytest.approx(12 / 36)
    assert summary["block_rule"]["scope"] == "local"


def test_a_bad_recorded_rule_is_refused(tmp_path):
    meta = record(f"tair:{FORMATS / 'tair.jsonl'}", "llama3-8b", tmp_path / "t.parquet",
                  RecordOptions.from_flat(show_progress=False))
    check_trace_meta("t", meta)
    for key, value, message in [("scope", "nearby", "scope must be one of"), ("version", 9, "version must be 1"),
                                ("partial", 1, "partial must be true or false"),
                                ("block_tokens", 64, "must equal workload.hash_block_tokens")]:
        bad = copy.deepcopy(meta)
        bad["workload"]["block_rule"][key] = value
        with pytest.raises(TraceError, match=message):
            check_trace_meta("t", bad)


def test_docs_table_states_each_readers_defaults():
    text = (ROOT / "docs" / "workloads.md").read_text()
    for kind, reader in FILE_READERS.items():
        m = re.search(rf"^\| `{kind}` \| (\S+) \| (\w+) \| (\d) \| (\w+) \|", text, re.M)
        assert m, kind
        block, scope, partial, unit = m.groups()
        r = reader.rule
        assert (block, scope, partial, unit) == (
            "(none)" if r.block_tokens is None else str(r.block_tokens), r.scope, str(int(r.partial)), r.time_unit)


@pytest.mark.skipif(not (SHARED / "mooncake_conversation_trace.jsonl").exists(), reason="no shared traces")
def test_real_mooncake_ratio_under_its_rule():
    w = load_workload(f"mooncake:{SHARED / 'mooncake_conversation_trace.jsonl'}")
    got = prefix_hit_ratio(w.input_tokens, w.hash_offsets, w.hash_ids, w.hash_block_tokens)
    assert got == pytest.approx(0.374, abs=0.001)  # ../shared/traces/README.md: 37.4 %
    assert got == pytest.approx(brute_force_ratio(w))


def test_engine_blocks_longer_than_hash_blocks(tmp_path):
    # 16-token hashes, 32-token engine blocks: an engine block is named by its second hash block.
    # e1 and e2 share keys [1,2] (one full engine block); e3 differs in its second key [1,3].
    p = jsonl(tmp_path, "t.jsonl", [
        {"instance_id": "X", "timestamp_ns": 0, "keys": [1, 2], "input_len": 40, "output_len": 2},
        {"instance_id": "X", "timestamp_ns": 1000, "keys": [1, 2], "input_len": 40, "output_len": 2},
        {"instance_id": "X", "timestamp_ns": 2000, "keys": [1, 3], "input_len": 40, "output_len": 2}])
    record(f"tair:{p}", "llama3-8b", tmp_path / "t.parquet", RecordOptions.from_flat(show_progress=False,
                                                                                    block_tokens=32))
    tr = read_trace(tmp_path / "t.parquet")
    first = [int(tr.table_ids[tr.table_offsets[i]]) for i in range(3)]
    assert first[0] == first[1] and first[2] != first[0]


def test_record_help_names_every_reader_and_generator():
    from kvemu.workloads import SYNTHETIC_WORKLOADS

    res = CliRunner().invoke(cli, ["record", "--help"], terminal_width=2000)
    text = " ".join(res.output.split())
    for kind in FILE_READERS:
        assert f"{kind}:PATH" in text, kind
    listed = re.search(r"synthetic:NAME\[:key=val,\.\.\.\] \(([\w, ]+)\)", text)
    assert listed and set(listed.group(1).split(", ")) == set(SYNTHETIC_WORKLOADS)


def test_the_file_a_spec_reads_is_never_overwritten(tmp_path):
    from kvemu.workloads import source_file

    assert source_file("tair:/x/y.jsonl:scope=local,partial=1") == "/x/y.jsonl"
    assert source_file("tair:/x/odd:name=1:") == "/x/odd:name=1"
    assert source_file("synthetic:agent:turns=3") is None
    p = bailian_file(tmp_path)
    before = p.read_bytes()
    res = CliRunner().invoke(cli, ["record", "--workload", f"bailian:{p}:scope=local", "--model", "llama3-8b",
                                   "--out", str(p), "--force"])
    assert res.exit_code == 2 and p.read_bytes() == before
