"""Replica averaging: the outer step, the pure decisions, the exchange in one event loop, and
groups of real member processes (tests/averaging_peer.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ravnest_node.averaging import (
    AveragingConfig,
    AveragingService,
    BanList,
    OuterOptimizer,
    Replica,
    ReplicaAverager,
    Topology,
    choose_topology,
    delta_codec,
    round_payload_bytes,
    screen_norms,
)
from ravnest_node.averaging.inbox import Admission, admit_round
from ravnest_node.averaging.topology import (
    gather_chunk,
    owned_chunk,
    ring_chunks,
    scatter_chunk,
)
from ravnest_node.averaging.wire import PATH, PeerBehind
from ravnest_node.compression import get_codec
from ravnest_node.errors import ConfigError
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.frames import FrameKind, Outgoing, encode_frame
from ravnest_node.transport.options import TransportConfig, server_options
from ravnest_node.transport.proofs import NODE_ID_KEY

from .conftest import Procs, read_line, wait_for_line
from .fakes import claimed

PEER = Path(__file__).with_name("averaging_peer.py")
LIMIT = 4 * 2**20
HEADER_SLACK = 256
"""Bytes a delta frame's header (and prefix) takes at most beyond its payload, in these tests."""


# ---- the outer step ----


def test_outer_step_matches_a_hand_computation() -> None:
    params = [torch.tensor([1.0, 2.0])]
    outer = OuterOptimizer(params, AveragingConfig(outer_lr=0.7, momentum=0.9))
    params[0].copy_(torch.tensor([0.5, 2.5]))
    delta = outer.begin_round(params)
    assert delta.tolist() == pytest.approx([0.5, -0.5])
    params[0].add_(0.1)  # local progress while the round is in flight
    outer.apply(params, torch.tensor([0.4, -0.2]))
    # v = [0.4, -0.2]; θ_g = θ_prev - 0.7 (Δ + 0.9 v) = [1 - 0.532, 2 + 0.266]; plus the progress.
    assert outer.momentum_buffer.tolist() == pytest.approx([0.4, -0.2])
    assert outer.prev.tolist() == pytest.approx([0.468, 2.266])
    assert params[0].tolist() == pytest.approx([0.568, 2.366])
    assert outer.begin_round(params).tolist() == pytest.approx([-0.1, -0.1])
    outer.apply(params, torch.tensor([0.2, 0.0]))
    # v = 0.9 [0.4, -0.2] + [0.2, 0] = [0.56, -0.18]; θ_g = [0.468 - 0.7 (0.2 + 0.504),
    # 2.266 - 0.7 (0 - 0.162)].
    assert outer.momentum_buffer.tolist() == pytest.approx([0.56, -0.18])
    assert params[0].tolist() == pytest.approx([-0.0248, 2.3794], abs=1e-6)


def test_outer_step_with_lr_1_and_no_momentum_is_plain_averaging() -> None:
    config = AveragingConfig(outer_lr=1.0, momentum=0.0)
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    members = [[p.clone() for p in init] for _ in range(3)]
    outers = [OuterOptimizer(m, config) for m in members]
    for m in members:  # each replica trains somewhere else
        for p in m:
            p.add_(torch.randn(p.shape, generator=gen))
    trained = [[p.clone() for p in m] for m in members]
    deltas = [o.begin_round(m) for o, m in zip(outers, members, strict=True)]
    mean = torch.stack(deltas).mean(0)
    for o, m in zip(outers, members, strict=True):
        o.apply(m, mean)
        for got, *theirs in zip(m, *trained, strict=True):
            torch.testing.assert_close(got, torch.stack(theirs).mean(0))


def test_outer_step_keeps_local_progress_and_one_round_in_flight() -> None:
    params = [torch.zeros(4), torch.zeros(2, 2)]
    outer = OuterOptimizer(params, AveragingConfig(outer_lr=1.0, momentum=0.0))
    for p in params:
        p.add_(1.0)
    delta = outer.begin_round(params)
    with pytest.raises(RuntimeError, match="in flight"):
        outer.begin_round(params)
    for p in params:
        p.add_(0.25)  # steps taken while the round was exchanged
    outer.apply(params, delta * 0.5)  # the group's mean moved half as far
    for p in params:
        torch.testing.assert_close(p, torch.full_like(p, 0.5 + 0.25))
    assert not outer.in_flight
    with pytest.raises(RuntimeError, match="no outer round"):
        outer.apply(params, delta)
    outer.begin_round(params)
    with pytest.raises(ValueError, match="not finite"):
        outer.apply(params, torch.full((8,), float("nan")))


def test_outer_step_on_module_parameters_in_other_dtypes() -> None:
    """nn.Module parameters (leaves that require grad) and a bf16 tensor are written in place."""
    layer = torch.nn.Linear(3, 2)
    half = torch.zeros(4, dtype=torch.bfloat16)
    params = [*layer.parameters(), half]
    outer = OuterOptimizer(params, AveragingConfig(outer_lr=1.0, momentum=0.0))
    weight = layer.weight.detach().clone()
    delta = outer.begin_round(params)
    assert delta.dtype == torch.float32 and delta.numel() == 6 + 2 + 4
    outer.apply(params, torch.cat([torch.ones(8), torch.full((4,), 0.5)]))
    torch.testing.assert_close(layer.weight.detach(), weight - 1)
    assert layer.weight.requires_grad and half.tolist() == [-0.5] * 4


async def test_error_feedback_tracks_the_sum_of_true_deltas() -> None:
    """A group of one still averages (the mean of one); with int4 error feedback the sum of
    what the group decodes stays within one round's quantisation error of the sum of the true
    deltas, however many rounds."""
    config = AveragingConfig(codec="int4-block", timeout_s=1.0)
    averager = ReplicaAverager(
        node_id="a",
        members=[Replica("a", "127.0.0.1:9")],
        config=config,
        numel=1000,
        max_message_bytes=LIMIT,
    )
    gen = torch.Generator().manual_seed(2)
    true_sum, decoded_sum = torch.zeros(1000), torch.zeros(1000)
    worst_single = 0.0
    for r in range(40):
        delta = torch.randn(1000, generator=gen) * 0.1 + 0.03  # a bias int4 alone would lose
        result = await averager.average(r, delta)
        assert result.participants == ("a",) and result.missing == () and result.bytes_sent == 0
        worst_single = max(worst_single, float((result.mean - delta).abs().max()))
        true_sum += delta
        decoded_sum += result.mean
    drift = float((decoded_sum - true_sum).abs().max())
    assert worst_single > 0.005  # int4 is lossy per round ...
    assert drift <= worst_single  # ... but the error does not accumulate
    await averager.close()


# ---- pure decisions ----


def test_topology_by_group_size() -> None:
    assert [choose_topology(n) for n in (1, 2, 4, 5, 16)] == [
        Topology.ALL_TO_ALL,
        Topology.ALL_TO_ALL,
        Topology.ALL_TO_ALL,
        Topology.RING,
        Topology.RING,
    ]
    with pytest.raises(ValueError):
        choose_topology(0)


@given(n=st.integers(2, 12), extra=st.integers(0, 40))
def test_ring_schedule_sums_every_chunk_once_and_delivers_it_everywhere(n: int, extra: int) -> None:
    bounds = ring_chunks(n + extra, n)
    assert bounds[0][0] == 0 and bounds[-1][1] == n + extra
    assert all(a < b and b == c for (a, b), (c, _) in itertools.pairwise(bounds))
    # Reduce-scatter: follow each chunk's partial sum from its first sender to its owner.
    for chunk in range(n):
        rank = chunk  # rank r starts chunk r at step 0
        added = [rank]
        for step in range(n - 1):
            assert scatter_chunk(rank, step, n) == chunk
            rank = (rank + 1) % n
            added.append(rank)
        assert sorted(added) == list(range(n))
        assert owned_chunk(rank, n) == chunk
    # All-gather: every rank receives every chunk but its own, once.
    for rank in range(n):
        received = [gather_chunk((rank - 1) % n, s, n) for s in range(n - 1)]
        assert sorted([*received, owned_chunk(rank, n)]) == list(range(n))


def test_round_payload_bytes() -> None:
    int8 = delta_codec("int8-block")
    # 3 members all-to-all: two whole deltas of 512 int8 codes + one float32 scale each.
    assert round_payload_bytes(int8, 512, 3) == 2 * (512 + 4)
    assert round_payload_bytes(get_codec("none"), 1000, 4) == 3 * 4000
    # A ring of 5: 2 (n - 1) = 8 chunks of 200 floats.
    assert round_payload_bytes(get_codec("none"), 1000, 5) == 8 * 800


def test_norm_guard() -> None:
    assert screen_norms({"a": 1.0, "b": 50.0}, 10.0).rejected == ()  # too few for a median
    s = screen_norms({"a": 1.0, "b": 1.2, "c": 50.0}, 10.0)
    assert s.accepted == ("a", "b") and s.rejected == ("c",) and s.median_norm == 1.2
    assert screen_norms({"a": 1.0, "b": 2.0, "c": math.nan}, 10.0).rejected == ("c",)
    assert screen_norms({"a": 0.0, "b": 0.0, "c": 0.0}, 10.0).accepted == ("a", "b", "c")
    assert screen_norms({"a": 1.0, "b": 1.0, "c": 1e30}, math.inf).rejected == ()
    # An even count: the median is the mean of the middle two.
    s = screen_norms({"a": 1.0, "b": 2.0, "c": 3.0, "d": 100.0}, 10.0)
    assert s.median_norm == 2.5 and s.rejected == ("d",)
    # Clipping: over clip_ratio x median (but within max_norm_ratio), scaled down to it.
    s = screen_norms({"a": 1.0, "b": 2.0, "c": 3.0, "d": 12.0, "e": 40.0}, 10.0, 3.0)
    assert s.accepted == ("a", "b", "c", "d") and s.rejected == ("e",)
    assert s.clipped == ("d",) and s.scales == {"d": 0.75}  # to 3 x the median 3
    assert screen_norms({"a": 1.0, "b": 2.0, "c": 8.0}, 10.0, math.inf).clipped == ()
    assert screen_norms({"a": 1.0, "b": 9.0}, 10.0, 3.0).clipped == ()  # too few for a median
    # Too few for a median, this member's own delta is the measure: it knows it is honest.
    s = screen_norms({"a": 1.0, "b": 50.0}, 10.0, 3.0, own="a")
    assert s.rejected == ("b",) and s.by_own and s.median_norm == 1.0
    assert screen_norms({"a": 1.0, "b": 9.0}, 10.0, 3.0, own="a").accepted == ("a", "b")
    assert screen_norms({"b": 50.0, "a": 1.0}, 10.0, own="b").rejected == ()  # b can't tell
    assert not screen_norms({"a": 1.0, "b": 1.2, "c": 50.0}, 10.0, own="a").by_own


def test_a_member_whose_deltas_keep_being_rejected_is_banned() -> None:
    bans = BanList()
    assert not bans.strike("c", "not finite", 3) and not bans.strike("c", "huge", 3)
    assert not bans.strike("d", "huge", 3)
    assert bans.strike("c", "huge again", 3) and "c" in bans.banned and "d" not in bans.banned
    assert bans.banned["c"] == "3 rejected deltas, the last: huge again"
    bans.clear("d")  # d sent a good delta: its strike was not one in a row
    assert not bans.strike("d", "huge", 3) and not bans.strike("d", "huge", 3)
    assert not bans.strike("c", "more", 3)  # banned once
    assert not any(bans.strike("e", "huge", 0) for _ in range(10))  # 0: never


def test_round_admission() -> None:
    assert admit_round(0, -1, False) is Admission.ACCEPT
    assert admit_round(3, 3, True) is Admission.ACCEPT
    assert admit_round(4, 3, True) is Admission.ACCEPT
    assert admit_round(3, 3, False) is Admission.DROP
    assert admit_round(1, 3, True) is Admission.DROP
    assert admit_round(5, 3, True) is Admission.REFUSE


@pytest.mark.parametrize(
    "field",
    [
        {"every_steps": 0},
        {"outer_lr": 0.0},
        {"momentum": 1.0},
        {"codec": "topk-ef"},
        {"codec": "aq-delta"},
        {"timeout_s": math.inf},
        {"max_norm_ratio": 0.5},
        {"clip_ratio": 0.9},
        {"clip_ratio": math.nan},
        {"ban_after": -1},
        {"lands_after": -1},
        {"lands_after": 1.5},
    ],
)
def test_config_validation(field: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        AveragingConfig(**field)


def test_config_rounds() -> None:
    config = AveragingConfig(every_steps=4)
    assert [s for s in range(13) if config.round_due(s)] == [4, 8, 12]
    assert [config.round_of(s) for s in (4, 8, 12)] == [0, 1, 2]


def test_a_delta_too_large_for_a_message_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_message_bytes"):
        ReplicaAverager(
            node_id="a",
            members=[Replica("a", "127.0.0.1:1")],
            config=AveragingConfig(),
            numel=1_000_000,
            max_message_bytes=2**20,
        )
    with pytest.raises(ConfigError, match="not a member"):
        ReplicaAverager(
            node_id="z",
            members=[Replica("a", "127.0.0.1:1")],
            config=AveragingConfig(),
            numel=10,
            max_message_bytes=LIMIT,
        )


# ---- the exchange, several members in this event loop ----


def _closed_port() -> int:
    """A port nobody listens on (bound, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@asynccontextmanager
async def _group(
    n: int, numel: int, config: AveragingConfig, down: tuple[int, ...] = ()
) -> AsyncIterator[dict[int, ReplicaAverager]]:
    """Members n0 .. n{n-1}, each with its own grpc.aio server; those in `down` never start."""
    servers: dict[int, Any] = {}
    members = []
    for i in range(n):
        if i in down:
            members.append(Replica(f"n{i}", f"127.0.0.1:{_closed_port()}"))
            continue
        servers[i] = grpc.aio.server(options=server_options(TransportConfig()))
        port = servers[i].add_insecure_port("127.0.0.1:0")
        members.append(Replica(f"n{i}", f"127.0.0.1:{port}"))
    averagers = {
        i: ReplicaAverager(
            node_id=f"n{i}", members=members, config=config, numel=numel, max_message_bytes=LIMIT
        )
        for i in servers
    }
    for i, server in servers.items():
        server.add_generic_rpc_handlers([averagers[i].handler(caller=claimed)])
        await server.start()
    try:
        yield averagers
    finally:
        for averager in averagers.values():
            await averager.close()
        for server in servers.values():
            await server.stop(0)


async def _round(
    averagers: dict[int, ReplicaAverager], r: int, deltas: dict[int, torch.Tensor]
) -> dict[int, Any]:
    results = await asyncio.gather(*(a.average(r, deltas[i]) for i, a in averagers.items()))
    return dict(zip(averagers, results, strict=True))


@pytest.mark.parametrize("codec", ["none", "int8-block"])
async def test_a_ring_of_five_averages(codec: str) -> None:
    numel, n = 3001, 5
    config = AveragingConfig(codec=codec, timeout_s=10.0)
    gen = torch.Generator().manual_seed(3)
    async with _group(n, numel, config) as averagers:
        assert averagers[0].topology is Topology.RING
        for r in range(2):
            deltas = {i: torch.randn(numel, generator=gen) for i in averagers}
            results = await _round(averagers, r, deltas)
            true = torch.stack(list(deltas.values())).mean(0)
            # A partial sum of k deltas is quantised once per hop (error <= k M / 254, M the
            # largest |x|), the full sum once more; error feedback can double that.
            largest = max(float(d.abs().max()) for d in deltas.values())
            tol = 1e-6 if codec == "none" else (n + 1) * largest / 127
            for i, res in results.items():
                assert res.participants == tuple(f"n{k}" for k in range(n)) and not res.fell_back
                assert torch.equal(res.mean, results[0].mean)  # bit-identical everywhere
                assert float((res.mean - true).abs().max()) <= tol
                payload = round_payload_bytes(delta_codec(codec), numel, n, rank=i)
                # lz4 may shrink int8 payloads (the padding of the last block, small codes).
                assert 0.25 * payload < res.bytes_sent <= payload + 2 * (n - 1) * HEADER_SLACK


async def test_a_broken_ring_falls_back_to_whole_deltas() -> None:
    numel, n = 2000, 5
    config = AveragingConfig(codec="none", timeout_s=5.0)
    gen = torch.Generator().manual_seed(4)
    async with _group(n, numel, config, down=(2,)) as averagers:
        deltas = {i: torch.randn(numel, generator=gen) for i in averagers}
        results = await _round(averagers, 0, deltas)
        true = torch.stack(list(deltas.values())).mean(0)
        for res in results.values():
            assert res.fell_back and res.missing == ("n2",)
            assert res.participants == ("n0", "n1", "n3", "n4")
            assert torch.equal(res.mean, results[0].mean)
            torch.testing.assert_close(res.mean, true)
            # n2 refuses connections: nobody waits for it until the deadline.
            assert res.wait_s < config.timeout_s * 0.5


async def test_a_push_to_a_member_still_on_an_earlier_round_is_delivered_once_it_gets_there(
) -> None:  # fmt: skip
    """n0 finishes round 0 without n1 (which has not started) and pushes round 1: n1 refuses
    it (OUT_OF_RANGE, it is not there yet), and n0 tries again until n1 has opened that round,
    so both average round 1 together."""
    numel = 500
    config = AveragingConfig(codec="none", timeout_s=1.0)
    gen = torch.Generator().manual_seed(5)
    deltas = [{i: torch.randn(numel, generator=gen) for i in (0, 1)} for _ in range(2)]
    async with _group(2, numel, config) as averagers:
        a, b = averagers[0], averagers[1]
        behind = asyncio.Event()
        push = a._pusher.push

        async def watched(member: Replica, message: bytes, deadline: float) -> int:
            try:
                return await push(member, message, deadline)
            except PeerBehind:
                behind.set()
                raise

        a._pusher.push = watched  # type: ignore[method-assign]
        first = await a.average(0, deltas[0][0])
        assert first.participants == ("n0",) and first.missing == ("n1",)
        second = asyncio.create_task(a.average(1, deltas[1][0]))
        await behind.wait()  # n1 refused round 1: it has not had round 0 yet
        b_first = await b.average(0, deltas[0][1])
        b_second = await b.average(1, deltas[1][1])
        a_second = await second
    assert b_first.participants == ("n0", "n1")  # n0's round-0 push waited in n1's inbox
    for res in (a_second, b_second):
        assert res.participants == ("n0", "n1")
        torch.testing.assert_close(res.mean, (deltas[1][0] + deltas[1][1]) / 2)


async def _push(address: str, message: bytes, sender: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await channel.unary_unary(PATH)(message, timeout=10, metadata=((NODE_ID_KEY, sender),))
        except grpc.aio.AioRpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _delta_frame(seq: int, tensor: torch.Tensor, name: str = "delta") -> bytes:
    return encode_frame(FrameKind.DELTA, seq, 0, [Outgoing(name, tensor, get_codec("none"))])


async def test_bad_pushes_are_refused_with_a_status_and_change_nothing() -> None:
    numel = 64
    server = grpc.aio.server(options=server_options(TransportConfig()))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    service = AveragingService()
    server.add_generic_rpc_handlers([service.handler(caller=claimed)])
    await server.start()
    config = AveragingConfig(codec="none", timeout_s=5.0)
    averager = ReplicaAverager(
        node_id="a",
        members=[Replica("a", address), Replica("b", "127.0.0.1:1")],
        config=config,
        numel=numel,
        max_message_bytes=LIMIT,
    )
    ok = torch.ones(numel)
    code = grpc.StatusCode
    try:
        assert await _push(address, _delta_frame(0, ok), "b") == code.FAILED_PRECONDITION
        service.attach(averager)
        assert await _push(address, _delta_frame(0, ok), "mallory") == code.PERMISSION_DENIED
        assert await _push(address, _delta_frame(0, ok), "a") == code.PERMISSION_DENIED
        assert await _push(address, b"RVF1garbage", "b") == code.INVALID_ARGUMENT
        assert await _push(address, _delta_frame(0, torch.ones(63)), "b") == code.INVALID_ARGUMENT
        ring_part = _delta_frame(0, torch.ones(numel), name="scatter-0")
        assert await _push(address, ring_part, "b") == code.INVALID_ARGUMENT
        assert await _push(address, _delta_frame(2, ok), "b") == code.OUT_OF_RANGE
        # A NaN delta is refused and counts as b's rejected delta of round 0.
        nan = torch.full((numel,), float("nan"))
        assert await _push(address, _delta_frame(0, nan), "b") == code.INVALID_ARGUMENT
        assert await _push(address, _delta_frame(0, ok), "b") == code.ALREADY_EXISTS
        result = await averager.average(0, torch.zeros(numel))
        assert result.rejected == ("b",) and result.participants == ("a",) and not result.missing
        assert result.wait_s < 1.0  # b was settled: no waiting for the deadline
        assert averager.bans.strikes["b"] == 1  # it came from b's host
        assert await _push(address, _delta_frame(0, ok), "b") == code.OK  # old round: dropped
        assert await _push(address, _delta_frame(1, ok * 3), "b") == code.OK  # the next round
        result = await averager.average(1, torch.ones(numel))
        assert result.participants == ("a", "b")
        torch.testing.assert_close(result.mean, torch.full((numel,), 2.0))
        assert averager.bans.strikes["b"] == 0  # a good delta: the strike was not one in a row
        # A NaN delta in b's name from another host: rejected, not counted toward a ban.
        with pytest.raises(Refusal):
            await averager.receive(_delta_frame(2, nan), "b", source="203.0.113.9")
        result = await averager.average(2, torch.ones(numel))
        assert result.rejected == ("b",) and averager.bans.strikes["b"] == 0
        # A push that arrived before its sender was banned (it raced the round that banned
        # it, as in test_replicas' poisoning run) is left out: neither used nor rejected again.
        assert await _push(address, _delta_frame(3, ok * 5), "b") == code.OK
        averager.bans.banned["b"] = "3 rejected deltas"
        result = await averager.average(3, torch.ones(numel))
        assert result.participants == ("a",) and result.rejected == () and not result.missing
        torch.testing.assert_close(result.mean, torch.ones(numel))
    finally:
        await averager.close()
        await server.stop(0)


# ---- real processes ----


def _start_peers(
    procs: Procs, out: Path, peers: dict[str, list[str]], go: tuple[str, ...] | None = None
) -> dict[str, subprocess.Popen[bytes]]:
    """Start one process per member (saving its rounds under `out`), give each the member
    list, wait until every one serves it, then tell those in `go` (default: all) to start."""
    started = {
        node_id: procs.popen(
            [sys.executable, str(PEER), "--node-id", node_id, "--out", str(out), *args],
            stdin=subprocess.PIPE,
        )
        for node_id, args in peers.items()
    }
    ports = {node_id: json.loads(read_line(p, 60))["port"] for node_id, p in started.items()}
    members = json.dumps({"members": [[i, f"127.0.0.1:{port}"] for i, port in ports.items()]})
    for proc in started.values():
        _tell(proc, members)
    for proc in started.values():
        wait_for_line(proc, '"attached"', 30)
    for node_id in go if go is not None else tuple(started):
        _tell(started[node_id], "go")
    return started


def _tell(proc: subprocess.Popen[bytes], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


def _rounds(
    proc: subprocess.Popen[bytes], timeout_s: float = 30, until: str = '"done"'
) -> list[dict[str, Any]]:
    """A member's round events up to the line with `until` ("done"), each with the tensors it
    saved, if any."""
    lines = wait_for_line(proc, until, timeout_s)
    events = [json.loads(line) for line in lines]
    rounds = [e for e in events if e["event"] in ("round", "pushed")]
    for e in rounds:
        if "saved" in e:
            e.update(torch.load(e["saved"]))
    return rounds


def _finish(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
    for proc in procs.values():
        assert proc.wait(10) == 0


def _check_mean(rounds: dict[str, dict[str, Any]], tol: float) -> None:
    """Every member that averaged holds the mean of their parameters before the round."""
    true = torch.stack([e["before"] for e in rounds.values()]).mean(0)
    means = [e["mean"] for e in rounds.values()]
    assert all(torch.equal(m, means[0]) for m in means)  # the same decoded mean, bit for bit
    for event in rounds.values():
        assert float((event["after"] - true).abs().max()) <= tol


def _codec_tolerance(rounds: dict[str, dict[str, Any]], previous: torch.Tensor) -> float:
    """int8 with error feedback: each member's decoded delta is off by at most this round's
    and the previous round's error, s/254 each, s the largest |delta| (plus a little)."""
    largest = max(float((previous - e["before"]).abs().max()) for e in rounds.values())
    return 2 * largest / 127 + 1e-5


def _initial() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    shapes = [(40, 50), (50,), (17, 13)]
    return torch.cat([(torch.randn(s, generator=gen) * 0.1).reshape(-1) for s in shapes])


def test_three_processes_average_to_the_same_mean(procs: Procs, tmp_path: Path) -> None:
    peers = {m: ["--seed", str(seed), "--rounds", "3"] for seed, m in enumerate("abc", 1)}
    started = _start_peers(procs, tmp_path, peers)
    by_member = {m: _rounds(p) for m, p in started.items()}
    previous = _initial()
    numel = previous.numel()
    payload = round_payload_bytes(delta_codec("int8-block"), numel, 3)
    for r in range(3):
        rounds = {m: events[r] for m, events in by_member.items()}
        for event in rounds.values():
            assert event["round"] == r
            assert event["participants"] == ["a", "b", "c"]
            assert event["missing"] == [] and event["rejected"] == []
            assert 0.5 * payload < event["bytes_sent"] <= payload + 2 * HEADER_SLACK
        _check_mean(rounds, _codec_tolerance(rounds, previous))
        previous = rounds["a"]["after"]
        print(f"round {r}: bytes sent per member", {m: e["bytes_sent"] for m, e in rounds.items()})
    _finish(started)


def test_a_member_that_never_answers_is_left_out(procs: Procs, tmp_path: Path) -> None:
    timeout_s = 1.5
    args = ["--rounds", "2", "--timeout-s", str(timeout_s)]
    peers = {m: ["--seed", str(seed), *args] for seed, m in enumerate("abc", 1)}
    started = _start_peers(procs, tmp_path, peers, go=("a", "b"))
    started["c"].send_signal(signal.SIGSTOP)  # frozen: its port accepts, nothing answers
    by_member = {m: _rounds(started[m]) for m in "ab"}
    previous = _initial()
    for r in range(2):
        rounds = {m: events[r] for m, events in by_member.items()}
        for event in rounds.values():
            assert event["participants"] == ["a", "b"] and event["missing"] == ["c"]
            assert timeout_s * 0.9 <= event["wait_s"] < timeout_s + 1.0
        _check_mean(rounds, _codec_tolerance(rounds, previous))
        previous = rounds["a"]["after"]
    _finish({m: started[m] for m in "ab"})


def test_poisoned_deltas_are_rejected_clipped_and_their_sender_banned(
    procs: Procs, tmp_path: Path
) -> None:
    peers = {m: ["--seed", str(seed), "--rounds", "5"] for seed, m in enumerate("ab", 1)}
    peers["c"] = ["--seed", "3", "--poison"]
    started = _start_peers(procs, tmp_path, peers)
    pushed = [json.loads(wait_for_line(started["c"], '"pushed"', 30)[-1]) for _ in range(4)]
    early = {m: _rounds(started[m], until='"round": 3') for m in "ab"}
    # Round 0: c's NaN delta is refused on arrival, and c is told why.
    assert all("INVALID_ARGUMENT" in s and "not finite" in s for s in pushed[0]["status"].values())
    # Rounds 1-3 arrive; the norm guard rejects the huge ones and clips the moderate one.
    assert all(p["status"] == {"a": "OK", "b": "OK"} for p in pushed[1:])
    _tell(started["c"], "again")  # the honest members have banned c: its next push is refused
    last = json.loads(wait_for_line(started["c"], '"pushed"', 30)[-1])
    assert all("PERMISSION_DENIED" in s and "banned" in s for s in last["status"].values())
    by_member = {m: early[m] + _rounds(started[m]) for m in "ab"}
    previous = _initial()
    for r in range(5):
        rounds = {m: events[r] for m, events in by_member.items()}
        for event in rounds.values():
            assert event["missing"] == []
            assert event["rejected"] == (["c"] if r in (0, 1, 3) else [])
            assert event["clipped"] == (["c"] if r == 2 else [])
            assert event["banned"] == (["c"] if r >= 3 else [])
            assert event["participants"] == (["a", "b", "c"] if r == 2 else ["a", "b"])
        if r == 2:  # c's delta entered scaled to 3 x the median norm (the larger honest one)
            means = [e["mean"] for e in rounds.values()]
            assert torch.equal(means[0], means[1])
            honest = [previous - e["before"] for e in rounds.values()]
            clipped = float(torch.linalg.vector_norm(3 * means[0] - sum(honest)))
            median = max(float(torch.linalg.vector_norm(d)) for d in honest)
            assert abs(clipped / (3.0 * median) - 1) < 0.05, (clipped, median)
        else:
            _check_mean(rounds, _codec_tolerance(rounds, previous))
        if r == 4:  # nobody waited for a banned member
            assert all(e["wait_s"] < 5.0 for e in rounds.values())
        previous = rounds["a"]["after"]
    _finish(started)
