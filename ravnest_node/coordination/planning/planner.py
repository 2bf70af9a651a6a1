"""Cutting a model's blocks into pipeline stages: pure functions, no I/O.

A pipeline runs at the pace of its slowest stage, so the blocks are split into contiguous stages
that minimise the largest stage cost (the min-max linear partition problem), solved exactly by
dynamic programming.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["partition", "stage_costs"]


def partition(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Split blocks ``0..len(costs)-1`` into `num_stages` contiguous stages of minimal max cost.

    Returns the stages as ``[start, stop)`` ranges, in order, each non-empty, covering every block.
    The cost of a stage is the sum of its blocks' costs; the result minimises the largest stage
    cost exactly.

    Ties: among all partitions with the minimal largest cost, the one whose list of ``stop``
    indices is lexicographically smallest is returned, i.e. each stage in turn, first to last, is
    as short as possible. Earlier stages thus get the lighter share of any slack, which suits
    a 1F1B pipeline, where earlier stages hold more activations in flight.

    Raises `ValueError` if `num_stages` is not in ``1..len(costs)`` or a cost is negative, NaN or
    infinite. Runs in O(n^2 * num_stages) time for n blocks.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot split {n} blocks into {num_stages} non-empty stages; "
            f"num_stages must be between 1 and {n}"
        )
    for i, cost in enumerate(costs):
        if not math.isfinite(cost) or cost < 0:
            raise ValueError(f"block costs must be finite and non-negative; block {i} costs {cost}")

    # span[i][j]: cost of blocks [i, j). fsum, so the same span always sums to the same float.
    span = [[0.0] * (n + 1) for _ in range(n + 1)]
    for i in range(n):
        for j in range(i + 1, n + 1):
            span[i][j] = math.fsum(costs[i:j])

    # best[s][i]: minimal largest stage cost when blocks [i, n) form s stages (inf: impossible).
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    best[0][n] = 0.0
    for s in range(1, num_stages + 1):
        # s stages need at least s blocks: i <= n - s.
        for i in range(n - s + 1):
            best[s][i] = min(
                max(span[i][stop], best[s - 1][stop]) for stop in range(i + 1, n - s + 2)
            )

    # Walk forward taking the shortest stage that still allows the optimum. The comparison is
    # exact: `optimum` is itself one of the max(...) values computed from the same floats.
    optimum = best[num_stages][0]
    stages: list[tuple[int, int]] = []
    start = 0
    for remaining in range(num_stages, 0, -1):
        stop = next(
            stop
            for stop in range(start + 1, n - remaining + 2)
            if max(span[start][stop], best[remaining - 1][stop]) <= optimum
        )
        stages.append((start, stop))
        start = stop
    return stages


def stage_costs(costs: Sequence[float], stages: Sequence[tuple[int, int]]) -> list[float]:
    """The cost of each stage ``[start, stop)``: the sum of its blocks' costs."""
    return [math.fsum(costs[start:stop]) for start, stop in stages]
