"""From members and their measurements to a plan: speeds, machines, and the static plan's cut."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from ravnest_node.bench.links import LinkSpec, NetnsSwarm
from ravnest_node.coordination.planning import negotiate
from ravnest_node.coordination.planning.negotiate import (
    DEFAULT_LINK,
    check_capabilities,
    measured_links,
    negotiated_plan,
    node_speeds,
    wire_ratio,
)
from ravnest_node.coordination.planning.static_plan import Member, check_plan, static_plan
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb

from .conftest import (
    NODE_ENV,
    Procs,
    node_status,
    progress_events,
    ravnest,
    require_netns,
    swarm_view,
)


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


def test_a_node_without_memory_for_any_stage_is_left_spare_and_no_fit_is_refused() -> None:
    model = get_model("bench-small")
    run = TrainConfig(model="bench-small").to_proto("0" * 16)
    members = [Member("a", "10.0.0.1:1"), Member("b", "10.0.0.2:1")]
    caps = [
        pb.Capabilities(block_s=[0.01] * 8, memory_bytes=2**34),
        pb.Capabilities(block_s=[0.01] * 8, memory_bytes=1000),
    ]
    plan, placed = negotiated_plan(
        epoch=1, swarm_id="s", model=model, members=members, capabilities=caps, run=run
    )
    assert [s.node_id for s in plan.stages] == ["a"] and placed.spare == ("b",)
    caps[0].memory_bytes = 1000
    with pytest.raises(ConfigError, match="fits in memory"):
        negotiated_plan(
            epoch=1, swarm_id="s", model=model, members=members, capabilities=caps, run=run
        )


def test_measured_links_bound_the_plan_and_a_relay_counts() -> None:
    """b measured a 10 Mbit/s uplink, c and e are behind NAT and reached through a (100 Mbit/s),
    the coordinator's own node d measured nothing. A boundary gets the slower uplink of its two
    ends (an unmeasured end counts as the default), the round trip the longer of the two. A
    relayed node opens its streams to a reachable one itself: its relay is not on that path.
    Between two relayed nodes it is, in and out, shared by the nodes it relays."""
    members = [Member(n, f"{n}:1") for n in "abcde"]
    caps = [
        pb.Capabilities(uplink_bps=100e6, rtt_s=0.002),
        pb.Capabilities(uplink_bps=10e6, rtt_s=0.05),
        pb.Capabilities(uplink_bps=40e6, rtt_s=0.02, relay_node_id="a"),
        pb.Capabilities(),
        pb.Capabilities(uplink_bps=100e6, rtt_s=0.02, relay_node_id="a"),
    ]
    links = measured_links(members, caps, "int8-block")
    assert links.link("a", "b").bandwidth_bps == 10e6 and links.link("a", "b").rtt_s == 0.05
    assert links.link("a", "c").bandwidth_bps == 40e6  # its own uplink
    assert links.link("d", "c").bandwidth_bps == 40e6
    assert links.link("d", "e").bandwidth_bps == 100e6
    assert links.link("a", "d") == DEFAULT_LINK.__class__(100e6, 0.002)
    assert links.link("c", "e").bandwidth_bps == 25e6  # a's 100 / 2 ways / 2 nodes
    assert measured_links(members[3:4], caps[3:4], "none").link("d", "x") == DEFAULT_LINK
    slow_relay = [pb.Capabilities(uplink_bps=20e6), *caps[1:]]
    assert measured_links(members, slow_relay, "none").link("c", "e").bandwidth_bps == 5e6
    assert measured_links(members, slow_relay, "none").link("d", "c").bandwidth_bps == 40e6
    assert links.codec_ratio == wire_ratio("int8-block") and 0.25 < links.codec_ratio < 0.3
    assert wire_ratio("none") == 1.0 and wire_ratio("bf16") == 0.5
    assert wire_ratio("auto") == wire_ratio("int4-block") == 4.5 / 32
    # A boundary's slower direction counts: int4 activations with fp32 gradients move fp32.
    assert measured_links(members, caps, "int4-block", "none").codec_ratio == 1.0
    int8 = wire_ratio("int8-block")
    assert measured_links(members, caps, "auto", "int8-block").codec_ratio == int8
    # top-k sends a float32 value and an index for 1% of the elements: 0.64 bits, not 32.
    assert wire_ratio("topk-ef") == 0.64 / 32
    assert measured_links(members, caps, "int4-block", "topk-ef").codec_ratio == 4.5 / 32


def test_auto_pipelines_over_a_slow_internet_link_where_fp32_would_not() -> None:
    """bench-small on three like machines linked at 10 Mbit/s and 50 ms (the `internet`
    scenario): with `auto` (int4 where nothing more faithful fits in half the compute) the
    three form a pipeline, each link's transfer below a stage's compute; with fp32 frames the
    links would dwarf the compute and one node alone trains the model, the others spare."""
    model = get_model("bench-small")
    members = [Member(n, f"10.0.0.{i}:1") for i, n in enumerate("abc")]
    # bench-small's blocks for a microbatch of 4 on this machine: ~20 ms each
    caps = [pb.Capabilities(block_s=[0.02] * 8, memory_bytes=2**34, uplink_bps=10e6, rtt_s=0.1)
            for _ in members]  # fmt: skip

    def stages(codec: str, asked: int = 0) -> int:
        run = TrainConfig(model="bench-small", codec=codec, stages=asked).to_proto("0" * 16)
        plan, _ = negotiated_plan(
            epoch=1, swarm_id="s", model=model, members=members, capabilities=caps, run=run
        )
        return len(plan.stages)

    assert stages("auto") == 3
    assert stages("int4-block") == 3
    assert stages("none") == 1
    # A run that asks for a shape gets it (the benchmarks' fp32 pipeline over these links),
    # and after losing a member as many stages as are left, not no plan at all.
    assert stages("none", asked=3) == 3
    assert stages("auto", asked=2) == 2
    del members[2], caps[2]
    assert stages("none", asked=3) == 2


def test_a_slow_uplink_becomes_the_plans_bottleneck(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three like nodes: with fast links compute bounds the step; with a 2 Mbit/s uplink on
    one of them, fp32 activations of bench-small across its boundary do, and the plan says so
    (when every node must have a stage; by default that node is left spare, as above)."""
    monkeypatch.setattr(negotiate, "SPARE_GAIN", 1e9)
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


def test_measured_pairs_win_over_uplinks_each_direction_on_its_own() -> None:
    """a and b are on one LAN, the coordinator far away: their uplinks to it say 10 Mbit/s,
    but b measured 800 Mbit/s to a and 600 back; that is what their boundary gets. A pair not
    measured still gets the slower uplink; two nodes on one host talk through memory."""
    members = [Member("a", "10.0.0.1:1"), Member("b", "10.0.0.2:1"),
               Member("c", "10.0.0.3:1"), Member("d", "10.0.0.3:2")]  # fmt: skip
    far = {"uplink_bps": 10e6, "rtt_s": 0.05}
    b = pb.Capabilities(**far)  # type: ignore[arg-type]
    b.peer_links.add(node_id="a", to_bps=800e6, from_bps=600e6, rtt_s=0.001)
    caps = [pb.Capabilities(**far), b, pb.Capabilities(**far), pb.Capabilities(**far)]  # type: ignore[arg-type]
    links = measured_links(members, caps, "none")
    assert links.pairs[("b", "a")] == DEFAULT_LINK.__class__(800e6, 0.001)
    assert links.pairs[("a", "b")] == DEFAULT_LINK.__class__(600e6, 0.001)
    assert links.link("a", "c") == DEFAULT_LINK.__class__(10e6, 0.05)
    assert ("c", "d") not in links.pairs and links.link("c", "d") == DEFAULT_LINK
    # Both behind NAT: the relay's uplink, in and out for the two, still bounds what they
    # measured to each other.
    relayed = [pb.Capabilities(uplink_bps=100e6),
               pb.Capabilities(uplink_bps=10e6, relay_node_id="a"),
               pb.Capabilities(uplink_bps=10e6, relay_node_id="a")]  # fmt: skip
    relayed[2].peer_links.add(node_id="b", to_bps=900e6, from_bps=900e6, rtt_s=0.001)
    assert measured_links(members[:3], relayed, "none").link("c", "b").bandwidth_bps == 25e6
    relayed[1].relay_node_id = ""  # one of them: straight, as measured
    assert measured_links(members[:3], relayed, "none").link("c", "b").bandwidth_bps == 900e6


def test_a_node_on_a_slow_link_is_left_spare_only_when_that_is_clearly_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench-small on three like nodes, c's links to a and b measured at 2 Mbit/s: fp32
    activations across c's boundary would take far longer than the compute, so c is left
    spare and a and b share the model. With SPARE_GAIN out of reach, every node has a stage."""
    model = get_model("bench-small")
    run = TrainConfig(model="bench-small", codec="none").to_proto("0" * 16)
    members = [Member(n, f"10.0.0.{i}:1") for i, n in enumerate("abc")]
    caps = [pb.Capabilities(block_s=[0.01] * 8, memory_bytes=2**34) for _ in members]
    for peer in "ab":
        caps[2].peer_links.add(node_id=peer, to_bps=2e6, from_bps=2e6, rtt_s=0.01)

    def plan() -> tuple[pb.Plan, object]:
        return negotiated_plan(
            epoch=1, swarm_id="s", model=model, members=members, capabilities=caps, run=run
        )

    spared, placed = plan()
    assert {s.node_id for s in spared.stages} == {"a", "b"} and placed.spare == ("c",)  # type: ignore[attr-defined]
    for node in "ab":
        check_plan(spared, model, node)
    monkeypatch.setattr(negotiate, "SPARE_GAIN", 1e9)
    full, placed = plan()
    assert {s.node_id for s in full.stages} == {"a", "b", "c"} and not placed.spare  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"uplink_bps": float("nan")}, "uplink_bps"),
        ({"uplink_bps": -1.0}, "uplink_bps"),
        ({"uplink_bps": 1e20}, "uplink_bps"),
        ({"rtt_s": float("inf")}, "rtt_s"),
        ({"relay_node_id": "../etc"}, "relay_node_id"),
        ({"peer_links": [pb.PeerLink(node_id="../x", to_bps=1e6, from_bps=1e6)]}, "node_id"),
        ({"peer_links": [pb.PeerLink(node_id="b", to_bps=0, from_bps=1e6)]}, "rates"),
        ({"peer_links": [pb.PeerLink(node_id="b", to_bps=1e-300, from_bps=1e6)]}, "rates"),
        ({"peer_links": [pb.PeerLink(node_id="b", to_bps=1e6, from_bps=float("nan"))]}, "rates"),
        ({"peer_links": [pb.PeerLink(node_id="b", to_bps=1e6, from_bps=1e6, rtt_s=-1)]}, "rtt_s"),
        ({"peer_links": [pb.PeerLink(node_id="b", to_bps=1e6, from_bps=1e6)] * 2}, "two peer"),
        (
            {
                "peer_links": [
                    pb.PeerLink(node_id=f"n{i}", to_bps=1e6, from_bps=1e6) for i in range(17)
                ]
            },
            "17 peer links",
        ),
        ({"relay_address": "no port"}, "HOST:PORT"),
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


def test_a_host_on_a_slow_link_is_measured_and_left_spare(procs: Procs, tmp_path: Path) -> None:
    """Three hosts on a bridge, h2's link capped at 2 Mbit/s: each node measures its links to
    the nodes that joined before it, both ways; the coordinator sees h2's links at about 2
    Mbit/s and leaves it spare (fp32 activations over that link would take far longer than
    the compute), `status` says so, and the other two train the run. h2 also computes a little
    slower (`--fault-block-ms`): on a loaded machine it could otherwise measure fastest, and a
    plan of that one node alone, with no link at all, would then be the best."""
    require_netns()
    with NetnsSwarm(3, LinkSpec(rate_mbit=1000, delay_ms=0), name="rvs",
                    rates_mbit=[1000, 1000, 2]) as net:  # fmt: skip
        nodes = []
        for i, host in enumerate(net.hosts):
            args = ("--swarm-size", "3", "--model", "tiny", "--steps", "20", "--codec", "none")
            if i:
                args = ("--join", f"{net.hosts[0].address}:7070")
            if i == 2:
                args = (*args, "--fault-block-ms", "5")
            nodes.append(procs.start_node(tmp_path / f"n{i}", "--listen", f"{host.address}:7070",
                                          "--swarm-name", "spare", *args,
                                          prefix=net.exec_prefix(i)))  # fmt: skip
        coordinator = nodes[0][1]["address"]
        slow = nodes[2][1]["node_id"]
        done = [e for e in progress_events(coordinator) if e.done]
        assert len(done) == 1 and not done[0].error
        view = swarm_view(coordinator)
        assert slow not in {s.node_id for s in view.plan.stages}
        assert len(view.plan.stages) == 2
        links = {(m.node_id, p.node_id): p for m in view.members for p in m.peer_links}
        assert len(links) == 3
        for (a, b), link in links.items():
            print(
                f"{a} -> {b}: {link.to_bps / 1e6:.1f} Mbit/s, back {link.from_bps / 1e6:.1f}, "
                f"round trip {link.rtt_s * 1e3:.2f} ms"
                + (" (the capped host)" if slow in (a, b) else "")
            )
            rate = min(link.to_bps, link.from_bps)
            if slow in (a, b):
                assert 1e6 < rate < 3e6, (a, b, link)
            else:
                assert rate > 20e6, (a, b, link)
        assert node_status(nodes[2][1]["address"]).stage == -1
        out = subprocess.run(
            ravnest("status", "--swarm", "spare", "--peer", coordinator, "--json"), env=NODE_ENV,
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=True,
        ).stdout  # fmt: skip
        shown = {m["node_id"]: m for m in json.loads(out)["members"]}
        assert shown[slow]["stage"] is None and len(shown[slow]["links"]) == 2
        for proc, _ in nodes:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(10) for proc, _ in nodes] == [0, 0, 0]
