"""`aq-delta`: activations as quantised changes against a per-sample reference both ends keep.

The AQ-SGD idea (Wang et al., arXiv 2206.01299): in multi-epoch training the activation of a
sample at a stage boundary changes little from one visit of the sample to the next, so instead of
the activation a, send Q(a - m), where m is the reference kept for that sample; both ends then set
m <- m + D(Q(a - m)), and the receiver uses the new m as the activation. Because the reference is
updated with what was decoded, the quantisation error of one visit is part of the next visit's
delta: errors do not pile up over epochs (error feedback per sample).

The first visit of a sample is the warm-up: the activation travels uncompressed (its own dtype)
and becomes the reference. Later visits send the delta with blockwise absmax codes of 4 bits
(`aq-delta`) or 2 bits (`aq-delta2`, ternary) and float32 scales per block.

Both ends must hold bit-identical references: the sender computes m + D(c) with the same float32
operations (an exactly rounded multiply, then an exactly rounded add) that the receiver's decoder
uses, so they agree on every platform. References live per stream on both ends; a new stream
starts from none (warm-up again). Memory: one float32 copy of every sample's activation at the
boundary, on each end (docs/compression.md).

Frames carry the sample ids of a microbatch in the header (`samples`); params are
{"bits", "block", "ref"}: ref=0 is a warm-up payload (the tensor's own bytes), ref=1 a delta
payload laid out as in `quant`. Pure torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod

import torch

from ravnest_node.compression.host import to_host
from ravnest_node.compression.quant import (
    MAX_BLOCK,
    MIN_BLOCK,
    BlockQuant,
    check_params,
    check_payload_size,
    checked_numel,
    flat_float32,
    int_param,
)
from ravnest_node.errors import ConfigError, FrameError

Commit = Callable[[], None]


@dataclass(slots=True)
class SampleReferences:
    """The reference activation of every sample seen on one stream (float32, one per id)."""

    limit: int | None = None
    """Sample ids must be below this (the run's dataset size); None: trusted sender side."""
    refs: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.refs.values())

    def lookup(self, samples: Sequence[int], sample_shape: Sequence[int]) -> torch.Tensor | None:
        """The stacked references of `samples` (float32), or None if any is missing; FrameError
        if one has another shape than `sample_shape`."""
        found = [self.refs.get(s) for s in samples]
        present = [t for t in found if t is not None]
        if len(present) < len(found):
            return None
        for t in present:
            if tuple(t.shape) != tuple(sample_shape):
                raise FrameError(
                    f"aq-delta: the reference of a sample has shape {list(t.shape)}, "
                    f"the frame's is {list(sample_shape)}"
                )
        return torch.stack(present)

    def store(self, samples: Sequence[int], values: torch.Tensor) -> None:
        """Set the references of `samples` to the rows of `values` (float32). Detached: the
        receiver trains on `values` (autograd marks it), and the references must not follow."""
        for s, row in zip(samples, values.detach().unbind(0), strict=True):
            self.refs[s] = row


@dataclass(slots=True)
class AQState:
    """Sender side of one aq-delta stream: its references and the ids of the next tensor."""

    references: SampleReferences = field(default_factory=SampleReferences)
    samples: tuple[int, ...] | None = None
    """Set by `bind` before each encode: the sample ids of the tensor's rows."""

    def bind(self, samples: Sequence[int]) -> None:
        self.samples = tuple(samples)


def check_samples(samples: Sequence[int], rows: int, limit: int | None) -> None:
    """FrameError unless `samples` are `rows` distinct ints in 0..limit-1."""
    if len(samples) != rows:
        raise FrameError(f"aq-delta: {len(samples)} sample ids for a tensor of {rows} rows")
    if len(set(samples)) != len(samples):
        raise FrameError("aq-delta: a sample id appears twice in one frame")
    for s in samples:
        if type(s) is not int or s < 0 or (limit is not None and s >= limit):
            raise FrameError(f"aq-delta: sample id {s!r} is outside 0..{limit}")


@dataclass(frozen=True, slots=True)
class AQDelta:
    """The aq-delta codec; see the module doc. Activations only."""

    name: str
    bits: int
    block: int = 64

    def __post_init__(self) -> None:
        if self.bits not in (4, 2):
            raise ConfigError(f"{self.name}: bits must be 4 or 2, not {self.bits!r}")
        if not MIN_BLOCK <= self.block <= MAX_BLOCK:
            raise ConfigError(f"{self.name}: block must be in {MIN_BLOCK}..{MAX_BLOCK}")

    @property
    def _quant(self) -> BlockQuant:
        return BlockQuant(self.name, self.bits, self.block)

    @property
    def bits_per_element(self) -> float:
        """Wire bits per element of a delta payload (after the warm-up visit)."""
        return self._quant.bits_per_element

    def applies_to(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    def new_state(self) -> AQState:
        return AQState()

    def encode(self, tensor: torch.Tensor, state: object | None) -> tuple[dict[str, int], bytes]:
        """(params, payload) of a [samples, ...] floating tensor whose sample ids were bound to
        `state`; updates the state's references exactly as the receiver will (the sender's
        references stay on the tensor's device)."""
        if not isinstance(state, AQState):
            raise TypeError(f"{self.name} needs the state of new_state(), got {type(state)}")
        if state.samples is None:
            raise ValueError(f"{self.name}: bind the tensor's sample ids to the state first")
        samples, state.samples = state.samples, None
        if tensor.dim() < 1:
            raise ValueError(f"{self.name}: the tensor needs a leading sample dimension")
        check_samples(samples, tensor.shape[0], None)
        x = flat_float32(tensor).view(tensor.shape)
        ref = state.references.lookup(samples, tuple(tensor.shape[1:]))
        if ref is None:  # warm-up: the tensor's own bytes; they become the references
            state.references.store(samples, x.clone())
            (raw,) = to_host(tensor.detach().contiguous().view(torch.uint8))
            return self._params(0), raw.numpy().tobytes()
        quant = self._quant
        scales, codes = quant.quantise((x - ref).view(-1), None)
        decoded = quant.dequantise(scales, codes)[: x.numel()].view(x.shape)
        state.references.store(samples, ref + decoded)
        return self._params(1), quant.pack(scales, codes)

    def payload_nbytes(
        self, shape: Sequence[int], dtype: torch.dtype, params: Mapping[str, int]
    ) -> int:
        check_params(self.name, params, ("bits", "block", "ref"))
        int_param(self.name, params, "bits", self.bits, self.bits)
        ref = int_param(self.name, params, "ref", 0, 1)
        if not shape:
            raise FrameError(f"codec {self.name}: the tensor needs a leading sample dimension")
        if ref == 0:
            int_param(self.name, params, "block", MIN_BLOCK, MAX_BLOCK)
            return checked_numel(self.name, shape, dtype) * dtype.itemsize
        return self._quant.payload_nbytes(
            shape, dtype, {"bits": self.bits, "block": params["block"]}
        )

    def decode(
        self,
        payload: memoryview,
        shape: Sequence[int],
        dtype: torch.dtype,
        params: Mapping[str, int],
    ) -> torch.Tensor:
        """What the payload holds on its own: the warm-up activation (ref=0) or the float32
        delta (ref=1). `reconstruct` turns it into the activation."""
        check_payload_size(self.name, payload, self.payload_nbytes(shape, dtype, params))
        if params["ref"] == 0:
            carrier = torch.int16 if dtype == torch.bfloat16 else dtype
            out = torch.frombuffer(bytearray(payload), dtype=carrier).view(dtype)
            if not bool(torch.isfinite(out).all()):
                raise FrameError(f"codec {self.name}: payload holds values that are not finite")
            return out.reshape(tuple(shape))
        quant_params = {"bits": self.bits, "block": params["block"]}
        return self._quant.decode(payload, shape, torch.float32, quant_params)

    def reconstruct(
        self,
        references: SampleReferences,
        samples: Sequence[int],
        decoded: torch.Tensor,
        params: Mapping[str, int],
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, Commit]:
        """Receiver side: (the activation, a commit that updates the references). Nothing
        changes until the commit runs; FrameError for bad sample ids or a delta against a
        sample this stream has no reference for."""
        check_samples(samples, decoded.shape[0], references.limit)
        if params["ref"] == 0:
            values = decoded.to(torch.float32).clone()
        else:
            ref = references.lookup(samples, tuple(decoded.shape[1:]))
            if ref is None:
                raise FrameError(
                    f"{self.name}: a delta for a sample this stream holds no reference for"
                )
            values = ref + decoded
            if not bool(torch.isfinite(values).all()):
                raise FrameError(f"{self.name}: the reconstructed activation is not finite")
        ids = tuple(samples)
        return values.to(dtype), lambda: references.store(ids, values)

    def _params(self, ref: int) -> dict[str, int]:
        return {"bits": self.bits, "block": self.block, "ref": ref}


def reference_bytes(num_samples: int, sample_shape: Sequence[int]) -> int:
    """Memory the references of `num_samples` samples take on one end of one boundary."""
    return num_samples * prod(sample_shape) * 4
