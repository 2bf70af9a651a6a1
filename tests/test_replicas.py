"""Replica groups across real node processes: two pipelines of three stages train side by side
on disjoint data shards and average each stage with its replica every few steps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .conftest import demo_summary


def _demo(tmp_path: Path, name: str, *args: str) -> dict[str, Any]:
    return demo_summary(tmp_path, name, "--model", "tiny", "--seed", "0", *args)


def test_two_pipelines_average_and_end_as_one_model(tmp_path: Path) -> None:
    steps, every = 24, 6
    s = _demo(
        tmp_path, "two", "--nodes", "6", "--pipelines", "2", "--steps", str(steps),
        "--average-every", str(every), "--max-staleness", "1",
    )  # fmt: skip
    assert s["pipelines"] == 2 and s["samples"] == 2 * steps * 16
    stages = {(st["pipeline"], st["index"]): st for st in s["stages"]}
    assert sorted(stages) == [(p, i) for p in (0, 1) for i in range(3)]
    for i in range(3):
        a, b = stages[(0, i)], stages[(1, i)]
        assert a["blocks"] == b["blocks"]
        for st in (a, b):
            assert st["averaging_rounds"] == steps // every
            assert st["averaging_rounds_incomplete"] == 0
            assert st["averaging_bytes_sent"] > 0
        # The run ends with a round applied and no local step after it: the replicas hold the
        # same global point (up to the rounding of θ_i + (θ_global - θ_i), which differs with
        # each replica's θ_i); without averaging they differ by ~1e-4 relative after 24 steps.
        assert math.isclose(a["params_sq_sum"], b["params_sq_sum"], rel_tol=1e-9)
    # Each pipeline read its own shard, so their losses differ, and both fell.
    first, second = s["loss_history_per_pipeline"]
    assert first != second
    assert first[-1] < first[0] and second[-1] < second[0]
    # Averaging traffic is counted with the rest of the node's traffic.
    assert s["bytes_on_wire"] > sum(
        st["activation_bytes_sent"] + st["gradient_bytes_sent"] for st in s["stages"]
    )
