"""What the engine's bounded offload tier evicts (`record --tier-eviction`) and what the replay's
tier evicts (`replay --tier-eviction`: the arena's slots and, closed loop, the replayed engine's
tier), by kvemu.policies name.

The oracle is counted by hand from the policies' published rules (LRU; FIFO; S3-FIFO, SOSP'23, with
a capacity of 3: a small FIFO of 1, a main FIFO of 2, a ghost FIFO of 2). Each request's prompt is
one full 16-token block, named by a letter, plus one token; requests arrive a second apart, so each
finishes before the next; HBM holds 2 blocks, exactly one request's table, so the next request
evicts the last one's block from HBM and a block comes back only from the tier. The tier holds 3
blocks. A request whose block the tier holds loads it (a tier hit: 16 tokens); otherwise its block is
computed and stored, which may evict one.

``ABACDAEBA``:

- LRU: A B miss; A hit [B A]; C miss [B A C]; D evicts B [A C D]; A hit [C D A]; E evicts C; B evicts
  D; A hit. Hits at requests 3, 6, 9; 3 evictions.
- FIFO (a hit changes nothing): A B miss; A hit; C miss [A B C]; D evicts A; A misses, evicts B; E
  evicts C; B misses, evicts D; A hit. Hits at 3, 9; 4 evictions.
- S3-FIFO: A B miss; A hit (freq 1); C miss, S=[A B C]; D: S's tail A was used, so it moves to M,
  and B, unused, is evicted (G=[B]); A hit; E evicts C from S (G=[B C]); B misses: D is evicted
  from S, and G, over its 2, drops B, so B enters S, not M; A hit. Hits at 3, 6, 9; 3 evictions.

``ABACDEA`` (a scan after A's reuse):

- LRU: A hit at 3; D evicts B, E evicts A, so A misses at 7 (evicting C). Hits at 3; 3 evictions.
- FIFO: A hit at 3; D evicts A, E evicts B, A misses at 7 (evicting C). Hits at 3; 3 evictions.
- S3-FIFO: A hit at 3; D moves A (used) to M and evicts B; E evicts C from S; A is in M: a hit at 7.
  Hits at 3, 7; 2 evictions.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import make_workload, record
from kvemu.backends import TierSlots
from kvemu.errors import OptionError
from kvemu.record_options import EngineOptions, RecordOptions
from kvemu.replay import DataPathOptions, ReplayOptions, TierOptions, replay
from kvemu.replay.arena import PolicySlots
from kvemu.schema import read_trace

TPB = 16
ORACLE = {
    "ABACDAEBA": {"lru": ([3, 6, 9], 3), "fifo": ([3, 9], 4), "s3fifo": ([3, 6, 9], 3)},
    "ABACDEA": {"lru": ([3], 3), "fifo": ([3], 3), "s3fifo": ([3, 7], 2)},
}


def _workload(seq: str):
    n = len(seq)
    # one full 16-token hash block per prompt (its letter) and a partial one of its own
    return make_workload([1000.0 * i for i in range(n)], [TPB + 1] * n, [1] * n,
                         [[ord(c), 1000 + i] for i, c in enumerate(seq)], hash_block_tokens=TPB)


def _record(tmp_path, seq: str, eviction: str | None):
    kw = {} if eviction is None else {"tier_eviction": eviction}
    return record(_workload(seq), tmp_path / f"{seq}-{eviction}.parquet", tokens_per_block=TPB, hbm_kv_blocks=2,
                  tier_policy="offload", tier_capacity_blocks=3, transfer_chunk_tokens=TPB, **kw)


def _hits(tier_hit_tokens) -> list[int]:
    """The 1-based requests that found their block in the tier."""
    return [i + 1 for i, t in enumerate(tier_hit_tokens) if t]


@pytest.mark.parametrize("seq", sorted(ORACLE))
@pytest.mark.parametrize("eviction", ["lru", "fifo", "s3fifo"])
def test_record_evicts_by_the_named_policy(tmp_path, seq, eviction):
    tr = read_trace(_record(tmp_path, seq, eviction))
    hits, evictions = ORACLE[seq][eviction]
    assert _hits(tr.tier_hit_tokens) == hits
    assert all(t in (0, TPB) for t in tr.tier_hit_tokens)  # a whole block from the tier, or recomputed
    eng = tr.header.meta["engine"]
    assert eng["tier_eviction"] == eviction and eng["tier_evictions"] == evictions


def test_record_default_is_lru(tmp_path):
    tr = read_trace(_record(tmp_path, "ABACDAEBA", None))
    assert _hits(tr.tier_hit_tokens) == ORACLE["ABACDAEBA"]["lru"][0]
    assert tr.header.meta["engine"]["tier_eviction"] == "lru" == EngineOptions().tier_eviction


def _replayed(trace, out, **tier):
    opts = ReplayOptions(datapath=DataPathOptions(chunk_tokens=TPB), tier=TierOptions(**tier))
    res = replay(trace, "vemu:cxl-pool", opts, out=out)
    t = pq.read_table(res.path)
    return t.column("tier_hit_tokens").to_pylist(), json.loads(t.schema.metadata[b"kvemu"])


def test_closed_loop_replays_the_traces_policy_and_the_one_it_is_told(tmp_path):
    """The closed loop's engine tier evicts by the trace's policy (FIFO here), or by --tier-eviction:
    the hand-counted hits of each policy again, on a tier of the recorded 3 blocks."""
    fifo = _record(tmp_path, "ABACDAEBA", "fifo")
    h = read_trace(fifo).header
    hits, meta = _replayed(fifo, tmp_path / "r.parquet")
    assert _hits(hits) == ORACLE["ABACDAEBA"]["fifo"][0]
    assert meta["tier"]["eviction"] == "fifo" and meta["label"].endswith("/offload-fifo")
    assert meta["schedule"]["engine"]["tier_evictions"] == ORACLE["ABACDAEBA"]["fifo"][1]
    cap = 3 * h.block_bytes_per_layer * h.layers
    for name in ("lru", "s3fifo"):
        hits, meta = _replayed(fifo, tmp_path / f"r-{name}.parquet", capacity_bytes=cap, eviction=name)
        assert _hits(hits) == ORACLE["ABACDAEBA"][name][0], name
        assert meta["tier"]["eviction"] == name and meta["tier"]["capacity_chunks"] == 3


def test_replay_of_a_trace_that_records_no_policy_evicts_lru(tmp_path):
    """The golden v2 trace predates engine.tier_eviction: replayed with a small tier, it evicts LRU."""
    from pathlib import Path

    golden = Path(__file__).parent / "data" / "golden-trace-v2.parquet"
    assert "tier_eviction" not in read_trace(golden).header.meta["engine"]
    res = replay(golden, "vemu:cxl-pool", ReplayOptions(tier=TierOptions(capacity_bytes=64 << 20)),
                 out=tmp_path / "r.parquet")
    meta = json.loads(pq.read_schema(res.path).metadata[b"kvemu"])
    assert meta["tier"]["eviction"] == "lru" and "-lru" not in meta["label"]


# ------------------------------------------------------------------------------ the arena's slots
def test_policy_slots_fifo_against_a_hand_count():
    """Capacity 2. Call 1 stores 1 and 2 (slots 0, 1); call 2 uses 1; call 3 stores 3: FIFO evicts 1,
    the oldest stored (LRU would evict 2), and 3 takes its slot 0."""
    s = PolicySlots("fifo", 2, 10)
    assert [x.tolist() for x in s.map([1, 2])] == [[0, 1], [True, True]]
    assert [x.tolist() for x in s.map([1])] == [[0], [False]]
    assert [x.tolist() for x in s.map([3])] == [[0], [True]]
    assert s.evictions == 1 and s.overflow == 0
    lru = TierSlots(2, 10)
    lru.map([1, 2]), lru.map([1])
    assert lru.map([3])[0].tolist() == [1]  # the C LRU: 2 goes


def test_policy_slots_lru_matches_the_c_allocator():
    """PolicySlots run with the registry's LRU gives the C allocator's slots, fresh flags, evictions
    and overflow, call by call (random calls, some larger than the tier)."""
    rng = np.random.default_rng(7)
    c, py = TierSlots(5, 40), PolicySlots("lru", 5, 40)
    for _ in range(300):
        keys = rng.integers(0, 40, rng.integers(1, 8))
        (a, fa), (b, fb) = c.map(keys), py.map(keys)
        assert a.tolist() == b.tolist() and fa.tolist() == fb.tolist()
    assert (c.evictions, c.overflow, c.resident) == (py.evictions, py.overflow, py.resident)


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("engine, message", [
    (EngineOptions(tier_eviction="mru"), "engine.tier_eviction names no eviction policy, got 'mru' (known: lru, fifo"),
    (EngineOptions(tier_eviction="optimal", tier_capacity_gib=1.0), "engine.tier_eviction optimal needs every future"),
    (EngineOptions(tier_eviction="fifo"), "engine.tier_eviction fifo has no effect without engine.tier_capacity_gib"),
    (EngineOptions(tier_eviction="fifo", tier_policy="resident", tier_capacity_gib=1.0),
     "engine.tier_eviction fifo needs engine.tier_policy offload"),
])
def test_record_options_refuse_what_the_tier_cannot_evict_by(engine, message):
    with pytest.raises(OptionError, match=message.replace("(", r"\(")):
        RecordOptions(engine=engine).check()


def test_replay_refuses_a_policy_it_cannot_run(tmp_path):
    with pytest.raises(OptionError, match="tier.eviction names no eviction policy"):
        TierOptions(eviction="clock").check()
    unbounded = record(_workload("ABA"), tmp_path / "u.parquet", tokens_per_block=TPB, hbm_kv_blocks=2)
    with pytest.raises(OptionError, match="has no effect without tier.capacity_bytes or a trace recorded"):
        replay(unbounded, "vemu:cxl-pool", ReplayOptions(tier=TierOptions(eviction="fifo")), out=tmp_path / "r.parquet")
    assert not (tmp_path / "r.parquet").exists()


@pytest.mark.parametrize("args, line", [
    (["record", "--workload", "synthetic:chat", "--model", "llama3-8b", "--tier-eviction", "mru"],
     "Error: --tier-eviction names no eviction policy, got 'mru' (known: lru, fifo, s3fifo)"),
    (["record", "--workload", "synthetic:chat", "--model", "llama3-8b", "--tier-eviction", "fifo"],
     "Error: --tier-eviction fifo has no effect without --tier-capacity-gib (an unbounded tier evicts nothing)"),
])
def test_cli_refuses_in_one_line(tmp_path, args, line):
    out = tmp_path / "t.parquet"
    p = subprocess.run([sys.executable, "-m", "kvemu", *args, "--out", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == line and p.stdout == ""
    assert not out.exists()


def test_trace_info_shows_the_policy(tmp_path):
    from click.testing import CliRunner

    from kvemu.cli import cli

    path = _record(tmp_path, "ABA", "s3fifo")
    r = CliRunner().invoke(cli, ["trace", "info", str(path)])
    assert r.exit_code == 0
    assert "tier eviction" in r.output and "s3fifo, over 3 blocks" in r.output
