"""`ravnest-node bench replicas`: two pipelines that average against one pipeline.

Runs, on loopback node processes, three ways to train on the same total samples:
- **one pipeline** of 3 stages for 2T steps of the batch;
- **one pipeline, double batch**: T steps of twice the batch (what perfectly synchronous data
  parallelism over two pipelines would compute);
- **two pipelines** of 3 stages for T steps each, every stage averaging with its replica every
  `average_every` steps (DiLoCo, docs/averaging.md);

and reports the loss of the two pipelines against both references, the averaging traffic per
sample against what averaging every step in fp32 would send and against hivemind-style
data-parallel averaging (estimated from its documented scheme: an all-reduce of fp16 gradients
every step), samples/s per pipeline, and the share of each stage's time spent on averaging.

This machine has 2 cores: two pipelines share them, so they add no compute here; the figures
that matter are loss, bytes and the waiting share.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ravnest_node.bench.suite import Suite
from ravnest_node.launch.demo import DemoConfig, train_quietly
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.transport.options import TransportConfig

Record = dict[str, Any]
STAGES = 3


def _run(
    train: TrainConfig, pipelines: int, work_dir: Path, transport: TransportConfig | None
) -> dict[str, Any]:
    cfg = DemoConfig(
        nodes=STAGES * pipelines,
        work_dir=work_dir,
        compute_threads=1,
        train=dataclasses.replace(train, pipelines=pipelines),
        transport=transport or TransportConfig(),
    )
    summary = train_quietly(cfg)
    if summary is None:
        raise RuntimeError(f"the run in {work_dir} was stopped")
    return summary


def fp32_every_step_bytes(params_per_stage: list[int], replicas: int) -> float:
    """Bytes one training step would move if every replica sent its whole fp32 stage to every
    other replica of its group (the naive way to keep replicas equal)."""
    return sum(replicas * (replicas - 1) * 4 * p for p in params_per_stage)


def hivemind_step_bytes(num_params: int, peers: int) -> float:
    """Bytes one step of hivemind-style data parallelism moves: each of `peers` full-model
    peers all-reduces fp16 gradients with a butterfly all-reduce, sending 2 (n-1)/n of the
    model per round (hivemind's averager; its examples use Float16Compression)."""
    return peers * 2 * (peers - 1) / peers * 2 * num_params


def replicas_table(
    train: TrainConfig, work_dir: Path, transport: TransportConfig | None = None
) -> list[Record]:
    """The three runs and the derived figures, one record each."""
    longer = dataclasses.replace(train, steps=2 * train.steps)
    one = _run(longer, 1, work_dir / "one-pipeline", transport)
    double = _run(
        dataclasses.replace(
            train, batch_size=2 * train.batch_size, microbatches=2 * train.microbatches
        ),
        1,
        work_dir / "one-pipeline-double-batch",
        transport,
    )
    two = _run(train, 2, work_dir / "two-pipelines", transport)
    model = get_model(train.model)
    params = [
        sum(p.numel() for b in model.build_stage(train.seed, a, z) for p in b.parameters())
        for a, z in (tuple(s["blocks"]) for s in one["stages"])
    ]
    samples = two["samples"]
    averaging = sum(s["averaging_bytes_sent"] for s in two["stages"])
    fp32 = fp32_every_step_bytes(params, 2) * train.steps
    hivemind = hivemind_step_bytes(sum(params), 2) * train.steps
    wait_share = max(s["averaging_wait_s"] / s["wall_s"] for s in two["stages"])
    rows = []
    runs = (("one pipeline", one), ("one pipeline, double batch", double), ("two pipelines", two))
    for name, s in runs:
        rows.append(
            {
                "run": name,
                "pipelines": s["pipelines"],
                "steps": s["steps"],
                "samples": s["samples"],
                "wall_s": s["wall_s"],
                "samples_per_s": s["samples_per_s"],
                "samples_per_s_per_pipeline": s["samples_per_s"] / s["pipelines"],
                "final_loss": s["final_loss"],
                "mean_loss_last_5": sum(s["loss_history"][-5:]) / 5,
                "bytes_per_sample": s["bytes_per_sample"],
                "averaging_rounds": min(st["averaging_rounds"] for st in s["stages"]),
                "averaging_rounds_incomplete": sum(
                    st["averaging_rounds_incomplete"] for st in s["stages"]
                ),
            }
        )
    rows[2] |= {
        "loss_gap_vs_one_pipeline": rows[2]["mean_loss_last_5"] / rows[0]["mean_loss_last_5"] - 1,
        "loss_gap_vs_double_batch": rows[2]["mean_loss_last_5"] / rows[1]["mean_loss_last_5"] - 1,
        "averaging_bytes_per_sample": averaging / samples,
        "fp32_every_step_bytes_per_sample": fp32 / samples,
        "hivemind_bytes_per_sample": hivemind / samples,
        "fewer_than_fp32_every_step": fp32 / averaging if averaging else float("inf"),
        "fewer_than_hivemind": hivemind / averaging if averaging else float("inf"),
        "averaging_wait_share": wait_share,
        "average_every": train.average_every,
        "average_codec": train.average_codec,
    }
    return rows


def run_replicas_bench(suite: Suite) -> int:
    """The `bench replicas` command (its swarms with `suite.transport`)."""
    train = suite.train
    if suite.quick:
        train = dataclasses.replace(train, steps=8, average_every=4)
    print(
        f"replicas: {train.model}, 1 pipeline x {2 * train.steps} steps vs 2 pipelines x "
        f"{train.steps} steps, averaging every {train.average_every} steps "
        f"({train.average_codec})",
        file=suite.out,
        flush=True,
    )
    rows = replicas_table(train, suite.work_dir, suite.transport)
    two = rows[2]
    lines = [
        "| run | samples | samples/s | per pipeline | mean loss, last 5 steps | bytes/sample |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['run']} | {r['samples']} | {r['samples_per_s']:.2f} | "
            f"{r['samples_per_s_per_pipeline']:.2f} | {r['mean_loss_last_5']:.4f} | "
            f"{r['bytes_per_sample']:,.0f} |"
            for r in rows
        ),
        "",
        f"loss gap, two pipelines vs one pipeline: {two['loss_gap_vs_one_pipeline']:+.2%} "
        f"(same samples in twice the steps), vs one pipeline with double batch: "
        f"{two['loss_gap_vs_double_batch']:+.2%} (same samples and steps)",
        f"averaging: {two['averaging_rounds']} rounds "
        f"({two['averaging_rounds_incomplete']} incomplete), "
        f"{two['averaging_bytes_per_sample']:,.0f} bytes/sample; fp32 every step would send "
        f"{two['fp32_every_step_bytes_per_sample']:,.0f} "
        f"({two['fewer_than_fp32_every_step']:.0f}x more), hivemind-style fp16 data "
        f"parallelism {two['hivemind_bytes_per_sample']:,.0f} "
        f"({two['fewer_than_hivemind']:.0f}x more)",
        f"largest share of a stage's time spent on averaging: {two['averaging_wait_share']:.2%}",
    ]
    text = "\n".join(lines) + "\n"
    print(text, file=suite.out, flush=True)
    suite.jsonl.parent.mkdir(parents=True, exist_ok=True)
    with open(suite.jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    suite.jsonl.with_suffix(".md").write_text(text)
    print(f"wrote {suite.jsonl} and {suite.jsonl.with_suffix('.md')}", file=suite.out, flush=True)
    return 0
