"""The server half of a stage's boundary streams, and who may probe this node.

A stage's upstream stream is opened by the previous stage (`open_session`, called by the node's
gRPC server), or, when this node is behind NAT and its upstream's is not, by this node itself
(`dial_upstream`, BoundaryBack). Likewise a downstream stage behind NAT opens this stage's
downstream stream (`dial_in`), which the stage waits for (`await_dial_in`). Either way the
stream attaches to the session of the plan this node trains now (`Session`), and only the
plan's neighbours may attach. A neighbour may have the plan a moment before this node: a call
waits for it, within the connect timeout.

A `Boundary` stream that breaks on the network is opened again by the upstream stage while
the plan holds (training.py, transport/resume.py): its link stays the session's, and a resumed
call takes it over. Meanwhile this side watches (`_watch_upstream`): the plan breaks here as
before if the upstream's address refuses connections (its process is gone) or a newer plan has
started without the stream coming back (the coordinator counted a member lost).

Link probes are admitted here too (`admit_probe`): under a plan, from the stage's neighbours
within PROBE_BUDGET_BYTES each; under epoch 0 (before a plan, or a newcomer measuring its
links), from members measuring their links as the coordinator lists them (`MemberProbes`).

The first opening of the upstream stream under a plan waits (for up to QUIET_WAIT_S) until the
measurements of this node's links have ended: its own (`Session.links_measured`) and those of
the neighbours that probe it (`Session.probers`, each ended by its DONE probe). Frames would
otherwise share the links with the probes: on the bench's mobile link the first stage, its
measurement done, sent its first step's frames into the middle node while the last stage still
measured its link to it, which then read 0.2 and 1.3 Mbit/s of 2 (docs/benchmarks.md, "Where
the time of a slow link's run goes"). The upstream stage writes nothing before this side
answers the opening (transport/boundary.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from ravnest_node.daemon.worker.changes import Changes
from ravnest_node.daemon.worker.tasks import Tasks
from ravnest_node.errors import FrameError, PeerError, PeerUnavailable
from ravnest_node.pipeline.stage import StageRuntime
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import MAX_EPOCH_AHEAD
from ravnest_node.state import valid_node_id
from ravnest_node.transport.boundary import (
    Accept,
    BoundaryLink,
    LinkAborted,
    LinkCounters,
    run_back_stream,
)
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.frames import FrameLimits
from ravnest_node.transport.options import TransportConfig, open_channel, refuses_connections
from ravnest_node.transport.probe import MIN_PROBE_COST, PROBE_BUDGET_BYTES, ProbeTurns
from ravnest_node.transport.resume import ResumeState

__all__ = ["Coordinator", "DialIn", "MemberProbes", "Session", "Sessions"]

log = logging.getLogger(__name__)

# A probe under epoch 0 from an id this node does not know as measuring asks the coordinator
# for its members at most this often, and what it said holds this long.
MEMBERS_ASK_S = 0.5
MEMBERS_KEEP_S = 10.0
# Seconds the streams this node opened itself get to end when the node closes.
CLOSE_WAIT_S = 0.5
# While a broken upstream stream is not resumed: how often this side looks again whether the
# upstream's address refuses connections.
WATCH_S = 0.5
QUIET_WAIT_S = 15.0
"""The longest the upstream stream's opening waits for the measurements of this node's links
to end (`Session.quiet`): a prober whose measurement failed sends no DONE probe."""


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a future's exception as seen (nobody waits for it any more)."""
    if not future.cancelled():
        future.exception()


class Coordinator(Protocol):
    """What sessions learn from the coordinator (the coordinator client)."""

    @property
    def address(self) -> str:
        """The coordinator's address; "" while it is not known."""
        ...

    @property
    def latest_plan(self) -> pb.Plan | None:
        """The newest plan it announced."""
        ...

    @property
    def started_plan(self) -> pb.Plan | None:
        """The newest plan that has started."""
        ...

    async def swarm(self) -> pb.SwarmView:
        """Its members now; PeerUnavailable / PeerRefused if it cannot say."""
        ...


@dataclass(slots=True)
class DialIn:
    """The downstream stream a stage waits for its downstream stage to open (BoundaryBack)."""

    link: BoundaryLink
    accept: Accept
    ended: asyncio.Future[None]
    """How the stream ended (an exception: broken)."""
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the downstream has opened it (only once)."""


@dataclass(slots=True)
class Session:
    """This node's stage of the plan it trains now, as its neighbours see it."""

    runtime: StageRuntime
    upstream_node_id: str
    upstream_failed: asyncio.Future[None]
    """Fails (PeerUnavailable) when the upstream stream ends before the run does."""
    downstream_node_id: str = ""
    upstream_address: str = ""
    """Where the upstream stage's node listens ("" if it is reached through a relay)."""
    probe_bytes: dict[str, int] = field(default_factory=dict)
    """Probe bytes received per neighbour under this plan (bounded by PROBE_BUDGET_BYTES)."""
    probe_turns: ProbeTurns = field(default_factory=ProbeTurns)
    """One neighbour measures its link to this node at a time: two at once would share this
    node's downlink, and each would read a part of it."""
    opens_upstream: bool = False
    """This stage opens its upstream stream itself (BoundaryBack: this node is behind NAT and
    its upstream's is not); a forward Boundary from upstream is refused."""
    downstream_opens: bool = False
    """Its downstream stage opens their stream (BoundaryBack); this stage waits for it."""
    dial_in: DialIn | None = None
    """That stream, once this stage waits for it (`Sessions.await_dial_in`)."""
    probers: frozenset[str] = frozenset()
    """The neighbours that measure their link to this node under this plan (the codec they
    send to it with is `auto`): the upstream stream waits for their measurements' ends."""
    probes_ended: set[str] = field(default_factory=set)
    """Those of `probers` whose measurement has ended (its DONE probe came)."""
    measured: bool = False
    """This stage's own link measurements have ended (`links_measured`)."""
    quiet: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once no measurement of a link to or from this node is left to run under this
    plan: this stage's own ended, and every prober's."""

    def probe_ended(self, peer_node_id: str) -> None:
        """A neighbour's measurement of its link to this node has ended."""
        self.probes_ended.add(peer_node_id)
        self._settle()

    def links_measured(self) -> None:
        """This stage's own link measurements have ended."""
        self.measured = True
        self._settle()

    def _settle(self) -> None:
        if self.measured and self.probers <= self.probes_ended:
            self.quiet.set()

    async def until_quiet(self, timeout_s: float) -> bool:
        """Wait until no measurement is left to run (`quiet`), for up to `timeout_s`; whether
        it came."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.quiet.wait()
        return self.quiet.is_set()

    @property
    def broken(self) -> bool:
        """The upstream stream broke mid-run (`fail_upstream`)."""
        return self.upstream_failed.done() and not self.upstream_failed.cancelled()

    def fail_upstream(self, error: PeerUnavailable) -> None:
        """The upstream stream broke mid-run: the stage's plan breaks (once)."""
        if not self.upstream_failed.done() and not self.runtime.done:
            self.upstream_failed.set_exception(error)


class MemberProbes:
    """Probes under epoch 0: only from a member measuring its links, as the coordinator lists
    them, within PROBE_BUDGET_BYTES each time it measures, one prober at a time
    (`ProbeTurns`)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self._measuring: dict[str, float] = {}
        """Members measuring their links as the coordinator last listed them: node id -> when
        that began (SwarmMember.measuring_since)."""
        self._answered_at = -float("inf")
        """When the coordinator was asked for the list it last gave (loop time)."""
        self._failed_at = -float("inf")
        self._failure = ""
        """When an ask last failed, and why."""
        self._asking = asyncio.Lock()
        """One ask at a time; the probes that arrive meanwhile wait for its answer."""
        self._bytes: dict[tuple[str, float], int] = {}
        """Probe bytes each member has sent per measuring (node id, measuring_since)."""
        self._turns = ProbeTurns()

    async def admit(self, peer_node_id: str, nbytes: int, *, done: bool = False) -> None:
        """Admit `nbytes` of probes from `peer_node_id` (`done`: the probe that ends its
        measurement); Refusal otherwise."""
        if not valid_node_id(peer_node_id):
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, "probe without a valid node id")
        since = await self._measuring_since(peer_node_id)
        if since is None:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"{peer_node_id} is not a member measuring its links")  # fmt: skip
        key = (peer_node_id, since)
        total = self._bytes.get(key, 0) + max(nbytes, MIN_PROBE_COST)
        if total > PROBE_BUDGET_BYTES:
            raise Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{peer_node_id} has sent {PROBE_BUDGET_BYTES} bytes of probes",
            )
        self._turns.admit(peer_node_id, done=done)
        self._bytes[key] = total

    async def _measuring_since(self, node_id: str) -> float | None:
        """When member `node_id` began measuring its links, as the coordinator says (None: it
        is not measuring). An answer is kept MEMBERS_KEEP_S; an id not in it waits for an
        answer asked after the probe came (one ask at a time, shared by every probe waiting,
        at most every MEMBERS_ASK_S). Refusal if the coordinator cannot be asked."""
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        if arrived - self._answered_at < MEMBERS_KEEP_S and node_id in self._measuring:
            return self._measuring[node_id]
        if not self._coordinator.address:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "this node has no coordinator yet")
        async with self._asking:
            if max(self._answered_at, self._failed_at) < arrived:  # nothing asked since it came
                await self._ask()
            if self._answered_at < arrived:
                raise Refusal(grpc.StatusCode.UNAVAILABLE,
                              f"cannot ask the coordinator for its members: "
                              f"{self._failure}")  # fmt: skip
        return self._measuring.get(node_id)

    async def _ask(self) -> None:
        """Ask the coordinator which members measure their links now, at most every
        MEMBERS_ASK_S; a failure is kept in `_failed_at` and `_failure`."""
        loop = asyncio.get_running_loop()
        wait = max(self._answered_at, self._failed_at) + MEMBERS_ASK_S - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)  # a rate limit on asking, not a wait for an event
        asked = loop.time()
        try:
            view = await self._coordinator.swarm()
        except PeerError as exc:
            self._failed_at, self._failure = asked, str(exc)
            return
        self._answered_at = asked
        self._measuring = {m.node_id: m.measuring_since for m in view.members
                           if m.measuring_since > 0 and not m.left}  # fmt: skip
        measuring = set(self._measuring.items())  # the budgets of measurings that are over go
        self._bytes = {key: n for key, n in self._bytes.items() if key in measuring}


class Sessions:
    """This node's (`node_id`) session of the plan it trains now, and the streams and probes
    that attach to it."""

    def __init__(
        self,
        *,
        node_id: str,
        transport: TransportConfig,
        counters: LinkCounters,
        changes: Changes,
        coordinator: Coordinator,
        fuzz_upstream: str = "",
    ) -> None:
        self.node_id = node_id
        self._fuzz_upstream = fuzz_upstream
        """Test only (NodeConfig's fault_fuzz_upstream): a peer whose streams are checked as
        the upstream's, never admitted."""
        self.counters = counters
        self.limits = FrameLimits(
            max_message_bytes=transport.max_message_bytes,
            max_header_bytes=transport.max_header_bytes,
        )
        self.session: Session | None = None
        self.plan: pb.Plan | None = None
        """The plan this node trains (or last trained) a stage of."""
        self.frames_refused = 0
        self._transport = transport
        self._changes = changes
        self._coordinator = coordinator
        self._members = MemberProbes(coordinator)
        self._dials = Tasks("upstream streams opened from this side")
        """Upstream streams this node opened itself (BoundaryBack), while they run."""
        self._watches = Tasks("broken upstream streams")
        """`_watch_upstream` of a broken upstream stream, until it is resumed."""
        self._ended_epoch = 0
        """The newest plan whose session ended here on a break (`end`)."""

    async def start(self, plan: pb.Plan, session: Session) -> None:
        """This node trains `session` of `plan` from now on: neighbours may attach."""
        self.plan, self.session = plan, session
        await self._changes.notify()

    async def end(self, reason: str) -> None:
        """The session's plan broke here: its upstream learns it at once (it may be waiting
        for this stage's gradients), and so on up the pipeline; nothing attaches to it any
        more."""
        session = self.session
        if session is not None and session.runtime.upstream is not None:
            session.runtime.upstream.abort(reason)
        if self.plan is not None:
            self._ended_epoch = max(self._ended_epoch, self.plan.epoch)
        self.session = None
        await self._changes.notify()

    async def _session_at(self, epoch: int, what: str) -> Session:
        """This node's session once it has a stage of plan `epoch` (a neighbour may get the
        plan a moment earlier: wait for it, within the connect timeout), if the peer's `what`
        is for that epoch; Refusal otherwise, at once for an epoch far past any plan this node
        has heard of (a hostile caller must not hold the handler for the whole wait)."""
        latest = self._coordinator.latest_plan
        newest = latest.epoch if latest is not None else 0
        if 0 < epoch <= self._ended_epoch and self.session is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"plan epoch {epoch} broke here")  # fmt: skip
        if epoch > newest + MAX_EPOCH_AHEAD:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} is for plan epoch {epoch}, far past this node's newest ({newest})",
            )
        await self._changes.wait_within(
            lambda: self.session is not None and self.plan is not None
            and self.plan.epoch >= epoch,
            f"this node has no stage of plan epoch {epoch} yet",
        )  # fmt: skip
        session, plan = self.session, self.plan
        assert session is not None and plan is not None
        if epoch != plan.epoch:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} is for plan epoch {epoch}, this node is at epoch {plan.epoch}",
            )
        return session

    # ----- the upstream stream ----------------------------------------------------------------
    async def open_session(
        self, peer_node_id: str, epoch: int, *, back: bool = False
    ) -> tuple[BoundaryLink, Accept, Callable[[], ResumeState]]:
        """Called by the gRPC server when the previous stage opens its boundary stream (or,
        `back`, by `dial_upstream` when this stage opens it): the session's upstream link (the
        same one for a resumed stream), how to admit frames, and what the stage has admitted.
        The previous stage may have the plan a moment before this node: wait for it, within
        the connect timeout."""
        session = await self._session_at(epoch, "stream")
        runtime = session.runtime
        if runtime.spec.is_first:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "the first stage has no upstream")
        if peer_node_id and peer_node_id == self._fuzz_upstream and not back:  # test only
            return (BoundaryLink(peer_node_id, self.counters, 1), runtime.check_from_upstream,
                    runtime.admitted_forwards)  # fmt: skip
        if session.opens_upstream != back:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          "this stage opens the stream to its upstream itself (BoundaryBack)"
                          if session.opens_upstream else "not a BoundaryBack stage")  # fmt: skip
        if peer_node_id != session.upstream_node_id:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"unknown peer {peer_node_id!r}: the plan's upstream is {session.upstream_node_id}",
            )
        if not await session.until_quiet(QUIET_WAIT_S):
            log.info("plan epoch %d: the upstream stream opens while links are still measured "
                     "(%.0f s passed; ended: %s of %s)", epoch, QUIET_WAIT_S,
                     sorted(session.probes_ended), sorted(session.probers))  # fmt: skip
        if session.broken:
            raise Refusal(grpc.StatusCode.ABORTED, "the upstream stream broke here")
        if runtime.upstream is not None:
            if back:  # BoundaryBack streams are not resumed
                raise Refusal(grpc.StatusCode.ALREADY_EXISTS, "the upstream stream is already open")
            return runtime.upstream, runtime.accept_from_upstream, runtime.admitted_forwards
        link = BoundaryLink(
            peer_node_id,
            self.counters,
            outbox_size=runtime.window,
            pace_bps=runtime.run_config.link_pace_bps(runtime.spec.index - 1),
            first_seq=runtime.first_seq,
        )
        runtime.upstream = link
        return link, runtime.accept_from_upstream, runtime.admitted_forwards

    def close_session(self, link: BoundaryLink, error: BaseException | None) -> None:
        """A call carrying the upstream link `link` ended (`error`: how, None if cleanly)."""
        session = self.session
        if session is None or session.runtime.upstream is not link:
            return
        runtime = session.runtime
        # A clean end is the upstream's way of saying it is done (with the run, or with its
        # plan: then at a step boundary, where this stage's plan ends too). The link stays the
        # session's: if the last gradients did not get through, the upstream resumes for them.
        if error is None:
            runtime.upstream_finished()
        if error is None and (runtime.received_all_forwards or runtime.upstream_ended()):
            return
        if error is None or isinstance(error, (FrameError, LinkAborted)) or session.opens_upstream:
            # Ended early, a frame refused, this stage gave up, or a BoundaryBack stream: the
            # plan breaks here (as it does for a stream the stage gave up on).
            reason = f"upstream stream from {link.peer} ended before the run did"
            if error is not None:
                reason += f": {error or type(error).__name__}"
            session.fail_upstream(PeerUnavailable(reason))
            return
        # Broken on the network: the upstream opens it again while the plan holds.
        log.warning("upstream stream from %s broke (%s); waiting for it to resume", link.peer,
                    str(error) or type(error).__name__)  # fmt: skip
        self._watches.start(self._watch_upstream(session, link), name="watch upstream")

    async def _watch_upstream(self, session: Session, link: BoundaryLink) -> None:
        """The upstream stream `link` broke on the network: until a resumed call carries it
        again, break the plan here if the upstream's address refuses connections (its process
        is gone: found within a second, as a crash was before streams resumed) or a newer plan
        has started (the coordinator counted a member lost and planned without this one)."""
        plan = self.plan
        assert plan is not None
        epoch = plan.epoch

        def over() -> bool:
            return (link.attached or self.session is not session or session.runtime.done
                    or session.broken)  # fmt: skip

        while not over():
            started = self._coordinator.started_plan
            if started is not None and started.epoch > epoch:
                session.fail_upstream(PeerUnavailable(
                    f"upstream stream from {link.peer} did not resume before plan epoch "
                    f"{started.epoch} started"))  # fmt: skip
                return
            address = session.upstream_address
            if address and await refuses_connections(address) and not over():
                session.fail_upstream(PeerUnavailable(
                    f"upstream stream from {link.peer} broke and {address} refuses "
                    "connections"))  # fmt: skip
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WATCH_S):
                    await self._changes.wait_for(over)

    def on_refused(self, reason: str) -> None:
        """A frame from a neighbour was refused (counted for the node's status)."""
        self.frames_refused += 1

    def dial_upstream(self, plan: pb.Plan, upstream: pb.StageAssignment) -> None:
        """This stage's node is behind NAT and its upstream's is not: open the upstream
        stream (BoundaryBack) straight to it, and run it as the server half would
        (`open_session`, `close_session`: a fault breaks the plan through upstream_failed). It
        runs beside the stage, as the server half of a stream does, until the upstream ends
        its half (or the stream breaks)."""
        session = self.session
        assert session is not None
        self._dials.start(self._dial(session, plan, upstream), name="dial upstream")

    async def _dial(self, session: Session, plan: pb.Plan, upstream: pb.StageAssignment) -> None:
        log.info("behind NAT: opening the stream to upstream %s at %s from this side",
                 upstream.node_id, upstream.address)  # fmt: skip
        try:
            async with open_channel(upstream.address, self._transport) as channel:
                link, accept, _ = await self.open_session(upstream.node_id, plan.epoch, back=True)
                error: BaseException | None = None
                try:
                    await run_back_stream(channel, link, node_id=self.node_id,
                                          epoch=plan.epoch, limits=self.limits, accept=accept,
                                          on_refused=self.on_refused,
                                          key=self._transport.node_key)  # fmt: skip
                except (PeerError, FrameError, LinkAborted) as exc:
                    error = exc
                except asyncio.CancelledError:  # the node stops: nobody waits for the stream
                    if session.runtime.upstream is link:
                        session.runtime.upstream = None
                    raise
                self.close_session(link, error)
        except (PeerError, Refusal) as exc:  # no channel, or no session to attach to
            session.fail_upstream(
                PeerUnavailable(f"cannot open the stream to {upstream.node_id}: {exc}")
            )

    # ----- the downstream stream, when the downstream opens it --------------------------------
    async def dial_in(
        self, peer_node_id: str, epoch: int
    ) -> tuple[BoundaryLink, Accept, Callable[[BaseException | None], None]]:
        """Called by the gRPC server when the next stage opens `BoundaryBack` (it is behind NAT,
        this node is not): the stream this stage waits for (`await_dial_in`), once it waits
        (within the connect timeout), and what to call when it ends; Refusal otherwise."""
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
        await self._changes.wait_within(
            lambda: session.dial_in is not None or self.session is not session,
            "this stage does not wait for its downstream's stream yet",
        )
        slot = session.dial_in
        if slot is None or self.session is not session:
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

    async def await_dial_in(self, link: BoundaryLink, accept: Accept) -> None:
        """This stage's downstream stream when its downstream opens it (BoundaryBack): until it
        ends, as `run_client_stream` would. PeerUnavailable if it is not opened within twice
        the connect timeout (a neighbour gets as long to connect, then to get the plan). If
        this stage gives up first (its plan broke), the stream is aborted, so the downstream
        learns it."""
        session = self.session
        assert session is not None
        slot = DialIn(link, accept, asyncio.get_running_loop().create_future())
        session.dial_in = slot
        log.info("downstream %s is behind NAT: it opens the stream to this node", link.peer)
        await self._changes.notify()
        limit_s = 2 * self._transport.connect_timeout_s
        try:
            try:
                async with asyncio.timeout(limit_s):
                    await slot.taken.wait()
            except TimeoutError:
                raise PeerUnavailable(
                    f"{link.peer} did not open its boundary stream within {limit_s:g} s"
                ) from None
            await slot.ended
        finally:
            if not slot.ended.done():
                link.abort("this stage gave up")  # ends the downstream's call, if open
                slot.ended.add_done_callback(_retrieve)

    # ----- probes -----------------------------------------------------------------------------
    async def admit_probe(
        self, peer_node_id: str, epoch: int, nbytes: int, *, done: bool = False
    ) -> None:
        """Called by the gRPC server for each link probe: only the plan's neighbours of this
        stage may probe, under the current epoch, within PROBE_BUDGET_BYTES each, one at a time
        (`done`: the probe that ends a measurement passes the turn on); Refusal otherwise.
        Waits for the plan like `open_session`. Under epoch 0 (before a plan, or a newcomer
        measuring its links), any member measuring its links may (`MemberProbes`)."""
        if epoch == 0:
            await self._members.admit(peer_node_id, nbytes, done=done)
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
        session.probe_turns.admit(peer_node_id, done=done)
        session.probe_bytes[peer_node_id] = total
        if done:
            session.probe_ended(peer_node_id)

    # ----- the end ----------------------------------------------------------------------------
    def stop(self) -> None:
        """The node stops: end the streams this node opened itself."""
        self._dials.cancel()
        self._watches.cancel()

    async def close(self) -> None:
        """Wait (a moment) for the streams this node opened itself to end."""
        await self._dials.close(CLOSE_WAIT_S)
        await self._watches.close(CLOSE_WAIT_S)
