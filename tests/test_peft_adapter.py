"""LoRA adapters as people use them: a run's adapters exported in PEFT's layout load with
`peft.PeftModel.from_pretrained` and compute what our blocks compute; a run starts from a PEFT
adapter (ours or one PEFT made) with the same outputs; adapters of another rank, other targets
or another base are refused. Tiny random Llamas built and saved by transformers; nothing is
downloaded."""

from __future__ import annotations

import json
import math
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ravnest_node.blocks import export_blocks
from ravnest_node.checkpoint import CheckpointDir
from ravnest_node.checkpoint.export import export_pretrained
from ravnest_node.checkpoint.peft_adapter import export_adapter
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.models.lora import LoRALinear
from ravnest_node.models.pretrained import PretrainedModel, check_allowed, local_paths
from ravnest_node.models.weight_files import tensor_table
from ravnest_node.pipeline.run import TrainConfig

from .conftest import NODE_ENV, demo_summaries, ravnest, require_module
from .test_pretrained import _first_step_loss
from .test_transformers_interop import SEQ, TOL, _ids, _llama, _run, _theirs, _train

transformers = require_module("transformers")
peft = require_module("peft", "PEFT adapters (an interop dev dependency)")

LORA = ",lora=2,alpha=3,targets=q_proj+v_proj+down_proj"
"""alpha / r = 1.5: not PEFT's default scaling, so a wrong alpha in the config shows."""


def _model(name: str) -> PretrainedModel:
    model = get_model(name)
    assert isinstance(model, PretrainedModel)
    return model


def _checkpoints(tmp_path: Path, name: str, model: PretrainedModel,
                 blocks: list[torch.nn.Module], opt: Any, steps: int) -> list[Path]:  # fmt: skip
    """Checkpoints of two stages of `blocks` after `steps` steps, written by our CheckpointDir
    as two nodes would; their state directories."""
    run, cut, n = TrainConfig(model=name).to_proto("fingerprint"), 2, model.num_blocks()
    dirs = []
    for stage, (a, b) in enumerate(((0, cut), (cut, n))):
        weights = export_blocks(torch.nn.Sequential(*blocks[a:b]), a, opt, steps)
        dirs.append(tmp_path / f"node-{stage}")
        CheckpointDir(dirs[-1]).save(weights, step=steps, run=run, pipeline=0, stage=stage,
                                     plan_epoch=1)  # fmt: skip
    return dirs


def _peft(src: Path, adapter: Path) -> Any:
    """The base model of `src` with the adapter in `adapter`, as PEFT loads it; fails on any
    warning of keys it missed or did not expect."""
    base = transformers.AutoModelForCausalLM.from_pretrained(src)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = peft.PeftModel.from_pretrained(base, adapter)
    keys = [str(w.message) for w in caught if "key" in str(w.message).lower()]
    assert not keys, keys
    return loaded.eval()


@pytest.fixture()
def trained(tmp_path: Path) -> dict[str, Any]:
    """A tiny Llama (untied head) trained 3 steps with LoRA in one process, checkpointed as two
    stages and exported as a PEFT adapter."""
    src = tmp_path / "source"
    _llama("LlamaForCausalLM", src, tie_word_embeddings=False)
    name = f"hf:{src},seq={SEQ}{LORA}"
    model = _model(name)
    blocks = model.build_blocks(0)
    opt = _train(model, blocks, 3)
    adapters = [m for b in blocks for m in b.modules() if isinstance(m, LoRALinear)]
    assert len(adapters) == 6 and all(bool(m.lora_b.abs().max() > 0) for m in adapters)
    dirs = _checkpoints(tmp_path, name, model, blocks, opt, 3)
    out = tmp_path / "adapter"
    result = export_adapter(name, dirs, out)
    assert result == {"step": 3, "tensors": 12, "file": str(out / "adapter_model.safetensors")}
    return {"src": src, "name": name, "blocks": blocks, "dirs": dirs, "out": out}


def test_an_exported_adapter_loads_in_peft_and_computes_our_model(
    tmp_path: Path, trained: dict[str, Any]
) -> None:
    """PEFT loads every key, and its logits are our blocks' and our merged export's, and not
    the base model's."""
    src, out = trained["src"], trained["out"]
    entries = tensor_table(out / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in entries
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in entries
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (2, 3, "CAUSAL_LM")
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert peft.LoraConfig.from_pretrained(out).r == 2  # PEFT reads the config itself

    ids = _ids(3, 160, seed=11)
    base = _theirs(transformers.AutoModelForCausalLM.from_pretrained(src).eval(), ids)
    theirs = _theirs(_peft(src, out), ids)
    ours = _run(trained["blocks"], ids)
    torch.testing.assert_close(theirs, ours, **TOL)
    assert float((theirs - base).abs().max()) > 1e-3  # the adapter changes the output
    merged = tmp_path / "merged"
    export_pretrained(trained["name"], trained["dirs"], merged)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    torch.testing.assert_close(_theirs(loaded, ids), theirs, **TOL)


@pytest.mark.parametrize("options", ["", ",alpha=7", ",alpha=3,rslora"], ids=str)
def test_a_run_starts_from_the_adapter(trained: dict[str, Any], options: str) -> None:
    """A run of the same base with adapter=OUT computes at step 0 what the trained blocks
    compute, whatever its own alpha (B is rescaled), and under PEFT's rsLoRA scaling."""
    out = trained["out"]
    if "rslora" in options:  # the same scaling, written as rsLoRA: alpha / sqrt(r) = 3 / 2
        config = json.loads((out / "adapter_config.json").read_text())
        config.update(use_rslora=True, lora_alpha=3 / 2 * 2**0.5)
        (out / "adapter_config.json").write_text(json.dumps(config))
        options = ""
    lora = LORA.replace(",alpha=3", "") + options
    blocks = _model(f"hf:{trained['src']},seq={SEQ}{lora},adapter={out}").build_blocks(0)
    ids = _ids(3, 160, seed=12)
    torch.testing.assert_close(_run(blocks, ids), _run(trained["blocks"], ids), **TOL)


def test_a_run_starts_from_an_adapter_peft_made(tmp_path: Path) -> None:
    """An adapter PEFT itself trained and saved (B not zero) gives our run PEFT's logits."""
    src = tmp_path / "source"
    base = _llama("LlamaForCausalLM", src, tie_word_embeddings=False)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj"],
                             task_type="CAUSAL_LM", init_lora_weights=False)  # fmt: skip
    theirs = peft.get_peft_model(base, config).eval()
    theirs.save_pretrained(tmp_path / "adapter")
    name = f"hf:{src},seq={SEQ},lora=4,targets=o_proj+k_proj+q_proj,adapter={tmp_path}/adapter"
    ids = _ids(2, 160, seed=13)
    torch.testing.assert_close(_run(_model(name).build_blocks(0), ids), _theirs(theirs, ids),
                               **TOL)  # fmt: skip


def _refusal(name: str) -> str:
    with pytest.raises(ConfigError) as info:
        _model(name).build_stage(0, 1, 2)
    return str(info.value)


def test_an_adapter_of_another_rank_targets_or_base_is_refused(
    tmp_path: Path, trained: dict[str, Any]
) -> None:
    src, out = trained["src"], trained["out"]
    targets = ",targets=q_proj+v_proj+down_proj"
    assert "r is 2, the run's rank is 4" in _refusal(f"hf:{src},lora=4{targets},adapter={out}")
    message = _refusal(f"hf:{src},lora=2,adapter={out}")
    assert "target_modules" in message and "adapter_config.json" in message
    # The same adapter on a base with a wider MLP: down_proj's A no longer fits.
    other = tmp_path / "wider"
    _llama("LlamaForCausalLM", other, intermediate_size=96)
    message = _refusal(f"hf:{other},lora=2{targets},adapter={out}")
    assert str(out / "adapter_model.safetensors") in message
    assert "'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight' has shape (2, 80)" in (
        message
    )
    with pytest.raises(ConfigError, match="adapter need lora=RANK"):
        _model(f"hf:{src},adapter={out}")


def test_a_run_that_trains_a_head_exports_no_adapter(tmp_path: Path) -> None:
    """A classifier trains in full beside its adapters: a PEFT adapter would lose it."""
    src = tmp_path / "source"
    _llama("LlamaForSequenceClassification", src, num_labels=3)
    name = f"hf:{src},seq={SEQ},task=classification,labels=3,lora=2"
    model = _model(name)
    blocks = model.build_blocks(0)
    dirs = _checkpoints(tmp_path, name, model, blocks, _train(model, blocks, 1), 1)
    with pytest.raises(ConfigError, match=r"score\.weight"):
        export_adapter(name, dirs, tmp_path / "adapter")


def test_three_nodes_export_an_adapter_peft_loads_and_a_run_starts_from_it(
    tmp_path: Path,
) -> None:
    """3 node processes train a byte-level Llama with LoRA; `ravnest-node export --adapter`
    (the CLI) writes an adapter that PEFT loads onto the base model and that changes its
    output. 3 nodes then start a run from it: their first step's loss is a single-process
    forward of the base with that adapter, not the base's. One of another rank is refused
    before any node trains."""
    src = tmp_path / "source"
    _llama("LlamaForCausalLM", src, tie_word_embeddings=False, vocab_size=260)
    name = f"hf:{src},seq=64,lora=8,tokenizer=bytes"
    out = tmp_path / "adapter"
    args = ("--nodes", "3", "--seed", "0", "--max-staleness", "0", "--codec", "none")
    first = demo_summaries(tmp_path, {"lora": (*args, "--model", name, "--steps", "3",
                                                "--lr", "1e-2")})  # fmt: skip
    assert first["lora"]["steps"] == 3
    nodes = [str(tmp_path / "lora" / f"node-{i}") for i in range(3)]
    done = subprocess.run(ravnest("export", "--adapter", "--model", name, "--out", str(out),
                                  *nodes), env=NODE_ENV, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tensors"] == 2 * 2 * 2  # q_proj, v_proj of 2 layers
    ids = _ids(2, 260, seed=14)
    base = _theirs(transformers.AutoModelForCausalLM.from_pretrained(src).eval(), ids)
    assert float((_theirs(_peft(src, out), ids) - base).abs().max()) > 1e-4

    started = f"{name},adapter={out}"
    second = demo_summaries(tmp_path, {"again": (*args, "--model", started, "--steps", "1")})
    loss = second["again"]["loss_history"][0]
    assert math.isclose(loss, _first_step_loss(_model(started)), rel_tol=1e-5)
    assert not math.isclose(loss, _first_step_loss(_model(name)), rel_tol=1e-3)
    refused = subprocess.run(
        ravnest("demo", "--work-dir", str(tmp_path / "refused"), *args, "--steps", "1",
                "--model", name.replace("lora=8", "lora=4") + f",adapter={out}"),
        env=NODE_ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "r is 8, the run's rank is 4" in refused.stderr


def test_a_node_reads_an_adapter_only_inside_its_model_directories(tmp_path: Path) -> None:
    """adapter=DIR is a path a run spec makes a node read, checked as the model's own."""
    name = f"hf:{tmp_path / 'models' / 'llama'},lora=2,adapter={tmp_path / 'elsewhere'}"
    assert tmp_path / "elsewhere" in local_paths(name)
    with pytest.raises(ConfigError, match=r"reads .*elsewhere"):
        check_allowed(name, [tmp_path / "models"])
    check_allowed(name, [tmp_path / "models", tmp_path / "elsewhere"])


@pytest.mark.parametrize(
    ("change", "message"),
    [({"peft_type": "IA3"}, "peft_type is 'IA3'"), ({"use_dora": True}, "use_dora is True"),
     ({"bias": "all"}, "bias is 'all'"), ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
     ({"lora_alpha": -1}, "lora_alpha must be a positive number")],
    ids=["ia3", "dora", "bias", "rank-pattern", "alpha"],
)  # fmt: skip
def test_an_adapter_that_is_not_plain_lora_is_refused(
    trained: dict[str, Any], change: dict[str, Any], message: str
) -> None:
    """What our adapters cannot compute (DoRA, trained biases, per-layer ranks) is refused,
    naming the config file, rather than loaded into a different model."""
    path = trained["out"] / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    refusal = _refusal(f"{trained['name']},adapter={trained['out']}")
    assert str(path) in refusal and message in refusal
