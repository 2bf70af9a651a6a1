"""The held-out loss of the multi-epoch codec table (bench/codecs.py): samples outside the fixed
dataset, and the final model of a run loaded from its nodes' checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ravnest_node.bench.codecs import epochs_table
from ravnest_node.bench.held_out import held_out_loss, held_out_samples
from ravnest_node.errors import RunFailed
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig


def test_held_out_samples_share_no_token_with_the_dataset() -> None:
    train = TrainConfig(model="tiny", batch_size=8, dataset_samples=64)
    x, y, starts = held_out_samples(train, 40)
    assert x.shape[0] == y.shape[0] == starts.shape[0] == 40
    # The windows of the dataset a run of `train` trains on.
    taken = get_model("tiny").dataset(seed=train.seed, num_samples=64).window_starts(0, 64)
    assert ((starts[:, None] - taken[None, :]).abs() > x.shape[1]).all()
    again = held_out_samples(train, 40)
    assert torch.equal(again[0], x) and torch.equal(again[1], y)  # a pure function


@pytest.mark.parametrize("pipelines", [1, 2])
def test_held_out_samples_of_a_run_on_random_windows_share_no_token_with_them(
    pipelines: int,
) -> None:
    train = TrainConfig(model="tiny", batch_size=8, steps=30, pipelines=pipelines)
    x, y, starts = held_out_samples(train, 40)
    assert x.shape[0] == y.shape[0] == starts.shape[0] == 40
    model = get_model("tiny")
    # Every window any pipeline of the run trains on, and the run's own batches are not it.
    taken = torch.cat([
        model.dataset(seed=train.seed, shard=p, num_shards=pipelines).window_starts(s, 8)
        for p in range(pipelines) for s in range(30)
    ])  # fmt: skip
    assert ((starts[:, None] - taken[None, :]).abs() > x.shape[1]).all()
    first, _ = model.dataset(seed=train.seed).batch(0, 8)
    assert not torch.equal(x[:8], first)
    again = held_out_samples(train, 40)
    assert torch.equal(again[0], x) and torch.equal(again[2], starts)  # a pure function
    other = held_out_samples(dataclasses.replace(train, seed=1), 40)
    assert not torch.equal(other[2], starts)


def test_held_out_loss_needs_the_final_checkpoints(tmp_path: Path) -> None:
    train = TrainConfig(model="tiny", batch_size=8, dataset_samples=64)
    assert 0 < held_out_loss(train, None, 16) < 10  # the model as built
    (tmp_path / "node-0").mkdir()
    with pytest.raises(RunFailed, match="no step has a checkpoint of all"):
        held_out_loss(train, tmp_path, 16)


@pytest.mark.slow
def test_epochs_table_reports_the_held_out_loss(tmp_path: Path) -> None:
    train = TrainConfig(model="tiny", batch_size=8, lr=1e-3)
    rows = epochs_table(train, tmp_path, 16, 3, ["none", "aq-delta"], held_out=32)
    assert [r["codec"] for r in rows] == ["none/none", "aq-delta/none"]
    before = held_out_loss(dataclasses.replace(train, dataset_samples=16), None, 32)
    for r in rows:
        assert 0 < r["held_out_loss"] < 10 and r["held_out_loss"] != before
    assert rows[0]["held_out_gap"] == 0
    assert rows[1]["held_out_gap"] == rows[1]["held_out_loss"] / rows[0]["held_out_loss"] - 1
