"""The record of faults on its own: crashes, restores, takeovers as records, what is dropped
and redone, the offers a restore counts on; and the store's format of them."""

from __future__ import annotations

import pytest

from ravnest_node.coordination.coordinator.faults import (
    Crash,
    FaultBook,
    PendingRestore,
    Restore,
    Takeover,
)
from ravnest_node.coordination.coordinator.store import Faults
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.proto import control_pb2 as pb

# What the coordinator stored before its records were dataclasses (and still does, with the
# members banned after it: an empty list here).
STORED = (
    '{"crashes": [{"node_id": "b", "pipeline": 0, "stage": 1, "plan_epoch": 1, "after_step": 12}],'
    ' "lost": ["b"], "dropped": 8, "dropped_steps": {"1": [4, 5]}, "restores": [{"plan_epoch": 2,'
    ' "lost": ["b"], "after_step": 12, "restored_step": 10, "redone_microbatches": 8, "holders":'
    ' [[0, 2, "a"], [2, 4, "c"]]}, {"plan_epoch": 4, "lost": ["a"], "after_step": null,'
    ' "restored_step": 20, "redone_microbatches": 0, "holders": [[0, 4, "c"]]}], "redone": 8}'
)


def test_the_stored_record_reads_as_dataclasses_and_writes_back_the_same() -> None:
    faults = Faults.from_json(STORED)
    assert faults.crashes == [Crash("b", pipeline=0, stage=1, plan_epoch=1, after_step=12)]
    assert faults.restores == [
        Restore(plan_epoch=2, lost=("b",), after_step=12, restored_step=10,
                redone_microbatches=8, holders=((0, 2, "a"), (2, 4, "c"))),
        Restore(plan_epoch=4, lost=("a",), after_step=None, restored_step=20,
                redone_microbatches=0, holders=((0, 4, "c"),)),
    ]  # fmt: skip
    assert (faults.lost, faults.dropped, faults.dropped_steps, faults.redone) == (
        ["b"], 8, {1: [4, 5]}, 8,
    )  # fmt: skip
    assert faults.banned == []
    assert faults.to_json() == STORED[:-1] + ', "banned": []}'


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('"node_id": "b"', '"node_id": 3'),
        ('"stage": 1', '"stage": -1'),
        ('"after_step": 12}]', '"after_step": true}]'),
        ('"holders": [[0, 4, "c"]]', '"holders": [[0, 4]]'),
        ('"after_step": null', '"after_step": "x"'),
        ('"restored_step": 10, ', ""),
    ],
)
def test_a_malformed_record_is_refused(old: str, new: str) -> None:
    assert old in STORED
    with pytest.raises((TypeError, ValueError, KeyError)):
        Faults.from_json(STORED.replace(old, new, 1))


def _stage(node: str, pipeline: int, index: int) -> pb.StageAssignment:
    return pb.StageAssignment(node_id=node, pipeline=pipeline, index=index)


def test_crashes_say_who_was_lost_and_which_pipelines_broke() -> None:
    book = FaultBook()
    book.count_lost([_stage("b", 1, 0), _stage("c", 1, 1)], epoch=2, step=7)
    book.count_lost([_stage("a", 0, 0)], epoch=3, step=9)
    assert book.crashes[0] == Crash("b", 1, 0, 2, 7)
    assert book.lost_in(2) == {"b", "c"} and book.lost_in(3) == {"a"} and book.lost_in(1) == set()
    assert book.broken_in(2) == {1} and book.broken_in(3) == {0}


def test_dropped_steps_are_counted_and_a_restore_makes_later_ones_redone() -> None:
    book = FaultBook()
    assert book.count_dropped(1, last=3, stop=5, microbatches=4) == 8
    assert book.count_dropped(1, last=4, stop=7, microbatches=4) == 12  # it reported step 4
    assert book.count_dropped(0, last=9, stop=7, microbatches=4) == 0  # it was ahead
    assert book.dropped == 20 and book.dropped_steps == {1: [4, 5, 6, 7], 0: []}
    book.unrestored = PendingRestore(2, (), since=1.0)
    assert book.hold_epoch() == 2
    book.rolled_back(5)
    assert book.dropped_steps == {1: [4, 5], 0: []} and book.unrestored is None
    assert book.hold_epoch() == 0


def test_offers_count_once_held_and_well_formed() -> None:
    book = FaultBook()
    good = pb.CheckpointOffer(step=5, stop_block=4)
    book.note_offers("a", [good], held=0, num_blocks=4)
    book.note_offers("b", [good], held=2, num_blocks=4)
    assert book.offers == {"a": [good], "b": [good]} and book.held == {"a": 0, "b": 2}
    members = [Member("a", "a:1"), Member("b", "b:1"), Member("c", "c:1")]
    assert book.unheld(2, members) == ["a", "c"]
    book.note_offers("a", [pb.CheckpointOffer(step=5, stop_block=9)], held=2, num_blocks=4)
    assert "a" not in book.offers and book.held["a"] == 2  # still a heartbeat
    assert book.unheld(2, members) == ["c"]


def test_checkpoints_of_a_rolled_back_timeline_are_not_offered() -> None:
    book = FaultBook()
    book.restores.append(Restore(2, ("b",), 9, 4, 20, ()))
    stale = pb.CheckpointOffer(step=6, stop_block=4, plan_epoch=1)
    before = pb.CheckpointOffer(step=4, stop_block=4, plan_epoch=1)
    fresh = pb.CheckpointOffer(step=6, stop_block=4, plan_epoch=2)
    assert book.timeline([stale, before, fresh]) == [before, fresh]
    book.offers["a"] = [stale, fresh]
    assert book.offered() == {"a": [fresh]}


def test_records_as_the_summary_shows_them() -> None:
    assert Crash("b", 0, 1, 1, 12).to_dict() == {
        "node_id": "b", "pipeline": 0, "stage": 1, "plan_epoch": 1, "after_step": 12,
    }  # fmt: skip
    restore = Restore(2, ("b",), None, 10, 8, ((0, 2, "a"),))
    assert restore.to_dict()["holders"] == [[0, 2, "a"]]
    assert Restore.from_dict(restore.to_dict()) == restore
    takeover = Takeover(term=2, plan_epoch=1, lost_coordinator=("a",), waiting={"b"})
    assert takeover.to_dict() == {"term": 2, "plan_epoch": 1, "lost_coordinator": ["a"]}
