"""Writes a verl 0.9.1 rollout dump (`trainer.rollout_data_dir`) with verl's own code: `RayPPOTrainer._log_rollout_data`
on a real `DataProto` batch (prompts chat-templated and left-padded, responses right-padded, token-level scores, the
ground truth under `reward_model`), as verl's trainer calls it after a step. Run with .venv-verl's python:

    .venv-verl/bin/python tests/generator/helpers/verl_dump.py SPEC.json

SPEC: {"tokenizer": DIR, "out": DIR, "step": N, "groups": [{"problem", "gold", "completions": [...], "scores": [...]}]}.
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


def padded(rows: list[list[int]], pad: int, left: bool) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([[pad] * (width - len(r)) + r if left else r + [pad] * (width - len(r)) for r in rows])


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    prompts, responses, scores, truths, uids = [], [], [], [], []
    for g, group in enumerate(spec["groups"]):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": group["problem"]}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        for i, (text, score) in enumerate(zip(group["completions"], group["scores"], strict=True)):
            response = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            prompts.append(list(prompt))
            responses.append(response)
            level = [0.0] * len(response)
            level[-1] = float(score)  # verl's reward managers put the sequence's score on its last token
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
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)  # the dump needs the tokenizer, the step and the dump executor only
    trainer.tokenizer = tokenizer
    trainer.global_steps = spec["step"]
    trainer._init_dump_executor()
    trainer._log_rollout_data(batch, reward_extra_infos_dict={}, timing_raw={}, rollout_data_dir=spec["out"])
    trainer._shutdown_dump_executor()


if __name__ == "__main__":
    main(sys.argv[1])
