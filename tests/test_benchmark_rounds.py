"""benchmarks/_launch.py: the interval the benchmarks give for the median of their rounds' ratios."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _launch import median_interval, ratio_verdict  # noqa: E402


def test_the_interval_is_the_narrowest_pair_of_order_statistics_with_the_coverage_asked():
    values = [1.022, 1.054, 1.000, 1.076, 1.052, 1.037, 0.959, 0.958]
    low, high, coverage = median_interval(values, confidence=0.9)
    assert (low, high) == (0.959, 1.054)  # the 2nd smallest and the 2nd largest of 8
    assert coverage == pytest.approx(1 - 2 * 9 / 256)
    assert median_interval(values, confidence=0.95)[:2] == (0.958, 1.076)  # only the extremes cover 95%
    assert median_interval([3.0, 1.0, 2.0, 4.0], confidence=0.9) is None  # 4 rounds cover at most 87.5%
    assert median_interval([3.0, 1.0, 2.0, 4.0], confidence=0.85) == (1.0, 4.0, 0.875)


def test_the_stated_coverage_is_what_sampling_gives():
    rng = random.Random(0)
    for n in (6, 8, 10):
        trials, covered = 20000, 0
        for _ in range(trials):
            low, high, coverage = median_interval([rng.random() for _ in range(n)])
            covered += low <= 0.5 <= high  # the median of the uniform distribution
        assert covered / trials == pytest.approx(coverage, abs=0.01), n


def test_the_verdict_says_above_below_or_not_resolved():
    assert ratio_verdict([1.016, 0.983, 1.118, 1.094, 1.114, 1.123, 1.007, 1.083]).endswith("above 1.0")
    assert ratio_verdict([0.90, 0.95, 0.97, 0.92, 0.99, 0.93, 0.96, 1.01]).endswith("below 1.0")
    assert ratio_verdict([1.022, 1.054, 1.000, 1.076, 1.052, 1.037, 0.959, 0.958]).endswith("not resolved from 1.0")
    assert ratio_verdict([1.1, 1.2, 1.3]).startswith("too few rounds")
