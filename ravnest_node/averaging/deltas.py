"""Deltas as frames: what a member pushes (encoded with the group's codec) and what it decodes.

Each push (wire.py) is one tensor frame of kind DELTA: `seq` = the round, `version` = the
sender's optimizer step, one float32 tensor named after the part of the round it is (inbox.py).
Every part (a whole delta, a ring chunk) keeps its own error-feedback state of the codec. A
member uses its own parts as the others decode them, so that every member computes with the
same values.

With powersgd a whole delta travels in an envelope: the frame's one tensor `delta` is the codec's
payload as uint8 (codec `none`), which the receiver decodes with its own PowerSGD codec, built
from the same layout and rank (the group's codec name fixes the rank, so its params need not
travel; a payload of another rank or layout has another size and is refused). The frame layer
cannot decode it itself: it looks codecs up by name, and this one needs the layout. powersgd
always runs all-to-all, whatever the group size: a ring would cut the flat vector into chunks
that split matrices, and its partial sums would be sums of factors, not of deltas.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ravnest_node.averaging.config import delta_codec, payload_nbytes
from ravnest_node.compression import CODECS
from ravnest_node.compression.powersgd import PowerSGD
from ravnest_node.errors import ConfigError, FrameError
from ravnest_node.transport.frames import (
    Expected,
    Frame,
    FrameKind,
    FrameLimits,
    Outgoing,
    check_tensors,
    encode_frame,
    parse_frame,
)

HEADER_RESERVE = 4096 + 8
"""Bytes a frame may need beyond its payload (the largest accepted header and the prefix)."""


class DeltaCoder:
    """Encodes this member's deltas and ring parts into frames, and parses and decodes the
    frames pushed to it. Not thread-safe: one round's torch work at a time."""

    def __init__(
        self,
        codec_name: str,
        layout: Sequence[Sequence[int]] | None,
        numel: int,
        max_message_bytes: int,
    ) -> None:
        """A coder of deltas of `numel` elements with the delta codec `codec_name` (`layout`:
        the parameters' shapes, for powersgd) in messages of at most `max_message_bytes`.
        ConfigError for a layout of another size than `numel`, or a delta that cannot fit one
        message."""
        self.numel = numel
        self._codec = delta_codec(codec_name, layout)
        # powersgd payloads travel in an envelope (module doc) and only whole: a ring chunk would
        # cut through matrices.
        self._envelope = self._codec if isinstance(self._codec, PowerSGD) else None
        if self._envelope is not None and self._envelope.numel != numel:
            raise ConfigError(
                f"the layout holds {self._envelope.numel} elements, the delta has {numel}"
            )
        # parse_frame bounds what decoding costs: the float32 result plus the payload (for an
        # envelope, its uint8 tensor counts 4 bytes an element, and the payload once more).
        payload = payload_nbytes(self._codec, numel)
        decoded = 4 * payload if self._envelope is not None else 4 * numel
        need = HEADER_RESERVE + decoded + payload
        if need > max_message_bytes:
            raise ConfigError(
                f"a delta of {numel} parameters with codec {codec_name} needs "
                f"max_message_bytes >= {need}, not {max_message_bytes}"
            )
        self._limits = FrameLimits(
            max_message_bytes=max_message_bytes, max_tensors=1, max_samples=0
        )
        self._states: dict[str, object | None] = {}

    @property
    def whole_only(self) -> bool:
        """Whether deltas travel only whole (powersgd: no ring)."""
        return self._envelope is not None

    def parse(self, request: bytes) -> Frame:
        """The pushed frame; FrameError unless it is a DELTA frame of one tensor within the
        limits."""
        frame = parse_frame(request, self._limits)
        if frame.kind is not FrameKind.DELTA or len(frame.headers) != 1:
            raise FrameError("an averaging push carries one tensor in a DELTA frame")
        return frame

    def check_length(self, frame: Frame, length: int) -> None:
        """FrameError unless the frame's tensor holds a part of `length` elements (with
        powersgd: the envelope of a whole delta)."""
        name = frame.headers[0].name
        if self._envelope is not None:
            nbytes = payload_nbytes(self._envelope, self.numel)
            check_tensors(frame, [Expected(name, (nbytes,), torch.uint8)])
        else:
            check_tensors(frame, [Expected(name, (length,), torch.float32)])

    def encode(
        self,
        round: int,
        step: int,
        name: str,
        tensor: torch.Tensor,
        plus: torch.Tensor | None = None,
        state_key: str | None = None,
    ) -> bytes:
        """The frame of `tensor` (+ `plus`) as part `name`, with that part's error-feedback
        state (or the state called `state_key`). ValueError if it is not finite. Runs in the
        executor."""
        if plus is not None:
            tensor = tensor + plus
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"round {round}: this member's {name} is not finite")
        key = state_key or name
        if key not in self._states:
            self._states[key] = self._codec.new_state()
        if self._envelope is not None:
            params, payload = self._envelope.encode(tensor, self._states[key])
            assert params == self._envelope.params  # the receivers assume them (module doc)
            carrier = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            out = Outgoing(name, carrier, CODECS["none"])
        else:
            out = Outgoing(name, tensor.contiguous(), self._codec, self._states[key])
        return encode_frame(FrameKind.DELTA, round, step, [out])

    def encode_decoded(
        self,
        round: int,
        step: int,
        name: str,
        tensor: torch.Tensor,
        plus: torch.Tensor | None = None,
    ) -> tuple[bytes, torch.Tensor]:
        """`encode`, and the tensor as the receivers decode it (what this member uses too, so
        that every member computes with the same values)."""
        message = self.encode(round, step, name, tensor, plus)
        return message, self.decode(parse_frame(message, self._limits))

    def decode(self, frame: Frame) -> torch.Tensor:
        """The frame's delta, flat float32 (from its envelope with powersgd); FrameError if it
        does not decode or holds values that are not finite. Runs in the executor."""
        if self._envelope is None:
            return _decode_finite(frame)
        carrier = next(iter(frame.decode().values()))
        payload = memoryview(carrier.numpy().tobytes())
        value = self._envelope.decode(payload, (self.numel,), torch.float32, self._envelope.params)
        return _decode_finite_tensor(value)


def _decode_finite(frame: Frame) -> torch.Tensor:
    """The frame's one tensor, flat; FrameError if it holds values that are not finite."""
    return _decode_finite_tensor(next(iter(frame.decode().values())))


def _decode_finite_tensor(value: torch.Tensor) -> torch.Tensor:
    """`value`, flat; FrameError if it holds values that are not finite."""
    value = value.reshape(-1)
    if not bool(torch.isfinite(value).all()):
        raise FrameError("the delta holds values that are not finite")
    return value
