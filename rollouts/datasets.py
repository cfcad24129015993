"""Problems from the repository's data folder (by benchmark name) or from any JSONL / Parquet file."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pyarrow.parquet as pq

from schemas import Problem

REPO_ROOT = Path(__file__).resolve().parents[1]

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
BENCHMARKS = ["math500", "aime24", "amc23", "minerva_math", "olympiadbench"]  # the five of GRAFT_SPEC section 10


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


def load_problems(path_or_benchmark_name: str, limit: int | None = None) -> list[Problem]:
    """Problems of a known dataset name (see KNOWN_DATASETS) or of a JSONL / Parquet file with `problem` and `answer`.

    The dataset name stored with each problem is the benchmark name, or the file's stem.
    Duplicate problem texts (same prompt_id) are kept once, first occurrence wins.
    """
    path, answer_field, dataset = resolve_dataset(path_or_benchmark_name)
    rows = _read_rows(path)
    problems: dict[str, Problem] = {}
    for i, row in enumerate(rows):
        if "problem" not in row or answer_field not in row:
            raise ValueError(f"{path} row {i} has no '{'problem' if 'problem' not in row else answer_field}' field: "
                             f"every row needs 'problem' and '{answer_field}'")
        text, answer = row["problem"], row[answer_field]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path} row {i}: 'problem' must be a non-empty string, got {text!r}")
        problem = Problem.from_text(text, str(answer).strip(), dataset)
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
