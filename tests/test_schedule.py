"""The schedule's decisions as functions of its counts, without threads, sockets or an event
loop: the staleness bound and its warm-up, what the first stage may feed, which frames fit, and
where a plan ends."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ravnest_node.compression import get_codec
from ravnest_node.errors import ConfigError, FrameError
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import GRAD, HIDDEN, TARGETS, Schedule, StageSpec
from ravnest_node.transport.frames import (
    Expected,
    Frame,
    FrameKind,
    FrameLimits,
    encode_frame,
    parse_frame,
)

M = 2  # microbatches per step
MB = 2  # rows per microbatch
NONE = get_codec("none")
FORWARD = [Expected(HIDDEN, (MB, 3), torch.float32), Expected(TARGETS, (MB,), torch.uint8)]
BACKWARD = [Expected(GRAD, (MB, 3), torch.float32)]


def _schedule(
    index: int = 1,
    num_stages: int = 3,
    start_step: int = 0,
    **run: Any,
) -> Schedule:
    """Stage `index` of `num_stages`, at `start_step` of a run of 6 steps (or `run`'s); a
    step ahead runs whole and without waiting for backwards unless `run` says otherwise."""
    base = {"model": "tiny", "steps": 6, "batch_size": M * MB, "microbatches": M,
            "stale_microbatches": 0, "stale_after_backwards": 0}  # fmt: skip
    config = TrainConfig(**(base | run))
    spec = StageSpec(index=index, num_stages=num_stages, first_block=index, stop_block=index + 1)
    return Schedule(spec, config, start_step=start_step, forward=FORWARD, backward=BACKWARD)


def _forward(
    seq: int, version: int | None = None, samples: tuple[int, ...] = (), rows: int = MB
) -> Frame:
    message = encode_frame(
        FrameKind.FORWARD,
        seq,
        seq // M if version is None else version,
        [(HIDDEN, torch.zeros(rows, 3), NONE), (TARGETS, torch.zeros(MB, dtype=torch.uint8), NONE)],
        samples=samples,
    )
    return parse_frame(message, FrameLimits(max_message_bytes=1 << 20))


def _grad(seq: int, version: int | None = None) -> Frame:
    message = encode_frame(
        FrameKind.BACKWARD,
        seq,
        seq // M if version is None else version,
        [(GRAD, torch.zeros(MB, 3), NONE)],
    )
    return parse_frame(message, FrameLimits(max_message_bytes=1 << 20))


def _steps(schedule: Schedule, n: int) -> None:
    """Apply n steps, every microbatch's backward done in order."""
    for _ in range(n):
        for i in range(M):
            done = schedule.microbatch_done(schedule.version * M + i)
            assert done == (i == M - 1)
        schedule.stepped()


def test_the_staleness_bound_is_zero_during_the_warm_up() -> None:
    schedule = _schedule(max_staleness=2, staleness_warmup_steps=2)
    assert schedule.may_forward(0) and schedule.may_forward(M - 1)  # step 0 at version 0
    assert not schedule.may_forward(M)  # step 1 is in the warm-up: it waits for version 1
    _steps(schedule, 1)
    assert schedule.may_forward(M)  # step 1 at version 1
    # A microbatch's bound is its step's: step 3 is past the warm-up, two updates ahead.
    assert schedule.may_forward(3 * M) and schedule.may_forward(4 * M - 1)
    assert not schedule.may_forward(4 * M)


def test_synchronous_training_runs_each_step_at_its_own_version() -> None:
    schedule = _schedule(max_staleness=0, staleness_warmup_steps=0)
    for version in range(3):
        assert schedule.may_forward(version * M + M - 1)
        assert not schedule.may_forward((version + 1) * M)
        _steps(schedule, 1)


def test_the_first_stage_feeds_as_far_as_the_bound_and_the_plan_allow() -> None:
    schedule = _schedule(index=0, max_staleness=1, staleness_warmup_steps=0)
    fed = []
    while schedule.may_produce():
        fed.append(schedule.produce())
    assert fed == list(range(2 * M))  # steps 0 and 1 at version 0
    _steps(schedule, 1)
    assert schedule.may_produce() and schedule.produce() == 2 * M
    # A drain: no new step is begun; the step under way (2) is finished.
    assert schedule.drain_step() == 3
    while schedule.may_produce():
        fed.append(schedule.produce())
    assert schedule.produced == 3 * M and not schedule.may_produce()


def test_only_a_steps_first_stale_microbatches_run_ahead_of_its_update() -> None:
    schedule = _schedule(index=0, max_staleness=1, staleness_warmup_steps=0,
                         microbatches=M, stale_microbatches=1, steps=4)  # fmt: skip
    # Step 0 at version 0: all of it; step 1 at version 0: its first microbatch only.
    allowed = [True] * (M + 1) + [False] * (M - 1)
    assert [schedule.may_forward(seq) for seq in range(2 * M)] == allowed
    assert not schedule.may_forward(2 * M)  # step 2: beyond the bound
    for _ in range(M + 1):
        assert schedule.may_produce()
        schedule.produce()
    assert not schedule.may_produce()  # the rest of step 1 waits for the update
    _steps(schedule, 1)
    assert schedule.may_produce() and schedule.may_forward(M + 1)
    # Without the setting (0), the whole step runs ahead, as far as the bound allows.
    unlimited = _schedule(max_staleness=1, staleness_warmup_steps=0)
    assert all(unlimited.may_forward(seq) for seq in range(2 * M))


def test_a_step_runs_ahead_only_once_stale_after_backwards_of_the_update_are_in() -> None:
    schedule = _schedule(index=0, max_staleness=1, staleness_warmup_steps=0,
                         microbatches=M, stale_microbatches=1, stale_after_backwards=1)  # fmt: skip
    assert all(schedule.may_forward(seq) for seq in range(M))  # step 0 at version 0
    assert not schedule.may_forward(M)  # step 1's first: none of step 0's backwards is in
    assert not schedule.microbatch_done(0)
    assert schedule.may_forward(M) and not schedule.may_forward(M + 1)  # one in: the first
    assert schedule.microbatch_done(1)
    schedule.stepped()
    assert schedule.may_forward(M + 1)  # the update landed: the rest of step 1
    assert not schedule.may_forward(2 * M)  # step 2's first waits for step 1's backwards again


def test_a_forward_is_held_for_gradients_only_by_that_rule() -> None:
    schedule = _schedule(index=0, max_staleness=1, staleness_warmup_steps=2, steps=4,
                         stale_microbatches=1, stale_after_backwards=1)  # fmt: skip
    for _ in range(M):
        schedule.produce()
    assert not schedule.held_for_gradients(None)  # step 1 is in the warm-up: the bound holds it
    _steps(schedule, 1)
    for _ in range(M):
        schedule.produce()
    assert schedule.held_for_gradients(None)  # step 2's first waits for step 1's first backward
    assert not schedule.microbatch_done(M)
    assert not schedule.held_for_gradients(None) and schedule.may_produce()
    schedule.produce()
    assert not schedule.held_for_gradients(None)  # the rest of step 2 waits for the update
    # A later stage asks about the forward it has queued; none queued, nothing held.
    later = _schedule(max_staleness=1, staleness_warmup_steps=0, stale_after_backwards=1)
    assert later.held_for_gradients(M) and not later.held_for_gradients(None)
    assert not later.held_for_gradients(0) and not later.held_for_gradients(2 * M)


def test_a_stage_may_stop_waiting_for_the_updates_gradients() -> None:
    schedule = _schedule(max_staleness=1, staleness_warmup_steps=0,
                         stale_microbatches=1, stale_after_backwards=1)  # fmt: skip
    assert not schedule.may_forward(M)
    schedule.whole_step_ahead(True)
    assert all(schedule.may_forward(seq) for seq in range(2 * M))  # the whole step, no wait
    assert not schedule.may_forward(2 * M) and not schedule.held_for_gradients(M)
    schedule.whole_step_ahead(False)  # (a trial that was not faster)
    assert not schedule.may_forward(M) and schedule.held_for_gradients(M)


def test_ahead_wait_share_is_checked_and_travels_in_the_run_spec() -> None:
    for share in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="ahead_wait_share"):
            TrainConfig(model="tiny", batch_size=M * MB, microbatches=M, ahead_wait_share=share)
    config = TrainConfig(model="tiny", batch_size=M * MB, microbatches=M, ahead_wait_share=0.25)
    assert TrainConfig.from_proto(config.to_proto("x")).ahead_wait_share == 0.25


def test_stale_after_backwards_is_checked_and_travels_in_the_run_spec() -> None:
    with pytest.raises(ConfigError, match="stale_after_backwards"):
        TrainConfig(model="tiny", batch_size=M * MB, microbatches=M, stale_after_backwards=-1)
    config = TrainConfig(model="tiny", batch_size=M * MB, microbatches=M, stale_after_backwards=1)
    assert TrainConfig.from_proto(config.to_proto("x")).stale_after_backwards == 1
    # At most microbatches - 1: the last backward lands the update (the default of 2 with
    # 2 microbatches waits for one, with 1 for none).
    for microbatches, after in ((1, 0), (2, 1), (4, 2)):
        run = TrainConfig(model="tiny", batch_size=4 * microbatches, microbatches=microbatches)
        assert run.ahead_after == after


def test_stale_microbatches_is_checked_and_travels_in_the_run_spec() -> None:
    with pytest.raises(ConfigError, match="stale_microbatches"):
        TrainConfig(model="tiny", batch_size=M * MB, microbatches=M, stale_microbatches=-1)
    config = TrainConfig(model="tiny", batch_size=M * MB, microbatches=M, stale_microbatches=1)
    assert TrainConfig.from_proto(config.to_proto("x")).stale_microbatches == 1


def test_the_sequential_schedule_waits_for_each_gradient() -> None:
    schedule = _schedule(index=0, schedule="sequential", max_staleness=1)
    assert schedule.may_produce()
    schedule.sent_forward(schedule.produce())
    assert not schedule.may_produce()  # microbatch 0's gradient is not back
    schedule.admitted(FrameKind.BACKWARD, 0)
    assert schedule.may_produce()


def test_the_stage_waits_for_upstream_only_when_a_forward_would_be_allowed() -> None:
    schedule = _schedule(max_staleness=0)
    assert schedule.waiting_for_upstream(forwards_queued=False)
    assert not schedule.waiting_for_upstream(forwards_queued=True)
    for seq in range(M):
        schedule.admitted(FrameKind.FORWARD, seq)
    assert not schedule.waiting_for_upstream(forwards_queued=False)  # the bound holds it
    assert not _schedule(index=0).waiting_for_upstream(forwards_queued=False)


def test_forward_frames_are_checked_against_the_plan_in_order() -> None:
    schedule = _schedule(steps=1)
    schedule.check_frame(_forward(0))
    with pytest.raises(FrameError, match="forward seq 1, expected 0"):
        schedule.check_frame(_forward(1))
    with pytest.raises(FrameError, match="past the plan's last microbatch 1"):
        schedule.check_frame(_forward(M))
    with pytest.raises(FrameError, match=r"shape \[3, 3\]"):
        schedule.check_frame(_forward(0, rows=3))
    with pytest.raises(FrameError, match="the first stage takes no forward frames"):
        _schedule(index=0).check_frame(_forward(0))
    schedule.admitted(FrameKind.FORWARD, 0)
    assert schedule.next_forward_seq == 1 and not schedule.received_all_forwards
    schedule.admitted(FrameKind.FORWARD, 1)
    assert schedule.received_all_forwards


def test_versions_within_the_bound_of_their_step_fit() -> None:
    schedule = _schedule(max_staleness=1)
    for seq in range(M):
        schedule.admitted(FrameKind.FORWARD, seq)
    with pytest.raises(FrameError, match="forward seq 2 carries weight version 2, expected 1 or"):
        schedule.check_frame(_forward(M, version=2))
    schedule.check_frame(_forward(M, version=0))
    schedule.check_frame(_forward(M, version=1))
    synchronous = _schedule(max_staleness=0)
    with pytest.raises(FrameError, match=r"carries weight version 1, expected 0$"):
        synchronous.check_frame(_forward(0, version=1))


def test_gradients_fit_only_for_microbatches_sent_downstream() -> None:
    schedule = _schedule()
    with pytest.raises(FrameError, match="gradient for microbatch 0, which is not in flight"):
        schedule.check_frame(_grad(0))
    schedule.sent_forward(0)
    schedule.check_frame(_grad(0))
    with pytest.raises(FrameError, match="backward seq 0 carries weight version 1"):
        schedule.check_frame(_grad(0, version=1))
    schedule.admitted(FrameKind.BACKWARD, 0)
    assert schedule.awaiting_grad == set()
    with pytest.raises(FrameError, match="the last stage takes no gradient frames"):
        _schedule(index=2).check_frame(_grad(0))


def test_sample_ids_fit_a_fixed_dataset_run_only() -> None:
    fixed = _schedule(dataset_samples=8)
    fixed.check_frame(_forward(0, samples=(3, 7)))
    with pytest.raises(FrameError, match="lists 1 sample ids, not 2"):
        fixed.check_frame(_forward(0, samples=(3,)))
    with pytest.raises(FrameError, match="distinct and below 8"):
        fixed.check_frame(_forward(0, samples=(3, 3)))
    with pytest.raises(FrameError, match="distinct and below 8"):
        fixed.check_frame(_forward(0, samples=(3, 8)))
    with pytest.raises(FrameError, match="lists 2 sample ids, not 0"):
        _schedule().check_frame(_forward(0, samples=(3, 7)))


def test_a_queue_holds_at_most_the_window() -> None:
    schedule = _schedule(max_staleness=2)
    assert schedule.window == 3 * M
    schedule.check_room(3 * M - 1)
    with pytest.raises(FrameError, match="more frames in flight than the schedule allows"):
        schedule.check_room(3 * M)


def test_staleness_outside_the_bound_is_a_bug() -> None:
    schedule = _schedule(max_staleness=1)
    schedule.check_staleness(0)
    schedule.check_staleness(1)
    for staleness in (-1, 2):
        with pytest.raises(RuntimeError, match=f"staleness {staleness} outside 0..1"):
            schedule.check_staleness(staleness)


def test_a_plan_stops_at_a_step_boundary_not_behind_the_stage() -> None:
    schedule = _schedule(start_step=1)
    assert schedule.version == 1 and schedule.next_forward_seq == M and not schedule.done
    with pytest.raises(ValueError, match="cannot stop at step 0: this stage is at 1"):
        schedule.stop_at(0)
    with pytest.raises(ValueError, match="cannot stop at step 7"):
        schedule.stop_at(7)
    schedule.stop_at(2)
    assert schedule.total_microbatches == 2 * M and not schedule.done
    _steps(schedule, 1)
    assert schedule.done and not schedule.run_done
    with pytest.raises(ValueError, match=r"start_step 6 outside 0\.\.5"):
        _schedule(start_step=6)


def test_the_first_stage_cannot_stop_before_what_it_fed() -> None:
    schedule = _schedule(index=0)
    schedule.produce()  # microbatch 0 of step 0 is fed
    with pytest.raises(ValueError, match="microbatches of it are fed already"):
        schedule.stop_at(0)
    assert schedule.drain_step() == 1  # the step under way is finished
    schedule.stop_at(1)
    assert schedule.feed_limit == schedule.stop_step == 1


def test_a_clean_upstream_end_stops_the_plan_only_at_a_step_boundary() -> None:
    schedule = _schedule()
    assert schedule.upstream_end_step() == 0
    schedule.admitted(FrameKind.FORWARD, 0)
    assert schedule.upstream_end_step() is None  # inside step 0
    schedule.admitted(FrameKind.FORWARD, 1)
    assert schedule.upstream_end_step() == 1
    behind = _schedule(start_step=2)
    behind.next_forward_seq = M  # (never so in a run: a stream behind the stage's version)
    assert behind.upstream_end_step() is None


def test_a_step_is_done_when_all_its_microbatches_are() -> None:
    schedule = _schedule()
    assert not schedule.microbatch_done(0)
    assert schedule.step_done == 1
    assert schedule.microbatch_done(1)
    schedule.stepped()
    assert schedule.version == 1 and schedule.step_done == 0
    with pytest.raises(AssertionError):
        schedule.microbatch_done(0)  # backwards complete in step order
