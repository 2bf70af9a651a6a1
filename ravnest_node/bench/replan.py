"""`ravnest-node bench replan`: a node joins a running swarm; how soon it works, and what it adds.

Three node processes on loopback train; at a quarter of the run a fourth starts and joins. The
coordinator announces a plan with four stages, the pipeline drains at a step boundary, the new
stages fetch the blocks they gain, and training carries on (docs/discovery.md, "Re-planning").
Reported: seconds from the fourth node's start to the first step of the new plan, the steps
and bytes the switch cost, and samples/s before the join against after the switch, side by
side in one run.

This machine has 2 cores, which four processes of real compute would only share; so every node
is made slower per block by a sleep (`--fault-block-ms`, included in what it measures), as
machines whose compute is their own would be. The ratio is then what a fourth such machine adds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any, TextIO

from ravnest_node.bench.suite import Suite
from ravnest_node.launch.demo import Demo, DemoConfig
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.transport.options import TransportConfig

NODES = 3
BLOCK_MS = 15.0


def _rate(demo: Demo, first: int, last: int) -> float:
    """Samples/s between the progress events of steps `first` and `last` (wall clock of the
    coordinator)."""
    by_step = {e.step: e for e in demo.events if not e.done}
    a, b = by_step[first], by_step[last]
    return (b.samples - a.samples) / (b.wall_s - a.wall_s)


def replan_record(
    train: TrainConfig, work_dir: Path, log: TextIO, transport: TransportConfig | None = None
) -> dict[str, Any]:
    """One run with a late fourth node, and its figures."""
    join_at = max(8, train.steps // 4)
    cfg = DemoConfig(
        nodes=NODES,
        work_dir=work_dir,
        compute_threads=1,
        train=train,
        transport=transport or TransportConfig(),
    )
    demo = Demo(
        cfg, log, node_args=["--fault-block-ms", str(BLOCK_MS)], late_nodes=1, late_at_step=join_at
    )
    summary = asyncio.run(demo.run())
    if summary is None or len(summary["plans"]) < 2:
        raise RuntimeError(f"no second plan in {work_dir}: {summary and summary['plans']}")
    start = summary["plans"][1]["start_step"]
    assert demo.late_started_at is not None
    first_new = next(
        t for e, t in zip(demo.events, demo.event_times, strict=True) if e.step == start + 1
    )
    settle = min(5, (train.steps - start) // 4)
    warm = max(1, join_at // 4)
    return {
        "model": train.model,
        "steps": train.steps,
        "block_ms": BLOCK_MS,
        "joined_at_step": join_at,
        "new_plan_from_step": start,
        "seconds_to_share": first_new - demo.late_started_at,
        "nodes": [p["nodes"] for p in summary["plans"]],
        "stages": [
            [stage[3] - stage[2] for stage in p["stages"]] for p in summary["plans"]
        ],  # blocks per stage
        "samples_per_s_before": _rate(demo, warm, join_at),
        "samples_per_s_after": _rate(demo, start + settle, train.steps),
        "final_loss": summary["final_loss"],
        "initial_loss": summary["initial_loss"],
        "loss_at_switch": summary["loss_history"][start - 1],
        "loss_after_switch": summary["loss_history"][start],
    }


def run_replan_bench(suite: Suite) -> int:
    """The `bench replan` command (its swarms with `suite.transport`)."""
    train = dataclasses.replace(suite.train, model="tiny", steps=60 if suite.quick else 240)
    print(
        f"replan: {train.model}, {NODES} nodes then a 4th, {train.steps} steps, every node "
        f"{BLOCK_MS:g} ms slower per block and microbatch",
        file=suite.out,
        flush=True,
    )
    suite.work_dir.mkdir(parents=True, exist_ok=True)
    with open(suite.work_dir / "progress.log", "w") as log:
        r = replan_record(train, suite.work_dir, log, suite.transport)
    r["speedup"] = r["samples_per_s_after"] / r["samples_per_s_before"]
    text = "\n".join(
        [
            "| nodes | blocks per stage | samples/s |",
            "|---|---|---|",
            f"| {r['nodes'][0]} | {r['stages'][0]} | {r['samples_per_s_before']:.1f} |",
            f"| {r['nodes'][1]} | {r['stages'][1]} | {r['samples_per_s_after']:.1f} |",
            "",
            f"the 4th node started at step {r['joined_at_step']}; the plan with it began at "
            f"step {r['new_plan_from_step']}, {r['seconds_to_share']:.1f} s after its start; "
            f"samples/s x{r['speedup']:.2f}; loss {r['loss_at_switch']:.3f} before the switch, "
            f"{r['loss_after_switch']:.3f} after (final {r['final_loss']:.3f})",
        ]
    )
    print(text, file=suite.out, flush=True)
    suite.jsonl.parent.mkdir(parents=True, exist_ok=True)
    suite.jsonl.write_text(json.dumps(r) + "\n")
    suite.jsonl.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {suite.jsonl} and {suite.jsonl.with_suffix('.md')}", file=suite.out, flush=True)
    return 0
