"""How a run's KV figures were obtained and what bounded them (kvemu.figures), and how every
report output shows it. Metadata is built by hand; every share is computed here by hand."""
import csv
import io
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvemu.figures import FIGURE_KEYS, FLAGS, KINDS, figures_of, run_figures
from kvemu.report import build_report, html_page, render_csv, render_json, render_table
from test_report import results_meta, results_table, write_results


def meta(mode="measured", name="dram", facts=None, virtual=False, datapath=None, **extra):
    """The parts of a results file's metadata the figures come from."""
    backend = {"spec": name, "name": name, "mode": mode, "facts": facts or {}}
    if virtual is not None:
        backend["virtual"] = virtual
    out = {"backend": backend, **extra}
    if datapath is not None:
        out["datapath"] = datapath
    return out


def datapath(**ops):
    """``datapath`` with (time_ns, medium_bound_ns) per op."""
    return {"ops": {op: {"time_ns": t, "medium_bound_ns": b} for op, (t, b) in ops.items()}}


#: A measured run 3 % bound by the host: (20 + 100) / (1000 + 3000).
PLAIN = datapath(load=(1000, 20), store=(3000, 100))
#: A host-bound measured run: (900,000 + 96,000) / (1,000,000 + 200,000) = 83 %.
HOST_BOUND = datapath(load=(1_000_000, 900_000), store=(200_000, 96_000), read=(0, 0))
#: An emulated tier faster than this host: every access took this host's time.
FLOOR = {"backend": "emu", "mode": "emulated", "accesses": 338, "floor_hits": 338}
#: A numa node with no allowed CPU outside it: local memory.
NUMA_LOCAL = {"backend": "numa", "node": 0, "remote_cpu": False, "cpu_pinned": False}


# --------------------------------------------------------------------------------------------
# run_figures


def test_a_plain_measured_run():
    f = run_figures(meta(datapath=PLAIN))
    assert f == {"kind": "measured", "compute": "modelled", "floor_share": None,
                 "host_bound_share": pytest.approx(0.03), "locality": None, "flags": [],
                 "upper_bound": False, "label": "measured"}
    assert list(f) == list(FIGURE_KEYS)


def test_a_host_bound_measured_run_is_an_upper_bound():
    f = run_figures(meta(datapath=HOST_BOUND))
    assert f["host_bound_share"] == pytest.approx(0.83)
    assert f["flags"] == ["host-bound"] and f["upper_bound"] is True
    assert f["label"] == "measured, host-bound 83% (upper bound)"
    # from 5 % on: 50 of 1000 is host-bound, 49 is not
    assert run_figures(meta(datapath=datapath(load=(1000, 50))))["flags"] == ["host-bound"]
    assert run_figures(meta(datapath=datapath(load=(1000, 49))))["flags"] == []


def test_an_emulated_run_faster_than_this_host_is_floor_limited():
    f = run_figures(meta("emulated", "emu", FLOOR))
    assert f["kind"] == "emulated" and f["floor_share"] == 1.0 and f["host_bound_share"] is None
    assert f["flags"] == ["floor-limited"] and f["upper_bound"] is True
    assert f["label"] == "emulated, floor-limited 100% (upper bound)"
    # a few late accesses (preemption) stay under 1 %; no hits is a share of 0
    few = run_figures(meta("emulated", "emu", {**FLOOR, "accesses": 1000, "floor_hits": 9}))
    assert few["floor_share"] == pytest.approx(0.009)
    assert few["flags"] == [] and few["label"] == "emulated"
    none = run_figures(meta("emulated", "emu", {**FLOOR, "floor_hits": 0}))
    assert none["floor_share"] == 0.0 and not none["upper_bound"]
    # 997 of 1000 is not all of them, and does not round to it
    most = run_figures(meta("emulated", "emu", {**FLOOR, "accesses": 1000, "floor_hits": 997}))
    assert most["label"] == "emulated, floor-limited >99% (upper bound)"
    # datapath figures do not apply to an emulation
    with_datapath = run_figures(meta("emulated", "emu", FLOOR, datapath=HOST_BOUND))
    assert with_datapath["host_bound_share"] is None


def test_a_virtual_run_has_no_floor_and_no_bound():
    facts = {"backend": "vemu", "mode": "emulated-virtual", "virtual": True, "accesses": 500}
    f = run_figures(meta("emulated", "vemu", facts, virtual=True))
    assert f == {"kind": "virtual", "compute": "modelled", "floor_share": None,
                 "host_bound_share": None, "locality": None, "flags": [], "upper_bound": False,
                 "label": "virtual"}
    # results from before backend.virtual: the backend's own facts say so
    assert run_figures(meta("emulated", "vemu", facts, virtual=None))["kind"] == "virtual"
    assert run_figures(meta("emulated", "emu", FLOOR, virtual=None))["kind"] == "emulated"


def test_a_numa_run_says_whether_it_is_local():
    f = run_figures(meta(name="numa", facts=NUMA_LOCAL, datapath=PLAIN))
    assert f["locality"] == "local" and f["flags"] == ["local"] and f["upper_bound"] is False
    assert f["label"] == "measured, numa local"
    remote = run_figures(meta(name="numa", facts={**NUMA_LOCAL, "remote_cpu": True}))
    assert remote["locality"] == "remote" and remote["flags"] == []
    assert remote["label"] == "measured"
    both = run_figures(meta(name="numa", facts=NUMA_LOCAL, datapath=HOST_BOUND))
    assert both["flags"] == ["host-bound", "local"]
    assert both["label"] == "measured, numa local, host-bound 83% (upper bound)"
    # other backends have no locality, whatever their facts hold
    assert run_figures(meta(facts={"remote_cpu": False}))["locality"] is None


def test_older_results_without_datapath_virtual_or_facts():
    f = run_figures(meta(virtual=None))
    assert f["kind"] == "measured" and f["host_bound_share"] is None and f["flags"] == []
    assert run_figures(meta(datapath={"ops": {}}))["host_bound_share"] is None
    assert run_figures(meta(datapath=datapath(load=(0, 0))))["host_bound_share"] is None  # no time
    emulated = run_figures(meta("emulated", "emu", {}, virtual=None))
    assert emulated["kind"] == "emulated" and emulated["floor_share"] is None
    assert run_figures(meta(name="numa", facts={"node": 1}))["locality"] is None


def test_compute_is_modelled_unless_the_trace_recorded_it():
    assert run_figures(meta(trace={"gpu": {"name": "H100-SXM"}}))["compute"] == "modelled"
    real = {"workload": {"kind": "realrun:tiny"}, "gpu": {}}
    assert run_figures(meta(trace=real))["compute"] == "recorded"
    assert run_figures(meta(trace={"workload": {"kind": "vllm-events"}}))["compute"] == "recorded"


@pytest.mark.parametrize("bad", [
    None, [], "x", 3, {"backend": None}, {"backend": "dram"}, {"backend": {"mode": ["measured"]}},
    meta(facts="facts"), meta(datapath="fast"), meta(datapath={"ops": [1, 2]}),
    meta(datapath={"ops": {"load": "x", "store": None}}),
    meta(datapath=datapath(load=("1000", "900"))), meta(datapath=datapath(load=(True, True))),
    meta(datapath=datapath(load=(float("nan"), 1.0))), meta(datapath=datapath(load=(1000, 2000))),
    meta(datapath=datapath(load=(1000, -1))),
    meta("emulated", "emu", {"accesses": "338", "floor_hits": 338}),
    meta("emulated", "emu", {"accesses": 10, "floor_hits": True}),
    meta("emulated", "emu", {"accesses": 10, "floor_hits": 11}),
    meta("emulated", "emu", {"accesses": 10.5, "floor_hits": 1}),
    meta("emulated", "emu", {"accesses": 0, "floor_hits": 0}),
    meta("emulated", "vemu", {"mode": ["emulated-virtual"]}, virtual="yes"),
    meta(name="numa", facts={"remote_cpu": "false"}),
    meta(name=["numa"], facts={"remote_cpu": False}),
    {"backend": {"mode": "emulated-virtual"}}, {"backend": {"mode": "measured"}, "trace": "t"},
])
def test_garbage_is_missing_never_an_error(bad):
    f = run_figures(bad)
    assert list(f) == list(FIGURE_KEYS)
    assert f["floor_share"] is None and f["host_bound_share"] is None and f["locality"] is None
    assert f["flags"] == [] and f["upper_bound"] is False and f["compute"] == "modelled"
    assert f["kind"] in (*KINDS, None) and f["label"]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(mode=st.sampled_from(["measured", "emulated"]) | JSON, virtual=JSON, facts=JSON,
       ops=JSON, figures=JSON)
def test_any_json_gives_a_well_formed_block(mode, virtual, facts, ops, figures):
    m = {"backend": {"mode": mode, "name": "numa", "virtual": virtual, "facts": facts},
         "datapath": {"ops": ops}, "figures": figures}
    for f in (run_figures(m), figures_of(m)):
        assert list(f) == list(FIGURE_KEYS)
        assert f["kind"] in (*KINDS, None) and set(f["flags"]) <= set(FLAGS)
        for share in (f["floor_share"], f["host_bound_share"]):
            assert share is None or 0 <= share <= 1


def test_a_stored_block_is_preferred_when_well_formed():
    m = meta(datapath=PLAIN)
    assert figures_of(m) == run_figures(m)  # older results: derived
    assert figures_of({**m, "figures": run_figures(m)}) == run_figures(m)
    # as replay wrote it, though the metadata has changed since
    stored = run_figures(meta(datapath=HOST_BOUND))
    assert figures_of({**m, "figures": stored}) == stored
    # ill-formed or contradicting backend.mode: derived again
    for broken in ({**stored, "kind": "emulated"}, {**stored, "host_bound_share": 1.5},
                   {**stored, "flags": "host-bound"}, {**stored, "upper_bound": False},
                   {**stored, "extra": 1}, {k: v for k, v in stored.items() if k != "label"},
                   {**stored, "flags": ["host-bound", "host-bound"]}, "measured", None):
        assert figures_of({**m, "figures": broken}) == run_figures(m)
    virtual = run_figures(meta("emulated", "vemu", virtual=True))
    assert figures_of({**meta("emulated", "vemu", virtual=True), "figures": virtual}) == virtual


# --------------------------------------------------------------------------------------------
# The report


#: label, backend, mode, backend extras, metadata extras, TTFT: the emulated and virtual runs
#: are the fastest, and never the default baseline.
RUNS = [
    ("dram", "dram", "measured", {}, {"datapath": PLAIN}, 100.0),
    ("nvme-file", "uring:/x", "measured", {}, {"datapath": HOST_BOUND}, 300.0),
    ("numa", "numa:0", "measured", {"name": "numa", "facts": NUMA_LOCAL}, {}, 110.0),
    ("cxl-emu", "emu:hbm", "emulated", {"virtual": False, "facts": FLOOR}, {}, 50.0),
    ("cxl-vemu", "vemu:cxl-pool", "emulated",
     {"virtual": True, "facts": {"mode": "emulated-virtual"}}, {}, 20.0),
    ("old", "mmap:/dev/shm/kv", "measured", {}, {}, 120.0),
]
EXPECTED = {  # label: mode column, figures label, kind, flags, host-bound share, floor share
    "dram": ("measured", "measured", "measured", [], 0.03, None),
    "nvme-file": ("measured host-bound", "measured, host-bound 83% (upper bound)", "measured",
                  ["host-bound"], 0.83, None),
    "numa": ("measured local", "measured, numa local", "measured", ["local"], None, None),
    "cxl-emu": ("emulated floor-limited", "emulated, floor-limited 100% (upper bound)",
                "emulated", ["floor-limited"], None, 1.0),
    "cxl-vemu": ("virtual", "virtual", "virtual", [], None, None),
    "old": ("measured", "measured", "measured", [], None, None),
}


@pytest.fixture
def kinds(tmp_path):
    """One trace replayed on every kind of figures, each flag among them."""
    paths = []
    for label, spec, mode, backend, extra, ttft in RUNS:
        m = results_meta(label, spec, mode, **extra)
        m["backend"].update(backend)
        paths.append(write_results(tmp_path / f"{label}.parquet", results_table([ttft] * 4), m))
    return paths


def test_the_table_says_how_every_run_was_obtained(kinds):
    report = build_report(kinds)
    (group,) = report.groups
    assert group.baseline.run.label == "dram" and "fastest measured" in group.baseline_rule
    text = render_table(report)
    for width in (80, 100):
        assert max(map(len, render_table(report, width=width).splitlines())) <= width
    lines = text.splitlines()
    for label, (mode, figures, *_) in EXPECTED.items():
        start = next(i for i, line in enumerate(lines) if line.startswith("run "))  # the latency table
        latency = next(line for line in lines[start:] if re.match(rf"[* ] {label} ", line))
        assert f"  {mode}  " in latency, latency
        # the figures table: how obtained, then what was replayed
        assert any(re.fullmatch(rf"[* ] {label} +{re.escape(figures)}( {{2,}}\S.*)?", line) for line in lines)
    notes = " ".join(" ".join(lines[lines.index("* baseline of its trace."):]).split())
    for sentence in (
        "measured: KV accesses performed and timed on this host",
        "host-bound: a measured run in which this host's CPU workers could not supply what the "
        "modelled GPU link would carry",
        "emulated: KV times are delays injected on this host to a tier profile",
        "so they are never faster than this host",
        "floor-limited: the share of an emulated run's accesses in which this host was slower "
        "than the profile",
        "virtual: KV times are the profile's model computed in virtual time; no data moved and "
        "nothing waited, so they are not bounded by this host",
        "local: a numa run whose arena is on the replaying CPU's own node",
        "compute: GPU compute time is modelled (docs/engine.md), not measured",
    ):
        assert sentence in notes
    assert "cannot be faster than this host" not in notes and "EMULATED" not in text


def test_a_report_of_measured_runs_explains_only_measured(kinds):
    text = render_table(build_report(kinds[:1]))
    assert "measured: KV accesses" in text
    assert not re.search(r"^(emulated|virtual|host-bound|floor-limited|local):", text, re.M)


def test_json_and_csv_carry_the_figures_of_every_run(kinds):
    report = build_report(kinds)
    runs = {r["label"]: r for r in json.loads(render_json(report))["runs"]}
    rows = {r["label"]: r for r in csv.DictReader(io.StringIO(render_csv(report)))}
    for label, (_, figures, kind, flags, host, floor) in EXPECTED.items():
        f = runs[label]["figures"]
        assert (f["kind"], f["flags"], f["label"]) == (kind, flags, figures)
        assert f["host_bound_share"] == pytest.approx(host) and f["floor_share"] == floor
        assert f["upper_bound"] is (label in ("nvme-file", "cxl-emu"))
        assert f["compute"] == "modelled"
        assert f["locality"] == ("local" if label == "numa" else None)
        row = rows[label]
        assert (row["figures_kind"], row["figures_flags"]) == (kind, ";".join(flags))
        if host is None:
            assert row["host_bound_share"] == ""
        else:
            assert float(row["host_bound_share"]) == pytest.approx(host)
        assert row["floor_share"] == ("" if floor is None else repr(floor))
        assert row["upper_bound"] == str(f["upper_bound"]) and row["figures_label"] == figures
        assert not any(k.startswith("figures_flags_") or k == "figures" for k in row)
    assert runs["cxl-vemu"]["mode"] == "emulated"  # backend.mode, as results files have it


def test_html_badges_every_kind_and_flag(kinds):
    page = html_page(build_report(kinds))
    sources = page[page.index("<h2>Runs</h2>"):]
    for label, (_, figures, kind, flags, *_) in EXPECTED.items():
        (row,) = re.findall(rf'<tr[^>]*><th scope="row">{re.escape(label)}</th>.*?</tr>', sources)
        badges = re.findall(r'<span class="badge ([a-z-]+)"[^>]*>([A-Z-]+)</span>', row)
        assert badges == [(t, t.upper()) for t in [kind, *flags]]
        assert f"<td>{figures}</td>" in row
        # and in each run table of the trace (reuse, latency, comparison, KV): beside the label,
        # the flags and a kind other than measured, but in the latency table, whose mode column
        # has them (once a row is enough: it keeps the table within a 1000 px page)
        label_cells = re.findall(rf'<span title="[^"]*">{re.escape(label)}</span>(.*?)</th>', page)
        assert len(label_cells) == 4
        beside = [t for t in [kind, *flags] if t != "measured"]
        terms = [[t for t in re.findall(r'<span class="badge ([a-z-]+)"', cell) if t != "baseline"]
                 for cell in label_cells]
        assert terms == [beside, [], beside, beside]
    vemu = re.search(r'<tr class="virtual"><th scope="row"><span title="[^"]*">cxl-vemu', page)
    assert vemu is not None
    notes = page[page.index("<h2>Notes</h2>"):]
    for term in ("measured", "emulated", "virtual", "host-bound", "floor-limited", "local"):
        assert f'<li><span class="badge {term}">{term.upper()}</span>' in notes


def test_the_report_uses_the_figures_the_results_carry(tmp_path):
    stored = run_figures(meta(datapath=HOST_BOUND))
    m = results_meta("stored", figures=stored)  # no datapath of its own: only the stored block
    broken = results_meta("broken", figures={**stored, "kind": "virtual"})
    paths = [write_results(tmp_path / f"{m['label']}.parquet", results_table([1.0]), m)
             for m in (m, broken)]
    runs = {r["label"]: r for r in json.loads(render_json(build_report(paths)))["runs"]}
    assert runs["stored"]["figures"]["label"] == "measured, host-bound 83% (upper bound)"
    assert runs["broken"]["figures"] == run_figures(broken)
