"""What the benchmarks in tools/ share: repetitions, result lines, the C baselines.

Every benchmark measures its baseline in the same run, repeats both several times, interleaved,
and prints one result line per figure:

    PASS  dram.load.cold  kvemu 10.66 GB/s [10.45-10.80] | C memcpy+clflush 11.00 GB/s [...] | ratio 0.97 | target >= 0.90

``[lo-hi]`` is the spread (min-max) of the repetitions, the number before it their median; the
ratio is the median of the per-repetition ratios (each repetition runs kvemu and its baseline
back to back, so drift of the machine between repetitions cancels), with their spread. The
status is PASS or FAIL against the target, FLOOR for a figure this machine cannot reach at all (an
emulated tier faster than the host), SKIP when something it needs is absent, INFO for a figure
without a target. tools/bench_all.py collects these lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
C_DIR = TOOLS / "c"
STATUSES = ("PASS", "FAIL", "FLOOR", "SKIP", "INFO")
#: flags the C baselines are built with: those of the kvemu extension (cbackends/build_ffi.py).
C_FLAGS = ["-std=gnu11", "-O2", "-Wall", "-Wextra"]


def parser(doc: str, quick_help: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(doc.strip().splitlines()[1:]))
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--repeat", type=int, default=None, help="repetitions (default: per benchmark, fewer with --quick)")
    return ap


def repeats(args, quick: int = 3, full: int = 5) -> int:
    return args.repeat or (quick if args.quick else full)


class Stat:
    """Repetitions of one figure: median and spread."""

    def __init__(self, values=()):
        self.values = [float(v) for v in values]

    def add(self, v) -> None:
        self.values.append(float(v))

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def lo(self) -> float:
        return min(self.values) if self.values else float("nan")

    @property
    def hi(self) -> float:
        return max(self.values) if self.values else float("nan")

    def fmt(self, digits: int = 2, unit: str = "") -> str:
        u = f" {unit}" if unit else ""
        if len(self.values) == 1:
            return f"{self.median:.{digits}f}{u}"
        return f"{self.median:.{digits}f}{u} [{self.lo:.{digits}f}-{self.hi:.{digits}f}]"


def result(status: str, key: str, text: str) -> None:
    """One result line (see the module docstring)."""
    assert status in STATUSES, status
    print(f"{status:<5} {key}  {text}", flush=True)


def ratios(value: Stat, base: Stat) -> Stat:
    """Per-repetition ratios value/base when both were measured in pairs (back to back), which
    cancels most of a shared machine's drift; else the one ratio of the medians."""
    if len(value.values) == len(base.values) and value.values:
        return Stat(v / b if b else float("nan") for v, b in zip(value.values, base.values))
    return Stat([value.median / base.median if base.median else float("nan")])


def ratio_result(key: str, label: str, value: Stat, base_label: str, base: Stat, unit: str,
                 min_ratio: float, digits: int = 2, note: str = "", status: str | None = None) -> float:
    """PASS when the median of the paired ratios value/base is >= min_ratio; returns that ratio."""
    r = ratios(value, base)
    status = status or ("PASS" if r.median >= min_ratio else "FAIL")
    result(status, key, f"{label} {value.fmt(digits, unit)} | {base_label} {base.fmt(digits, unit)} | "
                        f"ratio {r.fmt(3)} | target >= {min_ratio:.2f}{'  ' + note if note else ''}")
    return r.median


def info(text: str) -> None:
    """A detail line (not a result): indented, so bench_all leaves it out of the summary."""
    print(f"      {text}", flush=True)


def compile_c(name: str, outdir, extra=()) -> Path:
    """tools/c/NAME.c built with gcc into outdir (a temporary folder); returns the binary."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    out = Path(outdir) / name
    subprocess.run([gcc, *C_FLAGS, *extra, "-o", str(out), str(C_DIR / f"{name}.c")], check=True)
    return out


class MembwMT:
    """tools/c/membw_mt.c as a running process: W pinned threads that move the given transfers
    the way kvemu's memory tiers do (batches split into W contiguous shares, each piece timed,
    stores written back inside the timed region). Keeps its arena mapped between passes, so a
    benchmark can alternate its passes with kvemu's; ``run(op)`` performs one pass and returns
    its JSON line (``gbps`` = bytes / busy, as ``Backend.op_stats``)."""

    def __init__(self, binary, arena_bytes: int, block_bytes: int, seq, workers: int, cold: int,
                 hugepages: int = 1):
        self.p = subprocess.Popen([str(binary), str(arena_bytes), str(block_bytes), str(seq), str(workers),
                                   str(cold), str(hugepages)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, bufsize=1)
        self.ready = self._line()

    def _line(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            err = self.p.stderr.read().strip()[-400:]
            raise RuntimeError(f"membw_mt exited ({self.p.wait()}): {err}")
        return json.loads(line)

    def run(self, op: str) -> dict:
        self.p.stdin.write(op + "\n")
        self.p.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write("quit\n")
                self.p.stdin.close()
            except BrokenPipeError:
                pass
            self.p.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_json(cmd, timeout: float = 600) -> dict:
    """Runs a C baseline (or a kvemu command) that prints one JSON object on its last line."""
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}): {p.stderr.strip()[-400:]}")
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError:
        return json.loads(p.stdout.strip().splitlines()[-1])


def mooncake_path() -> Path:
    """The full Mooncake conversation trace (../shared/traces/ relative to the repository root)."""
    return REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def header(title: str, args=None) -> None:
    mode = "" if args is None else (" (quick)" if args.quick else " (full)")
    print(f"== {title}{mode}", flush=True)


def python() -> str:
    return sys.executable


def env_one_thread() -> dict:
    """Environment for child processes: one BLAS/OpenMP thread, so they stay on one core."""
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[k] = "1"
    return env


class ReplaySpy:
    """Records the arrays every ``Backend.replay`` call receives, inside ``with ReplaySpy() as spy:``.

    The benchmarks use it to time the C calls inside ``kvemu.replay`` and to rebuild the exact
    sequence of arena offsets a replay performed; it wraps the public method, nothing else.
    """

    def __init__(self, keep_arrays: bool = True):
        self.keep_arrays = keep_arrays
        self.calls: list[tuple] = []
        self.backends: list[int] = []  # id() of the backend of each call: the staging cursor is per backend
        self.c_seconds = 0.0
        self.n_calls = 0

    def __enter__(self):
        import time

        from kvemu.backends import Backend

        self._orig = orig = Backend.replay
        spy = self

        def replay(backend, table_off, table_slots, steps, entries, layer_span, kv=None):
            if spy.keep_arrays and kv is not None:
                raise RuntimeError("ReplaySpy rebuilds the transfers of full-attention models only: this replay "
                                   "moves KV groups (Backend.replay's kv)")
            if spy.keep_arrays:
                spy.calls.append((dict(backend.geometry), table_off.copy(), table_slots.copy(), steps.copy(),
                                  entries.copy(), layer_span.copy()))
                spy.backends.append(id(backend))
            t0 = time.perf_counter()
            try:
                return orig(backend, table_off, table_slots, steps, entries, layer_span, kv)
            finally:
                spy.c_seconds += time.perf_counter() - t0
                spy.n_calls += 1

        Backend.replay = replay
        return self

    def __exit__(self, *exc):
        from kvemu.backends import Backend

        Backend.replay = self._orig

    def transfers(self) -> dict:
        """The transfers kv_replay performed in the recorded calls, per op (see replay_transfers)."""
        return replay_transfers(self.calls, self.backends)


#: One transfer as memtier_access gets it (struct kv_access) plus its batch: tools/c/membw_mt.c's records.
TRANSFER_DTYPE = [("arena_off", "<u8"), ("bytes", "<u8"), ("staging_off", "<u8"), ("batch", "<u8")]
KV_BATCH = 256
KV_STAGING_MAX = 64 << 20


def replay_transfers(calls, backends=None) -> dict:
    """The transfers kv_replay performs for ``calls`` (ReplaySpy.calls: geometry and the arrays of
    each Backend.replay call), in order: {op: structured array of TRANSFER_DTYPE}. Mirrors
    cbackends/core.c: per step, per replayed layer, the phases load, read, store; in a phase, the
    entries' block ranges, consecutive slots of one chunk (chunk_blocks) merged into one transfer
    while staging stays contiguous; a batch is flushed at 256 transfers and at the end of each
    phase; staging offsets come from one cursor per backend, shared by loads and stores, which
    wraps when the next block does not fit (reads get 0). ``backends``: one key per call (calls
    with the same key share a cursor); default: all one backend."""
    import numpy as np

    ops = ("load", "read", "store")
    out = {op: [] for op in ops}
    cursors: dict = {}
    batch = 0
    for k, (geom, table_off, table_slots, steps, entries, layer_span) in enumerate(calls):
        key = backends[k] if backends is not None else 0
        cursor = cursors.get(key, 0)
        block, n_slots = int(geom["block_bytes"]), int(geom["n_slots"])
        chunk_g = int(geom.get("chunk_blocks", 1) or 1)
        arena = n_slots * int(geom["n_layers_replay"]) * block
        staging = min(arena, KV_STAGING_MAX)
        staging -= staging % block
        staging = staging or block
        slots = table_slots.tolist()
        toff = table_off.tolist()
        req = entries["req"].tolist()
        rng = {op: (entries[f"{op}_first"].tolist(), entries[f"{op}_count"].tolist()) for op in ops}
        for eb, ee in zip(steps["entry_begin"].tolist(), steps["entry_end"].tolist()):
            for j in range(len(layer_span)):
                base = j * n_slots
                for op in ops:
                    chunk = chunk_g if op != "read" else 1
                    first, count = rng[op]
                    rec = out[op]
                    n_batch = 0
                    for e in range(eb, ee):
                        c = count[e]
                        if not c:
                            continue
                        row = toff[req[e]] + first[e]
                        cur = None  # index in rec of the transfer the next block may extend
                        prev = None
                        for p in range(row, row + c):
                            s = slots[p]
                            if (cur is not None and s == prev + 1 and s // chunk == prev // chunk
                                    and rec[cur][2] + rec[cur][1] == cursor):
                                rec[cur][1] += block
                                cursor += block
                                if cursor + block > staging:
                                    cursor = 0
                                prev = s
                                continue
                            if n_batch == KV_BATCH:
                                batch += 1
                                n_batch = 0
                            if chunk > 1 and cursor + chunk * block > staging and chunk * block <= staging:
                                cursor = 0
                            if op == "read":
                                st_off = 0
                            else:
                                st_off = cursor
                                cursor += block
                                if cursor + block > staging:
                                    cursor = 0
                            rec.append([(base + s) * block, block, st_off, batch])
                            n_batch += 1
                            cur = len(rec) - 1 if chunk > 1 else None
                            prev = s
                    if n_batch:
                        batch += 1
        cursors[key] = cursor
    return {op: np.array([tuple(r) for r in out[op]], dtype=TRANSFER_DTYPE) for op in ops}


def sequential_loads(n_steps: int, per_step: int):
    """(table_off, steps, entries) for kv_replay: one request whose block table holds
    n_steps * per_step slots, loaded per_step per step in table order."""
    import numpy as np

    from kvemu.backends import ENTRY_DTYPE, STEP_DTYPE

    entries = np.zeros(n_steps, ENTRY_DTYPE)
    entries["load_first"] = np.arange(n_steps, dtype=np.uint32) * per_step
    entries["load_count"] = per_step
    steps = np.zeros(n_steps, STEP_DTYPE)
    steps["entry_begin"] = np.arange(n_steps)
    steps["entry_end"] = np.arange(1, n_steps + 1)
    return np.array([0, n_steps * per_step], np.uint64), steps, entries
