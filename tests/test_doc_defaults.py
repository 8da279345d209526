"""Every default README.md, docs/*.md and `--help` state, against the value in the code.

Each statement is found by a pattern in the text it lives in (a doc file, or one option's help
string) and its value compared with the one the code uses: the option's click default
(``kvemu.cli.cli``), a named library constant, or, where the default is behaviour rather than a
value (the schedule, the workers, what --max-memory does to a tier), what a small replay does.
A pattern that no longer matches fails too: reword a statement, and its check here follows.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import click
import pytest

from kvemu import calibrate, demo, links, workloads
from kvemu import sweep as sweep_module
from kvemu.cli import cli
from kvemu.engine import timing as engine_timing
from kvemu.errors import ResourceLimitError
from kvemu.replay import (DEFAULT_MAX_MEMORY, CostOptions, InstanceOptions, ReplayOptions, TierOptions, WindowOptions,
                          replay)
from kvemu.replay.arena import DEFAULT_CHUNK_TOKENS
from kvemu.replay.stack import StackSpec
from kvemu.sweep import GRID_DEFAULTS, Cell, Sweep, expand_sweep
from kvemu.units import parse_size

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"
VLLM_EVENTS = ROOT / "tests" / "data" / "vllm_events_sample.msgpack"  # a real-run trace's source


def _flat(text: str) -> str:
    return " ".join(text.split())


DOCS = {p.relative_to(ROOT).as_posix(): _flat(p.read_text(encoding="utf-8"))
        for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}


def command(path: str) -> click.Command:
    c = cli
    for part in path.split():
        c = c.commands[part]
    return c


def param(path: str, opt: str) -> click.Parameter:
    return next(p for p in command(path).params if opt in p.opts)


def default(path: str, opt: str):
    return param(path, opt).default


def text_of(source: str) -> str:
    """A doc file (``docs/replay.md``) or one option's help (``help:replay --link``)."""
    if source.startswith("help:"):
        path, opt = source[len("help:"):].rsplit(" ", 1)
        return _flat(param(path, opt).help or "")
    return DOCS[source]


def stated(source: str, pattern: str) -> list[str]:
    found = re.findall(pattern, text_of(source))
    assert found, f"{source} no longer says /{pattern}/: update the statement's check in this file"
    return found


def size(text: str) -> int:
    return parse_size(str(text).replace(" ", ""))


def _field_default(cls, name: str):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def word(text: str) -> str:
    return text.strip("`\"' ")


# --------------------------------------------------------------------- statements of a value
#: (what, the value in the code, how a statement's text is read, [(source, pattern), ...]);
#: every pattern's group 1 is the value stated.
def _run_sweep_default(name: str):
    import inspect

    from kvemu.sweep import run_sweep

    return inspect.signature(run_sweep).parameters[name].default


VALUES = [
    ("replay --link", links.DEFAULT_LINK, word, [
        ("docs/cli.md", r"`--link` how the GPU reaches the tier \(default `([^`]+)`\)"),
        ("docs/cli.md", r"\(`--link`: `([^`]+)` by default"),
        ("docs/replay.md", r"The link \(`--link`, default `([^`]+)`"),
        ("docs/tier-profiles.md", r"`kvemu replay --link NAME`, default `([^`]+)`"),
        ("docs/scale-out.md", r"\| `link` \| `--link` \| `\"([^\"]+)\"` \|"),
    ]),
    ("replay --store-timing", links.DEFAULT_STORE_MODE, word, [
        ("docs/replay.md", r"- `(\w+)` \(default; vLLM's OffloadingConnector"),
    ]),
    ("replay --store-inflight", links.DEFAULT_STORE_INFLIGHT_BYTES, size, [
        ("docs/replay.md", r"`--store-inflight` bytes in flight \(default ([\d.]+ [KMGT]iB)"),
    ]),
    ("replay --max-memory", DEFAULT_MAX_MEMORY, size, [
        ("docs/replay.md", r"`--max-memory` \(default ([\d.]+ [KMGT]iB)\)"),
        ("docs/scale-out.md", r"`max_memory` \(as `replay --max-memory`, default `\"([^\"]+)\"`\)"),
    ]),
    ("replay --chunk-tokens", DEFAULT_CHUNK_TOKENS, int, [
        ("help:replay --chunk-tokens", r"default: the trace's, else (\d+)"),
        ("docs/replay.md", r"`kvemu record --chunk-tokens`, default (\d+)\), else (?:\d+) tokens"),
        ("docs/replay.md", r"`kvemu record --chunk-tokens`, default \d+\), else (\d+) tokens"),
        ("docs/trace-format.md", r"`transfer_chunk_tokens` \(default (\d+)"),
    ]),
    ("replay --kv-layout", default("record", "--kv-layout"), word, [
        ("help:replay --kv-layout", r"default: the trace's, else ([\w-]+)\)"),
    ]),
    ("replay --kv-load", default("replay", "--kv-load"), word, [
        ("docs/replay.md", r"- `([\w-]+)` \(default, as the trace recorded it\)"),
    ]),
    ("replay --routing", default("replay", "--routing"), word, [
        ("docs/analysis.md", r"- `([\w-]+)` \(default\): the k-th arrival"),
    ]),
    ("replay --transfer", __import__("kvemu.deployment").deployment.DEFAULT_TRANSFER, word, [
        ("docs/replay.md", r"\| `([\w-]+)` \(default\) \| every block of the prompt"),
        ("help:replay --transfer", r"Default: the trace's deployment's, else ([\w-]+)\."),
        ("help:record --transfer", r"as replay --transfer; default ([\w-]+)\)"),
    ]),
    ("replay --decode-chunked-prefill", default("replay", "--decode-chunked-prefill"), word, [
        ("docs/replay.md", r"with `--decode-chunked-prefill (\w+)` \(default\)"),
    ]),
    ("replay --decode-chunked-prefill (library)", __import__("kvemu").DisaggOptions().decode_chunked_prefill, word, [
        ("docs/replay.md", r"with `--decode-chunked-prefill (\w+)` \(default\)"),
    ]),
    ("record --tier-eviction", default("record", "--tier-eviction"), word, [
        ("docs/cli.md", r"`--tier-eviction POLICY` what a bounded offload tier \(`--tier-capacity-gib`\) evicts "
                        r"\(default `(\w+)`"),
        ("docs/engine.md", r"evicts by `--tier-eviction POLICY`, default `(\w+)`"),
        ("docs/trace-format.md", r"`kvemu record --tier-eviction`, a `kvemu.policies` name, default `(\w+)`"),
    ]),
    ("record --tier-eviction (library)", __import__("kvemu").EngineOptions().tier_eviction, word, [
        ("docs/engine.md", r"evicts by `--tier-eviction POLICY`, default `(\w+)`"),
    ]),
    # replay's fallback for a trace that records none: tests/test_tier_eviction.py replays one
    ("replay --tier-eviction", __import__("kvemu.bounds").bounds.DEFAULT_TIER_EVICTION, word, [
        ("help:replay --tier-eviction", r"Default: the trace's \(record --tier-eviction\), else (\w+)\."),
        ("docs/cli.md", r"\(default: the trace's `engine.tier_eviction`, else `(\w+)`\)"),
        ("docs/replay.md", r"\(default: the trace's `engine.tier_eviction`, `kvemu record --tier-eviction`, else `(\w+)`;"),
    ]),
    ("record --engine-era", engine_timing.DEFAULT_ERA, word, [
        ("docs/engine.md", r"--engine-era ERA`, default `(\w+)`"),
    ]),
    ("record --engine-era (flag)", default("record", "--engine-era"), word, [
        ("docs/engine.md", r"--engine-era ERA`, default `(\w+)`"),
    ]),
    ("record --gpu", default("record", "--gpu"), word, [
        ("docs/cli.md", r"`([\w-]+)` \(default\), `H800-SXM`"),
        ("help:analyze breakeven --gpu", r"default: the trace's, else ([\w-]+)\)"),
        ("docs/analysis.md", r"the others default as `record`'s do: ([\w-]+),"),
    ]),
    ("record --block-tokens", default("record", "--block-tokens"), int, [
        ("docs/engine.md", r"Engine blocks hold `--block-tokens` tokens \(default (\d+)\)"),
    ]),
    ("record --max-batched-tokens", default("record", "--max-batched-tokens"), int, [
        ("docs/engine.md", r"\(`--max-batched-tokens`, default (\d+);"),
    ]),
    ("record --max-num-seqs", default("record", "--max-num-seqs"), int, [
        ("docs/engine.md", r"`--max-num-seqs` \((\d+)\)"),
    ]),
    ("record --weight-stream", default("record", "--weight-stream"), word, [
        ("docs/weights-in-tier.md", r"- `(\w+)` \(default; vLLM's CPU offload"),
    ]),
    ("record --kv-dtype", default("record", "--kv-dtype"), word, [
        ("docs/sources.md", r"\(`--kv-dtype`, default (\w+)\)"),
        ("help:analyze breakeven --kv-dtype", r"default: the trace's, else (\w+)\)"),
    ]),
    ("record --weight-dtype", default("record", "--weight-dtype"), word, [
        ("help:analyze breakeven --weight-dtype", r"default: the trace's, else (\w+)\)"),
    ]),
    ("record --hbm-kv-gib: memory utilisation", _field_default(engine_timing.GpuTiming, "memory_utilization"), float, [
        ("help:record --hbm-kv-gib", r"default: GPU memory x ([\d.]+) minus weights"),
        ("docs/engine.md", r"HBM KV capacity defaults to `gpus × memory × ([\d.]+) − weights`"),
    ]),
    ("record --hash-block-tokens: Mooncake", workloads.MOONCAKE_BLOCK_TOKENS, int, [
        ("help:record --hash-block-tokens", r"Mooncake default (\d+)"),
    ]),
    ("record --hash-block-tokens: synthetic", workloads.SYNTHETIC_BLOCK_TOKENS, int, [
        ("help:record --hash-block-tokens", r"synthetic (\d+)\)"),
        ("docs/engine.md", r"Synthetic workloads use (\d+)-token hash blocks"),
    ]),
    ("record --ep", 1, int, [
        ("help:record --ep", r"\(default: (\d+)\)"),
    ]),
    ("fitted prefill mfu", engine_timing.DEFAULT_FACTORS["mfu"], float, [
        ("docs/analysis.md", r"`--mfu`, default the fitted ([\d.]+) for prefill steps"),
        ("docs/analysis.md", r"the fitted prefill factors \(`docs/engine.md`: mfu ([\d.]+),"),
    ]),
    ("fitted prefill mbu", engine_timing.DEFAULT_FACTORS["mbu"], float, [
        ("docs/analysis.md", r"the fitted prefill factors \(`docs/engine.md`: mfu [\d.]+, mbu ([\d.]+)\)"),
    ]),
    ("analyze capacity --load-gbps", default("analyze capacity", "--load-gbps"), float, [
        ("docs/analysis.md", r"`--load-gbps` \(default ([\d.]+) GB/s\)"),
    ]),
    ("analyze capacity --warmup", default("analyze capacity", "--warmup"), float, [
        ("docs/analysis.md", r"`--warmup F` \(default ([\d.]+)\)"),
    ]),
    ("analyze capacity --promote", "off" if default("analyze capacity", "--promote") is False else "on", str, [
        ("docs/analysis.md", r"`--promote` \((\w+) by default\)"),
    ]),
    ("replay --warmup", default("replay", "--warmup"), float, [
        ("docs/replay.md", r"`--warmup F` \(default ([\d.]+);"),
    ]),
    ("the stack's placement (kvemu.stackrules)", StackSpec(levels=()).placement, str, [
        ("docs/analysis.md", r"\| `([\w-]+)` \(default with `--stack`, and of `replay --tiers`\)"),
    ]),
    ("analyze capacity --amortise-years", default("analyze capacity", "--amortise-years"), float, [
        ("docs/analysis.md", r"`--amortise-years`, default ([\d.]+) years"),
    ]),
    ("replay --amortise-years", default("replay", "--amortise-years"), float, [
        ("docs/replay.md", r"`--amortise-years` \(`CostOptions.amortise_years`\), default ([\d.]+) years"),
    ]),
    ("replay CostOptions.amortise_years", _field_default(CostOptions, "amortise_years"), float, [
        ("docs/replay.md", r"`--amortise-years` \(`CostOptions.amortise_years`\), default ([\d.]+) years"),
    ]),
    ("calibrate --buffer", calibrate.DEFAULT_BUFFER_BYTES, size, [
        ("docs/tier-profiles.md", r"the buffer defaults to ([\d.]+ [KMGT]iB) \(`--buffer`\)"),
    ]),
    ("sweep [sweep] repetitions (measured)", sweep_module.MEASURED_REPETITIONS, int, [
        ("docs/scale-out.md", r"`repetitions` \(default (\d+) on measured and emulated backends"),
    ]),
    ("sweep [sweep] retries", _field_default(Sweep, "retries"), int, [
        ("docs/scale-out.md", r"`retries` \(Dask, default (\d+)\)"),
        ("docs/scale-out.md", r"\(`\[sweep\] retries`, default (\d+)\)"),
    ]),
    ("report --fallback", default("report", "--fallback"), word, [
        ("docs/report.md", r"`--fallback (\w+)` \(the default\)"),
    ]),
    ("sweep's Dask connect timeout", _run_sweep_default("connect_timeout_s"), float, [
        ("docs/scale-out.md", r"Dask's handshake included, is given up after (\d+) s"),
        ("docs/scale-out.md", r"did not answer as a Dask scheduler within (\d+) s"),
    ]),
    ("sweep's wait for a worker with a resource", _run_sweep_default("placement_timeout_s"), float, [
        ("docs/scale-out.md", r"as long as it waits for workers at the start \((\d+) s\)"),
        ("docs/scale-out.md", r"no worker has offered resource 'mem' for (\d+) s"),
    ]),
    ("demo's repetitions", demo.REPEAT, lambda w: {"two": 2, "three": 3, "four": 4, "five": 5}[w], [
        ("docs/report.md", r"`kvemu demo` replays its tier comparison (\w+) times"),
    ]),
    ("replay --tiers prefetch", _field_default(StackSpec, "prefetch"), word, [
        ("docs/replay.md", r"`prefetch=` \(`(\w+)`, the default"),
        ("docs/replay.md", r"- `(\w+)` \(default\): when every block has arrived"),
        ("help:replay --tiers", r"default (\w+), [\d.]+ ms \+"),
    ]),
    ("replay --tiers prefetch_timeout_ms", _field_default(StackSpec, "prefetch_timeout_ms"), float, [
        ("docs/replay.md", r"`prefetch_timeout_ms=` \(default ([\d.]+)\)"),
        ("help:replay --tiers", r"default \w+, ([\d.]+) ms \+"),
    ]),
    ("replay --tiers prefetch_timeout_per_ki_token_ms", _field_default(StackSpec, "prefetch_timeout_per_ki_token_ms"),
     float, [
        ("docs/replay.md", r"`prefetch_timeout_per_ki_token_ms=` \(default ([\d.]+)\)"),
        ("help:replay --tiers", r"ms \+ ([\d.]+) ms per 1024 tokens"),
    ]),
]


@pytest.mark.parametrize("what, value, read, statements", VALUES, ids=[v[0] for v in VALUES])
def test_stated_default_is_the_codes(what, value, read, statements):
    assert value is not None, f"{what}: the code's value was not found"
    for source, pattern in statements:
        for text in stated(source, pattern):
            assert read(text) == value, f"{source} says {what} defaults to {text!r}; the code: {value!r}"


# ------------------------------------------------------- the CLI's defaults are the library's
def _sweep_defaults(tmp_path) -> Cell:
    sweep = expand_sweep({"trace": [{"path": str(TRACE)}], "backends": {"use": ["vemu:nvme"]}},
                         tmp_path / "s.toml")
    assert len(sweep.cells) == 1  # repetitions: 1
    return sweep.cells[0]


def test_cli_defaults_are_the_library_constants(tmp_path):
    """One default, one value: the click options, the sweep's grid and the library agree."""
    cell = _sweep_defaults(tmp_path)
    fields = {name: _field_default(Cell, name) for name in ("link", "store_timing")}
    assert default("replay", "--link") == links.DEFAULT_LINK == GRID_DEFAULTS["link"] == fields["link"] == cell.link
    assert (default("replay", "--store-timing") == links.DEFAULT_STORE_MODE == GRID_DEFAULTS["store_timing"]
            == fields["store_timing"] == cell.store_timing)
    assert size(default("replay", "--store-inflight")) == links.DEFAULT_STORE_INFLIGHT_BYTES
    assert size(default("replay", "--max-memory")) == DEFAULT_MAX_MEMORY == cell.max_memory
    assert default("record", "--chunk-tokens") == DEFAULT_CHUNK_TOKENS
    assert default("replay", "--instances") == GRID_DEFAULTS["instances"] == cell.instances == 1
    assert default("replay", "--sharing") == GRID_DEFAULTS["sharing"] == cell.sharing
    assert default("replay", "--repeat") == 1
    assert default("replay", "--chunk-tokens") is None and default("replay", "--kv-layout") is None  # the trace's
    assert size(default("calibrate", "--buffer")) == calibrate.DEFAULT_BUFFER_BYTES
    assert default("calibrate", "--hops") == calibrate.DEFAULT_HOPS
    assert default("sweep", "--executor") == "local"
    assert "## Local executor (default)" in (ROOT / "docs" / "scale-out.md").read_text()


def test_breakeven_without_a_trace_defaults_as_record():
    """docs/analysis.md: without a trace the options "default as `record`'s do"."""
    from kvemu.analysis import breakeven_timing

    t = breakeven_timing(model="llama3-8b")
    assert t.gpu.name == default("record", "--gpu")
    assert t.to_dict()["weight_dtype"] == default("record", "--weight-dtype")


def test_help_that_shows_its_default_does_not_state_another():
    """An option with show_default prints the code's value; its help must not state one of its own."""
    def commands(c, path):
        if isinstance(c, click.Group):
            for name, sub in c.commands.items():
                yield from commands(sub, f"{path} {name}".strip())
        else:
            yield path, c

    bad = [f"{path} {p.opts[0]}" for path, c in commands(cli, "") for p in c.params
           if getattr(p, "show_default", False) and re.search(r"\bdefault\b", p.help or "", re.I)]
    assert not bad


# ------------------------------------------------------------------- defaults that are behaviour
def test_closed_loop_is_the_default_for_engine_traces_with_instances_too(tmp_path):
    for source, pattern, says in [
        ("help:replay --schedule", r"closed: [^;]*\(default for ([^)]*)\)", "traces kvemu's engine recorded, with --instances too"),
        ("help:replay --schedule", r"recorded: [^;]*\(default for ([^)]*)\)", "real-run traces"),
        ("docs/cli.md", r"`--schedule closed\\?\|recorded` \(default (closed for engine-model traces)", "closed for engine-model traces"),
        ("docs/replay.md", r"\(`--schedule closed`, the default for ([^;]*);", "traces kvemu's engine model recorded, with one instance or several"),
        ("docs/replay.md", r"\(`--schedule recorded`, the default for ([^,]*),", "real-run traces"),
    ]:
        assert stated(source, pattern) == [says], source
    for instances in (1, 3):
        meta = replay(TRACE, "vemu:nvme", ReplayOptions(window=WindowOptions(requests=(0, 2), layers=1), instances=InstanceOptions(count=instances)), out=tmp_path / f"r{instances}.parquet")
        assert (meta["schedule"]["ran"], meta["schedule"]["from"]) == ("closed", "default")
    pytest.importorskip("msgpack", reason="the real-run trace comes from vLLM events (pip install 'kvemu[vllm]')")
    from kvemu.realrun.vllm_events import import_vllm_events

    import_vllm_events(VLLM_EVENTS, "llama3-8b", tmp_path / "real-run.parquet")
    meta = replay(tmp_path / "real-run.parquet", "vemu:nvme", ReplayOptions(instances=InstanceOptions(count=2)), out=tmp_path / "real.parquet")
    assert (meta["schedule"]["ran"], meta["schedule"]["from"]) == ("recorded", "default")


def test_memory_tiers_get_one_worker_per_cpu_and_one_per_instance(tmp_path):
    stated("docs/cli.md", r"move bytes with pinned transfer workers, by default one per CPU \(with `--instances N`, one per instance\)")
    stated("docs/backends.md", r"`workers=N` \(1–256; default: one per CPU this process may use, by its affinity;")
    stated("docs/backends.md", r"With `--instances N` \(N > 1\) each instance's `dram`, `numa` or `mmap` backend has one worker,")
    cpus = len(os.sched_getaffinity(0))
    one = replay(TRACE, "dram:hugepages=0", ReplayOptions(window=WindowOptions(requests=(0, 2), layers=1)), out=tmp_path / "one.parquet")
    assert one["backend"]["facts"]["workers"] == min(cpus, 256)
    two = replay(TRACE, "dram:hugepages=0", ReplayOptions(window=WindowOptions(requests=(0, 2), layers=1), instances=InstanceOptions(count=2)), out=tmp_path / "two.parquet")
    assert two["backend"]["facts"]["workers"] == 1 and two["backend"]["spec"].endswith(",workers=1")


def test_a_tier_larger_than_max_memory_is_shrunk_unless_given(tmp_path):
    stated("docs/replay.md", r"A tier the replay sizes itself that needs more than `--max-memory` \(default 4 GiB\) is "
                             r"shrunk to what fits, with a warning")
    stated("docs/replay.md", r"a `--tier-capacity` above `--max-memory`, or beyond 80 % of available memory")
    warnings: list[str] = []
    meta = replay(TRACE, "dram:hugepages=0", ReplayOptions(window=WindowOptions(requests=(0, 2), layers=1), tier=TierOptions(max_memory_bytes=8 << 20)), out=tmp_path / "small.parquet", warn=warnings.append)
    assert meta["tier"]["capacity_from"] == "--max-memory" and meta["tier"]["capacity_chunks"] == 8
    assert any("--max-memory allows 8" in w for w in warnings)
    with pytest.raises(ResourceLimitError, match="--max-memory"):
        replay(TRACE, "dram:hugepages=0", ReplayOptions(window=WindowOptions(requests=(0, 2), layers=1), tier=TierOptions(max_memory_bytes=8 << 20, capacity_bytes=1 << 30)), out=tmp_path / "given.parquet")


# -------------------------------------------------------------------------------- coverage
#: Options a doc says something about the default of, without a value of its own to check:
#: "the trace's" (a value from the input), or a rule computed per model.
NO_VALUE_STATED = {"--kv-layout": "docs/cli.md: the trace's", "--gpus": "the smallest power of two that holds the "
                   "weights, per model", "--model": "analysis.md: needed without a trace; the rest as record's",
                   "--tier-capacity-gib": "engine.md: the table cell after it states the HBM default",
                   "--tier-devices": "one per instance, a rule: tests/test_software_path.py checks it",
                   "--arrivals": "session for a trace with sessions on one closed-loop instance, a rule: "
                                 "tests/test_sessions.py checks it"}


def test_every_default_the_docs_state_of_an_option_is_checked():
    """A new "`--option` ... default" statement in a doc needs a check above."""
    checked = {what.split()[1].rstrip(":") for what, *_ in VALUES if what.split()[0] in
               ("replay", "record", "analyze", "calibrate", "report") and what.split()[1].startswith("--")}
    checked |= {"--load-gbps", "--warmup", "--promote", "--amortise-years", "--mfu", "--schedule"}  # analyze capacity's; fitted prefill mfu; the behaviour test
    found = {(name, m.group(1)) for name, text in DOCS.items() if name != "docs/performance.md"
             for m in re.finditer(r"`(--[a-z][\w-]*)[^`]*`[^`.;]{0,40}?\bdefault", text)}
    unchecked = sorted(f"{name}: {opt}" for name, opt in found if opt not in checked and opt not in NO_VALUE_STATED)
    assert not unchecked
