"""The foundation's plan: contiguous stages balanced by block cost, one node per stage.

A pure function of the model and the members, so it is tested without sockets. The discovery
and negotiation issue replaces it with a planner that also weighs node speed, memory and links.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ravnest_node.coordination.planner import partition
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
    """Stage i (blocks balanced by `model.block_costs()`) goes to members[i]."""
    cuts = partition(model.block_costs(), len(members))
    return pb.Plan(
        epoch=epoch,
        swarm_id=swarm_id,
        run=run,
        stages=[
            pb.StageAssignment(
                index=i, first_block=start, stop_block=stop, node_id=m.node_id, address=m.address
            )
            for i, ((start, stop), m) in enumerate(zip(cuts, members, strict=True))
        ],
    )


def check_plan(plan: pb.Plan, model: BlockModel, node_id: str) -> pb.StageAssignment:
    """This node's stage in a received plan, after checking that the plan is one a node can
    follow: stages numbered in order, contiguous and covering every block, one per node, with
    valid ids and addresses. Raises ConfigError saying what is wrong."""
    stages = plan.stages
    if not 0 < len(stages) <= model.num_blocks():
        raise ConfigError(f"plan has {len(stages)} stages for {model.num_blocks()} blocks")
    expected_start = 0
    for i, s in enumerate(stages):
        if s.index != i or s.first_block != expected_start or s.stop_block <= s.first_block:
            raise ConfigError(f"plan stage {i} is out of order or empty")
        if not valid_node_id(s.node_id):
            raise ConfigError(f"plan stage {i} has an invalid node id")
        split_host_port(s.address)
        expected_start = s.stop_block
    if expected_start != model.num_blocks():
        raise ConfigError(f"plan covers {expected_start} of {model.num_blocks()} blocks")
    if len({s.node_id for s in stages}) != len(stages):
        raise ConfigError("plan gives one node several stages")
    mine = [s for s in stages if s.node_id == node_id]
    if not mine:
        raise ConfigError(f"plan epoch {plan.epoch} has no stage for this node")
    return mine[0]
