"""Probes under epoch 0 (daemon/worker/sessions.py `MemberProbes`): only a member measuring its
links, as the coordinator lists them, may probe this node, within its byte budget; the probes that
arrive together share one question to the coordinator, and a coordinator that cannot answer
refuses them as unavailable. Tested with a fake coordinator, without sockets."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ravnest_node.daemon.worker.sessions import MemberProbes
from ravnest_node.errors import PeerUnavailable
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.probe import PROBE_BUDGET_BYTES

MEASURING = "a" * 16
WAITING = "b" * 16


class FakeCoordinator:
    """Lists MEASURING as measuring its links; counts the questions; may fail them."""

    def __init__(self, address: str = "c:1") -> None:
        self.address = address
        self.latest_plan: pb.Plan | None = None
        self.asked = 0
        self.asking = asyncio.Event()
        self.fails = False
        self.answer = asyncio.Event()
        self.answer.set()

    async def swarm(self) -> pb.SwarmView:
        self.asked += 1
        self.asking.set()
        await self.answer.wait()
        if self.fails:
            raise PeerUnavailable("coordinator c:1: UNAVAILABLE: gone")
        return pb.SwarmView(
            members=[
                pb.SwarmMember(node_id=MEASURING, measuring_since=5.0),
                pb.SwarmMember(node_id=WAITING),
            ]
        )


async def refused(probes: MemberProbes, peer: str, nbytes: int = 0) -> grpc.StatusCode:
    with pytest.raises(Refusal) as refusal:
        await probes.admit(peer, nbytes)
    return refusal.value.code


async def test_only_a_member_measuring_its_links_may_probe_within_its_budget() -> None:
    coordinator = FakeCoordinator()
    probes = MemberProbes(coordinator)
    await probes.admit(MEASURING, PROBE_BUDGET_BYTES // 2)
    await probes.admit(MEASURING, PROBE_BUDGET_BYTES // 2)
    assert await refused(probes, MEASURING, 1) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await refused(probes, WAITING) == grpc.StatusCode.PERMISSION_DENIED
    assert await refused(probes, "not an id!") == grpc.StatusCode.PERMISSION_DENIED


async def test_probes_that_arrive_together_share_the_questions() -> None:
    """Each probe waits for an answer asked after it came: the first asks, and every probe
    that came while it waited shares one more question."""
    coordinator = FakeCoordinator()
    coordinator.answer.clear()
    probes = MemberProbes(coordinator)
    checks = [asyncio.create_task(probes.admit(MEASURING, 0)) for _ in range(5)]
    async with asyncio.timeout(10):
        await coordinator.asking.wait()
        coordinator.answer.set()
        await asyncio.gather(*checks)
    assert 1 <= coordinator.asked <= 2
    asked = coordinator.asked
    await probes.admit(MEASURING, 0)  # the answer is kept for a while
    assert coordinator.asked == asked


async def test_probes_are_refused_as_unavailable_when_the_coordinator_cannot_say() -> None:
    coordinator = FakeCoordinator()
    coordinator.fails = True
    probes = MemberProbes(coordinator)
    assert await refused(probes, MEASURING) == grpc.StatusCode.UNAVAILABLE
    coordinator.fails = False  # asked again (after the rate limit), and it answers
    await probes.admit(MEASURING, 0)
    assert coordinator.asked == 2
    assert await refused(MemberProbes(FakeCoordinator(address="")), MEASURING) == (
        grpc.StatusCode.UNAVAILABLE
    )
