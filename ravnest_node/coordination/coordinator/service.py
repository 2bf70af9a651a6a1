"""The coordinator service: membership, the plan, and the run's progress.

One node acts as coordinator: the node started without `--join`, the node a LAN swarm elected,
or a lab's `ravnest-node coordinator`, which holds no stage. It waits until `swarm_size` nodes
have joined and said what they measured, publishes the negotiated plan, collects each stage's
reports and turns them into progress events and, at the end, the run summary. A lab
coordinator keeps all of it in a SQLite store (store.py) and, restarted, carries on from there;
the others keep it in memory.

This module is the gRPC side only: it checks a call, hands it to the decisions (member_calls.py,
replan.py, reporting.py over the pure parts of swarm_state.py), answers a `Refusal` with its
status (the one place that aborts a call), and does the waiting: reaching a joining node,
probing suspects, a drain's end, the watch streams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import torch
from google.protobuf.message import Message

from ravnest_node.coordination.coordinator import bans, member_calls, recovery, replan, reporting
from ravnest_node.coordination.coordinator.faults import Ban, FaultBook
from ravnest_node.coordination.coordinator.membership import ProbeAnswer
from ravnest_node.coordination.coordinator.planbook import PlanBook
from ravnest_node.coordination.coordinator.progress import RunProgress
from ravnest_node.coordination.coordinator.roster import Roster
from ravnest_node.coordination.coordinator.store import CoordinatorStore
from ravnest_node.coordination.coordinator.swarm_state import SwarmState
from ravnest_node.coordination.coordinator.view import swarm_view
from ravnest_node.errors import FrameError
from ravnest_node.pipeline.audit import (
    TOLERANCE,
    AuditRecord,
    StageBlocks,
    distance,
    received_tensor,
)
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import DEFAULT_LEASE_S, UNREACHABLE_KEY
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.membership import Membership, MembershipError
from ravnest_node.transport.proofs import ProofCheck, check_request

__all__ = ["MAX_REACHING", "REACH_TIMEOUT_S", "CoordinatorService"]

log = logging.getLogger(__name__)

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Ask = Callable[[str, str, float], Awaitable[ProbeAnswer]]
"""Asks (node id, address) whether it answers there, within a timeout (seconds)."""

REACH_TIMEOUT_S = 3.0
"""How long the coordinator waits for a joining node to answer at its address."""
MAX_REACHING = 4
"""Joining nodes the coordinator checks at once (the others wait for a turn)."""


def _evidence(request: pb.AuditReport) -> tuple[AuditRecord, torch.Tensor]:
    """The record and the received tensor of a report; Refusal if either does not parse."""
    try:
        return AuditRecord.from_bytes(request.record), received_tensor(request.received)
    except FrameError as exc:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"evidence: {exc}") from None


@asynccontextmanager
async def _answered(context: Context) -> AsyncIterator[None]:
    """A `Refusal` within answers the call with its status and reason."""
    try:
        yield
    except Refusal as refusal:
        await context.abort(refusal.code, refusal.reason)


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """Serves `ravnest.v1.Coordinator`. All methods run on the node's event loop."""

    def __init__(
        self,
        *,
        train: TrainConfig,
        swarm_size: int,
        swarm_id: str,
        summary_path: Path | None,
        clock: Callable[[], float] = time.monotonic,
        epoch: int = 1,
        lease_s: float = DEFAULT_LEASE_S,
        store: CoordinatorStore | None = None,
        probe: Ask | None = None,
        node_id: str = "",
        reach: Ask | None = None,
        relay_address: str = "",
        prove: ProofCheck = check_request,
        membership: Membership | None = None,
    ) -> None:
        """`epoch`: of this coordinator's first plan (1, or the election term it won).
        `probe`: asks a suspected member whether it is alive (Suspect); `reach`: asks a
        node joining for the first time whether it answers at its address (None: not
        asked). `node_id`: this coordinator's own node (alive while it answers, never
        probed); `relay_address`: the relay it serves ("" if none), first of SwarmView.relays.
        `prove`: checks that a member call comes from the node it names (transport/proofs.py;
        unit tests of the coordinator's rules give one that takes their readable ids).
        `membership`: what the swarm's authority says (transport/membership.py): whether a
        joining node needs a certificate, and who is revoked (None: an open swarm).
        ConfigError if `store` holds another run."""
        self._prove = prove
        self._membership = membership or Membership()
        self._state = SwarmState.create(
            train=train, swarm_size=swarm_size, swarm_id=swarm_id, summary_path=summary_path,
            clock=clock, epoch=epoch, lease_s=lease_s, store=store, node_id=node_id,
            relay_address=relay_address,
        )  # fmt: skip
        self._probe = probe
        self._reach = reach
        self._reaching = asyncio.Semaphore(MAX_REACHING)
        self._probing: set[str] = set()
        """Members being probed now (Suspect): not probed twice at once."""
        self._changed = asyncio.Condition()
        """Anything changed (what Drain waits for)."""
        # Plan streams and progress streams wait on conditions of their own, woken only when
        # there is a plan or an event to send: with one wake-up per report for every plan
        # stream, 1,000 members cost the coordinator a whole core (bench/swarm_size.py).
        self._plans = asyncio.Condition()
        self._progress = asyncio.Condition()
        self._told = (0, 0)
        """(announcements, events) when their watchers were last woken."""
        self._auditing = asyncio.Lock()
        """Held while an audit report's evidence is recomputed (one at a time)."""
        self._blocks: StageBlocks | None = None
        """The audited stages' blocks (built at the first report)."""
        self._revoke()  # a list this node held before it coordinated

    # ----- the daemon's interface -------------------------------------------------------------
    @property
    def plan(self) -> pb.Plan | None:
        """The current plan (None before the first)."""
        return self._state.book.current

    def take_over(self, plan: pb.Plan, lost: set[str], term: int, known_epoch: int = 0) -> None:
        """This node won failover election `term` after the coordinator (node ids `lost`) of
        `plan`, the newest plan it knows, was lost: carry the run on from that plan. Its
        members get a lease to come back (Join again with what they measured, then a
        heartbeat with their checkpoint offers); once every one has (or its lease has run
        out), the lost coordinator's stages are counted lost, and the run goes on as after
        any lost member: from a replica, or restored from checkpoints and copies. Progress
        before the takeover stayed with the lost coordinator: this one's summary starts at the
        step it restores (`resumed_at`). `known_epoch`: the newest plan epoch this node knows
        (a pending plan's): the plans it makes start above it."""
        recovery.take_over(self._state, plan, lost, term, known_epoch)

    def admit_probe(self, node_id: str, nbytes: int, *, done: bool = False) -> None:
        """A member measures its link to this coordinator (link probes under epoch 0): only a
        member that is measuring (between its first Join and its capabilities), within
        PROBE_BUDGET_BYTES each time it measures; Refusal otherwise (Roster.admit_probe)."""
        self._state.roster.admit_probe(node_id, nbytes, done=done)

    def relay_offers(self) -> list[pb.RelayOffer]:
        """Relays a node behind NAT may use: this coordinator's own, then those members serve
        that are not gone (left, lost, or their lease run out)."""
        return self._state.roster.relay_offers(self._state.clock())

    def summary(self, plan: pb.Plan) -> dict[str, Any]:
        """The run summary, ending under `plan`; every figure comes from what the stages
        reported."""
        return reporting.summary(self._state, plan)

    # ----- the parts, to read (status pages, tests) -------------------------------------------
    @property
    def roster(self) -> Roster:
        return self._state.roster

    @property
    def book(self) -> PlanBook:
        return self._state.book

    @property
    def faults(self) -> FaultBook:
        return self._state.faults

    @property
    def progress(self) -> RunProgress:
        return self._state.progress

    def _speaks_for(self, method: str, request: Message, context: Context) -> None:
        """A member-scoped call carries the proof of the node its request names, made for
        this request (transport/proofs.py): Refusal UNAUTHENTICATED otherwise, before it
        changes anything."""
        self._prove(context, f"/ravnest.v1.Coordinator/{method}", request)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
        told = (len(self._state.book.announcements), len(self._state.progress.events))
        if told[0] != self._told[0]:
            async with self._plans:
                self._plans.notify_all()
        if told[1] != self._told[1]:
            async with self._progress:
                self._progress.notify_all()
        self._told = told

    # ----- membership and plan ----------------------------------------------------------------
    async def Join(self, request: pb.JoinRequest, context: Context) -> pb.JoinReply:
        async with _answered(context):
            member_calls.check_join(request, self._state.num_blocks())
            # Its id is made from its key (identity.py): nobody else can join under it.
            self._speaks_for("Join", request, context)
            self._membership.check_member(request.node_id, request.node_certificate)
        if await self._unreachable(request):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this coordinator cannot reach node {request.node_id} at {request.address}: "
                "its neighbours could not either. Behind NAT, it is reached through a relay: "
                "one this coordinator offers, or --relay HOST:PORT (a reachable node started "
                "with --relay-listen); otherwise check --advertise and the firewall",
                trailing_metadata=((UNREACHABLE_KEY, "1"),),
            )
        async with _answered(context):
            reply, changed = member_calls.join(self._state, request)
        if changed:
            await self._notify()
        return reply

    async def _unreachable(self, request: pb.JoinRequest) -> bool:
        """A node joining for the first time (not asking again from where it was checked,
        not with what it measured, not this coordinator's own) does not answer at its
        address. A few at a time: joins from strangers cannot hold all of this server's
        calls."""
        roster = self._state.roster
        if (
            self._reach is None
            or request.HasField("capabilities")
            or request.node_id == roster.node_id
            or roster.known_at(request.node_id, request.address)
        ):
            return False
        async with self._reaching:
            answer = await self._reach(request.node_id, request.address, REACH_TIMEOUT_S)
        return answer is not ProbeAnswer.ALIVE

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Context) -> pb.HeartbeatReply:
        async with _answered(context):
            self._speaks_for("Heartbeat", request, context)
            reply, changed = member_calls.heartbeat(self._state, request)
        if changed:
            await self._notify()
        return reply

    async def Suspect(self, request: pb.SuspectRequest, context: Context) -> pb.SuspectReply:
        """A member's stream to a neighbour broke: probe the neighbours it names (members with
        a stage of the current plan, not yet lost or leaving, not being probed already), each
        within a deadline from its measured round trips; count those whose address refuses
        the probe as lost now (a killed process). One that answers stays: a broken stream
        alone proves nothing (its own neighbour may have broken it); one that is silent is no
        verdict either (a cut link looks like a machine off): its silence counts like any
        other (member_calls.suspects_lost)."""
        async with _answered(context):
            self._speaks_for("Suspect", request, context)
            targets = member_calls.suspect_targets(self._state, request, self._probing)
        plan, probe = self.plan, self._probe
        if not targets or plan is None or probe is None:
            return pb.SuspectReply()
        self._probing |= set(targets)
        roster = self._state.roster
        timeouts = {n: roster.rtts.probe_timeout(n, roster.leases.lease_s) for n in targets}
        try:
            answers = await asyncio.gather(
                *(probe(n, address, timeouts[n]) for n, address in targets.items())
            )
        finally:
            self._probing -= set(targets)
        answered = dict(zip(targets, answers, strict=True))
        lost = member_calls.suspects_lost(self._state, plan, request, answered, timeouts)
        if not lost:
            return pb.SuspectReply()
        await self._notify()
        return pb.SuspectReply(lost=lost)

    async def ReportAudit(self, request: pb.AuditReport, context: Context) -> pb.AuditReply:
        """A member's audits of a neighbour failed twice: recompute its evidence here (the
        third recomputation, off the event loop, one report at a time) and ban the neighbour
        if that fails too (bans.py)."""
        async with _answered(context):
            self._speaks_for("ReportAudit", request, context)
            member_calls.check_member(self._state, request.node_id)
            record, received = await asyncio.to_thread(_evidence, request)
            plan, suspect = bans.check_report(self._state, request, record)
            if self._auditing.locked():
                raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "another report is being checked")
            async with self._auditing:
                recomputed = await asyncio.to_thread(self._recompute, record)
            d = distance(received, recomputed)
            if d <= TOLERANCE:
                log.warning("%s reported %s, but its evidence recomputed here is %.3g away "
                            "(within %g): not banned", request.node_id, suspect.node_id, d,
                            TOLERANCE)  # fmt: skip
                return pb.AuditReply(distance=d)
            if self.plan is not plan or suspect.node_id in self._state.faults.banned:
                return pb.AuditReply(
                    banned=suspect.node_id in self._state.faults.banned, distance=d
                )
            kind = "input gradient" if record.backward else "activation"
            evidence = Ban(suspect.node_id, suspect.pipeline, suspect.index, plan.epoch,
                           self._state.progress.completed(), request.node_id, kind, record.seq,
                           record.version, request.distance, d)  # fmt: skip
            bans.ban(self._state, plan, suspect, evidence)
        await self._notify()
        return pb.AuditReply(banned=True, distance=d)

    async def Revoke(self, request: pb.RevokeRequest, context: Context) -> pb.RevokeReply:
        """The authority's revocation list (anyone may hand it over: only the authority signs
        one): ban the members it names and announce it with the plan (bans.revoke)."""
        async with _answered(context):
            if self._membership.authority is None:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              "an open swarm has no authority to revoke members")  # fmt: skip
            try:
                adopted = self._membership.adopt(request.revocations)
            except MembershipError as exc:
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None
            held = self._membership.current
            if not adopted and held is not None and held.blob != request.revocations:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"this swarm holds revocation list {held.serial}: a new list "
                              "needs a higher serial (revoke signs the next one after the "
                              "list in its directory)")  # fmt: skip
            banned = self._revoke()
        await self._notify()
        plan = self._state.book.pending or self.plan
        current = self._membership.current
        return pb.RevokeReply(serial=current.serial if current else 0,
                              plan_epoch=plan.epoch if plan else 0, banned=banned)  # fmt: skip

    def _revoke(self) -> list[str]:
        """Apply the newest revocation list this node holds, if the plans do not carry it
        yet; the members banned now."""
        current = self._membership.current
        if current is None or self._state.book.revocations == current.blob:
            return []
        return bans.revoke(self._state, current.node_ids, current.serial, current.blob)

    def _recompute(self, record: AuditRecord) -> torch.Tensor:
        """The record's output recomputed here (blocks built once per range); Refusal if it
        does not fit the model."""
        if self._blocks is None:
            t = self._state.train
            self._blocks = StageBlocks(self._state.model, t.seed, microbatches=t.microbatches,
                                       loss_scale=t.loss_scale)  # fmt: skip
        try:
            return self._blocks.recompute(record)
        except FrameError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"evidence: {exc}") from None

    async def Leave(self, request: pb.LeaveRequest, context: Context) -> pb.LeaveReply:
        async with _answered(context):
            self._speaks_for("Leave", request, context)
            reply = member_calls.leave(self._state, request)
        await self._notify()
        return reply

    async def Drain(self, request: pb.DrainRequest, context: Context) -> pb.DrainReply:
        async with _answered(context):
            self._speaks_for("Drain", request, context)
            stop = replan.drain(self._state, request)
        if stop is not None:  # a retry after the end was fixed
            return pb.DrainReply(stop_step=stop)
        await self._notify()
        book = self._state.book
        async with self._changed:
            await self._changed.wait_for(lambda: request.plan_epoch in book.ends)
        async with _answered(context):
            stop = replan.drain_end(self._state, request)
        return pb.DrainReply(stop_step=stop)

    async def WatchPlan(
        self, request: pb.WatchPlanRequest, context: Context
    ) -> AsyncIterator[pb.Plan]:
        # From the current plan on (a newer one may be pending), then each change in order:
        # a node never misses the start of a plan it must train before the next is announced.
        announcements = self._state.book.announcements
        started = [i for i, p in enumerate(announcements) if not p.pending]
        sent = started[-1] if started else 0

        def more() -> bool:
            return len(announcements) > sent

        while True:
            async with self._plans:
                await self._plans.wait_for(more)
            while sent < len(announcements):  # more may come while we yield
                sent += 1
                yield announcements[sent - 1]

    # ----- progress ---------------------------------------------------------------------------
    async def Report(self, request: pb.StageReport, context: Context) -> pb.ReportReply:
        async with _answered(context):
            self._speaks_for("Report", request, context)
            changed = reporting.report(self._state, request)
        if changed:
            await self._notify()
        return pb.ReportReply()

    async def Swarm(self, request: pb.SwarmRequest, context: Context) -> pb.SwarmView:
        return swarm_view(self._state)

    async def WatchProgress(
        self, request: pb.WatchProgressRequest, context: Context
    ) -> AsyncIterator[pb.Progress]:
        progress = self._state.progress
        sent = 0

        def new_events() -> bool:
            return len(progress.events) > sent

        while True:
            async with self._progress:
                await self._progress.wait_for(new_events)
            for event in progress.events[sent:]:
                yield event
                if event.done:
                    return
            sent = len(progress.events)
