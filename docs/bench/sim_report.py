"""What the one-process simulations (staleness_sim.py, boundary_codec_sim.py) print at the end."""

from collections.abc import Sequence

import torch

from ravnest_node.data.stdlib_bytes import StdlibBytes
from ravnest_node.models import BlockModel

UNSEEN = 10_000
"""Batches from this index on are never drawn by the simulations' training."""


def report(stages: Sequence[torch.nn.Module], model: BlockModel, data: StdlibBytes,
           losses: Sequence[float]) -> None:  # fmt: skip
    """Print the final weights' mean loss on 8 unseen batches of 16 and the mean training loss
    of the last 5 steps."""
    with torch.no_grad():
        evals = []
        for k in range(8):
            x, y = data.batch(UNSEEN + k, 16)
            for stage in stages:
                x = stage(x)
            evals.append(model.loss(x, y).item())
    print(f"eval {sum(evals) / len(evals):.4f}  mean train loss of the last 5 steps "
          f"{sum(losses[-5:]) / 5:.4f}")  # fmt: skip
