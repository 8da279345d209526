"""Emulated tiers: emu moves real bytes and waits to the profile's time; vemu computes it.

Timing checks compare totals of thousands of accesses with the model. The machine these run on is
a shared 2-vCPU VM: a preempted run is late, never early, so such checks take the best of five
attempts (a failure then means the emulation itself is off, not the neighbours).
"""
import errno
import json
import math
import os
import shutil
import subprocess
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvemu.backends import ENTRY_DTYPE, STEP_DTYPE, Backend, ffi, hist_bucket_lower_ns, lib
from kvemu.errors import BackendError, BackendUnavailable, ConfigError
from kvemu.profiles import BUILTIN_PROFILES, Profile
from kvemu.schema import METADATA_KEY
from timing_noise import host_units, measured

BLOCK = 4096


def load_steps(n_slots, per_step, n_steps, op="load"):
    """One request over slots 0..n_slots-1; step i does ``per_step`` accesses of ``op`` (positions wrap)."""
    table_off = np.array([0, n_slots], np.uint64)
    slots = np.random.default_rng(0).permutation(n_slots).astype(np.uint32)
    entries = np.zeros(n_steps, ENTRY_DTYPE)
    entries[f"{op}_first"] = (np.arange(n_steps) * per_step) % (n_slots - per_step + 1)
    entries[f"{op}_count"] = per_step
    steps = np.zeros(n_steps, STEP_DTYPE)
    steps["entry_begin"] = np.arange(n_steps)
    steps["entry_end"] = np.arange(1, n_steps + 1)
    return table_off, slots, steps, entries, np.ones(1, np.uint32)


def prepared(spec, n_slots=64, block=BLOCK):
    b = Backend(spec)
    b.prepare(block, n_slots, 1, 1, False)
    return b


def best_of(attempts, measure, ok):
    """Runs ``measure`` until ``ok(value)``, at most ``attempts`` times (timing_noise.measured:
    skipped when no attempt had a CPU to itself)."""
    return measured(attempts, measure, ok)


def write_profile(tmp_path, name, **fields):
    lines = [f'name = "{name}"'] + [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"'
                                   for k, v in fields.items()]
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- data path


def test_emu_stores_and_loads_bytes_intact():
    with prepared("emu:nvme,latency_ns=2000", n_slots=4) as b:
        for k in range(4):
            b.debug_poke("staging", k * BLOCK, bytes([k + 1]) * BLOCK)
        off, slots, steps, entries, span = load_steps(4, 4, 1, op="store")
        b.replay(off, slots, steps, entries, span)
        for pos, slot in enumerate(slots):
            assert b.debug_peek("arena", int(slot) * BLOCK, BLOCK) == bytes([pos + 1]) * BLOCK
        b.debug_poke("staging", 0, bytes(4 * BLOCK))
        off, slots2, steps, entries, span = load_steps(4, 4, 1, op="load")
        b.replay(off, slots, steps, entries, span)
        # the staging cursor continued after the 4 stores: staging blocks 0..3 again (4 blocks of staging)
        assert b.debug_peek("staging", 0, 4 * BLOCK) == b"".join(bytes([k + 1]) * BLOCK for k in range(4))
        d = b.describe()
        assert d["mode"] == "emulated" and d["virtual"] is False and d["accesses"] == 8
        assert d["profile"]["name"] == "nvme" and d["profile"]["latency_ns"] == 2000


def test_vemu_moves_nothing_and_needs_no_memory():
    # 1 TiB of arena: nothing is allocated in virtual time
    with Backend("vemu:nvme") as b:
        b.prepare(1 << 20, 1 << 20, 1, 1, False)
        assert b.describe()["arena_bytes"] == 1 << 40
        with pytest.raises(BackendUnavailable, match="not host-addressable"):
            b.debug_peek("arena", 0, 8)
        d = b.describe()
        assert d["mode"] == "emulated-virtual" and d["virtual"] is True and "floor_hits" not in d


# ---------------------------------------------------------------- timing


def test_every_access_takes_at_least_the_profile():
    p = Profile(name="t", kind="storage", latency_ns=3000, bandwidth_gbps=2, concurrency=4)
    with prepared("emu:" + "nvme,latency_ns=3000,bandwidth_gbps=2,concurrency=4", n_slots=256) as b:
        b.replay(*load_steps(256, 256, 2))
        st = b.op_stats("load")
        lower = hist_bucket_lower_ns()
        smallest = lower[np.flatnonzero(st["counts"])[0] + 1]  # upper bound of the lowest bucket used
        assert smallest >= p.access_ns(BLOCK)
        assert st["accesses"] == 512 and st["time_ns"] / 512 >= p.access_ns(BLOCK)


def test_storage_profile_mean_latency_and_wall_time(tmp_path):
    # a storage-like tier of 20 us, one access at a time: every access 20 us + 4 KiB / 2 GB/s
    path = write_profile(tmp_path, "disk", kind="storage", latency_ns=20000, bandwidth_gbps=2.0, concurrency=1)
    expected = 20000 + BLOCK / 2.0
    n = 400

    def measure():
        with prepared(f"emu:{path}", n_slots=n) as b:
            args = load_steps(n, n, 1)
            t0 = time.perf_counter()
            b.replay(*args)
            wall = (time.perf_counter() - t0) * 1e9
            st = b.op_stats("load")
        return st["time_ns"] / st["accesses"], st["busy_ns"], wall

    mean, busy, wall = best_of(5, measure, lambda v: abs(v[0] / expected - 1) < 0.05 and v[2] < 1.05 * v[1])
    assert mean == pytest.approx(expected, rel=0.05)
    # the run really took that long: the delay is paid on the clock, not just reported
    assert busy == pytest.approx(n * expected, rel=0.05)
    assert 0.99 * busy <= wall < 1.05 * busy


@pytest.mark.parametrize("per_step", [256, 1])
def test_sub_microsecond_delays_are_exact_in_total(per_step):
    # 1 us per 4 KiB access: what each access owes after the host's own ~0.2-0.5 us is under the
    # 1 us payment threshold, so it is deferred and paid in batches; the totals must still match.
    # per_step 1: each access is a backend call of its own, and the debt carries across calls.
    spec = "cxl-pool,latency_ns=1000,bandwidth_gbps=64,concurrency=1"
    n = 20480
    expected = n * (1000 + BLOCK / 64)

    def measure(backend):
        with prepared(f"{backend}:{spec}", n_slots=256) as b:
            args = load_steps(256, per_step, n // per_step)
            t0 = time.perf_counter()
            b.replay(*args)
            wall = (time.perf_counter() - t0) * 1e9
            hits = b.describe().get("floor_hits", 0)
            return wall, b.op_stats("load")["busy_ns"], hits

    # The replay core's own work between backend calls is not tier time (as for dram); vemu
    # replays the same accesses without waiting, so its wall time is that work.
    core = min(measure("vemu")[0] for _ in range(3))
    # A preempted access overruns its 1.06 us and counts as a floor hit, so hits are part of "ok".
    wall, busy, hits = best_of(8, lambda: measure("emu"),
                               lambda v: abs(v[1] / expected - 1) < 0.05 and v[0] < 1.05 * (v[1] + core)
                               and v[2] < 0.05 * n)
    assert hits < 0.05 * n
    assert busy == pytest.approx(expected, rel=0.05)
    assert 0.99 * busy <= wall < 1.05 * (busy + core)


def test_floor_hits_are_counted_for_a_tier_faster_than_this_host():
    # HBM moves 64 KiB in ~20 ns; no host copies that fast.
    prof = BUILTIN_PROFILES["hbm"]
    with prepared("emu:hbm", n_slots=256, block=65536) as b:
        b.replay(*load_steps(256, 256, 2))
        d = b.describe()
        st = b.op_stats("load")
    assert d["accesses"] == 512 and d["floor_hits"] >= 0.9 * 512
    assert d["floor_ns"] > prof.access_ns(65536)
    # the reported times are the host's, not the profile's
    assert st["time_ns"] / st["accesses"] > 2 * prof.access_ns(65536)


def _model_ns(profile, sizes):
    lat, busy = profile.batch_times(sizes)
    return [math.floor(x + 0.5) for x in lat], math.floor(busy + 0.5)


def test_vemu_reports_the_model_exactly():
    # nvme's software path (its kernel I/O part) stays under the overrides
    p = Profile(name="m", kind="storage", latency_ns=700.5, bandwidth_gbps=2.5, concurrency=3, overhead_ns=50.25,
                software=BUILTIN_PROFILES["nvme"].software)
    spec = "vemu:nvme,latency_ns=700.5,bandwidth_gbps=2.5,concurrency=3,overhead_ns=50.25"
    with prepared(spec, n_slots=600) as b:
        # 600 loads in one step: backend calls of 256, 256 and 88, each a batch of the model
        b.replay(*load_steps(600, 600, 1))
        st = b.op_stats("load")
    lat, busy = [], 0
    for n in (256, 256, 88):
        l_, b_ = _model_ns(p, [BLOCK] * n)
        lat += l_
        busy += b_
    assert st["accesses"] == 600 and st["busy_ns"] == busy and st["time_ns"] == sum(lat)
    lower = hist_bucket_lower_ns()
    expected_counts = np.zeros(lower.size, np.uint64)
    for v in lat:
        expected_counts[np.searchsorted(lower, v, side="right") - 1] += 1
    assert np.array_equal(st["counts"], expected_counts)


def test_vemu_step_times_compose_from_the_model():
    p = BUILTIN_PROFILES["nvme"]
    with prepared("vemu:nvme", n_slots=64) as b:
        step_out, entry_out = b.replay(*load_steps(64, 8, 5))
    _, busy8 = _model_ns(p, [BLOCK] * 8)
    assert step_out["load_ns"].tolist() == [busy8] * 5
    assert step_out["step_ns"].tolist() == [busy8] * 5
    # each access is charged its share of the busy time, rounded per access
    assert np.all(np.abs(entry_out["load_ns"] - busy8) <= 8)


def test_vemu_is_fast():
    n_slots, per_step, n_steps = 4096, 4096, 500   # 2 M block accesses
    with prepared("vemu:cxl-pool", n_slots=n_slots) as b:
        args = load_steps(n_slots, per_step, n_steps)
        b.replay(*load_steps(n_slots, per_step, 2))  # warm up
        _, units = host_units(lambda: b.replay(*args))
    # in CPU time against this host's speed (timing_noise.host_units): a loaded host does not fail it
    assert units < 40, f"2 M virtual block accesses took {units:.0f} reference units of CPU time"


# ---------------------------------------------------------------- chase


def test_chase():
    with prepared("dram", n_slots=4096) as b:
        # a hop is a DRAM access: a host too busy to give this thread its CPU skips (timing_noise)
        assert 10 < best_of(3, lambda: b.chase(20000), lambda ns: 10 < ns < 10000) < 10000
    with prepared("vemu:nvme,overhead_ns=500", n_slots=16) as b:
        assert b.chase(10) == 65500
        assert b.describe()["hops"] == 10
    with Backend("dram") as b:
        with pytest.raises(BackendError, match="not prepared") as info:
            b.chase(10)
        assert info.value.errno == errno.EINVAL
    with prepared("dram", n_slots=1, block=64) as b:
        with pytest.raises(BackendError, match="fewer than 2 lines"):
            b.chase(10)
    with pytest.raises(ConfigError, match="hops must be an integer in"):
        with prepared("dram") as b:
            b.chase(0)


def test_emu_chase_pays_each_hop():
    with prepared("emu:cxl-pool,latency_ns=2000", n_slots=4096) as b:
        ns = best_of(5, lambda: b.chase(5000), lambda v: abs(v / 2000 - 1) < 0.05)
        d = b.describe()
    assert ns == pytest.approx(2000, rel=0.05)
    assert d["hops"] >= 5000 and d["hop_floor_ns"] < 2000


# ---------------------------------------------------------------- options through C


@pytest.mark.parametrize("name,args,message", [
    ("emu", "latency_ns=1,gbps=1", "emu: a profile needs latency_ns, gbps and concurrency"),
    ("emu", "latency_ns=1,gbps=0,concurrency=1", "emu: option gbps is '0', must be a finite number > 0"),
    ("emu", "latency_ns=-1,gbps=1,concurrency=1", "emu: option latency_ns is '-1', must be a finite number >= 0"),
    ("emu", "latency_ns=inf,gbps=1,concurrency=1", "must be a finite number"),
    ("emu", "latency_ns=1,gbps=1,concurrency=1.5", "emu: option concurrency is '1.5', must be an integer"),
    ("emu", "latency_ns=1,gbps=1,concurrency=0", "must be an integer in 1..1048576"),
    ("emu", "latency_ns=1,gbps=1,concurrency=1,kind=tape", "emu: option kind is 'tape', must be memory or storage"),
    ("emu", "latency_ns=1,gbps=1,concurrency=1,name=a\"b", "emu: option name"),
    ("emu", "latency_ns=1,gbps=1,concurrency=1,qd=3", "emu: unknown option 'qd=3' (known: latency_ns=X"),
    ("vemu", "latency_ns=1,gbps=1,concurrency=1,hugepages=1", "vemu: unknown option 'hugepages=1'"),
    ("emu", "latency_ns,gbps=1,concurrency=1", "emu: option latency_ns needs a value: latency_ns=X"),
    ("emu", "latency_ns=1,gbps=1,concurrency=1,cold=1", "emu: cold=1 is not supported"),
])
def test_c_option_errors(name, args, message):
    ctx = ffi.gc(lib.kv_ctx_new(), lib.kv_ctx_free)
    assert lib.kv_backend_open(ctx, name.encode(), args.encode()) == -errno.EINVAL
    assert message in ffi.string(lib.kv_errmsg(ctx)).decode()


# ---------------------------------------------------------------- replay and results


def results_meta(path):
    return json.loads(pq.read_schema(path).metadata[METADATA_KEY])


def test_replay_trace_on_emu_and_vemu(tmp_path, chat_trace):
    from kvemu.replay import ReplayOptions, TierOptions, WindowOptions, replay
    from kvemu.report import build_report, render_table

    seen = []
    runs = []
    for spec in ("emu:hbm", "vemu:cxl-pool", "dram"):
        out = tmp_path / f"{spec.replace(':', '-')}.parquet"
        meta = replay(chat_trace, spec, ReplayOptions(window=WindowOptions(layers=1)), out=out, warn=seen.append)
        assert results_meta(out)["backend"] == meta["backend"]
        runs.append(str(out))
        b = meta["backend"]
        if spec == "dram":
            # a loaded test machine may add its load warning (test_host_load.py); nothing else
            assert b["mode"] == "measured" and b["virtual"] is False
            assert [w for w in meta["warnings"] if not w.startswith("other processes took")] == []
            continue
        assert b["mode"] == "emulated" and b["requested"] == spec and b["substituted_because"] is None
        assert b["facts"]["profile"]["name"] == spec.split(":")[1]
        assert b["facts"]["accesses"] == sum(meta["ops"][op]["accesses"] for op in ("load", "store", "read"))
        if spec.startswith("vemu"):
            assert b["virtual"] is True and b["facts"]["mode"] == "emulated-virtual"
            assert meta["warnings"] == []
        else:
            # HBM is faster than this host: the results say so, in facts and in a warning
            assert b["virtual"] is False and b["facts"]["mode"] == "emulated"
            assert b["facts"]["floor_hits"] > 0.9 * b["facts"]["accesses"]
            own = [w for w in meta["warnings"] if not w.startswith("other processes took")]  # a loaded host's
            assert len(own) == 1 and "took longer on this host than profile 'hbm'" in own[0]
    assert seen == [w for r in runs for w in results_meta(r)["warnings"]]
    text = render_table(build_report(runs), width=160)
    assert "emulated floor-limited" in text and "virtual" in text and "measured" in text
    assert "emulated, floor-limited 100% (upper bound)" in text


def test_emulate_missing_substitutes_an_unavailable_backend(tmp_path, chat_trace):
    from kvemu.replay import ReplayOptions, TierOptions, WindowOptions, replay

    try:
        with Backend("numa:1") as b:
            b.prepare(BLOCK, 4, 1, 1, False)
        pytest.skip("numa:1 is available on this machine")
    except BackendUnavailable:
        pass
    out = tmp_path / "r.parquet"
    with pytest.raises(BackendUnavailable):
        replay(chat_trace, "numa:1", ReplayOptions(window=WindowOptions(layers=1)), out=out)
    assert not out.exists()
    seen = []
    meta = replay(chat_trace, "numa:1", ReplayOptions(window=WindowOptions(layers=1), tier=TierOptions(emulate_missing=True)), out=out, warn=seen.append)
    b = results_meta(out)["backend"]
    assert b["spec"] == "emu:remote-numa" and b["requested"] == "numa:1" and b["mode"] == "emulated"
    assert b["substituted_because"] and "numa" in b["substituted_because"]
    assert seen[0].startswith("backend numa:1 is unavailable here (") and "emu:remote-numa instead" in seen[0]
    assert meta["label"].startswith("emu:remote-numa/")
    # a backend with no counterpart still fails
    assert replay(chat_trace, "dram", ReplayOptions(window=WindowOptions(layers=1), tier=TierOptions(emulate_missing=True)), out=tmp_path / "d.parquet")["backend"]["requested"] == "dram"


def test_cli_replay_emulate_missing_warns_on_stderr(tmp_path, chat_trace):
    from click.testing import CliRunner

    from kvemu.cli import cli

    out = tmp_path / "r.parquet"
    res = CliRunner().invoke(cli, ["replay", str(chat_trace), "--backend", "numa:1", "--layers", "1",
                                   "--emulate-missing", "--out", str(out)])
    if res.exit_code == 0 and "is unavailable here" not in res.stderr:
        pytest.skip("numa:1 is available on this machine")
    assert res.exit_code == 0, res.output
    assert "warning: backend numa:1 is unavailable here" in res.stderr
    assert "on emu:remote-numa (emulated" in res.stdout
    res = CliRunner().invoke(cli, ["replay", str(chat_trace), "--backend", "vemu:nvme", "--layers", "1",
                                   "--out", str(tmp_path / "v.parquet")])
    assert res.exit_code == 0 and "(virtual" in res.stdout


# ---------------------------------------------------------------- C API under sanitizers

CB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cbackends")

DRIVER = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "kvemu.h"

static int failures;
#define EXPECT(cond) do { if (!(cond)) { failures++; \
    fprintf(stderr, "line %d: %s (msg: %s)\n", __LINE__, #cond, kv_errmsg(ctx)); } } while (0)

static void run(const char *name, const char *args)
{
    struct kv_ctx *ctx = kv_ctx_new();
    struct kv_geom g = { .block_bytes = 4096, .n_slots = 8, .n_layers_model = 2, .n_layers_replay = 2 };
    uint64_t off[2] = { 0, 8 }, tot[4];
    uint32_t slots[8] = { 7, 6, 5, 4, 3, 2, 1, 0 }, span[2] = { 1, 1 };
    struct kv_entry e[1] = { { 0, 0, 8, 0, 8, 0, 8 } };
    struct kv_step st[1] = { { 0, 1, 100 } };
    struct kv_step_out so[1];
    struct kv_entry_out eo[1];
    double ns = 0;
    char buf[2048];

    EXPECT(kv_chase(ctx, 10, &ns) == -EINVAL);
    EXPECT(kv_backend_open(ctx, name, args) == 0);
    EXPECT(kv_chase(ctx, 10, &ns) == -EINVAL);
    EXPECT(kv_describe(ctx, buf, sizeof(buf)) > 0);
    EXPECT(kv_prepare(ctx, &g) == 0);
    EXPECT(kv_chase(ctx, 0, &ns) == -EINVAL);
    EXPECT(kv_chase(ctx, 100, NULL) == -EINVAL);
    EXPECT(kv_chase(ctx, 100, &ns) == 0 && ns > 0);
    EXPECT(kv_replay(ctx, off, 1, slots, 8, st, 1, e, 1, span, NULL, so, eo) == 1);
    EXPECT(kv_op_stats(ctx, KV_OP_STORE, NULL, 0, tot) == 0 && tot[0] == 16);
    EXPECT(so[0].step_ns > 100 && eo[0].read_ns > 0);
    EXPECT(kv_describe(ctx, buf, sizeof(buf)) > 0);
    EXPECT(strcmp(name, "dram") == 0 || strstr(buf, "\"accesses\":48") != NULL);
    kv_ctx_free(ctx);
}

int main(void)
{
    struct kv_ctx *ctx = kv_ctx_new();

    EXPECT(kv_backend_open(ctx, "emu", "latency_ns=1,gbps=x,concurrency=1") == -EINVAL);
    EXPECT(kv_backend_open(ctx, "emu", "latency_ns=1,gbps=1,concurrency=99999999999999") == -EINVAL);
    EXPECT(kv_backend_open(ctx, "vemu", ",,latency_ns=1,gbps=1,") == -EINVAL);
    kv_ctx_free(ctx);
    run("emu", "name=t,kind=storage,latency_ns=500,gbps=2,concurrency=3,overhead_ns=10,hugepages=0");
    run("vemu", "latency_ns=500,gbps=2,concurrency=3");
    run("dram", "");
    if (failures == 0)
        printf("ok\n");
    return failures != 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_emu_and_chase_under_sanitizers(tmp_path):
    sources = sorted(os.path.join(CB, f) for f in os.listdir(CB) if f.endswith(".c"))
    (tmp_path / "driver.c").write_text(DRIVER)
    exe = str(tmp_path / "driver")
    r = subprocess.run(["gcc", "-std=gnu11", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                        f"-I{CB}", "driver.c", *sources, "-o", exe], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([exe], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ, ASAN_OPTIONS="detect_leaks=1"))
    assert r.returncode == 0 and r.stdout == "ok\n", r.stdout + r.stderr
