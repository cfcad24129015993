"""A store for the browser's tests: groups sampled by real tiny models (the trainer's toy world) and scored by
math-verify, plus a few store-factory groups for the cases sampling may not produce (a peer that solves every
rollout, which the lookup does not graft; a prompt with no problem text; rollouts longer than one line)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from store_factory import make_group, make_problem

from graft.rollouts.groups import assemble_group, make_group_id
from graft.rollouts.hf_backend import HFBackend
from graft.rollouts.sampling import SamplingParams
from graft.rollouts.scoring import Scorer
from graft.schemas import Problem, RolloutGroup
from graft.services.store_api.local.shards import write_groups
from toy.world import build_toy_world

LEARNER = "toy-learner"
PEER = "toy-peer"  # build_toy_world's peer model id
SECOND_PEER = "toy-peer-b"  # the same weights as the peer, sampled again under another name
FACTORY = "factory"  # store_factory's synthetic model, for edge cases


@dataclass
class BrowserWorld:
    root: Path  # the store root
    learner_dir: Path
    peer_dir: Path
    problems: list[Problem]


def sample_groups(backend: HFBackend, problems: list[Problem], scorer: Scorer, *, step: int, seed: int,
                  group_size: int = 8) -> list[RolloutGroup]:
    """One scored group per problem from `backend`, exactly as graft-generate assembles them."""
    params = SamplingParams(n=group_size, temperature=1.0, max_tokens=16, seed=seed)
    samples = backend.generate([p.problem for p in problems], params)
    scores = scorer.score([s.text for per in samples for s in per], [p.answer for p in problems for _ in range(group_size)])
    revision = f"step-{step}"  # one checkpoint stands for several policy steps here
    return [
        assemble_group(problem, per_prompt, scores[i * group_size : (i + 1) * group_size], model_id=backend.model_id,
                       model_revision=revision, tokenizer_id=backend.tokenizer_id, policy_step=step,
                       generator_id="browser-tests", params=params, eos_token_ids=backend.eos_token_ids,
                       group_id=make_group_id(backend.model_id, revision, step, problem.prompt_id, seed))
        for i, (problem, per_prompt) in enumerate(zip(problems, samples))
    ]


def build_browser_world(base: Path) -> BrowserWorld:
    """The toy world's peer groups (step 0), the learner's groups at steps 0, 2 and 4, the peer again at step 3,
    a second peer on half the problems, and store-factory edge cases."""
    world = build_toy_world(base / "toy", problems_per_family=8)
    problems = world.learner_problems + world.peer_problems
    learner = HFBackend.from_path(world.learner_dir, model_id=LEARNER, batch_size=512)
    peer = HFBackend.from_path(world.peer_dir, model_id=PEER, batch_size=512)
    second_peer = HFBackend.from_path(world.peer_dir, model_id=SECOND_PEER, batch_size=512)
    with Scorer(num_workers=1, timeout_s=10.0) as scorer:
        for step in (0, 2, 4):
            write_groups(world.store_root, sample_groups(learner, problems, scorer, step=step, seed=step))
        write_groups(world.store_root, sample_groups(peer, problems, scorer, step=3, seed=3))
        write_groups(world.store_root, sample_groups(second_peer, problems[::2], scorer, step=1, seed=5))
    # edge cases on prompts of their own: the learner fails, a peer solves every rollout (not informative: the
    # lookup does not graft it), or solves some (grafted); one prompt has no problem file
    factory_problems = [make_problem(i) for i in range(900, 903)]
    write_groups(world.store_root, [make_group(900, LEARNER, step=4, rewards=[0.0] * 4),
                                    make_group(901, LEARNER, step=4, rewards=[0.0] * 4),
                                    make_group(902, LEARNER, step=4, rewards=[0.0, 1.0, 0.0, 0.0])],
                 factory_problems)
    write_groups(world.store_root, [make_group(900, FACTORY, step=1, rewards=[1.0] * 4),
                                    make_group(901, FACTORY, step=1, rewards=[1.0, 0.0, 1.0, 0.0]),
                                    make_group(903, FACTORY, step=1, rewards=[1.0, 0.0, 0.0, 0.0])])
    return BrowserWorld(world.store_root, world.learner_dir, world.peer_dir, problems + factory_problems)
