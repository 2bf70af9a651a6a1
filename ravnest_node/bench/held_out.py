"""The loss of a run's final model on data it did not train on: how the bench compares the
quality of runs.

A run's training loss at a step is one batch's (16 samples of bench-small: 2,048 tokens): a
thin measure of a model for differences of 1-2%, which is what the bench is asked to judge. So
each run's final model is also evaluated on `samples` windows of the same corpus that share
no token with any window the run trained on, the same windows for every system of a scenario
(`held_out_samples`), loaded from the checkpoints its nodes wrote at the run's last step
(`held_out_loss`). This is done after the run, in the bench's own process: it costs the run no
time and no bytes.

Held-out windows: of a run on a fixed dataset (`dataset_samples`), fresh windows of the run's
seed that overlap none of the dataset's; of a run on random windows, windows of another seed
(`held_out_seed`) that overlap none of the windows of the run's steps, of any pipeline.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ravnest_node.checkpoint.export import blocks_at
from ravnest_node.errors import ConfigError, RunFailed
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig

__all__ = ["held_out_loss", "held_out_samples", "held_out_seed"]


def held_out_seed(seed: int) -> int:
    """The seed whose windows a run of `seed` on random windows is evaluated on."""
    return (seed + 0x5EED) % 2**62


def held_out_loss(
    train: TrainConfig, run_dir: Path | None, samples: int, device: torch.device | None = None
) -> float:
    """Mean loss, over `held_out_samples`, of the model a run left in `run_dir` (every block
    from its node's newest checkpoint, which must be of the run's last step) or, with None, of
    the model as built (before training: a pretrained model's own weights); in float32 on
    `device` (the CPU if None)."""
    model = get_model(train.model)
    blocks = model.build_blocks(train.seed)
    if run_dir is not None:
        try:
            step, loaded = blocks_at(sorted(run_dir.glob("node-*")), model)
        except ConfigError as exc:
            raise RunFailed(f"{run_dir}: {exc}") from None
        if step != train.steps:
            raise RunFailed(f"{run_dir}: the newest step with every block is {step}, not the "
                            f"run's last, {train.steps}")  # fmt: skip
        with torch.no_grad():
            for i, block in enumerate(blocks):
                for name, p in block.named_parameters():
                    p.copy_(loaded[i].tensors[("param", name)])
    x, y, _ = held_out_samples(train, samples)
    where = device or torch.device("cpu")
    sequential = torch.nn.Sequential(*blocks).to(where).eval()
    losses = []
    with torch.no_grad():
        for i in range(0, samples, train.batch_size):
            end = i + train.batch_size
            out = sequential(x[i:end].to(where))
            losses.append(float(model.loss(out, y[i:end].to(where))))
    return sum(losses) / len(losses)


def held_out_samples(
    train: TrainConfig, samples: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`samples` inputs and targets of `train.model`'s data that a run of `train` does not
    train on, and their window starts, batch by batch (module docstring): every window that
    starts within a sample's length of a training window is left out, so that none shares a
    token with the training data. A pure function of `train` and `samples`."""
    model = get_model(train.model)
    run_on_windows = not train.dataset_samples
    fresh = model.dataset(seed=held_out_seed(train.seed) if run_on_windows else train.seed)
    if not hasattr(fresh, "window_starts"):
        raise ConfigError(f"{train.model}: held-out samples need data of windows of a corpus")
    if run_on_windows:  # every window any pipeline's shard trains on
        shards = [model.dataset(seed=train.seed, shard=p, num_shards=train.pipelines)
                  for p in range(train.pipelines)]  # fmt: skip
        taken = torch.cat([shard.window_starts(step, train.batch_size)
                           for shard in shards for step in range(train.steps)])  # fmt: skip
    else:
        fixed = model.dataset(seed=train.seed, num_samples=train.dataset_samples)
        taken = fixed.window_starts(0, train.dataset_samples)
    xs, ys, starts = [], [], []
    step, have = 0, 0
    while have < samples:
        x, y = fresh.batch(step, train.batch_size)
        at = fresh.window_starts(step, train.batch_size)
        # A window is seq_len + 1 tokens at most (a masked-LM one seq_len - 2).
        keep = ((at[:, None] - taken[None, :]).abs() > x.shape[1]).all(dim=1)
        xs.append(x[keep])
        ys.append(y[keep])
        starts.append(at[keep])
        have += int(keep.sum())
        step += 1
    return torch.cat(xs)[:samples], torch.cat(ys)[:samples], torch.cat(starts)[:samples]
