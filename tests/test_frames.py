"""Tensor frames: round trips, and every malformed input refused before allocation."""

from __future__ import annotations

import contextlib
import struct
import zlib

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ravnest_node.compression import ACTIVATION_ONLY, CODECS, SampleReferences, get_codec
from ravnest_node.errors import FrameError
from ravnest_node.transport.frames import (
    MAGIC,
    Expected,
    Frame,
    FrameKind,
    FrameLimits,
    Outgoing,
    check_tensors,
    encode_frame,
    parse_frame,
)

LIMITS = FrameLimits(max_message_bytes=1 << 20)


def _raw_frame(header: object, payload: bytes = b"") -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return MAGIC + struct.pack("<I", len(packed)) + packed + payload


def _header(**tensor: object) -> dict[str, object]:
    meta = {"name": "hidden", "shape": [2, 3], "dtype": "float32", "codec": "none", "nbytes": 24}
    meta.update(tensor)
    return {"kind": 1, "seq": 0, "version": 0, "tensors": [meta]}


# Worst-case error of one round trip, relative to the largest |x| (see docs/compression.md).
BOUNDS = {"none": 0.0, "fp16": 1e-3, "bf16": 1e-2, "int8-block": 1 / 254, "int4-block": 1 / 14}
BOUNDS |= {"aq-delta": 0.0, "aq-delta2": 0.0}  # a sample's first visit travels uncompressed
BOUNDS |= {"klt": 0.25 * 1.01}  # a stream's first frames: half a step of 0.5 x the row's rms


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_round_trip_every_codec(codec: str) -> None:
    x = torch.randn(4, 8, 16)
    y = torch.randint(0, 256, (4, 8), dtype=torch.uint8)
    c = get_codec(codec)
    samples = [5, 1, 2, 9] if codec in ACTIVATION_ONLY else []
    message = encode_frame(
        FrameKind.FORWARD, 7, 1,
        [Outgoing("hidden", x, c, c.new_state()), Outgoing("targets", y, c)], samples=samples,
    )  # fmt: skip
    frame = parse_frame(message, LIMITS)
    assert (frame.kind, frame.seq, frame.version) == (FrameKind.FORWARD, 7, 1)
    assert frame.samples == tuple(samples)
    out, commit = frame.decode_with({"hidden": SampleReferences(limit=10)})
    commit()
    assert torch.equal(out["targets"], y)  # integers always travel losslessly
    assert out["hidden"].dtype == torch.float32 and out["hidden"].shape == x.shape
    if codec in BOUNDS:
        error = (out["hidden"] - x).abs().max()
        assert error <= BOUNDS[codec] * x.abs().max() * (1 + 1e-5)
    else:  # top-k: the k largest entries arrive exactly, the rest as zeros
        kept = out["hidden"] != 0
        assert 0 < int(kept.sum()) < x.numel() // 10
        assert torch.equal(out["hidden"][kept], x[kept])


def test_lz4_is_used_only_when_it_pays() -> None:
    none = get_codec("none")
    zeros = parse_frame(
        encode_frame(FrameKind.BACKWARD, 0, 0, [("grad", torch.zeros(64, 64), none)]), LIMITS
    )
    noise = parse_frame(
        encode_frame(FrameKind.BACKWARD, 0, 0, [("grad", torch.randn(64, 64), none)]), LIMITS
    )
    assert zeros.headers[0].lz4 and zeros.nbytes < 64 * 64 * 4 / 10
    assert torch.equal(zeros.decode()["grad"], torch.zeros(64, 64))
    assert not noise.headers[0].lz4 and noise.nbytes == 64 * 64 * 4  # fp32 noise: ~1.0x


def test_hostile_lz4_payload_is_refused() -> None:
    header = _header(lz4=True, nbytes=24)
    frame = parse_frame(_raw_frame(header, b"\xff" * 24), LIMITS)
    with pytest.raises(FrameError, match="lz4"):
        frame.decode()
    with pytest.raises(FrameError, match="lz4 payload of 99999"):
        parse_frame(_raw_frame(_header(lz4=True, nbytes=99999), b"\0" * 99999), LIMITS)


def test_deflate_packs_quantised_codes_where_asked_and_when_it_pays() -> None:
    """int4 codes of a bell-shaped tensor carry about 3.5 bits of entropy: deflate (asked for)
    shrinks them where lz4 does not, and they decode to exactly what they would unpacked."""
    int4 = get_codec("int4-block")
    x = torch.randn(4, 128, 64, generator=torch.Generator().manual_seed(0))

    def sent(deflate: bool, data: torch.Tensor = x, codec: str = "int4-block") -> Frame:
        out = Outgoing("hidden", data, get_codec(codec), deflate=deflate)
        return parse_frame(encode_frame(FrameKind.FORWARD, 0, 0, [out]), LIMITS)

    plain, packed = sent(False), sent(True)
    assert not plain.headers[0].lz4 and not plain.headers[0].deflate  # lz4: no gain
    assert packed.headers[0].deflate and not packed.headers[0].lz4
    assert plain.nbytes == int4.payload_nbytes(x.shape, x.dtype, {"bits": 4, "block": 64})
    assert packed.nbytes < plain.nbytes / 1.05
    assert torch.equal(packed.decode()["hidden"], plain.decode()["hidden"])
    # Bytes with no structure do not shrink: sent as they are. `lz4_min_ratio` 0 packs nothing.
    noise = torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=torch.Generator())
    assert not sent(True, noise, "none").headers[0].deflate
    off = encode_frame(FrameKind.FORWARD, 0, 0, [Outgoing("hidden", x, int4, deflate=True)],
                       lz4_min_ratio=0)  # fmt: skip
    assert not parse_frame(off, LIMITS).headers[0].deflate


def _deflated(data: bytes) -> bytes:
    packer = zlib.compressobj(1, zlib.DEFLATED, -15)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xff" * 20, "bad deflate payload"),  # not a deflate stream
        (_deflated(b"\0" * 23), "does not unpack to 24"),  # too short
        (_deflated(b"\0" * 25), "does not unpack to 24"),  # too long: stops at 24
        (_deflated(b"\0" * 24) + b"\0", "does not unpack to 24"),  # bytes after the end
        (_deflated(b"\0" * 24)[:-1], "does not unpack to 24"),  # cut short
    ],
)
def test_hostile_deflate_payload_is_refused(payload: bytes, reason: str) -> None:
    frame = parse_frame(_raw_frame(_header(deflate=True, nbytes=len(payload)), payload), LIMITS)
    with pytest.raises(FrameError, match=reason):
        frame.decode()


def test_a_deflate_bomb_unpacks_no_further_than_the_header_allows() -> None:
    """A 64 KiB stream that would unpack to 64 MiB (deflate's limit is about 1000:1), sent as a
    1 MiB tensor: unpacking stops at the 1 MiB the header's shape allows; the frame is refused."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    bomb = b"".join(packer.compress(b"\0" * (1 << 20)) for _ in range(64)) + packer.flush()
    assert len(bomb) < 128 << 10
    meta = _header(shape=[1 << 18], nbytes=len(bomb), deflate=True)  # 1 MiB of float32
    frame = parse_frame(_raw_frame(meta, bomb), FrameLimits(max_message_bytes=8 << 20))
    with pytest.raises(FrameError, match="does not unpack to 1048576"):
        frame.decode()


def test_payload_size_is_counted_exactly() -> None:
    x = torch.zeros(2, 3)
    message = encode_frame(FrameKind.BACKWARD, 0, 0, [("grad", x, get_codec("fp16"))])
    assert parse_frame(message, LIMITS).nbytes == 2 * 3 * 2


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (b"RV", "too short"),
        (b"XXXX" + struct.pack("<I", 0), "bad magic"),
        (MAGIC + struct.pack("<I", 10_000), "header of 10000 bytes exceeds"),
        (MAGIC + struct.pack("<I", 50) + b"\x00" * 10, "runs past the end"),
        (MAGIC + struct.pack("<I", 1) + b"\xc1", "not valid msgpack"),
        (_raw_frame([1, 2]), "must be a map"),
        (_raw_frame({**_header(), "kind": 9}), "unknown frame kind"),
        (_raw_frame({**_header(), "seq": True}), "'seq' must be int"),
        (_raw_frame({**_header(), "seq": -1}), "must not be negative"),
        (_raw_frame({**_header(), "tensors": []}), "0 tensors"),
        (_raw_frame(_header(dtype="complex128"), b"\0" * 24), "unknown dtype 'complex128'"),
        (_raw_frame(_header(codec="pickle"), b"\0" * 24), "unknown codec 'pickle'"),
        (_raw_frame(_header(shape=[2, -3]), b"\0" * 24), "bad dimension"),
        (_raw_frame(_header(shape=[1] * 9), b"\0" * 4), "9 dimensions, at most 8"),
        (_raw_frame({**_header(), "samples": [0] * 513}, b"\0" * 24), "exceeds max_array_len"),
        (_raw_frame({**_header(), "samples": 3}, b"\0" * 24), "'samples' must be a list"),
        (_raw_frame({**_header(), "samples": [1, -1]}, b"\0" * 24), "sample id -1"),
        (_raw_frame({**_header(), "samples": [1.5]}, b"\0" * 24), "sample id 1.5"),
        (_raw_frame(_header(shape=[1 << 20, 1 << 20], nbytes=4 << 40)), "larger than the message"),
        (_raw_frame(_header(nbytes=25), b"\0" * 25), "nbytes 25 does not match 24"),
        (_raw_frame(_header(), b"\0" * 23), "payload is 23 bytes"),
        (_raw_frame(_header(name=7), b"\0" * 24), "'name' must be str"),
        (_raw_frame(_header(params={"block": 64}), b"\0" * 24), "takes no params"),
        (_raw_frame(_header(params={"a": True}), b"\0" * 24), "params must map"),
        (_raw_frame(_header(lz4=1), b"\0" * 24), "'lz4' must be bool"),
        (_raw_frame(_header(deflate=1, nbytes=20), b"\0" * 20), "'deflate' must be bool"),
        (_raw_frame(_header(deflate=True, lz4=True, nbytes=20), b"\0" * 20), "not both"),
        (_raw_frame(_header(deflate=True), b"\0" * 24), "deflate payload of 24 bytes for 24"),
        (
            _raw_frame(_header(codec="int8-block", params={"bits": 8, "block": 1 << 40}), b""),
            "block",
        ),
    ],
)
def test_malformed_frames_are_refused(message: bytes, reason: str) -> None:
    with pytest.raises(FrameError, match=reason):
        parse_frame(message, LIMITS)


def test_oversized_message_is_refused_before_parsing() -> None:
    with pytest.raises(FrameError, match="exceeds the limit"):
        parse_frame(b"\0" * (LIMITS.max_message_bytes + 1), LIMITS)


def test_check_tensors_against_the_plan() -> None:
    x = torch.zeros(2, 3)
    frame = parse_frame(
        encode_frame(FrameKind.FORWARD, 0, 0, [("hidden", x, get_codec("none"))]), LIMITS
    )
    check_tensors(frame, [Expected("hidden", (2, 3), torch.float32)])
    with pytest.raises(FrameError, match=r"shape \[2, 3\] does not match the plan's \[2, 4\]"):
        check_tensors(frame, [Expected("hidden", (2, 4), torch.float32)])
    with pytest.raises(FrameError, match="dtype float32 does not match the plan's float16"):
        check_tensors(frame, [Expected("hidden", (2, 3), torch.float16)])
    with pytest.raises(FrameError, match="expected"):
        check_tensors(frame, [Expected("grad", (2, 3), torch.float32)])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_the_parser(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        parse_frame(data, LIMITS)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_frames_are_parsed_or_refused(data: st.DataObject) -> None:
    good = bytearray(
        encode_frame(FrameKind.FORWARD, 3, 0, [("hidden", torch.randn(2, 5), get_codec("none"))])
    )
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(good)))
    try:
        frame = parse_frame(bytes(good[:cut]), LIMITS)
    except FrameError:
        return
    frame.decode()  # whatever passed the checks must decode without error
