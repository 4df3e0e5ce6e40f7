"""Fast-tier coverage of a parameter grid by pairs (the full grid stays in the slow tier).

A lossless check over ``rule x cache x temperature`` (and the like) grows as a product. The fast tier keeps a
covering set in which every pair of values of two parameters occurs together at least once (the classic pairwise
criterion: most interaction bugs need two factors); the other combinations are marked ``slow``, so CI still runs
the whole grid. The covering set is chosen greedily and deterministically (the same on every machine).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import pytest

__all__ = ["pairwise_params"]


def _pairs(case: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The pairs of (axis, value index) a case covers, and its single values (one axis: every value is a case)."""
    singles = {(i, case[i]) for i in range(len(case))}
    return singles | {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(case)), 2)}


def pairwise_params(*axes: Sequence[Any]) -> list[Any]:
    """Every combination of ``axes`` as a ``pytest.param``: a pairwise-covering subset unmarked (fast tier), the
    rest marked ``slow``. Use with ``@pytest.mark.parametrize(("a", "b", "c"), pairwise_params(A, B, C))``.
    Values need not be hashable (the cover is chosen over their indices)."""
    grid = list(itertools.product(*(range(len(axis)) for axis in axes)))
    uncovered = set().union(*(_pairs(c) for c in grid))
    fast: set[tuple[int, ...]] = set()
    while uncovered:  # each pass covers at least one pair: at most len(uncovered) passes
        best = max(grid, key=lambda c: (len(_pairs(c) & uncovered), -grid.index(c)))
        fast.add(best)
        uncovered -= _pairs(best)
    params = []
    for c in grid:
        values = [axis[i] for axis, i in zip(axes, c)]
        params.append(pytest.param(*values) if c in fast else pytest.param(*values, marks=pytest.mark.slow))
    return params
