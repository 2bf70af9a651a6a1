"""The text a dataset is cut from: local files (`read_texts`, `read_jsonl`) or
`stdlib_docstrings`, English text that every Python install has; and a whole corpus tokenized
once (`tokenize_corpus`).
"""

from __future__ import annotations

import ast
import functools
import gc
import hashlib
import json
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from ravnest_node.data.stdlib_bytes import stdlib_dir
from ravnest_node.errors import ConfigError

__all__ = [
    "Tokenizer",
    "json_lines",
    "json_object",
    "read_jsonl",
    "read_texts",
    "stdlib_docstrings",
    "tokenize_corpus",
]


class Tokenizer(Protocol):
    """What `tokenize_corpus` needs of a tokenizer (`TextTokenizer` is one)."""

    @property
    def fingerprint(self) -> str:
        """Equal for two tokenizers exactly when they give equal ids for every text."""
        ...

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`."""
        ...


def stdlib_docstrings() -> str:
    """English text every Python install has: the docstrings of the top-level ``*.py`` modules
    in the directory of `os`, files sorted by name, each file's docstrings in source order,
    separated by blank lines. The files are parsed, never imported. Cached per process; it
    differs between Python versions, as `StdlibBytes`' corpus does."""
    return _docstrings(stdlib_dir())


@functools.lru_cache(maxsize=2)
def _docstrings(directory: Path) -> str:
    docs: list[str] = []
    for path in sorted(directory.glob("*.py"), key=lambda p: p.name):
        source = path.read_bytes()
        # A syntax tree is many small objects without cycles: collecting garbage while it is
        # built only costs time (half the time, in a process with a large heap).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # invalid escapes in old sources
                tree = ast.parse(source, filename=str(path))
        except (SyntaxError, ValueError):
            continue  # not this Python's syntax: it is left out on every node alike
        finally:
            if collecting:
                gc.enable()
        docs += _source_docstrings(tree)
    if not docs:
        raise ConfigError(f"no docstrings found in the *.py files of {directory}")
    return "\n\n".join(docs)


_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)
"""The nodes that may hold a class or function definition."""


def _source_docstrings(tree: ast.Module) -> list[str]:
    """The docstrings of a module and of the classes and functions in it, in source order.
    Walks statements only: docstrings never hide inside expressions, which are most nodes."""
    docs = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                docs.append(doc)
        children: list[ast.AST] = []
        for field in ("body", "handlers", "orelse", "finalbody", "cases"):
            value = getattr(node, field, None)
            if isinstance(value, list):
                children += [c for c in value if isinstance(c, _BLOCKS)]
        stack += reversed(children)  # depth first, in source order
    return docs


def read_texts(paths: Sequence[Path]) -> str:
    """The UTF-8 text files `paths`, in the order given, separated by blank lines. Raises
    `ConfigError` naming a file that cannot be read or is not UTF-8, or if `paths` is empty."""
    if not paths:
        raise ConfigError("no text files given")
    texts = []
    for path in paths:
        try:
            texts.append(Path(path).read_text(encoding="utf-8-sig"))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the text file {path}: {exc}") from exc
    return "\n\n".join(texts)


def json_lines(path: Path) -> list[tuple[int, str]]:
    """The non-blank lines of JSON Lines file `path` with their numbers (from 1); ConfigError
    naming the file if it cannot be read as UTF-8."""
    try:
        content = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the JSON Lines file {path}: {exc}") from exc
    return [(n, line) for n, line in enumerate(content.split("\n"), start=1) if line.strip()]


def json_object(where: str, line: str) -> dict[str, object]:
    """The JSON object on `line`; ConfigError naming `where` (file:line) for anything else."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{where}: not a JSON object: {exc}") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a JSON {type(row).__name__}, expected an object")
    return row


def read_jsonl(
    path: Path, *, text_field: str = "text", label_field: str = "label"
) -> list[tuple[str, int | str]]:
    """The (text, label) pairs of a JSON Lines file: one JSON object per line, with a string
    under `text_field` and an int or a string under `label_field`; blank lines are skipped.
    Raises `ConfigError` naming the file and the line of the first bad line, or if the file
    cannot be read or holds no example."""
    examples: list[tuple[str, int | str]] = []
    for number, line in json_lines(path):
        where = f"{path}:{number}"
        row = json_object(where, line)
        text, label = row.get(text_field), row.get(label_field)
        if not isinstance(text, str):
            raise ConfigError(f"{where}: {text_field!r} must be a string, got {text!r:.60}")
        if isinstance(label, bool) or not isinstance(label, int | str):
            raise ConfigError(
                f"{where}: {label_field!r} must be an int or a string, got {label!r:.60}"
            )
        examples.append((text, label))
    if not examples:
        raise ConfigError(f"{path}: no examples")
    return examples


_corpus_cache: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()
_corpus_lock = threading.Lock()
_CORPUS_CACHE_SIZE = 4


def tokenize_corpus(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """The token ids of `text` as a 1-d int64 tensor, without special tokens.

    Cached per process by (tokenizer fingerprint, SHA-256 of the text), so the datasets of
    several shards or stages tokenize a corpus once: the tensor is shared and must not be
    written to."""
    key = (tokenizer.fingerprint, hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())
    with _corpus_lock:
        cached = _corpus_cache.get(key)
        if cached is not None:
            _corpus_cache.move_to_end(key)
            return cached
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
    with _corpus_lock:
        _corpus_cache[key] = ids
        while len(_corpus_cache) > _CORPUS_CACHE_SIZE:
            _corpus_cache.popitem(last=False)
    return ids
