"""The GRPO / GRAFT / DAPO training loop (docs/algorithm.md): setup, then one `for` loop over the steps.

One step:
  1. draw the step's prompts and start the peer lookup for them in the background (graft)
  2. sample G rollouts per prompt from the current policy and score them (dapo: refill)      trainer/sample.py
  3. publish the groups to the store (co-training, or peers.publish)                        trainer/peers.py
  4. collect the peer groups from the run's source (peers.source; prefetch: what the lookup
     brought; cotrain: wait a bounded time for the co-trainer's; lockstep: for its groups of
     this step, as long as it lives; replay: the recorded run's, by id)                    trainer/peers.py
  5. gate: mixed / all-success groups train on-policy; all-fail groups take a peer group
     the step's lookup rule accepts, else are skipped; the groups it chose from, and the
     learner's own rewards, are recorded; the source acts on the decisions (the broker's
     wants and ledger; a replay compares them with the record)                             trainer/gate.py
  6. build the rows: the learner's and the re-tokenised peer rollouts                        trainer/batch.py
  7. pi_old on every row with signal (or the update's own forward, detached, when it is the
     only one), compatibility weights w and token ratios b on grafted rows                  trainer/batch.py
  8. PPO epoch(s) over mini-batches (micro-batched), plus the optional supervised anchor      trainer/update.py
  9. vLLM weight sync, metrics line, checkpoint, evaluation                                  trainer/metrics.py
`train(cfg)` runs it in-process and returns the run directory. Under torchrun (parallel.strategy ddp or fsdp)
every rank runs it on its block of the step's prompts; the stages' collectives (trainer/distributed.py) make
N ranks take the update one process takes on the same global batch, and the metrics line the job's.
SIGTERM (`docker stop`) ends the run at the next step boundary: checkpoint, outbox flushed, a normal return.
"""

from __future__ import annotations

import logging
import random
import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from graft.rollouts.files import latest_checkpoint
from graft.rollouts.sampling import report_tokens_on
from graft.rollouts.scoring import Scorer
from graft.rollouts.stopping import StopFlag
from graft.trainer.batch import build_rows, old_logprobs_and_weights
from graft.trainer.checkpoint import (
    RunDirInUse,
    check_run_dir,
    checkpoints_dir,
    clear_run,
    restore_training_state,
    resumable,
    save_checkpoint,
    write_run_config,
)
from graft.trainer.config import TrainConfig
from graft.trainer.data import LoopState, load_anchor, load_step_rows, training_prompts
from graft.trainer.distributed import (
    DistContext,
    barrier,
    broadcast_object,
    close_distributed,
    gather_lists,
    init_distributed,
    reduce_metrics,
)
from graft.trainer.evaluation import due, evaluate_policy
from graft.trainer.gate import gate_groups
from graft.trainer.host import GraftHost
from graft.trainer.learner import learner_model_id, load_learner, load_reference, make_sampler, sync_sampler
from graft.trainer.loss import LossConfig
from graft.trainer.metrics import MetricsLog, StepClock, StepOutcome, step_metrics
from graft.trainer.peers import PeerSource, make_source
from graft.trainer.replay import PeerGroupRecord
from graft.trainer.sample import sample_step
from graft.trainer.update import UpdateContext, make_optimizer, single_pass_forward, update_policy

log = logging.getLogger("graft.trainer")


def train(cfg: TrainConfig, resume: bool = False, on_step: Callable[[dict[str, Any]], None] | None = None,
          overwrite: bool = False) -> Path:
    """Run training as configured; returns the run directory (metrics.jsonl, checkpoints/, eval.jsonl).

    resume: continue from the newest checkpoint in cfg.run_dir (none there: start from the beginning). overwrite:
    delete the run cfg.run_dir holds and start afresh; without either, a run directory holding a run is refused
    (RunDirInUse, a FileExistsError). on_step: called with each step's metrics line after it is written (progress reporting in the
    demo, fault injection in tests). Under torchrun every rank calls this (parallel.strategy ddp or fsdp;
    graft.trainer.distributed)."""
    dist = init_distributed(cfg.parallel, cfg.model.device)
    # SIGTERM only: the step in progress ends, is checkpointed, and the run returns (Ctrl-C stops at once)
    stop = StopFlag(signals=(signal.SIGTERM,))
    stop.install()
    try:
        return _train(cfg, dist, resume, overwrite, on_step, stop)
    finally:
        stop.uninstall()
        close_distributed(dist)


def stop_agreed(stop: StopFlag, dist: DistContext) -> bool:
    """Whether any rank was asked to stop (every rank calls it at the same step: they stop together)."""
    if not dist.distributed:
        return stop.requested
    return reduce_metrics(dist, maxima={"stop": float(stop.requested)})["stop"] > 0


def _claim_run_dir(run_dir: Path, resume: bool, overwrite: bool, dist: DistContext) -> None:
    """Refuse a fresh start where a run is (rank 0 decides, every rank raises); overwrite: clear the old run first."""
    try:
        found = check_run_dir(run_dir, resume, overwrite) if dist.is_main else []
        refusal = None
    except (RunDirInUse, ValueError) as error:
        log.error("%s", error)
        found, refusal = [], error
    refusal = broadcast_object(dist, refusal)
    if refusal is not None:
        raise refusal
    if found:
        log.warning("overwrite: deleting the previous run in %s (%s)", run_dir, "; ".join(found))
        clear_run(run_dir)
    barrier(dist)


def _train(cfg: TrainConfig, dist: DistContext, resume: bool, overwrite: bool,
           on_step: Callable[[dict[str, Any]], None] | None, stop: StopFlag) -> Path:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _setup_logging(run_dir, cfg, dist)  # before the check: its refusal goes to train.log too
    # Chosen once; built before the model loads: a replay refuses another config first, and a lockstep partner's
    # heartbeats start while this trainer loads (its partner may be waiting already).
    source = make_source(cfg, learner_model_id(cfg), stopping=lambda: stop.requested) \
        if cfg.method == "graft" or cfg.publishes else None
    try:
        return _train_with(cfg, dist, resume, overwrite, on_step, stop, run_dir, source)
    finally:
        if source is not None:
            source.close()


def _train_with(cfg: TrainConfig, dist: DistContext, resume: bool, overwrite: bool,
                on_step: Callable[[dict[str, Any]], None] | None, stop: StopFlag, run_dir: Path,
                source: PeerSource | None) -> Path:
    _claim_run_dir(run_dir, resume, overwrite, dist)
    checkpoint = latest_checkpoint(checkpoints_dir(run_dir), resumable) if resume else None
    if resume and checkpoint is None:
        log.warning("--resume: no checkpoint in %s, starting a fresh run from step 0", run_dir)
    if dist.is_main:
        write_run_config(run_dir, cfg.model_dump(mode="json"), checkpoint)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    torch.manual_seed(cfg.seed)

    learner = load_learner(cfg, checkpoint, dist)  # wrapped for parallel.strategy; the optimizer comes after
    optimizer, scheduler = make_optimizer(cfg, learner.hf_model)
    update = UpdateContext(cfg, LossConfig.from_train(cfg), learner, optimizer, scheduler, load_reference(cfg, learner),
                           load_anchor(cfg), load_step_rows(cfg))
    state = LoopState(**restore_training_state(checkpoint, learner.grad_model, optimizer, scheduler, dist)) \
        if checkpoint else LoopState()
    if state.step >= cfg.steps:  # a finished run started again (a container restarted with --resume): say so
        log.warning("the run in %s is at step %d of %d already: nothing to train (raise --steps to go on)", run_dir,
                    state.step, cfg.steps)
    prompts = training_prompts(cfg, state)
    # what TRL's and verl's hosts build around their learner too: the peers' tokenizers, the gate's refusals (peer
    # groups whose text the learner cannot weigh, one warning per tokenizer id), the store counts
    host = GraftHost.around(cfg, learner, source)
    sampler, uses_vllm = make_sampler(cfg, learner, checkpoint or cfg.model.path)
    scorer = Scorer(num_workers=cfg.rollout.scorer_workers, timeout_s=cfg.rollout.scorer_timeout_s)
    graft = cfg.method == "graft"
    metrics_log = MetricsLog(cfg, run_dir, state.step, host.store, writes=dist.is_main)
    peer_record = PeerGroupRecord(run_dir, state.step, dist.rank) if graft else None  # what a replay gives back
    progress = tqdm(total=cfg.steps, initial=state.step, disable=not (cfg.logging.progress and dist.is_main),
                    desc=cfg.method, unit="step")
    if not progress.disable:  # a step samples for minutes on a CPU: show its tokens
        sampler.on_tokens = report_tokens_on(progress)
    try:
        for policy_step in range(state.step, cfg.steps):
            clock = StepClock()
            block = prompts.take_block(cfg.rollout.prompts_per_step, dist)  # this rank's share of the step's prompts
            request = source.request([p.prompt_id for p in block.problems], policy_step) if graft else None
            pending = source.start_lookup(request) if graft else None  # runs while the learner samples
            with clock("generation_s"):
                sampled = sample_step(cfg, sampler, scorer, learner, prompts, block, policy_step)
            if source is not None:
                source.publish(sampled.generated, [sampled.problem_of[g.prompt_id] for g in sampled.generated])
            with clock("gate_s"):
                found = source.candidates(pending, request, sampled.rewards, host.refused.usable, policy_step) if graft else None
                candidates = found.groups if found else {}
                decisions = gate_groups(sampled.rewards, candidates, request, max_grafted_fraction=cfg.graft.max_grafted_fraction,
                                        rng=random.Random(cfg.seed * 7_919 + policy_step), usable_tokenizers=host.refused.usable,
                                        ranks=dist, trust_unverified_mu=cfg.graft.trust_unverified_mu)
                host.refused.warn(decisions, candidates)
                if peer_record is not None:
                    # a replay stops here at the first difference from its record, before training the step
                    source.after_gate(policy_step, decisions, found, sampled.problem_of, sampled.rewards)
                    peer_record.write(policy_step + 1, found, decisions, sampled.rewards)
                rows = build_rows(cfg, learner, decisions, sampled.groups, sampled.problem_of, host.peer_tokenizers)
            with clock("update_s"):
                first_pass = single_pass_forward(update, rows.rows)
                weighted = old_logprobs_and_weights(cfg, learner, update.reference, rows.rows, first_pass)
                result = update_policy(update, weighted.rows, sampled.positions, policy_step, first_pass)
            if uses_vllm:  # the engine samples the next step with the new weights
                with clock("weight_sync_s"):
                    sync_sampler(sampler, learner)
            elif learner.sampler_model is not None:  # rollout.hf_sampler_copy: so does the bfloat16 copy
                with clock("weight_sync_s"):
                    learner.sync_sampler_copy()

            outcome = StepOutcome(sampled, found, decisions, rows, weighted, result,
                                  co_trains=source is not None and source.co_trains)
            metrics = metrics_log.write(step_metrics(cfg, state, outcome, clock, scheduler.get_last_lr()[0],
                                                     metrics_log.store.take(), dist))  # the job's line, on every rank
            log.info("%s", step_line(metrics))
            if dist.world_size > 1:  # this rank's own share (train.rank<r>.log for rank r > 0)
                log.info("step %d: %d groups, %d grafted, %d rows trained on (this rank's)", metrics["step"],
                         len(decisions), len(outcome.grafted), len(weighted.rows))
            state.advance(metrics["rollouts_generated"], metrics["peer_rollouts_consumed"],
                          gather_lists(dist, [d.prompt_id for d in outcome.grafted]))
            progress.update(1)
            if on_step is not None:
                on_step(metrics)
            progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}", grafted=f"{metrics['frac_grafted']:.2f}",
                                 signal=f"{metrics['rows_with_signal']}/{metrics['rows']}", loss=f"{metrics['loss']:.4f}")
            stopping = stop_agreed(stop, dist)
            if stopping or (cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0) \
                    or state.step == cfg.steps:
                save_checkpoint(run_dir, state.step, learner.grad_model, learner.tokenizer, optimizer, scheduler,
                                asdict(state), cfg.checkpoint.keep_last, dist, cfg.checkpoint.optimizer_in_newest_only)
            if stopping:
                log.warning("SIGTERM: stopped after step %d of %d, checkpoint written%s; continue with --resume",
                            state.step, cfg.steps, " (this step's evaluation skipped)" if due(cfg, state.step) else "")
                break
            if due(cfg, state.step):  # each rank scores its block of the problems; rank 0 writes
                with learner.sampling_autocast():
                    evaluate_policy(cfg, sampler, scorer, run_dir, state.step, dist)
    finally:
        progress.close()
        if source is not None:
            source.finish(timeout_s=cfg.store.timeout_s)
        metrics_log.close()
        scorer.close()
        if uses_vllm:  # before the process group ends (under torchrun the engine's groups live in it)
            sampler.close()
    return run_dir


def step_line(metrics: dict[str, Any]) -> str:
    """The step's log line (the job's counts): what the gate did with the all-fail groups, and how many rows carried
    a gradient (a row with advantage 0 carries none)."""
    why = ", ".join(f"{name.removeprefix('groups_no_peer_').replace('_', ' ')} {metrics[name]}"
                    for name in sorted(metrics)
                    if name.startswith("groups_no_peer_") and name != "groups_no_peer_tokenizer" and metrics[name])
    skipped = {"no peer group": metrics["groups_no_peer"], "peer groups uninformative": metrics["groups_peer_uninformative"],
               "no peer tokenizer": metrics["groups_no_peer_tokenizer"], "capped": metrics["groups_capped"]}
    parts = [f"{count} {name}" + (f" ({why})" if name == "no peer group" and why else "")
             for name, count in skipped.items() if count]
    return (f"step {metrics['step']}: reward {metrics['reward_mean']:.3f}, {len(metrics['grafted_groups'])} group(s) "
            "grafted" + (f", all-fail groups not grafted: {'; '.join(parts)}" if parts else "")
            + f"; {metrics['rows']} rows trained on, {metrics['rows_with_signal']} with a non-zero advantage"
            + ("" if metrics["rows_with_signal"] else " (no gradient this step)"))


def _setup_logging(run_dir: Path, cfg: TrainConfig, dist: DistContext) -> None:
    """The trainer's log lines into <run_dir>/train.log (data parallel: rank r > 0 into train.rank<r>.log); threads as
    configured; transformers' bars off with ours."""
    handler = logging.FileHandler(run_dir / ("train.log" if dist.is_main else f"train.rank{dist.rank}.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    trainer_log = logging.getLogger("graft.trainer")  # its children (graft.trainer.peers, ...) propagate to it
    trainer_log.setLevel(logging.INFO)
    trainer_log.handlers = [h for h in trainer_log.handlers if not isinstance(h, logging.FileHandler)] + [handler]
    if not cfg.logging.progress:  # transformers' own bars (loading, saving checkpoints) too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
