"""The averaging exchange: members of a replica group push compressed deltas to each other.

`ReplicaAverager` is this member's side of it, put together from: group.py (who is in the
group, in which order, and whether it runs a ring), deltas.py (deltas as DELTA frames, with the
group's codec), receive.py and inbox.py (the pushes of the others: who may push, what fits,
where it is kept until its round), whole_round.py and ring_round.py (the rounds), and wire.py
(the Push method and the client that pushes).

`ReplicaAverager.average` runs one round: all-to-all for groups of up to 4 members, a ring
all-reduce for larger ones (topology.py). A round waits at most `timeout_s` for the others and
then completes with the members it heard from. A ring that breaks (a push fails, a part does not
arrive within half of `timeout_s`, a member sends its whole delta) falls back, for that round,
to exchanging whole deltas all-to-all in the time left; members then average with those they
heard from, as in a small group. The poisoning guard (robust.py) applies to whole deltas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

import torch

from ravnest_node.averaging.config import AveragingConfig
from ravnest_node.averaging.deltas import DeltaCoder
from ravnest_node.averaging.group import Group, group_members
from ravnest_node.averaging.inbox import Inboxes
from ravnest_node.averaging.receive import PushIntake
from ravnest_node.averaging.ring_round import ring_round
from ravnest_node.averaging.robust import BanList
from ravnest_node.averaging.rounds import RoundKit, RoundResult, RoundRun
from ravnest_node.averaging.topology import Topology
from ravnest_node.averaging.whole_round import whole_round
from ravnest_node.averaging.wire import ChannelFactory, Pusher, Replica, push_handler
from ravnest_node.errors import ConfigError
from ravnest_node.transport import proofs
from ravnest_node.transport.boundary import LinkCounters
from ravnest_node.transport.options import TransportConfig
from ravnest_node.transport.proofs import Caller

__all__ = ["ReplicaAverager", "RoundResult"]

log = logging.getLogger(__name__)


class ReplicaAverager:
    """This member's side of a replica group's averaging: the server handler and the rounds.

    Call `average` from the event loop that serves `handler()`, one round at a time, with
    strictly increasing round numbers; torch work (encoding, decoding, sums) runs in `executor`
    (the loop's default executor when None). `close()` closes the channels it opened."""

    def __init__(
        self,
        *,
        node_id: str,
        members: Sequence[Replica],
        config: AveragingConfig,
        numel: int,
        max_message_bytes: int,
        channel_factory: ChannelFactory | None = None,
        executor: Executor | None = None,
        counters: LinkCounters | None = None,
        first_round: int = 0,
        layout: Sequence[Sequence[int]] | None = None,
        transport: TransportConfig | None = None,
        bans: BanList | None = None,
        fault_push_scale: float = 1.0,
    ) -> None:
        """A member `node_id` of the group `members` (itself included) averaging deltas of
        `numel` elements in messages of at most `max_message_bytes` (use the node's
        TransportConfig.max_message_bytes: its server accepts nothing larger), starting with
        round `first_round` (a member that joins late starts with the group's next round).
        `channel_factory` makes a channel to an address (default: a grpc.aio channel with the
        options and credentials of `transport`, the node's: mutual TLS in a protected swarm);
        `counters` also counts the bytes pushed per peer.
        `layout` (the shapes of the stage's parameters, in the order of the flat delta) is
        needed by the powersgd codec only. `bans` is the node's record of rejected deltas and
        banned members (robust.py), kept across groups (default: this averager's own).
        `fault_push_scale` (test only, != 1): whole deltas are pushed that many times their
        size while this member averages its own as it is (a poisoning member).
        ConfigError for a group without this node, duplicate ids, a delta that cannot fit one
        message, or powersgd without a layout of `numel` elements."""
        ordered = group_members(node_id, members)
        if numel < 1:
            raise ConfigError(f"numel={numel}: a stage averages at least one parameter")
        self.config = config
        self.numel = numel
        coder = DeltaCoder(config.codec, layout, numel, max_message_bytes)
        group = Group.of(
            node_id,
            ordered,
            bans if bans is not None else BanList(),
            numel=numel,
            whole_only=coder.whole_only,
        )
        transport = dataclasses.replace(
            transport or TransportConfig(), max_message_bytes=max_message_bytes
        )
        self._pusher = Pusher(node_id, transport, channel_factory, counters)
        self._kit = RoundKit(
            config=config,
            group=group,
            coder=coder,
            inboxes=Inboxes(first_round),
            pusher=self._pusher,
            executor=executor,
            fault_push_scale=fault_push_scale,
        )
        self._intake = PushIntake(self._kit)

    @property
    def node_id(self) -> str:
        """This member's node id."""
        return self._kit.group.node_id

    @property
    def members(self) -> tuple[Replica, ...]:
        """Every member of the group, this one included, sorted by node id."""
        return self._kit.group.members

    @property
    def rank(self) -> int:
        """This member's index in `members`."""
        return self._kit.group.rank

    @property
    def topology(self) -> Topology:
        """How the group's rounds move deltas."""
        return self._kit.group.topology

    @property
    def bans(self) -> BanList:
        """The record of rejected deltas and banned members this averager keeps."""
        return self._kit.group.bans

    @property
    def banned(self) -> tuple[str, ...]:
        """Members of this group banned for the run, sorted."""
        return self._kit.group.banned

    # ---- the server side ----

    def handler(self, caller: Caller = proofs.caller) -> Any:
        """The gRPC generic handler of the Push method, to add to a grpc.aio server (a node
        whose server starts before it knows its group registers an AveragingService instead
        and attaches this averager to it); `caller`: push_handler's."""
        return push_handler(lambda: self, caller)

    async def receive(self, request: bytes, sender: str, source: str = "") -> None:
        """Validate, decode and keep one pushed part from the host `source`; Refusal (with the
        status to answer) if it is not wanted. A refused part changes nothing, except that a
        whole delta which cannot be used counts as that member's rejected delta of the round
        (toward a ban only if it came from the member's host)."""
        await self._intake.receive(request, sender, source)

    # ---- the rounds ----

    async def average(self, round: int, delta: torch.Tensor, *, step: int = 0) -> RoundResult:
        """Average this member's `delta` (P elements) with the group's for round `round`.

        Waits at most about `timeout_s` (plus the torch work) and always completes: members not
        heard from by then are `missing`, and with nobody else the mean is this member's own
        delta as decoded. `step` (the optimizer step) travels as the frames' version. Raises
        RuntimeError if a round is already running, ValueError for a round number not above the
        last one, a delta of the wrong size, or a delta that is not finite (our own fault)."""
        inboxes = self._kit.inboxes
        if inboxes.open:
            raise RuntimeError("an averaging round is already running")
        if round <= inboxes.current:
            raise ValueError(
                f"round {round}: rounds must increase (the last was {inboxes.current})"
            )
        if delta.numel() != self.numel or step < 0:
            raise ValueError(f"delta of {delta.numel()} elements at step {step}: need {self.numel}")
        flat = delta.detach().to(device="cpu", dtype=torch.float32).reshape(-1)
        started = asyncio.get_running_loop().time()
        run = RoundRun(round, step, flat, started, started + self.config.timeout_s)
        inboxes.begin(round)
        try:
            if self.topology is Topology.RING and not self.banned:  # a ring needs everyone
                result = await ring_round(self._kit, run)
            else:
                result = await whole_round(self._kit, run)
        finally:
            inboxes.end(round)
        log.info(
            "round %d (%s%s): %d of %d members averaged, %d bytes sent, %.3f s",
            round,
            result.topology,
            ", fell back" if result.fell_back else "",
            len(result.participants),
            len(self.members),
            result.bytes_sent,
            result.wait_s,
        )
        return result

    async def close(self) -> None:
        """Close the channels this averager opened (pushes in flight fail)."""
        await self._pusher.close()
