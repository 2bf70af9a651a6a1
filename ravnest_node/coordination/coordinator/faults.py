"""The coordinator's record of faults and what it decides from it: members lost (`Crash`), a
failover's takeover (`Takeover`), restores from checkpoints (`Restore`, and `PendingRestore`
while one waits), and the microbatches dropped or trained again. Pure: no sockets, no clock
(callers pass `now`).

Crashes, restores and bans are stored as JSON objects by the lab coordinator's store
(store.py); `to_dict` / `from_dict` are that format, and the run summary's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ravnest_node.coordination.planning.negotiate import check_offers
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.errors import ConfigError
from ravnest_node.proto import control_pb2 as pb

__all__ = [
    "Ban",
    "Crash",
    "FaultBook",
    "PendingRestore",
    "Restore",
    "Revoked",
    "Takeover",
    "as_count",
    "as_text",
    "ban_from_dict",
]

log = logging.getLogger(__name__)


def as_text(value: object) -> str:
    """`value`, a string; TypeError otherwise (a store that does not parse)."""
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def as_count(value: object) -> int:
    """`value`, a count (an int >= 0, not a bool); TypeError otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"expected a count, got {value!r}")
    return value


def as_number(value: object) -> float:
    """`value`, a finite number (not a bool); TypeError otherwise."""
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Crash:
    """A member with a stage lost mid-run: who, its stage, the plan, and the last step every
    pipeline had completed then."""

    node_id: str
    pipeline: int
    stage: int
    plan_epoch: int
    after_step: int

    def to_dict(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "pipeline": self.pipeline, "stage": self.stage,
                "plan_epoch": self.plan_epoch, "after_step": self.after_step}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Crash:
        """KeyError / TypeError if `data` is not what `to_dict` makes."""
        return cls(as_text(data["node_id"]), as_count(data["pipeline"]),
                   as_count(data["stage"]), as_count(data["plan_epoch"]),
                   as_count(data["after_step"]))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Restore:
    """A restore from checkpoints after a member without a replica was lost: the plan that
    restored, who was lost, the last step completed before (None: unknown, a run taken
    over), the step restored, the microbatches trained again, and who held which blocks
    (first block, stop block, node id)."""

    plan_epoch: int
    lost: tuple[str, ...]
    after_step: int | None
    restored_step: int
    redone_microbatches: int
    holders: tuple[tuple[int, int, str], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan_epoch": self.plan_epoch, "lost": list(self.lost), "after_step": self.after_step,
            "restored_step": self.restored_step,
            "redone_microbatches": self.redone_microbatches,
            "holders": [list(h) for h in self.holders],
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Restore:
        """KeyError / TypeError / ValueError if `data` is not what `to_dict` makes."""
        after, lost, holders = data["after_step"], data["lost"], data["holders"]
        if not isinstance(lost, list) or not isinstance(holders, list):
            raise TypeError("expected lists of who was lost and who held the blocks")
        held = []
        for holder in holders:
            first, stop, node_id = holder  # ValueError if not three
            held.append((as_count(first), as_count(stop), as_text(node_id)))
        return cls(
            plan_epoch=as_count(data["plan_epoch"]),
            lost=tuple(as_text(n) for n in lost),
            after_step=None if after is None else as_count(after),
            restored_step=as_count(data["restored_step"]),
            redone_microbatches=as_count(data["redone_microbatches"]),
            holders=tuple(held),
        )


@dataclass(slots=True)
class Takeover:
    """This coordinator won failover election `term` and took plan `plan_epoch` over from
    `lost_coordinator`: who of that plan it waits for, who restarted meanwhile, and who has
    rejoined (a heartbeat with its offers then makes it back)."""

    term: int
    plan_epoch: int
    lost_coordinator: tuple[str, ...]
    waiting: set[str]
    restarted: set[str] = field(default_factory=set)
    rejoined: set[str] = field(default_factory=set)

    def to_dict(self) -> dict[str, Any]:
        """For the run summary."""
        return {"term": self.term, "plan_epoch": self.plan_epoch,
                "lost_coordinator": list(self.lost_coordinator)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class PendingRestore:
    """A restore from checkpoints that found no step yet: tried again on each heartbeat."""

    plan_epoch: int
    lost: tuple[pb.StageAssignment, ...]
    since: float


@dataclass(frozen=True, slots=True)
class Ban:
    """A member banned for computing wrong, with the evidence."""

    node_id: str
    pipeline: int
    stage: int
    plan_epoch: int
    after_step: int
    """Steps every pipeline had completed when it was banned."""
    auditor: str
    kind: str
    """What failed: "activation" or "input gradient"."""
    seq: int
    version: int
    distance: float
    """The auditor's relative distance."""
    recomputed: float
    """The coordinator's."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "pipeline": self.pipeline, "stage": self.stage,
            "plan_epoch": self.plan_epoch, "after_step": self.after_step,
            "auditor": self.auditor, "kind": self.kind, "microbatch": self.seq,
            "version": self.version, "distance": self.distance, "recomputed": self.recomputed,
            "reason": f"its {self.kind} of microbatch {self.seq} (weights version "
                      f"{self.version}) is {self.recomputed:.3g} from its recomputation",
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Ban:
        """KeyError / TypeError if `data` is not what `to_dict` makes (its reason is not
        read: `to_dict` makes it again)."""
        return cls(as_text(data["node_id"]), as_count(data["pipeline"]),
                   as_count(data["stage"]), as_count(data["plan_epoch"]),
                   as_count(data["after_step"]), as_text(data["auditor"]),
                   as_text(data["kind"]), as_count(data["microbatch"]),
                   as_count(data["version"]), as_number(data["distance"]),
                   as_number(data["recomputed"]))  # fmt: skip


@dataclass(frozen=True, slots=True)
class Revoked:
    """A member the swarm's authority revoked (transport/membership.py)."""

    node_id: str
    serial: int
    """The revocation list that first named it."""
    after_step: int

    def to_dict(self) -> dict[str, Any]:
        why = f"revoked by the swarm's authority (revocation list {self.serial})"
        return {"node_id": self.node_id, "serial": self.serial, "after_step": self.after_step,
                "reason": why}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Revoked:
        """KeyError / TypeError if `data` is not what `to_dict` makes."""
        return cls(as_text(data["node_id"]), as_count(data["serial"]),
                   as_count(data["after_step"]))  # fmt: skip


def ban_from_dict(data: Mapping[str, object]) -> Ban | Revoked:
    """A ban as `to_dict` wrote it: an audit's (it names its auditor) or a revocation's;
    KeyError / TypeError otherwise."""
    return Ban.from_dict(data) if "auditor" in data else Revoked.from_dict(data)


class FaultBook:
    """Who was lost, what was dropped or restored, and the checkpoints members offer for a
    restore."""

    def __init__(self) -> None:
        self.crashes: list[Crash] = []
        self.restores: list[Restore] = []
        self.dropped = 0
        """Microbatches of broken pipelines that were never trained (counted at the switch)."""
        self.dropped_steps: dict[int, list[int]] = {}
        """Pipeline -> the steps it never trained (NaN in its losses)."""
        self.redone = 0
        """Microbatches trained again after a restore rolled the run back."""
        self.takeover: Takeover | None = None
        """After a failover election (take_over); kept for the summary once done."""
        self.banned: dict[str, Ban | Revoked] = {}
        """Members banned for failing audits or revoked (bans.py), by node id."""
        self.unrestored: PendingRestore | None = None
        self.offers: dict[str, list[pb.CheckpointOffer]] = {}
        """Node id -> the checkpoints (own and copies) it said it holds in its last heartbeat."""
        self.held: dict[str, int] = {}
        """Node id -> the plan epoch its last offers are held for (HeartbeatRequest.held_epoch):
        none of them is pruned before it has a newer plan."""

    def resume(
        self,
        *,
        crashes: list[Crash],
        restores: list[Restore],
        dropped: int,
        dropped_steps: dict[int, list[int]],
        redone: int,
        banned: Iterable[Ban | Revoked] = (),
    ) -> None:
        """The record a store held."""
        self.crashes, self.restores = crashes, restores
        self.dropped, self.dropped_steps, self.redone = dropped, dropped_steps, redone
        self.banned = {b.node_id: b for b in banned}

    # ----- crashes ----------------------------------------------------------------------------
    def lost_in(self, epoch: int) -> set[str]:
        """Members counted lost under plan `epoch`."""
        return {c.node_id for c in self.crashes if c.plan_epoch == epoch}

    def broken_in(self, epoch: int) -> set[int]:
        """Pipelines of plan `epoch` that lost a member."""
        return {c.pipeline for c in self.crashes if c.plan_epoch == epoch}

    def count_lost(self, lost: Iterable[pb.StageAssignment], epoch: int, step: int) -> None:
        """The owners of `lost` stages of plan `epoch` are gone, `step` the last complete."""
        self.crashes.extend(Crash(s.node_id, s.pipeline, s.index, epoch, step) for s in lost)

    def count_dropped(self, pipeline: int, last: int, stop: int, microbatches: int) -> int:
        """Broken `pipeline` trained steps up to `last` and none up to `stop`: the dropped
        microbatches (counted)."""
        dropped = max(0, stop - last) * microbatches
        self.dropped += dropped
        kept = [s for s in self.dropped_steps.get(pipeline, []) if s <= last]
        self.dropped_steps[pipeline] = kept + list(range(last + 1, stop + 1))
        return dropped

    # ----- restores ---------------------------------------------------------------------------
    def note_offers(
        self, node_id: str, offers: Sequence[pb.CheckpointOffer], held: int, num_blocks: int
    ) -> None:
        """A heartbeat's checkpoint offers, held for plan epoch `held`. Malformed ones make it
        still a heartbeat, but none of its checkpoints is counted on."""
        self.held[node_id] = held
        try:
            check_offers(offers, num_blocks)
            self.offers[node_id] = list(offers)
        except ConfigError as exc:
            self.offers.pop(node_id, None)
            log.warning("node %s: its checkpoint offers are ignored: %s", node_id, exc)

    def unheld(self, epoch: int, members: Iterable[Member]) -> list[str]:
        """Of `members`, those whose last offers are not held for a restore from plan
        `epoch`."""
        return [m.node_id for m in members if self.held.get(m.node_id) != epoch]

    def hold_epoch(self) -> int:
        """While a restore waits, members hold the checkpoints they offer: the plan epoch to
        hold them for (0: none)."""
        return 0 if self.unrestored is None else self.unrestored.plan_epoch

    def timeline(self, offers: Iterable[pb.CheckpointOffer]) -> list[pb.CheckpointOffer]:
        """Of a member's `offers`, those of the run as it happened: a checkpoint written under
        a plan before a restore, of a step after the one restored, is of a timeline that was
        rolled back (its node may not have set it aside yet: it restarted, or lags)."""
        rolled = [(r.plan_epoch, r.restored_step) for r in self.restores]
        return [
            o for o in offers
            if not any(o.plan_epoch < epoch and o.step > step for epoch, step in rolled)
        ]  # fmt: skip

    def offered(self) -> dict[str, list[pb.CheckpointOffer]]:
        """Node id -> its offers of the run as it happened (`timeline`)."""
        return {node: self.timeline(offers) for node, offers in self.offers.items()}

    def rolled_back(self, step: int) -> None:
        """A restore went back to `step`: steps after it were not dropped, they are redone."""
        self.unrestored = None
        for p, steps in self.dropped_steps.items():
            self.dropped_steps[p] = [s for s in steps if s <= step]
