"""Reverse tunnels: a node that cannot accept connections (behind NAT) is reached via a relay.

Most home PCs sit behind NAT: they can open connections, nobody can open one to them. Such a
node (`--no-inbound --relay HOST:PORT`) opens a *control connection* to a relay: any node that
can be reached, started with `--relay-listen HOST:PORT` (relay.py). The relay opens a port for
it, and that port is the node's address for everyone else. Each connection a peer makes to that
port is announced over the control connection; the node answers with a new outbound *data
connection* to the relay and joins it to its own gRPC server on loopback, and the relay joins the
peer's connection to it. So every RPC to the node (boundary streams, block and checkpoint
fetches, votes, status probes) rides on connections the node opened itself, and nothing above TCP
changes. The relay's link carries that traffic twice (in and out): the price of a node nobody can
reach directly. The wire format is in tunnel_wire.py.

This module is the node's side, `TunnelClient`; it also re-exports what the daemon takes from
here (`RelayServer`, `connect_rtt`, `host_port`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from typing import Any

from ravnest_node.errors import ConfigError, PeerRefused, PeerUnavailable
from ravnest_node.state import valid_node_id
from ravnest_node.transport.credentials import TLS_NAME
from ravnest_node.transport.options import split_host_port
from ravnest_node.transport.relay import RelayServer
from ravnest_node.transport.tunnel_wire import (
    CONTROL_SILENCE_S,
    TunnelError,
    connect_rtt,
    encode_header,
    header_field,
    header_op,
    host_port,
    keepalive,
    nodelay,
    read_header,
    splice,
)

__all__ = ["RelayServer", "TunnelClient", "connect_rtt", "host_port"]

log = logging.getLogger(__name__)

RECONNECT_FIRST_S = 0.25
RECONNECT_MAX_S = 4.0


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
            address: str = header_field(reply, "address", str)
            self._secret = header_field(reply, "secret", str)
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
        register again for the same address (`_reconnect`: PeerRefused if the relay refuses it
        for the connect timeout)."""
        try:
            while True:
                assert self._control is not None
                reader, _ = self._control
                try:
                    while True:
                        async with asyncio.timeout(CONTROL_SILENCE_S):  # the relay pings
                            header = await read_header(reader)
                        if (op := header_op(header)) == "ping":
                            continue
                        if op != "open":
                            raise TunnelError(f"unexpected op {op[:32]!r}")
                        task = asyncio.create_task(self._carry(header_field(header, "id", int)))
                        self._splices.add(task)
                        task.add_done_callback(self._splices.discard)
                except (TimeoutError, asyncio.IncompleteReadError, OSError, TunnelError) as exc:
                    log.warning("the control connection to relay %s ended (%r): reconnecting",
                                self._relay, exc)  # fmt: skip
                await self._reconnect()
        finally:
            self.close()

    async def _reconnect(self) -> None:
        """Register again with the relay, as long as it takes while it does not answer (a link
        down for minutes costs minutes, never the node: issue #34); a refusal (the relay still
        holds the old control connection) is retried for the connect timeout, then raised."""
        if self._control is not None:
            self._control[1].close()
            self._control = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout_s
        wait_s, warned = RECONNECT_FIRST_S, False
        while True:
            try:
                await self.open()
                if warned:
                    log.warning("registered with relay %s again", self._relay)
                return
            except PeerUnavailable as exc:
                if not warned and loop.time() > deadline:
                    log.warning("relay %s does not answer (%s): still trying", self._relay, exc)
                    warned = True
            except PeerRefused:
                if loop.time() + wait_s > deadline:
                    raise
            # A back-off between attempts (jittered: nodes cut off together do not come back
            # in step), not a wait for an event.
            await asyncio.sleep(random.uniform(wait_s / 2, wait_s))
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
