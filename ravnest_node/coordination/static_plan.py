"""The foundation's plan: contiguous stages balanced by block cost, one node per stage.

A pure function of the model and the members, so it is tested without sockets. The discovery
and negotiation issue replaces it with a planner that also weighs node speed, memory and links.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ravnest_node.coordination.planner import partition
from ravnest_node.models import BlockModel
from ravnest_node.proto import control_pb2 as pb


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
