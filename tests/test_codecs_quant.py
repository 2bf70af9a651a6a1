"""Blockwise quantisation (int8-block, int4-block) and top-k with error feedback (topk-ef)."""

from __future__ import annotations

import contextlib
import math
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ravnest_node.compression.codecs import Codec, get_codec
from ravnest_node.compression.quant import BlockQuant, int4_block, int8_block
from ravnest_node.compression.sparse import TopK
from ravnest_node.compression.transform import KLT_ACTIVATION
from ravnest_node.errors import ConfigError, FrameError

QUANTS = [
    int8_block(),
    int8_block(stochastic=True),
    int4_block(),
    int4_block(stochastic=True),
    BlockQuant("int2", 2, 64),  # the ternary codes inside aq-delta2
]
QUANT_IDS = [f"{c.name}{'-sr' if c.stochastic else ''}" for c in QUANTS]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def tensors(draw: st.DrawFn, max_numel: int = 3000) -> torch.Tensor:
    """Float tensors of 0-3 dims: random magnitudes (tiny to 1e30), some all-zero stretches."""
    ndim = draw(st.integers(0, 3))
    shape: list[int] = []
    budget = max_numel
    for _ in range(ndim):
        dim = draw(st.integers(0 if not shape else 1, max(1, min(budget, 200))))
        shape.append(dim)
        budget = max(1, budget // max(dim, 1))
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 10.0 ** draw(st.integers(-20, 30))
    if draw(st.booleans()) and x.numel():
        cut = draw(st.integers(0, x.numel()))
        x.view(-1)[:cut] = 0.0
    if draw(st.booleans()) and x.numel():  # one outlier
        x.view(-1)[seed % x.numel()] *= 1000.0
    return x


def block_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element scale (max |x| of the element's block) of flat float32 x."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block)
    padded[:n] = flat.abs()
    return padded.view(nb, block).amax(dim=1).repeat_interleave(block)[:n]


def roundtrip(codec: Any, x: torch.Tensor, state: object | None = None) -> torch.Tensor:
    params, payload = codec.encode(x, state)
    assert len(params) <= 6 and all(type(v) is int for v in params.values())
    assert codec.payload_nbytes(x.shape, x.dtype, params) == len(payload)
    wire = msgpack.unpackb(msgpack.packb(params))  # params travel in the frame header
    assert wire == params
    out: torch.Tensor = codec.decode(memoryview(payload), x.shape, x.dtype, wire)
    assert out.shape == x.shape and out.dtype == x.dtype
    return out


# ---- round trip within the documented bound ----


@pytest.mark.parametrize("codec", QUANTS, ids=QUANT_IDS)
@given(x=tensors(), block=st.sampled_from([16, 17, 64, 256]))
@settings(max_examples=60, deadline=None)
def test_blockquant_error_within_bound(codec: BlockQuant, x: torch.Tensor, block: int) -> None:
    c = BlockQuant(codec.name, codec.bits, block, codec.stochastic)
    out = roundtrip(c, x, c.new_state())
    s = block_scales(x, block)
    # s / (2L) round to nearest, < s / L stochastic; float32 arithmetic adds a few ulps of s.
    bound = s / c.levels * (1.0 if c.stochastic else 0.5) + s * 1e-6
    err = (out.reshape(-1) - x.reshape(-1)).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert bool((out.reshape(-1)[s == 0] == 0).all())  # zero blocks decode to zeros


@pytest.mark.parametrize("codec", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_blockquant_half_inputs(codec: BlockQuant, dtype: torch.dtype) -> None:
    x = (torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 50).to(dtype)
    out = roundtrip(codec, x, codec.new_state())
    s = block_scales(x, codec.block)
    rel = torch.finfo(dtype).eps  # the decoded value is rounded to `dtype` once more
    bound = s / codec.levels + out.float().abs() * rel + s * 1e-6
    assert bool(((out.float() - x.float()).abs() <= bound).all())


@pytest.mark.parametrize("codec", [c for c in QUANTS if c.stochastic], ids=["int8-sr", "int4-sr"])
def test_stochastic_rounding_is_unbiased(codec: BlockQuant) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, codec.block, generator=gen) * torch.tensor([[1.0], [1e-3], [1e4], [7.0]])
    state = codec.new_state()
    runs = 2000
    total = torch.zeros_like(x)
    for _ in range(runs):
        total += roundtrip(codec, x, state)
    mean = total / runs
    step = block_scales(x, codec.block).view_as(x) / codec.levels
    # each decode errs by < step with variance <= step^2 / 4: 6 sigma of the mean of `runs`
    assert bool(((mean - x).abs() <= 6 * step / (2 * math.sqrt(runs))).all())
    # round to nearest is biased on the same input (so the check above has teeth)
    nearest = BlockQuant(codec.name, codec.bits, codec.block)
    bias = (roundtrip(nearest, x) - x).abs() / step
    assert float(bias.max()) > 0.3


@given(x=tensors(), fraction=st.floats(0.001, 1.0))
@settings(max_examples=60, deadline=None)
def test_topk_sends_largest_exactly(x: torch.Tensor, fraction: float) -> None:
    assume(x.numel() > 0)
    codec = TopK(fraction=fraction)
    state = codec.new_state()
    out = roundtrip(codec, x, state).reshape(-1)
    flat = x.reshape(-1)
    k = max(1, math.ceil(fraction * flat.numel()))
    sent = out != 0
    assert int(sent.sum()) <= k
    assert bool((out[sent] == flat[sent]).all())  # float32 values: sent entries are exact
    unsent = flat[~sent].abs()
    if int(sent.sum()) > 0 and unsent.numel():
        assert float(unsent.max()) <= float(flat[sent].abs().min())
    assert state.residual is not None
    assert torch.equal(state.residual + out, flat)  # v = x - D(C(x)) after one step


# ---- error feedback: the accumulated error stays bounded ----


def accumulated_error(codec: Any, x: torch.Tensor, steps: int) -> float:
    state = codec.new_state()
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for _ in range(steps):
        params, payload = codec.encode(x, state)
        total += codec.decode(memoryview(payload), x.shape, x.dtype, params).double().view(-1)
    return float((total - steps * x.double().view(-1)).abs().max())


def test_int4_error_feedback_keeps_the_sum() -> None:
    x = torch.linspace(-1.0, 1.0, 1000) ** 3  # many values between quantisation levels
    # The accumulated error is the residual e = p - D(C(p)), p = x + e, s <= max|x| + max|e|:
    # |e| <= (1 + |e|) / (2L) gives |e| <= 1/13 (nearest); |e| < (1 + |e|) / L gives 1/6.
    for stochastic, bound in ((False, 1 / 13), (True, 1 / 6)):
        codec = int4_block(stochastic=stochastic, error_feedback=True)
        errors = [accumulated_error(codec, x, n) for n in (10, 100, 400)]
        assert max(errors) <= bound * (1 + 1e-5), (stochastic, errors)
    # without feedback a constant signal's error grows linearly
    assert accumulated_error(int4_block(), x, 400) > 100 / 13


def test_topk_error_feedback_keeps_the_sum() -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.rand(1000, generator=gen) + 0.5) * torch.sign(torch.randn(1000, generator=gen))
    codec = TopK(fraction=0.01)
    # every element waits at most ~ numel / k steps, so |residual| <= ~ (numel / k) * max|x|
    bound = 2 * (1000 / 10) * float(x.abs().max())
    errors = [accumulated_error(codec, x, n) for n in (50, 500, 2000)]
    assert max(errors) <= bound, errors
    assert errors[-1] / 2000 < 0.1  # mean error per step -> 0


def test_codecs_fit_the_codec_interface() -> None:
    codecs: list[Codec] = [int8_block(), int4_block(256, stochastic=True), TopK()]  # mypy checks
    assert [c.name for c in codecs] == ["int8-block", "int4-block", "topk-ef"]
    assert all(c.applies_to(torch.bfloat16) and not c.applies_to(torch.int64) for c in codecs)


def test_state_checks() -> None:
    x = torch.ones(100)
    with pytest.raises(TypeError):
        int8_block(error_feedback=True).encode(x, None)
    with pytest.raises(TypeError):
        int8_block(error_feedback=True).encode(x, object())
    with pytest.raises(TypeError):
        TopK().encode(x, None)
    for codec in (int8_block(error_feedback=True), TopK()):
        state = codec.new_state()
        codec.encode(x, state)
        with pytest.raises(ValueError):
            codec.encode(torch.ones(101), state)
        with pytest.raises(ValueError):
            codec.encode(torch.full((100,), math.nan), codec.new_state())
    assert int8_block().new_state() is None
    with pytest.raises(TypeError):
        int8_block().encode(torch.ones(3, dtype=torch.int64), None)


def test_config_checks() -> None:
    with pytest.raises(ConfigError):
        BlockQuant("int8-block", 5)
    with pytest.raises(ConfigError):
        int8_block(8)
    with pytest.raises(ConfigError):
        int4_block(1 << 17)
    for fraction in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ConfigError):
            TopK(fraction=fraction)


def test_names_params_and_sizes() -> None:
    x = torch.randn(1000)
    for codec, block, nbytes in (
        (int8_block(64), 64, 16 * 4 + 1024),
        (int8_block(256), 256, 4 * 4 + 1024),
        (int4_block(64), 64, 16 * 4 + 512),
        (int4_block(256), 256, 4 * 4 + 512),
    ):
        params, payload = codec.encode(x, None)
        assert params == {"bits": codec.bits, "block": block}
        assert len(payload) == nbytes
    assert int8_block(stochastic=True, error_feedback=True).name == "int8-block"
    assert int4_block().name == "int4-block"
    assert int8_block(64).bits_per_element == 8.5
    assert int4_block(256).bits_per_element == 4.125
    params, payload = TopK().encode(torch.randn(1000), TopK().new_state())
    assert params == {"k": 10, "index_bytes": 2} and len(payload) == 60
    big = torch.zeros(200_000)
    big[[0, 150_000]] = 1.0
    params, payload = TopK(fraction=1e-5).encode(big, TopK().new_state())
    assert params == {"k": 2, "index_bytes": 4} and len(payload) == 16
    out = TopK().decode(memoryview(payload), big.shape, big.dtype, params)
    assert torch.equal(out, big)


def test_empty_tensor_quantises() -> None:
    for codec in QUANTS:
        x = torch.zeros(0, 3)
        assert roundtrip(codec, x, codec.new_state()).shape == (0, 3)


# ---- hostile input: FrameError and nothing else ----

ALL = [*QUANTS, TopK(), KLT_ACTIVATION]
ALL_IDS = [*QUANT_IDS, "topk-ef", "klt"]
HOSTILE_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 4, 8, 15, 16, 64, 65536, 65537, 2**31, 2**40, -1]),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
    st.binary(max_size=3),
)


def expect_frame_error_or_tensor(codec: Any, payload: bytes, shape: Any, params: Any) -> None:
    try:
        out = codec.decode(memoryview(payload), shape, torch.float32, params)
    except FrameError:
        return
    assert out.shape == tuple(shape) and out.dtype == torch.float32
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("codec", ALL, ids=ALL_IDS)
@given(
    params=st.dictionaries(
        st.sampled_from(["bits", "block", "k", "index_bytes", "x", ""]), HOSTILE_VALUES, max_size=6
    ),
    shape=st.lists(st.integers(0, 300), max_size=3),
    payload=st.binary(max_size=2000),
)
@FUZZ
def test_hostile_params_and_bytes(
    codec: Any, params: Mapping[str, Any], shape: list[int], payload: bytes
) -> None:
    with contextlib.suppress(FrameError):
        codec.payload_nbytes(shape, torch.float32, params)
    expect_frame_error_or_tensor(codec, payload, shape, params)


@pytest.mark.parametrize("codec", ALL, ids=ALL_IDS)
@given(x=tensors(max_numel=500), data=st.data())
@FUZZ
def test_mutated_payloads(codec: Any, x: torch.Tensor, data: st.DataObject) -> None:
    assume(x.numel() > 0)
    params, payload = codec.encode(x.float(), codec.new_state())
    buf = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 8))):
        buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):  # truncate or extend
        cut = data.draw(st.integers(0, len(buf) + 8))
        buf = (buf + bytes(8))[:cut]
    expect_frame_error_or_tensor(codec, bytes(buf), x.shape, params)
    # the same payload under random shapes and neighbouring params
    shape = data.draw(st.lists(st.integers(0, 600), max_size=3))
    key = data.draw(st.sampled_from(sorted(params)))
    bent = {**params, key: params[key] + data.draw(st.integers(-3, 3))}
    expect_frame_error_or_tensor(codec, bytes(buf), shape, bent)


@pytest.mark.parametrize(
    ("codec", "params"),
    [
        (int8_block(), {"bits": 8, "block": 2**40}),
        (int8_block(), {"bits": 8, "block": 15}),
        (int8_block(), {"bits": 8, "block": -64}),
        (int8_block(), {"bits": 8, "block": True}),
        (int8_block(), {"bits": 8, "block": 64.0}),
        (int8_block(), {"bits": 4, "block": 64}),
        (int4_block(), {"bits": 8, "block": 64}),
        (int8_block(), {"block": 64}),
        (int8_block(), {"bits": 8, "block": 64, "extra": 1}),
        (TopK(), {"k": 1001, "index_bytes": 2}),
        (TopK(), {"k": 0, "index_bytes": 2}),
        (TopK(), {"k": -1, "index_bytes": 4}),
        (TopK(), {"k": True, "index_bytes": 2}),
        (TopK(), {"k": 2**40, "index_bytes": 4}),
        (TopK(), {"k": 10, "index_bytes": 3}),
        (TopK(), {"k": 10}),
    ],
)
def test_hostile_params_are_refused_before_allocation(codec: Any, params: dict[str, Any]) -> None:
    with pytest.raises(FrameError):
        codec.payload_nbytes((1000,), torch.float32, params)
    with pytest.raises(FrameError):
        codec.decode(memoryview(bytes(64)), (1000,), torch.float32, params)


@pytest.mark.parametrize("codec", ALL, ids=ALL_IDS)
def test_huge_shape_with_small_payload_is_refused(codec: Any) -> None:
    params, payload = codec.encode(torch.randn(100), codec.new_state())
    if isinstance(codec, BlockQuant):  # would be a 4 TiB tensor: refused on size, nothing allocated
        with pytest.raises(FrameError):
            codec.decode(memoryview(payload), (2**40,), torch.float32, params)
    # (topk-ef's payload size does not depend on the shape: its dense output is bounded by the
    # frame layer, which refuses a shape larger than the message limit before any codec runs)
    with pytest.raises(FrameError):
        codec.decode(memoryview(payload), (100,), torch.int64, params)
    with pytest.raises(FrameError):
        codec.decode(memoryview(payload), (-100,), torch.float32, params)


def _quant_payload(codec: BlockQuant, x: torch.Tensor) -> tuple[dict[str, int], bytearray]:
    params, payload = codec.encode(x, None)
    return params, bytearray(payload)


@pytest.mark.parametrize("bad_scale", [math.nan, math.inf, -1.0])
def test_bad_scales_are_refused(bad_scale: float) -> None:
    for codec in (int8_block(), int4_block()):
        params, buf = _quant_payload(codec, torch.randn(100))
        buf[4:8] = struct.pack("<f", bad_scale)
        with pytest.raises(FrameError, match="scale"):
            codec.decode(memoryview(buf), (100,), torch.float32, params)


def test_out_of_range_codes_and_padding_are_refused() -> None:
    codec8, codec4 = int8_block(), int4_block()
    params, buf = _quant_payload(codec8, torch.randn(100))  # 2 blocks: 8 scale bytes, 128 codes
    buf[8 + 5] = 0x80  # -128
    with pytest.raises(FrameError, match="code"):
        codec8.decode(memoryview(buf), (100,), torch.float32, params)
    params, buf = _quant_payload(codec8, torch.randn(100))
    buf[8 + 110] = 1  # a code in the padding
    with pytest.raises(FrameError, match="padding"):
        codec8.decode(memoryview(buf), (100,), torch.float32, params)
    params, buf = _quant_payload(codec4, torch.randn(100))
    buf[8 + 3] = 0x18  # high nibble 1 is fine, low nibble 8 is -8
    with pytest.raises(FrameError, match="code"):
        codec4.decode(memoryview(buf), (100,), torch.float32, params)
    params, buf = _quant_payload(codec4, torch.randn(100))
    buf[8 + 60] = 0x10  # codes 120, 121 are padding
    with pytest.raises(FrameError, match="padding"):
        codec4.decode(memoryview(buf), (100,), torch.float32, params)
    # odd padded length: the high nibble of the last byte is padding too
    c17 = BlockQuant("int4-block", 4, 17)
    params, buf = _quant_payload(c17, torch.randn(17))
    assert len(buf) == 4 + 9
    buf[-1] |= 0x30
    with pytest.raises(FrameError, match="padding"):
        c17.decode(memoryview(buf), (17,), torch.float32, params)
    # 2-bit: four codes a byte, 0b10 (-2) is outside -1..1
    c2 = BlockQuant("int2", 2, 64)
    params, buf = _quant_payload(c2, torch.randn(100))  # 2 blocks: 8 scale bytes, 32 code bytes
    assert len(buf) == 8 + 32
    buf[8 + 3] = 0b0010_0001  # codes 1, 0, -2, 0
    with pytest.raises(FrameError, match="code"):
        c2.decode(memoryview(buf), (100,), torch.float32, params)
    params, buf = _quant_payload(c2, torch.randn(100))
    buf[-1] = 0b0100_0000  # codes 124..127 are padding
    with pytest.raises(FrameError, match="padding"):
        c2.decode(memoryview(buf), (100,), torch.float32, params)


def _topk_payload(values: list[float], deltas: list[int], width: int) -> bytes:
    fmt = "H" if width == 2 else "I"
    return struct.pack(f"<{len(values)}f", *values) + struct.pack(f"<{len(deltas)}{fmt}", *deltas)


@pytest.mark.parametrize(
    ("values", "deltas", "width", "match"),
    [
        ([1.0, 2.0], [3, 0], 2, "increasing"),  # repeated index
        ([1.0, 2.0], [999, 1], 2, ">= numel"),
        ([1.0], [1000], 2, ">= numel"),
        ([1.0, 2.0, 3.0], [1, 2**32 - 1, 2**32 - 1], 4, ">= numel"),  # no wrap-around
        ([1.0, math.nan], [0, 1], 4, "finite"),
        ([math.inf], [5], 2, "finite"),
    ],
)
def test_hostile_topk_payloads(
    values: list[float], deltas: list[int], width: int, match: str
) -> None:
    params = {"k": len(values), "index_bytes": width}
    with pytest.raises(FrameError, match=match):
        TopK().decode(
            memoryview(_topk_payload(values, deltas, width)), (1000,), torch.float32, params
        )


def test_overflow_of_a_half_dtype_is_refused() -> None:
    for codec in (int8_block(), TopK()):
        params, payload = codec.encode(torch.full((100,), 1e6), codec.new_state())
        with pytest.raises(FrameError, match="overflows"):
            codec.decode(memoryview(payload), (100,), torch.float16, params)


def test_topk_decodes_a_valid_handmade_payload() -> None:
    payload = _topk_payload([1.5, -2.0, 3.0], [0, 7, 992], 2)
    out = TopK().decode(memoryview(payload), (10, 100), torch.float16, {"k": 3, "index_bytes": 2})
    expected = np.zeros(1000, dtype=np.float32)
    expected[[0, 7, 999]] = [1.5, -2.0, 3.0]
    assert out.dtype == torch.float16
    assert np.array_equal(out.float().reshape(-1).numpy(), expected)


# ---- coarse codes: fewer values in an ordinary payload ----


@given(x=tensors(), codes=st.integers(1, 6), stochastic=st.booleans())
@settings(max_examples=60, deadline=None)
def test_coarse_codes_keep_their_bound_and_decode_as_plain_int4(
    x: torch.Tensor, codes: int, stochastic: bool
) -> None:
    coarse = int4_block(stochastic=stochastic, codes=codes)
    params, payload = coarse.encode(x, coarse.new_state())
    # Any int4-block decoder reads it: the wire format is the registered codec's.
    plain = get_codec("int4-block")
    assert params == {"bits": 4, "block": 64}
    out = plain.decode(memoryview(payload), x.shape, x.dtype, params)
    s = block_scales(x, 64)
    bound = s / codes * (1.0 if stochastic else 0.5) + s * 1e-6
    assert bool(((out.reshape(-1) - x.reshape(-1)).abs() <= bound).all())
    _, sent = coarse.quantise(x.reshape(-1).float(), torch.Generator().manual_seed(0))
    assert sent.numel() == 0 or int(sent.abs().max()) <= codes


def test_coarse_codes_are_unbiased_and_fall_back_where_the_scale_would_overflow() -> None:
    codec = int4_block(stochastic=True, codes=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 64, generator=gen) * torch.tensor([[1.0], [1e-4]])
    state = codec.new_state()
    mean = sum(roundtrip(codec, x, state) for _ in range(2000)) / 2000
    step = block_scales(x, 64).view_as(x) / 3
    assert bool(((mean - x).abs() <= 6 * step / (2 * math.sqrt(2000))).all())
    # s * 7 / 3 overflows float32 for this block: it keeps the 15 values and decodes right.
    huge = torch.full((64,), 3e38)
    huge[1] = -1e38
    out = roundtrip(int4_block(codes=3), huge)
    assert bool(torch.isfinite(out).all())
    assert bool(((out - huge).abs() <= 3e38 / 14 * (1 + 1e-6)).all())


def test_coarse_gradients_pack_smaller_with_deflate() -> None:
    x = torch.randn(64 * 512, generator=torch.Generator().manual_seed(5))

    def packed(codec: BlockQuant) -> int:
        return len(zlib.compress(codec.encode(x, codec.new_state())[1], 1))

    assert packed(int4_block(stochastic=True, codes=3)) < 0.9 * packed(int4_block(stochastic=True))
    with pytest.raises(ConfigError):
        int4_block(codes=8)
