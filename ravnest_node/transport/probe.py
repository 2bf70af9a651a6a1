"""Link probes: measure a link's round trip and bandwidth at the application level.

A gRPC write completes once HTTP/2 flow control admits the message, not when the peer has it
(grpc/grpc#21348), so write timings overstate a link. A probe is a unary call instead: it ends
only when the peer has received the whole request and answered, so its duration is what the
link took. `/ravnest.v1.Pipeline/Probe` is raw bytes (no protobuf): the request is N filler
bytes, the answer is empty. A *pulled* probe measures the other direction: its request is empty
and asks, in the metadata (`PULL_KEY`), for an answer of N filler bytes.

`measure_link` sends a few empty probes (their fastest is the RTT), then probes of growing size
(32 KiB, doubling), at least two, until one takes `target_s` (100 ms) beyond the RTT or reaches
`max_bytes`, and estimates bandwidth from the last two: (bytes of the last - bytes of the one
before) / (duration of the last - duration of the one before). What both paid alike cancels:
the round trip, the call's own costs, and a burst that a shaped link lets pass at once (a
token bucket: the bench's 10 Mbit/s link passes 64 KiB at wire speed, and one probe's bytes over
its time beyond the RTT read it as 12.2 Mbit/s). Where the two are too close in time to tell
(`MIN_SPREAD`, a fast link whose probes reach `max_bytes` first), the last probe's bytes over
its time beyond the RTT stand. Growing sizes keep the traffic small on a slow link (a 10 Mbit/s
link stops at 256 KiB, 480 KiB sent; 2 Mbit/s at 64 KiB) and give HTTP/2's window time to open
on a fast one (loopback stops at 1 MiB, ~2 MiB sent in all). Pushed probe bytes are
bytes on the wire: the prober counts them in its link counters like frames, and the probed
node counts a pulled probe's answer in its own.

The server half (`check`, given by the node) refuses a probe (either way) larger than
`MAX_PROBE_BYTES`; under a plan's epoch, one from a node that is not a neighbour of this stage;
under epoch 0, one from a node that is not a member measuring its links; one from a second
prober while another measures (`ProbeTurns`, under any epoch: two probers would share this
node's link and each read a part of it); and one beyond a per-peer byte budget, which counts
both directions. A measurement ends with an empty probe marked `DONE_KEY` (`end_measurement`),
which passes the turn on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from ravnest_node.errors import ConfigError, PeerRefused, PeerUnavailable
from ravnest_node.transport.boundary import SERVICE, LinkCounters
from ravnest_node.transport.errors import Refusal, peer_error
from ravnest_node.transport.proofs import EPOCH_KEY, NODE_ID_KEY, caller

METHOD = "Probe"
PATH = f"/{SERVICE}/{METHOD}"
PULL_KEY = "ravnest-probe-pull-bytes"
"""Metadata of a pulled probe: the size of the answer it asks for."""
DONE_KEY = "ravnest-probe-done"
"""Metadata of the empty probe that ends a measurement ("1"): the probed node's turn passes at
once (`ProbeTurns.release`) rather than after its hold. A node that does not know it takes the
probe as an ordinary empty one."""
MAX_PROBE_BYTES = 4 << 20
"""Largest probe request a node accepts."""
DEFAULT_PROBE_BYTES = 1 << 20
"""Largest probe a measurement sends by default: at 1 Gbit/s it takes 8 ms, enough to tell that
even fp32 frames fit, and a measurement then sends about 2 MiB."""
PROBE_BUDGET_BYTES = 32 << 20
"""Probe bytes a node accepts from one peer per plan (a measurement sends about 2 MiB)."""
MIN_PROBE_COST = 64 << 10
"""Under epoch 0, bytes a probe costs its sender's budget at least (an empty one too)."""
PROBE_TURN_S = 2.0
"""Under epoch 0, a probe from another peer within this many seconds of the current prober's
last probe is refused as busy (`ProbeTurns`)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ProbePlan:
    """How a link is measured."""

    rtt_probes: int = 3
    """Empty probes sent first; the fastest is taken as the round-trip time."""
    first_bytes: int = 32 << 10
    """Size of the first sized probe; each next one doubles."""
    differential: bool = True
    """Bandwidth from the last two sized probes (at least two are sent); False: from the last
    one alone, its bytes over its time beyond the RTT (`SINGLE`)."""
    max_bytes: int = DEFAULT_PROBE_BYTES
    """Largest probe; the measurement stops after a probe of this size."""
    target_s: float = 0.1
    """The measurement stops after a probe whose transfer (beyond the RTT) took this long."""
    timeout_s: float = 30.0
    """Seconds one probe may take before the link counts as unavailable."""

    @classmethod
    def within(cls, max_message_bytes: int, *, differential: bool = True) -> ProbePlan:
        """The default plan (or SINGLE's, without `differential`), with probes no larger than
        half the transport's message limit."""
        limit = max(1, min(DEFAULT_PROBE_BYTES, max_message_bytes // 2))
        first = cls().first_bytes if differential else SINGLE.first_bytes
        return cls(first_bytes=min(first, limit), max_bytes=limit, differential=differential)

    def __post_init__(self) -> None:
        if self.rtt_probes < 1 or not 1 <= self.first_bytes <= self.max_bytes <= MAX_PROBE_BYTES:
            raise ConfigError(
                f"probe plan: rtt_probes must be >= 1 and 1 <= first_bytes <= max_bytes <= "
                f"{MAX_PROBE_BYTES}, got {self.rtt_probes}, {self.first_bytes}, {self.max_bytes}"
            )
        if not self.target_s > 0 or not self.timeout_s > 0:
            raise ConfigError("probe plan: target_s and timeout_s must be > 0 (seconds)")


SINGLE = ProbePlan(first_bytes=64 << 10, differential=False)
"""The plan of the measurements under epoch 0 (the planner's links at join, taken in turn):
probes from 64 KiB, bandwidth from the last one alone. The difference of two probes reads a
shaper's burst right, but on a slow link with a shallow queue the larger probe can lose packets
and wait out TCP's retransmission timer, and the difference then charges all of that wait to
half the bytes: a 2 Mbit/s host read 0.9 Mbit/s so (tests/test_negotiate.py, once in CI)."""


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    """What a measurement found about one direction of a link."""

    rtt_s: float
    """Round trip of an empty probe, in seconds."""
    bandwidth_bps: float
    """Estimated bandwidth, in bits per second."""
    probe_bytes: int
    """Bytes the measurement sent."""


def estimate_bandwidth_bps(size_bytes: int, elapsed_s: float, rtt_s: float) -> float:
    """Bandwidth implied by a probe of `size_bytes` that took `elapsed_s`, of which `rtt_s` is
    the round trip every call pays (a probe no slower than an empty one counts 1 µs)."""
    return size_bytes * 8 / max(elapsed_s - rtt_s, 1e-6)


class ProbeBusy(PeerUnavailable):
    """The peer is being measured by another node now (ABORTED): try again a little later."""


class ProbeTurns:
    """One prober at a time. Newcomers that start together would all measure the same early
    member at once, sharing its link, and each would see a fraction of it. So a probe from
    another peer within `hold_s` of the current prober's last probe is refused as busy
    (`Refusal` ABORTED, which the prober's `send` raises as ProbeBusy). The node itself may
    `claim` the turn while it measures its own links: its probes' bytes fill its uplink, and
    a neighbour measuring it meanwhile would wait for its acknowledgements behind them."""

    def __init__(self, hold_s: float = PROBE_TURN_S, clock: Callable[[], float] = time.monotonic):
        self._hold_s = hold_s
        self._clock = clock
        self._holder = ""
        self._last = -math.inf

    def admit(self, peer: str, *, done: bool = False) -> None:
        """A probe from `peer` takes (or keeps) the turn (`take`); the one that ends its
        measurement (`done`) passes it on (`release`)."""
        if done:
            self.release(peer)
        else:
            self.take(peer)

    def release(self, peer: str) -> None:
        """`peer`'s measurement has ended: the next prober need not wait out the hold."""
        if peer == self._holder:
            self._last = -math.inf

    def claim(self, peer: str) -> bool:
        """`peer` (this node, about to measure its own links) takes the turn if no other
        prober holds it, and keeps it until it `release`s it: probes from others are refused
        as busy meanwhile. False, changing nothing, while another prober holds it."""
        if peer != self._holder and self._clock() - self._last < self._hold_s:
            return False
        self._holder, self._last = peer, math.inf
        return True

    def take(self, peer: str) -> None:
        now = self._clock()
        if peer != self._holder and now - self._last < self._hold_s:
            raise Refusal(
                grpc.StatusCode.ABORTED,
                "busy: another node is measuring its link to this one; try again",
            )
        self._holder, self._last = peer, now


Send = Callable[[int], Awaitable[None]]
"""Sends one probe of that many bytes and returns once the peer has answered."""


async def measure_link(
    send: Send, plan: ProbePlan = ProbePlan(), clock: Callable[[], float] = time.perf_counter
) -> LinkEstimate:
    """Measure a link by probing it (see the module doc); whatever `send` raises propagates."""

    async def timed(nbytes: int) -> float:
        started = clock()
        await send(nbytes)
        return clock() - started

    rtt_s = min([await timed(0) for _ in range(plan.rtt_probes)])
    size, sent, probes = plan.first_bytes, 0, []
    while True:
        elapsed_s = await timed(size)
        sent += size
        probes.append((size, elapsed_s))
        enough = len(probes) > 1 or not plan.differential
        if (elapsed_s - rtt_s >= plan.target_s and enough) or size >= plan.max_bytes:
            break
        size = min(2 * size, plan.max_bytes)
    return LinkEstimate(
        rtt_s=rtt_s,
        bandwidth_bps=bandwidth_of(probes[-2 if plan.differential else -1 :], rtt_s, plan.target_s),
        probe_bytes=sent,
    )


MIN_SPREAD = 0.25
"""The last two probes' durations must differ by this share of the plan's `target_s` for their
difference to give the bandwidth (below it, timer noise would dominate)."""


def bandwidth_of(probes: list[tuple[int, float]], rtt_s: float, target_s: float) -> float:
    """Bits per second from sized probes [(bytes, seconds)], in the order sent: from the
    difference of the last two (see the module doc) where they differ in size and by
    MIN_SPREAD x `target_s` in time, else from the last one alone."""
    if len(probes) > 1:
        (size_a, elapsed_a), (size_b, elapsed_b) = probes[-2:]
        if size_b > size_a and elapsed_b - elapsed_a >= MIN_SPREAD * target_s:
            return (size_b - size_a) * 8 / (elapsed_b - elapsed_a)
    size, elapsed_s = probes[-1]
    return estimate_bandwidth_bps(size, elapsed_s, rtt_s)


def probe_sender(
    channel: grpc.aio.Channel,
    *,
    peer: str,
    node_id: str,
    epoch: int,
    counters: LinkCounters,
    timeout_s: float,
    pace_bps: float = 0.0,
    pull: bool = False,
) -> Send:
    """A `Send` that probes `peer` over `channel`, counting the bytes sent in `counters`; with
    `pull`, each probe asks `peer` for that many bytes instead (nothing to count: the peer sends
    them). Raises PeerUnavailable / PeerRefused for a failed call, or for a pulled answer of
    the wrong size. `pace_bps` (test only) delays each probe as a link of that rate would."""
    call = channel.unary_unary(PATH)
    metadata = ((NODE_ID_KEY, node_id), (EPOCH_KEY, str(epoch)))

    async def send(nbytes: int) -> None:
        if pace_bps > 0:
            await asyncio.sleep(nbytes * 8 / pace_bps)
        try:
            if pull:
                answer = await call(b"", metadata=(*metadata, (PULL_KEY, str(nbytes))),
                                    timeout=timeout_s)  # fmt: skip
                if not isinstance(answer, bytes) or len(answer) != nbytes:
                    raise PeerRefused(
                        f"probe of {peer}: asked for {nbytes} bytes, got "
                        f"{len(answer) if isinstance(answer, bytes) else '?'}"
                    )
                return
            await call(bytes(nbytes), metadata=metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ABORTED:
                raise ProbeBusy(f"probe of {peer}: ABORTED: {exc.details()}") from None
            raise peer_error(exc, f"probe of {peer}") from None
        counters.add(peer, nbytes)

    return send


async def end_measurement(
    channel: grpc.aio.Channel, *, peer: str, node_id: str, epoch: int, timeout_s: float
) -> None:
    """Tell `peer` this node's measurement of it has ended (an empty probe marked DONE_KEY), so
    that the next prober's turn comes at once. PeerUnavailable / PeerRefused if it fails."""
    metadata = ((NODE_ID_KEY, node_id), (EPOCH_KEY, str(epoch)), (DONE_KEY, "1"))
    try:
        await channel.unary_unary(PATH)(b"", metadata=metadata, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise peer_error(exc, f"end of the measurement of {peer}") from None


Admit = Callable[[str, int, int, bool], Awaitable[None]]
"""admit(peer_node_id, epoch, nbytes, done): returns if that peer may probe with that many bytes
now (`done`: the empty probe that ends its measurement), raises Refusal otherwise."""


class ProbeServer:
    """The server half: a generic raw-bytes unary handler for `PATH`. The answers of pulled
    probes are bytes this node sends: counted in `counters`, for the prober."""

    def __init__(self, admit: Admit, counters: LinkCounters | None = None) -> None:
        self._admit = admit
        self._counters = counters

    def handler(self) -> Any:
        """The gRPC generic handler to add to a server."""
        return grpc.method_handlers_generic_handler(
            SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(self._serve)}
        )

    async def _serve(self, request: object, context: Any) -> bytes:
        try:
            peer_id, epoch = caller(context, PATH)
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.reason)
        if not isinstance(request, bytes):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "probes are raw bytes")
        assert isinstance(request, bytes)
        pull = pulled_bytes(context)
        if pull is None or (pull and request):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{PULL_KEY} must be a byte count, on an empty probe")  # fmt: skip
        assert pull is not None
        done = _done(context)
        if done and (request or pull):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{DONE_KEY} ends a measurement with an empty probe")  # fmt: skip
        size = max(len(request), pull)
        if size > MAX_PROBE_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"probe of {size} bytes exceeds the limit of {MAX_PROBE_BYTES}",
            )
        try:
            await self._admit(peer_id, epoch, size, done)
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.reason)
        if pull and self._counters is not None:
            self._counters.add(peer_id, pull)
        return bytes(pull)


def _done(context: Any) -> bool:
    """Whether the probe ends its sender's measurement (DONE_KEY)."""
    return any(key == DONE_KEY for key, _ in context.invocation_metadata() or ())


def pulled_bytes(context: Any) -> int | None:
    """The answer's size a probe asks for (0 for a pushed probe); None if malformed."""
    for key, value in context.invocation_metadata() or ():
        if key == PULL_KEY:
            text = str(value)
            return int(text) if text.isascii() and text.isdigit() and len(text) <= 10 else None
    return 0
