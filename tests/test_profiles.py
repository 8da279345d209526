"""Tier profiles: built-ins, TOML files and their errors, the timing model, spec resolution."""

import dataclasses
import math

import pytest

from kvemu.backend_spec import KINDS as BACKEND_KINDS
from kvemu.backend_spec import counterpart_spec, emulated_backend_args
from kvemu.errors import ConfigError
from kvemu.profiles import (
    BUILTIN_PROFILES,
    KINDS,
    Profile,
    load_profile,
    resolve_profile,
)

REQUIRED_BUILTINS = ("hbm", "local-dram", "remote-numa", "cxl-pool", "cxl-pool-multi", "rdma-storage", "nvme")


def test_builtins_are_valid_and_cite_their_figures():
    assert set(REQUIRED_BUILTINS) <= set(BUILTIN_PROFILES)
    for name, p in BUILTIN_PROFILES.items():
        assert p.name == name and p.kind in KINDS
        assert p.latency_ns > 0 and p.bandwidth_gbps > 0 and p.concurrency >= 1 and p.overhead_ns >= 0
        assert p.description and p.sources and all(isinstance(s, str) and s for s in p.sources)
        # every figure has a source line naming it
        text = " ".join(p.sources)
        assert "latency" in text and "bandwidth" in text and "concurrency" in text, name
        # round trip through TOML text
        assert resolve_profile(name) is p


def test_builtins_follow_the_published_figures():
    b = BUILTIN_PROFILES
    assert b["hbm"].bandwidth_gbps == 3350
    assert 81 <= b["local-dram"].latency_ns <= 89 and b["local-dram"].bandwidth_gbps == 176
    assert 140 <= b["remote-numa"].latency_ns <= 143
    assert 250 <= b["cxl-pool"].latency_ns <= 370 and 17 <= b["cxl-pool"].bandwidth_gbps <= 31
    # pooled over several devices: more bandwidth, a bit more latency
    assert b["cxl-pool-multi"].bandwidth_gbps > b["cxl-pool"].bandwidth_gbps
    assert b["cxl-pool"].latency_ns < b["cxl-pool-multi"].latency_ns <= 410
    # the medium alone (perftest's one-sided read) costs 2.3 us at 4 KiB; the software path comes on top
    medium = dataclasses.replace(b["rdma-storage"], software=())
    assert medium.access_ns(4096) == pytest.approx(2300)
    assert b["rdma-storage"].access_ns(4096) > 2300
    assert 50_000 <= b["nvme"].latency_ns <= 80_000 and b["nvme"].bandwidth_gbps == 7
    assert b["nvme"].kind == b["rdma-storage"].kind == "storage"
    # ~1M IOPS at depth, by the model's own arithmetic
    nvme = b["nvme"]
    assert 0.8e6 < nvme.concurrency / nvme.access_ns(4096) * 1e9 < 1.2e6
    # the kernel I/O path is nvme's software part, taken out of its measured 65 us
    assert nvme.access_ns(4096) == pytest.approx(65000 + 4096 / 7)
    # memory tiers have no software path
    assert all(not p.software for p in b.values() if p.kind == "memory")


def write(tmp_path, text, name="p.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


GOOD = """
[profile]
name = "slow-pool"
description = "a test pool"
kind = "memory"
latency_ns = 1500
bandwidth_gbps = 4.5
concurrency = 2
overhead_ns = 100.5
sources = ["made up for a test"]
"""


def test_toml_profile_table_and_top_level(tmp_path):
    p = load_profile(write(tmp_path, GOOD))
    assert p == Profile(name="slow-pool", kind="memory", latency_ns=1500.0, bandwidth_gbps=4.5, concurrency=2,
                        overhead_ns=100.5, description="a test pool", sources=("made up for a test",))
    flat = write(tmp_path, "kind = 'storage'\nlatency_ns = 20000\nbandwidth_gbps = 2\nconcurrency = 4\n",
                 name="my disk.toml")
    q = load_profile(flat)
    assert q.name == "my-disk" and q.kind == "storage" and q.overhead_ns == 0 and q.sources == ()
    assert resolve_profile(str(flat)) == q
    # what to_toml writes, load_profile reads back unchanged (and provenance tables are allowed)
    again = load_profile(write(tmp_path, p.to_toml(extra={"backend": "dram", "load_gbps": 9.5}), name="again.toml"))
    assert again == p


@pytest.mark.parametrize("text,message", [
    ("kind = 'memory'\nbandwidth_gbps = 1\nconcurrency = 1\n", "profile is missing 'latency_ns'"),
    ("kind = 'memory'\nlatency_ns = 1\nconcurrency = 1\n", "profile is missing 'bandwidth_gbps'"),
    ("latency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1\n", "profile is missing 'kind'"),
    ("kind = 'memory'\nlatency_ns = -5\nbandwidth_gbps = 1\nconcurrency = 1\n",
     "profile key 'latency_ns' must be >= 0, got -5"),
    ("kind = 'memory'\nlatency_ns = 1\nbandwidth_gbps = 0\nconcurrency = 1\n",
     "profile key 'bandwidth_gbps' must be > 0, got 0"),
    ("kind = 'memory'\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1\noverhead_ns = -1.5\n",
     "profile key 'overhead_ns' must be >= 0, got -1.5"),
    ("kind = 'memory'\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 0\n",
     "profile key 'concurrency' must be in 1..1048576, got 0"),
    ("kind = 'memory'\nlatency_ns = '85'\nbandwidth_gbps = 1\nconcurrency = 1\n",
     "profile key 'latency_ns' must be a number, got string"),
    ("kind = 'memory'\nlatency_ns = true\nbandwidth_gbps = 1\nconcurrency = 1\n",
     "profile key 'latency_ns' must be a number, got boolean"),
    ("kind = 'memory'\nlatency_ns = nan\nbandwidth_gbps = 1\nconcurrency = 1\n",
     "profile key 'latency_ns' must be finite, got nan"),
    ("kind = 'memory'\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1.5\n",
     "profile key 'concurrency' must be an integer, got number"),
    ("kind = 'tape'\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1\n",
     "profile key 'kind' must be one of memory, storage, got 'tape'"),
    ("kind = 'memory'\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1\nlatncy = 3\n",
     "unknown profile key 'latncy' (known: name, description, kind, latency_ns, bandwidth_gbps, concurrency, "
     "overhead_ns, sources, generation, gpu_direct, software, software_from)"),
    ("kind = 'memory'\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1\nname = 'a b'\n",
     "profile key 'name' must be 1-64 of [A-Za-z0-9._-] starting with a letter or digit, got 'a b'"),
    ("kind = 'memory'\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1\nsources = 'x'\n",
     "profile key 'sources' must be an array of strings"),
    ("kind = 'memory'\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1\ndescription = 3\n",
     "profile key 'description' must be a string, got integer"),
    ("[profile]\nkind = 'memory'\n[other]\nx = 1\n",
     "unknown top-level key 'other' next to [profile] (allowed: profile, calibration)"),
    ("profile = 3\n", "'profile' must be a table"),
])
def test_toml_errors_are_one_exact_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert str(info.value) == f"{path}: {message}"
    assert "\n" not in str(info.value)


def test_unreadable_profiles(tmp_path):
    with pytest.raises(ConfigError, match=r"p.toml: not valid TOML \("):
        load_profile(write(tmp_path, "latency_ns = = 3"))
    with pytest.raises(ConfigError, match=r"^.*missing.toml: profile file not found$"):
        resolve_profile(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match=r"unknown tier profile 'cxl' \(built-in: hbm, .*; or give a .toml path\)"):
        resolve_profile("cxl")


# ---------------------------------------------------------------- the timing model


def test_one_access_costs_overhead_latency_and_transfer():
    p = Profile(name="x", kind="storage", latency_ns=1000, bandwidth_gbps=2, concurrency=4, overhead_ns=50)
    lat, busy = p.batch_times([4096])
    assert lat == [50 + 1000 + 2048] and busy == 50 + 1000 + 2048 == p.access_ns(4096)
    assert p.batch_times([]) == ([], 0.0)


def test_model_limits():
    b = 4096
    # concurrency 1: accesses one after another, each alone
    serial = Profile(name="s", kind="storage", latency_ns=1000, bandwidth_gbps=4, concurrency=1, overhead_ns=10)
    lat, busy = serial.batch_times([b] * 10)
    assert lat == pytest.approx([serial.access_ns(b)] * 10) and busy == pytest.approx(10 * serial.access_ns(b))
    # latency-bound with concurrency c: ceil(n / c) rounds of one access time (plus link queueing)
    wide = Profile(name="w", kind="storage", latency_ns=100_000, bandwidth_gbps=1000, concurrency=8)
    _, busy = wide.batch_times([b] * 20)
    assert busy == pytest.approx(3 * wide.access_ns(b), rel=0.01)
    # bandwidth-bound: the link, after one latency
    bw = Profile(name="b", kind="memory", latency_ns=100, bandwidth_gbps=1, concurrency=64)
    lat, busy = bw.batch_times([b] * 100)
    assert busy == pytest.approx(100 + 100 * b)
    # ... and an access waits for the link: latency grows with the accesses ahead of it
    assert lat[0] == pytest.approx(bw.access_ns(b)) and lat[63] == pytest.approx(100 + 64 * b)
    # issue-bound: one CPU pays the overhead of each access
    cpu = Profile(name="c", kind="storage", latency_ns=1000, bandwidth_gbps=1000, concurrency=1000, overhead_ns=500)
    _, busy = cpu.batch_times([64] * 100)
    assert busy == pytest.approx(100 * 500 + 1000 + 64 / 1000)
    # no access is ever faster than alone
    for prof in (serial, wide, bw, cpu):
        lat, _ = prof.batch_times([b] * 300)
        assert min(lat) >= prof.access_ns(b) - 1e-6


# ---------------------------------------------------------------- specs


def test_emulated_backend_args():
    p, args = emulated_backend_args("emu:cxl-pool")
    assert p is BUILTIN_PROFILES["cxl-pool"]
    assert args == "name=cxl-pool,kind=memory,latency_ns=310.0,gbps=24.0,concurrency=2,overhead_ns=0.0"
    p, args = emulated_backend_args("emu:nvme,latency_ns=20000,concurrency=8,hugepages=0")
    assert (p.name, p.latency_ns, p.concurrency, p.bandwidth_gbps) == ("nvme", 20000.0, 8, 7.0)
    assert args.endswith(",hugepages=0")
    for bad, message in [("", "emu needs a tier profile first"), ("latency_ns=3", "emu needs a tier profile"),
                         ("nvme,qd=3", r"emu: unknown option 'qd' \(known: latency_ns, bandwidth_gbps, "
                                       r"overhead_ns, concurrency, software_from, hugepages\)"),
                         ("nvme,latency_ns=abc", "emu: option latency_ns must be a number"),
                         ("nvme,concurrency=0", "concurrency' must be in 1..")]:
        with pytest.raises(ConfigError, match=message):
            emulated_backend_args(f"emu:{bad}")
    with pytest.raises(ConfigError, match="vemu: unknown option 'hugepages'"):
        emulated_backend_args("vemu:nvme,hugepages=1")


def test_counterparts():
    assert {k.name for k in BACKEND_KINDS.values() if k.counterpart} == {"numa", "mmap", "uring", "mooncake"}
    assert counterpart_spec("numa:1") == "emu:remote-numa"
    assert counterpart_spec("mmap:/dev/dax0.0") == "emu:cxl-pool"
    assert counterpart_spec("mmap:/tmp/file.bin") == "emu:nvme"
    assert counterpart_spec("uring:/tmp/f") == "emu:nvme"
    assert counterpart_spec("uring:/tmp/f,qd=8") == "emu:nvme,concurrency=8"
    assert counterpart_spec("mooncake:lease_ms=5") == "emu:rdma-storage"
    assert counterpart_spec("dram") is None and counterpart_spec("emu:nvme") is None
    for spec in ("numa:1", "mmap:/dev/dax0.0", "uring:/x,qd=4"):
        emulated_backend_args(counterpart_spec(spec))  # resolvable


def test_to_toml_refuses_non_finite():
    p = Profile(name="x", kind="memory", latency_ns=1.0, bandwidth_gbps=1.0, concurrency=1)
    with pytest.raises(ConfigError):
        p.to_toml(extra={"x": math.inf})
