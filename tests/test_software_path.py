"""The software path of storage tiers (docs/tier-profiles.md) and the devices of a shared tier."""

import json

import pyarrow.parquet as pq
import pytest

from kvemu.profiles import BUILTIN_PROFILES

CHUNK = 64 << 10  # one access: 64 KiB
# The published figures each part stands for (docs/tier-profiles.md, "The software path"), written out here:
COPY = 1 / 6.25          # ns per byte: single-thread memcpy of a server core, 6.25 GB/s (Xeon E5-2650 v2)
KERNEL = 1e9 / 800_000   # ns per I/O: one core used up at 800k IOPS through the block layer
LOOKUP = 1.5e6           # ns per request: LMCache's batch_exist lookup, 1-2 ms (PR #934)
RPC = 1000.0             # ns per object: Mooncake master's GetReplicaList, an estimate
FS = (0.84 / 0.16) / 7.0  # ns per byte: 84 % of SSD KV retrieval in the kernel file system, drive at 7 GB/s
SPDK = 1e9 / 10e6        # ns per I/O: 10 M IOPS from one thread


# (profile, per request, per I/O, per byte, staged: bytes pass a host bounce buffer)
PATHS = [
    ("mooncake-lmcache-copy", LOOKUP, RPC, COPY, True),
    ("mooncake-lmcache-zerocopy", LOOKUP, RPC, 0.0, True),
    ("mooncake-gdr", LOOKUP, RPC, 0.0, False),
    ("rdma-storage", LOOKUP, RPC, COPY, True),        # the name of mooncake-lmcache-copy before generations
    ("nvme-fs", 0.0, KERNEL, FS, True),
    ("nvme-direct", 0.0, KERNEL, 0.0, True),
    ("nvme", 0.0, KERNEL, 0.0, True),                 # the name of nvme-direct
    ("nvme-spdk", 0.0, SPDK, 0.0, True),
    ("nvme-gds", 0.0, KERNEL, 0.0, False),
    ("nvme-gpu-initiated", 0.0, 0.0, 0.0, False),
    ("storage-rdma", 0.0, RPC + KERNEL, 0.0, True),   # master RPC, the storage server's O_DIRECT read
    ("object-store", 0.0, 0.0, COPY, True),
]


def test_every_storage_profile_is_covered():
    assert {n for n, *_ in PATHS} == {n for n, p in BUILTIN_PROFILES.items() if p.kind == "storage"}


@pytest.mark.parametrize("name, per_request, fixed_ns, per_byte, staged", PATHS)
def test_software_time_of_one_chunk(name, per_request, fixed_ns, per_byte, staged):
    p = BUILTIN_PROFILES[name]
    # a hit: the request's lookup, then one chunk
    assert p.software_ns(1, CHUNK, requests=1) == pytest.approx(per_request + fixed_ns + CHUNK * per_byte)
    # a miss: the lookup alone, no access, no bytes; it still costs
    assert p.software_ns(0, 0, requests=1) == pytest.approx(per_request)
    # composed into the model: one access alone is overhead + software + latency + bytes through both
    alone = fixed_ns + p.latency_ns + CHUNK / p.bandwidth_gbps + CHUNK * per_byte
    assert p.access_ns(CHUNK) == pytest.approx(alone)
    lat, busy = p.batch_times([CHUNK])
    assert busy == pytest.approx(alone)
    assert p.staged is staged
    # every part names where its figure comes from, and none is this development VM
    for part in p.software:
        assert part.source and "measured here" not in part.source and "development" not in part.source
    assert p.generation


def test_the_drive_through_the_os_still_costs_65_us_at_4k():
    # the drive reviews' 65 us is through the OS with O_DIRECT: kernel_io is taken out of the latency
    p = BUILTIN_PROFILES["nvme-direct"]
    assert p.access_ns(4096) == pytest.approx(65000.0 + 4096 / 7.0)
    fs = BUILTIN_PROFILES["nvme-fs"]
    # in bulk the file system is 84 % of the time per byte, as Unified KV Pooling measured
    assert FS / (1 / 7.0 + FS) == pytest.approx(0.84)
    assert fs.path_gbps == pytest.approx(1 / (1 / 7.0 + FS))


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
    assert sw["figures"] == "modelled" and sw["ns_per_io"] == KERNEL
    assert sw["generation"] == "NVMe, O_DIRECT through the kernel block layer"
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

    for name in [n for n, p in BUILTIN_PROFILES.items() if p.kind == "storage"]:
        path = tmp_path / f"{name}.toml"
        path.write_text(BUILTIN_PROFILES[name].to_toml())
        assert load_profile(path) == BUILTIN_PROFILES[name]
    bad = tmp_path / "mem.toml"
    bad.write_text('kind = "memory"\nlatency_ns = 1\nbandwidth_gbps = 1\nconcurrency = 1\n'
                   '[software.copy]\nns_per_byte = 0.1\nsource = "x"\n')
    with pytest.raises(ConfigError, match="for storage tiers"):
        load_profile(bad)


def _lookup_run(tmp_path, name, lookup_ns):
    """Three requests far apart on a storage tier of fixed figures, with a per-request lookup or without."""
    from conftest import make_workload, record
    from kvemu.profiles import profile_from_mapping
    from kvemu.replay import DataPathOptions, OutputOptions, ReplayOptions, replay

    trace = tmp_path / "t.parquet"
    if not trace.exists():
        # requests 0 and 2 share a prefix: request 2 hits the tier (HBM too small to keep it), 0 and 1 miss
        w = make_workload([0.0, 500.0, 1000.0], [150, 90, 150], [3, 3, 3], hashes=[[1, 2, 3], [4, 5], [1, 2, 3]])
        record(w, trace, tier_policy="offload", hbm_kv_blocks=12)
    parts = {"copy": {"ns_per_byte": 0.01, "source": "test"}}
    if lookup_ns:
        parts["lookup"] = {"ns_per_request": lookup_ns, "path": "store", "source": "test"}
    prof = tmp_path / f"{name}.toml"
    prof.write_text(profile_from_mapping({"name": name, "kind": "storage", "latency_ns": 1000.0,
                                          "bandwidth_gbps": 64.0, "concurrency": 1, "software": parts},
                                         "test").to_toml())
    out = tmp_path / f"{name}.parquet"
    replay(trace, f"vemu:{prof}", ReplayOptions(datapath=DataPathOptions(link="cpu"),
                                                output=OutputOptions(force=True)), out=out)
    t = pq.read_table(out)
    return t.to_pydict(), json.loads(t.schema.metadata[b"kvemu"])


def test_a_lookup_is_paid_by_every_request_hit_or_miss(tmp_path):
    """The per-request part: each request's first step waits one lookup, whether its prefix was in the
    tier (request 2) or not (requests 0 and 1); nothing else changes (arrivals far apart)."""
    look = 2e6  # 2 ms
    bare, _ = _lookup_run(tmp_path, "bare", 0.0)
    with_, meta = _lookup_run(tmp_path, "look", look)
    assert bare["tier_hit_tokens"][2] > 0 and bare["tier_hit_tokens"][0] == bare["tier_hit_tokens"][1] == 0
    for i in range(3):
        assert with_["ttft_ms"][i] - bare["ttft_ms"][i] == pytest.approx(look / 1e6, abs=1e-6)
    lk = meta["schedule"]["engine"]["store_lookups"]
    assert lk["requests"] == 3 and lk["ns"] == 3 * look
    sw = meta["backend"]["software_path"]
    assert sw["ns_per_request"] == look and sw["parts"]["lookup"]["path"] == "store"


def test_the_report_names_each_storage_runs_generation_and_software_share(tmp_path):
    from kvemu.report import group_sections, report

    r, out = _replay(tmp_path, "rdma", "--backend", "vemu:rdma-storage", "--sharing", "shared")
    assert r.exit_code == 0, r.output
    sw = _meta(out)["backend"]["software_path"]
    soft = sum(o["software_ns"] for o in sw["ops"].values())
    busy = soft + sum(o["medium_ns"] for o in sw["ops"].values())
    rep = report([out])
    notes = [n for s in group_sections(rep.groups[0], None) if s.key == "figures" for n in s.notes]
    note = next(n for n in notes if "storage software path" in n)
    assert "Mooncake Store via LMCache, host copy of get() results, mid-2025" in note
    assert f"software {100 * soft / busy:.0f} % of its KV time" in note
    assert all(part in note for part in ("request_lookup", "object_rpc", "host_copy"))
    lk = _meta(out)["schedule"]["engine"]["store_lookups"]
    assert f"{lk['requests']} per-request lookups, {lk['ns'] / 1e6:.1f} ms of step time" in note
    assert lk["ns"] == lk["requests"] * 1.5e6  # LMCache's batch_exist, 1-2 ms per request
