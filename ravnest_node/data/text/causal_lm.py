"""Next-token prediction over a token sequence (`CausalLMData`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ravnest_node.data.text.sampling import TokenWindows
from ravnest_node.errors import ConfigError

__all__ = ["CausalLMData"]


class CausalLMData(TokenWindows):
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
