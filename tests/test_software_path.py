"""The software path of storage tiers (docs/tier-profiles.md) and the devices of a shared tier."""

import json

import pyarrow.parquet as pq
import pytest

from kvemu.profiles import BUILTIN_PROFILES

CHUNK = 64 << 10  # one access: 64 KiB
COPY = 1 / 7.7    # ns per byte of the bounce copy (single-thread memcpy ~7.7 GB/s)


@pytest.mark.parametrize("name, fixed_ns, per_byte", [
    ("nvme", 1000.0, 0.0),                       # kernel I/O path
    ("rdma-storage", 1000.0, COPY),              # metadata lookup, bounce copy
    ("storage-rdma", 1000.0 + 5000.0 + 1000.0, COPY),  # lookup, server CPU, kernel I/O, copy
    ("object-store", 20000.0, COPY),             # HTTP request, copy
])
def test_software_time_of_one_chunk(name, fixed_ns, per_byte):
    p = BUILTIN_PROFILES[name]
    assert p.software_ns(1, CHUNK) == pytest.approx(fixed_ns + CHUNK * per_byte)
    # composed into the model: one access alone is overhead + software + latency + bytes through both
    alone = fixed_ns + p.latency_ns + CHUNK / p.bandwidth_gbps + CHUNK * per_byte
    assert p.access_ns(CHUNK) == pytest.approx(alone)
    lat, busy = p.batch_times([CHUNK])
    assert busy == pytest.approx(alone)


def test_memory_tiers_have_no_software_path():
    for p in BUILTIN_PROFILES.values():
        if p.kind == "memory":
            assert p.software == () and p.software_ns(10, 1 << 20) == 0


def _meta(path):
    return json.loads(pq.read_schema(path).metadata[b"kvemu"])


def _replay(tmp_path, name, *extra):
    from click.testing import CliRunner

    from kvemu.cli import cli

    out = tmp_path / f"{name}.parquet"
    r = CliRunner().invoke(cli, ["replay", "traces/chat-llama3-8b-offload.parquet", "--backend", "vemu:nvme",
                                  "--out", str(out), "--instances", "2", *extra])
    return r, out


def test_shared_tier_has_one_device_per_instance_by_default(tmp_path):
    r, out = _replay(tmp_path, "default", "--sharing", "shared")
    assert r.exit_code == 0, r.output
    d = _meta(out)["tier"]["devices"]
    assert d["devices"] == 2 and d["gbps"] == pytest.approx(2 * 7.0)
    sw = _meta(out)["backend"]["software_path"]
    assert sw["figures"] == "modelled" and sw["ns_per_io"] == 1000.0
    r, out = _replay(tmp_path, "one", "--sharing", "shared", "--tier-devices", "1")
    assert r.exit_code == 0, r.output
    assert _meta(out)["tier"]["devices"]["gbps"] == pytest.approx(7.0)


def test_replicated_tier_refuses_other_device_counts(tmp_path):
    r, out = _replay(tmp_path, "rep", "--sharing", "replicated", "--tier-devices", "1")
    assert r.exit_code == 2 and "--tier-devices" in r.output and not out.exists()


def test_a_resident_trace_on_storage_is_refused(tmp_path):
    from click.testing import CliRunner

    from kvemu.cli import cli

    out = tmp_path / "r.parquet"
    r = CliRunner().invoke(cli, ["replay", "traces/chat-llama3-8b-resident.parquet", "--backend", "vemu:nvme",
                                 "--out", str(out)])
    assert r.exit_code == 2 and "in place" in r.output and not out.exists()
    assert len(r.output.strip().splitlines()) == 1


def test_hbm_at_tp_is_every_gpus_hbm():
    from kvemu.links import spread_over_gpus

    hbm = BUILTIN_PROFILES["hbm"]
    assert spread_over_gpus(hbm, 4) == 4 * 3350.0
    assert spread_over_gpus(hbm, 1) is None and spread_over_gpus(BUILTIN_PROFILES["cxl-pool"], 4) is None


def test_toml_profiles_carry_their_software_parts(tmp_path):
    from kvemu.errors import ConfigError
    from kvemu.profiles import load_profile

    for name in ("nvme", "rdma-storage", "storage-rdma", "object-store"):
        path = tmp_path / f"{name}.toml"
        path.write_text(BUILTIN_PROFILES[name].to_toml())
        assert load_profile(path) == BUILTIN_PROFILES[name]
    bad = tmp_path / "mem.toml"
    bad.write_text('kind = "memory"\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1\n'
                   '[software.copy]\nns_per_byte = 0.1\nsource = "x"\n')
    with pytest.raises(ConfigError, match="for storage tiers"):
        load_profile(bad)
