"""One pricing rule for every command (kvemu/prices.py run_cost): the same configuration, built as an
`analyze capacity` point and as a replay whose timeline agrees, gives the same $ per million output
tokens, and that figure is computed here by hand from the price table (read with the standard
library); remote DRAM is priced as DRAM plus its servers' and NICs' share; flash is priced for its
writes against its rated endurance; a run prices the capacity provisioned, not what it filled."""

from __future__ import annotations

import json
import tomllib
from collections import OrderedDict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.analysis import input_block_stream
from kvemu.capacity import Level, StackAnalysis
from kvemu.cli import cli
from kvemu.errors import ConfigError
from kvemu.prices import DEFAULT_PRICES, PRICED_DURATION_TOLERANCE, load_prices
from kvemu.profiles import resolve_profile
from kvemu.replay.describe import CostPiece, cost_section, tier_capacity_priced
from kvemu.schema import read_trace

TRACE = Path(__file__).resolve().parent.parent / "traces" / "chat-llama3-8b-offload.parquet"
YEAR_S = 365.25 * 86400
CAP = 8 << 30  # more than the trace's distinct KV (6.8 GiB): every block is written once, both ways
SHIPPED = tomllib.loads(DEFAULT_PRICES.read_text())


def _shipped_usd_per_gb(medium: str) -> float:
    """A medium's $/GB from the shipped table as a reader of the TOML adds it up: its own figure, or
    its parts', a part ``of`` another medium taking that medium's."""
    m = SHIPPED["medium"][medium]
    if "part" not in m:
        return m["usd_per_gb"]
    return sum(_shipped_usd_per_gb(p["of"]) if "of" in p else p["usd_per_gb"] for p in m["part"])


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory):
    """Per profile: the `analyze capacity` point of one level of CAP, and the replay of the whole
    trace on that profile with --tier-capacity CAP (virtual time, 2 of 32 layers)."""
    tmp = tmp_path_factory.mktemp("rule")
    tr = read_trace(TRACE)
    an = StackAnalysis(tr)
    out = {}
    for prof in ("rdma-storage", "nvme"):
        point = an.evaluate([Level("tier", resolve_profile(prof), CAP)], "lru", prices=load_prices(),
                            amortise_years=3.0)
        res = tmp / f"{prof}.parquet"
        r = CliRunner().invoke(cli, ["replay", str(TRACE), "--backend", f"vemu:{prof}", "--tier-capacity",
                                     str(CAP), "--layers", "2", "--out", str(res)])
        assert r.exit_code == 0, r.output
        out[prof] = (point, json.loads(pq.read_schema(res).metadata[b"kvemu"]), r.output)
    return tr, an, out


def _by_hand(tr, busy_s, usd_per_gb, written_gb, per_gb_written):
    """$/M output tokens: GPUs x hours x $/GPU-hour + GB x $/GB x time / 3 years + GB written x wear."""
    gpu = SHIPPED["gpu"][tr.header.meta["gpu"]["name"]]
    gpus = int(tr.header.meta["gpu"].get("gpus", 1))
    usd = (gpus * busy_s / 3600 * gpu["usd_per_hour"] + CAP / 1e9 * usd_per_gb * busy_s / (3 * YEAR_S)
           + written_gb * per_gb_written)
    return usd * 1e6 / int(tr.output_tokens.sum())


@pytest.mark.parametrize("prof", ["rdma-storage", "nvme"])
def test_the_same_configuration_costs_the_same_in_analyze_and_in_a_replay_over_the_same_span(both_ways, prof):
    tr, an, runs = both_ways
    point, meta, _ = runs[prof]
    busy = point["priced_duration_s"]
    # both price the span the instances are held (prices.priced_duration_s): the analysis's modelled span
    # is the replay's timeline within the stated tolerance, not to the ns; price the replay over the
    # analysis's span to compare the rule itself
    assert meta["duration_s"] != busy and busy == pytest.approx(meta["duration_s"], rel=PRICED_DURATION_TOLERANCE)
    c = meta["cost"]
    piece = CostPiece(load_prices(), 3.0, c["inputs"]["gpu"], c["inputs"]["gpus"], c["inputs"]["requests"],
                      c["inputs"]["output_tokens"], prof)
    replayed = cost_section(piece, {**meta, "duration_s": busy})
    analysed = point["cost"]
    assert replayed["usd_per_million_output_tokens"] == pytest.approx(analysed["usd_per_million_output_tokens"],
                                                                      rel=1e-12)
    # both price the capacity provisioned, CAP, not what the tier held
    assert analysed["capacity_bytes"] == replayed["capacity_bytes"] == CAP
    assert meta["tier"]["resident_bytes"] * 16 < CAP  # it held less: 2 of 32 layers, scaled
    # by hand: written bytes = every distinct block once (CAP holds them all), all layers
    written_gb = an.unique * an.block_bytes / 1e9
    m = SHIPPED["medium"][prof]
    per_written = (_shipped_usd_per_gb(prof) / (m["dwpd"] * 365.25 * m["warranty_years"]) if "dwpd" in m else 0.0)
    want = _by_hand(tr, busy, _shipped_usd_per_gb(prof), written_gb, per_written)
    assert analysed["usd_per_million_output_tokens"] == pytest.approx(want, rel=1e-9)
    # and the replay's own figure is the same rule over its own timeline
    assert c["usd_per_million_output_tokens"] == pytest.approx(
        _by_hand(tr, meta["duration_s"], _shipped_usd_per_gb(prof), written_gb, per_written), rel=1e-9)


def test_remote_dram_is_priced_as_dram_plus_its_servers_and_nics_share(both_ways):
    prices = load_prices()
    rdma, dram = prices.medium_of("rdma-storage"), prices.medium_of("local-dram")
    parts = {p["name"]: p for p in SHIPPED["medium"]["rdma-storage"]["part"]}
    assert set(parts) == {"dram", "server", "nic"} and parts["dram"]["of"] == "dram"
    want = SHIPPED["medium"]["dram"]["usd_per_gb"] + parts["server"]["usd_per_gb"] + parts["nic"]["usd_per_gb"]
    assert rdma.usd_per_gb == pytest.approx(want) and rdma.usd_per_gb > dram.usd_per_gb
    assert rdma.usd_per_gb_written is None  # DRAM does not wear
    for medium in prices.media.values():  # every part of every medium names its source and date
        for p in medium.parts:
            assert p.source.strip() and p.date.strip(), (medium.name, p.name)
    # a replay on it says so: capacity, its parts, no wear
    _, meta, output = both_ways[2]["rdma-storage"]
    lv = meta["cost"]["levels"][0]
    assert lv["medium"] == "rdma-storage" and [p["name"] for p in lv["parts"]] == ["dram", "server", "nic"]
    assert lv["wear_usd"] == 0.0 and "capacity priced: tier 8.0 GiB as rdma-storage" in output


def test_flash_wear_is_the_bytes_written_against_the_drives_rated_endurance(both_ways):
    tr, an, runs = both_ways
    _, meta, output = runs["nvme"]
    m = SHIPPED["medium"]["nvme"]
    assert "PM9D3a" in m["source"] and m["dwpd"] == 1.0 and m["warranty_years"] == 5.0
    # the replay's stores, 2 of 32 layers, scaled to all: every distinct block once
    layers = meta["params"]["reductions"]["layers"]
    written = meta["ops"]["store"]["bytes"] * layers["of"] / len(layers["replayed"])
    assert written == an.unique * an.block_bytes
    lv = meta["cost"]["levels"][0]
    want = written / 1e9 * m["usd_per_gb"] / (1.0 * 365.25 * 5.0)
    assert lv["wear_usd"] == pytest.approx(want, rel=1e-12) and meta["cost"]["wear_usd"] == pytest.approx(want)
    # KV offload writes far more than it keeps: the wear outweighs the capacity's amortised cost
    assert lv["wear_usd"] > 10 * lv["usd"]
    assert "flash wear $" in output


def test_analyze_counts_a_levels_writes_as_its_misses_by_a_brute_force_lru(tmp_path):
    """A level smaller than the distinct KV under the inclusive rule: each reference it misses writes its block,
    so blocks are written again after eviction; a plain LRU over the stream counts them."""
    tr = read_trace(TRACE)
    an = StackAnalysis(tr)
    k = an.unique // 5
    ids, _ = input_block_stream(tr)
    lru, misses = OrderedDict(), 0
    for b in ids.tolist():
        if b in lru:
            lru.move_to_end(b)
            continue
        misses += 1
        lru[b] = None
        if len(lru) > k:
            lru.popitem(last=False)
    assert misses > an.unique  # evicted blocks written again
    p = an.evaluate([Level("disk", resolve_profile("nvme"), k * an.block_bytes)], "lru", prices=load_prices(),
                    placement="inclusive")
    lv = p["cost"]["levels"][0]
    assert lv["written_gb"] == pytest.approx(misses * an.block_bytes / 1e9, rel=1e-12)
    # a level of no capacity stores nothing
    p0 = an.evaluate([Level("disk", resolve_profile("nvme"), 0)], "lru", prices=load_prices())
    assert p0["cost"]["levels"][0]["written_gb"] == 0 and p0["cost"]["wear_usd"] == 0


def test_a_replay_prices_the_capacity_provisioned_not_the_chunks_it_rounded_to():
    params = {"instances": 2, "sharing": "replicated", "reductions": {"layers": {"replayed": [0], "of": 4}}}
    tier = {"capacity_bytes": 900, "provisioned_bytes": 1000, "capacity_from": "--tier-capacity"}
    assert tier_capacity_priced(tier, params) == (2000, "provisioned (--tier-capacity) x 2 tier(s)")
    unbounded = {"capacity_bytes": None, "provisioned_bytes": None, "resident_bytes": 10, "resident_from": "x"}
    nbytes, how = tier_capacity_priced(unbounded, params)
    assert nbytes == 40 and how.startswith("unbounded, nothing provisioned")


BASE = 'title = "t"\ndate = "d"\n[medium.dram]\nusd_per_gb = 10.0\nwatts_per_gb = 0.1\nsource = "s"\ndate = "d"\n'


@pytest.mark.parametrize("extra, message", [
    ('[medium.r]\nsource = "s"\ndate = "d"\n[[medium.r.part]]\nname = "dram"\nof = "nosuch"\n', "of must name"),
    ('[medium.r]\nsource = "s"\ndate = "d"\n[[medium.r.part]]\nname = "x"\nusd_per_gb = 1.0\nwatts_per_gb = 0.0\n'
     'date = "d"\n', "needs a source"),
    ('[medium.f]\nusd_per_gb = 1.0\nwatts_per_gb = 0.0\ndwpd = 1.0\nsource = "s"\ndate = "d"\n', "together"),
])
def test_bad_parts_and_endurance_are_refused_in_one_line(tmp_path, extra, message):
    p = tmp_path / "p.toml"
    p.write_text(BASE + extra)
    with pytest.raises(ConfigError, match=message):
        load_prices(p)


def test_a_composed_medium_adds_up_its_parts(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text(BASE + '[medium.r]\nprofiles = ["rdma-storage"]\nsource = "s"\ndate = "d"\n'
                 '[[medium.r.part]]\nname = "dram"\nof = "dram"\n'
                 '[[medium.r.part]]\nname = "server"\nusd_per_gb = 2.5\nwatts_per_gb = 0.05\nsource = "s"\ndate = "d"\n')
    r = load_prices(p).medium_of("rdma-storage")
    assert (r.usd_per_gb, r.watts_per_gb) == pytest.approx((12.5, 0.15))


def test_flash_behind_rdma_is_priced_as_flash_with_its_servers_share_and_wears_as_its_drives():
    prices = load_prices()
    f, nvme = prices.medium_of("storage-rdma"), prices.medium_of("nvme")
    parts = {p["name"]: p for p in SHIPPED["medium"]["rdma-flash"]["part"]}
    assert parts["nvme"]["of"] == "nvme"
    assert f.usd_per_gb == pytest.approx(nvme.usd_per_gb + parts["server"]["usd_per_gb"] + parts["nic"]["usd_per_gb"])
    assert f.usd_per_gb < prices.medium_of("rdma-storage").usd_per_gb / 100  # flash, not DRAM
    # the drives wear, not the servers: the same wear per GB written as the drives alone
    assert f.usd_per_gb_written == pytest.approx(nvme.usd_per_gb / (1.0 * 365.25 * 5.0))
