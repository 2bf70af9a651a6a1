"""tiny-mlp: a small MLP that learns to imitate a fixed random "teacher" network.

What ravnest-node needs of a model (ravnest_node/models/base.py has the whole contract):
an ordered list of blocks, one tensor in and one out each, built deterministically from a
seed; the specs of what enters, leaves and crosses every cut; a loss; and a data set that is a
pure function of its arguments, so that every node computes the same thing.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from ravnest_node import BlockModel, ConfigError, TensorSpec

IN_FEATURES = 16
WIDTH = 64
OUT_FEATURES = 4
HIDDEN_BLOCKS = 4


class Residual(nn.Module):
    """x + Linear(GELU(LayerNorm(x))): a block whose output has its input's shape."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.linear(nn.functional.gelu(self.norm(x)))
        return out


class TeacherData:
    """Inputs drawn from a normal distribution and the outputs of a random teacher network on
    them: a pure function of (seed, shard, num_shards, step, batch_size)."""

    def __init__(self, *, seed: int, shard: int, num_shards: int) -> None:
        self.seed, self.shard, self.num_shards = seed, shard, num_shards
        gen = torch.Generator().manual_seed(seed)
        self.teacher_in = torch.randn(IN_FEATURES, WIDTH, generator=gen) / IN_FEATURES**0.5
        self.teacher_out = torch.randn(WIDTH, OUT_FEATURES, generator=gen) / WIDTH**0.5
        self.num_samples = 0  # fresh samples every step

    @property
    def fingerprint(self) -> str:
        """What nodes compare to check that they draw the same data: the teacher's hash."""
        digest = hashlib.sha256(self.teacher_in.numpy().tobytes())
        digest.update(self.teacher_out.numpy().tobytes())
        return digest.hexdigest()[:16]

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs [batch_size, IN_FEATURES] and targets [batch_size, OUT_FEATURES] of `step`."""
        key = f"{self.seed}:{self.shard}/{self.num_shards}:{step}:{batch_size}".encode()
        gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8]))
        x = torch.randn(batch_size, IN_FEATURES, generator=gen)
        return x, torch.tanh(x @ self.teacher_in) @ self.teacher_out

    def sample_ids(self, step: int, batch_size: int) -> list[int]:
        """No fixed data set: samples have no ids."""
        return []


class TinyMLP(BlockModel):
    """Input projection, HIDDEN_BLOCKS residual blocks, output head: 6 blocks to cut."""

    name = "tiny-mlp"

    def _block(self, i: int) -> nn.Module:
        if i == 0:
            return nn.Linear(IN_FEATURES, WIDTH)
        if i <= HIDDEN_BLOCKS:
            return Residual(WIDTH)
        return nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, OUT_FEATURES))

    def build_blocks(self, seed: int) -> list[nn.Module]:
        # Every node builds all blocks in order from the run's seed, so that the parameters
        # are the same whichever blocks it keeps; the caller's RNG is left alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return [self._block(i) for i in range(self.num_blocks())]

    def num_blocks(self) -> int:
        return HIDDEN_BLOCKS + 2

    def block_costs(self) -> list[float]:
        # Relative forward FLOPs per sample: what the planner balances stages by.
        hidden = [float(WIDTH * WIDTH)] * HIDDEN_BLOCKS
        return [float(IN_FEATURES * WIDTH), *hidden, float(WIDTH * OUT_FEATURES)]

    def input_spec(self, batch: int) -> TensorSpec:
        return TensorSpec("features", (batch, IN_FEATURES), torch.float32)

    def output_spec(self, block: int, batch: int) -> TensorSpec:
        if not 0 <= block < self.num_blocks():
            raise ValueError(f"block {block} out of range [0, {self.num_blocks()})")
        if block == self.num_blocks() - 1:
            return TensorSpec("prediction", (batch, OUT_FEATURES), torch.float32)
        return TensorSpec("hidden", (batch, WIDTH), torch.float32)

    def target_spec(self, batch: int) -> TensorSpec:
        return TensorSpec("targets", (batch, OUT_FEATURES), torch.float32)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, targets)

    def dataset(
        self, *, seed: int, shard: int = 0, num_shards: int = 1, num_samples: int = 0
    ) -> TeacherData:
        if num_samples:
            raise ConfigError("tiny-mlp draws fresh samples every step: no --dataset-samples")
        return TeacherData(seed=seed, shard=shard, num_shards=num_shards)


def make_model() -> TinyMLP:
    """The entry point (pyproject.toml): a fresh model, no arguments."""
    return TinyMLP()
