"""`PretrainedModel`: a pretrained BERT- or Llama-style model (Llama, Mistral, Qwen2, Qwen3:
llama.py) as blocks (the embeddings, one per layer, the task's head), with its weights, costs,
tensor specs, loss and data.

Each node builds and loads only the blocks of its own stage (`PretrainedModel.build_stage`),
reading only those tensors from the safetensors files. A head the checkpoint lacks (a sentence
encoder has no masked-LM head) is initialised from the seed, per block, so that every node
builds the same one; a masked-LM or tied LM head starts from a copy of the word embeddings
(blocks share no parameters, so the copy trains on its own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ravnest_node.errors import ConfigError
from ravnest_node.models.base import BlockModel, TensorSpec, shapes_only, to_device
from ravnest_node.models.lora import FrozenLinear, freeze, seeded_generator
from ravnest_node.models.pretrained.adapter import (
    MODEL_PREFIX,
    Adapted,
    AdapterSource,
    adapted_layers,
)
from ravnest_node.models.pretrained.bert import (
    BertClassifierHead,
    BertEmbeddings,
    BertLayer,
    BertMaskedLMHead,
)
from ravnest_node.models.pretrained.llama import (
    LlamaClassifierHead,
    LlamaEmbeddings,
    LlamaLayer,
    LlamaLMHead,
)
from ravnest_node.models.pretrained.spec import eval_fraction, parse_spec
from ravnest_node.models.pretrained.tokenizer import first_id, last_id, load_tokenizer
from ravnest_node.models.weight_files import index_directory, load_tensors, tensor_shape

__all__ = ["PretrainedModel"]

IGNORE = -100
"""Target value of positions that do not count in a token-level loss."""

_INIT_STD = 0.02  # BERT and Llama initialise new linear layers with this standard deviation


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

    def timing_blocks(self, *, device: torch.device | None = None) -> list[nn.Module]:
        """The embeddings, one layer listed for every layer, and the head, with their initial
        (random) values, on `device`: timing reads no weights and holds one layer, however
        many there are."""
        n = self.num_blocks()
        first, layer = self._build(0, 0, 2)
        blocks = [first, layer, *self._build(0, n - 1, n)]
        first, layer, last = (to_device(b, device) for b in blocks)
        return [first, *[layer] * self.layers, last]

    def build_stage(
        self, seed: int, start: int, stop: int, *, device: torch.device | None = None
    ) -> list[nn.Module]:
        """Blocks ``[start, stop)`` with their pretrained weights, on `device` (default: the
        CPU), reading only their tensors (no reading at all when built on the meta device, to
        count parameters). Tensors are read one at a time in the checkpoint's dtype and placed
        on `device` (a LoRA base quantised first, only its stored form placed): the host never
        holds more than one tensor beyond what it already placed. With ``adapter=DIR``, the
        LoRA adapters start from that PEFT adapter's values (adapter.py)."""
        n = self.num_blocks()
        if not 0 <= start < stop <= n:
            raise ValueError(f"stage range [{start}, {stop}) is not inside 0..{n} of {self.name!r}")
        if torch.empty(()).device.type == "meta":
            return self._build(seed, start, stop)
        entries = index_directory(self.spec.directory)
        return [self._load_block(i, seed, entries, device) for i in range(start, stop)]

    def _build(self, seed: int, start: int, stop: int) -> list[nn.Module]:
        """Blocks ``[start, stop)`` with their initial values, no weight read, built where
        torch's default device says."""
        blocks = []
        for i in range(start, stop):
            block, _, _ = self._block(i)
            if self.spec.lora is not None:
                made, _ = freeze(block, self.spec.lora, seed=seed, index=i,
                                 keep=self._trainable_new(i))  # fmt: skip
                self._check_adapters(i, block, made)
            blocks.append(block)
        return blocks

    def _check_adapters(self, i: int, block: nn.Module, made: int) -> None:
        """ConfigError if layer block `i` got no adapter: its targets name none of its linears."""
        if 0 < i <= self.layers and not made and self.spec.lora is not None:
            linears = sorted({n.rpartition(".")[2] for n, m in block.named_modules()
                              if isinstance(m, (nn.Linear, FrozenLinear))})  # fmt: skip
            raise ConfigError(
                f"model {self.name!r}: no linear layer of block {i} is named in "
                f"targets={'+'.join(self.spec.lora.targets)}; its linear layers: "
                f"{', '.join(linears)}"
            )

    def _load_block(
        self, i: int, seed: int, entries: Mapping[str, Path], device: torch.device | None
    ) -> nn.Module:
        """Block `i` built on the meta device, then given its tensors one at a time: read (or
        initialised) straight onto `device` in the checkpoint's dtype, then made float32;
        under LoRA each frozen linear layer is read on the host and stored as the base says
        before it is placed."""
        prefix = self._prefix()
        with shapes_only():
            block, names, new = self._block(i, prefix)
        source = self._sources(i, block, names, new, entries, seed)
        placed: set[str] = set()

        def fill(path: str, linear: nn.Linear) -> None:  # on the host: it is quantised next
            for leaf in ("weight", "bias"):
                if (k := f"{path}.{leaf}") in names:
                    _place(linear, leaf, source(k, None).float())
                    placed.add(k)

        if self.spec.lora is not None:
            made, _ = freeze(block, self.spec.lora, seed=seed, index=i,
                             keep=self._trainable_new(i), fill=fill, device=device)  # fmt: skip
            self._check_adapters(i, block, made)
            if self.spec.adapter:  # a run's start; a resume then loads its own checkpoints
                self._adapter_source.fill(i, block)
        for k in names:
            if k not in placed:
                _place(block, k, source(k, device).float())
        return to_device(block, device)  # what is not read (rotary frequencies)

    def _block(
        self, i: int, prefix: str | None = None
    ) -> tuple[nn.Module, dict[str, str], dict[str, str]]:
        """Block `i`, its tensors' checkpoint names (ours -> theirs, under `prefix`, default
        the checkpoint's) and the tensors the checkpoint may lack, with how to initialise them
        ("normal", "zeros", "ones", or "copy:<checkpoint name>")."""
        c, spec = self.spec.config, self.spec
        bert = spec.family == "bert"
        prefix = self._prefix() if prefix is None else prefix
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
            block = BertLayer(c) if bert else LlamaLayer(c, spec.family, layer)
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

    @functools.cached_property
    def _adapter_source(self) -> AdapterSource:
        """The adapter the run starts from (``adapter=DIR``), read and checked once."""
        assert self.spec.lora is not None  # (parse_spec refuses adapter= without lora=)
        layers = {i: self.adapted_layers(i) for i in range(self.num_blocks())}
        return AdapterSource(Path(self.spec.adapter).expanduser(), self.spec.lora, layers)

    def adapted_layers(self, i: int) -> list[Adapted]:
        """Block `i`'s LoRA adapters and their names in PEFT's layout (adapter.py); reads no
        file."""
        with shapes_only():
            block = self._build(0, i, i + 1)[0]
            _, names, _ = self._block(i, MODEL_PREFIX[self.spec.family])
        return adapted_layers(block, names)

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

    def _sources(self, i: int, block: nn.Module, names: Mapping[str, str],
                 new: Mapping[str, str], entries: Mapping[str, Path], seed: int
                 ) -> Callable[[str, torch.device | None], torch.Tensor]:  # fmt: skip
        """For block `i` (built on the meta device), a function of a tensor's name and a device
        to its value there, read from the checkpoint in its dtype (one tensor a call) or
        initialised; ConfigError, before anything is read, for a tensor the checkpoint lacks
        or one whose shape is not the block's (naming its file)."""
        shapes = {k: tuple(t.shape) for k, t in _tensors(block)}
        read: dict[str, str] = {}
        for k in names:
            how = new.get(k, "")
            copy = how.removeprefix("copy:") if how.startswith("copy:") else ""
            if copy in entries and (names[k] not in entries or self._tied()):
                read[k] = copy  # a tied head reads the embeddings, whatever the file holds
            elif names[k] in entries:
                read[k] = names[k]
            elif not how or copy:
                raise ConfigError(
                    f"{self.spec.directory}: the checkpoint has no tensor {names[k]!r} "
                    f"(block {i}, {k})"
                )
        for k, name in read.items():
            if (shape := tensor_shape(entries, name)) != shapes[k]:
                raise ConfigError(
                    f"{entries[name]}: tensor {name!r} (block {i}, {k}) has shape {shape}, "
                    f"the config says {shapes[k]}"
                )

        def source(k: str, device: torch.device | None = None) -> torch.Tensor:
            if k in read:
                return load_tensors(entries, [read[k]], device=device)[read[k]]
            shape, how = shapes[k], new.get(k, "")
            if how == "normal":
                value = torch.randn(shape, generator=seeded_generator(seed, i, k)) * _INIT_STD
            else:
                value = torch.zeros(shape) if how == "zeros" else torch.ones(shape)
            return value.to(device or "cpu")

        return source

    def _tied(self) -> bool:
        """Whether a decoder's LM head is its embeddings (``tie_word_embeddings``): the head
        then starts from them even where the file also holds an ``lm_head.weight``."""
        c = self.spec.config
        return self.spec.family != "bert" and bool(c.get("tie_word_embeddings", False))

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
    def dataset(self, *, seed: int, shard: int = 0, num_shards: int = 1, num_samples: int = 0,
                split: str = "train") -> Any:  # fmt: skip
        """The task's data (ravnest_node/data/text/), tokenised as the model expects; a
        causal-LM data file of conversations or prompt/completion pairs is chat data, rendered
        with the model's chat template, the loss on the assistant's tokens (data/text/chat.py).
        ``split="eval"``: the held-out data the spec's ``eval=`` names (a share of the data
        file, left out of the training split, or a file of its own), None without one."""
        from ravnest_node.data import text

        spec = self.spec
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if spec.eval and spec.task != "causal-lm":
            raise ConfigError(f"model {self.name!r}: eval= holds out causal-lm data only")
        if split == "eval" and not spec.eval:
            return None
        tokenizer = self.tokenizer()
        common: dict[str, Any] = dict(seed=seed, shard=shard, num_shards=num_shards)
        if spec.task == "classification":
            if not spec.data:
                raise ConfigError(f"model {self.name!r}: classification needs data=FILE.jsonl")
            pad_id = spec.config.get("pad_token_id")  # what the embeddings treat as padding
            if pad_id is None:
                raise ConfigError(f"model {self.name!r}: classification pads its samples, and "
                                  "the model's config.json has no pad_token_id")  # fmt: skip
            rows = text.read_jsonl(Path(spec.data).expanduser())
            examples = [(tokenizer.encode(t), label) for t, label in rows]
            return text.ClassificationData(
                examples, seq_len=spec.seq_len, pad_id=int(pad_id),
                cls_id=first_id(tokenizer), sep_id=last_id(tokenizer),
                num_labels=spec.num_labels, **common,
            )  # fmt: skip
        fraction = eval_fraction(spec.eval) if spec.eval else None
        source = spec.eval if split == "eval" and fraction is None else spec.data
        path = Path(source).expanduser()
        chat = text.read_chat_lines(path) if spec.task == "causal-lm" and source else None
        if chat is not None:  # conversations or prompt/completion pairs: the loss on replies
            if fraction is not None:
                train, held = text.hold_out(chat, fraction, where=str(path))
                chat = held if split == "eval" else train
            return text.chat_dataset(
                chat, path=path, directory=spec.directory, config=spec.config,
                tokenizer=tokenizer, seq_len=spec.seq_len, **common,
            )  # fmt: skip
        corpus = text.read_texts([path]) if source else text.stdlib_docstrings()
        ids = text.tokenize_corpus(tokenizer, corpus)
        if spec.task == "masked-lm":
            return text.MaskedLMData(ids, seq_len=spec.seq_len, tokenizer=tokenizer,
                                     num_samples=num_samples, **common)  # fmt: skip
        if fraction is not None:  # the last share of the tokens is held out
            cut = round(len(ids) * (1 - fraction))
            ids = ids[cut:] if split == "eval" else ids[:cut]
        return text.CausalLMData(ids, seq_len=spec.seq_len, num_samples=num_samples, **common)

    @property
    def held_out(self) -> bool:
        """The spec names held-out data (``eval=``)."""
        return bool(self.spec.eval)

    def eval_dataset(self, *, seed: int) -> Any:
        """The held-out data (``eval=``), None without."""
        return self.dataset(seed=seed, split="eval")

    def tokenizer(self) -> Any:
        """The tokenizer the spec names: WordPiece from vocab.txt, BPE from tokenizer.json, or
        bytes (tokenizer.py)."""
        return load_tokenizer(self.spec, self.name, self.vocab)

    def __repr__(self) -> str:
        return f"PretrainedModel({self.name!r})"


def _place(block: nn.Module, path: str, value: torch.Tensor) -> None:
    """Make `value` the parameter (trainable as the one it replaces) or buffer at `path`."""
    module, _, leaf = path.rpartition(".")
    owner = block.get_submodule(module)
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(
            value, requires_grad=old is None or old.requires_grad
        )
    else:
        owner._buffers[leaf] = value


def _tensors(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A block's parameters and persistent buffers, by name."""
    out: list[tuple[str, torch.Tensor]] = list(block.named_parameters())
    persistent = set(block.state_dict())
    out += [(k, b) for k, b in block.named_buffers() if k in persistent]
    return out
