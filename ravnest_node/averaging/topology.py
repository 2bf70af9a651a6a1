"""Who sends what to whom in an averaging round: pure functions of the group size and rank.

Members are ranked by node id (every member sorts the same list the same way). A small group
exchanges whole deltas all-to-all; a larger one runs a ring all-reduce over n chunks:
reduce-scatter (n - 1 steps: rank r sends the partial sum of chunk (r - s) mod n to rank r + 1,
which adds its own part) leaves rank r with the full sum of chunk (r + 1) mod n; all-gather
(n - 1 more steps: rank r passes chunk (r + 1 - s) mod n on, as it was encoded by its owner)
gives every member every summed chunk. Each member then sends 2 (n - 1) / n of a delta instead of
(n - 1) deltas.
"""

from __future__ import annotations

from enum import StrEnum

from ravnest_node.averaging.config import payload_nbytes
from ravnest_node.compression import Codec

ALL_TO_ALL_MAX = 4
"""Largest group that exchanges whole deltas all-to-all; larger groups use the ring."""


class Topology(StrEnum):
    """How a round moves deltas between the members of a group."""

    ALL_TO_ALL = "all-to-all"
    """Every member sends its whole delta to every other member."""
    RING = "ring"
    """Ring reduce-scatter then all-gather over n chunks of the delta."""


def choose_topology(group_size: int) -> Topology:
    """All-to-all for groups of up to ALL_TO_ALL_MAX members, the ring for larger ones.
    ValueError for a group of fewer than one member."""
    if group_size < 1:
        raise ValueError(f"a replica group has at least one member, not {group_size}")
    return Topology.ALL_TO_ALL if group_size <= ALL_TO_ALL_MAX else Topology.RING


def ring_chunks(numel: int, n: int) -> list[tuple[int, int]]:
    """[start, stop) of each of the n ring chunks of a flat tensor of `numel` elements: as equal
    as possible, the first numel mod n one element longer. ValueError unless 1 <= n <= numel
    (every chunk has at least one element)."""
    if not 1 <= n <= numel:
        raise ValueError(f"cannot cut {numel} elements into {n} non-empty chunks")
    base, extra = divmod(numel, n)
    bounds = []
    start = 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def scatter_chunk(rank: int, step: int, n: int) -> int:
    """The chunk rank `rank` sends (as a partial sum) at reduce-scatter step `step`
    (0 .. n - 2). The successor receives the same chunk at the same step."""
    return (rank - step) % n


def owned_chunk(rank: int, n: int) -> int:
    """The chunk whose full sum rank `rank` holds after the reduce-scatter."""
    return (rank + 1) % n


def gather_chunk(rank: int, step: int, n: int) -> int:
    """The summed chunk rank `rank` passes on at all-gather step `step` (0 .. n - 2): at step 0
    its own, later the one it received at the previous step."""
    return (rank + 1 - step) % n


def round_payload_bytes(codec: Codec, numel: int, group_size: int, rank: int = 0) -> int:
    """Payload bytes that member `rank` sends in one complete round (before lz4, frame headers
    and gRPC framing excluded): (n - 1) whole deltas all-to-all; 2 (n - 1) chunks in a ring."""
    topology = choose_topology(group_size)
    if topology is Topology.ALL_TO_ALL or numel < group_size:
        return (group_size - 1) * payload_nbytes(codec, numel)
    bounds = ring_chunks(numel, group_size)
    steps = range(group_size - 1)
    sent = [scatter_chunk(rank, s, group_size) for s in steps]
    sent += [gather_chunk(rank, s, group_size) for s in steps]
    return sum(payload_nbytes(codec, bounds[c][1] - bounds[c][0]) for c in sent)
