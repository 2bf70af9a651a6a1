"""When a stage stops waiting for the update's gradients before it runs ahead.

By default a stage runs the next step's first microbatches ahead of the update they follow
only once `stale_after_backwards` of that update's microbatches have run backward on it
(schedule.py, weights.py): the forward then runs on nearly the weights the update lands, and
the held-out loss stays within 0.6% of synchronous training's on the bench's home and internet
links. Whether the wait costs time depends on what bounds the pipeline. Where compute does
(the bench's internet link on its 2 cores) the first stage waits a third of its time and the
pipeline runs as fast as without the wait; where a link's latency and an uplink do (the mobile
link: 2 Mbit/s, 80 ms) the wait is a pipeline round trip during which the links carry nothing,
and the run was 16% slower than with the whole step ahead (docs/benchmarks.md). Neither the
wait itself nor the stage's own busy share tells the two apart: a stage whose neighbour is slow
waits as long as one whose links are (stage 0 waited 24-35% of the asynchronous phase on home
and internet, where the wait cost nothing, and 61% on mobile).

So the stage tries it (`AheadSwitch`): over its first `WINDOW_STEPS` asynchronous steps it
measures how long its loop idled with a forward held back only by that wait. If that is more
than `TrainConfig.ahead_wait_share` of the time, it runs the next `WINDOW_STEPS` steps (after
one to change over) with the whole step ahead on the moments' prediction, as
`--stale-microbatches 0 --stale-after-backwards 0` would, and keeps that only if its mean
step took at most `KEEP_BELOW` of the mean before; otherwise it goes back to waiting. Steps
apply at the same rate on every stage of a pipeline, so a stage's own step time is the
pipeline's. Decided once per plan. Event loop only; the stage applies the decisions to its
schedule and its weights.
"""

from __future__ import annotations

import enum
import time

from ravnest_node.pipeline.run import TrainConfig

WINDOW_STEPS = 5
"""Steps measured with the wait, and then without it."""
KEEP_BELOW = 0.8
"""The whole step ahead is kept if its mean step took at most this share of the wait's."""


class Ahead(enum.Enum):
    """What `AheadSwitch.stepped` asks of the stage."""

    TRY = "try"
    """Run the whole next step ahead, for a trial."""
    KEEP = "keep"
    """The trial was faster: go on without the wait."""
    REVERT = "revert"
    """The trial was not faster: wait for the gradients again."""


class AheadSwitch:
    """Measures one stage's wait for the update's gradients and its step times, and decides,
    once, whether the stage stops waiting (`stepped`)."""

    __slots__ = ("_from", "_limit", "_marks", "_trial_from", "_waited_before", "decided", "share",
                 "step_s", "trial_step_s")  # fmt: skip

    def __init__(self, run: TrainConfig) -> None:
        waits = run.max_staleness > 0 and run.ahead_after > 0 and run.ahead_wait_share > 0
        self._limit = run.ahead_wait_share
        self._from = run.staleness_warmup_steps
        """The window starts once a step may run ahead."""
        self._marks: list[float] = []
        """When each step of the window being measured was applied (time.monotonic)."""
        self._trial_from: int | None = None
        """The version from which the trial's window is measured, once it runs."""
        self._waited_before = 0.0
        """The stage's wait (`waited_s`) when the first window began."""
        self.decided = not waits
        """Nothing left to decide: the stage never waits, or has decided."""
        self.share: float | None = None
        """The share of the first window's time the stage waited, once measured."""
        self.step_s: float | None = None
        """The first window's mean step, in seconds, once measured."""
        self.trial_step_s: float | None = None
        """The trial's mean step, once measured."""

    def stepped(self, version: int, waited_s: float) -> Ahead | None:
        """The stage has applied `version` steps and has idled `waited_s` seconds in all with
        a forward held back only by the wait for gradients (its `ahead_wait_s`): what it
        should change now, if anything."""
        if self.decided or version < self._from:
            return None
        now = time.monotonic()
        if self._trial_from is None:
            if not self._marks:  # (a resumed plan starts its window where it starts)
                self._waited_before = waited_s
            self._marks.append(now)
            if len(self._marks) <= WINDOW_STEPS:
                return None
            self.share = (waited_s - self._waited_before) / (now - self._marks[0])
            self.step_s = _mean_step(self._marks)
            if self.share <= self._limit:
                self.decided = True
                return None
            self._marks, self._trial_from = [], version + 1  # (one step to change over)
            return Ahead.TRY
        if version < self._trial_from:
            return None
        self._marks.append(now)
        if len(self._marks) <= WINDOW_STEPS:
            return None
        self.decided = True
        self.trial_step_s = _mean_step(self._marks)
        assert self.step_s is not None
        return Ahead.KEEP if self.trial_step_s <= KEEP_BELOW * self.step_s else Ahead.REVERT


def _mean_step(marks: list[float]) -> float:
    """The mean interval between the marks: the steps' rate (a median is not, where steps
    come unevenly)."""
    return (marks[-1] - marks[0]) / (len(marks) - 1)
