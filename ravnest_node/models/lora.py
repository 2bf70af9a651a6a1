"""LoRA adapters and frozen base weights (Hu et al., "LoRA", arXiv 2106.09685).

A pretrained block fine-tuned with LoRA keeps its weights frozen and learns, for each targeted
linear layer ``y = W x + b``, a low-rank correction ``y = W x + b + (alpha / r) B A x`` with
``A`` of shape ``[r, in]`` and ``B`` of shape ``[out, r]``. ``B`` starts at zero, so the
fine-tune starts exactly at the pretrained model.

Frozen weights are *buffers*, not parameters: everything in the swarm that moves or averages
parameters (the optimizer, weight stashing, replica averaging, checkpoints, hand-offs) then
sees only what trains, and a frozen base costs no optimizer state and no averaging bytes. The
base can be kept in bfloat16, int8 (per output row absmax) or 4-bit NF4 (QLoRA: Dettmers et
al., arXiv 2305.14314) to halve, quarter or eighth its memory.

A compact base saves memory while training only if autograd does not keep an expanded copy of
it for the backward: `FrozenMatmul` dequantises the weight into a temporary for the matmul and
saves only the stored tensors, dequantising again for the input's gradient (the frozen weight
gets none). The matmul runs in the input's dtype, or the autocast dtype inside autocast.

NF4 quantisation is torchao's (`NF4Tensor.from_tensor`, block 64, scalers double-quantised in
blocks of 256, as QLoRA): a maintained, pure-torch implementation that runs on the CPU and on
CUDA alike (bitsandbytes' NF4 kernels are CUDA-centric). Its layout (two codes a byte, an int8
scaler per block, a float32 factor per scaler block, their mean) is kept as plain buffers, and
dequantised here with int32 indices into a table of byte pairs: torchao's own dequantisation
expands the codes to int64, 16 bytes of temporaries a weight, too much beside a 24 GB card's
largest matrix. Dequantising the same layout gives the same float32 values as torchao's.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ravnest_node.errors import ConfigError

__all__ = [
    "BASE_DTYPES",
    "NF4_BLOCK",
    "FrozenLinear",
    "FrozenMatmul",
    "LoRAConfig",
    "LoRALinear",
    "dequantise",
    "freeze",
    "nf4_bytes",
    "seeded_generator",
]

BASE_DTYPES = ("fp32", "bf16", "int8", "nf4")
"""How a frozen base weight is stored: float32, bfloat16, int8 with a float32 scale per row, or
NF4 (4 bits a weight, see the module docstring)."""
NF4_BLOCK = 64
"""Weights sharing one NF4 scaler (QLoRA's block size)."""
NF4_SCALER_BLOCK = 256
"""Scalers sharing one float32 factor (QLoRA's double quantisation); a matrix with fewer
blocks, or a number of them not a multiple of this, uses the largest power of two dividing it."""


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
    """Storage of the frozen base weights: fp32, bf16, int8 or nf4."""

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


def nf4_scaler_block(numel: int) -> int:
    """Scalers per float32 factor for a matrix of `numel` weights (`NF4_SCALER_BLOCK` or the
    largest power of two below it that divides its number of blocks)."""
    blocks, size = numel // NF4_BLOCK, NF4_SCALER_BLOCK
    while blocks % size:
        size //= 2
    return size


def nf4_bytes(numel: int) -> int:
    """Bytes an NF4 base takes for a matrix of `numel` weights: two codes a byte, an int8 scaler
    per block, a float32 factor per scaler block, a float32 mean and the 16-entry codebook."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + 4 * (blocks // nf4_scaler_block(numel)) + 4 + 16 * 4


def _nf4_module() -> Any:
    """torchao's NF4 module, imported on first use (1 s; it logs two warnings about optional
    CUDA extensions it cannot load, which say nothing about NF4: silenced here)."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        return importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _store(weight: torch.Tensor, base: str) -> list[torch.Tensor | None]:
    """`weight` in the storage `base`: the stored tensors, in `dequantise`'s order (the weight,
    then its scales: none for fp32 and bf16, a float32 per row for int8, the int8 block
    scalers, float32 factors, mean and codebook for nf4)."""
    w = weight.detach()
    if base == "bf16":
        return [w.to(torch.bfloat16), None]
    if base == "int8":
        scale = w.abs().amax(dim=1, keepdim=True).float() / 127.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return [torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8), scale]
    if base == "nf4":
        return _store_nf4(w)
    return [w.float().clone(), None]


def _store_nf4(w: torch.Tensor) -> list[torch.Tensor | None]:
    n = w.numel()
    if n % NF4_BLOCK:
        raise ConfigError(
            f"an nf4 base stores weights in blocks of {NF4_BLOCK}: a {tuple(w.shape)} matrix "
            f"has {n} weights, not a multiple; use another base"
        )
    blocks, scaler_block = n // NF4_BLOCK, nf4_scaler_block(n)
    if w.is_meta:  # shapes only (base.shapes_only): no arithmetic on a meta tensor
        return [torch.empty(n // 2, dtype=torch.uint8), torch.empty(blocks, dtype=torch.int8),
                torch.empty(blocks // scaler_block), torch.empty(()), torch.empty(16)]  # fmt: skip
    q = _nf4_module().NF4Tensor.from_tensor(w.float().contiguous(), NF4_BLOCK, scaler_block)
    return [q.quantized_data, q.quantized_scalers, q.quantization_factor,
            q.scaler_mean.reshape(()), q.nf4]  # fmt: skip


def dequantise(
    base: str, stored: Sequence[torch.Tensor], shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """The weight of `shape` stored as `base` says (`_store`'s tensors), as `dtype`. A new
    tensor unless the stored one already is `dtype` (fp32 into float32, bf16 into bfloat16)."""
    w = stored[0]
    if base == "int8":
        if dtype == torch.float32:  # as before a compute dtype existed: exact for fp32
            return w.float() * stored[1]
        return w.to(dtype).mul_(stored[1].to(dtype))
    if base == "nf4":
        codes, scalers, factors, mean, codebook = stored
        # Byte b holds codes b >> 4 and b & 15, in that order.
        pairs = torch.stack((codebook.repeat_interleave(16), codebook.repeat(16)), dim=1)
        out = pairs.to(dtype)[codes.int()]
        size = scalers.numel() // factors.numel()
        scale = (scalers.view(-1, size) / factors.unsqueeze(-1)).flatten() + mean
        out.view(scalers.numel(), -1).mul_(scale.to(dtype).unsqueeze(-1))
        return out.view(shape)
    return w.to(dtype)


class FrozenMatmul(torch.autograd.Function):
    """``F.linear(x, W, bias)`` for a frozen `W` stored compactly: autograd keeps the stored
    tensors, not `W` (nor `x`: the frozen weight takes no gradient), and the backward
    dequantises `W` again. Computes in the autocast dtype inside autocast, else in `x`'s."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, base: str, shape: torch.Size,
        *stored: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        ctx.base, ctx.shape, ctx.dtype, ctx.x_dtype = base, shape, dtype, x.dtype
        ctx.save_for_backward(*stored)
        with torch.autocast(kind, enabled=False):
            w = dequantise(base, stored, shape, dtype)
            return F.linear(x.to(dtype), w, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        nones: tuple[None, ...] = (None,) * (3 + len(ctx.saved_tensors))
        if not ctx.needs_input_grad[0]:
            return (None, *nones)
        w = dequantise(ctx.base, ctx.saved_tensors, ctx.shape, ctx.dtype)
        return (grad.to(ctx.dtype).matmul(w).to(ctx.x_dtype), *nones)


class FrozenLinear(nn.Module):
    """A linear layer whose weight and bias are frozen buffers, stored as `base` says."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, base: str = "fp32") -> None:
        super().__init__()
        stored = _store(linear.weight, base)
        self.register_buffer("weight", stored[0])
        self.register_buffer("scale", stored[1])
        self._extra = ("nf4_factor", "nf4_mean", "nf4_codebook")[: len(stored) - 2]
        for name, tensor in zip(self._extra, stored[2:], strict=True):
            self.register_buffer(name, tensor)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)
        self.base = base
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def stored(self) -> list[torch.Tensor]:
        """The tensors the weight is stored in (`dequantise`'s `stored`)."""
        names = ("weight", "scale", *self._extra)
        return [t for t in (getattr(self, n) for n in names) if t is not None]

    def dense_weight(self) -> torch.Tensor:
        """The weight as float32 (dequantised if stored as int8 or nf4)."""
        shape = torch.Size((self.out_features, self.in_features))
        return dequantise(self.base, self.stored(), shape, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.base == "fp32":  # autograd keeps the buffer itself: no copy to avoid
            return F.linear(x, self.weight, self.bias)
        shape = torch.Size((self.out_features, self.in_features))
        out: torch.Tensor = FrozenMatmul.apply(x, self.bias, self.base, shape, *self.stored())  # type: ignore[no-untyped-call]
        return out


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank adapter (B starts at zero)."""

    def __init__(self, linear: nn.Linear, cfg: LoRAConfig, generator: torch.Generator) -> None:
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


def freeze(block: nn.Module, cfg: LoRAConfig, *, seed: int, index: int, keep: tuple[str, ...] = (),
           fill: Callable[[str, nn.Linear], None] | None = None,
           device: torch.device | None = None) -> tuple[int, int]:  # fmt: skip
    """Turn `block` into a LoRA block in place: each `nn.Linear` whose attribute name is in
    ``cfg.targets`` becomes a `LoRALinear`, every other one a `FrozenLinear` stored as
    ``cfg.base`` says, and every other parameter becomes a frozen float32 buffer,
    except those inside the submodules or parameters named in `keep` (new heads,
    which must train). Adapters are
    initialised from (seed, block index, module path). With `fill` (a loader that reads one
    tensor at a time into a block built on the meta device), ``fill(path, linear)`` gives each
    linear layer its values just before it is replaced, and each replacement goes to `device`
    as soon as it is made: one linear layer's float32 weight at a time on the host. Returns
    (adapters made, parameters that still train)."""
    made = 0
    for path, module in list(block.named_modules()):
        for attr, child in list(module.named_children()):
            full = f"{path}.{attr}" if path else attr
            if not isinstance(child, nn.Linear) or _kept(full, keep):
                continue
            if fill is not None:
                fill(full, child)
            if attr in cfg.targets:
                frozen: nn.Module = LoRALinear(child, cfg, seeded_generator(seed, index, full))
                made += 1
            else:
                frozen = FrozenLinear(child, cfg.base)
            setattr(module, attr, frozen if device is None else frozen.to(device))
            if fill is not None:  # the list above holds `child`: let go of its values now
                child.to("meta")
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
