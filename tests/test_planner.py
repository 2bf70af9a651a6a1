"""The planner: exact min-max contiguous partition, deterministic ties, clear errors."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ravnest_node.coordination.planning.planner import partition, stage_costs


def brute_force(costs: list[float], num_stages: int) -> tuple[float, list[tuple[int, int]]]:
    """Minimal max stage cost and the lexicographically smallest optimal stops, by enumeration."""
    n = len(costs)
    best: tuple[float, list[tuple[int, int]]] | None = None
    # combinations come in lexicographic order, so the first optimum is the tie-break winner.
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = [0, *cuts, n]
        stages = list(itertools.pairwise(bounds))
        worst = max(stage_costs(costs, stages))
        if best is None or worst < best[0]:
            best = (worst, stages)
    assert best is not None
    return best


def test_one_stage_takes_everything() -> None:
    assert partition([1.0, 2.0, 3.0], 1) == [(0, 3)]


def test_one_block_per_stage() -> None:
    assert partition([5.0, 1.0, 7.0], 3) == [(0, 1), (1, 2), (2, 3)]


def test_balances_equal_costs() -> None:
    assert partition([1.0] * 6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert partition([1.0] * 6, 2) == [(0, 3), (3, 6)]


def test_heavy_block_stands_alone() -> None:
    assert partition([1.0, 1.0, 10.0, 1.0, 1.0], 3) == [(0, 2), (2, 3), (3, 5)]


def test_ties_make_earlier_stages_shorter() -> None:
    # [1] | [1, 1] and [1, 1] | [1] both have max 2; the earlier stop wins.
    assert partition([1.0, 1.0, 1.0], 2) == [(0, 1), (1, 3)]
    # Zero-cost blocks go to the later stage.
    assert partition([0.0, 0.0, 4.0, 0.0], 2) == [(0, 1), (1, 4)]


def test_accepts_ints_and_zero_costs() -> None:
    assert partition([0, 0, 0], 2) == [(0, 1), (1, 3)]
    assert partition([3, 1, 1, 1], 2) == [(0, 1), (1, 4)]


@pytest.mark.parametrize("num_stages", [0, -1, 4])
def test_rejects_impossible_stage_counts(num_stages: int) -> None:
    with pytest.raises(ValueError, match="non-empty stages"):
        partition([1.0, 2.0, 3.0], num_stages)


def test_rejects_empty_costs() -> None:
    with pytest.raises(ValueError, match="between 1 and 0"):
        partition([], 1)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, -math.inf])
def test_rejects_bad_costs(bad: float) -> None:
    with pytest.raises(ValueError, match="block 1 costs"):
        partition([1.0, bad, 1.0], 2)


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(
        st.one_of(
            st.floats(min_value=0.0, max_value=1e6, allow_nan=False),
            st.integers(min_value=0, max_value=5).map(float),  # small ints: many ties
        ),
        min_size=1,
        max_size=9,
    ),
    data=st.data(),
)
def test_matches_brute_force(costs: list[float], data: st.DataObject) -> None:
    num_stages = data.draw(st.integers(min_value=1, max_value=len(costs)), label="num_stages")
    stages = partition(costs, num_stages)

    assert len(stages) == num_stages
    assert stages[0][0] == 0 and stages[-1][1] == len(costs)
    assert all(start < stop for start, stop in stages)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(stages))

    optimum, expected = brute_force(costs, num_stages)
    assert max(stage_costs(costs, stages)) == optimum
    assert stages == expected


def test_is_deterministic() -> None:
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0]
    assert all(partition(costs, 4) == partition(costs, 4) for _ in range(3))
