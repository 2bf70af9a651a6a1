"""The all-to-all round: each member pushes its whole delta to every other member and averages
what it heard within the round's time, through the poisoning guard (robust.py).

Groups of up to ALL_TO_ALL_MAX members run it, and so does a ring round that broke (ring_round.py)
in the time it has left. A member still on an earlier round refuses a push as too early: it is
pushed again while the round lasts. A member that cannot be reached, or that refuses this one
as not of its group, is not waited for. The deltas the round uses are fixed when every other
member was heard from (or given up on), or at the deadline; the guard then rejects, clips and
counts strikes toward bans, and the mean is taken in sorted order, so that members that heard
from the same set compute bit-identical means.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from ravnest_node.averaging.inbox import WHOLE
from ravnest_node.averaging.robust import Screening, screen_norms, stable_norm
from ravnest_node.averaging.rounds import RoundKit, RoundResult, RoundRun
from ravnest_node.averaging.wire import PeerBehind, PeerExcludes, Replica
from ravnest_node.errors import PeerRefused, PeerUnavailable

log = logging.getLogger(__name__)

BEHIND_RETRY_S = 0.05
"""Pause before pushing again to a member that has not reached the round yet."""


async def whole_round(kit: RoundKit, run: RoundRun, fell_back: bool = False) -> RoundResult:
    """All-to-all: push the whole delta to every other member and collect theirs."""
    deltas, refused, elsewhere = await _exchange(kit, run)
    screening, mean = await kit.run(_combine, kit, deltas)
    group = kit.group
    missing = tuple(
        m.node_id for m in group.others if m.node_id not in deltas and m.node_id not in refused
    )
    if missing:
        log.warning(
            "round %d: no delta from %s within %.1f s; averaged without them",
            run.round,
            ", ".join(missing),
            kit.config.timeout_s,
        )
    _judge(kit, run.round, screening, refused, elsewhere)
    return RoundResult(
        round=run.round,
        mean=mean,
        participants=screening.accepted,
        missing=missing,
        rejected=tuple(sorted(refused)),
        clipped=screening.clipped,
        banned=group.banned,
        bytes_sent=run.bytes_sent,
        wait_s=run.wait_s(),
        topology=group.topology,
        fell_back=fell_back,
    )


async def _exchange(
    kit: RoundKit, run: RoundRun
) -> tuple[dict[str, torch.Tensor], dict[str, str], set[str]]:
    """Push this member's whole delta to the others and wait for theirs: the deltas to use
    (this member's own as decoded included), the refused ones' reasons, and the senders whose
    delta came from another host than theirs."""
    message, own = await kit.run(kit.coder.encode_decoded, run.round, run.step, WHOLE, run.flat)
    if kit.fault_push_scale != 1.0:
        poisoned = run.flat * kit.fault_push_scale  # with an error-feedback state of its own
        message = await kit.run(
            kit.coder.encode, run.round, run.step, WHOLE, poisoned, None, "fault"
        )
    group = kit.group
    inbox = kit.inboxes.get(run.round)
    unreachable: set[str] = set()

    def settled() -> bool:
        return all(inbox.heard_from(m.node_id) or m.node_id in unreachable for m in group.others)

    async with asyncio.TaskGroup() as tg:
        for member in group.others:
            tg.create_task(_push_whole(kit, run, member, message, unreachable))
        await kit.inboxes.wait_until(settled, run.deadline)
        # What the round uses is fixed here; later arrivals change nothing. A member banned
        # since its push arrived (the push raced the round that banned it) is left out.
        banned = group.bans.banned
        deltas = {group.node_id: own}
        deltas.update((k, v) for k, v in inbox.deltas.items() if k not in banned)
        refused = {k: why for k, why in inbox.rejected.items() if k not in banned}
        elsewhere = set(inbox.elsewhere)
    return deltas, refused, elsewhere


def _combine(kit: RoundKit, deltas: dict[str, torch.Tensor]) -> tuple[Screening, torch.Tensor]:
    """The guard's decision and the mean of the accepted deltas (runs in the executor)."""
    config = kit.config
    norms = {k: stable_norm(v) for k, v in deltas.items()}
    screening = screen_norms(norms, config.max_norm_ratio, config.clip_ratio, own=kit.group.node_id)
    total = torch.zeros(kit.coder.numel, dtype=torch.float32)
    # In sorted order: members that accepted the same deltas compute bit-identical means.
    for k in screening.accepted:
        total.add_(deltas[k], alpha=screening.scales.get(k, 1.0))
    if screening.accepted:  # always: the guard keeps the median
        total.div_(len(screening.accepted))
    return screening, total


def _judge(
    kit: RoundKit, round: int, screening: Screening, refused: dict[str, str], elsewhere: set[str]
) -> None:
    """Log the guard's decision and keep the ban record: a strike for each rejected delta from
    its member's host, a clean record for each accepted one. Adds the deltas the guard
    rejected to `refused`."""
    config, group = kit.config, kit.group
    median = screening.median_norm or 0.0
    measure = "this member's own delta's norm" if screening.by_own else "the median norm"
    for sender in screening.rejected:
        refused[sender] = f"its norm exceeds {config.max_norm_ratio:g} x {measure} {median:.4g}"
    for sender, reason in sorted(refused.items()):
        log.warning("round %d: rejected %s's delta: %s", round, sender, reason)
        if sender == group.node_id:
            continue
        if sender in elsewhere:
            log.warning("round %d: %s's rejected delta came from another host than %s: "
                        "not counted toward a ban", round, sender,
                        group.hosts[sender])  # fmt: skip
        elif group.bans.strike(sender, reason, config.ban_after):
            log.error("round %d: banned %s from averaging for the rest of the run (%s)",
                      round, sender, group.bans.banned[sender])  # fmt: skip
    for sender in screening.accepted:
        # A good delta from the member's own host: its strikes were not in a row. (One
        # sent in its name from elsewhere must not wipe the record either.)
        if sender not in screening.scales and sender not in elsewhere:
            group.bans.clear(sender)
    for sender, scale in sorted(screening.scales.items()):
        log.warning("round %d: clipped %s's delta to %g x the median norm %.4g (scaled by "
                    "%.3g)", round, sender, config.clip_ratio, median, scale)  # fmt: skip


async def _push_whole(
    kit: RoundKit, run: RoundRun, member: Replica, message: bytes, unreachable: set[str]
) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            await kit.push(run, member, message, run.deadline)
        except PeerBehind as exc:
            # A member still on an earlier round (its last one waited for someone, or it
            # started late) takes this round's push once it opens it: try again while the
            # round's time lasts.
            if loop.time() + BEHIND_RETRY_S < run.deadline:
                await asyncio.sleep(BEHIND_RETRY_S)  # a back-off, not a wait for an event
                continue
            log.warning("%s", exc)
        except (PeerUnavailable, PeerExcludes) as exc:
            log.warning("could not push a delta to %s: %s", member.node_id, exc)
            unreachable.add(member.node_id)  # it is not waited for any longer
            await kit.inboxes.notify()
        except PeerRefused as exc:
            log.warning("%s", exc)
        return
