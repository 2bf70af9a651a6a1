"""Labelled examples for sequence classification (`ClassificationData`): rows of token ids
with a class index each, a fixed dataset dealt out to the shards one example at a time."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch

from ravnest_node.data.text.sampling import (
    Epochs,
    as_tokens,
    check_batch,
    check_sharding,
    derive_seed,
)
from ravnest_node.errors import ConfigError

__all__ = ["ClassificationData"]


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
        check_sharding(shard, num_shards, 0)
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
            row = as_tokens(ids)[:body]
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
        self._epochs = Epochs(self.num_samples, self._seed_of)
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
        check_batch(step, batch_size)
        return self._epochs.sample_ids(step, batch_size)

    def _seed_of(self, what: str) -> int:
        return derive_seed("classification", self.seed, self.shard, self.num_shards, what)

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
