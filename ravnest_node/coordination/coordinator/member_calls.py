"""What the calls members make about themselves and their neighbours change: `Join` (a
newcomer, a member asking again or coming back, a restart), `Heartbeat`, `Leave` and
`Suspect`. Pure decisions on a `SwarmState`; a refusal is a `Refusal` (service.py answers
it with its status, and does the awaiting: reaching a joining node, probing suspects)."""

from __future__ import annotations

import logging

import grpc

from ravnest_node.coordination.coordinator.membership import ProbeAnswer
from ravnest_node.coordination.coordinator.planbook import Phase
from ravnest_node.coordination.coordinator.recovery import (
    check_lost,
    lose,
    raise_floor,
    restarted,
    takeover_ready,
)
from ravnest_node.coordination.coordinator.replan import maybe_replan, publish_when_ready
from ravnest_node.coordination.coordinator.roster import MAX_MEMBERS
from ravnest_node.coordination.coordinator.swarm_state import SwarmState
from ravnest_node.coordination.planning.negotiate import check_capabilities
from ravnest_node.coordination.planning.static_plan import Member, has_node
from ravnest_node.errors import ConfigError
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import BANNED, PROTOCOL, hold_s
from ravnest_node.state import MAX_NODE_ID_LEN, valid_node_id
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.options import split_host_port

__all__ = [
    "MAX_SUSPECTS",
    "check_join",
    "check_member",
    "heartbeat",
    "join",
    "leave",
    "suspect_targets",
    "suspects_lost",
]

log = logging.getLogger(__name__)

MAX_SUSPECTS = 8
"""Neighbours one Suspect call may name."""


# ----- Join -----------------------------------------------------------------------------------
def check_join(request: pb.JoinRequest, num_blocks: int) -> None:
    """Refusal (INVALID_ARGUMENT, FAILED_PRECONDITION) for a Join that is malformed or of
    another protocol, before anything is looked up."""
    if not valid_node_id(request.node_id):
        raise Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"node_id must be 1 to {MAX_NODE_ID_LEN} ASCII letters, digits, '-' or '_'",
        )
    try:
        split_host_port(request.address)
    except ConfigError as exc:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"address: {exc}") from None
    if request.protocol != PROTOCOL:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                      f"protocol {request.protocol!r} is not {PROTOCOL!r}")  # fmt: skip
    if request.HasField("capabilities"):
        try:
            check_capabilities(request.capabilities, num_blocks)
        except ConfigError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def join(s: SwarmState, request: pb.JoinRequest) -> tuple[pb.JoinReply, bool]:
    """A checked Join (`check_join`): the reply, and whether watchers have news (a member
    with what it measured, a plan). Refusal if the swarm is full, or the node id is another
    node's, or it was banned."""
    check_not_banned(s, request.node_id)
    now = s.clock()
    if s.book.current is None and s.roster.evict_gone(now):
        s.save_members()
    index = s.roster.index(request.node_id)
    if index is None:
        index, changed = _newcomer(s, request, now), True
    else:
        changed = _member_again(s, index, request, now)
    s.roster.note_measuring(request.node_id, request.HasField("capabilities"))
    return _join_reply(s, index), changed


def _newcomer(s: SwarmState, request: pb.JoinRequest, now: float) -> int:
    roster = s.roster
    if s.book.current is None and len(roster.members) >= s.swarm_size:
        raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"the swarm is full ({s.swarm_size} nodes) until its first plan")  # fmt: skip
    if len(roster.members) >= MAX_MEMBERS:
        raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the swarm has {MAX_MEMBERS} members")
    index = roster.add(Member(node_id=request.node_id, address=request.address), now)
    if request.HasField("capabilities"):
        roster.capabilities[request.node_id] = request.capabilities
    s.save_members()
    log.info("node %s joined from %s (%d/%d)", request.node_id, request.address,
             len(roster.members), s.swarm_size)  # fmt: skip
    publish_when_ready(s)
    maybe_replan(s)
    return index


def _member_again(s: SwarmState, index: int, request: pb.JoinRequest, now: float) -> bool:
    """A member joins again: to say what it measured, from another address (it came back),
    or restarted while it had a stage."""
    roster, node_id = s.roster, request.node_id
    member = roster.members[index]
    if member.address != request.address:
        if not roster.gone(node_id, now):
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                          f"node {node_id} already joined from {member.address}")  # fmt: skip
        # Lost, or its lease ran out: the node came back (restarted, or its address changed).
        log.info("node %s rejoins from %s (it was at %s)", node_id, request.address,
                 member.address)  # fmt: skip
        roster.move(index, request.address)
        s.save_members()
    measured = request.HasField("capabilities")
    in_plan = _in_plan(s, node_id)
    if in_plan and not measured:
        # A node starting up finds itself in the plan: an earlier run of it had a stage and
        # is gone (a crash and a quick restart), whether or not its lease has run out yet.
        # Count it lost now (a takeover still waiting for its members counts it then); this
        # run of it is a newcomer.
        takeover = s.faults.takeover
        if s.book.phase is Phase.TAKING_OVER and takeover is not None:
            takeover.waiting.discard(node_id)
            takeover.restarted.add(node_id)
        else:
            restarted(s, node_id, now)
        in_plan = False
    if roster.back(node_id):  # back: a newcomer
        s.save_faults()
    roster.renew(node_id, now)
    takeover = s.faults.takeover
    if measured and in_plan and takeover is not None and node_id in takeover.waiting:
        # A member of the run taken over is back.
        roster.capabilities[node_id] = request.capabilities
        takeover.rejoined.add(node_id)
        raise_floor(s, node_id, request.plan_epoch)
    if not measured or in_plan:
        return False
    roster.capabilities[node_id] = request.capabilities
    if s.book.current is not None:  # what it measured may change the plan now
        s.book.considered.pop(s.book.current.epoch, None)
    s.save_members()
    publish_when_ready(s)
    maybe_replan(s)
    return True


def _in_plan(s: SwarmState, node_id: str) -> bool:
    """`node_id` has a stage of the current plan that was not counted lost (then it is no
    longer in that plan)."""
    plan, takeover = s.book.current, s.faults.takeover
    return (
        plan is not None
        and has_node(plan.stages, node_id)
        and node_id not in s.faults.lost_in(plan.epoch)
        and not (takeover is not None and node_id in takeover.restarted)
    )


def _join_reply(s: SwarmState, index: int) -> pb.JoinReply:
    plan = s.book.current
    return pb.JoinReply(
        started_epoch=plan.epoch if plan is not None else 0,
        swarm_id=s.swarm_id,
        member_index=index,
        swarm_size=s.swarm_size,
        model=s.train.model,
        microbatch=s.train.batch_size // s.train.microbatches,
        lease_s=s.roster.leases.lease_s,
        precision=s.train.precision,
        model_package=s.model_package,
    )


def check_not_banned(s: SwarmState, node_id: str) -> None:
    """Refusal PERMISSION_DENIED if `node_id` was banned (bans.py). Not this coordinator's own
    node: it trains no more (never planned again), and coordinates on."""
    banned = s.faults.banned.get(node_id)
    if banned is not None and node_id != s.roster.node_id:
        reason = banned.to_dict()["reason"]
        raise Refusal(grpc.StatusCode.PERMISSION_DENIED, f"{BANNED}: {reason}")


def check_member(s: SwarmState, node_id: str, why: str = "") -> None:
    """Refusal NOT_FOUND unless `node_id` is a member; PERMISSION_DENIED if it was banned."""
    check_not_banned(s, node_id)
    if not s.roster.is_member(node_id):
        raise Refusal(grpc.StatusCode.NOT_FOUND, f"not a member of this swarm{why}")


# ----- Heartbeat and Leave --------------------------------------------------------------------
def heartbeat(s: SwarmState, request: pb.HeartbeatRequest) -> tuple[pb.HeartbeatReply, bool]:
    """A member's heartbeat (Refusal NOT_FOUND from a stranger): the reply, and whether
    watchers have news (members lost, a plan)."""
    check_member(s, request.node_id, ": join first")
    roster, node_id, now = s.roster, request.node_id, s.clock()
    roster.heard(node_id, request.rtt_s, now)
    if roster.alive_again(node_id, now):
        # Heard from a lease after it was counted lost: alive after all (a stall, a cut
        # link). It may have a stage in a later plan again.
        s.save_faults()
        log.warning("node %s, counted lost, is heard from again: it may have a stage again",
                    node_id)  # fmt: skip
        maybe_replan(s)
    s.faults.note_offers(node_id, request.checkpoints, request.held_epoch, s.num_blocks())
    takeover = s.faults.takeover
    if takeover is not None and node_id in takeover.rejoined:
        takeover.waiting.discard(node_id)  # back, offers and all
    changed = takeover_ready(s) | check_lost(s)
    # While a restore waits, members hold the checkpoints they offer (recovery.py).
    reply = pb.HeartbeatReply(lease_s=roster.leases.lease_s, hold_epoch=s.faults.hold_epoch())
    return reply, changed


def leave(s: SwarmState, request: pb.LeaveRequest) -> pb.LeaveReply:
    """A member leaves (Refusal NOT_FOUND from a stranger). After the plan, a member with a
    stage stays until a plan without it has taken its blocks over, if there is anyone to
    take them (`hand_off`)."""
    check_member(s, request.node_id)
    s.roster.leave(request.node_id)
    log.info("node %s leaves the swarm", request.node_id)
    plan, book = s.book.current, s.book
    if plan is None:
        if s.roster.evict_gone(s.clock()):
            s.save_members()
        return pb.LeaveReply()
    holds = has_node(plan.stages, request.node_id)
    if book.pending is not None and has_node(book.pending.stages, request.node_id):
        # The pending plan counted on it: make it again without it (same epoch; drains
        # already said stay valid, they are about the current plan).
        book.drop_pending()
        maybe_replan(s, force=True, keep_drains=True)
    else:
        maybe_replan(s)
    return pb.LeaveReply(hand_off=holds and book.pending is not None)


# ----- Suspect --------------------------------------------------------------------------------
def suspect_targets(s: SwarmState, request: pb.SuspectRequest, probing: set[str]) -> dict[str, str]:
    """Whom a member's Suspect (Refusal NOT_FOUND from a stranger) has probed: node id ->
    address of the neighbours it names that have a stage of the current plan, are not yet
    lost or being probed (`probing`), and are neither the caller nor this coordinator's own
    node (alive: it is answering). A member that left but still has a stage may be killed
    before its hand-over: it is probed too. None during a takeover (it counts who is lost)
    or for another plan."""
    check_member(s, request.node_id)
    plan = s.book.current
    if plan is None or request.plan_epoch != plan.epoch:
        return {}
    if s.book.phase is Phase.TAKING_OVER:
        return {}  # the takeover counts who is lost (takeover_ready)
    named = set(request.suspects[:MAX_SUSPECTS])
    known = s.faults.lost_in(plan.epoch)
    return {
        st.node_id: st.address for st in plan.stages
        if st.node_id in named and st.node_id not in (request.node_id, s.roster.node_id)
        and st.node_id not in known and st.node_id not in probing
    }  # fmt: skip


def suspects_lost(
    s: SwarmState,
    plan: pb.Plan,
    request: pb.SuspectRequest,
    answers: dict[str, ProbeAnswer],
    timeouts: dict[str, float],
) -> list[str]:
    """The suspects of `request` probed under `plan` (`answers`: node id -> what its probe
    found within its timeout) that refused it are lost now, unless a newer plan came
    meanwhile: who was counted lost. A silent one is no verdict (a cut link, the
    coordinator's own included, looks the same as a machine off): its silence counts like
    any other's (`check_lost`). If nobody is lost, the caller's pipeline is noted broken:
    once its other members are all heard from again (a dead one never is: it is found lost
    another way), its plan starts again (`check_lost`)."""
    if s.book.current is not plan:  # a newer plan came meanwhile
        return []
    known = s.faults.lost_in(plan.epoch)
    dead = [n for n, a in answers.items() if a is ProbeAnswer.REFUSED and n not in known]
    silent = [n for n, a in answers.items() if a is ProbeAnswer.SILENT]
    if silent:
        log.info("%s did not answer a probe within %.2f s: counted lost only after %g s of "
                 "silence", ", ".join(silent), max(timeouts[n] for n in silent),
                 hold_s(s.roster.leases.lease_s))  # fmt: skip
    if not dead:
        me = next((st for st in plan.stages if st.node_id == request.node_id), None)
        if me is not None:
            others = {st.node_id for st in plan.stages if st.pipeline == me.pipeline}
            s.roster.note_broken(plan.epoch, me.pipeline, others - {request.node_id})
        return []
    why = (
        f"its neighbour {request.node_id} lost its stream ({request.reason[:200]}) and "
        "its address refused a probe (nobody listens there, or another node does)"
    )
    lose(s, plan, [st for st in plan.stages if st.node_id in dead], s.clock(), why)
    return dead
