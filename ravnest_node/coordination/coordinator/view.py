"""The swarm as the coordinator sees it now (`Swarm`, read by `status --swarm`, the web page
and newcomers): members, the plan, progress and the loss curve, each stage's latest report.
Pure."""

from __future__ import annotations

import math
from typing import TypeVar

from ravnest_node.coordination.coordinator.swarm_state import SwarmState
from ravnest_node.coordination.planning.negotiate import member_speeds
from ravnest_node.proto import control_pb2 as pb

__all__ = ["LOSS_POINTS", "swarm_view", "thin"]

T = TypeVar("T")

LOSS_POINTS = 500
"""Points of the loss curve a SwarmView carries (the web page draws them)."""


def thin(items: list[T], most: int) -> list[T]:
    """At most `most` of `items`, evenly spread, the last always included."""
    if len(items) <= most:
        return items
    step = len(items) / most
    picked = [items[int(i * step)] for i in range(most - 1)]
    return [*picked, items[-1]]


def swarm_view(s: SwarmState) -> pb.SwarmView:
    """The swarm now."""
    events = s.progress.events
    last = events[-1] if events else None
    view = pb.SwarmView(
        swarm_id=s.swarm_id,
        swarm_size=s.swarm_size,
        members=_members(s),
        step=last.step if last else 0,
        samples=last.samples if last else 0,
        samples_per_s=last.samples / last.wall_s if last and last.wall_s > 0 else 0.0,
        done=bool(last and last.done),
        relays=s.roster.relay_offers(s.clock()),
    )
    curve = [e for e in events if not e.done and math.isfinite(e.loss)]
    for event in thin(curve, LOSS_POINTS):
        view.loss_steps.append(event.step)
        view.losses.append(event.loss)
    for step, loss in sorted(s.progress.evals.items()):
        view.eval_steps.append(step)
        view.eval_losses.append(loss)
    plan = s.book.current
    if plan is not None:
        view.plan.CopyFrom(plan)
        latest = sorted(s.progress.latest.items())
        view.stages.extend(r for _, r in latest if r.plan_epoch == plan.epoch)
    return view


def _members(s: SwarmState) -> list[pb.SwarmMember]:
    roster, now = s.roster, s.clock()
    caps = [roster.capabilities.get(m.node_id) for m in roster.members]
    speeds = [0.0] * len(caps)
    measured = [i for i, c in enumerate(caps) if c is not None and c.block_s]
    if s.book.current is not None and measured:  # a member still measuring has no speed yet
        known = member_speeds(
            [roster.members[i] for i in measured],
            [caps[i] or pb.Capabilities() for i in measured],
        )
        for i, speed in zip(measured, known, strict=True):
            speeds[i] = speed
    checkpoints = s.progress.checkpoints.values()
    return [
        pb.SwarmMember(
            node_id=m.node_id,
            address=m.address,
            compute_s=math.fsum(c.block_s) if c else 0.0,
            speed=speed,
            silent_s=roster.leases.silent_s(m.node_id, now),
            lease_expired=roster.leases.expired(m.node_id, now),
            left=m.node_id in roster.leases.left,
            checkpoint_step=max(
                (step for node, step in checkpoints if node == m.node_id), default=0
            ),
            uplink_bps=c.uplink_bps if c else 0.0,
            rtt_s=c.rtt_s if c else 0.0,
            relay_node_id=c.relay_node_id if c else "",
            peer_links=c.peer_links if c else (),
            measuring_since=roster.measuring_since(m.node_id),
        )
        for m, c, speed in zip(roster.members, caps, speeds, strict=True)
    ]
