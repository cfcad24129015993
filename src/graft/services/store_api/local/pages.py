"""Where each group's bulk values lie in a shard, so that lookups read them from the shard itself.

A shard written by `shards.encode_shard` stores the bulk columns (`BULK_COLUMNS`) in Parquet data pages of
version 2 that hold whole groups: each page of `completion_token_ids` and `token_logprobs` holds its rows'
values PLAIN-encoded (exactly an Arrow int32/float32 values buffer once decompressed; version-2 pages keep
the repetition and definition levels outside the compressed values), each page of `completion_text` is
DELTA_LENGTH_BYTE_ARRAY (the lengths, then every string's bytes back to back: an Arrow string data buffer
after the lengths). `bulk_pages` walks the page headers of those columns and says where each page's values
are, so a lookup preads and decompresses only its groups' pages (`lookup/reader.py`), and no second copy of the
bulk data is kept. A column chunk laid out otherwise (version-1 pages, dictionary pages, other encodings, a
codec pyarrow cannot decompress on its own) yields nothing, and its groups are copied whole into the lookup
file as before.

pyarrow reads Parquet files whole or by row group, and exposes neither page headers nor a page reader, so
this module reads the page headers itself (`thrift.py`); and
`message_holes` reads the buffer list of an Arrow IPC record batch message (a flatbuffer), which pyarrow does
not expose either. Both are checked against pyarrow's own output in tests/store/test_store_pages.py.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graft.schemas import ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.local.thrift import read_struct
from graft.services.store_api.tables import BULK_COLUMNS

# pyarrow's names of Parquet codecs (ColumnChunkMetaData.compression: "LZ4" is Parquet's LZ4_RAW, raw LZ4 blocks;
# it names Parquet's deprecated Hadoop-framed LZ4 "UNKNOWN", which is left to the copying path) -> its codec
_PARQUET_CODECS = {"UNCOMPRESSED": None, "ZSTD": "zstd", "LZ4": "lz4_raw", "SNAPPY": "snappy", "GZIP": "gzip",
                   "BROTLI": "brotli"}
PAGE_CODECS = tuple(_PARQUET_CODECS.values())  # numbered in this order in lookup files: never reorder
CODECS = {parquet: arrow for parquet, arrow in _PARQUET_CODECS.items() if arrow is None or pa.Codec.is_available(arrow)}
_DATA_PAGE_V2 = 3
_PLAIN, _DELTA_LENGTH_BYTE_ARRAY = 0, 6
VALUE_ENCODING = {"completion_text": _DELTA_LENGTH_BYTE_ARRAY, "completion_token_ids": _PLAIN, "token_logprobs": _PLAIN}
_HEADER_READ = 256  # bytes read for a page header (a bulk page's is ~35: no statistics); more if it is longer


class PageLayoutError(ValueError):
    """A column chunk not laid out as `bulk_pages` needs: its groups are copied into the lookup file."""


# ------------------------------------------------------------------------------------------ page walk


@dataclass(frozen=True)
class Page:
    """One data page of rows [first_row, first_row + rows) of the shard: its body (levels, then values) at
    [offset, offset + length) of the file, with Parquet's CRC-32 of those bytes; the values start `levels`
    bytes in and are `size` bytes once decompressed with `codec` (None: stored as they are)."""

    first_row: int
    rows: int
    offset: int
    length: int
    levels: int
    size: int
    codec: str | None
    crc: int


def _read_at(source, offset: int, length: int) -> memoryview:
    if isinstance(source, memoryview):
        return source[offset:offset + length]
    return memoryview(source.read_at(length, offset))


def _page_header(source, position: int, end: int, name: str) -> tuple[dict, int]:
    """The page header at `position` of a column chunk ending at `end`, and its length; PageLayoutError if it is
    not a version-2 data page of the encoding `name` needs, with a CRC, or cannot be read (a damaged file)."""
    try:
        try:
            header, start = read_struct(_read_at(source, position, min(_HEADER_READ, end - position)))
        except IndexError:  # a header longer than _HEADER_READ (statistics of long strings)
            header, start = read_struct(_read_at(source, position, end - position))
    except (IndexError, ValueError, struct.error) as exc:
        raise PageLayoutError(f"{name}: no page header at byte {position}: {exc}") from None
    v2 = header.get(8)
    if header.get(1) != _DATA_PAGE_V2 or not isinstance(v2, dict):
        raise PageLayoutError(f"{name}: a page of type {header.get(1)}, not a version-2 data page")
    if v2.get(4) != VALUE_ENCODING[name] or not isinstance(header.get(4), int):
        raise PageLayoutError(f"{name}: encoding {v2.get(4)}, page CRC {header.get(4)}")
    sizes = (header.get(2), header.get(3), v2.get(3), v2.get(5, 0), v2.get(6, 0))
    if not all(isinstance(n, int) and n >= 0 for n in sizes) or position + start + sizes[1] > end \
            or sizes[3] + sizes[4] > min(sizes[0], sizes[1]):
        raise PageLayoutError(f"{name}: a page header at byte {position} with sizes {sizes} that do not fit")
    return header, start


def bulk_pages(source: memoryview | pa.NativeFile, metadata: pq.FileMetaData) -> dict[str, list[Page]]:
    """The data pages of each bulk column, in file order: the Parquet file's bytes (`source`, a memoryview, or
    a file to read headers from); PageLayoutError if a bulk column chunk is not laid out as this module needs
    (the module docstring) or its page headers cannot be read (then pyarrow decodes the file, or says why not)."""
    names = [metadata.schema.column(j).path.split(".")[0] for j in range(metadata.num_columns)]
    pages: dict[str, list[Page]] = {name: [] for name in BULK_COLUMNS}
    first_row = 0
    for g in range(metadata.num_row_groups):
        row_group = metadata.row_group(g)
        for j, name in enumerate(names):
            if name not in pages:
                continue
            chunk = row_group.column(j)
            if chunk.dictionary_page_offset is not None or chunk.compression not in CODECS:
                raise PageLayoutError(f"{name}: {chunk.compression}, dictionary page {chunk.dictionary_page_offset}")
            codec = CODECS[chunk.compression]
            position, end, row = chunk.data_page_offset, chunk.data_page_offset + chunk.total_compressed_size, first_row
            while position < end:
                header, start = _page_header(source, position, end, name)
                v2 = header[8]
                levels = v2.get(5, 0) + v2.get(6, 0)  # repetition and definition levels, before the values
                pages[name].append(Page(row, v2[3], position + start, header[3], levels, header[2] - levels,
                                        codec if v2.get(7, True) else None, header[4] & 0xFFFFFFFF))
                row += v2[3]
                position += start + header[3]
            if row != first_row + row_group.num_rows:
                raise PageLayoutError(f"{name}: pages of row group {g} hold {row - first_row} of its "
                                      f"{row_group.num_rows} rows")
        first_row += row_group.num_rows
    return pages


# ------------------------------------------------------------------------------------------ IPC messages


def _buffer_indices() -> tuple[int, ...]:
    """Index, in an IPC record batch message's buffer list of ROLLOUT_ARROW_SCHEMA, of each bulk column's values
    buffer (string data, list child data); buffers come in schema order, depth first: validity, then offsets for
    strings and lists, then data (strings, primitives) or the child's (lists)."""
    index, found = 0, {}
    for field in ROLLOUT_ARROW_SCHEMA:
        kind = field.type
        if pa.types.is_list(kind):
            index += 2  # validity, offsets
            kind = kind.value_type
            found[field.name] = index + 1  # the child's validity, then its data
            index += 2
        elif pa.types.is_string(kind):
            found[field.name] = index + 2
            index += 3
        elif pa.types.is_null(kind):
            pass
        else:
            index += 2
    return tuple(found[name] for name in BULK_COLUMNS)


BULK_BUFFERS = _buffer_indices()


def _table(b, position: int) -> tuple[int, int, int]:
    """A flatbuffer table at `position`: (position, its vtable's position, the vtable's field count)."""
    vtable = position - struct.unpack_from("<i", b, position)[0]
    return position, vtable, (struct.unpack_from("<H", b, vtable)[0] - 4) // 2


def _field(b, table: tuple[int, int, int], field: int) -> int:
    """Where field `field` of the table is (0: absent)."""
    position, vtable, count = table
    if field >= count:
        return 0
    offset = struct.unpack_from("<H", b, vtable + 4 + 2 * field)[0]
    return position + offset if offset else 0


def _deref(b, position: int) -> int:
    return position + struct.unpack_from("<I", b, position)[0]


def message_buffers(message) -> tuple[int, np.ndarray]:
    """An encapsulated IPC record batch message (continuation, metadata length, Message flatbuffer, body) ->
    (where its body starts, (buffers, 2) int64 array of each buffer's offset in the body and length)."""
    if bytes(message[:4]) != b"\xff\xff\xff\xff":
        raise ValueError("not an encapsulated IPC message")
    metadata_length = struct.unpack_from("<i", message, 4)[0]
    fb = memoryview(message)[8:8 + metadata_length]
    root = _table(fb, _deref(fb, 0))
    header_type = _field(fb, root, 1)
    if not header_type or fb[header_type] != 3:  # MessageHeader.RecordBatch
        raise ValueError("not a record batch message")
    batch = _table(fb, _deref(fb, _field(fb, root, 2)))
    vector = _deref(fb, _field(fb, batch, 2))
    count = struct.unpack_from("<I", fb, vector)[0]
    buffers = np.frombuffer(fb, "<i8", 2 * count, vector + 4).reshape(count, 2)
    return 8 + metadata_length, buffers
