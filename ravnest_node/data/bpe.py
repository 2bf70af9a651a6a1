"""Byte-pair-encoding tokenizers read from a Hugging Face ``tokenizer.json``, without the
``tokenizers`` library: the ids of Llama-family models, so a node tokenizes its local text as the
model was trained.

The file is the JSON the ``tokenizers`` library saves (``Tokenizer.save``): ``model``,
``normalizer``, ``pre_tokenizer``, ``post_processor``, ``decoder`` and ``added_tokens``. The same
steps run in the same order:

1. added tokens (``added_tokens``: ``<s>``, ``<|eot_id|>``...) are cut out of the text where
   they appear, longest first at the leftmost place; the ``normalized`` ones are looked for
   after normalization, in the normalized form of their content; ``single_word``, ``lstrip``
   and ``rstrip`` mean what they mean to the library (a word character is a letter, mark,
   decimal digit, letter number or connector punctuation; a space is Unicode White_Space);
2. each remaining piece is normalized on its own (`ravnest_node.data.bpe_steps`);
3. each piece is pre-tokenized (`ravnest_node.data.bpe_steps`, with the regexes translated by
   `ravnest_node.data.oniguruma`);
4. each pre-token is cut by the BPE ``model`` (`ravnest_node.data.bpe_model`);
5. only with ``add_special_tokens``: the post-processor's single-sequence template wraps the
   ids (`ravnest_node.data.bpe_steps`).

Decoding runs the file's ``decoder`` (`ravnest_node.data.bpe_steps`).

References, for the formats only (the code is our own): the ``tokenizers`` library's
serialization (github.com/huggingface/tokenizers, ``tokenizers/src``).

Not supported, refused with a `ConfigError` when `from_file` reads them: models other than BPE,
BPE dropout, ``continuing_subword_prefix``, ``end_of_word_suffix``, and any other normalizer,
pre-tokenizer, post-processor or decoder type. ``truncation`` and ``padding`` are ignored: the
datasets cut and pad their windows themselves.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ravnest_node.data.bpe_json import (
    MAX_FILE_BYTES,
    as_id,
    as_list,
    as_object,
    bool_field,
    parse_object,
    read_file,
    str_field,
)
from ravnest_node.data.bpe_model import BpeModel
from ravnest_node.data.bpe_steps import decoder, normalizer, pre_tokenizer, template
from ravnest_node.data.oniguruma import WHITE_SPACE, escape_class, word_ranges
from ravnest_node.errors import ConfigError

__all__ = ["MAX_FILE_BYTES", "BpeTokenizer"]

_CACHE_WORDS = 1 << 18
"""Pre-tokens whose ids are remembered; the cache starts afresh when it is full."""
_CACHE_CHARS = 100
"""Longer pre-tokens are not remembered (they rarely repeat)."""

_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "<|pad|>")
"""Added tokens taken as BOS, EOS and padding when tokenizer_config.json does not say."""


# -- added tokens --


@dataclass(frozen=True, slots=True)
class _Added:
    """A token of ``added_tokens``."""

    id: int
    content: str
    single_word: bool
    lstrip: bool
    rstrip: bool
    normalized: bool
    special: bool


_SPACES = frozenset(chr(c) for low, high in WHITE_SPACE for c in range(low, high + 1))


class _AddedMatcher:
    """Finds added tokens in text as the library does: leftmost, longest first."""

    def __init__(self, tokens: dict[str, _Added]) -> None:
        self._tokens = tokens
        ordered = sorted(tokens, key=len, reverse=True)
        self._regex = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._word: re.Pattern[str] | None = None
        if any(t.single_word for t in tokens.values()):
            self._word = re.compile(f"[{escape_class(word_ranges(oniguruma=False))}]")

    def split(self, text: str, first: bool) -> list[tuple[str, int | None, bool]]:
        """`text` as pieces (text, id of the added token or None, starts the original text)."""
        if self._regex is None:
            return [(text, None, first)]
        out: list[tuple[str, int | None, bool]] = []
        prev = 0
        for match in self._regex.finditer(text):
            start, stop = match.span()
            token = self._tokens[match.group()]
            if token.single_word and self._word is not None:
                before = start > 0 and self._word.match(text, start - 1)
                if before or (stop < len(text) and self._word.match(text, stop)):
                    continue
            while token.lstrip and start > prev and text[start - 1] in _SPACES:
                start -= 1
            while token.rstrip and stop < len(text) and text[stop] in _SPACES:
                stop += 1
            if start > prev:
                out.append((text[prev:start], None, first and prev == 0))
            out.append((text[start:stop], token.id, False))
            prev = stop
        if prev < len(text):
            out.append((text[prev:], None, first and prev == 0))
        return out


# -- the tokenizer --


class BpeTokenizer:
    """A BPE tokenizer of a Hugging Face ``tokenizer.json`` (see the module's docstring).

    Pure and deterministic: the same text gives the same ids on every node (with the same
    Unicode database). Each pre-token's ids are remembered, so a large corpus costs little
    more than its distinct pre-tokens (about a second per MB on one core). The caches are plain
    dicts that only ever hold right answers: threads may share a tokenizer.
    """

    def __init__(self, spec: dict[str, Any], config: dict[str, Any], data: bytes) -> None:
        """Use `from_file`. Raises `ConfigError` (without the file's name) for a bad `spec`."""
        self._fingerprint = hashlib.sha256(data).hexdigest()[:16]
        self._model = BpeModel(as_object(spec.get("model"), "model"))
        self._normalize = normalizer(spec.get("normalizer"), "normalizer")
        self._stages = pre_tokenizer(spec.get("pre_tokenizer"), "pre_tokenizer")
        self._decode = decoder(spec.get("decoder"), "decoder")
        added = _added_tokens(spec.get("added_tokens", []), self._model.vocab)
        self._tokens = dict(self._model.tokens)
        self._tokens.update({t.id: t.content for t in added})
        self._ids = {t: i for i, t in self._tokens.items()}
        self._special_ids = frozenset(t.id for t in added if t.special)
        normalize = self._normalize
        self._raw_added = _AddedMatcher({t.content: t for t in added if not t.normalized})
        normalized = {
            normalize(t.content) if normalize else t.content: t for t in added if t.normalized
        }
        self._normalized_added = _AddedMatcher({k: t for k, t in normalized.items() if k})
        self._template = template(spec.get("post_processor"), "post_processor", self._tokens)
        before, after = self._template
        self._bos_id = self._config_id(config, "bos_token", _BOS_NAMES, before[:1])
        self._eos_id = self._config_id(config, "eos_token", _EOS_NAMES, after[-1:])
        self._pad_id = self._config_id(config, "pad_token", _PAD_NAMES, [])
        self._words: dict[str, tuple[int, ...]] = {}

    @classmethod
    def from_file(cls, path: Path) -> BpeTokenizer:
        """The tokenizer of a ``tokenizer.json``, with the BOS, EOS and padding tokens of the
        ``tokenizer_config.json`` beside it if there is one. Raises `ConfigError` naming the file
        and what is wrong if a file cannot be read, is larger than `MAX_FILE_BYTES`, is not JSON
        or asks for what is not supported."""
        path = Path(path)
        data = read_file(path)
        spec = parse_object(data, path)
        config_path = path.with_name("tokenizer_config.json")
        config = parse_object(read_file(config_path), config_path) if config_path.is_file() else {}
        try:
            return cls(spec, config, data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    def _config_id(
        self, config: dict[str, Any], key: str, names: Iterable[str], fallback: list[int]
    ) -> int | None:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            found = [self._ids[n] for n in names if n in self._ids] + fallback
            return found[0] if found else None
        if not isinstance(value, str) or value not in self._ids:
            raise ConfigError(
                f"tokenizer_config.json's {key} {value!r:.60} is not a token of the vocabulary"
            )
        return self._ids[value]

    @property
    def vocab_size(self) -> int:
        """Number of token ids: the largest id of the vocabulary and added tokens, plus one."""
        return max(self._tokens, default=-1) + 1

    @property
    def bos_id(self) -> int | None:
        """The token that begins a sequence: tokenizer_config.json's ``bos_token``, else an
        added ``<s>``, ``<|begin_of_text|>``, ``<bos>`` or ``<|startoftext|>``, else the token
        the template puts first; None if there is none."""
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        """The token that ends a sequence: tokenizer_config.json's ``eos_token``, else an added
        ``</s>``, ``<|end_of_text|>``, ``<eos>`` or ``<|endoftext|>``, else the token the
        template puts last; None if there is none."""
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        """The padding token: tokenizer_config.json's ``pad_token``, else an added ``<pad>`` or
        ``<|pad|>``; None if there is none (Llama's files have none)."""
        return self._pad_id

    @property
    def adds_bos(self) -> bool:
        """Whether ``encode(text, add_special_tokens=True)`` starts with `bos_id`."""
        before = self._template[0]
        return self._bos_id is not None and before[:1] == [self._bos_id]

    @property
    def adds_eos(self) -> bool:
        """Whether ``encode(text, add_special_tokens=True)`` ends with `eos_id`."""
        after = self._template[1]
        return self._eos_id is not None and after[-1:] == [self._eos_id]

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (``<s>``, ``<|eot_id|>``...)."""
        return self._special_ids

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of tokenizer.json's bytes: equal fingerprints give
        equal ids for every text (tokenizer_config.json only names BOS, EOS and padding)."""
        return self._fingerprint

    def id_of(self, token: str) -> int:
        """The id of `token` (of the vocabulary or an added token); `KeyError` if it has none."""
        return self._ids[token]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """The token ids of `text`, as the library's ``encode(text, add_special_tokens=...)``:
        added tokens written in the text are matched; the template's BOS (and EOS) only with
        `add_special_tokens`."""
        ids: list[int] = []
        normalize = self._normalize
        for piece, token_id, first in self._raw_added.split(text, True):
            if token_id is not None:
                ids.append(token_id)
                continue
            if normalize is not None:
                piece = normalize(piece)
            if not piece:
                continue
            for part, part_id, part_first in self._normalized_added.split(piece, first):
                if part_id is not None:
                    ids.append(part_id)
                    continue
                for word in self._pre_tokenize(part, part_first):
                    ids += self._word_ids(word)
        if add_special_tokens:
            before, after = self._template
            return [*before, *ids, *after]
        return ids

    def tokens(self, text: str, *, add_special_tokens: bool = False) -> list[str]:
        """The tokens of `encode` as strings (in the model's alphabet: "Ġ" for a byte-level
        space, "▁" for a SentencePiece one)."""
        return [self._tokens[i] for i in self.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """The text of `ids` through the file's decoder, as the library's ``decode``; the special
        added tokens are left out with `skip_special_tokens`. Raises `ValueError` for an id that
        is no token."""
        tokens = []
        for i in ids:
            token = self._tokens.get(i)
            if token is None:
                raise ValueError(f"token id {i} is no token of this vocabulary")
            if not (skip_special_tokens and i in self._special_ids):
                tokens.append(token)
        return "".join(self._decode(tokens))

    def _pre_tokenize(self, text: str, first: bool) -> list[str]:
        pieces = [text]
        for stage in self._stages:
            out: list[str] = []
            next_first = False
            for k, piece in enumerate(pieces):
                parts, parts_first = stage(piece, first and k == 0)
                out += [p for p in parts if p]
                if k == 0:
                    next_first = parts_first and bool(parts) and parts[0] != ""
            pieces, first = out, next_first
        return pieces

    def _word_ids(self, word: str) -> tuple[int, ...]:
        """Step 4 for one pre-token (cached)."""
        ids = self._words.get(word)
        if ids is not None:
            return ids
        ids = tuple(self._model.ids(word))
        if len(word) <= _CACHE_CHARS:
            if len(self._words) >= _CACHE_WORDS:
                self._words.clear()
            self._words[word] = ids
        return ids

    def __repr__(self) -> str:
        return f"BpeTokenizer(vocab_size={self.vocab_size}, fingerprint={self.fingerprint!r})"


def _added_tokens(spec: Any, vocab: dict[str, int]) -> list[_Added]:
    tokens: list[_Added] = []
    by_id: dict[int, str] = {i: t for t, i in vocab.items()}
    contents: set[str] = set()
    for k, entry in enumerate(as_list(spec, "added_tokens")):
        where = f"added_tokens[{k}]"
        entry = as_object(entry, where)
        special = bool_field(entry, "special", where, False)
        token = _Added(
            id=as_id(entry.get("id"), f"{where}.id"),
            content=str_field(entry, "content", where),
            single_word=bool_field(entry, "single_word", where, False),
            lstrip=bool_field(entry, "lstrip", where, False),
            rstrip=bool_field(entry, "rstrip", where, False),
            normalized=bool_field(entry, "normalized", where, not special),
            special=special,
        )
        if not token.content:
            raise ConfigError(f"{where}.content is empty")
        if token.content in contents:
            raise ConfigError(f"{where}: {token.content!r} is listed twice")
        owner = by_id.setdefault(token.id, token.content)
        if owner != token.content:
            raise ConfigError(f"{where}: the id {token.id} of {token.content!r} is {owner!r}'s")
        if vocab.get(token.content, token.id) != token.id:
            raise ConfigError(
                f"{where}: {token.content!r} has the id {token.id} but "
                f"{vocab[token.content]} in model.vocab"
            )
        contents.add(token.content)
        tokens.append(token)
    return tokens
