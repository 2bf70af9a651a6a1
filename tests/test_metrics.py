"""A stage's metrics record (pipeline/metrics.py): one field list feeds the report to the
coordinator, the run summary, /metrics and the page. Pure."""

from __future__ import annotations

import dataclasses
import math

from ravnest_node.daemon.web import stage_families
from ravnest_node.pipeline.metrics import (
    StageMetrics,
    from_report,
    samples_of,
    summary,
    to_report,
)
from ravnest_node.pipeline.stage import StageSpec
from ravnest_node.proto import control_pb2 as pb

SAMPLE = StageMetrics(
    wall_s=10.0,
    compute_s=4.0,
    idle_upstream_s=1.5,
    idle_downstream_s=2.5,
    ahead_wait_s=0.5,
    ahead_trial_from=25,
    whole_step_ahead_from=31,
    staleness_histogram=(30, 10, 0),
    max_in_flight=8,
    max_weight_versions=2,
    activation_bytes_sent=1000,
    gradient_bytes_sent=900,
    activation_fp32_bytes=4000,
    gradient_fp32_bytes=3600,
    averaging_rounds=3,
    averaging_rounds_incomplete=1,
    averaging_bytes_sent=500,
    averaging_wait_s=0.25,
    activation_codec="int8-block",
    gradient_codec="fp16",
    activation_codec_frames={"int8-block": 30, "none": 10},
    gradient_codec_frames={"fp16": 40},
    activation_deflated_frames=2,
    gradient_deflated_frames=1,
    downstream_bandwidth_bps=5e7,
    upstream_bandwidth_bps=4e7,
    frame_decode_s=0.75,
    device="cuda:0 (NVIDIA H100, 79.1 GiB)",
    precision="bf16",
    steps_skipped=2,
    eval_step=20,
    eval_loss=2.25,
    evals_lost=1,
    stream_resumes=3,
    frames_resent=11,
    audits=12,
    audits_failed=1,
    audits_unanswered=2,
    audits_skipped=5,
    audit_bytes=3_000_000,
    audit_s=0.75,
    audit_max_passed=0.16,
)


def test_every_field_is_set_in_the_sample() -> None:
    """(So that the round trips below exercise every field, not its default.)"""
    defaults = StageMetrics()
    unset = [f.name for f in dataclasses.fields(StageMetrics)
             if getattr(SAMPLE, f.name) == getattr(defaults, f.name)]  # fmt: skip
    assert not unset


def test_every_field_has_its_field_in_the_report() -> None:
    proto = pb.StageReport.DESCRIPTOR.fields_by_name
    for f in dataclasses.fields(StageMetrics):
        assert f.name in proto, f"pb.StageReport has no field {f.name}"
        p = proto[f.name]
        if f.type.startswith("tuple"):
            assert p.is_repeated and p.message_type is None, f.name
        elif f.type.startswith("Mapping"):
            assert p.message_type is not None and p.message_type.GetOptions().map_entry, f.name
        else:
            assert not p.is_repeated and p.message_type is None, f.name


def test_the_record_travels_whole_in_a_report() -> None:
    report = pb.StageReport(node_id="n", step=7, **to_report(SAMPLE))
    again = pb.StageReport.FromString(report.SerializeToString())
    assert from_report(again) == SAMPLE
    assert from_report(pb.StageReport()) == StageMetrics()


def test_the_summary_has_every_field_and_the_derived_figures() -> None:
    out = summary(SAMPLE)
    assert set(out) == {f.name for f in dataclasses.fields(StageMetrics)} | {
        "busy_fraction", "max_staleness_seen"
    }  # fmt: skip
    assert out["staleness_histogram"] == [30, 10, 0]
    assert out["activation_codec_frames"] == {"int8-block": 30, "none": 10}
    assert out["busy_fraction"] == 0.4 and out["max_staleness_seen"] == 1
    assert math.isnan(summary(StageMetrics())["busy_fraction"])


def test_declared_series_reach_prometheus_with_their_labels() -> None:
    samples = {(s.name, tuple(sorted(labels.items()))): v for s, labels, v in samples_of(SAMPLE)}
    assert samples[("ravnest_bytes_sent_total", (("role", "activation"),))] == 1000
    assert samples[("ravnest_bytes_sent_total", (("role", "averaging"),))] == 500
    assert samples[("ravnest_idle_seconds_total", (("neighbour", "downstream"),))] == 2.5
    assert samples[("ravnest_staleness_microbatches_total", (("staleness", "1"),))] == 10
    assert samples[("ravnest_averaging_rounds_total", ())] == 3
    # Fields without a series are not in /metrics.
    assert not [name for name, _ in samples if "codec" in name]
    spec = StageSpec(index=1, num_stages=3, first_block=2, stop_block=4)
    families = {f.name: f for f in stage_families(spec, SAMPLE, step=5, samples=80, loss=1.0)}
    sent = families["ravnest_bytes_sent_total"]
    assert sorted(labels["role"] for labels, _ in sent.samples) == [
        "activation", "averaging", "gradient"
    ]  # fmt: skip
    assert all(labels["stage"] == "1" for labels, _ in sent.samples)
    assert families["ravnest_codec_ratio"].samples[0] == ({"role": "activation", "stage": "1"}, 4.0)
    assert "ravnest_loss" not in families  # not the last stage
