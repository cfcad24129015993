"""Thrift's compact protocol, which Parquet's page headers and footers are written in: pyarrow exposes neither
the headers nor the footer's own bytes as structures, so the store reads them here (`pages.py`) and writes a
footer back (`splice.py`). `read_struct` is the fast reader of page headers, a dict per struct;
`decode_struct` / `encode_struct` keep every field's type, so that a footer decoded and encoded again is the
same bytes (tests/store/test_store_pages.py checks it on pyarrow's footers).
"""

from __future__ import annotations

import struct


def _varint(b, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = b[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7


def _decode_value(b, i: int, kind: int):
    if kind in (4, 5, 6):
        n, i = _varint(b, i)
        return (n >> 1) ^ -(n & 1), i
    if kind == 3:
        return b[i], i + 1
    if kind == 7:
        return struct.unpack_from("<d", b, i)[0], i + 8
    if kind == 8:
        n, i = _varint(b, i)
        return bytes(b[i:i + n]), i + n
    if kind in (9, 10):
        head = b[i]
        i += 1
        n, item = head >> 4, head & 0x0F
        if n == 15:
            n, i = _varint(b, i)
        items = []
        for _ in range(n):
            if item in (1, 2):  # bools inside a collection are a byte each
                value, i = b[i], i + 1
            else:
                value, i = _decode_value(b, i, item)
            items.append(value)
        return (item, items), i
    if kind == 11:
        n, i = _varint(b, i)
        kinds = 0
        if n:
            kinds = b[i]
            i += 1
        pairs = []
        for _ in range(n):
            key, i = _decode_value(b, i, kinds >> 4)
            value, i = _decode_value(b, i, kinds & 0x0F)
            pairs.append((key, value))
        return (kinds, pairs), i
    if kind == 12:
        return decode_struct(b, i)
    raise ValueError(f"Thrift compact type {kind} at byte {i}")


def decode_struct(b, i: int = 0) -> tuple[list[list], int]:
    """A Thrift compact struct at b[i:] as [field id, type, value] triples in order (a bool field's value is its
    type: 1 true, 2 false), and where it ends."""
    fields: list[list] = []
    field = 0
    while True:
        head = b[i]
        i += 1
        kind = head & 0x0F
        if not kind:
            return fields, i
        if head >> 4:
            field += head >> 4
        else:
            n, i = _varint(b, i)
            field = (n >> 1) ^ -(n & 1)
        if 4 <= kind <= 6:  # i16, i32, i64, a zigzag varint: most fields of a page header or footer, decoded inline
            n = shift = 0
            while True:
                byte = b[i]
                i += 1
                n |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    break
                shift += 7
            fields.append([field, kind, (n >> 1) ^ -(n & 1)])
        elif kind in (1, 2):
            fields.append([field, kind, None])
        else:
            value, i = _decode_value(b, i, kind)
            fields.append([field, kind, value])


def _put_varint(out: bytearray, n: int) -> None:
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _encode_value(out: bytearray, kind: int, value) -> None:
    if kind in (4, 5, 6):
        _put_varint(out, (value << 1) ^ (value >> 63))
    elif kind == 3:
        out.append(value & 0xFF)
    elif kind == 7:
        out += struct.pack("<d", value)
    elif kind == 8:
        _put_varint(out, len(value))
        out += value
    elif kind in (9, 10):
        item, items = value
        if len(items) < 15:
            out.append(len(items) << 4 | item)
        else:
            out.append(0xF0 | item)
            _put_varint(out, len(items))
        for element in items:
            if item in (1, 2):
                out.append(element)
            else:
                _encode_value(out, item, element)
    elif kind == 11:
        kinds, pairs = value
        _put_varint(out, len(pairs))
        if pairs:
            out.append(kinds)
        for key, element in pairs:
            _encode_value(out, kinds >> 4, key)
            _encode_value(out, kinds & 0x0F, element)
    elif kind == 12:
        encode_struct(out, value)
    else:
        raise ValueError(f"Thrift compact type {kind}")


def encode_struct(out: bytearray, fields: list[list]) -> bytearray:
    """Append the struct of `decode_struct`'s triples to `out` (and return it)."""
    last = 0
    for field, kind, value in fields:
        if 0 < field - last <= 15:
            out.append((field - last) << 4 | kind)
        else:
            out.append(kind)
            _put_varint(out, (field << 1) ^ (field >> 63))
        last = field
        if kind not in (1, 2):
            _encode_value(out, kind, value)
    out.append(0)
    return out


def read_struct(b, i: int = 0) -> tuple[dict[int, object], int]:
    """A Thrift compact struct at b[i:] as {field id: value} (nested structs as dicts too, bools as bools), and
    where it ends. IndexError if `b` ends first."""
    fields, end = decode_struct(b, i)
    return {field: _plain(kind, value) for field, kind, value in fields}, end


def _plain(kind: int, value):
    if kind in (1, 2):
        return kind == 1
    if kind == 12:
        return {field: _plain(k, v) for field, k, v in value}
    return value
