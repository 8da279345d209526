"""Calibration: measuring a backend gives a profile, and emulating that profile measures the same.

Buffers are 64 MiB and runs short, so the file takes seconds. Profiles this host cannot emulate
(faster than its own memory: the floor) are skipped with the figures that rule them out; the
floor itself is checked to be reported as such.
"""
import json

import pytest
from click.testing import CliRunner

from kvemu.calibrate import DEFAULT_ROUNDS, _measure, calibrate, profile_of, with_queue_depth, write_profile
from kvemu.cli import cli
from kvemu.errors import ConfigError, KvemuError, OutputError
from kvemu.profiles import BUILTIN_PROFILES, Profile, load_profile
from timing_noise import measured

BUFFER = 64 << 20
HOPS = 20000


def run(spec, **kw):
    return calibrate(spec, buffer_bytes=BUFFER, hops=HOPS, **kw)


def run_virtual(spec):
    """calibrate's measurements of a vemu tier, which calibrate itself refuses: the profile's
    exact model, free of this host's noise, checks the measurement methods themselves."""
    return _measure(spec, "vemu", buffer_bytes=BUFFER, hops=HOPS, rounds=DEFAULT_ROUNDS, name=None, log=None)


@pytest.fixture(scope="module")
def host():
    """This host's own figures at the test buffer size: the floor of every emulation."""
    r = run("dram")
    return {"latency_ns": r["latency"]["ns"], "gbps": r["bandwidth"]["load_gbps"]}


SLOW_MEMORY = Profile(name="slow-pool", kind="memory", latency_ns=1500.0, bandwidth_gbps=4.0, concurrency=2,
                      description="a pooled memory tier slower than this host (latency raised)")
SLOW_DISK = Profile(name="slow-disk", kind="storage", latency_ns=20000.0, bandwidth_gbps=1.5, concurrency=4,
                    description="a storage tier slower than this host")
ROUND_TRIP = [BUILTIN_PROFILES[n] for n in ("remote-numa", "cxl-pool", "cxl-pool-multi", "rdma-storage", "nvme")]
ROUND_TRIP += [SLOW_MEMORY, SLOW_DISK]


def iops(p: Profile) -> float:
    """4 KiB accesses per second the model gives a batch of 256."""
    return 256 / p.batch_times([4096] * 256)[1] * 1e9


def below_floor(p: Profile, host: dict) -> str | None:
    """Why this host cannot emulate p (None if it can): it would have to be faster than itself."""
    # a chase hop on emu also pays a timer read; keep a margin over the host's own hop
    if p.kind == "memory" and p.overhead_ns + p.latency_ns < 1.5 * host["latency_ns"] + 50:
        return f"latency {p.latency_ns} ns is below 1.5x this host's {host['latency_ns']:.0f} ns pointer chase"
    if p.bandwidth_gbps > 0.5 * host["gbps"]:
        return f"bandwidth {p.bandwidth_gbps} GB/s is above half this host's {host['gbps']:.1f} GB/s copy"
    if p.kind == "storage" and p.access_ns(4096) / p.concurrency < 2000:
        return f"{p.concurrency} accesses of {p.access_ns(4096):.0f} ns in flight need a 4 KiB copy every " \
               f"{p.access_ns(4096) / p.concurrency:.0f} ns"
    return None


@pytest.mark.parametrize("profile", ROUND_TRIP, ids=lambda p: p.name)
def test_calibrating_an_emulated_tier_gives_its_profile_back(tmp_path, host, profile):
    why = below_floor(profile, host)
    if why:
        pytest.skip(f"{profile.name} is below this host's floor: {why}")
    path = tmp_path / f"{profile.name}.toml"
    path.write_text(profile.to_toml())

    def measure():
        return run(f"emu:{path}")

    def good(r):
        got = profile_of(r)
        return (abs(got.latency_ns / profile.latency_ns - 1) < 0.05
                and abs(got.bandwidth_gbps / profile.bandwidth_gbps - 1) < 0.1
                and (profile.kind == "memory" or abs(iops(got) / iops(profile) - 1) < 0.1)
                and r["floor"]["floor_hits"] < 0.05 * r["floor"]["accesses"])

    # a shared machine makes a round slow, never fast: retry, and skip when no attempt had a CPU
    r = measured(5, measure, good, f"calibrating emu:{profile.name}")
    got = profile_of(r)
    assert r["kind"] == got.kind == profile.kind
    assert got.latency_ns == pytest.approx(profile.latency_ns, rel=0.05)
    assert got.bandwidth_gbps == pytest.approx(profile.bandwidth_gbps, rel=0.10)
    if profile.kind == "memory":
        # the same rule on the measured figures: 1 + ceil(latency x bandwidth / 64 KiB)
        assert abs(got.concurrency - profile.concurrency) <= 1
    else:
        # Little's law on IOPS x latency finds the concurrency that gives the IOPS measured; a tier
        # whose link saturates first shows less than it has, so compare what it does
        assert iops(got) == pytest.approx(iops(profile), rel=0.10)
    # a preempted moment makes the accesses due in it late: a few hits, never most
    assert r["floor"]["floor_hits"] < 0.05 * r["floor"]["accesses"]


@pytest.mark.parametrize("name", sorted(BUILTIN_PROFILES))
def test_the_methods_give_every_virtual_tier_its_profile_back(name):
    # vemu has no floor: every built-in comes back, through the same measurements as a real tier
    p = BUILTIN_PROFILES[name]
    got = profile_of(run_virtual(f"vemu:{name}"))
    assert got.kind == p.kind
    # a software path is measured as part of the tier: its fixed parts in the latency, its per-byte
    # parts in the bandwidth (docs/tier-profiles.md, "The software path")
    assert got.latency_ns == pytest.approx(p.latency_ns + p.software_ns_per_io, abs=0.1 + 1e-3 * p.latency_ns)
    # 4 MiB (memory) or 1 MiB (storage) blocks pay one latency each: a little under the link's rate;
    # an object store's 5 ms first byte is more than the calibration's batches keep covered
    if name != "object-store":
        assert got.bandwidth_gbps == pytest.approx(p.path_gbps, rel=0.03)
    if p.kind == "memory":
        assert abs(got.concurrency - p.concurrency) <= 1
    elif p.issue_ns == 0 or 1e9 / p.issue_ns > 1.1 * iops(p):
        assert iops(got) == pytest.approx(iops(p), rel=0.10)
    else:
        # the issuing CPU bounds its 4 KiB IOPS (a software part per I/O, no host copy to slow the link):
        # calibration folds fixed parts into the latency and fits no CPU ceiling, so it can only
        # overestimate them (a limit of the fit, docs/tier-profiles.md "Calibration")
        assert iops(got) >= 0.9 * iops(p)


def test_the_floor_is_reported(host):
    # a 10 ns DRAM hop over a 64 MiB buffer is faster than any host's memory: every hop is the host's
    # (the built-in local-dram, 85 ns, is not: a fast host meets it on some hops, a loaded one on none)
    r = run("emu:local-dram,latency_ns=10")
    floor = r["floor"]
    assert floor["hops"] >= HOPS - 5 and floor["hop_floor_hits"] > 0.9 * floor["hops"]
    assert r["latency"]["ns"] > 2 * 10
    assert any("chase hops" in w and "floor" in w for w in r["warnings"])
    # and HBM's bandwidth: every block access is the host's
    r = run("emu:hbm")
    assert r["floor"]["floor_hits"] > 0.9 * r["floor"]["accesses"]
    assert r["bandwidth"]["load_gbps"] < 0.1 * BUILTIN_PROFILES["hbm"].bandwidth_gbps
    assert any("block accesses" in w and "floor" in w for w in r["warnings"])


def test_dram_calibration_is_plausible(host):
    assert 30 < host["latency_ns"] < 5000
    assert 0.5 < host["gbps"] < 200


def test_cli_calibrate_json_and_profile_out(tmp_path):
    out = tmp_path / "here.toml"
    args = ["calibrate", "--backend", "dram", "--buffer", "64MiB", "--hops", str(HOPS), "--json"]
    # --force-load: this test is about the profile, not about the load of the machine it runs on
    res = CliRunner().invoke(cli, [*args, "--out", str(out), "--name", "this-vm", "--force-load"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert r["backend"] == "dram" and r["kind"] == "memory" and r["buffer_bytes"] == BUFFER
    assert r["latency"]["ns"] > 0 and r["latency"]["hops"] == HOPS
    assert all(r["bandwidth"][f"{op}_gbps"] > 0 for op in ("load", "store", "read"))
    assert r["facts"]["backend"] == "dram" and r["host"]["cores"] >= 1
    # the profile written loads back, and an emulated tier opens with it
    p = load_profile(out)
    assert p.name == "this-vm" and p.kind == "memory"
    assert p.latency_ns == pytest.approx(r["latency"]["ns"], abs=0.1)
    assert p.bandwidth_gbps == pytest.approx(r["bandwidth"]["load_gbps"], abs=1e-3)
    assert p.to_dict() == r["profile"]
    from kvemu.backends import Backend

    with Backend(f"vemu:{out}") as b:
        assert b.describe()["profile"]["name"] == "this-vm"
    # never over an existing file without --force
    res = CliRunner().invoke(cli, [*args, "--out", str(out), "--force-load"])
    assert res.exit_code == 2 and "already exists (use --force to replace it)" in res.output
    res = CliRunner().invoke(cli, ["calibrate", "--backend", "emu:nvme", "--buffer", "64MiB", "--out", str(out),
                                   "--force", "--force-load"])
    assert res.exit_code == 0, res.output
    assert "IOPS" in res.stdout and load_profile(out).kind == "storage"


def test_virtual_time_is_not_calibrated(tmp_path):
    # vemu's figures are its profile's model: refused in one line, pointing at emu, and nothing written
    out = tmp_path / "virtual.toml"
    res = CliRunner().invoke(cli, ["calibrate", "--backend", "vemu:nvme,concurrency=8", "--out", str(out)])
    assert res.exit_code == 2 and not out.exists()
    assert res.output.strip().splitlines() == [
        "Error: cannot calibrate vemu:nvme,concurrency=8: vemu is the profile's model in virtual time, "
        "there is nothing to measure; calibrate emu:nvme,concurrency=8 to see what this host can emulate"]
    with pytest.raises(ConfigError, match="^cannot calibrate vemu:cxl-pool: vemu is the profile's model"):
        calibrate("vemu:cxl-pool", buffer_bytes=BUFFER)
    # and the help does not offer it
    res = CliRunner().invoke(cli, ["calibrate", "--help"])
    assert res.exit_code == 0 and "vemu:PROFILE is refused" in " ".join(res.output.split())


def test_write_profile_refuses_to_overwrite(tmp_path):
    r = run("dram")
    path = tmp_path / "p.toml"
    write_profile(r, path, force_load=True)
    with pytest.raises(OutputError, match="already exists"):
        write_profile(r, path, force_load=True)
    assert load_profile(path) == profile_of(r)


def test_bad_requests():
    with pytest.raises(ConfigError, match="--buffer must be at least 8 MiB"):
        calibrate("dram", buffer_bytes=1 << 20)
    with pytest.raises(ConfigError, match="unknown tier profile"):
        calibrate("emu:nope", buffer_bytes=BUFFER)


def test_queue_depth_option():
    assert with_queue_depth("uring:/x/y", 1) == "uring:/x/y,qd=1"
    assert with_queue_depth("uring:/x/y,qd=8,direct=1", 32) == "uring:/x/y,direct=1,qd=32"
    assert with_queue_depth("emu:nvme", 32) == "emu:nvme"


def test_uring_calibration_if_available(tmp_path):
    from kvemu.backends import Backend

    spec = f"uring:{tmp_path / 'kv.bin'}"
    try:
        with Backend(with_queue_depth(spec, 1)) as b:
            b.prepare(4096, 16, 1, 1, False)
    except KvemuError as e:
        pytest.skip(f"uring cannot run here: {e}")
    r = calibrate(spec, buffer_bytes=16 << 20, hops=HOPS)
    assert r["kind"] == "storage"
    assert r["latency"]["ns"] > 0 and r["iops"]["value"] > 0 and r["bandwidth"]["load_gbps"] > 0
    assert r["latency"]["queue_depth"] == 1 and r["iops"]["queue_depth"] == 32
    p = profile_of(r)
    assert 1 <= p.concurrency <= 32 and p.kind == "storage"
