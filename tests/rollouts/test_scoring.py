"""The scorer: boxed-answer extraction, math-verify rewards in worker processes, timeouts, the cache."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graft.rollouts.scoring import Scorer, extract_last_boxed


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


def _extract_last_boxed_by_rescanning(text: str) -> str | None:
    """The first implementation (each candidate box scanned forward to its end: quadratic), kept as the oracle."""
    start = max(text.rfind(cmd) for cmd in ("\\boxed", "\\fbox"))
    while start >= 0:
        cmd = next(c for c in ("\\boxed", "\\fbox") if text.startswith(c, start))
        pos = start + len(cmd)
        if text.startswith("{", pos):
            depth = 0
            for end in range(pos, len(text)):
                if text[end] == "{":
                    depth += 1
                elif text[end] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[pos + 1 : end].strip()
        elif text.startswith(" ", pos):
            rest = text[pos:].lstrip(" ")
            answer = rest.split("$")[0].split()[0] if rest.split("$")[0].split() else ""
            if answer:
                return answer
        start = max(text.rfind(c, 0, start) for c in ("\\boxed", "\\fbox"))
    return None


# Texts built from the pieces that matter to the scan: the commands, braces, spaces, `$`, other whitespace.
_BOXED_PIECES = ["\\boxed", "\\fbox", "{", "}", " ", "  ", "$", "\n", "\t", "x", "12", "\\frac", "\\", "\u00a0", "\\boxedx", "\x1c", "\\fboxed"]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_BOXED_PIECES), max_size=40))
def test_extract_last_boxed_matches_the_rescanning_version(pieces):
    text = "".join(pieces)
    assert extract_last_boxed(text) == _extract_last_boxed_by_rescanning(text)


def test_extract_last_boxed_on_many_unbalanced_boxes():
    """21k characters of unclosed boxes (a completion cut off while repeating itself): no complete box, or the one
    before them (benchmarks/boxed_bench.py times this case)."""
    unbalanced = "\\boxed{" * 3000
    assert extract_last_boxed(unbalanced) is None
    assert extract_last_boxed("\\boxed{7} " + unbalanced) == "7"
    assert extract_last_boxed(unbalanced + "}") == ""  # the last box closes, empty


def test_a_worker_killed_mid_item_is_replaced():
    """SIGKILL while the worker holds items: its current item scores 0 (counted), a fresh worker scores the rest, and
    later calls work."""
    with Scorer(num_workers=1, timeout_s=5.0, grace_s=120.0) as scorer:
        scorer.score(["\\boxed{1}"], ["1"])  # the worker is up
        worker = scorer._workers[0]
        os.kill(worker.process.pid, signal.SIGSTOP)  # it takes the items but cannot answer them ...
        killer = threading.Thread(target=lambda: (_wait_until(lambda: worker.items), time.sleep(0.5),
                                                  os.kill(worker.process.pid, signal.SIGKILL)))
        killer.start()  # ... and dies holding them
        try:
            scores = scorer.score(["\\boxed{2}", "\\boxed{3}", "\\boxed{5}"], ["2", "3", "4"])
        finally:
            killer.join(30)
        assert [s.reward for s in scores] == [0.0, 1.0, 0.0]
        assert scorer.timeouts == 1 and scorer.workers_replaced == 1
        assert scorer._workers[0].process.pid != worker.process.pid
        assert [s.reward for s in scorer.score(["\\boxed{6}"], ["6"])] == [1.0]


def test_a_worker_that_died_between_calls_is_replaced():
    """A worker dead before the call held no item: every item is scored, by a fresh worker."""
    with Scorer(num_workers=2, timeout_s=5.0) as scorer:
        scorer.score(["\\boxed{1}", "\\boxed{2}"], ["1", "2"])
        dead = scorer._workers[0].process
        dead.kill()
        dead.wait()
        scores = scorer.score(["\\boxed{3}", "\\boxed{4}", "\\boxed{5}", "\\boxed{7}"], ["3", "4", "5", "6"])
        assert [s.reward for s in scores] == [1.0, 1.0, 1.0, 0.0]
        assert scorer.timeouts == 0 and scorer.workers_replaced == 1
        assert dead.pid not in [w.process.pid for w in scorer._workers]


def test_the_cache_is_bounded_and_results_do_not_change():
    """A continuous run scores new answers without end: the cache keeps the most recently used ones."""
    completions, golds = [f"\\boxed{{{i % 7}}}" for i in range(40)], [str(i % 5) for i in range(40)]
    with Scorer(num_workers=1, timeout_s=5.0, cache_size=4) as small, Scorer(num_workers=1, timeout_s=5.0) as large:
        expected = [s.reward for s in large.score(completions, golds)]
        assert [s.reward for s in small.score(completions, golds)] == expected
        assert len(small.cache) == 4
        assert [s.reward for s in small.score(completions[::-1], golds[::-1])] == expected[::-1]
        assert len(small.cache) == 4


def _wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.01)
