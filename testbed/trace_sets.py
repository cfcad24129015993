"""Published trace sets as they stand, in small: the column names and types of each set's dataset card, built and
written by `datasets` as the Hub's exports are (a Parquet export, a `save_to_disk` folder), for `graft-import`'s tests
and benchmark.

- OpenR1-Math-220k (open-r1/OpenR1-Math-220k, config default): problem, solution, answer, problem_type,
  question_type, source, uuid (strings); is_reasoning_complete, correctness_math_verify, correctness_llama (lists of
  bool), generations, finish_reasons (lists of strings), correctness_count (int64), messages (list of {content, role}).
  Two to four generations per problem.
- DeepMath-103K (zwhe99/DeepMath-103K): question, final_answer, topic (strings), difficulty (float64), and three
  solutions r1_solution_1, r1_solution_2, r1_solution_3 (strings).
- OpenThoughts-114k (open-thoughts/OpenThoughts-114k, config default): system (string), conversations (list of
  {from, value}: the user's problem, the assistant's answer).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset, Features, List, Value

OPENR1_FEATURES = Features({
    "problem": Value("string"), "solution": Value("string"), "answer": Value("string"),
    "problem_type": Value("string"), "question_type": Value("string"), "source": Value("string"),
    "uuid": Value("string"), "is_reasoning_complete": List(Value("bool")), "generations": List(Value("string")),
    "correctness_math_verify": List(Value("bool")), "correctness_llama": List(Value("bool")),
    "finish_reasons": List(Value("string")), "correctness_count": Value("int64"),
    "messages": List({"content": Value("string"), "role": Value("string")}),
})
DEEPMATH_FEATURES = Features({
    "question": Value("string"), "final_answer": Value("string"), "difficulty": Value("float64"),
    "topic": Value("string"), "r1_solution_1": Value("string"), "r1_solution_2": Value("string"),
    "r1_solution_3": Value("string"),
})
OPENTHOUGHTS_FEATURES = Features({
    "system": Value("string"), "conversations": List({"from": Value("string"), "value": Value("string")}),
})
OPENTHOUGHTS_SYSTEM = "Your role as an assistant involves thoroughly exploring questions before answering."


@dataclass
class OpenR1Row:
    """One problem of an OpenR1-Math-220k-shaped set: its generations, whether each is right (math-verify's flag as
    the set gives it, which may differ from a check by graft), and how each ended."""

    problem: str
    answer: str
    generations: list[str]
    correct: list[bool]
    finish_reasons: list[str]
    extra: dict = field(default_factory=dict)

    def record(self) -> dict:
        n = len(self.generations)
        return {
            "problem": self.problem, "solution": f"The answer is $\\boxed{{{self.answer}}}$.", "answer": self.answer,
            "problem_type": "Algebra", "question_type": "math-word-problem", "source": "olympiads",
            "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, self.problem)),
            "is_reasoning_complete": [f == "stop" for f in self.finish_reasons], "generations": self.generations,
            "correctness_math_verify": self.correct, "correctness_llama": [None] * n,
            "finish_reasons": self.finish_reasons, "correctness_count": sum(self.correct),
            "messages": [{"content": self.problem, "role": "user"},
                         {"content": self.generations[0], "role": "assistant"}],
        } | self.extra


def openr1_dataset(rows: list[OpenR1Row]) -> Dataset:
    return Dataset.from_list([r.record() for r in rows], features=OPENR1_FEATURES)


def deepmath_dataset(rows: list[tuple[str, str, list[str]]]) -> Dataset:
    """(question, final answer, its three solutions) per row."""
    return Dataset.from_list([
        {"question": q, "final_answer": a, "difficulty": 5.0, "topic": "Mathematics -> Algebra",
         **{f"r1_solution_{i + 1}": s for i, s in enumerate(solutions)}} for q, a, solutions in rows
    ], features=DEEPMATH_FEATURES)


def openthoughts_dataset(rows: list[tuple[str, str]]) -> Dataset:
    """(the user's problem, the assistant's answer) per row, ShareGPT's from/value turns."""
    return Dataset.from_list([
        {"system": OPENTHOUGHTS_SYSTEM, "conversations": [{"from": "user", "value": q}, {"from": "assistant", "value": a}]}
        for q, a in rows
    ], features=OPENTHOUGHTS_FEATURES)


def parquet_export(dataset: Dataset, folder: Path, shards: int = 1) -> Path:
    """The set as the Hub's Parquet export lays it out: `data/train-0000i-of-0000n.parquet`, written by `datasets`."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        dataset.shard(shards, i, contiguous=True).to_parquet(str(folder / "data" / f"train-{i:05d}-of-{shards:05d}.parquet"))
    return folder
