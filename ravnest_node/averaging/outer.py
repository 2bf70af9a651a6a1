"""The DiLoCo outer optimizer of one replica (Douillard et al., arXiv 2311.08105). Pure torch.

Every member of a replica group starts each outer round from the same θ_prev, trains H local
steps to θ_i, and sends Δ_i = θ_prev - θ_i. With the mean Δ of the group the outer step is
Nesterov momentum on Δ:

    v <- μ v + Δ
    θ_global = θ_prev - η_out (Δ + μ v)
    θ_prev <- θ_global

The state (θ_prev, v and the snapshot θ_i of the round in flight) is kept as flat float32 CPU
tensors: 3 P floats for a stage of P parameters, whatever device the parameters live on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ravnest_node.averaging.config import AveragingConfig


def param_count(params: Sequence[torch.Tensor]) -> int:
    """Number of elements of all `params` together."""
    return sum(p.numel() for p in params)


def flatten_into(params: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy `params`, in order, into the flat tensor `out` (converting dtype and device) and
    return it. ValueError if the sizes differ."""
    if out.numel() != param_count(params):
        raise ValueError(f"{param_count(params)} parameter elements, the buffer has {out.numel()}")
    offset = 0
    for p in params:
        n = p.numel()
        out[offset : offset + n].view_as(p).copy_(p.detach())
        offset += n
    return out


class OuterOptimizer:
    """Nesterov outer step over averaged deltas, with delayed application.

    A round is in flight from `begin_round` to `apply`; there is at most one. Training goes on
    meanwhile: `apply` writes θ_global plus the local progress made since the snapshot into the
    parameters. Both read or write the parameters in place, so call them where the optimizer
    steps (the compute thread), between two optimizer steps. Every member must start from the
    same parameters (the seed builds the model identically) and apply the same mean, or the
    replicas drift apart by the difference."""

    def __init__(self, params: Sequence[torch.Tensor], config: AveragingConfig) -> None:
        """Start with θ_prev = the current `params` and zero momentum."""
        self.config = config
        self.numel = param_count(params)
        self._prev = flatten_into(params, torch.empty(self.numel, dtype=torch.float32))
        self._momentum = torch.zeros(self.numel, dtype=torch.float32)
        self._snapshot = torch.empty(self.numel, dtype=torch.float32)
        self._in_flight = False

    @property
    def in_flight(self) -> bool:
        """Whether a round has begun and not been applied yet."""
        return self._in_flight

    @property
    def prev(self) -> torch.Tensor:
        """θ_prev, the flat float32 start of the current outer round (read-only by contract)."""
        return self._prev

    @property
    def momentum_buffer(self) -> torch.Tensor:
        """v, the flat float32 Nesterov momentum (read-only by contract)."""
        return self._momentum

    def begin_round(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Δ_i = θ_prev - θ_i, a new flat float32 CPU tensor, and remember θ_i (the current
        `params`). RuntimeError if a round is already in flight; ValueError if the parameters
        do not have the size this optimizer was built for."""
        if self._in_flight:
            raise RuntimeError("an outer round is already in flight; apply it first")
        flatten_into(params, self._snapshot)
        self._in_flight = True
        return torch.sub(self._prev, self._snapshot)

    def apply(self, params: Sequence[torch.Tensor], mean_delta: torch.Tensor) -> None:
        """Finish the round in flight with the group's mean delta Δ (flat, P elements).

        v <- μ v + Δ; θ_global = θ_prev - η_out (Δ + μ v); θ_prev <- θ_global. The parameters
        become θ_global + (θ_current - θ_i): the steps taken since `begin_round` (delayed
        application) are kept on top of the global point. With a group of one, Δ is this
        member's own delta. RuntimeError if no round is in flight; ValueError for a Δ of the
        wrong size or with non-finite values (nothing changes then)."""
        if not self._in_flight:
            raise RuntimeError("no outer round in flight; call begin_round first")
        if mean_delta.numel() != self.numel:
            raise ValueError(f"mean delta has {mean_delta.numel()} elements, expected {self.numel}")
        if param_count(params) != self.numel:
            raise ValueError(f"{param_count(params)} parameter elements, expected {self.numel}")
        delta = mean_delta.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        if not bool(torch.isfinite(delta).all()):
            raise ValueError("mean delta has values that are not finite")
        mu, lr = self.config.momentum, self.config.outer_lr
        self._momentum.mul_(mu).add_(delta)
        self._prev.sub_(delta, alpha=lr).sub_(self._momentum, alpha=lr * mu)
        # θ <- θ_current + (θ_global - θ_i): the correction reuses the snapshot's buffer.
        correction = torch.sub(self._prev, self._snapshot, out=self._snapshot)
        with torch.no_grad():
            offset = 0
            for p in params:
                n = p.numel()
                p.add_(correction[offset : offset + n].view_as(p).to(p.device))
                offset += n
        self._in_flight = False
