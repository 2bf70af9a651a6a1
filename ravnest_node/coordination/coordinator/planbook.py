"""The coordinator's plan book: the current, pending and previous plans, the phase the run's
plans are in, the drains of the current plan and where each plan ended, and its broken
pipelines. Pure: what to plan is decided in replan.py and recovery.py; this keeps the record
and refuses what does not fit it.

The phases (`Phase`), and what moves between them:

```
FORMING --publish--> RUNNING --announce--> ANNOUNCED --switch/restore--> RUNNING
FORMING --take_over--> TAKING_OVER --every member back--> RUNNING
RUNNING/ANNOUNCED --the run ends under this plan--> LAST
```

Publishing and switching are moves, not phases; announcing and draining are one phase
(the first stages drain from the moment a newer plan is announced).
"""

from __future__ import annotations

import enum

import grpc

from ravnest_node.coordination.planning.placement import SwarmPlan
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.errors import Refusal

__all__ = ["Phase", "PlanBook"]


class Phase(enum.Enum):
    """Where the run's plans are."""

    FORMING = "forming"
    """No plan yet: members join and say what they measured."""
    TAKING_OVER = "taking over"
    """After a failover election: the plan taken over waits for its members to come back."""
    RUNNING = "running"
    """The current plan trains; no newer plan is announced."""
    ANNOUNCED = "announced"
    """A newer plan is pending: the current plan's pipelines drain to the step it starts at."""
    LAST = "last"
    """The run ends under the current plan: no newer plan is made, nor one announced started.
    (A plan announced before stays pending; nothing makes it the current one.)"""


class PlanBook:
    """The plans of one coordinator's run. `first_epoch`: the epoch of its first plan (1, or
    the election term it won)."""

    def __init__(self, first_epoch: int = 1) -> None:
        self.phase = Phase.FORMING
        self.first_epoch = first_epoch
        self.current: pb.Plan | None = None
        self.placed: SwarmPlan | None = None
        """The planner's answer for the current plan (its predicted step time)."""
        self.pending: pb.Plan | None = None
        """A newer plan, announced (pending) while the current one's pipelines drain."""
        self.pending_placed: SwarmPlan | None = None
        self.previous: pb.Plan | None = None
        """The plan before the current one (its stages report their last steps late)."""
        self.considered: dict[int, frozenset[str]] = {}
        """The members each plan epoch was negotiated from (its spares are the ones in no
        stage): a plan is made again only when they change."""
        self.drains: dict[int, int] = {}
        """Pipeline -> the step its first stage stops feeding at."""
        self.ends: dict[int, int] = {}
        """Epoch -> the step that plan ended at."""
        self.broken: set[int] = set()
        """Pipelines of the current plan that lost a member: they are not waited for."""
        self.broken_in: dict[int, set[int]] = {}
        """Plan epoch -> its broken pipelines (a late Drain from one is refused)."""
        self.banned: set[str] = set()
        """Members banned for failing audits (bans.py): every plan announced names them."""
        self.revocations = b""
        """The authority's newest revocation list (transport/membership.py): every plan
        announced carries it."""
        self.announcements: list[pb.Plan] = []
        """Every plan WatchPlan announced, in order (a copy as it was then: a pending plan,
        and later the same epoch started)."""
        self.epoch_floor = 0
        """Plan epochs at or below this are taken (known to members of a taken-over run)."""

    # ----- moves between phases ---------------------------------------------------------------
    def adopt(self, plan: pb.Plan, placed: SwarmPlan | None) -> None:
        """`plan` is the current plan now (published, switched to, or a restore's)."""
        self.current, self.placed = plan, placed
        self._announce(plan)
        if self.phase is not Phase.LAST:
            self.phase = Phase.RUNNING

    def resume(self, plan: pb.Plan, broken: set[int]) -> None:
        """The current plan a store held; `broken`: its pipelines that lost a member."""
        self.current = plan
        self._announce(plan)
        self.phase = Phase.RUNNING
        self.broken = broken
        if broken:
            self.broken_in[plan.epoch] = set(broken)

    def take_over(self, plan: pb.Plan, known_epoch: int) -> None:
        """`plan`, taken over after a failover election, waits for its members; the plans
        made after it start above `known_epoch` too."""
        assert self.phase is Phase.FORMING
        self.current = plan
        self.epoch_floor = max(plan.epoch, known_epoch)
        self._announce(plan)
        self.phase = Phase.TAKING_OVER

    def takeover_done(self) -> None:
        assert self.phase is Phase.TAKING_OVER
        self.phase = Phase.RUNNING

    def announce(self, plan: pb.Plan, placed: SwarmPlan, *, keep_drains: bool) -> None:
        """`plan` (pending) is to follow the current one once its pipelines have drained.
        Drains already said stay valid with `keep_drains` (they are about the current plan)."""
        assert self.phase is Phase.RUNNING
        self.pending, self.pending_placed = plan, placed
        if not keep_drains:
            self.drains = {}
        self._announce(plan)
        self.phase = Phase.ANNOUNCED

    def announce_again(self) -> None:
        """Announce the newest plan again (a pending one, or the current), as it is now: with
        the newest revocation list."""
        newest = self.pending if self.pending is not None else self.current
        if newest is not None:
            self._announce(newest)

    def drop_pending(self) -> None:
        """The pending plan counted on someone gone: it is made again."""
        self.pending = None
        if self.phase is Phase.ANNOUNCED:
            self.phase = Phase.RUNNING

    def switch(self, epoch: int) -> tuple[pb.Plan, SwarmPlan | None, int, list[int]]:
        """Every healthy pipeline of plan `epoch` (the current one) has drained: it ends at the
        furthest of their steps. The pending plan, the planner's answer for it, that step, and
        the broken pipelines (their steps up to it are dropped); the caller adopts the plan or
        closes."""
        new = self.pending
        assert new is not None
        stop = max(self.drains.values())
        self.ends[epoch] = stop
        self.drop_pending()
        self.drains = {}
        broken, self.broken = sorted(self.broken), set()
        return new, self.pending_placed, stop, broken

    def end_at(self, epoch: int, step: int, pipelines: int) -> None:
        """Plan `epoch` (the current one) is rolled back to `step` (a restore): its stages'
        later reports are refused, and its first stages are told to drop their work, not to
        drain."""
        self.ends[epoch] = step
        self.broken_in[epoch] = set(range(pipelines))
        self.drop_pending()
        self.drains, self.broken = {}, set()

    def close(self) -> None:
        """The run ends under the current plan."""
        self.phase = Phase.LAST

    # ----- the current plan's pipelines -------------------------------------------------------
    def break_pipelines(self, epoch: int, broken: set[int]) -> None:
        """`broken` pipelines of plan `epoch` (the current one) lost a member: not drained, nor
        waited for."""
        self.broken = broken
        self.broken_in[epoch] = set(broken)
        for p in broken:
            self.drains.pop(p, None)

    def drained(self, pipelines: int) -> bool:
        """Every healthy pipeline of the current plan has drained."""
        healthy = set(range(pipelines)) - self.broken
        return bool(healthy) and healthy <= set(self.drains)

    def is_dropped(self, epoch: int, pipeline: int) -> bool:
        """`pipeline` of plan `epoch` lost a member, or was rolled back: not drained but
        dropped."""
        return pipeline in self.broken_in.get(epoch, ())

    def next_epoch(self, plan: pb.Plan) -> int:
        """The epoch of a plan after `plan` (and after a pending one, and any a member of a
        taken-over run knew)."""
        pending = self.pending.epoch if self.pending else 0
        return max(plan.epoch, pending, self.epoch_floor) + 1

    def raise_floor(self, epoch: int) -> None:
        self.epoch_floor = max(self.epoch_floor, epoch)

    def started(self) -> list[pb.Plan]:
        """Every plan of the run that started, in order (copies as they started: one announced
        again, with a revocation list, is listed once)."""
        seen: set[int] = set()
        started = []
        for plan in self.announcements:
            if not plan.pending and plan.epoch not in seen:
                seen.add(plan.epoch)
                started.append(plan)
        return started

    def plan_of_report(self, epoch: int, step: int, done: bool) -> pb.Plan:
        """The plan a stage report of plan `epoch` at `step` (`done`: its final one) is for:
        the current one, or the previous one up to the step it ended at. Refusal
        FAILED_PRECONDITION otherwise."""
        plan, previous = self.current, self.previous
        if plan is not None and previous is not None and epoch == previous.epoch:
            # The previous plan's stages report their last steps after the switch.
            end = self.ends.get(previous.epoch, 0)
            if done or step > end:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"plan epoch {epoch} ended at step {end}")  # fmt: skip
            plan = previous
        if plan is None or epoch != plan.epoch:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "report for an unknown plan")
        return plan

    def _announce(self, plan: pb.Plan) -> None:
        copy = pb.Plan()
        copy.CopyFrom(plan)
        copy.banned[:] = sorted(self.banned)
        copy.revocations = self.revocations
        self.announcements.append(copy)
