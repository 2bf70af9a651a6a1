"""The poisoning guard of an averaging round: which members' deltas enter the mean. Pure.

Non-finite deltas are refused on arrival (they never get here). Of the rest, when a round has at
least MIN_FOR_MEDIAN deltas (this member's own included), a delta whose L2 norm exceeds
`max_norm_ratio` times the median norm is rejected: one member cannot drag the mean arbitrarily
far, and since the median is kept, at least half of the deltas always enter the mean. Every
member applies the same rule to the same decoded deltas, so members that heard from the same
set agree on the result (this member may reject its own delta too). It is a coarse guard: a
minority of colluding members with moderately large deltas still moves the mean; centred
clipping or a trimmed mean (docs/averaging.md) would bound that further.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

MIN_FOR_MEDIAN = 3
"""Fewest deltas for which the median norm says anything about an outlier."""


@dataclass(frozen=True, slots=True)
class Screening:
    """The guard's decision for one round."""

    accepted: tuple[str, ...]
    """Members whose deltas enter the mean, sorted by id."""
    rejected: tuple[str, ...]
    """Members whose deltas were left out, sorted by id."""
    median_norm: float | None
    """The median norm the decision used (None when the guard did not apply)."""


def screen_norms(norms: Mapping[str, float], max_norm_ratio: float) -> Screening:
    """Split members by the L2 norms of their deltas: a norm that is not finite is rejected;
    with at least MIN_FOR_MEDIAN finite norms, so is a norm above `max_norm_ratio` x median."""
    finite = {k: v for k, v in norms.items() if math.isfinite(v)}
    rejected = {k for k in norms if k not in finite}
    median: float | None = None
    if len(finite) >= MIN_FOR_MEDIAN:
        median = statistics.median(finite.values())
        bound = max_norm_ratio * median
        rejected |= {k for k, v in finite.items() if v > bound}
    accepted = tuple(sorted(k for k in norms if k not in rejected))
    return Screening(accepted=accepted, rejected=tuple(sorted(rejected)), median_norm=median)
