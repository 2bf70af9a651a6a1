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
from typing import Protocol

import torch

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


class Codec(Protocol):
    """Turns a tensor into payload bytes and back."""

    @property
    def name(self) -> str:
        """The codec's registry name, as frames carry it."""
        ...

    def applies_to(self, dtype: torch.dtype) -> bool:
        """Whether this codec may encode tensors of this dtype (others travel as `none`)."""
        ...

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Payload bytes of a contiguous CPU tensor."""
        ...

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Exact payload size for a tensor of this shape and dtype."""
        ...

    def decode(self, payload: memoryview, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The tensor (of `dtype`, `shape`); raises FrameError if the payload size is wrong."""
        ...


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    t = tensor.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: move the same bits as int16
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _from_bytes(payload: memoryview, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    carrier = torch.int16 if dtype == torch.bfloat16 else dtype
    # bytearray: one copy into memory we own, so the tensor is writable and outlives the message.
    flat = torch.frombuffer(bytearray(payload), dtype=carrier)
    if carrier != dtype:
        flat = flat.view(dtype)
    return flat.reshape(tuple(shape))


def _check_size(codec: str, payload: memoryview, expected: int) -> None:
    if len(payload) != expected:
        raise FrameError(
            f"codec {codec}: payload is {len(payload)} bytes, the header implies {expected}"
        )


@dataclass(frozen=True, slots=True)
class RawCodec:
    """`none`: the tensor's own bytes, lossless."""

    name: str = "none"

    def applies_to(self, dtype: torch.dtype) -> bool:
        return True

    def encode(self, tensor: torch.Tensor) -> bytes:
        return _raw_bytes(tensor)

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return prod(shape) * dtype.itemsize

    def decode(self, payload: memoryview, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        _check_size(self.name, payload, self.payload_nbytes(shape, dtype))
        return _from_bytes(payload, shape, dtype)


@dataclass(frozen=True, slots=True)
class CastCodec:
    """`fp16` / `bf16`: floating tensors cast to 16 bits on the wire, back to their dtype after."""

    name: str
    wire: torch.dtype

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def encode(self, tensor: torch.Tensor) -> bytes:
        return _raw_bytes(tensor.to(self.wire))

    def payload_nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return prod(shape) * self.wire.itemsize

    def decode(self, payload: memoryview, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        _check_size(self.name, payload, self.payload_nbytes(shape, dtype))
        return _from_bytes(payload, shape, self.wire).to(dtype)


CODECS: Mapping[str, Codec] = {
    c.name: c
    for c in (
        RawCodec(),
        CastCodec(name="fp16", wire=torch.float16),
        CastCodec(name="bf16", wire=torch.bfloat16),
    )
}


def get_codec(name: str) -> Codec:
    """The registered codec called `name`; ConfigError listing the known ones otherwise."""
    try:
        return CODECS[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; choose one of: {', '.join(CODECS)}") from None
