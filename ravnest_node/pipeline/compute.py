"""A stage's torch work: forward, forward + loss + backward on the last stage, backward (with
activation recomputation), the frames they produce, the optimizer steps, and the compute
thread they all run on.

All of it runs on one compute thread (`call`), one piece at a time, so the stage's weights,
its snapshots and the microbatches in flight are never touched by two threads at once; the
event loop only reads the counts. The frames they produce are encoded on the encoder's coder
thread (encoder.py): the methods return the frame's future, and the compute thread goes on.

**Activation recomputation** (`recompute`): a forward then runs without a graph and keeps only
the input of each block; its backward runs each block's forward again, last block first, and
back-propagates through it. That trades a second forward for the activations' memory.

**Device and precision**: the blocks, their snapshots and AdamW's state live on the stage's
device; what arrives (decoded on the CPU) is moved there, through pinned memory on CUDA so the
copy does not hold up the host, and not copied at all on the CPU. In bf16/fp16 the forward, the
loss and the recomputation run under autocast (`devices.autocast`) with float32 weights, and the
activations and gradients the stage sends are in that dtype; what it receives is cast to float32
(a stage accepts any float dtype from its neighbours, whose precision may differ). fp16 runs
scale the loss by the run's fixed `loss_scale` (run.py): gradients cross stages scaled, and
each stage unscales its own before stepping (weights.py), skipping a non-finite step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial
from typing import ParamSpec, TypeVar

import torch

from ravnest_node.averaging import AveragingConfig
from ravnest_node.blocks import BlockWeights, export_blocks
from ravnest_node.devices import autocast, autocast_dtype, describe, resolve_precision
from ravnest_node.models import BlockModel
from ravnest_node.models.base import Chain
from ravnest_node.pipeline.audit import AuditRecord, AuditRecords
from ravnest_node.pipeline.encoder import FrameEncoder
from ravnest_node.pipeline.lies import lie
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import HIDDEN, TARGETS, TOKENS, StageSpec
from ravnest_node.pipeline.weights import StageWeights, Weights

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(slots=True)
class InFlight:
    """A microbatch between its forward and its backward on this stage."""

    version: int
    weights: Weights
    """The snapshot its forward used, which its backward uses too (weight stashing)."""
    inputs: torch.Tensor
    outputs: torch.Tensor | list[torch.Tensor]
    """The forward's output with its graph; under recomputation, the input of each block
    after the first, without a graph (the backward runs each block's forward again)."""
    tokens: torch.Tensor | None = None
    """The input token ids of a model that `carries_tokens`: for recomputing its blocks, and
    for the record of its backward (audit.py)."""


class StageCompute:
    """One stage's blocks and everything torch does with them. The methods that take a
    `version` are given the stage's weight version (optimizer steps applied) at the time of
    the call; run them through `call`, on the compute thread."""

    def __init__(
        self,
        *,
        spec: StageSpec,
        model: BlockModel,
        blocks: list[torch.nn.Module],
        run: TrainConfig,
        executor: Executor,
        restore: Mapping[int, BlockWeights] | None = None,
        block_delay_s: float = 0.0,
        averaging: AveragingConfig | None = None,
        device: torch.device | None = None,
    ) -> None:
        """`executor`: the compute thread; `restore`: block states to start from;
        `block_delay_s`: test only, this node is slower by so much per block and microbatch;
        `averaging`: the replica group's settings, if the stage averages; `device`: where the
        stage computes (the CPU if None; blocks elsewhere are moved there). ConfigError if the
        run's precision is not one `devices.resolve_precision` knows."""
        self._spec = spec
        self._run = run
        self._model = model
        self._executor = executor
        self.device = torch.device("cpu") if device is None else device
        self.precision = resolve_precision(run.precision, self.device)
        """The precision this stage computes in: fp32, bf16 or fp16."""
        self.device_name = describe(self.device)
        self._wire_dtype = autocast_dtype(self.precision)
        """The dtype of the float tensors this stage sends (None: as computed, float32)."""
        self.block_delay_s = block_delay_s
        self.compute_s = 0.0
        """Seconds spent in `call`s (written by the compute thread only)."""
        self.steps_skipped = 0
        """Optimizer steps skipped for gradients that were not finite (fp16)."""
        self._lied = False  # (test only: the dishonest stage said so once)
        self.encoder = FrameEncoder(spec, run, compute_s=lambda: self.compute_s)
        self.blocks = Chain(*blocks).to(self.device)
        self.weights = StageWeights(
            self.blocks, run, first_block=spec.first_block, restore=restore, averaging=averaging,
            device=self.device, loss_scale=run.loss_scale,
        )  # fmt: skip
        self.in_flight: dict[int, InFlight] = {}
        """seq -> what its backward needs."""
        self.step_loss = 0.0
        """Last stage: the sum of the current step's microbatch losses."""
        self.records = AuditRecords(run.microbatches) if run.audit_share else None
        """What this stage computed its last step's worth of outputs from, for its neighbours'
        audits (audit.py): at most one weight snapshot more than the stash holds anyway; None
        in a run without audits."""
        self._digest: tuple[int, str] | None = None
        self._digest_lock = asyncio.Lock()

    async def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """fn(*args, **kwargs) on the compute thread, its time added to `compute_s`."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(self._timed, fn, *args, **kwargs))

    def _timed(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - started

    @property
    def live_versions(self) -> int:
        """Weight snapshots alive: those of steps still running forward and of microbatches
        in flight."""
        return self.weights.live_versions(f.weights for f in self.in_flight.values())

    # ----- forward and backward ----------------------------------------------------------------
    def _inputs(
        self, tensors: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The received input (its gradient goes back upstream), what the blocks take in
        (float32 on the device) and the targets (on the device)."""
        received = self._to_device(tensors[HIDDEN])
        if not self._spec.is_first:
            received.requires_grad_(True)  # its gradient goes back upstream
        x = received.float() if received.is_floating_point() else received
        return received, x, self._to_device(tensors[TARGETS])

    def _tokens(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The input token ids every block takes (`carries_tokens`; None for other models)."""
        if not self._model.carries_tokens:
            return None
        return self._to_device(tensors[HIDDEN if self._spec.is_first else TOKENS])

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (a received CPU tensor) on the stage's device: no copy on the CPU; on CUDA
        through pinned memory, so the host does not wait for the copy (later kernels on the
        same stream do)."""
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _outgoing(self, t: torch.Tensor) -> torch.Tensor:
        """A float tensor the stage sends, in the dtype of its precision."""
        if self._wire_dtype is None or not t.is_floating_point():
            return t
        return t.to(self._wire_dtype)

    def forward(
        self,
        seq: int,
        version: int,
        received: dict[str, torch.Tensor],
        samples: tuple[int, ...],
    ) -> Future[bytes]:
        """Run microbatch `seq` forward and keep what its backward needs; its frame for the
        next stage (being encoded)."""
        first, x, targets = self._inputs(received)
        tokens = self._tokens(received)
        used, weights = self.weights.for_forward(seq, version)
        if self._run.recompute:
            kept: list[torch.Tensor] = []
            with torch.no_grad():
                out = x
                for i in range(len(self.blocks)):
                    if i:
                        kept.append(out)
                    out = self._block_call(i, weights, out, tokens)
            self.in_flight[seq] = InFlight(used, weights, first, kept, tokens)
        else:
            with autocast(self.device, self.precision):
                out = torch.func.functional_call(self.blocks, weights, (x, tokens))
            self.in_flight[seq] = InFlight(used, weights, first, out, tokens)
        self._record(False, seq, used, first, weights, tokens)
        sent = self._lying(self._outgoing(out.detach()), used)
        # (Neither `out`, kept for the backward, nor `targets` or `tokens` is ever modified
        # in place.)
        return self.encoder.submit_forward(seq, used, sent, targets, samples, tokens)

    def forward_loss_backward(
        self, seq: int, version: int, received: dict[str, torch.Tensor]
    ) -> Future[bytes] | None:
        """Last stage: microbatch `seq` forward, its loss (added to `step_loss`) and backward;
        its gradient frame for the previous stage (being encoded; None on a single-stage
        pipeline)."""
        first, x, targets = self._inputs(received)
        tokens = self._tokens(received)
        used, weights = self.weights.for_forward(seq, version)
        with autocast(self.device, self.precision):
            out = torch.func.functional_call(self.blocks, weights, (x, tokens))
            loss = self._model.loss(out, targets) / self._run.microbatches
        scale = self._run.loss_scale
        torch.autograd.backward(loss * scale if scale != 1.0 else loss)
        if not self._spec.is_first:
            self._record(True, seq, used, first, weights, tokens, targets=targets)
        self.weights.release(weights)
        self._slow_down()
        self.step_loss += loss.item()
        return self._grad_frame(seq, used, first)

    def _eval_output(self, received: dict[str, torch.Tensor]) -> torch.Tensor:
        """The stage's output on an evaluation's microbatch: the current weights, no graph."""
        x = self._to_device(received[HIDDEN])
        x = x.float() if x.is_floating_point() else x
        with torch.no_grad(), autocast(self.device, self.precision):
            out: torch.Tensor = self.blocks(x, self._tokens(received))  # (its own parameters)
        return out

    def eval_forward(
        self, seq: int, version: int, received: dict[str, torch.Tensor]
    ) -> Future[bytes]:
        """Microbatch `seq` of the evaluation after step `version` forward, nothing kept; its
        frame for the next stage (being encoded)."""
        out = self._outgoing(self._eval_output(received))
        targets = self._to_device(received[TARGETS])
        tokens = self._tokens(received)
        return self.encoder.submit_eval(seq, version, out, targets, tokens)

    def eval_loss(self, received: dict[str, torch.Tensor]) -> float:
        """Last stage: the loss of an evaluation's microbatch (the model's mean, as a training
        microbatch's)."""
        out = self._eval_output(received)
        with torch.no_grad():
            return float(self._model.loss(out, self._to_device(received[TARGETS])).item())

    def backward(self, seq: int, grad: torch.Tensor) -> tuple[int, Future[bytes] | None]:
        """Microbatch `seq` backward from the gradient of its output; the version its forward
        used, and its gradient frame for the previous stage (being encoded; None on the first
        stage)."""
        flight = self.in_flight.pop(seq)
        grad = self._to_device(grad)
        if not self._spec.is_first:
            self._record(True, seq, flight.version, flight.inputs, flight.weights, flight.tokens,
                         grad_out=grad)  # fmt: skip
        if isinstance(flight.outputs, list):  # recomputation, one block at a time, last first
            first = flight.inputs
            inputs = [first.float() if first.is_floating_point() else first, *flight.outputs]
            for i in reversed(range(len(self.blocks))):
                x = inputs[i] if i == 0 else inputs[i].detach().requires_grad_(True)
                out = self._block_call(i, flight.weights, x, flight.tokens)
                grad = grad.to(out.dtype)
                if out.requires_grad:  # (not so in frozen blocks fed tokens)
                    torch.autograd.backward(out, grad)
                if i:
                    assert x.grad is not None  # (x requires grad, so out does)
                    grad = x.grad
                # (block 0's input is the stage's own: its gradient goes upstream)
        elif flight.outputs.requires_grad:  # (not so in a stage of frozen blocks fed tokens)
            torch.autograd.backward(flight.outputs, grad.to(flight.outputs.dtype))
        self.weights.release(flight.weights)
        self._slow_down()
        # The gradient frame carries the version our forward used.
        return flight.version, self._grad_frame(seq, flight.version, flight.inputs)

    def _record(
        self,
        backward: bool,
        seq: int,
        version: int,
        inputs: torch.Tensor,
        weights: Weights,
        tokens: torch.Tensor | None,
        *,
        targets: torch.Tensor | None = None,
        grad_out: torch.Tensor | None = None,
    ) -> None:
        """Keep what microbatch `seq`'s output (`backward`: its input's gradient) was computed
        from, for an audit (the tensors themselves: none of them changes later)."""
        if self.records is None:
            return
        spec = self._spec
        self.records.add(AuditRecord(
            backward, seq, version, spec.first_block, spec.stop_block, inputs.detach(),
            {k: w.detach() for k, w in weights.items()}, tokens, targets, grad_out,
        ))  # fmt: skip

    def _block_call(
        self, i: int, weights: Weights, x: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Block `i` of the stage on `x` (and `tokens`, where the model carries them) with its
        tensors from the snapshot `weights`, in the stage's precision."""
        args = (x,) if tokens is None else (x, tokens)
        prefix = f"{i}."
        own = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
        with autocast(self.device, self.precision):
            out: torch.Tensor = torch.func.functional_call(self.blocks[i], own, args)
        return out

    def _grad_frame(self, seq: int, version: int, x: torch.Tensor) -> Future[bytes] | None:
        if self._spec.is_first:
            return None
        assert x.grad is not None
        # (x is the microbatch's received input, dropped after this: its gradient stays as is.)
        grad = self._lying(self._outgoing(x.grad), version)
        return self.encoder.submit_backward(seq, version, grad)

    def _lying(self, sent: torch.Tensor, version: int) -> torch.Tensor:
        """Test only: what the stage sends, a plausibly wrong copy if this is the dishonest
        stage (`fault_lie_stage` of pipeline 0) at or after `fault_lie_after` (lies.py)."""
        run, spec = self._run, self._spec
        if run.fault_lie_stage != spec.index or spec.pipeline or version < run.fault_lie_after:
            return sent
        if not self._lied:
            log.warning("fault injection: stage %d sends %s activations and gradients from "
                        "step %d", spec.index, run.fault_lie_kind, version)  # fmt: skip
            self._lied = True
        return lie(sent, run.fault_lie_kind)

    def _slow_down(self) -> None:
        """Test only: the stage named by fault_slow_stage works fault_slow_ms longer per
        microbatch, as a slower machine would."""
        if self._run.fault_slow_stage == self._spec.index:
            time.sleep(self._run.fault_slow_ms / 1000)
        if self.block_delay_s:  # test only: this node is slower by so much per block
            time.sleep(self.block_delay_s * (self._spec.stop_block - self._spec.first_block))

    # ----- between microbatches ----------------------------------------------------------------
    def optimizer_step(self) -> float:
        """Apply the step's gradients; the step's loss (last stage; 0.0 elsewhere)."""
        skip = self._run.fault_skip_step_stage == self._spec.index
        if skip:
            log.warning("fault injection: stage %d skips its optimizer step", self._spec.index)
        if not self.weights.step(skip=skip) and not skip:
            self.steps_skipped += 1
            log.warning(
                "stage %d skips an optimizer step: a gradient is not finite at loss scale %g "
                "(%d skipped so far)", self._spec.index, self._run.loss_scale, self.steps_skipped,
            )  # fmt: skip
        loss, self.step_loss = self.step_loss, 0.0
        return loss

    def export(self, version: int) -> dict[int, BlockWeights]:
        """Copies of the stage's blocks and their optimizer moments, at `version`."""
        return export_blocks(self.blocks, self._spec.first_block, self.weights.optimizer, version)

    async def params_digest(self, version: int) -> str:
        """sha256 of the stage's parameters, computed on the compute thread (between torch
        ops) at most once per weight `version`, however often it is asked for."""
        if self._digest is None or self._digest[0] != version:
            async with self._digest_lock:
                if self._digest is None or self._digest[0] != version:
                    self._digest = (version, await self.call(self.weights.sha256))
        return self._digest[1]
