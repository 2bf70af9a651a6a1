"""An experiment, not a codec of ravnest-node (measured 2026-12-03, docs/compression.md,
"Reading it honestly", "Transform coding, tried"): `subspace`, transform coding of activations and their gradients in a principal subspace.

A boundary tensor of shape [..., d] is a stack of rows (tokens) in d channels, and those rows
are far from independent across channels: at bench-small's boundaries the top 32 of 256
principal directions hold 93-99% of an activation's energy and 64-100% of its gradient's. A
uniform quantiser that codes each channel alone spends ~3.5 bits per element on what a coder in
the principal basis (the Karhunen-Loeve transform) codes in about one at the same error
(docs/compression.md has the figures).

Encoding x [rows, d] with a basis V [d, r] (orthonormal columns, float16 on the wire) and one
step size s_i per row (bfloat16 on the wire):

    c = round(x V / s)                 r coefficient codes per row
    e = round((x - s c V^T) / s)       d residual codes per row
    x' = s c V^T + s e                 what the receiver decodes

The residual is taken against the quantised coefficients, so the coefficients' rounding is
part of it: every element's error is |x - x'| <= s_i / 2 with round to nearest (< s_i with
stochastic rounding, which is unbiased), plus float32 rounding of the product. The step is
s_i = alpha * rms(x_i) (a row's own scale, as a LayerNorm after it sees it; one step for the
whole tensor lost more). Most residual codes and the small coefficients' codes are 0: the
codes are packed with raw deflate, which is where the bits go away.

The basis is the sender's: the top-r principal directions of the tensors it sends, tracked by
one subspace (power) iteration per refresh from the previous basis (two from a random start at
the first frame), rounded to float16 so that both ends use the same numbers. It travels inside
the frame that first uses it, every `refresh` frames of the stream; the receiver keeps the last
one per stream (`SubspaceBases`) and frames without a basis use it. A new stream starts without.

Payload: raw deflate (zlib, level 1) of

```
bfloat16 steps[rows]                 finite and > 0
float16 basis[d, r]                  only when params basis=1; finite
int codes c [r, rows]                coefficient-major (a coefficient's codes are contiguous)
int codes e [rows, d]
```

codes are int8 (params wide=0) or little-endian int16 (wide=1). params: {"rank": r, "basis":
0 or 1, "wide": 0 or 1, "packed": payload bytes}. A tensor whose last dimension is below 16 or
above 8192 goes with rank 0 (the residual alone: uniform codes of x, deflated). Pure torch and
zlib, no I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod

import torch

from ravnest_node.compression.host import random_generator
from ravnest_node.compression.quant import (
    check_params,
    checked_numel,
    flat_float32,
    int_param,
)
from ravnest_node.errors import ConfigError, FrameError
from ravnest_node.transport.frames import _inflate  # the frames' bounded unpacking

MIN_DIM = 16
MAX_DIM = 8192
MAX_RANK = 256
DEFLATE_LEVEL = 1
_WIDE = 32767
_NARROW = 127


def deflate(raw: bytes, level: int = DEFLATE_LEVEL) -> bytes:
    """The raw deflate stream (no zlib header) of `raw`."""
    packer = zlib.compressobj(level, zlib.DEFLATED, -15)
    return packer.compress(raw) + packer.flush()


def rows_and_dim(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, d): the tensor as rows of its last dimension (a scalar is one row of one)."""
    d = shape[-1] if len(shape) else 1
    return (prod(shape) // d if d else 0), d


def track_basis(x: torch.Tensor, start: torch.Tensor, iterations: int) -> torch.Tensor:
    """Orthonormal [d, r] basis of x's top-r principal directions by subspace iteration from
    `start`, rounded to float16 values (held in float32) so both ends use the same numbers."""
    v = start
    for _ in range(iterations):
        v = torch.linalg.qr(x.T @ (x @ v)).Q
    return v.to(torch.float16).to(torch.float32)


def quantise(
    x: torch.Tensor, basis: torch.Tensor | None, steps: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(steps [rows, 1], coefficient codes [r, rows] or None, residual codes [rows, d]) of
    x [rows, d]; the codes fit int16 (a row's step doubles until they do). Stochastic rounding
    when a generator is given."""

    def rounded(y: torch.Tensor) -> torch.Tensor:
        if generator is None:
            return y.round_()
        return y.add_(torch.rand(y.shape, generator=generator)).floor_()

    while True:
        coeffs = None
        target = x
        if basis is not None:
            coeffs = rounded(x @ basis / steps)
            target = x - (coeffs * steps) @ basis.T
        residual = rounded(target / steps)
        biggest = residual.abs().amax(1, keepdim=True)
        if coeffs is not None:
            biggest = torch.maximum(biggest, coeffs.abs().amax(1, keepdim=True))
        over = biggest > _WIDE
        if not bool(over.any()):
            break
        steps = torch.where(over, steps * 2.0, steps)
    return steps, (coeffs.T.contiguous() if coeffs is not None else None), residual


def dequantise(
    steps: torch.Tensor, basis: torch.Tensor | None, coeffs: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """x' [rows, d] float32 of the codes (steps [rows, 1], coefficient codes [r, rows])."""
    out = residual.to(torch.float32) * steps
    if basis is not None and coeffs is not None:
        out += (coeffs.T.to(torch.float32) * steps) @ basis.T
    return out


@dataclass(slots=True)
class SubspaceState:
    """Sender side of one stream: its basis, frames since it was sent, and the rounding RNG."""

    basis: torch.Tensor | None = None
    since: int = 0
    generator: torch.Generator | None = None


@dataclass(slots=True)
class SubspaceBases:
    """Receiver side: the last basis each stream (tensor name) sent."""

    bases: dict[str, torch.Tensor] = field(default_factory=dict)


Commit = Callable[[], None]


@dataclass(frozen=True, slots=True)
class Subspace:
    """The `subspace` codec; see the module doc."""

    name: str = "subspace"
    rank: int = 32
    """Principal directions kept (at most d // 4 of a tensor's last dimension d)."""
    alpha: float = 0.5
    """Step size in units of the tensor's root mean square (sender side only)."""
    refresh: int = 8
    """Frames of a stream between two basis updates (sender side only)."""
    stochastic: bool = False
    """Stochastic rounding (unbiased; for gradients); sender side only."""
    iterations: int = 1
    """Subspace iterations per refresh from the previous basis (sender side only)."""

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise ConfigError(f"{self.name}: rank must be in 1..{MAX_RANK}, not {self.rank!r}")
        if not 0 < self.alpha <= 4:
            raise ConfigError(f"{self.name}: alpha must be in (0, 4], not {self.alpha!r}")
        if self.refresh < 1:
            raise ConfigError(f"{self.name}: refresh must be at least 1, not {self.refresh!r}")

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def new_state(self) -> SubspaceState:
        return SubspaceState(generator=random_generator() if self.stochastic else None)

    def rank_for(self, shape: Sequence[int]) -> int:
        """The rank this sender uses for a tensor of `shape` (0: residual codes only)."""
        rows, d = rows_and_dim(shape)
        if not MIN_DIM <= d <= MAX_DIM:
            return 0
        return min(self.rank, d // 4, rows)

    def encode(
        self, tensor: torch.Tensor, state: object | None
    ) -> tuple[dict[str, int], bytes]:
        """(params, payload) of a floating tensor; updates the stream's basis in `state`.
        ValueError for non-finite values."""
        if not isinstance(state, SubspaceState):
            raise TypeError(f"{self.name} needs the state of new_state(), got {type(state)}")
        rows, d = rows_and_dim(tuple(tensor.shape))
        x = flat_float32(tensor).view(rows, d)
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{self.name}: the tensor has non-finite values")
        rank = self.rank_for(tuple(tensor.shape))
        basis, fresh = None, False
        if rank:
            basis = state.basis
            if basis is not None and tuple(basis.shape) != (d, rank):
                basis = None
            if basis is None or state.since >= self.refresh:
                if basis is None:
                    gen = state.generator or torch.Generator().manual_seed(0)
                    start, iterations = torch.randn(d, rank, generator=gen), 2
                else:
                    start, iterations = basis, self.iterations
                basis, fresh, state.since = track_basis(x, start, iterations), True, 0
            state.basis = basis
            state.since += 1
        rms = x.pow(2).mean(1, keepdim=True).sqrt_()
        steps = torch.where(rms > 0, rms * self.alpha, 1.0).to(torch.bfloat16).to(torch.float32)
        steps = torch.where(steps > 0, steps, 1.0)
        steps, coeffs, residual = quantise(x, basis, steps, state.generator)
        wide = bool(
            residual.abs().max() > _NARROW if residual.numel() else False
        ) or bool(coeffs is not None and coeffs.numel() and coeffs.abs().max() > _NARROW)
        code_dtype = torch.int16 if wide else torch.int8
        parts = [steps.view(-1).to(torch.bfloat16).view(torch.uint8)]
        if fresh and basis is not None:
            parts.append(basis.to(torch.float16).contiguous().view(-1).view(torch.uint8))
        if coeffs is not None:
            parts.append(coeffs.to(code_dtype).view(-1).view(torch.uint8))
        parts.append(residual.to(code_dtype).view(-1).view(torch.uint8))
        payload = deflate(torch.cat(parts).numpy().tobytes())
        params = {"rank": rank, "basis": int(fresh), "wide": int(wide), "packed": len(payload)}
        return params, payload

    def _raw_nbytes(self, shape: Sequence[int], params: Mapping[str, int]) -> int:
        rows, d = rows_and_dim(shape)
        rank = params["rank"]
        code = 2 if params["wide"] else 1
        return rows * 2 + params["basis"] * d * rank * 2 + (rows * rank + rows * d) * code

    def payload_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, params: Mapping[str, int]
    ) -> int:
        """The payload's size (params' `packed`), after checking every param against the shape;
        FrameError for bad params, shape or dtype."""
        check_params(self.name, params, ("rank", "basis", "wide", "packed"))
        numel = checked_numel(self.name, shape, dtype)
        rows, d = rows_and_dim(shape)
        top = min(MAX_RANK, d, rows) if MIN_DIM <= d <= MAX_DIM else 0
        rank = int_param(self.name, params, "rank", 0, top)
        int_param(self.name, params, "basis", 0, 1 if rank else 0)
        int_param(self.name, params, "wide", 0, 1)
        if numel == 0:
            raise FrameError(f"codec {self.name}: an empty tensor has no payload")
        # A deflate stream is never much bigger than what it packs (stored blocks: 5 bytes in
        # 65535), so a larger claim is refused before anything is read.
        raw = self._raw_nbytes(shape, params)
        return int_param(self.name, params, "packed", 1, raw + raw // 8192 + 64)

    def decode(
        self, payload: memoryview, shape: Sequence[int], dtype: torch.dtype, params: Mapping[str, int]
    ) -> torch.Tensor:
        """A frame of this codec needs the stream's basis: use `decode_with`."""
        raise FrameError(f"codec {self.name} needs the stream's basis (decode_with)")

    def decode_with(
        self,
        bases: SubspaceBases,
        stream: str,
        payload: memoryview,
        shape: Sequence[int],
        dtype: torch.dtype,
        params: Mapping[str, int],
    ) -> tuple[torch.Tensor, Commit]:
        """(the tensor, a commit that keeps its basis for the stream's later frames). Nothing
        changes until the commit runs; FrameError for a payload that does not unpack to what
        the params say, a step or basis that is not finite, a frame without a basis on a stream
        that has none of that shape, or a value that overflows `dtype`."""
        nbytes = self.payload_nbytes(shape, dtype, params)
        if len(payload) != nbytes:
            raise FrameError(
                f"codec {self.name}: payload is {len(payload)} bytes, the header says {nbytes}"
            )
        raw = bytearray(_inflate(payload, self._raw_nbytes(shape, params), self.name))
        rows, d = rows_and_dim(shape)
        rank = params["rank"]
        code_dtype = torch.int16 if params["wide"] else torch.int8
        steps = torch.frombuffer(raw, dtype=torch.bfloat16, count=rows).to(torch.float32)
        if not bool(torch.isfinite(steps).all()) or not bool((steps > 0).all()):
            raise FrameError(f"codec {self.name}: a row's step is not a positive number")
        steps = steps.view(rows, 1)
        offset = rows * 2
        basis = None
        if rank and params["basis"]:
            half = torch.frombuffer(raw, dtype=torch.float16, count=d * rank, offset=offset)
            basis = half.to(torch.float32).view(d, rank)
            if not bool(torch.isfinite(basis).all()):
                raise FrameError(f"codec {self.name}: the basis holds values that are not finite")
            offset += d * rank * 2
        elif rank:
            basis = bases.bases.get(stream)
            if basis is None or tuple(basis.shape) != (d, rank):
                raise FrameError(
                    f"codec {self.name}: tensor {stream!r} refers to a basis this stream has not "
                    "sent"
                )
        size = code_dtype.itemsize
        coeffs = None
        if rank:
            coeffs = torch.frombuffer(raw, dtype=code_dtype, count=rows * rank, offset=offset)
            coeffs = coeffs.view(rank, rows)
            offset += rows * rank * size
        residual = torch.frombuffer(raw, dtype=code_dtype, count=rows * d, offset=offset)
        out = dequantise(steps, basis, coeffs, residual.view(rows, d))
        if not bool(torch.isfinite(out).all()):
            raise FrameError(f"codec {self.name}: a decoded value is not finite")
        cast = out.view(tuple(shape)).to(dtype)
        if dtype != torch.float32 and not bool(torch.isfinite(cast).all()):
            raise FrameError(f"codec {self.name}: a decoded value overflows {dtype}")
        fresh = basis if params["basis"] else None

        def commit() -> None:
            if fresh is not None:
                bases.bases[stream] = fresh

        return cast, commit
