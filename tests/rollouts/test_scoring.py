"""The scorer: boxed-answer extraction, math-verify rewards in worker processes, timeouts, the cache."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from rollouts.scoring import Scorer, extract_last_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("nested \\boxed{\\sqrt{x^{2}+1}} end", "\\sqrt{x^{2}+1}"),
        ("spaces \\boxed{ (3, -1) }", "(3, -1)"),
        ("fbox \\fbox{7}", "7"),
        ("bare $\\boxed 5$ done", "5"),
        ("cut off \\boxed{12} and then \\boxed{3", "12"),  # the last box is unbalanced: take the complete one
        ("no box at all: 17", None),
        ("\\boxed{}", ""),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


@pytest.fixture(scope="module")
def scorer():
    with Scorer(num_workers=2, timeout_s=5.0) as s:
        yield s


def test_rewards(scorer):
    completions = [
        "2+2 is \\boxed{4}",  # right
        "it is \\boxed{5}",  # wrong
        "I think 4",  # no boxed answer
        "\\boxed{0.5}",  # equivalent form of the gold
        "\\boxed{(3,-1)}",  # a tuple: a bare parse would read it as -1
        "\\boxed{-1}",
        "\\boxed{4}",
    ]
    golds = ["4", "4", "4", "\\frac{1}{2}", "(3, -1)", "(3, -1)", "\\text{}"]
    scores = scorer.score(completions, golds)
    assert [s.reward for s in scores] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, None]
    assert [s.correct for s in scores] == [True, False, False, True, True, False, False]
    assert [s.extracted_answer for s in scores] == ["4", "5", None, "0.5", "(3,-1)", "-1", "4"]


def test_tiny_numbers_are_compared_relatively(scorer):
    """math-verify alone calls any two numbers below ~1e-15 equal (evalf with chop)."""
    gold = "1.325 \\times 10^{-27}"
    completions = ["\\boxed{2.88 \\times 10^{-19}}", "\\boxed{1.325 \\times 10^{-27}}", "\\boxed{13.25 \\times 10^{-28}}",
                   "\\boxed{1.4 \\times 10^{-27}}"]
    assert [s.reward for s in scorer.score(completions, [gold] * 4)] == [0.0, 1.0, 1.0, 0.0]


def test_unparseable_gold_is_null_even_without_a_boxed_answer(scorer):
    assert scorer.score(["no answer here"], ["\\text{}"])[0].reward is None
    assert scorer.score(["no answer here"], ["7"])[0].reward == 0.0


def test_cached_items_need_no_worker(scorer):
    golds = [str(i) for i in range(50)]
    completions = [f"\\boxed{{{i}}}" for i in range(50)]
    assert all(s.correct for s in scorer.score(completions, golds))
    # Stop the workers: a cache hit must not talk to them (it would hang until the deadline).
    pids = [w.process.pid for w in scorer._workers]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        for _ in range(20):
            scores = scorer.score(completions, golds)
        per_item_s = (time.perf_counter() - started) / (20 * len(golds))
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    assert all(s.correct for s in scores)
    assert per_item_s < 50e-6, f"cached scoring took {per_item_s * 1e6:.1f} us per item"


def test_scoring_off_the_main_thread(scorer):
    """math-verify's own timeouts fail off the main thread; ours run in workers, so any thread may score."""
    results = []
    thread = threading.Thread(target=lambda: results.append(scorer.score(["\\boxed{\\frac{2}{4}}"], ["0.5"])))
    thread.start()
    thread.join(60)
    assert results and results[0][0].correct


def test_per_item_timeout_gives_zero():
    # A long polynomial takes far more than 20 ms to parse and compare: each item hits the timeout.
    poly = "+".join(f"x^{{{i}}}" for i in range(1, 300))
    with Scorer(num_workers=1, timeout_s=0.02) as scorer:
        scores = scorer.score([f"\\boxed{{{poly}}}", "\\boxed{3}"], [poly, poly])
        assert [s.reward for s in scores] == [0.0, 0.0]
        assert scorer.timeouts >= 1
        assert scorer.cache == {} or all(v is not None for v in scorer.cache.values())


def test_a_stuck_worker_is_replaced():
    with Scorer(num_workers=1, timeout_s=1.0, grace_s=1.0) as scorer:
        scorer.score(["\\boxed{1}"], ["1"])  # the worker is up
        stuck_pid = scorer._workers[0].process.pid
        os.kill(stuck_pid, signal.SIGSTOP)  # stuck outside Python: the interval timer cannot help
        started = time.perf_counter()
        scores = scorer.score(["\\boxed{2}", "\\boxed{3}", "\\boxed{5}"], ["2", "3", "4"])
        assert time.perf_counter() - started < 60
        assert [s.reward for s in scores] == [0.0, 1.0, 0.0]  # the stuck item scores 0, the rest are scored
        assert scorer.timeouts == 1
        assert scorer._workers[0].process.pid != stuck_pid


def test_bad_arguments():
    with pytest.raises(ValueError, match="one gold per completion"):
        Scorer.score(Scorer.__new__(Scorer), ["a"], [])
    with pytest.raises(ValueError, match="at least one worker"):
        Scorer(num_workers=0)
