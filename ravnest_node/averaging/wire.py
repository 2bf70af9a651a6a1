"""The gRPC side of averaging: the Push method, its server handler and the pushing client.

`/ravnest.v1.Averaging/Push` is a raw-bytes unary method (no protobuf around tensors, as for
boundary streams): the request is one tensor frame of kind DELTA, the response is empty. The
sender's node id travels in the `ravnest-node-id` invocation metadata. gRPC errors are
translated here: PeerUnavailable when a member cannot be reached in time, PeerRefused when it
answers with an error status.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from ravnest_node.averaging.robust import BanList
from ravnest_node.errors import PeerRefused, PeerUnavailable
from ravnest_node.transport import proofs
from ravnest_node.transport.boundary import LinkCounters
from ravnest_node.transport.errors import UNANSWERED, Refusal
from ravnest_node.transport.gate import peer_address, peer_host
from ravnest_node.transport.options import TransportConfig, grpc_channel
from ravnest_node.transport.proofs import NODE_ID_KEY, Caller

log = logging.getLogger(__name__)

SERVICE = "ravnest.v1.Averaging"
METHOD = "Push"
PATH = f"/{SERVICE}/{METHOD}"
MAX_NODE_ID_LEN = 128

ChannelFactory = Callable[[str], Any]
"""Makes a grpc.aio channel to a "host:port" address (grpc is untyped to mypy)."""

_NOT_YET = frozenset({grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION})
"""Refusals of a push that came too early (see PeerBehind)."""


@dataclass(frozen=True, slots=True)
class Replica:
    """One member of a replica group."""

    node_id: str
    """The member's node id (what it sends in `ravnest-node-id`)."""
    address: str
    """Where its gRPC server listens, "host:port"."""


class PushReceiver(Protocol):
    """What takes the pushes a node's server receives (a ReplicaAverager)."""

    async def receive(self, request: bytes, sender: str, source: str = "") -> None:
        """Take one pushed message from node `sender` (as it claims), which came from the host
        `source`; raises Refusal (with the gRPC status to answer) if it is not wanted, and then
        changes nothing."""
        ...


def push_handler(
    receiver: Callable[[], PushReceiver | None], caller: Caller = proofs.caller
) -> Any:
    """The gRPC generic handler of `PATH`, passing each push to `receiver()`; while that is
    None (no replica group yet) pushes are refused with FAILED_PRECONDITION. A push whose
    sender's proof fails is refused UNAUTHENTICATED first (`caller`: proofs.py; unit tests of
    averaging give one that takes their readable ids)."""

    async def serve(request: bytes, context: Any) -> bytes:
        metadata = dict(context.invocation_metadata() or ())
        sender = str(metadata.get(NODE_ID_KEY, ""))[:MAX_NODE_ID_LEN]
        target = receiver()
        try:
            caller(context, PATH)
            if target is None:
                raise Refusal(
                    grpc.StatusCode.FAILED_PRECONDITION, "this node has no replica group (yet)"
                )
            await target.receive(request, sender, peer_host(context.peer())[0])
        except Refusal as refusal:
            # Not there yet: the sender tries again while its round lasts (quietly, then).
            early = refusal.code in _NOT_YET
            log.log(
                logging.DEBUG if early else logging.WARNING,
                "refused a push from %r (%s): %s",
                sender,
                peer_address(context.peer()),
                refusal.reason,
            )
            await context.abort(refusal.code, refusal.reason)
        return b""

    return grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(serve)}
    )


class AveragingService:
    """The Push handler of a node whose server starts before it knows its replica group:
    register `handler()` once, then `attach` the averager of the current group (or None)."""

    def __init__(self) -> None:
        """A service with no averager attached: pushes are refused until `attach`."""
        self._receiver: PushReceiver | None = None
        self.bans = BanList()
        """The node's record of rejected deltas and banned replicas, kept across groups."""

    def attach(self, receiver: PushReceiver | None) -> None:
        """Route pushes to `receiver` from now on (None: refuse them)."""
        self._receiver = receiver

    def handler(self, caller: Caller = proofs.caller) -> Any:
        """The gRPC generic handler to add to the node's grpc.aio server."""
        return push_handler(lambda: self._receiver, caller)


class PeerBehind(PeerRefused):
    """The member refused a push of a round it has not reached (OUT_OF_RANGE), or came before
    it had its replica group (FAILED_PRECONDITION): it will take the push once it gets there."""


class PeerExcludes(PeerRefused):
    """The member refused a push because it does not average with this node (PERMISSION_DENIED:
    it banned this node, or does not count it in its group): it sends this node nothing
    either, so a round need not wait for it."""


_REFUSED: dict[grpc.StatusCode, type[PeerRefused]] = {
    **dict.fromkeys(_NOT_YET, PeerBehind),
    grpc.StatusCode.PERMISSION_DENIED: PeerExcludes,
}
"""Refusals a round acts on (any other is a PeerRefused: logged, nothing more)."""


class Pusher:
    """The client side: one channel per member (opened on first use), one Push per call."""

    def __init__(
        self,
        node_id: str,
        transport: TransportConfig,
        channel_factory: ChannelFactory | None = None,
        counters: LinkCounters | None = None,
    ) -> None:
        """Pushes as `node_id`; channels from `channel_factory` (default: grpc.aio channels
        with the transport's options and credentials); `counters` counts delivered bytes per
        peer."""
        self.node_id = node_id
        self._factory: ChannelFactory = channel_factory or functools.partial(
            grpc_channel, cfg=transport
        )
        self._counters = counters
        self._channels: dict[str, Any] = {}

    async def push(self, member: Replica, message: bytes, deadline: float) -> int:
        """Push one message to `member` before the event loop time `deadline`; the bytes
        delivered. PeerUnavailable if it cannot be reached in time, PeerRefused if it answers
        with an error status."""
        timeout = deadline - asyncio.get_running_loop().time()
        if timeout <= 0:
            raise PeerUnavailable(f"no time left to reach {member.node_id}")
        channel = self._channels.get(member.address)
        if channel is None:
            channel = self._channels[member.address] = self._factory(member.address)
        try:
            await channel.unary_unary(PATH)(
                message, timeout=timeout, metadata=((NODE_ID_KEY, self.node_id),)
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in UNANSWERED:
                raise PeerUnavailable(f"{member.node_id}: {code.name}: {exc.details()}") from None
            raise _REFUSED.get(code, PeerRefused)(
                f"{member.node_id} refused a push: {code.name}: {exc.details()}"
            ) from None
        if self._counters is not None:
            self._counters.add(member.node_id, len(message))
        return len(message)

    async def close(self) -> None:
        """Close the channels opened so far (pushes in flight fail)."""
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
