"""What the parts of a worker wait on together: a change to the worker's state.

The worker is made of small parts (daemon/worker/worker.py), and a wait in one is often for a change
in another: a block fetch waits for this node's plan to end, a neighbour's stream for this
node's session of the plan, a checkpoint copy for the checkpoint to be written, a leaving node
for its blocks to be taken. Every change wakes every waiter (`notify`), and each checks its own
condition again. The node's stop is such a change (`stop`): every wait and retry loop of the
run ends on it rather than trying again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from ravnest_node.transport.errors import Refusal

__all__ = ["Changes"]


class Changes:
    """One condition shared by a worker's parts: a plan announced, a session started or ended,
    blocks kept or handed over, a checkpoint written, the coordinator lost, the node stopping."""

    def __init__(self, connect_timeout_s: float) -> None:
        self._condition = asyncio.Condition()
        self._connect_timeout_s = connect_timeout_s
        self.stopping = False
        """Set when the node stops (`stop`): retry loops end instead of trying again."""

    async def notify(self) -> None:
        """Something changed: every waiter checks its condition again."""
        async with self._condition:
            self._condition.notify_all()

    async def stop(self) -> None:
        """The node stops: waits that check `stopping` end."""
        self.stopping = True
        await self.notify()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Wait until `condition` holds, as long as it takes."""
        async with self._condition:
            await self._condition.wait_for(condition)

    async def wait_within(
        self, condition: Callable[[], bool], what: str, timeout_s: float | None = None
    ) -> None:
        """Wait for `condition` on behalf of a peer's call, within `timeout_s` (default: the
        connect timeout); Refusal(UNAVAILABLE, `what`) after it."""
        limit = self._connect_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit):
                await self.wait_for(condition)
        except TimeoutError:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, what) from None

    def raise_if_stopping(self) -> None:
        """Raise CancelledError if the node is stopping or this task is being cancelled. A
        call to this node's own server that is cancelled while the server stops can end with
        UNAVAILABLE (or CANCELLED) instead of the cancel (see NodeDaemon._end): a retry loop
        must not swallow the stop with it."""
        task = asyncio.current_task()
        if self.stopping or (task is not None and task.cancelling()):
            raise asyncio.CancelledError
