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
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from graft.rollouts.models import eos_token_ids, load_model_and_tokenizer, tokenizer_fingerprint
from graft.rollouts.sampling import ProgressCallback, Sample, SamplingParams

if TYPE_CHECKING:
    from graft.rollouts.backends import HFSettings

DEFAULT_LOGITS_BUDGET_BYTES = 2 << 30  # raw logits kept per generate call (steps x sequences x vocab x 4 bytes)
DEFAULT_STATIC_CACHE_BUDGET_BYTES = 4 << 30  # a preallocated KV cache up to this size, else one that grows
GROUPED_DECODE_ATTENTION = "graft_sdpa_grouped_decode"  # the attention sampling runs with (see below)


def grouped_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' "sdpa" attention, except that one-token decoding steps on CPU keep grouped-query attention grouped.

    Given a padding mask, transformers repeats the key/value heads num_key_value_groups times before calling
    SDPA (CUDA's fast kernels need that). On CPU that copies the whole KV cache once per layer and step, about
    20x the attention itself at 500 tokens of context (most of the sampling time with few-shot prompts); torch's
    CPU SDPA takes the mask with grouped heads directly and gives the same numbers.
    query: (B, H, 1, D); key, value: (B, H_kv, L, D); attention_mask: (B, 1, 1, L) or None.
    """
    plain_decode_step = (
        query.shape[2] == 1 and query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1
        and kwargs.get("position_bias") is None and kwargs.get("cache") is None and not kwargs.get("output_attentions")
    )
    if not plain_decode_step:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (B, H, 1, D)
    return out.transpose(1, 2).contiguous(), None  # (B, 1, H, D) as transformers' attention functions return it


AttentionInterface.register(GROUPED_DECODE_ATTENTION, grouped_decode_attention)
AttentionMaskInterface.register(GROUPED_DECODE_ATTENTION, sdpa_mask)


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
def teacher_forced_logprobs(model, prompt_ids: list[int], completions: list[list[int]], params: SamplingParams,
                            pad_token_id: int = 0) -> list[list[float]]:
    """Behaviour logprobs (`processed_logprobs` at `params`) of each completion's tokens after `prompt_ids`: one
    forward pass over them all, no cache, right-padded after the shared prompt (causal attention: a real position
    sees what it sees in a pass of its own). The in-process teacher forcing, of graft-rescore and of the tests'
    checks of stored logprobs alike."""
    longest = max((len(c) for c in completions), default=0)
    if longest == 0:
        return [[] for _ in completions]
    rows = [prompt_ids + c + [pad_token_id] * (longest - len(c)) for c in completions]
    ids = torch.tensor(rows, device=model.device)  # (G, P + L)
    mask = torch.tensor([[1] * (len(prompt_ids) + len(c)) + [0] * (longest - len(c)) for c in completions],
                        device=model.device)  # (G, P + L)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, len(prompt_ids) - 1 : -1]  # (G, L, V)
    logprobs = processed_logprobs(logits.reshape(-1, logits.shape[-1]), params).view(len(rows), longest, -1)  # (G, L, V)
    taken = logprobs.gather(-1, ids[:, len(prompt_ids):, None])[..., 0]  # (G, L): position t predicts token t + 1
    return [taken[i, : len(c)].tolist() for i, c in enumerate(completions)]


class HFBackend:
    """transformers sampler over a model already in memory (the trainer's policy) or loaded from a path."""

    logprobs_mode = "processed_logprobs"  # processed_logprobs() below

    def __init__(
        self,
        model,
        tokenizer,
        model_id: str,
        tokenizer_id: str | None = None,
        batch_size: int = 64,
        logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET_BYTES,
        share_prompt_prefill: bool = True,
        static_cache_budget_bytes: int = DEFAULT_STATIC_CACHE_BUDGET_BYTES,
    ):
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token: batched generation needs one to pad with")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.tokenizer_id = tokenizer_id or tokenizer_fingerprint(tokenizer)
        self.batch_size = batch_size  # sequences per generate call
        self.logits_budget_bytes = logits_budget_bytes
        # Run each distinct prompt through the model once and copy its KV cache to its n samples, instead of
        # n identical prefills (with G = 8 and few-shot prompts, prefill is most of the CPU time).
        self.share_prompt_prefill = share_prompt_prefill
        # A KV cache that grows (transformers' DynamicCache) copies itself whole at every step (torch.cat): with a
        # few hundred prompt tokens that is half of a CPU decoding step. A preallocated one is written in place.
        self.static_cache_budget_bytes = static_cache_budget_bytes
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # Progress inside a generate call, told after each decoding step (the budget: rows x max_tokens over its batches)
        self.on_tokens: ProgressCallback | None = None

    @classmethod
    def from_path(cls, path: str | Path, model_id: str | None = None, dtype: torch.dtype = torch.float32, **kwargs) -> HFBackend:
        from graft.rollouts.models import default_model_id

        model, tokenizer = load_model_and_tokenizer(path, dtype=dtype)
        if torch.cuda.is_available():
            model = model.to("cuda")
        return cls(model, tokenizer, model_id=model_id or default_model_id(path), **kwargs)

    @classmethod
    def from_settings(cls, settings: HFSettings, path: str | Path, *, model_id: str | None = None,
                      seed: int = 0) -> HFBackend:
        """The registered loader (`backends.load_backend`); each call's seed comes with its SamplingParams."""
        return cls.from_path(path, model_id=model_id, dtype=getattr(torch, settings.dtype), batch_size=settings.batch_size)

    def close(self) -> None:
        """Drop the model (before loading a newer checkpoint)."""
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def server_counts(self) -> None:
        return None  # samples in this process

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
        counter = _TokenCounter(self.on_tokens, len(rows) * params.max_tokens) if self.on_tokens else None
        device_rng = [self.model.device] if self.model.device.type == "cuda" else []
        with (
            torch.random.fork_rng(devices=device_rng), _eval_mode(self.model), _neutral_generation_config(self.model),
            _grouped_decode_attention(self.model),
        ):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(order), per_call):
                batch_rows = order[start : start + per_call]
                # row r is sample r % n of prompt r // n
                seeds = [params.sample_seed(r // params.n, r % params.n) for r in batch_rows] if params.seed_per_sample else None
                batch_samples = self._generate_batch([prompt_ids[rows[r]] for r in batch_rows], params, seeds, counter)
                samples_by_row.update(zip(batch_rows, batch_samples, strict=True))
                if counter is not None:  # rows that stopped early: their budget is done too
                    counter.finish_batch(sum(len(s.token_ids) for s in batch_samples), len(batch_rows) * params.max_tokens)
        return [[samples_by_row[i * params.n + j] for j in range(params.n)] for i in range(len(prompts))]

    @torch.inference_mode()
    def _generate_batch(self, prompt_ids: list[list[int]], params: SamplingParams, seeds: list[int] | None = None,
                        counter: _TokenCounter | None = None) -> list[Sample]:
        """seeds: one per row (params.seed_per_sample): each row draws from its own generator (`SeededDraw`).
        counter: told of every decoding step (progress)."""
        device = self.model.device
        width = max(len(ids) for ids in prompt_ids)
        # The tokens every prompt of the batch starts with (a system prompt, few-shot examples), at most all but
        # the last token of the shortest prompt: generate() itself must feed each row's last prompt token.
        shared = _common_prefix_length(prompt_ids) if self.share_prompt_prefill else 0
        # Padding goes between the shared prefix and the rest, so that the prefix sits at the same columns in
        # every row and every row's next token is predicted at the same (last) position. Masked, and skipped
        # by the positions (computed from the mask), the padding changes nothing.
        input_ids = torch.tensor(
            [ids[:shared] + [self.pad_token_id] * (width - len(ids)) + ids[shared:] for ids in prompt_ids], device=device
        )  # (B, P)
        attention_mask = torch.tensor(
            [[1] * shared + [0] * (width - len(ids)) + [1] * (len(ids) - shared) for ids in prompt_ids], device=device
        )  # (B, P)
        extra = {}  # what generate() gets besides the inputs: the prefilled KV cache, our own draws
        own_draws = seeds is not None and not params.greedy  # SeededDraw leaves one token per row for greedy search
        config = GenerationConfig(
            do_sample=not params.greedy and not own_draws,
            max_new_tokens=params.max_tokens,
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            repetition_penalty=1.0,
            min_new_tokens=0,
            # Explicit values: transformers fills unset ones from global defaults (top_k=50 among them).
            **({} if params.greedy or own_draws else {
                "temperature": params.temperature, "top_k": params.effective_top_k or 0, "top_p": params.top_p, "typical_p": 1.0,
            }),
        )
        processors = [SeededDraw(seeds, params, device)] if own_draws else []
        if counter is not None:
            processors.append(counter)
        if processors:
            extra["logits_processor"] = LogitsProcessorList(processors)
        distinct: dict[tuple[int, ...], int] = {}
        row_prompt = [distinct.setdefault(tuple(ids), len(distinct)) for ids in prompt_ids]  # (B,) index into distinct
        if self.share_prompt_prefill and width > 1:
            extra["past_key_values"] = self._shared_prefill(input_ids, attention_mask, row_prompt, shared, params.max_tokens)
        # synced_gpus=False: transformers would otherwise turn it on for an FSDP-sharded model in a process group and
        # all-reduce a flag every step; each process samples on its own here (a trainer rank gathers the weights first).
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                  synced_gpus=False, **extra)
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

    def _shared_prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row_prompt: list[int], shared: int, max_tokens: int
    ):
        """The KV cache of every row's prompt but its last token, with no prompt token computed twice.

        input_ids, attention_mask: (B, P) rows laid out as in _generate_batch; row_prompt: (B,) the distinct
        prompt of each row; shared: the length of the prefix that every row starts with. The prefix runs once,
        the rest of each distinct prompt once, and the cache is then copied to the rows: into a preallocated
        cache with room for max_tokens more when that fits static_cache_budget_bytes. `generate` feeds only
        the last prompt token, at the position it computes from the mask, so positions here come from the mask too.
        """
        from transformers import DynamicCache, StaticCache

        first_row = [row_prompt.index(u) for u in range(max(row_prompt) + 1)]  # (U,)
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # (B, P)
        cache = DynamicCache(config=self.model.config)
        # logits_to_keep=1: no logits are needed here, and (rows, P, V) floats would be large.
        if shared > 0:
            self.model(input_ids=input_ids[:1, :shared], position_ids=positions[:1, :shared], past_key_values=cache,
                       use_cache=True, logits_to_keep=1)  # (1, C)
            cache.batch_repeat_interleave(len(first_row))  # (1, ...) -> (U, ...)
        width = input_ids.shape[1]
        if width - 1 > shared:
            self.model(
                input_ids=input_ids[first_row, shared : width - 1],  # (U, P - 1 - C)
                attention_mask=attention_mask[first_row, : width - 1],  # (U, P - 1): the cached prefix and these tokens
                position_ids=positions[first_row, shared : width - 1],
                past_key_values=cache, use_cache=True, logits_to_keep=1,
            )
        rows = torch.tensor(row_prompt, device=input_ids.device)  # (B,)
        if not self._fits_static_cache(cache, len(row_prompt), width, max_tokens):
            cache.batch_select_indices(rows)  # (U, ...) -> (B, ...)
            return cache
        static = StaticCache(config=self.model.config, max_cache_len=width + max_tokens)
        for grown, fixed in zip(cache.layers, static.layers, strict=True):
            fixed.update(grown.keys[rows], grown.values[rows])  # (B, H_kv, P - 1, D) into (B, H_kv, P + max_tokens, D)
        return static

    def _fits_static_cache(self, cache, rows: int, width: int, max_tokens: int) -> bool:
        """Whether the prefilled `cache` goes into a preallocated StaticCache: on CPU only (on CUDA, generate()
        torch.compiles every new StaticCache shape), for plain full-attention layers, within the byte budget, and not
        under autocast (RoPE gives float32 keys next to bfloat16 values there, and a StaticCache holds one dtype)."""
        if self.model.device.type != "cpu" or cache.get_seq_length() != width - 1:
            return False
        if any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in cache.layers):
            return False
        if torch.is_autocast_enabled(self.model.device.type):
            return False
        bytes_per_token = sum(layer.keys[0, :, :1].nbytes + layer.values[0, :, :1].nbytes for layer in cache.layers)  # one row
        return rows * (width + max_tokens) * bytes_per_token <= self.static_cache_budget_bytes


class _TokenCounter(LogitsProcessor):
    """Reports (tokens sampled so far, budget) to a progress callback at each decoding step, counting every row of the
    batch until it ends (then corrected to what was sampled: `finish_batch`); leaves the scores as they are."""

    def __init__(self, report: ProgressCallback, budget: int):
        self.report, self.budget, self.done, self.batch_tokens = report, budget, 0, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.batch_tokens += scores.shape[0]
        self.report(self.done + self.batch_tokens, self.budget)
        return scores

    def finish_batch(self, sampled: int, budget: int) -> None:
        """A batch ended: count the tokens it really sampled, and take the budget its early stops left unused."""
        self.done += sampled
        self.budget -= budget - sampled
        self.batch_tokens = 0
        self.report(self.done, self.budget)


class SeededDraw(LogitsProcessor):
    """Each row's next token drawn from the processed distribution with the row's own generator (Gumbel-max: the
    argmax of log p + Gumbel noise is a draw from p), so that a row's samples do not depend on the batch it is in.
    Returns scores that leave only the drawn token, for generate()'s greedy search to pick."""

    def __init__(self, seeds: list[int], params: SamplingParams, device: torch.device):
        self.params = params
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logprobs = processed_logprobs(scores, self.params)  # (B, V), -inf outside the top-k/top-p support
        uniform = torch.stack([
            torch.rand(scores.shape[-1], generator=generator, device=scores.device) for generator in self.generators
        ])  # (B, V): row b's t-th draw comes from its own generator whatever the other rows are
        drawn = (logprobs - torch.log(-torch.log(uniform))).argmax(dim=-1)  # (B,)
        only_drawn = torch.full_like(scores, float("-inf"))  # (B, V)
        return only_drawn.scatter_(1, drawn[:, None], 0.0)


def _common_prefix_length(prompt_ids: list[list[int]]) -> int:
    """How many leading tokens all prompts share, at most all but the last token of the shortest."""
    shortest = min(len(ids) for ids in prompt_ids)
    length = 0
    while length < shortest - 1 and all(ids[length] == prompt_ids[0][length] for ids in prompt_ids):
        length += 1
    return length


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
def _grouped_decode_attention(model):
    """Sample with `grouped_decode_attention` when the model runs transformers' SDPA attention, then put it back
    (the trainer's forward and backward passes keep the model's own attention)."""
    saved = model.config._attn_implementation
    if saved == "sdpa":
        model.config._attn_implementation = GROUPED_DECODE_ATTENTION
    try:
        yield
    finally:
        model.config._attn_implementation = saved


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
