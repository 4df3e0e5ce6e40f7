"""95% intervals over prompts for the figures the benchmarks report, by the paired bootstrap.

A benchmark figure such as an NFE reduction or a speedup is a ratio of two means over the same prompts (baseline
forwards / method forwards; mean time per token of one method / of another). Its uncertainty comes from which
prompts were drawn, and the two means are paired by prompt, so the interval resamples *prompts* with replacement and
recomputes the ratio of means on each resample (``scipy.stats.bootstrap`` with ``paired=True``; BCa, the default,
which corrects the percentile interval for bias and skew; 9999 resamples; a fixed seed, so the same measurements give
the same interval). A mean (τ) gets the same treatment with one sample.

Where BCa is undefined (every resample gives the same ratio, or two prompts) the percentile interval is used; with
fewer than two prompts there is no interval (``None``). An interval that contains 1.0 means the run cannot tell the
two sides apart: reports flag it (``includes_one``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import numpy as np
from scipy import stats

#: confidence level of every interval
CONFIDENCE = 0.95
#: bootstrap resamples per interval
RESAMPLES = 9999
#: seed of the resampling (same measurements, same interval)
SEED = 0
__all__ = ["CONFIDENCE", "RESAMPLES", "SEED", "interval_method", "mean_interval", "ratio_of_means",
           "ratio_of_means_interval"]


def interval_method(unit: str = "prompt") -> str:
    """How the intervals are computed, as the reports state it (``unit``: what is resampled, e.g. ``"call"``)."""
    return (f"{100 * CONFIDENCE:.0f}% bootstrap interval over {unit}s, paired by {unit} (scipy.stats.bootstrap, BCa, "
            f"{RESAMPLES} resamples, seed {SEED}; percentile where BCa is undefined); a ratio of means is resampled "
            "as one")


def _ratio_of_means(numerator: np.ndarray, denominator: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(numerator, axis=axis) / np.mean(denominator, axis=axis)


def _mean(values: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(values, axis=axis)


def _bootstrap(data: tuple[np.ndarray, ...], statistic: Any, paired: bool) -> dict[str, Any] | None:
    """``{"low", "high", "includes_one", "method"}`` of ``statistic`` over ``data`` (arrays of one value per
    prompt), or ``None`` with fewer than two prompts or a non-finite bound."""
    if len(data[0]) < 2:
        return None
    interval = None
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():  # a degenerate bootstrap distribution warns and gives NaN: fall back
            warnings.simplefilter("ignore")
            result = stats.bootstrap(data, statistic, paired=paired, vectorized=True, n_resamples=RESAMPLES,
                                     confidence_level=CONFIDENCE, method=method, rng=np.random.default_rng(SEED))
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
        if math.isfinite(low) and math.isfinite(high):
            interval = {"low": low, "high": high, "includes_one": low <= 1.0 <= high, "method": method}
            break
    return interval


def ratio_of_means(numerator: Sequence[float], denominator: Sequence[float]) -> float | None:
    """``mean(numerator) / mean(denominator)`` (``None`` when empty or the denominator's mean is not positive)."""
    if not numerator or len(numerator) != len(denominator):
        return None
    den = float(np.mean(np.asarray(denominator, dtype=np.float64)))
    return float(np.mean(np.asarray(numerator, dtype=np.float64))) / den if den > 0 else None


def ratio_of_means_interval(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any] | None:
    """The interval of ``mean(numerator) / mean(denominator)``, both one value per prompt, paired by prompt.

    Returns:
        ``{"low", "high", "includes_one", "method"}``, or ``None`` with fewer than two prompts, a non-positive
        denominator, or a bound that is not finite.
    Raises:
        ValueError: the two sides differ in length.
    """
    if len(numerator) != len(denominator):
        raise ValueError(f"a paired ratio needs one value per prompt on both sides, got {len(numerator)} and "
                         f"{len(denominator)}")
    num = np.asarray(numerator, dtype=np.float64)
    den = np.asarray(denominator, dtype=np.float64)
    if len(den) and np.any(den <= 0):  # a resample of non-positive values has no ratio
        return None
    return _bootstrap((num, den), _ratio_of_means, paired=True)


def mean_interval(values: Sequence[float]) -> dict[str, Any] | None:
    """The interval of ``mean(values)`` (one value per prompt), as :func:`ratio_of_means_interval` returns it."""
    return _bootstrap((np.asarray(values, dtype=np.float64),), _mean, paired=False)
