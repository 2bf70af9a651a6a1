"""SIGINT/SIGTERM as a graceful stop, for the whole life of the process.

asyncio's `loop.add_signal_handler` is removed again when the loop closes, restoring the
default action: a signal that arrives while the process is finishing up (say, a second node
stopping after its peer already failed) would then kill it with status -15 instead of letting it
exit cleanly. These handlers stay installed: during the loop they ask it to stop; after it,
there is nothing left to stop and the signal is ignored (`ignore_stop_signals`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def install_stop_handlers(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
    """Make SIGINT and SIGTERM call `stop()` on `loop` (or do nothing once it has closed)."""

    def handle(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are exiting anyway
            loop.call_soon_threadsafe(stop)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)


def ignore_stop_signals() -> None:
    """For the last moments of the process, once there is nothing left to stop: Python resets
    its own handlers to the default action while the interpreter shuts down, which would let a
    late SIGTERM end an exiting process with status -15; an ignored signal stays ignored."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
