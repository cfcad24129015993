"""Request and response models of the store API (v1): data, and the rule of which peer group a lookup accepts."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from graft.schemas.rollout import INT32_MAX, INT64_MAX, PROMPT_ID_PATTERN, Problem, Rollout, RolloutGroup

LOOKUP_PATH = "/v1/peer-groups/lookup"  # the trainer's hot call: the client's and the server's fast path
PUSH_PATH = "/v1/groups"  # the generators' push (its bodies have their own size limit: http/asgi.py)
MAX_LOOKUP_PROMPTS = 1024
MAX_PAGE_SIZE = 1000
MAX_PUSH_GROUPS = 512
MAX_WANTS = 1024  # wants or ledger entries in one POST /v1/wanted or /v1/served
WANTED_PATH = "/v1/wanted"
LEASE_PATH = "/v1/wanted/lease"
SERVED_PATH = "/v1/served"
HEARTBEAT_PATH = "/v1/heartbeats"
MAX_LEASE_S = 24 * 3600.0

PromptId = Annotated[str, Field(pattern=PROMPT_ID_PATTERN, description="prompt_id(problem text)")]
ServeOrder = Literal["freshest", "most_successes", "least_served"]
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class PeerLookupRequest(BaseModel):
    """The trainer's call: informative peer groups for many prompts at once (strict: `false` is no integer).

    `accepts` is the one rule of which peer group may be grafted: the store's lookup answers with the groups it
    accepts, and the trainer's gate and co-training wait test the groups they hold with it, so the three cannot
    drift apart."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt_ids: list[PromptId] = Field(min_length=1, max_length=MAX_LOOKUP_PROMPTS, description="prompts to find peer groups for")
    learner_model: str = Field(min_length=1, description="the asking model; its own groups are never returned")
    peer_models: list[str] | None = Field(
        default=None, min_length=1,
        description="accept only these peer models; null (the default): any model but the learner. An empty list "
                    "would accept none and is refused")
    informative_only: StrictBool = Field(default=True, description="only groups with 0 < successes < group size")
    min_successes: int = Field(default=1, ge=0, le=INT32_MAX, description="at least this many correct rollouts in a returned group")
    min_policy_step: int | None = Field(default=None, ge=0, le=INT64_MAX, description="only groups from peer policy step >= this")
    max_age_s: float | None = Field(default=None, gt=0, description="only groups created at most this many seconds ago")
    groups_per_prompt: int = Field(default=1, ge=1, le=16, description="most recent first: highest policy step, then newest")
    require_behaviour_logprobs: StrictBool = Field(
        default=False,
        description="only groups whose stored logprobs are their behaviour mu (schemas.mu_is_behaviour): none with "
                    "logprobs_mode 'none' or 'rescored_unverified', nor 'raw' away from temperature 1 untruncated")
    max_times_served: int | None = Field(
        default=None, ge=1, le=INT32_MAX,
        description="serving policy: skip groups the store's served ledger (POST /v1/served) holds this many times for "
                    "learner_model already; null: no cap. 0 would serve nothing and is refused")
    order: ServeOrder = Field(
        default="freshest",
        description="which accepted groups come first: freshest (highest policy step, then newest: the default), "
                    "most_successes (then freshest), least_served (fewest ledger entries for learner_model, then freshest)")

    def admits_source(self, model_id: str, policy_step: int, created_us: int, now_us: int) -> bool:
        """Who sampled the group and when: another model (one of peer_models when given), from a recent enough
        policy step, created recently enough (times in microseconds since the epoch)."""
        return (
            model_id != self.learner_model
            and (self.peer_models is None or model_id in self.peer_models)
            and (self.min_policy_step is None or policy_step >= self.min_policy_step)
            and (self.max_age_s is None or created_us >= now_us - self.max_age_s * 1e6)
        )

    def admits_behaviour(self, has_behaviour_logprobs: bool) -> bool:
        """Whether the group's mu is known when the request requires it (require_behaviour_logprobs): the group's
        `has_behaviour_logprobs` (the store's has_mu)."""
        return has_behaviour_logprobs or not self.require_behaviour_logprobs

    def admits_outcome(self, successes: int, group_size: int) -> bool:
        """What the group scored: informative (0 < successes < group size) when asked, and enough successes."""
        return (not self.informative_only or 0 < successes < group_size) and successes >= self.min_successes

    @staticmethod
    def informative_sql(successes: str = "successes", group_size: str = "group_size") -> str:
        """0 < successes < group size as a SQL condition on a table's columns (the store index counts and filters
        informative groups with it)."""
        return f"{successes} > 0 AND {successes} < {group_size}"

    def outcome_sql(self, successes: str = "successes", group_size: str = "group_size") -> str:
        """`admits_outcome` as a SQL condition on a table's columns."""
        informative = [self.informative_sql(successes, group_size)] if self.informative_only else []
        return " AND ".join([*informative, f"{successes} >= {int(self.min_successes)}"])

    def accepts(self, model_id: str, policy_step: int, successes: int, group_size: int, created_us: int, now_us: int,
                has_behaviour_logprobs: bool) -> bool:
        """Whether a stored group with these properties answers this request (`admits_source`, `admits_behaviour`
        and `admits_outcome`)."""
        return (self.admits_source(model_id, policy_step, created_us, now_us)
                and self.admits_behaviour(has_behaviour_logprobs) and self.admits_outcome(successes, group_size))

    def accepts_group(self, group: RolloutGroup, now_us: int) -> bool:
        """`accepts` for a group in hand."""
        return self.accepts(group.model_id, group.policy_step, group.successes, len(group.rollouts),
                            group_created_us(group), now_us, group.has_behaviour_logprobs)


def now_us() -> int:
    """Now, in the store index's unit: microseconds since the epoch."""
    return time.time_ns() // 1000


def group_created_us(group: RolloutGroup) -> int:
    """When the group was created, as the store index has it: its newest row's created_at, in microseconds since
    the epoch."""
    return (max(r.created_at for r in group.rollouts) - EPOCH) // timedelta(microseconds=1)


# Why a lookup found no group for a prompt (PeerLookupResponse.miss_reasons), in the order the store tests them.
MISS_REASONS = {
    "nothing_stored": "the store holds no group of the prompt",
    "only_learner": "every stored group is the learner's own (its model id is learner_model)",
    "peers_not_admitted": "other models' groups are stored, none from a peer the request admits (peer_models, "
                          "min_policy_step, max_age_s)",
    "only_without_mu": "admitted peers' groups are stored, none whose logprobs are behaviour mu "
                       "(require_behaviour_logprobs; schemas.mu_is_behaviour)",
    "only_uninformative": "admitted peers' groups are stored, none with an outcome the request admits (all-fail, or "
                          "all-success under informative_only, or fewer than min_successes)",
    "served_out": "groups the request accepts are stored, each served to the learner max_times_served times already",
}


class PeerLookupResponse(BaseModel):
    groups: list[RolloutGroup] = Field(description="whole groups, grouped by prompt in request order, most recent first")
    misses: list[str] = Field(description="requested prompt ids with no matching group")
    miss_reasons: dict[str, str] = Field(
        default_factory=dict,
        description="why each missed prompt got nothing: " + "; ".join(f"{k}: {v}" for k, v in MISS_REASONS.items())
                    + " (empty from a store older than this field)")


class PushGroupsRequest(BaseModel):
    """Push ingest for writers without the shared volume."""

    model_config = ConfigDict(extra="forbid")

    groups: list[RolloutGroup] = Field(min_length=1, max_length=MAX_PUSH_GROUPS, description="whole groups to store")
    problems: list[Problem] = Field(default_factory=list, description="problems of these groups, stored once per dataset")


class PushGroupsResponse(BaseModel):
    accepted_groups: int = Field(description="groups written to a new shard")
    duplicate_groups: list[str] = Field(description="group ids already stored (same model and prompt), not written again")
    shard: str | None = Field(description="path of the new shard relative to the store root, if any")


class RolloutPage(BaseModel):
    rollouts: list[Rollout]
    next_cursor: str | None = Field(description="pass as `cursor` for the next page; null on the last page")


class ModelStats(BaseModel):
    model_id: str
    groups: int
    rollouts: int
    prompts: int
    success_rate: float | None = Field(description="mean reward over scored rollouts; null when none is scored")
    informative_groups: int
    max_policy_step: int
    newest_created_at: datetime | None


class LakeStats(BaseModel):
    """Where a lake replica stands (`graft-store serve --backend lake`)."""

    catalog: str = Field(description="the lake's catalog, password hidden")
    data_path: str | None = Field(description="where its data files live")
    snapshot_id: int | None = Field(description="the newest lake snapshot this replica has read into its cache")
    snapshot_at: datetime | None = Field(description="when that snapshot was committed")
    snapshot_age_s: float | None = Field(description="seconds since that snapshot was committed")
    newest_snapshot_id: int | None = Field(description="the lake's newest snapshot when the replica last looked")
    checked_at: datetime | None = Field(description="when the replica last reached the lake")
    error: str | None = Field(default=None, description="why the last attempt to follow the lake failed, if it did; "
                                                        "the replica keeps serving its cache meanwhile")
    unreadable_snapshots: list[int] = Field(default_factory=list, description="snapshots whose data files could not be "
                                                                             "read (retried); their groups are missing here")


def utf8_text(*texts: str) -> None:
    """Refuse text that is not valid UTF-8 (a lone surrogate, which JSON's \\ud800 escapes can carry): the store keeps
    and answers with what it is sent."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{text[:40]!r} is not valid UTF-8 text ({exc.reason}): send it as UTF-8") from None


class Want(BaseModel):
    """One prompt a learner missed: the generators' work (POST /v1/wanted)."""

    model_config = ConfigDict(extra="forbid")

    prompt_id: PromptId
    reason: str = Field(default="nothing_stored", description="why the learner's lookup missed it: one of MISS_REASONS")
    problem: Problem | None = Field(
        default=None, description="the problem, so that a generator can sample it; required the first time the store "
                                  "hears of the prompt (its prompt_id must be prompt_id(problem))")

    @model_validator(mode="after")
    def _known_reason_and_problem(self) -> Want:
        if self.reason not in MISS_REASONS:
            raise ValueError(f"reason {self.reason!r} is none of {', '.join(MISS_REASONS)}")
        if self.problem is not None:
            utf8_text(self.problem.problem, self.problem.answer)
        if self.problem is not None and self.problem.prompt_id != self.prompt_id:
            raise ValueError(f"the problem's prompt_id is {self.problem.prompt_id}, not {self.prompt_id}: send the "
                             "problem whose text hashes to the wanted id")
        return self


class WantRule(BaseModel):
    """Which peer groups the wanting learner takes (the rule of its lookups, posted with its wants): only a group it
    would take clears its want, and a generator whose model it would not take is not handed it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    peer_models: list[str] | None = Field(default=None, min_length=1, description="only these models' groups (null: any model but the learner)")
    max_policy_lag: int | None = Field(default=None, ge=0, le=INT64_MAX, description="only groups from policy step >= the learner's newest step (as it reports them) - this")
    require_behaviour_logprobs: StrictBool = Field(default=False, description="only groups whose rows carry behaviour logprobs (mu)")
    informative_only: StrictBool = Field(default=True, description="only groups with 0 < successes < group size (false: all-success ones too)")
    max_times_served: int | None = Field(default=None, ge=1, le=INT32_MAX, description="only groups served to the learner fewer times than this")

    def admits_model(self, learner_model: str, model_id: str) -> bool:
        """Whether a group of `model_id` can be one the learner takes (a generator of that model can serve it)."""
        return model_id != learner_model and (self.peer_models is None or model_id in self.peer_models)

    def takes(self, learner_model: str, learner_step: int, model_id: str, policy_step: int, successes: int,
              group_size: int, has_behaviour_logprobs: bool, times_served: int) -> bool:
        """Whether the learner, at its step `learner_step`, takes a group with these properties (its lookup's rule,
        PeerLookupRequest.accepts, but the wall-clock bound, which a want outlives)."""
        lookup = PeerLookupRequest.model_construct(
            learner_model=learner_model, peer_models=self.peer_models, informative_only=self.informative_only,
            min_successes=1, max_age_s=None, require_behaviour_logprobs=self.require_behaviour_logprobs,
            min_policy_step=None if self.max_policy_lag is None else max(0, learner_step - self.max_policy_lag))
        return (lookup.accepts(model_id, policy_step, successes, group_size, 0, 0, has_behaviour_logprobs)
                and (self.max_times_served is None or times_served < self.max_times_served))


class WantedRequest(BaseModel):
    """A learner's misses, to become the generators' work."""

    model_config = ConfigDict(extra="forbid", strict=True)

    learner_model: str = Field(min_length=1, description="the learner that missed them (groups of its own never clear a want)")
    policy_step: int = Field(ge=0, le=INT64_MAX, description="the learner's policy step at the miss")
    wants: list[Want] = Field(min_length=1, max_length=MAX_WANTS)
    rule: WantRule | None = Field(default=None, description="which groups the learner takes (null: any informative group of another model); the learner's newest rule holds for all its wants")

    @model_validator(mode="after")
    def _utf8(self) -> WantedRequest:
        utf8_text(self.learner_model)
        return self


class WantedResponse(BaseModel):
    recorded: int = Field(description="wants recorded (new or seen again)")
    backlog: int = Field(description="prompts wanted now, all learners")


class WantedPrompt(BaseModel):
    """A wanted prompt, as a generator sees it (GET /v1/wanted)."""

    prompt_id: str
    dataset: str
    problem: str = Field(description="the problem text to sample")
    answer: str = Field(description="its gold answer, to score with")
    learners: list[str] = Field(description="the learners that want it (its wanted-by count is their number)")
    reasons: list[str] = Field(description="why their lookups missed it, one per learner")
    first_wanted_at: datetime = Field(description="when the first of them first missed it")
    last_wanted_at: datetime = Field(description="when one of them last missed it")
    misses: int = Field(description="lookups that missed it, all learners together")


class WantedList(BaseModel):
    prompts: list[WantedPrompt]
    backlog: int = Field(description="prompts wanted now, all learners")
    next_cursor: str | None = Field(default=None, description="where the next page starts (null: this was the last); a "
                                                              "page may hold fewer prompts than asked and still have one")


class LeaseRequest(BaseModel):
    """A generator takes wanted prompts to sample: each is leased to it alone until it has stored a group of the prompt,
    or for lease_s at most (then another may take it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_id: str = Field(min_length=1, description="the model the generator samples (wants it cannot serve are left out: its own as a learner, and those of learners whose peer_models leave it out)")
    generator_id: str = Field(min_length=1, description="who holds the leases")
    limit: int = Field(default=64, ge=1, le=1024, description="at most this many prompts")
    order: Literal["oldest", "most_wanted"] = Field(default="oldest", description="oldest want first, or most learners (then most misses) first")
    lease_s: float = Field(gt=0, le=MAX_LEASE_S, description="how long the prompts are this generator's alone (by the store's clock)")

    @model_validator(mode="after")
    def _utf8(self) -> LeaseRequest:
        utf8_text(self.model_id, self.generator_id)
        return self


class HeartbeatRequest(BaseModel):
    """A trainer that lives (lockstep co-training): its step, and whether it waits for its partners."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model_id: str = Field(min_length=1, description="the trainer's model id (what its partners name in peer_models)")
    step: int = Field(ge=0, le=INT64_MAX, description="the policy step it is at")
    waiting: StrictBool = Field(description="whether it is waiting for its partners' groups of that step")

    @model_validator(mode="after")
    def _utf8(self) -> HeartbeatRequest:
        utf8_text(self.model_id)
        return self


class Heartbeat(BaseModel):
    """A trainer's last heartbeat as the store holds it (in memory: a restarted store has none until the next)."""

    model_id: str
    beats: int = Field(description="heartbeats received from it since the store started: a change is a sign of life")
    step: int
    waiting: bool
    age_s: float = Field(description="seconds since the store received it, by the store's own clock")


class ServedRequest(BaseModel):
    """Ledger entries: the groups a learner grafted at a step (the serving policy of later lookups reads them)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    learner_model: str = Field(min_length=1)
    policy_step: int = Field(ge=0, le=INT64_MAX, description="the learner's policy step that grafted them")
    group_ids: list[str] = Field(min_length=1, max_length=MAX_WANTS, description="groups of this store")

    @model_validator(mode="after")
    def _utf8(self) -> ServedRequest:
        utf8_text(self.learner_model, *self.group_ids)
        return self


class ServedResponse(BaseModel):
    recorded: int = Field(description="ledger entries added")


class BrokerStats(BaseModel):
    """Wanted prompts and the served ledger (`graft-store stats`, /v1/stats, the browser)."""

    backlog_prompts: int = Field(description="prompts wanted now")
    backlog_wants: int = Field(description="(prompt, learner) wants open now")
    wants_recorded: int = Field(description="wants ever recorded (a want seen again counts once)")
    wants_cleared: int = Field(description="wants an informative group from another model cleared")
    wants_evicted: int = Field(description="wants dropped, oldest first, to keep at most max_wanted open")
    want_to_group_s_p50: float | None = Field(description="median seconds from a want to the group that cleared it (recent wants)")
    want_to_group_s_p90: float | None
    within_steps: int = Field(description="N of served_within_steps_share")
    served_within_steps_share: float | None = Field(
        description="of the recent wants the learner has had N steps to see served: the share cleared within N of its steps")
    ledger_entries: int = Field(description="served ledger entries, all learners")
    ledger_groups: int = Field(description="distinct groups in the ledger")


class StatsResponse(BaseModel):
    models: list[ModelStats]
    files: int
    quarantined_files: int
    total_groups: int
    total_rollouts: int
    last_ingest_at: datetime | None = Field(description="when the ingest loop last indexed a new shard")
    duplicate_groups: int = Field(default=0, description="group ids met again in a later shard: kept once, skipped there")
    conflicting_groups: int = Field(
        default=0, description="group ids met again in a later shard under another model or prompt: the first kept, "
                               "the other skipped and logged as an error")
    backend: str = Field(default="local", description="'local' (shards on this disk) or 'lake' (a replica of a DuckLake)")
    lake: LakeStats | None = Field(default=None, description="the lake this replica follows (backend 'lake')")
    broker: BrokerStats | None = Field(default=None, description="wanted prompts and the served ledger")


class HealthResponse(BaseModel):
    status: str = Field(description="'ok' when the index is open and the ingest loop is alive")
    version: str
    groups: int


class ErrorResponse(BaseModel):
    error: str = Field(description="what went wrong, and what to do about it")
    detail: list[dict] | None = Field(default=None, description="per-field validation errors, when there are any")
