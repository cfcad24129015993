"""Parquet shards: where they live and how they are written (the generators' `write_groups`).

A shard is `<root>/rollouts/model=<model_id>/part-<utc time>-<host>-<pid>-<uuid>.parquet`, written in
`<root>/.tmp/`, fsynced, then renamed into place, so readers only ever see whole files. It holds
whole groups of one model, in `ROLLOUT_ARROW_SCHEMA`: the source of truth, read by DuckDB and by anyone.
Row groups hold whole groups and about `ROW_GROUP_ROWS` rows; only the bulk columns (text, token ids,
logprobs, `BULK_COLUMNS` in tables.py) are zstd-compressed (decompressing many small zstd pages of the small columns cost more than it
saved), at level 1: the cheapest level that compresses (negative levels skip entropy coding and saved ~1%).
Each shard's lookup file (`lookup.py`) is written just before the shard is published, bound to the shard's
footer. Problems go once per
dataset to `<root>/prompts/dataset=<name>/`. Validation lives in `tables.py`, atomic files in `durable.py`.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import uuid
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import PROBLEM_ARROW_SCHEMA, ROLLOUT_ARROW_SCHEMA, Problem, RolloutGroup
from services.store_api.local.durable import Pending, drop_cached_pages, drop_written_pages, publish, write_temporary
from services.store_api.local.lookup import (
    UNBOUND,
    bind_lookup_file,
    lookup_path,
    shard_footer,
    table_groups,
    write_lookup_file,
)
from services.store_api.tables import (
    BULK_COLUMNS,
    SAFE_NAME,
    ShardValidationError,
    group_runs,
    groups_table,
    validate_table,
)

# target rows per Parquet row group (whole groups only; a bigger group gets its own). Lookups never decode
# row groups, so they are sized for writing: 1024 rows cost 11 us/rollout to write, 64 rows cost 22 us.
ROW_GROUP_ROWS = 1024
STATISTICS_COLUMNS = ["prompt_id", "policy_step"]  # min/max per row group: prunes scans of prompt-sorted files
# per-column codecs are keyed by Parquet leaf path: a list column's leaf is "<name>.list.element"
COMPRESSION = {
    (f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name): ("zstd" if f.name in BULK_COLUMNS else "none")
    for f in ROLLOUT_ARROW_SCHEMA
}


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


def discard(shard: Path | Pending) -> None:
    """Delete a shard (published, or still pending) and its lookup file."""
    if isinstance(shard, Pending):
        shard.tmp.unlink(missing_ok=True)
        shard = shard.final
    shard.unlink(missing_ok=True)
    lookup_path(shard).unlink(missing_ok=True)


def write_rollout_table(
    directory: Path, table: pa.Table, row_group_rows: int = ROW_GROUP_ROWS, publish_now: bool = True,
    encoded: bytes | None = None,
) -> Path | Pending:
    """Write an already validated table of whole groups as one shard in `directory`, and its lookup file.

    `encoded`: the same rows already encoded as Parquet in ROLLOUT_ARROW_SCHEMA (a lake data file graft's writers
    wrote, which a replica caches), stored as they are. Returns the final path, or with `publish_now=False` the
    Pending file, for `publish` later (the store renames only once it holds the index's write lock).
    """
    starts, lengths = group_runs(table.column("group_id"))
    name = shard_name()
    # the lookup file first: a store that sees the shard finds it ready (it is written back meanwhile); it is
    # bound to the shard's footer once the shard is written, which tells the store this shard was checked whole
    lookup = write_lookup_file(lookup_path(directory / name), table_groups(table, starts, lengths), UNBOUND)

    def write(f) -> None:
        if encoded is not None:
            with open(f, "wb") as out:
                out.write(encoded)
            return
        with pq.ParquetWriter(
            f, ROLLOUT_ARROW_SCHEMA, compression=COMPRESSION, use_dictionary=False,
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
        tmp = write_temporary(directory / name, write)
    except BaseException:
        lookup.unlink(missing_ok=True)
        raise
    try:
        bind_lookup_file(lookup, shard_footer(tmp.tmp))
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
        write = functools.partial(pq.write_table, table, compression="zstd")
        paths.append(publish(write_temporary(directory / shard_name(), write)))
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

