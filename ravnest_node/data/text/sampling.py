"""How the text datasets choose their samples: windows of one token sequence, drawn per step
or fixed and dealt out to shards (`TokenWindows`); the epochs of a fixed dataset, each in a
fresh order (`Epochs`); the seeds of every draw; and the checks of sharding and batch settings.

With ``num_shards > 1`` a token sequence is cut into chunks dealt out in turn, as `StdlibBytes`
deals its bytes, so shards never share a token and each sees every part of the corpus. With
``num_samples > 0`` a dataset is instead a fixed set of windows visited once per epoch in a
fresh order. Every random draw comes from a `torch.Generator` seeded from the dataset's
settings (`derive_seed`), never from the global generator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from ravnest_node.errors import ConfigError

__all__ = [
    "TOKEN_SHARD_CHUNK",
    "Epochs",
    "TokenWindows",
    "as_tokens",
    "check_batch",
    "check_sharding",
    "derive_seed",
]

TOKEN_SHARD_CHUNK = 1024
"""Tokens per chunk (at least) when a token sequence is dealt out to several shards."""


def derive_seed(*parts: object) -> int:
    """A seed below 2**63 from `parts` (SHA-256 of their text): the same in every process."""
    key = ":".join(map(str, parts))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def check_sharding(shard: int, num_shards: int, num_samples: int) -> None:
    """ConfigError unless `shard` is one of `num_shards` (at least 1) and `num_samples` is not
    negative."""
    if num_shards < 1:
        raise ConfigError(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard must be in 0..{num_shards - 1}, got {shard}")
    if num_samples < 0:
        raise ConfigError(f"num_samples must not be negative, got {num_samples}")


def check_batch(step: int, batch_size: int) -> None:
    """ValueError for a negative step or a batch size below 1."""
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")


class Epochs:
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


def as_tokens(tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """`tokens` as a 1-d int64 tensor; ConfigError for any other shape."""
    ids = torch.as_tensor(tokens, dtype=torch.int64)
    if ids.dim() != 1:
        raise ConfigError(f"tokens must be one sequence (1-d), got shape {list(ids.shape)}")
    return ids


class TokenWindows:
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
        check_sharding(shard, num_shards, num_samples)
        self._tokens = as_tokens(tokens)
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
        self._epochs = Epochs(num_samples, self._seed_of) if num_samples else None
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
        check_batch(step, batch_size)
        if self._starts is not None:
            return self._starts[torch.tensor(self.sample_ids(step, batch_size))]
        return self._draw_starts(batch_size, self._generator(step, batch_size))

    def sample_ids(self, step: int, batch_size: int) -> list[int]:
        """Dataset ids of the rows of `step`'s batch (fixed dataset only; [] otherwise): row j
        of step k is the sample at position k * batch_size + j of the sequence of epochs."""
        check_batch(step, batch_size)
        return self._epochs.sample_ids(step, batch_size) if self._epochs is not None else []

    def _windows(self, starts: torch.Tensor) -> torch.Tensor:
        return self._tokens[starts[:, None] + self._offsets]

    def _generator(self, step: int, batch_size: int) -> torch.Generator:
        return torch.Generator().manual_seed(self._seed_of(f"{step}:{batch_size}"))

    def _seed_of(self, what: str) -> int:
        return derive_seed(self.kind, self.seed, self.shard, self.num_shards, what)

    def _digest(self, settings: str) -> str:
        """The fingerprint over `settings` and the whole token sequence: equal on every shard,
        and whatever the seed or num_samples, which the run's settings carry."""
        digest = hashlib.sha256(f"{self.kind}:{settings}\n".encode())
        digest.update(self._tokens.numpy().tobytes())
        return digest.hexdigest()[:16]
