"""Finding the coordinator of a swarm without its address: mDNS records and bootstrap peers.

A worker started without a coordinator address (`--join auto`, or only `--peer`) calls
`locate_coordinator`. Candidates come from two kinds of hints:

- a coordinator record of its swarm over mDNS (any `Discovery`), and
- each bootstrap peer (`--peer HOST:PORT`), asked for its `Node.Status`: a peer that is the
  coordinator is taken; a worker peer names the coordinator it follows.

No hint is trusted: a candidate is used only after its own `Node.Status` says it is the
coordinator of this swarm (and, for an mDNS record, that it is the node the record named).
Rounds repeat, waiting for new mDNS records or a short back-off, until the deadline; then
PeerUnavailable lists every hint tried and why it was not used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from ravnest_node.discovery import Discovery
from ravnest_node.errors import ConfigError, PeerError, PeerRefused, PeerUnavailable
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.errors import unanswered
from ravnest_node.transport.options import TransportConfig, grpc_channel, split_host_port

log = logging.getLogger(__name__)

AskStatus = Callable[[str, float], Awaitable[pb.NodeStatus]]
"""ask(address, timeout_s): that node's Node.Status; PeerUnavailable / PeerRefused otherwise."""
Verify = Callable[[str, str], Awaitable[tuple[str | None, pb.NodeStatus]]]
"""verify(address, node_id): why that node is not the coordinator (None if it is), its status."""

# One status call may take this long (a peer behind a dead address must not use up the budget).
ATTEMPT_TIMEOUT_S = 5.0
FIRST_RETRY_S = 0.25
MAX_RETRY_S = 2.0


@dataclass(frozen=True, slots=True)
class Found:
    """The coordinator's address and how it was learned (`pb.FoundVia`)."""

    address: str
    via: pb.FoundVia
    source: str = ""
    """The mDNS record's node id, or the bootstrap peer's address."""
    term: int = 0
    """The election term the coordinator said it leads (0: not elected)."""
    node_id: str = ""
    """The coordinator's node id, as its Node.Status said ("" if not asked)."""

    @property
    def via_name(self) -> str:
        return pb.FoundVia.Name(self.via).removeprefix("FOUND_VIA_").lower()


def grpc_status_asker(transport: TransportConfig) -> AskStatus:
    """An AskStatus over real gRPC channels with the node's transport options."""

    async def ask(address: str, timeout_s: float) -> pb.NodeStatus:
        try:
            split_host_port(address)
        except ConfigError as exc:
            raise PeerRefused(f"not an address: {exc}") from None
        channel = grpc_channel(address, transport)
        try:
            stub = pb_grpc.NodeStub(channel)
            # No wait_for_ready: a peer that is down fails at once, and the next round retries.
            status: pb.NodeStatus = await stub.Status(pb.StatusRequest(), timeout=timeout_s)
            return status
        except grpc.aio.AioRpcError as exc:
            # The status alone: callers name the address in their own words ("peer X: ...").
            fault = PeerUnavailable if unanswered(exc.code()) else PeerRefused
            raise fault(f"{exc.code().name}: {exc.details()}") from None
        finally:
            await channel.close(grace=None)

    return ask


def grpc_vote_asker(
    transport: TransportConfig,
) -> Callable[[str, pb.VoteRequest], Awaitable[pb.VoteReply]]:
    """Asks a node for its vote (`Election.Vote`) over a real gRPC channel."""

    async def ask(address: str, request: pb.VoteRequest) -> pb.VoteReply:
        channel = grpc_channel(address, transport)
        try:
            reply: pb.VoteReply = await pb_grpc.ElectionStub(channel).Vote(
                request, timeout=ATTEMPT_TIMEOUT_S
            )
            return reply
        except grpc.aio.AioRpcError as exc:
            raise PeerRefused(f"{exc.code().name}: {exc.details()}") from None
        finally:
            await channel.close(grace=None)

    return ask


def check_coordinator(status: pb.NodeStatus, swarm: str, node_id: str = "") -> str | None:
    """Why `status` is not the coordinator of `swarm` (and, if given, node `node_id`); None if
    it is. Pure."""
    if status.swarm_name != swarm:
        return f"it is in swarm {status.swarm_name[:64]!r}, not {swarm!r}"
    if status.role != pb.NODE_ROLE_COORDINATOR:
        return "it is not a coordinator"
    if node_id and status.node_id != node_id:
        return f"it is node {status.node_id[:64]!r}, not {node_id!r} as advertised"
    return None


async def locate_coordinator(
    *,
    swarm: str,
    discovery: Discovery | None,
    peers: Sequence[str],
    ask: AskStatus,
    timeout_s: float,
) -> Found:
    """The verified coordinator of `swarm`, from mDNS records and bootstrap peers; waits for
    one up to `timeout_s`. Raises PeerUnavailable naming every hint tried and the outcome."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    tried: dict[str, str] = {}  # hint -> why it was not used (last outcome)
    retry_s = FIRST_RETRY_S
    warned: set[str] = set()

    async def verify(address: str, node_id: str = "") -> tuple[str | None, pb.NodeStatus]:
        """Why the node at `address` is not the coordinator (None if it is), and its status."""
        budget = min(ATTEMPT_TIMEOUT_S, max(0.05, deadline - loop.time()))
        try:
            status = await ask(address, budget)
        except PeerError as exc:
            return str(exc), pb.NodeStatus()
        return check_coordinator(status, swarm, node_id), status

    while True:
        generation = discovery.generation if discovery is not None else 0
        if discovery is not None:
            found = await _ask_mdns(discovery, swarm, verify, tried, warned)
            if found is not None:
                return found
        for peer in peers:
            found = await _ask_peer(peer, swarm, ask, verify, deadline, tried)
            if found is not None:
                return found
        left = deadline - loop.time()
        if left <= 0:
            break
        wait_s, retry_s = min(retry_s, left), min(2 * retry_s, MAX_RETRY_S)
        if discovery is not None:
            await discovery.wait_newer(generation, wait_s)  # a new record ends the wait early
        else:
            await asyncio.sleep(wait_s)  # a back-off between rounds of asking the peers
    raise _not_found(swarm, timeout_s, discovery, tried)


async def _ask_mdns(
    discovery: Discovery,
    swarm: str,
    verify: Verify,
    tried: dict[str, str],
    warned: set[str],
) -> Found | None:
    """The coordinator records seen over mDNS: of those that check out, the one of the highest
    term (None if none does). Warns once about each new set of several coordinators."""
    coordinators = [r for r in discovery.records() if r.txt.role == "coordinator"]
    ids = {r.txt.node_id for r in coordinators}
    if len(ids) > 1 and not ids <= warned:
        warned |= ids
        log.warning(
            "%d coordinators advertise swarm %r over mDNS (%s); trying them in order",
            len(coordinators), swarm, ", ".join(r.txt.node_id for r in coordinators),
        )  # fmt: skip
    # Of several that check out (a deposed coordinator that came back still says it
    # is one until it learns of its successor), the one of the highest term.
    checked: list[Found] = []
    for record in coordinators:
        for address in record.addresses:
            why, status = await verify(address, record.txt.node_id)
            if why is None:
                checked.append(Found(address, pb.FOUND_VIA_MDNS, record.txt.node_id,
                                     status.term, status.node_id))  # fmt: skip
                break
            tried[f"mDNS coordinator {record.txt.node_id} at {address}"] = why
    return max(checked, key=lambda f: f.term) if checked else None


def _not_found(
    swarm: str, timeout_s: float, discovery: Discovery | None, tried: dict[str, str]
) -> PeerUnavailable:
    """The error of a search that found no coordinator, naming every hint tried."""
    sources = []
    if discovery is not None:
        sources.append(discovery.describe())
    sources += [f"{hint}: {why}" for hint, why in tried.items()]
    if not sources:
        sources.append("nothing (no mDNS and no --peer)")
    return PeerUnavailable(
        f"found no coordinator of swarm {swarm!r} within {timeout_s:g} s; tried "
        + "; ".join(sources)
    )


async def _ask_peer(
    peer: str,
    swarm: str,
    ask: AskStatus,
    verify: Verify,
    deadline: float,
    tried: dict[str, str],
) -> Found | None:
    """One bootstrap peer: the coordinator itself, or the coordinator it names (verified)."""
    hint = f"peer {peer}"
    budget = min(ATTEMPT_TIMEOUT_S, max(0.05, deadline - asyncio.get_running_loop().time()))
    try:
        status = await ask(peer, budget)
    except PeerError as exc:
        tried[hint] = str(exc)
        return None
    if status.swarm_name != swarm:
        tried[hint] = f"it is in swarm {status.swarm_name[:64]!r}, not {swarm!r}"
        return None
    if status.role == pb.NODE_ROLE_COORDINATOR:
        return Found(peer, pb.FOUND_VIA_PEER, peer, status.term, status.node_id)
    named = status.coordinator_address
    if not named:
        tried[hint] = "it knows no coordinator yet"
        return None
    why, named_status = await verify(named, "")
    if why is None:
        return Found(named, pb.FOUND_VIA_PEER, peer, named_status.term, named_status.node_id)
    tried[f"coordinator {named[:80]} named by {hint}"] = why
    return None
