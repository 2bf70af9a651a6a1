"""Block state: one block's weights and AdamW moments, as a stage exports them and every
consumer (a checkpoint, a peer fetching the block, `export`) takes them in.

Below both `checkpoint` and `pipeline`: a stage exports and restores block state
(`export_blocks`, `restore_blocks`), checkpoints write and verify it, a hand-over moves it
between plans (pipeline/handoff.py), and `check_block` is the one set of checks all of them
pass before anything is used.

Block state is always on the CPU: a stage on a GPU exports CPU copies and restores onto its own
device, so a checkpoint or hand-over from a GPU node resumes on a CPU node and back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

ROLES = ("param", "exp_avg", "exp_avg_sq")
"""The tensors of a block's parameter: its value and AdamW's two moments."""
DTYPE = "float32"


@dataclass(frozen=True, slots=True)
class BlockWeights:
    """One block after `version` optimizer steps: its parameters and, once it has taken a step,
    AdamW's moments; tensors are float32 CPU copies, keyed by (role, parameter name in the
    block)."""

    block: int
    version: int
    optimizer_step: float
    tensors: Mapping[tuple[str, str], torch.Tensor]


def export_blocks(
    blocks: torch.nn.Sequential, first_block: int, optimizer: torch.optim.Optimizer, version: int
) -> dict[int, BlockWeights]:
    """CPU copies of each block of a stage, wherever its tensors are (on the compute thread,
    between steps)."""
    out: dict[int, BlockWeights] = {}
    with torch.no_grad():
        for i, block in enumerate(blocks):
            tensors: dict[tuple[str, str], torch.Tensor] = {}
            step = 0.0
            for name, p in block.named_parameters():
                tensors[("param", name)] = _cpu_copy(p.detach())
                state = optimizer.state.get(p, {})
                if "exp_avg" in state:
                    tensors[("exp_avg", name)] = _cpu_copy(state["exp_avg"])
                    tensors[("exp_avg_sq", name)] = _cpu_copy(state["exp_avg_sq"])
                    step = float(state["step"])
            out[first_block + i] = BlockWeights(first_block + i, version, step, tensors)
    return out


def restore_blocks(
    blocks: torch.nn.Sequential,
    first_block: int,
    optimizer: torch.optim.Optimizer,
    states: Mapping[int, BlockWeights],
) -> None:
    """Load `states` (checked by `BlockAssembler`, or exported here) into a stage's blocks and its
    fresh optimizer, onto the device each parameter is on; blocks without a state keep their
    initial weights."""
    with torch.no_grad():
        for i, block in enumerate(blocks):
            state = states.get(first_block + i)
            if state is None:
                continue
            for name, p in block.named_parameters():
                p.copy_(state.tensors[("param", name)])
                if ("exp_avg", name) in state.tensors:
                    optimizer.state[p] = {
                        "step": _step_tensor(optimizer, p, state.optimizer_step),
                        "exp_avg": _device_copy(state.tensors[("exp_avg", name)], p.device),
                        "exp_avg_sq": _device_copy(state.tensors[("exp_avg_sq", name)], p.device),
                    }


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A float32 copy of `t` on the CPU (a new tensor even where `t` is one already)."""
    return t.to(device="cpu", dtype=torch.float32, copy=True)


def _device_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of `t` on `device` (a new tensor even where `t` is there already)."""
    return t.to(device=device, copy=True)


def _step_tensor(optimizer: torch.optim.Optimizer, p: torch.Tensor, step: float) -> torch.Tensor:
    """AdamW's step count for `p` where its kernel wants it: on the parameter's device for the
    fused and capturable kernels, a CPU scalar otherwise (as torch's own AdamW creates it)."""
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    on_device = bool(group.get("fused") or group.get("capturable"))
    return torch.tensor(step, dtype=torch.float32, device=p.device if on_device else "cpu")


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
