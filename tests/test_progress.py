"""The run's progress on its own: losses in order, the mean over pipelines, dropped and
rolled-back steps, retries, and what a store resumes."""

from __future__ import annotations

import math

import grpc
import pytest

from ravnest_node.coordination.coordinator.progress import RunProgress
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.errors import Refusal

from .fakes import Clock

TRAIN = TrainConfig(model="tiny", steps=6, batch_size=16, pipelines=2, microbatches=4)


def test_steps_complete_once_every_pipeline_reported_them() -> None:
    clock = Clock()
    progress = RunProgress(TRAIN, clock)
    progress.start(clock.now, 1e9)
    progress.record_loss(0, 1, 4.0)
    progress.record_loss(0, 2, 3.0)
    assert progress.losses == {} and progress.completed() == 0
    clock.now += 2.0
    progress.bytes_sent["a"] = 100
    progress.record_loss(1, 1, 2.0)
    assert progress.losses == {1: 3.0} and progress.completed() == 1
    (event,) = progress.events
    assert (event.step, event.loss, event.samples, event.wall_s, event.bytes_on_wire) == (
        1, 3.0, 32, 2.0, 100,
    )  # fmt: skip
    with pytest.raises(Refusal, match="report for step 4, expected step 2") as info:
        progress.record_loss(1, 4, 1.0)  # steps come in order, once each
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(Refusal, match="expected step 3"):
        progress.record_loss(0, 2, 3.0)


def test_a_dropped_step_is_left_out_of_the_mean() -> None:
    progress = RunProgress(TRAIN, Clock())
    for step in (1, 2, 3):
        progress.record_loss(0, step, 4.0)
    progress.record_loss(1, 1, 2.0)
    progress.record_loss(1, 2, 2.0)
    assert progress.drop_steps(1, start_step=0, stop=3) == 2
    progress.complete_steps()
    assert math.isnan(progress.pipeline_losses[1][3]) and progress.losses[3] == 4.0
    # Reported past the end (it was ahead): those go too.
    progress.record_loss(0, 4, 4.0)
    assert (
        progress.drop_steps(0, start_step=0, stop=3) == 3 and 4 not in progress.pipeline_losses[0]
    )
    assert progress.drop_steps(1, start_step=5, stop=3) == 3  # nothing new dropped


def test_retries_are_recognised_nan_included() -> None:
    progress = RunProgress(TRAIN, Clock())
    progress.record_loss(0, 1, math.nan)
    report = pb.StageReport(node_id="b", pipeline=0, stage=1, step=1, loss=math.nan)
    assert progress.is_repeat(report, (0, 1), last=1)
    assert not progress.is_repeat(report, (0, 0), last=1)  # not the last stage: counters only
    report.loss = 2.0
    assert not progress.is_repeat(report, (0, 1), last=1)
    final = pb.StageReport(node_id="b", pipeline=0, stage=1, step=6, done=True)
    progress.record_final((0, 1), final)
    assert progress.is_repeat(final, (0, 1), last=1)
    with pytest.raises(Refusal, match="cannot be done at step 6"):
        progress.record_final((0, 1), final)
    with pytest.raises(Refusal, match="cannot be done at step 5"):
        progress.record_final((0, 0), pb.StageReport(step=5, done=True))


def test_reports_carry_counters_that_only_grow_and_checkpoints() -> None:
    progress = RunProgress(TRAIN, Clock())
    progress.note(pb.StageReport(node_id="a", bytes_sent=50, checkpoint_step=4), (0, 0))
    progress.note(pb.StageReport(node_id="a", bytes_sent=20, checkpoint_step=2), (0, 0))
    assert progress.bytes_sent == {"a": 50} and progress.checkpoints == {(0, 0): ("a", 4)}
    assert progress.latest[(0, 0)].bytes_sent == 20


def test_a_roll_back_forgets_later_steps_and_counts_them_redone() -> None:
    progress = RunProgress(TRAIN, Clock())
    for step in (1, 2, 3, 4):
        progress.record_loss(0, step, 4.0)
        progress.record_loss(1, step, 2.0)
    progress.record_loss(0, 5, 4.0)
    progress.checkpoints = {(0, 0): ("a", 2), (1, 0): ("c", 4)}
    progress.finals[(0, 0)] = pb.StageReport()
    assert progress.roll_back(2) == (2 + 3) * 4
    assert sorted(progress.losses) == [1, 2] and progress.completed() == 2
    assert progress.checkpoints == {(0, 0): ("a", 2)} and progress.finals == {}
    assert len(progress.events) == 4  # what watchers were shown stays


def test_a_store_resumes_at_the_first_step_it_has_every_loss_of() -> None:
    progress = RunProgress(TRAIN, Clock())
    events = [pb.Progress(step=s, loss=1.0) for s in (3, 4, 5)]
    progress.resume(
        pipeline_losses={0: {3: 1.0, 4: 1.0, 5: 1.0}, 1: {3: 1.0}},
        dropped_steps={1: [4]}, bytes_sent={"a": 9}, finals={}, events=events,
    )  # fmt: skip
    assert progress.losses == {3: 1.0, 4: 1.0} and progress.resumed_at == 2
    assert math.isnan(progress.pipeline_losses[1][4])
    assert not progress.done() and progress.bytes_sent == {"a": 9}
