"""Backend specs and the table of backend kinds: parsing and printing, what each kind implies, and
that no module outside kvemu/backend_spec.py tests a backend's name."""

import ast
from pathlib import Path

import pytest

from kvemu.backend_spec import KINDS, BackendSpec, kind_of
from kvemu.errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[1] / "kvemu"


@pytest.mark.parametrize("text, name, target, options", [
    ("dram", "dram", None, ()),
    ("dram:workers=2,hugepages=0", "dram", None, (("workers", "2"), ("hugepages", "0"))),
    ("numa:1", "numa", "1", ()),
    ("mmap:/dev/dax0.0", "mmap", "/dev/dax0.0", ()),
    ("uring:/mnt/kv.bin,qd=32,batch=4", "uring", "/mnt/kv.bin", (("qd", "32"), ("batch", "4"))),
    ("emu:cxl-pool", "emu", "cxl-pool", ()),
    ("vemu:my.toml,latency_ns=2000", "vemu", "my.toml", (("latency_ns", "2000"),)),
])
def test_parse_and_print_round_trip(text, name, target, options):
    s = BackendSpec.parse(text)
    assert (s.name, s.target, s.options) == (name, target, options)
    assert s.text() == str(s) == text
    assert BackendSpec.parse(s) is s


@pytest.mark.parametrize("odd", ["dram:", "uring:,qd=8", "dram:a=1,,b=2", "emu:nvme,=5", "dram:bare"])
def test_odd_option_text_reaches_the_backend_as_given(odd):
    # the backend (C, or the profile resolver) says what is wrong with it, quoting the user's text
    assert BackendSpec.parse(odd).args() == odd.partition(":")[2]


@pytest.mark.parametrize("bad", ["", "ram", "DRAM", "nvme:/x", 3, None])
def test_unknown_backends_are_one_line(bad):
    with pytest.raises(ConfigError, match=r"unknown backend|non-empty string") as e:
        BackendSpec.parse(bad)
    assert "\n" not in str(e.value)


def test_options_edit_without_duplicating_keys():
    s = BackendSpec.parse("uring:/x,qd=8,batch=2")
    assert s.with_option("qd", 1).text() == "uring:/x,batch=2,qd=1"
    assert s.option("qd") == "8" and s.option("size") is None and s.has_option("batch")


def test_instances_of_a_file_backed_tier():
    s = BackendSpec.parse("mmap:/dev/shm/kv.bin,hugepages=0")
    assert s.instance(0, replicated=True, attached=False) == s
    assert s.instance(2, replicated=True, attached=False).text() == "mmap:/dev/shm/kv.bin.2,hugepages=0"
    assert s.instance(1, replicated=False, attached=True).text() == "mmap:/dev/shm/kv.bin,hugepages=0,size=existing"
    dram = BackendSpec.parse("dram")
    assert dram.instance(3, replicated=True, attached=True) is dram


def test_each_store_kind_names_a_class_that_implements_the_store_protocol():
    import inspect

    from kvemu.stores import Store, store_class

    members = {n for n in vars(Store) if not n.startswith("_")} | set(Store.__annotations__)
    assert {"start", "put_from", "get_into", "describe", "stop", "outcomes"} <= members
    for name, kind in KINDS.items():
        if not kind.store:
            continue
        cls = store_class(kind.store)
        assert all(hasattr(cls, m) for m in members), (name, members - set(dir(cls)))
        assert list(inspect.signature(cls.put_from).parameters) == ["self", "keys", "addrs", "sizes"]
        # a store is measured, holds its own objects (no arena another instance attaches to), has no workers
        assert kind.mode == "measured" and not kind.shareable and not kind.workers and kind.medium == "storage"
        assert set(cls.outcomes.values()) <= {"put_refused", "lease_held", "get_missing", "get_partial"}
    assert KINDS["mooncake"].store == "kvemu.stores.mooncake:MooncakeStore"


def test_what_each_kind_implies():
    stores = {k for k, v in KINDS.items() if v.store}
    assert {"mooncake", "files"} <= stores
    assert {k for k, v in KINDS.items() if v.mode == "measured"} - stores == {"dram", "numa", "mmap", "uring"}
    assert [k for k, v in KINDS.items() if v.virtual] == ["vemu"]
    assert {k for k, v in KINDS.items() if v.lockstep} == {"emu", "vemu"}
    assert [k for k, v in KINDS.items() if not v.shareable and not v.store] == ["uring"]
    assert {k for k, v in KINDS.items() if v.workers} == {"dram", "numa", "mmap"}
    assert kind_of("vemu").arena is None and kind_of("uring").arena == "file"
    assert BackendSpec.parse("mmap:/dev/dax1.0").resources() == {"dax": 1}
    assert BackendSpec.parse("mmap:/dev/shm/x").resources() == {"mem": 1}
    assert BackendSpec.parse("numa:2").resources() == {"numa2": 1}
    assert BackendSpec.parse("vemu:nvme").resources() == {}
    assert BackendSpec.parse("emu:x.toml").files_read() == ["x.toml"]
    assert BackendSpec.parse("emu:nvme").files_read() == []
    assert BackendSpec.parse("uring:/t/f.bin").files_read() == ["/t/f.bin"]
    assert BackendSpec.parse("numa:1").short() == "numa:1" and BackendSpec.parse("uring:/a,qd=2").short() == "uring"


# "mooncake" names a backend (Mooncake Store) and a workload source (Mooncake's traces,
# --workload mooncake:PATH): only the names that are not also a workload's are looked for.
_WORKLOAD_SOURCES = {"mooncake", "azure"}


def _names_a_kind(node) -> bool:
    """A comparison or membership test against a backend's name, or a startswith over names."""
    def is_name(n):
        return isinstance(n, ast.Constant) and n.value in KINDS and n.value not in _WORKLOAD_SOURCES
    def names(n):
        return is_name(n) or (isinstance(n, (ast.Tuple, ast.List, ast.Set)) and any(is_name(e) for e in n.elts))
    if isinstance(node, ast.Compare):
        return names(node.left) or any(names(c) for c in node.comparators)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
        return any(names(a) for a in node.args)
    if isinstance(node, ast.Dict):
        return any(is_name(k) for k in node.keys if k is not None)
    return False


def test_no_module_outside_the_table_tests_a_backend_name():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "backend_spec.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _names_a_kind(node):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert offenders == []
