"""From per-sequence training samples to padded tensors, and the policy's logprobs on them.

Prompt and completion are tokenised separately and concatenated (a BPE can merge across the
boundary otherwise, and then the completion's tokens would not be the ones that were sampled).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TrainSample:
    """One sequence of a step's batch: on-policy (the learner's own rollout) or grafted (a peer's)."""

    prompt_id: str
    group: int  # index of its group within the step (grafted groups are normalised together)
    prompt_ids: list[int]  # learner token ids of the prompt (the learner's own template)
    completion_ids: list[int]  # learner token ids of the completion, EOS included when it finished
    num_content_tokens: int  # completion tokens before the EOS (what l_old sums over)
    advantage: float  # on-policy: GRPO advantage; grafted: peer-computed (negatives scaled)
    grafted: bool
    num_bytes: int  # UTF-8 length of the completion text
    behaviour_logprobs: list[float] | None = None  # grafted: log mu~ per completion token (len(completion_ids))
    peer_logprob_sum: float = 0.0  # grafted: the stored l_peer (EOS excluded)
    # Filled in by the no-grad pass before the update (rows without signal keep None):
    old_logprobs: Tensor | None = None  # (n,) float32, log pi_old of each completion token
    ref_logprobs: Tensor | None = None  # (n,) float32, log pi_ref (only when the KL is on)
    token_weight: Tensor | None = None  # (n,) float32, c = w * b on grafted rows, 1 on on-policy rows
    compat_weight: float = 1.0  # w of a grafted row
    finite: bool = True  # False when pi_old or w is not finite (the row is dropped)


@dataclass
class TokenBatch:
    """B sequences (prompt + completion) right-padded to L; their T response positions."""

    input_ids: Tensor  # (B, L) int64, prompt then completion then padding
    attention_mask: Tensor  # (B, L) int64, 1 on real tokens
    response_positions: Tensor  # (B, T) int64, index into L of each completion token (0 on padding)
    response_ids: Tensor  # (B, T) int64, the completion tokens (pad id on padding)
    mask: Tensor  # (B, T) bool, True on completion tokens (EOS included)
    content_mask: Tensor  # (B, T) bool, True on completion tokens before the EOS (the sum for l_old)

    def to(self, device: torch.device | str) -> TokenBatch:
        fields = (self.input_ids, self.attention_mask, self.response_positions, self.response_ids, self.mask,
                  self.content_mask)
        return TokenBatch(*(t.to(device) for t in fields))


def collate(samples: list[TrainSample], pad_id: int) -> TokenBatch:
    """Pad prompt + completion of each sample into one TokenBatch."""
    if not samples:
        raise ValueError("collate got no samples")
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    B, L = len(samples), max(lengths)
    T = max(max(len(s.completion_ids) for s in samples), 1)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((B, L), dtype=torch.long)  # (B, L)
    response_positions = torch.zeros((B, T), dtype=torch.long)  # (B, T)
    response_ids = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((B, T), dtype=torch.bool)  # (B, T)
    content_mask = torch.zeros((B, T), dtype=torch.bool)  # (B, T)
    for b, sample in enumerate(samples):
        P, n = len(sample.prompt_ids), len(sample.completion_ids)
        if P == 0:
            raise ValueError(
                f"sample of prompt {sample.prompt_id} has an empty prompt: the first completion token has no context"
            )
        input_ids[b, : P + n] = torch.tensor(sample.prompt_ids + sample.completion_ids, dtype=torch.long)
        attention_mask[b, : P + n] = 1
        response_positions[b, :n] = torch.arange(P, P + n)
        response_ids[b, :n] = torch.tensor(sample.completion_ids, dtype=torch.long)
        mask[b, :n] = True
        content_mask[b, : sample.num_content_tokens] = True
    return TokenBatch(input_ids, attention_mask, response_positions, response_ids, mask, content_mask)


def response_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0) -> Tensor:
    """log pi(completion token | prefix) at every response position: (B, T) float32, 0 on padding.

    The logits are divided by the sampling temperature, so pi is the distribution the learner's
    rollouts were drawn from."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, L, V)
    predicting = (batch.response_positions - 1).clamp(min=0)  # (B, T): position whose logits predict each token
    picked = torch.gather(logits, 1, predicting[:, :, None].expand(-1, -1, logits.shape[-1]))  # (B, T, V)
    picked = picked.float() / temperature
    token_logprobs = torch.gather(picked.log_softmax(dim=-1), 2, batch.response_ids[:, :, None]).squeeze(-1)  # (B, T)
    return torch.where(batch.mask, token_logprobs, torch.zeros_like(token_logprobs))
