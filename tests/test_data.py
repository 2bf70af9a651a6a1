"""The stdlib byte corpus: deterministic batches, shifted targets, disjoint shards."""

from __future__ import annotations

import hashlib

import pytest
import torch

from ravnest_node.data import StdlibBytes
from ravnest_node.data.stdlib_bytes import stdlib_dir
from ravnest_node.errors import ConfigError


def _corpus_bytes() -> bytes:
    files = sorted(stdlib_dir().glob("*.py"), key=lambda p: p.name)
    return b"".join(p.read_bytes() for p in files)


def _windows(x: torch.Tensor, y: torch.Tensor) -> list[bytes]:
    """Each row's full window: the inputs plus the last target byte."""
    return [
        bytes(torch.cat([row_x, row_y[-1:]]).tolist()) for row_x, row_y in zip(x, y, strict=True)
    ]


def test_corpus_is_the_stdlib_sources() -> None:
    data = StdlibBytes(seq_len=16, seed=0)
    raw = _corpus_bytes()
    assert data.num_bytes == len(raw) > 1_000_000
    assert data.fingerprint == hashlib.sha256(raw).hexdigest()[:16]


def test_fingerprint_is_stable_and_shared() -> None:
    a = StdlibBytes(seq_len=16, seed=0)
    b = StdlibBytes(seq_len=64, seed=7, shard=1, num_shards=3)
    assert a.fingerprint == b.fingerprint == a.fingerprint
    assert len(a.fingerprint) == 16
    int(a.fingerprint, 16)


def test_batch_shapes_and_dtype() -> None:
    x, y = StdlibBytes(seq_len=32, seed=0).batch(0, 5)
    assert x.shape == y.shape == (5, 32)
    assert x.dtype == y.dtype == torch.uint8
    assert x.is_contiguous() and y.is_contiguous()


def test_targets_are_inputs_shifted_by_one_byte() -> None:
    data = StdlibBytes(seq_len=32, seed=3)
    x, y = data.batch(4, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
    # and each row really is a window of the corpus
    corpus = _corpus_bytes()
    assert all(window in corpus for window in _windows(x, y))


def test_batch_is_a_pure_function_of_its_arguments() -> None:
    a = StdlibBytes(seq_len=32, seed=1)
    b = StdlibBytes(seq_len=32, seed=1)
    # Out of order, repeated, on another instance: the same step gives the same batch.
    later = b.batch(9, 4)
    for step in range(10):
        a.batch(step, 4)
    assert all(torch.equal(u, v) for u, v in zip(a.batch(9, 4), later, strict=True))
    assert all(torch.equal(u, v) for u, v in zip(b.batch(9, 4), later, strict=True))


def test_steps_and_seeds_differ() -> None:
    data = StdlibBytes(seq_len=32, seed=1)
    assert not torch.equal(data.batch(0, 4)[0], data.batch(1, 4)[0])
    assert not torch.equal(data.batch(0, 4)[0], StdlibBytes(seq_len=32, seed=2).batch(0, 4)[0])


def test_does_not_disturb_the_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    StdlibBytes(seq_len=8, seed=0).batch(0, 2)
    assert torch.equal(torch.rand(3), expected)


def test_shards_draw_disjoint_windows_from_the_whole_corpus() -> None:
    seq_len, num_shards = 64, 3
    shards = [
        StdlibBytes(seq_len=seq_len, seed=0, shard=s, num_shards=num_shards)
        for s in range(num_shards)
    ]
    corpus = _corpus_bytes()
    n = len(corpus)
    for shard in shards:
        seen_parts = set()
        for step in range(20):
            starts = shard.window_starts(step, 16).tolist()
            x, _ = shard.batch(step, 16)
            for start, row in zip(starts, x.tolist(), strict=True):
                # Inside one of its own chunks, and in nobody else's.
                assert shard.owns(start)
                assert not any(o.owns(start) for o in shards if o is not shard)
                assert bytes(row) == corpus[start : start + seq_len]
                seen_parts.add(start * 4 // n)
        assert seen_parts == {0, 1, 2, 3}  # every quarter of the corpus (every file), not a slice
    # One shard is the whole corpus, drawn exactly as before sharding existed.
    whole = StdlibBytes(seq_len=seq_len, seed=0)
    assert all(whole.owns(s) for s in whole.window_starts(3, 64).tolist())


def test_rejects_bad_config() -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        StdlibBytes(seq_len=0, seed=0)
    with pytest.raises(ConfigError, match=r"shard must be in 0\.\.1"):
        StdlibBytes(seq_len=8, seed=0, shard=2, num_shards=2)
    with pytest.raises(ConfigError, match="num_shards"):
        StdlibBytes(seq_len=8, seed=0, num_shards=0)
    with pytest.raises(ConfigError, match="fewer shards"):
        StdlibBytes(seq_len=1 << 20, seed=0, shard=7, num_shards=8)
    data = StdlibBytes(seq_len=8, seed=0)
    with pytest.raises(ValueError, match="step"):
        data.batch(-1, 2)
    with pytest.raises(ValueError, match="batch_size"):
        data.batch(0, 0)
