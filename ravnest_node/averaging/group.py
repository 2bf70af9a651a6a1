"""A member's view of its replica group: who is in it, in which order, and how it exchanges.

Members are ranked by node id (topology.py): every member sorts the same list the same way. A
group runs a ring when it is larger than ALL_TO_ALL_MAX, its delta has at least one element per
member (a chunk each) and its codec may cut the delta (powersgd may not: deltas.py); else it
exchanges whole deltas all-to-all. Members banned for the run (robust.py) stay in the group:
rounds leave them out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ravnest_node.averaging.robust import BanList
from ravnest_node.averaging.topology import Topology, choose_topology, ring_chunks
from ravnest_node.averaging.wire import Replica
from ravnest_node.errors import ConfigError
from ravnest_node.transport.options import split_host_port


def group_members(node_id: str, members: Sequence[Replica]) -> tuple[Replica, ...]:
    """The group `members`, sorted by node id; ConfigError if it lists an id twice or lacks
    `node_id`."""
    ids = [m.node_id for m in members]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"replica group lists a node id twice: {sorted(ids)}")
    if node_id not in ids:
        raise ConfigError(f"node {node_id!r} is not a member of its replica group {ids}")
    return tuple(sorted(members, key=lambda m: m.node_id))


@dataclass(frozen=True, slots=True)
class Group:
    """This member's replica group, as a round needs it (`Group.of` builds one)."""

    node_id: str
    """This member."""
    members: tuple[Replica, ...]
    """Every member, this one included, sorted by node id."""
    rank: int
    """This member's index in `members`."""
    ids: frozenset[str]
    """The members' node ids."""
    hosts: Mapping[str, str]
    """Replica id -> the host of its address (where its pushes should come from)."""
    topology: Topology
    """How the group's rounds move deltas."""
    bounds: tuple[tuple[int, int], ...]
    """[start, stop) of each ring chunk of the delta; empty for all-to-all."""
    bans: BanList
    """The node's record of rejected deltas and banned members (robust.py)."""

    @classmethod
    def of(
        cls,
        node_id: str,
        members: tuple[Replica, ...],
        bans: BanList,
        *,
        numel: int,
        whole_only: bool,
    ) -> Group:
        """The group of the sorted `members` (`group_members`) averaging deltas of `numel`
        elements, which runs a ring if its size asks for one, unless `whole_only`."""
        n = len(members)
        # A ring needs a non-empty chunk per member; tiny stages exchange whole deltas.
        ring_ok = numel >= n and not whole_only
        topology = choose_topology(n) if ring_ok else Topology.ALL_TO_ALL
        return cls(
            node_id=node_id,
            members=members,
            rank=[m.node_id for m in members].index(node_id),
            ids=frozenset(m.node_id for m in members),
            hosts={m.node_id: split_host_port(m.address)[0] for m in members},
            topology=topology,
            bounds=tuple(ring_chunks(numel, n)) if topology is Topology.RING else (),
            bans=bans,
        )

    @property
    def others(self) -> tuple[Replica, ...]:
        """The other members, less those banned for the run."""
        return tuple(m for m in self.members if m.node_id != self.node_id and not self._out(m))

    @property
    def banned(self) -> tuple[str, ...]:
        """Members of this group banned for the run, sorted."""
        return tuple(m.node_id for m in self.members if m.node_id != self.node_id and self._out(m))

    @property
    def predecessor(self) -> str:
        """The member before this one in the ring (ring parts come from it)."""
        return self.members[(self.rank - 1) % len(self.members)].node_id

    @property
    def successor(self) -> Replica:
        """The member after this one in the ring (this member pushes its parts to it)."""
        return self.members[(self.rank + 1) % len(self.members)]

    def _out(self, member: Replica) -> bool:
        return member.node_id in self.bans.banned
