"""Hostile inputs, fourth round (issue 44 items 2, 3, 5, 6, 7): no input is a tier's file, no
Infinity or NaN in JSON, one typed validation for the new inputs, typed errors from the Python API,
sweeps that lock their folder and leave none empty, messages that cannot read as a contradiction.
Each refusal is one line on stderr, exit 2, and nothing written or destroyed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from test_hostile import _refused  # one line on stderr, exit 2

PRICES = Path(__file__).resolve().parents[1] / "kvemu" / "data" / "prices.toml"


def _run(args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- item 2: no input is ever a tier's file --------------------------------------------------------

@pytest.fixture
def big_prices(tmp_path):
    """The shipped price table, padded with a comment to 6 MB: large enough for a one-layer arena,
    so that a tier mapping it with size=existing would write into it."""
    p = tmp_path / "prices.toml"
    p.write_text(PRICES.read_text() + "#" + "x" * 6_000_000 + "\n")
    return p


@pytest.mark.parametrize("how", ["backend", "tiers"])
@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink"])
def test_a_tier_file_that_is_the_price_table_is_refused(chat_trace, tmp_path, big_prices, how, alias):
    target = big_prices
    if alias == "symlink":
        target = tmp_path / "tier.bin"
        target.symlink_to(big_prices)
    elif alias == "hardlink":
        target = tmp_path / "tier.bin"
        os.link(big_prices, target)
    tier = f"mmap:{target},size=existing"
    before = _listing(tmp_path)
    args = ["replay", chat_trace, "--prices", big_prices, "--layers", "1", "--out", tmp_path / "r.parquet"]
    args += ["--backend", tier] if how == "backend" else ["--tiers", f"dram|cap=1GiB;{tier}|cap=1GiB"]
    line = _refused(_run(args), "is one of this command's inputs", "a tier writes into its file: give the tier "
                                                                   "another file")
    assert str(big_prices) in line
    assert _listing(tmp_path) == before  # the table is whole, no results


def test_a_tier_file_that_is_the_trace_or_the_output_is_refused(chat_trace, tmp_path):
    trace = tmp_path / "t.parquet"
    trace.write_bytes(chat_trace.read_bytes())
    out = tmp_path / "r.parquet"
    out.write_bytes(b"previous results")
    before = _listing(tmp_path)
    _refused(_run(["replay", trace, "--backend", f"mmap:{trace},size=existing", "--layers", "1", "--out",
                   tmp_path / "r2.parquet"]), "is one of this command's inputs")
    _refused(_run(["replay", trace, "--backend", f"uring:{out},size=existing", "--layers", "1", "--out", out,
                   "--force"]), "is one of this command's inputs")  # the tier's file is read: --out may not replace it
    assert _listing(tmp_path) == before


def test_two_levels_on_one_file_are_refused(chat_trace, tmp_path):
    f = tmp_path / "tier.bin"
    f.write_bytes(b"\0" * 4096)
    link = tmp_path / "other.bin"
    link.symlink_to(f)
    _refused(_run(["replay", chat_trace, "--tiers", f"dram|cap=1GiB;mmap:{f},size=existing|cap=1GiB;"
                   f"mmap:{link},size=existing|cap=1GiB", "--layers", "1", "--out", tmp_path / "r.parquet"]),
             "each tier writes into a file of its own")


def test_each_spec_names_the_files_it_writes():
    from kvemu.backend_spec import BackendSpec

    assert BackendSpec.parse("mmap:/x/t.bin,size=existing").files_written(3) == ["/x/t.bin", "/x/t.bin.1",
                                                                                 "/x/t.bin.2"]
    assert BackendSpec.parse("uring:/x/t.bin").files_written(1) == ["/x/t.bin"]
    assert [BackendSpec.parse(s).files_written() for s in ("dram", "emu:/x/p.toml", "vemu:nvme", "numa:0")] \
        == [[], [], [], []]


# --- JSON never holds Infinity or NaN; absurd periods refused --------------------------------------

@pytest.mark.parametrize("years", ["1e-300", "1e-320", "0.001"])
def test_an_absurd_amortisation_period_is_refused(chat_trace, tmp_path, years):
    _refused(_run(["replay", chat_trace, "--backend", "vemu:nvme", "--amortise-years", years, "--out",
                   tmp_path / "r.parquet"]), "--amortise-years must be a number of years from 0.01 to 100, got")
    _refused(_run(["analyze", "capacity", chat_trace, "--stack", "local-dram=1GiB", "--amortise-years", years,
                   "--json"]), "--amortise-years must be >= 0.01 and <= 100, got")
    assert list(tmp_path.iterdir()) == []


def test_the_shortest_period_gives_finite_strict_json(chat_trace):
    res = _run(["analyze", "capacity", chat_trace, "--stack", "local-dram=1GiB", "--amortise-years", "0.01",
                "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    costs = [p["cost"]["capacity_usd"] for p in doc["points"] if p.get("cost")]
    assert costs and all(0 <= c < 1e6 for c in costs)


def test_json_documents_and_metadata_are_strict():
    from kvemu import jsontext
    from kvemu.errors import OutputError

    # by hand: NaN and infinities are null in a printed document, the rule of report --json
    assert jsontext.document({"a": [1.5, float("nan")], "b": float("-inf")}) == '{"a": [1.5, null], "b": null}'
    with pytest.raises(OutputError, match=r"r.parquet: results metadata: not written: x.y\[1\] is inf"):
        jsontext.dumps({"x": {"y": [0, float("inf")]}}, "r.parquet: results metadata")
    assert jsontext.dumps({"x": [1, 2.5]}, "m") == '{"x": [1, 2.5]}'


def test_capacity_json_without_a_gpu_model_has_null_not_nan(chat_trace):
    # every analyze ... --json is parsed with a strict parser: no NaN or Infinity constant anywhere
    for args in (["analyze", "capacity", chat_trace, "--json"], ["trace", "info", chat_trace, "--json"],
                 ["analyze", "breakeven", chat_trace, "--json"]):
        res = _run(args)
        assert res.exit_code == 0, res.output
        json.loads(res.output, parse_constant=lambda c: pytest.fail(f"{c} in {args[:2]}"))
