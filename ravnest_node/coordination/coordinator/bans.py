"""Audit reports and bans (issue #35; pipeline/audit.py says what an audit checks).

A member whose audits of a neighbour failed twice in a row reports it with the evidence: the
neighbour's record of the microbatch (its input, its weights, where its backward started) and
what the member received of it. The coordinator does not take the member's word: it
recomputes the record itself (the third recomputation, in the service, off the event loop)
and compares with what the member says it received. If that fails too, the neighbour is
**banned**: counted lost at once (recovery.lose: a plan without it, its blocks taken from a
replica or restored from checkpoints), never planned again, and every later call it makes as
a member is refused (PERMISSION_DENIED, member_calls.check_not_banned), and every plan
announced after names it (`Plan.banned`: the node stops when it sees it). This coordinator's
own node, if banned, only trains no more: it coordinates on.

What a ban leaves as it was, and why: the updates the liar's frames caused before the ban
(the steps since its last passed audit) are kept, not redone: with replicas its pipeline's
unfinished steps are dropped as for any member lost, the healthy replicas average the rest
away, and the stratified draw bounds how long a liar goes unseen (two audit windows). A
member who frames an honest neighbour by reporting what it did not receive is not caught
(frames are not signed by their sender; docs/security.md).

A member the swarm's authority revokes (`revoke`) is banned the same way, its steps kept as
they are (the authority says who, not what was wrong): lost at once if it has a stage, left
out of the roster if it has none, and named in every plan announced from then on, which
carries the signed list to every node (transport/membership.py).

The bans are in the run summary's `banned`, and a lab coordinator keeps them in its store
(store.py): restarted, it refuses the banned and names them in its plans as before.
"""

from __future__ import annotations

import logging

import grpc

from ravnest_node.coordination.coordinator.faults import Ban, Revoked
from ravnest_node.coordination.coordinator.recovery import lose
from ravnest_node.coordination.coordinator.replan import maybe_replan
from ravnest_node.coordination.coordinator.swarm_state import SwarmState
from ravnest_node.coordination.planning.static_plan import has_node
from ravnest_node.pipeline.audit import AuditRecord
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.errors import Refusal

__all__ = ["ban", "check_report", "revoke"]

log = logging.getLogger(__name__)


def check_report(
    s: SwarmState, request: pb.AuditReport, record: AuditRecord
) -> tuple[pb.Plan, pb.StageAssignment]:
    """The current plan and the audited stage of a report (its `record` parsed); Refusal
    unless it comes from a member of the current plan about its neighbour that sent what
    the record is of, and the record is of that neighbour's blocks."""
    plan = s.book.current
    if plan is None or request.plan_epoch != plan.epoch:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "not the current plan")
    stages = {st.node_id: st for st in plan.stages}
    me, suspect = stages.get(request.node_id), stages.get(request.suspect_id)
    if me is None or suspect is None or request.suspect_id in s.faults.banned:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "not both in the plan (or banned)")
    # The sender of an activation is the stage before; of an input gradient, the stage after.
    step = 1 if record.backward else -1
    if suspect.pipeline != me.pipeline or suspect.index != me.index + step:
        raise Refusal(grpc.StatusCode.PERMISSION_DENIED, "a stage audits what its neighbours send")
    if (record.first_block, record.stop_block) != (suspect.first_block, suspect.stop_block):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "the record is not of its blocks")
    return plan, suspect


def ban(s: SwarmState, plan: pb.Plan, suspect: pb.StageAssignment, evidence: Ban) -> None:
    """Ban the owner of `suspect`: count it lost now and never plan it again."""
    s.faults.banned[suspect.node_id] = evidence
    if suspect.node_id != s.roster.node_id:  # (this coordinator's own node coordinates on)
        s.book.banned.add(suspect.node_id)  # named in every plan announced from now on
    log.warning("node %s (pipeline %d stage %d) is BANNED: %s; the auditor was %s",
                suspect.node_id, suspect.pipeline, suspect.index,
                evidence.to_dict()["reason"], evidence.auditor)  # fmt: skip
    s.roster.leave(suspect.node_id)
    # (lose() stores the record of faults, the ban in it.)
    lose(s, plan, [suspect], s.clock(), f"banned: {evidence.to_dict()['reason']}")


def revoke(s: SwarmState, node_ids: frozenset[str], serial: int, blob: bytes) -> list[str]:
    """The authority's revocation list `serial` (`blob`, checked) names `node_ids`: ban those
    not banned yet (as a Leave would, and lost at once where they hold a stage), and announce
    the newest plan again with the list. The members banned now."""
    book, roster = s.book, s.roster
    book.revocations = blob
    now = s.clock()
    now_banned = []
    for node_id in sorted(node_ids - set(s.faults.banned)):
        s.faults.banned[node_id] = Revoked(node_id, serial, s.progress.completed())
        if node_id != roster.node_id:
            book.banned.add(node_id)
        if not roster.is_member(node_id):
            continue
        now_banned.append(node_id)
        log.warning("node %s is BANNED: revoked by the swarm's authority (list %d)", node_id,
                    serial)  # fmt: skip
        already_lost = node_id in roster.lost
        roster.leave(node_id)
        plan = book.current
        if plan is None:
            roster.evict_gone(now)
            continue
        stages = [st for st in plan.stages if st.node_id == node_id]
        if stages and not already_lost:
            lose(s, plan, stages, now, f"revoked (list {serial})")
        elif book.pending is not None and has_node(book.pending.stages, node_id):
            book.drop_pending()  # the pending plan counted on it: made again without it
            maybe_replan(s, force=True, keep_drains=True)
    book.announce_again()  # with the list (and the banned named, where no re-plan did)
    s.save_members()
    s.save_faults()
    return now_banned
