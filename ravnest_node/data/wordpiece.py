"""BERT's WordPiece tokenizer, read from a model's ``vocab.txt``.

The same splitting as BERT's reference tokenizer (``BasicTokenizer`` then
``WordpieceTokenizer``), so the ids match what a pretrained BERT-style model was trained on:

1. drop NUL, U+FFFD and control characters (Unicode category C*, except tab, newline and
   carriage return, which count as whitespace); every Zs space becomes " ";
2. put spaces around CJK ideographs, so each is a word of its own;
3. with ``lowercase``: lowercase, decompose (NFD) and drop the combining marks (Mn), so
   "Café" reads as "cafe"; without it, compose (NFC) only;
4. split on whitespace and around punctuation (Unicode P* categories and every ASCII
   character that is not a letter, digit or space: ``$``, ``+``, ``^``...);
5. cut each word greedily into the longest vocabulary pieces from its start, the pieces after
   the first prefixed "##"; a word with no such cut, or longer than ``max_chars_per_word``,
   becomes [UNK].

Special tokens written in the text ("[MASK]") are not recognised: they split like any other
text, so a corpus cannot smuggle a special token into the ids.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Iterable
from pathlib import Path

from ravnest_node.errors import ConfigError

__all__ = ["SPECIAL_TOKENS", "WordPiece"]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""The tokens every BERT vocabulary must hold."""

_CACHE_WORDS = 1 << 18
"""Words whose ids are remembered; the cache starts afresh when it is full."""

_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)
"""The CJK Unified Ideographs blocks BERT treats as words of their own (not Hangul or kana)."""


def _is_cjk(char: str) -> bool:
    code = ord(char)
    return any(low <= code <= high for low, high in _CJK_RANGES)


def _is_whitespace(char: str) -> bool:
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    return char not in "\t\n\r" and unicodedata.category(char).startswith("C")


def _is_punctuation(char: str) -> bool:
    code = ord(char)
    if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _clean_table(chars: Iterable[str]) -> dict[int, str | None]:
    """A `str.translate` table for steps 1 and 2 over the characters `chars`."""
    table: dict[int, str | None] = {}
    for char in chars:
        if char in ("\0", "\ufffd") or _is_control(char):
            table[ord(char)] = None
        elif _is_whitespace(char):
            table[ord(char)] = " "
        elif _is_cjk(char):
            table[ord(char)] = f" {char} "
    return table


class WordPiece:
    """A BERT WordPiece tokenizer over a fixed vocabulary (see the module's docstring).

    Pure and deterministic: the same text gives the same ids on every node. Each word's ids are
    remembered, so a large corpus costs little more than its distinct words.
    """

    def __init__(
        self, tokens: Iterable[str], *, lowercase: bool = True, max_chars_per_word: int = 100
    ) -> None:
        """A tokenizer whose token id ``i`` is ``tokens[i]``. Raises `ConfigError` if a special
        token of `SPECIAL_TOKENS` is missing or `max_chars_per_word` is below 1."""
        self._tokens = list(tokens)
        self._ids: dict[str, int] = {}
        for i, token in enumerate(self._tokens):
            self._ids.setdefault(token, i)  # a duplicate keeps its first id
        missing = [t for t in SPECIAL_TOKENS if t not in self._ids]
        if missing:
            raise ConfigError(f"the vocabulary lacks the special tokens {', '.join(missing)}")
        if max_chars_per_word < 1:
            raise ConfigError(f"max_chars_per_word must be at least 1, got {max_chars_per_word}")
        self.lowercase = lowercase
        self.max_chars_per_word = max_chars_per_word
        self._longest = max(map(len, self._tokens))
        self._words: dict[str, tuple[int, ...]] = {}
        self._tables: dict[int, str | None] = {}
        self._classified: set[str] = set()
        digest = hashlib.sha256(
            f"wordpiece:lowercase={lowercase}:max_chars_per_word={max_chars_per_word}\n".encode()
        )
        digest.update("\n".join(self._tokens).encode())
        self._fingerprint = digest.hexdigest()[:16]

    @classmethod
    def from_vocab(
        cls, path: Path, *, lowercase: bool = True, max_chars_per_word: int = 100
    ) -> WordPiece:
        """The tokenizer of a ``vocab.txt``: one token per line, a token's id is its line
        number counted from 0. Raises `ConfigError` if the file cannot be read, is not UTF-8
        or lacks a special token."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the vocabulary {path}: {exc}") from exc
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the newline that ends the last line
        try:
            return cls(
                (line.removesuffix("\r") for line in lines),
                lowercase=lowercase,
                max_chars_per_word=max_chars_per_word,
            )
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the lines of vocab.txt)."""
        return len(self._tokens)

    @property
    def pad_id(self) -> int:
        """Id of [PAD], which fills a row up to its length."""
        return self._ids["[PAD]"]

    @property
    def unk_id(self) -> int:
        """Id of [UNK], which stands for a word the vocabulary cannot spell."""
        return self._ids["[UNK]"]

    @property
    def cls_id(self) -> int:
        """Id of [CLS], which starts a sequence."""
        return self._ids["[CLS]"]

    @property
    def sep_id(self) -> int:
        """Id of [SEP], which ends a sequence."""
        return self._ids["[SEP]"]

    @property
    def mask_id(self) -> int:
        """Id of [MASK], which hides a token from a masked language model."""
        return self._ids["[MASK]"]

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens and of every other bracketed token (BERT's
        ``[unused0]``...): tokens that plain text never encodes to, apart from [UNK]."""
        return frozenset(
            i
            for i, t in enumerate(self._tokens)
            if t in SPECIAL_TOKENS or (len(t) > 2 and t[0] == "[" and t[-1] == "]")
        )

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of the vocabulary and the settings (lowercase,
        max_chars_per_word): equal fingerprints give equal ids for every text."""
        return self._fingerprint

    def id_of(self, token: str) -> int:
        """The id of `token`; `KeyError` if the vocabulary lacks it."""
        return self._ids[token]

    def words(self, text: str) -> list[str]:
        """The words of `text` after steps 1-4 (before the WordPiece cut)."""
        text = text.translate(self._table(text))
        if self.lowercase:
            text = unicodedata.normalize("NFD", text.lower())
        else:
            text = unicodedata.normalize("NFC", text)
        # Combining marks (when stripping accents) and punctuation are looked up after the
        # normalisation, which may produce characters the raw text did not have.
        return text.translate(self._table(text)).split()

    def _table(self, text: str) -> dict[int, str | None]:
        """The `str.translate` table for every step but the WordPiece cut, grown to cover the
        characters of `text`. `words` applies it twice, before and after normalising: the
        entries of steps 1-2 and those of steps 3-4 (marks, punctuation) never meet the same
        character, and each pass leaves text that the other pass maps to itself, up to
        extra spaces."""
        new = set(text) - self._classified
        if new:
            self._tables.update(_clean_table(new))
            for char in new:
                if self.lowercase and unicodedata.category(char) == "Mn":
                    self._tables[ord(char)] = None
                elif _is_punctuation(char):
                    self._tables[ord(char)] = f" {char} "
            self._classified |= new
        return self._tables

    def _word_ids(self, word: str) -> tuple[int, ...]:
        """Step 5 for one word (cached)."""
        ids = self._words.get(word)
        if ids is not None:
            return ids
        ids = self._cut(word)
        if len(self._words) >= _CACHE_WORDS:
            self._words.clear()
        self._words[word] = ids
        return ids

    def _cut(self, word: str) -> tuple[int, ...]:
        if len(word) > self.max_chars_per_word:
            return (self.unk_id,)
        pieces = []
        start = 0
        while start < len(word):
            prefix = "##" if start else ""
            for end in range(min(len(word), start + self._longest), start, -1):
                found = self._ids.get(prefix + word[start:end])
                if found is not None:
                    pieces.append(found)
                    start = end
                    break
            else:
                return (self.unk_id,)
        return tuple(pieces)

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`, without [CLS], [SEP] or padding."""
        ids: list[int] = []
        for word in self.words(text):
            ids.extend(self._word_ids(word))
        return ids

    def tokens(self, text: str) -> list[str]:
        """The tokens of `text` as strings (continuation pieces start with "##")."""
        return [self._tokens[i] for i in self.encode(text)]

    def decode(self, ids: Iterable[int]) -> str:
        """The tokens of `ids` joined by spaces, continuation pieces glued to the piece before.

        Lossy: the text comes back lowercased and without accents (when ``lowercase``), with a
        space around each punctuation mark, and with [UNK] for what could not be spelled.
        Raises `ValueError` for an id outside the vocabulary."""
        out: list[str] = []
        for i in ids:
            if not 0 <= i < len(self._tokens):
                raise ValueError(f"token id {i} is outside the vocabulary 0..{self.vocab_size - 1}")
            token = self._tokens[i]
            if token.startswith("##") and out:
                out[-1] += token[2:]
            else:
                out.append(token)
        return " ".join(out)

    def __repr__(self) -> str:
        return (
            f"WordPiece(vocab_size={self.vocab_size}, lowercase={self.lowercase}, "
            f"fingerprint={self.fingerprint!r})"
        )
