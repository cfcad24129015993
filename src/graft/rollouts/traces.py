"""Text-only traces read from local files, as the tools that write them write them (`graft-import`'s input).

Three formats, each a file or a folder of files:
- `columns`: JSONL or Parquet with named columns: the problem, the completion (a string, or a list of strings: the
  row is then a whole group), and optionally the gold answer, a given reward and a step;
- `trl`: TRL's `output_dir/completions/completions_<step>.parquet` (`log_completions=True`): `step`, `prompt`,
  `completion`, one column per reward function (named after it), the columns of `log_extra`, `advantage`;
  a conversational prompt or completion is a list of `{role, content}` messages;
- `verl`: verl's `trainer.rollout_data_dir/<step>.jsonl`: `input` (the prompt as decoded, chat template included),
  `output`, `gts` (the ground truth), `score` (the summed token-level reward), `step`, and `uid` / `request_id`.

Rows are grouped per prompt (and step): a group is the completions one model wrote for one prompt at one step. A row
that cannot be read is a `BadRow` (file, row, reason); a file that cannot be read at all, or lacks a named column, is a
`TraceFileError`. Nothing here scores, tokenises or stores (`graft.services.generator.importing` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
import pyarrow.parquet as pq

TraceFormat = Literal["columns", "trl", "verl"]
# TRL's completions table: the columns that are not a reward function's
TRL_NOT_REWARDS = {"step", "prompt", "completion", "advantage", "image"}


@dataclass(frozen=True)
class TraceColumns:
    """Which column holds what; None: the format has no such column (gold, reward and step are optional)."""

    problem: str
    completion: str
    gold: str | None = None
    reward: str | None = None
    step: str | None = None


FORMAT_COLUMNS: dict[str, TraceColumns] = {
    "columns": TraceColumns(problem="problem", completion="completion", gold="answer", reward="reward"),
    "trl": TraceColumns(problem="prompt", completion="completion", step="step"),  # reward: the one reward column
    "verl": TraceColumns(problem="input", completion="output", gold="gts", reward="score", step="step"),
}


class TraceFileError(ValueError):
    """A trace file that cannot be read, or lacks a column it must have: nothing of the import is stored."""


@dataclass(frozen=True)
class BadRow:
    file: Path
    row: int  # 0-based row (JSONL: line - 1) of the file
    reason: str
    group_key: tuple | None = None  # the group the row belongs to, when its prompt could be read (that group is left out)

    def __str__(self) -> str:
        return f"{self.file}: row {self.row}: {self.reason}"


@dataclass(frozen=True)
class TraceRow:
    """One completion of a trace, as the file holds it."""

    file: Path
    row: int  # 0-based row of the file
    prompt: str  # the prompt's text (a conversation's last user message)
    completion: str
    gold: str | None  # the gold answer the file gives, None when it gives none
    reward: float | None  # the reward the file gives, None when it gives none
    step: int | None  # the writing run's step, None when the file has none
    group_key: tuple  # rows with one key are one group


def trace_files(paths: list[str], fmt: TraceFormat) -> list[Path]:
    """The files the paths name: a file as it is; a folder's files of the format (trl: `completions_*.parquet`, in
    it or in its `completions/`; verl: `*.jsonl`; columns: `*.jsonl` and `*.parquet`), in name order."""
    patterns = {"trl": ["completions_*.parquet", "completions/completions_*.parquet"], "verl": ["*.jsonl"],
                "columns": ["*.jsonl", "*.parquet"]}[fmt]
    files: list[Path] = []
    for name in paths:
        path = Path(name).expanduser()
        if path.is_dir():
            found = sorted({f for pattern in patterns for f in path.glob(pattern) if f.is_file()})
            if not found:
                raise TraceFileError(f"{path} holds no {fmt} trace files ({' or '.join(patterns)})")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise TraceFileError(f"{path} does not exist (a trace file, or a folder of them)")
    return files


def read_traces(files: list[Path], fmt: TraceFormat, columns: TraceColumns,
                named: frozenset[str] = frozenset()) -> tuple[list[TraceRow], list[BadRow]]:
    """Every row of `files` as TraceRows, and the rows that could not be read. named: the fields of `columns` the user
    named (a named column missing from a file is a TraceFileError; a format's default column may be absent)."""
    rows: list[TraceRow] = []
    bad: list[BadRow] = []
    for path in files:
        records, unreadable = _records(path)
        bad += unreadable
        present = set().union(*(r.keys() for _, r in records)) if records else set()
        used = _columns_of_file(path, fmt, columns, named, present, bool(records))
        for index, record in records:
            read, problem, key = _trace_rows(path, index, record, used)
            rows += read
            if problem is not None:
                bad.append(BadRow(path, index, problem, key))
    return rows, bad


def _records(path: Path) -> tuple[list[tuple[int, dict]], list[BadRow]]:
    """(row, object) of a JSONL or Parquet file; a JSONL line that is not an object is a bad row."""
    if path.suffix == ".parquet":
        try:
            return list(enumerate(pq.read_table(path).to_pylist())), []
        except Exception as error:  # pyarrow raises several kinds for a file that is not Parquet
            raise TraceFileError(f"{path} cannot be read as Parquet: {error}") from None
    records, bad = [], []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as error:
        raise TraceFileError(f"{path} cannot be read: {error}") from None
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            bad.append(BadRow(path, index, f"not JSON ({error})"))
            continue
        if not isinstance(record, dict):
            bad.append(BadRow(path, index, f"a JSON {type(record).__name__}, not an object"))
            continue
        records.append((index, record))
    return records, bad


def _columns_of_file(path: Path, fmt: TraceFormat, columns: TraceColumns, named: frozenset[str], present: set[str],
                     has_rows: bool) -> TraceColumns:
    """The columns to read in this file: the problem and completion columns must be there (when it has rows), a named
    optional column too; a default optional column that is absent is read as None. TRL: the reward is the one reward
    function's column (or the named one); with several and none named, none is read (score against a gold)."""
    if not has_rows:
        return columns
    for field in ("problem", "completion", *(f for f in ("gold", "reward", "step") if f in named)):
        name = getattr(columns, field)
        if name is not None and name not in present:
            raise TraceFileError(f"{path} has no column {name!r} ({field}; its columns: {', '.join(sorted(present))}): "
                                 f"name the column that holds the {field} with --set {field}_column=NAME")
    reward = columns.reward if "reward" in named or (columns.reward in present) else None
    if fmt == "trl" and "reward" not in named:
        candidates = sorted(present - TRL_NOT_REWARDS)
        reward = candidates[0] if len(candidates) == 1 else None
    return TraceColumns(problem=columns.problem, completion=columns.completion,
                        gold=columns.gold if columns.gold in present else None, reward=reward,
                        step=columns.step if columns.step in present else None)


def _trace_rows(path: Path, index: int, record: dict,
                columns: TraceColumns) -> tuple[list[TraceRow], str | None, tuple | None]:
    """The completions of one record (several when its completion column holds a list), or the reason it is bad and
    the group it belongs to (when its prompt and step could be read)."""
    prompt = _text(record.get(columns.problem), "user")
    if not prompt or not prompt.strip():
        return [], f"{columns.problem!r} is {_shown(record.get(columns.problem))}: a prompt must be a non-empty text", None
    step = record.get(columns.step) if columns.step else None
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        return [], f"{columns.step!r} is {_shown(step)}: a step must be an integer", None
    value = record.get(columns.completion)
    conversation = isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)
    many = isinstance(value, list) and not conversation
    # a list of completions is a whole group of its own; single completions group by (step, prompt) across rows and files
    key = ("row", str(path), index) if many else ("prompt", step, prompt.strip())
    completions = value if many else [_text(value, "assistant")]
    if not completions or any(not isinstance(c, str) for c in completions):
        return [], f"{columns.completion!r} is {_shown(value)}: a completion must be a text (or a list of texts)", key
    gold = record.get(columns.gold) if columns.gold else None
    if gold is not None and not isinstance(gold, (str, int, float)):
        return [], f"{columns.gold!r} is {_shown(gold)}: a gold answer must be a text or a number", key
    reward = record.get(columns.reward) if columns.reward else None
    if reward is not None and (isinstance(reward, str) or not isinstance(reward, (int, float)) or not math.isfinite(reward)):
        return [], f"{columns.reward!r} is {_shown(reward)}: a reward must be a finite number (or null)", key
    gold_text = None if gold is None else str(gold)
    reward_value = None if reward is None else float(reward)
    return [TraceRow(path, index, prompt, c, gold_text, reward_value, step, key) for c in completions], None, None


def _text(value: Any, role: str) -> str | None:
    """A text, or a conversation's text: the last `role` message's content (a prompt), or every message's content
    joined (a completion: TRL's `[{role: assistant, content}]`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in value):
        if role == "user":
            users = [m["content"] for m in value if m.get("role") == "user"]
            return users[-1] if users else None
        return "".join(m["content"] for m in value)
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
