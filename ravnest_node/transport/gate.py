"""The TLS gate of a node in a protected swarm: it accepts every connection to the node's
address, completes mutual TLS with the swarm's credentials, and joins each connection that
passes to the node's gRPC server, which listens on loopback only.

Why not gRPC's own server credentials: a gRPC server refuses a client without a valid
certificate inside its C core, and nothing of that reaches the application; the refusal is not
logged with the peer's address, and the server cannot limit connections per peer. The gate
does both: each refusal is one warning with the address and the reason (`refused a connection
from 203.0.113.9:51012: no certificate`), counted in `refused`; at most MAX_CONNECTIONS
connections are open at once, MAX_PER_HOST of them from one host, and a TLS handshake gets
HANDSHAKE_TIMEOUT_S. Channels still use gRPC's own TLS (`grpc.ssl_channel_credentials` with
the member certificate): only the server side passes through here.

The gate knows which peer each connection to the gRPC server carries: handlers see the gate as
their peer (`context.peer()` is a loopback address), and `peer_address` gives the real one.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import Counter
from dataclasses import dataclass
from urllib.parse import unquote

from ravnest_node.transport.options import is_loopback_host
from ravnest_node.transport.refusals import RefusalLog
from ravnest_node.transport.tunnel_wire import host_port, nodelay, splice

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
CLOSE_WAIT_S = 2.0
"""On close: how long connections get to end once aborted, before their tasks are cancelled."""
MAX_CONNECTIONS = 512
MAX_PER_HOST = 64
"""Connections from one host at once: a node opens a few per peer (one channel per neighbour,
averaging, probes, the coordinator's calls); a flood from one host leaves room for the rest.
Not for loopback: a one-machine swarm's nodes share it, and so do the connections a node behind
NAT gets through its relay (its tunnel joins them to the gate from loopback; the relay bounds
those, 64 unanswered per tunnel)."""


_ROUTES: dict[int, GatePeer] = {}
"""Every gate of this process: the local port of each connection it opened to its node's
server -> the peer that connection carries (local ports are unique on the host)."""


def route(grpc_peer: str) -> GatePeer | None:
    """The peer behind a gRPC handler's `context.peer()` if the call came through a gate of
    this process, else None."""
    host, _, port = grpc_peer.rpartition(":")
    return _ROUTES.get(int(port)) if port.isdigit() and "127.0.0.1" in host else None


def peer_host(grpc_peer: str) -> tuple[str, str]:
    """(host, "HOST:PORT") of a handler's `context.peer()`: the real peer behind a gate of this
    process, gRPC's form ("ipv6:%5B::1%5D:5000") undone ("::1", "[::1]:5000")."""
    peer = route(grpc_peer)
    address = peer.address if peer is not None else unquote(grpc_peer.partition(":")[2])
    address = address or grpc_peer
    host, sep, _ = address.rpartition(":")
    return (host.strip("[]") if sep else address), address


def peer_address(grpc_peer: str) -> str:
    """Who a gRPC handler's `context.peer()` really is: the peer's address and certificate
    name if the call came through a gate of this process, else `grpc_peer` itself."""
    peer = route(grpc_peer)
    return grpc_peer if peer is None else f"{peer.address} ({peer.subject})"


@dataclass(frozen=True, slots=True)
class GatePeer:
    """Who a connection through the gate comes from."""

    address: str
    """The peer's HOST:PORT as the gate saw it."""
    subject: str
    """The common name of the certificate it presented."""


class TlsGate:
    """Mutual TLS on `listen` (HOST, PORT) in front of the gRPC server at `backend`."""

    def __init__(
        self,
        host: str,
        port: int,
        backend: tuple[str, int],
        context: ssl.SSLContext,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_per_host: int = MAX_PER_HOST,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        limit_loopback: bool = False,
    ) -> None:
        self._host, self._port = host, port
        self._backend = backend
        self._context = context
        self._max_connections = max_connections
        self._max_per_host = max_per_host
        self._handshake_timeout_s = handshake_timeout_s
        self._limit_loopback = limit_loopback
        """Apply `max_per_host` to loopback too (see MAX_PER_HOST for why not, by default)."""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._open: set[asyncio.StreamWriter] = set()
        """Both ends of every connection through the gate (closed by `close`)."""
        self._per_host: Counter[str] = Counter()
        self.refused = 0
        """Connections refused so far (failed TLS, or over the limits)."""
        self._log = RefusalLog("connections", log)
        self.accepted = 0

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> int:
        """Listen; returns the port (an OSError if it cannot)."""
        self._server = await asyncio.start_server(self._accept, self._host, self._port)
        return self.port

    async def close(self) -> None:
        """Stop accepting, and end every connection (abruptly: the node is stopping)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        if self._tasks:  # their splices end as their connections do
            _, stuck = await asyncio.wait(list(self._tasks), timeout=CLOSE_WAIT_S)
            for task in stuck:
                task.cancel()
        if self._server is not None:
            await self._server.wait_closed()

    def _refuse(self, address: str, reason: str) -> None:
        """Count a refusal and log it (throttled in a flood)."""
        self.refused += 1
        self._log.warn("refused a connection from %s: %s", address, reason)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peername = writer.get_extra_info("peername") or ("?", 0)
        host, address = str(peername[0]), host_port(str(peername[0]), int(peername[1]))
        self._per_host[host] += 1
        self._open.add(writer)
        try:
            if len(self._tasks) > self._max_connections:
                self._refuse(address, f"{self._max_connections} connections are open")
            elif self._per_host[host] > self._max_per_host and (
                self._limit_loopback or not is_loopback_host(host)
            ):
                self._refuse(address, f"{self._max_per_host} connections from {host} are open")
            else:
                await self._serve(reader, writer, address)
        finally:
            writer.close()
            self._open.discard(writer)
            self._per_host[host] -= 1
            if not self._per_host[host]:
                del self._per_host[host]
            self._tasks.discard(task)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str
    ) -> None:
        try:
            await writer.start_tls(self._context, ssl_handshake_timeout=self._handshake_timeout_s)
        except (ConnectionError, ssl.SSLEOFError) as exc:
            # Closed before TLS was done (a port check, a round-trip timing): it left.
            log.debug("connection from %s closed during the TLS handshake: %r", address, exc)
            return
        except (ssl.SSLError, OSError, TimeoutError) as exc:
            self._refuse(address, _reason(exc))
            return
        cert = writer.get_extra_info("peercert") or {}
        subject = next(
            (value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"),
            "",
        )
        try:
            backend = await asyncio.open_connection(*self._backend)
        except OSError as exc:
            log.warning("gate: the node's server does not answer (%s): dropping %s", exc, address)
            return
        nodelay(writer)
        nodelay(backend[1])
        local_port = int(backend[1].get_extra_info("sockname")[1])
        _ROUTES[local_port] = GatePeer(address, subject)
        self._open.add(backend[1])
        self.accepted += 1
        try:
            await splice((reader, writer), backend)
        finally:
            _ROUTES.pop(local_port, None)
            self._open.discard(backend[1])


def _reason(exc: BaseException) -> str:
    """Why a TLS handshake failed, for a person."""
    text = str(exc)
    for needle, reason in (
        ("PEER_DID_NOT_RETURN_A_CERTIFICATE", "no certificate"),
        ("CERTIFICATE_REQUIRED", "no certificate"),
        ("peer did not return a certificate", "no certificate"),
        ("CERTIFICATE_VERIFY_FAILED", "a certificate this swarm's authority did not sign"),
        ("UNKNOWN_CA", "a certificate this swarm's authority did not sign"),
        ("WRONG_VERSION_NUMBER", "not TLS (an open node, or not a ravnest node)"),
        ("HTTP_REQUEST", "not TLS (an open node, or not a ravnest node)"),
        ("NO_APPLICATION_PROTOCOL", "no HTTP/2 (not a gRPC client)"),
    ):
        if needle in text:
            return reason
    if isinstance(exc, TimeoutError):
        return "no TLS handshake in time"
    detail = getattr(exc, "reason", None) or text or type(exc).__name__
    return f"TLS: {detail}"
