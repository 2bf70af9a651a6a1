"""Taking the deltas other members push: who may push, what fits, and where it is kept.

A sender that is not a member of the group (or is banned for the run) is refused with
PERMISSION_DENIED, a frame that does not parse or does not fit (shape, dtype, name, non-finite
values, a ring part from another member than the predecessor) with INVALID_ARGUMENT, a round
further ahead than the next one with OUT_OF_RANGE and a second copy of a part with
ALREADY_EXISTS; frames of finished rounds are dropped quietly (inbox.py). A refused part changes
nothing, except that a whole delta which cannot be used counts as its member's rejected delta of
the round (toward a ban only if it came from the member's host: robust.py).
"""

from __future__ import annotations

import logging

import grpc
import torch

from ravnest_node.averaging.inbox import SCATTER, WHOLE, Admission, part_of
from ravnest_node.averaging.rounds import RoundKit
from ravnest_node.averaging.topology import Topology, owned_chunk
from ravnest_node.errors import FrameError
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.frames import Frame
from ravnest_node.transport.options import same_host

log = logging.getLogger(__name__)


class PushIntake:
    """The receiving side of an averager: checks each push and keeps it in its round's inbox."""

    def __init__(self, kit: RoundKit) -> None:
        """Takes pushes for the averager of `kit` (its group, coder and inboxes)."""
        self._kit = kit

    async def receive(self, request: bytes, sender: str, source: str = "") -> None:
        """Validate, decode and keep one pushed part from the host `source`; Refusal (with the
        status to answer) if it is not wanted (module doc)."""
        self._check_sender(sender)
        try:
            frame, part, chunk = self._check(request, sender)
        except FrameError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"delta refused: {exc}") from None
        inboxes = self._kit.inboxes
        admission = inboxes.admission(frame.seq)
        if admission is Admission.DROP:
            log.debug("dropped %s's %s of finished round %d", sender, part, frame.seq)
            return
        if admission is Admission.REFUSE:
            raise Refusal(
                grpc.StatusCode.OUT_OF_RANGE,
                f"round {frame.seq} is ahead of this member's round {inboxes.current}",
            )
        if inboxes.get(frame.seq).has(part, chunk, sender):
            raise Refusal(
                grpc.StatusCode.ALREADY_EXISTS, f"round {frame.seq}: this part arrived already"
            )
        # Whether this delta came from another host than the member's: then neither its
        # rejection nor its acceptance says anything of the member (node ids are claims).
        foreign = part == WHOLE and not same_host(source, self._kit.group.hosts[sender])
        try:
            value = await self._kit.run(self._kit.coder.decode, frame)
        except FrameError as exc:
            if inboxes.still_wanted(frame.seq, part, chunk, sender):
                if foreign:
                    inboxes.get(frame.seq).elsewhere.add(sender)
                await inboxes.record_fault(frame.seq, part, sender, str(exc))
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"delta refused: {exc}") from None
        # The round may have moved on, or a copy arrived, while this one was decoded.
        if not inboxes.still_wanted(frame.seq, part, chunk, sender):
            return
        self._keep(request, frame.seq, part, chunk, sender, value, foreign)
        await inboxes.notify()

    def _check_sender(self, sender: str) -> None:
        """Refusal (PERMISSION_DENIED) unless `sender` is another member, not banned."""
        group = self._kit.group
        if sender not in group.ids or sender == group.node_id:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {sender!r} is not a member of this replica group",
            )
        if sender in group.bans.banned:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {sender!r} is banned from averaging for this run: "
                f"{group.bans.banned[sender]}",
            )

    def _check(self, request: bytes, sender: str) -> tuple[Frame, str, int]:
        """The parsed frame and which part of a round it is; FrameError if it does not fit."""
        kit, group = self._kit, self._kit.group
        frame = kit.coder.parse(request)
        n = len(group.members)
        part, chunk = part_of(frame.headers[0].name, n)
        length = kit.coder.numel
        if part != WHOLE:
            predecessor = group.predecessor
            if group.topology is not Topology.RING:
                raise FrameError(f"this group of {n} does not run a ring")
            if sender != predecessor:
                raise FrameError(f"ring parts come from {predecessor}, not {sender}")
            if chunk == (group.rank if part == SCATTER else owned_chunk(group.rank, n)):
                raise FrameError(f"{part} chunk {chunk} is never sent to rank {group.rank}")
            start, stop = group.bounds[chunk]
            length = stop - start
        kit.coder.check_length(frame, length)
        return frame, part, chunk

    def _keep(
        self,
        request: bytes,
        seq: int,
        part: str,
        chunk: int,
        sender: str,
        value: torch.Tensor,
        foreign: bool,
    ) -> None:
        """Keep a decoded part in round `seq`'s inbox (a gathered chunk with its message, to
        pass on as it is)."""
        inbox = self._kit.inboxes.get(seq)
        if part == WHOLE:
            inbox.deltas[sender] = value
            if foreign:
                inbox.elsewhere.add(sender)
            else:
                inbox.elsewhere.discard(sender)
        elif part == SCATTER:
            inbox.partials[chunk] = value
        else:
            inbox.gathered[chunk] = (request, value)
