"""Benchmark evaluation (GRAFT_SPEC section 10): avg@k and pass@k per benchmark and the mean over the
five, with the same backends, prompts and scorer as the generator. `graft-eval` and the trainer's
periodic evaluation both call `evaluate`."""

from __future__ import annotations

import time

from tqdm import tqdm

from rollouts.datasets import BENCHMARKS
from rollouts.prompts import PromptTemplate, build_prompt
from rollouts.sampling import Backend, SamplingParams
from rollouts.scoring import Scorer
from schemas import Problem


def evaluate(
    backend: Backend,
    problems_by_benchmark: dict[str, list[Problem]],
    k: int,
    params: SamplingParams,
    scorer: Scorer,
    *,
    template: PromptTemplate = "auto",
    few_shot: int = 0,
    prompts_per_batch: int = 64,
    progress: bool = False,
) -> dict:
    """Sample k completions per problem and score them.

    Returns {"k", "temperature", "top_p", "max_tokens", "benchmarks": {name: {"problems", "samples",
    "avg_at_k", "pass_at_k", "unscored", "mean_completion_tokens", "finished_share"}},
    "mean_avg_at_k", "mean_pass_at_k" (over the five GRAFT benchmarks that were evaluated; None if none),
    "mean_over": [their names], "wall_s"}. avg@k is the mean correctness over all k samples, pass@k
    the share of problems with at least one correct sample. A problem whose gold does not parse
    (reward null) counts as wrong and is counted in "unscored".
    """
    if params.n != k:
        raise ValueError(f"evaluate(k={k}) but params.n = {params.n}: they must agree")
    started = time.perf_counter()
    total = sum(len(p) for p in problems_by_benchmark.values())
    bar = tqdm(total=total, disable=not progress, unit="problem", dynamic_ncols=True)
    results: dict[str, dict] = {}
    try:
        for name, problems in problems_by_benchmark.items():
            correct_per_problem: list[int] = []
            unscored = tokens = finished = 0
            for start in range(0, len(problems), prompts_per_batch):
                batch = problems[start : start + prompts_per_batch]
                prompts = [build_prompt(backend.tokenizer, p.problem, template, few_shot) for p in batch]
                samples = backend.generate(prompts, params)  # (prompts, k)
                texts = [s.text for group in samples for s in group]
                golds = [p.answer for p in batch for _ in range(k)]
                scores = scorer.score(texts, golds)
                for i in range(len(batch)):
                    group_scores = scores[i * k : (i + 1) * k]
                    correct_per_problem.append(sum(s.correct for s in group_scores))
                    unscored += any(s.reward is None for s in group_scores)
                tokens += sum(len(s.token_ids) for group in samples for s in group)
                finished += sum(s.finish_reason == "stop" for group in samples for s in group)
                bar.update(len(batch))
                bar.set_postfix({name: f"{sum(correct_per_problem) / (k * len(correct_per_problem)):.1%}"}, refresh=False)
            n = len(problems)
            results[name] = {
                "problems": n,
                "samples": n * k,
                "avg_at_k": sum(correct_per_problem) / (n * k) if n else None,
                "pass_at_k": sum(c > 0 for c in correct_per_problem) / n if n else None,
                "unscored": unscored,
                "mean_completion_tokens": tokens / (n * k) if n else None,
                "finished_share": finished / (n * k) if n else None,
            }
    finally:
        bar.close()
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
        "wall_s": time.perf_counter() - started,
    }


def markdown_table(result: dict, model_id: str) -> str:
    """The results as a Markdown table: one row per benchmark, then the mean over the five."""
    k = result["k"]
    lines = [
        f"Model `{model_id}`, k = {k}, temperature {result['temperature']}, top_p {result['top_p']}, "
        f"max tokens {result['max_tokens']}",
        "",
        f"| benchmark | problems | avg@{k} | pass@{k} | mean tokens | finished |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["benchmarks"].items():
        lines.append(
            f"| {name} | {r['problems']} | {_pct(r['avg_at_k'])} | {_pct(r['pass_at_k'])} | "
            f"{'-' if r['mean_completion_tokens'] is None else round(r['mean_completion_tokens'])} | {_pct(r['finished_share'])} |"
        )
    if result["mean_over"]:
        lines.append(
            f"| mean of {len(result['mean_over'])} ({', '.join(result['mean_over'])}) | | "
            f"{_pct(result['mean_avg_at_k'])} | {_pct(result['mean_pass_at_k'])} | | |"
        )
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"
