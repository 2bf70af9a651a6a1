"""Resuming a boundary stream: what each side has received, and what it must send again.

A boundary stream that breaks (a link down for longer than TCP holds on) is opened again by
the side that opened it, while the plan holds (issue #34, "Home networks flap"). Nothing of
the stage's work is redone and nothing is applied twice: each side keeps the frames it wrote
in a `SentLog` until the peer can no longer need them, the resumed stream's first exchange
says what each side has admitted (`ResumeState`, in call metadata), and each side writes
again, as the same bytes and in their order, exactly the frames the peer lacks, then carries
on with its outbox. Admission is atomic (pipeline/inbox.py: a frame is checked, decoded and
committed with no await between the commit and the bookkeeping), so a frame the broken stream
was delivering is either admitted or not, and the state says which.

Forwards are admitted strictly in seq order, so the downstream stage's state is one number,
the next forward seq it takes. Gradients are admitted for the microbatches the upstream stage
sent forward and has no gradient of yet (`Schedule.awaiting_grad`), so the upstream's state is
that set. A forward leaves the log when its gradient is admitted (the downstream could only
compute that gradient from it); a gradient leaves it once a forward shows the upstream has
applied its step (a forward of step t is computed at version >= t - max_staleness, so every
gradient of an earlier step was admitted), and at most `capacity` gradients are kept.

Written here, not taken from a library: gRPC has no resumable streams, and what a resumed
stream must send again depends on the schedule's admission rules.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from ravnest_node.errors import FrameError

__all__ = ["MAX_STATE_CHARS", "ResumeGap", "ResumeState", "SentLog"]

MAX_STATE_CHARS = 4096
"""Longest resume state a side reads from call metadata."""
MAX_AWAITING = 512
"""Most seqs a gradient receiver's resume state may list (its window is far smaller)."""


class ResumeGap(Exception):
    """The peer needs a frame this side no longer has (or never sent in order): the stream
    cannot resume, and the plan breaks as it would have without resuming."""


@dataclass(frozen=True, slots=True)
class ResumeState:
    """What one side of a boundary stream has admitted.

    `next_forward` (the downstream stage, which receives forwards): every forward below it is
    admitted. `awaiting` (the upstream stage, which receives gradients): the microbatches it
    sent forward whose gradient it has not admitted."""

    next_forward: int | None = None
    awaiting: tuple[int, ...] | None = None

    def encode(self) -> str:
        """The state as call metadata: "f:<seq>" or "g:<seq>,<seq>,..."."""
        if self.next_forward is not None:
            return f"f:{self.next_forward}"
        return "g:" + ",".join(str(s) for s in sorted(self.awaiting or ()))

    @staticmethod
    def decode(text: str) -> ResumeState:
        """Parse `encode`'s text; FrameError for anything else (a peer's metadata)."""
        if len(text) > MAX_STATE_CHARS:
            raise FrameError(f"resume state of {len(text)} characters")
        kind, _, rest = text.partition(":")
        try:
            if kind == "f":
                seq = int(rest)
                if seq < 0:
                    raise ValueError(rest)
                return ResumeState(next_forward=seq)
            if kind == "g":
                seqs = tuple(int(s) for s in rest.split(",")) if rest else ()
                if len(seqs) > MAX_AWAITING or any(s < 0 for s in seqs):
                    raise ValueError(rest[:40])
                if len(set(seqs)) != len(seqs):
                    raise ValueError("repeated seq")
                return ResumeState(awaiting=tuple(sorted(seqs)))
        except ValueError:
            pass
        raise FrameError(f"malformed resume state {text[:60]!r}")


class SentLog:
    """The frames one side of a boundary stream has written (or was writing), by seq, in the
    order they were written, until the peer cannot need them any more."""

    def __init__(self, capacity: int, first_seq: int = 0) -> None:
        """`capacity`: most frames kept; past it the oldest goes (the schedule keeps far fewer
        in flight, see the module's docstring) and a resume that needs it fails. `first_seq`:
        the plan's first microbatch."""
        self.capacity = max(1, capacity)
        self._frames: OrderedDict[int, bytes] = OrderedDict()
        self.newest = first_seq - 1
        """The highest seq recorded (`first_seq` - 1 before the first)."""

    def __len__(self) -> int:
        return len(self._frames)

    def record(self, seq: int, message: bytes) -> None:
        """`message` (the frame of microbatch `seq`) is about to be written."""
        self._frames[seq] = message
        self.newest = max(self.newest, seq)
        while len(self._frames) > self.capacity:
            self._frames.popitem(last=False)

    def ack(self, seq: int) -> None:
        """The peer has admitted `seq`'s frame (or no longer needs it)."""
        self._frames.pop(seq, None)

    def ack_below(self, seq: int) -> None:
        """The peer needs no frame of a seq below `seq`."""
        for s in [s for s in self._frames if s < seq]:
            del self._frames[s]

    def forwards_from(self, next_forward: int) -> list[tuple[int, bytes]]:
        """The forwards a downstream stage that next takes `next_forward` lacks, in order
        (drops those below it: admitted). ResumeGap if one of them is not here, or if the
        peer claims a forward this side never wrote."""
        if next_forward > self.newest + 1:
            raise ResumeGap(f"the peer says it has forwards up to {next_forward - 1}, "
                            f"but only {self.newest + 1} were written")  # fmt: skip
        self.ack_below(next_forward)
        wanted = range(next_forward, self.newest + 1)
        missing = [s for s in wanted if s not in self._frames]
        if missing:
            raise ResumeGap(f"forward {missing[0]} is no longer kept")
        return [(s, self._frames[s]) for s in wanted]

    def gradients_for(self, awaiting: Iterable[int]) -> list[tuple[int, bytes]]:
        """The gradients an upstream stage that awaits `awaiting` lacks and this side has
        written, in order. A seq above `newest` is not computed yet (it will come in the
        outbox); ResumeGap for one this side wrote (gradients go in seq order) and no longer
        has."""
        out = []
        for s in sorted(awaiting):
            if s in self._frames:
                out.append((s, self._frames[s]))
            elif s <= self.newest:
                raise ResumeGap(f"gradient {s} is no longer kept")
        return out
