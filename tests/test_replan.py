"""Re-planning without a restart: a node that joins a running swarm gets a share of the work.

The coordinator announces a plan with the newcomer, the pipeline drains at a step boundary,
the new stages fetch the blocks they gain from their previous owners (Node.FetchBlock) and the
run carries on from that step (docs/discovery.md, "Re-planning")."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from ravnest_node.blocks import BlockWeights, export_blocks, restore_blocks
from ravnest_node.errors import PeerRefused
from ravnest_node.identity import NodeKey
from ravnest_node.models import get_model
from ravnest_node.pipeline.handoff import from_chunks, to_chunks
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.proofs import provers
from tests.conftest import Procs, node_status, poll_until, progress_events

NEGATIVE = b"\x00\x00\x80\xbf"  # -1.0 as little-endian float32


def _stage(seed: int = 0) -> tuple[torch.nn.Sequential, torch.optim.AdamW]:
    blocks = torch.nn.Sequential(*get_model("tiny").build_stage(seed, 1, 3))
    return blocks, torch.optim.AdamW(blocks.parameters(), lr=1e-3)


def test_blocks_move_with_their_optimizer_state() -> None:
    blocks, opt = _stage()
    sum(p.square().sum() for p in blocks.parameters()).backward()
    opt.step()
    states = export_blocks(blocks, 1, opt, version=7)
    assert sorted(states) == [1, 2]
    fresh, fresh_opt = _stage(seed=1)
    received = {  # in small chunks: many per tensor
        b: from_chunks(to_chunks(w, 256), block=fresh[b - 1], index=b, version=7, source="peer")
        for b, w in states.items()
    }
    restore_blocks(fresh, 1, fresh_opt, received)
    for p, q in zip(blocks.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
    assert float(fresh_opt.state[next(fresh.parameters())]["step"]) == 1.0


def _tensor(chunks: list[pb.BlockChunk], role: str = "param") -> list[pb.BlockChunk]:
    """The chunks of the first tensor of `role` with more than one chunk."""
    first = next(c for c in chunks if c.role == role and c.offset > 0)
    return [c for c in chunks if (c.role, c.name) == (first.role, first.name)]


def _drop_tensor(m: list[pb.BlockChunk]) -> None:
    last = (m[-1].role, m[-1].name)
    m[:] = [c for c in m if (c.role, c.name) != last]


@pytest.mark.parametrize(
    ("spoil", "match"),
    [
        (lambda m: setattr(m[0], "block", 2), "it is block 2"),
        (lambda m: setattr(m[0], "version", 6), "at step 6, the plan starts at 7"),
        (_drop_tensor, "missing|only some"),
        (lambda m: m.remove(_tensor(m)[-1]), r"has \d+ of \d+ values"),
        (lambda m: m[0].shape.append(1), "has shape"),
        (lambda m: setattr(m[0], "dtype", "float64"), "not float32"),
        (lambda m: setattr(m[0], "name", "os.system"), "unknown tensor"),
        (lambda m: m.extend(_tensor(m)), "twice"),
        (lambda m: setattr(_tensor(m)[1], "offset", _tensor(m)[1].offset + 1), "expected"),
        (lambda m: setattr(_tensor(m)[-1], "data", _tensor(m)[-1].data + NEGATIVE), "not \\d+"),
        (lambda m: setattr(m[0], "data", m[0].data[:-1]), "a chunk of"),
        (lambda m: setattr(m[0], "data", b""), "a chunk of 0 bytes"),
        (lambda m: setattr(m[1], "optimizer_step", 3.0), "disagree"),
        (lambda m: setattr(m[0], "data", b"\xff" * len(m[0].data)), "not finite"),
        (
            lambda m: setattr(
                _tensor(m, "exp_avg_sq")[0], "data", NEGATIVE * (len(m[0].data) // 4)
            ),
            "negative",
        ),
    ],
    ids=["block", "version", "missing", "truncated", "shape", "dtype", "name", "twice", "gap",
         "overrun", "odd-bytes", "empty", "step", "nan", "negative"],
)  # fmt: skip
def test_a_wrong_block_is_refused_whole(spoil: object, match: str) -> None:
    blocks, opt = _stage()
    sum(p.square().sum() for p in blocks.parameters()).backward()
    opt.step()
    weights: BlockWeights = export_blocks(blocks, 1, opt, version=7)[1]
    chunks = list(to_chunks(weights, 256))
    spoil(chunks)  # type: ignore[operator]
    fresh, _ = _stage(seed=1)
    before = [p.clone() for p in fresh.parameters()]
    with pytest.raises(PeerRefused, match=match):
        from_chunks(chunks, block=fresh[0], index=1, version=7, source="peer")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))


def test_a_fourth_node_joining_mid_run_gets_a_share_of_the_work(
    tmp_path: Path, procs: Procs
) -> None:
    steps = 400
    coord, ready = procs.start_node(
        tmp_path / "n0", "--swarm-size", "3", "--model", "tiny", "--steps", str(steps)
    )
    address = ready["address"]
    for i in (1, 2):
        procs.start_node(tmp_path / f"n{i}", "--join", address)
    for event in progress_events(address):
        if event.step >= 5:
            break
    _, fourth = procs.start_node(tmp_path / "n3", "--join", address)
    joined = time.monotonic()
    # Within 30 s it owns a stage of a newer plan and trains it.
    poll_until(lambda: node_status(fourth["address"]).version > 0, 30)
    took = time.monotonic() - joined
    status = node_status(fourth["address"])
    assert status.stage >= 0 and status.plan_epoch == 2, status
    done = [e for e in progress_events(address, timeout_s=300) if e.done]
    assert len(done) == 1
    summary = json.loads(done[0].summary_json)
    assert [p["epoch"] for p in summary["plans"]] == [1, 2]
    assert [p["nodes"] for p in summary["plans"]] == [3, 4]
    start = summary["plans"][1]["start_step"]
    assert 5 <= start < steps
    assert fourth["node_id"] in {s["node_id"] for s in summary["stages"]}
    losses = summary["loss_history"]
    assert len(losses) == steps and all(x == x for x in losses)  # every step, no gaps
    # Training carried on across the switch: no jump back to the initial loss.
    assert max(losses[start : start + 5]) < losses[0]
    assert summary["final_loss"] < summary["initial_loss"]
    print(f"fourth node trained {took:.1f} s after it started; plan 2 from step {start}")
    with grpc.insecure_channel(address) as channel:
        view = pb_grpc.CoordinatorStub(channel).Swarm(pb.SwarmRequest(), timeout=30)
    assert view.plan.epoch == 2 and len(view.members) == 4
    assert coord.poll() is None
    # Blocks go only to members of the current plan, for the current plan, asked by
    # themselves (the test speaks as the fourth node with its key; identity.py).
    fourth_key, intruder = NodeKey.load_or_create(tmp_path / "n3"), NodeKey.generate()
    assert fourth_key.node_id == fourth["node_id"]
    for key, request, code in (
        (intruder, pb.BlockRequest(node_id=intruder.node_id, plan_epoch=2),
         grpc.StatusCode.PERMISSION_DENIED),
        (fourth_key, pb.BlockRequest(node_id=fourth["node_id"], plan_epoch=1),
         grpc.StatusCode.FAILED_PRECONDITION),
        (intruder, pb.BlockRequest(node_id=fourth["node_id"], plan_epoch=2),
         grpc.StatusCode.UNAUTHENTICATED),
    ):  # fmt: skip
        async def fetch(key: NodeKey = key, request: pb.BlockRequest = request) -> None:
            async with grpc.aio.insecure_channel(address, interceptors=provers(key)) as channel:
                async for _ in pb_grpc.NodeStub(channel).FetchBlock(request, timeout=30):
                    pass

        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(fetch())
        assert info.value.code() == code, info.value.details()


def test_a_node_that_stops_mid_run_hands_its_blocks_over(tmp_path: Path, procs: Procs) -> None:
    steps = 400
    _, ready = procs.start_node(
        tmp_path / "n0", "--swarm-size", "4", "--model", "tiny", "--steps", str(steps)
    )
    address = ready["address"]
    joined = [procs.start_node(tmp_path / f"n{i}", "--join", address) for i in (1, 2, 3)]
    for event in progress_events(address):
        if event.step >= 5:
            break
    leaver, info = joined[1]
    leaver.send_signal(signal.SIGTERM)
    assert leaver.wait(60) == 0  # it left once its blocks were handed over
    log = (tmp_path / "n2" / "node.log").read_text()
    assert "blocks handed over; stopping" in log, log
    done = [e for e in progress_events(address, timeout_s=300) if e.done]
    assert len(done) == 1
    summary = json.loads(done[0].summary_json)
    assert [p["nodes"] for p in summary["plans"]] == [4, 3]
    assert info["node_id"] not in {s["node_id"] for s in summary["stages"]}
    losses = summary["loss_history"]
    assert len(losses) == steps and all(x == x for x in losses)
    start = summary["plans"][1]["start_step"]
    assert max(losses[start : start + 5]) < losses[0]


async def test_a_worker_never_goes_back_to_an_older_plan() -> None:
    """A coordinator that comes back with an older plan (a stale one, or one restored from an
    old copy of its store) cannot impose it: the worker keeps the newest it has seen."""
    from ravnest_node.daemon.worker.changes import Changes
    from ravnest_node.daemon.worker.coordinator_client import CoordinatorClient
    from ravnest_node.transport.options import TransportConfig

    def plan(epoch: int, pending: bool = False) -> pb.Plan:
        return pb.Plan(epoch=epoch, pending=pending, start_step=epoch)

    streams = [[plan(3)], [plan(2), plan(3), plan(4, pending=True), plan(4)]]

    class Coordinator(pb_grpc.CoordinatorServicer):
        async def WatchPlan(
            self, request: pb.WatchPlanRequest, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[pb.Plan]:
            for p in streams.pop(0):
                yield p
            if not streams:  # the last stream stays open, as a live coordinator's does
                await asyncio.Event().wait()

    seen: list[tuple[int, bool]] = []

    class Recorded(Changes):
        async def notify(self) -> None:
            assert client.latest_plan is not None
            seen.append((client.latest_plan.epoch, client.latest_plan.pending))
            await super().notify()

    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(Coordinator(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = CoordinatorClient(
        join=pb.JoinRequest(node_id="w"), address=f"127.0.0.1:{port}",
        transport=TransportConfig(), changes=Recorded(1.0), grace_s=1.0,
    )  # fmt: skip
    try:
        async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
            watcher = tg.create_task(client.watch_plans())
            latest = await client.next_plan(3)  # the first stream ended: it reconnects
            watcher.cancel()
    finally:
        await client.close()
        await server.stop(None)
    assert latest.epoch == 4 and not latest.pending
    assert seen == [(3, False), (4, True), (4, False)]  # epoch 2 never replaced epoch 3
