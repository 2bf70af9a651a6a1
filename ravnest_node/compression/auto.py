"""`auto`: which codec a link needs, from its measured bandwidth and the stage's compute time.

A pipeline overlaps transfers with compute, so a link slows training only when moving one
microbatch's tensor takes longer than the stage needs to compute one microbatch. `auto` picks,
per link and role, the most faithful codec whose transfer time fits in a share of that compute
time, and the smallest one when none fits:

    transfer_s(codec) = payload_bytes(codec, tensor) * 8 / bandwidth_bps
    pick the first codec of AUTO_LADDER with transfer_s <= LINK_SHARE * compute_s_per_microbatch

When even the smallest codec does not fit, the link is the pipeline's bottleneck, and `auto` also
packs that codec's payloads with deflate (transport/frames.py): 1.1-1.4x fewer bytes for about
1.5 ms of one core per 74 kB frame, time the link would spend anyway (`link_bound`).

RTT does not count: boundary streams pipeline frames, so latency delays a microbatch but does not
lower the rate. `LINK_SHARE` = 0.5 leaves the other half for what the estimate misses (the
measurement's noise, bubbles, the targets and headers that travel along, the receiver's decode).
Moving to a more faithful codec than the current one needs a further HYSTERESIS margin, so a
link near a threshold does not flap between two codecs.

`auto` is a setting, not a codec: frames always name the codec they were encoded with, so a
receiver decodes whatever the sender picked, and the sender may change its mind between frames.
Everything here is pure: the caller measures (transport/probe.py, the stage's compute time).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ravnest_node.compression.codecs import Role, encoder

AUTO = "auto"
"""The setting that lets each link choose its codec (never a wire codec)."""
AUTO_LADDER: tuple[str, ...] = ("none", "bf16", "int8-block", "int4-block")
"""What `auto` chooses from, most faithful first (32, 16, 8.06 and 4.5 bits per element)."""
LINK_SHARE = 0.5
"""Share of the stage's compute time per microbatch that one tensor's transfer may take."""
HYSTERESIS = 0.2
"""A more faithful codec than the current one must fit in (1 - HYSTERESIS) of the budget."""

Sizes = Sequence[tuple[str, int]]
"""(codec name, payload bytes of one tensor) pairs, most faithful first."""


def payload_sizes(role: Role, shape: Sequence[int], dtype: torch.dtype) -> list[tuple[str, int]]:
    """Payload bytes of a tensor of `shape` and `dtype` under each codec of AUTO_LADDER, in
    ladder order (encodes zeros once per codec: payload sizes do not depend on the values)."""
    zeros = torch.zeros(tuple(shape), dtype=dtype)
    sizes = []
    for name in AUTO_LADDER:
        codec = encoder(name, role)
        _, payload = codec.encode(zeros, codec.new_state())
        sizes.append((name, len(payload)))
    return sizes


def transfer_s(nbytes: int, bandwidth_bps: float) -> float:
    """Seconds to move `nbytes` over a link of `bandwidth_bps` bits per second."""
    return nbytes * 8 / bandwidth_bps


def _fits(nbytes: int, bandwidth_bps: float, compute_s: float, share: float, margin: float) -> bool:
    """Whether `nbytes` moves over `bandwidth_bps` within `share` of `compute_s`, less a
    `margin` (0, or the hysteresis). ValueError for non-positive measurements."""
    if not bandwidth_bps > 0 or not compute_s > 0:
        raise ValueError(f"bandwidth_bps={bandwidth_bps} and compute_s={compute_s} must be > 0")
    return transfer_s(nbytes, bandwidth_bps) <= share * compute_s * (1 - margin)


def choose_codec(
    sizes: Sizes,
    *,
    bandwidth_bps: float,
    compute_s: float,
    current: str | None = None,
    share: float = LINK_SHARE,
    hysteresis: float = HYSTERESIS,
) -> str:
    """The most faithful codec of `sizes` whose transfer fits in `share` of `compute_s` (the
    stage's compute seconds per microbatch) on a link of `bandwidth_bps`; the last (smallest)
    one when none fits. A codec more faithful than `current` must fit with the `hysteresis`
    margin. ValueError for empty sizes or non-positive measurements."""
    if not sizes:
        raise ValueError("choose_codec needs at least one candidate")
    names = [name for name, _ in sizes]
    rank = names.index(current) if current in names else 0  # codecs more faithful than current
    for i, (name, nbytes) in enumerate(sizes):
        if _fits(nbytes, bandwidth_bps, compute_s, share, hysteresis if i < rank else 0.0):
            return name
    return names[-1]


def link_bound(
    nbytes: int,
    *,
    bandwidth_bps: float,
    compute_s: float,
    was: bool = False,
    share: float = LINK_SHARE,
    hysteresis: float = HYSTERESIS,
) -> bool:
    """Whether `nbytes` (a payload of the smallest codec) takes longer on a link of
    `bandwidth_bps` than `share` of `compute_s`: the link, not compute, sets the pace, and
    packing with deflate pays. Once true (`was`), it stays true until the transfer fits with
    the `hysteresis` margin, so a link near the threshold does not flap."""
    return not _fits(nbytes, bandwidth_bps, compute_s, share, hysteresis if was else 0.0)
