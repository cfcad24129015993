"""Response models of the aggregates the trajectory browser reads (v1). Data only.

The browser (`/ui/`) reads every number it shows from the REST API: `/v1/stats`, `/v1/prompts/{id}/groups`
and `/v1/groups/{id}` as they were, and these aggregates, which the API had no endpoint for.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

MAX_PROMPT_PAGE = 200  # prompts per page of GET /v1/prompts
MAX_STEP_BINS = 1000  # points per model of GET /v1/stats/steps

# which rollouts of a prompt count for the correctness filter: none correct, some of each, all correct, any correct
Outcome = Literal["all_fail", "mixed", "all_correct", "solved"]


class PromptModelSummary(BaseModel):
    model_id: str
    groups: int
    rollouts: int
    successes: int = Field(description="correct rollouts (reward > 0)")
    informative_groups: int = Field(description="groups with 0 < successes < group size")
    min_policy_step: int
    max_policy_step: int
    newest_created_at: datetime | None = Field(description="newest created_at of this model's rollouts of the prompt")


class PromptSummary(BaseModel):
    prompt_id: str
    dataset: str = Field(description="dataset of the prompt's newest group")
    problem: str | None = Field(description="problem text; null when the store holds no problem file for it")
    answer: str | None = Field(description="gold answer; null when the store holds no problem file for it")
    groups: int
    rollouts: int
    successes: int = Field(description="correct rollouts (reward > 0), every model")
    models: list[PromptModelSummary] = Field(description="per model, by model id")


class PromptPage(BaseModel):
    prompts: list[PromptSummary] = Field(description="prompts with the newest ingested group first")
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last page")


class StoredProblem(BaseModel):
    """A problem as its file holds it (the browser shows what is stored, even a problem whose id does not match)."""

    dataset: str
    problem: str
    answer: str


class PromptDetail(BaseModel):
    prompt_id: str
    problems: list[StoredProblem] = Field(description="the stored problem text and gold answer, per dataset")
    models: list[PromptModelSummary] = Field(description="every model with groups of this prompt, by model id")


class StepPoint(BaseModel):
    step_min: int = Field(description="lowest policy step in this bin")
    step_max: int = Field(description="highest policy step in this bin")
    groups: int
    rollouts: int
    success_rate: float | None = Field(description="mean reward over the bin's scored rollouts")
    informative_groups: int = Field(description="groups with 0 < successes < group size")


class ModelCurve(BaseModel):
    model_id: str
    points: list[StepPoint] = Field(description="bins with groups, by policy step")


class StepCurves(BaseModel):
    bin_width: int = Field(description="policy steps per bin (1: a point per step)")
    models: list[ModelCurve]


class DatasetSummary(BaseModel):
    dataset: str
    prompts: int = Field(description="prompts with at least one group")
    groups: int
    rollouts: int
    problems: int = Field(description="problems stored for this dataset (with or without groups)")


class DatasetsResponse(BaseModel):
    datasets: list[DatasetSummary]


class RolloutTokens(BaseModel):
    rollout_id: str
    pieces: list[str] | None = Field(
        description="the text each token adds to the decoded completion, aligned with completion_token_ids ('' for a "
                    "token that ends inside a multi-byte character: the token completing it carries the character); "
                    "null when the store does not have the tokenizer")
    special: list[bool] | None = Field(description="whether each token is a special token (EOS and the like)")


class GroupTokens(BaseModel):
    group_id: str
    tokenizer_id: str
    decoded: bool = Field(description="whether `pieces` come from the tokenizer with this fingerprint")
    note: str = Field(description="what the pieces are, or why there are none; and when the rows have no behaviour "
                                  "logprobs, that they have none")
    behaviour_logprobs: bool = Field(
        default=True, description="whether the rows carry behaviour logprobs (false: logprobs_mode 'none', mu unknown: "
                                  "no token has a probability to show)")
    rollouts: list[RolloutTokens]
