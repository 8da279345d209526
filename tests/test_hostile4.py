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


def test_a_sweep_backend_on_its_spec_or_trace_is_refused_before_anything(chat_trace, tmp_path):
    trace = tmp_path / "t.parquet"
    trace.write_bytes(chat_trace.read_bytes())
    spec = _sweep_spec(tmp_path, trace, backend=f"mmap:{trace},size=existing")
    before = _listing(tmp_path)
    _refused(_run(["sweep", spec, "--out", tmp_path / "out"]), f"mmap: {trace} is one of this command's inputs")
    spec.write_text(spec.read_text().replace(str(trace) + ",", str(spec) + ","))
    before = _listing(tmp_path)
    _refused(_run(["sweep", spec, "--out", tmp_path / "out"]), f"mmap: {spec} is one of this command's inputs")
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


# --- one validation for every new input (item 3) ---------------------------------------------------

TWO_LEVELS = '[[tier]]\nbackend = "dram"\ncapacity = "1GiB"\n[[tier]]\nbackend = "vemu:nvme"\ncapacity = "1GiB"\n'


@pytest.mark.parametrize("body,message", [
    (TWO_LEVELS + 'sharing = "shared"\ndevices = inf\n', "tier 2: devices is a whole number from 1 to 4096, got inf"),
    (TWO_LEVELS + 'sharing = "shared"\ndevices = 2.5\n', "tier 2: devices is a whole number from 1 to 4096, got 2.5"),
    (TWO_LEVELS + 'link = ["cxl-x16"]\n', "tier 2: link must be a string, got ['cxl-x16']"),
    (TWO_LEVELS + 'policy = 3\n', "tier 2: policy must be a string, got 3"),
    (TWO_LEVELS.replace('"1GiB"\n[[', '[1]\n[[', 1), 'tier 1: capacity must be a size like "64GiB" or a number of bytes'),
    ('selective_hits = inf\nplacement = "write-through-selective"\n' + TWO_LEVELS,
     "selective_hits is a whole number from 1 to 1048576, got inf"),
    ('selective_hits = 2\n' + TWO_LEVELS,
     "selective_hits is for placement write-through-selective (the hits before a block is copied below); this "
     "stack's placement is write-back"),
    ('prefetch_timeout_ms = 5\n' + TWO_LEVELS, "prefetch_timeout_ms is for prefetch=timeout; this stack's prefetch "
                                               "is wait_complete"),
], ids=["devices-inf", "devices-fraction", "link-list", "policy-number", "capacity-list", "hits-inf",
        "hits-unused", "timeout-unused"])
def test_a_tiers_file_is_typed_and_bounded(chat_trace, tmp_path, body, message):
    f = tmp_path / "s.toml"
    f.write_text(body)
    _refused(_run(["replay", chat_trace, "--tiers", f, "--layers", "1", "--out", tmp_path / "r.parquet"]), message)
    assert [p.name for p in tmp_path.iterdir()] == ["s.toml"]


@pytest.mark.parametrize("tiers,message", [
    ("dram|cap=1GiB,cap=2GiB", "--tiers: level 'dram' gives cap twice (cap and capacity are one key); give it once"),
    ("dram|cap=1GiB,capacity=2GiB", "level 'dram' gives capacity twice"),
    ("promote=1,promote=0;dram|cap=1GiB", "--tiers: stack option promote is given twice; give it once"),
    ("selective_hits=3;dram|cap=1GiB", "selective_hits is for placement write-through-selective"),
    ("dram|cap=1GiB;vemu:nvme|cap=1GiB,sharing=shared,devices=1e400", "devices is a whole number from 1 to 4096"),
])
def test_the_compact_form_takes_each_key_once(chat_trace, tmp_path, tiers, message):
    _refused(_run(["replay", chat_trace, "--tiers", tiers, "--layers", "1", "--out", tmp_path / "r.parquet"]), message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("body,message", [
    ("gpu = 5\n", "gpu must be a table of [gpu.NAME] tables, got int '5'"),
    ("gpu = [1, 2]\n", "gpu must be a table of [gpu.NAME] tables, got list"),
    ("medium = 'x'\n", "medium must be a table of [medium.NAME] tables, got str"),
    ("title = 3\n", "title must be a string, got int"),
])
def test_a_price_table_of_the_wrong_types_is_one_line(chat_trace, tmp_path, body, message):
    p = tmp_path / "p.toml"
    p.write_text(body)
    _refused(_run(["replay", chat_trace, "--backend", "vemu:nvme", "--prices", p, "--out", tmp_path / "r.parquet"]),
             message)
    _refused(_run(["analyze", "capacity", chat_trace, "--stack", "local-dram=1GiB", "--prices", p]), message)
    assert [x.name for x in tmp_path.iterdir()] == ["p.toml"]


@pytest.fixture(scope="module")
def stack_results(chat_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("stackres") / "r.parquet"
    res = _run(["replay", chat_trace, "--tiers", "dram|cap=1GiB;vemu:nvme|cap=4GiB", "--layers", "1", "--out", out])
    assert res.exit_code == 0, res.output
    return out


def _crafted(src, dst, *, meta=None, columns=None):
    """``src`` with its metadata edited by ``meta(m)`` and columns replaced, written without a content
    digest (as a hand-made file would be: nothing to match)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvemu.schema import METADATA_KEY

    t = pq.read_table(src)
    m = json.loads(t.schema.metadata[METADATA_KEY])
    if meta:
        meta(m)
    for name, change in (columns or {}).items():  # row 0's value changed by change(row 0's values)
        values = t.column(name).to_pylist()
        values[0] = change(t.slice(0, 1).to_pylist()[0])
        t = t.set_column(t.column_names.index(name), name, pa.array(values, t.schema.field(name).type))
    pq.write_table(t.replace_schema_metadata({METADATA_KEY: json.dumps(m).encode()}), dst)
    return dst


def _set(path, value):
    def edit(m):
        *head, last = path.split(".")
        d = m
        for k in head:
            d = d[k] if not k.isdigit() else d[int(k)]
        d[last] = value
    return edit


@pytest.mark.parametrize("edit,message", [
    (dict(meta=_set("cost.usd_per_million_output_tokens", "cheap")),
     "results metadata cost.usd_per_million_output_tokens must be a number, got 'cheap'"),
    (dict(meta=_set("cost.total_usd", -5.0)), "results metadata cost.total_usd must be >= 0 and <= 1e+18, got -5"),
    (dict(meta=_set("cost.inputs.amortise_years", 1e-320)), "results metadata cost.inputs.amortise_years must be >= "
                                                            "0.01 and <= 100, got 1e-320"),
    (dict(meta=_set("cost", "free")), "results metadata cost must be an object, got 'free'"),
    (dict(meta=_set("schedule.stack.levels.1.served_tokens", -100)),
     "results metadata schedule.stack.levels[1].served_tokens must be >= 0"),
    (dict(columns={"cached_tokens": lambda r: 10 * r["input_tokens"]}), "request 0: cached_tokens"),
    (dict(columns={"recomputed_tokens": lambda r: -5}), "request 0: recomputed_tokens must be >= 0, got -5"),
    (dict(columns={"tier_hit_tokens": lambda r: r["tier_hit_tokens"] + 7}), "request 0: hbm_hit_tokens"),
], ids=["cost-text", "cost-negative", "amortise-tiny", "cost-not-object", "level-negative", "cached-above-input",
        "recomputed-negative", "hits-do-not-add-up"])
def test_a_crafted_results_file_is_refused_naming_the_field(stack_results, tmp_path, edit, message):
    bad = _crafted(stack_results, tmp_path / "bad.parquet", **edit)
    _refused(_run(["report", bad]), message)
    _refused(_run(["report", bad, "--json"]), message)


def test_an_untouched_copy_of_the_results_is_read(stack_results, tmp_path):
    res = _run(["report", _crafted(stack_results, tmp_path / "same.parquet"), "--json"])
    assert res.exit_code == 0, res.output


def test_options_the_backend_or_analysis_does_not_use_are_refused(chat_trace, tmp_path):
    _refused(_run(["replay", chat_trace, "--backend", "dram", "--tier-devices", "2", "--instances", "2",
                   "--layers", "1", "--out", tmp_path / "r.parquet"]),
             "--tier-devices is for an emulated or virtual tier (the devices of its profile that the instances "
             "queue on); dram is measured on this host's own devices")
    _refused(_run(["analyze", "capacity", chat_trace, "--warmup", "0.5"]),
             "--warmup applies to a stack analysis (--stack, --policies, --sweep or --prices): the plain capacity "
             "curve counts every request")
    assert list(tmp_path.iterdir()) == []
    # where it is used, it is taken
    assert _run(["analyze", "capacity", chat_trace, "--warmup", "0.5", "--stack", "local-dram=1GiB"]).exit_code == 0


@pytest.mark.parametrize("option,message", [
    ("start_timeout_s=nan", "mooncake: option start_timeout_s is 'nan', must be a number above 0 and at most 3600"),
    ("start_timeout_s=inf", "must be a number above 0 and at most 3600"),
    ("lease_ms=99999999999", "mooncake: option lease_ms is '99999999999', must be a whole number from 1 to 86400000"),
])
def test_store_options_are_bounded(option, message):
    from kvemu.backend_spec import BackendSpec
    from kvemu.errors import ConfigError
    from kvemu.stores.mooncake import _options

    with pytest.raises(ConfigError) as e:
        _options(BackendSpec.parse(f"mooncake:{option}"))
    assert message in str(e.value)


# --- the Python API raises a KvemuError naming the argument (item 6) -------------------------------

def _api_cases(trace, results, out):
    import kvemu

    return {
        "replay-options-dict": (lambda: kvemu.replay(trace, "vemu:nvme", {"window": {}}, out=out), "options",
                                "options must be a kvemu.ReplayOptions, got dict"),
        "replay-options-str": (lambda: kvemu.replay(trace, "vemu:nvme", "fast", out=out), "options",
                               "options must be a kvemu.ReplayOptions, got str"),
        "replay-group-dict": (lambda: kvemu.replay(trace, "vemu:nvme", kvemu.ReplayOptions(window={"layers": 1}),
                                                   out=out), "window", "window must be of type WindowOptions, got dict"),
        "replay-trace-none": (lambda: kvemu.replay(None, "vemu:nvme", out=out), "trace", "trace must be a path"),
        "replay-out-number": (lambda: kvemu.replay(trace, "vemu:nvme", out=5), "out", "out must be a path"),
        "replay-progress": (lambda: kvemu.replay(trace, "vemu:nvme", out=out, progress=1), "progress",
                            "progress must be a function or None"),
        "record-options-dict": (lambda: kvemu.record("synthetic:chat", "llama3-8b", out, {"gpu": "H100"}), "options",
                                "options must be a kvemu.RecordOptions, got dict"),
        "record-workload-none": (lambda: kvemu.record(None, "llama3-8b", out), "workload",
                                 "workload must be a non-empty str, got None"),
        "record-model-none": (lambda: kvemu.record("synthetic:chat", None, out), "model", "model must be a non-empty str"),
        "record-out-none": (lambda: kvemu.record("synthetic:chat", "llama3-8b", None), "out", "out must be a path"),
        "report-one-string": (lambda: kvemu.report(str(results)), "paths", "paths takes a list of paths, got the single str"),
        "report-one-path": (lambda: kvemu.report(results), "paths", "paths takes a list of paths, got the single"),
        "report-none": (lambda: kvemu.report(None), "paths", "paths must be a list of paths, got NoneType"),
        "report-none-inside": (lambda: kvemu.report([None]), "paths[0]", "paths[0] must be a path"),
        "report-slo-dict": (lambda: kvemu.report([results], slo={"ttft": 1}), "slo", "slo must be a preset name"),
        "report-rank-str": (lambda: kvemu.report([results], rank="x"), "rank", "rank must be a list of run labels"),
        "report-traces-str": (lambda: kvemu.report([results], traces=str(trace)), "traces", "traces takes a list"),
        "render-none": (lambda: kvemu.render_table(None), "report", "report must be a kvemu.Report, got NoneType"),
        "render-json-dict": (lambda: kvemu.render_json({}), "report", "report must be a kvemu.Report, got dict"),
        "render-html-none": (lambda: kvemu.render_html(None, out), "report", "report must be a kvemu.Report"),
    }


CASES = list(_api_cases("t", "r", "o"))


@pytest.mark.parametrize("case", CASES)
def test_the_python_api_names_the_argument(chat_trace, stack_results, tmp_path, case):
    import kvemu

    fn, field, message = _api_cases(chat_trace, stack_results, tmp_path / "o.parquet")[case]
    with pytest.raises(kvemu.OptionError) as e:
        fn()
    assert e.value.field == field and message in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError) and list(tmp_path.iterdir()) == []


# --- sweeps: a lock on the output folder, no empty folder left (item 5) ----------------------------

def _sweep_spec(tmp_path, trace, backend="vemu:cxl-pool"):
    p = tmp_path / "spec.toml"
    p.write_text(f'[[trace]]\npath = "{trace}"\n[backends]\nuse = ["{backend}"]\n[grid]\nreplay_layers = [1]\n'
                 f'requests = ["0:1"]\n')
    return p


def test_a_second_sweep_on_a_locked_folder_is_refused_and_touches_nothing(chat_trace, tmp_path):
    import fcntl

    from kvemu.sweep import LOCK_NAME

    spec = _sweep_spec(tmp_path, chat_trace)
    out = tmp_path / "out"
    (out / ".sweep-work").mkdir(parents=True)
    (out / ".sweep-work" / "cell.parquet").write_bytes(b"the running sweep's cell")  # the other sweep's work
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held as a running sweep holds it
    try:
        before = _listing(out)
        _refused(_run(["sweep", spec, "--out", out]),
                 "another sweep is running on this folder (it holds .sweep.lock); wait for it to finish or give "
                 "another --out (finished cells are kept)")
        assert _listing(out) == before
    finally:
        os.close(fd)
    # the lock released, the sweep runs, and it leaves no lock file behind
    res = _run(["sweep", spec, "--out", out])
    assert res.exit_code == 0, res.output
    assert not (out / LOCK_NAME).exists()


def test_the_lock_is_taken_on_the_file_the_name_holds(tmp_path):
    from kvemu.sweep import LOCK_NAME, _lock_out, _unlock_out

    lock = _lock_out(tmp_path)
    assert (tmp_path / LOCK_NAME).exists()
    with pytest.raises(Exception, match="another sweep is running"):
        _lock_out(tmp_path)
    _unlock_out(lock)
    assert not (tmp_path / LOCK_NAME).exists()
    _unlock_out(_lock_out(tmp_path))  # taken again once released


def test_a_sweep_whose_every_cell_fails_leaves_no_folder(chat_trace, tmp_path):
    spec = _sweep_spec(tmp_path, chat_trace, backend=f"mmap:{tmp_path}/missing/tier.bin")
    out = tmp_path / "a" / "out"
    res = _run(["sweep", spec, "--out", out])
    assert "failed" in res.output
    assert not (tmp_path / "a").exists(), sorted(str(p) for p in (tmp_path / "a").rglob("*"))


# --- messages that cannot read as a contradiction, name what was given, fit one line (item 7) ------

def test_a_bound_and_a_value_are_told_apart(tmp_path):
    base = ["record", "--workload", "synthetic:chat:sessions=1,turns=1", "--model", "llama3-8b", "--out",
            tmp_path / "t.parquet"]
    _refused(_run([*base, "--time-scale", "1e9"]),
             "--time-scale must be a positive number below 1e+09, got 1e+09 (1e+09 itself is too large)")
    _refused(_run([*base, "--mfu", "1.0000001"]), "--mfu must be >= 0.001 and <= 1, got 1.0000001")
    assert list(tmp_path.iterdir()) == []


def test_exact_numbers_by_hand():
    from kvemu.units import exact, number_problem

    shown = {1e9: "1e+09", 1.0000001: "1.0000001", 1048576.0: "1048576", 2**31: "2147483648", 0.001: "0.001",
             1e-320: "1e-320", 100.0: "100", 2.5: "2.5", 10**6: "1e+06", float("inf"): "inf"}
    assert {v: exact(v) for v in shown} == shown
    assert number_problem(2**31, 1, 2**31 - 1) == "must be >= 1 and <= 2147483647, got 2147483648"


def test_a_break_even_names_only_the_options_given(tmp_path):
    cfg = tmp_path / "config.json"  # 2 layers and weights that need more GPUs than 8 of tensor parallelism
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 65536, "num_attention_heads": 64,
                               "num_key_value_heads": 8, "vocab_size": 1000, "intermediate_size": 1048576}))
    line = _refused(_run(["analyze", "breakeven", "--model", cfg]), "weights need (no --gpus given) would need",
                    "pipeline stages of tp 8")
    assert "None" not in line


@pytest.mark.parametrize("name", ["A" * 1_000_000, "A b" * 300_000], ids=["one-word", "many-words"])
def test_a_huge_name_is_one_short_line(chat_trace, tmp_path, name):
    line = _refused(_run(["replay", chat_trace, "--backend", f"vemu:{name}", "--out", tmp_path / "r.parquet"]),
                    "unknown tier profile", "characters)")
    assert len(line) < 4100 and line.endswith("or give a .toml path)")


# --- signals: before the handlers and after the command ---------------------------------------------

def _child(code: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])


def test_a_signal_during_the_first_imports_is_held_then_one_line(chat_trace):
    # the early handler records, never raises (a traceback from inside `import signal` before)
    r = _child("import os, signal, kvemu.__main__ as m\nm._install_early()\nos.kill(os.getpid(), signal.SIGINT)\n"
               "print(m._early)")
    assert r.returncode == 0 and r.stdout.strip() == "[2]", r.stderr
    # and once kvemu.interrupt's handlers are in, it ends the command as any other signal does
    r = _child(f"import sys, kvemu.__main__ as m\nm._early.append(15)\n"
               f"sys.argv = ['kvemu', 'trace', 'info', {str(chat_trace)!r}]\nm.main()")
    assert r.returncode == 143 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr == "Error: interrupted by SIGTERM; discarded: nothing (no partial file left; tier released)\n"


def test_after_the_command_a_signal_cannot_kill_the_way_out(chat_trace):
    # Python's finalization would reset the handlers to SIG_DFL: a SIGTERM then was death (-15)
    r = _child(f"import os, signal, sys, kvemu.__main__ as m\nsys.argv = ['kvemu', 'trace', 'info', "
               f"{str(chat_trace)!r}]\ntry:\n    m.main()\nexcept SystemExit as e:\n"
               f"    print('ignored', signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, file=sys.stderr)\n"
               f"    os.kill(os.getpid(), signal.SIGTERM)\n    raise")
    assert r.returncode == 0 and r.stderr.strip().endswith("ignored True"), (r.returncode, r.stderr[-300:])


def test_every_json_kvemu_emits_goes_through_a_strict_writer():
    """Every json.dump(s) call in kvemu passes allow_nan=False (kvemu/jsontext.py does), except the
    ones listed here, which write no document: a hash's input, a grouping key, a TOML string's
    escapes, a temporary config for the model reader, the test-only lenient trace writer, and the
    pipe between kvemu and its own isolated child (read back by kvemu alone, NaN included)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "kvemu"
    allowed = {("integrity.py", "update"),
               ("report/compare.py", "*"), ("report/grouping.py", "workload_key"), ("sweep.py", "_digest"),
               ("profiles.py", "*"), ("realrun/hf.py", "geometry_from_config"), ("schema.py", "write_trace"),
               ("isolation.py", "run_isolated"), ("isolation.py", "_child"), ("isolation.py", "send")}
    loose = []
    for f in sorted(root.rglob("*.py")):
        rel = str(f.relative_to(root))
        tree = ast.parse(f.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("dump", "dumps") and getattr(node.func.value, "id", "") == "json":
                    strict = any(k.arg == "allow_nan" and isinstance(k.value, ast.Constant) and k.value.value is False
                                 for k in node.keywords)
                    if not strict and (rel, fn.name) not in allowed and (rel, "*") not in allowed:
                        loose.append(f"{rel}:{node.lineno} in {fn.name}")
    assert loose == [], loose
