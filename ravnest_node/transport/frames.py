"""Tensor frames: the messages of the data plane.

One gRPC message of the raw-bytes method `/ravnest.v1.Pipeline/Boundary` is one frame:

```
offset 0   4 bytes   magic b"RVF1"
offset 4   4 bytes   header length H, unsigned little-endian
offset 8   H bytes   msgpack header (a map, see below)
offset 8+H           the tensors' payloads, concatenated in header order
```

The header is a map with the keys `kind` (1 = forward activation, 2 = activation gradient, 3 =
parameter delta of replica averaging, 4 = forward activation of an evaluation),
`seq` (microbatch sequence number), `version` (weight version the sender computed it with),
optionally `samples` (the dataset ids of the microbatch's rows, in order: forward frames of a run
with a fixed dataset carry them, and aq-delta needs them) and `tensors`, a list of maps with
`name`, `shape` (list of ints), `dtype` (a name in `WIRE_DTYPES`), `codec` (a name in `CODECS`),
`params` (the codec's integer parameters), `lz4` (the codec payload is lz4-compressed on the
wire), optionally `deflate` (it is raw-deflate-compressed instead, RFC 1951) and `nbytes` (payload
length on the wire).

A sender packs a payload with lz4 when that makes it at least `LZ4_MIN_RATIO` times smaller
(fp32 noise never is; zeros and small codes often are), or, where the tensor's `Outgoing` asks for
deflate, with deflate at level 1 when that makes it at least `DEFLATE_MIN_RATIO` times smaller.
Deflate's Huffman stage is what shrinks quantised codes (4-bit absmax codes carry about 3.5 bits
of entropy, and lz4 has no entropy stage): 1.1-1.4x on int4-block activations and gradients of
`bench-small`, at about 50 MB/s of one core, so `auto` asks for it only on links that are the
pipeline's bottleneck (compression/auto.py). Unpacking never allocates more than the codec size
that the header's shape implies.

`parse_frame` checks the structure before anything is allocated: the header length against
`FrameLimits.max_header_bytes` before unpacking, msgpack unpacking with tight container limits,
every field's type and range, known dtype and codec names, and that the payload lengths add up to
the message length and match what the codec implies for the shape. Checking a parsed frame
against what the plan expects (names, shapes, dtypes, sequence numbers) is the stage's job
(`check_tensors`). Nothing here unpickles or dispatches by name.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from math import prod
from typing import Any

import lz4.block
import msgpack
import torch

from ravnest_node.compression import (
    CODECS,
    WIRE_DTYPES,
    AQDelta,
    AQState,
    Codec,
    SampleReferences,
    dtype_name,
)
from ravnest_node.compression.aq import Commit
from ravnest_node.compression.transform import KLT, KLTBases
from ravnest_node.errors import FrameError

MAGIC = b"RVF1"
MAX_NAME_LEN = 64
MAX_PARAMS = 8
"""A codec's params in a tensor header (klt's coder 2 has 7)."""
# lz4 is kept for a payload only when it shrinks it at least this much (fp32 values: ~1.0x).
LZ4_MIN_RATIO = 1.1
LZ4_MIN_BYTES = 256
# deflate, asked for on a bottleneck link, is kept for any real gain there.
DEFLATE_MIN_RATIO = 1.02
DEFLATE_LEVEL = 1
_PREFIX = struct.Struct("<4sI")


class FrameKind(IntEnum):
    FORWARD = 1
    BACKWARD = 2
    DELTA = 3
    """A replica's parameter delta for one averaging round (`seq` = the round)."""
    EVAL = 4
    """A forward activation of an evaluation on held-out data, no gradient to come back (`seq`
    = the microbatch within the evaluation, `version` = the step it follows)."""


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """Bounds a received frame must respect before any of it is decoded."""

    max_message_bytes: int
    max_header_bytes: int = 4096
    max_tensors: int = 8
    max_ndim: int = 8
    max_samples: int = 512
    """Sample ids one frame may list (a microbatch's rows)."""


@dataclass(frozen=True, slots=True)
class TensorHeader:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    codec: Codec
    params: dict[str, int]
    raw_nbytes: int
    """Codec payload size (validated against shape and params)."""
    lz4: bool
    """The payload on the wire is that codec payload, lz4-compressed."""
    nbytes: int
    """Bytes on the wire."""
    deflate: bool = False
    """The payload on the wire is that codec payload, raw-deflate-compressed."""

    def decode(self, payload: memoryview) -> torch.Tensor:
        return self.codec.decode(self.unpacked(payload), self.shape, self.dtype, self.params)

    def unpacked(self, payload: memoryview) -> memoryview:
        """The codec payload of what came on the wire (lz4 or deflate undone)."""
        if self.deflate:
            payload = _inflate(payload, self.raw_nbytes, self.name)
        elif self.lz4:
            try:
                # uncompressed_size is the validated codec size: nothing larger is allocated.
                raw = memoryview(lz4.block.decompress(payload, uncompressed_size=self.raw_nbytes))
            except lz4.block.LZ4BlockError as exc:
                raise FrameError(f"tensor {self.name!r}: bad lz4 payload: {exc}") from None
            if len(raw) != self.raw_nbytes:
                raise FrameError(f"tensor {self.name!r}: lz4 payload has the wrong size")
            payload = raw
        return payload


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One tensor to send: its name, the codec for it and that codec's sender state."""

    name: str
    tensor: torch.Tensor
    """On any device, in any dtype of WIRE_DTYPES: the codec encodes it where it lies."""
    codec: Codec
    state: object | None = None
    deflate: bool = False
    """Pack the payload with deflate rather than lz4 (for a link that is the bottleneck)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """A parsed, structurally valid frame; payloads are views into the received message."""

    kind: FrameKind
    seq: int
    version: int
    headers: tuple[TensorHeader, ...]
    payloads: tuple[memoryview, ...]
    samples: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)

    def decode(self) -> dict[str, torch.Tensor]:
        """The frame's tensors by name (copies out of the message); FrameError for a tensor
        whose codec needs receiver state (aq-delta: use `decode_with`)."""
        tensors, _ = self.decode_with({})
        return tensors

    def decode_with(
        self, references: Mapping[str, SampleReferences | KLTBases]
    ) -> tuple[dict[str, torch.Tensor], Commit]:
        """The frame's tensors, and a commit that applies the frame to the receiver's state.

        A tensor sent with aq-delta is rebuilt from the stream's per-sample references
        (`references[name]`; FrameError if this receiver keeps none), one sent with klt in the
        stream's basis (`references[name]`, a KLTBases; without one, only frames that carry their
        basis decode). Nothing
        changes until the commit runs, so a frame refused after decoding changes nothing."""
        tensors: dict[str, torch.Tensor] = {}
        commits: list[Commit] = []
        for h, p in zip(self.headers, self.payloads, strict=True):
            if isinstance(h.codec, KLT):
                held = references.get(h.name)
                bases = held if isinstance(held, KLTBases) else None
                value, commit = h.codec.decode_stream(
                    bases, h.unpacked(p), h.shape, h.dtype, h.params
                )
                commits.append(commit)
                tensors[h.name] = value
                continue
            value = h.decode(p)
            if isinstance(h.codec, AQDelta):
                refs = references.get(h.name)
                if not isinstance(refs, SampleReferences):
                    raise FrameError(f"tensor {h.name!r}: codec {h.codec.name} is not expected")
                value, commit = h.codec.reconstruct(refs, self.samples, value, h.params, h.dtype)
                commits.append(commit)
            tensors[h.name] = value

        def commit_all() -> None:
            for c in commits:
                c()

        return tensors, commit_all


def encode_frame(
    kind: FrameKind,
    seq: int,
    version: int,
    tensors: Sequence[Outgoing | tuple[str, torch.Tensor, Codec]],
    *,
    samples: Sequence[int] = (),
    lz4_min_ratio: float = LZ4_MIN_RATIO,
    packing: list[str] | None = None,
) -> bytes:
    """One frame carrying `tensors`, and the dataset ids of their rows if `samples` is given.
    Codecs that do not apply to a tensor's dtype (e.g. int8 on integer targets) fall back to
    `none`. Each payload is lz4-compressed when that makes it at least `lz4_min_ratio` times
    smaller, or deflate-compressed where its `Outgoing` asks for deflate and that makes it at
    least DEFLATE_MIN_RATIO times smaller (`lz4_min_ratio` 0 disables both). `packing`, if
    given, gets one entry per tensor: "deflate", "lz4" or "" (sent as the codec made it).
    Tensors may lie on any device: the codecs encode them there and hand back bytes
    (compression/host.py), so nothing here reads a device tensor's memory."""
    metas: list[dict[str, Any]] = []
    payloads: list[bytes] = []
    for item in tensors:
        out = item if isinstance(item, Outgoing) else Outgoing(*item)
        usable = out.codec.applies_to(out.tensor.dtype)
        chosen = out.codec if usable else CODECS["none"]
        if usable and isinstance(out.state, AQState):
            out.state.bind(samples)
        params, payload = chosen.encode(out.tensor, out.state if usable else None)
        deflated = _maybe_deflate(payload) if out.deflate and lz4_min_ratio > 0 else None
        packed = None if deflated is not None else _maybe_lz4(payload, lz4_min_ratio)
        wire = deflated if deflated is not None else packed if packed is not None else payload
        meta = {
            "name": out.name,
            "shape": list(out.tensor.shape),
            "dtype": dtype_name(out.tensor.dtype),
            "codec": chosen.name,
            "params": params,
            "lz4": packed is not None,
            "nbytes": len(wire),
        }
        if deflated is not None:
            meta["deflate"] = True
        if packing is not None:
            packing.append("deflate" if deflated is not None else "lz4" if packed else "")
        metas.append(meta)
        payloads.append(wire)
    fields: dict[str, Any] = {"kind": int(kind), "seq": seq, "version": version, "tensors": metas}
    if samples:
        fields["samples"] = list(samples)
    header = msgpack.packb(fields, use_bin_type=True)
    return b"".join([_PREFIX.pack(MAGIC, len(header)), header, *payloads])


def _lz4_bound(n: int) -> int:
    """Largest lz4 block that `n` bytes can compress to (LZ4_COMPRESSBOUND)."""
    return n + n // 255 + 16


def _maybe_lz4(payload: bytes, min_ratio: float) -> bytes | None:
    """The lz4 block of `payload` if it is at least `min_ratio` times smaller, else None."""
    if min_ratio <= 0 or len(payload) < LZ4_MIN_BYTES:
        return None
    packed: bytes = lz4.block.compress(payload, store_size=False)
    return packed if len(payload) >= min_ratio * len(packed) else None


def _maybe_deflate(payload: bytes) -> bytes | None:
    """The raw deflate stream of `payload` if it is at least DEFLATE_MIN_RATIO times smaller."""
    if len(payload) < LZ4_MIN_BYTES:
        return None
    packer = zlib.compressobj(DEFLATE_LEVEL, zlib.DEFLATED, -15)
    packed = packer.compress(payload) + packer.flush()
    return packed if len(payload) >= DEFLATE_MIN_RATIO * len(packed) else None


def _inflate(payload: memoryview, size: int, name: str) -> memoryview:
    """The `size` bytes a raw deflate stream unpacks to; FrameError for a stream that is
    corrupt, unpacks to another size (nothing past `size` is ever produced) or has bytes after
    its end."""
    if size <= 0:  # (zlib reads a limit of 0 as none; parsing never lets one through)
        raise FrameError(f"tensor {name!r}: deflate payload for an empty tensor")
    unpacker = zlib.decompressobj(-15)
    try:
        raw = unpacker.decompress(payload, size)
    except zlib.error as exc:
        raise FrameError(f"tensor {name!r}: bad deflate payload: {exc}") from None
    if len(raw) != size or not unpacker.eof or unpacker.unconsumed_tail or unpacker.unused_data:
        raise FrameError(f"tensor {name!r}: deflate payload does not unpack to {size} bytes")
    return memoryview(raw)


def _field(table: dict[Any, Any], key: str, kind: type, what: str) -> Any:
    value = table.get(key)
    # bool is an int in Python; a header that says `seq: true` is malformed, not 1.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FrameError(f"{what}: field {key!r} must be {kind.__name__}, got {value!r:.40}")
    return value


def _parse_tensor(meta: Any, index: int, limits: FrameLimits) -> TensorHeader:
    what = f"tensor {index}"
    if not isinstance(meta, dict):
        raise FrameError(f"{what}: expected a map")
    name = _field(meta, "name", str, what)
    if not 0 < len(name) <= MAX_NAME_LEN:
        raise FrameError(f"{what}: name must be 1 to {MAX_NAME_LEN} characters")
    where = f"{what} {name!r}"
    shape = _parse_shape(meta, what, where, limits)
    dtype = _parse_dtype(meta, what, where)
    codec = _parse_codec(meta, what, where)
    nbytes = _field(meta, "nbytes", int, what)
    # prod() of validated dims cannot overflow Python ints; compare before any allocation.
    if prod(shape) * dtype.itemsize > limits.max_message_bytes:
        raise FrameError(f"{where}: shape {shape} is larger than the message limit")
    params = _params(meta.get("params", {}), where)
    packed, deflated = _parse_packing(meta, where)
    expected = codec.payload_nbytes(shape, dtype, params)
    if expected > limits.max_message_bytes:
        raise FrameError(f"{where}: payload of {expected} bytes exceeds the message limit")
    _check_nbytes(meta, where, nbytes, expected, packed, deflated)
    return TensorHeader(
        name=name,
        shape=tuple(shape),
        dtype=dtype,
        codec=codec,
        params=params,
        raw_nbytes=expected,
        lz4=packed,
        nbytes=nbytes,
        deflate=deflated,
    )


def _parse_shape(meta: dict[Any, Any], what: str, where: str, limits: FrameLimits) -> list[int]:
    """The tensor's shape: at most `max_ndim` dimensions, each 1 .. the message limit."""
    shape: list[Any] = _field(meta, "shape", list, what)
    if len(shape) > limits.max_ndim:
        raise FrameError(f"{where}: {len(shape)} dimensions, at most {limits.max_ndim}")
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 < d <= limits.max_message_bytes:
            raise FrameError(f"{where}: bad dimension {d!r:.40} in shape")
    return shape


def _parse_dtype(meta: dict[Any, Any], what: str, where: str) -> torch.dtype:
    """The tensor's dtype, one of WIRE_DTYPES."""
    dtype_str = _field(meta, "dtype", str, what)
    dtype = WIRE_DTYPES.get(dtype_str)
    if dtype is None:
        raise FrameError(
            f"{where}: unknown dtype {dtype_str!r:.40}; known: {', '.join(WIRE_DTYPES)}"
        )
    return dtype


def _parse_codec(meta: dict[Any, Any], what: str, where: str) -> Codec:
    """The tensor's codec, one of CODECS."""
    codec_name = _field(meta, "codec", str, what)
    codec = CODECS.get(codec_name)
    if codec is None:
        raise FrameError(f"{where}: unknown codec {codec_name!r:.40}")
    return codec


def _parse_packing(meta: dict[Any, Any], where: str) -> tuple[bool, bool]:
    """(lz4, deflate): how the payload is packed on the wire (at most one of them)."""
    packed = meta.get("lz4", False)
    if not isinstance(packed, bool):
        raise FrameError(f"{where}: field 'lz4' must be bool")
    deflated = meta.get("deflate", False)
    if not isinstance(deflated, bool):
        raise FrameError(f"{where}: field 'deflate' must be bool")
    if packed and deflated:
        raise FrameError(f"{where}: a payload is packed with lz4 or deflate, not both")
    return packed, deflated


def _check_nbytes(
    meta: dict[Any, Any], where: str, nbytes: int, expected: int, packed: bool, deflated: bool
) -> None:
    """FrameError unless `nbytes` on the wire fits a codec payload of `expected` bytes packed
    as said (`meta`'s dtype and codec are valid names by now)."""
    if deflated:  # a sender keeps deflate only when it shrinks the payload
        if not 0 < nbytes < expected:
            raise FrameError(f"{where}: deflate payload of {nbytes} bytes for {expected}")
    elif packed:
        if not 0 < nbytes <= _lz4_bound(expected):
            raise FrameError(f"{where}: lz4 payload of {nbytes} bytes for {expected}")
    elif nbytes != expected:
        raise FrameError(
            f"{where}: nbytes {nbytes} does not match {expected} for shape {meta['shape']} "
            f"{meta['dtype']} with codec {meta['codec']}"
        )


def _params(value: Any, what: str) -> dict[str, int]:
    if not isinstance(value, dict) or len(value) > MAX_PARAMS:
        raise FrameError(f"{what}: 'params' must be a map of at most {MAX_PARAMS} entries")
    for key, item in value.items():
        if not (isinstance(key, str) and len(key) <= 16) or type(item) is not int:
            raise FrameError(f"{what}: params must map short names to integers")
    return dict(value)


def parse_frame(message: bytes, limits: FrameLimits) -> Frame:
    """Parse and structurally validate one received message; raises FrameError saying why not."""
    header, header_end = _read_header(message, limits)
    kind, seq, version, samples = _parse_fields(header, limits)
    metas = _field(header, "tensors", list, "header")
    if not 0 < len(metas) <= limits.max_tensors:
        raise FrameError(f"header: {len(metas)} tensors, expected 1 to {limits.max_tensors}")
    headers = tuple(_parse_tensor(m, i, limits) for i, m in enumerate(metas))
    # Decoding works in float32 and returns every tensor: bound what the whole frame may cost.
    decoded = sum(prod(h.shape) * max(4, h.dtype.itemsize) + h.raw_nbytes for h in headers)
    if decoded > limits.max_message_bytes:
        raise FrameError(
            f"decoding would take {decoded} bytes, more than the limit of "
            f"{limits.max_message_bytes}"
        )
    return Frame(
        kind=kind,
        seq=seq,
        version=version,
        headers=headers,
        payloads=_split_payloads(memoryview(message)[header_end:], headers),
        samples=samples,
    )


def _read_header(message: bytes, limits: FrameLimits) -> tuple[dict[Any, Any], int]:
    """The message's header map and where it ends; the message's size, prefix and header
    length are checked before anything is unpacked."""
    if len(message) > limits.max_message_bytes:
        raise FrameError(
            f"message of {len(message)} bytes exceeds the limit of {limits.max_message_bytes}"
        )
    if len(message) < _PREFIX.size:
        raise FrameError(f"message of {len(message)} bytes is too short to be a frame")
    magic, header_len = _PREFIX.unpack_from(message)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}; not a ravnest frame")
    if header_len > limits.max_header_bytes:
        raise FrameError(
            f"header of {header_len} bytes exceeds the limit of {limits.max_header_bytes}"
        )
    header_end = _PREFIX.size + header_len
    if header_end > len(message):
        raise FrameError("header runs past the end of the message")
    try:
        header = msgpack.unpackb(
            message[_PREFIX.size : header_end],
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_header_bytes,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=max(limits.max_tensors, limits.max_ndim, limits.max_samples),
            max_map_len=8,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise FrameError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError("header must be a map")
    return header, header_end


def _parse_fields(
    header: dict[Any, Any], limits: FrameLimits
) -> tuple[FrameKind, int, int, tuple[int, ...]]:
    """The header's kind, seq, version and sample ids."""
    kind_value = _field(header, "kind", int, "header")
    try:
        kind = FrameKind(kind_value)
    except ValueError:
        raise FrameError(f"header: unknown frame kind {kind_value}") from None
    seq = _field(header, "seq", int, "header")
    version = _field(header, "version", int, "header")
    if seq < 0 or version < 0:
        raise FrameError("header: seq and version must not be negative")
    samples = header.get("samples", [])
    if not isinstance(samples, list) or len(samples) > limits.max_samples:
        raise FrameError(f"header: 'samples' must be a list of at most {limits.max_samples} ids")
    for sample in samples:
        if type(sample) is not int or sample < 0:
            raise FrameError(f"header: sample id {sample!r:.40} is not a non-negative int")
    return kind, seq, version, tuple(samples)


def _split_payloads(body: memoryview, headers: tuple[TensorHeader, ...]) -> tuple[memoryview, ...]:
    """Each tensor's payload, a view into `body`; FrameError unless their sizes add up to it."""
    if sum(h.nbytes for h in headers) != len(body):
        raise FrameError(
            f"payload is {len(body)} bytes, the header lists {sum(h.nbytes for h in headers)}"
        )
    payloads = []
    offset = 0
    for h in headers:
        payloads.append(body[offset : offset + h.nbytes])
        offset += h.nbytes
    return tuple(payloads)


@dataclass(frozen=True, slots=True)
class Expected:
    """One tensor a frame of some kind must carry, as the plan says."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def check_tensors(frame: Frame, expected: Sequence[Expected]) -> None:
    """Raise FrameError unless the frame carries exactly the expected tensors, in order."""
    got = [h.name for h in frame.headers]
    want = [e.name for e in expected]
    if got != want:
        raise FrameError(f"{frame.kind.name.lower()} frame carries tensors {got}, expected {want}")
    for h, e in zip(frame.headers, expected, strict=True):
        if h.shape != e.shape:
            raise FrameError(
                f"tensor {h.name!r}: shape {list(h.shape)} does not match "
                f"the plan's {list(e.shape)}"
            )
        if h.dtype != e.dtype:
            raise FrameError(
                f"tensor {h.name!r}: dtype {dtype_name(h.dtype)} does not match the plan's "
                f"{dtype_name(e.dtype)}"
            )
