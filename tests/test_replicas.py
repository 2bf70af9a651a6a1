"""Replica groups across real node processes: two pipelines of three stages train side by side
on disjoint data shards and average each stage with its replica every few steps."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .conftest import demo_summary
from .training import final_blocks, ulps_apart


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
    final = final_blocks(sorted((tmp_path / "two").glob("node-*")), "tiny")
    assert sorted(final) == sorted(stages)
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
        # Measured: 1/16 to 1/8 of a float32 step at each tensor's largest magnitude.
        assert ulps_apart(final[(0, i)], final[(1, i)]) <= 1
        assert math.isclose(a["params_sq_sum"], b["params_sq_sum"], rel_tol=1e-9)
    # Each pipeline read its own shard, so their losses differ, and both fell.
    first, second = s["loss_history_per_pipeline"]
    assert first != second
    assert first[-1] < first[0] and second[-1] < second[0]
    # Averaging traffic is counted with the rest of the node's traffic.
    assert s["bytes_on_wire"] > sum(
        st["activation_bytes_sent"] + st["gradient_bytes_sent"] for st in s["stages"]
    )


def test_a_poisoning_replica_is_banned_and_the_others_train_on(tmp_path: Path) -> None:
    """Three pipelines of one stage; the replica of pipeline 2 trains honestly but pushes deltas
    10^4 times their size. The others reject them, ban it after 3 rounds and stop waiting for
    it, and train as well as it did on its own (its pushes never entered their means)."""
    steps, every = 24, 4
    s = _demo(
        tmp_path, "poisoned", "--nodes", "3", "--pipelines", "3", "--steps", str(steps),
        "--average-every", str(every), "--average-timeout-s", "8", "--fault-poison-pipeline", "2",
    )  # fmt: skip
    stages = {st["pipeline"]: st for st in s["stages"]}
    dirs = (tmp_path / "poisoned").glob("node-*")
    by_id = {(d / "node_id").read_text().strip(): (d / "node.log").read_text() for d in dirs}
    logs = {p: by_id[st["node_id"]] for p, st in stages.items()}
    bad = stages[2]["node_id"]
    for p in (0, 1):
        assert logs[p].count(f"rejected {bad}'s delta: its norm exceeds 10 x") == 3
        assert f"banned {bad} from averaging for the rest of the run" in logs[p]
        # Every round went on without the poisoner: rejected, then banned.
        assert stages[p]["averaging_rounds"] == stages[p]["averaging_rounds_incomplete"] == 6
    assert f"node '{bad}' is banned from averaging for this run" in logs[2]  # when it pushed
    lines = (logs[0] + logs[1]).splitlines()
    assert all(bad in line for line in lines if "banned" in line)  # nobody else
    # The honest replicas end as one model (to the rounding of a round's correction, as above;
    # the poisoner's, averaged apart from theirs, is far from it), as large as the poisoner's
    # own (which only its pushes poisoned): 10^4-times deltas in their means would have blown
    # it up.
    final = final_blocks(sorted((tmp_path / "poisoned").glob("node-*")), "tiny")
    assert ulps_apart(final[(0, 0)], final[(1, 0)]) <= 1
    assert ulps_apart(final[(0, 0)], final[(2, 0)]) > 1000
    a, b, own = (stages[p]["params_sq_sum"] for p in (0, 1, 2))
    assert math.isclose(a, b, rel_tol=1e-9)
    assert math.isclose(a, own, rel_tol=0.01)
    # Their loss fell as far as the poisoner's (each reads its own shard: the last 6 steps).
    tail = [statistics.mean(h[-6:]) for h in s["loss_history_per_pipeline"]]
    for p in (0, 1):
        assert tail[p] < 0.85 * s["loss_history_per_pipeline"][p][0]
        assert math.isclose(tail[p], tail[2], rel_tol=0.05), tail
