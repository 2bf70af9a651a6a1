"""Per-peer limits on what a node's gRPC server takes from each peer, so that a flood from one
peer (a stranger in an open swarm, a broken or hostile member in a protected one) does not
stall the others.

A server interceptor (`PeerLimiter.interceptor`) holds each peer to four budgets:

- **calls open**: at most `max_calls` calls open at once. One more is refused with
  RESOURCE_EXHAUSTED before its handler runs. Long-lived streams (WatchPlan, WatchProgress, the
  boundary streams) count for as long as they are open.
- **calls per second**: a token bucket of `calls_per_s` new calls per second (unary or
  streaming), with one second's worth as the burst; a call over it is refused with
  RESOURCE_EXHAUSTED. Every call costs the node's event loop work, whatever it asks.
- **stream messages per second**: a bucket of `messages_per_s` messages on the peer's streams.
  A message over it is delayed, not refused: the handler reads no further until the bucket
  allows it, so gRPC's flow control slows that peer's sender, and nobody else's.
- **bytes in flight**: the request messages of a peer's open calls that handlers hold (a unary
  request until its call ends, a stream's message until its handler reads the next) stay
  within `inflight_bytes`. A message that would exceed it ends its call with
  RESOURCE_EXHAUSTED. The budget holds at least one largest message.

Who a peer is: the host of the connection's address (behind the TLS gate, the address the gate
saw). Connections from loopback count one by one (host and port): the nodes of a one-machine
swarm, and the connections a node behind NAT gets through its relay, all come from loopback.
Refusals are counted (`calls_refused`, `messages_delayed`) and logged with the peer, throttled
as refusals.py does.

The limiter runs on the server's event loop and needs no lock.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from ravnest_node.transport.gate import peer_host
from ravnest_node.transport.options import is_loopback_host
from ravnest_node.transport.refusals import RefusalLog

log = logging.getLogger(__name__)

MAX_TRACKED_PEERS = 4096
"""Peers whose buckets are remembered; beyond it the least recently seen idle peer is
forgotten (its bucket was full again after a second anyway)."""


@dataclass(slots=True)
class _Bucket:
    """A token bucket: `rate` tokens a second, up to `rate` (one second's worth, at least 1)."""

    rate: float
    tokens: float
    stamp: float

    def refill(self, now: float) -> None:
        self.tokens = min(max(1.0, self.rate), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now


@dataclass(slots=True)
class _Peer:
    calls_rate: _Bucket
    messages_rate: _Bucket
    calls: int = 0
    inflight: int = 0


class PeerLimiter:
    """The three per-peer budgets of one server (see the module's docstring)."""

    def __init__(
        self,
        *,
        max_calls: int,
        calls_per_s: float,
        messages_per_s: float,
        inflight_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_calls < 1 or not (calls_per_s > 0 and messages_per_s > 0) or inflight_bytes < 1:
            raise ValueError("every limit must be positive")
        self.max_calls = max_calls
        self.calls_per_s = calls_per_s
        self.messages_per_s = messages_per_s
        self.inflight_bytes = inflight_bytes
        self._clock = clock
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._log = RefusalLog("calls", log, clock)
        self.calls_refused = 0
        """Calls refused or ended by a budget so far."""
        self.messages_delayed = 0
        """Stream messages held back by a peer's message rate so far."""

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """The interceptor to give `grpc.aio.server(interceptors=[...])`."""
        return WrappingInterceptor(lambda handler, method: _limited(self, handler, method))

    # ---- the budgets ----

    def _state(self, peer: str) -> _Peer:
        state = self._peers.get(peer)
        if state is None:
            if len(self._peers) >= MAX_TRACKED_PEERS:
                idle = next((k for k, s in self._peers.items() if not s.calls), None)
                if idle is not None:
                    del self._peers[idle]
            now = self._clock()
            state = self._peers[peer] = _Peer(
                calls_rate=_Bucket(self.calls_per_s, max(1.0, self.calls_per_s), now),
                messages_rate=_Bucket(self.messages_per_s, max(1.0, self.messages_per_s), now),
            )
        else:
            self._peers.move_to_end(peer)
        now = self._clock()
        state.calls_rate.refill(now)
        state.messages_rate.refill(now)
        return state

    def _refused(self, peer: str, method: str, reason: str) -> str:
        self.calls_refused += 1
        self._log.warn("refused a call to %s from %s: %s", method, peer, reason)
        return f"too much from {peer}: {reason}"

    def _open(self, peer: str, method: str, size: int | None) -> str | None:
        """Open a call (with its request of `size` bytes if unary); why not, or None."""
        state = self._state(peer)
        if state.calls >= self.max_calls:
            return self._refused(peer, method, f"{state.calls} calls are open (peer_max_calls)")
        if state.calls_rate.tokens < 1:
            return self._refused(
                peer, method, f"over {self.calls_per_s:g} calls/s (peer_calls_per_s)"
            )
        if size is not None:
            if state.inflight + size > self.inflight_bytes:
                return self._refused(peer, method, self._bytes_reason(state, size))
            state.inflight += size
        state.calls_rate.tokens -= 1
        state.calls += 1
        return None

    def _close(self, peer: str, held: int) -> None:
        state = self._peers.get(peer)
        if state is not None:
            state.calls -= 1
            state.inflight -= held

    def _bytes_reason(self, state: _Peer, size: int) -> str:
        return (
            f"a message of {size} bytes with {state.inflight} in flight exceeds "
            f"{self.inflight_bytes} (peer_inflight_bytes)"
        )

    def _take(self, peer: str, method: str, size: int, held: int) -> tuple[str | None, float]:
        """A stream message of `size` bytes arrived, replacing one of `held` bytes that its
        handler is done with: (why the call must end, or None; seconds it must wait for the
        message rate). Counts `size` as held unless it refuses."""
        state = self._state(peer)
        state.inflight -= held
        if state.inflight + size > self.inflight_bytes:
            return self._refused(peer, method, self._bytes_reason(state, size)), 0.0
        state.inflight += size
        bucket = state.messages_rate
        bucket.tokens -= 1
        if bucket.tokens >= 0:
            return None, 0.0
        self.messages_delayed += 1  # in debt: this stream waits until the bucket has refilled
        return None, -bucket.tokens / bucket.rate


def peer_key(grpc_peer: str) -> str:
    """Who a call comes from, for the budgets: the host of `context.peer()` (the real one
    behind the TLS gate), or host and port for loopback."""
    host, address = peer_host(grpc_peer)
    return address if is_loopback_host(host) else host


def _size(message: object) -> int:
    if isinstance(message, bytes | bytearray | memoryview):
        return len(message)
    byte_size = getattr(message, "ByteSize", None)
    return int(byte_size()) if callable(byte_size) else 0


class _Call:
    """One call's side of the budgets: its stream messages and the bytes its handler holds."""

    def __init__(self, limiter: PeerLimiter, peer: str, method: str, context: Any) -> None:
        self.limiter, self.peer, self.method = limiter, peer, method
        self.context = context
        self.held = 0

    async def admit(self, message: object) -> None:
        size = _size(message)
        reason, delay = self.limiter._take(self.peer, self.method, size, self.held)
        if reason is not None:
            self.held = 0  # _take released it
            await self.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
        self.held = size  # before waiting: a call cancelled meanwhile releases what it holds
        if delay:
            await asyncio.sleep(delay)

    async def read(self) -> Any:
        message = await self.context.read()
        if message is not grpc.aio.EOF:
            await self.admit(message)
        return message

    async def requests(self, source: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in source:
            await self.admit(message)
            yield message


class _Context:
    """A handler's servicer context whose `read` goes through the budgets."""

    def __init__(self, call: _Call) -> None:
        self._call = call

    def read(self) -> Awaitable[Any]:
        return self._call.read()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call.context, name)


class WrappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # untyped in grpc
    """A server interceptor that serves each method's handler as `wrap(handler, method)` makes
    it (made once per handler and kept), or the handler itself where `wrap` returns None."""

    def __init__(self, wrap: Callable[[Any, str], Any | None]) -> None:
        self._wrap = wrap
        self._wrapped: dict[str, tuple[Any, Any]] = {}
        """method -> (its handler, that handler wrapped)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is None or known[0] is not handler:
            known = self._wrapped[method] = (handler, self._wrap(handler, method) or handler)
        return known[1]


_KINDS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}
"""(request streaming, response streaming) -> the handler's behaviour attribute, its maker."""


def behaviour_of(handler: Any) -> Any:
    """What a gRPC method handler runs, whichever its kind."""
    return getattr(handler, _KINDS[(bool(handler.request_streaming),
                                    bool(handler.response_streaming))][0])  # fmt: skip


def handler_like(handler: Any, behaviour: Any) -> Any:
    """A method handler of `handler`'s kind and (de)serializers that runs `behaviour`."""
    make = _KINDS[(bool(handler.request_streaming), bool(handler.response_streaming))][1]
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _limited(limiter: PeerLimiter, handler: Any, method: str) -> Any:
    """`handler` with its behaviour run inside the budgets of the calling peer."""
    behaviour = behaviour_of(handler)
    streaming_request = handler.request_streaming

    async def opened(request: Any, context: Any) -> tuple[_Call, Any, Any] | None:
        peer = peer_key(context.peer())
        reason = limiter._open(peer, method, None if streaming_request else _size(request))
        if reason is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)
            return None
        call = _Call(limiter, peer, method, context)
        if streaming_request:
            call.held = 0
            return call, call.requests(request), _Context(call)
        call.held = _size(request)
        return call, request, context

    if inspect.isasyncgenfunction(behaviour):

        async def wrapped_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            opened_call = await opened(request, context)
            assert opened_call is not None  # abort raised otherwise
            call, request, context = opened_call
            try:
                async for response in behaviour(request, context):
                    yield response
            finally:
                limiter._close(call.peer, call.held)

        wrapped: Any = wrapped_stream
    else:

        async def wrapped_call(request: Any, context: Any) -> Any:
            opened_call = await opened(request, context)
            assert opened_call is not None
            call, request, context = opened_call
            try:
                return await behaviour(request, context)
            finally:
                limiter._close(call.peer, call.held)

        wrapped = wrapped_call
    return handler_like(handler, wrapped)
