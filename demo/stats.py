"""The demo's decision rule, written before the runs it judges (issue 35): paired intervals, a permutation test, verdicts.

Every comparison is paired: a method's run and GRPO's run share a start (the learner's warm-start checkpoint) and a seed
(prompt order, sampling seeds: both arms draw the same random numbers where their policies agree), and the unit of
evidence is their difference. For a method M against GRPO, over the n pairs (start, seed):

- weak family: d_i = M's primary metric minus GRPO's on the learner's weak family. The primary metric is sampled
  accuracy (EVAL_SAMPLES samples at T = 1 per held-out problem), averaged over the late evaluations (step >= half the
  run): a seed that happens to learn the family late or early moves it less than one greedy endpoint. Reported: the
  mean, its 95% t-interval, and the two-sided p-value of a sign-flip permutation test (exact over all 2^n sign
  patterns: no normality assumed).
- strong family: the same difference; non-inferiority when the interval's lower bound is above -STRONG_MARGIN.

The verdict (VERDICT_RULE below, the words the report prints):
- gain: the weak family's interval lies above 0 and p < ALPHA, and the strong family is non-inferior;
- harm: the weak family's interval lies below 0, or the strong family's lies below -STRONG_MARGIN;
- no gain: the weak family's interval lies below +WEAK_MIN_GAIN (a gain of that size is ruled out), and not harm;
- undecided: anything else (too few pairs or too much spread to tell, or a weak-family gain with the strong family's
  non-inferiority not shown).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import asdict, dataclass
from typing import Literal

ALPHA = 0.05  # two-sided, for the 95% intervals and the permutation test
STRONG_MARGIN = 0.02  # the strong family may lose at most 2 points (the interval's lower bound above -0.02)
WEAK_MIN_GAIN = 0.02  # the smallest weak-family gain that matters: an interval below it says "no gain"
# The fewest pairs with which the sign-flip test can reach p < ALPHA at all: its smallest two-sided p is 2 / 2^n
# (every pair on one side), 0.125 with 4 pairs, 0.0625 with 5, 0.031 with 6. With fewer, "gain" is out of reach.
MIN_PAIRS_FOR_GAIN = next(n for n in range(1, 64) if 2 / 2 ** n < ALPHA)
EXACT_PERMUTATIONS_UP_TO = 16  # pairs; beyond, a seeded Monte Carlo sample of sign patterns
# Student's t, 0.975 quantile, by degrees of freedom (the standard table; beyond 30 the normal's 1.960 is within 2%)
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228, 11: 2.201,
         12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080,
         22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042}
Verdict = Literal["gain", "no gain", "harm", "undecided"]
VERDICT_RULE = (
    f"paired by (start, seed) with GRPO; 95% t-intervals; gain: the weak family's interval above 0, sign-flip permutation "
    f"p < {ALPHA} and the strong family's interval above -{100 * STRONG_MARGIN:.0f} points; harm: the weak family's interval "
    f"below 0 or the strong family's below -{100 * STRONG_MARGIN:.0f} points; no gain: the weak family's interval below "
    f"+{100 * WEAK_MIN_GAIN:.0f} points; otherwise undecided"
)


@dataclass(frozen=True)
class Interval:
    """A paired difference over n pairs: mean, 95% t-interval, sign-flip permutation p-value."""

    mean: float
    low: float
    high: float
    p_value: float
    pairs: int

    def as_dict(self) -> dict:
        return asdict(self)


def paired_interval(differences: list[float]) -> Interval:
    """The mean of `differences` with its 95% t-interval (n - 1 degrees of freedom) and its permutation p-value. One
    pair gives an interval from -inf to +inf (nothing can be said), none raises."""
    n = len(differences)
    if n == 0:
        raise ValueError("no pairs to compare")
    mean = statistics.fmean(differences)
    if n == 1:
        return Interval(mean, -math.inf, math.inf, 1.0, 1)
    half = T_975.get(n - 1, 1.960) * statistics.stdev(differences) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, sign_flip_p_value(differences), n)


def sign_flip_p_value(differences: list[float], samples: int = 20_000, seed: int = 0) -> float:
    """Two-sided p-value of the mean difference under the null that each pair's sign is a coin flip: the share of sign
    patterns whose |mean| is at least the observed one (exact over all 2^n patterns for n <= 16, else sampled)."""
    import random

    observed = abs(statistics.fmean(differences))
    tolerance = 1e-12 * max(1.0, observed)
    n = len(differences)
    if n <= EXACT_PERMUTATIONS_UP_TO:
        patterns = itertools.product((1.0, -1.0), repeat=n)
        total = 2 ** n
    else:
        rng = random.Random(seed)
        patterns = ([rng.choice((1.0, -1.0)) for _ in range(n)] for _ in range(samples))
        total = samples
    extreme = sum(abs(sum(s * d for s, d in zip(signs, differences)) / n) >= observed - tolerance for signs in patterns)
    return extreme / total


def verdict(weak: Interval, strong: Interval) -> Verdict:
    """VERDICT_RULE on a method's weak-family and strong-family intervals against GRPO."""
    strong_kept = strong.low > -STRONG_MARGIN
    if weak.high < 0 or strong.high < -STRONG_MARGIN:
        return "harm"
    if weak.low > 0 and weak.p_value < ALPHA and strong_kept:
        return "gain"
    if weak.high < WEAK_MIN_GAIN:
        return "no gain"
    return "undecided"


def pct(interval: Interval) -> str:
    """`+12.3 [+4.1, +20.5]` in points (of a fraction)."""
    return f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"
