"""The report's table model (kvemu/report/tables.py) and what every renderer draws from it: one
model, no private names shared between modules, CSV safe for spreadsheets, spreads in one number
format, one baseline per table, labels numbered within a workload."""
import ast
import csv
import html
import io
import re
from pathlib import Path

import pytest

import kvemu
from kvemu.report import build_report, group_sections, html_page, render_csv, render_table, runs_table
from kvemu.report.tables import spread
from test_report import SHA_A, SHA_B, results_meta, results_table, write_results

PACKAGE = Path(kvemu.__file__).parent


# --------------------------------------------------------------------------------------------
# No module reaches into another's private names


def _report_module_names() -> set[str]:
    return {p.stem for p in (PACKAGE / "report").glob("*.py")}


def _private_uses(path: Path) -> list[str]:
    """Every underscore-prefixed name ``path`` takes from a module of kvemu.report: imported by
    name, or read as an attribute of a report module it imported."""
    tree = ast.parse(path.read_text(), str(path))
    in_report = path.parent.name == "report"
    modules = _report_module_names()

    def is_report(module: str | None, level: int) -> bool:
        parts = (module or "").split(".")
        if level == 0:
            return parts[:2] == ["kvemu", "report"]
        if level == 1:  # from .x: a sibling of this file
            return in_report and (module is None or parts[0] in modules)
        return level == 2 and parts[0] == "report"  # from ..report(.x), from kvemu/plots.py's level

    found, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and is_report(node.module, node.level):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path.name}:{node.lineno} imports {alias.name}")
                elif node.module is None or alias.name in modules:
                    bound.add(alias.asname or alias.name)  # a module: watch its attributes
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvemu.report"):
                    bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append(f"{path.name}:{node.lineno} reads {node.attr}")
    return found


def test_no_report_module_uses_another_modules_private_names():
    files = sorted((PACKAGE / "report").glob("*.py")) + [PACKAGE / "plots.py"]
    assert len(files) >= 8
    assert [use for f in files for use in _private_uses(f)] == []


def test_the_checker_sees_private_imports(tmp_path):
    report = tmp_path / "report"
    report.mkdir()
    (report / "html.py").touch()
    bad = report / "text.py"
    bad.write_text("from .html import _esc, render\nfrom . import html\nhtml._badge('x')\n"
                   "from kvemu.report.compare import _run_row\n")
    uses = _private_uses(bad)
    assert [u.split()[-1] for u in uses] == ["_esc", "_run_row", "_badge"]


# --------------------------------------------------------------------------------------------
# Fixtures


def _write(tmp_path, name, ttft, label=None, sha=SHA_A, backend="dram", mode="measured", **extra):
    table = results_table([ttft] * 4, tpot_ms=[ttft / 10] * 4)
    return write_results(tmp_path / f"{name}.parquet", table,
                         results_meta(label or name, backend, mode, sha, **extra))


def _repetitions(*median_ttft_ms):
    figures = [{"median_ttft_ms": t, "p99_ttft_ms": 2 * t, "mean_tpot_ms": t / 10, "p99_tpot_ms": t / 5,
                "median_e2el_ms": 3 * t, "request_throughput": 1000 / t, "kv_gbps_load": 8.4,
                "kv_gbps_store": 4.2, "kv_gbps_read": 16.8, "kv_stall_share": 0.25}
               for t in median_ttft_ms]
    return {"n": len(figures), "chosen": 0, "runs": figures}


def _tables(text: str) -> list[list[str]]:
    """The text report's tables: blocks of lines between blank lines, but the verdicts' (wrapped
    sentences, whose continuation lines may begin with a label)."""
    return [block.splitlines() for block in text.split("\n\n")
            if not block.lstrip("\n").startswith(("verdict for ", "workload "))]


# --------------------------------------------------------------------------------------------
# One model, every renderer


def test_text_and_html_show_every_cell_of_the_model(tmp_path):
    paths = [_write(tmp_path, "dram", 100.0), _write(tmp_path, "nvme", 300.0, backend="nvme"),
             _write(tmp_path, "cxl", 50.0, backend="cxl", mode="emulated")]
    report = build_report(paths)
    (group,) = report.groups
    sections = group_sections(group, report.slo)
    # no GPU model, no trace at hand: those two sections say why they are missing
    assert [s.key for s in sections] == ["reuse", "latency", "comparison", "kv", "figures", "breakeven",
                                         "capacity"]
    assert [bool(s.missing) for s in sections] == [False] * 5 + [True] * 2
    blocks = _tables(render_table(report, width=200))
    page = html.unescape(re.sub(r"<[^>]+>", " ", html_page(report)))
    for section in sections:
        if section.missing:
            assert section.missing in page
        for table in section.tables:
            titles = [c.title for c in table.columns]
            (lines,) = [b for b in blocks if any(ln.split() == " ".join(titles).split() for ln in b)]
            assert len(table.rows) == 3
            for row in table.rows:
                assert len(row.cells) == len(table.columns)
                (line,) = [ln for ln in lines if ln[2:].startswith(row.run.run.label + " ")]
                assert line.startswith("* " if row.baseline else "  ")
                assert line[2:].split() == " ".join(c.text for c in row.cells).split()
                if section.key != "figures":  # the page gives it in its Runs table
                    assert all(cell.text in page for cell in row.cells)
    # the figures the model holds are the report's own, in the report's row order
    latency = next(s for s in sections if s.key == "latency").tables[0]
    assert [c.value for c in latency.column("median_ttft_ms")] == [100.0, 300.0, 50.0]
    assert [c.text for c in latency.column("median_ttft_ms")] == ["100.0", "300.0", "50.00"]
    assert [c.badges for c in latency.column("mode")] == [("measured",), ("measured",), ("emulated",)]
    assert [c.badges for c in latency.column("run")] == [(), (), ("emulated",)]


def test_csv_rows_are_the_runs_table(tmp_path):
    report = build_report([_write(tmp_path, "dram", 100.0), _write(tmp_path, "nvme", 300.0, backend="nvme")])
    table = runs_table(report)
    rows = list(csv.reader(io.StringIO(render_csv(report))))
    assert rows[0] == [c.key for c in table.columns]
    assert rows[1:] == [[c.text for c in row.cells] for row in table.rows]
    kinds = {c.key: c.kind for c in table.columns}
    assert kinds["median_ttft_ms"] == "number" and kinds["label"] == "text" and kinds["backend"] == "text"


def test_csv_of_runs_with_and_without_repetitions_has_one_header(tmp_path):
    """A run with repetitions has spread columns a single run lacks: every row gets every column
    (this used to stop the CSV with a ValueError)."""
    report = build_report([_write(tmp_path, "one", 100.0),
                           _write(tmp_path, "reps", 120.0, backend="nvme", repetitions=_repetitions(110, 130))])
    rows = list(csv.DictReader(io.StringIO(render_csv(report))))
    assert [r["label"] for r in rows] == ["one", "reps"]
    assert "spread" not in rows[0]
    assert rows[0]["spread_median_ttft_ms_min"] == "" and rows[0]["repetitions"] == "1"
    assert float(rows[1]["spread_median_ttft_ms_min"]) == 110 and float(rows[1]["spread_median_ttft_ms_max"]) == 130
    header = list(rows[0])
    # the spread columns sit where the spread is in a run record, after repetitions
    assert header.index("spread_median_ttft_ms_min") == header.index("repetitions") + 1


# --------------------------------------------------------------------------------------------
# CSV safe for spreadsheets


@pytest.mark.parametrize("label", ["=1+2", "+1", "-1", "@SUM(A1)", "\tx", "\rx", '=HYPERLINK("http://x")'])
def test_csv_escapes_text_a_spreadsheet_would_run_as_a_formula(tmp_path, label):
    # an emulated run is never the default baseline: its difference from the baseline is negative
    report = build_report([_write(tmp_path, "dram", 100.0),
                           _write(tmp_path, "fast", 50.0, label=label, backend="cxl", mode="emulated")])
    rows = {r["run_id"]: r for r in csv.DictReader(io.StringIO(render_csv(report), newline=""))}
    fast = rows["run-" + label]
    assert fast["label"] == "'" + label
    # a negative number is a number, not a formula: it stays as it is
    assert fast["delta_vs_baseline_ms_ttft"] == "-50.0"
    assert float(fast["delta_vs_baseline_ms_ttft"]) == -50.0
    assert rows["run-dram"]["label"] == "dram"
    if label.isprintable():  # the other outputs show the label as it is
        assert any(line[2:].startswith(label + " ") for line in render_table(report, width=200).splitlines())


# --------------------------------------------------------------------------------------------
# Spreads in one number format


@pytest.mark.parametrize("low, high, expected", [
    (1974.2, 13214.4, "1,974–13,214"),
    (10.34, 10.9, "10.34–10.90"),
    (2957.0, 2957.0, "2,957–2,957"),
    (0.0, 0.0, "0–0"),
    (1.305, 1.3051, "1.305–1.305"),
    (99.99, 100.2, "100.0–100.2"),
    (0.0123, 0.0456, "0.01230–0.04560"),
])
def test_spread_has_one_format_for_both_ends(low, high, expected):
    assert spread(low, high) == expected


@pytest.mark.parametrize("exponent", range(-3, 9))
def test_spread_never_writes_an_exponent_for_ordinary_magnitudes(exponent):
    low, high = 1.234567 * 10.0 ** (exponent - 1), 9.87654 * 10.0 ** exponent
    text = spread(low, high)
    assert "e" not in text
    a, b = text.split("–")
    assert len(a.partition(".")[2]) == len(b.partition(".")[2])  # the same decimals
    for shown, value in ((a, low), (b, high)):
        # about four significant digits of the larger end: the error is under 5e-4 of it
        assert abs(float(shown.replace(",", "")) - value) <= 5e-4 * high


def test_spread_tables_use_it(tmp_path):
    reps = _repetitions(1974.2, 13214.4)
    report = build_report([_write(tmp_path, "slow", 2000.0, repetitions=reps)])
    text = render_table(report)
    assert "1,974–13,214" in text and "e+" not in text
    assert "1,974–13,214" in html_page(report)


# --------------------------------------------------------------------------------------------
# One baseline per table; labels numbered within a workload


def test_one_baseline_marker_per_table_with_several_comparison_classes(tmp_path):
    """Runs with and without overlap are compared within their class, each class with its own
    baseline; the tables mark one: the group's."""
    paths = [_write(tmp_path, "dram", 100.0), _write(tmp_path, "nvme", 300.0, backend="nvme"),
             _write(tmp_path, "dram-overlap", 80.0, params={"overlap": True}),
             _write(tmp_path, "nvme-overlap", 200.0, backend="nvme", params={"overlap": True})]
    report = build_report(paths)
    (group,) = report.groups
    assert sum(row.is_baseline for row in group.rows) == 2  # each class's baseline (JSON is_baseline)
    assert group.baseline.run.label == "dram-overlap"
    for section in group_sections(group, report.slo):
        for table in section.tables:
            if table.columns[0].kind == "run":
                assert [r.run.run.label for r in table.rows if r.baseline] == ["dram-overlap"]
    run_tables = [lines for lines in _tables(render_table(report))
                  if any(ln.startswith("* ") and not ln.startswith("* baseline of") for ln in lines)]
    assert len(run_tables) == 5  # reuse, latency, comparison, KV, figures
    for lines in run_tables:
        assert [ln.split()[1] for ln in lines if ln.startswith("* ")] == ["dram-overlap"]
    page = html_page(report)
    for table in re.findall(r"<table.*?</table>", page, re.S):
        if 'scope="row"><span title=' in table:
            assert len(re.findall(r'<tr class="baseline', table)) == 1
            assert table.count('badge baseline') == 1


def test_labels_are_numbered_within_a_workload(tmp_path):
    paths = [_write(tmp_path, "a1", 100.0, label="x"), _write(tmp_path, "b1", 120.0, label="x", sha=SHA_B),
             _write(tmp_path, "a2", 110.0, label="x", backend="nvme"),
             _write(tmp_path, "a3", 130.0, label="x#2", backend="cxl")]
    report = build_report(paths)
    by_sha = {g.trace_sha256: [r.run.label for r in g.rows] for g in report.groups}
    # trace A: read order x, x, x#2 -> the second x skips the x#2 another file carries
    assert sorted(by_sha[SHA_A]) == ["x", "x#2", "x#3"]
    assert by_sha[SHA_B] == ["x"]  # another workload's run keeps its label: no '#2' without its first
    a = next(g for g in report.groups if g.trace_sha256 == SHA_A)
    recorded = {r.run.label: r.run.meta.get("label_recorded") for r in a.rows}
    assert recorded == {"x": None, "x#2": None, "x#3": "x"}
    for lines in _tables(render_table(report)):
        labels = [ln[2:].split()[0] for ln in lines if ln[:2] in ("* ", "  ") and ln[2:3] == "x"]
        if any(re.fullmatch(r"x#\d+", lab) for lab in labels):
            assert "x" in labels  # a numbered label only beside the one it repeats
