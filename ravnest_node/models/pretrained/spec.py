"""What an ``hf:`` model name says, read and checked before any weight is.

A model name ``hf:DIR[,key=value...]`` names a directory in the Hugging Face layout
(``config.json`` and ``model.safetensors``, or ``model.safetensors.index.json`` and its shards)
that every node has a copy of, and how to fine-tune it:

==========  ==========================================================================
key         meaning (default)
==========  ==========================================================================
task        ``masked-lm``, ``causal-lm`` or ``classification`` (BERT: masked-lm; the
            decoders, Llama, Mistral, Qwen2 and Qwen3: causal-lm)
seq         tokens per sample (128)
labels      classes of a classification task (2)
lora        LoRA rank; 0 = full fine-tuning (0)
alpha       LoRA alpha (2 x rank)
targets     linear layers that get adapters, joined by ``+`` (BERT: query+value; the
            decoders: q_proj+v_proj)
base        storage of frozen weights under LoRA: fp32, bf16, int8 or nf4 (fp32)
adapter     a directory holding a LoRA adapter in PEFT's layout (``adapter_config.json``,
            ``adapter_model.safetensors``) to start from: its rank and targets must be the
            run's (adapter.py); none by default
data        a local ``.txt`` file (language modelling) or ``.jsonl`` file with ``text`` and
            ``label`` (classification); for causal-lm also a ``.jsonl`` file of conversations
            (``messages``) or ``prompt`` and ``completion`` pairs (data/text/chat.py);
            default: the docstrings of the standard library
eval        held-out data (causal-lm): a fraction of ``data`` (``0.05``) or a file like it
tokenizer   ``wordpiece`` (from ``vocab.txt``; cased if ``tokenizer_config.json`` says
            ``do_lower_case: false``; BERT's default), ``bpe`` (from ``tokenizer.json``,
            whatever model it names, read by the ``tokenizers`` library, data/tokenizer.py;
            Llama's default where the file is there) or ``bytes`` (token id = byte value)
==========  ==========================================================================

Also which local paths a name makes a node read, and the check that they lie inside the model
directories the node's operator allowed.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ravnest_node.errors import ConfigError
from ravnest_node.models.lora import LoRAConfig
from ravnest_node.models.pretrained.llama import FAMILIES as DECODERS

__all__ = [
    "PREFIX",
    "TASKS",
    "PretrainedSpec",
    "check_allowed",
    "eval_fraction",
    "local_paths",
    "parse_spec",
    "read_config",
    "without_lora",
]

PREFIX = "hf:"
"""Model names that start with this name a pretrained model directory."""

TASKS = ("masked-lm", "causal-lm", "classification")
"""Fine-tuning tasks."""


@dataclass(frozen=True, slots=True)
class PretrainedSpec:
    """What an ``hf:`` model name says (see the module docstring)."""

    directory: Path
    family: str
    task: str
    seq_len: int = 128
    num_labels: int = 2
    lora: LoRAConfig | None = None
    adapter: str = ""
    """A PEFT LoRA adapter directory the adapters start from ("": B starts at zero)."""
    data: str = ""
    eval: str = ""
    tokenizer: str = "wordpiece"
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


_FAMILY_DEFAULTS = {
    "bert": ("masked-lm", ("query", "value"), "wordpiece"),
    **{family: ("causal-lm", ("q_proj", "v_proj"), "") for family in DECODERS},
}
"""Per family: its default task, LoRA targets and tokenizer ("": bpe where the directory has a
``tokenizer.json``)."""


def parse_spec(name: str) -> PretrainedSpec:
    """The `PretrainedSpec` of an ``hf:DIR[,key=value...]`` model name; ConfigError, naming the
    part at fault, for a malformed name, a missing directory or an unsupported model."""
    if not name.startswith(PREFIX):
        raise ConfigError(f"not a pretrained model name (no {PREFIX!r} prefix): {name!r}")
    directory, *options = name[len(PREFIX) :].split(",")
    path = Path(directory).expanduser()
    config = read_config(path)
    family = _family(path, config)
    task, targets, tokenizer = _FAMILY_DEFAULTS[family]
    values = _options(name, options)
    task = values.get("task", task)
    if task not in TASKS or (family == "bert" and task == "causal-lm"):
        raise ConfigError(f"model {name!r}: task {task!r} is not one a {family} model can train")
    lora = _lora(name, values, targets)
    spec = PretrainedSpec(
        directory=path,
        family=family,
        task=task,
        seq_len=_int(values.get("seq", "128"), "seq", name, minimum=2, maximum=1 << 20),
        num_labels=_int(values.get("labels", "2"), "labels", name, minimum=2, maximum=1 << 16),
        lora=lora,
        adapter=values.get("adapter", ""),
        data=values.get("data", ""),
        eval=_held_out(name, values, task),
        tokenizer=values.get(
            "tokenizer", tokenizer or ("bpe" if (path / "tokenizer.json").is_file() else "")
        ),
        config=config,
    )
    _check_model(name, spec)
    return spec


def _family(path: Path, config: Mapping[str, Any]) -> str:
    """The family of the model in directory `path` (its ``model_type``); ConfigError for one
    this package does not write."""
    family = str(config.get("model_type", ""))
    if family not in _FAMILY_DEFAULTS:
        raise ConfigError(
            f"{path / 'config.json'}: model_type {family!r} is not supported; "
            f"supported: {', '.join(sorted(_FAMILY_DEFAULTS))}"
        )
    return family


_OPTION_KEYS = ("task", "seq", "labels", "lora", "alpha", "targets", "base", "adapter", "data",
                "eval", "tokenizer")  # fmt: skip


def eval_fraction(value: str) -> float | None:
    """The share of the data an ``eval=`` option holds out, or None if it names a file."""
    try:
        return float(value)
    except ValueError:
        return None


def _held_out(name: str, values: Mapping[str, str], task: str) -> str:
    """The ``eval=`` option: a fraction in (0, 1) of a ``data=`` file, or a file; ConfigError
    for another number, a fraction without a data file, an empty value, or a task other than
    causal-lm (the only one with held-out data)."""
    if "eval" in values and not values["eval"]:
        raise ConfigError(f"model {name!r}: eval= needs a fraction or a file")
    if "eval" in values and task != "causal-lm":
        raise ConfigError(f"model {name!r}: eval= holds out causal-lm data; task is {task}")
    value = values.get("eval", "")
    fraction = eval_fraction(value) if value else None
    if fraction is not None and not 0 < fraction < 1:
        raise ConfigError(f"model {name!r}: eval must be a fraction between 0 and 1 (or a "
                          f"file), got {value!r}")  # fmt: skip
    if fraction is not None and not values.get("data"):
        raise ConfigError(f"model {name!r}: eval={value} holds out a share of data=FILE")
    return value


def _options(name: str, options: Sequence[str]) -> dict[str, str]:
    """The ``key=value`` options of model `name`, by key; ConfigError for any other text."""
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in _OPTION_KEYS:
            raise ConfigError(
                f"model {name!r}: bad option {option!r}; options are key=value with key one of "
                f"{', '.join(_OPTION_KEYS)}"
            )
        values[key] = value
    return values


def _lora(name: str, values: Mapping[str, str], targets: tuple[str, ...]) -> LoRAConfig | None:
    """The LoRA the options ask for (`targets` unless they name some), or None for full
    fine-tuning; ConfigError for a bad rank or alpha, or LoRA options without a rank."""
    rank = _int(values.get("lora", "0"), "lora", name, minimum=0, maximum=4096)
    if rank:
        return LoRAConfig(
            rank=rank,
            alpha=_float(values.get("alpha", str(2 * rank)), "alpha", name),
            targets=tuple(values["targets"].split("+")) if "targets" in values else targets,
            base=values.get("base", "fp32"),
        )
    if any(key in values for key in ("base", "alpha", "targets", "adapter")):
        raise ConfigError(f"model {name!r}: alpha, targets, base and adapter need lora=RANK")
    return None


def _check_model(name: str, spec: PretrainedSpec) -> None:
    """ConfigError if `spec` asks what its model cannot do: a tokenizer we do not know,
    position embeddings other than absolute ones (BERT), or more tokens than it has
    positions."""
    path, config = spec.directory, spec.config
    if spec.tokenizer not in ("wordpiece", "bpe", "bytes", ""):
        raise ConfigError(f"model {name!r}: tokenizer must be wordpiece, bpe or bytes")
    if spec.family == "bert" and config.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"{path / 'config.json'}: only absolute position embeddings are "
                          "supported")  # fmt: skip
    limit = int(config.get("max_position_embeddings", spec.seq_len))
    if spec.seq_len > limit:
        raise ConfigError(f"model {name!r}: seq {spec.seq_len} exceeds the model's {limit}")


_LORA_KEYS = ("lora", "alpha", "targets", "base", "adapter")


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
    its data and eval files, its adapter); [] for other names. Parses nothing beyond the name."""
    if not name.startswith(PREFIX):
        return []
    directory, *options = name[len(PREFIX) :].split(",")
    paths = [Path(directory).expanduser()]
    for key in ("data=", "adapter="):
        paths += [Path(o[len(key) :]).expanduser() for o in options
                  if o.startswith(key) and o[len(key) :]]  # fmt: skip
    paths += [Path(o[len("eval=") :]).expanduser() for o in options
              if o.startswith("eval=") and o[len("eval=") :]
              and eval_fraction(o[len("eval=") :]) is None]  # fmt: skip
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
