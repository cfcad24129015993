"""A GraftGRPOTrainer run on the toy world, as the TRL tests build it: in-process (`make_trainer`), or under torchrun
(`python trl_run.py SPEC.json`: every process trains, the main one writes the final weights and TRL's log history)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from graft.integrations.trl import GraftConfig, GraftGRPOTrainer
from graft.rollouts.scoring import extract_last_boxed
from graft.schemas import Problem


def accuracy(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1 for a completion whose last \\boxed{} holds the answer, else 0 (the toy task's reward)."""
    return [float(extract_last_boxed(text) == gold) for text, gold in zip(completions, answer)]


def dataset(problems: list[Problem]) -> Dataset:
    """The problems as a TRL dataset: the prompt (the problem text, as the toy models were trained), its store id, the
    problem and its answer (what a want and a published group carry)."""
    return Dataset.from_list([{"prompt": p.problem, "prompt_id": p.prompt_id, "problem": p.problem, "answer": p.answer}
                              for p in problems])


def make_args(out_dir: Path, store_url: str | None, peer_dir: Path | None, **overrides: Any) -> GraftConfig:
    """4 prompts x G = 8 completions of at most 16 tokens per step, one optimizer step per generation batch."""
    settings: dict[str, Any] = dict(
        output_dir=str(out_dir), per_device_train_batch_size=32, num_generations=8, max_completion_length=16,
        max_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        disable_tqdm=True, graft_store_url=store_url, graft_peer_tokenizers=[str(peer_dir)] if peer_dir else None,
        # the `spec` preset's formulas (b, peer negatives) unless a test says otherwise: the tests check b and peer negatives
        graft_options={"token_is": "tis", "peer_negative_scale": 1.0},
    )
    return GraftConfig(**(settings | overrides))


def make_trainer(learner_dir: Path, problems: list[Problem], args: GraftConfig) -> GraftGRPOTrainer:
    model = AutoModelForCausalLM.from_pretrained(learner_dir)
    return GraftGRPOTrainer(model=model, reward_funcs=accuracy, args=args, train_dataset=dataset(problems),
                            processing_class=AutoTokenizer.from_pretrained(learner_dir))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    args = make_args(Path(spec["out"]) / "trl", spec["store_url"], Path(spec["peer_dir"]), **spec["args"])
    trainer = make_trainer(Path(spec["learner_dir"]), [Problem(**p) for p in spec["problems"]], args)
    trainer.train()
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, Path(spec["out"]) / "weights.pt")
        (Path(spec["out"]) / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    # every process waits for the main one's files, then gloo's threads are stopped before the interpreter exits: a
    # process group left to the interpreter's teardown aborted one rank ("terminate called without an active
    # exception", SIGABRT) after a run that had finished (CI, stop 41)
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
