"""GRAFT inside TRL beside TRL's GRPO and graft-train's GRPO / GRAFT: one step of each, side by side.

    python -m benchmarks.trl_bench --json OUT [--steps 8] [--repeats 2] [--workdir DIR]

Builds the trainer benchmark's toy world (benchmarks/trainer_bench.py: a char-level Llama learner partly trained on
half of 32 `a+b=` problems, a BPE Qwen3 peer whose groups sit in a real store server on loopback), then runs, in
turn and `repeats` times each (alternating, so that load from other processes hits all four alike):
- trl-grpo:    TRL's GRPOTrainer (GraftGRPOTrainer without a store: the parent's code path untouched)
- trl-graft:   GraftGRPOTrainer grafting from the store
- train-grpo:  graft-train, method grpo
- train-graft: graft-train, method graft
on the same learner, problems, prompts per step, group size, completion length, learning rate and clip
(graft-train's configuration is GraftConfig.train_config of the TRL one). A step is one optimizer step: TRL's from
the callback's step begin to step end (generation, rewards, GRAFT, loss, backward, optimizer), graft-train's its
metrics line's step_time_s. Medians over all steps but each run's first (warm-up) one.

What GRAFT adds: in TRL, graft/graft_s (the gathered prompt ids and lookup start, the gate, the re-tokenisation, the
grafted rows' pi_old forward and the splice); in graft-train, gate_s plus the update's difference.
Target: trl-graft step <= 1.05 x trl-grpo step. Prints the JSON and writes it to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import orjson
import torch


class StepTimer:
    """A TRL callback: wall and CPU seconds of every optimizer step."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._began = (0.0, 0.0)

    def hooks(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._began = (time.perf_counter(), time.process_time())

            def on_step_end(self, args, state, control, **kwargs):
                timer.wall.append(time.perf_counter() - timer._began[0])
                timer.cpu.append(time.process_time() - timer._began[1])

        return _Callback()


def trl_args(workdir: Path, store_url: str | None, peer_dir: Path, steps: int, prompts: int, group_size: int, lr: float):
    from graft.integrations.trl import GraftConfig

    return GraftConfig(
        output_dir=str(workdir), per_device_train_batch_size=prompts * group_size, num_generations=group_size,
        max_completion_length=16, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, epsilon=0.2, epsilon_high=0.28,
        delta=3.0, graft_store_url=store_url, graft_peer_tokenizers=[str(peer_dir)],
    )


def run_trl(world, problems, store_url: str | None, steps: int, run_dir: Path, prompts: int, group_size: int,
            lr: float) -> list[dict]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graft.integrations.trl import GraftGRPOTrainer
    from graft.rollouts.scoring import extract_last_boxed

    def accuracy(completions, answer, **_):
        return [float(extract_last_boxed(text) == gold) for text, gold in zip(completions, answer)]

    timer = StepTimer()
    trainer = GraftGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(world.learner_dir), reward_funcs=accuracy,
        args=trl_args(run_dir, store_url, world.peer_dir, steps, prompts, group_size, lr),
        train_dataset=Dataset.from_list([{"prompt": p["problem"], "prompt_id": p["prompt_id"], "answer": p["answer"]}
                                         for p in problems]),
        processing_class=AutoTokenizer.from_pretrained(world.learner_dir), callbacks=[timer.hooks()],
    )
    trainer.train()
    lines = [line for line in trainer.state.log_history if "loss" in line]
    return [{"step_s": wall, "step_cpu_s": cpu, **{k: v for k, v in line.items() if k.startswith("graft/")}}
            for wall, cpu, line in zip(timer.wall, timer.cpu, lines)]


def run_graft_train(world, store_url: str, method: str, steps: int, run_dir: Path, prompts: int, group_size: int,
                    lr: float) -> list[dict]:
    from graft.trainer.config import TrainConfig
    from graft.trainer.loop import train

    same = trl_args(run_dir, store_url, world.peer_dir, steps, prompts, group_size, lr).train_config(
        str(world.learner_dir), dataset=str(world.problems_path)).model_dump(mode="json")
    same.update(run_dir=str(run_dir), method=method, torch_threads=1, checkpoint={"every_steps": 0, "keep_last": 1},
                logging={"progress": False})
    same["model"]["device"] = "cpu"
    same["prompt"] = {"template": "raw"}  # TRL's prompt is the problem text, as the toy models learnt it
    same["rollout"].update(backend="hf", generation_batch_size=512, scorer_workers=1)
    same["optim"]["micro_batch_size"] = 256  # one forward for the batch, as TRL's one optimizer step here
    train(TrainConfig.model_validate(same))
    lines = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    return [{"step_s": m["step_time_s"], "step_cpu_s": m["step_cpu_s"], "gate_s": m["gate_s"], "update_s": m["update_s"],
             "generation_s": m["generation_s"], "frac_grafted": m["frac_grafted"]} for m in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="write the result JSON here")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each of the four (alternating)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4, help="small, so that the policies stay alike over the run")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the toy world and runs here (default: a temp dir)")
    args = parser.parse_args()

    from benchmarks.trainer_bench import existing_world
    from graft.services.store_api.http.testing import StoreServer
    from toy.world import build_toy_world

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trl_bench-"))
    world_dir = workdir / "world"
    world = build_toy_world(world_dir) if not (world_dir / "store").exists() else existing_world(world_dir)
    problems = [json.loads(line) for line in world.problems_path.read_text().splitlines() if line.strip()]
    common = (args.steps, args.prompts_per_step, args.group_size, args.lr)
    steps: dict[str, list[dict]] = {"trl-grpo": [], "trl-graft": [], "train-grpo": [], "train-graft": []}
    with StoreServer(world.store_root) as server:
        for repeat in range(args.repeats):
            for name in steps:
                run_dir = workdir / f"{name}-{repeat}"
                if name.startswith("trl"):
                    lines = run_trl(world, problems, server.url if name == "trl-graft" else None, args.steps, run_dir,
                                    *common[1:])
                else:
                    lines = run_graft_train(world, server.url, name.removeprefix("train-"), args.steps, run_dir, *common[1:])
                steps[name].extend(lines[1:])  # the first step warms up

    def median(name: str, key: str) -> float:
        return statistics.median(line[key] for line in steps[name])

    result = {
        "prompts_per_step": args.prompts_per_step, "group_size": args.group_size, "max_completion_tokens": 16,
        "lr": args.lr, "steps_measured_per_run_kind": len(steps["trl-graft"]), "cpus": os.cpu_count(),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg()[0],
        **{f"{name}_step_s": median(name, "step_s") for name in steps},
        **{f"{name}_step_cpu_s": median(name, "step_cpu_s") for name in steps},
        "trl_graft_over_grpo": median("trl-graft", "step_s") / median("trl-grpo", "step_s"),
        "trl_graft_over_grpo_cpu": median("trl-graft", "step_cpu_s") / median("trl-grpo", "step_cpu_s"),
        "trl_graft_added_s": median("trl-graft", "graft/graft_s"),
        "trl_frac_grafted": statistics.mean(line["graft/frac_grafted"] for line in steps["trl-graft"]),
        "trl_store_wait_s": statistics.mean(line["graft/store_wait_s"] for line in steps["trl-graft"]),
        "trl_lookups_late": sum(line["graft/store_lookups_late"] for line in steps["trl-graft"]),
        "train_graft_over_grpo": median("train-graft", "step_s") / median("train-grpo", "step_s"),
        "train_graft_gate_s": median("train-graft", "gate_s"),
        "train_update_s": {"grpo": median("train-grpo", "update_s"), "graft": median("train-graft", "update_s")},
        "train_frac_grafted": statistics.mean(line["frac_grafted"] for line in steps["train-graft"]),
        "target": {"trl_graft_over_grpo": "<= 1.05"},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
