"""Replay moves each KV group's own bytes (issue 25 item 3): a sliding-window and a linear-attention
model's traces through ``replay --backend dram`` move, per request and op, the bytes written out
below by hand from the engine's traffic rule (docs/engine.md "Tier traffic"), both in the results'
kv_bytes_* and in what the C core measured (results ``ops``); layer sampling keeps every group; and
a full-attention trace replays to the byte and the nanosecond as it did before KV groups reached
the replay.

The two small models (config.json, written here): 4 layers, one KV head of 64 dims in bf16, so a
token costs 2 x 64 x 2 = 256 bytes in an attention layer and a block of 16 tokens 4,096.
- sliding: layers alternate sliding (window 64 tokens: 4 blocks) and full, 2 of each.
- linear: Qwen3-Next's layout with full_attention_interval 2: 2 Gated DeltaNet layers, 2 full; a
  DeltaNet layer's state is 2 value heads x 32 x 32 recurrent values plus 3 conv inputs of
  2 x 2 x 32 + 2 x 32 channels, bf16: (2048 + 576) x 2 = 5,248 bytes.
"""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

import kvemu
from kvemu.replay.options import ReplayOptions, ScheduleOptions, WindowOptions

BLOCK = 16 * 256          # bytes of one block in one attention layer
WINDOW_BLOCKS = 64 // 16  # a sliding layer goes back ceil(64 / 16) blocks from where it goes on
STATE = (2 * 32 * 32 + 3 * (2 * 2 * 32 + 2 * 32)) * 2
CHECKPOINT = 256 // 16    # linear states are checkpointed every --chunk-tokens (256) tokens

BASE = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 64, "vocab_size": 1000, "intermediate_size": 512}
SLIDING = {**BASE, "model_type": "mistral", "sliding_window": 64,
           "layer_types": ["sliding_attention", "full_attention"] * 2}
LINEAR = {**BASE, "model_type": "qwen3_next", "full_attention_interval": 2, "linear_num_key_heads": 2,
          "linear_num_value_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
          "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 128}


def _record(tmp_path, cfg, policy, doc_tokens):
    from kvemu import RecordOptions, record
    from kvemu.record_options import EngineOptions, WorkloadOptions

    model = tmp_path / "config.json"
    model.write_text(json.dumps(cfg))
    out = tmp_path / f"{policy}.parquet"
    # HBM for about two documents' KV: later questions find their document in the tier
    record(f"synthetic:docqa:documents=4,questions=3,doc_tokens={doc_tokens},rate=0.5", str(model), out,
           RecordOptions(workload=WorkloadOptions(max_requests=12),
                         engine=EngineOptions(tier_policy=policy, hbm_kv_gib=0.0008 * max(1, doc_tokens / 600))))
    return out


def _entries(path):
    from kvemu.schema import iter_entries, read_trace

    tr = read_trace(str(path))
    rows = []
    for e in iter_entries(tr):
        for i in range(len(e["step"])):
            rows.append({k: int(e[k][i]) for k in ("request_id", "load_first", "load_count", "store_first",
                                                    "store_count", "read_first", "read_count")})
    return tr, rows


def _blocks_in(lo, hi, first, count):
    return max(0, min(first + count, hi) - max(first, lo))


def hand_bytes(kind, policy, rows, prompt_blocks):
    """Per request, {op: bytes} over the 4 layers, entry by entry, by the rule in docs/engine.md."""
    out = {}
    for r in rows:
        req, nf = r["request_id"], prompt_blocks[r["request_id"]]
        got = out.setdefault(req, {"load": 0, "store": 0, "read": 0})
        for op in ("load", "store", "read"):
            first, count = r[f"{op}_first"], r[f"{op}_count"]
            end = first + count
            full = 2 * count * BLOCK  # the 2 full layers move every block of the range
            if kind == "sliding":
                if op == "store" and policy == "offload":
                    # what a request resuming at the prompt's end needs: its last 4 full blocks
                    windowed = _blocks_in(nf - WINDOW_BLOCKS, nf, first, count)
                elif op == "store":
                    windowed = count  # resident: every block, in the window when it fills
                else:
                    windowed = _blocks_in(end - WINDOW_BLOCKS, end, first, count)
                got[op] += full + 2 * windowed * BLOCK
            else:
                if op == "store":
                    states = sum(1 for b in range(first + 1, end + 1) if b % CHECKPOINT == 0)
                else:
                    states = 1 if count else 0
                got[op] += full + 2 * states * STATE
    return out


def _replay(tmp_path, trace, name, layers=None, backend="dram"):
    out = tmp_path / f"{name}.parquet"
    opts = ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), window=WindowOptions(layers=layers))
    kvemu.replay(str(trace), backend, opts, out=str(out))
    t = pq.read_table(out)
    meta = json.loads(t.schema.metadata[b"kvemu"])
    return t, meta


COLUMN = {"load": "kv_bytes_loaded", "store": "kv_bytes_stored", "read": "kv_bytes_read"}


@pytest.mark.parametrize("kind, cfg", [("sliding", SLIDING), ("linear", LINEAR)])
@pytest.mark.parametrize("policy", ["offload", "resident"])
@pytest.mark.parametrize("doc_tokens", [40, 600, pytest.param(1500, marks=pytest.mark.slow)])
def test_replay_moves_the_hand_computed_bytes(tmp_path, kind, cfg, policy, doc_tokens):
    trace = _record(tmp_path, cfg, policy, doc_tokens)
    tr, rows = _entries(trace)
    want = hand_bytes(kind, policy, rows, tr.input_tokens.astype(int) // 16)
    t, meta = _replay(tmp_path, trace, "r")
    ids = t["request_id"].to_pylist()
    for op, col in COLUMN.items():
        assert t[col].to_pylist() == [want[i][op] for i in ids], op
        # what the C core moved (all 4 layers replayed): the same bytes
        assert meta["ops"][op]["bytes"] == sum(w[op] for w in want.values()), op
    moved = {op: sum(w[op] for w in want.values()) for op in COLUMN}
    if policy == "offload" and doc_tokens >= 600:
        assert moved["load"] > 0  # the hits are exercised
    if policy == "resident":
        assert moved["read"] > 0
    # and less than full attention in all 4 layers would move where the window or state bites
    blocks = {op: sum(r[f"{op}_count"] for r in rows) for op in COLUMN}
    if doc_tokens >= 600:
        assert moved["read" if policy == "resident" else "store"] < 4 * BLOCK * blocks[
            "read" if policy == "resident" else "store"]
    assert meta["params"]["kv_bytes"] == "kv groups"
    assert not any("upper bound" in w and "KV bytes" in w for w in meta["warnings"])


@pytest.mark.parametrize("cfg", [SLIDING, LINEAR])
def test_sampled_layers_keep_every_group(tmp_path, cfg):
    trace = _record(tmp_path, cfg, "offload", 600)
    all4, m4 = _replay(tmp_path, trace, "all", backend="vemu:cxl-pool")
    two, m2 = _replay(tmp_path, trace, "two", layers=2, backend="vemu:cxl-pool")
    # one replayed layer per group, each standing for its group's 2 layers
    assert m2["params"]["reductions"]["layers"]["span"] == [2, 2]
    for op, col in COLUMN.items():
        assert two[col].to_pylist() == all4[col].to_pylist()
        # the C core moved the two replayed layers' own bytes: half of the four layers'
        assert 2 * m2["ops"][op]["bytes"] == m4["ops"][op]["bytes"]


def test_too_few_layers_for_the_groups_is_refused(tmp_path):
    from kvemu.errors import OptionError

    trace = _record(tmp_path, SLIDING, "offload", 40)
    with pytest.raises(OptionError, match="must be at least 2: the model's layers cache in 2 ways"):
        _replay(tmp_path, trace, "one", layers=1)


# Recorded with kvemu at commit 8d539fb, before the replay followed KV groups: vemu:cxl-pool (virtual
# time, so the figures do not depend on this host), sums over the requests.
BEFORE = {
    ("chat-llama3-8b-offload", "0:96", "recorded", 3): {
        "ttft_ms": 4506.401798, "e2el_ms": 273217.328561, "kv_load_ms": 163.126752, "kv_store_ms": 306.05795200000006,
        "kv_bytes_loaded": 3909091328, "kv_bytes_stored": 7323254784, "kv_bytes_read": 0},
    ("chat-llama3-8b-resident", "0:40", None, None): {
        "ttft_ms": 13268.779926999996, "e2el_ms": 8684577.790795, "kv_store_ms": 167.13168000000002,
        "kv_read_ms": 132542.807904, "kv_bytes_stored": 4102029312, "kv_bytes_read": 3179762679808},
}


@pytest.mark.parametrize("key", [k if k[1] != "0:40" else pytest.param(k, marks=pytest.mark.slow) for k in BEFORE],
                         ids=[k[0] for k in BEFORE])
def test_full_attention_replays_as_before(tmp_path, key):
    name, requests, schedule, layers = key
    lo, hi = map(int, requests.split(":"))
    opts = ReplayOptions(schedule=ScheduleOptions(schedule=schedule),
                         window=WindowOptions(requests=(lo, hi), layers=layers))
    out = tmp_path / "r.parquet"
    kvemu.replay(f"traces/{name}.parquet", "vemu:cxl-pool", opts, out=str(out))
    t = pq.read_table(out)
    for col, value in BEFORE[key].items():
        got = sum(x for x in t[col].to_pylist() if x == x)
        if isinstance(value, int):
            assert got == value, col
        else:
            assert got == pytest.approx(value, rel=1e-12, abs=1e-9), col


# ---------------------------------------------------------------- issue 25 item 4: break-even and capacity
def _lone_prefills(trace):
    """(step, new tokens, cached tokens) of the steps that ran one prefill chunk and nothing else."""
    from kvemu.schema import PHASE_PREFILL, iter_entries

    steps = {}
    for e in iter_entries(trace):
        for s, ph, n, c in zip(e["step"].tolist(), e["phase"].tolist(), e["tokens"].tolist(),
                               e["context_tokens"].tolist()):
            steps.setdefault(s, []).append((ph, n, c))
    return [(s, v[0][1], v[0][2]) for s, v in steps.items() if len(v) == 1 and v[0][0] == PHASE_PREFILL]


def _analysis_matches_record(tmp_path, model, compute="roofline"):
    from kvemu import RecordOptions, record
    from kvemu.analysis import breakeven_timing, compute_from_meta, prefill_ns
    from kvemu.record_options import GpuOptions, WorkloadOptions
    from kvemu.schema import read_trace

    out = tmp_path / f"{model}-{compute}.parquet"
    record("synthetic:docqa:doc_tokens=3000,questions=2", model, out,
           RecordOptions(workload=WorkloadOptions(max_requests=6), gpu=GpuOptions(compute=compute)))
    tr = read_trace(str(out))
    lone = _lone_prefills(tr)
    assert lone
    want = [int(tr.compute_ns[s]) for s, _, _ in lone]
    # a prefill alone in its step is priced by analyze breakeven and analyze capacity exactly as record priced it
    for timing in (compute_from_meta(tr.header.meta), breakeven_timing(tr.header.meta)):
        got = prefill_ns(timing, [n for _, n, _ in lone], [c for _, _, c in lone]).tolist()
        assert got == want


@pytest.mark.parametrize("model", ["llama3-8b", "gemma-3-27b"])
def test_analysis_prices_recomputation_as_record_did(tmp_path, model):
    _analysis_matches_record(tmp_path, model)


@pytest.mark.slow
def test_analysis_follows_an_aiconfigurator_recording(tmp_path):
    pytest.importorskip("aiconfigurator_core")
    _analysis_matches_record(tmp_path, "llama3-8b", "aiconfigurator")


def test_breakeven_of_an_aiconfigurator_trace_needs_the_extra(tmp_path):
    import importlib.util

    from click.testing import CliRunner

    from kvemu.cli import cli
    from kvemu.integrity import METADATA_KEY

    if importlib.util.find_spec("aiconfigurator_core") is not None:
        pytest.skip("aiconfigurator-core is installed: the recording's model runs")
    trace = _record(tmp_path, SLIDING, "offload", 40)
    t = pq.read_table(trace)
    meta = json.loads(t.schema.metadata[METADATA_KEY])
    roofline = meta["compute"]["params"]
    # the compute blob a recording with aiconfigurator writes (engine/compute.py), and the summary of
    # a trace recorded before the blob, the roofline's terms in gpu
    blob = {"model": "aiconfigurator", "version": 1, "backend": "vllm",
            "params": {"backend": "vllm", "database": None, "roofline": roofline}}
    legacy = {**meta, "gpu": {**meta["gpu"], **roofline},
              "compute": {"model": "aiconfigurator", "backend": "vllm", "version": None}}
    for i, m in enumerate(({**meta, "compute": blob}, legacy)):
        aic = tmp_path / f"aic{i}.parquet"
        pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(m)}), aic)
        for cmd in ("breakeven", "capacity"):
            r = CliRunner().invoke(cli, ["analyze", cmd, str(aic)])
            assert r.exit_code == 2
            assert "recorded with --compute aiconfigurator; pricing its recomputation the same way needs " \
                   "aiconfigurator-core" in r.output


# ------------------------------------------------------------------ the C core's clipping, one call
def _layers(*rows):
    from kvemu.backends import LAYER_DTYPE, LAYER_KINDS

    t = np.zeros(len(rows), LAYER_DTYPE)
    for i, (kind, window, block, state) in enumerate(rows):
        t[i] = (LAYER_KINDS.index(kind), window, block, state)
    return t


def test_the_c_core_clips_each_layer_by_hand():
    from backend_helpers import csr, make_entries, make_steps, span

    from kvemu.backends import REQ_DTYPE, Backend, LayerMoves

    # B = 16 tokens; one request, 10 blocks, prompt_blocks 8; layers: sliding W 32 (2 blocks back),
    # full, chunked W 64 (chunks of 4 blocks, half-size blocks), linear (a 4 KiB state, checkpoint 4)
    layers = _layers(("sliding", 32, 1024, 0), ("full", 0, 1024, 0), ("chunked", 64, 512, 0), ("linear", 0, 0, 4096))
    reqs = np.zeros(1, REQ_DTYPE)
    reqs["prompt_blocks"] = 8
    kv = LayerMoves(layers, reqs, 16, 4, False)
    off, slots = csr([list(range(10))])
    entries = make_entries([(0, (3, 6), (0, 10), (5, 2))])  # load 3..8, store 0..9, read 5..6
    with Backend("dram") as b:
        b.prepare(1024, 16, 4, 4, False)
        b.replay(off, slots, make_steps([(0, 1)]), entries, span(1, 1, 1, 1), kv)
        got = {op: b.op_stats(op)["bytes"] for op in ("load", "store", "read")}
    # load ends at block 9: full 6 blocks; sliding from 7: 2; chunked from 8 (9's chunk): 1 half block; one state
    assert got["load"] == 6 * 1024 + 2 * 1024 + 1 * 512 + 4096
    # store: full all 10; sliding the 2 before the prompt's end (6, 7); chunked: the prompt ends on a chunk
    # boundary (8), nothing; linear: checkpoints at blocks 4 and 8 are passed
    assert got["store"] == 10 * 1024 + 2 * 1024 + 0 + 2 * 4096
    # read ends at 7: full 2; sliding from 5: 2; chunked from 4 (7's chunk): 2 half blocks; one state
    assert got["read"] == 2 * 1024 + 2 * 1024 + 2 * 512 + 4096


def test_the_c_core_refuses_bad_layer_tables():
    from backend_helpers import csr, make_entries, make_steps, span

    from kvemu.backends import REQ_DTYPE, Backend, LayerMoves
    from kvemu.errors import BackendError

    off, slots = csr([[0, 1]])
    entries = make_entries([(0, (0, 2), (0, 0), (0, 0))])
    reqs = np.zeros(1, REQ_DTYPE)
    big_state = LayerMoves(_layers(("linear", 0, 0, 1 << 20), ("full", 0, 1024, 0)), reqs, 16, 4, False)
    wide_block = LayerMoves(_layers(("full", 0, 2048, 0), ("full", 0, 1024, 0)), reqs, 16, 4, False)
    with Backend("dram") as b:
        b.prepare(1024, 4, 2, 2, False)
        with pytest.raises(BackendError, match="state of 1048576 bytes exceeds the layer's arena"):
            b.replay(off, slots, make_steps([(0, 1)]), entries, span(1, 1), big_state)
        with pytest.raises(BackendError, match="block_bytes 2048 must be a multiple of 64 up to 1024"):
            b.replay(off, slots, make_steps([(0, 1)]), entries, span(1, 1), wide_block)
    with Backend("dram") as b:
        b.prepare(1024, 4, 2, 2, False, layout="cross-layer")
        with pytest.raises(BackendError, match="per-layer KV kinds need the per-layer layout"):
            b.replay(off, slots, make_steps([(0, 1)]), entries, span(1, 1), wide_block)


def test_a_split_load_windows_from_the_whole_loads_end_by_hand():
    """A prefix load split over entries (a tier stack's levels) with load_end: each layer's window is
    the whole load's, each entry moving only its own part of it."""
    from backend_helpers import csr, make_entries, make_steps, span

    from kvemu.backends import REQ_DTYPE, Backend, LayerMoves
    from kvemu.errors import BackendError

    layers = _layers(("sliding", 32, 1024, 0), ("full", 0, 1024, 0), ("chunked", 64, 512, 0), ("linear", 0, 0, 4096))

    def loads(parts, load_end):
        reqs = np.zeros(1, REQ_DTYPE)
        reqs["prompt_blocks"], reqs["load_end"] = 10, load_end
        kv = LayerMoves(layers, reqs, 16, 4, False)
        off, slots = csr([list(range(10))])
        with Backend("dram") as b:
            b.prepare(1024, 16, 4, 4, False)
            b.replay(off, slots, make_steps([(0, len(parts))]),
                     make_entries([(0, p, (0, 0), (0, 0)) for p in parts]), span(1, 1, 1, 1), kv)
            return b.op_stats("load")["bytes"]

    # the load of blocks 0..8 (ends at 9), split 0..5 | 6..8: whole, the sliding window is 7, 8, the
    # chunked one 8 (9's chunk starts at 8), the state is block 8's
    whole = 9 * 1024 + 2 * 1024 + 1 * 512 + 4096
    assert loads([(0, 9)], 0) == whole
    assert loads([(0, 6), (6, 3)], 9) == whole
    # the first part alone: its full blocks only (its window lies in the second part)
    assert loads([(0, 6)], 9) == 6 * 1024
    # without load_end each part windows from its own end: more than the whole load
    assert loads([(0, 6), (6, 3)], 0) == whole + 2 * 1024 + 2 * 512 + 4096
    with pytest.raises(BackendError, match="after its request's load_end 5"):
        loads([(0, 6)], 5)


# ------------------------------------------------------------------ a tier stack's levels, each its groups' bytes
@pytest.mark.parametrize("kind, cfg", [("sliding", SLIDING), ("linear", LINEAR)])
def test_every_level_of_a_stack_moves_the_groups_bytes(tmp_path, kind, cfg):
    """A two-level stack whose top holds 1 MiB (64 chunks of one block; a document of 600 tokens is 37
    blocks): hits are split between the levels. Each request's prefix load moves, over the levels together, what
    one load of the whole hit moves by hand (sliding: the full layers every block, the sliding ones
    the window before the hit's end; linear: one state each); with placement write-through into a
    level that holds everything, the level below writes what the engine stores, each group its own."""
    from kvemu.replay import DataPathOptions, TierOptions
    from kvemu.replay.stack import parse_tiers

    trace = _record(tmp_path, cfg, "offload", 600)
    got = {}
    for placement in ("write-back", "write-through"):
        spec = parse_tiers(f"placement={placement};dram|cap=1MiB;dram|cap=64MiB")
        out = tmp_path / f"{placement}.parquet"
        kvemu.replay(str(trace), "dram", ReplayOptions(tier=TierOptions(stack=spec),
                                                       datapath=DataPathOptions(chunk_tokens=16)), out=str(out))
        t = pq.read_table(out)
        got[placement] = t.to_pydict(), json.loads(t.schema.metadata[b"kvemu"])
    rows, meta = got["write-back"]
    hand = 0
    for h, n in zip(rows["hbm_hit_tokens"], rows["tier_hit_tokens"]):
        n //= 16
        if n:
            hand += 2 * n * BLOCK + (2 * min(n, WINDOW_BLOCKS) * BLOCK if kind == "sliding" else 2 * STATE)
    levels = meta["schedule"]["stack"]["levels"]
    split = [lt for lt in rows["stack_level_tokens"] if lt[0] and lt[1]]
    assert split, "no hit is split between the levels"
    assert levels[0]["replayed_bytes"] is None
    moved = meta["ops"]["load"]["bytes"] + levels[1]["replayed_bytes"]["load"]
    assert moved == hand == sum(rows["kv_bytes_loaded"])
    assert levels[1]["replayed_bytes"]["load"] < 4 * BLOCK * levels[1]["served_tokens"] // 16  # groups, not full
    rows, meta = got["write-through"]
    assert meta["schedule"]["stack"]["levels"][1]["replayed_bytes"]["store"] == meta["ops"]["store"]["bytes"] \
        == sum(rows["kv_bytes_stored"])
    assert not any("upper bound" in w for w in meta["warnings"])


def test_a_split_hit_whose_top_part_comes_first_windows_from_the_hits_end(tmp_path):
    """Hand-traced: the top level holds a document's first half and the level below its second, so
    the top level's part of the hit ends before the hit does. The sliding layers' window (4 blocks
    before the hit's end) lies wholly below: the top level moves only the full layers' blocks.
    Blocks of 16 tokens, chunks of one block; L1 holds 8 chunks (8 x 4 layers x 4 KiB), L2 plenty;
    HBM 9 blocks. Requests (1 s apart), hash ids of 64 tokens (4 blocks):
      0: doc A [1, 2] + 1 token: A0..A7 stored into L1 (full).
      1: 15 tokens, 130 out: no block stored; its decode takes HBM's 9 blocks (A leaves HBM).
      2: [1] + 1 token: A0..A3 served by L1 (LRU: now newer than A4..A7). 3: as 1.
      4: [5] + 1 token: C0..C3 stored into L1, A4..A7 (the oldest) demoted into L2.  5: as 1.
      6: A again: A0..A3 from L1, A4..A7 from L2; its prefix ends at block 8."""
    import json

    from conftest import make_workload, record

    from kvemu.replay import DataPathOptions, TierOptions
    from kvemu.replay.stack import parse_tiers

    model = tmp_path / "config.json"
    model.write_text(json.dumps(SLIDING))
    inp = [129, 15, 65, 15, 65, 15, 129]
    out = [1, 130, 1, 130, 1, 130, 1]
    hashes = [[1, 2, 100], [200], [1, 101], [201], [5, 102], [202], [1, 2, 103]]
    trace = record(make_workload([1000.0 * i for i in range(7)], inp, out, hashes), tmp_path / "t.parquet",
                   model=str(model), hbm_kv_blocks=9)
    spec = parse_tiers(f"dram|cap={8 * 4 * BLOCK};dram|cap=64MiB")
    res = tmp_path / "r.parquet"
    kvemu.replay(str(trace), "dram", ReplayOptions(tier=TierOptions(stack=spec), datapath=DataPathOptions(chunk_tokens=16)),
                 out=str(res))
    t = pq.read_table(res)
    rows, meta = t.to_pydict(), json.loads(t.schema.metadata[b"kvemu"])
    assert rows["hbm_hit_tokens"] == [0] * 7
    assert rows["stack_level_tokens"] == [[0, 0], [0, 0], [64, 0], [0, 0], [0, 0], [0, 0], [64, 64]]
    # the top level: request 2's 4 blocks (2 full + 2 sliding layers, all in its window), request 6's
    # first 4 (2 full layers only); L2: request 6's last 4 in all 4 layers (in the window)
    assert meta["ops"]["load"]["bytes"] == 4 * 4 * BLOCK + 4 * 2 * BLOCK
    l2 = meta["schedule"]["stack"]["levels"][1]
    assert l2["replayed_bytes"]["load"] == 4 * 4 * BLOCK
    assert rows["kv_bytes_loaded"][6] == 8 * 2 * BLOCK + WINDOW_BLOCKS * 2 * BLOCK
    # A4..A7 demoted, as request 0 stored them: in its window before the prompt's end, all 4 layers
    assert l2["replayed_bytes"]["store"] == 4 * 4 * BLOCK
