"""From members and their measurements to a plan: speeds, machines, and the static plan's cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ravnest_node.coordination.negotiate import negotiated_plan, node_speeds
from ravnest_node.coordination.static_plan import Member, check_plan, static_plan
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb

from .conftest import Procs, progress_events


def test_speeds_are_relative_to_the_fastest_and_noise_is_not_a_difference() -> None:
    assert node_speeds([1.0, 2.0, 4.0]) == [1.0, 0.5, 0.25]
    assert node_speeds([1.0, 1.2, 2.0]) == [1.0, 1.0, 0.5]  # within 1.3x: one speed
    # Nodes of one machine share its best measurement, whatever they measured.
    assert node_speeds([1.0, 3.0, 2.0], ["m1", "m2", "m2"]) == [1.0, 0.5, 0.5]


@pytest.mark.parametrize("model", ["tiny", "bench-small"])
@pytest.mark.parametrize(("nodes", "pipelines"), [(1, 1), (2, 1), (3, 1), (4, 2), (6, 2), (6, 3)])
def test_like_nodes_get_the_static_plan(model: str, nodes: int, pipelines: int) -> None:
    blocks = get_model(model)
    if nodes // pipelines > blocks.num_blocks():
        pytest.skip("more stages than blocks")
    run = TrainConfig(model=model, pipelines=pipelines).to_proto("0" * 16)
    members = [Member(f"n{i}", f"10.0.0.{i + 1}:7000") for i in range(nodes)]
    caps = [
        pb.Capabilities(block_s=[0.01 + 0.0005 * i] * blocks.num_blocks(), memory_bytes=2**34)
        for i in range(nodes)
    ]  # each a little slower than the last, all within 1.3x: noise
    plan, placed = negotiated_plan(
        epoch=1, swarm_id="s", model=blocks, members=members, capabilities=caps, run=run
    )
    assert plan == static_plan(epoch=1, swarm_id="s", model=blocks, members=members, run=run)
    for m in members:
        check_plan(plan, blocks, m.node_id)
    assert placed.exact and not placed.spare


def test_a_node_without_memory_for_any_stage_is_refused_clearly() -> None:
    model = get_model("bench-small")
    run = TrainConfig(model="bench-small").to_proto("0" * 16)
    members = [Member("a", "10.0.0.1:1"), Member("b", "10.0.0.2:1")]
    caps = [
        pb.Capabilities(block_s=[0.01] * 8, memory_bytes=2**34),
        pb.Capabilities(block_s=[0.01] * 8, memory_bytes=1000),
    ]
    with pytest.raises(ConfigError, match="fits in memory"):
        negotiated_plan(
            epoch=1, swarm_id="s", model=model, members=members, capabilities=caps, run=run
        )


def test_a_node_that_measures_faster_gets_more_of_the_model_across_processes(
    procs: Procs, tmp_path: Path
) -> None:
    """Three real nodes on three loopback hosts measure themselves; the one that reports a
    quarter of the compute time (test-only scale: on one machine they are alike) gets the
    largest share, and the swarm trains on that plan."""
    model = get_model("bench-small")
    _, ready = procs.start_node(
        tmp_path / "n0", "--swarm-size", "3", "--model", "bench-small", "--steps", "2"
    )
    join = ("--join", ready["address"])
    _, fast = procs.start_node(
        tmp_path / "n1", "--listen", "127.0.0.2:0", *join, "--fault-compute-scale", "0.25"
    )
    _, other = procs.start_node(tmp_path / "n2", "--listen", "127.0.0.3:0", *join)
    done = [e for e in progress_events(ready["address"]) if e.done]
    assert len(done) == 1 and not done[0].error
    summary = json.loads(done[0].summary_json)
    costs = model.block_costs()
    share = {s["node_id"]: sum(costs[slice(*s["blocks"])]) for s in summary["stages"]}
    assert set(share) == {ready["node_id"], fast["node_id"], other["node_id"]}
    assert share[fast["node_id"]] > max(share[ready["node_id"]], share[other["node_id"]])
    assert "measured" in (tmp_path / "n1" / "node.log").read_text()
