"""A worker's client of its swarm's coordinator: join, follow, heartbeats, the plan watch.

One coordinator at a time, but not always the same one: a failover election moves the node to
another (`follow`), and every call made through `stub()` from then on reaches the new one,
retries included. A call the coordinator does not answer (a lab coordinator being restarted)
is tried again for a while (`call`) while the stage trains on; one it refuses fails at once.

The plan watch keeps the newest plan the coordinator announced (`latest_plan`) and the newest
whose start is fixed (`started_plan`), never going back to an older one. The coordinator counts
as lost (`lost`) once its address has refused the plan stream for COORDINATOR_LOST_S (its
process is gone), or the plan stream has been unreachable, or its heartbeats have failed, for
`hold_s` (a cut link, the coordinator's or this node's: no sooner than the coordinator would
count this node lost; a coordinator that hangs keeps its connections open: only keepalive,
tens of seconds later, would end them).

While heartbeats fail they are tried again every fraction of a second (`beat_cadence`), so
that the first one after a link comes back ends the silence the coordinator counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar

import grpc

from ravnest_node.coordination.planning.static_plan import stage_at
from ravnest_node.daemon.worker.changes import Changes
from ravnest_node.daemon.worker.tasks import Tasks
from ravnest_node.errors import Banned, PeerError, PeerRefused, PeerUnavailable, Unreachable
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import (
    BANNED,
    DEFAULT_LEASE_S,
    UNREACHABLE_KEY,
    heartbeat_interval,
    hold_s,
)
from ravnest_node.transport.errors import peer_error, peer_errors
from ravnest_node.transport.options import TransportConfig, grpc_channel, open_channel

__all__ = [
    "CoordinatorClient",
    "Holdings",
    "beat_cadence",
    "coordinator_errors",
    "coordinator_lost",
]

log = logging.getLogger(__name__)

# A stopping node says it leaves, but does not hold up its stop for long.
LEAVE_TIMEOUT_S = 1.0
# A report the coordinator refused at once as unavailable is tried again after this pause,
# and a plan stream that ended is opened again after it.
REPORT_RETRY_S = 0.5
BEAT_LOG_EVERY_S = 60.0
"""While heartbeats keep failing, a warning at most this often."""
# The coordinator counts as lost (a leaving node stops waiting for a hand-over, an elected
# one's members elect another) once its address has refused the plan stream this long: its
# process is gone, not one dropped connection. Unreachable otherwise, it waits `hold_s`.
COORDINATOR_LOST_S = 3.0
RETRY_PAUSE_S = (0.3, 0.7)
"""While heartbeats fail, the next goes after a pause drawn from this range (seconds), and a
plan stream that ended is opened again after one: many members whose link came back at
once do not all call in step."""
RETRY_TIMEOUT_S = 2.0
"""... and such a heartbeat waits at most this long (or an interval, if shorter)."""


def beat_cadence(
    interval_s: float,
    failing: bool,
    draw: Callable[[float, float], float] = random.uniform,
) -> tuple[float, float]:
    """The pause before the next heartbeat and its timeout (seconds), for a heartbeat
    interval of `interval_s`: an interval each while they succeed; while they fail
    (`failing`), a short random pause (`draw` from RETRY_PAUSE_S) and a short timeout, so
    that the first heartbeat after an outage comes within a second of the link's return."""
    if not failing:
        return interval_s, interval_s
    return draw(*RETRY_PAUSE_S), min(interval_s, RETRY_TIMEOUT_S)


def coordinator_lost(
    now: float, unreachable_since: float | None, refused_since: float | None, lease_s: float
) -> bool:
    """Is the coordinator lost, its plan stream unreachable since `unreachable_since` and
    its address refusing it since `refused_since` (None: not)? Refused for
    COORDINATOR_LOST_S (its process is gone), or unreachable for `hold_s`: a link cut that
    long is when the coordinator counts this node lost too."""
    if refused_since is not None and now - refused_since >= COORDINATOR_LOST_S:
        return True
    return unreachable_since is not None and now - unreachable_since >= hold_s(lease_s)


def _refused(error: BaseException) -> bool:
    """`error` says the peer's address refused the connection (nobody listens there)."""
    return "connection refused" in str(error).lower()


T = TypeVar("T")


@contextmanager
def coordinator_errors(address: str) -> Iterator[None]:
    """Translate a failed call to the coordinator into PeerUnavailable / PeerRefused."""
    with peer_errors(f"coordinator {address}"):
        yield


class Holdings(Protocol):
    """What this node's heartbeats say about its checkpoints (the checkpoint keeper)."""

    @property
    def held_epoch(self) -> int:
        """The broken plan whose restore this node holds its checkpoints for (0: none)."""
        ...

    def offers(self) -> list[pb.CheckpointOffer]:
        """The checkpoints this node holds now. Blocking."""
        ...

    async def hold(self, epoch: int) -> bool:
        """Hold them for a restore from plan `epoch`; True if this hold is new."""
        ...


class CoordinatorClient:
    """Calls to the coordinator this node follows (`address`), as node `join.node_id`."""

    def __init__(
        self,
        *,
        join: pb.JoinRequest,
        address: str,
        transport: TransportConfig,
        changes: Changes,
        grace_s: float,
        on_revocations: Callable[[bytes], None] | None = None,
    ) -> None:
        """Calls go on channels of `transport`: with the node's key set (`proving`), each
        carries its proof (transport/proofs.py). `on_revocations`: given every plan's
        revocation list (transport/membership.py), before anything else is done with it."""
        self._on_revocations = on_revocations
        self._join = join
        """What this node says when it joins: its id, address and threads; its capabilities
        once measured (sent again to a new coordinator)."""
        self.address = address
        """The coordinator's address; "" until the daemon has found it."""
        self.lost = False
        """The coordinator's address has refused its plan stream for COORDINATOR_LOST_S, or
        its plan stream has been unreachable or its heartbeats have failed for `hold_s`."""
        self.lease_s = DEFAULT_LEASE_S
        self.latest_plan: pb.Plan | None = None
        """The newest plan the coordinator announced (maybe still pending)."""
        self.started_plan: pb.Plan | None = None
        """The newest plan whose start is fixed (not pending)."""
        self.joined = asyncio.Event()
        """Set once this node has joined: heartbeats go from then on."""
        self._transport = transport
        self._changes = changes
        self._grace_s = grace_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        """A channel per coordinator address this node has followed (one, but for failovers)."""
        self._switched = asyncio.Event()
        """Set when `follow` moves this node to another coordinator (the plan stream moves)."""
        self._failing_since: float | None = None
        """When heartbeats to the coordinator followed now began to fail (None: they do not)."""
        self._beat_logged_at = -float("inf")
        """When a failed heartbeat was last logged."""
        self._tasks = Tasks("calls to the coordinator")
        """Suspect calls in flight, and plan streams from a coordinator left behind that did
        not end at once when cancelled."""

    @property
    def node_id(self) -> str:
        return self._join.node_id

    @property
    def node_address(self) -> str:
        """This node's address for the others (the coordinator, its peers)."""
        return self._join.address

    @node_address.setter
    def node_address(self, address: str) -> None:
        self._join.address = address

    def stub(self) -> pb_grpc.CoordinatorStub:
        """A stub for the coordinator this node follows now: calls made through it reach a
        new coordinator after a failover (`follow`), retries included."""
        channel = self._channels.get(self.address)
        if channel is None:
            channel = grpc_channel(self.address, self._transport)
            self._channels[self.address] = channel
        return pb_grpc.CoordinatorStub(channel)

    async def call(
        self,
        call: Callable[[float], Awaitable[T]],
        what: str = "reports wait",
        grace_s: float | None = None,
    ) -> T:
        """Make one call to the coordinator (`call(timeout_s)`). While the coordinator does
        not answer (a lab coordinator being restarted) the stage trains on and the call is
        tried again every REPORT_RETRY_S, for up to `grace_s` in all (default: the
        coordinator's grace); then PeerUnavailable. A coordinator that answers but refuses
        raises PeerRefused at once. No wait_for_ready: a call queued for a channel that never
        comes back cannot always be cancelled (grpc.aio), and the node's stop must not wait
        for it."""
        loop = asyncio.get_running_loop()
        grace_s = self._grace_s if grace_s is None else grace_s
        deadline = loop.time() + grace_s
        lost_at: float | None = None
        while True:
            attempt = loop.time()
            timeout_s = max(0.1, min(self._transport.connect_timeout_s, deadline - attempt))
            try:
                with coordinator_errors(self.address):
                    result = await call(timeout_s)
            except PeerUnavailable as exc:
                self._changes.raise_if_stopping()
                if loop.time() >= deadline:
                    raise PeerUnavailable(f"{exc} (no answer for {grace_s:g} s)") from None
                if lost_at is None:
                    lost_at = attempt
                    log.warning("%s; training on, %s for it", exc, what)
                if loop.time() - attempt < REPORT_RETRY_S:  # refused at once: not a busy loop
                    await asyncio.sleep(REPORT_RETRY_S)  # a retry's pause, not a wait for an event
                continue
            if lost_at is not None:
                log.info("coordinator %s answers again after %.1f s", self.address,
                         loop.time() - lost_at)  # fmt: skip
            return result

    # ----- membership -------------------------------------------------------------------------
    async def join(self) -> pb.JoinReply:
        """Join the coordinator, without capabilities yet; the node is joined from then on.
        Unreachable if the coordinator cannot reach this node at its address (nothing has
        changed then: the node may go through a relay and join again); PeerUnavailable /
        PeerRefused if the call fails otherwise."""
        join = pb.JoinRequest(node_id=self._join.node_id, address=self._join.address,
                              compute_threads=self._join.compute_threads,
                              protocol=self._join.protocol,
                              node_certificate=self._join.node_certificate)  # fmt: skip
        try:
            reply: pb.JoinReply = await self.stub().Join(
                join, timeout=self._transport.connect_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            what = f"coordinator {self.address}"
            if any(k == UNREACHABLE_KEY for k, _ in exc.trailing_metadata() or ()):
                raise Unreachable(f"{what}: {exc.code().name}: {exc.details()}") from None
            raise peer_error(exc, what) from None
        self.lease_s = reply.lease_s or DEFAULT_LEASE_S
        self.joined.set()  # keep_membership() sends heartbeats from now on
        return reply

    async def tell(self, caps: pb.Capabilities) -> None:
        """Join again with what this node measured (`caps`): the coordinator plans with it."""
        self._join.capabilities.CopyFrom(caps)
        join = pb.JoinRequest()
        join.CopyFrom(self._join)
        with coordinator_errors(self.address):
            await self.stub().Join(join, timeout=self._transport.connect_timeout_s)

    async def follow(self, address: str) -> None:
        """A failover election made the node at `address` this swarm's coordinator: send
        everything there from now on (the plan stream, heartbeats, reports), and join it again
        with what this node measured and the newest plan epoch it knows, so that it can plan
        with this node. Raises PeerUnavailable / PeerRefused if it cannot join."""
        if address == self.address and not self.lost:
            return
        log.warning("following coordinator %s from now on (it was %s)", address,
                    self.address)  # fmt: skip
        self.address = address
        self.lost = False
        self._failing_since = None
        self._switched.set()
        await self._changes.notify()
        join = pb.JoinRequest()
        join.CopyFrom(self._join)
        latest = self.latest_plan
        join.plan_epoch = latest.epoch if latest is not None else 0
        await self.call(
            lambda t: self.stub().Join(join, timeout=t),
            "the join waits",
            grace_s=self._transport.connect_timeout_s + hold_s(self.lease_s),
        )

    async def back(self) -> None:
        """The coordinator counted lost answers after all (only this node lost it)."""
        self.lost = False
        self._failing_since = None
        await self._changes.notify()

    async def keep_membership(self, holdings: Holdings) -> None:
        """Heartbeats to the coordinator once this node has joined, for as long as the node
        runs; when cancelled (the node stops), a last `Leave`. A missed heartbeat is logged
        and the next one tried at once (`beat_cadence`): the coordinator forgives two."""
        await self.joined.wait()
        interval = heartbeat_interval(self.lease_s)
        rtt_s, at_once = 0.0, False
        # No wait for a channel to be ready: a stop at any moment from here must still leave.
        try:
            while True:
                pause_s, timeout_s = beat_cadence(interval, self._failing_since is not None)
                if not at_once:
                    await asyncio.sleep(pause_s)  # the heartbeat's period, not a wait for an event
                rtt_s, at_once = await self._beat(holdings, rtt_s, timeout_s)
        except asyncio.CancelledError:
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await self.stub().Leave(
                    pb.LeaveRequest(node_id=self.node_id), timeout=LEAVE_TIMEOUT_S
                )
            raise

    async def _beat(self, holdings: Holdings, rtt_s: float, timeout_s: float) -> tuple[float, bool]:
        """One heartbeat, carrying the round trip of the one before (`rtt_s`): its own round
        trip (0 if it failed), and whether the next one goes at once (a new hold to say)."""
        loop = asyncio.get_running_loop()
        coordinator = self.address  # a failover may move it
        sent = loop.time()
        try:
            held = holdings.held_epoch
            offers = await asyncio.to_thread(holdings.offers)  # after `held`
            sent = loop.time()
            beat = pb.HeartbeatRequest(node_id=self.node_id, rtt_s=rtt_s, held_epoch=held)
            beat.checkpoints.extend(offers)
            with coordinator_errors(coordinator):
                reply = await self.stub().Heartbeat(beat, timeout=timeout_s)
        except PeerError as exc:
            if isinstance(exc, PeerRefused) and BANNED in str(exc):  # told to go: it goes
                raise  # (the daemon stops, exit status 3: node.banned)
            await self._beat_failed(coordinator, sent, exc)
            return 0.0, False
        rtt_s = loop.time() - sent
        # The coordinator waits for this node's held offers to restore: at once.
        latest, hold = self.latest_plan, reply.hold_epoch
        at_once = hold > 0 and not (latest and latest.epoch > hold) and await holdings.hold(hold)
        if coordinator == self.address:
            self._failing_since = None
        return rtt_s, at_once

    async def _beat_failed(self, coordinator: str, sent: float, exc: PeerError) -> None:
        """A heartbeat sent at `sent` failed: the coordinator counts as lost once they have
        failed for `hold_s`."""
        if coordinator != self.address:  # a failover moved it meanwhile
            log.warning("heartbeat failed: %s", exc)
            return
        now = asyncio.get_running_loop().time()
        if self._failing_since is None or now - self._beat_logged_at >= BEAT_LOG_EVERY_S:
            # Retried every 0.3 to 0.7 s while failing: one line when they start failing, then
            # one a minute (a link down for 5 minutes wrote 580 lines before).
            since = (
                ""
                if self._failing_since is None
                else f" (failing for {now - self._failing_since:.0f} s)"
            )
            log.warning("heartbeat failed%s: %s", since, exc)
            self._beat_logged_at = now
        if self._failing_since is None:
            self._failing_since = sent
        silent_s = asyncio.get_running_loop().time() - self._failing_since
        if silent_s >= hold_s(self.lease_s) and not self.lost:
            log.warning("coordinator %s has not answered a heartbeat for %.1f s: counted lost",
                        coordinator, silent_s)  # fmt: skip
            self.lost = True
            await self._changes.notify()

    def suspect(self, plan: pb.Plan, error: BaseException) -> None:
        """Name this stage's neighbours under `plan` to the coordinator (Coordinator.Suspect),
        in a task of its own: one that is gone is counted lost at once, not after its lease.
        Best effort: without an answer, the lease rule still finds it."""
        self._tasks.start(self._suspect(plan, error), name="suspect")

    async def _suspect(self, plan: pb.Plan, error: BaseException) -> None:
        me = next((s for s in plan.stages if s.node_id == self.node_id), None)
        if me is None:
            return
        neighbours = [stage_at(plan, me.pipeline, me.index + d) for d in (-1, 1)]
        request = pb.SuspectRequest(
            node_id=self.node_id,
            plan_epoch=plan.epoch,
            suspects=[n.node_id for n in neighbours if n is not None],
            reason=str(error)[:200],
        )
        try:
            async with open_channel(self.address, self._transport) as channel:
                with coordinator_errors(self.address):
                    # The coordinator may probe twice, each for up to a lease.
                    reply = await pb_grpc.CoordinatorStub(channel).Suspect(
                        request, timeout=self._transport.connect_timeout_s + 2 * self.lease_s
                    )
        except PeerError as exc:
            log.info("could not name the suspects to the coordinator: %s", exc)
            return
        if reply.lost:
            log.info("the coordinator counts %s as lost", ", ".join(reply.lost))

    async def report_audit(self, report: pb.AuditReport) -> pb.AuditReply:
        """Report a neighbour that failed its audits (Coordinator.ReportAudit): the
        coordinator's verdict after recomputing the evidence itself. PeerUnavailable /
        PeerRefused if the call fails."""
        with coordinator_errors(self.address):
            reply: pb.AuditReply = await self.stub().ReportAudit(
                report, timeout=self._transport.connect_timeout_s + 60.0
            )
        return reply

    async def leave(self) -> bool:
        """Tell the coordinator this node is leaving; True if it should stay until a plan
        without it has taken its blocks over. PeerUnavailable / PeerRefused if it cannot."""
        async with open_channel(self.address, self._transport) as channel:
            with coordinator_errors(self.address):
                reply = await pb_grpc.CoordinatorStub(channel).Leave(
                    pb.LeaveRequest(node_id=self.node_id),
                    timeout=self._transport.connect_timeout_s,
                )
        return bool(reply.hand_off)

    async def swarm(self) -> pb.SwarmView:
        """The coordinator's view of the swarm; PeerUnavailable / PeerRefused if it cannot."""
        with coordinator_errors(self.address):
            view: pb.SwarmView = await self.stub().Swarm(
                pb.SwarmRequest(), timeout=self._transport.connect_timeout_s
            )
        return view

    # ----- the plan watch ---------------------------------------------------------------------
    async def watch_plans(self) -> None:
        """Keep `latest_plan` up to date from the coordinator's plan stream, opening it again
        whenever it ends (a coordinator restarting), and at once on the new coordinator after
        a failover (`follow`). Only a newer plan replaces the one this node has (a higher
        epoch, or the same epoch no longer pending): an old coordinator that comes back cannot
        impose an older plan."""
        unreachable_since: float | None = None
        refused_since: float | None = None
        while True:
            address = self.address
            error = await self._watch_once(address)
            if self.address != address:
                unreachable_since = refused_since = None
                continue
            if isinstance(error, PeerError):
                log.info("plan stream ended: %s", error)
            elif error is not None:
                raise error
            if isinstance(error, PeerUnavailable):
                now = asyncio.get_running_loop().time()
                unreachable_since = unreachable_since or now
                refused_since = (refused_since or now) if _refused(error) else None
                lost = coordinator_lost(now, unreachable_since, refused_since, self.lease_s)
                if lost and not self.lost:
                    self.lost = True
                    await self._changes.notify()
            elif error is None:
                unreachable_since = refused_since = None
            # A retry's pause before opening it again, jittered (RETRY_PAUSE_S).
            await asyncio.sleep(random.uniform(*RETRY_PAUSE_S))

    async def _watch_once(self, address: str) -> BaseException | None:
        """One plan stream from the coordinator at `address`, until it ends or `follow` moves
        this node to another; how it ended (None: cleanly, or moved)."""
        self._switched.clear()
        watch = asyncio.create_task(self._watch_from(address))
        switched = asyncio.create_task(self._switched.wait())
        try:
            await asyncio.wait({watch, switched}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            switched.cancel()
            if not watch.done():  # a call to a coordinator left behind ends here
                watch.cancel()
                await asyncio.wait({watch}, timeout=REPORT_RETRY_S)
                self._tasks.adopt(watch)  # if it did not end at once: awaited on `close`
            await asyncio.wait({switched})
        return watch.exception() if watch.done() and not watch.cancelled() else None

    async def _watch_from(self, address: str) -> None:
        """One plan stream from the coordinator at `address`, until it ends; PeerUnavailable /
        PeerRefused if it fails."""
        # Not wait_for_ready: a call waiting for a channel that never comes back cannot
        # always be cancelled (grpc.aio); an unreachable coordinator fails fast here and
        # is tried again after a pause.
        with coordinator_errors(address):
            async for plan in self.stub().WatchPlan(pb.WatchPlanRequest(node_id=self.node_id)):
                if self.address != address:
                    return
                self.lost = False
                if plan.revocations and self._on_revocations is not None:
                    self._on_revocations(plan.revocations)
                if self.node_id in plan.banned:  # told to go: it goes (exit status 3)
                    raise Banned(f"this node is {BANNED} (announced with plan epoch {plan.epoch})")
                if self._is_newer(plan):
                    self.latest_plan = plan
                    if not plan.pending:
                        self.started_plan = plan
                    await self._changes.notify()

    def _is_newer(self, plan: pb.Plan) -> bool:
        """`plan` replaces the newest this node has: a higher epoch, or the same epoch no
        longer pending."""
        latest = self.latest_plan
        if latest is None or (plan.epoch, not plan.pending) > (latest.epoch, not latest.pending):
            return True
        if plan.epoch < latest.epoch:
            log.warning("ignoring plan epoch %d: this node has epoch %d", plan.epoch,
                        latest.epoch)  # fmt: skip
        return False

    async def next_plan(self, after_epoch: int) -> pb.Plan:
        """The newest started plan above `after_epoch`. Waits as long as it takes (a spare
        waits for a plan with room for it); the coordinator's absence is noticed by reports.
        CancelledError if the node stops meanwhile."""

        def arrived() -> bool:
            p = self.started_plan
            return p is not None and p.epoch > after_epoch

        await self._changes.wait_for(lambda: arrived() or self._changes.stopping)
        if self._changes.stopping:
            raise asyncio.CancelledError
        assert self.started_plan is not None
        return self.started_plan

    # ----- the end ----------------------------------------------------------------------------
    def stop(self) -> None:
        """The node stops: cancel the calls in flight (suspects)."""
        self._tasks.cancel()

    async def close(self) -> None:
        """Close the channels to coordinators (after the run's tasks have ended), which ends
        the calls left behind on them, and wait a moment for those."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)
        await self._tasks.close(REPORT_RETRY_S)
