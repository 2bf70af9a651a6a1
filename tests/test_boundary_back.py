"""`BoundaryBack`: the downstream stage opens the boundary stream (it is behind NAT, its upstream
is not). Activations flow in the response direction, gradients in the request direction, and
the upstream ends its half with one empty message, as it cannot end a server's half and read on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
import torch

from ravnest_node.compression import get_codec
from ravnest_node.errors import FrameError, PeerRefused
from ravnest_node.transport.boundary import (
    BoundaryLink,
    BoundaryServer,
    LinkCounters,
    run_back_stream,
)
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.frames import Frame, FrameKind, FrameLimits, encode_frame

from .fakes import claimed

LIMITS = FrameLimits(max_message_bytes=1 << 20)


def _frame(kind: FrameKind, seq: int) -> bytes:
    return encode_frame(kind, seq, 0, [("hidden", torch.full((2, 3), float(seq)),
                                        get_codec("none"))])  # fmt: skip


class Upstream:
    """The upstream stage's side: its downstream link, the gradients it got, how it ended."""

    def __init__(self) -> None:
        self.link = BoundaryLink("down", LinkCounters(), outbox_size=8)
        self.gradients: list[int] = []
        self.all_gradients = asyncio.Event()
        self.ended: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    async def accept(self, frame: Frame) -> None:
        if frame.kind != FrameKind.BACKWARD:
            raise FrameError("the downstream sends gradients only")
        self.gradients.append(frame.seq)
        if len(self.gradients) == 3:
            self.all_gradients.set()

    async def dial_in(self, peer: str, epoch: int) -> tuple[BoundaryLink, object, object]:
        if peer != "down" or epoch != 3:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, f"unknown peer {peer!r}")
        return self.link, self.accept, self.ended.set_result

    async def train(self, frames: list[bytes]) -> None:
        """Send `frames`, and end once every gradient is in (as a stage whose run is done)."""
        for message in frames:
            await self.link.send(message, 0)
        await self.all_gradients.wait()
        await self.link.close()


@pytest_asyncio.fixture
async def upstream() -> AsyncIterator[tuple[str, Upstream]]:
    up = Upstream()

    async def no_session(peer: str, epoch: int) -> tuple[BoundaryLink, object]:
        raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "the first stage has no upstream")

    server = grpc.aio.server()
    handler = BoundaryServer(no_session, lambda link, error: None, lambda reason: None, LIMITS,
                             dial_in=up.dial_in, caller=claimed)  # type: ignore[arg-type]  # fmt: skip
    server.add_generic_rpc_handlers([handler.handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", up
    finally:
        await server.stop(0)


async def _downstream(address: str, node_id: str = "down", *, refuse: bool = False) -> list[int]:
    """The downstream stage: open BoundaryBack, answer every activation with its gradient."""
    link = BoundaryLink("up", LinkCounters(), outbox_size=8)
    got: list[int] = []

    async def accept(frame: Frame) -> None:
        if refuse:
            raise FrameError("refused for the test")
        got.append(frame.seq)
        await link.send(_frame(FrameKind.BACKWARD, frame.seq), frame.seq)

    async with grpc.aio.insecure_channel(address) as channel:
        await run_back_stream(channel, link, node_id=node_id, epoch=3, limits=LIMITS,
                              accept=accept, on_refused=lambda reason: None)  # fmt: skip
    return got


async def test_frames_go_both_ways_and_the_stream_ends_cleanly(
    upstream: tuple[str, Upstream],
) -> None:
    address, up = upstream
    activations = [_frame(FrameKind.FORWARD, seq) for seq in range(3)]
    trained = asyncio.create_task(up.train(activations))
    assert await _downstream(address) == [0, 1, 2]
    await trained
    assert up.gradients == [0, 1, 2]
    assert await up.ended is None


async def test_a_stranger_is_refused_and_changes_nothing(upstream: tuple[str, Upstream]) -> None:
    address, up = upstream
    with pytest.raises(PeerRefused, match="PERMISSION_DENIED"):
        await _downstream(address, node_id="stranger")
    assert not up.ended.done() and up.gradients == []


async def test_a_refused_activation_ends_the_stream_on_both_sides(
    upstream: tuple[str, Upstream],
) -> None:
    address, up = upstream
    await up.link.send(_frame(FrameKind.FORWARD, 0), 0)
    with pytest.raises(FrameError, match="refused for the test"):
        await _downstream(address, refuse=True)
    assert await up.ended is not None  # the upstream learns its stream broke


async def test_a_bad_gradient_is_refused_by_the_upstream(upstream: tuple[str, Upstream]) -> None:
    """The downstream sends an activation where a gradient belongs: the upstream refuses it,
    ends the stream with INVALID_ARGUMENT, and is told why."""
    address, up = upstream
    await up.link.send(_frame(FrameKind.FORWARD, 0), 0)
    link = BoundaryLink("up", LinkCounters(), outbox_size=8)

    async def accept(frame: Frame) -> None:
        await link.send(_frame(FrameKind.FORWARD, frame.seq), frame.seq)  # wrong kind

    async with grpc.aio.insecure_channel(address) as channel:
        with pytest.raises(PeerRefused, match="INVALID_ARGUMENT"):
            await run_back_stream(channel, link, node_id="down", epoch=3, limits=LIMITS,
                                  accept=accept, on_refused=lambda reason: None)  # fmt: skip
    assert isinstance(await up.ended, FrameError)
