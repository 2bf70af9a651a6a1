"""The relay's wire: headers, the byte splice and the socket options both ends of a tunnel use.

Wire format on the relay's port (relay.py serves it, tunnel.py is the node's side): each
connection starts with one header, a 4-byte big-endian length and a msgpack map of at most
MAX_HEADER_BYTES:

- `{"op": "register", "node": ID, "port": P}` asks for a tunnel (P: the port wanted, 0 for any:
  a node that reconnects asks for its old port, as its peers know that address). The relay
  gives a port of its `--relay-ports` range if it has one (P only if it is in it), else one the
  system picks (P only if it is 1024 or above). The relay
  answers `{"ok": true, "address": "HOST:PORT", "secret": HEX}` or `{"ok": false, "error":
  WHY}`, then sends `{"op": "open", "id": N}` on this connection, one per peer connection.
- `{"op": "data", "node": ID, "secret": HEX, "id": N}` answers `open` N; from then on the
  connection carries the peer's bytes both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

import msgpack

from ravnest_node.transport.options import split_host_port

MAX_HEADER_BYTES = 512
CHUNK_BYTES = 256 * 1024
PING_S = 15.0
"""The relay sends a ping on every control connection this often; a node that hears nothing
for CONTROL_SILENCE_S counts its control connection dead (a NAT that forgot it) and reconnects."""
CONTROL_SILENCE_S = 3 * PING_S
HALF_CLOSE_S = 30.0
"""After one direction of a relayed connection ends, the other gets this long to end too."""


async def connect_rtt(address: str, timeout_s: float, tries: int = 3) -> float | None:
    """The fastest of `tries` TCP connects to `address` (closed at once, nothing sent), in
    seconds; None if none succeeds within `timeout_s` each."""
    host, port = split_host_port(address)
    loop = asyncio.get_running_loop()
    best: float | None = None
    for _ in range(tries):
        started = loop.time()
        try:
            async with asyncio.timeout(timeout_s):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError, ValueError):  # ValueError: a host name DNS refuses
            continue
        elapsed = loop.time() - started
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        best = elapsed if best is None else min(best, elapsed)
    return best


class TunnelError(Exception):
    """A header that breaks the tunnel protocol."""


def nodelay(writer: asyncio.StreamWriter) -> None:
    """TCP_NODELAY on the writer's socket: frames go out at once, not after Nagle's wait."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def keepalive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on a long-lived idle connection (a control connection): a peer that
    vanished is noticed within about 30 s, not after the system's two hours."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def host_port(host: str, port: int) -> str:
    """HOST:PORT, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def encode_header(header: dict[str, Any]) -> bytes:
    """The header, length-prefixed; TunnelError if it packs to more than MAX_HEADER_BYTES."""
    body: bytes = msgpack.packb(header, use_bin_type=True)
    if len(body) > MAX_HEADER_BYTES:
        raise TunnelError(f"header of {len(body)} bytes (at most {MAX_HEADER_BYTES})")
    return len(body).to_bytes(4, "big") + body


async def read_header(reader: asyncio.StreamReader) -> dict[str, Any]:
    """One header; TunnelError if it is malformed or oversized (nothing more is read then),
    asyncio.IncompleteReadError if the connection ends first."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    if not 0 < size <= MAX_HEADER_BYTES:
        raise TunnelError(f"header of {size} bytes (at most {MAX_HEADER_BYTES})")
    try:
        header = msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=True)
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        raise TunnelError(f"header is not msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise TunnelError("header is not a map")
    return header


def header_op(header: dict[str, Any]) -> str:
    """The header's op; TunnelError if it has none."""
    op = header.get("op")
    if not isinstance(op, str):
        raise TunnelError("header has no op")
    return op


def header_field(header: dict[str, Any], key: str, kind: type) -> Any:
    """The header's `key`, of type `kind` (a bool is no int here); TunnelError otherwise."""
    value = header.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TunnelError(f"header field {key!r} is not a {kind.__name__}")
    return value


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    count: Callable[[int], None] | None = None,
) -> None:
    """Move bytes both ways between two connections (`count` is told each chunk's size). When
    one direction ends, the other gets HALF_CLOSE_S to end as well; an error on either side, or
    the end of that time, closes both."""

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await src.read(CHUNK_BYTES):
                dst.write(chunk)
                if count is not None:
                    count(len(chunk))
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()

    pumps = {asyncio.create_task(pump(a[0], b[1])), asyncio.create_task(pump(b[0], a[1]))}
    try:
        _, rest = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        if rest:
            await asyncio.wait(rest, timeout=HALF_CLOSE_S)
    finally:
        for writer in (a[1], b[1]):
            writer.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
