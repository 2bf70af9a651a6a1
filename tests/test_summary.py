"""The run summary on its own: every figure from what the stages reported."""

from __future__ import annotations

from ravnest_node.coordination.coordinator.faults import Crash, FaultBook, Takeover
from ravnest_node.coordination.coordinator.progress import RunProgress
from ravnest_node.coordination.coordinator.summary import plan_entry, run_summary
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb

from .fakes import Clock


def test_the_summary_is_made_of_what_was_reported() -> None:
    clock = Clock()
    train = TrainConfig(model="tiny", steps=2, batch_size=16, microbatches=4)
    plan = pb.Plan(epoch=1, stages=[
        pb.StageAssignment(node_id="a", index=0, first_block=0, stop_block=2),
        pb.StageAssignment(node_id="b", index=1, first_block=2, stop_block=4),
    ])  # fmt: skip
    progress = RunProgress(train, clock)
    progress.start(clock.now, 1e9)
    progress.record_loss(0, 1, 5.0)
    progress.record_loss(0, 2, 4.0)
    progress.note(pb.StageReport(node_id="a", bytes_sent=100, checkpoint_step=2), (0, 0))
    progress.record_final(
        (0, 0),
        pb.StageReport(
            step=2, done=True, params_sq_sum=9.0, num_params=3, activation_bytes_sent=64
        ),
    )
    faults = FaultBook()
    faults.crashes.append(Crash("b", 0, 1, 1, 2))
    summary = run_summary(train=train, fingerprint="f", plan=plan, plans=[plan],
                          progress=progress, faults=faults, wall_s=2.0)  # fmt: skip
    assert list(summary)[:3] == ["system", "model", "nodes"] and list(summary)[-1] == "stages"
    assert summary["loss_history"] == [5.0, 4.0] and summary["final_loss"] == 4.0
    assert summary["samples"] == 32 and summary["samples_per_s"] == 16.0
    assert summary["bytes_on_wire"] == 100 and summary["activation_bytes_per_sample"] == 2.0
    assert summary["final_params_l2"] == 3.0 and summary["num_params"] == 3
    assert summary["crashes"] == [{"node_id": "b", "pipeline": 0, "stage": 1, "plan_epoch": 1,
                                   "after_step": 2}]  # fmt: skip
    assert summary["takeover"] is None and summary["data_fingerprint"] == "f"
    assert summary["dropped_microbatches"] == 0 and summary["restores"] == []
    assert summary["plans"] == [plan_entry(plan)]
    assert summary["plans"][0]["stages"] == [[0, 0, 0, 2, "a"], [0, 1, 2, 4, "b"]]
    assert summary["checkpoints"] == [{"pipeline": 0, "stage": 0, "node_id": "a", "step": 2}]
    first, second = summary["stages"]
    assert first["params_sq_sum"] == 9.0 and first["bytes_sent"] == 100
    assert second["lost"] and second["blocks"] == [2, 4]


def test_a_run_taken_over_says_so_and_starts_where_it_resumed() -> None:
    train = TrainConfig(model="tiny", steps=3, batch_size=16)
    plan = pb.Plan(epoch=4, stages=[pb.StageAssignment(node_id="b")])
    progress = RunProgress(train, Clock())
    progress.resumed_at = 1
    progress.record_loss(0, 2, 3.0)
    progress.record_loss(0, 3, 2.0)
    faults = FaultBook()
    faults.takeover = Takeover(term=2, plan_epoch=1, lost_coordinator=("a",), waiting=set())
    summary = run_summary(train=train, fingerprint="f", plan=plan, plans=[plan],
                          progress=progress, faults=faults, wall_s=0.0)  # fmt: skip
    assert summary["takeover"] == {"term": 2, "plan_epoch": 1, "lost_coordinator": ["a"]}
    assert summary["resumed_at"] == 1 and summary["loss_history"] == [3.0, 2.0]
    assert summary["samples"] == 32 and summary["samples_per_s"] != summary["samples_per_s"]
