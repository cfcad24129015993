"""Writing a shard's lookup file: each group's template (its IPC message without the bulk values, and where they go)
or, for a group without pages of its own, a copy of its message; then the block and page tables and the trailer."""

from __future__ import annotations

import os
import uuid
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from graft.schemas import NO_LOGPROBS, ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.local.durable import TMP_PREFIX, drop_cached_pages
from graft.services.store_api.local.lookup.layout import (
    BLOCK,
    CODEC_IDS,
    LOOKUP_MAGIC,
    LOOKUP_TRAILER,
    LOOKUP_VERSION,
    PAGE,
    SCHEMA_MESSAGE,
    Block,
    PageEntry,
)
from graft.services.store_api.local.pages import BULK_BUFFERS, Page, PageLayoutError, message_buffers
from graft.services.store_api.tables import BULK_COLUMNS, group_runs

LOOKUP_CHUNK_BYTES = 1 << 20  # lookup file messages are built in memory and written in chunks of about this size


def _as_batch(table: pa.Table) -> pa.RecordBatch:
    """A non-empty table as one record batch (copies only columns split into several chunks)."""
    return table.combine_chunks().to_batches()[0]


def table_groups(table: pa.Table, starts: np.ndarray, lengths: np.ndarray) -> Iterator[tuple[int, pa.RecordBatch]]:
    batch = _as_batch(table)  # slicing a batch costs ~3 us, a table of 28 columns ~13 us
    for start, length in zip(starts.tolist(), lengths.tolist()):
        yield start, batch.slice(start, length)


class _Zeros:
    """Zero bytes the IPC writer copies where templates' bulk values go (then cut out): one buffer, grown on
    demand (untouched zero pages cost no memory) and sliced."""

    def __init__(self) -> None:
        self.buffer = pa.py_buffer(np.zeros(1 << 20, np.uint8))

    def take(self, size: int) -> pa.Buffer:
        buffer = self.buffer
        if buffer.size < size:
            buffer = self.buffer = pa.py_buffer(np.zeros(max(size, 2 * buffer.size), np.uint8))
        return buffer.slice(0, size)


_ZEROS = _Zeros()


def _zero_based(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def list_lengths(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Items per row of completion_token_ids and of token_logprobs, from the small columns: num_tokens, and none of
    the logprobs of a row without behaviour logprobs (logprobs_mode 'none')."""
    tokens = table.column("num_tokens").to_numpy(zero_copy_only=False).astype(np.int64)  # (rows,)
    without_mu = pc.equal(table.column("logprobs_mode"), NO_LOGPROBS).to_numpy(zero_copy_only=False)  # (rows,)
    return tokens, np.where(without_mu, 0, tokens)


def template_table(table: pa.Table) -> pa.Table:
    """Rows of whole groups with their bulk values zeroed (sizes from `num_tokens`, `num_bytes`, `logprobs_mode`: only
    the small columns are read), so that each group's IPC message has the layout of the real one."""
    n = table.num_rows
    text_offsets = _zero_based(table.column("num_bytes").to_numpy(zero_copy_only=False)).astype(np.int32)
    bulk = {"completion_text": pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(text_offsets),
                                                                       _ZEROS.take(int(text_offsets[-1]))])}
    for name, counts in zip(BULK_COLUMNS[1:], list_lengths(table)):
        offsets = _zero_based(counts).astype(np.int32)
        kind = ROLLOUT_ARROW_SCHEMA.field(name).type
        values = pa.Array.from_buffers(kind.value_type, int(offsets[-1]), [None, _ZEROS.take(4 * int(offsets[-1]))])
        bulk[name] = pa.Array.from_buffers(kind, n, [None, pa.py_buffer(offsets)], children=[values])
    columns = [bulk[f.name] if f.name in bulk else table.column(f.name) for f in ROLLOUT_ARROW_SCHEMA]
    return pa.Table.from_arrays(columns, schema=ROLLOUT_ARROW_SCHEMA)


class _PageIndex:
    """The pages of a shard's bulk columns as arrays, and which of them hold each group exactly."""

    def __init__(self, pages: dict[str, list[Page]]):
        self.columns = []
        for name in BULK_COLUMNS:
            column = pages[name]
            rows = np.array([PageEntry(p.offset, p.length, p.levels, p.size, CODEC_IDS[p.codec], p.crc, 0)
                             for p in column], dtype=np.int64).reshape(-1, len(PAGE))
            firsts = np.array([p.first_row for p in column], np.int64)
            counts = np.array([p.rows for p in column], np.int64)
            self.columns.append((rows, firsts, counts))

    def plan(self, first_row: int, chunk: pa.Table, starts: np.ndarray, lengths: np.ndarray
             ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        """For each group of a chunk of whole groups (from shard row `first_row`): whether its bulk values are
        exactly whole pages in each column, its first page and page count per column, and the value bytes of
        the group per column; and the page table rows (skip filled in) per column."""
        group_starts, group_ends = first_row + starts, first_row + starts + lengths
        per_row = (chunk.column("num_bytes").to_numpy(zero_copy_only=False).astype(np.int64),
                   *(4 * counts for counts in list_lengths(chunk)))  # value bytes per row of each bulk column
        sizes = np.stack([np.add.reduceat(values, starts) if len(starts) else starts for values in per_row], 1)
        ok = np.ones(len(starts), bool)
        firsts, counts, tables = [], [], []
        for c, (rows, page_firsts, page_counts) in enumerate(self.columns):
            values = _zero_based(per_row[c])  # (chunk rows + 1,) bytes of values before each row
            i0 = np.searchsorted(page_firsts, group_starts)
            i1 = np.searchsorted(page_firsts, group_ends)
            last = np.maximum(i1 - 1, 0)
            has = (i1 > i0) & (i0 < len(page_firsts))
            has &= page_firsts[np.minimum(i0, len(page_firsts) - 1)] == group_starts if len(page_firsts) else False
            has &= (page_firsts[last] + page_counts[last] == group_ends) if len(page_firsts) else False
            # value bytes of each page that lies in the chunk, and what precedes them once decompressed (the text's
            # lengths; nothing for the lists)
            local = np.clip(page_firsts - first_row, 0, chunk.num_rows)
            local_end = np.clip(page_firsts + page_counts - first_row, 0, chunk.num_rows)
            skip = rows[:, PAGE.size] - (values[local_end] - values[local])
            table = rows.copy()
            table[:, PAGE.skip] = skip
            bad = (skip < 0) if c == 0 else (skip != 0)
            bad_before = _zero_based(bad.astype(np.int64))  # bad pages before each page index
            has &= bad_before[i1] == bad_before[i0]
            ok &= has
            firsts.append(i0)
            counts.append(i1 - i0)
            tables.append(table)
        return tables, ok, np.stack(firsts, 1), np.stack(counts, 1), sizes


def _encode(batches: Iterator[tuple[int, pa.RecordBatch, object]]) -> Iterator[tuple[memoryview, list[tuple]]]:
    """The batches' IPC record batch messages, about LOOKUP_CHUNK_BYTES at a time: (a chunk of the stream, then
    per batch (first row, rows, start, end of its message in the chunk, what came with it)).

    An IPC stream writer into memory, one write() per chunk: `RecordBatch.serialize()` and a write() per group
    cost ~1.5x the user CPU and ~2x the kernel CPU for the same bytes.
    """
    while True:
        sink = pa.BufferOutputStream()
        placed: list[tuple[int, int, object]] = []
        ends: list[int] = []  # where each group's message ends in `sink`
        with pa.ipc.new_stream(sink, ROLLOUT_ARROW_SCHEMA) as writer:  # the schema goes out with the first batch
            for row_start, batch, extra in batches:
                writer.write_batch(batch)
                placed.append((row_start, batch.num_rows, extra))
                ends.append(sink.tell())
                if ends[-1] >= LOOKUP_CHUNK_BYTES:
                    break
        if not ends:
            return
        stream = memoryview(sink.getvalue())  # schema message, this chunk's messages, end of stream
        if bytes(stream[:len(SCHEMA_MESSAGE)]) != SCHEMA_MESSAGE:
            raise RuntimeError("pyarrow's IPC stream writer wrote another schema message than SCHEMA_MESSAGE")
        starts = [len(SCHEMA_MESSAGE), *ends[:-1]]
        yield stream, [(row_start, rows, start, end, extra)
                       for (row_start, rows, extra), start, end in zip(placed, starts, ends)]


def write_lookup_file(path: Path, chunks: Iterable[tuple[int, pa.Table]], footer: tuple[int, int],
                      pages: dict[str, list[Page]] | None = None, whole: bool = True) -> Path:
    """Write the lookup file `path` of a shard, via a temporary name: `chunks` are (first row in the shard, table
    of whole groups) in row order, `footer` is `shard_footer` of the shard they were validated and written as,
    `pages` its `bulk_pages` (None: copies only). A group whose bulk values are pages of their own gets a
    template, any other a copy; `whole=False` says the chunks hold only the small columns (every group must then
    have its pages: PageLayoutError otherwise).

    Its writeback starts at once (`drop_cached_pages`); a writer that will not read it calls
    `drop_written_pages` later, which waits for its data and frees its pages. Neither the rename nor the
    directory is fsynced: a file lost or torn by a crash fails its size or CRC checks and is rebuilt.
    """
    index = _PageIndex(pages) if pages is not None else None
    page_rows: list[np.ndarray] = []
    page_count = 0

    def planned() -> Iterator[tuple[int, pa.RecordBatch, object]]:
        nonlocal page_count
        for first_row, chunk in chunks:
            starts, lengths = group_runs(chunk.column("group_id"))
            if index is None:
                ok = np.zeros(len(starts), bool)
            else:
                tables, ok, firsts, counts, sizes = index.plan(first_row, chunk, starts, lengths)
            if not whole and not ok.all():
                raise PageLayoutError(f"the group at row {first_row + int(starts[np.argmin(ok)])} has no pages "
                                      "of its own")
            templates = _as_batch(template_table(chunk)) if ok.any() else None
            real = _as_batch(chunk) if not ok.all() else None
            for g, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
                if not ok[g]:
                    yield first_row + start, real.slice(start, length), None
                    continue
                for c in range(len(BULK_COLUMNS)):
                    page_rows.append(tables[c][firsts[g, c]:firsts[g, c] + counts[g, c]])
                extra = (page_count, tuple(counts[g].tolist()), tuple(int(size) for size in sizes[g]))
                page_count += int(counts[g].sum())
                yield first_row + start, templates.slice(start, length), extra

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex[:8]}-{path.name}")
    blocks: list[Block] = []
    try:
        with open(tmp, "wb") as f:
            offset = 0
            for stream, placed in _encode(planned()):
                records = []
                for row_start, rows, start, end, extra in placed:
                    if extra is None:
                        pieces, first, counts, holes = [stream[start:end]], -1, (0, 0, 0), (0, 0, 0)
                    else:
                        first, counts, sizes = extra
                        pieces, holes = _cut_holes(stream[start:end], sizes)
                    length = sum(len(p) for p in pieces)
                    crc = 0
                    for piece in pieces:
                        crc = zlib.crc32(piece, crc)
                    blocks.append(Block(row_start, rows, offset, length, crc, first, *counts, *holes))
                    records.extend(pieces)
                    offset += length
                f.write(b"".join(records))
            pages_table = np.concatenate(page_rows) if page_rows else np.zeros((0, len(PAGE)), np.int64)
            tables = (np.array(blocks, dtype="<i8").reshape(-1, len(BLOCK)).tobytes()
                      + pages_table.astype("<i8").tobytes())
            f.write(tables)
            f.write(LOOKUP_TRAILER.pack(len(blocks), len(pages_table), zlib.crc32(tables), *footer, LOOKUP_VERSION,
                                         LOOKUP_MAGIC))
            f.flush()
            drop_cached_pages(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _cut_holes(message: memoryview, sizes: tuple[int, int, int]) -> tuple[list[memoryview], tuple[int, int, int]]:
    """A template message without its bulk values: its pieces, and where each bulk column's values go in them.
    (pyarrow may write up to 63 more bytes of a sliced buffer than its values: they stay in the template.)"""
    body, buffers = message_buffers(message)
    pieces, holes, at, kept = [], [], 0, 0
    for index, size in zip(BULK_BUFFERS, sizes):
        start, length = body + int(buffers[index, 0]), int(buffers[index, 1])
        if not size <= length < size + 64:
            raise RuntimeError(f"pyarrow wrote a bulk buffer of {length} bytes for {size} bytes of values: the "
                               "template layout no longer matches pyarrow's IPC writer")
        pieces.append(message[at:start])
        kept += start - at
        holes.append(kept)
        at = start + size
    pieces.append(message[at:])
    return pieces, tuple(holes)

