"""Sampling with transformers `generate`: for CPU, for tests, and for the trainer's own rollouts
(it samples from the policy object it is training).

The recorded logprobs are the behaviour policy's: the raw logits of every step (`output_logits`)
go through the same temperature, top-k and top-p that the sampler applied, then log-softmax,
exactly as vLLM's `processed_logprobs`. `output_scores` is not used: its scores are neither
normalised nor free of whatever processors a model's generation config adds.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import GenerationConfig

from services.generator.models import eos_token_ids, load_model_and_tokenizer, tokenizer_fingerprint
from services.generator.sampling import Sample, SamplingParams

DEFAULT_LOGITS_BUDGET_BYTES = 2 << 30  # raw logits kept per generate call (steps x sequences x vocab x 4 bytes)


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution the sampler draws from.

    logits: (B, V) raw next-token logits. Returns (B, V) float32, -inf outside the top-k/top-p
    support. Greedy (temperature 0): the model's own log-softmax, as vLLM reports it.
    Order as in transformers and vLLM: temperature, then top-k, then top-p.
    """
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / params.temperature  # (B, V)
    top_k = params.effective_top_k
    if top_k is not None and top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, top_k, dim=-1).values[..., -1:]  # (B, 1)
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(scaled, dim=-1, descending=False)  # (B, V) ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # (B, V)
        remove_sorted = cumulative <= (1.0 - params.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_index, remove_sorted)  # (B, V) back in vocab order
        scaled = scaled.masked_fill(remove, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


@torch.inference_mode()
def teacher_forced_logprobs(model, prompt_ids: list[int], completion_ids: list[int], params: SamplingParams) -> list[float]:
    """Behaviour logprobs of `completion_ids` after `prompt_ids` from one full forward pass (no cache, no padding)."""
    ids = torch.tensor([prompt_ids + completion_ids], device=model.device)  # (1, P + L)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]  # (L, V): position t predicts token t + 1
    logprobs = processed_logprobs(logits, params)  # (L, V)
    targets = torch.tensor(completion_ids, device=model.device)  # (L,)
    return logprobs.gather(-1, targets[:, None])[:, 0].tolist()


class HFBackend:
    """transformers sampler over a model already in memory (the trainer's policy) or loaded from a path."""

    def __init__(
        self,
        model,
        tokenizer,
        model_id: str,
        tokenizer_id: str | None = None,
        batch_size: int = 64,
        logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
    ):
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token: batched generation needs one to pad with")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.tokenizer_id = tokenizer_id or tokenizer_fingerprint(tokenizer)
        self.batch_size = batch_size  # sequences per generate call
        self.logits_budget_bytes = logits_budget_bytes
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @classmethod
    def from_path(cls, path: str | Path, model_id: str | None = None, dtype: torch.dtype = torch.float32, **kwargs) -> HFBackend:
        from services.generator.models import default_model_id

        model, tokenizer = load_model_and_tokenizer(path, dtype=dtype)
        if torch.cuda.is_available():
            model = model.to("cuda")
        return cls(model, tokenizer, model_id=model_id or default_model_id(path), **kwargs)

    def close(self) -> None:
        """Drop the model (before loading a newer checkpoint)."""
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def generate(self, prompts: list[str], params: SamplingParams) -> list[list[Sample]]:
        prompt_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        for i, ids in enumerate(prompt_ids):
            if not ids:
                raise ValueError(f"prompt {i} tokenises to nothing: every prompt needs at least one token")
        # One row per sample; rows sorted by prompt length so that a batch pads little.
        rows = [i for i in range(len(prompts)) for _ in range(params.n)]
        order = sorted(range(len(rows)), key=lambda r: len(prompt_ids[rows[r]]))
        vocab = self.model.get_output_embeddings().weight.shape[0]
        per_call = max(1, min(self.batch_size, self.logits_budget_bytes // (params.max_tokens * vocab * 4)))

        samples_by_row: dict[int, Sample] = {}
        device_rng = [self.model.device] if self.model.device.type == "cuda" else []
        with torch.random.fork_rng(devices=device_rng), _eval_mode(self.model), _neutral_generation_config(self.model):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(order), per_call):
                batch_rows = order[start : start + per_call]
                batch_samples = self._generate_batch([prompt_ids[rows[r]] for r in batch_rows], params)
                samples_by_row.update(zip(batch_rows, batch_samples, strict=True))
        return [[samples_by_row[i * params.n + j] for j in range(params.n)] for i in range(len(prompts))]

    @torch.inference_mode()
    def _generate_batch(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Sample]:
        device = self.model.device
        width = max(len(ids) for ids in prompt_ids)
        # Left padding: every row's next token is predicted at the same (last) position.
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(ids)) + ids for ids in prompt_ids], device=device)  # (B, P)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=device)  # (B, P)
        config = GenerationConfig(
            do_sample=not params.greedy,
            max_new_tokens=params.max_tokens,
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            repetition_penalty=1.0,
            min_new_tokens=0,
            # Explicit values: transformers fills unset ones from global defaults (top_k=50 among them).
            **({} if params.greedy else {
                "temperature": params.temperature, "top_k": params.effective_top_k or 0, "top_p": params.top_p, "typical_p": 1.0,
            }),
        )
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        completions = out.sequences[:, width:]  # (B, L): pad after a row's EOS
        step_logprobs = [
            processed_logprobs(step_logits, params).gather(-1, completions[:, t : t + 1])[:, 0]  # (B,)
            for t, step_logits in enumerate(out.logits)  # L steps of (B, V) raw logits
        ]
        token_logprobs = torch.stack(step_logprobs, dim=1).cpu()  # (B, L)
        completions = completions.cpu()

        samples = []
        for row in range(completions.shape[0]):
            ids = completions[row].tolist()
            end = next((t + 1 for t, tok in enumerate(ids) if tok in self.eos_token_ids), None)
            finish_reason = "length" if end is None else "stop"
            ids = ids[: end or len(ids)]
            logprobs = token_logprobs[row, : len(ids)].tolist()
            if any(lp == float("-inf") for lp in logprobs):
                raise RuntimeError(
                    "a sampled token lies outside the top-k/top-p support recomputed from the raw logits: the sampler "
                    "and the recorded behaviour distribution disagree (a logits processor outside SamplingParams?)"
                )
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            samples.append(Sample(token_ids=ids, token_logprobs=logprobs, text=text, finish_reason=finish_reason))
        return samples


@contextlib.contextmanager
def _eval_mode(model):
    """Sample without dropout, then give the trainer its model back in the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _neutral_generation_config(model):
    """Hide the model's own generation config (a repetition penalty or top_k in it would change the sampler
    without our knowing); only `SamplingParams` decide the distribution."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved
