"""The gate, peer choice, peer advantages and the compatibility weights, by hand (docs/algorithm.md sections 1, 2, 4, 5)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from graft.schemas import PeerLookupRequest, Problem, Rollout, RolloutGroup
from graft.trainer.gate import (
    behaviour_ratio,
    centre_under_weights,
    choose_peer_group,
    classify_group,
    compat_weights,
    effective_sample_size,
    gate_groups,
    peer_group_advantages,
)

PROBLEMS = [Problem.from_text(f"{a}+1=", str(a + 1), "toy_add") for a in range(6)]


def group(problem, rewards, model_id="peer", policy_step=0, std_normalize=True, advantages=None, tokenizer_id="tok"):
    from graft.schemas import group_advantages

    gid = f"{model_id}-{problem.prompt_id}-{policy_step}-{len(rewards)}-{sum(rewards)}"
    adv = advantages if advantages is not None else group_advantages(rewards, std_normalize)
    rows = [
        Rollout(rollout_id=f"{gid}-{i}", group_id=gid, prompt_id=problem.prompt_id, dataset="toy_add", model_id=model_id,
                tokenizer_id=tokenizer_id, policy_step=policy_step, temperature=1.0, top_p=1.0, max_tokens=8,
                completion_text="x", completion_token_ids=[1], token_logprobs=[-1.0], logprob_sum=-1.0, num_tokens=1,
                num_bytes=1, finish_reason="length", reward=r, correct=r > 0, advantage=a, group_size=len(rewards))
        for i, (r, a) in enumerate(zip(rewards, adv))
    ]
    return RolloutGroup.model_construct(rollouts=rows) if advantages is not None else RolloutGroup(rollouts=rows)


def rule(peer_models=None, min_policy_step=None, union=False, learner_model="learner"):
    """The lookup request a trainer with these settings sends (its `accepts` is the gate's rule)."""
    return PeerLookupRequest(prompt_ids=[PROBLEMS[0].prompt_id], learner_model=learner_model, peer_models=peer_models,
                             informative_only=not union, min_successes=1, min_policy_step=min_policy_step)


def test_classify():
    assert classify_group([0.0, 0.0, None]) == "all_fail"
    assert classify_group([1.0, 1.0]) == "all_success"
    assert classify_group([1.0, 0.0]) == "mixed"
    assert classify_group([1.0, None]) == "mixed"


def test_choose_the_first_informative_peer_group_in_serving_order_and_filters():
    """The candidates come in the store's serving order (freshest: highest policy step first): the gate takes the first
    group its rule accepts, informative ones first, and never re-sorts them (that would undo the serving order)."""
    p = PROBLEMS[0]
    old = group(p, [1.0, 0.0], policy_step=3)
    new = group(p, [0.0, 1.0, 0.0], policy_step=7)
    uninformative = group(p, [0.0, 0.0], policy_step=9)
    own = group(p, [1.0, 0.0], model_id="learner", policy_step=10)
    other = group(p, [1.0, 0.0, 1.0], model_id="other", policy_step=8)
    chosen, action = choose_peer_group([own, uninformative, new, old], rule())
    assert (chosen, action) == (new, "graft")
    assert choose_peer_group([other, new, old], rule(["peer"])) == (new, "graft")
    assert choose_peer_group([other, new, old], rule()) == (other, "graft")
    # another serving order (least_served, most_successes): its first group, whatever its step
    assert choose_peer_group([old, new, other], rule()) == (old, "graft")
    assert choose_peer_group([old, new], rule(min_policy_step=8)) == (None, "skip_no_peer")
    assert choose_peer_group([uninformative], rule()) == (None, "skip_uninformative")
    assert choose_peer_group([own], rule()) == (None, "skip_no_peer")
    all_success = group(p, [1.0, 1.0])
    assert choose_peer_group([all_success], rule()) == (None, "skip_uninformative")
    assert choose_peer_group([all_success], rule(union=True)) == (all_success, "graft_union")
    assert choose_peer_group([all_success, old], rule(union=True)) == (old, "graft")


def test_peer_groups_in_a_tokenizer_the_learner_lacks_are_refused():
    p = PROBLEMS[0]
    known = group(p, [1.0, 0.0], policy_step=2, tokenizer_id="tok-peer")
    unknown_newer = group(p, [0.0, 1.0], policy_step=5, model_id="other", tokenizer_id="tok-other")
    usable = {"tok-learner", "tok-peer"}
    # the first usable group wins over one served before it that the learner cannot weigh
    assert choose_peer_group([unknown_newer, known], rule(), usable) == (known, "graft")
    assert choose_peer_group([unknown_newer], rule(), usable) == (unknown_newer, "skip_no_peer_tokenizer")
    assert choose_peer_group([unknown_newer], rule(), None) == (unknown_newer, "graft")
    # the learner's own tokenizer needs no entry
    same = group(p, [1.0, 0.0], tokenizer_id="tok-learner")
    assert choose_peer_group([same], rule(), {"tok-learner"}) == (same, "graft")
    # an uninformative group stays "uninformative" whatever its tokenizer
    assert choose_peer_group([group(p, [0.0, 0.0], tokenizer_id="tok-other")], rule(), usable)[1] == (
        "skip_uninformative")
    rewards = [(p.prompt_id, [0.0, 0.0])]
    decisions = gate_groups(rewards, {p.prompt_id: [unknown_newer]}, rule(), max_grafted_fraction=1.0, rng=random.Random(0),
                            usable_tokenizers=usable)
    assert [(d.action, d.peer_group) for d in decisions] == [("skip_no_peer_tokenizer", unknown_newer)]


def test_a_group_without_mu_needs_no_peer_tokenizer_and_is_left_out_when_the_rule_requires_mu():
    p = PROBLEMS[0]
    with_mu = group(p, [1.0, 0.0], policy_step=2, tokenizer_id="tok-peer")
    text_only = RolloutGroup(rollouts=[
        r.model_copy(update={"logprobs_mode": "none", "token_logprobs": [], "logprob_sum": None})
        for r in group(p, [0.0, 1.0], policy_step=5, model_id="traces", tokenizer_id="tok-unknown").rollouts])
    usable = {"tok-learner", "tok-peer"}
    # nothing of it is projected, so a tokenizer the learner lacks does not refuse it; the first served wins as ever
    assert choose_peer_group([text_only, with_mu], rule(), usable) == (text_only, "graft")
    require_mu = rule().model_copy(update={"require_behaviour_logprobs": True})
    assert choose_peer_group([text_only, with_mu], require_mu, usable) == (with_mu, "graft")
    assert choose_peer_group([text_only], require_mu, usable) == (None, "skip_no_peer")
    now = 0
    assert rule().accepts_group(text_only, now) and not require_mu.accepts_group(text_only, now)


def test_a_group_whose_logprobs_are_not_mu_needs_no_peer_tokenizer_unless_its_mu_is_trusted():
    """schemas.mu_is_behaviour: 'raw' logprobs at T = 0.7 are not mu, so nothing of the group is projected and a
    tokenizer the learner lacks does not refuse it, nor does the store serve it under require_behaviour_logprobs; a
    rescored_unverified group needs its tokenizer only when graft.trust_unverified_mu makes its logprobs mu."""
    p = PROBLEMS[0]

    def relabelled(mode: str, temperature: float) -> RolloutGroup:
        return RolloutGroup(rollouts=[r.model_copy(update={"logprobs_mode": mode, "temperature": temperature})
                                      for r in group(p, [0.0, 1.0], tokenizer_id="tok-unknown").rollouts])

    usable = {"tok-learner"}
    raw = relabelled("raw", 0.7)
    assert not raw.has_behaviour_logprobs and relabelled("raw", 1.0).has_behaviour_logprobs
    for trust in (False, True):
        assert choose_peer_group([raw], rule(), usable, trust_unverified_mu=trust) == (raw, "graft")
    require_mu = rule().model_copy(update={"require_behaviour_logprobs": True})
    assert choose_peer_group([raw], require_mu, usable) == (None, "skip_no_peer")
    unverified = relabelled("rescored_unverified", 1.0)
    assert choose_peer_group([unverified], rule(), usable) == (unverified, "graft")
    assert choose_peer_group([unverified], rule(), usable, trust_unverified_mu=True) == (unverified,
                                                                                        "skip_no_peer_tokenizer")
    decisions = gate_groups([(p.prompt_id, [0.0, 0.0])], {p.prompt_id: [unverified]}, rule(), max_grafted_fraction=1.0,
                            rng=random.Random(0), usable_tokenizers=usable, trust_unverified_mu=True)
    assert [d.action for d in decisions] == ["skip_no_peer_tokenizer"]


def test_gate_groups_and_the_grafted_fraction_cap():
    rewards = {
        PROBLEMS[0].prompt_id: [0.0, 0.0],  # all fail, peer informative -> graft
        PROBLEMS[1].prompt_id: [0.0, 0.0],  # all fail, peer informative -> graft
        PROBLEMS[2].prompt_id: [0.0, 0.0],  # all fail, no peer -> skip_no_peer
        PROBLEMS[3].prompt_id: [1.0, 0.0],  # mixed -> on-policy (even with a peer group)
        PROBLEMS[4].prompt_id: [1.0, 1.0],  # all success -> on-policy, zero advantage
        PROBLEMS[5].prompt_id: [0.0, 0.0],  # all fail, peer uninformative -> skip_uninformative
    }
    peers = {
        PROBLEMS[0].prompt_id: [group(PROBLEMS[0], [1.0, 0.0])],
        PROBLEMS[1].prompt_id: [group(PROBLEMS[1], [1.0, 0.0])],
        PROBLEMS[3].prompt_id: [group(PROBLEMS[3], [1.0, 0.0])],
        PROBLEMS[5].prompt_id: [group(PROBLEMS[5], [0.0, 0.0])],
    }
    decisions = gate_groups(list(rewards.items()), peers, rule(), max_grafted_fraction=0.5, rng=random.Random(0))
    assert [d.action for d in decisions] == ["graft", "graft", "skip_no_peer", "onpolicy", "onpolicy", "skip_uninformative"]
    assert [d.kind for d in decisions] == ["all_fail", "all_fail", "all_fail", "mixed", "all_success", "all_fail"]
    capped = gate_groups(list(rewards.items()), peers, rule(), max_grafted_fraction=0.2, rng=random.Random(0))  # floor(0.2 * 6) = 1
    assert sorted(d.action for d in capped[:2]) == ["graft", "skip_capped"]
    off = gate_groups(list(rewards.items()), peers, None, max_grafted_fraction=0.5, rng=random.Random(0))
    assert all(d.action == "onpolicy" for d in off)


def test_peer_advantages_are_recomputed_and_checked():
    g = group(PROBLEMS[0], [1.0, 0.0, 0.0, 0.0])
    advantages, agrees = peer_group_advantages(g, std_normalize=True)
    assert advantages == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5) and agrees
    dr, agrees = peer_group_advantages(g, std_normalize=False)
    assert dr == pytest.approx([0.75, -0.25, -0.25, -0.25]) and agrees
    tampered = group(PROBLEMS[0], [1.0, 0.0], advantages=[5.0, -5.0])
    advantages, agrees = peer_group_advantages(tampered, std_normalize=True)
    assert not agrees and advantages == pytest.approx([0.7071, -0.7071], abs=1e-3)


def test_compat_weights_by_hand():
    l_old = torch.tensor([-10.0, -2.0, -6.0, -100.0, -7.0])
    l_peer = torch.tensor([-6.0, -6.0, -6.0, 0.0, -6.0])
    n_bytes = torch.tensor([4, 4, 4, 2, 2])
    w, log_rho = compat_weights(l_old, l_peer, n_bytes, kappa=1.0, log_rho_min=None)
    # per-byte log rho: -1, +1, 0, -50 -> clamped -10, -0.5
    assert log_rho.tolist() == pytest.approx([-1.0, 1.0, 0.0, -10.0, -0.5])
    assert w.tolist() == pytest.approx([math.exp(-1), 1.0, 1.0, math.exp(-10), math.exp(-0.5)], rel=1e-6)
    w2, _ = compat_weights(l_old, l_peer, n_bytes, kappa=2.0, log_rho_min=-0.75)
    assert w2.tolist() == pytest.approx([0.0, 1.0, 1.0, 0.0, math.exp(-1.0)], rel=1e-6)


def test_advantages_centred_under_the_weights_behaviour_ratio_and_ess():
    # group 0: w 0.3 on its two correct rows, 0.8 on its two wrong ones; A = +-0.866: sum w A = -0.866 before
    a = 0.5 / math.sqrt(1 / 3)
    advantages = torch.tensor([a, a, -a, -a, 1.0, 0.7, -0.7], dtype=torch.float64)
    w = torch.tensor([0.3, 0.3, 0.8, 0.8, 0.5, 0.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    centred = centre_under_weights(advantages, w, groups)
    shift = (0.6 * a - 1.6 * a) / 2.2  # sum w A / sum w of group 0
    assert centred.tolist() == pytest.approx([a - shift, a - shift, -a - shift, -a - shift, 0.0, 0.7, -0.7])
    assert float((w[:4] * centred[:4]).sum()) == pytest.approx(0.0, abs=1e-12)  # no net push on shared tokens
    assert float((w[:4] * advantages[:4]).sum()) == pytest.approx(-a)  # what the uncentred group gave
    old = torch.tensor([[-1.0, -1.0, -3.0]])
    mu = torch.tensor([[-2.0, -0.5, -1.0]])
    # exp(old - mu) = e^1 (capped at 2), e^-0.5, e^-2
    assert behaviour_ratio(old, mu, cap=2.0).tolist()[0] == pytest.approx([2.0, math.exp(-0.5), math.exp(-2.0)])
    assert effective_sample_size(torch.tensor([1.0, 1.0, 1.0, 1.0])) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
