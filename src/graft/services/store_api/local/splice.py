"""One Parquet file from two of the same row groups: the bulk columns with pages of whole groups, the others with
pages of ~1024 rows.

Lookups read a group's bulk values from pages of their own (`pages.py`), so the bulk columns need data pages
that hold whole groups: 8 rows for groups of 8. pyarrow cuts pages by rows only for a whole file
(`max_rows_per_page`), and 8-row pages of the 25 small columns made DuckDB's scans of them 5-17x slower, their
decoding by the store ~2 us per rollout dearer and the shards' writing ~2 us per rollout dearer (benchmarks/
RESULTS.md, "The store at the size of a real run"). So `shards.encode_shard` has pyarrow write the bulk columns
and the small columns as two files with the same row groups, and `splice_footer` makes the footer of one file
holding both: the bulk file's column chunks where pyarrow wrote them, then the small file's chunks appended
after them (column chunks may lie anywhere in a Parquet file: every reader finds them by their offsets), and
the schema, key-value metadata and column orders of an empty file of the whole schema. The footer is read and
written with its fields' types kept (`thrift.py`), so every field pyarrow wrote is written back as it was.
"""

from __future__ import annotations

import functools

import pyarrow as pa
import pyarrow.parquet as pq

from graft.schemas import ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.local.thrift import decode_struct, encode_struct
from graft.services.store_api.tables import BULK_COLUMNS

_I16, _I64, _STRUCT, _LIST = 4, 6, 12, 9
# FileMetaData: row_groups, num_rows; RowGroup: columns, total_byte_size, num_rows, file_offset,
# total_compressed_size, ordinal; ColumnChunk: file_offset, meta_data and the offsets of its indexes;
# ColumnMetaData: the offsets of its pages and bloom filter
_ROW_GROUPS, _NUM_ROWS = 4, 3
_COLUMNS, _BYTE_SIZE, _RG_ROWS, _RG_OFFSET, _RG_COMPRESSED, _ORDINAL = 1, 2, 3, 5, 6, 7
_CHUNK_OFFSETS, _META = (2, 4, 6), 3  # file_offset, offset_index_offset, column_index_offset
_META_OFFSETS = (9, 10, 11, 14)  # data_page_offset, index_page_offset, dictionary_page_offset, bloom_filter_offset


# ------------------------------------------------------------------------------------------ footers


def footer_span(data) -> tuple[int, int]:
    """(start, length) of a Parquet file's footer (its FileMetaData) in its bytes."""
    length = int.from_bytes(data[-8:-4], "little")
    if bytes(data[-4:]) != b"PAR1" or not 0 < length <= len(data) - 12:
        raise ValueError("no Parquet footer at the end")
    return len(data) - 8 - length, length


def _get(fields: list[list], field: int) -> list | None:
    return next((f for f in fields if f[0] == field), None)


def _set(fields: list[list], field: int, kind: int, value) -> None:
    found = _get(fields, field)
    if found is None:
        fields.append([field, kind, value])
        fields.sort(key=lambda f: f[0])
    else:
        found[1], found[2] = kind, value


@functools.cache
def _whole_schema_footer() -> bytes:
    """The footer of an empty file of ROLLOUT_ARROW_SCHEMA: its schema, key-value metadata (the Arrow schema)
    and column orders are those of every shard."""
    sink = pa.BufferOutputStream()
    pq.write_table(ROLLOUT_ARROW_SCHEMA.empty_table(), sink)
    data = sink.getvalue().to_pybytes()
    start, length = footer_span(data)
    return data[start:start + length]


def _shifted(chunk: list[list], delta: int) -> list[list]:
    """A ColumnChunk moved by `delta` bytes in the file."""
    chunk = [list(f) for f in chunk]
    for field in chunk:
        if field[0] in _CHUNK_OFFSETS and field[2]:  # pyarrow writes the deprecated file_offset as 0
            field[2] += delta
        elif field[0] == _META:
            meta = field[2] = [list(f) for f in field[2]]
            for entry in meta:
                if entry[0] in _META_OFFSETS:
                    entry[2] += delta
    return chunk


def _chunk_start(chunk: list[list]) -> int:
    meta = _get(chunk, _META)[2]
    return min(f[2] for f in meta if f[0] in (9, 11))


def splice_footer(bulk_footer, small_footer, small_delta: int) -> bytes:
    """The footer of one file of ROLLOUT_ARROW_SCHEMA from the footers of a file of its bulk columns and a file of
    its other columns with the same row groups: the bulk file's column chunks where they are, the small file's
    moved by `small_delta` bytes."""
    bulk, _ = decode_struct(bulk_footer)
    small, _ = decode_struct(small_footer)
    bulk_groups, small_groups = _get(bulk, _ROW_GROUPS)[2][1], _get(small, _ROW_GROUPS)[2][1]
    if len(bulk_groups) != len(small_groups):
        raise ValueError(f"{len(bulk_groups)} and {len(small_groups)} row groups")
    row_groups = []
    for ordinal, (bulk_group, small_group) in enumerate(zip(bulk_groups, small_groups)):
        rows = _get(bulk_group, _RG_ROWS)[2]
        if rows != _get(small_group, _RG_ROWS)[2]:
            raise ValueError(f"row group {ordinal}: {rows} and {_get(small_group, _RG_ROWS)[2]} rows")
        bulk_chunks = iter(_get(bulk_group, _COLUMNS)[2][1])
        small_chunks = iter(_get(small_group, _COLUMNS)[2][1])
        columns = [next(bulk_chunks) if f.name in BULK_COLUMNS else _shifted(next(small_chunks), small_delta)
                   for f in ROLLOUT_ARROW_SCHEMA]
        group = [[_COLUMNS, _LIST, (_STRUCT, columns)],
                 [_BYTE_SIZE, _I64, _get(bulk_group, _BYTE_SIZE)[2] + _get(small_group, _BYTE_SIZE)[2]],
                 [_RG_ROWS, _I64, rows],
                 [_RG_OFFSET, _I64, min(_chunk_start(c) for c in columns)],
                 [_RG_COMPRESSED, _I64, _get(bulk_group, _RG_COMPRESSED)[2] + _get(small_group, _RG_COMPRESSED)[2]],
                 [_ORDINAL, _I16, ordinal]]
        row_groups.append(group)
    merged, _ = decode_struct(_whole_schema_footer())
    _set(merged, _NUM_ROWS, _I64, _get(bulk, _NUM_ROWS)[2])
    _set(merged, _ROW_GROUPS, _LIST, (_STRUCT, row_groups))
    return bytes(encode_struct(bytearray(), merged))
