"""Parquet shards: the vectorised validator, the atomic shard writer, and the cached row reader.

A shard is `<root>/rollouts/model=<model_id>/part-<utc time>-<host>-<pid>-<uuid>.parquet`, written under
a `.tmp-` name in the same directory, fsynced, then renamed, so readers only ever see whole files. It holds
whole groups of one model, in `ROLLOUT_ARROW_SCHEMA`. Row groups hold whole groups and about
`ROW_GROUP_ROWS` rows: small enough that a point lookup decodes little, large enough that writing stays
fast (per-row-group overhead dominates below ~64 rows). Only the bulk columns (text, token ids, logprobs)
are zstd-compressed: decompressing dozens of tiny zstd pages per lookup cost more than the bytes saved.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import PROBLEM_ARROW_SCHEMA, ROLLOUT_ARROW_SCHEMA, Problem, RolloutGroup, groups_to_table
from schemas.rollout import ADVANTAGE_EPS, ADVANTAGE_TOLERANCE

ROW_GROUP_ROWS = 64  # target rows per Parquet row group (whole groups only; a bigger group gets its own)
BULK_COLUMNS = ("completion_text", "completion_token_ids", "token_logprobs")
SMALL_COLUMNS = [f.name for f in ROLLOUT_ARROW_SCHEMA if f.name not in BULK_COLUMNS]
# (0, i): column i of the small columns; (1, j): column j of the bulk columns, in ROLLOUT_ARROW_SCHEMA order
_COLUMN_SOURCES = [(0, SMALL_COLUMNS.index(f.name)) if f.name in SMALL_COLUMNS else (1, BULK_COLUMNS.index(f.name))
                   for f in ROLLOUT_ARROW_SCHEMA]
STATISTICS_COLUMNS = ["prompt_id", "policy_step"]  # min/max per row group: prunes scans of prompt-sorted files
TMP_PREFIX = ".tmp-"
SHARD_PATTERN = "part-*.parquet"
SAFE_NAME = re.compile(r"^[A-Za-z0-9._\-]+$")  # model ids and dataset names become directory names
GROUP_SHARED_FIELDS = (
    "group_id", "prompt_id", "dataset", "model_id", "model_revision", "tokenizer_id", "policy_step", "group_size",
)
# per-column codecs are keyed by Parquet leaf path: a list column's leaf is "<name>.list.element"
_COMPRESSION = {
    (f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name): ("zstd" if f.name in BULK_COLUMNS else "none")
    for f in ROLLOUT_ARROW_SCHEMA
}


class ShardValidationError(ValueError):
    """Rows that break a rule of `schemas.Rollout` / `schemas.RolloutGroup`; the message names the row."""


class ShardReadError(OSError):
    """A shard that cannot be read (truncated, corrupt, vanished); `path` is the shard."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot read shard {path}: {reason}")
        self.path = path
        self.reason = reason


# ----------------------------------------------------------------------------------------------------------
# validation (the same rules as schemas.Rollout and schemas.RolloutGroup, vectorised with pyarrow.compute)


def conform_table(table: pa.Table) -> pa.Table:
    """The table with exactly the columns of ROLLOUT_ARROW_SCHEMA, in order and cast to its types."""
    missing = [n for n in ROLLOUT_ARROW_SCHEMA.names if n not in table.column_names]
    extra = [n for n in table.column_names if n not in ROLLOUT_ARROW_SCHEMA.names]
    if missing or extra:
        raise ShardValidationError(
            f"rollout table columns differ from ROLLOUT_ARROW_SCHEMA: missing {missing}, unexpected {extra}"
        )
    columns = []
    for field in ROLLOUT_ARROW_SCHEMA:
        column = table.column(field.name)
        if column.type != field.type:
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise ShardValidationError(
                    f"column {field.name} has type {column.type}, expected {field.type}, and cannot be cast: {exc}"
                ) from exc
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=ROLLOUT_ARROW_SCHEMA)


def group_runs(group_ids: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Start row and length of each run of equal group ids; every group must be one contiguous run."""
    n = len(group_ids)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if isinstance(group_ids, pa.ChunkedArray):
        group_ids = group_ids.combine_chunks()
    changes = pc.not_equal(group_ids.slice(1), group_ids.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.flatnonzero(changes) + 1]).astype(np.int64)
    lengths = np.diff(np.append(starts, n))
    if len(starts) != pc.count_distinct(group_ids).as_py():
        seen: set[str] = set()
        for s in starts:
            gid = group_ids[int(s)].as_py()
            if gid in seen:
                raise ShardValidationError(
                    f"group {gid} appears in separate runs of rows (again at row {int(s)}); a shard holds whole "
                    "groups: write each group's rollouts next to each other, once"
                )
            seen.add(gid)
    return starts, lengths


def check_groups(table: pa.Table, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Every run shares GROUP_SHARED_FIELDS and has exactly group_size rows."""
    first_of_row = np.repeat(starts, lengths)
    for name in GROUP_SHARED_FIELDS:
        if name not in table.column_names:
            continue
        column = table.column(name)
        same = pc.equal(column, column.take(pa.array(first_of_row))).to_numpy(zero_copy_only=False)
        if not same.all():
            row = int(np.flatnonzero(~same)[0])
            head = int(first_of_row[row])
            raise ShardValidationError(
                f"row {row} (group {table.column('group_id')[row].as_py()}): {name} = {column[row].as_py()!r} but the "
                f"group's first rollout has {column[head].as_py()!r}; a group's rollouts share "
                f"{', '.join(GROUP_SHARED_FIELDS)}"
            )
    sizes = table.column("group_size").to_numpy()[starts]
    wrong = np.flatnonzero(sizes != lengths)
    if len(wrong):
        g = int(wrong[0])
        raise ShardValidationError(
            f"group {table.column('group_id')[int(starts[g])].as_py()} has {int(lengths[g])} rollouts but "
            f"group_size = {int(sizes[g])}"
        )


def _fail_first(ok: np.ndarray | pa.Array | pa.ChunkedArray, table: pa.Table, message: str, values=None) -> None:
    """Raise naming the first row where `ok` is false (null counts as false)."""
    if not isinstance(ok, np.ndarray):
        ok = pc.fill_null(ok, False).to_numpy(zero_copy_only=False)
    if ok.all():
        return
    row = int(np.flatnonzero(~ok)[0])
    shown = "" if values is None else f" = {values[row].as_py() if hasattr(values[row], 'as_py') else values[row]!r}"
    raise ShardValidationError(
        f"row {row} (group {table.column('group_id')[row].as_py()}, rollout "
        f"{table.column('rollout_id')[row].as_py()}): {message}{shown}"
    )


def validate_table(table: pa.Table) -> pa.Table:
    """Check a table of rollouts against every rule of Rollout and RolloutGroup; return it conformed.

    Raises ShardValidationError naming the first offending row and the rule it breaks.
    """
    table = conform_table(table)
    if table.num_rows == 0:
        raise ShardValidationError("no rollouts: a shard holds at least one whole group")
    for field in ROLLOUT_ARROW_SCHEMA:
        column = table.column(field.name)
        if not field.nullable and column.null_count:
            _fail_first(pc.is_valid(column), table, f"{field.name} is null; only top_k, reward and extracted_answer may be")
        if pa.types.is_list(field.type):
            flat = pc.list_flatten(column)
            if flat.null_count:
                lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
                row_of_item = np.repeat(np.arange(table.num_rows), lengths)
                bad = row_of_item[np.flatnonzero(~pc.is_valid(flat).to_numpy(zero_copy_only=False))[0]]
                ok = np.ones(table.num_rows, bool)
                ok[bad] = False
                _fail_first(ok, table, f"{field.name} holds a null item")
    col = table.column
    for name in ("rollout_id", "group_id", "dataset", "model_id", "tokenizer_id"):
        _fail_first(pc.greater_equal(pc.utf8_length(col(name)), 1), table, f"{name} is empty")
    _fail_first(pc.match_substring_regex(col("prompt_id"), r"^[0-9a-f]{16}$"), table,
                "prompt_id must be 16 lowercase hex chars (schemas.prompt_id)", col("prompt_id"))
    _fail_first(pc.match_substring_regex(col("model_id"), SAFE_NAME.pattern), table,
                "model_id must match [A-Za-z0-9._-]+ (it names a directory)", col("model_id"))
    _fail_first(pc.greater_equal(col("policy_step"), 0), table, "policy_step must be >= 0", col("policy_step"))
    _fail_first(pc.greater_equal(col("temperature"), 0), table, "temperature must be >= 0", col("temperature"))
    _fail_first(pc.and_(pc.greater(col("top_p"), 0), pc.less_equal(col("top_p"), 1)), table,
                "top_p must be in (0, 1]", col("top_p"))
    _fail_first(pc.greater(col("max_tokens"), 0), table, "max_tokens must be > 0", col("max_tokens"))
    _fail_first(pc.greater_equal(col("num_tokens"), 0), table, "num_tokens must be >= 0", col("num_tokens"))
    _fail_first(pc.greater_equal(col("num_bytes"), 0), table, "num_bytes must be >= 0", col("num_bytes"))
    _fail_first(pc.greater_equal(col("group_size"), 1), table, "group_size must be >= 1", col("group_size"))
    _fail_first(pc.is_in(col("finish_reason"), pa.array(["stop", "length", "abort"])), table,
                "finish_reason must be 'stop', 'length' or 'abort'", col("finish_reason"))
    _fail_first(pc.and_(pc.is_finite(col("logprob_sum")), pc.less_equal(col("logprob_sum"), 0)), table,
                "logprob_sum must be finite and <= 0", col("logprob_sum"))
    _fail_first(pc.is_finite(col("advantage")), table, "advantage must be finite", col("advantage"))
    reward = col("reward")
    _fail_first(pc.or_kleene(pc.is_null(reward), pc.and_(pc.greater_equal(reward, 0), pc.less_equal(reward, 1))),
                table, "reward must be in [0, 1] or null", reward)
    correct_expected = pc.fill_null(pc.greater(reward, 0), False)
    _fail_first(pc.equal(col("correct"), correct_expected), table, "correct disagrees with reward (correct means reward > 0)")
    logprobs_flat = pc.list_flatten(col("token_logprobs")).to_numpy()  # (total tokens,) float32, no copy
    lp_ok = (logprobs_flat <= 1e-6) & (logprobs_flat > -np.inf)  # NaN fails both comparisons
    if not lp_ok.all():
        lengths = pc.list_value_length(col("token_logprobs")).to_numpy(zero_copy_only=False)
        row_of_item = np.repeat(np.arange(table.num_rows), lengths)
        ok = np.ones(table.num_rows, bool)
        ok[row_of_item[np.flatnonzero(~lp_ok)[0]]] = False
        _fail_first(ok, table, "token_logprobs must be finite and <= 0")
    n_ids = pc.list_value_length(col("completion_token_ids"))
    _fail_first(pc.equal(n_ids, pc.list_value_length(col("token_logprobs"))), table,
                "completion_token_ids and token_logprobs must have the same length")
    _fail_first(pc.equal(col("num_tokens"), n_ids), table, "num_tokens must equal len(completion_token_ids)", col("num_tokens"))
    _fail_first(pc.equal(col("num_bytes"), pc.binary_length(col("completion_text"))), table,
                "num_bytes must equal the UTF-8 length of completion_text", col("num_bytes"))

    starts, lengths = group_runs(col("group_id"))
    check_groups(table, starts, lengths)
    _check_unique_rollout_ids(table)
    _check_advantages(table, starts, lengths)
    return table


def _check_unique_rollout_ids(table: pa.Table) -> None:
    pairs = table.select(["group_id", "rollout_id"]).group_by(["group_id", "rollout_id"]).aggregate([])
    if pairs.num_rows != table.num_rows:
        counts = table.select(["group_id", "rollout_id"]).group_by(["group_id", "rollout_id"]).aggregate(
            [("rollout_id", "count")]
        )
        dup = pc.filter(counts, pc.greater(counts.column("rollout_id_count"), 1))
        raise ShardValidationError(
            f"group {dup.column('group_id')[0].as_py()} repeats rollout_id {dup.column('rollout_id')[0].as_py()!r}"
        )


def _check_advantages(table: pa.Table, starts: np.ndarray, lengths: np.ndarray) -> None:
    """Stored advantages are the group advantages of the rewards (std-normalised or Dr. GRPO), as in RolloutGroup."""
    reward_col = table.column("reward")
    scored = pc.is_valid(reward_col).to_numpy(zero_copy_only=False)
    rewards = pc.fill_null(reward_col, 0.0).to_numpy().astype(np.float64)
    stored = table.column("advantage").to_numpy().astype(np.float64)
    n_scored = np.add.reduceat(scored.astype(np.int64), starts)
    mean = np.add.reduceat(rewards * scored, starts) / np.maximum(n_scored, 1)
    mean_row = np.repeat(mean, lengths)
    sq = np.add.reduceat(((rewards - mean_row) ** 2) * scored, starts)
    std = np.sqrt(sq / np.maximum(n_scored - 1, 1))
    has_signal = np.repeat(n_scored >= 2, lengths) & scored
    centred = np.where(has_signal, rewards - mean_row, 0.0)
    expected_std = centred / (np.repeat(std, lengths) + ADVANTAGE_EPS)
    expected_dr = centred

    def close(expected: np.ndarray) -> np.ndarray:
        row_ok = np.abs(stored - expected) <= ADVANTAGE_TOLERANCE * np.maximum(1.0, np.abs(expected))
        return np.logical_and.reduceat(row_ok, starts)

    ok_groups = close(expected_std) | close(expected_dr)
    if not ok_groups.all():
        g = int(np.flatnonzero(~ok_groups)[0])
        a, b = int(starts[g]), int(starts[g] + lengths[g])
        raise ShardValidationError(
            f"group {table.column('group_id')[a].as_py()}: stored advantages {np.round(stored[a:b], 4).tolist()} are not "
            f"the group advantages of its rewards {reward_col.slice(a, b - a).to_pylist()} "
            f"(expected {np.round(expected_std[a:b], 4).tolist()}, or without std division for Dr. GRPO)"
        )


# ----------------------------------------------------------------------------------------------------------
# writing


def shard_name() -> str:
    """A file name unique across processes and hosts, ordered by creation time."""
    now = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    host = re.sub(r"[^A-Za-z0-9.\-]", "-", socket.gethostname())[:32] or "host"
    return f"part-{now}-{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}.parquet"


def row_group_plan(lengths: np.ndarray, target_rows: int) -> list[int]:
    """Row counts of consecutive row groups that hold whole groups, about `target_rows` each."""
    plan: list[int] = []
    rows = 0
    for n in lengths.tolist():
        if rows and rows + n > target_rows:
            plan.append(rows)
            rows = 0
        rows += n
    if rows:
        plan.append(rows)
    return plan


def write_temporary(directory: Path, write) -> Path:
    """Write through `write(path)` to a `.tmp-` name in `directory` and fsync; readers never pick it up."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (TMP_PREFIX + shard_name())
    try:
        write(str(tmp))  # a path, not a Python file object: Arrow's native file is ~3x faster for many small pages
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def publish(tmp: Path) -> Path:
    """Rename a finished temporary file to its final name (atomic) and make the rename durable."""
    final = tmp.with_name(tmp.name.removeprefix(TMP_PREFIX))
    os.rename(tmp, final)
    dir_fd = os.open(tmp.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def write_rollout_table(
    directory: Path, table: pa.Table, row_group_rows: int = ROW_GROUP_ROWS, publish_now: bool = True
) -> Path:
    """Write an already validated table of whole groups as one shard in `directory`.

    Returns the final path, or with `publish_now=False` the temporary one, for `publish` later (compaction
    renames only once it holds the index's write lock).
    """
    starts, lengths = group_runs(table.column("group_id"))

    def write(f) -> None:
        with pq.ParquetWriter(
            f, ROLLOUT_ARROW_SCHEMA, compression=_COMPRESSION, use_dictionary=False,
            write_statistics=STATISTICS_COLUMNS, write_page_checksum=True,
        ) as writer:
            offset = 0
            for rows in row_group_plan(lengths, row_group_rows):
                writer.write_table(table.slice(offset, rows), row_group_size=rows)
                offset += rows

    tmp = write_temporary(directory, write)
    return publish(tmp) if publish_now else tmp


def model_dir(root: str | Path, model_id: str) -> Path:
    if not SAFE_NAME.match(model_id):
        raise ShardValidationError(f"model_id {model_id!r} must match [A-Za-z0-9._-]+ (it names a directory)")
    return Path(root) / "rollouts" / f"model={model_id}"


def dataset_dir(root: str | Path, dataset: str) -> Path:
    if not SAFE_NAME.match(dataset):
        raise ShardValidationError(f"dataset name {dataset!r} must match [A-Za-z0-9._-]+ (it names a directory)")
    return Path(root) / "prompts" / f"dataset={dataset}"


def write_problems(root: str | Path, problems: list[Problem]) -> list[Path]:
    """Store problems once per dataset: one atomic file per dataset under <root>/prompts/dataset=<name>/."""
    by_dataset: dict[str, dict[str, Problem]] = {}
    for p in problems:
        by_dataset.setdefault(p.dataset, {}).setdefault(p.prompt_id, p)
    paths = []
    for dataset, unique in sorted(by_dataset.items()):
        directory = dataset_dir(root, dataset)
        table = pa.Table.from_pylist([p.model_dump() for p in unique.values()], schema=PROBLEM_ARROW_SCHEMA)
        paths.append(publish(write_temporary(directory, lambda f, t=table: pq.write_table(t, f, compression="zstd"))))
    return paths


def write_groups(
    root: str | Path, groups: list[RolloutGroup] | pa.Table, problems: list[Problem] | None = None
) -> Path:
    """Validate whole groups of one model and write them as one shard; return the shard's final path.

    `groups` is a list of RolloutGroup or an Arrow table in ROLLOUT_ARROW_SCHEMA (validated vectorised with
    the same rules). Problems, if given, go to <root>/prompts/dataset=<name>/. Safe with many concurrent
    writers: names are unique and files appear only once complete (temporary name, fsync, rename).
    """
    if isinstance(groups, pa.Table):
        table = groups
    else:
        if not groups:
            raise ShardValidationError("no groups to write")
        table = groups_to_table(list(groups))
    table = validate_table(table)
    models = pc.unique(table.column("model_id")).to_pylist()
    if len(models) != 1:
        raise ShardValidationError(
            f"groups of {len(models)} models ({', '.join(sorted(models))}); a shard holds one model's groups: "
            "call write_groups once per model"
        )
    if problems:
        write_problems(root, problems)
    return write_rollout_table(model_dir(root, models[0]), table)


# ----------------------------------------------------------------------------------------------------------
# reading


class _OpenShard:
    def __init__(self, path: Path):
        try:
            self.file = pq.ParquetFile(path, memory_map=False, pre_buffer=False, page_checksum_verification=True)
        except (OSError, pa.ArrowException) as exc:
            raise ShardReadError(path, str(exc)) from exc
        metadata = self.file.metadata
        counts = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        self.row_group_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # (R + 1,)
        self.lock = threading.Lock()  # one ParquetFile is not safe for concurrent reads


class ShardReader:
    """Reads row ranges of shards: small columns from a bounded cache, bulk columns from the row groups.

    Decoding a row group costs ~14 us per column chunk before any data, and 25 of the 28 columns are small,
    so a lookup that decoded whole row groups spent half its time on metadata. The small columns of a file
    (~230 bytes per rollout) are kept per file in an LRU cache bounded by `small_cache_bytes`; only the 3
    bulk columns are decoded per lookup. Open files (parsed footers) are kept in an LRU as well.
    """

    def __init__(self, root: Path, max_open_files: int = 64, small_cache_bytes: int = 512 * 2**20):
        self.root = Path(root)
        self.max_open_files = max_open_files
        self.small_cache_bytes = small_cache_bytes
        self._open: OrderedDict[str, _OpenShard] = OrderedDict()
        self._small: OrderedDict[str, pa.Table] = OrderedDict()
        self._small_bytes = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="shard-read")

    def _get(self, rel_path: str) -> _OpenShard:
        with self._lock:
            shard = self._open.get(rel_path)
            if shard is not None:
                self._open.move_to_end(rel_path)
                return shard
        shard = _OpenShard(self.root / rel_path)
        with self._lock:
            self._open[rel_path] = shard
            while len(self._open) > self.max_open_files:
                self._open.popitem(last=False)
        return shard

    def remember_small_columns(self, rel_path: str, table: pa.Table) -> None:
        """Cache a file's small columns (all rows, SMALL_COLUMNS order), e.g. as read at ingest."""
        table = table.select(SMALL_COLUMNS).combine_chunks()
        with self._lock:
            old = self._small.pop(rel_path, None)
            if old is not None:
                self._small_bytes -= old.nbytes
            self._small[rel_path] = table
            self._small_bytes += table.nbytes
            while self._small_bytes > self.small_cache_bytes and len(self._small) > 1:
                _, evicted = self._small.popitem(last=False)
                self._small_bytes -= evicted.nbytes

    def _small_columns(self, rel_path: str, shard: _OpenShard) -> pa.Table:
        with self._lock:
            table = self._small.get(rel_path)
            if table is not None:
                self._small.move_to_end(rel_path)
                return table
        with shard.lock:
            table = shard.file.read(columns=SMALL_COLUMNS, use_threads=False)
        self.remember_small_columns(rel_path, table)
        return table.combine_chunks()

    def forget(self, rel_path: str) -> None:
        with self._lock:
            self._open.pop(rel_path, None)
            old = self._small.pop(rel_path, None)
            if old is not None:
                self._small_bytes -= old.nbytes

    def cached_bytes(self) -> int:
        return self._small_bytes

    def read(self, locations: list[tuple[str, int, int]]) -> pa.Table:
        """Rows [row_start, row_start + num_rows) of each (file, row_start, num_rows), concatenated in order."""
        if not locations:
            return ROLLOUT_ARROW_SCHEMA.empty_table()
        by_file: dict[str, list[int]] = {}
        for i, (rel_path, _, _) in enumerate(locations):
            by_file.setdefault(rel_path, []).append(i)
        def read_file(item: tuple[str, list[int]]) -> pa.Table:
            rel_path, indices = item
            try:
                return self._read_file_rows(rel_path, [locations[i] for i in indices])
            except (OSError, pa.ArrowException) as exc:
                self.forget(rel_path)
                if isinstance(exc, ShardReadError):
                    raise
                raise ShardReadError(self.root / rel_path, str(exc)) from exc

        items = list(by_file.items())
        # Parquet decoding releases the GIL: files of a big lookup decode on all cores
        file_tables = list(self._pool.map(read_file, items)) if len(items) >= 4 else [read_file(i) for i in items]
        placed: dict[int, int] = {}  # location index -> its first row in the concatenation of file_tables
        offset = 0
        for _, indices in items:
            for i in indices:
                placed[i] = offset
                offset += locations[i][2]
        if len(file_tables) == 1 and len(locations) == 1:
            return file_tables[0]
        combined = pa.concat_tables(file_tables)
        return pa.concat_tables([combined.slice(placed[i], locations[i][2]) for i in range(len(locations))])

    def _read_file_rows(self, rel_path: str, spans: list[tuple[str, int, int]]) -> pa.Table:
        """The rows of these spans of one file, in span order, in ROLLOUT_ARROW_SCHEMA."""
        shard = self._get(rel_path)
        bounds = shard.row_group_starts  # (R + 1,)
        if len(spans) == 1:  # the common case: one group of this file, zero-copy slices
            _, row_start, num_rows = spans[0]
            first = int(np.searchsorted(bounds, row_start, side="right")) - 1
            last = int(np.searchsorted(bounds, row_start + num_rows - 1, side="right")) - 1
            if first < 0 or row_start + num_rows > bounds[-1]:
                raise ShardReadError(self.root / rel_path, f"rows {row_start}+{num_rows} beyond its {bounds[-1]} rows")
            with shard.lock:
                bulk = shard.file.read_row_groups(list(range(first, last + 1)), columns=list(BULK_COLUMNS),
                                                  use_threads=False)
            small = self._small_columns(rel_path, shard).slice(row_start, num_rows)
            bulk = bulk.slice(row_start - int(bounds[first]), num_rows)
            parts = (small, bulk)
            return pa.Table.from_arrays([parts[part].column(i) for part, i in _COLUMN_SOURCES], schema=ROLLOUT_ARROW_SCHEMA)
        wanted = []
        for _, row_start, num_rows in spans:
            if row_start < 0 or row_start + num_rows > bounds[-1]:
                raise ShardReadError(self.root / rel_path, f"rows {row_start}+{num_rows} beyond its {bounds[-1]} rows")
            wanted.append(np.arange(row_start, row_start + num_rows))
        rows = np.concatenate(wanted)  # (rows wanted,) row numbers in the file
        row_groups = np.unique(np.searchsorted(bounds, rows, side="right") - 1)
        with shard.lock:
            bulk = shard.file.read_row_groups(row_groups.tolist(), columns=list(BULK_COLUMNS), use_threads=False)
        # position of each wanted row inside `bulk`, which holds just the listed row groups back to back
        sizes = bounds[row_groups + 1] - bounds[row_groups]
        first_in_bulk = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        group_of_row = np.searchsorted(row_groups, np.searchsorted(bounds, rows, side="right") - 1)
        in_bulk = first_in_bulk[group_of_row] + rows - bounds[row_groups[group_of_row]]
        small = self._small_columns(rel_path, shard).take(pa.array(rows))
        bulk = bulk.take(pa.array(in_bulk))
        parts = (small, bulk)
        columns = [parts[part].column(i) for part, i in _COLUMN_SOURCES]
        return pa.Table.from_arrays(columns, schema=ROLLOUT_ARROW_SCHEMA)
