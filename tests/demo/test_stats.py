"""The demo's decision rule (demo/stats.py) by hand: intervals, the exact permutation test, every verdict."""

from __future__ import annotations

import math

import pytest

from demo.stats import Interval, paired_interval, sign_flip_p_value, verdict


def test_paired_interval_by_hand():
    d = [0.10, 0.20, 0.30, 0.40]
    interval = paired_interval(d)
    half = 3.182 * math.sqrt(((0.15 ** 2) * 2 + (0.05 ** 2) * 2) / 3) / 2  # t(0.975, 3) * sd / sqrt(4)
    assert (interval.mean, interval.low, interval.high) == pytest.approx((0.25, 0.25 - half, 0.25 + half))
    assert interval.pairs == 4 and interval.p_value == pytest.approx(2 / 16)  # all positive: 2 of 16 patterns as extreme
    one = paired_interval([0.3])
    assert one.low == -math.inf and one.high == math.inf and one.p_value == 1.0
    with pytest.raises(ValueError):
        paired_interval([])


def test_sign_flip_p_value_counts_every_pattern_at_least_as_extreme():
    # |mean| of [1, -1, 2] is 2/3; patterns with |s1 - s2 + 2 s3| >= 2: all but those summing to 0 -> 6 of 8
    assert sign_flip_p_value([1.0, -1.0, 2.0]) == pytest.approx(6 / 8)
    assert sign_flip_p_value([0.0, 0.0]) == 1.0
    # more pairs than the exact limit: a seeded sample, close to the exact value of the same data
    data = [0.05 * (i % 5) - 0.02 for i in range(20)]
    sampled = sign_flip_p_value(data)
    assert 0.0 <= sampled <= 1.0 and sampled == sign_flip_p_value(data)


@pytest.mark.parametrize("weak, strong, expected", [
    ((0.10, 0.05, 0.15, 0.01), (0.0, -0.01, 0.01, 0.5), "gain"),
    ((0.10, 0.05, 0.15, 0.01), (-0.01, -0.03, 0.01, 0.5), "undecided"),  # strong family's non-inferiority not shown
    ((-0.10, -0.15, -0.05, 0.01), (0.0, -0.01, 0.01, 0.5), "harm"),
    ((0.0, -0.01, 0.01, 0.9), (-0.05, -0.07, -0.03, 0.01), "harm"),  # the strong family clearly lost beyond 2 points
    ((0.0, -0.01, 0.015, 0.9), (0.0, -0.01, 0.01, 0.9), "no gain"),
    ((0.05, -0.02, 0.12, 0.2), (0.0, -0.01, 0.01, 0.9), "undecided"),
    ((0.10, 0.01, 0.19, 0.06), (0.0, -0.01, 0.01, 0.9), "undecided"),  # interval above 0 but the test does not agree
])
def test_verdicts(weak, strong, expected):
    assert verdict(Interval(*weak, pairs=8), Interval(*strong, pairs=8)) == expected
