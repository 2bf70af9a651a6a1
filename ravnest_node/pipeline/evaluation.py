"""Evaluations on held-out data as the last stage of pipeline 0 sees them: the losses of each
evaluation's microbatches, summed until its last one, then its mean (the mean of the
microbatches' mean losses, as a training step's loss is). An evaluation that a frame is missing
from (lost on a broken stream, or cut off by a plan's end) is counted lost, never reported as a
mean of fewer microbatches. Pure: no torch, no I/O."""

from __future__ import annotations

import math

__all__ = ["Evaluations"]


class Evaluations:
    """The evaluations one stage has finished: the newest (`step`, `loss`) and how many were
    `lost`. Microbatches arrive in (step, index) order (admission makes sure of it)."""

    def __init__(self, microbatches: int) -> None:
        """`microbatches`: how many one evaluation has."""
        self.microbatches = microbatches
        self.step = 0
        """The step the newest whole evaluation followed (0: none yet)."""
        self.loss = math.nan
        """Its mean loss."""
        self.lost = 0
        """Evaluations begun here and missing a microbatch."""
        self._open: int | None = None
        self._sum = 0.0
        self._count = 0

    def add(self, step: int, index: int, loss: float) -> bool:
        """Microbatch `index` of the evaluation after `step` had `loss`; True if that made an
        evaluation whole (`step`, `loss` are now its)."""
        if self._open is not None and self._open != step:
            self.end()
        self._open = step
        self._sum += loss
        self._count += 1
        if index == self.microbatches - 1:
            return self._close()
        return False

    def end(self) -> None:
        """No more microbatches of the evaluation begun: lost if it was not whole."""
        if self._open is not None:
            self._close()

    def _close(self) -> bool:
        whole = self._count == self.microbatches
        if whole:
            assert self._open is not None
            self.step, self.loss = self._open, self._sum / self._count
        else:
            self.lost += 1
        self._open, self._sum, self._count = None, 0.0, 0
        return whole
