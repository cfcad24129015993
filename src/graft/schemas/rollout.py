"""One stored rollout, a rollout group, a problem, and the one Arrow schema they map to.

A row's behaviour logprobs (mu, docs/algorithm.md section 5) may be unknown: a text-only trace or an API without logprobs
(docs/algorithm.md section 11). Such a row says so with `logprobs_mode = "none"`, an empty `token_logprobs` and a null
`logprob_sum` (no placeholder a reader could take for a logprob); a group is all with mu or all without. A row may
also keep the prompt its completion followed (`prompt_text`, `prompt_token_ids`: an imported trace's own prompt, which
a rescoring conditions on), beside the problem its `prompt_id` names.
Versions: 2 added logprobs_mode 'none' (its logprob_sum then 0.0); 3 made that logprob_sum null and added the two
prompt columns (last in the schema, nullable). Rows of versions 1 and 2 read unchanged: a shard without the prompt
columns reads them as null, and a version-2 row without mu keeps its 0.0.

Every writer and reader of the store uses `ROLLOUT_ARROW_SCHEMA`, which is derived from the
`Rollout` model below (each field carries its Arrow type as annotation metadata), so the pydantic
model and the Parquet files cannot drift apart. Data only: no I/O, no torch.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

SCHEMA_VERSION = 3  # 2: logprobs_mode 'none'; 3: its logprob_sum null, the prompt columns; older rows read unchanged
NULL_LOGPROB_SUM_VERSION = 3  # rows of this version on store a null logprob_sum without mu (version 2: 0.0)
# columns added after version 1, nullable, last in the schema: a shard written before them reads them as null
ADDED_COLUMNS = ("prompt_text", "prompt_token_ids")
ADVANTAGE_EPS = 1e-6  # docs/algorithm.md section 2: A = (r - mean) / (std + eps)
ADVANTAGE_TOLERANCE = 1e-3  # stored advantages are float32; recomputed ones must agree to this
LOGPROB_TOLERANCE = 1e-6  # a logprob may exceed 0 by this much (rounding in the sampler)
# A group id is a URL path segment (GET /v1/groups/{group_id}): no '/', no '.' or '..', bounded length.
GROUP_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$"
PROMPT_ID_PATTERN = r"^[0-9a-f]{16}$"  # prompt_id(problem text): 16 lowercase hex characters
ARROW_MEDIA_TYPE = "application/vnd.apache.arrow.stream"  # the store's Arrow IPC bodies and answers
# "<group_id>-<position in the group>": unique in the whole store wherever group ids are
ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}-(0|[1-9][0-9]{0,9})$"
SAFE_NAME_PATTERN = r"^[A-Za-z0-9._\-]+$"  # model ids and dataset names of problems name directories
CLOCK_SKEW_S = 300.0  # created_at may lie this far in the future (writers' clocks differ), no further
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38  # larger finite floats become inf in a float32 column
FLOAT32_TINY = 1.401298464324817e-45  # smaller positive floats become 0 in a float32 column
NO_LOGPROBS = "none"  # logprobs_mode of a row whose behaviour logprobs (mu) are unknown
# logprobs_mode of a row whose mu was computed after the fact (graft-rescore): the weights model_revision names,
# teacher-forced on the stored tokens at the row's temperature (top_p, top_k), those weights shown to be the ones that
# wrote the trace (their fingerprint is the source rows' model_revision): an ordinary row with mu to the trainers
RESCORED = "rescored"
# logprobs_mode of a row rescored by weights not shown to be the ones that sampled the trace: its logprobs are another
# model's, mu to the trainers only when a setting says so (graft.trust_unverified_mu)
RESCORED_UNVERIFIED = "rescored_unverified"
PROCESSED = "processed"  # logprobs of the distribution sampled from (after temperature, top-p, top-k): mu itself
RAW = "raw"  # the model's own (temperature 1, untruncated) logprobs: mu only where the sampling changed nothing
MU_FIELDS = ("logprobs_mode", "temperature", "top_p", "top_k")  # what mu_is_behaviour reads of a row


def mu_is_behaviour(row: Rollout | Mapping[str, Any], *, trust_unverified: bool = False) -> bool:
    """Whether a stored row's token_logprobs are its behaviour logprobs mu (docs/algorithm.md section 5), by the row's own
    `logprobs_mode`, `temperature`, `top_p` and `top_k` (a Rollout, or a row as a mapping): the one rule every trainer
    and the store's lookup apply. 'processed' and 'rescored': yes. 'raw' (the model's own distribution): only where
    sampling changed nothing, temperature 1 without top-p or top-k truncation (greedy rows are 'raw' and not mu: their
    behaviour policy put all its mass on one token). 'rescored_unverified': only with `trust_unverified` (a trainer's
    setting, graft.trust_unverified_mu). 'none', and any mode this version does not know: never.

    A row whose mu is not behaviour is grafted as a row without mu (b = 1, w = 1, docs/algorithm.md section 11)."""
    field = row.get if isinstance(row, Mapping) else lambda name: getattr(row, name)
    mode = field("logprobs_mode")
    if mode in (PROCESSED, RESCORED):
        return True
    if mode == RESCORED_UNVERIFIED:
        return trust_unverified
    if mode == RAW:
        top_k = field("top_k")
        return field("temperature") == 1.0 and field("top_p") >= 1.0 and (top_k is None or top_k <= 0)
    return False


# The trainers that publish groups of their own sampling name them "<trainer>:<run>" in generator_id; a generator that
# writes beside them under the same model id (following a trainer's checkpoints) tells them from its own by it.
TRAINERS = ("graft-train", "trl", "verl")


def trainer_generator_id(trainer: str, run: str) -> str:
    """The generator_id of the groups trainer `trainer` (one of TRAINERS) publishes of its own sampling in run `run`."""
    if trainer not in TRAINERS:
        raise ValueError(f"{trainer!r} is none of the trainers that publish their own groups: {', '.join(TRAINERS)}")
    return f"{trainer}:{run}"


def is_trainers_own(generator_id: str | None) -> bool:
    """Whether a group's generator_id says a trainer published it of its own sampling (trainer_generator_id)."""
    trainer, colon, _ = (generator_id or "").partition(":")
    return bool(colon) and trainer in TRAINERS


def rollout_id(group_id: str, position: int) -> str:
    """The id of the rollout at `position` (0-based) of group `group_id`."""
    return f"{group_id}-{position}"


def prompt_id(problem_text: str) -> str:
    """First 16 hex chars of sha256 of the UTF-8 problem text stripped of surrounding whitespace."""
    return hashlib.sha256(problem_text.strip().encode("utf-8")).hexdigest()[:16]


def group_advantages(rewards: list[float | None], std_normalize: bool = True) -> list[float]:
    """GRPO group advantages: (r - mean) / (std + 1e-6), unbiased std; Dr. GRPO without the std.

    Rollouts whose reward is null (gold not parseable) get advantage 0 and are left out of the
    statistics. A group with fewer than two scored rollouts has no signal: all zeros.
    """
    scored = [r for r in rewards if r is not None]
    if len(scored) < 2:
        return [0.0] * len(rewards)
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / (len(scored) - 1))
    scale = 1.0 / (std + ADVANTAGE_EPS) if std_normalize else 1.0
    return [0.0 if r is None else (r - mean) * scale for r in rewards]


class Arrow:
    """Annotation metadata: the Arrow type a field is stored as."""

    def __init__(self, type_: pa.DataType, nullable: bool = False):
        self.type = type_
        self.nullable = nullable


FinishReason = Literal["stop", "length", "abort"]


class Rollout(BaseModel):
    """One stored rollout: one row of a Parquet shard (docs/ARCHITECTURE.md, "One stored rollout")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # identity
    rollout_id: Annotated[str, Arrow(pa.string())] = Field(
        pattern=ROLLOUT_ID_PATTERN, description="'<group_id>-<i>', i its 0-based position in the group: unique in the store")
    group_id: Annotated[str, Arrow(pa.string())] = Field(
        pattern=GROUP_ID_PATTERN,
        description="id shared by the rollouts of one group, unique in the store: 1-128 of [A-Za-z0-9._:-], starting with "
                    "a letter or digit (it is a URL path segment)")
    prompt_id: Annotated[str, Arrow(pa.string())] = Field(pattern=PROMPT_ID_PATTERN, description="prompt_id(problem text)")
    dataset: Annotated[str, Arrow(pa.string())] = Field(min_length=1, description="dataset the prompt comes from")
    # provenance
    model_id: Annotated[str, Arrow(pa.string())] = Field(min_length=1, pattern=SAFE_NAME_PATTERN, description="model that generated it (a path-safe name)")
    model_revision: Annotated[str, Arrow(pa.string())] = Field(default="", description="checkpoint revision or hash")
    tokenizer_id: Annotated[str, Arrow(pa.string())] = Field(min_length=1, description="tokenizer the token ids belong to")
    policy_step: Annotated[int, Arrow(pa.int64())] = Field(default=0, ge=0, le=INT64_MAX, description="training step of the behaviour policy")
    generator_id: Annotated[str, Arrow(pa.string())] = Field(default="", description="process that generated it")
    created_at: Annotated[datetime, Arrow(pa.timestamp("us", tz="UTC"))] = Field(
        default_factory=lambda: datetime.now(timezone.utc),
        description=f"when it was generated (UTC); at most {CLOCK_SKEW_S:.0f} s ahead of the store's clock")
    schema_version: Annotated[int, Arrow(pa.int32())] = Field(default=SCHEMA_VERSION, ge=-INT32_MAX - 1, le=INT32_MAX, description="row format version")
    # sampling
    temperature: Annotated[float, Arrow(pa.float32())] = Field(ge=0.0, le=FLOAT32_MAX, description="sampling temperature")
    top_p: Annotated[float, Arrow(pa.float32())] = Field(
        ge=FLOAT32_TINY, le=1.0, description="nucleus sampling mass in (0, 1] (stored as float32: at least its smallest positive value)")
    top_k: Annotated[int | None, Arrow(pa.int32(), nullable=True)] = Field(default=None, ge=-INT32_MAX - 1, le=INT32_MAX, description="top-k, null for none")
    max_tokens: Annotated[int, Arrow(pa.int32())] = Field(gt=0, le=INT32_MAX, description="completion token budget")
    logprobs_mode: Annotated[str, Arrow(pa.string())] = Field(
        default="processed",
        description="'processed': logprobs after temperature/top-p (the behaviour policy); 'raw': the model's own "
                    "distribution (greedy); 'none': mu unknown (text-only traces, APIs without logprobs), token_logprobs "
                    "empty and logprob_sum null (0.0 in rows of schema version 2); 'rescored': mu teacher-forced after "
                    "the fact by the weights model_revision names, shown to be the trace's author, at the row's "
                    "temperature (graft-rescore); 'rescored_unverified': the same by weights not shown to be its author")
    # content
    completion_text: Annotated[str, Arrow(pa.string())] = Field(description="decoded completion, special tokens excluded")
    completion_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Arrow(pa.list_(pa.int32()))] = Field(
        description="sampled token ids (EOS included when finished)")
    token_logprobs: Annotated[list[Annotated[float, Field(ge=-FLOAT32_MAX, le=LOGPROB_TOLERANCE)]], Arrow(pa.list_(pa.float32()))] = Field(
        description="behaviour logprob of each sampled token (finite, <= 0); empty when logprobs_mode is 'none'")
    logprob_sum: Annotated[float | None, Arrow(pa.float64(), nullable=True)] = Field(
        le=0.0, description="sum of token_logprobs, EOS excluded; null when logprobs_mode is 'none' (0.0 in rows of "
                            "schema version 2)")
    num_tokens: Annotated[int, Arrow(pa.int32())] = Field(ge=0, le=INT32_MAX, description="len(completion_token_ids)")
    num_bytes: Annotated[int, Arrow(pa.int32())] = Field(ge=0, le=INT32_MAX, description="UTF-8 length of completion_text")
    finish_reason: Annotated[FinishReason, Arrow(pa.string())] = Field(description="'stop' (EOS or stop string), 'length' or 'abort'")
    # outcome
    reward: Annotated[float | None, Arrow(pa.float32(), nullable=True)] = Field(default=None, description="in [0, 1]; null when the gold cannot be parsed")
    correct: Annotated[StrictBool, Arrow(pa.bool_())] = Field(description="reward > 0")
    extracted_answer: Annotated[str | None, Arrow(pa.string(), nullable=True)] = Field(
        default=None, description="the final answer the scoring rule took from the completion (by default its last "
                                  "\\boxed{})")
    advantage: Annotated[float, Arrow(pa.float32())] = Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX, description="group-normalised advantage")
    group_size: Annotated[int, Arrow(pa.int32())] = Field(ge=1, le=INT32_MAX, description="number of rollouts in the group")
    # the prompt the completion followed (ADDED_COLUMNS: last, nullable; version 3)
    prompt_text: Annotated[str | None, Arrow(pa.string(), nullable=True)] = Field(
        default=None, description="the prompt the completion followed, as its source gives it (an imported trace's "
                                  "prompt, chat template included where the source applied one); null: not kept (the "
                                  "prompt is rebuilt from the problem prompt_id names)")
    prompt_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None,
                                Arrow(pa.list_(pa.int32()), nullable=True)] = Field(
        default=None, description="the prompt's token ids in tokenizer_id's vocabulary, where the source gives them; "
                                  "null: not known")

    @field_validator("token_logprobs")
    @classmethod
    def _logprobs_finite_nonpositive(cls, v: list[float]) -> list[float]:
        for i, lp in enumerate(v):
            if not math.isfinite(lp) or lp > LOGPROB_TOLERANCE:
                raise ValueError(f"token_logprobs[{i}] = {lp!r}: logprobs must be finite and <= 0")
        return v

    @field_validator("reward")
    @classmethod
    def _reward_in_unit_interval(cls, v: float | None) -> float | None:
        if v is not None and not (0.0 <= v <= 1.0):
            raise ValueError(f"reward = {v!r}: must be in [0, 1] or null")
        return v

    @field_validator("created_at")
    @classmethod
    def _utc_not_ahead(cls, v: datetime) -> datetime:
        v = v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v.astimezone(timezone.utc)
        ahead = (v - datetime.now(timezone.utc)).total_seconds()
        if ahead > CLOCK_SKEW_S:
            raise ValueError(f"created_at {v.isoformat()} is {ahead:.0f} s in the future; at most {CLOCK_SKEW_S:.0f} s "
                             "of clock skew is accepted")
        return v

    @model_validator(mode="after")
    def _consistent_lengths(self) -> Rollout:
        n_ids, n_lps = len(self.completion_token_ids), len(self.token_logprobs)
        if self.logprobs_mode == NO_LOGPROBS:
            unknown = None if self.schema_version >= NULL_LOGPROB_SUM_VERSION else 0.0
            if n_lps or self.logprob_sum != unknown:
                raise ValueError(f"logprobs_mode = 'none' (mu unknown) but token_logprobs has {n_lps} entries and "
                                 f"logprob_sum = {self.logprob_sum!r}: a row without behaviour logprobs stores an "
                                 f"empty token_logprobs and logprob_sum {unknown} (schema version {self.schema_version})")
        else:
            if n_ids != n_lps:
                raise ValueError(f"completion_token_ids has {n_ids} entries but token_logprobs has {n_lps}: they must be equal")
            if self.logprob_sum is None:
                raise ValueError(f"logprob_sum is null but logprobs_mode = {self.logprobs_mode!r}: only a row without "
                                 "behaviour logprobs ('none') has no logprob_sum")
        if self.num_tokens != n_ids:
            raise ValueError(f"num_tokens = {self.num_tokens} but completion_token_ids has {n_ids} entries")
        n_bytes = len(self.completion_text.encode("utf-8"))
        if self.num_bytes != n_bytes:
            raise ValueError(f"num_bytes = {self.num_bytes} but completion_text is {n_bytes} UTF-8 bytes")
        if self.correct != (self.reward is not None and self.reward > 0):
            raise ValueError(f"correct = {self.correct} disagrees with reward = {self.reward!r} (correct means reward > 0)")
        if not math.isfinite(self.advantage) or (self.logprob_sum is not None and not math.isfinite(self.logprob_sum)):
            raise ValueError("advantage and logprob_sum must be finite")
        return self


class RolloutGroup(BaseModel):
    """The G rollouts one model sampled for one prompt, in one shard, with group advantages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollouts: list[Rollout] = Field(min_length=1, description="the group's rollouts, in sampling order")

    @model_validator(mode="after")
    def _one_group(self) -> RolloutGroup:
        first = self.rollouts[0]
        shared = ("group_id", "prompt_id", "dataset", "model_id", "model_revision", "tokenizer_id", "policy_step", "group_size")
        for r in self.rollouts[1:]:
            for name in shared:
                if getattr(r, name) != getattr(first, name):
                    raise ValueError(
                        f"rollout {r.rollout_id}: {name} = {getattr(r, name)!r} but the group's first rollout has "
                        f"{getattr(first, name)!r}; a group's rollouts share {', '.join(shared)}"
                    )
        without_mu = [r.logprobs_mode == NO_LOGPROBS for r in self.rollouts]
        if any(without_mu) and not all(without_mu):
            raise ValueError(f"group {first.group_id} mixes rows with logprobs_mode 'none' and rows with behaviour "
                             "logprobs: a group is all with behaviour logprobs or all without")
        if len(self.rollouts) != first.group_size:
            raise ValueError(f"group {first.group_id} has {len(self.rollouts)} rollouts but group_size = {first.group_size}")
        for position, r in enumerate(self.rollouts):
            if r.rollout_id != rollout_id(first.group_id, position):
                raise ValueError(f"group {first.group_id}: rollout {position} has rollout_id {r.rollout_id!r}, expected "
                                 f"{rollout_id(first.group_id, position)!r} ('<group_id>-<position>')")
        expected = group_advantages([r.reward for r in self.rollouts], std_normalize=True)
        expected_dr = group_advantages([r.reward for r in self.rollouts], std_normalize=False)
        stored = [r.advantage for r in self.rollouts]
        if not (_close(stored, expected) or _close(stored, expected_dr)):
            raise ValueError(
                f"group {first.group_id}: stored advantages {stored} are not the group advantages of its rewards "
                f"{[r.reward for r in self.rollouts]} (expected {[round(a, 4) for a in expected]})"
            )
        return self

    @property
    def group_id(self) -> str:
        return self.rollouts[0].group_id

    @property
    def prompt_id(self) -> str:
        return self.rollouts[0].prompt_id

    @property
    def model_id(self) -> str:
        return self.rollouts[0].model_id

    @property
    def policy_step(self) -> int:
        return self.rollouts[0].policy_step

    def mu_is_behaviour(self, trust_unverified: bool = False) -> bool:
        """`mu_is_behaviour` of the group's rows, which share their mode and sampling: its first row's."""
        return mu_is_behaviour(self.rollouts[0], trust_unverified=trust_unverified)

    @property
    def has_behaviour_logprobs(self) -> bool:
        """Whether the group's stored logprobs are its behaviour mu by the rows' own word (`mu_is_behaviour` without a
        trainer's trust in 'rescored_unverified'): what the store's lookup calls having mu (require_behaviour_logprobs).
        Rows of mode 'none' have no logprobs at all; 'raw' ones away from temperature 1 have logprobs that are not mu."""
        return self.mu_is_behaviour()

    @property
    def successes(self) -> int:
        return sum(r.correct for r in self.rollouts)

    @property
    def informative(self) -> bool:
        """Rewards not all equal: 0 < successes < group size (docs/algorithm.md section 1)."""
        return 0 < self.successes < len(self.rollouts)


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= ADVANTAGE_TOLERANCE * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


class Problem(BaseModel):
    """A prompt of a dataset, stored once per dataset (not per rollout)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_id: Annotated[str, Arrow(pa.string())] = Field(pattern=PROMPT_ID_PATTERN, description="prompt_id(problem)")
    dataset: Annotated[str, Arrow(pa.string())] = Field(
        pattern=SAFE_NAME_PATTERN, description="dataset name: [A-Za-z0-9._-]+ (it names the directory prompts/dataset=<name>/)")
    problem: Annotated[str, Arrow(pa.string())] = Field(min_length=1, description="problem text")
    answer: Annotated[str, Arrow(pa.string())] = Field(description="gold answer (LaTeX, without \\boxed{})")

    @classmethod
    def from_text(cls, problem: str, answer: str, dataset: str) -> Problem:
        return cls(prompt_id=prompt_id(problem), dataset=dataset, problem=problem, answer=answer)

    @model_validator(mode="after")
    def _id_matches(self) -> Problem:
        if self.prompt_id != prompt_id(self.problem):
            raise ValueError(f"prompt_id {self.prompt_id} is not prompt_id(problem) = {prompt_id(self.problem)}")
        return self


def arrow_schema(model: type[BaseModel]) -> pa.Schema:
    """The Arrow schema of a model whose every field is annotated with `Arrow(...)`."""
    fields = []
    for name, info in model.model_fields.items():
        arrow = next((m for m in info.metadata if isinstance(m, Arrow)), None)
        if arrow is None:
            raise TypeError(f"{model.__name__}.{name} has no Arrow(...) annotation")
        fields.append(pa.field(name, arrow.type, nullable=arrow.nullable, metadata={"description": info.description or ""}))
    return pa.schema(fields, metadata={"graft_schema_version": str(SCHEMA_VERSION)})


ROLLOUT_ARROW_SCHEMA = arrow_schema(Rollout)
PROBLEM_ARROW_SCHEMA = arrow_schema(Problem)


def groups_to_table(groups: list[RolloutGroup]) -> pa.Table:
    """Rows of whole groups, in order, as an Arrow table of `ROLLOUT_ARROW_SCHEMA`."""
    rows = [r.model_dump() for g in groups for r in g.rollouts]
    return pa.Table.from_pylist(rows, schema=ROLLOUT_ARROW_SCHEMA)


def table_to_groups(table: pa.Table, validate: bool = True) -> list[RolloutGroup]:
    """Whole groups from an Arrow table of stored rows, in order of first appearance."""
    by_group: dict[str, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        by_group.setdefault(row["group_id"], []).append(row)
    if validate:
        return [RolloutGroup(rollouts=[Rollout(**r) for r in rows]) for rows in by_group.values()]
    return [
        RolloutGroup.model_construct(rollouts=[Rollout.model_construct(**r) for r in rows]) for rows in by_group.values()
    ]
