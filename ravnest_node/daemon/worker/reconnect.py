"""What a worker does after a network fault, decided without sockets: wait for the
coordinator's next plan, rejoin as a new member, or try the coordinator again after a backoff.

A network fault never ends a node's daemon (issue #34, "Home networks flap"): a link that
drops for seconds costs seconds, a longer outage costs a restore, never the run. Only a plan
this node cannot follow (its configuration, data, or a bug of its own) stays fatal.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

__all__ = ["AfterBreak", "Backoff", "after_break", "counted_out"]

# The coordinator's answer to a report of a plan it ended (planbook.end_at / reporting):
# "plan epoch N ended at step X". The node's stage is not in the run any more.
_ENDED_PLAN = "ended at step"


class AfterBreak(enum.Enum):
    """What a worker whose plan broke on a peer fault does next."""

    STOP = "stop"
    """The node stops: the break ends its run quietly."""
    WAIT = "wait"
    """Wait for a newer started plan, however long: heartbeats go on, offers stay held."""
    FOLLOW = "follow"
    """A newer plan has started: take it (a stage in it, or wait for a later one)."""
    REJOIN = "rejoin"
    """The coordinator counted this node out: join again as a new member would (its measured
    capabilities, fresh checkpoint offers), then follow the plans from there."""
    RESTART = "restart"
    """No plan came within the patience: nobody was counted lost (a stream reset by the
    network while every member still answers heartbeats), so nobody will plan without the
    break. Join again as a restarted node does: the coordinator counts this node's stage
    lost and restores or re-plans the run, and this node is a newcomer from then on."""


def counted_out(error: BaseException | str) -> bool:
    """`error` (a refused report, or its message) says the coordinator ended the plan this
    node trained in: it counts this node's stage out of the run."""
    return _ENDED_PLAN in str(error)


def after_break(
    *,
    stopping: bool,
    broken_epoch: int,
    started_epoch: int,
    out: bool,
    rejoined: bool,
    waited_s: float = 0.0,
    patience_s: float = float("inf"),
) -> AfterBreak:
    """What to do after plan `broken_epoch` broke: `started_epoch` is the newest started plan
    this node knows (0: none), `out` whether the coordinator counted this node out (see
    `counted_out`), `rejoined` whether it has joined again since, `waited_s` how long it has
    waited for a newer plan. Never gives up: a node waits for the coordinator as long as it
    runs; past `patience_s` with no newer plan it joins again as a restarted node (once)."""
    if stopping:
        return AfterBreak.STOP
    if out and not rejoined:
        return AfterBreak.REJOIN
    if started_epoch > broken_epoch:
        return AfterBreak.FOLLOW
    if waited_s >= patience_s and not rejoined:
        return AfterBreak.RESTART
    return AfterBreak.WAIT


@dataclass
class Backoff:
    """Delays between tries of a call that fails on the network: `base_s` doubling up to
    `cap_s`, each with equal jitter (half the delay fixed, half uniform) so that nodes cut off
    together do not come back in step. `reset` after a success."""

    base_s: float = 1.0
    cap_s: float = 15.0
    rng: random.Random = field(default_factory=random.Random)
    _tries: int = 0

    def next_s(self) -> float:
        """The delay before the next try, in [d/2, d] for d = min(cap_s, base_s * 2**tries)."""
        delay = min(self.cap_s, self.base_s * 2.0 ** min(self._tries, 32))
        self._tries += 1
        return delay / 2 + self.rng.uniform(0, delay / 2)

    def reset(self) -> None:
        self._tries = 0
