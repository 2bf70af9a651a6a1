"""What a stage has received and not worked on yet: frames admitted against the plan and the
schedule (schedule.py), decoded, and queued for the compute loop, and the receiver state their
codecs need (aq-delta's per-sample references, klt's bases).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ravnest_node.compression import ACTIVATION_ONLY, SampleReferences
from ravnest_node.compression.transform import KLTBases
from ravnest_node.pipeline.metrics import StageMetrics
from ravnest_node.pipeline.schedule import GRAD, HIDDEN, Schedule
from ravnest_node.transport.frames import Frame, FrameKind


@dataclass(frozen=True, slots=True)
class Received:
    """An admitted frame, decoded: what the compute loop works on."""

    kind: FrameKind
    seq: int
    version: int
    tensors: dict[str, torch.Tensor]
    samples: tuple[int, ...] = ()


class Inbox:
    """The admitted frames of both directions, in arrival order, and `wake`, the event the
    compute loop waits on when it has nothing to do. Used on the event loop only."""

    def __init__(self, schedule: Schedule, counts: StageMetrics | None = None) -> None:
        self._schedule = schedule
        self._counts = StageMetrics() if counts is None else counts
        """The stage's metrics record (counters.py) that what the inbox measures goes to."""
        spec, run = schedule.spec, schedule.run
        # Receiver state per incoming stream: klt's basis (kept whatever the run's codecs, as
        # a sender may pick klt by itself), and for aq-delta the reference of every sample.
        self._references: dict[str, SampleReferences | KLTBases] = {}
        if not spec.is_first:
            self._references[HIDDEN] = (
                SampleReferences(limit=run.dataset_samples)
                if run.activation in ACTIVATION_ONLY
                else KLTBases()
            )
        if not spec.is_last:
            self._references[GRAD] = KLTBases()
        # The schedule bounds each queue by the window: a peer that sends more is refused.
        self.forwards: deque[Received] = deque()
        self.backwards: deque[Received] = deque()
        self.evals: deque[Received] = deque()
        """Evaluation frames (pipeline 0's later stages): forwards without gradients."""
        self.wake = asyncio.Event()
        """Set whenever there may be new work or room."""
        self.accepted = 0
        """Frames admitted."""
        self.on_admitted: Callable[[Frame, dict[str, torch.Tensor]], None] | None = None
        """Called with each training frame admitted and its decoded tensors (the stage's
        audits)."""

    @property
    def references(self) -> Mapping[str, SampleReferences | KLTBases]:
        """The receiver state of each incoming stream, by tensor name."""
        return self._references

    @property
    def queued(self) -> int:
        """Admitted frames waiting for the compute loop."""
        return len(self.forwards) + len(self.backwards) + len(self.evals)

    def _queue(self, kind: FrameKind) -> deque[Received]:
        if kind is FrameKind.EVAL:
            return self.evals
        return self.forwards if kind is FrameKind.FORWARD else self.backwards

    async def check(self, frame: Frame) -> None:
        """FrameError where `admit` would refuse the frame now, its payload decoded; nothing is
        admitted, and the receiver state does not change (a test's fuzzer, stage.py)."""
        self._schedule.check_frame(frame)
        self._schedule.check_room(len(self._queue(frame.kind)), frame.kind)
        await asyncio.to_thread(
            frame.decode_with, {} if frame.kind is FrameKind.EVAL else self._references
        )

    async def admit(self, frame: Frame) -> None:
        """Check a received frame against the plan and the schedule, decode it, and queue it;
        FrameError (and no change) if it does not fit or its payload does not decode. The
        checks and the bookkeeping run on the event loop, so they never race the compute loop;
        frames of one stream are admitted one at a time, in order."""
        self._schedule.check_frame(frame)
        queue = self._queue(frame.kind)
        self._schedule.check_room(len(queue), frame.kind)
        # Decoding validates the payload's content (codes, scales, indices, lz4); do it before
        # anything changes, off the event loop and off the compute thread.
        started = time.perf_counter()
        # (An evaluation's frame is outside its stream's sequence: it neither reads nor moves
        # the receiver state that mirrors the sender's.)
        references = {} if frame.kind is FrameKind.EVAL else self._references
        tensors, commit = await asyncio.to_thread(frame.decode_with, references)
        decode_s = time.perf_counter() - started
        self._schedule.check_room(len(queue), frame.kind)
        # No await from the check above to here: the frame's effect on receiver state
        # (aq-delta references) is applied only now that it is admitted.
        commit()
        self._counts.frame_decode_s += decode_s
        queue.append(Received(frame.kind, frame.seq, frame.version, tensors, frame.samples))
        self._schedule.admitted(frame.kind, frame.seq, frame.version)
        if self.on_admitted is not None and frame.kind is not FrameKind.EVAL:
            self.on_admitted(frame, tensors)
        self.accepted += 1
        self.wake.set()
