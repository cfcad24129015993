"""Every gold answer of the five benchmarks verifies against itself in \\boxed{}, and is rejected
against other problems' golds except true equivalents.

All ordered pairs (about 2.3 million, or 0.8 million within benchmarks) would take hours of sympy
on two cores, so the cross check takes, per benchmark: each gold against one other gold (a seeded
random pairing, which catches blanket acceptance), and numeric golds against their neighbours in
value (which catches tolerance bugs: math-verify alone called 1.325e-27 equal to 2.88e-19). The
pairs it accepts must be true equivalents by an independent check (same number, or the same
expression once units, `x =` and spacing are dropped).
"""

from __future__ import annotations

import random
import re

import pytest

from graft.rollouts.datasets import BENCHMARKS, load_problems
from graft.rollouts.scoring import Scorer

EXPECTED_COUNTS = {"math500": 500, "aime24": 30, "amc23": 40, "minerva_math": 272, "olympiadbench": 675}
SCI = re.compile(r"^(-?\d+(?:\.\d+)?)\s*\\times\s*10\^\{?(-?\d+)\}?$")


def numeric_value(gold: str) -> float | None:
    """The gold as a float when it is a plain or scientific-notation number, else None."""
    text = gold.replace(",", "").replace("\\!", "").strip()
    m = SCI.match(text)
    if m:
        return float(m.group(1)) * 10 ** int(m.group(2))
    try:
        return float(text)
    except ValueError:
        return None


def normalised(gold: str) -> str:
    """Independent of math-verify: drop units in degrees, `\\text{}`, a leading `x =`, sizing and spaces."""
    text = re.sub(r"\^\s*\{?\\circ\}?|\\text\{[^}]*\}|\\left|\\right|\\[,;! ]|\s+", "", gold)
    text = re.sub(r"^[a-zA-Z]=", "", text)
    return text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def truly_equivalent(a: str, b: str) -> bool:
    """Same number, same normalised expression, or the same items of an unbracketed list in another
    order (OlympiadBench's multiple answers, `2,3,4`, are unordered; a bracketed `(3,-1)` is a tuple)."""
    na, nb = normalised(a), normalised(b)
    # A comma is a list separator unless it groups thousands (`1,000`), where the numbers compare below.
    if na[:1] not in "([{" and "," in na and not re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", na):
        return sorted(na.split(",")) == sorted(nb.split(","))
    va, vb = numeric_value(na), numeric_value(nb)
    if va is not None and vb is not None:
        return abs(va - vb) <= 1e-9 * max(abs(va), abs(vb))
    return na == nb


@pytest.fixture(scope="module")
def golds() -> dict[str, list[str]]:
    return {name: [p.answer for p in load_problems(name)] for name in BENCHMARKS}


@pytest.fixture(scope="module")
def scorer():
    with Scorer(num_workers=2, timeout_s=10.0) as s:
        yield s


@pytest.mark.slow
def test_every_gold_verifies_against_itself(golds, scorer):
    assert {name: len(g) for name, g in golds.items()} == EXPECTED_COUNTS
    for name, answers in golds.items():
        scores = scorer.score([f"The answer is \\boxed{{{g}}}." for g in answers], answers)
        failed = [g for g, s in zip(answers, scores) if not s.correct]
        assert not failed, f"{name}: {len(failed)} golds do not verify against themselves, e.g. {failed[:5]}"
        assert [s.extracted_answer for s in scores] == [g.strip() for g in answers]


def cross_pairs(answers: list[str], seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    partner = list(range(len(answers)))
    rng.shuffle(partner)
    pairs = {(i, j) for i, j in enumerate(partner) if answers[i] != answers[j]}
    numeric = sorted((v, i) for i, g in enumerate(answers) if (v := numeric_value(g)) is not None)
    for (va, a), (vb, b) in zip(numeric, numeric[1:]):
        if answers[a] != answers[b]:
            pairs.update({(a, b), (b, a)})
    return sorted(pairs)


@pytest.mark.slow
def test_golds_reject_other_problems_golds(golds, scorer):
    accepted_wrongly = []
    checked = 0
    for seed, (name, answers) in enumerate(golds.items()):
        pairs = cross_pairs(answers, seed)
        checked += len(pairs)
        scores = scorer.score([f"\\boxed{{{answers[j]}}}" for _, j in pairs], [answers[i] for i, _ in pairs])
        for (i, j), score in zip(pairs, scores):
            if score.correct and not truly_equivalent(answers[i], answers[j]):
                accepted_wrongly.append((name, answers[i], answers[j]))
    assert checked > 2000, checked
    assert not accepted_wrongly, f"golds accepted against other problems' golds: {accepted_wrongly}"
