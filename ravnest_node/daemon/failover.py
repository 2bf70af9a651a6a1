"""Who coordinates this node's swarm, as the node knows it: the coordinator it follows and how
it found it, its own coordinator service if it is the coordinator, and the elections that
choose one (`--join elect`: the first, and a failover when the elected coordinator is lost).

The decisions of a failover that depend only on the plan (who is lost, who votes, in which
order members stand) are the pure `electorate`; `Leadership` does the asking and waiting.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.coordination.election import Ballot, VoteBook, stand
from ravnest_node.coordination.locate import (
    AskStatus,
    Found,
    check_coordinator,
    grpc_status_asker,
    grpc_vote_asker,
    locate_coordinator,
)
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.daemon.worker.worker import Worker
from ravnest_node.discovery import MdnsDiscovery, PeerRecord
from ravnest_node.errors import PeerError, PeerUnavailable, RunFailed
from ravnest_node.proto import control_pb2 as pb

log = logging.getLogger(__name__)

FAILOVER_STAND_S = 1.0
"""In a failover election the plan's members stand in the order of their node ids, this many
seconds apart: the first at once, each next one only if no coordinator has come up by then."""
FAILOVER_STATUS_S = 2.0
"""How long a failover waits for a member's Node.Status when looking for the new coordinator."""
ASK_SEEN_S = 0.5
"""How long one round of asking the nodes seen over mDNS for the coordinator may take, in a
first election (Leadership._ask_seen)."""


@dataclass(frozen=True, slots=True)
class Electorate:
    """Who elects a new coordinator when the one of a plan is lost."""

    lost: frozenset[str]
    """The plan's members that are the lost coordinator (by node id, or by its address)."""
    members: dict[str, str]
    """The plan's other members: node id -> address."""
    size: int
    """Members of the plan, the lost ones included: a majority is of these."""
    voters: tuple[tuple[str, str], ...]
    """The members this node asks for their vote (all but itself), by node id."""
    rank: int
    """This node's place in the order the members stand in (node ids); len(members) for a
    node that is not a member (a spare), which does not stand."""


def electorate(plan: pb.Plan, own_id: str, lost_id: str, lost_address: str) -> Electorate:
    """The electorate of a failover after the coordinator `lost_id` at `lost_address` of
    `plan` is lost, as node `own_id` sees it."""
    lost = {s.node_id for s in plan.stages if s.node_id == lost_id or s.address == lost_address}
    members: dict[str, str] = {}
    for s in plan.stages:
        if s.node_id not in lost:
            members.setdefault(s.node_id, s.address)
    order = sorted(members)
    return Electorate(
        lost=frozenset(lost),
        members=members,
        size=len({s.node_id for s in plan.stages}),
        voters=tuple((n, a) for n, a in sorted(members.items()) if n != own_id),
        rank=order.index(own_id) if own_id in members else len(order),
    )


class Leadership:
    """The coordinator this node follows (`found`), and its own coordinator `service` while
    it is one: from the start (no --join, no --peer), after an election, or never.

    The daemon sets `address` once its server listens and `mdns` while mDNS runs. Methods
    that fail the run raise PeerError (no coordinator found or elected) or RunFailed (this
    coordinator stepped down)."""

    def __init__(
        self,
        config: NodeConfig,
        node_id: str,
        new_service: Callable[[int], CoordinatorService],
    ) -> None:
        self._config = config
        self._node_id = node_id
        self._new_service = new_service
        """A coordinator service for an epoch (a term, once elected)."""
        self.address = ""
        """This node's address (an elected coordinator's, for its members)."""
        self.certificate = b""
        """This node's certificate from the swarm's authority, for its votes (b"" if none)."""
        self.mdns: MdnsDiscovery | None = None
        self.votes = VoteBook(config.state_dir) if config.discovery.elects else None
        self.found: Found | None = None
        """The coordinator this node follows and how it learned of it (None while looking)."""
        self.service: CoordinatorService | None = None
        """This node's coordinator service: from the start, after an election, or never."""
        self.led_term = 0
        """The election term this node won and leads as coordinator (0: none)."""
        self._lost: set[str] = set()
        """Coordinators (node ids) this node lost: it never votes for them again."""

    @property
    def term(self) -> int:
        """A coordinator: the term it leads; any other node: the last it voted in."""
        if self.service is not None and self.led_term:
            return self.led_term
        return self.votes.state.term if self.votes is not None else 0

    def ballot(self, worker: Worker) -> Ballot:
        """What this node's vote depends on (ElectionService)."""
        records = self.mdns.records() if self.mdns is not None else []
        latest = worker.latest_plan
        return Ballot(
            own_id=self._node_id,
            seen=frozenset(r.txt.node_id for r in records),
            following=self.found.address if self.found is not None else "",
            plan_epoch=latest.epoch if latest is not None else 0,
            lost=frozenset(self._lost),
        )

    async def coordinator_address(self) -> str:
        """The address of the coordinator this node follows; if none yet, --join's, or the
        one the bootstrap peers name (kept as this node's). PeerError if there is none."""
        cfg = self._config
        if self.found is None:
            if cfg.discovery.join_address is not None:
                self.found = Found(cfg.discovery.join_address, pb.FOUND_VIA_CONFIG)
            else:
                self.found = await locate_coordinator(
                    swarm=cfg.swarm_name, discovery=None, peers=cfg.discovery.peers,
                    ask=grpc_status_asker(cfg.transport),
                    timeout_s=cfg.transport.connect_timeout_s,
                )  # fmt: skip
        return self.found.address

    async def find(self, worker: Worker, timeout_s: float | None = None) -> None:
        """Locate and check the coordinator (mDNS, --peer), within the connect timeout, and
        have `worker` follow it; PeerUnavailable naming what was tried if there is none."""
        cfg = self._config
        log.info(
            "looking for the coordinator of swarm %r (%s) for up to %g s",
            cfg.swarm_name,
            ", ".join((["mDNS"] if self.mdns else []) + [f"peer {p}" for p in cfg.discovery.peers]),
            cfg.transport.connect_timeout_s,
        )
        found = await locate_coordinator(
            swarm=cfg.swarm_name,
            discovery=self.mdns,
            peers=cfg.discovery.peers,
            ask=grpc_status_asker(cfg.transport),
            timeout_s=cfg.transport.connect_timeout_s if timeout_s is None else timeout_s,
        )
        log.info("coordinator %s found via %s (%s)", found.address, found.via_name, found.source)
        self.found = found
        worker.coordinator_address = found.address

    async def elect(self, worker: Worker) -> None:
        """--join elect: follow the coordinator the swarm elected, or stand and become it."""
        cfg, mdns, votes = self._config, self.mdns, self.votes
        assert mdns is not None and votes is not None  # settings require --mdns
        swarm_size = cfg.membership.swarm_size
        loop = asyncio.get_running_loop()
        timeout_s = cfg.transport.connect_timeout_s
        deadline = loop.time() + timeout_s
        ask = grpc_vote_asker(cfg.transport)
        log.info("electing a coordinator for swarm %r of %d nodes", cfg.swarm_name, swarm_size)
        while True:
            generation = mdns.generation
            records = mdns.records()
            if any(r.txt.role == "coordinator" for r in records):
                await self.find(worker, deadline - loop.time())
                return
            # Stand once this node is announced (voters must see it) and sees the whole swarm.
            if (
                mdns.registered.is_set()
                and len(records) >= swarm_size - 1
                and all(self._node_id < r.txt.node_id for r in records)
            ):
                voters = [(r.txt.node_id, r.addresses[0]) for r in records if r.addresses]
                term = await stand(
                    book=votes,
                    own_id=self._node_id,
                    swarm=cfg.swarm_name,
                    swarm_size=swarm_size,
                    voters=voters,
                    ask=ask,
                    certificate=self.certificate,
                )
                if term is not None:
                    self._lead(self._new_service(term), term)
                    worker.coordinator_address = self.address
                    await mdns.set_role("coordinator")
                    return
            if records and await self._ask_seen(worker, records, deadline - loop.time()):
                return
            left = deadline - loop.time()
            if left <= 0:
                raise PeerUnavailable(
                    f"no coordinator of swarm {cfg.swarm_name!r} elected within {timeout_s:g} s; "
                    f"sees {len(records)} of the {swarm_size - 1} other nodes "
                    f"(term {votes.state.term}); {mdns.describe()}"
                )
            # A new record ends the wait at once; otherwise retry after a jittered back-off.
            await mdns.wait_newer(generation, min(left, random.uniform(0.3, 0.9)))

    async def _ask_seen(self, worker: Worker, records: list[PeerRecord], left_s: float) -> bool:
        """Ask the nodes this node sees over mDNS for the coordinator, as `locate` asks peers
        (one that is it, or names it, checked): a node that refused its vote (it did not see
        the candidate yet) learns of the winner even when the winner's coordinator record is
        late or lost (CI, 2026-12-04: one never came in 30 s). True if found and followed."""
        peers = [r.addresses[0] for r in records if r.addresses]
        if not peers or left_s <= 0:
            return False
        try:
            found = await locate_coordinator(
                swarm=self._config.swarm_name, discovery=None, peers=peers,
                ask=grpc_status_asker(self._config.transport), timeout_s=min(left_s, ASK_SEEN_S),
            )  # fmt: skip
        except PeerUnavailable:
            return False
        log.info("coordinator %s found via %s (%s)", found.address, found.via_name, found.source)
        self.found = found
        worker.coordinator_address = found.address
        return True

    def _lead(self, service: CoordinatorService, term: int) -> None:
        """This node won the election of `term`: it is the coordinator, and follows itself."""
        self.service, self.led_term = service, term
        self.found = Found(self.address, pb.FOUND_VIA_ELECTION, f"term {term}", term, self._node_id)

    async def keep(
        self, worker: Worker, *, stopped: Callable[[], bool], leaving: Callable[[], bool]
    ) -> None:
        """--join elect, once the swarm has a plan: while this node follows an elected
        coordinator, wait for its loss and elect another (`_fail_over`); while this node is
        the coordinator, watch for one of a higher term, and step down if there is one."""
        while not stopped():
            if self.service is None:
                await worker.wait_until(
                    lambda: (
                        self.service is not None
                        or (
                            worker.coordinator_lost
                            and worker.started_plan is not None
                            and not worker.run_finished
                        )
                    )
                )
                if self.service is not None:  # elected meanwhile (the first election)
                    continue
                if leaving() or stopped():
                    return  # a node on its way out does not stand
                await self._fail_over(worker)
            elif self.led_term:
                successor = await self._successor(worker, self.led_term, {self._node_id})
                if successor is not None or self._votes_for_later_term():
                    self._step_down(successor)
                # Each new mDNS record ends the wait (a successor's, say); otherwise a lease.
                lease_s = self._config.membership.lease_s
                if self.mdns is not None:
                    await self.mdns.wait_newer(self.mdns.generation, lease_s)
                else:
                    await asyncio.sleep(lease_s)  # the period of a check, not a wait for one
            else:
                return  # a coordinator by configuration: nobody takes over from it

    def _votes_for_later_term(self) -> bool:
        """This coordinator voted in a term after the one it leads: another node won it."""
        return self.votes is not None and self.votes.state.term > self.led_term

    def _step_down(self, successor: Found | None) -> None:
        """A coordinator of a later term leads the swarm: stop acting as one (its calls are
        refused from now on) and fail the run (RunFailed): this node's stage is of a run the
        swarm has left."""
        voted = self.votes.state.term if self.votes is not None else 0
        who = (f"node at {successor.address} leads term {successor.term}" if successor
               else f"this node voted in term {voted}")  # fmt: skip
        self.service = None
        raise RunFailed(
            f"this node led term {self.led_term} as coordinator, but the swarm has elected "
            f"another ({who}): it steps down and stops; start it again to rejoin the swarm"
        )

    async def _successor(
        self, worker: Worker, above_term: int, lost: set[str], ask: AskStatus | None = None
    ) -> Found | None:
        """The coordinator of the highest term above `above_term` among the members of this
        node's newest plan and the coordinators advertised over mDNS (not `lost`, not this
        node), checked with Node.Status; None if there is none."""
        ask = ask or grpc_status_asker(self._config.transport)
        plan = worker.latest_plan
        hints = {s.node_id: s.address for s in plan.stages} if plan is not None else {}
        if self.mdns is not None:
            for r in self.mdns.records():
                if r.txt.role == "coordinator" and r.addresses:
                    hints.setdefault(r.txt.node_id, r.addresses[0])
        hints = {n: a for n, a in hints.items() if n not in lost and n != self._node_id}

        async def check(node_id: str, address: str) -> Found | None:
            try:
                status = await ask(address, FAILOVER_STATUS_S)
            except PeerError:
                return None
            if check_coordinator(status, self._config.swarm_name, node_id) is not None:
                return None
            if status.term <= above_term:
                return None
            return Found(address, pb.FOUND_VIA_ELECTION, f"term {status.term}", status.term,
                         status.node_id)  # fmt: skip

        found = [f for f in await asyncio.gather(*(check(n, a) for n, a in hints.items())) if f]
        return max(found, key=lambda f: f.term) if found else None

    async def _fail_over(self, worker: Worker) -> None:
        """The elected coordinator this node followed is lost (its address refusing the plan
        stream for a few seconds: its process is gone; or unreachable, its heartbeats
        failing, for `hold_s`: a cut of its link shorter than that starts no second
        coordinator, CoordinatorClient.lost): elect another among the members of the newest
        plan this node trained, and follow it, or take the run over if this node wins. If the
        old coordinator answers after all (only this node lost it), follow it again.
        PeerUnavailable if no coordinator comes up within the connect timeout plus two leases
        (a spare, which cannot stand, waits as long as it takes)."""
        cfg, votes, plan = self._config, self.votes, worker.started_plan
        assert votes is not None and plan is not None
        old, before = worker.coordinator_address, self.found
        lost_term = before.term if before is not None else 0
        voters = electorate(plan, self._node_id, before.node_id if before else "", old)
        lost = set(voters.lost)
        self._lost |= lost
        self.found = None  # following nobody now: this node may vote
        loop = asyncio.get_running_loop()
        start = loop.time()
        wait_s = cfg.transport.connect_timeout_s + 2 * cfg.membership.lease_s
        log.warning("coordinator %s (%s, term %d) is lost: electing another among the %d "
                    "members of plan epoch %d", old, ", ".join(sorted(lost)) or "no member",
                    lost_term, len(voters.members), plan.epoch)  # fmt: skip
        ask_status = grpc_status_asker(cfg.transport)
        while True:
            found, alive = await asyncio.gather(
                self._successor(worker, lost_term, lost, ask_status),
                self._still_leads(old, lost, lost_term, ask_status),
            )
            if found is not None:
                self.found = found
                log.info("coordinator %s of term %d found after the failover", found.address,
                         found.term)  # fmt: skip
                await worker.follow(found.address)
                return
            if alive and before is not None:
                log.warning("coordinator %s answers after all: following it again", old)
                self.found = before
                self._lost -= lost
                await worker.coordinator_back()
                return
            member = self._node_id in voters.members
            stands = member and loop.time() >= start + voters.rank * FAILOVER_STAND_S
            if stands and await self._stand_after(worker, plan, voters, votes):
                return
            if loop.time() - start >= wait_s and member:
                raise PeerUnavailable(
                    f"coordinator {old} was lost and no other was elected within {wait_s:g} s "
                    f"(term {votes.state.term}; {len(voters.members)} members of plan epoch "
                    f"{plan.epoch} left, {voters.size // 2 + 1} votes needed)"
                )
            # A jittered back-off between rounds (two candidates must not keep colliding).
            await asyncio.sleep(random.uniform(0.3, 0.9))

    async def _stand_after(
        self, worker: Worker, plan: pb.Plan, voters: Electorate, votes: VoteBook
    ) -> bool:
        """Stand in a failover election; if this node wins, take the run of `plan` over as
        its coordinator and follow itself. Whether it won."""
        latest = worker.latest_plan or plan
        term = await stand(
            book=votes,
            own_id=self._node_id,
            swarm=self._config.swarm_name,
            swarm_size=voters.size,
            voters=list(voters.voters),
            ask=grpc_vote_asker(self._config.transport),
            plan_epoch=latest.epoch,
            certificate=self.certificate,
        )
        if term is None:
            return False
        service = self._new_service(term)
        service.take_over(plan, set(voters.lost), term, known_epoch=latest.epoch)
        self._lead(service, term)
        if self.mdns is not None:
            await self.mdns.set_role("coordinator")
        await worker.follow(self.address)
        return True

    async def _still_leads(
        self, address: str, node_ids: set[str], term: int, ask: AskStatus
    ) -> bool:
        """The coordinator at `address` (one of `node_ids`) answers, and still leads `term`."""
        try:
            status = await ask(address, FAILOVER_STATUS_S)
        except PeerError:
            return False
        return (
            check_coordinator(status, self._config.swarm_name) is None
            and status.node_id in node_ids
            and status.term == term
        )
