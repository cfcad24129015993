"""The GRPO / GRAFT / DAPO training loop, top to bottom (GRAFT_SPEC.md).

One step:
  1. draw the step's prompts; start the batch peer lookup in the background (graft)
  2. sample G rollouts per prompt from the current policy and score them (dapo: refill)
  3. publish the groups to the store (co-training)
  4. gate: mixed / all-success groups train on-policy; all-fail groups take an informative peer
     group when one arrived (re-tokenised into the learner's tokens), else are skipped
  5. pi_old: a no-grad forward on every row with signal (or, with one update per step, the
     update's own forward, detached); compatibility weights w and token behaviour ratios b for
     grafted rows
  6. PPO epoch(s) over mini-batches (micro-batched), plus the optional supervised anchor
  7. metrics line, vLLM weight sync, checkpoint, evaluation
`train(cfg)` runs it in-process and returns the run directory.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import orjson
import torch
import yaml

from rollouts.datasets import load_problems
from rollouts.groups import assemble_group, make_group_id
from rollouts.models import (
    default_model_id,
    eos_token_ids,
    load_model_and_tokenizer,
    load_tokenizer_of,
    model_fingerprint,
    resolve_model_dir,
    tokenizer_fingerprint,
)
from rollouts.prompts import build_prompt
from rollouts.sampling import SamplingParams
from rollouts.scoring import Scorer
from schemas import Problem, RolloutGroup, group_advantages
from trainer.batch import TokenBatch, TrainSample, collate, response_logprobs
from trainer.checkpoint import latest_checkpoint, load_trainer_state, restore_rng_state, save_checkpoint
from trainer.config import TrainConfig
from trainer.gate import (
    GateDecision,
    behaviour_ratio,
    choose_peer_group,
    classify_group,
    compat_weights,
    effective_sample_size,
    gate_groups,
    group_normalize,
    peer_group_advantages,
)
from trainer.loss import LossBatch, LossConfig, agg_denominator, graft_loss
from trainer.retokenize import learner_stop_token, retokenize_peer_rollout

log = logging.getLogger("trainer")

# The keys every metrics line has (the list); more keys follow them.
METRIC_KEYS = (
    "step", "loss", "reward_mean", "frac_all_fail", "frac_all_success", "peer_hit_rate", "frac_grafted",
    "frac_skipped_no_signal", "frac_dropped_retokenize", "compat_weight_mean", "compat_weight_ess", "log_rho_p10",
    "log_rho_p50", "log_rho_p90", "clip_frac_onpolicy", "clip_frac_grafted", "peer_group_age_steps",
    "rollouts_generated", "peer_rollouts_consumed", "store_wait_s", "step_time_s",
)
WEIGHT_STAT_KEYS = (
    "compat_weight_mean", "compat_weight_ess", "log_rho_p10", "log_rho_p50", "log_rho_p90",
    # b = min(pi_old / mu~, C) over grafted tokens, and on each positive grafted row at the token the learner
    # finds least likely (where the peer's answer differs from the learner's habit): how much of the
    # peer's signal the token-level correction lets through where it matters.
    "behaviour_ratio_p50", "behaviour_ratio_hardest_p50",
)
NAN = float("nan")


@dataclass
class LoopState:
    """Everything besides weights, optimizer and RNG that a resumed run needs to continue exactly."""

    step: int = 0  # completed training steps (= policy step of the next rollouts)
    epoch: int = 0  # pass over the training problems
    cursor: int = 0  # position in this epoch's order
    grafted_prompts: list[str] = field(default_factory=list)  # prompts grafted in earlier steps (section 8)
    rollouts_generated_total: int = 0
    peer_rollouts_consumed_total: int = 0


class PromptStream:
    """The training problems in a seeded order per epoch; resumable from (epoch, cursor)."""

    def __init__(self, problems: list[Problem], seed: int, shuffle: bool, state: LoopState):
        self.problems, self.seed, self.shuffle, self.state = problems, seed, shuffle, state
        self._order = self._epoch_order(state.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[Problem]:
        taken = []
        while len(taken) < count:
            if self.state.cursor >= len(self._order):
                self.state.epoch += 1
                self.state.cursor = 0
                self._order = self._epoch_order(self.state.epoch)
            taken.append(self.problems[self._order[self.state.cursor]])
            self.state.cursor += 1
        return taken


@dataclass
class Learner:
    """The policy being trained and the identities its groups carry."""

    model: torch.nn.Module
    tokenizer: Any
    model_id: str
    tokenizer_id: str
    revision: str
    eos_ids: set[int]
    device: torch.device
    compute_dtype: torch.dtype = torch.float32  # forward passes run in it; the parameters stay float32
    # the token its own rollouts end with (retokenize.learner_stop_token), which grafted and anchor rows end with
    # too; None: the tokenizer's EOS
    stop_token_id: int | None = None

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for forward passes (sampling, pi_old, the update's forward and loss); backward runs outside."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)


def train(cfg: TrainConfig, resume: bool = False, on_step: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Run training as configured; returns the run directory (metrics.jsonl, checkpoints/, eval.jsonl).

    resume: continue from the newest checkpoint in cfg.run_dir. on_step: called with each step's
    metrics line after it is written (progress reporting in the demo, fault injection in tests)."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _setup_logging(run_dir)
    checkpoint = latest_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        log.warning("--resume: no checkpoint in %s, starting from the beginning", run_dir)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))

    if not cfg.logging.progress:  # transformers' own bars (loading, saving checkpoints) too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    torch.manual_seed(cfg.seed)
    learner = _load_learner(cfg, checkpoint)
    loss_cfg = LossConfig.from_train(cfg)
    params = [p for p in learner.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.adam_eps,
                                  weight_decay=cfg.optim.weight_decay)
    updates_per_step = cfg.optim.ppo_epochs * _num_mini_batches(cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg, cfg.steps * updates_per_step))
    reference = None
    if cfg.ppo.kl_beta > 0:  # the initial policy, frozen (loaded from the start checkpoint, also on resume)
        # frozen, so it needs no float32 master copy: kept in the compute dtype
        reference = _load_learner(cfg, None).model.requires_grad_(False).to(learner.compute_dtype)

    state = LoopState()
    if checkpoint is not None:
        saved = load_trainer_state(checkpoint)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        state = LoopState(**saved["loop"])
        restore_rng_state(saved["rng"])
        log.info("resumed from %s at step %d", checkpoint, state.step)

    problems = load_problems(cfg.data.dataset, limit=cfg.data.limit)
    if not problems:
        raise ValueError(f"data set {cfg.data.dataset!r} holds no problems")
    prompts = PromptStream(problems, cfg.seed, cfg.data.shuffle, state)
    anchors = _load_anchor(cfg)
    peer_tokenizers = _load_peer_tokenizers(cfg)
    # Peer groups whose text the learner can weigh: its own tokenizer's and those of the configured peer tokenizers
    # (None: any, the uniform projection opted in); the others are refused at the gate, with one warning per id.
    usable_tokenizers = None if cfg.graft.uniform_projection else {learner.tokenizer_id, *peer_tokenizers}
    warned_tokenizers: set[str] = set()
    backend, uses_vllm = _make_backend(cfg, learner, checkpoint or cfg.model.path)
    scorer = Scorer(num_workers=cfg.rollout.scorer_workers, timeout_s=cfg.rollout.scorer_timeout_s)
    peers = None
    if cfg.method == "graft" or cfg.publishes:
        from trainer.peers import PeerExchange

        peers = PeerExchange(cfg.store, cfg.graft, learner.model_id)
    metrics_path = run_dir / "metrics.jsonl"
    _truncate_metrics(metrics_path, state.step)
    _truncate_metrics(run_dir / "eval.jsonl", state.step)
    tb = _tensorboard(cfg, run_dir)
    grafted_before: set[str] = set(state.grafted_prompts)
    previous_counters = asdict(peers.counters) if peers else {}

    from tqdm import tqdm

    progress = tqdm(total=cfg.steps, initial=state.step, disable=not cfg.logging.progress, desc=cfg.method, unit="step")
    try:
        while state.step < cfg.steps:
            step_start, step_cpu_start = time.perf_counter(), time.process_time()
            policy_step = state.step
            counts: dict[str, float] = {}

            # 1. prompts, and the peer lookup for all of them in the background
            step_problems = prompts.take(cfg.rollout.prompts_per_step)
            pending = None
            if cfg.method == "graft":
                pending = peers.start_lookup([p.prompt_id for p in step_problems], policy_step)

            # 2. learner rollouts (dapo: drop zero-variance groups and refill up to the round budget)
            generation_start = time.perf_counter()
            groups = _generate_groups(cfg, backend, scorer, learner, step_problems, policy_step, round_index=0)
            generated = list(groups)
            if cfg.method == "dapo":
                groups = [g for g in groups if 0 < g.successes < len(g.rollouts)]
                rounds = 1
                while len(groups) < cfg.rollout.prompts_per_step and rounds < cfg.dapo.max_generation_rounds:
                    refill = prompts.take(cfg.rollout.prompts_per_step - len(groups))
                    step_problems += refill
                    more = _generate_groups(cfg, backend, scorer, learner, refill, policy_step, round_index=rounds)
                    generated += more
                    groups += [g for g in more if 0 < g.successes < len(g.rollouts)]
                    rounds += 1
                counts["dapo_rounds"] = rounds
                counts["dapo_groups_kept"] = len(groups)
            generation_s = time.perf_counter() - generation_start
            problem_of = {p.prompt_id: p for p in step_problems}

            # 3. co-training: publish every sampled group
            if peers is not None and cfg.publishes:
                peers.publish(generated, [problem_of[g.prompt_id] for g in generated])

            # 4. the gate
            gate_start = time.perf_counter()
            store_wait = 0.0
            peer_candidates: dict[str, list[RolloutGroup]] = {}
            learner_rewards = [(g.prompt_id, [r.reward for r in g.rollouts]) for g in groups]
            if cfg.method == "graft":
                wait_start = time.perf_counter()
                cotrain = cfg.store.mode == "cotrain"
                lookup = peers.collect(pending, wait_s=cfg.store.cotrain_wait_s if cotrain else 0.0)
                peer_candidates = dict(lookup.groups)
                counts["peer_lookup_ok"] = float(lookup.ok)
                if cotrain:
                    all_fail = [g.prompt_id for g in groups if not any((r.reward or 0) > 0 for r in g.rollouts)]
                    missing = [p for p in all_fail if not _has_usable_peer(
                        peer_candidates.get(p, []), cfg, learner, policy_step, usable_tokenizers)]
                    if missing:
                        deadline = wait_start + cfg.store.cotrain_wait_s
                        peer_candidates.update(peers.wait_for_peers(missing, policy_step, deadline))
                store_wait = time.perf_counter() - wait_start
            lag = cfg.graft.max_peer_policy_lag
            decisions = gate_groups(
                learner_rewards, peer_candidates, enabled=cfg.method == "graft", learner_model=learner.model_id,
                peer_models=cfg.graft.peer_models,
                min_policy_step=max(0, policy_step - lag) if lag is not None else None,
                union_all_success=cfg.graft.union_all_success, max_grafted_fraction=cfg.graft.max_grafted_fraction,
                rng=random.Random(cfg.seed * 7_919 + policy_step), usable_tokenizers=usable_tokenizers,
            )
            _warn_refused_tokenizers(decisions, peer_candidates, usable_tokenizers, warned_tokenizers)

            # 4b. the batch: on-policy rows and re-tokenised peer rows
            rows, peer_groups_used, drops = _build_rows(
                cfg, learner, decisions, groups, problem_of, peer_tokenizers, counts
            )

            gate_s = time.perf_counter() - gate_start

            # 5. pi_old (and pi_ref) on every row with signal; weights of grafted rows
            update_start = time.perf_counter()
            first_pass = _single_pass_forward(cfg, learner, rows)
            rows, weight_stats = _attach_old_logprobs_and_weights(cfg, learner, reference, rows, drops, first_pass)
            counts.update(weight_stats)

            # 6. PPO epoch(s) over mini-batches
            update_metrics = _update_policy(
                cfg, loss_cfg, learner, reference, optimizer, scheduler, rows, anchors, policy_step, first_pass
            )
            update_s = time.perf_counter() - update_start
            if uses_vllm:  # the engine samples the next step with the new weights
                from trainer.vllm_sync import sync_weights

                sync_start = time.perf_counter()
                sync_weights(backend, learner.model)
                counts["weight_sync_s"] = time.perf_counter() - sync_start

            # 7. metrics
            state.step += 1
            rewards = [r.reward or 0.0 for g in generated for r in g.rollouts]
            n_groups = max(len(decisions), 1)
            # Kinds over every group sampled this step (dapo: before dropping zero-variance ones).
            kinds = [classify_group([r.reward for r in g.rollouts]) for g in generated]
            all_fail = [d for d in decisions if d.kind == "all_fail"]
            grafted = [d for d in decisions if d.action in ("graft", "graft_union")]
            hits = [d for d in all_fail if d.peer_group is not None and d.peer_group.informative]
            skipped = [d for d in decisions if d.action.startswith("skip_")]
            previously = [r.reward or 0.0 for g in generated if g.prompt_id in grafted_before for r in g.rollouts]
            grafted_before.update(d.prompt_id for d in grafted)
            peer_rollouts_consumed = sum(1 for row in rows if row.grafted)
            peer_samples_considered = sum(len(g.rollouts) for g in peer_groups_used)
            ages = [policy_step - d.peer_group.policy_step for d in grafted]
            ages_s = [time.time() - d.peer_group.rollouts[0].created_at.timestamp() for d in grafted]
            state.rollouts_generated_total += sum(len(g.rollouts) for g in generated)
            state.peer_rollouts_consumed_total += peer_rollouts_consumed
            state.grafted_prompts = sorted(grafted_before)
            metrics: dict[str, Any] = {
                "step": state.step,
                "loss": update_metrics.pop("loss"),
                "reward_mean": _mean(rewards),
                "frac_all_fail": kinds.count("all_fail") / max(len(kinds), 1),
                "frac_all_success": kinds.count("all_success") / max(len(kinds), 1),
                "frac_mixed": kinds.count("mixed") / max(len(kinds), 1),
                "peer_hit_rate": len(hits) / len(all_fail) if all_fail and cfg.method == "graft" else NAN,
                "frac_grafted": len(grafted) / n_groups,
                "frac_skipped_no_signal": len(skipped) / n_groups,
                "frac_dropped_retokenize": sum(drops.values()) / max(peer_samples_considered, 1),
                **{k: counts.pop(k) for k in WEIGHT_STAT_KEYS},
                "clip_frac_onpolicy": update_metrics.pop("clip_frac_onpolicy"),
                "clip_frac_grafted": update_metrics.pop("clip_frac_grafted"),
                "peer_group_age_steps": _mean(ages),
                "peer_group_age_s": _mean(ages_s),
                "rollouts_generated": sum(len(g.rollouts) for g in generated),
                "peer_rollouts_consumed": peer_rollouts_consumed,
                "store_wait_s": store_wait,
                "step_time_s": time.perf_counter() - step_start,
                "step_cpu_s": time.process_time() - step_cpu_start,  # this process, all threads (not the scorer's)
                "generation_s": generation_s,
                "gate_s": gate_s,
                "update_s": update_s,
                "reward_previously_grafted": _mean(previously),
                "groups_capped": sum(1 for d in decisions if d.action == "skip_capped"),
                "groups_no_peer": sum(1 for d in decisions if d.action == "skip_no_peer"),
                "groups_peer_uninformative": sum(1 for d in decisions if d.action == "skip_uninformative"),
                "groups_no_peer_tokenizer": sum(1 for d in decisions if d.action == "skip_no_peer_tokenizer"),
                **{f"dropped_{reason}": count for reason, count in drops.items()},
                "rollouts_generated_total": state.rollouts_generated_total,
                "peer_rollouts_consumed_total": state.peer_rollouts_consumed_total,
                "lr": scheduler.get_last_lr()[0],
                **update_metrics,
                **counts,
            }
            if peers is not None:
                now = asdict(peers.counters)
                metrics.update({f"store_{k}": v - previous_counters.get(k, 0) for k, v in now.items()})
                metrics["store_available"] = float(peers.available)
                previous_counters = now
            _append_metrics(metrics_path, metrics)
            if tb is not None:
                for key, value in metrics.items():
                    if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                        tb.add_scalar(key, value, state.step)
            progress.update(1)
            if on_step is not None:
                on_step(metrics)
            progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}", grafted=f"{metrics['frac_grafted']:.2f}",
                                 loss=f"{metrics['loss']:.4f}")

            last = state.step == cfg.steps
            if (cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0) or last:
                save_checkpoint(run_dir, state.step, learner.model, learner.tokenizer, optimizer, scheduler,
                                asdict(state), cfg.checkpoint.keep_last)
            if cfg.eval.every_steps and cfg.eval.benchmarks and (state.step % cfg.eval.every_steps == 0 or last):
                with learner.autocast():
                    _evaluate(cfg, backend, scorer, run_dir, state.step)
    finally:
        progress.close()
        if peers is not None:
            if cfg.publishes and not peers.flush(timeout_s=cfg.store.timeout_s):
                log.warning("%d sampled groups could not be published before exit", peers.outbox_size)
            peers.close()
        if tb is not None:
            tb.close()
        close = getattr(scorer, "close", None)
        if close is not None:
            close()
    return run_dir


# ---- setup ---------------------------------------------------------------------------------------

def _setup_logging(run_dir: Path) -> None:
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("trainer", "trainer.peers"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.handlers = [h for h in logger.handlers if not isinstance(h, logging.FileHandler)] + [handler]


def _resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def _load_learner(cfg: TrainConfig, checkpoint: Path | None) -> Learner:
    # float32 master weights whatever the compute dtype (mixed precision through Learner.autocast)
    model, tokenizer = load_model_and_tokenizer(checkpoint or cfg.model.path, dtype=torch.float32)
    device = _resolve_device(cfg.model.device)
    # Dropout off: the policy that samples must be the one whose logprobs are trained on.
    model.to(device).eval()
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer of {cfg.model.path} has no eos_token; set one in its tokenizer_config.json")
    eos_ids = eos_token_ids(model, tokenizer)
    return Learner(
        model=model,
        tokenizer=tokenizer,
        model_id=cfg.model.model_id or default_model_id(cfg.model.path),
        tokenizer_id=cfg.model.tokenizer_id or tokenizer_fingerprint(tokenizer),
        revision=cfg.model.revision or model_fingerprint(resolve_model_dir(cfg.model.path)),
        eos_ids=eos_ids,
        device=device,
        compute_dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype],
        stop_token_id=learner_stop_token(tokenizer, eos_ids, cfg.data.prompt_template),
    )


def _num_mini_batches(cfg: TrainConfig) -> int:
    return max(1, round(cfg.rollout.prompts_per_step / cfg.optim.mini_batch_prompts))


def _lr_lambda(cfg: TrainConfig, total_updates: int):
    warmup, schedule = cfg.optim.warmup_steps, cfg.optim.schedule

    def factor(update: int) -> float:
        if warmup and update < warmup:
            return (update + 1) / warmup
        if schedule == "cosine":
            progress = (update - warmup) / max(1, total_updates - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return factor


def _load_anchor(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(problem, reference completion) pairs of the supervised anchor, or [] when it is off."""
    if cfg.anchor.dataset is None:
        return []
    path = Path(cfg.anchor.dataset)
    if not path.is_file():
        raise FileNotFoundError(
            f"anchor.dataset {path} does not exist: pass a JSONL file with 'problem' and 'completion' fields"
        )
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = orjson.loads(line)
        if not isinstance(row.get("problem"), str) or not isinstance(row.get("completion"), str):
            raise ValueError(f"{path}:{number}: an anchor row needs string fields 'problem' and 'completion'")
        pairs.append((row["problem"], row["completion"]))
    if not pairs:
        raise ValueError(f"anchor.dataset {path} holds no rows")
    return pairs


def _load_peer_tokenizers(cfg: TrainConfig) -> dict[str, Any]:
    """Peer tokenizers by the tokenizer_id their stored rows carry, loaded as the generator loads them.

    graft.peer_tokenizers maps ids to directories, or lists directories whose fingerprints (the id the
    generator and the trainer store unless told otherwise) are their ids."""
    entries = cfg.graft.peer_tokenizers
    pairs = list(entries.items()) if isinstance(entries, dict) else [(None, path) for path in entries]
    found = {}
    for tokenizer_id, path in pairs:
        if not Path(path).exists():
            raise FileNotFoundError(
                f"graft.peer_tokenizers: {path} does not exist; pass the peer model's (or tokenizer's) directory"
            )
        tokenizer = load_tokenizer_of(path)
        fingerprint = tokenizer_fingerprint(tokenizer)
        if tokenizer_id is not None and tokenizer_id.startswith("tok-") and tokenizer_id != fingerprint:
            log.warning("graft.peer_tokenizers maps %s to %s, whose fingerprint is %s: if the peer sampled with another "
                        "tokenizer, its rows will not decode (counted as dropped_peer_decode)", tokenizer_id, path,
                        fingerprint)
        found[tokenizer_id or fingerprint] = tokenizer
    return found


def _warn_refused_tokenizers(
    decisions: list[GateDecision], peer_candidates: dict[str, list[RolloutGroup]], usable: set[str] | None,
    warned: set[str],
) -> None:
    """One warning per tokenizer id whose peer groups the gate refused for want of the peer's tokenizer."""
    if usable is None:
        return
    refused: dict[str, set[str]] = {}  # tokenizer id -> the models that sampled in it
    for decision in decisions:
        if decision.action == "skip_no_peer_tokenizer":
            for group in peer_candidates.get(decision.prompt_id, []):
                refused.setdefault(group.rollouts[0].tokenizer_id, set()).add(group.model_id)
    for tokenizer_id, models in sorted(refused.items()):
        if tokenizer_id in usable or tokenizer_id in warned:
            continue
        warned.add(tokenizer_id)
        log.warning(
            "peer groups of %s are in tokenizer %r, for which this trainer has no tokenizer: they are refused "
            "(counted as groups_no_peer_tokenizer). Map that id to the peer's tokenizer or model directory: "
            "graft.peer_tokenizers: {%s: /path/to/peer} (or opt in to graft.uniform_projection, which spreads the "
            "peer's logprobs evenly over characters)", ", ".join(sorted(models)), tokenizer_id, tokenizer_id,
        )


def _make_backend(cfg: TrainConfig, learner: Learner, weights_path: str | Path) -> tuple[Any, bool]:
    """The learner's sampler and whether it is a vLLM engine (which needs weight syncs)."""
    on_gpu = learner.device.type == "cuda"
    use_vllm = cfg.rollout.backend == "vllm" or (cfg.rollout.backend == "auto" and on_gpu and _vllm_installed())
    if use_vllm:
        from trainer.vllm_sync import make_vllm_backend

        return make_vllm_backend(cfg, learner, weights_path), True
    from rollouts.hf_backend import HFBackend

    backend = HFBackend(learner.model, learner.tokenizer, learner.model_id, tokenizer_id=learner.tokenizer_id,
                        batch_size=cfg.rollout.generation_batch_size)
    return backend, False


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _tensorboard(cfg: TrainConfig, run_dir: Path):
    if not cfg.logging.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise RuntimeError(
            "logging.tensorboard is on but tensorboard is not installed: pip install tensorboard"
        ) from error
    return SummaryWriter(str(run_dir / "tb"))


# ---- rollouts ------------------------------------------------------------------------------------

def _sampling_params(cfg: TrainConfig, policy_step: int, round_index: int) -> SamplingParams:
    # A seed per (run seed, step, round): a resumed run samples exactly what the uninterrupted one did.
    seed = (cfg.seed * 1_000_003 + policy_step * 101 + round_index) % 2**31
    return SamplingParams(n=cfg.rollout.group_size, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                          top_k=cfg.rollout.top_k, max_tokens=cfg.rollout.max_response_tokens, seed=seed)


def _generate_groups(
    cfg: TrainConfig, backend, scorer, learner: Learner, problems: list[Problem], policy_step: int, round_index: int
) -> list[RolloutGroup]:
    """G rollouts per problem from the current policy, scored and assembled into stored-format groups."""
    params = _sampling_params(cfg, policy_step, round_index)
    prompts = [build_prompt(learner.tokenizer, p.problem, cfg.data.prompt_template) for p in problems]
    with learner.autocast():
        samples = backend.generate(prompts, params)  # one list of G samples per prompt
    completions = [s.text for per_prompt in samples for s in per_prompt]
    golds = [p.answer for p, per_prompt in zip(problems, samples) for _ in per_prompt]
    scores = scorer.score(completions, golds)
    groups, offset = [], 0
    for index, (problem, per_prompt) in enumerate(zip(problems, samples)):
        group_scores = scores[offset : offset + len(per_prompt)]
        offset += len(per_prompt)
        # The seed is part of the key: two runs of one checkpoint with different seeds publish different groups.
        group_id = make_group_id(learner.model_id, f"{learner.revision}/seed={cfg.seed}", policy_step,
                                 problem.prompt_id, round_index * 1_000_000 + index)
        groups.append(assemble_group(
            problem, per_prompt, group_scores, model_id=learner.model_id, model_revision=learner.revision,
            tokenizer_id=learner.tokenizer_id, policy_step=policy_step, generator_id=f"graft-train:{cfg.run_dir.name}",
            params=params, eos_token_ids=learner.eos_ids, group_id=group_id, std_normalize=cfg.ppo.advantage == "grpo",
        ))
    return groups


def _has_usable_peer(
    candidates: list[RolloutGroup], cfg: TrainConfig, learner: Learner, policy_step: int, usable_tokenizers: set[str] | None
) -> bool:
    """Whether the gate would graft one of `candidates` (the co-training wait ends for a prompt when it would)."""
    lag = cfg.graft.max_peer_policy_lag
    _, action = choose_peer_group(
        candidates, learner.model_id, cfg.graft.peer_models, max(0, policy_step - lag) if lag is not None else None,
        cfg.graft.union_all_success, usable_tokenizers,
    )
    return action in ("graft", "graft_union")


# ---- the batch -----------------------------------------------------------------------------------

def _build_rows(
    cfg: TrainConfig,
    learner: Learner,
    decisions: list[GateDecision],
    groups: list[RolloutGroup],
    problem_of: dict[str, Problem],
    peer_tokenizers: dict[str, Any],
    counts: dict[str, float],
) -> tuple[list[TrainSample], list[RolloutGroup], dict[str, int]]:
    """TrainSamples for the step: learner rows (on-policy, skipped with zero advantage) and peer rows.

    Skipped all-fail groups stay in the batch with zero advantage, exactly as GRPO has them: they
    add no gradient but count in the token-mean denominator, so GRAFT without peers is GRPO."""
    std_normalize = cfg.ppo.advantage == "grpo"
    prompt_ids_of: dict[str, list[int]] = {}
    rows: list[TrainSample] = []
    peer_groups_used: list[RolloutGroup] = []
    drops = {"round_trip": 0, "overlength": 0, "non_finite": 0, "peer_decode": 0}
    projections = {"exact": 0, "spans": 0, "uniform": 0}
    mismatched_advantages = 0
    not_canonical = 0  # same-tokenizer rows whose text does not re-tokenise to the stored ids

    def prompt_tokens(prompt_id: str) -> list[int]:
        if prompt_id not in prompt_ids_of:
            text = build_prompt(learner.tokenizer, problem_of[prompt_id].problem, cfg.data.prompt_template)
            # The template already holds any BOS: no special tokens added here (as the backends do).
            prompt_ids_of[prompt_id] = list(learner.tokenizer(text, add_special_tokens=False)["input_ids"])
        return prompt_ids_of[prompt_id]

    def learner_row(rollout, advantage: float, group_index: int) -> TrainSample:
        ids = list(rollout.completion_token_ids)
        finished_with_eos = rollout.finish_reason == "stop" and bool(ids) and ids[-1] in learner.eos_ids
        return TrainSample(prompt_id=rollout.prompt_id, group=group_index, prompt_ids=prompt_tokens(rollout.prompt_id),
                           completion_ids=ids, num_content_tokens=len(ids) - int(finished_with_eos),
                           advantage=advantage, grafted=False, num_bytes=rollout.num_bytes)

    for group_index, (decision, own) in enumerate(zip(decisions, groups, strict=True)):
        if decision.action not in ("graft", "graft_union"):
            advantages = group_advantages([r.reward for r in own.rollouts], std_normalize=std_normalize)
            rows.extend(learner_row(r, a, group_index) for r, a in zip(own.rollouts, advantages))
            continue
        peer = decision.peer_group
        peer_groups_used.append(peer)
        if decision.action == "graft":
            peer_rollouts = list(peer.rollouts)
            peer_advantages, agrees = peer_group_advantages(peer, std_normalize=std_normalize)
            mismatched_advantages += int(not agrees)
        else:  # union: the learner's failures and the peer's successes form one group
            peer_rollouts = [r for r in peer.rollouts if r.correct]
            union_rewards = [r.reward for r in own.rollouts] + [r.reward for r in peer_rollouts]
            union = group_advantages(union_rewards, std_normalize=std_normalize)
            rows.extend(learner_row(r, a, group_index) for r, a in zip(own.rollouts, union[: len(own.rollouts)]))
            peer_advantages = union[len(own.rollouts):]
        for rollout, advantage in zip(peer_rollouts, peer_advantages):
            out = retokenize_peer_rollout(
                rollout, learner.tokenizer, learner.tokenizer_id, cfg.rollout.max_response_tokens,
                peer_tokenizers.get(rollout.tokenizer_id), stop_token_id=learner.stop_token_id,
                uniform_projection=cfg.graft.uniform_projection,
            )
            if isinstance(out, str):
                drops[out] += 1
                continue
            projections[out.projection] += 1
            not_canonical += int(not out.canonical)
            if advantage < 0:
                advantage *= cfg.graft.peer_negative_scale
            rows.append(TrainSample(
                prompt_id=decision.prompt_id, group=group_index, prompt_ids=prompt_tokens(decision.prompt_id),
                completion_ids=out.token_ids, num_content_tokens=out.num_content_tokens, advantage=advantage,
                grafted=True, num_bytes=len(rollout.completion_text.encode("utf-8")),
                behaviour_logprobs=out.behaviour_logprobs, peer_logprob_sum=float(rollout.logprob_sum),
            ))
    counts.update({f"projection_{k}": v for k, v in projections.items()})
    counts["peer_advantage_mismatch"] = mismatched_advantages
    counts["same_tokenizer_id_mismatch"] = not_canonical
    return rows, peer_groups_used, drops


def _needs_forward(row: TrainSample, cfg: TrainConfig) -> bool:
    """Rows with zero advantage add nothing to the loss (unless a KL is on); with
    optim.skip_zero_advantage they get no forward pass (they still count in the normaliser).
    Grafted rows under graft.group_normalized_weight always get one: their w is part of their
    group's mean, which must not depend on that speed switch."""
    return (not cfg.optim.skip_zero_advantage or row.advantage != 0.0 or cfg.ppo.kl_beta > 0
            or (row.grafted and cfg.graft.group_normalized_weight))


@torch.no_grad()
def _forward_logprobs(
    model: torch.nn.Module, rows: list[TrainSample], learner: Learner, micro: int, temperature: float
) -> list[torch.Tensor]:
    """Per row (n_i,) float32 logprobs of its completion tokens, computed in micro-batches."""
    out: list[torch.Tensor] = []
    for begin in range(0, len(rows), micro):
        chunk = rows[begin : begin + micro]
        batch = collate(chunk, learner.tokenizer.pad_token_id).to(learner.device)
        with learner.autocast():
            logprobs = response_logprobs(model, batch, temperature).cpu()  # (b, T)
        out.extend(logprobs[i, : len(row.completion_ids)] for i, row in enumerate(chunk))
    return out


@dataclass
class FirstPass:
    """The update's own forward pass, taken before pi_old is needed (see `_single_pass_forward`)."""

    rows: list[TrainSample]  # the rows with signal, in the order of `logprobs`
    tokens: TokenBatch
    logprobs: torch.Tensor  # (b, T) with grad

    def select(self, chunk: list[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs with grad, mask) of `chunk`'s rows, in its order."""
        position = {id(row): i for i, row in enumerate(self.rows)}
        index = torch.tensor([position[id(row)] for row in chunk], device=self.logprobs.device)
        return self.logprobs.index_select(0, index), self.tokens.mask.index_select(0, index)


def _single_pass_forward(cfg: TrainConfig, learner: Learner, rows: list[TrainSample]) -> FirstPass | None:
    """With one PPO epoch of one mini-batch that fits one micro-batch, the update's forward pass runs on
    exactly the weights that pi_old is defined by (ratio 1): one forward with grad serves both, as verl
    does, and the separate no-grad pass is skipped. None otherwise (several updates per step need pi_old
    frozen before the first)."""
    active = [row for row in rows if _needs_forward(row, cfg)]
    if cfg.optim.ppo_epochs != 1 or _num_mini_batches(cfg) != 1 or not active or len(active) > cfg.optim.micro_batch_size:
        return None
    tokens = collate(active, learner.tokenizer.pad_token_id).to(learner.device)
    with learner.autocast():
        logprobs = response_logprobs(learner.model, tokens, cfg.rollout.temperature)  # (b, T) float32, with grad
    return FirstPass(active, tokens, logprobs)


def _attach_old_logprobs_and_weights(
    cfg, learner: Learner, reference, rows: list[TrainSample], drops: dict[str, int], first_pass: FirstPass | None = None
):
    """pi_old (and pi_ref) for every row with signal; token weights c = w*b on grafted rows.

    Returns the rows kept (grafted rows with non-finite values are dropped and counted) and the
    weight statistics of the step."""
    if first_pass is not None:  # its rows are the ones with signal, in the order of its logprobs
        active = first_pass.rows
        detached = first_pass.logprobs.detach().cpu()  # (b, T)
        old = [detached[i, : len(row.completion_ids)] for i, row in enumerate(active)]
    else:
        active = [row for row in rows if _needs_forward(row, cfg)]
        old = _forward_logprobs(learner.model, active, learner, cfg.optim.micro_batch_size, cfg.rollout.temperature)
    refs: list[torch.Tensor | None] = [None] * len(active)
    if reference is not None:
        # at the rollout temperature, as the policy's: the KL compares the two distributions the loss sees
        refs = _forward_logprobs(reference, active, learner, cfg.optim.micro_batch_size, cfg.rollout.temperature)
    for row, old_lp, ref_lp in zip(active, old, refs):
        row.old_logprobs, row.ref_logprobs = old_lp, ref_lp
        row.token_weight = torch.ones_like(old_lp)

    grafted = [row for row in active if row.grafted]
    stats = dict.fromkeys(WEIGHT_STAT_KEYS, NAN)
    if grafted:
        # l_old: the learner's log-likelihood of the text, EOS excluded
        learner_sums = torch.stack([r.old_logprobs[: r.num_content_tokens].double().sum() for r in grafted])  # (g,)
        peer_sums = torch.tensor([row.peer_logprob_sum for row in grafted], dtype=torch.float64)  # (g,)
        num_bytes = torch.tensor([row.num_bytes for row in grafted])  # (g,)
        weights, log_rho = compat_weights(learner_sums, peer_sums, num_bytes, cfg.graft.kappa, cfg.graft.log_rho_min)
        if cfg.graft.group_normalized_weight:
            weights = group_normalize(weights, torch.tensor([row.group for row in grafted]))
        finite = torch.isfinite(learner_sums) & torch.isfinite(weights)
        ratios: list[torch.Tensor] = []
        hardest: list[float] = []
        for row, w, ok in zip(grafted, weights.tolist(), finite.tolist()):
            row.compat_weight = w
            row.finite = bool(ok) and bool(torch.isfinite(row.old_logprobs).all())
            # b, the token-level correction, exists under tis only (luffy's shaping replaces the PPO ratio and needs
            # no peer probabilities); the sequence weight w applies under every token_is, as kappa etc. say.
            b = torch.ones_like(row.old_logprobs)  # (n,)
            if cfg.graft.token_is == "tis":
                behaviour = torch.tensor(row.behaviour_logprobs, dtype=torch.float32)  # (n,) log mu~
                b = behaviour_ratio(row.old_logprobs, behaviour, cfg.graft.is_cap)
                if row.finite:
                    ratios.append(b)
                    if row.advantage > 0 and row.num_content_tokens > 0:
                        hardest.append(float(b[int(torch.argmin(row.old_logprobs[: row.num_content_tokens]))]))
            row.token_weight = cfg.graft.peer_loss_scale * w * b  # (n,)
        kept_weights = weights[finite]
        kept_log_rho = log_rho[finite]
        if kept_weights.numel():
            levels = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
            quantiles = torch.quantile(kept_log_rho.double(), levels).tolist()
            stats = {
                "compat_weight_mean": float(kept_weights.mean()),
                "compat_weight_ess": effective_sample_size(kept_weights),
                "log_rho_p10": quantiles[0], "log_rho_p50": quantiles[1], "log_rho_p90": quantiles[2],
                "behaviour_ratio_p50": float(torch.cat(ratios).median()) if ratios else NAN,
                "behaviour_ratio_hardest_p50": float(torch.tensor(hardest).median()) if hardest else NAN,
            }
    kept = []
    for row in rows:
        if row.grafted and not row.finite:
            drops["non_finite"] += 1
            continue
        kept.append(row)
    return kept, stats


# ---- the update ----------------------------------------------------------------------------------

def _pad(values: list[torch.Tensor], width: int, fill: float = 0.0) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into (b, width)."""
    out = torch.full((len(values), width), fill, dtype=torch.float32)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def _length_mask(rows: list[TrainSample]) -> torch.Tensor:
    lengths = torch.tensor([len(r.completion_ids) for r in rows])  # (b,)
    return torch.arange(max(int(lengths.max()), 1))[None, :] < lengths[:, None]  # (b, T) bool


def _update_policy(
    cfg: TrainConfig,
    loss_cfg: LossConfig,
    learner: Learner,
    reference: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    rows: list[TrainSample],
    anchors: list[tuple[str, str]],
    policy_step: int,
    first_pass: FirstPass | None = None,
) -> dict[str, float]:
    """PPO epoch(s) over mini-batches of the step's rows; returns averaged loss metrics. With `first_pass`
    (one epoch, one mini-batch, one micro-batch) its logprobs are the update's: no second forward."""
    generator = torch.Generator().manual_seed(cfg.seed * 31_337 + policy_step)
    num_mini = _num_mini_batches(cfg)
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    anchor_rng = random.Random(cfg.seed * 65_537 + policy_step)
    anchor_rows = _anchor_rows(cfg, learner, anchors, anchor_rng) if anchors else []
    updates = skipped = 0
    grad_norms = []

    def accumulate(name: str, value: float, weight: float) -> None:
        if weight > 0 and math.isfinite(value):
            totals[name] = totals.get(name, 0.0) + value * weight
            weights[name] = weights.get(name, 0.0) + weight

    for _ in range(cfg.optim.ppo_epochs):
        order = torch.randperm(len(rows), generator=generator).tolist() if rows else []
        for mini_index in range(num_mini):
            mini = [rows[i] for i in order[mini_index::num_mini]]
            active = [row for row in mini if _needs_forward(row, cfg)]
            if not active and not anchor_rows:
                skipped += 1
                continue
            optimizer.zero_grad(set_to_none=True)
            denominator = agg_denominator(_length_mask(mini), loss_cfg) if mini else 1.0
            mini_loss = 0.0
            for begin in range(0, len(active), cfg.optim.micro_batch_size):
                chunk = active[begin : begin + cfg.optim.micro_batch_size]
                if first_pass is not None:
                    logprobs, mask = first_pass.select(chunk)  # (b, T), with grad
                else:
                    tokens = collate(chunk, learner.tokenizer.pad_token_id).to(learner.device)
                    with learner.autocast():
                        logprobs = response_logprobs(learner.model, tokens, cfg.rollout.temperature)
                    mask = tokens.mask
                width = logprobs.shape[1]
                batch = LossBatch(
                    logprobs=logprobs,
                    old_logprobs=_pad([r.old_logprobs for r in chunk], width).to(learner.device),
                    advantages=torch.tensor([r.advantage for r in chunk], dtype=torch.float32, device=learner.device),
                    mask=mask,
                    token_weight=_pad([r.token_weight for r in chunk], width).to(learner.device),
                    is_grafted=torch.tensor([r.grafted for r in chunk], dtype=torch.bool, device=learner.device),
                    ref_logprobs=None if reference is None else _pad([r.ref_logprobs for r in chunk], width).to(
                        learner.device),
                )
                loss, metrics = graft_loss(batch, loss_cfg)
                micro_denominator = agg_denominator(mask, loss_cfg)
                # the micro-batches' losses add up to the mini-batch's (a mini-batch without a token has none)
                scale = micro_denominator / denominator if denominator else 0.0
                (loss * scale).backward()
                mini_loss += float(loss.detach()) * scale
                accumulate("clip_frac_onpolicy", metrics["clip_frac_onpolicy"], metrics["tokens_onpolicy"])
                accumulate("clip_frac_grafted", metrics["clip_frac_grafted"], metrics["tokens_grafted"])
                accumulate("ratio_mean", metrics["ratio_mean"], metrics["tokens_onpolicy"] + metrics["tokens_grafted"])
                accumulate("kl", metrics["kl"], micro_denominator)
            if anchor_rows:
                nll = _anchor_nll(learner, anchor_rows)
                (cfg.anchor.weight * nll).backward()
                accumulate("anchor_nll", float(nll.detach()), 1.0)
                mini_loss += cfg.anchor.weight * float(nll.detach())
            if cfg.optim.grad_clip is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(learner.model.parameters(), cfg.optim.grad_clip)
            else:
                grad_norm = torch.linalg.vector_norm(
                    torch.stack([p.grad.norm() for p in learner.model.parameters() if p.grad is not None])
                )
            grad_norms.append(float(grad_norm))
            optimizer.step()
            scheduler.step()
            updates += 1
            accumulate("loss", mini_loss, 1.0)
    optimizer.zero_grad(set_to_none=True)
    result = {name: totals[name] / weights[name] for name in totals}
    result.setdefault("loss", 0.0)
    for name in ("clip_frac_onpolicy", "clip_frac_grafted", "ratio_mean", "kl"):
        result.setdefault(name, NAN)
    if anchor_rows:
        result.setdefault("anchor_nll", NAN)
    result["grad_norm"] = _mean(grad_norms)
    result["optimizer_updates"] = updates
    result["updates_skipped_no_signal"] = skipped
    return result


def _anchor_rows(cfg, learner: Learner, anchors, rng: random.Random) -> list[TrainSample]:
    rows = []
    for problem, completion in rng.sample(anchors, min(cfg.anchor.prompts_per_step, len(anchors))):
        prompt = build_prompt(learner.tokenizer, problem, cfg.data.prompt_template)
        prompt_ids = list(learner.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        completion_ids = list(learner.tokenizer(completion, add_special_tokens=False)["input_ids"])
        completion_ids.append(learner.tokenizer.eos_token_id if learner.stop_token_id is None else learner.stop_token_id)
        rows.append(TrainSample(
            prompt_id="anchor", group=-1, prompt_ids=prompt_ids,
            completion_ids=completion_ids, num_content_tokens=len(completion_ids) - 1, advantage=0.0, grafted=False,
            num_bytes=len(completion.encode("utf-8")),
        ))
    return rows


def _anchor_nll(learner: Learner, rows: list[TrainSample]) -> torch.Tensor:
    """Token-mean negative log-likelihood of the reference completions (temperature 1)."""
    tokens = collate(rows, learner.tokenizer.pad_token_id).to(learner.device)
    with learner.autocast():
        logprobs = response_logprobs(learner.model, tokens, 1.0)  # (b, T)
    return -(logprobs * tokens.mask).sum() / tokens.mask.sum().clamp(min=1)


# ---- outputs -------------------------------------------------------------------------------------

def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else NAN


def _append_metrics(path: Path, metrics: dict[str, Any]) -> None:
    missing = [k for k in METRIC_KEYS if k not in metrics]
    if missing:
        raise RuntimeError(f"metrics line lacks {missing}")  # a bug in this module, not bad input
    with open(path, "ab") as f:
        f.write(orjson.dumps(metrics, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        f.flush()


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, forget lines (metrics, evaluations) of steps after the checkpoint: they run again."""
    if not path.exists():
        return
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    kept = [line for line in lines if orjson.loads(line).get("step", 0) <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in kept))
    tmp.replace(path)


def _evaluate(cfg: TrainConfig, backend, scorer, run_dir: Path, step: int) -> dict:
    """Accuracy on the configured benchmarks through graft-eval's code; appended to eval.jsonl."""
    from rollouts.evaluation import evaluate

    problems_by_benchmark = {
        name: load_problems(source, limit=cfg.eval.limit) for name, source in cfg.eval.benchmarks.items()
    }
    greedy = cfg.eval.k == 1  # GRAFT_SPEC section 10: greedy for k = 1, else T = 0.6, top_p = 0.95
    params = SamplingParams(
        n=cfg.eval.k, temperature=0.0 if greedy else cfg.eval.temperature, top_p=1.0 if greedy else cfg.eval.top_p,
        max_tokens=cfg.eval.max_tokens or cfg.rollout.max_response_tokens, seed=cfg.seed,
    )
    result = evaluate(backend, problems_by_benchmark, cfg.eval.k, params, scorer, template=cfg.data.prompt_template)
    with open(run_dir / "eval.jsonl", "ab") as f:
        options = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
        f.write(orjson.dumps({"step": step, **result}, option=options) + b"\n")
    accuracies = ", ".join(f"{name} {r['avg_at_k']:.3f}" for name, r in result["benchmarks"].items())
    log.info("step %d evaluation (avg@%d): %s", step, cfg.eval.k, accuracies)
    return result
