"""The run summary the coordinator writes at the end (summary.json, and the last progress
event): every figure comes from what the stages reported. Pure functions."""

from __future__ import annotations

import math
from typing import Any

from ravnest_node.coordination.coordinator.faults import FaultBook
from ravnest_node.coordination.coordinator.progress import RunProgress
from ravnest_node.pipeline.metrics import from_report
from ravnest_node.pipeline.metrics import summary as metrics_summary
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb

__all__ = ["plan_entry", "run_summary", "stage_schedule"]


def stage_schedule(report: pb.StageReport) -> dict[str, Any]:
    """The traffic and schedule figures of a stage's final report, for the run summary: every
    metric of the stage (pipeline/metrics.py) and its parameters' sum of squares."""
    return {"params_sq_sum": report.params_sq_sum, **metrics_summary(from_report(report))}


def plan_entry(plan: pb.Plan) -> dict[str, Any]:
    """A plan as the summary lists it: epoch, start step, nodes and stages."""
    return {
        "epoch": plan.epoch,
        "start_step": plan.start_step,
        "nodes": len({s.node_id for s in plan.stages}),
        "stages": [
            [s.pipeline, s.index, s.first_block, s.stop_block, s.node_id] for s in plan.stages
        ],
    }


def run_summary(
    *,
    train: TrainConfig,
    fingerprint: str,
    plan: pb.Plan,
    plans: list[pb.Plan],
    progress: RunProgress,
    faults: FaultBook,
    wall_s: float,
) -> dict[str, Any]:
    """The summary of `train`'s run, ending under `plan` after `wall_s` seconds; `plans`:
    every plan that started, in order."""
    return {
        **_figures(train, plan, progress, wall_s),
        **_settings(train, fingerprint),
        **_history(plans, progress, faults),
        "stages": _stages(plan, progress),
    }


def _figures(t: TrainConfig, plan: pb.Plan, progress: RunProgress, wall_s: float) -> dict[str, Any]:
    """What the run did: samples, time, losses, bytes, parameters."""
    trained = range(progress.resumed_at + 1, t.steps + 1)  # the steps this run trained
    samples = len(trained) * t.batch_size * t.pipelines
    losses = [progress.losses.get(step, math.nan) for step in trained]
    finals = progress.finals
    first_pipeline = [r for (p, _), r in finals.items() if p == 0]
    bytes_on_wire = sum(progress.bytes_sent.values())
    activation_bytes = sum(r.activation_bytes_sent for r in finals.values())
    gradient_bytes = sum(r.gradient_bytes_sent for r in finals.values())
    return {
        "system": "ravnest-node",
        "model": t.model,
        "nodes": len(plan.stages),
        "steps": t.steps,
        "batch_size": t.batch_size,
        "microbatches": t.microbatches,
        "samples": samples,
        "wall_s": wall_s,
        "samples_per_s": samples / wall_s if wall_s > 0 else math.nan,
        # Resumed from checkpoints at this step: loss_history starts at the step after it.
        "resumed_at": progress.resumed_at,
        "initial_loss": losses[0],
        "final_loss": losses[-1],
        "loss_history": losses,
        "bytes_on_wire": bytes_on_wire,
        "bytes_per_sample": bytes_on_wire / samples,
        "activation_bytes_per_sample": activation_bytes / samples,
        "gradient_bytes_per_sample": gradient_bytes / samples,
        "dataset_samples": t.dataset_samples,
        "epochs": samples / t.dataset_samples if t.dataset_samples else math.nan,
        # Of pipeline 0: replicas agree up to their last averaging round.
        "final_params_l2": math.sqrt(sum(r.params_sq_sum for r in first_pipeline)),
        "num_params": sum(r.num_params for r in first_pipeline),
        "pipelines": t.pipelines,
        "loss_history_per_pipeline": [
            [progress.pipeline_losses.get(p, {}).get(s, math.nan) for s in trained]
            for p in range(t.pipelines)
        ],
        # Evaluations on held-out data (--eval-every): [step, mean loss] each, in order, and
        # the last one's loss (NaN without); evaluations lost on the way are per stage.
        "eval_every": t.eval_every,
        "eval_history": [[step, loss] for step, loss in sorted(progress.evals.items())],
        "final_eval_loss": progress.evals.get(t.steps, math.nan),
    }


def _settings(t: TrainConfig, fingerprint: str) -> dict[str, Any]:
    """The run's settings that shape its figures."""
    return {
        "average_every": t.average_every,
        "average_codec": t.average_codec,
        "codec": t.activation,
        "gradient_codec": t.gradient,
        "lz4": t.lz4,
        "max_staleness": t.max_staleness,
        "stale_microbatches": t.stale_microbatches,
        "stale_after_backwards": t.stale_after_backwards,
        "ahead_wait_share": t.ahead_wait_share,
        "weight_prediction": t.weight_prediction,
        "seed": t.seed,
        "lr": t.lr,
        "data_fingerprint": fingerprint,
        "schedule": t.schedule,
    }


def _history(plans: list[pb.Plan], progress: RunProgress, faults: FaultBook) -> dict[str, Any]:
    """What happened to the run: its plans, faults, takeover and checkpoints."""
    takeover = faults.takeover
    return {
        # Every plan of the run, in order: epoch, start step, nodes and stages
        # ([pipeline, stage, first block, stop block, node id]); the last is `stages`.
        "plans": [plan_entry(p) for p in plans],
        # Members lost mid-run, and the microbatches their pipelines never trained.
        "crashes": [c.to_dict() for c in faults.crashes],
        "dropped_microbatches": faults.dropped,
        # Restores from checkpoints (a lost member had no replica), and the microbatches
        # of the steps rolled back and trained again.
        "restores": [r.to_dict() for r in faults.restores],
        "redone_microbatches": faults.redone,
        # Members banned for failing audits (coordinator/bans.py), with the evidence.
        "banned": [b.to_dict() for b in faults.banned.values()],
        # This coordinator won a failover election and took the run over: the term, the
        # plan it took over and the coordinator lost (progress before it is not known
        # here: loss_history starts at `resumed_at`, the step the run was restored at).
        "takeover": None if takeover is None else takeover.to_dict(),
        # The newest checkpoint each stage's owner reported writing.
        "checkpoints": [
            {"pipeline": p, "stage": i, "node_id": node, "step": step}
            for (p, i), (node, step) in sorted(progress.checkpoints.items())
        ],
    }


def _stages(plan: pb.Plan, progress: RunProgress) -> list[dict[str, Any]]:
    """Each stage of the last plan: where it ran, and its final report's figures (or that it
    was lost)."""
    return [
        {
            "pipeline": s.pipeline,
            "index": s.index,
            "blocks": [s.first_block, s.stop_block],
            "node_id": s.node_id,
            "address": s.address,
            "relayed": s.relayed,
            "bytes_sent": progress.bytes_sent.get(s.node_id, 0),
            **(
                stage_schedule(progress.finals[(s.pipeline, s.index)])
                if (s.pipeline, s.index) in progress.finals
                else {"lost": True}
            ),
        }
        for s in plan.stages
    ]
