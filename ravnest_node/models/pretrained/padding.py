"""How padding travels between the blocks of a pretrained model, with no mask tensor.

Positions holding the pad token leave the embeddings as all-zero rows, and every layer treats an
all-zero input row as padding (a key nobody attends to, an output row kept at zero). So the
mask needs no second tensor between stages, and every codec keeps zeros exact.
"""

from __future__ import annotations

import torch

__all__ = ["pad_rows"]


def pad_rows(x: torch.Tensor) -> torch.Tensor | None:
    """[B, T] True where a row of the hidden state is all zero (padding), or None if none is."""
    pad = (x == 0).all(dim=-1)
    return pad if bool(pad.any()) else None
