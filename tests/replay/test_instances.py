"""Several serving instances on one tier, on the recorded schedule (requests round-robin): a shared
arena touched concurrently, or a copy each. Closed-loop instances: tests/replay/test_closed_loop.py."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvemu.errors import BackendUnavailable, ConfigError
from kvemu.replay import DataPathOptions, InstanceOptions, ReplayOptions, ScheduleOptions, WindowOptions, replay
from kvemu.schema import METADATA_KEY

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "traces" / "chat-llama3-8b-offload.parquet"


def results(path):
    t = pq.read_table(path)
    return t, json.loads(t.schema.metadata[METADATA_KEY])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "r.parquet"
    replay(TRACE, "dram", ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), window=WindowOptions(layers=1), datapath=DataPathOptions(chunk_tokens=16)), out=out)
    return results(out)


@pytest.mark.parametrize("sharing", ["shared", "replicated"])
def test_two_instances_replay_every_access_once(tmp_path, single, sharing):
    t1, m1 = single
    replay(TRACE, "dram", ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), window=WindowOptions(layers=1), datapath=DataPathOptions(chunk_tokens=16), instances=InstanceOptions(count=2, sharing=sharing)), out=tmp_path / "r.parquet")
    t, m = results(tmp_path / "r.parquet")
    assert t.num_rows == t1.num_rows
    inst = t["instance"].to_numpy()
    assert np.array_equal(inst, t["request_id"].to_numpy() % 2)  # round-robin
    for op in ("load", "store", "read"):  # the same block accesses, split over the instances
        assert m["ops"][op]["accesses"] == m1["ops"][op]["accesses"]
        assert sum(i[op]["accesses"] for i in m["instance_ops"]) == m1["ops"][op]["accesses"]
    assert [i["instance"] for i in m["instance_ops"]] == [0, 1]
    tier = m["tier"]
    assert tier["shared_bytes"] < tier["replicated_bytes"]  # the chat prefix is common to instances
    expected = tier["shared_bytes"] if sharing == "shared" else tier["replicated_bytes"]
    assert tier["resident_bytes"] == expected == m["params"]["arena_bytes"]
    assert m["params"]["instances"] == 2 and m["params"]["sharing"] == sharing
    assert np.all(t["ttft_ms"].to_numpy() > 0)


def test_shared_arena_is_one_mapping_for_every_instance(tmp_path):
    replay(TRACE, "dram", ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), window=WindowOptions(layers=1), instances=InstanceOptions(count=3)), out=tmp_path / "r.parquet")
    _, m = results(tmp_path / "r.parquet")
    assert m["backend"]["facts"]["arena_shared_with_owner"] is False  # instance 0 owns the arena
    assert len(m["instance_ops"]) == 3


def test_uring_cannot_share_but_can_replicate(tmp_path):
    disk = Path("/var/tmp")
    tier = disk / f"kvemu-inst-{tmp_path.name}.bin"
    with pytest.raises(BackendUnavailable, match="cannot share one arena"):
        replay(TRACE, f"uring:{tier}", ReplayOptions(window=WindowOptions(layers=1, requests=(0, 8)), instances=InstanceOptions(count=2)), out=tmp_path / "a.parquet")
    replay(TRACE, f"uring:{tier},qd=4", ReplayOptions(window=WindowOptions(layers=1, requests=(0, 8)), instances=InstanceOptions(count=2, sharing="replicated")), out=tmp_path / "b.parquet")
    assert not tier.exists() and not Path(f"{tier}.1").exists()  # each instance removed its file


def test_mmap_instances_share_one_file(tmp_path):
    out = tmp_path / "r.parquet"
    replay(TRACE, f"mmap:{tmp_path / 'pool.bin'}", ReplayOptions(window=WindowOptions(layers=1, requests=(0, 8)), datapath=DataPathOptions(chunk_tokens=16), instances=InstanceOptions(count=2)), out=out)
    _, m = results(out)
    assert m["tier"]["resident_bytes"] == m["tier"]["shared_bytes"]
    assert not (tmp_path / "pool.bin").exists()


def test_bad_instance_options():
    with pytest.raises(ConfigError, match="instances.count"):
        replay(TRACE, "dram", ReplayOptions(instances=InstanceOptions(count=0)), out="/tmp/never.parquet")
    with pytest.raises(ConfigError, match="instances.sharing"):
        replay(TRACE, "dram", ReplayOptions(instances=InstanceOptions(count=2, sharing="sometimes")), out="/tmp/never.parquet")


def test_recorded_instances_compute_only_their_own_requests(tmp_path):
    """A recorded step is one GPU's batch; split over two instances, each instance's step costs the
    roofline of its own entries (hand-computed here), not the whole batch's."""
    from collections import defaultdict

    from conftest import make_workload, record
    from kvemu.schema import iter_entries, read_trace
    from test_closed_loop import roofline_ns

    w = make_workload([0, 0, 0, 0, 1, 2], [300, 40, 900, 64, 128, 32], [5, 9, 3, 12, 4, 6])
    trace = record(w, tmp_path / "t.parquet", tier_policy="offload", max_num_batched_tokens=512)
    meta = replay(trace, "vemu:cxl-pool", ReplayOptions(schedule=ScheduleOptions(schedule="recorded"), instances=InstanceOptions(count=2)), out=tmp_path / "r.parquet")
    groups = defaultdict(lambda: [0, 0.0, 0])
    for e in iter_entries(read_trace(trace).header):
        for st, rid, tok, ctx in zip(e["step"], e["request_id"], e["tokens"], e["context_tokens"]):
            g = groups[(int(st), int(rid) % 2)]
            g[0] += int(tok)
            g[1] += int(tok) * (int(ctx) + (int(tok) + 1) / 2)
            g[2] += int(ctx) + int(tok)
    expected = sum(roofline_ns(*g) for g in groups.values())
    assert meta["steps"]["compute_ns"] == expected
    assert expected < 2 * sum(read_trace(trace).compute_ns)   # not the whole batch twice
