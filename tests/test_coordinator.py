"""The coordinator's decisions, driven directly (no sockets): membership, the plan, progress."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from ravnest_node.coordination.coordinator import PROTOCOL, CoordinatorService
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class FakeContext:
    """The part of grpc.aio.ServicerContext the coordinator uses."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _service(tmp_path: Path, clock: Clock, size: int = 3) -> CoordinatorService:
    return CoordinatorService(
        train=TrainConfig(model="bench-small", steps=2, batch_size=16),
        swarm_size=size,
        swarm_id="test/bench-small",
        summary_path=tmp_path / "summary.json",
        clock=clock,
    )


async def _join(svc: CoordinatorService, node: str, address: str = "") -> pb.JoinReply:
    request = pb.JoinRequest(node_id=node, address=address or f"{node}:1", protocol=PROTOCOL)
    reply: pb.JoinReply = await svc.Join(request, FakeContext())  # type: ignore[arg-type]
    return reply


async def test_plan_waits_for_the_swarm_and_balances_blocks(tmp_path: Path) -> None:
    svc = _service(tmp_path, Clock())
    assert (await _join(svc, "a")).member_index == 0
    assert (await _join(svc, "a")).member_index == 0  # joining again is harmless
    await _join(svc, "b")
    assert svc.plan is None
    await _join(svc, "c")
    plan = svc.plan
    assert plan is not None and plan.epoch == 1
    assert [(s.first_block, s.stop_block, s.node_id) for s in plan.stages] == [
        (0, 3, "a"),
        (3, 5, "b"),
        (5, 8, "c"),
    ]
    assert plan.run.model == "bench-small" and plan.run.steps == 2
    assert not plan.run.HasField("fault_skip_step_stage")


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
    await _join(svc, "a")
    with pytest.raises(Aborted) as info:
        await _join(svc, "b")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(Aborted) as info:
        await _join(svc, "a", address="elsewhere:2")
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS


async def test_reports_become_progress_and_a_summary(tmp_path: Path) -> None:
    clock = Clock()
    svc = _service(tmp_path, clock, size=2)
    await _join(svc, "a")
    await _join(svc, "b")
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
