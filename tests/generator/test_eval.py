"""`evaluate` and `graft-eval` on the tiny model: avg@k and pass@k agree with scoring the samples by hand."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from graft.rollouts.evaluation import evaluate, markdown_table
from graft.rollouts.prompts import PromptConfig, build_prompt
from graft.rollouts.sampling import SamplingParams
from graft.rollouts.scoring import Scorer
from graft.schemas import Problem
from graft.services.generator.eval_cli import app
from toy.task import sample_problems, write_problems_jsonl

RAW = PromptConfig(template="raw")


def toy(count: int, seed: int, name: str) -> list[Problem]:
    return sample_problems(count, seed, dataset=name)


def test_greedy_evaluation_matches_scoring_by_hand(tiny_backend):
    problems = {"math500": toy(12, 1, "math500"), "gsm8k": toy(8, 2, "gsm8k")}
    params = SamplingParams(n=1, temperature=0.0, max_tokens=12)
    with Scorer(num_workers=1) as scorer:
        result = evaluate(tiny_backend, problems, 1, params, scorer, prompt=RAW, prompts_per_batch=5)
        for name, items in problems.items():
            samples = tiny_backend.generate([build_prompt(tiny_backend.tokenizer, p.problem, "raw") for p in items], params)
            scores = scorer.score([g[0].text for g in samples], [p.answer for p in items])
            expected = sum(s.correct for s in scores) / len(items)
            assert result["benchmarks"][name]["avg_at_k"] == expected == result["benchmarks"][name]["pass_at_k"]
            assert result["benchmarks"][name]["problems"] == len(items)
    assert result["mean_over"] == ["math500"]  # gsm8k is not one of the five
    assert result["mean_avg_at_k"] == result["benchmarks"]["math500"]["avg_at_k"]
    table = markdown_table(result, "tiny")
    assert "| math500 | 12 |" in table and "avg@1" in table


def test_sampled_evaluation_pass_at_k_bounds(tiny_backend):
    problems = {"aime24": toy(10, 3, "aime24"), "amc23": toy(6, 4, "amc23")}
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=0)
    with Scorer(num_workers=1) as scorer:
        result = evaluate(tiny_backend, problems, 4, params, scorer, prompt=RAW)
    for r in result["benchmarks"].values():
        assert 0.0 <= r["avg_at_k"] <= r["pass_at_k"] <= min(1.0, 4 * r["avg_at_k"])
        assert r["samples"] == 4 * r["problems"]
    means = [result["benchmarks"][b]["avg_at_k"] for b in ("aime24", "amc23")]
    assert abs(result["mean_avg_at_k"] - sum(means) / 2) < 1e-12


def test_eval_cli_writes_json_and_markdown(tiny_model_dir, tmp_path):
    data = write_problems_jsonl(sample_problems(6, 5), tmp_path / "toy.jsonl")
    out_json, out_md = tmp_path / "eval.json", tmp_path / "eval.md"
    result = CliRunner().invoke(app, [
        "--model", str(tiny_model_dir), "-b", str(data), "--k", "2", "--set", "max_tokens=12", "--set", "prompt.template=raw",
        "--set", "scoring.workers=1", "--set", f"output_json={out_json}", "--set", f"output_md={out_md}", "--set", "progress=false",
    ])
    assert result.exit_code == 0, result.output
    saved = json.loads(out_json.read_text())
    assert saved["k"] == 2 and saved["temperature"] == 0.6 and saved["top_p"] == 0.95  # the k > 1 defaults
    assert saved["benchmarks"][str(data)]["problems"] == 6
    assert "avg@2" in out_md.read_text()
    bad = CliRunner().invoke(app, ["--model", str(tiny_model_dir), "-b", "no_such_benchmark", "--set", "progress=false"])
    assert bad.exit_code == 2 and "no_such_benchmark" in bad.output
