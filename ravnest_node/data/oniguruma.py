r"""Oniguruma regexes, as Hugging Face ``tokenizer.json`` files write them, translated for
Python's ``re``, and the Unicode classes they name.

The ``tokenizers`` library matches the patterns of ``Split``, ``Replace`` and ByteLevel's
``use_regex`` with Oniguruma, in its Ruby syntax. The translation keeps what they match:
``\p{..}``/``\P{..}`` general categories (``L``, ``N``, ``Lu``...) become classes built from
`unicodedata`, ``\s`` is White_Space, ``\w`` and ``\d`` are Unicode's word and decimal-digit
characters, ``^``/``$`` match at line ends and ``(?m)`` means dot-all, as in Oniguruma's Ruby
syntax; POSIX brackets, nested classes, back-references and ``\b`` are refused (`compile_regex`
raises `ConfigError`). Llama 3's pattern (Meta's tokenizer), cut in two here, and GPT-2's::

    (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
        | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
    's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

A character the running Python's Unicode database does not know (Python 3.11 has Unicode 14) is
neither a letter nor a number here, while a newer Oniguruma may class it as one: such rare
characters may split differently from the library and between Python versions (the datasets'
fingerprints, taken over the token ids, tell).

References, for the formats only (the code is our own): the ``tokenizers`` library's
serialization (github.com/huggingface/tokenizers, ``tokenizers/src``); Llama 3's pattern in
Meta's ``llama/tokenizer.py`` (github.com/meta-llama/llama3).
"""

from __future__ import annotations

import functools
import itertools
import re
import unicodedata
from collections.abc import Callable

from ravnest_node.errors import ConfigError

__all__ = ["WHITE_SPACE", "Ranges", "compile_regex", "escape_class", "word_ranges"]

Ranges = tuple[tuple[int, int], ...]
"""Code point ranges (first, last), both inclusive."""

WHITE_SPACE: Ranges = (
    (0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
    (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
)  # fmt: skip
"""Unicode's White_Space property (Python's ``\\s`` also takes U+001C..U+001F)."""

_WORD_CATEGORIES = ("L", "M", "Nd", "Nl", "Pc")
_ALPHABETIC_SYMBOLS: Ranges = ((0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169),
                               (0x1F170, 0x1F189))  # fmt: skip
"""Word characters of all kinds beyond `_WORD_CATEGORIES`: the Alphabetic symbols (circled and
squared Latin letters)..."""
_JOINERS: Ranges = ((0x200C, 0x200D),)
"""...the joiners, for the library's own ``\\w`` (single_word)..."""
_LATIN1_NUMBERS: Ranges = ((0xB2, 0xB3), (0xB9, 0xB9), (0xBC, 0xBE))
"""...and instead Latin-1's superscripts and fractions for Oniguruma's ``\\w``."""

_CATEGORIES = frozenset((
    "L", "Lu", "Ll", "Lt", "Lm", "Lo", "M", "Mn", "Mc", "Me", "N", "Nd", "Nl", "No",
    "P", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "S", "Sm", "Sc", "Sk", "So",
    "Z", "Zs", "Zl", "Zp", "C", "Cc", "Cf", "Cs", "Co", "Cn",
))  # fmt: skip
"""The general categories ``\\p{..}`` may name."""


@functools.cache
def _category_table() -> dict[str, Ranges]:
    """The code point ranges of each two-letter general category, from one pass over
    `unicodedata` (a fifth of a second, once per process)."""
    table: dict[str, list[tuple[int, int]]] = {}
    start = 0
    categories = map(unicodedata.category, map(chr, range(0x110000)))
    for category, run in itertools.groupby(categories):
        end = start + len(list(run))
        table.setdefault(category, []).append((start, end - 1))
        start = end
    return {category: tuple(ranges) for category, ranges in table.items()}


def _union(*parts: Ranges) -> Ranges:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(r for part in parts for r in part):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(high, merged[-1][1]))
        else:
            merged.append((low, high))
    return tuple(merged)


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for low, high in ranges:
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= 0x10FFFF:
        out.append((start, 0x10FFFF))
    return tuple(out)


@functools.cache
def _category(name: str) -> Ranges:
    """The ranges of a general category: two letters, or one for all categories under it."""
    table = _category_table()
    return _union(*(ranges for cat, ranges in table.items() if cat.startswith(name)))


@functools.cache
def word_ranges(oniguruma: bool = True) -> Ranges:
    """The word characters of Oniguruma's ``\\w`` or of the library's own (Rust's)."""
    extra = _LATIN1_NUMBERS if oniguruma else _JOINERS
    return _union(_ALPHABETIC_SYMBOLS, extra, *map(_category, _WORD_CATEGORIES))


def escape_class(ranges: Ranges) -> str:
    """The inside of a ``re`` character class holding `ranges`."""
    return "".join(
        f"\\U{low:08x}" if low == high else f"\\U{low:08x}-\\U{high:08x}" for low, high in ranges
    )


_SHORTHANDS: dict[str, Callable[[], Ranges]] = {
    "s": lambda: WHITE_SPACE,
    "d": lambda: _category("Nd"),
    "w": word_ranges,
}


class _PatternError(Exception):
    """A regex construct the translation does not support."""


def _translate(pattern: str) -> str:
    """An Oniguruma (Ruby syntax) regex as a Python ``re`` pattern; `_PatternError` for a
    construct that has no exact translation."""
    out: list[str] = []
    i, n = 0, len(pattern)
    in_class = class_opened = class_negated = False
    while i < n:
        char = pattern[i]
        if char == "\\":
            if i + 1 == n:
                raise _PatternError("it ends with a lone backslash")
            escape = pattern[i + 1]
            i += 2
            ranges: Ranges | None = None
            if escape in "pP":
                if pattern.startswith("{", i):
                    end = pattern.find("}", i)
                    if end < 0:
                        raise _PatternError(f"\\{escape}{{ is not closed")
                    name, i = pattern[i + 1 : end], end + 1
                else:
                    name, i = pattern[i : i + 1], i + 1
                if name.startswith("^"):
                    escape, name = "pP"[escape == "p"], name[1:]
                if name not in _CATEGORIES:
                    raise _PatternError(
                        f"\\{escape}{{{name}}} is not a Unicode general category "
                        "(L, N, Lu, ... are supported)"
                    )
                ranges = _category(name)
                if escape == "P":
                    ranges = _complement(ranges)
            elif escape.lower() in _SHORTHANDS:
                ranges = _SHORTHANDS[escape.lower()]()
                if escape.isupper():
                    ranges = _complement(ranges)
            elif escape == "x" and pattern.startswith("{", i):
                end = pattern.find("}", i)
                try:
                    code = int(pattern[i + 1 : end], 16) if end > 0 else -1
                except ValueError:
                    code = -1
                if not 0 <= code <= 0x10FFFF:
                    raise _PatternError(f"bad code point escape {pattern[i - 2 : end + 1]!r}")
                out.append(f"\\U{code:08x}")
                i = end + 1
            elif escape == "e":
                out.append("\\x1b")
            elif escape == "z" and not in_class:
                out.append("\\Z")
            elif escape == "Z" and not in_class:
                out.append("(?=\\n?\\Z)")
            elif escape in "tnrfvaxu0" or (escape == "A" and not in_class):
                out.append("\\" + escape)
            elif escape.isascii() and escape.isalnum():
                raise _PatternError(f"the escape \\{escape} is not supported")
            else:
                out.append("\\" + escape)  # an escaped literal
            if ranges is not None:
                body = escape_class(ranges)
                out.append(body if in_class else f"[{body}]")
            class_opened = False
            continue
        if in_class:
            if char == "]" and not class_opened:
                in_class = False
            elif char == "[":
                raise _PatternError(
                    "nested classes and POSIX brackets ([[:alpha:]]) are not supported"
                )
            elif char == "&" and pattern.startswith("&&", i):
                raise _PatternError("class intersections (&&) are not supported")
            elif char == "^" and class_opened and not class_negated:
                class_negated = True
                out.append(char)
                i += 1
                continue
            if char in "~|&":
                char = "\\" + char  # Python warns of set operations on doubled ones
            class_opened = False
        elif char == "[":
            in_class, class_opened, class_negated = True, True, False
        elif char == "(" and pattern.startswith("(?", i):
            i = _translate_group(pattern, i, out)
            continue
        out.append(char)
        i += 1
    if in_class:
        raise _PatternError("a character class is not closed")
    return "".join(out)


def _translate_group(pattern: str, i: int, out: list[str]) -> int:
    """Appends the translation of the group opener ``(?...`` at `i`; returns where to go on."""
    rest = pattern[i + 2 :]
    for opener in (":", "=", "!", "<=", "<!", ">"):
        if rest.startswith(opener):
            out.append("(?" + opener)
            return i + 2 + len(opener)
    if rest.startswith("<"):
        out.append("(?P<")  # a named group
        return i + 3
    flags = re.match(r"[a-z]*(?:-[a-z]*)?(?=[:)])", rest)
    if flags is None or set(flags.group()) - set("imx-"):
        raise _PatternError(f"the group {pattern[i : i + 6]!r}... is not supported")
    # Ruby's (?m) is dot-all, Python's (?s).
    out.append("(?" + flags.group().replace("m", "s"))
    return i + 2 + flags.end()


@functools.lru_cache(maxsize=64)
def compile_regex(pattern: str) -> re.Pattern[str]:
    """The translation of an Oniguruma regex, compiled; `ConfigError` if it has none."""
    try:
        return re.compile(_translate(pattern), re.MULTILINE)
    except (_PatternError, re.error, OverflowError, RecursionError) as exc:
        raise ConfigError(f"the regex {pattern!r} cannot be used: {exc}") from exc
