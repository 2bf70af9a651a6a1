"""A replicated stage's averaging rounds, as its loop runs them.

**Replica averaging**: with several pipelines, every `average_every` steps the stage takes its
parameter delta and averages it with its replica group in the background (DiLoCo outer step,
docs/averaging.md); the result is applied between two microbatches when it arrives, or, where
the config fixes where it lands (`AveragingConfig.lands_after`, synchronous runs), right after
that many more optimizer steps, waited for if late. New forwards use the averaged weights from
then on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ravnest_node.averaging import AveragingConfig, ReplicaAverager, RoundResult
from ravnest_node.pipeline.compute import StageCompute
from ravnest_node.pipeline.counters import StageCounters

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Averaging:
    """A stage's replica group: how and with whom it averages (docs/averaging.md)."""

    config: AveragingConfig
    averager: ReplicaAverager


class ReplicaRounds:
    """The rounds of one stage's replica group: at most one in flight, begun after the step
    it is due at and applied by the loop when its result is in. Event loop only."""

    def __init__(
        self,
        averaging: Averaging,
        compute: StageCompute,
        counters: StageCounters,
        wake: asyncio.Event,
        stage: int,
    ) -> None:
        """`wake` is set when a round's result arrives; `stage`: the stage's index, for logs."""
        self._averaging = averaging
        self._compute = compute
        self._counters = counters
        self._wake = wake
        self._stage = stage
        self._round: asyncio.Task[RoundResult] | None = None
        self._began_at = 0
        """The version the round in flight began after."""

    def due(self, version: int) -> bool:
        """A round begins now that `version` steps are applied."""
        return self._averaging.config.round_due(version)

    @property
    def in_flight(self) -> bool:
        """A round has begun and is not applied yet."""
        return self._round is not None

    @property
    def arrived(self) -> bool:
        """The round in flight has its result and may be applied whenever it arrives: `finish`
        applies it without waiting. False where the config fixes where rounds land (`lands`)."""
        return (
            self._round is not None
            and self._round.done()
            and not self._averaging.config.lands_after
        )

    def lands(self, version: int) -> bool:
        """The round in flight is to be applied now that `version` steps are applied (waited
        for if it is late): `lands_after` steps after the one it began after."""
        after = self._averaging.config.lands_after
        return self._round is not None and after > 0 and version >= self._began_at + after

    async def begin(self, version: int) -> None:
        """Take this replica's delta and average it with the group in the background. A round
        still in flight is finished first: one round at a time (that wait is the
        backpressure of a slow group)."""
        if self._round is not None:
            await self.finish()
        started = time.monotonic()
        compute = self._compute
        delta = await compute.call(compute.weights.begin_round)
        round_number = self._averaging.config.round_of(version)
        self._began_at = version
        self._round = asyncio.create_task(
            self._averaging.averager.average(round_number, delta, step=version)
        )
        self._round.add_done_callback(lambda _: self._wake.set())
        self._counters.counts.averaging_wait_s += time.monotonic() - started

    async def finish(self) -> None:
        """Wait for the round in flight (if it is not done yet) and apply its mean."""
        assert self._round is not None
        started = time.monotonic()
        result = await self._round
        self._round = None
        await self._compute.call(self._compute.weights.apply_round, result.mean)
        counters = self._counters.counts
        counters.averaging_rounds += 1
        counters.averaging_bytes_sent += result.bytes_sent
        left_out = sorted({*result.missing, *result.rejected, *result.banned})
        if left_out:
            counters.averaging_rounds_incomplete += 1
            log.warning(
                "averaging round %d of stage %d went on without %s",
                result.round,
                self._stage,
                ", ".join(left_out),
            )
        counters.averaging_wait_s += time.monotonic() - started
