"""Progress lines: no ETA from a rate measured over too little work (a replay's setup is not work)."""
import io

from kvemu import progress as progress_mod
from kvemu.progress import Progress


def test_eta_waits_for_a_measured_rate(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    p = Progress("replay", total=1000, unit="steps", stream=out)
    clock[0] = 10.0                  # ten seconds of setup (pre-faulting the arena), then the first step
    p(1)
    assert "ETA" not in out.getvalue()   # 1 of 1000 after 10 s would say ~10,000 s
    clock[0] = 30.0
    p(11)
    assert "ETA" not in out.getvalue()   # still under 2 % done
    clock[0] = 50.0
    p(201)                               # 200 steps in the 40 s since the first: 5 steps/s
    line = out.getvalue().strip().splitlines()[-1]
    assert "ETA 160 s" in line           # 799 left at 5/s


def test_closed_loop_progress_counts_requests_out_of_the_requests(chat_trace):
    """The closed loop reports finished requests: the total it is measured against is the number of
    requests (here 9: 3 sessions x 3 turns), not the trace's step count, which made the share and the
    ETA many times too long."""
    import pyarrow.parquet as pq

    from kvemu.replay import OutputOptions, ReplayOptions, WindowOptions, replay

    steps = pq.read_table(chat_trace, columns=["row_type"]).column("row_type").to_pylist().count(1)
    assert steps > 512        # the engine reports every 512 steps: this trace reaches one report at least
    seen = []
    replay(chat_trace, "vemu:local-dram", ReplayOptions(window=WindowOptions(layers=1), output=OutputOptions()),
           out=chat_trace.parent / "progress-results.parquet", progress=lambda d, t: seen.append((d, t)))
    assert seen
    assert {t for _, t in seen} == {9}
    assert all(0 <= d <= 9 for d, _ in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_phases_are_one_plain_line_each_off_a_terminal(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: clock[0])
    from kvemu.progress import Phases

    out = io.StringIO()
    phases = Phases(2, stream=out)
    line = phases.start("replay t on dram", repetitions=3)
    for d in (10, 50, 100, 0, 40):
        clock[0] += 1.0
        line(d, 100)
    line.end("x3")
    report = phases.start("report")
    clock[0] += 0.5
    report.end("report.html")
    assert out.getvalue() == "[1/2] replay t on dram: 5.0 s, x3\n[2/2] report: 0.5 s, report.html\n"


def test_phases_redraw_one_line_with_a_bar_on_a_terminal(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: clock[0])
    from kvemu.progress import Phases

    out = _Terminal()
    line = Phases(1, stream=out).start("replay t on dram", repetitions=3)
    clock[0] = 1.0
    line(50, 100)
    clock[0] = 2.0
    line(0, 100)      # the count fell back: the second repetition started
    clock[0] = 3.0
    line(25, 100)
    line.end("x3")
    text = out.getvalue()
    assert "\n" not in text[:-1] and text.endswith("\n")   # one line, redrawn in place
    draws = text.split("\r")[1:]
    assert draws[1].startswith("[1/1] replay t on dram [############............] 50% repetition 1/3")
    assert draws[3].startswith("[1/1] replay t on dram [######..................] 25% repetition 2/3")
    assert draws[-1].rstrip() == "[1/1] replay t on dram: 3.0 s, x3"


def test_a_repetition_measures_its_own_rate(monkeypatch):
    """replay --repeat counts each repetition from 0: the ETA of the second comes from its own rate."""
    clock = [0.0]
    monkeypatch.setattr(progress_mod.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    p = Progress("replay", total=100, unit="requests", stream=out)
    for t, d in ((3.0, 1), (13.0, 100)):   # the first repetition: 99 requests in 10 s
        clock[0] = t
        p(d)
    clock[0], out = 14.0, io.StringIO()
    p.stream = out
    p(2)                                  # the second starts
    clock[0] = 34.0
    p(12)                                 # 10 requests in 20 s since its first progress: 0.5/s
    assert "ETA 176 s" in out.getvalue().strip().splitlines()[-1]   # 88 left at 0.5/s
