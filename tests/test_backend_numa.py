"""The numa backend: an arena bound to one NUMA node, its placement checked, the CPU moved off it.

Most machines that run these tests have one node; there numa:0 is the local baseline. The
remote case (another node with memory and a CPU elsewhere) runs only where the machine has it.
"""
import errno
import os
from pathlib import Path

import pytest

from backend_helpers import replay_one
from kvemu.backends import Backend
from kvemu.errors import BackendUnavailable, ConfigError

NODES = Path("/sys/devices/system/node")
BLOCK = 4096

pytestmark = pytest.mark.skipif(not (NODES / "online").exists(), reason="kernel shows no NUMA nodes")


def _cpulist(text: str) -> set[int]:
    cpus = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _topology() -> tuple[list[int], dict[int, set[int]]]:
    """Online nodes with memory, and each online node's CPUs, as sysfs shows them."""
    mem, cpus = [], {}
    for n in sorted(_cpulist((NODES / "online").read_text())):
        meminfo = (NODES / f"node{n}" / "meminfo").read_text()
        total_kb = int(meminfo.split("MemTotal:")[1].split()[0])
        if total_kb > 0:
            mem.append(n)
        cpus[n] = _cpulist((NODES / f"node{n}" / "cpulist").read_text())
    return mem, cpus


MEM_NODES, NODE_CPUS = _topology()
LOCAL = MEM_NODES[0]


def _prepared(spec: str, n_slots: int = 4, n_layers: int = 2, block: int = BLOCK) -> Backend:
    b = Backend(spec)
    try:
        b.prepare(block, n_slots, n_layers, n_layers, False)
    except BackendUnavailable as e:  # mbind/move_pages forbidden (a container's seccomp profile)
        b.close()
        pytest.skip(str(e))
    return b


def test_local_node_binds_every_sampled_page():
    before = os.sched_getaffinity(0)
    with _prepared(f"numa:{LOCAL}", n_slots=16) as b:
        d = b.describe()
        assert d["backend"] == "numa" and d["node"] == LOCAL
        assert d["nodes_with_memory"] == MEM_NODES
        assert d["pages_checked"] == d["arena_bytes"] // d["page_size"] == 32
        assert d["pages_on_node"] == d["pages_checked"]
        assert d["prefaulted"] is True and d["cache_cold"] is True
        if d["remote_cpu"]:
            assert d["cpu_pinned"] is True and d["cpu_node"] != LOCAL
        else:  # one node here: numa:0 is local memory and says so
            assert d["cpu_pinned"] is False and d["cpu"] is None
            assert d["cpu_node"] == LOCAL and d["staging_node"] == LOCAL
            assert "no allowed CPU outside node" in d["cpu_note"]
    assert os.sched_getaffinity(0) == before


def test_placement_sample_is_capped():
    # 64 KiB x 256 slots x 2 layers = 32 MiB: 8192 base pages, of which 4096 are checked.
    with _prepared(f"numa:{LOCAL},hugepages=0", n_slots=256, block=65536) as b:
        d = b.describe()
        assert d["pages_checked"] == 4096 == d["pages_on_node"]
        assert d["hugepages_requested"] is False and d["arena_hugepage_bytes"] == 0


def test_describe_before_prepare():
    with Backend(f"numa:{LOCAL}") as b:
        d = b.describe()
        assert d["prepared"] is False and d["node"] == LOCAL
        assert d["pages_checked"] == 0 and d["cpu_pinned"] is False


def test_stores_land_in_the_bound_arena_and_load_back():
    with _prepared(f"numa:{LOCAL}") as b:
        for k in range(8):
            b.debug_poke("staging", k * BLOCK, bytes([k + 1]) * BLOCK)
        replay_one(b, 2, "store")
        # Layer-major: layer j's chunk of slot 2 is block j * 4 + 2; staging blocks 0 and 1 went there.
        assert b.debug_peek("arena", 2 * BLOCK, BLOCK) == b"\x01" * BLOCK
        assert b.debug_peek("arena", 6 * BLOCK, BLOCK) == b"\x02" * BLOCK
        b.debug_poke("staging", 0, bytes(8 * BLOCK))
        replay_one(b, 2, "load")
        assert b.debug_peek("staging", 2 * BLOCK, 2 * BLOCK) == b"\x01" * BLOCK + b"\x02" * BLOCK
        replay_one(b, 2, "read")
        assert [b.op_stats(op)["accesses"] for op in ("load", "store", "read")] == [2, 2, 2]


@pytest.mark.parametrize("node", [n for n in (1, 99) if n not in MEM_NODES] + [1023, 5000])
def test_missing_node_is_unavailable_and_names_the_nodes(node):
    listed = ",".join(map(str, MEM_NODES))
    with pytest.raises(BackendUnavailable, match=rf"^numa: node {node} is unavailable "
                                                 rf"\(nodes with memory: {listed}\)$") as info:
        Backend(f"numa:{node}")
    assert info.value.errno == errno.ENODEV


@pytest.mark.parametrize("spec,match", [
    ("numa", "'' is not a node number"),
    ("numa:", "'' is not a node number"),
    ("numa:x", "'x' is not a node number"),
    ("numa:-1", "'-1' is not a node number"),
    ("numa:0x1", "'0x1' is not a node number"),
    ("numa:99999999999", "not a node number"),
    ("numa:0,hugepages=2", r"numa: option hugepages is '2', must be 0 or 1"),
    ("numa:0,cold", r"numa: option cold needs a value: cold=0\|1"),
    ("numa:0,offset=0", r"numa: unknown option 'offset=0' \(known: hugepages=0\|1, cold=0\|1, workers=N\)"),
])
def test_bad_specs_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        Backend(spec)


def _remote_pair():
    """A node with memory and the CPUs allowed here that lie outside it, or None."""
    allowed = os.sched_getaffinity(0)
    for node in MEM_NODES:
        elsewhere = {c for n, cpus in NODE_CPUS.items() if n != node for c in cpus} & allowed
        if elsewhere:
            return node, elsewhere
    return None


@pytest.mark.skipif(len(MEM_NODES) < 2 or _remote_pair() is None,
                    reason="needs two nodes with memory and a CPU outside one of them")
def test_remote_node_binds_and_pins_the_cpu_elsewhere():
    node, elsewhere = _remote_pair()
    before = os.sched_getaffinity(0)
    with _prepared(f"numa:{node}", n_slots=64) as b:
        d = b.describe()
        assert d["node"] == node and d["pages_on_node"] == d["pages_checked"] > 0
        assert d["remote_cpu"] is True and d["cpu_pinned"] is True
        assert d["cpu"] in elsewhere and d["cpu"] in NODE_CPUS[d["cpu_node"]]
        assert d["cpu_node"] != node
        assert os.sched_getaffinity(0) == {d["cpu"]}
        assert d["staging_node"] == d["cpu_node"]  # first touched from the pinned CPU
        b.debug_poke("staging", 0, b"\x5a" * BLOCK)
        replay_one(b, 1, "store")
        assert b.debug_peek("arena", BLOCK, BLOCK) == b"\x5a" * BLOCK
    assert os.sched_getaffinity(0) == before
