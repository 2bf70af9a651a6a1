"""The coordinator's roster: its members, their leases, what they measured, who is lost, and
who is measuring its links. Pure: the clock is injected, nothing here awaits or talks to the
network (service.py does)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import grpc

from ravnest_node.coordination.coordinator.membership import Leases, RoundTrips
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.probe import MIN_PROBE_COST, PROBE_BUDGET_BYTES, ProbeTurns

__all__ = ["MAX_MEMBERS", "MEASURING_S", "Roster"]

log = logging.getLogger(__name__)

MAX_MEMBERS = 1024
"""Members a swarm may grow to after its first plan (before it, exactly --swarm-size)."""
MEASURING_S = 300.0
"""A member counts as measuring its links (and may probe under epoch 0) for at most this long
after its first Join."""


class Roster:
    """Who the members are, in join order (a member's index is its place), and what the
    coordinator knows of each. `clock` is the coordinator's (seconds, monotonic)."""

    def __init__(
        self,
        *,
        lease_s: float,
        clock: Callable[[], float],
        node_id: str = "",
        relay_address: str = "",
    ) -> None:
        self.members: list[Member] = []
        self._places: dict[str, int] = {}
        """node id -> its index in `members`, as last seen (`index` checks it)."""
        self.capabilities: dict[str, pb.Capabilities] = {}
        """Node id -> what it measured (its last Join with capabilities)."""
        self.leases = Leases(lease_s, own_id=node_id)
        self.rtts = RoundTrips()
        self.lost: dict[str, float] = {}
        """Members counted lost, and when: in no plan until they join again (a restart), or
        send a heartbeat more than a lease after (they were alive after all)."""
        self.node_id = node_id
        """This coordinator's own node: alive while it answers, never probed."""
        self.broken: dict[int, dict[int, set[str]]] = {}
        """Plan epoch -> pipeline -> its members not heard from since a stream of that
        pipeline broke with nobody found gone (`note_broken`)."""
        self.relay_address = relay_address
        """The relay this coordinator's node serves ("" if none), first of its relay offers."""
        self._clock = clock
        self._measuring: dict[str, float] = {}
        """Members measuring themselves and their links (joined once, no capabilities yet):
        when that began. Only they may send link probes under epoch 0."""
        self._probe_turns = ProbeTurns(clock=clock)
        self._probe_bytes: dict[str, int] = {}
        """Link-probe bytes each member has sent this coordinator (admit_probe)."""

    # ----- who is a member --------------------------------------------------------------------
    def index(self, node_id: str) -> int | None:
        """`node_id`'s place in the roster (None: not a member)."""
        # (Every member's call asks this: a dict of where each member was, checked against the
        # list before it is believed, and made again when it is wrong.)
        members = self.members
        i = self._places.get(node_id)
        if i is not None and i < len(members) and members[i].node_id == node_id:
            return i
        self._places = {m.node_id: i for i, m in reversed(list(enumerate(members)))}
        return self._places.get(node_id)

    def is_member(self, node_id: str) -> bool:
        return self.index(node_id) is not None

    def known_at(self, node_id: str, address: str) -> bool:
        """`node_id` is a member at `address` (a member asking again was checked then)."""
        return any(m.node_id == node_id and m.address == address for m in self.members)

    def add(self, member: Member, now: float) -> int:
        """A newcomer, its lease starting `now`: its index."""
        self.members.append(member)
        self.renew(member.node_id, now)
        return len(self.members) - 1

    def move(self, index: int, address: str) -> None:
        """Member `index` is back at another `address`: what others measured to it is stale."""
        node_id = self.members[index].node_id
        self.members[index] = Member(node_id, address)
        self._forget_links_to(node_id)

    def resume(
        self, members: list[Member], capabilities: dict[str, pb.Capabilities], now: float
    ) -> None:
        """The members a store held: every one gets a full lease from `now` to reattach."""
        self.members, self.capabilities = members, capabilities
        for m in members:
            self.renew(m.node_id, now)

    def evict_gone(self, now: float) -> bool:
        """Before the plan: free the places of members that left or whose lease ran out.
        True if any did (the caller stores the members)."""
        gone = self.leases.gone([m.node_id for m in self.members], now)
        if not gone:
            return False
        for node_id in gone:
            why = "left" if node_id in self.leases.left else "its lease ran out"
            log.info("node %s is no longer a member: %s", node_id, why)
            self.capabilities.pop(node_id, None)
            self._measuring.pop(node_id, None)
            self._probe_bytes.pop(node_id, None)
        self.members = [m for m in self.members if m.node_id not in gone]
        self.leases = self.leases.forget(gone)
        return True

    def _forget_links_to(self, node_id: str) -> None:
        """`node_id` is back at another address: what others measured to it is stale (the
        planner goes by uplinks for those pairs)."""
        for caps in self.capabilities.values():
            kept = [p for p in caps.peer_links if p.node_id != node_id]
            if len(kept) != len(caps.peer_links):
                del caps.peer_links[:]
                caps.peer_links.extend(kept)

    # ----- leases and losses ------------------------------------------------------------------
    def renew(self, node_id: str, now: float) -> None:
        """Heard from `node_id` at `now` (a join); it is back if it had left."""
        self.leases = self.leases.renew(node_id, now)

    def heard(self, node_id: str, rtt_s: float, now: float) -> None:
        """A heartbeat from `node_id` that measured `rtt_s` to this coordinator. A leaving
        node stays left."""
        if node_id not in self.leases.left:
            self.renew(node_id, now)
        self.rtts.add(node_id, rtt_s)
        for waiting in self.broken.values():
            for unheard in waiting.values():
                unheard.discard(node_id)

    def deaf(self, now: float) -> bool:
        """This coordinator hears none of its other members now (`Leases.deaf`)."""
        return self.leases.deaf(now)

    def note_broken(self, epoch: int, pipeline: int, members: Iterable[str]) -> None:
        """A stream of `pipeline` under plan `epoch` broke, and the probes found nobody gone
        (they answered, or were silent): once all of `members` are heard from after now, the
        pipeline is known to be whole but its plan broken (`whole_but_broken`)."""
        self.broken = {e: w for e, w in self.broken.items() if e >= epoch}  # older plans: done
        unheard = self.broken.setdefault(epoch, {}).setdefault(pipeline, set())
        unheard.update(members)

    def whole_but_broken(self, epoch: int) -> set[int]:
        """The pipelines of plan `epoch` whose stream broke and whose members have all been
        heard from since (`note_broken`): their plan cannot go on, though nobody is gone.
        Each is told once."""
        waiting = self.broken.get(epoch, {})
        whole = {p for p, unheard in waiting.items() if not unheard}
        for p in whole:
            del waiting[p]
        return whole

    def leave(self, node_id: str) -> None:
        self.leases = self.leases.leave(node_id)

    def gone(self, node_id: str, now: float) -> bool:
        """Counted lost, or its lease has run out."""
        return node_id in self.lost or self.leases.expired(node_id, now)

    def silent_longer(self, node_id: str, leases: float, now: float) -> bool:
        """Not heard from for more than `leases` leases."""
        return self.leases.silent_s(node_id, now) > leases * self.leases.lease_s

    def mark_lost(self, node_ids: Iterable[str], now: float) -> None:
        self.lost.update((n, now) for n in node_ids)

    def back(self, node_id: str) -> bool:
        """`node_id` joined again: a newcomer, no longer lost. True if it was lost."""
        return self.lost.pop(node_id, None) is not None

    def alive_again(self, node_id: str, now: float) -> bool:
        """Heard from more than a lease after it was counted lost: alive after all (a stall, a
        cut link), no longer lost. True if so."""
        lost_at = self.lost.get(node_id)
        if lost_at is None or now - lost_at <= self.leases.lease_s:
            return False
        del self.lost[node_id]
        return True

    def staying(self, in_plan: set[str], now: float) -> list[Member]:
        """Members that have said what they measured, are alive (not lost, lease running) and
        stay (not leaving): those in `in_plan` first, then the others, each in join order."""
        staying = [
            m for m in self.members
            if m.node_id in self.capabilities and m.node_id not in self.lost
            and not self.leases.expired(m.node_id, now) and m.node_id not in self.leases.left
        ]  # fmt: skip
        staying.sort(key=lambda m: m.node_id not in in_plan)
        return staying

    def relay_offers(self, now: float) -> list[pb.RelayOffer]:
        """Relays a node behind NAT may use: this coordinator's own, then those members serve
        (Capabilities.relay_address) that are not gone (left, lost, or their lease run out)."""
        offers = []
        if self.relay_address:
            offers.append(pb.RelayOffer(node_id=self.node_id, address=self.relay_address))
        for m in self.members:
            caps = self.capabilities.get(m.node_id)
            if caps is None or not caps.relay_address or m.node_id == self.node_id:
                continue
            if m.node_id in self.lost or m.node_id in self.leases.left:
                continue
            if not self.leases.expired(m.node_id, now):
                offers.append(pb.RelayOffer(node_id=m.node_id, address=caps.relay_address))
        return offers

    # ----- measuring --------------------------------------------------------------------------
    def note_measuring(self, node_id: str, measured: bool) -> None:
        """A member's first Join starts its measuring (a fresh probe budget), unless one began
        less than MEASURING_S ago; the Join with its capabilities (`measured`) ends it."""
        if measured:
            self._measuring.pop(node_id, None)
        elif self.measuring_since(node_id) == 0.0:
            self._measuring[node_id] = self._clock()
            self._probe_bytes.pop(node_id, None)

    def measuring_since(self, node_id: str) -> float:
        """When `node_id`'s measuring began (0: it is not measuring, or for MEASURING_S and
        more: a member that never sends its capabilities does not measure for ever)."""
        since = self._measuring.get(node_id, 0.0)
        return since if since and self._clock() - since < MEASURING_S else 0.0

    def admit_probe(self, node_id: str, nbytes: int, *, done: bool = False) -> None:
        """A member measures its link to this coordinator (link probes under epoch 0): only a
        member that is measuring (between its first Join and its capabilities), within
        PROBE_BUDGET_BYTES each time it measures, one at a time (`done`: the probe that ends
        its measurement passes the turn on); Refusal otherwise."""
        if not self.measuring_since(node_id) or not self.is_member(node_id):
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{node_id[:80]!r} is not a member measuring its links: join first",
            )
        total = self._probe_bytes.get(node_id, 0) + max(nbytes, MIN_PROBE_COST)
        if total > PROBE_BUDGET_BYTES:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{node_id} has sent {PROBE_BUDGET_BYTES} bytes of probes")  # fmt: skip
        self._probe_turns.admit(node_id, done=done)
        self._probe_bytes[node_id] = total
