"""The report's trace sections on real traces and real runs: break-even bandwidth with each run's
tier GB/s against it, and the LRU capacity curve found through --trace or the recorded path."""
import base64
import csv
import io
import json
import re
import shutil
import struct
import zlib

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu import analysis, plots
from kvemu.cli import cli
from kvemu.realrun import record_tiny
from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.replay import ReplayOptions, WindowOptions, replay
from kvemu.report import CAPACITY_POINTS, build_report, html_page, render_json, render_table
from kvemu.schema import METADATA_KEY, file_sha256, read_header, read_trace

MATPLOTLIB_MISSING = plots.unavailable_reason()
WORKLOAD = "synthetic:chat:sessions=3,turns=3"


def _record(path, workload=WORKLOAD):
    path.parent.mkdir(parents=True, exist_ok=True)
    record(workload, "llama3-8b", path, RecordOptions.from_flat(hbm_kv_gib=0.5, show_progress=False))
    return path


def _replay(trace, backend, out):
    replay(trace, backend, ReplayOptions(window=WindowOptions(layers=2)), out=out, warn=lambda m: None)
    return str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A chat trace with prefix hits loaded back from the tier (offload, small HBM), replayed on
    DRAM and on an emulated CXL pool in virtual time."""
    folder = tmp_path_factory.mktemp("sections")
    trace = _record(folder / "traces" / "chat.parquet")
    dram = _replay(trace, "dram", folder / "dram.parquet")
    cxl = _replay(trace, "vemu:cxl-pool", folder / "cxl.parquet")
    return trace, dram, cxl


def _with_ops(src, dst, **gbps):
    """A copy of results file ``src`` whose recorded GB/s per KV operation is replaced (None:
    the run did not do that operation)."""
    table = pq.read_table(src)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    for op, value in gbps.items():
        meta["ops"][op]["gbps"] = value
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta)}), dst)
    return str(dst)


# --------------------------------------------------------------------------------------------
# Break-even


def test_breakeven_equals_analysis_for_the_traces_model_and_gpu(runs):
    trace, dram, cxl = runs
    report = build_report([dram, cxl])
    (group,) = report.groups
    be = group.breakeven
    expected = analysis.breakeven_gbps(analysis.timing_from_meta(read_header(trace).meta))
    assert [p["prefix_tokens"] for p in expected] == list(analysis.BREAKEVEN_PREFIXES)
    assert [dict(p) for p in be.prefixes] == expected
    assert be.model == "llama3-8b" and be.gpu["name"] == "H100-SXM"

    # each run's tier GB/s is its measured load GB/s, and the verdicts follow from it
    for row, verdict in zip(group.rows, be.verdicts):
        meta = json.loads(pq.read_schema(row.run.path).metadata[METADATA_KEY])
        measured = meta["ops"]["load"]["gbps"]
        assert (verdict.gbps, verdict.op) == (measured, "load")
        assert list(verdict.wins.values()) == [measured >= p["breakeven_gbps"] for p in expected]

    text = render_table(report)
    assert max(len(line) for line in text.splitlines()) <= 100
    for p in expected:
        assert re.search(rf"^\s*{p['prefix_tokens']:,}\s.*\s{p['breakeven_gbps']:.2f}$", text, re.M)

    section = json.loads(render_json(report))["traces"][file_sha256(trace)]["breakeven"]
    assert [p["breakeven_gbps"] for p in section["prefixes"]] == [
        p["breakeven_gbps"] for p in expected]
    assert [r["label"] for r in section["runs"]] == [row.run.label for row in group.rows]


def test_verdict_flips_at_the_breakeven_bandwidth(runs, tmp_path):
    trace, dram, _ = runs
    be = analysis.breakeven_gbps(analysis.timing_from_meta(read_header(trace).meta))
    by_prefix = {p["prefix_tokens"]: p["breakeven_gbps"] for p in be}
    between = (by_prefix[4096] + by_prefix[8192]) / 2  # loses up to 4k tokens, wins from 8k
    made_up = _with_ops(dram, tmp_path / "between.parquet", load=between)
    slow = _with_ops(dram, tmp_path / "slow.parquet", load=0.5 * min(by_prefix.values()))
    resident = _with_ops(dram, tmp_path / "reads.parquet", load=None, read=between)

    for path, wins_from, op in ((made_up, 8192, "load"), (slow, None, "load"),
                                (resident, 8192, "read")):
        report = build_report([path])
        (verdict,) = report.groups[0].breakeven.verdicts
        assert verdict.op == op and verdict.gbps == pytest.approx(between if wins_from else
                                                                 0.5 * min(by_prefix.values()))
        # reuse wins wherever the tier is at least as fast as the break-even (which need not fall with
        # the prefix: short prefills are less efficient per token); it wins *from* 8k at every longer one
        gbps = between if wins_from else 0.5 * min(by_prefix.values())
        assert verdict.wins == {p: gbps >= b for p, b in by_prefix.items()}
        assert not any(verdict.wins[p] for p in (2048, 4096)) and all(verdict.wins[p] for p in by_prefix if p >= 8192) \
            if wins_from else not any(verdict.wins.values())
        assert verdict.wins_from_tokens == wins_from
        (line,) = [ln for ln in render_table(report).splitlines() if ln.startswith("* ") and
                   f" {op} " in ln]
        cells = line.split(f" {op} ")[1].split()
        assert cells[:8] == ["yes" if verdict.wins[p] else "no" for p in sorted(by_prefix)]
        assert cells[8:] == (["from", "8k"] if wins_from else ["never"])
        (row,) = json.loads(render_json(report))["runs"]
        assert row["breakeven"] == {"tier_gbps": pytest.approx(verdict.gbps), "tier_op": op,
                                    "reuse_wins_from_tokens": wins_from}


def test_a_real_run_trace_has_no_breakeven_but_a_capacity_curve(tmp_path):
    trace = tmp_path / "tiny.parquet"
    record_tiny(trace)
    report = build_report([_replay(trace, "dram", tmp_path / "tiny-dram.parquet")])
    (group,) = report.groups
    assert group.breakeven is None and "no GPU compute model" in group.breakeven_note
    assert group.capacity is not None and group.capacity.ttft is None
    text = " ".join(render_table(report).split())
    assert "break-even: not available" in text and "no modelled TTFT" in text


# --------------------------------------------------------------------------------------------
# Capacity


def test_capacity_from_the_recorded_trace_path(runs):
    trace, dram, cxl = runs
    report = build_report([cxl, dram])
    (group,) = report.groups
    cap = group.capacity
    assert cap.found_by == "recorded" and cap.trace_path == str(trace)

    tr = read_trace(trace)
    curve = analysis.capacity_curve(tr, points=CAPACITY_POINTS)
    assert cap.curve == curve
    ratio = np.array(cap.curve["hit_ratio"])
    assert len(ratio) > 5 and np.all(np.diff(ratio) >= 0)  # never decreases with capacity
    assert np.all(np.diff(cap.curve["capacity_blocks"]) > 0)
    assert ratio[-1] == pytest.approx(cap.curve["unbounded_hit_ratio"]) and ratio[-1] > 0.3
    sat = cap.saturation_index
    assert ratio[sat] >= 0.95 * ratio[-1] and (sat == 0 or ratio[sat - 1] < 0.95 * ratio[-1])

    # TTFT at the baseline run's measured load GB/s (the measured DRAM run, not the emulated one)
    assert group.baseline.run.path == dram
    gbps = group.breakeven.verdicts[group.rows.index(group.baseline)].gbps
    assert cap.load_gbps == gbps
    assert [dict(t) for t in cap.ttft] == analysis.capacity_ttft(tr, curve, gbps)
    # a larger cache lowers TTFT where loading beats recomputing: at a tier far above break-even (the
    # measured DRAM GB/s above depends on this host's load, and below break-even a hit costs more)
    fast = analysis.capacity_ttft(tr, curve, 1000.0)
    assert fast[0]["mean_ttft_ms"] > fast[-1]["mean_ttft_ms"]

    text = render_table(report)
    (marked,) = [line for line in text.splitlines() if line.endswith("<- 95% of max")]
    assert f"{cap.curve['capacity_blocks'][sat]:,}" in marked.split()
    assert f"unbounded hit ratio {ratio[-1]:.4f}; 95% of it is reached at" in " ".join(text.split())

    section = json.loads(render_json(report))["traces"][file_sha256(trace)]["capacity"]
    assert section["hit_ratio"] == curve["hit_ratio"] and section["found_by"] == "recorded"
    assert section["saturation_blocks"] == curve["saturation_blocks"]


def test_moved_trace_gives_a_one_line_hint_and_trace_brings_the_section_back(tmp_path):
    trace = _record(tmp_path / "a" / "chat.parquet")
    results = _replay(trace, "dram", tmp_path / "dram.parquet")
    moved = tmp_path / "b" / "chat.parquet"
    moved.parent.mkdir()
    shutil.move(trace, moved)

    report = build_report([results])
    (group,) = report.groups
    assert group.capacity is None and group.breakeven is not None
    text = render_table(report, width=200)
    hints = [line for line in text.splitlines() if "capacity" in line and "--trace" in line]
    assert hints == [f"capacity curve: needs the trace ({trace} not found); add --trace TRACE"]
    assert "<- 95% of max" not in text

    given = build_report([results], traces=[moved]).groups[0].capacity
    assert given.found_by == "--trace" and given.trace_path == str(moved)
    assert given.curve == analysis.capacity_curve(read_trace(moved), points=CAPACITY_POINTS)

    # a different file at the recorded path is not taken for the trace
    _record(trace, "synthetic:chat:sessions=2,turns=2")
    (group,) = build_report([results]).groups
    assert group.capacity is None and "has changed since the replay" in group.capacity_note


def test_cli_trace_option_json_csv_and_mismatch(runs, tmp_path):
    trace, dram, cxl = runs
    r = CliRunner()
    res = r.invoke(cli, ["report", dram, cxl, "--trace", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    document = json.loads(res.output)
    (section,) = document["traces"].values()
    assert section["capacity"]["found_by"] == "--trace"
    assert len(section["breakeven"]["prefixes"]) == len(analysis.BREAKEVEN_PREFIXES)

    res = r.invoke(cli, ["report", dram, cxl, "--csv"])
    rows = list(csv.DictReader(io.StringIO(res.output)))
    assert [row["breakeven_tier_op"] for row in rows] == ["load", "load"]
    # the virtual run's tier is far above break-even; the measured DRAM run's figure is this host's
    # (a loaded host can move too little for reuse to win), so only its column is required
    assert all("breakeven_reuse_wins_from_tokens" in row for row in rows)
    assert rows[1]["breakeven_reuse_wins_from_tokens"]

    other = _record(tmp_path / "other.parquet", "synthetic:chat:sessions=2,turns=2")
    for args, message in ((["--trace", str(other)], "is not the trace of any run in the report"),
                          (["--trace", str(tmp_path / "nope.parquet")], "no such file")):
        res = r.invoke(cli, ["report", dram, *args])
        assert res.exit_code == 2, res.output
        assert message in res.output and "Traceback" not in res.output
        assert len(res.output.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# HTML


def test_html_has_the_section_tables_and_their_figures(runs):
    _, dram, cxl = runs
    report = build_report([dram, cxl])
    text = html_page(report)
    for kind in ("breakeven", "verdicts", "capacity"):
        assert f'<table class="{kind}">' in text
    assert text.count('<tr class="marked">') == 1  # the saturation row
    body = " ".join(re.sub(r"<[^>]+>", " ", text).replace("&lt;", "<").split())
    numbers = {token for line in render_table(report, width=200).splitlines()
               for token in line.split() if re.fullmatch(r"[+-]?[\d,]+(\.\d+)?(x|%)?", token)}
    assert len(numbers) > 60
    assert sorted(n for n in numbers if n not in body) == []

    if MATPLOTLIB_MISSING is not None:
        pytest.skip(f"tables checked; figures not drawn: {MATPLOTLIB_MISSING}")
    images = re.findall(r'<img src="data:image/png;base64,([^"]+)" width="(\d+)" height="(\d+)" '
                        r'alt="([^"]*)"', text)
    assert len(images) == 5  # TTFT and TPOT CDFs, breakdown, break-even, capacity
    for data, width, height, alt in images:
        png = base64.b64decode(data, validate=True)
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", png[16:24]) == (int(width), int(height))
        assert png[24:26] == b"\x08\x06"  # 8-bit RGBA, as matplotlib's Agg canvas writes it
        # the image data inflates to one filter byte and width RGBA pixels per row
        assert len(_png_pixels(png)) == int(height) * (1 + 4 * int(width))
    alts = [alt for *_, alt in images]
    assert any(a.startswith("Break-even bandwidth") for a in alts)
    assert any(a.startswith("Prefix-hit ratio and modelled TTFT") for a in alts)


def _png_pixels(png: bytes) -> bytes:
    """The inflated image data of a PNG: its IDAT chunks, concatenated and decompressed."""
    data, offset = b"", 8
    while offset < len(png):
        (length,) = struct.unpack(">I", png[offset:offset + 4])
        if png[offset + 4:offset + 8] == b"IDAT":
            data += png[offset + 8:offset + 8 + length]
        offset += 12 + length
    return zlib.decompress(data)
