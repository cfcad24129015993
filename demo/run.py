"""`make demo`: the whole GRAFT system on a laptop CPU, from nothing to a report, in one command.

1. data: two addition families with fixed splits (toy/task.py)
2. two heterogeneous models built from scratch and warm-started with complementary skills:
   a Llama-style learner with a character-level tokenizer (strong on add2, weak on add3) and a
   Qwen2-style peer with a byte-level BPE (mostly add3), in parallel processes
3. the store API (`graft-store serve`, uvicorn on 127.0.0.1) over a local store root
4. `graft-generate` fills the store with the peer's scored groups for the RL prompts
5. RL runs of the learner under the same seeds and rollout budget: GRPO, GRAFT offline (the
   spec's defaults), GRAFT co-training (learner and peer train at once, each the other's peer,
   through the store), and the ablations
6. held-out accuracy per family of every checkpoint
7. report/: summary.json, REPORT.md, plots; the server is stopped; how to serve the store again

Every stage is cached in demo_out/ under a hash of its config: a rerun skips what is finished.
    python -m demo.run [--quick] [--config studies/configs/study.yaml] [--set rl.steps=50 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import yaml

from demo.config import (
    LEARNER_MODEL_ID,
    PEER_MODEL_ID,
    DemoConfig,
    config_hash,
    load_demo_config,
    warm_start_checkpoint,
)
from demo.jobs import (
    PORTABLE_KERNELS,
    CodeGuard,
    Job,
    child_env,
    portable_kernels_available,
    python_module,
    run_recorded,
)
from demo.report import graft_preset
from demo.records import invocation_record, job_record, kernel_settings, now, package_files
from demo.stats import RULE_VERSION
from graft.rollouts.files import write_jsonl_atomic, write_text_atomic
from graft.trainer.config import TrainConfig
from toy.task import completion_text, dataset_name, family_splits, write_problems_jsonl

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN_BASE = REPO_ROOT / "configs" / "demo_train.yaml"


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    run = command_line("python -m demo.run", __doc__, None, argv)
    cfg, env, kernels, out = run.cfg, run.env, run.kernels, run.out
    guard = CodeGuard.of_checkout()  # the code every job runs: none starts once it has changed
    print(f"GRAFT demo ({cfg.mode}): outputs in {out}, report in {cfg.report_dir}, {cfg.workers} processes at once", flush=True)

    data = prepare_data(cfg, out / "data")
    build_jobs, models = model_jobs(cfg, data, out, kernels)

    from graft.services.store_api.http.testing import StoreServer

    store_key = config_hash(cfg.task, cfg.peer_groups, models["peer"]["checkpoint_hash"], models["learner"]["checkpoint_hash"])
    store_root = out / f"store-{store_key}"
    server = StoreServer(store_root)
    with server:
        print(f"store API up at {server.url} over {store_root} (pid {server.pid})", flush=True)
        jobs, runs = rl_jobs(cfg, data, models, store_root, server.url, out)
        # One schedule for everything: while the learner warms up, the other process warms up the
        # peer and fills the store with its groups.
        timings, record = run.jobs(build_jobs + jobs, "SFT, peer groups, RL runs", guard)
        from graft.services.store_api.http.client import StoreClient

        with StoreClient(server.url) as client:
            store_stats = client.stats().model_dump(mode="json")
    server_stopped = server.process is not None and server.process.poll() is not None and "Application shutdown complete" in server.log_tail()
    print(f"store server stopped cleanly: {server_stopped} (pid {server.pid}, exit code {server.process.returncode})", flush=True)
    for role in ("learner", "peer"):
        models[role].update(json.loads((Path(models[role]["dir"]) / "done.json").read_text()))

    probes = {start: json.loads((Path(job.done[0])).read_text()) for start, job in probe_jobs(jobs).items()}
    from demo.report import LOCAL_FILE, committed_table_lines, time_lines, verdict_lines, write_report

    summary = write_report(cfg, models, runs, data, store_stats, timings, wall_time_s=time.perf_counter() - started,
                           server_stopped=server_stopped, store_root=store_root, probes=probes,
                           kernels=kernel_label(kernels, env), record=record)
    print()
    print((cfg.report_dir / "REPORT.md").read_text().split("<!-- table-end -->")[0])
    print_serve_instructions(store_root, runs, data, models)
    print(f"Each GRAFT against GRPO ({summary['primary_metric']}; {summary['rule']}):")
    print("\n".join(verdict_lines(summary)))
    print("\n".join(time_lines(summary, cfg.workers)))
    if run.record["options"]["config"] is None:  # `make demo`: against the committed report/ (a study has its own)
        print("\n".join(committed_table_lines(summary, REPO_ROOT / "report", cfg.report_dir)))
    print(f"wall time {summary['wall_time_s']:.0f} s; report written to {cfg.report_dir}/ (the times in "
          f"{cfg.report_dir / LOCAL_FILE}, which git ignores)", flush=True)
    return 0


def probe_jobs(jobs: list[Job]) -> dict[str, Job]:
    """The probe jobs by start."""
    return {job.name.removeprefix("probe "): job for job in jobs if job.name.startswith("probe ")}


def kernel_label(kernels: dict[str, str] | None, env: dict[str, str]) -> str:
    """Which kernels the jobs ran on, as the report names them: the pin (`kernels`), else the CPU's own but for what
    the jobs' environment `env` sets (demo.records.KERNEL_VARIABLES)."""
    settings = " ".join(f"{k}={v}" for k, v in kernel_settings(env).items())
    if kernels:
        return f"portable: {settings}"
    return f"set by the environment: {settings} (the rest the CPU's own)" if settings else "the CPU's own"


@dataclass
class Invocation:
    """One demo or study command, as its options made it: the config, the jobs' environment, the pinned kernels (or
    None), the output folder, whether jobs cached under other code are taken, and its record (demo.records)."""

    cfg: DemoConfig
    env: dict[str, str]
    kernels: dict[str, str] | None
    out: Path
    accept_cached_code: bool
    record: dict

    def jobs(self, jobs: list[Job], desc: str, guard: CodeGuard) -> tuple[dict[str, float], dict]:
        """Run the jobs with their records (demo.jobs.run_recorded): timings, and the report's record."""
        return run_recorded(jobs, self.cfg.workers, desc, self.env, guard, self.record, self.accept_cached_code)


def command_line(prog: str, description: str, default_config: Path | None, argv: list[str] | None,
                 add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> Invocation:
    """The options every demo command takes (`--quick`, `--config`, `--set`, `--out-dir`, `--report-dir`,
    `--portable-kernels`, `--accept-cached-code`; `add_arguments` adds a command's own, read back from
    `record["options"]`), and what they give (Invocation), the output folder made. The report goes to
    <out_dir>/report, which git does not track, unless --report-dir (or the config) names another folder: a run writes
    the committed report only when asked (issue 59). SIGTERM now stops the jobs and the server."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small pipeline (minutes): structure, not the accuracy target")
    parser.add_argument("--config", type=Path, default=default_config,
                        help="YAML with DemoConfig fields" + (" (default %(default)s)" if default_config else ""))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a field, e.g. rl.steps=50")
    parser.add_argument("--out-dir", type=Path, default=None, help="where models, store and runs go (default: the config's out_dir, demo_out/)")
    parser.add_argument("--report-dir", type=Path, default=None,
                        help="where the report goes (default: the config's report_dir, else <out-dir>/report, which git "
                             "does not track; the committed one is written only when named here, e.g. report/)")
    parser.add_argument("--portable-kernels", action="store_true",
                        help="ATen's baseline kernels and MKL's SSE2 branch: the same numbers under every kernel choice of one "
                             "machine, about 1.6x slower; not the same as another CPU model's (measured: docs/demo.md)")
    parser.add_argument("--accept-cached-code", action="store_true",
                        help="take the jobs found done in the output folder though other code computed them (or no "
                             "record says which): the report's record lists them. Without it the command stops and "
                             "names them")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.out_dir is not None:
        overrides.append(f"out_dir={args.out_dir}")
    if args.report_dir is not None:
        overrides.append(f"report_dir={args.report_dir}")
    cfg = load_demo_config(args.config, overrides, args.quick)
    if cfg.report_dir is None:
        cfg = cfg.model_copy(update={"report_dir": cfg.out_dir / "report"})
    # SIGTERM (or SIGINT in a background shell, where it is ignored) must still stop the jobs and the server.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    env, kernels = kernel_environment(args.portable_kernels)
    out = cfg.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    record = invocation_record(env, RULE_VERSION, [prog, *(sys.argv[1:] if argv is None else argv)])
    record["options"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return Invocation(cfg, env, kernels, out, args.accept_cached_code, record)


def kernel_environment(portable: bool) -> tuple[dict[str, str], dict[str, str] | None]:
    """The jobs' environment and, when pinned, the kernels (part of the warm starts' cache keys); says which it is."""
    if portable and not portable_kernels_available():
        raise SystemExit(f"--portable-kernels: this CPU is {platform.machine()}, not x86-64; it has neither ATen's x86 "
                         "baseline kernels nor MKL: run without the flag (its own kernels, its own numbers)")
    env = child_env(portable_kernels=portable)
    # what the jobs' environment sets, the caller's included (issue 48: ATEN_CPU_CAPABILITY=default was run as "this
    # CPU's own")
    settings = " ".join(f"{k}={v}" for k, v in kernel_settings(env).items())
    if portable:
        print(f"kernels: {settings} (--portable-kernels: the same numbers under every kernel choice of this machine; "
              "another CPU model still gives others, docs/demo.md)", flush=True)
    elif settings:
        print(f"kernels: as the environment sets them, {settings}; ATen and MKL pick the rest by the CPU: the warm starts "
              "and the table move with these settings and the machine (docs/demo.md, \"Numbers across x86-64 CPUs\")",
              flush=True)
    else:
        print("kernels: this CPU's own (ATen and MKL pick them by the CPU): the warm starts and the table move with the "
              "machine (docs/demo.md, \"Numbers across x86-64 CPUs\")", flush=True)
    return env, (dict(PORTABLE_KERNELS) if portable else None)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_jobs and the server's context: children and server stop


# ---- 1. data -------------------------------------------------------------------------------------

def prepare_data(cfg: DemoConfig, data_dir: Path) -> dict[str, Path]:
    """Held-out sets per family, the learner's RL prompts (weak and strong mixed), and the anchor's references."""
    key = config_hash(cfg.task)
    marker = data_dir / f"done-{key}.json"
    paths = {f"eval_{f}": data_dir / f"toy-{f}-eval.jsonl" for f in cfg.task.n_eval}
    paths["rl"] = data_dir / "toy-rl.jsonl"
    paths["anchor"] = data_dir / f"anchor-{cfg.task.strong_family}.jsonl"
    paths["anchor_weak"] = data_dir / f"anchor-{cfg.task.weak_family}.jsonl"  # the co-training peer's own family
    if marker.exists():
        return paths
    splits = {f: family_splits(f, cfg.task.n_eval[f], cfg.task.n_rl) for f in cfg.task.n_eval}
    for family, split in splits.items():
        write_problems_jsonl(split["eval"], paths[f"eval_{family}"])
    rl = [p for family, count in cfg.task.rl_prompts.items() for p in splits[family]["rl"][:count]]
    write_problems_jsonl(rl, paths["rl"])
    # The anchors: reference answers of a family's RL split (never its held-out problems): the learner's on its strong
    # family; the co-training peer's on its own, the learner's weak one.
    for key, family in (("anchor", cfg.task.strong_family), ("anchor_weak", cfg.task.weak_family)):
        rows = [{"problem": p.problem, "completion": completion_text(p.answer)} for p in splits[family]["rl"]]
        write_jsonl_atomic(paths[key], rows)
    marker.write_text(json.dumps({k: str(v) for k, v in paths.items()}))
    return paths


# ---- 2. models -----------------------------------------------------------------------------------

def model_jobs(cfg: DemoConfig, data: dict[str, Path], out: Path, kernels: dict[str, str] | None,
               peer_after_learner: bool = True) -> tuple[list[Job], dict[str, dict]]:
    """Two jobs: the learner's and the peer's warm start (cached by config hash and, when pinned, the kernels: every
    later stage's key holds these models' keys), and where their checkpoints will be."""
    eval_sets = {f: str(data[f"eval_{f}"]) for f in cfg.task.n_eval}
    jobs, models = [], {}
    for role in ("learner", "peer"):
        spec = cfg.learner if role == "learner" else cfg.peer
        key = config_hash(role, spec, cfg.task, cfg.bpe_vocab_size if role == "peer" else None, *([kernels] if kernels else []))
        job_dir = out / "models" / f"{role}-{key}"
        job_dir.mkdir(parents=True, exist_ok=True)
        job_file = job_dir / "job.json"
        threads = cfg.learner_sft_threads if role == "learner" else 1
        job_file.write_text(json.dumps({"role": role, "out": str(job_dir), "demo": cfg.model_dump(mode="json"), "eval_sets": eval_sets,
                                        "threads": threads}))
        if (job_dir / "done.json").exists():
            print_model(role, json.loads((job_dir / "done.json").read_text()))
        models[role] = {"dir": str(job_dir), "checkpoint_hash": job_dir.name,
                        "start_dirs": {name: str(warm_start_checkpoint(job_dir, name)) for name in cfg.start_levels(role)}}
        jobs.append(Job(
            name=f"sft {role}", commands=[python_module("demo.worker", "build", str(job_file))], logs=[job_dir / "log.txt"],
            done=[job_dir / "done.json"], progress=progress_file(job_dir / "progress"), total=spec.sft.stop_at or spec.sft.steps,
            after=lambda job_dir=job_dir, role=role: print_model(role, json.loads((job_dir / "done.json").read_text())),
            # The learner's warm start, which every RL run waits for, runs alone on its threads (OpenMP threads that
            # share a core with another process wait for each other); the peer's follows, next to the GRPO runs.
            # (peer_after_learner=False: both at once, one thread each, where the first runs need both models)
            deps=["sft learner"] if role == "peer" and peer_after_learner else [],
        ))
    return jobs, models


def print_model(role: str, info: dict) -> None:
    from tqdm import tqdm

    tqdm.write(f"  {role}: {info['architecture']}, {info['parameters']:,} parameters, vocab {info['vocab_size']} "
               f"(`\\boxed{{1046}}` -> {' '.join(info['tokenizer_tokens_of_example'])}); SFT {info['sft_steps']} steps in "
               f"{info['sft_s']:.0f} s")
    for name, start in info["starts"].items():
        greedy = ", ".join(f"{f} {100 * a:.1f}%" for f, a in start["acc_greedy"].items())
        sampled = ", ".join(f"{f} {100 * a:.1f}%" for f, a in start["acc_sampled"].items())
        tqdm.write(f"    start {name} (level {100 * start['level']:.0f}%): step {start['step']}; held-out greedy: {greedy}; "
                   f"sampled T=1: {sampled}")


def progress_file(path: Path):
    """A progress reader for a job: the first number of `path` (written by toy.sft.write_progress), 0 before it exists."""
    def read() -> float:
        try:
            return float(path.read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return 0.0
    return read


def _lines(path: Path):
    def read() -> float:
        try:
            with open(path, "rb") as f:
                return float(sum(1 for _ in f))
        except FileNotFoundError:
            return 0.0
    return read


# ---- 4 and 5. peer groups and RL runs ------------------------------------------------------------

def rl_jobs(cfg: DemoConfig, data: dict[str, Path], models: dict[str, dict], store_root: Path, store_url: str,
            out: Path) -> tuple[list[Job], list[dict]]:
    """The generator job, the probe at each start, and the paired RL runs: at every start and seed, GRPO and each GRAFT
    of `rl.methods` (offline, from the peer's stored groups), the co-training pairs and the ceiling."""
    peer_ckpt = models["peer"]["start_dirs"]["peer"]
    jobs: list[Job] = [generator_job(cfg, data, peer_ckpt, PEER_MODEL_ID, store_root, store_url, "peer groups", ["sft peer"])]
    runs: list[dict] = []
    base = yaml.safe_load(TRAIN_BASE.read_text())
    eval_sets = {f: str(data[f"eval_{f}"]) for f in cfg.task.n_eval}

    def add_run(name: str, mode: str, start: str, seed: int, trains: list[dict], deps: list[str]) -> None:
        job, job_dir = train_job(cfg, name, trains, out, models, eval_sets, deps)
        jobs.append(job)
        runs.append({"name": name, "mode": mode, "start": start, "seed": seed, "dir": str(job_dir),
                     "peer_dir": str(job_dir / "peer") if len(trains) > 1 else None})

    for start, learner_ckpt in models["learner"]["start_dirs"].items():
        def learner_config(seed: int, method: str, overrides: list[str]) -> dict:
            peers = ([PEER_MODEL_ID], [peer_ckpt]) if method == "graft" else None
            return trainer_config(cfg, base, data["rl"], learner_ckpt, LEARNER_MODEL_ID, seed, method, data["anchor"], peers,
                                  store_url, overrides)

        jobs.append(probe_job(cfg, data, start, learner_ckpt, peer_ckpt, learner_config(0, "graft", []), out, models))
        # Co-training pairs first: each needs both processes at once, which is easiest right after the warm starts.
        for seed in cfg.rl.cotrain_seeds:
            # Both models train at once on the same prompts in the same order (same seed and data), each publishing
            # every group it samples and taking the other's for its all-fail prompts. The peer is anchored on its own
            # strong family (the learner's weak one), as the learner is on its own: without it, it loses that skill.
            # (ids unique to what the pair computes, so demo-study reuses the demo's pairs)
            pair_rl = cfg.rl.model_dump(include={"steps", "prompts_per_step", "group_size", "lr", "anchor_prompts_per_step",
                                                 "anchor_weight", "eval_every", "eval_samples", "cotrain_wait_s",
                                                 "cotrain_peer_anchor"})
            tag = config_hash(seed, models["learner"]["checkpoint_hash"], start, models["peer"]["checkpoint_hash"], pair_rl)[:8]
            learner_id, peer_id = f"{LEARNER_MODEL_ID}-co{tag}", f"{PEER_MODEL_ID}-co{tag}"
            # lockstep: each step grafts the partner's groups of that very step, so the pair's table reproduces
            cotrain = [f"peers={{source: lockstep, partner_timeout_s: {cfg.rl.cotrain_wait_s}}}",
                       f"model.model_id={learner_id}", f"graft.peer_models=[{peer_id}]"]
            learner = learner_config(seed, "graft", cotrain)
            peer = learner_config(seed, "graft", cotrain)
            peer["model"].update(path=peer_ckpt, model_id=peer_id)
            peer["graft"].update(peer_models=[learner_id], peer_tokenizers=[learner_ckpt])
            peer["anchor"]["dataset"] = str(data["anchor_weak"]) if cfg.rl.cotrain_peer_anchor else None
            add_run(f"graft_cotrain-{start}-s{seed}", "graft_cotrain", start, seed, [learner, peer], deps=["sft learner", "sft peer"])
            runs[-1]["graft_preset"] = graft_preset(learner)
        for seed in cfg.rl.seeds:
            add_run(f"grpo-{start}-s{seed}", "grpo", start, seed, [learner_config(seed, "grpo", [])], deps=["sft learner"])
            resolved: dict[str, str] = {}  # resolved trainer config -> the first method that has it
            for method, overrides in cfg.rl.methods.items():
                train = learner_config(seed, "graft", overrides)
                key = json.dumps(TrainConfig.model_validate(train).model_dump(mode="json"), sort_keys=True)
                if key in resolved:  # the same run under another name (the default GRAFT is the spec's): run once
                    runs.append({"name": f"{method}-{start}-s{seed}", "mode": method, "start": start, "seed": seed,
                                 "same_as": resolved[key]})
                    continue
                resolved[key] = method
                add_run(f"{method}-{start}-s{seed}", method, start, seed, [train], deps=["sft learner", "peer groups"])
                runs[-1]["graft_preset"] = graft_preset(train)
        if cfg.rl.imitation_examples_per_step:
            for seed in cfg.rl.imitation_seeds:
                train = learner_config(seed, "grpo", [])
                key = config_hash(train, cfg.rl.imitation_examples_per_step, models["learner"]["checkpoint_hash"], store_root.name,
                                  eval_sets, cfg.rl.eval_samples)
                job_dir = out / "runs" / f"peer_imitation-{start}-s{seed}-{key}"
                job_dir.mkdir(parents=True, exist_ok=True)
                job = {"out": str(job_dir), "train": train, "eval_sets": eval_sets, "rl_dataset": str(data["rl"]), "store_url": store_url,
                       "weak_dataset": dataset_name(cfg.task.weak_family), "peer_model": PEER_MODEL_ID,
                       "examples_per_step": cfg.rl.imitation_examples_per_step, "eval_samples": cfg.rl.eval_samples}
                (job_dir / "job.json").write_text(json.dumps(job))
                jobs.append(Job(
                    name=f"peer_imitation-{start}-s{seed}", commands=[python_module("demo.worker", "imitate", str(job_dir / "job.json"))],
                    logs=[job_dir / "log.txt"], done=[job_dir / "done.json"], deps=["sft learner", "peer groups"],
                    progress=progress_file(job_dir / "progress"), total=float(cfg.rl.steps),
                ))
                runs.append({"name": f"peer_imitation-{start}-s{seed}", "mode": "peer_imitation", "start": start, "seed": seed,
                             "dir": str(job_dir), "peer_dir": None})
    return jobs, runs


def probe_job(cfg: DemoConfig, data: dict[str, Path], start: str, learner_ckpt: str, peer_ckpt: str, train: dict, out: Path,
              models: dict[str, dict]) -> Job:
    """The mechanism probe at one start (demo.probe): seconds, no RL noise."""
    key = config_hash(cfg.probe, cfg.task, models["learner"]["checkpoint_hash"], start, models["peer"]["checkpoint_hash"],
                      cfg.peer_groups, {**train, "store": {**train["store"], "url": None}})
    job_dir = out / "probes" / f"{start}-{key}"
    job_dir.mkdir(parents=True, exist_ok=True)
    job = {"out": str(job_dir), "start": start, "train": train, "probe": cfg.probe.model_dump(),
           "rl_dataset": str(data["rl"]), "weak_dataset": dataset_name(cfg.task.weak_family), "peer_model": PEER_MODEL_ID,
           "eval_weak": str(data[f"eval_{cfg.task.weak_family}"])}
    (job_dir / "job.json").write_text(json.dumps(job))
    return Job(name=f"probe {start}", commands=[python_module("demo.worker", "probe", str(job_dir / "job.json"))],
               logs=[job_dir / "log.txt"], done=[job_dir / "done.json"], deps=["sft learner", "peer groups"],
               progress=progress_file(job_dir / "progress"), total=float(max(1, cfg.probe.prompts // cfg.probe.batch_prompts)))


def trainer_config(cfg: DemoConfig, base: dict, dataset: Path, checkpoint: str, model_id: str, seed: int, method: str,
                   anchor: Path | None, peers: tuple[list[str], list[str]] | None, store_url: str, overrides: list[str]) -> dict:
    """A trainer config (configs/demo_train.yaml's settings, `base`) for one model's RL run: its checkpoint and id,
    the RL prompts, the budget and optimizer of `cfg.rl`, its supervised anchor (None: none), and for GRAFT the store
    and the peers' (model ids, tokenizer dirs); then the run's own overrides."""
    from graft.schemas.overrides import apply_overrides

    train = json.loads(json.dumps(base))
    train.update(seed=seed, steps=cfg.rl.steps, method=method)
    train["model"].update(path=checkpoint, model_id=model_id)
    train["data"]["dataset"] = str(dataset)
    train["rollout"].update(group_size=cfg.rl.group_size, prompts_per_step=cfg.rl.prompts_per_step)
    train["optim"].update(lr=cfg.rl.lr, mini_batch_prompts=cfg.rl.prompts_per_step)
    train["anchor"].update(dataset=str(anchor) if anchor is not None else None, prompts_per_step=cfg.rl.anchor_prompts_per_step,
                           weight=cfg.rl.anchor_weight)
    train["checkpoint"]["every_steps"] = cfg.rl.eval_every
    train["logging"]["progress"] = True
    if peers is not None:
        train["store"]["url"] = store_url
        train.setdefault("graft", {}).update(peer_models=list(peers[0]), peer_tokenizers=list(peers[1]))
    return apply_overrides(train, overrides)


def train_job(cfg: DemoConfig, name: str, trains: list[dict], out: Path, models: dict[str, dict], eval_sets: dict[str, str],
              deps: list[str], extra: dict | None = None) -> tuple[Job, Path]:
    """One RL run as a job: `demo.worker train` per trainer config (two at once for a co-training pair: the first in
    the job's folder, the second in its `peer/`), in a folder keyed by what the run computes. `extra`: more fields of
    the job file, part of the key (a GRPO run given another run's grafted rows: `matched_run`, demo.worker.train)."""
    # Keyed by the config as the trainer resolves it, defaults included: a changed default is another run, never a
    # cached one. The store's URL (a fresh port each time) is no part of what a run computes: left out of the key.
    resolved = [TrainConfig.model_validate(train).model_dump(mode="json") for train in trains]
    portable = [{**train, "store": {**train["store"], "url": None}} for train in resolved]
    key = config_hash(portable, models["learner"]["checkpoint_hash"], models["peer"]["checkpoint_hash"], eval_sets,
                      cfg.rl.eval_samples, cfg.evaluated_steps(), *([{k: v for k, v in extra.items() if k != "store_url"}]
                                                                      if extra else []))
    job_dir = out / "runs" / f"{name}-{key}"
    commands, logs, done = [], [], []
    for index, train in enumerate(trains):
        part_dir = job_dir if index == 0 else job_dir / "peer"
        train["run_dir"] = str(part_dir / "train")
        part_dir.mkdir(parents=True, exist_ok=True)
        job_file = part_dir / "job.json"
        job_file.write_text(json.dumps({"out": str(part_dir), "train": train, "eval_sets": eval_sets,
                                        "eval_samples": cfg.rl.eval_samples, "eval_steps": cfg.evaluated_steps(),
                                        **(extra or {})}))
        commands.append(python_module("demo.worker", "train", str(job_file)))
        logs.append(part_dir / "log.txt")
        done.append(part_dir / "done.json")
    n_evals = len(cfg.evaluated_steps())
    parts = [job_dir] + ([job_dir / "peer"] if len(trains) > 1 else [])
    progress = [(_lines(p / "train" / "metrics.jsonl"), progress_file(p / "eval_progress")) for p in parts]
    job = Job(
        name=name, commands=commands, logs=logs, done=done, deps=deps, total=len(parts) * (cfg.rl.steps + n_evals),
        progress=lambda progress=progress: sum(steps() + evals() for steps, evals in progress),
    )
    return job, job_dir


def generator_job(cfg: DemoConfig, data: dict[str, Path], checkpoint: str, model_id: str, store_root: Path, store_url: str,
                  name: str, deps: list[str]) -> Job:
    """`graft-generate` with one warm-started model over the RL prompts, writing shards into the store root; done
    once the store has indexed a group of that model for every prompt."""
    done = store_root / f"groups-done-{model_id}.json"
    log = store_root / "logs" / f"generate-{model_id}.log"
    n_prompts = sum(cfg.task.rl_prompts.values())
    command = python_module(
        "graft.services.generator.cli",
        "--model", checkpoint, "--model-id", model_id, "--dataset", str(data["rl"]),
        "--set", "prompt.template=raw", "--set", f"group_size={cfg.peer_groups.group_size}", "--set", "temperature=1.0",
        "--set", "max_tokens=16", "--set", f"seed={cfg.peer_groups.seed}", "--store", str(store_root),
        "--set", f"prompts_per_batch={cfg.peer_groups.prompts_per_batch}", "--set", "sampler.batch_size=1024",
        "--set", "scoring.workers=1", "--set", "progress=false",
    )

    from graft.services.store_api.local import model_dir

    shards = model_dir(store_root, model_id)  # this model's folder only (a co-training id extends the peer's)

    def groups() -> float:  # the bar's progress: a shard holds one batch of prompts
        return float(sum(1 for _ in shards.rglob("*.parquet"))) * cfg.peer_groups.prompts_per_batch

    started, files = now(), package_files()  # when this invocation planned it, and the code graft-generate will run

    def after() -> None:
        # The generator wrote shards; wait until the store's ingest loop has indexed every group.
        from graft.services.store_api.http.client import StoreClient

        summary = json.loads(log.read_text().strip().splitlines()[-1])
        deadline = time.monotonic() + 60
        with StoreClient(store_url) as client:
            while True:
                stats = next((m for m in client.stats().models if m.model_id == model_id), None)
                if stats is not None and stats.groups >= n_prompts:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the store indexed {0 if stats is None else stats.groups} of {n_prompts} groups of {model_id} after 60 s")
                time.sleep(0.2)
        summary.update(indexed_groups=stats.groups, informative_groups=stats.informative_groups, success_rate=stats.success_rate,
                       record=job_record(started, files, package_files()))  # graft-generate ran graft's code
        write_text_atomic(done, json.dumps(summary))

    return Job(name=name, commands=[command], logs=[log], done=[done], progress=groups, total=n_prompts, after=after, deps=deps)


# ---- 7. after the report -------------------------------------------------------------------------

def print_serve_instructions(store_root: Path, runs: list[dict], data: dict[str, Path], models: dict[str, dict]) -> None:
    first = orjson.loads(data["rl"].read_bytes().splitlines()[0])
    rel = os.path.relpath(store_root, Path.cwd())
    # the models' directories: the browser decodes their token ids with their tokenizers
    dirs = (next(iter(models["learner"]["start_dirs"].values())), models["peer"]["start_dirs"]["peer"])
    tokenizers = " ".join(f"--tokenizer {os.path.relpath(path, Path.cwd())}" for path in dirs)
    script = Path(sys.executable).parent / "graft-store"
    graft_store = os.path.relpath(script) if script.exists() else (shutil.which("graft-store") or f"{sys.executable} -m graft.services.store_api.cli")
    print(f"""
The demo's store is kept in {rel}. Serve it again with
  {graft_store} serve --root {rel} --port 8600 {tokenizers}
browse it at http://127.0.0.1:8600/ui/ (every model's groups per prompt, each rollout's tokens coloured by
probability, the prompts GRAFT grafts), or query it, e.g.
  curl -s http://127.0.0.1:8600/v1/health
  curl -s http://127.0.0.1:8600/v1/stats
  curl -s 'http://127.0.0.1:8600/v1/prompts/{first["prompt_id"]}/groups?model={PEER_MODEL_ID}&limit=1'   # the peer's group for `{first["problem"]}`
  curl -s 'http://127.0.0.1:8600/v1/rollouts?model={PEER_MODEL_ID}&correct=true&limit=3'
  curl -s -X POST http://127.0.0.1:8600/v1/peer-groups/lookup -H 'content-type: application/json' \\
       -d '{{"prompt_ids": ["{first["prompt_id"]}"], "learner_model": "{LEARNER_MODEL_ID}"}}'
(OpenAPI docs at http://127.0.0.1:8600/docs)
""", flush=True)


if __name__ == "__main__":
    sys.exit(main())
