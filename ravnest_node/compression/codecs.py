"""Tensor codecs: how one tensor becomes payload bytes on the wire and back.

A codec is chosen per tensor role (activation, activation gradient) by the run spec. The
foundation has the lossless `none` (the tensor's own bytes) and the casts `fp16` and `bf16`;
the compression issue adds quantising and stateful codecs behind the same interface. Pure torch,
no I/O. Decoders treat payloads as hostile: the expected size is computed from the (already
validated) header before anything is read, and a payload of any other size is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Literal, Protocol

import torch

from ravnest_node.compression.aq import AQDelta
from ravnest_node.compression.host import to_host
from ravnest_node.compression.quant import BlockQuant, check_payload_size, int4_block, int8_block
from ravnest_node.compression.sparse import TopK
from ravnest_node.compression.transform import (
    KLT,
    KLT_ACTIVATION,
    KLT_ACTIVATION_COARSE,
    KLT_ACTIVATION_FINE,
    KLT_GRADIENT,
    KLT_GRADIENT_COARSE,
)
from ravnest_node.errors import ConfigError, FrameError

# The dtypes a frame may name, by wire name. Anything else is refused before allocation.
WIRE_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
DTYPE_NAMES: Mapping[torch.dtype, str] = {v: k for k, v in WIRE_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a dtype; raises ConfigError for a dtype frames cannot carry."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ConfigError(f"dtype {dtype} cannot be sent in a frame") from None


Params = Mapping[str, int]
"""A codec's wire parameters (e.g. {"block": 64}); they travel in the frame header."""


class Codec(Protocol):
    """Turns a tensor into (params, payload bytes) and back.

    Decoders treat params and payloads as hostile: `payload_nbytes` validates the params and
    says exactly how many bytes a payload must have before anything is allocated, and `decode`
    raises FrameError for anything inconsistent."""

    @property
    def name(self) -> str:
        """The codec's registry name, as frames carry it."""
        ...

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether this codec may encode tensors of this dtype (others travel as `none`)."""
        ...

    def new_state(self) -> object | None:
        """Sender-side state kept between frames of one stream (an error-feedback residual),
        or None for a stateless codec."""
        ...

    def encode(self, tensor: torch.Tensor, state: object | None) -> tuple[dict[str, int], bytes]:
        """(params, payload) of a tensor on any device, in any dtype `applies_to` accepts;
        updates `state` (kept on the tensor's device). The tensor work runs on that device and
        only its small results cross to the host, through `host.to_host`; the bytes are those
        of the same values encoded on the CPU (stochastic rounding aside: compression/host.py)."""
        ...

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype, params: Params) -> int:
        """Exact payload size for this shape, dtype and params; FrameError for bad params."""
        ...

    def decode(
        self, payload: memoryview, shape: Sequence[int], dtype: torch.dtype, params: Params
    ) -> torch.Tensor:
        """The tensor (of `dtype`, `shape`); FrameError if the payload does not fit."""
        ...


def _no_params(codec: str, params: Params) -> None:
    if params:
        raise FrameError(f"codec {codec} takes no params, got {sorted(params)[:6]}")


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    t = tensor.detach().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the same bits as int16
        t = t.view(torch.int16)
    (host,) = to_host(t)
    return host.numpy().tobytes()


def _from_bytes(payload: memoryview, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    carrier = torch.int16 if dtype == torch.bfloat16 else dtype
    # bytearray: one copy into memory we own, so the tensor is writable and outlives the message.
    flat = torch.frombuffer(bytearray(payload), dtype=carrier)
    if carrier != dtype:
        flat = flat.view(dtype)
    return flat.reshape(tuple(shape))


@dataclass(frozen=True, slots=True)
class RawCodec:
    """`none`: the tensor's own bytes, lossless."""

    name: str = "none"

    def applies_to(self, dtype: torch.dtype) -> bool:
        return True

    def new_state(self) -> None:
        return None

    def encode(self, tensor: torch.Tensor, state: object | None) -> tuple[dict[str, int], bytes]:
        return {}, _raw_bytes(tensor)

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype, params: Params) -> int:
        _no_params(self.name, params)
        return prod(shape) * dtype.itemsize

    def decode(
        self, payload: memoryview, shape: Sequence[int], dtype: torch.dtype, params: Params
    ) -> torch.Tensor:
        check_payload_size(self.name, payload, self.payload_nbytes(shape, dtype, params))
        return _from_bytes(payload, shape, dtype)


@dataclass(frozen=True, slots=True)
class CastCodec:
    """`fp16` / `bf16`: floating tensors cast to 16 bits on the wire (on their device, so half
    the bytes cross to the host), back to their dtype after."""

    name: str
    wire: torch.dtype

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def new_state(self) -> None:
        return None

    def encode(self, tensor: torch.Tensor, state: object | None) -> tuple[dict[str, int], bytes]:
        return {}, _raw_bytes(tensor.to(self.wire))

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype, params: Params) -> int:
        _no_params(self.name, params)
        if not dtype.is_floating_point:
            raise FrameError(f"codec {self.name} carries floating tensors only, not {dtype}")
        return prod(shape) * self.wire.itemsize

    def decode(
        self, payload: memoryview, shape: Sequence[int], dtype: torch.dtype, params: Params
    ) -> torch.Tensor:
        check_payload_size(self.name, payload, self.payload_nbytes(shape, dtype, params))
        out = _from_bytes(payload, shape, self.wire).to(dtype)
        if not bool(torch.isfinite(out).all()):
            raise FrameError(f"codec {self.name}: payload holds values that are not finite")
        return out


# Block sizes: 512 keeps int8 at 8.06 bits per element (scales are float32); int4 keeps small
# blocks, where a coarse code needs a local scale most.
INT8_BLOCK = 512
INT4_BLOCK = 64
AQ_BLOCK = 64

CODECS: Mapping[str, Codec] = {
    c.name: c
    for c in (
        RawCodec(),
        CastCodec(name="fp16", wire=torch.float16),
        CastCodec(name="bf16", wire=torch.bfloat16),
        int8_block(INT8_BLOCK),
        int4_block(INT4_BLOCK),
        TopK(name="topk-ef", fraction=0.01),
        AQDelta(name="aq-delta", bits=4, block=AQ_BLOCK),
        AQDelta(name="aq-delta2", bits=2, block=AQ_BLOCK),
        KLT_ACTIVATION,
    )
}
GRADIENT_ONLY = frozenset({"topk-ef"})
"""Codecs that drop most of a tensor and rely on error feedback: fine for gradients, whose
errors are fed back into later ones, but they would destroy activations."""
ACTIVATION_ONLY = frozenset({"aq-delta", "aq-delta2"})
"""Codecs that need the sample ids of each row and a reference per sample: activations of a
dataset that is revisited every epoch (aq-delta)."""


def get_codec(name: str) -> Codec:
    """The registered codec called `name`; ConfigError listing the known ones otherwise."""
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; choose one of: {', '.join(CODECS)}") from None


Role = Literal["activation", "gradient"]


def encoder(
    name: str, role: Role, *, bottleneck: bool = False, fine: bool = False, coarse: bool = False
) -> Codec:
    """The codec a sender uses for `name` in `role`: the registered one, or a variant that
    any decoder of that codec reads but that encodes better for the role (stochastic rounding
    for gradients, which keeps them unbiased). With `bottleneck` (a link that sets the
    pipeline's pace, where payloads are packed with deflate), int4-block takes fewer bytes:
    activations with one scale per BOTTLENECK_BLOCK elements, gradients with codes
    -COARSE_CODES..COARSE_CODES only. With `fine` (a link with room for it), klt activations
    take the finer step of KLT_ACTIVATION_FINE; with `coarse` (a link where even klt sets the
    pace), klt takes the coarser step of KLT_ACTIVATION_COARSE or KLT_GRADIENT_COARSE.
    ConfigError for an unknown name."""
    codec = get_codec(name)
    if role == "activation" and name in GRADIENT_ONLY:
        raise ConfigError(f"codec {name} is for gradients only; it would destroy activations")
    if role == "gradient" and name in ACTIVATION_ONLY:
        raise ConfigError(f"codec {name} is for activations only (it needs per-sample references)")
    variant: Codec | None
    if coarse and codec is KLT_ACTIVATION:
        variant = KLT_GRADIENT_COARSE if role == "gradient" else KLT_ACTIVATION_COARSE
    elif role == "gradient":
        variant = (_BOTTLENECK_GRADIENT if bottleneck else _GRADIENT_VARIANTS).get(name)
    elif fine and codec is KLT_ACTIVATION:
        variant = KLT_ACTIVATION_FINE
    else:
        variant = _BOTTLENECK_ACTIVATION.get(name) if bottleneck else None
    return variant if variant is not None else codec


_GRADIENT_VARIANTS: dict[str, Codec] = {
    # Stochastic rounding keeps quantised gradients unbiased.
    "int8-block": int8_block(INT8_BLOCK, stochastic=True),
    "int4-block": int4_block(INT4_BLOCK, stochastic=True),
    # One step for the whole tensor (only the sum of errors over rows reaches the weights),
    # stochastic rounding.
    "klt": KLT_GRADIENT,
}
# On a link that sets the pipeline's pace (auto packs its payloads with deflate there), both
# int4-block variants stay ordinary int4-block payloads. In the one-process simulation of
# bench-small's boundaries (docs/bench/boundary_codec_sim.py, 40 steps, seeds 0-2) the held-out
# loss with both moved -0.6% to +0.2% from int4's, inside the spread between seeds
# (docs/compression.md).
BOTTLENECK_BLOCK = 256
"""Elements per scale of activations: deflated, 12-16% fewer bits than at block 64 (the float32
scales cost 0.125 bits per element instead of 0.5; the codes' entropy grows a little)."""
COARSE_CODES = 3
"""Largest code of gradients: deflate packs the 7 values 20-23% smaller than the 15."""
_BOTTLENECK_ACTIVATION: dict[str, Codec] = {"int4-block": int4_block(BOTTLENECK_BLOCK)}
_BOTTLENECK_GRADIENT: dict[str, Codec] = {
    **_GRADIENT_VARIANTS,
    "int4-block": int4_block(INT4_BLOCK, stochastic=True, codes=COARSE_CODES),
}


FINE_LABEL = ", fine step"
"""How logs, tables and frame counts name klt activations at KLT_ACTIVATION_FINE's step."""
COARSE_LABEL = ", coarse step"
"""How logs, tables and frame counts name klt at KLT_ACTIVATION_COARSE's or
KLT_GRADIENT_COARSE's step."""


def variant_label(codec: Codec) -> str:
    """How an int4-block bottleneck variant or klt's fine step differs from the registered
    codec ("" otherwise), for logs and tables: ", codes -3..3", ", block 256", ", fine step",
    ", coarse step"."""
    if isinstance(codec, KLT):
        if codec is KLT_ACTIVATION_FINE:
            return FINE_LABEL
        return COARSE_LABEL if codec in (KLT_ACTIVATION_COARSE, KLT_GRADIENT_COARSE) else ""
    if not isinstance(codec, BlockQuant) or codec.name != "int4-block":
        return ""
    if codec.codes:
        return f", codes -{codec.codes}..{codec.codes}"
    return f", block {codec.block}" if codec.block != INT4_BLOCK else ""
