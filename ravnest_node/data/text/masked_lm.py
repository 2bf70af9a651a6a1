"""BERT's masked-LM task over a token sequence (`MaskedLMData`), and what it needs of a
vocabulary (`MaskingVocab`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ravnest_node.data.text.sampling import TokenWindows, as_tokens, check_batch
from ravnest_node.errors import ConfigError

__all__ = ["IGNORE_INDEX", "MaskedLMData", "MaskingVocab"]

IGNORE_INDEX = -100
"""Target of a position that carries no loss (cross entropy's ``ignore_index``)."""

_MASK_SHARE = 0.8
"""Of the chosen positions of a masked-LM row, the share that reads [MASK]..."""
_RANDOM_SHARE = 0.1
"""...and the share that reads a random token; the rest keep their token (BERT's 80/10/10)."""


class MaskingVocab(Protocol):
    """What `MaskedLMData` needs of a vocabulary (`TextTokenizer` is one)."""

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


class MaskedLMData(TokenWindows):
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
        ids = as_tokens(tokens)
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
        check_batch(step, batch_size)
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
