"""The ring round: a ring all-reduce over the members' chunks of the delta (topology.py).

Each member pushes its parts to its successor only: n - 1 reduce-scatter partial sums, then n - 1
summed chunks of the all-gather (passed on as their owner encoded them). A ring needs every
member: a push that fails, a part that cannot be used or does not arrive within RING_SHARE of
`timeout_s`, or a member that sends its whole delta (it fell back already) breaks it, and the
round falls back to exchanging whole deltas all-to-all (whole_round.py) in the time left.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from ravnest_node.averaging.inbox import GATHER, SCATTER, RoundInbox, part_name
from ravnest_node.averaging.rounds import RoundKit, RoundResult, RoundRun
from ravnest_node.averaging.topology import gather_chunk, owned_chunk, scatter_chunk
from ravnest_node.averaging.whole_round import whole_round
from ravnest_node.averaging.wire import Replica
from ravnest_node.errors import PeerError

log = logging.getLogger(__name__)

RING_SHARE = 0.5
"""Share of `timeout_s` a ring may take before the round falls back to whole deltas."""


async def ring_round(kit: RoundKit, run: RoundRun) -> RoundResult:
    """The ring; if it breaks, whole deltas all-to-all until the round's deadline."""
    ring_deadline = run.started + kit.config.timeout_s * RING_SHARE
    pushes: list[asyncio.Task[None]] = []
    async with asyncio.TaskGroup() as tg:
        mean = await _ring(kit, tg, pushes, run, ring_deadline)
        if mean is None:  # the pushes still in flight are of no use any more
            for task in pushes:
                task.cancel()
    if mean is not None:
        return RoundResult(
            round=run.round,
            mean=mean,
            participants=tuple(m.node_id for m in kit.group.members),
            missing=(),
            rejected=(),
            bytes_sent=run.bytes_sent,
            wait_s=run.wait_s(),
            topology=kit.group.topology,
        )
    log.warning(
        "round %d: the ring broke (%s); exchanging whole deltas instead",
        run.round,
        kit.inboxes.get(run.round).ring_fault or "a member sent its whole delta",
    )
    return await whole_round(kit, run, True)


async def _ring(
    kit: RoundKit,
    tg: asyncio.TaskGroup,
    pushes: list[asyncio.Task[None]],
    run: RoundRun,
    deadline: float,
) -> torch.Tensor | None:
    """Reduce-scatter then all-gather (topology.py); the mean, or None if the ring broke."""
    group = kit.group
    n, rank = len(group.members), group.rank
    successor = group.successor
    inbox = kit.inboxes.get(run.round)
    bounds = group.bounds
    round, step, flat = run.round, run.step, run.flat

    def piece(chunk: int) -> torch.Tensor:
        start, stop = bounds[chunk]
        return flat[start:stop]

    def push(message: bytes) -> None:
        task = _push_part(kit, run, successor, message, deadline, inbox)
        pushes.append(tg.create_task(task))

    async def arrived(table: dict[int, Any], chunk: int) -> bool:
        ok = await kit.inboxes.wait_until(lambda: chunk in table or inbox.ring_broken(), deadline)
        return ok and not inbox.ring_broken()

    for s in range(n - 1):
        chunk = scatter_chunk(rank, s, n)
        received = inbox.partials.get(chunk)  # None at step 0 only
        name = part_name(SCATTER, chunk)
        message = await kit.run(kit.coder.encode, round, step, name, piece(chunk), received)
        push(message)
        if not await arrived(inbox.partials, scatter_chunk(rank - 1, s, n)):
            return None
    owned = owned_chunk(rank, n)
    name = part_name(GATHER, owned)
    message, total = await kit.run(
        kit.coder.encode_decoded, round, step, name, piece(owned), inbox.partials[owned]
    )
    sums = {owned: total}
    for s in range(n - 1):
        push(message if s == 0 else inbox.gathered[gather_chunk(rank, s, n)][0])
        incoming = gather_chunk(rank - 1, s, n)
        if not await arrived(inbox.gathered, incoming):
            return None
        sums[incoming] = inbox.gathered[incoming][1]
    return await kit.run(_assemble, kit, sums)


def _assemble(kit: RoundKit, sums: dict[int, torch.Tensor]) -> torch.Tensor:
    """The mean from the summed ring chunks (runs in the executor)."""
    mean = torch.empty(kit.coder.numel, dtype=torch.float32)
    for chunk, value in sums.items():
        start, stop = kit.group.bounds[chunk]
        mean[start:stop] = value
    return mean.div_(len(kit.group.members))


async def _push_part(
    kit: RoundKit,
    run: RoundRun,
    member: Replica,
    message: bytes,
    deadline: float,
    inbox: RoundInbox,
) -> None:
    try:
        await kit.push(run, member, message, deadline)
    except PeerError as exc:
        if inbox.ring_fault is None:
            inbox.ring_fault = f"push to {member.node_id} failed: {exc}"
        await kit.inboxes.notify()
