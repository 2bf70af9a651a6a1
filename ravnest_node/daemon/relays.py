"""Relays for nodes behind NAT: this node's tunnel through a relay (`--relay`, or one it
chooses from the coordinator's offers when it cannot accept connections or the coordinator
cannot reach it), and the relay it serves for others (`--relay-listen`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from ravnest_node.daemon.config import (
    NodeConfig,
    ipaddress_is_wildcard,
    is_address,
    parse_port_range,
)
from ravnest_node.errors import PeerError, StartupError, Unreachable
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.errors import peer_errors
from ravnest_node.transport.options import grpc_channel, split_host_port
from ravnest_node.transport.tunnel import RelayServer, TunnelClient, connect_rtt

log = logging.getLogger(__name__)

# --no-inbound without --relay: of the relays the coordinator offers, at most this many are
# timed, each connect within this many seconds.
MAX_RELAY_OFFERS = 16
RELAY_RTT_TIMEOUT_S = 2.0

Coordinator = Callable[[], Awaitable[str]]
"""The address of the coordinator to ask for relays; PeerError if there is none."""


def relay_advice(relay: str) -> str:
    """What to check when the coordinator cannot reach a node at the port its relay opened."""
    return (
        f"That is the port relay {relay} opened for this node: check the relay's --advertise "
        "(the host its ports are reached at) and that its firewall lets the swarm reach its "
        "ports (--relay-ports LOW-HIGH)"
    )


class Relays:
    """This node's tunnel through a relay (`tunnel`) and the relay it serves (`server`), both
    opened by `start` (or the tunnel later by `join_through`) and closed by `close`."""

    def __init__(self, config: NodeConfig, node_id: str) -> None:
        self._config = config
        self._node_id = node_id
        self._local = ""
        """HOST:PORT of this node's server as the tunnel reaches it (its local end)."""
        self.tunnel: TunnelClient | None = None
        """This node's tunnel through its relay."""
        self.server: RelayServer | None = None
        """The relay this node serves (--relay-listen)."""

    @property
    def relay_node_id(self) -> str:
        """The node id of the relay this node is reached through ("" if none)."""
        return self.tunnel.relay_node_id if self.tunnel is not None else ""

    @property
    def relay_address(self) -> str:
        """The address of the relay this node serves ("" if none)."""
        return self.server.address if self.server is not None else ""

    async def start(self, host: str, port: int, coordinator: Coordinator) -> str:
        """This node's server listens on `host`:`port`: open its tunnel (--relay; with
        --no-inbound the relay with the lowest round trip of those `coordinator` offers) and
        serve its relay (--relay-listen). This node's address through the tunnel, or "" if it
        has none. StartupError if either cannot be opened."""
        self._local = f"{'127.0.0.1' if ipaddress_is_wildcard(host) else host}:{port}"
        relays = self._config.relays
        address = ""
        if relays.relay is not None:
            address = await self._open_tunnel(relays.relay)
        elif relays.no_inbound:
            address = await self._open_chosen(coordinator)
        if relays.relay_listen is not None:
            await self._serve(relays.relay_listen)
        return address

    async def join_through(self, refused: Unreachable, coordinator: Coordinator) -> str:
        """The coordinator cannot reach this node at its address: open a tunnel through a
        relay it offers; this node's address there. Unreachable, with what to do, if this node
        may not go through a relay (announced over mDNS, serving a relay, or reached through
        one already); StartupError if no relay can be opened."""
        cfg = self._config
        if self.tunnel is not None:
            raise Unreachable(f"{refused}. {relay_advice(self.tunnel.relay)}")
        if cfg.discovery.mdns or cfg.relays.relay_listen is not None:
            why = (
                "it serves a relay (--relay-listen), which must be reachable itself"
                if cfg.relays.relay_listen is not None
                else "it is announced over mDNS, at its address on the LAN; across NAT, start "
                "it with --join or --peer and no --mdns"
            )
            raise Unreachable(f"{refused}. This node does not go through a relay: {why}")
        log.warning("%s. Going through a relay it offers", refused)
        return await self._open_chosen(coordinator)

    async def keep(self) -> None:
        """Keep the tunnel open (reconnecting) until cancelled; PeerError if it cannot."""
        assert self.tunnel is not None
        await self.tunnel.run()

    async def close(self) -> None:
        if self.tunnel is not None:
            self.tunnel.close()
        if self.server is not None:
            await self.server.close()

    async def _open_chosen(self, coordinator: Coordinator) -> str:
        """Open this node's tunnel through the relay with the lowest round trip of those the
        coordinator offers, or the next if it cannot (`_choose`); this node's address there.
        StartupError if none can."""
        relays = await self._choose(coordinator)
        for i, relay in enumerate(relays):
            try:
                return await self._open_tunnel(relay)
            except StartupError as exc:
                if i == len(relays) - 1:
                    raise
                log.warning("%s; trying the next relay", exc)
        raise AssertionError("not reached: _choose returns at least one relay")

    async def _choose(self, coordinator: Coordinator) -> list[str]:
        """The relays the coordinator offers (SwarmView.relays) that answer, by their round
        trip (TCP connects), lowest first. StartupError if there is no coordinator to ask, or
        no relay is offered or answers."""
        transport = self._config.transport
        timeout_s = transport.connect_timeout_s
        try:
            address = await coordinator()
            async with grpc_channel(address, transport) as channel:
                with peer_errors(f"coordinator {address}"):
                    view: pb.SwarmView = await pb_grpc.CoordinatorStub(channel).Swarm(
                        pb.SwarmRequest(), timeout=timeout_s
                    )
        except PeerError as exc:
            raise StartupError(
                f"behind NAT: cannot ask the coordinator for a relay: {exc}"
            ) from None
        offers = [o for o in view.relays[:MAX_RELAY_OFFERS] if is_address(o.address)]
        if not offers:
            raise StartupError(
                f"behind NAT: coordinator {address} offers no relay: start a reachable node "
                "with --relay-listen HOST:PORT, or name one with --relay"
            )
        rtts = await asyncio.gather(*(connect_rtt(o.address, RELAY_RTT_TIMEOUT_S) for o in offers))
        answered = [(rtt, o) for rtt, o in zip(rtts, offers, strict=True) if rtt is not None]
        if not answered:
            raise StartupError(
                "behind NAT: no relay the coordinator offers answers: "
                + ", ".join(f"{o.node_id} at {o.address}" for o in offers)
            )
        answered.sort(key=lambda a: a[0])
        rtt, best = answered[0]
        log.info("relay chosen: %s at %s (round trip %.1f ms, of %d offered, %d answered)",
                 best.node_id, best.address, rtt * 1e3, len(offers), len(answered))  # fmt: skip
        return [o.address for _, o in answered]

    async def _open_tunnel(self, relay_address: str) -> str:
        """Open this node's tunnel through the relay at `relay_address`; this node's address
        there (the port the relay opened for it). StartupError if it cannot."""
        creds = self._config.transport.credentials  # a protected swarm: relays use mutual TLS
        tunnel = TunnelClient(
            relay_address,
            self._node_id,
            self._local,
            connect_timeout_s=self._config.transport.connect_timeout_s,
            tls=creds.client_context() if creds is not None else None,
        )
        try:
            address = await tunnel.open()
        except PeerError as exc:
            tunnel.close()
            raise StartupError(f"cannot be reached through relay {relay_address}: {exc}") from None
        except BaseException:  # cancelled (stopped) while it opened
            tunnel.close()
            raise
        self.tunnel = tunnel
        return address

    async def _serve(self, listen: str) -> None:
        """Serve as a relay on `listen`; StartupError if it cannot."""
        cfg = self._config
        creds = cfg.transport.credentials
        ports = parse_port_range(cfg.relays.relay_ports) if cfg.relays.relay_ports else None
        server = RelayServer(
            listen,
            split_host_port(cfg.advertise or listen)[0],
            node_id=self._node_id,
            ports=ports,
            tls=creds.server_context() if creds is not None else None,
        )
        try:
            await server.start()
        except OSError as exc:
            raise StartupError(
                f"cannot serve as a relay on {listen}: {exc.strerror or exc}"
            ) from None
        self.server = server
