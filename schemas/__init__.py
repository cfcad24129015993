"""Data definitions shared by every process: the stored rollout, its Arrow schema, API models."""

from graft.schemas.api import (
    LOOKUP_PATH,
    MAX_LOOKUP_PROMPTS,
    MAX_PAGE_SIZE,
    MAX_PUSH_GROUPS,
    PUSH_PATH,
    ErrorResponse,
    HealthResponse,
    LakeStats,
    ModelStats,
    PeerLookupRequest,
    PeerLookupResponse,
    PushGroupsRequest,
    PushGroupsResponse,
    RolloutPage,
    StatsResponse,
)
from graft.schemas.rollout import (
    ARROW_MEDIA_TYPE,
    GROUP_ID_PATTERN,
    NO_LOGPROBS,
    PROBLEM_ARROW_SCHEMA,
    PROMPT_ID_PATTERN,
    ROLLOUT_ARROW_SCHEMA,
    SCHEMA_VERSION,
    Problem,
    Rollout,
    RolloutGroup,
    group_advantages,
    groups_to_table,
    prompt_id,
    rollout_id,
    table_to_groups,
)

__all__ = [
    "ARROW_MEDIA_TYPE", "GROUP_ID_PATTERN", "LOOKUP_PATH", "MAX_LOOKUP_PROMPTS", "PROMPT_ID_PATTERN", "PUSH_PATH", "MAX_PAGE_SIZE", "MAX_PUSH_GROUPS", "NO_LOGPROBS", "PROBLEM_ARROW_SCHEMA", "ROLLOUT_ARROW_SCHEMA",
    "SCHEMA_VERSION", "ErrorResponse", "HealthResponse", "LakeStats", "ModelStats", "PeerLookupRequest", "PeerLookupResponse",
    "Problem", "PushGroupsRequest", "PushGroupsResponse", "Rollout", "RolloutGroup", "RolloutPage", "StatsResponse",
    "group_advantages", "groups_to_table", "prompt_id", "rollout_id", "table_to_groups",
]
