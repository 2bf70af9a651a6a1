"""The relay: a reachable node's open ports for the nodes that cannot accept connections.

A node started with `--relay-listen HOST:PORT` runs a `RelayServer`. A node behind NAT
(tunnel.py) registers over a control connection and gets a public port of the relay; each peer
connection to that port is announced to it, and joined to the data connection it answers with
(wire format: tunnel_wire.py).

A malformed or oversized header, an unknown op, a wrong secret or an id that is not open closes
that connection with a log line and changes nothing else. A relay keeps at most `max_tunnels`
tunnels and `max_pending` unanswered peer connections per tunnel; a peer connection the node
does not answer within `open_timeout_s` is closed. There is no authentication beyond the secret
of each tunnel yet (the security issue adds swarm credentials).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import ssl
from dataclasses import dataclass, field
from typing import Any

from ravnest_node.state import valid_node_id
from ravnest_node.transport.options import split_host_port
from ravnest_node.transport.tunnel_wire import (
    PING_S,
    TunnelError,
    encode_header,
    header_field,
    header_op,
    host_port,
    keepalive,
    nodelay,
    read_header,
    splice,
)

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 5.0
"""A connection to the relay must send its header within this time."""
MAX_HANDSHAKES = 64
"""Connections to the relay still sending their header, at most (more are closed at once)."""
MIN_ASKED_PORT = 1024
"""Without --relay-ports, a node asking for a port below this gets one the system picks."""


@dataclass(slots=True)
class _Tunnel:
    node_id: str
    secret: str
    control: asyncio.StreamWriter
    address: str = ""
    server: asyncio.Server | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    pending: dict[int, asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = field(
        default_factory=dict
    )
    next_id: int = 0
    bytes: int = 0
    """Bytes carried for this node's peers, both ways."""

    def count(self, nbytes: int) -> None:
        self.bytes += nbytes


class RelayServer:
    """The relay: accepts control and data connections on one port (`--relay-listen`) and opens
    a public port per tunnel on `public_host`."""

    def __init__(
        self,
        listen: str,
        public_host: str,
        *,
        max_tunnels: int = 16,
        max_pending: int = 64,
        open_timeout_s: float = 10.0,
        node_id: str = "",
        ports: range | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._host, self._port = split_host_port(listen)
        self._tls = tls
        """A protected swarm: control and data connections must pass mutual TLS first (the
        tunnels' public ports carry the nodes' own TLS, and are joined as they are)."""
        self._ports = ports
        """The ports tunnels get (--relay-ports); None: any port the system picks."""
        self._next_port = 0
        self._node_id = node_id
        """The node this relay runs in (told to the nodes it relays, for the planner)."""
        self._public_host = public_host
        self._max_tunnels = max_tunnels
        self._max_pending = max_pending
        self._open_timeout_s = open_timeout_s
        self._server: asyncio.Server | None = None
        self._tunnels: dict[str, _Tunnel] = {}
        self._handshakes = 0
        self._connections: set[asyncio.StreamWriter] = set()
        """Every connection open now (closed with the relay)."""
        self.refused = 0
        """Connections closed for breaking the protocol."""

    @property
    def address(self) -> str:
        return host_port(self._public_host, self._port)

    def tunnels(self) -> dict[str, str]:
        """Node id -> the address peers reach it at, for the tunnels open now."""
        return {n: t.address for n, t in self._tunnels.items() if t.address}

    def bytes_carried(self) -> dict[str, int]:
        """Node id -> bytes carried for it, for the tunnels open now."""
        return {n: t.bytes for n, t in self._tunnels.items() if t.address}

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)
        self._port = self._server.sockets[0].getsockname()[1]
        log.info("relay for nodes that cannot accept connections on %s:%d", self._host, self._port)
        return self._port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for tunnel in list(self._tunnels.values()):
            if tunnel.server is not None:
                tunnel.server.close()
        for writer in list(self._connections):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if self._handshakes >= MAX_HANDSHAKES:
            log.warning("relay: %d connections are sending their header: %s is closed",
                        MAX_HANDSHAKES, peer)  # fmt: skip
            writer.close()
            return
        self._connections.add(writer)
        try:
            self._handshakes += 1
            try:
                if self._tls is not None:
                    try:
                        await writer.start_tls(self._tls, ssl_handshake_timeout=HEADER_TIMEOUT_S)
                    except (ConnectionError, ssl.SSLEOFError):
                        raise  # closed before TLS was done (a node timing its round trip)
                    except (ssl.SSLError, OSError, TimeoutError) as exc:
                        self.refused += 1  # nothing to answer it with: it has no TLS
                        log.warning("relay: refused a connection from %s: mutual TLS failed: "
                                    "%s", peer, exc)  # fmt: skip
                        return
                async with asyncio.timeout(HEADER_TIMEOUT_S):
                    header = await read_header(reader)
            finally:
                self._handshakes -= 1
            op = header_op(header)
            if op == "register":
                await self._register(header, reader, writer)
            elif op == "data":
                await self._data(header, reader, writer)
            else:
                raise TunnelError(f"unknown op {op[:32]!r}")
        except TunnelError as exc:
            self.refused += 1
            log.warning("relay: refused a connection from %s: %s", peer, exc)
            with contextlib.suppress(ConnectionError, TunnelError):
                writer.write(encode_header({"ok": False, "error": str(exc)[:200]}))
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug("relay: connection from %s ended: %r", peer, exc)
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _open_port(self, tunnel: _Tunnel, port: int) -> asyncio.Server:
        """The public port of `tunnel`: `port` if given (a node back for its old one), else one
        of `--relay-ports` that is free (in turn), else any. TunnelError if none opens."""
        candidates = [port]
        if not port and self._ports is not None:
            start = self._next_port % len(self._ports)
            candidates = [self._ports[(start + i) % len(self._ports)]
                          for i in range(len(self._ports))]  # fmt: skip
        error: OSError | None = None
        for candidate in candidates:
            try:
                server = await asyncio.start_server(
                    lambda r, w: self._public(tunnel, r, w), self._host, candidate
                )
            except OSError as exc:
                error = exc
                continue
            if self._ports is not None and candidate in self._ports:
                self._next_port = self._ports.index(candidate) + 1
            return server
        assert error is not None
        if port or self._ports is None:
            raise TunnelError(f"cannot open port {port}: {error.strerror or error}")
        raise TunnelError(f"no free port in {self._ports.start}-{self._ports.stop - 1}")

    async def _register(
        self, header: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        node_id = header_field(header, "node", str)
        port = header_field(header, "port", int)
        if not valid_node_id(node_id):
            raise TunnelError("not a node id")
        if not 0 <= port <= 65535:
            raise TunnelError(f"port {port} out of range")
        if port and (port < MIN_ASKED_PORT if self._ports is None else port not in self._ports):
            port = 0  # not a port this relay gives out: the node gets another
        old = self._tunnels.get(node_id)
        if old is not None:
            # The node reconnects before this relay saw its old control connection die: with
            # the old tunnel's secret it may replace it (and keep its port).
            secret = header.get("secret")
            if not isinstance(secret, str) or not hmac.compare_digest(secret, old.secret):
                raise TunnelError(f"node {node_id} already has a tunnel here")
            old.control.close()
            try:
                async with asyncio.timeout(HEADER_TIMEOUT_S):
                    await old.closed.wait()
            except TimeoutError:
                raise TunnelError(f"the old tunnel of node {node_id} does not close") from None
        if len(self._tunnels) >= self._max_tunnels:
            raise TunnelError(f"this relay serves {self._max_tunnels} tunnels already")
        tunnel = _Tunnel(node_id, secrets.token_hex(16), writer)
        self._tunnels[node_id] = tunnel
        try:
            tunnel.server = await self._open_port(tunnel, port)
            public_port = tunnel.server.sockets[0].getsockname()[1]
            tunnel.address = host_port(self._public_host, public_port)
            nodelay(writer)
            keepalive(writer)
            writer.write(encode_header({"ok": True, "address": tunnel.address,
                                        "secret": tunnel.secret,
                                        "relay_node": self._node_id}))  # fmt: skip
            await writer.drain()
            log.info("relay: node %s is reached at %s", node_id, tunnel.address)
            # The node sends nothing more on its control connection: its end closes the tunnel.
            pings = asyncio.create_task(self._ping(tunnel))
            try:
                if await reader.read(1):
                    raise TunnelError("data on a control connection")
            finally:
                pings.cancel()
        finally:
            tunnel.closed.set()
            del self._tunnels[node_id]
            if tunnel.server is not None:
                tunnel.server.close()
            for future in tunnel.pending.values():
                future.cancel()
            log.info("relay: the tunnel of node %s is closed", node_id)

    async def _ping(self, tunnel: _Tunnel) -> None:
        """Keep the tunnel's control connection from looking idle, to the node and to NATs."""
        with contextlib.suppress(ConnectionError, OSError):
            while True:
                await asyncio.sleep(PING_S)  # the ping's period, not a wait for an event
                tunnel.control.write(encode_header({"op": "ping"}))
                await tunnel.control.drain()

    async def _public(
        self, tunnel: _Tunnel, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A peer connected to a tunnelled node's port: ask the node for a data connection and
        join the two."""
        if len(tunnel.pending) >= self._max_pending:
            log.warning("relay: node %s has %d connections waiting: one more is closed",
                        tunnel.node_id, self._max_pending)  # fmt: skip
            writer.close()
            return
        conn_id, tunnel.next_id = tunnel.next_id, tunnel.next_id + 1
        future = asyncio.get_running_loop().create_future()
        tunnel.pending[conn_id] = future
        try:
            tunnel.control.write(encode_header({"op": "open", "id": conn_id}))
            await tunnel.control.drain()
            async with asyncio.timeout(self._open_timeout_s):
                data = await future
        except (TimeoutError, asyncio.CancelledError, ConnectionError, OSError) as exc:
            if isinstance(exc, asyncio.CancelledError) and not future.cancelled():
                raise
            log.info("relay: node %s did not answer connection %d", tunnel.node_id, conn_id)
            if future.done() and not future.cancelled():  # it answered just too late
                future.result()[1].close()
            writer.close()
            return
        finally:
            tunnel.pending.pop(conn_id, None)
        nodelay(writer)
        self._connections.add(writer)
        try:
            await splice((reader, writer), data, tunnel.count)
        finally:
            self._connections.discard(writer)

    async def _data(
        self, header: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        node_id = header_field(header, "node", str)
        secret = header_field(header, "secret", str)
        conn_id = header_field(header, "id", int)
        tunnel = self._tunnels.get(node_id)
        if tunnel is None or not hmac.compare_digest(secret, tunnel.secret):
            raise TunnelError(f"no tunnel of node {node_id[:64]!r} with that secret")
        future = tunnel.pending.get(conn_id)
        if future is None or future.done():
            raise TunnelError(f"connection {conn_id} of node {node_id} is not waiting")
        nodelay(writer)
        future.set_result((reader, writer))
        await writer.wait_closed()  # the peer's handler splices; this one keeps the connection
