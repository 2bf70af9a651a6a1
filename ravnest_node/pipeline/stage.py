"""The stage runtime: one node's share of the model, kept busy while bytes move.

A stage owns blocks [first_block, stop_block) of the model. The first stage reads data and
produces microbatches; every stage runs forward on what it receives and sends the activation
downstream; the last stage computes the loss and starts the backward pass; activation gradients
flow back upstream, and each stage steps its own optimizer as soon as it has the gradients of all
microbatches of a step, without waiting for any other stage.

**The staleness bound.** A stage's weight version is the number of optimizer steps it has
applied. A microbatch of step t may run forward on a stage only while t - version <= S
(`max_staleness`), so at most S updates land between a microbatch's forward and its backward on
any stage (its *staleness*, recorded per stage). The first stage therefore feeds microbatches of
up to S steps ahead while earlier gradients are still on their way back, and the pipeline holds
at most (S + 1) x microbatches microbatches per stage: that bounds the queues, the activations
kept for backward and the weight versions kept. S = 0 is synchronous training: every microbatch
of step t uses version t everywhere, exactly what one process computes.

**Weight stashing** (PipeDream, Narayanan et al., arXiv 1806.03377): a microbatch's backward uses
the very weights its forward used. Forward runs with `torch.func.functional_call` on a snapshot
of the parameters (at most S + 1 alive); gradients are moved from the snapshot into the
optimizer's parameters after each backward, and AdamW updates those in place.

**Weight prediction** (`weight_prediction`, on by default; SpecTrain, Chen et al., arXiv
1809.02839): a step t whose first forward runs at version v < t has its gradient applied
t - v updates later, to weights that have moved meanwhile. Its snapshot, taken at its first
microbatch and used by all of them, is therefore not the weights of version v but AdamW's
prediction of version t: w - (t - v) lr (m_hat / (sqrt(v_hat) + eps) + wd w), the update
AdamW's current moments would apply, repeated. Under a constant gradient that is the weights
step t will have (up to weight decay compounding, a term of order (t - v)^2 lr^2 wd); after
the synchronous warm-up on bench-small it takes 40-45% off the loss that staleness costs
(docs/benchmarks.md). Synchronous steps (t = v) use the weights unchanged. Without prediction a
snapshot is the current version's, taken at its first forward and shared by the steps that
run forward with it.

**The schedule** (1F1B): backward work first (it frees memory and unblocks the stages upstream),
then a forward the bound allows, then (first stage) a new microbatch. The compute loop waits on
an event when there is nothing it may do, never polls. All torch work runs on one compute
thread; the event loop only moves bytes and makes decisions. Frames are checked against the plan
and the schedule on the event loop as they arrive (`accept_from_*`) and decoded in a worker
thread before they are queued: a refused frame, malformed payloads included, changes nothing.
Sends go through the links' bounded outboxes, so network I/O overlaps compute and a slow
neighbour applies backpressure.

**Replica averaging**: with several pipelines, every `average_every` steps the stage takes its
parameter delta and averages it with its replica group in the background (DiLoCo outer step,
docs/averaging.md); the result is applied between two microbatches when it arrives, and new
forwards use the averaged weights from then on.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import ParamSpec, TypeVar

import torch

from ravnest_node.averaging import AveragingConfig, OuterOptimizer, ReplicaAverager, RoundResult
from ravnest_node.blocks import BlockWeights, export_blocks, restore_blocks
from ravnest_node.compression import ACTIVATION_ONLY, SampleReferences, get_codec
from ravnest_node.compression.transform import KLTBases
from ravnest_node.errors import FrameError
from ravnest_node.models import BlockModel
from ravnest_node.pipeline.codec_choice import CodecChoice
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.transport.boundary import BoundaryLink
from ravnest_node.transport.frames import (
    LZ4_MIN_RATIO,
    Expected,
    Frame,
    FrameKind,
    Outgoing,
    check_tensors,
    encode_frame,
)

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

HIDDEN = "hidden"
TARGETS = "targets"
GRAD = "grad"


@dataclass(frozen=True, slots=True)
class StageSpec:
    """Where a stage sits in its pipeline."""

    index: int
    num_stages: int
    first_block: int
    stop_block: int
    pipeline: int = 0
    num_pipelines: int = 1

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


@dataclass(frozen=True, slots=True)
class Received:
    """An admitted frame, decoded: what the compute loop works on."""

    kind: FrameKind
    seq: int
    version: int
    tensors: dict[str, torch.Tensor]
    samples: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StageMetrics:
    """What a stage measured about its own schedule, for reports and benchmarks."""

    wall_s: float = 0.0
    """Seconds since the stage's run started."""
    compute_s: float = 0.0
    """Seconds spent in torch work (forward, backward, optimizer, codecs)."""
    idle_upstream_s: float = 0.0
    """Seconds the compute loop had nothing to do but wait for the previous stage."""
    idle_downstream_s: float = 0.0
    """Seconds it waited for the next stage: for gradients, or for room in the outbox."""
    staleness: tuple[int, ...] = ()
    """Histogram: staleness[k] microbatches saw k updates between forward and backward."""
    max_in_flight: int = 0
    """Most microbatches this stage held between forward and backward at once."""
    max_weight_versions: int = 0
    """Most weight snapshots this stage kept at once."""
    activation_bytes_sent: int = 0
    gradient_bytes_sent: int = 0
    activation_fp32_bytes: int = 0
    """Bytes the activations sent would take as float32: against activation_bytes_sent, the
    codec's ratio."""
    gradient_fp32_bytes: int = 0
    """Bytes the gradients sent would take as float32."""
    averaging_rounds: int = 0
    """Averaging rounds applied."""
    averaging_rounds_incomplete: int = 0
    """Rounds in which some replica was missing, rejected or banned."""
    averaging_bytes_sent: int = 0
    """Bytes this stage pushed to its replicas."""
    averaging_wait_s: float = 0.0
    """Seconds the compute loop spent on averaging: taking deltas, applying results, and
    waiting for a round still in flight when the next was due or the run ended."""
    activation_codec: str = ""
    """Codec of the last activation frame sent downstream ("" on the last stage)."""
    gradient_codec: str = ""
    """Codec of the last gradient frame sent upstream ("" on the first stage)."""
    activation_codec_frames: dict[str, int] = field(default_factory=dict)
    """Activation frames sent, per codec."""
    gradient_codec_frames: dict[str, int] = field(default_factory=dict)
    """Gradient frames sent, per codec."""
    activation_deflated_frames: int = 0
    """Activation frames whose payload `auto` asked to pack with deflate."""
    gradient_deflated_frames: int = 0
    """Gradient frames whose payload `auto` asked to pack with deflate."""
    downstream_bandwidth_bps: float = 0.0
    """Bandwidth `auto` measured towards the next stage, bits/s (0: not measured)."""
    upstream_bandwidth_bps: float = 0.0
    """Bandwidth `auto` measured towards the previous stage, bits/s (0: not measured)."""

    @property
    def busy_fraction(self) -> float:
        return self.compute_s / self.wall_s if self.wall_s > 0 else math.nan


@dataclass(frozen=True, slots=True)
class StepReport:
    """What a stage tells the coordinator after each optimizer step."""

    step: int
    loss: float
    done: bool
    metrics: StageMetrics
    params_sq_sum: float = math.nan
    num_params: int = 0


Weights = dict[str, torch.Tensor]
_THIS_VERSION = -1
"""Key of the snapshot of the current version in `StageRuntime._step_weights` (no prediction)."""


@dataclass(slots=True)
class _InFlight:
    """A microbatch between its forward and its backward on this stage."""

    version: int
    weights: Weights
    """The snapshot its forward used, which its backward uses too (weight stashing)."""
    inputs: torch.Tensor
    outputs: torch.Tensor | list[torch.Tensor]
    """The forward's output with its graph; under recomputation, the input of each block
    after the first, without a graph (the backward runs each block's forward again)."""


@dataclass(frozen=True, slots=True)
class Averaging:
    """A stage's replica group: how and with whom it averages (docs/averaging.md)."""

    config: AveragingConfig
    averager: ReplicaAverager


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
    ) -> None:
        self.spec = spec
        self._checkpoint = checkpoint
        """Called with (step, blocks) after every `checkpoint_every` steps (an averaging round
        begun at that step not applied yet: the replica's own weights of that step) and at the
        run's end (every round applied)."""
        self._snapshots: list[asyncio.Future[dict[int, BlockWeights]]] = []
        self._looping = False
        self.ended = asyncio.Event()
        """Set when `run()` has returned normally: this plan's part is trained, the last
        averaging round applied; the weights are those of step `version`."""
        self.block_delay_s = block_delay_s
        self.run_config = run
        self._model = model
        self._compute = compute
        self._report = report
        self.upstream = upstream
        self.downstream = downstream
        self._raw = get_codec("none")
        # The codec (and its sender state) of each role on its link: fixed, or chosen by `auto`
        # from the link's measured bandwidth and this stage's compute time (codec_choice.py).
        self.activation_codec = CodecChoice(
            run.activation, "activation", compute_s=lambda: self.compute_s,
            every=run.microbatches, what=f"stage {spec.index} activations downstream",
            packs=run.lz4,
        )  # fmt: skip
        self.gradient_codec = CodecChoice(
            run.gradient, "gradient", compute_s=lambda: self.compute_s,
            every=run.microbatches, what=f"stage {spec.index} gradients upstream",
            packs=run.lz4,
        )  # fmt: skip
        self._lz4_ratio = LZ4_MIN_RATIO if run.lz4 else 0.0
        mb = run.microbatch_size
        self._blocks = torch.nn.Sequential(*blocks)
        self._params = dict(self._blocks.named_parameters())
        # A stage of frozen blocks only (LoRA's embeddings) has no parameters: its optimizer
        # then holds one empty placeholder, and its steps change nothing.
        trained = list(self._params.values()) or [torch.nn.Parameter(torch.empty(0))]
        self._optimizer = torch.optim.AdamW(trained, lr=run.lr, weight_decay=run.weight_decay)
        if restore:
            restore_blocks(self._blocks, spec.first_block, self._optimizer, restore)
        self._data = (
            model.dataset(
                seed=run.seed,
                shard=spec.pipeline,
                num_shards=spec.num_pipelines,
                num_samples=run.dataset_samples,
            )
            if spec.is_first
            else None
        )
        # Receiver state per incoming stream: klt's basis (kept whatever the run's codecs, as
        # a sender may pick klt by itself), and for aq-delta the reference of every sample.
        self._references: dict[str, SampleReferences | KLTBases] = {}
        if not spec.is_first:
            self._references[HIDDEN] = (
                SampleReferences(limit=run.dataset_samples)
                if run.activation in ACTIVATION_ONLY
                else KLTBases()
            )
        if not spec.is_last:
            self._references[GRAD] = KLTBases()
        targets = model.target_spec(mb)
        self._expected_forward = [Expected(TARGETS, targets.shape, targets.dtype)]
        if not spec.is_first:
            hidden = model.output_spec(spec.first_block - 1, mb)
            self._expected_forward.insert(0, Expected(HIDDEN, hidden.shape, hidden.dtype))
        out = model.output_spec(spec.stop_block - 1, mb)
        self._expected_backward = [Expected(GRAD, out.shape, out.dtype)]
        if not 0 <= start_step < run.steps:
            raise ValueError(f"start_step {start_step} outside 0..{run.steps - 1}")
        self._stop_step = run.steps  # the plan's last step, once known; the run's until then
        self._feed_limit = run.steps  # first stage: feeds no step from this one on
        # Admitted frames waiting for the compute loop. The schedule bounds each queue by the
        # window: a peer that sends more is refused.
        self.window = run.window
        self._forwards: deque[Received] = deque()
        self._backwards: deque[Received] = deque()
        self._wake = asyncio.Event()  # set whenever there may be new work or room
        self._next_forward_seq = start_step * run.microbatches  # next forward we accept
        self._produced = start_step * run.microbatches  # first stage: microbatches fed
        self._awaiting_grad: set[int] = set()  # sent downstream, gradient not yet received
        self._in_flight: dict[int, _InFlight] = {}  # seq -> what its backward needs
        # step -> (version it was taken at, weight snapshot) for steps whose microbatches are
        # still running forward (weight stashing), or _THIS_VERSION -> the current version's
        # without weight prediction; microbatches in flight hold theirs.
        self._step_weights: dict[int, tuple[int, Weights]] = {}
        # Replica averaging: the outer optimizer, and the round in flight (at most one).
        self._averaging = averaging
        self._outer = (
            OuterOptimizer(list(self._params.values()), averaging.config) if averaging else None
        )
        self._round: asyncio.Task[RoundResult] | None = None
        self._rounds = 0
        self._rounds_incomplete = 0
        self._averaging_bytes = 0
        self._averaging_wait_s = 0.0
        self.start_step = start_step
        self.version = start_step  # optimizer steps applied
        self._step_loss = 0.0
        self.last_loss = math.nan
        """The loss of the last step applied (the last stage only)."""
        self._step_done = 0  # microbatches of the current step whose backward is done
        self.frames_accepted = 0
        # Metrics; compute_s is written by the compute thread only, the rest by the loop.
        self.compute_s = 0.0
        self._started = time.monotonic()
        self._idle_upstream_s = 0.0
        self._idle_downstream_s = 0.0
        self._staleness: list[int] = [0] * (run.max_staleness + 1)
        self._max_in_flight = 0
        self._max_versions = 0
        self.activation_bytes_sent = 0
        self.gradient_bytes_sent = 0
        self.activation_fp32_bytes = 0
        self.gradient_fp32_bytes = 0
        self._digest: tuple[int, str] | None = None
        self._digest_lock = asyncio.Lock()

    # ----- decisions, on the event loop -------------------------------------------------------
    async def accept_from_upstream(self, frame: Frame) -> None:
        """Admit a frame from the previous stage: only activations travel that way."""
        if frame.kind is not FrameKind.FORWARD:
            raise FrameError("only forward frames travel downstream")
        await self._admit(frame)

    async def check_from_upstream(self, frame: Frame) -> None:
        """Test only (a node's fault_fuzz_upstream): FrameError where `accept_from_upstream`
        would refuse the frame now, its payload decoded; nothing is admitted or changed."""
        if frame.kind is not FrameKind.FORWARD:
            raise FrameError("only forward frames travel downstream")
        self._check(frame)
        if len(self._forwards) >= self.window:
            raise FrameError("more frames in flight than the schedule allows")
        await asyncio.to_thread(frame.decode_with, self._references)

    async def accept_from_downstream(self, frame: Frame) -> None:
        """Admit a frame from the next stage: only gradients travel that way."""
        if frame.kind is not FrameKind.BACKWARD:
            raise FrameError("only gradient frames travel upstream")
        await self._admit(frame)

    async def _admit(self, frame: Frame) -> None:
        """Check a received frame against the plan and the schedule, decode it, and queue it;
        FrameError (and no change) if it does not fit or its payload does not decode. The
        checks and the bookkeeping run on the event loop, so they never race the compute loop;
        frames of one stream are admitted one at a time, in order."""
        self._check(frame)
        queue = self._forwards if frame.kind is FrameKind.FORWARD else self._backwards
        if len(queue) >= self.window:
            raise FrameError("more frames in flight than the schedule allows")
        # Decoding validates the payload's content (codes, scales, indices, lz4); do it before
        # anything changes, off the event loop and off the compute thread.
        tensors, commit = await asyncio.to_thread(frame.decode_with, self._references)
        if len(queue) >= self.window:
            raise FrameError("more frames in flight than the schedule allows")
        # No await from the check above to here: the frame's effect on receiver state
        # (aq-delta references) is applied only now that it is admitted.
        commit()
        queue.append(Received(frame.kind, frame.seq, frame.version, tensors, frame.samples))
        if frame.kind is FrameKind.FORWARD:
            self._next_forward_seq += 1
        else:
            self._awaiting_grad.discard(frame.seq)
        self.frames_accepted += 1
        self._wake.set()

    def _check(self, frame: Frame) -> None:
        m = self.run_config.microbatches
        step = frame.seq // m
        if frame.kind is FrameKind.FORWARD:
            if self.spec.is_first:
                raise FrameError("the first stage takes no forward frames")
            check_tensors(frame, self._expected_forward)
            if frame.seq >= self._total_microbatches:
                raise FrameError(
                    f"forward seq {frame.seq} is past the plan's last microbatch "
                    f"{self._total_microbatches - 1}"
                )
            if frame.seq != self._next_forward_seq:
                raise FrameError(f"forward seq {frame.seq}, expected {self._next_forward_seq}")
            self._check_samples(frame)
        else:
            if self.spec.is_last:
                raise FrameError("the last stage takes no gradient frames")
            check_tensors(frame, self._expected_backward)
            if frame.seq not in self._awaiting_grad:
                raise FrameError(f"gradient for microbatch {frame.seq}, which is not in flight")
        # The sender computed microbatch seq (of step seq // m) with weights no more than
        # max_staleness versions old, and not from the future.
        oldest = step - self.run_config.max_staleness
        if not oldest <= frame.version <= step:
            raise FrameError(
                f"{frame.kind.name.lower()} seq {frame.seq} carries weight version "
                f"{frame.version}, expected {step}"
                + (f" or down to {max(oldest, 0)}" if oldest < step else "")
            )

    def _check_samples(self, frame: Frame) -> None:
        """Forward frames of a fixed-dataset run list their rows' sample ids; others list none."""
        n = self.run_config.dataset_samples
        want = self.run_config.microbatch_size if n else 0
        if len(frame.samples) != want:
            raise FrameError(f"forward frame lists {len(frame.samples)} sample ids, not {want}")
        if any(s >= n for s in frame.samples) or len(set(frame.samples)) != len(frame.samples):
            raise FrameError(f"forward frame's sample ids must be distinct and below {n}")

    @property
    def _total_microbatches(self) -> int:
        """Microbatch seqs below this are this plan's to train."""
        return self._stop_step * self.run_config.microbatches

    @property
    def received_all_forwards(self) -> bool:
        return self._next_forward_seq >= self._total_microbatches

    @property
    def run_done(self) -> bool:
        """The run's last step is applied (not just this plan's)."""
        return self.version >= self.run_config.steps

    def drain_step(self) -> int:
        """First stage, when a new plan is coming: feed no microbatch of a step not yet
        started; returns the step it stops at (this plan then ends there or later, `stop_at`)."""
        assert self.spec.is_first
        m = self.run_config.microbatches
        self._feed_limit = min(self._feed_limit, self._stop_step, -(-self._produced // m))
        return self._feed_limit

    def stop_at(self, step: int) -> None:
        """This plan ends once `step` steps are applied (the coordinator's answer to the
        first stages' `drain_step`). ValueError if this stage is already past it."""
        if not self.version <= step <= self.run_config.steps:
            raise ValueError(f"cannot stop at step {step}: this stage is at {self.version}")
        if self.spec.is_first and step * self.run_config.microbatches < self._produced:
            raise ValueError(f"cannot stop at step {step}: microbatches of it are fed already")
        self._stop_step = self._feed_limit = step
        self._wake.set()

    def upstream_ended(self) -> bool:
        """The previous stage ended its stream cleanly before the run's end: its plan ended
        after the forwards it sent. Stop there; False (and no change) if that is not a step
        boundary, which no drained stage would do."""
        step, rest = divmod(self._next_forward_seq, self.run_config.microbatches)
        if rest or step < self.version:
            return False
        self.stop_at(step)
        return True

    async def export(self) -> dict[int, BlockWeights]:
        """Copies of this stage's blocks and their optimizer moments, for the next plan."""
        return await self._call(
            export_blocks, self._blocks, self.spec.first_block, self._optimizer, self.version
        )

    @property
    def data_fingerprint(self) -> str:
        return self._data.fingerprint if self._data is not None else ""

    @property
    def in_flight(self) -> int:
        """Microbatches between forward and backward on this stage."""
        return len(self._in_flight)

    @property
    def queued(self) -> int:
        """Admitted frames waiting for the compute loop."""
        return len(self._forwards) + len(self._backwards)

    @property
    def done(self) -> bool:
        """This plan's part of the run is done."""
        return self.version >= self._stop_step

    def metrics(self) -> StageMetrics:
        return StageMetrics(
            wall_s=time.monotonic() - self._started,
            compute_s=self.compute_s,
            idle_upstream_s=self._idle_upstream_s,
            idle_downstream_s=self._idle_downstream_s,
            staleness=tuple(self._staleness),
            max_in_flight=self._max_in_flight,
            max_weight_versions=self._max_versions,
            activation_bytes_sent=self.activation_bytes_sent,
            gradient_bytes_sent=self.gradient_bytes_sent,
            activation_fp32_bytes=self.activation_fp32_bytes,
            gradient_fp32_bytes=self.gradient_fp32_bytes,
            averaging_rounds=self._rounds,
            averaging_rounds_incomplete=self._rounds_incomplete,
            averaging_bytes_sent=self._averaging_bytes,
            averaging_wait_s=self._averaging_wait_s,
            activation_codec=self.activation_codec.name if not self.spec.is_last else "",
            gradient_codec=self.gradient_codec.name if not self.spec.is_first else "",
            activation_codec_frames=self.activation_codec.frames,
            gradient_codec_frames=self.gradient_codec.frames,
            activation_deflated_frames=self.activation_codec.deflated,
            gradient_deflated_frames=self.gradient_codec.deflated,
            downstream_bandwidth_bps=self.activation_codec.bandwidth_bps or 0.0,
            upstream_bandwidth_bps=self.gradient_codec.bandwidth_bps or 0.0,
        )

    # ----- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Train until this plan's last step is applied; at the run's end, send the final
        report. Ends the downstream stream cleanly either way."""
        self._started = time.monotonic()
        self._looping = True
        try:
            await self._loop()
        finally:
            self._looping = False
            for waiter in self._snapshots:  # the loop ended first: no snapshot for them
                if not waiter.done():
                    waiter.set_result({})
            self._snapshots = []
        if self._round is not None:  # the run ends with the last round applied
            await self._finish_round()
        if not self.run_done:  # this plan's part ends here; the next plan carries on
            if self.downstream is not None:
                await self.downstream.close()
            self.ended.set()
            return
        if self._checkpoint is not None:  # the trained model, every round applied
            await self._checkpoint(self.version, await self.export())
        params_sq_sum, num_params = await self._call(self._param_stats)
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
        if self.downstream is not None:
            await self.downstream.close()
        self.ended.set()

    async def _loop(self) -> None:
        while not self.done:
            if self._snapshots:  # between two pieces of work: weights and version agree
                blocks = await self.export()
                waiters, self._snapshots = self._snapshots, []
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(blocks)
            elif self._round is not None and self._round.done():  # an averaged result arrived
                await self._finish_round()
            elif self._backwards:  # 1F1B: backward work first
                await self._on_backward(self._backwards.popleft())
            elif self._forwards and self._may_forward(self._forwards[0].seq):
                received = self._forwards.popleft()
                await self._on_forward(received.seq, received.tensors, received.samples)
            elif self.spec.is_first and self._may_produce():
                # Counted before it is fed: a drain decided meanwhile (drain_step, on the loop)
                # must see this microbatch as begun.
                self._produced += 1
                await self._produce(self._produced - 1)
            else:
                await self._idle()

    async def snapshot(self) -> dict[int, BlockWeights]:
        """Copies of this stage's blocks at its current step (`version`), taken by the loop
        between two pieces of its work, where weights and step agree (a stopping node
        checkpoints them). Empty if the loop is not running, or ends first: a loop stopped
        midway may have stepped its weights without counting the step."""
        if not self._looping:
            return {}
        waiter: asyncio.Future[dict[int, BlockWeights]] = asyncio.get_running_loop().create_future()
        self._snapshots.append(waiter)
        self._wake.set()
        return await waiter

    async def _idle(self) -> None:
        """Wait for a frame or a finished send; the time counts against the neighbour that
        would have given us work (upstream when a forward would be allowed now)."""
        waiting_for_upstream = (
            not self.spec.is_first
            and not self._forwards
            and self._may_forward(self._next_forward_seq)
        )
        self._wake.clear()
        started = time.monotonic()
        await self._wake.wait()
        waited = time.monotonic() - started
        if waiting_for_upstream:
            self._idle_upstream_s += waited
        else:
            self._idle_downstream_s += waited

    def _may_forward(self, seq: int) -> bool:
        """The staleness bound: microbatch seq (of step seq // microbatches) may run forward
        with the current weights only if they are at most max_staleness versions behind (0
        during the synchronous warm-up)."""
        step = seq // self.run_config.microbatches
        return step - self.version <= self.run_config.staleness_bound(step)

    def _may_produce(self) -> bool:
        """GPipe/1F1B feed microbatches as far as the bound allows; the sequential (naive)
        schedule waits until the previous microbatch's gradient is back."""
        limit = min(self._feed_limit, self._stop_step) * self.run_config.microbatches
        if self._produced >= limit or not self._may_forward(self._produced):
            return False
        return self.run_config.schedule == "gpipe" or not self._awaiting_grad

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
        assert self._may_forward(seq), (seq, self.version)
        if self.spec.is_last:
            loss, message = await self._call(self._forward_loss_backward, seq, received)
            self._max_versions = max(self._max_versions, self._live_versions)
            self._step_loss += loss
            self._record_staleness(0)
            if message is not None:
                await self._send_upstream(message)
            await self._microbatch_done(seq)
        else:
            message = await self._call(self._forward, seq, received, samples)
            self._awaiting_grad.add(seq)
            self._max_in_flight = max(self._max_in_flight, len(self._in_flight))
            self._max_versions = max(self._max_versions, self._live_versions)
            assert self.downstream is not None
            self.activation_bytes_sent += len(message)
            await self._send(self.downstream, message)

    async def _on_backward(self, frame: Received) -> None:
        forward_version = self._in_flight[frame.seq].version
        message = await self._call(self._backward, frame)
        self._record_staleness(self.version - forward_version)
        if message is not None:
            await self._send_upstream(message)
        await self._microbatch_done(frame.seq)

    def _record_staleness(self, staleness: int) -> None:
        # Backward of step t runs at version t (steps apply in order), and its forward ran at
        # a version >= t - max_staleness: anything else is a bug in the schedule.
        if not 0 <= staleness <= self.run_config.max_staleness:
            raise RuntimeError(f"staleness {staleness} outside 0..{self.run_config.max_staleness}")
        self._staleness[staleness] += 1

    async def _send_upstream(self, message: bytes) -> None:
        assert self.upstream is not None
        self.gradient_bytes_sent += len(message)
        await self._send(self.upstream, message)

    async def _send(self, link: BoundaryLink, message: bytes) -> None:
        """Queue a frame on a link; time spent waiting for room counts as idle on that side."""
        started = time.monotonic()
        await link.send(message)
        waited = time.monotonic() - started
        if link is self.downstream:
            self._idle_downstream_s += waited
        else:
            self._idle_upstream_s += waited

    async def _microbatch_done(self, seq: int) -> None:
        m = self.run_config.microbatches
        assert seq // m == self.version, (seq, self.version)  # backwards arrive in order
        self._step_done += 1
        if self._step_done < m:
            return
        await self._call(self._optimizer_step)
        self.version += 1
        loss = self._step_loss if self.spec.is_last else math.nan
        self.last_loss = loss
        self._step_done, self._step_loss = 0, 0.0
        self._wake.set()  # the bound moved: forwards may be allowed now
        if self._averaging is not None and self._averaging.config.round_due(self.version):
            await self._begin_round()
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

    # ----- replica averaging ------------------------------------------------------------------
    async def _begin_round(self) -> None:
        """Take this replica's delta and average it with the group in the background. A round
        still in flight is finished first: one round at a time (that wait is the
        backpressure of a slow group)."""
        assert self._averaging is not None and self._outer is not None
        if self._round is not None:
            await self._finish_round()
        started = time.monotonic()
        delta = await self._call(self._outer.begin_round, list(self._params.values()))
        round_number = self._averaging.config.round_of(self.version)
        self._round = asyncio.create_task(
            self._averaging.averager.average(round_number, delta, step=self.version)
        )
        self._round.add_done_callback(lambda _: self._wake.set())
        self._averaging_wait_s += time.monotonic() - started

    async def _finish_round(self) -> None:
        """Wait for the round in flight (if it is not done yet) and apply its mean."""
        assert self._round is not None and self._outer is not None
        started = time.monotonic()
        result = await self._round
        self._round = None
        await self._call(self._apply_round, result.mean)
        self._rounds += 1
        self._averaging_bytes += result.bytes_sent
        left_out = sorted({*result.missing, *result.rejected, *result.banned})
        if left_out:
            self._rounds_incomplete += 1
            log.warning(
                "averaging round %d of stage %d went on without %s",
                result.round,
                self.spec.index,
                ", ".join(left_out),
            )
        self._averaging_wait_s += time.monotonic() - started

    async def _call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._compute, partial(self._timed, fn, *args, **kwargs))

    def _timed(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - started

    # ----- torch work, on the compute thread --------------------------------------------------
    def _weights(self, seq: int) -> tuple[int, Weights]:
        """The version and snapshot microbatch `seq` runs forward with (leaves that collect the
        gradients of the microbatches that used them). With weight prediction: its step's,
        taken when the step's first microbatch came and released for new forwards after its
        last; without: the current version's, taken at its first forward."""
        m = self.run_config.microbatches
        step = seq // m
        if self.run_config.weight_prediction:
            key, ahead = step, step - self.version
        else:  # one snapshot per version, shared by every step that runs forward with it
            key, ahead = _THIS_VERSION, 0
        held = self._step_weights.get(key)
        if held is None:
            held = (self.version, self._snapshot(ahead))
            self._step_weights[key] = held
        if key != _THIS_VERSION and seq % m == m - 1:
            del self._step_weights[key]
        return held

    def _snapshot(self, ahead: int) -> Weights:
        """Copies of the parameters, moved `ahead` AdamW updates along its current moments."""
        group = self._optimizer.param_groups[0]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        snapshot = {}
        with torch.no_grad():
            for name, p in self._params.items():
                w = p.detach().clone()
                state = self._optimizer.state.get(p)
                if ahead and state:
                    k = float(state["step"])
                    m_hat = state["exp_avg"] / (1 - beta1**k)
                    v_hat = state["exp_avg_sq"] / (1 - beta2**k)
                    w -= ahead * lr * (m_hat / (v_hat.sqrt() + eps) + wd * w)
                snapshot[name] = w.requires_grad_(True)
        return snapshot

    @property
    def _live_versions(self) -> int:
        """Weight snapshots alive: those of steps still running forward and of microbatches
        in flight."""
        alive = {id(f.weights) for f in self._in_flight.values()}
        alive.update(id(weights) for _, weights in self._step_weights.values())
        return len(alive)

    def _release(self, snapshot: Weights) -> None:
        """Move the snapshot's gradients into the optimizer's parameters (the step's gradient
        sums microbatches in the order their backwards ran). A snapshot is freed when no
        microbatch in flight holds it and its step has no forwards left to run."""
        with torch.no_grad():
            for name, p in self._params.items():
                g = snapshot[name].grad
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
                snapshot[name].grad = None

    def _inputs(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = tensors[HIDDEN]
        if not self.spec.is_first:
            x.requires_grad_(True)  # its gradient goes back upstream
        return x, tensors[TARGETS]

    def _forward(
        self,
        seq: int,
        received: dict[str, torch.Tensor],
        samples: tuple[int, ...],
    ) -> bytes:
        x, targets = self._inputs(received)
        version, weights = self._weights(seq)
        if self.run_config.recompute:
            kept: list[torch.Tensor] = []
            with torch.no_grad():
                out = x
                for i in range(len(self._blocks)):
                    if i:
                        kept.append(out)
                    out = self._block_call(i, weights, out)
            self._in_flight[seq] = _InFlight(version, weights, x, kept)
        else:
            out = torch.func.functional_call(self._blocks, weights, (x,))
            self._in_flight[seq] = _InFlight(version, weights, x, out)
        self.activation_fp32_bytes += 4 * out.numel()  # (an int += on the compute thread)
        packing: list[str] = []
        message = encode_frame(
            FrameKind.FORWARD,
            seq,
            version,
            [
                self.activation_codec.outgoing(HIDDEN, out.detach()),
                Outgoing(TARGETS, targets, self._raw),
            ],
            samples=samples,
            lz4_min_ratio=self._lz4_ratio,
            packing=packing,
        )
        self.activation_codec.sent(packing[0])
        return message

    def _forward_loss_backward(
        self, seq: int, received: dict[str, torch.Tensor]
    ) -> tuple[float, bytes | None]:
        x, targets = self._inputs(received)
        version, weights = self._weights(seq)
        out = torch.func.functional_call(self._blocks, weights, (x,))
        loss = self._model.loss(out, targets) / self.run_config.microbatches
        torch.autograd.backward(loss)
        self._release(weights)
        self._slow_down()
        return loss.item(), self._grad_frame(seq, version, x)

    def _backward(self, frame: Received) -> bytes | None:
        flight = self._in_flight.pop(frame.seq)
        if isinstance(flight.outputs, list):  # recomputation, one block at a time, last first
            grad = frame.tensors[GRAD]
            inputs = [flight.inputs, *flight.outputs]
            for i in reversed(range(len(self._blocks))):
                x = inputs[i] if i == 0 else inputs[i].detach().requires_grad_(True)
                out = self._block_call(i, flight.weights, x)
                if out.requires_grad:  # (not so in frozen blocks fed tokens)
                    torch.autograd.backward(out, grad)
                if i:
                    assert x.grad is not None  # (x requires grad, so out does)
                    grad = x.grad
                # (block 0's input is the stage's own: its gradient goes upstream)
        elif flight.outputs.requires_grad:  # (not so in a stage of frozen blocks fed tokens)
            torch.autograd.backward(flight.outputs, frame.tensors[GRAD])
        self._release(flight.weights)
        self._slow_down()
        # The gradient frame carries the version our forward used.
        return self._grad_frame(frame.seq, flight.version, flight.inputs)

    def _block_call(self, i: int, weights: Weights, x: torch.Tensor) -> torch.Tensor:
        """Block `i` of the stage on `x` with its tensors from the snapshot `weights`."""
        prefix = f"{i}."
        own = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        out: torch.Tensor = torch.func.functional_call(self._blocks[i], own, (x,))
        return out

    def _grad_frame(self, seq: int, version: int, x: torch.Tensor) -> bytes | None:
        if self.spec.is_first:
            return None
        assert x.grad is not None
        self.gradient_fp32_bytes += 4 * x.grad.numel()
        packing: list[str] = []
        message = encode_frame(
            FrameKind.BACKWARD,
            seq,
            version,
            [self.gradient_codec.outgoing(GRAD, x.grad)],
            lz4_min_ratio=self._lz4_ratio,
            packing=packing,
        )
        self.gradient_codec.sent(packing[0])
        return message

    def _slow_down(self) -> None:
        """Test only: the stage named by fault_slow_stage works fault_slow_ms longer per
        microbatch, as a slower machine would."""
        if self.run_config.fault_slow_stage == self.spec.index:
            time.sleep(self.run_config.fault_slow_ms / 1000)
        if self.block_delay_s:  # test only: this node is slower by so much per block
            time.sleep(self.block_delay_s * (self.spec.stop_block - self.spec.first_block))

    def _optimizer_step(self) -> None:
        if self.run_config.fault_skip_step_stage == self.spec.index:
            log.warning("fault injection: stage %d skips its optimizer step", self.spec.index)
        else:
            self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._step_weights.pop(_THIS_VERSION, None)  # stale now; microbatches in flight keep it

    def _apply_round(self, mean: torch.Tensor) -> None:
        assert self._outer is not None
        self._outer.apply(list(self._params.values()), mean)
        self._step_weights.clear()  # the next forward sees the averaged weights

    def _param_stats(self) -> tuple[float, int]:
        with torch.no_grad():
            total = sum(float(p.double().square().sum()) for p in self._params.values())
            count = sum(p.numel() for p in self._params.values())
        return total, count

    async def params_digest(self) -> str:
        """sha256 of the stage's parameters, to show that something did or did not change them.

        Computed on the compute thread (between torch ops) at most once per weight version,
        however often it is asked for."""
        version = self.version
        if self._digest is None or self._digest[0] != version:
            async with self._digest_lock:
                if self._digest is None or self._digest[0] != version:
                    self._digest = (version, await self._call(self._params_sha256))
        return self._digest[1]

    def _params_sha256(self) -> str:
        digest = hashlib.sha256()
        with torch.no_grad():
            for p in self._params.values():
                digest.update(p.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()
