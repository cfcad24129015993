"""Where a warm start's weak skill emerges under each kernel choice of this CPU, and where each stop rule stops it.

    python -m demo.warm_start_curves [--role learner] [--kernels own,avx2,default] [--set KEY=VALUE] [--report-dir DIR]

The demo's warm starts stop at a measured level (SFTConfig.stop_when), not at a step, because the step where the
learner's add3 emerges moves with the CPU's kernels. This trains the demo's warm start of `--role` to its last step
under each kernel choice (ATen's kernels for this CPU's ISA, AVX2, baseline x86-64: each gives other weights from the
first step on, as another CPU model would), saving a checkpoint at every check, and measures each checkpoint's greedy
exact-match accuracy on the dev problems the rule reads and on the held-out problems the demo reports (the demo's
math-verify scoring gives the same figure for a greedy boxed answer). It then replays the rule on each curve
(`toy.sft.stop_check`) with one check and with two in a row, and writes curves.json, REPORT.md and
warm_start_curves.png to the report folder: the step each rule stops at and the held-out accuracy RL would start from.
Each warm start runs on the demo's threads for it (`learner_sft_threads`: the thread count changes the weights as well):
about 5 minutes a kernel choice for the learner on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from demo.config import DemoConfig
from demo.jobs import Job, child_env, python_module, run_jobs
from rollouts.files import write_text_atomic

# ATen's kernel choices on x86-64, best first: ATEN_CPU_CAPABILITY's values; "own" sets nothing (the CPU's best)
ATEN_CHOICES = ("avx512", "avx2", "default")
RULES = (1, 2)  # stop_when_checks replayed on every curve


def available_kernels() -> list[str]:
    """"own" and every ATen choice below this CPU's own (the same as own once the list reaches it is left out)."""
    import torch

    own = torch.backends.cpu.get_cpu_capability().lower()  # avx512, avx2, default (or an Arm name)
    if own not in ATEN_CHOICES:
        return ["own"]
    return ["own", *ATEN_CHOICES[ATEN_CHOICES.index(own) + 1 :]]


def curve_job(job: dict) -> None:
    """In the kernel choice's own process: the warm start to its last step, then every checkpoint's accuracies."""
    import torch

    from demo.evaluation import load_eval_sets
    from demo.worker import warm_start_inputs, write_json_atomic
    from toy.sft import greedy_exact_match, train_sft, write_progress
    from toy.task import completion_text

    torch.set_num_threads(job["threads"])  # the demo's own for this warm start: threads change the weights too
    cfg = DemoConfig.model_validate(job["demo"])
    role, out = job["role"], Path(job["out"])
    sft = (cfg.learner if role == "learner" else cfg.peer).sft
    last = sft.stop_at or sft.steps
    model, tokenizer, pools, dev = warm_start_inputs(cfg, role)
    checks = [s for s in range(1, last + 1) if s % sft.check_every == 0 or s == last]  # the steps train_sft checks at
    started = time.perf_counter()
    saved = train_sft(model, tokenizer, pools, sft.model_copy(update={"stop_when": {}, "save_steps": checks}),
                      out / "checkpoints", desc=f"sft {role} ({job['kernels']})", progress_path=out / "progress")
    sft_s = time.perf_counter() - started
    from transformers import AutoModelForCausalLM

    held_out = {f: [(p.problem, completion_text(p.answer)) for p in problems]
                for f, problems in load_eval_sets({f: Path(p) for f, p in job["eval_sets"].items()}).items()}
    rows = []
    for index, step in enumerate(sorted(saved)):
        checkpoint = AutoModelForCausalLM.from_pretrained(saved[step])
        rows.append({"step": step, "dev": {f: greedy_exact_match(checkpoint, tokenizer, pairs) for f, pairs in dev.items()},
                     "held_out": {f: greedy_exact_match(checkpoint, tokenizer, pairs) for f, pairs in held_out.items()}})
        write_progress(out / "progress", last + (index + 1) * last // len(saved), 2 * last)
    shutil.rmtree(out / "checkpoints")  # 4 MB each: the curve is what is kept
    write_json_atomic(out / "done.json", {"kernels": job["kernels"], "role": role, "sft_s": round(sft_s, 1), "curve": rows})


def replay(cfg: DemoConfig, role: str, curve: list[dict], checks: int) -> dict:
    """The check a warm start with `stop_when_checks = checks` stops at on this curve (the last one when never)."""
    from toy.sft import stop_check

    sft = (cfg.learner if role == "learner" else cfg.peer).sft.model_copy(update={"stop_when_checks": checks})
    held: dict[str, int] = {}
    for row in curve:
        held, reached = stop_check(sft, held, row["dev"])
        if reached:
            return {**row, "reached": True}
    return {**curve[-1], "reached": False}


def report(cfg: DemoConfig, role: str, results: dict[str, dict], report_dir: Path) -> str:
    sft = (cfg.learner if role == "learner" else cfg.peer).sft
    families = list(sft.stop_when) or list(cfg.task.n_eval)
    stops = {k: {checks: replay(cfg, role, r["curve"], checks) for checks in RULES} for k, r in results.items()}
    levels = ", ".join(f"{f} {100 * v:.0f}%" for f, v in sft.stop_when.items())
    lines = [f"# Warm start of the {role} under each kernel choice", "",
             f"stop_when: {levels}, checked every {sft.check_every} steps on {cfg.task.n_dev} dev problems per family; "
             f"the demo uses stop_when_checks = {sft.stop_when_checks}.", "",
             "| kernels | rule | stop step | " + " | ".join(f"dev {f}" for f in families) + " | "
             + " | ".join(f"held-out {f}" for f in cfg.task.n_eval) + " |",
             "|---|---|---|" + "---|" * (len(families) + len(cfg.task.n_eval))]
    for kernels, by_rule in stops.items():
        for checks, row in by_rule.items():
            step = f"{row['step']}" + ("" if row["reached"] else " (never reached)")
            lines.append(f"| {kernels} | stop_when_checks {checks} | {step} | "
                         + " | ".join(f"{100 * row['dev'][f]:.1f}" for f in families) + " | "
                         + " | ".join(f"{100 * row['held_out'][f]:.1f}" for f in cfg.task.n_eval) + " |")
    report_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(report_dir / "curves.json", json.dumps({"role": role, "stop_when": sft.stop_when, "results": results,
                                                                 "stops": stops}, indent=1))
    write_text_atomic(report_dir / "REPORT.md", "\n".join(lines) + "\n")
    _plot(results, stops, families, cfg.task.weak_family, report_dir / "warm_start_curves.png")
    return "\n".join(lines)


def _plot(results: dict[str, dict], stops: dict, families: list[str], weak: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from demo.report import _save_fig

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), sharey=True, squeeze=False)
    for ax, (kernels, result) in zip(axes[0], results.items()):
        steps = [row["step"] for row in result["curve"]]
        for f in families:
            ax.plot(steps, [100 * row["dev"][f] for row in result["curve"]], lw=0.9, label=f"dev {f}")
        ax.plot(steps, [100 * row["held_out"][weak] for row in result["curve"]], lw=2, color="black", label=f"held-out {weak}")
        for checks, style in zip(RULES, (":", "-")):
            row = stops[kernels][checks]
            ax.axvline(row["step"], color="tab:red" if checks == 1 else "tab:green", ls=style,
                       label=f"stop, {checks} check{'s' * (checks > 1)}: {100 * row['held_out'][weak]:.1f}% held-out")
        ax.set_title(f"kernels: {kernels}")
        ax.set_xlabel("SFT step")
        ax.legend(fontsize=7, loc="center left")
    axes[0][0].set_ylabel("greedy accuracy (%)")
    fig.tight_layout()
    _save_fig(fig, path)


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["curve"]:  # the per-kernel process
        curve_job(json.loads(Path(argv[1]).read_text()))
        return
    parser = argparse.ArgumentParser(prog="python -m demo.warm_start_curves", description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["learner", "peer"], default="learner")
    parser.add_argument("--kernels", default=None, help="comma-separated: own, avx512, avx2, default (default: own and every "
                                                        "ATen choice below this CPU's)")
    parser.add_argument("--config", type=Path, default=None, help="YAML with DemoConfig fields (default: the demo's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field, e.g. learner.sft.stop_at=500")
    parser.add_argument("--out-dir", type=Path, default=Path("demo_out/warm-start-curves"))
    parser.add_argument("--report-dir", type=Path, default=Path("report/warm_start"))
    parser.add_argument("--slots", type=int, default=None, help="kernel choices trained at once (default: the cores over "
                                                                 "the warm start's threads)")
    args = parser.parse_args(argv)
    kernels = args.kernels.split(",") if args.kernels else available_kernels()
    unknown = set(kernels) - {"own", *ATEN_CHOICES}
    if unknown:
        parser.error(f"unknown kernel choice(s) {sorted(unknown)}: expected own, {', '.join(ATEN_CHOICES)}")
    from demo.config import config_hash, load_demo_config
    from demo.run import prepare_data, progress_file

    cfg = load_demo_config(args.config, args.set, use_quick=False)
    paths = prepare_data(cfg, args.out_dir / "data")
    eval_sets = {f: str(paths[f"eval_{f}"]) for f in cfg.task.n_eval}
    spec = cfg.learner if args.role == "learner" else cfg.peer
    sft = spec.sft
    last = sft.stop_at or sft.steps
    jobs = []
    threads = cfg.learner_sft_threads if args.role == "learner" else 1  # as demo.run's warm starts
    curve_spec = spec.model_copy(update={"sft": sft.model_copy(update={"stop_when": {}, "stop_when_checks": 1})})  # the rule is replayed
    key = config_hash(args.role, curve_spec, cfg.task, cfg.bpe_vocab_size if args.role == "peer" else None, threads)
    folders = {k: (args.out_dir / f"{args.role}-{k}-{key}").resolve() for k in kernels}  # a rerun keeps what is done
    for k, out in folders.items():
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "job.json", json.dumps({"role": args.role, "kernels": k, "out": str(out), "eval_sets": eval_sets,
                                                        "threads": threads, "demo": cfg.model_dump(mode="json")}))
        # ATen reads its choice when torch loads: each kernel choice is its own process, started through env
        prefix = [] if k == "own" else ["env", f"ATEN_CPU_CAPABILITY={k}"]
        jobs.append(Job(name=k, commands=[prefix + python_module("demo.warm_start_curves", "curve", str(out / "job.json"))],
                        logs=[out / "log.txt"], done=[out / "done.json"], progress=progress_file(out / "progress"), total=2 * last))
    slots = args.slots or max(1, (os.cpu_count() or 1) // threads)
    run_jobs(jobs, slots, f"{args.role} warm starts", child_env())
    results = {k: json.loads((out / "done.json").read_text()) for k, out in folders.items()}
    print(report(cfg, args.role, results, args.report_dir))
    print(f"report written to {args.report_dir}/ (REPORT.md, curves.json, warm_start_curves.png)")


if __name__ == "__main__":
    main()
