"""The BPE ``model`` of a Hugging Face ``tokenizer.json``: the token ids of one pre-token.

The pre-token's characters (or with ``byte_fallback`` the UTF-8 bytes of a character the
vocabulary lacks, as ``<0xNN>`` tokens; else ``unk_token``, consecutive ones fused with
``fuse_unk``) are merged pair by pair, the pair of lowest merge rank first and the leftmost among
equals; with ``ignore_merges`` a pre-token that is itself in the vocabulary is that one token.
``merges`` may be ``"a b"`` strings or ``["a", "b"]`` pairs. Models other than BPE, BPE dropout,
``continuing_subword_prefix`` and ``end_of_word_suffix`` are refused with a `ConfigError`.
"""

from __future__ import annotations

import heapq
from typing import Any

from ravnest_node.data.bpe_json import as_id, as_list, as_object, bool_field
from ravnest_node.errors import ConfigError

__all__ = ["BpeModel"]

_SCAN_CHARS = 24
"""Runs of up to this many symbols are merged by scanning their pairs, longer ones by a heap."""


class BpeModel:
    """The BPE model of the file: a pre-token's ids (see the module's docstring)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        """Raises `ConfigError` for a model that is not BPE, or a setting not supported."""
        kind = spec.get("type", "BPE" if "merges" in spec else None)
        if kind != "BPE":
            raise ConfigError(f"the model type is {kind!r}: only BPE models are supported")
        if spec.get("dropout") not in (None, 0, 0.0):
            raise ConfigError("BPE dropout is not supported (it makes the ids random)")
        for key in ("continuing_subword_prefix", "end_of_word_suffix"):
            if spec.get(key):
                raise ConfigError(f"model.{key} is not supported")
        self.vocab: dict[str, int] = as_object(spec.get("vocab"), "model.vocab")
        self.tokens: dict[int, str] = {}
        for token, i in self.vocab.items():
            other = self.tokens.setdefault(as_id(i, f"model.vocab[{token!r}]"), token)
            if other != token:
                raise ConfigError(f"model.vocab gives the id {i} to both {other!r} and {token!r}")
        self.merges = _merges(as_list(spec.get("merges", []), "model.merges"), self.vocab)
        unk = spec.get("unk_token")
        if unk is not None and (not isinstance(unk, str) or unk not in self.vocab):
            raise ConfigError(f"model.unk_token {unk!r:.60} is not in the vocabulary")
        self.unk_id = None if unk is None else self.vocab[unk]
        self.fuse_unk = bool_field(spec, "fuse_unk", "model", False)
        self.byte_fallback = bool_field(spec, "byte_fallback", "model", False)
        self.ignore_merges = bool_field(spec, "ignore_merges", "model", False)
        self._bigrams: frozenset[str] | None = None

    def ids(self, word: str) -> list[int]:
        """The ids of the pre-token `word`."""
        if self.ignore_merges and word in self.vocab:
            return [self.vocab[word]]
        ids = self._symbols(word)
        if len(ids) <= _SCAN_CHARS:
            return self._scan(ids)
        # Cut where two neighbours are a pair of characters no token holds: no merge ever joins
        # them, and each side merges alone as it would have within the whole.
        if self._bigrams is None:
            self._bigrams = frozenset(t[k : k + 2] for t in self.vocab for k in range(len(t) - 1))
        tokens, bigrams = self.tokens, self._bigrams
        out: list[int] = []
        start = 0
        for k in range(1, len(ids)):
            if tokens[ids[k - 1]][-1:] + tokens[ids[k]][:1] not in bigrams:
                part = ids[start:k]
                out += self._scan(part) if len(part) <= _SCAN_CHARS else self._heap(part)
                start = k
        part = ids[start:]
        return out + (self._scan(part) if len(part) <= _SCAN_CHARS else self._heap(part))

    def _symbols(self, word: str) -> list[int]:
        """The ids of `word`'s characters before merging: a character the vocabulary lacks
        becomes its UTF-8 bytes (``<0xNN>``) with byte fallback, else the unknown token (runs of
        them fused with ``fuse_unk``), else nothing, as the library does."""
        vocab, unk = self.vocab, self.unk_id
        ids: list[int] = []
        pending = False  # an unknown token waits: it goes in before the next known character
        for char in word:
            found = vocab.get(char)
            if found is not None:
                if pending and unk is not None:
                    ids.append(unk)
                    pending = False
                ids.append(found)
                continue
            if self.byte_fallback:
                codes = [vocab.get(f"<0x{b:02X}>") for b in char.encode("utf-8")]
                known = [c for c in codes if c is not None]
                if len(known) == len(codes):
                    ids += known  # (the library puts them before a waiting unknown token)
                    continue
            if unk is not None:
                if pending and not self.fuse_unk:
                    ids.append(unk)
                pending = True
        if pending and unk is not None:
            ids.append(unk)
        return ids

    def _scan(self, ids: list[int]) -> list[int]:
        """`ids` merged: the pair of lowest rank first, the leftmost among equals."""
        merges = self.merges
        while len(ids) > 1:
            best, where = None, -1
            for k in range(len(ids) - 1):
                found = merges.get((ids[k], ids[k + 1]))
                if found is not None and (best is None or found[0] < best[0]):
                    best, where = found, k
            if best is None:
                break
            ids[where : where + 2] = [best[1]]
        return ids

    def _heap(self, ids: list[int]) -> list[int]:
        """As `_scan`, in n log n steps: a linked list of symbols and a heap of candidate
        merges (rank, position, merged id) that are dropped when stale."""
        merges, n = self.merges, len(ids)
        after = list(range(1, n + 1))
        before = list(range(-1, n - 1))
        alive = [True] * n
        heap: list[tuple[int, int, int]] = []
        for k in range(n - 1):
            found = merges.get((ids[k], ids[k + 1]))
            if found is not None:
                heap.append((found[0], k, found[1]))
        heapq.heapify(heap)
        while heap:
            _, k, new = heapq.heappop(heap)
            nxt = after[k]
            if not alive[k] or nxt >= n or merges.get((ids[k], ids[nxt]), (0, -1))[1] != new:
                continue
            ids[k] = new
            alive[nxt] = False
            after[k] = after[nxt]
            if after[k] < n:
                before[after[k]] = k
            prev = before[k]
            if prev >= 0 and (found := merges.get((ids[prev], new))) is not None:
                heapq.heappush(heap, (found[0], prev, found[1]))
            if after[k] < n and (found := merges.get((new, ids[after[k]]))) is not None:
                heapq.heappush(heap, (found[0], k, found[1]))
        return [i for i, live in zip(ids, alive, strict=True) if live]


def _merges(merges: list[Any], vocab: dict[str, int]) -> dict[tuple[int, int], tuple[int, int]]:
    """(left id, right id) -> (rank, merged id) of the ``merges`` list (a later duplicate wins,
    as in the library)."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, merge in enumerate(merges):
        if isinstance(merge, str) and merge.count(" ") == 1:
            left, right = merge.split(" ")
        elif isinstance(merge, list) and len(merge) == 2 and all(isinstance(m, str) for m in merge):
            left, right = merge
        else:
            raise ConfigError(
                f'model.merges[{rank}] must be "left right" or ["left", "right"], got {merge!r:.60}'
            )
        for token in (left, right, left + right):
            if token not in vocab:
                raise ConfigError(f"model.merges[{rank}] {merge!r} needs {token!r}, not in vocab")
        out[vocab[left], vocab[right]] = (rank, vocab[left + right])
    return out
