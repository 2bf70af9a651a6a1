"""Local text datasets for fine-tuning: masked-LM, causal-LM and sequence classification.

They keep the contract of `StdlibBytes` (ravnest_node/data/stdlib_bytes.py), which the pipeline
already drives: ``batch(step, batch_size) -> (inputs, targets)`` is a pure function of (seed,
shard, num_shards, step, batch_size) and the data, so any node, or a resumed run, makes step
``k``'s batch without replaying the steps before; ``sample_ids``, ``num_samples`` and
``fingerprint`` mean what they mean there. Every random draw comes from a `torch.Generator`
seeded from those values, never from the global generator.

The language-model datasets cut windows out of one token sequence, the whole corpus tokenized
once (`tokenize_corpus`). With ``num_shards > 1`` the sequence is cut into chunks dealt out in
turn, as `StdlibBytes` deals its bytes, so shards never share a token and each sees every part of
the corpus. With ``num_samples > 0`` a dataset is instead a fixed set of windows visited once per
epoch in a fresh order, and a sample is the same on every visit (its masking too), as aq-delta
needs. `ClassificationData` is always such a fixed set: its labelled examples, dealt out to the
shards one by one.

The corpora are local files (`read_texts`, `read_jsonl`) or `stdlib_docstrings`, English text
that every Python install has.

A causal-LM data file of conversations or prompt/completion pairs (JSON Lines) is chat data
(`ChatData`): rendered with the model's own chat template, the loss on the assistant's tokens.

Modules: corpus.py (reading and tokenizing a corpus), sampling.py (windows, epochs, seeds,
shards), masked_lm.py, causal_lm.py and classification.py (the three datasets), chat.py and
chat_template.py (chat data).
"""

from ravnest_node.data.text.causal_lm import CausalLMData
from ravnest_node.data.text.chat import ChatData, chat_dataset, hold_out, read_chat_lines
from ravnest_node.data.text.classification import ClassificationData
from ravnest_node.data.text.corpus import (
    Tokenizer,
    read_jsonl,
    read_texts,
    stdlib_docstrings,
    tokenize_corpus,
)
from ravnest_node.data.text.masked_lm import IGNORE_INDEX, MaskedLMData, MaskingVocab
from ravnest_node.data.text.sampling import TOKEN_SHARD_CHUNK

__all__ = [
    "IGNORE_INDEX",
    "TOKEN_SHARD_CHUNK",
    "CausalLMData",
    "ChatData",
    "ClassificationData",
    "MaskedLMData",
    "MaskingVocab",
    "Tokenizer",
    "chat_dataset",
    "hold_out",
    "read_chat_lines",
    "read_jsonl",
    "read_texts",
    "stdlib_docstrings",
    "tokenize_corpus",
]
