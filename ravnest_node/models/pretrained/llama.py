"""Llama-style decoders as blocks: RMSNorm, rotary embeddings (with Llama 3's scaling), SwiGLU
MLP, grouped-query attention, and the LM and classification heads.

The families (`FAMILIES`, by ``model_type``) share that architecture and differ only in their
attention (`attention_layout`, `sliding_window`): Llama ("llama"; q/k/v/o biases where
``attention_bias`` says), Mistral ("mistral"; no biases, a sliding window where
``sliding_window`` is set), Qwen2 and Qwen2.5 ("qwen2"; biases on q/k/v, none on o), Qwen3
("qwen3"; an RMSNorm over each head of q and of k before the rotary embedding, biases where
``attention_bias`` says). Qwen's sliding window applies where ``use_sliding_window`` is true,
on the layers ``layer_types`` names (else from ``max_window_layers`` on). Each is checked
against transformers' own classes in tests/test_families.py.

The module and tensor names follow a Hugging Face checkpoint's closely enough that
`LlamaLayer.NAMES` maps one to the other; pad rows stay zero (padding.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ravnest_node.errors import ConfigError
from ravnest_node.models.pretrained.padding import pad_rows

__all__ = [
    "FAMILIES",
    "LlamaClassifierHead",
    "LlamaEmbeddings",
    "LlamaLMHead",
    "LlamaLayer",
    "RMSNorm",
    "attention_layout",
    "rope_frequencies",
    "sliding_window",
]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""The ``model_type`` values this module builds."""


def attention_layout(family: str, c: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    """Whether the attention of a `family` model of config `c` has biases on its q/k/v
    projections, a bias on its output projection, and an RMSNorm on each head of q and k."""
    if family == "qwen2":  # transformers' Qwen2Attention: fixed, whatever the config says
        return True, False, False
    if family == "mistral":  # MistralAttention: no biases
        return False, False, False
    bias = bool(c.get("attention_bias", False))
    return bias, bias, family == "qwen3"


def sliding_window(family: str, c: Mapping[str, Any], layer: int) -> int | None:
    """How many positions (itself included) a query of layer `layer` attends back to, or None
    for all before it. Mistral: ``sliding_window`` on every layer; Qwen: only under
    ``use_sliding_window``, on the layers ``layer_types`` marks "sliding_attention" (where
    it is absent: those from ``max_window_layers`` on); Llama: never."""
    window = c.get("sliding_window")
    if family not in ("mistral", "qwen2", "qwen3") or window is None:
        return None
    if family != "mistral":
        if not c.get("use_sliding_window", False):
            return None
        types = c.get("layer_types")
        if isinstance(types, list) and layer < len(types):
            if types[layer] != "sliding_attention":
                return None
        elif layer < int(c.get("max_window_layers", 28)):
            return None
    if int(window) < 1:
        raise ConfigError(f"sliding_window must be at least 1, got {window!r}")
    return int(window)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32."""

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out: torch.Tensor = self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)
                                                             + self.eps))  # fmt: skip
        return out


def rope_frequencies(c: Mapping[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama 3's scaling when configured
    (``rope_type == "llama3"``: long wavelengths divided by ``factor``, short ones kept, a
    smooth blend between; Meta's Llama 3.1 release). Read from ``rope_theta`` and
    ``rope_scaling`` as the Hub's configs write them, or from ``rope_parameters``, where
    transformers 5 puts both."""
    params = c.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"rope_parameters must be an object, not {params!r:.80}")
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    # On the CPU even where blocks are built on the meta device: a loader reads no value for
    # this buffer and moves it with its block.
    steps = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv = 1.0 / theta ** (steps / head_dim)
    scaling = c.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind != "llama3":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (llama3 only)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = ((context / wavelen - low) / (high - low)).clamp(0, 1)
    scaled = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > context / low, inv / factor,
                       torch.where(wavelen < context / high, inv, scaled)).float()  # fmt: skip


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaEmbeddings(nn.Module):
    """Token embeddings; pad rows zero (when the config has a pad token)."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(int(c["vocab_size"]), int(c["hidden_size"]))
        pad = c.get("pad_token_id")
        self.pad_id = None if pad is None else int(pad)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        h: torch.Tensor = self.embed_tokens(ids)
        if self.pad_id is not None:
            h = h.masked_fill((ids == self.pad_id)[..., None], 0.0)
        return h


class LlamaLayer(nn.Module):
    """Pre-norm decoder layer `layer` of a `family` model: x + attn(RMSNorm(x)) with rotary
    embeddings and grouped-query attention (with the family's biases, q/k norms and sliding
    window), then h + SwiGLU(RMSNorm(h)); pad rows stay zero."""

    inv_freq: torch.Tensor

    NAMES = {
        "input_layernorm": "input_layernorm", "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
        "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
        "post_attention_layernorm": "post_attention_layernorm", "gate_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
    }  # fmt: skip
    """Our module name -> its name under ``model.layers.{i}`` in a Hugging Face checkpoint."""

    def __init__(self, c: Mapping[str, Any], family: str = "llama", layer: int = 0) -> None:
        super().__init__()
        d, ffn = int(c["hidden_size"]), int(c["intermediate_size"])
        self.heads = int(c["num_attention_heads"])
        self.kv_heads = int(c.get("num_key_value_heads") or self.heads)
        self.head_dim = int(c.get("head_dim") or d // self.heads)
        if self.heads % self.kv_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        eps, mlp_bias = float(c.get("rms_norm_eps", 1e-6)), bool(c.get("mlp_bias", False))
        bias, o_bias, qk_norm = attention_layout(family, c)
        self.window = sliding_window(family, c, layer)
        self.input_layernorm = RMSNorm(d, eps)
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.gate_proj = nn.Linear(d, ffn, bias=mlp_bias)
        self.up_proj = nn.Linear(d, ffn, bias=mlp_bias)
        self.down_proj = nn.Linear(ffn, d, bias=mlp_bias)
        self.register_buffer("inv_freq", rope_frequencies(c, self.head_dim), persistent=False)
        if c.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {c.get('hidden_act')!r} is not supported (silu only)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        pad = pad_rows(x)
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the rotation
            q, k = self.q_norm(q).type_as(q), self.k_norm(k).type_as(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        angles = torch.outer(
            torch.arange(t, dtype=torch.float32, device=x.device), self.inv_freq.float()
        )
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        windowed = self.window is not None and self.window < t
        if pad is None and not windowed:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keep = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            if windowed:  # a query sees itself and the window - 1 positions before it
                keep = keep.triu(1 - int(self.window or 0))
            if pad is not None:
                keep = keep & ~pad[:, None, None, :]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
            a = a.nan_to_num(0.0)  # a pad query attending nothing
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        h = self.post_attention_layernorm(x)
        out: torch.Tensor = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return out if pad is None else out.masked_fill(pad[..., None], 0.0)


class LlamaLMHead(nn.Module):
    """Final RMSNorm and the projection on the vocabulary: hidden -> logits."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        d = int(c["hidden_size"])
        self.norm = RMSNorm(d, float(c.get("rms_norm_eps", 1e-6)))
        self.lm_head = nn.Linear(d, int(c["vocab_size"]), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.norm(x))
        return out


class LlamaClassifierHead(nn.Module):
    """Final RMSNorm and a linear classifier on the last position that is not padding."""

    def __init__(self, c: Mapping[str, Any], num_labels: int) -> None:
        super().__init__()
        d = int(c["hidden_size"])
        self.norm = RMSNorm(d, float(c.get("rms_norm_eps", 1e-6)))
        self.score = nn.Linear(d, num_labels, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = (x != 0).any(dim=-1).sum(dim=1).clamp(min=1) - 1  # right padding
        out: torch.Tensor = self.score(
            self.norm(x[torch.arange(x.shape[0], device=x.device), last])
        )
        return out
