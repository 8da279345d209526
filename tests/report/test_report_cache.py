"""The report's capacity cache (kvemu/report/curve_cache.py): a trace's capacity curve is computed
once, kept per trace digest, read back by the next report, and an entry that is not sound is
computed again, never trusted."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.record_options import RecordOptions
from kvemu.recording import record
from kvemu.replay import ReplayOptions, WindowOptions, replay
from kvemu.report import build_report, curve_cache, render_json, render_table
from kvemu.report.compare import curve_params
from kvemu.schema import file_sha256


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cache-runs")
    trace = folder / "chat.parquet"
    record("synthetic:chat:sessions=3,turns=3", "llama3-8b", trace,
           RecordOptions.from_flat(hbm_kv_gib=0.5, show_progress=False))
    out = folder / "cxl.parquet"
    replay(trace, "vemu:cxl-pool", ReplayOptions(window=WindowOptions(layers=2)), out=out, warn=lambda m: None)
    return trace, str(out)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))
    monkeypatch.delenv(curve_cache.DISABLE_ENV, raising=False)
    return tmp_path / "cache-home" / "kvemu" / "capacity"


def _report(results, **kw):
    """The report's capacity section and whether its curve was computed (the progress callback is
    called only while a curve is computed, never on a cache hit)."""
    calls = []
    rep = build_report([results], progress=lambda done, total: calls.append(done), **kw)
    cap = rep.groups[0].capacity
    return (cap.curve, cap.ttft), bool(calls)


def test_second_report_reads_the_curve_kept_under_the_trace_digest(run, home):
    trace, results = run
    first, computed = _report(results)
    assert computed
    (entry,) = list(home.iterdir())
    assert entry.name.startswith(file_sha256(trace) + "-") and entry.suffix == ".npz"
    second, computed = _report(results)
    assert not computed and second == first
    # the same figures as computed without the cache at all
    fresh, computed = _report(results, cache=False)
    assert computed and fresh == first
    assert sorted(p.name for p in home.iterdir()) == [entry.name]  # no temporary file left


def test_cache_off_by_option_or_environment_writes_nothing(run, home, monkeypatch):
    _, results = run
    _report(results, cache=False)
    assert not home.exists()
    monkeypatch.setenv(curve_cache.DISABLE_ENV, "1")
    _, computed = _report(results)
    assert computed and not home.exists()


def _entry_path(home):
    (p,) = [p for p in home.iterdir() if not p.name.startswith(".")]
    return p


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign", "tampered"])
def test_an_unsound_entry_is_computed_again_and_replaced(run, home, damage):
    trace, results = run
    good, _ = _report(results)
    path = _entry_path(home)
    sha = file_sha256(trace)
    if damage == "garbage":
        path.write_bytes(b"not an npz file at all")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    elif damage == "foreign":  # a sound entry of another trace put under this trace's name
        e = curve_cache.load(sha, curve_params())
        other = curve_cache.Entry("0" * 64, e.params, {**e.curve, "hit_ratio": [0.5] * len(e.curve["hit_ratio"])},
                                  e.has_gpu, e.compute_ns, e.load_bytes, e.earlier_hit_tokens)
        os.replace(curve_cache.store(other), path)
    else:  # an array changed, the checksum left as it was
        with np.load(path) as z:
            parts = {k: z[k] for k in z.files}
        parts["compute_ns"] = parts["compute_ns"] + 1
        with open(path, "wb") as f:
            np.savez(f, **parts)
    assert curve_cache.load(sha, curve_params()) is None
    again, computed = _report(results)
    assert computed and again == good
    assert curve_cache.load(sha, curve_params()) is not None  # replaced by a sound one


def test_other_parameters_are_another_entry(run, home):
    trace, results = run
    _report(results)
    sha = file_sha256(trace)
    assert curve_cache.load(sha, {**curve_params(), "points": 3}) is None
    assert curve_cache.load(sha, curve_params()) is not None


def test_cache_home_follows_xdg_and_falls_back_to_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert curve_cache.cache_dir() == tmp_path / "kvemu" / "capacity"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec: a relative path is ignored
    assert curve_cache.cache_dir() == Path.home() / ".cache" / "kvemu" / "capacity"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert curve_cache.cache_dir() == Path.home() / ".cache" / "kvemu" / "capacity"


def test_an_unwritable_cache_folder_does_not_stop_the_report(run, tmp_path, monkeypatch):
    _, results = run
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.delenv(curve_cache.DISABLE_ENV, raising=False)
    (curve, ttft), computed = _report(results)
    assert computed and curve["hit_ratio"]


def test_cli_no_cache(run, home):
    _, results = run
    res = CliRunner().invoke(cli, ["report", results, "--no-cache", "--json"])
    assert res.exit_code == 0, res.output
    assert not home.exists()
    res = CliRunner().invoke(cli, ["report", results, "--json"])
    assert res.exit_code == 0 and len(list(home.iterdir())) == 1
    doc = json.loads(res.stdout)
    assert doc["traces"]


def _earlier_hits_by_hand(trace):
    """Per request, the prompt tokens an unbounded cache of every earlier request serves it: its
    leading full blocks that some earlier request referenced (a plain loop over the trace)."""
    from kvemu.schema import read_trace

    tr = read_trace(trace)
    tpb = tr.header.tokens_per_block
    seen, out = set(), []
    for i in range(tr.n_requests):
        blocks = [int(b) for b in tr.table_ids[tr.table_offsets[i]:tr.table_offsets[i + 1]]][:int(tr.input_tokens[i]) // tpb]
        n = 0
        while n < len(blocks) and blocks[n] in seen:
            n += 1
        out.append(n * tpb)
        seen.update(blocks)
    return out, [int(x) for x in tr.input_tokens]


def test_a_window_that_starts_cold_says_what_earlier_requests_would_let_it_reuse(run, home, tmp_path):
    trace, full = run
    window = tmp_path / "first4.parquet"
    replay(trace, "vemu:cxl-pool", ReplayOptions(window=WindowOptions(layers=2, requests=(0, 4))), out=window,
           warn=lambda m: None)
    assert build_report([full]).groups[0].cold == ()  # the whole trace is no window
    rep = build_report([str(window)])
    (group,) = rep.groups
    (cold,) = group.cold
    hits, inp = _earlier_hits_by_hand(trace)
    assert (cold.first, cold.last, cold.requests, cold.trace_requests) == (0, 3, 4, len(inp))
    assert cold.earlier_share == pytest.approx(sum(hits[:4]) / sum(inp[:4]))
    assert cold.trace_share == pytest.approx(sum(hits) / sum(inp))
    assert cold.sentence.startswith(f"{cold.label} replays requests 0-3 of the trace's {len(inp)} and starts cold: "
                                    f"at most {100 * sum(hits[:4]) / sum(inp[:4]):.0f} % of its prompt tokens")
    assert cold.sentence in " ".join(render_table(rep).split())  # wrapped to the width
    assert json.loads(render_json(rep))["traces"][file_sha256(trace)]["cold_windows"][0]["first"] == 0
    # a closed-loop window later in the trace replays its history first: it does not start cold
    later = tmp_path / "later.parquet"
    replay(trace, "vemu:cxl-pool", ReplayOptions(window=WindowOptions(layers=2, requests=(4, 8))), out=later,
           warn=lambda m: None)
    assert build_report([str(later)]).groups[0].cold == ()
