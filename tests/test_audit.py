"""Audited computation, the pure part (pipeline/audit.py): which frames are drawn, the record a
stage keeps of a microbatch, and the recomputation an auditor runs from it: an honest stage
passes, every lie fails, a record that does not fit the model is refused. Across processes:
tests/test_audit_live.py."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.errors import FrameError
from ravnest_node.models import get_model
from ravnest_node.pipeline.audit import (
    TOLERANCE,
    AuditDraw,
    AuditRecord,
    StageBlocks,
    auditable,
    distance,
    received_bytes,
    received_tensor,
)
from ravnest_node.pipeline.auditor import LINK_SHARE, Auditor, RecordBudget
from ravnest_node.pipeline.compute import StageCompute
from ravnest_node.pipeline.lies import LIES, lie
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import GRAD, HIDDEN, TARGETS, TOKENS, StageSpec
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import PROTOCOL
from ravnest_node.transport.frames import FrameLimits, parse_frame

from .fakes import Aborted, Clock, FakeContext, capabilities, join, unproven

LIMITS = FrameLimits(max_message_bytes=64 << 20)


def test_one_frame_of_each_window_is_drawn_where_the_sender_cannot_know() -> None:
    draw = AuditDraw(0.02, random.Random(0))
    assert draw.window == 50
    picks = [[draw.draw() for _ in range(50)] for _ in range(40)]
    assert all(sum(window) == 1 for window in picks)
    places = {window.index(True) for window in picks}
    assert len(places) > 20  # anywhere in the window, not one place every time
    assert not draw.again_drawn
    draw.again()
    assert draw.draw() and draw.again_drawn  # the re-check: the next frame too
    draw.draw()
    assert not draw.again_drawn
    assert not any(AuditDraw(0.0).draw() for _ in range(1000))
    assert all(AuditDraw(1.0).draw() for _ in range(10))
    assert auditable("int4-block") and not auditable("topk-ef")


def _sent(message: Any) -> torch.Tensor:
    """The one tensor of an encoded frame (a future's result)."""
    tensors = parse_frame(message.result(), LIMITS).decode()
    return tensors[GRAD] if GRAD in tensors else tensors[HIDDEN]


def _three_stages(pool: ThreadPoolExecutor, **run_args: Any) -> tuple[list[StageCompute], Any]:
    run = TrainConfig(model="tiny", batch_size=4, microbatches=2, codec="none", **run_args)
    model = get_model("tiny")
    cuts = [(0, 1), (1, 3), (3, 4)]
    stages = []
    for i, (a, b) in enumerate(cuts):
        spec = StageSpec(index=i, num_stages=3, first_block=a, stop_block=b)
        blocks = model.build_stage(run.seed, a, b)
        stages.append(StageCompute(spec=spec, model=model, blocks=blocks, run=run, executor=pool))
    return stages, StageBlocks(model, run.seed, microbatches=2, loss_scale=1.0)


def _one_microbatch(stages: list[StageCompute]) -> dict[str, torch.Tensor]:
    """Microbatch 0 through three stages; what each boundary carried."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 32), generator=gen)
    targets = torch.randint(0, 256, (2, 32), generator=gen)
    first, middle, last = stages
    a1 = _sent(first.forward(0, 0, {HIDDEN: tokens, TARGETS: targets}, ()))
    a2 = _sent(middle.forward(0, 0, {HIDDEN: a1, TARGETS: targets}, ()))
    g2 = _sent(last.forward_loss_backward(0, 0, {HIDDEN: a2, TARGETS: targets}))
    _, g1 = middle.backward(0, g2)
    assert g1 is not None
    first.backward(0, _sent(g1))
    return {"a1": a1, "a2": a2, "g2": g2, "g1": _sent(g1)}


def _audit(stage: StageCompute, blocks: StageBlocks, backward: bool, got: torch.Tensor) -> float:
    assert stage.records is not None
    record = stage.records.get(backward, 0)
    assert record is not None
    again = AuditRecord.from_bytes(record.to_bytes())  # as it travels
    return distance(got, blocks.recompute(again))


def test_an_honest_stage_passes_every_audit() -> None:
    with ThreadPoolExecutor(1) as pool:
        stages, blocks = _three_stages(pool)
        sent = _one_microbatch(stages)
        first, middle, last = stages
        # Each stage's activations and its input's gradient, recomputed with the weights as
        # they travel (int8-block): within 1-2% here, far inside the tolerance.
        assert _audit(first, blocks, False, sent["a1"]) < 0.05
        assert _audit(middle, blocks, False, sent["a2"]) < 0.05
        assert _audit(middle, blocks, True, sent["g1"]) < 0.05
        assert _audit(last, blocks, True, sent["g2"]) < 0.05
        assert first.records is not None and first.records.get(True, 0) is None  # sends none


@pytest.mark.parametrize("kind", LIES)
def test_a_lying_stage_fails(kind: str) -> None:
    with ThreadPoolExecutor(1) as pool:
        stages, blocks = _three_stages(pool, fault_lie_stage=1, fault_lie_kind=kind)
        sent = _one_microbatch(stages)
        middle = stages[1]
        assert _audit(middle, blocks, False, sent["a2"]) >= 2 * TOLERANCE
        assert _audit(middle, blocks, True, sent["g1"]) >= 2 * TOLERANCE
        assert _audit(stages[2], blocks, True, sent["g2"]) < 0.05  # the honest neighbour


def test_records_are_kept_for_recent_microbatches_only_and_not_without_audits() -> None:
    with ThreadPoolExecutor(1) as pool:
        stages, _ = _three_stages(pool)
        records = stages[0].records
        assert records is not None
        tokens = torch.zeros(2, 32, dtype=torch.long)
        for seq in range(12):
            stages[0].forward(seq, seq // 2, {HIDDEN: tokens, TARGETS: tokens}, ()).result()
        # a step's worth (2 microbatches) kept: at most one weight snapshot beyond the stash
        assert records.get(False, 11) is not None and records.get(False, 10) is not None
        assert records.get(False, 9) is None and len(records) == 2
        quiet, _ = _three_stages(pool, audit_share=0.0)
        assert quiet[0].records is None


def test_a_record_that_does_not_fit_is_refused() -> None:
    with ThreadPoolExecutor(1) as pool:
        stages, blocks = _three_stages(pool)
        _one_microbatch(stages)
        assert stages[1].records is not None
        record = stages[1].records.get(False, 0)
        assert record is not None
    with pytest.raises(FrameError, match="does not parse"):
        AuditRecord.from_bytes(b"\x00" * 64)
    with pytest.raises(FrameError, match="does not parse"):
        AuditRecord.from_bytes(received_bytes(torch.ones(3)))  # no metadata
    narrowed = {k: v[..., :1] for k, v in record.weights.items()}
    wrong = {
        "range": AuditRecord(False, 0, 0, 3, 9, record.inputs, record.weights),
        "names": AuditRecord(False, 0, 0, 2, 3, record.inputs, record.weights),
        "shape": AuditRecord(False, 0, 0, 1, 3, record.inputs, narrowed),
        "backward": AuditRecord(True, 0, 0, 1, 3, record.inputs, record.weights),
    }
    for why, bad in wrong.items():
        with pytest.raises(FrameError, match="audit record"):
            blocks.recompute(AuditRecord.from_bytes(bad.to_bytes()))
            pytest.fail(why)
    assert torch.equal(received_tensor(received_bytes(torch.ones(3))), torch.ones(3))
    with pytest.raises(FrameError):
        received_tensor(record.to_bytes())
    assert distance(torch.ones(3), torch.ones(4)) == float("inf")


# ----- the coordinator's side: the third recomputation, the ban -------------------------------
def _stage_record(run: TrainConfig, stage: pb.StageAssignment, lie_kind: str | None) -> Any:
    """An audit report's evidence for `stage`'s activation of microbatch 0: its record, and
    what its downstream received (the honest output, or a lie of it)."""
    model = get_model(run.model)
    spec = StageSpec(index=stage.index, num_stages=3, first_block=stage.first_block,
                     stop_block=stage.stop_block)  # fmt: skip
    blocks = model.build_stage(run.seed, stage.first_block, stage.stop_block)
    with ThreadPoolExecutor(1) as pool:
        compute = StageCompute(spec=spec, model=model, blocks=blocks, run=run, executor=pool)
        x = torch.randn(run.microbatch_size, 32, 64)  # tiny's hidden width
        y = torch.zeros(run.microbatch_size, 32, dtype=torch.long)
        sent = _sent(compute.forward(0, 0, {HIDDEN: x, TARGETS: y}, ()))
        assert compute.records is not None
        record = compute.records.get(False, 0)
    assert record is not None
    received = sent if lie_kind is None else lie(sent, lie_kind)
    return record.to_bytes(), received_bytes(received)


async def test_the_coordinator_recomputes_a_report_and_bans_only_a_liar(tmp_path: Path) -> None:
    run = TrainConfig(model="tiny", steps=50, batch_size=4, microbatches=2, codec="none")
    svc = CoordinatorService(prove=unproven, train=run, swarm_size=3, swarm_id="t/tiny",
                             summary_path=tmp_path / "summary.json", clock=Clock())  # fmt: skip
    for node in "abc":
        await join(svc, node, caps=capabilities(blocks=4))
    plan = svc.plan
    assert plan is not None
    by_index = {s.index: s for s in plan.stages}
    up, mid, down = (by_index[i].node_id for i in range(3))
    ctx: Any = FakeContext()

    def report(by: str, about: str, evidence: tuple[bytes, bytes]) -> pb.AuditReport:
        return pb.AuditReport(node_id=by, plan_epoch=plan.epoch, suspect_id=about,
                              record=evidence[0], received=evidence[1], distance=1.0)  # fmt: skip

    honest = _stage_record(run, by_index[1], None)
    lying = _stage_record(run, by_index[1], "rotate")
    # An activation is sent downstream: only the stage after may report it.
    with pytest.raises(Aborted) as refused:
        await svc.ReportAudit(report(up, mid, lying), ctx)
    assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(Aborted) as refused:
        await svc.ReportAudit(report(down, mid, (b"junk", lying[1])), ctx)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    # An auditor whose evidence recomputes within the tolerance bans nobody.
    reply = await svc.ReportAudit(report(down, mid, honest), ctx)
    assert not reply.banned and reply.distance < 0.05
    assert json.dumps(svc._state.faults.banned) == "{}"
    # The evidence of a lie is recomputed here too, and the liar banned.
    reply = await svc.ReportAudit(report(down, mid, lying), ctx)
    assert reply.banned and reply.distance > 1.0
    ban = svc._state.faults.banned[mid].to_dict()
    assert (ban["stage"], ban["auditor"], ban["kind"]) == (1, down, "activation")
    again = pb.JoinRequest(node_id=mid, address="b:1", protocol=PROTOCOL)
    for call in (svc.Heartbeat(pb.HeartbeatRequest(node_id=mid), ctx), svc.Join(again, ctx)):
        with pytest.raises(Aborted) as refused:
            await call
        assert refused.value.code is grpc.StatusCode.PERMISSION_DENIED
        assert "banned from this swarm" in refused.value.details
    await svc.Heartbeat(pb.HeartbeatRequest(node_id=up), ctx)  # the others are members still


async def test_the_coordinators_own_node_banned_trains_no_more_and_coordinates_on(
    tmp_path: Path,
) -> None:
    run = TrainConfig(model="tiny", steps=50, batch_size=4, microbatches=2, codec="none")
    svc = CoordinatorService(prove=unproven, train=run, swarm_size=3, swarm_id="t/tiny",
                             summary_path=tmp_path / "summary.json", clock=Clock(),
                             node_id="b")  # fmt: skip
    for node in "abc":
        await join(svc, node, caps=capabilities(blocks=4))
    plan = svc.plan
    assert plan is not None
    by_index = {s.index: s for s in plan.stages}
    assert [by_index[i].node_id for i in range(3)] == ["a", "b", "c"]  # (equal members: in order)
    record, received = _stage_record(run, by_index[1], "negate")
    report = pb.AuditReport(node_id="c", plan_epoch=plan.epoch, suspect_id="b", record=record,
                            received=received, distance=2.0)  # fmt: skip
    ctx: Any = FakeContext()
    assert (await svc.ReportAudit(report, ctx)).banned
    await svc.Heartbeat(pb.HeartbeatRequest(node_id="b"), ctx)  # not refused: it coordinates
    assert all("b" not in p.banned for p in svc._state.book.announcements)


def test_a_model_that_carries_token_ids_is_audited_honestly() -> None:
    """small-subspace's blocks take the token ids beside the residual stream: the records
    keep them (the first stage's input is the ids themselves, one tensor), forward and
    backward, and the recomputation passes them on."""
    run = TrainConfig(model="small-subspace", batch_size=4, microbatches=2, codec="none")
    model = get_model(run.model)
    cuts = [(0, 2), (2, 4), (4, model.num_blocks())]
    with ThreadPoolExecutor(1) as pool:
        stages = []
        for i, (a, b) in enumerate(cuts):
            spec = StageSpec(index=i, num_stages=3, first_block=a, stop_block=b)
            built = model.build_stage(run.seed, a, b)
            compute = StageCompute(spec=spec, model=model, blocks=built, run=run, executor=pool)
            stages.append(compute)
        first, middle, last = stages
        blocks = StageBlocks(model, run.seed, microbatches=2, loss_scale=1.0)
        tokens = torch.randint(0, 256, model.input_spec(2).shape)
        a1 = _sent(first.forward(0, 0, {HIDDEN: tokens, TARGETS: tokens}, ()))
        a2 = _sent(middle.forward(0, 0, {HIDDEN: a1, TARGETS: tokens, TOKENS: tokens}, ()))
        g2 = _sent(last.forward_loss_backward(0, 0, {HIDDEN: a2, TARGETS: tokens, TOKENS: tokens}))
        _, g1 = middle.backward(0, g2)
        assert g1 is not None
        for stage, backward, got in ((first, False, a1), (middle, False, a2),
                                     (middle, True, _sent(g1)), (last, True, g2)):  # fmt: skip
            assert _audit(stage, blocks, backward, got) < 0.05


def test_records_take_at_most_their_share_of_the_link() -> None:
    budget = RecordBudget(expected=100_000)
    mbit = 8e6  # 1 MB/s: records may take LINK_SHARE of it, 20 KB/s
    assert LINK_SHARE * mbit / 8 == 20_000
    assert not budget.take(mbit, 0.0)  # nothing saved up yet
    assert not budget.take(mbit, 4.0)  # 80 KB
    assert budget.take(mbit, 5.0)  # 100 KB: one record's worth, set aside
    assert not budget.take(mbit, 5.0)
    budget.fetched(50_000, reserved=True, seconds=0.0)  # smaller than expected: the rest back
    assert budget.expected == 50_000 and budget.take(mbit, 5.0)
    budget.fetched(50_000, reserved=False, seconds=0.0)  # a check again after a failure
    assert not budget.take(mbit, 7.0)  # 40 KB of the 50 KB the next record needs
    assert budget.take(mbit, 10.0)
    assert all(RecordBudget(expected=10**9).take(None, t) for t in range(3))  # unmeasured link


def test_an_unmeasured_link_is_budgeted_at_the_rate_its_last_record_came() -> None:
    """A fixed codec's link is not probed: its first record is fetched unbudgeted, the next
    ones at LINK_SHARE of the rate that one came at (at 10 Mbit/s a record of bench-small's
    2.2 MB about every 90 s, not as often as they are drawn)."""
    budget = RecordBudget(expected=100_000)
    assert budget.take(None, 0.0)  # nothing known: the first goes
    budget.fetched(100_000, reserved=True, seconds=0.08)  # 100 KB in 80 ms: 10 Mbit/s
    assert budget.fetched_bps == pytest.approx(10e6)
    rate = LINK_SHARE * 10e6 / 8
    assert not budget.take(None, 1.0)  # budgeted from now on
    assert not budget.take(None, 1.0 + 0.9 * 100_000 / rate)
    assert budget.take(None, 1.0 + 1.01 * 100_000 / rate)
    assert budget.take(8e9, 1e6)  # a measured bandwidth, where there is one, stands first


async def test_an_auditor_spaces_its_audits_to_the_links_budget() -> None:
    run = TrainConfig(model="tiny", audit_share=1.0)  # every frame drawn
    fetched: list[int] = []

    async def fetch(backward: bool, seq: int) -> bytes:
        fetched.append(seq)
        raise ConnectionError("no record")  # (counted unanswered: no recomputation here)

    async def report(*_: object) -> None:
        raise AssertionError("nothing is reported")

    now = [0.0]
    auditor = Auditor(run, get_model("tiny"), fetch_upstream=fetch, fetch_downstream=None,
                      report=report)  # fmt: skip
    auditor.budget(lambda backward: 1e6, first_bytes=10_000, clock=lambda: now[0])  # 2.5 KB/s
    got = torch.zeros(2, 3)
    for seq in range(10):
        auditor.consider(False, seq, got, "none")
    now[0] = 4.0  # 10 KB saved up: one audit
    for seq in range(10, 20):
        auditor.consider(False, seq, got, "none")
    await asyncio.gather(*auditor._tasks)
    assert fetched == [10]
    assert auditor.counts.skipped == 19 and auditor.counts.unanswered == 1
    auditor.consider(True, 0, got, "none")  # no downstream to audit: nothing drawn
    assert auditor.counts.skipped == 19
    auditor._draws[False].again()  # as after a failed audit: the check again is not let go
    auditor.consider(False, 20, got, "none")
    await asyncio.gather(*auditor._tasks)
    assert fetched == [10, 20] and auditor.counts.skipped == 19
