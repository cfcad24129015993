"""The trainer's periodic evaluation: accuracy on the configured benchmarks through graft-eval's code
(`rollouts.evaluation.evaluate`), with the learner's own sampler; appended to `<run_dir>/eval.jsonl`."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson

from rollouts.datasets import load_problems
from rollouts.evaluation import evaluate
from rollouts.sampling import SamplingParams
from trainer.config import TrainConfig

log = logging.getLogger("trainer")


def due(cfg: TrainConfig, step: int) -> bool:
    """Whether the policy after `step` steps is evaluated: every eval.every_steps and at the end."""
    return bool(cfg.eval.every_steps and cfg.eval.benchmarks and (step % cfg.eval.every_steps == 0 or step == cfg.steps))


def evaluate_policy(cfg: TrainConfig, sampler, scorer, run_dir: Path, step: int, write: bool = True) -> dict:
    """avg@k and pass@k per benchmark (GRAFT_SPEC section 10: greedy for k = 1, else T = 0.6, top_p = 0.95), appended
    to eval.jsonl when `write` (data parallel: every rank evaluates the same problems, rank 0 writes)."""
    problems_by_benchmark = {
        name: load_problems(source, limit=cfg.eval.limit) for name, source in cfg.eval.benchmarks.items()
    }
    greedy = cfg.eval.k == 1
    params = SamplingParams(
        n=cfg.eval.k, temperature=0.0 if greedy else cfg.eval.temperature, top_p=1.0 if greedy else cfg.eval.top_p,
        max_tokens=cfg.eval.max_tokens or cfg.rollout.max_response_tokens, seed=cfg.seed,
    )
    result = evaluate(sampler, problems_by_benchmark, cfg.eval.k, params, scorer, template=cfg.data.prompt_template)
    if not write:
        return result
    with open(run_dir / "eval.jsonl", "ab") as f:
        options = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
        f.write(orjson.dumps({"step": step, **result}, option=options) + b"\n")
    accuracies = ", ".join(f"{name} {r['avg_at_k']:.3f}" for name, r in result["benchmarks"].items())
    log.info("step %d evaluation (avg@%d): %s", step, cfg.eval.k, accuracies)
    return result
