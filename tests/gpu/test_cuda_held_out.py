"""The bench's held-out loss on a CUDA device (skipped without one): the bench evaluates each
run's final model on the device its runs used, and the figure is the CPU's."""

from __future__ import annotations

import pytest
import torch

from ravnest_node.bench.held_out import held_out_loss
from ravnest_node.pipeline.run import TrainConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_held_out_loss_on_the_device_is_the_cpus() -> None:
    train = TrainConfig(model="tiny", batch_size=8, steps=4)
    on_cpu = held_out_loss(train, None, 32)
    assert held_out_loss(train, None, 32, torch.device("cuda")) == pytest.approx(on_cpu, rel=1e-4)
