"""`make demo-mutual`: do two models, each strong where the other is weak, improve each other through GRAFT with no
designated teacher? The paper's headline claim, measured on the main demo's design (issues 27, 37).

1. data: the families of configs/demo_mutual.yaml: `add3` (A's strong, B's weak), `add3r` (the same sums with the
   operands swapped: B's strong, A's weak), and `add2`, which both learn first
2. two heterogeneous models warm-started to be strong on one family each: A, a Llama with a character-level tokenizer
   (the learner slot), and B, a Qwen2 with a byte-level BPE (the peer slot); each starts from its warm start's checkpoint
   whose weak family's sampled dev accuracy is nearest its level (DemoConfig.starts for A, peer_level for B)
3. the store API over a store root; each start's scored groups for the RL prompts go in once (the stored trajectories)
4. per seed, the same rollout budget for every run of a model, each model anchored on its own strong family: each model
   alone with GRPO; the two co-training through the store with the trainers' default GRAFT (the claim's) and with each
   other entry of `rl.methods`; each model offline from the other's stored groups, the same way; and, on `rl.imitation_seeds`, each model's ceiling (supervised on the other's correct answers)
5. held-out sampled accuracy per family at every evaluation; report/mutual/: the rule's verdicts per model, interference
   per family, the ceilings, plots

The budget (lr, with the anchors) was chosen before any GRAFT run by BUDGET_RULE on GRPO and the ceilings alone:
`python -m studies.mutual --budget` runs that pilot (report/mutual/budget/). `python -m studies.mutual --dose` runs the dose
study (studies.mutual_report.DOSE_RULE, report/mutual/dose/): offline, on seeds of its own, the single changes that tell
apart why GRAFT moves a weak family so much less than the ceiling. Every stage is cached under demo_out/mutual/:
    python -m studies.mutual [--quick] [--budget | --dose] [--config configs/demo_mutual.yaml] [--set rl.seeds=[4,5,6,7] ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from demo.config import DemoConfig, config_hash
from demo.jobs import CodeGuard, Job, python_module, run_jobs
from studies.mutual_report import (
    BUDGET_LRS,
    DOSE_LR,
    DOSE_LR_MODES,
    DOSE_RUNS,
    DOSE_SEEDS,
    NAME,
    OTHER,
    PILOT_SEED,
    ROLES,
    mode_name,
    strong_family,
    weak_family,
)
from demo.run import (
    REPO_ROOT,
    TRAIN_BASE,
    command_line,
    generator_job,
    model_jobs,
    prepare_data,
    progress_file,
    train_job,
    trainer_config,
)
from demo.stats import MIN_PAIRS_FOR_GAIN
from graft.rollouts.files import write_jsonl_atomic
from toy.task import completion_text, dataset_name, family_splits

DEFAULT_CONFIG = REPO_ROOT / "studies" / "configs" / "mutual_v1.yaml"
MODEL_ID = {"learner": "mutual-a-llama", "peer": "mutual-b-qwen2"}  # ids of the RL runs' own groups (co-training)
STORED_ID = {role: f"{model_id}-stored" for role, model_id in MODEL_ID.items()}  # the starts' groups, made once


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = sys.argv[1:] if argv is None else list(argv)
    budget = "--budget" in args  # the pilot (this module's docstring, which --help prints, says what it does)
    dose = "--dose" in args  # the dose study (DOSE_RULE)
    if budget and dose:
        raise SystemExit("--budget and --dose are two studies: run one at a time")
    cfg, env, kernels, out = command_line("python -m studies.mutual", __doc__, DEFAULT_CONFIG,
                                          [a for a in args if a not in ("--budget", "--dose")])
    guard = CodeGuard.of_checkout()  # the code every job runs: none starts once it has changed
    check_config(cfg)
    print(f"GRAFT mutual demo ({cfg.mode}{', the budget pilot' if budget else ''}): A strong on {cfg.task.strong_family}, B "
          f"strong on {cfg.task.weak_family}{', the dose study' if dose else ''}; outputs in {out}, report in {cfg.report_dir}, {cfg.workers} processes at once",
          flush=True)
    data = prepare_data(cfg, out / "data")
    data.update(anchor_files(cfg, out / "data"))
    build_jobs, models = model_jobs(cfg, data, out, kernels, peer_after_learner=False)  # co-training needs both at once

    from graft.services.store_api.http.testing import StoreServer

    store_root = out / f"store-{config_hash(cfg.task, cfg.peer_groups, *(models[r]['checkpoint_hash'] for r in ROLES))}"
    with StoreServer(store_root) as server:
        print(f"store API up at {server.url} over {store_root} (pid {server.pid})", flush=True)
        make = budget_jobs if budget else dose_jobs if dose else mutual_jobs
        jobs, runs = make(cfg, data, models, store_root, server.url, out)
        timings = run_jobs(build_jobs + jobs, cfg.workers, desc="SFT, stored groups, RL runs", env=env, guard=guard)
    for role in ROLES:
        models[role].update(json.loads((Path(models[role]["dir"]) / "done.json").read_text()))
    stored = {role: json.loads((store_root / f"groups-done-{STORED_ID[role]}.json").read_text()) for role in ROLES}

    from studies import mutual_report

    if budget:
        result = mutual_report.write_budget(cfg, models, runs, timings, wall_time_s=time.perf_counter() - started)
        print("\n".join(mutual_report.budget_lines(result)))
        return 0 if result["chosen_lr"] is not None else 1
    if dose:
        result = mutual_report.write_dose(cfg, models, runs, timings, wall_time_s=time.perf_counter() - started)
        print("\n".join(mutual_report.dose_lines(result)))
        return 0
    summary = mutual_report.write_report(cfg, models, runs, stored, timings, wall_time_s=time.perf_counter() - started)
    print()
    print((cfg.report_dir / "REPORT.md").read_text().split("<!-- table-end -->")[0])
    print(f"wall time {summary['wall_time_s']:.0f} s; report written to {cfg.report_dir}/", flush=True)
    return 0


def check_config(cfg: DemoConfig) -> None:
    """Refuse what the mutual demo cannot compare: both models' strong families among the evaluated ones, one start per
    model, and nothing of demo.run's that it would ignore."""
    for family in (cfg.task.strong_family, cfg.task.weak_family):
        if family not in cfg.task.n_eval or family not in cfg.task.rl_prompts:
            raise SystemExit(f"family {family} (a model's strong family) must be in task.n_eval and task.rl_prompts")
    if cfg.task.strong_family == cfg.task.weak_family:
        raise SystemExit("task.strong_family (A's) and task.weak_family (B's strong one) must differ")
    if len(cfg.starts) != 1:
        raise SystemExit(f"starts {cfg.starts}: the mutual demo starts A once (one level); give one")
    if cfg.mode == "full" and len(cfg.rl.seeds) < MIN_PAIRS_FOR_GAIN:
        raise SystemExit(f"rl.seeds {cfg.rl.seeds}: each model's verdicts pair its runs by seed, and with fewer than "
                         f"{MIN_PAIRS_FOR_GAIN} pairs the sign-flip test's smallest p is {2 / 2 ** len(cfg.rl.seeds):.3f}: "
                         f"no method could be judged a gain; give at least {MIN_PAIRS_FOR_GAIN} seeds")
    if cfg.rl.cotrain_seeds:
        raise SystemExit("rl.cotrain_seeds is demo.run's (its learner and peer); the mutual demo co-trains on every seed of "
                         "rl.seeds: set rl.cotrain_seeds=[]")
    if cfg.rl.methods.get("graft") != []:
        raise SystemExit(f"rl.methods {sorted(cfg.rl.methods)}: the mutual demo's claim is judged on the trainers' default "
                         "GRAFT, `graft: []`; other entries (name -> trainer overrides) run beside it, co-training and "
                         "offline, as further rows")


def anchor_files(cfg: DemoConfig, data_dir: Path) -> dict[str, Path]:
    """Each model's supervised anchor: reference answers of its own strong family's RL split."""
    paths = {}
    for role in ROLES:
        family = strong_family(cfg, role)
        path = data_dir / f"anchor-{family}.jsonl"
        if not path.exists():
            problems = family_splits(family, cfg.task.n_eval[family], cfg.task.n_rl)["rl"]
            write_jsonl_atomic(path, [{"problem": p.problem, "completion": completion_text(p.answer)} for p in problems])
        paths[f"anchor_{role}"] = path
    return paths


class _Plan:
    """What both the pilot and the demo build: the stored-groups jobs, and per model its trainer configs."""

    def __init__(self, cfg: DemoConfig, data: dict[str, Path], models: dict[str, dict], store_root: Path, store_url: str,
                 out: Path):
        self.cfg, self.data, self.models, self.store_root, self.store_url, self.out = cfg, data, models, store_root, store_url, out
        self.base = yaml.safe_load(TRAIN_BASE.read_text())
        self.eval_sets = {f: str(data[f"eval_{f}"]) for f in cfg.task.n_eval}
        self.start = {role: next(iter(models[role]["start_dirs"].values())) for role in ROLES}
        self.jobs = [generator_job(cfg, data, self.start[role], STORED_ID[role], store_root, store_url, f"groups {NAME[role]}",
                                   [f"sft {role}"]) for role in ROLES]
        self.runs: list[dict] = []

    def config(self, role: str, seed: int, method: str, model_id: str, peer_id: str | None, overrides: list[str]) -> dict:
        peers = ([peer_id], [self.start[OTHER[role]]]) if peer_id else None
        return trainer_config(self.cfg, self.base, self.data["rl"], self.start[role], model_id, seed, method,
                              self.data[f"anchor_{role}"], peers, self.store_url, overrides)

    def add(self, name: str, mode: str, seed: int, parts: list[tuple[str, dict]], deps: list[str]) -> None:
        job, job_dir = train_job(self.cfg, name, [train for _, train in parts], self.out, self.models, self.eval_sets, deps)
        self.jobs.append(job)
        for index, (role, _) in enumerate(parts):
            self.runs.append({"name": name, "mode": mode, "seed": seed, "model": NAME[role], "start": NAME[role],
                              "dir": str(job_dir if index == 0 else job_dir / "peer")})

    def ceiling(self, role: str, seed: int, tag: str = "", matched: dict | None = None) -> None:
        """The model trained on the other's correct answers to its weak family (its start's stored groups), with the RL
        runs' optimizer, updates and anchor: what any way of consuming them could teach in this budget. `matched` (a
        GRAFT run of self.runs): the dose-matched ceiling, on exactly the correct rows that run grafted, step by step,
        with its token-mean denominator (demo.worker.imitate)."""
        cfg = self.cfg
        train = self.config(role, seed, "grpo", MODEL_ID[role], None, [])
        matched_run = str(Path(matched["dir"]) / "train") if matched else None
        key = config_hash(train, cfg.rl.imitation_examples_per_step, self.models[role]["checkpoint_hash"], self.store_root.name,
                          self.eval_sets, cfg.rl.eval_samples, *([matched_run] if matched_run else []))
        name = f"ceiling{'_matched' if matched else ''}_{NAME[role]}{tag}-s{seed}"
        job_dir = self.out / "runs" / f"{name}-{key}"
        job_dir.mkdir(parents=True, exist_ok=True)
        job = {"out": str(job_dir), "train": train, "eval_sets": self.eval_sets, "rl_dataset": str(self.data["rl"]),
               "store_url": self.store_url, "weak_dataset": dataset_name(weak_family(cfg, role)),
               "peer_model": STORED_ID[OTHER[role]], "examples_per_step": cfg.rl.imitation_examples_per_step,
               "eval_samples": cfg.rl.eval_samples, "eval_every": cfg.rl.eval_every, "matched_run": matched_run}
        (job_dir / "job.json").write_text(json.dumps(job))
        self.jobs.append(Job(name=name, commands=[python_module("demo.worker", "imitate", str(job_dir / "job.json"))],
                             logs=[job_dir / "log.txt"], done=[job_dir / "done.json"],
                             deps=[f"sft {role}", f"groups {NAME[OTHER[role]]}", *([matched["name"]] if matched else [])],
                             progress=progress_file(job_dir / "progress"), total=float(cfg.rl.steps)))
        self.runs.append({"name": name, "mode": "ceiling_matched" if matched else "ceiling", "seed": seed, "model": NAME[role],
                          "start": NAME[role], "dir": str(job_dir), "lr": cfg.rl.lr})


def mutual_jobs(cfg: DemoConfig, data: dict[str, Path], models: dict[str, dict], store_root: Path, store_url: str,
                out: Path) -> tuple[list[Job], list[dict]]:
    """The stored groups of both starts, then per seed: each model's GRPO run and, for each GRAFT of rl.methods (the
    trainers' default first), the co-training pair and each model offline from the other's stored groups; and each
    model's ceiling."""
    plan = _Plan(cfg, data, models, store_root, store_url, out)
    both = [f"sft {role}" for role in ROLES]
    rl = cfg.rl.model_dump(exclude={"seeds", "cotrain_seeds", "imitation_seeds", "imitation_examples_per_step"})
    for seed in cfg.rl.seeds:
        for method, overrides in cfg.rl.methods.items():
            # Co-training first (two processes at once, easiest right after the warm starts): both models train on the
            # same prompts in the same order, each publishing every group it samples and taking the other's for its
            # all-fail ones. (ids unique to what the pair computes: this method, the config's other seeds left out)
            tag = config_hash(seed, *(models[r]["checkpoint_hash"] for r in ROLES), {**rl, "methods": {method: overrides}})[:8]
            ids = {role: f"{MODEL_ID[role]}-co{tag}" for role in ROLES}
            # lockstep: each step grafts the other's groups of that very step, so the same command gives the same table
            cotrain = ["store.mode=cotrain", "store.cotrain_lockstep=true", f"store.cotrain_wait_s={cfg.rl.cotrain_wait_s}",
                       "store.lookup_wait_s=0", *overrides]
            parts = [(role, plan.config(role, seed, "graft", ids[role], ids[OTHER[role]], cotrain)) for role in ROLES]
            mode = mode_name("cotrain", method)
            plan.add(f"{mode}-s{seed}", mode, seed, parts, both)
        for role in ROLES:
            plan.add(f"grpo_{NAME[role]}-s{seed}", "grpo", seed, [(role, plan.config(role, seed, "grpo", MODEL_ID[role], None, []))],
                     [f"sft {role}"])
            for method, overrides in cfg.rl.methods.items():
                mode = mode_name("offline", method)
                offline = plan.config(role, seed, "graft", MODEL_ID[role], STORED_ID[OTHER[role]], list(overrides))
                plan.add(f"{mode}_{NAME[role]}-s{seed}", mode, seed, [(role, offline)],
                         [f"sft {role}", f"groups {NAME[OTHER[role]]}"])
    if cfg.rl.imitation_examples_per_step:
        for seed in cfg.rl.imitation_seeds:
            for role in ROLES:
                plan.ceiling(role, seed)
    return plan.jobs, plan.runs


def dose_jobs(cfg: DemoConfig, data: dict[str, Path], models: dict[str, dict], store_root: Path, store_url: str,
              out: Path) -> tuple[list[Job], list[dict]]:
    """The dose study (studies.mutual_report.DOSE_RULE): on DOSE_SEEDS, each model offline from the other's stored groups,
    every run of DOSE_RUNS (GRPO and the default GRAFT at the demo's lr, each single change, GRPO and the default GRAFT
    at DOSE_LR) and its two ceilings (the full one, and the dose-matched one on the default GRAFT run's grafted rows)."""
    seeds = DOSE_SEEDS if cfg.mode == "full" else DOSE_SEEDS[:1]
    plan = _Plan(cfg, data, models, store_root, store_url, out)
    for seed in seeds:
        for role in ROLES:
            deps = [f"sft {role}", f"groups {NAME[OTHER[role]]}"]
            for mode, overrides in DOSE_RUNS.items():
                lr = DOSE_LR if mode in DOSE_LR_MODES else cfg.rl.lr
                plan.cfg = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"lr": lr})})
                method, peer = ("grpo", None) if overrides is None else ("graft", STORED_ID[OTHER[role]])
                plan.add(f"dose_{mode}_{NAME[role]}-s{seed}", mode, seed,
                         [(role, plan.config(role, seed, method, MODEL_ID[role], peer, overrides or []))], deps)
                plan.runs[-1]["lr"] = lr
            plan.cfg = cfg
            default = next(r for r in plan.runs if r["mode"] == "graft" and r["seed"] == seed and r["model"] == NAME[role])
            plan.ceiling(role, seed, tag="-dose")
            plan.ceiling(role, seed, tag="-dose", matched=default)
    return plan.jobs, plan.runs


def budget_jobs(cfg: DemoConfig, data: dict[str, Path], models: dict[str, dict], store_root: Path, store_url: str,
                out: Path) -> tuple[list[Job], list[dict]]:
    """BUDGET_RULE's pilot: on PILOT_SEED, for each lr of BUDGET_LRS, each model's GRPO run and ceiling."""
    if not cfg.rl.imitation_examples_per_step:
        raise SystemExit("the budget pilot needs the ceiling runs: rl.imitation_examples_per_step > 0")
    plan = _Plan(cfg, data, models, store_root, store_url, out)
    for lr in BUDGET_LRS:
        plan.cfg = cfg.model_copy(update={"rl": cfg.rl.model_copy(update={"lr": lr})})
        for role in ROLES:
            plan.add(f"grpo_{NAME[role]}-lr{lr:g}-s{PILOT_SEED}", "grpo", PILOT_SEED,
                     [(role, plan.config(role, PILOT_SEED, "grpo", MODEL_ID[role], None, []))], [f"sft {role}"])
            plan.runs[-1]["lr"] = lr
            plan.ceiling(role, PILOT_SEED, tag=f"-lr{lr:g}")
    return plan.jobs, plan.runs


if __name__ == "__main__":
    sys.exit(main())
