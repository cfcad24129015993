"""Text-only traces read from local files, as the tools that write them write them (`graft-import`'s input).

Three formats, each a file or a folder of files:
- `columns`: JSONL, Parquet (a Hub dataset's Parquet export, in a folder's tree) or a `datasets.save_to_disk` folder
  (Arrow files), with named columns: the problem, the completion (a text; a list of texts, or several columns: the row
  is then a whole group; a conversation: its assistant turns), and optionally the gold answer, a reward (a number or
  a boolean, one per completion where the completions are a list), a finish reason, a step, the prompt the model
  followed and its token ids;
- `trl`: TRL's `output_dir/completions/completions_<step>.parquet` (`log_completions=True`): `step`, `prompt`,
  `completion`, one column per reward function (named after it), the columns of `log_extra`, `advantage`;
  a conversational prompt or completion is a list of `{role, content}` messages;
- `verl`: verl's `trainer.rollout_data_dir/<step>.jsonl`: `input` (the prompt as decoded, chat template included),
  `output`, `gts` (the ground truth), `score` (the summed token-level reward), `step`, and the reward's extra columns.

A conversation is a list of `{role, content}` messages or ShareGPT's `{from, value}` (`human`/`gpt` read as
user/assistant): as a prompt, the turns before the first assistant turn (the problem: the last user turn among them);
as a completion, the assistant turns only.

Files are read a batch of rows at a time (Parquet by row group, Arrow by record batch, JSONL by lines), only the
columns named. A row holding a whole group yields it at once; single completions are grouped: TRL's and verl's per
prompt within a file (a TRL file is one logging step's table; a verl file one step's batch, rows reordered by its
balancing), the columns format's per (step, prompt) across all the files. A group is the completions one model wrote
for one prompt at one step. A row that cannot be read is a `BadRow` (file, row, reason); a file that cannot be read at
all, or lacks a named column, is a `TraceFileError`. Nothing here scores, tokenises or stores
(`graft.services.generator.importing` does).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

TraceFormat = Literal["columns", "trl", "verl"]
# TRL's completions table: the columns that are not a reward function's
TRL_NOT_REWARDS = {"step", "prompt", "completion", "advantage", "image"}
FINISH_REASONS = ("stop", "length", "abort")
BATCH_ROWS = 256  # rows decoded at a time: a few MB of reasoning-length completions
ROW = "\x00row"  # the key of a record's row number (no column has this name)
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant", "system": "system",
                  "tool": "tool"}


@dataclass(frozen=True)
class TraceColumns:
    """Which column holds what; None: the format has no such column (all but problem and completion are optional).
    Several completion columns: each row's values form one group (DeepMath-103K's r1_solution_1..3)."""

    problem: str
    completion: tuple[str, ...]
    gold: str | None = None
    reward: str | None = None
    step: str | None = None
    finish: str | None = None
    prompt: str | None = None  # the prompt the model followed, when the file has it apart from the problem
    prompt_ids: str | None = None

    def names(self) -> list[str]:
        optional = (self.gold, self.reward, self.step, self.finish, self.prompt, self.prompt_ids)
        return list(dict.fromkeys([self.problem, *self.completion, *(n for n in optional if n)]))


FORMAT_COLUMNS: dict[str, TraceColumns] = {
    "columns": TraceColumns(problem="problem", completion=("completion",), gold="answer", reward="reward"),
    # reward: the one reward function's column; the prompt TRL sent is its prompt column
    "trl": TraceColumns(problem="prompt", completion=("completion",), step="step", prompt="prompt"),
    "verl": TraceColumns(problem="input", completion=("output",), gold="gts", reward="score", step="step",
                         prompt="input"),
}


class TraceFileError(ValueError):
    """A trace file that cannot be read, or lacks a column it must have: nothing of the import is stored."""


@dataclass(frozen=True)
class BadRow:
    file: Path
    row: int  # 0-based row (JSONL: line - 1) of the file
    reason: str
    group_key: tuple | None = None  # its group, when its prompt could be read (that group is left out)
    own_group: bool = False  # the row was a whole group (a list of completions): that group is left out

    def __str__(self) -> str:
        return f"{self.file}: row {self.row}: {self.reason}"


@dataclass
class TraceGroup:
    """The completions one model wrote for one prompt, as the file holds them (one entry per completion)."""

    file: Path
    rows: list[int]  # each completion's 0-based row of the file
    problem: str  # the text matched to a problem (a conversation's last user turn before the answer)
    prompt: str | list[dict] | None  # the prompt the model followed: a text, or turns to render; None: not in the file
    prompt_token_ids: list[int] | None
    step: int | None
    completions: list[str] = field(default_factory=list)
    golds: list[str | None] = field(default_factory=list)
    rewards: list[float | bool | None] = field(default_factory=list)
    finishes: list[str | None] = field(default_factory=list)
    reward_column: str | None = None  # the column the rewards came from (TRL: the reward function's)

    @property
    def first_row(self) -> int:
        return self.rows[0]


@dataclass(frozen=True)
class LeftOut:
    """A group not imported, and why (a row of it could not be read, or it has fewer completions than the run's)."""

    group: TraceGroup
    reason: str

    def __str__(self) -> str:
        rows = sorted(set(self.group.rows))
        span = f"row {rows[0]}" if len(rows) == 1 else f"rows {rows[0]}-{rows[-1]}"
        return (f"{self.group.file}: {span}: its group of {len(self.group.completions)} completions is not imported: "
                f"{self.reason}")


def trace_files(paths: list[str], fmt: TraceFormat) -> list[Path]:
    """The files the paths name: a file as it is; a folder's files of the format (trl: `completions_*.parquet`, in
    it or in its `completions/`; verl: `*.jsonl`; columns: a `save_to_disk` folder's Arrow files, else `*.jsonl` and
    `*.parquet` in its tree: a Hub export's `data/` or `default/train/`), in name order."""
    files: list[Path] = []
    for name in paths:
        path = Path(name).expanduser()
        if path.is_dir():
            found = _folder_files(path, fmt)
            if not found:
                raise TraceFileError(f"{path} holds no {fmt} trace files ({_FOLDER_PATTERNS[fmt]})")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise TraceFileError(f"{path} does not exist (a trace file, or a folder of them)")
    return files


_FOLDER_PATTERNS = {"trl": "completions_*.parquet, or completions/completions_*.parquet", "verl": "*.jsonl",
                    "columns": "a datasets.save_to_disk folder, or *.jsonl / *.parquet in its tree"}


def _folder_files(path: Path, fmt: TraceFormat) -> list[Path]:
    if fmt == "trl":
        return sorted({f for pattern in ("completions_*.parquet", "completions/completions_*.parquet")
                       for f in path.glob(pattern) if f.is_file()})
    if fmt == "verl":
        return sorted(f for f in path.glob("*.jsonl") if f.is_file())
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise TraceFileError(f"{path} is a datasets.DatasetDict folder: name one split's folder ({', '.join(splits)})")
    if (path / "state.json").is_file():  # datasets.save_to_disk: the Arrow files its state lists, in order
        state = json.loads((path / "state.json").read_text())
        return [path / entry["filename"] for entry in state.get("_data_files", [])]
    return sorted(f for pattern in ("**/*.jsonl", "**/*.parquet") for f in path.glob(pattern) if f.is_file())


# ------------------------------------------------------------------------------------------------ records


def file_columns(path: Path, sample_rows: int = 1000) -> set[str]:
    """The columns of a file: a Parquet or Arrow file's schema, or the keys of a JSONL file's first rows."""
    if path.suffix in (".parquet", ".arrow"):
        try:
            return set(_arrow_schema(path).names)
        except (OSError, pa.ArrowException) as error:
            raise TraceFileError(f"{path} cannot be read as {path.suffix[1:]}: {error}") from None
    present: set[str] = set()
    for record in itertools.islice(records(path, None), sample_rows):
        if isinstance(record, dict):
            present |= record.keys()
    return present - {ROW}


def _arrow_schema(path: Path) -> pa.Schema:
    if path.suffix == ".parquet":
        return pq.read_schema(path)
    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).schema


def records(path: Path, columns: list[str] | None) -> Iterator[dict | BadRow]:
    """Each row of a JSONL, Parquet or Arrow (IPC stream: `save_to_disk`) file as a dict of `columns` (those it has;
    None: all), a batch at a time; a JSONL line that is not a JSON object is a BadRow."""
    if path.suffix in (".parquet", ".arrow"):
        yield from _columnar_records(path, columns)
        return
    try:
        handle = open(path, "rb")  # noqa: SIM115 (closed below; a generator holds it between batches)
    except OSError as error:
        raise TraceFileError(f"{path} cannot be read: {error}") from None
    with handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as error:
                yield BadRow(path, index, f"not JSON ({error})")
                continue
            if not isinstance(record, dict):
                yield BadRow(path, index, f"a JSON {type(record).__name__}, not an object")
                continue
            record[ROW] = index
            yield record


def _columnar_records(path: Path, columns: list[str] | None) -> Iterator[dict]:
    try:
        schema = _arrow_schema(path)
        wanted = None if columns is None else [c for c in columns if c in schema.names]
        if path.suffix == ".parquet":
            batches = pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=wanted, use_threads=False)
        else:
            batches = _arrow_batches(path, wanted)
        index = 0
        for batch in batches:
            for record in batch.to_pylist():
                record[ROW] = index
                index += 1
                yield record
    except (OSError, pa.ArrowException) as error:
        raise TraceFileError(f"{path} cannot be read as {path.suffix[1:]}: {error}") from None


def _arrow_batches(path: Path, columns: list[str] | None) -> Iterator[pa.RecordBatch]:
    """A `save_to_disk` Arrow file's record batches (memory-mapped, `BATCH_ROWS` rows at a time), `columns` only."""
    with pa.memory_map(str(path)) as source:
        for batch in pa.ipc.open_stream(source):
            if columns is not None:
                batch = batch.select(columns)
            for start in range(0, batch.num_rows, BATCH_ROWS):
                yield batch.slice(start, BATCH_ROWS)


# ------------------------------------------------------------------------------------------------ columns


def columns_of_file(path: Path, fmt: TraceFormat, columns: TraceColumns, named: frozenset[str],
                    present: set[str]) -> TraceColumns:
    """The columns to read in this file: the problem and completion columns must be there, a named optional column
    too (TraceFileError naming it); a format's default optional column that is absent is read as None. TRL: the reward
    is the one reward function's column (or the named one); with several and none named, none is read."""
    if not present:
        return columns
    required = [("problem", columns.problem), *(("completion", c) for c in columns.completion)]
    for name in ("gold", "reward", "step", "finish", "prompt", "prompt_ids"):
        if name in named:
            required.append((name, getattr(columns, name)))
    for what, name in required:
        if name not in present:
            raise TraceFileError(f"{path} has no column {name!r} ({what}; its columns: {', '.join(sorted(present))}): "
                                 f"name the column that holds the {what} with --set {what}_column=NAME")
    kept = {name: getattr(columns, name) if getattr(columns, name) in present else None
            for name in ("gold", "reward", "step", "finish", "prompt", "prompt_ids")}
    if fmt == "trl" and "reward" not in named:
        candidates = sorted(present - TRL_NOT_REWARDS)
        kept["reward"] = candidates[0] if len(candidates) == 1 else None
    return TraceColumns(problem=columns.problem, completion=columns.completion, **kept)


# ------------------------------------------------------------------------------------------------ groups


def read_groups(files: list[Path], fmt: TraceFormat, columns: TraceColumns, named: frozenset[str] = frozenset(),
                group_size: int | None = None) -> Iterator[TraceGroup | BadRow | LeftOut]:
    """Every group of `files` (and every row that cannot be read, as a BadRow: its group, when known, is left out).

    group_size: the completions of every group of single-completion rows (TRL's num_generations, verl's rollout.n);
    TRL and verl, when not given: each file's most common group size (the columns format: none, groups as they are).
    A prompt with a multiple of it (the same prompt twice in a batch) is cut into groups of that size in file order;
    one with another count (a row lost: a line that is not JSON) is left out."""
    across: dict[tuple, TraceGroup] = {}  # columns format: single completions grouped across files
    broken: set[tuple] = set()  # groups holding a bad row
    for path in files:
        used = columns_of_file(path, fmt, columns, named, file_columns(path))
        within: dict[tuple, TraceGroup] = {}
        last_key: tuple | None = None
        after_unreadable = False
        for record in records(path, used.names()):
            if isinstance(record, BadRow):
                yield record
                # which group lost the row is unknown: the groups of the rows around it (rows of one group are
                # written together) are left out with it (TRL and verl: their group sizes tell)
                if fmt == "columns" and last_key is not None:
                    broken.add(last_key)
                after_unreadable = True
                continue
            read = _row(path, record, used)
            if isinstance(read, BadRow):
                if read.group_key is not None:
                    broken.add(read.group_key if fmt == "columns" else (path, *read.group_key))
                yield read
                continue
            if read.key is None:  # a whole group in one row
                yield read.group
                continue
            key = read.key if fmt == "columns" else (path, *read.key)
            if fmt == "columns" and after_unreadable:
                broken.add(key)
            after_unreadable = False
            last_key = key
            target = across if fmt == "columns" else within
            if key in target:
                _extend(target[key], read.group)
            else:
                target[key] = read.group
        if fmt != "columns":
            yield from _sized(within, broken, group_size, infer=True)
    yield from _sized(across, broken, group_size, infer=False)


def _extend(group: TraceGroup, more: TraceGroup) -> None:
    group.rows += more.rows
    group.completions += more.completions
    group.golds += more.golds
    group.rewards += more.rewards
    group.finishes += more.finishes


UNREADABLE_ROW = "it holds a row that could not be read (reported above)"


def _sized(groups: dict[tuple, TraceGroup], broken: set[tuple], group_size: int | None,
           infer: bool) -> Iterator[TraceGroup | LeftOut]:
    """Groups cut to the run's group size (stated, or with `infer` the most common: TRL's and verl's files); those of
    another size, or holding a bad row, left out. Without a size, every group as it is."""
    sizes = Counter(len(g.completions) for key, g in groups.items() if key not in broken)
    size = group_size or (sizes.most_common(1)[0][0] if sizes and infer else None)
    for key, group in groups.items():
        if key in broken:
            yield LeftOut(group, UNREADABLE_ROW)
            continue
        n = len(group.completions)
        if size is None:
            yield group
            continue
        if n % size:
            said = "the run's groups (group_size)" if group_size else "this file's other groups"
            yield LeftOut(group, f"{n} completions where {said} have {size}: a row is missing (a line that is not "
                                 "JSON?); set group_size if the run's groups differ in size")
            continue
        for start in range(0, n, size):
            yield _slice(group, start, start + size)


def _slice(group: TraceGroup, start: int, stop: int) -> TraceGroup:
    return TraceGroup(group.file, group.rows[start:stop], group.problem, group.prompt, group.prompt_token_ids,
                      group.step, group.completions[start:stop], group.golds[start:stop], group.rewards[start:stop],
                      group.finishes[start:stop], group.reward_column)


@dataclass(frozen=True)
class _Read:
    group: TraceGroup
    key: tuple | None  # None: the row is a whole group


def _row(path: Path, record: dict, columns: TraceColumns) -> _Read | BadRow:
    """A record's completions (several when its completion column holds a list, or there are several completion
    columns), or the reason it is bad and the group it belongs to (when its prompt and step could be read)."""
    index = record[ROW]
    raw_problem = record.get(columns.problem)
    problem, prompt_turns = _prompt_of(raw_problem)
    if not problem or not problem.strip():
        return BadRow(path, index, f"{columns.problem!r} is {_shown(raw_problem)}: a prompt must be a non-empty text "
                                   "(or a conversation with a user turn)")
    step = record.get(columns.step) if columns.step else None
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        return BadRow(path, index, f"{columns.step!r} is {_shown(step)}: a step must be an integer >= 0")
    prompt: str | list[dict] | None = None
    if columns.prompt is not None:
        raw = record.get(columns.prompt)
        prompt = raw if isinstance(raw, str) else (prompt_turns if columns.prompt == columns.problem
                                                   else _prompt_of(raw)[1])
    prompt_ids = record.get(columns.prompt_ids) if columns.prompt_ids else None
    if prompt_ids is not None and not (isinstance(prompt_ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt_ids)):
        return BadRow(path, index, f"{columns.prompt_ids!r} is {_shown(prompt_ids)}: prompt token ids must be a list "
                                   "of integers >= 0")
    several = len(columns.completion) > 1
    values = [record.get(c) for c in columns.completion]
    listed = not several and isinstance(values[0], list) and not _is_conversation(values[0])
    key = None if several or listed else (step, problem.strip())
    completions = values if several else (values[0] if listed else values)
    where = ", ".join(repr(c) for c in columns.completion)
    own = key is None
    if not completions:
        return BadRow(path, index, f"{where} is an empty list: no completion", key, own)
    texts = []
    for value in completions:
        text = value if isinstance(value, str) else _assistant_text(value)
        if text is None:
            return BadRow(path, index, f"{where} holds {_shown(value)}: a completion must be a text or a conversation "
                                       "with an assistant turn (or a list of texts)", key, own)
        texts.append(text)
    n = len(texts)
    golds = _per_completion(record, columns.gold, n, key is None)
    rewards = _per_completion(record, columns.reward, n, key is None)
    finishes = _per_completion(record, columns.finish, n, key is None)
    for name, got in ((columns.gold, golds), (columns.reward, rewards), (columns.finish, finishes)):
        if isinstance(got, str):
            return BadRow(path, index, f"{name!r} {got}", key, own)
    bad = (next((f"gold {_shown(g)}: a gold answer must be a text or a number" for g in golds
                 if g is not None and (isinstance(g, bool) or not isinstance(g, (str, int, float)))), None)
           or next((f"reward {_shown(r)}: a reward must be a finite number or a boolean (or null)" for r in rewards
                    if r is not None and not _is_reward(r)), None)
           or next((f"finish reason {_shown(f)}: one of {', '.join(FINISH_REASONS)} (or null)" for f in finishes
                    if f is not None and f not in FINISH_REASONS), None))
    if bad:
        return BadRow(path, index, bad, key, own)
    group = TraceGroup(path, [index] * n, problem, prompt, prompt_ids, step, texts,
                       [None if g is None else str(g) for g in golds], rewards, finishes, columns.reward)
    return _Read(group, key)


def _per_completion(record: dict, column: str | None, n: int, whole_group: bool) -> list | str:
    """A column's value for each of the row's n completions: a list of n values where the row is a whole group and
    the column holds a list (OpenR1's correctness and finish reasons), else the one value for all; a message (str)
    when a list has another length."""
    if column is None:
        return [None] * n
    value = record.get(column)
    if whole_group and isinstance(value, list):
        if len(value) != n:
            return f"holds {len(value)} values for {n} completions"
        return value
    return [value] * n


def _is_reward(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value))


def _is_conversation(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def turns(value: Any) -> list[dict] | None:
    """A conversation as `{role, content}` turns (ShareGPT's `{from, value}` mapped), or None if it is none."""
    if not _is_conversation(value):
        return None
    out = []
    for message in value:
        role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if not isinstance(role, str) or not isinstance(content, str):
            return None
        out.append({"role": SHAREGPT_ROLES.get(role, role), "content": content})
    return out


def prompt_problem(value: Any) -> str | None:
    """The problem's text a prompt value holds: the text itself, or a conversation's last user turn before its
    first assistant turn."""
    return _prompt_of(value)[0]


def _prompt_of(value: Any) -> tuple[str | None, list[dict] | None]:
    """(the problem's text, the prompt's turns) of a prompt value: a text (no turns), or a conversation: its turns
    before the first assistant turn, the problem being the last user turn among them."""
    if isinstance(value, str):
        return value, None
    messages = turns(value)
    if messages is None:
        return None, None
    first_answer = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    before = messages[:first_answer]
    users = [m["content"] for m in before if m["role"] == "user"]
    return (users[-1] if users else None), before


def _assistant_text(value: Any) -> str | None:
    """A conversation's answer: its assistant turns' contents (joined by a blank line when there are several), None
    when it has none."""
    messages = turns(value)
    answers = [m["content"] for m in messages or [] if m["role"] == "assistant"]
    return "\n\n".join(answers) if answers else None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
