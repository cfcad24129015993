"""The store's health, its stats, and its Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from graft.schemas import HealthResponse, StatsResponse
from graft.services.store_api.http import VERSION
from graft.services.store_api.http.dependencies import MetricsDep, StoreDep

router = APIRouter()


@router.get("/v1/health", response_model=HealthResponse, tags=["meta"])
def health(request: Request, store: StoreDep) -> HealthResponse:
    """'ok' when the index is open and the ingest loop runs."""
    background = request.app.state.background
    status = "ok" if background is not None and background.alive() else "degraded"
    return HealthResponse(status=status, version=VERSION, groups=store.index.queries.group_count())


@router.get("/v1/stats", response_model=StatsResponse, tags=["meta"])
def stats(store: StoreDep) -> StatsResponse:
    """Counts per model, success rates, files, quarantined files, duplicates and ingest freshness."""
    return store.stats()


@router.get("/metrics", include_in_schema=False)
def metrics(store_metrics: MetricsDep) -> Response:
    return Response(generate_latest(store_metrics.registry), media_type=CONTENT_TYPE_LATEST)
