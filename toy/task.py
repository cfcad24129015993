"""The toy task: `a+b=` -> `\\boxed{a+b}`, in families of operand sizes.

The demo's two families are the same operation with different operand sizes (a prototype of the toy world found: families that
share structure transfer; different operations did not). The learner is warm-started mostly on `add2`
(strong) and barely on `add3` (weak); the peer mostly on `add3`. The tests draw from `SMALL`
(`sample_problems`).

The demo's splits are fixed by a stable hash of the problem text (sha256, never Python's per-process
`hash()`), so SFT, the generator, RL and evaluation see the same held-out problems in every process.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from pathlib import Path

from graft.rollouts.files import write_jsonl_atomic
from graft.schemas.rollout import Problem


@dataclass(frozen=True)
class Family:
    """All problems `a+b=` (or `a+b+c=`, one range per term) with each term in an inclusive range."""

    name: str
    a_range: tuple[int, int]
    b_range: tuple[int, int]
    c_range: tuple[int, int] | None = None  # a third term: a sum of another shape than two operands

    def problems(self) -> list[tuple[int, ...]]:
        ranges = [r for r in (self.a_range, self.b_range, self.c_range) if r is not None]
        return list(itertools.product(*(range(low, high + 1) for low, high in ranges)))


ADD2 = Family("add2", (10, 99), (10, 99))  # 8,100 problems: the learner's strong family
ADD3 = Family("add3", (100, 999), (10, 99))  # 81,000 problems: the learner's weak family, the peer's strong one
# add3 with its operands swapped: as hard by construction, aligned the other way (the mutual study's first pair)
ADD3R = Family("add3r", (10, 99), (100, 999))
# three two-digit terms (`12+34+45=`): a weak family of another shape than a swapped operand order, two carries into
# one column (the mutual study's second pair, issue 60)
SUM3 = Family("sum3", (10, 49), (10, 49), (10, 49))
FAMILIES: dict[str, Family] = {f.name: f for f in (ADD2, ADD3, ADD3R, SUM3)}
SMALL = Family("small", (0, 49), (0, 49))  # 2,500 problems: the tests' worlds
SMALL_DATASET = "toy_add"
SPLITS = ("eval", "rl", "sft")


def problem_text(*terms: int) -> str:
    return "+".join(map(str, terms)) + "="


def answer_text(*terms: int) -> str:
    return str(sum(terms))


def completion_text(answer: str) -> str:
    """The reference completion: the answer in \\boxed{} (the EOS token is the tokenizer's business)."""
    return "\\boxed{" + answer + "}"


def dataset_name(family: str) -> str:
    return f"toy-{family}"


def stable_rank(text: str) -> str:
    """A per-problem key that is the same in every process (sha256 hex), to order problems into splits."""
    return hashlib.sha256(f"graft-demo-split:{text}".encode()).hexdigest()


def family_splits(family: str, n_eval: int, n_rl: int) -> dict[str, list[Problem]]:
    """The family's problems in a fixed pseudo-random order: the first n_eval held out for evaluation,
    the next n_rl used as RL prompts, the rest for supervised warm-starting. Disjoint by construction."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: expected one of {sorted(FAMILIES)}")
    pairs = FAMILIES[family].problems()
    if n_eval + n_rl >= len(pairs):
        raise ValueError(f"family {family} has {len(pairs)} problems; n_eval={n_eval} + n_rl={n_rl} leaves none for SFT")
    items = sorted((stable_rank(problem_text(*terms)), terms) for terms in pairs)
    problems = [Problem.from_text(problem_text(*terms), answer_text(*terms), dataset_name(family)) for _, terms in items]
    return {"eval": problems[:n_eval], "rl": problems[n_eval : n_eval + n_rl], "sft": problems[n_eval + n_rl :]}


def sample_problems(count: int, seed: int = 0, family: Family = SMALL, dataset: str = SMALL_DATASET) -> list[Problem]:
    """`count` distinct problems of `family` in a seeded order (the tests' worlds; the demo uses `family_splits`)."""
    pairs = family.problems()
    random.Random(seed).shuffle(pairs)
    if count > len(pairs):
        raise ValueError(f"family {family.name} has {len(pairs)} distinct problems; asked for {count}")
    return [Problem.from_text(problem_text(*terms), answer_text(*terms), dataset) for terms in pairs[:count]]


def write_problems_jsonl(problems: list[Problem], path: Path, with_completion: bool = False) -> Path:
    """Problems as JSON Lines (prompt_id, dataset, problem, answer[, the reference completion]), written atomically.

    with_completion: rows the trainer's supervised anchor reads (`problem` and `completion`)."""
    rows = [p.model_dump() | ({"completion": completion_text(p.answer)} if with_completion else {}) for p in problems]
    return write_jsonl_atomic(path, rows)


def alphabet() -> str:
    """Every character a problem or a completion of this task can contain, in a fixed order."""
    return "0123456789+=\\boxed{}"
