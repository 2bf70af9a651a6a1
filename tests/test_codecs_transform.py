"""klt (compression/transform.py) and its entropy coder (compression/rans.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest_node.compression import encoder, get_codec, rans, transform
from ravnest_node.compression.transform import (
    CODER_COLUMNS,
    FALLBACK_WIDTH,
    KLT,
    KLT_ACTIVATION,
    KLT_GRADIENT,
    REFRESH_FIRST,
    KLTBases,
    KLTState,
    layout,
)
from ravnest_node.errors import FrameError
from ravnest_node.transport.frames import (
    FrameKind,
    FrameLimits,
    Outgoing,
    encode_frame,
    parse_frame,
)

from .conftest import demo_summary
from .test_codecs_quant import HOSTILE_VALUES, expect_frame_error_or_tensor

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = FrameLimits(max_message_bytes=1 << 24)


def correlated(rows: int, d: int, rank: int = 4, seed: int = 0) -> torch.Tensor:
    """Rows that live mostly in the same few directions (whatever `seed`), as boundary
    tensors do."""
    mix = torch.randn(rank, d, generator=torch.Generator().manual_seed(99))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g) @ mix + 0.05 * torch.randn(rows, d, generator=g)


# ---- rans ----


@given(
    lanes=st.integers(1, 6),
    n=st.integers(1, 40),
    spread=st.floats(0.01, 60.0),
    seed=st.integers(0, 2**16),
)
@FUZZ
def test_rans_gives_back_every_code(lanes: int, n: int, spread: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(lanes, n, generator=g) * spread).round().clamp(-255, 255).long()
    a, models, payload = rans.encode(codes)
    assert a == int(codes.abs().max())
    assert torch.equal(rans.decode(memoryview(payload), a, models, n), codes)


def test_rans_spends_about_the_entropy_of_each_column() -> None:
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(1, -2, 64).unsqueeze(1)
    codes = (torch.randn(64, 512, generator=g) * scale).round().long()
    _, _, payload = rans.encode(codes)
    entropy = 0.0
    for lane in codes:
        _, counts = torch.unique(lane, return_counts=True)
        p = counts.double() / lane.numel()
        entropy += float(-(p * p.log2()).sum()) * lane.numel()
    bits = 8 * len(payload)
    # Within 5% of the columns' entropy, plus the coder's final state (64 bits).
    assert bits < 1.05 * entropy + 64
    assert bits < 0.5 * 4 * codes.numel()  # half of what 4-bit codes would take


@given(data=st.data())
@FUZZ
def test_a_corrupt_rans_payload_is_refused(data: st.DataObject) -> None:
    codes = (torch.randn(4, 30, generator=torch.Generator().manual_seed(0)) * 3).round().long()
    a, models, payload = rans.encode(codes)
    raw = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 6))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    raw = raw[: cut - cut % 4] if data.draw(st.booleans()) else raw
    try:
        out = rans.decode(memoryview(bytes(raw)), a, models, 30)
    except FrameError:
        return
    assert out.shape == codes.shape and int(out.abs().max()) <= a


def test_rans_refuses_payloads_that_do_not_hold_exactly_the_codes() -> None:
    codes = (torch.randn(8, 50, generator=torch.Generator().manual_seed(0)) * 4).round().long()
    a, models, payload = rans.encode(codes)
    assert torch.equal(rans.decode(memoryview(payload), a, models, 50), codes)
    other = models.clone()
    other[3] = (int(models[3]) + 97) % rans.MODELS
    wrong = {
        "truncated by a word": (payload[:-4], a, models, 50),
        "a word too many": (payload + payload[-4:], a, models, 50),
        "not whole words": (payload[:-1], a, models, 50),
        "a last word of 0 (no encoder ends on one)": (payload[:-4] + bytes(4), a, models, 50),
        "one code fewer per lane": (payload, a, models, 49),
        "a lane's model changed": (payload, a, other, 50),
        "another alphabet": (payload, a + 1, models, 50),
        "beyond the largest payload": (bytes(4 * 400), a, models, 50),
        "codes beyond MAX_CODE": (payload, rans.MAX_CODE + 1, models, 50),
    }
    for why, (raw, a_, models_, n) in wrong.items():
        with pytest.raises(FrameError):
            rans.decode(memoryview(raw), a_, models_, n)
            pytest.fail(f"decoded a payload with {why}")


@given(raw=st.binary(max_size=400), models=st.binary(min_size=1, max_size=8))
@FUZZ
def test_random_rans_payloads_raise_frame_error_only(raw: bytes, models: bytes) -> None:
    lanes = torch.frombuffer(bytearray(models), dtype=torch.uint8)
    with contextlib.suppress(FrameError):
        out = rans.decode(memoryview(raw), 7, lanes, 20)
        assert out.shape == (len(models), 20) and int(out.abs().max()) <= 7


def test_rans_codes_nothing_as_nothing() -> None:
    codes = torch.zeros(0, 5, dtype=torch.long)
    a, models, payload = rans.encode(codes)
    assert payload == b"" and rans.decode(memoryview(payload), a, models, 5).shape == (0, 5)


# The wire format pinned: bytes that the codec wrote before its encoder and decoder were made
# faster (rans: integer codes; klt: identity-basis frames of rows whose steps and coefficients
# are exact in float32, so the bytes do not depend on the machine's float arithmetic).
PINNED_RANS = bytes.fromhex(
    "55361249adb3a312728d25c8a3bd1150f5dd28482bd3d9b9d28ede79c38dcfa97dee0b3e92961412a59bb8c7"
    "7f3e120e2329393ffb3fd6a622544d742e86b9234a74385716358a37db53927d2b43e4890755ed08a436896d"
    "b9e11884afcd8e580ee41b928ce110606a0a71d202621be53e8a18b67c3b9106a423369fe5ce9a8d931adeed"
    "d3c119c3c1d7bff84f2ec9805c010000"
)
PINNED_KLT = {
    "activation": bytes.fromhex(
        "2f403d4024402e401a40803f22402d40fdebfdd7fdfafefce7e6fefbd7fdfee7fdfea3fbfeebd7fdfefeebfd"
        "e7ebe7e773057ebaf086591243b43255c55fed8e802004f01214e328c63187bfc09d1b0c994d045db84fbf52"
        "35e0d524408348dcae556ee48df3334d41b66c3a6a15bcf8c8d685556179f613ff636d90a4b6a1eaf7d85b92"
        "029de39a2a000000"
    ),
    "gradient": bytes.fromhex(
        "df3ffefbfcecfdfcfffde9e9fefdd9fdfefcfdffd7fdececfcfbfffffcfcfbe9fcfb9a71ba080a14dab11095"
        "6aca12c691ba3c0df808a43b45e5054ebf21ffbbb0ce651bb4745b57709e7a1502fd855838adbd886304718d"
        "bc03451919e4f3537552db8d3b589523a46826169d79740e5e14474882eda5c4d5787ecfd876d86f644bbc7b"
        "e3d5380ca51553e6e28654580000"
    ),
}


def _tables_one_alphabet(a: int) -> torch.Tensor:
    """The models' frequencies over -a..a as the coder first built them, one alphabet at a
    time (the recurrence run up to a): every node must build the same ones."""
    p0 = torch.tensor(rans._P0, dtype=torch.int64).repeat_interleave(len(rans._RATIO))
    ratio = torch.tensor(rans._RATIO, dtype=torch.int64).repeat(len(rans._P0))
    weights = torch.zeros(rans.MODELS, 2 * a + 1, dtype=torch.int64)
    weights[:, a] = p0 << 16
    tail = ((rans.TOTAL - p0) * (rans.TOTAL - ratio)) >> 1
    for q in range(1, a + 1):
        weights[:, a + q] = tail
        weights[:, a - q] = tail
        tail = (tail * ratio) >> 16
    freq = 1 + weights * (rans.TOTAL - (2 * a + 1)) // weights.sum(1, keepdim=True)
    freq[:, a] += rans.TOTAL - freq.sum(1)
    return freq


@pytest.mark.parametrize("a", [0, 1, 2, 7, 44, 81, 126, 200, rans.MAX_CODE])
def test_rans_tables_are_the_ones_every_node_builds(a: int) -> None:
    assert torch.equal(rans.tables(a), _tables_one_alphabet(a))
    assert bool((rans.tables(a).sum(1) == rans.TOTAL).all())


def test_rans_wire_format_is_pinned() -> None:
    g = torch.Generator().manual_seed(3)
    spread = torch.tensor([0, 1, 3, 9, 27, 81]).unsqueeze(1)
    codes = (torch.randint(-1000, 1001, (6, 50), generator=g) * spread // 1000).to(torch.int16)
    for lanes in (codes, codes.T.contiguous().T):  # (contiguous lanes, and strided ones)
        a, models, payload = rans.encode(lanes)
        assert (a, bytes(models.numpy()), payload) == (
            81,
            bytes.fromhex("0fa0e6eafdff"),
            PINNED_RANS,
        )
    decoded = rans.decode(
        memoryview(PINNED_RANS),
        81,
        torch.tensor([15, 160, 230, 234, 253, 255], dtype=torch.uint8),
        50,
    )
    assert torch.equal(decoded, codes.long())


@pytest.mark.parametrize("which", ["activation", "gradient"])
@pytest.mark.parametrize("columns", [False, True])
def test_klt_wire_format_is_pinned(which: str, columns: bool) -> None:
    codec = KLT_ACTIVATION if which == "activation" else KLT_GRADIENT
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-8, 9, (8, 32), generator=g).to(torch.float32)
    x[:, 0] = torch.where(torch.arange(8) % 2 == 0, 8.0, -8.0)  # (each row's peak is 8)
    x[5] = 0  # (a row of zeros: step 1)
    state = codec.new_state()
    state.columns = columns
    if state.generator is not None:
        state.generator = torch.Generator().manual_seed(11)
    params, payload = codec.encode(x, state)
    pinned = PINNED_KLT[which]
    a = 3 if which == "activation" else 5
    rows = int(which == "activation")
    expect = {"basis": 0, "id": 0, "rows": rows, "a": a, "packed": len(pinned), "coder": 1}
    if columns:
        expect |= {"coder": CODER_COLUMNS, "cols": 32}
    assert (params, payload) == (expect, pinned)
    n_steps = 8 if which == "activation" else 1
    steps = torch.frombuffer(bytearray(pinned[: 2 * n_steps]), dtype=torch.bfloat16).float()
    out = codec.decode(memoryview(pinned), x.shape, x.dtype, params)
    # identity basis: the decoded values are the codes times the steps, exactly
    codes = out / steps.reshape(-1, 1)
    assert torch.equal(codes, codes.round()) and int(codes.abs().max()) == a
    bound = steps.reshape(-1, 1) * (0.5 if which == "activation" else 1.0)
    assert bool(((out - x).abs() <= bound).all())


# ---- klt ----


def send(codec: KLT, state: KLTState, bases: KLTBases, x: torch.Tensor) -> torch.Tensor:
    params, payload = codec.encode(x, state)
    out, commit = codec.decode_stream(bases, memoryview(payload), x.shape, x.dtype, params)
    commit()
    return out


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """`t` as the codec's rows (`layout`: the fallback's last row zero-padded)."""
    rows, d, _ = layout(tuple(t.shape))
    flat = t.reshape(-1)
    return torch.cat([flat, flat.new_zeros(rows * d - flat.numel())]).view(rows, d)


@given(
    rows=st.integers(1, 40),
    d=st.sampled_from([3, 16, 40, 1500]),
    magnitude=st.sampled_from([1e-12, 1e-3, 1.0, 1e6, 1e30]),
    frames=st.integers(1, 10),
    stochastic=st.booleans(),
    per_row=st.booleans(),
)
@FUZZ
def test_every_frame_stays_within_its_bound(
    rows: int, d: int, magnitude: float, frames: int, stochastic: bool, per_row: bool
) -> None:
    codec = KLT(alpha=0.5, per_row=per_row, stochastic=stochastic)
    state, bases = codec.new_state(), KLTBases()
    for i in range(frames):
        x = correlated(rows, d, seed=i) * magnitude
        out = send(codec, state, bases, x)
        assert out.shape == x.shape and bool(torch.isfinite(out).all())
        xr, err = rows_of(x).double(), rows_of(out - x).double()
        width = xr.shape[1]
        learns = layout(tuple(x.shape))[2]
        basis = state.basis if state.basis is not None and learns else torch.eye(width)
        ms = xr.pow(2).mean(1, keepdim=True) if per_row else xr.pow(2).mean().expand(len(xr), 1)
        # A row's step: 0.5 x rms, bfloat16-rounded, doubled where codes would overflow (never
        # here for per-row steps: a coefficient is at most sqrt(d) x rms).
        step = 0.5 * ms.sqrt() * (1 + 2**-7) * (1 if per_row else 2**8)
        # |y - q s| <= s / 2 (nearest) or < s (stochastic) per coefficient, mapped through V.
        half = 1 if stochastic else 0.5
        bound = float(torch.linalg.matrix_norm(basis.double(), 2)) * width**0.5 * step * half
        assert bool((err.norm(dim=1, keepdim=True) <= bound * 1.01 + 1e-300).all())


def test_huge_values_leave_the_basis_learning_alone_and_non_finite_ones_are_refused() -> None:
    codec = get_codec("klt")
    assert isinstance(codec, KLT)
    state = codec.new_state()
    codec.encode(correlated(64, 32), state)
    codec.encode(correlated(64, 32) * 1e20, state)  # its squares overflow float32
    for i in range(2 * REFRESH_FIRST):
        codec.encode(correlated(64, 32, seed=i), state)
    assert state.basis_id == 2 and state.covariance is not None
    assert bool(torch.isfinite(state.covariance).all())
    with pytest.raises(ValueError, match="not finite"):
        codec.encode(torch.full((4, 32), float("nan")), state)


def test_any_shape_is_rows_of_a_bounded_width() -> None:
    assert layout((4, 128, 256)) == (512, 256, True)
    assert layout((1, 20000)) == (79, FALLBACK_WIDTH, False)  # no lane per element of a long row
    assert layout((20000, 1)) == (79, FALLBACK_WIDTH, False)  # nor a step per element of a column
    assert layout(()) == (1, FALLBACK_WIDTH, False)


def test_the_basis_is_learned_sent_once_and_then_named() -> None:
    codec = get_codec("klt")
    assert isinstance(codec, KLT)
    state, bases = codec.new_state(), KLTBases()
    modes, sizes = [], []
    for i in range(REFRESH_FIRST + 3):
        params, payload = codec.encode(correlated(256, 64, seed=i), state)
        _, commit = codec.decode_stream(
            bases, memoryview(payload), (256, 64), torch.float32, params
        )
        commit()
        modes.append(params["basis"])
        sizes.append(len(payload))
    assert modes == [0] * REFRESH_FIRST + [1, 2, 2]
    assert bases.basis_id == state.basis_id == 1 and bases.received == 1
    assert state.basis is not None and bases.basis is not None
    assert torch.equal(bases.basis, state.basis)
    # In its basis a correlated tensor takes a fraction of the identity basis' bytes.
    assert sizes[-1] < 0.6 * sizes[0]


def drifting(frame: int, frames: int, rows: int = 256, d: int = 64) -> torch.Tensor:
    """Rows of a boundary that drifts as a model trains: their principal directions move from
    one set to another over `frames` frames."""
    g = torch.Generator().manual_seed(99)
    start, end = torch.randn(6, d, generator=g), torch.randn(6, d, generator=g)
    t = frame / frames
    energy = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.25])
    g = torch.Generator().manual_seed(frame)
    z = torch.randn(rows, 6, generator=g) * energy
    return z @ ((1 - t) * start + t * end) + 0.05 * torch.randn(rows, d, generator=g)


def late_frames(frames: int = 192) -> tuple[float, list[int]]:
    """(the mean payload of frames 128 on that carry no basis, the frames that carry one) of
    an activation stream of `drifting` rows towards a peer that decodes columns."""
    codec = get_codec("klt")
    assert isinstance(codec, KLT)
    state = codec.new_state()
    state.columns = True
    sizes, with_basis = [], []
    for i in range(frames):
        params, payload = codec.encode(drifting(i, frames), state)
        if params["basis"] == 1:
            with_basis.append(i)
        elif i >= 128:
            sizes.append(len(payload))
    return sum(sizes) / len(sizes), with_basis


def test_the_basis_follows_a_drifting_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """A basis goes at least every REFRESH_MAX frames once the doubling reaches it, and on a
    drifting stream the fresher basis codes the later frames smaller than the sender before
    it did (an average of weight 0.9 and a basis every 128 frames), at the same step."""
    now, sent = late_frames()
    assert sent == [4, 8, 16, 32, 64, 96, 128, 160]
    monkeypatch.setattr(transform, "EMA", 0.9)
    monkeypatch.setattr(transform, "REFRESH_MAX", 128)
    before, sent_before = late_frames()
    assert sent_before == [4, 8, 16, 32, 64, 128]
    assert now < 0.95 * before, (now, before)


def test_a_frame_naming_a_basis_the_receiver_lacks_is_refused_and_changes_nothing() -> None:
    codec = get_codec("klt")
    assert isinstance(codec, KLT)
    state = codec.new_state()
    frames = [codec.encode(correlated(64, 32, seed=i), state) for i in range(REFRESH_FIRST + 2)]
    carrier, named = frames[-2], frames[-1]
    assert (carrier[0]["basis"], named[0]["basis"]) == (1, 2)
    fresh = KLTBases()
    with pytest.raises(FrameError, match="holds none"):
        codec.decode_stream(fresh, memoryview(named[1]), (64, 32), torch.float32, named[0])
    assert fresh.basis is None
    # Decoded but not committed (a frame the stage then refuses): still nothing.
    codec.decode_stream(fresh, memoryview(carrier[1]), (64, 32), torch.float32, carrier[0])
    assert fresh.basis is None and fresh.received == 0
    with pytest.raises(FrameError, match="names basis"):
        codec.decode(memoryview(named[1]), (64, 32), torch.float32, named[0])
    stale = KLTBases(basis=torch.eye(32), basis_id=7)
    with pytest.raises(FrameError, match="holds 7"):
        codec.decode_stream(stale, memoryview(named[1]), (64, 32), torch.float32, named[0])


def test_a_frame_of_another_entropy_coder_is_refused() -> None:
    """Frames of the numpy coder before "coder" 1 had no "coder" param; a node of that time
    refuses these frames by the same exact check of the params."""
    codec = KLT()
    params, payload = codec.encode(correlated(64, 32), codec.new_state())
    assert params["coder"] == 1
    old = {k: v for k, v in params.items() if k != "coder"}
    for wrong in (old, {**params, "coder": 0}, {**params, "coder": 2}):
        with pytest.raises(FrameError, match="coder"):
            codec.decode(memoryview(payload), (64, 32), torch.float32, wrong)


@pytest.mark.parametrize("role", ["activation", "gradient"])
def test_a_peer_that_decodes_columns_gets_the_columns_that_carry_energy(role: str) -> None:
    """CODER_COLUMNS: in the learned basis, trailing columns whose codes' rms is under
    drop_below are left out; the frame decodes to about what all columns would give, in fewer
    bytes. Before the first basis (the identity) every column goes."""
    codec = encoder("klt", role)
    assert isinstance(codec, KLT)
    full, cut = codec.new_state(), codec.new_state()
    cut.columns = True
    bases_full, bases_cut = KLTBases(), KLTBases()
    sizes, errors, cols = [], [], []
    for i in range(REFRESH_FIRST + 6):
        x = correlated(256, 64, rank=6, seed=i)
        for state, bases in ((full, bases_full), (cut, bases_cut)):
            params, payload = codec.encode(x, state)
            out, commit = codec.decode_stream(bases, memoryview(payload), x.shape, x.dtype,
                                              params)  # fmt: skip
            commit()
            if state is cut:
                assert params["coder"] == CODER_COLUMNS
                cols.append(params["cols"])
            else:
                assert params["coder"] == 1 and "cols" not in params
            if i >= REFRESH_FIRST + 1:  # (both in the learned basis, named not carried)
                sizes.append(len(payload))
                errors.append(float((out - x).norm() / x.norm()))
    assert cols[:REFRESH_FIRST] == [64] * REFRESH_FIRST  # the identity basis: all of them
    # Rows of rank 6 plus a little noise: the 6 columns of their directions, not 64.
    assert all(6 <= c <= 8 for c in cols[REFRESH_FIRST:]), cols
    full_sizes, cut_sizes = sizes[0::2], sizes[1::2]
    full_errors, cut_errors = errors[0::2], errors[1::2]
    assert all(c < f for c, f in zip(cut_sizes, full_sizes, strict=True))
    assert max(cut_errors) < 1.1 * max(full_errors) + 0.01
    # Either format decodes with any node of this version; a "cols" beyond d is refused.
    params, payload = codec.encode(correlated(256, 64, rank=6), cut)
    with pytest.raises(FrameError, match="cols"):
        codec.decode_stream(bases_cut, memoryview(payload), (256, 64), torch.float32,
                            {**params, "cols": 65})  # fmt: skip
    with pytest.raises(FrameError, match="params must be exactly"):
        codec.decode_stream(bases_cut, memoryview(payload), (256, 64), torch.float32,
                            {k: v for k, v in params.items() if k != "cols"})  # fmt: skip


def test_a_frame_of_no_column_at_all_decodes_to_zeros() -> None:
    codec = KLT()
    state, bases = codec.new_state(), KLTBases()
    state.columns = True
    for i in range(REFRESH_FIRST + 1):
        send(codec, state, bases, correlated(64, 32, seed=i))
    params, payload = codec.encode(torch.zeros(64, 32), state)
    assert params["cols"] == 0 and params["a"] == 0
    out, _ = codec.decode_stream(bases, memoryview(payload), (64, 32), torch.float32, params)
    assert torch.equal(out, torch.zeros(64, 32))


def test_stochastic_gradients_are_unbiased() -> None:
    codec = encoder("klt", "gradient")
    assert isinstance(codec, KLT) and codec.stochastic and not codec.per_row
    x = correlated(32, 32)
    state, bases = codec.new_state(), KLTBases()
    for _ in range(REFRESH_FIRST + 1):
        send(codec, state, bases, x)
    mean = sum(send(codec, state, bases, x) for _ in range(400)) / 400
    one = send(codec, state, bases, x)
    assert float((mean - x).norm()) < 0.15 * float((one - x).norm())


@given(
    params=st.dictionaries(
        st.sampled_from(["basis", "id", "rows", "a", "packed", "coder", "cols", "x"]),
        HOSTILE_VALUES,
        max_size=8,
    ),
    shape=st.lists(st.integers(0, 40), max_size=3),
    payload=st.binary(max_size=4000),
)
@FUZZ
def test_hostile_klt_params_and_payloads_raise_frame_error_only(
    params: Mapping[str, Any], shape: list[int], payload: bytes
) -> None:
    codec = get_codec("klt")
    with contextlib.suppress(FrameError):
        codec.payload_nbytes(shape, torch.float32, params)
    expect_frame_error_or_tensor(codec, payload, shape, params)


@given(data=st.data())
@FUZZ
def test_mutated_klt_frames_are_refused_or_decode_finite(data: st.DataObject) -> None:
    codec = get_codec("klt")
    assert isinstance(codec, KLT)
    state = codec.new_state()
    for i in range(REFRESH_FIRST):
        codec.encode(correlated(8, 16, seed=i), state)
    x = correlated(8, 16)
    message = bytearray(encode_frame(FrameKind.FORWARD, 0, 0, [Outgoing("h", x, codec, state)]))
    for _ in range(data.draw(st.integers(1, 8))):
        message[data.draw(st.integers(0, len(message) - 1))] = data.draw(st.integers(0, 255))
    bases = KLTBases()
    try:
        tensors, commit = parse_frame(bytes(message), LIMITS).decode_with({"h": bases})
    except FrameError:
        assert bases.basis is None
        return
    commit()
    assert all(bool(torch.isfinite(t).all()) for t in tensors.values())  # (a mutated name too)


def test_frames_carry_klt_and_a_receiver_keeps_the_basis_per_stream() -> None:
    codec = get_codec("klt")
    assert isinstance(codec, KLT)
    state = codec.new_state()
    bases = {"h": KLTBases()}
    for i in range(REFRESH_FIRST + 2):
        x = correlated(64, 32, seed=i).reshape(4, 16, 32)
        message = encode_frame(FrameKind.FORWARD, i, 0, [Outgoing("h", x, codec, state)])
        frame = parse_frame(message, LIMITS)
        assert frame.headers[0].codec is codec
        tensors, commit = frame.decode_with(bases)
        commit()
        assert tensors["h"].shape == x.shape
        assert float((tensors["h"] - x).norm()) < 0.2 * float(x.norm())
    assert bases["h"].basis_id == 1
    # A receiver that keeps no klt state for the tensor cannot decode a frame naming a basis.
    with pytest.raises(FrameError, match="holds none"):
        parse_frame(message, LIMITS).decode_with({})


def test_three_node_processes_train_with_klt_both_ways(tmp_path: Path) -> None:
    """Three `ravnest-node start` processes on loopback, `--codec klt`: every frame of both
    boundaries goes with klt, each stream's bases arrive (frames naming them decode), far fewer
    bytes than int4-block would send, and the model trains."""
    steps = 12
    s = demo_summary(
        tmp_path, "klt", "--model", "small", "--seed", "0", "--steps", str(steps),
        "--codec", "klt",
    )  # fmt: skip
    first, middle, last = s["stages"]
    for stage, role in ((first, "activation"), (middle, "activation"), (middle, "gradient"),
                        (last, "gradient")):  # fmt: skip
        assert stage[f"{role}_codec_frames"] == {"klt": steps * 4}
    # small: 64 tokens x 128 channels per sample cross each boundary each way; int4-block
    # would take 4.5 bits per element.
    int4 = 64 * 128 * 4.5 / 8
    assert s["activation_bytes_per_sample"] < 2 * int4 * 0.75
    assert s["gradient_bytes_per_sample"] < 2 * int4 * 0.75
    assert s["final_loss"] < s["initial_loss"]
