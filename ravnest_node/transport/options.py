"""Transport settings, the gRPC channel/server options derived from them, and channels to peers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ravnest_node.errors import ConfigError, PeerUnavailable
from ravnest_node.identity import NodeKey
from ravnest_node.settings import NOT_A_SETTING
from ravnest_node.transport.credentials import TLS_NAME, SwarmCredentials, load_credentials
from ravnest_node.transport.proofs import provers


@dataclass(kw_only=True, frozen=True, slots=True)
class TransportConfig:
    """How a node talks to its peers."""

    max_message_bytes: int = 64 * 2**20
    """Largest gRPC message (one tensor frame) a node sends or accepts, in bytes."""
    max_header_bytes: int = 4096
    """Largest msgpack frame header a node accepts, in bytes (checked before unpacking)."""
    stop_grace_s: float = 3.0
    """Seconds that open streams get to finish when a node stops."""
    connect_timeout_s: float = 30.0
    """Seconds to wait for a peer's server (coordinator, neighbour) to answer before giving up."""
    peer_max_calls: int = 32
    """Calls one peer may have open on this node at once; more are refused (RESOURCE_EXHAUSTED).

    A peer is a host (a connection, for loopback). A node needs a few per neighbour."""
    peer_calls_per_s: float = 200.0
    """New calls per second one peer may make (a burst of one second's worth); more are refused.
    A node makes a few per step to its coordinator, fewer to others."""
    peer_messages_per_s: float = 2000.0
    """Messages per second on one peer's streams (a burst of one second's worth); more wait,
    which slows only that peer's sender (a boundary stream carries a few per microbatch)."""
    peer_inflight_bytes: int = 256 * 2**20
    """Bytes of one peer's messages that this node's handlers may hold at once; a message over
    it ends its call. At least max_message_bytes."""
    swarm_dir: Path | None = None
    """Protect the swarm with the credentials in DIR, made by `ravnest-node init-swarm`.

    Mutual TLS with every peer; peers without the swarm's certificate are refused and logged.
    Without it (or --token) the swarm is open: anyone who can reach a node may join."""
    token: str | None = field(default=None, repr=False)
    """Protect the swarm with the same credentials as one line (DIR/token), not --swarm-dir.

    Give it as RAVNEST_TRANSPORT_TOKEN to keep it out of the process list."""
    node_key: NodeKey | None = field(default=None, repr=False, compare=False,
                                     metadata=NOT_A_SETTING)  # fmt: skip
    """This node's key (identity.py): not a setting (no flag, no file key); a daemon sets it
    with `proving`, and every channel made from this config then carries its proofs (a copy
    made with `dataclasses.replace` keeps it)."""

    def __post_init__(self) -> None:
        if not 1024 <= self.max_message_bytes <= 2**31 - 1:
            raise ConfigError(
                f"max_message_bytes={self.max_message_bytes}: must be between 1024 and 2**31-1"
            )
        if not 64 <= self.max_header_bytes <= self.max_message_bytes:
            raise ConfigError(
                f"max_header_bytes={self.max_header_bytes}: must be between 64 and "
                "max_message_bytes"
            )
        if self.peer_max_calls < 1 or not (
            self.peer_calls_per_s > 0 and self.peer_messages_per_s > 0
        ):
            raise ConfigError(
                f"peer_max_calls={self.peer_max_calls}, peer_calls_per_s={self.peer_calls_per_s} "
                f"and peer_messages_per_s={self.peer_messages_per_s}: must be >= 1, > 0 and > 0"
            )
        if self.peer_inflight_bytes < self.max_message_bytes:
            raise ConfigError(
                f"peer_inflight_bytes={self.peer_inflight_bytes}: must be at least "
                f"max_message_bytes ({self.max_message_bytes}), or no message would fit"
            )
        if self.stop_grace_s < 0 or self.connect_timeout_s <= 0:
            raise ConfigError("stop_grace_s must be >= 0 and connect_timeout_s > 0 (seconds)")
        load_credentials(self.swarm_dir, self.token)  # ConfigError now, not at the first call

    def proving(self, key: NodeKey | None) -> TransportConfig:
        """This config, its channels' calls carrying `key`'s proofs (transport/proofs.py)."""
        return dataclasses.replace(self, node_key=key)

    @property
    def credentials(self) -> SwarmCredentials | None:
        """The swarm's credentials (None: an open swarm)."""
        return load_credentials(self.swarm_dir, self.token)


MAX_ADDRESS_LEN = 255


def split_host_port(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ConfigError if it is not one."""
    host, sep, port = address.rpartition(":")
    if (
        len(address) > MAX_ADDRESS_LEN
        or not sep
        or not host
        or not (port.isascii() and port.isdigit())
        or not 0 <= int(port) <= 65535
        or not (host.isascii() and host.isprintable())
        or any(c in host for c in "/ ")
    ):
        raise ConfigError(f"{address[:80]!r} is not HOST:PORT (e.g. 127.0.0.1:7070, port 0 = any)")
    return host.strip("[]"), int(port)


REFUSED_TIMEOUT_S = 1.0
"""How long a look at whether an address refuses connections waits for an answer."""


async def tcp_answer(address: str, timeout_s: float) -> bool | None:
    """A plain TCP connection to `address`: True if it is accepted, False if the address
    refuses it (nobody listens there: a stopped process), None if nothing answers within
    `timeout_s` or the host cannot be reached or named (a machine off, a link cut: no
    verdict)."""
    try:
        host, port = split_host_port(address)
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except ConnectionRefusedError:
        return False
    except (OSError, TimeoutError, ConfigError):
        return None
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def refuses_connections(address: str, timeout_s: float = REFUSED_TIMEOUT_S) -> bool:
    """Does `address` refuse a plain TCP connection now (`tcp_answer` False)?"""
    return await tcp_answer(address, timeout_s) is False


def is_loopback(address: str) -> bool:
    """Is HOST:PORT on this machine's loopback (127.0.0.0/8, ::1, localhost)?"""
    return is_loopback_host(split_host_port(address)[0])


def is_loopback_host(host: str) -> bool:
    """Is HOST (a name or an IP, no port) this machine's loopback?"""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def same_host(a: str, b: str) -> bool:
    """Are hosts `a` and `b` (names or IPs, no port) the same machine, as far as their text
    tells: equal IPs, equal names, or both loopback?"""
    if is_loopback_host(a) and is_loopback_host(b):
        return True
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a.lower() == b.lower()


def _message_limits(cfg: TransportConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
    ]


def server_options(cfg: TransportConfig) -> list[tuple[str, int]]:
    """Options for a node's gRPC server."""
    return [
        *_message_limits(cfg),
        # Without this, gRPC binds a port another server already listens on (SO_REUSEPORT),
        # and two nodes silently share one address.
        ("grpc.so_reuseport", 0),
        # Peers ping idle streams (see channel_options); allow it instead of answering GOAWAY.
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # And ping them: a peer that froze (not crashed) is noticed within ~30 s, not hours.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def channel_options(cfg: TransportConfig) -> list[tuple[str, int]]:
    """Options for channels a node opens to its peers."""
    return [
        *_message_limits(cfg),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Keep pinging while a stream waits for data (the default stops after two pings).
        ("grpc.http2.max_pings_without_data", 0),
        # A peer that went away (a coordinator restarting) is tried again at least every 2 s,
        # not after gRPC's default back-off of up to 120 s.
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


ChannelArgs = tuple[list[tuple[str, int | str]], grpc.ChannelCredentials | None]


def _channel_args(cfg: TransportConfig) -> ChannelArgs:
    creds = cfg.credentials
    options: list[tuple[str, int | str]] = [*channel_options(cfg)]
    if creds is None:
        return options, None
    options.append(("grpc.ssl_target_name_override", TLS_NAME))
    return options, grpc.ssl_channel_credentials(creds.ca_pem, creds.key_pem, creds.cert_pem)


def grpc_channel(
    address: str, cfg: TransportConfig, interceptors: Sequence[Any] = ()
) -> grpc.aio.Channel:
    """A channel to the node at `address`: mutual TLS with the swarm's credentials, or plain
    in an open swarm; its calls go through `interceptors` (client interceptors)."""
    options, creds = _channel_args(cfg)
    proving = provers(cfg.node_key) if cfg.node_key is not None else []
    chain = [*proving, *interceptors] or None
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=chain)
    return grpc.aio.secure_channel(address, creds, options=options, interceptors=chain)


@asynccontextmanager
async def open_channel(
    address: str, cfg: TransportConfig, interceptors: Sequence[Any] = ()
) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a peer, ready to use (closed on the way out); PeerUnavailable if it does
    not answer within the connect timeout."""
    channel = grpc_channel(address, cfg, interceptors)
    try:
        try:
            async with asyncio.timeout(cfg.connect_timeout_s):
                await channel.channel_ready()
        except TimeoutError:
            raise PeerUnavailable(
                f"no answer from {address} within {cfg.connect_timeout_s:g} s"
            ) from None
        yield channel
    finally:
        await channel.close(grace=None)


def grpc_sync_channel(address: str, cfg: TransportConfig) -> grpc.Channel:
    """The same as `grpc_channel`, for blocking code (the status command)."""
    options, creds = _channel_args(cfg)
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)
