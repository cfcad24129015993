"""Run by test_vllm_backend.py with .venv-vllm/bin/python: sample with the vLLM engine and write the samples as JSON.

usage: python vllm_check.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import dataclasses
import json
import sys

PROMPTS = ["12+7=", "3+40=", "1+1=", "44+44="]
PARAM_SETS = [
    {"n": 4, "temperature": 1.0, "max_tokens": 12, "seed": 0},
    {"n": 4, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "max_tokens": 12, "seed": 1},
    {"n": 1, "temperature": 0.0, "max_tokens": 12},
]


def main() -> None:
    from graft.rollouts.sampling import SamplingParams
    from graft.rollouts.vllm_backend import VLLMBackend

    model_dir, out_path = sys.argv[1], sys.argv[2]
    backend = VLLMBackend.from_path(model_dir, model_id="tiny", max_model_len=128)
    runs = []
    for values in PARAM_SETS:
        groups = backend.generate(PROMPTS, SamplingParams(**values))
        runs.append({"params": values, "groups": [[dataclasses.asdict(s) for s in g] for g in groups]})
    again = backend.generate(PROMPTS, SamplingParams(**PARAM_SETS[0]))
    result = {
        "prompts": PROMPTS,
        "tokenizer_id": backend.tokenizer_id,
        "eos_token_ids": sorted(backend.eos_token_ids),
        "runs": runs,
        "seeded_repeat_equal": [[s.token_ids for s in g] for g in again] == [[s["token_ids"] for s in g] for g in runs[0]["groups"]],
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
