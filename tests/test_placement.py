"""The planner: the fastest placement of blocks on nodes within memory, against brute force."""

from __future__ import annotations

import io
import itertools
import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ravnest_node.bench.planner import run_planner_bench
from ravnest_node.coordination.planning.placement import (
    Block,
    Link,
    Links,
    NodeCaps,
    SwarmPlan,
    plan_swarm,
)
from ravnest_node.errors import ConfigError


def step_of(
    blocks: list[Block],
    nodes: dict[str, NodeCaps],
    links: Links,
    cuts: list[tuple[int, int]],
    owners: list[tuple[str, ...]],
) -> float:
    """Seconds per microbatch of one placement, written out from the definition (inf if a
    stage does not fit in one of its owners)."""
    slowest = 0.0
    for s, ((start, stop), group) in enumerate(zip(cuts, owners, strict=True)):
        held = sum(b.memory_bytes for b in blocks[start:stop])
        if any(held > nodes[v].memory_bytes for v in group):
            return math.inf
        work = sum(b.compute_s for b in blocks[start:stop])
        slowest = max(slowest, max(work / nodes[v].speed for v in group))
        if s + 1 < len(cuts):
            sent = blocks[stop - 1].activation_bytes * links.codec_ratio * 8
            for a, b in zip(group, owners[s + 1], strict=True):
                there, back = links.link(a, b), links.link(b, a)
                wire = max(sent / there.bandwidth_bps, sent / back.bandwidth_bps)
                slowest = max(slowest, wire + max(there.rtt_s, back.rtt_s) / links.in_flight)
    return slowest


def brute_force(blocks: list[Block], nodes: list[NodeCaps], links: Links, pipelines: int) -> float:
    """The least step over every stage count, choice and order of owners, and cut."""
    by_id = {node.node_id: node for node in nodes}
    n, best = len(blocks), math.inf
    for stages in range(1, min(n, len(nodes) // pipelines) + 1):
        for chosen in itertools.permutations(by_id, stages * pipelines):
            owners = [
                tuple(chosen[p * stages + s] for p in range(pipelines)) for s in range(stages)
            ]
            for inner in itertools.combinations(range(1, n), stages - 1):
                bounds = [0, *inner, n]
                cuts = list(itertools.pairwise(bounds))
                best = min(best, step_of(blocks, by_id, links, cuts, owners))
    return best


def speed_sorted_start(
    blocks: list[Block], nodes: list[NodeCaps], links: Links, pipelines: int
) -> float:
    """The step of the local search's start, written out from its definition: for each stage
    count, the nodes ranked fastest first (equal speeds in the order given), stage s owned by
    the next `pipelines` of them (one per pipeline), at the best cut; the least of those."""
    ranked = [node.node_id for node in sorted(nodes, key=lambda node: -node.speed)]
    by_id = {node.node_id: node for node in nodes}
    n, best = len(blocks), math.inf
    for stages in range(1, min(n, len(nodes) // pipelines) + 1):
        owners = [tuple(ranked[s * pipelines + p] for p in range(pipelines))
                  for s in range(stages)]  # fmt: skip
        for inner in itertools.combinations(range(1, n), stages - 1):
            cuts = list(itertools.pairwise([0, *inner, n]))
            best = min(best, step_of(blocks, by_id, links, cuts, owners))
    return best


def check_valid(plan: SwarmPlan, blocks: list[Block], nodes: list[NodeCaps], links: Links) -> None:
    """Stages in order, covering every block; every node used once or spare; step as claimed."""
    assert plan.stages[0].first_block == 0 and plan.stages[-1].stop_block == len(blocks)
    for a, b in itertools.pairwise(plan.stages):
        assert a.stop_block == b.first_block
    used = [v for stage in plan.stages for v in stage.owners]
    assert sorted(used + list(plan.spare)) == sorted(node.node_id for node in nodes)
    cuts = [(s.first_block, s.stop_block) for s in plan.stages]
    by_id = {node.node_id: node for node in nodes}
    actual = step_of(blocks, by_id, links, cuts, [s.owners for s in plan.stages])
    assert actual == pytest.approx(plan.step_s, rel=1e-9)
    assert max(max(s.compute_s, s.send_s) for s in plan.stages) == pytest.approx(plan.step_s)


@st.composite
def instances(draw: st.DrawFn) -> tuple[list[Block], list[NodeCaps], Links, int]:
    n = draw(st.integers(1, 6))
    blocks = [
        Block(
            compute_s=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])),
            activation_bytes=draw(st.sampled_from([0, 1000, 10**6, 10**7])),
            memory_bytes=draw(st.sampled_from([1, 2, 4])),
        )
        for _ in range(n)
    ]
    count = draw(st.integers(1, 4))
    nodes = [
        NodeCaps(
            node_id=f"n{i}",
            speed=draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])),
            memory_bytes=draw(st.sampled_from([2, 4, 8, math.inf])),
        )
        for i in range(count)
    ]
    ids = [node.node_id for node in nodes]
    pairs = {
        (a, b): Link(draw(st.sampled_from([1e6, 1e8, 1e9])), draw(st.sampled_from([0.0, 0.05])))
        for a in ids
        for b in ids
        if a != b and draw(st.booleans())
    }
    links = Links(
        default=Link(1e9, 0.001),
        pairs=pairs,
        codec_ratio=draw(st.sampled_from([0.125, 0.5, 1.0])),
    )
    pipelines = draw(st.integers(1, max(1, count // 2)))
    return blocks, nodes, links, pipelines


@given(instances())
@settings(max_examples=150, deadline=None)
def test_small_instances_match_brute_force(
    instance: tuple[list[Block], list[NodeCaps], Links, int],
) -> None:
    blocks, nodes, links, pipelines = instance
    optimum = brute_force(blocks, nodes, links, pipelines)
    if math.isinf(optimum):
        with pytest.raises(ConfigError, match="fits in memory"):
            plan_swarm(blocks, nodes, links, pipelines=pipelines)
        return
    plan = plan_swarm(blocks, nodes, links, pipelines=pipelines)
    assert plan.exact
    assert plan.step_s == pytest.approx(optimum, rel=1e-9)
    check_valid(plan, blocks, nodes, links)


@given(instances())
@settings(max_examples=60, deadline=None)
@example(  # the fast, small nodes hold the stage with the big block: no single swap helps
    instance=(
        [Block(0.0, 0, 4), Block(0.0, 0, 1), Block(0.0, 0, 1)],
        [NodeCaps("n0", 0.5, 4), NodeCaps("n1", 1.0, 2), NodeCaps("n2", 1.0, 2),
         NodeCaps("n3", 0.5, 4)],
        Links(default=Link(1e9, 1e-3), codec_ratio=0.125, in_flight=4),
        2,
    )
)  # fmt: skip
@example(  # no start fits: only 4 stages can, with the big nodes in the middle (found in CI)
    instance=(
        [Block(0.0, 0, 1), Block(0.0, 0, 4), Block(0.0, 0, 4), Block(0.0, 0, 1)],
        [NodeCaps("n0", 0.5, 2), NodeCaps("n1", 0.5, 2), NodeCaps("n2", 0.5, 4),
         NodeCaps("n3", 0.5, 4)],
        Links(default=Link(1e9, 1e-3), codec_ratio=0.125, in_flight=4),
        1,
    )
)  # fmt: skip
def test_the_local_search_gives_a_valid_plan_no_worse_than_the_speed_sorted_start(
    instance: tuple[list[Block], list[NodeCaps], Links, int],
) -> None:
    blocks, nodes, links, pipelines = instance
    if math.isinf(brute_force(blocks, nodes, links, pipelines)):
        return
    plan = plan_swarm(blocks, nodes, links, pipelines=pipelines, exact_limit=0)
    assert not plan.exact
    check_valid(plan, blocks, nodes, links)
    assert plan.step_s <= speed_sorted_start(blocks, nodes, links, pipelines) * (1 + 1e-9)


def test_a_node_twice_as_fast_gets_twice_the_compute() -> None:
    rng = random.Random(1)
    blocks = [Block(rng.uniform(0.8, 1.2), 10_000, 1) for _ in range(60)]
    nodes = [NodeCaps("slow-a"), NodeCaps("fast", speed=2.0), NodeCaps("slow-b")]
    plan = plan_swarm(blocks, nodes, stages=3)
    work = {
        stage.owners[0]: sum(b.compute_s for b in blocks[stage.first_block : stage.stop_block])
        for stage in plan.stages
    }
    for slow in ("slow-a", "slow-b"):
        assert work["fast"] / work[slow] == pytest.approx(2.0, rel=0.15)
    # Equal blocks that divide evenly: exactly twice.
    even = plan_swarm([Block(1.0, 0, 1)] * 40, nodes)
    assert [len(even.blocks_of(v)) for v in ("slow-a", "fast", "slow-b")] == [10, 20, 10]


def test_a_node_gets_no_stage_it_cannot_hold() -> None:
    blocks = [Block(1.0, 1000, 10) for _ in range(12)]
    nodes = [
        NodeCaps("big", memory_bytes=1000),
        NodeCaps("tiny", speed=4.0, memory_bytes=5),  # fastest, but holds no block
        NodeCaps("small", memory_bytes=30),  # three blocks at most
    ]
    plan = plan_swarm(blocks, nodes)
    assert plan.spare == ("tiny",)
    assert len(plan.blocks_of("small")) <= 3
    check_valid(plan, blocks, nodes, Links())
    with pytest.raises(ConfigError, match="fits in memory"):
        plan_swarm(blocks, nodes, stages=3)  # every node must then hold a stage
    with pytest.raises(ConfigError, match="fits in memory"):
        plan_swarm(blocks, [NodeCaps("a", memory_bytes=50), NodeCaps("b", memory_bytes=50)])


def test_a_link_slower_than_the_compute_it_would_save_is_not_used() -> None:
    # Splitting 2 s of compute in two saves 1 s a microbatch but sends 10 MB over 10 Mbit/s (8 s).
    blocks = [Block(1.0, 10**7, 1), Block(1.0, 10**7, 1)]
    nodes = [NodeCaps("a"), NodeCaps("b")]
    slow = plan_swarm(blocks, nodes, Links(default=Link(1e7)))
    assert len(slow.stages) == 1 and len(slow.spare) == 1 and slow.step_s == 2.0
    assert slow.bottleneck == "compute of stage 0"
    fast = plan_swarm(blocks, nodes, Links(default=Link(1e10)))
    assert len(fast.stages) == 2 and fast.step_s == 1.0
    # A codec that sends 1/16 of the bytes makes the split worth it on the slow link too.
    squeezed = plan_swarm(blocks, nodes, Links(default=Link(1e7), codec_ratio=1 / 16))
    assert len(squeezed.stages) == 2 and squeezed.bottleneck == "compute of stage 0"


def test_when_a_link_sets_the_pace_compute_is_still_balanced() -> None:
    """bench-small's shape (a light embedding, six layers, a head) on three alike nodes and a
    10 Mbit/s link: every 3-stage cut has the same boundary, so the link sets the same pace for
    all of them; the plan takes the one whose slowest stage computes least, not the first stage
    cut as short as it can be (the embedding alone, leaving one stage four blocks)."""
    blocks = [Block(0.0001, 10**6, 1)] + [Block(0.1, 10**6, 1)] * 6 + [Block(0.05, 0, 1)]
    nodes = [NodeCaps(v) for v in ("a", "b", "c")]
    plan = plan_swarm(blocks, nodes, Links(default=Link(1e7)), stages=3)
    assert plan.bottleneck == "the link after stage 0"
    compute = [stage.compute_s for stage in plan.stages]
    assert max(compute) == pytest.approx(0.25)  # embedding + 2 | 2 | 2 + head; was 0.55
    assert plan.step_s == pytest.approx(0.8)  # 1 MB at 10 Mbit/s, as for any cut
    check_valid(plan, blocks, nodes, Links(default=Link(1e7)))


def test_replica_groups_gather_nodes_of_like_speed() -> None:
    blocks = [Block(1.0, 0, 1) for _ in range(8)]
    nodes = [NodeCaps(f"n{i}", speed=s) for i, s in enumerate([1.0, 2.0, 1.0, 2.0])]
    plan = plan_swarm(blocks, nodes, pipelines=2)
    groups = {frozenset(stage.owners) for stage in plan.stages}
    assert groups == {frozenset({"n1", "n3"}), frozenset({"n0", "n2"})}
    assert [len(plan.blocks_of(v)) for v in ("n0", "n1")] in ([3, 5], [2, 6])  # fast ones: more


def test_a_sixteen_node_eighty_block_instance_gives_a_valid_plan() -> None:
    rng = random.Random(0)
    blocks = [Block(rng.uniform(0.5, 2), rng.randint(10**5, 10**6), 10**8) for _ in range(80)]
    nodes = [NodeCaps(f"n{i}", rng.choice([0.5, 1.0, 2.0]), 2 * 10**9) for i in range(16)]
    links = Links(default=Link(1e9, 0.001))
    plan = plan_swarm(blocks, nodes, links)
    check_valid(plan, blocks, nodes, links)
    # It does at least as well as the static cut (blocks balanced by cost, speed ignored).
    assert plan.step_s <= 80 * 2 / 16 / 0.5


def test_the_local_search_of_a_public_swarm_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand members (40 pipelines of 25 stages): the pairwise swaps would be half a
    million a pass; the search evaluates at most SEARCH_BUDGET placements, never swaps two
    nodes that only their ids tell apart, and still improves on the speed-sorted start."""
    from ravnest_node.coordination.planning import placement

    evaluations = 0
    value = placement._Instance.value

    def counted(self: object, *args: object) -> float:
        nonlocal evaluations
        evaluations += 1
        return value(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(placement._Instance, "value", counted)
    rng = random.Random(1)
    blocks = [Block(1.0, 10**6, 10**8) for _ in range(26)]
    same = [NodeCaps(f"s{i}", 1.0, 10**10) for i in range(1000)]
    plan = plan_swarm(blocks, same, pipelines=40, stages=25)
    assert evaluations < 20  # nodes alike, and groups of them, are never swapped
    assert plan.step_s == 2.0  # (one stage of two blocks: 26 blocks in 25 stages)
    evaluations = 0
    mixed = [NodeCaps(f"m{i}", rng.uniform(0.5, 2.0), 10**10) for i in range(1000)]
    plan = plan_swarm(blocks, mixed, pipelines=40, stages=25)
    check_valid(plan, blocks, mixed, Links())
    assert evaluations <= placement.SEARCH_BUDGET + 10  # (+ the starts' own values)
    # The fastest 1,000 of them all hold a stage; the slowest replica of the two-block stage
    # sets the pace, no slower than the slowest member would.
    assert plan.step_s <= 2.0 / min(n.speed for n in mixed)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": []}, "no blocks"),
        ({"blocks": [Block(-1.0, 0, 0)]}, "compute_s"),
        ({"blocks": [Block(math.nan, 0, 0)]}, "compute_s"),
        ({"nodes": [NodeCaps("a"), NodeCaps("a")]}, "distinct"),
        ({"nodes": [NodeCaps("a", speed=0.0)]}, "speed"),
        ({"links": Links(default=Link(0.0))}, "bandwidth"),
        ({"links": Links(codec_ratio=math.inf)}, "codec_ratio"),
        ({"pipelines": 3}, "cannot form"),
        ({"stages": 3}, "at most 2"),
    ],
)
def test_malformed_input_is_refused_with_a_clear_error(kwargs: dict, message: str) -> None:
    args: dict = {"blocks": [Block(1.0, 0, 0)] * 4, "nodes": [NodeCaps("a"), NodeCaps("b")]}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        plan_swarm(**args)


def test_the_planner_benchmark_prints_its_table_and_writes_jsonl(tmp_path: Path) -> None:
    out = io.StringIO()
    assert run_planner_bench(tmp_path / "p.jsonl", quick=True, out=out) == 0
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and rows[-1]["search"]["instances"] == 10
    assert all(r["speedup_vs_static"] >= 1.0 for r in rows[:-1])  # never worse than static
    assert out.getvalue().count("\n| ") == 4 and "local search vs exhaustive" in out.getvalue()
