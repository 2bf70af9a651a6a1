"""PowerSGD: rank-r compression of a flat parameter delta (Vogels et al., arXiv 1905.13727).

The paper compresses gradients of data-parallel training to rank 2 with error feedback and
reaches the accuracy of full-precision SGD with about 136x fewer gradient bytes. Here it
compresses the parameter delta of a replica-averaging round: one flat float32 vector holding all
of a stage's parameters, concatenated. The codec knows the **layout** of that vector, the tuple
of parameter shapes in order. Both ends build it from the same model blocks, so it never
travels.

Each entry of the layout is either a matrix or dense:

- a **matrix** is an entry with ndim >= 2, seen as M of m = shape[0] rows and n = prod(shape[1:])
  columns, for which the rank-r factors are smaller than the bf16 values:
  4 r (m + n) < 2 m n. It travels as P (m x r) and Q (n x r), and decodes to P Q^T;
- every other entry (biases, norms, small matrices) travels as **bf16**.

Encoding a matrix (sender, per entry, with error feedback and warm start):

```
M = Δ + e                 e: the residual of the previous round (zero at first)
P = orthonormalise(M Q)   Q: the previous round's Q (warm start; first round: random normal)
Q = M^T P                 kept for the next round
M_hat = P Q^T = P P^T M   what every receiver decodes
e <- M - M_hat            (for dense entries e <- x - bf16(x))
```

One power iteration per round: with the warm start this is subspace iteration spread over the
rounds, so on a delta that changes slowly P follows its top-r singular subspace.

**Bound.** P has orthonormal columns (Householder QR), so M_hat is the orthogonal projection of
M onto span(P): ||M - M_hat||_F <= ||M||_F always, and ||M - M_hat||_F^2 = ||M||_F^2 -
||M_hat||_F^2 (up to float32 rounding). The best rank-r approximation bounds the error from
below (Eckart-Young): ||M - M_hat||_F >= (sum_{i>r} s_i^2)^(1/2), s_i the singular values of M.
A matrix of rank <= r is sent exactly, to float32 rounding (span(M Q) is its column space for a
random Q). On a fixed matrix, k warm-started rounds without error feedback are k steps of
subspace iteration: the error approaches the optimal rank-r error, the gap shrinking like
(s_{r+1} / s_r)^k. One round can thus lose most of a delta that is not close to rank r. With
error feedback the sum of the decoded deltas is exactly the sum of the true ones minus the
current residual; the residual is not bounded by a formula, but it levels off (the part of it
that grows becomes the top of M, which the next P captures: a few times one delta's norm in the
tests), so the running mean of the decoded deltas converges to the true one like 1 / rounds.

Payload (little-endian), two sections so that both are aligned:

```
float32 factor[F]     for each matrix entry in layout order: P (m x r, row-major), then Q
                      (n x r, row-major); F = sum of r (m + n) over the matrix entries
bfloat16 dense[D]     for each dense entry in layout order, its values; D = their numel
```

Factors are float32 so that a rank-<=r matrix round-trips to float32 rounding and the projection
bound above holds; bf16 factors would halve the matrix bytes at the cost of a 2^-8 relative
error per round (which error feedback would carry). Frame params: {"rank": 1..64}. The decoder
derives the exact size from layout and rank, refuses any other size, a shape whose numel is not
the layout's, and non-finite factors, values or products. The product P Q^T is computed
elementwise in a fixed order (one outer product per rank, added in turn), not by BLAS, so every
member decodes the same bits on any machine.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod

import torch

from ravnest_node.compression.host import to_host
from ravnest_node.compression.quant import (
    cast_finite,
    check_params,
    check_payload_size,
    checked_numel,
    flat_float32,
    int_param,
    owned_bytes,
)
from ravnest_node.errors import ConfigError, FrameError

MIN_RANK = 1
MAX_RANK = 64
_FACTOR_BYTES = 4
_DENSE_BYTES = 2
_SEED = 0x5067  # the first Q of each matrix; members need not share it (nothing is summed)

Layout = tuple[tuple[int, ...], ...]
"""Shapes of the parameters a flat vector concatenates, in order."""


def as_layout(shapes: Sequence[Sequence[int]]) -> Layout:
    """`shapes` as a Layout; ConfigError for a dimension that is not an int >= 0 or a layout
    without a single element."""
    layout = tuple(tuple(s) for s in shapes)
    for shape in layout:
        if any(type(d) is not int or d < 0 for d in shape):
            raise ConfigError(f"layout: bad shape {list(shape)}; dimensions are ints >= 0")
    if sum(prod(s) for s in layout) < 1:
        raise ConfigError("layout: the parameters hold no element")
    return layout


@dataclass(frozen=True, slots=True)
class _Entry:
    start: int
    """Offset of the entry in the flat vector."""
    numel: int
    rows: int
    """m for a matrix sent as factors; 0 for a dense entry."""
    cols: int
    """n for a matrix sent as factors; 0 for a dense entry."""
    offset: int
    """Offset of P in the factor section (matrix) or of the values in the dense section."""


@dataclass(frozen=True, slots=True)
class _Plan:
    entries: tuple[_Entry, ...]
    total: int
    """numel of the flat vector."""
    factors: int
    """F: float32 factor elements."""
    dense: int
    """D: bf16 elements."""

    @property
    def nbytes(self) -> int:
        return _FACTOR_BYTES * self.factors + _DENSE_BYTES * self.dense


def compresses(rows: int, cols: int, rank: int) -> bool:
    """Whether an m x n matrix travels as rank-r float32 factors: only when they are smaller than
    its bf16 values."""
    return _FACTOR_BYTES * rank * (rows + cols) < _DENSE_BYTES * rows * cols


@functools.lru_cache(maxsize=16)
def _plan(layout: Layout, rank: int) -> _Plan:
    """Where each entry of `layout` goes on the wire at rank `rank` (cached: one per stream)."""
    entries = []
    start = factors = dense = 0
    for shape in layout:
        numel = prod(shape)
        rows, cols = (shape[0], numel // shape[0]) if len(shape) >= 2 and shape[0] else (0, 0)
        if rows and compresses(rows, cols, rank):
            entries.append(_Entry(start, numel, rows, cols, factors))
            factors += rank * (rows + cols)
        else:
            entries.append(_Entry(start, numel, 0, 0, dense))
            dense += numel
        start += numel
    return _Plan(tuple(entries), start, factors, dense)


@dataclass(slots=True)
class PowerSGDState:
    """Sender-side state of one delta stream (same layout every round; not thread-safe). The
    residual and the warm starts live on the device of the stream's tensors."""

    residual: torch.Tensor | None = None
    """e, flat float32, created at the first encode (error feedback only)."""
    warm: dict[int, torch.Tensor] = field(default_factory=dict)
    """Q (n x r) of each matrix entry, by layout index: the warm start of the next round."""
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(_SEED))
    """Draws the first Q of each matrix (private: the training RNG is not disturbed). It draws
    on the CPU whatever the tensor's device (Q is small), so every device starts alike."""


@dataclass(frozen=True, slots=True)
class PowerSGD:
    """Rank-r PowerSGD of a flat vector of known layout (`powersgd`); see the module doc."""

    layout: Layout
    """Shapes of the parameters the flat vector concatenates, in order (never sent)."""
    rank: int = 4
    """r, 1..64: columns of P and Q."""
    name: str = "powersgd"
    """Registry name carried in frames."""
    error_feedback: bool = True
    """Keep the residual e <- p - D(C(p)) and add it to the next delta; sender-side only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", as_layout(self.layout))
        if type(self.rank) is not int or not MIN_RANK <= self.rank <= MAX_RANK:
            raise ConfigError(
                f"{self.name}: rank must be an int in {MIN_RANK}..{MAX_RANK}, not {self.rank!r}"
            )

    @property
    def params(self) -> dict[str, int]:
        """The frame params of this codec's payloads."""
        return {"rank": self.rank}

    @property
    def numel(self) -> int:
        """Elements of the flat vector the layout describes."""
        return _plan(self.layout, self.rank).total

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def new_state(self) -> PowerSGDState:
        """A fresh state: no residual, no warm start yet."""
        return PowerSGDState()

    def encode(self, tensor: torch.Tensor, state: object | None) -> tuple[dict[str, int], bytes]:
        """(params, payload) of the flat vector on any device (the projections run there; the
        factors and dense values cross to the host); updates the residual and warm start in
        `state`.
        TypeError for a missing or foreign state, ValueError for a tensor of another size than
        the layout's or with non-finite values (also after adding the residual)."""
        if not isinstance(state, PowerSGDState):
            raise TypeError(f"{self.name} needs the state of new_state(), got {type(state)}")
        plan = _plan(self.layout, self.rank)
        x = flat_float32(tensor)
        if x.numel() != plan.total:
            raise ValueError(f"{self.name}: {x.numel()} elements, the layout has {plan.total}")
        if state.residual is not None:
            x = x + state.residual
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{self.name}: the tensor has non-finite values")
        r = self.rank
        factors = torch.empty(plan.factors, dtype=torch.float32, device=x.device)
        dense = torch.empty(plan.dense, dtype=torch.bfloat16, device=x.device)
        for i, e in enumerate(plan.entries):
            segment = x[e.start : e.start + e.numel]
            if not e.rows:
                dense[e.offset : e.offset + e.numel] = segment
                continue
            m = segment.view(e.rows, e.cols)
            q = state.warm.get(i)
            if q is None or not bool(q.any()):  # first round, or M was 0: nothing to follow
                q = torch.randn(e.cols, r, generator=state.generator).to(x.device)
            p = torch.linalg.qr(m @ q).Q  # reduced: m x r, orthonormal columns
            q = m.T @ p
            state.warm[i] = q
            split = e.offset + e.rows * r
            factors[e.offset : split] = p.reshape(-1)
            factors[split : split + e.cols * r] = q.reshape(-1)
        decoded = _reconstruct(plan, r, factors, dense)
        if not bool(torch.isfinite(decoded).all()):
            raise ValueError(f"{self.name}: the factors overflow float32")
        if self.error_feedback:
            state.residual = x - decoded
        factors, dense_bits = to_host(factors, dense.view(torch.int16))
        payload = factors.numpy().astype("<f4", copy=False).tobytes()
        payload += dense_bits.numpy().astype("<i2", copy=False).tobytes()
        return self.params, payload

    def payload_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, params: Mapping[str, int]
    ) -> int:
        """Exact payload size, 4 F + 2 D; FrameError for params other than {"rank": 1..64}, a
        non-floating dtype, or a shape whose numel is not the layout's."""
        check_params(self.name, params, ("rank",))
        rank = int_param(self.name, params, "rank", MIN_RANK, MAX_RANK)
        numel = checked_numel(self.name, shape, dtype)
        plan = _plan(self.layout, rank)
        if numel != plan.total:
            raise FrameError(
                f"codec {self.name}: shape {list(shape)} has {numel} elements, "
                f"the layout {plan.total}"
            )
        return plan.nbytes

    def decode(
        self,
        payload: memoryview,
        shape: Sequence[int],
        dtype: torch.dtype,
        params: Mapping[str, int],
    ) -> torch.Tensor:
        """The flat vector as `shape` and `dtype`; FrameError if the payload has the wrong
        size, a factor or value that is not finite, or a product that overflows `dtype`."""
        check_payload_size(self.name, payload, self.payload_nbytes(shape, dtype, params))
        rank = params["rank"]
        plan = _plan(self.layout, rank)
        buf = owned_bytes(payload)
        factors = torch.empty(0, dtype=torch.float32)
        dense = torch.empty(0, dtype=torch.bfloat16)
        if plan.factors:
            factors = torch.frombuffer(buf, dtype=torch.float32, count=plan.factors)
        if plan.dense:
            offset = _FACTOR_BYTES * plan.factors
            raw = torch.frombuffer(buf, dtype=torch.int16, offset=offset, count=plan.dense)
            dense = raw.view(torch.bfloat16)
        if not (bool(torch.isfinite(factors).all()) and bool(torch.isfinite(dense).all())):
            raise FrameError(f"codec {self.name}: a factor or value is not finite")
        out = _reconstruct(plan, rank, factors, dense)
        if not bool(torch.isfinite(out).all()):
            raise FrameError(f"codec {self.name}: a product of the factors overflows float32")
        return cast_finite(self.name, out.reshape(tuple(shape)), dtype)


def _reconstruct(
    plan: _Plan, rank: int, factors: torch.Tensor, dense: torch.Tensor
) -> torch.Tensor:
    """The flat float32 vector of the factors and dense values. P Q^T is summed one outer
    product at a time (elementwise multiplies and adds, each exactly rounded), so the result
    does not depend on the BLAS, the thread count or the device (a CUDA sender's separate
    multiply and add kernels round as the CPU's do): sender and receivers get the same bits."""
    out = torch.empty(plan.total, dtype=torch.float32, device=factors.device)
    for e in plan.entries:
        target = out[e.start : e.start + e.numel]
        if not e.rows:
            target.copy_(dense[e.offset : e.offset + e.numel])
            continue
        split = e.offset + e.rows * rank
        p = factors[e.offset : split].view(e.rows, rank)
        q = factors[split : split + e.cols * rank].view(e.cols, rank)
        m = target.view(e.rows, e.cols)
        torch.mul(p[:, :1], q[:, 0], out=m)
        term = torch.empty_like(m)
        for k in range(1, rank):
            torch.mul(p[:, k : k + 1], q[:, k], out=term)
            m.add_(term)
    return out
