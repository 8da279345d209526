"""The cost section of every replay's results and the report's cost table (kvemu/replay/describe.py
cost_section, kvemu/prices.py, kvemu/report): figures computed by hand from the run's timeline and
the price table's numbers, an overridden table, bad price tables, results without a cost section,
and which medium each backend is priced as."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.backend_spec import KINDS, BackendSpec
from kvemu.cli import cli
from kvemu.integrity import READ_OPTIONS, write_results
from kvemu.prices import DEFAULT_PRICES, load_prices
from kvemu.replay.describe import tier_capacity_priced

TRACE = Path(__file__).resolve().parent.parent / "traces" / "chat-llama3-8b-offload.parquet"
YEAR_S = 365.25 * 86400

#: H100-SXM at $2/h and 500 W; the CXL pool at $10/GB and 0.5 W/GB (made-up round numbers)
PRICES = """
title = "test prices"
date = "2026-11-30"
[gpu.H100-SXM]
usd_per_hour = 2.0
watts = 500.0
source = "made up for the test"
date = "2026-11-30"
[medium.cxl]
profiles = ["cxl-pool"]
usd_per_gb = 10.0
watts_per_gb = 0.5
source = "made up for the test"
date = "2026-11-30"
"""


def _replay(tmp_path, name, *args):
    out = tmp_path / f"{name}.parquet"
    r = CliRunner().invoke(cli, ["replay", str(TRACE), "--backend", "vemu:cxl-pool", "--requests", "0:12",
                                 "--tier-capacity", "1GiB", "--out", str(out), *args])
    assert r.exit_code == 0, r.output
    table = pq.read_table(out, **READ_OPTIONS)
    return out, json.loads(table.schema.metadata[b"kvemu"]), table


def _by_hand(meta, table, usd_per_hour, watts, usd_per_gb, watts_per_gb, years):
    """The cost section's figures from the run's timeline, its rows and the prices, written out."""
    d = meta["duration_s"]
    gb = meta["tier"]["capacity_bytes"] / 1e9  # one instance, one tier
    requests = table.num_rows
    out_tokens = sum(table.column("output_tokens").to_pylist())
    gpu_hours = 1 * 1 * d / 3600  # 1 instance x 1 GPU (the trace's llama3-8b on one H100)
    usd = gpu_hours * usd_per_hour + gb * usd_per_gb * d / (years * YEAR_S)
    joules = watts * d + gb * watts_per_gb * d
    return {"gpu_hours": gpu_hours, "usd_per_million_output_tokens": usd * 1e6 / out_tokens,
            "usd_per_request": usd / requests, "joules_per_request": joules / requests}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cost")
    prices = tmp / "prices.toml"
    prices.write_text(PRICES)
    default = _replay(tmp, "default")
    given = _replay(tmp, "given", "--prices", str(prices), "--amortise-years", "2")
    return {"default": default, "given": given, "prices": prices, "tmp": tmp}


def test_cost_of_one_run_by_hand(runs):
    _, meta, table = runs["given"]
    c = meta["cost"]
    assert meta["duration_s"] > 0 and 0 < meta["tier"]["capacity_bytes"] <= 1 << 30
    want = _by_hand(meta, table, 2.0, 500.0, 10.0, 0.5, 2.0)
    for key, value in want.items():
        assert c[key] == pytest.approx(value, rel=1e-9), key
    assert meta["params"]["instances"] == 1 and meta["trace"]["gpu"]["gpus"] == 1
    assert c["figures"] == "modelled (price table 2026-11-30)"
    assert c["priced_as"] == "cxl-pool" and c["levels"][0]["medium"] == "cxl"
    assert c["prices"]["path"] == str(runs["prices"]) and c["inputs"]["amortise_years"] == 2.0
    assert c["inputs"]["gpu_usd_per_hour"] == 2.0 and c["levels"][0]["usd_per_gb"] == 10.0
    assert c["notes"] == []


def test_an_overridden_price_table_changes_the_figures_as_computed_by_hand(runs):
    # the shipped table's numbers, read here with the standard library (not kvemu's reader)
    shipped = tomllib.loads(DEFAULT_PRICES.read_text())
    gpu, cxl = shipped["gpu"]["H100-SXM"], shipped["medium"]["cxl"]
    _, meta, table = runs["default"]
    want = _by_hand(meta, table, gpu["usd_per_hour"], gpu["watts"], cxl["usd_per_gb"], cxl["watts_per_gb"], 3.0)
    for key, value in want.items():
        assert meta["cost"][key] == pytest.approx(value, rel=1e-9), key
    assert meta["cost"]["prices"]["date"] == shipped["date"] and meta["cost"]["inputs"]["amortise_years"] == 3.0
    # the two runs differ by their prices alone ($2 against the shipped $/GPU-hour)
    other = runs["given"][1]["cost"]
    assert other["usd_per_million_output_tokens"] != pytest.approx(meta["cost"]["usd_per_million_output_tokens"])


def test_a_gpu_the_table_does_not_price_leaves_its_figures_empty(runs, tmp_path):
    p = tmp_path / "p.toml"
    p.write_text(PRICES.replace("gpu.H100-SXM", "gpu.A100-80GB"))
    _, meta, _ = _replay(tmp_path, "unpriced", "--prices", str(p))
    c = meta["cost"]
    assert c["gpu_hours"] == pytest.approx(meta["duration_s"] / 3600)
    assert c["total_usd"] is None and c["usd_per_million_output_tokens"] is None and c["joules_per_request"] is None
    assert any("no price for GPU H100-SXM" in n for n in c["notes"])


@pytest.mark.parametrize("text, args, message", [
    ("not toml [", (), "cannot be read"),
    ("[gpu.X]\nusd_per_hour = 1.0\nwatts = 1.0\ndate = \"2026\"\n", (), "needs a source"),
    ("[gpu.X]\nusd_per_hour = -1.0\nwatts = 1.0\nsource = \"s\"\ndate = \"d\"\n", (), "usd_per_hour must be"),
    (PRICES, ("--amortise-years", "0"), "--amortise-years"),
])
def test_bad_cost_inputs_are_one_line_and_write_nothing(tmp_path, text, args, message):
    p = tmp_path / "p.toml"
    p.write_text(text)
    out = tmp_path / "out.parquet"
    r = CliRunner().invoke(cli, ["replay", str(TRACE), "--backend", "vemu:cxl-pool", "--requests", "0:4",
                                 "--out", str(out), "--prices", str(p), *args])
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert "Traceback" not in r.output and not out.exists()
    assert p.read_text() == text


def test_the_price_table_is_an_input_no_output_replaces(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text(PRICES)
    r = CliRunner().invoke(cli, ["replay", str(TRACE), "--backend", "vemu:cxl-pool", "--requests", "0:4",
                                 "--out", str(p), "--prices", str(p), "--force"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert p.read_text() == PRICES


def test_the_priced_tier_is_its_capacity_per_tier_or_what_it_held_over_all_layers():
    layers = {"replayed": [0, 8, 16, 24], "span": [8, 8, 8, 8], "of": 32}
    params = {"instances": 3, "sharing": "replicated", "reductions": {"layers": layers}}
    sized = {"capacity_bytes": 5 * 10**9, "capacity_from": "--tier-capacity"}
    assert tier_capacity_priced(sized, params)[0] == 15 * 10**9  # one tier per replicated instance
    assert tier_capacity_priced(sized, {**params, "sharing": "shared"})[0] == 5 * 10**9
    unsized = {"capacity_bytes": None, "resident_bytes": 1000, "resident_from": "arena slots"}
    nbytes, how = tier_capacity_priced(unsized, params)
    assert nbytes == 8000 and "all 32 layers" in how  # 4 replayed layers of 32 held 1000 bytes


@pytest.mark.parametrize("spec, profile", [
    ("dram", "local-dram"), ("numa:1", "remote-numa"), ("mmap:/dev/dax0.0", "cxl-pool"), ("mmap:/tmp/kv.bin", "nvme"),
    ("uring:/tmp/kv.bin,qd=8", "nvme"), ("emu:cxl-pool", "cxl-pool"), ("vemu:rdma-storage", "rdma-storage"),
])
def test_each_backend_is_priced_as_its_medium(spec, profile):
    assert BackendSpec.parse(spec).priced_profile() == profile


def test_a_profile_file_is_priced_as_its_name_and_every_kind_has_a_priced_medium(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text('name = "nvme"\nkind = "storage"\nlatency_ns = 60000.0\nbandwidth_gbps = 6.0\nconcurrency = 64\n')
    assert BackendSpec.parse(f"vemu:{f}").priced_profile() == "nvme"
    shipped = load_prices()
    for kind in KINDS.values():
        if not kind.emulated:
            assert shipped.medium_of(kind.priced_as) is not None, kind.name


def test_the_report_shows_cost_and_leaves_older_results_blank(runs):
    new, meta, table = runs["given"]
    old = runs["tmp"] / "old.parquet"
    m = dict(meta)
    del m["cost"]
    m.update(label="old", run_id="old0")
    write_results(old, table.replace_schema_metadata(None), {b"kvemu": json.dumps(m).encode()})
    runner = CliRunner()
    r = runner.invoke(cli, ["report", str(old), str(new), "--json"])
    assert r.exit_code == 0, r.output
    costs = {run["label"]: run["cost"] for run in json.loads(r.output)["runs"]}
    assert all(v is None for v in costs["old"].values())
    assert costs[meta["label"]]["usd_per_million_output_tokens"] == pytest.approx(
        meta["cost"]["usd_per_million_output_tokens"])
    assert costs[meta["label"]]["joules_per_request"] == pytest.approx(meta["cost"]["joules_per_request"])
    text = runner.invoke(cli, ["report", str(old), str(new)]).output
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("cost, modelled"))
    assert "$/M out" in lines[head] and "J/req" in lines[head]
    old_row = next(line for line in lines[head + 1:head + 3] if " old " in line)
    assert old_row.split()[2:6] == ["-", "-", "-", "-"]
    new_row = next(line for line in lines[head + 1:head + 3] if " old " not in line)
    assert f"{meta['cost']['usd_per_million_output_tokens']:.3f}" in new_row
    assert f"{meta['cost']['joules_per_request']:.0f}" in new_row
    assert "modelled (price table 2026-11-30)" in text


#: NVMe at $0.1/GB and 0.01 W/GB (made-up round numbers)
NVME_PRICES = """
[medium.nvme]
profiles = ["nvme"]
usd_per_gb = 0.1
watts_per_gb = 0.01
source = "made up for the test"
date = "2026-11-30"
"""

#: the test table with a medium for every level of the stack below (made-up round numbers)
STACK_PRICES = PRICES + """
[medium.dram]
profiles = ["local-dram"]
usd_per_gb = 4.0
watts_per_gb = 0.25
source = "made up for the test"
date = "2026-11-30"
""" + NVME_PRICES


def test_a_stack_run_prices_every_level_as_its_medium_by_hand(tmp_path):
    prices = tmp_path / "prices.toml"
    prices.write_text(STACK_PRICES)
    out = tmp_path / "stack.parquet"
    r = CliRunner().invoke(cli, ["replay", str(TRACE), "--requests", "0:12", "--prices", str(prices),
                                 "--amortise-years", "2", "--out", str(out), "--tiers",
                                 "vemu:local-dram|cap=1GiB;vemu:cxl-pool|cap=2GiB;vemu:nvme|cap=8GiB"])
    assert r.exit_code == 0, r.output
    table = pq.read_table(out, **READ_OPTIONS)
    meta = json.loads(table.schema.metadata[b"kvemu"])
    c, d = meta["cost"], meta["duration_s"]
    # by hand: 1 GiB at $4/GB, 2 GiB at $10/GB, 8 GiB at $0.1/GB, amortised over 2 years; one H100 at $2/h
    gib = (1 << 30) / 1e9
    levels = [(1 * gib, 4.0, 0.25), (2 * gib, 10.0, 0.5), (8 * gib, 0.1, 0.01)]
    level_usd = [gb * usd * d / (2 * YEAR_S) for gb, usd, _ in levels]
    usd = 2.0 * d / 3600 + sum(level_usd)
    joules = 500.0 * d + sum(gb * w * d for gb, _, w in levels)
    out_tokens = sum(table.column("output_tokens").to_pylist())
    assert [lv["usd"] for lv in c["levels"]] == pytest.approx(level_usd, rel=1e-9)
    assert [lv["medium"] for lv in c["levels"]] == ["dram", "cxl", "nvme"]
    assert [lv["level"] for lv in c["levels"]] == ["L1 vemu:local-dram", "L2 vemu:cxl-pool", "L3 vemu:nvme"]
    assert c["usd_per_million_output_tokens"] == pytest.approx(usd * 1e6 / out_tokens, rel=1e-9)
    assert c["usd_per_request"] == pytest.approx(usd / 12, rel=1e-9)
    assert c["joules_per_request"] == pytest.approx(joules / 12, rel=1e-9)
    assert c["gpu_hours"] == pytest.approx(d / 3600, rel=1e-9)
    assert c["capacity_bytes"] == 11 << 30 and c["priced_as"] == "local-dram + cxl-pool + nvme"


def test_a_private_level_is_priced_once_per_instance_a_shared_one_once():
    from kvemu.replay.describe import stack_capacities_priced

    levels = [{"level": 1, "backend": "dram", "capacity_bytes": 10, "sharing": s} for s in ("private", "shared")]
    for sharing, want in (("private", 30), ("shared", 10)):
        stack = {"levels": [lv for lv in levels if lv["sharing"] == sharing]}
        [held] = stack_capacities_priced(stack, {"instances": 3})
        assert (held.level, held.profile, held.capacity_bytes) == ("L1 dram", "local-dram", want)
