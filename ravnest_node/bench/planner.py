"""`ravnest-node bench planner`: how fast the planner solves and how much its placements gain.

For a few swarms (a home trio of unequal GPUs on a 50 Mbit/s uplink, a 16-node lab with 80
blocks, the same lab as two pipelines) it prints the solve time, the plan (stages, spares,
seconds per microbatch and what bounds them) and the step of the foundation's static plan on the
same nodes (blocks balanced by cost, one node per stage in join order, speed ignored). Then, on
random 6-node instances, the local search's step against the exhaustive optimum.

Pure computation on one core; nothing is trained.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ravnest_node.coordination.planning.negotiate import model_blocks
from ravnest_node.coordination.planning.placement import (
    Block,
    Link,
    Links,
    NodeCaps,
    plan_swarm,
    step_of,
)
from ravnest_node.coordination.planning.planner import partition
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig

Record = dict[str, Any]


def static_step(
    blocks: Sequence[Block], nodes: Sequence[NodeCaps], links: Links, pipelines: int
) -> float:
    """The foundation's placement: cost-balanced cut, nodes in join order, every node used."""
    stages = len(nodes) // pipelines
    cuts = partition([b.compute_s for b in blocks], stages)
    owners = [[nodes[p * stages + s].node_id for p in range(pipelines)] for s in range(stages)]
    return step_of(blocks, nodes, links, cuts, owners)


def _lab(rng: random.Random) -> tuple[list[Block], list[NodeCaps]]:
    blocks = [
        Block(rng.uniform(0.5, 2.0) / 40, rng.randint(10**5, 10**6), 10**8) for _ in range(80)
    ]
    nodes = [NodeCaps(f"n{i:02d}", rng.choice([0.5, 1.0, 2.0]), 2 * 10**9) for i in range(16)]
    return blocks, nodes


def swarm_rows() -> list[Record]:
    rng = random.Random(0)
    run = TrainConfig(model="bench-small").to_proto("")  # microbatches of 4 samples
    home = model_blocks(get_model("bench-small"), run, total_s=0.12)
    trio = [NodeCaps("pc-3090"), NodeCaps("pc-4090", speed=1.8), NodeCaps("laptop", speed=0.3)]
    lab_blocks, lab_nodes = _lab(rng)
    cases = [
        ("home trio, 50 Mbit/s", home, trio, Links(default=Link(5e7, 0.02)), 1),
        ("home trio, 50 Mbit/s, int8", home, trio, Links(Link(5e7, 0.02), codec_ratio=0.27), 1),
        ("lab 16 nodes x 80 blocks, 1 Gbit/s", lab_blocks, lab_nodes, Links(Link(1e9, 1e-3)), 1),
        ("same lab, 2 pipelines", lab_blocks, lab_nodes, Links(Link(1e9, 1e-3)), 2),
    ]
    rows = []
    for name, blocks, nodes, links, pipelines in cases:
        start = time.perf_counter()
        plan = plan_swarm(blocks, nodes, links, pipelines=pipelines)
        solve_s = time.perf_counter() - start
        static = static_step(blocks, nodes, links, pipelines)
        rows.append(
            {
                "swarm": name,
                "nodes": len(nodes),
                "blocks": len(blocks),
                "pipelines": pipelines,
                "solve_s": solve_s,
                "exact": plan.exact,
                "stages": [[s.first_block, s.stop_block, list(s.owners)] for s in plan.stages],
                "spare": list(plan.spare),
                "step_s": plan.step_s,
                "bottleneck": plan.bottleneck,
                "static_step_s": static,
                "speedup_vs_static": static / plan.step_s,
            }
        )
    return rows


def search_row(instances: int) -> Record:
    """The local search against the exhaustive optimum on random 6-node, 12-block swarms."""
    rng = random.Random(1)
    ratios, solve = [], []
    for _ in range(instances):
        blocks = [
            Block(rng.uniform(0.2, 2.0), rng.choice([10**4, 10**6, 10**7]), rng.randint(1, 4))
            for _ in range(12)
        ]
        ids = [f"n{i}" for i in range(6)]
        nodes = [NodeCaps(v, rng.choice([0.5, 1.0, 2.0]), rng.choice([8, 16, 64])) for v in ids]
        pairs = {(a, b): Link(rng.choice([1e7, 1e8, 1e9])) for a in ids for b in ids if a != b}
        links = Links(default=Link(1e9), pairs=pairs)
        exact = plan_swarm(blocks, nodes, links, exact_limit=10**6)
        start = time.perf_counter()
        local = plan_swarm(blocks, nodes, links, exact_limit=0)
        solve.append(time.perf_counter() - start)
        ratios.append(local.step_s / exact.step_s)
    return {
        "instances": instances,
        "mean_ratio": sum(ratios) / len(ratios),
        "worst_ratio": max(ratios),
        "optimal_share": sum(r <= 1 + 1e-9 for r in ratios) / len(ratios),
        "mean_solve_s": sum(solve) / len(solve),
    }


def run_planner_bench(jsonl: Path, quick: bool, out: TextIO = sys.stdout) -> int:
    """The `bench planner` command."""
    rows = swarm_rows()
    print("| swarm | nodes x blocks | pipelines | solve s | stages | spare | s/microbatch "
          "| bound by | static plan | gain |", file=out)  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        print(
            f"| {r['swarm']} | {r['nodes']} x {r['blocks']} | {r['pipelines']} | "
            f"{r['solve_s']:.3f}{'' if r['exact'] else ' (search)'} | {len(r['stages'])} | "
            f"{len(r['spare'])} | {r['step_s']:.4f} | {r['bottleneck']} | "
            f"{r['static_step_s']:.4f} | {r['speedup_vs_static']:.2f}x |",
            file=out,
        )
    search = search_row(10 if quick else 60)
    print(
        f"\nlocal search vs exhaustive, {search['instances']} random 6-node x 12-block swarms: "
        f"mean step ratio {search['mean_ratio']:.4f}, worst {search['worst_ratio']:.4f}, "
        f"optimal in {search['optimal_share']:.0%}, {search['mean_solve_s'] * 1e3:.0f} ms each",
        file=out,
    )
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    with jsonl.open("a") as f:
        for r in [*rows, {"search": search}]:
            f.write(json.dumps(r) + "\n")
    return 0
