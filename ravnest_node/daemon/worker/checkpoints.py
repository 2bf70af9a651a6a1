"""A worker's checkpoint keeper: its stage's checkpoints, and its copies of its upstream's.

A stage writes a checkpoint every few steps, when its plan ends and when the node stops, one at
a time in a worker thread (a slow disk holds the stage up rather than piling copies up in
memory). The keeper loads what a plan that resumes or restores the run says this node holds at
its start, offers what it holds in its heartbeats (the coordinator restores a run from them),
and holds everything while a restore is being planned (checkpoint.Retention).

A stage without a replica has no other copy of its state: the next stage's node keeps copies
of its checkpoints (daemon/worker/checkpoint_copies.py), so that a restore finds them when it
is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import grpc

from ravnest_node.blocks import BlockWeights
from ravnest_node.checkpoint import (
    CheckpointCopies,
    CheckpointDir,
    CheckpointError,
    Manifest,
    run_key,
)
from ravnest_node.coordination.planning.static_plan import stage_at
from ravnest_node.daemon.worker.changes import Changes
from ravnest_node.daemon.worker.checkpoint_copies import CheckpointCopier, copier_of
from ravnest_node.errors import RunFailed
from ravnest_node.models import BlockModel, get_model
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import MAX_OFFERS
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.options import TransportConfig

__all__ = ["CheckpointKeeper"]

log = logging.getLogger(__name__)


class CheckpointKeeper:
    """The checkpoints of node `node_id` in `store` (none: it keeps none), and its copies of
    others' beside them."""

    def __init__(
        self,
        *,
        node_id: str,
        store: CheckpointDir | None,
        resume: bool,
        transport: TransportConfig,
        changes: Changes,
    ) -> None:
        self.node_id = node_id
        self.store = store
        self.copies = (
            None if store is None
            else CheckpointCopies(store.path.parent, retention=store.retention)
        )  # fmt: skip
        """Copies of the upstream stage's checkpoints (a stage without a replica)."""
        self.checkpoint_step = 0
        """Step of the newest checkpoint this node has written (reported to the coordinator)."""
        self.model_name = ""
        """The swarm's model (its checkpoints of others are not offered)."""
        self._resume = resume
        self._changes = changes
        self._offering = False
        """Heartbeats carry this node's checkpoints once its first plan has set aside those
        that are not of the run."""
        self._offers: list[pb.CheckpointOffer] = []
        self._run_key = ""
        """The run this node's plans have been of (its first plan's `run_key`): a node that
        joins again in-process offers that run's checkpoints (`rejoin_offers`)."""
        self._writing: asyncio.Task[None] | None = None
        """The checkpoint being written (one at a time, in a worker thread)."""
        self._write_lock = asyncio.Lock()
        self._copier = (
            None if self.copies is None
            else CheckpointCopier(node_id=node_id, copies=self.copies, transport=transport,
                                  changes=changes)
        )  # fmt: skip

    # ----- what the heartbeats say ------------------------------------------------------------
    @property
    def held_epoch(self) -> int:
        """The broken plan whose restore this node holds its checkpoints for (0: none)."""
        return self.store.retention.held_epoch if self.store is not None else 0

    def offers(self) -> list[pb.CheckpointOffer]:
        """What this node holds now (its checkpoints and copies of the swarm's model, newest
        first, checked for form), for its heartbeats; none before its first plan. Blocking
        (reads the manifests). A disk that cannot be read keeps the last list."""
        if self.store is None or self.copies is None or not self._offering:
            return []
        try:
            found = self.store.manifests() + self.copies.manifests()
        except OSError as exc:  # a copy folder replaced meanwhile, or a failing disk
            log.warning("cannot list this node's checkpoints: %s", exc)
            return self._offers
        model = get_model(self.model_name)
        found = [m for m in found if m.model == model.name and m.stop_block <= model.num_blocks()]
        found.sort(key=lambda m: m.step, reverse=True)
        self._offers = [m.offer() for m in found[:MAX_OFFERS]]
        return self._offers

    async def hold(self, epoch: int) -> bool:
        """The coordinator plans a restore from the broken plan `epoch`: keep every checkpoint
        and copy this node has until a newer plan comes (checkpoint.Retention). True if this
        hold is new (the next heartbeat says it holds them)."""
        if self.store is None or epoch == 0:
            return False
        if not await asyncio.to_thread(self.store.retention.hold, epoch):
            return False
        log.info("a restore is being planned: this node keeps its checkpoints until a plan "
                 "newer than epoch %d", epoch)  # fmt: skip
        return True

    def release(self, plan_epoch: int) -> None:
        """Plan `plan_epoch` has come: a hold for a restore older than it ends."""
        if self.store is not None:
            self.store.retention.release(plan_epoch)

    def verified_offers(self, model: BlockModel) -> list[pb.CheckpointOffer]:
        """Every checkpoint and copy here that loads, newest first (at most MAX_OFFERS), for
        a node that resumes (--resume); none otherwise. Blocking."""
        if not self._resume or self.store is None or self.copies is None:
            return []
        found = self.store.verified(model)
        found += [m for d in self.copies.dirs() for m in d.verified(model)]
        found.sort(key=lambda m: m.step, reverse=True)
        log.info("--resume: offering checkpoints at steps %s",
                 [m.step for m in found] or "(none)")  # fmt: skip
        return [m.offer() for m in found[:MAX_OFFERS]]

    def rejoin_offers(self) -> list[pb.CheckpointOffer]:
        """For a node that joins again without a restart (the coordinator counted it out
        while it was cut off): every checkpoint and copy here of the run its plans were of
        (same `run_key`) that loads, newest first (at most MAX_OFFERS), without --resume;
        none before its first plan. Blocking."""
        if self.store is None or self.copies is None or not self._run_key:
            return []
        model = get_model(self.model_name)
        found = self.store.verified(model)
        found += [m for d in self.copies.dirs() for m in d.verified(model)]
        found = [m for m in found if m.run_key == self._run_key]
        found.sort(key=lambda m: m.step, reverse=True)
        log.info("joining again: offering checkpoints at steps %s",
                 [m.step for m in found] or "(none)")  # fmt: skip
        return [m.offer() for m in found[:MAX_OFFERS]]

    # ----- a plan's start ---------------------------------------------------------------------
    async def start_plan(self, plan: pb.Plan) -> dict[int, BlockWeights] | None:
        """The first plan this node gets, or a plan that restores the run from checkpoints:
        checkpoints newer than its start are set aside (a run that starts there must never
        resume from another timeline; copies of them are removed), and the blocks the plan
        says this node holds at its start are loaded from its checkpoints or copies (verified
        again), to serve; None if it holds none. RunFailed if they do not load."""
        store, copies = self.store, self.copies
        if store is None or copies is None:
            self._offering = True
            return None
        self._run_key = run_key(plan.run)
        step = plan.start_step
        # What this node keeps from before: with --resume or on a restore, its timeline up to
        # the plan's start; otherwise nothing (another run's checkpoints may share this run's
        # key, and must never be offered to a restore).
        keep = step if self._resume or plan.restore else 0
        store.hold = step  # a write of the dropped timeline may land now: it must not prune it
        try:
            await self.flush()  # ... and it lands before the move
            aside, folder = await asyncio.to_thread(store.set_aside_after, keep)
        finally:
            store.hold = None
        if aside:
            log.warning("checkpoints at steps %s are newer than where this run starts (step "
                        "%d): moved to %s", aside, keep, folder)  # fmt: skip
        await asyncio.to_thread(copies.drop_after, keep)
        self.checkpoint_step = max(await asyncio.to_thread(store.steps), default=0)
        self._offering = True
        mine = [h for h in plan.previous if h.node_id == self.node_id]
        if step == 0 or not mine:
            return None
        held = await self._load_held(plan, mine)
        self.checkpoint_step = step
        return held

    async def _load_held(
        self, plan: pb.Plan, mine: list[pb.StageAssignment]
    ) -> dict[int, BlockWeights]:
        """The blocks of `mine` (what this node held before `plan`) at the plan's start."""
        step = plan.start_step
        model = get_model(plan.run.model)
        held: dict[int, BlockWeights] = {}
        for h in mine:
            try:
                found, blocks, where = await asyncio.to_thread(
                    self._load, step, h.first_block, h.stop_block, model
                )
            except CheckpointError as exc:
                raise RunFailed(f"cannot start at step {step}: {exc}") from None
            if found.run_key != run_key(plan.run):
                raise RunFailed(f"cannot start at step {step}: the checkpoint of blocks "
                                f"[{h.first_block}, {h.stop_block}) is of another run")  # fmt: skip
            held |= blocks
            log.info("%s at step %d: serving blocks [%d, %d) from %s",
                     "restoring" if plan.restore else "resuming", step, h.first_block,
                     h.stop_block, where)  # fmt: skip
        return held

    def _load(
        self, step: int, first_block: int, stop_block: int, model: BlockModel
    ) -> tuple[Manifest, dict[int, BlockWeights], Path]:
        """This node's checkpoint, or copy of one, of blocks [first_block, stop_block) at
        `step`, verified, and the folder it is in. Blocking."""
        assert self.store is not None and self.copies is not None
        refused: list[str] = []
        for store in (self.store, self.copies.dir(first_block, stop_block)):
            try:
                found = store.manifest(step)
                if (found.first_block, found.stop_block) != (first_block, stop_block):
                    continue
                started = time.monotonic()
                log.info("loading the checkpoint of blocks [%d, %d) at step %d from %s "
                         "(%.1f MB)", first_block, stop_block, step, store.path,
                         found.bytes / 1e6)  # fmt: skip
                loaded = store.load(step, model)
                log.info("checkpoint at step %d loaded and verified in %.1f s", step,
                         time.monotonic() - started)  # fmt: skip
                return (*loaded, store.path)
            except CheckpointError as exc:
                refused.append(str(exc))
        raise CheckpointError(
            f"no checkpoint of blocks [{first_block}, {stop_block}) at step "
            f"{step} loads here" + (f": {refused[-1]}" if refused else "")
        )

    # ----- writes -----------------------------------------------------------------------------
    async def write(self, step: int, blocks: dict[int, BlockWeights], plan: pb.Plan) -> None:
        """Start writing a checkpoint of `blocks` at `step` in a worker thread, once the one
        before it is written: one write at a time (a slow disk holds the stage up rather than
        piling copies up in memory)."""
        if self.store is None or step == 0 or not blocks:
            return
        me = next(s for s in plan.stages if s.node_id == self.node_id)
        save = partial(
            self.store.save,
            blocks,
            step=step,
            run=plan.run,
            pipeline=me.pipeline,
            stage=me.index,
            plan_epoch=plan.epoch,
        )
        async with self._write_lock:
            if self._writing is not None:
                await asyncio.wait([self._writing])  # never cancels the write, even if cancelled
            self._writing = asyncio.create_task(self._write(save), name="checkpoint write")

    async def _write(self, save: partial[Manifest]) -> None:
        """Write one checkpoint; a failure (a full disk) is logged loudly, and training goes
        on."""
        try:
            manifest = await asyncio.to_thread(save)
        except Exception as exc:
            log.error("checkpoint not written: %s", exc)
            return
        self.checkpoint_step = max(self.checkpoint_step, manifest.step)
        await self._changes.notify()  # a copy may be waiting for it (FetchCheckpoint)
        log.info("checkpoint of blocks [%d, %d) at step %d written (%.1f MB)",
                 manifest.first_block, manifest.stop_block, manifest.step,
                 manifest.bytes / 1e6)  # fmt: skip

    async def flush(self) -> None:
        """Wait until every checkpoint started so far is on disk."""
        async with self._write_lock:  # a write being started is started
            task = self._writing
        if task is not None:
            await asyncio.wait([task])  # never cancels the write, even if this wait is

    async def stage_checkpoint(
        self,
        step: int,
        blocks: dict[int, BlockWeights],
        *,
        plan: pb.Plan,
        me: pb.StageAssignment,
    ) -> None:
        """The stage's periodic checkpoint (and its run-end one): write it, and copy the
        upstream stage's checkpoint of that step if no replica holds that stage."""
        await self.write(step, blocks, plan)
        stages = len(plan.stages) // max(1, plan.run.pipelines)
        if self._copier is None or plan.run.pipelines > 1 or stages < 2:
            return
        if step >= plan.run.steps:  # the run's end: nothing left to restore
            return
        source = stage_at(plan, me.pipeline, (me.index - 1) % stages)
        assert source is not None
        self._copier.start(plan, source, step)

    # ----- copies -----------------------------------------------------------------------------
    async def copy(self, plan: pb.Plan, source: pb.StageAssignment, step: int) -> None:
        """Fetch `source`'s checkpoint at `step` and keep it (CheckpointCopier.copy)."""
        if self._copier is not None:
            await self._copier.copy(plan, source, step)

    async def serve_copy(
        self, request: pb.CheckpointRequest, plan: pb.Plan | None, pace_bps: float | None = None
    ) -> AsyncIterator[pb.CheckpointChunk]:
        """Node.FetchCheckpoint, this node training under `plan`: a member of that plan copies
        its checkpoint at `request.step`, waited for (within twice the connect timeout) if it
        is being written, sent at `pace_bps` at most; Refusal (before any chunk) otherwise."""
        store = self.store
        if store is None or self._copier is None:
            raise Refusal(grpc.StatusCode.NOT_FOUND, "this node keeps no checkpoints")
        if plan is None or plan.epoch != request.plan_epoch:
            raise Refusal(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node does not train under plan epoch {request.plan_epoch}",
            )
        if request.node_id != copier_of(plan, self.node_id):
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"peer {request.node_id[:80]!r} does not keep this node's checkpoint copies "
                f"under plan epoch {plan.epoch}",
            )
        async for chunk in self._copier.serve(
            request, store, written=lambda: self.checkpoint_step >= request.step, pace_bps=pace_bps
        ):
            yield chunk

    def stop(self) -> None:
        """The node stops: a copy being fetched ends."""
        if self._copier is not None:
            self._copier.stop()

    async def close(self) -> None:
        """Wait (a moment) for a copy being fetched to end. Writes are awaited by `flush`."""
        if self._copier is not None:
            await self._copier.close()
