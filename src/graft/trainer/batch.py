"""A step's batch: its rows (the learner's own rollouts and re-tokenised peer rollouts), pi_old and the weights
of grafted rows on them, padded tensors, and the policy's logprobs.

- `build_rows`: one TrainSample per learner or peer rollout, as the gate decided (docs/algorithm.md sections 2, 3).
- `old_logprobs_and_weights`: pi_old (and pi_ref) on every row with signal; on grafted rows the sequence
  weight w and the token correction b, so that c = w * b (sections 4, 5).
- `collate` and `response_logprobs`: rows to padded tensors, and log pi of each completion token.

Prompt and completion are tokenised separately and concatenated (a BPE can merge across the
boundary otherwise, and then the completion's tokens would not be the ones that were sampled).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from graft.schemas import Problem, RolloutGroup, group_advantages
from graft.trainer.config import TrainConfig
from graft.trainer.distributed import collective_passes, padding_pass
from graft.trainer.gate import (
    GateDecision,
    behaviour_ratio,
    centre_under_weights,
    compat_weights,
    effective_sample_size,
    peer_group_advantages,
)
from graft.trainer.retokenize import drop_counts, projection_counts, retokenize_peer_rollout

if TYPE_CHECKING:
    from graft.trainer.learner import Learner

NAN = float("nan")


@dataclass
class TrainSample:
    """One sequence of a step's batch: on-policy (the learner's own rollout) or grafted (a peer's)."""

    prompt_id: str
    group: int  # index of its group within the step (grafted groups are normalised together)
    prompt_ids: list[int]  # learner token ids of the prompt (the learner's own template)
    completion_ids: list[int]  # learner token ids of the completion, EOS included when it finished
    num_content_tokens: int  # completion tokens before the EOS (what l_old sums over)
    advantage: float  # on-policy: GRPO advantage; grafted: peer-computed over the group's kept rows (negatives scaled)
    grafted: bool
    num_bytes: int  # UTF-8 length of the completion text
    reward: float | None = None  # grafted: the peer rollout's stored reward (its advantage is recomputed from these)
    behaviour_logprobs: list[float] | None = None  # grafted: log mu~ per completion token (len(completion_ids))
    peer_logprob_sum: float = 0.0  # grafted: the stored l_peer (EOS excluded); NaN when the peer row has no mu
    # grafted: the peer row has no behaviour logprobs (logprobs_mode 'none', or stored ones that are not its mu:
    # schemas.mu_is_behaviour): b = 1 and w = 1 (docs/algorithm.md section 11)
    without_mu: bool = False
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
    # use_cache=False: a training forward has no next step to cache keys and values for
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits  # (B, L, V)
    predicting = (batch.response_positions - 1).clamp(min=0)  # (B, T): position whose logits predict each token
    picked = torch.gather(logits, 1, predicting[:, :, None].expand(-1, -1, logits.shape[-1]))  # (B, T, V)
    picked = picked.float() / temperature
    token_logprobs = torch.gather(picked.log_softmax(dim=-1), 2, batch.response_ids[:, :, None]).squeeze(-1)  # (B, T)
    return torch.where(batch.mask, token_logprobs, torch.zeros_like(token_logprobs))


# ---- the rows ------------------------------------------------------------------------------------

@dataclass
class PeerRowCounts:
    """What became of the peer rollouts of a step (graft-train) or of a generation batch (TRL, verl) on their way to
    learner rows: `build_rows`, `grafted_group_rows` and `peer_rows` add to it, and every trainer's metrics line reads it
    (`graft.trainer.metrics.graft_tally`)."""

    drops: dict[str, int] = field(default_factory=drop_counts)  # peer rollouts dropped, by reason (every reason present)
    projections: dict[str, int] = field(default_factory=projection_counts)  # peer rollouts kept, by projection
    # of those kept without mu (projection none), rows whose stored logprobs are not their mu (schemas.mu_is_behaviour:
    # 'raw' away from temperature 1 untruncated, rescored_unverified without graft.trust_unverified_mu)
    mu_set_aside: int = 0
    peer_samples: int = 0  # peer rollouts of the grafted groups (union: the peer's successes)
    peer_advantage_mismatch: int = 0  # grafted groups whose stored advantages are not their rewards' group advantages
    same_tokenizer_id_mismatch: int = 0  # same-tokenizer rows whose text does not re-tokenise to the stored ids
    grafted_groups_short: int = 0  # grafted groups that lost rows on the way (advantages recomputed over the rest)
    grafted_groups_subsampled: int = 0  # grafted groups larger than a host's slots, picked down (pick_rows)
    grafted_groups_no_signal: int = 0  # grafted groups whose rows that train have one reward: all advantages 0
    peer_rollouts_unused: int = 0  # a host's (TRL, verl): rows of peer groups larger than its G slots, beyond them


@dataclass
class StepRows:
    """The rows of a step, as `build_rows` made them, and what happened to the peer rollouts on the way."""

    rows: list[TrainSample]  # learner rows (every group, skipped ones with zero advantage) and grafted peer rows
    peer_groups_used: list[RolloutGroup]  # the peer groups grafted, in the order of the learner's groups
    counts: PeerRowCounts = field(default_factory=PeerRowCounts)


def build_rows(
    cfg: TrainConfig, learner: Learner, decisions: list[GateDecision], groups: list[RolloutGroup],
    problem_of: dict[str, Problem], peer_tokenizers: dict[str, Any],
) -> StepRows:
    """TrainSamples for the step: learner rows (on-policy, skipped with zero advantage) and peer rows.

    Skipped all-fail groups stay in the batch with zero advantage, exactly as GRPO has them: they
    add no gradient but count in the token-mean denominator, so GRAFT without peers is GRPO."""
    std_normalize = cfg.ppo.advantage == "grpo"
    prompt_ids_of: dict[str, list[int]] = {}
    out = StepRows([], [])

    def prompt_tokens(prompt_id: str) -> list[int]:
        if prompt_id not in prompt_ids_of:
            prompt_ids_of[prompt_id] = cfg.prompt.token_ids(learner.tokenizer, problem_of[prompt_id].problem)
        return prompt_ids_of[prompt_id]

    def learner_row(rollout, advantage: float, group_index: int) -> TrainSample:
        ids = list(rollout.completion_token_ids)
        finished_with_eos = rollout.finish_reason == "stop" and bool(ids) and ids[-1] in learner.eos_ids
        return TrainSample(prompt_id=rollout.prompt_id, group=group_index, prompt_ids=prompt_tokens(rollout.prompt_id),
                           completion_ids=ids, num_content_tokens=len(ids) - int(finished_with_eos),
                           advantage=advantage, grafted=False, num_bytes=rollout.num_bytes)

    for group_index, (decision, own) in enumerate(zip(decisions, groups, strict=True)):
        if not decision.grafts:
            advantages = group_advantages([r.reward for r in own.rollouts], std_normalize=std_normalize)
            out.rows.extend(learner_row(r, a, group_index) for r, a in zip(own.rollouts, advantages))
            continue
        peer = decision.peer_group
        out.peer_groups_used.append(peer)
        prompt_ids = prompt_tokens(decision.prompt_id)
        if decision.action == "graft":
            out.rows.extend(grafted_group_rows(cfg, learner, peer, group_index, prompt_ids, peer_tokenizers,
                                               learner.stop_token_id, out.counts))
            continue
        # union: the learner's failures and the peer's successes that survive re-tokenisation form one group
        successes = [r for r in peer.rollouts if r.correct]
        out.counts.peer_samples += len(successes)
        kept = peer_rows(cfg, learner, successes, decision.prompt_id, group_index, prompt_ids, peer_tokenizers,
                         learner.stop_token_id, out.counts)
        out.counts.grafted_groups_short += int(len(kept) < len(successes))
        union = group_advantages([r.reward for r in own.rollouts] + [row.reward for row in kept], std_normalize=std_normalize)
        out.rows.extend(learner_row(r, a, group_index) for r, a in zip(own.rollouts, union[: len(own.rollouts)]))
        out.rows.extend(_with_advantages(cfg, kept, union[len(own.rollouts):]))
    return out


def grafted_group_rows(
    cfg: TrainConfig, learner: Learner, peer: RolloutGroup, group: int, prompt_ids: list[int],
    peer_tokenizers: dict[str, Any], stop_token_id: int | None, counts: PeerRowCounts, max_rows: int | None = None,
    pick_seed: int = 0,
) -> list[TrainSample]:
    """A grafted peer group as learner rows (docs/algorithm.md sections 2, 3): re-tokenised (`peer_rows`), then
    `fit_grafted_group` (at most `max_rows` of them, advantages over those)."""
    rows = peer_rows(cfg, learner, list(peer.rollouts), peer.prompt_id, group, prompt_ids, peer_tokenizers,
                     stop_token_id, counts)
    return fit_grafted_group(cfg, peer, rows, counts, max_rows, pick_seed)


def fit_grafted_group(
    cfg: TrainConfig, peer: RolloutGroup, rows: list[TrainSample], counts: PeerRowCounts, max_rows: int | None = None,
    pick_seed: int = 0,
) -> list[TrainSample]:
    """`rows` (peer group `peer`'s re-tokenised rollouts, `peer_rows`, with their rewards as they stand: the stored
    ones, or a host's own reward of their text), at most `max_rows` of them (a host with that many slots for the group:
    TRL, verl; `pick_rows` chooses which, seeded by `pick_seed` and the group's id), with the group advantages
    recomputed from the rewards of the rows that train, so that they still sum to zero when a row was dropped or not
    picked, and negatives scaled.

    `counts` also gets: peer_samples, whether the stored advantages match the rewards
    (peer_advantage_mismatch, over the whole stored group), whether the group lost rows (grafted_groups_short), was
    picked down (grafted_groups_subsampled) or kept rows of one reward only (grafted_groups_no_signal)."""
    std_normalize = cfg.ppo.advantage == "grpo"
    _, agrees = peer_group_advantages(peer, std_normalize=std_normalize)
    counts.peer_advantage_mismatch += int(not agrees)
    counts.peer_samples += len(peer.rollouts)
    if max_rows is not None and len(rows) > max_rows:
        rows = pick_rows(rows, max_rows, random.Random(f"{pick_seed}:{peer.group_id}"))
        counts.grafted_groups_subsampled += 1
    counts.grafted_groups_short += int(len(rows) < len(peer.rollouts))
    counts.grafted_groups_no_signal += int(len({row.reward for row in rows}) < 2)
    return _with_advantages(cfg, rows, group_advantages([row.reward for row in rows], std_normalize=std_normalize))


def pick_rows(rows: list[TrainSample], max_rows: int, rng: random.Random) -> list[TrainSample]:
    """`max_rows` of a grafted group's rows, drawn with `rng`, keeping one of the best-rewarded and one of the
    worst-rewarded rows when max_rows >= 2 (a plain cut, or a plain draw, can keep only failures: advantages 0, the
    group grafted for nothing). The rows keep their stored order."""
    if max_rows < 1:
        raise ValueError(f"max_rows = {max_rows}: a grafted group needs at least one slot")
    rewards = [row.reward or 0.0 for row in rows]
    best = [i for i, r in enumerate(rewards) if r == max(rewards)]
    worst = [i for i, r in enumerate(rewards) if r == min(rewards)]
    chosen = {rng.choice(best)}
    if max_rows >= 2 and worst != best:
        chosen.add(rng.choice(worst))
    rest = [i for i in range(len(rows)) if i not in chosen]
    chosen.update(rng.sample(rest, max_rows - len(chosen)))
    return [rows[i] for i in sorted(chosen)]


def _with_advantages(cfg: TrainConfig, rows: list[TrainSample], advantages: list[float]) -> list[TrainSample]:
    """Set the grafted rows' advantages, negatives scaled by graft.peer_negative_scale."""
    for row, advantage in zip(rows, advantages, strict=True):
        row.advantage = advantage * cfg.graft.peer_negative_scale if advantage < 0 else advantage
    return rows


def peer_rows(
    cfg: TrainConfig, learner: Learner, rollouts: list, prompt_id: str, group: int, prompt_ids: list[int],
    peer_tokenizers: dict[str, Any], stop_token_id: int | None, counts: PeerRowCounts,
) -> list[TrainSample]:
    """Peer rollouts as learner rows, re-tokenised into the learner's tokens (ending with `stop_token_id`), each with its
    stored reward and advantage 0 (set by the caller over the rows that survive: `grafted_group_rows`). `counts`
    gets the dropped rows by reason, the projections and the same-tokenizer mismatches."""
    rows = []
    for rollout in rollouts:
        tokens = retokenize_peer_rollout(
            rollout, learner.tokenizer, learner.tokenizer_id, cfg.rollout.max_response_tokens,
            peer_tokenizers.get(rollout.tokenizer_id), stop_token_id=stop_token_id,
            uniform_projection=cfg.graft.uniform_projection, trust_unverified_mu=cfg.graft.trust_unverified_mu,
        )
        if isinstance(tokens, str):
            counts.drops[tokens] += 1
            continue
        counts.projections[tokens.projection] += 1
        counts.mu_set_aside += int(tokens.mu_set_aside)
        counts.same_tokenizer_id_mismatch += int(not tokens.canonical)
        rows.append(TrainSample(
            prompt_id=prompt_id, group=group, prompt_ids=prompt_ids, completion_ids=tokens.token_ids,
            num_content_tokens=tokens.num_content_tokens, advantage=0.0, grafted=True,
            num_bytes=len(rollout.completion_text.encode("utf-8")), reward=rollout.reward,
            behaviour_logprobs=tokens.behaviour_logprobs, without_mu=tokens.behaviour_logprobs is None,
            # a row without mu stores logprob_sum 0.0, one whose mu is set aside another model's: NaN here, so that
            # no sum can take either for an l_peer
            peer_logprob_sum=NAN if tokens.behaviour_logprobs is None else float(rollout.logprob_sum),
        ))
    return rows


def needs_forward(row: TrainSample, cfg: TrainConfig) -> bool:
    """Rows with zero advantage add nothing to the loss (unless a KL is on); with
    optim.skip_zero_advantage they get no forward pass (they still count in the normaliser).
    Grafted rows under graft.group_normalized_weight always get one: their w enters their group's
    centring, which must not depend on that speed switch."""
    return (not cfg.optim.skip_zero_advantage or row.advantage != 0.0 or cfg.ppo.kl_beta > 0
            or (row.grafted and cfg.graft.group_normalized_weight))


# ---- pi_old and the weights of grafted rows ------------------------------------------------------

@dataclass
class FirstPass:
    """The update's own forward pass, taken before pi_old is needed (`graft.trainer.update.single_pass_forward`)."""

    # the rows with signal when the pass ran, in the order of `logprobs` (none: a data-parallel rank's padding); the
    # non-finite grafted rows dropped after it stay here, so rows the update trains on may be fewer
    rows: list[TrainSample]
    tokens: TokenBatch | None
    logprobs: Tensor  # (b, T) float32, with grad (a padding forward's (1, 1, V) logits when there are no rows)

    def select(self, chunk: list[TrainSample]) -> tuple[Tensor, Tensor]:
        """(logprobs with grad, mask) of `chunk`'s rows, in its order."""
        position = {id(row): i for i, row in enumerate(self.rows)}
        index = torch.tensor([position[id(row)] for row in chunk], device=self.logprobs.device)
        return self.logprobs.index_select(0, index), self.tokens.mask.index_select(0, index)


@dataclass
class WeightStats:
    """The grafted rows' weights in a step (NaN when none was grafted): w's mean and effective sample size, the
    per-byte log rho's quantiles, and b = min(pi_old / mu~, C) over grafted tokens and, on each positive grafted
    row, at the token the learner finds least likely (where the peer's answer differs from the learner's habit):
    how much of the peer's signal the token-level correction lets through where it matters."""

    compat_weight_mean: float = NAN
    compat_weight_ess: float = NAN
    log_rho_p10: float = NAN
    log_rho_p50: float = NAN
    log_rho_p90: float = NAN
    behaviour_ratio_p50: float = NAN
    behaviour_ratio_hardest_p50: float = NAN

    @classmethod
    def of(cls, parts: list[GraftedWeights]) -> WeightStats:
        """The statistics over the grafted rows of `parts` (one per data-parallel rank, in rank order: one process's
        rows laid end to end), as one process computes them over its rows."""
        weights = _joined([part.weights for part in parts])  # (g,) float64, the finite rows' w
        if not weights.numel():
            return cls()
        levels = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
        log_rho = _joined([part.log_rho for part in parts])  # (g',) rows without mu have none
        quantiles = torch.quantile(log_rho, levels).tolist() if log_rho.numel() else [NAN] * 3
        ratios = [b for part in parts for b in part.ratios]
        hardest = [b for part in parts for b in part.hardest]
        return cls(
            compat_weight_mean=float(weights.mean()),
            compat_weight_ess=effective_sample_size(weights),
            log_rho_p10=quantiles[0], log_rho_p50=quantiles[1], log_rho_p90=quantiles[2],
            behaviour_ratio_p50=float(torch.cat(ratios).median()) if ratios else NAN,
            behaviour_ratio_hardest_p50=float(torch.tensor(hardest).median()) if hardest else NAN,
        )


@dataclass
class GraftedWeights:
    """What the step's WeightStats are computed from, per finite grafted row of this rank (data parallel: gathered
    from every rank first, graft.trainer.metrics)."""

    weights: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))  # (g,) w
    # (g',) per-byte log rho of the rows with mu
    log_rho: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    ratios: list[Tensor] = field(default_factory=list)  # b of every token (tis), one (n,) tensor per row
    hardest: list[float] = field(default_factory=list)  # b at the least likely token of each positive row (tis)


def _joined(tensors: list[Tensor]) -> Tensor:
    """One tensor of the pieces laid end to end (one piece: itself, so one process computes on what it always did)."""
    pieces = [t for t in tensors if t.numel()]
    return pieces[0] if len(pieces) == 1 else torch.cat(tensors)


@dataclass
class WeightedRows:
    """The rows the update trains on, with pi_old, pi_ref and the token weights c filled in."""

    rows: list[TrainSample]  # grafted rows with non-finite pi_old or w are dropped
    dropped_non_finite: int
    grafted: GraftedWeights = field(default_factory=GraftedWeights)

    @property
    def stats(self) -> WeightStats:
        """The weight statistics of this rank's grafted rows."""
        return WeightStats.of([self.grafted])


@torch.no_grad()
def forward_logprobs(
    model: torch.nn.Module, rows: list[TrainSample], learner: Learner, micro: int, temperature: float
) -> list[Tensor]:
    """Per row (n_i,) float32 logprobs of its completion tokens, computed in micro-batches. Under fsdp every rank
    runs as many passes as the rank with the most (graft.trainer.distributed.collective_passes), the rest padding."""
    out: list[Tensor] = []
    chunks = [rows[begin : begin + micro] for begin in range(0, len(rows), micro)]
    passes = collective_passes(learner.dist, len(chunks))  # agreed before any pass: each is a collective under fsdp
    for chunk in chunks:
        batch = collate(chunk, learner.tokenizer.pad_token_id).to(learner.device)
        with learner.autocast():
            logprobs = response_logprobs(model, batch, temperature).cpu()  # (b, T)
        out.extend(logprobs[i, : len(row.completion_ids)] for i, row in enumerate(chunk))
    for _ in range(passes - len(chunks)):
        with learner.autocast():
            padding_pass(model, learner.device, backward=False)
    return out


def old_logprobs_and_weights(
    cfg: TrainConfig, learner: Learner, reference: torch.nn.Module | None, rows: list[TrainSample],
    first_pass: FirstPass | None = None,
) -> WeightedRows:
    """pi_old (and pi_ref) for every row with signal; token weights c = w * b on grafted rows.

    pi_old comes from `first_pass` when the update took its forward already (its rows are the ones with
    signal), else from a no-grad pass. Grafted rows whose pi_old or w is not finite are dropped (counted)."""
    if first_pass is not None:
        active = first_pass.rows
        detached = first_pass.logprobs.detach().cpu()  # (b, T)
        old = [detached[i, : len(row.completion_ids)] for i, row in enumerate(active)]
    else:
        active = [row for row in rows if needs_forward(row, cfg)]
        old = forward_logprobs(learner.hf_model, active, learner, cfg.optim.micro_batch_size, cfg.rollout.temperature)
    refs: list[Tensor | None] = [None] * len(active)
    if reference is not None:
        # at the rollout temperature, as the policy's: the KL compares the two distributions the loss sees
        refs = forward_logprobs(reference, active, learner, cfg.optim.micro_batch_size, cfg.rollout.temperature)
    for row, old_lp, ref_lp in zip(active, old, refs):
        row.old_logprobs, row.ref_logprobs = old_lp, ref_lp
        row.token_weight = torch.ones_like(old_lp)

    grafted = [row for row in active if row.grafted]
    values = weigh_grafted_rows(cfg, grafted) if grafted else GraftedWeights()
    kept = [row for row in rows if not (row.grafted and not row.finite)]
    return WeightedRows(kept, len(rows) - len(kept), values)


def weigh_grafted_rows(cfg: TrainConfig, grafted: list[TrainSample]) -> GraftedWeights:
    """Set w, finiteness and c = peer_loss_scale * w * b on the grafted rows (pi_old filled in); what their
    statistics are computed from. A row without mu gets w = 1 and b = 1 (docs/algorithm.md section 11: l_peer and mu~ are
    unknown), under every token_is; its log rho is left out of the statistics, its w = 1 is not."""
    # l_old: the learner's log-likelihood of the text, EOS excluded
    learner_sums = torch.stack([r.old_logprobs[: r.num_content_tokens].double().sum() for r in grafted])  # (g,)
    peer_sums = torch.tensor([row.peer_logprob_sum for row in grafted], dtype=torch.float64)  # (g,)
    num_bytes = torch.tensor([row.num_bytes for row in grafted])  # (g,)
    weights, log_rho = compat_weights(learner_sums, peer_sums, num_bytes, cfg.graft.kappa, cfg.graft.log_rho_min)
    without_mu = torch.tensor([row.without_mu for row in grafted])  # (g,) bool
    weights = torch.where(without_mu, torch.ones_like(weights), weights)  # their l_peer is NaN: w = 1 instead
    finite = torch.isfinite(learner_sums) & torch.isfinite(weights)
    if cfg.graft.group_normalized_weight:  # over the rows that train (the non-finite ones are dropped below)
        kept = [row for row, ok in zip(grafted, finite.tolist()) if ok]
        if kept:
            centred = centre_under_weights(torch.tensor([row.advantage for row in kept], dtype=torch.float64), weights[finite],
                                           torch.tensor([row.group for row in kept]))
            for row, advantage in zip(kept, centred.tolist()):
                row.advantage = advantage
    ratios: list[Tensor] = []
    hardest: list[float] = []
    for row, w, ok in zip(grafted, weights.tolist(), finite.tolist()):
        row.compat_weight = w
        row.finite = bool(ok) and bool(torch.isfinite(row.old_logprobs).all())
        # b, the token-level correction, exists under tis only (luffy's shaping replaces the PPO ratio and needs
        # no peer probabilities); the sequence weight w applies under every token_is, as kappa etc. say.
        b = torch.ones_like(row.old_logprobs)  # (n,)
        if cfg.graft.token_is == "tis" and not row.without_mu:
            behaviour = torch.tensor(row.behaviour_logprobs, dtype=torch.float32)  # (n,) log mu~
            b = behaviour_ratio(row.old_logprobs, behaviour, cfg.graft.is_cap)
            if row.finite:
                ratios.append(b)
                if row.advantage > 0 and row.num_content_tokens > 0:
                    hardest.append(float(b[int(torch.argmin(row.old_logprobs[: row.num_content_tokens]))]))
        row.token_weight = cfg.graft.peer_loss_scale * w * b  # (n,)
    return GraftedWeights(weights[finite], log_rho[finite & ~without_mu].double(), ratios, hardest)
