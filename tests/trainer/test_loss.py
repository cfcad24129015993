"""Hand-computed losses and gradients of graft_loss (docs/algorithm.md sections 5 and 6)."""

from __future__ import annotations

import math

import pytest
import torch

from graft.schemas import group_advantages
from graft.trainer.config import GraftOptions, PPOConfig
from graft.trainer.loss import LossBatch, LossConfig, agg_denominator, graft_loss

CFG = LossConfig()


def make_batch(lengths, advantages, *, grafted=None, weights=None, log_ratio=None, ref_delta=None):
    """Rows with the given lengths; logprobs == old_logprobs unless log_ratio (B, T) is given."""
    B, T = len(lengths), max(lengths)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    old = torch.full((B, T), -1.0) * mask
    shift = torch.zeros(B, T) if log_ratio is None else torch.tensor(log_ratio, dtype=torch.float32)
    logprobs = (old + shift * mask).clone().requires_grad_(True)
    token_weight = torch.ones(B, T) if weights is None else torch.tensor(weights, dtype=torch.float32)
    is_grafted = torch.zeros(B, dtype=torch.bool) if grafted is None else torch.tensor(grafted)
    ref = None if ref_delta is None else (old + torch.tensor(ref_delta, dtype=torch.float32)) * mask
    batch = LossBatch(
        logprobs=logprobs, old_logprobs=old, advantages=torch.tensor(advantages, dtype=torch.float32), mask=mask,
        token_weight=token_weight, is_grafted=is_grafted, ref_logprobs=ref,
    )
    return batch, logprobs


def loss_and_grad(batch, logprobs, cfg=CFG):
    loss, metrics = graft_loss(batch, cfg)
    loss.backward()
    return float(loss.detach()), logprobs.grad.clone(), metrics


def test_all_fail_group_gives_zero_loss_and_zero_gradient():
    advantages = group_advantages([0.0, 0.0, 0.0, 0.0])
    assert advantages == [0.0] * 4
    batch, logprobs = make_batch([3, 2, 4, 1], advantages)
    loss, grad, _ = loss_and_grad(batch, logprobs)
    assert loss == 0.0
    assert torch.count_nonzero(grad) == 0


def test_all_success_group_gives_zero_loss_and_zero_gradient():
    batch, logprobs = make_batch([3, 2], group_advantages([1.0, 1.0]))
    loss, grad, _ = loss_and_grad(batch, logprobs)
    assert loss == 0.0
    assert torch.count_nonzero(grad) == 0


def test_mixed_group_token_mean_by_hand():
    # rewards [1, 0, 0, 0]: mean 0.25, unbiased std 0.5 -> A = [1.5, -0.5, -0.5, -0.5] (up to the 1e-6)
    advantages = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert advantages == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    lengths = [2, 3, 1, 2]  # N = 8 valid tokens
    batch, logprobs = make_batch(lengths, advantages)
    loss, grad, metrics = loss_and_grad(batch, logprobs)
    # ratio = 1 everywhere: loss = (1/N) sum_b -A_b * n_b = -(1.5*2 - 0.5*3 - 0.5*1 - 0.5*2) / 8 = 0
    expected = -sum(a * n for a, n in zip(advantages, lengths)) / 8
    assert loss == pytest.approx(expected, abs=1e-6)
    # d loss / d logprob_bt = -A_b * ratio / N on valid tokens, 0 on padding
    for b, n in enumerate(lengths):
        assert grad[b, :n].tolist() == pytest.approx([-advantages[b] / 8] * n, rel=1e-6)
        assert grad[b, n:].abs().sum() == 0
    assert metrics["clip_frac_onpolicy"] == 0.0


def test_ppo_clip_and_dual_clip_by_hand():
    log_r = [[math.log(1.5)], [math.log(0.5)], [math.log(5.0)], [math.log(2.0)], [math.log(1.1)]]
    advantages = [1.0, -1.0, -1.0, -1.0, 1.0]
    batch, logprobs = make_batch([1] * 5, advantages, log_ratio=log_r)
    loss, grad, metrics = loss_and_grad(batch, logprobs)
    # row 0: A>0, r=1.5 > 1.28 -> -1.28 (clipped, no grad)
    # row 1: A<0, r=0.5 < 0.8 -> max(0.5, 0.8) = 0.8 (clipped, no grad)
    # row 2: A<0, r=5 -> 5 > dual bound 3 -> 3 (dual clipped, no grad)
    # row 3: A<0, r=2 -> max(2, 1.28) = 2 (< 3, unclipped, grad = -A * r / N = 2/5)
    # row 4: A>0, r=1.1 -> -1.1 (inside, grad = -1.1/5)
    expected = (-1.28 + 0.8 + 3.0 + 2.0 - 1.1) / 5
    assert loss == pytest.approx(expected, rel=1e-5)
    assert grad[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.0, 2.0 / 5, -1.1 / 5], abs=1e-6)
    assert metrics["clip_frac_onpolicy"] == pytest.approx(3 / 5)

    no_dual = LossConfig(PPOConfig(dual_clip_c=None))
    batch, logprobs = make_batch([1] * 5, advantages, log_ratio=log_r)
    loss, grad, _ = loss_and_grad(batch, logprobs, no_dual)
    assert loss == pytest.approx((-1.28 + 0.8 + 5.0 + 2.0 - 1.1) / 5, rel=1e-5)
    assert grad[2, 0] == pytest.approx(5.0 / 5)


def test_grafted_tokens_are_weighted_by_w_times_b_and_normalised_by_unweighted_count():
    # one on-policy row (A=0.5, 2 tokens) and one grafted row (A=-1, 3 tokens, c = w*b = 0.5*[1, 2, 0.25])
    weights = [[1.0, 1.0, 0.0], [0.5, 1.0, 0.125]]
    batch, logprobs = make_batch([2, 3], [0.5, -1.0], grafted=[False, True], weights=weights)
    loss, grad, metrics = loss_and_grad(batch, logprobs)
    N = 5  # unweighted count of valid tokens, never sum(w)
    expected = (-0.5 * 2 + 1.0 * (0.5 + 1.0 + 0.125)) / N
    assert loss == pytest.approx(expected, rel=1e-6)
    assert grad[0, :2].tolist() == pytest.approx([-0.5 / N] * 2)
    assert grad[1].tolist() == pytest.approx([0.5 / N, 1.0 / N, 0.125 / N])
    assert metrics["clip_frac_grafted"] == 0.0
    assert metrics["tokens_grafted"] == 3 and metrics["tokens_onpolicy"] == 2


def test_grafted_group_with_unit_weights_equals_grpo_on_same_tokens():
    advantages = group_advantages([1.0, 0.0, 1.0, 0.0])
    lengths = [3, 1, 2, 4]
    log_r = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).mul(0.3).tolist()
    on_policy, lp_on = make_batch(lengths, advantages, log_ratio=log_r)
    grafted, lp_gr = make_batch(lengths, advantages, grafted=[True] * 4, log_ratio=log_r)
    loss_on, grad_on, _ = loss_and_grad(on_policy, lp_on)
    loss_gr, grad_gr, _ = loss_and_grad(grafted, lp_gr)
    assert loss_gr == loss_on
    assert torch.equal(grad_gr, grad_on)


def test_seq_mean_token_mean_and_dr_grpo_normalisers_by_hand():
    lengths, advantages = [1, 3], [1.0, -1.0]
    batch, logprobs = make_batch(lengths, advantages)
    loss, grad, _ = loss_and_grad(batch, logprobs, LossConfig(PPOConfig(loss_agg="seq-mean-token-mean")))
    # per-sequence means: -1 and +1 -> mean 0; grads -A / (n_b * B)
    assert loss == pytest.approx(0.0, abs=1e-7)
    assert grad[0, 0] == pytest.approx(-1.0 / 2)
    assert grad[1, :3].tolist() == pytest.approx([1.0 / 6] * 3)

    batch, logprobs = make_batch(lengths, advantages)
    loss, grad, _ = loss_and_grad(batch, logprobs, LossConfig(PPOConfig(loss_agg="seq-mean-token-sum-norm"), token_sum_norm=10.0))
    assert loss == pytest.approx((-1.0 + 3.0) / (2 * 10.0))
    assert grad[1, 0] == pytest.approx(1.0 / 20)


def test_both_sequence_means_leave_empty_rows_out():
    """An empty completion (no valid token) is no sequence under either rule: adding one changes neither
    loss nor denominator (a batch of one 3-token row with A = -1: token sum 3)."""
    for agg, expected in (("seq-mean-token-mean", 1.0), ("seq-mean-token-sum-norm", 3.0 / 10.0)):
        cfg = LossConfig(PPOConfig(loss_agg=agg), token_sum_norm=10.0)
        alone, _ = make_batch([3], [-1.0])
        with_empty, _ = make_batch([3, 0], [-1.0, 0.5])
        assert float(graft_loss(alone, cfg)[0].detach()) == pytest.approx(expected, rel=1e-6), agg
        assert float(graft_loss(with_empty, cfg)[0].detach()) == pytest.approx(expected, rel=1e-6), agg
        assert agg_denominator(with_empty.mask, cfg) == agg_denominator(alone.mask, cfg), agg


def test_k3_kl_is_clamped_at_10_per_token_as_verls_low_var_kl():
    # ref - logprob = 12 on one token: k3 = e^12 - 13 ~ 1.6e5 unclamped; 10 after the clamp (and no gradient through it)
    cfg = LossConfig(PPOConfig(kl_beta=1.0))
    batch, logprobs = make_batch([2], [0.0], ref_delta=[[12.0, math.log(2.0)]])
    loss, grad, metrics = loss_and_grad(batch, logprobs, cfg)
    k3 = 2.0 - math.log(2.0) - 1.0
    assert metrics["kl"] == pytest.approx((10.0 + k3) / 2, rel=1e-5)
    assert grad[0, 0] == 0.0 and grad[0, 1] == pytest.approx((1.0 - 2.0) / 2, rel=1e-5)  # d k3 / d logp = 1 - e^(ref - logp)


def test_kl_applies_to_onpolicy_tokens_unless_kl_on_peer():
    # ref - logprob = log 2 on every token: k3 = 2 - log 2 - 1
    delta = [[math.log(2.0)] * 2, [math.log(2.0)] * 2]
    k3 = 2.0 - math.log(2.0) - 1.0
    cfg = LossConfig(PPOConfig(kl_beta=0.5))
    batch, logprobs = make_batch([2, 2], [0.0, 0.0], grafted=[False, True], ref_delta=delta)
    loss, _, metrics = loss_and_grad(batch, logprobs, cfg)
    assert metrics["kl"] == pytest.approx(k3 * 2 / 4, rel=1e-5)  # on-policy tokens only, over all 4 tokens
    assert loss == pytest.approx(0.5 * k3 * 2 / 4, rel=1e-5)
    batch, logprobs = make_batch([2, 2], [0.0, 0.0], grafted=[False, True], ref_delta=delta)
    loss, _, _ = loss_and_grad(batch, logprobs, LossConfig(PPOConfig(kl_beta=0.5), GraftOptions(kl_on_peer=True)))
    assert loss == pytest.approx(0.5 * k3, rel=1e-5)


def test_luffy_shapes_grafted_tokens_only():
    cfg = LossConfig(graft=GraftOptions(token_is="luffy", luffy_gamma=0.1))
    batch, logprobs = make_batch([1, 1], [1.0, 1.0], grafted=[False, True])
    loss, grad, _ = loss_and_grad(batch, logprobs, cfg)
    p = math.exp(-1.0)
    shaped = p / (p + 0.1)
    assert loss == pytest.approx((-1.0 - shaped) / 2, rel=1e-6)
    # d/dlp [p / (p + g)] = p * g / (p + g)^2
    assert grad[1, 0] == pytest.approx(-(p * 0.1 / (p + 0.1) ** 2) / 2, rel=1e-5)
    assert grad[0, 0] == pytest.approx(-1.0 / 2)


def test_micro_batches_weighted_by_denominator_sum_to_the_full_loss():
    torch.manual_seed(1)
    lengths, advantages = [3, 1, 4, 2], [0.7, -1.2, 0.3, -0.4]
    log_r = (torch.randn(4, 4) * 0.2).tolist()
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        cfg = LossConfig(PPOConfig(loss_agg=agg), token_sum_norm=8.0)
        full, _ = make_batch(lengths, advantages, log_ratio=log_r)
        full_loss, _ = graft_loss(full, cfg)
        total = 0.0
        for rows in ([0, 1], [2, 3]):
            width = max(lengths[i] for i in rows)
            part, _ = make_batch(
                [lengths[i] for i in rows], [advantages[i] for i in rows], log_ratio=[log_r[i][:width] for i in rows]
            )
            part_loss, _ = graft_loss(part, cfg)
            total += float(part_loss.detach()) * agg_denominator(part.mask, cfg) / agg_denominator(full.mask, cfg)
        assert total == pytest.approx(float(full_loss.detach()), rel=1e-5), agg


def test_shape_errors_are_reported():
    batch, _ = make_batch([2, 2], [0.0, 0.0])
    with pytest.raises(ValueError, match="advantages has shape"):
        LossBatch(batch.logprobs, batch.old_logprobs, torch.zeros(3), batch.mask, batch.token_weight, batch.is_grafted)


def test_clip_fraction_of_grafted_tokens_without_mu_is_logged_apart():
    # rows: on-policy, grafted with mu, grafted without mu (docs/algorithm.md section 11); ratios e^0.5 > 1 + eps_high clip
    # on positive advantages, e^0 does not
    log_ratio = [[0.5, 0.0], [0.0, 0.0], [0.5, 0.5]]
    batch, logprobs = make_batch([2, 2, 2], [1.0, 1.0, 1.0], grafted=[False, True, True], log_ratio=log_ratio)
    batch.without_mu = torch.tensor([False, False, True])
    _, _, metrics = loss_and_grad(batch, logprobs)
    assert metrics["clip_frac_onpolicy"] == 0.5 and metrics["clip_frac_grafted"] == 0.5
    assert metrics["clip_frac_grafted_without_mu"] == 1.0 and metrics["tokens_grafted_without_mu"] == 2
    with pytest.raises(ValueError, match="without_mu"):
        LossBatch(batch.logprobs, batch.old_logprobs, batch.advantages, batch.mask, batch.token_weight,
                  batch.is_grafted, without_mu=torch.tensor([True]))
