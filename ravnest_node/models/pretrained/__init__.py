"""Pretrained transformers from a local Hugging Face directory, written as blocks.

A model name ``hf:DIR[,key=value...]`` names a directory in the Hugging Face layout that every
node has a copy of, and how to fine-tune it (the options: spec.py). Families, in our own compact
code: BERT-style encoders (``model_type`` "bert": learned positions, post-norm layers, GELU MLP;
bert.py) and Llama-style decoders ("llama": RMSNorm, rotary embeddings, SwiGLU MLP,
grouped-query attention; llama.py). Blocks: the embeddings, one per layer, the task's head
(`PretrainedModel`, model.py), with the tokenizer of its data (tokenizer.py). Padding travels
between stages as all-zero rows, with no mask tensor (padding.py).
"""

from ravnest_node.models.pretrained.model import PretrainedModel
from ravnest_node.models.pretrained.spec import (
    PREFIX,
    TASKS,
    PretrainedSpec,
    check_allowed,
    local_paths,
    parse_spec,
    read_config,
    without_lora,
)
from ravnest_node.models.pretrained.tokenizer import ByteTokenizer

__all__ = [
    "PREFIX",
    "TASKS",
    "ByteTokenizer",
    "PretrainedModel",
    "PretrainedSpec",
    "check_allowed",
    "local_paths",
    "parse_spec",
    "read_config",
    "without_lora",
]
