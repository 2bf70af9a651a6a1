"""The run's progress as the coordinator records it from the stages' reports: each pipeline's
loss per step, the mean loss of every step all pipelines have reported, the progress events
watchers are sent, the byte counters, each stage's latest and final report, and the newest
checkpoint each stage's owner wrote. Pure: the clock is injected (for `wall_s`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import grpc

from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.errors import Refusal

__all__ = ["RunProgress", "StageKey"]

StageKey = tuple[int, int]
"""(pipeline, stage index)."""


class RunProgress:
    """What the stages reported of `train`'s run, and the events made of it."""

    def __init__(self, train: TrainConfig, clock: Callable[[], float]) -> None:
        self._train = train
        self._clock = clock
        self.pipeline_losses: dict[int, dict[int, float]] = {}
        """Pipeline -> step -> loss (NaN: a step it never trained)."""
        self.losses: dict[int, float] = {}
        """Step -> mean loss over the pipelines that trained it."""
        self.bytes_sent: dict[str, int] = {}
        self.finals: dict[StageKey, pb.StageReport] = {}
        self.latest: dict[StageKey, pb.StageReport] = {}
        """The latest report of each stage (SwarmView.stages)."""
        self.events: list[pb.Progress] = []
        self.evals: dict[int, float] = {}
        """Step -> mean loss of the evaluation on held-out data after it (pipeline 0's last
        stage reports them; `--eval-every`)."""
        self.checkpoints: dict[StageKey, tuple[str, int]] = {}
        """(node id, step) of the newest checkpoint each stage's owner reported."""
        self.resumed_at = 0
        """The step the run (re)started at: 0, or where the members' checkpoints were."""
        self.started_at = 0.0
        """When the run started, on the coordinator's clock."""
        self.started_unix = 0.0
        """When the run started, wall-clock time (time.time())."""

    def start(self, now: float, unix: float) -> None:
        self.started_at, self.started_unix = now, unix

    def completed(self) -> int:
        """The last step every pipeline has reported (or the step the run resumed at)."""
        return max(self.losses, default=self.resumed_at)

    def done(self) -> bool:
        """The run's last event (done) was made."""
        return any(e.done for e in self.events)

    # ----- reports ----------------------------------------------------------------------------
    def is_repeat(self, request: pb.StageReport, key: StageKey, last: int) -> bool:
        """`request` (of stage `key`; `last`: the index of its pipeline's last stage) is a
        retry of a report already recorded."""
        if request.done:
            return self.finals.get(key) == request
        if key[1] != last:  # other stages' step reports only carry counters: harmless again
            return False
        losses = self.pipeline_losses.get(key[0], {})
        # NaN is never equal to itself: compare the bits' meaning, not the float.
        return request.step in losses and (
            losses[request.step] == request.loss
            or (math.isnan(losses[request.step]) and math.isnan(request.loss))
        )

    def note(self, request: pb.StageReport, key: StageKey) -> None:
        """The counters and the checkpoint a report of stage `key` carries."""
        self.latest[key] = request
        # Counters only grow; max() keeps a late-arriving older report from undoing a newer one.
        previous = self.bytes_sent.get(request.node_id, 0)
        self.bytes_sent[request.node_id] = max(previous, request.bytes_sent)
        if request.checkpoint_step > self.checkpoints.get(key, ("", 0))[1]:
            self.checkpoints[key] = (request.node_id, request.checkpoint_step)
        # (Each report carries its stage's newest evaluation: kept once, finite ones only.)
        if (
            key[0] == 0
            and 0 < request.eval_step <= self._train.steps
            and request.eval_step not in self.evals
            and math.isfinite(request.eval_loss)
        ):
            self.evals[request.eval_step] = request.eval_loss

    def record_final(self, key: StageKey, request: pb.StageReport) -> None:
        """Stage `key`'s final report; Refusal FAILED_PRECONDITION if it has one already or
        it is not at the run's last step."""
        if key in self.finals or request.step != self._train.steps:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stage {request.stage} of pipeline {request.pipeline} cannot be done at "
                f"step {request.step}",
            )
        self.finals[key] = request

    def record_loss(self, pipeline: int, step: int, loss: float) -> None:
        """`pipeline`'s last stage trained `step` to `loss`. Steps are reported once each, in
        order: anything else is a confused or hostile peer, and must not grow the event list
        (Refusal FAILED_PRECONDITION)."""
        losses = self.pipeline_losses.setdefault(pipeline, {})
        expected = max(losses, default=self.resumed_at) + 1
        if step != expected or expected > self._train.steps:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"report for step {step}, expected step {expected}")  # fmt: skip
        losses[step] = loss
        self.complete_steps()

    def complete_steps(self) -> None:
        """Record each step every pipeline has reported (or dropped), in order: its mean loss
        over the pipelines that trained it, and its progress event."""
        pipelines = range(self._train.pipelines)
        step = self.completed() + 1
        while step <= self._train.steps and all(
            step in self.pipeline_losses.get(p, {}) for p in pipelines
        ):
            trained = [
                loss for p in pipelines if not math.isnan(loss := self.pipeline_losses[p][step])
            ]
            self.losses[step] = sum(trained) / len(trained) if trained else math.nan
            self.events.append(self.event(step, self.losses[step]))
            step += 1

    def event(self, step: int, loss: float) -> pb.Progress:
        """The progress event of `step` (counters as of now)."""
        t = self._train
        eval_step = max(self.evals, default=0)
        return pb.Progress(
            step=step,
            steps=t.steps,
            loss=loss,
            samples=(step - self.resumed_at) * t.batch_size * t.pipelines,
            wall_s=self._clock() - self.started_at,
            bytes_on_wire=sum(self.bytes_sent.values()),
            eval_step=eval_step,
            eval_loss=self.evals.get(eval_step, 0.0),
        )

    # ----- faults -----------------------------------------------------------------------------
    def drop_steps(self, pipeline: int, start_step: int, stop: int) -> int:
        """Broken `pipeline` (of a plan that started at `start_step`) trains no step up to
        `stop`: the steps after its last report are dropped (NaN, left out of the mean);
        steps it reported past `stop` (it was ahead) go too. The last step it trained."""
        losses = self.pipeline_losses.setdefault(pipeline, {})
        for step in [s for s in losses if s > stop]:
            del losses[step]
        last = max(losses, default=start_step)
        for step in range(last + 1, stop + 1):
            losses[step] = math.nan
        return last

    def roll_back(self, step: int) -> int:
        """A restore takes the run back to `step`: every stage drops what it trained after
        it, and final reports of the rolled-back timeline (a stage ended early) go. The
        microbatches to train again."""
        self.finals = {}
        redone = 0
        for losses in self.pipeline_losses.values():
            later = [s for s in losses if s > step]
            redone += len(later) * self._train.microbatches
            for s in later:
                del losses[s]
        for s in [s for s in self.losses if s > step]:
            del self.losses[s]
        self.checkpoints = {k: v for k, v in self.checkpoints.items() if v[1] <= step}
        return redone

    # ----- a store ----------------------------------------------------------------------------
    def resume(
        self,
        *,
        pipeline_losses: dict[int, dict[int, float]],
        dropped_steps: dict[int, list[int]],
        bytes_sent: dict[str, int],
        finals: dict[StageKey, pb.StageReport],
        events: list[pb.Progress],
    ) -> None:
        """What a store held (`dropped_steps`: pipeline -> steps it never trained, NaN in its
        losses). The run resumes at the step before the first it has every loss of."""
        self.pipeline_losses = pipeline_losses
        for pipeline, steps in dropped_steps.items():
            losses = self.pipeline_losses.setdefault(pipeline, {})
            losses.update(dict.fromkeys(steps, math.nan))
        self.bytes_sent, self.finals, self.events = bytes_sent, finals, events
        # Events of steps a restore rolled back stay in the list; the losses table does not
        # have them: a step counts once every pipeline's loss for it is stored.
        self.losses = {
            e.step: e.loss for e in events
            if not e.done and all(e.step in self.pipeline_losses.get(p, {})
                                  for p in range(self._train.pipelines))
        }  # fmt: skip
        if self.losses:
            self.resumed_at = min(self.losses) - 1
