"""The store's HTTP API (v1): `create_app` assembles the FastAPI app over one store. The routes are in routes/ (one
router per area) and browser/routes.py, reading the store through `dependencies.get_store`; the response bodies in
responses.py; the errors in errors.py, answered as `ErrorResponse` JSON by the handlers registered below; the ASGI
wrappers (`BodySizeLimit`, `LookupFastPath`) in asgi.py; the ingest and maintenance threads in background.py.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from graft.schemas import PushGroupsRequest
from graft.services.store_api.backend import store_backend
from graft.services.store_api.browser import routes as browser
from graft.services.store_api.http import VERSION
from graft.services.store_api.http.asgi import BodySizeLimit, LookupFastPath
from graft.services.store_api.http.background import Background
from graft.services.store_api.http.errors import ERROR_RESPONSES, StoreHTTPError, error_body, readable_errors
from graft.services.store_api.http.metrics import StoreMetrics
from graft.services.store_api.http.push import PushRejected
from graft.services.store_api.http.routes import broker, groups, meta, rollouts
from graft.services.store_api.lake.config import LakeError, LakeUnavailable
from graft.services.store_api.local import BadCursor, GroupConflict
from graft.services.store_api.settings import StoreSettings
from graft.services.store_api.tables import ShardValidationError

log = logging.getLogger("graft.store")


@asynccontextmanager
async def lifespan(app: FastAPI):
    """Open the store (the index catches up with the files), run the background threads; close both at shutdown."""
    store, settings, metrics = app.state.store, app.state.settings, app.state.metrics
    await run_in_threadpool(store.open)
    metrics.groups.set_function(store.index.queries.group_count)
    app.state.background = background = Background(store, settings, metrics.ingested)
    background.start()
    log.info("store serving %s: %d groups indexed", settings.root, store.index.queries.group_count())
    try:
        yield
    finally:
        background.close()
        store.close()


def create_app(settings: StoreSettings) -> FastAPI:
    """The store API over `settings.root`; the index opens (and catches up with the files) at startup."""
    store = store_backend(settings)
    metrics = StoreMetrics()
    app = FastAPI(
        title="graft trajectory store", version=VERSION, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS,
        description="Stored rollout groups for GRAFT: peer lookups for trainers, push ingest, filtered queries; a "
                    "read-only trajectory browser at /ui/ reads the same API.",
    )
    app.state.settings = settings
    app.state.store = store
    app.state.metrics = metrics
    app.state.background = None  # until the lifespan starts it: /v1/health says 'degraded'
    app.state.browse = browser.open_browse(store.index, settings.tokenizers)

    # the last added middleware runs first: the size limit, then the fast path
    app.add_middleware(LookupFastPath, answer=partial(groups.arrow_lookup, store, metrics))
    app.add_middleware(BodySizeLimit, push_limit=int(settings.max_body_mb * 2**20),
                       other_limit=int(settings.max_request_kb * 2**10))

    for router in (meta.router, groups.router, rollouts.router, broker.router):
        app.include_router(router)
    app.mount("/ui/static", browser.UI_FILES, name="ui-static")  # before the browser's /ui/{view:path} page route
    app.include_router(browser.router, responses=ERROR_RESPONSES)
    app.openapi = partial(openapi_document, app)
    return app


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus PushGroupsRequest and Problem, which the push body refers to; the bearer token (and
    the 401 it answers) only where the store has one."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = FastAPI.openapi(app)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    generated = PushGroupsRequest.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
    for name, definition in generated.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components["PushGroupsRequest"] = generated
    if app.state.settings.token is None:  # an open store: no operation needs the bearer token, so none says it does
        schema["components"].pop("securitySchemes", None)
        for operation in (op for path in schema["paths"].values() for op in path.values()):
            operation.pop("security", None)
            operation["responses"].pop("401", None)
    app.openapi_schema = schema
    return schema


# ------------------------------------------------------------------------------------------ exception handlers


async def on_validation_error(request: Request, exc: RequestValidationError):
    message, detail = readable_errors(list(exc.errors()))
    return error_body(422, message, detail)


async def on_http_error(request: Request, exc: StarletteHTTPException):
    message = str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":
        message = f"no such endpoint: {request.method} {request.url.path}; see /docs"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}; see /docs"
    return error_body(exc.status_code, message, headers=getattr(exc, "headers", None))  # 405 keeps its Allow


async def on_store_error(request: Request, exc: StoreHTTPError):
    return error_body(exc.status, exc.message)


async def on_shard_validation(request: Request, exc: ShardValidationError):
    return error_body(422, f"invalid rollouts: {exc}")


async def on_push_rejected(request: Request, exc: PushRejected):
    return error_body(exc.status, exc.message)


async def on_group_conflict(request: Request, exc: GroupConflict):
    return error_body(409, str(exc))


async def on_lake_error(request: Request, exc: LakeError):
    # a push the lake refused: nothing of it was committed, the writer retries (503) or fixes its input
    return error_body(503 if isinstance(exc, LakeUnavailable) else 502, f"{exc}")


async def on_bad_cursor(request: Request, exc: BadCursor):
    return error_body(400, str(exc))


async def on_client_left(request: Request, exc: ClientDisconnect):
    log.info("client left during %s %s before its body was read whole: nothing stored", request.method,
             request.url.path)
    return error_body(400, "the client disconnected before sending the whole body")


async def on_unexpected(request: Request, exc: Exception):
    log.exception("internal error on %s %s", request.method, request.url.path)
    return error_body(500, f"internal error ({type(exc).__name__}); the store logged the details")


# every error the API answers, registered in one place (create_app hands these to FastAPI); Exception's handler is
# Starlette's last resort, a 500
EXCEPTION_HANDLERS = {
    RequestValidationError: on_validation_error,
    StarletteHTTPException: on_http_error,
    StoreHTTPError: on_store_error,
    ShardValidationError: on_shard_validation,
    PushRejected: on_push_rejected,
    GroupConflict: on_group_conflict,
    LakeError: on_lake_error,
    BadCursor: on_bad_cursor,
    ClientDisconnect: on_client_left,
    Exception: on_unexpected,
}
