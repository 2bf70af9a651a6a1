"""The boundary between discovery and its users: a changing set of peer records of one swarm.

`MdnsDiscovery` (mdns.py) fills it from the network; `StaticDiscovery` is the fake that tests
(and anything that already knows its peers) hand in instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Protocol

from ravnest_node.discovery.records import PeerRecord


class Discovery(Protocol):
    """Peer records of this node's swarm, as hints: whatever is used is checked over gRPC."""

    @property
    def generation(self) -> int:
        """Grows each time the set of records changes."""
        ...

    def records(self) -> list[PeerRecord]:
        """The records known now (never this node's own), ordered by node id."""
        ...

    async def wait_newer(self, generation: int, timeout_s: float) -> None:
        """Return once `self.generation` differs from `generation`, or after `timeout_s`."""
        ...

    def describe(self) -> str:
        """What this source is and has seen, for a person reading an error."""
        ...


class ChangeSignal:
    """A generation counter that tasks can wait on (one event per generation, no polling)."""

    def __init__(self) -> None:
        self.generation = 0
        self._event = asyncio.Event()

    def bump(self) -> None:
        self.generation += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait_newer(self, generation: int, timeout_s: float) -> None:
        if generation != self.generation:
            return
        # asyncio.timeout, not wait_for: Python 3.11's wait_for returns normally when the task
        # is cancelled just as the event is set (CPython gh-86296), and a cancelled loop that
        # waits here would run on (a node's stop that never ended, seen in CI).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._event.wait()


class StaticDiscovery:
    """A fixed (or test-driven) set of records: the fake beside `MdnsDiscovery`."""

    def __init__(self, records: Iterable[PeerRecord] = (), *, name: str = "static records"):
        self._records = {r.txt.node_id: r for r in records}
        self._name = name
        self._signal = ChangeSignal()

    @property
    def generation(self) -> int:
        return self._signal.generation

    def records(self) -> list[PeerRecord]:
        return [self._records[k] for k in sorted(self._records)]

    def add(self, record: PeerRecord) -> None:
        self._records[record.txt.node_id] = record
        self._signal.bump()

    async def wait_newer(self, generation: int, timeout_s: float) -> None:
        await self._signal.wait_newer(generation, timeout_s)

    def describe(self) -> str:
        return f"{self._name} ({len(self._records)} records)"
