"""From members and their measurements to a plan: speeds, machines, and the static plan's cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ravnest_node.coordination.negotiate import (
    DEFAULT_LINK,
    check_capabilities,
    measured_links,
    negotiated_plan,
    node_speeds,
    wire_ratio,
)
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


def test_measured_links_bound_the_plan_and_a_relay_counts() -> None:
    """b measured a 10 Mbit/s uplink, c is behind NAT and reached through a (100 Mbit/s), the
    coordinator's own node d measured nothing. A boundary gets the slower uplink of its two ends
    (an unmeasured end counts as the default), and half the relay's uplink for a relayed end;
    the round trip is the longer of the two."""
    members = [Member(n, f"{n}:1") for n in "abcd"]
    caps = [
        pb.Capabilities(uplink_bps=100e6, rtt_s=0.002),
        pb.Capabilities(uplink_bps=10e6, rtt_s=0.05),
        pb.Capabilities(uplink_bps=40e6, rtt_s=0.02, relay_node_id="a"),
        pb.Capabilities(),
    ]
    links = measured_links(members, caps, "int8-block")
    assert links.link("a", "b").bandwidth_bps == 10e6 and links.link("a", "b").rtt_s == 0.05
    assert links.link("a", "c").bandwidth_bps == 40e6  # its own uplink is slower than 50
    assert links.link("d", "c").bandwidth_bps == 40e6
    assert links.link("a", "d") == DEFAULT_LINK.__class__(100e6, 0.002)
    assert measured_links(members[3:], caps[3:], "none").link("d", "x") == DEFAULT_LINK
    slow_relay = [pb.Capabilities(uplink_bps=20e6), *caps[1:]]
    assert measured_links(members, slow_relay, "none").link("d", "c").bandwidth_bps == 10e6
    assert links.codec_ratio == wire_ratio("int8-block") and 0.25 < links.codec_ratio < 0.3
    assert wire_ratio("none") == wire_ratio("auto") == 1.0 and wire_ratio("bf16") == 0.5


def test_a_slow_uplink_becomes_the_plans_bottleneck() -> None:
    """Three like nodes: with fast links compute bounds the step; with a 2 Mbit/s uplink on
    one of them, fp32 activations of bench-small across its boundary do, and the plan says so."""
    model = get_model("bench-small")
    run = TrainConfig(model="bench-small", codec="none").to_proto("0" * 16)
    members = [Member(n, f"{n}:1") for n in "abc"]

    def plan(uplinks: list[float]) -> str:
        caps = [pb.Capabilities(block_s=[0.01] * 8, memory_bytes=2**34, uplink_bps=u,
                                rtt_s=0.01) for u in uplinks]  # fmt: skip
        _, placed = negotiated_plan(
            epoch=1, swarm_id="s", model=model, members=members, capabilities=caps, run=run
        )
        return placed.bottleneck

    assert plan([1e9, 1e9, 1e9]).startswith("compute")
    assert plan([1e9, 2e6, 1e9]).startswith("the link after stage")


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"uplink_bps": float("nan")}, "uplink_bps"),
        ({"uplink_bps": -1.0}, "uplink_bps"),
        ({"uplink_bps": 1e20}, "uplink_bps"),
        ({"rtt_s": float("inf")}, "rtt_s"),
        ({"relay_node_id": "../etc"}, "relay_node_id"),
    ],
)
def test_malformed_link_measurements_are_refused(changes: dict[str, object], needle: str) -> None:
    caps = pb.Capabilities(block_s=[0.01] * 4, **changes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=needle):
        check_capabilities(caps, 4)


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
