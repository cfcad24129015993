"""The demo's decision rule, written before the runs it judges (issue 35), amended before any new run (issue 48):
paired intervals stratified by start, a permutation test, verdicts.

Every comparison is paired: a method's run and GRPO's run share a start (the learner's warm-start checkpoint) and a seed
(prompt order, sampling seeds: both arms draw the same random numbers where their policies agree), and the unit of
evidence is their difference. For a method M against GRPO, over the pairs (start, seed):

- weak family: d = M's primary metric minus GRPO's on the learner's weak family. The primary metric is sampled
  accuracy (EVAL_SAMPLES samples at T = 1 per held-out problem), averaged over the late evaluations (step >= half the
  run): a seed that happens to learn the family late or early moves it less than one greedy endpoint.
- strong family: the same difference; non-inferiority when the interval's lower bound is above -STRONG_MARGIN.

Stratified by start (`stratified_interval`): two starts can differ in effect (issue 48: b = 1 with peer negatives x0
gained +29.5 from the early start, +11.8 from the late one), and pooling them as one sample would count that
difference as noise. With S starts, start s holding n_s pairs of mean m_s and sample variance v_s:

    estimate  = (1 / S) * sum_s m_s                                   (every start weighs the same)
    SE^2      = (1 / S^2) * sum_s v_s / n_s                           (the starts are independent)
    df        = (sum_s v_s / n_s)^2 / sum_s (v_s / n_s)^2 / (n_s - 1)  (Welch-Satterthwaite)
    interval  = estimate -+ t_{0.975, df} * SE                        (t quantile exact for any df: `t_quantile`)

One start gives the plain paired t-interval (df = n - 1). A start with one pair has no variance: the interval is
(-inf, +inf). The p-value is a two-sided sign-flip permutation test of the same estimate (each pair's difference
weighted 1 / (S n_s)): exact over all 2^n sign patterns up to EXACT_PERMUTATIONS_UP_TO pairs, else MONTE_CARLO_SAMPLES
seeded patterns with the observed one counted in, (count + 1) / (samples + 1), so it is never 0. No normality assumed.

The verdict (VERDICT_RULE below, the words the report prints), W = WEAK_MIN_GAIN, M = STRONG_MARGIN, "shown" meaning
the weak family's interval excludes 0 on that side and p < ALPHA:
- harm: the strong family's interval lies below -M (a loss of what the model had, beyond the margin);
- loss: a weak-family loss is shown (its interval below 0), whatever its size: the label carries the size
  (`verdict_text`: "loss of 6.5 points"), so a small shown loss and a large one are told apart, and neither is called
  "no gain";
- gain: a weak-family gain is shown with its mean at least +W, and the strong family is non-inferior;
- small gain: a weak-family gain is shown and its whole interval lies below +W (real, and smaller than what matters);
- no gain: the weak family's interval lies below +W and reaches 0 or above (a gain that matters is ruled out, and no
  loss is shown);
- undecided: anything else (too few pairs or too much spread to tell, a shown gain whose size is not, a gain with the
  strong family's non-inferiority not shown, or an interval below 0 whose p does not show it).

RULE_HISTORY dates each version; a report names the version its runs were judged under and, when a later one re-renders
it, both (studies.rerender). An amendment is dated and committed before any run that uses it.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from dataclasses import asdict, dataclass
from typing import Literal

ALPHA = 0.05  # two-sided, for the 95% intervals and the permutation test
STRONG_MARGIN = 0.02  # the strong family may lose at most 2 points (the interval's lower bound above -0.02)
WEAK_MIN_GAIN = 0.02  # the smallest weak-family change that matters, gain or loss
# The fewest pairs with which the sign-flip test can reach p < ALPHA at all: its smallest two-sided p is 2 / 2^n
# (every pair on one side), 0.125 with 4 pairs, 0.0625 with 5, 0.031 with 6. With fewer, "gain" is out of reach.
MIN_PAIRS_FOR_GAIN = next(n for n in range(1, 64) if 2 / 2 ** n < ALPHA)
EXACT_PERMUTATIONS_UP_TO = 16  # pairs; beyond, a seeded Monte Carlo sample of sign patterns
MONTE_CARLO_SAMPLES = 20_000
Verdict = Literal["gain", "small gain", "no gain", "loss", "harm", "undecided"]
VERDICT_RULE = (
    f"paired by (start, seed) with GRPO; the estimate is the mean of the per-start means, its 95% t-interval stratified "
    f"by start (Welch-Satterthwaite df), its p a sign-flip permutation test of the same estimate; harm: the strong "
    f"family's interval below -{100 * STRONG_MARGIN:.0f} points; loss: the weak family's interval below 0 with p < "
    f"{ALPHA} (its size given); gain: the weak family's interval above 0, p < {ALPHA}, its mean at least "
    f"+{100 * WEAK_MIN_GAIN:.0f} points, and the strong family's interval above -{100 * STRONG_MARGIN:.0f} points; small "
    f"gain: the weak family's interval inside (0, +{100 * WEAK_MIN_GAIN:.0f}) points with p < {ALPHA}; no gain: the weak "
    f"family's interval below +{100 * WEAK_MIN_GAIN:.0f} points and not below 0; otherwise undecided"
)
# (date, issue, what changed): the rule's versions, oldest first; the last is VERDICT_RULE. Each was committed before
# any run it judged (issue 35's with its runs' design; the amendments before the runs that first used them).
RULE_HISTORY = [
    ("2026-12-03", "issue 35", "paired t-intervals and the sign-flip test; gain / no gain / harm / undecided"),
    ("2026-12-04", "issue 48", "intervals stratified by start, exact t quantiles, margins on both sides (small gain; "
                               "harm on the weak family only from -2 points)"),
    ("2026-12-06", "issue 60", "a shown weak-family loss is a loss, with its size, at any size; no gain only where no "
                               "loss is shown; harm for the strong family alone; p printed as < 0.001 or at its floor"),
]
RULE_VERSION = f"{RULE_HISTORY[-1][0]} ({RULE_HISTORY[-1][1]})"


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
    """The mean of `differences` (one start) with its 95% t-interval (n - 1 degrees of freedom) and its permutation
    p-value. One pair gives an interval from -inf to +inf (nothing can be said), none raises."""
    return stratified_interval({None: differences})


def stratified_interval(strata: dict[object, list[float]]) -> Interval:
    """The paired differences of several starts (start -> its pairs' differences) pooled as the module says: the mean
    of the per-start means, its stratified 95% t-interval and the sign-flip p-value of that estimate."""
    strata = {name: list(values) for name, values in strata.items() if values}
    if not strata:
        raise ValueError("no pairs to compare")
    count = len(strata)
    estimate = statistics.fmean(statistics.fmean(values) for values in strata.values())
    differences = [d for values in strata.values() for d in values]
    weights = [1 / (count * len(values)) for values in strata.values() for _ in values]
    if any(len(values) < 2 for values in strata.values()):  # a start with one pair: its variance is unknown
        return Interval(estimate, -math.inf, math.inf, 1.0, len(differences))
    per_start = [statistics.variance(values) / len(values) for values in strata.values()]  # v_s / n_s
    spread = math.sqrt(sum(per_start)) / count  # SE
    if spread == 0:
        half = 0.0
    else:
        df = sum(per_start) ** 2 / sum(v ** 2 / (len(values) - 1) for v, values in zip(per_start, strata.values()))
        half = t_quantile(1 - ALPHA / 2, df) * spread
    return Interval(estimate, estimate - half, estimate + half, sign_flip_p_value(differences, weights), len(differences))


def sign_flip_p_value(differences: list[float], weights: list[float] | None = None, samples: int = MONTE_CARLO_SAMPLES,
                      seed: int = 0) -> float:
    """Two-sided p-value of the weighted sum of `differences` (weights: 1 / n each, the mean, by default) under the null
    that each pair's sign is a coin flip: the share of sign patterns whose |sum| is at least the observed one. Exact over
    all 2^n patterns for n <= EXACT_PERMUTATIONS_UP_TO; else `samples` seeded patterns plus the observed one,
    (count + 1) / (samples + 1): a sampled p of 0 would claim more than any sample can show."""
    n = len(differences)
    weighted = [d * w for d, w in zip(differences, weights or [1 / n] * n)]
    observed = abs(sum(weighted))
    tolerance = 1e-12 * max(1.0, observed)

    def extreme(patterns) -> int:
        return sum(abs(sum(s * x for s, x in zip(signs, weighted))) >= observed - tolerance for signs in patterns)

    if n <= EXACT_PERMUTATIONS_UP_TO:
        return extreme(itertools.product((1.0, -1.0), repeat=n)) / 2 ** n
    rng = random.Random(seed)
    sampled = ([rng.choice((1.0, -1.0)) for _ in range(n)] for _ in range(samples))
    return (extreme(sampled) + 1) / (samples + 1)


def t_quantile(probability: float, df: float) -> float:
    """Student's t quantile for any df > 0 (not only integers: the stratified interval's df is not), by bisection on
    the exact CDF: P(T <= t) = 1 - I_x(df / 2, 1 / 2) / 2 for t >= 0, x = df / (df + t^2), I the regularized
    incomplete beta function. Accurate to ~1e-10; t(0.975, 31) = 2.0395, where a table that stops at 30 says 1.960."""
    if not 0 < probability < 1 or not df > 0:
        raise ValueError(f"t quantile of probability {probability} at df {df}: need 0 < p < 1 and df > 0")
    if probability < 0.5:
        return -t_quantile(1 - probability, df)

    def cdf(t: float) -> float:
        return 1 - 0.5 * _incomplete_beta(df / 2, 0.5, df / (df + t * t))

    low, high = 0.0, 1.0
    while cdf(high) < probability:
        low, high = high, 2 * high
    for _ in range(200):
        middle = (low + high) / 2
        if cdf(middle) < probability:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function: its continued fraction (Lentz's method, as in Numerical
    Recipes' betacf), on the side of x where it converges fast."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1 - _incomplete_beta(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return front * fraction


def verdict(weak: Interval, strong: Interval) -> Verdict:
    """VERDICT_RULE on a method's weak-family and strong-family intervals against GRPO."""
    significant = weak.p_value < ALPHA
    if strong.high < -STRONG_MARGIN:
        return "harm"
    if weak.high < 0 and significant:
        return "loss"
    if weak.low > 0 and significant:
        if weak.mean >= WEAK_MIN_GAIN and strong.low > -STRONG_MARGIN:
            return "gain"
        if weak.high < WEAK_MIN_GAIN:
            return "small gain"
    if 0 <= weak.high < WEAK_MIN_GAIN:
        return "no gain"
    return "undecided"


def verdict_text(label: str, weak: Interval) -> str:
    """The verdict as a report prints it: a loss with its size ("loss of 6.5 points"), any other label as it is."""
    return f"loss of {-100 * weak.mean:.1f} points" if label == "loss" else label


def p_floor(pairs: int) -> float:
    """The smallest p the sign-flip test can give with `pairs` pairs: 2 / 2^n exact (every pair on one side), 1 / (samples
    + 1) past EXACT_PERMUTATIONS_UP_TO."""
    return 2 / 2 ** pairs if pairs <= EXACT_PERMUTATIONS_UP_TO else 1 / (MONTE_CARLO_SAMPLES + 1)


def p_text(interval: Interval) -> str:
    """An interval's p as a report prints it: "< 0.001" below a thousandth (never 0.000: the test's floor is above 0,
    2/65536 at 16 pairs), else three decimals, with "(the floor at n pairs)" when no sign pattern could give less."""
    if interval.p_value < 0.001:
        return "< 0.001"
    floor = p_floor(interval.pairs)
    at_floor = interval.p_value <= floor * (1 + 1e-9)
    return f"{interval.p_value:.3f}" + (f" (the floor at {interval.pairs} pairs)" if at_floor else "")


def pct(interval: Interval) -> str:
    """`+12.3 [+4.1, +20.5]` in points (of a fraction)."""
    return f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"
