"""What the routes take from the app they serve (FastAPI dependencies): its store, its metrics, and the bearer token
check for writes. `create_app` puts the store and the metrics on `app.state`. (async: FastAPI calls a plain `def`
dependency on its thread pool, a hand-off per request.)"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from graft.services.store_api.backend import Store
from graft.services.store_api.http.errors import StoreHTTPError
from graft.services.store_api.http.metrics import StoreMetrics


async def get_store(request: Request) -> Store:
    return request.app.state.store


async def get_metrics(request: Request) -> StoreMetrics:
    return request.app.state.metrics


StoreDep = Annotated[Store, Depends(get_store)]
MetricsDep = Annotated[StoreMetrics, Depends(get_metrics)]

bearer = HTTPBearer(auto_error=False, description="this store's GRAFT_STORE_TOKEN: required for writes (POST /v1/groups)")


def require_token(request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> None:
    token = request.app.state.settings.token
    if token is None:
        return
    if credentials is None:
        raise StoreHTTPError(401, "this store requires a bearer token for writes: send 'Authorization: Bearer <token>'")
    if not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
        raise StoreHTTPError(401, "wrong bearer token: use the store's GRAFT_STORE_TOKEN")
