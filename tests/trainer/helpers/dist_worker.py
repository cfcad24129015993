"""One rank of the data-parallel tests, started by test_distributed.py with torchrun (2 ranks, gloo):

    torchrun --nproc-per-node 2 tests/trainer/helpers/dist_worker.py {ddp,fsdp} OUT_DIR

Runs every scenario on the hand-built batches of dist_step.py and writes what it saw to
OUT_DIR/rank{R}.pt; the test compares that with one process on the same global batch. Scenarios:
equivalence (3 loss aggregations, 2 steps each), zero_rows (rank 1 has no rows), metrics
(reduce_metrics), full_weights (the streamed gather vs the gathered state dict) and checkpoint
(save at step 1, continue, reload into a fresh model and redo step 2; the HF export's logits).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from dist_step import (
    SEED,
    full_gradients,
    global_groups,
    local_rows,
    make_optimizer,
    tiny_policy,
    update,
)

from graft.trainer.checkpoint import load_sharded_checkpoint, save_checkpoint
from graft.trainer.config import ParallelConfig, PPOConfig
from graft.trainer.distributed import (
    DistContext,
    close_distributed,
    full_state_dict,
    init_distributed,
    iter_full_weights,
    max_over_ranks,
    reduce_metrics,
    wrap_model,
)
from graft.trainer.loss import LossConfig

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
PROBE = torch.tensor([[5, 9, 12, 7, 3, 14]])  # (1, 6) token ids whose logits the export must reproduce


def params(model) -> dict[str, torch.Tensor]:
    return {name: tensor.cpu().clone() for name, tensor in iter_full_weights(model)}


def fresh(ctx: DistContext):
    """The initial policy wrapped for the strategy, its optimizer and scheduler, a plain pi_old reference."""
    torch.manual_seed(SEED)
    model, tokenizer = tiny_policy()
    reference, _ = tiny_policy()
    wrapped = wrap_model(model, ctx)
    optimizer, scheduler = make_optimizer(wrapped)
    return wrapped, optimizer, scheduler, reference.eval(), tokenizer


def step(ctx, wrapped, optimizer, scheduler, reference, tokenizer, loss_cfg, index, **kwargs):
    groups = global_groups(tokenizer, reference)
    return update(wrapped, optimizer, scheduler, ctx, local_rows(groups, ctx, kwargs.pop("empty_rank", None)), loss_cfg,
                  index, tokenizer.pad_token_id, **kwargs)


def equivalence(ctx: DistContext) -> dict:
    out = {}
    for aggregation in AGGREGATIONS:
        loss_cfg = LossConfig(PPOConfig(loss_agg=aggregation), token_sum_norm=16.0)
        wrapped, optimizer, scheduler, reference, tokenizer = fresh(ctx)
        first_grads: dict[str, torch.Tensor] = {}

        def keep_first(mini: int) -> None:
            if not first_grads and mini == 0:
                first_grads.update(full_gradients(wrapped))

        losses, norms, steps = [], [], []
        for index in range(2):
            result = step(ctx, wrapped, optimizer, scheduler, reference, tokenizer, loss_cfg, index,
                          on_gradients=keep_first if index == 0 else None)
            losses.append(reduce_metrics(ctx, sums={"loss": result.loss_share})["loss"])
            norms.append(result.grad_norms)
            steps.append(result.optimizer_steps)
        out[aggregation] = {"losses": losses, "grad_norms": norms, "optimizer_steps": steps,
                            "first_grads": first_grads, "params": params(wrapped)}
    return out


def zero_rows(ctx: DistContext) -> dict:
    wrapped, optimizer, scheduler, reference, tokenizer = fresh(ctx)
    result = step(ctx, wrapped, optimizer, scheduler, reference, tokenizer, LossConfig(), 0, empty_rank=1)
    return {"params": params(wrapped), "padding_passes": result.padding_passes,
            "micro_batches_run": result.micro_batches_run, "optimizer_steps": result.optimizer_steps,
            "loss": reduce_metrics(ctx, sums={"loss": result.loss_share})["loss"]}


def metrics(ctx: DistContext) -> dict:
    r = ctx.rank
    reduced = reduce_metrics(
        ctx,
        sums={"rows": float(r + 1), "nan_on_rank_1": float("nan") if r == 1 else 2.0},
        means={"reward": (0.5, 2.0) if r == 0 else (1.0, 6.0), "only_rank_1": (float("nan"), 1.0) if r == 0 else (3.0, 1.0),
               "nowhere": (float("nan"), 0.0)},
        maxima={"step_time_s": r + 0.5},
    )
    try:
        reduce_metrics(ctx, sums={f"only_on_rank_{r}": 1.0})
        mismatch_raised = False
    except RuntimeError:
        mismatch_raised = True
    return {"reduced": reduced, "mismatch_raised": mismatch_raised, "max_over_ranks": max_over_ranks(ctx, 3 * r + 1)}


def full_weights(ctx: DistContext) -> dict:
    wrapped, *_ = fresh(ctx)
    gathered = full_state_dict(wrapped, ctx)  # rank 0 only
    streamed = params(wrapped)
    same = all(torch.equal(streamed[k], gathered[k]) for k in gathered) and (not gathered or set(gathered) <= set(streamed))
    return {"streamed_equals_gathered": same, "names": sorted(streamed)}


def checkpoint(ctx: DistContext, run_dir: Path) -> dict:
    loss_cfg = LossConfig()
    wrapped, optimizer, scheduler, reference, tokenizer = fresh(ctx)
    step(ctx, wrapped, optimizer, scheduler, reference, tokenizer, loss_cfg, 0)
    loop_state = {"step": 1, "epoch": 0, "cursor": 7, "grafted_prompts": ["p2", "p5"]}
    path = save_checkpoint(run_dir, 1, wrapped, tokenizer, optimizer, scheduler, loop_state, 2, ctx=ctx)
    with torch.no_grad():
        logits = wrapped(input_ids=PROBE.to(ctx.device)).logits.cpu()  # (1, 6, V) of the sharded model
    saved_params = params(wrapped)
    step(ctx, wrapped, optimizer, scheduler, reference, tokenizer, loss_cfg, 1)
    continuous = params(wrapped)

    torch.manual_seed(12345)  # whatever the process holds now, the checkpoint's RNG must win
    resumed_model, resumed_optimizer, resumed_scheduler, reference, tokenizer = fresh(ctx)
    restored = load_sharded_checkpoint(path, resumed_model, resumed_optimizer, resumed_scheduler, ctx)
    loaded_params = params(resumed_model)
    step(ctx, resumed_model, resumed_optimizer, resumed_scheduler, reference, tokenizer, loss_cfg, 1)
    return {"path": str(path), "logits": logits, "saved_params": saved_params, "loaded_params": loaded_params,
            "continuous": continuous, "resumed": params(resumed_model), "restored": restored, "loop_state": loop_state}


def main() -> None:
    strategy, out_dir = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    ctx = init_distributed(ParallelConfig(strategy=strategy, timeout_s=120), "cpu")
    try:
        result = {
            "world_size": ctx.world_size,
            "equivalence": equivalence(ctx),
            "zero_rows": zero_rows(ctx),
            "metrics": metrics(ctx),
            "full_weights": full_weights(ctx),
            "checkpoint": checkpoint(ctx, out_dir / "run"),
        }
        torch.save(result, out_dir / f"rank{ctx.rank}.pt")
    finally:
        close_distributed(ctx)


if __name__ == "__main__":
    main()
