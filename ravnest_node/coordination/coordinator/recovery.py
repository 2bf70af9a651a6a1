"""Members lost mid-run and what the coordinator does about it: count them lost, carry on
without them (a plan without them, their blocks from a replica) or restore the run from the
members' checkpoints and copies; and a failover's takeover of a lost coordinator's run.
Pure decisions on a `SwarmState` (the records are faults.py's)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace

from ravnest_node.checkpoint import run_key
from ravnest_node.coordination.coordinator.faults import PendingRestore, Restore, Takeover
from ravnest_node.coordination.coordinator.planbook import Phase
from ravnest_node.coordination.coordinator.replan import adopt, maybe_replan, negotiate, switch
from ravnest_node.coordination.coordinator.reporting import finish_if_done
from ravnest_node.coordination.coordinator.swarm_state import SwarmState
from ravnest_node.coordination.planning.negotiate import resume_point
from ravnest_node.coordination.planning.static_plan import Member, has_node
from ravnest_node.errors import ConfigError
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import LOST_AFTER_LEASES, MAX_EPOCH_AHEAD

__all__ = [
    "RESTORE_RETRY_LEASES",
    "check_lost",
    "lose",
    "raise_floor",
    "restarted",
    "retry_restore",
    "take_over",
    "takeover_ready",
]

log = logging.getLogger(__name__)

SILENCE_CHECK_S = 0.1
"""Shortest time between two looks for members silent past their lease (`check_lost`)."""

RESTORE_RETRY_LEASES = 3
"""A restore from checkpoints that finds no step at once is tried again on each heartbeat for
as long as it takes (members cut off may come back with the missing blocks); every this many
leases the log says again what it waits for."""


# ----- a failover's takeover ------------------------------------------------------------------
def take_over(s: SwarmState, plan: pb.Plan, lost: set[str], term: int, known_epoch: int) -> None:
    """See CoordinatorService.take_over."""
    assert s.book.current is None and s.store is None
    now = s.clock()
    copy = pb.Plan()
    copy.CopyFrom(plan)
    copy.pending = False
    seen: set[str] = set()
    for st in copy.stages:
        if st.node_id not in seen:
            seen.add(st.node_id)
            s.roster.add(Member(st.node_id, st.address), now)
    s.book.take_over(copy, known_epoch)
    s.progress.start(now, time.time())
    s.progress.resumed_at = copy.start_step
    s.faults.takeover = Takeover(
        term=term, plan_epoch=copy.epoch, lost_coordinator=tuple(sorted(lost)),
        waiting=seen - lost,
    )  # fmt: skip
    log.warning("taking the run over from plan epoch %d (term %d): waiting for %d members "
                "to come back", copy.epoch, term, len(seen - lost))  # fmt: skip


def takeover_ready(s: SwarmState) -> bool:
    """A takeover whose members are all back (or silent for LOST_AFTER_LEASES leases):
    count the old coordinator and the silent ones lost, and restore the run from the
    newest step the members' checkpoints and copies hold, every pipeline included (the
    progress of the steps after it died with the old coordinator, so every pipeline goes
    back to one step this coordinator knows). True if so."""
    takeover = s.faults.takeover
    plan = s.book.current
    if takeover is None or s.book.phase is not Phase.TAKING_OVER or plan is None:
        return False
    now = s.clock()
    silent = {n for n in takeover.waiting if s.roster.silent_longer(n, LOST_AFTER_LEASES, now)}
    if takeover.waiting - silent:
        return False
    s.book.takeover_done()
    gone = set(takeover.lost_coordinator) | takeover.restarted | silent
    lost = [st for st in plan.stages if st.node_id in gone]
    _count_lost(s, plan, lost, now, f"term {takeover.term} took over from it")
    _restore_or_wait(s, plan, lost, now)
    return True


def raise_floor(s: SwarmState, node_id: str, epoch: int) -> None:
    """A member of the run taken over knew plan `epoch` (a pending plan the old
    coordinator announced, say): this coordinator's plans start above it. An epoch far
    beyond the plan taken over is not believed (a confused or hostile member)."""
    assert s.faults.takeover is not None
    ceiling = s.faults.takeover.plan_epoch + MAX_EPOCH_AHEAD
    if epoch > ceiling:
        log.warning("node %s says it knew plan epoch %d, more than %d past the plan taken "
                    "over: not believed", node_id, epoch, MAX_EPOCH_AHEAD)  # fmt: skip
        return
    s.book.raise_floor(epoch)


# ----- members lost ---------------------------------------------------------------------------
def check_lost(s: SwarmState) -> bool:
    """Members send heartbeats every third of their lease, so every member's heartbeat is
    also this coordinator's clock: a member with a stage whose lease has run out is lost
    (crashed, or cut off). With replicas, its pipeline is broken: a plan without it is
    announced at once, the healthy pipelines drain to a step boundary and the new stages
    take the lost blocks from a replica there; the broken pipeline's unfinished steps are
    dropped and counted. Without a replica, the run is restored from the newest step at
    which the members left hold a checkpoint (or a copy) of every block
    (`_restore_from_checkpoints`); if they do not, say so. Silence counts only while this
    coordinator hears some other member (a deaf coordinator blames nobody: Leases.deaf). A
    pipeline whose stream broke with nobody gone goes the same way, with all its members,
    once they are all heard from again (Roster.whole_but_broken). True if anything changed."""
    plan = s.book.current
    if plan is None or s.book.phase is Phase.TAKING_OVER:
        return False  # a takeover counts its members lost itself (takeover_ready)
    now = s.clock()
    if retry_restore(s):
        return True
    if s.roster.deaf(now):
        return False  # its own link is down: nobody's silence counts (Leases.deaf)
    # Every heartbeat would look through every stage: at most every SILENCE_CHECK_S (leases
    # are seconds long; 1,000 members send 333 heartbeats a second).
    if now - s.silence_checked_at >= SILENCE_CHECK_S:
        s.silence_checked_at = now
        known = s.faults.lost_in(plan.epoch)
        lost = [
            st for st in plan.stages
            if st.node_id not in known and st.node_id not in s.roster.leases.left
            and s.roster.silent_longer(st.node_id, LOST_AFTER_LEASES, now)
        ]  # fmt: skip
        if lost:
            lose(s, plan, lost, now)
            return True
    # A stream broke, nobody is gone and everyone of its pipeline is heard from again (a
    # link that came back): the plan cannot resume its streams, so it goes on as if a
    # member were lost, with all of them.
    whole = s.roster.whole_but_broken(plan.epoch)
    if not whole:
        return False
    log.warning("plan epoch %d: a stream of pipeline %s broke, but all its members are "
                "alive: it starts again from their checkpoints", plan.epoch,
                ", ".join(map(str, sorted(whole))))  # fmt: skip
    lose(s, plan, [], now, broken_streams=whole)
    return True


def restarted(s: SwarmState, node_id: str, now: float) -> None:
    """`node_id`, which has a stage in the current plan, joined again: it restarted."""
    plan = s.book.current
    assert plan is not None
    s.roster.capabilities.pop(node_id, None)  # measured again before it gets a stage
    s.save_members()
    if node_id not in s.faults.lost_in(plan.epoch):
        log.warning("node %s joined again: it restarted, and its stage is lost", node_id)
        lose(s, plan, [st for st in plan.stages if st.node_id == node_id], now)


def lose(s: SwarmState, plan: pb.Plan, lost: list[pb.StageAssignment], now: float,
         why: str = "", broken_streams: Iterable[int] = ()) -> None:  # fmt: skip
    """The owners of `lost` stages of `plan` are gone: count them, and carry on without
    them (see check_lost). Pipelines whose streams broke with nobody gone, carried
    on the same way (with all their members): `broken_streams`."""
    _count_lost(s, plan, lost, now, why)
    book = s.book
    if book.phase is Phase.LAST:  # the run ends without a newer plan: its stages not awaited
        finish_if_done(s, plan)
        return
    broken = book.broken | {st.pipeline for st in lost} | set(broken_streams)
    if len(broken) >= s.train.pipelines:
        if s.progress.completed() >= s.train.steps:
            # Every step is trained; only final reports were missing: the run ends
            # without the lost stages' ones.
            book.close()
            finish_if_done(s, plan)
        else:
            _restore_or_wait(s, plan, lost, now)
        return
    book.break_pipelines(plan.epoch, broken)
    pending = book.pending
    if pending is not None and (
        any(has_node(pending.stages, st.node_id) for st in lost)
        or any(st.pipeline in broken for st in pending.previous)
    ):
        book.drop_pending()  # it counted on a lost member or its pipeline: make it again
    maybe_replan(s, force=True, keep_drains=True)
    if book.pending is None:
        log.error("no plan without %s is possible with the members left: the run cannot "
                  "go on", ", ".join(st.node_id for st in lost))  # fmt: skip
    elif book.drained(s.train.pipelines):
        switch(s, plan)


def _count_lost(
    s: SwarmState, plan: pb.Plan, lost: list[pb.StageAssignment], now: float, why: str
) -> None:
    s.roster.mark_lost((st.node_id for st in lost), now)
    s.faults.count_lost(lost, plan.epoch, s.progress.completed())
    for st in lost:
        log.warning("node %s (pipeline %d stage %d) is lost: %s", st.node_id, st.pipeline,
                    st.index, why or "no heartbeat for "
                    f"{s.roster.leases.silent_s(st.node_id, now):.1f} s")  # fmt: skip
    s.save_faults()


# ----- restores from checkpoints --------------------------------------------------------------
def _restore_or_wait(
    s: SwarmState, plan: pb.Plan, lost: list[pb.StageAssignment], now: float
) -> None:
    """Restore from checkpoints, or if the members' offers do not make a step yet, try
    again on each heartbeat, as long as it takes (`retry_restore`).

    Offers lag: a member lists its checkpoints in its heartbeats, and by the time a
    restore plan reaches it, a newer write may have pruned the step the plan names. So a
    restore counts only offers its members hold (`FaultBook.held`): meanwhile every heartbeat
    reply asks them to keep what they have until the plan after `plan` (hold_epoch), and each
    answers at once with a heartbeat whose offers are held (checkpoint.Retention)."""
    if _restore_from_checkpoints(s, plan, lost):
        return
    s.faults.unrestored = PendingRestore(plan.epoch, tuple(lost), now)
    names = ", ".join(st.node_id for st in lost) or "pipeline(s) whose streams broke"
    unheld = s.faults.unheld(plan.epoch, s.plan_members(plan))
    if unheld:
        log.info("restoring the blocks of %s from checkpoints: first %d members keep "
                 "theirs (their next heartbeat)", names, len(unheld))  # fmt: skip
    else:
        _log_waiting(s, plan, lost)


def retry_restore(s: SwarmState) -> bool:
    """A restore from checkpoints that found no step yet (`FaultBook.unrestored`): try it
    again (on every heartbeat; a member that joins again with offers sends one at once).
    Never given up: the members keep holding their checkpoints, and when members that come
    back bring the missing blocks, the restore plan starts by itself. Every
    RESTORE_RETRY_LEASES leases the log says again what is missing. True if it started."""
    plan, waiting = s.book.current, s.faults.unrestored
    if plan is None or waiting is None or waiting.plan_epoch != plan.epoch:
        return False
    if _restore_from_checkpoints(s, plan, list(waiting.lost)):
        return True
    now = s.clock()
    if now - waiting.since >= RESTORE_RETRY_LEASES * s.roster.leases.lease_s:
        s.faults.unrestored = replace(waiting, since=now)  # the log's cadence
        _log_waiting(s, plan, list(waiting.lost))
    return False


def _log_waiting(s: SwarmState, plan: pb.Plan, lost: list[pb.StageAssignment]) -> None:
    """Say what a waiting restore lacks: who holds what, and which members are not holding
    their checkpoints yet."""
    staying = s.plan_members(plan)
    offered = s.faults.offered()
    key = run_key(plan.run)
    holds = []
    for m in staying:
        spans = sorted({(o.first_block, o.stop_block, o.step) for o in offered.get(m.node_id, ())
                        if o.run_key == key})  # fmt: skip
        text = ", ".join(f"[{a}, {b}) at {st}" for a, b, st in spans) or "nothing"
        holds.append(f"{m.node_id} holds {text}")
    unheld = s.faults.unheld(plan.epoch, staying)
    log.warning("no replica holds the blocks of %s and the members' checkpoints do not "
                "restore them yet (no step at which every block is held): waiting for members "
                "to come back with them, tried again on each heartbeat; %s%s",
                ", ".join(st.node_id for st in lost), "; ".join(holds) or "no members left",
                f"; not holding yet: {', '.join(unheld)}" if unheld else "")  # fmt: skip


def _restore_from_checkpoints(s: SwarmState, plan: pb.Plan, lost: list[pb.StageAssignment]) -> bool:
    """No replica holds the `lost` members' blocks: start a plan of the members left at
    the newest step, no later than the last step every pipeline completed, at which their
    checkpoints and copies of checkpoints hold every block (`plan.restore`). Every stage
    drops what it trained after that step; those steps are trained again (counted as
    redone). False if the members left cannot (no such step, or no plan fits them), or
    if one of them does not hold its checkpoints yet (`_restore_or_wait`)."""
    staying = s.plan_members(plan)
    if s.faults.unheld(plan.epoch, staying):
        return False
    # A run taken over knows no step's loss yet: any step its checkpoints hold will do.
    taken_over = s.faults.takeover is not None and not s.progress.losses
    completed = s.train.steps if taken_over else s.progress.completed()
    point = resume_point(
        staying,
        s.faults.offered(),
        run_key=run_key(plan.run),
        num_blocks=s.num_blocks(),
        steps=completed + 1,  # a step every pipeline has reported: its loss is known
    )
    if not point.holders or point.step < s.progress.resumed_at:
        return False
    try:
        new, placed = negotiate(s, s.book.next_epoch(plan), staying, plan.run)
    except ConfigError as exc:
        log.error("restore: no plan fits the members left: %s", exc)
        return False
    step = point.step
    new.start_step, new.restore = step, True
    new.previous.extend(point.holders)
    redone = _roll_back(s, plan, step, taken_over)
    s.faults.restores.append(Restore(
        plan_epoch=new.epoch, lost=tuple(sorted({st.node_id for st in lost})),
        after_step=None if taken_over else completed, restored_step=step,
        redone_microbatches=redone,
        holders=tuple((h.first_block, h.stop_block, h.node_id) for h in point.holders),
    ))  # fmt: skip
    if taken_over:
        log.warning("restoring the run taken over at step %d from %d checkpoints and "
                    "copies", step, len(point.holders))  # fmt: skip
    else:
        log.warning("restoring the run at step %d from %d checkpoints and copies: steps %d "
                    "to %d are trained again (%d microbatches redone)", step,
                    len(point.holders), step + 1, completed, redone)  # fmt: skip
    s.book.previous = plan
    s.faults.rolled_back(step)
    if s.store is not None:
        s.store.roll_back(step, new, s.progress.started_unix)
    s.save_faults()
    adopt(s, new, placed)
    return True


def _roll_back(s: SwarmState, plan: pb.Plan, step: int, taken_over: bool) -> int:
    """`plan` ends at `step`, restored: the run goes back there. The microbatches
    of the steps after it, to train again (counted as redone)."""
    # The plan broken here ends at the restored step: its stages' later reports are
    # refused, and its first stages are told to drop their work, not to drain.
    s.book.end_at(plan.epoch, step, s.train.pipelines)
    redone = s.progress.roll_back(step)
    s.faults.redone += redone
    if taken_over:  # this coordinator's progress starts here
        s.progress.resumed_at = step
    return redone
