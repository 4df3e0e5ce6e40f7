"""The benchmarks' 95% intervals over prompts (spiffy.bench.stats) and how the reports show them."""

from __future__ import annotations

import numpy as np
import pytest

from spiffy.bench.common import degenerate_stats
from spiffy.bench.report import markdown_ar, markdown_dllm
from spiffy.bench.stats import interval_method, mean_interval, ratio_of_means, ratio_of_means_interval

BASE = [40.0, 52.0, 38.0, 61.0, 45.0, 70.0, 33.0, 48.0, 57.0, 42.0]  # e.g. baseline forwards per prompt
FAST = [19.0, 27.0, 18.0, 25.0, 22.0, 31.0, 17.0, 20.0, 28.0, 21.0]


def test_ratio_of_means_interval_brackets_the_figure_and_is_seeded() -> None:
    value = ratio_of_means(BASE, FAST)
    assert value == pytest.approx(sum(BASE) / sum(FAST))
    iv = ratio_of_means_interval(BASE, FAST)
    assert iv is not None and iv["method"] == "BCa"
    assert 1.0 < iv["low"] < value < iv["high"] < 3.0 and iv["includes_one"] is False
    assert ratio_of_means_interval(BASE, FAST) == iv  # same measurements, same interval


def test_the_interval_is_paired_by_prompt() -> None:
    """Prompts of very different sizes, each about twice as costly on one side: pairing keeps the interval tight
    (resampling the two sides independently would mix a long prompt on one side with a short one on the other)."""
    rng = np.random.default_rng(1)
    sizes = rng.lognormal(4.0, 1.0, 12)
    slow, fast = sizes * 2.0 * rng.uniform(0.95, 1.05, 12), sizes
    iv = ratio_of_means_interval(slow.tolist(), fast.tolist())
    assert iv is not None and 1.9 < iv["low"] < iv["high"] < 2.1


def test_no_difference_includes_one() -> None:
    noise = [1.0, -2.0, 1.5, -0.5, 0.5, -1.0, 2.0, -1.5]
    other = [b + d for b, d in zip(BASE, noise)]
    iv = ratio_of_means_interval(BASE[: len(other)], other)
    assert iv is not None and iv["includes_one"] and iv["low"] < 1.0 < iv["high"]


def test_degenerate_samples() -> None:
    # every resample gives the same ratio (BCa undefined): the percentile interval is the point
    assert ratio_of_means_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == {
        "low": 2.0, "high": 2.0, "includes_one": False, "method": "percentile"}
    assert ratio_of_means_interval([3.0], [1.0]) is None  # one prompt: no interval
    assert ratio_of_means_interval([1.0, 2.0], [0.0, 1.0]) is None  # a zero denominator: no ratio on some resamples
    assert ratio_of_means([], []) is None and ratio_of_means([1.0], [0.0]) is None
    with pytest.raises(ValueError, match="one value per prompt"):
        ratio_of_means_interval([1.0, 2.0], [1.0])
    tau = mean_interval([2.0, 2.5, 3.0, 2.2, 2.8])
    assert tau is not None and tau["low"] < 2.5 < tau["high"]
    assert "paired by prompt" in interval_method() and "over calls" in interval_method("call")


def _run(**over):  # noqa: ANN003, ANN202
    deg = degenerate_stats(["a b"], [[1, 2]])
    run = {"method": "spiffy", "budget": 2, "states_per_forward": 3, "nfe_per_token": 0.5, "nfe_reduction": 2.19,
           "tokens_per_s": 1.0, "speedup": 1.02, "mean_accepted_per_forward": 1.0, "identical": 2,
           "identical_fraction": 1.0, "mismatches": [], "degenerate": deg, "acceptance_histogram": {},
           "accepted_per_level": {}, "acceptance_rate_per_level": {}, "stage_times": {},
           "intervals": {"nfe_reduction": {"low": 2.05, "high": 2.31, "includes_one": False},
                         "speedup": {"low": 0.93, "high": 1.12, "includes_one": True}}}
    run.update(over)
    return run


def test_the_markdown_tables_quote_the_intervals() -> None:
    deg = degenerate_stats(["a b"], [[1, 2]])
    rival = {"nfe_reduction_vs_freedave": {"low": 0.99, "high": 1.03, "includes_one": True},
             "speedup_vs_freedave": {"low": 1.01, "high": 1.09, "includes_one": False}}
    spiffy = _run(rival="freedave 3", nfe_reduction_vs_freedave=1.01, speedup_vs_freedave=1.05,
                  intervals={**_run()["intervals"], **rival})
    res = {"kind": "dllm", "num_prompts": 2, "intervals": interval_method(),
           "baseline": {"nfe_per_token": 1.0, "tokens_per_s": 1.0, "degenerate": deg},
           "runs": [spiffy, _run(method="freedave")]}
    md = markdown_dllm(res)
    assert "| 2.19x [2.05, 2.31] | 1.00 | 1.02x [0.93, 1.12] n.s. | 1.01x [0.99, 1.03] n.s.; 1.05x [1.01, 1.09] |" in md
    assert "| freedave 3 | 2 |" in md and "Brackets: 95% bootstrap interval over prompts" in md
    # a results file written before the intervals still renders (figures alone)
    old = {k: v for k, v in _run().items() if k != "intervals"}
    assert "| 2.19x | 1.00 | 1.02x | - |" in markdown_dllm(dict(res, runs=[old], intervals=None))
    method = {"name": "ddtree@16", "method": "ddtree", "budget": 16, "tau": 2.5, "tau_vs_dflash": 1.3, "tpot_s": 0.01,
              "tokens_per_s": 100.0, "speedup_vs_ar": 0.8, "speedup_vs_dflash": 1.3, "identical": 2,
              "identical_fraction": 1.0, "mismatches": [], "degenerate": deg, "acceptance_histogram": {},
              "stage_times": {}, "intervals": {"tau": {"low": 2.2, "high": 2.9, "includes_one": False},
                                               "tau_vs_dflash": {"low": 1.1, "high": 1.5, "includes_one": False},
                                               "speedup_vs_ar": {"low": 0.7, "high": 0.9, "includes_one": False},
                                               "speedup_vs_dflash": {"low": 0.9, "high": 1.6, "includes_one": True}}}
    md = markdown_ar({"kind": "ar", "num_prompts": 2, "intervals": interval_method(), "methods": [method]})
    assert "| ddtree | 16 | 2.50 [2.20, 2.90] | 1.30x [1.10, 1.50] | 10.00 | 100.00 | 0.80x [0.70, 0.90] | " \
           "1.30x [0.90, 1.60] n.s. |" in md
