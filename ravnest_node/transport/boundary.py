"""Boundary streams: one gRPC bidirectional stream per pipeline boundary.

Stage k opens `/ravnest.v1.Pipeline/Boundary` on stage k+1's server. Activations flow in the
request direction, activation gradients in the response direction, both as tensor frames
(`frames.py`) in raw-bytes messages: no protobuf (de)serialisation of large tensors.

A stage whose node is behind NAT (reached through a relay) and whose previous stage's node is
not opens the stream itself, straight to the previous stage: `/ravnest.v1.Pipeline/BoundaryBack`
on stage k's server, opened by stage k+1. Activations then flow in the response direction and
gradients in the request direction. A server cannot end its half of a stream and still read, so
stage k ends its activations with one empty message (`END_OF_STREAM`; frames are never empty),
after which stage k+1 sends its last gradients and ends its half, and stage k's server returns.

Each side of a stream is a `BoundaryLink`: a bounded outbox drained by a writer (so `send`
blocks when the peer is slow: HTTP/2 flow control is the backpressure) and a reader that parses
every received message and hands it to an `accept` callback, which validates it against the plan.
A frame refused by `accept` ends the stream with INVALID_ARGUMENT and a reason, and nothing
else changes. Bytes written are counted here, in the transport: that counter is what benchmarks
report as bytes on wire.

**Resuming** (issue #34, resume.py). A `BoundaryLink` outlives the gRPC calls that carry it:
when a `Boundary` stream breaks on the network, its opener opens it again with the next
generation (`GENERATION_KEY`) and what it has admitted (`RESUME_KEY`); the server ends the older
call's handler if it still runs (it may not have noticed the break), answers with what it has
admitted in its initial metadata, and each side writes again the frames the other lacks from
its `SentLog`, then carries on. `BoundaryBack` streams are not resumed: they end the plan as
before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from ravnest_node.errors import FrameError, PeerRefused, PeerUnavailable
from ravnest_node.identity import NodeKey
from ravnest_node.transport.errors import Refusal, unanswered
from ravnest_node.transport.frames import Frame, FrameLimits, parse_frame
from ravnest_node.transport.gate import peer_address
from ravnest_node.transport.proofs import (
    EPOCH_KEY,
    GENERATION_KEY,
    NODE_ID_KEY,
    Caller,
    caller,
    with_proof,
)
from ravnest_node.transport.resume import ResumeGap, ResumeState, SentLog

log = logging.getLogger(__name__)

SERVICE = "ravnest.v1.Pipeline"
METHOD = "Boundary"
PATH = f"/{SERVICE}/{METHOD}"
BACK_METHOD = "BoundaryBack"
BACK_PATH = f"/{SERVICE}/{BACK_METHOD}"
END_OF_STREAM = b""
"""The last message of a stream's half that sends activations (frames are never empty): on
`BoundaryBack`, the upstream stage's, as it cannot end a server's half and read on; on
`Boundary`, the opener's, before it ends its half, so that a dropped connection (which ends a
server's half with no error) is not taken for the upstream's end."""
# Initial metadata of a boundary stream: who is sending, under which plan epoch, which opening
# (proofs.py: NODE_ID_KEY, EPOCH_KEY, GENERATION_KEY, signed by the sender's node key).
RESUME_KEY = "ravnest-resume"
"""What the side sending it has admitted (`ResumeState.encode`): the opener's in its
invocation metadata, the server's in its initial metadata."""


@dataclass(slots=True)
class LinkCounters:
    """Data-plane traffic of one node, per peer."""

    bytes_sent: dict[str, int] = field(default_factory=dict)
    frames_sent: dict[str, int] = field(default_factory=dict)

    def add(self, peer: str, nbytes: int) -> None:
        self.bytes_sent[peer] = self.bytes_sent.get(peer, 0) + nbytes
        self.frames_sent[peer] = self.frames_sent.get(peer, 0) + 1

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())


Accept = Callable[[Frame], Awaitable[None]]


def resumed_from(context: Any) -> tuple[int, ResumeState | None]:
    """(generation, the opener's state) a `Boundary` call's metadata gives: (0, None) for a
    first opening. FrameError if either is malformed."""
    metadata = dict(context.invocation_metadata() or ())
    text = str(metadata.get(GENERATION_KEY, "0"))[:12]
    if not text.isdigit():
        raise FrameError(f"malformed stream generation {text!r}")
    generation = int(text)
    state = metadata.get(RESUME_KEY)
    if generation == 0 or state is None:
        return generation, None
    return generation, ResumeState.decode(str(state))


class BoundaryLink:
    """One side of a boundary stream, as the stage runtime sees it: outlives the gRPC calls
    that carry it (a resumed stream is a new call on the same link)."""

    def __init__(
        self,
        peer: str,
        counters: LinkCounters,
        outbox_size: int,
        *,
        pace_bps: float = 0.0,
        first_seq: int = 0,
    ) -> None:
        """`first_seq`: the first microbatch of the plan (what a peer that has admitted
        nothing from this side yet expects)."""
        self.peer = peer
        self._counters = counters
        # Test only: hold each message as long as a link of this rate would (0 = no pacing).
        self._pace_bps = pace_bps
        self._outbox: asyncio.Queue[tuple[int | None, bytes] | None] = asyncio.Queue(
            maxsize=outbox_size
        )
        self.log = SentLog(2 * outbox_size, first_seq)
        """Frames written, until the peer cannot need them again (resume.py)."""
        self.closing = False
        self.abort_reason: str | None = None
        self._ended = False
        """The end of this side's frames has been taken from the outbox."""
        self.generation = -1
        """The newest stream generation that carried this link (server side)."""
        self._running: _Attached | None = None
        self.resumes = 0
        """Times a stream carrying this link was opened again after a break."""
        self.frames_resent = 0
        """Frames written again on a resumed stream."""

    @property
    def attached(self) -> bool:
        """Server side: a call carries this link now."""
        return self._running is not None

    async def send(self, message: bytes, seq: int | None) -> None:
        """Queue the frame of microbatch `seq` (None: a frame never resent, an evaluation's);
        waits while the outbox is full (the peer or the link is slow, or the stream is being
        resumed)."""
        await self._outbox.put((seq, message))

    async def close(self) -> None:
        """No more frames from this side; the writer ends the stream after the queued ones."""
        self.closing = True
        await self._outbox.put(None)

    def abort(self, reason: str) -> None:
        """End the stream with an error now, queued frames dropped: this side's stage gave up
        (its plan broke), and the peer must learn it rather than wait."""
        self.abort_reason = reason
        while not self._outbox.empty():
            self._outbox.get_nowait()
        self._outbox.put_nowait(None)

    async def pump_writes(
        self,
        write: Callable[[bytes], Awaitable[Any]],
        resend: Sequence[tuple[int, bytes]] = (),
    ) -> None:
        """Write `resend` (frames the peer of a resumed stream lacks), then queued frames
        until `close`; counts each message's bytes once written. Each frame is kept in the log
        before its write, so a write the stream breaks under is sent again on resume.
        LinkAborted after `abort`."""
        for _, message in resend:
            await self._write(write, message)
            self.frames_resent += 1
        while not self._ended and (item := await self._outbox.get()) is not None:
            seq, message = item
            if seq is not None:
                self.log.record(seq, message)
            await self._write(write, message)
        self._ended = True
        if self.abort_reason is not None:
            raise LinkAborted(self.abort_reason)

    async def _write(self, write: Callable[[bytes], Awaitable[Any]], message: bytes) -> None:
        if self._pace_bps > 0:
            await asyncio.sleep(len(message) * 8 / self._pace_bps)
        await write(message)
        self._counters.add(self.peer, len(message))

    async def take(self, generation: int) -> _Attached:
        """Server side: a stream of `generation` carries this link from now on. The call of
        an older generation still running (its handler may not have noticed the break) is
        ended first, and waited for. Refusal(ALREADY_EXISTS) unless `generation` is newer
        than every stream before it, or this side has written its last frame (a call then
        changes nothing: every frame it sends is refused)."""
        if generation <= self.generation and not self._ended:
            raise Refusal(
                grpc.StatusCode.ALREADY_EXISTS,
                f"the upstream stream is already open (generation {self.generation})",
            )
        self.generation = max(self.generation, generation)
        old, self._running = self._running, _Attached(generation)
        if old is not None:
            old.superseded = True
            if old.task is not None:
                old.task.cancel()
                await asyncio.wait([old.task])
        if generation > 0:
            self.resumes += 1
        return self._running

    def release(self, attached: _Attached) -> None:
        """Server side: the call `attached` has ended."""
        if self._running is attached:
            self._running = None


@dataclass(slots=True)
class _Attached:
    """The call that carries a link now (server side), while it runs."""

    generation: int
    task: asyncio.Future[None] | None = None
    """Its frames moving both ways, once they do."""
    superseded: bool = False
    """A newer call took the link over (`BoundaryLink.take`): this one changes nothing more."""


class LinkAborted(Exception):
    """This side ended its boundary stream with an error (`BoundaryLink.abort`)."""


async def pump_reads(
    read: Callable[[], Awaitable[Any]],
    limits: FrameLimits,
    accept: Accept,
    on_refused: Callable[[str], None],
    *,
    until_end: bool = False,
) -> bool:
    """Read, parse and hand over frames until the other side ends its half of the stream, or
    (`until_end`) sends `END_OF_STREAM`; True if it did.

    Raises FrameError for the first frame that is malformed or refused by `accept`, after
    telling `on_refused` why."""
    while (message := await read()) is not grpc.aio.EOF:
        if until_end and message == END_OF_STREAM:
            return True
        try:
            if not isinstance(message, bytes):
                raise FrameError("boundary messages must be raw bytes")
            await accept(parse_frame(message, limits))
        except FrameError as exc:
            on_refused(str(exc))
            raise
    return False


async def _both(first: Coroutine[Any, Any, None], second: Coroutine[Any, Any, None]) -> None:
    """Run two halves of a stream together; the first failure cancels the other and is
    raised as itself (not wrapped in an ExceptionGroup)."""
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(first)
            tg.create_task(second)
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None


class StreamBroken(PeerUnavailable):
    """A boundary stream broke on the network (no answer, reset, timed out): its opener may
    open it again while the plan holds (`run_client_stream` with the next generation)."""


@contextmanager
def _call_faults(call: Any, peer: str) -> Iterator[None]:
    """A boundary call's failures as StreamBroken / PeerRefused; the call is cancelled on
    the way out (a no-op once it has ended)."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        # INTERNAL too: gRPC core answers a write on a connection that was reset under the
        # call with it ("Internal error from Core"); the opener's retries are bounded.
        if unanswered(exc.code()) or exc.code() == grpc.StatusCode.INTERNAL:
            raise StreamBroken(f"stream to {peer} broke: {exc.details()}") from None
        raise PeerRefused(
            f"{peer} refused the boundary stream: {exc.code().name}: {exc.details()}"
        ) from None
    except asyncio.InvalidStateError:  # a write after the call ended
        raise StreamBroken(f"{peer} ended the boundary stream early") from None
    finally:
        call.cancel()


async def run_client_stream(
    channel: grpc.aio.Channel,
    link: BoundaryLink,
    *,
    node_id: str,
    epoch: int,
    limits: FrameLimits,
    accept: Accept,
    on_refused: Callable[[str], None],
    generation: int = 0,
    admitted: Callable[[], ResumeState] | None = None,
    key: NodeKey | None = None,
) -> None:
    """Open the boundary stream to the downstream stage (its `generation`-th opening; from 1
    on a resume, `admitted` saying which gradients this side still awaits; `key`: this node's,
    whose proof the opening carries, proofs.py) and move frames
    both ways until both sides have finished. Raises StreamBroken when it breaks on the
    network (open it again with the next generation), PeerRefused when the downstream
    refuses it (or cannot resume it), and FrameError for a frame it sent that `accept`
    refused."""
    metadata = [(NODE_ID_KEY, node_id), (EPOCH_KEY, str(epoch)),
                (GENERATION_KEY, str(generation))]  # fmt: skip
    if generation > 0 and admitted is not None:
        metadata.append((RESUME_KEY, admitted().encode()))
    call = channel.stream_stream(PATH)(metadata=with_proof(key, PATH, metadata))

    async def write_all() -> None:
        answer = dict(await call.initial_metadata() or ())
        if RESUME_KEY not in answer:  # refused before it answered: the status says why
            await call.read()
            raise StreamBroken(f"{link.peer} answered the boundary stream without its state")
        try:
            state = ResumeState.decode(str(answer[RESUME_KEY]))
            if state.next_forward is None:
                raise FrameError("a downstream stage's state names its next forward")
            resend = link.log.forwards_from(state.next_forward)
        except (FrameError, ResumeGap) as exc:
            raise PeerRefused(f"cannot resume the boundary stream to {link.peer}: {exc}") from None
        if generation > 0:
            link.resumes += 1
        await link.pump_writes(call.write, resend)
        await call.write(END_OF_STREAM)  # a connection that drops must not look like this end
        await call.done_writing()

    async def read_all() -> None:
        await pump_reads(call.read, limits, accept, on_refused)
        # The downstream ends its half only after we end ours; earlier is a fault.
        if not link.closing:
            raise StreamBroken(f"{link.peer} ended the boundary stream before the run did")

    with _call_faults(call, link.peer):
        await _both(write_all(), read_all())


async def run_back_stream(
    channel: grpc.aio.Channel,
    link: BoundaryLink,
    *,
    node_id: str,
    epoch: int,
    limits: FrameLimits,
    accept: Accept,
    on_refused: Callable[[str], None],
    key: NodeKey | None = None,
) -> None:
    """The downstream stage's side of `BoundaryBack` (its opening carries `key`'s proof):
    open it on the upstream stage's server
    and move frames both ways (activations in, through `accept`; gradients out, from `link`)
    until the upstream has said it is done and this side's queued frames are out. Raises
    PeerRefused / PeerUnavailable for gRPC failures or a stream the upstream ends early, and
    FrameError for a frame it sent that `accept` refused."""
    call = channel.stream_stream(BACK_PATH)(
        metadata=with_proof(key, BACK_PATH, ((NODE_ID_KEY, node_id), (EPOCH_KEY, str(epoch)))),
    )

    async def read_all() -> None:
        if not await pump_reads(call.read, limits, accept, on_refused, until_end=True):
            raise PeerUnavailable(f"{link.peer} ended the boundary stream before the run did")
        await link.close()  # the upstream is done: this side's last gradients, then the end

    async def write_all() -> None:
        await link.pump_writes(call.write)
        await call.done_writing()

    with _call_faults(call, link.peer):
        await _both(read_all(), write_all())
        code = await call.code()
        if code != grpc.StatusCode.OK:
            raise PeerRefused(f"{link.peer} ended the boundary stream: {code.name}: "
                              f"{await call.details()}")  # fmt: skip


Finish = Callable[[BaseException | None], None]
"""Told how a `BoundaryBack` stream ended on the upstream's server (None: cleanly)."""


class BoundaryServer:
    """The server half: a generic raw-bytes handler for `PATH`.

    `open_session(peer_node_id, epoch)` returns (link, accept, admitted) for the stage that
    owns this boundary (`admitted`: what it has admitted, for a resume), or raises Refusal;
    the link is the same for every call of the stream under one plan (a resumed stream takes
    it over, `BoundaryLink.take`); `close_session(link, error)` is told how a call ended;
    `on_refused(reason)` records why a frame was refused. `BoundaryBack` (the downstream stage
    opens it): `dial_in(peer_node_id, epoch)` returns (link, accept, finish) of the stage whose
    downstream that peer is, or raises Refusal; `finish(error)` is told how it ended."""

    def __init__(
        self,
        open_session: Callable[
            [str, int], Awaitable[tuple[BoundaryLink, Accept, Callable[[], ResumeState]]]
        ],
        close_session: Callable[[BoundaryLink, BaseException | None], None],
        on_refused: Callable[[str], None],
        limits: FrameLimits,
        dial_in: Callable[[str, int], Awaitable[tuple[BoundaryLink, Accept, Finish]]] | None = None,
        caller: Caller = caller,
    ) -> None:
        self._caller = caller
        """(peer node id, epoch) of a call, its proof checked (proofs.py; unit tests of the
        streams give one that takes their readable ids)."""
        self._open_session = open_session
        self._close_session = close_session
        self._on_refused = on_refused
        self._limits = limits
        self._dial_in = dial_in

    def handler(self) -> Any:
        """The gRPC generic handler to add to a server."""
        methods = {METHOD: grpc.stream_stream_rpc_method_handler(self._serve)}
        if self._dial_in is not None:
            methods[BACK_METHOD] = grpc.stream_stream_rpc_method_handler(self._serve_back)
        return grpc.method_handlers_generic_handler(SERVICE, methods)

    async def _serve_back(self, _requests: object, context: Any) -> None:
        """`BoundaryBack`: this node's stage is the upstream one; the peer is its downstream."""
        assert self._dial_in is not None
        try:
            peer_id, epoch = self._caller(context, BACK_PATH)
            link, accept, finish = await self._dial_in(peer_id, epoch)
        except Refusal as refusal:
            log.warning(
                "refused boundary stream from %s: %s", peer_address(context.peer()), refusal.reason
            )
            await context.abort(refusal.code, refusal.reason)
            return

        async def write_all() -> None:
            await link.pump_writes(context.write)
            await context.write(END_OF_STREAM)

        async def read_all() -> None:
            await pump_reads(context.read, self._limits, accept, self._on_refused)
            # The downstream ends its half only after ours is done; earlier is a fault.
            if not link.closing:
                raise PeerUnavailable(f"{link.peer} ended the boundary stream before the run did")

        error: BaseException | None = None
        try:
            await _both(write_all(), read_all())
        except FrameError as exc:
            error = exc
            reason = f"frame refused: {exc}"
            log.warning("%s (from %s)", reason, peer_address(context.peer()))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
        except (LinkAborted, PeerUnavailable) as exc:
            error = exc
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"this stage gave up: {exc}")
        except BaseException as exc:
            error = exc
            raise
        finally:
            finish(error)

    async def _serve(self, _requests: object, context: Any) -> None:
        try:
            peer_id, epoch = self._caller(context, PATH)
            generation, opener = resumed_from(context)
            link, accept, admitted = await self._open_session(peer_id, epoch)
            attached = await link.take(generation)
            resend = link.log.gradients_for(opener.awaiting or ()) if opener is not None else []
        except FrameError as exc:
            await self._refuse(context, Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return
        except ResumeGap as exc:
            await self._refuse(context, Refusal(grpc.StatusCode.DATA_LOSS,
                                                f"cannot resume the stream: {exc}"))  # fmt: skip
            return
        except Refusal as refusal:
            await self._refuse(context, refusal)
            return
        # What this side has admitted, now that no older call of the stream admits any more.
        await context.send_initial_metadata(((RESUME_KEY, admitted().encode()),))
        if attached.superseded:  # an even newer call came meanwhile
            await context.abort(grpc.StatusCode.ABORTED, "superseded by a resumed stream")

        async def read_all() -> None:
            if not await pump_reads(context.read, self._limits, accept, self._on_refused,
                                    until_end=True):  # fmt: skip
                # The half ended without its last message: the connection dropped.
                raise StreamBroken(f"the stream from {link.peer} broke")
            # The upstream finished sending; the writer ends once our queued frames are out.
            await link.close()

        task = asyncio.ensure_future(_both(read_all(), link.pump_writes(context.write, resend)))
        attached.task = task
        error: BaseException | None = None
        try:
            await task
        except FrameError as exc:
            error = exc
            reason = f"frame refused: {exc}"
            log.warning("%s (from %s)", reason, peer_address(context.peer()))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
        except LinkAborted as exc:
            error = exc
            await context.abort(grpc.StatusCode.ABORTED, f"this stage gave up: {exc}")
        except StreamBroken as exc:  # nobody to answer
            error = exc
        except asyncio.CancelledError as exc:
            if attached.superseded:  # a newer call of the stream carries the link now
                await context.abort(grpc.StatusCode.ABORTED, "superseded by a resumed stream")
            error = exc
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if not task.done():  # the call ended under it: nothing of it is admitted from now
                task.cancel()
            link.release(attached)
            if not attached.superseded:
                self._close_session(link, error)

    async def _refuse(self, context: Any, refusal: Refusal) -> None:
        log.warning(
            "refused boundary stream from %s: %s", peer_address(context.peer()), refusal.reason
        )
        await context.abort(refusal.code, refusal.reason)
