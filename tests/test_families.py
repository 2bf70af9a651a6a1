"""The decoder families beyond Llama (Qwen2/Qwen2.5, Qwen3, Mistral: models/pretrained/llama.py)
against transformers' own classes: tiny random models saved with `save_pretrained`, loaded as
``hf:DIR`` and cut into stages, give transformers' logits in float32; LoRA with B = 0 changes
nothing; a trained run's merged export loads back into transformers. Offline, like
tests/test_transformers_interop.py, whose helpers these use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ravnest_node.cli.plan import pretrained_shape
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.models.lora import LoRALinear
from ravnest_node.models.pretrained import PretrainedModel
from ravnest_node.models.weight_files import index_directory

from .conftest import require_module
from .test_transformers_interop import (
    SEQ,
    TOL,
    _export_two_stages,
    _ids,
    _padded,
    _randomise,
    _run,
    _theirs,
    _train,
)

transformers = require_module("transformers")

COMMON: dict[str, Any] = {
    "vocab_size": 160, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "rope_theta": 5000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
"""Grouped-query attention (4 query heads share 2 key/value heads), head size 12."""

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", "Qwen2", {}),
    "qwen2-tied": ("Qwen2Config", "Qwen2", {"tie_word_embeddings": True}),
    "qwen2-window": ("Qwen2Config", "Qwen2", {"use_sliding_window": True, "sliding_window": 5,
                                              "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", "Qwen3", {"head_dim": 16}),
    "qwen3-bias": ("Qwen3Config", "Qwen3", {"head_dim": 8, "attention_bias": True}),
    "mistral": ("MistralConfig", "Mistral", {"sliding_window": None, "head_dim": 16}),
    "mistral-window": ("MistralConfig", "Mistral", {"sliding_window": 6}),
}  # fmt: skip
"""Per case: the config class, the class prefix and the config on top of `COMMON`. Qwen3's
head_dim differs from hidden/heads; the windows are shorter than the sequence (Qwen's from
layer 1 on), so a window left out or off by one changes the logits."""


def _family(case: str, head: str, directory: Path, seed: int = 3, **config: Any) -> Any:
    """A random `transformers` model of `case` with `head` ("ForCausalLM", ...), saved."""
    config_class, prefix, extra = FAMILIES[case]
    cfg = getattr(transformers, config_class)(**{**COMMON, **extra, **config})
    model = _randomise(getattr(transformers, prefix + head)(cfg), seed)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _model(name: str) -> PretrainedModel:
    model = get_model(name)
    assert isinstance(model, PretrainedModel)
    return model


def _stages(model: PretrainedModel) -> list[torch.nn.Module]:
    """The model's blocks, built as three stages would build them."""
    n = model.num_blocks()
    return [b for a, z in ((0, 2), (2, n - 1), (n - 1, n)) for b in model.build_stage(0, a, z)]


@pytest.mark.parametrize("case", list(FAMILIES))
def test_logits_match_transformers_stage_by_stage(tmp_path: Path, case: str) -> None:
    theirs = _family(case, "ForCausalLM", tmp_path)
    tied = bool(theirs.config.tie_word_embeddings)
    assert ("lm_head.weight" in index_directory(tmp_path)) != tied
    model = _model(f"hf:{tmp_path},seq={SEQ}")
    assert model.spec.family == FAMILIES[case][1].lower()
    blocks = _stages(model)
    ids = _ids(2, COMMON["vocab_size"], seed=4)
    torch.testing.assert_close(_run(blocks, ids), _theirs(theirs, ids), **TOL)
    padded, mask = _padded(ids, [12, 5])  # right padding: real positions only
    real = mask.bool()
    torch.testing.assert_close(_run(blocks, padded)[real], _theirs(theirs, padded, mask)[real],
                               **TOL)  # fmt: skip
    # LoRA on the default targets (q_proj, v_proj) with B = 0 computes the same.
    lora = _model(f"hf:{tmp_path},seq={SEQ},lora=4")
    lora_blocks = _stages(lora)
    adapters = [m for b in lora_blocks for m in b.modules() if isinstance(m, LoRALinear)]
    assert len(adapters) == 2 * COMMON["num_hidden_layers"]
    torch.testing.assert_close(_run(lora_blocks, ids), _theirs(theirs, ids), **TOL)


def test_the_window_and_the_qk_norms_are_not_no_ops(tmp_path: Path) -> None:
    """Without Mistral's or Qwen2's window, or Qwen3's q/k norms (read as a Llama), the logits
    are far apart (so the test above would have caught any of them left out)."""
    ids = _ids(2, COMMON["vocab_size"], seed=5)
    for case, change in (("mistral-window", {"sliding_window": None}),
                         ("qwen2-window", {"use_sliding_window": False}),
                         ("qwen3", {"model_type": "llama"})):  # fmt: skip
        directory = tmp_path / case
        theirs = _family(case, "ForCausalLM", directory)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **change}))
        ours = _run(_model(f"hf:{directory},seq={SEQ}").build_blocks(0), ids)
        assert float((ours - _theirs(theirs, ids)).abs().max()) > 1e-2, case


@pytest.mark.parametrize("case", ["qwen2", "qwen3", "mistral-window"])
def test_classification_pools_as_transformers(tmp_path: Path, case: str) -> None:
    theirs = _family(case, "ForSequenceClassification", tmp_path, num_labels=3)
    blocks = _stages(_model(f"hf:{tmp_path},seq={SEQ},task=classification,labels=3"))
    ids, mask = _padded(_ids(3, COMMON["vocab_size"], seed=3), [SEQ, 10, 1])
    torch.testing.assert_close(_run(blocks, ids), _theirs(theirs, ids, mask), **TOL)


@pytest.mark.parametrize("case", ["qwen2-tied", "qwen3-bias", "mistral"])
def test_a_merged_lora_export_loads_in_transformers(tmp_path: Path, case: str) -> None:
    """A few LoRA steps (on every attention projection, biases and q/k norms frozen beside
    them), checkpointed as two stages and merged: transformers loads exactly its tensors and
    computes what our trained blocks compute."""
    src = tmp_path / "source"
    _family(case, "ForCausalLM", src)
    name = f"hf:{src},seq={SEQ},lora=2,targets=q_proj+k_proj+v_proj+o_proj"
    model = _model(name)
    blocks = model.build_blocks(0)
    ids, mask = _padded(_ids(3, model.vocab, seed=10), [SEQ, 12, 7])
    before = _run(blocks, ids)
    steps = 3
    opt = _train(model, blocks, steps)
    out = _export_two_stages(tmp_path, name, blocks, opt, steps, cut=2)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(loaded).__name__ == FAMILIES[case][1] + "ForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    ours, real = _run(blocks, ids), mask.bool()
    assert not torch.allclose(ours, before, atol=1e-3)  # it trained
    torch.testing.assert_close(ours[real], _theirs(loaded.eval(), ids, mask)[real], **TOL)


def test_a_family_we_do_not_have_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**COMMON, "model_type": "gemma3"}))
    with pytest.raises(ConfigError, match=r"model_type 'gemma3' is not supported; supported: "
                                          r"bert, llama, mistral, qwen2, qwen3"):  # fmt: skip
        get_model(f"hf:{tmp_path}")


@pytest.mark.parametrize("case", ["mistral-window", "qwen3"])
def test_plan_counts_every_parameter_of_the_family(tmp_path: Path, case: str) -> None:
    """`plan` of hf:DIR: Mistral by the Llama formulas, Qwen3 (whose head_dim is not
    hidden/heads) measured on its timing blocks; both count the model's parameters."""
    _family(case, "ForCausalLM", tmp_path / case)
    name = f"hf:{tmp_path / case},seq={SEQ}"
    assert pretrained_shape(name).params == get_model(name).num_parameters()
