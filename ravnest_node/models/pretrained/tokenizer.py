"""The tokenizer an ``hf:`` model's data is cut with: WordPiece from ``vocab.txt``, BPE from
``tokenizer.json``, or bytes, as its spec names; and the tokens that frame a classification
sample.
"""

from __future__ import annotations

import json
from typing import Any

from ravnest_node.errors import ConfigError
from ravnest_node.models.pretrained.spec import PretrainedSpec

__all__ = ["ByteTokenizer", "first_id", "last_id", "load_tokenizer"]


def load_tokenizer(spec: PretrainedSpec, name: str, vocab: int) -> Any:
    """The tokenizer `spec` names, for model `name` with `vocab` token ids; ConfigError if the
    spec names none, its file is missing or bad, or it has more token ids than the model."""
    if not spec.tokenizer:
        raise ConfigError(
            f"model {name!r}: say which tokenizer its data needs: the directory has no "
            "tokenizer.json (tokenizer=bpe); tokenizer=bytes for a model whose first 256 "
            "token ids are the byte values"
        )
    if spec.tokenizer == "bpe":
        return _bpe(spec, vocab)
    if spec.tokenizer == "bytes":
        if vocab < 256:
            raise ConfigError(f"model {name!r}: tokenizer=bytes needs a vocabulary of "
                              f"at least 256, the model has {vocab}")  # fmt: skip
        return ByteTokenizer(pad_id=spec.config.get("pad_token_id"))
    return _wordpiece(spec)


def _bpe(spec: PretrainedSpec, vocab: int) -> Any:
    """BPE from the directory's ``tokenizer.json``."""
    from ravnest_node.data.bpe import BpeTokenizer

    bpe = BpeTokenizer.from_file(spec.directory / "tokenizer.json")
    if bpe.vocab_size > vocab:
        raise ConfigError(
            f"{spec.directory / 'tokenizer.json'}: {bpe.vocab_size} token ids, "
            f"more than the model's vocabulary of {vocab}"
        )
    return bpe


def _wordpiece(spec: PretrainedSpec) -> Any:
    """WordPiece from the directory's ``vocab.txt``, lowercasing unless its
    ``tokenizer_config.json`` says ``do_lower_case: false``."""
    from ravnest_node.data.wordpiece import WordPiece

    vocab = spec.directory / "vocab.txt"
    if not vocab.is_file():
        raise ConfigError(f"{spec.directory}: no vocab.txt for the WordPiece tokenizer")
    lowercase = True
    settings = spec.directory / "tokenizer_config.json"
    if settings.is_file():
        try:
            lowercase = bool(json.loads(settings.read_text()).get("do_lower_case", True))
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{settings}: cannot read it: {exc}") from None
    return WordPiece.from_vocab(vocab, lowercase=lowercase)


def first_id(tokenizer: Any) -> int | None:
    """The token a classification sample starts with: WordPiece's [CLS], or the BOS a BPE
    tokenizer's template adds (as the model saw its text in pretraining)."""
    if hasattr(tokenizer, "adds_bos"):
        return tokenizer.bos_id if tokenizer.adds_bos else None
    return tokenizer.cls_id  # type: ignore[no-any-return]


def last_id(tokenizer: Any) -> int | None:
    """The token a classification sample ends with: WordPiece's [SEP], or a BPE template's EOS."""
    if hasattr(tokenizer, "adds_eos"):
        return tokenizer.eos_id if tokenizer.adds_eos else None
    return tokenizer.sep_id  # type: ignore[no-any-return]


class ByteTokenizer:
    """Token id = byte value of the UTF-8 text (for models whose first 256 ids are bytes)."""

    vocab_size = 256
    cls_id = sep_id = mask_id = None
    fingerprint = "bytes"

    def __init__(self, pad_id: int | None = None) -> None:
        self.pad_id = pad_id

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))
