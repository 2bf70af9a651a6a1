"""What a node says about itself over mDNS, and how a record from the network is read.

Every node advertises one service of type `SERVICE_TYPE` whose SRV record carries its gRPC port,
whose A/AAAA records carry its addresses, and whose TXT record carries four keys:

| key     | value                                                       |
|---------|-------------------------------------------------------------|
| `swarm` | the swarm name (`--swarm-name`)                             |
| `node`  | the node id                                                 |
| `proto` | the control-plane protocol version, e.g. `ravnest.v1`       |
| `role`  | `coordinator` or `worker`                                   |

A record received from the network is a hint from a stranger, never a fact: `parse_txt` and
`peer_addresses` are pure functions that turn *anything* into either a value or an `Ignored`
reason, never an exception, and whatever they accept is still checked over gRPC before use.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ravnest_node.state import valid_node_id, valid_swarm_name

SERVICE_TYPE = "_ravnest._tcp.local."
Role = Literal["coordinator", "worker"]
ROLES: tuple[Role, ...] = ("coordinator", "worker")
TXT_KEYS = ("swarm", "node", "proto", "role")

# One TXT string is `key=value` in at most 255 bytes; a longer value cannot be ours.
MAX_VALUE_BYTES = 200
# Our records have four keys; leave room for later versions, refuse a flood.
MAX_TXT_KEYS = 16
MAX_KEY_BYTES = 32
MAX_PROTOCOL_LEN = 32
# Addresses taken from one record; more are dropped (a record is a hint, not a host list).
MAX_ADDRESSES = 8


@dataclass(frozen=True, slots=True)
class TxtRecord:
    """The TXT keys of one node's advertisement."""

    swarm: str
    node_id: str
    protocol: str
    role: Role


@dataclass(frozen=True, slots=True)
class Ignored:
    """Why a record from the network was not taken (logged at debug level)."""

    reason: str


@dataclass(frozen=True, slots=True)
class PeerRecord:
    """A node of this swarm seen over mDNS: its TXT keys and the gRPC addresses to try."""

    txt: TxtRecord
    addresses: tuple[str, ...]
    """"host:port" strings ("[v6]:port" for IPv6), IPv4 first."""


def encode_txt(record: TxtRecord) -> dict[str, str]:
    """The TXT properties that advertise `record` (zeroconf encodes them as UTF-8)."""
    return {
        "swarm": record.swarm,
        "node": record.node_id,
        "proto": record.protocol,
        "role": record.role,
    }


def parse_txt(properties: object, *, swarm: str, protocol: str) -> TxtRecord | Ignored:
    """Read a TXT record as zeroconf hands it over (a mapping of bytes to bytes or None) and
    keep it only if it is a well-formed record of `swarm` speaking `protocol`. Never raises:
    anything unexpected, whatever its type or size, is an `Ignored` with the reason."""
    if not isinstance(properties, Mapping):
        return Ignored(f"TXT is a {type(properties).__name__}, not a mapping")
    if len(properties) > MAX_TXT_KEYS:
        return Ignored(f"{len(properties)} TXT keys (at most {MAX_TXT_KEYS})")
    values: dict[str, str] = {}
    for raw_key, raw_value in properties.items():
        if not isinstance(raw_key, bytes) or len(raw_key) > MAX_KEY_BYTES:
            return Ignored("a TXT key that is not a short byte string")
        key = raw_key.decode("ascii", errors="replace").lower()
        if key not in TXT_KEYS:
            continue  # a later version may add keys
        if not isinstance(raw_value, bytes):
            return Ignored(f"TXT key {key!r} has no value")
        if len(raw_value) > MAX_VALUE_BYTES:
            return Ignored(
                f"TXT key {key!r} has {len(raw_value)} bytes (at most {MAX_VALUE_BYTES})"
            )
        try:
            value = raw_value.decode("utf-8")
        except UnicodeDecodeError:
            return Ignored(f"TXT key {key!r} is not UTF-8")
        if not value.isprintable():
            return Ignored(f"TXT key {key!r} has control characters")
        values[key] = value
    missing = [key for key in TXT_KEYS if key not in values]
    if missing:
        return Ignored(f"TXT keys missing: {', '.join(missing)}")
    if not valid_swarm_name(values["swarm"]):
        return Ignored("the swarm name is not 1 to 64 printable characters")
    if values["swarm"] != swarm:
        return Ignored(f"another swarm ({values['swarm']!r})")
    if len(values["proto"]) > MAX_PROTOCOL_LEN or values["proto"] != protocol:
        return Ignored(f"protocol {values['proto'][:MAX_PROTOCOL_LEN]!r}, not {protocol!r}")
    if not valid_node_id(values["node"]):
        return Ignored("the node id is not a short ASCII word")
    role = next((r for r in ROLES if r == values["role"]), None)
    if role is None:
        return Ignored(f"role {values['role'][:16]!r} is not one of {', '.join(ROLES)}")
    return TxtRecord(swarm=swarm, node_id=values["node"], protocol=protocol, role=role)


def peer_addresses(ips: object, port: object) -> tuple[str, ...] | Ignored:
    """The gRPC addresses ("host:port") of a record's IP addresses and SRV port: IPv4 first,
    at most MAX_ADDRESSES; link-local, multicast and unspecified addresses are left out (a
    gRPC target cannot name their scope). Never raises."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 65535:
        return Ignored(f"port {port!r} is not 1 to 65535")
    if not isinstance(ips, Sequence) or isinstance(ips, str | bytes):
        return Ignored("addresses are not a list")
    parsed: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for ip in list(ips)[: 4 * MAX_ADDRESSES]:
        if not isinstance(ip, str) or len(ip) > 64:
            continue
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            continue
        if address.is_link_local or address.is_multicast or address.is_unspecified:
            continue
        if address not in parsed:
            parsed.append(address)
    parsed.sort(key=lambda a: a.version)
    out = tuple(
        f"{a}:{port}" if a.version == 4 else f"[{a}]:{port}" for a in parsed[:MAX_ADDRESSES]
    )
    return out if out else Ignored("no usable address")
