"""Chat and instruction data (data/text/chat.py, chat_template.py): conversations rendered with
the model's own chat template, the loss counting exactly the assistant's tokens, checked
against transformers' own assistant mask; cutting, skipping, bad input; and a Llama with a
ChatML tokenizer LoRA-fine-tuned on chat JSONL across 3 node processes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ravnest_node.data.text import ChatData, chat_dataset, read_chat_lines
from ravnest_node.data.text.chat_template import ChatTemplate, assistant_samples
from ravnest_node.data.tokenizer import TextTokenizer
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model, run_blocks
from ravnest_node.models.pretrained import local_paths as pretrained_paths

from .conftest import demo_summaries, require_module

transformers = require_module("transformers")
tk = require_module("tokenizers")

CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' %}"
    "{% generation %}{{- m['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML, as Qwen's templates write it, with transformers' ``{% generation %}`` markers
around what the assistant writes (for transformers' own assistant mask)."""

LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + "
    "'<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
"""Llama 3's template, abridged: no generation markers, the BOS token written by the template."""

CITIES = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
          ("Peru", "Lima"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
          ("Chile", "Santiago")]  # fmt: skip


def conversation(k: int) -> list[dict[str, str]]:
    """A multi-turn conversation: system, user, assistant, user, assistant."""
    country, city = CITIES[k % len(CITIES)]
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"What is the capital of {country}?"},
            {"role": "assistant", "content": f"The capital of {country} is {city}."},
            {"role": "user", "content": "Thanks! Say it once more."},
            {"role": "assistant", "content": f"{city}."}]  # fmt: skip


def make_tokenizer(directory: Path, *, template: str | None = CHATML) -> Any:
    """A byte-level BPE with ChatML's and Llama 3's special tokens, trained by the `tokenizers`
    library and saved by transformers (tokenizer.json, tokenizer_config.json and
    chat_template.jinja)."""
    corpus = " ".join(" ".join(m["content"] for m in conversation(k)) for k in range(8)) * 4
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
                        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator([corpus], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token="<|begin_of_text|>",
    )  # fmt: skip
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(directory)
    return fast


def make_model(directory: Path, *, template: str | None = CHATML) -> Any:
    """A tiny random Llama saved by transformers, with the tokenizer of `make_tokenizer`."""
    fast = make_tokenizer(directory, template=template)
    config = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights larger than transformers' init: a model with something to
        for name, p in model.named_parameters():  # adapt, whose logits are not all alike
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.3 * noise)
    model.save_pretrained(directory)
    return fast


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def data_of(directory: Path, path: Path, seq: int) -> ChatData:
    """The chat data of `path` for the model in `directory`, with the tokenizer a node loads."""
    lines = read_chat_lines(path)
    assert lines is not None
    return chat_dataset(lines, path=path, directory=directory,
                        config=json.loads((directory / "config.json").read_text()),
                        tokenizer=TextTokenizer.from_file(directory / "tokenizer.json"),
                        seq_len=seq, seed=0)  # fmt: skip


def counted(data: ChatData) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of every row, in file order (one shard)."""
    return [(data._rows[i], data._targets[i]) for i in range(len(data._rows))]


def test_the_loss_counts_exactly_the_assistant_tokens(tmp_path: Path) -> None:
    """Against transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` on
    the same template: the same ids, and a target counts exactly where the token it predicts
    is one the assistant wrote (its content and <|im_end|>); nothing of system or user."""
    fast = make_model(tmp_path)
    convs = [conversation(k) for k in range(4)]
    data = data_of(tmp_path, write_jsonl(tmp_path / "chat.jsonl",
                                         [{"messages": c} for c in convs]), 100)  # fmt: skip
    assert data.cut == data.skipped == 0
    end = fast.convert_tokens_to_ids("<|im_end|>")
    for conv, (x, y) in zip(convs, counted(data), strict=True):
        theirs = fast.apply_chat_template(conv, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)  # fmt: skip
        ids, mask = theirs["input_ids"], theirs["assistant_masks"]
        n = len(ids)
        assert x[: n - 1].tolist() == ids[:-1]
        assert (x[n - 1 :] == fast.pad_token_id).all()
        expected = [ids[t + 1] if mask[t + 1] else -100 for t in range(n - 1)]
        assert y[: n - 1].tolist() == expected
        assert (y[n - 1 :] == -100).all()
        # And as text: the assistant's turns and their end-of-turn token, nothing else.
        text = fast.decode([int(i) for i in y if i != -100])
        assert text == "".join(m["content"] + "<|im_end|>" for m in conv
                               if m["role"] == "assistant")  # fmt: skip
        assert sum(int(i) == end for i in y) == 2  # the two turns' ends, not the user's


def test_a_template_without_generation_markers(tmp_path: Path) -> None:
    """Llama 3's template marks nothing: each run of counted targets, decoded, is one assistant
    turn and its <|eot_id|>, in order; every system and user text lies outside them."""
    fast = make_model(tmp_path, template=LLAMA3)
    convs = [conversation(k) for k in range(3)]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    data = data_of(tmp_path, path, 100)
    for conv, (x, y) in zip(convs, counted(data), strict=True):
        ids = fast.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        assert x[: len(ids) - 1].tolist() == ids[:-1] and ids[0] == fast.bos_token_id
        runs: list[list[int]] = []
        for t, target in enumerate(y.tolist()):
            if target != -100:
                if not runs or y[t - 1] == -100:
                    runs.append([])
                runs[-1].append(target)
        assert [fast.decode(r) for r in runs] == [
            m["content"] + "<|eot_id|>" for m in conv if m["role"] == "assistant"
        ]
        rest = fast.decode([i for t, i in enumerate(ids[1:]) if y[t] == -100])
        assert all(m["content"] in rest for m in conv if m["role"] != "assistant")


def test_a_cut_conversation_keeps_the_assistant_tokens_inside_seq(tmp_path: Path) -> None:
    """A conversation longer than seq keeps the spans (whole or partial) inside seq; one whose
    only assistant turn lies beyond seq, and one without any, are skipped with a count; if
    all are skipped, ConfigError."""
    fast = make_model(tmp_path)
    conv = conversation(0)
    full = fast.apply_chat_template(conv, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)  # fmt: skip
    ids, mask = full["input_ids"], full["assistant_masks"]
    first = mask.index(1)
    seq = first + 2  # the first turn's first three tokens are targets, the rest is cut
    short = [conv[1], {"role": "assistant", "content": "Paris."}]
    late = [{"role": "user", "content": "What is the capital of France? " * 6}, conv[2]]
    rows = [{"messages": conv}, {"messages": late}, {"messages": conv[:2]}, {"messages": short}]
    data = data_of(tmp_path, write_jsonl(tmp_path / "chat.jsonl", rows), seq)
    assert (data.cut, data.skipped, data.num_samples) == (2, 2, 2)
    (x, y), _ = counted(data)
    assert x.tolist() == ids[:seq]
    assert y.tolist() == [ids[t + 1] if mask[t + 1] else -100 for t in range(seq)]
    assert sum(int(i) != -100 for i in y) == 3
    with pytest.raises(ConfigError, match=r"chat\.jsonl: no sample .*\(2 skipped\)"):
        data_of(tmp_path, write_jsonl(tmp_path / "chat.jsonl", rows[1:3]), seq)


def test_prompt_completion_lines(tmp_path: Path) -> None:
    """With a chat template: a user turn and an assistant turn. Without: the prompt, then the
    completion and EOS, the loss on the latter."""
    fast = make_model(tmp_path)
    row = {"prompt": "What is the capital of Peru?", "completion": "Lima."}
    data = data_of(tmp_path, write_jsonl(tmp_path / "pc.jsonl", [row]), 40)
    (_, y), = counted(data)  # fmt: skip
    assert fast.decode([int(i) for i in y if i != -100]) == "Lima.<|im_end|>"
    messages = [{"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"]}]  # fmt: skip
    assert data.fingerprint == data_of(tmp_path, write_jsonl(
        tmp_path / "m.jsonl", [{"messages": messages}]), 40).fingerprint  # fmt: skip

    plain = tmp_path / "plain"
    fast = make_model(plain, template=None)
    data = data_of(plain, write_jsonl(tmp_path / "pc.jsonl", [row]), 40)
    (_, y), = counted(data)  # fmt: skip
    n = len(fast.encode(row["prompt"]))
    assert (y[: n - 1] == -100).all()
    assert fast.decode([int(i) for i in y if i != -100]) == "Lima.<|im_end|>"
    with pytest.raises(ConfigError, match=r"chat\.jsonl:1: a conversation, and the model .* "
                                          "has no chat template"):  # fmt: skip
        data_of(plain, write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}]), 40)


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"chat\.jsonl:3: not a JSON object"),
    ('{"messages": "hi"}', r"chat\.jsonl:3: 'messages' must be a non-empty list"),
    ('{"messages": [{"content": "hi"}]}', r"chat\.jsonl:3: message 0 has no role"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}',
     r"chat\.jsonl:3: message 0 has an unknown role 'wizard'"),
    ('{"text": "hi"}', r"chat\.jsonl:3: needs 'messages', or 'prompt' and 'completion'"),
])  # fmt: skip
def test_a_bad_line_is_named_by_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(0)}, "", line])
    with pytest.raises(ConfigError, match=message):
        read_chat_lines(path)


def test_a_template_that_fails_is_named_with_the_line(tmp_path: Path) -> None:
    """A template that refuses a conversation (raise_exception) or cannot render it: the data
    file and line, and the template's file; one that is not Jinja: the template's file."""
    refusing = ("{%- if messages[0]['role'] != 'system' %}{{ raise_exception('needs a system "
                "turn') }}{%- endif %}" + CHATML)  # fmt: skip
    make_model(tmp_path, template=refusing)
    rows = [{"messages": conversation(0)}, {"messages": conversation(1)[1:]}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(
        ConfigError,
        match=r"chat\.jsonl:2: the chat template \(.*chat_template"
        r"\.jinja\) fails to render it: .*needs a system turn",
    ):
        data_of(tmp_path, path, 64)  # fmt: skip
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].nothing.deeper }}")
    with pytest.raises(ConfigError, match=r"chat\.jsonl:1: the chat template"):
        data_of(tmp_path, path, 64)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"chat_template\.jinja: the chat template is not "
                                          "valid Jinja"):  # fmt: skip
        data_of(tmp_path, path, 64)


def test_the_template_in_tokenizer_config_and_a_text_file(tmp_path: Path) -> None:
    """Older directories keep the template in tokenizer_config.json; a JSONL file of other
    objects stays text (read_chat_lines says None)."""
    fast = make_model(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    settings["chat_template"] = CHATML
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    template = ChatTemplate.from_directory(tmp_path)
    assert template is not None
    assert template.render(conversation(0), add_generation_prompt=False) == (
        fast.apply_chat_template(conversation(0), tokenize=False))  # fmt: skip
    assert read_chat_lines(write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}])) is None


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_alone(tmp_path: Path) -> None:
    """A template that writes an earlier assistant turn otherwise than as the last (Qwen3
    drops the reasoning of earlier turns): each turn is a sample with the context the model
    sees when it writes it, spans still exactly the turn."""
    rewriting = CHATML.replace(
        "m['content'] + '<|im_end|>' }}{% endgeneration %}",
        "('<think></think>' if loop.last else '') + m['content'] + '<|im_end|>' }}"
        "{% endgeneration %}",
    )  # fmt: skip
    make_tokenizer(tmp_path, template=rewriting)
    template = ChatTemplate.from_directory(tmp_path)
    assert template is not None
    samples, apart = assistant_samples(template, conversation(0))
    assert apart and len(samples) == 2
    # The whole conversation trains its last turn; the first turn trains in its own context.
    assert samples[0][0] == template.render(conversation(0), add_generation_prompt=False)
    assert samples[1][0].endswith("France?<|im_end|>\n<|im_start|>assistant\n<think></think>"
                                  "The capital of France is Paris.<|im_end|>")  # fmt: skip
    for (text, [(start, end)]), content in zip(samples, ["Paris.",
                                                         "The capital of France is Paris."],
                                               strict=True):  # fmt: skip
        assert text[start:end] == f"<think></think>{content}<|im_end|>"


def test_three_node_processes_learn_the_replies(tmp_path: Path) -> None:
    """The issue's run: a Llama saved by transformers with its ChatML tokenizer, LoRA-
    fine-tuned on chat JSONL by 3 node processes; the first step's loss equals one process's
    on the same batch (the -100 targets travel to the last stage) and the loss falls."""
    make_model(tmp_path / "llama")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(k)} for k in range(16)])
    name = f"hf:{tmp_path / 'llama'},seq=64,lora=8,data={path}"
    runs = {"chat": ("--nodes", "3", "--seed", "0", "--max-staleness", "0", "--codec", "none",
                     "--model", name, "--steps", "30", "--lr", "3e-2")}  # fmt: skip
    s = demo_summaries(tmp_path, runs)["chat"]
    model = get_model(name)
    x, y = model.dataset(seed=0).batch(0, 16)
    assert (y == -100).any() and (y != -100).any()
    blocks = model.build_blocks(0)
    with torch.no_grad():
        first = sum(float(model.loss(run_blocks(blocks, x[i : i + 4]), y[i : i + 4]))
                    for i in range(0, 16, 4)) / 4  # fmt: skip
    assert math.isclose(s["loss_history"][0], first, rel_tol=1e-5)
    assert s["final_loss"] < 0.5 * s["initial_loss"], s["loss_history"]


def test_a_held_out_share_or_file_gives_the_eval_data(tmp_path: Path) -> None:
    """eval=FRACTION holds out that share of the lines (the same whatever the seed, never
    trained on); eval=FILE reads a file of its own; text data holds out its last tokens."""
    make_model(tmp_path / "llama")
    more = [[{"role": "user", "content": f"And {k}?"}, {"role": "assistant", "content": f"{k}."}]
            for k in range(16)]  # fmt: skip
    lines = [{"messages": conversation(k)[:3] + more[k]} for k in range(16)]
    path = write_jsonl(tmp_path / "chat.jsonl", lines)
    base = f"hf:{tmp_path / 'llama'},seq=64,data={path}"
    model = get_model(f"{base},eval=0.25")
    train, held = model.dataset(seed=0), model.dataset(seed=0, split="eval")
    assert (train.num_samples, held.num_samples) == (12, 4)
    again = get_model(f"{base},eval=0.25").dataset(seed=5, split="eval")
    assert held.fingerprint == again.fingerprint  # whatever the seed
    rows = {tuple(r.tolist()) for r in train._rows}
    assert not rows & {tuple(r.tolist()) for r in held._rows}
    assert len(rows | {tuple(r.tolist()) for r in held._rows}) == 16
    assert get_model(base).dataset(seed=0, split="eval") is None

    other = write_jsonl(tmp_path / "eval.jsonl", [{"messages": conversation(3)}])
    model = get_model(f"{base},eval={other}")
    assert model.dataset(seed=0, split="eval").num_samples == 1
    assert model.dataset(seed=0).num_samples == 16  # a file of its own leaves data whole
    assert other in pretrained_paths(f"{base},eval={other}")

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    text_model = get_model(f"hf:{tmp_path / 'llama'},seq=16,data={corpus},eval=0.1")
    whole = get_model(f"hf:{tmp_path / 'llama'},seq=16,data={corpus}").dataset(seed=0)
    a, b = text_model.dataset(seed=0), text_model.dataset(seed=0, split="eval")
    assert a.num_tokens + b.num_tokens == whole.num_tokens
    assert b.num_tokens == round(0.1 * whole.num_tokens)


@pytest.mark.parametrize(("options", "message"), [
    (",eval=1.5", "eval must be a fraction between 0 and 1"),
    (",eval=0", "eval must be a fraction between 0 and 1"),
    (",eval=0.1", r"eval=0.1 holds out a share of data=FILE"),
    (",eval=", r"eval= needs a fraction or a file"),
    (",task=classification,eval=0.1", r"eval= holds out causal-lm data; task is classification"),
])  # fmt: skip
def test_bad_eval_options(tmp_path: Path, options: str, message: str) -> None:
    make_model(tmp_path)
    with pytest.raises(ConfigError, match=message):
        get_model(f"hf:{tmp_path},seq=16{options}")


@pytest.mark.parametrize("hostile", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append(1) }}",
    "{{ cycler.__init__.__globals__ }}",
])  # fmt: skip
def test_a_template_that_reaches_for_python_is_refused(tmp_path: Path, hostile: str) -> None:
    """The sandbox: a template reaching for Python's internals, or changing the messages, is
    refused naming the data line, and nothing is trained on it."""
    make_model(tmp_path, template=hostile + CHATML)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(0)}])
    with pytest.raises(ConfigError, match=r"chat\.jsonl:1: the chat template .* fails to render"):
        data_of(tmp_path, path, 64)


def test_a_conversation_holding_the_pad_token_is_refused(tmp_path: Path) -> None:
    """config.json's pad token inside a sample would be taken for padding by the blocks (an
    all-zero row): refused, naming the line."""
    make_model(tmp_path)
    talk = conversation(0)
    talk[2] = {"role": "assistant", "content": "Paris<|endoftext|> again."}
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation(1)}, {"messages": talk}])
    with pytest.raises(ConfigError, match=r"chat\.jsonl:2: the rendered sample holds the pad "):
        data_of(tmp_path, path, 64)


def test_without_an_eos_in_the_config_the_tokenizers_own_ends_a_completion(
    tmp_path: Path,
) -> None:
    """No template, no eos_token or pad_token in tokenizer_config.json and no pad_token_id in
    config.json: the completion still ends with the EOS the tokenizer knows (data/tokenizer.py
    guesses it from its name), counted in the loss, and rows are padded with the tokenizer's
    own pad token. (With config.json's pad_token_id on that same token the sample would be
    refused: the blocks would take the EOS for padding.)"""
    plain = tmp_path / "plain"
    make_model(plain, template=None)
    settings = json.loads((plain / "tokenizer_config.json").read_text())
    del settings["eos_token"], settings["pad_token"]
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    config = json.loads((plain / "config.json").read_text())
    config["pad_token_id"] = None
    (plain / "config.json").write_text(json.dumps(config))
    tokenizer = TextTokenizer.from_file(plain / "tokenizer.json")
    assert tokenizer.eos_id is not None
    row = {"prompt": "What is the capital of Peru?", "completion": "Lima."}
    data = data_of(plain, write_jsonl(tmp_path / "pc.jsonl", [row]), 40)
    (_, y), = counted(data)  # fmt: skip
    kept = [int(i) for i in y if i != -100]
    assert kept[-1] == tokenizer.eos_id and tokenizer.decode(kept[:-1]) == "Lima."
