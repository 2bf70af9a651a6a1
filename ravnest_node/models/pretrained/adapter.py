"""LoRA adapters in PEFT's layout: the names, the config, and starting a run from one.

PEFT (Hugging Face's parameter-efficient fine-tuning library, the layout people share LoRA
adapters in) saves an adapter as a directory with ``adapter_config.json`` and
``adapter_model.safetensors``. Each adapted linear layer has two tensors named after its module
path in the transformers model, under ``base_model.model.``: ``<path>.lora_A.weight`` (shape
``[r, in]``) and ``<path>.lora_B.weight`` (``[out, r]``), e.g.
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` for a Llama. The layer then
computes ``W x + s B A x`` with ``s = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora`` (Kalajdzievski, "rsLoRA", arXiv 2312.03732). Ours is ``W x + (alpha / r) B A x``
(lora.py): the same layer as PEFT's with ``lora_alpha = alpha`` and no rsLoRA, which is what
`peft_config` writes.

`AdapterSource` reads such a directory (``adapter=DIR`` in an ``hf:`` name): its rank and
target modules must be the run's, its tensors exactly the run's adapters with their shapes
(ConfigError naming the file and the key otherwise, before any block is filled). A block's
adapters then start from its A and B, B rescaled so that the delta is PEFT's whatever the two
alphas: ``(alpha / r) B' A = s B A``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ravnest_node.errors import ConfigError
from ravnest_node.models.lora import LoRAConfig, LoRALinear
from ravnest_node.models.pretrained.llama import FAMILIES
from ravnest_node.models.pretrained.spec import PretrainedSpec
from ravnest_node.models.weight_files import load_tensors, tensor_table

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "MODEL_PREFIX",
    "PEFT_PREFIX",
    "Adapted",
    "AdapterSource",
    "adapted_layers",
    "peft_config",
]

ADAPTER_CONFIG = "adapter_config.json"
"""PEFT's adapter config file."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""PEFT's adapter tensors file."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the transformers model's module paths (its wrapper's attributes)."""

_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "classification": "SEQ_CLS", "masked-lm": None}
"""PEFT's task type of each task (it has none for masked-LM: a plain PeftModel)."""
_MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Adapted:
    """One adapted linear layer of a block: its path in our block, its PEFT key stem (the keys
    are ``stem + ".lora_A.weight"`` and ``".lora_B.weight"``) and the shapes of A and B."""

    path: str
    stem: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


MODEL_PREFIX = {"bert": "bert."} | dict.fromkeys(FAMILIES, "model.")
"""The path of a family's base model inside its task model (``LlamaForCausalLM.model``,
``Qwen3ForCausalLM.model``, ``BertForMaskedLM.bert``): PEFT names modules by where they are in
the task model, whatever prefix the checkpoint's tensors have."""


def adapted_layers(block: nn.Module, names: Mapping[str, str]) -> list[Adapted]:
    """The adapted linear layers of `block` (made by `freeze`, on any device, meta included),
    given its tensors' names in the task model (``q_proj.weight`` -> its path there)."""
    return [
        Adapted(path, PEFT_PREFIX + names[f"{path}.weight"].removesuffix(".weight"),
                tuple(m.lora_a.shape), tuple(m.lora_b.shape))
        for path, m in block.named_modules() if isinstance(m, LoRALinear)
    ]  # fmt: skip


def peft_config(spec: PretrainedSpec, base_model: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of the adapters of a run of `spec`, as PEFT's LoraConfig
    reads it, with ``base_model_name_or_path`` `base_model`: the same delta as ours (module
    docstring)."""
    lora = spec.lora
    if lora is None:
        raise ConfigError(f"{spec.directory}: a run without lora=RANK trains no adapters")
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA", "task_type": _TASK_TYPES[spec.task],
        "base_model_name_or_path": base_model, "revision": None, "inference_mode": True,
        "r": lora.rank, "lora_alpha": alpha, "lora_dropout": 0.0, "use_rslora": False,
        "target_modules": sorted(lora.targets), "bias": "none", "fan_in_fan_out": False,
        "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {},
    }  # fmt: skip


_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
"""The safetensors dtype names an adapter's A and B may be stored in."""


class AdapterSource:
    """A PEFT LoRA adapter directory checked against a run's model, whose A and B a block's
    adapters start from (`fill`)."""

    def __init__(self, directory: Path, lora: LoRAConfig, layers: Mapping[int, list[Adapted]]
                 ) -> None:  # fmt: skip
        """The adapter in `directory` for a run with adapters `lora`, whose block i's adapted
        layers are ``layers[i]``; ConfigError (module docstring) for one that is not."""
        self.directory = directory
        self.file = directory / ADAPTER_WEIGHTS
        self.scaling = _read_scaling(directory / ADAPTER_CONFIG, lora)
        self.entries = tensor_table(self.file)  # ConfigError naming the file if unreadable
        self.layers = dict(layers)
        self._check(lora)

    def _check(self, lora: LoRAConfig) -> None:
        """ConfigError naming the file and the key for a tensor the run lacks, one it has that
        the file lacks, or one of another shape."""
        wanted: dict[str, tuple[int, ...]] = {}
        for layers in self.layers.values():
            for a in layers:
                wanted[a.stem + ".lora_A.weight"] = a.a_shape
                wanted[a.stem + ".lora_B.weight"] = a.b_shape
        for key in sorted(self.entries):
            if key not in wanted:
                raise ConfigError(
                    f"{self.file}: tensor {key!r} is not one of the run's adapters (rank "
                    f"{lora.rank} on {'+'.join(lora.targets)} of every layer)"
                )
        for key, shape in wanted.items():
            if key not in self.entries:
                raise ConfigError(f"{self.file}: no tensor {key!r} (the run adapts that layer)")
            found, dtype = self.entries[key]
            if found != shape:
                raise ConfigError(
                    f"{self.file}: tensor {key!r} has shape {found}, the "
                    f"run's model has {shape} (an adapter of another base model?)"
                )
            if dtype not in _FLOAT_DTYPES:
                raise ConfigError(f"{self.file}: tensor {key!r} is not floating point")

    def fill(self, i: int, block: nn.Module) -> None:
        """Give block `i`'s adapters (built by `freeze`) the file's A and B, B rescaled to our
        scaling; read one layer's two tensors at a time."""
        for a in self.layers[i]:
            module = block.get_submodule(a.path)
            assert isinstance(module, LoRALinear)
            keys = (a.stem + ".lora_A.weight", a.stem + ".lora_B.weight")
            values = load_tensors(dict.fromkeys(keys, self.file), keys)
            with torch.no_grad():
                module.lora_a.copy_(values[keys[0]].float())
                module.lora_b.copy_(values[keys[1]].float() * (self.scaling / module.scaling))


def _read_scaling(path: Path, lora: LoRAConfig) -> float:
    """PEFT's scaling of the adapter whose config is `path`; ConfigError, naming the file and
    the key, for one that is not a plain LoRA of the run's rank and targets."""
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes")
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{path}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    r = config.get("r")
    if r != lora.rank or isinstance(r, bool):
        raise ConfigError(f"{path}: r is {r!r}, the run's rank is {lora.rank} (lora=)")
    targets = config.get("target_modules")
    if isinstance(targets, list) and set(targets) != set(lora.targets):
        raise ConfigError(
            f"{path}: target_modules {sorted(map(str, targets))} are not the run's "
            f"{sorted(lora.targets)} (targets=)"
        )
    for key in ("use_dora", "fan_in_fan_out", "lora_bias", "rank_pattern", "alpha_pattern",
                "modules_to_save"):  # fmt: skip
        if config.get(key):
            raise ConfigError(f"{path}: {key} is {config[key]!r}; only plain LoRA is supported")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"{path}: bias is {config['bias']!r}; only 'none' is supported")
    alpha = config.get("lora_alpha", 8)  # PEFT's default
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
        raise ConfigError(f"{path}: lora_alpha must be a positive number, got {alpha!r}")
    root = math.sqrt(lora.rank) if config.get("use_rslora") else lora.rank
    return float(alpha) / root
