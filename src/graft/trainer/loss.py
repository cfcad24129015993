"""The GRPO/GRAFT policy loss: a pure function over a typed batch (docs/algorithm.md sections 5 and 6).

One function serves on-policy and grafted tokens. Everything that differs between them arrives in
the batch: the per-token weight c (1 on-policy, w_j * b_jt grafted), the advantage (peer-computed,
already scaled by `peer_negative_scale`), and `is_grafted`, which selects the luffy shaping and
whether the KL applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from graft.trainer.config import GraftOptions, PPOConfig, RolloutConfig, TrainConfig

KL_CLAMP = 10.0  # per-token k3 KL bound (verl's low_var_kl)


@dataclass(frozen=True)
class LossConfig:
    """The knobs of `graft_loss`, read from the trainer config's sections (one definition, one default each):
    ppo's clip (eps_low, eps_high, dual_clip_c), loss_agg and kl_beta; graft's token_is, luffy_gamma and
    kl_on_peer; and the Dr. GRPO normaliser of seq-mean-token-sum-norm (rollout.max_response_tokens)."""

    ppo: PPOConfig = field(default_factory=PPOConfig)
    graft: GraftOptions = field(default_factory=GraftOptions)
    token_sum_norm: float = float(RolloutConfig.model_fields["max_response_tokens"].default)

    @classmethod
    def from_train(cls, cfg: TrainConfig) -> LossConfig:
        return cls(cfg.ppo, cfg.graft, float(cfg.rollout.max_response_tokens))


@dataclass
class LossBatch:
    """B response sequences padded to T tokens; response positions only (the prompt is not here)."""

    logprobs: Tensor  # (B, T) float32, log pi_theta(token) under the current policy; carries the gradient
    old_logprobs: Tensor  # (B, T) float32, log pi_old(token), the proximal anchor; no grad
    advantages: Tensor  # (B,) float32, per-sequence advantage (grafted: peer-computed, negative ones scaled)
    mask: Tensor  # (B, T) bool, True on valid response tokens (EOS included, padding excluded)
    token_weight: Tensor  # (B, T) float32, c = w_j * b_jt on grafted rows, 1 on on-policy rows; no grad
    is_grafted: Tensor  # (B,) bool, True for rows that came from a peer group
    ref_logprobs: Tensor | None = None  # (B, T) float32, log pi_ref(token); needed only when kl_beta > 0
    # (B,) bool, True for grafted rows whose peer row had no behaviour logprobs (b = 1, w = 1); metrics only
    without_mu: Tensor | None = None

    def __post_init__(self) -> None:
        B, T = self.logprobs.shape
        expected = {
            "old_logprobs": (B, T), "mask": (B, T), "token_weight": (B, T), "advantages": (B,), "is_grafted": (B,),
        }
        for name, shape in expected.items():
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise ValueError(f"LossBatch.{name} has shape {actual}; expected {shape} (logprobs is {(B, T)})")
        if self.without_mu is not None and (tuple(self.without_mu.shape) != (B,) or self.without_mu.dtype != torch.bool):
            raise ValueError(f"LossBatch.without_mu must be a bool tensor of shape {(B,)}")
        if self.ref_logprobs is not None and tuple(self.ref_logprobs.shape) != (B, T):
            raise ValueError(f"LossBatch.ref_logprobs has shape {tuple(self.ref_logprobs.shape)}; expected {(B, T)}")
        if self.mask.dtype != torch.bool or self.is_grafted.dtype != torch.bool:
            raise ValueError("LossBatch.mask and LossBatch.is_grafted must be bool tensors")


def agg_denominator(mask: Tensor, cfg: LossConfig) -> float:
    """What `graft_loss` divides the summed token losses by, for a batch with this mask (B, T).

    The loop uses it to weight micro-batches so that their sum equals the loss of the whole mini-batch."""
    if cfg.ppo.loss_agg == "token-mean":
        return float(mask.sum())
    rows_with_tokens = float((mask.sum(dim=1) > 0).sum())
    if cfg.ppo.loss_agg == "seq-mean-token-mean":
        return rows_with_tokens
    return rows_with_tokens * cfg.token_sum_norm


def aggregate(values: Tensor, mask: Tensor, cfg: LossConfig) -> Tensor:
    """Reduce per-token values (B, T) over valid tokens (B, T) bool to a scalar with the configured rule.

    token-mean divides by the unweighted count of valid tokens (never by the sum of weights: that
    would undo the down-weighting of peer tokens). Both sequence means count only rows with at least
    one valid token: an empty completion is no sequence to average over, under either rule."""
    maskf = mask.to(values.dtype)
    if cfg.ppo.loss_agg == "token-mean":
        return (values * maskf).sum() / maskf.sum().clamp(min=1.0)
    tokens_per_seq = maskf.sum(dim=1)  # (B,)
    rows_with_tokens = (tokens_per_seq > 0).to(values.dtype).sum().clamp(min=1.0)  # scalar
    if cfg.ppo.loss_agg == "seq-mean-token-mean":
        seq_means = (values * maskf).sum(dim=1) / tokens_per_seq.clamp(min=1.0)  # (B,), 0 on empty rows
        return seq_means.sum() / rows_with_tokens
    return (values * maskf).sum() / (rows_with_tokens * cfg.token_sum_norm)


def graft_loss(batch: LossBatch, cfg: LossConfig) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss over on-policy and grafted tokens, plus the optional KL.

    Per token: L = c * max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), dual-clipped at -A * c_dual
    when A < 0; r = exp(logprobs - old_logprobs). With token_is = luffy, grafted tokens use
    -A * c * p / (p + gamma), p = exp(logprobs), unclipped. Returns the scalar loss and detached
    metrics (clip fractions on-policy and grafted, KL, ratio statistics)."""
    logprobs, mask = batch.logprobs, batch.mask  # (B, T), (B, T)
    advantages = batch.advantages.to(logprobs.dtype)[:, None]  # (B, 1)
    log_ratio = (logprobs - batch.old_logprobs).clamp(-20.0, 20.0)  # (B, T); clamp keeps exp finite
    ratio = torch.exp(log_ratio)  # (B, T)

    unclipped = -advantages * ratio  # (B, T)
    clipped = -advantages * ratio.clamp(1.0 - cfg.ppo.eps_low, 1.0 + cfg.ppo.eps_high)  # (B, T)
    pg = torch.maximum(unclipped, clipped)  # (B, T)
    is_clipped = clipped > unclipped  # (B, T): the clipped branch is active (no gradient through it)
    if cfg.ppo.dual_clip_c is not None:
        dual_bound = -advantages * cfg.ppo.dual_clip_c  # (B, 1), positive where A < 0
        dual_active = (advantages < 0) & (pg > dual_bound)  # (B, T)
        pg = torch.where(dual_active, dual_bound.expand_as(pg), pg)
        is_clipped = is_clipped | dual_active

    grafted_rows = batch.is_grafted[:, None].expand_as(mask)  # (B, T) bool
    if cfg.graft.token_is == "luffy":
        prob = torch.exp(logprobs)  # (B, T)
        shaped = -advantages * prob / (prob + cfg.graft.luffy_gamma)  # (B, T)
        pg = torch.where(grafted_rows, shaped, pg)
        is_clipped = is_clipped & ~grafted_rows

    token_loss = batch.token_weight.to(pg.dtype) * pg  # (B, T)
    pg_loss = aggregate(token_loss, mask, cfg)
    loss = pg_loss

    kl_value = torch.zeros((), dtype=logprobs.dtype)
    if cfg.ppo.kl_beta > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_beta > 0 but LossBatch.ref_logprobs is None; compute reference logprobs for the batch")
        log_ref_ratio = (batch.ref_logprobs - logprobs).clamp(-20.0, 20.0)  # (B, T)
        # k3 estimator (>= 0), clamped at 10 as verl's low_var_kl: one token the reference finds far likelier
        # (ref - logp ~ 12 gives e^12 ~ 1.6e5) would otherwise outweigh the whole policy term.
        kl = (torch.exp(log_ref_ratio) - log_ref_ratio - 1.0).clamp(-KL_CLAMP, KL_CLAMP)  # (B, T)
        kl_mask = mask if cfg.graft.kl_on_peer else mask & ~grafted_rows  # (B, T)
        # Same denominator as the policy term (all valid tokens), so beta means the same with or without peers.
        kl_value = aggregate(torch.where(kl_mask, kl, torch.zeros_like(kl)), mask, cfg)
        loss = loss + cfg.ppo.kl_beta * kl_value

    with torch.no_grad():
        onpolicy_mask = mask & ~grafted_rows
        grafted_mask = mask & grafted_rows
        metrics = {
            "loss": float(loss.detach()),
            "pg_loss": float(pg_loss.detach()),
            "kl": float(kl_value.detach()),
            "clip_frac_onpolicy": _masked_mean(is_clipped.float(), onpolicy_mask),
            "clip_frac_grafted": _masked_mean(is_clipped.float(), grafted_mask),
            "ratio_mean": _masked_mean(ratio, mask),
            "token_weight_mean_grafted": _masked_mean(batch.token_weight.float(), grafted_mask),
            "tokens_onpolicy": float(onpolicy_mask.sum()),
            "tokens_grafted": float(grafted_mask.sum()),
        }
        if batch.without_mu is not None:  # docs/algorithm.md section 11: grafted tokens without mu, logged apart
            without_mu_mask = grafted_mask & batch.without_mu[:, None]  # (B, T)
            metrics["clip_frac_grafted_without_mu"] = _masked_mean(is_clipped.float(), without_mu_mask)
            metrics["tokens_grafted_without_mu"] = float(without_mu_mask.sum())
    return loss, metrics


def _masked_mean(values: Tensor, mask: Tensor) -> float:
    count = int(mask.sum())
    return float((values * mask).sum() / count) if count else float("nan")
