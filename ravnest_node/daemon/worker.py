"""A node's worker role: join the coordinator, take a stage from the plan, train it.

The worker owns the stage runtime of the current plan and the client half of the boundary
stream to the next stage; the daemon's gRPC server hands it the server half (the stream from
the previous stage) through `open_session`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import grpc
import torch

from ravnest_node.averaging import AveragingConfig, AveragingService, Member, ReplicaAverager
from ravnest_node.coordination.coordinator import PROTOCOL
from ravnest_node.coordination.membership import DEFAULT_LEASE_S, heartbeat_interval
from ravnest_node.coordination.static_plan import check_plan, replica_group, stage_at
from ravnest_node.daemon.capabilities import measure
from ravnest_node.errors import ConfigError, PeerRefused, PeerUnavailable, RunFailed
from ravnest_node.models import get_model
from ravnest_node.pipeline.codec_choice import CodecChoice
from ravnest_node.pipeline.run import TrainConfig, check_frame_limit
from ravnest_node.pipeline.stage import Averaging, StageRuntime, StageSpec, StepReport
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.boundary import (
    Accept,
    BoundaryLink,
    LinkCounters,
    Refusal,
    run_client_stream,
)
from ravnest_node.transport.frames import FrameLimits
from ravnest_node.transport.options import TransportConfig, channel_options
from ravnest_node.transport.probe import (
    PROBE_BUDGET_BYTES,
    ProbePlan,
    measure_link,
    probe_sender,
)

log = logging.getLogger(__name__)

# A stopping node says it leaves, but does not hold up its stop for long.
LEAVE_TIMEOUT_S = 1.0
# A report the coordinator refused at once as unavailable is tried again after this pause.
REPORT_RETRY_S = 0.5


@asynccontextmanager
async def open_channel(address: str, transport: TransportConfig) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a peer, ready to use; PeerUnavailable if it does not answer in time."""
    channel = grpc.aio.insecure_channel(address, options=channel_options(transport))
    try:
        try:
            await asyncio.wait_for(channel.channel_ready(), transport.connect_timeout_s)
        except TimeoutError:
            raise PeerUnavailable(
                f"no answer from {address} within {transport.connect_timeout_s:g} s"
            ) from None
        yield channel
    finally:
        await channel.close(grace=None)


@contextmanager
def coordinator_errors(address: str) -> Iterator[None]:
    """Translate a failed call to the coordinator into PeerUnavailable / PeerRefused."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        what = f"coordinator {address}: {exc.code().name}: {exc.details()}"
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise PeerUnavailable(what) from None
        raise PeerRefused(what) from None


@dataclass(slots=True)
class _Session:
    runtime: StageRuntime
    upstream_node_id: str
    upstream_failed: asyncio.Future[None]
    downstream_node_id: str = ""
    probe_bytes: dict[str, int] = field(default_factory=dict)
    """Probe bytes received per neighbour under this plan (bounded by PROBE_BUDGET_BYTES)."""


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
    ) -> None:
        self.node_id = node_id
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
        self._transport = transport
        self._compute = compute
        self.counters = counters
        self.limits = FrameLimits(
            max_message_bytes=transport.max_message_bytes,
            max_header_bytes=transport.max_header_bytes,
        )
        self.plan: pb.Plan | None = None
        self._session: _Session | None = None
        self._has_stage = asyncio.Event()
        self.frames_refused = 0

    @property
    def runtime(self) -> StageRuntime | None:
        return self._session.runtime if self._session else None

    @property
    def upstream_node_id(self) -> str:
        return self._session.upstream_node_id if self._session else ""

    # ----- the server half of the upstream boundary -------------------------------------------
    async def _session_at(self, epoch: int, what: str) -> _Session:
        """This node's session once it has a stage (a neighbour may get the plan a moment
        earlier: wait for it, within the connect timeout), if the peer's `what` is for its plan
        epoch; Refusal otherwise."""
        if self._session is None:
            try:
                await asyncio.wait_for(self._has_stage.wait(), self._transport.connect_timeout_s)
            except TimeoutError:
                raise Refusal(grpc.StatusCode.UNAVAILABLE, "this node has no stage yet") from None
        session, plan = self._session, self.plan
        assert session is not None and plan is not None
        if epoch != plan.epoch:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{what} is for plan epoch {epoch}, this node is at epoch {plan.epoch}",
            )
        return session

    async def open_session(self, peer_node_id: str, epoch: int) -> tuple[BoundaryLink, Accept]:
        """Called by the gRPC server when the previous stage opens its boundary stream. The
        previous stage may have the plan a moment before this node: wait for it, within the
        connect timeout."""
        session = await self._session_at(epoch, "stream")
        if session.runtime.spec.is_first:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "the first stage has no upstream")
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
        # A clean end is the upstream's way of saying it is done; anything else mid-run is a fault.
        finished = error is None and session.runtime.received_all_forwards
        if not finished and not session.runtime.done and not session.upstream_failed.done():
            reason = f"upstream stream from {link.peer} ended before the run did"
            if error is not None:
                reason += f": {error or type(error).__name__}"
            session.upstream_failed.set_exception(PeerUnavailable(reason))

    def on_refused(self, reason: str) -> None:
        self.frames_refused += 1

    async def check_probe(self, peer_node_id: str, epoch: int, nbytes: int) -> None:
        """Called by the gRPC server for each link probe: only the plan's neighbours of this
        stage may probe, under the current epoch, within PROBE_BUDGET_BYTES each; Refusal
        otherwise. Waits for the plan like `open_session`."""
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
                async with open_channel(peer.address, self._transport) as channel:
                    send = probe_sender(
                        channel,
                        peer=peer.node_id,
                        node_id=self.node_id,
                        epoch=plan.epoch,
                        counters=self.counters,
                        timeout_s=self._transport.connect_timeout_s,
                        pace_bps=pace_bps,
                    )
                    estimate = await measure_link(
                        send, ProbePlan.within(self._transport.max_message_bytes)
                    )
            except (PeerUnavailable, PeerRefused) as exc:
                log.warning("%s: cannot measure the link (%s); using %s", choice.what, exc,
                            choice.name)  # fmt: skip
                return
            choice.bandwidth_bps = estimate.bandwidth_bps
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

    # ----- the run ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Join, wait for the plan, train the stage; returns when this stage's run is done."""
        if not self.coordinator:
            raise RuntimeError("Worker.run() before the coordinator's address is known")
        async with open_channel(self.coordinator, self._transport) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            join = pb.JoinRequest(
                node_id=self.node_id,
                address=self._address,
                compute_threads=self._threads,
                protocol=PROTOCOL,
            )
            with coordinator_errors(self.coordinator):
                reply = await stub.Join(join, timeout=self._transport.connect_timeout_s)
            self._lease_s = reply.lease_s or DEFAULT_LEASE_S
            self._joined.set()  # keep_membership() sends heartbeats from now on
            # Then measure this node for the swarm's model, and tell the coordinator.
            try:
                get_model(reply.model)
            except ConfigError as exc:
                raise PeerRefused(f"coordinator {self.coordinator}: {exc}") from None
            loop = asyncio.get_running_loop()
            caps = await loop.run_in_executor(
                self._compute, measure, reply.model, max(1, reply.microbatch), self.compute_scale
            )
            log.info(
                "measured %.1f ms a microbatch for %s over %d blocks; %.1f GiB available",
                sum(caps.block_s) * 1e3,
                reply.model,
                len(caps.block_s),
                caps.memory_bytes / 2**30,
            )
            join.capabilities.CopyFrom(caps)
            with coordinator_errors(self.coordinator):
                await stub.Join(join, timeout=self._transport.connect_timeout_s)
                watch = stub.WatchPlan(pb.WatchPlanRequest(node_id=self.node_id))
                plan = await watch.read()
                watch.cancel()
            if plan is grpc.aio.EOF:
                raise PeerUnavailable(f"coordinator {self.coordinator} closed the plan stream")
            await self._train(plan, stub)

    async def _report(self, stub: pb_grpc.CoordinatorStub, report: pb.StageReport) -> None:
        """Send one report. While the coordinator does not answer (a lab coordinator being
        restarted), the stage trains on and its reports wait: each attempt waits for the
        channel to be ready, for up to `coordinator_grace_s` in all; then PeerUnavailable.
        A coordinator that answers but refuses raises PeerRefused at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._coordinator_grace_s
        lost_at: float | None = None
        while True:
            attempt = loop.time()
            try:
                with coordinator_errors(self.coordinator):
                    await stub.Report(
                        report,
                        timeout=max(
                            0.1, min(self._transport.connect_timeout_s, deadline - attempt)
                        ),
                        wait_for_ready=True,
                    )
            except PeerUnavailable as exc:
                if loop.time() >= deadline:
                    raise PeerUnavailable(
                        f"{exc} (no answer for {self._coordinator_grace_s:g} s)"
                    ) from None
                if lost_at is None:
                    lost_at = attempt
                    log.warning("%s; training on, reports wait for it", exc)
                if loop.time() - attempt < REPORT_RETRY_S:  # refused at once: not a busy loop
                    await asyncio.sleep(REPORT_RETRY_S)  # a retry's pause, not a wait for an event
                continue
            if lost_at is not None:
                log.info("coordinator %s answers again after %.1f s", self.coordinator,
                         loop.time() - lost_at)  # fmt: skip
            return

    async def keep_membership(self) -> None:
        """Heartbeats to the coordinator once this node has joined, for as long as the node
        runs; when cancelled (the node stops), a last `Leave`. A missed heartbeat is logged
        and the next one tried: the coordinator forgives two."""
        await self._joined.wait()
        coordinator = self.coordinator
        # No wait for the channel to be ready: a stop at any moment from here must still leave.
        channel = grpc.aio.insecure_channel(coordinator, options=channel_options(self._transport))
        stub = pb_grpc.CoordinatorStub(channel)
        interval = heartbeat_interval(self._lease_s)
        try:
            while True:
                await asyncio.sleep(interval)  # the heartbeat's period, not a wait for an event
                try:
                    await stub.Heartbeat(
                        pb.HeartbeatRequest(node_id=self.node_id), timeout=interval
                    )
                except grpc.aio.AioRpcError as exc:
                    log.warning(
                        "heartbeat to coordinator %s failed: %s", coordinator, exc.code().name
                    )
        except asyncio.CancelledError:
            with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
                await stub.Leave(pb.LeaveRequest(node_id=self.node_id), timeout=LEAVE_TIMEOUT_S)
            raise
        finally:
            await channel.close(grace=None)

    def _averaging(
        self,
        plan: pb.Plan,
        me: pb.StageAssignment,
        run: TrainConfig,
        blocks: list[torch.nn.Module],
    ) -> Averaging | None:
        """This stage's replica group, attached to the node's Push service; None with one
        pipeline."""
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
        try:
            averager = ReplicaAverager(
                node_id=self.node_id,
                members=[Member(node_id=s.node_id, address=s.address) for s in group],
                config=config,
                numel=sum(p.numel() for p in params),
                max_message_bytes=self._transport.max_message_bytes,
                counters=self.counters,
                layout=[tuple(p.shape) for p in params],
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

    async def _train(self, plan: pb.Plan, stub: pb_grpc.CoordinatorStub) -> None:
        try:
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
        reports: asyncio.Queue[StepReport] = asyncio.Queue()

        async def report(r: StepReport) -> None:
            reports.put_nowait(r)

        blocks = await asyncio.get_running_loop().run_in_executor(
            self._compute, model.build_stage, run.seed, spec.first_block, spec.stop_block
        )
        averaging = self._averaging(plan, me, run, blocks)
        runtime = StageRuntime(
            spec=spec,
            model=model,
            blocks=blocks,
            run=run,
            compute=self._compute,
            report=report,
            averaging=averaging,
        )
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
        self._session = _Session(
            runtime,
            upstream_id,
            loop.create_future(),
            downstream_node_id="" if downstream is None else downstream.node_id,
        )
        self._has_stage.set()
        log.info(
            "stage %d of %d: blocks [%d, %d) of %s",
            spec.index,
            spec.num_stages,
            spec.first_block,
            spec.stop_block,
            run.model,
        )

        async def send_reports() -> None:
            while True:
                r = await reports.get()
                await self._report(
                    stub,
                    pb.StageReport(
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
                        downstream_bandwidth_bps=r.metrics.downstream_bandwidth_bps,
                        upstream_bandwidth_bps=r.metrics.upstream_bandwidth_bps,
                    ),
                )
                if r.done:
                    return

        async def watch_upstream() -> None:
            session = self._session
            assert session is not None
            await session.upstream_failed  # raises PeerUnavailable if the stream breaks

        # `auto` codecs: measure the links this stage sends on before its first frame.
        neighbours = [
            (downstream, runtime.activation_codec, run.link_pace_bps(spec.index)),
            (upstream, runtime.gradient_codec, run.link_pace_bps(spec.index - 1)),
        ]
        await self._measure_links(
            plan, [(p, c, pace) for p, c, pace in neighbours if p is not None]
        )

        async with asyncio.TaskGroup() as tg:
            tg.create_task(send_reports())
            upstream_watch = tg.create_task(watch_upstream())
            if downstream is not None:
                async with open_channel(downstream.address, self._transport) as channel:
                    link = BoundaryLink(
                        downstream.node_id,
                        self.counters,
                        runtime.window,
                        pace_bps=run.link_pace_bps(spec.index),
                    )
                    runtime.downstream = link
                    tg.create_task(runtime.run())
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
                await runtime.run()
            upstream_watch.cancel()
        log.info("stage %d finished %d steps", spec.index, runtime.version)
        if averaging is not None:
            assert self._averaging_service is not None
            self._averaging_service.attach(None)
            await averaging.averager.close()
