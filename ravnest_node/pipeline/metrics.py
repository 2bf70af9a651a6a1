"""A stage's metrics: one record, `StageMetrics`, whose field list is the one place a metric is
declared.

Every field of the record travels and shows by its name alone:

- in the stage's reports to the coordinator: `pb.StageReport` has a field of the same name and
  kind (`to_report`, `from_report`; tests/test_metrics.py checks that every field has one);
- in the run summary, per stage (`summary`), and on the live page's stage table (the
  coordinator's `Swarm` view carries each stage's latest report; daemon/web.py);
- in `/metrics`, where a field declares its Prometheus series (`series(...)` in its metadata;
  fields without one are left out there).

So a new metric is one field here (with its docstring, and a series if Prometheus should have
it), the place the stage measures it, and its field in `pb.StageReport`. Values are plain
numbers, strings, tuples of counts (a histogram by index) or string-keyed counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ravnest_node.proto import control_pb2 as pb

__all__ = [
    "Series",
    "StageMetrics",
    "StepReport",
    "from_report",
    "samples_of",
    "series",
    "summary",
    "to_report",
]

SERIES = "series"
"""The metadata key of a field's Prometheus series."""


@dataclass(frozen=True, slots=True)
class Series:
    """How one field of the record shows in `/metrics`: the family it adds samples to (several
    fields may share one, told apart by `labels`), and for a histogram (a tuple) or per-key
    counts (a mapping) the label each index or key becomes."""

    name: str
    help: str
    kind: str = "counter"
    labels: tuple[tuple[str, str], ...] = ()
    by: str = ""


def series(name: str, help: str, kind: str = "counter", by: str = "", **labels: str) -> Any:
    """A field's metadata: its samples go to family `name` (see `Series`)."""
    return {SERIES: Series(name, help, kind, tuple(sorted(labels.items())), by)}


_SENT = "Bytes this stage sent, per role."
_IDLE = "Seconds waiting for a neighbour."


@dataclass(slots=True)
class StageMetrics:
    """What a stage measured about its own schedule and traffic since its run started, for
    reports, the summary, /metrics and the page. A record: one field per metric, no behaviour.
    The stage counts into one of its own (counters.py) and hands out copies."""

    wall_s: float = 0.0
    """Seconds since the stage's run started."""
    compute_s: float = 0.0
    """Seconds spent in torch work (forward, backward, optimizer, codecs)."""
    idle_upstream_s: float = field(
        default=0.0, metadata=series("ravnest_idle_seconds_total", _IDLE, neighbour="upstream")
    )
    """Seconds the compute loop had nothing to do but wait for the previous stage."""
    idle_downstream_s: float = field(
        default=0.0, metadata=series("ravnest_idle_seconds_total", _IDLE, neighbour="downstream")
    )
    """Seconds it waited for the next stage: for gradients, or for room in the outbox."""
    ahead_wait_s: float = 0.0
    """Of idle_downstream_s, the seconds a forward was held back only by the wait for the
    current update's gradients (stale_after_backwards)."""
    ahead_trial_from: int = 0
    """The step from which the stage tried the whole next step ahead without that wait,
    because the wait idled it (pipeline/ahead.py); 0: it did not."""
    whole_step_ahead_from: int = 0
    """The step from which it kept that, the trial's steps having been shorter; 0: it did not."""
    staleness_histogram: tuple[int, ...] = field(
        default=(),
        metadata=series(
            "ravnest_staleness_microbatches_total",
            "Microbatches that saw this many updates between forward and backward.",
            by="staleness",
        ),
    )
    """staleness_histogram[k]: microbatches that saw k updates between forward and backward."""
    max_in_flight: int = 0
    """Most microbatches this stage held between forward and backward at once."""
    max_weight_versions: int = 0
    """Most weight snapshots this stage kept at once."""
    activation_bytes_sent: int = field(
        default=0, metadata=series("ravnest_bytes_sent_total", _SENT, role="activation")
    )
    """Bytes of the activation frames sent downstream."""
    gradient_bytes_sent: int = field(
        default=0, metadata=series("ravnest_bytes_sent_total", _SENT, role="gradient")
    )
    """Bytes of the gradient frames sent upstream."""
    activation_fp32_bytes: int = 0
    """Bytes the activations sent would take as float32: against activation_bytes_sent, the
    codec's ratio."""
    gradient_fp32_bytes: int = 0
    """Bytes the gradients sent would take as float32."""
    averaging_rounds: int = field(
        default=0, metadata=series("ravnest_averaging_rounds_total", "Averaging rounds applied.")
    )
    """Averaging rounds applied."""
    averaging_rounds_incomplete: int = 0
    """Rounds in which some replica was missing, rejected or banned."""
    averaging_bytes_sent: int = field(
        default=0, metadata=series("ravnest_bytes_sent_total", _SENT, role="averaging")
    )
    """Bytes this stage pushed to its replicas."""
    averaging_wait_s: float = 0.0
    """Seconds the compute loop spent on averaging: taking deltas, applying results, and
    waiting for a round still in flight when the next was due or the run ended."""
    activation_codec: str = ""
    """Codec of the last activation frame sent downstream ("" on the last stage)."""
    gradient_codec: str = ""
    """Codec of the last gradient frame sent upstream ("" on the first stage)."""
    activation_codec_frames: Mapping[str, int] = field(default_factory=dict)
    """Activation frames sent, per codec."""
    gradient_codec_frames: Mapping[str, int] = field(default_factory=dict)
    """Gradient frames sent, per codec."""
    activation_deflated_frames: int = 0
    """Activation frames whose payload `auto` asked to pack with deflate."""
    gradient_deflated_frames: int = 0
    """Gradient frames whose payload `auto` asked to pack with deflate."""
    downstream_bandwidth_bps: float = 0.0
    """Bandwidth `auto` measured towards the next stage, bits/s (0: not measured)."""
    upstream_bandwidth_bps: float = 0.0
    """Bandwidth `auto` measured towards the previous stage, bits/s (0: not measured)."""
    frame_decode_s: float = field(
        default=0.0,
        metadata=series(
            "ravnest_frame_decode_seconds_total",
            "Seconds spent decoding the frames this stage admitted (off its compute thread).",
        ),
    )
    """Seconds spent decoding the payloads of the frames this stage admitted (in a worker
    thread, beside the compute thread: klt's rANS decoding is most of it)."""

    device: str = ""
    """The device the stage computes on, as `devices.describe` tells it."""
    precision: str = ""
    """The precision the stage computes in: fp32, bf16 or fp16 (its node's resolution of the
    run's --precision)."""
    steps_skipped: int = field(
        default=0,
        metadata=series(
            "ravnest_steps_skipped_total",
            "Optimizer steps skipped because a gradient was not finite (fp16 loss scaling).",
        ),
    )
    """Optimizer steps skipped because a gradient was not finite (the fixed fp16 loss scale
    overflowed); the weights did not change in them."""
    eval_step: int = 0
    """The last stage of pipeline 0 with `--eval-every`: the step its newest evaluation on
    held-out data followed (0: none yet)."""
    eval_loss: float = 0.0
    """That evaluation's mean loss (meaningful once eval_step > 0)."""
    evals_lost: int = field(
        default=0,
        metadata=series(
            "ravnest_evals_lost_total",
            "Evaluations missing a microbatch (a broken stream or a plan's end), not reported.",
        ),
    )
    """Evaluations this stage began that missed a microbatch (lost on a broken stream, which
    does not resend them, or cut off by a plan's end): counted, never reported."""
    stream_resumes: int = field(
        default=0,
        metadata=series(
            "ravnest_stream_resumes_total",
            "Boundary streams of this stage opened again after a network break.",
        ),
    )
    """Times this stage's boundary streams (either side) were opened again after breaking on
    the network, the plan holding (transport/resume.py)."""
    frames_resent: int = field(
        default=0,
        metadata=series(
            "ravnest_frames_resent_total",
            "Frames this stage wrote again on resumed boundary streams.",
        ),
    )
    """Frames written again on resumed streams: those the peer had not admitted when the stream
    broke. Their bytes count in the bytes sent too."""
    audits: int = field(
        default=0,
        metadata=series("ravnest_audits_total", "Neighbours' microbatches this stage audited."),
    )
    """Neighbours' microbatches recomputed and compared (auditor.py)."""
    audits_failed: int = field(
        default=0,
        metadata=series(
            "ravnest_audits_failed_total", "Audits whose recomputation was beyond the tolerance."
        ),
    )
    """Audits beyond the tolerance (each checked again on the next frame; two in a row are
    reported)."""
    audits_unanswered: int = 0
    """Audits whose record did not come (the sender slow or unreachable)."""
    audits_skipped: int = 0
    """Frames drawn for an audit but let go: too many audits waiting, or the records' share
    of the link spent (auditor.LINK_SHARE)."""
    audit_bytes: int = field(
        default=0,
        metadata=series("ravnest_audit_bytes_total", "Bytes of the audit records fetched."),
    )
    """Bytes of the neighbours' records this stage fetched (not in the links' bytes)."""
    audit_s: float = 0.0
    """Seconds of recomputation (off the compute thread)."""
    audit_max_passed: float = 0.0
    """The largest relative distance of an audit that passed: how close honest frames land."""

    @property
    def busy_fraction(self) -> float:
        """Share of the stage's time spent computing (NaN before any time passed)."""
        return self.compute_s / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def max_staleness_seen(self) -> int:
        """The largest staleness any microbatch saw."""
        return max((k for k, n in enumerate(self.staleness_histogram) if n), default=0)


@dataclass(frozen=True, slots=True)
class StepReport:
    """What a stage tells the coordinator after each optimizer step."""

    step: int
    loss: float
    done: bool
    metrics: StageMetrics
    params_sq_sum: float = math.nan
    num_params: int = 0


def to_report(metrics: StageMetrics) -> dict[str, Any]:
    """The record as keyword arguments of `pb.StageReport`."""
    return {f.name: getattr(metrics, f.name) for f in fields(StageMetrics)}


def from_report(report: pb.StageReport) -> StageMetrics:
    """The record a stage's report carries."""
    values: dict[str, Any] = {}
    for f in fields(StageMetrics):
        value = getattr(report, f.name)
        if isinstance(value, (str, int, float)):
            values[f.name] = value
        elif hasattr(value, "items"):  # a protobuf map
            values[f.name] = dict(value.items())
        else:  # a protobuf repeated field
            values[f.name] = tuple(value)
    return StageMetrics(**values)


def summary(metrics: StageMetrics) -> dict[str, Any]:
    """The record for JSON (the run summary, the page): every field by name, tuples as lists,
    plus `busy_fraction` and `max_staleness_seen`."""
    out: dict[str, Any] = {}
    for f in fields(StageMetrics):
        value = getattr(metrics, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else (
            dict(value) if isinstance(value, Mapping) else value
        )  # fmt: skip
    out["busy_fraction"] = metrics.busy_fraction
    out["max_staleness_seen"] = metrics.max_staleness_seen
    return out


def samples_of(metrics: StageMetrics) -> Iterator[tuple[Series, dict[str, str], float]]:
    """Every Prometheus sample the record's fields declare: (series, labels, value)."""
    for f in fields(StageMetrics):
        spec: Series | None = f.metadata.get(SERIES)
        if spec is None:
            continue
        value = getattr(metrics, f.name)
        labels = dict(spec.labels)
        if isinstance(value, tuple):
            for index, count in enumerate(value):
                yield spec, {**labels, spec.by: str(index)}, float(count)
        elif isinstance(value, Mapping):
            for key, count in sorted(value.items()):
                yield spec, {**labels, spec.by: str(key)}, float(count)
        else:
            yield spec, labels, float(value)
