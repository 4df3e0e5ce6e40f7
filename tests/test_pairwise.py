"""The fast tier's pairwise cover (tests/pairwise.py): every pair of values of two axes is in an unmarked case, the
marked rest completes the grid, and the cover is the same on every call."""

from __future__ import annotations

import itertools

from pairwise import pairwise_params


def _split(params: list) -> tuple[list[tuple], list[tuple]]:
    fast = [tuple(p.values) for p in params if not p.marks]
    slow = [tuple(p.values) for p in params if p.marks and p.marks[0].name == "slow"]
    return fast, slow


def test_every_pair_is_in_the_fast_tier_and_the_grid_is_whole() -> None:
    axes = (["llada", "llada_moe"], ["static", "threshold"], ["none", "prefix", "dual"], [0.0, 1.0])
    fast, slow = _split(pairwise_params(*axes))
    assert sorted(fast + slow, key=repr) == sorted(itertools.product(*axes), key=repr)
    assert len(fast) < len(fast) + len(slow) // 2  # the point: far fewer than the grid
    for (i, a), (j, b) in itertools.combinations(enumerate(axes), 2):
        for x, y in itertools.product(a, b):
            assert any(case[i] == x and case[j] == y for case in fast), (x, y)
    assert _split(pairwise_params(*axes)) == (fast, slow)


def test_unhashable_values_and_one_axis() -> None:
    fast, slow = _split(pairwise_params([[5, 5], [5, 8]], ["a", "b"]))
    assert len(fast) == 4 and not slow  # two axes: every pair is a case
    fast, slow = _split(pairwise_params([1, 2, 3]))
    assert len(fast) == 3 and not slow  # one axis: every value is a case of its own
