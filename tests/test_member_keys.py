"""Member keys (coordination/coordinator/member_keys.py): a call that speaks for a member must
carry that member's key; a stranger who knows a member's id cannot make it leave, report,
drain, suspect, beat or join in its place, and nothing changes when it tries. The keys outlive a
coordinator restart (the store) and a failover (plans carry their digests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from ravnest_node.coordination.coordinator.member_keys import MemberKeys, key_of
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.coordination.coordinator.store import CoordinatorStore
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import MEMBER_KEY_METADATA, PROTOCOL, member_key_digest
from ravnest_node.state import load_or_create_member_key
from ravnest_node.transport.errors import Refusal

from .fakes import Aborted, Clock, FakeContext, join

RUN = TrainConfig(model="bench-small", steps=4, batch_size=16)


def _service(clock: Clock, store: CoordinatorStore | None = None) -> CoordinatorService:
    return CoordinatorService(
        train=RUN, swarm_size=3, swarm_id="test/bench-small", summary_path=None, clock=clock,
        store=store,
    )  # fmt: skip


async def _swarm(svc: CoordinatorService) -> pb.Plan:
    for node in "abc":
        await join(svc, node, key=f"key-of-{node}")
    assert svc.plan is not None
    return svc.plan


def _member_calls(plan: pb.Plan) -> list[tuple[str, Any]]:
    """Every member-scoped call, each naming member b."""
    report = pb.StageReport(node_id="b", stage=1, plan_epoch=plan.epoch, step=1, loss=1.0)
    return [
        ("Heartbeat", pb.HeartbeatRequest(node_id="b")),
        ("Report", report),
        ("Suspect", pb.SuspectRequest(node_id="b", plan_epoch=plan.epoch, suspects=["c"])),
        ("Drain", pb.DrainRequest(node_id="b", plan_epoch=plan.epoch, pipeline=0)),
        ("Leave", pb.LeaveRequest(node_id="b")),
    ]


def _state(svc: CoordinatorService) -> tuple[Any, ...]:
    roster, book = svc.roster, svc.book
    return (
        [(m.node_id, m.address) for m in roster.members], sorted(roster.leases.left),
        sorted(roster.lost), book.phase, book.pending, dict(book.drains),
        dict(svc.progress.losses) if hasattr(svc.progress, "losses") else None,
        sorted(svc.progress.bytes_sent.items()) if hasattr(svc.progress, "bytes_sent") else None,
    )  # fmt: skip


@pytest.mark.parametrize("key", ["", "key-of-a", "a-guess"])
async def test_a_stranger_cannot_speak_for_a_member(key: str) -> None:
    clock = Clock()
    svc = _service(clock)
    plan = await _swarm(svc)
    before = _state(svc)
    expected = grpc.StatusCode.UNAUTHENTICATED if not key else grpc.StatusCode.PERMISSION_DENIED
    for method, request in _member_calls(plan):
        with pytest.raises(Aborted) as refused:
            await getattr(svc, method)(request, FakeContext(key))
        assert refused.value.code == expected, (method, refused.value.details)
        assert "member b" in refused.value.details
    # A Join in b's name from elsewhere, or as if b restarted, is refused too.
    for address in ("b:1", "evil:1"):
        request = pb.JoinRequest(node_id="b", address=address, protocol=PROTOCOL)
        with pytest.raises(Aborted) as refused:
            await svc.Join(request, FakeContext(key))
        assert refused.value.code == expected
    assert _state(svc) == before and svc.plan == plan
    # b itself is heard, and may leave.
    await svc.Heartbeat(pb.HeartbeatRequest(node_id="b"), FakeContext("key-of-b"))
    await svc.Leave(pb.LeaveRequest(node_id="b"), FakeContext("key-of-b"))
    assert "b" in svc.roster.leases.left


async def test_a_join_whose_reply_was_lost_can_be_sent_again() -> None:
    svc = _service(Clock())
    request = pb.JoinRequest(node_id="a", address="a:1", protocol=PROTOCOL)
    first = await svc.Join(request, FakeContext("key-of-a"))
    again = await svc.Join(request, FakeContext("key-of-a"))
    assert first.member_index == again.member_index == 0


async def test_a_refused_join_leaves_no_key_behind() -> None:
    svc = _service(Clock())
    for node in "abc":  # first joins only: no plan yet, and the swarm is full
        request = pb.JoinRequest(node_id=node, address=f"{node}:1", protocol=PROTOCOL)
        await svc.Join(request, FakeContext(f"key-of-{node}"))
    request = pb.JoinRequest(node_id="d", address="d:1", protocol=PROTOCOL)
    with pytest.raises(Aborted) as refused:
        await svc.Join(request, FakeContext("key-of-d"))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sorted(svc.roster.keys.digests) == ["a", "b", "c"]


async def test_plans_carry_the_digests_and_a_takeover_knows_them() -> None:
    svc = _service(Clock())
    plan = await _swarm(svc)
    assert {s.node_id: s.member_key_sha256 for s in plan.stages} == {
        n: member_key_digest(f"key-of-{n}") for n in "abc"
    }
    # The member that wins the election carries the run on from the plan it had.
    heir = CoordinatorService(
        train=RUN, swarm_size=3, swarm_id="test/bench-small", summary_path=None, clock=Clock(),
        epoch=plan.epoch + 1,
    )  # fmt: skip
    heir.take_over(plan, lost={"a"}, term=2)
    with pytest.raises(Aborted) as refused:
        await heir.Leave(pb.LeaveRequest(node_id="b"), FakeContext("a-guess"))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    await heir.Heartbeat(pb.HeartbeatRequest(node_id="b"), FakeContext("key-of-b"))


async def test_a_restarted_coordinator_keeps_the_keys(tmp_path: Path) -> None:
    clock = Clock()
    svc = _service(clock, CoordinatorStore(tmp_path))
    await _swarm(svc)
    clock.now += 10
    again = _service(clock, CoordinatorStore(tmp_path))
    with pytest.raises(Aborted) as refused:
        await again.Leave(pb.LeaveRequest(node_id="c"), FakeContext("key-of-b"))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    await again.Heartbeat(pb.HeartbeatRequest(node_id="c"), FakeContext("key-of-c"))


def test_member_keys_decide_as_documented() -> None:
    keys = MemberKeys()
    with pytest.raises(Refusal) as missing:
        keys.may_join("a", "")
    assert missing.value.code == grpc.StatusCode.UNAUTHENTICATED
    keys.may_join("a", "k1")
    assert keys.claim("a", "k1") and not keys.claim("a", "k1")
    keys.may_join("a", "k1")
    with pytest.raises(Refusal) as other:
        keys.may_join("a", "k2")
    assert other.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert not keys.check("a", "k1")
    with pytest.raises(Refusal):
        keys.check("a", "k2")
    assert keys.check("b", "kb")  # no digest on record (an old store): this call's is taken
    keys.learn([("c", b"short"), ("d", member_key_digest("kd"))])
    assert "c" not in keys.digests and not keys.check("d", "kd")
    keys.forget(["a"])
    assert keys.claim("a", "k2")  # a place given up: the id starts anew
    assert key_of([("other", "x"), (MEMBER_KEY_METADATA, "k")]) == "k"
    assert key_of([(MEMBER_KEY_METADATA, b"k")]) == "k"
    assert key_of([(MEMBER_KEY_METADATA, "x" * 500)]) == "" and key_of(None) == ""


def test_a_node_keeps_its_key_in_its_state_dir(tmp_path: Path) -> None:
    key = load_or_create_member_key(tmp_path)
    assert load_or_create_member_key(tmp_path) == key and len(key) >= 32
    assert (tmp_path / "member_key").stat().st_mode & 0o077 == 0  # for this user only
    assert load_or_create_member_key(None) != load_or_create_member_key(None)
    (tmp_path / "member_key").write_text("short")
    assert load_or_create_member_key(tmp_path) not in ("short", key)
