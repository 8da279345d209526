"""calibrate --software: the fit of a storage stack's software path, and software_from.

The fit is checked against timings made here from known costs (with noise and preempted outliers);
the measurement method against a virtual tier whose per-object and per-byte costs are computed by
hand from its profile; a real io_uring calibration on a small file writes a profile that a replay
takes, alone and as the software parts of another profile. Mooncake runs where its client imports.
"""
import json
import os
import tomllib

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from kvemu.backend_spec import emulated_backend_args
from kvemu.calibrate import COST_TERMS, _measure_software, calibrate_software, fit_costs, profile_of
from kvemu.cli import cli
from kvemu.errors import ConfigError
from kvemu.profiles import BUILTIN_PROFILES, load_profile, resolve_profile

GRID_N = (1, 4, 16, 64)
GRID_S = (4096, 65536, 262144, 1048576)
TRACE = "traces/chat-llama3-8b-offload.parquet"


def synthetic(costs, reps, noise, slow_share=0.0, seed=0):
    """Batch times from known costs: a + b n + c n s, times log-normal noise; ``slow_share`` of them
    three times as long (a preempted batch: a shared host makes a timing slow, never fast)."""
    rng = np.random.default_rng(seed)
    n, s, t = [], [], []
    for b in GRID_N:
        for size in GRID_S:
            for _ in range(reps):
                exact = costs[0] + costs[1] * b + costs[2] * b * size
                y = exact * rng.lognormal(0.0, noise)
                if rng.random() < slow_share:
                    y *= 3
                n.append(b), s.append(size), t.append(y)
    return n, s, t


def test_the_fit_gives_exact_costs_back_from_exact_timings():
    costs = (40_000.0, 9_000.0, 0.8)
    fit = fit_costs(*synthetic(costs, reps=2, noise=0.0))
    for term, want in zip(COST_TERMS, costs):
        assert fit[term] == pytest.approx(want, rel=1e-9)
        assert fit["stderr"][term] == pytest.approx(0.0, abs=1e-6 * want)
    assert fit["r2"] == pytest.approx(1.0) and fit["max_abs_rel_residual"] < 1e-9
    assert fit["held_at_zero"] == [] and fit["points"] == 16 and fit["timings"] == 32


@pytest.mark.parametrize("costs", [(40_000.0, 9_000.0, 0.8), (300_000.0, 120_000.0, 1.6), (2_000.0, 500.0, 0.05)],
                         ids=["uring-like", "store-like", "fast"])
def test_the_fit_recovers_known_costs_through_noise_and_outliers(costs):
    # 5 % noise and one timing in ten preempted (3x): the medians keep the costs within 10 %, and each
    # within four of its own standard errors
    fit = fit_costs(*synthetic(costs, reps=9, noise=0.05, slow_share=0.1, seed=3))
    for term, want in zip(COST_TERMS, costs):
        assert fit[term] == pytest.approx(want, rel=0.10), term
        assert abs(fit[term] - want) <= 4 * fit["stderr"][term] + 1e-3 * want, term
        assert 0 < fit["stderr"][term] < 0.2 * want
    assert fit["r2"] > 0.98


def test_a_cost_that_is_not_there_is_held_at_zero():
    # no fixed cost per request: the unconstrained fit may go below zero, the fit never does
    costs = (0.0, 20_000.0, 0.5)
    for seed in range(4):
        fit = fit_costs(*synthetic(costs, reps=5, noise=0.05, seed=seed))
        assert fit["ns_per_request"] >= 0
        assert fit["ns_per_request"] < 0.5 * costs[1]  # small against one object's cost
        assert fit["ns_per_io"] == pytest.approx(costs[1], rel=0.1)
        assert fit["ns_per_byte"] == pytest.approx(costs[2], rel=0.1)


def test_a_grid_that_cannot_tell_the_costs_apart_is_refused():
    with pytest.raises(ConfigError, match="two batch sizes and two object sizes"):
        fit_costs([4, 4, 4], [4096, 8192, 16384], [1.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match="--batches needs at least two"):
        calibrate_software("uring:/var/tmp/x.bin", batches=(8,), sizes=(4096, 8192))
    with pytest.raises(ConfigError, match="--sizes needs at least two object sizes, multiples of 512"):
        calibrate_software("uring:/var/tmp/x.bin", batches=(1, 8), sizes=(4096, 5000))


def test_the_method_gives_a_virtual_tier_its_costs_back(tmp_path):
    # one access at a time (concurrency 1): a batch of n objects of s bytes takes, by hand,
    # n x (3 us software + 20 us latency) + n s x (1 / 2 GB/s + 0.25 ns per byte), nothing per request
    path = tmp_path / "slow.toml"
    path.write_text('[profile]\nname = "slow"\nkind = "storage"\nlatency_ns = 20000.0\nbandwidth_gbps = 2.0\n'
                    'concurrency = 1\n[profile.software.part]\nns_per_io = 3000.0\nns_per_byte = 0.25\n'
                    'source = "a test"\n')
    r = _measure_software(f"vemu:{path}", batches=(1, 4, 16), sizes=(4096, 65536), reps=3, name=None, log=None)
    fit = r["fit"]
    assert fit["ns_per_request"] == pytest.approx(0.0, abs=1.0)
    assert fit["ns_per_io"] == pytest.approx(23_000.0, rel=1e-4)
    assert fit["ns_per_byte"] == pytest.approx(0.5 + 0.25, rel=1e-4)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-6)
    # with no wire or medium of its own, the profile's parts replay the fit
    p = resolve_profile(str(path))
    got = profile_of(r)
    assert got.latency_ns == 0 and got.concurrency == 1
    assert got.access_ns(65536) == pytest.approx(p.access_ns(65536), rel=1e-3)


def _meta(path):
    return json.loads(pq.read_schema(path).metadata[b"kvemu"])


def test_uring_calibration_writes_a_profile_replay_takes(tmp_path):
    out = tmp_path / "fs.toml"
    spec = f"uring:{tmp_path / 'kv.bin'}"
    r = CliRunner().invoke(cli, ["calibrate", "--backend", spec, "--software", "--batches", "1,8", "--sizes",
                                 "4KiB,64KiB", "--reps", "3", "--out", str(out), "--force-load", "--json"])
    if r.exit_code == 2 and "io_uring" in r.output:
        pytest.skip(f"io_uring cannot run here: {r.output.strip()}")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["kind"] == "software" and result["transport"] == "io_uring O_DIRECT"
    assert result["grid"] == {"batches": [1, 8], "object_bytes": [4096, 65536], "reps": 3}
    assert result["fit"]["timings"] == 12 and result["fit"]["points"] == 4
    fs = result["filesystem"]
    assert len(fs["points"]) == 4 and all(p["fs_ns"] > 0 and p["direct_ns"] > 0 for p in fs["points"])
    assert fs["share_median"] == pytest.approx(float(np.median([p["share"] for p in fs["points"]])))
    # nothing left beside the profile: the tier file and the file of the file-system reads are removed
    assert sorted(os.listdir(tmp_path)) == ["fs.toml"]
    doc = tomllib.loads(out.read_text())
    cal = doc["calibration"]
    assert cal["what"] == "software path" and cal["transport"] == "io_uring O_DIRECT"
    assert cal["measured_on"] and cal["date"] and cal["kvemu_version"] and cal["fit_r2"] <= 1.0
    assert all(f"fit_{t}_stderr" in cal for t in COST_TERMS)
    p = load_profile(out)
    assert p.kind == "storage" and p.concurrency == 1
    assert p.latency_ns == pytest.approx(result["fit"]["ns_per_io"])
    assert all("measured by kvemu calibrate --software" in part.source for part in p.software)
    # a replay takes it alone, and as the software parts on a built-in's wire and medium
    for backend in (f"vemu:{out}", f"vemu:nvme,software_from={out}"):
        res = tmp_path / "r.parquet"
        rr = CliRunner().invoke(cli, ["replay", TRACE, "--backend", backend, "--out", str(res), "--force"])
        assert rr.exit_code == 0, rr.output
        sw = _meta(res)["backend"].get("software_path")
        if p.software:
            assert sw["parts"] == {part.name: part.to_dict() for part in p.software}
            assert sw["parts_from"] == str(out) if "software_from" in backend else sw["parts_from"] == p.name
            assert sw["wire_and_medium_from"] == ("nvme" if "software_from" in backend else p.name)
        res.unlink()


def test_software_from_takes_the_parts_and_keeps_the_wire_and_medium(tmp_path):
    parts = tmp_path / "parts.toml"
    parts.write_text('[profile]\nname = "measured"\nkind = "storage"\nlatency_ns = 0.0\nbandwidth_gbps = 100000.0\n'
                     'concurrency = 1\n[profile.software.object_rpc]\nns_per_io = 4000.0\nsource = "measured"\n'
                     '[profile.software.host_copy]\nns_per_byte = 0.5\nsource = "measured"\n')
    # a profile key, relative to the file's folder
    (tmp_path / "sub").mkdir()
    deploy = tmp_path / "sub" / "deploy.toml"
    deploy.write_text('name = "deploy"\nkind = "storage"\nlatency_ns = 2000.0\nbandwidth_gbps = 20.0\n'
                      'concurrency = 16\nsoftware_from = "../parts.toml"\n')
    p = load_profile(deploy)
    want = BUILTIN_PROFILES["rdma-storage"]
    assert (p.latency_ns, p.bandwidth_gbps, p.concurrency) == (2000.0, 20.0, 16)
    assert [s.name for s in p.software] == ["object_rpc", "host_copy"] and p.software_ns_per_io == 4000.0
    assert p.software_from == str(tmp_path / "sub" / "../parts.toml")
    # by hand: 4 us per object, and 64 KiB through 20 GB/s in series with 0.5 ns per byte
    assert p.access_ns(65536) == pytest.approx(4000.0 + 2000.0 + 65536 * (1 / 20.0 + 0.5))
    # it writes and reads back the same: the parts taken, and where from
    again = tmp_path / "again.toml"
    again.write_text(p.to_toml())
    assert load_profile(again) == p
    # a backend option on a built-in: its wire and medium, the file's parts
    q, _ = emulated_backend_args(f"vemu:rdma-storage,software_from={parts}")
    assert (q.latency_ns, q.bandwidth_gbps, q.concurrency) == (want.latency_ns, want.bandwidth_gbps,
                                                               want.concurrency)
    assert q.software == load_profile(parts).software and q.software_from == str(parts)


def test_software_from_refusals(tmp_path):
    bad = tmp_path / "a.toml"
    for text, message in [
        ('kind = "storage"\nlatency_ns = 1.0\nbandwidth_gbps = 1.0\nconcurrency = 1\nsoftware_from = "nope.toml"\n',
         "software_from: .*nope.toml: profile file not found"),
        ('kind = "storage"\nlatency_ns = 1.0\nbandwidth_gbps = 1.0\nconcurrency = 1\nsoftware_from = "cxl-pool"\n',
         "software_from 'cxl-pool': profile cxl-pool has no software parts"),
        ('kind = "memory"\nlatency_ns = 1.0\nbandwidth_gbps = 1.0\nconcurrency = 1\nsoftware_from = "nvme"\n',
         "'software_from' is for storage tiers"),
        ('kind = "storage"\nlatency_ns = 1.0\nbandwidth_gbps = 1.0\nconcurrency = 1\nsoftware_from = 3\n',
         "'software_from' must be a profile name or .toml path"),
        ('kind = "storage"\nlatency_ns = 1.0\nbandwidth_gbps = 1.0\nconcurrency = 1\nsoftware_from = "a.toml"\n',
         "leads back to this file"),
    ]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_profile(bad)
    # on the command line: one line, exit 2, nothing written
    out = tmp_path / "r.parquet"
    r = CliRunner().invoke(cli, ["replay", TRACE, "--backend", f"vemu:nvme,software_from={tmp_path}/none.toml",
                                 "--out", str(out)])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "profile file not found" in r.output
    assert not out.exists()


def test_calibrate_software_refusals_are_one_line(tmp_path):
    out = tmp_path / "p.toml"
    for args, message in [
        (["--backend", "uring:/nonexistent-kvemu-dir/kv.bin", "--software"], "does not exist"),
        (["--backend", "dram", "--software"], "dram is a memory tier"),
        (["--backend", "vemu:nvme", "--software"], "is a profile's model"),
        (["--backend", f"uring:{tmp_path}/kv.bin", "--software", "--batches", "1,x"], "--batches: 'x' is not"),
        (["--backend", f"uring:{tmp_path}/kv.bin", "--software", "--sizes", "4KiB,lots"], "--sizes"),
        (["--backend", f"uring:{tmp_path}/kv.bin", "--software", "--batches", "1,512"], "1..256"),
    ]:
        r = CliRunner().invoke(cli, ["calibrate", *args, "--out", str(out)])
        assert r.exit_code == 2, r.output
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], r.output
        assert not out.exists() and os.listdir(tmp_path) == []


def _mooncake_missing():
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any reason it cannot load is a reason to skip
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.skipif(_mooncake_missing() is not None, reason=f"Mooncake Store client not importable: "
                                                            f"{_mooncake_missing()}")
def test_mooncake_calibration_is_flagged_as_tcp_over_loopback(tmp_path):
    from importlib.metadata import version

    from kvemu.calibrate import render_software_table, write_profile
    from kvemu.isolation import private_interfaces
    from kvemu.profiles import SoftwarePart

    # the default spec: no allow_exposed, the store in a network namespace of its own where one can be made
    r = calibrate_software("mooncake", batches=(1, 8), sizes=(4096, 65536), reps=3)
    assert r["transport"] == "tcp-loopback" and r["measured_on"]
    assert r["isolation"]["isolation"] == "netns" and r["facts"]["exposed"] == []
    assert r["isolation"]["interfaces"] == ["lo"] and private_interfaces() is None  # this process: the host's
    assert r["facts"]["listening"]
    # the generation names the software and its version as the package says it, and the wire
    gen = f"Mooncake Store {version('mooncake-transfer-engine-non-cuda')} over TCP loopback, measured on "
    assert r["generation"].startswith(gen) and r["profile"]["generation"] == r["generation"]
    # over loopback every measured time is the store's software: its share of the KV time is that of the
    # per-object and per-byte parts against them and the no-medium profile's 100,000 GB/s (per-request
    # lookups aside, step time in a replay), by hand
    io, byte = (sum(p.get(k, 0.0) for p in r["profile"]["software"].values()) for k in ("ns_per_io", "ns_per_byte"))
    sw = sum(b * (io + size * byte) for b in (1, 8) for size in (4096, 65536))
    busy = sum(round(b * (io + size * (byte + 1e-5))) for b in (1, 8) for size in (4096, 65536))
    share = r["software_share"]["software_share"]
    assert share == pytest.approx(sw / busy, rel=1e-6, abs=1e-9)
    text = render_software_table(r)
    assert f"generation   {r['generation']}: software {100 * share:.0f} % of its KV time" in text
    assert "isolation    a private network namespace" in text
    assert r["fit"]["points"] == 4 and all(r["fit"][t] >= 0 for t in COST_TERMS)
    p = profile_of(r)
    names = {s.name for s in p.software}
    assert names <= {"request_lookup", "object_rpc", "host_copy"} and names
    if "ns_per_request" in SoftwarePart.__dataclass_fields__ and r["fit"]["ns_per_request"] > 0:
        assert "request_lookup" in names
    assert all("tcp-loopback" in s.source for s in p.software)
    assert (p.latency_ns, p.concurrency) == (0.0, 1)
    out = tmp_path / "mc.toml"
    write_profile(r, out, force_load=True)
    table = tomllib.loads(out.read_text())["calibration"]
    assert table["transport"] == "tcp-loopback" and table["isolation"] == "netns"
    assert table["generation"] == r["generation"] and table["listening"] == r["facts"]["listening"]
    assert load_profile(out) == p
    # one rule, one name: a replay taking these parts names the generation calibrate named
    q, _ = emulated_backend_args(f"vemu:mooncake-gdr,software_from={out}")
    assert q.generation == r["generation"]


def test_the_command_line_grid_is_the_library_grid():
    from kvemu.calibrate import SOFTWARE_BATCHES, SOFTWARE_REPS, SOFTWARE_SIZES
    from kvemu.units import parse_size

    params = {p.name: p.default for p in cli.commands["calibrate"].params}
    assert tuple(int(x) for x in params["batches"].split(",")) == SOFTWARE_BATCHES
    assert tuple(parse_size(x, "--sizes") for x in params["sizes"].split(",")) == SOFTWARE_SIZES
    assert params["reps"] == SOFTWARE_REPS


def test_the_file_systems_share_is_the_difference_of_two_fits(tmp_path):
    from kvemu.calibrate import _fs_share

    # O_DIRECT: 5 us a batch, 20 us an object, 0.2 ns a byte; the file system adds 2 us an object and
    # 0.6 ns a byte, nothing per batch: its part is that, and its share at each point by hand
    direct = synthetic((5_000.0, 20_000.0, 0.2), reps=3, noise=0.0)
    fs = synthetic((5_000.0, 22_000.0, 0.8), reps=3, noise=0.0)
    share = _fs_share(list(zip(*fs)), list(zip(*direct)), str(tmp_path))
    assert share["difference"]["ns_per_request"] == pytest.approx(0.0, abs=1e-3)
    assert share["difference"]["ns_per_io"] == pytest.approx(2_000.0, rel=1e-6)
    assert share["difference"]["ns_per_byte"] == pytest.approx(0.6, rel=1e-6)
    for p in share["points"]:
        n, s = p["batch"], p["object_bytes"]
        by_hand = 1 - (5_000 + 20_000 * n + 0.2 * n * s) / (5_000 + 22_000 * n + 0.8 * n * s)
        assert p["share"] == pytest.approx(by_hand, rel=1e-9)
    # a file system faster than O_DIRECT somewhere (a cache) is never a negative part
    share = _fs_share(list(zip(*direct)), list(zip(*fs)), str(tmp_path))
    assert all(v == 0.0 for v in share["difference"].values())


def test_a_store_is_calibrated_for_its_software_path_by_default(tmp_path):
    # files:DIR is a store (a file per object): without --software/--tier its software path is fitted,
    # with parts named as the built-in stores' are
    store = tmp_path / "kv"
    store.mkdir()
    grid = ["--batches", "1,8", "--sizes", "4KiB,64KiB", "--reps", "2", "--json"]
    r = CliRunner().invoke(cli, ["calibrate", "--backend", f"files:{store}", *grid])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["kind"] == "software" and result["fit"]["points"] == 4
    assert set(result["profile"]["software"]) <= {"request_lookup", "object_rpc", "host_copy"}
    assert "filesystem" not in result  # a store's own files: no O_DIRECT counterpart measured
    assert os.listdir(store) == []
    # its generation, and its software share by the replay's rule, by hand: on the no-medium profile
    # (latency 0, 100,000 GB/s, one access at a time) an access of s bytes is busy io + s (byte + 1e-5) ns,
    # a batch's busy time in whole ns as results hold it
    assert result["generation"].startswith("kvemu's files store over file per object") and "isolation" not in result
    io, byte = (sum(p.get(k, 0.0) for p in result["profile"]["software"].values()) for k in ("ns_per_io", "ns_per_byte"))
    sw = busy = 0.0
    for b in (1, 8):
        for size in (4096, 65536):
            sw += b * (io + size * byte)
            busy += round(b * (io + size * (byte + 1e-5)))
    assert result["software_share"]["software_share"] == pytest.approx(sw / busy, rel=1e-6)


def test_the_parts_bring_their_generation_with_them(tmp_path):
    # the software generation a report prints beside a storage row is the parts' (a measured stack on a
    # deployment's NIC), the wire and medium stay the profile's own
    q, _ = emulated_backend_args("vemu:mooncake-gdr,software_from=mooncake-lmcache-copy")
    copy, gdr = BUILTIN_PROFILES["mooncake-lmcache-copy"], BUILTIN_PROFILES["mooncake-gdr"]
    assert q.generation == copy.generation and q.software == copy.software
    assert (q.latency_ns, q.bandwidth_gbps, q.concurrency) == (gdr.latency_ns, gdr.bandwidth_gbps, gdr.concurrency)
    parts = tmp_path / "parts.toml"
    parts.write_text('kind = "storage"\nlatency_ns = 0.0\nbandwidth_gbps = 1.0\nconcurrency = 1\n'
                     '[software.object_rpc]\nns_per_io = 1.0\nsource = "measured"\n')
    q, _ = emulated_backend_args(f"vemu:mooncake-gdr,software_from={parts}")
    assert q.generation == "software path of parts"
