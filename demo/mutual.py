"""`make demo-mutual`: do two models that are each strong where the other is weak improve each other through GRAFT,
with no designated teacher? The paper's headline claim (issue 27), measured on a complementary pair.

1. data: the families of configs/demo_mutual.yaml (`add3` and its operands swapped, `add3r`: as hard by construction,
   so that neither model is better on average; and `add2`, which both warm starts learn first)
2. two heterogeneous models warm-started to be strong on one family each: A, a Llama with a character-level tokenizer
   (the demo's learner slot: strong on `task.strong_family`), and B, a Qwen2 with a byte-level BPE (the peer slot:
   strong on `task.weak_family`), each stopped at a measured level (SFTConfig.stop_when)
3. the store API over a store root; each warm start's scored groups for the RL prompts go in once, before training
   (the "stored trajectories" setting)
4. per seed, under the same per-model rollout budget: each model alone with GRPO; the two co-training through the
   store with each GRAFT of `rl.variants` (the spec's defaults, b = 1, the changed GRAFT); each model offline from
   the other's stored groups (spec defaults)
5. held-out greedy accuracy per family at every evaluation, and report/mutual/: summary.json, REPORT.md, plots

Every stage is cached under demo_out/mutual/ by a hash of its config (demo.run's stages and job runner):
    python -m demo.mutual [--quick] [--config configs/demo_mutual.yaml] [--set rl.seeds=[3,4,5] ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from demo.config import DemoConfig, config_hash
from demo.jobs import Job, run_jobs
from demo.run import REPO_ROOT, TRAIN_BASE, command_line, generator_job, model_jobs, prepare_data, train_job, trainer_config
from rollouts.files import write_jsonl_atomic
from toy.task import completion_text, family_splits

DEFAULT_CONFIG = REPO_ROOT / "configs" / "demo_mutual.yaml"
ROLES = ("learner", "peer")  # DemoConfig's two build slots: A is built in the learner's, B in the peer's
NAME = {"learner": "A", "peer": "B"}
OTHER = {"learner": "peer", "peer": "learner"}
MODEL_ID = {"learner": "mutual-a-llama", "peer": "mutual-b-qwen2"}  # ids of the RL runs' own groups (co-training)
STORED_ID = {role: f"{model_id}-stored" for role, model_id in MODEL_ID.items()}  # the warm starts' groups, made once
SPEC_VARIANT = "graft"  # the key of rl.variants that must hold the spec's defaults: the offline runs use it too


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    cfg, env, kernels, out = command_line("python -m demo.mutual", __doc__, DEFAULT_CONFIG, argv)
    check_config(cfg)
    a_strong, b_strong = cfg.task.strong_family, cfg.task.weak_family
    print(f"GRAFT mutual demo ({cfg.mode}): A strong on {a_strong}, B strong on {b_strong}; outputs in {out}, report in "
          f"{cfg.report_dir}, {cfg.workers} processes at once", flush=True)

    data = prepare_data(cfg, out / "data")
    data.update(anchor_files(cfg, out / "data"))
    build_jobs, models = model_jobs(cfg, data, out, kernels, peer_after_learner=False)  # co-training needs both at once

    from services.store_api.http.server import StoreServer

    store_root = out / f"store-{config_hash(cfg.task, cfg.peer_groups, *(models[r]['checkpoint_hash'] for r in ROLES))}"
    with StoreServer(store_root) as server:
        print(f"store API up at {server.url} over {store_root} (pid {server.pid})", flush=True)
        jobs, runs = mutual_jobs(cfg, data, models, store_root, server.url, out)
        timings = run_jobs(build_jobs + jobs, cfg.workers, desc="SFT, stored groups, RL runs", env=env)
    for role in ROLES:
        models[role].update(json.loads((Path(models[role]["dir"]) / "done.json").read_text()))
    stored = {role: json.loads((store_root / f"groups-done-{STORED_ID[role]}.json").read_text()) for role in ROLES}

    from demo.mutual_report import write_report

    summary = write_report(cfg, models, runs, stored, timings, wall_time_s=time.perf_counter() - started)
    print()
    print((cfg.report_dir / "REPORT.md").read_text().split("<!-- table-end -->")[0])
    print(f"wall time {summary['wall_time_s']:.0f} s; report written to {cfg.report_dir}/", flush=True)
    return 0


def check_config(cfg: DemoConfig) -> None:
    """Refuse what the mutual demo cannot compare: it needs the spec's GRAFT among the variants (the offline runs and
    the verdict use it) and both models' strong families among the evaluated ones."""
    if SPEC_VARIANT not in cfg.rl.variants:
        raise SystemExit(f"rl.variants has no {SPEC_VARIANT!r} (the spec's GRAFT, for co-training and the offline runs): "
                         f"it has {sorted(cfg.rl.variants)}")
    for family in (cfg.task.strong_family, cfg.task.weak_family):
        if family not in cfg.task.n_eval or family not in cfg.task.rl_prompts:
            raise SystemExit(f"family {family} (a model's strong family) must be in task.n_eval and task.rl_prompts")
    if cfg.task.strong_family == cfg.task.weak_family:
        raise SystemExit("task.strong_family (A's) and task.weak_family (B's strong one) must differ")
    if not cfg.rl.cotrain:
        raise SystemExit("rl.cotrain=false: the mutual demo is about co-training; it runs the pairs whatever this says")
    if cfg.rl.ablations or cfg.rl.imitation_examples_per_step:
        raise SystemExit("rl.ablations and rl.imitation_examples_per_step are demo.run's (the learner against a fixed peer); "
                         "the mutual demo would ignore them: set rl.ablations={} and rl.imitation_examples_per_step=0")


def anchor_files(cfg: DemoConfig, data_dir: Path) -> dict[str, Path]:
    """Each model's supervised anchor, when rl.anchor_weight > 0: reference answers of its own strong family's RL split."""
    if cfg.rl.anchor_weight == 0:
        return {}
    paths = {}
    for role, family in (("learner", cfg.task.strong_family), ("peer", cfg.task.weak_family)):
        path = data_dir / f"anchor-{family}.jsonl"
        if not path.exists():
            problems = family_splits(family, cfg.task.n_eval[family], cfg.task.n_rl)["rl"]
            write_jsonl_atomic(path, [{"problem": p.problem, "completion": completion_text(p.answer)} for p in problems])
        paths[f"anchor_{role}"] = path
    return paths


def mutual_jobs(cfg: DemoConfig, data: dict[str, Path], models: dict[str, dict], store_root: Path, store_url: str,
                out: Path) -> tuple[list[Job], list[dict]]:
    """Two generator jobs (each warm start's groups, stored once) and the RL runs; `runs` has one entry per model and
    run (a co-training job is two entries: A in the job's folder, B in its `peer/`)."""
    base = yaml.safe_load(TRAIN_BASE.read_text())
    eval_sets = {f: str(data[f"eval_{f}"]) for f in cfg.task.n_eval}
    checkpoint = {role: models[role]["checkpoint"] for role in ROLES}
    jobs = [generator_job(cfg, data, checkpoint[role], STORED_ID[role], store_root, store_url, f"groups {NAME[role]}", [f"sft {role}"])
            for role in ROLES]
    runs: list[dict] = []

    def config(role: str, seed: int, method: str, model_id: str, peer_id: str | None, overrides: list[str]) -> dict:
        peers = ([peer_id], [checkpoint[OTHER[role]]]) if peer_id else None
        return trainer_config(cfg, base, data["rl"], checkpoint[role], model_id, seed, method, data.get(f"anchor_{role}"), peers,
                              store_url, overrides)

    def add(name: str, mode: str, seed: int, parts: list[tuple[str, dict]], deps: list[str]) -> None:
        job, job_dir = train_job(cfg, name, [train for _, train in parts], out, models, eval_sets, deps)
        jobs.append(job)
        for index, (role, _) in enumerate(parts):
            runs.append({"name": name, "mode": mode, "seed": seed, "model": NAME[role], "dir": str(job_dir if index == 0 else job_dir / "peer")})

    both = [f"sft {role}" for role in ROLES]
    for seed in cfg.rl.seeds:
        # Co-training first (two processes at once, easiest right after the warm starts): both models train on the same
        # prompts in the same order, each publishing every group it samples and taking the other's for its all-fail ones.
        for variant, overrides in cfg.rl.variants.items():
            # ids unique to what the pair computes, the config's other seeds left out: seed 0's pair is the same run
            # whichever seeds run beside it
            tag = config_hash(seed, variant, overrides, *(models[r]["checkpoint_hash"] for r in ROLES),
                              cfg.rl.model_dump(exclude={"seeds", "variants", "ablations", "ablation_seeds", "imitation_examples_per_step", "cotrain"}))[:8]
            ids = {role: f"{MODEL_ID[role]}-co{tag}" for role in ROLES}
            cotrain = ["store.mode=cotrain", f"store.cotrain_wait_s={cfg.rl.cotrain_wait_s}", "store.lookup_wait_s=0", *overrides]
            parts = [(role, config(role, seed, "graft", ids[role], ids[OTHER[role]], cotrain)) for role in ROLES]
            add(f"cotrain_{variant}-s{seed}", f"cotrain_{variant}", seed, parts, both)
        for role in ROLES:
            add(f"grpo_{NAME[role]}-s{seed}", "grpo", seed, [(role, config(role, seed, "grpo", MODEL_ID[role], None, []))], [f"sft {role}"])
            # offline: the other's warm start's groups, stored before training, with the spec's GRAFT
            offline = config(role, seed, "graft", MODEL_ID[role], STORED_ID[OTHER[role]], cfg.rl.variants[SPEC_VARIANT])
            add(f"offline_{NAME[role]}-s{seed}", "offline", seed, [(role, offline)], [f"sft {role}", f"groups {NAME[OTHER[role]]}"])
    return jobs, runs


if __name__ == "__main__":
    sys.exit(main())
