"""A stage's audits of its neighbours (audit.py says what is checked and why): which frames,
the record fetched from the sender, the recomputation off the compute thread, and the report
of a neighbour that fails twice in a row. The network is the worker's: it gives the fetches
and the report as callables.

A failed audit is checked again on the very next frame of that neighbour and kind (a corrupt
frame, a record of a microbatch the sender no longer had... do not ban a node); a second
failure in a row is reported to the coordinator with the evidence, which recomputes it a
third time before it bans anyone (an auditor is not trusted blindly either). A record that
does not come (the sender too slow, its link down) is counted, not held against it.

Records are large (a record holds the sender's weights: about 2.2 MB for a stage of
bench-small), so their bytes are budgeted against the link they come over: on average they
take at most LINK_SHARE of its measured bandwidth (where nothing measured it, a fixed codec's
link, of the rate the last record came at). A frame drawn while the records fetched
from that side already used the budget (the next one expected as large as the last, the first
as large as this stage's own weights in int8, so that the first waits until its bytes have
accrued: about a second on a LAN) is let go and counted `skipped`; a check again after a
failure is never let go. On a LAN the share is never reached; on a 10 Mbit/s link a
stage of bench-small is audited about once a minute and a half from each side, on 2 Mbit/s
once in seven minutes, whatever `audit_share` asks: audits slow slow links by at most about
LINK_SHARE, and a liar there is caught later (docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from ravnest_node.errors import FrameError
from ravnest_node.models import BlockModel
from ravnest_node.pipeline.audit import (
    TOLERANCE,
    AuditDraw,
    AuditRecord,
    StageBlocks,
    auditable,
    distance,
    received_bytes,
)
from ravnest_node.pipeline.run import TrainConfig

__all__ = ["LINK_SHARE", "AuditCounts", "Auditor", "Fetch", "RecordBudget", "Report"]

log = logging.getLogger(__name__)

Fetch = Callable[[bool, int], Awaitable[bytes]]
"""(backward, seq) -> the neighbour's record of that microbatch (AuditRecord.to_bytes); raises
on any failure."""
Report = Callable[[bool, bytes, bytes, float], Awaitable[None]]
"""(backward, record, received_bytes, distance): report the neighbour that sent it."""

MAX_WAITING = 4
"""Audits in progress at once; a frame drawn beyond that is let go (counted as skipped)."""
LINK_SHARE = 0.02
"""The share of a link's measured bandwidth that audit records fetched over it may take, on
average."""


@dataclass(slots=True)
class RecordBudget:
    """The bytes the records from one side may still take (a token bucket, refilled at
    LINK_SHARE of the link, holding at most one record's worth)."""

    expected: int
    """Bytes the next record is expected to take (the last one's)."""
    tokens: float = 0.0
    at: float | None = None
    """When `tokens` was last refilled (None: not yet)."""
    fetched_bps: float | None = None
    """The last record's bytes over the seconds its fetch took: the link's rate as the records
    find it, where nothing measured it (a fixed codec's link is not probed)."""

    def take(self, bandwidth_bps: float | None, now: float) -> bool:
        """Whether a record may be fetched now (its expected bytes then taken)."""
        bandwidth_bps = bandwidth_bps or self.fetched_bps
        if not bandwidth_bps:
            return True  # nothing measured and no record fetched yet: no budget
        if self.at is not None:
            rate = LINK_SHARE * bandwidth_bps / 8
            self.tokens = min(self.tokens + rate * (now - self.at), float(self.expected))
        self.at = now
        if self.tokens < self.expected:
            return False
        self.tokens -= self.expected
        return True

    def fetched(self, nbytes: int, reserved: bool, seconds: float) -> None:
        """A record of `nbytes` came in `seconds` (`reserved`: `take` set its expected bytes
        aside): its bytes are taken, and the next one is expected as large."""
        self.tokens += (self.expected if reserved else 0) - nbytes
        self.expected = nbytes
        if seconds > 0:
            self.fetched_bps = 8 * nbytes / seconds


@dataclass(slots=True)
class AuditCounts:
    """What a stage's audits did, for its metrics and the run summary."""

    audits: int = 0
    """Recomputations compared (passed or failed)."""
    failed: int = 0
    reported: int = 0
    """Neighbours reported to the coordinator (after two failures in a row)."""
    unanswered: int = 0
    """Records that did not come."""
    skipped: int = 0
    """Frames drawn but not audited (too many audits waiting, or the link's budget spent)."""
    record_bytes: int = 0
    """Bytes of the records fetched."""
    seconds: float = 0.0
    """Recomputation time (off the compute thread)."""
    max_distance_passed: float = 0.0
    """The largest distance of an audit that passed: how close honest nodes land."""


class Auditor:
    """Audits the activations from the upstream (`fetch_upstream`) and the gradients from the
    downstream (`fetch_downstream`; either None where there is no such neighbour). Call
    `consider` on the event loop for every training frame admitted."""

    def __init__(
        self,
        run: TrainConfig,
        model: BlockModel,
        *,
        fetch_upstream: Fetch | None,
        fetch_downstream: Fetch | None,
        report: Report,
    ) -> None:
        self._blocks = StageBlocks(model, run.seed, microbatches=run.microbatches,
                                   loss_scale=run.loss_scale)  # fmt: skip
        self._draws = {False: AuditDraw(run.audit_share), True: AuditDraw(run.audit_share)}
        self._fetch = {False: fetch_upstream, True: fetch_downstream}
        self._report = report
        self._in_a_row = {False: 0, True: 0}
        self._tasks: set[asyncio.Task[None]] = set()
        self._one = asyncio.Semaphore(1)  # one recomputation at a time
        self.counts = AuditCounts()
        self._budgets = {False: RecordBudget(0), True: RecordBudget(0)}
        self._bandwidth: Callable[[bool], float | None] = lambda backward: None
        self._clock = time.monotonic

    def budget(
        self,
        bandwidth_bps: Callable[[bool], float | None],
        first_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Budget the records' bytes (LINK_SHARE): `bandwidth_bps(backward)` measures the
        link to the downstream (backward) or the upstream, None while unmeasured;
        `first_bytes`: what the first record of each side is expected to take."""
        self._bandwidth = bandwidth_bps
        self._budgets = {False: RecordBudget(first_bytes), True: RecordBudget(first_bytes)}
        self._clock = clock

    def consider(self, backward: bool, seq: int, received: torch.Tensor, codec: str) -> None:
        """A training frame just admitted: microbatch `seq`'s activation from the upstream, or
        (`backward`) its input's gradient from the downstream, sent with `codec`."""
        if self._fetch[backward] is None or not auditable(codec):
            return
        if not self._draws[backward].draw():
            return
        # A check again after a failure always runs; others wait their turn and the budget.
        reserved = not self._draws[backward].again_drawn
        if reserved and (
            len(self._tasks) >= MAX_WAITING
            or not self._budgets[backward].take(self._bandwidth(backward), self._clock())
        ):
            self.counts.skipped += 1
            return
        task = asyncio.create_task(self._audit(backward, seq, received, reserved))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the audits in progress."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _audit(
        self, backward: bool, seq: int, received: torch.Tensor, reserved: bool
    ) -> None:
        fetch = self._fetch[backward]
        assert fetch is not None
        side = "downstream" if backward else "upstream"
        what = "input gradient" if backward else "activation"
        asked = self._clock()
        try:
            data = await fetch(backward, seq)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a fault of the link or the peer: counted, not held against it
            self.counts.unanswered += 1
            log.info("audit of the %s's %s of microbatch %d: no record (%s)", side, what, seq,
                     str(exc)[:200])  # fmt: skip
            return
        self.counts.record_bytes += len(data)
        self._budgets[backward].fetched(len(data), reserved, self._clock() - asked)
        async with self._one:
            started = time.perf_counter()
            try:
                d = await asyncio.to_thread(self._compare, data, backward, seq, received)
            except FrameError as exc:
                log.warning("audit of the %s's %s of microbatch %d: its record is unusable: %s",
                            side, what, seq, exc)  # fmt: skip
                d = float("inf")
            except (RuntimeError, TypeError, ValueError, IndexError):
                # Torch could not run it: an input of a shape the blocks do not take (the
                # sender's), or a bug here. Said loudly, counted, never held against anyone.
                log.exception("audit of the %s's %s of microbatch %d could not be recomputed",
                              side, what, seq)  # fmt: skip
                self.counts.unanswered += 1
                return
            self.counts.seconds += time.perf_counter() - started
        self.counts.audits += 1
        if d <= TOLERANCE:
            self._in_a_row[backward] = 0
            self.counts.max_distance_passed = max(self.counts.max_distance_passed, d)
            return
        self.counts.failed += 1
        self._in_a_row[backward] += 1
        log.warning("audit FAILED: the %s's %s of microbatch %d is %.3g from its recomputation "
                    "(tolerance %g; %d in a row)", side, what, seq, d, TOLERANCE,
                    self._in_a_row[backward])  # fmt: skip
        if self._in_a_row[backward] < 2:
            self._draws[backward].again()  # checked again on its next frame
            return
        self._in_a_row[backward] = 0
        try:
            await self._report(backward, data, received_bytes(received), d)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the coordinator unreachable: audits go on
            log.warning("could not report the %s to the coordinator: %s", side, str(exc)[:200])
            return
        self.counts.reported += 1

    def _compare(self, data: bytes, backward: bool, seq: int, received: torch.Tensor) -> float:
        """The distance between what came and its recomputation from the record `data`."""
        record = AuditRecord.from_bytes(data)
        if record.backward != backward or record.seq != seq:
            raise FrameError("the record is of another microbatch")
        return distance(received, self._blocks.recompute(record))
