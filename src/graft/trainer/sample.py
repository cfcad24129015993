"""The learner's own rollouts of a step: G samples per prompt from the current policy, scored with math-verify
and assembled into stored-format groups (the generator's code), and DAPO's refills."""

from __future__ import annotations

from dataclasses import dataclass

from graft.rollouts.groups import assemble_group, make_group_id
from graft.rollouts.sampling import SamplingParams
from graft.rollouts.scoring import Scorer
from graft.schemas import Problem, RolloutGroup, trainer_generator_id
from graft.trainer.config import TrainConfig
from graft.trainer.data import PromptBlock, PromptStream
from graft.trainer.distributed import sum_over_ranks
from graft.trainer.learner import Learner


@dataclass
class SampledStep:
    """What the learner sampled in one step."""

    groups: list[RolloutGroup]  # the groups the step trains on, one per prompt (dapo: the informative ones)
    generated: list[RolloutGroup]  # every group sampled (the rollout budget; dapo: refills and dropped groups too)
    problems: list[Problem]  # the step's problems, refills included
    # each group's place among the job's prompts of the step as one process takes them (round after round, each
    # round's prompts in stream order): the order the update draws mini-batches in (graft.trainer.distributed.row_places)
    positions: list[int]
    dapo_rounds: int | None = None  # generation rounds (dapo only)

    @property
    def problem_of(self) -> dict[str, Problem]:
        return {p.prompt_id: p for p in self.problems}

    @property
    def rewards(self) -> list[tuple[str, list[float | None]]]:
        """(prompt id, rewards) of each group the step trains on: what the gate decides on."""
        return [(g.prompt_id, [r.reward for r in g.rollouts]) for g in self.groups]


def sample_step(
    cfg: TrainConfig, sampler, scorer: Scorer, learner: Learner, prompts: PromptStream, block: PromptBlock,
    policy_step: int,
) -> SampledStep:
    """One group per problem of this rank's block; dapo keeps only informative groups and refills from the stream
    (`dapo_refill`)."""
    groups = generate_groups(cfg, sampler, scorer, learner, block, policy_step, round_index=0)
    first = SampledStep(groups, list(groups), list(block.problems), [block.offset + i for i in range(len(groups))])
    return dapo_refill(cfg, sampler, scorer, learner, prompts, first, policy_step) if cfg.method == "dapo" else first


def dapo_refill(
    cfg: TrainConfig, sampler, scorer: Scorer, learner: Learner, prompts: PromptStream, first: SampledStep,
    policy_step: int,
) -> SampledStep:
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no advantage) and sample new prompts in
    further rounds until prompts_per_step groups are kept or dapo.max_generation_rounds is reached.

    Data parallel: the count is the job's (every rank takes the same refill from its stream, which stays in step
    with the others', and samples its block of it), so every rank runs the same rounds. A refill's prompts come
    after all of the rounds before (`positions`), as in one process."""
    kept = [(g, p) for g, p in zip(first.groups, first.positions, strict=True) if g.informative]
    generated, problems = list(first.generated), list(first.problems)
    rounds, taken = 1, cfg.rollout.prompts_per_step  # the job's prompts so far (the loop took the first round's)
    while rounds < cfg.dapo.max_generation_rounds:
        missing = cfg.rollout.prompts_per_step - sum_over_ranks(learner.dist, len(kept))
        if missing <= 0:
            break
        refill = prompts.take_block(missing, learner.dist)
        problems += refill.problems
        more = generate_groups(cfg, sampler, scorer, learner, refill, policy_step, round_index=rounds)
        generated += more
        kept += [(g, taken + refill.offset + i) for i, g in enumerate(more) if g.informative]
        rounds, taken = rounds + 1, taken + missing
    return SampledStep([g for g, _ in kept], generated, problems, [p for _, p in kept], dapo_rounds=rounds)


def sampling_params(cfg: TrainConfig, policy_step: int, round_index: int, prompt_offset: int = 0) -> SamplingParams:
    # A seed per (run seed, step, round): a resumed run samples exactly what the uninterrupted one did.
    seed = (cfg.seed * 1_000_003 + policy_step * 101 + round_index) % 2**31
    return SamplingParams(n=cfg.rollout.group_size, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                          top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.max_response_tokens, seed=seed,
                          seed_per_sample=cfg.rollout.seeds_per_sample(cfg.parallel.strategy), prompt_offset=prompt_offset)


def generate_groups(
    cfg: TrainConfig, sampler, scorer: Scorer, learner: Learner, block: PromptBlock, policy_step: int,
    round_index: int,
) -> list[RolloutGroup]:
    """G rollouts per problem from the current policy, scored and assembled into stored-format groups.

    Every rank calls it in every round, with an empty block too (the fsdp sampler gathers the weights, a collective)."""
    problems = block.problems
    params = sampling_params(cfg, policy_step, round_index, block.offset)
    prompts = [cfg.prompt.render(learner.tokenizer, p.problem) for p in problems]
    with learner.sampling_autocast():
        samples = sampler.generate(prompts, params)  # one list of G samples per prompt
    completions = [s.text for per_prompt in samples for s in per_prompt]
    golds = [p.answer for p, per_prompt in zip(problems, samples) for _ in per_prompt]
    scores = scorer.score(completions, golds)
    groups, offset = [], 0
    for index, (problem, per_prompt) in enumerate(zip(problems, samples)):
        group_scores = scores[offset : offset + len(per_prompt)]
        offset += len(per_prompt)
        # The seed is part of the key: two runs of one checkpoint with different seeds publish different groups.
        group_id = make_group_id(learner.model_id, f"{learner.revision}/seed={cfg.seed}", policy_step,
                                 problem.prompt_id, round_index * 1_000_000 + block.offset + index)
        groups.append(assemble_group(
            problem, per_prompt, group_scores, model_id=learner.model_id, model_revision=learner.revision,
            tokenizer_id=learner.tokenizer_id, policy_step=policy_step,
            generator_id=trainer_generator_id("graft-train", cfg.run_dir.name),
            params=params, eos_token_ids=learner.eos_ids, group_id=group_id, std_normalize=cfg.ppo.advantage == "grpo",
        ))
    return groups
