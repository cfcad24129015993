"""A real TRL 1.16 `GRPOTrainer` run that writes the completions files `graft-import --format trl` reads, as users run
it: a conversational dataset (a system turn and the user's problem), `num_iterations: 2` (each generation batch trains
two steps, so the table TRL rewrites from its deque every logging step holds the same groups under two step labels),
an eval set evaluated mid-run (TRL 1.16 writes the eval completions into the same files), `log_completions=True`.

The model is given a chat template that renders the user turns only, so that a toy model warm-started on bare
problems answers the conversational prompts as it learned to (mixed rewards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from graft.rollouts.scoring import extract_last_boxed
from graft.schemas import Problem

SYSTEM = "Answer with the sum in \\boxed{}."
USER_TURNS_TEMPLATE = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"


def conversation(problem: Problem) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem.problem}]


def accuracy(completions: list, answer: list[str], **_: Any) -> list[float]:
    """1.0 for a completion whose last \\boxed{} is the answer, else 0.0: the run's own reward function."""
    return [float(extract_last_boxed(c[-1]["content"]) == a) for c, a in zip(completions, answer, strict=True)]


def run_trl(model_dir: Path, train: list[Problem], evaluate: list[Problem], out: Path, *, max_steps: int = 6,
            eval_steps: int = 5, num_generations: int = 4, max_completion_length: int = 12, seed: int = 0) -> Path:
    """Train `model_dir` with GRPO for `max_steps` (its tokenizer given the user-turns chat template); returns the
    run's output_dir, whose completions/ holds TRL's files and tokenizer/ the run's tokenizer. A generation batch is 2
    prompts x num_generations and trains 2 steps; evaluation (1 prompt x num_generations at a time) at `eval_steps`
    and at the end. With the defaults and 6 training prompts, TRL's files hold: steps 1 and 2 the first batch, 3 and 4
    the second, 5 the third batch's second group and an eval group (the evaluation rewrote the file from its deque),
    6 two eval groups."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = USER_TURNS_TEMPLATE
    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=2 * num_generations, num_generations=num_generations,
        max_completion_length=max_completion_length, max_steps=max_steps, num_iterations=2, logging_steps=1,
        eval_strategy="steps", eval_steps=eval_steps, per_device_eval_batch_size=num_generations, report_to=[], use_cpu=True,
        save_strategy="no", log_completions=True, disable_tqdm=True, seed=seed, learning_rate=1e-5)

    def dataset(problems: list[Problem]) -> Dataset:
        return Dataset.from_list([{"prompt": conversation(p), "answer": p.answer} for p in problems])

    torch.manual_seed(seed)
    GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=accuracy, args=args,
                train_dataset=dataset(train), eval_dataset=dataset(evaluate), processing_class=tokenizer).train()
    tokenizer.save_pretrained(out / "tokenizer")  # the run's tokenizer, chat template included: the import's
    return out
