"""Membership leases: who is still a member, decided from (state, now). Pure.

A member's lease starts when it joins and is renewed by every heartbeat; it runs `lease_s`
seconds (members send a heartbeat every third of that, so two lost heartbeats are forgiven).
Before the plan exists a member whose lease ran out, or that left, loses its place, so that a
node that joined and died does not hold the swarm back; after the plan it stays in the plan and
is only reported (re-planning is the next piece of the discovery issue).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["DEFAULT_LEASE_S", "Leases", "heartbeat_interval"]

DEFAULT_LEASE_S = 6.0


def heartbeat_interval(lease_s: float) -> float:
    """How often a member sends a heartbeat for a lease of `lease_s`."""
    return lease_s / 3


@dataclass(frozen=True)
class Leases:
    """When the coordinator last heard from each member, and who left."""

    lease_s: float = DEFAULT_LEASE_S
    heard: Mapping[str, float] = field(default_factory=dict)
    left: frozenset[str] = frozenset()

    def renew(self, node_id: str, now: float) -> Leases:
        """`node_id` was heard from at `now` (a join or a heartbeat); it is back if it had left."""
        return Leases(self.lease_s, {**self.heard, node_id: now}, self.left - {node_id})

    def leave(self, node_id: str) -> Leases:
        return Leases(self.lease_s, self.heard, self.left | {node_id})

    def forget(self, node_ids: Iterable[str]) -> Leases:
        gone = set(node_ids)
        heard = {k: v for k, v in self.heard.items() if k not in gone}
        return Leases(self.lease_s, heard, self.left - gone)

    def silent_s(self, node_id: str, now: float) -> float:
        """Seconds since `node_id` was last heard from (inf if never)."""
        heard = self.heard.get(node_id)
        return now - heard if heard is not None else float("inf")

    def expired(self, node_id: str, now: float) -> bool:
        """Its lease has run out: not heard from for more than `lease_s`."""
        return self.silent_s(node_id, now) > self.lease_s

    def gone(self, node_ids: Iterable[str], now: float) -> list[str]:
        """Of `node_ids`, in order, those that left or whose lease has run out."""
        return [n for n in node_ids if n in self.left or self.expired(n, now)]
