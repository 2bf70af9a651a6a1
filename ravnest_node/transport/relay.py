"""Reverse tunnels: a node that cannot accept connections (behind NAT) is reached via a relay.

Most home PCs sit behind NAT: they can open connections, nobody can open one to them. Such a
node (`--no-inbound --relay HOST:PORT`) opens a *control connection* to a relay: any node that
can be reached, started with `--relay-listen HOST:PORT`. The relay opens a port for it, and that
port is the node's address for everyone else. Each connection a peer makes to that port is
announced over the control connection; the node answers with a new outbound *data connection*
to the relay and joins it to its own gRPC server on loopback, and the relay joins the peer's
connection to it. So every RPC to the node (boundary streams, block and checkpoint fetches,
votes, status probes) rides on connections the node opened itself, and nothing above TCP
changes. The relay's link carries that traffic twice (in and out): the price of a node nobody can
reach directly.

Wire format on the relay's port: each connection starts with one header, a 4-byte big-endian
length and a msgpack map of at most MAX_HEADER_BYTES:

- `{"op": "register", "node": ID, "port": P}` asks for a tunnel (P: the port wanted, 0 for any:
  a node that reconnects asks for its old port, as its peers know that address). The relay
  gives a port of its `--relay-ports` range if it has one (P only if it is in it), else one the
  system picks (P only if it is 1024 or above). The relay
  answers `{"ok": true, "address": "HOST:PORT", "secret": HEX}` or `{"ok": false, "error":
  WHY}`, then sends `{"op": "open", "id": N}` on this connection, one per peer connection.
- `{"op": "data", "node": ID, "secret": HEX, "id": N}` answers `open` N; from then on the
  connection carries the peer's bytes both ways.

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
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ravnest_node.errors import ConfigError, PeerRefused, PeerUnavailable
from ravnest_node.state import valid_node_id
from ravnest_node.transport.credentials import TLS_NAME
from ravnest_node.transport.options import split_host_port

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 512
CHUNK_BYTES = 256 * 1024
HEADER_TIMEOUT_S = 5.0
"""A connection to the relay must send its header within this time."""
MAX_HANDSHAKES = 64
"""Connections to the relay still sending their header, at most (more are closed at once)."""
PING_S = 15.0
"""The relay sends a ping on every control connection this often; a node that hears nothing
for CONTROL_SILENCE_S counts its control connection dead (a NAT that forgot it) and reconnects."""
CONTROL_SILENCE_S = 3 * PING_S
HALF_CLOSE_S = 30.0
"""After one direction of a relayed connection ends, the other gets this long to end too."""
MIN_ASKED_PORT = 1024
"""Without --relay-ports, a node asking for a port below this gets one the system picks."""
RECONNECT_FIRST_S = 0.25
RECONNECT_MAX_S = 4.0


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


def _op(header: dict[str, Any]) -> str:
    op = header.get("op")
    if not isinstance(op, str):
        raise TunnelError("header has no op")
    return op


def _field(header: dict[str, Any], key: str, kind: type) -> Any:
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
            op = _op(header)
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
        node_id = _field(header, "node", str)
        port = _field(header, "port", int)
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
        node_id = _field(header, "node", str)
        secret = _field(header, "secret", str)
        conn_id = _field(header, "id", int)
        tunnel = self._tunnels.get(node_id)
        if tunnel is None or not hmac.compare_digest(secret, tunnel.secret):
            raise TunnelError(f"no tunnel of node {node_id[:64]!r} with that secret")
        future = tunnel.pending.get(conn_id)
        if future is None or future.done():
            raise TunnelError(f"connection {conn_id} of node {node_id} is not waiting")
        nodelay(writer)
        future.set_result((reader, writer))
        await writer.wait_closed()  # the peer's handler splices; this one keeps the connection


class TunnelClient:
    """The node's side: a control connection to the relay, and a data connection per peer
    connection, joined to this node's own server at `local`."""

    def __init__(
        self,
        relay: str,
        node_id: str,
        local: str,
        *,
        connect_timeout_s: float = 30.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        split_host_port(relay)
        self._relay = relay
        self._tls = tls
        """A protected swarm: connections to the relay use mutual TLS (not those to `local`)."""
        self._node_id = node_id
        self._local = local
        self._connect_timeout_s = connect_timeout_s
        self.address = ""
        """The address peers reach this node at (the relay's port for it)."""
        self._secret = ""
        self._control: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._splices: set[asyncio.Task[None]] = set()
        self.connections = 0
        """Peer connections carried so far."""
        self.relay_node_id = ""
        """The relay's node id, as it said ("" if it did not, or said something else)."""
        self.registered = asyncio.Event()
        """Set each time the relay has opened (or given back) this node's tunnel."""

    @property
    def relay(self) -> str:
        """The relay's address ("host:port"), as given."""
        return self._relay

    async def _connect(
        self, address: str, tls: bool = False
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = split_host_port(address)
        secure: dict[str, Any] = (
            {"ssl": self._tls, "server_hostname": TLS_NAME} if tls and self._tls else {}
        )
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                reader, writer = await asyncio.open_connection(host, port, **secure)
        except (TimeoutError, OSError) as exc:
            raise PeerUnavailable(f"cannot connect to {address}: {exc}") from None
        nodelay(writer)
        return reader, writer

    async def open(self) -> str:
        """Register with the relay (asking for the port this node had, if any); the address
        peers reach this node at. PeerUnavailable / PeerRefused if the relay cannot be reached
        or refuses."""
        reader, writer = await self._connect(self._relay, tls=True)
        port = split_host_port(self.address)[1] if self.address else 0
        register: dict[str, Any] = {"op": "register", "node": self._node_id, "port": port}
        if self._secret:  # replaces the old tunnel if the relay still holds it
            register["secret"] = self._secret
        try:
            writer.write(encode_header(register))
            await writer.drain()
            async with asyncio.timeout(self._connect_timeout_s):
                reply = await read_header(reader)
        except (TimeoutError, asyncio.IncompleteReadError, OSError, TunnelError) as exc:
            writer.close()
            raise PeerUnavailable(f"relay {self._relay} did not answer: {exc!r}") from None
        if reply.get("ok") is not True:
            writer.close()
            raise PeerRefused(f"relay {self._relay} refused a tunnel: {reply.get('error')!s:.200}")
        try:
            address: str = _field(reply, "address", str)
            self._secret = _field(reply, "secret", str)
            split_host_port(address)
        except (TunnelError, ConfigError) as exc:
            writer.close()
            raise PeerRefused(f"relay {self._relay} answered nonsense: {exc}") from None
        if self.address and address != self.address:
            writer.close()
            raise PeerUnavailable(
                f"relay {self._relay} gave this node another address ({address}, it was "
                f"{self.address}): its peers would not find it"
            )
        self.address = address
        relay_node = reply.get("relay_node")
        self.relay_node_id = relay_node if isinstance(relay_node, str) and valid_node_id(
            relay_node) else ""  # fmt: skip
        keepalive(writer)
        self._control = (reader, writer)
        self.registered.set()
        log.info("reached through relay %s at %s", self._relay, address)
        return address

    async def run(self) -> None:
        """Answer the relay's `open` requests until cancelled; after a lost control connection,
        register again for the same address (PeerUnavailable if that fails for the connect
        timeout)."""
        try:
            while True:
                assert self._control is not None
                reader, _ = self._control
                try:
                    while True:
                        async with asyncio.timeout(CONTROL_SILENCE_S):  # the relay pings
                            header = await read_header(reader)
                        if (op := _op(header)) == "ping":
                            continue
                        if op != "open":
                            raise TunnelError(f"unexpected op {op[:32]!r}")
                        task = asyncio.create_task(self._carry(_field(header, "id", int)))
                        self._splices.add(task)
                        task.add_done_callback(self._splices.discard)
                except (TimeoutError, asyncio.IncompleteReadError, OSError, TunnelError) as exc:
                    log.warning("the control connection to relay %s ended (%r): reconnecting",
                                self._relay, exc)  # fmt: skip
                await self._reconnect()
        finally:
            self.close()

    async def _reconnect(self) -> None:
        if self._control is not None:
            self._control[1].close()
            self._control = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout_s
        wait_s = RECONNECT_FIRST_S
        while True:
            try:
                await self.open()
                return
            except (PeerUnavailable, PeerRefused):  # refused: the relay still holds the old one
                if loop.time() + wait_s > deadline:
                    raise
            await asyncio.sleep(wait_s)  # a back-off between attempts, not a wait for an event
            wait_s = min(2 * wait_s, RECONNECT_MAX_S)

    async def _carry(self, conn_id: int) -> None:
        """One peer connection: a data connection to the relay joined to the local server."""
        relay: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            relay = await self._connect(self._relay, tls=True)
            relay[1].write(encode_header({"op": "data", "node": self._node_id,
                                          "secret": self._secret, "id": conn_id}))  # fmt: skip
            await relay[1].drain()
            local = await self._connect(self._local)
        except (PeerUnavailable, ConnectionError, OSError) as exc:
            log.info("relayed connection %d not carried: %s", conn_id, exc)
            if relay is not None:
                relay[1].close()
            return
        self.connections += 1
        await splice(relay, local)

    def close(self) -> None:
        if self._control is not None:
            self._control[1].close()
            self._control = None
        for task in self._splices:
            task.cancel()
