"""Feasible configurations (kvemu/feasibility.py, the price table's limits): device counts and switch
choice hand-computed for a few configurations, the shipped limits each with a source, an unbuildable
point flagged in analyze capacity's output, and bad limits refused in one line."""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import make_workload, record
from kvemu.cli import cli
from kvemu.errors import ConfigError
from kvemu.feasibility import check_feasible
from kvemu.prices import DEFAULT_PRICES, load_prices

GiB, TiB = 2**30, 2**40

# a small table written here, so that the oracles below do not read the shipped figures back
TABLE = '''title = "t"
date = "d"
[medium.mem]
profiles = ["local-dram"]
usd_per_gb = 10.0
watts_per_gb = 0.1
source = "s"
date = "d"
[medium.mem.device]
name = "dimm"
capacity_gib = 64
bandwidth_gbps = 40.0
per_host = 16
source = "s"
date = "d"
[medium.pool]
profiles = ["cxl-pool"]
usd_per_gb = 8.0
watts_per_gb = 0.1
source = "s"
date = "d"
[medium.pool.device]
name = "card"
capacity_gib = 512
bandwidth_gbps = 36.0
per_host = 8
source = "s"
date = "d"
[[medium.pool.switch]]
name = "big"
hosts = 32
capacity_gb = 48000
bandwidth_gbps = 4000
source = "s"
date = "d"
[[medium.pool.switch]]
name = "small"
hosts = 16
capacity_gb = 8000
bandwidth_gbps = 1024
source = "s"
date = "d"
[medium.pool.compression]
ratio = 4.0
source = "s"
date = "d"
[medium.store]
profiles = ["rdma-storage"]
usd_per_gb = 20.0
watts_per_gb = 0.1
source = "s"
date = "d"
[medium.store.device]
name = "server"
capacity_gb = 4000
bandwidth_gbps = 50.0
source = "s"
date = "d"
'''


@pytest.fixture
def table(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text(TABLE)
    return load_prices(p)


def test_device_counts_and_switch_choice_by_hand(table):
    pool, mem, store = table.media["pool"], table.media["mem"], table.media["store"]
    # 4 TiB per 4-GPU instance: 4096 / 512 = 8 cards, exactly the 8 a host attaches: direct
    f = check_feasible(pool, 4 * TiB, 1, 4)
    assert (f.ok, f.devices, f.switch, f.devices_per_host) == (True, 8, None, 8)
    # 4 TiB + 1 byte: a ninth card, over the host's 8: a switch; 9 x 512 GiB = 4.95e12 B fits the small
    # one (8e12 B), listed second in the file: the smallest that holds it is chosen
    f = check_feasible(pool, 4 * TiB + 1, 1, 4)
    assert (f.ok, f.devices, f.switch, f.switches) == (True, 9, "small", 1)
    # 8 TiB = 8.796e12 B: 16 cards, more than 8 per host, and more than the small switch's 8e12 B: the big one
    f = check_feasible(pool, 8 * TiB, 1, 4)
    assert (f.ok, f.devices, f.switch) == (True, 16, "big")
    assert "needs a switch" in f.reason and "more than the 8 a host attaches" in f.reason
    # 8 x 4-GPU instances, 2 TiB each, not shared: 4 cards each, 2 instances per 8-GPU host = 8 per host: direct
    f = check_feasible(pool, 2 * TiB, 8, 4)
    assert (f.ok, f.devices, f.switch, f.hosts, f.devices_per_host) == (True, 32, None, 4, 8)
    # one 8 TiB pool shared by 8 x 4-GPU instances (4 hosts): 16 cards behind one big switch
    f = check_feasible(pool, 8 * TiB, 8, 4, shared=True)
    assert (f.ok, f.devices, f.switch, f.switches, f.hosts) == (True, 16, "big", 1, 4)
    # a small pool shared by two hosts still needs a switch (joining hosts), the small one
    f = check_feasible(pool, 1 * TiB, 4, 4, shared=True)
    assert (f.ok, f.devices, f.switch) == (True, 2, "small")
    # 48 TiB = 52.8e12 B, over the big switch's 48e12 B: not buildable
    f = check_feasible(pool, 48 * TiB, 1, 4)
    assert (f.ok, f.devices, f.switch) == (False, 96, None) and f.reason.startswith("not buildable")
    # DRAM: 1 TiB = 16 DIMMs of 64 GiB, the host's 16 slots; 1 TiB + 64 GiB = 17: no switch for DRAM
    assert check_feasible(mem, 1 * TiB, 1, 8).ok
    f = check_feasible(mem, 1 * TiB + 64 * GiB, 1, 8)
    assert (f.ok, f.devices) == (False, 17) and "16 a host attaches" in f.reason
    assert not check_feasible(mem, 64 * GiB, 2, 8, shared=True).ok  # DRAM is not shared across hosts
    # network-attached servers: ceil(10e12 / 4e12) = 3 servers, no host limit, 3 x 50 GB/s
    f = check_feasible(store, 10 * 10**12, 4, 4, shared=True)
    assert (f.ok, f.devices, f.switch, f.bandwidth_gbps) == (True, 3, None, 150.0)
    assert check_feasible(pool, 0, 1, 4).devices == 0


def test_compression_divides_the_physical_bytes_only_when_asked(table):
    pool = table.media["pool"]
    # 8 TiB at 4x: 2 TiB physical, 4 cards, direct; without it, 16 and a switch
    f = check_feasible(pool, 8 * TiB, 1, 4, compression=True)
    assert (f.devices, f.switch, f.physical_bytes, f.compression) == (4, None, 2 * TiB, 4.0)
    assert check_feasible(pool, 8 * TiB, 1, 4).switch == "big"
    # priced per logical GB under the ratio: $8 / 4
    c = table.with_compression()
    assert c.media["pool"].usd_per_gb == pytest.approx(2.0) and c.media["mem"].usd_per_gb == 10.0
    assert c.compressed == ("pool",)


def test_the_shipped_limits_each_name_a_source_and_a_date():
    prices = load_prices()
    raw = tomllib.loads(DEFAULT_PRICES.read_text())["medium"]
    for name, m in prices.media.items():
        assert m.device is not None, name  # every shipped medium carries its physical unit
        assert m.device.source.strip() and m.device.date.strip() and "http" in m.device.source, name
        assert m.device.capacity_bytes > 0 and m.device.bandwidth_gbps > 0
        for sw in m.switches:
            assert sw.source.strip() and sw.date.strip() and "http" in sw.source, (name, sw.name)
        if m.compression:
            assert m.compression.source.strip() and "http" in m.compression.source
        assert set(raw[name]).issuperset({"device"})
    cxl = prices.media["cxl"]
    # the switches the issue names, with their published figures
    by = {w.name.split(" (")[0]: w for w in cxl.switches}
    assert (by["Marvell Structera S 20256"].hosts, by["Marvell Structera S 20256"].capacity_bytes) == (16, 8 * 10**12)
    assert (by["Marvell Structera S 30260"].capacity_bytes, by["Marvell Structera S 30260"].bandwidth_gbps) \
        == (48 * 10**12, 4000)
    assert cxl.compression.ratio == 3.64 and "3.64" in cxl.compression.source
    # the example on the shipped table: 8 TiB per 4-GPU instance = 16 x 512 GiB, over the 8 a
    # host attaches, over the 20256's 8 TB: the 30260
    f = check_feasible(cxl, 8 * TiB, 1, 4)
    assert (f.devices, f.switch) == (16, "Marvell Structera S 30260")


@pytest.mark.parametrize("extra, message", [
    ('[medium.x.device]\nname = "d"\ncapacity_gib = 1\nbandwidth_gbps = 1.0\ndate = "d"\n', "needs a source"),
    ('[medium.x.device]\nname = "d"\ncapacity_gib = 1\ncapacity_gb = 1\nbandwidth_gbps = 1.0\nsource = "s"\n'
     'date = "d"\n', "one of capacity_gib"),
    ('[medium.x.device]\nname = "d"\ncapacity_gib = 1\nbandwidth_gbps = 1.0\nper_host = 2.5\nsource = "s"\n'
     'date = "d"\n', "whole number"),
    ('[medium.x.device]\nname = "d"\ncapacity_gib = -1\nbandwidth_gbps = 1.0\nsource = "s"\ndate = "d"\n',
     "capacity_gib must be"),
    ('[[medium.x.switch]]\nname = "s"\nhosts = 4\ncapacity_gb = 1\nbandwidth_gbps = 1\nsource = "s"\ndate = "d"\n',
     "give \\[medium.x.device\\]"),
    ('[medium.x.compression]\nratio = 0.5\nsource = "s"\ndate = "d"\n', "ratio must be"),
    ('[medium.x.device]\nname = "d"\ncapacity_gib = 1\nbandwidth_gbps = 1.0\nsource = "s"\ndate = "d"\nlanes = 3\n',
     "unknown keys lanes"),
])
def test_bad_limits_are_refused_in_one_line(tmp_path, extra, message):
    p = tmp_path / "p.toml"
    p.write_text('[medium.x]\nusd_per_gb = 1.0\nwatts_per_gb = 0.0\nsource = "s"\ndate = "d"\n' + extra)
    with pytest.raises(ConfigError, match=message) as e:
        load_prices(p)
    assert "\n" not in str(e.value)


def test_bad_arguments_are_refused(table):
    with pytest.raises(ConfigError, match="instances"):
        check_feasible(table.media["pool"], TiB, 0, 4)
    with pytest.raises(ConfigError, match="capacity_bytes"):
        check_feasible(table.media["pool"], -1, 1, 4)


@pytest.fixture
def trace(tmp_path):
    n = 12
    rng = np.random.default_rng(3)
    hashes = [list(range(int(rng.integers(1, 6)))) for _ in range(n)]
    w = make_workload([i * 50.0 for i in range(n)], [64 * len(h) for h in hashes], [2] * n, hashes)
    return record(w, tmp_path / "t.parquet")


def test_analyze_capacity_flags_an_unbuildable_point(trace, tmp_path):
    p = tmp_path / "p.toml"
    p.write_text(TABLE)
    args = ["analyze", "capacity", str(trace), "--stack", "local-dram=64GiB,cxl-pool=0", "--sweep",
            "cxl-pool=2TiB,8TiB,64TiB", "--prices", str(p)]
    r = CliRunner().invoke(cli, args + ["--json"])
    assert r.exit_code == 0, r.output
    pts = json.loads(r.output)["points"]
    cxl = [next(f for f in pt["feasibility"] if f["level"] == "cxl-pool") for pt in pts]
    # hand: 2 TiB = 4 cards direct; 8 TiB = 16 cards, big switch; 64 TiB = 128 cards > 48e12 B: unbuildable
    assert [(f["devices"], f["switch"], f["ok"]) for f in cxl] == [(4, None, True), (16, "big", True),
                                                                   (128, None, False)]
    assert [pt["buildable"] for pt in pts] == [True, True, False]
    dram = pts[0]["feasibility"][0]
    assert (dram["level"], dram["devices"]) == ("local-dram", math.ceil(64 / 64))
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0
    row = next(line for line in text.output.splitlines() if line.strip().startswith("64.0 TiB"))
    assert "cxl-pool NOT BUILDABLE" in row
    assert "cxl-pool 64.0 TiB: not buildable" in text.output
    assert "cxl-pool 8.0 TiB: " in text.output and "needs a switch (1 x big" in text.output
    # --compression: 8 TiB at 4x is 4 cards, direct
    r = CliRunner().invoke(cli, args + ["--json", "--compression"])
    pts = json.loads(r.output)["points"]
    assert next(f for f in pts[1]["feasibility"] if f["level"] == "cxl-pool")["devices"] == 4


def test_compression_without_a_declaring_medium_is_one_line_exit_2(trace, tmp_path):
    p = tmp_path / "p.toml"
    p.write_text(TABLE.split("[medium.pool.compression]")[0] + TABLE.split('ratio = 4.0\nsource = "s"\ndate = "d"\n')[1])
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(trace), "--stack", "cxl-pool=1TiB", "--prices", str(p),
                                 "--compression"])
    assert r.exit_code == 2 and "declares inline compression" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_the_documented_gpus_per_host_and_the_example_are_the_codes():
    from kvemu import feasibility

    doc = " ".join((Path(__file__).resolve().parent.parent / "docs" / "analysis.md").read_text().split())
    assert re.search(r"with (\d+) GPUs per host when none is given", doc).group(1) == \
        str(feasibility.DEFAULT_GPUS_PER_HOST)
    # the worked example's figures: 8 TiB / 512 GiB = 16 expanders; 4 TiB = 8; 64 TiB = 128, unbuildable
    cxl = load_prices().media["cxl"]
    assert "= 16 expanders" in doc and check_feasible(cxl, 8 * TiB, 1, 4).devices == 16
    assert check_feasible(cxl, 4 * TiB, 1, 4).switch is None
    assert not check_feasible(cxl, 64 * TiB, 1, 4).ok
    f = check_feasible(cxl, 8 * TiB, 1, 4, compression=True)
    assert "5 expanders, attached directly" in doc and (f.devices, f.switch) == (5, None)


def test_a_bad_limit_through_the_cli_is_one_line_exit_2(trace, tmp_path):
    p = tmp_path / "p.toml"
    p.write_text(TABLE.replace("per_host = 8\n", "per_host = 0\n"))
    before = p.read_bytes()
    r = CliRunner().invoke(cli, ["analyze", "capacity", str(trace), "--stack", "cxl-pool=1TiB", "--prices", str(p)])
    assert r.exit_code == 2 and "[medium.pool.device] per_host must be a number from 1" in r.output
    assert len(r.output.strip().splitlines()) == 1 and p.read_bytes() == before
