"""One demo job in its own process (one torch thread): build and warm-start a model, or one RL run.

    python -m demo.worker build <job.json>     # tokenizer + model + SFT + held-out accuracy
    python -m demo.worker train <job.json>     # graft.trainer.loop.train, then held-out accuracy of its checkpoints
    python -m demo.worker imitate <job.json>   # the ceiling: supervised training on the peer's correct answers
    python -m demo.worker probe <job.json>     # the mechanism probe at one start (demo.probe)

The parent (`demo.run`) writes the job file and reads `done.json` from the job's folder; a job is
finished exactly when that file exists (written last, atomically).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from demo.config import DemoConfig, warm_start_checkpoint
from demo.evaluation import family_accuracy, load_eval_sets
from demo.records import first_party_files, job_record, now
from graft.rollouts.files import write_text_atomic
from toy.models import build_learner, build_peer, count_parameters
from toy.sft import SFTConfig, stop_check, train_sft, write_progress
from toy.task import alphabet, completion_text, family_splits
from toy.tokenization import build_bpe_tokenizer, build_char_tokenizer

EVAL_SEED = 20261203  # the seed of every held-out sampled evaluation (a problem's samples: EVAL_SEED + its place)


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2))


def warm_start_inputs(cfg: DemoConfig, role: str) -> tuple[PreTrainedModel, PreTrainedTokenizerFast, dict, dict]:
    """The untrained model and tokenizer of `role` (learner or peer), its SFT pools and its dev pairs, per family."""
    spec = cfg.learner if role == "learner" else cfg.peer
    splits = {f: family_splits(f, cfg.task.n_eval[f], cfg.task.n_rl) for f in cfg.task.n_eval}
    # the first n_dev supervised problems of each family decide when the warm start stops (SFTConfig.stop_when)
    dev = {f: [(p.problem, completion_text(p.answer)) for p in s["sft"][: cfg.task.n_dev]] for f, s in splits.items()}
    pools = {f: [(p.problem, completion_text(p.answer)) for p in s["sft"][cfg.task.n_dev :]] for f, s in splits.items()}
    if role == "learner":
        tokenizer = build_char_tokenizer(alphabet())
        model = build_learner(tokenizer, spec.seed, spec.hidden, spec.layers)
    else:
        # The peer's tokenizer sees SFT text only, and only characters the learner's tokenizer has.
        corpus = [text for f in pools for pair in pools[f][:4000] for text in pair]
        tokenizer = build_bpe_tokenizer(corpus, cfg.bpe_vocab_size, allowed_chars=alphabet())
        model = build_peer(tokenizer, spec.seed, spec.hidden, spec.layers)
    return model, tokenizer, pools, dev


def build(job: dict) -> dict:
    """Tokenizer, model from a config, supervised warm start with a checkpoint at every check, and the checkpoints the
    later stages start from, chosen by level (`choose_starts`), with their held-out accuracy per family."""
    cfg = DemoConfig.model_validate(job["demo"])
    role, out = job["role"], Path(job["out"])
    spec = cfg.learner if role == "learner" else cfg.peer
    started = time.perf_counter()
    model, tokenizer, pools, dev = warm_start_inputs(cfg, role)
    curve: list[dict] = []
    saved = train_sft(model, tokenizer, pools, spec.sft, out / "sft", desc=f"sft {role}", progress_path=out / "progress",
                      dev=dev, curve=curve)
    sft_s = time.perf_counter() - started
    stopped = stop_step(spec.sft, curve)
    write_json_atomic(out / "curve.json", {"curve": curve, "stop_step": stopped})
    if spec.sft.stop_when or spec.sft.stop_when_sampled:
        if stopped is None:
            last = curve[-1]
            raise SystemExit(
                f"the {role}'s warm start reached its last step, {last['step']}, without its levels "
                f"({level_text(spec.sft)}; at that step: {check_text(last)}): the demo's precondition failed on this "
                "machine, and its RL runs would measure another setting than the one they are meant to. Nothing was "
                "trained after it. Look at the curve in " + str(out / "curve.json") + "; a longer schedule (--set "
                f"{role}.sft.stop_at=..., {role}.sft.steps=...) may reach it")
    levels = cfg.start_levels(role)
    chosen = choose_starts(curve, cfg.level_family(role), levels, spec.sft.stop_when, stopped or curve[-1]["step"],
                           cfg.start_tolerance)

    from graft.rollouts.scoring import Scorer

    eval_sets = load_eval_sets({f: Path(p) for f, p in job["eval_sets"].items()})
    starts = {}
    with Scorer(num_workers=1, timeout_s=5.0) as scorer:
        for name, step in chosen.items():
            checkpoint = warm_start_checkpoint(out, name)  # one name whatever step it is: the later jobs' configs name it
            if checkpoint.exists():  # left by a run that died before done.json
                shutil.rmtree(checkpoint)
            shutil.copytree(saved[step], checkpoint)
            check = next(c for c in curve if c["step"] == step)
            starts[name] = {
                "level": levels[name], "step": step, "checkpoint": str(checkpoint),
                "dev_greedy": check["greedy"], "dev_sampled": check["sampled"],
                "acc_greedy": family_accuracy(checkpoint, eval_sets, scorer),
                "acc_sampled": family_accuracy(checkpoint, eval_sets, scorer, sampled=True, seed=EVAL_SEED,
                                               samples=cfg.rl.eval_samples),
            }
    for path in saved.values():  # the other checks' checkpoints: their levels are in curve.json
        shutil.rmtree(path, ignore_errors=True)
    return {
        "role": role,
        "architecture": type(model).__name__,
        "parameters": count_parameters(model),
        "vocab_size": len(tokenizer),
        "tokenizer_tokens_of_example": tokenizer.convert_ids_to_tokens(tokenizer("\\boxed{1046}", add_special_tokens=False)["input_ids"]),
        "sft_steps": stopped or curve[-1]["step"],
        "sft_s": round(sft_s, 1),
        "starts": starts,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def stop_step(sft: SFTConfig, curve: list[dict]) -> int | None:
    """The check at which `train_sft` stopped on this curve by its stop rule (`toy.sft.stop_check`), None if never."""
    held: dict[str, int] = {}
    for check in curve:
        held, reached = stop_check(sft, held, check["greedy"], check["sampled"])
        if reached:
            return check["step"]
    return None


def choose_starts(curve: list[dict], family: str, levels: dict[str, float], required: dict[str, float],
                  last_step: int, tolerance: float | None = None) -> dict[str, int]:
    """name -> the step of the check (up to `last_step`) whose sampled accuracy on `family` is nearest each level
    (the earlier one on a tie), among the checks where every family of `required` was at its greedy level.

    With a `tolerance` (DemoConfig.start_tolerance), a start further than it from its level, or two starts at one
    check, stop the demo with the reason in one line: its runs would measure another setting than the one they are
    named for (issue 48: a learner that learnt `family` before `required` had both starts at one step, 25 points off)."""
    eligible = [c for c in curve if c["step"] <= last_step and all(c["greedy"][f] >= v for f, v in required.items())]
    if not eligible:
        raise SystemExit(f"no check of the warm start up to step {last_step} had {required} (greedy): nothing to start from")
    # distances rounded: 0.38 and 0.42 are as far from 0.40, whatever the floats say
    chosen = {name: min(eligible, key=lambda c: (round(abs(c["sampled"][family] - level), 9), c["step"]))
              for name, level in levels.items()}
    if tolerance is None:
        return {name: check["step"] for name, check in chosen.items()}
    among = f" with {', '.join(f'{f} at {100 * v:.0f}% greedy' for f, v in required.items())}" if required else ""
    problems = []
    for name, check in chosen.items():
        off = abs(check["sampled"][family] - levels[name])
        if round(off, 9) > tolerance:
            problems.append(f"start {name} (level {100 * levels[name]:.0f}% {family} sampled on dev) is {100 * off:.1f} "
                            f"points off: the nearest check{among} is step {check['step']} at "
                            f"{100 * check['sampled'][family]:.1f}%")
    by_step: dict[int, list[str]] = {}
    for name, check in chosen.items():
        by_step.setdefault(check["step"], []).append(name)
    problems += [f"starts {' and '.join(names)} are one checkpoint (step {step})" for step, names in by_step.items()
                 if len(names) > 1]
    if problems:
        raise SystemExit(f"the warm start has no checkpoint at its starts' levels (tolerance {100 * tolerance:.0f} points): "
                         + "; ".join(problems) + ". Runs from there would not be the starts they are named for, so "
                         "none is run: this is the result on this machine (report it as such; trying other seeds until "
                         "a warm start fits would choose the data). The curve (every check) is in the warm start's "
                         "curve.json")
    return {name: check["step"] for name, check in chosen.items()}


def level_text(sft: SFTConfig) -> str:
    parts = [f"{f} {100 * v:.0f}% greedy" for f, v in sft.stop_when.items()]
    parts += [f"{f} {100 * v:.0f}% sampled" for f, v in sft.stop_when_sampled.items()]
    return ", ".join(parts) + f" on {sft.stop_when_checks} checks in a row"


def check_text(check: dict) -> str:
    return ", ".join([f"{f} {100 * a:.1f}% greedy" for f, a in check["greedy"].items()]
                     + [f"{f} {100 * a:.1f}% sampled" for f, a in check["sampled"].items()])


def finished_checkpoints(folder: Path, steps: int) -> list[Path]:
    """The run's checkpoints, oldest first, once it has reached its last step. The trainer returns normally when SIGTERM
    stops it at a step boundary (`docker stop`, the demo stopped): such a run must not be evaluated and marked done, or a
    rerun would take its shorter run for the finished one."""
    checkpoints = sorted(folder.glob("step_*"))
    last = int(checkpoints[-1].name.split("_")[1]) if checkpoints else 0
    if last < steps:
        raise SystemExit(f"the run stopped at step {last} of {steps} (SIGTERM?): not evaluated, not marked done")
    return checkpoints


def train(job: dict) -> dict:
    """One RL run through the project's trainer, then held-out accuracy (greedy, sampled) of the checkpoints the
    verdict reads (job["eval_steps"])."""
    from graft.rollouts.scoring import Scorer
    from graft.trainer.checkpoint import checkpoints_dir
    from graft.trainer.config import TrainConfig
    from graft.trainer.loop import train as run_training

    started = time.perf_counter()
    train_cfg = dict(job["train"])
    if job.get("matched_run"):  # GRPO plus the rows a GRAFT run grafted, supervised at their step (the mutual study)
        train_cfg["anchor"] = {**train_cfg["anchor"], "step_rows": str(write_step_rows(job))}
    cfg = TrainConfig.model_validate(train_cfg)
    run_dir = run_training(cfg, overwrite=True)  # a job runs again only when it did not finish (no done.json): afresh
    train_s = time.perf_counter() - started
    # only the checkpoints the verdict reads (DemoConfig.evaluated_steps); a job file from before it: all of them
    checkpoints = [c for c in finished_checkpoints(checkpoints_dir(run_dir), cfg.steps)
                   if "eval_steps" not in job or int(c.name.split("_")[1]) in job["eval_steps"]]
    eval_sets = load_eval_sets({f: Path(p) for f, p in job["eval_sets"].items()})
    evals: list[dict] = []
    with Scorer(num_workers=1, timeout_s=5.0) as scorer:
        for index, checkpoint in enumerate(checkpoints):
            step = int(checkpoint.name.split("_")[1])
            # sampled: every run draws the same seeds per problem (EVAL_SEED, not the run's), so a pair's difference is
            # its policies' (demo.stats: the primary metric)
            evals.append({"step": step, "acc_greedy": family_accuracy(checkpoint, eval_sets, scorer),
                          "acc_sampled": family_accuracy(checkpoint, eval_sets, scorer, sampled=True, seed=EVAL_SEED,
                                                         samples=job["eval_samples"])})
            write_progress(Path(job["out"]) / "eval_progress", index + 1, len(checkpoints))
    return {
        "run_dir": str(run_dir),
        "train_s": round(train_s, 1),
        "evals": evals,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def write_step_rows(job: dict) -> Path:
    """The correct rows of the peer groups job["matched_run"] grafted, by step (`matched_examples`), as the trainer's
    anchor.step_rows file in the job's folder."""
    import orjson

    from graft.services.store_api.http.client import StoreClient

    problems = {row["prompt_id"]: row["problem"] for row in map(orjson.loads, Path(job["rl_dataset"]).read_bytes().splitlines())}
    with StoreClient(job["store_url"]) as client:
        per_step, _ = matched_examples(Path(job["matched_run"]), problems, client)
    path = Path(job["out"]) / "step_rows.jsonl"
    write_text_atomic(path, "".join(json.dumps({"step": step, "problem": q, "completion": c}) + "\n"
                                    for step, pairs in enumerate(per_step) for q, c in pairs))
    return path


def imitate(job: dict) -> dict:
    """What the peer's stored groups could teach at best in this setting, measured.

    Plain supervised training of the learner on the peer's *correct* weak-family answers (read from
    the store's REST API), with the RL runs' optimizer, learning rate, number of updates and anchor:
    every update sees `examples_per_step` peer answers at full weight, more than GRAFT's grafted rows
    carry (they are down-weighted by w and b and mixed with the learner's own groups). If this does
    not move the weak family, no way of consuming the peer's groups can in this budget.

    With `matched_run` (a GRAFT run's train dir), the dose-matched ceiling: each update is supervised on the correct
    rows of exactly the peer groups that run grafted at that step (its peer_groups.jsonl, fetched from the store by id),
    their summed NLL divided by that step's token-mean denominator in the run (its `completion_tokens`: the learner's
    sampled tokens, up to the swap of a failed group for a peer group), so that a row weighs what a grafted row with
    weight 1 would. It is supervised alone: it lacks the RL on the model's own groups that the GRAFT run also had, so
    it differs from that run in more than the loss's form (issue 60); the mutual study's control for the loss's form
    is GRPO plus these rows (`train` with `matched_run`).

    With `gated_run` (a GRAFT run's train dir), the ceiling on the gate's prompts: each update is supervised on
    examples_per_step rows drawn (with replacement) from the correct rows of exactly the peer groups that run grafted
    at that step, token-mean as the full ceiling's: the full ceiling's rows and weight, the prompts GRAFT had. A step
    that grafted nothing trains on the anchor alone.

    With `eval_steps` (or, in a job file from before it, `eval_every`: every such step from steps / 2 on), the held-out
    accuracy at those steps (`evals`, read as the RL runs' are); the last evaluation's is also `acc_greedy` /
    `acc_sampled`."""
    import random

    import orjson

    from graft.rollouts.models import load_model_and_tokenizer
    from graft.rollouts.prompts import PromptConfig
    from graft.rollouts.scoring import Scorer
    from graft.services.store_api.http.client import StoreClient
    from graft.trainer.batch import TrainSample, collate, response_logprobs

    started = time.perf_counter()
    train_cfg = job["train"]
    # The stored row carries the prompt id (and the generator's dataset name, the whole RL file), not the
    # problem or its family: the RL dataset maps one to the other.
    rl_rows = [orjson.loads(line) for line in Path(job["rl_dataset"]).read_bytes().splitlines()]
    weak = {row["prompt_id"]: row["problem"] for row in rl_rows if row["dataset"] == job["weak_dataset"]}
    matched, gated = job.get("matched_run"), job.get("gated_run")
    with StoreClient(job["store_url"]) as client:
        if gated:
            per_step, _ = matched_examples(Path(gated), {row["prompt_id"]: row["problem"] for row in rl_rows}, client)
            examples = [pair for pairs in per_step for pair in pairs]
        elif matched:
            per_step, denominators = matched_examples(Path(matched), {row["prompt_id"]: row["problem"] for row in rl_rows},
                                                      client)
            examples = [pair for pairs in per_step for pair in pairs]
        else:
            examples = []
            for table in client.iter_rollouts(model=job["peer_model"], correct=True):
                examples += [(weak[pid], text) for pid, text in zip(table["prompt_id"].to_pylist(),
                                                                     table["completion_text"].to_pylist()) if pid in weak]
    steps = train_cfg["steps"] if examples else 0  # a peer with no correct answer teaches nothing: the start is the ceiling
    anchors = [(row["problem"], row["completion"]) for row in map(orjson.loads, Path(train_cfg["anchor"]["dataset"]).read_bytes().splitlines())]
    model, tokenizer = load_model_and_tokenizer(Path(train_cfg["model"]["path"]))
    model.train()
    optim = train_cfg["optim"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim["lr"], weight_decay=0.0)

    prompt = PromptConfig.model_validate(train_cfg.get("prompt", {}))  # the RL runs' prompts (demo_train.yaml: raw)

    def nll(pairs: list[tuple[str, str]], denominator: float | None = None) -> torch.Tensor:
        """Token-mean NLL of the pairs; with `denominator`, their summed NLL divided by it instead."""
        rows = []
        for problem, completion in pairs:
            prompt_ids = prompt.token_ids(tokenizer, problem)
            completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(TrainSample(prompt_id="", group=-1, prompt_ids=list(prompt_ids), completion_ids=list(completion_ids),
                                    num_content_tokens=len(completion_ids) - 1, advantage=0.0, grafted=False,
                                    num_bytes=len(completion.encode())))
        batch = collate(rows, tokenizer.pad_token_id)
        logprobs = response_logprobs(model, batch)  # (b, T)
        return -(logprobs * batch.mask).sum() / (batch.mask.sum() if denominator is None else denominator)

    eval_sets = load_eval_sets({f: Path(p) for f, p in job["eval_sets"].items()})
    eval_every = job.get("eval_every") or steps
    eval_steps = set(job["eval_steps"]) if "eval_steps" in job else {
        done for done in range(eval_every, steps, eval_every or 1) if done >= steps / 2}  # steps 0: none
    evals: list[dict] = []

    def evaluate(step: int) -> None:
        checkpoint = Path(job["out"]) / "final"
        model.save_pretrained(checkpoint)
        tokenizer.save_pretrained(checkpoint)
        with Scorer(num_workers=1, timeout_s=5.0) as scorer:
            evals.append({"step": step, "acc_greedy": family_accuracy(checkpoint, eval_sets, scorer),
                          "acc_sampled": family_accuracy(checkpoint, eval_sets, scorer, sampled=True, seed=EVAL_SEED,
                                                         samples=job["eval_samples"])})
        model.train()

    rng = random.Random(train_cfg["seed"])
    for step in range(steps):
        if gated:
            loss = nll([rng.choice(per_step[step]) for _ in range(job["examples_per_step"])]) if per_step[step] \
                else torch.zeros(())
        elif matched:
            pairs = per_step[step]
            loss = nll(pairs, denominators[step]) if pairs else torch.zeros(())
        else:
            loss = nll([rng.choice(examples) for _ in range(job["examples_per_step"])])
        loss = loss + train_cfg["anchor"]["weight"] * nll(rng.sample(anchors, train_cfg["anchor"]["prompts_per_step"]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim["grad_clip"])
        optimizer.step()
        write_progress(Path(job["out"]) / "progress", step + 1, train_cfg["steps"])
        done = step + 1
        if done < steps and done in eval_steps:
            evaluate(done)
    evaluate(train_cfg["steps"])  # with nothing to teach (steps 0) the start's accuracy, at the run's last step
    result = {"peer_correct_answers": len(examples), "examples_per_step": job["examples_per_step"], "steps": steps,
              "acc_greedy": evals[-1]["acc_greedy"], "acc_sampled": evals[-1]["acc_sampled"], "evals": evals,
              "wall_s": round(time.perf_counter() - started, 1)}
    if matched:
        result.update(matched_run=matched, examples_per_step=round(len(examples) / max(1, steps), 2),
                      denominator_mean=round(sum(denominators) / max(1, len(denominators)), 1))
    if gated:
        result.update(gated_run=gated, gated_rows_per_step=round(len(examples) / max(1, steps), 2),
                      steps_without_rows=sum(not pairs for pairs in per_step))
    return result


def matched_examples(run_dir: Path, problems: dict[str, str], client) -> tuple[list[list[tuple[str, str]]], list[float]]:
    """Per step of a GRAFT run (its train dir): the (problem, completion) of every correct row of the peer groups it
    grafted (peer_groups.jsonl, fetched by id; a group gone from the store stops the job), and the step's token-mean
    denominator (metrics.jsonl's `completion_tokens`)."""
    import orjson

    from graft.trainer.replay import RECORD_NAME

    records = [orjson.loads(line) for line in (run_dir / RECORD_NAME).read_bytes().splitlines() if line.strip()]
    metrics = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines() if line.strip()]
    if len(records) != len(metrics):
        raise RuntimeError(f"{run_dir}: {len(records)} steps in {RECORD_NAME} but {len(metrics)} in metrics.jsonl")
    per_step: list[list[tuple[str, str]]] = []
    for record in records:
        pairs = []
        for group_id in record["grafted"]:
            group = client.get_group(group_id)
            if group is None:
                raise RuntimeError(f"group {group_id} grafted at step {record['step']} of {run_dir} is gone from the store")
            pairs += [(problems[r.prompt_id], r.completion_text) for r in group.rollouts if r.correct]
        per_step.append(pairs)
    return per_step, [float(m["completion_tokens"]) for m in metrics]


def probe(job: dict) -> dict:
    """The mechanism probe at one start (demo.probe)."""
    from demo.probe import probe as run_probe

    started = time.perf_counter()
    result = run_probe(job, progress=lambda done, total: write_progress(Path(job["out"]) / "progress", done, total))
    return {**result, "wall_s": round(time.perf_counter() - started, 1)}


COMMANDS = {"build": build, "train": train, "imitate": imitate, "probe": probe}


def main() -> None:
    if len(sys.argv) != 3 or sys.argv[1] not in COMMANDS:
        raise SystemExit(f"usage: python -m demo.worker {'|'.join(COMMANDS)} <job.json>")
    job = json.loads(Path(sys.argv[2]).read_text())
    # The kernels demo.run pins (demo.jobs.PORTABLE_KERNELS) hold only if torch read them when it loaded: say so if not.
    wanted, used = os.environ.get("ATEN_CPU_CAPABILITY"), torch.backends.cpu.get_cpu_capability()
    if wanted and wanted.lower() != used.lower():
        raise SystemExit(f"ATEN_CPU_CAPABILITY={wanted} but torch runs its {used} kernels (was torch imported before the variable was set?)")
    torch.set_num_threads(job.get("threads", 1))  # one process per core, but the learner's warm start, which all RL waits for
    started, at_start = now(), first_party_files()  # the code as the job starts (demo.records.job_record)
    result = COMMANDS[sys.argv[1]](job)
    # CPU seconds of this process and its finished children (the scorer): what the job costs on an idle core.
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu_s"] = round(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, 1)
    result["record"] = job_record(started, at_start)  # the code it imported, the commit, the host, when (demo.records)
    write_json_atomic(Path(job["out"]) / "done.json", result)


if __name__ == "__main__":
    main()
