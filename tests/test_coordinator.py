"""The coordinator's decisions, driven directly (no sockets): membership, the plan, progress."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from ravnest_node.coordination.coordinator.membership import ProbeAnswer
from ravnest_node.coordination.coordinator.roster import MEASURING_S
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.coordination.planning.static_plan import (
    Member,
    check_plan,
    replica_group,
    stage_at,
    static_plan,
)
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig, check_swarm_shape
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import PROTOCOL, UNREACHABLE_KEY
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.probe import PROBE_BUDGET_BYTES

from .fakes import Aborted, Clock, FakeContext, capabilities, join, unproven


def _service(tmp_path: Path, clock: Clock, size: int = 3, steps: int = 2) -> CoordinatorService:
    return CoordinatorService(
        prove=unproven,
        train=TrainConfig(model="bench-small", steps=steps, batch_size=16),
        swarm_size=size,
        swarm_id="test/bench-small",
        summary_path=tmp_path / "summary.json",
        clock=clock,
    )


async def test_plan_waits_for_the_swarm_and_balances_blocks(tmp_path: Path) -> None:
    svc = _service(tmp_path, Clock())
    assert (await join(svc, "a")).member_index == 0
    assert (await join(svc, "a")).member_index == 0  # joining again is harmless
    await join(svc, "b")
    assert svc.plan is None
    await join(svc, "c")
    plan = svc.plan
    assert plan is not None and plan.epoch == 1
    assert [(s.first_block, s.stop_block, s.node_id) for s in plan.stages] == [
        (0, 3, "a"),
        (3, 5, "b"),
        (5, 8, "c"),
    ]
    assert plan.run.model == "bench-small" and plan.run.steps == 2
    assert not plan.run.HasField("fault_skip_step_stage")


async def test_the_plan_waits_for_every_members_measurements(tmp_path: Path) -> None:
    svc = _service(tmp_path, Clock(), size=2)
    ctx: Any = FakeContext()
    reply = await svc.Join(pb.JoinRequest(node_id="a", address="a:1", protocol=PROTOCOL), ctx)
    assert (reply.model, reply.microbatch) == ("bench-small", 4)  # what to measure
    await join(svc, "b")
    assert svc.plan is None  # a has not said what it measured
    await join(svc, "a")
    assert svc.plan is not None


async def test_a_faster_machine_gets_more_blocks(tmp_path: Path) -> None:
    svc = _service(tmp_path, Clock())
    await join(svc, "a", "10.0.0.1:1")
    await join(svc, "b", "10.0.0.2:1", caps=capabilities(total_s=0.04))  # twice as fast
    await join(svc, "c", "10.0.0.3:1")
    plan = svc.plan
    assert plan is not None
    blocks = {s.node_id: s.stop_block - s.first_block for s in plan.stages}
    assert blocks["b"] > max(blocks["a"], blocks["c"])
    # The same measurements from one machine are one machine's: its best total for all.
    same = _service(tmp_path, Clock())
    for node, total in (("a", 0.08), ("b", 0.04), ("c", 0.08)):
        await join(same, node, f"10.0.0.9:{ord(node)}", caps=capabilities(total_s=total))
    assert same.plan is not None
    assert [(s.first_block, s.stop_block) for s in same.plan.stages] == [(0, 3), (3, 5), (5, 8)]


@pytest.mark.parametrize(
    "caps",
    [
        pb.Capabilities(block_s=[0.01] * 7),  # one time short
        pb.Capabilities(block_s=[0.01] * 7 + [float("nan")]),
        pb.Capabilities(block_s=[0.01] * 7 + [0.0]),
        pb.Capabilities(block_s=[0.01] * 100_000),
    ],
    ids=["short", "nan", "zero", "huge"],
)
async def test_malformed_capabilities_are_refused(tmp_path: Path, caps: pb.Capabilities) -> None:
    svc = _service(tmp_path, Clock(), size=1)
    request = pb.JoinRequest(node_id="a", address="a:1", protocol=PROTOCOL, capabilities=caps)
    with pytest.raises(Aborted) as info:
        await svc.Join(request, FakeContext())  # type: ignore[arg-type]
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert svc.plan is None


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (pb.JoinRequest(node_id="", address="x:1", protocol=PROTOCOL), "INVALID_ARGUMENT"),
        (pb.JoinRequest(node_id="z" * 200, address="x:1", protocol=PROTOCOL), "INVALID_ARGUMENT"),
        (pb.JoinRequest(node_id="a", address="x:1", protocol="v0"), "FAILED_PRECONDITION"),
    ],
)
async def test_bad_joins_are_refused(tmp_path: Path, request_: pb.JoinRequest, code: str) -> None:
    svc = _service(tmp_path, Clock())
    with pytest.raises(Aborted) as info:
        await svc.Join(request_, FakeContext())  # type: ignore[arg-type]
    assert info.value.code.name == code


async def test_full_swarm_and_address_theft_are_refused(tmp_path: Path) -> None:
    svc = _service(tmp_path, Clock(), size=1)
    ctx: Any = FakeContext()
    # Before its first plan a swarm takes exactly --swarm-size members.
    await svc.Join(pb.JoinRequest(node_id="a", address="a:1", protocol=PROTOCOL), ctx)
    with pytest.raises(Aborted) as info:
        await join(svc, "b")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    await join(svc, "a")
    with pytest.raises(Aborted) as info:
        await join(svc, "a", address="elsewhere:2")
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS


async def test_reports_become_progress_and_a_summary(tmp_path: Path) -> None:
    clock = Clock()
    svc = _service(tmp_path, clock, size=2)
    await join(svc, "a")
    await join(svc, "b")
    ctx: Any = FakeContext()

    def report(node: str, stage: int, step: int, **kw: Any) -> pb.StageReport:
        return pb.StageReport(node_id=node, stage=stage, plan_epoch=1, step=step, **kw)

    with pytest.raises(Aborted) as info:
        await svc.Report(report("b", 0, 1), ctx)  # b does not own stage 0
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    clock.now += 2.0
    await svc.Report(report("a", 0, 1, bytes_sent=100), ctx)
    await svc.Report(report("b", 1, 1, loss=5.0, bytes_sent=50), ctx)
    await svc.Report(report("b", 1, 2, loss=4.0, bytes_sent=80), ctx)
    await svc.Report(
        report("a", 0, 2, done=True, params_sq_sum=9.0, num_params=3, bytes_sent=100), ctx
    )
    await svc.Report(
        report("b", 1, 2, done=True, params_sq_sum=16.0, num_params=4, bytes_sent=80), ctx
    )
    events = []
    async for event in svc.WatchProgress(pb.WatchProgressRequest(), ctx):
        events.append(event)
    assert [e.step for e in events] == [1, 2, 2] and events[-1].done
    summary = json.loads(events[-1].summary_json)
    assert summary["loss_history"] == [5.0, 4.0]
    assert summary["final_params_l2"] == 5.0 and summary["num_params"] == 7
    assert summary["bytes_on_wire"] == 180 and summary["wall_s"] == 2.0
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


async def test_two_pipelines_make_replica_groups_and_mean_losses(tmp_path: Path) -> None:
    svc = CoordinatorService(
        prove=unproven,
        train=TrainConfig(model="bench-small", steps=2, batch_size=16, pipelines=2),
        swarm_size=4,
        swarm_id="test/bench-small",
        summary_path=None,
        clock=Clock(),
    )
    for node in "abcd":
        await join(svc, node)
    plan = svc.plan
    assert plan is not None and plan.run.pipelines == 2
    assert [(s.pipeline, s.index, s.first_block, s.stop_block, s.node_id) for s in plan.stages] == [
        (0, 0, 0, 4, "a"), (0, 1, 4, 8, "b"), (1, 0, 0, 4, "c"), (1, 1, 4, 8, "d"),
    ]  # fmt: skip
    me = check_plan(plan, get_model("bench-small"), "d")
    assert [s.node_id for s in replica_group(plan, me)] == ["b", "d"]
    first = stage_at(plan, 1, 0)
    assert first is not None and first.node_id == "c"
    assert stage_at(plan, 1, 2) is None
    ctx: Any = FakeContext()

    def report(node: str, pipeline: int, stage: int, step: int, **kw: Any) -> pb.StageReport:
        return pb.StageReport(
            node_id=node, pipeline=pipeline, stage=stage, plan_epoch=1, step=step, **kw
        )

    with pytest.raises(Aborted) as info:  # d owns stage 1 of pipeline 1, not of pipeline 0
        await svc.Report(report("d", 0, 1, 1, loss=1.0), ctx)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    await svc.Report(report("b", 0, 1, 1, loss=5.0), ctx)
    await svc.Report(report("b", 0, 1, 2, loss=4.0), ctx)
    await svc.Report(report("d", 1, 1, 1, loss=3.0), ctx)  # step 1 is complete now
    await svc.Report(report("d", 1, 1, 2, loss=2.0), ctx)
    for node, pipeline, stage in (("a", 0, 0), ("b", 0, 1), ("c", 1, 0), ("d", 1, 1)):
        await svc.Report(report(node, pipeline, stage, 2, done=True, num_params=1), ctx)
    events = [e async for e in svc.WatchProgress(pb.WatchProgressRequest(), ctx)]
    assert [(e.step, e.loss, e.samples) for e in events[:2]] == [(1, 4.0, 32), (2, 3.0, 64)]
    summary = json.loads(events[-1].summary_json)
    assert summary["loss_history_per_pipeline"] == [[5.0, 4.0], [3.0, 2.0]]
    assert summary["samples"] == 64 and summary["num_params"] == 2


def test_plans_with_replicas_are_checked() -> None:
    model = get_model("bench-small")
    members = [Member(node_id=n, address=f"{n}:1") for n in "abcd"]
    plan = static_plan(
        epoch=1, swarm_id="s", model=model, members=members, run=pb.RunSpec(pipelines=2)
    )
    assert check_plan(plan, model, "c").pipeline == 1
    bad = pb.Plan()
    bad.CopyFrom(plan)
    bad.stages[3].first_block = 5  # pipeline 1 cut differently from pipeline 0
    with pytest.raises(ConfigError, match="out of order"):
        check_plan(bad, model, "c")
    bad.CopyFrom(plan)
    bad.stages[2].pipeline = 0
    with pytest.raises(ConfigError, match="out of order"):
        check_plan(bad, model, "c")
    with pytest.raises(ConfigError, match="3 nodes cannot form 2 equal pipelines"):
        static_plan(
            epoch=1, swarm_id="s", model=model, members=members[:3], run=pb.RunSpec(pipelines=2)
        )
    with pytest.raises(ConfigError, match="multiple"):
        check_swarm_shape(3, TrainConfig(pipelines=2))
    with pytest.raises(ConfigError, match="stages=4: 6 nodes in 2 pipeline"):
        check_swarm_shape(6, TrainConfig(pipelines=2, stages=4))
    check_swarm_shape(6, TrainConfig(pipelines=2, stages=2))  # one spare per pipeline
    with pytest.raises(ConfigError, match="stages=-1: must be 0"):
        TrainConfig(stages=-1)


async def test_a_node_joining_after_the_plan_gets_a_stage_once_the_plan_drains(
    tmp_path: Path,
) -> None:
    svc = _service(tmp_path, Clock(), size=2, steps=20)
    ctx: Any = FakeContext()
    await join(svc, "a")
    await join(svc, "b")
    first = svc.plan
    assert first is not None and first.epoch == 1 and first.start_step == 0
    plans = svc.WatchPlan(pb.WatchPlanRequest(node_id="a"), ctx)
    assert (await anext(plans)).epoch == 1
    await join(svc, "c")  # after the plan: it waits for the next one
    announced = await anext(plans)
    assert (announced.epoch, announced.pending) == (2, True)
    assert [s.node_id for s in announced.previous] == ["a", "b"]
    assert svc.plan == first  # the current plan runs on until it has drained
    with pytest.raises(Aborted) as info:  # only a pipeline's first stage drains it
        await svc.Drain(pb.DrainRequest(node_id="b", plan_epoch=1, stop_step=5), ctx)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    await svc.Report(pb.StageReport(node_id="b", stage=1, plan_epoch=1, step=1, loss=5.0), ctx)
    reply = await svc.Drain(pb.DrainRequest(node_id="a", plan_epoch=1, stop_step=5), ctx)
    assert reply.stop_step == 5
    started = await anext(plans)
    assert (started.epoch, started.pending, started.start_step) == (2, False, 5)
    assert svc.plan == started and {s.node_id for s in started.stages} == {"a", "b", "c"}
    # The old plan's last stage reports its remaining steps, up to where it ended, no further.
    for step in range(2, 6):
        await svc.Report(
            pb.StageReport(node_id="b", stage=1, plan_epoch=1, step=step, loss=4.0), ctx
        )
    with pytest.raises(Aborted) as info:
        await svc.Report(pb.StageReport(node_id="b", stage=1, plan_epoch=1, step=6, loss=4.0), ctx)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    # A retried drain gets the same answer.
    again = await svc.Drain(pb.DrainRequest(node_id="a", plan_epoch=1, stop_step=5), ctx)
    assert again.stop_step == 5


def _slow_link_to(*peers: str) -> pb.Capabilities:
    """A node whose measured links to `peers` are 2 Mbit/s each way."""
    caps = capabilities()
    caps.peer_links.extend(
        pb.PeerLink(node_id=p, to_bps=2e6, from_bps=2e6, rtt_s=0.01) for p in peers
    )
    return caps


async def test_a_newcomer_on_a_slow_link_stays_spare_without_a_new_plan(tmp_path: Path) -> None:
    """c joins after the plan with 2 Mbit/s links to a and b: a plan with c would be far slower,
    so it stays spare, and no plan is announced for it (not now, nor at every later join or
    heartbeat). When b leaves, a alone is still faster than a and c across that link: the next
    plan gives a every block and keeps c spare."""
    svc = _service(tmp_path, Clock(), size=2, steps=20)
    ctx: Any = FakeContext()
    await join(svc, "a")
    await join(svc, "b")
    first = svc.plan
    assert first is not None
    # Joined, still measuring: the swarm view (which newcomers read) shows it without a speed.
    await svc.Join(pb.JoinRequest(node_id="c", address="c:1", protocol=PROTOCOL), ctx)
    view = await svc.Swarm(pb.SwarmRequest(), ctx)
    assert [m.speed for m in view.members] == [1.0, 1.0, 0.0]
    assert view.members[2].measuring_since > 0
    await join(svc, "c", caps=_slow_link_to("a", "b"))
    await join(svc, "c", caps=_slow_link_to("a", "b"))  # again: still nothing to do
    assert svc.plan == first and svc.book.pending is None
    assert [a.epoch for a in svc.book.announcements] == [1]
    view = await svc.Swarm(pb.SwarmRequest(), ctx)
    assert [len(m.peer_links) for m in view.members] == [0, 0, 2]
    await svc.Leave(pb.LeaveRequest(node_id="b"), ctx)
    assert svc.book.pending is not None and [s.node_id for s in svc.book.pending.stages] == ["a"]


async def test_relays_are_offered_while_their_members_stay(tmp_path: Path) -> None:
    """Members that serve a relay say so with their capabilities: the swarm view offers the
    coordinator's own relay first, then theirs, and drops one whose member left. A malformed
    relay address is refused and changes nothing."""
    svc = CoordinatorService(
        prove=unproven,
        train=TrainConfig(model="bench-small", steps=2, batch_size=16),
        swarm_size=3,
        swarm_id="test/bench-small",
        summary_path=tmp_path / "summary.json",
        clock=Clock(),
        node_id="a",
        relay_address="10.0.0.1:7071",
    )
    ctx: Any = FakeContext()
    await join(svc, "a")
    caps = capabilities()
    caps.relay_address = "no port"
    with pytest.raises(Aborted, match="HOST:PORT") as info:
        await join(svc, "b", caps=caps)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [o.node_id for o in (await svc.Swarm(pb.SwarmRequest(), ctx)).relays] == ["a"]
    caps.relay_address = "10.0.0.2:7071"
    await join(svc, "b", caps=caps)
    await join(svc, "c")
    offers = (await svc.Swarm(pb.SwarmRequest(), ctx)).relays
    assert [(o.node_id, o.address) for o in offers] == [("a", "10.0.0.1:7071"),
                                                        ("b", "10.0.0.2:7071")]  # fmt: skip
    await svc.Leave(pb.LeaveRequest(node_id="b"), ctx)
    offers = (await svc.Swarm(pb.SwarmRequest(), ctx)).relays
    assert [o.node_id for o in offers] == ["a"]


async def test_only_a_member_measuring_its_links_may_probe_the_coordinator(tmp_path: Path) -> None:
    """Link probes under epoch 0 come from a member between its first Join and its
    capabilities (for MEASURING_S at most), within a budget that each new measuring starts
    afresh; joining again while it measures does not."""
    clock = Clock()
    svc = _service(tmp_path, clock, size=2)
    ctx: Any = FakeContext()
    first = pb.JoinRequest(node_id="a", address="a:1", protocol=PROTOCOL)
    await svc.Join(first, ctx)
    svc.admit_probe("a", PROBE_BUDGET_BYTES)
    await svc.Join(first, ctx)  # again while measuring: the same budget
    with pytest.raises(Refusal) as info:
        svc.admit_probe("a", 1)  # its budget is spent
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(Refusal) as info:
        svc.admit_probe("stranger", 1)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    view = await svc.Swarm(pb.SwarmRequest(), ctx)
    assert view.members[0].measuring_since == clock.now
    await join(svc, "a")  # with capabilities: its measuring is over
    with pytest.raises(Refusal):
        svc.admit_probe("a", 1)
    assert (await svc.Swarm(pb.SwarmRequest(), ctx)).members[0].measuring_since == 0
    await svc.Join(first, ctx)  # measuring again (say, restarted): a fresh budget
    svc.admit_probe("a", 1)
    clock.now += MEASURING_S  # a member that never sends capabilities stops measuring
    with pytest.raises(Refusal) as info:
        svc.admit_probe("a", 1)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED


async def test_a_node_the_coordinator_cannot_reach_is_refused_with_the_unreachable_mark(
    tmp_path: Path,
) -> None:
    """A node's first Join is checked by reaching it at its address (not the coordinator's own
    node, nor a Join with what it measured, nor a member asking again from where it was
    reached); one that does not answer is refused, marked so that it may try a relay."""
    answers = {"a": ProbeAnswer.ALIVE, "b": ProbeAnswer.SILENT}
    asked: list[str] = []

    async def reach(node_id: str, address: str, timeout_s: float) -> ProbeAnswer:
        asked.append(node_id)
        return answers.get(node_id, ProbeAnswer.REFUSED)

    svc = CoordinatorService(
        prove=unproven,
        train=TrainConfig(model="bench-small", steps=2, batch_size=16), swarm_size=3,
        swarm_id="test/bench-small", summary_path=None, clock=Clock(), node_id="c", reach=reach,
    )  # fmt: skip
    ctx: Any = FakeContext()
    await join(svc, "a")
    await svc.Join(pb.JoinRequest(node_id="a", address="a:1", protocol=PROTOCOL), ctx)
    assert asked == ["a"]  # asking again from where it was reached: not checked again
    with pytest.raises(Aborted, match="cannot reach node b at b:1") as info:
        await svc.Join(pb.JoinRequest(node_id="b", address="b:1", protocol=PROTOCOL), ctx)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.metadata == ((UNREACHABLE_KEY, "1"),)
    assert [m.node_id for m in (await svc.Swarm(pb.SwarmRequest(), ctx)).members] == ["a"]
    await svc.Join(pb.JoinRequest(node_id="c", address="c:1", protocol=PROTOCOL), ctx)
    assert asked == ["a", "b"]  # the coordinator's own node is not asked
