"""Push bodies (POST /v1/groups), decoded and checked before anything is stored: a PushGroupsRequest as JSON,
or an Arrow IPC stream of rows in ROLLOUT_ARROW_SCHEMA with the problems as JSON in its schema metadata.

Any bytes are safe to hand over. An Arrow body is refused if any message is compressed (12 KB of zstd can
decompress to gigabytes, before anything could check them), then decoded and validated by Arrow itself
(`Table.validate(full=True)`: offsets, lengths, UTF-8) before any other use: Arrow's kernels and `to_pylist`
trust those and crashed the process on bit-flipped bodies. Whatever fails to decode answers 400 saying so;
decoded columns are then cast to the schema's types before any kernel runs on them (400 naming a column whose
type does not cast: Arrow's kernels each take only some types), and the rows pass `tables.validate_table` like
every stored row (422 naming the bad row).
"""

from __future__ import annotations

import struct

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from graft.schemas import MAX_PUSH_GROUPS, Problem, PushGroupsRequest
from graft.services.store_api.tables import ColumnTypeError, conform_table, groups_table, validate_table

PROBLEMS_METADATA_KEY = b"graft_problems"  # Arrow push: problems as JSON in the stream's schema metadata
MAX_STREAM_MESSAGES = 65536  # record batches of one push (512 groups); each costs a Python step to check


class PushRejected(Exception):
    """A push body refused before anything was stored: `status` (400, 422) and a message saying why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parse_json_push(body: bytes) -> tuple[pa.Table, list[Problem]]:
    """A PushGroupsRequest body as a validated table and its problems; pydantic errors become 422s.

    Strict: a value the published schema refuses (`false` for a number, `"3"` for an integer) is refused.
    """
    try:
        request = PushGroupsRequest.model_validate_json(body, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if errors and errors[0]["type"] == "json_invalid":
            raise PushRejected(400, f"body is not JSON: {errors[0]['msg']}") from exc
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from exc
    return validate_table(groups_table(request.groups)), list(request.problems)


def parse_arrow_push(body: bytes) -> tuple[pa.Table, list[Problem]]:
    """An Arrow IPC stream body as a validated table (vectorised checks) and the problems in its metadata."""
    table, metadata = decode_arrow_stream(body)
    problems: list[Problem] = []
    raw = metadata.get(PROBLEMS_METADATA_KEY)
    if raw:
        try:
            problems = [Problem.model_validate(p, strict=True) for p in orjson.loads(raw)]
        except (orjson.JSONDecodeError, ValidationError, TypeError) as exc:
            raise PushRejected(422, f"schema metadata {PROBLEMS_METADATA_KEY.decode()} is not a JSON list of "
                                    f"Problem: {exc}") from exc
    try:
        table = conform_table(table)  # first: count_distinct has no kernel for most types a client may send
    except ColumnTypeError as exc:
        raise PushRejected(400, f"{exc}; send the columns in ROLLOUT_ARROW_SCHEMA's types") from exc
    n_groups = pc.count_distinct(table.column("group_id")).as_py()
    if n_groups > MAX_PUSH_GROUPS:
        raise PushRejected(422, f"{n_groups} groups in one push; at most {MAX_PUSH_GROUPS}: split it")
    return validate_table(table), problems


def decode_arrow_stream(body: bytes) -> tuple[pa.Table, dict[bytes, bytes]]:
    """The table of an uncompressed Arrow IPC stream, checked whole by Arrow, and its schema metadata (without
    the metadata); PushRejected(400) for anything that is not such a stream."""
    buffer = pa.py_buffer(body)
    try:
        messages = 0
        for message in pa.ipc.MessageReader.open_stream(buffer):
            messages += 1
            if messages > MAX_STREAM_MESSAGES:
                raise PushRejected(400, f"more than {MAX_STREAM_MESSAGES} messages in one Arrow stream: send the "
                                        "rows as fewer, larger record batches")
            if _compressed(message.metadata.to_pybytes()):
                raise PushRejected(400, "compressed Arrow IPC record batches are not accepted: write the stream "
                                        "without IpcWriteOptions(compression=...)")
        table = pa.ipc.open_stream(buffer).read_all()
        table.validate(full=True)  # before anything reads a value: offsets, lengths and UTF-8 checked
        table.column_names  # decodes the names: a UnicodeDecodeError is raised here, not later
        metadata = dict(table.schema.metadata or {})
        if table.nbytes > len(body):  # only columns sharing buffers can be larger than the stream they came in
            raise PushRejected(400, "the stream's columns share buffers; write it with pyarrow.ipc.new_stream")
    except PushRejected:
        raise
    except (pa.ArrowException, OSError, ValueError, KeyError, IndexError, TypeError, struct.error) as exc:
        # ArrowInvalid, ArrowNotImplementedError, UnicodeDecodeError (a ValueError) for names, ...
        raise PushRejected(400, f"body is not a valid Arrow IPC stream ({type(exc).__name__}: {exc}); send the "
                                "rows written by pyarrow.ipc.new_stream, or JSON") from exc
    return table.replace_schema_metadata(None), metadata


def _compressed(flatbuffer: bytes) -> bool:
    """Whether an IPC message's metadata (a flatbuffer `Message`) declares a compressed body.

    Arrow's format (format/Message.fbs): Message.header (field 2) is a union whose type (field 1) is
    RecordBatch = 3 or DictionaryBatch = 2 (its field 1 holds a RecordBatch); RecordBatch.compression is its
    field 3. Raises struct.error or IndexError on a truncated or malformed flatbuffer.
    """
    root = _u32(flatbuffer, 0)
    header_type = _field(flatbuffer, root, 1)
    header = _field(flatbuffer, root, 2)
    if header_type is None or header is None:
        return False
    kind = _unpack("<B", flatbuffer, header_type)
    batch = header + _u32(flatbuffer, header)
    if kind == 2:  # DictionaryBatch: its data is a RecordBatch table
        data = _field(flatbuffer, batch, 1)
        if data is None:
            return False
        batch = data + _u32(flatbuffer, data)
    elif kind != 3:
        return False
    return _field(flatbuffer, batch, 3) is not None


def _unpack(fmt: str, buf: bytes, offset: int) -> int:
    if not 0 <= offset <= len(buf) - struct.calcsize(fmt):  # unpack_from would count a negative one from the end
        raise IndexError(f"flatbuffer offset {offset} outside its {len(buf)} bytes")
    return struct.unpack_from(fmt, buf, offset)[0]


def _u32(buf: bytes, offset: int) -> int:
    return _unpack("<I", buf, offset)


def _field(buf: bytes, table: int, index: int) -> int | None:
    """Where field `index` of the flatbuffer table at `table` lies, or None if the field is absent."""
    vtable = table - _unpack("<i", buf, table)
    vtable_size = _unpack("<H", buf, vtable)
    entry = 4 + 2 * index
    if entry + 2 > vtable_size:
        return None
    offset = _unpack("<H", buf, vtable + entry)
    return None if offset == 0 else table + offset
