"""Blockwise absmax quantisation to 8, 4 or 2 bits (Dettmers et al., arXiv 2110.02861).

The flattened tensor is cut into blocks of `block` elements (the last one zero-padded); each block
keeps its scale s = max|x| and codes q = round(x / s * L), with L = 127 for 8 bits, L = 7 for
4 bits and L = 1 for 2 bits (ternary codes; used by aq-delta for small deltas). Decoding gives
q * s / L; a block whose scale is 0 decodes to zeros.

Payload (little-endian, nb = ceil(numel / block) blocks, n = nb * block padded elements):

```
float32 scale[nb]                     4 * nb bytes: scales are float32 so that no finite
                                      magnitude overflows (float16 stops at 65504)
8-bit:  int8 code[n]                  n bytes, each in -127..127 (-128 is refused)
4-bit:  uint8 packed[ceil(n / 2)]     code 2i in the low nibble of byte i, code 2i+1 in the high
                                      one; nibbles are 4-bit two's complement in -7..7 (8 refused)
2-bit:  uint8 packed[ceil(n / 4)]     code 4i+j in bits 2j..2j+1 of byte i, two's complement in
                                      -1..1 (the pattern 0b10, -2, is refused)
```

Codes of the padding are 0. Bits per element: bits + 32 / block (8.5 / 4.5 at block 64, 8.125 /
4.125 at block 256), ignoring the padding of the last block.

Error bound per element (s the scale of the element's block, exact arithmetic; float32 adds a
few ulps of s): |x - D(C(x))| <= s / (2L) with round-to-nearest, < s / L with stochastic rounding
(round up with probability equal to the fractional part), which is unbiased: E[D(C(x))] = x.

Error feedback (Karimireddy et al., arXiv 1901.09847), sender side only: p = x + e; c = C(p);
e <- p - D(c). The sum of what the receiver decodes then stays within one step's error of the sum
of what was sent, however many steps are taken.

Coarse codes (`codes` < L, sender side only): the encoder rounds x / s * codes to -codes..codes
and writes the block's scale as s * L / codes, so the payload is an ordinary one of this codec
and any decoder rebuilds q * s / codes. With 4 bits and codes = 3, the int4 payload carries 7
values, and packing it with deflate (transport/frames.py) spends about 3.2 bits per element
instead of 3.9 on bench-small's gradients; `auto` sends gradients so on links that set the
pipeline's pace (docs/compression.md). Error bound: s / (2 codes) to nearest, < s / codes
stochastic. A block whose written scale would overflow float32 keeps all L codes.

Frame params: {"bits": 8 or 4, "block": 16..65536}; 2-bit codes travel only inside aq-delta.
Stochastic rounding, error feedback and coarse codes do not change the wire format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch

from ravnest_node.compression.host import generator_on, random_generator, to_host
from ravnest_node.errors import ConfigError, FrameError

MIN_BLOCK = 16
MAX_BLOCK = 65536
_SCALE_BYTES = 4
_LEVELS = {8: 127, 4: 7, 2: 1}


# ---- helpers shared with sparse.py: hostile header values, checked before any allocation ----


def check_params(codec: str, params: Mapping[str, int], expected: Sequence[str]) -> None:
    """FrameError unless `params` has exactly the keys `expected` (no missing, no unknown)."""
    if not isinstance(params, Mapping):
        raise FrameError(f"codec {codec}: params must be a mapping, got {type(params).__name__}")
    keys = set(params)
    if keys != set(expected):
        raise FrameError(
            f"codec {codec}: params must be exactly {sorted(expected)}, "
            f"got {sorted(map(str, keys))}"
        )


def int_param(codec: str, params: Mapping[str, int], key: str, lo: int, hi: int) -> int:
    """params[key] as an int in lo..hi; FrameError if it is missing, not an int (bool is not), or
    out of range."""
    value = params.get(key)
    if type(value) is not int:
        raise FrameError(f"codec {codec}: param {key!r} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise FrameError(f"codec {codec}: param {key!r}={value} is outside {lo}..{hi}")
    return value


def checked_numel(codec: str, shape: Sequence[int], dtype: torch.dtype) -> int:
    """Number of elements of `shape`; FrameError for a bad dimension or a non-floating dtype."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise FrameError(f"codec {codec}: only floating tensors are encoded, not {dtype}")
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise FrameError(f"codec {codec}: bad dimension {dim!r} in shape {list(shape)}")
    return prod(shape)


def check_payload_size(codec: str, payload: memoryview, expected: int) -> None:
    """FrameError unless the payload is exactly `expected` bytes."""
    if len(payload) != expected:
        raise FrameError(
            f"codec {codec}: payload is {len(payload)} bytes, the header implies {expected}"
        )


def flat_float32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a flat, contiguous float32 tensor on its own device (a view when it already
    is one): a bf16 or fp16 tensor is converted where it lies, before anything crosses to the
    host (compression/host.py)."""
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"only floating tensors can be quantised, not {tensor.dtype}")
    return tensor.detach().to(dtype=torch.float32).contiguous().reshape(-1)


def cast_finite(codec: str, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Finite float32 `out` cast to `dtype`; FrameError if a value overflows a 16-bit dtype."""
    if dtype == torch.float32:
        return out
    cast = out.to(dtype)
    if not bool(torch.isfinite(cast).all()):
        raise FrameError(f"codec {codec}: a decoded value overflows {dtype}")
    return cast


def owned_bytes(payload: memoryview) -> bytearray:
    """One copy of the payload into memory we own (writable, so torch.frombuffer accepts it)."""
    return bytearray(payload)


# ---- the codec ----


@dataclass(slots=True)
class QuantState:
    """Sender-side state of a BlockQuant stream: error-feedback residual and rounding RNG.

    One state per tensor stream (same shape every step); not shared between threads."""

    residual: torch.Tensor | None = None
    """e, flat float32, created at the first encode (error feedback only)."""
    generator: torch.Generator | None = None
    """RNG for stochastic rounding, private so the training RNG is not disturbed; on the
    tensor's device after the first encode (compression/host.py)."""


@dataclass(frozen=True, slots=True)
class BlockQuant:
    """Blockwise absmax quantisation codec (`int8-block` / `int4-block`); see the module doc."""

    name: str
    """Registry name carried in frames."""
    bits: int
    """Bits per code: 8, 4 or 2."""
    block: int = 64
    """Elements per scale, 16..65536 (64-256 keeps activation outliers local)."""
    stochastic: bool = False
    """Stochastic rounding (unbiased; for gradients); sender-side only."""
    error_feedback: bool = False
    """Keep the residual e <- p - D(C(p)) and add it to the next tensor; sender-side only."""
    codes: int = 0
    """Largest code magnitude the encoder uses, 1..L (0: L); sender-side only (module doc)."""

    def __post_init__(self) -> None:
        if self.bits not in _LEVELS:
            raise ConfigError(f"{self.name}: bits must be 8, 4 or 2, not {self.bits!r}")
        if type(self.codes) is not int or not 0 <= self.codes <= _LEVELS[self.bits]:
            raise ConfigError(
                f"{self.name}: codes must be in 0..{_LEVELS[self.bits]}, not {self.codes!r}"
            )
        if type(self.block) is not int or not MIN_BLOCK <= self.block <= MAX_BLOCK:
            raise ConfigError(
                f"{self.name}: block must be an int in {MIN_BLOCK}..{MAX_BLOCK}, not {self.block!r}"
            )

    @property
    def levels(self) -> int:
        """L: the largest code magnitude (127, 7 or 1)."""
        return _LEVELS[self.bits]

    @property
    def bits_per_element(self) -> float:
        """Wire bits per element, ignoring the padding of the last block."""
        return self.bits + 8 * _SCALE_BYTES / self.block

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def new_state(self) -> QuantState | None:
        """A fresh sender state, or None when the codec is stateless (no feedback, no RNG)."""
        if not (self.error_feedback or self.stochastic):
            return None
        return QuantState(generator=random_generator() if self.stochastic else None)

    def encode(self, tensor: torch.Tensor, state: object | None) -> tuple[dict[str, int], bytes]:
        """(params, payload) of a floating tensor on any device, quantised there (only the codes
        and scales cross to the host). Raises ValueError for non-finite values (they cannot be
        quantised) and TypeError for a state that is not this codec's."""
        x = flat_float32(tensor)
        st = self._state(state)
        if st is not None and st.residual is not None:
            if st.residual.numel() != x.numel():
                raise ValueError(
                    f"{self.name}: error-feedback state holds {st.residual.numel()} elements, "
                    f"the tensor has {x.numel()}; use one state per tensor stream"
                )
            x = x + st.residual
        generator = st.generator if st is not None else None
        if generator is not None and st is not None:
            generator = st.generator = generator_on(generator, x.device)
        elif self.stochastic:
            generator = random_generator(x.device)
        scales, codes = self.quantise(x, generator)
        if st is not None and self.error_feedback:
            numel = x.numel()
            decoded = self.dequantise(scales, codes)[:numel]
            st.residual = x - decoded
        params = {"bits": self.bits, "block": self.block}
        return params, self.pack(scales, codes)

    def payload_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, params: Mapping[str, int]
    ) -> int:
        """Exact payload size; FrameError for bad params, shape or dtype."""
        block = self._block_param(params)
        numel = checked_numel(self.name, shape, dtype)
        nblocks = -(-numel // block)
        padded = nblocks * block
        per_byte = 8 // self.bits
        code_bytes = -(-padded // per_byte)
        return nblocks * _SCALE_BYTES + code_bytes

    def decode(
        self,
        payload: memoryview,
        shape: Sequence[int],
        dtype: torch.dtype,
        params: Mapping[str, int],
    ) -> torch.Tensor:
        """The tensor; FrameError if the payload has the wrong size, a scale that is negative or
        not finite, a code outside -L..L, a nonzero code in the padding, or a value that
        overflows a 16-bit `dtype`."""
        check_payload_size(self.name, payload, self.payload_nbytes(shape, dtype, params))
        block = params["block"]
        numel = prod(shape)
        nblocks = -(-numel // block)
        buf = owned_bytes(payload)
        if nblocks == 0:
            return torch.zeros(tuple(shape), dtype=dtype)
        scales = torch.frombuffer(buf, dtype=torch.float32, count=nblocks)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise FrameError(f"codec {self.name}: a block scale is negative or not finite")
        raw = torch.frombuffer(buf, dtype=torch.int8, offset=nblocks * _SCALE_BYTES)
        codes = raw if self.bits == 8 else _unpack(raw, self.bits)  # may end in padding codes
        if bool((codes == -self.levels - 1).any()):
            raise FrameError(f"codec {self.name}: a code is outside -{self.levels}..{self.levels}")
        if bool(codes[numel:].any()):
            raise FrameError(f"codec {self.name}: the padding after the last element is not zero")
        out = self.dequantise(scales, codes[: nblocks * block])[:numel]
        return cast_finite(self.name, out.reshape(tuple(shape)), dtype)

    # -- internals (quantise, dequantise and pack are also used by aq-delta) --

    def _state(self, state: object | None) -> QuantState | None:
        if state is None:
            if self.error_feedback:
                raise TypeError(f"{self.name} with error feedback needs the state of new_state()")
            return None
        if not isinstance(state, QuantState):
            raise TypeError(f"{self.name}: state must come from new_state(), got {type(state)}")
        return state

    def _block_param(self, params: Mapping[str, int]) -> int:
        check_params(self.name, params, ("bits", "block"))
        int_param(self.name, params, "bits", self.bits, self.bits)
        return int_param(self.name, params, "block", MIN_BLOCK, MAX_BLOCK)

    def quantise(
        self, x: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scales [nb] float32 as written, codes [nb, block] int8) of flat float32 x."""
        numel, block = x.numel(), self.block
        nblocks = -(-numel // block)
        if nblocks * block != numel:
            padded = x.new_zeros(nblocks * block)
            padded[:numel] = x
            x = padded
        blocks = x.view(nblocks, block)
        # max|x| as max(amax, -amin): two reductions and no |x| temporary.
        scales = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())
        if not bool(torch.isfinite(scales).all()):
            raise ValueError(f"{self.name}: the tensor has non-finite values")
        levels = self.levels
        used: float | torch.Tensor = levels
        if self.codes and self.codes < levels:
            written = scales * (levels / self.codes)
            coarse = torch.isfinite(written)
            used = torch.where(coarse, float(self.codes), float(levels)).unsqueeze(1)
            scales = torch.where(coarse, written, scales)
        inv = torch.where(scales > 0, levels / scales, 0.0)
        y = blocks * inv.unsqueeze(1)  # x / s_written * L = x / s * codes
        if self.stochastic:
            y.add_(torch.rand(y.shape, generator=generator, device=y.device)).floor_()
        else:
            y.round_()
        # levels / s rounds: x = s can land an ulp above the largest code
        if isinstance(used, torch.Tensor):
            y.clamp_(-used, used)
        elif self.stochastic:
            y.clamp_(-levels, levels)
        return scales, y.to(torch.int8)

    def dequantise(self, scales: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Flat float32 q * s / L of codes [nb, block]."""
        # A tensor divisor: CUDA divides by a Python number as a multiply by its reciprocal,
        # which can differ from the division in the last bit, and aq-delta's sender and
        # receiver must compute bit-identical references on any device.
        step = scales / torch.full_like(scales, self.levels)
        return (codes.view(scales.numel(), -1).to(torch.float32) * step.unsqueeze(1)).view(-1)

    def pack(self, scales: torch.Tensor, codes: torch.Tensor) -> bytes:
        """The payload of `quantise`'s results: codes packed on their device, then moved to the
        host with the scales."""
        flat = codes.view(-1)
        if self.bits < 8:
            flat = _pack(flat, self.bits)
        scales, flat = to_host(scales, flat)
        out = torch.empty(scales.numel() * _SCALE_BYTES + flat.numel(), dtype=torch.uint8)
        split = scales.numel() * _SCALE_BYTES
        out[:split] = scales.view(torch.uint8)
        out[split:] = flat.view(torch.uint8)
        return out.numpy().tobytes()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes in -L..L -> bytes of 8 // bits codes each (the first in the lowest bits),
    padded with 0 codes to whole bytes."""
    per_byte = 8 // bits
    pad = -codes.numel() % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    groups = codes.view(torch.uint8).view(-1, per_byte) & ((1 << bits) - 1)
    out = groups[:, 0].clone()
    for j in range(1, per_byte):
        out |= groups[:, j] << (bits * j)
    return out


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes (int8) -> sign-extended int8 codes, 8 // bits per byte, lowest bits first."""
    per_byte = 8 // bits
    # Shift code j to the top of the byte, then an arithmetic shift on int8 sign-extends it.
    parts = [(packed << (8 - bits * (j + 1))) >> (8 - bits) for j in range(per_byte)]
    return torch.stack(parts, dim=1).view(-1)


def int8_block(
    block: int = 64, *, stochastic: bool = False, error_feedback: bool = False
) -> BlockQuant:
    """The `int8-block` codec: 8-bit codes, 8 + 32/block bits per element."""
    return BlockQuant("int8-block", 8, block, stochastic, error_feedback)


def int4_block(
    block: int = 64, *, stochastic: bool = False, error_feedback: bool = False, codes: int = 0
) -> BlockQuant:
    """The `int4-block` codec: 4-bit codes, 4 + 32/block bits per element (`codes`: coarse
    codes, module doc)."""
    return BlockQuant("int4-block", 4, block, stochastic, error_feedback, codes)
