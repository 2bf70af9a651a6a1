"""The coordinator's roster, on its own: members, leases, who is lost, who is measuring."""

from __future__ import annotations

import grpc
import pytest

from ravnest_node.coordination.coordinator.roster import MEASURING_S, Roster
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.probe import PROBE_BUDGET_BYTES

from .fakes import Clock


def _roster(clock: Clock, nodes: str = "abc", **kw: str) -> Roster:
    """A roster of one member per letter of `nodes` (address `x:1`), all measured, 6 s leases."""
    roster = Roster(lease_s=6.0, clock=clock, **kw)
    for node in nodes:
        roster.add(Member(node, f"{node}:1"), clock.now)
        roster.capabilities[node] = pb.Capabilities(block_s=[0.01])
    return roster


def test_members_keep_their_join_order_and_a_move_forgets_links_to_the_mover() -> None:
    clock = Clock()
    roster = _roster(clock)
    assert [roster.index(n) for n in "abcz"] == [0, 1, 2, None]
    assert roster.is_member("b") and not roster.is_member("z")
    assert roster.known_at("b", "b:1") and not roster.known_at("b", "b:2")
    roster.capabilities["a"].peer_links.extend(
        [pb.PeerLink(node_id="b", to_bps=1e6), pb.PeerLink(node_id="c", to_bps=1e6)]
    )
    roster.move(1, "b:2")
    assert roster.members[1] == Member("b", "b:2")
    assert [p.node_id for p in roster.capabilities["a"].peer_links] == ["c"]


def test_before_the_plan_members_gone_are_evicted_with_what_they_measured() -> None:
    clock = Clock()
    roster = _roster(clock)
    assert not roster.evict_gone(clock.now)
    for _ in range(2):  # a's heartbeats (a longer gap would be the coordinator's deafness)
        clock.now += 2.5
        roster.renew("a", clock.now)
    roster.leave("c")
    clock.now += 2.0  # b silent for 7 s > 6 s; a for 2 s; c left
    assert roster.evict_gone(clock.now)
    assert [m.node_id for m in roster.members] == ["a"]
    assert set(roster.capabilities) == {"a"}
    assert set(roster.leases.heard) == {"a"} and not roster.leases.left


def test_lost_members_come_back_by_joining_or_by_a_late_heartbeat() -> None:
    clock = Clock()
    roster = _roster(clock)
    assert not roster.gone("a", clock.now)
    roster.mark_lost(["a", "b"], clock.now)
    assert roster.gone("a", clock.now) and set(roster.lost) == {"a", "b"}
    assert roster.back("a") and not roster.back("a")  # joined again: a newcomer
    clock.now += 6.0
    assert not roster.alive_again("b", clock.now)  # within a lease of being counted lost
    clock.now += 0.5
    roster.heard("b", 0.01, clock.now)
    assert roster.alive_again("b", clock.now) and roster.lost == {}
    assert roster.leases.silent_s("b", clock.now) == 0 and roster.rtts.rtt_s["b"] == 0.01


def test_a_leaving_member_stays_left_through_its_heartbeats() -> None:
    clock = Clock()
    roster = _roster(clock)
    roster.leave("a")
    clock.now += 1.0
    roster.heard("a", 0.0, clock.now)
    assert "a" in roster.leases.left and roster.leases.silent_s("a", clock.now) == 1.0
    assert roster.silent_longer("a", 1 / 12, clock.now)  # 1 s > 0.5 s
    assert not roster.silent_longer("b", 1.0, clock.now)


def test_who_stays_for_the_next_plan() -> None:
    """Measured, alive and staying members, the current plan's first, then newcomers, each in
    join order."""
    clock = Clock()
    roster = _roster(clock, "abcdef")
    del roster.capabilities["b"]  # still measuring
    roster.mark_lost(["c"], clock.now)
    for step_s in (2.0, 2.0, 2.0, 1.0):  # heartbeats every interval; e's lease runs out
        clock.now += step_s
        for node in "acdf":
            roster.renew(node, clock.now)
    roster.leave("d")
    assert [m.node_id for m in roster.staying({"f"}, clock.now)] == ["f", "a"]


def test_relays_offered_are_the_coordinators_then_members_not_gone() -> None:
    clock = Clock()
    roster = _roster(clock, "abcd", node_id="a", relay_address="10.0.0.1:7071")
    for node in "abcd":
        roster.capabilities[node].relay_address = f"{node}.relay:7071"
    roster.leave("c")
    roster.mark_lost(["d"], clock.now)
    offers = roster.relay_offers(clock.now)
    assert [(o.node_id, o.address) for o in offers] == [("a", "10.0.0.1:7071"),
                                                        ("b", "b.relay:7071")]  # fmt: skip
    assert roster.relay_offers(clock.now + 7.0)[1:] == []  # b's lease ran out


def test_only_a_measuring_member_probes_within_its_budget() -> None:
    clock = Clock()
    roster = _roster(clock, "ab")
    with pytest.raises(Refusal) as info:
        roster.admit_probe("a", 1)  # joined, not measuring
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    roster.note_measuring("a", measured=False)
    assert roster.measuring_since("a") == clock.now
    roster.admit_probe("a", PROBE_BUDGET_BYTES)
    clock.now += 1.0
    roster.note_measuring("a", measured=False)  # again while measuring: the same budget
    assert roster.measuring_since("a") == clock.now - 1.0
    with pytest.raises(Refusal) as info:
        roster.admit_probe("a", 1)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    roster.note_measuring("a", measured=True)
    assert roster.measuring_since("a") == 0.0
    roster.note_measuring("a", measured=False)  # measuring again: a fresh budget
    roster.admit_probe("a", 1)
    clock.now += MEASURING_S
    assert roster.measuring_since("a") == 0.0  # not for ever
