"""The foundation's plan: contiguous stages balanced by block cost, one node per stage.

A pure function of the model and the members, so it is tested without sockets. The discovery
and negotiation issue replaces it with a planner that also weighs node speed, memory and links.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ravnest_node.coordination.planning.planner import partition
from ravnest_node.errors import ConfigError
from ravnest_node.models import BlockModel
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.state import valid_node_id
from ravnest_node.transport.options import split_host_port


@dataclass(frozen=True, slots=True)
class Member:
    node_id: str
    address: str


def static_plan(
    *,
    epoch: int,
    swarm_id: str,
    model: BlockModel,
    members: Sequence[Member],
    run: pb.RunSpec,
) -> pb.Plan:
    """`run.pipelines` pipelines of len(members) / pipelines stages each (blocks balanced by
    `model.block_costs()`, the same cut in every pipeline). Member j owns stage j % S of
    pipeline j // S; stages with the same index in different pipelines form a replica group."""
    pipelines = max(1, run.pipelines)
    if len(members) % pipelines:
        raise ConfigError(f"{len(members)} nodes cannot form {pipelines} equal pipelines")
    per_pipeline = len(members) // pipelines
    cuts = partition(model.block_costs(), per_pipeline)
    return pb.Plan(
        epoch=epoch,
        swarm_id=swarm_id,
        run=run,
        stages=[
            pb.StageAssignment(
                pipeline=j // per_pipeline,
                index=j % per_pipeline,
                first_block=cuts[j % per_pipeline][0],
                stop_block=cuts[j % per_pipeline][1],
                node_id=m.node_id,
                address=m.address,
            )
            for j, m in enumerate(members)
        ],
    )


def check_plan(plan: pb.Plan, model: BlockModel, node_id: str) -> pb.StageAssignment:
    """This node's stage in a received plan, after checking that the plan is one a node can
    follow: `run.pipelines` pipelines listed in order, each with its stages numbered in order,
    contiguous, covering every block and cut the same way; one stage per node, with valid ids
    and addresses. Raises ConfigError saying what is wrong."""
    stages = plan.stages
    pipelines = max(1, plan.run.pipelines)
    if not stages or len(stages) % pipelines:
        raise ConfigError(f"plan has {len(stages)} stages for {pipelines} pipelines")
    per_pipeline = len(stages) // pipelines
    if per_pipeline > model.num_blocks():
        raise ConfigError(f"plan has {per_pipeline} stages for {model.num_blocks()} blocks")
    expected_start = 0
    for j, s in enumerate(stages):
        p, i = divmod(j, per_pipeline)
        if i == 0:
            expected_start = 0
        first = stages[i]
        if s.pipeline != p or s.index != i or s.first_block != expected_start:
            raise ConfigError(f"plan stage {i} of pipeline {p} is out of order")
        if s.stop_block <= s.first_block or s.stop_block != first.stop_block:
            raise ConfigError(f"plan stage {i} of pipeline {p} is empty or cut differently")
        if not valid_node_id(s.node_id):
            raise ConfigError(f"plan stage {i} of pipeline {p} has an invalid node id")
        split_host_port(s.address)
        expected_start = s.stop_block
        if i == per_pipeline - 1 and expected_start != model.num_blocks():
            raise ConfigError(f"plan covers {expected_start} of {model.num_blocks()} blocks")
    if len({s.node_id for s in stages}) != len(stages):
        raise ConfigError("plan gives one node several stages")
    mine = [s for s in stages if s.node_id == node_id]
    if not mine:
        raise ConfigError(f"plan epoch {plan.epoch} has no stage for this node")
    return mine[0]


def has_node(stages: Iterable[pb.StageAssignment], node_id: str) -> bool:
    """`node_id` owns one of `stages` (a plan's stages, or its `previous`)."""
    return any(s.node_id == node_id for s in stages)


def dials_back(upstream: pb.StageAssignment, downstream: pb.StageAssignment) -> bool:
    """The downstream stage opens their boundary stream (BoundaryBack), straight to the
    upstream's node: it is behind NAT (reached through a relay) and the upstream's node is not.
    Otherwise the upstream opens it at the downstream's address, as always."""
    return downstream.relayed and not upstream.relayed


def same_stages(a: pb.Plan, b: pb.Plan) -> bool:
    """`a` and `b` give the same blocks to the same nodes (addresses aside)."""

    def key(plan: pb.Plan) -> list[tuple[int, int, int, int, str]]:
        return sorted((s.pipeline, s.index, s.first_block, s.stop_block, s.node_id)
                      for s in plan.stages)  # fmt: skip

    return key(a) == key(b)


def stage_at(plan: pb.Plan, pipeline: int, index: int) -> pb.StageAssignment | None:
    """Stage `index` of `pipeline` in a checked plan, or None past either end."""
    per_pipeline = len(plan.stages) // max(1, plan.run.pipelines)
    if not 0 <= index < per_pipeline:
        return None
    return plan.stages[pipeline * per_pipeline + index]


def replica_group(plan: pb.Plan, me: pb.StageAssignment) -> list[pb.StageAssignment]:
    """The owners of my stage in every pipeline (me included), in pipeline order."""
    group = [stage_at(plan, p, me.index) for p in range(max(1, plan.run.pipelines))]
    return [s for s in group if s is not None]
