"""The lab coordinator: `ravnest-node coordinator --state-dir DIR` keeps membership, the plan
and progress in SQLite; restarted, it carries on and its nodes reattach."""

from __future__ import annotations

import json
import re
import signal
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path
from typing import Any

import grpc
import pytest

from ravnest_node.coordination.coordinator import bans
from ravnest_node.coordination.coordinator.faults import Ban, Revoked
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.coordination.coordinator.store import STORE_FILE, CoordinatorStore, Faults
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.errors import ConfigError
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import PROTOCOL
from tests.conftest import NODE_ENV, Procs, node_status, progress_events, ravnest
from tests.fakes import Aborted, Clock, FakeContext, capabilities, unproven

RUN = TrainConfig(model="bench-small", steps=2, batch_size=16)


def _service(state_dir: Path, clock: Clock, train: TrainConfig = RUN) -> CoordinatorService:
    return CoordinatorService(
        prove=unproven,
        train=train,
        swarm_size=2,
        swarm_id="lab/bench-small",
        summary_path=state_dir / "summary.json",
        clock=clock,
        store=CoordinatorStore(state_dir),
    )


async def _join(svc: CoordinatorService, node: str) -> None:
    request = pb.JoinRequest(node_id=node, address=f"{node}:1", protocol=PROTOCOL)
    request.capabilities.CopyFrom(capabilities())
    await svc.Join(request, FakeContext())  # type: ignore[arg-type]


def _report(node: str, stage: int, step: int, **kw: Any) -> pb.StageReport:
    return pb.StageReport(node_id=node, stage=stage, plan_epoch=1, step=step, **kw)


async def test_a_restarted_coordinator_resumes_members_plan_and_progress(tmp_path: Path) -> None:
    clock = Clock()
    svc = _service(tmp_path, clock)
    ctx: Any = FakeContext()
    await _join(svc, "a")
    await _join(svc, "b")
    plan = svc.plan
    assert plan is not None
    await svc.Report(_report("b", 1, 1, loss=5.0, bytes_sent=50), ctx)

    # The process dies here; a new one opens the same store.
    clock.now += 100.0
    again = _service(tmp_path, clock)
    assert again.plan == plan
    view = await again.Swarm(pb.SwarmRequest(), ctx)
    assert [m.node_id for m in view.members] == ["a", "b"]
    assert not any(m.lease_expired for m in view.members)  # a full lease to reattach
    assert view.step == 1
    # The retry of a report it already had changes nothing; the next step carries on.
    await again.Report(_report("b", 1, 1, loss=5.0, bytes_sent=50), ctx)
    with pytest.raises(Aborted) as info:  # a different report for a recorded step is refused
        await again.Report(_report("b", 1, 1, loss=4.5), ctx)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    await again.Report(_report("b", 1, 2, loss=4.0, bytes_sent=80), ctx)
    await again.Report(_report("a", 0, 2, done=True, num_params=3, bytes_sent=100), ctx)
    final_b = _report("b", 1, 2, done=True, num_params=4, bytes_sent=80)
    await again.Report(final_b, ctx)
    await again.Report(final_b, ctx)  # a retried final report too

    # And once more: the finished run's events replay from the store.
    third = _service(tmp_path, clock)
    events = [e async for e in third.WatchProgress(pb.WatchProgressRequest(), ctx)]
    assert [(e.step, e.loss) for e in events[:2]] == [(1, 5.0), (2, 4.0)] and events[-1].done
    summary = json.loads(events[-1].summary_json)
    assert summary["loss_history"] == [5.0, 4.0] and summary["bytes_on_wire"] == 180
    assert summary["num_params"] == 7


async def test_evictions_before_the_plan_are_kept(tmp_path: Path) -> None:
    clock = Clock()
    svc = _service(tmp_path, clock)
    await _join(svc, "a")
    await svc.Leave(pb.LeaveRequest(node_id="a"), FakeContext())  # type: ignore[arg-type]
    await _join(svc, "b")
    again = _service(tmp_path, clock)
    assert again.plan is None
    view = await again.Swarm(pb.SwarmRequest(), FakeContext())  # type: ignore[arg-type]
    assert [m.node_id for m in view.members] == ["b"]


def test_a_store_of_another_run_is_refused_and_left_alone(tmp_path: Path) -> None:
    _service(tmp_path, Clock())
    before = (tmp_path / STORE_FILE).read_bytes()
    with pytest.raises(ConfigError, match=r"another run \(it differs in steps\)"):
        _service(tmp_path, Clock(), TrainConfig(model="bench-small", steps=3, batch_size=16))
    assert (tmp_path / STORE_FILE).read_bytes() == before


def test_a_corrupt_store_is_refused(tmp_path: Path) -> None:
    (tmp_path / STORE_FILE).write_bytes(b"not a database, just bytes" * 100)
    with pytest.raises(ConfigError, match="not a coordinator store"):
        _service(tmp_path, Clock())
    (tmp_path / STORE_FILE).unlink()
    _service(tmp_path, Clock())
    with sqlite3.connect(tmp_path / STORE_FILE) as db:  # a plan that does not parse
        db.execute("INSERT OR REPLACE INTO meta VALUES ('plan', x'ffffffff')")
        db.execute("INSERT OR REPLACE INTO meta VALUES ('started_unix', 0)")
    with pytest.raises(ConfigError, match="corrupt coordinator store"):
        _service(tmp_path, Clock())


def test_the_coordinator_command_needs_a_state_dir(tmp_path: Path) -> None:
    result = subprocess.run(
        ravnest("coordinator", "--swarm-size", "2"),
        env=NODE_ENV, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "keeps its state in --state-dir" in result.stderr


def test_a_lab_coordinator_stopped_before_any_member_came_exits_cleanly(
    tmp_path: Path, procs: Procs
) -> None:
    # (It holds no stage and had planned nothing: once, its stop found no task to end and
    # failed with a traceback.)
    proc, _ = procs.start_node(tmp_path / "coord", "--swarm-size", "3", command="coordinator")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    log = (tmp_path / "coord" / "node.log").read_text()
    assert "Traceback" not in log


def test_a_killed_lab_coordinator_restarts_and_its_nodes_reattach(
    tmp_path: Path, procs: Procs
) -> None:
    steps = 300
    args = ("--swarm-size", "2", "--model", "tiny", "--steps", str(steps))
    coord_dir = tmp_path / "coordinator"
    coord, ready = procs.start_node(coord_dir, *args, command="coordinator")
    address = ready["address"]
    assert node_status(address).role == pb.NODE_ROLE_COORDINATOR
    workers = [procs.start_node(tmp_path / f"w{i}", "--join", address)[1] for i in range(2)]

    for event in progress_events(address):
        if event.step >= 5:
            break
    coord.send_signal(signal.SIGKILL)  # mid-run, without a word to anyone
    coord.wait(10)

    # Same state dir, same address; the workers trained on meanwhile.
    _, again = procs.start_node(coord_dir, *args, "--listen", address, command="coordinator")
    assert again["node_id"] == ready["node_id"]
    log = (coord_dir / "node.log").read_text()
    resumed = re.search(r"resumed from .*: 2 members, plan epoch 1, (\d+) steps reported", log)
    assert resumed is not None, log
    assert int(resumed.group(1)) < steps  # it really died mid-run
    done = [e for e in progress_events(address) if e.done]
    assert len(done) == 1 and not done[0].error
    summary = json.loads(done[0].summary_json)
    assert len(summary["loss_history"]) == steps
    assert all(isinstance(x, float) and x == x for x in summary["loss_history"])  # no gaps
    assert {s["node_id"] for s in summary["stages"]} == {w["node_id"] for w in workers}
    assert summary["final_loss"] < summary["initial_loss"]
    # Some reports waited for the restarted coordinator.
    worker_logs = [(tmp_path / f"w{i}" / "node.log").read_text() for i in range(2)]
    assert any("answers again" in text for text in worker_logs), worker_logs


async def test_a_switch_interrupted_by_a_restart_finishes(tmp_path: Path) -> None:
    clock = Clock()
    svc = _service(tmp_path, clock, TrainConfig(model="bench-small", steps=20, batch_size=16))
    ctx: Any = FakeContext()
    await _join(svc, "a")
    await _join(svc, "b")
    request = pb.JoinRequest(node_id="c", address="c:1", protocol=PROTOCOL)
    request.capabilities.CopyFrom(capabilities())
    await svc.Join(request, ctx)  # after the plan: a newer plan is announced, pending
    # Restarted before the switch: the pending plan was not stored; the first stage's drain
    # (retried) makes it again from the stored members.
    again = _service(tmp_path, clock, TrainConfig(model="bench-small", steps=20, batch_size=16))
    plans = again.WatchPlan(pb.WatchPlanRequest(node_id="a"), ctx)
    assert (await anext(plans)).epoch == 1
    reply = await again.Drain(pb.DrainRequest(node_id="a", plan_epoch=1, stop_step=3), ctx)
    assert reply.stop_step == 3
    pending, started = await anext(plans), await anext(plans)
    assert (pending.epoch, pending.pending, started.epoch, started.pending) == (2, True, 2, False)
    assert started.start_step == 3 and {s.node_id for s in started.stages} == {"a", "b", "c"}


async def test_a_restarted_coordinator_remembers_who_was_lost(tmp_path: Path) -> None:
    """A member lost mid-run stays lost across a restart (it gets no stage until it joins
    again), with the record of its crash; once it has joined again, it is a member again."""
    clock = Clock()
    svc = _service(tmp_path, clock)
    ctx: Any = FakeContext()
    await _join(svc, "a")
    await _join(svc, "b")
    for _ in range(9):  # b falls silent for 3 leases; a's heartbeats are the clock
        clock.now += svc.roster.leases.lease_s / 3
        await svc.Heartbeat(pb.HeartbeatRequest(node_id="a"), ctx)
    assert set(svc.roster.lost) == {"b"} and [c.node_id for c in svc.faults.crashes] == ["b"]

    again = _service(tmp_path, clock)
    assert set(again.roster.lost) == {"b"} and again.faults.crashes == svc.faults.crashes
    assert again.book.broken == {0}  # its pipeline lost a member under this plan
    plan = again.plan
    assert plan is not None
    assert [m.node_id for m in again.roster.staying({"a", "b"}, clock.now)] == ["a"]
    await _join(again, "b")  # b, restarted, joins again
    third = _service(tmp_path, clock)
    assert third.roster.lost == {} and [c.node_id for c in third.faults.crashes] == ["b"]


async def test_a_restarted_coordinator_still_refuses_the_banned(tmp_path: Path) -> None:
    """A member banned for failing an audit stays banned across a restart: its calls are
    refused, and every plan the restarted coordinator announces names it."""
    clock = Clock()
    svc = _service(tmp_path, clock)
    await _join(svc, "a")
    await _join(svc, "b")
    plan = svc.plan
    assert plan is not None
    suspect = next(s for s in plan.stages if s.node_id == "b")
    evidence = Ban("b", suspect.pipeline, suspect.index, plan.epoch, 0, auditor="a",
                   kind="input gradient", seq=5, version=1, distance=0.8,
                   recomputed=1.25)  # fmt: skip
    bans.ban(svc._state, plan, suspect, evidence)

    again = _service(tmp_path, clock)
    assert again.faults.banned == {"b": evidence}
    ctx: Any = FakeContext()
    rejoin = pb.JoinRequest(node_id="b", address="b:1", protocol=PROTOCOL)
    for call in (again.Heartbeat(pb.HeartbeatRequest(node_id="b"), ctx), again.Join(rejoin, ctx)):
        with pytest.raises(Aborted) as refused:
            await call
        assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
        assert "banned from this swarm" in refused.value.details
    assert again._state.book.announcements[-1].banned == ["b"]
    await again.Heartbeat(pb.HeartbeatRequest(node_id="a"), ctx)  # a is a member still


def test_bans_and_revocations_are_stored_as_they_were() -> None:
    banned: list[Ban | Revoked] = [
        Ban("n1", 0, 2, 3, 17, "n2", "activation", 68, 16, 0.31, 0.29),
        Revoked("n3", serial=4, after_step=20),
    ]
    faults = Faults(banned=banned)
    assert Faults.from_json(faults.to_json()).banned == banned
    older = json.loads(faults.to_json())
    del older["banned"]  # a store written before bans were kept
    assert Faults.from_json(json.dumps(older)).banned == []


@pytest.mark.parametrize(
    "entry",
    [{"node_id": "n3", "after_step": 2}, {"node_id": "n3", "serial": "4", "after_step": 2},
     {**Ban("n1", 0, 2, 3, 17, "n2", "activation", 68, 16, 0.31, 0.29).to_dict(),
      "distance": "far"}],
)  # fmt: skip
def test_a_corrupt_ban_in_the_store_is_refused(tmp_path: Path, entry: dict[str, Any]) -> None:
    _service(tmp_path, Clock())
    faults = json.loads(Faults().to_json())
    faults["banned"] = [entry]
    with closing(sqlite3.connect(tmp_path / STORE_FILE)) as db, db:
        db.execute("INSERT OR REPLACE INTO meta VALUES ('faults', ?)", (json.dumps(faults),))
    with pytest.raises(ConfigError, match="corrupt coordinator store"):
        _service(tmp_path, Clock())


def test_a_corrupt_record_of_faults_is_refused(tmp_path: Path) -> None:
    _service(tmp_path, Clock())
    with closing(sqlite3.connect(tmp_path / "coordinator.sqlite3")) as db, db:
        db.execute("INSERT OR REPLACE INTO meta VALUES ('faults', ?)",
                   ('{"crashes": [{"node_id": 3}], "lost": [], "dropped": 0, '
                    '"dropped_steps": {}, "restores": [], "redone": 0}',))  # fmt: skip
    with pytest.raises(ConfigError, match="corrupt coordinator store"):
        _service(tmp_path, Clock())


def test_the_store_writes_only_the_member_rows_that_changed_and_reads_back_the_list(
    tmp_path: Path,
) -> None:
    store = CoordinatorStore(tmp_path)
    store.create(run=RUN.to_proto(""), swarm_id="lab/bench-small", swarm_size=4)
    members = [Member(f"{i:016x}", f"10.0.0.{i}:1") for i in range(4)]
    caps = {members[1].node_id: capabilities()}
    writes: list[int] = []
    for n in range(1, 5):  # joins, one at a time; then the second's capabilities
        store.save_members(members[:n], {})
    store.save_members(members, caps)
    # An eviction before the plan: everyone after the first moves up a place.
    left = [members[0], *members[2:]]
    store.save_members(left, caps)
    store._db.set_trace_callback(lambda sql: writes.append(sql.startswith("INSERT")))
    store.save_members(left, caps)  # nothing changed: nothing written
    assert sum(writes) == 0
    store.close()
    again = CoordinatorStore(tmp_path).load()
    assert again.members == left and again.capabilities == {}
