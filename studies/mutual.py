"""`make demo-mutual`: do two models, each strong where the other is weak, improve each other through GRAFT with no
designated teacher, and does co-training give more than the other's stored groups? The paper's headline claim, in a
design that can answer it (issue 60; the rule, written before the runs: studies.mutual_report.MUTUAL_RULE).

Two task pairs (PAIRS), each two heterogeneous models built from scratch, each strong on one family and weak on the
other's: `digit_order` (A, a Llama with a character-level tokenizer, strong on `add3` = `123+45=`, weak on `add3r` =
`45+123=`; B, a Qwen2 with a byte-level BPE, the mirror image) and `three_terms` (A strong on `add3`, weak on `sum3` =
`12+34+45=`, a weak family of another shape; B the mirror image). Per pair:

1. the warm starts, both at once, each kept at two starts by level on its weak family (`early`, `late`)
2. the store API over the pair's store root; each model's groups at each start go in once (the stored trajectories)
3. per start and seed, every model with the same rollout budget, anchored on its own strong family:
   - `grpo`: GRPO alone;
   - `cotrain`: the two co-training through the store in lockstep (each step grafts the other's groups of that step),
     the trainers' default GRAFT: the peer is the other model *as it trains*;
   - `offline`: the same GRAFT from the other's stored groups of the same start: the peer frozen where co-training's
     began, so that co-training and offline differ exactly by the peer changing (and by fresh groups);
   - `grpo_matched`: GRPO plus, as supervised rows at their step, the correct rows the `offline` run grafted (summed
     NLL over the step's token-mean denominator: anchor.step_rows): the same rows and dose, not GRAFT's loss;
   - `ceiling`: supervised on 24 of the other's correct weak-family answers a step (its stored groups), the RL runs'
     optimizer, steps and anchor, no RL;
   - `ceiling_gated`: the same 24 rows a step, drawn only from the groups the `offline` run grafted at that step: the
     full ceiling's rows and weight on the prompts GRAFT's gate had;
4. held-out sampled accuracy per family every `rl.eval_every` steps (curves over the whole run);
5. report/: each model's answers under MUTUAL_RULE, the controls, the peers' change over the run, the curves.

The budget (lr and run length) is GRPO's, set before any GRAFT run by `--pilot` (studies.mutual_report.PILOT_RULE, on
a seed of its own): the pilot's report names the lr and steps the pair configs then carry. Every stage is cached under
demo_out/mutual/<pair>/:
    python -m studies.mutual [--pilot] [--pairs digit_order three_terms] [--quick] [--set rl.seeds=[0,1] ...]
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import yaml

from demo.config import DemoConfig, config_hash, load_demo_config
from demo.jobs import CodeGuard, Job, python_module
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
from studies.mutual_report import NAME, OTHER, PILOT_LRS, PILOT_SEED, PILOT_STEPS, ROLES, strong_family, weak_family
from toy.task import completion_text, dataset_name, family_splits

CONFIGS = REPO_ROOT / "studies" / "configs"
PAIRS = {"digit_order": CONFIGS / "mutual_digit_order.yaml", "three_terms": CONFIGS / "mutual_three_terms.yaml"}
OUT_DIR = Path("demo_out") / "mutual"
COMMITTED = REPO_ROOT / "report" / "mutual"  # <pair>/pilot/summary.json: the committed pilots, which set the budgets
MODEL_ID = {"learner": "mutual-a", "peer": "mutual-b"}  # the RL runs' own groups (co-training) extend these ids


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    run = command_line("python -m studies.mutual", __doc__, None, argv, add_arguments=_arguments)
    options = run.record["options"]
    out = Path(options["out_dir"] or OUT_DIR).resolve()
    report_dir = Path(options["report_dir"] or out / "report")
    pairs = {name: pair_config(name, out, options) for name in options["pairs"]}
    if not options["pilot"]:
        check_budget(pairs, COMMITTED)
    guard = CodeGuard.of_checkout()  # the code every job runs: none starts once it has changed
    print(f"GRAFT mutual study ({'the budget pilot' if options['pilot'] else 'the study'}, {run.cfg.mode}): pairs "
          f"{', '.join(pairs)}; outputs in {out}, report in {report_dir}, {run.cfg.workers} processes at once", flush=True)

    from graft.services.store_api.http.testing import StoreServer

    plans: dict[str, Plan] = {}
    with ExitStack() as stack:
        for name, cfg in pairs.items():
            check_config(cfg, pilot=options["pilot"])
            data = prepare_data(cfg, cfg.out_dir / "data")
            data.update(anchor_files(cfg, cfg.out_dir / "data"))
            builds, models = model_jobs(cfg, data, cfg.out_dir, run.kernels, peer_after_learner=False)
            store_root = cfg.out_dir / f"store-{config_hash(cfg.task, cfg.peer_groups, *(models[r]['checkpoint_hash'] for r in ROLES))}"
            server = stack.enter_context(StoreServer(store_root))
            print(f"{name}: store API up at {server.url} over {store_root} (pid {server.pid})", flush=True)
            plan = Plan(name, cfg, data, models, store_root, server.url, builds)
            (plan.pilot if options["pilot"] else plan.study)()
            plans[name] = plan
        timings, record = run.jobs([job for plan in plans.values() for job in plan.jobs],
                                   "SFT, stored groups, RL runs", guard)
    for plan in plans.values():
        plan.read_models()

    from studies import mutual_report

    wall = time.perf_counter() - started
    if options["pilot"]:
        for result in mutual_report.write_pilot(plans, report_dir, record, timings, wall).values():
            print("\n".join(mutual_report.pilot_lines(result)))
        return 0
    mutual_report.write_report(plans, report_dir, record, timings, wall, COMMITTED)
    print()
    print((report_dir / "REPORT.md").read_text())
    print(f"wall time {wall:.0f} s; reports written to {report_dir}/<pair>/", flush=True)
    return 0


def _arguments(parser) -> None:
    parser.add_argument("--pilot", action="store_true",
                        help="the budget pilot: GRPO alone at each lr of PILOT_LRS for PILOT_STEPS steps on PILOT_SEED, "
                             "before any GRAFT run (studies.mutual_report.PILOT_RULE)")
    parser.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=list(PAIRS), help="the task pairs to run")


def pair_config(name: str, out: Path, options: dict) -> DemoConfig:
    """A pair's DemoConfig: its file, the command line's --set, its own folder under `out`, the small pipeline with
    --quick."""
    return load_demo_config(PAIRS[name], [*options["overrides"], f"out_dir={out / name}"], options["quick"])


def check_budget(pairs: dict[str, DemoConfig], committed: Path) -> None:
    """Each pair's lr and steps are its committed pilot's choice (PILOT_RULE): refuse others in a full run."""
    for name, cfg in pairs.items():
        path = committed / name / "pilot" / "summary.json"
        if cfg.mode != "full" or not path.exists():
            continue  # no pilot committed yet: the report says so (its summary's `pilot` is None)
        chosen = json.loads(path.read_text())["pairs"][name]
        if (cfg.rl.lr, cfg.rl.steps) != (chosen["chosen_lr"], chosen["steps"]):
            raise SystemExit(f"{name}: lr {cfg.rl.lr:g} and {cfg.rl.steps} steps, but its committed pilot ({path}) chose lr "
                             f"{chosen['chosen_lr']:g} and {chosen['steps']} steps: the budget is GRPO's, set before any "
                             "GRAFT run (studies.mutual_report.PILOT_RULE)")


def check_config(cfg: DemoConfig, pilot: bool) -> None:
    """Refuse what the study cannot compare: both models' strong families evaluated, the same two start names for both
    models (co-training pairs A's start with B's of the same name), enough pairs for the sign-flip test, and nothing
    of demo.run's it would ignore."""
    for family in (cfg.task.strong_family, cfg.task.weak_family):
        if family not in cfg.task.n_eval or family not in cfg.task.rl_prompts:
            raise SystemExit(f"family {family} (a model's strong family) must be in task.n_eval and task.rl_prompts")
    if cfg.task.strong_family == cfg.task.weak_family:
        raise SystemExit("task.strong_family (A's) and task.weak_family (B's strong one) must differ")
    if not cfg.peer_starts or set(cfg.peer_starts) != set(cfg.starts):
        raise SystemExit(f"starts {cfg.starts} and peer_starts {cfg.peer_starts}: both models start at the same named "
                         "starts (co-training pairs A's start with B's)")
    pairs = len(cfg.rl.seeds) * len(cfg.starts)
    if cfg.mode == "full" and not pilot and pairs < MIN_PAIRS_FOR_GAIN:
        raise SystemExit(f"rl.seeds {cfg.rl.seeds} at {len(cfg.starts)} starts: {pairs} pairs per model, and with fewer "
                         f"than {MIN_PAIRS_FOR_GAIN} the sign-flip test's smallest p is {2 / 2 ** pairs:.3f}: no arm "
                         "could be shown to differ")
    if cfg.rl.cotrain_seeds or cfg.rl.methods != {"graft": []}:
        raise SystemExit("rl.cotrain_seeds and rl.methods are demo.run's: the mutual study co-trains on every seed of "
                         "rl.seeds, with the trainers' default GRAFT (`methods: {graft: []}`)")
    if not cfg.rl.eval_all:
        raise SystemExit("rl.eval_all: the study reads each model's curves over the whole run (set it true)")


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


class Plan:
    """One task pair's jobs and runs: the warm starts, each start's stored groups, and the pilot's or the study's runs
    (`runs`: one entry per model's run, with its mode, start, seed and folder)."""

    def __init__(self, name: str, cfg: DemoConfig, data: dict[str, Path], models: dict[str, dict], store_root: Path,
                 store_url: str, builds: list[Job]):
        self.name, self.cfg, self.data, self.models = name, cfg, data, models
        self.store_root, self.store_url = store_root, store_url
        self.base = yaml.safe_load(TRAIN_BASE.read_text())
        self.eval_sets = {f: str(data[f"eval_{f}"]) for f in cfg.task.n_eval}
        self.starts = list(cfg.starts)
        self.jobs: list[Job] = [self._named(job) for job in builds]
        self.runs: list[dict] = []

    def job_name(self, name: str) -> str:
        return f"{self.name}: {name}"

    def _named(self, job: Job) -> Job:
        job.name, job.deps = self.job_name(job.name), [self.job_name(d) for d in job.deps]
        return job

    def checkpoint(self, role: str, start: str) -> str:
        return self.models[role]["start_dirs"][start]

    @staticmethod
    def stored_id(role: str, start: str) -> str:
        return f"{MODEL_ID[role]}-{start}-stored"

    def config(self, role: str, start: str, seed: int, method: str, model_id: str,
               peer: tuple[str, str] | None = None, overrides: list[str] | None = None, cfg: DemoConfig | None = None) -> dict:
        """A trainer config of `role` from `start`; `peer`: (model id, tokenizer dir) of the groups it grafts."""
        peers = ([peer[0]], [peer[1]]) if peer else None
        return trainer_config(cfg or self.cfg, self.base, self.data["rl"], self.checkpoint(role, start), model_id, seed,
                              method, self.data[f"anchor_{role}"], peers, self.store_url, overrides or [])

    def add(self, mode: str, start: str, seed: int, parts: list[tuple[str, dict]], deps: list[str],
            extra: dict | None = None, cfg: DemoConfig | None = None, tag: str = "") -> dict:
        cfg = cfg or self.cfg
        name = f"{mode}{'' if len(parts) > 1 else '_' + NAME[parts[0][0]]}{tag}-{start}-s{seed}"
        job, job_dir = train_job(cfg, name, [train for _, train in parts], self.cfg.out_dir, self.models, self.eval_sets,
                                 [self.job_name(d) for d in deps], extra)
        job.name = self.job_name(name)
        self.jobs.append(job)
        for index, (role, _) in enumerate(parts):
            self.runs.append({"pair": self.name, "name": name, "job": job.name, "mode": mode, "start": start, "seed": seed,
                              "model": NAME[role], "lr": cfg.rl.lr, "steps": cfg.rl.steps,
                              "dir": str(job_dir if index == 0 else job_dir / "peer")})
        return self.runs[-1]

    def stored_groups(self) -> None:
        """Each model's groups at each start, generated once before any training."""
        for role in ROLES:
            for start in self.starts:
                self.jobs.append(self._named(generator_job(
                    self.cfg, self.data, self.checkpoint(role, start), self.stored_id(role, start), self.store_root,
                    self.store_url, f"groups {NAME[role]} {start}", [f"sft {role}"])))

    def pilot(self) -> None:
        """PILOT_RULE's runs: GRPO alone, each model from each start, at each lr of PILOT_LRS for PILOT_STEPS steps on
        PILOT_SEED."""
        steps = PILOT_STEPS if self.cfg.mode == "full" else self.cfg.rl.steps
        for lr in PILOT_LRS:
            cfg = self.cfg.model_copy(update={"rl": self.cfg.rl.model_copy(update={"lr": lr, "steps": steps})})
            for start in self.starts:
                for role in ROLES:
                    self.add("grpo", start, PILOT_SEED, [(role, self.config(role, start, PILOT_SEED, "grpo", MODEL_ID[role],
                                                                             cfg=cfg))],
                             [f"sft {role}"], cfg=cfg, tag=f"-lr{lr:g}")

    def study(self) -> None:
        """MUTUAL_RULE's runs, per start and seed (the module's docstring)."""
        self.stored_groups()
        both = [f"sft {role}" for role in ROLES]
        rl = self.cfg.rl.model_dump(exclude={"seeds", "cotrain_seeds", "imitation_seeds"})
        for start in self.starts:
            for seed in self.cfg.rl.seeds:
                # co-training first (two processes at once, easiest right after the warm starts); lockstep: each step
                # grafts the other's groups of that very step, so the same command gives the same table
                tag = config_hash(seed, start, *(self.models[r]["checkpoint_hash"] for r in ROLES), rl)[:8]
                ids = {role: f"{MODEL_ID[role]}-co{tag}" for role in ROLES}
                cotrain = [f"peers={{source: lockstep, partner_timeout_s: {self.cfg.rl.cotrain_wait_s}}}"]
                self.add("cotrain", start, seed, [(role, self.config(role, start, seed, "graft", ids[role],
                                                                     (ids[OTHER[role]], self.checkpoint(OTHER[role], start)),
                                                                     cotrain)) for role in ROLES], both)
                for role in ROLES:
                    other = OTHER[role]
                    stored = (self.stored_id(other, start), self.checkpoint(other, start))
                    deps = [f"sft {role}", f"groups {NAME[other]} {start}"]
                    self.add("grpo", start, seed, [(role, self.config(role, start, seed, "grpo", MODEL_ID[role]))],
                             [f"sft {role}"])
                    offline = self.add("offline", start, seed,
                                       [(role, self.config(role, start, seed, "graft", MODEL_ID[role], stored))], deps)
                    grafted = str(Path(offline["dir"]) / "train")
                    self.add("grpo_matched", start, seed, [(role, self.config(role, start, seed, "grpo", MODEL_ID[role]))],
                             [*deps, offline["name"]],
                             extra={"matched_run": grafted, "store_url": self.store_url, "rl_dataset": str(self.data["rl"])})
                    self.ceiling(role, start, seed, deps)
                    self.ceiling(role, start, seed, [*deps, offline["name"]], gated=grafted)

    def ceiling(self, role: str, start: str, seed: int, deps: list[str], gated: str | None = None) -> None:
        """The model supervised on the other's correct answers to its weak family (the other's stored groups at this
        start), with the RL runs' optimizer, steps and anchor; `gated`: only those of the groups that GRAFT run grafted,
        step by step (demo.worker.imitate)."""
        cfg, other = self.cfg, OTHER[role]
        train = self.config(role, start, seed, "grpo", MODEL_ID[role])
        mode = "ceiling_gated" if gated else "ceiling"
        key = config_hash(train, cfg.rl.imitation_examples_per_step, self.models[role]["checkpoint_hash"],
                          self.store_root.name, self.eval_sets, cfg.rl.eval_samples, cfg.evaluated_steps(), gated)
        name = f"{mode}_{NAME[role]}-{start}-s{seed}"
        job_dir = cfg.out_dir / "runs" / f"{name}-{key}"
        job_dir.mkdir(parents=True, exist_ok=True)
        job = {"out": str(job_dir), "train": train, "eval_sets": self.eval_sets, "rl_dataset": str(self.data["rl"]),
               "store_url": self.store_url, "weak_dataset": dataset_name(weak_family(cfg, role)),
               "peer_model": self.stored_id(other, start), "examples_per_step": cfg.rl.imitation_examples_per_step,
               "eval_samples": cfg.rl.eval_samples, "eval_steps": cfg.evaluated_steps(), "gated_run": gated}
        (job_dir / "job.json").write_text(json.dumps(job))
        self.jobs.append(Job(name=self.job_name(name), commands=[python_module("demo.worker", "imitate", str(job_dir / "job.json"))],
                             logs=[job_dir / "log.txt"], done=[job_dir / "done.json"], deps=[self.job_name(d) for d in deps],
                             progress=progress_file(job_dir / "progress"), total=float(cfg.rl.steps)))
        self.runs.append({"pair": self.name, "name": name, "job": self.job_name(name), "mode": mode, "start": start,
                          "seed": seed, "model": NAME[role], "lr": cfg.rl.lr, "steps": cfg.rl.steps, "dir": str(job_dir)})

    def read_models(self) -> None:
        """The warm starts' results (done.json) into `models`, and each start's stored groups into `stored`."""
        for role in ROLES:
            self.models[role].update(json.loads((Path(self.models[role]["dir"]) / "done.json").read_text()))
        self.stored = {f"{NAME[role]} {start}": json.loads(path.read_text())
                       for role in ROLES for start in self.starts
                       if (path := self.store_root / f"groups-done-{self.stored_id(role, start)}.json").exists()}


if __name__ == "__main__":
    sys.exit(main())
