"""The tokenizer an ``hf:`` model's data is cut with, as its spec names: the ``tokenizers``
library over the directory's ``tokenizer.json`` (any model type) or BERT's ``vocab.txt``
(`ravnest_node.data.tokenizer`), or bytes; and the tokens that frame a classification sample.
"""

from __future__ import annotations

from typing import Any

from ravnest_node.data.tokenizer import TextTokenizer
from ravnest_node.errors import ConfigError
from ravnest_node.models.pretrained.spec import PretrainedSpec

__all__ = ["ByteTokenizer", "first_id", "last_id", "load_tokenizer"]


def load_tokenizer(spec: PretrainedSpec, name: str, vocab: int) -> Any:
    """The tokenizer `spec` names, for model `name` with `vocab` token ids; ConfigError if the
    spec names none, its file is missing or bad, it has more token ids than the model, or a
    masked-LM model's tokenizer lacks [CLS], [SEP] or [MASK]."""
    if not spec.tokenizer:
        raise ConfigError(
            f"model {name!r}: say which tokenizer its data needs: the directory has no "
            "tokenizer.json (tokenizer=bpe); tokenizer=bytes for a model whose first 256 "
            "token ids are the byte values"
        )
    if spec.tokenizer == "bytes":
        if vocab < 256:
            raise ConfigError(f"model {name!r}: tokenizer=bytes needs a vocabulary of "
                              f"at least 256, the model has {vocab}")  # fmt: skip
        return ByteTokenizer(pad_id=spec.config.get("pad_token_id"))
    if spec.tokenizer == "bpe":
        path = spec.directory / "tokenizer.json"
        tokenizer = TextTokenizer.from_file(path)
    else:
        path = spec.directory / "vocab.txt"
        tokenizer = _bert_vocab(spec)
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"{path}: {tokenizer.vocab_size} token ids, more than the model's vocabulary of {vocab}"
        )
    if spec.task == "masked-lm":
        lacking = [k for k in ("cls", "sep", "mask") if getattr(tokenizer, f"{k}_id") is None]
        if lacking:
            raise ConfigError(f"{path}: masked-LM rows need the tokens it lacks: "
                              f"{', '.join(lacking)}")  # fmt: skip
    return tokenizer


def _bert_vocab(spec: PretrainedSpec) -> TextTokenizer:
    """BERT's WordPiece from the directory's ``vocab.txt``, lowercasing unless its
    ``tokenizer_config.json`` says ``do_lower_case: false``."""
    vocab = spec.directory / "vocab.txt"
    if not vocab.is_file():
        raise ConfigError(f"{spec.directory}: no vocab.txt for the WordPiece tokenizer")
    return TextTokenizer.from_vocab(vocab)


def first_id(tokenizer: Any) -> int | None:
    """The token a classification sample starts with: the one the tokenizer's template puts
    first (BERT's [CLS], Llama's BOS), as the model saw its text in pretraining; else None."""
    return tokenizer.bos_id if tokenizer.adds_bos else None


def last_id(tokenizer: Any) -> int | None:
    """The token a classification sample ends with: the template's last (BERT's [SEP], an EOS)."""
    return tokenizer.eos_id if tokenizer.adds_eos else None


class ByteTokenizer:
    """Token id = byte value of the UTF-8 text (for models whose first 256 ids are bytes)."""

    vocab_size = 256
    cls_id = sep_id = mask_id = bos_id = eos_id = None
    adds_bos = adds_eos = False
    fingerprint = "bytes"

    def __init__(self, pad_id: int | None = None) -> None:
        self.pad_id = pad_id

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def token_to_id(self, token: str) -> int | None:
        """The byte value of a one-byte `token`, else None."""
        data = token.encode("utf-8")
        return data[0] if len(data) == 1 else None
