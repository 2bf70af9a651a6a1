"""Checkpoint copies between neighbours, both ways (`Node.FetchCheckpoint`).

A stage without a replica (one pipeline, two stages or more) has no other copy of its state:
the next stage's node (the first stage's, for the last) keeps copies of its checkpoints, so a
restore finds them if the stage's node is lost. After each of its own checkpoints, a stage
fetches its upstream's checkpoint of the same step (`CheckpointCopier.copy`, one at a time; a
copy due while the one before is still coming is skipped), and serves its own to its downstream
(`CheckpointCopier.serve`).

A copy shares the link with the boundary streams, and on a slow link a stage's checkpoint (20
MB for a third of bench-small) takes seconds to minutes, so the source sends it at COPY_SHARE of
the link's measured bandwidth (in PACED_CHUNK_BYTES chunks, each after the time the ones before
it take at that pace): a 60-step bench on the 10 Mbit/s link, whose copies at step 50 went at
full speed, ran its last steps at half its speed before (docs/benchmarks.md).

What comes from the peer is checked before anything is kept: the manifest against what the
source trains under the plan and the size bound of its blocks, each chunk against the one
before, and the whole against its sha256 (CheckpointCopies.store); a peer that trickles is cut
off (COPY_MIN_BPS).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict
from typing import BinaryIO

import grpc

from ravnest_node.checkpoint import (
    CheckpointCopies,
    CheckpointDir,
    CheckpointError,
    Manifest,
    bytes_bound,
    parse_manifest,
    run_key,
)
from ravnest_node.coordination.planning.static_plan import stage_at
from ravnest_node.daemon.worker.changes import Changes
from ravnest_node.daemon.worker.tasks import Tasks
from ravnest_node.errors import PeerError
from ravnest_node.models import get_model
from ravnest_node.pipeline.handoff import CHUNK_BYTES
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.chunks import read_chunks, serve_chunks
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.options import TransportConfig, open_channel

__all__ = ["COPY_MIN_BPS", "COPY_SHARE", "PACED_CHUNK_BYTES", "CheckpointCopier", "copier_of"]

log = logging.getLogger(__name__)

COPY_MIN_BPS = 0.1e6
"""A checkpoint copy must come at least this fast (bits per second), after the connect
timeout."""
COPY_SHARE = 0.2
"""Share of the measured link a checkpoint copy is sent at."""
PACED_CHUNK_BYTES = 64 << 10
"""Chunk size of a paced copy: a chunk's burst holds a boundary frame up for little."""
CLOSE_WAIT_S = 0.5
"""Seconds a copy being fetched gets to end when the node closes."""


def copier_of(plan: pb.Plan, node_id: str) -> str:
    """The node that keeps copies of node `node_id`'s checkpoints under `plan`: the next
    stage's (the first stage's for the last), with one pipeline and two stages or more; "" if
    none."""
    stages = len(plan.stages) // max(1, plan.run.pipelines)
    me = next((s for s in plan.stages if s.node_id == node_id), None)
    if me is None or plan.run.pipelines > 1 or stages < 2:
        return ""
    copier = stage_at(plan, me.pipeline, (me.index + 1) % stages)
    return "" if copier is None else copier.node_id


class _Received:
    """A copy as its chunks come: the manifest first, checked against what the source trains
    (`expected`: model, first and stop block, run key) and the size `bound`, then the data in
    order, within the manifest's size; CheckpointError naming `where` otherwise."""

    def __init__(
        self, step: int, where: str, expected: tuple[str, int, int, str], bound: int
    ) -> None:
        self._step, self._where, self._expected, self._bound = step, where, expected, bound
        self.manifest: Manifest | None = None
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, chunk: pb.CheckpointChunk) -> None:
        where = f"copy from {self._where}"
        manifest = self.manifest
        if manifest is None:
            manifest = self.manifest = parse_manifest(chunk.manifest, self._step, where)
            got = (manifest.model, manifest.first_block, manifest.stop_block, manifest.run_key)
            if got != self._expected:
                raise CheckpointError(f"{where}: it is of {got}, not {self._expected}")
            if manifest.bytes > self._bound:
                raise CheckpointError(
                    f"{where}: {manifest.bytes} bytes, at most {self._bound} expected"
                )
        elif chunk.manifest:
            raise CheckpointError(f"{where}: a second manifest")
        size = self._size
        if not chunk.data or chunk.offset != size or size + len(chunk.data) > manifest.bytes:
            raise CheckpointError(f"{where}: a chunk at {chunk.offset} of {len(chunk.data)} "
                                  f"bytes does not follow {size} of {manifest.bytes}")  # fmt: skip
        self._parts.append(chunk.data)
        self._size += len(chunk.data)

    def whole(self) -> tuple[Manifest, bytes]:
        """The manifest and the data received (checked whole by CheckpointCopies.store)."""
        if self.manifest is None:
            raise CheckpointError(f"copy from {self._where}: no manifest came")
        return self.manifest, b"".join(self._parts)


def _file_chunks(f: BinaryIO, manifest: Manifest, chunk_bytes: int) -> Iterator[pb.CheckpointChunk]:
    """A checkpoint's tensor file as FetchCheckpoint sends it, the manifest with its first
    chunk. Blocking: it reads as it goes (a stage's checkpoint is never all in memory)."""
    head, offset = json.dumps(asdict(manifest)).encode(), 0
    while data := f.read(chunk_bytes):
        yield pb.CheckpointChunk(manifest=head, offset=offset, data=data)
        head, offset = b"", offset + len(data)


class CheckpointCopier:
    """Copies of checkpoints, for node `node_id`: fetched into `copies`, and served."""

    def __init__(
        self,
        *,
        node_id: str,
        copies: CheckpointCopies,
        transport: TransportConfig,
        changes: Changes,
    ) -> None:
        self.node_id = node_id
        self._copies = copies
        self._transport = transport
        self._changes = changes
        self._fetching = Tasks("checkpoint copies")
        """The copy being fetched (one at a time; a copy due meanwhile is skipped)."""
        self._serving: set[str] = set()
        """Peers a checkpoint copy is being sent to now (one at a time each)."""

    def start(self, plan: pb.Plan, source: pb.StageAssignment, step: int) -> None:
        """Fetch a copy (`copy`) beside the stage, unless the one before is still coming."""
        if self._fetching.busy:
            log.info("checkpoint copy of step %d skipped: the one before is still coming", step)
            return
        self._fetching.start(self.copy(plan, source, step), name="checkpoint copy")

    async def copy(self, plan: pb.Plan, source: pb.StageAssignment, step: int) -> None:
        """Fetch `source`'s checkpoint at `step` and keep it (CheckpointCopies): checked
        against what `source` trains under `plan`, its size bound and its sha256. A failure is
        logged; the next copy is tried at the next checkpoint."""
        generation = self._copies.generation
        where = f"{source.node_id} ({source.address})"
        model = get_model(plan.run.model)
        bound = bytes_bound(model, source.first_block, source.stop_block)
        expected = (model.name, source.first_block, source.stop_block, run_key(plan.run))
        received = _Received(step, where, expected, bound)
        connect_s = self._transport.connect_timeout_s
        # All of it within the connect timeout plus what it takes at COPY_MIN_BPS: a peer that
        # trickles cannot hold the copies up for ever.
        whole_s = 3 * connect_s + bound * 8 / COPY_MIN_BPS
        request = pb.CheckpointRequest(node_id=self.node_id, plan_epoch=plan.epoch, step=step)
        try:
            channel_cm = open_channel(source.address, self._transport)
            async with asyncio.timeout(whole_s), channel_cm as channel:
                call = pb_grpc.NodeStub(channel).FetchCheckpoint(request)
                # The source may still be writing it: the first chunk may take longer.
                async for chunk in read_chunks(call, what=where, first_timeout_s=3 * connect_s,
                                               timeout_s=connect_s):  # fmt: skip
                    received.add(chunk)
            manifest, data = received.whole()
            await asyncio.to_thread(self._copies.store, manifest, data, generation, model)
        except (CheckpointError, OSError) as exc:
            log.warning("checkpoint copy of step %d not kept: %s", step, exc)
            return
        except TimeoutError:
            log.warning("checkpoint copy of step %d from %s: too slow (all of it must come "
                        "within %.0f s)", step, where, whole_s)  # fmt: skip
            return
        except PeerError as exc:
            self._changes.raise_if_stopping()
            log.warning("checkpoint copy of step %d: %s", step, exc)
            return
        log.info("kept a copy of %s's checkpoint of blocks [%d, %d) at step %d (%.1f MB)",
                 source.node_id, manifest.first_block, manifest.stop_block, step,
                 manifest.bytes / 1e6)  # fmt: skip

    async def serve(
        self,
        request: pb.CheckpointRequest,
        store: CheckpointDir,
        written: Callable[[], bool],
        pace_bps: float | None = None,
    ) -> AsyncIterator[pb.CheckpointChunk]:
        """This node's checkpoint in `store` at `request.step` for the peer that keeps its
        copies (the caller checked it is): waited for (`written`, within twice the connect
        timeout) if it is being written, sent at `pace_bps` at most (at least COPY_MIN_BPS;
        None: as fast as the link goes); Refusal (before any chunk) if it is not there, or a
        copy to the peer is under way."""
        if request.node_id in self._serving:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "a copy to this peer is under way")
        await self._changes.wait_within(
            written,
            f"no checkpoint at step {request.step} yet",
            timeout_s=2 * self._transport.connect_timeout_s,
        )
        self._serving.add(request.node_id)
        try:
            try:
                manifest = await asyncio.to_thread(store.manifest, request.step)
                f = await asyncio.to_thread(store.open_tensors, manifest)
            except CheckpointError as exc:
                raise Refusal(grpc.StatusCode.NOT_FOUND, str(exc)) from None
            with f:
                chunk_bytes = min(CHUNK_BYTES, self._transport.max_message_bytes // 2)
                if pace_bps is not None:
                    chunk_bytes = min(chunk_bytes, PACED_CHUNK_BYTES)
                    pace_bps = max(pace_bps, 2 * COPY_MIN_BPS)
                loop = asyncio.get_running_loop()
                start_s, sent = loop.time(), 0
                async for chunk in serve_chunks(_file_chunks(f, manifest, chunk_bytes)):
                    if pace_bps is not None:  # each chunk when the ones before are due
                        await asyncio.sleep(max(0.0, start_s + sent * 8 / pace_bps - loop.time()))
                    yield chunk
                    sent += len(chunk.data)
        finally:
            self._serving.discard(request.node_id)

    def stop(self) -> None:
        """The node stops: a copy being fetched ends."""
        self._fetching.cancel()

    async def close(self) -> None:
        """Wait (a moment) for a copy being fetched to end."""
        await self._fetching.close(CLOSE_WAIT_S)
