"""Benchmark evaluation (docs/algorithm.md section 10): avg@k and pass@k per benchmark and the mean over the
five, with the same backends, prompts and scorer as the generator. `graft-eval` calls `evaluate`; the trainer's
periodic evaluation scores each rank's block of every benchmark (`score_problems`) and summarises them all."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from tqdm import tqdm

from graft.rollouts.datasets import BENCHMARKS
from graft.rollouts.prompts import PromptConfig
from graft.rollouts.sampling import Backend, SamplingParams
from graft.rollouts.scoring import Scorer
from graft.schemas import Problem


@dataclass
class ProblemScores:
    """One benchmark's problems, scored, in order: per problem, its correct samples, whether a sample was unscored
    (the gold does not parse), its completion tokens, its samples that finished (EOS) and its samples with a
    \\boxed{} answer (the scorer reads only that: a sample without one scores 0). Blocks of one
    benchmark's problems scored apart (one per data-parallel rank) laid end to end are the whole's."""

    correct: list[int] = field(default_factory=list)
    unscored: list[bool] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    boxed: list[int] = field(default_factory=list)


def score_problems(
    backend: Backend,
    problems: list[Problem],
    k: int,
    params: SamplingParams,
    scorer: Scorer,
    *,
    prompt: PromptConfig | None = None,
    prompts_per_batch: int = 64,
    bar: tqdm | None = None,
    name: str = "",
) -> ProblemScores:
    """Sample k completions per problem (prompted as `prompt` says; default: PromptConfig's) and score them. With
    params.seed_per_sample, problem i draws its samples from its own seeds (params.prompt_offset + i), whatever the
    batches: a block of a benchmark scores its problems as the whole benchmark does."""
    if params.n != k:
        raise ValueError(f"evaluate(k={k}) but params.n = {params.n}: they must agree")
    prompt = prompt or PromptConfig()
    scores = ProblemScores()
    for start in range(0, len(problems), prompts_per_batch):
        batch = problems[start : start + prompts_per_batch]
        prompts = [prompt.render(backend.tokenizer, p.problem) for p in batch]
        batch_params = replace(params, prompt_offset=params.prompt_offset + start) if params.seed_per_sample else params
        samples = backend.generate(prompts, batch_params)  # (prompts, k)
        texts = [s.text for group in samples for s in group]
        golds = [p.answer for p in batch for _ in range(k)]
        flat = scorer.score(texts, golds)
        for i, group in enumerate(samples):
            group_scores = flat[i * k : (i + 1) * k]
            scores.correct.append(sum(s.correct for s in group_scores))
            scores.unscored.append(any(s.reward is None for s in group_scores))
            scores.tokens.append(sum(len(s.token_ids) for s in group))
            scores.finished.append(sum(s.finish_reason == "stop" for s in group))
            scores.boxed.append(sum(s.extracted_answer is not None for s in group_scores))
        if bar is not None:
            bar.update(len(batch))
            bar.set_postfix({name: f"{sum(scores.correct) / (k * len(scores.correct)):.1%}"}, refresh=False)
    return scores


def summarise(scores: dict[str, ProblemScores], k: int, params: SamplingParams, wall_s: float) -> dict:
    """`evaluate`'s result from each benchmark's scored problems."""
    results: dict[str, dict] = {}
    for name, s in scores.items():
        n = len(s.correct)
        results[name] = {
            "problems": n,
            "samples": n * k,
            "avg_at_k": sum(s.correct) / (n * k) if n else None,
            "pass_at_k": sum(c > 0 for c in s.correct) / n if n else None,
            "unscored": sum(s.unscored),
            "mean_completion_tokens": sum(s.tokens) / (n * k) if n else None,
            "finished_share": sum(s.finished) / (n * k) if n else None,
            "boxed_share": sum(s.boxed) / (n * k) if n else None,  # samples with a \boxed{} answer (the rest score 0)
        }
    mean_over = [b for b in BENCHMARKS if b in results and results[b]["problems"]]
    return {
        "k": k,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_tokens,
        "benchmarks": results,
        "mean_avg_at_k": sum(results[b]["avg_at_k"] for b in mean_over) / len(mean_over) if mean_over else None,
        "mean_pass_at_k": sum(results[b]["pass_at_k"] for b in mean_over) / len(mean_over) if mean_over else None,
        "mean_over": mean_over,
        "wall_s": wall_s,
    }


def evaluate(
    backend: Backend,
    problems_by_benchmark: dict[str, list[Problem]],
    k: int,
    params: SamplingParams,
    scorer: Scorer,
    *,
    prompt: PromptConfig | None = None,
    prompts_per_batch: int = 64,
    progress: bool = False,
) -> dict:
    """Sample k completions per problem and score them.

    Returns {"k", "temperature", "top_p", "max_tokens", "benchmarks": {name: {"problems", "samples",
    "avg_at_k", "pass_at_k", "unscored", "mean_completion_tokens", "finished_share", "boxed_share"}},
    "mean_avg_at_k", "mean_pass_at_k" (over the five GRAFT benchmarks that were evaluated; None if none),
    "mean_over": [their names], "wall_s"}. avg@k is the mean correctness over all k samples, pass@k
    the share of problems with at least one correct sample. A problem whose gold does not parse
    (reward null) counts as wrong and is counted in "unscored".
    """
    started = time.perf_counter()
    total = sum(len(p) for p in problems_by_benchmark.values())
    bar = tqdm(total=total, disable=not progress, unit="problem", dynamic_ncols=True)
    try:
        scores = {name: score_problems(backend, problems, k, params, scorer, prompt=prompt,
                                       prompts_per_batch=prompts_per_batch, bar=bar, name=name)
                  for name, problems in problems_by_benchmark.items()}
    finally:
        bar.close()
    return summarise(scores, k, params, time.perf_counter() - started)


def markdown_table(result: dict, model_id: str) -> str:
    """The results as a Markdown table: one row per benchmark, then the mean over the five."""
    k = result["k"]
    lines = [
        f"Model `{model_id}`, k = {k}, temperature {result['temperature']}, top_p {result['top_p']}, "
        f"max tokens {result['max_tokens']}",
        "",
        f"| benchmark | problems | avg@{k} | pass@{k} | mean tokens | finished | boxed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in result["benchmarks"].items():
        lines.append(
            f"| {name} | {r['problems']} | {_pct(r['avg_at_k'])} | {_pct(r['pass_at_k'])} | "
            f"{'-' if r['mean_completion_tokens'] is None else round(r['mean_completion_tokens'])} | {_pct(r['finished_share'])} | "
            f"{_pct(r['boxed_share'])} |"
        )
    if result["mean_over"]:
        lines.append(
            f"| mean of {len(result['mean_over'])} ({', '.join(result['mean_over'])}) | | "
            f"{_pct(result['mean_avg_at_k'])} | {_pct(result['mean_pass_at_k'])} | | | |"
        )
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"
