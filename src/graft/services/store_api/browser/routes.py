"""The trajectory browser: a read-only web page at /ui/ and the aggregate endpoints it reads, on the store's app.

The page is three static files (ui/: index.html, app.js, app.css; no build step, nothing fetched from elsewhere)
that call the REST API: /v1/stats, /v1/prompts/{id}/groups and /v1/groups/{id} as they are, and the endpoints
below where a view needs an aggregate. Reads need no token, so the page works on a store with one.

The store's app includes `router` (errors answer as its ErrorResponse), mounts `UI_FILES` at /ui/static before it
(the page route below takes every other /ui/ path), and puts the browser's queries (`open_browse`) on
`app.state.browse`, which the routes take through `get_browse`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from graft.schemas import GROUP_ID_PATTERN, PROMPT_ID_PATTERN
from graft.schemas.browse import (
    MAX_PROMPT_PAGE,
    MAX_STEP_BINS,
    DatasetsResponse,
    GroupTokens,
    Outcome,
    PromptDetail,
    PromptPage,
    StepCurves,
)
from graft.services.store_api.browser.queries import Browse
from graft.services.store_api.browser.tokens import TokenizerShelf
from graft.services.store_api.local import StoreIndex

UI_DIR = Path(__file__).parent / "ui"
UI_FILES = StaticFiles(directory=UI_DIR)
NO_STORE = {"Cache-Control": "no-cache"}  # revalidate: a restarted store may serve a newer page

ModelName = Annotated[str | None, Query(min_length=1, max_length=256, description="model_id")]


def open_browse(index: StoreIndex, tokenizer_paths: list[Path]) -> Browse:
    """The browser's queries over `index`; the tokenizers of `tokenizer_paths` start loading now (ValueError for a
    path that does not exist)."""
    tokenizers = TokenizerShelf(tokenizer_paths)
    tokenizers.load_in_background()
    return Browse(index, tokenizers)


async def get_browse(request: Request) -> Browse:
    return request.app.state.browse


BrowseDep = Annotated[Browse, Depends(get_browse)]

router = APIRouter(tags=["browse"])


@router.get("/v1/prompts", response_model=PromptPage)
def prompts(
    browse: BrowseDep,
    q: Annotated[str | None, Query(max_length=256, description="prompt id prefix, or a piece of the problem text "
                                                               "(case-insensitive)")] = None,
    dataset: Annotated[str | None, Query(min_length=1, max_length=256, description="only prompts with groups of "
                                                                                   "this dataset")] = None,
    model: ModelName = None,
    outcome: Annotated[Outcome | None, Query(description="correctness of the rollouts of `model` (every model "
                                                         "without it): none, some, every one, at least one correct")] = None,
    failed_by: Annotated[str | None, Query(min_length=1, max_length=256, description=(
        "model A: prompts where A has groups, none of A's rollouts is correct, and POST /v1/peer-groups/lookup "
        "with learner_model A (peer_models [solved_by] if given, other fields at their defaults) finds a group: "
        "the prompts GRAFT grafts for A"))] = None,
    solved_by: Annotated[str | None, Query(min_length=1, max_length=256, description="model B: the peer of "
                                                                                     "`failed_by`")] = None,
    cursor: Annotated[str | None, Query(max_length=64, description="next_cursor of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PROMPT_PAGE, description="page size")] = 50,
) -> PromptPage:
    """Prompts matching every filter given, the one with the newest ingested group first, a page at a time.

    A prompt that gets a new group moves to the top of the first page. A page may hold fewer than `limit`
    prompts while next_cursor is set (the store bounds the work per page); the last page has next_cursor null.
    """
    if solved_by is not None and failed_by is None:
        raise HTTPException(422, "solved_by needs failed_by: the learner whose all-fail prompts the peer solves")
    if solved_by is not None and solved_by == failed_by:
        raise HTTPException(422, f"failed_by and solved_by are both {failed_by!r}: the lookup never returns a "
                                 "model's own groups to it")
    return browse.prompt_page(q=q, dataset=dataset, model=model, outcome=outcome, failed_by=failed_by,
                              solved_by=solved_by, cursor=cursor, limit=limit)


@router.get("/v1/prompts/{prompt_id}", response_model=PromptDetail)
def prompt(browse: BrowseDep,
           prompt_id: Annotated[str, PathParam(pattern=PROMPT_ID_PATTERN, description="prompt_id(problem text)")]
           ) -> PromptDetail:
    """One prompt: its stored problem text and gold answer (per dataset), and per model its group counts.

    Its groups: GET /v1/prompts/{prompt_id}/groups?model=...
    """
    detail = browse.prompt_detail(prompt_id)
    if detail is None:
        raise HTTPException(404, f"no prompt {prompt_id} in this store: no group and no problem has this id")
    return detail


@router.get("/v1/stats/steps", response_model=StepCurves)
def step_curves(
    browse: BrowseDep,
    bins: Annotated[int, Query(ge=1, le=MAX_STEP_BINS, description="at most this many points per model")] = 200,
) -> StepCurves:
    """Per model and policy step (steps binned to at most `bins` points): groups, rollouts, success rate
    (mean reward over scored rollouts, as /v1/stats) and informative groups."""
    return browse.step_curves(bins)


@router.get("/v1/datasets", response_model=DatasetsResponse)
def datasets(browse: BrowseDep) -> DatasetsResponse:
    """Every dataset with groups or stored problems: prompts, groups, rollouts, problems."""
    return browse.datasets()


@router.get("/v1/groups/{group_id}/tokens", response_model=GroupTokens)
def group_tokens(
    browse: BrowseDep,
    group_id: Annotated[str, PathParam(pattern=GROUP_ID_PATTERN, description="schemas.Rollout.group_id")],
    rollout_id: Annotated[str | None, Query(min_length=1, max_length=256, description="only this rollout")] = None,
) -> GroupTokens:
    """The text of each token of a group's rollouts, decoded with the model's tokenizer when the store has it
    (`graft-store serve --tokenizer DIR`, matched by fingerprint to the rows' tokenizer_id); otherwise no
    pieces and a note saying so. Token ids and logprobs: GET /v1/groups/{group_id}."""
    tokens = browse.group_tokens(group_id, rollout_id)
    if tokens is None:
        what = f"rollout {rollout_id!r} in group {group_id!r}" if rollout_id else f"group {group_id!r}"
        raise HTTPException(404, f"no {what} in this store")
    return tokens


# ------------------------------------------------------------------ the page


@router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    return RedirectResponse("/ui/")


@router.get("/ui", include_in_schema=False)
def ui_root() -> RedirectResponse:
    return RedirectResponse("/ui/")


@router.get("/ui/{view:path}", include_in_schema=False)
def page(view: str) -> FileResponse:
    """Every view is the same page: app.js reads the path and query (links hold the whole state)."""
    return FileResponse(UI_DIR / "index.html", headers=NO_STORE)
