"""A worker's link measurements, by link probes (transport/probe.py).

When a node joins, it measures its link to the coordinator (`coordinator`) and to the members
that joined before it (`peers`), for the planner: each pair of members is so measured once, by
the later to join. Before a stage sends its first frame, the links it sends on with an `auto`
codec are measured under the plan's epoch (`codecs`): the codec then fits the link. A peer takes
probes from one node at a time, under any epoch, so a measurement refused as busy waits its
turn, and ends by passing the turn on (`end_measurement`); a node measures its own links one
after another, and under a plan takes no probes while it measures (`ProbeTurns.claim`).
Probes that shared a link would each read a part of it: on the bench's home link (50 Mbit/s
a host) the middle node's two links read 11.7 and 13.3 Mbit/s when all four were measured at
once; and an end node that measured the middle node while the middle node measured its other
link read 4.3 of the internet link's 10 Mbit/s and 31.2 of home's 50 (its acknowledgements
queued behind the middle node's probe bytes on the middle node's uplink). Every measurement
is best effort: a link that cannot be measured is logged and left out (the planner goes by
uplinks; an `auto` codec keeps the smallest).
"""

from __future__ import annotations

import asyncio
import logging
import random

from ravnest_node.compression.auto import LINK_SHARE
from ravnest_node.errors import ConfigError, PeerError
from ravnest_node.pipeline.codec_choice import CodecChoice
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import MAX_PEER_LINKS
from ravnest_node.state import valid_node_id
from ravnest_node.transport.boundary import LinkCounters
from ravnest_node.transport.options import (
    TransportConfig,
    is_loopback,
    open_channel,
    split_host_port,
)
from ravnest_node.transport.probe import (
    LinkEstimate,
    ProbeBusy,
    ProbePlan,
    ProbeTurns,
    end_measurement,
    measure_link,
    probe_sender,
)

__all__ = ["CodecLink", "LinkMeter"]

log = logging.getLogger(__name__)

# A measurement refused as busy (another node measures the peer) is tried again after a pause
# of this many seconds (a random one in the range), for up to MEASURE_TURN_WAIT_S. Under a
# plan the stages wait for their measurements, and the turn passes on as soon as the other
# node's measurement ends: shorter pauses.
MEASURE_RETRY_S = (0.2, 1.0)
PLAN_MEASURE_RETRY_S = (0.05, 0.25)
MEASURE_TURN_WAIT_S = 30.0

CodecLink = tuple[pb.StageAssignment | None, CodecChoice, float]
"""A link a stage sends on: (the neighbour, None if it is not to be probed, the codec choice
for it, the link's pace in bps)."""


class LinkMeter:
    """Measures this node's (`node_id`) links, its probe bytes counted in `counters`."""

    def __init__(self, *, node_id: str, transport: TransportConfig, counters: LinkCounters) -> None:
        self.node_id = node_id
        self.counters = counters
        self._transport = transport

    async def probe(
        self, address: str, peer: str, *, epoch: int, pace_bps: float = 0.0, pull: bool = False
    ) -> LinkEstimate:
        """Measure the link to the node at `address` with link probes under `epoch` (its
        bytes counted for `peer`), from this node, or with `pull` to it; PeerUnavailable /
        PeerRefused if it cannot. The measurement ends by passing the peer's turn on (best
        effort: a peer that missed it lets the next prober in after its hold)."""
        timeout_s = self._transport.connect_timeout_s
        async with open_channel(address, self._transport) as channel:
            send = probe_sender(
                channel,
                peer=peer,
                node_id=self.node_id,
                epoch=epoch,
                counters=self.counters,
                timeout_s=timeout_s,
                pace_bps=pace_bps,
                pull=pull,
            )
            plan = ProbePlan.within(self._transport.max_message_bytes, differential=epoch != 0)
            estimate = await measure_link(send, plan)
            try:
                await end_measurement(channel, peer=peer, node_id=self.node_id, epoch=epoch,
                                      timeout_s=timeout_s)  # fmt: skip
            except PeerError as exc:
                log.debug("%s", exc)
            return estimate

    async def _in_turn(
        self,
        address: str,
        peer: str,
        *,
        pull: bool,
        epoch: int = 0,
        pace_bps: float = 0.0,
        own: ProbeTurns | None = None,
    ) -> LinkEstimate:
        """`probe`, tried again after a short random pause while the peer is busy being
        measured by another node, for up to MEASURE_TURN_WAIT_S. With `own` (this node's turns
        for probes it takes), the measurement holds this node's turn too (`ProbeTurns.claim`):
        it waits while a neighbour measures this node, and a neighbour that comes meanwhile
        waits for it; the turn is given up during each pause, so two nodes that want to
        measure each other cannot hold each other up."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MEASURE_TURN_WAIT_S
        pause_s = PLAN_MEASURE_RETRY_S if epoch else MEASURE_RETRY_S
        while True:
            if own is None or own.claim(self.node_id):
                try:
                    return await self.probe(
                        address, peer, epoch=epoch, pace_bps=pace_bps, pull=pull
                    )
                except ProbeBusy:
                    if loop.time() >= deadline:
                        raise
                finally:
                    if own is not None:
                        own.release(self.node_id)
            elif loop.time() >= deadline:
                raise ProbeBusy(f"this node was measured by others for {MEASURE_TURN_WAIT_S} s")
            await asyncio.sleep(random.uniform(*pause_s))  # a back-off, not a wait

    async def coordinator(self, coordinator: str, *, address: str) -> LinkEstimate | None:
        """This node's (at `address`) link to the coordinator at `coordinator`, for the
        planner (Capabilities.uplink_bps): link probes under epoch 0, in turn with the other
        nodes measuring it. None for the coordinator's own node, a coordinator on loopback
        (the same machine), or one that does not take probes (the planner then assumes a fast
        link)."""
        if coordinator == address or is_loopback(coordinator):
            return None  # its own node, or the same machine: memory, not a network
        try:
            link = await self._in_turn(coordinator, coordinator, pull=False)
        except PeerError as exc:
            log.info("the link to the coordinator is not measured: %s", exc)
            return None
        log.info("link to the coordinator: %.1f Mbit/s, round trip %.1f ms",
                 link.bandwidth_bps / 1e6, link.rtt_s * 1e3)  # fmt: skip
        return link

    async def peers(
        self,
        view: pb.SwarmView,
        *,
        address: str,
        relay_node_id: str,
        coordinator: str,
        coordinator_link: LinkEstimate | None,
    ) -> list[pb.PeerLink]:
        """This node's (at `address`, reached through `relay_node_id` if any) links to the
        members of `view` that joined before it, on other hosts (at most MAX_PEER_LINKS, one
        after another so that they do not share the link): each pushed then pulled (the
        coordinator's own node: pulled only, its push is `coordinator_link`). A member that
        cannot be probed is left out."""
        ids = [m.node_id for m in view.members]
        if self.node_id not in ids:
            return []
        host = split_host_port(address)[0]
        links: list[pb.PeerLink] = []
        for m in view.members[: ids.index(self.node_id)]:
            if len(links) >= MAX_PEER_LINKS:
                break
            try:
                if m.left or m.lease_expired or not valid_node_id(m.node_id):
                    continue
                if not (relay_node_id or m.relay_node_id) and (
                    split_host_port(m.address)[0] == host
                ):
                    continue  # one machine: memory, not a network
                if m.relay_node_id and not relay_node_id:
                    continue  # only through its relay, but their stream would go straight
                to = coordinator_link if m.address == coordinator else None
                link = await self._peer(m, to)
            except (PeerError, ConfigError) as exc:
                log.info("link to %s not measured: %s", m.node_id[:64], exc)
                continue
            links.append(link)
        return links

    async def _peer(self, member: pb.SwarmMember, to: LinkEstimate | None) -> pb.PeerLink:
        """The link to `member`: pushed (unless `to` is that already), then pulled."""
        if to is None:
            to = await self._in_turn(member.address, member.node_id, pull=False)
        back = await self._in_turn(member.address, member.node_id, pull=True)
        link = pb.PeerLink(
            node_id=member.node_id,
            to_bps=to.bandwidth_bps,
            from_bps=back.bandwidth_bps,
            rtt_s=min(to.rtt_s, back.rtt_s),
        )
        log.info("link to %s: %.1f Mbit/s there, %.1f back, round trip %.1f ms", member.node_id,
                 link.to_bps / 1e6, link.from_bps / 1e6, link.rtt_s * 1e3)  # fmt: skip
        return link

    async def codecs(
        self, epoch: int, links: list[CodecLink], own: ProbeTurns | None = None
    ) -> None:
        """Give every link this stage sends on its part of LINK_SHARE (they leave from this
        node's one uplink: a middle stage's two take half each), then probe each link with a
        neighbour to probe and an `auto` codec choice, one after another, each in turn with the
        peer's other probers and (`own`: the turns of the probes this node takes under
        `epoch`) with the neighbours that measure this node, under plan `epoch`, and give the
        choice the measured bandwidth. A link that cannot be measured is logged and keeps the
        codec it starts with (the most compact its peer decodes)."""
        for _, choice, _ in links:
            choice.share = LINK_SHARE / len(links)
        for peer, choice, pace_bps in links:
            if peer is not None and choice.auto:
                await self._codec(epoch, peer, choice, pace_bps, own)

    async def _codec(
        self,
        epoch: int,
        peer: pb.StageAssignment,
        choice: CodecChoice,
        pace_bps: float,
        own: ProbeTurns | None,
    ) -> None:
        try:
            estimate = await self._in_turn(peer.address, peer.node_id, pull=False, epoch=epoch,
                                           pace_bps=pace_bps, own=own)  # fmt: skip
        except PeerError as exc:
            log.warning("%s: cannot measure the link (%s); using %s", choice.what, exc,
                        choice.name)  # fmt: skip
            return
        choice.bandwidth_bps = estimate.bandwidth_bps  # (what the peer decodes: `meet`)
        log.info(
            "%s: link to %s measured at %.1f Mbit/s, RTT %.2f ms (%d probe bytes)",
            choice.what,
            peer.node_id,
            estimate.bandwidth_bps / 1e6,
            estimate.rtt_s * 1e3,
            estimate.probe_bytes,
        )
