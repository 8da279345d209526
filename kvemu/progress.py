"""Progress on stderr for long work: done/total, rate and ETA, only once work lasts a few seconds."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int | None = None, unit: str = "", delay_s: float = 2.0,
                 every_s: float = 1.0, stream=None):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.t0 = time.monotonic()
        self.delay_s, self.every_s = delay_s, every_s
        self.last = 0.0
        self.shown = False
        self.first = None  # (time, done) of the first progress reported
        self.prev = 0
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def __call__(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self.total = total
        now = time.monotonic()
        if done < self.prev:
            self.first = None  # the count fell back: a repetition (replay --repeat) starts; its own rate
        self.prev = done
        if self.first is None and done > 0:
            self.first = (now, done)  # the rate counts from the first progress: setup is not work
        elapsed = now - self.t0
        # on a terminal redraw every second; in a log, a line every ten seconds
        every = self.every_s if self.tty else 10 * self.every_s
        if elapsed < self.delay_s or now - self.last < every:
            return
        self.last = now
        self.shown = True
        self._write(done, elapsed)

    def _write(self, done: int, elapsed: float) -> None:
        rate = done / elapsed if elapsed > 0 else 0.0
        text = f"{self.label}: {done}"
        if self.total:
            text += f"/{self.total} {self.unit} ({100 * done / self.total:.0f}%)"
            # an ETA only from a rate measured over some of the work (2 % and a second of it)
            if self.first is not None and done < self.total and done >= self.total / 50:
                t1, d1 = self.first
                span = time.monotonic() - t1
                if span >= 1.0 and done > d1:
                    text += f", ETA {(self.total - done) * span / (done - d1):.0f} s"
        else:
            text += f" {self.unit}"
        text += f", {rate:,.0f} {self.unit}/s"
        end = "\r" if self.tty else "\n"
        self.stream.write(f"{text}{' ' * 8}{end}")
        self.stream.flush()

    def close(self, done: int | None = None) -> None:
        if self.shown:
            if done is not None:
                self._write(done, time.monotonic() - self.t0)
            if self.tty:
                self.stream.write("\n")
            self.stream.flush()


class Phases:
    """One line per phase of a job of several (the demo's recordings and replays) on stderr.

    On a terminal the phase's line is a bar redrawn in place as its work advances (``line(done,
    total)``, the progress callback replay takes; a count that falls back to 0 starts the next
    repetition) and is left as the phase's summary when it ends; anywhere else (a log, a pipe, a
    CI job) each phase is one plain line, written when it ends, so a log holds no redraws."""

    BAR = 24  # characters of the bar

    def __init__(self, total: int, stream=None, every_s: float = 0.1):
        self.total, self.index = total, 0
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.every_s = every_s

    def start(self, text: str, repetitions: int = 1) -> PhaseLine:
        self.index += 1
        return PhaseLine(self, f"[{self.index}/{self.total}] {text}", repetitions)


class PhaseLine:
    """One phase of :class:`Phases`: call it with (done, total) as the work advances, then
    :meth:`end` with what the phase came to."""

    def __init__(self, phases: Phases, text: str, repetitions: int):
        self.phases, self.text, self.repetitions = phases, text, repetitions
        self.t0 = time.monotonic()
        self.last = 0.0
        self.rep, self.prev_done = 1, 0
        self.width = 0
        if phases.tty:
            self._draw(self.text)

    def __call__(self, done: int, total: int | None = None) -> None:
        if done < self.prev_done:
            self.rep += 1  # replay's next repetition counts again from 0
        self.prev_done = done
        now = time.monotonic()
        if not self.phases.tty or now - self.last < self.phases.every_s or not total:
            return
        self.last = now
        filled = min(int(self.phases.BAR * done / total), self.phases.BAR)
        reps = f" repetition {self.rep}/{self.repetitions}" if self.repetitions > 1 else ""
        self._draw(f"{self.text} [{'#' * filled}{'.' * (self.phases.BAR - filled)}] {100 * done / total:.0f}%{reps}")

    def _draw(self, text: str) -> None:
        s = self.phases.stream
        s.write("\r" + text + " " * max(self.width - len(text), 0))
        s.flush()
        self.width = len(text)

    def end(self, summary: str = "") -> float:
        """Writes the phase's last line (its text, the time it took and ``summary``); returns the time."""
        took = time.monotonic() - self.t0
        text = f"{self.text}: {took:.1f} s{', ' + summary if summary else ''}"
        if self.phases.tty:
            self._draw(text)
            self.phases.stream.write("\n")
        else:
            self.phases.stream.write(text + "\n")
        self.phases.stream.flush()
        return took
