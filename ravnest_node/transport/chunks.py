"""Chunked transfers: a big thing (a block with its AdamW moments, a checkpoint) sent as a
server-streaming call of small messages, for `Node.FetchBlock` and `Node.FetchCheckpoint`
alike.

The sender makes its chunks in a worker thread, one at a time (`serve_chunks`): converting a
tensor or reading a file never blocks the event loop, and never holds more than one chunk.
The receiver waits for each chunk within a deadline of its own (`read_chunks`), not for the
whole transfer: a big block over a slow link may take minutes, but a peer that stops sending
is found out within one chunk's deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import grpc

from ravnest_node.errors import PeerUnavailable
from ravnest_node.transport.errors import peer_error

__all__ = ["read_chunks", "serve_chunks"]

T = TypeVar("T")


async def serve_chunks(chunks: Iterator[T]) -> AsyncIterator[T]:
    """The items of a blocking iterator, each made in a worker thread: what a
    server-streaming handler yields."""
    end = object()
    while (item := await asyncio.to_thread(next, chunks, end)) is not end:
        yield item  # type: ignore[misc]  # (not `end`, by the loop's condition)


async def read_chunks(
    call: Any, *, what: str, first_timeout_s: float, timeout_s: float
) -> AsyncIterator[Any]:
    """The messages of a server-streaming `call` until it ends: the first within
    `first_timeout_s` (the sender may have to get it ready), each next one within `timeout_s`
    of the one before. PeerUnavailable naming `what` if one does not come in time; a failed
    call as `peer_error`. The call is cancelled on the way out, however the reader stops."""
    limit = first_timeout_s
    try:
        while True:
            try:
                async with asyncio.timeout(limit):
                    message = await call.read()
            except TimeoutError:
                raise PeerUnavailable(f"{what}: no chunk for {limit:g} s") from None
            if message is grpc.aio.EOF:
                return
            yield message
            limit = timeout_s
    except grpc.aio.AioRpcError as exc:
        raise peer_error(exc, what) from None
    finally:
        call.cancel()
