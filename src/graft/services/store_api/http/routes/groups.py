"""Whole rollout groups: the trainer's peer lookup, a prompt's groups, one group by id, and push ingest.

`arrow_lookup` answers a peer lookup as an Arrow IPC stream both for the route and for `asgi.LookupFastPath`, which
app.py gives it to.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import orjson
import pyarrow.compute as pc
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import BaseModel, Field

from graft.schemas import (
    ARROW_MEDIA_TYPE,
    GROUP_ID_PATTERN,
    LOOKUP_PATH,
    PROMPT_ID_PATTERN,
    PUSH_PATH,
    PeerLookupRequest,
    PeerLookupResponse,
    PushGroupsResponse,
    RolloutGroup,
)
from graft.services.store_api.backend import Store
from graft.services.store_api.http.dependencies import MetricsDep, StoreDep, require_token
from graft.services.store_api.http.errors import ERROR_RESPONSES, StoreHTTPError, error_responses
from graft.services.store_api.http.metrics import StoreMetrics
from graft.services.store_api.http.push import parse_arrow_push, parse_json_push
from graft.services.store_api.http.responses import (
    ARROW_CONTENT,
    json_response,
    rows_as_groups,
    stream_response,
    wants_arrow,
)
from graft.services.store_api.local import arrow_stream, read_stream

router = APIRouter(tags=["groups"])


class PromptGroupsResponse(BaseModel):
    prompt_id: str = Field(description="the prompt asked for")
    groups: list[RolloutGroup] = Field(description="its stored groups, most recent first (highest policy step, then newest)")


# ------------------------------------------------------------------------------------------ peer lookups


def read_lookup(store: Store, metrics: StoreMetrics, req: PeerLookupRequest) -> tuple[list[bytes], dict[str, Any]]:
    """The lookup's group messages and its answer's other fields: misses, and why each missed."""
    index = store.index
    served = store.broker.served_counts(req.learner_model) if store.broker.needs_ledger(req) else None
    messages, misses = index.queries.read_selected(lambda: index.queries.select_peer_groups(req, served), as_messages=True)
    metrics.lookups.inc()
    metrics.lookup_misses.inc(len(misses))
    return messages, {"misses": list(misses), "miss_reasons": misses}


async def arrow_lookup(store: Store, metrics: StoreMetrics, req: PeerLookupRequest) -> bytes:
    """A peer lookup's answer as an Arrow IPC stream, misses and miss_reasons in the schema metadata."""
    started = time.perf_counter()

    def answer() -> bytes:
        messages, fields = read_lookup(store, metrics, req)
        return arrow_stream(messages, {name: orjson.dumps(value).decode() for name, value in fields.items()})

    # reading a stored group costs ~25 us (a pread and a CRC): up to 64 groups, answer on the event loop
    # and skip the thread hand-off; bigger lookups go to the thread pool so they never stall other requests
    small = len(req.prompt_ids) * req.groups_per_prompt <= 64
    stream = answer() if small else await run_in_threadpool(answer)
    metrics.lookup_seconds.observe(time.perf_counter() - started)
    return stream


@router.post(LOOKUP_PATH, response_model=PeerLookupResponse, responses={200: {"content": ARROW_CONTENT}, **ERROR_RESPONSES})
async def peer_lookup(req: PeerLookupRequest, request: Request, store: StoreDep, metrics: MetricsDep) -> Response:
    """The trainer's call: whole peer groups for many prompts, most recent first, and the misses.

    Send `Accept: application/vnd.apache.arrow.stream` for an Arrow IPC stream of rollout rows in
    ROLLOUT_ARROW_SCHEMA (misses and miss_reasons as JSON in the schema metadata keys of those names). Valid Arrow lookups are
    answered by LookupFastPath with the same `arrow_lookup`; this route serves the rest.
    """
    if wants_arrow(request):
        return Response(await arrow_lookup(store, metrics, req), media_type=ARROW_MEDIA_TYPE)
    started = time.perf_counter()

    def answer() -> Response:  # JSON is slow to build: always on the thread pool
        messages, fields = read_lookup(store, metrics, req)
        return json_response({"groups": rows_as_groups(read_stream(arrow_stream(messages))), **fields})

    response = await run_in_threadpool(answer)
    metrics.lookup_seconds.observe(time.perf_counter() - started)
    return response


# ------------------------------------------------------------------------------------------ reads by prompt or id


@router.get("/v1/prompts/{prompt_id}/groups", response_model=PromptGroupsResponse,
            responses={200: {"content": ARROW_CONTENT}, **ERROR_RESPONSES})
def prompt_groups(
    request: Request,
    store: StoreDep,
    prompt_id: Annotated[str, Path(pattern=PROMPT_ID_PATTERN, description="prompt_id(problem text)")],
    model: Annotated[str | None, Query(description="only this model's groups")] = None,
    limit: Annotated[int, Query(ge=1, le=256, description="at most this many groups")] = 16,
) -> Response:
    """Every stored group of one prompt (any model), most recent first."""
    queries = store.index.queries
    messages, _ = queries.read_selected(lambda: (queries.select_prompt_groups(prompt_id, model, limit), None),
                                  as_messages=True)
    if wants_arrow(request):
        return stream_response(messages, {"prompt_id": prompt_id})
    return json_response({"prompt_id": prompt_id, "groups": rows_as_groups(read_stream(arrow_stream(messages)))})


@router.get("/v1/groups/{group_id}", response_model=RolloutGroup,
            responses={200: {"content": ARROW_CONTENT}, **ERROR_RESPONSES})
def get_group(request: Request, store: StoreDep, group_id: Annotated[str, Path(
        pattern=GROUP_ID_PATTERN, description="the group's id (schemas.Rollout.group_id)")]) -> Response:
    """One group by id."""
    queries = store.index.queries
    messages, _ = queries.read_selected(lambda: (queries.select_group(group_id), None), as_messages=True)
    if not messages:
        raise StoreHTTPError(404, f"no group {group_id!r} in this store")
    if wants_arrow(request):
        return stream_response(messages, {})
    return json_response(rows_as_groups(read_stream(arrow_stream(messages)))[0])


# ------------------------------------------------------------------------------------------ writes

# 401 is documented only where the store has a token: app.py's OpenAPI document drops it for an open store
PUSH_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/PushGroupsRequest"}},
    ARROW_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}}


@router.post(PUSH_PATH, response_model=PushGroupsResponse, dependencies=[Depends(require_token)],
             responses=error_responses(400, 401, 409, 413, 415, 422), openapi_extra=PUSH_BODY)
async def push_groups(request: Request, store: StoreDep, metrics: MetricsDep) -> PushGroupsResponse:
    """Push ingest: validate whole groups of one model, write them as a shard, index it at once.

    JSON body: PushGroupsRequest. Or an Arrow IPC stream (Content-Type application/vnd.apache.arrow.stream)
    of rollout rows in ROLLOUT_ARROW_SCHEMA, problems as JSON in schema metadata key `graft_problems`.
    Groups already stored are not written again (listed in duplicate_groups); a group id stored under another
    model or prompt is refused with 409. With GRAFT_STORE_TOKEN set, send `Authorization: Bearer <token>`
    (checked before the body is read).
    """
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    body = await request.body()
    if content_type == ARROW_MEDIA_TYPE:
        table, problems = await run_in_threadpool(parse_arrow_push, body)
    elif content_type in ("application/json", ""):
        table, problems = await run_in_threadpool(parse_json_push, body)
    else:
        raise StoreHTTPError(415, f"Content-Type {content_type!r} is not accepted: send application/json "
                                  f"(PushGroupsRequest) or {ARROW_MEDIA_TYPE}")
    n_models = pc.count_distinct(table.column("model_id")).as_py()
    if n_models != 1:
        raise StoreHTTPError(422, f"groups of {n_models} models in one push; a shard holds one model's groups: "
                                  "push each model's groups separately")
    accepted, duplicates, shard = await run_in_threadpool(store.push, table, problems)
    metrics.pushed.inc(accepted)
    return PushGroupsResponse(accepted_groups=accepted, duplicate_groups=duplicates, shard=shard)
