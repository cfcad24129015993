"""Stored rollouts matching filters, a page at a time."""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from graft.schemas import MAX_PAGE_SIZE, PROMPT_ID_PATTERN, RolloutPage
from graft.schemas.rollout import INT64_MAX
from graft.services.store_api.http.dependencies import StoreDep
from graft.services.store_api.http.errors import ERROR_RESPONSES, StoreHTTPError
from graft.services.store_api.http.responses import ARROW_CONTENT, arrow_response, json_response, wants_arrow

router = APIRouter()


@router.get("/v1/rollouts", response_model=RolloutPage, tags=["rollouts"],
            responses={200: {"content": ARROW_CONTENT}, **ERROR_RESPONSES})
def rollouts(
    request: Request,
    store: StoreDep,
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
    table, next_cursor = store.index.queries.rollout_page(
        model=model, prompt_id=prompt_id, dataset=dataset, correct=correct, min_reward=min_reward,
        max_reward=max_reward, min_policy_step=min_policy_step, max_policy_step=max_policy_step,
        cursor=cursor, limit=limit,
    )
    if wants_arrow(request):
        return arrow_response(table, {"next_cursor": orjson.dumps(next_cursor).decode()})
    return json_response({"rollouts": table.to_pylist(), "next_cursor": next_cursor})
