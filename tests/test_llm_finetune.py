"""Issue #32's run, whole: a Qwen3-family model saved by transformers with its own tokenizer and
chat template, LoRA-fine-tuned on chat JSONL by three node processes (`ravnest-node demo`);
the loss falls, and `ravnest-node export --adapter` writes an adapter that peft loads onto
the base and that changes its output the way the run trained it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from ravnest_node.data.text.chat_template import ChatTemplate
from ravnest_node.models import get_model

from .conftest import NODE_ENV, demo_summaries, ravnest, require_module
from .test_chat_data import conversation, make_tokenizer, write_jsonl

transformers = require_module("transformers")
peft = require_module("peft")


def make_qwen3(directory: Path) -> None:
    """A tiny random Qwen3 (per-head q/k RMSNorm, its own head_dim) with a ChatML tokenizer
    and template, both saved by transformers; weights drawn wider than transformers' init, so
    that the adapters have something to change within a short run."""
    fast = make_tokenizer(directory)
    config = transformers.Qwen3Config(
        vocab_size=len(fast), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
    model.save_pretrained(directory)


def test_three_nodes_fine_tune_a_qwen3_on_chat_and_peft_loads_the_adapter(tmp_path: Path) -> None:
    source = tmp_path / "qwen3"
    make_qwen3(source)
    assert json.loads((source / "config.json").read_text())["model_type"] == "qwen3"
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(k)} for k in range(16)])
    name = f"hf:{source},seq=64,lora=8,data={data}"
    runs = {"qwen3": ("--nodes", "3", "--seed", "0", "--model", name, "--steps", "30",
                      "--lr", "3e-2")}  # fmt: skip
    summary = demo_summaries(tmp_path, runs)["qwen3"]
    assert summary["steps"] == 30
    assert summary["final_loss"] < 0.5 * summary["initial_loss"], summary["loss_history"]

    out = tmp_path / "adapter"
    nodes = [str(tmp_path / "qwen3" / f"node-{i}") for i in range(3)]
    done = subprocess.run(ravnest("export", "--adapter", "--model", name, "--out", str(out),
                                  *nodes), env=NODE_ENV, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"]) == ("LORA", 8)

    # A user's conversation, rendered by the model's own template, through transformers.
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    rendered = tokenizer.apply_chat_template(conversation(3)[:2], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)  # fmt: skip
    ids = rendered["input_ids"]
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(source).eval()(ids).logits
        tuned_model = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(source), out
        ).eval()
        tuned = tuned_model(ids).logits
    assert float((tuned - base).abs().max()) > 1e-2
    # What the run taught it: the reply to that question, whose first token is "The".
    reply = tokenizer.encode("The capital", add_special_tokens=False)[0]
    p_tuned, p_base = (float(torch.softmax(t[0, -1], -1)[reply]) for t in (tuned, base))
    print(f"loss {summary['initial_loss']:.3f} -> {summary['final_loss']:.3f}; P(first reply "
          f"token) base {p_base:.4f}, with the adapter {p_tuned:.4f}")  # fmt: skip
    assert p_tuned > p_base

    # The merged export renders chat as the source did: its template travels with it.
    merged = tmp_path / "merged"
    done = subprocess.run(ravnest("export", "--model", name, "--out", str(merged), *nodes),
                          env=NODE_ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert ChatTemplate.from_directory(merged) is not None
    again = get_model(f"hf:{merged},seq=64,data={data}").dataset(seed=0)
    assert again.fingerprint == get_model(name).dataset(seed=0).fingerprint
