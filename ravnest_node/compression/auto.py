"""`auto`: which codec a link needs, from its measured bandwidth and the stage's compute time.

A pipeline overlaps transfers with compute, so a link slows training only when moving one
microbatch's tensor takes longer than the stage needs to compute one microbatch. `auto` picks,
per link and role, the most faithful codec whose cost fits in a share of that compute time, and
the cheapest one when none fits:

    cost(codec) = payload_bytes(codec, tensor) * 8 / bandwidth_bps + coding_s(codec)
    pick the first codec of the ladder with cost <= LINK_SHARE * compute_s_per_microbatch,
    else the codec of least cost

The ladder is AUTO_LADDER (sizes known from the shape: `payload_sizes`). Towards a peer that
decodes klt, klt joins it after the ladder (compression/auto.py, COMPACT; its size depends on
the values: `compact_estimate`, from the frames it made on this link or a prior), activations
first at klt's finer step (transform.py KLT_ACTIVATION_FINE), then at its default step, then
(both roles) at a coarser step (KLT_ACTIVATION_COARSE, KLT_GRADIENT_COARSE: a fifth to a
quarter fewer bytes, about int4-block's error) that only the rule's "least cost" reaches, where
nothing else fits (`ranked`): klt errs less than int4-block in a third of its bytes, but under
the pipeline's staleness its error costs more loss, so it is taken where int4-block does not
fit. `coding_s` is what encoding and the peer's decoding cost per frame (the caller measures
its own encode time; the peer's decode is taken as equal): coding time counts against the
compute budget the way link time does, so a compact codec whose coder is slow on this machine
loses to one that is larger but cheap.

When the chosen codec is int4-block and even it does not fit, the link is the pipeline's
bottleneck, and `auto` also packs its payloads with deflate (transport/frames.py): 1.1-1.4x
fewer bytes for about 1.5 ms of one core per 74 kB frame, time the link would spend anyway
(`link_bound`).

RTT does not count: boundary streams pipeline frames, so latency delays a microbatch but does not
lower the rate. `LINK_SHARE` = 0.5 leaves the other half for what the estimate misses (the
measurement's noise, bubbles, the targets and headers that travel along). Moving to a more
faithful codec than the current one needs a further HYSTERESIS margin, and so does moving
between two codecs when none fits, so a link near a threshold does not flap between two codecs.

`auto` is a setting, not a codec: frames always name the codec they were encoded with, so a
receiver decodes whatever the sender picked, and the sender may change its mind between frames.
Everything here is pure: the caller measures (transport/probe.py, the stage's compute time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import prod

import torch

from ravnest_node.compression.codecs import COARSE_LABEL, FINE_LABEL, Role, encoder

AUTO = "auto"
"""The setting that lets each link choose its codec (never a wire codec)."""
AUTO_LADDER: tuple[str, ...] = ("none", "bf16", "int8-block", "int4-block")
"""What `auto` chooses from, most faithful first (32, 16, 8.06 and 4.5 bits per element)."""
DEFLATES = AUTO_LADDER[-1]
"""The ladder's smallest codec (int4-block): the one whose payloads deflate packs on a
bottleneck link."""
COMPACT = "klt"
"""The most compact codec, after the ladder, towards a peer that decodes it."""
FINE = COMPACT + FINE_LABEL
"""klt activations at the finer step, as `ranked` and `choose_codec` name that candidate."""
COARSE = COMPACT + COARSE_LABEL
"""klt at the coarser step (compression/transform.py KLT_ACTIVATION_COARSE,
KLT_GRADIENT_COARSE), as `ranked` and `choose_codec` name that candidate."""
COMPACT_PRIOR_BITS: dict[str, float] = {"activation": 2.0, "gradient": 3.0}
"""Bits per element klt is assumed to take before a frame of it was measured on the link: above
what it took on bench-small's boundaries (1.1-1.5 for activations, 1.8-2.2 for gradients,
docs/benchmarks.md), so that a prior never sells it short of what it does."""
COMPACT_PRIOR_CODING_S_PER_ELEMENT = 2e-8
"""Seconds of encoding (and as many of the peer's decoding) per element klt is assumed to take
before a frame of it was measured: about what bench-small's microbatch takes on one core."""
LINK_SHARE = 0.5
"""Share of the stage's compute time per microbatch that one tensor's transfer may take."""
HYSTERESIS = 0.2
"""A more faithful codec than the current one must fit in (1 - HYSTERESIS) of the budget."""
FINE_GROWTH = 1.35
"""klt activation frames at the fine step over those at the default step: 1.30 measured on the
internet link (14.2 against 10.9 KB a sample, docs/benchmarks.md), rounded up."""

COARSE_SHRINK: dict[str, float] = {"activation": 0.76, "gradient": 0.81}
"""klt frames at the coarse step over those at the default step: on bench-small's four boundary
streams of a 60-step run (docs/compression.md), 0.75-0.76 for activations (0.7 against 0.5 of
the row's rms) and 0.78-0.81 for gradients (0.5 against 0.35 of the tensor's rms), the larger
taken."""

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


def compact_estimate(
    role: Role, shape: Sequence[int], measured_bytes: float | None = None
) -> tuple[str, int]:
    """(COMPACT, payload bytes) for a tensor of `shape`: `measured_bytes` (what its frames took
    on this link) when known, else COMPACT_PRIOR_BITS of its elements."""
    if measured_bytes is not None:
        return COMPACT, round(measured_bytes)
    return COMPACT, round(prod(shape) * COMPACT_PRIOR_BITS[role] / 8)


def transfer_s(nbytes: int, bandwidth_bps: float) -> float:
    """Seconds to move `nbytes` over a link of `bandwidth_bps` bits per second."""
    return nbytes * 8 / bandwidth_bps


def _fits(nbytes: int, bandwidth_bps: float, compute_s: float, share: float, margin: float) -> bool:
    """Whether `nbytes` moves over `bandwidth_bps` within `share` of `compute_s`, less a
    `margin` (0, or the hysteresis). ValueError for non-positive measurements."""
    _fits_s(0.0, bandwidth_bps, compute_s, share, margin)  # ValueError before a division by 0
    return _fits_s(transfer_s(nbytes, bandwidth_bps), bandwidth_bps, compute_s, share, margin)


def _fits_s(
    cost_s: float, bandwidth_bps: float, compute_s: float, share: float, margin: float
) -> bool:
    """Whether `cost_s` lies within `share` of `compute_s`, less a `margin`. ValueError for
    non-positive measurements."""
    if not bandwidth_bps > 0 or not compute_s > 0:
        raise ValueError(f"bandwidth_bps={bandwidth_bps} and compute_s={compute_s} must be > 0")
    return cost_s <= share * compute_s * (1 - margin)


def choose_codec(
    sizes: Sizes,
    *,
    bandwidth_bps: float,
    compute_s: float,
    current: str | None = None,
    share: float = LINK_SHARE,
    hysteresis: float = HYSTERESIS,
    coding_s: Mapping[str, float] | None = None,
) -> str:
    """The most faithful codec of `sizes` whose cost (transfer on a link of `bandwidth_bps`
    plus `coding_s`, the seconds its encoding and decoding take per frame, 0 where not given)
    fits in `share` of `compute_s` (the stage's compute seconds per microbatch); the cheapest
    one when none fits. A codec more faithful than `current` must fit with the `hysteresis`
    margin; when none fits, another codec than `current` must cost `hysteresis` less.
    ValueError for empty sizes or non-positive measurements."""
    if not sizes:
        raise ValueError("choose_codec needs at least one candidate")
    _fits_s(0.0, bandwidth_bps, compute_s, share, 0.0)  # ValueError for nonsense measurements
    coding = coding_s or {}
    names = [name for name, _ in sizes]
    rank = names.index(current) if current in names else 0  # codecs more faithful than current
    costs = {
        name: transfer_s(nbytes, bandwidth_bps) + coding.get(name, 0.0) for name, nbytes in sizes
    }
    for i, (name, _) in enumerate(sizes):
        if _fits_s(costs[name], bandwidth_bps, compute_s, share, hysteresis if i < rank else 0.0):
            return name
    cheapest = min(names, key=lambda name: (costs[name], -names.index(name)))
    if current in costs and costs[cheapest] > (1 - hysteresis) * costs[current]:
        return current
    return cheapest


def ranked(role: Role, ladder: Sizes, klt_bytes: int) -> list[tuple[str, int]]:
    """The candidates towards a peer that decodes klt, most faithful first: the `ladder`'s
    (payload_sizes), then klt at its finer step (activations: FINE_GROWTH times `klt_bytes`,
    klt's frames at its default step), then klt, then klt at its coarser step (COARSE_SHRINK
    times `klt_bytes`). So klt is taken only where int4-block does not fit the link, and its
    coarser step only where nothing fits (`choose_codec` takes the cheapest then): where the
    link sets the pipeline's pace, a fifth to a quarter fewer bytes is as much time, at about
    int4-block's error (klt's gradients at the coarse step err 0.160 against int4-block's
    0.151, activations 0.136-0.156 against 0.099-0.104).

    By relative error alone klt would come before int4-block: on bench-small's boundaries
    (docs/bench/codec_error.py, 60 steps, frames 9-240) int4-block errs 0.099-0.104 on
    activations and 0.149-0.151 on gradients (stochastic), klt at its finer step 0.085-0.092
    and klt's gradients 0.106-0.124. Ranked so, klt's error cost more held-out loss under the
    pipeline's staleness than int4-block's: six interleaved pairs of home runs (50 Mbit/s,
    where both fit on the middle stage's links) gave +1.90% mean (+1.00% to +2.69%) with klt
    first against +1.23% (+1.01% to +1.76%) with int4-block first, and 0.936 against 0.947
    of compute-bound (docs/benchmarks.md, "a node takes no probes while it measures")."""
    coarse = (COARSE, round(COARSE_SHRINK[role] * klt_bytes))
    if role == "activation":
        return [*ladder, (FINE, round(FINE_GROWTH * klt_bytes)), (COMPACT, klt_bytes), coarse]
    return [*ladder, (COMPACT, klt_bytes), coarse]


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
