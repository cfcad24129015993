"""What every sampling backend takes and returns, so the generator, the evaluation and the trainer
can swap vLLM for transformers without noticing. Types (and the progress line a backend reports to) only: the
backends (`hf_backend`, `vllm_backend`, `openai_backend`) import these, and `backends.load_backend` picks one by
name, so nothing here imports a backend."""

from __future__ import annotations

import time
from collections.abc import Callable
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
    # True: sample j of the call's prompt i draws from its own seed, seed + (prompt_offset + i) * n + j (vLLM seeds its
    # requests so, always), so a prompt's samples do not depend on the other prompts of the call: a batch split into
    # blocks (one per data-parallel rank) draws what the whole batch draws. False: the hf backend seeds the call once.
    seed_per_sample: bool = False
    prompt_offset: int = 0  # index of the call's first prompt in the batch it is a block of (0: the whole batch)

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
        if self.seed_per_sample and self.seed is None:
            raise ValueError("SamplingParams.seed_per_sample needs a seed to derive the samples' seeds from")
        if self.prompt_offset < 0:
            raise ValueError(f"SamplingParams.prompt_offset = {self.prompt_offset}: must be >= 0")

    def sample_seed(self, prompt: int, sample: int) -> int:
        """The seed of sample `sample` of the call's prompt `prompt` (seed_per_sample; vLLM's request seeds)."""
        return self.seed + (self.prompt_offset + prompt) * self.n + sample

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def effective_top_k(self) -> int | None:
        """top_k with 0 folded into None (both mean: no cut)."""
        return self.top_k if self.top_k else None

    @property
    def model_distribution(self) -> bool:
        """Whether these samples come from the model's own distribution (`samples_the_model`)."""
        return samples_the_model(self.temperature, self.top_p, self.top_k)


def samples_the_model(temperature: float, top_p: float, top_k: int | None) -> bool:
    """Whether sampling with these settings draws from the model's own distribution: temperature 1 and no top-p or
    top-k cut (top_k 0 or None), so that processed logprobs (the behaviour policy's) and raw ones (the model's) are
    one. Greedy decoding (temperature 0) does not."""
    return temperature == 1.0 and top_p >= 1.0 and not top_k


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


ProgressCallback = Callable[[int, int], None]  # (tokens sampled so far in a generate call, at most that many in all)


class Backend(Protocol):
    """A sampler: the HF (`hf_backend.HFBackend`), vLLM (`vllm_backend.VLLMBackend`) and served
    (`openai_backend.OpenAIBackend`) backends, each registered once (`backends.BACKENDS`), with a classmethod
    `from_settings(settings, path, *, model_id, seed)` that loads it from its settings."""

    tokenizer: Any  # a transformers tokenizer: prompts are built with its chat template
    model_id: str  # path-safe name of the model, stored with every row
    tokenizer_id: str  # identity of the tokenizer the token ids belong to
    eos_token_ids: set[int]  # tokens that end a completion
    # what token_logprobs holds, in vLLM's names: "processed_logprobs" (after temperature, top-k and top-p: the
    # behaviour policy; the hf and vllm backends) or "raw_logprobs" (the model's own: a server started so)
    logprobs_mode: str
    # progress within a generate call, which on a CPU can take minutes: the hf backend tells it after each decoding
    # step, the served one as each prompt's samples come back, the vllm engine when the call returns
    on_tokens: ProgressCallback | None

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Sample]]:
        """Outer list: one entry per prompt, in order; inner list: params.n samples."""
        ...

    def close(self) -> None:
        """Free what the backend holds (the weights, an engine, the connections): at the end of a run, or before a
        newer checkpoint loads. Called once; the backend is not used after."""
        ...

    def server_counts(self) -> dict[str, float] | None:
        """What was asked of a server (requests, retries, tokens, time: the run summary's `server`); None for a
        backend that samples in this process."""
        ...


def report_tokens_on(bar, every_s: float = 0.5) -> ProgressCallback:
    """A `Backend.on_tokens` that shows `sampling: 312/2048 tok` in a tqdm bar's postfix, at most every `every_s`."""
    last = [0.0]

    def report(sampled: int, budget: int) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s or sampled >= budget:
            last[0] = now
            bar.set_postfix_str(f"sampling: {sampled}/{budget} tok")

    return report
