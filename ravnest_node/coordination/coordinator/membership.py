"""Membership leases: who is still a member, decided from (state, now). Pure.

A member's lease starts when it joins and is renewed by every heartbeat; it runs `lease_s`
seconds (members send a heartbeat every third of that, so two lost heartbeats are forgiven).
Before the plan exists a member whose lease ran out, or that left, loses its place, so that a
node that joined and died does not hold the swarm back; after the plan it stays in the plan and
is only reported (re-planning is the next piece of the discovery issue).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ravnest_node.protocol import DEFAULT_LEASE_S, heartbeat_interval

__all__ = ["DEAF_AFTER_INTERVALS", "Leases", "ProbeAnswer", "RoundTrips"]

DEAF_AFTER_INTERVALS = 2
"""The coordinator is deaf (its own link is down, not its members') once it has heard no
member but its own node for more than this many heartbeat intervals, while two or more
others are members: they cannot all have gone quiet at once for reasons of their own."""


class ProbeAnswer(enum.Enum):
    """What a direct probe of a member (`daemon.services.probe_node`) found."""

    ALIVE = "alive"
    """It answered, as itself."""
    REFUSED = "refused"
    """Its address refused the connection (nobody listens: the process is gone), or another
    node answers there: it is not there, a verdict at once."""
    SILENT = "silent"
    """Nothing answered in time: a machine off, or a link cut, the prober's own included. No
    verdict: its silence is counted like any other (`hold_s`)."""


PROBE_MIN_S = 2.0
"""A probe of a suspected member waits at least this long for its answer (a busy machine's
event loop may take that long to answer; a killed process refuses the connection at once)."""
PROBE_RTTS = 10
"""... and at least this many of its measured round trips (a slow or far link)."""
RTT_WEIGHT = 0.2
"""Weight of a new sample in a member's round-trip average (exponential)."""


@dataclass
class RoundTrips:
    """Each member's round trip to the coordinator, an exponential average of what its
    heartbeats measured; what a probe's deadline is made of."""

    rtt_s: dict[str, float] = field(default_factory=dict)

    def add(self, node_id: str, sample_s: float) -> None:
        """One measured round trip (ignored unless finite and in (0, 60] s)."""
        if not 0 < sample_s <= 60:  # also false for NaN
            return
        old = self.rtt_s.get(node_id)
        self.rtt_s[node_id] = sample_s if old is None else old + RTT_WEIGHT * (sample_s - old)

    def probe_timeout(self, node_id: str, ceiling_s: float) -> float:
        """How long a direct probe of `node_id` may take: PROBE_RTTS of its round trips, at
        least PROBE_MIN_S, at most `ceiling_s` (also before anything is measured)."""
        rtt = self.rtt_s.get(node_id)
        if rtt is None:
            return ceiling_s
        return min(ceiling_s, max(PROBE_MIN_S, PROBE_RTTS * rtt))


@dataclass(frozen=True)
class Leases:
    """When the coordinator last heard from each member, and who left.

    A deaf coordinator blames nobody: `own_id` (the coordinator's own node) is heard over a
    local address whatever the network does, so silence counts only while some other member
    is heard (`deaf`); and when another member is heard after a gap in which no other one
    was, every member's silence is shortened by that gap (less one heartbeat interval): the
    gap was the coordinator's own outage, not theirs."""

    lease_s: float = DEFAULT_LEASE_S
    heard: Mapping[str, float] = field(default_factory=dict)
    left: frozenset[str] = frozenset()
    own_id: str = ""
    last_other: float | None = None
    """When a member other than `own_id` was last heard (None: never)."""

    def renew(self, node_id: str, now: float) -> Leases:
        """`node_id` was heard from at `now` (a join or a heartbeat); it is back if it had left.
        The first other member heard after the coordinator was deaf shifts everyone's last
        heard time by the gap, less one interval (never past `now`)."""
        heard = dict(self.heard)
        last_other = self.last_other
        if node_id != self.own_id:
            interval = heartbeat_interval(self.lease_s)
            if last_other is not None and now - last_other > DEAF_AFTER_INTERVALS * interval:
                shift = now - last_other - interval
                heard = {k: min(v + shift, now) for k, v in heard.items()}
            last_other = max(now, last_other or now)
        heard[node_id] = now
        return Leases(self.lease_s, heard, self.left - {node_id}, self.own_id, last_other)

    def leave(self, node_id: str) -> Leases:
        return Leases(self.lease_s, self.heard, self.left | {node_id}, self.own_id,
                      self.last_other)  # fmt: skip

    def forget(self, node_ids: Iterable[str]) -> Leases:
        gone = set(node_ids)
        heard = {k: v for k, v in self.heard.items() if k not in gone}
        return Leases(self.lease_s, heard, self.left - gone, self.own_id, self.last_other)

    def deaf(self, now: float) -> bool:
        """The coordinator hears no other member now, while two or more others are members:
        its own link is down, and silence proves nothing of theirs. (With one other member
        its silence and a deaf coordinator look alike: silence counts, as it always did.)"""
        if self.last_other is None:
            return False
        others = 0
        for k in self.heard:  # (two are enough to know: a heartbeat asks, of a 1,000)
            if k != self.own_id and k not in self.left:
                others += 1
                if others == 2:
                    break
        if others < 2:
            return False
        return now - self.last_other > DEAF_AFTER_INTERVALS * heartbeat_interval(self.lease_s)

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
