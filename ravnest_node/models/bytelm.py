"""A byte-level decoder-only transformer language model, written as blocks.

Vocabulary 256 (raw bytes), learned positional embeddings, pre-norm transformer layers
(LayerNorm, causal self-attention, LayerNorm, GELU MLP, residuals), final LayerNorm and an untied
linear head. No dropout, so training is deterministic. Blocks, in order:

* block 0: embedding, token ids ``[B, T]`` (uint8 or int64) -> hidden ``[B, T, d_model]``;
* blocks 1..n_layers: one transformer layer each, hidden -> hidden;
* last block: head (final LayerNorm + linear), hidden -> logits ``[B, T, 256]`` float32.

Presets: ``tiny`` (fast tests), ``small``, and ``bench-small`` (the benchmark workload of
BENCHMARKS.md, about 4.9 M parameters).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ravnest_node.errors import ConfigError
from ravnest_node.models.base import BlockModel, TensorSpec, build_seeded

__all__ = ["VOCAB_SIZE", "ByteBlocks", "ByteLM", "ByteLMConfig"]

VOCAB_SIZE = 256
"""One token per byte value."""

_INIT_STD = 0.02  # GPT-2 initialisation


@dataclass(kw_only=True, frozen=True, slots=True)
class ByteLMConfig:
    """Shape of a `ByteLM`."""

    d_model: int
    """Width of the hidden state (the tensor that crosses every stage boundary)."""
    n_layers: int
    """Number of transformer layers (one block each)."""
    n_heads: int
    """Attention heads per layer; must divide `d_model`."""
    seq_len: int
    """Sequence length in bytes (also the number of learned positions)."""
    mlp_ratio: int = 4
    """Width of the MLP's hidden layer, as a multiple of `d_model`."""

    def __post_init__(self) -> None:
        for field in ("d_model", "n_layers", "n_heads", "seq_len", "mlp_ratio"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ByteLMConfig.{field} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"ByteLMConfig.n_heads ({self.n_heads}) must divide d_model ({self.d_model}); "
                f"try n_heads in {[h for h in range(1, self.d_model + 1) if self.d_model % h == 0]}"
            )


class Embedding(nn.Module):
    """Token + learned position embedding: token ids [B, T] -> hidden [B, T, d_model]."""

    def __init__(self, cfg: ByteLMConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.positions = nn.Embedding(cfg.seq_len, cfg.d_model)
        nn.init.normal_(self.tokens.weight, std=_INIT_STD)
        nn.init.normal_(self.positions.weight, std=_INIT_STD)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq, max_seq = tokens.shape[1], self.positions.num_embeddings
        if seq > max_seq:
            raise ValueError(f"a sequence of {seq} tokens is longer than the model's {max_seq}")
        ids = tokens.long()
        pos = torch.arange(seq, device=tokens.device)
        out: torch.Tensor = self.tokens(ids) + self.positions(pos)
        return out


class TransformerLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(ln(x)), then x + mlp(ln(x)); [B, T, d] -> [B, T, d]."""

    def __init__(self, cfg: ByteLMConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln_attn = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.ln_mlp = nn.LayerNorm(d)
        self.mlp_in = nn.Linear(d, cfg.mlp_ratio * d)
        self.mlp_out = nn.Linear(cfg.mlp_ratio * d, d)
        # GPT-2: residual projections scaled down with depth so the residual stream stays O(1).
        residual_std = _INIT_STD / math.sqrt(2 * cfg.n_layers)
        for linear, std in (
            (self.qkv, _INIT_STD),
            (self.attn_out, residual_std),
            (self.mlp_in, _INIT_STD),
            (self.mlp_out, residual_std),
        ):
            nn.init.normal_(linear.weight, std=std)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        head_dim = d // self.n_heads
        q, k, v = self.qkv(self.ln_attn(x)).split(d, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(batch, seq, d))
        out: torch.Tensor = x + self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x))))
        return out


class Head(nn.Module):
    """Final LayerNorm and untied linear head: hidden [B, T, d] -> logits [B, T, 256]."""

    def __init__(self, cfg: ByteLMConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.linear = nn.Linear(cfg.d_model, VOCAB_SIZE)
        nn.init.normal_(self.linear.weight, std=_INIT_STD)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(self.ln(x))
        return out


class ByteBlocks(BlockModel):
    """What every byte-level language model of blocks shares: token ids ``[B, seq_len]`` in
    (uint8), hidden ``[B, seq_len, width]`` between blocks, logits over the 256 byte values
    out of the last block, mean cross entropy against the next bytes; blocks built in order
    from a seed (`build_seeded`). A subclass says its `seq_len`, `width`, `num_blocks` and
    how block i is made (`_block`)."""

    vocab_size = VOCAB_SIZE

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """Tokens (bytes) per sample."""

    @property
    @abstractmethod
    def width(self) -> int:
        """Elements per token of the hidden tensor between blocks."""

    @abstractmethod
    def _block(self, i: int) -> nn.Module:
        """Block `i`, freshly initialised from the global RNG."""

    def build_blocks(self, seed: int) -> list[nn.Module]:
        return build_seeded(seed, self._block, 0, self.num_blocks())

    def build_stage(
        self, seed: int, start: int, stop: int, *, device: torch.device | None = None
    ) -> list[nn.Module]:
        self.check_range(start, stop)
        return build_seeded(seed, self._block, start, stop, device)

    def input_spec(self, batch: int) -> TensorSpec:
        return TensorSpec("tokens", (batch, self.seq_len), torch.uint8)

    def output_spec(self, block: int, batch: int) -> TensorSpec:
        last = self.num_blocks() - 1
        if not 0 <= block <= last:
            raise ValueError(f"block {block} is out of range; {self.name!r} has blocks 0..{last}")
        if block == last:
            return TensorSpec("logits", (batch, self.seq_len, VOCAB_SIZE), torch.float32)
        return TensorSpec("hidden", (batch, self.seq_len, self.width), torch.float32)

    def target_spec(self, batch: int) -> TensorSpec:
        return TensorSpec("targets", (batch, self.seq_len), torch.uint8)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over all positions; `targets` are byte values [B, T]."""
        return F.cross_entropy(output.reshape(-1, VOCAB_SIZE).float(), targets.reshape(-1).long())


class ByteLM(ByteBlocks):
    """The byte-level LM as ``n_layers + 2`` blocks: embedding, one per layer, head."""

    def __init__(self, cfg: ByteLMConfig, *, name: str = "bytelm") -> None:
        self.cfg = cfg
        self.name = name

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    @property
    def width(self) -> int:
        return self.cfg.d_model

    def _block(self, i: int) -> nn.Module:
        if i == 0:
            return Embedding(self.cfg)
        return TransformerLayer(self.cfg) if i <= self.cfg.n_layers else Head(self.cfg)

    def num_blocks(self) -> int:
        return self.cfg.n_layers + 2

    def block_costs(self) -> list[float]:
        """Forward FLOPs per sample of each block (a multiply-add counts 2).

        With ``T = seq_len``, ``d = d_model``, ``r = mlp_ratio``:

        * embedding: ``T * d`` (the elements it writes; a lookup has no multiply-adds, but its
          cost is not zero);
        * transformer layer: ``2 * T * (3d^2 + d^2 + 2 r d^2)`` for the four matmuls (QKV,
          attention output, MLP in and out) plus ``4 * T^2 * d`` for the scores ``QK^T`` and
          their product with ``V`` (counted in full, without the causal half);
        * head: ``2 * T * d * 256``.

        LayerNorms, GELU, softmax and residual additions are left out (a few percent).
        """
        t, d, r = self.cfg.seq_len, self.cfg.d_model, self.cfg.mlp_ratio
        embedding = float(t * d)
        layer = float(2 * t * (4 + 2 * r) * d * d + 4 * t * t * d)
        head = float(2 * t * d * VOCAB_SIZE)
        return [embedding, *([layer] * self.cfg.n_layers), head]

    def __repr__(self) -> str:
        return f"ByteLM({self.cfg!r}, name={self.name!r})"


PRESETS: dict[str, ByteLMConfig] = {
    "tiny": ByteLMConfig(d_model=64, n_layers=2, n_heads=2, seq_len=32),
    "small": ByteLMConfig(d_model=128, n_layers=4, n_heads=4, seq_len=64),
    "bench-small": ByteLMConfig(d_model=256, n_layers=6, n_heads=4, seq_len=128),
}
"""Built-in ByteLM shapes; ``bench-small`` is the benchmark model of BENCHMARKS.md."""
