"""Trainer benchmark: the same tiny run with GRPO and with GRAFT, side by side.

    python -m benchmarks.trainer_bench --json OUT [--steps 8] [--repeats 3]

Builds the toy world of the trainer's tests (a char-level Llama learner, a BPE Qwen2 peer whose
groups sit in a real store server on loopback), then runs GRPO and GRAFT alternately `repeats`
times each (alternating, so that load from other processes on the machine hits both alike).
Per-step times are the median over all steps but each run's first (warm-up) one.

Targets: step_time_ratio = GRAFT / GRPO <= 1.10; store_wait_share (time the GRAFT trainer blocks
on the store, over its step time) < 1%. Prints the JSON and writes it to --json.

    python -m benchmarks.trainer_bench --json OUT --ranks 2

--ranks N also runs GRAFT on the same global batch (every rollout seeded by its place in the batch) in one
process (parallel.strategy none) and on N ranks under torchrun with ddp and with fsdp, each through the
command a user types (`python -m graft.trainer.cli train`, `torchrun --nproc-per-node N -m graft.trainer.cli train`),
alternating; adds single_step_s, ddp_step_s, fsdp_step_s (median step time of the job: the slowest rank's),
their CPU seconds per step (all ranks), and the peak resident memory of each process (single_peak_rss_mb,
ddp_/fsdp_peak_rss_mb_per_rank: the largest rank's; benchmarks/traced_train.py records them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch
import yaml


def run_once(world, store_url: str, method: str, steps: int, run_dir: Path, prompts_per_step: int, group_size: int,
             lr: float, skip_zero_advantage: bool) -> list[dict]:
    from graft.trainer.loop import train

    train(bench_config(world, store_url, method, steps, run_dir, prompts_per_step, group_size, lr, skip_zero_advantage),
          overwrite=True)  # --workdir may hold the runs of an earlier benchmark
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


def run_ranked(world, store_url: str, strategy: str, ranks: int, steps: int, run_dir: Path, prompts_per_step: int,
               group_size: int, lr: float, model: Path | None) -> tuple[list[dict], list[float]]:
    """GRAFT through the CLI: one process (strategy none) or `ranks` ranks under torchrun; the metrics lines and each
    process's peak RSS in MB. model: another learner than the toy world's (an HF directory)."""
    cfg = bench_config(world, store_url, "graft", steps, run_dir, prompts_per_step, group_size, lr, False)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"seed_per_sample": True}),
                                 "parallel": cfg.parallel.model_copy(update={"strategy": strategy}),
                                 "model": cfg.model.model_copy(update={"path": str(model or world.learner_dir)})})
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    rss_dir = run_dir.with_name(run_dir.name + "-rss")
    launcher = [] if strategy == "none" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    env = dict(os.environ, GRAFT_BENCH_RSS_DIR=str(rss_dir), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, *launcher, "-m", "benchmarks.traced_train", "train", "--config", str(path), "--overwrite"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    rss = [json.loads(f.read_text())["peak_rss_mb"] for f in sorted(rss_dir.glob("rank*.json"))]
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()], rss


def bench_config(world, store_url: str, method: str, steps: int, run_dir: Path, prompts_per_step: int, group_size: int,
                 lr: float, skip_zero_advantage: bool):
    from graft.trainer.config import TrainConfig

    return TrainConfig.model_validate({
        "run_dir": str(run_dir), "seed": 0, "steps": steps, "method": method, "torch_threads": 1,
        "model": {"path": str(world.learner_dir), "device": "cpu"},
        "data": {"dataset": str(world.problems_path)}, "prompt": {"template": "raw"},
        "rollout": {"backend": "hf", "group_size": group_size, "prompts_per_step": prompts_per_step,
                    "max_response_tokens": 16, "generation_batch_size": 512, "scorer_workers": 1},
        "optim": {"lr": lr, "mini_batch_prompts": prompts_per_step, "micro_batch_size": 256,
                  "skip_zero_advantage": skip_zero_advantage},
        "graft": {"peer_tokenizers": [str(world.peer_dir)]},
        "store": {"url": store_url},
        "checkpoint": {"every_steps": 0, "keep_last": 1},
        "logging": {"progress": False},
    })


def existing_world(root: Path):
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
    parser.add_argument("--ranks", type=int, default=0,
                        help="also run GRAFT on one process and on this many ranks (ddp, fsdp) on the same global batch")
    parser.add_argument("--ranks-model", type=Path, default=None,
                        help="with --ranks: this learner (an HF directory, e.g. SmolLM2-135M) instead of the toy one, so "
                             "that weights and optimizer state, not the runtime, dominate the memory")
    parser.add_argument("--only-ranks", action="store_true", help="with --ranks: skip the GRPO / GRAFT comparison")
    args = parser.parse_args()

    from graft.services.store_api.http.testing import StoreServer
    from toy.world import build_toy_world

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trainer_bench-"))
    build_start = time.perf_counter()
    world_dir = workdir / "world"
    world = build_toy_world(world_dir) if not (world_dir / "store").exists() else existing_world(world_dir)
    build_s = time.perf_counter() - build_start
    steps: dict[str, list[dict]] = {"grpo": [], "graft": []}
    with StoreServer(world.store_root) as server:
        for repeat in range(0 if args.only_ranks else args.repeats):
            for method in ("grpo", "graft"):
                metrics = run_once(world, server.url, method, args.steps, workdir / f"{method}-{repeat}",
                                   args.prompts_per_step, args.group_size, args.lr, args.skip_zero_advantage)
                steps[method].extend(metrics[1:])  # the first step warms up (allocations, scorer cache)
        ranked: dict[str, list[dict]] = {"none": [], "ddp": [], "fsdp": []}
        peak_rss: dict[str, list[float]] = {"none": [], "ddp": [], "fsdp": []}
        for repeat in range(args.repeats if args.ranks else 0):
            for strategy in ranked:
                metrics, rss = run_ranked(world, server.url, strategy, args.ranks, args.steps,
                                          workdir / f"ranks-{strategy}-{repeat}", args.prompts_per_step, args.group_size,
                                          args.lr, args.ranks_model)
                ranked[strategy].extend(metrics[1:])
                peak_rss[strategy].append(max(rss))

    def median(method: str, key: str) -> float:
        return statistics.median(m[key] for m in steps[method])

    result: dict = {
        "prompts_per_step": args.prompts_per_step,
        "group_size": args.group_size,
        "lr": args.lr,
        "skip_zero_advantage": args.skip_zero_advantage,
        "toy_world_build_s": build_s,
        "cpus": os.cpu_count(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg()[0],
    }
    if not args.only_ranks:
        graft_time = sum(m["step_time_s"] for m in steps["graft"])
        result.update({
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
            "targets": {"step_time_ratio": "<= 1.10", "store_wait_share": "< 0.01"},
        })
    if args.ranks:
        def ranked_median(strategy: str, key: str) -> float:
            return statistics.median(m[key] for m in ranked[strategy])

        result.update({
            "ranks": args.ranks,
            "single_step_s": ranked_median("none", "step_time_s"),
            "ddp_step_s": ranked_median("ddp", "step_time_s"),
            "fsdp_step_s": ranked_median("fsdp", "step_time_s"),
            "single_step_cpu_s": ranked_median("none", "step_cpu_s"),
            "ddp_step_cpu_s": ranked_median("ddp", "step_cpu_s"),  # all ranks' processes
            "fsdp_step_cpu_s": ranked_median("fsdp", "step_cpu_s"),
            **{f"{name}_{stage}": ranked_median(strategy, stage) for name, strategy in
               (("single", "none"), ("ddp", "ddp"), ("fsdp", "fsdp")) for stage in ("generation_s", "update_s")},
            "single_peak_rss_mb": max(peak_rss["none"]),
            "ddp_peak_rss_mb_per_rank": max(peak_rss["ddp"]),
            "fsdp_peak_rss_mb_per_rank": max(peak_rss["fsdp"]),
            "ranked_frac_grafted": {s: statistics.mean(m["frac_grafted"] for m in ranked[s]) for s in ranked},
            "ranked_steps_measured": len(ranked["fsdp"]),
        })
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
