"""The two tiers of the hypothesis property tests (one home for their knobs).

* the default tier: a fixed set of examples (``derandomize``: the same ones in CI and on every machine) sized to stay
  within the fast tier's budget; ``SPIFFY_PROPERTY_EXAMPLES=N`` draws ``N`` per test instead;
* the long run (``*_long`` tests: marked ``slow``, ``factor`` times the examples from another seed, or ``N`` each)
  runs only with ``SPIFFY_PROPERTY_LONG=1``, e.g. ``SPIFFY_PROPERTY_LONG=1 SPIFFY_PROPERTY_EXAMPLES=500 python -m
  pytest -q tests/test_property_exactness.py -m slow``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

__all__ = ["EXAMPLES", "fast_settings", "long_run", "long_settings"]

#: examples per test when set (``SPIFFY_PROPERTY_EXAMPLES``); 0 = each test's own default
EXAMPLES = int(os.environ.get("SPIFFY_PROPERTY_EXAMPLES", "0"))

_HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]

#: the longer run: only on request (it would add minutes to the default tier)
long_run = pytest.mark.skipif(not os.environ.get("SPIFFY_PROPERTY_LONG"), reason="set SPIFFY_PROPERTY_LONG=1 to run")


def fast_settings(default: int) -> settings:
    """``default`` examples (or ``SPIFFY_PROPERTY_EXAMPLES``), always the same ones, no example database."""
    return settings(max_examples=EXAMPLES or default, deadline=None, derandomize=True, database=None,
                    suppress_health_check=_HEALTH)


def long_settings(default: int, factor: int = 10) -> settings:
    """``factor * default`` examples (or ``SPIFFY_PROPERTY_EXAMPLES``), drawn afresh (pair with ``@seed``)."""
    return settings(max_examples=EXAMPLES or factor * default, deadline=None, database=None,
                    suppress_health_check=_HEALTH)
