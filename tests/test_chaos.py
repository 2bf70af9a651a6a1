"""Chaos: a node of a swarm with replicas is killed with SIGKILL mid-run; the swarm carries on
without a restart, a replica's blocks take its place, and what was dropped is counted."""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from ravnest_node.coordination.coordinator import CoordinatorService
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc

from .conftest import Procs, demo_summary, poll_until, progress_events
from .test_coordinator import Aborted, Clock, FakeContext, _caps, _join

STEPS = 160
RUN = ("--model", "tiny", "--pipelines", "2", "--steps", str(STEPS), "--seed", "0",
       "--average-every", "8")  # fmt: skip


def swarm_view(address: str) -> pb.SwarmView:
    with grpc.insecure_channel(address) as channel:
        view: pb.SwarmView = pb_grpc.CoordinatorStub(channel).Swarm(pb.SwarmRequest(), timeout=30)
    return view


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same run with nobody killed."""
    return demo_summary(tmp_path_factory.mktemp("chaos"), "undisturbed", "--nodes", "6", *RUN)


@pytest.mark.parametrize("victim_stage", [1, 2], ids=["middle-stage", "last-stage"])
def test_a_node_killed_mid_run_is_replaced_by_its_replica(
    procs: Procs, tmp_path: Path, undisturbed: dict[str, Any], victim_stage: int
) -> None:
    """Killing the middle stage breaks both its neighbours' streams; killing the last one, the
    first stage two hops away learns it when the coordinator refuses its drain."""

    coord, ready = procs.start_node(tmp_path / "n0", "--swarm-size", "6", *RUN)
    address = ready["address"]
    nodes = {ready["node_id"]: coord}
    for i in range(1, 6):
        proc, info = procs.start_node(tmp_path / f"n{i}", "--join", address)
        nodes[info["node_id"]] = proc
    events = progress_events(address, timeout_s=600)
    for event in events:
        if event.step >= 30:
            break
    # The node owning that stage of pipeline 1 dies without a word.
    victim = next(
        s.node_id
        for s in swarm_view(address).plan.stages
        if (s.pipeline, s.index) == (1, victim_stage)
    )
    nodes[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # Within 30 s a plan without it has started, and the swarm trains on.
    poll_until(lambda: swarm_view(address).plan.epoch >= 2, 30)
    taken_over_s = time.monotonic() - killed
    plan = swarm_view(address).plan
    assert victim not in {s.node_id for s in plan.stages} and plan.start_step > 30
    summary = json.loads(list(events)[-1].summary_json)

    assert [c["node_id"] for c in summary["crashes"]] == [victim]
    dropped_steps = [
        step for step, loss in enumerate(summary["loss_history_per_pipeline"][1], start=1)
        if math.isnan(loss)
    ]  # fmt: skip
    assert dropped_steps and summary["dropped_microbatches"] == 4 * len(dropped_steps)
    # Final loss at equal samples: the mean of the last 10 steps (one step's loss is one batch).
    final, expected = (sum(s["loss_history"][-10:]) / 10 for s in (summary, undisturbed))
    print(f"taken over {taken_over_s:.1f} s after the kill (plan epoch {plan.epoch} from step "
          f"{plan.start_step}); {summary['dropped_microbatches']} microbatches dropped (steps "
          f"{dropped_steps[0]}-{dropped_steps[-1]} of pipeline 1); final loss (last 10 steps) "
          f"{final:.4f}, undisturbed {expected:.4f}")  # fmt: skip
    # No worse than 3%. (In runs so far it ended 3-4% lower; the re-plan restarts the replicas'
    # outer optimizer, which the undisturbed run carries along: our guess at why.)
    assert final <= 1.03 * expected
    for node_id, proc in nodes.items():
        if node_id != victim:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0


# ----- the coordinator's side, without processes --------------------------------------------
async def test_a_lost_member_breaks_its_pipeline_and_the_healthy_one_carries_on(
    tmp_path: Path,
) -> None:
    clock = Clock()
    svc = CoordinatorService(
        train=TrainConfig(model="tiny", steps=50, batch_size=16, pipelines=2),
        swarm_size=4, swarm_id="test/tiny", summary_path=None, clock=clock,
    )  # fmt: skip
    ctx: Any = FakeContext()
    for node in "abcd":
        await _join(svc, node, caps=_caps(blocks=4))
    plan = svc.plan
    assert plan is not None and plan.epoch == 1
    stage = {(s.pipeline, s.index): s.node_id for s in plan.stages}
    last = len(plan.stages) // 2 - 1
    for step in (1, 2, 3):
        for p in (0, 1):
            report = pb.StageReport(node_id=stage[(p, last)], stage=last, pipeline=p,
                                    plan_epoch=1, step=step, loss=4.0 + p)  # fmt: skip
            await svc.Report(report, ctx)
    victim = stage[(1, 0)]
    # Everyone else keeps sending heartbeats; the victim is silent past its lease.
    for _ in range(4):  # lost after two leases (12 s) of silence
        clock.now += 3.5
        for node in "abcd":
            if node != victim:
                await svc.Heartbeat(pb.HeartbeatRequest(node_id=node), ctx)
    pending = svc._next
    assert pending is not None and pending.pending and pending.epoch == 2
    assert victim not in {s.node_id for s in pending.stages}
    assert {s.pipeline for s in pending.previous} == {0}  # blocks come from the healthy one
    # Pipeline 0 trains two more steps and drains; pipeline 1 is not waited for.
    for step in (4, 5):
        report = pb.StageReport(node_id=stage[(0, last)], stage=last, pipeline=0,
                                plan_epoch=1, step=step, loss=3.0)  # fmt: skip
        await svc.Report(report, ctx)
    # The broken pipeline's first stage is told to drop its work, not to drain.
    broken_drain = pb.DrainRequest(node_id=victim, plan_epoch=1, pipeline=1, stop_step=4)
    with pytest.raises(Aborted) as refused:
        await svc.Drain(broken_drain, ctx)
    assert refused.value.code == grpc.StatusCode.ABORTED
    drain = pb.DrainRequest(node_id=stage[(0, 0)], plan_epoch=1, pipeline=0, stop_step=5)
    assert (await svc.Drain(drain, ctx)).stop_step == 5
    assert svc.plan is not None and svc.plan.epoch == 2 and svc.plan.start_step == 5
    assert [c["node_id"] for c in svc._crashes] == [victim]
    assert svc._dropped == 2 * 4  # steps 4 and 5 of pipeline 1, 4 microbatches each
    # Steps 4 and 5 are complete (progress goes on): their loss is the mean of who trained.
    assert [e.loss for e in svc._events] == [4.5, 4.5, 4.5, 3.0, 3.0]


async def test_without_a_replica_a_lost_member_is_reported_and_nothing_replanned(
    tmp_path: Path,
) -> None:
    clock = Clock()
    svc = CoordinatorService(
        train=TrainConfig(model="tiny", steps=50, batch_size=16), swarm_size=2,
        swarm_id="test/tiny", summary_path=None, clock=clock,
    )  # fmt: skip
    for node in "ab":
        await _join(svc, node, caps=_caps(blocks=4))
    clock.now += 7.0  # one lease: not yet lost
    await svc.Heartbeat(pb.HeartbeatRequest(node_id="a"), FakeContext())  # type: ignore[arg-type]
    assert svc._crashes == []
    clock.now += 6.0
    await svc.Heartbeat(pb.HeartbeatRequest(node_id="a"), FakeContext())  # type: ignore[arg-type]
    assert svc._next is None and svc.plan is not None and svc.plan.epoch == 1
    assert [c["node_id"] for c in svc._crashes] == ["b"]
