"""Tables of rollouts in ROLLOUT_ARROW_SCHEMA: built from pydantic groups, conformed, validated vectorised.

Owns the rules a stored row must keep, the same as `schemas.Rollout` and `schemas.RolloutGroup` but checked
column by column with pyarrow.compute: `validate_table` is the one check every way in runs before a row is
stored or served (a push, `write_groups`, a shard the store finds in its folder, the lake backend), and
`validate_problems` the same for problems. Also `group_runs`, which finds the groups of a table (each one
contiguous run of rows).
"""

from __future__ import annotations

import collections
import itertools
import operator
import re
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import ValidationError

from graft.schemas import PROBLEM_ARROW_SCHEMA, PROMPT_ID_PATTERN, ROLLOUT_ARROW_SCHEMA, Problem, RolloutGroup
from graft.schemas.rollout import (
    ADDED_COLUMNS,
    ADVANTAGE_EPS,
    ADVANTAGE_TOLERANCE,
    CLOCK_SKEW_S,
    GROUP_ID_PATTERN,
    LOGPROB_TOLERANCE,
    NO_LOGPROBS,
    NULL_LOGPROB_SUM_VERSION,
    SAFE_NAME_PATTERN,
)

SAFE_NAME = re.compile(SAFE_NAME_PATTERN)  # model ids and dataset names become directory names
BULK_COLUMNS = ("completion_text", "completion_token_ids", "token_logprobs")  # ~97% of a row's bytes
# every column but the bulk ones: what the store decodes of a shard its writer validated whole (ingest.py)
SMALL_COLUMNS_SCHEMA = pa.schema([f for f in ROLLOUT_ARROW_SCHEMA if f.name not in BULK_COLUMNS],
                                 metadata=ROLLOUT_ARROW_SCHEMA.metadata)
GROUP_SHARED_FIELDS = (
    "group_id", "prompt_id", "dataset", "model_id", "model_revision", "tokenizer_id", "policy_step", "group_size",
)


class ShardValidationError(ValueError):
    """Rows that break a rule of `schemas.Rollout` / `schemas.RolloutGroup`; the message names the row."""


class ColumnTypeError(ShardValidationError):
    """A column in an Arrow type that does not convert to the schema's; the message names the column."""


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
                nulls = [v is None for v in values] if field.nullable else []
                if any(nulls):
                    values = [[] if v is None else v for v in values]
                offsets = np.zeros(n + 1, np.int64)  # (rollouts + 1,)
                np.cumsum(np.fromiter(map(len, values), np.int64, n), out=offsets[1:])
                if offsets[-1] > np.iinfo(np.int32).max:
                    raise ShardValidationError(f"{int(offsets[-1])} items of {field.name} in one table; Arrow lists "
                                               "hold at most 2**31 - 1: write fewer groups per shard")
                items = np.fromiter(itertools.chain.from_iterable(values), _LIST_ITEM_DTYPES[field.name],
                                    int(offsets[-1]))  # (total items,)
                arrays.append(pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(items),
                                                       type=field.type, mask=pa.array(nulls) if any(nulls) else None))
            else:
                arrays.append(pa.array(values, type=field.type))
        except (OverflowError, ValueError, TypeError, pa.ArrowException) as exc:
            if isinstance(exc, ShardValidationError):
                raise
            raise ShardValidationError(f"column {field.name} does not fit {field.type}: {exc}") from exc
    return pa.Table.from_arrays(arrays, schema=ROLLOUT_ARROW_SCHEMA)


# ----------------------------------------------------------------------------------------------------------
# validation (the same rules as schemas.Rollout and schemas.RolloutGroup, vectorised with pyarrow.compute)


def conform_table(table: pa.Table, schema: pa.Schema = ROLLOUT_ARROW_SCHEMA) -> pa.Table:
    """The table with exactly the columns of `schema`, in order and cast to its types; ColumnTypeError naming a
    column whose type does not cast. A column added to the schema after version 1 (`ADDED_COLUMNS`) that the table
    lacks (rows written before it) is read as null."""
    names = collections.Counter(table.column_names)
    for name in ADDED_COLUMNS:
        if name in schema.names and name not in names:
            table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
            names[name] = 1
    missing = [n for n in schema.names if n not in names]
    extra = [n for n in names if n not in schema.names]
    repeated = sorted(n for n, count in names.items() if count > 1)
    if missing or extra or repeated:
        raise ShardValidationError(
            f"table columns differ from the schema: missing {missing}, unexpected {extra}, repeated {repeated}"
        )
    columns = []
    for field in schema:
        column = table.column(field.name)
        if column.type != field.type:
            if pa.types.is_list_view(column.type) or pa.types.is_large_list_view(column.type):
                # pyarrow 26's cast from a list view to a list drops the last row's items (or reads past the
                # offsets buffer): refused rather than stored wrong
                raise ColumnTypeError(f"column {field.name} has type {column.type}, expected {field.type}: list "
                                      "views are not accepted, send a list")
            try:
                column = column.cast(field.type, safe=True)
                column.validate(full=True)  # a cast's output is trusted by every kernel after it
            except pa.ArrowException as exc:  # no cast for these types, a value that does not fit, ...
                raise ColumnTypeError(
                    f"column {field.name} has type {column.type}, expected {field.type}, and cannot be cast: {exc}"
                ) from exc
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=schema)


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


def validate_table(table: pa.Table, bulk: bool = True) -> pa.Table:
    """Check a table of rollouts against every rule of Rollout and RolloutGroup; return it conformed.

    With `bulk=False` the table has the columns of SMALL_COLUMNS_SCHEMA and the rules on BULK_COLUMNS (token
    ids and logprobs, their lengths, the text's byte length) are left out. Raises ShardValidationError naming
    the first offending row and the rule it breaks.
    """
    schema = ROLLOUT_ARROW_SCHEMA if bulk else SMALL_COLUMNS_SCHEMA
    table = conform_table(table, schema)
    if table.num_rows == 0:
        raise ShardValidationError("no rollouts: a shard holds at least one whole group")
    for field in schema:
        column = table.column(field.name)
        if not field.nullable and column.null_count:
            _fail_first(pc.is_valid(column), table, f"{field.name} is null; only top_k, reward, extracted_answer, "
                        "logprob_sum (without mu) and the prompt columns may be")
        if pa.types.is_list(field.type):
            flat = pc.list_flatten(column)
            if flat.null_count:
                _fail_first_item(column, pc.is_valid(flat).to_numpy(zero_copy_only=False), table,
                                 f"{field.name} holds a null item")
    col = table.column
    _fail_first(pc.greater_equal(col("policy_step"), 0), table, "policy_step must be >= 0", col("policy_step"))
    _fail_first(pc.and_(pc.greater_equal(col("temperature"), 0), pc.is_finite(col("temperature"))), table,
                "temperature must be finite and >= 0", col("temperature"))
    latest = pa.scalar(datetime.now(timezone.utc) + timedelta(seconds=CLOCK_SKEW_S), col("created_at").type)
    _fail_first(pc.less_equal(col("created_at"), latest), table,
                f"created_at is more than {CLOCK_SKEW_S:.0f} s in the future", col("created_at"))
    _fail_first(pc.and_(pc.greater(col("top_p"), 0), pc.less_equal(col("top_p"), 1)), table,
                "top_p must be in (0, 1]", col("top_p"))
    _fail_first(pc.greater(col("max_tokens"), 0), table, "max_tokens must be > 0", col("max_tokens"))
    _fail_first(pc.greater_equal(col("num_tokens"), 0), table, "num_tokens must be >= 0", col("num_tokens"))
    _fail_first(pc.greater_equal(col("num_bytes"), 0), table, "num_bytes must be >= 0", col("num_bytes"))
    _fail_first(pc.greater_equal(col("group_size"), 1), table, "group_size must be >= 1", col("group_size"))
    _fail_first(pc.is_in(col("finish_reason"), pa.array(["stop", "length", "abort"])), table,
                "finish_reason must be 'stop', 'length' or 'abort'", col("finish_reason"))
    without_mu = pc.equal(col("logprobs_mode"), NO_LOGPROBS)
    logprob_sum = col("logprob_sum")
    _fail_first(pc.or_kleene(without_mu, pc.and_(pc.is_finite(logprob_sum), pc.less_equal(logprob_sum, 0))), table,
                "logprob_sum must be finite and <= 0 (and not null) in a row with behaviour logprobs", logprob_sum)
    # without mu: null from version 3 on, 0.0 before (version 2 rows read unchanged)
    nulls_version = pc.greater_equal(col("schema_version"), NULL_LOGPROB_SUM_VERSION)
    unknown_ok = pc.if_else(nulls_version, pc.is_null(logprob_sum), pc.fill_null(pc.equal(logprob_sum, 0.0), False))
    _fail_first(pc.or_(pc.invert(without_mu), unknown_ok), table,
                "logprobs_mode is 'none' (mu unknown) but logprob_sum is not null (schema version 3 on; 0.0 before): a "
                "row without behaviour logprobs stores no logprob_sum and an empty token_logprobs", logprob_sum)
    _fail_first(pc.is_finite(col("advantage")), table, "advantage must be finite", col("advantage"))
    reward = col("reward")
    _fail_first(pc.or_kleene(pc.is_null(reward), pc.and_(pc.greater_equal(reward, 0), pc.less_equal(reward, 1))),
                table, "reward must be in [0, 1] or null", reward)
    correct_expected = pc.fill_null(pc.greater(reward, 0), False)
    _fail_first(pc.equal(col("correct"), correct_expected), table, "correct disagrees with reward (correct means reward > 0)")
    _check_token_ids(table, "prompt_token_ids")
    if bulk:
        _check_bulk_columns(table)
    starts, lengths = group_runs(col("group_id"))
    check_groups(table, starts, lengths)
    without_mu_rows = without_mu.to_numpy(zero_copy_only=False).astype(np.int64)  # (rows,)
    without_mu_count = np.add.reduceat(without_mu_rows, starts)  # (groups,)
    _fail_first(np.repeat((without_mu_count == 0) | (without_mu_count == lengths), lengths), table,
                "the group mixes rows with logprobs_mode 'none' and rows with behaviour logprobs: a group is all "
                "with behaviour logprobs or all without")
    # the fields a group shares are now known equal within it: check them on its first row only (8x fewer
    # strings through the regexes), reporting that row
    heads = table.select(["group_id", "dataset", "model_id", "tokenizer_id", "prompt_id"]).take(pa.array(starts))

    def fail_first_group(ok: pa.Array | pa.ChunkedArray, message: str, values=None) -> None:
        ok_rows = np.repeat(pc.fill_null(ok, False).to_numpy(zero_copy_only=False), lengths)  # (rows,)
        _fail_first(ok_rows, table, message, values)

    for name in ("group_id", "dataset", "model_id", "tokenizer_id"):
        fail_first_group(pc.greater_equal(pc.binary_length(heads.column(name)), 1), f"{name} is empty")
    fail_first_group(pc.match_substring_regex(heads.column("prompt_id"), PROMPT_ID_PATTERN),
                     "prompt_id must be 16 lowercase hex chars (schemas.prompt_id)", col("prompt_id"))
    fail_first_group(pc.match_substring_regex(heads.column("model_id"), SAFE_NAME.pattern),
                     "model_id must match [A-Za-z0-9._-]+ (it names a directory)", col("model_id"))
    fail_first_group(pc.match_substring_regex(heads.column("group_id"), GROUP_ID_PATTERN),
                     "group_id must be 1-128 of [A-Za-z0-9._:-] starting with a letter or digit (it is a URL path "
                     "segment)", col("group_id"))
    # rollout ids derive from group ids, so they are unique in the store wherever group ids are
    position = np.arange(table.num_rows) - np.repeat(starts, lengths)  # (rows,) position in the group
    expected = pc.binary_join_element_wise(col("group_id"), pa.array(position).cast(pa.string()), "-")
    _fail_first(pc.equal(col("rollout_id"), expected), table, "rollout_id must be '<group_id>-<position in the "
                "group>'", col("rollout_id"))
    _check_advantages(table, starts, lengths)
    return table


def _check_bulk_columns(table: pa.Table) -> None:
    """The rules on BULK_COLUMNS: finite logprobs <= 0, token ids >= 0, as many of each as num_tokens, and
    num_bytes the text's UTF-8 length."""
    col = table.column
    logprobs_flat = pc.list_flatten(col("token_logprobs")).to_numpy()  # (total tokens,) float32, no copy
    # two reductions, no temporaries (max is NaN if any item is); the per-item test only to name the row
    if len(logprobs_flat) and not (logprobs_flat.max() <= LOGPROB_TOLERANCE and logprobs_flat.min() > -np.inf):
        _fail_first_item(col("token_logprobs"), (logprobs_flat <= LOGPROB_TOLERANCE) & (logprobs_flat > -np.inf), table,
                         "token_logprobs must be finite and <= 0")  # NaN fails both comparisons
    _check_token_ids(table, "completion_token_ids")
    n_ids = pc.list_value_length(col("completion_token_ids"))
    n_logprobs = pc.list_value_length(col("token_logprobs"))
    without_mu = pc.equal(col("logprobs_mode"), NO_LOGPROBS)
    _fail_first(pc.or_(without_mu, pc.equal(n_ids, n_logprobs)), table,
                "completion_token_ids and token_logprobs must have the same length")
    _fail_first(pc.or_(pc.invert(without_mu), pc.equal(n_logprobs, 0)), table,
                "logprobs_mode is 'none' (mu unknown) but token_logprobs is not empty: a row without behaviour "
                "logprobs stores none (and logprob_sum 0.0)", n_logprobs)
    _fail_first(pc.equal(col("num_tokens"), n_ids), table, "num_tokens must equal len(completion_token_ids)", col("num_tokens"))
    _fail_first(pc.equal(col("num_bytes"), pc.binary_length(col("completion_text"))), table,
                "num_bytes must equal the UTF-8 length of completion_text", col("num_bytes"))


def _check_token_ids(table: pa.Table, name: str) -> None:
    ids_flat = pc.list_flatten(table.column(name)).to_numpy()  # (total tokens,) int32, no copy
    if len(ids_flat) and ids_flat.min() < 0:
        _fail_first_item(table.column(name), ids_flat >= 0, table, f"{name} must be >= 0")


def _fail_first_item(column: pa.ChunkedArray, item_ok: np.ndarray, table: pa.Table, message: str) -> None:
    """Raise naming the row of the first list item where `item_ok` (one bool per flattened item) is false."""
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
    row_of_item = np.repeat(np.arange(table.num_rows), lengths)  # (items,)
    ok = np.ones(table.num_rows, bool)
    ok[row_of_item[np.flatnonzero(~item_ok)[0]]] = False
    _fail_first(ok, table, message)


def validate_problems(table: pa.Table, dataset: str | None = None) -> list[Problem]:
    """The problems of a table in PROBLEM_ARROW_SCHEMA, each checked by `schemas.Problem` (the rules a push's
    problems meet); with `dataset`, all of that dataset. Raises ShardValidationError naming the first bad row."""
    table = conform_table(table, PROBLEM_ARROW_SCHEMA)
    problems = []
    for row, values in enumerate(table.to_pylist()):
        try:
            problem = Problem.model_validate(values)
        except ValidationError as exc:
            raise ShardValidationError(f"problem row {row}: {exc.errors(include_url=False)[0]['msg']}") from exc
        if dataset is not None and problem.dataset != dataset:
            raise ShardValidationError(f"problem row {row}: dataset {problem.dataset!r} in the directory of {dataset!r}")
        problems.append(problem)
    return problems


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

