"""The coordinator service: membership, the plan, and the run's progress.

One node acts as coordinator: the node started without `--join`, the node a LAN swarm elected,
or a lab's `ravnest-node coordinator`, which holds no stage. It waits until `swarm_size` nodes
have joined and said what they measured, publishes the negotiated plan, collects each stage's
reports and turns them into progress events and, at the end, the run summary. A lab
coordinator keeps all of it in a SQLite store (store.py) and, restarted, carries on from there;
the others keep it in memory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from ravnest_node.checkpoint import run_key
from ravnest_node.coordination.membership import Leases, RoundTrips
from ravnest_node.coordination.negotiate import (
    check_capabilities,
    check_offers,
    member_speeds,
    negotiated_plan,
    resume_point,
)
from ravnest_node.coordination.placement import SwarmPlan
from ravnest_node.coordination.static_plan import Member, has_node, same_stages, stage_at
from ravnest_node.coordination.store import CoordinatorStore, Faults
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.pipeline.metrics import from_report
from ravnest_node.pipeline.metrics import summary as metrics_summary
from ravnest_node.pipeline.run import TrainConfig, check_swarm_shape
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import (
    DEFAULT_LEASE_S,
    LOST_AFTER_LEASES,
    MAX_EPOCH_AHEAD,
    PROTOCOL,
    UNREACHABLE_KEY,
)
from ravnest_node.state import MAX_NODE_ID_LEN, valid_node_id, write_atomic
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.options import split_host_port
from ravnest_node.transport.probe import MIN_PROBE_COST, PROBE_BUDGET_BYTES, ProbeTurns

log = logging.getLogger(__name__)

T = TypeVar("T")
# Members a swarm may grow to after its first plan (before it, exactly --swarm-size).
MAX_MEMBERS = 1024
MAX_SUSPECTS = 8
REACH_TIMEOUT_S = 3.0
"""How long the coordinator waits for a joining node to answer at its address."""
MAX_REACHING = 4
"""Joining nodes the coordinator checks at once (the others wait for a turn)."""
RESTORE_RETRY_LEASES = 3
"""A restore from checkpoints that finds no step at once is tried again on each heartbeat for
this many leases (a member's offers may come with its next heartbeat)."""
LOSS_POINTS = 500
"""Points of the loss curve a SwarmView carries (the web page draws them)."""
MEASURING_S = 300.0
"""A member counts as measuring its links (and may probe under epoch 0) for at most this long
after its first Join."""
REPLAN_GAIN = 0.05
"""A plan that leaves every newcomer spare (and nobody of the current plan gone) is announced
only if the members' measurements make it this much faster: a drain and moved blocks cost."""


def thin(items: list[T], most: int) -> list[T]:
    """At most `most` of `items`, evenly spread, the last always included."""
    if len(items) <= most:
        return items
    step = len(items) / most
    picked = [items[int(i * step)] for i in range(most - 1)]
    return [*picked, items[-1]]


def stage_schedule(report: pb.StageReport) -> dict[str, Any]:
    """The traffic and schedule figures of a stage's final report, for the run summary: every
    metric of the stage (pipeline/metrics.py) and its parameters' sum of squares."""
    return {"params_sq_sum": report.params_sq_sum, **metrics_summary(from_report(report))}


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """Serves `ravnest.v1.Coordinator`. All methods run on the node's event loop."""

    def __init__(
        self,
        *,
        train: TrainConfig,
        swarm_size: int,
        swarm_id: str,
        summary_path: Path | None,
        clock: Callable[[], float] = time.monotonic,
        epoch: int = 1,
        lease_s: float = DEFAULT_LEASE_S,
        store: CoordinatorStore | None = None,
        probe: Callable[[str, str, float], Awaitable[bool]] | None = None,
        node_id: str = "",
        reach: Callable[[str, str, float], Awaitable[bool]] | None = None,
        relay_address: str = "",
    ) -> None:
        self._train = train
        self._epoch = epoch
        """The epoch of this coordinator's plan: 1, or the election term it won."""
        self._model = get_model(train.model)
        self._swarm_size = swarm_size
        check_swarm_shape(swarm_size, train)
        self._swarm_id = swarm_id
        self._summary_path = summary_path
        self._clock = clock
        self._members: list[Member] = []
        self._capabilities: dict[str, pb.Capabilities] = {}
        self._leases = Leases(lease_s)
        self._rtts = RoundTrips()
        self._probe = probe
        """Asks (node id, address) whether it is alive, within a timeout (Suspect)."""
        self._node_id = node_id
        """This coordinator's own node: alive while it answers, never probed."""
        self._reach = reach
        """Asks (node id, address) whether it answers there (the first Join of a node)."""
        self._relay_address = relay_address
        """The relay this coordinator's node serves ("" if none), first of SwarmView.relays."""
        self._measuring: dict[str, float] = {}
        """Members measuring themselves and their links (joined once, no capabilities yet):
        when that began. Only they may send link probes under epoch 0."""
        self._reaching = asyncio.Semaphore(MAX_REACHING)
        self._probe_turns = ProbeTurns(clock=clock)
        self._probe_bytes: dict[str, int] = {}
        """Link-probe bytes each member has sent this coordinator (check_link_probe)."""
        self._probing: set[str] = set()
        self._plan: pb.Plan | None = None
        self._next: pb.Plan | None = None
        """A newer plan, announced (pending) while the current one's pipelines drain."""
        self._next_placed: SwarmPlan | None = None
        self._placed: SwarmPlan | None = None
        """The planner's answer for the current plan (its predicted step time)."""
        self._considered: dict[int, frozenset[str]] = {}
        """The members each plan epoch was negotiated from (its spares are the ones in no
        stage): a plan is made again only when they change."""
        self._previous: pb.Plan | None = None
        self._drains: dict[int, int] = {}  # pipeline -> the step its first stage stops feeding at
        self._ends: dict[int, int] = {}  # epoch -> the step that plan ended at
        self._announcements: list[pb.Plan] = []
        """Every plan WatchPlan announced, in order (a copy as it was then: a pending plan,
        and later the same epoch started)."""
        self._replans_closed = False  # the run ends before a newer plan could start
        self._changed = asyncio.Condition()
        self._started_at = 0.0
        self._started_unix = 0.0
        self._pipeline_losses: dict[int, dict[int, float]] = {}  # pipeline -> step -> loss
        self._losses: dict[int, float] = {}  # step -> mean loss over the pipelines
        self._bytes_sent: dict[str, int] = {}
        self._final: dict[tuple[int, int], pb.StageReport] = {}  # (pipeline, stage) -> report
        self._latest: dict[tuple[int, int], pb.StageReport] = {}
        """(pipeline, stage) -> the latest report of that stage (SwarmView.stages)."""
        self._events: list[pb.Progress] = []
        self._resumed_at = 0
        """The step the run (re)started at: 0, or where the members' checkpoints were."""
        self._crashes: list[dict[str, Any]] = []
        self._lost: dict[str, float] = {}
        """Members counted lost, and when: in no plan until they join again (a restart), or
        send a heartbeat more than a lease after (they were alive after all)."""
        """Members with a stage whose lease ran out mid-run: who, where, when."""
        self._broken: set[int] = set()
        """Pipelines of the current plan that lost a member: they are not waited for."""
        self._broken_in: dict[int, set[int]] = {}
        """Plan epoch -> its broken pipelines (a late Drain from one is refused)."""
        self._dropped = 0
        """Microbatches of broken pipelines that were never trained (counted at the switch)."""
        self._dropped_steps: dict[int, list[int]] = {}
        """Pipeline -> the steps it never trained (NaN in its losses)."""
        self._checkpoints: dict[tuple[int, int], tuple[str, int]] = {}
        """(pipeline, stage) -> (node id, step) of the newest checkpoint its owner reported."""
        self._offers: dict[str, list[pb.CheckpointOffer]] = {}
        """Node id -> the checkpoints (own and copies) it said it holds in its last heartbeat."""
        self._held: dict[str, int] = {}
        """Node id -> the plan epoch its last offers are held for (HeartbeatRequest.held_epoch):
        none of them is pruned before it has a newer plan."""
        self._restores: list[dict[str, Any]] = []
        """Restores from checkpoints after a member without a replica was lost."""
        self._redone = 0
        """Microbatches trained again after a restore rolled the run back."""
        self._unrestored: tuple[int, list[pb.StageAssignment], float] | None = None
        """(plan epoch, lost stages, when) of a restore that found no step yet: tried again."""
        self._takeover: dict[str, Any] | None = None
        """After a failover election (take_over): the term, the lost coordinator, and the
        members of the plan taken over not yet back (rejoined, then a heartbeat)."""
        self._rejoined: set[str] = set()
        self._epoch_floor = 0
        """Plan epochs at or below this are taken (known to members of a taken-over run)."""
        data = self._model.dataset(seed=train.seed)
        self._fingerprint = data.fingerprint
        self._store = store
        if store is not None:
            self._restore(store)

    def _restore(self, store: CoordinatorStore) -> None:
        """Carry on from what the store holds, or make it this run's store if it is new.
        ConfigError if it holds another run (a lab coordinator restarted with other settings
        would hand its nodes a plan they did not sign up for)."""
        run = self._train.to_proto(self._fingerprint)
        saved = store.load()
        if saved.run is None:
            store.create(run=run, swarm_id=self._swarm_id, swarm_size=self._swarm_size)
            return
        differ = [
            f.name for f in pb.RunSpec.DESCRIPTOR.fields
            if getattr(saved.run, f.name) != getattr(run, f.name)
        ]  # fmt: skip
        if saved.swarm_size != self._swarm_size:
            differ.append("swarm_size")
        if saved.swarm_id != self._swarm_id:
            differ.append(f"swarm ({saved.swarm_id})")
        if differ:
            raise ConfigError(
                f"{store.path} holds another run (it differs in {', '.join(differ)}): start "
                "with the settings it was created with, or give another --state-dir"
            )
        now = self._clock()
        self._members = saved.members
        self._capabilities = saved.capabilities
        for m in self._members:  # every member gets a full lease to reattach
            self._leases = self._leases.renew(m.node_id, now)
        self._plan = saved.plan
        if saved.plan is not None:
            self._epoch = saved.plan.epoch
            self._announce(saved.plan)
            self._started_unix = saved.started_unix
            self._started_at = now - max(0.0, time.time() - saved.started_unix)
        self._pipeline_losses = saved.pipeline_losses
        faults = saved.faults
        self._crashes, self._restores = faults.crashes, faults.restores
        self._dropped, self._redone = faults.dropped, faults.redone
        self._dropped_steps = faults.dropped_steps
        self._lost = dict.fromkeys(faults.lost, now)
        for pipeline, steps in faults.dropped_steps.items():
            losses = self._pipeline_losses.setdefault(pipeline, {})
            losses.update(dict.fromkeys(steps, math.nan))
        if saved.plan is not None:  # pipelines of the plan that lost a member stay broken
            broken = {int(c["pipeline"]) for c in self._crashes
                      if c["plan_epoch"] == saved.plan.epoch}  # fmt: skip
            self._broken = broken
            if broken:
                self._broken_in[saved.plan.epoch] = set(broken)
        self._bytes_sent = saved.bytes_sent
        self._final = saved.finals
        self._events = saved.events
        # Events of steps a restore rolled back stay in the list; the losses table does not
        # have them: a step counts once every pipeline's loss for it is stored.
        self._losses = {
            e.step: e.loss for e in saved.events
            if not e.done and all(e.step in self._pipeline_losses.get(p, {})
                                  for p in range(self._train.pipelines))
        }  # fmt: skip
        if self._losses:
            self._resumed_at = min(self._losses) - 1
        elif saved.plan is not None:
            self._resumed_at = saved.plan.start_step
        log.info(
            "resumed from %s: %d members, plan epoch %s, %d steps reported",
            store.path,
            len(self._members),
            saved.plan.epoch if saved.plan else "none yet",
            len(self._losses),
        )

    def take_over(self, plan: pb.Plan, lost: set[str], term: int, known_epoch: int = 0) -> None:
        """This node won failover election `term` after the coordinator (node ids `lost`) of
        `plan`, the newest plan it knows, was lost: carry the run on from that plan. Its
        members get a lease to come back (Join again with what they measured, then a
        heartbeat with their checkpoint offers); once every one has (or its lease has run
        out), the lost coordinator's stages are counted lost, and the run goes on as after
        any lost member: from a replica, or restored from checkpoints and copies. Progress
        before the takeover stayed with the lost coordinator: this one's summary starts at the
        step it restores (`resumed_at`). `known_epoch`: the newest plan epoch this node knows
        (a pending plan's): the plans it makes start above it."""
        assert self._plan is None and self._store is None
        now = self._clock()
        copy = pb.Plan()
        copy.CopyFrom(plan)
        copy.pending = False
        seen: set[str] = set()
        for s in copy.stages:
            if s.node_id not in seen:
                seen.add(s.node_id)
                self._members.append(Member(s.node_id, s.address))
                self._leases = self._leases.renew(s.node_id, now)
        self._plan, self._epoch = copy, copy.epoch
        self._epoch_floor = max(copy.epoch, known_epoch)
        self._announce(copy)
        self._started_at, self._started_unix = now, time.time()
        self._resumed_at = copy.start_step
        self._takeover = {
            "term": term,
            "plan_epoch": copy.epoch,
            "lost_coordinator": sorted(lost),
            "waiting": seen - lost,
            "restarted": set(),
        }
        log.warning("taking the run over from plan epoch %d (term %d): waiting for %d members "
                    "to come back", copy.epoch, term, len(seen - lost))  # fmt: skip

    def _takeover_ready(self) -> bool:
        """A takeover whose members are all back (or silent for LOST_AFTER_LEASES leases):
        count the old coordinator and the silent ones lost, and restore the run from the
        newest step the members' checkpoints and copies hold, every pipeline included (the
        progress of the steps after it died with the old coordinator, so every pipeline goes
        back to one step this coordinator knows)."""
        takeover = self._takeover
        plan = self._plan
        if takeover is None or takeover.get("done") or plan is None:
            return False
        now = self._clock()
        silent = {
            n for n in takeover["waiting"]
            if self._leases.silent_s(n, now) > LOST_AFTER_LEASES * self._leases.lease_s
        }  # fmt: skip
        if takeover["waiting"] - silent:
            return False
        takeover["done"] = True
        gone = set(takeover["lost_coordinator"]) | takeover["restarted"] | silent
        lost = [s for s in plan.stages if s.node_id in gone]
        self._count_lost(plan, lost, now, f"term {takeover['term']} took over from it")
        self._restore_or_wait(plan, lost, now)
        return True

    def _raise_floor(self, node_id: str, epoch: int) -> None:
        """A member of the run taken over knew plan `epoch` (a pending plan the old
        coordinator announced, say): this coordinator's plans start above it. An epoch far
        beyond the plan taken over is not believed (a confused or hostile member)."""
        assert self._takeover is not None
        ceiling = self._takeover["plan_epoch"] + MAX_EPOCH_AHEAD
        if epoch > ceiling:
            log.warning("node %s says it knew plan epoch %d, more than %d past the plan taken "
                        "over: not believed", node_id, epoch, MAX_EPOCH_AHEAD)  # fmt: skip
            return
        self._epoch_floor = max(self._epoch_floor, epoch)

    def _next_epoch(self, plan: pb.Plan) -> int:
        """The epoch of a plan after `plan` (and after a pending one, and any a member of a
        taken-over run knew)."""
        return max(plan.epoch, self._next.epoch if self._next else 0, self._epoch_floor) + 1

    async def _reachable(self, node_id: str, address: str) -> bool:
        """Does `node_id` answer at `address`? A few at a time: joins from strangers cannot
        hold all of this server's calls."""
        assert self._reach is not None
        async with self._reaching:
            return await self._reach(node_id, address, REACH_TIMEOUT_S)

    def check_link_probe(self, node_id: str, nbytes: int) -> None:
        """A member measures its link to this coordinator (link probes under epoch 0): only a
        member that is measuring (between its first Join and its capabilities), within
        PROBE_BUDGET_BYTES each time it measures; Refusal otherwise."""
        if not self._measuring_since(node_id) or not self._is_member(node_id):
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{node_id[:80]!r} is not a member measuring its links: join first",
            )
        total = self._probe_bytes.get(node_id, 0) + max(nbytes, MIN_PROBE_COST)
        if total > PROBE_BUDGET_BYTES:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{node_id} has sent {PROBE_BUDGET_BYTES} bytes of probes")  # fmt: skip
        self._probe_turns.take(node_id)
        self._probe_bytes[node_id] = total

    def _save_faults(self) -> None:
        if self._store is not None:
            self._store.save_faults(Faults(
                crashes=self._crashes, lost=sorted(self._lost), dropped=self._dropped,
                dropped_steps=self._dropped_steps, restores=self._restores, redone=self._redone,
            ))  # fmt: skip

    def _save_members(self) -> None:
        if self._store is not None:
            self._store.save_members(self._members, self._capabilities)

    @property
    def plan(self) -> pb.Plan | None:
        return self._plan

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # ----- membership and plan ----------------------------------------------------------------
    async def Join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.JoinReply:
        if not valid_node_id(request.node_id):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node_id must be 1 to {MAX_NODE_ID_LEN} ASCII letters, digits, '-' or '_'",
            )
        try:
            split_host_port(request.address)
        except ConfigError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address: {exc}")
        if request.protocol != PROTOCOL:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol {request.protocol!r} is not {PROTOCOL!r}",
            )
        if request.HasField("capabilities"):
            try:
                check_capabilities(request.capabilities, self._model.num_blocks())
            except ConfigError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if (
            self._reach is not None
            and not request.HasField("capabilities")
            and request.node_id != self._node_id
            and not any(m.node_id == request.node_id and m.address == request.address
                        for m in self._members)  # a member asking again was checked then
            and not await self._reachable(request.node_id, request.address)
        ):  # fmt: skip
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this coordinator cannot reach node {request.node_id} at {request.address}: "
                "its neighbours could not either. Behind NAT, it is reached through a relay: "
                "one this coordinator offers, or --relay HOST:PORT (a reachable node started "
                "with --relay-listen); otherwise check --advertise and the firewall",
                trailing_metadata=((UNREACHABLE_KEY, "1"),),
            )
        now = self._clock()
        if self._plan is None:
            self._evict_gone(now)
        for index, member in enumerate(self._members):
            if member.node_id == request.node_id:
                if member.address != request.address:
                    gone = request.node_id in self._lost or self._leases.expired(
                        request.node_id, now
                    )
                    if not gone:
                        await context.abort(
                            grpc.StatusCode.ALREADY_EXISTS,
                            f"node {request.node_id} already joined from {member.address}",
                        )
                    # Lost, or its lease ran out: the node came back (restarted, or its address
                    # changed).
                    log.info("node %s rejoins from %s (it was at %s)", request.node_id,
                             request.address, member.address)  # fmt: skip
                    self._members[index] = Member(request.node_id, request.address)
                    self._forget_links_to(request.node_id)
                    self._save_members()
                plan = self._plan
                in_plan = (
                    plan is not None
                    and has_node(plan.stages, request.node_id)
                    and not any(
                        c["node_id"] == request.node_id and c["plan_epoch"] == plan.epoch
                        for c in self._crashes
                    )
                    and not (
                        self._takeover is not None
                        and request.node_id in self._takeover["restarted"]
                    )
                )  # its stage there was counted lost: it is no longer in that plan
                if in_plan and not request.HasField("capabilities"):
                    # A node starting up finds itself in the plan: an earlier run of it had a
                    # stage and is gone (a crash and a quick restart), whether or not its
                    # lease has run out yet. Count it lost now (a takeover still waiting for
                    # its members counts it then); this run of it is a newcomer.
                    if self._takeover is None or self._takeover.get("done"):
                        self._restarted(request.node_id, now)
                    else:
                        self._takeover["waiting"].discard(request.node_id)
                        self._takeover["restarted"].add(request.node_id)
                    in_plan = False
                if self._lost.pop(request.node_id, None) is not None:  # back: a newcomer
                    self._save_faults()
                self._leases = self._leases.renew(request.node_id, now)
                if (
                    request.HasField("capabilities")
                    and in_plan
                    and self._takeover is not None
                    and request.node_id in self._takeover["waiting"]
                ):  # a member of the run taken over is back
                    self._capabilities[request.node_id] = request.capabilities
                    self._rejoined.add(request.node_id)
                    self._raise_floor(request.node_id, request.plan_epoch)
                if request.HasField("capabilities") and not in_plan:
                    self._capabilities[request.node_id] = request.capabilities
                    if self._plan is not None:  # what it measured may change the plan now
                        self._considered.pop(self._plan.epoch, None)
                    self._save_members()
                    self._publish_when_ready()
                    self._maybe_replan()
                    await self._notify()
                self._note_measuring(request)
                return self._join_reply(index)
        if self._plan is None and len(self._members) >= self._swarm_size:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the swarm is full ({self._swarm_size} nodes) until its first plan",
            )
        if len(self._members) >= MAX_MEMBERS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"the swarm has {MAX_MEMBERS} members"
            )
        self._members.append(Member(node_id=request.node_id, address=request.address))
        self._leases = self._leases.renew(request.node_id, now)
        if request.HasField("capabilities"):
            self._capabilities[request.node_id] = request.capabilities
        self._save_members()
        log.info(
            "node %s joined from %s (%d/%d)",
            request.node_id,
            request.address,
            len(self._members),
            self._swarm_size,
        )
        self._publish_when_ready()
        self._maybe_replan()
        await self._notify()
        self._note_measuring(request)
        return self._join_reply(len(self._members) - 1)

    def _forget_links_to(self, node_id: str) -> None:
        """`node_id` is back at another address: what others measured to it is stale (the
        planner goes by uplinks for those pairs)."""
        for caps in self._capabilities.values():
            kept = [p for p in caps.peer_links if p.node_id != node_id]
            if len(kept) != len(caps.peer_links):
                del caps.peer_links[:]
                caps.peer_links.extend(kept)

    def _note_measuring(self, request: pb.JoinRequest) -> None:
        """A member's first Join starts its measuring (a fresh probe budget), unless one began
        less than MEASURING_S ago; the Join with its capabilities ends it."""
        if request.HasField("capabilities"):
            self._measuring.pop(request.node_id, None)
        elif self._measuring_since(request.node_id) == 0.0:
            self._measuring[request.node_id] = self._clock()
            self._probe_bytes.pop(request.node_id, None)

    def _measuring_since(self, node_id: str) -> float:
        """When `node_id`'s measuring began (0: it is not measuring, or for MEASURING_S and
        more: a member that never sends its capabilities does not measure for ever)."""
        since = self._measuring.get(node_id, 0.0)
        return since if since and self._clock() - since < MEASURING_S else 0.0

    def relay_offers(self) -> list[pb.RelayOffer]:
        """Relays a node behind NAT may use: this coordinator's own, then those members serve
        (Capabilities.relay_address) that are not gone (left, lost, or their lease run out)."""
        now = self._clock()
        offers = []
        if self._relay_address:
            offers.append(pb.RelayOffer(node_id=self._node_id, address=self._relay_address))
        for m in self._members:
            caps = self._capabilities.get(m.node_id)
            if caps is None or not caps.relay_address or m.node_id == self._node_id:
                continue
            if m.node_id in self._lost or m.node_id in self._leases.left:
                continue
            if not self._leases.expired(m.node_id, now):
                offers.append(pb.RelayOffer(node_id=m.node_id, address=caps.relay_address))
        return offers

    def _join_reply(self, index: int) -> pb.JoinReply:
        return pb.JoinReply(
            started_epoch=self._plan.epoch if self._plan is not None else 0,
            swarm_id=self._swarm_id,
            member_index=index,
            swarm_size=self._swarm_size,
            model=self._train.model,
            microbatch=self._train.batch_size // self._train.microbatches,
            lease_s=self._leases.lease_s,
        )

    def _evict_gone(self, now: float) -> None:
        """Before the plan: free the places of members that left or whose lease ran out."""
        gone = self._leases.gone([m.node_id for m in self._members], now)
        if not gone:
            return
        for node_id in gone:
            why = "left" if node_id in self._leases.left else "its lease ran out"
            log.info("node %s is no longer a member: %s", node_id, why)
            self._capabilities.pop(node_id, None)
            self._measuring.pop(node_id, None)
            self._probe_bytes.pop(node_id, None)
        self._members = [m for m in self._members if m.node_id not in gone]
        self._leases = self._leases.forget(gone)
        self._save_members()

    def _is_member(self, node_id: str) -> bool:
        return any(m.node_id == node_id for m in self._members)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HeartbeatReply:
        if not self._is_member(request.node_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, "not a member of this swarm: join first")
        if request.node_id not in self._leases.left:  # a leaving node stays left
            self._leases = self._leases.renew(request.node_id, self._clock())
        self._rtts.add(request.node_id, request.rtt_s)
        lost_at = self._lost.get(request.node_id)
        if lost_at is not None and self._clock() - lost_at > self._leases.lease_s:
            # Heard from a lease after it was counted lost: alive after all (a stall, a cut
            # link). It may have a stage in a later plan again.
            del self._lost[request.node_id]
            self._save_faults()
            log.warning("node %s, counted lost, is heard from again: it may have a stage again",
                        request.node_id)  # fmt: skip
            self._maybe_replan()
        self._held[request.node_id] = request.held_epoch
        try:
            check_offers(request.checkpoints, self._model.num_blocks())
            self._offers[request.node_id] = list(request.checkpoints)
        except ConfigError as exc:  # still a heartbeat: its checkpoints are not counted on
            self._offers.pop(request.node_id, None)
            log.warning("node %s: its checkpoint offers are ignored: %s", request.node_id, exc)
        if request.node_id in self._rejoined and self._takeover is not None:
            self._takeover["waiting"].discard(request.node_id)  # back, offers and all
        if self._takeover_ready() | self._check_lost():
            await self._notify()
        # While a restore waits, members hold the checkpoints they offer (_restore_or_wait).
        hold = 0 if self._unrestored is None else self._unrestored[0]
        return pb.HeartbeatReply(lease_s=self._leases.lease_s, hold_epoch=hold)

    def _check_lost(self) -> bool:
        """Members send heartbeats every third of their lease, so every member's heartbeat is
        also this coordinator's clock: a member with a stage whose lease has run out is lost
        (crashed, or cut off). With replicas, its pipeline is broken: a plan without it is
        announced at once, the healthy pipelines drain to a step boundary and the new stages
        take the lost blocks from a replica there; the broken pipeline's unfinished steps are
        dropped and counted. Without a replica, the run is restored from the newest step at
        which the members left hold a checkpoint (or a copy) of every block
        (`_restore_from_checkpoints`); if they do not, say so."""
        plan = self._plan
        if plan is None or (self._takeover is not None and not self._takeover.get("done")):
            return False  # a takeover counts its members lost itself (_takeover_ready)
        now = self._clock()
        if self._unrestored and self._unrestored[0] == plan.epoch:
            # A restore that found no step yet (offers not in): try again on every heartbeat
            # while the stages wait for it (they give up after 4 leases).
            _, lost_before, since = self._unrestored
            if now - since > RESTORE_RETRY_LEASES * self._leases.lease_s:
                self._unrestored = None
                log.error("no replica holds the blocks of %s and no checkpoints restore them: "
                          "the run cannot go on; restart the swarm with --resume to carry on "
                          "from its checkpoints",
                          ", ".join(s.node_id for s in lost_before))  # fmt: skip
            elif self._restore_from_checkpoints(plan, lost_before):
                return True
        known = {(c["node_id"], c["plan_epoch"]) for c in self._crashes}
        lost = [
            s for s in plan.stages
            if (s.node_id, plan.epoch) not in known and s.node_id not in self._leases.left
            and self._leases.silent_s(s.node_id, now) > LOST_AFTER_LEASES * self._leases.lease_s
        ]  # fmt: skip
        if not lost:
            return False
        self._lose(plan, lost, now)
        return True

    def _restarted(self, node_id: str, now: float) -> None:
        """`node_id`, which has a stage in the current plan, joined again: it restarted."""
        plan = self._plan
        assert plan is not None
        known = {(c["node_id"], c["plan_epoch"]) for c in self._crashes}
        self._capabilities.pop(node_id, None)  # measured again before it gets a stage
        self._save_members()
        if (node_id, plan.epoch) not in known:
            log.warning("node %s joined again: it restarted, and its stage is lost", node_id)
            self._lose(plan, [s for s in plan.stages if s.node_id == node_id], now)

    def _lose(
        self, plan: pb.Plan, lost: list[pb.StageAssignment], now: float, why: str = ""
    ) -> None:
        """The owners of `lost` stages of `plan` are gone: count them, and carry on without
        them (see _check_lost)."""
        self._count_lost(plan, lost, now, why)
        if self._replans_closed:  # the run ends without a newer plan: its stages are not awaited
            self._finish_if_done(plan)
            return
        broken = self._broken | {s.pipeline for s in lost}
        if len(broken) >= self._train.pipelines:
            if max(self._losses, default=self._resumed_at) >= self._train.steps:
                # Every step is trained; only final reports were missing: the run ends
                # without the lost stages' ones.
                self._replans_closed = True
                self._finish_if_done(plan)
            else:
                self._restore_or_wait(plan, lost, now)
            return
        self._broken = broken
        self._broken_in[plan.epoch] = set(broken)
        for p in broken:
            self._drains.pop(p, None)
        pending = self._next
        if pending is not None and (
            any(has_node(pending.stages, s.node_id) for s in lost)
            or any(s.pipeline in broken for s in pending.previous)
        ):
            self._next = None  # it counted on a lost member or its pipeline: make it again
        self._maybe_replan(force=True, keep_drains=True)
        if self._next is None:
            log.error("no plan without %s is possible with the members left: the run cannot "
                      "go on", ", ".join(s.node_id for s in lost))  # fmt: skip
        elif self._drained():
            self._switch(plan)

    def _count_lost(
        self, plan: pb.Plan, lost: list[pb.StageAssignment], now: float, why: str
    ) -> None:
        step = max(self._losses, default=self._resumed_at)
        self._lost.update((s.node_id, now) for s in lost)
        for s in lost:
            self._crashes.append({"node_id": s.node_id, "pipeline": s.pipeline, "stage": s.index,
                                  "plan_epoch": plan.epoch, "after_step": step})  # fmt: skip
            log.warning("node %s (pipeline %d stage %d) is lost: %s", s.node_id, s.pipeline,
                        s.index, why or "no heartbeat for "
                        f"{self._leases.silent_s(s.node_id, now):.1f} s")  # fmt: skip
        self._save_faults()

    def _restore_or_wait(self, plan: pb.Plan, lost: list[pb.StageAssignment], now: float) -> None:
        """Restore from checkpoints, or if the members' offers do not make a step yet, try
        again on each heartbeat (`_check_lost`).

        Offers lag: a member lists its checkpoints in its heartbeats, and by the time a
        restore plan reaches it, a newer write may have pruned the step the plan names. So a
        restore counts only offers its members hold (`_held`): meanwhile every heartbeat reply
        asks them to keep what they have until the plan after `plan` (hold_epoch), and each
        answers at once with a heartbeat whose offers are held (checkpoint.Retention)."""
        if self._restore_from_checkpoints(plan, lost):
            return
        self._unrestored = (plan.epoch, lost, now)
        names = ", ".join(s.node_id for s in lost)
        unheld = self._unheld(plan, self._plan_members(plan))
        if unheld:
            log.info("restoring the blocks of %s from checkpoints: first %d members keep "
                     "theirs (their next heartbeat)", names, len(unheld))  # fmt: skip
        else:
            log.warning("no replica holds the blocks of %s and the members' checkpoints do not "
                        "restore them yet: tried again on each heartbeat for %g s", names,
                        RESTORE_RETRY_LEASES * self._leases.lease_s)  # fmt: skip

    def _restore_from_checkpoints(self, plan: pb.Plan, lost: list[pb.StageAssignment]) -> bool:
        """No replica holds the `lost` members' blocks: start a plan of the members left at
        the newest step, no later than the last step every pipeline completed, at which their
        checkpoints and copies of checkpoints hold every block (`plan.restore`). Every stage
        drops what it trained after that step; those steps are trained again (counted as
        redone). False if the members left cannot (no such step, or no plan fits them), or
        if one of them does not hold its checkpoints yet (`_restore_or_wait`)."""
        staying = self._plan_members(plan)
        if self._unheld(plan, staying):
            return False
        # A run taken over knows no step's loss yet: any step its checkpoints hold will do.
        taken_over = self._takeover is not None and not self._losses
        completed = self._train.steps if taken_over else max(self._losses, default=self._resumed_at)
        point = resume_point(
            staying,
            {node: self._timeline(offers) for node, offers in self._offers.items()},
            run_key=run_key(plan.run),
            num_blocks=self._model.num_blocks(),
            steps=completed + 1,  # a step every pipeline has reported: its loss is known
        )
        if not point.holders or point.step < self._resumed_at:
            return False
        try:
            new, placed = self._negotiate(self._next_epoch(plan), staying, plan.run)
        except ConfigError as exc:
            log.error("restore: no plan fits the members left: %s", exc)
            return False
        step = point.step
        new.start_step, new.restore = step, True
        new.previous.extend(point.holders)
        # The plan broken here ends at the restored step: its stages' later reports are
        # refused, and its first stages are told to drop their work, not to drain.
        self._ends[plan.epoch] = step
        self._broken_in[plan.epoch] = set(range(self._train.pipelines))
        self._next, self._drains, self._broken = None, {}, set()
        self._unrestored = None
        self._final = {}  # final reports of the rolled-back timeline (a stage ended early)
        redone = 0
        for losses in self._pipeline_losses.values():
            later = [s for s in losses if s > step]
            redone += len(later) * self._train.microbatches
            for s in later:
                del losses[s]
        for s in [s for s in self._losses if s > step]:
            del self._losses[s]
        self._checkpoints = {k: v for k, v in self._checkpoints.items() if v[1] <= step}
        self._redone += redone
        if taken_over:  # this coordinator's progress starts here
            self._resumed_at = step
        self._restores.append({
            "plan_epoch": new.epoch, "lost": sorted({s.node_id for s in lost}),
            "after_step": None if taken_over else completed, "restored_step": step,
            "redone_microbatches": redone,
            "holders": [[h.first_block, h.stop_block, h.node_id] for h in point.holders],
        })  # fmt: skip
        if taken_over:
            log.warning("restoring the run taken over at step %d from %d checkpoints and "
                        "copies", step, len(point.holders))  # fmt: skip
        else:
            log.warning("restoring the run at step %d from %d checkpoints and copies: steps %d "
                        "to %d are trained again (%d microbatches redone)", step,
                        len(point.holders), step + 1, completed, redone)  # fmt: skip
        self._previous = plan
        for p, steps in self._dropped_steps.items():
            self._dropped_steps[p] = [s for s in steps if s <= step]
        if self._store is not None:
            self._store.roll_back(step, new, self._started_unix)
        self._save_faults()
        self._adopt(new, placed)
        return True

    def _unheld(self, plan: pb.Plan, members: list[Member]) -> list[str]:
        """Of `members`, those whose last offers are not held for a restore from `plan`."""
        return [m.node_id for m in members if self._held.get(m.node_id) != plan.epoch]

    def _timeline(self, offers: list[pb.CheckpointOffer]) -> list[pb.CheckpointOffer]:
        """Of a member's `offers`, those of the run as it happened: a checkpoint written under
        a plan before a restore, of a step after the one restored, is of a timeline that was
        rolled back (its node may not have set it aside yet: it restarted, or lags)."""
        rolled = [(r["plan_epoch"], r["restored_step"]) for r in self._restores]
        return [
            o for o in offers
            if not any(o.plan_epoch < epoch and o.step > step for epoch, step in rolled)
        ]  # fmt: skip

    async def Suspect(
        self, request: pb.SuspectRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SuspectReply:
        """A member's stream to a neighbour broke: probe the neighbours it names (members with
        a stage of the current plan, not yet lost or leaving, not being probed already), each
        within a deadline from its measured round trips; count those that do not answer as
        lost now. One that answers stays: a broken stream alone proves nothing (its own
        neighbour may have broken it)."""
        if not self._is_member(request.node_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, "not a member of this swarm")
        plan = self._plan
        if plan is None or request.plan_epoch != plan.epoch or self._probe is None:
            return pb.SuspectReply()
        if self._takeover is not None and not self._takeover.get("done"):
            return pb.SuspectReply()  # the takeover counts who is lost (_takeover_ready)
        named = set(request.suspects[:MAX_SUSPECTS])
        known = {c["node_id"] for c in self._crashes if c["plan_epoch"] == plan.epoch}
        # A member that left but still has a stage may be killed before its hand-over: it is
        # probed too. This coordinator's own node is alive: it is answering.
        targets = {
            s.node_id: s.address for s in plan.stages
            if s.node_id in named and s.node_id not in (request.node_id, self._node_id)
            and s.node_id not in known and s.node_id not in self._probing
        }  # fmt: skip
        if not targets:
            return pb.SuspectReply()
        self._probing |= set(targets)
        timeouts = {n: self._rtts.probe_timeout(n, self._leases.lease_s) for n in targets}
        try:
            answers = await asyncio.gather(
                *(self._probe(n, address, timeouts[n]) for n, address in targets.items())
            )
        finally:
            self._probing -= set(targets)
        known = {c["node_id"] for c in self._crashes if c["plan_epoch"] == plan.epoch}
        dead = [n for n, alive in zip(targets, answers, strict=True)
                if not alive and n not in known]  # fmt: skip
        if not dead or self._plan is not plan:  # a newer plan came meanwhile
            return pb.SuspectReply()
        why = (f"its neighbour {request.node_id} lost its stream ({request.reason[:200]}) and it "
               f"did not answer a probe within {max(timeouts[n] for n in dead):.2f} s")  # fmt: skip
        self._lose(plan, [s for s in plan.stages if s.node_id in dead], self._clock(), why)
        await self._notify()
        return pb.SuspectReply(lost=dead)

    async def Leave(
        self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LeaveReply:
        if not self._is_member(request.node_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, "not a member of this swarm")
        self._leases = self._leases.leave(request.node_id)
        log.info("node %s leaves the swarm", request.node_id)
        if self._plan is None:
            self._evict_gone(self._clock())
            await self._notify()
            return pb.LeaveReply()
        # After the plan: a member with a stage stays until a plan without it has taken its
        # blocks over, if there is anyone to take them.
        holds = has_node(self._plan.stages, request.node_id)
        pending = self._next
        if pending is not None and has_node(pending.stages, request.node_id):
            # The pending plan counted on it: make it again without it (same epoch; drains
            # already said stay valid, they are about the current plan).
            self._next = None
            self._maybe_replan(force=True, keep_drains=True)
        else:
            self._maybe_replan()
        await self._notify()
        return pb.LeaveReply(hand_off=holds and self._next is not None)

    def _publish_when_ready(self) -> None:
        """Plan once every expected member has joined and sent what it measured."""
        if self._plan is not None or len(self._members) < self._swarm_size:
            return
        if not all(m.node_id in self._capabilities for m in self._members):
            return
        run = self._train.to_proto(self._fingerprint)
        self._plan, placed = self._negotiate(self._epoch, self._members, run)
        resume = resume_point(
            self._members,
            {node: c.checkpoints for node, c in self._capabilities.items()},
            run_key=run_key(run),
            num_blocks=self._model.num_blocks(),
            steps=self._train.steps,
        )
        if resume.why:
            log.info("checkpoints: %s", resume.why)
        # Resuming: the first plan starts where the checkpoints are, its blocks fetched from
        # their holders as from a previous plan's stages.
        self._plan.start_step = self._resumed_at = resume.step
        self._plan.previous.extend(resume.holders)
        self._started_at = self._clock()
        self._started_unix = time.time()
        self._adopt(self._plan, placed)

    def _adopt(self, plan: pb.Plan, placed: SwarmPlan) -> None:
        """`plan` is the current plan now: keep it, announce it, log it."""
        self._plan, self._placed = plan, placed
        self._epoch = plan.epoch
        self._announce(plan)
        if self._store is not None:
            self._store.save_plan(plan, self._started_unix)
        for s in plan.stages:
            log.info(
                "plan epoch %d: pipeline %d stage %d = blocks [%d, %d) on %s, from step %d",
                plan.epoch,
                s.pipeline,
                s.index,
                s.first_block,
                s.stop_block,
                s.address,
                plan.start_step,
            )
        log.info(
            "plan epoch %d: %.1f ms a microbatch by the members' measurements, bound by %s",
            plan.epoch,
            placed.step_s * 1e3,
            placed.bottleneck,
        )
        if placed.spare:
            log.info("plan epoch %d leaves %s spare (faster without them)", plan.epoch,
                     ", ".join(placed.spare))  # fmt: skip

    @staticmethod
    def _plan_entry(plan: pb.Plan) -> dict[str, Any]:
        return {
            "epoch": plan.epoch,
            "start_step": plan.start_step,
            "nodes": len({s.node_id for s in plan.stages}),
            "stages": [
                [s.pipeline, s.index, s.first_block, s.stop_block, s.node_id] for s in plan.stages
            ],
        }

    # ----- re-planning ------------------------------------------------------------------------
    def _announce(self, plan: pb.Plan) -> None:
        copy = pb.Plan()
        copy.CopyFrom(plan)
        self._announcements.append(copy)

    def _plan_members(self, plan: pb.Plan) -> list[Member]:
        """Who a plan after `plan` has: members that have said what they measured, are alive
        (not lost) and stay, `plan`'s first, then newcomers, each in join order; as many as the
        swarm's shape allows (a multiple of the pipelines, at most one stage a block)."""
        now = self._clock()
        in_plan = {s.node_id for s in plan.stages}
        staying = [
            m for m in self._members
            if m.node_id in self._capabilities and m.node_id not in self._lost
            and not self._leases.expired(m.node_id, now) and m.node_id not in self._leases.left
        ]  # fmt: skip
        staying.sort(key=lambda m: m.node_id not in in_plan)
        pipelines = self._train.pipelines
        count = min(len(staying) - len(staying) % pipelines, self._model.num_blocks() * pipelines)
        return staying[:count]

    def _negotiate(
        self, epoch: int, members: list[Member], run: pb.RunSpec
    ) -> tuple[pb.Plan, SwarmPlan]:
        plan, placed = negotiated_plan(
            epoch=epoch,
            swarm_id=self._swarm_id,
            model=self._model,
            members=members,
            capabilities=[self._capabilities[m.node_id] for m in members],
            run=run,
        )
        self._considered[epoch] = frozenset(m.node_id for m in members)
        return plan, placed

    def _maybe_replan(self, *, force: bool = False, keep_drains: bool = False) -> None:
        """After the first plan: when members that are in no stage have said what they
        measured, or members with a stage leave, announce a plan of the members that stay and
        as many newcomers as the swarm's shape allows (a multiple of the pipelines, at most one
        stage per block). It starts once the current plan's pipelines have drained (Drain).
        Newcomers left out wait for a later plan."""
        plan = self._plan
        if plan is None or self._next is not None or self._replans_closed:
            return
        if self._takeover is not None and not self._takeover.get("done"):
            return  # the takeover's restore plans first
        if max(self._losses, default=self._resumed_at) >= self._train.steps and not force:
            return  # the run is over
        in_plan = {s.node_id for s in plan.stages}
        members = self._plan_members(plan)
        ids = frozenset(m.node_id for m in members)
        if not members or (ids == self._considered.get(plan.epoch, in_plan) and not force):
            return
        current = [m for m in members if m.node_id in in_plan]
        try:
            new, placed = self._negotiate(self._next_epoch(plan), members, plan.run)
        except ConfigError as exc:
            log.warning("no plan with the new members: %s", exc)
            return
        # Newcomers only (everyone of the plan stays), all of them left spare: moving blocks
        # among the same nodes is worth a drain only for a plan clearly faster.
        spared = not force and in_plan <= ids and {s.node_id for s in new.stages} == in_plan
        faster = self._placed is None or placed.step_s < self._placed.step_s * (1 - REPLAN_GAIN)
        if spared and (same_stages(new, plan) or not faster):
            self._considered[plan.epoch] = ids
            log.info("no new plan for %s: %.1f ms a microbatch with them, %.1f ms now",
                     ", ".join(sorted(ids - in_plan)), placed.step_s * 1e3,
                     (self._placed.step_s if self._placed else 0) * 1e3)  # fmt: skip
            return
        new.pending = True
        # A broken pipeline's blocks are not at the plan's end step: take them from replicas.
        new.previous.extend(s for s in plan.stages if s.pipeline not in self._broken)
        self._next, self._next_placed = new, placed
        if not keep_drains:
            self._drains = {}
        self._announce(new)
        log.info(
            "plan epoch %d announced with %d nodes (%d new, %d gone); waiting for plan epoch %d "
            "to drain",
            new.epoch,
            len(members),
            len(members) - len(current),
            len(in_plan) - len(current),
            plan.epoch,
        )

    async def Drain(
        self, request: pb.DrainRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DrainReply:
        if request.pipeline in self._broken_in.get(request.plan_epoch, ()):
            # It cannot reach any step: its stages drop their state and wait for the plan
            # without the lost member (the stages behind the first learn it as their streams end).
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"pipeline {request.pipeline} lost a member: it is not drained but dropped",
            )
        if request.plan_epoch in self._ends:  # a retry after the end was fixed
            return pb.DrainReply(stop_step=self._ends[request.plan_epoch])
        plan = self._plan
        if plan is None or request.plan_epoch != plan.epoch:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"drain of plan epoch {request.plan_epoch}, the current one is "
                f"{plan.epoch if plan else 'none'}",
            )
        assert plan is not None
        first = stage_at(plan, request.pipeline, 0)
        if first is None or first.node_id != request.node_id:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {request.node_id[:80]!r} does not feed pipeline {request.pipeline}",
            )
        if self._next is None:
            # The node saw a newer plan that this coordinator does not have: it was announced
            # before a restart (pending plans are not stored). Make it again from the members.
            self._maybe_replan(force=True)
        if self._next is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no newer plan is coming")
        if not plan.start_step <= request.stop_step <= self._train.steps:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stop step {request.stop_step} outside {plan.start_step}..{self._train.steps}",
            )
        self._drains[request.pipeline] = request.stop_step
        if self._drained():
            self._switch(plan)
        await self._notify()
        async with self._changed:
            await self._changed.wait_for(lambda: plan.epoch in self._ends)
        if request.pipeline in self._broken_in.get(plan.epoch, ()):  # a restore ended it
            await context.abort(
                grpc.StatusCode.ABORTED,
                f"plan epoch {plan.epoch} was rolled back to step {self._ends[plan.epoch]}: "
                f"pipeline {request.pipeline} is not drained but dropped",
            )
        return pb.DrainReply(stop_step=self._ends[plan.epoch])

    def _drained(self) -> bool:
        """Every healthy pipeline of the current plan has drained."""
        healthy = set(range(self._train.pipelines)) - self._broken
        return bool(healthy) and healthy <= set(self._drains)

    def _switch(self, plan: pb.Plan) -> None:
        """Every healthy pipeline of `plan` has drained: it ends at the furthest of their
        steps, and the announced plan starts there (unless the run ends first). A broken
        pipeline's steps up to there are dropped: counted, and left out of the mean loss."""
        new = self._next
        assert new is not None
        stop = max(self._drains.values())
        self._ends[plan.epoch] = stop
        self._next, self._drains = None, {}
        for p in sorted(self._broken):
            self._drop_steps(plan, p, stop)
        self._broken = set()
        self._complete_steps()
        if stop >= self._train.steps:
            log.info("the run ends (step %d) before plan epoch %d could start", stop, new.epoch)
            self._replans_closed = True
            return
        new.pending = False
        new.start_step = stop
        self._previous = plan
        assert self._next_placed is not None
        self._adopt(new, self._next_placed)
        self._maybe_replan()  # more members may be waiting

    async def WatchPlan(
        self, request: pb.WatchPlanRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.Plan]:
        # From the current plan on (a newer one may be pending), then each change in order:
        # a node never misses the start of a plan it must train before the next is announced.
        started = [i for i, p in enumerate(self._announcements) if not p.pending]
        sent = started[-1] if started else 0

        def more() -> bool:
            return len(self._announcements) > sent

        while True:
            async with self._changed:
                await self._changed.wait_for(more)
            while sent < len(self._announcements):  # more may come while we yield
                sent += 1
                yield self._announcements[sent - 1]

    # ----- progress ---------------------------------------------------------------------------
    async def Report(
        self, request: pb.StageReport, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportReply:
        plan = self._plan
        if (
            plan is not None
            and self._previous is not None
            and request.plan_epoch == (self._previous.epoch)
        ):
            # The previous plan's stages report their last steps after the switch.
            if request.done or request.step > self._ends.get(self._previous.epoch, 0):
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"plan epoch {request.plan_epoch} ended at step "
                    f"{self._ends.get(self._previous.epoch, 0)}",
                )
            plan = self._previous
        if plan is None or request.plan_epoch != plan.epoch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "report for an unknown plan")
        assert plan is not None
        owner = next((s for s in plan.stages if s.node_id == request.node_id), None)
        if owner is None or (owner.pipeline, owner.index) != (request.pipeline, request.stage):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {request.node_id!r} does not own stage {request.stage} of pipeline "
                f"{request.pipeline}",
            )
        assert owner is not None
        key = (owner.pipeline, owner.index)
        last = len(plan.stages) // self._train.pipelines - 1
        if self._is_repeat(request, key, last):
            # A retry of a report this coordinator already has (its reply was lost, or this
            # coordinator restarted from its store after answering): nothing changes.
            return pb.ReportReply()
        events_before = len(self._events)
        self._latest[key] = request
        # Counters only grow; max() keeps a late-arriving older report from undoing a newer one.
        previous = self._bytes_sent.get(request.node_id, 0)
        self._bytes_sent[request.node_id] = max(previous, request.bytes_sent)
        if request.checkpoint_step > self._checkpoints.get(key, ("", 0))[1]:
            self._checkpoints[key] = (request.node_id, request.checkpoint_step)
        if request.done:
            if key in self._final or request.step != self._train.steps:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"stage {request.stage} of pipeline {request.pipeline} cannot be done at "
                    f"step {request.step}",
                )
            self._final[key] = request
            self._finish_if_done(plan)
        elif owner.index == last:
            # Steps are reported once each, in order: anything else is a confused or hostile
            # peer, and must not grow the event list.
            losses = self._pipeline_losses.setdefault(owner.pipeline, {})
            expected = max(losses, default=self._resumed_at) + 1
            if request.step != expected or expected > self._train.steps:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"report for step {request.step}, expected step {expected}",
                )
            losses[request.step] = request.loss
            self._complete_steps()
        if self._store is not None:
            self._store.save_report(
                node_id=request.node_id,
                bytes_sent=self._bytes_sent[request.node_id],
                loss=None if request.done or owner.index != last
                else (owner.pipeline, request.step, request.loss),
                final=(*key, request) if request.done else None,
                events=[(i, self._events[i]) for i in range(events_before, len(self._events))],
            )  # fmt: skip
        await self._notify()
        return pb.ReportReply()

    def _finish_if_done(self, plan: pb.Plan) -> None:
        """The run is done once every stage of its last plan has sent its final report, but
        for the stages of a pipeline that lost a member in that plan (they never will)."""
        if any(e.done for e in self._events):
            return
        broken = {c["pipeline"] for c in self._crashes if c["plan_epoch"] == plan.epoch}
        if not all((s.pipeline, s.index) in self._final or s.pipeline in broken
                   for s in plan.stages):  # fmt: skip
            return
        for p in sorted(broken):  # a pipeline lost in the last plan: its other steps dropped
            self._drop_steps(plan, p, self._train.steps)
        self._complete_steps()
        self._events.append(self._finish(plan))

    def _drop_steps(self, plan: pb.Plan, pipeline: int, stop: int) -> None:
        """Broken `pipeline` of `plan` trains no step up to `stop`: the steps after its last
        report are dropped (NaN, left out of the mean) and counted; steps it reported past
        `stop` (it was ahead) go too."""
        losses = self._pipeline_losses.setdefault(pipeline, {})
        for step in [s for s in losses if s > stop]:
            del losses[step]
        last = max(losses, default=plan.start_step)
        for step in range(last + 1, stop + 1):
            losses[step] = math.nan
        dropped = max(0, stop - last) * self._train.microbatches
        self._dropped += dropped
        kept = [s for s in self._dropped_steps.get(pipeline, []) if s <= last]
        self._dropped_steps[pipeline] = kept + list(range(last + 1, stop + 1))
        if self._store is not None:
            self._store.forget_losses(pipeline, after=stop)
        self._save_faults()
        log.warning("pipeline %d of plan epoch %d broke after step %d: %d microbatches of "
                    "steps %d to %d dropped", pipeline, plan.epoch, last, dropped, last + 1,
                    stop)  # fmt: skip

    def _complete_steps(self) -> None:
        """Record each step every pipeline has reported (or dropped), in order: its mean loss
        over the pipelines that trained it, and its progress event."""
        step = max(self._losses, default=self._resumed_at) + 1
        while step <= self._train.steps and all(
            step in self._pipeline_losses.get(p, {}) for p in range(self._train.pipelines)
        ):
            trained = [
                loss for p in range(self._train.pipelines)
                if not math.isnan(loss := self._pipeline_losses[p][step])
            ]  # fmt: skip
            self._losses[step] = sum(trained) / len(trained) if trained else math.nan
            self._events.append(self._progress(step, self._losses[step]))
            step += 1

    def _is_repeat(self, request: pb.StageReport, key: tuple[int, int], last: int) -> bool:
        if request.done:
            return self._final.get(key) == request
        if key[1] != last:  # other stages' step reports only carry counters: harmless again
            return False
        losses = self._pipeline_losses.get(key[0], {})
        # NaN is never equal to itself: compare the bits' meaning, not the float.
        return request.step in losses and (
            losses[request.step] == request.loss
            or (math.isnan(losses[request.step]) and math.isnan(request.loss))
        )

    def _progress(self, step: int, loss: float) -> pb.Progress:
        return pb.Progress(
            step=step,
            steps=self._train.steps,
            loss=loss,
            samples=(step - self._resumed_at) * self._train.batch_size * self._train.pipelines,
            wall_s=self._clock() - self._started_at,
            bytes_on_wire=sum(self._bytes_sent.values()),
        )

    def _finish(self, plan: pb.Plan) -> pb.Progress:
        summary = self.summary(plan)
        if self._summary_path is not None:
            write_atomic(self._summary_path, json.dumps(summary, indent=2).encode())
        event = self._progress(self._train.steps, summary["final_loss"])
        event.done = True
        event.summary_json = json.dumps(summary)
        return event

    def summary(self, plan: pb.Plan) -> dict[str, Any]:
        """The run summary; every figure comes from what the stages reported."""
        t = self._train
        wall_s = self._clock() - self._started_at
        trained = range(self._resumed_at + 1, t.steps + 1)  # the steps this run trained
        samples = len(trained) * t.batch_size * t.pipelines
        losses = [self._losses.get(step, math.nan) for step in trained]
        first_pipeline = [r for (p, _), r in self._final.items() if p == 0]
        bytes_on_wire = sum(self._bytes_sent.values())
        activation_bytes = sum(r.activation_bytes_sent for r in self._final.values())
        gradient_bytes = sum(r.gradient_bytes_sent for r in self._final.values())
        return {
            "system": "ravnest-node",
            "model": t.model,
            "nodes": len(plan.stages),
            "steps": t.steps,
            "batch_size": t.batch_size,
            "microbatches": t.microbatches,
            "samples": samples,
            "wall_s": wall_s,
            "samples_per_s": samples / wall_s if wall_s > 0 else math.nan,
            # Resumed from checkpoints at this step: loss_history starts at the step after it.
            "resumed_at": self._resumed_at,
            "initial_loss": losses[0],
            "final_loss": losses[-1],
            "loss_history": losses,
            "bytes_on_wire": bytes_on_wire,
            "bytes_per_sample": bytes_on_wire / samples,
            "activation_bytes_per_sample": activation_bytes / samples,
            "gradient_bytes_per_sample": gradient_bytes / samples,
            "dataset_samples": t.dataset_samples,
            "epochs": samples / t.dataset_samples if t.dataset_samples else math.nan,
            # Of pipeline 0: replicas agree up to their last averaging round.
            "final_params_l2": math.sqrt(sum(r.params_sq_sum for r in first_pipeline)),
            "num_params": sum(r.num_params for r in first_pipeline),
            "pipelines": t.pipelines,
            "loss_history_per_pipeline": [
                [self._pipeline_losses.get(p, {}).get(s, math.nan) for s in trained]
                for p in range(t.pipelines)
            ],
            "average_every": t.average_every,
            "average_codec": t.average_codec,
            "codec": t.activation,
            "gradient_codec": t.gradient,
            "lz4": t.lz4,
            "max_staleness": t.max_staleness,
            "weight_prediction": t.weight_prediction,
            "seed": t.seed,
            "lr": t.lr,
            "data_fingerprint": self._fingerprint,
            "schedule": t.schedule,
            # Every plan of the run, in order: epoch, start step, nodes and stages
            # ([pipeline, stage, first block, stop block, node id]); the last is `stages`.
            "plans": [self._plan_entry(p) for p in self._announcements if not p.pending],
            # Members lost mid-run, and the microbatches their pipelines never trained.
            "crashes": self._crashes,
            "dropped_microbatches": self._dropped,
            # Restores from checkpoints (a lost member had no replica), and the microbatches
            # of the steps rolled back and trained again.
            "restores": self._restores,
            "redone_microbatches": self._redone,
            # This coordinator won a failover election and took the run over: the term, the
            # plan it took over and the coordinator lost (progress before it is not known
            # here: loss_history starts at `resumed_at`, the step the run was restored at).
            "takeover": None
            if self._takeover is None
            else {k: self._takeover[k] for k in ("term", "plan_epoch", "lost_coordinator")},
            # The newest checkpoint each stage's owner reported writing.
            "checkpoints": [
                {"pipeline": p, "stage": i, "node_id": node, "step": step}
                for (p, i), (node, step) in sorted(self._checkpoints.items())
            ],
            "stages": [
                {
                    "pipeline": s.pipeline,
                    "index": s.index,
                    "blocks": [s.first_block, s.stop_block],
                    "node_id": s.node_id,
                    "address": s.address,
                    "relayed": s.relayed,
                    "bytes_sent": self._bytes_sent.get(s.node_id, 0),
                    **(
                        stage_schedule(self._final[(s.pipeline, s.index)])
                        if (s.pipeline, s.index) in self._final
                        else {"lost": True}
                    ),
                }
                for s in plan.stages
            ],
        }

    async def Swarm(
        self, request: pb.SwarmRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.SwarmView:
        now = self._clock()
        caps = [self._capabilities.get(m.node_id) for m in self._members]
        speeds = [0.0] * len(caps)
        measured = [i for i, c in enumerate(caps) if c is not None and c.block_s]
        if self._plan is not None and measured:  # a member still measuring has no speed yet
            known = member_speeds(
                [self._members[i] for i in measured],
                [caps[i] or pb.Capabilities() for i in measured],
            )
            for i, speed in zip(measured, known, strict=True):
                speeds[i] = speed
        last = self._events[-1] if self._events else None
        view = pb.SwarmView(
            swarm_id=self._swarm_id,
            swarm_size=self._swarm_size,
            members=[
                pb.SwarmMember(
                    node_id=m.node_id,
                    address=m.address,
                    compute_s=math.fsum(c.block_s) if c else 0.0,
                    speed=speed,
                    silent_s=self._leases.silent_s(m.node_id, now),
                    lease_expired=self._leases.expired(m.node_id, now),
                    left=m.node_id in self._leases.left,
                    checkpoint_step=max(
                        (step for node, step in self._checkpoints.values() if node == m.node_id),
                        default=0,
                    ),
                    uplink_bps=c.uplink_bps if c else 0.0,
                    rtt_s=c.rtt_s if c else 0.0,
                    relay_node_id=c.relay_node_id if c else "",
                    peer_links=c.peer_links if c else (),
                    measuring_since=self._measuring_since(m.node_id),
                )
                for m, c, speed in zip(self._members, caps, speeds, strict=True)
            ],
            step=last.step if last else 0,
            samples=last.samples if last else 0,
            samples_per_s=last.samples / last.wall_s if last and last.wall_s > 0 else 0.0,
            done=bool(last and last.done),
            relays=self.relay_offers(),
        )
        curve = [e for e in self._events if not e.done and math.isfinite(e.loss)]
        for event in thin(curve, LOSS_POINTS):
            view.loss_steps.append(event.step)
            view.losses.append(event.loss)
        if self._plan is not None:
            view.plan.CopyFrom(self._plan)
            epoch = self._plan.epoch
            view.stages.extend(r for _, r in sorted(self._latest.items()) if r.plan_epoch == epoch)
        return view

    async def WatchProgress(
        self, request: pb.WatchProgressRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.Progress]:
        sent = 0

        def new_events() -> bool:
            return len(self._events) > sent

        while True:
            async with self._changed:
                await self._changed.wait_for(new_events)
            for event in self._events[sent:]:
                yield event
                if event.done:
                    return
            sent = len(self._events)
