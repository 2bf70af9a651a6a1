"""Pretrained transformers from a local Hugging Face directory, written as blocks.

A model name ``hf:DIR[,key=value...]`` names a directory in the Hugging Face layout
(``config.json`` and ``model.safetensors``, or ``model.safetensors.index.json`` and its shards)
that every node has a copy of, and how to fine-tune it:

==========  ==========================================================================
key         meaning (default)
==========  ==========================================================================
task        ``masked-lm``, ``causal-lm`` or ``classification`` (BERT: masked-lm; Llama:
            causal-lm)
seq         tokens per sample (128)
labels      classes of a classification task (2)
lora        LoRA rank; 0 = full fine-tuning (0)
alpha       LoRA alpha (2 x rank)
targets     linear layers that get adapters, joined by ``+`` (BERT: query+value; Llama:
            q_proj+v_proj)
base        storage of frozen weights under LoRA: fp32, bf16 or int8 (fp32)
data        a local ``.txt`` file (language modelling) or ``.jsonl`` file with ``text`` and
            ``label`` (classification); default: the docstrings of the standard library
tokenizer   ``wordpiece`` (from ``vocab.txt``; cased if ``tokenizer_config.json`` says
            ``do_lower_case: false``; BERT's default), ``bpe`` (from ``tokenizer.json``:
            Llama 3's byte-level BPE, Llama 2's with byte fallback, data/bpe.py; Llama's
            default where the file is there) or ``bytes`` (token id = byte value)
==========  ==========================================================================

Families, in our own compact code: BERT-style encoders (``model_type`` "bert": learned positions,
post-norm layers, GELU MLP) and Llama-style decoders ("llama": RMSNorm, rotary embeddings,
SwiGLU MLP, grouped-query attention). Blocks: the embeddings, one per layer, the task's head.

Each node builds and loads only the blocks of its own stage (`PretrainedModel.build_stage`),
reading only those tensors from the safetensors files. A head the checkpoint lacks (a sentence
encoder has no masked-LM head) is initialised from the seed, per block, so that every node
builds the same one; a masked-LM or tied LM head starts from a copy of the word embeddings
(blocks share no parameters, so the copy trains on its own).

Padding: positions holding the pad token leave the embeddings as all-zero rows, and every layer
treats an all-zero input row as padding (a key nobody attends to, an output row kept at zero).
So the mask needs no second tensor between stages, and every codec keeps zeros exact.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ravnest_node.errors import ConfigError
from ravnest_node.models.base import BlockModel, TensorSpec
from ravnest_node.models.lora import FrozenLinear, LoRAConfig, freeze, seeded_generator
from ravnest_node.models.safetensors import index_directory, load_tensors

__all__ = [
    "PREFIX",
    "TASKS",
    "ByteTokenizer",
    "PretrainedModel",
    "PretrainedSpec",
    "check_allowed",
    "local_paths",
    "parse_spec",
]

PREFIX = "hf:"
"""Model names that start with this name a pretrained model directory."""

TASKS = ("masked-lm", "causal-lm", "classification")
"""Fine-tuning tasks."""

IGNORE = -100
"""Target value of positions that do not count in a token-level loss."""

_INIT_STD = 0.02  # BERT and Llama initialise new linear layers with this standard deviation


@dataclass(frozen=True, slots=True)
class PretrainedSpec:
    """What an ``hf:`` model name says (see the module docstring)."""

    directory: Path
    family: str
    task: str
    seq_len: int = 128
    num_labels: int = 2
    lora: LoRAConfig | None = None
    data: str = ""
    tokenizer: str = "wordpiece"
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


_FAMILY_DEFAULTS = {
    "bert": ("masked-lm", ("query", "value"), "wordpiece"),
    "llama": ("causal-lm", ("q_proj", "v_proj"), ""),
}


def parse_spec(name: str) -> PretrainedSpec:
    """The `PretrainedSpec` of an ``hf:DIR[,key=value...]`` model name; ConfigError, naming the
    part at fault, for a malformed name, a missing directory or an unsupported model."""
    if not name.startswith(PREFIX):
        raise ConfigError(f"not a pretrained model name (no {PREFIX!r} prefix): {name!r}")
    directory, *options = name[len(PREFIX):].split(",")
    path = Path(directory).expanduser()
    config = read_config(path)
    family = str(config.get("model_type", ""))
    if family not in _FAMILY_DEFAULTS:
        raise ConfigError(
            f"{path / 'config.json'}: model_type {family!r} is not supported; "
            f"supported: {', '.join(sorted(_FAMILY_DEFAULTS))}"
        )
    task, targets, tokenizer = _FAMILY_DEFAULTS[family]
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        known = ("task", "seq", "labels", "lora", "alpha", "targets", "base", "data", "tokenizer")
        if not sep or key not in known:
            raise ConfigError(
                f"model {name!r}: bad option {option!r}; options are key=value with key one of "
                f"{', '.join(known)}"
            )
        values[key] = value
    task = values.get("task", task)
    if task not in TASKS or (family == "bert" and task == "causal-lm"):
        raise ConfigError(f"model {name!r}: task {task!r} is not one a {family} model can train")
    rank = _int(values.get("lora", "0"), "lora", name, minimum=0, maximum=4096)
    lora = None
    if rank:
        lora = LoRAConfig(
            rank=rank,
            alpha=_float(values.get("alpha", str(2 * rank)), "alpha", name),
            targets=tuple(values["targets"].split("+")) if "targets" in values else targets,
            base=values.get("base", "fp32"),
        )
    elif "base" in values or "alpha" in values or "targets" in values:
        raise ConfigError(f"model {name!r}: alpha, targets and base need lora=RANK")
    spec = PretrainedSpec(
        directory=path,
        family=family,
        task=task,
        seq_len=_int(values.get("seq", "128"), "seq", name, minimum=2, maximum=1 << 20),
        num_labels=_int(values.get("labels", "2"), "labels", name, minimum=2, maximum=1 << 16),
        lora=lora,
        data=values.get("data", ""),
        tokenizer=values.get(
            "tokenizer", tokenizer or ("bpe" if (path / "tokenizer.json").is_file() else "")
        ),
        config=config,
    )
    if spec.tokenizer not in ("wordpiece", "bpe", "bytes", ""):
        raise ConfigError(f"model {name!r}: tokenizer must be wordpiece, bpe or bytes")
    if family == "bert" and config.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"{path / 'config.json'}: only absolute position embeddings are "
                          "supported")  # fmt: skip
    limit = int(config.get("max_position_embeddings", spec.seq_len))
    if spec.seq_len > limit:
        raise ConfigError(f"model {name!r}: seq {spec.seq_len} exceeds the model's {limit}")
    return spec


_LORA_KEYS = ("lora", "alpha", "targets", "base")


def without_lora(name: str) -> str:
    """The ``hf:`` model name with its LoRA options left out: the same model, trained in full."""
    directory, *options = name.split(",")
    return ",".join([directory, *(o for o in options if o.partition("=")[0] not in _LORA_KEYS)])


def _int(text: str, key: str, name: str, *, minimum: int, maximum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"model {name!r}: {key} must be an integer, got {text!r}") from None
    if not minimum <= value <= maximum:
        raise ConfigError(
            f"model {name!r}: {key} must be at least {minimum} and at most {maximum}, got {value}"
        )
    return value


def _float(text: str, key: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"model {name!r}: {key} must be a number, got {text!r}") from None


def local_paths(name: str) -> list[Path]:
    """The local files and directories an ``hf:`` model name makes a node read (its directory,
    its data file); [] for other names. Parses nothing beyond the name."""
    if not name.startswith(PREFIX):
        return []
    directory, *options = name[len(PREFIX):].split(",")
    paths = [Path(directory).expanduser()]
    paths += [Path(o[len("data="):]).expanduser() for o in options if o.startswith("data=")]
    return paths


def check_allowed(name: str, allowed: Sequence[Path]) -> None:
    """ConfigError unless every local path of model `name` lies inside one of the `allowed`
    directories (after resolving links): a run spec comes from the coordinator, and a node
    reads only the model directories its own operator named (``--model-dir``, or its own
    ``--model``)."""
    roots = [a.expanduser().resolve() for a in allowed]
    for path in local_paths(name):
        real = path.resolve()
        if not any(real == root or root in real.parents for root in roots):
            raise ConfigError(
                f"the run's model reads {path}, which is outside this node's model directories "
                f"({', '.join(map(str, roots)) or 'none'}); start the node with --model-dir "
                f"{path if path.is_dir() else path.parent} to train it"
            )


@functools.lru_cache(maxsize=16)
def read_config(directory: Path) -> dict[str, Any]:
    """The directory's ``config.json`` (cached per process); ConfigError if missing or bad."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no config.json in {directory} (a pretrained model directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return config


def _pad_rows(x: torch.Tensor) -> torch.Tensor | None:
    """[B, T] True where a row of the hidden state is all zero (padding), or None if none is."""
    pad = (x == 0).all(dim=-1)
    return pad if bool(pad.any()) else None


# ----- BERT ---------------------------------------------------------------------------------
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
        pad = _pad_rows(x)

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


# ----- Llama --------------------------------------------------------------------------------
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
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
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
    """Pre-norm decoder layer: x + attn(RMSNorm(x)) with rotary embeddings and grouped-query
    attention, then h + SwiGLU(RMSNorm(h)); pad rows stay zero."""

    inv_freq: torch.Tensor

    NAMES = {
        "input_layernorm": "input_layernorm", "q_proj": "self_attn.q_proj",
        "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
        "post_attention_layernorm": "post_attention_layernorm", "gate_proj": "mlp.gate_proj",
        "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
    }  # fmt: skip
    """Our module name -> its name under ``model.layers.{i}`` in a Hugging Face checkpoint."""

    def __init__(self, c: Mapping[str, Any]) -> None:
        super().__init__()
        d, ffn = int(c["hidden_size"]), int(c["intermediate_size"])
        self.heads = int(c["num_attention_heads"])
        self.kv_heads = int(c.get("num_key_value_heads") or self.heads)
        self.head_dim = int(c.get("head_dim") or d // self.heads)
        if self.heads % self.kv_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        eps, bias = float(c.get("rms_norm_eps", 1e-6)), bool(c.get("attention_bias", False))
        mlp_bias = bool(c.get("mlp_bias", False))
        self.input_layernorm = RMSNorm(d, eps)
        self.q_proj = nn.Linear(d, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, d, bias=bias)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.gate_proj = nn.Linear(d, ffn, bias=mlp_bias)
        self.up_proj = nn.Linear(d, ffn, bias=mlp_bias)
        self.down_proj = nn.Linear(ffn, d, bias=mlp_bias)
        self.register_buffer("inv_freq", rope_frequencies(c, self.head_dim), persistent=False)
        if c.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {c.get('hidden_act')!r} is not supported (silu only)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        pad = _pad_rows(x)
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        angles = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq.float())
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if pad is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & ~pad[:, None, None, :])
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
        out: torch.Tensor = self.score(self.norm(x[torch.arange(x.shape[0]), last]))
        return out


# ----- the model ----------------------------------------------------------------------------
class PretrainedModel(BlockModel):
    """A pretrained BERT- or Llama-style model as blocks: embeddings, one per layer, head."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.spec = parse_spec(name)
        c = self.spec.config
        self.layers = int(c["num_hidden_layers"])
        self.hidden = int(c["hidden_size"])
        self.vocab = self.vocab_size = int(c["vocab_size"])

    # -- blocks --
    def num_blocks(self) -> int:
        return self.layers + 2

    def build_blocks(self, seed: int) -> list[nn.Module]:
        return self.build_stage(seed, 0, self.num_blocks())

    def timing_blocks(self) -> list[nn.Module]:
        """The embeddings, one layer listed for every layer, and the head, with their initial
        (random) values: timing reads no weights and holds one layer, however many there are."""
        n = self.num_blocks()
        first, layer = self._build(0, 0, 2, load=False)
        return [first, *[layer] * self.layers, *self._build(0, n - 1, n, load=False)]

    def build_stage(self, seed: int, start: int, stop: int) -> list[nn.Module]:
        """Blocks ``[start, stop)`` with their pretrained weights, reading only their tensors
        (no reading at all when built on the meta device, to count parameters)."""
        n = self.num_blocks()
        if not 0 <= start < stop <= n:
            raise ValueError(f"stage range [{start}, {stop}) is not inside 0..{n} of {self.name!r}")
        return self._build(seed, start, stop, load=torch.empty(()).device.type != "meta")

    def _build(self, seed: int, start: int, stop: int, *, load: bool) -> list[nn.Module]:
        entries = index_directory(self.spec.directory) if load else {}
        blocks = []
        for i in range(start, stop):
            block, names, new = self._block(i)
            if load:
                self._load(i, block, names, new, entries, seed)
            if self.spec.lora is not None:
                made, _ = freeze(block, self.spec.lora, seed=seed, index=i,
                                 keep=self._trainable_new(i))  # fmt: skip
                if 0 < i <= self.layers and not made:
                    linears = sorted({n.rpartition(".")[2] for n, m in block.named_modules()
                                      if isinstance(m, (nn.Linear, FrozenLinear))})  # fmt: skip
                    raise ConfigError(
                        f"model {self.name!r}: no linear layer of block {i} is named in "
                        f"targets={'+'.join(self.spec.lora.targets)}; its linear layers: "
                        f"{', '.join(linears)}"
                    )
            blocks.append(block)
        return blocks

    def _block(self, i: int) -> tuple[nn.Module, dict[str, str], dict[str, str]]:
        """Block `i`, its tensors' checkpoint names (ours -> theirs) and the tensors the
        checkpoint may lack, with how to initialise them ("normal", "zeros", "ones", or
        "copy:<checkpoint name>")."""
        c, spec = self.spec.config, self.spec
        bert = spec.family == "bert"
        prefix = self._prefix()
        if i == 0:
            block: nn.Module = BertEmbeddings(c) if bert else LlamaEmbeddings(c)
            base = f"{prefix}embeddings." if bert else f"{prefix}embed_tokens."
            if bert:
                names = {k: base + k for k, _ in _tensors(block)}
            else:
                names = {k: base + k.removeprefix("embed_tokens.") for k, _ in _tensors(block)}
            return block, names, {}
        if i <= self.layers:
            layer = i - 1
            block = BertLayer(c) if bert else LlamaLayer(c)
            table = BertLayer.NAMES if bert else LlamaLayer.NAMES
            base = f"{prefix}encoder.layer.{layer}." if bert else f"{prefix}layers.{layer}."
            names = {}
            for k, _ in _tensors(block):
                module, _, leaf = k.rpartition(".")
                names[k] = f"{base}{table[module]}.{leaf}"
            return block, names, {}
        if spec.task == "classification":
            block = (BertClassifierHead(c, spec.num_labels) if bert
                     else LlamaClassifierHead(c, spec.num_labels))  # fmt: skip
            if bert:
                names = {"pooler.weight": f"{prefix}pooler.dense.weight",
                         "pooler.bias": f"{prefix}pooler.dense.bias",
                         "classifier.weight": "classifier.weight",
                         "classifier.bias": "classifier.bias"}  # fmt: skip
                new = {"pooler.weight": "normal", "pooler.bias": "zeros",
                       "classifier.weight": "normal", "classifier.bias": "zeros"}  # fmt: skip
            else:
                names = {"norm.weight": f"{prefix}norm.weight", "score.weight": "score.weight"}
                new = {"score.weight": "normal"}
            return block, names, new
        if bert:
            block = BertMaskedLMHead(c)
            p = "cls.predictions."
            names = {"transform.weight": f"{p}transform.dense.weight",
                     "transform.bias": f"{p}transform.dense.bias",
                     "transform_ln.weight": f"{p}transform.LayerNorm.weight",
                     "transform_ln.bias": f"{p}transform.LayerNorm.bias",
                     "decoder.weight": f"{p}decoder.weight", "bias": f"{p}bias"}  # fmt: skip
            new = {"transform.weight": "normal", "transform.bias": "zeros",
                   "transform_ln.weight": "ones", "transform_ln.bias": "zeros",
                   "decoder.weight": f"copy:{prefix}embeddings.word_embeddings.weight",
                   "bias": "zeros"}  # fmt: skip
            return block, names, new
        block = LlamaLMHead(c)
        names = {"norm.weight": f"{prefix}norm.weight", "lm_head.weight": "lm_head.weight"}
        return block, names, {"lm_head.weight": f"copy:{prefix}embed_tokens.weight"}

    def _trainable_new(self, i: int) -> tuple[str, ...]:
        """Under LoRA, the head's parts that train in full: those a pretrained model lacks
        (a masked-LM head's transform and bias, a classifier), not a vocabulary projection."""
        if i <= self.layers:
            return ()
        if self.spec.task == "classification":
            return ("pooler", "classifier", "score")
        return ("transform", "transform_ln", "bias") if self.spec.family == "bert" else ()

    @functools.cached_property
    def _prefix_cache(self) -> str:
        entries = index_directory(self.spec.directory)
        if self.spec.family == "bert":
            return "bert." if "bert.embeddings.word_embeddings.weight" in entries else ""
        return "model." if "model.embed_tokens.weight" in entries else ""

    def _prefix(self) -> str:
        if torch.empty(()).device.type == "meta":
            return ""
        return self._prefix_cache

    def _load(self, i: int, block: nn.Module, names: Mapping[str, str], new: Mapping[str, str],
              entries: Mapping[str, Any], seed: int) -> None:  # fmt: skip
        """Fill block `i`'s tensors from the checkpoint, or initialise those it lacks."""
        wanted = {k: v for k, v in names.items() if v in entries}
        missing = [k for k in names if k not in wanted]
        for k in missing:
            how = new.get(k)
            if how is None or (how.startswith("copy:") and how[5:] not in entries):
                raise ConfigError(
                    f"{self.spec.directory}: the checkpoint has no tensor {names[k]!r} "
                    f"(block {i}, {k})"
                )
        copies = {how[5:] for k in missing if (how := new[k]).startswith("copy:")}
        loaded = load_tensors(entries, [*wanted.values(), *(copies & set(entries))])
        tensors = dict(_tensors(block))
        with torch.no_grad():
            for k, t in tensors.items():
                if k in wanted:
                    source = loaded[wanted[k]]
                else:
                    how = new[k]
                    if how.startswith("copy:"):
                        source = loaded[how[5:]]
                    elif how == "normal":
                        source = torch.randn(t.shape, generator=seeded_generator(seed, i, k))
                        source = source * _INIT_STD
                    else:
                        source = torch.zeros(t.shape) if how == "zeros" else torch.ones(t.shape)
                if tuple(source.shape) != tuple(t.shape):
                    raise ConfigError(
                        f"{self.spec.directory}: tensor for block {i} {k} has shape "
                        f"{tuple(source.shape)}, the config says {tuple(t.shape)}"
                    )
                t.copy_(source.to(t.dtype))

    # -- shapes --
    def block_costs(self) -> list[float]:
        """Forward FLOPs per sample of each block (multiply-add = 2); attention scores counted
        in full; norms and activations left out."""
        c, t, d = self.spec.config, self.spec.seq_len, self.hidden
        ffn = int(c["intermediate_size"])
        if self.spec.family == "bert":
            matmul = 4 * d * d + 2 * d * ffn
        else:
            heads = int(c["num_attention_heads"])
            kv = int(c.get("num_key_value_heads") or heads)
            head_dim = int(c.get("head_dim") or d // heads)
            matmul = 2 * d * heads * head_dim + 2 * d * kv * head_dim + 3 * d * ffn
        layer = float(2 * t * matmul + 4 * t * t * d)
        if self.spec.task == "classification":
            head = float(2 * d * d + 2 * d * self.spec.num_labels)
        else:
            head = float(2 * t * d * (d + self.vocab) if self.spec.family == "bert"
                         else 2 * t * d * self.vocab)  # fmt: skip
        return [float(t * d), *([layer] * self.layers), head]

    def input_spec(self, batch: int) -> TensorSpec:
        return TensorSpec("tokens", (batch, self.spec.seq_len), torch.int64)

    def output_spec(self, block: int, batch: int) -> TensorSpec:
        last = self.num_blocks() - 1
        if not 0 <= block <= last:
            raise ValueError(f"block {block} is out of range; {self.name!r} has blocks 0..{last}")
        if block < last:
            return TensorSpec("hidden", (batch, self.spec.seq_len, self.hidden), torch.float32)
        if self.spec.task == "classification":
            return TensorSpec("logits", (batch, self.spec.num_labels), torch.float32)
        return TensorSpec("logits", (batch, self.spec.seq_len, self.vocab), torch.float32)

    def target_spec(self, batch: int) -> TensorSpec:
        if self.spec.task == "classification":
            return TensorSpec("labels", (batch,), torch.int64)
        return TensorSpec("targets", (batch, self.spec.seq_len), torch.int64)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the positions that count (targets other than -100), or over
        the samples of a classification batch."""
        return F.cross_entropy(
            output.reshape(-1, output.shape[-1]).float(), targets.reshape(-1).long(),
            ignore_index=IGNORE,
        )  # fmt: skip

    # -- data --
    def dataset(self, *, seed: int, shard: int = 0, num_shards: int = 1, num_samples: int = 0
                ) -> Any:  # fmt: skip
        """The task's data (ravnest_node/data/text.py), tokenised as the model expects."""
        from ravnest_node.data import text

        spec = self.spec
        tokenizer = self.tokenizer()
        common: dict[str, Any] = dict(seed=seed, shard=shard, num_shards=num_shards)
        if spec.task == "classification":
            if not spec.data:
                raise ConfigError(f"model {self.name!r}: classification needs data=FILE.jsonl")
            pad_id = spec.config.get("pad_token_id")  # what the embeddings treat as padding
            if pad_id is None:
                raise ConfigError(f"model {self.name!r}: classification pads its samples, and "
                                  "the model's config.json has no pad_token_id")  # fmt: skip
            rows = text.read_jsonl(Path(spec.data))
            examples = [(tokenizer.encode(t), label) for t, label in rows]
            return text.ClassificationData(
                examples, seq_len=spec.seq_len, pad_id=int(pad_id),
                cls_id=_first_id(tokenizer), sep_id=_last_id(tokenizer),
                num_labels=spec.num_labels, **common,
            )  # fmt: skip
        corpus = text.read_texts([Path(spec.data)]) if spec.data else text.stdlib_docstrings()
        ids = text.tokenize_corpus(tokenizer, corpus)
        if spec.task == "masked-lm":
            return text.MaskedLMData(ids, seq_len=spec.seq_len, tokenizer=tokenizer,
                                     num_samples=num_samples, **common)  # fmt: skip
        return text.CausalLMData(ids, seq_len=spec.seq_len, num_samples=num_samples, **common)

    def tokenizer(self) -> Any:
        """The tokenizer the spec names: WordPiece from vocab.txt, BPE from tokenizer.json, or
        bytes."""
        from ravnest_node.data.bpe import BpeTokenizer
        from ravnest_node.data.wordpiece import WordPiece

        if not self.spec.tokenizer:
            raise ConfigError(
                f"model {self.name!r}: say which tokenizer its data needs: the directory has no "
                "tokenizer.json (tokenizer=bpe); tokenizer=bytes for a model whose first 256 "
                "token ids are the byte values"
            )
        if self.spec.tokenizer == "bpe":
            bpe = BpeTokenizer.from_file(self.spec.directory / "tokenizer.json")
            if bpe.vocab_size > self.vocab:
                raise ConfigError(
                    f"{self.spec.directory / 'tokenizer.json'}: {bpe.vocab_size} token ids, "
                    f"more than the model's vocabulary of {self.vocab}"
                )
            return bpe
        if self.spec.tokenizer == "bytes":
            if self.vocab < 256:
                raise ConfigError(f"model {self.name!r}: tokenizer=bytes needs a vocabulary of "
                                  f"at least 256, the model has {self.vocab}")  # fmt: skip
            return ByteTokenizer(pad_id=self.spec.config.get("pad_token_id"))
        vocab = self.spec.directory / "vocab.txt"
        if not vocab.is_file():
            raise ConfigError(f"{self.spec.directory}: no vocab.txt for the WordPiece tokenizer")
        lowercase = True
        settings = self.spec.directory / "tokenizer_config.json"
        if settings.is_file():
            try:
                lowercase = bool(json.loads(settings.read_text()).get("do_lower_case", True))
            except (OSError, ValueError, AttributeError) as exc:
                raise ConfigError(f"{settings}: cannot read it: {exc}") from None
        return WordPiece.from_vocab(vocab, lowercase=lowercase)

    def __repr__(self) -> str:
        return f"PretrainedModel({self.name!r})"


def _first_id(tokenizer: Any) -> int | None:
    """The token a classification sample starts with: WordPiece's [CLS], or the BOS a BPE
    tokenizer's template adds (as the model saw its text in pretraining)."""
    if hasattr(tokenizer, "adds_bos"):
        return tokenizer.bos_id if tokenizer.adds_bos else None
    return tokenizer.cls_id  # type: ignore[no-any-return]


def _last_id(tokenizer: Any) -> int | None:
    """The token a classification sample ends with: WordPiece's [SEP], or a BPE template's EOS."""
    if hasattr(tokenizer, "adds_eos"):
        return tokenizer.eos_id if tokenizer.adds_eos else None
    return tokenizer.sep_id  # type: ignore[no-any-return]


class ByteTokenizer:
    """Token id = byte value of the UTF-8 text (for models whose first 256 ids are bytes)."""

    vocab_size = 256
    cls_id = sep_id = mask_id = None
    fingerprint = "bytes"

    def __init__(self, pad_id: int | None = None) -> None:
        self.pad_id = pad_id

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))


def _tensors(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A block's parameters and persistent buffers, by name."""
    out: list[tuple[str, torch.Tensor]] = list(block.named_parameters())
    persistent = set(block.state_dict())
    out += [(k, b) for k, b in block.named_buffers() if k in persistent]
    return out
