"""The fields of a bench record that need the whole scenario: the loss at equal samples (of the
last step's batch, and the held-out loss's gap to compute-bound's), and the
efficiency against the lower bound of a step (the slowest stage's compute or the busiest uplink's
transfer, whichever is longer)."""

from __future__ import annotations

import math
from typing import Any

from ravnest_node.bench.config import NODES, cores
from ravnest_node.bench.link_bound import versus_naive
from ravnest_node.bench.report import Record
from ravnest_node.coordination.planning.planner import partition
from ravnest_node.pipeline.run import TrainConfig


def finish_scenario(records: list[Record], model: Any, train: TrainConfig) -> None:
    """Fields that need the whole scenario: loss at equal samples and efficiency."""
    runs = [r for r in records if "skipped" not in r]
    if not runs:
        return
    versus_naive(runs)
    # An estimated run (naive on a slow link) ran a few steps only: its losses are not compared.
    full = [r for r in runs if "estimated" not in r]
    equal = min((len(r["loss_history"]) for r in full), default=0)
    for r in full:
        r["loss_at_equal_samples"] = r["loss_history"][equal - 1]
    compute = next((r for r in runs if r["system"] == "compute-bound"), None)
    # Full runs all end at the same step: their final models' held-out losses are at equal
    # samples (bench/held_out.py).
    if compute is not None and "held_out_loss" in compute:
        for r in full:
            if "held_out_loss" in r:
                r["held_out_gap"] = r["held_out_loss"] / compute["held_out_loss"] - 1
    costs = model.block_costs()
    cuts = partition(costs, NODES)
    share = max(sum(costs[a:b]) for a, b in cuts) / sum(costs)
    if compute is not None:
        stage_s = compute["step_s"] * share
    else:  # measured on our nodes (the same stages; inflated when they share cores)
        measured = [
            max(r["stage_compute_s"]) / r["steps"] for r in runs if r.get("stage_compute_s")
        ]
        stage_s = min(measured) if measured else math.nan
    for r in runs:
        if r["system"] == "compute-bound" or r.get("link") is None:
            continue
        if r["link"]["emulation"] != "netns":
            # Relays pace each connection, not each host: there is no per-host uplink to bound.
            r["efficiency"] = None
            continue
        # What each host's interface sent (headers included), the same measure for every system.
        egress = max(r["node_link_bytes"]) / r["steps"]  # steps it ran (an estimate: a few)
        transfer_s = egress * 8 / (r["link"]["rate_mbit"] * 1e6)
        bound = max(stage_s, transfer_s)
        r["lower_bound_step_s"] = bound
        r["slowest_stage_compute_s"] = stage_s
        r["busiest_uplink_transfer_s"] = transfer_s
        r["efficiency"] = bound / r["step_s"]
        # The same bound for this machine, where the stages share its cores (or its one GPU):
        # their measured compute cannot take less than its sum over the cores.
        measured = [c / r["steps"] for c in r.get("stage_compute_s") or []]
        if measured:
            lanes = min(cores(), len(measured)) if r.get("device", "cpu") == "cpu" else 1
            shared = max(sum(measured) / lanes, max(measured))
            r["lower_bound_step_s_this_machine"] = max(shared, transfer_s)
            r["efficiency_this_machine"] = max(shared, transfer_s) / r["step_s"]
