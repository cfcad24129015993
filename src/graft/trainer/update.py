"""The policy update of a step: PPO epoch(s) over mini-batches of the step's rows, micro-batched, each mini-batch
one optimizer step, plus the optional supervised anchor (docs/algorithm.md section 6).

The update is written on `graft.trainer.distributed`'s parts, so that N data-parallel ranks take the update one
process takes on the job's rows (in one process they run no collective): where this rank's rows sit among
the job's in one process's order (`row_places`), the mini-batches (`mini_batch_rows` of one permutation of
all ranks' rows), the global loss normaliser and micro-batch count (`plan_mini_batches`), a padding pass for
a rank that has run out of rows, `gradient_sync` around each backward (DDP all-reduces in the mini-batch's last
one: the anchor's when there is an anchor term), and the gradient norm over all ranks (`clip_grad_norm`).
`UpdateResult.totals` are sums the metrics add over ranks. Every forward here is backpropagated: each calls
`learner.grad_model` (graft.trainer.learner.Learner says why).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from graft.trainer.batch import FirstPass, TrainSample, collate, needs_forward, response_logprobs
from graft.trainer.config import TrainConfig
from graft.trainer.distributed import (
    clip_grad_norm,
    gradient_sync,
    mini_batch_rows,
    padding_forward,
    plan_mini_batches,
    row_places,
    sum_over_ranks,
    zero_backward,
)
from graft.trainer.learner import Learner
from graft.trainer.loss import LossBatch, LossConfig, agg_denominator, graft_loss

NAN = float("nan")


@dataclass
class UpdateContext:
    """What every step's update works with (set up once per run)."""

    cfg: TrainConfig
    loss_cfg: LossConfig
    learner: Learner
    optimizer: torch.optim.Optimizer
    scheduler: Any  # a torch LR scheduler, stepped with the optimizer
    reference: torch.nn.Module | None = None  # the frozen initial policy when the KL is on
    anchors: list[tuple[str, str]] = field(default_factory=list)  # (problem, reference completion) of the anchor
    step_rows: dict[int, list[tuple[str, str]]] = field(default_factory=dict)  # anchor.step_rows: step -> its rows


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over the trainable parameters, and its schedule over every optimizer step of the run."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.adam_eps,
                                  weight_decay=cfg.optim.weight_decay)
    total_updates = cfg.steps * cfg.optim.ppo_epochs * num_mini_batches(cfg)
    warmup, schedule = cfg.optim.warmup_steps, cfg.optim.schedule

    def factor(update: int) -> float:
        if warmup and update < warmup:
            return (update + 1) / warmup
        if schedule == "cosine":
            progress = (update - warmup) / max(1, total_updates - warmup)
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def num_mini_batches(cfg: TrainConfig) -> int:
    return max(1, round(cfg.rollout.prompts_per_step / cfg.optim.mini_batch_prompts))


def single_pass_forward(ctx: UpdateContext, rows: list[TrainSample]) -> FirstPass | None:
    """With one PPO epoch of one mini-batch that fits one micro-batch, the update's forward pass runs on
    exactly the weights that pi_old is defined by (ratio 1): one forward with grad serves both, as verl
    does, and the separate no-grad pass is skipped. None otherwise (several updates per step need pi_old
    frozen before the first).

    Data parallel: decided on the job's rows (every rank alike); a rank without rows then runs a padding
    forward. A rank whose micro-batch comes out empty (no rows, or every row dropped after this pass as non-finite)
    backpropagates this pass with a zero gradient while the others take theirs (`_padding`)."""
    cfg, learner = ctx.cfg, ctx.learner
    if cfg.optim.ppo_epochs != 1 or num_mini_batches(cfg) != 1:
        return None
    active = [row for row in rows if needs_forward(row, cfg)]
    total = sum_over_ranks(learner.dist, len(active))
    if not total or total > cfg.optim.micro_batch_size:
        return None
    if not active:
        with learner.autocast():
            return FirstPass([], None, padding_forward(learner.grad_model, learner.device))
    tokens = collate(active, learner.tokenizer.pad_token_id).to(learner.device)
    with learner.autocast():
        logprobs = response_logprobs(learner.grad_model, tokens, cfg.rollout.temperature)  # (b, T) float32, with grad
    return FirstPass(active, tokens, logprobs)


@dataclass
class UpdateResult:
    """What a step's update did. `totals` are (weighted sum, weight) pairs of this rank, the mean being their
    ratio once summed over ranks: loss (this rank's share of each mini-batch's loss, weight 1 per optimizer step),
    clip_frac_onpolicy, clip_frac_grafted, ratio_mean, kl[, anchor_nll]."""

    totals: dict[str, tuple[float, float]]
    grad_norm: float  # mean over optimizer steps of the gradient norm before clipping (the job's, every rank alike)
    optimizer_updates: int
    updates_skipped_no_signal: int  # mini-batches without a row to train on (and no anchor)

    def mean(self, name: str, default: float = NAN) -> float:
        """One process: the mean of a total (`default` when nothing was added)."""
        total, weight = self.totals[name]
        return total / weight if weight else default


def update_policy(
    ctx: UpdateContext, rows: list[TrainSample], positions: list[int], policy_step: int,
    first_pass: FirstPass | None = None,
) -> UpdateResult:
    """PPO epoch(s) over mini-batches of the step's rows. `positions`: each group's place among the job's prompts
    (SampledStep.positions; rows point to their group), which fixes the job's row order the mini-batches are drawn
    from. With `first_pass` (one epoch, one mini-batch, one micro-batch) its logprobs are the update's: no second
    forward."""
    cfg, learner, loss_cfg, dist = ctx.cfg, ctx.learner, ctx.loss_cfg, ctx.learner.dist
    generator = torch.Generator().manual_seed(cfg.seed * 31_337 + policy_step)  # the same permutation on every rank
    num_mini, micro = num_mini_batches(cfg), cfg.optim.micro_batch_size
    # the same anchor rows on every rank: DDP and FSDP average their identical gradients into one anchor term
    anchor_rows = anchor_batch(cfg, learner, ctx.anchors, random.Random(cfg.seed * 65_537 + policy_step))
    step_rows = reference_rows(cfg, learner, ctx.step_rows.get(policy_step, []))  # anchor.step_rows (one update a step)
    means = _WeightedMeans()
    grad_norms: list[float] = []
    skipped = 0
    places = row_places(dist, [positions[row.group] for row in rows])
    for _ in range(cfg.optim.ppo_epochs):
        minis = [[rows[i] for i in indices] for indices in mini_batch_rows(places, num_mini, generator)]
        actives = [[row for row in mini if needs_forward(row, cfg)] for mini in minis]
        plans = plan_mini_batches(dist, [agg_denominator(_length_mask(mini), loss_cfg) if mini else 0.0
                                         for mini in minis], [math.ceil(len(active) / micro) for active in actives])
        for active, plan in zip(actives, plans):
            if plan.micro_batches == 0 and not anchor_rows and not step_rows:
                skipped += 1
                continue
            ctx.optimizer.zero_grad(set_to_none=True)
            mini_loss = 0.0  # this rank's micro-batch losses as scaled for their backward: the ranks' mean is the loss
            # DDP all-reduces in the mini-batch's last backward: the step rows' or the anchor's, which run after the
            # micro-batches, when the step has such a term; else the last micro-batch's
            anchor_is_sync_point = bool(anchor_rows) and not step_rows
            for k in range(plan.micro_batches):
                chunk = active[k * micro : (k + 1) * micro]
                last_backward = k == plan.micro_batches - 1 and not anchor_rows and not step_rows
                with gradient_sync(learner.grad_model, last_backward=last_backward):
                    if not chunk:  # this rank has run out of rows: it takes part in the others' collectives
                        _padding(learner, first_pass)
                        continue
                    loss, metrics, micro_denominator = _micro_batch_loss(ctx, chunk, first_pass)
                    # the micro-batches' losses add up to the mini-batch's (a mini-batch without a token has none)
                    scale = plan.loss_scale(micro_denominator) if plan.denominator else 0.0
                    (loss * scale).backward()
                mini_loss += float(loss.detach()) * scale
                means.add("clip_frac_onpolicy", metrics["clip_frac_onpolicy"], metrics["tokens_onpolicy"])
                means.add("clip_frac_grafted", metrics["clip_frac_grafted"], metrics["tokens_grafted"])
                means.add("clip_frac_grafted_without_mu", metrics["clip_frac_grafted_without_mu"],
                          metrics["tokens_grafted_without_mu"])
                means.add("ratio_mean", metrics["ratio_mean"], metrics["tokens_onpolicy"] + metrics["tokens_grafted"])
                means.add("kl", metrics["kl"], micro_denominator)
            if anchor_rows:
                with gradient_sync(learner.grad_model, last_backward=anchor_is_sync_point):
                    nll = anchor_nll(learner, anchor_rows)
                    (cfg.anchor.weight * nll).backward()
                means.add("anchor_nll", float(nll.detach()), 1.0 / dist.world_size)  # every rank holds the same term
                mini_loss += cfg.anchor.weight * float(nll.detach())
            if step_rows:  # summed over the rows, divided by the step's token-mean denominator (every rank: the same)
                with gradient_sync(learner.grad_model, last_backward=True):
                    term = summed_nll(learner, step_rows) / max(plan.denominator, 1.0)
                    term.backward()
                means.add("step_rows_nll", float(term.detach()), 1.0 / dist.world_size)
                mini_loss += float(term.detach())
            grad_norms.append(clip_grad_norm(learner.grad_model, cfg.optim.grad_clip))
            ctx.optimizer.step()
            ctx.scheduler.step()
            means.add("loss", mini_loss, 1.0 / dist.world_size)  # the weights of one optimizer step add up to 1
    ctx.optimizer.zero_grad(set_to_none=True)
    names = ("loss", "clip_frac_onpolicy", "clip_frac_grafted", "clip_frac_grafted_without_mu", "ratio_mean", "kl") + (
        ("anchor_nll",) if anchor_rows else ()) + (("step_rows_nll",) if step_rows else ())
    return UpdateResult(
        totals={name: means.total(name) for name in names},
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else NAN, optimizer_updates=len(grad_norms),
        updates_skipped_no_signal=skipped,
    )


def _padding(learner: Learner, first_pass: FirstPass | None) -> None:
    """A rank without rows in this micro-batch: the zero backward of its first pass when there is one (its padding
    forward's, or its rows' whose every row was dropped after it: another forward would be one more than the other
    ranks run, which misaligns fsdp's all-gathers), else a whole padding pass (graft.trainer.distributed.padding_pass)."""
    if first_pass is not None:
        zero_backward(first_pass.logprobs)
        return
    with learner.autocast():
        logits = padding_forward(learner.grad_model, learner.device)  # (1, 1, V)
    zero_backward(logits)


def _micro_batch_loss(
    ctx: UpdateContext, chunk: list[TrainSample], first_pass: FirstPass | None
) -> tuple[torch.Tensor, dict[str, float], float]:
    """graft_loss over one micro-batch (its own normaliser), its metrics, and that normaliser."""
    learner = ctx.learner
    if first_pass is not None:
        logprobs, mask = first_pass.select(chunk)  # (b, T), with grad
    else:
        tokens = collate(chunk, learner.tokenizer.pad_token_id).to(learner.device)
        with learner.autocast():
            logprobs = response_logprobs(learner.grad_model, tokens, ctx.cfg.rollout.temperature)  # (b, T)
        mask = tokens.mask
    width = logprobs.shape[1]
    batch = LossBatch(
        logprobs=logprobs,
        old_logprobs=_pad([r.old_logprobs for r in chunk], width).to(learner.device),
        advantages=torch.tensor([r.advantage for r in chunk], dtype=torch.float32, device=learner.device),
        mask=mask,
        token_weight=_pad([r.token_weight for r in chunk], width).to(learner.device),
        is_grafted=torch.tensor([r.grafted for r in chunk], dtype=torch.bool, device=learner.device),
        without_mu=torch.tensor([r.without_mu for r in chunk], dtype=torch.bool, device=learner.device),
        ref_logprobs=None if ctx.reference is None else _pad([r.ref_logprobs for r in chunk], width).to(learner.device),
    )
    loss, metrics = graft_loss(batch, ctx.loss_cfg)
    return loss, metrics, agg_denominator(mask, ctx.loss_cfg)


def anchor_batch(cfg: TrainConfig, learner: Learner, anchors: list[tuple[str, str]], rng: random.Random) -> list[TrainSample]:
    """The step's anchor rows: anchor.prompts_per_step reference completions, ending as the learner's own do."""
    if not anchors:
        return []
    return reference_rows(cfg, learner, rng.sample(anchors, min(cfg.anchor.prompts_per_step, len(anchors))))


def reference_rows(cfg: TrainConfig, learner: Learner, pairs: list[tuple[str, str]]) -> list[TrainSample]:
    """(problem, completion) pairs as supervised rows, ending as the learner's own do."""
    rows = []
    for problem, completion in pairs:
        prompt_ids = cfg.prompt.token_ids(learner.tokenizer, problem)
        completion_ids = list(learner.tokenizer(completion, add_special_tokens=False)["input_ids"])
        completion_ids.append(learner.end_token_id)
        rows.append(TrainSample(
            prompt_id="anchor", group=-1, prompt_ids=prompt_ids,
            completion_ids=completion_ids, num_content_tokens=len(completion_ids) - 1, advantage=0.0, grafted=False,
            num_bytes=len(completion.encode("utf-8")),
        ))
    return rows


def anchor_nll(learner: Learner, rows: list[TrainSample]) -> torch.Tensor:
    """Token-mean negative log-likelihood of the reference completions (temperature 1)."""
    tokens = collate(rows, learner.tokenizer.pad_token_id).to(learner.device)
    return summed_nll(learner, rows, tokens) / tokens.mask.sum().clamp(min=1)


def summed_nll(learner: Learner, rows: list[TrainSample], tokens=None) -> torch.Tensor:
    """Negative log-likelihood of the rows' completions (temperature 1), summed over their tokens."""
    tokens = collate(rows, learner.tokenizer.pad_token_id).to(learner.device) if tokens is None else tokens
    with learner.autocast():
        logprobs = response_logprobs(learner.grad_model, tokens, 1.0)  # (b, T)
    return -(logprobs * tokens.mask).sum()


class _WeightedMeans:
    """Running weighted means of finite values with positive weight."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, name: str, value: float, weight: float) -> None:
        if weight > 0 and math.isfinite(value):
            self.totals[name] = self.totals.get(name, 0.0) + value * weight
            self.weights[name] = self.weights.get(name, 0.0) + weight

    def total(self, name: str) -> tuple[float, float]:
        """(weighted sum, weight); (0, 0) when nothing was added."""
        return self.totals.get(name, 0.0), self.weights.get(name, 0.0)


def _pad(values: list[torch.Tensor], width: int, fill: float = 0.0) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into (b, width)."""
    out = torch.full((len(values), width), fill, dtype=torch.float32)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def _length_mask(rows: list[TrainSample]) -> torch.Tensor:
    lengths = torch.tensor([len(r.completion_ids) for r in rows])  # (b,)
    return torch.arange(max(int(lengths.max()), 1))[None, :] < lengths[:, None]  # (b, T) bool
