"""Every example in the README, docs/cli.md and every command's --help runs, with default options, here.

The examples are collected from the texts themselves (so an example added later is run too), in an
order that lets each find what an earlier one wrote: records, trace commands, calibration,
replays, sweeps, reports, analyses, the demo. Inputs a user brings are laid out first under the
names the examples use (a Mooncake JSONL, an Azure CSV, a vLLM event capture, a v1 trace, the
examples/ and traces/ folders); an example that needs ../shared/traces skips without it, and the
Dask one runs against a LocalCluster started on the address it names.
"""
import json
import re
import shlex
import shutil
import socket
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvemu.cli import cli

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MOONCAKE = SHARED / "traces" / "mooncake_conversation_trace.jsonl"
ORDER = ("record", "trace", "calibrate", "replay", "sweep", "report", "analyze", "demo")


def _join(lines):
    """Example lines with continuations joined and trailing comments dropped."""
    out, cur = [], ""
    for line in lines:
        line = line.strip()
        if cur:
            line = cur + " " + line
        if line.endswith("\\"):
            cur = line[:-1].strip()
            continue
        cur = ""
        out.append(line.split("  #")[0].split(" # ")[0].strip())
    return out


def help_examples() -> list[str]:
    """Every ``kvemu ...`` line of every command's help (continuations joined)."""
    found = []

    def walk(cmd):
        lines, i = (cmd.help or "").splitlines(), 0
        while i < len(lines):
            line = lines[i].strip()
            if re.match(r"kvemu [a-z]", line) and not line.startswith("kvemu reads"):
                block = [line]
                while block[-1].endswith("\\") and i + 1 < len(lines):
                    i += 1
                    block.append(lines[i].strip())
                found.extend(_join(block))
            i += 1
        if isinstance(cmd, click.Group):
            for sub in cmd.commands.values():
                walk(sub)

    walk(cli)
    return found


#: Where the documented examples are: the README's Quick start and docs/cli.md's worked examples.
EXAMPLE_DOCS = ("README.md", "docs/cli.md")


def readme_examples() -> list[str]:
    text = "\n".join((ROOT / name).read_text() for name in EXAMPLE_DOCS)
    found = []
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        lines, i = block.splitlines(), 0
        while i < len(lines):
            line = lines[i].strip()
            if "&& kvemu " in line:
                line = "kvemu " + line.split("&& kvemu ", 1)[1]
            if line.startswith("kvemu "):
                chunk = [line]
                while chunk[-1].endswith("\\") and i + 1 < len(lines):
                    i += 1
                    chunk.append(lines[i].strip())
                found += _join(chunk)
            i += 1
    return found


def _rank(example: str) -> int:
    verb = example.split()[1]
    return ORDER.index(verb) if verb in ORDER else len(ORDER)


def _lay_out_inputs(work: Path) -> None:
    """What a user brings, under the names the examples use."""
    if MOONCAKE.exists():
        with MOONCAKE.open() as src:
            lines = [next(src) for _ in range(300)]
        (work / "conv.jsonl").write_text("".join(lines))
    else:
        rows = [{"timestamp": 1000 * i, "input_length": 1024 + 512 * (i % 5), "output_length": 20,
                 "hash_ids": list(range(2 + i % 5))} for i in range(300)]
        (work / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stamps = [f"2023-11-16 18:{15 + i // 60:02d}:{i % 60:02d}.0000000" for i in range(200)]
    (work / "code.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                   + "".join(f"{t},{900 + 37 * (i % 9)},{12 + i % 7}\n" for i, t in enumerate(stamps)))
    shutil.copy(ROOT / "tests" / "data" / "vllm_events_sample.msgpack", work / "events.msgpack")
    shutil.copy(ROOT / "tests" / "data" / "golden-trace-v1.parquet", work / "old.parquet")
    shutil.copytree(ROOT / "examples", work / "examples")
    shutil.copytree(ROOT / "traces", work / "traces")
    if SHARED.exists():
        (work.parent / "shared").symlink_to(SHARED)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_every_readme_and_help_example_runs(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    _lay_out_inputs(work)
    monkeypatch.chdir(work)
    examples = list(dict.fromkeys(readme_examples() + help_examples()))
    assert len(examples) > 30
    examples.sort(key=_rank)  # stable: doc order within a verb
    runner = CliRunner()
    failures, skipped, cluster = [], [], None
    try:
        missing: set[str] = set()  # what skipped examples would have written
        for example in examples:
            words = shlex.split(example)
            needs = [w for w in words if w in missing or any(w.endswith((f":{m}", f"={m}")) for m in missing)]  # emu:PATH, software_from=PATH
            if ("../shared/" in example and not SHARED.exists()) or needs:
                skipped.append(f"{example}: {'no ../shared/traces here' if not needs else 'needs ' + needs[0]}")
                if "--out" in words:
                    missing.add(words[words.index("--out") + 1])
                continue
            if example.split()[1] == "report" and "moved/chat.parquet" in example and not (work / "moved").exists():
                (work / "moved").mkdir()
                shutil.copy(work / "chat.parquet", work / "moved" / "chat.parquet")  # the user moved it
            if "dask://" in example:
                distributed = pytest.importorskip("distributed")
                port = int(re.search(r"dask://[^:]+:(\d+)", example).group(1))
                if cluster is None:
                    if not _port_free(port):
                        skipped.append(f"{example}: port {port} is busy")
                        continue
                    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                                       scheduler_port=port, dashboard_address=None)
            if "uring:/var/tmp/" in example and not Path("/var/tmp").is_dir():
                skipped.append(f"{example}: no /var/tmp")
                continue
            res = runner.invoke(cli, shlex.split(example)[1:])
            if res.exit_code == 2 and "not written: other processes took" in res.output:
                # calibrate --out on a loaded host refuses, as documented (docs/errors.md): not a failure
                skipped.append(f"{example}: this host was loaded ({res.output.strip().splitlines()[-1][:120]})")
                missing.add(words[words.index("--out") + 1])
                continue
            if res.exit_code != 0:
                failures.append(f"{example}\n  exit {res.exit_code}: {res.output.strip()[-400:]}"
                                f"{'' if res.exception is None or isinstance(res.exception, SystemExit) else repr(res.exception)}")
    finally:
        if cluster is not None:
            cluster.close()
    assert not failures, "examples that failed:\n" + "\n".join(failures)
