"""The steps of a Hugging Face ``tokenizer.json`` around its BPE model, read from the JSON as the
``tokenizers`` library runs them (`ravnest_node.data.bpe` puts them together):

- ``normalizer``: ``Prepend``, ``Replace`` (a string or a regex), ``NFC``/``NFD``/``NFKC``/
  ``NFKD``, or a ``Sequence`` of these (Llama 2 writes
  ``Sequence[Prepend("▁"), Replace(" ", "▁")]``);
- ``pre_tokenizer``: ``Split`` (a string or a regex; every ``behavior``; ``invert``),
  ``ByteLevel`` (GPT-2's bytes-to-unicode alphabet, its ``add_prefix_space`` and its own regex
  with ``use_regex``), ``Metaspace`` (``replacement``, ``prepend_scheme`` always/first/never or
  the older ``add_prefix_space``, ``split``), or a ``Sequence`` of these (Llama 3 writes
  ``Sequence[Split(pattern, Isolated), ByteLevel(use_regex=false)]``);
- ``post_processor``: the single-sequence template of ``TemplateProcessing`` (Llama's
  ``<s> $A`` or ``<|begin_of_text|> $A``), ``ByteLevel`` (which adds no ids) or a ``Sequence``
  of these;
- ``decoder``: ``ByteLevel``, ``Metaspace``, ``Replace``, ``ByteFallback``, ``Fuse``, ``Strip``
  or a ``Sequence`` of these; without one the tokens are joined with spaces.

Regexes are Oniguruma's, translated by `ravnest_node.data.oniguruma`. Any other type is refused
with a `ConfigError` that names where it stands in the file.

References, for the formats only (the code is our own): the ``tokenizers`` library's
serialization (github.com/huggingface/tokenizers, ``tokenizers/src``); GPT-2's
``bytes_to_unicode`` in ``src/encoder.py`` (github.com/openai/gpt-2).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Callable
from typing import Any

from ravnest_node.data.bpe_json import as_id, as_list, as_object, bool_field, list_field, str_field
from ravnest_node.data.oniguruma import compile_regex
from ravnest_node.errors import ConfigError

__all__ = ["Decoder", "Normalizer", "Stage", "decoder", "normalizer", "pre_tokenizer", "template"]

_METASPACE = "\u2581"
"""SentencePiece's space, "▁"."""

_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
"""The split of ByteLevel's ``use_regex``."""


# -- GPT-2's byte alphabet --


@functools.cache
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's bytes-to-unicode map: the printable Latin-1 bytes stand for themselves, the
    other 68 bytes, in order, for U+0100, U+0101, ..."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = dict(zip(printable, map(chr, printable), strict=True))
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(0x100 + k) for k, b in enumerate(others)})
    return tuple(chars[b] for b in range(256))


@functools.cache
def _byte_table() -> dict[int, str]:
    """`str.translate` table from a Latin-1 decoded byte string to the byte alphabet."""
    return dict(enumerate(_byte_chars()))


@functools.cache
def _char_bytes() -> dict[str, int]:
    return {c: b for b, c in enumerate(_byte_chars())}


def _pattern(spec: dict[str, Any], where: str) -> re.Pattern[str]:
    """A ``{"String": ...}`` or ``{"Regex": ...}`` pattern, compiled."""
    pattern = as_object(spec.get("pattern"), f"{where}.pattern")
    if isinstance(pattern.get("String"), str):
        return re.compile(re.escape(pattern["String"]))
    if isinstance(pattern.get("Regex"), str):
        return compile_regex(pattern["Regex"])
    raise ConfigError(f'{where}.pattern must be {{"String": ...}} or {{"Regex": ...}}')


# -- normalizers --

Normalizer = Callable[[str], str]
"""A normalizer: a piece of text to its normalized form."""


def normalizer(spec: Any, where: str) -> Normalizer | None:
    """The normalizer `spec` at `where` in the file, None if there is none; `ConfigError` for
    one not supported."""
    if spec is None:
        return None
    spec = as_object(spec, where)
    kind = spec.get("type")
    if kind == "Sequence":
        steps = [normalizer(s, at) for s, at in list_field(spec, "normalizers", where)]
        start: Normalizer = _same
        return functools.reduce(_then, (s for s in steps if s is not None), start)
    if kind == "Prepend":
        prefix = str_field(spec, "prepend", where)
        return lambda text: prefix + text if text else text
    if kind == "Replace":
        regex, content = _pattern(spec, where), str_field(spec, "content", where)
        return lambda text: regex.sub(lambda _: content, text)
    if kind in ("NFC", "NFD", "NFKC", "NFKD"):
        return functools.partial(unicodedata.normalize, kind)
    raise ConfigError(
        f"the normalizer type {kind!r} ({where}) is not supported; supported: Sequence, "
        "Prepend, Replace, NFC, NFD, NFKC, NFKD"
    )


def _same(text: str) -> str:
    return text


def _then(first: Normalizer, second: Normalizer) -> Normalizer:
    return lambda text: second(first(text))


# -- pre-tokenizers --

Stage = Callable[[str, bool], tuple[list[str], bool]]
"""One pre-tokenizer step on one piece: (piece, whether it starts the original text) to
(its pieces, whether the first of them starts the original text). Empty pieces are dropped."""


def _split_spans(text: str, regex: re.Pattern[str], invert: bool) -> list[tuple[int, int, bool]]:
    """`text` cut into (start, end, is_match) spans that cover it, in order."""
    spans, prev = [], 0
    for match in regex.finditer(text):
        start, end = match.span()
        if start > prev:
            spans.append((prev, start, invert))
        spans.append((start, end, not invert))
        prev = end
    if prev < len(text):
        spans.append((prev, len(text), invert))
    return spans


def _split(text: str, regex: re.Pattern[str], behavior: str, invert: bool) -> list[tuple[int, int]]:
    """The library's split of `text` at the matches of `regex` (its ``SplitDelimiterBehavior``):
    the (start, end) of each piece, empty ones dropped."""
    spans = _split_spans(text, regex, invert)
    if behavior == "Isolated":
        pieces = [(s, e) for s, e, _ in spans]
    elif behavior == "Removed":
        pieces = [(s, e) for s, e, matched in spans if not matched]
    else:
        pieces, previous = [], False
        ordered = reversed(spans) if behavior == "MergedWithNext" else spans
        for start, end, matched in ordered:
            joins = matched == previous if behavior == "Contiguous" else matched and not previous
            if joins and pieces:
                s, e = pieces[-1]
                pieces[-1] = (start, e) if behavior == "MergedWithNext" else (s, end)
            else:
                pieces.append((start, end))
            previous = matched
        if behavior == "MergedWithNext":
            pieces.reverse()
    return [(s, e) for s, e in pieces if e > s]


def _split_stage(regex: re.Pattern[str], behavior: str, invert: bool) -> Stage:
    if behavior == "Isolated" and not invert:
        # The common case (Llama 3), kept lean: a piece per match and per gap.
        def isolated(text: str, first: bool) -> tuple[list[str], bool]:
            pieces, prev = [], 0
            for match in regex.finditer(text):
                start, end = match.span()
                if start > prev:
                    pieces.append(text[prev:start])
                if end > start:
                    pieces.append(match.group())
                prev = end
            if prev < len(text):
                pieces.append(text[prev:])
            return pieces, first

        return isolated

    def split(text: str, first: bool) -> tuple[list[str], bool]:
        spans = _split(text, regex, behavior, invert)
        return [text[s:e] for s, e in spans], first and bool(spans) and spans[0][0] == 0

    return split


def _byte_level_stage(add_prefix_space: bool, use_regex: bool) -> Stage:
    regex = compile_regex(_GPT2_PATTERN) if use_regex else None
    table = _byte_table()

    def byte_level(text: str, first: bool) -> tuple[list[str], bool]:
        if add_prefix_space and not text.startswith(" "):
            text = " " + text
        pieces = (
            [text]
            if regex is None
            else [text[s:e] for s, e in _split(text, regex, "Isolated", False)]
        )
        return [p.encode("utf-8").decode("latin-1").translate(table) for p in pieces], first

    return byte_level


def _metaspace_stage(replacement: str, scheme: str, split: bool) -> Stage:
    separator = re.compile(re.escape(replacement))

    def metaspace(text: str, first: bool) -> tuple[list[str], bool]:
        text = text.replace(" ", replacement)
        if (scheme == "always" or (scheme == "first" and first)) and not text.startswith(
            replacement
        ):
            text = replacement + text
        if not split:
            return [text], first
        return [text[s:e] for s, e in _split(text, separator, "MergedWithNext", False)], first

    return metaspace


def pre_tokenizer(spec: Any, where: str) -> list[Stage]:
    """The steps of the pre-tokenizer `spec` at `where` in the file, in order (none if there is
    none); `ConfigError` for one not supported."""
    if spec is None:
        return []
    spec = as_object(spec, where)
    kind = spec.get("type")
    if kind == "Sequence":
        return [
            stage
            for s, at in list_field(spec, "pretokenizers", where)
            for stage in pre_tokenizer(s, at)
        ]
    if kind == "Split":
        behaviors = ("Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")
        behavior = str_field(spec, "behavior", where)
        if behavior not in behaviors:
            raise ConfigError(f"{where}.behavior must be one of {', '.join(behaviors)}")
        invert = bool_field(spec, "invert", where, False)
        return [_split_stage(_pattern(spec, where), behavior, invert)]
    if kind == "ByteLevel":
        add_prefix_space = bool_field(spec, "add_prefix_space", where, True)
        return [_byte_level_stage(add_prefix_space, bool_field(spec, "use_regex", where, True))]
    if kind == "Metaspace":
        replacement = str_field(spec, "replacement", where, _METASPACE)
        if len(replacement) != 1:
            raise ConfigError(f"{where}.replacement must be one character, got {replacement!r}")
        if "prepend_scheme" in spec:
            scheme = str_field(spec, "prepend_scheme", where)
            if scheme not in ("always", "first", "never"):
                raise ConfigError(f"{where}.prepend_scheme must be always, first or never")
        else:
            scheme = "always" if bool_field(spec, "add_prefix_space", where, True) else "never"
        return [_metaspace_stage(replacement, scheme, bool_field(spec, "split", where, True))]
    raise ConfigError(
        f"the pre-tokenizer type {kind!r} ({where}) is not supported; supported: Sequence, "
        "Split, ByteLevel, Metaspace"
    )


# -- post-processor --


def template(spec: Any, where: str, tokens: dict[int, str]) -> tuple[list[int], list[int]]:
    """The ids the post-processor `spec` at `where` in the file puts before and after a single
    sequence; `ConfigError` for one not supported or an id not in `tokens`."""
    if spec is None:
        return [], []
    spec = as_object(spec, where)
    kind = spec.get("type")
    if kind == "Sequence":
        before: list[int] = []
        after: list[int] = []
        for s, at in list_field(spec, "processors", where):
            b, a = template(s, at, tokens)
            before, after = b + before, after + a
        return before, after
    if kind == "ByteLevel":
        return [], []  # it only moves offsets
    if kind != "TemplateProcessing":
        raise ConfigError(
            f"the post-processor type {kind!r} ({where}) is not supported; supported: "
            "TemplateProcessing, ByteLevel, Sequence"
        )
    specials = as_object(spec.get("special_tokens", {}), f"{where}.special_tokens")
    parts: tuple[list[int], list[int]] = ([], [])
    seen_sequence = False
    for piece, piece_at in list_field(spec, "single", where):
        piece = as_object(piece, piece_at)
        if "Sequence" in piece:
            if seen_sequence:
                raise ConfigError(f"{where}.single holds more than one sequence")
            seen_sequence = True
            continue
        name = str_field(as_object(piece.get("SpecialToken"), piece_at), "id", where)
        special = as_object(specials.get(name), f"{where}.special_tokens[{name!r}]")
        at = f"{where}.special_tokens[{name!r}].ids"
        ids = [as_id(i, at) for i in as_list(special.get("ids"), at)]
        unknown = [i for i in ids if i not in tokens]
        if unknown:
            raise ConfigError(f"{where}.special_tokens[{name!r}] has unknown ids {unknown}")
        parts[seen_sequence].extend(ids)
    if not seen_sequence:
        raise ConfigError(f"{where}.single has no sequence ($A)")
    return parts


# -- decoders --

Decoder = Callable[[list[str]], list[str]]
"""A decoder: tokens to pieces of text, joined by the caller."""


def decoder(spec: Any, where: str) -> Decoder:
    """The decoder `spec` at `where` in the file; `ConfigError` for one not supported."""
    if spec is None:
        return lambda tokens: [" ".join(tokens)]
    spec = as_object(spec, where)
    kind = spec.get("type")
    if kind == "Sequence":
        steps = [decoder(s, at) for s, at in list_field(spec, "decoders", where)]
        return lambda tokens: functools.reduce(lambda ts, step: step(ts), steps, tokens)
    if kind == "ByteLevel":
        return _decode_byte_level
    if kind == "Metaspace":
        replacement = str_field(spec, "replacement", where, _METASPACE)
        if "prepend_scheme" in spec:
            strip = str_field(spec, "prepend_scheme", where) != "never"
        else:
            strip = bool_field(spec, "add_prefix_space", where, True)
        return lambda tokens: [
            t.replace(replacement, "" if k == 0 and strip else " ") for k, t in enumerate(tokens)
        ]
    if kind == "Replace":
        regex, content = _pattern(spec, where), str_field(spec, "content", where)
        return lambda tokens: [regex.sub(lambda _: content, t) for t in tokens]
    if kind == "ByteFallback":
        return _decode_byte_fallback
    if kind == "Fuse":
        return lambda tokens: ["".join(tokens)]
    if kind == "Strip":
        content = str_field(spec, "content", where)
        start, stop = (
            as_id(spec.get("start"), f"{where}.start"),
            as_id(spec.get("stop"), f"{where}.stop"),
        )
        return lambda tokens: [_strip(t, content, start, stop) for t in tokens]
    raise ConfigError(
        f"the decoder type {kind!r} ({where}) is not supported; supported: Sequence, ByteLevel, "
        "Metaspace, Replace, ByteFallback, Fuse, Strip"
    )


def _decode_byte_level(tokens: list[str]) -> list[str]:
    chars = _char_bytes()
    data = bytearray()
    for token in tokens:
        if all(c in chars for c in token):
            data.extend(chars[c] for c in token)
        else:
            data.extend(token.encode("utf-8"))  # not byte-level text: taken as it is
    return [data.decode("utf-8", "replace")]


_BYTE_TOKEN = re.compile("<0x[0-9A-Fa-f]{2}>")


def _decode_byte_fallback(tokens: list[str]) -> list[str]:
    """Runs of ``<0xNN>`` tokens as their UTF-8 text, or one U+FFFD per byte if they are not
    UTF-8 (the library's ByteFallback)."""
    out: list[str] = []
    pending = bytearray()
    for token in [*tokens, ""]:
        if _BYTE_TOKEN.fullmatch(token):
            pending.append(int(token[3:5], 16))
            continue
        if pending:
            try:
                out.append(pending.decode("utf-8"))
            except UnicodeDecodeError:
                out += ["\ufffd"] * len(pending)
            pending.clear()
        out.append(token)
    return out[:-1]


def _strip(token: str, content: str, start: int, stop: int) -> str:
    begin, end = 0, len(token)
    while begin < min(start, end) and token[begin] == content:
        begin += 1
    while stop > len(token) - end and end > begin and token[end - 1] == content:
        end -= 1
    return token[begin:end]
