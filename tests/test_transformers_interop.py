"""Interop with the `transformers` package (a dev dependency): tiny random models built with its
own classes and saved with `save_pretrained` load in our compact code (models/pretrained/)
and give the same outputs in float32; `export_pretrained`'s directory loads back into
transformers without missing or unexpected keys and computes what our trained blocks compute.
Everything offline: no weights are downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ravnest_node.blocks import export_blocks
from ravnest_node.checkpoint import CheckpointDir
from ravnest_node.checkpoint.export import export_pretrained
from ravnest_node.models import get_model, run_blocks
from ravnest_node.models.lora import LoRALinear
from ravnest_node.models.pretrained import PretrainedModel
from ravnest_node.models.weight_files import index_directory
from ravnest_node.pipeline.run import TrainConfig

from .conftest import missing, require_module

transformers = require_module("transformers")
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
"""transformers 5 writes rope settings as ``rope_parameters`` (4 writes ``rope_theta`` and
``rope_scaling``, as the Hub's configs have them)."""

TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-5}
"""float32 against float32: the same math in another order."""

BERT: dict[str, Any] = {
    "vocab_size": 120, "hidden_size": 36, "num_hidden_layers": 3, "num_attention_heads": 3,
    "intermediate_size": 50, "max_position_embeddings": 32, "type_vocab_size": 2,
    "hidden_act": "gelu", "layer_norm_eps": 1e-12, "pad_token_id": 0,
}  # fmt: skip
"""Head size 12: not one of the usual 64."""

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
"""As Llama 3.1's config writes it, with a short original context so that the 6 frequencies
of a head of 12 fall in all three bands (kept, blended, divided by the factor)."""

LLAMA: dict[str, Any] = {
    "vocab_size": 160, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "rope_theta": 5000.0, "rope_scaling": LLAMA3_SCALING, "rms_norm_eps": 1e-5,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
"""Grouped-query attention (4 query heads share 2 key/value heads)."""

SEQ = 16


# ----- models made and saved by transformers ------------------------------------------------
def _randomise(model: Any, seed: int) -> Any:
    """`model` in eval mode with every parameter drawn anew (transformers starts norms at one
    and biases at zero, which would hide a norm or bias loaded into the wrong place)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            norm = "norm" in name.lower() and name.endswith("weight")
            p.copy_(1 + 0.1 * noise if norm else 0.1 * noise)
    return model.eval()


def _bert(cls: str, directory: Path, seed: int = 0, *, shard: str = "50GB", **config: Any
          ) -> Any:  # fmt: skip
    """A random `transformers.<cls>` of the BERT config (with `config` on top), saved in
    shards of at most `shard`."""
    model = getattr(transformers, cls)(transformers.BertConfig(**{**BERT, **config}))
    model = _randomise(model, seed)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard)
    return model


def _llama(cls: str, directory: Path, seed: int = 1, *, hub_config: bool = True,
           shard: str = "50GB", **config: Any) -> Any:  # fmt: skip
    """A random `transformers.<cls>` of the Llama config (with `config` on top), saved in
    shards of at most `shard`. With `hub_config`, config.json is rewritten in the form Llama
    3.1's own carries (``rope_theta`` and ``rope_scaling``; transformers 5 writes them as one
    ``rope_parameters`` object instead)."""
    model = getattr(transformers, cls)(transformers.LlamaConfig(**{**LLAMA, **config}))
    model = _randomise(model, seed)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard)
    if hub_config:
        path = directory / "config.json"
        saved = json.loads(path.read_text())
        rope = saved.pop("rope_parameters", None)
        if rope is not None:
            saved["rope_theta"] = rope.pop("rope_theta")
            saved["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
        path.write_text(json.dumps(saved))
    return model


def _ids(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Random token ids without the pad token 0."""
    return torch.randint(1, vocab, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _padded(ids: torch.Tensor, lengths: list[int], *, left: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`ids` with all but `lengths[i]` tokens of row i replaced by the pad token 0 (on the
    right, or on the left), and the attention mask transformers takes (1 = a real token)."""
    pos = torch.arange(ids.shape[1])[None, :]
    n = torch.tensor(lengths)[:, None]
    mask = pos >= ids.shape[1] - n if left else pos < n
    return ids.masked_fill(~mask, 0), mask.long()


def _model(name: str) -> PretrainedModel:
    model = get_model(name)
    assert isinstance(model, PretrainedModel)
    return model


def _ours(directory: Path, options: str = "") -> tuple[PretrainedModel, list[torch.nn.Module]]:
    """Our model of `directory` (``hf:DIR,seq=16`` plus `options`) and its blocks."""
    model = _model(f"hf:{directory},seq={SEQ}{options}")
    return model, model.build_blocks(0)


def _run(blocks: list[torch.nn.Module], ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return run_blocks(blocks, ids)


def _theirs(model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=ids, attention_mask=mask).logits
    return out


# ----- 1. BERT ------------------------------------------------------------------------------
def test_bert_masked_lm_logits_match_transformers(tmp_path: Path) -> None:
    theirs = _bert("BertForMaskedLM", tmp_path)
    _, blocks = _ours(tmp_path)
    assert len(blocks) == 2 + BERT["num_hidden_layers"]
    ids = _ids(3, BERT["vocab_size"], seed=2)
    torch.testing.assert_close(_run(blocks, ids), _theirs(theirs, ids), **TOL)
    # Padding: our all-zero rows against transformers' attention mask, real positions only.
    padded, mask = _padded(ids, [SEQ, 11, 4])
    real = mask.bool()
    ours, ref = _run(blocks, padded), _theirs(theirs, padded, mask)
    torch.testing.assert_close(ours[real], ref[real], **TOL)


# ----- 2. Llama -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [{"tie_word_embeddings": False}, {"tie_word_embeddings": True}, {"head_dim": 16}],
    ids=["untied", "tied", "head-dim-16"],
)
def test_llama_causal_lm_logits_match_transformers(tmp_path: Path, config: dict[str, Any]
                                                   ) -> None:  # fmt: skip
    theirs = _llama("LlamaForCausalLM", tmp_path, **config)
    tied = bool(config.get("tie_word_embeddings"))
    assert ("lm_head.weight" in index_directory(tmp_path)) != tied  # tied: ours copies it
    _, blocks = _ours(tmp_path)
    ids = _ids(2, LLAMA["vocab_size"], seed=4)
    torch.testing.assert_close(_run(blocks, ids), _theirs(theirs, ids), **TOL)
    for left in (False, True):  # padding: real positions only (positions count from 0 both)
        padded, mask = _padded(ids, [12, 5], left=left)
        real = mask.bool()
        ours, ref = _run(blocks, padded), _theirs(theirs, padded, mask)
        torch.testing.assert_close(ours[real], ref[real], **TOL)


def test_llama3_rope_scaling_changes_the_logits(tmp_path: Path) -> None:
    """The scaling is not a no-op at these sizes: without it the logits are far apart (so the
    test above would have caught a scaling left out)."""
    theirs = _llama("LlamaForCausalLM", tmp_path)
    plain = json.loads((tmp_path / "config.json").read_text())
    plain["rope_scaling"] = None
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(plain))
    (tmp_path / "plain" / "model.safetensors").symlink_to(tmp_path / "model.safetensors")
    ids = _ids(2, LLAMA["vocab_size"], seed=5)
    unscaled = _run(_ours(tmp_path / "plain")[1], ids)
    assert float((unscaled - _theirs(theirs, ids)).abs().max()) > 1e-2


def test_llama_config_as_transformers_5_writes_it(tmp_path: Path) -> None:
    if not TRANSFORMERS_5:  # (pyproject asks for 5)
        missing("transformers 4 writes rope_theta, rope_scaling")
    theirs = _llama("LlamaForCausalLM", tmp_path, hub_config=False)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    ids = _ids(2, LLAMA["vocab_size"], seed=6)
    torch.testing.assert_close(_run(_ours(tmp_path)[1], ids), _theirs(theirs, ids), **TOL)


@pytest.mark.parametrize(
    ("family", "lengths"), [("bert", [SEQ, 9, 2]), ("llama", [SEQ, 10, 1])], ids=["bert", "llama"]
)
def test_classification_pools_as_transformers(tmp_path: Path, family: str, lengths: list[int]
                                              ) -> None:  # fmt: skip
    """BERT pools the first ([CLS]) position, Llama the last real token. Right padding, as our
    data pads (ours takes Llama's last row that is not all zero; with left padding it would
    take a pad row, where transformers takes the last real token)."""
    if family == "bert":
        theirs, vocab = _bert("BertForSequenceClassification", tmp_path, num_labels=3), BERT
    else:
        theirs, vocab = _llama("LlamaForSequenceClassification", tmp_path, num_labels=3), LLAMA
    _, blocks = _ours(tmp_path, ",task=classification,labels=3")
    ids, mask = _padded(_ids(3, vocab["vocab_size"], seed=3), lengths)
    out = _run(blocks, ids)
    assert out.shape == (3, 3)
    torch.testing.assert_close(out, _theirs(theirs, ids, mask), **TOL)


# ----- 3. sharded checkpoints ---------------------------------------------------------------
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_a_sharded_checkpoint_loads_stage_by_stage(tmp_path: Path, family: str) -> None:
    if family == "bert":
        theirs = _bert("BertForMaskedLM", tmp_path, shard="20KB")
    else:
        theirs = _llama("LlamaForCausalLM", tmp_path, shard="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 5
    model, blocks = _ours(tmp_path)
    ids = _ids(2, theirs.config.vocab_size, seed=8)
    torch.testing.assert_close(_run(blocks, ids), _theirs(theirs, ids), **TOL)
    n = model.num_blocks()
    stages = [model.build_stage(0, a, b) for a, b in ((0, 2), (2, n - 1), (n - 1, n))]
    torch.testing.assert_close(_run([b for s in stages for b in s], ids), _theirs(theirs, ids),
                               **TOL)  # fmt: skip


# ----- 4. export round trip -----------------------------------------------------------------
def _train(
    model: PretrainedModel, blocks: list[torch.nn.Module], steps: int
) -> torch.optim.Optimizer:
    """A few AdamW steps of `blocks` on random tokens (a trained run, in one process)."""
    params = [p for b in blocks for p in b.parameters()]
    opt = torch.optim.AdamW(params, lr=2e-2)
    gen = torch.Generator().manual_seed(9)
    targets = model.target_spec(4)
    classes = model.spec.num_labels if model.spec.task == "classification" else model.vocab
    for _ in range(steps):
        x = torch.randint(1, model.vocab, (4, SEQ), generator=gen)
        y = torch.randint(0, classes, targets.shape, generator=gen)
        opt.zero_grad()
        loss = model.loss(run_blocks(blocks, x), y)
        torch.autograd.backward(loss)
        opt.step()
    return opt


EXPORTS = [
    pytest.param("bert", "BertForMaskedLM", "AutoModelForMaskedLM", "",
                 id="bert-full"),
    pytest.param("bert", "BertForMaskedLM", "AutoModelForMaskedLM",
                 ",lora=2,targets=query+value+intermediate", id="bert-lora"),
    pytest.param("bert", "BertForSequenceClassification", "AutoModelForSequenceClassification",
                 ",task=classification,labels=3,lora=2", id="bert-cls-lora"),
    pytest.param("llama", "LlamaForCausalLM", "AutoModelForCausalLM", "", id="llama-full"),
    pytest.param("llama", "LlamaForCausalLM", "AutoModelForCausalLM",
                 ",lora=2,targets=q_proj+v_proj+down_proj", id="llama-lora"),
    pytest.param("llama", "LlamaForSequenceClassification", "AutoModelForSequenceClassification",
                 ",task=classification,labels=3", id="llama-cls"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "source", "auto", "options"), EXPORTS)
def test_an_exported_run_loads_in_transformers(
    tmp_path: Path, family: str, source: str, auto: str, options: str
) -> None:
    """Checkpoints of two stages, written by our own CheckpointDir after a few steps, merged by
    `export_pretrained`: transformers loads every tensor it expects and nothing else, and its
    logits are our trained blocks' (LoRA folded in). The Llama source ties its embeddings."""
    src = tmp_path / "source"
    config: dict[str, Any] = {"num_labels": 3} if "Classification" in source else {}
    if family == "bert":
        _bert(source, src, **config)
    else:
        _llama(source, src, tie_word_embeddings=True, **config)
    name = f"hf:{src},seq={SEQ}{options}"
    model = _model(name)
    blocks = model.build_blocks(0)
    ids, mask = _padded(_ids(3, model.vocab, seed=10), [SEQ, 12, 7])
    before = _run(blocks, ids)
    steps, cut = 3, 2
    opt = _train(model, blocks, steps)
    if ",lora=" in options:  # the adapters trained (B starts at zero)
        adapters = [m for b in blocks for m in b.modules() if isinstance(m, LoRALinear)]
        assert adapters and all(bool(m.lora_b.detach().abs().max() > 0) for m in adapters)
    out = _export_two_stages(tmp_path, name, blocks, opt, steps, cut)

    loaded, info = getattr(transformers, auto).from_pretrained(out, output_loading_info=True)
    assert type(loaded).__name__ == source
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["missing_keys"] and not info["error_msgs"], info
    loaded.eval()
    ours = _run(blocks, ids)
    theirs = _theirs(loaded, ids, mask)
    assert not torch.allclose(ours, before, atol=1e-3)  # it trained
    if model.spec.task == "classification":
        torch.testing.assert_close(ours, theirs, **TOL)
    else:
        real = mask.bool()
        torch.testing.assert_close(ours[real], theirs[real], **TOL)
    # And the exported directory loads as a model of its own, in our code too.
    torch.testing.assert_close(_run(_ours(out, options.split(",lora")[0])[1], ids), ours, **TOL)


def _export_two_stages(
    tmp_path: Path, name: str, blocks: list[torch.nn.Module], opt: Any, steps: int, cut: int
) -> Path:
    """`blocks` trained `steps` steps with `opt`, checkpointed as two stages cut at `cut` (as
    two nodes would) and merged by `export_pretrained`: the exported directory."""
    run = TrainConfig(model=name).to_proto("fingerprint")
    for stage, (a, b) in enumerate(((0, cut), (cut, len(blocks)))):
        weights = export_blocks(torch.nn.Sequential(*blocks[a:b]), a, opt, steps)
        CheckpointDir(tmp_path / f"node-{stage}").save(
            weights, step=steps, run=run, pipeline=0, stage=stage, plan_epoch=1
        )
    out = tmp_path / "exported"
    result = export_pretrained(name, [tmp_path / "node-0", tmp_path / "node-1"], out)
    assert result["step"] == steps
    return out
