"""A one-line progress bar for long work on a terminal (benchmark runs): redrawn in place at
most a few times a second, and nothing at all when the output is not a terminal (a log file,
a pipe), where the finished lines say enough."""

from __future__ import annotations

import time
from typing import TextIO

WIDTH = 30
REDRAW_S = 0.2


class ProgressBar:
    """`label [#####.....] done/total unit`, redrawn in place on `out`."""

    def __init__(self, out: TextIO, label: str, total: int, unit: str = "steps") -> None:
        self._out, self._label, self._total, self._unit = out, label, max(1, total), unit
        self._tty = out.isatty()
        self._drawn = -REDRAW_S

    def update(self, done: int) -> None:
        """Show `done` of the total (throttled to one redraw per REDRAW_S)."""
        now = time.monotonic()
        if not self._tty or (now - self._drawn < REDRAW_S and done < self._total):
            return
        self._drawn = now
        filled = WIDTH * min(done, self._total) // self._total
        bar = "#" * filled + "." * (WIDTH - filled)
        self._out.write(f"\r{self._label} [{bar}] {done}/{self._total} {self._unit}")
        self._out.flush()

    def clear(self) -> None:
        """Remove the bar (before the line that reports the finished work)."""
        if self._tty:
            self._out.write("\r\x1b[K")
            self._out.flush()
