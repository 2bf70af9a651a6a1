"""Chaos: a node is killed with SIGKILL mid-run and the swarm carries on without a restart.
With replicas, a replica's blocks take its place and what was dropped is counted; without, its
stage is restored from a copy of its checkpoint on another node, the run goes back to that
step, and what is trained again is counted."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ravnest_node.checkpoint import run_key
from ravnest_node.coordination.coordinator.membership import ProbeAnswer, RoundTrips
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.coordination.planning.static_plan import has_node
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import PROTOCOL

from .conftest import Procs, demo_summary, poll_until, progress_events, swarm_view
from .fakes import Aborted, Clock, FakeContext, capabilities, join, unproven

STEPS = 160
RUN = ("--model", "tiny", "--pipelines", "2", "--steps", str(STEPS), "--seed", "0",
       "--average-every", "8")  # fmt: skip


def swarm_at_step(
    procs: Procs, tmp_path: Path, size: int, run: tuple[str, ...], step: int
) -> tuple[str, dict[str, subprocess.Popen[bytes]], Iterator[pb.Progress]]:
    """`size` nodes (n0 the coordinator) training `run`, followed until `step`: the
    coordinator's address, the processes by node id, and the rest of the progress stream."""
    coord, ready = procs.start_node(tmp_path / "n0", "--swarm-size", str(size), *run)
    address = ready["address"]
    nodes = {ready["node_id"]: coord}
    for i in range(1, size):
        proc, info = procs.start_node(tmp_path / f"n{i}", "--join", address)
        nodes[info["node_id"]] = proc
    events = progress_events(address, timeout_s=600)
    for event in events:
        if event.step >= step:
            break
    return address, nodes, events


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

    address, nodes, events = swarm_at_step(procs, tmp_path, 6, RUN, 30)
    # The node owning that stage of pipeline 1 dies without a word.
    victim = next(
        s.node_id
        for s in swarm_view(address).plan.stages
        if (s.pipeline, s.index) == (1, victim_stage)
    )
    nodes[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # A plan without it has started, and the swarm trains on.
    poll_until(lambda: swarm_view(address).plan.epoch >= 2, 30)
    taken_over_s = time.monotonic() - killed
    plan = swarm_view(address).plan
    assert victim not in {s.node_id for s in plan.stages} and plan.start_step > 30
    # The fast path found it (its neighbours' broken streams, the coordinator's probe that
    # its address refused: not missed heartbeats, ~12 s, nor a probe that went unanswered, no
    # verdict), and its replica took over within a second, as README says (measured: 0.1 to
    # 0.6 s; this counts from the kill to the test's poll seeing the new plan). Bounded at 3 s,
    # for a loaded CI machine (whose 3.3 s was a resume that waited out gRPC's connect timeout
    # on the refusing address: the resume now looks first), far below the 12 s of heartbeats.
    lost = f"node {victim} (pipeline 1 stage {victim_stage}) is lost: its neighbour "
    log = (tmp_path / "n0" / "node.log").read_text()
    assert lost in log and "refused a probe" in log.split(lost, 1)[1].split("\n", 1)[0]
    assert taken_over_s < 3.0, f"taken over {taken_over_s:.2f} s after the kill"
    summary = json.loads(list(events)[-1].summary_json)

    assert [c["node_id"] for c in summary["crashes"]] == [victim]
    dropped_steps = [
        step for step, loss in enumerate(summary["loss_history_per_pipeline"][1], start=1)
        if math.isnan(loss)
    ]  # fmt: skip
    # Dropped: the broken pipeline's steps after its last report up to the new plan's start
    # (none if it had reported them all when the takeover came).
    assert summary["dropped_microbatches"] == 4 * len(dropped_steps)
    # Final loss at equal samples: the mean of the last 10 steps (one step's loss is one batch).
    final, expected = (sum(s["loss_history"][-10:]) / 10 for s in (summary, undisturbed))
    print(f"taken over {taken_over_s:.1f} s after the kill (plan epoch {plan.epoch} from step "
          f"{plan.start_step}); {summary['dropped_microbatches']} microbatches dropped (steps "
          f"{dropped_steps} of pipeline 1); final loss (last 10 steps) {final:.4f}, undisturbed "
          f"{expected:.4f}")  # fmt: skip
    # No worse than 3%. (In runs so far it ended 3-4% lower; the re-plan restarts the replicas'
    # outer optimizer, which the undisturbed run carries along: our guess at why.)
    assert final <= 1.03 * expected
    for node_id, proc in nodes.items():
        if node_id != victim:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0


ALONE = ("--model", "tiny", "--steps", "400", "--seed", "0", "--checkpoint-every", "10")


@pytest.fixture(scope="module")
def undisturbed_alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One pipeline of three stages, nobody killed."""
    return demo_summary(tmp_path_factory.mktemp("alone"), "undisturbed", "--nodes", "3", *ALONE)


def test_a_node_without_a_replica_killed_mid_run_is_restored_from_its_copied_checkpoint(
    procs: Procs, tmp_path: Path, undisturbed_alone: dict[str, Any]
) -> None:
    """One pipeline: nothing holds the middle stage's blocks but its checkpoints, of which the
    last stage's node keeps copies. Killed, the middle node's stage is restored from the copy
    on another node, the run goes back to that step, and the steps trained again are counted.
    Started again on its state directory, the node rejoins under its id and gets a stage of a
    later plan, whose blocks it fetches (it trains nothing of the plan it crashed in)."""
    address, nodes, events = swarm_at_step(procs, tmp_path, 3, ALONE, 35)
    view = swarm_view(address)
    stages = {s.index: s for s in view.plan.stages}
    victim, keeper = stages[1].node_id, stages[2]
    # The first plan runs (no member was counted gone meanwhile), the coordinator's node is
    # not the victim.
    assert view.plan.epoch == 1 and victim != view.members[0].node_id
    held = next(p for p in (tmp_path / "n2").glob("checkpoint-copies/blocks-*"))
    assert sorted(held.glob("step-*.json"))  # the last stage keeps copies of the middle one's
    nodes[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    poll_until(lambda: swarm_view(address).plan.epoch >= 2, 30)
    restored_s = time.monotonic() - killed
    plan = swarm_view(address).plan
    assert plan.restore and victim not in {s.node_id for s in plan.stages}
    holders = {(h.first_block, h.stop_block): h.node_id for h in plan.previous}
    assert holders[(stages[1].first_block, stages[1].stop_block)] == keeper.node_id
    nodes[victim], info = procs.start_node(tmp_path / "n1", "--join", address)
    assert info["node_id"] == victim
    poll_until(lambda: has_node(swarm_view(address).plan.stages, victim), 60)
    rejoined = swarm_view(address).plan
    summary = json.loads(list(events)[-1].summary_json)

    assert [c["node_id"] for c in summary["crashes"]] == [victim]
    (restore,) = summary["restores"]
    assert restore["restored_step"] == plan.start_step and plan.start_step % 10 == 0
    redone_steps = restore["after_step"] - restore["restored_step"]
    assert redone_steps > 0 and summary["redone_microbatches"] == 4 * redone_steps
    assert summary["dropped_microbatches"] == 0
    assert not any(math.isnan(loss) for loss in summary["loss_history"])
    final, expected = (sum(s["loss_history"][-10:]) / 10 for s in (summary, undisturbed_alone))
    print(f"restored {restored_s:.1f} s after the kill at step {plan.start_step} (plan epoch "
          f"{plan.epoch}, {len(plan.stages)} stages) from the copy on {keeper.node_id}; "
          f"{summary['redone_microbatches']} microbatches redone (steps "
          f"{restore['restored_step'] + 1}-{restore['after_step']}); final loss (last 10 "
          f"steps) {final:.4f}, undisturbed {expected:.4f}")  # fmt: skip
    assert final <= 1.03 * expected
    assert [len({s[4] for s in p["stages"]}) for p in summary["plans"]] == [3, 2, 3]
    print(f"the restarted node rejoined in plan epoch {rejoined.epoch} from step "
          f"{rejoined.start_step}")  # fmt: skip
    for proc in nodes.values():
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


# ----- the coordinator's side, without processes --------------------------------------------
async def planned_swarm(
    clock: Clock, nodes: str, **train: Any
) -> tuple[CoordinatorService, pb.Plan]:
    """A tiny-model swarm of one node per letter of `nodes`, all joined: its first plan."""
    svc = tiny_swarm(clock, len(nodes), **train)
    for node in nodes:
        await join(svc, node, caps=capabilities(blocks=4))
    assert svc.plan is not None
    return svc, svc.plan


LEASE_S = 6.0
"""The leases of these tests' coordinators (their clock steps are in units of it)."""


def tiny_swarm(
    clock: Clock,
    size: int,
    probe: Callable[[str, str, float], Awaitable[ProbeAnswer]] | None = None,
    **train: Any,
) -> CoordinatorService:
    return CoordinatorService(
        prove=unproven,
        train=TrainConfig(model="tiny", batch_size=16, **train), swarm_size=size,
        swarm_id="test/tiny", summary_path=None, clock=clock, probe=probe, node_id="a",
        lease_s=LEASE_S,
    )  # fmt: skip


async def beat(
    svc: CoordinatorService, node: str, offers: list[pb.CheckpointOffer], held: int = 0
) -> int:
    """`node`'s heartbeat offering `offers`, held for plan epoch `held` (0: not held): the
    epoch the coordinator asks it to hold its checkpoints for (0: none)."""
    request = pb.HeartbeatRequest(node_id=node, checkpoints=offers, held_epoch=held)
    reply = await svc.Heartbeat(request, FakeContext())  # type: ignore[arg-type]
    return reply.hold_epoch


def offer(plan: pb.Plan, step: int, s: pb.StageAssignment) -> pb.CheckpointOffer:
    """A checkpoint of stage `s` of `plan` at `step`, as a heartbeat offers it."""
    return pb.CheckpointOffer(step=step, first_block=s.first_block, stop_block=s.stop_block,
                              run_key=run_key(plan.run), stage=s.index)  # fmt: skip


def ring_offers(plan: pb.Plan, steps: tuple[int, ...]) -> dict[str, list[pb.CheckpointOffer]]:
    """Each stage's own checkpoints at `steps`, and its copies of its upstream stage's (the
    first stage keeps the last's), by node id: what the members of one pipeline offer."""
    stage = {s.index: s for s in plan.stages}
    return {
        s.node_id: [offer(plan, st, s) for st in steps]
        + [offer(plan, st, stage[(s.index - 1) % len(stage)]) for st in steps]
        for s in plan.stages
    }


async def test_a_lost_member_breaks_its_pipeline_and_the_healthy_one_carries_on(
    tmp_path: Path,
) -> None:
    clock = Clock()
    svc = tiny_swarm(clock, 4, steps=50, pipelines=2)
    ctx: Any = FakeContext()
    for node in "abcd":
        await join(svc, node, caps=capabilities(blocks=4))
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
    pending = svc.book.pending
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
    assert [c.node_id for c in svc.faults.crashes] == [victim]
    assert svc.faults.dropped == 2 * 4  # steps 4 and 5 of pipeline 1, 4 microbatches each
    # Steps 4 and 5 are complete (progress goes on): their loss is the mean of who trained.
    assert [e.loss for e in svc.progress.events] == [4.5, 4.5, 4.5, 3.0, 3.0]


async def test_without_a_replica_a_lost_member_is_reported_and_nothing_replanned(
    tmp_path: Path,
) -> None:
    clock = Clock()
    svc = tiny_swarm(clock, 2, steps=50)
    for node in "ab":
        await join(svc, node, caps=capabilities(blocks=4))
    clock.now += 7.0  # one lease: not yet lost
    await svc.Heartbeat(pb.HeartbeatRequest(node_id="a"), FakeContext())  # type: ignore[arg-type]
    assert svc.faults.crashes == []
    clock.now += 6.0
    await svc.Heartbeat(pb.HeartbeatRequest(node_id="a"), FakeContext())  # type: ignore[arg-type]
    assert svc.book.pending is None and svc.plan is not None and svc.plan.epoch == 1
    assert [c.node_id for c in svc.faults.crashes] == ["b"]


async def test_without_a_replica_the_run_is_restored_from_checkpoints_and_copies(
    tmp_path: Path,
) -> None:
    """b is lost; c holds a copy of b's checkpoint at step 10: a plan of a and c restores the
    run at step 10 (the newest step every block has, and no later than the last reported),
    and the steps after it are rolled back and counted as redone."""
    clock = Clock()
    svc, plan = await planned_swarm(clock, "abc", steps=50, microbatches=4)
    ctx: Any = FakeContext()
    stage = {s.index: s for s in plan.stages}
    offers = ring_offers(plan, (10, 5))
    offers[stage[2].node_id].insert(0, offer(plan, 15, stage[2]))  # past the last reported step
    for step in range(1, 13):
        report = pb.StageReport(node_id=stage[2].node_id, stage=2, pipeline=0, plan_epoch=1,
                                step=step, loss=5.0 - step / 10)  # fmt: skip
        await svc.Report(report, ctx)
    victim = stage[1].node_id
    held = dict.fromkeys("abc", 0)
    for _ in range(4):  # lost after two leases of silence
        clock.now += 3.5
        for node in "abc":
            if node != victim:
                held[node] = await beat(svc, node, offers[node], held[node])
    # The loss came with the last round: each member was asked to hold its checkpoints, and
    # the restore waits for the heartbeats that say they do.
    assert svc.plan is not None and svc.plan.epoch == 1
    assert {n: e for n, e in held.items() if n != victim} == {"a": 1, "c": 1}
    await beat(svc, "a", offers["a"], held["a"])
    assert svc.plan.epoch == 1  # c's offers are not held yet
    assert await beat(svc, "c", offers["c"], held["c"]) == 0  # restored: nothing to hold now
    new = svc.plan
    assert new is not None and new.epoch == 2 and new.restore and not new.pending
    assert new.start_step == 10 and victim not in {s.node_id for s in new.stages}
    assert len(new.stages) == 2
    holders = {(h.first_block, h.stop_block): h.node_id for h in new.previous}
    assert holders[(stage[1].first_block, stage[1].stop_block)] == stage[2].node_id
    assert svc.faults.redone == 2 * 4 and sorted(svc.progress.losses) == list(range(1, 11))
    # The broken plan's late report past step 10 is refused; the new plan trains step 11 again.
    late = pb.StageReport(node_id=stage[2].node_id, stage=2, pipeline=0, plan_epoch=1, step=13)
    with pytest.raises(Aborted):
        await svc.Report(late, ctx)
    last = new.stages[-1]
    again = pb.StageReport(node_id=last.node_id, stage=last.index, pipeline=0, plan_epoch=2,
                           step=11, loss=3.0)  # fmt: skip
    await svc.Report(again, ctx)
    assert svc.progress.losses[11] == 3.0
    summary = svc.summary(new)
    assert summary["redone_microbatches"] == 8
    assert summary["restores"][0]["restored_step"] == 10


async def test_a_restore_is_planned_from_held_offers_not_from_older_ones() -> None:
    """Offers lag: the middle stage's node is lost while the others' last heartbeats offered
    step 10 only. By the time they hold their checkpoints, their writes have pruned step 10
    (keep 2): the restore starts at step 30, which they hold, never at the step 10 their
    older offers named."""
    clock = Clock()
    svc, plan = await planned_swarm(clock, "abc", steps=50, microbatches=4)
    ctx: Any = FakeContext()
    stage = {s.index: s for s in plan.stages}
    for step in range(1, 33):
        report = pb.StageReport(node_id=stage[2].node_id, stage=2, pipeline=0, plan_epoch=1,
                                step=step, loss=5.0 - step / 100)  # fmt: skip
        await svc.Report(report, ctx)
    old, now = ring_offers(plan, (10,)), ring_offers(plan, (30, 20))
    victim = stage[1].node_id
    others = [n for n in "abc" if n != victim]
    asked = {}
    for _ in range(4):
        clock.now += 3.5
        for node in others:
            asked[node] = await beat(svc, node, old[node])
    assert svc.plan is not None and svc.plan.epoch == 1 and set(asked.values()) == {1}
    assert [c.node_id for c in svc.faults.crashes] == [victim]
    for node in others:
        await beat(svc, node, now[node], held=1)
    new = svc.plan
    assert new.epoch == 2 and new.restore and new.start_step == 30
    holders = {(h.first_block, h.stop_block): h.node_id for h in new.previous}
    assert holders[(stage[1].first_block, stage[1].stop_block)] == stage[2].node_id


async def test_a_coordinator_elected_in_a_failover_takes_the_run_over(tmp_path: Path) -> None:
    """a, coordinator of plan epoch 1, is lost; b won the failover election (term 2). Its new
    coordinator service takes plan 1 over and waits for the members to come back (Join with
    what they measured and the newest plan epoch they know, then a heartbeat with their
    checkpoint offers); then it counts a lost and restores the run from b's and c's
    checkpoints and copies, in a plan above every epoch a member knew (c saw a pending 3; b's
    999 is not believed)."""
    clock = Clock()
    _, plan = await planned_swarm(clock, "abc", steps=50, microbatches=4)
    ctx: Any = FakeContext()
    stage = {s.index: s for s in plan.stages}
    offers = ring_offers(plan, (20, 10))
    svc = tiny_swarm(clock, 3, steps=50, microbatches=4)
    svc.take_over(plan, {"a"}, term=2, known_epoch=1)
    assert svc.plan is not None and svc.plan.epoch == 1

    async def back(node: str, epoch: int) -> None:
        request = pb.JoinRequest(node_id=node, address=f"{node}:1", protocol=PROTOCOL,
                                 capabilities=capabilities(blocks=4), plan_epoch=epoch)  # fmt: skip
        await svc.Join(request, ctx)

    await back("b", 999)  # far past the plan taken over: not believed
    assert await beat(svc, "b", offers["b"]) == 0
    await back("c", 3)
    assert svc.plan.epoch == 1 and not svc.faults.crashes  # c has not sent its offers yet
    clock.now += 2
    assert await beat(svc, "c", offers["c"]) == 1  # the restore waits for held offers
    assert [c.node_id for c in svc.faults.crashes] == ["a"] and svc.plan.epoch == 1
    for node in "bc":
        await beat(svc, node, offers[node], held=1)
    new = svc.plan
    assert new.epoch == 4 and new.restore and new.start_step == 20
    assert {s.node_id for s in new.stages} == {"b", "c"}
    assert [c.node_id for c in svc.faults.crashes] == ["a"]
    summary = svc.summary(new)
    assert summary["takeover"] == {"term": 2, "plan_epoch": 1, "lost_coordinator": ["a"]}
    assert summary["resumed_at"] == 20 and summary["restores"][0]["after_step"] is None
    # The plan taken over is rolled back: its late reports are refused; the new one reports
    # from the step after the restore.
    late = pb.StageReport(node_id=stage[2].node_id, stage=2, pipeline=0, plan_epoch=1, step=25)
    with pytest.raises(Aborted):
        await svc.Report(late, ctx)
    last = new.stages[-1]
    await svc.Report(pb.StageReport(node_id=last.node_id, stage=last.index, pipeline=0,
                                    plan_epoch=4, step=21, loss=3.0), ctx)  # fmt: skip
    assert svc.progress.losses == {21: 3.0}


async def test_a_takeover_does_not_wait_for_a_member_that_stays_silent(tmp_path: Path) -> None:
    """c never comes back to the coordinator that took over: after two leases it is counted
    lost with the old coordinator, and without their blocks the run cannot be restored (said,
    not planned)."""
    clock = Clock()
    _, plan = await planned_swarm(clock, "abc", steps=50)
    ctx: Any = FakeContext()
    svc = tiny_swarm(clock, 3, steps=50)
    svc.take_over(plan, {"a"}, term=2)
    request = pb.JoinRequest(node_id="b", address="b:1", protocol=PROTOCOL,
                             capabilities=capabilities(blocks=4), plan_epoch=1)  # fmt: skip
    await svc.Join(request, ctx)
    for _ in range(4):
        clock.now += 3.5
        await svc.Heartbeat(pb.HeartbeatRequest(node_id="b"), ctx)
    assert sorted(c.node_id for c in svc.faults.crashes) == ["a", "c"]
    assert svc.plan is not None and svc.plan.epoch == 1 and svc.book.pending is None


async def test_a_heartbeat_with_malformed_offers_counts_without_them(tmp_path: Path) -> None:
    clock = Clock()
    svc = tiny_swarm(clock, 2, steps=50)
    await join(svc, "a", caps=capabilities(blocks=4))
    clock.now += 5
    good = pb.CheckpointOffer(step=5, stop_block=4)
    await svc.Heartbeat(pb.HeartbeatRequest(node_id="a", checkpoints=[good]), FakeContext())  # type: ignore[arg-type]
    bad = pb.HeartbeatRequest(node_id="a", checkpoints=[pb.CheckpointOffer(step=5, stop_block=9)])
    clock.now += 5
    await svc.Heartbeat(bad, FakeContext())  # type: ignore[arg-type]
    assert svc.faults.offers == {}  # what it offered before is not counted on either
    assert svc.roster.leases.silent_s("a", clock.now) == 0  # but it is alive


async def test_a_node_that_restarts_while_in_the_plan_is_lost_at_once_and_rejoins(
    tmp_path: Path,
) -> None:
    """b crashes and starts again at once (another port): the coordinator does not wait for
    its lease to run out. Its earlier run's stage is lost (here restored from checkpoints);
    this run of it is a newcomer that trains no plan up to the one started when it joined."""
    clock = Clock()
    svc, plan = await planned_swarm(clock, "abc", steps=50, microbatches=4)
    ctx: Any = FakeContext()
    key = run_key(plan.run)
    offers_of = {}
    for s in plan.stages:  # every block checkpointed at step 4 by its owner and copied by c
        offers_of[s.node_id] = [
            pb.CheckpointOffer(step=4, first_block=t.first_block, stop_block=t.stop_block,
                               run_key=key, stage=t.index, plan_epoch=1)
            for t in plan.stages if t.node_id == s.node_id or s.node_id == "c"
        ]  # fmt: skip
        await beat(svc, s.node_id, offers_of[s.node_id])
    last = plan.stages[-1]
    for step in range(1, 7):
        report = pb.StageReport(node_id=last.node_id, stage=last.index, pipeline=0,
                                plan_epoch=1, step=step, loss=4.0)  # fmt: skip
        await svc.Report(report, ctx)
    clock.now += 1.0  # well within its lease
    # Another address while its lease runs: someone else, refused.
    with pytest.raises(Aborted) as refused:
        await svc.Join(pb.JoinRequest(node_id="b", address="b:2", protocol=PROTOCOL), ctx)
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
    # The same address (a fixed port): its restart.
    reply = await svc.Join(pb.JoinRequest(node_id="b", address="b:1", protocol=PROTOCOL), ctx)
    assert [c.node_id for c in svc.faults.crashes] == ["b"]
    assert reply.started_epoch == 1  # it trains nothing of the plan its crash broke
    for node in "ac":  # the restore waits for the members left to hold their checkpoints
        assert svc.plan.epoch == 1
        await beat(svc, node, offers_of[node], held=1)
    new = svc.plan
    assert new is not None and new.epoch == 2 and new.restore and new.start_step == 4
    assert "b" not in {s.node_id for s in new.stages}
    # Measured again, it gets a stage in the next plan.
    await svc.Join(pb.JoinRequest(node_id="b", address="b:1", protocol=PROTOCOL,
                                  capabilities=capabilities(blocks=4)), ctx)  # fmt: skip
    pending = svc.book.pending
    assert pending is not None and pending.epoch == 3 and has_node(pending.stages, "b")
    # A second restore never takes the rolled-back timeline's checkpoints: b's step-6 one,
    # written under epoch 1, after the step (4) that epoch 2 restored.
    stale = pb.CheckpointOffer(step=6, first_block=0, stop_block=4, run_key=key, plan_epoch=1)
    fresh = pb.CheckpointOffer(step=6, first_block=0, stop_block=4, run_key=key, plan_epoch=2)
    assert svc.faults.timeline([stale, fresh]) == [fresh]


async def test_a_node_lost_after_the_last_step_ends_the_run(tmp_path: Path) -> None:
    clock = Clock()
    svc = tiny_swarm(clock, 2, steps=3)
    ctx: Any = FakeContext()
    for node in "ab":
        await join(svc, node, caps=capabilities(blocks=4))
    plan = svc.plan
    assert plan is not None
    last = plan.stages[-1]
    for step in (1, 2, 3):
        report = pb.StageReport(node_id=last.node_id, stage=last.index, pipeline=0,
                                plan_epoch=1, step=step, loss=4.0)  # fmt: skip
        await svc.Report(report, ctx)
    victim = plan.stages[0].node_id
    for _ in range(4):
        clock.now += 3.5
        await svc.Heartbeat(pb.HeartbeatRequest(node_id=last.node_id), ctx)
    assert svc.plan is not None and svc.plan.epoch == 1 and not svc.faults.restores
    assert svc.progress.events[-1].done  # nothing to restore: every step is trained
    assert json.loads(svc.progress.events[-1].summary_json)["crashes"][0]["node_id"] == victim


async def test_a_suspect_whose_address_refuses_a_probe_is_lost_at_once(tmp_path: Path) -> None:
    """A stream broke: the coordinator probes the neighbours named, each within a deadline of
    ten of its measured round trips (at least 2 s, at most a lease), and counts the one whose
    address refuses the probe as lost without waiting for its lease; one that answers stays.
    Its own node (a) is never probed. Heard from a lease later, a lost member may have a stage
    again."""
    clock = Clock()
    alive = {"a": ProbeAnswer.ALIVE, "b": ProbeAnswer.ALIVE, "c": ProbeAnswer.ALIVE,
             "d": ProbeAnswer.REFUSED}  # fmt: skip
    probed: list[tuple[str, float]] = []

    async def probe(node_id: str, address: str, timeout_s: float) -> ProbeAnswer:
        assert address == f"{node_id}:1"
        probed.append((address, timeout_s))
        return alive[node_id]

    svc = tiny_swarm(clock, 4, probe, steps=50, pipelines=2)
    ctx: Any = FakeContext()
    for node in "abcd":
        await join(svc, node, caps=capabilities(blocks=4))
    plan = svc.plan
    assert plan is not None
    for node, rtt in [("a", 0.002), ("b", 0.3), ("c", 0.3), ("d", 0.002)]:
        await svc.Heartbeat(pb.HeartbeatRequest(node_id=node, rtt_s=rtt), ctx)
    with pytest.raises(Aborted) as refused:
        await svc.Suspect(pb.SuspectRequest(node_id="zz", plan_epoch=1, suspects=["d"]), ctx)
    assert refused.value.code == grpc.StatusCode.NOT_FOUND
    # A stale plan epoch: nothing is probed.
    await svc.Suspect(pb.SuspectRequest(node_id="a", plan_epoch=7, suspects=["d"]), ctx)
    assert probed == []
    reply = await svc.Suspect(
        pb.SuspectRequest(node_id="c", plan_epoch=1, suspects=["b", "d", "a", "c", "nobody"],
                          reason="stream removed"), ctx,
    )  # fmt: skip
    assert list(reply.lost) == ["d"] and [c.node_id for c in svc.faults.crashes] == ["d"]
    assert sorted(probed) == [("b:1", 3.0), ("d:1", 2.0)]  # 10 x 0.3 s; 10 x 2 ms -> 2 s floor
    assert svc.book.pending is not None and "d" not in {s.node_id for s in svc.book.pending.stages}
    # Named again: it is lost already, and not probed twice.
    await svc.Suspect(pb.SuspectRequest(node_id="b", plan_epoch=1, suspects=["d"]), ctx)
    assert len(probed) == 2
    # It was alive after all (its heartbeats come back a lease later): it may be planned again.
    clock.now += 7.0
    await svc.Heartbeat(pb.HeartbeatRequest(node_id="d"), ctx)
    assert "d" not in svc.roster.lost


def test_round_trips_average_what_heartbeats_measured() -> None:
    rtts = RoundTrips()
    assert rtts.probe_timeout("a", 6.0) == 6.0  # nothing measured: the ceiling
    for sample in (0.5, float("nan"), -1.0, 1e9, 0.0):
        rtts.add("a", sample)  # only the first counts
    assert rtts.probe_timeout("a", 6.0) == 5.0
    rtts.add("b", 0.01)
    assert rtts.probe_timeout("b", 6.0) == 2.0  # the floor
    rtts.add("a", 1.0)
    assert rtts.rtt_s["a"] == pytest.approx(0.6)
    assert rtts.probe_timeout("a", 6.0) == 6.0  # 10 x 0.6 s, capped at the lease


async def test_two_suspects_lost_at_once_make_one_new_plan(tmp_path: Path) -> None:
    """Both neighbours of a stage are gone: one plan without both, not two of one epoch."""
    clock = Clock()
    ctx: Any = FakeContext()
    neighbours: list[str] = []  # of the middle stage, once planned

    async def probe(node_id: str, address: str, timeout_s: float) -> ProbeAnswer:
        return ProbeAnswer.REFUSED if node_id in neighbours else ProbeAnswer.ALIVE

    svc = tiny_swarm(clock, 6, probe, steps=50, pipelines=2)
    for node in "abcdef":
        await join(svc, node, caps=capabilities(blocks=4))
    plan = svc.plan
    assert plan is not None
    middle = next(s for s in plan.stages if (s.pipeline, s.index) == (1, 1))
    neighbours += [s.node_id for s in plan.stages if s.pipeline == 1 and s.index != 1]
    reply = await svc.Suspect(
        pb.SuspectRequest(node_id=middle.node_id, plan_epoch=1, suspects=neighbours), ctx
    )
    assert sorted(reply.lost) == sorted(neighbours)
    assert sorted(c.node_id for c in svc.faults.crashes) == sorted(neighbours)
    announced = [(p.epoch, p.pending) for p in svc.book.announcements]
    assert len(announced) == len(set(announced)) and svc.book.pending is not None
    assert not set(neighbours) & {s.node_id for s in svc.book.pending.stages}
