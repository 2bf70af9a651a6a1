"""The network side of a stage's audits (pipeline/audit.py, pipeline/auditor.py): fetching a
neighbour's record of a microbatch (`Node.AuditRecord`), serving this stage's own to its
neighbours, and reporting a neighbour that failed twice to the coordinator
(`Coordinator.ReportAudit`).

Only the stage's neighbours under the current plan get its records (the caller's node id,
proven; transport/proofs.py), each at most MAX_SERVING at a time: a record holds the stage's
weights (in int8-block, a quarter of their float32 bytes), and serving one costs a copy of
them. A record goes at the pace of a checkpoint copy (COPY_SHARE of the measured link): it
is not on the critical path, the boundary streams are.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial

import grpc

from ravnest_node.coordination.planning.static_plan import stage_at
from ravnest_node.daemon.worker.checkpoint_copies import PACED_CHUNK_BYTES
from ravnest_node.models import BlockModel
from ravnest_node.pipeline.auditor import Auditor
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.stage import StageRuntime
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.chunks import read_chunks, serve_chunks
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.options import TransportConfig, open_channel

__all__ = ["AuditLinks", "neighbour"]

log = logging.getLogger(__name__)

MAX_SERVING = 2
"""Records this node serves one neighbour at once."""


def neighbour(plan: pb.Plan, me: pb.StageAssignment, step: int) -> pb.StageAssignment | None:
    """The stage `step` places after `me` in its pipeline (-1: upstream, 1: downstream)."""
    return stage_at(plan, me.pipeline, me.index + step)


class AuditLinks:
    """Fetches, serves and reports for the audits of node `node_id`'s stage."""

    def __init__(
        self,
        node_id: str,
        transport: TransportConfig,
        report: Callable[[pb.AuditReport], Awaitable[pb.AuditReply]],
    ) -> None:
        self._node_id = node_id
        self._transport = transport
        self._report_to = report
        self._serving: dict[str, int] = {}

    def auditor(
        self, plan: pb.Plan, me: pb.StageAssignment, run: TrainConfig, model: BlockModel
    ) -> Auditor | None:
        """The auditor of this node's stage `me` of `plan` (None in a run without audits)."""
        if not run.audit_share:
            return None
        up, down = neighbour(plan, me, -1), neighbour(plan, me, 1)
        return Auditor(
            run, model,
            fetch_upstream=partial(self._fetch, plan, up) if up is not None else None,
            fetch_downstream=partial(self._fetch, plan, down) if down is not None else None,
            report=partial(self._report, plan, up, down),
        )  # fmt: skip

    async def _fetch(
        self, plan: pb.Plan, peer: pb.StageAssignment, backward: bool, seq: int
    ) -> bytes:
        request = pb.AuditRecordRequest(node_id=self._node_id, plan_epoch=plan.epoch, seq=seq,
                                        backward=backward)  # fmt: skip
        connect_s = self._transport.connect_timeout_s
        limit = self._transport.max_message_bytes * 16
        data = bytearray()
        async with open_channel(peer.address, self._transport) as channel:
            call = pb_grpc.NodeStub(channel).AuditRecord(request)
            what = f"audit record of {peer.node_id}"
            chunks = read_chunks(call, what=what, first_timeout_s=3 * connect_s,
                                 timeout_s=connect_s)  # fmt: skip
            async for chunk in chunks:
                data += chunk.data
                if len(data) > limit:
                    raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "audit record too large")
        return bytes(data)

    async def _report(
        self,
        plan: pb.Plan,
        up: pb.StageAssignment | None,
        down: pb.StageAssignment | None,
        backward: bool,
        record: bytes,
        received: bytes,
        distance: float,
    ) -> None:
        suspect = down if backward else up
        assert suspect is not None
        report = pb.AuditReport(node_id=self._node_id, plan_epoch=plan.epoch,
                                suspect_id=suspect.node_id, record=record, received=received,
                                distance=distance)  # fmt: skip
        reply = await self._report_to(report)
        log.warning("reported %s (pipeline %d stage %d) to the coordinator: its recomputation "
                    "there is %.3g away; %s", suspect.node_id, suspect.pipeline, suspect.index,
                    reply.distance, "banned" if reply.banned else "not banned")  # fmt: skip

    async def serve(
        self,
        request: pb.AuditRecordRequest,
        plan: pb.Plan | None,
        runtime: StageRuntime | None,
        pace_bps: float | None = None,
    ) -> AsyncIterator[pb.AuditChunk]:
        """This stage's record of a microbatch, for a neighbour under the current plan, sent
        at `pace_bps` at most (None: as fast as the link goes; the worker gives the pace of
        checkpoint copies, a share of the measured link, so that the boundary streams keep
        the rest); Refusal (before any chunk) otherwise."""
        if plan is None or runtime is None or request.plan_epoch != plan.epoch:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "not under that plan")
        me = next((s for s in plan.stages if s.node_id == self._node_id), None)
        peers = [neighbour(plan, me, d) for d in (-1, 1)] if me is not None else []
        if not any(p is not None and p.node_id == request.node_id for p in peers):
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, "only a neighbour audits a stage")
        record = runtime.audit_record(request.backward, request.seq)
        if record is None:
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"no record of microbatch {request.seq}")
        if self._serving.get(request.node_id, 0) >= MAX_SERVING:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "audits of this peer under way")
        self._serving[request.node_id] = self._serving.get(request.node_id, 0) + 1
        try:
            data = await asyncio.to_thread(record.to_bytes)
            size = max(1, self._transport.max_message_bytes // 2)
            if pace_bps is not None:
                size = min(size, PACED_CHUNK_BYTES)
            loop = asyncio.get_running_loop()
            start_s, sent = loop.time(), 0
            async for chunk in serve_chunks(_chunks(data, size)):
                if pace_bps is not None:  # each chunk when the ones before are due
                    await asyncio.sleep(max(0.0, start_s + sent * 8 / pace_bps - loop.time()))
                yield chunk
                sent += len(chunk.data)
        finally:
            self._serving[request.node_id] -= 1


def _chunks(data: bytes, size: int) -> Iterator[pb.AuditChunk]:
    view = memoryview(data)
    for start in range(0, len(data), size):
        yield pb.AuditChunk(data=bytes(view[start : start + size]))
