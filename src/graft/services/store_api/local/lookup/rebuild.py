"""Rebuilding a shard's lookup file from the shard (an indexed, so validated, one), and reading a shard's rows as
tables of whole groups, which the store's ingest does too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from graft.schemas import ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.local.lookup.layout import ShardReadError, lookup_path, shard_footer
from graft.services.store_api.local.lookup.writer import write_lookup_file
from graft.services.store_api.local.pages import Page, PageLayoutError, bulk_pages
from graft.services.store_api.tables import SMALL_COLUMNS_SCHEMA, ShardValidationError, conform_table, group_runs

CHUNK_ROWS = 4096  # rows decoded at a time when a shard is read whole (bounded memory for any foreign file)


def read_whole_groups(shard: Path, parquet: pq.ParquetFile, schema: pa.Schema = ROLLOUT_ARROW_SCHEMA,
                      chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[int, pa.Table]]:
    """The shard's rows in `schema` (ROLLOUT_ARROW_SCHEMA or some of its columns), as (first row, table of whole
    groups) about `chunk_rows` rows at a time; a group may span row groups and batches. ShardReadError if the
    file cannot be decoded."""
    pending = schema.empty_table()  # rows read and not yet yielded, from file row `pending_start`
    pending_start = 0
    present = set(parquet.schema_arrow.names)  # a shard written before a column was added lacks it: conformed as null
    batches = parquet.iter_batches(batch_size=chunk_rows, columns=[n for n in schema.names if n in present],
                                   use_threads=False)
    while True:
        try:
            batch = next(batches, None)
            if batch is not None:
                pending = pa.concat_tables([pending, conform_table(pa.Table.from_batches([batch]), schema)])
        except (OSError, pa.ArrowException, ShardValidationError) as exc:
            raise ShardReadError(shard, f"rows from {pending_start + pending.num_rows}: {exc}") from exc
        if batch is None:
            if pending.num_rows:
                yield pending_start, pending
            return
        ids = pending.column("group_id").combine_chunks()
        changes = np.flatnonzero(pc.not_equal(ids.slice(1), ids.slice(0, len(ids) - 1)).to_numpy(zero_copy_only=False))
        if len(changes) and pending.num_rows >= chunk_rows:
            cut = int(changes[-1]) + 1  # the last group may go on in the next batch: keep it
            yield pending_start, pending.slice(0, cut)
            pending, pending_start = pending.slice(cut), pending_start + cut


def shard_pages(shard: Path, parquet: pq.ParquetFile) -> dict[str, list[Page]] | None:
    """`bulk_pages` of a shard on disk, or None if its bulk columns are laid out otherwise."""
    try:
        with pa.OSFile(str(shard)) as source:
            return bulk_pages(source, parquet.metadata)
    except PageLayoutError:  # laid out otherwise, or its headers garbled: decoding it whole says which
        return None
    except (OSError, pa.ArrowException) as exc:
        raise ShardReadError(shard, f"reading its page headers: {exc}") from exc


def _all_have_pages(pages: dict[str, list[Page]], shard: Path, parquet: pq.ParquetFile) -> bool:
    """Whether every group of the shard starts a page in each bulk column (then `write_lookup_file` needs only
    the small columns; a group whose pages hold other rows too is caught there and the file read whole)."""
    firsts = [{p.first_row for p in column} for column in pages.values()]
    for first_row, chunk in read_whole_groups(shard, parquet, pa.schema([ROLLOUT_ARROW_SCHEMA.field("group_id")]),
                                              16 * CHUNK_ROWS):
        starts, _ = group_runs(chunk.column("group_id"))
        if not all(set((starts + first_row).tolist()) <= f for f in firsts):
            return False
    return True


def rebuild_lookup_file(shard: Path) -> Path:
    """Write a shard's lookup file from the shard, an indexed (so validated) one; ShardReadError if the shard
    cannot be read. Where every group has bulk pages of its own, only the small columns and page headers are read."""
    try:
        parquet = pq.ParquetFile(shard, page_checksum_verification=True)
        footer = shard_footer(shard)
    except (OSError, pa.ArrowException) as exc:
        raise ShardReadError(shard, str(exc)) from exc
    pages = shard_pages(shard, parquet)
    try:
        if pages is not None and _all_have_pages(pages, shard, parquet):
            try:
                small = read_whole_groups(shard, parquet, SMALL_COLUMNS_SCHEMA, 16 * CHUNK_ROWS)
                return write_lookup_file(lookup_path(shard), small, footer, pages, whole=False)
            except PageLayoutError:
                pass
        return write_lookup_file(lookup_path(shard), read_whole_groups(shard, parquet), footer, pages)
    except ShardValidationError as exc:  # a group in separate runs of rows
        raise ShardReadError(shard, str(exc)) from exc

