"""Choosing a coordinator among the nodes of a LAN swarm (`--join elect`).

Every node of the swarm is started the same way, with the same `--swarm-size`. Each advertises
itself over mDNS and waits until it sees the whole swarm (`swarm_size - 1` others). The node with
the smallest id then stands: it moves to a new term, votes for itself and asks the others for
their votes (`Election.Vote`). It becomes the coordinator only with a majority of the swarm
(`swarm_size // 2 + 1` votes, its own included), and its plans carry the term as their epoch.

Two nodes can never both act as coordinator of one term: a node grants at most one vote per term
(written to its state directory before it answers, so a restart does not vote twice), and two
majorities of one swarm always share a node. A voter grants only while it follows no coordinator
and only to the smallest node id it sees (its own included), so a node that has not yet seen the
smallest one cannot win votes from those that have. The rules are pure functions (`grant_vote`);
the service and the candidate's round wrap them.

When an elected coordinator is lost after the first plan (its plan stream unreachable), the
members of the newest plan elect another among themselves (a failover, daemon/failover.py):
the electorate is that plan's nodes, the majority is over all of them (the lost one included),
and a voter grants its vote to a candidate that knows a plan at least as new as its own and is
not the coordinator it lost (Raft's "at least as up to date" rule: a node restarted with no plan
cannot win and start the run over). The winner takes the run over from that plan
(`CoordinatorService.take_over`); a coordinator that learns of a higher term steps down.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from ravnest_node.errors import ConfigError, PeerError
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.state import valid_node_id, write_atomic
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.proofs import check_request

log = logging.getLogger(__name__)

VOTE_FILE = "vote.json"


def majority(swarm_size: int) -> int:
    """Votes a candidate needs: more than half of the expected swarm."""
    return swarm_size // 2 + 1


@dataclass(frozen=True, slots=True)
class VoteState:
    term: int = 0
    voted_for: str = ""
    """Whom this node voted for in `term` ("" if nobody yet)."""


@dataclass(frozen=True, slots=True)
class Ballot:
    """What the voter knows when a request arrives."""

    own_id: str
    seen: frozenset[str]
    """Node ids of its swarm it sees now (over mDNS), not its own."""
    following: str
    """The coordinator it follows ("" if none, or if it has lost it)."""
    plan_epoch: int = 0
    """The newest plan epoch it knows: 0 before the first plan (the first election)."""
    lost: frozenset[str] = frozenset()
    """Coordinators (node ids) it has lost: never voted for again."""


def grant_vote(
    state: VoteState, term: int, candidate: str, ballot: Ballot, candidate_epoch: int = 0
) -> tuple[VoteState, bool, str]:
    """The voter's new state, whether it grants `candidate` (which knows plan epoch
    `candidate_epoch`) its vote in `term`, and why not. Pure."""
    if term < state.term:
        return state, False, f"term {term} is behind this node's term {state.term}"
    if ballot.following:
        return state, False, f"this node follows coordinator {ballot.following}"
    if ballot.plan_epoch:  # a failover: the electorate is the plan's members
        if candidate in ballot.lost:
            return state, False, "the candidate is the coordinator this node lost"
        if candidate_epoch < ballot.plan_epoch:
            return (
                state,
                False,
                (
                    f"the candidate knows plan epoch {candidate_epoch}, this node "
                    f"{ballot.plan_epoch}"
                ),
            )
    else:
        if candidate != ballot.own_id and candidate not in ballot.seen:
            return state, False, "this node does not see the candidate over mDNS yet"
        smallest = min(ballot.seen | {ballot.own_id})
        if candidate != smallest:
            return state, False, f"this node sees a smaller node id ({smallest})"
    if term == state.term and state.voted_for not in ("", candidate):
        return state, False, f"this node voted for {state.voted_for} in term {term}"
    return VoteState(term=term, voted_for=candidate), True, ""


class VoteBook:
    """This node's vote, kept in `<state dir>/vote.json` when there is a state directory."""

    def __init__(self, state_dir: Path | None) -> None:
        self._path = state_dir / VOTE_FILE if state_dir is not None else None
        self.state = self._load()

    def _load(self) -> VoteState:
        if self._path is None or not self._path.exists():
            return VoteState()
        try:
            raw: Any = json.loads(self._path.read_text())
            state = VoteState(term=int(raw["term"]), voted_for=str(raw["voted_for"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{self._path} is not a vote record ({exc}); remove it") from None
        if state.term < 0 or (state.voted_for and not valid_node_id(state.voted_for)):
            raise ConfigError(f"{self._path} is not a vote record; remove it")
        return state

    def record(self, state: VoteState) -> None:
        """Keep `state` (on disk first, then in memory)."""
        if state == self.state:
            return
        if self._path is not None:
            payload = {"term": state.term, "voted_for": state.voted_for}
            write_atomic(self._path, json.dumps(payload).encode())
        self.state = state


class ElectionService(pb_grpc.ElectionServicer):
    """Serves `ravnest.v1.Election` for a node started with --join elect."""

    def __init__(
        self,
        swarm: str,
        book: VoteBook,
        ballot: Callable[[], Ballot],
        check_member: Callable[[str, bytes], None] | None = None,
    ) -> None:
        """`check_member(node_id, certificate)`: Refusal unless the candidate may be a member
        (transport/membership.py: not revoked; certified where the authority certifies)."""
        self._swarm = swarm
        self._book = book
        self._ballot = ballot
        self._check_member = check_member
        self._lock = asyncio.Lock()

    async def Vote(
        self, request: pb.VoteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.VoteReply:
        if request.swarm_name != self._swarm:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node is not in swarm {request.swarm_name!r}",
            )
        if not valid_node_id(request.candidate_id):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "candidate_id is not a node id")
        try:  # the candidate itself asks (transport/proofs.py), and may be a member
            check_request(context, "/ravnest.v1.Election/Vote", request)
            if self._check_member is not None:
                self._check_member(request.candidate_id, request.node_certificate)
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.reason)
        async with self._lock:
            state, granted, reason = grant_vote(
                self._book.state,
                request.term,
                request.candidate_id,
                self._ballot(),
                request.plan_epoch,
            )
            self._book.record(state)  # before the answer leaves
        log.info(
            "election term %d: %s vote for %s%s",
            request.term,
            "granted" if granted else "refused",
            request.candidate_id,
            f" ({reason})" if reason else "",
        )
        return pb.VoteReply(term=self._book.state.term, granted=granted, reason=reason)


AskVote = Callable[[str, pb.VoteRequest], Awaitable[pb.VoteReply]]


async def stand(
    *,
    book: VoteBook,
    own_id: str,
    swarm: str,
    swarm_size: int,
    voters: Sequence[tuple[str, str]],
    ask: AskVote,
    plan_epoch: int = 0,
    certificate: bytes = b"",
) -> int | None:
    """One round as candidate: a new term, this node's own vote, then the others'. Returns the
    term won with a majority of `swarm_size`, or None (the caller waits and tries again).
    `plan_epoch`: the newest plan this node knows (a failover; 0 before the first plan);
    `certificate`: this node's from the swarm's authority (b"" if none)."""
    term = book.state.term + 1
    book.record(replace(book.state, term=term, voted_for=own_id))
    request = pb.VoteRequest(
        swarm_name=swarm, term=term, candidate_id=own_id, plan_epoch=plan_epoch,
        node_certificate=certificate,
    )  # fmt: skip

    async def one(node_id: str, address: str) -> bool:
        try:
            reply = await ask(address, request)
        except (PeerError, TimeoutError) as exc:  # a voter that is down is one vote fewer
            log.info("election term %d: no vote from %s (%s)", term, node_id, exc)
            return False
        if reply.term > book.state.term:
            book.record(VoteState(term=reply.term))
        if not reply.granted:
            log.info("election term %d: %s refused: %s", term, node_id, reply.reason)
        return reply.granted

    votes = 1 + sum(await asyncio.gather(*(one(n, a) for n, a in voters)))
    won = votes >= majority(swarm_size) and book.state.term == term
    log.info(
        "election term %d: %d of %d votes (%d needed)%s",
        term,
        votes,
        swarm_size,
        majority(swarm_size),
        ": this node is the coordinator" if won else "",
    )
    return term if won else None
