"""Turning one prompt's samples and scores into a stored `RolloutGroup` (docs/algorithm.md sections 2 and 7)."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from graft.rollouts.sampling import Sample, SamplingParams
from graft.rollouts.scoring import Score
from graft.schemas import NO_LOGPROBS, Problem, Rollout, RolloutGroup, group_advantages


def make_group_id(model_id: str, model_revision: str, policy_step: int, prompt_id: str, round_index: int | str,
                  sampling_key: str = "") -> str:
    """Deterministic group id: a restarted generator recomputes the ids it already stored and skips them.

    sampling_key: the settings that change what a group holds besides the model (the generator's
    `GeneratorConfig.sampling_key`), so that other settings make other ids; "" leaves it out (the trainer's ids)."""
    parts = [model_id, model_revision, str(policy_step), prompt_id, str(round_index)]
    key = "\x1f".join(parts + [sampling_key] if sampling_key else parts)
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


class PromptRef(NamedTuple):
    """A prompt by its store id and dataset, where its problem text is not at hand (a framework's own rollouts)."""

    prompt_id: str
    dataset: str


WANTED_DRAW = "wanted-"


def wanted_group_id(model_id: str, model_revision: str, policy_step: int, prompt_id: str, draw: str,
                    sampling_key: str) -> str:
    """The id of a group a generator drew for a wanted prompt (`draw`: unique to the draw): `wanted-<sampling key>-
    <hash>`, so that a restarted generator knows the wanted groups its settings made among the stored ones, however
    many draws there were (`is_wanted_draw`), where the dataset's rounds are known by recomputing their ids."""
    digest = make_group_id(model_id, model_revision, policy_step, prompt_id, draw, sampling_key)[:24]
    return f"{WANTED_DRAW}{sampling_key}-{digest}"


def is_wanted_draw(group_id: str, sampling_key: str) -> bool:
    """Whether `group_id` is a wanted prompt's draw under these settings (`wanted_group_id`)."""
    return group_id.startswith(f"{WANTED_DRAW}{sampling_key}-")


def logprobs_mode(params: SamplingParams, engine_mode: str = "processed_logprobs") -> str:
    """'processed': logprobs of the distribution sampled from (after temperature, top-k, top-p).
    'raw': the model's own (temperature 1) distribution: greedy decoding, or a server that reports raw logprobs
    (engine_mode, vLLM's `--logprobs-mode` name: 'processed_logprobs' or 'raw_logprobs'). 'none': the source gave no
    logprobs (engine_mode 'none': text-only traces), the samples' token_logprobs are empty."""
    if engine_mode == NO_LOGPROBS:
        return NO_LOGPROBS
    return "raw" if params.greedy or engine_mode == "raw_logprobs" else "processed"


def assemble_group(
    problem: Problem | PromptRef,
    samples: list[Sample],
    scores: list[Score],
    *,
    model_id: str,
    model_revision: str,
    tokenizer_id: str,
    policy_step: int,
    generator_id: str,
    params: SamplingParams,
    eos_token_ids: set[int],
    group_id: str,
    std_normalize: bool = True,
    engine_logprobs_mode: str = "processed_logprobs",
    prompt_text: str | None = None,
    prompt_token_ids: list[int] | None = None,
) -> RolloutGroup:
    """One validated group: rewards, group advantages, and logprob sums with the EOS token excluded.

    The EOS token stays in completion_token_ids and token_logprobs (the trainer trains on it), but
    not in logprob_sum: another tokenizer's re-tokenisation has its own EOS, so a sequence-level
    likelihood compared across models covers the text only (docs/algorithm.md section 4). engine_logprobs_mode: what the
    sampler's logprobs are (`Backend.logprobs_mode`), recorded in the rows' logprobs_mode; without logprobs ('none')
    the rows' logprob_sum is null. prompt_text / prompt_token_ids: the prompt the samples followed, where known.
    """
    if len(samples) != len(scores):
        raise ValueError(f"assemble_group got {len(samples)} samples but {len(scores)} scores: one score per sample")
    if not samples:
        raise ValueError("assemble_group got no samples: a group needs at least one rollout")
    advantages = group_advantages([s.reward for s in scores], std_normalize=std_normalize)
    mode = logprobs_mode(params, engine_logprobs_mode)
    rollouts = []
    for index, (sample, score, advantage) in enumerate(zip(samples, scores, advantages)):
        ends_with_eos = sample.finish_reason == "stop" and bool(sample.token_ids) and sample.token_ids[-1] in eos_token_ids
        text_logprobs = sample.token_logprobs[:-1] if ends_with_eos else sample.token_logprobs
        rollouts.append(
            Rollout(
                rollout_id=f"{group_id}-{index}",
                group_id=group_id,
                prompt_id=problem.prompt_id,
                dataset=problem.dataset,
                model_id=model_id,
                model_revision=model_revision,
                tokenizer_id=tokenizer_id,
                policy_step=policy_step,
                generator_id=generator_id,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.effective_top_k,
                max_tokens=params.max_tokens,
                logprobs_mode=mode,
                completion_text=sample.text,
                completion_token_ids=sample.token_ids,
                token_logprobs=sample.token_logprobs,
                # float32 rounding can put a sum of ~0 above 0
                logprob_sum=None if mode == NO_LOGPROBS else min(0.0, float(sum(text_logprobs))),
                num_tokens=len(sample.token_ids),
                num_bytes=len(sample.text.encode("utf-8")),
                finish_reason=sample.finish_reason,
                reward=score.reward,
                correct=score.correct,
                extracted_answer=score.extracted_answer,
                advantage=advantage,
                group_size=len(samples),
                prompt_text=prompt_text,
                prompt_token_ids=prompt_token_ids,
            )
        )
    return RolloutGroup(rollouts=rollouts)
