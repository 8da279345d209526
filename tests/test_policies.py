"""Eviction policies (kvemu.policies): the registry, S3-FIFO against a brute-force oracle written
here from the paper's Algorithm 1, the Python LRU and FIFO objects against the analysis' fast paths
(stack distances, C), and S3-FIFO in the analysis (--policies, --stack) and in a replayed stack level
(--tiers ... policy=s3fifo), hand-traced."""

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_workload, record
from kvemu.backends import policy_hits, stack_distances
from kvemu.capacity import POLICIES, Level, StackAnalysis
from kvemu.cli import cli
from kvemu.errors import ConfigError
from kvemu.policies import (CachePolicy, get_policy, make_policy, policy_names, register_policy,
                            simulate_hits)
from kvemu.profiles import resolve_profile
from kvemu.replay.stack import STACK_POLICIES, parse_tiers
from kvemu.schema import read_trace
from test_tier_stack import DOCS, ORDER, _run


def s3fifo_oracle(seq, C):
    """S3-FIFO as Yang et al. (SOSP'23) describe it, with plain lists (index 0 the head, the last
    the tail), linear scans and integer arithmetic for the ratios: S is "full" at 10 % of C, M and
    G hold at most 90 % of C; a hit raises the frequency (capped at 3); a miss evicts while the cache
    is full, then goes to M's head if G remembers it, else S's head; S's tail goes to M (bits
    cleared) when used since it came in, else to G; M's tail is reinserted with its frequency less
    one until one with frequency 0 leaves. Returns the hits (1/0) and the set held after each
    reference."""
    S, M, G, freq = [], [], [], {}

    def evict_m():
        while M:
            t = M.pop()
            if freq[t] > 0:
                freq[t] -= 1
                M.insert(0, t)
            else:
                del freq[t]
                return

    def evict_s():
        while S:
            t = S.pop()
            if freq[t] > 0:
                freq[t] = 0
                M.insert(0, t)
                if 10 * len(M) > 9 * C:
                    evict_m()
            else:
                del freq[t]
                G.insert(0, t)
                if 10 * len(G) > 9 * C:
                    G.pop()
                return

    hits, held = [], []
    for x in seq:
        if x in S or x in M:
            freq[x] = min(freq[x] + 1, 3)
            hits.append(1)
        else:
            hits.append(0)
            while len(S) + len(M) >= C:
                if 10 * len(S) >= C or not M:
                    evict_s()
                else:
                    evict_m()
            if x in G:
                G.remove(x)
                M.insert(0, x)
            else:
                S.insert(0, x)
            freq[x] = 0
        held.append(set(S) | set(M))
    return hits, held


def run_policy(name, seq, C):
    """The policy object driven as the analysis drives it, with the victims it names checked."""
    p = make_policy(name, C)
    hits, held = [], []
    for x in seq:
        before = set(p)
        if x in p:
            p.on_hit(x)
            hits.append(1)
            assert set(p) == before
        else:
            gone = p.on_insert(x)
            hits.append(0)
            assert x not in gone and set(gone) == before - set(p) and len(gone) == len(set(gone))
            assert set(p) == (before - set(gone)) | {x}
        assert len(p) <= C
        held.append(set(p))
    return hits, held


def adversarial(C):
    """Sequences that stress each rule: a loop one longer than the cache (LRU's worst case), a hot
    set under a scan of one-hit wonders, keys coming back from the ghost, all keys hot (S drains
    into M), and a slowly drifting working set."""
    hot = list(range(max(1, C // 2)))
    loop = list(range(C + 1)) * 4
    scan = (hot * 2 + list(range(1000, 1000 + 3 * C)) + hot) * 2
    ghost = [k for r in range(4) for k in list(range(2 * C)) + list(range(C // 2))]
    allhot = [k for r in range(5) for k in range(C + 3) for _ in range(2)]
    drift = [i // 3 + (i * 7) % 5 for i in range(20 * C)]
    return [loop, scan, ghost, allhot, drift]


def c_hits(seq, C):
    """The analysis' fast path (cbackends/policies.c)."""
    ids = np.array(seq, np.int64)
    return policy_hits(ids, int(ids.max(initial=0)) + 1, C, "s3fifo").astype(int).tolist()


@pytest.mark.parametrize("C", [1, 2, 3, 9, 10, 11, 19, 20, 21, 40])
def test_s3fifo_matches_the_oracle_on_adversarial_sequences(C):
    for seq in adversarial(C):
        want = s3fifo_oracle(seq, C)
        assert run_policy("s3fifo", seq, C) == want
        assert c_hits(seq, C) == want[0]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 25), st.lists(st.integers(0, 40), max_size=300), st.booleans())
def test_s3fifo_matches_the_oracle_on_random_sequences(C, seq, skew):
    if skew:  # a few hot keys among many cold ones
        seq = [x % 4 if x % 3 else x for x in seq]
    want = s3fifo_oracle(seq, C)
    assert run_policy("s3fifo", seq, C) == want
    assert simulate_hits("s3fifo", np.array(seq, np.int64), C).astype(int).tolist() == want[0]
    assert c_hits(seq, C) == want[0]


def test_s3fifo_keeps_a_hot_set_through_a_scan_that_flushes_lru():
    C = 20
    hot = list(range(10))
    seq = hot * 2 + list(range(100, 160)) + hot   # the hot set used twice, a scan of 60 one-hit wonders
    tail = slice(len(seq) - 10, None)
    assert simulate_hits("s3fifo", np.array(seq), C)[tail].all()
    assert not simulate_hits("lru", np.array(seq), C)[tail].any()
    assert not simulate_hits("fifo", np.array(seq), C)[tail].any()


def test_s3fifo_remove_and_evict():
    p = make_policy("s3fifo", 10)
    for k in range(10):
        p.on_insert(k)
    p.on_hit(0)
    p.remove(5)
    assert 5 not in p and len(p) == 9
    gone = p.evict()                      # S holds 9 >= 1: its tail 0 was used, moves to M; 1 leaves
    assert gone == [1] and 0 in p and len(p) == 8
    assert make_policy("s3fifo", 10).evict() == []


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.lists(st.integers(0, 50), max_size=400))
def test_python_lru_and_fifo_agree_with_the_analysis_fast_paths(C, seq):
    ids = np.array(seq, np.int64)
    want_lru = stack_distances(ids, 51) < np.uint64(C)
    assert (simulate_hits("lru", ids, C) == want_lru).all()
    assert (simulate_hits("fifo", ids, C) == policy_hits(ids, 51, C, "fifo").astype(bool)).all()


def test_registry_names_and_refusals():
    assert policy_names() == POLICIES == ("lru", "fifo", "optimal", "s3fifo")
    assert policy_names(online=True) == STACK_POLICIES == ("lru", "fifo", "s3fifo")
    assert policy_names(fast=False) == ()
    assert get_policy("s3fifo").fast_path == "s3fifo" and get_policy("lru").fast_path == "stack-distance"
    with pytest.raises(ConfigError, match=r"^--x: unknown policy 'mru' \(known: lru, fifo, optimal, s3fifo\)$"):
        get_policy("mru", "--x")
    with pytest.raises(ConfigError, match="needs every future access.*lru, fifo or s3fifo"):
        make_policy("optimal", 4)
    with pytest.raises(ConfigError, match="capacity must be at least 1"):
        make_policy("lru", 0)
    with pytest.raises(ValueError, match="registered twice"):
        @register_policy
        class Other(CachePolicy):
            name = "lru"
    with pytest.raises(ValueError, match="lower-case"):
        @register_policy
        class Bad(CachePolicy):
            name = "Bad Name"


@pytest.fixture
def trace(tmp_path):
    """Requests that share prefixes of earlier ones (a smaller copy of test_capacity's stack trace)."""
    rng = np.random.default_rng(7)
    n, hashes, fresh = 40, [], 1000
    for i in range(n):
        base = hashes[rng.integers(0, i)][: rng.integers(0, 6)] if i else []
        hashes.append(base + list(range(fresh, fresh + int(rng.integers(1, 5)))))
        fresh += 10
    w = make_workload([0.0] + sorted(rng.uniform(0, 2000, n - 1).tolist()), [64 * len(h) - 5 for h in hashes],
                      [3] * n, hashes)
    return read_trace(record(w, tmp_path / "t.parquet", hbm_kv_blocks=40))


def test_the_analysis_runs_s3fifo_as_the_oracle_does(trace, monkeypatch):
    an = StackAnalysis(trace)
    seq = an.ids.tolist()
    assert an.unique > 12
    for C in (0, 1, 4, 12, an.unique + 5):
        assert an.level_hits("s3fifo", C).astype(int).tolist() == (s3fifo_oracle(seq, C)[0] if C else [0] * len(seq))
    # the generic path: a policy without a fast path runs its Python object over the stream
    from kvemu.policies.s3fifo import S3FIFO

    monkeypatch.setattr(S3FIFO, "fast_path", None)
    generic = StackAnalysis(trace)
    for C in (0, 1, 4, 12):
        assert (generic.level_hits("s3fifo", C) == an.level_hits("s3fifo", C)).all()
    monkeypatch.undo()
    # a level's block hit ratio, through evaluate and the command line
    bb = an.block_bytes
    got = an.evaluate([Level("dram", resolve_profile("local-dram"), 12 * bb, "s3fifo")], "lru", placement="inclusive")
    want = sum(s3fifo_oracle(seq, 12)[0]) / len(seq)
    assert got["levels"][0]["block_hit_ratio"] == pytest.approx(want, abs=1e-12)
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(trace.header.path), "--stack",
                                 f"local-dram={12 * bb}", "--policies", "lru,s3fifo", "--json", "--placement",
                                 "inclusive"])
    assert r.exit_code == 0, r.output
    pts = {p["policy"]: p for p in json.loads(r.output)["points"]}
    assert pts["s3fifo"]["levels"][0]["block_hit_ratio"] == pytest.approx(want, abs=1e-12)
    assert pts["s3fifo"]["levels"][0]["policy"] == "s3fifo"
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(trace.header.path), "--stack",
                                 f"local-dram={12 * bb}:s3fifo", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["stack"][0]["policy"] == "s3fifo", r.output
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(trace.header.path), "--policies", "lru,arc"])
    assert r.exit_code == 2 and r.output.strip().endswith("(known: lru, fifo, optimal, s3fifo)"), r.output


def test_a_replayed_s3fifo_level_keeps_the_reused_document(tmp_path):
    """test_tier_stack's documents (A B A C A D B C, 8 one-block chunks each; HBM holds one request),
    L1 an LRU of 16 MiB (one document), L2 an S3-FIFO of 32 MiB (16 chunks: S 2, M 14, ghost 14).
    By hand: B's store demotes A into L2's S; A is served by L2 twice (frequency 2); C demotes B
    (L2 full: S = A, B); D demotes C: C's first chunk makes room by moving A's 8 chunks (used) to M
    and sending B's first to the ghost, each next chunk of C sends one more of B: B is recomputed.
    Its store demotes D, whose chunks push C's to the ghost one by one: C is recomputed too (LRU
    served it, test_tier_stack), and its store demotes B, which pushes out D. L2 evicts B, C and D
    (24 blocks) and keeps A."""
    w = make_workload([1000.0 * i for i in range(len(ORDER))], [129] * len(ORDER), [1] * len(ORDER),
                      [DOCS[c] + [100 + i] for i, c in enumerate(ORDER)], hash_block_tokens=64)
    path = record(w, tmp_path / "t.parquet", hbm_kv_blocks=9)
    st, rows, _ = _run(path, tmp_path / "r.parquet", "vemu:cxl-pool|cap=16MiB;vemu:nvme|cap=32MiB,policy=s3fifo")
    assert rows["tier_hit_tokens"] == [0, 0, 128, 0, 128, 0, 0, 0]
    l1, l2 = st["levels"]
    assert l2["policy"] == "s3fifo" and l2["served_tokens"] == 256
    assert l2["evicted_blocks"] == 24
    r = CliRunner().invoke(cli, ["replay", str(path), "--tiers", "dram|cap=16MiB,policy=arc",
                                 "--out", str(tmp_path / "x.parquet")])
    assert r.exit_code == 2 and "unknown policy 'arc' (known: lru, fifo, s3fifo)" in r.output, r.output


def test_tiers_take_every_online_policy():
    for name in policy_names(online=True):
        spec = parse_tiers(f"dram|cap=1GiB,policy={name}")
        assert spec.levels[0].policy == name


@pytest.mark.parametrize("C", [1, 5, 12])
def test_the_engines_tier_runs_a_named_policy(C):
    """engine.pool.TierCache driven a block at a time (a prefix hit touches, a miss stores) holds
    what the oracle holds, and counts its evictions."""
    from kvemu.engine.pool import TierCache

    seq = adversarial(C)[1] + adversarial(C)[2]
    want_hits, want_held = s3fifo_oracle(seq, C)
    tier = TierCache(C, "s3fifo")
    hits = []
    for x, held in zip(seq, want_held):
        hits.append(tier.prefix_hit([x], 0, 1))
        (tier.touch if hits[-1] else tier.add)([x])
        assert set(tier.blocks) == held
    assert hits == want_hits
    assert tier.evictions == len(seq) - sum(hits) - len(want_held[-1]) and tier.peak == C


def _fill_oracle(moves: bool, cap: int, chunks: dict, runs):
    """fill_chunks by hand: the queue a plain list of keys, oldest first, a write moving the key to
    the end where ``moves`` (LRU), nothing else (FIFO); the most held is the sum of the chunks'
    blocks after each run."""
    queue, gone, dropped, peaks = list(chunks), [], [], []
    for key, blocks in runs:
        if key in chunks:
            chunks[key] = chunks[key] + list(blocks)
            if moves:
                queue.remove(key)
                queue.append(key)
        else:
            chunks[key] = list(blocks)
            queue.append(key)
            while len(queue) > cap:
                k = queue.pop(0)
                vb = chunks.pop(k)
                dropped += vb
                gone.append((k, vb))
        peaks.append(sum(map(len, chunks.values())))
    return queue, gone, dropped, peaks


@pytest.mark.parametrize("name", ["fifo", "lru"])
@settings(max_examples=60, deadline=None)
@given(cap=st.integers(1, 5),
       runs=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 3)), min_size=1, max_size=40))
def test_fill_chunks_matches_a_list_queue(name, cap, runs):
    """The stack level's inline loop (FIFO.fill_chunks, LRU inherits it with writes that move) stores
    runs as a list-queue walked by hand does: the chunks, what is evicted in order, the queue's
    order after, the blocks held and the most held."""
    pol = make_policy(name, cap)
    nxt, rr = iter(range(10_000)), []
    for key, n in runs:
        rr.append((key, [next(nxt) for _ in range(n)]))
    chunks: dict = {}
    gone, dropped = [], []
    held, peak = pol.fill_chunks(chunks, [(k, list(b)) for k, b in rr], [len(b) for _, b in rr], 0, 0,
                                 dropped, gone)
    ref_chunks: dict = {}
    queue, ref_gone, ref_dropped, peaks = _fill_oracle(name == "lru", cap, ref_chunks, rr)
    assert chunks == ref_chunks and list(pol.held) == queue
    assert gone == ref_gone and dropped == ref_dropped
    assert held == peaks[-1] and peak == max(peaks)
    assert getattr(make_policy("s3fifo", cap), "fill_chunks", None) is None  # S3-FIFO walks its own rules
