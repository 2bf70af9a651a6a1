"""What a stage's loop counts while it trains, and the `StageMetrics` record made of it with
the compute thread's own counts (metrics.py declares every metric).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ravnest_node.pipeline.encoder import FrameEncoder
from ravnest_node.pipeline.metrics import StageMetrics
from ravnest_node.pipeline.schedule import StageSpec


@dataclass(slots=True)
class StageCounters:
    """The loop's counts (event loop only); `record` gives them as a `StageMetrics`, whose
    fields of the same name say what each one means."""

    staleness_histogram: list[int]
    started: float = field(default_factory=time.monotonic)
    """When the stage's run started (time.monotonic)."""
    idle_upstream_s: float = 0.0
    idle_downstream_s: float = 0.0
    max_in_flight: int = 0
    max_weight_versions: int = 0
    activation_bytes_sent: int = 0
    gradient_bytes_sent: int = 0
    averaging_rounds: int = 0
    averaging_rounds_incomplete: int = 0
    averaging_bytes_sent: int = 0
    averaging_wait_s: float = 0.0

    def idle(self, seconds: float, *, upstream: bool) -> None:
        """The loop waited `seconds` for its previous stage (`upstream`) or its next one."""
        if upstream:
            self.idle_upstream_s += seconds
        else:
            self.idle_downstream_s += seconds

    def record(self, spec: StageSpec, compute_s: float, encoder: FrameEncoder) -> StageMetrics:
        """The stage's metrics now: these counts, its `compute_s` and its frames' codecs."""
        activation, gradient = encoder.activation, encoder.gradient
        return StageMetrics(
            wall_s=time.monotonic() - self.started,
            compute_s=compute_s,
            idle_upstream_s=self.idle_upstream_s,
            idle_downstream_s=self.idle_downstream_s,
            staleness_histogram=tuple(self.staleness_histogram),
            max_in_flight=self.max_in_flight,
            max_weight_versions=self.max_weight_versions,
            activation_bytes_sent=self.activation_bytes_sent,
            gradient_bytes_sent=self.gradient_bytes_sent,
            activation_fp32_bytes=encoder.activation_fp32_bytes,
            gradient_fp32_bytes=encoder.gradient_fp32_bytes,
            averaging_rounds=self.averaging_rounds,
            averaging_rounds_incomplete=self.averaging_rounds_incomplete,
            averaging_bytes_sent=self.averaging_bytes_sent,
            averaging_wait_s=self.averaging_wait_s,
            activation_codec=activation.name if not spec.is_last else "",
            gradient_codec=gradient.name if not spec.is_first else "",
            activation_codec_frames=activation.frames,
            gradient_codec_frames=gradient.frames,
            activation_deflated_frames=activation.deflated,
            gradient_deflated_frames=gradient.deflated,
            downstream_bandwidth_bps=activation.bandwidth_bps or 0.0,
            upstream_bandwidth_bps=gradient.bandwidth_bps or 0.0,
        )
