"""The stage runtime: one node's share of the model, kept busy while bytes move.

A stage owns blocks [first_block, stop_block) of the model. The first stage reads data and
produces microbatches; every stage runs forward on what it receives and sends the activation
downstream; the last stage computes the loss and starts the backward pass; activation gradients
flow back upstream, and each stage steps its own optimizer as soon as it has the gradients of all
microbatches of a step, without waiting for any other stage.

The runtime composes the parts that do this, each in its own module:
- schedule.py: the schedule's decisions (the staleness bound, admission, where a plan ends);
- inbox.py: received frames, admitted, decoded and queued for the loop;
- compute.py and weights.py: the torch work on the compute thread, weight stashing and weight
  prediction; encoder.py: the frames it sends, through the codec choices;
- replica_rounds.py: averaging with the replica group; counters.py: the metrics it keeps;
- ahead.py: when the stage stops waiting for the update's gradients before it runs ahead;
- evaluation.py: the evaluations on held-out data the last stage has finished.

**The schedule** (1F1B): backward work first (it frees memory and unblocks the stages upstream),
then a forward the bound allows, then (first stage) a new microbatch. The compute loop waits on
an event when there is nothing it may do, never polls. All torch work runs on one compute
thread; the event loop only moves bytes and makes decisions. Frames are checked against the plan
and the schedule on the event loop as they arrive (`accept_from_*`) and decoded in a worker
thread before they are queued: a refused frame, malformed payloads included, changes nothing.
Sends go through the links' bounded outboxes, so network I/O overlaps compute and a slow
neighbour applies backpressure. A frame is encoded on the encoder's coder thread while the
compute thread goes on (`_send`): each link queues its frames in order, and the loop goes on
with at most one frame of a link not yet queued (its encoding overlaps the next piece of work).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any

import torch

from ravnest_node.blocks import BlockWeights
from ravnest_node.errors import ConfigError, FrameError
from ravnest_node.models import BlockModel
from ravnest_node.pipeline.ahead import Ahead, AheadSwitch
from ravnest_node.pipeline.audit import AuditRecord
from ravnest_node.pipeline.auditor import Auditor
from ravnest_node.pipeline.codec_choice import CodecChoice
from ravnest_node.pipeline.compute import StageCompute
from ravnest_node.pipeline.counters import StageCounters
from ravnest_node.pipeline.evaluation import Evaluations
from ravnest_node.pipeline.inbox import Inbox, Received
from ravnest_node.pipeline.metrics import StageMetrics, StepReport
from ravnest_node.pipeline.replica_rounds import Averaging, ReplicaRounds
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import (
    GRAD,
    HIDDEN,
    TARGETS,
    Schedule,
    StageSpec,
    expected_tensors,
)
from ravnest_node.transport.boundary import BoundaryLink
from ravnest_node.transport.frames import Frame, FrameKind
from ravnest_node.transport.resume import ResumeState

__all__ = ["GRAD", "HIDDEN", "TARGETS", "Averaging", "StageRuntime", "StageSpec"]

log = logging.getLogger(__name__)


def _dataset(model: BlockModel, spec: StageSpec, run: TrainConfig) -> Any:
    """The first stage's data: its pipeline's shard of the run's dataset."""
    return model.dataset(
        seed=run.seed,
        shard=spec.pipeline,
        num_shards=spec.num_pipelines,
        num_samples=run.dataset_samples,
    )


class StageRuntime:
    """Trains one stage under one plan: from `start_step` until the run's last step is
    applied, or until the step the plan ends at (`drain_step`, `stop_at`, `upstream_ended`)."""

    def __init__(
        self,
        *,
        spec: StageSpec,
        model: BlockModel,
        blocks: list[torch.nn.Module],
        run: TrainConfig,
        compute: Executor,
        report: Callable[[StepReport], Awaitable[None]],
        upstream: BoundaryLink | None = None,
        downstream: BoundaryLink | None = None,
        averaging: Averaging | None = None,
        start_step: int = 0,
        restore: Mapping[int, BlockWeights] | None = None,
        block_delay_s: float = 0.0,
        checkpoint: Callable[[int, dict[int, BlockWeights]], Awaitable[None]] | None = None,
        device: torch.device | None = None,
        auditor: Auditor | None = None,
    ) -> None:
        """`device`: where the stage computes (the CPU if None), in the precision it resolves
        the run's to (StageCompute); `auditor`: audits the neighbours' frames (auditor.py)."""
        self.spec = spec
        self.run_config = run
        self.upstream = upstream
        self.downstream = downstream
        self._report = report
        self._checkpoint = checkpoint
        """Called with (step, blocks) after every `checkpoint_every` steps (an averaging round
        begun at that step not applied yet: the replica's own weights of that step) and at the
        run's end (every round applied)."""
        self._compute = StageCompute(
            spec=spec, model=model, blocks=blocks, run=run, executor=compute, restore=restore,
            block_delay_s=block_delay_s, averaging=averaging.config if averaging else None,
            device=device,
        )  # fmt: skip
        self._data = _dataset(model, spec, run) if spec.is_first else None
        forward, backward = expected_tensors(model, spec, run.microbatch_size)
        self._schedule = Schedule(
            spec, run, start_step=start_step, forward=forward, backward=backward
        )
        # Metrics; the compute thread keeps its own (compute_s, the encoder's byte counts).
        self._counters = StageCounters(run.max_staleness)
        self._ahead = AheadSwitch(run)
        self._inbox = Inbox(self._schedule, self._counters.counts)
        self.auditor = auditor
        if auditor is not None:
            self._inbox.on_admitted = self._audit
            # Records from the downstream come over the link gradients go up, and back.
            auditor.budget(
                lambda backward: (
                    (self.activation_codec if backward else self.gradient_codec).bandwidth_bps
                ),
                first_bytes=sum(p.numel() for b in blocks for p in b.parameters()),
            )
        self._evals = Evaluations(run.eval_microbatches)
        self._eval_data = None
        if spec.is_first and self._schedule.evaluates:
            self._eval_data = model.eval_dataset(seed=run.seed)
            if self._eval_data is None:
                raise ConfigError(f"eval_every={run.eval_every}: model {model.name!r} has no "
                                  "held-out data")  # fmt: skip
        self._rounds = (
            ReplicaRounds(averaging, self._compute, self._counters, self._inbox.wake, spec.index)
            if averaging is not None
            else None
        )
        self._snapshots: list[asyncio.Future[dict[int, BlockWeights]]] | None = None
        """Waiters for `snapshot` while the loop runs; None while it does not."""
        self.last_loss = math.nan
        """The loss of the last step applied (the last stage only)."""
        self._sends: dict[int, asyncio.Task[None]] = {}
        """id(link) -> the task that queues the last frame given to that link, once coded."""
        self.ended = asyncio.Event()
        """Set when `run()` has returned normally: this plan's part is trained, the last
        averaging round applied; the weights are those of step `version`."""

    # ----- what the stage is at, on the event loop ----------------------------------------------
    @property
    def version(self) -> int:
        """Optimizer steps applied."""
        return self._schedule.version

    @property
    def start_step(self) -> int:
        return self._schedule.start_step

    @property
    def window(self) -> int:
        """Most frames of one direction that may wait for the compute loop (and most
        microbatches between forward and backward)."""
        return self._schedule.window

    @property
    def activation_codec(self) -> CodecChoice:
        """The codec of activations sent downstream (the worker sets the link's bandwidth)."""
        return self._compute.encoder.activation

    @property
    def gradient_codec(self) -> CodecChoice:
        """The codec of gradients sent upstream."""
        return self._compute.encoder.gradient

    @property
    def compute_s(self) -> float:
        """Seconds spent in torch work so far."""
        return self._compute.compute_s

    @property
    def frames_accepted(self) -> int:
        return self._inbox.accepted

    @property
    def received_all_forwards(self) -> bool:
        return self._schedule.received_all_forwards

    @property
    def run_done(self) -> bool:
        """The run's last step is applied (not just this plan's)."""
        return self._schedule.run_done

    @property
    def done(self) -> bool:
        """This plan's part of the run is done."""
        return self._schedule.done

    @property
    def data_fingerprint(self) -> str:
        return self._data.fingerprint if self._data is not None else ""

    @property
    def in_flight(self) -> int:
        """Microbatches between forward and backward on this stage."""
        return len(self._compute.in_flight)

    @property
    def queued(self) -> int:
        """Admitted frames waiting for the compute loop."""
        return self._inbox.queued

    @property
    def device(self) -> torch.device:
        """The device this stage computes on."""
        return self._compute.device

    @property
    def precision(self) -> str:
        """The precision this stage computes in: fp32, bf16 or fp16."""
        return self._compute.precision

    @property
    def first_seq(self) -> int:
        """The first microbatch of this plan."""
        return self._schedule.start_step * self.run_config.microbatches

    def admitted_forwards(self) -> ResumeState:
        """What this stage has admitted from its upstream (for a resumed stream)."""
        return ResumeState(next_forward=self._schedule.next_forward_seq)

    def admitted_gradients(self) -> ResumeState:
        """Which gradients this stage still awaits from its downstream (for a resumed
        stream)."""
        return ResumeState(awaiting=tuple(sorted(self._schedule.awaiting_grad)))

    @property
    def evaluations(self) -> Evaluations:
        """The evaluations this stage finished (the last stage of pipeline 0)."""
        return self._evals

    def metrics(self) -> StageMetrics:
        links = [link for link in (self.upstream, self.downstream) if link is not None]
        evals = self._evals
        metrics = dataclasses.replace(
            self._counters.record(self.spec, self._compute),
            stream_resumes=sum(link.resumes for link in links),
            frames_resent=sum(link.frames_resent for link in links),
            eval_step=evals.step,
            eval_loss=evals.loss if evals.step else 0.0,
            evals_lost=evals.lost,
        )
        if self.auditor is None:
            return metrics
        c = self.auditor.counts
        return dataclasses.replace(
            metrics, audits=c.audits, audits_failed=c.failed, audits_unanswered=c.unanswered,
            audits_skipped=c.skipped,
            audit_bytes=c.record_bytes, audit_s=c.seconds, audit_max_passed=c.max_distance_passed,
        )  # fmt: skip

    # ----- decisions, on the event loop -------------------------------------------------------
    async def accept_from_upstream(self, frame: Frame) -> None:
        """Admit a frame from the previous stage: only activations travel that way."""
        if frame.kind not in (FrameKind.FORWARD, FrameKind.EVAL):
            raise FrameError("only forward frames travel downstream")
        await self._inbox.admit(frame)
        if self.upstream is not None and frame.kind is FrameKind.FORWARD:
            # The upstream computed this forward at a version >= its step - max_staleness:
            # it has admitted every gradient of the steps before that (resume.py).
            m = self.run_config.microbatches
            oldest = frame.seq // m - self.run_config.max_staleness
            self.upstream.log.ack_below(oldest * m)

    def _audit(self, frame: Frame, tensors: dict[str, torch.Tensor]) -> None:
        """A training frame admitted: maybe audit it (auditor.py)."""
        assert self.auditor is not None
        backward = frame.kind is FrameKind.BACKWARD
        name = GRAD if backward else HIDDEN
        codec = next((h.codec.name for h in frame.headers if h.name == name), "")
        self.auditor.consider(backward, frame.seq, tensors[name], codec)

    def audit_record(self, backward: bool, seq: int) -> AuditRecord | None:
        """What this stage computed microbatch `seq`'s output (`backward`: its input's
        gradient) from, while it keeps it (audit.py); None otherwise."""
        records = self._compute.records
        return records.get(backward, seq) if records is not None else None

    async def check_from_upstream(self, frame: Frame) -> None:
        """Test only (a node's fault_fuzz_upstream): FrameError where `accept_from_upstream`
        would refuse the frame now, its payload decoded; nothing is admitted or changed."""
        if frame.kind not in (FrameKind.FORWARD, FrameKind.EVAL):
            raise FrameError("only forward frames travel downstream")
        await self._inbox.check(frame)

    async def accept_from_downstream(self, frame: Frame) -> None:
        """Admit a frame from the next stage: only gradients travel that way."""
        if frame.kind is not FrameKind.BACKWARD:
            raise FrameError("only gradient frames travel upstream")
        await self._inbox.admit(frame)
        if self.downstream is not None:  # its forward can no longer be needed
            self.downstream.log.ack(frame.seq)

    def drain_step(self) -> int:
        """First stage, when a new plan is coming: feed no microbatch of a step not yet
        started; returns the step it stops at (this plan then ends there or later, `stop_at`)."""
        return self._schedule.drain_step()

    def stop_at(self, step: int) -> None:
        """This plan ends once `step` steps are applied (the coordinator's answer to the
        first stages' `drain_step`). ValueError if this stage is already past it."""
        self._schedule.stop_at(step)
        self._inbox.wake.set()

    def upstream_finished(self) -> None:
        """The previous stage ended its stream cleanly: no frame comes any more (an
        evaluation this stage waits for at the run's end was lost on the way)."""
        self._schedule.upstream_closed = True
        self._inbox.wake.set()

    def upstream_ended(self) -> bool:
        """The previous stage ended its stream cleanly before the run's end: its plan ended
        after the forwards it sent. Stop there; False (and no change) if that is not a step
        boundary, which no drained stage would do."""
        step = self._schedule.upstream_end_step()
        if step is None:
            return False
        self.stop_at(step)
        return True

    async def export(self) -> dict[int, BlockWeights]:
        """Copies of this stage's blocks and their optimizer moments, for the next plan."""
        return await self._compute.call(self._compute.export, self.version)

    async def snapshot(self) -> dict[int, BlockWeights]:
        """Copies of this stage's blocks at its current step (`version`), taken by the loop
        between two pieces of its work, where weights and step agree (a stopping node
        checkpoints them). Empty if the loop is not running, or ends first: a loop stopped
        midway may have stepped its weights without counting the step."""
        if self._snapshots is None:
            return {}
        waiter: asyncio.Future[dict[int, BlockWeights]] = asyncio.get_running_loop().create_future()
        self._snapshots.append(waiter)
        self._inbox.wake.set()
        return await waiter

    async def params_digest(self) -> str:
        """sha256 of the stage's parameters, to show that something did or did not change them.

        Computed on the compute thread (between torch ops) at most once per weight version,
        however often it is asked for."""
        return await self._compute.params_digest(self.version)

    # ----- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Train until this plan's last step is applied; at the run's end, send the final
        report. Ends the downstream stream cleanly either way."""
        self._counters.started = time.monotonic()
        self._snapshots = []
        try:
            await self._loop()
            await self._flush_sends()
        finally:
            for task in self._sends.values():  # (done already, unless the loop failed)
                task.cancel()
            self._compute.encoder.close()
            if self.auditor is not None:
                await self.auditor.close()
            waiters, self._snapshots = self._snapshots, None
            for waiter in waiters:  # the loop ended first: no snapshot for them
                if not waiter.done():
                    waiter.set_result({})
        self._evals.end()  # (an evaluation still missing microbatches will not get them)
        if self._rounds is not None and self._rounds.in_flight:  # the run ends with it applied
            await self._rounds.finish()
        if self.run_done:
            await self._final_report()
        # (otherwise this plan's part ends here; the next plan carries on)
        if self.downstream is not None:
            await self.downstream.close()
        self.ended.set()

    async def _final_report(self) -> None:
        """The run's end: checkpoint the trained model (every round applied) and report."""
        if self._checkpoint is not None:
            await self._checkpoint(self.version, await self.export())
        params_sq_sum, num_params = await self._compute.call(self._compute.weights.stats)
        await self._report(
            StepReport(
                step=self.version,
                loss=math.nan,
                done=True,
                metrics=self.metrics(),
                params_sq_sum=params_sq_sum,
                num_params=num_params,
            )
        )

    async def _loop(self) -> None:
        inbox, schedule = self._inbox, self._schedule
        while not schedule.done:
            if self._snapshots:  # between two pieces of work: weights and version agree
                blocks = await self.export()
                waiters, self._snapshots = self._snapshots, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(blocks)
            elif self._rounds is not None and self._rounds.arrived:  # an averaged result
                await self._rounds.finish()
            elif inbox.backwards:  # 1F1B: backward work first
                await self._on_backward(inbox.backwards.popleft())
            elif inbox.evals:  # no gradient to wait for, and no bound
                await self._on_eval(inbox.evals.popleft())
            elif inbox.forwards and schedule.may_forward(inbox.forwards[0].seq):
                received = inbox.forwards.popleft()
                await self._on_forward(received.seq, received.tensors, received.samples)
            elif self.spec.is_first and schedule.may_produce():
                await self._produce(schedule.produce())
            else:
                await self._idle()

    async def _idle(self) -> None:
        """Wait for a frame or a finished send; the time counts against the neighbour that
        would have given us work (upstream when a forward would be allowed now)."""
        forwards = self._inbox.forwards
        waiting_for_upstream = self._schedule.waiting_for_upstream(bool(forwards))
        held = self._schedule.held_for_gradients(forwards[0].seq if forwards else None)
        wake = self._inbox.wake
        wake.clear()
        started = time.monotonic()
        await wake.wait()
        seconds = time.monotonic() - started
        self._counters.idle(seconds, upstream=waiting_for_upstream)
        if held:
            self._counters.counts.ahead_wait_s += seconds

    async def _produce(self, seq: int) -> None:
        assert self._data is not None
        m = self.run_config.microbatches
        step, i = divmod(seq, m)
        x, y = self._data.batch(step, self.run_config.batch_size)
        # Sample ids travel only in a fixed-dataset run (aq-delta's): others send none.
        ids = (self._data.sample_ids(step, self.run_config.batch_size)
               if self.run_config.dataset_samples else [])  # fmt: skip
        mb = self.run_config.microbatch_size
        rows = slice(i * mb, (i + 1) * mb)
        tensors = {HIDDEN: x[rows], TARGETS: y[rows]}
        await self._on_forward(seq, tensors, tuple(ids[rows]))

    async def _on_forward(
        self, seq: int, received: dict[str, torch.Tensor], samples: tuple[int, ...]
    ) -> None:
        assert self._schedule.may_forward(seq), (seq, self.version)
        compute, counters = self._compute, self._counters.counts
        if self.spec.is_last:
            message = await compute.call(compute.forward_loss_backward, seq, self.version, received)
            counters.max_weight_versions = max(counters.max_weight_versions, compute.live_versions)
            self._record_staleness(0)
            if message is not None:
                await self._send_upstream(message, seq)
            await self._microbatch_done(seq)
        else:
            message = await compute.call(compute.forward, seq, self.version, received, samples)
            self._schedule.sent_forward(seq)
            counters.max_in_flight = max(counters.max_in_flight, len(compute.in_flight))
            counters.max_weight_versions = max(counters.max_weight_versions, compute.live_versions)
            assert self.downstream is not None
            await self._send(self.downstream, message, seq, activations=True)

    async def _change_ahead(self, change: Ahead) -> None:
        """Stop or start waiting for the update's gradients before running ahead (ahead.py)."""
        on = change is not Ahead.REVERT
        if change is not Ahead.KEEP:
            await self._compute.call(self._compute.weights.whole_step_ahead, on)
            self._schedule.whole_step_ahead(on)
        counts = self._counters.counts
        if change is Ahead.TRY:
            counts.ahead_trial_from = self.version
        elif change is Ahead.KEEP:
            counts.whole_step_ahead_from = self.version
        a = self._ahead
        log.info(
            "ahead: %s at step %d (waited %.0f%% of the time; mean step %.3f s waiting, %s)",
            change.value, self.version, 100 * (a.share or 0.0), a.step_s or 0.0,
            "-" if a.trial_step_s is None else f"{a.trial_step_s:.3f} s with the whole step ahead",
        )  # fmt: skip

    async def _evaluate(self, step: int) -> None:
        """First stage of pipeline 0, step `step` just applied: the evaluation after it, its
        microbatches sent down the pipeline (a single stage takes their losses itself). The
        same held-out batches every time."""
        assert self._eval_data is not None
        run, schedule = self.run_config, self._schedule
        mb = run.microbatch_size
        for b in range(run.eval_batches):
            x, y = self._eval_data.batch(b, run.batch_size)
            for i in range(run.microbatches):
                seq, rows = b * run.microbatches + i, slice(i * mb, (i + 1) * mb)
                schedule.admitted(FrameKind.EVAL, seq, step)
                tensors = {HIDDEN: x[rows], TARGETS: y[rows]}
                await self._on_eval(Received(FrameKind.EVAL, seq, step, tensors))

    async def _on_eval(self, frame: Received) -> None:
        """Microbatch `frame.seq` of the evaluation after step `frame.version`: forward with
        the current weights and on downstream, or (last stage) its loss."""
        compute = self._compute
        if self.spec.is_last:
            loss = await compute.call(compute.eval_loss, frame.tensors)
            if self._evals.add(frame.version, frame.seq, loss):
                log.info("evaluation after step %d: loss %.4f", self._evals.step, self._evals.loss)
        else:
            message = await compute.call(
                compute.eval_forward, frame.seq, frame.version, frame.tensors
            )
            assert self.downstream is not None
            await self._send(self.downstream, message, None, activations=True)
        self._schedule.eval_passed(frame.version, frame.seq)

    async def _on_backward(self, frame: Received) -> None:
        compute = self._compute
        forward_version, message = await compute.call(
            compute.backward, frame.seq, frame.tensors[GRAD]
        )
        self._record_staleness(self.version - forward_version)
        if message is not None:
            await self._send_upstream(message, frame.seq)
        await self._microbatch_done(frame.seq)

    def _record_staleness(self, staleness: int) -> None:
        self._schedule.check_staleness(staleness)
        self._counters.staleness[staleness] += 1

    async def _send_upstream(self, message: Future[bytes], seq: int) -> None:
        assert self.upstream is not None
        await self._send(self.upstream, message, seq, activations=False)

    async def _send(
        self, link: BoundaryLink, message: Future[bytes], seq: int | None, *, activations: bool
    ) -> None:
        """Queue microbatch `seq`'s frame (None: an evaluation's, never resent) on a link
        once it is coded, after the link's frames before it; returns when the link's frame
        before this one is queued. Time spent waiting for that (its coding, or room in the
        outbox: a slow neighbour, or one unreachable while its stream is resumed) counts as
        idle on that side."""
        previous = self._sends.get(id(link))
        self._sends[id(link)] = asyncio.create_task(
            self._queue_when_coded(previous, link, message, seq, activations)
        )
        if previous is not None:
            started = time.monotonic()
            await previous
            self._counters.idle(time.monotonic() - started, upstream=link is not self.downstream)

    async def _queue_when_coded(
        self,
        previous: asyncio.Task[None] | None,
        link: BoundaryLink,
        message: Future[bytes],
        seq: int | None,
        activations: bool,
    ) -> None:
        if previous is not None:
            await previous
        frame = await asyncio.wrap_future(message)
        counts = self._counters.counts
        if seq is not None:  # (an evaluation's frame: the link's counters have it, not training's)
            if activations:
                counts.activation_bytes_sent += len(frame)
            else:
                counts.gradient_bytes_sent += len(frame)
        await link.send(frame, seq)

    async def _flush_sends(self) -> None:
        """Wait until every frame given to a link is queued on it (the time counts as idle on
        that side)."""
        for key, task in list(self._sends.items()):
            started = time.monotonic()
            await task
            upstream = self.downstream is None or key != id(self.downstream)
            self._counters.idle(time.monotonic() - started, upstream=upstream)

    async def _microbatch_done(self, seq: int) -> None:
        if not self._schedule.microbatch_done(seq):
            return
        loss = await self._compute.call(self._compute.optimizer_step)
        self._schedule.stepped()
        change = self._ahead.stepped(self.version, self._counters.counts.ahead_wait_s)
        if change is not None:
            await self._change_ahead(change)
        if self._eval_data is not None and self.run_config.evaluates_at(self.version):
            if self.version < self._schedule.stop_step or self.run_done:
                await self._evaluate(self.version)
            else:  # (the stages after it end their plan here and may be gone)
                log.info("no evaluation after step %d: this plan ends there", self.version)
        loss = loss if self.spec.is_last else math.nan
        self.last_loss = loss
        self._inbox.wake.set()  # the bound moved: forwards may be allowed now
        if self._rounds is not None and self._rounds.lands(self.version):
            await self._rounds.finish()  # (before the next step's forwards: the same every run)
        if self._rounds is not None and self._rounds.due(self.version):
            await self._rounds.begin(self.version)
        every = self.run_config.checkpoint_every
        if (
            self._checkpoint is not None
            and every
            and self.version % every == 0
            and not self.run_done  # the run's end is checkpointed once its last round is in
        ):
            await self._checkpoint(self.version, await self.export())
        await self._report(
            StepReport(step=self.version, loss=loss, done=False, metrics=self.metrics())
        )
