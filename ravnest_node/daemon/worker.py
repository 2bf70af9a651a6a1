"""A node's worker role: join the coordinator, take a stage from the plan, train it.

The worker owns the stage runtime of the current plan and the client half of the boundary
stream to the next stage; the daemon's gRPC server hands it the server half (the stream from
the previous stage) through `open_session`.

Plans follow one another without a restart (docs/discovery.md, "Re-planning"): when the
coordinator announces a newer plan, the first stage of each pipeline stops feeding at a step
boundary and tells the coordinator (`Drain`), the stages behind it learn where the old plan
ends from their upstream stream's clean end, every node keeps the blocks it trained as they
were at that step and serves them (`Node.FetchBlock`), and each member of the new plan builds
its stage from blocks it kept or fetched, and trains on from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Executor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from ravnest_node.averaging import AveragingConfig, AveragingService, Member, ReplicaAverager
from ravnest_node.blocks import BlockWeights
from ravnest_node.checkpoint import (
    CheckpointCopies,
    CheckpointDir,
    CheckpointError,
    Manifest,
    bytes_bound,
    parse_manifest,
    run_key,
)
from ravnest_node.coordination.static_plan import (
    check_plan,
    dials_back,
    has_node,
    replica_group,
    stage_at,
)
from ravnest_node.daemon.capabilities import measure
from ravnest_node.errors import (
    ConfigError,
    FrameError,
    PeerError,
    PeerRefused,
    PeerUnavailable,
    RunFailed,
    Unreachable,
)
from ravnest_node.models import get_model
from ravnest_node.models.pretrained import check_allowed
from ravnest_node.pipeline.codec_choice import CodecChoice
from ravnest_node.pipeline.handoff import CHUNK_BYTES, BlockAssembler, to_chunks
from ravnest_node.pipeline.run import TrainConfig, check_frame_limit
from ravnest_node.pipeline.stage import Averaging, StageRuntime, StageSpec, StepReport
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import (
    DEFAULT_LEASE_S,
    LOST_AFTER_LEASES,
    MAX_EPOCH_AHEAD,
    MAX_OFFERS,
    MAX_PEER_LINKS,
    PROTOCOL,
    UNREACHABLE_KEY,
    heartbeat_interval,
)
from ravnest_node.state import valid_node_id
from ravnest_node.transport.boundary import (
    Accept,
    BoundaryLink,
    LinkAborted,
    LinkCounters,
    run_back_stream,
    run_client_stream,
)
from ravnest_node.transport.errors import Refusal, peer_errors
from ravnest_node.transport.frames import FrameLimits
from ravnest_node.transport.options import (
    TransportConfig,
    grpc_channel,
    is_loopback,
    split_host_port,
)
from ravnest_node.transport.probe import (
    MIN_PROBE_COST,
    PROBE_BUDGET_BYTES,
    LinkEstimate,
    ProbeBusy,
    ProbePlan,
    ProbeTurns,
    measure_link,
    probe_sender,
)

log = logging.getLogger(__name__)

# A stopping node says it leaves, but does not hold up its stop for long.
LEAVE_TIMEOUT_S = 1.0
# A report the coordinator refused at once as unavailable is tried again after this pause,
# and a plan stream that ended is opened again after it.
REPORT_RETRY_S = 0.5
# The coordinator counts as lost (a leaving node stops waiting for a hand-over) once its plan
# stream has been unreachable this long: not one dropped connection.
COORDINATOR_LOST_S = 3.0
# A node whose plan a lost neighbour broke waits this many leases (plus the connect timeout)
# for the coordinator's plan without that neighbour.
BREAK_WAIT_LEASES = 4
# A checkpoint copy must come at least this fast (bits per second), after the connect timeout.
COPY_MIN_BPS = 1e6
PROGRESS_EVERY_S = 2.0
"""A block fetch that takes longer logs how far it got this often."""
FETCH_AT_ONCE = 16
"""Blocks a node fetches at once from one holder: within its calls per peer (peer_max_calls)."""
POISON_SCALE = 1e4
"""Test only (TrainConfig.fault_poison_pipeline): how much larger a poisoning replica's pushed
deltas are than its real ones."""
# A probe under epoch 0 from an id this node does not know as measuring asks the coordinator
# for its members at most this often, and what it said holds this long.
MEMBERS_ASK_S = 0.5
MEMBERS_KEEP_S = 10.0
# A measurement refused as busy (another node measures the peer) is tried again after a pause
# of this many seconds (a random one in the range), for up to MEASURE_TURN_WAIT_S.
MEASURE_RETRY_S = (0.2, 1.0)
MEASURE_TURN_WAIT_S = 30.0


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (nobody waits for it any more)."""
    if not future.cancelled():
        future.exception()


def _peer_fault(exc: BaseException) -> PeerUnavailable | PeerRefused | None:
    """The first peer fault in `exc` (or its task groups) if every error in it is one: a
    neighbour or the coordinator gave up on this stage. None if anything else failed."""
    leaves: list[BaseException] = []
    pending = [exc]
    while pending:
        e = pending.pop()
        if isinstance(e, BaseExceptionGroup):
            pending.extend(reversed(e.exceptions))
        else:
            leaves.append(e)
    faults = [e for e in leaves if isinstance(e, (PeerUnavailable, PeerRefused))]
    return faults[0] if faults and len(faults) == len(leaves) else None


@asynccontextmanager
async def open_channel(address: str, transport: TransportConfig) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a peer, ready to use; PeerUnavailable if it does not answer in time."""
    channel = grpc_channel(address, transport)
    try:
        try:
            async with asyncio.timeout(transport.connect_timeout_s):
                await channel.channel_ready()
        except TimeoutError:
            raise PeerUnavailable(
                f"no answer from {address} within {transport.connect_timeout_s:g} s"
            ) from None
        yield channel
    finally:
        await channel.close(grace=None)


T = TypeVar("T")


@contextmanager
def coordinator_errors(address: str) -> Iterator[None]:
    """Translate a failed call to the coordinator into PeerUnavailable / PeerRefused."""
    with peer_errors(f"coordinator {address}"):
        yield


@dataclass(slots=True)
class _Session:
    runtime: StageRuntime
    upstream_node_id: str
    upstream_failed: asyncio.Future[None]
    downstream_node_id: str = ""
    probe_bytes: dict[str, int] = field(default_factory=dict)
    """Probe bytes received per neighbour under this plan (bounded by PROBE_BUDGET_BYTES)."""
    opens_upstream: bool = False
    """This stage opens its upstream stream itself (BoundaryBack: this node is behind NAT and
    its upstream's is not); a forward Boundary from upstream is refused."""
    downstream_opens: bool = False
    """Its downstream stage opens their stream (BoundaryBack); this stage waits for it."""
    dial_in: _DialIn | None = None
    """That stream, once this stage waits for it (`_await_dial_in`)."""


@dataclass(slots=True)
class _DialIn:
    """The downstream stream a stage waits for its downstream stage to open (BoundaryBack)."""

    link: BoundaryLink
    accept: Accept
    ended: asyncio.Future[None]
    """How the stream ended (an exception: broken)."""
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the downstream has opened it (only once)."""


class Worker:
    """Trains the stage this node is given. One per node."""

    def __init__(
        self,
        *,
        node_id: str,
        address: str,
        coordinator: str,
        compute_threads: int,
        transport: TransportConfig,
        compute: Executor,
        counters: LinkCounters,
        averaging: AveragingService | None = None,
        coordinator_grace_s: float = 600.0,
        checkpoints: CheckpointDir | None = None,
        resume: bool = False,
        model_dirs: tuple[Path, ...] = (),
    ) -> None:
        self.node_id = node_id
        self._model_dirs = model_dirs
        """Where the run's pretrained model and data may be read from (check_allowed)."""
        self._checkpoints = checkpoints
        self._copies = (
            None if checkpoints is None
            else CheckpointCopies(checkpoints.path.parent, retention=checkpoints.retention)
        )  # fmt: skip
        """Copies of the upstream stage's checkpoints (a stage without a replica)."""
        self._copying: asyncio.Task[None] | None = None
        self._serving_copy: set[str] = set()
        """Peers a checkpoint copy is being sent to now (one at a time each)."""
        self._offering = False
        """Heartbeats carry this node's checkpoints once its first plan has set aside those
        that are not of the run."""
        self._offers: list[pb.CheckpointOffer] = []
        self._model_name = ""
        self._joined_epoch = 0
        self._notifying: asyncio.Future[None] | None = None
        self._suspecting: set[asyncio.Task[None]] = set()
        """Suspect calls in flight (kept: the loop holds only weak references to tasks)."""
        self._dialing: set[asyncio.Task[None]] = set()
        """Upstream streams this node opened itself (BoundaryBack), while they run."""
        """The copy being fetched (one at a time; a copy due meanwhile is skipped)."""
        self._resume = resume
        self._writing: asyncio.Task[Manifest] | None = None
        """The checkpoint being written (one at a time, in a worker thread)."""
        self._write_lock = asyncio.Lock()
        self.checkpoint_step = 0
        """Step of the newest checkpoint this node has written (reported to the coordinator)."""
        self._first_plan = True
        self._coordinator_grace_s = coordinator_grace_s
        self._averaging_service = averaging
        self._address = address
        self.coordinator = coordinator
        """The coordinator's address; "" until the daemon has found it."""
        self._threads = compute_threads
        self._joined = asyncio.Event()
        self._lease_s = DEFAULT_LEASE_S
        self.compute_scale = 1.0
        """Test only: multiplies the compute time this node measures (see NodeConfig)."""
        self.block_delay_s = 0.0
        """Test only: seconds this node sleeps per block and microbatch (see NodeConfig)."""
        self.fuzz_upstream = ""
        """Test only: a peer whose streams are checked, never admitted (see NodeConfig)."""
        self._transport = transport
        self._compute = compute
        self.counters = counters
        self.limits = FrameLimits(
            max_message_bytes=transport.max_message_bytes,
            max_header_bytes=transport.max_header_bytes,
        )
        self.plan: pb.Plan | None = None
        """The plan this node trains (or last trained) a stage of."""
        self.latest_plan: pb.Plan | None = None
        """The newest plan the coordinator announced (maybe still pending)."""
        self.started_plan: pb.Plan | None = None
        """The newest plan whose start is fixed (not pending)."""
        self._session: _Session | None = None
        self._held: dict[int, BlockWeights] = {}
        """Blocks this node trained under its last plan, as they were when it ended."""
        self._held_step = -1
        self._handed: set[int] = set()
        """Held blocks a member of the next plan has fetched."""
        self._changed = asyncio.Condition()  # a plan announced, a session started, blocks kept
        self.frames_refused = 0
        self.stopping = False
        """Set by the daemon when it stops: retry loops end instead of trying again."""
        self.coordinator_lost = False
        """The coordinator's plan stream has been unreachable for COORDINATOR_LOST_S, or its
        heartbeats have failed for LOST_AFTER_LEASES leases (a coordinator that hangs keeps
        its connections open: only keepalive, tens of seconds later, would end them)."""
        self._channels: dict[str, grpc.aio.Channel] = {}
        """A channel per coordinator address this node has followed (one, but for failovers)."""
        self._switched = asyncio.Event()
        """Set when `follow` moves this node to another coordinator (the plan stream moves)."""
        self._caps: pb.Capabilities | None = None
        """What this node measured for the swarm's model (sent again to a new coordinator)."""
        self.relay_node_id = ""
        """Behind NAT: the relay this node is reached through (told to the planner)."""
        self.relay_address = ""
        """The relay this node serves (--relay-listen), offered to the coordinator."""
        self.run_finished = False
        """This node's stage trained the run's last step."""
        self._heartbeats_failing_since: float | None = None
        """When heartbeats to the coordinator followed now began to fail (None: they do not)."""
        self._left_behind: set[asyncio.Task[None]] = set()
        """Plan streams from a coordinator left behind that did not end at once when cancelled
        (awaited when the node stops)."""
        self._measuring: dict[str, float] = {}
        """Members measuring their links as the coordinator last listed them (who may probe
        under epoch 0): node id -> when that began (SwarmMember.measuring_since); when it was
        asked (loop time), and the probe bytes each has sent per measuring."""
        self._measuring_asked_at = -math.inf
        self._measuring_ask: asyncio.Task[None] | None = None
        self._member_probe_bytes: dict[tuple[str, float], int] = {}
        self._probe_turns = ProbeTurns()

    @property
    def runtime(self) -> StageRuntime | None:
        return self._session.runtime if self._session else None

    @property
    def upstream_node_id(self) -> str:
        return self._session.upstream_node_id if self._session else ""

    def _reraise_cancel(self, exc: BaseException) -> None:
        """Raise CancelledError if the node is stopping or this task is being cancelled. A
        call to this node's own server that is cancelled while the server stops can end with
        UNAVAILABLE instead of the cancel (see NodeDaemon._serve): a retry loop must not
        swallow the stop with it."""
        task = asyncio.current_task()
        cancelled = (
            isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.CANCELLED
        )
        if self.stopping or cancelled or (task is not None and task.cancelling()):
            raise asyncio.CancelledError from None

    async def stop(self) -> None:
        """The node stops: end the waits and retry loops of the run (the run's task is
        cancelled too, but a cancel that arrives during a call to this node's own server can be
        lost inside grpc.aio, so the run must not rely on it alone)."""
        self.stopping = True
        if self._copying is not None:
            self._copying.cancel()
        for task in (*self._suspecting, *self._dialing):
            task.cancel()
        await self._notify()

    async def _send_report(self, report: pb.StageReport, timeout_s: float) -> pb.ReportReply:
        reply: pb.ReportReply = await self._stub().Report(report, timeout=timeout_s)
        return reply

    async def _probe_link(
        self, address: str, peer: str, *, epoch: int, pace_bps: float = 0.0, pull: bool = False
    ) -> LinkEstimate:
        """Measure the link to the node at `address` with link probes under `epoch` (its
        bytes counted for `peer`), from this node, or with `pull` to it; PeerUnavailable /
        PeerRefused if it cannot."""
        async with open_channel(address, self._transport) as channel:
            send = probe_sender(
                channel,
                peer=peer,
                node_id=self.node_id,
                epoch=epoch,
                counters=self.counters,
                timeout_s=self._transport.connect_timeout_s,
                pace_bps=pace_bps,
                pull=pull,
            )
            return await measure_link(send, ProbePlan.within(self._transport.max_message_bytes))

    async def _measure_in_turn(self, address: str, peer: str, *, pull: bool) -> LinkEstimate:
        """`_probe_link` under epoch 0, tried again after a short random pause while the peer
        is busy being measured by another node, for up to MEASURE_TURN_WAIT_S."""
        deadline = asyncio.get_running_loop().time() + MEASURE_TURN_WAIT_S
        while True:
            try:
                return await self._probe_link(address, peer, epoch=0, pull=pull)
            except ProbeBusy:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
            await asyncio.sleep(random.uniform(*MEASURE_RETRY_S))  # a back-off, not a wait

    async def _measure_peers(self, coordinator_link: LinkEstimate | None) -> list[pb.PeerLink]:
        """This node's links to the members that joined before it, on other hosts (at most
        MAX_PEER_LINKS, one after another so that they do not share the link): each measured
        with link probes under epoch 0, pushed then pulled (the coordinator's own node: pulled
        only, its push is `coordinator_link`). Every pair of members is so measured once, by the
        later to join. Best effort: a member that cannot be probed is left out (the planner
        then goes by uplinks)."""
        try:
            with coordinator_errors(self.coordinator):
                view = await self._stub().Swarm(
                    pb.SwarmRequest(), timeout=self._transport.connect_timeout_s
                )
        except PeerError as exc:
            log.info("links to peers not measured: %s", exc)
            return []
        ids = [m.node_id for m in view.members]
        if self.node_id not in ids:
            return []
        host = split_host_port(self._address)[0]
        links: list[pb.PeerLink] = []
        for m in view.members[: ids.index(self.node_id)]:
            if len(links) >= MAX_PEER_LINKS:
                break
            try:
                if m.left or m.lease_expired or not valid_node_id(m.node_id):
                    continue
                if not (self.relay_node_id or m.relay_node_id) and (
                    split_host_port(m.address)[0] == host
                ):
                    continue  # one machine: memory, not a network
                if m.relay_node_id and not self.relay_node_id:
                    continue  # only through its relay, but their stream would go straight
                to = coordinator_link if m.address == self.coordinator else None
                if to is None:
                    to = await self._measure_in_turn(m.address, m.node_id, pull=False)
                back = await self._measure_in_turn(m.address, m.node_id, pull=True)
            except (PeerError, ConfigError) as exc:
                log.info("link to %s not measured: %s", m.node_id[:64], exc)
                continue
            link = pb.PeerLink(
                node_id=m.node_id,
                to_bps=to.bandwidth_bps,
                from_bps=back.bandwidth_bps,
                rtt_s=min(to.rtt_s, back.rtt_s),
            )
            log.info("link to %s: %.1f Mbit/s there, %.1f back, round trip %.1f ms", m.node_id,
                     link.to_bps / 1e6, link.from_bps / 1e6, link.rtt_s * 1e3)  # fmt: skip
            links.append(link)
        return links

    async def _measure_coordinator_link(self) -> LinkEstimate | None:
        """This node's link to the coordinator, for the planner (Capabilities.uplink_bps):
        link probes under epoch 0, in turn with the other nodes measuring it. None for the
        coordinator's own node, a coordinator on loopback (the same machine), or one that does
        not take probes (best effort: the planner then assumes a fast link)."""
        if self.coordinator == self._address or is_loopback(self.coordinator):
            return None  # its own node, or the same machine: memory, not a network
        try:
            link = await self._measure_in_turn(self.coordinator, self.coordinator, pull=False)
        except PeerError as exc:
            log.info("the link to the coordinator is not measured: %s", exc)
            return None
        log.info("link to the coordinator: %.1f Mbit/s, round trip %.1f ms",
                 link.bandwidth_bps / 1e6, link.rtt_s * 1e3)  # fmt: skip
        return link

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Wait until `condition` (about this worker's state) holds."""
        async with self._changed:
            await self._changed.wait_for(condition)

    async def close_channels(self) -> None:
        """Close the channels to coordinators (after the run's tasks have ended)."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:  # ends the calls left behind on them, too
            await channel.close(grace=None)
        if self._left_behind:
            await asyncio.wait(self._left_behind, timeout=REPORT_RETRY_S)

    def _stub(self) -> pb_grpc.CoordinatorStub:
        """A stub for the coordinator this node follows now: calls made through it reach a
        new coordinator after a failover (`follow`), retries included."""
        channel = self._channels.get(self.coordinator)
        if channel is None:
            channel = grpc_channel(self.coordinator, self._transport)
            self._channels[self.coordinator] = channel
        return pb_grpc.CoordinatorStub(channel)

    async def follow(self, address: str) -> None:
        """A failover election made the node at `address` this swarm's coordinator: send
        everything there from now on (the plan stream, heartbeats, reports), and join it again
        with what this node measured and the newest plan epoch it knows, so that it can plan
        with this node. Raises PeerUnavailable / PeerRefused if it cannot join."""
        if address == self.coordinator and not self.coordinator_lost:
            return
        log.warning("following coordinator %s from now on (it was %s)", address,
                    self.coordinator)  # fmt: skip
        self.coordinator = address
        self.coordinator_lost = False
        self._heartbeats_failing_since = None
        self._switched.set()
        await self._notify()
        latest = self.latest_plan
        join = pb.JoinRequest(
            node_id=self.node_id,
            address=self._address,
            compute_threads=self._threads,
            protocol=PROTOCOL,
            plan_epoch=latest.epoch if latest is not None else 0,
        )
        if self._caps is not None:
            join.capabilities.CopyFrom(self._caps)
        await self._call_coordinator(
            lambda t: self._stub().Join(join, timeout=t),
            "the join waits",
            grace_s=self._transport.connect_timeout_s + LOST_AFTER_LEASES * self._lease_s,
        )

    def _ended_behind(self, task: asyncio.Task[None]) -> None:
        self._left_behind.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a plan stream left behind ended: %s", task.exception())

    async def coordinator_back(self) -> None:
        """The coordinator counted lost answers after all (only this node lost it)."""
        self.coordinator_lost = False
        self._heartbeats_failing_since = None
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait(
        self, condition: Callable[[], bool], what: str, timeout_s: float | None = None
    ) -> None:
        """Wait for `condition`, within `timeout_s` (default: the connect timeout);
        Refusal(UNAVAILABLE) after it."""
        limit = self._transport.connect_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(limit), self._changed:
                await self._changed.wait_for(condition)
        except TimeoutError:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, what) from None

    # ----- the server half of the upstream boundary -------------------------------------------
    async def _session_at(self, epoch: int, what: str) -> _Session:
        """This node's session once it has a stage of plan `epoch` (a neighbour may get the
        plan a moment earlier: wait for it, within the connect timeout), if the peer's `what`
        is for that epoch; Refusal otherwise, at once for an epoch far past any plan this node
        has heard of (a hostile caller must not hold the handler for the whole wait)."""
        newest = self.latest_plan.epoch if self.latest_plan is not None else 0
        if epoch > newest + MAX_EPOCH_AHEAD:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} is for plan epoch {epoch}, far past this node's newest ({newest})",
            )
        await self._wait(
            lambda: self._session is not None and self.plan is not None
            and self.plan.epoch >= epoch,
            f"this node has no stage of plan epoch {epoch} yet",
        )  # fmt: skip
        session, plan = self._session, self.plan
        assert session is not None and plan is not None
        if epoch != plan.epoch:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} is for plan epoch {epoch}, this node is at epoch {plan.epoch}",
            )
        return session

    async def open_session(
        self, peer_node_id: str, epoch: int, *, back: bool = False
    ) -> tuple[BoundaryLink, Accept]:
        """Called by the gRPC server when the previous stage opens its boundary stream (or,
        `back`, by `_dial_upstream` when this stage opens it). The previous stage may have the
        plan a moment before this node: wait for it, within the connect timeout."""
        session = await self._session_at(epoch, "stream")
        if session.runtime.spec.is_first:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "the first stage has no upstream")
        if peer_node_id and peer_node_id == self.fuzz_upstream and not back:  # test only
            return BoundaryLink(peer_node_id, self.counters, 1), session.runtime.check_from_upstream
        if session.opens_upstream != back:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "this stage opens the stream to its upstream itself (BoundaryBack)"
                          if session.opens_upstream else "not a BoundaryBack stage")  # fmt: skip
        if peer_node_id != session.upstream_node_id:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"unknown peer {peer_node_id!r}: the plan's upstream is {session.upstream_node_id}",
            )
        if session.runtime.upstream is not None:
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS, "the upstream stream is already open")
        link = BoundaryLink(
            peer_node_id,
            self.counters,
            outbox_size=session.runtime.window,
            pace_bps=session.runtime.run_config.link_pace_bps(session.runtime.spec.index - 1),
        )
        session.runtime.upstream = link
        return link, session.runtime.accept_from_upstream

    def close_session(self, link: BoundaryLink, error: BaseException | None) -> None:
        session = self._session
        if session is None or session.runtime.upstream is not link:
            return
        session.runtime.upstream = None
        # A clean end is the upstream's way of saying it is done (with the run, or with its
        # plan: then at a step boundary, where this stage's plan ends too); anything else
        # mid-run is a fault.
        finished = error is None and (
            session.runtime.received_all_forwards or session.runtime.upstream_ended()
        )
        if not finished and not session.runtime.done and not session.upstream_failed.done():
            reason = f"upstream stream from {link.peer} ended before the run did"
            if error is not None:
                reason += f": {error or type(error).__name__}"
            session.upstream_failed.set_exception(PeerUnavailable(reason))

    def on_refused(self, reason: str) -> None:
        self.frames_refused += 1

    async def dial_in(
        self, peer_node_id: str, epoch: int
    ) -> tuple[BoundaryLink, Accept, Callable[[BaseException | None], None]]:
        """Called by the gRPC server when the next stage opens `BoundaryBack` (it is behind NAT,
        this node is not): the stream this stage waits for (`_await_dial_in`), once it waits
        (within the connect timeout); Refusal otherwise."""
        session = await self._session_at(epoch, "stream")
        if not peer_node_id or peer_node_id != session.downstream_node_id:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"unknown peer {peer_node_id[:80]!r}: the plan's downstream is "
                f"{session.downstream_node_id or 'none'}",
            )
        if not session.downstream_opens:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "this stage opens the stream to its downstream (Boundary)")  # fmt: skip
        await self._wait(lambda: session.dial_in is not None or self._session is not session,
                         "this stage does not wait for its downstream's stream yet")  # fmt: skip
        slot = session.dial_in
        if slot is None or self._session is not session:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "this stage's plan has moved on")
        if slot.taken.is_set():
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS, "the downstream stream is already open")
        slot.taken.set()

        def finish(error: BaseException | None) -> None:
            if slot.ended.done():
                return
            if error is None:
                slot.ended.set_result(None)
            elif isinstance(error, asyncio.CancelledError):  # the call ended under it
                slot.ended.set_exception(PeerUnavailable(f"stream from {peer_node_id} broke"))
            else:
                slot.ended.set_exception(error)

        return slot.link, slot.accept, finish

    async def _await_dial_in(self, link: BoundaryLink, accept: Accept) -> None:
        """This stage's downstream stream when its downstream opens it (BoundaryBack): until it
        ends, as `run_client_stream` would. PeerUnavailable if it is not opened within twice
        the connect timeout (a neighbour gets as long to connect, then to get the plan). If
        this stage gives up first (its plan broke), the stream is aborted, so the downstream
        learns it."""
        session = self._session
        assert session is not None
        slot = _DialIn(link, accept, asyncio.get_running_loop().create_future())
        session.dial_in = slot
        log.info("downstream %s is behind NAT: it opens the stream to this node", link.peer)
        await self._notify()
        try:
            try:
                async with asyncio.timeout(2 * self._transport.connect_timeout_s):
                    await slot.taken.wait()
            except TimeoutError:
                raise PeerUnavailable(
                    f"{link.peer} did not open its boundary stream within "
                    f"{2 * self._transport.connect_timeout_s:g} s"
                ) from None
            await slot.ended
        finally:
            if not slot.ended.done():
                link.abort("this stage gave up")  # ends the downstream's call, if open
                slot.ended.add_done_callback(_retrieve)

    async def _dial_upstream(self, plan: pb.Plan, upstream: pb.StageAssignment) -> None:
        """This stage's node is behind NAT and its upstream's is not: open the upstream
        stream (BoundaryBack) straight to it, and run it as the server half would
        (`open_session`, `close_session`: a fault breaks the plan through upstream_failed). It
        runs beside the stage, as the server half of a stream does, until the upstream ends
        its half (or the stream breaks)."""
        session = self._session
        assert session is not None
        log.info("behind NAT: opening the stream to upstream %s at %s from this side",
                 upstream.node_id, upstream.address)  # fmt: skip
        try:
            async with open_channel(upstream.address, self._transport) as channel:
                link, accept = await self.open_session(upstream.node_id, plan.epoch, back=True)
                error: BaseException | None = None
                try:
                    await run_back_stream(channel, link, node_id=self.node_id,
                                          epoch=plan.epoch, limits=self.limits, accept=accept,
                                          on_refused=self.on_refused)  # fmt: skip
                except (PeerError, FrameError, LinkAborted) as exc:
                    error = exc
                except asyncio.CancelledError:  # the node stops: nobody waits for the stream
                    if session.runtime.upstream is link:
                        session.runtime.upstream = None
                    raise
                self.close_session(link, error)
        except (PeerError, Refusal) as exc:  # no channel, or no session to attach to
            if not session.upstream_failed.done() and not session.runtime.done:
                session.upstream_failed.set_exception(
                    PeerUnavailable(f"cannot open the stream to {upstream.node_id}: {exc}")
                )

    async def check_probe(self, peer_node_id: str, epoch: int, nbytes: int) -> None:
        """Called by the gRPC server for each link probe: only the plan's neighbours of this
        stage may probe, under the current epoch, within PROBE_BUDGET_BYTES each; Refusal
        otherwise. Waits for the plan like `open_session`. Under epoch 0 (before a plan, or a
        newcomer measuring its links), any member may (`_check_member_probe`)."""
        if epoch == 0:
            await self._check_member_probe(peer_node_id, nbytes)
            return
        session = await self._session_at(epoch, "probe")
        if not peer_node_id or peer_node_id not in (
            session.upstream_node_id,
            session.downstream_node_id,
        ):
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"unknown peer {peer_node_id!r}: only this stage's neighbours may probe it",
            )
        total = session.probe_bytes.get(peer_node_id, 0) + nbytes
        if total > PROBE_BUDGET_BYTES:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{peer_node_id} has sent {PROBE_BUDGET_BYTES} bytes of probes under this plan",
            )
        session.probe_bytes[peer_node_id] = total

    async def _check_member_probe(self, peer_node_id: str, nbytes: int) -> None:
        """A probe under epoch 0: only from a member measuring its links, as the coordinator
        lists them (`_measuring_since`), within PROBE_BUDGET_BYTES each time it measures, one
        prober at a time (`ProbeTurns`); Refusal otherwise."""
        if not valid_node_id(peer_node_id):
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, "probe without a valid node id")
        since = await self._measuring_since(peer_node_id)
        if since is None:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"{peer_node_id} is not a member measuring its links")  # fmt: skip
        key = (peer_node_id, since)
        total = self._member_probe_bytes.get(key, 0) + max(nbytes, MIN_PROBE_COST)
        if total > PROBE_BUDGET_BYTES:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{peer_node_id} has sent {PROBE_BUDGET_BYTES} bytes of probes",
            )
        self._probe_turns.take(peer_node_id)
        self._member_probe_bytes[key] = total

    async def _measuring_since(self, node_id: str) -> float | None:
        """When member `node_id` began measuring its links, as the coordinator says (None: it
        is not measuring). An answer is kept MEMBERS_KEEP_S; an id not in it waits for an
        answer asked after the probe came (one ask at a time, shared by every probe waiting,
        at most every MEMBERS_ASK_S). Refusal if the coordinator cannot be asked."""
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        if arrived - self._measuring_asked_at < MEMBERS_KEEP_S and node_id in self._measuring:
            return self._measuring[node_id]
        if not self.coordinator:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "this node has no coordinator yet")
        while True:
            ask = self._measuring_ask
            if ask is not None and (not ask.done() or self._measuring_asked_at >= arrived):
                try:
                    await asyncio.shield(ask)
                except PeerError as exc:
                    raise Refusal(
                        grpc.StatusCode.UNAVAILABLE,
                        f"cannot ask the coordinator for its members: {exc}",
                    ) from None
                if self._measuring_asked_at >= arrived:  # an answer newer than the probe
                    return self._measuring.get(node_id)
                continue
            wait = self._measuring_asked_at + MEMBERS_ASK_S - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)  # a rate limit on asking, not a wait for an event
                continue
            self._measuring_asked_at = loop.time()
            self._measuring_ask = asyncio.create_task(self._ask_measuring())
            self._measuring_ask.add_done_callback(_retrieve)

    async def _ask_measuring(self) -> None:
        """Ask the coordinator which members measure their links now (`_measuring`)."""
        with coordinator_errors(self.coordinator):
            view = await self._stub().Swarm(
                pb.SwarmRequest(), timeout=self._transport.connect_timeout_s
            )
        self._measuring = {m.node_id: m.measuring_since for m in view.members
                           if m.measuring_since > 0 and not m.left}  # fmt: skip
        measuring = set(self._measuring.items())  # the budgets of measurings that are over go
        self._member_probe_bytes = {
            key: n for key, n in self._member_probe_bytes.items() if key in measuring
        }

    async def _measure_links(
        self,
        plan: pb.Plan,
        links: list[tuple[pb.StageAssignment, CodecChoice, float]],
    ) -> None:
        """Probe each (neighbour, codec choice, pace) whose choice is `auto`, in parallel, and
        give the choice the measured bandwidth. A link that cannot be measured is logged and
        keeps the smallest codec."""

        async def measure(peer: pb.StageAssignment, choice: CodecChoice, pace_bps: float) -> None:
            try:
                estimate = await self._probe_link(
                    peer.address, peer.node_id, epoch=plan.epoch, pace_bps=pace_bps
                )
            except (PeerUnavailable, PeerRefused) as exc:
                log.warning("%s: cannot measure the link (%s); using %s", choice.what, exc,
                            choice.name)  # fmt: skip
                return
            choice.bandwidth_bps = estimate.bandwidth_bps
            choice.peer_unpacks_deflate = peer.unpacks_deflate
            log.info(
                "%s: link to %s measured at %.1f Mbit/s, RTT %.2f ms (%d probe bytes)",
                choice.what,
                peer.node_id,
                estimate.bandwidth_bps / 1e6,
                estimate.rtt_s * 1e3,
                estimate.probe_bytes,
            )

        async with asyncio.TaskGroup() as tg:
            for peer, choice, pace_bps in links:
                if choice.auto:
                    tg.create_task(measure(peer, choice, pace_bps))

    def reached_through(self, address: str, relay_node_id: str) -> None:
        """Before this node has joined: its address for the others is now `address`, a port
        the relay `relay_node_id` opened for it (the coordinator could not reach it)."""
        assert not self._joined.is_set()
        self._address, self.relay_node_id = address, relay_node_id

    # ----- the run ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Join, wait for the plan, train the stage; returns when this stage's run is done.
        Unreachable if the coordinator cannot reach this node at its address (nothing has
        changed then: the daemon may go through a relay and call this again)."""
        if not self.coordinator:
            raise RuntimeError("Worker.run() before the coordinator's address is known")
        async with open_channel(self.coordinator, self._transport):  # answers within the timeout
            stub = self._stub()
            join = pb.JoinRequest(
                node_id=self.node_id,
                address=self._address,
                compute_threads=self._threads,
                protocol=PROTOCOL,
            )
            with coordinator_errors(self.coordinator):
                try:
                    reply = await stub.Join(join, timeout=self._transport.connect_timeout_s)
                except grpc.aio.AioRpcError as exc:
                    if any(k == UNREACHABLE_KEY for k, _ in exc.trailing_metadata() or ()):
                        what = f"coordinator {self.coordinator}: {exc.code().name}: {exc.details()}"
                        raise Unreachable(what) from None
                    raise
            self._lease_s = reply.lease_s or DEFAULT_LEASE_S
            self._model_name = reply.model
            self._joined_epoch = reply.started_epoch
            self._joined.set()  # keep_membership() sends heartbeats from now on
            # Then measure this node for the swarm's model, and tell the coordinator.
            try:
                check_allowed(reply.model, self._model_dirs)
                get_model(reply.model)
            except ConfigError as exc:
                raise PeerRefused(f"coordinator {self.coordinator}: {exc}") from None
            loop = asyncio.get_running_loop()
            caps = await loop.run_in_executor(
                self._compute,
                measure,
                reply.model,
                max(1, reply.microbatch),
                self.compute_scale,
                self.block_delay_s,
            )
            log.info(
                "measured %.1f ms a microbatch for %s over %d blocks; %.1f GiB available",
                sum(caps.block_s) * 1e3,
                reply.model,
                len(caps.block_s),
                caps.memory_bytes / 2**30,
            )
            link = await self._measure_coordinator_link()
            if link is not None:
                caps.uplink_bps, caps.rtt_s = link.bandwidth_bps, link.rtt_s
            caps.relay_node_id = self.relay_node_id
            caps.relay_address = self.relay_address
            caps.peer_links.extend(await self._measure_peers(link))
            if self._resume and self._checkpoints is not None:
                found = await asyncio.to_thread(self._verified_checkpoints, get_model(reply.model))
                caps.checkpoints.extend(m.offer() for m in found[:MAX_OFFERS])
                log.info("--resume: offering checkpoints at steps %s",
                         [m.step for m in found] or "(none)")  # fmt: skip
            self._caps = caps
            join.capabilities.CopyFrom(caps)
            with coordinator_errors(self.coordinator):
                await stub.Join(join, timeout=self._transport.connect_timeout_s)
            async with asyncio.TaskGroup() as tg:
                watcher = tg.create_task(self._watch_plans())
                await self._follow_plans()
                watcher.cancel()

    async def _follow_plans(self) -> None:
        """Train a stage of each plan this node is in, one after another, to the run's end.
        Never a plan that had started before this node joined: a stage for it there was an
        earlier run's of this node (JoinReply.started_epoch)."""
        epoch = self._joined_epoch
        while True:
            plan = await self._next_plan(epoch)
            epoch = plan.epoch
            # A restore (a lost member had no replica) goes back to its checkpoints' step.
            if self._first_plan or plan.restore:
                self._first_plan = False
                await self._checkpoints_for(plan)
            if self._checkpoints is not None:  # a restore planned meanwhile has come (or not)
                self._checkpoints.retention.release(plan.epoch)
            if not has_node(plan.stages, self.node_id):
                log.info("plan epoch %d has no stage for this node; it waits for a later one",
                         plan.epoch)  # fmt: skip
                continue
            if has_node(plan.previous, self.node_id) and plan.start_step != self._held_step:
                raise RunFailed(
                    f"plan epoch {plan.epoch} starts at step {plan.start_step}, but this node's "
                    f"last plan ended at step {self._held_step}"
                )
            try:
                runtime = await self._train(plan)
            except BaseException as exc:
                broke = _peer_fault(exc)
                if broke is None or not await self._after_break(plan, broke):
                    raise
                continue
            if runtime.run_done:
                self.run_finished = True
                await self._notify()  # a leaving node need not wait for a hand-over now
                return
            # Keep this stage's blocks as they are now: the next plan's members fetch them.
            self._held, self._held_step = await runtime.export(), runtime.version
            self._handed = set()
            await self._notify()
            await self._write_checkpoint(self._held_step, self._held, plan)
            log.info("plan epoch %d ended at step %d; waiting for the next plan", plan.epoch,
                     runtime.version)  # fmt: skip

    async def _after_break(self, plan: pb.Plan, error: BaseException) -> bool:
        """A neighbour of this stage broke `plan` (its stream ended, or the coordinator refused
        what the stage reported after counting its pipeline out). With replicas, the
        coordinator plans without the lost member once its lease runs out: wait for that plan
        (True) with this stage's state discarded, as its pipeline's steps from here on are
        dropped. Without replicas, the coordinator restores the run from checkpoints if the
        members left hold them (the plan says `restore`). False (the run fails) when the run is
        over or stopping, or if no newer plan comes within a few leases."""
        if self.stopping:
            return False
        log.warning("plan epoch %d broke: %s; this node waits for the coordinator's plan "
                    "without the lost member", plan.epoch, error)  # fmt: skip
        task = asyncio.create_task(self._suspect(plan, error))
        self._suspecting.add(task)
        task.add_done_callback(self._suspecting.discard)
        # The stage upstream learns it at once (it may be waiting for this stage's gradients),
        # and so on up the pipeline. Blocks kept from the plan before stay: a slow member of
        # this plan may still fetch them.
        session = self._session
        if session is not None and session.runtime.upstream is not None:
            session.runtime.upstream.abort(f"plan epoch {plan.epoch} broke here: {error}")
        self._session = None
        await self._notify()
        try:
            async with asyncio.timeout(BREAK_WAIT_LEASES * self._lease_s
                                       + self._transport.connect_timeout_s):  # fmt: skip
                async with self._changed:
                    await self._changed.wait_for(
                        lambda: (
                            self.stopping
                            or (
                                self.started_plan is not None
                                and self.started_plan.epoch > plan.epoch
                            )
                        )
                    )
        except TimeoutError:
            return False
        return not self.stopping

    async def _suspect(self, plan: pb.Plan, error: BaseException) -> None:
        """Name this stage's neighbours under `plan` to the coordinator (Coordinator.Suspect):
        one that is gone is counted lost at once, not after its lease. Best effort: without an
        answer, the lease rule still finds it."""
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
            async with open_channel(self.coordinator, self._transport) as channel:
                # The coordinator may probe twice, each for up to a lease.
                reply = await pb_grpc.CoordinatorStub(channel).Suspect(
                    request, timeout=self._transport.connect_timeout_s + 2 * self._lease_s
                )
        except (grpc.aio.AioRpcError, PeerError) as exc:
            log.info("could not name the suspects to the coordinator: %s", exc)
            return
        if reply.lost:
            log.info("the coordinator counts %s as lost", ", ".join(reply.lost))

    async def _next_plan(self, after_epoch: int) -> pb.Plan:
        """The newest started plan above `after_epoch`. Waits as long as it takes (a spare
        waits for a plan with room for it); the coordinator's absence is noticed by reports."""

        def arrived() -> bool:
            p = self.started_plan
            return p is not None and p.epoch > after_epoch

        async with self._changed:
            await self._changed.wait_for(lambda: arrived() or self.stopping)
        if self.stopping:
            raise asyncio.CancelledError
        assert self.started_plan is not None
        return self.started_plan

    async def _watch_plans(self) -> None:
        """Keep `latest_plan` up to date from the coordinator's plan stream, opening it again
        whenever it ends (a coordinator restarting), and at once on the new coordinator after
        a failover (`follow`). Only a newer plan replaces the one this node has (a higher
        epoch, or the same epoch no longer pending): an old coordinator that comes back cannot
        impose an older plan."""
        unreachable_since: float | None = None
        while True:
            self._switched.clear()
            address = self.coordinator
            watch = asyncio.create_task(self._watch_plans_from(address))
            switched = asyncio.create_task(self._switched.wait())
            try:
                await asyncio.wait({watch, switched}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                switched.cancel()
                if not watch.done():  # a call to a coordinator left behind ends here
                    watch.cancel()
                    await asyncio.wait({watch}, timeout=REPORT_RETRY_S)
                    if not watch.done():
                        self._left_behind.add(watch)
                        watch.add_done_callback(self._ended_behind)
            if self.coordinator != address:
                unreachable_since = None
                continue
            error = watch.exception() if watch.done() and not watch.cancelled() else None
            if isinstance(error, grpc.aio.AioRpcError):
                log.info("plan stream from %s ended: %s", address, error.code().name)
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    now = asyncio.get_running_loop().time()
                    unreachable_since = unreachable_since or now
                    if now - unreachable_since >= COORDINATOR_LOST_S and not self.coordinator_lost:
                        self.coordinator_lost = True
                        await self._notify()
            elif error is not None:
                raise error
            else:
                unreachable_since = None
            await asyncio.sleep(REPORT_RETRY_S)  # a retry's pause before opening it again

    async def _watch_plans_from(self, address: str) -> None:
        """One plan stream from the coordinator at `address`, until it ends."""
        # Not wait_for_ready: a call waiting for a channel that never comes back cannot
        # always be cancelled (grpc.aio); an unreachable coordinator fails fast here and
        # is tried again after a pause.
        watch = self._stub().WatchPlan(pb.WatchPlanRequest(node_id=self.node_id))
        async for plan in watch:
            if self.coordinator != address:
                return
            self.coordinator_lost = False
            latest = self.latest_plan
            if latest is not None and (plan.epoch, not plan.pending) <= (
                latest.epoch,
                not latest.pending,
            ):
                if plan.epoch < latest.epoch:
                    log.warning("ignoring plan epoch %d: this node has epoch %d",
                                plan.epoch, latest.epoch)  # fmt: skip
                continue
            self.latest_plan = plan
            if not plan.pending:
                self.started_plan = plan
            await self._notify()

    # ----- checkpoints ------------------------------------------------------------------------
    async def _checkpoints_for(self, plan: pb.Plan) -> None:
        """The first plan this node gets, or a plan that restores the run from checkpoints:
        checkpoints newer than its start are set aside (a run that starts there must never
        resume from another timeline; copies of them are removed), and the blocks the plan
        says this node holds at its start are loaded from its checkpoints or copies (verified
        again) to serve. A restore drops what this node trained after that step."""
        step = plan.start_step
        if plan.restore:
            self._held, self._held_step, self._handed = {}, step, set()
        store, copies = self._checkpoints, self._copies
        if store is None or copies is None:
            self._offering = True
            return
        # What this node keeps from before: with --resume or on a restore, its timeline up to
        # the plan's start; otherwise nothing (another run's checkpoints may share this run's
        # key, and must never be offered to a restore).
        keep = step if self._resume or plan.restore else 0
        store.hold = step  # a write of the dropped timeline may land now: it must not prune it
        try:
            await self.flush_checkpoints()  # ... and it lands before the move
            aside, folder = await asyncio.to_thread(store.set_aside_after, keep)
        finally:
            store.hold = None
        if aside:
            log.warning("checkpoints at steps %s are newer than where this run starts (step "
                        "%d): moved to %s", aside, keep, folder)  # fmt: skip
        await asyncio.to_thread(copies.drop_after, keep)
        self.checkpoint_step = max(await asyncio.to_thread(store.steps), default=0)
        self._offering = True
        mine = [h for h in plan.previous if h.node_id == self.node_id]
        if step == 0 or not mine:
            return
        model = get_model(plan.run.model)
        held: dict[int, BlockWeights] = {}
        for h in mine:
            try:
                found, blocks, where = await asyncio.to_thread(
                    self._load_checkpoint, step, h.first_block, h.stop_block, model
                )
            except CheckpointError as exc:
                raise RunFailed(f"cannot start at step {step}: {exc}") from None
            if found.run_key != run_key(plan.run):
                raise RunFailed(f"cannot start at step {step}: the checkpoint of blocks "
                                f"[{h.first_block}, {h.stop_block}) is of another run")  # fmt: skip
            held |= blocks
            log.info("%s at step %d: serving blocks [%d, %d) from %s",
                     "restoring" if plan.restore else "resuming", step, h.first_block,
                     h.stop_block, where)  # fmt: skip
        self._held, self._held_step, self._handed = held, step, set()
        self.checkpoint_step = step
        await self._notify()

    def _load_checkpoint(
        self, step: int, first_block: int, stop_block: int, model: Any
    ) -> tuple[Manifest, dict[int, BlockWeights], Path]:
        """This node's checkpoint, or copy of one, of blocks [first_block, stop_block) at
        `step`, verified, and the folder it is in. Blocking."""
        assert self._checkpoints is not None and self._copies is not None
        refused: list[str] = []
        for store in (self._checkpoints, self._copies.dir(first_block, stop_block)):
            try:
                found = store.manifest(step)
                if (found.first_block, found.stop_block) != (first_block, stop_block):
                    continue
                started = time.monotonic()
                log.info("loading the checkpoint of blocks [%d, %d) at step %d from %s "
                         "(%.1f MB)", first_block, stop_block, step, store.path,
                         found.bytes / 1e6)  # fmt: skip
                loaded = store.load(step, model)
                log.info("checkpoint at step %d loaded and verified in %.1f s", step,
                         time.monotonic() - started)  # fmt: skip
                return (*loaded, store.path)
            except CheckpointError as exc:
                refused.append(str(exc))
        raise CheckpointError(
            f"no checkpoint of blocks [{first_block}, {stop_block}) at step "
            f"{step} loads here" + (f": {refused[-1]}" if refused else "")
        )

    def _verified_checkpoints(self, model: Any) -> list[Manifest]:
        """Every checkpoint and copy here that loads, newest first. Blocking."""
        assert self._checkpoints is not None and self._copies is not None
        found = self._checkpoints.verified(model)
        found += [m for d in self._copies.dirs() for m in d.verified(model)]
        return sorted(found, key=lambda m: m.step, reverse=True)

    def checkpoint_offers(self) -> list[pb.CheckpointOffer]:
        """What this node holds now (its checkpoints and copies of the swarm's model, newest
        first, checked for form), for its heartbeats; none before its first plan. Blocking
        (reads the manifests). A disk that cannot be read keeps the last list."""
        if self._checkpoints is None or self._copies is None or not self._offering:
            return []
        try:
            found = self._checkpoints.manifests() + self._copies.manifests()
        except OSError as exc:  # a copy folder replaced meanwhile, or a failing disk
            log.warning("cannot list this node's checkpoints: %s", exc)
            return self._offers
        model = get_model(self._model_name)
        found = [m for m in found if m.model == model.name and m.stop_block <= model.num_blocks()]
        found.sort(key=lambda m: m.step, reverse=True)
        self._offers = [m.offer() for m in found[:MAX_OFFERS]]
        return self._offers

    async def _write_checkpoint(
        self, step: int, blocks: dict[int, BlockWeights], plan: pb.Plan
    ) -> None:
        """Start writing a checkpoint of `blocks` at `step` in a worker thread, once the one
        before it is written: one write at a time (a slow disk holds the stage up rather than
        piling copies up in memory)."""
        if self._checkpoints is None or step == 0 or not blocks:
            return
        me = next(s for s in plan.stages if s.node_id == self.node_id)
        save = partial(
            self._checkpoints.save,
            blocks,
            step=step,
            run=plan.run,
            pipeline=me.pipeline,
            stage=me.index,
            plan_epoch=plan.epoch,
        )
        async with self._write_lock:
            if self._writing is not None:
                await asyncio.wait([self._writing])  # never cancels the write, even if cancelled
            self._writing = asyncio.ensure_future(asyncio.to_thread(save))
            self._writing.add_done_callback(self._written)

    async def _stage_checkpoint(
        self,
        step: int,
        blocks: dict[int, BlockWeights],
        *,
        plan: pb.Plan,
        me: pb.StageAssignment,
    ) -> None:
        """The stage's periodic checkpoint (and its run-end one): write it, and copy the
        upstream stage's checkpoint of that step if no replica holds that stage."""
        await self._write_checkpoint(step, blocks, plan)
        stages = len(plan.stages) // max(1, plan.run.pipelines)
        if self._copies is None or plan.run.pipelines > 1 or stages < 2:
            return
        if step >= plan.run.steps:  # the run's end: nothing left to restore
            return
        if self._copying is not None and not self._copying.done():
            log.info("checkpoint copy of step %d skipped: the one before is still coming", step)
            return
        source = stage_at(plan, me.pipeline, (me.index - 1) % stages)
        assert source is not None
        self._copying = asyncio.create_task(self._copy_checkpoint(plan, source, step))

    async def _copy_checkpoint(self, plan: pb.Plan, source: pb.StageAssignment, step: int) -> None:
        """Fetch `source`'s checkpoint at `step` and keep it (CheckpointCopies): checked
        against what `source` trains under `plan`, its size bound and its sha256. A failure is
        logged; the next copy is tried at the next checkpoint."""
        assert self._copies is not None
        generation = self._copies.generation
        where = f"{source.node_id} ({source.address})"
        model = get_model(plan.run.model)
        bound = bytes_bound(model, source.first_block, source.stop_block)
        manifest: Manifest | None = None
        parts: list[bytes] = []
        size = 0
        limit = self._transport.connect_timeout_s
        # All of it within the connect timeout plus what it takes at COPY_MIN_BPS: a peer that
        # trickles cannot hold the copies up for ever.
        whole = 3 * self._transport.connect_timeout_s + bound * 8 / COPY_MIN_BPS
        try:
            channel_cm = open_channel(source.address, self._transport)
            async with asyncio.timeout(whole), channel_cm as channel:
                call = pb_grpc.NodeStub(channel).FetchCheckpoint(
                    pb.CheckpointRequest(node_id=self.node_id, plan_epoch=plan.epoch, step=step)
                )
                try:
                    while True:
                        # The source may still be writing it: the first chunk may take longer.
                        limit = self._transport.connect_timeout_s * (3 if manifest is None else 1)
                        async with asyncio.timeout(limit):
                            chunk = await call.read()
                        if chunk is grpc.aio.EOF:
                            break
                        if manifest is None:
                            manifest = parse_manifest(chunk.manifest, step, f"copy from {where}")
                            expected = (model.name, source.first_block, source.stop_block,
                                        run_key(plan.run))  # fmt: skip
                            got = (manifest.model, manifest.first_block, manifest.stop_block,
                                   manifest.run_key)  # fmt: skip
                            if got != expected:
                                raise CheckpointError(f"copy from {where}: it is of {got}, "
                                                      f"not {expected}")  # fmt: skip
                            if manifest.bytes > bound:
                                raise CheckpointError(
                                    f"copy from {where}: {manifest.bytes} bytes, at most "
                                    f"{bound} expected"
                                )
                        elif chunk.manifest:
                            raise CheckpointError(f"copy from {where}: a second manifest")
                        if (not chunk.data or chunk.offset != size
                                or size + len(chunk.data) > manifest.bytes):  # fmt: skip
                            raise CheckpointError(f"copy from {where}: a chunk at {chunk.offset} "
                                                  f"of {len(chunk.data)} bytes does not follow "
                                                  f"{size} of {manifest.bytes}")  # fmt: skip
                        parts.append(chunk.data)
                        size += len(chunk.data)
                finally:
                    call.cancel()
            if manifest is None:
                raise CheckpointError(f"copy from {where}: no manifest came")
            await asyncio.to_thread(
                self._copies.store, manifest, b"".join(parts), generation, model
            )
        except (CheckpointError, OSError) as exc:
            log.warning("checkpoint copy of step %d not kept: %s", step, exc)
            return
        except TimeoutError:
            log.warning("checkpoint copy of step %d from %s: too slow (each chunk must come "
                        "within %g s, all of it within %.0f s)", step, where, limit,
                        whole)  # fmt: skip
            return
        except PeerError as exc:
            log.warning("checkpoint copy of step %d from %s: %s", step, where, exc)
            return
        except grpc.aio.AioRpcError as exc:
            self._reraise_cancel(exc)
            log.warning("checkpoint copy of step %d from %s: %s: %s", step, where,
                        exc.code().name, exc.details())  # fmt: skip
            return
        log.info("kept a copy of %s's checkpoint of blocks [%d, %d) at step %d (%.1f MB)",
                 source.node_id, manifest.first_block, manifest.stop_block, step,
                 manifest.bytes / 1e6)  # fmt: skip

    async def fetch_checkpoint(
        self, request: pb.CheckpointRequest
    ) -> AsyncIterator[pb.CheckpointChunk]:
        """Node.FetchCheckpoint: a member of this node's plan copies its checkpoint at
        `request.step`, waited for (within twice the connect timeout) if it is being written;
        Refusal (before any chunk) otherwise."""
        store = self._checkpoints
        if store is None:
            raise Refusal(grpc.StatusCode.NOT_FOUND, "this node keeps no checkpoints")
        plan = self.plan
        if plan is None or plan.epoch != request.plan_epoch:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node does not train under plan epoch {request.plan_epoch}",
            )
        if request.node_id != self._copier(plan):
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer {request.node_id[:80]!r} does not keep this node's checkpoint copies "
                f"under plan epoch {plan.epoch}",
            )
        if request.node_id in self._serving_copy:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "a copy to this peer is under way")
        await self._wait(
            lambda: self.checkpoint_step >= request.step,
            f"no checkpoint at step {request.step} yet",
            timeout_s=2 * self._transport.connect_timeout_s,
        )
        self._serving_copy.add(request.node_id)
        try:
            try:
                manifest = await asyncio.to_thread(store.manifest, request.step)
                f = await asyncio.to_thread(store.open_tensors, manifest)
            except CheckpointError as exc:
                raise Refusal(grpc.StatusCode.NOT_FOUND, str(exc)) from None
            with f:  # read as it goes: a stage's checkpoint is never all in memory here
                chunk_bytes = min(CHUNK_BYTES, self._transport.max_message_bytes // 2)
                offset = 0
                head = json.dumps(asdict(manifest)).encode()
                while data := await asyncio.to_thread(f.read, chunk_bytes):
                    yield pb.CheckpointChunk(manifest=head, offset=offset, data=data)
                    head, offset = b"", offset + len(data)
        finally:
            self._serving_copy.discard(request.node_id)

    def _copier(self, plan: pb.Plan) -> str:
        """The node that keeps copies of this node's checkpoints under `plan`: the next stage's
        (the first stage's for the last), with one pipeline and two stages or more; "" if
        none."""
        stages = len(plan.stages) // max(1, plan.run.pipelines)
        me = next((s for s in plan.stages if s.node_id == self.node_id), None)
        if me is None or plan.run.pipelines > 1 or stages < 2:
            return ""
        copier = stage_at(plan, me.pipeline, (me.index + 1) % stages)
        return "" if copier is None else copier.node_id

    def _written(self, task: asyncio.Task[Manifest]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:  # a full disk: say so loudly, train on
            log.error("checkpoint not written: %s", exc)
            return
        manifest = task.result()
        self.checkpoint_step = max(self.checkpoint_step, manifest.step)
        # A copy may be waiting for it (FetchCheckpoint).
        self._notifying = asyncio.ensure_future(self._notify())
        log.info("checkpoint of blocks [%d, %d) at step %d written (%.1f MB)",
                 manifest.first_block, manifest.stop_block, manifest.step,
                 manifest.bytes / 1e6)  # fmt: skip

    async def flush_checkpoints(self) -> None:
        """Wait until every checkpoint started so far is on disk."""
        async with self._write_lock:  # a write being started is started
            task = self._writing
        if task is not None:
            await asyncio.wait([task])  # never cancels the write, even if this wait is

    async def checkpoint_on_stop(self, drain_s: float, pause_s: float) -> None:
        """The node stops: checkpoint its stage, and wait for every write.

        Where it can, the stage first ends its plan at a step boundary, as for a new plan (for
        up to `drain_s`): a first stage feeds no new step and trains what it fed; a stage
        behind it does the same and ends when its upstream stream ends cleanly there. Stopped
        together, a pipeline's stages so checkpoint one step, the step a resumed run starts
        at. A stage that cannot get there in time (a neighbour gone) is checkpointed where it
        is, if its loop pauses within `pause_s`."""
        session, plan = self._session, self.plan
        if session is not None and plan is not None and self._checkpoints is not None:
            runtime = session.runtime
            if not runtime.done:
                if runtime.spec.is_first:
                    with contextlib.suppress(ValueError):
                        runtime.stop_at(runtime.drain_step())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(drain_s):
                        await runtime.ended.wait()
            blocks: dict[int, BlockWeights] = {}
            if runtime.ended.is_set():
                blocks = await runtime.export()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause_s):
                        blocks = await runtime.snapshot()
            if blocks:
                await self._write_checkpoint(next(iter(blocks.values())).version, blocks, plan)
            else:
                log.warning("stage %d did not pause: no checkpoint at its last step (the "
                            "newest is at step %d)", runtime.spec.index,
                            self.checkpoint_step)  # fmt: skip
        await self.flush_checkpoints()

    async def fetch_block(self, request: pb.BlockRequest) -> AsyncIterator[pb.BlockChunk]:
        """Node.FetchBlock: a member of plan `request.plan_epoch` asks for a block this node
        kept when its last plan ended; its chunks. Waits (within the connect timeout) for that
        plan and for this node's previous plan to end; Refusal otherwise (before any chunk)."""
        await self._wait(
            lambda: self.started_plan is not None
            and self.started_plan.epoch >= request.plan_epoch,
            f"this node has not seen plan epoch {request.plan_epoch}",
        )  # fmt: skip
        plan = self.started_plan
        assert plan is not None
        if plan.epoch != request.plan_epoch:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"plan epoch {request.plan_epoch} is not the current one ({plan.epoch})",
            )
        if not has_node(plan.stages, request.node_id):
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"unknown peer {request.node_id[:80]!r}: not a member of plan epoch {plan.epoch}",
            )
        if not any(s.node_id == self.node_id and s.first_block <= request.block < s.stop_block
                   for s in plan.previous):  # fmt: skip
            raise Refusal(
                grpc.StatusCode.NOT_FOUND, f"this node did not hold block {request.block}"
            )
        await self._wait(
            lambda: self._held_step == plan.start_step and request.block in self._held,
            f"block {request.block} is not ready yet (its plan has not ended here)",
            timeout_s=2 * self._transport.connect_timeout_s,  # a pipeline may be catching up
        )
        # A chunk well within the message limit both ends have (its header included).
        chunk_bytes = min(CHUNK_BYTES, self._transport.max_message_bytes // 2)
        chunks = to_chunks(self._held[request.block], chunk_bytes)
        done = object()
        while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
            assert isinstance(chunk, pb.BlockChunk)
            yield chunk
        if self._held_step == plan.start_step:
            self._handed.add(request.block)
            await self._notify()

    @property
    def holds_stage(self) -> bool:
        """This node trains a stage whose run is not over."""
        session = self._session
        return session is not None and not session.runtime.run_done

    async def leave(self) -> bool:
        """Tell the coordinator this node is leaving; True if it should stay until a plan
        without it has taken its blocks over (`handed_over`)."""
        async with open_channel(self.coordinator, self._transport) as channel:
            with coordinator_errors(self.coordinator):
                reply = await pb_grpc.CoordinatorStub(channel).Leave(
                    pb.LeaveRequest(node_id=self.node_id),
                    timeout=self._transport.connect_timeout_s,
                )
        return bool(reply.hand_off)

    async def handed_over(self) -> bool:
        """Wait until a plan without this node has started and its members have fetched every
        block this node held when its last plan ended (True), or until the coordinator's plan
        stream is lost (False): then nobody will take the blocks over, and the node stops with
        them checkpointed."""

        def done() -> bool:
            if self._session is not None and self._session.runtime.run_done:
                return True  # the run ended before a plan without this node started
            if self.coordinator_lost:
                return True
            plan = self.started_plan
            return (
                plan is not None
                and not has_node(plan.stages, self.node_id)
                and self._held_step == plan.start_step
                and set(self._held) <= self._handed
            )

        async with self._changed:
            await self._changed.wait_for(done)
        return not self.coordinator_lost

    async def _gather_blocks(
        self, plan: pb.Plan, me: pb.StageAssignment, blocks: list[torch.nn.Module]
    ) -> dict[int, BlockWeights]:
        """The state of each block of this node's new stage at the plan's start: kept here, or
        fetched (in parallel) from the node that held it under the previous plan."""
        if plan.start_step == 0:
            return {}
        # Blocks kept here count only if this node trained them under the previous plan (then
        # up to this plan's start: _follow_plans checked that).
        trained = has_node(plan.previous, self.node_id)
        kept = {
            b: w for b, w in self._held.items()
            if trained and me.first_block <= b < me.stop_block
        }  # fmt: skip
        wanted = [b for b in range(me.first_block, me.stop_block) if b not in kept]

        def sources(block: int) -> list[pb.StageAssignment]:
            """Who held `block`: first the holder of this node's pipeline, then replicas."""
            holders = [s for s in plan.previous if s.first_block <= block < s.stop_block]
            if not holders:
                raise RunFailed(f"plan epoch {plan.epoch}: nobody held block {block} before")
            return sorted(holders, key=lambda s: s.pipeline != me.pipeline)

        at_once: dict[str, asyncio.Semaphore] = {}
        """Per holder: fetches from one holder at once, FETCH_AT_ONCE at most."""

        async def fetch(block: int) -> BlockWeights:
            """The block from its first holder that gives it whole (a holder may be gone)."""
            failed: PeerUnavailable | PeerRefused | None = None
            for holder in sources(block):
                try:
                    limit = at_once.setdefault(holder.address, asyncio.Semaphore(FETCH_AT_ONCE))
                    async with limit:
                        return await fetch_from(block, holder)
                except (PeerUnavailable, PeerRefused) as exc:
                    if failed is not None or len(sources(block)) > 1:
                        log.warning("%s; trying another holder", exc)
                    failed = exc
            assert failed is not None
            raise failed

        async def fetch_from(block: int, holder: pb.StageAssignment) -> BlockWeights:
            where = f"{holder.node_id} ({holder.address})"
            assembler = BlockAssembler(
                block=blocks[block - me.first_block], index=block, version=plan.start_step,
                source=where,
            )  # fmt: skip
            async with open_channel(holder.address, self._transport) as channel:
                stub = pb_grpc.NodeStub(channel)
                request = pb.BlockRequest(node_id=self.node_id, plan_epoch=plan.epoch, block=block)
                call = stub.FetchBlock(request)
                # No deadline for the whole block (a big one over a slow link takes minutes);
                # the holder may take a while to have it (its pipeline catching up), then each
                # chunk must follow the one before within the connect timeout.
                first = True
                shown = time.monotonic()
                try:
                    while True:
                        limit = self._transport.connect_timeout_s * (3 if first else 1)
                        async with asyncio.timeout(limit):
                            chunk = await call.read()
                        if chunk is grpc.aio.EOF:
                            break
                        assembler.add(chunk)
                        first = False
                        if time.monotonic() - shown >= PROGRESS_EVERY_S:  # a big block, slowly
                            shown = time.monotonic()
                            done, total = assembler.progress
                            log.info("fetching block %d from %s: %.0f%% (%.1f of %.1f MB)",
                                     block, where, 100 * done / total, done / 1e6,
                                     total / 1e6)  # fmt: skip
                except TimeoutError:
                    raise PeerUnavailable(f"block {block} from {where}: no chunk for "
                                          f"{limit:g} s") from None  # fmt: skip
                except grpc.aio.AioRpcError as exc:
                    raise PeerUnavailable(
                        f"block {block} from {where}: {exc.code().name}: {exc.details()}"
                    ) from None
                finally:
                    call.cancel()
            return assembler.finish()

        async with asyncio.TaskGroup() as tg:
            tasks = {b: tg.create_task(fetch(b)) for b in wanted}
        log.info("plan epoch %d: blocks %s kept, %s fetched", plan.epoch, sorted(kept),
                 sorted(wanted))  # fmt: skip
        return kept | {b: t.result() for b, t in tasks.items()}

    async def _call_coordinator(
        self,
        call: Callable[[float], Awaitable[T]],
        what: str = "reports wait",
        grace_s: float | None = None,
    ) -> T:
        """Make one call to the coordinator (`call(timeout_s)`). While the coordinator does
        not answer (a lab coordinator being restarted) the stage trains on and the call is
        tried again every REPORT_RETRY_S, for up to `coordinator_grace_s` in all; then
        PeerUnavailable. A coordinator that answers but refuses raises PeerRefused at once.
        No wait_for_ready: a call queued for a channel that never comes back cannot always be
        cancelled (grpc.aio), and the node's stop must not wait for it."""
        loop = asyncio.get_running_loop()
        grace_s = self._coordinator_grace_s if grace_s is None else grace_s
        deadline = loop.time() + grace_s
        lost_at: float | None = None
        while True:
            attempt = loop.time()
            timeout_s = max(0.1, min(self._transport.connect_timeout_s, deadline - attempt))
            try:
                with coordinator_errors(self.coordinator):
                    result = await call(timeout_s)
            except PeerUnavailable as exc:
                self._reraise_cancel(exc)
                if loop.time() >= deadline:
                    raise PeerUnavailable(f"{exc} (no answer for {grace_s:g} s)") from None
                if lost_at is None:
                    lost_at = attempt
                    log.warning("%s; training on, %s for it", exc, what)
                if loop.time() - attempt < REPORT_RETRY_S:  # refused at once: not a busy loop
                    await asyncio.sleep(REPORT_RETRY_S)  # a retry's pause, not a wait for an event
                continue
            if lost_at is not None:
                log.info("coordinator %s answers again after %.1f s", self.coordinator,
                         loop.time() - lost_at)  # fmt: skip
            return result

    async def keep_membership(self) -> None:
        """Heartbeats to the coordinator once this node has joined, for as long as the node
        runs; when cancelled (the node stops), a last `Leave`. A missed heartbeat is logged
        and the next one tried: the coordinator forgives two."""
        await self._joined.wait()
        interval = heartbeat_interval(self._lease_s)
        loop = asyncio.get_running_loop()
        rtt_s, at_once = 0.0, False
        # No wait for a channel to be ready: a stop at any moment from here must still leave.
        try:
            while True:
                if not at_once:
                    await asyncio.sleep(interval)  # the heartbeat's period, not a wait for an event
                at_once = False
                coordinator = self.coordinator  # a failover may move it
                try:
                    held = self._checkpoints.retention.held_epoch if self._checkpoints else 0
                    offers = await asyncio.to_thread(self.checkpoint_offers)  # after `held`
                    sent = loop.time()
                    beat = pb.HeartbeatRequest(node_id=self.node_id, rtt_s=rtt_s, held_epoch=held)
                    beat.checkpoints.extend(offers)
                    rtt_s = 0.0  # a heartbeat that fails measures nothing
                    reply = await self._stub().Heartbeat(beat, timeout=interval)
                    rtt_s = loop.time() - sent
                    # The coordinator waits for this node's held offers to restore: at once.
                    at_once = await self._hold_checkpoints(reply.hold_epoch)
                    if coordinator == self.coordinator:
                        self._heartbeats_failing_since = None
                except grpc.aio.AioRpcError as exc:
                    log.warning(
                        "heartbeat to coordinator %s failed: %s", coordinator, exc.code().name
                    )
                    if coordinator != self.coordinator:  # a failover moved it meanwhile
                        continue
                    if self._heartbeats_failing_since is None:
                        self._heartbeats_failing_since = sent
                    silent_s = loop.time() - self._heartbeats_failing_since
                    if silent_s >= LOST_AFTER_LEASES * self._lease_s and not self.coordinator_lost:
                        log.warning("coordinator %s has not answered a heartbeat for %.1f s: "
                                    "counted lost", coordinator, silent_s)  # fmt: skip
                        self.coordinator_lost = True
                        await self._notify()
        except asyncio.CancelledError:
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await self._stub().Leave(
                    pb.LeaveRequest(node_id=self.node_id), timeout=LEAVE_TIMEOUT_S
                )
            raise

    async def _hold_checkpoints(self, epoch: int) -> bool:
        """The coordinator plans a restore from the broken plan `epoch`: keep every checkpoint
        and copy this node has until a newer plan comes (checkpoint.Retention). True if this
        hold is new (the next heartbeat says it holds them)."""
        latest = self.latest_plan
        if self._checkpoints is None or epoch == 0 or (latest and latest.epoch > epoch):
            return False
        if not await asyncio.to_thread(self._checkpoints.retention.hold, epoch):
            return False
        log.info("a restore is being planned: this node keeps its checkpoints until a plan "
                 "newer than epoch %d", epoch)  # fmt: skip
        return True

    def _averaging(
        self,
        plan: pb.Plan,
        me: pb.StageAssignment,
        run: TrainConfig,
        blocks: list[torch.nn.Module],
    ) -> Averaging | None:
        """This stage's replica group, attached to the node's Push service; None with one
        pipeline or nothing that trains."""
        group = replica_group(plan, me)
        if len(group) < 2:
            return None
        if self._averaging_service is None:
            raise RunFailed("this node cannot serve replica averaging")
        config = AveragingConfig(
            every_steps=run.average_every,
            outer_lr=run.outer_lr,
            momentum=run.outer_momentum,
            codec=run.average_codec,
            timeout_s=run.average_timeout_s,
        )
        # The stage's parameters in the order its delta concatenates them (stage.py).
        params = list(torch.nn.Sequential(*blocks).parameters())
        if not params:  # frozen blocks only (LoRA's embeddings): nothing to average
            return None
        try:
            averager = ReplicaAverager(
                node_id=self.node_id,
                members=[Member(node_id=s.node_id, address=s.address) for s in group],
                config=config,
                numel=sum(p.numel() for p in params),
                max_message_bytes=self._transport.max_message_bytes,
                counters=self.counters,
                layout=[tuple(p.shape) for p in params],
                transport=self._transport,
                bans=self._averaging_service.bans,
                fault_push_scale=POISON_SCALE if run.fault_poison_pipeline == me.pipeline else 1.0,
            )
        except ConfigError as exc:
            raise RunFailed(f"cannot average stage {me.index}: {exc}") from None
        self._averaging_service.attach(averager)
        log.info(
            "stage %d averages with %d replicas every %d steps (%s, %s)",
            me.index,
            len(group) - 1,
            config.every_steps,
            averager.topology,
            config.codec,
        )
        return Averaging(config=config, averager=averager)

    async def _train(self, plan: pb.Plan) -> StageRuntime:
        """Train this node's stage of `plan` until the plan or the run ends."""
        try:
            check_allowed(plan.run.model, self._model_dirs)
            run = TrainConfig.from_proto(plan.run)
            model = get_model(run.model)
            me = check_plan(plan, model, self.node_id)
            check_frame_limit(run, self._transport.max_message_bytes)
        except ConfigError as exc:
            raise RunFailed(f"cannot follow plan epoch {plan.epoch}: {exc}") from None
        spec = StageSpec(
            index=me.index,
            num_stages=len(plan.stages) // run.pipelines,
            first_block=me.first_block,
            stop_block=me.stop_block,
            pipeline=me.pipeline,
            num_pipelines=run.pipelines,
        )
        reports: asyncio.Queue[StepReport | None] = asyncio.Queue()  # None: the plan ended

        async def report(r: StepReport) -> None:
            reports.put_nowait(r)

        blocks = await asyncio.get_running_loop().run_in_executor(
            self._compute, model.build_stage, run.seed, spec.first_block, spec.stop_block
        )
        try:
            restore = await self._gather_blocks(plan, me, blocks)
        except* (PeerUnavailable, PeerRefused) as group:
            # A holder lost meanwhile: a peer fault, so the node waits for the coordinator's
            # plan without it (_after_break) rather than failing.
            first = group.exceptions[0]
            fault = PeerRefused if isinstance(first, PeerRefused) else PeerUnavailable
            raise fault(f"plan epoch {plan.epoch}: cannot gather its blocks: {first}") from None
        averaging = self._averaging(plan, me, run, blocks)
        build = partial(
            StageRuntime,
            spec=spec,
            model=model,
            blocks=blocks,
            run=run,
            compute=self._compute,
            report=report,
            averaging=averaging,
            start_step=plan.start_step,
            restore=restore,
            block_delay_s=self.block_delay_s,
            checkpoint=partial(self._stage_checkpoint, plan=plan, me=me),
        )
        try:
            runtime = await asyncio.get_running_loop().run_in_executor(self._compute, build)
        except ValueError as exc:  # a start step outside the run
            raise RunFailed(f"cannot follow plan epoch {plan.epoch}: {exc}") from None
        if spec.is_first and runtime.data_fingerprint != plan.run.data_fingerprint:
            raise RunFailed(
                "this node's training data differs from the coordinator's "
                f"({runtime.data_fingerprint} vs {plan.run.data_fingerprint}): "
                "use the same Python version on every node"
            )
        downstream = stage_at(plan, me.pipeline, me.index + 1)
        upstream = stage_at(plan, me.pipeline, me.index - 1)
        upstream_id = "" if upstream is None else upstream.node_id
        loop = asyncio.get_running_loop()
        self.plan = plan
        self._session = session = _Session(
            runtime,
            upstream_id,
            loop.create_future(),
            downstream_node_id="" if downstream is None else downstream.node_id,
            opens_upstream=upstream is not None and dials_back(upstream, me),
            downstream_opens=downstream is not None and dials_back(me, downstream),
        )
        await self._notify()
        log.info(
            "plan epoch %d: stage %d of %d, blocks [%d, %d) of %s, from step %d",
            plan.epoch,
            spec.index,
            spec.num_stages,
            spec.first_block,
            spec.stop_block,
            run.model,
            plan.start_step,
        )

        async def send_reports() -> None:
            while True:
                r = await reports.get()
                if r is None:
                    return
                if r.done:  # the run's last checkpoint counts in the final report
                    await self.flush_checkpoints()
                report = pb.StageReport(
                    node_id=self.node_id,
                    stage=spec.index,
                    pipeline=spec.pipeline,
                    plan_epoch=plan.epoch,
                    step=r.step,
                    loss=r.loss,
                    bytes_sent=self.counters.total_bytes,
                    done=r.done,
                    params_sq_sum=r.params_sq_sum,
                    num_params=r.num_params,
                    compute_s=r.metrics.compute_s,
                    activation_bytes_sent=r.metrics.activation_bytes_sent,
                    gradient_bytes_sent=r.metrics.gradient_bytes_sent,
                    wall_s=r.metrics.wall_s,
                    idle_upstream_s=r.metrics.idle_upstream_s,
                    idle_downstream_s=r.metrics.idle_downstream_s,
                    staleness=r.metrics.staleness,
                    max_in_flight=r.metrics.max_in_flight,
                    max_weight_versions=r.metrics.max_weight_versions,
                    averaging_rounds=r.metrics.averaging_rounds,
                    averaging_rounds_incomplete=r.metrics.averaging_rounds_incomplete,
                    averaging_bytes_sent=r.metrics.averaging_bytes_sent,
                    averaging_wait_s=r.metrics.averaging_wait_s,
                    activation_codec=r.metrics.activation_codec,
                    gradient_codec=r.metrics.gradient_codec,
                    activation_codec_frames=r.metrics.activation_codec_frames,
                    gradient_codec_frames=r.metrics.gradient_codec_frames,
                    activation_deflated_frames=r.metrics.activation_deflated_frames,
                    gradient_deflated_frames=r.metrics.gradient_deflated_frames,
                    downstream_bandwidth_bps=r.metrics.downstream_bandwidth_bps,
                    upstream_bandwidth_bps=r.metrics.upstream_bandwidth_bps,
                    checkpoint_step=self.checkpoint_step,
                )
                await self._call_coordinator(partial(self._send_report, report))
                if r.done:
                    return

        async def watch_upstream() -> None:
            await session.upstream_failed  # raises PeerUnavailable if the stream breaks

        async def drain_when_replanned() -> None:
            """First stage: when a newer plan is announced, stop feeding and agree with the
            coordinator on the step this plan ends at."""
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self.latest_plan is not None and self.latest_plan.epoch > plan.epoch
                )
            stop = runtime.drain_step()
            log.info("a newer plan is coming: stage feeds no step from %d on", stop)
            request = pb.DrainRequest(
                node_id=self.node_id, plan_epoch=plan.epoch, pipeline=me.pipeline, stop_step=stop
            )
            reply = await self._call_coordinator(
                lambda t: self._stub().Drain(request, timeout=t), "the drain waits"
            )
            try:
                runtime.stop_at(reply.stop_step)
            except ValueError as exc:
                raise RunFailed(f"plan epoch {plan.epoch}: {exc}") from None
            log.info("plan epoch %d ends at step %d", plan.epoch, reply.stop_step)

        async def run_stage() -> None:
            await runtime.run()
            reports.put_nowait(None)

        # `auto` codecs: measure the links this stage sends on before its first frame. Not to
        # a neighbour behind NAT when this node is not: that neighbour opens their stream,
        # straight to this node, while probes would go through its relay (the codec keeps the
        # smallest, as for a link that cannot be measured).
        def probed(peer: pb.StageAssignment | None) -> pb.StageAssignment | None:
            return None if peer is None or (peer.relayed and not me.relayed) else peer

        neighbours = [
            (probed(downstream), runtime.activation_codec, run.link_pace_bps(spec.index)),
            (probed(upstream), runtime.gradient_codec, run.link_pace_bps(spec.index - 1)),
        ]
        await self._measure_links(
            plan, [(p, c, pace) for p, c, pace in neighbours if p is not None]
        )

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(send_reports())
                upstream_watch = tg.create_task(watch_upstream())
                drain = tg.create_task(drain_when_replanned()) if spec.is_first else None
                if upstream is not None and session.opens_upstream:
                    dial = asyncio.create_task(self._dial_upstream(plan, upstream))
                    self._dialing.add(dial)
                    dial.add_done_callback(self._dialing.discard)
                if downstream is not None:
                    link = BoundaryLink(
                        downstream.node_id,
                        self.counters,
                        runtime.window,
                        pace_bps=run.link_pace_bps(spec.index),
                    )
                    runtime.downstream = link
                if downstream is not None and session.downstream_opens:
                    tg.create_task(run_stage())
                    await self._await_dial_in(link, runtime.accept_from_downstream)
                elif downstream is not None:
                    async with open_channel(downstream.address, self._transport) as channel:
                        tg.create_task(run_stage())
                        await run_client_stream(
                            channel,
                            link,
                            node_id=self.node_id,
                            epoch=plan.epoch,
                            limits=self.limits,
                            accept=runtime.accept_from_downstream,
                            on_refused=self.on_refused,
                        )
                else:
                    await run_stage()
                upstream_watch.cancel()
                if drain is not None:  # the run ended before a newer plan came
                    drain.cancel()
        finally:
            if averaging is not None:  # also when a neighbour broke the plan
                assert self._averaging_service is not None
                self._averaging_service.attach(None)
                await averaging.averager.close()
        log.info("stage %d is at step %d", spec.index, runtime.version)
        return runtime
