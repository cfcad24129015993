"""The store's HTTP API (v1): the FastAPI app, errors as `ErrorResponse` JSON. Its ASGI wrappers (`BodySizeLimit`,
`LookupFastPath`) are in `asgi.py`, the ingest and maintenance threads in `background.py`. (Over 400 lines because
the routes are closures of `create_app` over one store, its settings and metrics.)

Bulk responses (groups, rollout pages) are Arrow IPC streams when the client sends
`Accept: application/vnd.apache.arrow.stream`, else JSON serialised with orjson into a raw Response
(FastAPI's default response path is ~6x slower for these payloads). Groups are sent as the record batch
messages stored in the shards' lookup files, concatenated: nothing is decoded or re-encoded.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from schemas import (
    ARROW_MEDIA_TYPE,
    GROUP_ID_PATTERN,
    LOOKUP_PATH,
    MAX_PAGE_SIZE,
    PROMPT_ID_PATTERN,
    ROLLOUT_ARROW_SCHEMA,
    ErrorResponse,
    HealthResponse,
    PeerLookupRequest,
    PeerLookupResponse,
    PushGroupsRequest,
    PushGroupsResponse,
    RolloutGroup,
    RolloutPage,
    StatsResponse,
)
from schemas.rollout import INT64_MAX
from services.store_api.browser.routes import add_browser
from services.store_api.http.asgi import BodySizeLimit, LookupFastPath
from services.store_api.http.background import Background
from services.store_api.backend import store_backend
from services.store_api.http.push import PushRejected, parse_arrow_push, parse_json_push
from services.store_api.lake.config import LakeError, LakeUnavailable
from services.store_api.local.lookup import arrow_stream, read_stream
from services.store_api.local.mirror import GroupConflict
from services.store_api.local.queries import BadCursor
from services.store_api.settings import StoreSettings
from services.store_api.tables import ShardValidationError

log = logging.getLogger("graft.store")

try:
    VERSION = version("graft")
except PackageNotFoundError:  # running from a checkout without `pip install -e .`
    VERSION = "0.0.0"


class StoreHTTPError(Exception):
    """An error the API answers with `status` and an ErrorResponse saying what to do."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class PromptGroupsResponse(BaseModel):
    prompt_id: str = Field(description="the prompt asked for")
    groups: list[RolloutGroup] = Field(description="its stored groups, most recent first (highest policy step, then newest)")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    texts = {400: "malformed request", 401: "missing or wrong bearer token", 404: "not found",
             409: "a group id is stored already under another model or prompt", 413: "request body too large",
             415: "unsupported content type", 422: "request fails validation"}
    return {status: {"model": ErrorResponse, "description": texts[status]} for status in statuses}


ERROR_RESPONSES = error_responses(400, 404, 413, 415, 422)
ARROW_CONTENT = {ARROW_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}


# ------------------------------------------------------------------------------------------ response helpers


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


# ------------------------------------------------------------------------------------------ auth

bearer = HTTPBearer(auto_error=False, description="this store's GRAFT_STORE_TOKEN: required for writes (POST /v1/groups)")


def require_token(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    token = request.app.state.settings.token
    if token is None:
        return
    if credentials is None:
        raise StoreHTTPError(401, "this store requires a bearer token for writes: send 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
        raise StoreHTTPError(401, "wrong bearer token: use the store's GRAFT_STORE_TOKEN")


# ------------------------------------------------------------------------------------------ the app


def create_app(settings: StoreSettings) -> FastAPI:
    """The store API over `settings.root`; the index opens (and catches up with the files) at startup."""
    registry = CollectorRegistry()
    lookups = Counter("graft_store_lookups", "peer lookup requests", registry=registry)
    lookup_seconds = Histogram("graft_store_lookup_seconds", "peer lookup latency", registry=registry,
                               buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5))
    lookup_misses = Counter("graft_store_lookup_misses", "prompts a peer lookup found nothing for", registry=registry)
    ingested = Counter("graft_store_groups_ingested", "groups indexed by the ingest loop", registry=registry)
    pushed = Counter("graft_store_groups_pushed", "groups accepted by POST /v1/groups", registry=registry)
    groups_gauge = Gauge("graft_store_groups", "groups in the index", registry=registry)
    store = store_backend(settings)
    index = store.index
    state: dict[str, Background] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(store.open)
        groups_gauge.set_function(index.group_count)
        background = Background(store, settings, ingested)
        background.start()
        state["background"] = background
        log.info("store serving %s: %d groups indexed", settings.root, index.group_count())
        try:
            yield
        finally:
            background.close()
            store.close()

    app = FastAPI(
        title="graft trajectory store", version=VERSION, lifespan=lifespan,
        description="Stored rollout groups for GRAFT: peer lookups for trainers, push ingest, filtered queries; a "
                    "read-only trajectory browser at /ui/ reads the same API.",
    )
    app.state.index = index

    def read_lookup(req: PeerLookupRequest) -> tuple[list[bytes], dict[str, Any]]:
        """The lookup's group messages and its answer's other fields: misses, and why each missed."""
        messages, misses = index.read_selected(lambda: index.select_peer_groups(req), as_messages=True)
        lookups.inc()
        lookup_misses.inc(len(misses))
        return messages, {"misses": list(misses), "miss_reasons": misses}

    async def arrow_lookup(req: PeerLookupRequest) -> bytes:
        """A peer lookup's answer as an Arrow IPC stream, misses and miss_reasons in the schema metadata."""
        started = time.perf_counter()

        def answer() -> bytes:
            messages, fields = read_lookup(req)
            return arrow_stream(messages, {name: orjson.dumps(value).decode() for name, value in fields.items()})

        # reading a stored group costs ~25 us (a pread and a CRC): up to 64 groups, answer on the event loop
        # and skip the thread hand-off; bigger lookups go to the thread pool so they never stall other requests
        small = len(req.prompt_ids) * req.groups_per_prompt <= 64
        stream = answer() if small else await run_in_threadpool(answer)
        lookup_seconds.observe(time.perf_counter() - started)
        return stream

    # the last added middleware runs first: the size limit, then the fast path
    app.add_middleware(LookupFastPath, answer=arrow_lookup)
    app.add_middleware(BodySizeLimit, push_limit=int(settings.max_body_mb * 2**20),
                       other_limit=int(settings.max_request_kb * 2**10))
    app.state.settings = settings

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, detail = readable_errors(list(exc.errors()))
        return error_body(422, message, detail)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}; see /docs"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; see /docs"
        return error_body(exc.status_code, message, headers=getattr(exc, "headers", None))  # 405 keeps its Allow

    @app.exception_handler(StoreHTTPError)
    async def on_store_error(request: Request, exc: StoreHTTPError):
        return error_body(exc.status, exc.message)

    @app.exception_handler(ShardValidationError)
    async def on_shard_validation(request: Request, exc: ShardValidationError):
        return error_body(422, f"invalid rollouts: {exc}")

    @app.exception_handler(PushRejected)
    async def on_push_rejected(request: Request, exc: PushRejected):
        return error_body(exc.status, exc.message)

    @app.exception_handler(GroupConflict)
    async def on_group_conflict(request: Request, exc: GroupConflict):
        return error_body(409, str(exc))

    @app.exception_handler(LakeError)
    async def on_lake_error(request: Request, exc: LakeError):
        # a push the lake refused: nothing of it was committed, the writer retries (503) or fixes its input
        return error_body(503 if isinstance(exc, LakeUnavailable) else 502, f"{exc}")

    @app.exception_handler(BadCursor)
    async def on_bad_cursor(request: Request, exc: BadCursor):
        return error_body(400, str(exc))

    @app.exception_handler(ClientDisconnect)
    async def on_client_left(request: Request, exc: ClientDisconnect):
        log.info("client left during %s %s before its body was read whole: nothing stored", request.method,
                 request.url.path)
        return error_body(400, "the client disconnected before sending the whole body")

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_body(500, f"internal error ({type(exc).__name__}); the store logged the details")

    # ------------------------------------------------------------------ reads

    @app.get("/v1/health", response_model=HealthResponse, tags=["meta"])
    def health() -> HealthResponse:
        """'ok' when the index is open and the ingest loop runs."""
        background = state.get("background")
        status = "ok" if background is not None and background.alive() else "degraded"
        return HealthResponse(status=status, version=VERSION, groups=index.group_count())

    @app.get("/v1/stats", response_model=StatsResponse, tags=["meta"])
    def stats() -> StatsResponse:
        """Counts per model, success rates, files, quarantined files, duplicates and ingest freshness."""
        return store.stats()

    @app.post(LOOKUP_PATH, response_model=PeerLookupResponse, tags=["groups"],
              responses={200: {"content": ARROW_CONTENT}, **ERROR_RESPONSES})
    async def peer_lookup(req: PeerLookupRequest, request: Request) -> Response:
        """The trainer's call: whole peer groups for many prompts, most recent first, and the misses.

        Send `Accept: application/vnd.apache.arrow.stream` for an Arrow IPC stream of rollout rows in
        ROLLOUT_ARROW_SCHEMA (misses and miss_reasons as JSON in the schema metadata keys of those names). Valid Arrow lookups are
        answered by LookupFastPath with the same `arrow_lookup`; this route serves the rest.
        """
        if wants_arrow(request):
            return Response(await arrow_lookup(req), media_type=ARROW_MEDIA_TYPE)
        started = time.perf_counter()

        def answer() -> Response:  # JSON is slow to build: always on the thread pool
            messages, fields = read_lookup(req)
            return json_response({"groups": rows_as_groups(read_stream(arrow_stream(messages))), **fields})

        response = await run_in_threadpool(answer)
        lookup_seconds.observe(time.perf_counter() - started)
        return response

    @app.get("/v1/prompts/{prompt_id}/groups", response_model=PromptGroupsResponse, tags=["groups"],
             responses={200: {"content": ARROW_CONTENT}, **ERROR_RESPONSES})
    def prompt_groups(
        request: Request,
        prompt_id: Annotated[str, Path(pattern=PROMPT_ID_PATTERN, description="prompt_id(problem text)")],
        model: Annotated[str | None, Query(description="only this model's groups")] = None,
        limit: Annotated[int, Query(ge=1, le=256, description="at most this many groups")] = 16,
    ) -> Response:
        """Every stored group of one prompt (any model), most recent first."""
        messages, _ = index.read_selected(lambda: (index.select_prompt_groups(prompt_id, model, limit), None),
                                          as_messages=True)
        if wants_arrow(request):
            return stream_response(messages, {"prompt_id": prompt_id})
        return json_response({"prompt_id": prompt_id, "groups": rows_as_groups(read_stream(arrow_stream(messages)))})

    @app.get("/v1/groups/{group_id}", response_model=RolloutGroup, tags=["groups"],
             responses={200: {"content": ARROW_CONTENT}, **ERROR_RESPONSES})
    def get_group(request: Request, group_id: Annotated[str, Path(pattern=GROUP_ID_PATTERN,
                                                                  description="the group's id (schemas.Rollout.group_id)")]) -> Response:
        """One group by id."""
        messages, _ = index.read_selected(lambda: (index.select_group(group_id), None), as_messages=True)
        if not messages:
            raise StoreHTTPError(404, f"no group {group_id!r} in this store")
        if wants_arrow(request):
            return stream_response(messages, {})
        return json_response(rows_as_groups(read_stream(arrow_stream(messages)))[0])

    @app.get("/v1/rollouts", response_model=RolloutPage, tags=["rollouts"],
             responses={200: {"content": ARROW_CONTENT}, **ERROR_RESPONSES})
    def rollouts(
        request: Request,
        model: Annotated[str | None, Query(description="model_id")] = None,
        prompt_id: Annotated[str | None, Query(pattern=PROMPT_ID_PATTERN, description="prompt_id")] = None,
        dataset: Annotated[str | None, Query(description="dataset name")] = None,
        correct: Annotated[bool | None, Query(description="only correct (true) or incorrect (false) rollouts")] = None,
        min_reward: Annotated[float | None, Query(ge=0, le=1, description="reward >= this (unscored rows excluded)")] = None,
        max_reward: Annotated[float | None, Query(ge=0, le=1, description="reward <= this (unscored rows excluded)")] = None,
        min_policy_step: Annotated[int | None, Query(ge=0, le=INT64_MAX, description="policy_step >= this")] = None,
        max_policy_step: Annotated[int | None, Query(ge=0, le=INT64_MAX, description="policy_step <= this")] = None,
        cursor: Annotated[str | None, Query(max_length=64, description="next_cursor of the previous page")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="page size")] = 100,
    ) -> Response:
        """Stored rollouts matching the filters, in ingest order, one page at a time (follow next_cursor).

        A page may hold fewer than `limit` rollouts while next_cursor is set (the store bounds the work per
        page); the last page has next_cursor null.
        """
        if min_reward is not None and max_reward is not None and min_reward > max_reward:
            raise StoreHTTPError(422, f"min_reward {min_reward} > max_reward {max_reward}: the range is empty")
        table, next_cursor = index.rollout_page(
            model=model, prompt_id=prompt_id, dataset=dataset, correct=correct, min_reward=min_reward,
            max_reward=max_reward, min_policy_step=min_policy_step, max_policy_step=max_policy_step,
            cursor=cursor, limit=limit,
        )
        if wants_arrow(request):
            return arrow_response(table, {"next_cursor": orjson.dumps(next_cursor).decode()})
        return json_response({"rollouts": table.to_pylist(), "next_cursor": next_cursor})

    # ------------------------------------------------------------------ writes

    push_body_schema = {"$ref": "#/components/schemas/PushGroupsRequest"}

    push_errors = error_responses(400, *((401,) if settings.token else ()), 409, 413, 415, 422)

    @app.post("/v1/groups", response_model=PushGroupsResponse, tags=["groups"], dependencies=[Depends(require_token)],
              responses=push_errors, openapi_extra={"requestBody": {"required": True, "content": {
                  "application/json": {"schema": push_body_schema},
                  ARROW_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}})
    async def push_groups(request: Request) -> PushGroupsResponse:
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
        pushed.inc(accepted)
        return PushGroupsResponse(accepted_groups=accepted, duplicate_groups=duplicates, shard=shard)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def custom_openapi() -> dict[str, Any]:
        """FastAPI's schema plus PushGroupsRequest and Problem, which the push body refers to; the bearer token
        only where the store has one."""
        if app.openapi_schema:
            return app.openapi_schema
        schema = FastAPI.openapi(app)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        generated = PushGroupsRequest.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        for name, definition in generated.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components["PushGroupsRequest"] = generated
        if settings.token is None:  # an open store: no operation needs the bearer token, so none says it does
            schema["components"].pop("securitySchemes", None)
            for operation in (op for path in schema["paths"].values() for op in path.values()):
                operation.pop("security", None)
        app.openapi_schema = schema
        return schema

    add_browser(app, index, settings, ERROR_RESPONSES, PROMPT_ID_PATTERN)
    app.openapi = custom_openapi
    return app
