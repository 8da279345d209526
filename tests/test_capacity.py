"""Stacks of levels for analysis: lru/fifo/optimal against brute-force oracles, the inclusive
two-level stack, and the cost and energy of a run computed by hand (kvemu/capacity.py, kvemu/prices.py)."""

import hashlib
import json
import math

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_workload, record
from kvemu.backends import policy_hits, stack_distances
from kvemu.capacity import Level, StackAnalysis, parse_stack
from kvemu.cli import cli
from kvemu.errors import ConfigError
from kvemu.prices import DEFAULT_PRICES, load_prices, run_cost
from kvemu.profiles import resolve_profile
from kvemu.schema import iter_entries, read_trace


def brute_hits(seq, capacity, policy):
    """A cache of ``capacity`` blocks, starting empty, as a plain list: 1 per reference that hits.
    lru: a hit moves the block to the back, the front is evicted; fifo: a hit changes nothing;
    optimal: on a miss with the cache full, of the cached blocks and the missed one the one used
    furthest in the future (or never) stays out."""
    cache, out = [], []
    for i, b in enumerate(seq):
        if b in cache:
            out.append(1)
            if policy == "lru":
                cache.remove(b)
                cache.append(b)
            continue
        out.append(0)
        if capacity == 0:
            continue
        if len(cache) < capacity:
            cache.append(b)
            continue
        if policy in ("lru", "fifo"):
            cache.pop(0)
            cache.append(b)
            continue

        def next_use(x):
            return next((j for j in range(i + 1, len(seq)) if seq[j] == x), math.inf)

        victim = max(cache, key=next_use)
        if next_use(victim) > next_use(b):
            cache.remove(victim)
            cache.append(b)
    return out


def hits(seq, capacity, policy, id_space=None):
    ids = np.array(seq, np.int64)
    space = id_space or (max(seq) + 1 if seq else 1)
    if policy == "lru":
        return (stack_distances(ids, space) < np.uint64(capacity)).astype(int)
    return policy_hits(ids, space, capacity, policy).astype(int)


BELADY = [1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5]  # the reference string of Belady's anomaly


@pytest.mark.parametrize("capacity, want", [
    # (lru, fifo, optimal) hits, counted by hand on BELADY; fifo at 4 hits less than at 3 (the anomaly);
    # optimal at 3 and 4 as the textbook's demand-paging MIN (7 and 6 faults), at 1 and 2 more (it may bypass)
    (1, (0, 0, 2)), (2, (0, 0, 4)), (3, (2, 3, 5)), (4, (4, 2, 6)), (5, (7, 7, 7)),
])
def test_policies_on_beladys_string_exact(capacity, want):
    for policy, n in zip(("lru", "fifo", "optimal"), want):
        assert sum(brute_hits(BELADY, capacity, policy)) == n, policy  # the oracle agrees with the hand count
        assert int(hits(BELADY, capacity, policy).sum()) == n, policy


def test_policies_match_the_brute_force_oracle_on_random_strings():
    rng = np.random.default_rng(11)
    for _ in range(60):
        seq = rng.integers(0, 12, int(rng.integers(0, 80))).tolist()
        for cap in (0, 1, 2, 3, 5, 8, 13):
            for policy in ("lru", "fifo"):  # one answer per reference
                assert hits(seq, cap, policy, 12).tolist() == brute_hits(seq, cap, policy)
            # optimal: ties between blocks never used again may fall either way; the count is exact
            assert int(hits(seq, cap, "optimal", 12).sum()) == sum(brute_hits(seq, cap, "optimal"))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 15), max_size=120), st.integers(0, 18))
def test_optimal_never_hits_less_than_lru_or_fifo(seq, cap):
    opt = int(hits(seq, cap, "optimal", 16).sum())
    assert opt >= int(hits(seq, cap, "lru", 16).sum())
    assert opt >= int(hits(seq, cap, "fifo", 16).sum())
    assert opt <= int(hits(seq, cap + 1, "optimal", 16).sum())  # more room never hurts the optimum


def test_policy_hits_refuses_an_id_outside_the_id_space():
    from kvemu.errors import BackendError

    with pytest.raises(BackendError, match="outside"):
        policy_hits(np.array([0, 5], np.int64), 5, 2, "fifo")


@pytest.fixture
def stack_trace(tmp_path):
    rng = np.random.default_rng(5)
    n, hashes, fresh = 60, [], 1000
    for i in range(n):  # requests share prefixes of earlier ones' chains
        base = hashes[rng.integers(0, i)][: rng.integers(0, 6)] if i else []
        hashes.append(base + list(range(fresh, fresh + int(rng.integers(1, 5)))))
        fresh += 10
    w = make_workload([0.0] + sorted(rng.uniform(0, 2000, n - 1).tolist()), [64 * len(h) - 5 for h in hashes],
                      [3] * n, hashes)
    # a small HBM, so that its own prefix cache misses some reuse
    return read_trace(record(w, tmp_path / "t.parquet", hbm_kv_blocks=40))


def stack_oracle(tr, levels, warmup_requests=0):
    """Request by request: each level a brute-force cache on the whole stream; a prompt block is
    HBM's when the trace's HBM prefix cache held it, else the first level's that holds it; the
    prefix stops at the first block no level holds. Tokens per level over the counted requests."""
    tpb = tr.header.tokens_per_block
    seq, where = [], []
    for r in range(tr.n_requests):
        blocks = tr.table_ids[tr.table_offsets[r]:tr.table_offsets[r] + tr.input_tokens[r] // tpb].tolist()
        for j, b in enumerate(blocks):
            seq.append(b)
            where.append((r, j))
    level_hits = [brute_hits(seq, cap, pol) for _, cap, pol in levels]
    tokens = [0] * (len(levels) + 1)  # the last: HBM
    prefix_ok = {}
    for i, (r, j) in enumerate(where):
        if j == 0:
            prefix_ok[r] = True
        hbm_blocks = (int(tr.cached_tokens[r]) - int(tr.tier_hit_tokens[r])) // tpb
        k = -1 if j < hbm_blocks else next((k for k in range(len(levels)) if level_hits[k][i]), None)
        if k is None:
            prefix_ok[r] = False
        if prefix_ok[r] and r >= warmup_requests:
            tokens[k] += tpb
    total = int(tr.input_tokens[warmup_requests:].sum())
    return [t / total for t in tokens]


@pytest.mark.parametrize("warmup", [0.0, 0.25])
def test_two_level_inclusive_stack_matches_the_oracle(stack_trace, warmup):
    tr = stack_trace
    an = StackAnalysis(tr, warmup=warmup)
    bb = an.block_bytes
    for (c1, p1), (c2, p2) in [((3, "lru"), (20, "fifo")), ((5, "fifo"), (12, "optimal")),
                               ((0, "lru"), (8, "lru")), ((10, "optimal"), (30, "lru"))]:
        levels = [Level("dram", resolve_profile("local-dram"), c1 * bb, p1),
                  Level("ssd", resolve_profile("nvme"), c2 * bb, p2)]
        got = an.evaluate(levels, "lru", placement="inclusive")  # the oracle's rule (kvemu.stackrules)
        want = stack_oracle(tr, [("dram", c1, p1), ("ssd", c2, p2)], an.first_counted)
        assert [lv["hit_share"] for lv in got["levels"]] == pytest.approx(want[:2], abs=1e-12)
        assert got["hbm_share"] == pytest.approx(want[2], abs=1e-12)
        assert got["recompute_share"] == pytest.approx(1 - sum(want), abs=1e-12)
    assert want[2] > 0  # the trace's HBM served some prompts itself


def test_more_capacity_never_slower_lru(stack_trace):
    an = StackAnalysis(stack_trace)
    prof = resolve_profile("local-dram")
    t = [an.evaluate([Level("dram", prof, c * an.block_bytes)], "lru")["ttft_ms"]["mean"] for c in (0, 4, 16, 64, 256)]
    assert all(b <= a + 1e-9 for a, b in zip(t, t[1:]))


PRICES = """
title = "test prices"
date = "2026-12-01"
[gpu.TESTGPU]
usd_per_hour = 2.0
watts = 500.0
source = "made up for the test"
date = "2026-12-01"
[medium.dram]
profiles = ["local-dram"]
usd_per_gb = 10.0
watts_per_gb = 0.1
source = "made up"
date = "2026-12-01"
"""


def test_cost_and_energy_of_one_run_by_hand(tmp_path):
    p = tmp_path / "prices.toml"
    p.write_text(PRICES)
    prices = load_prices(p)
    c = run_cost(prices, gpu="TESTGPU", gpus=4, instances=2, duration_s=1800.0, output_tokens=2_000_000,
                 requests=100, capacities=[("dram", "local-dram", 100 * 10**9)], amortise_years=1.0)
    # 2 instances x 4 GPUs x 0.5 h = 4 GPU-hours at $2; 100 GB x $10 over 1800 s of a 365.25-day year
    assert c["gpu_hours"] == pytest.approx(4.0)
    assert c["gpu_usd"] == pytest.approx(8.0)
    cap = 100 * 10.0 * 1800 / (365.25 * 86400)
    assert c["capacity_usd"] == pytest.approx(cap)
    assert c["usd_per_million_output_tokens"] == pytest.approx((8.0 + cap) / 2.0)
    assert c["usd_per_request"] == pytest.approx((8.0 + cap) / 100)
    # (8 GPUs x 500 W + 100 GB x 0.1 W/GB) x 1800 s = 7,218,000 J = 2005 Wh, over 100 requests
    assert c["energy_joules"] == pytest.approx(7_218_000.0)
    assert c["wh_per_request"] == pytest.approx(20.05)
    assert c["inputs"]["gpu_usd_per_hour"] == 2.0 and c["inputs"]["amortise_years"] == 1.0
    unpriced = run_cost(prices, gpu="OTHER", gpus=1, instances=1, duration_s=10, output_tokens=1, requests=1)
    assert unpriced["total_usd"] is None and "no price for GPU OTHER" in unpriced["notes"][0]


def test_the_shipped_price_table_names_a_source_and_date_for_every_figure():
    prices = load_prices()
    assert prices.gpus and prices.media
    for entry in [*prices.gpus.values(), *prices.media.values()]:
        assert entry.source.strip() and entry.date.strip()
    for profile in ("local-dram", "remote-numa", "cxl-pool", "cxl-pool-multi", "nvme", "rdma-storage"):
        assert prices.medium_of(profile) is not None, profile
    assert prices.digest == hashlib.sha256(DEFAULT_PRICES.read_bytes()).hexdigest()


@pytest.mark.parametrize("text, message", [
    ("[gpu.X]\nusd_per_hour = 1.0\nwatts = 1.0\ndate = \"2026\"\n", "needs a source"),
    ("[gpu.X]\nusd_per_hour = -1.0\nwatts = 1.0\nsource = \"s\"\ndate = \"d\"\n", "usd_per_hour must be"),
    ("[gpus.X]\n", "unknown keys gpus"),
    ("not toml [", "cannot be read"),
])
def test_bad_price_tables_are_refused_in_one_line(tmp_path, text, message):
    p = tmp_path / "p.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_prices(p)
    r = CliRunner().invoke(cli, ["analyze", "capacity", "nothing.parquet", "--policies", "lru", "--prices", str(p)])
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--stack", "local-dram=1TiB:mru"], "unknown policy 'mru'"),
    (["--stack", "local-dram"], "is not NAME=SIZE"),
    (["--stack", "nosuch=1GiB"], "unknown tier profile"),
    (["--policies", "lru,lru"], "twice"),
    (["--stack", "local-dram=1GiB", "--sweep", "nvme=1GiB"], "not in the stack"),
    (["--policies", "lru", "--warmup", "1"], "--warmup must be below 1"),
    (["--policies", "lru", "--amortise-years", "0"], "--amortise-years"),
])
def test_bad_stack_options_are_refused_in_one_line(stack_trace, args, message):
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(stack_trace.header.path), *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1


def test_stack_file_and_cli_sweep_json(stack_trace, tmp_path):
    f = tmp_path / "stack.toml"
    f.write_text('[[tier]]\nname = "pool"\nprofile = "cxl-pool"\ncapacity = "0"\n\n'
                 '[[tier]]\nname = "disk"\nprofile = "nvme"\ncapacity = "1GiB"\npolicy = "fifo"\n')
    levels = parse_stack(str(f))
    assert [(lv.name, lv.profile.name, lv.policy) for lv in levels] == [("pool", "cxl-pool", None), ("disk", "nvme", "fifo")]
    bb = StackAnalysis(stack_trace).block_bytes
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(stack_trace.header.path), "--stack", str(f),
                                 "--sweep", f"pool=0,{4 * bb},{16 * bb}", "--policies", "lru,optimal", "--json",
                                 "--placement", "inclusive"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert len(out["points"]) == 6 and out["sweep"]["level"] == "pool"
    assert "starts empty" in out["measurement_rule"]
    assert out["prices"]["sha256"] == hashlib.sha256(DEFAULT_PRICES.read_bytes()).hexdigest()
    for p in out["points"]:
        assert p["levels"][1]["policy"] == "fifo"  # its own policy, whatever the run's
        assert p["cost"]["inputs"]["amortise_years"] == 3.0
    # the optimal top level serves at least what lru's does, block for block
    by = {(p["swept_capacity_bytes"], p["policy"]): p for p in out["points"]}
    for cap in (0, 4 * bb, 16 * bb):
        assert by[(cap, "optimal")]["levels"][0]["block_hit_ratio"] >= by[(cap, "lru")]["levels"][0]["block_hit_ratio"]


def _sweep_prices(tr, tmp_path):
    """A price table for the trace's GPU and the two media of the sweep, with round figures."""
    gpu = tr.header.meta["gpu"]["name"]
    p = tmp_path / "sweep-prices.toml"
    p.write_text(f'title = "sweep test"\ndate = "2026-12-02"\n[gpu."{gpu}"]\nusd_per_hour = 3.0\nwatts = 700.0\n'
                 'source = "test"\ndate = "2026-12-02"\n'
                 '[medium.pool]\nprofiles = ["cxl-pool"]\nusd_per_gb = 8.0\nwatts_per_gb = 0.2\n'
                 'source = "test"\ndate = "2026-12-02"\n'
                 '[medium.disk]\nprofiles = ["nvme"]\nusd_per_gb = 0.1\nwatts_per_gb = 0.01\n'
                 'source = "test"\ndate = "2026-12-02"\n')
    return p


def test_a_sweep_point_by_hand(stack_trace, tmp_path):
    """One --sweep point of a pool over storage: the tokens each level serves by the brute-force
    stack oracle, the cost and energy by hand from the point's GPU busy time, TPOT from the steps."""
    tr = stack_trace
    bb = StackAnalysis(tr).block_bytes
    prices = _sweep_prices(tr, tmp_path)
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(tr.header.path), "--stack",
                                 f"cxl-pool=0,nvme={120 * bb}:fifo", "--sweep", f"cxl-pool=0,{80 * bb}",
                                 "--warmup", "0.25", "--prices", str(prices), "--amortise-years", "2", "--json",
                                 "--placement", "inclusive"])  # the stack oracle's rule
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert "requests 0..14 (--warmup 0.25) warm the levels and are not counted, 45 counted" in out["measurement_rule"]
    p0, p5 = out["points"]
    for p, cap in ((p0, 0), (p5, 80)):
        want = stack_oracle(tr, [("pool", cap, "lru"), ("disk", 120, "fifo")], 15)
        assert [lv["hit_share"] for lv in p["levels"]] == pytest.approx(want[:2], abs=1e-12)
        assert p["hbm_share"] == pytest.approx(want[2], abs=1e-12)
    assert p0["levels"][0]["hit_share"] == 0 and p0["levels"][1]["hit_share"] > 0 and p5["levels"][0]["hit_share"] > 0
    # cost by hand: GPUs x held h x $3; pool 80 blocks x $8/GB and disk 120 blocks x $0.1/GB held for
    # the priced duration out of 2 years; energy (GPUs x 700 W + GB x W/GB) x held. The priced duration is
    # the span the instances are held (first arrival to last modelled completion), at least the busy time
    # (tests/test_priced_duration.py checks the span by hand)
    gpus = int(tr.header.meta["gpu"].get("gpus", 1))
    held, busy = p5["priced_duration_s"], p5["gpu_busy_s"]
    assert held >= busy
    gb_pool, gb_disk = 80 * bb / 1e9, 120 * bb / 1e9
    usd = gpus * held / 3600 * 3.0 + (gb_pool * 8.0 + gb_disk * 0.1) * held / (2 * 365.25 * 86400)
    joules = (gpus * 700.0 + gb_pool * 0.2 + gb_disk * 0.01) * held
    c = p5["cost"]
    assert c["gpu_hours"] == pytest.approx(gpus * held / 3600)
    assert c["usd_per_million_output_tokens"] == pytest.approx(usd * 1e6 / int(tr.output_tokens.sum()))
    assert c["joules_per_request"] == pytest.approx(joules / tr.n_requests)
    assert p5["throughput_output_tokens_per_s"] == pytest.approx(int(tr.output_tokens.sum()) / busy)
    # TPOT: the recorded step times scaled by busy / recorded busy; the median step by sorting
    steps = sorted(float(x) for x in tr.compute_ns)
    scale = busy * 1e9 / sum(steps)
    n = len(steps)
    med = (steps[(n - 1) // 2] + steps[n // 2]) / 2
    assert p5["tpot_step_ms"]["p50"] == pytest.approx(med * scale / 1e6)
    assert p5["tpot_step_ms"]["p99"] <= steps[-1] * scale / 1e6 + 1e-9
    # TPOT per request (queued: the batch it decoded in): from the end of its first token's step to the
    # end of its last step over its tokens after the first, on the recorded timeline, scaled the same way
    end = [int(s) + int(c) for s, c in zip(tr.start_ns, tr.compute_ns)]
    first_tok, last = {}, {}
    for e in iter_entries(tr, columns=("step", "request_id", "phase")):
        for st_, r, ph in zip(e["step"].tolist(), e["request_id"].tolist(), e["phase"].tolist()):
            last[r] = max(last.get(r, -1), st_)
            if ph == 0:
                first_tok[r] = max(first_tok.get(r, -1), st_)
    per = sorted((end[last[r]] - end[first_tok[r]]) / (int(tr.output_tokens[r]) - 1) * scale / 1e6
                 for r in range(15, tr.n_requests) if int(tr.output_tokens[r]) > 1)
    assert p5["tpot_ms"]["p50"] == pytest.approx((per[(len(per) - 1) // 2] + per[len(per) // 2]) / 2)
    # the table form prints the same columns
    t = CliRunner().invoke(cli, ["analyze", "capacity", str(tr.header.path), "--stack",
                                 f"cxl-pool=0,nvme={120 * bb}:fifo", "--sweep", f"cxl-pool=0,{80 * bb}",
                                 "--prices", str(prices)])
    assert t.exit_code == 0, t.output
    assert "TPOT p50" in t.output and "GPU-h" in t.output and "J/req" in t.output and "measurement:" in t.output


def test_prices_alone_price_the_single_tier_curve(stack_trace, tmp_path):
    """--prices without --stack, --policies or --sweep used to be ignored: it prices the one-level curve."""
    tr = stack_trace
    prices = _sweep_prices(tr, tmp_path)
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(tr.header.path), "--prices", str(prices),
                                 "--points", "4", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["prices"]["sha256"] == hashlib.sha256(prices.read_bytes()).hexdigest()
    assert out["sweep"]["level"] == "tier" and len(out["points"]) == len(out["sweep"]["capacity_bytes"]) >= 2
    assert all(p["cost"]["inputs"]["gpu_usd_per_hour"] == 3.0 for p in out["points"])
    # the one level is priced as DRAM, which this table does not price: said, not silently zero
    assert all(p["cost"]["capacity_usd"] is None and p["cost"]["notes"] for p in out["points"])
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml [")
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(tr.header.path), "--prices", str(bad)])
    assert r.exit_code == 2 and "cannot be read" in r.output and len(r.output.strip().splitlines()) == 1
