"""Writes a verl 0.9.1 rollout dump (`trainer.rollout_data_dir`) with verl's own code: `RayPPOTrainer._log_rollout_data`
on a real `DataProto` batch (prompts chat-templated and left-padded, responses right-padded, token-level scores, the
ground truth under `reward_model`), as verl's trainer calls it after a step, the scores by verl's own reward for the
data source (`default_compute_score`: `openai/gsm8k` takes the last `#### N` and compares it with the ground truth).
Run with .venv-verl's python:

    .venv-verl/bin/python tests/generator/helpers/verl_dump.py SPEC.json

SPEC: {"tokenizer": DIR, "out": DIR, "step": N, "data_source": "openai/gsm8k", "response_length": L,
       "groups": [{"problem", "gold", "completions": [...], "cut": [bool, ...] (optional)}]}.
A completion that was cut has no EOS and is `response_length` tokens long (its text is cut to that); the rest end with
EOS. The batch is reordered before the dump as verl's `_balance_batch` reorders it (`DataProto.reorder`), so a group's
rows are not next to each other. Prints the scores verl gave, one list per group, as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402
from verl.utils.reward_score import default_compute_score  # noqa: E402


def padded(rows: list[list[int]], pad: int, left: bool) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([[pad] * (width - len(r)) + r if left else r + [pad] * (width - len(r)) for r in rows])


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    length = spec["response_length"]
    prompts, responses, scores, truths, uids, given = [], [], [], [], [], []
    for g, group in enumerate(spec["groups"]):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": group["problem"]}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        cut = group.get("cut", [False] * len(group["completions"]))
        given.append([])
        for text, was_cut in zip(group["completions"], cut, strict=True):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            response = ids[:length] if was_cut else ids + [tokenizer.eos_token_id]
            assert len(response) <= length and (not was_cut or len(response) == length), (text, len(ids), length)
            # the reward manager scores the decoded response, as verl's does
            score = float(default_compute_score(spec["data_source"], tokenizer.decode(response, skip_special_tokens=True),
                                                group["gold"]))
            given[-1].append(score)
            prompts.append(list(prompt))
            responses.append(response)
            level = [0.0] * len(response)
            level[-1] = score  # verl's reward managers put the sequence's score on its last token
            scores.append(level)
            truths.append({"ground_truth": group["gold"], "style": "rule"})
            uids.append(f"group-{g}")
    pad = tokenizer.pad_token_id
    response_ids = padded(responses, pad, left=False)
    level_scores = torch.zeros(response_ids.shape, dtype=torch.float32)
    for row, level in enumerate(scores):
        level_scores[row, : len(level)] = torch.tensor(level)
    batch = DataProto.from_dict(
        tensors={"prompts": padded(prompts, pad, left=True), "responses": response_ids, "token_level_scores": level_scores},
        non_tensors={"reward_model": np.array(truths, dtype=object), "uid": np.array(uids, dtype=object)},
    )
    batch.reorder(torch.tensor(np.random.RandomState(spec["step"]).permutation(len(responses))))
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)  # the dump needs the tokenizer, the step and the dump executor only
    trainer.tokenizer = tokenizer
    trainer.global_steps = spec["step"]
    trainer._init_dump_executor()
    trainer._log_rollout_data(batch, reward_extra_infos_dict={}, timing_raw={}, rollout_data_dir=spec["out"])
    trainer._shutdown_dump_executor()
    print(json.dumps(given))


if __name__ == "__main__":
    main(sys.argv[1])
