"""Requests that are not the message their method takes: refused with INVALID_ARGUMENT, counted
per peer, and logged at most once per peer a minute.

gRPC parses a request with the method's deserializer before any handler runs; a parse error
there is answered UNKNOWN and logged by grpc itself at ERROR with a full traceback, one per
call: 2,000 hostile calls once wrote 1,978 tracebacks into a node's log. A server interceptor
(`MalformedRequests.interceptor`) gives every method a deserializer that cannot raise: bytes that
do not parse become a `Malformed` marker, and the method's behaviour, wrapped, refuses the call
when it meets one (for a request stream, at the message that did not parse: the ones before it
were handled). Nothing of the bytes is kept but their size.

grpc offers no hook for this (its deserialization errors go to its own logger), hence the
wrapping here; it runs on the server's event loop and needs no lock.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ravnest_node.transport.limits import WrappingInterceptor, peer_key

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
"""A peer's malformed requests are logged at most once in so many seconds."""
MAX_TRACKED_PEERS = 4096
"""Peers whose counts are kept; beyond it the least recently seen is forgotten."""


class Malformed:
    """Stands for a request whose bytes did not parse as its method's message."""

    __slots__ = ("error", "size")

    def __init__(self, size: int, error: str) -> None:
        self.size = size
        self.error = error

    def ByteSize(self) -> int:  # (the protobuf name the limiter's sizing reads)
        """The request's size in bytes, as a parsed message would say."""
        return self.size


class MalformedRequests:
    """Counts of malformed requests per peer, and the interceptor that refuses them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.total = 0
        """Malformed requests refused so far, from every peer."""
        self.by_peer: OrderedDict[str, int] = OrderedDict()
        """peer -> malformed requests refused (the most recent MAX_TRACKED_PEERS peers)."""
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """The interceptor to give `grpc.aio.server(interceptors=[...])`; put it after the
        per-peer limiter so that malformed calls spend the caller's budgets too."""

        def guard(handler: Any, method: str) -> Any | None:
            if handler.request_deserializer is None:
                return None  # (a raw-bytes method parses nothing here: its handler checks)
            return _guarded(self, handler, method)

        return WrappingInterceptor(guard)

    def refuse_reason(self, peer: str, method: str, request: Malformed) -> str:
        """Count a malformed request from `peer` to `method`, log it if this peer's last line
        is over LOG_EVERY_S old, and say why the call is refused."""
        self.total += 1
        self.by_peer[peer] = self.by_peer.get(peer, 0) + 1
        self.by_peer.move_to_end(peer)
        if len(self.by_peer) > MAX_TRACKED_PEERS:
            gone, _ = self.by_peer.popitem(last=False)
            self._logged_at.pop(gone, None)
            self._unlogged.pop(gone, None)
        now = self._clock()
        last = self._logged_at.get(peer)
        if last is None or now - last >= LOG_EVERY_S:
            more = self._unlogged.pop(peer, 0)
            self._logged_at[peer] = now
            log.warning(
                "refused a malformed request to %s from %s (%d bytes: %s)%s",
                method, peer, request.size, request.error,
                f"; {more} more from this peer since the last line" if more else "",
            )  # fmt: skip
        else:
            self._unlogged[peer] = self._unlogged.get(peer, 0) + 1
        return f"malformed request: {request.error}"


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # whatever the parser raises, the bytes are not the message
            return Malformed(len(data), f"{type(e).__name__}: {e}"[:200])

    return parse


_KINDS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _guarded(counts: MalformedRequests, handler: Any, method: str) -> Any:
    """`handler` with a deserializer that cannot raise and a behaviour that refuses what it
    could not parse."""
    attr, make = _KINDS[(bool(handler.request_streaming), bool(handler.response_streaming))]
    behaviour = getattr(handler, attr)
    streaming_request = bool(handler.request_streaming)

    async def refuse(request: Malformed, context: Any) -> None:
        reason = counts.refuse_reason(peer_key(context.peer()), method, request)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)

    async def checked(source: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        async for message in source:
            if isinstance(message, Malformed):
                await refuse(message, context)
            yield message

    async def admitted(request: Any, context: Any) -> Any:
        if streaming_request:
            return checked(request, context)
        if isinstance(request, Malformed):
            await refuse(request, context)
        return request

    if inspect.isasyncgenfunction(behaviour):

        async def wrapped_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            async for response in behaviour(await admitted(request, context), context):
                yield response

        wrapped: Any = wrapped_stream
    else:

        async def wrapped_call(request: Any, context: Any) -> Any:
            return await behaviour(await admitted(request, context), context)

        wrapped = wrapped_call
    return make(
        wrapped,
        request_deserializer=_tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )
