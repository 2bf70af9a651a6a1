"""The plan book on its own: phases, pending and previous plans, drains, ends, broken
pipelines."""

from __future__ import annotations

import grpc
import pytest

from ravnest_node.coordination.coordinator.planbook import Phase, PlanBook
from ravnest_node.coordination.planning.placement import SwarmPlan
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.errors import Refusal

PLACED = SwarmPlan(stages=(), spare=(), step_s=1.0, exact=True)


def _plan(epoch: int, nodes: str = "ab", pipelines: int = 1, start: int = 0) -> pb.Plan:
    """A plan of `pipelines` pipelines over the nodes of `nodes` (one letter, one stage)."""
    per = len(nodes) // pipelines
    stages = [
        pb.StageAssignment(node_id=n, address=f"{n}:1", pipeline=i // per, index=i % per)
        for i, n in enumerate(nodes)
    ]
    return pb.Plan(epoch=epoch, stages=stages, start_step=start)


def test_a_plan_is_published_announced_drained_and_switched_to() -> None:
    book = PlanBook(first_epoch=3)
    assert book.phase is Phase.FORMING and book.first_epoch == 3
    first = _plan(3, "abcd", pipelines=2)
    book.adopt(first, PLACED)
    assert book.phase is Phase.RUNNING and book.current is first
    assert book.next_epoch(first) == 4
    new = _plan(4, "abcdef", pipelines=2)
    new.pending = True
    book.announce(new, PLACED, keep_drains=False)
    assert book.phase is Phase.ANNOUNCED and book.pending is new
    assert book.next_epoch(first) == 5  # after the pending one
    book.drains[0] = 7
    assert not book.drained(2)
    book.drains[1] = 9
    assert book.drained(2)
    switched, placed, stop, broken = book.switch(first.epoch)
    assert (switched, placed, stop, broken) == (new, PLACED, 9, [])
    assert book.phase is Phase.RUNNING and book.pending is None and book.drains == {}
    assert book.ends == {3: 9}
    new.pending = False
    book.previous = first
    book.adopt(new, PLACED)
    assert [(p.epoch, p.pending) for p in book.announcements] == [(3, False), (4, True),
                                                                   (4, False)]  # fmt: skip
    assert [p.epoch for p in book.started()] == [3, 4]
    new.start_step = 99  # announcements are copies as they were then
    assert book.announcements[-1].start_step == 0


def test_reports_of_the_previous_plan_count_up_to_its_end() -> None:
    book = PlanBook()
    with pytest.raises(Refusal, match="unknown plan"):
        book.plan_of_report(1, 1, done=False)
    old, new = _plan(1), _plan(2, start=5)
    book.adopt(old, PLACED)
    assert book.plan_of_report(1, 3, done=False) is old
    book.ends[1], book.previous = 5, old
    book.adopt(new, PLACED)
    assert book.plan_of_report(1, 5, done=False) is old
    assert book.plan_of_report(2, 6, done=True) is new
    for step, done in ((6, False), (5, True)):
        with pytest.raises(Refusal, match="plan epoch 1 ended at step 5") as info:
            book.plan_of_report(1, step, done=done)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(Refusal, match="unknown plan"):
        book.plan_of_report(3, 6, done=False)


def test_broken_pipelines_are_not_waited_for_and_switch_broken() -> None:
    book = PlanBook()
    plan = _plan(1, "abcd", pipelines=2)
    book.adopt(plan, PLACED)
    book.announce(_plan(2, "ac"), PLACED, keep_drains=False)
    book.drains = {0: 4, 1: 5}
    book.break_pipelines(1, {1})
    assert book.drains == {0: 4} and book.is_dropped(1, 1) and not book.is_dropped(1, 0)
    assert book.drained(2)  # the healthy pipeline has
    _, _, stop, broken = book.switch(1)
    assert (stop, broken, book.broken) == (4, [1], set())
    book.break_pipelines(1, {0, 1})
    assert not book.drained(2)  # nobody healthy to drain


def test_a_pending_plan_dropped_is_made_again_with_the_same_epoch() -> None:
    book = PlanBook()
    plan = _plan(1)
    book.adopt(plan, PLACED)
    book.announce(_plan(2), PLACED, keep_drains=False)
    book.drains[0] = 3
    book.drop_pending()
    assert book.phase is Phase.RUNNING and book.next_epoch(plan) == 2
    book.announce(_plan(2), PLACED, keep_drains=True)
    assert book.drains == {0: 3}


def test_a_restore_ends_the_plan_for_every_pipeline() -> None:
    book = PlanBook()
    book.adopt(_plan(1, "abcd", pipelines=2), PLACED)
    book.announce(_plan(2), PLACED, keep_drains=False)
    book.drains, book.broken = {0: 3}, {1}
    book.end_at(1, 10, pipelines=2)
    assert book.ends == {1: 10} and book.is_dropped(1, 0) and book.is_dropped(1, 1)
    assert (book.pending, book.drains, book.broken) == (None, {}, set())
    assert book.phase is Phase.RUNNING


def test_the_last_plan_stays_the_last() -> None:
    """Once the run ends under the current plan, nothing makes the phase move again (a plan
    announced before stays pending, not started)."""
    book = PlanBook()
    book.adopt(_plan(1), PLACED)
    book.announce(_plan(2), PLACED, keep_drains=False)
    book.close()
    assert book.phase is Phase.LAST and book.pending is not None
    book.drop_pending()
    book.adopt(_plan(3), PLACED)
    assert book.phase is Phase.LAST


def test_a_plan_taken_over_waits_and_later_epochs_start_above_what_members_knew() -> None:
    book = PlanBook()
    plan = _plan(4)
    book.take_over(plan, known_epoch=6)
    assert book.phase is Phase.TAKING_OVER and book.current is plan
    assert book.next_epoch(plan) == 7
    book.raise_floor(9)
    book.raise_floor(8)
    assert book.next_epoch(plan) == 10
    book.takeover_done()
    assert book.phase is Phase.RUNNING


def test_a_store_resumes_the_current_plan_with_its_broken_pipelines() -> None:
    book = PlanBook()
    book.resume(_plan(2, "abcd", pipelines=2), {1})
    assert book.phase is Phase.RUNNING and book.broken == {1} and book.is_dropped(2, 1)
    other = PlanBook()
    other.resume(_plan(2), set())
    assert other.broken_in == {} and len(other.announcements) == 1
