"""The schedule's decisions: what a stage may do next, which received frames fit, and where
this plan's part of the run ends. No torch work, no I/O, no clock: a `Schedule` is the counts
the schedule keeps, its decisions are functions of them, and the stage runtime (stage.py) tells
it what happened.

**The staleness bound.** A stage's weight version is the number of optimizer steps it has
applied. A microbatch of step t may run forward on a stage only while t - version <= S
(`max_staleness`), so at most S updates land between a microbatch's forward and its backward on
any stage (its *staleness*, recorded per stage). The first stage therefore feeds microbatches of
up to S steps ahead while earlier gradients are still on their way back, and the pipeline holds
at most (S + 1) x microbatches microbatches per stage: that bounds the queues, the activations
kept for backward and the weight versions kept. S = 0 is synchronous training: every microbatch
of step t uses version t everywhere, exactly what one process computes. During the warm-up
(`staleness_warmup_steps`) the bound is 0.

**Admission.** A frame is checked against the plan and the schedule before anything of it is
decoded (`check_frame`, `check_room`): its kind, its tensors' names and shapes, its seq (the
next forward in order; a gradient only for a microbatch sent downstream and not answered yet),
its weight version (within the bound of its step), and its sample ids. A refused frame raises
FrameError and changes nothing.

**Evaluations** (`run.eval_every`) ride the same streams: after step t where the run evaluates,
pipeline 0's first stage sends `eval_microbatches` EVAL frames (version = t, seq = the
microbatch within the evaluation) that every stage runs forward without gradients, out of the
forwards' seq order and the staleness bound, and that are never resent on a resumed stream (an
evaluation that loses one is counted lost, not retried). At the run's end a later stage of
pipeline 0 is done only once the last evaluation has passed it (or its upstream has ended its
stream: nothing more comes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ravnest_node.errors import FrameError
from ravnest_node.models import BlockModel
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.transport.frames import Expected, Frame, FrameKind, check_tensors

HIDDEN = "hidden"
"""The activation a forward frame carries (the first stage's: the input tokens)."""
TARGETS = "targets"
"""The microbatch's targets, which travel with its activations to the last stage."""
GRAD = "grad"
"""The gradient a backward frame carries: of the receiving stage's output."""
TOKENS = "tokens"
"""The microbatch's input token ids, which a forward frame carries after its targets where
the model `carries_tokens` (models/subspace.py); raw, in the input's dtype."""


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


def expected_tensors(
    model: BlockModel, spec: StageSpec, microbatch_size: int
) -> tuple[list[Expected], list[Expected]]:
    """The tensors a forward frame and a backward frame to this stage must carry, in order.

    Token ids (TOKENS) are checked by shape and dtype like any tensor; a model that carries
    them takes them as uint8 with a vocabulary of at most 256 (ValueError otherwise), so every
    id that admission lets through is in range."""
    targets = model.target_spec(microbatch_size)
    forward = [Expected(TARGETS, targets.shape, targets.dtype)]
    if not spec.is_first:
        hidden = model.output_spec(spec.first_block - 1, microbatch_size)
        forward.insert(0, Expected(HIDDEN, hidden.shape, hidden.dtype))
        if model.carries_tokens:
            tokens = model.input_spec(microbatch_size)
            if tokens.dtype != torch.uint8 or model.vocab_size > 256:
                raise ValueError(f"{model.name}: carried token ids must be uint8 (vocab <= 256)")
            forward.append(Expected(TOKENS, tokens.shape, tokens.dtype))
    out = model.output_spec(spec.stop_block - 1, microbatch_size)
    return forward, [Expected(GRAD, out.shape, out.dtype)]


COMPUTE_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
"""The dtypes a float tensor may cross a stage boundary in: a neighbour computing in bf16 or
fp16 sends in that dtype (pipeline/compute.py), whatever this stage computes in."""


def _as_sent(frame: Frame, expected: Sequence[Expected]) -> list[Expected]:
    """`expected` with each float tensor's dtype taken from the frame where it is one of
    COMPUTE_DTYPES (the plan fixes names, shapes and integer dtypes, not float widths)."""
    sent = {h.name: h.dtype for h in frame.headers}
    out = []
    for e in expected:
        dtype = sent.get(e.name, e.dtype)
        if e.dtype in COMPUTE_DTYPES and dtype in COMPUTE_DTYPES:
            e = Expected(e.name, e.shape, dtype)
        out.append(e)
    return out


class Schedule:
    """The 1F1B schedule of one stage under one plan, from `start_step` to `stop_step`.

    Its counts are read freely and changed only by the methods below, on the event loop: the
    runtime says what it admitted, produced, sent and finished, and asks what it may do."""

    def __init__(
        self,
        spec: StageSpec,
        run: TrainConfig,
        *,
        start_step: int,
        forward: Sequence[Expected],
        backward: Sequence[Expected],
    ) -> None:
        """`forward`, `backward`: the tensors each kind of frame must carry
        (`expected_tensors`). ValueError if `start_step` is outside the run."""
        if not 0 <= start_step < run.steps:
            raise ValueError(f"start_step {start_step} outside 0..{run.steps - 1}")
        self.spec = spec
        self.run = run
        self.start_step = start_step
        self._forward = list(forward)
        self._backward = list(backward)
        self.version = start_step
        """Optimizer steps applied."""
        self.next_forward_seq = start_step * run.microbatches
        """The next forward frame admitted must carry this seq."""
        self.produced = start_step * run.microbatches
        """First stage: microbatches fed (begun)."""
        self.awaiting_grad: set[int] = set()
        """Microbatches sent downstream whose gradient has not been admitted yet."""
        self.stop_step = run.steps
        """The plan's last step, once known (`stop_at`); the run's until then."""
        self.feed_limit = run.steps
        """First stage: feeds no microbatch of this step or later."""
        self.evaluates = run.eval_every > 0 and spec.pipeline == 0
        """This stage's pipeline evaluates on held-out data."""
        self.last_eval = (start_step, -1)
        """(version, seq) of the last EVAL frame admitted (or produced, on the first stage)."""
        self.evals_through = start_step
        """The last evaluation (its step) that has passed this stage whole."""
        self.upstream_closed = False
        """The upstream ended its stream cleanly: no frame of any kind comes any more."""
        self.evals_waiting = 0
        """Evaluation microbatches admitted and not finished here yet."""
        self.step_done = 0
        """Microbatches of the current step (`version`) whose backward is done."""
        self.stale_microbatches = run.stale_microbatches
        """Of a step's microbatches, how many may run ahead of the update they follow (0: all)."""
        self.ahead_after = run.ahead_after
        """Backwards of the current update in before a microbatch runs ahead."""

    # ----- what the stage may do ---------------------------------------------------------------
    def may_forward(self, seq: int) -> bool:
        """The staleness bound: microbatch seq (of step seq // microbatches) may run forward
        with the current weights only if they are at most max_staleness versions behind (0
        during the synchronous warm-up), and while they are behind at all only if it is one of
        its step's first `stale_microbatches` and `ahead_after` of the current version's
        microbatches have run backward here (both from the run, until
        `whole_step_ahead`)."""
        step = seq // self.run.microbatches
        behind = step - self.version
        return behind <= self.run.staleness_bound(step) and (
            behind <= 0 or (self._may_run_ahead(seq) and self.step_done >= self.ahead_after)
        )

    def _may_run_ahead(self, seq: int) -> bool:
        """Whether microbatch `seq` is one of its step's first `stale_microbatches`."""
        k = self.stale_microbatches
        return not k or seq % self.run.microbatches < k

    def held_for_gradients(self, queued: int | None) -> bool:
        """Whether the next forward (the first stage's next microbatch to feed; elsewhere the
        `queued` one's seq, None if none is) is held back only by the wait for the current
        update's gradients (`stale_after_backwards`)."""
        if self.spec.is_first:
            queued = self.produced if self.produced < self._feed_end else None
        if queued is None:
            return False
        step = queued // self.run.microbatches
        behind = step - self.version
        return (
            0 < behind <= self.run.staleness_bound(step)
            and self._may_run_ahead(queued)
            and self.step_done < self.ahead_after
        )

    def whole_step_ahead(self, on: bool) -> None:
        """From now on run every microbatch of the next step ahead without waiting for the
        update's gradients (`on`, as with stale_microbatches = stale_after_backwards = 0), or
        as the run says again (ahead.py decides when)."""
        self.stale_microbatches = 0 if on else self.run.stale_microbatches
        self.ahead_after = 0 if on else self.run.ahead_after

    @property
    def _feed_end(self) -> int:
        """First stage: the seq after the last microbatch this plan may feed."""
        return min(self.feed_limit, self.stop_step) * self.run.microbatches

    def may_produce(self) -> bool:
        """GPipe/1F1B feed microbatches as far as the bound allows; the sequential (naive)
        schedule waits until the previous microbatch's gradient is back."""
        if self.produced >= self._feed_end or not self.may_forward(self.produced):
            return False
        return self.run.schedule == "gpipe" or not self.awaiting_grad

    def waiting_for_upstream(self, forwards_queued: bool) -> bool:
        """Whether the stage, with nothing to do, waits for the previous stage: a forward
        would be allowed now and none is queued (otherwise it waits for the next stage)."""
        return (
            not self.spec.is_first
            and not forwards_queued
            and self.may_forward(self.next_forward_seq)
        )

    @property
    def total_microbatches(self) -> int:
        """Microbatch seqs below this are this plan's to train."""
        return self.stop_step * self.run.microbatches

    @property
    def received_all_forwards(self) -> bool:
        return self.next_forward_seq >= self.total_microbatches

    @property
    def done(self) -> bool:
        """This plan's part of the run is done: its last step applied and, at the run's end
        on pipeline 0, the last evaluation passed on (or the upstream gone quiet)."""
        if self.version < self.stop_step:
            return False
        final_eval = (
            self.evaluates
            and not self.spec.is_first
            and self.stop_step == self.run.steps
            and self.run.evaluates_at(self.run.steps)
        )
        return (
            not final_eval
            or self.evals_through >= self.run.steps
            or (self.upstream_closed and not self.evals_waiting)
        )

    @property
    def run_done(self) -> bool:
        """The run's last step is applied (not just this plan's)."""
        return self.version >= self.run.steps

    @property
    def window(self) -> int:
        """Most frames of one direction that may wait for the compute loop."""
        return self.run.window

    # ----- admission ---------------------------------------------------------------------------
    def check_frame(self, frame: Frame) -> None:
        """FrameError unless the frame fits the plan and the schedule now (not its room in the
        queue: `check_room`)."""
        if frame.kind is FrameKind.FORWARD:
            self._check_forward(frame)
        elif frame.kind is FrameKind.EVAL:
            self._check_eval(frame)
            return
        else:
            if self.spec.is_last:
                raise FrameError("the last stage takes no gradient frames")
            check_tensors(frame, _as_sent(frame, self._backward))
            if frame.seq not in self.awaiting_grad:
                raise FrameError(f"gradient for microbatch {frame.seq}, which is not in flight")
        # The sender computed microbatch seq (of step seq // m) with weights no more than
        # max_staleness versions old, and not from the future.
        step = frame.seq // self.run.microbatches
        oldest = step - self.run.max_staleness
        if not oldest <= frame.version <= step:
            raise FrameError(
                f"{frame.kind.name.lower()} seq {frame.seq} carries weight version "
                f"{frame.version}, expected {step}"
                + (f" or down to {max(oldest, 0)}" if oldest < step else "")
            )

    def _check_forward(self, frame: Frame) -> None:
        if self.spec.is_first:
            raise FrameError("the first stage takes no forward frames")
        check_tensors(frame, _as_sent(frame, self._forward))
        if frame.seq >= self.total_microbatches:
            raise FrameError(
                f"forward seq {frame.seq} is past the plan's last microbatch "
                f"{self.total_microbatches - 1}"
            )
        if frame.seq != self.next_forward_seq:
            raise FrameError(f"forward seq {frame.seq}, expected {self.next_forward_seq}")
        self._check_samples(frame)

    def _check_eval(self, frame: Frame) -> None:
        """An evaluation's frame: of pipeline 0, after a step where the run evaluates and this
        plan's first stage has applied, in (version, seq) order (gaps allowed: a frame lost
        on a broken stream is not resent), carrying no sample ids."""
        if self.spec.is_first or not self.evaluates:
            raise FrameError("this stage takes no evaluation frames")
        check_tensors(frame, _as_sent(frame, self._forward))
        version, seq = frame.version, frame.seq
        if not (self.start_step < version <= self.stop_step and self.run.evaluates_at(version)):
            raise FrameError(f"evaluation frame after step {version}: the run does not "
                             f"evaluate there in this plan")  # fmt: skip
        if seq >= self.run.eval_microbatches:
            raise FrameError(f"evaluation frame {seq}, but an evaluation has "
                             f"{self.run.eval_microbatches} microbatches")  # fmt: skip
        if (version, seq) <= self.last_eval:
            raise FrameError(f"evaluation frame ({version}, {seq}) after "
                             f"{self.last_eval}: out of order")  # fmt: skip
        if frame.samples:
            raise FrameError("evaluation frames list no sample ids")

    def _check_samples(self, frame: Frame) -> None:
        """Forward frames of a fixed-dataset run list their rows' sample ids; others list none."""
        n = self.run.dataset_samples
        want = self.run.microbatch_size if n else 0
        if len(frame.samples) != want:
            raise FrameError(f"forward frame lists {len(frame.samples)} sample ids, not {want}")
        if any(s >= n for s in frame.samples) or len(set(frame.samples)) != len(frame.samples):
            raise FrameError(f"forward frame's sample ids must be distinct and below {n}")

    def check_room(self, queued: int, kind: FrameKind = FrameKind.FORWARD) -> None:
        """FrameError if `queued` frames of a kind already wait: the schedule bounds each
        queue by the window (evaluations: two evaluations' microbatches), and a peer that
        sends more is refused."""
        room = 2 * self.run.eval_microbatches if kind is FrameKind.EVAL else self.window
        if queued >= room:
            raise FrameError("more frames in flight than the schedule allows")

    def admitted(self, kind: FrameKind, seq: int, version: int = 0) -> None:
        """A frame that passed the checks was queued."""
        if kind is FrameKind.FORWARD:
            self.next_forward_seq += 1
        elif kind is FrameKind.EVAL:
            self.last_eval = (version, seq)
            self.evals_waiting += 1
        else:
            self.awaiting_grad.discard(seq)

    def eval_passed(self, version: int, seq: int) -> None:
        """This stage finished microbatch `seq` of the evaluation after step `version`."""
        self.evals_waiting -= 1
        if seq == self.run.eval_microbatches - 1:
            self.evals_through = max(self.evals_through, version)

    # ----- progress ----------------------------------------------------------------------------
    def produce(self) -> int:
        """First stage: the seq of the next microbatch to feed, counted as fed from now on (a
        drain decided before its forward is done must see it as begun)."""
        self.produced += 1
        return self.produced - 1

    def sent_forward(self, seq: int) -> None:
        """Microbatch seq went downstream; its gradient is awaited."""
        self.awaiting_grad.add(seq)

    def check_staleness(self, staleness: int) -> None:
        """RuntimeError unless a backward that saw `staleness` updates since its forward is
        within the bound."""
        # Backward of step t runs at version t (steps apply in order), and its forward ran at
        # a version >= t - max_staleness: anything else is a bug in the schedule.
        if not 0 <= staleness <= self.run.max_staleness:
            raise RuntimeError(f"staleness {staleness} outside 0..{self.run.max_staleness}")

    def microbatch_done(self, seq: int) -> bool:
        """Microbatch seq's backward is done here; True if it was its step's last (the
        optimizer steps now, then `stepped`)."""
        assert seq // self.run.microbatches == self.version, (seq, self.version)  # in order
        self.step_done += 1
        return self.step_done >= self.run.microbatches

    def stepped(self) -> None:
        """The optimizer applied step `version`."""
        self.version += 1
        self.step_done = 0

    # ----- where this plan ends ----------------------------------------------------------------
    def drain_step(self) -> int:
        """First stage, when a new plan is coming: feed no microbatch of a step not yet
        started; returns the step it stops at (this plan then ends there or later, `stop_at`)."""
        assert self.spec.is_first
        m = self.run.microbatches
        self.feed_limit = min(self.feed_limit, self.stop_step, -(-self.produced // m))
        return self.feed_limit

    def stop_at(self, step: int) -> None:
        """This plan ends once `step` steps are applied (the coordinator's answer to the
        first stages' `drain_step`). ValueError if this stage is already past it."""
        if not self.version <= step <= self.run.steps:
            raise ValueError(f"cannot stop at step {step}: this stage is at {self.version}")
        if self.spec.is_first and step * self.run.microbatches < self.produced:
            raise ValueError(f"cannot stop at step {step}: microbatches of it are fed already")
        self.stop_step = self.feed_limit = step

    def upstream_end_step(self) -> int | None:
        """The step this plan stops at when the previous stage ended its stream cleanly before
        the run's end (its plan ended after the forwards it sent); None if that is not a step
        boundary at or after `version`, which no drained stage would do."""
        step, rest = divmod(self.next_forward_seq, self.run.microbatches)
        if rest or step < self.version:
            return None
        return step
