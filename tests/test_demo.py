"""The demo's first screen against its contract: the verdicts first, one line per tier with what
kind of figure each number is, a sentence computed from the rows, and the command behind each row.
The screen is built here from hand-made rows (fast); one end-to-end run checks the real thing (slow)."""
import re
from pathlib import Path
from types import SimpleNamespace

from click.testing import CliRunner

from kvemu.cli import cli
from kvemu.demo import REPEAT, Demo, DeploymentRow, Row, StackRow, demo_deployments, demo_stacks, demo_tiers


def row(tier, kind, p50, spread=None, e2el=1380.0):
    return Row(tier=tier, kind=kind, figures=kind if kind == "virtual" else f"{kind}, host-bound 100% (upper bound)",
               ttft_p50=p50, ttft_p50_spread=spread, ttft_p99=10 * p50, e2el_p50=e2el, gpu_busy=0.38,
               kv_stall=0.01, moved_bytes=1 << 30, results=Path(f"r-{tier.role}.parquet"),
               command=f"kvemu replay t.parquet --backend {tier.spec} --out r.parquet")


def hand_demo(pool=65.40, rdma=69.15, nvme=88.86, skip_uring=True):
    hbm, dram, uring, cxl, rdma_t, nvme_t = demo_tiers(Path("d"))
    rows = [row(hbm, "virtual", 90.57), row(dram, "measured", 84.09, (67.15, 85.68)),
            row(cxl, "virtual", pool), row(rdma_t, "virtual", rdma), row(nvme_t, "virtual", nvme)]
    head = "vemu:cxl-pool/offload wins on median TTFT by 1.06x (1.06-1.06x over the repetitions) over vemu:rdma-storage/offload"
    verdict = SimpleNamespace(sentence=head, reason=f"{head}; reusing this workload's prefix")
    return Demo(folder=Path("d"), rows=rows, skipped=[(uring, "io_uring is unavailable")] if skip_uring else [],
                virtual_verdict=verdict, measured_verdict=None, report=None, html=Path("d/report.html"),
                record_commands=["kvemu record --out d/trace-offload.parquet"])


def test_the_screen_opens_with_the_verdict_and_lists_every_tier_once():
    lines = hand_demo().screen().splitlines()
    assert lines[0].startswith("kvemu demo: memory pool or storage")
    # the verdict's own first clause, and nothing of its later reasons
    assert lines[1] == ("verdict, virtual time (no spread: the model gives the same figures every repetition): "
                        "vemu:cxl-pool/offload wins on median TTFT by 1.06x (1.06-1.06x over the repetitions) over "
                        "vemu:rdma-storage/offload")
    assert lines[2].startswith("meaning: ")
    tiers = [t.name for t in demo_tiers(Path("d"))]
    for name in tiers:
        assert sum(line.startswith(name) for line in lines) == 1, name
    # every tier line says how its figures were obtained; the skipped one says why
    kinds = {line[54:64].split()[0].rstrip(":") for line in lines if any(line.startswith(n) for n in tiers)}
    assert kinds == {"virtual", "measured", "skipped"}
    dram = next(line for line in lines if line.startswith("host DRAM"))
    assert "84.09 (67.15–85.68)" in dram          # measured: the median with its range over the repetitions
    cxl = next(line for line in lines if line.startswith("CXL memory pool"))
    assert "65.40 " in cxl and "(" not in cxl.split("vemu:cxl-pool")[1]   # virtual: no range to give
    assert any("upper bound" in line for line in lines)   # what bounded the measured figures
    # one command per row, after the record commands
    i = lines.index(next(line for line in lines if line.startswith("reproduce")))
    assert lines[i + 1].strip().startswith("kvemu record")
    assert [line.strip() for line in lines[i + 2:]] == [r.command for r in hand_demo().rows]
    assert len(lines) <= 25


def test_the_meaning_is_computed_from_the_rows():
    text = hand_demo().meaning()
    # 69.15 / 65.40 = 1.057, 88.86 / 65.40 = 1.359
    assert "median TTFT 65.40 ms against 69.15 ms from RDMA storage (1.06x) and 88.86 ms from NVMe SSD (1.36x)" in text
    assert "recomputing it in HBM only takes 90.57 ms" in text and text.endswith("published profiles)")
    assert "not in completion" in text        # every tier's completion is within 10 %
    flipped = hand_demo(pool=70.0, rdma=60.0).meaning()
    assert "RDMA storage matches or beats the CXL memory pool: median TTFT 60.00 ms against 70.00 ms" in flipped
    assert "pool buys no TTFT" in flipped


def test_the_demo_first_screen_answers_the_question(tmp_path):
    out = tmp_path / "demo"
    res = CliRunner().invoke(cli, ["demo", "--out", str(out)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()[:25]
    # in the first 25 lines: a verdict ranking the pool against storage, its margin beyond the spread
    verdict = next(line for line in lines[:4] if line.startswith("verdict, virtual time"))
    m = re.search(r": (vemu:\S+)/offload (?:wins|beats) (?:over )?(vemu:\S+)/offload on median TTFT by ([\d.]+)x "
                  r"(?:in virtual time \(exact: no spread\)|\(([\d.]+)[-\u2013]([\d.]+)x over the repetitions\))", verdict)
    assert m, verdict
    assert {m[1], m[2]} <= {"vemu:cxl-pool", "vemu:rdma-storage", "vemu:nvme"} and "vemu:cxl-pool" in (m[1], m[2])
    # beyond the spread: exact in virtual time (no spread), or the lower end of the spread above 1
    assert float(m[3]) > 1.0 and (m[4] is None or float(m[4]) > 1.0)
    assert any(line.startswith("meaning: ") for line in lines)
    for tier in demo_tiers(out):
        assert sum(line.startswith(tier.name) for line in lines) == 1, tier.name
    # progress: one plain line per phase on stderr (CliRunner's is no terminal), no redraws
    phases = [line for line in res.stderr.splitlines() if re.match(r"\[\d+/13\] ", line)]
    assert len(phases) == 13 and "\r" not in res.stderr
    # the demo ends with the plan for its workload: the cheapest stack meeting the stated SLO, and the command
    last = res.stdout.rstrip().splitlines()[-2:]
    assert last[0].startswith("plan: the cheapest stack meeting TTFT p90 <= 200 ms is "), last
    assert last[1].strip().startswith("kvemu plan ") and "--slo ttft_p90=200ms" in last[1]
    # disaggregation in the first lines: each deployment's TTFT, TPOT and the hand-off's share of TTFT
    pd = next(line for line in lines[:6] if line.startswith("prefill/decode disaggregation, llama3-70b"))
    assert re.search(r"pd2x2-rdma: TTFT p50 [\d.]+ ms, TPOT mean [\d.]+ ms, hand-off [<>\d]+% of TTFT; "
                     r"pd2x2-pool: .*hand-off [<>\d]+% of TTFT; colocated-4x: TTFT p50 [\d.]+ ms, TPOT mean [\d.]+ ms$", pd), pd
    assert any(line.startswith("hand-off share of TTFT: pd2x2-rdma ") for line in lines_all(res))
    from kvemu.schema import read_header

    assert read_header(out / "trace-pd.parquet").meta["deployment"]["prefill_instances"] == 2
    for dep in demo_deployments():
        assert (out / dep.results_name).exists()
    # the tier stacks: one line per stack, and where the pool stops paying, inside the sweep
    stack_lines = [line for line in lines_all(res) if line.startswith("DRAM 1 GiB + ")]
    assert [line.split("  ")[0] for line in stack_lines] == [st.name for st in demo_stacks()]
    assert any(line.startswith("tier stacks below HBM, virtual time: the pool stops paying against NVMe at ")
               for line in lines_all(res))
    assert (out / "results-stack-pool-8GiB.parquet").exists()
    names = {p.name for p in out.iterdir()}
    assert {"trace-none.parquet", "trace-offload.parquet", "report.html", "results-dram-offload.parquet",
            "results-vemu-cxl-pool-offload.parquet"} <= names
    assert "tier.bin" not in names  # the uring tier file is removed when its replay ends
    # each row's results hold REPEAT repetitions
    import json

    import pyarrow.parquet as pq
    meta = json.loads(pq.read_schema(out / "results-dram-offload.parquet").metadata[b"kvemu"])
    assert meta["repetitions"]["n"] == REPEAT and "host_load" in meta
    # a second demo into the same folder refuses instead of overwriting
    res = CliRunner().invoke(cli, ["demo", "--out", str(out)])
    assert res.exit_code == 2 and "already holds" in res.output


def test_the_deployment_line_gives_each_runs_hand_off_share():
    rdma, pool, colo = demo_deployments()
    demo = hand_demo()
    demo.deployments = [DeploymentRow(rdma, 246.2, 18.37, 0.001, Path("a"), "kvemu replay a"),
                        DeploymentRow(pool, 234.3, 18.48, 0.27, Path("b"), "kvemu replay b"),
                        DeploymentRow(colo, 140.7, 18.32, None, Path("c"), "kvemu replay c")]
    lines = demo.screen().splitlines()
    assert lines[2].startswith("meaning: ")  # no measured verdict here
    assert lines[3].endswith("pd2x2-rdma: TTFT p50 246.2 ms, TPOT mean 18.37 ms, hand-off <1% of TTFT; "
                             "pd2x2-pool: TTFT p50 234.3 ms, TPOT mean 18.48 ms, hand-off 27% of TTFT; "
                             "colocated-4x: TTFT p50 140.7 ms, TPOT mean 18.32 ms")
    assert lines[3].startswith("prefill/decode disaggregation, llama3-70b on 16 x H100-SXM (2 prefill + 2 decode")
    assert [line.strip() for line in lines[-3:]] == ["kvemu replay a", "kvemu replay b", "kvemu replay c"]


def lines_all(res):
    return res.stdout.splitlines()


def stack_rows(ttfts, nvme, usd):
    """Hand-made stack rows: the stack without a pool, then each pool size, with these figures."""
    return [StackRow(stack=st, pool_share=None if st.pool is None else 0.2, nvme_share=n, recomputed_share=0.26,
                     ttft_p50=t, usd_per_million=u, results=Path("r.parquet"), command=f"kvemu replay --tiers {st.tiers}")
            for st, t, n, u in zip(demo_stacks(), ttfts, nvme, usd)]


def test_the_pool_stops_paying_where_a_larger_one_changes_nothing():
    demo = hand_demo()
    # pools 1, 2, 4, 8, 16 GiB after the no-pool stack: 8 GiB is the first that the 16 GiB pool does not beat
    # (62.34 against 62.34: within 0.5 %) and NVMe serves nothing from it on
    demo.stacks = stack_rows([86.42, 85.61, 81.15, 70.59, 62.34, 62.34], [0.23, 0.16, 0.12, 0.05, 0.0, 0.0],
                             [18.644, 18.648, 18.653, 18.663, 18.682, 18.720])
    assert demo.pool_stops().stack.pool == "8GiB"
    text = demo.stack_meaning()
    # 86.42 / 62.34 = 1.386; 18.682 - 18.644 = 0.038; 18.720 - 18.682 = 0.038
    assert text.startswith("the pool stops paying against NVMe at 8 GiB: median TTFT 86.42 ms (DRAM + NVMe) -> "
                           "62.34 ms (1.39x) for +0.038 $/M output tokens, NVMe serving 0% of prompt tokens instead of 23%")
    assert "16 GiB adds 0.038 $/M more" in text
    screen = demo.screen().splitlines()
    assert sum(line.startswith("DRAM 1 GiB + ") for line in screen) == 6
    assert screen[-1].strip() == demo.stacks[-1].command
    # still falling at the largest pool: no stop inside the sweep, and the sentence says so
    demo.stacks = stack_rows([86.42, 85.61, 81.15, 70.59, 62.34, 55.0], [0.23, 0.16, 0.12, 0.05, 0.02, 0.0],
                             [18.644, 18.648, 18.653, 18.663, 18.682, 18.720])
    assert demo.pool_stops() is None and "the sweep ends before it stops" in demo.stack_meaning()
    # a pool of the same TTFT that serves less from NVMe still pays: 4 GiB is not the stop here
    demo.stacks = stack_rows([86.42, 85.61, 81.15, 70.59, 70.59, 70.59], [0.23, 0.16, 0.12, 0.05, 0.01, 0.01],
                             [18.644, 18.648, 18.653, 18.663, 18.682, 18.720])
    assert demo.pool_stops().stack.pool == "8GiB"


def test_overload_advice_never_offers_a_time_scale_that_changes_nothing():
    from kvemu.engine.load import load_line, offered_load

    # arrivals over 10 s served by 10.3 s (1.03x), requests queueing 88 % of their time: overloaded.
    # Rounded to a tenth the stretch would be 1.0, which changes nothing; rounded up it is 1.1.
    s = 1_000_000_000
    load = offered_load([0, 10 * s], [9 * s, 10.2 * s], [10.1 * s, 10.3 * s], busy_ns=10 * s)
    assert load["overloaded"] and load["makespan_over_span"] == 1.03
    assert load["suggest_time_scale"] == 1.1
    assert "--time-scale 1.1 " in load_line(load) and "--time-scale 1.0" not in load_line(load)


def test_each_storage_row_names_its_software_generation_and_share():
    """The demo names the software generation of every storage row it emulates, with its software share
    of the KV time (the results' backend.software_path), in one line under the table."""
    from dataclasses import replace

    demo = hand_demo()
    demo.rows = [replace(r, software=("Mooncake Store via LMCache, host copy of get() results, mid-2025", 0.94))
                 if r.tier.spec == "vemu:rdma-storage" else
                 replace(r, software=("NVMe, O_DIRECT through the kernel block layer", 0.02))
                 if r.tier.spec == "vemu:nvme" else r for r in demo.rows]
    line = next(line for line in demo.screen().splitlines() if line.startswith("storage software paths"))
    rdma, nvme = (next(t for t in demo_tiers(Path("d")) if t.spec == s) for s in ("vemu:rdma-storage", "vemu:nvme"))
    assert (f"{rdma.name}: Mooncake Store via LMCache, host copy of get() results, mid-2025, software 94% of its KV "
            f"time" in line)
    assert f"{nvme.name}: NVMe, O_DIRECT through the kernel block layer, software 2% of its KV time" in line
    assert "host DRAM" not in line  # a memory tier has no software path


def test_a_rows_software_comes_from_its_results():
    from kvemu.demo import _software

    ops = {"load": {"software_ns": 90.0, "medium_ns": 10.0}, "store": {"software_ns": 0.0, "medium_ns": 0.0}}
    meta = {"backend": {"software_path": {"generation": "G", "ops": ops}}}
    assert _software(meta) == ("G", 0.9)
    assert _software({"backend": {}}) is None
