"""After a network fault (issue #34): what a worker decides once its plan broke
(daemon/worker/reconnect.py), and the coordinator's restore that waits, as long as it takes,
for members to come back with the blocks it lacks. Pure: no sockets, no sleeps."""

from __future__ import annotations

import random
from typing import Any

from ravnest_node.coordination.coordinator import recovery
from ravnest_node.daemon.worker.reconnect import AfterBreak, Backoff, after_break, counted_out
from ravnest_node.errors import PeerRefused, PeerUnavailable
from ravnest_node.proto import control_pb2 as pb

from .fakes import Clock, FakeContext
from .test_chaos import beat, offer, planned_swarm


# ----- the worker's decisions -----------------------------------------------------------------
def test_after_a_break_a_node_waits_for_a_newer_plan_however_long() -> None:
    decide: dict[str, Any] = dict(broken_epoch=3, out=False, rejoined=False)
    assert after_break(stopping=False, started_epoch=3, **decide) is AfterBreak.WAIT
    assert after_break(stopping=False, started_epoch=0, **decide) is AfterBreak.WAIT
    assert after_break(stopping=False, started_epoch=4, **decide) is AfterBreak.FOLLOW
    assert after_break(stopping=True, started_epoch=4, **decide) is AfterBreak.STOP


def test_a_node_counted_out_rejoins_once_then_follows() -> None:
    out: dict[str, Any] = dict(stopping=False, broken_epoch=3, out=True)
    assert after_break(started_epoch=3, rejoined=False, **out) is AfterBreak.REJOIN
    assert after_break(started_epoch=4, rejoined=False, **out) is AfterBreak.REJOIN
    assert after_break(started_epoch=3, rejoined=True, **out) is AfterBreak.WAIT
    assert after_break(started_epoch=4, rejoined=True, **out) is AfterBreak.FOLLOW
    assert after_break(started_epoch=4, rejoined=False, stopping=True, broken_epoch=3,
                       out=True) is AfterBreak.STOP  # fmt: skip


def test_a_break_nobody_resolves_ends_in_a_rejoin_as_a_restarted_node_once() -> None:
    waiting: dict[str, Any] = dict(
        stopping=False, broken_epoch=3, started_epoch=3, out=False, patience_s=54.0
    )
    assert after_break(waited_s=53.9, rejoined=False, **waiting) is AfterBreak.WAIT
    assert after_break(waited_s=54.0, rejoined=False, **waiting) is AfterBreak.RESTART
    assert after_break(waited_s=600.0, rejoined=True, **waiting) is AfterBreak.WAIT
    newer: dict[str, Any] = {**waiting, "started_epoch": 4}
    assert after_break(waited_s=600.0, rejoined=False, **newer) is AfterBreak.FOLLOW


def test_a_refused_report_of_an_ended_plan_counts_the_node_out() -> None:
    ended = PeerRefused("coordinator h0:7070: FAILED_PRECONDITION: plan epoch 1 ended at step 40")
    assert counted_out(ended)
    assert not counted_out(PeerUnavailable("stream to b broke: Connection timed out"))
    assert not counted_out(PeerRefused("coordinator h0:7070: ABORTED: drop your work"))


def test_backoff_doubles_from_one_second_up_to_fifteen_with_jitter() -> None:
    backoff = Backoff(rng=random.Random(7))
    delays = [backoff.next_s() for _ in range(8)]
    for delay, cap in zip(delays, (1, 2, 4, 8, 15, 15, 15, 15), strict=True):
        assert cap / 2 <= delay <= cap
    assert len(set(delays)) == len(delays)  # jittered, not in step
    backoff.reset()
    assert 0.5 <= backoff.next_s() <= 1.0


# ----- the coordinator's restore that waits ---------------------------------------------------
async def test_a_restore_that_cannot_start_starts_when_a_returning_member_brings_the_blocks() -> (
    None
):
    """One pipeline a-b-c, no copies of b's blocks anywhere but b: b is cut off and counted
    lost; no step restores its blocks, and the coordinator keeps the restore pending (members
    hold their checkpoints) far past RESTORE_RETRY_LEASES. When b comes back and offers its
    checkpoint, the restore plan starts by itself at the newest step every block has."""
    clock = Clock()
    svc, plan = await planned_swarm(clock, "abc", steps=200, microbatches=4)
    ctx: Any = FakeContext()
    stage = {s.index: s for s in plan.stages}
    own = {s.node_id: [offer(plan, 20, s), offer(plan, 10, s)] for s in plan.stages}
    for step in range(1, 25):
        report = pb.StageReport(node_id=stage[2].node_id, stage=2, pipeline=0, plan_epoch=1,
                                step=step, loss=5.0 - step / 100)  # fmt: skip
        await svc.Report(report, ctx)
    victim = stage[1].node_id
    others = [n for n in "abc" if n != victim]
    held = dict.fromkeys(others, 0)
    lease_s = svc.roster.leases.lease_s
    # Two minutes of heartbeats from the others (ten times the old retry window).
    for _ in range(int(120 / 3)):
        clock.now += 3.0
        for node in others:
            held[node] = await beat(svc, node, own[node], held[node])
    assert 3 * recovery.RESTORE_RETRY_LEASES * lease_s < 120
    assert [c.node_id for c in svc.faults.crashes] == [victim]
    assert svc.plan is not None and svc.plan.epoch == 1 and svc.book.pending is None
    assert svc.faults.unrestored is not None  # still waiting, never given up
    assert set(held.values()) == {1}  # ... and the members keep holding their checkpoints
    # b is back: its first heartbeat is asked to hold, its second (held) completes step 20.
    asked = await beat(svc, victim, own[victim])
    assert asked == 1 and svc.plan.epoch == 1
    await beat(svc, victim, own[victim], held=1)
    new = svc.plan
    assert new is not None and new.epoch == 2 and new.restore and not new.pending
    assert new.start_step == 20
    holders = {(h.first_block, h.stop_block): h.node_id for h in new.previous}
    assert holders[(stage[1].first_block, stage[1].stop_block)] == victim
    assert svc.faults.unrestored is None and svc.faults.redone == 4 * 4  # steps 21-24
