"""A node's worker role: join the coordinator, take a stage from each plan, train it.

The worker owns the stage runtime of the current plan and the client half of the boundary
stream to the next stage; the daemon's gRPC server hands it the server half (the stream from
the previous stage) through `open_session`.

Plans follow one another without a restart (docs/discovery.md, "Re-planning"): when the
coordinator announces a newer plan, the first stage of each pipeline stops feeding at a step
boundary and tells the coordinator (`Drain`), the stages behind it learn where the old plan
ends from their upstream stream's clean end, every node keeps the blocks it trained as they
were at that step and serves them (`Node.FetchBlock`), and each member of the new plan builds
its stage from blocks it kept or fetched, and trains on from there.

This module is the plan loop (`Worker._follow_plans`: a plan, its stage, what its end or its
break leaves) and the face the daemon (node.py) sees. The rest are parts of their own:

- coordinator_client.py: join, follow after a failover, retried calls, heartbeats, the plan
  watch, suspects, leave;
- links.py: link measurements (peers and the coordinator at join, `auto` codec links);
- sessions.py: the server half of boundary streams, dial-back (BoundaryBack), probe admission;
- checkpoints.py and checkpoint_copies.py: this node's checkpoints, and copies of its
  upstream's;
- handover.py: blocks kept when a plan ends, served to and gathered by the next plan's members;
- training.py: building and running one stage of one plan;
- changes.py and tasks.py: what the parts wait on together, and who owns their tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from functools import partial
from pathlib import Path

import torch

from ravnest_node.averaging import AveragingService
from ravnest_node.checkpoint import CheckpointDir
from ravnest_node.coordination.planning.static_plan import has_node
from ravnest_node.daemon.worker.capabilities import measure
from ravnest_node.daemon.worker.changes import Changes
from ravnest_node.daemon.worker.checkpoint_copies import COPY_SHARE
from ravnest_node.daemon.worker.checkpoints import CheckpointKeeper
from ravnest_node.daemon.worker.coordinator_client import CoordinatorClient
from ravnest_node.daemon.worker.handover import Handover
from ravnest_node.daemon.worker.links import LinkMeter
from ravnest_node.daemon.worker.reconnect import AfterBreak, Backoff, after_break, counted_out
from ravnest_node.daemon.worker.sessions import Sessions
from ravnest_node.daemon.worker.training import StageTrainer, stopped_blocks
from ravnest_node.devices import resolve_precision
from ravnest_node.errors import (
    ConfigError,
    PeerError,
    PeerRefused,
    PeerUnavailable,
    RunFailed,
    Unreachable,
)
from ravnest_node.models import get_model, is_project_name, lacking_model, model_names
from ravnest_node.models.pretrained import check_allowed
from ravnest_node.pipeline.stage import StageRuntime
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import PROTOCOL
from ravnest_node.transport.boundary import Accept, BoundaryLink, LinkCounters
from ravnest_node.transport.frames import FrameLimits
from ravnest_node.transport.options import TransportConfig, open_channel
from ravnest_node.transport.probe import LinkEstimate
from ravnest_node.transport.resume import ResumeState

__all__ = ["Worker"]

log = logging.getLogger(__name__)

# A node whose plan broke waits this many leases (plus the connect timeout, plus up to a lease
# of jitter) for the coordinator's next plan before it joins again as a restarted node
# (reconnect.AfterBreak.RESTART): then nobody was counted lost, and nobody would plan.
BREAK_PATIENCE_LEASES = 4


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


class Worker:
    """Trains the stage this node is given. One per node."""

    def __init__(
        self,
        *,
        node_id: str,
        address: str,
        coordinator_address: str,
        compute_threads: int,
        transport: TransportConfig,
        compute: Executor,
        counters: LinkCounters,
        device: torch.device | None = None,
        averaging: AveragingService | None = None,
        coordinator_grace_s: float = 600.0,
        checkpoints: CheckpointDir | None = None,
        resume: bool = False,
        model_dirs: tuple[Path, ...] = (),
        fault_fuzz_upstream: str = "",
        certificate: bytes = b"",
        on_revocations: Callable[[bytes], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self._transport = transport
        self._compute = compute
        self.device = torch.device("cpu") if device is None else device
        """The device this node's stages compute on (resolved from --device at start-up)."""
        self._changes = changes = Changes(transport.connect_timeout_s)
        join = pb.JoinRequest(node_id=node_id, address=address, compute_threads=compute_threads,
                              protocol=PROTOCOL, node_certificate=certificate)  # fmt: skip
        self._client = client = CoordinatorClient(
            join=join, address=coordinator_address, transport=transport, changes=changes,
            grace_s=coordinator_grace_s, on_revocations=on_revocations,
        )  # fmt: skip
        self._links = LinkMeter(node_id=node_id, transport=transport, counters=counters)
        self._sessions = Sessions(node_id=node_id, transport=transport, counters=counters,
                                  changes=changes, coordinator=client,
                                  fuzz_upstream=fault_fuzz_upstream)  # fmt: skip
        self._keeper = CheckpointKeeper(node_id=node_id, store=checkpoints, resume=resume,
                                        transport=transport, changes=changes)  # fmt: skip
        self._handover = Handover(node_id=node_id, transport=transport, changes=changes,
                                  started=lambda: client.started_plan)  # fmt: skip
        self._trainer = StageTrainer(
            node_id=node_id, compute=compute, transport=transport, model_dirs=model_dirs,
            averaging=averaging, client=client, keeper=self._keeper, handover=self._handover,
            sessions=self._sessions, links=self._links, changes=changes, device=self.device,
        )  # fmt: skip
        self.compute_scale = 1.0
        """Test only: multiplies the compute time this node measures (see NodeConfig)."""
        self.block_delay_s = 0.0
        """Test only: seconds this node sleeps per block and microbatch (see NodeConfig)."""
        self.relay_node_id = ""
        """Behind NAT: the relay this node is reached through (told to the planner)."""
        self.relay_address = ""
        """The relay this node serves (--relay-listen), offered to the coordinator."""
        self.run_finished = False
        """This node's stage trained the run's last step."""
        self._caps: pb.Capabilities | None = None
        """What this node measured for the swarm's model (kept for a rejoin: not measured
        again)."""

    # ----- what the daemon reads --------------------------------------------------------------
    @property
    def coordinator_address(self) -> str:
        """The coordinator's address; "" until the daemon has found it."""
        return self._client.address

    @coordinator_address.setter
    def coordinator_address(self, address: str) -> None:
        self._client.address = address

    @property
    def plan(self) -> pb.Plan | None:
        """The plan this node trains (or last trained) a stage of."""
        return self._sessions.plan

    @property
    def latest_plan(self) -> pb.Plan | None:
        """The newest plan the coordinator announced (maybe still pending)."""
        return self._client.latest_plan

    @property
    def started_plan(self) -> pb.Plan | None:
        """The newest plan whose start is fixed (not pending)."""
        return self._client.started_plan

    @property
    def runtime(self) -> StageRuntime | None:
        session = self._sessions.session
        return session.runtime if session else None

    @property
    def precision(self) -> str:
        """The precision this node's stage computes in (fp32, bf16 or fp16): its runtime's, or
        before any plan what auto resolves to on this node's device."""
        runtime = self.runtime
        return runtime.precision if runtime else resolve_precision("auto", self.device)

    @property
    def upstream_node_id(self) -> str:
        session = self._sessions.session
        return session.upstream_node_id if session else ""

    @property
    def holds_stage(self) -> bool:
        """This node trains a stage whose run is not over."""
        session = self._sessions.session
        return session is not None and not session.runtime.run_done

    @property
    def frames_refused(self) -> int:
        return self._sessions.frames_refused

    @property
    def limits(self) -> FrameLimits:
        return self._sessions.limits

    @property
    def counters(self) -> LinkCounters:
        return self._links.counters

    @property
    def coordinator_lost(self) -> bool:
        """The coordinator's plan stream has been unreachable for a few seconds, or its
        heartbeats have failed for a few leases (coordinator_client.py)."""
        return self._client.lost

    @property
    def stopping(self) -> bool:
        """Set by `stop`: retry loops end instead of trying again."""
        return self._changes.stopping

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Wait until `condition` (about this worker's state) holds."""
        await self._changes.wait_for(condition)

    # ----- the run ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Join, wait for the plan, train the stage; returns when this stage's run is done.
        Unreachable if the coordinator cannot reach this node at its address (nothing has
        changed then: the daemon may go through a relay and call this again). A network fault
        on the way (the coordinator does not answer the join, or the first channel fails)
        is logged and the join tried again after a backoff, for as long as the node runs,
        once this node has been answered by a coordinator; before that it is raised (a wrong
        address or missing credentials end the node with the error, not a silent retry)."""
        if not self.coordinator_address:
            raise RuntimeError("Worker.run() before the coordinator's address is known")
        backoff = Backoff()
        while True:
            try:
                joined = await self._join_measured()
                break
            except Unreachable:
                raise
            except PeerError as exc:
                if self.stopping or self._caps is None:
                    raise
                delay_s = backoff.next_s()
                log.warning("cannot join coordinator %s: %s; trying again in %.1f s",
                            self.coordinator_address, exc, delay_s)  # fmt: skip
                await self._pause(delay_s)
                if self.stopping:
                    raise
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(self._client.watch_plans())
            await self._follow_plans(joined)
            watcher.cancel()

    async def _join_measured(self) -> int:
        """Join the coordinator and tell it what this node measured (measured once per
        daemon); the epoch of the plan started when it joined."""
        # The coordinator answers within the timeout.
        async with open_channel(self.coordinator_address, self._transport):
            reply = await self._client.join()
            self._keeper.model_name = reply.model
            if self._caps is None:
                # Then measure this node for the swarm's model, and tell the coordinator.
                self._caps = await self._capabilities(reply)
            await self._client.tell(self._caps)
            return reply.started_epoch

    async def _rejoin(self, why: str, *, restarted_in: int | None = None) -> None:
        """The coordinator counted this node out (or this node lost the state its plan
        counts on): join again as a new member would, with the capabilities measured before
        and the checkpoint offers it holds now, until the coordinator answers or the node
        stops. `restarted_in`: a plain Join first, which makes the coordinator count this
        node's stage in that plan lost (what a restarted node does); not once a newer plan
        has started (here or at the coordinator: the break is resolved, and the node may
        have a stage in it)."""
        assert self._caps is not None
        log.warning("%s: this node joins the coordinator again as a new member", why)

        def resolved() -> bool:
            started = self.started_plan
            return (
                restarted_in is not None and started is not None and (started.epoch > restarted_in)
            )

        backoff = Backoff()
        while not self.stopping and not resolved():
            caps = pb.Capabilities()
            caps.CopyFrom(self._caps)
            del caps.checkpoints[:]
            caps.checkpoints.extend(await asyncio.to_thread(self._keeper.rejoin_offers))
            try:
                if restarted_in is not None:
                    view = await self._client.swarm()
                    if view.HasField("plan") and view.plan.epoch > restarted_in:
                        log.info("plan epoch %d has started meanwhile: no need to join again",
                                 view.plan.epoch)  # fmt: skip
                        return
                    await self._client.join()
                await self._client.tell(caps)
                return
            except PeerError as exc:
                delay_s = backoff.next_s()
                log.warning("cannot join coordinator %s again: %s; trying again in %.1f s",
                            self.coordinator_address, exc, delay_s)  # fmt: skip
                await self._pause(delay_s, resolved)

    async def _pause(self, delay_s: float, done: Callable[[], bool] = lambda: False) -> None:
        """Wait `delay_s` before a retry, or less if the node stops or `done` holds
        meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                await self._changes.wait_for(lambda: self.stopping or done())

    async def _capabilities(self, reply: pb.JoinReply) -> pb.Capabilities:
        """What this node measured for the swarm's model (`reply`): its compute, its links,
        and with --resume its checkpoints. RunFailed if it may not run that model (no retry
        helps)."""
        try:
            check_allowed(reply.model, self._trainer.model_dirs)
            model = get_model(reply.model)
        except ConfigError as exc:
            why = str(exc)
            if is_project_name(reply.model_package) and reply.model not in model_names():
                why = lacking_model(reply.model, reply.model_package)
            raise RunFailed(f"coordinator {self.coordinator_address}: {why}") from None
        precision = resolve_precision(reply.precision or "auto", self.device)
        timed = partial(measure, device=self.device, precision=precision)
        caps = await asyncio.get_running_loop().run_in_executor(
            self._compute, timed, reply.model, max(1, reply.microbatch), self.compute_scale,
            self.block_delay_s,
        )  # fmt: skip
        log.info("measured %.1f ms a microbatch for %s over %d blocks on %s in %s; %.1f GiB "
                 "available", sum(caps.block_s) * 1e3, reply.model, len(caps.block_s),
                 caps.device, precision, caps.memory_bytes / 2**30)  # fmt: skip
        link = await self._links.coordinator(
            self.coordinator_address, address=self._client.node_address
        )
        if link is not None:
            caps.uplink_bps, caps.rtt_s = link.bandwidth_bps, link.rtt_s
        caps.relay_node_id = self.relay_node_id
        caps.relay_address = self.relay_address
        caps.peer_links.extend(await self._peer_links(link))
        caps.checkpoints.extend(await asyncio.to_thread(self._keeper.verified_offers, model))
        return caps

    async def _peer_links(self, coordinator_link: LinkEstimate | None) -> list[pb.PeerLink]:
        """This node's links to the members that joined before it (LinkMeter.peers); none if
        the coordinator cannot list them."""
        try:
            view = await self._client.swarm()
        except PeerError as exc:
            log.info("links to peers not measured: %s", exc)
            return []
        return await self._links.peers(
            view,
            address=self._client.node_address,
            relay_node_id=self.relay_node_id,
            coordinator=self.coordinator_address,
            coordinator_link=coordinator_link,
        )

    async def _follow_plans(self, joined_epoch: int) -> None:
        """Train a stage of each plan this node is in, one after another, to the run's end.
        Never a plan that had started before this node joined (`joined_epoch`): a stage for it
        there was an earlier run's of this node (JoinReply.started_epoch)."""
        epoch, first = joined_epoch, True
        while True:
            plan = await self._client.next_plan(epoch)
            epoch = plan.epoch
            # A restore (a lost member had no replica) goes back to its checkpoints' step.
            if first or plan.restore:
                first = False
                await self._checkpoints_for(plan)
            self._keeper.release(plan.epoch)  # a restore planned meanwhile has come (or not)
            if not has_node(plan.stages, self.node_id):
                log.info("plan epoch %d has no stage for this node; it waits for a later one",
                         plan.epoch)  # fmt: skip
                continue
            held_step = self._handover.held_step
            if has_node(plan.previous, self.node_id) and plan.start_step != held_step:
                # This node missed what happened since (it was cut off): what it holds is of
                # no use to the plan, which counts on blocks it does not have.
                await self._handover.keep({}, plan.start_step)
                await self._rejoin(
                    f"plan epoch {plan.epoch} starts at step {plan.start_step}, but this "
                    f"node's last plan ended at step {held_step}",
                    restarted_in=plan.epoch,
                )
                continue
            try:
                runtime = await self._trainer.train(plan, block_delay_s=self.block_delay_s)
            except BaseException as exc:
                broke = _peer_fault(exc)
                if broke is None or not await self._after_break(plan, broke):
                    raise
                continue
            if runtime.run_done:
                self.run_finished = True
                await self._changes.notify()  # a leaving node need not wait for a hand-over now
                return
            await self._plan_ended(plan, runtime)

    async def _checkpoints_for(self, plan: pb.Plan) -> None:
        """The first plan this node gets, or a plan that restores the run from checkpoints:
        the blocks this node holds at its start are those its checkpoints give
        (CheckpointKeeper.start_plan). A restore drops what this node trained after that
        step."""
        if plan.restore:
            await self._handover.keep({}, plan.start_step)
        held = await self._keeper.start_plan(plan)
        if held is not None:
            await self._handover.keep(held, plan.start_step)

    async def _plan_ended(self, plan: pb.Plan, runtime: StageRuntime) -> None:
        """The stage's `plan` ended at a step boundary: keep its blocks as they are now (the
        next plan's members fetch them), and checkpoint them."""
        await self._handover.keep(await runtime.export(), runtime.version)
        await self._keeper.write(runtime.version, self._handover.held, plan)
        log.info("plan epoch %d ended at step %d; waiting for the next plan", plan.epoch,
                 runtime.version)  # fmt: skip

    async def _after_break(self, plan: pb.Plan, error: BaseException) -> bool:
        """A neighbour of this stage broke `plan` (its stream ended, or the coordinator refused
        what the stage reported after counting its pipeline out). With replicas, the
        coordinator plans without the lost member once its lease runs out; without replicas,
        it restores the run from checkpoints once the members hold them (the plan says
        `restore`). Wait for that plan (True) with this stage's state discarded, as its
        pipeline's steps from here on are dropped, as long as it takes: a network fault never
        ends the node's run. If the coordinator counted this node out, join again first; if
        no plan comes within BREAK_PATIENCE_LEASES leases (nobody was counted lost: the
        break was the network's alone), join again as a restarted node, so that the
        coordinator restores or re-plans the run (reconnect.after_break). False only when
        the node stops."""
        if self.stopping:
            return False
        out = counted_out(error)
        log.warning("plan epoch %d broke: %s; this node waits for the coordinator's next "
                    "plan", plan.epoch, error)  # fmt: skip
        if not out:
            self._client.suspect(plan, error)
        # Blocks kept from the plan before stay: a slow member of this plan may still fetch
        # them.
        await self._sessions.end(f"plan epoch {plan.epoch} broke here: {error}")

        def newer() -> int:
            started = self.started_plan
            return started.epoch if started is not None else 0

        loop = asyncio.get_running_loop()
        since, lease_s = loop.time(), self._client.lease_s
        patience_s = (BREAK_PATIENCE_LEASES * lease_s + self._transport.connect_timeout_s
                      + random.uniform(0, lease_s))  # fmt: skip
        rejoined = False
        while True:
            step = after_break(stopping=self.stopping, broken_epoch=plan.epoch,
                               started_epoch=newer(), out=out, rejoined=rejoined,
                               waited_s=loop.time() - since, patience_s=patience_s)  # fmt: skip
            if step is AfterBreak.STOP:
                return False
            if step is AfterBreak.FOLLOW:
                return True
            if step is AfterBreak.REJOIN:
                await self._rejoin(f"the coordinator ended plan epoch {plan.epoch} without "
                                   "this node")  # fmt: skip
                rejoined = True
                continue
            if step is AfterBreak.RESTART:
                waited_s = loop.time() - since
                await self._rejoin(f"no plan has come {waited_s:.0f} s after plan epoch "
                                   f"{plan.epoch} broke", restarted_in=plan.epoch)  # fmt: skip
                rejoined = True
                continue
            remaining_s = None if rejoined else max(0.0, since + patience_s - loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining_s):
                    await self._changes.wait_for(lambda: self.stopping or newer() > plan.epoch)

    # ----- membership -------------------------------------------------------------------------
    async def keep_membership(self) -> None:
        """Heartbeats to the coordinator once this node has joined, for as long as the node
        runs (carrying its checkpoint offers); when cancelled (the node stops), a last
        `Leave`."""
        await self._client.keep_membership(self._keeper)

    async def follow(self, address: str) -> None:
        """A failover election made the node at `address` this swarm's coordinator: follow it
        from now on (CoordinatorClient.follow). PeerUnavailable / PeerRefused if it cannot
        join it."""
        await self._client.follow(address)

    async def coordinator_back(self) -> None:
        """The coordinator counted lost answers after all (only this node lost it)."""
        await self._client.back()

    def reached_through(self, address: str, relay_node_id: str) -> None:
        """Before this node has joined: its address for the others is now `address`, a port
        the relay `relay_node_id` opened for it (the coordinator could not reach it)."""
        assert not self._client.joined.is_set()
        self._client.node_address, self.relay_node_id = address, relay_node_id

    async def leave(self) -> bool:
        """Tell the coordinator this node is leaving; True if it should stay until a plan
        without it has taken its blocks over (`handed_over`)."""
        return await self._client.leave()

    async def handed_over(self) -> bool:
        """Wait until a plan without this node has started and its members have fetched every
        block this node held when its last plan ended (True), or until the coordinator's plan
        stream is lost (False): then nobody will take the blocks over, and the node stops with
        them checkpointed."""

        def done() -> bool:
            if self.runtime is not None and self.runtime.run_done:
                return True  # the run ended before a plan without this node started
            return self.coordinator_lost or self._handover.taken_over(self.started_plan)

        await self._changes.wait_for(done)
        return not self.coordinator_lost

    # ----- what the daemon's gRPC server hands over -------------------------------------------
    async def open_session(
        self, peer_node_id: str, epoch: int, *, back: bool = False
    ) -> tuple[BoundaryLink, Accept, Callable[[], ResumeState]]:
        """The previous stage opens its boundary stream (Sessions.open_session)."""
        return await self._sessions.open_session(peer_node_id, epoch, back=back)

    def close_session(self, link: BoundaryLink, error: BaseException | None) -> None:
        """The upstream stream `link` ended (Sessions.close_session)."""
        self._sessions.close_session(link, error)

    def on_refused(self, reason: str) -> None:
        """A frame from a neighbour was refused."""
        self._sessions.on_refused(reason)

    async def dial_in(
        self, peer_node_id: str, epoch: int
    ) -> tuple[BoundaryLink, Accept, Callable[[BaseException | None], None]]:
        """The next stage, behind NAT, opens BoundaryBack (Sessions.dial_in)."""
        return await self._sessions.dial_in(peer_node_id, epoch)

    async def admit_probe(
        self, peer_node_id: str, epoch: int, nbytes: int, *, done: bool = False
    ) -> None:
        """Admit a link probe, or Refusal (Sessions.admit_probe)."""
        await self._sessions.admit_probe(peer_node_id, epoch, nbytes, done=done)

    def fetch_block(self, request: pb.BlockRequest) -> AsyncIterator[pb.BlockChunk]:
        """Node.FetchBlock: a block this node kept when its last plan ended (Handover.serve);
        Refusal before any chunk."""
        return self._handover.serve(request)

    def audit_record(self, request: pb.AuditRecordRequest) -> AsyncIterator[pb.AuditChunk]:
        """Node.AuditRecord: this stage's record of a microbatch, for a neighbour's audit
        (AuditLinks.serve); Refusal before any chunk."""
        return self._trainer.audits.serve(
            request, self.plan, self.runtime, pace_bps=self._copy_pace_bps()
        )

    def fetch_checkpoint(self, request: pb.CheckpointRequest) -> AsyncIterator[pb.CheckpointChunk]:
        """Node.FetchCheckpoint: this node's checkpoint, for the node that keeps its copies
        (CheckpointKeeper.serve_copy); Refusal before any chunk."""
        return self._keeper.serve_copy(request, self.plan, pace_bps=self._copy_pace_bps())

    def _copy_pace_bps(self) -> float | None:
        """What a checkpoint copy this node serves may take of its link: COPY_SHARE of the
        bandwidth measured to the stage it sends activations to (the copier, except for the
        last stage's), else to its upstream; None (unpaced) where nothing was measured."""
        runtime = self.runtime
        if runtime is None:
            return None
        for choice in (runtime.activation_codec, runtime.gradient_codec):
            if choice.bandwidth_bps:
                return COPY_SHARE * choice.bandwidth_bps
        return None

    # ----- the stop ---------------------------------------------------------------------------
    async def checkpoint_on_stop(self, drain_s: float, pause_s: float) -> None:
        """The node stops: checkpoint its stage (at a step boundary if it gets there within
        `drain_s`, else where it pauses within `pause_s`: training.stopped_blocks), and wait
        for every write."""
        session, plan = self._sessions.session, self._sessions.plan
        if session is not None and plan is not None and self._keeper.store is not None:
            blocks = await stopped_blocks(session.runtime, drain_s, pause_s)
            if blocks:
                await self._keeper.write(next(iter(blocks.values())).version, blocks, plan)
            else:
                log.warning("stage %d did not pause: no checkpoint at its last step (the "
                            "newest is at step %d)", session.runtime.spec.index,
                            self._keeper.checkpoint_step)  # fmt: skip
        await self._keeper.flush()

    async def stop(self) -> None:
        """The node stops: end the waits and retry loops of the run, and the calls its parts
        started (the run's task is cancelled too, but a cancel that arrives during a call to
        this node's own server can be lost inside grpc.aio, so the run must not rely on it
        alone)."""
        self._client.stop()
        self._sessions.stop()
        self._keeper.stop()
        await self._changes.stop()

    async def close_channels(self) -> None:
        """Close the channels to coordinators (after the run's tasks have ended), and wait a
        moment for what the parts started to end."""
        await self._client.close()
        await self._sessions.close()
        await self._keeper.close()
