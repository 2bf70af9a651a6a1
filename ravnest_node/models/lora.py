"""LoRA adapters and frozen base weights (Hu et al., "LoRA", arXiv 2106.09685).

A pretrained block fine-tuned with LoRA keeps its weights frozen and learns, for each targeted
linear layer ``y = W x + b``, a low-rank correction ``y = W x + b + (alpha / r) B A x`` with
``A`` of shape ``[r, in]`` and ``B`` of shape ``[out, r]``. ``B`` starts at zero, so the
fine-tune starts exactly at the pretrained model.

Frozen weights are *buffers*, not parameters: everything in the swarm that moves or averages
parameters (the optimizer, weight stashing, replica averaging, checkpoints, hand-offs) then
sees only what trains, and a frozen base costs no optimizer state and no averaging bytes. The
base can be kept in bfloat16 or int8 (per output row absmax) to halve or quarter its memory;
it is cast back to float32 for each matmul.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ravnest_node.errors import ConfigError

__all__ = [
    "BASE_DTYPES",
    "FrozenLinear",
    "LoRAConfig",
    "LoRALinear",
    "freeze",
    "seeded_generator",
]

BASE_DTYPES = ("fp32", "bf16", "int8")
"""How a frozen base weight is stored: float32, bfloat16, or int8 with a float32 scale per row."""


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Which linear layers get adapters, and their shape."""

    rank: int
    """Rank r of each adapter (A is [r, in], B is [out, r])."""
    alpha: float
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    targets: tuple[str, ...]
    """Names of the linear layers (their attribute names in a block, e.g. "query", "q_proj")."""
    base: str = "fp32"
    """Storage of the frozen base weights: fp32, bf16 or int8."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"LoRA rank must be at least 1, got {self.rank}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"LoRA alpha must be a positive number, got {self.alpha}")
        if not self.targets:
            raise ConfigError("LoRA needs at least one target module name")
        if self.base not in BASE_DTYPES:
            raise ConfigError(f"base must be one of {', '.join(BASE_DTYPES)}, got {self.base!r}")


def seeded_generator(*key: object) -> torch.Generator:
    """A CPU generator seeded from `key` (e.g. seed, block index, tensor name): the same key gives
    the same numbers on every node, whichever other blocks it builds."""
    digest = hashlib.sha256(":".join(str(k) for k in key).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _store(weight: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`weight` in the storage `base`: (stored, per-row scale or None)."""
    w = weight.detach()
    if base == "bf16":
        return w.to(torch.bfloat16), None
    if base == "int8":
        scale = w.abs().amax(dim=1, keepdim=True).float() / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8), scale
    return w.float().clone(), None


class FrozenLinear(nn.Module):
    """A linear layer whose weight and bias are frozen buffers, stored as `base` says."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, base: str = "fp32") -> None:
        super().__init__()
        stored, scale = _store(linear.weight, base)
        self.register_buffer("weight", stored)
        self.register_buffer("scale", scale)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dense_weight(self) -> torch.Tensor:
        """The weight as float32 (dequantised if stored as int8)."""
        w = self.weight.float()
        return w * self.scale if self.scale is not None else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(), self.bias)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank adapter (B starts at zero)."""

    def __init__(
        self, linear: nn.Linear, cfg: LoRAConfig, generator: torch.Generator
    ) -> None:
        super().__init__()
        self.base = FrozenLinear(linear, cfg.base)
        self.scaling = cfg.alpha / cfg.rank
        bound = 1.0 / math.sqrt(linear.in_features)  # nn.Linear's default init range
        a = torch.rand(cfg.rank, linear.in_features, generator=generator)
        if not a.is_meta:  # (meta: shapes only, base.shapes_only)
            a = (a * 2 - 1) * bound
        self.lora_a = nn.Parameter(a)
        self.lora_b = nn.Parameter(torch.zeros(linear.out_features, cfg.rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        return out + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling

    def merged(self) -> torch.Tensor:
        """The base weight with the adapter folded in: ``W + (alpha / r) B A`` (float32)."""
        with torch.no_grad():
            return self.base.dense_weight() + self.scaling * (self.lora_b @ self.lora_a)


def freeze(block: nn.Module, cfg: LoRAConfig, *, seed: int, index: int, keep: tuple[str, ...] = ()
           ) -> tuple[int, int]:  # fmt: skip
    """Turn `block` into a LoRA block in place: each `nn.Linear` whose attribute name is in
    ``cfg.targets`` becomes a `LoRALinear`, every other one a `FrozenLinear` stored as
    ``cfg.base`` says, and every other parameter becomes a frozen float32 buffer,
    except those inside the submodules or parameters named in `keep` (new heads,
    which must train). Adapters are
    initialised from (seed, block index, module path). Returns (adapters made, parameters that
    still train)."""
    made = 0
    for path, module in list(block.named_modules()):
        for attr, child in list(module.named_children()):
            full = f"{path}.{attr}" if path else attr
            if not isinstance(child, nn.Linear) or _kept(full, keep):
                continue
            if attr in cfg.targets:
                setattr(module, attr, LoRALinear(child, cfg, seeded_generator(seed, index, full)))
                made += 1
            else:
                setattr(module, attr, FrozenLinear(child, cfg.base))
    for path, module in list(block.named_modules()):
        if isinstance(module, LoRALinear):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if _kept(f"{path}.{name}" if path else name, keep):
                continue
            delattr(module, name)
            module.register_buffer(name, param.detach().clone())
    return made, sum(p.numel() for p in block.parameters())


def _kept(path: str, keep: tuple[str, ...]) -> bool:
    return any(path == k or path.startswith(k + ".") for k in keep)
