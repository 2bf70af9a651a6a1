"""SIGINT/SIGTERM as a graceful stop, for the whole life of the process.

asyncio's `loop.add_signal_handler` is removed again when the loop closes, restoring the
default action: a signal that arrives while the process is finishing up (say, a second node
stopping after its peer already failed) would then kill it with status -15 instead of letting it
exit cleanly. These handlers stay installed: during the loop they ask it to stop; after it,
there is nothing left to stop and the signal is ignored (`ignore_stop_signals`).

A graceful stop has a deadline: the first stop signal also starts a watchdog thread, and a
process still alive STOP_DEADLINE_S later writes every thread's stack and the event loop's
pending tasks to standard error and exits. Rarely (a few runs in a hundred, under load), an idle
coordinator whose own worker was still joining when SIGTERM came did not finish its stop: the
loop kept running, waiting on something after the stop had reached it. The dump is there to find
that wait; the deadline keeps a stuck stop from needing SIGKILL.

That watchdog is a Python thread: it runs only if the main thread lets go of the GIL. Once (a
coordinator elected over mDNS, stopping at the end of its run, just after it closed its server
and channels) the process hung with no dump at all, as if a call into grpc's C core held the GIL
(grpc/grpc#42247 describes such a deadlock in channel close). So a second watchdog, faulthandler's
own C thread, which needs no GIL, dumps every thread's stack and ends the process with status 1
a moment after the first should have.

A later case (CI, 2026-12-02) had a simpler cause: an elected coordinator whose election loop
went on after its cancel, because Python 3.11's `asyncio.wait_for` returns normally when the
task is cancelled just as what it waits for happens (CPython gh-86296; here the other nodes'
mDNS goodbyes); the code uses `asyncio.timeout` instead. Its log had no dump either: a node
started with `--join elect` has a worker's deadline (STOP_DEADLINE_S + --leave-timeout), long
past the test's wait, which may explain the earlier missing dump too.

A stop the node decides on itself (banned from its swarm, or its run failed) has the same
deadline (`Deadline.start` with the exit status it would have had, cli/main.py): once in CI
(2026-12-05) a node revoked from its swarm logged its ban, ended its server's calls, and was
still alive two minutes later, with no signal to start a watchdog and so no dump of the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_DEADLINE_S = 8.0
"""Seconds a graceful stop may take (the transport's stop grace, 3 s by default, included)."""
GIL_WATCHDOG_AFTER_S = 1.0
"""The C watchdog (for a stop stuck holding the GIL) fires this long after the deadline."""


class Deadline:
    """A stop's deadline, started once per `install_stop_handlers`: a watchdog thread that,
    `deadline_s` after `start`, dumps every thread's stack and the loop's pending tasks to
    standard error and ends the process with the status `start` was given, and faulthandler's C
    watchdog a moment later (status 1) should the first not run."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline_s: float) -> None:
        self._loop = loop
        self._deadline_s = deadline_s
        self._started = False

    def start(self, status: int = 0) -> None:
        """Start the deadline (a no-op once started): status 0 for a stop that was asked for,
        the run's own exit status for a stop the process decided on itself (a ban, a failed
        run), so that a stop stuck on something still ends as it would have."""
        if self._started:
            return
        self._started = True
        timer = threading.Timer(
            self._deadline_s, _stop_overdue, args=(self._loop, self._deadline_s, status)
        )
        timer.daemon = True  # it must never keep an exiting process alive
        timer.start()
        faulthandler.dump_traceback_later(
            self._deadline_s + GIL_WATCHDOG_AFTER_S, exit=True, file=sys.stderr
        )


def install_stop_handlers(
    loop: asyncio.AbstractEventLoop,
    stop: Callable[[], None],
    *,
    deadline_s: float = STOP_DEADLINE_S,
) -> Deadline:
    """Make SIGINT and SIGTERM call `stop()` on `loop` (or do nothing once it has closed), and
    end the process `deadline_s` after the first of them if it has not ended by itself. The
    returned Deadline starts the same watchdog for a stop the process decides on itself."""
    deadline = Deadline(loop, deadline_s)

    def handle(signum: int, frame: FrameType | None) -> None:
        deadline.start(0)
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are exiting anyway
            loop.call_soon_threadsafe(stop)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)
    return deadline


def _stop_overdue(loop: asyncio.AbstractEventLoop, deadline_s: float, status: int) -> None:
    """The watchdog: say loudly what the stop is waiting for, then end the process with
    `status` (0 for a stop that was asked for: nothing that needs saving is left in memory)."""
    err = sys.stderr
    err.write(f"ravnest-node: the graceful stop did not finish within {deadline_s:g} s; "
              "ending the process. Threads:\n")  # fmt: skip
    faulthandler.dump_traceback(file=err, all_threads=True)
    try:  # read from another thread: good enough for a post-mortem, never for decisions
        for task in list(asyncio.all_tasks(loop)):
            err.write(f"pending {task!r}\n")
            for frame in task.get_stack():
                code = frame.f_code
                err.write(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}\n")
    except RuntimeError as exc:
        err.write(f"(pending tasks could not be listed: {exc})\n")
    err.flush()
    os._exit(status)


def ignore_stop_signals() -> None:
    """For the last moments of the process, once there is nothing left to stop: Python resets
    its own handlers to the default action while the interpreter shuts down, which would let a
    late SIGTERM end an exiting process with status -15; an ignored signal stays ignored."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
