"""`klt`: transform coding of activations and their gradients in a principal basis that the
sender learns and sends now and then (the Karhunen-Loeve transform), entropy-coded with rANS.

A boundary tensor [..., d] is a stack of rows (tokens) in d channels, and its channels are far
from independent: at bench-small's boundaries, 8 of the 256 principal directions of the rows
hold 93-97% of an activation's energy and 56-73% of its gradient's. A code per element
(int4-block) spends ~3.5 bits on every element; in the principal basis most coefficients are
near zero, and at int4's squared error the rate-distortion bound of the measured spectrum is
0.5-1.1 bits per element (docs/compression.md). This codec:

    y = x (V^T)^-1             V [d, d]: the eigenvectors of the rows' covariance, rounded to
                               int8 codes with a scale per column (so y V^T = x exactly, and
                               the rounding of V costs only decorrelation, never accuracy)
    q = round(y / s)           one step s per row (activations: a LayerNorm after the boundary
                               sees each row at its own scale) or one for the tensor (gradients,
                               where only the sum of errors over rows reaches the weights);
                               stochastic rounding for gradients (unbiased)
    x' = (q s) V^T             what the receiver decodes

with s = alpha x rms (of the row, or of the tensor) rounded to bfloat16. Error: |y - q s| <=
s / 2 per coefficient to nearest (< s stochastic, E[x'] = x), so ||x - x'|| <= ||V|| sqrt(d)
s / 2 per row (twice that stochastic), ||V|| ~ 1. A row's step doubles until its coefficients
lie within the codes, before rounding. Coefficient column j of all rows goes as one rANS lane
(compression/rans.py) with its own model: low-energy columns are nearly all zeros and cost a
small fraction of a bit.

The basis is the sender's: it keeps an exponential average (weight 1 - EMA for the newest
frame) of the rows' covariance and, after frames 4, 8, 16, ... REFRESH_MAX and then every
REFRESH_MAX, takes its eigenvectors (largest first) and sends them in the next frame (basis=1).
Both are the sender's choice alone (a receiver decodes any schedule): a fresher basis
decorrelates a training model's drifting boundary better than a rarer one saves on sending it
(docs/compression.md, "How often the basis is sent");
later frames name it (basis=2, by `id`), and the receiver keeps the last one per stream
(`KLTBases`). Until the first basis, frames go in the identity basis (basis=0). A receiver that
does not hold the basis a frame names refuses the frame (FrameError) rather than decode it
wrongly. A new stream starts afresh on both ends. A tensor whose last dimension is outside
MIN_DIM..MAX_DIM is coded as rows of FALLBACK_WIDTH of its flattened elements (the last row
zero-padded), always in the identity basis (`layout`).

Payload (little-endian):

```
bfloat16 steps[rows or 1]     finite and > 0 (params rows=1: one per row)
float32  scales[d]            only when basis=1, finite and > 0: column j of V is
int8     codes[d, d]          codes[:, j] x scales[j], codes in -127..127
uint8    models[d]            the rANS model of each coefficient column
rANS payload                  codes [d lanes, rows codes each] in -a..a (compression/rans.py)
```

params: {"basis": 0, 1 or 2, "id": the basis's number, "rows": 0 or 1, "a": largest |code|,
"packed": payload bytes, "coder": 1}, or with "coder": 2 (CODER_COLUMNS) also "cols": only
the first `cols` coefficient columns are coded (models[cols] and cols lanes), the others are 0.
A sender writes coder 2 only towards a peer whose plan entry says it decodes it (`klt_coder`),
and there, in a learned basis (ordered by energy), it leaves out the columns after the last
whose codes' rms reaches `drop_below` of a step (0.3 for activations, 0.5 for gradients):
their codes are mostly 0, and the entropy coder's time goes by symbol, not by bit. With
stochastic rounding those columns carry more noise than signal, so leaving them out lowers
the error it adds (a small bias, in directions of little energy; docs/compression.md).
"coder" names the entropy coder's format (1: the constriction ANS stream of
compression/rans.py); frames of the numpy coder before it had no "coder" and are refused, as
a node of that time refuses these (its params check is exact).
Pure torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch

import ravnest_node.compression.rans as rans
from ravnest_node.compression.aq import Commit
from ravnest_node.compression.host import generator_on, random_generator, to_host
from ravnest_node.compression.quant import (
    cast_finite,
    check_params,
    check_payload_size,
    checked_numel,
    flat_float32,
    int_param,
    owned_bytes,
)
from ravnest_node.errors import FrameError

MIN_DIM = 16
MAX_DIM = 1024
EMA = 0.8
REFRESH_FIRST = 4
REFRESH_GROWTH = 2
REFRESH_MAX = 32
MAX_ID = 2**31 - 1
_PARAMS = ("basis", "id", "rows", "a", "packed", "coder")
_PARAMS_COLUMNS = (*_PARAMS, "cols")
CODER = 1
"""The entropy coder's format that every node of klt reads (params "coder"): all d columns."""
CODER_COLUMNS = 2
"""The format with "cols": only the first `cols` coefficient columns are coded (the others
are 0). Sent only to a peer that decodes it (its plan entry's `klt_coder`)."""


@dataclass(slots=True)
class KLTState:
    """Sender side of one stream: the covariance average, the current basis and its number,
    whether the next frame must carry it, and the rounding RNG. Its tensors live on the device
    of the stream's tensors (the generator from the first encode on)."""

    covariance: torch.Tensor | None = None
    basis: torch.Tensor | None = None
    """V as the receiver rebuilds it from the frame (int8 codes times column scales)."""
    analysis: torch.Tensor | None = None
    """(V^T)^-1: coefficients y = x (V^T)^-1 make y V^T = x exactly, whatever V's rounding."""
    wire_basis: bytes = b""
    basis_id: int = 0
    send_basis: bool = False
    frames: int = 0
    next_refresh: int = REFRESH_FIRST
    generator: torch.Generator | None = None
    columns: bool = False
    """The receiver decodes CODER_COLUMNS: trailing columns of little energy may be left out."""


@dataclass(slots=True)
class KLTBases:
    """Receiver side of one stream: the last basis the sender sent, and its number."""

    basis: torch.Tensor | None = None
    basis_id: int = -1
    received: int = 0
    """Bases received on this stream."""


FALLBACK_WIDTH = 256
"""Row width of a tensor whose last dimension is outside MIN_DIM..MAX_DIM: it is coded as its
flattened elements in rows of this many (the last one zero-padded), in the identity basis."""


def layout(shape: Sequence[int]) -> tuple[int, int, bool]:
    """(rows, d, learns): the codec sees a tensor of `shape` as rows of its last dimension when
    that is within MIN_DIM..MAX_DIM, coded in the learned basis (learns), else as rows of
    FALLBACK_WIDTH flattened elements in the identity basis (so no shape, however hostile,
    makes more than MAX_DIM lanes or more than numel / MIN_DIM steps)."""
    n = prod(shape)
    d = shape[-1] if len(shape) else 1
    if MIN_DIM <= d <= MAX_DIM:
        return n // d, d, True
    return -(-n // FALLBACK_WIDTH), FALLBACK_WIDTH, False


@dataclass(frozen=True, slots=True)
class KLT:
    """The klt codec; see the module doc. `alpha`, `per_row` and `stochastic` are the
    sender's choices (the payload says what the receiver needs)."""

    name: str = "klt"
    alpha: float = 0.5
    per_row: bool = True
    stochastic: bool = False
    drop_below: float = 0.3
    """In a learned basis, towards a peer that decodes CODER_COLUMNS: the columns after the
    last whose codes' rms reaches this are left out (their codes sent as 0)."""

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def new_state(self) -> KLTState:
        return KLTState(generator=random_generator() if self.stochastic else None)

    # ---- sender ----

    def encode(self, tensor: torch.Tensor, state: object | None) -> tuple[dict[str, int], bytes]:
        if not isinstance(state, KLTState):
            raise TypeError(f"{self.name} needs the state of new_state(), got {type(state)}")
        shape = tuple(tensor.shape)
        rows, d, learns = layout(shape)
        flat = flat_float32(tensor)
        if flat.numel() != rows * d:  # the fallback layout's last row is zero-padded
            flat = torch.cat([flat, flat.new_zeros(rows * d - flat.numel())])
        x = flat.view(rows, d)
        # Each row's largest |x| (NaN propagates through amax): one pass checks every value.
        peaks = x.abs().amax(1, keepdim=True)
        if not bool(torch.isfinite(peaks).all()):
            raise ValueError(f"{self.name}: the tensor holds values that are not finite")
        basis = state.basis if learns else None
        basis_id = state.basis_id
        y = x @ state.analysis if basis is not None and state.analysis is not None else x
        steps = self._steps(x, peaks)
        # Double a step until its row's coefficients lie within the codes (before rounding,
        # so that stochastic rounding stays unbiased), then round once. Division by a step
        # rounds monotonically, so the largest |y| / step is the largest |y| over the step:
        # the search runs on one number per row.
        biggest = y.abs().amax(1, keepdim=True) if self.per_row else y.abs().amax()
        while True:
            over = biggest / steps > rans.MAX_CODE
            if not bool(over.any()):
                break
            steps = torch.where(over, steps * 2, steps)
        z = y / steps
        if state.generator is not None:
            state.generator = generator_on(state.generator, z.device)
            z = z.add_(torch.rand(z.shape, generator=state.generator, device=z.device)).floor_()
        else:
            z = z.round_()
        cols = d
        if state.columns and basis is not None:
            # The basis is ordered by energy: keep columns up to the last whose codes' rms
            # reaches drop_below (the rest round mostly to 0 anyway; with stochastic rounding
            # their codes are more noise than signal).
            kept = (z.square().mean(0) >= self.drop_below**2).nonzero()
            cols = int(kept[-1]) + 1 if kept.numel() else 0
            z = z[:, :cols]
        # Codes lie within -MAX_CODE..MAX_CODE: int16 is all that needs to cross to the host.
        codes, step_bits = to_host(
            z.to(torch.int16), steps.reshape(-1).to(torch.bfloat16).view(torch.int16)
        )
        a, models, coded = rans.encode(codes.T)
        parts = [step_bits.numpy().tobytes()]
        mode = 0
        if basis is not None:
            mode = 2
            if state.send_basis:
                mode = 1
                parts.append(state.wire_basis)
                state.send_basis = False
        parts += [models.numpy().tobytes(), coded]
        payload = b"".join(parts)
        if learns:
            self._learn(x, state)
        params = {"basis": mode, "id": basis_id if mode else 0, "rows": int(self.per_row),
                  "a": a, "packed": len(payload), "coder": CODER}  # fmt: skip
        if state.columns:
            params |= {"coder": CODER_COLUMNS, "cols": cols}
        return params, payload

    def _steps(self, x: torch.Tensor, peaks: torch.Tensor) -> torch.Tensor:
        """bfloat16-exact steps, [rows, 1] or [1, 1]; 1 where the rms is 0 (codes are 0).
        `peaks`: the largest |x| of each row [rows, 1]."""
        # rms as m * rms(x / m), m the largest |x|: no overflow for any finite x.
        if self.per_row:
            m = peaks
            rms = m * (x / m.clamp(min=1e-38)).pow(2).mean(1, keepdim=True).sqrt()
        else:
            m = peaks.amax().reshape(1, 1)
            rms = m * (x / m.clamp(min=1e-38)).pow(2).mean().sqrt()
        steps = (rms * self.alpha).to(torch.bfloat16).to(torch.float32)
        return torch.where((steps > 0) & torch.isfinite(steps), steps, torch.ones_like(steps))

    def _learn(self, x: torch.Tensor, state: KLTState) -> None:
        """Fold x's rows into the covariance average; on a refresh frame, take the new basis
        (sent with the next frame)."""
        cov = (x.T @ x) / max(1, x.shape[0])
        if not _all_finite(cov):
            return  # (squares of huge values overflow float32): leave this frame out
        if state.covariance is None:
            state.covariance = cov
        else:
            state.covariance.mul_(EMA).add_(cov, alpha=1 - EMA)
        state.frames += 1
        if state.frames < state.next_refresh:
            return
        state.next_refresh += min(state.next_refresh * (REFRESH_GROWTH - 1), REFRESH_MAX)
        vectors = torch.linalg.eigh(state.covariance.double()).eigenvectors
        vectors = vectors.flip(1).to(torch.float32)
        scales = (vectors.abs().amax(0) / 127).clamp(min=1e-30)
        codes = (vectors / scales).round().clamp(-127, 127).to(torch.int8)
        basis = codes.to(torch.float32) * scales
        try:
            analysis = torch.linalg.inv(basis.T)
        except RuntimeError:  # (a rounded basis of orthonormal vectors is far from singular)
            return
        state.basis, state.analysis = basis, analysis
        scales, codes = to_host(scales, codes)
        state.wire_basis = scales.numpy().tobytes() + codes.numpy().tobytes()
        state.basis_id = (state.basis_id % MAX_ID) + 1
        state.send_basis = True

    # ---- receiver ----

    def payload_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, params: Mapping[str, int]
    ) -> int:
        coder = params.get("coder") if isinstance(params, Mapping) else None
        columns = coder == CODER_COLUMNS
        check_params(self.name, params, _PARAMS_COLUMNS if columns else _PARAMS)
        checked_numel(self.name, shape, dtype)
        rows, d, learns = layout(shape)
        if rows < 1:
            raise FrameError(f"codec {self.name}: nothing to decode in shape {list(shape)}")
        mode = int_param(self.name, params, "basis", 0, 2 if learns else 0)
        int_param(self.name, params, "id", 1 if mode else 0, MAX_ID if mode else 0)
        per_row = int_param(self.name, params, "rows", 0, 1)
        a = int_param(self.name, params, "a", 0, rans.MAX_CODE)
        int_param(self.name, params, "coder", CODER, CODER_COLUMNS)
        cols = int_param(self.name, params, "cols", 0, d) if columns else d
        fixed = 2 * (rows if per_row else 1) + (_basis_nbytes(d) if mode == 1 else 0) + cols
        lo, hi = rans.payload_bounds(cols, rows, a)
        return int_param(self.name, params, "packed", fixed + lo, fixed + hi)

    def decode(
        self,
        payload: memoryview,
        shape: Sequence[int],
        dtype: torch.dtype,
        params: Mapping[str, int],
    ) -> torch.Tensor:
        """A frame that carries its own basis (or none); FrameError for one that names a basis
        of its stream (use `decode_stream`)."""
        value, _ = self.decode_stream(None, payload, shape, dtype, params)
        return value

    def decode_stream(
        self,
        bases: KLTBases | None,
        payload: memoryview,
        shape: Sequence[int],
        dtype: torch.dtype,
        params: Mapping[str, int],
    ) -> tuple[torch.Tensor, Commit]:
        """(the tensor, a commit that keeps a basis the frame carries in `bases`). Nothing
        changes until the commit runs; FrameError for a payload that does not decode or a
        frame that names a basis `bases` does not hold."""
        check_payload_size(self.name, payload, self.payload_nbytes(shape, dtype, params))
        rows, d, _ = layout(shape)
        mode, basis_id = params["basis"], params["id"]
        n_steps = rows if params["rows"] else 1
        steps = torch.frombuffer(owned_bytes(payload[: 2 * n_steps]), dtype=torch.int16)
        steps = steps.view(torch.bfloat16).to(torch.float32).reshape(n_steps, 1)
        if not bool((torch.isfinite(steps) & (steps > 0)).all()):
            raise FrameError(f"codec {self.name}: steps must be finite and positive")
        at = 2 * n_steps
        basis = None
        if mode == 1:
            basis = _read_basis(self.name, payload[at : at + _basis_nbytes(d)], d)
            at += _basis_nbytes(d)
        elif mode == 2:
            if bases is None or bases.basis is None or bases.basis_id != basis_id:
                held = "none" if bases is None or bases.basis is None else bases.basis_id
                raise FrameError(
                    f"codec {self.name}: the frame names basis {basis_id}, this stream holds {held}"
                )
            if bases.basis.shape != (d, d):
                raise FrameError(f"codec {self.name}: the stream's basis is not {d}x{d}")
            basis = bases.basis
        cols = params.get("cols", d)
        models = (
            torch.frombuffer(owned_bytes(payload[at : at + cols]), dtype=torch.uint8)
            if cols
            else torch.zeros(0, dtype=torch.uint8)
        )
        at += cols
        a = params["a"]
        symbols = rans.decode_symbols(payload[at:], a, models, rows)  # [cols, rows], codes + a
        # (code - a) x step is exact in float32: y [rows, cols] as the codes' transpose
        y = symbols.to(torch.float32).sub_(a).mul_(steps.reshape(1, n_steps)).T
        if basis is not None:
            out = y @ basis[:, :cols].T
        else:  # (the identity basis: the columns left out are 0)
            out = torch.cat([y, y.new_zeros(rows, d - cols)], 1) if cols < d else y
        if not _all_finite(out):
            raise FrameError(f"codec {self.name}: a decoded value is not finite")
        numel = prod(shape)
        value = cast_finite(self.name, out.reshape(-1)[:numel], dtype).reshape(tuple(shape))

        def commit() -> None:
            if mode == 1 and bases is not None and basis is not None:
                bases.basis, bases.basis_id = basis, basis_id
                bases.received += 1

        return value, commit


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a float tensor is finite: its largest |value| is (NaN propagates
    through amax), in two passes where isfinite().all() takes five."""
    return t.numel() == 0 or bool(torch.isfinite(t.abs().amax()))


def _basis_nbytes(d: int) -> int:
    return 4 * d + d * d


def _read_basis(codec: str, raw: memoryview, d: int) -> torch.Tensor:
    """V [d, d] from its float32 column scales and int8 codes; FrameError for a scale that is
    not finite and positive or a code of -128."""
    scales = torch.frombuffer(owned_bytes(raw[: 4 * d]), dtype=torch.float32)
    if not bool((torch.isfinite(scales) & (scales > 0)).all()):
        raise FrameError(f"codec {codec}: basis scales must be finite and positive")
    codes = torch.frombuffer(owned_bytes(raw[4 * d :]), dtype=torch.int8).reshape(d, d)
    if bool((codes == -128).any()):
        raise FrameError(f"codec {codec}: basis code -128 is refused")
    return codes.to(torch.float32) * scales


KLT_ACTIVATION = KLT()
KLT_ACTIVATION_FINE = KLT(alpha=0.35)
"""Activations at a step of 0.35 rather than 0.5 of the row's rms: about 30% more activation
bytes (14.2 against 10.9 KB a sample on the internet link) for half the squared error. The
step travels in the frame, so every decoder of klt reads it; `auto` sends it where it hides
and int4-block does not (compression/auto.py, `ranked`)."""
KLT_GRADIENT = KLT(alpha=0.35, per_row=False, stochastic=True, drop_below=0.5)
KLT_ACTIVATION_COARSE = KLT(alpha=0.7)
"""Activations at a step of 0.7 of the row's rms: about 25% fewer bytes than at 0.5 on
bench-small's boundaries (2.9 against 3.9 MB for the middle stage's 240 frames of a 60-step
run, relative error 0.136 against 0.111; docs/compression.md). `auto` sends it only where even
klt at its default step sets the pipeline's pace (compression/auto.py, `ranked`)."""
KLT_GRADIENT_COARSE = KLT(alpha=0.5, per_row=False, stochastic=True, drop_below=0.5)
"""Gradients at a step of 0.5 of the tensor's rms: about 20% fewer bytes than at 0.35 (5.2
against 6.7 MB for the middle stage's 240 frames, relative error 0.160 against 0.125: about
int4-block's, 0.151), sent where even klt at its default step sets the pace."""
