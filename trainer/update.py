"""The policy update of a step: PPO epoch(s) over mini-batches of the step's rows, micro-batched, each mini-batch
one optimizer step, plus the optional supervised anchor (GRAFT_SPEC section 6).

The update is written on `trainer.distributed`'s parts with a one-process context (`DistContext` strategy
"none", where they run no collective): the mini-batches are `mini_batch_rows` of the step's rows, the loss
normaliser is `plan_mini_batches`' global one, the gradient norm is `clip_grad_norm`'s. Data parallelism
adds the ranks' row span (`row_span`), padding passes for a rank that runs out of rows, `gradient_sync`
around each backward and `reduce_metrics` over `UpdateResult.means`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from rollouts.prompts import build_prompt
from trainer.batch import FirstPass, TrainSample, collate, needs_forward, response_logprobs
from trainer.config import TrainConfig
from trainer.distributed import DistContext, RowSpan, clip_grad_norm, mini_batch_rows, plan_mini_batches
from trainer.learner import Learner
from trainer.loss import LossBatch, LossConfig, agg_denominator, graft_loss

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
    dist: DistContext | None = None  # None: one process

    def __post_init__(self) -> None:
        if self.dist is None:
            self.dist = DistContext("none", self.learner.device)


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
    frozen before the first)."""
    cfg, learner = ctx.cfg, ctx.learner
    active = [row for row in rows if needs_forward(row, cfg)]
    if cfg.optim.ppo_epochs != 1 or num_mini_batches(cfg) != 1 or not active or len(active) > cfg.optim.micro_batch_size:
        return None
    tokens = collate(active, learner.tokenizer.pad_token_id).to(learner.device)
    with learner.autocast():
        logprobs = response_logprobs(learner.model, tokens, cfg.rollout.temperature)  # (b, T) float32, with grad
    return FirstPass(active, tokens, logprobs)


@dataclass
class UpdateResult:
    """What a step's update did; `means` are (mean, weight) pairs, the weight being what the mean is over."""

    loss: float  # mean over optimizer steps of each mini-batch's loss (0 when none ran)
    means: dict[str, tuple[float, float]]  # clip_frac_onpolicy, clip_frac_grafted, ratio_mean, kl[, anchor_nll]
    grad_norm: float  # mean over optimizer steps of the gradient norm before clipping
    optimizer_updates: int
    updates_skipped_no_signal: int  # mini-batches without a row to train on (and no anchor)

    def mean(self, name: str) -> float:
        return self.means[name][0]


def update_policy(
    ctx: UpdateContext, rows: list[TrainSample], policy_step: int, first_pass: FirstPass | None = None
) -> UpdateResult:
    """PPO epoch(s) over mini-batches of the step's rows. With `first_pass` (one epoch, one mini-batch, one
    micro-batch) its logprobs are the update's: no second forward."""
    cfg, learner, loss_cfg = ctx.cfg, ctx.learner, ctx.loss_cfg
    generator = torch.Generator().manual_seed(cfg.seed * 31_337 + policy_step)
    num_mini, micro = num_mini_batches(cfg), cfg.optim.micro_batch_size
    anchor_rows = anchor_batch(cfg, learner, ctx.anchors, random.Random(cfg.seed * 65_537 + policy_step))
    means = _WeightedMeans()
    grad_norms: list[float] = []
    skipped = 0
    span = RowSpan(offset=0, count=len(rows), total=len(rows))  # data parallel: trainer.distributed.row_span
    for _ in range(cfg.optim.ppo_epochs):
        minis = [[rows[i] for i in indices] for indices in mini_batch_rows(span, num_mini, generator)]
        actives = [[row for row in mini if needs_forward(row, cfg)] for mini in minis]
        plans = plan_mini_batches(ctx.dist, [agg_denominator(_length_mask(mini), loss_cfg) if mini else 0.0
                                             for mini in minis], [math.ceil(len(active) / micro) for active in actives])
        for active, plan in zip(actives, plans):
            if plan.micro_batches == 0 and not anchor_rows:
                skipped += 1
                continue
            ctx.optimizer.zero_grad(set_to_none=True)
            mini_loss = 0.0
            for begin in range(0, len(active), micro):
                chunk = active[begin : begin + micro]
                loss, metrics, micro_denominator = _micro_batch_loss(ctx, chunk, first_pass)
                # the micro-batches' losses add up to the mini-batch's (a mini-batch without a token has none)
                scale = plan.loss_scale(micro_denominator) if plan.denominator else 0.0
                (loss * scale).backward()
                mini_loss += float(loss.detach()) * scale
                means.add("clip_frac_onpolicy", metrics["clip_frac_onpolicy"], metrics["tokens_onpolicy"])
                means.add("clip_frac_grafted", metrics["clip_frac_grafted"], metrics["tokens_grafted"])
                means.add("ratio_mean", metrics["ratio_mean"], metrics["tokens_onpolicy"] + metrics["tokens_grafted"])
                means.add("kl", metrics["kl"], micro_denominator)
            if anchor_rows:
                nll = anchor_nll(learner, anchor_rows)
                (cfg.anchor.weight * nll).backward()
                means.add("anchor_nll", float(nll.detach()), 1.0)
                mini_loss += cfg.anchor.weight * float(nll.detach())
            grad_norms.append(clip_grad_norm(learner.model, cfg.optim.grad_clip))
            ctx.optimizer.step()
            ctx.scheduler.step()
            means.add("loss", mini_loss, 1.0)
    ctx.optimizer.zero_grad(set_to_none=True)
    names = ("clip_frac_onpolicy", "clip_frac_grafted", "ratio_mean", "kl") + (("anchor_nll",) if anchor_rows else ())
    return UpdateResult(
        loss=means.get("loss", 0.0)[0], means={name: means.get(name, NAN) for name in names},
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else NAN, optimizer_updates=len(grad_norms),
        updates_skipped_no_signal=skipped,
    )


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
            logprobs = response_logprobs(learner.model, tokens, ctx.cfg.rollout.temperature)  # (b, T)
        mask = tokens.mask
    width = logprobs.shape[1]
    batch = LossBatch(
        logprobs=logprobs,
        old_logprobs=_pad([r.old_logprobs for r in chunk], width).to(learner.device),
        advantages=torch.tensor([r.advantage for r in chunk], dtype=torch.float32, device=learner.device),
        mask=mask,
        token_weight=_pad([r.token_weight for r in chunk], width).to(learner.device),
        is_grafted=torch.tensor([r.grafted for r in chunk], dtype=torch.bool, device=learner.device),
        ref_logprobs=None if ctx.reference is None else _pad([r.ref_logprobs for r in chunk], width).to(learner.device),
    )
    loss, metrics = graft_loss(batch, ctx.loss_cfg)
    return loss, metrics, agg_denominator(mask, ctx.loss_cfg)


def anchor_batch(cfg: TrainConfig, learner: Learner, anchors: list[tuple[str, str]], rng: random.Random) -> list[TrainSample]:
    """The step's anchor rows: anchor.prompts_per_step reference completions, ending as the learner's own do."""
    if not anchors:
        return []
    rows = []
    for problem, completion in rng.sample(anchors, min(cfg.anchor.prompts_per_step, len(anchors))):
        prompt = build_prompt(learner.tokenizer, problem, cfg.data.prompt_template)
        prompt_ids = list(learner.tokenizer(prompt, add_special_tokens=False)["input_ids"])
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
    with learner.autocast():
        logprobs = response_logprobs(learner.model, tokens, 1.0)  # (b, T)
    return -(logprobs * tokens.mask).sum() / tokens.mask.sum().clamp(min=1)


class _WeightedMeans:
    """Running weighted means of finite values with positive weight."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, name: str, value: float, weight: float) -> None:
        if weight > 0 and math.isfinite(value):
            self.totals[name] = self.totals.get(name, 0.0) + value * weight
            self.weights[name] = self.weights.get(name, 0.0) + weight

    def get(self, name: str, default: float) -> tuple[float, float]:
        """(mean, weight), or (default, 0) when nothing was added."""
        if name not in self.totals:
            return default, 0.0
        return self.totals[name] / self.weights[name], self.weights[name]


def _pad(values: list[torch.Tensor], width: int, fill: float = 0.0) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into (b, width)."""
    out = torch.full((len(values), width), fill, dtype=torch.float32)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def _length_mask(rows: list[TrainSample]) -> torch.Tensor:
    lengths = torch.tensor([len(r.completion_ids) for r in rows])  # (b,)
    return torch.arange(max(int(lengths.max()), 1))[None, :] < lengths[:, None]  # (b, T) bool
