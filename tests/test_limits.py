"""Per-peer limits (transport/limits.py) on a real gRPC server over loopback: calls open at
once, messages per second and bytes in flight, each held per peer so that one peer's flood
leaves the others served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from ravnest_node.transport.limits import PeerLimiter, peer_key
from ravnest_node.transport.options import same_host

SERVICE = "test.Limits"
# A second channel to the same address opens its own connection (gRPC would share one).
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Service:
    """Handlers of every kind: Hold keeps its stream open until released; Echo answers a
    unary call; Count takes a stream through the request iterator; Pull reads a stream with
    context.read and holds each message until `step` lets it read the next."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.holding = 0
        self.none_held = asyncio.Event()
        self.step = asyncio.Semaphore(0)
        self.pulled: list[bytes] = []
        self.changed = asyncio.Condition()

    async def _bump(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def hold(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        self.holding += 1
        self.none_held.clear()
        try:
            yield b"held"
            await self.release.wait()
        finally:  # the limiter counts the call as ended right after this, in the same task
            self.holding -= 1
            if not self.holding:
                self.none_held.set()

    async def echo(self, request: bytes, context: Any) -> bytes:
        return len(request).to_bytes(4, "big")

    async def count(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        n = 0
        async for _ in requests:
            n += 1
        return n.to_bytes(4, "big")

    async def pull(self, requests: object, context: Any) -> bytes:
        while (message := await context.read()) is not grpc.aio.EOF:
            self.pulled.append(message)
            await self._bump()
            await self.step.acquire()
        return b"done"

    def handler(self) -> Any:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Hold": grpc.unary_stream_rpc_method_handler(self.hold),
                "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
                "Count": grpc.stream_unary_rpc_method_handler(self.count),
                "Pull": grpc.stream_unary_rpc_method_handler(self.pull),
            },
        )


@pytest.fixture
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Service, PeerLimiter, str]]:
    limits = {"max_calls": 3, "calls_per_s": 1000.0, "messages_per_s": 1000.0}
    limits |= {"inflight_bytes": 10_000}
    limits |= getattr(request, "param", {})
    clock = Clock()
    limiter = PeerLimiter(**limits, clock=clock)
    server = grpc.aio.server(interceptors=[limiter.interceptor()])
    service = Service()
    server.add_generic_rpc_handlers([service.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield service, limiter, f"127.0.0.1:{port}"
    service.release.set()
    await server.stop(0)


def _code(exc: BaseException) -> grpc.StatusCode:
    assert isinstance(exc, grpc.aio.AioRpcError), exc
    return exc.code()


async def test_one_peer_cannot_hold_more_than_its_calls(
    served: tuple[Service, PeerLimiter, str],
) -> None:
    service, limiter, address = served
    async with (
        grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as flood,
        grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as other,
    ):
        calls = [flood.unary_stream(f"/{SERVICE}/Hold")(b"") for _ in range(5)]
        outcomes = []
        for call in calls:  # each either streams its first message or is refused
            try:
                outcomes.append(await call.read())
            except grpc.aio.AioRpcError as exc:
                outcomes.append(exc)
        held = [o for o in outcomes if o == b"held"]
        refused = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(held) == 3 and len(refused) == 2 and service.holding == 3
        assert all(_code(e) == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert all("peer_max_calls" in (e.details() or "") for e in refused)  # type: ignore[attr-defined]
        # Another peer (loopback: another connection) is served while the flood holds its 3.
        assert await other.unary_unary(f"/{SERVICE}/Echo")(b"abc") == (3).to_bytes(4, "big")
        other_hold = other.unary_stream(f"/{SERVICE}/Hold")(b"")
        assert await other_hold.read() == b"held"
        assert limiter.calls_refused == 2
        for call in [*calls, other_hold]:
            call.cancel()
        # Calls that end give their places back.
        await service.none_held.wait()
        assert all(p.calls == 0 for p in limiter._peers.values())
        assert await flood.unary_unary(f"/{SERVICE}/Echo")(b"") == bytes(4)


@pytest.mark.parametrize("served", [{"calls_per_s": 10.0, "messages_per_s": 10.0}], indirect=True)
async def test_unary_calls_over_the_rate_are_refused_and_stream_messages_wait(
    served: tuple[Service, PeerLimiter, str],
) -> None:
    _, limiter, address = served  # the limiter's clock stands still: no refill
    async with grpc.aio.insecure_channel(address) as channel:
        echo = channel.unary_unary(f"/{SERVICE}/Echo")
        results = await asyncio.gather(*(echo(b"x") for _ in range(25)), return_exceptions=True)
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(refused) == 15  # a burst of one second's worth: 10
        assert all(_code(e) == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert "peer_calls_per_s" in (refused[0].details() or "")  # type: ignore[attr-defined]
    async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
        # A stream over the rate is slowed, not refused: all its messages arrive, in order.
        count = channel.stream_unary(f"/{SERVICE}/Count")
        n = await count(iter([b"m"] * 12))
        assert int.from_bytes(n, "big") == 12
        assert limiter.messages_delayed == 2


@pytest.mark.parametrize("served", [{"inflight_bytes": 1000}], indirect=True)
async def test_bytes_in_flight_are_bounded_per_peer(
    served: tuple[Service, PeerLimiter, str],
) -> None:
    service, limiter, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        echo = channel.unary_unary(f"/{SERVICE}/Echo")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await echo(bytes(1001))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "peer_inflight_bytes" in (refused.value.details() or "")
        assert await echo(bytes(1000)) == (1000).to_bytes(4, "big")
        # A stream's message counts while its handler holds it; the next one replaces it.
        call = channel.stream_unary(f"/{SERVICE}/Pull")()
        await call.write(bytes(700))
        async with service.changed:
            await service.changed.wait_for(lambda: len(service.pulled) == 1)
        with pytest.raises(grpc.aio.AioRpcError):  # 700 held + 400 > 1000
            await echo(bytes(400))
        assert await echo(bytes(300)) == (300).to_bytes(4, "big")
        service.step.release()  # the handler is done with the first message
        await call.write(bytes(900))  # replaces the 700
        async with service.changed:
            await service.changed.wait_for(lambda: len(service.pulled) == 2)
        service.step.release()
        await call.write(bytes(1001))  # more than the budget: the stream is ended
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await call
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert limiter.calls_refused == 3
        # Nothing is left counted once the calls have ended (each is uncounted before its
        # status goes out).
        assert all(p.inflight == 0 and p.calls == 0 for p in limiter._peers.values())


def test_a_peer_is_its_host_or_for_loopback_its_connection() -> None:
    assert peer_key("ipv4:203.0.113.9:51012") == "203.0.113.9"
    assert peer_key("ipv6:[2001:db8::1]:443") == "2001:db8::1"
    assert peer_key("ipv4:127.0.0.1:40000") == "127.0.0.1:40000"
    # gRPC writes IPv6 peers percent-encoded.
    assert peer_key("ipv6:%5B::1%5D:40000") == "[::1]:40000"
    assert peer_key("ipv6:%5B2001:db8::1%5D:443") == "2001:db8::1"
    assert peer_key("ipv6:%5B::ffff:127.0.0.1%5D:40000") == "[::ffff:127.0.0.1]:40000"
    assert peer_key("unix:/tmp/socket") == "/tmp/socket"
    with pytest.raises(ValueError):
        PeerLimiter(max_calls=0, calls_per_s=1, messages_per_s=1, inflight_bytes=1)


def test_same_host_compares_what_the_text_tells() -> None:
    assert same_host("127.0.0.1", "localhost") and same_host("::1", "127.0.0.2")
    assert same_host("2001:db8::1", "2001:DB8:0::1") and same_host("Lab-PC", "lab-pc")
    assert not same_host("203.0.113.9", "192.0.2.1") and not same_host("192.0.2.1", "lab-pc")
