"""Data parallelism on PyTorch's own stack: the process group from torchrun's environment, DDP or
FSDP2 (`fully_shard`), and the few collectives that make N ranks take the update one process takes
on the same global batch.

    graft-train train --config CONFIG                                    # one process, as always
    torchrun --nproc-per-node N -m graft.trainer.cli train --config CONFIG     # N ranks on this machine
    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        --rdzv-id RUN -m graft.trainer.cli train --config CONFIG               # on each of M machines

What a training step does with these parts so that N ranks equal one process:
- The step's prompts are global: every rank draws the same `prompts_per_step` from the same stream
  and keeps its `split_for_rank` block (contiguous, in order: the ranks' rows laid end to end are
  one process's rows).
- A mini-batch is global: `row_places` (one collective per step) places this rank's rows among the job's
  in one process's order (DAPO's refills too), and `mini_batch_rows` picks them out of the permutation one
  process would draw.
- The loss normaliser is global: `plan_mini_batches` sums the ranks' `agg_denominator`s (one
  collective per epoch, before any backward) and each micro-batch's loss is multiplied by
  `MiniBatchPlan.loss_scale` before its backward. The factor world_size in it undoes the mean over
  ranks that DDP's all-reduce and FSDP's reduce-scatter take of the gradients.
- Every rank runs the same number of forward/backward passes and optimizer steps: the plan holds
  the most micro-batches any rank needs, and a rank that has fewer runs `padding_pass` (zero loss
  over one token) so that FSDP's all-gathers and reduce-scatters and DDP's all-reduce meet.
- No-grad passes under fsdp are collectives too: `collective_passes` agrees on their number first, the
  rest are padding. Sampling with transformers' generate() runs inside `gathered_weights` (the full
  weights on every rank, no collective per forward); each rollout is seeded by its place in the global
  batch (graft.rollouts.sampling.SamplingParams.seed_per_sample), so the ranks draw what one process draws.
- Counts the step decides on globally come from `rank_spans` / `sum_over_ranks` (the graft cap, DAPO's refill,
  the single pass); lists are joined in rank order with `gather_lists` (grafted prompts, the grafted
  rows' weights for their statistics).
- Metrics: `reduce_metrics` (sums, count-weighted means, maxima; NaN-aware); rank 0 writes them.

Over 400 lines because every collective of the step lives here (the loop's stages call these named parts), so
that the rules that keep the ranks in step (agree on counts first, pad, gather the same order) are written once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, Literal, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from graft.trainer.config import ParallelConfig

log = logging.getLogger("graft.trainer.distributed")

Strategy = Literal["none", "ddp", "fsdp"]
T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job. One process without a process group: rank 0 of 1, strategy none."""

    strategy: Strategy
    device: torch.device  # this rank's device (cuda:LOCAL_RANK on GPU machines)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # init_distributed created the default process group (close_distributed ends it)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes what is written once (metrics, the HF export, renames)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group is up and the collectives below run (ddp and fsdp, even on one rank)."""
        return self.strategy != "none"


def init_distributed(parallel: ParallelConfig, device: str = "auto") -> DistContext:
    """Join the job torchrun started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the
    environment), or run alone when they are absent.

    `device` is model.device: 'auto' takes cuda:LOCAL_RANK when CUDA is there, else the CPU. The
    backend follows the device: nccl on CUDA, gloo on the CPU. ddp or fsdp without torchrun runs one
    rank in a process group of its own (the same code path; no launcher needed)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    strategy = parallel.strategy
    if world_size > 1 and strategy == "none":
        raise ValueError(
            f"{world_size} ranks were launched (WORLD_SIZE={world_size}) but parallel.strategy is 'none': each would train "
            "a model of its own on the same data; set parallel.strategy to ddp or fsdp, or start one process"
        )
    if strategy == "none":
        if device == "auto":
            return DistContext("none", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        return DistContext("none", torch.device(device))

    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"model.device {device!r}: under parallel.strategy {strategy!r} each rank takes the GPU of its "
                         "LOCAL_RANK; use auto, cuda or cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device is 'cuda' but torch sees no CUDA device")
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    rank_device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(rank_device)
    owns_group = False
    if dist.is_initialized():  # someone (a test harness, a wrapper) set the group up already
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(f"the process group is rank {dist.get_rank()} of {dist.get_world_size()} but the "
                               f"environment says rank {rank} of {world_size}")
    else:
        timeout = timedelta(seconds=parallel.timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=rank_device if on_gpu else None)
        elif world_size == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            raise ValueError(f"WORLD_SIZE={world_size} without MASTER_ADDR/MASTER_PORT: start the ranks with torchrun")
        owns_group = True
    log.info("rank %d of %d (local %d), %s on %s, backend %s", rank, world_size, local_rank, strategy, rank_device, backend)
    return DistContext(strategy, rank_device, rank, world_size, local_rank, owns_group)


def close_distributed(ctx: DistContext) -> None:
    """End the process group init_distributed created (no-op otherwise)."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


# ---- the model ------------------------------------------------------------------------------------

def fsdp_mixed_precision(device: torch.device, compute_dtype: torch.dtype):
    """FSDP2's policy: on CUDA the parameters are all-gathered in the compute dtype (bfloat16 in the GPU
    configs) and gradients reduced in float32; on the CPU everything stays float32 (the loop's
    torch.autocast gives the compute dtype there). The sharded master parameters stay float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = compute_dtype if device.type == "cuda" else torch.float32
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a transformers causal LM (Llama, Qwen2, Qwen3, ...)."""
    get_decoder = getattr(model, "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if callable(get_decoder) else None
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no get_decoder().layers: fsdp shards per decoder layer and "
                         "needs them; use parallel.strategy ddp for this model")
    return layers


def wrap_model(model: nn.Module, ctx: DistContext, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Move the model to the rank's device and wrap it for ctx.strategy; returns what the update's forward calls.

    ddp: a DistributedDataParallel around it (rank 0's weights are broadcast). fsdp: fully_shard on
    each decoder layer, then on the whole model (embeddings, final norm and a tied lm_head shard in the
    root group); in place, so the returned model is still the transformers class. Every rank must hold
    the same weights when this is called (loaded from the same checkpoint): FSDP keeps each rank's
    own slice of what it holds; under fsdp only rank 0 must (`shard_from_rank0`: the others may have built the
    model on the meta device)."""
    if ctx.strategy == "fsdp":
        return shard_from_rank0(model, ctx, fsdp_mixed_precision(ctx.device, compute_dtype))
    model.to(ctx.device)
    if ctx.strategy == "none":
        return model
    if ctx.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # No buffer broadcast: the models' buffers (rotary tables) never change, and a broadcast in each
        # forward would make even sampling a collective.
        return DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                                       broadcast_buffers=False)
    _shard(model, fsdp_mixed_precision(ctx.device, compute_dtype))
    return model


def shard_from_rank0(model: nn.Module, ctx: DistContext, policy) -> nn.Module:
    """FSDP2-shard a model whose weights only rank 0 holds: on the other ranks `model` was built on the meta device
    (no memory), so N ranks never hold N full copies of the weights (host memory scales with 1, not N).

    Every rank shards the model as `wrap_model` does, gives it empty storage on its device, then receives its
    shards of rank 0's weights (torch.distributed.checkpoint's set_model_state_dict with broadcast_from_rank0);
    buffers outside the state dict (rotary tables) are broadcast from rank 0 as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not ctx.is_main and any(p.is_meta for p in model.parameters()):
        log.info("rank %d: %s built on the meta device, its shards received from rank 0 (no weight read here)",
                 ctx.rank, type(model).__name__)
    # rank 0 keeps references to its full tensors (sharding and to_empty give the module new ones): no copy
    full = dict(model.state_dict()) if ctx.is_main else {}
    buffers = dict(model.named_buffers()) if ctx.is_main else {}
    _shard(model, policy)
    model.to_empty(device=ctx.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():
        if ctx.is_main:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, src=0)
    return model


def wrap_reference(model: nn.Module, ctx: DistContext) -> nn.Module:
    """The frozen reference policy (the KL term) on the rank's device: sharded like the policy under fsdp (its
    forwards are collectives then, padded like the policy's; rank 0's weights, as for the policy), a plain local
    copy otherwise (no gradient to reduce)."""
    if ctx.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return shard_from_rank0(model, ctx, MixedPrecisionPolicy())  # kept in the dtype it was loaded in
    return model.to(ctx.device)


def _shard(model: nn.Module, policy) -> None:
    """fully_shard per decoder layer, then the root (embeddings, final norm, lm_head). The layers reshard after
    their forward (memory); the root keeps its parameters for the backward, as FSDP2 does for a root by default."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)


@contextlib.contextmanager
def gathered_weights(model: nn.Module) -> Iterator[None]:
    """Under fsdp, the full parameters on every rank for the duration (one all-gather per FSDP unit on entry, a
    collective every rank takes at the same point), with no collective inside: each rank's forwards are then its
    own, whatever their number and shapes. What sampling with transformers' generate() needs (its number of
    forwards depends on the rank's prompts); the memory of one full copy of the weights in the compute dtype
    while it lasts, as a vLLM engine holds. Not under fsdp: nothing happens."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # the root first, the same order on every rank
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)  # as _shard set them


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a DDP wrapper (FSDP2 wraps in place: the model itself).

    Under ddp, sampling and no-grad passes call this: its forwards are local (no collective)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, last_backward: bool) -> Iterator[None]:
    """Around each backward of a mini-batch. ddp: gradients accumulate locally and are all-reduced once, in the
    mini-batch's last backward (`last_backward`: the caller says which one that is). fsdp (and none): nothing
    changes; FSDP reduce-scatters on every backward, so each rank only ever keeps its shard of the gradient."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and not last_backward:
        with model.no_sync():
            yield
    else:
        yield


def padding_pass(model: nn.Module, device: torch.device, backward: bool = True) -> None:
    """What a rank with no rows left runs while the others run a micro-batch: a forward over one token
    (and, with backward, the backward of zero times its logits). Its gradient is exactly zero, but it
    takes part in every collective the real pass does (FSDP's all-gathers and reduce-scatters, DDP's
    all-reduce), so no rank waits forever."""
    with contextlib.nullcontext() if backward else torch.no_grad():
        logits = padding_forward(model, device)  # (1, 1, V)
    if backward:
        zero_backward(logits)


def padding_forward(model: nn.Module, device: torch.device) -> Tensor:
    """The forward half of padding_pass: (1, 1, V) logits of one token (token 0 exists in every vocabulary)."""
    return model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device)).logits


def zero_backward(output: Tensor) -> None:
    """The backward half of padding_pass: a gradient of exactly zero, through every collective of a real one."""
    (output.float().sum() * 0.0).backward()


def collective_passes(ctx: DistContext, local_passes: int) -> int:
    """How many no-grad forward passes of the sharded model this rank runs: under fsdp each is a collective, so
    every rank runs the most any rank needs (the rest padded with padding_pass(backward=False)); otherwise its own."""
    return max_over_ranks(ctx, local_passes) if ctx.strategy == "fsdp" else local_passes


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """The global gradient norm over all ranks (before clipping), clipping to max_norm when given.

    Called after the mini-batch's last backward: DDP's gradients are already the all-reduced ones,
    FSDP's are DTensor shards whose norm torch reduces over the ranks."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if max_norm is None:
        norm = torch.nn.utils.get_total_norm(grads)
    else:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    full_tensor = getattr(norm, "full_tensor", None)  # a DTensor under fsdp
    return float(full_tensor() if full_tensor is not None else norm)


# ---- full weights ---------------------------------------------------------------------------------

def iter_full_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) for every entry of the model's state dict, one at a time: what the vLLM
    weight sync and an export take.

    fsdp: each parameter is all-gathered from the shards when the consumer reaches it and can be
    dropped before the next, so a rank holds its shards plus one full parameter, never two full
    models. Every rank must consume the whole iterator (each gather is a collective). ddp and none:
    the model's own tensors, no copy."""
    for name, tensor in unwrap(model).state_dict().items():
        full_tensor = getattr(tensor, "full_tensor", None)
        yield name, (full_tensor() if full_tensor is not None else tensor).detach()


def full_state_dict(model: nn.Module, ctx: DistContext) -> dict[str, Tensor]:
    """The full weights, gathered once onto rank 0's CPU (torch.distributed.checkpoint.state_dict);
    other ranks get {}. One process: the model's own state dict."""
    if not ctx.distributed:
        return unwrap(model).state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---- the global batch -----------------------------------------------------------------------------

def split_for_rank(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    """Rank `rank`'s contiguous block of the global list: sizes differ by at most one (the first ranks
    take the extra items), and the blocks in rank order are the list itself."""
    begin, end = rank_block(len(items), rank, world_size)
    return list(items[begin:end])


def rank_block(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """[begin, end) of rank `rank`'s block of `total` items (split_for_rank)."""
    base, extra = divmod(total, world_size)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class RankSpan:
    """Where this rank's items of one kind (the step's groups, its grafted groups) sit among all ranks' items of
    that kind laid end to end in rank order."""

    offset: int  # index of this rank's first item among all ranks' items
    count: int  # items on this rank
    total: int  # items on all ranks


def rank_spans(ctx: DistContext, local_counts: Sequence[int]) -> list[RankSpan]:
    """For each of several per-rank counts (groups, grafted groups), this rank's span in the ranks' items laid end to
    end in rank order; one all_gather for all of them (a collective: every rank calls it together)."""
    gathered = _gather(ctx, [float(c) for c in local_counts])  # (W, n)
    out = []
    for column, local in enumerate(local_counts):
        counts = [int(c) for c in gathered[:, column].tolist()]  # (W,)
        out.append(RankSpan(offset=sum(counts[: ctx.rank]), count=int(local), total=sum(counts)))
    return out


def gather_lists(ctx: DistContext, items: list[T]) -> list[T]:
    """Every rank's `items`, laid end to end in rank order, on every rank (all_gather_object; one process: items)."""
    if not ctx.distributed:
        return items
    gathered: list[list[T] | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


@dataclass(frozen=True)
class RowPlaces:
    """Where this rank's rows of a step sit among the job's rows laid in one process's order."""

    index: list[int]  # (local rows,) each row's index among the job's rows
    total: int  # the job's rows


def row_places(ctx: DistContext, positions: Sequence[int]) -> RowPlaces:
    """This rank's rows among the job's in one process's order, from each row's `position`: its prompt's place
    among the job's prompts of the step (graft.trainer.sample.SampledStep.positions). A prompt's rows are on one rank,
    together and in order. Without refills the ranks' rows laid end to end in rank order are that order already;
    DAPO's refill rounds put a rank's block of round 2 after its block of round 1, so the order is rebuilt from
    every rank's (position, rows) pairs (one all_gather_object)."""
    counts: dict[int, int] = {}
    for position in positions:
        counts[position] = counts.get(position, 0) + 1
    first_row, total = {}, 0  # position -> index of its first row among the job's
    for position, rows in sorted(gather_lists(ctx, sorted(counts.items()))):
        first_row[position], total = total, total + rows
    seen: dict[int, int] = {}
    index = []
    for position in positions:
        index.append(first_row[position] + seen.get(position, 0))
        seen[position] = seen.get(position, 0) + 1
    return RowPlaces(index, total)


def mini_batch_rows(places: RowPlaces, num_mini: int, generator: torch.Generator) -> list[list[int]]:
    """For each of the epoch's `num_mini` global mini-batches, the local indices of this rank's rows in it.

    One process gets `order[m::num_mini]` of one random permutation of its rows; with ranks, every rank draws the
    same permutation of the job's rows (the same generator state on every rank) and keeps its own, so the ranks'
    mini-batches together are one process's."""
    order = torch.randperm(places.total, generator=generator).tolist() if places.total else []
    local = {row: i for i, row in enumerate(places.index)}  # job's row index -> this rank's
    return [[local[row] for row in order[m::num_mini] if row in local] for m in range(num_mini)]


@dataclass(frozen=True)
class MiniBatchPlan:
    """What every rank agrees on before a mini-batch's first backward."""

    denominator: float  # the loss normaliser of the whole mini-batch: agg_denominator summed over all ranks' rows
    micro_batches: int  # forward/backward passes every rank runs: the most any rank needs (the others pad)
    world_size: int

    def loss_scale(self, micro_denominator: float) -> float:
        """Multiply a micro-batch's graft_loss by this before its backward.

        graft_loss divides by the micro-batch's own agg_denominator; micro/denominator turns that into
        its share of the global mini-batch's loss (the shares of all micro-batches on all ranks add up
        to the loss one process computes over the whole mini-batch). DDP and FSDP divide the gradients
        they sum over ranks by world_size; the factor world_size undoes it, so the update is the sum."""
        return micro_denominator / self.denominator * self.world_size


def plan_mini_batches(
    ctx: DistContext, local_denominators: Sequence[float], local_micro_batches: Sequence[int]
) -> list[MiniBatchPlan]:
    """Global normalisers and micro-batch counts for an epoch's mini-batches, in one collective.

    local_denominators[m]: agg_denominator over this rank's rows of mini-batch m (0 when it has none;
    rows that skip the forward still count). local_micro_batches[m]: the micro-batches this rank
    needs for it. A plan with micro_batches == 0 means no rank has a row to train on: every rank
    skips that optimizer step together."""
    if len(local_denominators) != len(local_micro_batches):
        raise ValueError(f"{len(local_denominators)} denominators for {len(local_micro_batches)} micro-batch counts")
    num_mini = len(local_denominators)
    gathered = _gather(ctx, [*map(float, local_denominators), *map(float, local_micro_batches)])  # (W, 2 * num_mini)
    denominators = gathered[:, :num_mini].sum(dim=0).tolist()  # (num_mini,)
    micro_batches = gathered[:, num_mini:].max(dim=0).values.tolist() if num_mini else []  # (num_mini,)
    return [MiniBatchPlan(d, int(m), ctx.world_size) for d, m in zip(denominators, micro_batches)]


def sum_over_ranks(ctx: DistContext, value: int) -> int:
    """The job's total of a per-rank count (DAPO's kept groups, the step's rows with signal)."""
    return int(_gather(ctx, [float(value)]).sum())


def max_over_ranks(ctx: DistContext, value: int) -> int:
    """The largest `value` of any rank: how many passes of a collective kind (FSDP no-grad forwards,
    generate() calls) every rank must run."""
    return int(_gather(ctx, [float(value)]).max())


# ---- metrics --------------------------------------------------------------------------------------

def reduce_metrics(
    ctx: DistContext,
    sums: dict[str, float] | None = None,
    means: dict[str, tuple[float, float]] | None = None,
    maxima: dict[str, float] | None = None,
) -> dict[str, float]:
    """Combine each rank's metrics into the job's, in one collective; every rank gets the result.

    sums: added over ranks (counts, each rank's share of the loss). means: (value, weight) pairs, the
    weighted mean over ranks (weight = the rows, tokens or groups the rank's mean is over). maxima:
    the largest (times: the slowest rank sets the step's pace). NaN, or a weight of 0, means the rank
    has no value: it is left out, and a metric no rank has is NaN. Every rank must pass the same keys."""
    sums, means, maxima = dict(sums or {}), dict(means or {}), dict(maxima or {})
    keys = (sorted(sums), sorted(means), sorted(maxima))
    fingerprint = float(zlib.crc32(repr(keys).encode()))  # exact in float64: catches ranks that pass other keys
    row = [fingerprint]
    for name in keys[0]:
        present = math.isfinite(sums[name])
        row += [sums[name] if present else 0.0, float(present)]
    for name in keys[1]:
        value, weight = means[name]
        present = math.isfinite(value) and weight > 0
        row += [value * weight if present else 0.0, weight if present else 0.0]
    for name in keys[2]:
        row += [maxima[name] if math.isfinite(maxima[name]) else -math.inf]
    gathered = _gather(ctx, row)  # (W, len(row)) float64
    if bool((gathered[:, 0] != fingerprint).any()):
        raise RuntimeError(f"reduce_metrics: the ranks passed different metric names (this rank: {keys})")
    totals = gathered.sum(dim=0).tolist()
    out: dict[str, float] = {}
    column = 1
    for name in keys[0]:
        out[name] = totals[column] if totals[column + 1] > 0 else math.nan
        column += 2
    for name in keys[1]:
        out[name] = totals[column] / totals[column + 1] if totals[column + 1] > 0 else math.nan
        column += 2
    for name in keys[2]:
        largest = float(gathered[:, column].max())
        out[name] = largest if math.isfinite(largest) else math.nan
        column += 1
    return out


def _gather(ctx: DistContext, values: list[float]) -> Tensor:
    """Every rank's `values` as a (W, n) float64 CPU tensor (one all_gather; no collective alone)."""
    local = torch.tensor(values, dtype=torch.float64)  # (n,)
    if not ctx.distributed:
        return local[None, :]
    local = local.to(ctx.device)
    gathered = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, local)
    return torch.stack(gathered).cpu()  # (W, n)


def broadcast_object(ctx: DistContext, value: Any) -> Any:
    """Rank 0's `value` on every rank (a path, a decision rank 0 took)."""
    if not ctx.distributed:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0, device=ctx.device)
    return holder[0]


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()
