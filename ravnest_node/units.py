"""Numbers for people: link rates as `plan`, `status` and the demo print them."""

from __future__ import annotations

import math

__all__ = ["rate_text"]


def rate_text(bps: float) -> str:
    """A link rate for people: "50 Mbit/s"; "over 1 Tbit/s" for what only a probe that took
    no longer than an empty one reports (two nodes on one machine: nothing to measure)."""
    if math.isinf(bps):
        return "unlimited"
    rounded = float(f"{bps:.4g}")  # 999.96 Mbit/s reads 1 Gbit/s, not 1000 Mbit/s
    if rounded >= 1e12:
        return "over 1 Tbit/s"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if rounded >= scale:
            return f"{rounded / scale:g} {unit}"
    return f"{rounded:g} bit/s"
