"""The poisoning guard of an averaging round: which members' deltas enter the mean, how much of
each, and which members are banned for the run. Pure.

Non-finite deltas are refused on arrival (they never get here). Of the rest, when a round has at
least MIN_FOR_MEDIAN deltas (this member's own included), with m the median L2 norm:

- a delta whose norm exceeds `max_norm_ratio` x m is **rejected**: it is far out of line (a
  broken or hostile member), it is left out, and it counts against its sender;
- a delta whose norm exceeds `clip_ratio` x m is **clipped**: scaled down to norm
  `clip_ratio` x m and then averaged (median-based norm clipping).

So each member moves the mean of n deltas by at most `clip_ratio` x m / n, and as the median
is always kept, at least half of the deltas enter the mean. With fewer deltas (two: a member
of a pair, or of a larger group that heard from one other) a median cannot tell which one is
out of line, but a member knows its own delta is honest: another's above `max_norm_ratio` x
the norm of its own is rejected (nothing is clipped). Two honest members within that ratio of
each other accept both, and so agree. Every member applies the same rule
to the same decoded deltas, so members that heard from the same set agree on the result (this
member may clip or reject its own delta too). Clipping bounds how far a member moves the mean,
not where it points: a minority of colluding members with deltas of ordinary size still moves
it by up to their share (docs/averaging.md).

`BanList`: a member whose delta is rejected (refused on arrival or by the norm guard) in
`ban_after` rounds with no good delta between them is banned for the run: its pushes are refused
and rounds stop waiting for it. A rejection counts only if the delta came from the member's own
host (receive.py): a node id is a claim, and a stranger must not get a member banned by
pushing garbage in its name. With a median norm of 0 the guard does not apply.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

MIN_FOR_MEDIAN = 3
"""Fewest deltas for which the median norm says anything about an outlier."""
SCALE_STEPS = 2**24
"""A clipped delta's scale is rounded down to a multiple of 1/SCALE_STEPS, so that members whose
norms differ in the last bits (their sums ran in another order) still scale it alike."""


@dataclass(frozen=True, slots=True)
class Screening:
    """The guard's decision for one round."""

    accepted: tuple[str, ...]
    """Members whose deltas enter the mean (clipped ones included), sorted by id."""
    rejected: tuple[str, ...]
    """Members whose deltas were left out, sorted by id."""
    median_norm: float | None
    """The norm the decision measured against: the median, or this member's own delta's norm
    when there were too few for a median (`by_own`); None when the guard did not apply."""
    scales: Mapping[str, float] = field(default_factory=dict)
    """Clipped members -> the factor (< 1) their delta is scaled by before it is averaged."""
    by_own: bool = False
    """Too few deltas for a median: `median_norm` is this member's own delta's norm."""

    @property
    def clipped(self) -> tuple[str, ...]:
        """Members whose deltas were clipped, sorted by id."""
        return tuple(sorted(self.scales))


def screen_norms(
    norms: Mapping[str, float],
    max_norm_ratio: float,
    clip_ratio: float = math.inf,
    own: str | None = None,
) -> Screening:
    """Split members by the L2 norms of their deltas: a norm that is not finite is rejected;
    with at least MIN_FOR_MEDIAN finite norms, so is a norm above `max_norm_ratio` x median,
    and a norm above `clip_ratio` x median is clipped to it. With fewer, a norm above
    `max_norm_ratio` x that of `own` (this member's, if given) is rejected."""
    finite = {k: v for k, v in norms.items() if math.isfinite(v)}
    rejected = {k for k in norms if k not in finite}
    median: float | None = None
    scales: dict[str, float] = {}
    mine = finite.get(own, 0.0) if own is not None else 0.0
    if len(finite) < MIN_FOR_MEDIAN and mine > 0:
        rejected |= {k for k, v in finite.items() if v > max_norm_ratio * mine}
        accepted = tuple(sorted(k for k in norms if k not in rejected))
        return Screening(accepted, tuple(sorted(rejected)), median_norm=mine, by_own=True)
    if len(finite) >= MIN_FOR_MEDIAN and statistics.median(finite.values()) > 0:
        median = statistics.median(finite.values())
        rejected |= {k for k, v in finite.items() if v > max_norm_ratio * median}
        bound = clip_ratio * median
        scales = {
            k: math.floor(bound / v * SCALE_STEPS) / SCALE_STEPS
            for k, v in finite.items()
            if k not in rejected and v > bound
        }
    accepted = tuple(sorted(k for k in norms if k not in rejected))
    return Screening(
        accepted=accepted, rejected=tuple(sorted(rejected)), median_norm=median, scales=scales
    )


def stable_norm(delta: torch.Tensor) -> float:
    """The L2 norm of `delta`, summed in float64: every member gets the same value to the last
    bits or so, whatever its thread count (squares of float32 values are exact in float64)."""
    return math.sqrt(float(torch.sum(delta.double().square())))


class BanList:
    """Rejected deltas per member, and the members banned for the run (node id -> why). One
    per node, kept across replica groups: a new plan does not wipe a member's record."""

    def __init__(self) -> None:
        self.strikes: Counter[str] = Counter()
        self.banned: dict[str, str] = {}

    def clear(self, member: str) -> None:
        """`member` sent a good delta: its earlier rejections no longer count."""
        self.strikes.pop(member, None)

    def strike(self, member: str, reason: str, ban_after: int) -> bool:
        """Count one rejected delta of `member`; True if that bans it now (`ban_after` rejected
        deltas with no good one between; 0 never bans)."""
        if member in self.banned:
            return False
        self.strikes[member] += 1
        if not ban_after or self.strikes[member] < ban_after:
            return False
        self.banned[member] = f"{self.strikes[member]} rejected deltas, the last: {reason}"
        return True
