"""The bodies the routes answer with: Arrow IPC streams when the client sends `Accept:
application/vnd.apache.arrow.stream`, else JSON serialised with orjson into a raw Response (FastAPI's default response
path is ~6x slower for these payloads). Groups are sent as the record batch messages stored in the shards' lookup
files, concatenated: nothing is decoded or re-encoded."""

from __future__ import annotations

from typing import Any

import orjson
import pyarrow as pa
from fastapi import Request
from fastapi.responses import Response

from graft.schemas import ARROW_MEDIA_TYPE, ROLLOUT_ARROW_SCHEMA
from graft.services.store_api.local import arrow_stream

ARROW_CONTENT = {ARROW_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}  # OpenAPI: a 200's Arrow body


def wants_arrow(request: Request) -> bool:
    return ARROW_MEDIA_TYPE in request.headers.get("accept", "")


def arrow_response(table: pa.Table, metadata: dict[str, str]) -> Response:
    schema = ROLLOUT_ARROW_SCHEMA.with_metadata({**ROLLOUT_ARROW_SCHEMA.metadata, **{k: v for k, v in metadata.items()}})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table.replace_schema_metadata(schema.metadata))
    return Response(sink.getvalue().to_pybytes(), media_type=ARROW_MEDIA_TYPE)


def stream_response(messages: list[bytes], metadata: dict[str, str]) -> Response:
    """Stored groups' record batch messages as an Arrow IPC stream response."""
    return Response(arrow_stream(messages, metadata), media_type=ARROW_MEDIA_TYPE)


def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


def rows_as_groups(table: pa.Table) -> list[dict[str, list[dict[str, Any]]]]:
    """Consecutive rows of a table of whole groups, as `{"rollouts": [...]}` dicts."""
    groups: list[dict[str, list[dict[str, Any]]]] = []
    last = None
    for row in table.to_pylist():
        if row["group_id"] != last:
            groups.append({"rollouts": []})
            last = row["group_id"]
        groups[-1]["rollouts"].append(row)
    return groups
