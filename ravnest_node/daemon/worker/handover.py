"""Blocks handed from one plan to the next (`Node.FetchBlock`), both ways.

When a plan ends at a step boundary, every node keeps the blocks it trained as they were at
that step (`Handover.keep`) and serves them to the members of the next plan (`serve`); each
member builds its new stage from blocks it kept or fetched from the node that held them under
the previous plan (`gather`: first the holder in its own pipeline, then the replicas). A node
leaving the swarm stays until the plan without it has started and its members have fetched
every block it held (`taken_over`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import torch

from ravnest_node.blocks import BlockWeights
from ravnest_node.coordination.planning.static_plan import has_node
from ravnest_node.daemon.worker.changes import Changes
from ravnest_node.errors import PeerError, RunFailed
from ravnest_node.pipeline.handoff import CHUNK_BYTES, BlockAssembler, to_chunks
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.chunks import read_chunks, serve_chunks
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.options import TransportConfig, open_channel

__all__ = ["Handover", "holders"]

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 2.0
"""A block fetch that takes longer logs how far it got this often."""
FETCH_AT_ONCE = 16
"""Blocks a node fetches at once from one holder: within its calls per peer (peer_max_calls)."""


def holders(plan: pb.Plan, me: pb.StageAssignment, block: int) -> list[pb.StageAssignment]:
    """Who held `block` under the plan before `plan`, to fetch it from: first the holder of
    this node's (`me`) pipeline, then replicas. RunFailed if nobody did."""
    found = [s for s in plan.previous if s.first_block <= block < s.stop_block]
    if not found:
        raise RunFailed(f"plan epoch {plan.epoch}: nobody held block {block} before")
    return sorted(found, key=lambda s: s.pipeline != me.pipeline)


@dataclass(slots=True)
class _Gathering:
    """The fetches of one new stage (`me` of `plan`) into its freshly built `blocks`."""

    plan: pb.Plan
    me: pb.StageAssignment
    blocks: list[torch.nn.Module]
    at_once: dict[str, asyncio.Semaphore] = field(default_factory=dict)
    """Per holder: fetches from one holder at once, FETCH_AT_ONCE at most."""


class Handover:
    """The blocks node `node_id` kept when its last plan ended, and the fetches of its next
    stage's. `started` says the newest plan whose start is fixed."""

    def __init__(
        self,
        *,
        node_id: str,
        transport: TransportConfig,
        changes: Changes,
        started: Callable[[], pb.Plan | None],
    ) -> None:
        self.node_id = node_id
        self.held: dict[int, BlockWeights] = {}
        """Blocks this node trained under its last plan, as they were when it ended."""
        self.held_step = -1
        """The step they are at (-1: none yet)."""
        self._handed: set[int] = set()
        """Held blocks a member of the next plan has fetched."""
        self._transport = transport
        self._changes = changes
        self._started = started

    async def keep(self, blocks: dict[int, BlockWeights], step: int) -> None:
        """Hold `blocks`, at `step`, for the next plan's members (none fetched yet)."""
        self.held, self.held_step, self._handed = blocks, step, set()
        await self._changes.notify()

    def taken_over(self, plan: pb.Plan | None) -> bool:
        """`plan` has no stage for this node, starts where its blocks were kept, and its
        members have fetched every one."""
        return (
            plan is not None
            and not has_node(plan.stages, self.node_id)
            and self.held_step == plan.start_step
            and set(self.held) <= self._handed
        )

    # ----- the serving side -------------------------------------------------------------------
    async def serve(self, request: pb.BlockRequest) -> AsyncIterator[pb.BlockChunk]:
        """Node.FetchBlock: a member of plan `request.plan_epoch` asks for a block this node
        kept when its last plan ended; its chunks. Waits (within the connect timeout) for that
        plan and for this node's previous plan to end; Refusal otherwise (before any chunk)."""
        await self._changes.wait_within(
            lambda: (p := self._started()) is not None and p.epoch >= request.plan_epoch,
            f"this node has not seen plan epoch {request.plan_epoch}",
        )
        plan = self._started()
        assert plan is not None
        self._check_request(plan, request)
        await self._changes.wait_within(
            lambda: self.held_step == plan.start_step and request.block in self.held,
            f"block {request.block} is not ready yet (its plan has not ended here)",
            timeout_s=2 * self._transport.connect_timeout_s,  # a pipeline may be catching up
        )
        # A chunk well within the message limit both ends have (its header included).
        chunk_bytes = min(CHUNK_BYTES, self._transport.max_message_bytes // 2)
        async for chunk in serve_chunks(to_chunks(self.held[request.block], chunk_bytes)):
            yield chunk
        if self.held_step == plan.start_step:
            self._handed.add(request.block)
            await self._changes.notify()

    def _check_request(self, plan: pb.Plan, request: pb.BlockRequest) -> None:
        """Refusal unless `request` is for `plan`, from one of its members, for a block this
        node held before it."""
        if plan.epoch != request.plan_epoch:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"plan epoch {request.plan_epoch} is not the current one ({plan.epoch})",
            )
        if not has_node(plan.stages, request.node_id):
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"unknown peer {request.node_id[:80]!r}: not a member of plan epoch {plan.epoch}",
            )
        if not any(s.node_id == self.node_id and s.first_block <= request.block < s.stop_block
                   for s in plan.previous):  # fmt: skip
            raise Refusal(
                grpc.StatusCode.NOT_FOUND, f"this node did not hold block {request.block}"
            )

    # ----- the fetching side ------------------------------------------------------------------
    async def gather(
        self, plan: pb.Plan, me: pb.StageAssignment, blocks: list[torch.nn.Module]
    ) -> dict[int, BlockWeights]:
        """The state of each block of this node's new stage (`me`, its blocks freshly built)
        at the plan's start: kept here, or fetched (in parallel) from the node that held it
        under the previous plan. A block no holder gives: PeerUnavailable / PeerRefused (in an
        exception group)."""
        if plan.start_step == 0:
            return {}
        # Blocks kept here count only if this node trained them under the previous plan (then
        # up to this plan's start: the plan loop checked that).
        trained = has_node(plan.previous, self.node_id)
        kept = {
            b: w for b, w in self.held.items()
            if trained and me.first_block <= b < me.stop_block
        }  # fmt: skip
        wanted = [b for b in range(me.first_block, me.stop_block) if b not in kept]
        gathering = _Gathering(plan, me, blocks)
        async with asyncio.TaskGroup() as tg:
            tasks = {b: tg.create_task(self._fetch(gathering, b)) for b in wanted}
        log.info("plan epoch %d: blocks %s kept, %s fetched", plan.epoch, sorted(kept),
                 sorted(wanted))  # fmt: skip
        return kept | {b: t.result() for b, t in tasks.items()}

    async def _fetch(self, gathering: _Gathering, block: int) -> BlockWeights:
        """The block from its first holder that gives it whole (a holder may be gone)."""
        failed: PeerError | None = None
        sources = holders(gathering.plan, gathering.me, block)
        for holder in sources:
            try:
                limit = gathering.at_once.setdefault(
                    holder.address, asyncio.Semaphore(FETCH_AT_ONCE)
                )
                async with limit:
                    return await self._fetch_from(gathering, block, holder)
            except PeerError as exc:
                if failed is not None or len(sources) > 1:
                    log.warning("%s; trying another holder", exc)
                failed = exc
        assert failed is not None
        raise failed

    async def _fetch_from(
        self, gathering: _Gathering, block: int, holder: pb.StageAssignment
    ) -> BlockWeights:
        where = f"{holder.node_id} ({holder.address})"
        assembler = BlockAssembler(
            block=gathering.blocks[block - gathering.me.first_block], index=block,
            version=gathering.plan.start_step, source=where,
        )  # fmt: skip
        request = pb.BlockRequest(node_id=self.node_id, plan_epoch=gathering.plan.epoch,
                                  block=block)  # fmt: skip
        connect_s = self._transport.connect_timeout_s
        async with open_channel(holder.address, self._transport) as channel:
            call = pb_grpc.NodeStub(channel).FetchBlock(request)
            # No deadline for the whole block (a big one over a slow link takes minutes); the
            # holder may take a while to have it (its pipeline catching up), then each chunk
            # must follow the one before within the connect timeout.
            shown = time.monotonic()
            async for chunk in read_chunks(call, what=f"block {block} from {where}",
                                           first_timeout_s=3 * connect_s,
                                           timeout_s=connect_s):  # fmt: skip
                assembler.add(chunk)
                if time.monotonic() - shown >= PROGRESS_EVERY_S:  # a big block, slowly
                    shown = time.monotonic()
                    done, total = assembler.progress
                    log.info("fetching block %d from %s: %.0f%% (%.1f of %.1f MB)", block,
                             where, 100 * done / total, done / 1e6, total / 1e6)  # fmt: skip
        return assembler.finish()
