"""The planner: which node owns which blocks, from measured speeds, memory and links. Pure.

A swarm of `pipelines` pipelines, each cut the same way into S contiguous stages; the owners of
stage s in every pipeline form a replica group that averages in the background. A pipeline
moves one microbatch per `step_s` seconds, the slowest of

* a stage's compute: the blocks' reference compute time divided by the owner's speed (the
  slowest replica of the stage sets the pace of its slot), and
* a boundary's transfer: the activation crosses downstream and its gradient (the same size)
  upstream, each on its own direction of the link between the two owners, at the link's
  bandwidth after the codec's ratio, plus the round-trip time spread over the microbatches in
  flight.

The planner minimises `step_s` within memory: a stage's blocks must fit in every one of its
owners. Nodes it does not use (they would not make the swarm faster, or cannot hold any stage)
are *spare*. Ties go to fewer stages, fewer hops for every microbatch. Among the cuts that reach
the least `step_s`, the planner takes one whose slowest stage computes least: when a link sets
the pace, compute is balanced anyway (it is what a synchronous step, a faster codec or a
re-measured link then wait on), rather than the first stages left nearly empty.

For a fixed order of owners the best cut is exact (a min-max dynamic programme over blocks, done
on whole cost matrices with torch). Which node goes where is exact for small swarms (every
ordered choice of owners is tried) and a local search of pairwise swaps (and swaps of two
stages' whole replica groups) from a speed-sorted start beyond that; `SwarmPlan.exact` says which.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ravnest_node.errors import ConfigError

__all__ = [
    "Block",
    "Link",
    "Links",
    "NodeCaps",
    "PlannedStage",
    "SwarmPlan",
    "plan_swarm",
    "step_of",
]

# Ordered choices of owners up to which the search is exhaustive.
EXACT_LIMIT = 2000
# Local searches from a shuffled order after the speed-sorted ones.
RESTARTS = 4
# Relative improvement below which two plans count as equally fast (so fewer stages win).
TIE = 1e-9
# Placements a local search may evaluate in one `plan_swarm` call, all its searches together
# (bench/swarm_size.py): its pairwise swaps are O(nodes^2) a pass, 26,000 evaluations (18 s)
# for 100 heterogeneous members of a 25-stage pipeline, hours for 1,000, and the coordinator
# plans on its event loop. Swarms of a few dozen nodes never reach it.
SEARCH_BUDGET = 3000


@dataclass(frozen=True, slots=True)
class Block:
    compute_s: float
    """Seconds per microbatch (forward + backward) on a node of speed 1."""
    activation_bytes: int
    """Bytes of this block's output per microbatch: what crosses a cut right after it."""
    memory_bytes: int
    """Bytes a node needs to train this block (parameters, gradients, optimizer state, stash)."""


@dataclass(frozen=True, slots=True)
class NodeCaps:
    node_id: str
    speed: float = 1.0
    """A block takes ``compute_s / speed`` here."""
    memory_bytes: float = math.inf


@dataclass(frozen=True, slots=True)
class Link:
    bandwidth_bps: float
    """Bits per second in this direction."""
    rtt_s: float = 0.0


@dataclass(frozen=True)
class Links:
    """What the planner knows of the network: measured directed links, a default for the rest."""

    default: Link = Link(1e9)
    pairs: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    """``(sender, receiver) -> Link``; a pair measured one way only is taken as symmetric."""
    codec_ratio: float = 1.0
    """Bytes on the wire per byte of activation (1.0 for fp32, 0.5 for bf16, ...)."""
    in_flight: int = 4
    """Microbatches in flight on a boundary, over which a round trip is spread."""

    def link(self, sender: str, receiver: str) -> Link:
        found = self.pairs.get((sender, receiver)) or self.pairs.get((receiver, sender))
        return found or self.default

    def boundary_s(self, upstream: str, downstream: str) -> tuple[float, float]:
        """``(seconds per byte, fixed seconds)`` of one microbatch across this boundary: the
        slower direction (activation down, gradient up) and the spread round trip."""
        down, up = self.link(upstream, downstream), self.link(downstream, upstream)
        per_byte = 8 * self.codec_ratio / min(down.bandwidth_bps, up.bandwidth_bps)
        return per_byte, max(down.rtt_s, up.rtt_s) / max(1, self.in_flight)


@dataclass(frozen=True, slots=True)
class PlannedStage:
    first_block: int
    stop_block: int
    owners: tuple[str, ...]
    """The owner in each pipeline, in pipeline order."""
    compute_s: float
    """Seconds per microbatch of the stage's slowest owner."""
    send_s: float
    """Seconds per microbatch across the boundary after this stage (0 for the last)."""


@dataclass(frozen=True, slots=True)
class SwarmPlan:
    stages: tuple[PlannedStage, ...]
    spare: tuple[str, ...]
    step_s: float
    """Seconds per microbatch of each pipeline: the slowest stage or boundary."""
    exact: bool
    """True when every placement was tried, so `step_s` is the optimum."""

    @property
    def bottleneck(self) -> str:
        """What sets `step_s`, in words."""
        for i, stage in enumerate(self.stages):
            if stage.compute_s >= self.step_s:
                return f"compute of stage {i}"
            if stage.send_s >= self.step_s:
                return f"the link after stage {i}"
        return "nothing"  # unreachable for a valid plan

    def blocks_of(self, node_id: str) -> range:
        """The blocks `node_id` owns (empty for a spare)."""
        for stage in self.stages:
            if node_id in stage.owners:
                return range(stage.first_block, stage.stop_block)
        return range(0)


class _Instance:
    """The cost matrices shared by every placement of one problem."""

    def __init__(self, blocks: Sequence[Block], nodes: Sequence[NodeCaps], links: Links) -> None:
        self.n = n = len(blocks)
        self.nodes, self.links = nodes, links
        f64 = torch.float64
        compute = torch.tensor([0.0] + [b.compute_s for b in blocks], dtype=f64).cumsum(0)
        memory = torch.tensor([0.0] + [float(b.memory_bytes) for b in blocks], dtype=f64).cumsum(0)
        # [i, j]: blocks [i, j); meaningful for j > i only.
        self.span_compute = compute[None, :] - compute[:, None]
        self.span_memory = memory[None, :] - memory[:, None]
        self.empty = torch.ones(n + 1, n + 1, dtype=torch.bool).tril()  # j <= i
        # A cut at j (0 < j < n) carries block j-1's output; j = 0 and j = n carry nothing.
        act = [0.0] + [float(b.activation_bytes) for b in blocks[:-1]] + [0.0]
        self.cut_bytes = torch.tensor(act, dtype=f64)
        self.done = torch.full((n + 1,), math.inf, dtype=f64)
        self.done[n] = 0.0
        self.speed = [node.speed for node in nodes]
        self.memory = [node.memory_bytes for node in nodes]
        self._costs: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        self._computes: dict[tuple[int, ...], torch.Tensor] = {}

    def slot_costs(self, slots: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """For each stage slot (its owners' node indices, one per pipeline): the [start, stop]
        matrix of seconds per microbatch of that stage and the boundary after it (inf where
        it does not fit in memory or is empty)."""
        return [
            self._cost(tuple(owners), tuple(slots[s + 1]) if s + 1 < len(slots) else ())
            for s, owners in enumerate(slots)
        ]

    def _cost(self, owners: tuple[int, ...], after: tuple[int, ...]) -> torch.Tensor:
        key = (owners, after)  # a local search asks for the same few pairs again and again
        cost = self._costs.get(key)
        if cost is None:
            if after:
                send = torch.stack(
                    [self.cut_bytes * per_byte + fixed
                     for per_byte, fixed in self.boundaries(owners, after)]
                ).amax(dim=0)  # fmt: skip
                cost = torch.maximum(self._compute(owners), send[None, :])
            else:
                cost = self._compute(owners)
            self._costs[key] = cost
        return cost

    def _compute(self, owners: tuple[int, ...]) -> torch.Tensor:
        cost = self._computes.get(owners)
        if cost is None:
            speed = min(self.speed[v] for v in owners)
            memory = min(self.memory[v] for v in owners)
            too_big = self.empty | (self.span_memory > memory)
            cost = (self.span_compute / speed).masked_fill(too_big, math.inf)
            self._computes[owners] = cost
        return cost

    def boundaries(self, owners: Sequence[int], after: Sequence[int]) -> list[tuple[float, float]]:
        """``(seconds per byte, fixed seconds)`` of each pipeline's link from a stage's owner
        to the next stage's."""
        ids = [node.node_id for node in self.nodes]
        return [self.links.boundary_s(ids[a], ids[b]) for a, b in zip(owners, after, strict=True)]

    @staticmethod
    def best_from(costs: Sequence[torch.Tensor], done: torch.Tensor) -> list[torch.Tensor]:
        """best[s][i]: least slowest-cost of stages s.. when stage s starts at block i."""
        best = [done]
        for cost in reversed(costs):
            best.append(torch.maximum(cost, best[-1][None, :]).amin(dim=1))
        best.reverse()
        return best

    def value(self, order: Sequence[int], stages: int, pipelines: int) -> float:
        costs = self.slot_costs(_slots(order, stages, pipelines))
        return float(self.best_from(costs, self.done)[0][0])

    def build(self, order: Sequence[int], stages: int, pipelines: int, exact: bool) -> SwarmPlan:
        slots = _slots(order, stages, pipelines)
        costs = self.slot_costs(slots)
        optimum = float(self.best_from(costs, self.done)[0][0])
        # Within the stages that allow the optimum (exact: same floats), the least slowest
        # compute: a second min-max programme over the compute of those stages alone.
        computes = [
            self._compute(tuple(owners)).masked_fill(cost > optimum, math.inf)
            for owners, cost in zip(slots, costs, strict=True)
        ]
        best = self.best_from(computes, self.done)
        planned, start = [], 0
        for s, owners in enumerate(slots):
            # The shortest stage that still allows both optima.
            row = torch.maximum(computes[s][start], best[s + 1])
            stop = int(torch.nonzero(row <= best[s][start])[0])
            speed = min(self.speed[v] for v in owners)
            send_s = 0.0
            if s + 1 < len(slots):
                send_s = max(
                    per_byte * float(self.cut_bytes[stop]) + fixed
                    for per_byte, fixed in self.boundaries(owners, slots[s + 1])
                )
            planned.append(
                PlannedStage(
                    first_block=start,
                    stop_block=stop,
                    owners=tuple(self.nodes[v].node_id for v in owners),
                    compute_s=float(self.span_compute[start, stop]) / speed,
                    send_s=send_s,
                )
            )
            start = stop
        used = {v for owners in slots for v in owners}
        spare = tuple(node.node_id for v, node in enumerate(self.nodes) if v not in used)
        return SwarmPlan(tuple(planned), spare, optimum, exact)


def _slots(order: Sequence[int], stages: int, pipelines: int) -> list[list[int]]:
    """Owners of each stage: position ``p * stages + s`` of `order` owns stage s of pipeline p."""
    return [[order[p * stages + s] for p in range(pipelines)] for s in range(stages)]


def _start_order(nodes: Sequence[NodeCaps], stages: int, pipelines: int) -> list[int]:
    """Fastest nodes first (equal speeds in the order given), and nodes of like speed in one
    replica group (a group moves at the pace of its slowest member)."""
    ranked = sorted(range(len(nodes)), key=lambda v: (-nodes[v].speed, v))
    used, rest = ranked[: stages * pipelines], ranked[stages * pipelines :]
    order = [0] * len(used)
    for k, v in enumerate(used):  # group s = ranked[s*P:(s+1)*P], one member per pipeline
        s, p = divmod(k, pipelines)
        order[p * stages + s] = v
    return order + rest


def _local_search(
    inst: _Instance, order: list[int], stages: int, pipelines: int, budget: list[int]
) -> float:
    """Improve `order` in place by pairwise swaps (at least one side used), and by swapping
    two stages' whole replica groups, until none helps or `budget[0]` evaluations are spent.
    (A group swap is many node swaps at once: a group of small-memory nodes holding the stage
    with the largest block cannot get out of it one node at a time, since every single swap
    still leaves one of them there.) Two nodes of equal speed and memory whose links were
    not measured, or two groups of such nodes, are never swapped: the placement's value
    cannot change."""
    used = stages * pipelines
    linked = {n for pair in inst.links.pairs for n in pair}
    kind = [
        (node.speed, node.memory_bytes) if node.node_id not in linked else (v,)
        for v, node in enumerate(inst.nodes)
    ]

    def positions(stage: int) -> list[int]:
        return [p * stages + stage for p in range(pipelines)]

    def swap(a: list[int], b: list[int]) -> None:
        for i, j in zip(a, b, strict=True):
            order[i], order[j] = order[j], order[i]

    def moves() -> Iterator[tuple[list[int], list[int]]]:
        # (Made as they are tried: a thousand nodes have half a million pairs.)
        for a in range(used):
            for b in range(a + 1, len(order)):
                if kind[order[a]] != kind[order[b]]:
                    yield [a], [b]
        if pipelines > 1:
            for x in range(stages):
                for y in range(x + 1, stages):
                    group_x, group_y = positions(x), positions(y)
                    if sorted(kind[order[i]] for i in group_x) != sorted(
                        kind[order[i]] for i in group_y
                    ):
                        yield group_x, group_y

    value = inst.value(order, stages, pipelines)
    improved = True
    while improved:
        improved = False
        for a, b in moves():
            if budget[0] <= 0:
                return value
            budget[0] -= 1
            swap(a, b)
            candidate = inst.value(order, stages, pipelines)
            if candidate < value * (1 - TIE):
                value, improved = candidate, True
            else:
                swap(a, b)
    return value


def plan_swarm(
    blocks: Sequence[Block],
    nodes: Sequence[NodeCaps],
    links: Links | None = None,
    *,
    pipelines: int = 1,
    stages: int | None = None,
    exact_limit: int = EXACT_LIMIT,
) -> SwarmPlan:
    """The fastest placement of `blocks` on `nodes` (see the module docstring).

    `stages` fixes the number of stages per pipeline; by default the planner chooses it (from 1
    to ``len(nodes) // pipelines``). Raises `ConfigError` when no placement fits in memory,
    `ValueError` for malformed input.
    """
    links = links or Links()
    _check(blocks, nodes, links, pipelines, stages)
    inst = _Instance(blocks, nodes, links)
    most = min(len(blocks), len(nodes) // pipelines)
    candidates = [stages] if stages is not None else list(range(1, most + 1))
    choices = sum(math.perm(len(nodes), s * pipelines) for s in candidates)
    exact = choices <= exact_limit
    best: tuple[float, int, list[int]] | None = None
    starts: list[tuple[float, int, list[int]]] = []
    for s in candidates:
        if exact:
            tries = (list(c) for c in itertools.permutations(range(len(nodes)), s * pipelines))
            found = [(inst.value(order, s, pipelines), order) for order in tries]
            value, order = min(found, key=lambda f: f[0])
            order += [v for v in range(len(nodes)) if v not in order]
            if best is None or value < best[0] * (1 - TIE):  # ties: fewer stages
                best = (value, s, order)
        else:
            order = _start_order(nodes, s, pipelines)
            starts.append((inst.value(order, s, pipelines), s, order))
    if not exact:  # local search: the three most promising stage counts, then restarts
        # Starts that do not fit rank after those that do, most stages first: smaller stages
        # fit smaller nodes, so that is where a swap or two most likely makes one fit.
        ranked = sorted(starts, key=lambda r: (r[0], r[1] if math.isfinite(r[0]) else -r[1]))[:3]
        refined = []
        budget = [SEARCH_BUDGET]
        for _, s, order in ranked:
            refined.append((_local_search(inst, order, s, pipelines, budget), s, order))
        rng = random.Random(0)  # restarts are seeded: the same input gives the same plan
        for _ in range(RESTARTS):
            if budget[0] <= 0:
                break
            _, s, order = min(refined, key=lambda r: (r[0], r[1]))
            order = order[:]
            rng.shuffle(order)
            refined.append((_local_search(inst, order, s, pipelines, budget), s, order))
        value = min(r[0] for r in refined)
        best = min((r for r in refined if r[0] <= value * (1 + TIE)), key=lambda r: r[1])
    assert best is not None
    value, s, order = best
    if math.isinf(value):
        biggest = max(b.memory_bytes for b in blocks)
        raise ConfigError(
            f"no placement of {len(blocks)} blocks on {len(nodes)} nodes "
            f"({pipelines} pipeline(s)) fits in memory; the largest block needs {biggest} bytes"
        )
    return inst.build(order, s, pipelines, exact)


def _check(
    blocks: Sequence[Block],
    nodes: Sequence[NodeCaps],
    links: Links,
    pipelines: int,
    stages: int | None,
) -> None:
    if not blocks:
        raise ValueError("no blocks to place")
    for i, b in enumerate(blocks):
        if not (math.isfinite(b.compute_s) and b.compute_s >= 0):
            raise ValueError(f"block {i}: compute_s must be finite and >= 0, not {b.compute_s}")
        if b.activation_bytes < 0 or b.memory_bytes < 0:
            raise ValueError(f"block {i}: byte counts must be >= 0")
    if len({node.node_id for node in nodes}) != len(nodes):
        raise ValueError("node ids must be distinct")
    for node in nodes:
        if not (math.isfinite(node.speed) and node.speed > 0):
            raise ValueError(f"node {node.node_id}: speed must be finite and > 0")
        if not node.memory_bytes >= 0:
            raise ValueError(f"node {node.node_id}: memory_bytes must be >= 0")
    for pair, link in [(None, links.default), *links.pairs.items()]:
        if not (link.bandwidth_bps > 0 and math.isfinite(link.rtt_s) and link.rtt_s >= 0):
            raise ValueError(f"link {pair or 'default'}: bandwidth must be > 0 and rtt >= 0")
    if not (math.isfinite(links.codec_ratio) and links.codec_ratio > 0):
        raise ValueError("codec_ratio must be finite and > 0")
    if pipelines < 1 or len(nodes) < pipelines:
        raise ConfigError(f"{len(nodes)} nodes cannot form {pipelines} pipeline(s)")
    most = min(len(blocks), len(nodes) // pipelines)
    if stages is not None and not 1 <= stages <= most:
        raise ConfigError(
            f"{stages} stages per pipeline is not possible with {len(blocks)} blocks and "
            f"{len(nodes)} nodes in {pipelines} pipeline(s); at most {most}"
        )


def step_of(
    blocks: Sequence[Block],
    nodes: Sequence[NodeCaps],
    links: Links,
    cuts: Sequence[tuple[int, int]],
    owners: Sequence[Sequence[str]],
) -> float:
    """Seconds per microbatch of a given placement: stage s holds blocks ``cuts[s]`` on nodes
    ``owners[s]`` (one per pipeline); inf if a stage does not fit in one of its owners."""
    _check(blocks, nodes, links, max(1, len(owners[0]) if owners else 1), None)
    inst = _Instance(blocks, nodes, links)
    index = {node.node_id: v for v, node in enumerate(nodes)}
    slots = [[index[v] for v in group] for group in owners]
    costs = inst.slot_costs(slots)
    return max(float(cost[start, stop]) for cost, (start, stop) in zip(costs, cuts, strict=True))
