"""The verl stage of the GPU check: a few `python -m verl.trainer.main_ppo` steps with GRAFT's trainer
(`trainer.v1.trainer_mode=graft_sync`) on a small model, a store on loopback, and graft/ metrics recorded.

    python -m gpu_check --verl --dry-run                       # here (CPU): the rehearsal
    python -m gpu_check --verl --python PY --model HF_DIR      # a GPU machine, PY with verl[vllm]==0.9.1

The rehearsal writes the run's data (toy addition problems as verl's parquet, with extra_info.prompt_id), the peer's
groups into a store and serves it, composes verl's own config with the run's settings, builds GraftPPOTrainer from it
(verl's constructor: the refusals pass) and runs GRAFT's part of its set-up (the preflight: the store answers, the
peer tokenizers load), asks the store for the prompts' peer groups, and prints the command a GPU machine runs; it stops
before verl starts workers (vLLM rollouts need CUDA). The GPU run executes that command with PY, reads verl's file
logger and writes <run-dir>/verl_check.json and .md: per step, verl's reward, GRAFT's graft/ metrics and the splice's
time at the stage's batch (PROMPTS x GROUP rows). It passes only if every step's lookup was answered in time and some
step grafted (graft/frac_grafted > 0): a run that grafted nothing proves nothing of the splice or the weights (the
trainer itself raises at a step that grafted if the batch verl hands its actor lacks the weights' fields). PY needs
`pip install 'verl[vllm]==0.9.1' 'TransferQueue>=0.1.10,<0.2' cachetools` and this project (`pip install --no-deps -e
.` plus src/graft/integrations/verl/requirements.py's list)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
GROUP = 4
PROMPTS = 8
PEER_ID = "toy-peer"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **_) -> float:
    """verl's custom reward function: 1 when the completion's last \\boxed{} holds the answer (the toy task's reward)."""
    from graft.rollouts.scoring import extract_last_boxed

    return float(extract_last_boxed(solution_str) == str(ground_truth))


def prepare(run_dir: Path) -> dict:
    """The run's problems as verl's parquet and the peer's groups (another tokenizer: re-tokenised) in a store root."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from graft.rollouts.models import tokenizer_fingerprint
    from graft.services.store_api.local import write_groups
    from toy.models import build_tiny_model, save_model
    from toy.task import completion_text, sample_problems
    from toy.world import build_group, peer_tokenizer

    run_dir.mkdir(parents=True, exist_ok=True)
    problems = sample_problems(2 * PROMPTS, seed=5)
    rows = [{"data_source": "graft_toy", "prompt": [{"role": "user", "content": p.problem}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": p.answer},
             "extra_info": {"prompt_id": p.prompt_id, "index": i}} for i, p in enumerate(problems)]
    train = run_dir / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), train)
    tokenizer = peer_tokenizer()
    peer = build_tiny_model(tokenizer, "qwen3", hidden=64, seed=3).eval()
    peer_dir = save_model(peer, tokenizer, run_dir / "peer")
    groups = [build_group(p, [completion_text(p.answer), completion_text("0")] * (GROUP // 2), [1.0, 0.0] * (GROUP // 2),
                          tokenizer, peer, model_id=PEER_ID, tokenizer_id=tokenizer_fingerprint(tokenizer))
              for p in problems]
    store_root = run_dir / "store"
    write_groups(store_root, groups, problems)
    return {"train": train, "peer_dir": peer_dir, "store_root": store_root, "problems": problems}


def overrides(model: Path, store_url: str, prepared: dict, run_dir: Path) -> list[str]:
    """main_ppo's settings: the ones docs/verl.md names for GRAFT, and a small run's."""
    return [
        "trainer.v1.trainer_mode=graft_sync", "algorithm.adv_estimator=grpo",
        f"+graft.store_url={store_url}", f"+graft.peer_tokenizers=[{prepared['peer_dir']}]",
        "+graft.lookup_wait_s=30", "+graft.options.max_grafted_fraction=1.0",
        f"data.train_files={prepared['train']}", f"data.val_files={prepared['train']}",
        f"data.train_batch_size={PROMPTS}", "data.max_prompt_length=64", "data.max_response_length=32",
        f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n={GROUP}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # verl[vllm] brings no flash-attn
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        f"reward.custom_reward_function.path={Path(__file__).resolve()}", "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={STEPS}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.logger=[console,file]", "trainer.project_name=graft", "trainer.experiment_name=gpu-check-verl",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
    ]


def rehearse(run_dir: Path, model: Path, store_url: str, prepared: dict, settings: list[str]) -> dict:
    """What runs without a GPU: verl's config composed and GRAFT's trainer built from it, the store's answer."""
    import verl
    from hydra import compose, initialize_config_dir

    from graft.integrations.verl.trainer import GraftPPOTrainer
    from graft.schemas import PeerLookupRequest
    from graft.services.store_api.http.client import StoreClient

    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=settings)
    trainer = GraftPPOTrainer(config)
    trainer._init_tokenizer()
    host = trainer.graft_setup()  # what _setup runs first in verl's TaskRunner: the preflight, the peers' tokenizers
    request = PeerLookupRequest(prompt_ids=[p.prompt_id for p in prepared["problems"]], learner_model=model.name,
                                informative_only=True, min_successes=1)
    found = StoreClient(store_url).lookup_peer_groups(request)
    host.peers.close()
    return {"trainer": type(trainer).__name__, "trainer_mode_underneath": trainer.trainer_mode,
            "trainer_mode_logged": config.trainer.v1.trainer_mode, "peer_tokenizers": sorted(host.peer_tokenizers),
            "graft": trainer.graft_cfg.graft.model_dump(include={"kappa", "is_cap", "token_is", "max_grafted_fraction"}),
            "ppo": trainer.graft_cfg.ppo.model_dump(), "peer_groups_found": len(found.groups),
            "prompts": len(prepared["problems"])}


def read_steps(log_path: Path) -> list[dict]:
    """verl's file logger lines: per step, its reward and the graft/ metrics."""
    steps = []
    for line in log_path.read_text().splitlines():
        record = json.loads(line)
        data = record["data"]
        steps.append({"step": record["step"], "critic/score/mean": data.get("critic/score/mean"),
                      **{k: v for k, v in data.items() if k.startswith("graft/")}})
    return steps


def passed(returncode: int, steps: list[dict]) -> bool:
    """The run's verdict: main_ppo ran its STEPS steps, each grafting from an answered lookup, and some step grafted (a
    run that grafted nothing runs too, and proves nothing of the splice or the weights)."""
    answered = all("graft/frac_grafted" in step and step.get("graft/store_lookups_late") == 0
                   and step.get("graft/store_lookup_failures") == 0 for step in steps)
    grafted = any((step.get("graft/frac_grafted") or 0) > 0 for step in steps)
    return returncode == 0 and len(steps) == STEPS and answered and grafted


def run(dry_run: bool, python: str | None, model: Path | None, run_dir: Path, timeout_s: float = 1800.0) -> int:
    from graft.services.store_api.http.testing import StoreServer

    began = time.perf_counter()
    run_dir = run_dir.resolve()  # main_ppo's Ray workers read these paths from their own directories
    prepared = prepare(run_dir)
    if model is None:
        if not dry_run:
            raise SystemExit("--verl on a GPU needs --model: an HF model directory (e.g. SmolLM2-135M-Instruct)")
        from toy.world import cached_chat_model
        model = cached_chat_model()  # the rehearsal's stand-in: a toy chat model
    report: dict = {"dry_run": dry_run, "model": str(model)}
    with StoreServer(prepared["store_root"]) as store:
        settings = overrides(model, store.url, prepared, run_dir)
        command = [python or sys.executable, "-m", "verl.trainer.main_ppo", *settings]
        report["command"] = shlex.join(command)  # as a shell takes it: the overrides' brackets quoted
        if dry_run:
            report["rehearsal"] = rehearse(run_dir, model, store.url, prepared, settings)
            report["not_run"] = ("main_ppo: verl's rollouts are vLLM/SGLang servers (CUDA); this is the command a GPU "
                                 "machine runs, with --python PY that has verl[vllm]")
        else:
            log_path = run_dir / "verl_metrics.jsonl"
            env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(log_path),
                       VERL_USE_EXTERNAL_MODULES="graft.integrations.verl.plugin",  # a plugin that fails to load fails loudly
                       PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
            with open(run_dir / "main_ppo.log", "w") as log:
                proc = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
            report["returncode"] = proc.returncode
            report["steps"] = read_steps(log_path) if log_path.exists() else []
            # every step grafted from an answered lookup: a late store would make the steps GRPO and still "run"
            report["batch_rows"] = PROMPTS * GROUP
            report["splice_s_per_step"] = [step.get("graft/splice_s") for step in report["steps"]]
            report["ok"] = passed(proc.returncode, report["steps"])
    report["seconds"] = round(time.perf_counter() - began, 1)
    (run_dir / "verl_check.json").write_text(json.dumps(report, indent=2, default=str))
    columns = ["critic/score/mean", "graft/frac_all_fail", "graft/frac_grafted", "graft/compat_weight_mean",
               "graft/peer_rows_verdict_changed", "graft/store_lookups_late", "graft/splice_s", "graft/graft_s"]
    lines = [f"| step | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
    for step in report.get("steps", []):
        lines.append(f"| {step['step']} | " + " | ".join(str(step.get(name)) for name in columns) + " |")
    lines.append(f"\nsplice at {PROMPTS} prompts x {GROUP} rollouts = {PROMPTS * GROUP} rows per step")
    (run_dir / "verl_check.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(report, indent=2, default=str))
    return 0 if dry_run or report.get("ok") else 1
