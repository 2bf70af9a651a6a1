"""Resumable boundary streams (issue #34): what each side keeps and sends again
(transport/resume.py), and a real gRPC stream on loopback through a proxy that swallows
everything for a while and then resets the connection: the stream is opened again, each side
writes again what the other lacks, and every frame is admitted once, in order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc
import pytest
import torch

from ravnest_node.compression import get_codec
from ravnest_node.errors import FrameError
from ravnest_node.transport.boundary import (
    BoundaryLink,
    BoundaryServer,
    LinkCounters,
    StreamBroken,
    run_client_stream,
)
from ravnest_node.transport.frames import Frame, FrameKind, FrameLimits, encode_frame
from ravnest_node.transport.resume import ResumeGap, ResumeState, SentLog

from .fakes import claimed

LIMITS = FrameLimits(max_message_bytes=1 << 20)
CUT_AT = (10, 25)
"""The stream is cut once the opener has admitted this many gradients."""


# ----- what each side keeps, without sockets ------------------------------------------------
def test_a_state_round_trips_and_a_malformed_one_is_refused() -> None:
    for state in (ResumeState(next_forward=12), ResumeState(awaiting=(3, 4, 9)),
                  ResumeState(awaiting=())):  # fmt: skip
        assert ResumeState.decode(state.encode()) == state
    for text in ("", "f:", "f:-1", "g:1,x", "g:1,1", "x:3", "f:" + "9" * 5000, "g:" + "1," * 600):
        with pytest.raises(FrameError):
            ResumeState.decode(text)


def test_forwards_from_sends_what_the_peer_lacks_in_order() -> None:
    log = SentLog(capacity=8, first_seq=10)
    assert log.forwards_from(10) == []  # nothing written, nothing lacked
    for seq in range(10, 15):
        log.record(seq, bytes([seq]))
    log.ack(10)  # its gradient came back
    assert log.forwards_from(12) == [(12, b"\x0c"), (13, b"\x0d"), (14, b"\x0e")]
    assert len(log) == 3  # below 12: admitted, dropped
    with pytest.raises(ResumeGap):  # claims a forward never written
        log.forwards_from(16)
    with pytest.raises(ResumeGap):  # needs one no longer kept
        log.forwards_from(11)


def test_gradients_for_sends_the_awaited_ones_and_knows_a_gap() -> None:
    log = SentLog(capacity=3, first_seq=0)
    for seq in range(5):
        log.record(seq, bytes([seq]))
    assert len(log) == 3  # 0 and 1 evicted for room
    # 7 is not computed yet (it comes in the outbox); 3 and 4 were written and are kept.
    assert log.gradients_for([7, 4, 3]) == [(3, b"\x03"), (4, b"\x04")]
    log.ack_below(4)
    assert log.gradients_for([4]) == [(4, b"\x04")]
    with pytest.raises(ResumeGap):
        log.gradients_for([1])


# ----- a real stream through a proxy that cuts it ----------------------------------------------
class Cutter:
    """A TCP proxy on loopback: forwards both ways, or (`swallow`) reads and drops everything,
    as a link that is down does; `reset` aborts every connection through it."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self.swallowing = False
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        tr, tw = await asyncio.open_connection("127.0.0.1", self._target_port)
        self._writers += [w, tw]
        await asyncio.gather(self._pump(r, tw), self._pump(tr, w), return_exceptions=True)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            if not self.swallowing:
                dst.write(data)
                await dst.drain()
        dst.close()

    def reset(self) -> None:
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()
        self.swallowing = False

    async def close(self) -> None:
        self.reset()
        if self._server is not None:
            self._server.close()


def _frame(kind: FrameKind, seq: int) -> bytes:
    return encode_frame(kind, seq, 0, [("hidden", torch.full((64, 64), float(seq)),
                                        get_codec("none"))])  # fmt: skip


class WatchedLog(SentLog):
    """A SentLog that says when a frame is recorded (about to be written)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.recorded = asyncio.Event()

    def record(self, seq: int, message: bytes) -> None:
        super().record(seq, message)
        self.recorded.set()


class Downstream:
    """The server side: admits forwards strictly in order and answers each with a gradient."""

    def __init__(self) -> None:
        self.link = BoundaryLink("up", LinkCounters(), outbox_size=4)
        self.admitted: list[int] = []

    @property
    def next_forward(self) -> int:
        return len(self.admitted)

    async def accept(self, frame: Frame) -> None:
        if frame.kind is not FrameKind.FORWARD or frame.seq != self.next_forward:
            raise FrameError(f"forward {frame.seq}, expected {self.next_forward}")
        self.admitted.append(frame.seq)
        await self.link.send(_frame(FrameKind.BACKWARD, frame.seq), frame.seq)

    async def open_session(
        self, peer: str, epoch: int
    ) -> tuple[BoundaryLink, Callable[[Frame], object], Callable[[], ResumeState]]:
        return self.link, self.accept, lambda: ResumeState(next_forward=self.next_forward)


async def serve(down: Downstream) -> tuple[grpc.aio.Server, int]:
    """A gRPC server on loopback whose boundary streams go to `down`; and its port."""
    server = grpc.aio.server()
    boundary = BoundaryServer(down.open_session, lambda link, error: None,  # type: ignore[arg-type]
                              lambda reason: None, LIMITS, caller=claimed)  # fmt: skip
    server.add_generic_rpc_handlers((boundary.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_a_stream_cut_mid_run_resumes_and_every_frame_is_admitted_once() -> None:
    n, window = 40, 4
    down = Downstream()
    server, port = await serve(down)
    cutter = Cutter(port)
    proxy_port = await cutter.start()
    link = BoundaryLink("down", LinkCounters(), outbox_size=window)
    link.log = log = WatchedLog(2 * window)
    awaiting: set[int] = set()
    gradients: list[int] = []
    room = asyncio.Semaphore(window)
    cut = [asyncio.Event() for _ in CUT_AT]
    all_in = asyncio.Event()

    def admitted() -> ResumeState:
        return ResumeState(awaiting=tuple(awaiting))

    async def accept(frame: Frame) -> None:
        if frame.kind is not FrameKind.BACKWARD or frame.seq not in awaiting:
            raise FrameError(f"gradient {frame.seq} not in flight")
        awaiting.discard(frame.seq)
        gradients.append(frame.seq)
        link.log.ack(frame.seq)
        if len(gradients) in CUT_AT:  # the link goes down now: the next forward is lost
            cutter.swallowing = True
            log.recorded.clear()
            cut[CUT_AT.index(len(gradients))].set()
        if len(gradients) == n:
            all_in.set()
        room.release()

    async def produce() -> None:
        for seq in range(n):
            await room.acquire()
            awaiting.add(seq)
            await link.send(_frame(FrameKind.FORWARD, seq), seq)
        await all_in.wait()
        await link.close()

    async def stream() -> int:
        """The opener's loop (as training.py's): open again with the next generation."""
        generation = 0
        while True:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy_port}") as channel:
                try:
                    await run_client_stream(channel, link, node_id="up", epoch=1, limits=LIMITS,
                                            accept=accept, on_refused=lambda r: None,
                                            generation=generation, admitted=admitted)  # fmt: skip
                    return generation
                except StreamBroken:
                    generation += 1

    async def cut_twice() -> None:
        for began in cut:
            await began.wait()
            await log.recorded.wait()  # a forward written (or being written), and lost
            cutter.reset()

    try:
        async with asyncio.timeout(60):
            producer = asyncio.create_task(produce())
            cuts = asyncio.create_task(cut_twice())
            generations = await stream()
            await producer
            await cuts
    finally:
        await cutter.close()
        await server.stop(None)
    assert down.admitted == list(range(n))  # every forward once, in order
    assert sorted(gradients) == list(range(n)) and len(gradients) == n
    assert generations >= 2 and link.resumes >= 2 and down.link.resumes >= 2
    assert link.frames_resent >= 2  # the forwards written while the link was down


async def test_a_resume_the_server_cannot_serve_is_refused() -> None:
    """An opener that claims to await a gradient the server wrote and no longer keeps is
    told DATA_LOSS (the plan then breaks, as without resuming): nothing is guessed."""
    down = Downstream()
    for seq in range(12):  # more than its log keeps (twice the outbox)
        down.link.log.record(seq, b"x")
    server, port = await serve(down)
    link = BoundaryLink("down", LinkCounters(), outbox_size=4)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(Exception) as refused:
                await run_client_stream(channel, link, node_id="up", epoch=1, limits=LIMITS,
                                        accept=down.accept, on_refused=lambda r: None,
                                        generation=1,
                                        admitted=lambda: ResumeState(awaiting=(0,)))  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            await server.stop(None)
    assert "DATA_LOSS" in str(refused.value) and "no longer kept" in str(refused.value)
