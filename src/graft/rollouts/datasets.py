"""Problems from the repository's data folder (by benchmark name) or from any JSONL / Parquet file."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import orjson
import pyarrow.parquet as pq

from graft.schemas import Problem

REPO_ROOT = Path(__file__).resolve().parents[3]  # src/graft/rollouts/datasets.py: the checkout (an editable install)

# name -> (file under the data dir, field holding the gold answer)
KNOWN_DATASETS: dict[str, tuple[str, str]] = {
    "math500": ("math500/test.jsonl", "answer"),
    "aime24": ("aime24/test.jsonl", "answer"),
    "amc23": ("amc23/test.jsonl", "answer"),
    # math-verify reads e-notation like 4.5e33 as 4.5*e*33: the LaTeX rewrite is the gold (SOURCES.md).
    "minerva_math": ("minerva_math/test.jsonl", "answer_sci_latex"),
    "olympiadbench": ("olympiadbench/test.jsonl", "answer"),
    "gsm8k": ("gsm8k/test.jsonl", "answer"),
    "math_train": ("math_train/train.jsonl", "answer"),
}
BENCHMARKS = ["math500", "aime24", "amc23", "minerva_math", "olympiadbench"]  # the five of docs/algorithm.md section 10


def data_dir() -> Path:
    """The data folder: env GRAFT_DATA_DIR when set, else the repository's `data/` (sources in data/SOURCES.md).

    An installed copy of the package (not editable) has no `data/` beside it: set GRAFT_DATA_DIR there,
    as docker-compose does."""
    override = os.environ.get("GRAFT_DATA_DIR")
    return Path(override) if override else REPO_ROOT / "data"


def resolve_dataset(path_or_benchmark_name: str) -> tuple[Path, str, str]:
    """(file, gold-answer field, dataset name) of a known dataset name or a JSONL / Parquet path (here or under the
    data dir); FileNotFoundError naming what was looked for when there is none."""
    if path_or_benchmark_name in KNOWN_DATASETS:
        relative, answer_field = KNOWN_DATASETS[path_or_benchmark_name]
        path, dataset = data_dir() / relative, path_or_benchmark_name
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: set GRAFT_DATA_DIR to a folder holding {relative} (default: the repository's data/)"
            )
    else:
        path, answer_field = Path(path_or_benchmark_name), "answer"
        if not path.exists() and not path.is_absolute() and (data_dir() / path).exists():
            path = data_dir() / path  # a file inside the data dir, e.g. math_train/train_level3to5.jsonl
        dataset = path.stem
        if not path.exists():
            raise FileNotFoundError(
                f"{path} is neither a file (here or under {data_dir()}) nor a known dataset name "
                f"({', '.join(KNOWN_DATASETS)})"
            )
    return path, answer_field, dataset


def gold_answer(text: str) -> str:
    """The gold answer a row's answer field holds: the text itself, or, in GSM8K's format (a worked solution ending in
    a line `#### 7`), what follows the last `####`, a number's thousands commas removed (as data/gsm8k/ holds it)."""
    text = str(text).strip()
    if "####" not in text:
        return text
    answer = text.rsplit("####", 1)[1].strip()
    return answer.replace(",", "") if _NUMBER_WITH_COMMAS.fullmatch(answer) else answer


_NUMBER_WITH_COMMAS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def load_problems(path_or_benchmark_name: str, limit: int | None = None, problem_field: str = "problem",
                  answer_field: str | None = None) -> list[Problem]:
    """Problems of a known dataset name (see KNOWN_DATASETS) or of a JSONL / Parquet file, one problem per row.

    problem_field: the column holding the problem text (default `problem`); answer_field: the column holding the gold
    answer (default `answer`, or the known dataset's field). A gold answer in GSM8K's format (`... #### 7`) is read
    as what follows `####` (`gold_answer`). The dataset name stored with each problem is the benchmark name, or the
    file's stem. Duplicate problem texts (same prompt_id) are kept once, first occurrence wins. A bad file raises
    ValueError with one line that says which row and what to change.
    """
    path, default_answer_field, dataset = resolve_dataset(path_or_benchmark_name)
    answer_field = answer_field or default_answer_field
    rows = _read_rows(path)
    problems: dict[str, Problem] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path} row {i} is a {type(row).__name__}, not an object: one JSON object per line "
                             f"with '{problem_field}' and '{answer_field}'")
        missing = [name for name in (problem_field, answer_field) if name not in row]
        if missing:
            raise ValueError(
                f"{path} row {i} has no {' and no '.join(repr(m) for m in missing)} field (its fields: "
                f"{', '.join(map(str, row)) or 'none'}): name the columns that hold the problem and the answer with "
                "problem_field / answer_field (graft-generate --set problem_field=question; graft-train "
                "--set data.problem_field=question)")
        text, answer = row[problem_field], row[answer_field]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path} row {i}: '{problem_field}' must be a non-empty string, got {text!r}")
        problem = Problem.from_text(text, gold_answer(answer), dataset)
        problems.setdefault(problem.prompt_id, problem)
        if limit is not None and len(problems) >= limit:
            break
    return list(problems.values())


def _read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(orjson.loads(line))
                    except orjson.JSONDecodeError as e:
                        raise ValueError(f"{path} line {n} is not valid JSON ({e}): one JSON object per line expected") from e
        return rows
    raise ValueError(f"{path}: unsupported dataset format {path.suffix!r}; use .jsonl or .parquet")


class ProblemIndex:
    """A trace prompt's problem: the one whose text it equals, else the longest one whose text it holds (a prompt
    rendered with a template or worked examples holds the problem), found through an index rather than a scan.

    Problems of at least ANCHOR characters are indexed by their first ANCHOR characters: each position of the prompt
    is one dict lookup, and only problems starting there are compared whole. Shorter problems are looked up by every
    substring of their lengths. A prompt costs O(its length x (1 + distinct short lengths)), whatever the number of
    problems (the scan it replaces compared every problem with every prompt: ~10^9 substring checks for a long dump
    against MATH's train set)."""

    ANCHOR = 16

    def __init__(self, problems: list[Problem]):
        self.exact = {p.problem.strip(): p for p in problems}
        self.by_anchor: dict[str, list[Problem]] = {}
        self.short: dict[int, dict[str, Problem]] = {}
        for p in self.exact.values():
            text = p.problem.strip()
            if len(text) >= self.ANCHOR:
                self.by_anchor.setdefault(text[: self.ANCHOR], []).append(p)
            else:
                self.short.setdefault(len(text), {}).setdefault(text, p)
        self.match = functools.lru_cache(maxsize=4096)(self._match)  # rows of a group repeat their prompt

    def _match(self, prompt: str) -> Problem | None:
        text = prompt.strip()
        found = self.exact.get(text)
        if found is not None:
            return found
        best: Problem | None = None
        best_length = 0
        for i in range(len(text) - self.ANCHOR + 1):
            for p in self.by_anchor.get(text[i : i + self.ANCHOR], ()):
                length = len(p.problem.strip())
                if length > best_length and text.startswith(p.problem.strip(), i):
                    best, best_length = p, length
        if best is not None:
            return best  # any indexed match is longer than every short problem
        for length in sorted(self.short, reverse=True):
            table = self.short[length]
            for i in range(len(text) - length + 1):
                found = table.get(text[i : i + length])
                if found is not None:
                    return found
        return None
