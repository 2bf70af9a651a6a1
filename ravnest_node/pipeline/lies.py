"""Test only: what a dishonest stage sends (`--fault-lie-stage S --fault-lie-after N`), for the
tests and benchmarks of audited computation (docs/security.md). From step N on, the node that
owns stage S of pipeline 0 computes honestly and sends a plausibly wrong copy of what it
computed: finite, of the ordinary size and spread, pointing elsewhere. Pure torch.

- ``rotate`` (the default): each row's features shifted cyclically by half their width (every
  value is one the stage computed; the norm is exactly the honest one; the direction is not);
- ``negate``: the honest tensor times -1 (a gradient then points uphill);
- ``scale``: the honest tensor times 2 (the right direction, the wrong size).
"""

from __future__ import annotations

import torch

__all__ = ["LIES", "lie"]

LIES = ("rotate", "negate", "scale")


def lie(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """The wrong copy of `tensor` a dishonest stage sends (a new tensor; `tensor` unchanged)."""
    if kind == "rotate":
        return torch.roll(tensor, shifts=max(1, tensor.shape[-1] // 2), dims=-1)
    if kind == "negate":
        return -tensor
    if kind == "scale":
        return tensor * 2
    raise ValueError(f"unknown lie {kind!r}; choose one of {', '.join(LIES)}")
