"""Membership leases: pure rules, the coordinator's use of them, and real processes that die
or leave before the plan."""

from __future__ import annotations

import json
import math
import signal
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest

from ravnest_node.coordination.coordinator.membership import Leases
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import PROTOCOL, heartbeat_interval

from .conftest import NODE_ENV, Procs, poll_until, progress_events, ravnest, swarm_view
from .fakes import Aborted, Clock, FakeContext, unproven


def test_a_lease_runs_from_the_last_heartbeat() -> None:
    leases = Leases(lease_s=6.0).renew("a", 100.0).renew("b", 100.0)
    assert heartbeat_interval(6.0) == 2.0
    assert leases.gone(["a", "b"], 106.0) == []  # exactly the lease: still a member
    assert leases.gone(["a", "b"], 106.5) == ["a", "b"]
    # b's heartbeats every interval (a gap of more than two, with nobody else heard, would
    # be the coordinator's own deafness: Leases.deaf).
    renewed = leases.renew("b", 103.0).renew("b", 105.0)
    assert renewed.gone(["a", "b"], 107.0) == ["a"] and renewed.silent_s("b", 107.0) == 2.0
    assert renewed.leave("b").gone(["a", "b"], 101.0) == ["b"]  # leaving needs no waiting
    assert renewed.leave("b").renew("b", 102.0).gone(["b"], 103.0) == []  # back again
    assert math.isinf(leases.silent_s("never", 0.0)) and leases.expired("never", 0.0)
    assert leases.forget(["a"]).heard.keys() == {"b"}


def _caps() -> pb.Capabilities:
    return pb.Capabilities(block_s=[0.01] * 8, memory_bytes=2**34)


def _service(clock: Clock) -> CoordinatorService:
    """A two-node swarm with 3 s leases."""
    return CoordinatorService(
        prove=unproven,
        train=TrainConfig(model="bench-small"), swarm_size=2, swarm_id="s/bench-small",
        summary_path=None, clock=clock, lease_s=3.0,
    )  # fmt: skip


async def _join(svc: CoordinatorService, node: str) -> pb.JoinReply:
    request = pb.JoinRequest(node_id=node, address=f"{node}:1", protocol=PROTOCOL)
    reply: pb.JoinReply = await svc.Join(request, FakeContext())  # type: ignore[arg-type]
    return reply


async def test_before_the_plan_a_silent_or_departed_member_loses_its_place() -> None:
    clock = Clock()
    svc = _service(clock)
    ctx: Any = FakeContext()
    assert (await _join(svc, "a")).lease_s == 3.0
    await _join(svc, "b")
    with pytest.raises(Aborted) as info:
        await _join(svc, "c")  # full, and everyone is alive
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    clock.now += 2.5
    await svc.Heartbeat(pb.HeartbeatRequest(node_id="a"), ctx)
    clock.now += 2.5  # b silent for 5 s > 3 s; a for 2.5 s
    view = await svc.Swarm(pb.SwarmRequest(), ctx)
    assert [(m.node_id, m.lease_expired) for m in view.members] == [("a", False), ("b", True)]
    assert (await _join(svc, "c")).member_index == 1  # c takes b's place
    with pytest.raises(Aborted) as info:
        await svc.Heartbeat(pb.HeartbeatRequest(node_id="b"), ctx)
    assert info.value.code == grpc.StatusCode.NOT_FOUND
    await svc.Leave(pb.LeaveRequest(node_id="c"), ctx)  # c leaves: at once
    view = await svc.Swarm(pb.SwarmRequest(), ctx)
    assert [m.node_id for m in view.members] == ["a"]


async def test_after_the_plan_members_stay_and_their_state_is_reported() -> None:
    clock = Clock()
    svc = _service(clock)
    ctx: Any = FakeContext()
    for node in "ab":
        request = pb.JoinRequest(
            node_id=node, address=f"{node}:1", protocol=PROTOCOL, capabilities=_caps()
        )
        await svc.Join(request, ctx)
    assert svc.plan is not None
    await svc.Leave(pb.LeaveRequest(node_id="b"), ctx)
    clock.now += 10
    view = await svc.Swarm(pb.SwarmRequest(), ctx)
    assert [(m.node_id, m.lease_expired, m.left) for m in view.members] == [
        ("a", True, False),
        ("b", True, True),
    ]
    assert [s.node_id for s in view.plan.stages] == ["a", "b"]  # re-planning is not built yet


# ----- real node processes ------------------------------------------------------------------------
def test_a_worker_that_dies_or_stops_before_the_plan_frees_its_place(
    procs: Procs, tmp_path: Path
) -> None:
    coord, ready = procs.start_node(
        tmp_path / "n0", "--swarm-size", "3", "--model", "tiny", "--steps", "2", "--lease-s", "1.5"
    )
    join = ("--join", ready["address"])

    def members() -> list[pb.SwarmMember]:
        return list(swarm_view(ready["address"]).members)

    # One worker at a time, so the swarm of 3 never fills (and plans) before the last two.
    stopped, first = procs.start_node(tmp_path / "n1", *join)
    # It has joined and sent what it measured: it is past its first join for sure.
    poll_until(lambda: any(m.node_id == first["node_id"] and m.compute_s for m in members()), 30)
    stopped.send_signal(signal.SIGTERM)  # a graceful stop leaves at once
    assert stopped.wait(10) == 0
    assert [m.node_id for m in members()] == [ready["node_id"]]
    killed, second = procs.start_node(tmp_path / "n2", *join)
    poll_until(lambda: second["node_id"] in [m.node_id for m in members()], 30)
    killed.send_signal(signal.SIGKILL)  # a crash: dropped once its lease runs out
    killed.wait(10)
    poll_until(
        lambda: any(m.node_id == second["node_id"] and m.lease_expired for m in members()), 30
    )
    _, third = procs.start_node(tmp_path / "n3", *join)
    _, fourth = procs.start_node(tmp_path / "n4", *join)
    done = [e for e in progress_events(ready["address"]) if e.done]
    assert len(done) == 1 and not done[0].error
    summary = json.loads(done[0].summary_json)
    assert {s["node_id"] for s in summary["stages"]} == {
        ready["node_id"],
        third["node_id"],
        fourth["node_id"],
    }
    shown = subprocess.run(
        ravnest("status", "--swarm", "default", "--peer", ready["address"],
                "--mdns-interface", "127.0.0.1", "--json"),
        env=NODE_ENV, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        check=True,
    ).stdout  # fmt: skip
    members = json.loads(shown)["members"]
    assert len(members) == 3 and not any(m["lease_expired"] or m["left"] for m in members)
    coord.send_signal(signal.SIGTERM)
    assert coord.wait(10) == 0
