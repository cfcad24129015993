"""The store as a broker: learners' misses in (POST /v1/wanted), generators' work out (GET /v1/wanted, a page at a time;
POST /v1/wanted/lease, each prompt to one generator), the served ledger that the lookup's serving policy reads (POST
/v1/served, GET /v1/groups/{id}/served), and lockstep co-trainers' heartbeats (POST, GET /v1/heartbeats)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from fastapi.concurrency import run_in_threadpool

from graft.schemas import (
    GROUP_ID_PATTERN,
    HEARTBEAT_PATH,
    LEASE_PATH,
    SERVED_PATH,
    WANTED_PATH,
    Heartbeat,
    HeartbeatRequest,
    LeaseRequest,
    ServedRequest,
    ServedResponse,
    WantedList,
    WantedRequest,
    WantedResponse,
)
from graft.services.store_api.broker import BadCursor, UnknownGroups, UnknownPrompts, WantedOrder
from graft.services.store_api.http.dependencies import StoreDep, require_token
from graft.services.store_api.http.errors import StoreHTTPError, error_responses

router = APIRouter(tags=["broker"])


@router.post(WANTED_PATH, response_model=WantedResponse, dependencies=[Depends(require_token)],
             responses=error_responses(400, 401, 404, 413, 415, 422))
async def post_wanted(req: WantedRequest, store: StoreDep) -> WantedResponse:
    """A learner's misses (its all-fail prompts with no peer group to graft): they become the generators' work until a
    group its rule takes (`rule`; none: an informative group of another model) lands for each. The first want of a
    prompt brings its problem; a want for a prompt the store has no problem of is refused (404), and nothing of the
    request is recorded."""
    try:
        return await run_in_threadpool(store.broker.want, req)  # fsync: off the event loop
    except UnknownPrompts as exc:
        raise StoreHTTPError(404, str(exc)) from exc


@router.get(WANTED_PATH, response_model=WantedList, responses=error_responses(400, 422))
def get_wanted(
    store: StoreDep,
    model: Annotated[str | None, Query(min_length=1, description="the asking generator's model id: wants it cannot "
                                                                 "serve are left out (its own as a learner, and those of "
                                                                 "learners whose peer_models leave it out)")] = None,
    order: Annotated[WantedOrder, Query(description="oldest want first, or most learners (then most misses) "
                                                    "first")] = "oldest",
    limit: Annotated[int, Query(ge=1, le=1024, description="at most this many prompts")] = 64,
    cursor: Annotated[str | None, Query(max_length=4096, description="a page's next_cursor: the page after it")] = None,
) -> WantedList:
    """The prompts learners want, with each problem's text and answer, a page at a time (a page costs its size, not
    the backlog's). A read: it leases nothing (POST /v1/wanted/lease does)."""
    try:
        return store.broker.wanted(model, order, limit, cursor)
    except BadCursor as exc:
        raise StoreHTTPError(400, str(exc)) from exc


@router.post(LEASE_PATH, response_model=WantedList, dependencies=[Depends(require_token)],
             responses=error_responses(400, 401, 413, 415, 422))
def lease_wanted(req: LeaseRequest, store: StoreDep) -> WantedList:
    """Work for one generator: wanted prompts its model can serve, each leased to it alone until a group of its model
    for the prompt lands in the store, or lease_s by the store's clock; another generator gets others meanwhile."""
    return store.broker.lease(req)


@router.post(SERVED_PATH, response_model=ServedResponse, dependencies=[Depends(require_token)],
             responses=error_responses(400, 401, 404, 413, 415, 422))
async def post_served(req: ServedRequest, store: StoreDep) -> ServedResponse:
    """Ledger entries: the groups a learner grafted at a step. Lookups with max_times_served or order least_served
    read them. A group this store never had is refused (404), and nothing of the request is recorded."""
    try:
        return await run_in_threadpool(store.broker.serve, req, store.index.queries)
    except UnknownGroups as exc:
        raise StoreHTTPError(404, str(exc)) from exc


@router.get("/v1/groups/{group_id}/served", response_model=dict[str, int], responses=error_responses(400, 404, 422))
def group_served(store: StoreDep, group_id: Annotated[str, Path(pattern=GROUP_ID_PATTERN)]) -> dict[str, int]:
    """How often the group was served, per learner (its ledger entries)."""
    if not store.index.queries.select_group(group_id):
        raise StoreHTTPError(404, f"no group {group_id!r} in this store")
    return store.broker.times_served(group_id)


@router.post(HEARTBEAT_PATH, status_code=204, dependencies=[Depends(require_token)],
             responses=error_responses(400, 401, 413, 415, 422))
def post_heartbeat(req: HeartbeatRequest, store: StoreDep) -> None:
    """A lockstep co-trainer lives (at req.step; waiting or not for its partners). Kept in memory only."""
    store.broker.heartbeats.beat(req)


@router.get(HEARTBEAT_PATH, response_model=dict[str, Heartbeat], responses=error_responses(400, 422))
def get_heartbeats(store: StoreDep, model: Annotated[list[str], Query(min_length=1, max_length=64,
                                                                      description="model ids (repeat the parameter)")]
                   ) -> dict[str, Heartbeat]:
    """The last heartbeat of each named model that has beaten since the store started."""
    return store.broker.heartbeats.of(model)
