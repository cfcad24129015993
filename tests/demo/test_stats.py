"""The demo's decision rule (demo/stats.py) by hand: intervals, the exact permutation test, every verdict."""

from __future__ import annotations

import math

import pytest

from demo.stats import (
    MONTE_CARLO_SAMPLES,
    Interval,
    p_text,
    paired_interval,
    sign_flip_p_value,
    stratified_interval,
    t_quantile,
    verdict,
    verdict_text,
)


def test_paired_interval_by_hand():
    d = [0.10, 0.20, 0.30, 0.40]
    interval = paired_interval(d)
    half = 3.1824 * math.sqrt(((0.15 ** 2) * 2 + (0.05 ** 2) * 2) / 3) / 2  # t(0.975, 3) * sd / sqrt(4)
    assert (interval.mean, interval.low, interval.high) == pytest.approx((0.25, 0.25 - half, 0.25 + half), rel=1e-4)
    assert interval.pairs == 4 and interval.p_value == pytest.approx(2 / 16)  # all positive: 2 of 16 patterns as extreme
    one = paired_interval([0.3])
    assert one.low == -math.inf and one.high == math.inf and one.p_value == 1.0
    with pytest.raises(ValueError):
        paired_interval([])


@pytest.mark.parametrize("df, expected", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (7, 2.3646), (10, 2.2281), (30, 2.0423),
                                          (31, 2.0395), (40, 2.0211), (60, 2.0003), (120, 1.9799), (10 ** 7, 1.9600)])
def test_t_quantiles_are_the_tables_for_any_df(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=5e-4)


def test_the_interval_of_32_pairs_uses_t_at_31_df_not_the_normal():
    # issue 48: the table stopped at 30 df and fell to 1.960, 3.9% too narrow at 31
    d = [0.01 * (i % 7) - 0.02 for i in range(32)]
    interval = paired_interval(d)
    sd = math.sqrt(sum((x - sum(d) / 32) ** 2 for x in d) / 31)
    assert interval.high - interval.mean == pytest.approx(2.0395 * sd / math.sqrt(32), rel=2e-4)
    assert t_quantile(0.975, 2.5) == pytest.approx(3.5747, abs=5e-4)  # a Welch df is not an integer (mpmath: 3.574655)
    assert t_quantile(0.025, 31) == pytest.approx(-2.0395, abs=5e-4)


def test_sign_flip_p_value_counts_every_pattern_at_least_as_extreme():
    # |mean| of [1, -1, 2] is 2/3; patterns with |s1 - s2 + 2 s3| >= 2: all but those summing to 0 -> 6 of 8
    assert sign_flip_p_value([1.0, -1.0, 2.0]) == pytest.approx(6 / 8)
    assert sign_flip_p_value([0.0, 0.0]) == 1.0
    # more pairs than the exact limit: a seeded sample, close to the exact value of the same data
    data = [0.05 * (i % 5) - 0.02 for i in range(20)]
    sampled = sign_flip_p_value(data)
    assert 0.0 <= sampled <= 1.0 and sampled == sign_flip_p_value(data)


def test_the_monte_carlo_p_counts_the_observed_pattern_and_is_never_0():
    # 20 pairs all +0.1: exactly 2 of 2^20 patterns as extreme (p = 1.9e-6); 20,000 samples most likely see none of
    # them, and 0 claims more than any sample can show: (count + 1) / (samples + 1)
    p = sign_flip_p_value([0.1] * 20)
    assert p > 0 and p in [(k + 1) / (MONTE_CARLO_SAMPLES + 1) for k in range(3)]


def test_a_stratified_interval_by_hand():
    # early: 0.1, 0.3 (mean 0.2, variance 0.02); late: 0.0, 0.2 (mean 0.1, variance 0.02). Pooled: (0.2 + 0.1) / 2 =
    # 0.15; SE^2 = (0.02 / 2 + 0.02 / 2) / 4 = 0.005; Welch df = (0.01 + 0.01)^2 / (0.01^2 / 1 + 0.01^2 / 1) = 2, so
    # t = 4.3027 and the half-width is 4.3027 * sqrt(0.005) = 0.3042 (unstratified, 3 df: 3.1824 * 0.1291 / 2 = 0.2054).
    interval = stratified_interval({"early": [0.1, 0.3], "late": [0.0, 0.2]})
    assert (interval.mean, interval.high - interval.mean) == pytest.approx((0.15, 4.3027 * math.sqrt(0.005)), rel=1e-4)
    assert interval.pairs == 4 and interval.p_value == pytest.approx(4 / 16)  # |sum| 0.6 only at all-+ or all-- (x2 for the 0)
    # unequal counts: every start weighs the same, (0.2 + 0.02) / 2, not the mean of the 5 values (0.092);
    # SE^2 = (0.02 / 2 + 0.0004 / 3) / 4, df = (0.01 + 0.000133)^2 / (0.01^2 / 1 + 0.000133^2 / 2)
    unequal = stratified_interval({"early": [0.1, 0.3], "late": [0.0, 0.02, 0.04]})
    v = [0.02 / 2, 0.0004 / 3]
    df = sum(v) ** 2 / (v[0] ** 2 / 1 + v[1] ** 2 / 2)
    assert unequal.mean == pytest.approx(0.11)
    assert unequal.high - unequal.mean == pytest.approx(t_quantile(0.975, df) * math.sqrt(sum(v) / 4), rel=1e-9)
    assert 1.02 < df < 1.03 and stratified_interval({"early": [0.1], "late": [0.0, 0.2]}).high == math.inf


def test_the_reports_comparison_is_stratified_by_start():
    """Through the path the report uses (demo.report.comparison over run records): the by-hand case above."""
    from demo.report import comparison

    def run(mode, start, seed, weak):
        return {"mode": mode, "start": start, "seed": seed, "primary": {"add3": weak, "add2": 0.9},
                "greedy_late": {"add3": weak, "add2": 0.9}}

    gains = {("early", 0): 0.1, ("early", 1): 0.3, ("late", 0): 0.0, ("late", 1): 0.2}
    records = [run("grpo", start, seed, 0.3) for start, seed in gains]
    records += [run("graft", start, seed, 0.3 + gain) for (start, seed), gain in gains.items()]
    weak = Interval(**comparison(records, "graft", "add3", "add2")["weak"])
    assert weak.high - weak.mean == pytest.approx(4.3027 * math.sqrt(0.005), rel=1e-4)


@pytest.mark.parametrize("weak, strong, expected", [
    ((0.10, 0.05, 0.15, 0.01), (0.0, -0.01, 0.01, 0.5), "gain"),
    ((0.10, 0.05, 0.15, 0.01), (-0.01, -0.03, 0.01, 0.5), "undecided"),  # strong family's non-inferiority not shown
    ((-0.10, -0.15, -0.05, 0.01), (0.0, -0.01, 0.01, 0.5), "loss"),  # a large shown loss
    ((0.0, -0.01, 0.01, 0.9), (-0.05, -0.07, -0.03, 0.01), "harm"),  # the strong family clearly lost beyond 2 points
    ((0.0, -0.01, 0.015, 0.9), (0.0, -0.01, 0.01, 0.9), "no gain"),
    ((0.05, -0.02, 0.12, 0.2), (0.0, -0.01, 0.01, 0.9), "undecided"),
    ((0.10, 0.01, 0.19, 0.06), (0.0, -0.01, 0.01, 0.9), "undecided"),  # interval above 0 but the test does not agree
    # issue 48: report/mutual's A, +0.8 [+0.3, +1.2], p 0.031: real, and below the +2 that matters
    ((0.008, 0.003, 0.012, 0.031), (-0.002, -0.005, 0.001, 0.9), "small gain"),
    # issue 60: -0.8 [-1.3, -0.3], a small shown loss, is a loss (issue 48 had called it "no gain")
    ((-0.008, -0.013, -0.003, 0.031), (0.002, -0.001, 0.005, 0.9), "loss"),
    ((-0.03, -0.05, -0.01, 0.01), (0.0, -0.01, 0.01, 0.9), "loss"),  # a loss of 3 points, shown
    # issue 60: the confirmatory run's spec, -3.7 [-8.7, +1.4]: a large loss not shown, a gain of +2 ruled out: no gain
    ((-0.037, -0.087, 0.014, 0.137), (-0.001, -0.012, 0.011, 0.9), "no gain"),
    # ... and its early start, -6.5 [-12.3, -0.7]: a shown loss
    ((-0.065, -0.123, -0.007, 0.039), (0.0, -0.01, 0.01, 0.9), "loss"),
    ((-0.02, -0.04, -0.001, 0.2), (0.0, -0.01, 0.01, 0.9), "undecided"),  # below 0, but the test does not show it
    ((0.015, 0.003, 0.027, 0.01), (0.0, -0.01, 0.01, 0.9), "undecided"),  # a gain shown, its mean below +2, its size not
])
def test_verdicts(weak, strong, expected):
    assert verdict(Interval(*weak, pairs=8), Interval(*strong, pairs=8)) == expected


def test_a_loss_is_printed_with_its_size():
    weak = Interval(-0.065, -0.123, -0.007, 0.039, 8)
    assert verdict_text(verdict(weak, Interval(0.0, -0.01, 0.01, 0.9, 8)), weak) == "loss of 6.5 points"
    assert verdict_text("no gain", weak) == "no gain"


@pytest.mark.parametrize("p, pairs, text", [
    (2 / 65536, 16, "< 0.001"),  # every pair one way at 16 pairs: never "0.000"
    (2 / 64, 6, "0.031 (the floor at 6 pairs)"),
    (0.0625, 6, "0.062"),
    (0.137, 16, "0.137"),
    (1 / 20_001, 32, "< 0.001"),
])
def test_p_is_printed_below_a_thousandth_or_at_its_floor(p, pairs, text):
    assert p_text(Interval(0.1, 0.05, 0.15, p, pairs)) == text


def test_docs_state_the_amended_rules_as_the_code_has_them():
    """docs/demo.md's "The rule, amended (issues 48 and 60)" quotes VERDICT_RULE and studies.recommend's RULE word for word (line
    breaks aside): a change to either shows in the page, with its commit, before a run reads it."""
    from pathlib import Path

    from studies.recommend import RULE
    from demo.stats import VERDICT_RULE

    page = (Path(__file__).resolve().parents[2] / "docs" / "demo.md").read_text()
    section = page.split("## The rule, amended (issues 48 and 60)", 1)[1].split("\n## ", 1)[0]
    section = " ".join(section.replace("\n> ", " ").split())
    assert " ".join(VERDICT_RULE.split()) in section and " ".join(RULE.split()) in section
