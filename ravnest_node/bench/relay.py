"""A TCP relay that puts a slow link between two endpoints: one-way delay, optionally a rate.

This kernel has no `netem`, so propagation delay comes from here: the harness points a node at
the relay instead of its peer. Every accepted connection gets a connection to the target and two
pumps, one per direction. Each pump is a delay line: a chunk read at time t reaches the other
side at t + delay. With `rate_bps` set (no root, so no `tbf`), the pump also paces: a chunk is
written no earlier than the previous one has finished plus its own serialisation time at the
rate, which is what a link of that rate and delay delivers (`write_time`). Pacing is accurate
while the relay has CPU to spare: on a 2-core machine, within 1% up to ~100 Mbit/s, ~4% short at
500 Mbit/s, ~15% short at 1000 Mbit/s (unpaced it moves 2-3 Gbit/s).

Each delay line holds at most `buffer_limit_bytes` (at least 4 MiB and twice the
bandwidth-delay product, so it never limits throughput below the rate); when it is full the
relay stops reading and TCP flow control slows the sender down, so a slow reader applies
backpressure instead of growing memory. When either side closes, what is in flight is delivered
and then both sides are closed. TCP_NODELAY is set on both sockets.

Run it as a process::

    python -m ravnest_node.bench.relay --listen HOST:PORT --target HOST:PORT --delay-ms D \\
        [--rate-mbit R]

It prints one JSON line ``{"event": "ready", "port": N}`` once listening, serves until SIGTERM
or SIGINT, then exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import signal
import socket
import sys
from collections import deque
from collections.abc import Sequence

log = logging.getLogger(__name__)

# Largest chunk read at once (also the StreamReader limit); also the delay line's granularity.
# 64 KiB chunks cap an unpaced relay near 1.2 Gbit/s on our machines; 256 KiB near 2-3 Gbit/s.
MAX_CHUNK_BYTES = 256 * 1024
# When pacing, read at most this much link time per chunk, so the rate is smooth at small scales.
PACING_QUANTUM_S = 0.002
# A paced relay that fell behind its schedule (the event loop was busy, the process was not
# scheduled, the reader stalled) catches up at most this much link time faster than the rate:
# the bucket of a token-bucket shaper. Without it, a relay that lags its timers by a fraction of
# a millisecond per chunk would fall short of the rate; with an unbounded one, it would burst
# far above the rate after a reader stall.
PACING_BURST_S = 0.010
MIN_CHUNK_BYTES = 1500
MIN_BUFFER_BYTES = 4 * 1024 * 1024
_CLOSE_GRACE_S = 1.0


def buffer_limit_bytes(delay_s: float, rate_bps: float | None) -> int:
    """Bytes one direction of one connection may hold: max(4 MiB, 2 x bandwidth-delay product)."""
    bdp_bytes = 0.0 if rate_bps is None else rate_bps / 8 * delay_s
    return max(MIN_BUFFER_BYTES, math.ceil(2 * bdp_bytes))


def chunk_limit_bytes(rate_bps: float | None) -> int:
    """Largest chunk to read at once: 64 KiB, or PACING_QUANTUM_S of link time when paced."""
    if rate_bps is None:
        return MAX_CHUNK_BYTES
    return min(MAX_CHUNK_BYTES, max(MIN_CHUNK_BYTES, int(rate_bps / 8 * PACING_QUANTUM_S)))


def write_time(
    *,
    read_at: float,
    size_bytes: int,
    delay_s: float,
    rate_bps: float | None,
    prev_done_at: float,
    now: float,
) -> float:
    """When a chunk read at `read_at` is to be written to the other side (loop time, seconds).

    Unpaced: `read_at + delay_s`. Paced: the chunk's last byte arrives after the propagation
    delay and after the previous chunk (scheduled at `prev_done_at`) plus its own serialisation
    time, max(read_at + delay, prev_done_at) + size / rate, as on a link of that rate and delay;
    a writer that is ready only at `now`, long after the schedule, catches up at most
    PACING_BURST_S of it.
    """
    due = read_at + delay_s
    if rate_bps is None:
        return due
    return max(due, prev_done_at, now - PACING_BURST_S) + size_bytes * 8 / rate_bps


class _DelayLine:
    """Chunks read but not yet written, oldest first, with their read times; bounded in bytes."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.size_bytes = 0
        self._chunks: deque[tuple[float, bytes]] = deque()
        self._eof = False
        self._changed = asyncio.Condition()

    async def put(self, read_at: float, data: bytes) -> None:
        """Appends a chunk; waits while it would not fit (an empty line takes any chunk)."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.size_bytes == 0 or self.size_bytes + len(data) <= self.limit_bytes
            )
            self._chunks.append((read_at, data))
            self.size_bytes += len(data)
            self._changed.notify_all()

    async def close(self) -> None:
        """No more chunks will come: `peek` returns None once the line is empty."""
        async with self._changed:
            self._eof = True
            self._changed.notify_all()

    async def peek(self) -> tuple[float, bytes] | None:
        """The oldest chunk, left in the line (it still counts against the limit)."""
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._chunks) or self._eof)
            return self._chunks[0] if self._chunks else None

    async def pop(self) -> None:
        """Removes the oldest chunk, freeing its room."""
        async with self._changed:
            _, data = self._chunks.popleft()
            self.size_bytes -= len(data)
            self._changed.notify_all()


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Relay:
    """Forwards every TCP connection on (listen_host, listen_port) to (target_host, target_port),
    adding `delay_s` of one-way delay in each direction and, if `rate_bps` is set, pacing each
    direction of each connection to `rate_bps` bit/s.

    `bytes_forwarded` counts payload bytes written to either side, both directions together.
    """

    bytes_forwarded: int

    def __init__(
        self,
        *,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        delay_s: float,
        rate_bps: float | None = None,
    ) -> None:
        if not 0 <= listen_port <= 65535:
            raise ValueError(f"listen_port must be 0 (any) to 65535, got {listen_port}")
        if not 1 <= target_port <= 65535:
            raise ValueError(f"target_port must be 1 to 65535, got {target_port}")
        if not delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0 seconds, got {delay_s}")
        if rate_bps is not None and not rate_bps > 0:
            raise ValueError(f"rate_bps must be > 0 bit/s or None (no pacing), got {rate_bps}")
        self._listen = (listen_host, listen_port)
        self._target = (target_host, target_port)
        self.delay_s = delay_s
        self.rate_bps = rate_bps
        self.buffer_limit_bytes = buffer_limit_bytes(delay_s, rate_bps)
        """Bytes each direction of each connection may hold before the relay stops reading."""
        self._chunk_bytes = chunk_limit_bytes(rate_bps)
        self.bytes_forwarded = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._lines: set[_DelayLine] = set()
        self._closing = False

    @property
    def buffered_bytes(self) -> int:
        """Bytes read and not yet written, all connections and directions together."""
        return sum(line.size_bytes for line in self._lines)

    @property
    def connections(self) -> int:
        """Connections being relayed now."""
        return len(self._connections)

    async def start(self) -> int:
        """Starts listening; returns the bound port. Raises OSError if it cannot listen."""
        if self._server is not None:
            raise RuntimeError("Relay already started")
        self._server = await asyncio.start_server(self._serve, *self._listen, limit=MAX_CHUNK_BYTES)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        """Stops listening and drops every relayed connection (without delivering what's in
        flight). Safe to call more than once."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        writers = [client_w]
        lines: list[_DelayLine] = []
        try:
            try:
                target_r, target_w = await asyncio.open_connection(
                    *self._target, limit=MAX_CHUNK_BYTES
                )
            except OSError as exc:
                log.warning("relay: cannot reach target %s:%d: %s", *self._target, exc)
                return
            writers.append(target_w)
            for w in writers:
                _set_nodelay(w)
            try:
                async with asyncio.TaskGroup() as tg:
                    for src, dst in ((client_r, target_w), (target_r, client_w)):
                        line = _DelayLine(self.buffer_limit_bytes)
                        lines.append(line)
                        self._lines.add(line)
                        tg.create_task(self._fill(src, line))
                        tg.create_task(self._drain(line, dst))
            except* OSError as group:  # a side reset or vanished: drop the connection
                log.debug("relay: connection dropped: %s", group.exceptions)
        except asyncio.CancelledError:
            # `close()` cancelled us. Python 3.11's server logs a handler task that ends
            # cancelled as an error ("Unhandled exception in client_connected_cb"), so end
            # normally then; any other cancellation goes on.
            if not self._closing:
                raise
        finally:
            self._connections.discard(task)
            self._lines.difference_update(lines)
            for w in writers:
                w.close()
            for w in writers:
                with contextlib.suppress(OSError, TimeoutError):
                    async with asyncio.timeout(_CLOSE_GRACE_S):
                        await w.wait_closed()

    async def _fill(self, src: asyncio.StreamReader, line: _DelayLine) -> None:
        """Reads chunks into the line (waiting while it is full) until EOF."""
        loop = asyncio.get_running_loop()
        while data := await src.read(self._chunk_bytes):
            await line.put(loop.time(), data)
        await line.close()

    async def _drain(self, line: _DelayLine, dst: asyncio.StreamWriter) -> None:
        """Writes each chunk at its `write_time`; closes `dst` after the last one."""
        loop = asyncio.get_running_loop()
        done_at = -math.inf
        while (chunk := await line.peek()) is not None:
            read_at, data = chunk
            at = write_time(
                read_at=read_at,
                size_bytes=len(data),
                delay_s=self.delay_s,
                rate_bps=self.rate_bps,
                prev_done_at=done_at,
                now=loop.time(),
            )
            # Sleeping until the chunk is due is the delay line itself.
            if (wait_s := at - loop.time()) > 0:
                await asyncio.sleep(wait_s)
            dst.write(data)
            self.bytes_forwarded += len(data)
            await dst.drain()
            # Pace from the schedule, not from when the sleep woke, which would lose the
            # oversleep of every chunk (`write_time` bounds the catching up).
            done_at = at
            await line.pop()
        dst.close()


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


async def _serve_until_signalled(relay: Relay) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        port = await relay.start()
        print(json.dumps({"event": "ready", "port": port}), flush=True)
        await stop.wait()
    finally:
        await relay.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ravnest_node.bench.relay`: run one relay until SIGTERM/SIGINT; returns 0."""
    parser = argparse.ArgumentParser(
        prog="python -m ravnest_node.bench.relay",
        description="TCP relay that adds one-way delay (and optionally a rate) to each direction.",
    )
    parser.add_argument("--listen", type=_host_port, required=True, help="HOST:PORT (port 0: any)")
    parser.add_argument("--target", type=_host_port, required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay in ms")
    parser.add_argument("--rate-mbit", type=float, default=None, help="pace each direction")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        relay = Relay(
            listen_host=args.listen[0],
            listen_port=args.listen[1],
            target_host=args.target[0],
            target_port=args.target[1],
            delay_s=args.delay_ms / 1e3,
            rate_bps=None if args.rate_mbit is None else args.rate_mbit * 1e6,
        )
    except ValueError as exc:
        parser.error(str(exc))
    asyncio.run(_serve_until_signalled(relay))
    return 0


if __name__ == "__main__":
    sys.exit(main())
