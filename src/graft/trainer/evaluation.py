"""The trainer's periodic evaluation: accuracy on the configured benchmarks through graft-eval's code
(`graft.rollouts.evaluation`), with the learner's own sampler, each data-parallel rank scoring its block of the
problems; appended to `<run_dir>/eval.jsonl`."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import orjson
import torch

from graft.rollouts.datasets import load_problems
from graft.rollouts.evaluation import ProblemScores, score_problems, summarise
from graft.rollouts.sampling import SamplingParams
from graft.trainer.config import TrainConfig
from graft.trainer.distributed import DistContext, gather_lists, rank_block
from graft.trainer.learner import whole_weights

log = logging.getLogger("graft.trainer")


def due(cfg: TrainConfig, step: int) -> bool:
    """Whether the policy after `step` steps is evaluated: every eval.every_steps and at the end."""
    return bool(cfg.eval.every_steps and cfg.eval.benchmarks and (step % cfg.eval.every_steps == 0 or step == cfg.steps))


def evaluate_policy(cfg: TrainConfig, sampler, scorer, run_dir: Path, step: int, dist: DistContext | None = None) -> dict:
    """avg@k and pass@k per benchmark (docs/algorithm.md section 10: greedy for k = 1, else T = 0.6, top_p = 0.95), appended
    to eval.jsonl by the main process.

    Data parallel: each rank scores its block of every benchmark's problems (graft.trainer.distributed.rank_block) and
    the blocks are gathered in order, so N ranks evaluate in about 1/N of the time and find what one process
    finds (sampled evaluations draw from per-problem seeds then, as the rollouts do: rollout.seed_per_sample).
    Under fsdp the full weights are gathered once for the whole evaluation, so that the ranks' differing numbers
    of generate calls need no collective."""
    dist = dist or DistContext("none", torch.device("cpu"))
    problems_by_benchmark = {
        name: load_problems(source, limit=cfg.eval.limit) for name, source in cfg.eval.benchmarks.items()
    }
    greedy = cfg.eval.k == 1
    params = SamplingParams(
        n=cfg.eval.k, temperature=0.0 if greedy else cfg.eval.temperature, top_p=1.0 if greedy else cfg.eval.top_p,
        max_tokens=cfg.eval.max_tokens or cfg.rollout.max_response_tokens, seed=cfg.seed,
        seed_per_sample=cfg.rollout.seeds_per_sample(cfg.parallel.strategy),
    )
    started = time.perf_counter()
    scores: dict[str, ProblemScores] = {}
    scored_here = 0
    with whole_weights(sampler) as backend:
        for name, problems in problems_by_benchmark.items():
            begin, end = rank_block(len(problems), dist.rank, dist.world_size)
            local = score_problems(backend, problems[begin:end], cfg.eval.k, replace(params, prompt_offset=begin),
                                   scorer, prompt=cfg.prompt)
            scores[name] = _gathered(dist, local)
            scored_here += end - begin
    result = summarise(scores, cfg.eval.k, params, time.perf_counter() - started)
    if dist.distributed:
        log.info("step %d evaluation: this rank scored %d of the %d problems", step, scored_here,
                 sum(len(p) for p in problems_by_benchmark.values()))
    if not dist.is_main:
        return result
    with open(run_dir / "eval.jsonl", "ab") as f:
        options = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
        f.write(orjson.dumps({"step": step, **result}, option=options) + b"\n")
    accuracies = ", ".join(f"{name} {r['avg_at_k']:.3f}" for name, r in result["benchmarks"].items())
    log.info("step %d evaluation (avg@%d): %s", step, cfg.eval.k, accuracies)
    return result


def _gathered(dist: DistContext, local: ProblemScores) -> ProblemScores:
    """Every rank's block of one benchmark's scores, in rank order (the benchmark's order)."""
    rows = gather_lists(dist, list(zip(local.correct, local.unscored, local.tokens, local.finished, local.boxed,
                                       strict=True)))
    return ProblemScores(*(list(column) for column in zip(*rows, strict=True))) if rows else ProblemScores()
