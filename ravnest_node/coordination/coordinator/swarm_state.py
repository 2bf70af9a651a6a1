"""What a coordinator knows of its swarm and run, in one place: the run's settings, its pure
parts (roster.py, planbook.py, faults.py, progress.py) and the store that keeps them (a lab
coordinator's; store.py). The decisions that span the parts (replan.py, recovery.py,
member_calls.py, reporting.py) take a `SwarmState`; service.py serves them over gRPC.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ravnest_node.coordination.coordinator.faults import FaultBook
from ravnest_node.coordination.coordinator.planbook import PlanBook
from ravnest_node.coordination.coordinator.progress import RunProgress
from ravnest_node.coordination.coordinator.roster import Roster
from ravnest_node.coordination.coordinator.store import CoordinatorStore, Faults, Saved
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.errors import ConfigError
from ravnest_node.models import BlockModel, get_model, installed_models
from ravnest_node.pipeline.run import TrainConfig, check_swarm_shape
from ravnest_node.proto import control_pb2 as pb

__all__ = ["SwarmState"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SwarmState:
    """One coordinator's swarm and run. Methods run on the event loop and never block but
    for the store's short transactions."""

    train: TrainConfig
    model: BlockModel
    swarm_id: str
    swarm_size: int
    fingerprint: str
    """The run's data set (RunSpec.data_fingerprint)."""
    clock: Callable[[], float]
    summary_path: Path | None
    store: CoordinatorStore | None
    roster: Roster
    book: PlanBook
    faults: FaultBook
    progress: RunProgress
    silence_checked_at: float = -math.inf
    """When `recovery.check_lost` last looked for silent members (on `clock`)."""

    @classmethod
    def create(
        cls,
        *,
        train: TrainConfig,
        swarm_size: int,
        swarm_id: str,
        summary_path: Path | None,
        clock: Callable[[], float],
        epoch: int,
        lease_s: float,
        store: CoordinatorStore | None,
        node_id: str,
        relay_address: str,
    ) -> SwarmState:
        """A new run's state, or with `store`, what it holds (ConfigError if it holds another
        run: a lab coordinator restarted with other settings would hand its nodes a plan they
        did not sign up for)."""
        model = get_model(train.model)
        check_swarm_shape(swarm_size, train)
        roster = Roster(lease_s=lease_s, clock=clock, node_id=node_id, relay_address=relay_address)
        state = cls(
            train=train, model=model, swarm_id=swarm_id, swarm_size=swarm_size,
            fingerprint=model.dataset(seed=train.seed).fingerprint, clock=clock,
            summary_path=summary_path, store=store,
            roster=roster, book=PlanBook(epoch), faults=FaultBook(),
            progress=RunProgress(train, clock),
        )  # fmt: skip
        if store is not None:
            state._open(store)
        return state

    def run_spec(self) -> pb.RunSpec:
        return self.train.to_proto(self.fingerprint)

    def num_blocks(self) -> int:
        return self.model.num_blocks()

    @property
    def model_package(self) -> str:
        """The distribution that provides the run's model here, what a node that lacks it is
        told to install; empty for a built-in or hf: model (JoinReply.model_package)."""
        installed = installed_models().get(self.train.model)
        return installed.project if installed is not None else ""

    def plan_members(self, plan: pb.Plan) -> list[Member]:
        """Who a plan after `plan` has: members that have said what they measured, are alive
        (not lost) and stay, `plan`'s first, then newcomers, each in join order; as many as the
        swarm's shape allows (a multiple of the pipelines, at most one stage a block)."""
        staying = self.roster.staying({s.node_id for s in plan.stages}, self.clock())
        pipelines = self.train.pipelines
        count = min(len(staying) - len(staying) % pipelines, self.num_blocks() * pipelines)
        return staying[:count]

    # ----- the store --------------------------------------------------------------------------
    def save_members(self) -> None:
        if self.store is not None:
            roster = self.roster
            self.store.save_members(roster.members, roster.capabilities)

    def save_faults(self) -> None:
        if self.store is not None:
            f = self.faults
            self.store.save_faults(Faults(
                crashes=list(f.crashes), lost=sorted(self.roster.lost), dropped=f.dropped,
                dropped_steps=f.dropped_steps, restores=list(f.restores), redone=f.redone,
                banned=list(f.banned.values()),
            ))  # fmt: skip

    def _open(self, store: CoordinatorStore) -> None:
        """Carry on from what the store holds, or make it this run's store if it is new."""
        run = self.run_spec()
        saved = store.load()
        if saved.run is None:
            store.create(run=run, swarm_id=self.swarm_id, swarm_size=self.swarm_size)
            return
        differ = [
            f.name for f in pb.RunSpec.DESCRIPTOR.fields
            if getattr(saved.run, f.name) != getattr(run, f.name)
        ]  # fmt: skip
        if saved.swarm_size != self.swarm_size:
            differ.append("swarm_size")
        if saved.swarm_id != self.swarm_id:
            differ.append(f"swarm ({saved.swarm_id})")
        if differ:
            raise ConfigError(
                f"{store.path} holds another run (it differs in {', '.join(differ)}): start "
                "with the settings it was created with, or give another --state-dir"
            )
        self._resume(saved)
        log.info(
            "resumed from %s: %d members, plan epoch %s, %d steps reported",
            store.path,
            len(self.roster.members),
            saved.plan.epoch if saved.plan else "none yet",
            len(self.progress.losses),
        )

    def _resume(self, saved: Saved) -> None:
        now = self.clock()
        self.roster.resume(saved.members, saved.capabilities, now)
        faults, progress = saved.faults, self.progress
        self.faults.resume(
            crashes=faults.crashes, restores=faults.restores, dropped=faults.dropped,
            dropped_steps=faults.dropped_steps, redone=faults.redone, banned=faults.banned,
        )  # fmt: skip
        # Every plan announced from now on names the banned again (not this node: bans.py).
        me = self.roster.node_id
        self.book.banned.update(b.node_id for b in faults.banned if b.node_id != me)
        self.roster.mark_lost(faults.lost, now)
        progress.resume(
            pipeline_losses=saved.pipeline_losses, dropped_steps=faults.dropped_steps,
            bytes_sent=saved.bytes_sent, finals=saved.finals, events=saved.events,
        )  # fmt: skip
        if saved.plan is not None:
            # Pipelines of the plan that lost a member stay broken.
            self.book.resume(saved.plan, self.faults.broken_in(saved.plan.epoch))
            progress.start(now - max(0.0, time.time() - saved.started_unix), saved.started_unix)
            if not progress.losses:
                progress.resumed_at = saved.plan.start_step
