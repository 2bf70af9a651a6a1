"""Write a LoRA run's adapters as a PEFT adapter directory (`ravnest-node export --adapter`).

Where the merged export (export.py) folds the adapters into a full copy of the model, this
writes only the adapters, in the layout people share and load them in: PEFT's
``adapter_model.safetensors`` (A and B of every adapted layer, under the names PEFT gives them)
and ``adapter_config.json`` (models/pretrained/adapter.py). ``PeftModel.from_pretrained(base,
OUT)`` then computes what the run's blocks compute, and ``hf:DIR,lora=R,adapter=OUT`` starts
another run from it. The step is the merged export's: the newest at which the nodes'
checkpoints cover every block.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from ravnest_node.checkpoint.export import blocks_at
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.models.pretrained import PretrainedModel
from ravnest_node.models.pretrained.adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    peft_config,
)
from ravnest_node.state import write_atomic

__all__ = ["export_adapter"]


def export_adapter(model_name: str, state_dirs: Sequence[Path], out: Path) -> dict[str, Any]:
    """Write the LoRA adapters of the run of `model_name`, from the checkpoints in
    `state_dirs`, as a PEFT adapter in the directory `out`; returns what was written (step,
    tensors, file). ConfigError for a run that trains anything besides its adapters (a
    classifier, a masked-LM head's transform, a full fine-tune): a PEFT adapter would leave
    that out, and the merged export keeps it."""
    model = get_model(model_name)
    if not isinstance(model, PretrainedModel) or model.spec.lora is None:
        raise ConfigError(
            f"export --adapter needs a LoRA run of a pretrained model (hf:DIR,lora=RANK...), "
            f"not {model_name!r}"
        )
    config = peft_config(model.spec, str(model.spec.directory))
    step, weights = blocks_at(state_dirs, model)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(model.num_blocks()):
        params = {name: t for (role, name), t in weights[i].tensors.items() if role == "param"}
        layers = model.adapted_layers(i)
        adapters = {f"{a.path}.lora_{x}" for a in layers for x in "ab"}
        others = sorted(set(params) - adapters)
        if others:
            raise ConfigError(
                f"model {model_name!r} trains more than its adapters (block {i}: "
                f"{', '.join(others[:3])}); a PEFT adapter would leave that out: use the "
                "merged export (without --adapter)"
            )
        for a in layers:
            tensors[a.stem + ".lora_A.weight"] = params[f"{a.path}.lora_a"].float().contiguous()
            tensors[a.stem + ".lora_B.weight"] = params[f"{a.path}.lora_b"].float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    data = st_save(tensors, metadata={"format": "pt", "ravnest_step": str(step)})
    write_atomic(out / ADAPTER_WEIGHTS, data)
    write_atomic(out / ADAPTER_CONFIG, (json.dumps(config, indent=2) + "\n").encode())
    return {"step": step, "tensors": len(tensors), "file": str(out / ADAPTER_WEIGHTS)}
