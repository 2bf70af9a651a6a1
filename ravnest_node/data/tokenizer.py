"""The tokenizer a text dataset is cut with: the Hugging Face ``tokenizers`` library itself, so a
node's ids are the ids the model's users get from ``AutoTokenizer``.

Two sources, as a pretrained model's directory has them:

- a ``tokenizer.json`` (`TextTokenizer.from_file`): whatever model the file names (BPE,
  WordPiece, Unigram, WordLevel) with its normalizer, pre-tokenizer, post-processor, decoder and
  added tokens, read by ``tokenizers.Tokenizer``; the ``tokenizer_config.json`` beside it, if
  any, names the BOS, EOS, padding, [CLS], [SEP] and [MASK] tokens;
- BERT's ``vocab.txt`` (`TextTokenizer.from_vocab`): the library's WordPiece built as
  transformers' ``BertTokenizer`` builds it (``BertNormalizer`` lowercasing per
  ``do_lower_case``, ``BertPreTokenizer``, the "##" continuation prefix, [UNK], the template
  ``[CLS] $A [SEP]``).

The contract the data code relies on (`ravnest_node.data.text`):

- ``encode(text) -> list[int]``: the ids of ``tokenizer(text, add_special_tokens=False)``: no
  template tokens added, but added and special tokens written in the text ("<|im_start|>",
  "[MASK]") are matched as their single ids, as the library does;
- ``token_to_id(token) -> int | None``, ``vocab_size``, ``fingerprint``;
- the framing ids ``bos_id``, ``eos_id``, ``adds_bos``, ``adds_eos``, ``pad_id``, ``cls_id``,
  ``sep_id``, ``mask_id``, ``unk_id`` (None where the tokenizer has none) and ``special_ids``.

A file's ``truncation`` and ``padding`` settings are switched off: the datasets cut and pad
their windows themselves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from ravnest_node.errors import ConfigError

__all__ = ["BERT_SPECIAL_TOKENS", "MAX_FILE_BYTES", "TextTokenizer"]

MAX_FILE_BYTES = 64 << 20
"""The largest tokenizer.json read (Llama 3's is 9 MB, Gemma 3's 33 MB)."""

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""The tokens every BERT ``vocab.txt`` must hold."""

_NAMES = {
    "bos_token": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos_token": ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>"),
    "pad_token": ("<pad>", "<|pad|>", "[PAD]"),
    "cls_token": ("[CLS]",),
    "sep_token": ("[SEP]",),
    "mask_token": ("[MASK]", "<mask>"),
    "unk_token": ("[UNK]", "<unk>"),
}
"""Tokens taken for each role when tokenizer_config.json does not name one."""


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the framing ids the datasets need (see the module).

    Pure and deterministic: the same text gives the same ids on every node with the same
    library version. The library's ``encode`` takes ``&self``: threads may share one.
    """

    def __init__(
        self, library: tokenizers.Tokenizer, config: dict[str, Any], *, where: str = ""
    ) -> None:
        """Wrap `library`, with the token names of a tokenizer_config.json's `config`. Raises
        `ConfigError` (prefixed with `where`) if `config` names a token the vocabulary lacks."""
        library.no_truncation()
        library.no_padding()
        self._library = library
        vocab = library.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values(), default=-1) + 1
        self._fingerprint = hashlib.sha256(library.to_str().encode()).hexdigest()[:16]
        added = library.get_added_tokens_decoder()
        special = {i for i, t in added.items() if t.special}
        if isinstance(library.model, tokenizers.models.WordPiece):
            # BERT's [unused0]...: tokens plain text never encodes to.
            special |= {i for t, i in vocab.items() if len(t) > 2 and t[0] == "[" and t[-1] == "]"}
        self._special_ids = frozenset(special)
        self._before, self._after = _template(library)
        ids: dict[str, int | None] = {}
        for key, names in _NAMES.items():
            ids[key] = self._config_id(config, key, names, where)
        if ids["bos_token"] is None:
            ids["bos_token"] = self._before[0] if self._before else None
        if ids["eos_token"] is None:
            ids["eos_token"] = self._after[-1] if self._after else None
        self._ids = ids

    @classmethod
    def from_file(cls, path: Path) -> TextTokenizer:
        """The tokenizer of a ``tokenizer.json``, with the token names of the
        ``tokenizer_config.json`` beside it if there is one. Raises `ConfigError` naming the file
        and the library's message if a file cannot be read, or is larger than
        `MAX_FILE_BYTES`."""
        path = Path(path)
        try:
            size = path.stat().st_size
            text = path.read_text(encoding="utf-8") if size <= MAX_FILE_BYTES else ""
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read it: {exc}") from None
        if size > MAX_FILE_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB")
        try:
            library = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise ConfigError(f"{path}: the tokenizers library cannot read it: {exc}") from None
        config_path = path.with_name("tokenizer_config.json")
        config = _read_config(config_path) if config_path.is_file() else {}
        try:  # the first encodes: a model the library parses but cannot run (no [UNK] in it)
            return cls(library, config, where=f"{config_path}: ")
        except ConfigError:
            raise
        except Exception as exc:  # the library raises a bare Exception
            raise ConfigError(f"{path}: the tokenizers library cannot use it: {exc}") from None

    @classmethod
    def from_vocab(cls, path: Path, *, lowercase: bool | None = None) -> TextTokenizer:
        """BERT's tokenizer of a ``vocab.txt`` (one token per line, a token's id its line number
        counted from 0, read by the library's ``WordPiece.read_file``), lowercasing as
        `lowercase` says, else as the ``do_lower_case`` of the ``tokenizer_config.json`` beside
        it (default: lowercase, as BERT's uncased models). Raises `ConfigError` naming the file
        if it cannot be read or lacks a token of `BERT_SPECIAL_TOKENS`."""
        path = Path(path)
        try:
            vocab = tokenizers.models.WordPiece.read_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for a missing/bad file
            raise ConfigError(f"cannot read the vocabulary {path}: {exc}") from None
        if lowercase is None:
            config_path = path.with_name("tokenizer_config.json")
            config = _read_config(config_path) if config_path.is_file() else {}
            lowercase = bool(config.get("do_lower_case", True))
        try:
            return cls.wordpiece(vocab, lowercase=lowercase)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def wordpiece(
        cls, vocab: Sequence[str] | dict[str, int], *, lowercase: bool = True
    ) -> TextTokenizer:
        """BERT's tokenizer of `vocab` (tokens by id, or a list whose token ``i`` has id ``i``; a
        repeated token keeps its last id, as the library reads vocab.txt), built as
        transformers' ``BertTokenizer`` builds it. Raises `ConfigError` if a token of
        `BERT_SPECIAL_TOKENS` is missing."""
        if not isinstance(vocab, dict):
            vocab = {token: i for i, token in enumerate(vocab)}
        missing = [t for t in BERT_SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise ConfigError(f"the vocabulary lacks the special tokens {', '.join(missing)}")
        m = tokenizers
        library = m.Tokenizer(m.models.WordPiece(vocab, unk_token="[UNK]"))
        library.normalizer = m.normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
        )
        library.pre_tokenizer = m.pre_tokenizers.BertPreTokenizer()
        library.decoder = m.decoders.WordPiece(prefix="##")
        library.add_special_tokens(
            [m.AddedToken(t, special=True, normalized=False) for t in BERT_SPECIAL_TOKENS]
        )
        library.post_processor = m.processors.TemplateProcessing(
            single="[CLS]:0 $A:0 [SEP]:0",
            pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        return cls(library, {})

    def _config_id(
        self, config: dict[str, Any], key: str, names: Iterable[str], where: str
    ) -> int | None:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            found = [i for i in map(self._library.token_to_id, names) if i is not None]
            return found[0] if found else None
        token_id = self._library.token_to_id(value) if isinstance(value, str) else None
        if token_id is None:
            raise ConfigError(f"{where}{key} {value!r:.60} is not a token of the vocabulary")
        return token_id

    # -- the contract --

    def encode(self, text: str) -> list[int]:
        """The ids of `text` without the template's tokens; added and special tokens written in
        the text are matched as their ids (the library's ``encode(text, add_special_tokens=
        False)``)."""
        try:
            return self._library.encode(text, add_special_tokens=False).ids
        except Exception as exc:  # the library raises a bare Exception (a token it lacks)
            raise ConfigError(f"the tokenizer cannot encode {text[:40]!r}: {exc}") from None

    def token_to_id(self, token: str) -> int | None:
        """The id of `token` (of the vocabulary or an added token), None if it has none."""
        return self._library.token_to_id(token)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids` through the tokenizer's decoder."""
        return self._library.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of token ids: the largest id of the vocabulary and added tokens, plus one."""
        return self._vocab_size

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of the library's serialization of the tokenizer
        (everything that decides the ids): equal fingerprints give equal ids for every text."""
        return self._fingerprint

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special, and of a WordPiece vocabulary's bracketed
        tokens (BERT's ``[unused0]``...)."""
        return self._special_ids

    @property
    def bos_id(self) -> int | None:
        """tokenizer_config.json's ``bos_token``, else an ``<s>``, ``<|begin_of_text|>``,
        ``<bos>`` or ``<|startoftext|>``, else the token the template puts first ([CLS])."""
        return self._ids["bos_token"]

    @property
    def eos_id(self) -> int | None:
        """tokenizer_config.json's ``eos_token``, else an ``</s>``, ``<|end_of_text|>``,
        ``<eos>`` or ``<|endoftext|>``, else the token the template puts last ([SEP])."""
        return self._ids["eos_token"]

    @property
    def adds_bos(self) -> bool:
        """Whether the template starts a single sequence with `bos_id` (as the model saw its
        text in pretraining)."""
        return self.bos_id is not None and self._before[:1] == [self.bos_id]

    @property
    def adds_eos(self) -> bool:
        """Whether the template ends a single sequence with `eos_id`."""
        return self.eos_id is not None and self._after[-1:] == [self.eos_id]

    @property
    def pad_id(self) -> int | None:
        """tokenizer_config.json's ``pad_token``, else a ``<pad>``, ``<|pad|>`` or ``[PAD]``."""
        return self._ids["pad_token"]

    @property
    def cls_id(self) -> int | None:
        """tokenizer_config.json's ``cls_token``, else ``[CLS]``."""
        return self._ids["cls_token"]

    @property
    def sep_id(self) -> int | None:
        """tokenizer_config.json's ``sep_token``, else ``[SEP]``."""
        return self._ids["sep_token"]

    @property
    def mask_id(self) -> int | None:
        """tokenizer_config.json's ``mask_token``, else ``[MASK]`` or ``<mask>``."""
        return self._ids["mask_token"]

    @property
    def unk_id(self) -> int | None:
        """tokenizer_config.json's ``unk_token``, else ``[UNK]`` or ``<unk>``."""
        return self._ids["unk_token"]

    def __repr__(self) -> str:
        kind = type(self._library.model).__name__
        return (
            f"TextTokenizer({kind}, vocab_size={self.vocab_size}, fingerprint={self.fingerprint!r})"
        )


def _template(library: tokenizers.Tokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a single sequence's own ids."""
    encoding = library.encode("a", add_special_tokens=True)
    ids, sequence = encoding.ids, encoding.sequence_ids
    own = [k for k, s in enumerate(sequence) if s is not None]
    if not own:  # "a" has no token of its own: all the template's ids count as before
        return list(ids), []
    return list(ids[: own[0]]), list(ids[own[-1] + 1 :])


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return config
