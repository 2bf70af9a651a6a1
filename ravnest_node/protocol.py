"""The wire protocol's constants: what both ends of a `ravnest.v1` call agree on.

Below every layer (it imports nothing of the package), so that a client never imports a
server's module to learn them: a worker, `status` and the coordinator all read them here.
docs/protocol.md describes the calls these numbers bound.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_LEASE_S",
    "LOST_AFTER_LEASES",
    "MAX_EPOCH_AHEAD",
    "MAX_OFFERS",
    "MAX_PEER_LINKS",
    "PROTOCOL",
    "UNREACHABLE_KEY",
    "heartbeat_interval",
    "hold_s",
]

PROTOCOL = "ravnest.v1"
"""The protocol a node speaks (JoinRequest.protocol, mDNS TXT records, Node.Status)."""

UNREACHABLE_KEY = "ravnest-unreachable"
"""Trailing metadata of a Join refused because the coordinator cannot reach the node at its
address: the node may then go through a relay (SwarmView.relays) and join again."""

DEFAULT_LEASE_S = 8.0
"""Seconds a member stays a member without a heartbeat, unless the coordinator says otherwise
(JoinReply.lease_s)."""

LOST_AFTER_LEASES = 2
"""A member silent for this many leases is lost (one late heartbeat is not); a worker whose
heartbeats have failed as long counts its coordinator lost."""

MAX_EPOCH_AHEAD = 16
"""How far past the newest plan epoch a peer knows a call's epoch may be before it is refused
at once (a hostile caller must not hold a handler waiting for a plan that never comes)."""

MAX_OFFERS = 64
"""Checkpoint offers one node sends (Capabilities.checkpoints, HeartbeatRequest.checkpoints)."""

MAX_PEER_LINKS = 16
"""A node measures its links to at most this many earlier members (about 4 MiB each)."""


def heartbeat_interval(lease_s: float) -> float:
    """How often a member sends a heartbeat for a lease of `lease_s`: two lost ones are
    forgiven."""
    return lease_s / 3


def hold_s(lease_s: float) -> float:
    """The hold window for a lease of `lease_s`: the one number both ends of a membership go
    by. The coordinator counts a stage owner silent this long as lost; a worker whose
    heartbeats have failed this long knows it is being counted lost (and counts its
    coordinator lost). An outage shorter than this costs no member."""
    return LOST_AFTER_LEASES * lease_s


BANNED = "banned from this swarm"
"""How a coordinator's refusal of a banned member begins (coordinator/bans.py): a node told so
stops (CoordinatorClient: RunFailed)."""
