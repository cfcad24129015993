"""Held-out accuracy per family of a checkpoint, through the project's own evaluation code
(`graft.rollouts.evaluation.evaluate`: the HF backend, the raw prompt, math-verify in workers)."""

from __future__ import annotations

from pathlib import Path

import orjson

from graft.rollouts.evaluation import evaluate
from graft.rollouts.hf_backend import HFBackend
from graft.rollouts.models import load_model_and_tokenizer
from graft.rollouts.prompts import PromptConfig
from graft.rollouts.sampling import SamplingParams
from graft.rollouts.scoring import Scorer
from graft.schemas import Problem

RAW = PromptConfig(template="raw")  # the tiny models see `a+b=` verbatim
MAX_TOKENS = 16  # the longest reference completion, `\boxed{1098}` + EOS, is 13 characters


def load_eval_sets(paths: dict[str, Path]) -> dict[str, list[Problem]]:
    return {family: [Problem(**orjson.loads(line)) for line in Path(path).read_bytes().splitlines() if line.strip()] for family, path in paths.items()}


def family_accuracy(
    checkpoint: Path, eval_sets: dict[str, list[Problem]], scorer: Scorer, sampled: bool = False, seed: int = 0,
    samples: int = 1,
) -> dict[str, float]:
    """Greedy accuracy per family of the model saved at `checkpoint`, or (sampled) the mean accuracy of `samples`
    samples per problem at T = 1, each problem drawing from its own seeds (`seed` + its place): every run of the demo
    draws the same random numbers for a problem, so two runs' difference is their policies', not their dice."""
    model, tokenizer = load_model_and_tokenizer(checkpoint)
    backend = HFBackend(model, tokenizer, model_id=checkpoint.name, batch_size=512)
    k = samples if sampled else 1
    params = SamplingParams(n=k, temperature=1.0 if sampled else 0.0, max_tokens=MAX_TOKENS, seed=seed, seed_per_sample=sampled)
    result = evaluate(backend, eval_sets, k, params, scorer, prompt=RAW, prompts_per_batch=512 // k)
    return {family: r["avg_at_k"] for family, r in result["benchmarks"].items()}
