"""Merge a fine-tuned pretrained model back into one Hugging Face directory.

After a run, each node holds checkpoints of its own stage (`<state-dir>/checkpoints`). `export`
gathers the newest step for which every block has a checkpoint, loads each block's trained
parameters onto the pretrained weights, folds LoRA adapters into their base weights
(``W + (alpha / r) B A``), and writes all tensors under their Hugging Face names as one
``model.safetensors`` (atomically), with the directory's ``config.json`` and tokenizer files:
the result loads as ``hf:OUT`` like the model it came from, or in any tool that reads the layout.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from ravnest_node.blocks import BlockWeights
from ravnest_node.checkpoint.store import CheckpointDir, CheckpointError
from ravnest_node.errors import ConfigError
from ravnest_node.models import BlockModel, get_model
from ravnest_node.models.lora import FrozenLinear, LoRALinear
from ravnest_node.models.pretrained import PretrainedModel
from ravnest_node.models.weight_files import index_directory, load_tensors
from ravnest_node.state import write_atomic

__all__ = ["export_pretrained"]

log = logging.getLogger(__name__)

_COPIED = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "generation_config.json")  # fmt: skip
"""The source directory's files an export carries over (where present): the template that
transformers 5 saves beside the tokenizer (`chat_template.jinja`) included, so that the
result renders chat data as the source did."""


def blocks_at(state_dirs: Sequence[Path], model: BlockModel
              ) -> tuple[int, dict[int, BlockWeights]]:  # fmt: skip
    """The newest step at which the checkpoints of one run under `state_dirs` cover every
    block, and each block's weights at that step (every file verified as a resume would; of
    replicas, the lowest pipeline's)."""
    found: dict[tuple[str, int], dict[int, tuple[int, BlockWeights]]] = {}
    for state_dir in state_dirs:
        for folder in (state_dir / "checkpoints", state_dir):
            if not folder.is_dir() or not any(folder.glob("step-*.json")):
                continue
            checkpoints = CheckpointDir(folder, path=folder)
            for step in checkpoints.steps():
                try:
                    manifest, blocks = checkpoints.load(step, model)
                except CheckpointError as exc:  # another model's, or damaged
                    log.warning("checkpoint left out: %s", exc)
                    continue
                slot = found.setdefault((manifest.run_key, step), {})
                for index, weights in blocks.items():
                    if index not in slot or manifest.pipeline < slot[index][0]:
                        slot[index] = (manifest.pipeline, weights)
    whole = [(step, key) for (key, step), blocks in found.items()
             if len(blocks) == model.num_blocks()]  # fmt: skip
    if not whole:
        have = {f"step {step}": sorted(b) for (_, step), b in sorted(found.items())}
        raise ConfigError(
            f"no step has a checkpoint of all {model.num_blocks()} blocks under "
            f"{', '.join(map(str, state_dirs))} (blocks found: {have or 'none'})"
        )
    step = max(step for step, _ in whole)
    runs = sorted(key for s, key in whole if s == step)
    if len(runs) > 1:
        raise ConfigError(
            f"checkpoints of {len(runs)} different runs (keys {', '.join(runs)}) each cover "
            f"step {step}: give the state directories of one run"
        )
    return step, {index: w for index, (_, w) in found[(runs[0], step)].items()}


def export_pretrained(model_name: str, state_dirs: Sequence[Path], out: Path) -> dict[str, Any]:
    """Write the fine-tuned model of `model_name` from the checkpoints in `state_dirs` to the
    directory `out`; returns what was written (step, tensors, bytes, file). Frozen weights are
    written as the source directory holds them (not their bf16 or int8 copies), adapters folded
    onto them, and tensors no block holds (a pooler under masked-LM) copied as they are."""
    model = get_model(model_name)
    if not isinstance(model, PretrainedModel):
        raise ConfigError(f"export needs a pretrained model (hf:DIR...), not {model_name!r}")
    step, weights = blocks_at(state_dirs, model)
    source = index_directory(model.spec.directory)
    tensors: dict[str, torch.Tensor] = {}
    covered: set[str] = set()
    for index in range(model.num_blocks()):
        block = model.build_stage(0, index, index + 1)[0]
        state = weights[index]
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.copy_(state.tensors[("param", name)])
        _, names, new = model._block(index)
        covered.update(names.values())

        def original(ours: str, names: Mapping[str, str] = names,
                     new: Mapping[str, str] = new) -> torch.Tensor | None:  # fmt: skip
            theirs = names.get(ours, "")
            if theirs not in source and new.get(ours, "").startswith("copy:"):
                theirs = new[ours][5:]
            if theirs not in source:
                return None
            return load_tensors(source, [theirs])[theirs].float()

        for ours, value in _merged(block, original).items():
            tensors[names[ours]] = value.contiguous()
    for theirs in sorted(set(source) - covered):
        tensors[theirs] = load_tensors(source, [theirs])[theirs]
    bias = "cls.predictions.bias"
    if model.spec.family == "bert" and model.spec.task == "masked-lm" and bias in tensors:
        # The decoder's own name for the trained output bias: transformers ties the two names
        # only while tie_word_embeddings is true, which it is not here (below).
        tensors["cls.predictions.decoder.bias"] = tensors[bias].clone()
    out.mkdir(parents=True, exist_ok=True)
    data = st_save(tensors, metadata={"format": "pt", "ravnest_step": str(step)})
    write_atomic(out / "model.safetensors", data)
    for file in _COPIED:
        path = model.spec.directory / file
        if path.is_file() and path.resolve() != (out / file).resolve():
            shutil.copyfile(path, out / file)
    config = json.loads((out / "config.json").read_text())
    if model.spec.task == "classification":
        config["num_labels"] = model.spec.num_labels
    else:  # the head was trained (or written) apart from the embeddings: keep it so on load
        config["tie_word_embeddings"] = False
    write_atomic(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    return {"step": step, "tensors": len(tensors), "bytes": len(data),
            "file": str(out / "model.safetensors")}  # fmt: skip


def _merged(
    block: torch.nn.Module, original: Callable[[str], torch.Tensor | None]
) -> dict[str, torch.Tensor]:
    """The block's tensors under the names a block without LoRA has: adapters folded onto the
    original weights (`original(name)`, or the stored copy where there is none), frozen
    weights back in float32."""
    out: dict[str, torch.Tensor] = {}
    folded: set[str] = set()
    for path, module in block.named_modules():
        prefix = f"{path}." if path else ""
        if any(prefix.startswith(f) for f in folded):
            continue
        if isinstance(module, LoRALinear | FrozenLinear):
            frozen = module.base if isinstance(module, LoRALinear) else module
            weight = original(prefix + "weight")
            if weight is None:
                weight = frozen.dense_weight()
            if isinstance(module, LoRALinear):
                with torch.no_grad():
                    weight = weight + module.scaling * (module.lora_b @ module.lora_a)
            out[prefix + "weight"] = weight
            if frozen.bias is not None:
                out[prefix + "bias"] = frozen.bias.float()
            folded.add(prefix)
    for name, tensor in block.state_dict().items():
        if not any(name.startswith(f) for f in folded):
            out[name] = tensor.detach().float()
    return out
