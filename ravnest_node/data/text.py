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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from ravnest_node.data.stdlib_bytes import stdlib_dir
from ravnest_node.errors import ConfigError

__all__ = [
    "IGNORE_INDEX",
    "TOKEN_SHARD_CHUNK",
    "CausalLMData",
    "ClassificationData",
    "MaskedLMData",
    "MaskingVocab",
    "Tokenizer",
    "read_jsonl",
    "read_texts",
    "stdlib_docstrings",
    "tokenize_corpus",
]

IGNORE_INDEX = -100
"""Target of a position that carries no loss (cross entropy's ``ignore_index``)."""

TOKEN_SHARD_CHUNK = 1024
"""Tokens per chunk (at least) when a token sequence is dealt out to several shards."""

_MASK_SHARE = 0.8
"""Of the chosen positions of a masked-LM row, the share that reads [MASK]..."""
_RANDOM_SHARE = 0.1
"""...and the share that reads a random token; the rest keep their token (BERT's 80/10/10)."""


class Tokenizer(Protocol):
    """What `tokenize_corpus` needs of a tokenizer (`WordPiece` is one)."""

    @property
    def fingerprint(self) -> str:
        """Equal for two tokenizers exactly when they give equal ids for every text."""
        ...

    def encode(self, text: str) -> list[int]:
        """The token ids of `text`."""
        ...


class MaskingVocab(Protocol):
    """What `MaskedLMData` needs of a vocabulary (`WordPiece` is one)."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        ...

    @property
    def cls_id(self) -> int:
        """The token that starts a row."""
        ...

    @property
    def sep_id(self) -> int:
        """The token that ends a row."""
        ...

    @property
    def mask_id(self) -> int:
        """The token that hides a chosen position."""
        ...

    @property
    def special_ids(self) -> frozenset[int]:
        """Tokens never chosen for masking and never drawn as random replacements."""
        ...


# -- corpora --


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


def read_jsonl(
    path: Path, *, text_field: str = "text", label_field: str = "label"
) -> list[tuple[str, int | str]]:
    """The (text, label) pairs of a JSON Lines file: one JSON object per line, with a string
    under `text_field` and an int or a string under `label_field`; blank lines are skipped.
    Raises `ConfigError` naming the file and the line of the first bad line, or if the file
    cannot be read or holds no example."""
    try:
        content = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the JSON Lines file {path}: {exc}") from exc
    examples: list[tuple[str, int | str]] = []
    for number, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"{where}: not a JSON object: {exc}") from exc
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: a JSON {type(row).__name__}, expected an object")
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


# -- shared parts --


def _seed(*parts: object) -> int:
    key = ":".join(map(str, parts))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def _check_sharding(shard: int, num_shards: int, num_samples: int) -> None:
    if num_shards < 1:
        raise ConfigError(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard must be in 0..{num_shards - 1}, got {shard}")
    if num_samples < 0:
        raise ConfigError(f"num_samples must not be negative, got {num_samples}")


def _check_batch(step: int, batch_size: int) -> None:
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")


class _Epochs:
    """The sample ids of a fixed dataset's batches: epoch after epoch, each a fresh permutation
    of ``0..num_samples-1`` (as `StdlibBytes.sample_ids`)."""

    def __init__(self, num_samples: int, seed_of: Callable[[str], int]) -> None:
        self.num_samples = num_samples
        self._seed_of = seed_of
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation)

    def sample_ids(self, step: int, batch_size: int) -> list[int]:
        ids = []
        for p in range(step * batch_size, (step + 1) * batch_size):
            epoch, index = divmod(p, self.num_samples)
            ids.append(int(self._permutation(epoch)[index]))
        return ids

    def _permutation(self, epoch: int) -> torch.Tensor:
        order = self._order  # one read: another thread may swap it meanwhile
        if order is None or order[0] != epoch:
            generator = torch.Generator().manual_seed(self._seed_of(f"epoch:{epoch}"))
            order = (epoch, torch.randperm(self.num_samples, generator=generator))
            self._order = order
        return order[1]


def _as_tokens(tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(tokens, dtype=torch.int64)
    if ids.dim() != 1:
        raise ConfigError(f"tokens must be one sequence (1-d), got shape {list(ids.shape)}")
    return ids


class _TokenWindows:
    """Windows of `window` consecutive tokens of one sequence, drawn per step or fixed, and
    dealt out to shards in chunks. The datasets below frame them as their task needs."""

    kind = ""
    """Names the task in seeds and fingerprints, so two tasks never draw alike."""

    def __init__(
        self,
        tokens: torch.Tensor | Sequence[int],
        *,
        window: int,
        seed: int,
        shard: int,
        num_shards: int,
        num_samples: int,
    ) -> None:
        _check_sharding(shard, num_shards, num_samples)
        self._tokens = _as_tokens(tokens)
        self.seed = seed
        self.shard = shard
        self.num_shards = num_shards
        self.window = window
        n = self.num_tokens
        # Window starts: [chunk start, chunk start + span) for each chunk of this shard.
        chunk = n if num_shards == 1 else max(TOKEN_SHARD_CHUNK, 4 * window)
        firsts = torch.arange(shard * chunk, n, num_shards * chunk, dtype=torch.int64)
        spans = (torch.clamp(n - firsts, max=chunk) - window + 1).clamp(min=0)
        keep = spans > 0
        self._chunk_starts, self._spans = firsts[keep], spans[keep]
        self.chunk_tokens = chunk
        if not len(self._spans):
            raise ConfigError(
                f"shard {shard} of {num_shards} has no {window} consecutive tokens (the corpus "
                f"has {n}); use more text, fewer shards or a shorter seq_len"
            )
        self._offsets = torch.arange(window)
        self.num_samples = num_samples
        self._epochs = _Epochs(num_samples, self._seed_of) if num_samples else None
        self._starts = (
            self._draw_starts(num_samples, torch.Generator().manual_seed(self._seed_of("dataset")))
            if num_samples
            else None
        )

    @property
    def num_tokens(self) -> int:
        """Length of the whole token sequence (all shards)."""
        return int(self._tokens.numel())

    def owns(self, start: int) -> bool:
        """Whether a window starting at token `start` lies inside one of this shard's chunks."""
        index = start // self.chunk_tokens
        return index % self.num_shards == self.shard and start + self.window <= min(
            (index + 1) * self.chunk_tokens, self.num_tokens
        )

    def _draw_starts(self, count: int, generator: torch.Generator) -> torch.Tensor:
        if self.num_shards == 1:
            high = self.num_tokens - self.window + 1
            return torch.randint(0, high, (count,), generator=generator)
        which = torch.multinomial(
            self._spans.double(), count, replacement=True, generator=generator
        )
        offsets = (torch.rand(count, generator=generator, dtype=torch.float64)
                   * self._spans[which]).long()  # fmt: skip
        return self._chunk_starts[which] + offsets

    def window_starts(self, step: int, batch_size: int) -> torch.Tensor:
        """Token offsets of the windows of `step`'s batch (each `window` tokens long)."""
        _check_batch(step, batch_size)
        if self._starts is not None:
            return self._starts[torch.tensor(self.sample_ids(step, batch_size))]
        return self._draw_starts(batch_size, self._generator(step, batch_size))

    def sample_ids(self, step: int, batch_size: int) -> list[int]:
        """Dataset ids of the rows of `step`'s batch (fixed dataset only; [] otherwise): row j
        of step k is the sample at position k * batch_size + j of the sequence of epochs."""
        _check_batch(step, batch_size)
        return self._epochs.sample_ids(step, batch_size) if self._epochs is not None else []

    def _windows(self, starts: torch.Tensor) -> torch.Tensor:
        return self._tokens[starts[:, None] + self._offsets]

    def _generator(self, step: int, batch_size: int) -> torch.Generator:
        return torch.Generator().manual_seed(self._seed_of(f"{step}:{batch_size}"))

    def _seed_of(self, what: str) -> int:
        return _seed(self.kind, self.seed, self.shard, self.num_shards, what)

    def _digest(self, settings: str) -> str:
        """The fingerprint over `settings` and the whole token sequence: equal on every shard,
        and whatever the seed or num_samples, which the run's settings carry."""
        digest = hashlib.sha256(f"{self.kind}:{settings}\n".encode())
        digest.update(self._tokens.numpy().tobytes())
        return digest.hexdigest()[:16]


# -- datasets --


class MaskedLMData(_TokenWindows):
    """BERT's masked-LM task over a token sequence: rows ``[CLS] w [SEP]`` of `seq_len` tokens
    (so seq_len - 2 corpus tokens per window).

    Of each row's positions that hold no special token, round(mask_prob * count) are chosen (at
    least one); of those, 80% read [MASK], 10% a random token of the vocabulary (special tokens
    left out) and 10% their own token. Targets hold the original token at the chosen positions
    and `IGNORE_INDEX` everywhere else. Masks are drawn afresh for every step (dynamic masking)
    or, in a fixed dataset, once per sample.
    """

    kind = "masked-lm"

    def __init__(
        self,
        tokens: torch.Tensor | Sequence[int],
        *,
        tokenizer: MaskingVocab,
        seq_len: int,
        seed: int,
        shard: int = 0,
        num_shards: int = 1,
        num_samples: int = 0,
        mask_prob: float = 0.15,
    ) -> None:
        """Raises `ConfigError` for a seq_len below 3, a mask_prob outside (0, 1], a token id
        outside the vocabulary, a vocabulary of special tokens only, or a shard too short for
        one window."""
        if seq_len < 3:
            raise ConfigError(f"seq_len must be at least 3 ([CLS], a token, [SEP]), got {seq_len}")
        if not 0 < mask_prob <= 1:
            raise ConfigError(f"mask_prob must be in (0, 1], got {mask_prob}")
        self.seq_len = seq_len
        self.mask_prob = mask_prob
        self.cls_id = tokenizer.cls_id
        self.sep_id = tokenizer.sep_id
        self.mask_id = tokenizer.mask_id
        vocab_size = tokenizer.vocab_size
        special = set(tokenizer.special_ids) | {self.cls_id, self.sep_id, self.mask_id}
        if not all(0 <= i < vocab_size for i in special):
            raise ConfigError(f"a special token id lies outside the vocabulary of {vocab_size}")
        self._special = torch.zeros(vocab_size, dtype=torch.bool)
        self._special[sorted(special)] = True
        self._replacements = (~self._special).nonzero().flatten()
        if not len(self._replacements):
            raise ConfigError("the vocabulary has no token but special ones to draw from")
        ids = _as_tokens(tokens)
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
            raise ConfigError(f"a token id of the corpus lies outside 0..{vocab_size - 1}")
        super().__init__(
            ids, window=seq_len - 2, seed=seed, shard=shard, num_shards=num_shards,
            num_samples=num_samples,
        )  # fmt: skip
        self._fingerprint = self._digest(
            f"seq_len={seq_len}:mask_prob={mask_prob!r}:vocab={vocab_size}:cls={self.cls_id}:"
            f"sep={self.sep_id}:mask={self.mask_id}:special={sorted(special)}"
        )
        self._fixed: tuple[torch.Tensor, torch.Tensor] | None = None
        if self._starts is not None:
            generator = torch.Generator().manual_seed(self._seed_of("dataset-masks"))
            self._fixed = self._mask(self._windows(self._starts), generator)

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of the token sequence and the settings that
        change rows (seq_len, mask_prob, the special and vocabulary ids)."""
        return self._fingerprint

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for `step`: two int64 tensors ``[batch_size, seq_len]``. A pure
        function of (seed, shard, num_shards, step, batch_size) and the corpus. Raises
        `ValueError` for a negative step or a batch size below 1."""
        if self._fixed is not None:
            rows = torch.tensor(self.sample_ids(step, batch_size))
            return self._fixed[0][rows], self._fixed[1][rows]
        _check_batch(step, batch_size)
        # One generator per batch: the windows first (as `window_starts`), then the masks.
        generator = self._generator(step, batch_size)
        starts = self._draw_starts(batch_size, generator)
        return self._mask(self._windows(starts), generator)

    def _mask(
        self, windows: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = windows.shape[0]
        rows = torch.cat(
            [
                torch.full((count, 1), self.cls_id, dtype=torch.int64),
                windows,
                torch.full((count, 1), self.sep_id, dtype=torch.int64),
            ],
            dim=1,
        )
        eligible = ~self._special[rows]
        # Choose k eligible positions per row: those with the k smallest random scores.
        scores = torch.rand(rows.shape, generator=generator).masked_fill_(~eligible, 2.0)
        available = eligible.sum(dim=1)
        k = torch.minimum(
            (available.double() * self.mask_prob).round().long().clamp(min=1), available
        )
        order = scores.argsort(dim=1, stable=True)
        first_k = torch.arange(self.seq_len)[None, :] < k[:, None]
        chosen = torch.zeros_like(eligible).scatter_(1, order, first_k)
        action = torch.rand(rows.shape, generator=generator)
        random_ids = self._replacements[
            torch.randint(len(self._replacements), rows.shape, generator=generator)
        ]
        inputs = rows.masked_fill(chosen & (action < _MASK_SHARE), self.mask_id)
        replace = chosen & (action >= _MASK_SHARE) & (action < _MASK_SHARE + _RANDOM_SHARE)
        inputs = torch.where(replace, random_ids, inputs)
        targets = torch.where(chosen, rows, IGNORE_INDEX)
        return inputs, targets

    def __repr__(self) -> str:
        return (
            f"MaskedLMData(seq_len={self.seq_len}, seed={self.seed}, shard={self.shard}, "
            f"num_shards={self.num_shards}, num_samples={self.num_samples}, "
            f"num_tokens={self.num_tokens}, mask_prob={self.mask_prob}, "
            f"fingerprint={self.fingerprint!r})"
        )


class CausalLMData(_TokenWindows):
    """Next-token prediction over a token sequence: windows of seq_len + 1 tokens, inputs the
    first seq_len, targets the last seq_len (the inputs shifted by one token)."""

    kind = "causal-lm"

    def __init__(
        self,
        tokens: torch.Tensor | Sequence[int],
        *,
        seq_len: int,
        seed: int,
        shard: int = 0,
        num_shards: int = 1,
        num_samples: int = 0,
    ) -> None:
        """Raises `ConfigError` for a seq_len below 1 or a shard too short for one window."""
        if seq_len < 1:
            raise ConfigError(f"seq_len must be at least 1, got {seq_len}")
        self.seq_len = seq_len
        super().__init__(
            tokens, window=seq_len + 1, seed=seed, shard=shard, num_shards=num_shards,
            num_samples=num_samples,
        )  # fmt: skip
        self._fingerprint = self._digest(f"seq_len={seq_len}")

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of the token sequence and seq_len."""
        return self._fingerprint

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for `step`: two int64 tensors ``[batch_size, seq_len]`` with
        ``targets[:, t] == inputs[:, t + 1]``. A pure function of (seed, shard, num_shards,
        step, batch_size) and the corpus. Raises `ValueError` for a negative step or a batch
        size below 1."""
        windows = self._windows(self.window_starts(step, batch_size))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __repr__(self) -> str:
        return (
            f"CausalLMData(seq_len={self.seq_len}, seed={self.seed}, shard={self.shard}, "
            f"num_shards={self.num_shards}, num_samples={self.num_samples}, "
            f"num_tokens={self.num_tokens}, fingerprint={self.fingerprint!r})"
        )


class ClassificationData:
    """Labelled examples for sequence classification, a fixed dataset.

    Each example's token ids become a row of seq_len ids: ``[CLS] ids [SEP]`` when `cls_id` and
    `sep_id` are given (either alone adds only itself), the ids cut to fit, then `pad_id` to the
    end (a model finds its attention mask as ``inputs != pad_id``). Labels become class indices
    ``0..num_labels-1``: string labels, and int labels when `num_labels` is not given, in sorted
    order of their distinct values; int labels with `num_labels` given are already indices and
    must lie in ``0..num_labels-1``. Example i belongs to shard i mod num_shards; a shard's
    examples are its samples ``0..num_samples-1``, visited once per epoch in a fresh order.
    """

    def __init__(
        self,
        examples: Sequence[tuple[torch.Tensor | Sequence[int], int | str]],
        *,
        seq_len: int,
        seed: int,
        pad_id: int,
        cls_id: int | None = None,
        sep_id: int | None = None,
        num_labels: int | None = None,
        shard: int = 0,
        num_shards: int = 1,
    ) -> None:
        """Raises `ConfigError` if there are no examples, fewer than shards, labels of mixed
        types or more classes than `num_labels`, or no room for a token in a row."""
        _check_sharding(shard, num_shards, 0)
        frame = [i for i in (cls_id, sep_id) if i is not None]
        if seq_len <= len(frame):
            raise ConfigError(f"seq_len must be above {len(frame)} to hold a token, got {seq_len}")
        if not examples:
            raise ConfigError("no examples to classify")
        self.seq_len, self.seed, self.shard, self.num_shards = seq_len, seed, shard, num_shards
        self.label_names, labels = _class_indices([label for _, label in examples], num_labels)
        self._labels = torch.tensor(labels, dtype=torch.int64)
        body = seq_len - len(frame)
        self._rows = torch.full((len(examples), seq_len), pad_id, dtype=torch.int64)
        for i, (ids, _) in enumerate(examples):
            row = _as_tokens(ids)[:body]
            if cls_id is not None:
                row = torch.cat([torch.tensor([cls_id]), row])
            if sep_id is not None:
                row = torch.cat([row, torch.tensor([sep_id])])
            self._rows[i, : len(row)] = row
        self.num_samples = len(range(shard, len(examples), num_shards))
        if not self.num_samples:
            raise ConfigError(
                f"shard {shard} of {num_shards} has no example: there are only {len(examples)}"
            )
        self._epochs = _Epochs(self.num_samples, self._seed_of)
        digest = hashlib.sha256(
            f"classification:seq_len={seq_len}:pad={pad_id}:cls={cls_id}:sep={sep_id}:"
            f"labels={json.dumps(list(self.label_names))}\n".encode()
        )
        digest.update(self._rows.numpy().tobytes())
        digest.update(self._labels.numpy().tobytes())
        self._fingerprint = digest.hexdigest()[:16]

    @property
    def num_labels(self) -> int:
        """Number of classes; class index c stands for the label ``label_names[c]``."""
        return len(self.label_names)

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of every example's row and class and the settings
        that make them (equal on every shard, whatever the seed)."""
        return self._fingerprint

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (int64 ``[batch_size, seq_len]``) and class indices (int64 ``[batch_size]``)
        for `step`: the examples of `sample_ids`. A pure function of (seed, shard, num_shards,
        step, batch_size) and the examples. Raises `ValueError` for a negative step or a batch
        size below 1."""
        rows = self.shard + torch.tensor(self.sample_ids(step, batch_size)) * self.num_shards
        return self._rows[rows], self._labels[rows]

    def sample_ids(self, step: int, batch_size: int) -> list[int]:
        """This shard's sample ids (``0..num_samples-1``) of the rows of `step`'s batch; sample
        s is example ``shard + s * num_shards`` of all of them."""
        _check_batch(step, batch_size)
        return self._epochs.sample_ids(step, batch_size)

    def _seed_of(self, what: str) -> int:
        return _seed("classification", self.seed, self.shard, self.num_shards, what)

    def __repr__(self) -> str:
        return (
            f"ClassificationData(seq_len={self.seq_len}, seed={self.seed}, shard={self.shard}, "
            f"num_shards={self.num_shards}, num_samples={self.num_samples}, "
            f"num_labels={self.num_labels}, fingerprint={self.fingerprint!r})"
        )


def _class_indices(
    labels: Sequence[int | str], num_labels: int | None
) -> tuple[tuple[int | str, ...], list[int]]:
    """(label of each class index, class index of each label); see `ClassificationData`."""
    if all(isinstance(x, str) for x in labels):
        names: list[int | str] = sorted(set(labels), key=str)
    elif all(isinstance(x, int) and not isinstance(x, bool) for x in labels):
        if num_labels is not None:
            wrong = [x for x in labels if not 0 <= int(x) < num_labels]
            if wrong:
                raise ConfigError(f"label {wrong[0]} is not a class index in 0..{num_labels - 1}")
            names = list(range(num_labels))
        else:
            names = sorted(set(labels), key=int)
    else:
        raise ConfigError("labels must be all ints or all strings")
    if num_labels is not None and len(names) > num_labels:
        raise ConfigError(f"{len(names)} distinct labels, but num_labels is {num_labels}")
    index = {name: i for i, name in enumerate(names)}
    return tuple(names), [index[x] for x in labels]
