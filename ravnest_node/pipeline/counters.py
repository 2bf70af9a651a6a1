"""What a stage's loop counts while it trains: a `StageMetrics` record (metrics.py declares
every metric) that the loop counts into, and the copies of it the stage hands out, completed
with what the compute thread and the frame encoder counted.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from ravnest_node.pipeline.encoder import FrameEncoder
from ravnest_node.pipeline.metrics import StageMetrics
from ravnest_node.pipeline.schedule import StageSpec


class ComputeFigures(Protocol):
    """What the compute thread counts that a stage's metrics carry (StageCompute)."""

    @property
    def compute_s(self) -> float: ...
    @property
    def encoder(self) -> FrameEncoder: ...
    @property
    def device_name(self) -> str: ...
    @property
    def precision(self) -> str: ...
    @property
    def steps_skipped(self) -> int: ...


class StageCounters:
    """The loop's counts (event loop only). `counts` is the stage's own metrics record, counted
    into field by field (a new count is a new field of the record, nothing here); `record` gives
    a copy of it, with the figures counted elsewhere filled in."""

    __slots__ = ("counts", "staleness", "started")

    def __init__(self, max_staleness: int) -> None:
        self.counts = StageMetrics()
        self.staleness = [0] * (max_staleness + 1)
        """staleness[k]: microbatches that saw k updates between forward and backward."""
        self.started = time.monotonic()
        """When the stage's run started (time.monotonic)."""

    def idle(self, seconds: float, *, upstream: bool) -> None:
        """The loop waited `seconds` for its previous stage (`upstream`) or its next one."""
        if upstream:
            self.counts.idle_upstream_s += seconds
        else:
            self.counts.idle_downstream_s += seconds

    def record(self, spec: StageSpec, compute: ComputeFigures) -> StageMetrics:
        """The stage's metrics now: these counts, and what its compute counted (its time, its
        device, its frames' codecs)."""
        encoder = compute.encoder
        activation, gradient = encoder.activation, encoder.gradient
        return dataclasses.replace(
            self.counts,
            wall_s=time.monotonic() - self.started,
            compute_s=compute.compute_s,
            device=compute.device_name,
            precision=compute.precision,
            steps_skipped=compute.steps_skipped,
            staleness_histogram=tuple(self.staleness),
            activation_fp32_bytes=encoder.activation_fp32_bytes,
            gradient_fp32_bytes=encoder.gradient_fp32_bytes,
            activation_codec=activation.name if not spec.is_last else "",
            gradient_codec=gradient.name if not spec.is_first else "",
            activation_codec_frames=dict(activation.frames),
            gradient_codec_frames=dict(gradient.frames),
            activation_deflated_frames=activation.deflated,
            gradient_deflated_frames=gradient.deflated,
            downstream_bandwidth_bps=activation.bandwidth_bps or 0.0,
            upstream_bandwidth_bps=gradient.bandwidth_bps or 0.0,
        )
