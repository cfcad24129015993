"""Lookup files: what point reads of whole groups are served from, beside each shard. (One module of over 600 lines
on purpose: the writer, the rebuild and the reader share the file's private layout, defined below; split by job,
each part would import the others' private names.)

A lookup answers whole groups as Arrow IPC record batch messages, one per group, behind a schema message: no
Parquet decoding of neighbours, no per-row Python. Every shard has a lookup file,
`<root>/lookup/model=<model_id>/<shard name>.lookup`, holding for each group either

- its **template** (a shard laid out by `shards.encode_shard`, where each group's bulk values are whole Parquet
  data pages of their own, see `pages.py`): the group's IPC message without the values of the bulk columns
  (completion text bytes, token ids, logprobs: ~97% of a row), plus where those pages lie in the shard. A
  lookup preads the template and the pages, checks the pages' own Parquet CRC-32, decompresses them and splices
  their values into the template's three holes. The bulk data is kept once, in the shard; a template costs
  ~0.5 KB per rollout (the message header and the small columns). Or
- a **copy** of its whole IPC message (a shard laid out otherwise: a foreign writer's, one written before this
  format), sent as it is.

Then a block table (per group: row start, rows, record offset, length and CRC-32; for a template its first
page, pages per bulk column and the three holes) and a page table (per page: body offset and length in the
shard, levels length, decompressed size, codec, Parquet's CRC-32, bytes to skip before the values), and a
trailer. `Block` and `PageEntry` below are the one definition of the two tables' columns: the writer writes them,
the reader names its columns by them (`BLOCK`, `PAGE`). Lookup files are derived: the writer writes one before
publishing the shard (it has the table and the encoded file in memory), the store rebuilds a missing or damaged
one from the shard (from its small columns and page headers when every group has pages of its own; whole
otherwise), and they may be deleted at any time.
The trailer records the CRC-32 and size of the shard's Parquet footer: a lookup file is written only from rows
that passed `validate_table`, so a matching footer tells the store that this very shard was checked whole by
its writer (`ingest.py` then decodes only its small columns); any rewrite of the shard changes its footer.
Their directory is not fsynced after the rename: a file lost or torn by a crash fails its size or CRC checks
and is rebuilt; a shard damaged under it fails its pages' CRC checks (and is quarantined, `queries.py`).

Owns the format (writer, rebuild from a shard, table checks), `ShardReader` (the store's reader of whole
groups, through these files) and the Arrow IPC stream helpers the API answers with.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import struct
import threading
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from graft.schemas import NO_LOGPROBS, ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.local.durable import HAS_FADVISE, TMP_PREFIX, drop_cached_pages
from graft.services.store_api.local.pages import (
    BULK_BUFFERS,
    CODECS,
    PAGE_CODECS,
    Page,
    PageLayoutError,
    bulk_pages,
    message_buffers,
)
from graft.services.store_api.tables import (
    BULK_COLUMNS,
    SMALL_COLUMNS_SCHEMA,
    ShardValidationError,
    conform_table,
    group_runs,
)

LOOKUP_DIR = "lookup"
LOOKUP_SUFFIX = ".lookup"
LOOKUP_MAGIC = b"GRAFTLK1"
LOOKUP_VERSION = 4  # 4: the rows of schema version 3 (the prompt columns); older files are rebuilt
# groups, pages, CRC-32 of the block and page tables, CRC-32 and size of the shard's Parquet footer, version, magic
_LOOKUP_TRAILER = struct.Struct("<qqIIqI8s")


class Block(NamedTuple):
    """A row of the block table (int64 each): one group's record in the lookup file. The one definition of the
    table's layout: the writer writes these fields in this order and the reader names its columns by `BLOCK`."""

    row_start: int  # its first row in the shard
    rows: int
    record_offset: int  # where its IPC message (a template or a copy) lies in the lookup file
    record_length: int
    record_crc: int  # CRC-32 of the record
    first_page: int  # its first row of the page table; -1: a copy, no pages
    text_pages: int  # pages of each bulk column (BULK_COLUMNS' order), from first_page on
    token_id_pages: int
    logprob_pages: int
    text_hole: int  # where each bulk column's values go in the template
    token_id_hole: int
    logprob_hole: int

    @property
    def page_counts(self) -> tuple[int, int, int]:
        return self.text_pages, self.token_id_pages, self.logprob_pages

    @property
    def holes(self) -> tuple[int, int, int]:
        return self.text_hole, self.token_id_hole, self.logprob_hole


class PageEntry(NamedTuple):
    """A row of the page table (int64 each): one Parquet data page of a bulk column in the shard."""

    offset: int  # its body's offset and length in the shard
    length: int
    levels: int  # bytes of levels before the values in the body
    size: int  # bytes of the values decompressed
    codec: int  # CODEC_IDS
    crc: int  # Parquet's CRC-32 of the body
    skip: int  # bytes of the decompressed values before the group's (text: the lengths)


BLOCK = Block(*range(len(Block._fields)))  # the block table's column of each field: blocks[:, BLOCK.first_page]
PAGE = PageEntry(*range(len(PageEntry._fields)))  # the page table's column of each field
BLOCK_PAGE_COUNTS = slice(BLOCK.text_pages, BLOCK.logprob_pages + 1)  # the block table's columns of pages per column
PAGE_SPAN = slice(PAGE.offset, PAGE.length + 1)  # the page table's offset and length columns (a view, not a copy)
CODEC_IDS = {codec: i for i, codec in enumerate(PAGE_CODECS)}  # a page's codec in the page table
_DECOMPRESSORS = [pa.Codec(codec) if codec and codec in CODECS.values() else None for codec in PAGE_CODECS]
SCHEMA_MESSAGE = ROLLOUT_ARROW_SCHEMA.serialize().to_pybytes()  # an IPC stream's first message
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an IPC stream's last 8 bytes
LOOKUP_CHUNK_BYTES = 1 << 20  # lookup file messages are built in memory and written in chunks of about this size
log = logging.getLogger("graft.store")


class ShardReadError(OSError):
    """A shard that cannot be read (truncated, corrupt, vanished); `path` is the shard."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot read shard {path}: {reason}")
        self.path = path
        self.reason = reason


class LookupFileInvalid(ValueError):
    """A lookup file that is not whole or not of this format version; it gets rebuilt from its shard."""


def lookup_path(shard: Path) -> Path:
    """<root>/lookup/model=<m>/<name>.lookup for the shard <root>/rollouts/model=<m>/<name>.parquet."""
    return shard.parent.parent.parent / LOOKUP_DIR / shard.parent.name / (shard.stem + LOOKUP_SUFFIX)


@functools.lru_cache(maxsize=256)
def _schema_message(metadata: tuple[tuple[str, str], ...]) -> bytes:
    # ~60 us to build (28 fields with descriptions): most responses repeat one, e.g. misses = []
    schema = ROLLOUT_ARROW_SCHEMA.with_metadata({**ROLLOUT_ARROW_SCHEMA.metadata, **dict(metadata)})
    return schema.serialize().to_pybytes()


def arrow_stream(messages: Iterable, metadata: dict[str, str] | None = None) -> bytes:
    """An Arrow IPC stream of record batch messages (or pieces of them, bytes-like) in ROLLOUT_ARROW_SCHEMA, with
    extra schema metadata."""
    schema = _schema_message(tuple(metadata.items())) if metadata else SCHEMA_MESSAGE
    return b"".join([schema, *messages, END_OF_STREAM])


def read_stream(stream: bytes) -> pa.Table:
    """The table of an Arrow IPC stream (zero-copy: its columns point into `stream`)."""
    return pa.ipc.open_stream(pa.py_buffer(stream)).read_all()


def _as_batch(table: pa.Table) -> pa.RecordBatch:
    """A non-empty table as one record batch (copies only columns split into several chunks)."""
    return table.combine_chunks().to_batches()[0]


def table_groups(table: pa.Table, starts: np.ndarray, lengths: np.ndarray) -> Iterator[tuple[int, pa.RecordBatch]]:
    batch = _as_batch(table)  # slicing a batch costs ~3 us, a table of 28 columns ~13 us
    for start, length in zip(starts.tolist(), lengths.tolist()):
        yield start, batch.slice(start, length)


# ------------------------------------------------------------------------------------------ templates


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
            f.write(_LOOKUP_TRAILER.pack(len(blocks), len(pages_table), zlib.crc32(tables), *footer, LOOKUP_VERSION,
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


def shard_footer(shard: Path | str) -> tuple[int, int]:
    """CRC-32 and length of a Parquet file's footer (its metadata, read from the file's end: a few KB)."""
    with open(shard, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size < 12:
            raise ShardReadError(Path(shard), f"{size} bytes: not a Parquet file")
        f.seek(size - 8)
        length = int.from_bytes(f.read(4), "little")
        if f.read(4) != b"PAR1" or not 0 < length <= size - 12:
            raise ShardReadError(Path(shard), "no Parquet footer at its end")
        f.seek(size - 8 - length)
        return zlib.crc32(f.read(length)), length


CHUNK_ROWS = 4096  # rows decoded at a time when a shard is read whole (bounded memory for any foreign file)


def lookup_footer(path: Path) -> tuple[int, int] | None:
    """The shard footer a lookup file is bound to (`shard_footer`), or None if there is no whole lookup file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < _LOOKUP_TRAILER.size:
                return None
            *_, crc, length, version, magic = _LOOKUP_TRAILER.unpack(os.pread(f.fileno(), _LOOKUP_TRAILER.size,
                                                                              size - _LOOKUP_TRAILER.size))
    except OSError:
        return None
    return (crc, length) if magic == LOOKUP_MAGIC and version == LOOKUP_VERSION else None


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


# ------------------------------------------------------------------------------------------ reading


class _LookupFile:
    """An open lookup file (its descriptor, block and page tables: ~100 bytes per group) and, if it has
    templates, its shard's descriptor; opening one costs ~0.1 ms."""

    def __init__(self, path: Path, shard: Path):
        self.path = path
        self.file = open(path, "rb", buffering=0)  # closed when the last reader lets go of this object
        self.shard = None
        try:
            if HAS_FADVISE:
                # reads are single groups at random offsets: without this, each miss reads ahead 128 KB or more
                os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            # (groups, len(BLOCK)), (pages, len(PAGE)) int64; ascending row starts
            self.blocks, self.pages = self._read_tables()
            if len(self.pages):
                self.shard = open(shard, "rb", buffering=0)
                if HAS_FADVISE:
                    os.posix_fadvise(self.shard.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            self.file.close()
            raise
        self.row_starts = np.ascontiguousarray(self.blocks[:, BLOCK.row_start])  # (groups,)

    def block(self, row_start: int, num_rows: int) -> Block | None:
        """The block table row of the group of `num_rows` rows at `row_start`, or None."""
        i = int(np.searchsorted(self.row_starts, row_start))
        if i == len(self.row_starts):
            return None
        block = Block._make(self.blocks[i].tolist())
        return block if block.row_start == row_start and block.rows == num_rows else None

    def _read_tables(self) -> tuple[np.ndarray, np.ndarray]:
        fd = self.file.fileno()
        size = os.fstat(fd).st_size
        if size < _LOOKUP_TRAILER.size:
            raise LookupFileInvalid(f"{self.path}: {size} bytes, too short")
        groups, pages, tables_crc, footer_crc, footer_size, version, magic = _LOOKUP_TRAILER.unpack(
            os.pread(fd, _LOOKUP_TRAILER.size, size - _LOOKUP_TRAILER.size))
        self.footer = (footer_crc, footer_size)  # shard_footer() of the shard it was written for
        if magic != LOOKUP_MAGIC or version != LOOKUP_VERSION:
            raise LookupFileInvalid(f"{self.path}: not a version-{LOOKUP_VERSION} lookup file")
        tables_bytes = (groups * len(BLOCK) + pages * len(PAGE)) * 8
        tables_start = size - _LOOKUP_TRAILER.size - tables_bytes
        if groups < 0 or pages < 0 or tables_start < 0:
            raise LookupFileInvalid(f"{self.path}: tables of {groups} groups and {pages} pages do not fit")
        raw = os.pread(fd, tables_bytes, tables_start)
        if zlib.crc32(raw) != tables_crc:
            raise LookupFileInvalid(f"{self.path}: block table checksum mismatch")
        blocks = np.frombuffer(raw, dtype="<i8", count=groups * len(BLOCK)).reshape(groups, len(BLOCK))
        page_table = np.frombuffer(raw, dtype="<i8", offset=groups * len(BLOCK) * 8).reshape(pages, len(PAGE))
        offsets, lengths = blocks[:, BLOCK.record_offset], blocks[:, BLOCK.record_length]
        if ((offsets < 0) | (offsets + lengths > tables_start)).any():
            raise LookupFileInvalid(f"{self.path}: a block lies outside the file")
        if (np.diff(blocks[:, BLOCK.row_start]) <= 0).any():
            raise LookupFileInvalid(f"{self.path}: row starts not ascending")
        templates = blocks[:, BLOCK.first_page] >= 0
        if (blocks[templates, BLOCK.first_page] + blocks[templates, BLOCK_PAGE_COUNTS].sum(1) > pages).any():
            raise LookupFileInvalid(f"{self.path}: a group's pages lie outside the page table")
        return blocks, page_table


def _room_for(files: int) -> int:
    """How many lookup files may stay open (each holds its own and its shard's descriptor): `files`, the process's
    soft descriptor limit raised to fit them and 1024 more (sockets, shards being written) where the hard limit
    allows, else as many as fit in three quarters of it. A reopened file costs a read of its tables (~0.1-0.3 ms):
    at 10M rollouts in shards of 8192 there are 1,221 of them, past the 1,024 descriptors Linux gives a process
    by default."""
    try:
        import resource
    except ImportError:  # not Unix
        return files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * files + 1024
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    fit = files if soft == resource.RLIM_INFINITY else max(1, min(files, (soft - min(1024, soft // 4)) // 2))
    if fit < files:
        log.warning("keeping %d lookup files open, not max_open_files=%d: the descriptor limit is %d", fit, files, soft)
    return fit


class ShardReader:
    """Reads whole groups of shards through their lookup files (kept open in an LRU), rebuilding any that is
    missing or damaged from its shard. Thread-safe: reads are preads on descriptors that stay open while used.
    """

    def __init__(self, root: Path, max_open_files: int = 2048):
        self.root = Path(root)
        self.max_open_files = _room_for(max_open_files)
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
            lookup = _LookupFile(lookup_path(shard), shard)
        except (FileNotFoundError, LookupFileInvalid):
            with self._rebuild_lock:
                try:  # another thread may have rebuilt it meanwhile
                    lookup = _LookupFile(lookup_path(shard), shard)
                except (FileNotFoundError, LookupFileInvalid):
                    if not shard.exists():
                        raise ShardReadError(shard, "the shard is gone (compacted away or quarantined)") from None
                    lookup = _LookupFile(rebuild_lookup_file(shard), shard)
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
            if np.array_equal(blocks[:, BLOCK.row_start], starts) and np.array_equal(blocks[:, BLOCK.rows], lengths):
                return
            self.forget(rel_path)  # written for other rows (a writer's bug or a stale file): rebuild from the shard
        raise ShardReadError(self.root / rel_path, "its rebuilt lookup file does not hold the shard's groups")

    def messages(self, locations: list[tuple[str, int, int]]) -> list:
        """The IPC record batch messages of whole groups (file, row_start, num_rows), in order, as bytes-like
        pieces to be joined (`arrow_stream`)."""
        located: list[tuple[_LookupFile, Block]] = []
        for rel_path, row_start, num_rows in locations:
            lookup = self.open(rel_path)
            block = lookup.block(row_start, num_rows)
            if block is None:
                self.forget(rel_path)
                raise ShardReadError(self.root / rel_path, f"no group of {num_rows} rows at row {row_start} in its "
                                                           "lookup file")
            located.append((lookup, block))
        if HAS_FADVISE and (len(located) > 1 or located and located[0][1].first_page >= 0):
            # groups not in the page cache come from disk (writers drop what they write): start all the reads
            # at once (a template and its pages are 4 reads), so a 64-prompt lookup waits ~one disk read instead
            # of 64 in a row (~10 ms here)
            for lookup, block in located:
                os.posix_fadvise(lookup.file.fileno(), block.record_offset, block.record_length, os.POSIX_FADV_WILLNEED)
                if block.first_page >= 0:
                    group_pages = lookup.pages[block.first_page:block.first_page + sum(block.page_counts)]
                    for offset, length in group_pages[:, PAGE_SPAN].tolist():
                        os.posix_fadvise(lookup.shard.fileno(), offset, length, os.POSIX_FADV_WILLNEED)
        pieces: list = []
        for (rel_path, row_start, _), (lookup, block) in zip(locations, located):
            try:
                record = os.pread(lookup.file.fileno(), block.record_length, block.record_offset)
            except OSError as exc:
                self.forget(rel_path)
                raise ShardReadError(self.root / rel_path, f"reading its lookup file: {exc}") from exc
            if len(record) != block.record_length or zlib.crc32(record) != block.record_crc:
                self.forget(rel_path)
                raise ShardReadError(self.root / rel_path, f"its lookup file is damaged at row {row_start} "
                                                           "(checksum): it is rebuilt on the next read")
            if block.first_page < 0:
                pieces.append(record)
            else:
                self._splice(rel_path, row_start, lookup, record, block, pieces)
        return pieces

    def _splice(self, rel_path: str, row_start: int, lookup: _LookupFile, record: bytes, block: Block,
                pieces: list) -> None:
        """A template's pieces with its group's bulk values read from the shard's pages in their holes."""
        view = memoryview(record)
        at = 0
        fd = lookup.shard.fileno()
        first, counts = block.first_page, block.page_counts
        pages = iter(lookup.pages[first:first + sum(counts)].tolist())
        for count, hole in zip(counts, block.holes):
            pieces.append(view[at:hole])
            at = hole
            # a page row unpacked in PageEntry's field order (a NamedTuple per page costs ~10% of a lookup's CPU;
            # tests/store/test_store_pages.py pins the order)
            for offset, length, levels, size, codec, crc, skip in itertools.islice(pages, count):
                try:
                    body = os.pread(fd, length, offset)
                    if len(body) != length or zlib.crc32(body) != crc:
                        raise ValueError("a data page's checksum does not match")
                    values = memoryview(body)[levels:]
                    if codec:
                        if _DECOMPRESSORS[codec] is None:
                            raise ValueError(f"pyarrow here cannot decompress {PAGE_CODECS[codec]}")
                        values = _DECOMPRESSORS[codec].decompress(values, size)
                    if len(values) != size:
                        raise ValueError(f"a data page holds {len(values)} bytes of values, not {size}")
                except (OSError, ValueError, pa.ArrowException) as exc:
                    # the shard itself (its own CRC says so): it is quarantined if it fails again (read_selected)
                    self.forget(rel_path)
                    raise ShardReadError(self.root / rel_path, f"group at row {row_start}: {exc}") from exc
                pieces.append(memoryview(values)[skip:])
        pieces.append(view[at:])

    def read(self, locations: list[tuple[str, int, int]]) -> pa.Table:
        """Rows of whole groups (file, row_start, num_rows), concatenated in order, in ROLLOUT_ARROW_SCHEMA."""
        return read_stream(arrow_stream(self.messages(locations)))

    def forget(self, rel_path: str) -> None:
        """Close the shard's lookup file and delete it: the next read rebuilds it from the shard."""
        with self._lock:
            self._open.pop(rel_path, None)
        lookup_path(self.root / rel_path).unlink(missing_ok=True)
