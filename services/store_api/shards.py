"""Parquet shards and their lookup files: the vectorised validator, the atomic writer, the group reader.

A shard is `<root>/rollouts/model=<model_id>/part-<utc time>-<host>-<pid>-<uuid>.parquet`, written under
a `.tmp-` name in the same directory, fsynced, then renamed, so readers only ever see whole files. It holds
whole groups of one model, in `ROLLOUT_ARROW_SCHEMA`: the source of truth, read by DuckDB and by anyone.
Row groups hold whole groups and about `ROW_GROUP_ROWS` rows; only the bulk columns (text, token ids,
logprobs) are zstd-compressed (decompressing many small zstd pages of the small columns cost more than it
saved), at level 1: the cheapest level that compresses (negative levels skip entropy coding and saved ~1%).

Point reads do not decode Parquet. Decoding is what a lookup cost: ~0.5 ms of CPU for the 64-row row group
holding one 8-row group, and row groups of one group made writing 4x slower and footers 8x bigger. So every
shard has a lookup file, `<root>/lookup/model=<model_id>/<shard name>.arrows`: an Arrow IPC stream with one
record batch per group (all columns), then a block table (row start, rows, byte offset, length, CRC-32 of
each group's message) and a trailer. A lookup preads its groups' messages and sends them behind a schema
message as the response stream: no decoding, no re-encoding (~25 us per group). Lookup files are derived:
the writer writes one just before publishing the shard (it has the table in memory; the store would have to
decode the shard), the store rebuilds a missing or damaged one from the shard, and they may be deleted at any
time. Their directory is not fsynced after the rename: a file lost or torn by a crash fails its size or CRC
checks and is rebuilt.

Written files leave the writer's page cache (`drop_cached_pages`, once their data is on disk): a writer
streams ~6 KB per rollout (shard + lookup file) that it never reads again, and on the VM this was measured
on, page cache grown beyond the guest's recently used memory cost 14-18 us of kernel time per 4 KB page
against ~1 us for recycled pages (`benchmarks/RESULTS.md`, Store): at 1M rollouts that was 15 us per
rollout. Dropping recycles the same pages shard after shard. The store reads a lookup file's groups from disk
when first asked for (~0.15 ms per group here; a batch's reads are issued together, see
`ShardReader.messages`), and the page cache keeps what lookups read.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import os
import re
import socket
import struct
import threading
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import PROBLEM_ARROW_SCHEMA, ROLLOUT_ARROW_SCHEMA, Problem, RolloutGroup
from schemas.rollout import ADVANTAGE_EPS, ADVANTAGE_TOLERANCE

# target rows per Parquet row group (whole groups only; a bigger group gets its own). Lookups never decode
# row groups, so they are sized for writing: 1024 rows cost 11 us/rollout to write, 64 rows cost 22 us.
ROW_GROUP_ROWS = 1024
BULK_COLUMNS = ("completion_text", "completion_token_ids", "token_logprobs")
STATISTICS_COLUMNS = ["prompt_id", "policy_step"]  # min/max per row group: prunes scans of prompt-sorted files
TMP_PREFIX = ".tmp-"
SHARD_PATTERN = "part-*.parquet"
LOOKUP_DIR = "lookup"
LOOKUP_SUFFIX = ".arrows"
LOOKUP_MAGIC = b"GRAFTLK1"
LOOKUP_VERSION = 1
_LOOKUP_TRAILER = struct.Struct("<qII8s")  # groups, CRC-32 of the block table, format version, magic
_BLOCK_FIELDS = 5  # block table columns (int64): row start, rows, message offset, message length, CRC-32
SCHEMA_MESSAGE = ROLLOUT_ARROW_SCHEMA.serialize().to_pybytes()  # an IPC stream's first message
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an IPC stream's last 8 bytes
LOOKUP_CHUNK_BYTES = 1 << 20  # lookup file messages are built in memory and written in chunks of about this size
SAFE_NAME = re.compile(r"^[A-Za-z0-9._\-]+$")  # model ids and dataset names become directory names
GROUP_SHARED_FIELDS = (
    "group_id", "prompt_id", "dataset", "model_id", "model_revision", "tokenizer_id", "policy_step", "group_size",
)
# per-column codecs are keyed by Parquet leaf path: a list column's leaf is "<name>.list.element"
_COMPRESSION = {
    (f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name): ("zstd" if f.name in BULK_COLUMNS else "none")
    for f in ROLLOUT_ARROW_SCHEMA
}


HAS_FADVISE = hasattr(os, "posix_fadvise")  # Linux; elsewhere pages are not dropped and the page cache just grows
log = logging.getLogger(__name__)


def drop_cached_pages(fd: int) -> None:
    """Tell the kernel a file's pages will not be read soon: clean ones leave the page cache, so the memory is
    reused for the next file instead of growing the cache (see the module docstring); on Linux, dirty ones
    start being written back (without waiting), so a later fsync waits less. Only an optimisation: a failure
    is logged, never raised."""
    if not HAS_FADVISE:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as exc:
        log.warning("could not drop cached pages of fd %d: %s", fd, exc)


def sync_and_drop(fd: int, data_only: bool = False) -> None:
    """Wait until the file's data is on disk (fsync, or fdatasync where only the data matters), then drop its
    pages from the page cache: dirty pages cannot be dropped."""
    (os.fdatasync if data_only and hasattr(os, "fdatasync") else os.fsync)(fd)
    drop_cached_pages(fd)


def drop_written_pages(path: Path) -> None:
    """Free the pages of a derived file this process will not read again (a lookup file): wait for its data,
    then drop them. A file deleted meanwhile is fine (its pages went with it), and a failure is logged, not
    raised: the file can be rebuilt from its shard, so it must never fail a shard write."""
    if not HAS_FADVISE:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        sync_and_drop(fd, data_only=True)
    except OSError as exc:
        log.warning("could not write back %s before dropping its pages: %s", path, exc)
    finally:
        os.close(fd)


class ShardValidationError(ValueError):
    """Rows that break a rule of `schemas.Rollout` / `schemas.RolloutGroup`; the message names the row."""


class ShardReadError(OSError):
    """A shard that cannot be read (truncated, corrupt, vanished); `path` is the shard."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot read shard {path}: {reason}")
        self.path = path
        self.reason = reason


# ----------------------------------------------------------------------------------------------------------
# building a table from pydantic groups

_LIST_ITEM_DTYPES = {
    f.name: f.type.value_type.to_pandas_dtype() for f in ROLLOUT_ARROW_SCHEMA if pa.types.is_list(f.type)
}


def groups_table(groups: Iterable[RolloutGroup]) -> pa.Table:
    """Rows of whole groups, in order, in ROLLOUT_ARROW_SCHEMA: the table `schemas.groups_to_table` builds,
    column by column instead of through a dict per rollout (~3x less CPU for 256-token rollouts; the token
    lists go through numpy without a Python object per item). Checks nothing: `validate_table` does.
    """
    rollouts = [r for g in groups for r in g.rollouts]
    n = len(rollouts)
    arrays = []
    for field in ROLLOUT_ARROW_SCHEMA:
        values = list(map(operator.attrgetter(field.name), rollouts))
        try:
            if field.name in _LIST_ITEM_DTYPES:
                offsets = np.zeros(n + 1, np.int64)  # (rollouts + 1,)
                np.cumsum(np.fromiter(map(len, values), np.int64, n), out=offsets[1:])
                if offsets[-1] > np.iinfo(np.int32).max:
                    raise ShardValidationError(f"{int(offsets[-1])} items of {field.name} in one table; Arrow lists "
                                               "hold at most 2**31 - 1: write fewer groups per shard")
                items = np.fromiter(itertools.chain.from_iterable(values), _LIST_ITEM_DTYPES[field.name],
                                    int(offsets[-1]))  # (total items,)
                arrays.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(items),
                                                       type=field.type))
            else:
                arrays.append(pa.array(values, type=field.type))
        except (OverflowError, ValueError, TypeError, pa.ArrowException) as exc:
            if isinstance(exc, ShardValidationError):
                raise
            raise ShardValidationError(f"column {field.name} does not fit {field.type}: {exc}") from exc
    return pa.Table.from_arrays(arrays, schema=ROLLOUT_ARROW_SCHEMA)


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
    n = table.num_rows
    # a value may change from one row to the next only where a group starts (comparing neighbours: taking
    # each row's group head first cost 4x more, mostly copying strings)
    inside = np.ones(max(n - 1, 0), bool)  # (rows - 1,): row i + 1 is in the same group as row i
    inside[starts[1:] - 1] = False
    for name in GROUP_SHARED_FIELDS:
        if name not in table.column_names or n < 2:
            continue
        column = table.column(name)
        changed = pc.fill_null(pc.not_equal(column.slice(1), column.slice(0, n - 1)), True)
        bad = np.flatnonzero(changed.to_numpy(zero_copy_only=False) & inside)
        if len(bad):
            row = int(bad[0]) + 1
            head = int(starts[np.searchsorted(starts, row, side="right") - 1])
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
    _fail_first(pc.greater_equal(pc.binary_length(col("rollout_id")), 1), table, "rollout_id is empty")
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
    # two reductions, no temporaries (max is NaN if any item is); the per-item test only to name the row
    if len(logprobs_flat) and not (logprobs_flat.max() <= 1e-6 and logprobs_flat.min() > -np.inf):
        lp_ok = (logprobs_flat <= 1e-6) & (logprobs_flat > -np.inf)  # NaN fails both comparisons
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
    # the fields a group shares are now known equal within it: check them on its first row only (8x fewer
    # strings through the regexes), reporting that row
    heads = table.select(["group_id", "dataset", "model_id", "tokenizer_id", "prompt_id"]).take(pa.array(starts))

    def fail_first_group(ok: pa.Array | pa.ChunkedArray, message: str, values=None) -> None:
        ok_rows = np.repeat(pc.fill_null(ok, False).to_numpy(zero_copy_only=False), lengths)  # (rows,)
        _fail_first(ok_rows, table, message, values)

    for name in ("group_id", "dataset", "model_id", "tokenizer_id"):
        fail_first_group(pc.greater_equal(pc.binary_length(heads.column(name)), 1), f"{name} is empty")
    fail_first_group(pc.match_substring_regex(heads.column("prompt_id"), r"^[0-9a-f]{16}$"),
                     "prompt_id must be 16 lowercase hex chars (schemas.prompt_id)", col("prompt_id"))
    fail_first_group(pc.match_substring_regex(heads.column("model_id"), SAFE_NAME.pattern),
                     "model_id must match [A-Za-z0-9._-]+ (it names a directory)", col("model_id"))
    _check_unique_rollout_ids(table)
    _check_advantages(table, starts, lengths)
    return table


def _check_unique_rollout_ids(table: pa.Table) -> None:
    if pc.count_distinct(table.column("rollout_id")).as_py() == table.num_rows:
        return  # unique in the whole table (the usual case), so within each group: 10x cheaper than grouping
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


def write_temporary(directory: Path, write, name: str | None = None) -> Path:
    """Write through `write(path)` to a `.tmp-` name in `directory`, fsync, and drop its pages from the page
    cache (durable, so clean: readers read it from disk); readers never pick up a `.tmp-` name."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (TMP_PREFIX + (name or shard_name()))
    try:
        write(str(tmp))  # a path, not a Python file object: Arrow's native file is ~3x faster for many small pages
        fd = os.open(tmp, os.O_RDONLY)
        try:
            sync_and_drop(fd)
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


def discard(shard: Path) -> None:
    """Delete a shard (final or temporary name) and its lookup file."""
    shard.unlink(missing_ok=True)
    lookup_path(shard.with_name(shard.name.removeprefix(TMP_PREFIX))).unlink(missing_ok=True)


def write_rollout_table(
    directory: Path, table: pa.Table, row_group_rows: int = ROW_GROUP_ROWS, publish_now: bool = True
) -> Path:
    """Write an already validated table of whole groups as one shard in `directory`, and its lookup file.

    Returns the final path, or with `publish_now=False` the temporary one, for `publish` later (compaction
    renames only once it holds the index's write lock).
    """
    starts, lengths = group_runs(table.column("group_id"))
    name = shard_name()
    # the lookup file first: a store that sees the shard finds it ready (it is written back meanwhile)
    lookup = write_lookup_file(lookup_path(directory / name), _table_groups(table, starts, lengths))

    def write(f) -> None:
        with pq.ParquetWriter(
            f, ROLLOUT_ARROW_SCHEMA, compression=_COMPRESSION, use_dictionary=False,
            write_statistics=STATISTICS_COLUMNS, write_page_checksum=True,
        ) as writer:
            fd = os.open(f, os.O_RDONLY)
            try:
                offset = 0
                for rows in row_group_plan(lengths, row_group_rows):
                    writer.write_table(table.slice(offset, rows), row_group_size=rows)
                    offset += rows
                    drop_cached_pages(fd)  # starts writing back the row groups so far: the fsync waits less
            finally:
                os.close(fd)

    try:
        tmp = write_temporary(directory, write, name)
    except BaseException:
        lookup.unlink(missing_ok=True)
        raise
    try:
        drop_written_pages(lookup)
    except BaseException:
        discard(tmp)
        raise
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
        table = groups_table(groups)
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
# lookup files (format in the module docstring)


class LookupFileInvalid(ValueError):
    """A lookup file that is not whole or not of this format version; it gets rebuilt from its shard."""


def lookup_path(shard: Path) -> Path:
    """<root>/lookup/model=<m>/<name>.arrows for the shard <root>/rollouts/model=<m>/<name>.parquet."""
    return shard.parent.parent.parent / LOOKUP_DIR / shard.parent.name / (shard.stem + LOOKUP_SUFFIX)


@functools.lru_cache(maxsize=256)
def _schema_message(metadata: tuple[tuple[str, str], ...]) -> bytes:
    # ~60 us to build (28 fields with descriptions): most responses repeat one, e.g. misses = []
    schema = ROLLOUT_ARROW_SCHEMA.with_metadata({**ROLLOUT_ARROW_SCHEMA.metadata, **dict(metadata)})
    return schema.serialize().to_pybytes()


def arrow_stream(messages: Iterable[bytes], metadata: dict[str, str] | None = None) -> bytes:
    """An Arrow IPC stream of record batch messages in ROLLOUT_ARROW_SCHEMA, with extra schema metadata."""
    schema = _schema_message(tuple(metadata.items())) if metadata else SCHEMA_MESSAGE
    return b"".join([schema, *messages, END_OF_STREAM])


def read_stream(stream: bytes) -> pa.Table:
    """The table of an Arrow IPC stream (zero-copy: its columns point into `stream`)."""
    return pa.ipc.open_stream(pa.py_buffer(stream)).read_all()


def _as_batch(table: pa.Table) -> pa.RecordBatch:
    """A non-empty table as one record batch (copies only columns split into several chunks)."""
    return table.combine_chunks().to_batches()[0]


def _table_groups(table: pa.Table, starts: np.ndarray, lengths: np.ndarray) -> Iterator[tuple[int, pa.RecordBatch]]:
    batch = _as_batch(table)  # slicing a batch costs ~3 us, a table of 28 columns ~13 us
    for start, length in zip(starts.tolist(), lengths.tolist()):
        yield start, batch.slice(start, length)


def _encode_groups(groups: Iterator[tuple[int, pa.RecordBatch]]) -> Iterator[tuple[memoryview, list[tuple[int, ...]]]]:
    """The groups' IPC record batch messages, concatenated about LOOKUP_CHUNK_BYTES at a time, each chunk with
    (first row, rows, message length, CRC-32 of the message) per group.

    An IPC stream writer into memory, one write() per chunk: `RecordBatch.serialize()` and a write() per group
    cost ~1.5x the user CPU and ~2x the kernel CPU for the same bytes.
    """
    while True:
        sink = pa.BufferOutputStream()
        placed: list[tuple[int, int]] = []  # (first row, rows) of each group in this chunk
        ends: list[int] = []  # where each group's message ends in `sink`
        with pa.ipc.new_stream(sink, ROLLOUT_ARROW_SCHEMA) as writer:  # the schema goes out with the first batch
            for row_start, group in groups:
                writer.write_batch(group)
                placed.append((row_start, group.num_rows))
                ends.append(sink.tell())
                if ends[-1] >= LOOKUP_CHUNK_BYTES:
                    break
        if not ends:
            return
        stream = memoryview(sink.getvalue())  # schema message, this chunk's messages, end of stream
        if bytes(stream[:len(SCHEMA_MESSAGE)]) != SCHEMA_MESSAGE:
            raise RuntimeError("pyarrow's IPC stream writer wrote another schema message than SCHEMA_MESSAGE")
        starts = [len(SCHEMA_MESSAGE), *ends[:-1]]
        yield stream[len(SCHEMA_MESSAGE):ends[-1]], [
            (row_start, rows, end - start, zlib.crc32(stream[start:end]))
            for (row_start, rows), start, end in zip(placed, starts, ends)
        ]


def write_lookup_file(path: Path, groups: Iterable[tuple[int, pa.RecordBatch]]) -> Path:
    """Write (first row in the shard, the group's rows) pairs as the lookup file `path`, via a temporary name.

    Its writeback starts at once (`drop_cached_pages`); a writer that will not read it calls
    `drop_written_pages` later, which waits for its data and frees its pages. Neither the rename nor the
    directory is fsynced: a file lost or torn by a crash fails its size or CRC checks and is rebuilt.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}-{path.name}")
    blocks: list[tuple[int, int, int, int, int]] = []
    try:
        with open(tmp, "wb") as f:
            f.write(SCHEMA_MESSAGE)
            offset = len(SCHEMA_MESSAGE)
            for messages, placed in _encode_groups(iter(groups)):
                f.write(messages)
                for row_start, rows, length, crc in placed:
                    blocks.append((row_start, rows, offset, length, crc))
                    offset += length
            f.write(END_OF_STREAM)
            table = np.array(blocks, dtype="<i8").reshape(-1, _BLOCK_FIELDS).tobytes()  # (groups, 5)
            f.write(table)
            f.write(_LOOKUP_TRAILER.pack(len(blocks), zlib.crc32(table), LOOKUP_VERSION, LOOKUP_MAGIC))
            f.flush()
            drop_cached_pages(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _shard_groups(shard: Path, parquet: pq.ParquetFile, starts: np.ndarray,
                  lengths: np.ndarray) -> Iterator[tuple[int, pa.RecordBatch]]:
    """The shard's groups one by one, decoding one row group at a time (a group may span row groups)."""
    pending = ROLLOUT_ARROW_SCHEMA.empty_table()  # rows read and not yet yielded, from file row `pending_start`
    pending_start = 0
    g = 0
    for i in range(parquet.num_row_groups):
        try:
            chunk = conform_table(parquet.read_row_group(i, use_threads=False))
        except (OSError, pa.ArrowException, ShardValidationError) as exc:
            raise ShardReadError(shard, f"row group {i}: {exc}") from exc
        pending = pa.concat_tables([pending, chunk])
        end = pending_start + pending.num_rows
        while g < len(starts) and starts[g] + lengths[g] <= end:
            yield int(starts[g]), _as_batch(pending.slice(int(starts[g]) - pending_start, int(lengths[g])))
            g += 1
        cut = (int(starts[g]) if g < len(starts) else end) - pending_start
        pending, pending_start = pending.slice(cut), pending_start + cut
    if g != len(starts):
        raise ShardReadError(shard, f"{len(starts) - g} groups beyond its row groups")


def rebuild_lookup_file(shard: Path) -> Path:
    """Write a shard's lookup file from the shard; ShardReadError if the shard cannot be read."""
    try:
        parquet = pq.ParquetFile(shard, page_checksum_verification=True)
        starts, lengths = group_runs(parquet.read(columns=["group_id"], use_threads=False).column("group_id"))
    except (OSError, pa.ArrowException, ShardValidationError) as exc:
        raise ShardReadError(shard, str(exc)) from exc
    return write_lookup_file(lookup_path(shard), _shard_groups(shard, parquet, starts, lengths))


class _LookupFile:
    """An open lookup file: its descriptor and block table, ~40 bytes per group (opening one costs ~0.1 ms)."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "rb", buffering=0)  # closed when the last reader lets go of this object
        try:
            if HAS_FADVISE:
                # reads are single groups at random offsets: without this, each miss reads ahead 128 KB or more
                os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            self.blocks = self._read_block_table()  # (groups, 5) int64, ascending row starts
        except BaseException:
            self.file.close()
            raise
        self.row_starts = np.ascontiguousarray(self.blocks[:, 0])  # (groups,)

    def block(self, row_start: int, num_rows: int) -> tuple[int, int, int] | None:
        """(offset, length, crc) of the message of the group of `num_rows` rows at `row_start`, or None."""
        i = int(np.searchsorted(self.row_starts, row_start))
        if i == len(self.row_starts):
            return None
        start, rows, offset, length, crc = self.blocks[i].tolist()
        return (offset, length, crc) if start == row_start and rows == num_rows else None

    def _read_block_table(self) -> np.ndarray:
        fd = self.file.fileno()
        size = os.fstat(fd).st_size
        if size < len(SCHEMA_MESSAGE) + len(END_OF_STREAM) + _LOOKUP_TRAILER.size:
            raise LookupFileInvalid(f"{self.path}: {size} bytes, too short")
        groups, table_crc, version, magic = _LOOKUP_TRAILER.unpack(os.pread(fd, _LOOKUP_TRAILER.size,
                                                                            size - _LOOKUP_TRAILER.size))
        if magic != LOOKUP_MAGIC or version != LOOKUP_VERSION:
            raise LookupFileInvalid(f"{self.path}: not a version-{LOOKUP_VERSION} lookup file")
        table_bytes = groups * _BLOCK_FIELDS * 8
        table_start = size - _LOOKUP_TRAILER.size - table_bytes
        if groups < 0 or table_start < len(SCHEMA_MESSAGE):
            raise LookupFileInvalid(f"{self.path}: block table of {groups} groups does not fit")
        raw = os.pread(fd, table_bytes, table_start)
        if zlib.crc32(raw) != table_crc:
            raise LookupFileInvalid(f"{self.path}: block table checksum mismatch")
        table = np.frombuffer(raw, dtype="<i8").reshape(groups, _BLOCK_FIELDS)
        if ((table[:, 2] < len(SCHEMA_MESSAGE)) | (table[:, 2] + table[:, 3] > table_start)).any():
            raise LookupFileInvalid(f"{self.path}: a block lies outside the file")
        if (np.diff(table[:, 0]) <= 0).any():
            raise LookupFileInvalid(f"{self.path}: row starts not ascending")
        return table


class ShardReader:
    """Reads whole groups of shards from their lookup files (kept open in an LRU), rebuilding any that is
    missing or damaged from its shard. Thread-safe: reads are preads on descriptors that stay open while used.
    """

    def __init__(self, root: Path, max_open_files: int = 256):
        self.root = Path(root)
        self.max_open_files = max_open_files
        self._open: OrderedDict[str, _LookupFile] = OrderedDict()
        self._lock = threading.Lock()
        self._rebuild_lock = threading.Lock()  # rebuilds are rare: one at a time, never two of the same file

    def open(self, rel_path: str) -> _LookupFile:
        """The shard's open lookup file; rebuilt from the shard first if missing or damaged (ShardReadError if
        the shard cannot be read)."""
        with self._lock:
            lookup = self._open.get(rel_path)
            if lookup is not None:
                self._open.move_to_end(rel_path)
                return lookup
        shard = self.root / rel_path
        try:
            lookup = _LookupFile(lookup_path(shard))
        except (FileNotFoundError, LookupFileInvalid):
            with self._rebuild_lock:
                try:  # another thread may have rebuilt it meanwhile
                    lookup = _LookupFile(lookup_path(shard))
                except (FileNotFoundError, LookupFileInvalid):
                    if not shard.exists():
                        raise ShardReadError(shard, "the shard is gone (compacted away or quarantined)") from None
                    lookup = _LookupFile(rebuild_lookup_file(shard))
        with self._lock:
            self._open[rel_path] = lookup
            while len(self._open) > self.max_open_files:
                self._open.popitem(last=False)
        return lookup

    def check(self, rel_path: str, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Make sure the shard's lookup file holds exactly these groups (first row, rows), else rebuild it.

        Raises ShardReadError if the shard cannot be read.
        """
        for attempt in range(2):
            blocks = self.open(rel_path).blocks
            if np.array_equal(blocks[:, 0], starts) and np.array_equal(blocks[:, 1], lengths):
                return
            self.forget(rel_path)  # written for other rows (a writer's bug or a stale file): rebuild from the shard
        raise ShardReadError(self.root / rel_path, "its rebuilt lookup file does not hold the shard's groups")

    def messages(self, locations: list[tuple[str, int, int]]) -> list[bytes]:
        """The IPC record batch message of each whole group (file, row_start, num_rows), in order."""
        blocks = []
        for rel_path, row_start, num_rows in locations:
            lookup = self.open(rel_path)
            block = lookup.block(row_start, num_rows)
            if block is None:
                self.forget(rel_path)
                raise ShardReadError(self.root / rel_path, f"no group of {num_rows} rows at row {row_start} in its "
                                                           "lookup file")
            blocks.append((lookup, block))
        if len(blocks) > 1 and HAS_FADVISE:
            # groups not in the page cache come from disk (writers drop what they write): start all the reads
            # at once, so a 64-prompt lookup waits ~one disk read instead of 64 in a row (~10 ms here)
            for lookup, (offset, length, _) in blocks:
                os.posix_fadvise(lookup.file.fileno(), offset, length, os.POSIX_FADV_WILLNEED)
        found = []
        for (rel_path, row_start, _), (lookup, (offset, length, crc)) in zip(locations, blocks):
            try:
                message = os.pread(lookup.file.fileno(), length, offset)
            except OSError as exc:
                self.forget(rel_path)
                raise ShardReadError(self.root / rel_path, f"reading its lookup file: {exc}") from exc
            if len(message) != length or zlib.crc32(message) != crc:
                self.forget(rel_path)
                raise ShardReadError(self.root / rel_path, f"its lookup file is damaged at row {row_start} "
                                                           "(checksum): it is rebuilt on the next read")
            found.append(message)
        return found

    def read(self, locations: list[tuple[str, int, int]]) -> pa.Table:
        """Rows of whole groups (file, row_start, num_rows), concatenated in order, in ROLLOUT_ARROW_SCHEMA."""
        return read_stream(arrow_stream(self.messages(locations)))

    def forget(self, rel_path: str) -> None:
        """Close the shard's lookup file and delete it: the next read rebuilds it from the shard."""
        with self._lock:
            self._open.pop(rel_path, None)
        lookup_path(self.root / rel_path).unlink(missing_ok=True)
