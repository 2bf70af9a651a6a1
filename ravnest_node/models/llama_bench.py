"""A Llama-shaped language model with random weights, for benchmarking GPU nodes: the layers
of models/pretrained/llama.py (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU)
over the byte vocabulary, so that it needs no download, no tokenizer and no pretrained
weights, and trains on the built-in byte data (data/stdlib_bytes.py) like the ByteLM presets.

Blocks, in order: the token embedding (token ids ``[B, T]`` -> hidden ``[B, T, hidden]``),
one block per decoder layer (hidden -> hidden), the head (final RMSNorm and an untied
projection on the 256 byte values: hidden -> logits ``[B, T, 256]`` float32). With 256 tokens
the embedding and the head are small: nearly every parameter is in the layers, as in a large
Llama, and the tensor crossing each stage boundary has a Llama's width.

Preset: ``llama-300m`` (`LLAMA_300M`): hidden 1024, 24 layers, 16 query heads sharing 4
key/value heads, SwiGLU width 2816, 256 positions: about 270 M parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ravnest_node.errors import ConfigError
from ravnest_node.models.base import to_device
from ravnest_node.models.bytelm import VOCAB_SIZE as BYTES
from ravnest_node.models.bytelm import ByteBlocks
from ravnest_node.models.pretrained.llama import LlamaEmbeddings, LlamaLayer, LlamaLMHead

__all__ = ["LLAMA_300M", "LlamaBench", "LlamaBenchConfig"]


@dataclass(frozen=True, slots=True)
class LlamaBenchConfig:
    """Shape of a `LlamaBench`."""

    hidden: int
    layers: int
    heads: int
    """Query heads; `hidden` is a multiple of it (the head width is hidden / heads)."""
    kv_heads: int
    """Key/value heads, shared by heads / kv_heads query heads each (grouped-query attention)."""
    ffn: int
    """Width of the SwiGLU MLP's hidden layer."""
    seq_len: int
    """Tokens (bytes) per sample."""

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"LlamaBenchConfig.{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(
                f"LlamaBenchConfig: heads ({self.heads}) must divide hidden ({self.hidden}) and "
                f"be a multiple of kv_heads ({self.kv_heads})"
            )

    def hf_config(self) -> Mapping[str, Any]:
        """The same shape as a Hugging Face Llama config, which the layers read."""
        return {
            "vocab_size": BYTES, "hidden_size": self.hidden, "intermediate_size": self.ffn,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        }  # fmt: skip


LLAMA_300M = LlamaBenchConfig(hidden=1024, layers=24, heads=16, kv_heads=4, ffn=2816, seq_len=256)


class LlamaBench(ByteBlocks):
    """The Llama-shaped byte LM as ``layers + 2`` blocks: embedding, one per layer, head."""

    def __init__(self, cfg: LlamaBenchConfig, *, name: str = "llama-bench") -> None:
        self.cfg = cfg
        self.name = name

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    @property
    def width(self) -> int:
        return self.cfg.hidden

    def _block(self, i: int) -> nn.Module:
        c = self.cfg.hf_config()
        if i == 0:
            return LlamaEmbeddings(c)
        return LlamaLayer(c) if i <= self.cfg.layers else LlamaLMHead(c)

    def timing_blocks(self, *, device: torch.device | None = None) -> list[nn.Module]:
        """The embedding, one layer listed for every layer, and the head: timing holds one
        layer's memory, however many there are."""
        c = self.cfg.hf_config()
        layer = to_device(LlamaLayer(c), device)
        first, last = to_device(LlamaEmbeddings(c), device), to_device(LlamaLMHead(c), device)
        return [first, *[layer] * self.cfg.layers, last]

    def num_blocks(self) -> int:
        return self.cfg.layers + 2

    def block_costs(self) -> list[float]:
        """Forward FLOPs per sample of each block (a multiply-add counts 2): the embedding
        ``T * d`` (the elements it writes), a layer its four projections (q and o ``d x d``,
        k and v ``d x kv``), its three SwiGLU matrices (``d x ffn``) and ``4 T^2 d`` for the
        attention's scores and their product with V, the head ``2 T d 256``. Norms, rotary
        embeddings and the activation are left out (a few percent)."""
        c = self.cfg
        t, d = c.seq_len, c.hidden
        kv = c.kv_heads * (d // c.heads)
        layer = float(2 * t * (2 * d * d + 2 * d * kv + 3 * d * c.ffn) + 4 * t * t * d)
        return [float(t * d), *([layer] * c.layers), float(2 * t * d * BYTES)]

    def __repr__(self) -> str:
        return f"LlamaBench({self.cfg!r}, name={self.name!r})"
