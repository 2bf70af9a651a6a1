"""Planning and re-planning: the first plan once the swarm has joined and measured, a newer
plan announced when members come or go, the current plan's drain (`Drain`) and the switch to
the newer plan. Pure decisions on a `SwarmState` (see planbook.py for the phases); a refusal
is a `Refusal`."""

from __future__ import annotations

import logging
import time

import grpc

from ravnest_node.checkpoint import run_key
from ravnest_node.coordination.coordinator.planbook import Phase
from ravnest_node.coordination.coordinator.reporting import drop_steps
from ravnest_node.coordination.coordinator.swarm_state import SwarmState
from ravnest_node.coordination.planning.negotiate import negotiated_plan, resume_point
from ravnest_node.coordination.planning.placement import SwarmPlan
from ravnest_node.coordination.planning.static_plan import Member, same_stages, stage_at
from ravnest_node.errors import ConfigError
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.errors import Refusal

__all__ = [
    "REPLAN_GAIN",
    "adopt",
    "drain",
    "drain_end",
    "maybe_replan",
    "negotiate",
    "publish_when_ready",
    "switch",
]

log = logging.getLogger(__name__)

REPLAN_GAIN = 0.05
"""A plan that leaves every newcomer spare (and nobody of the current plan gone) is announced
only if the members' measurements make it this much faster: a drain and moved blocks cost."""


def publish_when_ready(s: SwarmState) -> None:
    """Plan once every expected member has joined and sent what it measured."""
    roster = s.roster
    if s.book.current is not None or len(roster.members) < s.swarm_size:
        return
    if not all(m.node_id in roster.capabilities for m in roster.members):
        return
    run = s.run_spec()
    plan, placed = negotiate(s, s.book.first_epoch, roster.members, run)
    resume = resume_point(
        roster.members,
        {node: c.checkpoints for node, c in roster.capabilities.items()},
        run_key=run_key(run),
        num_blocks=s.num_blocks(),
        steps=s.train.steps,
    )
    if resume.why:
        log.info("checkpoints: %s", resume.why)
    # Resuming: the first plan starts where the checkpoints are, its blocks fetched from
    # their holders as from a previous plan's stages.
    plan.start_step = s.progress.resumed_at = resume.step
    plan.previous.extend(resume.holders)
    s.progress.start(s.clock(), time.time())
    adopt(s, plan, placed)


def negotiate(
    s: SwarmState, epoch: int, members: list[Member], run: pb.RunSpec
) -> tuple[pb.Plan, SwarmPlan]:
    """A plan of `members` (ConfigError if none fits them); they are noted as considered."""
    plan, placed = negotiated_plan(
        epoch=epoch,
        swarm_id=s.swarm_id,
        model=s.model,
        members=members,
        capabilities=[s.roster.capabilities[m.node_id] for m in members],
        run=run,
    )
    s.book.considered[epoch] = frozenset(m.node_id for m in members)
    return plan, placed


def adopt(s: SwarmState, plan: pb.Plan, placed: SwarmPlan) -> None:
    """`plan` is the current plan now: keep it, announce it, log it."""
    s.book.adopt(plan, placed)
    if s.store is not None:
        s.store.save_plan(plan, s.progress.started_unix)
    for st in plan.stages:
        log.info(
            "plan epoch %d: pipeline %d stage %d = blocks [%d, %d) on %s, from step %d",
            plan.epoch,
            st.pipeline,
            st.index,
            st.first_block,
            st.stop_block,
            st.address,
            plan.start_step,
        )
    log.info(
        "plan epoch %d: %.1f ms a microbatch by the members' measurements, bound by %s",
        plan.epoch,
        placed.step_s * 1e3,
        placed.bottleneck,
    )
    if placed.spare:
        log.info("plan epoch %d leaves %s spare (faster without them)", plan.epoch,
                 ", ".join(placed.spare))  # fmt: skip


def maybe_replan(s: SwarmState, *, force: bool = False, keep_drains: bool = False) -> None:
    """After the first plan: when members that are in no stage have said what they
    measured, or members with a stage leave, announce a plan of the members that stay and
    as many newcomers as the swarm's shape allows (a multiple of the pipelines, at most one
    stage per block). It starts once the current plan's pipelines have drained (Drain).
    Newcomers left out wait for a later plan. Nothing while a plan is pending, a takeover
    waits for its members (its restore plans first) or the run ends under this plan."""
    book = s.book
    plan = book.current
    if plan is None or book.phase is not Phase.RUNNING:
        return
    if s.progress.completed() >= s.train.steps and not force:
        return  # the run is over
    in_plan = {st.node_id for st in plan.stages}
    members = s.plan_members(plan)
    ids = frozenset(m.node_id for m in members)
    if not members or (ids == book.considered.get(plan.epoch, in_plan) and not force):
        return
    try:
        new, placed = negotiate(s, book.next_epoch(plan), members, plan.run)
    except ConfigError as exc:
        log.warning("no plan with the new members: %s", exc)
        return
    # Newcomers only (everyone of the plan stays), all of them left spare: moving blocks
    # among the same nodes is worth a drain only for a plan clearly faster.
    spared = not force and in_plan <= ids and {st.node_id for st in new.stages} == in_plan
    faster = book.placed is None or placed.step_s < book.placed.step_s * (1 - REPLAN_GAIN)
    if spared and (same_stages(new, plan) or not faster):
        book.considered[plan.epoch] = ids
        log.info("no new plan for %s: %.1f ms a microbatch with them, %.1f ms now",
                 ", ".join(sorted(ids - in_plan)), placed.step_s * 1e3,
                 (book.placed.step_s if book.placed else 0) * 1e3)  # fmt: skip
        return
    new.pending = True
    # A broken pipeline's blocks are not at the plan's end step: take them from replicas.
    new.previous.extend(st for st in plan.stages if st.pipeline not in book.broken)
    book.announce(new, placed, keep_drains=keep_drains)
    current = [m for m in members if m.node_id in in_plan]
    log.info(
        "plan epoch %d announced with %d nodes (%d new, %d gone); waiting for plan epoch %d "
        "to drain",
        new.epoch,
        len(members),
        len(members) - len(current),
        len(in_plan) - len(current),
        plan.epoch,
    )


def drain(s: SwarmState, request: pb.DrainRequest) -> int | None:
    """A pipeline's first stage stops feeding the current plan at `request.stop_step`: the
    step the plan ends at if that is fixed already (a retry), else None (the caller waits for
    the plan's end, then asks `drain_end`). Refusal ABORTED if the pipeline is dropped, not
    drained; other refusals if the drain does not fit the plan."""
    book = s.book
    if book.is_dropped(request.plan_epoch, request.pipeline):
        # It cannot reach any step: its stages drop their state and wait for the plan
        # without the lost member (the stages behind the first learn it as their streams end).
        raise Refusal(grpc.StatusCode.ABORTED,
                      f"pipeline {request.pipeline} lost a member: it is not drained but "
                      "dropped")  # fmt: skip
    if request.plan_epoch in book.ends:  # a retry after the end was fixed
        return book.ends[request.plan_epoch]
    plan = book.current
    if plan is None or request.plan_epoch != plan.epoch:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"drain of plan epoch {request.plan_epoch}, the current one is "
                      f"{plan.epoch if plan else 'none'}")  # fmt: skip
    first = stage_at(plan, request.pipeline, 0)
    if first is None or first.node_id != request.node_id:
        raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                      f"node {request.node_id[:80]!r} does not feed pipeline "
                      f"{request.pipeline}")  # fmt: skip
    if book.pending is None:
        # The node saw a newer plan that this coordinator does not have: it was announced
        # before a restart (pending plans are not stored). Make it again from the members.
        maybe_replan(s, force=True)
    if book.pending is None:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "no newer plan is coming")
    if not plan.start_step <= request.stop_step <= s.train.steps:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                      f"stop step {request.stop_step} outside "
                      f"{plan.start_step}..{s.train.steps}")  # fmt: skip
    book.drains[request.pipeline] = request.stop_step
    if book.drained(s.train.pipelines):
        switch(s, plan)
    return None


def drain_end(s: SwarmState, request: pb.DrainRequest) -> int:
    """The step the drained plan ended at, once it has; Refusal ABORTED if a restore ended
    it (the pipeline is dropped, not drained)."""
    epoch = request.plan_epoch
    if s.book.is_dropped(epoch, request.pipeline):  # a restore ended it
        raise Refusal(
            grpc.StatusCode.ABORTED,
            f"plan epoch {epoch} was rolled back to step {s.book.ends[epoch]}: "
            f"pipeline {request.pipeline} is not drained but dropped",
        )
    return s.book.ends[epoch]


def switch(s: SwarmState, plan: pb.Plan) -> None:
    """Every healthy pipeline of `plan` has drained: it ends at the furthest of their
    steps, and the announced plan starts there (unless the run ends first). A broken
    pipeline's steps up to there are dropped: counted, and left out of the mean loss."""
    new, placed, stop, broken = s.book.switch(plan.epoch)
    for p in broken:
        drop_steps(s, plan, p, stop)
    s.progress.complete_steps()
    if stop >= s.train.steps:
        log.info("the run ends (step %d) before plan epoch %d could start", stop, new.epoch)
        s.book.close()
        return
    new.pending = False
    new.start_step = stop
    s.book.previous = plan
    assert placed is not None
    adopt(s, new, placed)
    maybe_replan(s)  # more members may be waiting
