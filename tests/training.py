"""What a run trained, read back from its nodes' checkpoints, and the same training in a plain
PyTorch loop: the references that tests of runs compare parameters against, tensor by tensor.

Runs are bit-for-bit reproducible only at equal torch thread counts: a matrix product summed by
two threads rounds differently from one summed by one (the last bits of the loss, ~1e-7
relative after 12 steps of tiny, grow through AdamW into its moments). So tests that compare
runs give every process the same `--threads`, and the plain loop runs at that count too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ravnest_node.blocks import ROLES, BlockWeights
from ravnest_node.checkpoint import CheckpointDir
from ravnest_node.checkpoint.export import blocks_at
from ravnest_node.devices import torch_threads
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig

Key = tuple[int, str, str]
"""A tensor of a trained model: (block, role in blocks.ROLES, parameter name in the block)."""


@dataclass(frozen=True)
class Trained:
    """A run's loss at each step and every tensor of its blocks at its end (parameters and
    AdamW's moments)."""

    losses: list[float]
    tensors: dict[Key, torch.Tensor]

    def only(self, role: str) -> Trained:
        """The same with only the tensors of `role` ("param", "exp_avg", "exp_avg_sq")."""
        return Trained(self.losses, {k: t for k, t in self.tensors.items() if k[1] == role})


def _keyed(blocks: dict[int, BlockWeights]) -> dict[Key, torch.Tensor]:
    return {(i, role, name): t for i, w in blocks.items() for (role, name), t in w.tensors.items()}


def trained_run(summary: dict[str, Any], state_dirs: Sequence[Path]) -> Trained:
    """A finished run's losses (from its summary) and final tensors (from the checkpoints its
    stages wrote at the run's end in `state_dirs`, every file verified)."""
    model = get_model(summary["model"])
    step, blocks = blocks_at(state_dirs, model)
    assert step == summary["steps"], f"the newest checkpoint is of step {step}"
    return Trained(list(summary["loss_history"]), _keyed(blocks))


def demo_run(summary: dict[str, Any], work_dir: Path) -> Trained:
    """`trained_run` of a `ravnest-node demo` run whose --work-dir was `work_dir`."""
    return trained_run(summary, sorted(work_dir.glob("node-*")))


def final_blocks(state_dirs: Sequence[Path], model_name: str) -> dict[tuple[int, int], Trained]:
    """Each node's newest checkpoint, by (pipeline, stage): its blocks' tensors (no losses),
    so that replicas of a stage can be compared with each other."""
    model = get_model(model_name)
    out = {}
    for state_dir in state_dirs:
        latest = CheckpointDir(state_dir).latest(model)
        if latest is not None:
            manifest, blocks = latest
            out[(manifest.pipeline, manifest.stage)] = Trained([], _keyed(blocks))
    return out


def plain_training(model_name: str, steps: int, *, seed: int = 0, threads: int = 1) -> Trained:
    """The run a swarm trains synchronously in fp32 (`--max-staleness 0 --codec none`, the
    other settings at TrainConfig's defaults), as a plain PyTorch loop in this process at
    `threads` torch threads: the model and its data built from `seed`, each step's batch split
    into microbatches, each microbatch's loss divided by their number and its backward
    accumulated, then one AdamW step. Nothing of the daemon runs in the loop."""
    run = TrainConfig(model=model_name, steps=steps, seed=seed)
    model = get_model(model_name)
    blocks = torch.nn.Sequential(*model.build_blocks(seed))
    optimizer = torch.optim.AdamW(blocks.parameters(), lr=run.lr, weight_decay=run.weight_decay)
    data = model.dataset(seed=seed)
    m, size = run.microbatches, run.microbatch_size
    losses = []
    with torch_threads(threads):
        for step in range(steps):
            x, y = data.batch(step, run.batch_size)
            total = 0.0
            for i in range(m):
                rows = slice(i * size, (i + 1) * size)
                loss = model.loss(blocks(x[rows]), y[rows]) / m
                loss.backward()
                total += loss.item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total)
    tensors: dict[Key, torch.Tensor] = {}
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            state = optimizer.state[p]
            for role, t in zip(ROLES, (p, state["exp_avg"], state["exp_avg_sq"]), strict=True):
                tensors[(i, role, name)] = t.detach().clone()
    return Trained(losses, tensors)


def assert_same_tensors(a: Trained, b: Trained) -> None:
    """The same tensors, every one equal to the bit (torch.equal)."""
    only = sorted(a.tensors.keys() ^ b.tensors.keys())
    assert not only, f"tensors differ: {len(only)} in one run only, e.g. {only[:3]}"
    differ = [k for k in sorted(a.tensors) if not torch.equal(a.tensors[k], b.tensors[k])]
    assert not differ, f"{len(differ)} of {len(a.tensors)} tensors differ, e.g. {differ[:3]}"


def assert_same_training(a: Trained, b: Trained) -> None:
    """The same loss at every step and the same final tensors, to the bit."""
    assert len(a.losses) == len(b.losses), (len(a.losses), len(b.losses))
    pairs = enumerate(zip(a.losses, b.losses, strict=True), 1)
    differ = [(step, x, y) for step, (x, y) in pairs if x != y]
    assert not differ, f"losses differ at {len(differ)} steps, e.g. (step, loss, loss) {differ[:3]}"
    assert_same_tensors(a, b)


def ulps_apart(a: Trained, b: Trained) -> float:
    """The largest difference between two runs' parameters, in float32 steps (units in the
    last place) at the scale of each tensor (its largest magnitude): 0 for equal tensors, 1
    for a difference of the rounding of that tensor's largest element."""
    assert a.tensors.keys() == b.tensors.keys()
    worst = 0.0
    for key, x in a.tensors.items():
        if key[1] != "param":
            continue
        y = b.tensors[key]
        scale = torch.maximum(x.abs().max(), y.abs().max())
        spacing = torch.nextafter(scale, torch.tensor(torch.inf)) - scale
        worst = max(worst, float((x - y).abs().max() / spacing))
    assert not math.isnan(worst), "a NaN in the parameters compared"
    return worst
