"""Checkpoint copies (a stage without a replica has its checkpoints kept by the next stage's
node, ravnest_node/checkpoint/store.py `CheckpointCopies`, `Node.FetchCheckpoint`): a copy is kept
only whole and as expected; whatever the serving peer sends otherwise is refused with nothing
written."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from ravnest_node.checkpoint import (
    CheckpointCopies,
    CheckpointDir,
    CheckpointError,
    Manifest,
    bytes_bound,
    parse_manifest,
)
from ravnest_node.daemon.worker.changes import Changes
from ravnest_node.daemon.worker.checkpoint_copies import PACED_CHUNK_BYTES
from ravnest_node.daemon.worker.checkpoints import CheckpointKeeper
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.options import TransportConfig

from .test_checkpoint import MODEL, RUN, assert_same, save, trained_blocks

Chunks = Callable[[Manifest, bytes], Iterator[pb.CheckpointChunk]]


def tensor_bytes(store: CheckpointDir, manifest: Manifest) -> bytes:
    with store.open_tensors(manifest) as f:
        return f.read()


def honest(manifest: Manifest, data: bytes, size: int = 4096) -> Iterator[pb.CheckpointChunk]:
    yield pb.CheckpointChunk(manifest=json.dumps(asdict(manifest)).encode(), data=data[:size])
    for offset in range(size, len(data), size):
        yield pb.CheckpointChunk(offset=offset, data=data[offset : offset + size])


def a_checkpoint(tmp_path: Path) -> tuple[Manifest, bytes]:
    """Blocks [1, 3) at step 10, as their owner wrote them."""
    store = CheckpointDir(tmp_path / "owner")
    save(store, trained_blocks(1, 3, 10), 10)
    manifest = store.manifest(10)
    return manifest, tensor_bytes(store, manifest)


def test_a_copy_is_kept_whole_and_loads_like_the_original(tmp_path: Path) -> None:
    manifest, data = a_checkpoint(tmp_path)
    copies = CheckpointCopies(tmp_path / "keeper")
    copies.store(manifest, data, copies.generation, MODEL)
    assert [m.step for m in copies.manifests()] == [10]
    _, blocks = copies.dir(1, 3).load(10, MODEL)
    assert_same(blocks, trained_blocks(1, 3, 10))
    assert len(data) <= bytes_bound(MODEL, 1, 3)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[:-1],  # truncated
        lambda d: d[:100] + bytes([d[100] ^ 1]) + d[101:],  # one bit flipped
        lambda d: d + b"\0",  # longer
    ],
    ids=["truncated", "bit-flip", "longer"],
)
def test_a_damaged_copy_is_refused_and_nothing_is_written(
    tmp_path: Path, damage: Callable[[bytes], bytes]
) -> None:
    manifest, data = a_checkpoint(tmp_path)
    copies = CheckpointCopies(tmp_path / "keeper")
    with pytest.raises(CheckpointError, match="copy of step 10"):
        copies.store(manifest, damage(data), copies.generation, MODEL)
    assert copies.manifests() == []
    assert not list((tmp_path / "keeper").rglob("*.safetensors"))


def test_a_copy_asked_for_before_the_run_went_back_is_refused(tmp_path: Path) -> None:
    manifest, data = a_checkpoint(tmp_path)
    copies = CheckpointCopies(tmp_path / "keeper")
    copies.store(manifest, data, copies.generation, MODEL)
    asked = copies.generation
    assert copies.drop_after(5) == [10]  # a restore at step 5: step 10 is another timeline's
    assert copies.manifests() == []
    with pytest.raises(CheckpointError, match="went back"):
        copies.store(manifest, data, asked, MODEL)


def test_copies_of_an_old_range_go_once_the_new_range_has_enough(tmp_path: Path) -> None:
    copies = CheckpointCopies(tmp_path / "keeper", keep=2)
    for first, stop, step in [(1, 3, 10), (1, 3, 20), (0, 2, 30)]:
        store = CheckpointDir(tmp_path / f"owner-{step}")
        save(store, trained_blocks(first, stop, step), step)
        m = store.manifest(step)
        copies.store(m, tensor_bytes(store, m), copies.generation, MODEL)
    assert [m.step for m in copies.manifests()] == [30, 20, 10]  # the new range has one
    store = CheckpointDir(tmp_path / "owner-40")
    save(store, trained_blocks(0, 2, 40), 40)
    m = store.manifest(40)
    copies.store(m, tensor_bytes(store, m), copies.generation, MODEL)
    assert [(m.step, m.first_block) for m in copies.manifests()] == [(40, 0), (30, 0)]


def test_while_a_restore_is_planned_nothing_held_is_pruned(tmp_path: Path) -> None:
    """A node asked to hold its checkpoints (Retention, shared by its own and its copies)
    prunes none, of either, until it has a plan newer than the broken one; then the next
    write prunes down to `keep` again."""
    own = CheckpointDir(tmp_path / "keeper", keep=2)
    copies = CheckpointCopies(tmp_path / "keeper", keep=2, retention=own.retention)

    def copy(first: int, stop: int, step: int) -> None:
        store = CheckpointDir(tmp_path / f"owner-{first}-{step}")
        save(store, trained_blocks(first, stop, step), step)
        m = store.manifest(step)
        copies.store(m, tensor_bytes(store, m), copies.generation, MODEL)

    for step in (10, 20):
        save(own, trained_blocks(2, 4, step), step)
        copy(0, 2, step)
    assert own.retention.hold(3) and not own.retention.hold(3)  # once per epoch
    listed = ([m.step for m in own.manifests()], [m.step for m in copies.manifests()])
    for step in (30, 40):  # the node trains on while the restore is planned
        save(own, trained_blocks(2, 4, step), step)
        copy(0, 2, step)
    copy(1, 2, 40)  # a range whose copies would drop the others' once it has `keep`
    copy(1, 2, 50)
    assert {10, 20} <= set(own.steps()) and listed == ([20, 10], [20, 10])
    assert sorted(m.step for m in copies.manifests() if m.first_block == 0) == [10, 20, 30, 40]
    own.retention.release(3)  # the broken plan itself: still held
    assert own.retention.held_epoch == 3
    own.retention.release(4)  # the restore plan came
    save(own, trained_blocks(2, 4, 50), 50)
    assert own.steps() == [50, 40]
    copy(1, 2, 60)
    assert [(m.step, m.first_block) for m in copies.manifests()] == [(60, 1), (50, 1)]


@pytest.mark.parametrize(
    "raw", [b"", b"[]", b"{", b'{"format": "other"}', b"x" * (2 << 20)],
    ids=["empty", "list", "broken", "other-format", "too-large"],
)  # fmt: skip
def test_a_malformed_manifest_is_refused(raw: bytes) -> None:
    with pytest.raises(CheckpointError, match="peer"):
        parse_manifest(raw, 10, "peer")


# ----- the copy over gRPC, from a peer that may lie -------------------------------------------
class Server(pb_grpc.NodeServicer):
    def __init__(self, chunks: Iterator[pb.CheckpointChunk]) -> None:
        self.chunks = chunks

    async def FetchCheckpoint(
        self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.CheckpointChunk]:
        for chunk in self.chunks:
            yield chunk


def keeper(node_id: str, store: CheckpointDir, connect_timeout_s: float) -> CheckpointKeeper:
    return CheckpointKeeper(
        node_id=node_id, store=store, resume=False,
        transport=TransportConfig(connect_timeout_s=connect_timeout_s),
        changes=Changes(connect_timeout_s),
    )  # fmt: skip


async def copy_from(tmp_path: Path, chunks: Iterator[pb.CheckpointChunk]) -> CheckpointCopies:
    """Serve `chunks` as node "owner" (stage 0, blocks [1, 3)) and have the keeper copy them."""
    server = grpc.aio.server()
    pb_grpc.add_NodeServicer_to_server(Server(chunks), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    source = pb.StageAssignment(pipeline=0, index=0, first_block=1, stop_block=3,
                                node_id="owner", address=f"127.0.0.1:{port}")  # fmt: skip
    plan = pb.Plan(epoch=1, run=RUN, stages=[source])
    try:
        await keeper("keeper", CheckpointDir(tmp_path / "keeper"), 5).copy(plan, source, 10)
    finally:
        await server.stop(None)
    return CheckpointCopies(tmp_path / "keeper")


async def test_a_copy_over_grpc_is_kept(tmp_path: Path) -> None:
    manifest, data = a_checkpoint(tmp_path)
    copies = await copy_from(tmp_path, honest(manifest, data))
    assert [m.step for m in copies.manifests()] == [10]
    assert_same(copies.dir(1, 3).load(10, MODEL)[1], trained_blocks(1, 3, 10))


def lies(manifest: Manifest, data: bytes) -> dict[str, Iterator[pb.CheckpointChunk]]:
    def with_manifest(m: Manifest) -> Iterator[pb.CheckpointChunk]:
        return honest(m, data)

    def gap() -> Iterator[pb.CheckpointChunk]:
        chunks = list(honest(manifest, data))
        return iter(chunks[:1] + chunks[2:])

    def two_manifests() -> Iterator[pb.CheckpointChunk]:
        chunks = list(honest(manifest, data))
        chunks[1].manifest = chunks[0].manifest
        return iter(chunks)

    garbage = b"\0" * len(data)  # its manifest agrees with it: only the contents are wrong
    digest = hashlib.sha256(garbage).hexdigest()
    consistent = replace(manifest, sha256=digest, file=f"step-00000010-{digest[:16]}.safetensors")
    return {
        "consistent-garbage": honest(consistent, garbage),
        "other-blocks": with_manifest(replace(manifest, first_block=0, stop_block=2)),
        "other-run": with_manifest(replace(manifest, run_key="0" * 16)),
        "huge": with_manifest(replace(manifest, bytes=1 << 40)),
        "gap": gap(),
        "two-manifests": two_manifests(),
        "garbage-manifest": iter([pb.CheckpointChunk(manifest=b"{", data=data)]),
        "no-manifest": iter([]),
        "truncated": iter(list(honest(manifest, data))[:-1]),
        "other-bytes": honest(manifest, data[:100] + bytes([data[100] ^ 1]) + data[101:]),
    }


@pytest.mark.parametrize(
    "lie",
    ["consistent-garbage", "other-blocks", "other-run", "huge", "gap", "two-manifests",
     "garbage-manifest", "no-manifest", "truncated", "other-bytes"],
)  # fmt: skip
async def test_a_copy_the_peer_lies_about_is_refused_and_nothing_is_written(
    tmp_path: Path, lie: str, caplog: pytest.LogCaptureFixture
) -> None:
    manifest, data = a_checkpoint(tmp_path)
    copies = await copy_from(tmp_path, lies(manifest, data)[lie])
    assert copies.manifests() == []
    assert not list((tmp_path / "keeper").rglob("*.safetensors"))
    assert "checkpoint copy of step 10 not kept" in caplog.text


async def test_fetch_checkpoint_refuses_unknown_peers_and_other_plans(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path / "owner-dir")
    save(store, trained_blocks(1, 3, 10), 10)
    owner = keeper("owner", store, 0.2)
    stages = [pb.StageAssignment(node_id="owner"),
              pb.StageAssignment(node_id="keeper", index=1),
              pb.StageAssignment(node_id="other", index=2)]  # fmt: skip
    plan = pb.Plan(epoch=3, stages=stages)
    owner.checkpoint_step = 10

    async def fetch(node: str, epoch: int, step: int = 10) -> list[pb.CheckpointChunk]:
        request = pb.CheckpointRequest(node_id=node, plan_epoch=epoch, step=step)
        return [c async for c in owner.serve_copy(request, plan)]

    for node, epoch, step, code in [
        ("stranger", 3, 10, grpc.StatusCode.PERMISSION_DENIED),
        ("other", 3, 10, grpc.StatusCode.PERMISSION_DENIED),  # not the next stage's node
        ("keeper", 2, 10, grpc.StatusCode.FAILED_PRECONDITION),
        ("keeper", 3, 20, grpc.StatusCode.UNAVAILABLE),  # not written (yet)
        ("keeper", 3, 5, grpc.StatusCode.NOT_FOUND),  # not kept
    ]:
        with pytest.raises(Refusal) as refused:
            await fetch(node, epoch, step)
        assert refused.value.code == code
    chunks = await fetch("keeper", 3)
    assert parse_manifest(chunks[0].manifest, 10).step == 10
    assert sum(len(c.data) for c in chunks) == store.manifest(10).bytes


async def test_a_copy_is_sent_at_its_pace_in_small_chunks(tmp_path: Path) -> None:
    """A paced copy (COPY_SHARE of the measured link, worker._copy_pace_bps) goes in chunks of
    PACED_CHUNK_BYTES, each no sooner than the bytes before it take at the pace."""
    store = CheckpointDir(tmp_path / "owner-dir")
    save(store, trained_blocks(1, 3, 10), 10)
    owner = keeper("owner", store, 5)
    plan = pb.Plan(epoch=3, stages=[pb.StageAssignment(node_id="owner"),
                                    pb.StageAssignment(node_id="keeper", index=1)])  # fmt: skip
    owner.checkpoint_step = 10
    size = store.manifest(10).bytes
    pace_bps = size * 8 / 0.5  # the whole copy in 0.5 s
    request = pb.CheckpointRequest(node_id="keeper", plan_epoch=3, step=10)
    loop = asyncio.get_running_loop()
    start_s, arrivals = loop.time(), []
    async for chunk in owner.serve_copy(request, plan, pace_bps=pace_bps):
        arrivals.append((loop.time() - start_s, len(chunk.data)))
    assert sum(n for _, n in arrivals) == size and len(arrivals) > 2
    assert max(n for _, n in arrivals) <= PACED_CHUNK_BYTES
    before = 0
    for at_s, n in arrivals:
        assert at_s >= before * 8 / pace_bps - 1e-3  # never ahead of the pace
        before += n
