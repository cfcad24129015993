"""Trainer benchmark: the same tiny run with GRPO and with GRAFT, side by side.

    python -m benchmarks.trainer_bench --json OUT [--steps 8] [--repeats 3]

Builds the toy world of the trainer's tests (a char-level Llama learner, a BPE Qwen2 peer whose
groups sit in a real store server on loopback), then runs GRPO and GRAFT alternately `repeats`
times each (alternating, so that load from other processes on the machine hits both alike).
Per-step times are the median over all steps but each run's first (warm-up) one.

Targets: step_time_ratio = GRAFT / GRPO <= 1.10; store_wait_share (time the GRAFT trainer blocks
on the store, over its step time) < 1%. Prints the JSON and writes it to --json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import orjson
import torch


def run_once(world, store_url: str, method: str, steps: int, run_dir: Path, prompts_per_step: int, group_size: int,
             lr: float, skip_zero_advantage: bool) -> list[dict]:
    from trainer.config import TrainConfig
    from trainer.loop import train

    cfg = TrainConfig.model_validate({
        "run_dir": str(run_dir), "seed": 0, "steps": steps, "method": method, "torch_threads": 1,
        "model": {"path": str(world.learner_dir), "device": "cpu"},
        "data": {"dataset": str(world.problems_path), "prompt_template": "raw"},
        "rollout": {"backend": "hf", "group_size": group_size, "prompts_per_step": prompts_per_step,
                    "max_response_tokens": 16, "generation_batch_size": 512, "scorer_workers": 1},
        "optim": {"lr": lr, "mini_batch_prompts": prompts_per_step, "micro_batch_size": 256,
                  "skip_zero_advantage": skip_zero_advantage},
        "graft": {"peer_tokenizers": [str(world.peer_dir)]},
        "store": {"url": store_url},
        "checkpoint": {"every_steps": 0, "keep_last": 1},
        "logging": {"progress": False},
    })
    train(cfg)
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def _existing_world(root: Path):
    """Reuse a toy world built by an earlier run with the same --workdir."""
    from toy.world import ToyWorld

    return ToyWorld(root / "learner", root / "peer", root / "train.jsonl", root / "anchor.jsonl", root / "store", [], [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="write the result JSON here")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per method (alternating)")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4, help="small, so that both policies stay alike over the run")
    parser.add_argument("--skip-zero-advantage", action="store_true",
                        help="optim.skip_zero_advantage for both methods (GRPO then skips its all-fail groups' compute)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the toy world and runs here (default: a temp dir)")
    args = parser.parse_args()

    from services.store_api.server import StoreServer
    from toy.world import build_toy_world

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trainer_bench-"))
    build_start = time.perf_counter()
    world_dir = workdir / "world"
    world = build_toy_world(world_dir) if not (world_dir / "store").exists() else _existing_world(world_dir)
    build_s = time.perf_counter() - build_start
    steps: dict[str, list[dict]] = {"grpo": [], "graft": []}
    with StoreServer(world.store_root) as server:
        for repeat in range(args.repeats):
            for method in ("grpo", "graft"):
                metrics = run_once(world, server.url, method, args.steps, workdir / f"{method}-{repeat}",
                                   args.prompts_per_step, args.group_size, args.lr, args.skip_zero_advantage)
                steps[method].extend(metrics[1:])  # the first step warms up (allocations, scorer cache)

    def median(method: str, key: str) -> float:
        return statistics.median(m[key] for m in steps[method])

    graft_time = sum(m["step_time_s"] for m in steps["graft"])
    result = {
        "grpo_step_s": median("grpo", "step_time_s"),
        "graft_step_s": median("graft", "step_time_s"),
        "step_time_ratio": median("graft", "step_time_s") / median("grpo", "step_time_s"),
        # CPU time of the trainer process per step: what other jobs on a shared machine inflate least.
        "grpo_step_cpu_s": median("grpo", "step_cpu_s"),
        "graft_step_cpu_s": median("graft", "step_cpu_s"),
        "step_cpu_ratio": median("graft", "step_cpu_s") / median("grpo", "step_cpu_s"),
        "store_wait_share": sum(m["store_wait_s"] for m in steps["graft"]) / graft_time,
        "graft_store_wait_s_per_step": statistics.mean(m["store_wait_s"] for m in steps["graft"]),
        "grpo_generation_s": median("grpo", "generation_s"),
        "graft_generation_s": median("graft", "generation_s"),
        "grpo_update_s": median("grpo", "update_s"),
        "graft_update_s": median("graft", "update_s"),
        "graft_gate_s": median("graft", "gate_s"),
        "grpo_gate_s": median("grpo", "gate_s"),
        "graft_frac_grafted": statistics.mean(m["frac_grafted"] for m in steps["graft"]),
        "graft_peer_lookups_late": sum(m["store_lookups_late"] for m in steps["graft"]),
        "steps_measured_per_method": len(steps["graft"]),
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "lr": args.lr,
        "skip_zero_advantage": args.skip_zero_advantage,
        "toy_world_build_s": build_s,
        "cpus": os.cpu_count(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg()[0],
        "targets": {"step_time_ratio": "<= 1.10", "store_wait_share": "< 0.01"},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
