"""What a member keeps of the deltas other members pushed to it, and which it admits.

Frames are admitted by round: the round in progress and the next one (a faster member may start
it first) are kept; older rounds are dropped without complaint (a late member's delta is of no
use any more); rounds further ahead are refused, so memory stays bounded by two rounds. Every
frame carries one tensor, whose name says which part of the round it is (`part_of`).

`Inboxes` holds them for the averager: the inboxes of the admitted rounds, the round this member
is in, and the condition that wakes a round whenever one of them changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from ravnest_node.errors import FrameError

WHOLE = "delta"
"""Tensor name of a whole delta (all-to-all rounds and the ring's fallback)."""
SCATTER = "scatter"
"""Tensor name prefix of a ring reduce-scatter partial sum: `scatter-<chunk>`."""
GATHER = "gather"
"""Tensor name prefix of a ring all-gather summed chunk: `gather-<chunk>`."""


class Admission(Enum):
    """What to do with a frame of some round."""

    ACCEPT = "accept"
    """Keep it: it belongs to the round in progress or to the next one."""
    DROP = "drop"
    """Ignore it quietly: its round is over."""
    REFUSE = "refuse"
    """Refuse it with a status: its round is further ahead than the next one."""


def admit_round(seq: int, current: int, round_open: bool) -> Admission:
    """Admission of a frame of round `seq` at a member whose latest round is `current`
    (-1 before the first), still in progress if `round_open`."""
    if seq == current + 1 or (seq == current and round_open):
        return Admission.ACCEPT
    if seq <= current:
        return Admission.DROP
    return Admission.REFUSE


def part_name(prefix: str, chunk: int) -> str:
    """Tensor name of ring chunk `chunk` in phase `prefix` (SCATTER or GATHER)."""
    return f"{prefix}-{chunk}"


def part_of(name: str, n: int) -> tuple[str, int]:
    """(WHOLE, -1), (SCATTER, chunk) or (GATHER, chunk) for a received tensor name; FrameError
    for any other name or a chunk outside 0 .. n - 1."""
    if name == WHOLE:
        return WHOLE, -1
    prefix, _, index = name.partition("-")
    if prefix not in (SCATTER, GATHER) or not (index.isascii() and index.isdigit()):
        raise FrameError(f"tensor {name!r:.70} is not part of an averaging round")
    chunk = int(index[:8]) if len(index) <= 8 else n
    if chunk >= n:
        raise FrameError(f"tensor {name!r}: chunk {chunk} of a ring of {n}")
    return prefix, chunk


@dataclass(slots=True)
class RoundInbox:
    """Everything received for one round so far."""

    deltas: dict[str, torch.Tensor] = field(default_factory=dict)
    """Decoded whole deltas, by sender."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Senders whose whole delta was refused on arrival (not finite, undecodable): the reason."""
    partials: dict[int, torch.Tensor] = field(default_factory=dict)
    """Ring reduce-scatter partial sums from the predecessor, by chunk."""
    gathered: dict[int, tuple[bytes, torch.Tensor]] = field(default_factory=dict)
    """Ring all-gather chunks from the predecessor, by chunk: (the message, to pass on as it
    is, and its decoded sum)."""
    elsewhere: set[str] = field(default_factory=set)
    """Senders whose whole delta came from another host than the member's address: a rejection
    of it does not count toward a ban (the sender's id may be claimed by someone else)."""
    ring_fault: str | None = None
    """Why the ring of this round broke, if it did (a part that could not be used, a push that
    failed): the members fall back to exchanging whole deltas."""

    def heard_from(self, member: str) -> bool:
        """Whether `member`'s whole delta arrived (used or refused)."""
        return member in self.deltas or member in self.rejected

    def has(self, part: str, chunk: int, sender: str) -> bool:
        """Whether this part from `sender` arrived already (a second copy is refused)."""
        if part == WHOLE:
            return self.heard_from(sender)
        return chunk in (self.partials if part == SCATTER else self.gathered)

    def ring_broken(self) -> bool:
        """Whether the ring of this round cannot complete: a fault, or a member that sent its
        whole delta (it fell back already)."""
        return self.ring_fault is not None or bool(self.deltas) or bool(self.rejected)


class Inboxes:
    """What this member holds of the rounds it admits (`admit_round`), and the round it is in.
    Used from one event loop."""

    def __init__(self, first_round: int) -> None:
        """Inboxes of a member whose first round is `first_round` (it admits that one first)."""
        self._inboxes: dict[int, RoundInbox] = {}
        self.current = first_round - 1
        """This member's latest round (first_round - 1 before its first)."""
        self.open = False
        """Whether round `current` is in progress."""
        self._changed = asyncio.Condition()

    def admission(self, seq: int) -> Admission:
        """What to do with a frame of round `seq` now."""
        return admit_round(seq, self.current, self.open)

    def get(self, seq: int) -> RoundInbox:
        """The inbox of round `seq` (made empty on first use)."""
        inbox = self._inboxes.get(seq)
        if inbox is None:
            inbox = self._inboxes[seq] = RoundInbox()
        return inbox

    def still_wanted(self, seq: int, part: str, chunk: int, sender: str) -> bool:
        """Whether a part of round `seq` is admitted and has not arrived yet."""
        if self.admission(seq) is not Admission.ACCEPT:
            return False
        return not self.get(seq).has(part, chunk, sender)

    async def record_fault(self, seq: int, part: str, sender: str, reason: str) -> None:
        """Note that `sender`'s part of round `seq` could not be used: a rejected whole delta,
        or the fault that breaks the round's ring."""
        inbox = self.get(seq)
        if part == WHOLE:
            inbox.rejected[sender] = reason
        elif inbox.ring_fault is None:
            inbox.ring_fault = f"{part} part from {sender}: {reason}"
        await self.notify()

    def begin(self, round: int) -> None:
        """Round `round` is in progress from now on (the inboxes of earlier ones go)."""
        self.current, self.open = round, True
        for old in [k for k in self._inboxes if k < round]:
            del self._inboxes[old]

    def end(self, round: int) -> None:
        """Round `round` is over: its inbox goes, later frames of it are dropped."""
        self.open = False
        self._inboxes.pop(round, None)

    async def notify(self) -> None:
        """Wake the rounds waiting in `wait_until` (something they wait for may have changed)."""
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Wait (on the condition, no polling) until `predicate()` or the loop time `deadline`;
        returns `predicate()`."""
        async with self._changed:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._changed.wait_for(predicate)
            except TimeoutError:
                pass
            return predicate()
