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
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def __call__(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self.total = total
        now = time.monotonic()
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
