"""A policy update over a hand-built batch, written with graft.trainer.distributed's parts the way the
training step uses them: the same code runs in one process (the reference) and in every rank of a
torchrun job (dist_worker.py), so the tests compare N ranks with one process on the same global batch.

The batch goes through the real path: TrainSample rows, graft.trainer.batch.collate and response_logprobs,
graft.trainer.loss.graft_loss and agg_denominator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from graft.trainer.batch import TrainSample, collate, response_logprobs
from graft.trainer.distributed import (
    DistContext,
    clip_grad_norm,
    gradient_sync,
    mini_batch_rows,
    padding_pass,
    plan_mini_batches,
    row_places,
    split_for_rank,
)
from graft.trainer.loss import LossBatch, LossConfig, agg_denominator, graft_loss
from toy.models import build_tiny_model
from toy.world import TEST_CHARS, learner_tokenizer

SEED = 5
GROUPS_PER_STEP = 7  # prompts of the global batch; 2 ranks get 4 and 3
NUM_MINI = 2
MICRO_BATCH_SIZE = 3
LR = 1e-3


def tiny_policy():
    """The toy world's learner shape (char tokenizer, Llama), small: the same weights on every rank."""
    tokenizer = learner_tokenizer()
    return build_tiny_model(tokenizer, "llama", hidden=32, layers=2, seed=SEED), tokenizer


def make_optimizer(model: torch.nn.Module, total_updates: int = 8):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    # warm-up, so that the scheduler's state matters on resume
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: min(1.0, (update + 1) / total_updates))
    return optimizer, scheduler


def global_groups(tokenizer, reference: torch.nn.Module) -> list[list[TrainSample]]:
    """The step's groups (one per prompt), drawn from torch's global RNG: sizes 0 (a skipped group),
    2, 3 or 5 rows; every third group grafted, with token weights c; pi_old = `reference`'s logprobs
    plus noise, so ratios spread around 1 and some tokens clip."""
    vocab = [tokenizer.convert_tokens_to_ids(c) for c in TEST_CHARS]
    groups = []
    for g in range(GROUPS_PER_STEP):
        size = [0, 2, 3, 5][int(torch.randint(0, 4, ()))]
        grafted = g % 3 == 2
        rows = []
        for _ in range(size):
            prompt = [vocab[int(i)] for i in torch.randint(0, len(vocab), (int(torch.randint(3, 7, ())),))]
            completion = [vocab[int(i)] for i in torch.randint(0, len(vocab), (int(torch.randint(1, 9, ())),))]
            completion.append(tokenizer.eos_token_id)
            rows.append(TrainSample(
                prompt_id=f"p{g}", group=g, prompt_ids=prompt, completion_ids=completion,
                num_content_tokens=len(completion) - 1, advantage=float(torch.randn(())), grafted=grafted,
                num_bytes=len(completion) - 1,
            ))
        if rows:
            with torch.no_grad():
                logprobs = response_logprobs(reference, collate(rows, tokenizer.pad_token_id))  # (b, T)
            for b, row in enumerate(rows):
                n = len(row.completion_ids)
                row.old_logprobs = logprobs[b, :n] + 0.3 * torch.randn(n)  # (n,)
                row.token_weight = torch.rand(n) * 1.3 + 0.2 if grafted else torch.ones(n)  # (n,)
        groups.append(rows)
    return groups


def local_rows(groups: list[list[TrainSample]], ctx: DistContext, empty_rank: int | None = None) -> list[TrainSample]:
    """This rank's rows: its split_for_rank block of the prompts (empty_rank: that rank's prompts gave no rows)."""
    if ctx.rank == empty_rank:
        return []
    mine = split_for_rank(groups, ctx.rank, ctx.world_size)
    return [row for group in mine for row in group]


def _pad(values: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros((len(values), width), dtype=torch.float32)  # (b, width)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
    return out


def _length_mask(rows: list[TrainSample]) -> torch.Tensor:
    lengths = torch.tensor([len(r.completion_ids) for r in rows])  # (b,)
    return torch.arange(int(lengths.max()))[None, :] < lengths[:, None]  # (b, T) bool


@dataclass
class UpdateResult:
    loss_share: float  # this rank's share of the summed mini-batch losses (the job's: their sum over ranks)
    grad_norms: list[float] = field(default_factory=list)
    optimizer_steps: int = 0
    micro_batches_run: int = 0
    padding_passes: int = 0


def update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    ctx: DistContext,
    rows: list[TrainSample],
    loss_cfg: LossConfig,
    step: int,
    pad_id: int,
    grad_clip: float | None = 1.0,
    on_gradients: Callable[[int], None] | None = None,
) -> UpdateResult:
    """One PPO epoch over NUM_MINI global mini-batches of the step's rows, micro-batched. `on_gradients(m)`
    runs after mini-batch m's last backward, before clipping (the tests read the gradients there)."""
    generator = torch.Generator().manual_seed(SEED * 31_337 + step)  # the same permutation on every rank
    minis = mini_batch_rows(row_places(ctx, [row.group for row in rows]), NUM_MINI, generator)  # groups: global
    plans = plan_mini_batches(
        ctx,
        [agg_denominator(_length_mask([rows[i] for i in mini]), loss_cfg) if mini else 0.0 for mini in minis],
        [math.ceil(len(mini) / MICRO_BATCH_SIZE) for mini in minis],
    )
    result = UpdateResult(loss_share=0.0)
    for m, (mini, plan) in enumerate(zip(minis, plans)):
        if plan.micro_batches == 0:  # no rank has a row: every rank skips this optimizer step
            continue
        optimizer.zero_grad(set_to_none=True)
        for k in range(plan.micro_batches):
            chunk = [rows[i] for i in mini[k * MICRO_BATCH_SIZE : (k + 1) * MICRO_BATCH_SIZE]]
            with gradient_sync(model, last_backward=k == plan.micro_batches - 1):
                if not chunk:
                    padding_pass(model, ctx.device)
                    result.padding_passes += 1
                    continue
                tokens = collate(chunk, pad_id).to(ctx.device)
                logprobs = response_logprobs(model, tokens)  # (b, T)
                width = logprobs.shape[1]
                batch = LossBatch(
                    logprobs=logprobs,
                    old_logprobs=_pad([r.old_logprobs for r in chunk], width).to(ctx.device),
                    advantages=torch.tensor([r.advantage for r in chunk], dtype=torch.float32, device=ctx.device),
                    mask=tokens.mask,
                    token_weight=_pad([r.token_weight for r in chunk], width).to(ctx.device),
                    is_grafted=torch.tensor([r.grafted for r in chunk], dtype=torch.bool, device=ctx.device),
                )
                loss, _ = graft_loss(batch, loss_cfg)
                micro_denominator = agg_denominator(tokens.mask, loss_cfg)
                (loss * plan.loss_scale(micro_denominator)).backward()
                result.loss_share += float(loss.detach()) * micro_denominator / plan.denominator
                result.micro_batches_run += 1
        if on_gradients is not None:
            on_gradients(m)
        result.grad_norms.append(clip_grad_norm(model, grad_clip))
        optimizer.step()
        scheduler.step()
        result.optimizer_steps += 1
    optimizer.zero_grad(set_to_none=True)
    return result


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (FSDP: gathered from the shards, a collective), by HF name."""
    from graft.trainer.distributed import unwrap

    out = {}
    for name, param in unwrap(model).named_parameters():
        grad = param.grad
        full_tensor = getattr(grad, "full_tensor", None)
        out[name] = (full_tensor() if full_tensor is not None else grad).detach().cpu().clone()
    return out
