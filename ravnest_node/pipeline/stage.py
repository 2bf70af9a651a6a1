"""The stage runtime: one node's share of the model, trained in step with its neighbours.

A stage owns blocks [first_block, stop_block) of the model. The first stage reads data and
produces microbatches; every stage runs forward on what it receives and sends the activation
downstream; the last stage computes the loss and starts the backward pass; activation gradients
flow back upstream, and each stage steps its own optimizer once it has the gradients of all
microbatches of a step.

With `max_staleness=0` (the only mode so far) a step is synchronous: every microbatch of step t
is computed with the weights of version t (the number of optimizer steps applied), which frames
carry and `accept` checks, so the swarm computes exactly what one process would. All torch work
runs on one compute thread; the event loop only moves bytes and makes decisions. Frames are
checked against the plan on the event loop as they arrive (`accept_from_*`) and decoded in a
worker thread before they are queued: a refused frame, malformed payloads included, changes
nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import ParamSpec, TypeVar

import torch

from ravnest_node.compression import ACTIVATION_ONLY, SampleReferences, encoder, get_codec
from ravnest_node.data import StdlibBytes
from ravnest_node.errors import FrameError
from ravnest_node.models import BlockModel
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
class StepReport:
    """What a stage tells the coordinator after each optimizer step."""

    step: int
    loss: float
    done: bool
    params_sq_sum: float = math.nan
    num_params: int = 0
    compute_s: float = 0.0
    activation_bytes_sent: int = 0
    gradient_bytes_sent: int = 0


class StageRuntime:
    """Trains one stage. `run()` returns once the run's last step is applied."""

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
    ) -> None:
        self.spec = spec
        self.run_config = run
        self._model = model
        self._compute = compute
        self._report = report
        self.upstream = upstream
        self.downstream = downstream
        self._raw = get_codec("none")
        self._act_codec = encoder(run.activation, "activation")
        self._grad_codec = encoder(run.gradient, "gradient")
        # Sender-side codec state (error feedback) lives as long as the stream it encodes.
        self._act_state = self._act_codec.new_state()
        self._grad_state = self._grad_codec.new_state()
        self._lz4_ratio = LZ4_MIN_RATIO if run.lz4 else 0.0
        m = run.microbatches
        mb = run.microbatch_size
        self._blocks = torch.nn.Sequential(*blocks)
        self._optimizer = torch.optim.AdamW(
            self._blocks.parameters(), lr=run.lr, weight_decay=run.weight_decay
        )
        self._data = (
            StdlibBytes(
                seq_len=model.input_spec(1).shape[1],
                seed=run.seed,
                num_samples=run.dataset_samples,
            )
            if spec.is_first
            else None
        )
        # aq-delta: the receiving end of the activation stream keeps a reference per sample.
        self._references = (
            {HIDDEN: SampleReferences(limit=run.dataset_samples)}
            if run.activation in ACTIVATION_ONLY and not spec.is_first
            else {}
        )
        self.activation_bytes_sent = 0
        self.gradient_bytes_sent = 0
        targets = model.target_spec(mb)
        self._expected_forward = [Expected(TARGETS, targets.shape, targets.dtype)]
        if not spec.is_first:
            hidden = model.output_spec(spec.first_block - 1, mb)
            self._expected_forward.insert(0, Expected(HIDDEN, hidden.shape, hidden.dtype))
        out = model.output_spec(spec.stop_block - 1, mb)
        self._expected_backward = [Expected(GRAD, out.shape, out.dtype)]
        self._total_microbatches = run.steps * m
        # Frames received and accepted, waiting for the compute loop; bounded by the protocol:
        # at most one step's microbatches per direction are ever in flight.
        self.inbox: asyncio.Queue[Received] = asyncio.Queue(maxsize=2 * m)
        self._next_forward_seq = 0  # next forward frame we accept from upstream
        self._awaiting_grad: set[int] = set()  # sent downstream, gradient not yet received
        self._stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq -> (input, output)
        self.version = 0  # optimizer steps applied
        self._step_loss = 0.0
        self._step_done = 0  # microbatches of the current step whose backward is done
        self.frames_accepted = 0
        self.compute_s = 0.0  # time spent in torch work, written by the compute thread only
        self._digest: tuple[int, str] | None = None
        self._digest_lock = asyncio.Lock()

    # ----- decisions, on the event loop -------------------------------------------------------
    async def accept_from_upstream(self, frame: Frame) -> None:
        """Admit a frame from the previous stage: only activations travel that way."""
        if frame.kind is not FrameKind.FORWARD:
            raise FrameError("only forward frames travel downstream")
        await self._admit(frame)

    async def accept_from_downstream(self, frame: Frame) -> None:
        """Admit a frame from the next stage: only gradients travel that way."""
        if frame.kind is not FrameKind.BACKWARD:
            raise FrameError("only gradient frames travel upstream")
        await self._admit(frame)

    async def _admit(self, frame: Frame) -> None:
        """Check a received frame against the plan, decode it, and queue it; FrameError (and
        no change) if it does not fit or its payload does not decode. The checks and the
        bookkeeping run on the event loop, so they never race the compute loop; frames of one
        stream are admitted one at a time, in order."""
        self._check(frame)
        if self.inbox.full():
            raise FrameError("more frames in flight than the schedule allows")
        # Decoding validates the payload's content (codes, scales, indices, lz4); do it before
        # anything changes, off the event loop and off the compute thread.
        tensors, commit = await asyncio.to_thread(frame.decode_with, self._references)
        received = Received(frame.kind, frame.seq, frame.version, tensors, frame.samples)
        if self.inbox.full():
            raise FrameError("more frames in flight than the schedule allows")
        # No await from the check above to here: the put cannot fail, and the frame's effect
        # on receiver state (aq-delta references) is applied only now that it is admitted.
        commit()
        self.inbox.put_nowait(received)
        if frame.kind is FrameKind.FORWARD:
            self._next_forward_seq += 1
        else:
            self._awaiting_grad.discard(frame.seq)
        self.frames_accepted += 1

    def _check(self, frame: Frame) -> None:
        m = self.run_config.microbatches
        if frame.kind is FrameKind.FORWARD:
            if self.spec.is_first:
                raise FrameError("the first stage takes no forward frames")
            check_tensors(frame, self._expected_forward)
            if frame.seq >= self._total_microbatches:
                raise FrameError(
                    f"forward seq {frame.seq} is past the run's last microbatch "
                    f"{self._total_microbatches - 1}"
                )
            if frame.seq != self._next_forward_seq:
                raise FrameError(f"forward seq {frame.seq}, expected {self._next_forward_seq}")
            self._check_samples(frame)
            # Synchronous steps: microbatch seq belongs to step seq // m, computed with version
            # seq // m. (Compared with the seq, not with our own version, which may still be
            # one behind while our optimizer step runs.)
            if frame.version != frame.seq // m:
                raise FrameError(
                    f"forward seq {frame.seq} carries weight version {frame.version}, "
                    f"expected {frame.seq // m}"
                )
        else:
            if self.spec.is_last:
                raise FrameError("the last stage takes no gradient frames")
            check_tensors(frame, self._expected_backward)
            if frame.seq not in self._awaiting_grad:
                raise FrameError(f"gradient for microbatch {frame.seq}, which is not in flight")
            if frame.version != frame.seq // m:
                raise FrameError(
                    f"gradient seq {frame.seq} carries version {frame.version}, "
                    f"expected {frame.seq // m}"
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
    def received_all_forwards(self) -> bool:
        return self._next_forward_seq >= self._total_microbatches

    @property
    def data_fingerprint(self) -> str:
        return self._data.fingerprint if self._data is not None else ""

    @property
    def in_flight(self) -> int:
        return len(self._stash)

    @property
    def done(self) -> bool:
        return self.version >= self.run_config.steps

    # ----- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Train until the last step is applied, then send the final report."""
        m = self.run_config.microbatches
        produced = self.version * m
        while not self.done:
            # The first stage feeds the pipeline: all microbatches of the current step, with the
            # current weights; then it waits for their gradients (synchronous, max_staleness=0).
            if self.spec.is_first and produced < (self.version + 1) * m and self._may_produce():
                await self._produce(produced)
                produced += 1
                continue
            received = await self.inbox.get()
            if received.kind is FrameKind.FORWARD:
                await self._on_forward(received.seq, received.tensors, received.samples)
            else:
                await self._on_backward(received)
        params_sq_sum, num_params = await self._call(self._param_stats)
        await self._report(
            StepReport(
                step=self.version,
                loss=math.nan,
                done=True,
                params_sq_sum=params_sq_sum,
                num_params=num_params,
                compute_s=self.compute_s,
                activation_bytes_sent=self.activation_bytes_sent,
                gradient_bytes_sent=self.gradient_bytes_sent,
            )
        )
        if self.downstream is not None:
            await self.downstream.close()

    def _may_produce(self) -> bool:
        """GPipe feeds a step's microbatches back to back; the sequential (naive) schedule
        waits until the previous microbatch's gradient is back."""
        return self.run_config.schedule == "gpipe" or not self._awaiting_grad

    async def _produce(self, seq: int) -> None:
        assert self._data is not None
        m = self.run_config.microbatches
        step, i = divmod(seq, m)
        x, y = self._data.batch(step, self.run_config.batch_size)
        ids = self._data.sample_ids(step, self.run_config.batch_size)
        mb = self.run_config.microbatch_size
        rows = slice(i * mb, (i + 1) * mb)
        tensors = {HIDDEN: x[rows], TARGETS: y[rows]}
        await self._on_forward(seq, tensors, tuple(ids[rows]))

    async def _on_forward(
        self, seq: int, received: dict[str, torch.Tensor], samples: tuple[int, ...]
    ) -> None:
        version = self.version
        # Synchronous steps: frames of step t+1 wait in the inbox until step t is applied.
        assert version == seq // self.run_config.microbatches, (version, seq)
        if self.spec.is_last:
            loss, message = await self._call(self._forward_loss_backward, seq, received, version)
            self._step_loss += loss
            if message is not None:
                await self._send_upstream(message)
            await self._microbatch_done()
        else:
            message = await self._call(self._forward, seq, received, version, samples)
            assert self.downstream is not None
            self._awaiting_grad.add(seq)
            self.activation_bytes_sent += len(message)
            await self.downstream.send(message)

    async def _on_backward(self, frame: Received) -> None:
        message = await self._call(self._backward, frame)
        if message is not None:
            await self._send_upstream(message)
        await self._microbatch_done()

    async def _send_upstream(self, message: bytes) -> None:
        assert self.upstream is not None
        self.gradient_bytes_sent += len(message)
        await self.upstream.send(message)

    async def _microbatch_done(self) -> None:
        self._step_done += 1
        if self._step_done < self.run_config.microbatches:
            return
        await self._call(self._optimizer_step)
        self.version += 1
        loss = self._step_loss if self.spec.is_last else math.nan
        self._step_done, self._step_loss = 0, 0.0
        await self._report(
            StepReport(
                step=self.version,
                loss=loss,
                done=False,
                activation_bytes_sent=self.activation_bytes_sent,
                gradient_bytes_sent=self.gradient_bytes_sent,
            )
        )

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
    def _inputs(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = tensors[HIDDEN]
        if not self.spec.is_first:
            x.requires_grad_(True)  # its gradient goes back upstream
        return x, tensors[TARGETS]

    def _forward(
        self,
        seq: int,
        received: dict[str, torch.Tensor],
        version: int,
        samples: tuple[int, ...],
    ) -> bytes:
        x, targets = self._inputs(received)
        out = self._blocks(x)
        self._stash[seq] = (x, out)
        return encode_frame(
            FrameKind.FORWARD,
            seq,
            version,
            [
                Outgoing(HIDDEN, out.detach(), self._act_codec, self._act_state),
                Outgoing(TARGETS, targets, self._raw),
            ],
            samples=samples,
            lz4_min_ratio=self._lz4_ratio,
        )

    def _forward_loss_backward(
        self, seq: int, received: dict[str, torch.Tensor], version: int
    ) -> tuple[float, bytes | None]:
        x, targets = self._inputs(received)
        out = self._blocks(x)
        loss = self._model.loss(out, targets) / self.run_config.microbatches
        torch.autograd.backward(loss)
        return loss.item(), self._grad_frame(seq, version, x)

    def _backward(self, frame: Received) -> bytes | None:
        x, out = self._stash.pop(frame.seq)
        torch.autograd.backward(out, frame.tensors[GRAD])
        return self._grad_frame(frame.seq, frame.version, x)

    def _grad_frame(self, seq: int, version: int, x: torch.Tensor) -> bytes | None:
        if self.spec.is_first:
            return None
        assert x.grad is not None
        return encode_frame(
            FrameKind.BACKWARD,
            seq,
            version,
            [Outgoing(GRAD, x.grad, self._grad_codec, self._grad_state)],
            lz4_min_ratio=self._lz4_ratio,
        )

    def _optimizer_step(self) -> None:
        if self.run_config.fault_skip_step_stage == self.spec.index:
            log.warning("fault injection: stage %d skips its optimizer step", self.spec.index)
        else:
            self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)

    def _param_stats(self) -> tuple[float, int]:
        with torch.no_grad():
            total = sum(float(p.double().square().sum()) for p in self._blocks.parameters())
            count = sum(p.numel() for p in self._blocks.parameters())
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
            for p in self._blocks.parameters():
                digest.update(p.detach().contiguous().numpy().tobytes())
        return digest.hexdigest()
