"""Moving blocks between plans: a block's weights and AdamW moments, out of one stage and into
another, over `Node.FetchBlock`.

When a plan ends at step S (docs/discovery.md, "Re-planning"), every node keeps the blocks it
trained, as they were after step S, and serves them to the members of the next plan. A node
that gains a block fetches it from the node that held it; a block it keeps stays local. What
arrives is checked against the block the receiver built for itself (every parameter present,
named and shaped as expected, float32, the right number of bytes) before anything is copied:
a wrong message is refused whole and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ravnest_node.errors import PeerRefused
from ravnest_node.proto import control_pb2 as pb

ROLES = ("param", "exp_avg", "exp_avg_sq")
DTYPE = "float32"


@dataclass(frozen=True, slots=True)
class BlockWeights:
    """One block after `version` optimizer steps: its parameters and, once it has taken a step,
    AdamW's moments; tensors are float32 copies, keyed by (role, parameter name in the block)."""

    block: int
    version: int
    optimizer_step: float
    tensors: Mapping[tuple[str, str], torch.Tensor]


def export_blocks(
    blocks: torch.nn.Sequential, first_block: int, optimizer: torch.optim.Optimizer, version: int
) -> dict[int, BlockWeights]:
    """Copies of each block of a stage (on the compute thread, between steps)."""
    out: dict[int, BlockWeights] = {}
    with torch.no_grad():
        for i, block in enumerate(blocks):
            tensors: dict[tuple[str, str], torch.Tensor] = {}
            step = 0.0
            for name, p in block.named_parameters():
                tensors[("param", name)] = p.detach().to(torch.float32).clone()
                state = optimizer.state.get(p, {})
                if "exp_avg" in state:
                    tensors[("exp_avg", name)] = state["exp_avg"].to(torch.float32).clone()
                    tensors[("exp_avg_sq", name)] = state["exp_avg_sq"].to(torch.float32).clone()
                    step = float(state["step"])
            out[first_block + i] = BlockWeights(first_block + i, version, step, tensors)
    return out


def restore_blocks(
    blocks: torch.nn.Sequential,
    first_block: int,
    optimizer: torch.optim.Optimizer,
    states: Mapping[int, BlockWeights],
) -> None:
    """Load `states` (checked by `from_proto`, or exported here) into a stage's blocks and its
    fresh optimizer; blocks without a state keep their initial weights."""
    with torch.no_grad():
        for i, block in enumerate(blocks):
            state = states.get(first_block + i)
            if state is None:
                continue
            for name, p in block.named_parameters():
                p.copy_(state.tensors[("param", name)])
                if ("exp_avg", name) in state.tensors:
                    optimizer.state[p] = {
                        "step": torch.tensor(state.optimizer_step, dtype=torch.float32),
                        "exp_avg": state.tensors[("exp_avg", name)].clone(),
                        "exp_avg_sq": state.tensors[("exp_avg_sq", name)].clone(),
                    }


def to_proto(weights: BlockWeights) -> pb.BlockState:
    return pb.BlockState(
        block=weights.block,
        version=weights.version,
        optimizer_step=weights.optimizer_step,
        tensors=[
            pb.TensorData(
                name=name,
                role=role,
                dtype=DTYPE,
                shape=list(t.shape),
                data=t.contiguous().numpy().astype("<f4", copy=False).tobytes(),
            )
            for (role, name), t in weights.tensors.items()
        ],
    )


def from_proto(
    message: pb.BlockState, *, block: torch.nn.Module, index: int, version: int, source: str
) -> BlockWeights:
    """Check a fetched block against the receiver's own copy of it (`block`, freshly built) and
    the step the plan starts at; PeerRefused naming `source` and what is wrong otherwise."""

    def refuse(what: str) -> PeerRefused:
        return PeerRefused(f"block {index} from {source}: {what}")

    if message.block != index:
        raise refuse(f"it is block {message.block}")
    if message.version != version:
        raise refuse(f"it is at step {message.version}, the plan starts at {version}")
    shapes = block_shapes(block)
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    for t in message.tensors:
        key = (t.role, t.name)
        if t.role not in ROLES or t.name not in shapes:
            raise refuse(f"unknown tensor {t.role} {t.name[:80]!r}")
        if key in tensors:
            raise refuse(f"{t.role} {t.name} twice")
        if t.dtype != DTYPE:
            raise refuse(f"{t.role} {t.name} is {t.dtype[:20]!r}, not {DTYPE}")
        if tuple(t.shape) != shapes[t.name]:
            raise refuse(f"{t.role} {t.name} has shape {list(t.shape)}, not {list(shapes[t.name])}")
        expected = 4 * int(np.prod(shapes[t.name], dtype=np.int64))
        if len(t.data) != expected:
            raise refuse(f"{t.role} {t.name} has {len(t.data)} bytes, not {expected}")
        values = np.frombuffer(t.data, dtype="<f4").reshape(shapes[t.name])
        tensors[key] = torch.from_numpy(values.astype(np.float32))
    return check_block(
        tensors, shapes=shapes, index=index, version=version,
        optimizer_step=message.optimizer_step, refuse=refuse,
    )  # fmt: skip


def block_shapes(block: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of a block (a block built on the meta device will do)."""
    return {name: tuple(p.shape) for name, p in block.named_parameters()}


def check_block(
    tensors: dict[tuple[str, str], torch.Tensor],
    *,
    shapes: Mapping[str, tuple[int, ...]],
    index: int,
    version: int,
    optimizer_step: float,
    refuse: Callable[[str], Exception],
) -> BlockWeights:
    """The checks every block state passes before it is used, wherever it came from (a peer, a
    checkpoint): exactly the block's parameters, float32 and of their shapes, AdamW moments for
    all of them or none, a whole optimizer step count, every value finite, second moments not
    negative. Raises `refuse(what is wrong)`."""
    for role, name in tensors:
        if role not in ROLES or name not in shapes:
            raise refuse(f"unknown tensor {role} {name[:80]!r}")
        t = tensors[(role, name)]
        if t.dtype != torch.float32:
            raise refuse(f"{role} {name} is {t.dtype}, not {DTYPE}")
        if tuple(t.shape) != shapes[name]:
            raise refuse(f"{role} {name} has shape {list(t.shape)}, not {list(shapes[name])}")
    for name in shapes:
        if ("param", name) not in tensors:
            raise refuse(f"parameter {name} is missing")
    moments = len(tensors) > len(shapes)
    if moments and len(tensors) != len(ROLES) * len(shapes):
        raise refuse("optimizer moments for only some parameters")
    step = optimizer_step
    if moments and not (math.isfinite(step) and step >= 1 and step.is_integer()):
        raise refuse(f"optimizer step {step}")
    for (role, name), values_t in tensors.items():
        if not bool(torch.isfinite(values_t).all()):
            raise refuse(f"{role} {name} is not finite")
        if role == "exp_avg_sq" and bool((values_t < 0).any()):
            raise refuse(f"{role} {name} has negative values")
    return BlockWeights(index, version, optimizer_step if moments else 0.0, tensors)
