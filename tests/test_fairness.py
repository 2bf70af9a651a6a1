"""Coordinator fairness (issue #34): a link that drops for seconds costs no member. Heartbeats
come back at once, a silent probe is no verdict, a deaf coordinator blames nobody. Pure
decisions with a hand-moved clock, and `probe_node` against real loopback sockets."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from ravnest_node.coordination.coordinator.membership import Leases, ProbeAnswer
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.daemon.services import NodeService, probe_node
from ravnest_node.daemon.worker.coordinator_client import (
    COORDINATOR_LOST_S,
    RETRY_PAUSE_S,
    RETRY_TIMEOUT_S,
    beat_cadence,
    coordinator_lost,
)
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import LOST_AFTER_LEASES, heartbeat_interval, hold_s
from ravnest_node.transport.options import TransportConfig

from .fakes import Clock, FakeContext, capabilities, join, unproven
from .test_chaos import LEASE_S, beat, ring_offers, tiny_swarm

INTERVAL_S = heartbeat_interval(LEASE_S)


def test_the_hold_window_is_the_lost_rule_both_ends_go_by() -> None:
    assert hold_s(6.0) == LOST_AFTER_LEASES * 6.0 == 12.0
    assert hold_s(3.0) == 6.0


# ----- the worker's side ----------------------------------------------------------------------
def test_heartbeats_go_every_interval_while_they_succeed() -> None:
    def never(a: float, b: float) -> float:
        raise AssertionError("no pause is drawn while heartbeats succeed")

    assert beat_cadence(2.0, failing=False, draw=never) == (2.0, 2.0)


def test_while_heartbeats_fail_the_next_goes_within_a_second_with_a_short_timeout() -> None:
    drawn: list[tuple[float, float]] = []

    def draw(a: float, b: float) -> float:
        drawn.append((a, b))
        return b

    assert beat_cadence(2.0, failing=True, draw=draw) == (RETRY_PAUSE_S[1], 2.0)
    assert beat_cadence(8.0, failing=True, draw=draw) == (RETRY_PAUSE_S[1], RETRY_TIMEOUT_S)
    assert beat_cadence(1.0, failing=True, draw=draw)[1] == 1.0  # never above an interval
    assert drawn == [RETRY_PAUSE_S] * 3 and RETRY_PAUSE_S == (0.3, 0.7)
    pauses = {beat_cadence(2.0, failing=True)[0] for _ in range(200)}
    assert all(0.3 <= p <= 0.7 for p in pauses) and len(pauses) > 100  # jittered


@pytest.mark.parametrize(
    ("unreachable_for", "refused_for", "lost"),
    [
        (None, None, False),
        (11.9, None, False),  # a cut link shorter than the hold window: no election
        (12.0, None, True),
        (COORDINATOR_LOST_S, COORDINATOR_LOST_S, True),  # its process is gone
        (2.9, 2.9, False),
        (11.0, 1.0, False),  # refused only since its link came back: a restart, wait
    ],
)
def test_the_coordinator_is_lost_after_the_hold_window_or_a_few_seconds_of_refusals(
    unreachable_for: float | None, refused_for: float | None, lost: bool
) -> None:
    now = 1000.0
    since = [None if d is None else now - d for d in (unreachable_for, refused_for)]
    assert coordinator_lost(now, since[0], since[1], LEASE_S) is lost


# ----- leases ---------------------------------------------------------------------------------
def test_a_deaf_coordinator_shifts_everyones_silence_by_its_own() -> None:
    leases = Leases(LEASE_S, own_id="a")
    for node in "abc":
        leases = leases.renew(node, 100.0)
    assert not leases.deaf(100.0 + 2 * INTERVAL_S)
    for t in (102.0, 104.0, 106.0, 108.0, 110.0):  # only its own node is heard
        leases = leases.renew("a", t)
    assert leases.deaf(110.0) and leases.silent_s("c", 110.0) == 10.0
    leases = leases.renew("b", 110.5)  # the link is back: c was silent only one interval
    assert not leases.deaf(110.5)
    assert leases.silent_s("c", 110.5) == pytest.approx(INTERVAL_S)
    assert leases.silent_s("a", 110.5) == 0.0  # never shifted past now
    assert leases.silent_s("b", 110.5) == 0.0


def test_with_one_other_member_silence_counts_as_it_always_did() -> None:
    leases = Leases(LEASE_S, own_id="a").renew("a", 100.0).renew("b", 100.0)
    leases = leases.renew("a", 112.0)
    assert not leases.deaf(112.0) and leases.expired("b", 112.0)


# ----- the coordinator ------------------------------------------------------------------------
async def three_planned(probe: Any = None, **train: Any) -> tuple[CoordinatorService, Clock]:
    clock = Clock()
    svc = tiny_swarm(clock, 3, probe, steps=50, microbatches=4, **train)
    for node in "abc":
        await join(svc, node, caps=capabilities(blocks=4))
    assert svc.plan is not None and svc.plan.epoch == 1
    return svc, clock


async def heartbeats(svc: CoordinatorService, clock: Clock, nodes: str, seconds: float) -> None:
    """`nodes` send a heartbeat every interval for `seconds`."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now += INTERVAL_S
        for node in nodes:
            await beat(svc, node, [])


async def test_a_deaf_coordinator_blames_nobody() -> None:
    """Its own link is down 10 s: only its own node (a) is heard; then b and c come back.
    Nobody is lost, no plan is made; a member silent while the others are heard is lost
    at the hold window, as before."""
    svc, clock = await three_planned()
    await heartbeats(svc, clock, "a", 10.0)
    await heartbeats(svc, clock, "a", 6.0)  # 16 s: past the hold window, still deaf
    assert svc.faults.crashes == [] and svc.roster.deaf(clock.now)
    await beat(svc, "b", [])
    clock.now += 0.4
    await beat(svc, "c", [])
    await heartbeats(svc, clock, "abc", 10.0)
    assert svc.faults.crashes == [] and svc.roster.lost == {}
    assert svc.plan is not None and svc.plan.epoch == 1 and svc.book.pending is None
    # Now c is silent while a and b are heard: lost once silent past the hold window.
    silent_from = clock.now
    await heartbeats(svc, clock, "ab", hold_s(LEASE_S) - INTERVAL_S)
    assert svc.faults.crashes == []
    await heartbeats(svc, clock, "ab", 2 * INTERVAL_S)
    assert [c.node_id for c in svc.faults.crashes] == ["c"]
    assert hold_s(LEASE_S) < clock.now - silent_from <= hold_s(LEASE_S) + 2 * INTERVAL_S


async def test_a_silent_suspect_is_no_verdict_and_a_whole_pipeline_starts_again() -> None:
    """c's stream to b broke and b does not answer the probe (its link is cut): b is not lost.
    Back within the hold window, everyone is heard again, but the broken streams cannot go
    on: the run is restored from the members' checkpoints with all three, nobody lost."""
    answers = {"b": ProbeAnswer.SILENT}

    async def probe(node_id: str, address: str, timeout_s: float) -> ProbeAnswer:
        return answers[node_id]

    svc, clock = await three_planned(probe)
    plan = svc.plan
    assert plan is not None
    stage = {s.index: s for s in plan.stages}
    ctx: Any = FakeContext()
    for step in range(1, 13):
        report = pb.StageReport(node_id=stage[2].node_id, stage=2, pipeline=0, plan_epoch=1,
                                step=step, loss=5.0 - step / 10)  # fmt: skip
        await svc.Report(report, ctx)
    b = stage[1].node_id
    others = [s.node_id for s in plan.stages if s.node_id != b]
    suspect = pb.SuspectRequest(node_id=stage[2].node_id, plan_epoch=1, suspects=[b],
                                reason="Connection timed out")  # fmt: skip
    assert list((await svc.Suspect(suspect, ctx)).lost) == []
    assert svc.faults.crashes == []
    offers = ring_offers(plan, (10, 5))
    held = dict.fromkeys("abc", 0)
    for _ in range(3):  # b is still cut off: its pipeline waits for it
        clock.now += INTERVAL_S
        for node in others:
            held[node] = await beat(svc, node, offers[node], held[node])
    assert svc.plan is not None and svc.plan.epoch == 1 and svc.book.pending is None
    for _ in range(3):  # b's link is back before the hold window
        clock.now += INTERVAL_S
        for node in "abc":
            held[node] = await beat(svc, node, offers[node], held[node])
    new = svc.plan
    assert new is not None and new.epoch == 2 and new.restore and new.start_step == 10
    assert {s.node_id for s in new.stages} == {"a", "b", "c"}
    assert svc.faults.crashes == [] and svc.roster.lost == {}
    assert svc.faults.redone == 2 * 4


async def test_a_suspect_that_answers_never_restarts_a_pipeline_with_a_dead_member() -> None:
    """b's stream broke because a died (the break went on down the pipeline): c names b, who
    answers. The pipeline starts again only once all its members are heard from again; a,
    dead, never is, and is lost at the hold window, not restarted with."""

    async def probe(node_id: str, address: str, timeout_s: float) -> ProbeAnswer:
        return ProbeAnswer.ALIVE

    clock = Clock()
    svc = CoordinatorService(  # its own node (z) holds no stage: a may die
        prove=unproven,
        train=TrainConfig(model="tiny", batch_size=16, steps=50), swarm_size=3,
        swarm_id="test/tiny", summary_path=None, clock=clock, probe=probe, node_id="z",
        lease_s=LEASE_S,
    )  # fmt: skip
    for node in "abc":
        await join(svc, node, caps=capabilities(blocks=4))
    plan = svc.plan
    assert plan is not None
    ctx: Any = FakeContext()
    await svc.Suspect(pb.SuspectRequest(node_id="c", plan_epoch=1, suspects=["b"]), ctx)
    await heartbeats(svc, clock, "bc", hold_s(LEASE_S) - INTERVAL_S)
    assert svc.plan is not None and svc.plan.epoch == 1 and svc.faults.crashes == []
    assert svc.faults.unrestored is None and svc.faults.restores == []  # no restart with a
    await heartbeats(svc, clock, "bc", 2 * INTERVAL_S)
    assert [c.node_id for c in svc.faults.crashes] == ["a"]


# ----- probes over real sockets ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def node_server(node_id: str) -> AsyncIterator[str]:
    """A server of `ravnest.v1.Node` for node `node_id` on loopback: its address."""

    async def status(brief: bool) -> pb.NodeStatus:
        return pb.NodeStatus(node_id=node_id)

    server = grpc.aio.server()
    pb_grpc.add_NodeServicer_to_server(NodeService(status, lambda: None), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_a_probe_tells_alive_refused_and_silent_apart() -> None:
    transport = TransportConfig()
    probe: Callable[..., Any] = probe_node
    async with node_server("n1") as address:
        assert await probe("n1", address, 2.0, transport=transport) is ProbeAnswer.ALIVE
        # Another node answers there: not it.
        assert await probe("n2", address, 2.0, transport=transport) is ProbeAnswer.REFUSED
    # Nobody listens: refused at once, not after the timeout.
    loop = asyncio.get_running_loop()
    start = loop.time()
    closed = f"127.0.0.1:{free_port()}"
    assert await probe("n1", closed, 5.0, transport=transport) is ProbeAnswer.REFUSED
    assert loop.time() - start < 1.0
    # A listener that never accepts (its backlog full: SYNs dropped) stands for a cut link.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        stuffed = [socket.socket() for _ in range(4)]
        try:
            for s in stuffed:
                s.setblocking(False)
                s.connect_ex(listener.getsockname())
            host, port = listener.getsockname()
            answer = await probe("n1", f"{host}:{port}", 0.3, tries=1, transport=transport)
        finally:
            for s in stuffed:
                s.close()
    assert answer is ProbeAnswer.SILENT
    # A name that cannot be resolved is no verdict either.
    assert await probe("n1", "no-such-host.invalid:1", 0.3, tries=1,
                       transport=transport) is ProbeAnswer.SILENT  # fmt: skip
