"""Warnings about refused peers that a flood cannot turn into a flood of log lines."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

LOG_BURST, LOG_WINDOW_S = 20, 10.0
"""Refusals logged one by one per window; the rest are counted in one line."""


class RefusalLog:
    """Warnings about refused peers, throttled: in a flood, at most LOG_BURST lines per
    LOG_WINDOW_S, then one line saying how many more were not logged."""

    def __init__(
        self, what: str, logger: logging.Logger, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._what = what
        """What is refused, plural ("connections", "calls"), for the summary line."""
        self._log = logger
        self._clock = clock
        self._window_start = -math.inf
        self._logged = self._unlogged = 0

    def warn(self, message: str, *args: object) -> None:
        now = self._clock()
        if now - self._window_start > LOG_WINDOW_S:
            if self._unlogged:
                self._log.warning("... and %d more %s refused in %g s (not logged one by one)",
                                  self._unlogged, self._what, LOG_WINDOW_S)  # fmt: skip
            self._window_start, self._logged, self._unlogged = now, 0, 0
        if self._logged < LOG_BURST:
            self._logged += 1
            self._log.warning(message, *args)
        else:
            self._unlogged += 1
