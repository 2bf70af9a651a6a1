"""PowerSGD (powersgd) of a flat delta of known layout, and replica averaging with it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import struct
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest_node.averaging import (
    AveragingConfig,
    Replica,
    ReplicaAverager,
    Topology,
    delta_codec,
    round_payload_bytes,
)
from ravnest_node.compression import get_codec
from ravnest_node.compression.powersgd import MAX_RANK, PowerSGD, compresses
from ravnest_node.errors import ConfigError, FrameError
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.frames import FrameKind, Outgoing, encode_frame
from ravnest_node.transport.options import TransportConfig, server_options

from .fakes import claimed

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYOUT = ((64, 48), (48,), (3, 4, 5), (2, 2), (), (40, 30))
"""Two compressed matrices (64 x 48; 40 x 30 at rank <= 4), a 3-d entry seen as 3 x 20 (too
small to compress), a tiny matrix, a scalar and a vector."""
LIMIT = 4 * 2**20


def numel_of(layout: tuple[tuple[int, ...], ...]) -> int:
    return sum(math.prod(s) for s in layout)


def round_trip(
    codec: PowerSGD, x: torch.Tensor, state: object
) -> tuple[torch.Tensor, Mapping[str, int], bytes]:
    params, payload = codec.encode(x, state)
    assert len(payload) == codec.payload_nbytes(x.shape, torch.float32, params)
    return codec.decode(memoryview(payload), x.shape, torch.float32, params), params, payload


def low_rank(rows: int, cols: int, rank: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, rank, generator=gen) @ torch.randn(rank, cols, generator=gen)


def with_matrices(layout: Any, gen: torch.Generator, matrix: Any) -> torch.Tensor:
    """A flat vector of `layout`: `matrix(m, n)` for the entries sent as factors, random
    values for the others."""
    parts = []
    for shape in layout:
        n = math.prod(shape)
        if len(shape) >= 2 and compresses(shape[0], n // shape[0], 4):
            parts.append(matrix(shape[0], n // shape[0]).reshape(-1))
        else:
            parts.append(torch.randn(n, generator=gen))
    return torch.cat(parts)


def matrices(codec: PowerSGD, x: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
    """(entry as m x n, whether it travels as factors) for each entry of the layout."""
    out, start = [], 0
    for shape in codec.layout:
        n = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 1
        factored = len(shape) >= 2 and compresses(rows, n // max(rows, 1), codec.rank)
        out.append((x[start : start + n].view(rows, -1), factored))
        start += n
    return out


# ---- accuracy ----


def test_a_matrix_of_rank_at_most_r_round_trips_and_vectors_go_as_bf16() -> None:
    gen = torch.Generator().manual_seed(0)
    codec = PowerSGD(layout=LAYOUT, rank=4, error_feedback=False)
    for true_rank in (1, 3, 4):
        x = with_matrices(LAYOUT, gen, lambda m, n, k=true_rank: low_rank(m, n, k, gen))
        y, params, payload = round_trip(codec, x, codec.new_state())
        assert params == {"rank": 4}
        for (got, factored), (want, _) in zip(matrices(codec, y), matrices(codec, x), strict=True):
            if factored:  # exact up to float32 rounding
                assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
            else:  # bf16: 8 significant bits
                torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=0, atol=0)
    # Bytes: 4 r (m + n) per factored matrix, 2 per other element.
    dense = 48 + 60 + 4 + 1
    assert len(payload) == 4 * 4 * (64 + 48 + 40 + 30) + 2 * dense


@given(seed=st.integers(0, 2**31), rank=st.integers(1, 8))
@settings(max_examples=40, deadline=None)
def test_the_error_of_a_random_matrix_is_within_the_projection_bound(seed: int, rank: int) -> None:
    """One round from a fresh state: M_hat is the orthogonal projection of M onto span(P), so
    the best rank-r error <= ||M - M_hat|| <= ||M||, and ||M_hat||^2 + ||M - M_hat||^2 =
    ||M||^2."""
    gen = torch.Generator().manual_seed(seed)
    layout = ((96, 80),)
    m = torch.randn(96, 80, generator=gen) * torch.logspace(0, -3, 80)  # a decaying spectrum
    codec = PowerSGD(layout=layout, rank=rank, error_feedback=False)
    y, _, _ = round_trip(codec, m.reshape(-1), codec.new_state())
    m_hat = y.view(96, 80)
    err, norm = float((m - m_hat).norm()), float(m.norm())
    sigma = torch.linalg.svdvals(m.double())
    best = float(sigma[rank:].square().sum().sqrt())
    assert best * (1 - 1e-5) <= err <= norm * (1 + 1e-6)
    assert math.isclose(float(m_hat.norm()) ** 2 + err**2, norm**2, rel_tol=1e-4)


def test_warm_start_approaches_the_best_rank_r_error_on_a_fixed_matrix() -> None:
    gen = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(128, 64, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(96, 64, generator=gen))
    sigma = 0.8 ** torch.arange(64, dtype=torch.float32)  # s_5 / s_4 = 0.8
    m = (u * sigma) @ v.T
    best = float(sigma[4:].square().sum().sqrt())
    codec = PowerSGD(layout=((128, 96),), rank=4, error_feedback=False)
    state = codec.new_state()
    errors = []
    for _ in range(30):
        y, _, _ = round_trip(codec, m.reshape(-1), state)
        errors.append(float((y.view(128, 96) - m).norm()))
    assert errors[0] > 1.05 * best  # one power iteration from a random start is not optimal ...
    assert errors[-1] <= 1.001 * best  # ... subspace iteration over the rounds is
    assert all(b <= a * (1 + 1e-4) for a, b in itertools.pairwise(errors))


def test_error_feedback_makes_the_running_mean_converge_to_the_true_delta() -> None:
    """The same full-rank delta every round: each round is off by most of its mass, but the sum
    of the decoded deltas is the true sum minus the residual, which stays bounded, so the
    relative error of the running mean falls like 1 / rounds."""
    gen = torch.Generator().manual_seed(2)
    layout = ((64, 48), (48,), (40, 30))
    x = torch.randn(numel_of(layout), generator=gen) * 0.01 + 0.002
    codec = PowerSGD(layout=layout, rank=4)
    state = codec.new_state()
    total = torch.zeros_like(x)
    rel = {}
    for r in range(1, 201):
        y, _, _ = round_trip(codec, x, state)
        total += y
        if r in (1, 100, 200):
            rel[r] = float((total / r - x).norm() / x.norm())
    assert rel[1] > 0.5  # rank 4 of a random 64 x 48 loses most of one delta
    assert rel[200] < 0.05 and rel[200] < 0.6 * rel[100]  # ~ 1 / rounds: the residual is bounded
    assert state.residual is not None
    torch.testing.assert_close(total + state.residual, 200 * x, rtol=1e-4, atol=1e-4)


# ---- hostile input ----


def test_bad_configuration_is_refused() -> None:
    for rank in (0, MAX_RANK + 1, True):
        with pytest.raises(ConfigError):
            PowerSGD(layout=LAYOUT, rank=rank)
    with pytest.raises(ConfigError):
        PowerSGD(layout=((0, 3),), rank=4)  # no element at all
    with pytest.raises(ConfigError):
        PowerSGD(layout=((3, -1),), rank=4)
    with pytest.raises(ConfigError, match="layout"):
        delta_codec("powersgd")
    codec = PowerSGD(layout=LAYOUT)
    with pytest.raises(TypeError):
        codec.encode(torch.zeros(codec.numel), None)
    with pytest.raises(ValueError, match="elements"):
        codec.encode(torch.zeros(codec.numel + 1), codec.new_state())
    with pytest.raises(ValueError, match="finite"):
        codec.encode(torch.full((codec.numel,), math.inf), codec.new_state())


def test_bad_headers_are_refused_before_allocation() -> None:
    codec = PowerSGD(layout=LAYOUT)
    n, f32 = codec.numel, torch.float32
    good = {"rank": 4}
    assert codec.payload_nbytes((n,), f32, good) > 0
    assert codec.payload_nbytes((1, n), f32, good) == codec.payload_nbytes((n,), f32, good)
    for params in ({}, {"rank": 0}, {"rank": 65}, {"rank": True}, {"rank": 4, "x": 1}, {"r": 4}):
        with pytest.raises(FrameError):
            codec.payload_nbytes((n,), f32, params)
    # A claimed shape of 10^12 elements is refused from arithmetic alone.
    for shape in ((10**12,), (n + 1,), (n, 2), (-n,), (0,)):
        with pytest.raises(FrameError):
            codec.payload_nbytes(shape, f32, good)
    with pytest.raises(FrameError):
        codec.payload_nbytes((n,), torch.int32, good)


def test_non_finite_and_overflowing_payloads_are_refused() -> None:
    layout = ((64, 48),)
    codec = PowerSGD(layout=layout, rank=1)
    size = codec.payload_nbytes((64 * 48,), torch.float32, {"rank": 1})
    assert size == 4 * (64 + 48)
    for value in (math.nan, math.inf, 1e30):  # 1e30 * 1e30 overflows float32
        payload = struct.pack(f"<{size // 4}f", *([value] * (size // 4)))
        with pytest.raises(FrameError):
            codec.decode(memoryview(payload), (64 * 48,), torch.float32, {"rank": 1})
    # 1e3 * 1e3 fits float32 but not float16.
    payload = struct.pack(f"<{size // 4}f", *([1e3] * (size // 4)))
    with pytest.raises(FrameError):
        codec.decode(memoryview(payload), (64 * 48,), torch.float16, {"rank": 1})
    assert bool(
        (codec.decode(memoryview(payload), (3072,), torch.float32, {"rank": 1}) == 1e6).all()
    )


@FUZZ
@given(
    payload=st.binary(max_size=4096),
    params=st.dictionaries(
        st.sampled_from(["rank", "bits", "x"]), st.integers(-(2**40), 2**40), max_size=2
    ),
    numel=st.sampled_from([0, 1, 3072, numel_of(LAYOUT), numel_of(LAYOUT) + 1, 2**62]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64]),
)
def test_fuzzed_payloads_and_params_raise_frame_error_only(
    payload: bytes, params: dict[str, int], numel: int, dtype: torch.dtype
) -> None:
    codec = PowerSGD(layout=LAYOUT)
    with contextlib.suppress(FrameError):
        out = codec.decode(memoryview(payload), (numel,), dtype, params)
        assert out.shape == (numel,) and out.dtype == dtype and bool(torch.isfinite(out).all())


@FUZZ
@given(seed=st.integers(0, 2**31), flips=st.lists(st.integers(0, 10**6), max_size=8))
def test_corrupted_real_payloads_decode_or_raise_frame_error(seed: int, flips: list[int]) -> None:
    codec = PowerSGD(layout=LAYOUT, rank=2)
    x = torch.randn(codec.numel, generator=torch.Generator().manual_seed(seed))
    params, payload = codec.encode(x, codec.new_state())
    raw = bytearray(payload)
    for i in flips:
        raw[i % len(raw)] ^= 0xFF
    with contextlib.suppress(FrameError):
        out = codec.decode(memoryview(raw), (codec.numel,), torch.float32, params)
        assert bool(torch.isfinite(out).all())


# ---- averaging with powersgd between real averagers ----


@asynccontextmanager
async def group(
    n: int, layout: Any, config: AveragingConfig
) -> AsyncIterator[dict[int, ReplicaAverager]]:
    """Members n0 .. n{n-1}, each with its own grpc.aio server on 127.0.0.1."""
    servers = [grpc.aio.server(options=server_options(TransportConfig())) for _ in range(n)]
    members = [
        Replica(f"n{i}", f"127.0.0.1:{s.add_insecure_port('127.0.0.1:0')}")
        for i, s in enumerate(servers)
    ]
    averagers = {
        i: ReplicaAverager(
            node_id=f"n{i}",
            members=members,
            config=config,
            numel=numel_of(layout),
            max_message_bytes=LIMIT,
            layout=layout,
        )
        for i in range(n)
    }
    for i, server in enumerate(servers):
        server.add_generic_rpc_handlers([averagers[i].handler(caller=claimed)])
        await server.start()
    try:
        yield averagers
    finally:
        for averager in averagers.values():
            await averager.close()
        for server in servers:
            await server.stop(0)


async def test_three_averagers_average_low_rank_deltas_in_far_fewer_bytes() -> None:
    layout = ((256, 192), (192,), (192, 256), (256,), (8, 8))
    numel = numel_of(layout)
    config = AveragingConfig(codec="powersgd", timeout_s=10.0)
    gen = torch.Generator().manual_seed(5)
    async with group(3, layout, config) as averagers:
        assert averagers[0].topology is Topology.ALL_TO_ALL
        for r in range(3):
            # Each replica's matrices move in a rank-2 subspace of its own, as in fine-tuning.
            deltas = {
                i: with_matrices(layout, gen, lambda m, n: low_rank(m, n, 2, gen)) * 0.01
                for i in averagers
            }
            results = await asyncio.gather(*(a.average(r, deltas[i]) for i, a in averagers.items()))
            true = torch.stack(list(deltas.values())).mean(0)
            largest = max(float(d.abs().max()) for d in deltas.values())
            int8_bytes = round_payload_bytes(delta_codec("int8-block"), numel, 3)
            for res in results:
                assert res.participants == ("n0", "n1", "n2") and not res.rejected
                assert torch.equal(res.mean, results[0].mean)  # bit-identical everywhere
                # bf16 entries are off by 2^-9 of their magnitude, plus last round's residual.
                assert float((res.mean - true).abs().max()) <= 2 * largest / 256
                # 2 frames of 15.4 KB each (factors 14.3 KB, bf16 1 KB) vs 2 x 99.6 KB.
                assert res.bytes_sent * 5 < int8_bytes


async def test_powersgd_runs_all_to_all_and_refuses_what_does_not_fit() -> None:
    layout = ((64, 48), (48,))
    numel = numel_of(layout)
    config = AveragingConfig(codec="powersgd", timeout_s=1.0)
    members = [Replica(f"n{i}", f"127.0.0.1:{i + 1}") for i in range(6)]

    def averager(**kw: Any) -> ReplicaAverager:
        args: dict[str, Any] = {
            "node_id": "n0",
            "members": members,
            "config": config,
            "numel": numel,
            "max_message_bytes": LIMIT,
            "layout": layout,
        }
        return ReplicaAverager(**(args | kw))

    a = averager()
    assert a.topology is Topology.ALL_TO_ALL  # 6 members would run a ring with another codec
    with pytest.raises(ConfigError, match="layout"):
        averager(layout=None)
    with pytest.raises(ConfigError, match="elements"):
        averager(numel=numel + 1)

    def frame(tensor: torch.Tensor, name: str = "delta", seq: int = 0) -> bytes:
        return encode_frame(FrameKind.DELTA, seq, 0, [Outgoing(name, tensor, get_codec("none"))])

    size = delta_codec("powersgd", layout).payload_nbytes((numel,), torch.float32, {"rank": 4})
    bad = [
        frame(torch.ones(numel)),  # a float32 delta, not an envelope
        frame(torch.zeros(size + 1, dtype=torch.uint8)),  # the size of no rank-4 payload
        frame(torch.zeros(size, dtype=torch.uint8), name="scatter-1"),  # no ring here
        frame(torch.full((size,), 0xFF, dtype=torch.uint8)),  # NaN factors
    ]
    for message in bad:
        with pytest.raises(Refusal) as refused:
            await a.receive(message, "n1")
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    await a.receive(frame(torch.zeros(size, dtype=torch.uint8)), "n2")  # zeros decode to 0
    await a.close()
