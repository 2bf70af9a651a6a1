"""Tasks a part of the worker starts beside its caller's flow, and owns.

A call that must not hold its caller up (naming suspects to the coordinator, the upstream
stream a node behind NAT opens itself, a checkpoint copy, a plan stream left behind that did
not end when cancelled) runs as a task of its own. The event loop keeps only weak references
to tasks, and a task nobody awaits hides its error: so the part that starts such tasks keeps
them in a `Tasks`, which holds each until it ends, logs what failed, cancels them when the node
stops (`cancel`) and awaits them when the part closes (`close`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from ravnest_node.errors import PeerError

__all__ = ["Tasks"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Tasks:
    """The running tasks one part started (`what` names them in the log)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._running: set[asyncio.Task[Any]] = set()

    def start(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run `coro` as a task owned here."""
        task = asyncio.create_task(coro, name=name)
        self.adopt(task)
        return task

    def adopt(self, task: asyncio.Task[Any]) -> None:
        """Own a task started elsewhere, until it ends."""
        if task.done():
            self._ended(task)
            return
        self._running.add(task)
        task.add_done_callback(self._ended)

    @property
    def busy(self) -> bool:
        """One of them still runs."""
        return bool(self._running)

    def cancel(self) -> None:
        """Cancel every task that still runs (they end at their next await)."""
        for task in self._running:
            task.cancel()

    async def close(self, timeout_s: float) -> None:
        """Cancel every task and wait for them, for up to `timeout_s` (a call to a peer that is
        gone may not end at once when cancelled: grpc.aio); those left are logged."""
        self.cancel()
        if not self._running:
            return
        _, left = await asyncio.wait(set(self._running), timeout=timeout_s)
        if left:
            log.info("%s: %d task(s) still running after %g s", self._what, len(left), timeout_s)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        if isinstance(exc, (PeerError, grpc.aio.AioRpcError)):  # a peer gone: nothing to do
            log.debug("%s: %s ended: %s", self._what, task.get_name(), exc)
        else:  # our own bug: say so loudly
            log.error("%s: %s failed", self._what, task.get_name(), exc_info=exc)
