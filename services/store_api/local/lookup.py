"""Lookup files: the per-group Arrow IPC copies of each shard that point reads are served from.

Point reads do not decode Parquet. Decoding is what a lookup cost: ~0.5 ms of CPU for the 64-row row group
holding one 8-row group, and row groups of one group made writing 4x slower and footers 8x bigger. So every
shard has a lookup file, `<root>/lookup/model=<model_id>/<shard name>.arrows`: an Arrow IPC stream with one
record batch per group (all columns), then a block table (row start, rows, byte offset, length, CRC-32 of
each group's message) and a trailer. A lookup preads its groups' messages and sends them behind a schema
message as the response stream: no decoding, no re-encoding (~25 us per group). Lookup files are derived:
the writer writes one just before publishing the shard (it has the table in memory; the store would have to
decode the shard), the store rebuilds a missing or damaged one from the shard, and they may be deleted at any
time. The trailer records the CRC-32 and size of the shard's Parquet footer: a lookup file is written only from
rows that passed `validate_table`, so a matching footer tells the store that this very shard was checked whole
by its writer (`ingest.py` then decodes only its small columns); any rewrite of the shard changes its footer. Their directory is not fsynced after the rename: a file lost or torn by a crash fails its size or CRC
checks and is rebuilt.

Owns the format (writer, rebuild from a shard, block table checks), `ShardReader` (the store's reader of
whole groups, through these files) and the Arrow IPC stream helpers the API answers with.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import ROLLOUT_ARROW_SCHEMA
from services.store_api.local.durable import HAS_FADVISE, TMP_PREFIX, drop_cached_pages
from services.store_api.tables import ShardValidationError, conform_table, group_runs

LOOKUP_DIR = "lookup"
LOOKUP_SUFFIX = ".arrows"
LOOKUP_MAGIC = b"GRAFTLK1"
LOOKUP_VERSION = 2
# groups, CRC-32 of the block table, CRC-32 and size of the shard's Parquet footer, format version, magic
_LOOKUP_TRAILER = struct.Struct("<qIIqI8s")
_FOOTER_FIELDS = struct.Struct("<Iq")  # the footer's CRC-32 and size, 12 bytes into the trailer
UNBOUND = (0, 0)  # no shard's footer: a lookup file not (yet) bound to its shard
_BLOCK_FIELDS = 5  # block table columns (int64): row start, rows, message offset, message length, CRC-32
SCHEMA_MESSAGE = ROLLOUT_ARROW_SCHEMA.serialize().to_pybytes()  # an IPC stream's first message
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an IPC stream's last 8 bytes
LOOKUP_CHUNK_BYTES = 1 << 20  # lookup file messages are built in memory and written in chunks of about this size


class ShardReadError(OSError):
    """A shard that cannot be read (truncated, corrupt, vanished); `path` is the shard."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot read shard {path}: {reason}")
        self.path = path
        self.reason = reason


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


def table_groups(table: pa.Table, starts: np.ndarray, lengths: np.ndarray) -> Iterator[tuple[int, pa.RecordBatch]]:
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


def write_lookup_file(path: Path, groups: Iterable[tuple[int, pa.RecordBatch]], footer: tuple[int, int]) -> Path:
    """Write (first row in the shard, the group's rows) pairs as the lookup file `path`, via a temporary name;
    `footer` is `shard_footer` of the shard they were validated and written as.

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
            f.write(_LOOKUP_TRAILER.pack(len(blocks), zlib.crc32(table), *footer, LOOKUP_VERSION, LOOKUP_MAGIC))
            f.flush()
            drop_cached_pages(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


CHUNK_ROWS = 4096  # rows decoded at a time when a shard is read whole (bounded memory for any foreign file)


def lookup_footer(path: Path) -> tuple[int, int] | None:
    """The shard footer a lookup file is bound to (`shard_footer`), or None if there is no whole lookup file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < _LOOKUP_TRAILER.size:
                return None
            _, _, crc, length, version, magic = _LOOKUP_TRAILER.unpack(os.pread(f.fileno(), _LOOKUP_TRAILER.size,
                                                                                size - _LOOKUP_TRAILER.size))
    except OSError:
        return None
    return (crc, length) if magic == LOOKUP_MAGIC and version == LOOKUP_VERSION else None


def bind_lookup_file(path: Path, footer: tuple[int, int]) -> None:
    """Record in a lookup file's trailer the `shard_footer` of the shard it was written for."""
    with open(path, "r+b") as f:
        trailer = f.seek(0, os.SEEK_END) - _LOOKUP_TRAILER.size
        os.pwrite(f.fileno(), _FOOTER_FIELDS.pack(*footer), trailer + 12)


def read_whole_groups(shard: Path, parquet: pq.ParquetFile, schema: pa.Schema = ROLLOUT_ARROW_SCHEMA,
                      chunk_rows: int = CHUNK_ROWS) -> Iterator[tuple[int, pa.Table]]:
    """The shard's rows in `schema` (ROLLOUT_ARROW_SCHEMA or some of its columns), as (first row, table of whole
    groups) about `chunk_rows` rows at a time; a group may span row groups and batches. ShardReadError if the
    file cannot be decoded."""
    pending = schema.empty_table()  # rows read and not yet yielded, from file row `pending_start`
    pending_start = 0
    batches = parquet.iter_batches(batch_size=chunk_rows, columns=schema.names, use_threads=False)
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


def groups_of(chunks: Iterable[tuple[int, pa.Table]]) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first row in the shard, rows) of each group of chunks of whole groups, for `write_lookup_file`."""
    for first_row, chunk in chunks:
        starts, lengths = group_runs(chunk.column("group_id"))
        for start, batch in table_groups(chunk, starts, lengths):
            yield first_row + start, batch


def rebuild_lookup_file(shard: Path) -> Path:
    """Write a shard's lookup file from the shard, an indexed (so validated) one; ShardReadError if the shard
    cannot be read."""
    try:
        parquet = pq.ParquetFile(shard, page_checksum_verification=True)
        footer = shard_footer(shard)
    except (OSError, pa.ArrowException) as exc:
        raise ShardReadError(shard, str(exc)) from exc
    try:
        return write_lookup_file(lookup_path(shard), groups_of(read_whole_groups(shard, parquet)), footer)
    except ShardValidationError as exc:  # a group in separate runs of rows
        raise ShardReadError(shard, str(exc)) from exc


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
        groups, table_crc, footer_crc, footer_size, version, magic = _LOOKUP_TRAILER.unpack(
            os.pread(fd, _LOOKUP_TRAILER.size, size - _LOOKUP_TRAILER.size))
        self.footer = (footer_crc, footer_size)  # shard_footer() of the shard it was written for
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
