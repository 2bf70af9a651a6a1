"""Malformed requests (transport/malformed.py): refused with INVALID_ARGUMENT, counted per peer,
logged at most once per peer a minute, and nothing of grpc's own traceback logging."""

from __future__ import annotations

import logging
import re
import signal
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.limits import PeerLimiter
from ravnest_node.transport.malformed import LOG_EVERY_S, Malformed, MalformedRequests

from .conftest import Procs, node_status

SERVICE = "test.Guarded"
GARBAGE = b"\xff\xff\xff\xff"  # a field tag with no end: not any protobuf message


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Service:
    """Methods that take LeaveRequests, one of each kind, recording what they were given."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def one(self, request: pb.LeaveRequest, context: Any) -> pb.LeaveRequest:
        self.seen.append(request.node_id)
        return request

    async def many(self, requests: AsyncIterator[pb.LeaveRequest], context: Any) -> pb.LeaveRequest:
        async for request in requests:
            self.seen.append(request.node_id)
        return pb.LeaveRequest(node_id="done")

    async def stream(
        self, request: pb.LeaveRequest, context: Any
    ) -> AsyncIterator[pb.LeaveRequest]:
        self.seen.append(request.node_id)
        yield request


def handler(service: Service) -> grpc.GenericRpcHandler:
    parse, write = pb.LeaveRequest.FromString, pb.LeaveRequest.SerializeToString
    return grpc.method_handlers_generic_handler(SERVICE, {
        "One": grpc.unary_unary_rpc_method_handler(service.one, parse, write),
        "Many": grpc.stream_unary_rpc_method_handler(service.many, parse, write),
        "Stream": grpc.unary_stream_rpc_method_handler(service.stream, parse, write),
    })  # fmt: skip


@pytest.fixture
async def served() -> AsyncIterator[tuple[Service, MalformedRequests, Clock, grpc.aio.Channel]]:
    clock = Clock()
    counts = MalformedRequests(clock)
    limiter = PeerLimiter(max_calls=64, calls_per_s=1e6, messages_per_s=1e6, inflight_bytes=1 << 20)
    server = grpc.aio.server(interceptors=[limiter.interceptor(), counts.interceptor()])
    service = Service()
    server.add_generic_rpc_handlers([handler(service)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield service, counts, clock, channel
    finally:
        await channel.close()
        await server.stop(None)


def raw(channel: grpc.aio.Channel, method: str, kind: str = "unary_unary") -> Any:
    return getattr(channel, kind)(
        f"/{SERVICE}/{method}", request_serializer=bytes, response_deserializer=bytes
    )


async def test_malformed_unary_requests_are_refused_counted_and_logged_once_a_minute(
    served: tuple[Service, MalformedRequests, Clock, grpc.aio.Channel],
    caplog: pytest.LogCaptureFixture,
) -> None:
    service, counts, clock, channel = served
    caplog.set_level(logging.WARNING)
    call = raw(channel, "One")
    for _ in range(1000):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(GARBAGE)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request" in (refused.value.details() or "")
    assert counts.total == 1000 and sum(counts.by_peer.values()) == 1000
    assert service.seen == []  # the handler never ran
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # no grpc traceback either
    assert "malformed request" in lines[0].getMessage()
    # A minute later the same peer is logged again, with what was not logged meanwhile.
    clock.now += LOG_EVERY_S
    with pytest.raises(grpc.aio.AioRpcError):
        await call(GARBAGE)
    assert "999 more" in caplog.records[-1].getMessage()
    # A good request is served as ever.
    good = pb.LeaveRequest(node_id="m1").SerializeToString()
    assert pb.LeaveRequest.FromString(await call(good)).node_id == "m1"
    assert service.seen == ["m1"]


async def test_a_malformed_message_ends_a_request_stream_after_the_good_ones(
    served: tuple[Service, MalformedRequests, Clock, grpc.aio.Channel],
) -> None:
    service, counts, _, channel = served
    good = [pb.LeaveRequest(node_id=f"m{i}").SerializeToString() for i in range(3)]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await raw(channel, "Many", "stream_unary")(iter([*good, GARBAGE, good[0]]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert service.seen == ["m0", "m1", "m2"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in raw(channel, "Stream", "unary_stream")(GARBAGE):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert counts.total == 2


async def test_without_the_guard_grpc_answers_unknown_and_logs_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The negative control: what the guard exists for still happens without it."""
    caplog.set_level(logging.WARNING)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([handler(Service())])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await raw(channel, "One")(GARBAGE)
    finally:
        await server.stop(None)
    assert refused.value.code() == grpc.StatusCode.UNKNOWN
    assert any(r.levelno >= logging.ERROR and r.exc_info for r in caplog.records)


def test_the_marker_carries_only_the_size_and_the_error() -> None:
    marker = Malformed(4, "DecodeError: corrupt")
    assert marker.ByteSize() == 4 and not hasattr(marker, "__dict__")


def test_a_live_node_refuses_a_thousand_undecodable_requests_with_a_line_and_a_counter(
    procs: Procs, tmp_path: Path
) -> None:
    """The issue's attack on a real node process (a coordinator waiting for its swarm): 1,000
    requests that do not parse, to a method of each kind it serves, leave one log line per peer
    connection and a counter, where grpc logged a traceback for each."""
    proc, ready = procs.start_node(
        tmp_path / "n0", "--swarm-size", "2", "--model", "tiny", "--peer-calls-per-s", "100000"
    )  # (the per-peer call rate is not what this test is about)
    address = ready["address"]
    methods = ("Leave", "Heartbeat", "Join", "Report", "Drain", "Suspect")
    with grpc.insecure_channel(address) as channel:
        codes = Counter()
        for i in range(1000):
            call = channel.unary_unary(f"/ravnest.v1.Coordinator/{methods[i % len(methods)]}")
            try:
                call(GARBAGE, timeout=10)
            except grpc.RpcError as exc:
                assert isinstance(exc, grpc.Call)
                codes[exc.code().name] += 1
        watch = channel.unary_stream("/ravnest.v1.Coordinator/WatchPlan")(GARBAGE, timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            next(watch)
        codes[refused.value.code().name] += 1
    assert codes == {"INVALID_ARGUMENT": 1001}
    status = node_status(address)
    assert status.requests_malformed == 1001
    assert sum(status.requests_malformed_by_peer.values()) == 1001
    log = (tmp_path / "n0" / "node.log").read_text()
    assert "Traceback" not in log and "DecodeError]" not in log
    assert len(re.findall("malformed request", log)) <= 3, log[-2000:]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
