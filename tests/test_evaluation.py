"""Evaluations on held-out data (`--eval-every`), without sockets: the last stage's tally, the
schedule's admission of evaluation frames and its end of the run, the run settings, the codec
an evaluation's activations take, and what the coordinator makes of the reports."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ravnest_node.compression import get_codec
from ravnest_node.coordination.coordinator.progress import RunProgress
from ravnest_node.errors import ConfigError, FrameError
from ravnest_node.models import get_model
from ravnest_node.models.registry import MODEL_PRESETS, register_model
from ravnest_node.pipeline.codec_choice import CodecChoice
from ravnest_node.pipeline.evaluation import Evaluations
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import HIDDEN, TARGETS, Schedule, StageSpec
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.boundary import BoundaryLink, LinkCounters
from ravnest_node.transport.frames import (
    Expected,
    Frame,
    FrameKind,
    FrameLimits,
    encode_frame,
    parse_frame,
)

HELD = "tiny-held-out"
"""tiny, with held-out data (its training data under another seed) to evaluate on."""


def _tiny_held_out() -> Any:
    model = get_model("tiny")

    class HeldOut(type(model)):  # type: ignore[misc]
        held_out = True

        def eval_dataset(self, *, seed: int) -> Any:
            return self.dataset(seed=seed + 1)

    model.__class__ = HeldOut
    return model


if HELD not in MODEL_PRESETS:
    register_model(HELD, _tiny_held_out)

M, MB = 2, 2
NONE = get_codec("none")
FORWARD = [Expected(HIDDEN, (MB, 3), torch.float32), Expected(TARGETS, (MB,), torch.uint8)]


def _schedule(index: int = 1, pipeline: int = 0, start_step: int = 0, **run: Any) -> Schedule:
    """Stage `index` of 3 of pipeline `pipeline` (of 2), a run of 6 steps evaluating every 2
    with 2 batches of 2 microbatches (4 microbatches an evaluation)."""
    config = TrainConfig(**({"model": HELD, "steps": 6, "batch_size": M * MB, "microbatches": M,
                             "eval_every": 2, "pipelines": 2} | run))  # fmt: skip
    spec = StageSpec(index=index, num_stages=3, first_block=index, stop_block=index + 1,
                     pipeline=pipeline, num_pipelines=2)  # fmt: skip
    return Schedule(spec, config, start_step=start_step, forward=FORWARD, backward=[])


def _eval(version: int, seq: int, samples: tuple[int, ...] = ()) -> Frame:
    message = encode_frame(
        FrameKind.EVAL, seq, version,
        [(HIDDEN, torch.zeros(MB, 3), NONE), (TARGETS, torch.zeros(MB, dtype=torch.uint8), NONE)],
        samples=samples,
    )  # fmt: skip
    return parse_frame(message, FrameLimits(max_message_bytes=1 << 20))


def _admit(schedule: Schedule, frame: Frame) -> None:
    schedule.check_frame(frame)
    schedule.admitted(frame.kind, frame.seq, frame.version)


def test_an_evaluation_is_whole_or_lost() -> None:
    evals = Evaluations(3)
    assert [evals.add(4, i, loss) for i, loss in enumerate((1.0, 2.0, 6.0))] == [False] * 2 + [True]
    assert (evals.step, evals.loss, evals.lost) == (4, 3.0, 0)
    # A microbatch missing (its frame lost): the next evaluation's first closes it as lost.
    evals.add(8, 0, 1.0)
    evals.add(8, 2, 1.0)  # the last index, with one missing: not whole
    assert (evals.step, evals.loss, evals.lost) == (4, 3.0, 1)
    evals.add(12, 0, 5.0)
    evals.add(16, 0, 1.0)  # 12's others never came
    evals.end()  # (and 16's)
    assert (evals.step, evals.lost) == (4, 3)


def test_the_schedule_admits_evaluation_frames_in_order_with_gaps() -> None:
    schedule = _schedule()
    _admit(schedule, _eval(2, 0))
    _admit(schedule, _eval(2, 2))  # 1 lost on a broken stream: a gap is fine
    _admit(schedule, _eval(4, 0))
    assert schedule.last_eval == (4, 0) and schedule.evals_waiting == 3
    refusals = {
        "after \\(4, 0\\): out of order": _eval(2, 3),
        "\\(4, 0\\) after \\(4, 0\\)": _eval(4, 0),
        "does not evaluate there": _eval(5, 0),
        "an evaluation has 4": _eval(6, 4),
        "no sample ids": _eval(6, 0, samples=(1, 0)),
    }
    for match, frame in refusals.items():
        with pytest.raises(FrameError, match=match):
            schedule.check_frame(frame)
    # Only pipeline 0 evaluates, and the first stage makes them itself.
    for other in (_schedule(pipeline=1), _schedule(index=0)):
        with pytest.raises(FrameError, match="takes no evaluation frames"):
            other.check_frame(_eval(2, 0))
    # A plan that started at step 4 had the evaluation after step 4 done by the one before.
    with pytest.raises(FrameError, match="does not evaluate there"):
        _schedule(start_step=4).check_frame(_eval(4, 0))
    # Two evaluations' microbatches may wait; a peer that sends more is refused.
    schedule.check_room(7, FrameKind.EVAL)
    with pytest.raises(FrameError, match="more frames"):
        schedule.check_room(8, FrameKind.EVAL)


def test_a_later_stage_ends_the_run_after_the_last_evaluation() -> None:
    schedule = _schedule(index=2, steps=4)
    for _ in range(4):
        schedule.stepped()
    assert not schedule.done  # the evaluation after step 4 has not passed yet
    for seq in range(4):
        _admit(schedule, _eval(4, seq))
        assert not schedule.done
        schedule.eval_passed(4, seq)
    assert schedule.done
    # Its upstream gone quiet (the evaluation lost), it ends once what came is done.
    quiet = _schedule(index=2, steps=4)
    for _ in range(4):
        quiet.stepped()
    _admit(quiet, _eval(4, 0))
    quiet.upstream_closed = True
    assert not quiet.done
    quiet.eval_passed(4, 0)
    assert quiet.done
    # Pipeline 1, and the first stage (it sends the evaluation before it ends), do not wait.
    for other in (_schedule(index=2, pipeline=1, steps=4), _schedule(index=0, steps=4)):
        for _ in range(4):
            other.stepped()
        assert other.done


def test_the_run_settings() -> None:
    with pytest.raises(ConfigError, match="model 'tiny' has no held-out data; name some with"):
        TrainConfig(model="tiny", eval_every=5)
    with pytest.raises(ConfigError, match="eval_batches=0"):
        TrainConfig(model=HELD, eval_every=5, eval_batches=0)
    run = TrainConfig(model=HELD, steps=12, eval_every=5, eval_batches=3)
    assert [s for s in range(14) if run.evaluates_at(s)] == [5, 10, 12]
    assert run.eval_microbatches == 3 * run.microbatches
    back = TrainConfig.from_proto(run.to_proto(""))
    assert (back.eval_every, back.eval_batches) == (5, 3)
    assert not any(TrainConfig(model=HELD).evaluates_at(s) for s in range(300))


def test_an_evaluation_takes_a_stateless_codec_and_moves_nothing() -> None:
    x = torch.randn(4, 8, 16)
    for name, expected in (("int4-block", "int4-block"), ("klt", "int8-block"),
                           ("none", "none")):  # fmt: skip
        choice = CodecChoice(name, "activation", compute_s=lambda: 0.0, every=4, what="test")
        out = choice.stateless(HIDDEN, x)
        assert (out.codec.name, out.state) == (expected, None)
        assert choice.frames == {}  # not counted as a frame of the stream


def _report(pipeline: int, stage: int, eval_step: int, eval_loss: float) -> pb.StageReport:
    return pb.StageReport(node_id=f"n{pipeline}{stage}", pipeline=pipeline, stage=stage, step=3,
                          eval_step=eval_step, eval_loss=eval_loss)  # fmt: skip


def test_the_coordinator_keeps_pipeline_zeros_evaluations() -> None:
    progress = RunProgress(TrainConfig(model=HELD, steps=6, eval_every=2), clock=lambda: 0.0)
    progress.note(_report(0, 2, 0, 0.0), (0, 2))  # none yet
    progress.note(_report(0, 2, 2, 4.5), (0, 2))
    progress.note(_report(0, 2, 2, 4.5), (0, 2))  # carried again by the next report
    progress.note(_report(1, 2, 4, 1.0), (1, 2))  # (pipeline 1 never evaluates)
    progress.note(_report(0, 2, 4, math.nan), (0, 2))  # not a loss
    progress.note(_report(0, 2, 9, 1.0), (0, 2))  # past the run
    assert progress.evals == {2: 4.5}
    event = progress.event(3, 5.0)
    assert (event.eval_step, event.eval_loss) == (2, 4.5)


async def test_an_evaluation_frame_is_written_but_never_kept_for_a_resume() -> None:
    link = BoundaryLink("peer", LinkCounters(), outbox_size=4)
    written: list[bytes] = []

    async def write(message: bytes) -> None:
        written.append(message)

    await link.send(b"forward 0", 0)
    await link.send(b"evaluation", None)
    await link.send(b"forward 1", 1)
    await link.close()
    await link.pump_writes(write)
    assert written == [b"forward 0", b"evaluation", b"forward 1"]
    assert link.log.forwards_from(0) == [(0, b"forward 0"), (1, b"forward 1")]
