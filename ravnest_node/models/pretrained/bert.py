"""BERT-style encoders (``model_type`` "bert") as blocks: learned positions, post-norm layers,
GELU MLP, and the masked-LM and classification heads.

The module and tensor names follow a Hugging Face checkpoint's closely enough that
`BertLayer.NAMES` maps one to the other; pad rows stay zero (padding.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ravnest_node.errors import ConfigError
from ravnest_node.models.pretrained.padding import pad_rows

__all__ = ["BertClassifierHead", "BertEmbeddings", "BertLayer", "BertMaskedLMHead"]


class BertEmbeddings(nn.Module):
    """Word + learned position + token type (0) embeddings, then LayerNorm; pad rows zero."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        d = int(c["hidden_size"])
        self.word_embeddings = nn.Embedding(int(c["vocab_size"]), d)
        self.position_embeddings = nn.Embedding(int(c["max_position_embeddings"]), d)
        self.token_type_embeddings = nn.Embedding(int(c.get("type_vocab_size", 2)), d)
        self.LayerNorm = nn.LayerNorm(d, eps=float(c.get("layer_norm_eps", 1e-12)))
        pad = c.get("pad_token_id")
        self.pad_id = None if pad is None else int(pad)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.word_embeddings(ids) + self.position_embeddings(pos)
        h = self.LayerNorm(h + self.token_type_embeddings(torch.zeros_like(ids)))
        if self.pad_id is not None:
            h = h.masked_fill((ids == self.pad_id)[..., None], 0.0)
        out: torch.Tensor = h
        return out


class BertLayer(nn.Module):
    """Post-norm encoder layer: LN(x + attn(x)), then LN(h + mlp(h)); pad rows stay zero."""

    NAMES = {
        "query": "attention.self.query", "key": "attention.self.key",
        "value": "attention.self.value", "attn_out": "attention.output.dense",
        "attn_ln": "attention.output.LayerNorm", "intermediate": "intermediate.dense",
        "output": "output.dense", "out_ln": "output.LayerNorm",
    }  # fmt: skip
    """Our module name -> its name under ``encoder.layer.{i}`` in a Hugging Face checkpoint."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        d, ffn = int(c["hidden_size"]), int(c["intermediate_size"])
        eps = float(c.get("layer_norm_eps", 1e-12))
        self.heads = int(c["num_attention_heads"])
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.attn_out, self.attn_ln = nn.Linear(d, d), nn.LayerNorm(d, eps=eps)
        self.intermediate, self.output = nn.Linear(d, ffn), nn.Linear(ffn, d)
        self.out_ln = nn.LayerNorm(d, eps=eps)
        if c.get("hidden_act", "gelu") != "gelu":
            raise ConfigError(f"hidden_act {c.get('hidden_act')!r} is not supported (gelu only)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        pad = pad_rows(x)

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        mask = None if pad is None else ~pad[:, None, None, :]
        a = F.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)), attn_mask=mask
        )
        h = self.attn_ln(x + self.attn_out(a.transpose(1, 2).reshape(b, t, d)))
        out: torch.Tensor = self.out_ln(h + self.output(F.gelu(self.intermediate(h))))
        return out if pad is None else out.masked_fill(pad[..., None], 0.0)


class BertMaskedLMHead(nn.Module):
    """dense + GELU + LayerNorm, then a projection on the vocabulary: hidden -> logits."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        d, vocab = int(c["hidden_size"]), int(c["vocab_size"])
        self.transform = nn.Linear(d, d)
        self.transform_ln = nn.LayerNorm(d, eps=float(c.get("layer_norm_eps", 1e-12)))
        self.decoder = nn.Linear(d, vocab, bias=False)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(self.transform_ln(F.gelu(self.transform(x)))) + self.bias
        return out


class BertClassifierHead(nn.Module):
    """The pooler (dense + tanh on the first position, [CLS]) and a linear classifier."""

    def __init__(self, c: Mapping[str, Any], num_labels: int) -> None:
        super().__init__()
        d = int(c["hidden_size"])
        self.pooler = nn.Linear(d, d)
        self.classifier = nn.Linear(d, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier(torch.tanh(self.pooler(x[:, 0])))
        return out
