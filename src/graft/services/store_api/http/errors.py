"""The store API's errors: `StoreHTTPError` for a route to raise, the ErrorResponse body every error answers with,
and the OpenAPI entries that document them. app.py registers the exception handlers that write these bodies."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response

from graft.schemas import ErrorResponse


class StoreHTTPError(Exception):
    """An error the API answers with `status` and an ErrorResponse saying what to do."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    texts = {400: "malformed request", 401: "missing or wrong bearer token", 404: "not found",
             409: "a group id is stored already under another model or prompt", 413: "request body too large",
             415: "unsupported content type", 422: "request fails validation"}
    return {status: {"model": ErrorResponse, "description": texts[status]} for status in statuses}


ERROR_RESPONSES = error_responses(400, 404, 413, 415, 422)


def error_body(status: int, message: str, detail: list[dict] | None = None,
               headers: dict[str, str] | None = None) -> Response:
    """An ErrorResponse; ASCII JSON, so that any input it quotes (a lone surrogate included) can be sent."""
    body = json.dumps(ErrorResponse(error=message, detail=detail).model_dump(exclude_none=True), ensure_ascii=True)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def readable_errors(errors: list[dict[str, Any]]) -> tuple[str, list[dict]]:
    """Pydantic/FastAPI validation errors as one readable line and a JSON-safe list."""
    detail = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
              for e in errors]
    parts = [f"{'.'.join(d['loc']) or 'request'}: {d['msg']}" for d in detail[:5]]
    more = f" (and {len(detail) - 5} more)" if len(detail) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more, detail
