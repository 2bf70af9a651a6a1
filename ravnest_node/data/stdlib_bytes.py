"""Training data every Python install has: the bytes of the standard library's source files.

The corpus is the ``*.py`` files in the directory of the module `os` (not recursive), sorted by
name and concatenated. Batches are random windows drawn from a generator seeded by the step, so
any node, or a resumed run, can make step ``k``'s batch without replaying steps ``0..k-1``.

With ``num_samples > 0`` the data is instead a fixed set of that many windows (sample ids
``0..num_samples-1``), visited once per epoch in an order shuffled afresh every epoch: a
multi-epoch fine-tune, which aq-delta needs (it compresses a sample's activation against the one
of its previous visit).
Nodes compare `StdlibBytes.fingerprint` to check they read the same corpus (it differs between
Python versions).
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

from ravnest_node.errors import ConfigError

__all__ = ["SHARD_CHUNK", "StdlibBytes", "stdlib_dir"]

SHARD_CHUNK = 4096
"""Bytes per chunk when the corpus is dealt out to several shards."""


def stdlib_dir() -> Path:
    """The directory of the standard library module `os`, where the corpus is read from."""
    return Path(os.__file__).parent


@functools.lru_cache(maxsize=1)
def _load_corpus(directory: Path) -> tuple[torch.Tensor, str]:
    """The concatenated ``*.py`` bytes of `directory` as a uint8 tensor, and their fingerprint.

    Cached per process: every `StdlibBytes` shares the one tensor, which must not be written to.
    """
    data = bytearray()
    for path in sorted(directory.glob("*.py"), key=lambda p: p.name):
        data += path.read_bytes()
    if not data:
        raise ConfigError(f"no *.py files found in {directory}; cannot build the stdlib corpus")
    fingerprint = hashlib.sha256(data).hexdigest()[:16]
    return torch.frombuffer(data, dtype=torch.uint8), fingerprint


class StdlibBytes:
    """Random byte windows from the standard library's source, a pure function of the step.

    With ``num_shards > 1`` the corpus is cut into chunks of `SHARD_CHUNK` bytes dealt out in
    turn (chunk c belongs to shard c mod num_shards), and shard ``shard`` draws windows inside its
    own chunks only: different shards never see the same bytes, and each still sees every part
    of the corpus (every file), so replicas that average their parameters train on the same
    distribution. (Contiguous ranges would give each replica different files, and averaging
    replicas that learn different distributions costs loss.)
    """

    def __init__(
        self, *, seq_len: int, seed: int, shard: int = 0, num_shards: int = 1, num_samples: int = 0
    ) -> None:
        if seq_len < 1:
            raise ConfigError(f"seq_len must be at least 1, got {seq_len}")
        if num_shards < 1:
            raise ConfigError(f"num_shards must be at least 1, got {num_shards}")
        if not 0 <= shard < num_shards:
            raise ConfigError(f"shard must be in 0..{num_shards - 1}, got {shard}")
        self._corpus, self._fingerprint = _load_corpus(stdlib_dir())
        self.seq_len = seq_len
        self.seed = seed
        self.shard = shard
        self.num_shards = num_shards
        n = self.num_bytes
        # Window starts: [chunk start, chunk start + span) for each chunk of this shard.
        chunk = n if num_shards == 1 else max(SHARD_CHUNK, 4 * (seq_len + 1))
        firsts = torch.tensor(range(shard * chunk, n, num_shards * chunk), dtype=torch.long)
        spans = (torch.clamp(n - firsts, max=chunk) - seq_len).clamp(min=0)
        keep = spans > 0
        self._chunk_starts, self._spans = firsts[keep], spans[keep]
        self.chunk_bytes = chunk
        if not len(self._spans):
            raise ConfigError(
                f"shard {shard} of {num_shards} has no {seq_len + 1} contiguous bytes; use fewer "
                "shards or a shorter seq_len"
            )
        self._offsets = torch.arange(seq_len + 1)
        if num_samples < 0:
            raise ConfigError(f"num_samples must not be negative, got {num_samples}")
        self.num_samples = num_samples
        self._starts = (
            self._draw_starts(num_samples, torch.Generator().manual_seed(self._seed_of("dataset")))
            if num_samples
            else None
        )
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation)

    @property
    def num_bytes(self) -> int:
        """Size of the whole corpus (all shards) in bytes."""
        return int(self._corpus.numel())

    def owns(self, start: int) -> bool:
        """Whether a window starting at byte `start` lies inside one of this shard's chunks."""
        index = start // self.chunk_bytes
        return index % self.num_shards == self.shard and start + self.seq_len + 1 <= min(
            (index + 1) * self.chunk_bytes, self.num_bytes
        )

    def _draw_starts(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """`count` window starts, uniform over this shard's windows."""
        if self.num_shards == 1:  # one chunk: the whole corpus (the single-pipeline case)
            return torch.randint(0, self.num_bytes - self.seq_len, (count,), generator=generator)
        # A chunk with probability proportional to its windows, then a window inside it.
        which = torch.multinomial(
            self._spans.double(), count, replacement=True, generator=generator
        )
        offsets = (torch.rand(count, generator=generator, dtype=torch.float64)
                   * self._spans[which]).long()  # fmt: skip
        return self._chunk_starts[which] + offsets

    @property
    def fingerprint(self) -> str:
        """First 16 hex digits of the SHA-256 of the corpus bytes."""
        return self._fingerprint

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for `step`: two uint8 tensors ``[batch_size, seq_len]``.

        ``y[:, t] == x[:, t + 1]``: targets are the inputs shifted by one byte. The result is a
        pure function of (seed, shard, num_shards, step, batch_size) and the corpus. Raises
        `ValueError` for a negative step or a batch size below 1.
        """
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        starts = self.window_starts(step, batch_size)
        windows = self._corpus[starts[:, None] + self._offsets]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def window_starts(self, step: int, batch_size: int) -> torch.Tensor:
        """Byte offsets of the windows of `step`'s batch (each window is seq_len + 1 bytes)."""
        if self._starts is not None:
            return self._starts[torch.tensor(self.sample_ids(step, batch_size))]
        generator = torch.Generator().manual_seed(self._seed_of(f"{step}:{batch_size}"))
        return self._draw_starts(batch_size, generator)

    def sample_ids(self, step: int, batch_size: int) -> list[int]:
        """Dataset ids of the rows of `step`'s batch (fixed dataset only; [] otherwise).

        Row j of step k is the dataset's sample at position p = k * batch_size + j of the
        sequence of epochs; epoch p // num_samples visits every sample once, in its own order."""
        if self._starts is None:
            return []
        n = self.num_samples
        ids = []
        for p in range(step * batch_size, (step + 1) * batch_size):
            epoch, index = divmod(p, n)
            ids.append(int(self._permutation(epoch)[index]))
        return ids

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self._seed_of(f"epoch:{epoch}"))
            self._order = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._order[1]

    def _seed_of(self, what: str) -> int:
        key = f"stdlib-bytes:{self.seed}:{self.shard}:{self.num_shards}:{what}"
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1

    def __repr__(self) -> str:
        return (
            f"StdlibBytes(seq_len={self.seq_len}, seed={self.seed}, shard={self.shard}, "
            f"num_shards={self.num_shards}, num_samples={self.num_samples}, "
            f"num_bytes={self.num_bytes}, "
            f"fingerprint={self.fingerprint!r})"
        )
