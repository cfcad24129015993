"""Parquet shards: where they live and how they are written (the generators' `write_groups`).

A shard is `<root>/rollouts/model=<model_id>/part-<utc time>-<host>-<pid>-<uuid>.parquet`, written in
`<root>/.tmp/`, fsynced, then renamed into place, so readers only ever see whole files. It holds
whole groups of one model, in `ROLLOUT_ARROW_SCHEMA`: the source of truth, read by DuckDB and by anyone.
Row groups hold whole groups and about `ROW_GROUP_ROWS` rows. The bulk columns' data pages (version 2) hold
whole groups too, the greatest common divisor of the groups' sizes in rows (8 for groups of 8), so that lookups
read a group's bulk values (text, token ids, logprobs: `BULK_COLUMNS` in tables.py) from its own pages in the
shard (`pages.py`, `lookup/`) and no second copy of them is kept; the other columns keep pyarrow's own pages
(`splice.py`). Only the bulk columns are compressed (decompressing many small pages of the small columns cost
more than it saved), with `BULK_CODEC`; text is DELTA_LENGTH_BYTE_ARRAY (its page is then an Arrow string data
buffer after the lengths), the lists PLAIN. `encode_shard` writes them (the lake's writers use it too); each
shard's lookup file (`lookup/writer.py`) is written from the file's page headers, read back while still in the page
cache, just before the shard is published, bound to the shard's footer. Problems go once per dataset to
`<root>/prompts/dataset=<name>/`. Validation lives in `tables.py`, atomic files in `durable.py`.
"""

from __future__ import annotations

import functools
import math
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

from graft.schemas import PROBLEM_ARROW_SCHEMA, Problem, RolloutGroup
from graft.services.store_api.local.durable import (
    Pending,
    drop_cached_pages,
    drop_written_pages,
    publish,
    write_temporary,
)
from graft.services.store_api.local.lookup import lookup_path, shard_footer, write_lookup_file
from graft.services.store_api.local.pages import PageLayoutError, bulk_pages
from graft.services.store_api.local.splice import footer_span, splice_footer
from graft.services.store_api.tables import (
    BULK_COLUMNS,
    SAFE_NAME,
    SMALL_COLUMNS_SCHEMA,
    ShardValidationError,
    group_runs,
    groups_table,
    validate_table,
)

# target rows per Parquet row group (whole groups only; a bigger group gets its own). Lookups never decode
# row groups, so they are sized for writing: 1024 rows cost 11 us/rollout to write, 64 rows cost 22 us.
ROW_GROUP_ROWS = 1024
STATISTICS_COLUMNS = ["prompt_id", "policy_step"]  # min/max per row group: prunes scans of prompt-sorted files
# of the bulk columns' pages: LZ4 (Parquet's LZ4_RAW) decompresses at ~2.5 GB/s here, zstd at ~0.8 GB/s, below the
# ~1.9 GB/s at which this machine reads and sends a lookup's bytes from the page cache; zstd's shards are 18-27%
# smaller (benchmarks/RESULTS.md, "The store at the size of a real run"); lookups read pages of either

BULK_CODEC = "lz4"
PAGE_BYTES_MAX = 1 << 30  # pages are cut by rows (whole groups), never by size
WRITE_BUFFER_BYTES = 1 << 20


def _write_part(table: pa.Table, sink, plan: list[int], **options) -> None:
    with pq.ParquetWriter(sink, table.schema, use_dictionary=False, write_page_checksum=True, **options) as writer:
        offset = 0
        for rows in plan:
            writer.write_table(table.slice(offset, rows), row_group_size=rows)
            offset += rows


def encode_shard(table: pa.Table, lengths: np.ndarray, sink: str | pa.NativeFile, row_group_rows: int = ROW_GROUP_ROWS,
                 statistics: list[str] = STATISTICS_COLUMNS) -> None:
    """Write a validated table of whole groups (of sizes `lengths`, in order) to `sink` (a path, or an Arrow stream)
    as a Parquet file laid out for lookups (the module docstring): row groups of whole groups, the bulk columns'
    pages of whole groups, the other columns' pages as pyarrow cuts them (`splice.py`)."""
    plan = row_group_plan(lengths, row_group_rows)
    small = pa.BufferOutputStream()  # ~0.3 KB a rollout
    _write_part(table.select(SMALL_COLUMNS_SCHEMA.names), small, plan, compression="none", write_statistics=statistics)
    small = small.getvalue()
    small_start, small_length = footer_span(small)
    page_rows = math.gcd(*lengths.tolist()) if len(lengths) else 1
    bulk_options = dict(compression=BULK_CODEC, write_statistics=False, data_page_version="2.0",
                        data_page_size=PAGE_BYTES_MAX, max_rows_per_page=page_rows,
                        column_encoding={"completion_text": "DELTA_LENGTH_BYTE_ARRAY"})
    bulk_table = table.select(list(BULK_COLUMNS))
    if isinstance(sink, str):
        # buffered: pages of a group are small, and an unbuffered file costs a write() per page header and page
        with pa.output_stream(sink, buffer_size=WRITE_BUFFER_BYTES) as out:
            _write_part(bulk_table, out, plan, **bulk_options)
        with open(sink, "r+b") as f:  # the small columns' chunks and the whole file's footer replace the bulk footer
            size = f.seek(0, os.SEEK_END)
            f.seek(size - 8)
            length = int.from_bytes(f.read(4), "little")
            f.seek(size - 8 - length)
            bulk_footer = f.read(length)
            f.seek(size - 8 - length)
            f.truncate()
            _append_small(f, size - 8 - length, bulk_footer, small, small_start, small_length)
        return
    bulk = pa.BufferOutputStream()
    _write_part(bulk_table, bulk, plan, **bulk_options)
    bulk = bulk.getvalue()
    bulk_start, bulk_length = footer_span(bulk)
    sink.write(bulk[:bulk_start])
    _append_small(sink, bulk_start, bulk[bulk_start:bulk_start + bulk_length], small, small_start, small_length)


def _append_small(out, at: int, bulk_footer, small: pa.Buffer, small_start: int, small_length: int) -> None:
    """Write the small columns' chunks at byte `at` of the file being made, then its footer, length and magic."""
    out.write(small[4:small_start])  # after the small file's leading magic
    footer = splice_footer(bulk_footer, small[small_start:small_start + small_length], at - 4)
    out.write(footer)
    out.write(len(footer).to_bytes(4, "little") + b"PAR1")


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
    encoded: bytes | pa.Buffer | None = None,
) -> Path | Pending:
    """Write an already validated table of whole groups as one shard in `directory`, and its lookup file.

    `encoded`: the same rows already encoded as Parquet in ROLLOUT_ARROW_SCHEMA (a lake data file graft's writers
    wrote, which a replica caches), stored as they are. Returns the final path, or with `publish_now=False` the
    Pending file, for `publish` later (the store renames only once it holds the index's write lock).
    """
    _, lengths = group_runs(table.column("group_id"))
    name = shard_name()
    lookup = lookup_path(directory / name)

    def write(path: str) -> None:
        if encoded is None:
            encode_shard(table, lengths, path, row_group_rows)
        else:
            with open(path, "wb") as f:
                f.write(encoded)
        fd = os.open(path, os.O_RDONLY)
        try:
            drop_cached_pages(fd)  # starts its writeback; pages being written back stay cached for what follows
        finally:
            os.close(fd)
        # the lookup file, from the file's page headers (read from the page cache) and the table: written before the
        # shard is published, so a store that sees the shard finds it ready
        with pa.memory_map(path) as source:
            try:
                pages = bulk_pages(source, pq.ParquetFile(source).metadata)
            except PageLayoutError:  # a lake data file laid out otherwise: its groups are copied into the lookup file
                pages = None
        write_lookup_file(lookup, [(0, table)], shard_footer(path), pages)

    try:
        tmp = write_temporary(directory / name, write)
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

