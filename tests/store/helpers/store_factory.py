"""Real rollout groups for the store tests, built through the schemas' pydantic models; and polling."""

from __future__ import annotations

import random
import time
import uuid
from datetime import datetime, timedelta, timezone

import numpy as np

from graft.schemas import Problem, Rollout, RolloutGroup, group_advantages, prompt_id

DATASET = "toy-math"


def problem_text(i: int) -> str:
    return f"What is {i} + {i + 1}? Put the answer in \\boxed{{}}."


def make_problem(i: int, dataset: str = DATASET) -> Problem:
    return Problem.from_text(problem_text(i), str(2 * i + 1), dataset)


def make_group(
    prompt: int,
    model: str = "model-a",
    step: int = 0,
    rewards: list[float | None] | None = None,
    size: int = 4,
    tokens: int = 12,
    seed: int | None = None,
    created_at: datetime | None = None,
    dataset: str = DATASET,
    group_id: str | None = None,
    without_mu: bool = False,
) -> RolloutGroup:
    """A group of `size` rollouts for problem `prompt`; rewards default to a mixed (informative) pattern. without_mu:
    rows without behaviour logprobs (logprobs_mode 'none', token_logprobs empty, logprob_sum null)."""
    rng = random.Random(seed if seed is not None else hash((prompt, model, step)) & 0xFFFF)
    rewards = rewards if rewards is not None else [1.0 if i % 2 == 0 else 0.0 for i in range(size)]
    size = len(rewards)
    # float32-exact values: the store keeps logprobs and advantages as float32, so round trips compare equal
    advantages = [float(np.float32(a)) for a in group_advantages(rewards)]
    gid = group_id or f"{model}-{prompt}-{step}-{uuid.uuid4().hex[:8]}"
    created = created_at or datetime.now(timezone.utc)
    rollouts = []
    for i, (reward, advantage) in enumerate(zip(rewards, advantages)):
        ids = [rng.randrange(1, 5000) for _ in range(tokens)]
        logprobs = [float(np.float32(-rng.random() * 2)) for _ in range(tokens)]
        text = f"Sample {i}: {' '.join(str(t) for t in ids[:4])} so the answer is \\boxed{{{2 * prompt + 1 if reward else 7}}} é"
        rollouts.append(Rollout(
            rollout_id=f"{gid}-{i}", group_id=gid, prompt_id=prompt_id(problem_text(prompt)), dataset=dataset,
            model_id=model, model_revision="rev1", tokenizer_id=f"tok-{model}", policy_step=step,
            generator_id="tests", created_at=created + timedelta(microseconds=i), temperature=1.0, top_p=1.0,
            max_tokens=64, completion_text=text, completion_token_ids=ids,
            token_logprobs=[] if without_mu else logprobs,
            logprob_sum=None if without_mu else sum(logprobs[:-1]), logprobs_mode="none" if without_mu else "processed",
            num_tokens=tokens, num_bytes=len(text.encode()), finish_reason="stop",
            reward=reward, correct=reward is not None and reward > 0, extracted_answer="1", advantage=advantage,
            group_size=size, prompt_text=f"user: {problem_text(prompt)}\nassistant: ", prompt_token_ids=ids[:3],
        ))
    return RolloutGroup(rollouts=rollouts)


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    """Poll `predicate()` until it returns something true (returned), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def blocks_of(lookup_file) -> np.ndarray:
    """The block table of a lookup file, (groups, len(BLOCK)) int64: column BLOCK.first_page is a group's first page,
    -1 for a copy."""
    from graft.services.store_api.local.lookup import LookupFile

    shard = lookup_file.parent.parent.parent / "rollouts" / lookup_file.parent.name / (lookup_file.stem + ".parquet")
    return LookupFile(lookup_file, shard).blocks
