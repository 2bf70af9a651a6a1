"""aq-delta: activations as quantised deltas against a per-sample reference both ends keep."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest_node.compression import CODECS, AQDelta, SampleReferences, encoder, get_codec
from ravnest_node.data import StdlibBytes
from ravnest_node.errors import ConfigError, FrameError
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.transport.frames import (
    FrameKind,
    FrameLimits,
    Outgoing,
    encode_frame,
    parse_frame,
)

from .conftest import tiny_middle_inbox

LIMITS = FrameLimits(max_message_bytes=1 << 24)
AQS = [get_codec("aq-delta"), get_codec("aq-delta2")]
AQ_IDS = ["aq-delta", "aq-delta2"]
NONE = get_codec("none")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _send(codec: Any, state: Any, refs: SampleReferences, x: torch.Tensor, ids: list[int]) -> Any:
    """One frame from sender to receiver; returns (received tensor, frame)."""
    message = encode_frame(FrameKind.FORWARD, 0, 0, [Outgoing("h", x, codec, state)], samples=ids)
    frame = parse_frame(message, LIMITS)
    tensors, commit = frame.decode_with({"h": refs})
    commit()
    return tensors["h"], frame


EPS32 = torch.finfo(torch.float32).eps


def _delta_bound(codec: AQDelta, delta: torch.Tensor) -> torch.Tensor:
    """Per-element bound s / (2L) of nearest rounding, s the block's max |delta| (flat order)."""
    flat = delta.reshape(-1)
    n, block = flat.numel(), codec.block
    nb = -(-n // block)
    padded = torch.zeros(nb * block)
    padded[:n] = flat.abs()
    levels = 7 if codec.bits == 4 else 1
    scales = padded.view(nb, block).amax(dim=1).repeat_interleave(block)[:n]
    return (scales / (2 * levels)).view(delta.shape)


@pytest.mark.parametrize("codec", AQS, ids=AQ_IDS)
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 300),
    drift=st.floats(1e-4, 2.0),
    scale=st.sampled_from([1e-6, 1.0, 1e4]),
    seed=st.integers(0, 2**31),
)
@settings(max_examples=40, deadline=None)
def test_revisits_stay_within_the_bound_and_both_ends_agree(
    codec: Any, rows: int, width: int, drift: float, scale: float, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    state, refs = codec.new_state(), SampleReferences(limit=100)
    ids = torch.randperm(100, generator=gen)[:rows].tolist()
    x = torch.randn(rows, width, generator=gen) * scale
    first, frame = _send(codec, state, refs, x, ids)
    assert frame.headers[0].params["ref"] == 0 and torch.equal(first, x)  # warm-up: exact
    for _ in range(4):  # later epochs: the activation moved; the delta travels
        before = torch.stack([refs.refs[i] for i in ids])
        x = x + torch.randn(rows, width, generator=gen) * drift * scale
        got, frame = _send(codec, state, refs, x, ids)
        assert frame.headers[0].params["ref"] == 1
        # The quantiser's bound on the delta, plus one fp32 rounding of ref + delta at |x|.
        bound = _delta_bound(codec, x - before) * (1 + 1e-5) + EPS32 * x.abs()
        assert bool(((got - x).abs() <= bound + 1e-30 * scale).all())
        # The receiver uses its new reference, and the sender holds the very same bits.
        for i, row in zip(ids, got, strict=True):
            assert torch.equal(refs.refs[i], row)
            assert torch.equal(state.references.refs[i], row)
    assert frame.nbytes * 8 / x.numel() <= codec.bits + 32 / codec.block + 8 * 64 / x.numel()


@pytest.mark.parametrize("codec", AQS, ids=AQ_IDS)
def test_the_error_of_a_constant_activation_goes_to_zero(codec: Any) -> None:
    """Per-sample error feedback: a sample whose activation stops changing is soon exact."""
    state, refs = codec.new_state(), SampleReferences(limit=4)
    start = torch.randn(4, 256)
    _send(codec, state, refs, start, [0, 1, 2, 3])
    x = start + torch.randn(4, 256)  # then it moves once, and stays
    errors = []
    for _ in range(40):
        got, _ = _send(codec, state, refs, x, [0, 1, 2, 3])
        errors.append(float((got - x).abs().max()))
    assert errors[0] > 1e-2
    assert errors[-1] < 1e-5 * float(x.abs().max())
    assert errors[-1] < errors[5] < errors[0]


def test_a_new_sample_in_a_microbatch_sends_the_whole_microbatch_uncompressed() -> None:
    codec = get_codec("aq-delta")
    state, refs = codec.new_state(), SampleReferences(limit=8)
    _send(codec, state, refs, torch.randn(2, 64), [0, 1])
    _, frame = _send(codec, state, refs, torch.randn(2, 64), [1, 2])  # sample 2 is new
    assert frame.headers[0].params["ref"] == 0
    _, frame = _send(codec, state, refs, torch.randn(2, 64), [2, 0])
    assert frame.headers[0].params["ref"] == 1


def _delta_frame(ids: list[int], rows: int = 2, name: str = "aq-delta") -> bytes:
    """A delta (ref=1) frame from a sender that has seen `ids` before."""
    codec = get_codec(name)
    state = codec.new_state()
    x = torch.randn(rows, 64)
    _send(codec, state, SampleReferences(), x, ids)
    return encode_frame(
        FrameKind.FORWARD, 0, 0, [Outgoing("h", x + 0.1, codec, state)], samples=ids
    )


@pytest.mark.parametrize(
    ("ids_sent", "ids_claimed", "limit", "reason"),
    [
        ([0, 1], [0, 1], 8, "no reference"),  # the receiver never saw these samples
        ([0, 1], [0, 9], 8, "outside"),  # past the dataset
        ([0, 1], [1, 1], 8, "twice"),
        ([0, 1], [0], 8, "1 sample ids for a tensor of 2 rows"),
        ([0, 1], [], 8, "0 sample ids"),
    ],
)
def test_bad_sample_ids_or_missing_references_are_refused_and_change_nothing(
    ids_sent: list[int], ids_claimed: list[int], limit: int, reason: str
) -> None:
    message = _delta_frame(ids_sent)
    frame = parse_frame(message, LIMITS)
    frame = type(frame)(
        kind=frame.kind,
        seq=frame.seq,
        version=frame.version,
        headers=frame.headers,
        payloads=frame.payloads,
        samples=tuple(ids_claimed),
    )
    refs = SampleReferences(limit=limit)
    refs.refs[5] = torch.zeros(64)
    with pytest.raises(FrameError, match=reason):
        frame.decode_with({"h": refs})
    assert list(refs.refs) == [5] and not refs.refs[5].any()


def test_a_reference_of_another_shape_is_refused() -> None:
    frame = parse_frame(_delta_frame([0, 1]), LIMITS)
    refs = SampleReferences(limit=8, refs={0: torch.zeros(32), 1: torch.zeros(32)})
    with pytest.raises(FrameError, match="shape"):
        frame.decode_with({"h": refs})


def test_aq_frames_need_a_receiver_that_keeps_references() -> None:
    frame = parse_frame(_delta_frame([0, 1]), LIMITS)
    with pytest.raises(FrameError, match="not expected"):
        frame.decode()
    with pytest.raises(FrameError, match="not expected"):
        frame.decode_with({"other": SampleReferences()})


def test_nothing_changes_until_the_commit() -> None:
    codec = get_codec("aq-delta2")
    state, refs = codec.new_state(), SampleReferences(limit=8)
    x = torch.randn(2, 64)
    _send(codec, state, refs, x, [3, 4])
    before = {k: v.clone() for k, v in refs.refs.items()}
    message = encode_frame(
        FrameKind.FORWARD, 0, 0, [Outgoing("h", x * 2, codec, state)], samples=[3, 4]
    )
    tensors, commit = parse_frame(message, LIMITS).decode_with({"h": refs})
    assert all(torch.equal(refs.refs[k], v) for k, v in before.items())
    commit()
    assert torch.equal(refs.refs[3], tensors["h"][0])


HOSTILE = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 4, 8, 16, 64, 65536, 2**40, -1]),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)


@pytest.mark.parametrize("codec", AQS, ids=AQ_IDS)
@given(
    params=st.dictionaries(st.sampled_from(["bits", "block", "ref", "x"]), HOSTILE, max_size=4),
    shape=st.lists(st.integers(0, 300), max_size=3),
    payload=st.binary(max_size=3000),
)
@FUZZ
def test_hostile_params_and_payloads_raise_frame_error_only(
    codec: Any, params: Mapping[str, Any], shape: list[int], payload: bytes
) -> None:
    with contextlib.suppress(FrameError):
        codec.payload_nbytes(shape, torch.float32, params)
    try:
        out = codec.decode(memoryview(payload), shape, torch.float32, params)
    except FrameError:
        return
    assert out.shape == tuple(shape) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("codec", AQS, ids=AQ_IDS)
@given(data=st.data())
@FUZZ
def test_mutated_aq_frames_are_refused_or_decode_finite(codec: Any, data: st.DataObject) -> None:
    message = bytearray(_delta_frame([0, 1], name=codec.name))
    for _ in range(data.draw(st.integers(1, 8))):
        message[data.draw(st.integers(0, len(message) - 1))] = data.draw(st.integers(0, 255))
    refs = SampleReferences(limit=8, refs={i: torch.randn(64) for i in range(4)})
    try:
        tensors, commit = parse_frame(bytes(message), LIMITS).decode_with({"h": refs})
    except FrameError:
        return
    commit()
    assert bool(torch.isfinite(tensors["h"]).all())


def test_aq_is_for_activations_of_a_fixed_dataset() -> None:
    assert {"aq-delta", "aq-delta2"} <= set(CODECS)
    with pytest.raises(ConfigError, match="activations only"):
        encoder("aq-delta", "gradient")
    with pytest.raises(ConfigError, match="dataset_samples"):
        TrainConfig(activation_codec="aq-delta")
    with pytest.raises(ConfigError, match="activations only"):
        TrainConfig(gradient_codec="aq-delta2", dataset_samples=64)
    with pytest.raises(ConfigError, match="multiple of batch_size"):
        TrainConfig(activation_codec="aq-delta", dataset_samples=100)
    with pytest.raises(ConfigError, match="GiB of references"):
        TrainConfig(activation_codec="aq-delta", dataset_samples=1 << 20)
    run = TrainConfig(activation_codec="aq-delta2", gradient_codec="none", dataset_samples=64)
    assert TrainConfig.from_proto(run.to_proto("")) == run


def test_a_fixed_dataset_visits_every_sample_once_per_epoch() -> None:
    data = StdlibBytes(seq_len=16, seed=3, num_samples=32)
    seen: dict[int, torch.Tensor] = {}
    orders = []
    for epoch in range(3):
        ids = [i for step in range(4 * epoch, 4 * epoch + 4) for i in data.sample_ids(step, 8)]
        assert sorted(ids) == list(range(32))
        orders.append(ids)
        for step in range(4 * epoch, 4 * epoch + 4):
            x, _ = data.batch(step, 8)
            for i, row in zip(data.sample_ids(step, 8), x, strict=True):
                assert torch.equal(seen.setdefault(i, row), row)  # a sample is always the same
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch
    assert StdlibBytes(seq_len=16, seed=3).sample_ids(0, 8) == []


async def test_a_stage_refuses_what_its_references_cannot_take_and_changes_nothing() -> None:
    run = TrainConfig(
        model="tiny", steps=4, batch_size=16, activation_codec="aq-delta", dataset_samples=32
    )
    inbox = tiny_middle_inbox(run)
    codec = encoder("aq-delta", "activation")
    state = codec.new_state()
    targets = torch.zeros(4, 32, dtype=torch.uint8)

    def forward(seq: int, ids: list[int], x: torch.Tensor) -> Any:
        tensors = [Outgoing("hidden", x, codec, state), Outgoing("targets", targets, NONE)]
        message = encode_frame(FrameKind.FORWARD, seq, 0, tensors, samples=ids)
        return parse_frame(message, LIMITS)

    x = torch.randn(4, 32, 64)
    await inbox.admit(forward(0, [0, 1, 2, 3], x))
    refs = inbox.references["hidden"]
    assert sorted(refs.refs) == [0, 1, 2, 3]
    # A frame without sample ids, or with too few, is refused before decoding.
    with pytest.raises(FrameError, match="sample ids"):
        await inbox.admit(
            parse_frame(
                encode_frame(
                    FrameKind.FORWARD, 1, 0, [("hidden", x, NONE), ("targets", targets, NONE)]
                ),
                LIMITS,
            )
        )
    # A delta for samples this end never saw: refused, references and schedule unchanged.
    other = get_codec("aq-delta").new_state()
    codec_state, state = state, other
    forward(1, [4, 5, 6, 7], x)  # the other sender's warm-up, never delivered
    with pytest.raises(FrameError, match="no reference"):
        await inbox.admit(forward(1, [4, 5, 6, 7], x + 1))
    assert sorted(refs.refs) == [0, 1, 2, 3] and inbox.accepted == 1
    state = codec_state
    await inbox.admit(forward(1, [4, 5, 6, 7], x))  # seq 1 still fits
    assert sorted(refs.refs) == list(range(8))
