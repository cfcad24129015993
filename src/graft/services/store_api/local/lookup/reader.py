"""Reading whole groups through the lookup files (`ShardReader`: the store's reads of groups, the hottest path): a
template's record and its pages read with pread, their CRCs checked, the pages decompressed into the template's holes;
a missing or damaged lookup file rebuilt from its shard."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa

from graft.services.store_api.local.durable import HAS_FADVISE
from graft.services.store_api.local.lookup.layout import (
    BLOCK,
    BLOCK_PAGE_COUNTS,
    LOOKUP_MAGIC,
    LOOKUP_TRAILER,
    LOOKUP_VERSION,
    PAGE,
    PAGE_SPAN,
    Block,
    LookupFileInvalid,
    ShardReadError,
    arrow_stream,
    lookup_path,
    read_stream,
)
from graft.services.store_api.local.lookup.rebuild import rebuild_lookup_file
from graft.services.store_api.local.pages import CODECS, PAGE_CODECS

_DECOMPRESSORS = [pa.Codec(codec) if codec and codec in CODECS.values() else None for codec in PAGE_CODECS]
log = logging.getLogger("graft.store")


class LookupFile:
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
        if size < LOOKUP_TRAILER.size:
            raise LookupFileInvalid(f"{self.path}: {size} bytes, too short")
        groups, pages, tables_crc, footer_crc, footer_size, version, magic = LOOKUP_TRAILER.unpack(
            os.pread(fd, LOOKUP_TRAILER.size, size - LOOKUP_TRAILER.size))
        self.footer = (footer_crc, footer_size)  # shard_footer() of the shard it was written for
        if magic != LOOKUP_MAGIC or version != LOOKUP_VERSION:
            raise LookupFileInvalid(f"{self.path}: not a version-{LOOKUP_VERSION} lookup file")
        tables_bytes = (groups * len(BLOCK) + pages * len(PAGE)) * 8
        tables_start = size - LOOKUP_TRAILER.size - tables_bytes
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
        self._open: OrderedDict[str, LookupFile] = OrderedDict()
        self._lock = threading.Lock()
        self._rebuild_lock = threading.Lock()  # rebuilds are rare: one at a time, never two of the same file

    def open(self, rel_path: str) -> LookupFile:
        """The shard's open lookup file; rebuilt from the shard first if missing or damaged (ShardReadError if
        the shard cannot be read)."""
        with self._lock:
            lookup = self._open.get(rel_path)
            if lookup is not None:
                self._open.move_to_end(rel_path)
                return lookup
        shard = self.root / rel_path
        try:
            lookup = LookupFile(lookup_path(shard), shard)
        except (FileNotFoundError, LookupFileInvalid):
            with self._rebuild_lock:
                try:  # another thread may have rebuilt it meanwhile
                    lookup = LookupFile(lookup_path(shard), shard)
                except (FileNotFoundError, LookupFileInvalid):
                    if not shard.exists():
                        raise ShardReadError(shard, "the shard is gone (compacted away or quarantined)") from None
                    lookup = LookupFile(rebuild_lookup_file(shard), shard)
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
        located: list[tuple[LookupFile, Block]] = []
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

    def _splice(self, rel_path: str, row_start: int, lookup: LookupFile, record: bytes, block: Block,
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
