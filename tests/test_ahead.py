"""A stage's trial of the whole step ahead (pipeline/ahead.py), on a clock the test moves:
tried only where the wait for the update's gradients idles the stage, kept only where it made
the steps shorter."""

from __future__ import annotations

from typing import Any

import pytest

from ravnest_node.pipeline import ahead
from ravnest_node.pipeline.ahead import KEEP_BELOW, WINDOW_STEPS, Ahead, AheadSwitch
from ravnest_node.pipeline.run import TrainConfig

WARMUP = 3


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.waited = 7.0
        """The stage's wait in all (its ahead_wait_s), warm-up included."""

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(ahead.time, "monotonic", clock)
    return clock


def _switch(**run: Any) -> AheadSwitch:
    base = {"model": "tiny", "steps": 40, "batch_size": 8, "microbatches": 4,
            "staleness_warmup_steps": WARMUP}  # fmt: skip
    return AheadSwitch(TrainConfig(**(base | run)))


def _steps(
    switch: AheadSwitch, clock: _Clock, versions: range, step_s: float, wait_s: float
) -> list[tuple[int, Ahead]]:
    """Apply the steps `versions` (the version after each), each taking `step_s` of which
    `wait_s` idle for gradients; the changes asked for, by version."""
    changes = []
    for version in versions:
        clock.now += step_s
        clock.waited += wait_s
        change = switch.stepped(version, clock.waited)
        if change is not None:
            changes.append((version, change))
    return changes


def test_a_stage_that_does_not_wait_never_tries(clock: _Clock) -> None:
    switch = _switch()
    assert _steps(switch, clock, range(1, 40), 1.0, 0.05) == []
    assert switch.decided and switch.share == pytest.approx(0.05)


def test_a_trial_that_makes_steps_shorter_is_kept(clock: _Clock) -> None:
    switch = _switch()
    # The warm-up's waits do not count; the window starts once a step may run ahead.
    tried_at = WARMUP + WINDOW_STEPS
    assert _steps(switch, clock, range(1, WARMUP), 1.0, 0.9) == []
    assert _steps(switch, clock, range(WARMUP, tried_at + 1), 1.0, 0.5) == [(tried_at, Ahead.TRY)]
    assert switch.share == pytest.approx(0.5) and switch.step_s == pytest.approx(1.0)
    # One step to change over (not measured), then the trial's window.
    assert _steps(switch, clock, range(tried_at + 1, tried_at + 2), 5.0, 0.0) == []
    kept_at = tried_at + 1 + WINDOW_STEPS
    changes = _steps(switch, clock, range(tried_at + 2, 40), KEEP_BELOW - 0.05, 0.0)
    assert changes == [(kept_at, Ahead.KEEP)] and switch.decided


def test_a_trial_that_does_not_is_undone(clock: _Clock) -> None:
    switch = _switch()
    _steps(switch, clock, range(1, WARMUP + WINDOW_STEPS + 1), 1.0, 0.5)
    changes = _steps(switch, clock, range(WARMUP + WINDOW_STEPS + 1, 40), KEEP_BELOW + 0.05, 0.0)
    assert changes == [(WARMUP + 2 * WINDOW_STEPS + 1, Ahead.REVERT)]
    assert switch.trial_step_s == pytest.approx(KEEP_BELOW + 0.05)


NEVER_WAITS = [
    {"ahead_wait_share": 0.0},
    {"max_staleness": 0},
    {"stale_after_backwards": 0},
    {"microbatches": 1, "batch_size": 2},
]


@pytest.mark.parametrize("run", NEVER_WAITS)
def test_nothing_to_decide_where_the_stage_never_waits(clock: _Clock, run: dict[str, Any]) -> None:
    switch = _switch(**run)
    assert switch.decided
    assert _steps(switch, clock, range(1, 40), 1.0, 0.9) == []
