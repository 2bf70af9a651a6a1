"""The stages' reports and the run's end: a report (`Report`) becomes progress, a broken
pipeline's untrained steps are dropped and counted, and once every stage of the last plan has
sent its final report the run summary is written and the last event made. Pure decisions on a
`SwarmState`; a refusal is a `Refusal` (service.py answers it with its status)."""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc

from ravnest_node.coordination.coordinator.progress import StageKey
from ravnest_node.coordination.coordinator.summary import run_summary
from ravnest_node.coordination.coordinator.swarm_state import SwarmState
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.state import write_atomic
from ravnest_node.transport.errors import Refusal

__all__ = ["drop_steps", "finish_if_done", "report", "summary"]

log = logging.getLogger(__name__)


def report(s: SwarmState, request: pb.StageReport) -> bool:
    """Record a stage's report. False if it is a retry of one already recorded (its reply was
    lost, or this coordinator restarted from its store after answering): nothing changed.
    Refusal if its plan or stage is not its sender's, or it does not fit the run."""
    plan = s.book.plan_of_report(request.plan_epoch, request.step, request.done)
    owner = _owners(plan).get(request.node_id)
    if owner is None or (owner.pipeline, owner.index) != (request.pipeline, request.stage):
        raise Refusal(
            grpc.StatusCode.PERMISSION_DENIED,
            f"node {request.node_id!r} does not own stage {request.stage} of pipeline "
            f"{request.pipeline}",
        )
    key = (owner.pipeline, owner.index)
    last = len(plan.stages) // s.train.pipelines - 1
    progress = s.progress
    if progress.is_repeat(request, key, last):
        return False
    events_before = len(progress.events)
    progress.note(request, key)
    if request.done:
        progress.record_final(key, request)
        finish_if_done(s, plan)
    elif owner.index == last:
        progress.record_loss(owner.pipeline, request.step, request.loss)
    _save_report(s, request, key, last, events_before)
    return True


_OWNERS: list[tuple[pb.Plan, int, dict[str, pb.StageAssignment]]] = []
"""The last plans asked about, with each node's first stage in them (every report asks)."""


def _owners(plan: pb.Plan) -> dict[str, pb.StageAssignment]:
    """Node id -> its (first) stage in `plan`."""
    for held, epoch, owners in _OWNERS:
        if held is plan and epoch == plan.epoch and len(owners) <= len(plan.stages):
            return owners
    owners = {}
    for st in plan.stages:
        owners.setdefault(st.node_id, st)
    _OWNERS[:] = [*_OWNERS[-1:], (plan, plan.epoch, owners)]  # the current and the previous
    return owners


def _save_report(
    s: SwarmState, request: pb.StageReport, key: StageKey, last: int, events_before: int
) -> None:
    if s.store is None:
        return
    events = s.progress.events
    s.store.save_report(
        node_id=request.node_id,
        bytes_sent=s.progress.bytes_sent[request.node_id],
        loss=None if request.done or key[1] != last else (key[0], request.step, request.loss),
        final=(*key, request) if request.done else None,
        events=[(i, events[i]) for i in range(events_before, len(events))],
    )


def finish_if_done(s: SwarmState, plan: pb.Plan) -> None:
    """The run is done once every stage of its last plan has sent its final report, but
    for the stages of a pipeline that lost a member in that plan (they never will)."""
    progress = s.progress
    if progress.done():
        return
    broken = s.faults.broken_in(plan.epoch)
    if not all((st.pipeline, st.index) in progress.finals or st.pipeline in broken
               for st in plan.stages):  # fmt: skip
        return
    for p in sorted(broken):  # a pipeline lost in the last plan: its other steps dropped
        drop_steps(s, plan, p, s.train.steps)
    progress.complete_steps()
    progress.events.append(_finish(s, plan))


def drop_steps(s: SwarmState, plan: pb.Plan, pipeline: int, stop: int) -> None:
    """Broken `pipeline` of `plan` trains no step up to `stop`: the steps after its last
    report are dropped (NaN, left out of the mean) and counted; steps it reported past
    `stop` (it was ahead) go too."""
    last = s.progress.drop_steps(pipeline, plan.start_step, stop)
    dropped = s.faults.count_dropped(pipeline, last, stop, s.train.microbatches)
    if s.store is not None:
        s.store.forget_losses(pipeline, after=stop)
    s.save_faults()
    log.warning("pipeline %d of plan epoch %d broke after step %d: %d microbatches of "
                "steps %d to %d dropped", pipeline, plan.epoch, last, dropped, last + 1,
                stop)  # fmt: skip


def summary(s: SwarmState, plan: pb.Plan) -> dict[str, Any]:
    """The run summary, ending under `plan`; every figure comes from what the stages
    reported."""
    return run_summary(
        train=s.train, fingerprint=s.fingerprint, plan=plan, plans=s.book.started(),
        progress=s.progress, faults=s.faults, wall_s=s.clock() - s.progress.started_at,
    )  # fmt: skip


def _finish(s: SwarmState, plan: pb.Plan) -> pb.Progress:
    """The run's last event, its summary written to `summary_path` too."""
    result = summary(s, plan)
    if s.summary_path is not None:
        write_atomic(s.summary_path, json.dumps(result, indent=2).encode())
    event = s.progress.event(s.train.steps, result["final_loss"])
    event.done = True
    event.summary_json = json.dumps(result)
    return event
