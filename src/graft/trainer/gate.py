"""The gate (docs/algorithm.md section 1), peer advantages (section 2) and the compatibility weights (sections 4, 5).

Functions over groups and tensors that keep no state; all are local but `gate_groups`, which is a collective
under data parallel (its cap counts the groups of all ranks: every rank calls it together, with the same rng).
The loop calls them once per step. Which peer group may be grafted is the step's lookup request's rule
(`PeerLookupRequest.accepts`, which the store's lookup applies too); the gate adds what only the trainer knows:
the tokenizers it can weigh, the preference for informative groups (else the first in the store's serving order),
and the cap on grafted groups. The gate's tally (`gate_tally`: why the all-fail groups it did not graft got none), the
metrics every trainer logs alike, and the one warning per refused tokenizer (`RefusedTokenizers`) sit beside it.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from graft.schemas import PeerLookupRequest, RolloutGroup, group_advantages
from graft.schemas.api import group_created_us, now_us
from graft.schemas.rollout import ADVANTAGE_TOLERANCE
from graft.trainer.distributed import DistContext, rank_spans

if TYPE_CHECKING:
    from graft.trainer.store_link import LookupResult

log = logging.getLogger("graft.trainer.peers")  # the refused tokenizers' warning, as the peers' other messages

GroupKind = Literal["all_fail", "all_success", "mixed"]
Action = Literal[
    "onpolicy", "graft", "graft_union", "skip_no_peer", "skip_uninformative", "skip_no_peer_tokenizer", "skip_capped"
]
GRAFT_ACTIONS = ("graft", "graft_union")
LOG_RHO_CLAMP = 10.0


def classify_group(rewards: list[float | None]) -> GroupKind:
    """all_fail: no reward > 0; all_success: every reward equal and > 0; otherwise mixed."""
    scored = [r for r in rewards if r is not None]
    if not any(r > 0 for r in scored):
        return "all_fail"
    if len(scored) == len(rewards) and all(r == scored[0] for r in scored):
        return "all_success"
    return "mixed"


@dataclass
class GateDecision:
    """What the step does with one learner group."""

    prompt_id: str
    kind: GroupKind  # of the learner's own group
    action: Action  # onpolicy: train on the learner's group (mixed, all-success, or gate off); graft*: use peer_group
    # the chosen peer group (graft, graft_union, capped), or the one refused for want of its tokenizer
    peer_group: RolloutGroup | None = None

    @property
    def grafts(self) -> bool:
        """Whether the step trains on the peer group instead of the learner's own."""
        return self.action in GRAFT_ACTIONS


def choose_peer_group(
    candidates: list[RolloutGroup],
    rule: PeerLookupRequest,
    usable_tokenizers: set[str] | None = None,
    now: int | None = None,
    trust_unverified_mu: bool = False,
) -> tuple[RolloutGroup | None, Action]:
    """The first peer group of `candidates` (in the order the store served them: the request's serving order, freshest,
    most_successes or least_served) that `rule` accepts, informative ones first, else why none: no group from an
    admitted peer ("skip_no_peer"), none with an admitted outcome ("skip_uninformative").

    An all-success group is accepted when the rule asks for no informative groups only (graft.union_all_success)
    and is grafted as "graft_union". usable_tokenizers: the tokenizer ids whose text the learner can weigh (its
    own and the peers' it has); a group in another one is refused (one whose logprobs are not used as mu is not:
    nothing of it is projected; `RolloutGroup.mu_is_behaviour` with trust_unverified_mu, graft.trust_unverified_mu),
    and when that leaves nothing, the first refused group comes back with "skip_no_peer_tokenizer".
    None: any tokenizer. now: microseconds since the epoch, for the rule's max_age_s (default: now)."""
    now = now_us() if now is None else now
    eligible = [g for g in candidates if rule.admits_source(g.model_id, g.policy_step, group_created_us(g), now)
                and rule.admits_behaviour(g.has_behaviour_logprobs)]
    if not eligible:
        return None, "skip_no_peer"
    useful = [g for g in eligible if rule.admits_outcome(g.successes, len(g.rollouts))]
    if not useful:
        return None, "skip_uninformative"
    # a group without mu has nothing to project: its text is tokenised by the learner, whatever the peer's tokenizer
    usable = [g for g in useful if usable_tokenizers is None or g.rollouts[0].tokenizer_id in usable_tokenizers
              or not g.mu_is_behaviour(trust_unverified_mu)]
    if not usable:
        return _first_informative(useful), "skip_no_peer_tokenizer"
    best = _first_informative(usable)
    return best, "graft" if best.informative else "graft_union"


def _first_informative(groups: list[RolloutGroup]) -> RolloutGroup:
    """The first informative group in serving order, else the first of all (the serving order is the store's, which
    the request names: the gate re-sorting them would undo a serving policy)."""
    return next((g for g in groups if g.informative), groups[0])


def gate_groups(
    learner_rewards: list[tuple[str, list[float | None]]],
    peer_candidates: dict[str, list[RolloutGroup]],
    rule: PeerLookupRequest | None,
    *,
    max_grafted_fraction: float,
    rng: random.Random,
    usable_tokenizers: set[str] | None = None,
    ranks: DistContext | None = None,
    trust_unverified_mu: bool = False,
) -> list[GateDecision]:
    """One decision per learner group, in order; `learner_rewards` holds (prompt id, rewards) per group.

    Mixed and all-success groups train on-policy; all-fail groups are grafted when an acceptable peer group
    arrived (`choose_peer_group` under `rule`; None: the gate is off, GRPO and DAPO), else skipped. At most
    floor(max_grafted_fraction * groups) are grafted; the rest of the candidates (chosen at random) are
    skipped as 'skip_capped'. trust_unverified_mu: graft.trust_unverified_mu (choose_peer_group). ranks: data parallel, the step's groups are all ranks', and this is a collective (one
    all_gather for the cap: every rank calls it together, with the same rng); None: one process."""
    now = now_us()
    decisions: list[GateDecision] = []
    for prompt_id, rewards in learner_rewards:
        kind = classify_group(rewards)
        if kind != "all_fail" or rule is None:
            decisions.append(GateDecision(prompt_id, kind, "onpolicy"))
            continue
        peer_group, action = choose_peer_group(peer_candidates.get(prompt_id, []), rule, usable_tokenizers, now,
                                               trust_unverified_mu)
        decisions.append(GateDecision(prompt_id, kind, action, peer_group))

    # The cap is the job's: this rank's grafts are its block of all ranks' grafts laid end to end (one process's
    # order), and every rank draws the same indices to skip from the same rng, as one process would.
    grafted = [d for d in decisions if d.grafts]
    grafts, groups = rank_spans(ranks or DistContext("none", torch.device("cpu")), [len(grafted), len(decisions)])
    cap = math.floor(max_grafted_fraction * groups.total + 1e-9)
    if grafts.total > cap:
        for index in rng.sample(range(grafts.total), grafts.total - cap):
            if grafts.offset <= index < grafts.offset + grafts.count:
                grafted[index - grafts.offset].action = "skip_capped"
    return decisions


# ---- the gate's tally: why the all-fail groups it did not graft got none -----------------------------------

# Why an all-fail group that the gate found no peer group for (skip_no_peer) got none: the store's miss reasons
# (graft.schemas.api.MISS_REASONS) but only_uninformative, which counts as groups_peer_uninformative; `unanswered`: the step's
# lookup failed, was late (peers.lookup_wait_s) or was not sent (backing off); `unknown`: the store gave no reason (a
# store older than miss_reasons). Metrics groups_no_peer_<reason>; they add up to groups_no_peer.
NO_PEER_REASONS = ("nothing_stored", "only_learner", "peers_not_admitted", "only_without_mu", "served_out", "unanswered",
                   "unknown")


def no_peer_reasons(decisions: list[GateDecision], found: LookupResult | None) -> tuple[dict[str, int], int]:
    """(count per NO_PEER_REASONS, count of only_uninformative) over the decisions the gate skipped for want of a
    peer group ("skip_no_peer"), from what the step's lookup said of each prompt."""
    counts = dict.fromkeys(NO_PEER_REASONS, 0)
    uninformative = 0
    for decision in decisions:
        if decision.action != "skip_no_peer":
            continue
        if found is None or not found.ok:
            counts["unanswered"] += 1
            continue
        reason = found.miss_reasons.get(decision.prompt_id)
        if reason == "only_uninformative":
            uninformative += 1
        elif reason in counts:
            counts[reason] += 1
        elif decision.prompt_id in found.groups:  # groups came back, the gate admitted none (older than max_age_s now)
            counts["peers_not_admitted"] += 1
        else:
            counts["unknown"] += 1
    return counts, uninformative


def gate_tally(decisions: list[GateDecision], found: LookupResult | None) -> dict[str, int]:
    """Why the gate skipped the groups it did not graft, the metrics graft-train and the TRL adapter log alike:
    groups_capped; groups_no_peer (no admitted peer group at all) with groups_no_peer_<reason> from the lookup's
    miss_reasons (no_peer_reasons); groups_peer_uninformative (admitted peer groups, none informative: the gate's own
    and the store's only_uninformative prompts); groups_no_peer_tokenizer."""
    actions = [d.action for d in decisions]
    no_peer, uninformative_stored = no_peer_reasons(decisions, found)
    return {
        "groups_capped": actions.count("skip_capped"),
        "groups_no_peer": actions.count("skip_no_peer") - uninformative_stored,
        "groups_peer_uninformative": actions.count("skip_uninformative") + uninformative_stored,
        **{f"groups_no_peer_{reason}": count for reason, count in no_peer.items()},
        "groups_no_peer_tokenizer": actions.count("skip_no_peer_tokenizer"),
    }


class RefusedTokenizers:
    """One warning per tokenizer id whose peer groups the gate refused for want of the peer's tokenizer."""

    def __init__(self, usable: set[str] | None):
        self.usable = usable
        self.warned: set[str] = set()

    def warn(self, decisions: list[GateDecision], peer_candidates: dict[str, list[RolloutGroup]]) -> None:
        if self.usable is None:
            return
        refused: dict[str, set[str]] = {}  # tokenizer id -> the models that sampled in it
        for decision in decisions:
            if decision.action == "skip_no_peer_tokenizer":
                for group in peer_candidates.get(decision.prompt_id, []):
                    refused.setdefault(group.rollouts[0].tokenizer_id, set()).add(group.model_id)
        for tokenizer_id, models in sorted(refused.items()):
            if tokenizer_id in self.usable or tokenizer_id in self.warned:
                continue
            self.warned.add(tokenizer_id)
            log.warning(
                "peer groups of %s are in tokenizer %r, for which this trainer has no tokenizer: they are refused "
                "(counted as groups_no_peer_tokenizer). Map that id to the peer's tokenizer or model directory: "
                "graft.peer_tokenizers: {%s: /path/to/peer} (or opt in to graft.uniform_projection, which spreads the "
                "peer's logprobs evenly over characters)", ", ".join(sorted(models)), tokenizer_id, tokenizer_id,
            )


# ---- peer advantages and the compatibility weights ----------------------------------------------------------

def peer_group_advantages(group: RolloutGroup, std_normalize: bool) -> tuple[list[float], bool]:
    """Advantages recomputed from the stored rewards, and whether they agree with the stored ones.

    The stored value may follow either convention (GRPO or Dr. GRPO); it agrees if it matches the
    convention it was written with. The recomputed value (this run's convention) is what trains."""
    rewards = [r.reward for r in group.rollouts]
    recomputed = group_advantages(rewards, std_normalize=std_normalize)
    stored = [r.advantage for r in group.rollouts]
    def close_to(expected: list[float]) -> bool:
        return all(abs(s - e) <= ADVANTAGE_TOLERANCE * max(1.0, abs(e)) for s, e in zip(stored, expected))

    agrees = any(close_to(group_advantages(rewards, std_normalize=norm)) for norm in (True, False))
    return recomputed, agrees


def compat_weights(
    learner_logprob_sum: Tensor, peer_logprob_sum: Tensor, num_bytes: Tensor, kappa: float, log_rho_min: float | None
) -> tuple[Tensor, Tensor]:
    """Sequence compatibility weights w and per-byte log rho (docs/algorithm.md section 4).

    learner_logprob_sum: (n,) float, l_old = sum log pi_old over the learner's content tokens (EOS excluded)
    peer_logprob_sum: (n,) float, l_peer = the stored logprob_sum (EOS excluded)
    num_bytes: (n,) int, UTF-8 length of each completion text
    Returns w (n,) = min(1, rho) ** kappa * 1[log rho >= log_rho_min] and log rho (n,), both detached."""
    log_ratio = learner_logprob_sum.detach().double() - peer_logprob_sum.double()  # (n,)
    per_byte = log_ratio / num_bytes.double().clamp(min=1.0)  # (n,)
    log_rho = per_byte.clamp(-LOG_RHO_CLAMP, LOG_RHO_CLAMP)  # (n,)
    weights = torch.exp(kappa * log_rho.clamp(max=0.0))  # (n,) = min(1, rho) ** kappa
    if log_rho_min is not None:
        weights = torch.where(log_rho >= log_rho_min, weights, torch.zeros_like(weights))
    return weights.float(), log_rho.float()


def centre_under_weights(advantages: Tensor, weights: Tensor, group_index: Tensor) -> Tensor:
    """Advantages centred under the sequence weights, per group (option graft.group_normalized_weight, docs/algorithm.md section 5):
    A' = A - sum_k w_k A_k / sum_k w_k over the group's rows, so that sum_j w_j A'_j = 0 and a token every row of the
    group shares (same b) gets no net push, as it gets none under plain GRPO. Dividing w by the group's mean w does not
    do that: it rescales every row by one constant.

    advantages, weights: (n,) float; group_index: (n,) int64 group of each row. A group whose weights are all zero
    keeps its advantages (its rows carry no weight anyway)."""
    num_groups = int(group_index.max()) + 1 if len(group_index) else 0
    zeros = torch.zeros(num_groups, dtype=torch.float64)  # (groups,)
    weight_sums = zeros.index_add(0, group_index, weights.double())  # (groups,)
    weighted_sums = zeros.index_add(0, group_index, (weights.double() * advantages.double()))  # (groups,)
    shift = torch.where(weight_sums > 0, weighted_sums / weight_sums.clamp(min=1e-300), torch.zeros_like(weight_sums))
    return (advantages.double() - shift[group_index]).to(advantages.dtype)  # (n,)


def behaviour_ratio(old_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated token behaviour ratio b = min(pi_old / mu~, C), detached.

    old_logprobs, behaviour_logprobs: (B, T) float, log pi_old and log mu~ of the learner's tokens.
    Returns (B, T) float."""
    log_b = (old_logprobs.detach() - behaviour_logprobs).clamp(max=math.log(cap))  # (B, T)
    return torch.exp(log_b)


def effective_sample_size(weights: Tensor) -> float:
    """Kish ESS of the weights as a fraction of their count: (sum w)^2 / (n * sum w^2), in [0, 1]."""
    if weights.numel() == 0:
        return float("nan")
    squares = float((weights.double() ** 2).sum())
    return float(weights.double().sum()) ** 2 / (weights.numel() * squares) if squares > 0 else 0.0
