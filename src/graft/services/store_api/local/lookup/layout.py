"""The lookup file's layout: its two tables (`Block`, `PageEntry`: the one definition of their columns, which the
writer writes and the reader names), its trailer, where a shard's lookup file lies, the shard footer it is bound to,
and the Arrow IPC stream that lookups answer with."""

from __future__ import annotations

import functools
import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from graft.schemas import ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.local.pages import PAGE_CODECS

LOOKUP_DIR = "lookup"
LOOKUP_SUFFIX = ".lookup"
LOOKUP_MAGIC = b"GRAFTLK1"
LOOKUP_VERSION = 4  # 4: the rows of schema version 3 (the prompt columns); older files are rebuilt
# groups, pages, CRC-32 of the block and page tables, CRC-32 and size of the shard's Parquet footer, version, magic
LOOKUP_TRAILER = struct.Struct("<qqIIqI8s")


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
SCHEMA_MESSAGE = ROLLOUT_ARROW_SCHEMA.serialize().to_pybytes()  # an IPC stream's first message
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an IPC stream's last 8 bytes


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



def lookup_footer(path: Path) -> tuple[int, int] | None:
    """The shard footer a lookup file is bound to (`shard_footer`), or None if there is no whole lookup file."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < LOOKUP_TRAILER.size:
                return None
            *_, crc, length, version, magic = LOOKUP_TRAILER.unpack(os.pread(f.fileno(), LOOKUP_TRAILER.size,
                                                                              size - LOOKUP_TRAILER.size))
    except OSError:
        return None
    return (crc, length) if magic == LOOKUP_MAGIC and version == LOOKUP_VERSION else None



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

