"""What an averaging round works with and what it gives: the kit, one round's run, its result.

A round (whole_round.py, ring_round.py) is a function of the averager's `RoundKit` (its group,
codec, inboxes, pusher and executor, which live as long as the averager) and a `RoundRun` (this
round's delta, clock and the bytes it has pushed); it returns a `RoundResult`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ravnest_node.averaging.config import AveragingConfig
from ravnest_node.averaging.deltas import DeltaCoder
from ravnest_node.averaging.group import Group
from ravnest_node.averaging.inbox import Inboxes
from ravnest_node.averaging.topology import Topology
from ravnest_node.averaging.wire import Pusher, Replica

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RoundResult:
    """The outcome of one averaging round, as this member saw it."""

    round: int
    """The round number."""
    mean: torch.Tensor
    """Mean of the accepted deltas (flat float32, CPU), as every member decodes them: members
    that heard from the same set hold bit-identical means."""
    participants: tuple[str, ...]
    """Members whose deltas are in the mean (this one included unless rejected), sorted."""
    missing: tuple[str, ...]
    """Members not heard from within `timeout_s`, sorted."""
    rejected: tuple[str, ...]
    """Members whose delta was refused (not finite, undecodable) or failed the norm guard."""
    bytes_sent: int
    """Bytes of the messages this member pushed and that were delivered this round."""
    wait_s: float
    """Seconds the round took, from `average` to its result."""
    topology: Topology
    """The topology the group runs."""
    fell_back: bool = False
    """The ring broke and this round exchanged whole deltas instead."""
    clipped: tuple[str, ...] = ()
    """Members whose delta entered the mean scaled down to the guard's bound (robust.py)."""
    banned: tuple[str, ...] = ()
    """Members banned for the run (robust.py), left out without being waited for."""


@dataclass(slots=True)
class RoundRun:
    """One round in progress: this member's delta and the round's clock (event loop time)."""

    round: int
    """The round number."""
    step: int
    """This member's optimizer step (the frames' version)."""
    flat: torch.Tensor
    """This member's delta, flat float32 on the CPU."""
    started: float
    """When `average` was called."""
    deadline: float
    """When the round completes with whoever it heard from."""
    bytes_sent: int = 0
    """Bytes pushed and delivered so far."""

    def wait_s(self) -> float:
        """Seconds since the round started."""
        return asyncio.get_running_loop().time() - self.started


@dataclass(frozen=True, slots=True)
class RoundKit:
    """What every round of an averager works with."""

    config: AveragingConfig
    group: Group
    coder: DeltaCoder
    inboxes: Inboxes
    pusher: Pusher
    executor: Executor | None
    """Where torch work runs (None: the loop's default executor)."""
    fault_push_scale: float = 1.0
    """Test only, != 1: whole deltas are pushed that many times their size (a poisoning
    member), while this member averages its own as it is."""

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the executor (torch work stays off the event loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    async def push(self, run: RoundRun, member: Replica, message: bytes, deadline: float) -> None:
        """Push `message` to `member` before `deadline`, counting the bytes delivered in `run`
        (PeerUnavailable / PeerRefused as `Pusher.push`)."""
        delivered = await self.pusher.push(member, message, deadline)
        run.bytes_sent += delivered  # not `+= await`: that would read the total before
