"""One mapping from a failed gRPC call to this project's faults (transport/errors.py), over real
calls, and the chunked transfers' reader and server halves (transport/chunks.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from ravnest_node.errors import PeerRefused, PeerUnavailable
from ravnest_node.transport.chunks import read_chunks, serve_chunks
from ravnest_node.transport.errors import UNANSWERED, peer_error, peer_errors

METHOD = "/ravnest.test.Echo/Call"


class _Failed(grpc.aio.AioRpcError):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="why")


def test_every_status_is_unanswered_or_an_answer() -> None:
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        fault = peer_error(_Failed(code), "peer x")
        assert str(fault) == f"peer x: {code.name}: why"
        want = PeerUnavailable if code in UNANSWERED else PeerRefused
        assert type(fault) is want, code
    # What nobody answered: the three a caller may retry.
    assert {c.name for c in UNANSWERED} == {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"}


async def _server(behaviour: str, started: asyncio.Event) -> tuple[grpc.aio.Server, str]:
    async def call(request: bytes, context: Any) -> bytes:
        started.set()
        if behaviour == "refuse":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not you")
        await asyncio.Event().wait()  # never answers
        return b""

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(call)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("ravnest.test.Echo", {"Call": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _fault_of(address: str, *, timeout_s: float | None = None) -> BaseException:
    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises((PeerUnavailable, PeerRefused)) as caught, peer_errors("peer"):
            await channel.unary_unary(METHOD)(b"", timeout=timeout_s)
    return caught.value


async def test_real_calls_map_to_the_fault_they_are() -> None:
    started = asyncio.Event()
    server, address = await _server("refuse", started)
    try:
        assert isinstance(await _fault_of(address), PeerRefused)  # it answered: no
    finally:
        await server.stop(None)
    server, address = await _server("hang", started)
    try:  # no answer in time
        fault = await _fault_of(address, timeout_s=0.2)
        assert isinstance(fault, PeerUnavailable) and "DEADLINE_EXCEEDED" in str(fault)
    finally:
        await server.stop(None)
    assert isinstance(await _fault_of(address, timeout_s=5), PeerUnavailable)  # nobody there


async def test_a_server_that_stops_mid_call_is_no_answer() -> None:
    """The status a caller gets when its peer's server stops with the call open (UNAVAILABLE
    with grpcio 1.85: GOAWAY) is a peer that did not answer."""
    started = asyncio.Event()
    server, address = await _server("hang", started)
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD)(b"")
        await started.wait()
        await server.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call
    assert failed.value.code() in UNANSWERED
    assert isinstance(peer_error(failed.value, "peer"), PeerUnavailable)


async def test_a_call_cancelled_here_is_a_cancel_not_a_fault() -> None:
    started = asyncio.Event()
    server, address = await _server("hang", started)
    try:
        async with grpc.aio.insecure_channel(address) as channel:

            async def ask() -> None:
                with peer_errors("peer"):
                    await channel.unary_unary(METHOD)(b"")

            task = asyncio.create_task(ask())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        await server.stop(None)


class _Stream:
    """A server-streaming call's client side: its messages, then EOF, or a pause for ever."""

    def __init__(self, messages: list[bytes], *, hang_after: int | None = None) -> None:
        self._messages, self._hang_after = list(messages), hang_after
        self.read_count = 0
        self.cancelled = False

    async def read(self) -> Any:
        if self._hang_after is not None and self.read_count >= self._hang_after:
            await asyncio.Event().wait()
        self.read_count += 1
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    def cancel(self) -> None:
        self.cancelled = True


async def _all(chunks: AsyncIterator[Any]) -> list[Any]:
    return [c async for c in chunks]


async def test_chunks_are_read_to_the_end_and_the_call_ended() -> None:
    call = _Stream([b"a", b"b", b"c"])
    got = await _all(read_chunks(call, what="x", first_timeout_s=1, timeout_s=1))
    assert got == [b"a", b"b", b"c"] and call.cancelled


async def test_a_chunk_that_does_not_come_in_time_is_a_peer_that_stopped() -> None:
    call = _Stream([b"a", b"b"], hang_after=1)
    with pytest.raises(PeerUnavailable, match=r"block 3: no chunk for 0\.05 s"):
        await _all(read_chunks(call, what="block 3", first_timeout_s=5, timeout_s=0.05))
    assert call.cancelled and call.read_count == 1


async def test_a_failed_stream_is_mapped_and_a_reader_that_stops_early_ends_the_call() -> None:
    class Failing(_Stream):
        async def read(self) -> Any:
            raise _Failed(grpc.StatusCode.NOT_FOUND)

    with pytest.raises(PeerRefused, match="copy: NOT_FOUND: why"):
        await _all(read_chunks(Failing([]), what="copy", first_timeout_s=1, timeout_s=1))
    call = _Stream([b"a", b"b"])
    chunks = read_chunks(call, what="x", first_timeout_s=1, timeout_s=1)
    async for _ in chunks:
        break
    await chunks.aclose()  # type: ignore[attr-defined]
    assert call.cancelled


async def test_chunks_are_made_one_at_a_time_off_the_event_loop() -> None:
    made: list[bool] = []

    def blocking() -> Any:
        for i in range(3):
            try:
                asyncio.get_running_loop()
                made.append(False)  # on the event loop: wrong
            except RuntimeError:
                made.append(True)
            yield i

    assert await _all(serve_chunks(blocking())) == [0, 1, 2]
    assert made == [True, True, True]
