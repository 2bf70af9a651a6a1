"""Building and running this node's stage of one plan.

`StageTrainer.train` goes in order: check the plan, build the stage's blocks and gather their
state at the plan's start (kept here or fetched: handover.py), join the stage's replica group
(`_replicas`), build the StageRuntime and open the session its neighbours attach to
(sessions.py), measure the links it sends on with an `auto` codec (links.py), then run the
stage beside its streams and its reports to the coordinator until the plan or the run ends. A
first stage also drains when a newer plan is announced: it feeds no new step, and agrees with
the coordinator on the step its plan ends at; the stages behind it learn that step from their
upstream stream's clean end.

A downstream stream that breaks on the network is opened again (`_stream_downstream`, with
backoff and jitter) while the plan holds: each side sends again what the other lacks
(transport/resume.py) and the stage trains on. Meanwhile it keeps computing what the schedule
allows (backwards from the healthy side, forwards up to the staleness bound); its frames wait
in the link's bounded outbox, and then the stage waits, counted as idle on that neighbour. The
plan breaks instead, as before resuming, when the downstream's address refuses connections
(its process is gone), it refuses the stream (its plan broke, or it cannot resume), or a newer
plan has started (the coordinator counted a member lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import grpc
import torch

from ravnest_node.averaging import AveragingConfig, AveragingService, Replica, ReplicaAverager
from ravnest_node.blocks import BlockWeights
from ravnest_node.coordination.planning.static_plan import (
    check_plan,
    dials_back,
    replica_group,
    stage_at,
)
from ravnest_node.daemon.worker.audits import AuditLinks
from ravnest_node.daemon.worker.changes import Changes
from ravnest_node.daemon.worker.checkpoints import CheckpointKeeper
from ravnest_node.daemon.worker.coordinator_client import CoordinatorClient
from ravnest_node.daemon.worker.handover import Handover
from ravnest_node.daemon.worker.links import LinkMeter
from ravnest_node.daemon.worker.reconnect import Backoff
from ravnest_node.daemon.worker.sessions import Session, Sessions
from ravnest_node.devices import describe
from ravnest_node.errors import ConfigError, PeerRefused, PeerUnavailable, RunFailed
from ravnest_node.models import BlockModel, get_model
from ravnest_node.models.pretrained import check_allowed
from ravnest_node.pipeline.metrics import StepReport, to_report
from ravnest_node.pipeline.run import TrainConfig, check_frame_limit
from ravnest_node.pipeline.stage import Averaging, StageRuntime, StageSpec
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.boundary import (
    BoundaryLink,
    LinkCounters,
    StreamBroken,
    run_client_stream,
)
from ravnest_node.transport.options import TransportConfig, open_channel, refuses_connections

__all__ = ["StageTrainer", "stage_spec", "stopped_blocks"]

log = logging.getLogger(__name__)

POISON_SCALE = 1e4
RESUME_CONNECT_S = 3.0
"""Seconds one attempt to open a broken downstream stream again waits for a connection: short,
so that a connection attempt made while the link was down does not hold the resume long after
it is back."""
RESUME_BACKOFF_S = (0.2, 2.0)
"""The first and the longest delay between those attempts (with jitter: reconnect.Backoff)."""
RESUME_RESET_S = 10.0
"""A resumed stream that carried frames this long resets the backoff."""
MAX_QUICK_FAILURES = 5
"""Resumed streams that break again within RESUME_RESET_S of connecting, in a row, before the
plan breaks instead (a peer that answers, yet cannot carry the stream)."""
"""Test only (TrainConfig.fault_poison_pipeline): how much larger a poisoning replica's pushed
deltas are than its real ones."""


def stage_spec(plan: pb.Plan, me: pb.StageAssignment, run: TrainConfig) -> StageSpec:
    """Where stage `me` of `plan` sits in its pipeline."""
    return StageSpec(
        index=me.index,
        num_stages=len(plan.stages) // run.pipelines,
        first_block=me.first_block,
        stop_block=me.stop_block,
        pipeline=me.pipeline,
        num_pipelines=run.pipelines,
    )


def _probed(peer: pb.StageAssignment | None, me: pb.StageAssignment) -> pb.StageAssignment | None:
    """`peer` if this stage (`me`) measures its link to it for an `auto` codec. Not a neighbour
    behind NAT when this node is not: that neighbour opens their stream, straight to this node,
    while probes would go through its relay (the codec keeps the smallest, as for a link that
    cannot be measured)."""
    return None if peer is None or (peer.relayed and not me.relayed) else peer


def _probers(
    me: pb.StageAssignment,
    upstream: pb.StageAssignment | None,
    downstream: pb.StageAssignment | None,
    runtime: StageRuntime,
) -> frozenset[str]:
    """The neighbours that measure their link to this stage (`me`) under the plan: the upstream
    where activations go `auto` (the run's setting, theirs as this stage's), the downstream
    where gradients do, each unless `_probed` leaves this stage out for it."""
    sending = ((upstream, runtime.activation_codec), (downstream, runtime.gradient_codec))
    return frozenset(
        n.node_id for n, choice in sending
        if n is not None and choice.auto and _probed(me, n) is not None
    )  # fmt: skip


async def stopped_blocks(
    runtime: StageRuntime, drain_s: float, pause_s: float
) -> dict[int, BlockWeights]:
    """The node stops: the stage's blocks to checkpoint, or none if it did not pause.

    Where it can, the stage first ends its plan at a step boundary, as for a new plan (for up
    to `drain_s`): a first stage feeds no new step and trains what it fed; a stage behind it
    does the same and ends when its upstream stream ends cleanly there. Stopped together, a
    pipeline's stages so checkpoint one step, the step a resumed run starts at. A stage that
    cannot get there in time (a neighbour gone) gives its blocks where it is, if its loop
    pauses within `pause_s`."""
    if not runtime.done:
        if runtime.spec.is_first:
            with contextlib.suppress(ValueError):
                runtime.stop_at(runtime.drain_step())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_s):
                await runtime.ended.wait()
    if runtime.ended.is_set():
        return await runtime.export()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(pause_s):
            return await runtime.snapshot()
    return {}


class _Reports:
    """A stage's step reports, in order, until its plan ends (None)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[StepReport | None] = asyncio.Queue()

    async def put(self, report: StepReport) -> None:
        self._queue.put_nowait(report)

    def end(self) -> None:
        self._queue.put_nowait(None)

    async def get(self) -> StepReport | None:
        return await self._queue.get()


@dataclass(slots=True)
class _Stage:
    """This node's stage of one plan, being trained."""

    plan: pb.Plan
    me: pb.StageAssignment
    runtime: StageRuntime
    session: Session
    reports: _Reports
    upstream: pb.StageAssignment | None
    downstream: pb.StageAssignment | None


class StageTrainer:
    """Trains node `node_id`'s stage of each plan it is given, with the worker's parts."""

    def __init__(
        self,
        *,
        node_id: str,
        compute: Executor,
        transport: TransportConfig,
        model_dirs: tuple[Path, ...],
        averaging: AveragingService | None,
        client: CoordinatorClient,
        keeper: CheckpointKeeper,
        handover: Handover,
        sessions: Sessions,
        links: LinkMeter,
        changes: Changes,
        device: torch.device | None = None,
    ) -> None:
        """`device`: where the stages compute (the CPU if None)."""
        self.node_id = node_id
        self.device = torch.device("cpu") if device is None else device
        self.model_dirs = model_dirs
        """Where the run's pretrained model and data may be read from (check_allowed)."""
        self._compute = compute
        self._transport = transport
        self._push_service = averaging
        self._client = client
        self._keeper = keeper
        self._handover = handover
        self._sessions = sessions
        self._links = links
        self._changes = changes
        self.audits = AuditLinks(node_id, transport, client.report_audit)
        """The network side of this node's audits of its neighbours (audits.py)."""

    @property
    def _counters(self) -> LinkCounters:
        return self._links.counters

    async def train(self, plan: pb.Plan, *, block_delay_s: float = 0.0) -> StageRuntime:
        """Train this node's stage of `plan` until the plan or the run ends (each block and
        microbatch slowed by `block_delay_s`, test only). RunFailed if this node cannot
        follow the plan; PeerUnavailable / PeerRefused (maybe in an exception group) if a
        neighbour or the coordinator gives up on the stage."""
        run, model, me = self._check(plan)
        spec = stage_spec(plan, me, run)
        blocks = await asyncio.get_running_loop().run_in_executor(
            self._compute, self._build_blocks, model, run, spec
        )
        restore = await self._gather(plan, me, blocks)
        averaging = self._replicas(plan, me, run, blocks)
        reports = _Reports()
        build = partial(
            StageRuntime,
            spec=spec,
            model=model,
            blocks=blocks,
            run=run,
            compute=self._compute,
            report=reports.put,
            averaging=averaging,
            start_step=plan.start_step,
            restore=restore,
            block_delay_s=block_delay_s,
            checkpoint=partial(self._keeper.stage_checkpoint, plan=plan, me=me),
            device=self.device,
            auditor=self.audits.auditor(plan, me, run, model),
        )
        try:
            runtime = await self._build(plan, build)
            log.info("stage %d computes on %s in %s", spec.index, describe(runtime.device),
                     runtime.precision)  # fmt: skip
            stage = await self._begin(plan, me, runtime, reports)
            await self._run(stage)
        finally:
            if averaging is not None:  # also when a neighbour broke the plan
                assert self._push_service is not None
                self._push_service.attach(None)
                await averaging.averager.close()
        log.info("stage %d is at step %d", spec.index, runtime.version)
        return runtime

    def _build_blocks(
        self, model: BlockModel, run: TrainConfig, spec: StageSpec
    ) -> list[torch.nn.Module]:
        """The stage's blocks, initialised from the run's seed (or read from the pretrained
        weights, one tensor at a time), straight onto this node's device."""
        return model.build_stage(run.seed, spec.first_block, spec.stop_block, device=self.device)

    def _check(self, plan: pb.Plan) -> tuple[TrainConfig, BlockModel, pb.StageAssignment]:
        """The run, model and stage of this node in `plan`; RunFailed if it cannot follow it."""
        try:
            check_allowed(plan.run.model, self.model_dirs)
            run = TrainConfig.from_proto(plan.run)
            model = get_model(run.model)
            me = check_plan(plan, model, self.node_id)
            check_frame_limit(run, self._transport.max_message_bytes)
        except ConfigError as exc:
            raise RunFailed(f"cannot follow plan epoch {plan.epoch}: {exc}") from None
        return run, model, me

    async def _gather(
        self, plan: pb.Plan, me: pb.StageAssignment, blocks: list[torch.nn.Module]
    ) -> dict[int, BlockWeights]:
        """The state of the stage's blocks at the plan's start (Handover.gather)."""
        try:
            return await self._handover.gather(plan, me, blocks)
        except* (PeerUnavailable, PeerRefused) as group:
            # A holder lost meanwhile: a peer fault, so the node waits for the coordinator's
            # plan without it (the plan loop) rather than failing.
            first = group.exceptions[0]
            fault = PeerRefused if isinstance(first, PeerRefused) else PeerUnavailable
            raise fault(f"plan epoch {plan.epoch}: cannot gather its blocks: {first}") from None

    async def _build(self, plan: pb.Plan, build: partial[StageRuntime]) -> StageRuntime:
        """The stage's runtime (built in the compute thread); RunFailed if it cannot be."""
        try:
            runtime = await asyncio.get_running_loop().run_in_executor(self._compute, build)
        except ValueError as exc:  # a start step outside the run
            raise RunFailed(f"cannot follow plan epoch {plan.epoch}: {exc}") from None
        if runtime.spec.is_first and runtime.data_fingerprint != plan.run.data_fingerprint:
            raise RunFailed(
                "this node's training data differs from the coordinator's "
                f"({runtime.data_fingerprint} vs {plan.run.data_fingerprint}): "
                "use the same Python version on every node"
            )
        return runtime

    async def _begin(
        self, plan: pb.Plan, me: pb.StageAssignment, runtime: StageRuntime, reports: _Reports
    ) -> _Stage:
        """Open the stage's session (its neighbours may attach from now on), and measure the
        links it sends on with an `auto` codec, before its first frame."""
        downstream = stage_at(plan, me.pipeline, me.index + 1)
        upstream = stage_at(plan, me.pipeline, me.index - 1)
        session = Session(
            runtime,
            "" if upstream is None else upstream.node_id,
            asyncio.get_running_loop().create_future(),
            downstream_node_id="" if downstream is None else downstream.node_id,
            upstream_address="" if upstream is None or upstream.relayed else upstream.address,
            opens_upstream=upstream is not None and dials_back(upstream, me),
            downstream_opens=downstream is not None and dials_back(me, downstream),
            probers=_probers(me, upstream, downstream, runtime),
        )
        await self._sessions.start(plan, session)
        spec, run = runtime.spec, runtime.run_config
        log.info("plan epoch %d: stage %d of %d, blocks [%d, %d) of %s, from step %d",
                 plan.epoch, spec.index, spec.num_stages, spec.first_block, spec.stop_block,
                 run.model, plan.start_step)  # fmt: skip
        neighbours = [
            (downstream, runtime.activation_codec, run.link_pace_bps(spec.index)),
            (upstream, runtime.gradient_codec, run.link_pace_bps(spec.index - 1)),
        ]
        for n, choice, _ in neighbours:
            if n is not None:
                choice.meet(unpacks_deflate=n.unpacks_deflate, decodes_klt=n.decodes_klt,
                            klt_coder=n.klt_coder)  # fmt: skip
        await self._links.codecs(
            plan.epoch,
            [(_probed(n, me), c, pace) for n, c, pace in neighbours if n is not None],
            own=session.probe_turns,
        )
        session.links_measured()
        return _Stage(plan, me, runtime, session, reports, upstream, downstream)

    async def _run(self, stage: _Stage) -> None:
        """Run the stage beside its streams, reports and (first stage) drain."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._send_reports(stage))
            upstream_watch = tg.create_task(_raise_when_failed(stage.session))
            drain = (
                tg.create_task(self._drain_when_replanned(stage))
                if stage.runtime.spec.is_first else None
            )  # fmt: skip
            if stage.upstream is not None and stage.session.opens_upstream:
                self._sessions.dial_upstream(stage.plan, stage.upstream)
            await self._downstream(stage, tg)
            upstream_watch.cancel()
            if drain is not None:  # the run ended before a newer plan came
                drain.cancel()

    async def _downstream(self, stage: _Stage, tg: asyncio.TaskGroup) -> None:
        """Train the stage in `tg` while its downstream stream runs (opened by this stage, or
        by its downstream: BoundaryBack); the last stage has none."""
        runtime, downstream = stage.runtime, stage.downstream
        if downstream is None:
            await self._train_stage(stage)
            return
        link = BoundaryLink(
            downstream.node_id,
            self._counters,
            runtime.window,
            pace_bps=runtime.run_config.link_pace_bps(runtime.spec.index),
            first_seq=runtime.first_seq,
        )
        runtime.downstream = link
        if stage.session.downstream_opens:
            tg.create_task(self._train_stage(stage))
            await self._sessions.await_dial_in(link, runtime.accept_from_downstream)
            return
        async with open_channel(downstream.address, self._transport) as channel:
            tg.create_task(self._train_stage(stage))
            try:
                await self._open_downstream(stage, link, channel, 0)
                return
            except StreamBroken as exc:
                if not await self._may_resume(stage, link, exc):
                    raise
        await self._stream_downstream(stage, link)

    async def _open_downstream(
        self, stage: _Stage, link: BoundaryLink, channel: grpc.aio.Channel, generation: int
    ) -> None:
        runtime = stage.runtime
        await run_client_stream(
            channel,
            link,
            node_id=self.node_id,
            epoch=stage.plan.epoch,
            limits=self._sessions.limits,
            accept=runtime.accept_from_downstream,
            on_refused=self._sessions.on_refused,
            generation=generation,
            admitted=runtime.admitted_gradients,
            key=self._transport.node_key,
        )

    async def _stream_downstream(self, stage: _Stage, link: BoundaryLink) -> None:
        """The downstream stream broke on the network: open it again, with backoff and
        jitter, until it ends as a stream does, or the plan breaks (`_may_resume`)."""
        assert stage.downstream is not None
        address, epoch = stage.downstream.address, stage.plan.epoch
        attempt = dataclasses.replace(self._transport, connect_timeout_s=RESUME_CONNECT_S)
        backoff = Backoff(*RESUME_BACKOFF_S)
        loop = asyncio.get_running_loop()
        broken_at = loop.time()
        log.warning("stream to %s broke; resuming it while plan epoch %d holds", link.peer, epoch)
        generation, failed = 1, 0
        while True:
            await self._pause_unless_replanned(epoch, backoff.next_s())
            started = self._client.started_plan
            if started is not None and started.epoch > epoch:
                raise PeerUnavailable(f"stream to {link.peer} did not resume before plan "
                                      f"epoch {started.epoch} started")  # fmt: skip
            # A look first: gRPC waits out the whole connect timeout on an address that refuses
            # (a check after the break that got no answer in time, on a loaded machine, cost
            # a killed node's takeover 3 s in CI).
            if await refuses_connections(address):
                raise PeerUnavailable(f"stream to {link.peer} broke and its address "
                                      f"{address} refuses connections")  # fmt: skip
            connected_at = None
            try:
                async with open_channel(address, attempt) as channel:
                    connected_at = loop.time()
                    log.info("stream to %s resumes (try %d, %.1f s after it broke)", link.peer,
                             generation, connected_at - broken_at)  # fmt: skip
                    await self._open_downstream(stage, link, channel, generation)
                return
            except (StreamBroken, PeerUnavailable) as exc:
                if connected_at is not None and loop.time() - connected_at > RESUME_RESET_S:
                    backoff.reset()  # it carried frames a while: a new break
                    broken_at, failed = loop.time(), 0
                elif connected_at is not None:
                    failed += 1  # the peer is there, and the stream broke again at once
                if failed > MAX_QUICK_FAILURES or not await self._may_resume(stage, link, exc):
                    raise
            generation += 1

    async def _may_resume(self, stage: _Stage, link: BoundaryLink, error: BaseException) -> bool:
        """Whether the downstream stream, broken with `error`, may be opened again: not if
        this stage gave up on it, a newer plan has started, or the downstream's address
        refuses connections (its process is gone: the plan breaks at once, as a crash did
        before streams resumed)."""
        started = self._client.started_plan
        if link.abort_reason is not None or (started is not None
                                             and started.epoch > stage.plan.epoch):  # fmt: skip
            return False
        assert stage.downstream is not None
        return not await refuses_connections(stage.downstream.address)

    async def _pause_unless_replanned(self, epoch: int, delay_s: float) -> None:
        """Wait `delay_s` (a backoff), less if a plan newer than `epoch` starts meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay_s):
                await self._changes.wait_for(
                    lambda: (p := self._client.started_plan) is not None and p.epoch > epoch
                )

    async def _train_stage(self, stage: _Stage) -> None:
        await stage.runtime.run()
        stage.reports.end()

    async def _send_reports(self, stage: _Stage) -> None:
        """Send the stage's step reports to the coordinator, in order (each retried while it
        does not answer), until the plan or the run ends."""
        while True:
            r = await stage.reports.get()
            if r is None:
                return
            if r.done:  # the run's last checkpoint counts in the final report
                await self._keeper.flush()
            await self._report(stage, r)
            if r.done:
                return

    async def _report(self, stage: _Stage, r: StepReport) -> None:
        spec = stage.runtime.spec
        report = pb.StageReport(
            node_id=self.node_id,
            stage=spec.index,
            pipeline=spec.pipeline,
            plan_epoch=stage.plan.epoch,
            step=r.step,
            loss=r.loss,
            bytes_sent=self._counters.total_bytes,
            done=r.done,
            params_sq_sum=r.params_sq_sum,
            num_params=r.num_params,
            checkpoint_step=self._keeper.checkpoint_step,
            **to_report(r.metrics),
        )
        await self._client.call(lambda t: self._client.stub().Report(report, timeout=t))

    async def _drain_when_replanned(self, stage: _Stage) -> None:
        """First stage: when a newer plan is announced, stop feeding and agree with the
        coordinator on the step this plan ends at."""
        plan, runtime = stage.plan, stage.runtime
        await self._changes.wait_for(
            lambda: (p := self._client.latest_plan) is not None and p.epoch > plan.epoch
        )
        stop = runtime.drain_step()
        log.info("a newer plan is coming: stage feeds no step from %d on", stop)
        request = pb.DrainRequest(
            node_id=self.node_id, plan_epoch=plan.epoch, pipeline=stage.me.pipeline,
            stop_step=stop,
        )  # fmt: skip
        reply = await self._client.call(
            lambda t: self._client.stub().Drain(request, timeout=t), "the drain waits"
        )
        try:
            runtime.stop_at(reply.stop_step)
        except ValueError as exc:
            raise RunFailed(f"plan epoch {plan.epoch}: {exc}") from None
        log.info("plan epoch %d ends at step %d", plan.epoch, reply.stop_step)

    def _replicas(
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
        if self._push_service is None:
            raise RunFailed("this node cannot serve replica averaging")
        config = AveragingConfig(
            every_steps=run.average_every,
            outer_lr=run.outer_lr,
            momentum=run.outer_momentum,
            codec=run.average_codec,
            timeout_s=run.average_timeout_s,
            # A synchronous run lands each round one step after it began, whatever the timing.
            lands_after=1 if run.max_staleness == 0 else 0,
        )
        # The stage's parameters in the order its delta concatenates them (stage.py).
        params = list(torch.nn.Sequential(*blocks).parameters())
        if not params:  # frozen blocks only (LoRA's embeddings): nothing to average
            return None
        try:
            averager = ReplicaAverager(
                node_id=self.node_id,
                members=[Replica(node_id=s.node_id, address=s.address) for s in group],
                config=config,
                numel=sum(p.numel() for p in params),
                max_message_bytes=self._transport.max_message_bytes,
                counters=self._counters,
                layout=[tuple(p.shape) for p in params],
                transport=self._transport,
                bans=self._push_service.bans,
                fault_push_scale=POISON_SCALE if run.fault_poison_pipeline == me.pipeline else 1.0,
            )
        except ConfigError as exc:
            raise RunFailed(f"cannot average stage {me.index}: {exc}") from None
        self._push_service.attach(averager)
        log.info("stage %d averages with %d replicas every %d steps (%s, %s)", me.index,
                 len(group) - 1, config.every_steps, averager.topology, config.codec)  # fmt: skip
        return Averaging(config=config, averager=averager)


async def _raise_when_failed(session: Session) -> None:
    """Raise PeerUnavailable when the session's upstream stream breaks mid-run."""
    await session.upstream_failed
